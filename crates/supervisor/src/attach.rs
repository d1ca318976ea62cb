//! Applications attached to a device or a view (`bulkhead_client::attach`): their queues in
//! the slots the device's domain keeps for them, and the conversation with each.
//!
//! `serve` never maps an attached queue: it checks the descriptors the application sent (memory
//! files sealed against shrinking, of the sizes the geometry needs; eventfds), hands them to
//! the domain on its attach line, and keeps copies so that each new generation of the domain
//! gets them again once the application has started its queues over.

use crate::error::Error;
use std::collections::BTreeMap;
use std::io::Write;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use bulkhead_channel::BackQueueFds;
use bulkhead_client::attach::wire::{FromApp, FromServe, Offer};
use bulkhead_spec::attach_line::{FromDomain, ToDomain, MAX_MESSAGE};

/// How long the domain may take to answer on its attach line.
const LINE_WAIT: Duration = Duration::from_secs(2);

/// How long an application may take to start its queues over for a new domain.
const RESTART_WAIT: Duration = Duration::from_secs(1);

/// One attached application.
#[derive(Debug)]
pub(crate) struct Session {
    /// The device or view it attached to.
    target: String,
    /// Its process and user, as the socket says.
    pid: i32,
    uid: u32,
    /// Writes to it (events).
    conn: Mutex<UnixStream>,
    /// Its queues: slot (renumbered when a view before it goes) and the domain's descriptors.
    queues: Vec<(AtomicUsize, BackQueueFds)>,
    generation: Mutex<u32>,
    /// Its answer to the last restart.
    ack: Mutex<Option<Result<u32, Error>>>,
    acked: Condvar,
    /// It was let go of (it broke a ring, or did not follow a restart): its slots are free.
    dropped: AtomicBool,
}

impl Session {
    fn tell(&self, msg: &FromServe) -> std::io::Result<()> {
        let mut line = serde_json::to_vec(msg).expect("message serialises");
        line.push(b'\n');
        self.conn.lock().unwrap_or_else(|e| e.into_inner()).write_all(&line)
    }

    /// Ends the conversation: the application's follower sees it close.
    fn hang_up(&self) {
        let _ = self.conn.lock().unwrap_or_else(|e| e.into_inner()).shutdown(std::net::Shutdown::Both);
    }

    /// The slots its queues hold.
    pub(crate) fn slots(&self) -> Vec<u32> {
        self.slot_list().into_iter().map(|s| s as u32).collect()
    }

    fn slot_list(&self) -> Vec<usize> {
        self.queues.iter().map(|(slot, _)| slot.load(Ordering::Acquire)).collect()
    }

    /// Records the application's answer to a restart (from the thread reading its connection).
    pub(crate) fn answered(&self, a: Result<u32, Error>) {
        *self.ack.lock().unwrap_or_else(|e| e.into_inner()) = Some(a);
        self.acked.notify_all();
    }
}

pub use bulkhead_control::AttachedStatus;

#[derive(Debug, Default)]
struct Inner {
    /// The supervisor's end of the current domain's line (`None` between generations).
    line: Option<Arc<OwnedFd>>,
    /// The view each slot serves (`None`: the device).
    slots: Vec<Option<u32>>,
    /// Who holds each slot (a session, or one joining).
    owners: Vec<Option<u64>>,
    sessions: BTreeMap<u64, Arc<Session>>,
    next: u64,
}

/// The attach slots of one device and its views.
///
/// Joining, leaving and rejoining run one at a time, each under the device's claim; they talk
/// to the domain and to applications with no lock held, so `status` and the watcher read the
/// sessions while they wait.
#[derive(Debug)]
pub(crate) struct AttachPoint {
    device: String,
    inner: Mutex<Inner>,
}

/// Sends `msg` (with `fds`) on `line` and waits for the domain's answer about the same slot.
/// Other slots' refusals that come meanwhile (queues the domain let go of because their
/// application broke the ring) are added to `evicted`.
fn ask(line: &OwnedFd, msg: ToDomain, fds: &[BorrowedFd<'_>], evicted: &mut Vec<u32>) -> Result<FromDomain, Error> {
    let slot = match msg {
        ToDomain::Add { slot } | ToDomain::Remove { slot } => slot,
    };
    let bytes = serde_json::to_vec(&msg).expect("message serialises");
    bulkhead_sys::send_with_fds(line.as_fd(), &bytes, fds, false).map_err(|e| Error::failed(format!("attach line: {e}")))?;
    answer_about(line, slot, evicted)
}

/// Waits for the domain's next message about `slot` on `line` (others' refusals go to
/// `evicted`, as in [`ask`]).
fn answer_about(line: &OwnedFd, slot: u32, evicted: &mut Vec<u32>) -> Result<FromDomain, Error> {
    let deadline = Instant::now() + LINE_WAIT;
    let mut buf = [0u8; MAX_MESSAGE];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(Error::failed("the domain did not answer on its attach line"));
        }
        let mut pfd = [libc::pollfd { fd: line.as_raw_fd(), events: libc::POLLIN, revents: 0 }];
        bulkhead_sys::poll(&mut pfd, left.as_millis().max(1) as i32).map_err(|e| Error::failed(format!("attach line: {e}")))?;
        let (n, _) = match bulkhead_sys::recv_with_fds(line.as_fd(), &mut buf, false) {
            Ok(Some((0, _))) => return Err(Error::failed("the domain hung up its attach line")),
            Ok(Some(got)) => got,
            Ok(None) => continue,
            Err(e) => return Err(Error::failed(format!("attach line: {e}"))),
        };
        let answer: FromDomain = serde_json::from_slice(&buf[..n]).map_err(|e| Error::failed(format!("attach line: {e}")))?;
        let about = match &answer {
            FromDomain::Added { slot } | FromDomain::Removed { slot } | FromDomain::Refused { slot, .. } => *slot,
        };
        if about == slot {
            return Ok(answer);
        }
        if let FromDomain::Refused { slot, why } = answer {
            log::info!("attach slot {slot}: the domain let go of it: {why}");
            evicted.push(slot);
        }
    }
}

impl AttachPoint {
    /// Slots for `device`, each serving the view given (`None`: the device).
    pub(crate) fn new(device: &str, slots: Vec<Option<u32>>) -> Self {
        let owners = vec![None; slots.len()];
        AttachPoint { device: device.to_string(), inner: Mutex::new(Inner { slots, owners, ..Default::default() }) }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Lets go of the sessions holding `evicted` slots: their applications are told by the
    /// connection closing, and detach as any other.
    fn drop_evicted(&self, evicted: &[u32]) {
        if evicted.is_empty() {
            return;
        }
        let inner = self.lock();
        for &slot in evicted {
            if let Some(s) = inner.owners.get(slot as usize).copied().flatten().and_then(|id| inner.sessions.get(&id)) {
                s.hang_up();
            }
        }
    }

    /// Free slots for `view`.
    pub(crate) fn free(&self, view: Option<u32>) -> usize {
        let inner = self.lock();
        inner.slots.iter().zip(&inner.owners).filter(|(v, o)| **v == view && o.is_none()).count()
    }

    /// Adds `queues` (checked) to free slots of `view` in the running domain. The caller holds
    /// the device's claim.
    pub(crate) fn join(
        &self,
        target: &str,
        view: Option<u32>,
        conn: &UnixStream,
        queues: Vec<BackQueueFds>,
    ) -> Result<(u64, Arc<Session>), Error> {
        // Take the slots, then ask the domain with nothing locked.
        let (id, line, free) = {
            let mut inner = self.lock();
            let Some(line) = inner.line.clone() else {
                return Err(Error::busy(format!("device {} has no running domain", self.device)));
            };
            let free: Vec<usize> = (0..inner.slots.len())
                .filter(|&i| inner.slots[i] == view && inner.owners[i].is_none())
                .take(queues.len())
                .collect();
            if free.len() < queues.len() {
                return Err(Error::in_use(format!(
                    "{target}: {} attach slot(s) free, {} asked (its `attach` key sets how many)",
                    free.len(),
                    queues.len()
                )));
            }
            let id = inner.next;
            inner.next += 1;
            for &slot in &free {
                inner.owners[slot] = Some(id);
            }
            (id, line, free)
        };
        let mut evicted = Vec::new();
        let mut added = Vec::new();
        let mut failed = None;
        for (&slot, q) in free.iter().zip(&queues) {
            let fds = q.as_array().map(|fd| fd.as_fd());
            match ask(&line, ToDomain::Add { slot: slot as u32 }, &fds, &mut evicted) {
                Ok(FromDomain::Added { .. }) => added.push(slot),
                Ok(FromDomain::Refused { why, .. }) => {
                    failed = Some(Error::invalid(format!("the domain refused the queue: {why}")));
                    break;
                }
                Ok(other) => {
                    failed = Some(Error::failed(format!("the domain answered {other:?}")));
                    break;
                }
                Err(e) => {
                    failed = Some(e);
                    break;
                }
            }
        }
        let session = match failed {
            Some(why) => Err(why),
            None => {
                let (pid, uid) = bulkhead_sys::peer_credentials(conn.as_fd()).unwrap_or((0, 0));
                conn.try_clone().map_err(|e| Error::failed(e.to_string())).map(|conn| {
                    Arc::new(Session {
                        target: target.to_string(),
                        pid,
                        uid,
                        conn: Mutex::new(conn),
                        queues: free.iter().map(|&s| AtomicUsize::new(s)).zip(queues).collect(),
                        generation: Mutex::new(1),
                        ack: Mutex::new(None),
                        acked: Condvar::new(),
                        dropped: AtomicBool::new(false),
                    })
                })
            }
        };
        match session {
            Ok(session) => {
                self.lock().sessions.insert(id, session.clone());
                self.drop_evicted(&evicted);
                Ok((id, session))
            }
            Err(why) => {
                for slot in added {
                    let _ = ask(&line, ToDomain::Remove { slot: slot as u32 }, &[], &mut evicted);
                }
                self.release(id, &free);
                self.drop_evicted(&evicted);
                Err(why)
            }
        }
    }

    /// Frees the slots of `slots` that session `id` holds.
    fn release(&self, id: u64, slots: &[usize]) {
        let mut inner = self.lock();
        for &slot in slots {
            if let Some(owner @ Some(_)) = inner.owners.get_mut(slot).filter(|o| **o == Some(id)) {
                *owner = None;
            }
        }
    }

    /// Takes session `id`'s queues out of the domain and frees its slots; it is listed until
    /// the domain has let them go. The caller holds the device's claim.
    pub(crate) fn leave(&self, id: u64) {
        let (session, line) = {
            let inner = self.lock();
            let Some(session) = inner.sessions.get(&id).cloned() else { return };
            (session, inner.line.clone())
        };
        let mut evicted = Vec::new();
        if let (false, Some(line)) = (session.dropped.load(Ordering::Acquire), line) {
            for slot in session.slot_list() {
                let slot = slot as u32;
                // A refusal here is the domain's own earlier notice that it let the queue go (a
                // broken ring): the removal's answer comes after it.
                let answer = match ask(&line, ToDomain::Remove { slot }, &[], &mut evicted) {
                    Ok(FromDomain::Refused { .. }) => answer_about(&line, slot, &mut evicted),
                    other => other,
                };
                if let Err(e) = answer {
                    // The domain is dying or wedged; its successor will not get the queue.
                    log::info!("device {}: detaching slot {slot}: {e}", self.device);
                    break;
                }
            }
        }
        self.lock().sessions.remove(&id);
        self.release(id, &session.slot_list());
        self.drop_evicted(&evicted);
    }

    /// A new generation of the domain runs with `line`: each application starts its queues
    /// over in place, and the new domain takes them. An application that does not follow in
    /// time is let go of. The caller holds the device's claim, and the old domain is gone.
    pub(crate) fn rejoin(&self, line: Option<OwnedFd>) {
        let line = line.map(Arc::new);
        let sessions: Vec<(u64, Arc<Session>)> = {
            let mut inner = self.lock();
            inner.line = line.clone();
            inner.sessions.iter().map(|(id, s)| (*id, s.clone())).collect()
        };
        let mut evicted = Vec::new();
        for (id, s) in sessions {
            if s.dropped.load(Ordering::Acquire) {
                continue;
            }
            if let Err(why) = Self::restart_one(line.as_deref(), &s, &mut evicted) {
                log::info!("device {}: attached pid {} let go of: {why}", self.device, s.pid);
                s.dropped.store(true, Ordering::Release);
                s.hang_up();
                // Whatever of its queues the new domain took already, it lets go of.
                if let Some(line) = line.as_deref() {
                    for slot in s.slot_list() {
                        let _ = ask(line, ToDomain::Remove { slot: slot as u32 }, &[], &mut evicted);
                    }
                }
                self.release(id, &s.slot_list());
            }
        }
        self.drop_evicted(&evicted);
    }

    fn restart_one(line: Option<&OwnedFd>, s: &Session, evicted: &mut Vec<u32>) -> Result<(), Error> {
        let line = line.ok_or_else(|| Error::failed("no domain runs"))?;
        let generation = {
            let mut g = s.generation.lock().unwrap_or_else(|e| e.into_inner());
            *g = g.wrapping_add(1).max(1);
            *g
        };
        *s.ack.lock().unwrap_or_else(|e| e.into_inner()) = None;
        s.tell(&FromServe::Restart { generation }).map_err(|e| Error::failed(format!("cannot tell it of the restart: {e}")))?;
        let ack = s.ack.lock().unwrap_or_else(|e| e.into_inner());
        let (ack, _) = s.acked.wait_timeout_while(ack, RESTART_WAIT, |a| a.is_none()).unwrap_or_else(|e| e.into_inner());
        match ack.clone() {
            Some(Ok(g)) if g == generation => {}
            Some(Ok(g)) => return Err(Error::failed(format!("it started over as generation {g}, not {generation}"))),
            Some(Err(why)) => return Err(Error::failed(format!("it could not start over: {why}"))),
            None => return Err(Error::failed(format!("it did not start over within {} ms", RESTART_WAIT.as_millis()))),
        }
        drop(ack);
        for (slot, q) in &s.queues {
            let fds = q.as_array().map(|fd| fd.as_fd());
            match ask(line, ToDomain::Add { slot: slot.load(Ordering::Acquire) as u32 }, &fds, evicted)? {
                FromDomain::Added { .. } => {}
                other => return Err(Error::failed(format!("the new domain answered {other:?}"))),
            }
        }
        Ok(())
    }

    /// Adds `n` slots for view `view`, new to the layout, after the others. The caller holds
    /// the device's claim.
    pub(crate) fn add_view(&self, view: u32, n: usize) {
        let mut inner = self.lock();
        inner.slots.extend(std::iter::repeat_n(Some(view), n));
        inner.owners.extend(std::iter::repeat_n(None, n));
    }

    /// Takes view `view`'s slots out, and numbers the later views and slots down, sessions'
    /// slots with them. None of its slots is held (its sessions were let go of). The caller
    /// holds the device's claim, and no domain runs: the next one gets the new numbers.
    pub(crate) fn remove_view(&self, view: u32) {
        let mut inner = self.lock();
        let old = std::mem::take(&mut inner.slots);
        let owners = std::mem::take(&mut inner.owners);
        // Each old slot's new number, if it stays.
        let mut renumber = Vec::with_capacity(old.len());
        for (v, owner) in old.into_iter().zip(owners) {
            if v == Some(view) {
                renumber.push(None);
                continue;
            }
            renumber.push(Some(inner.slots.len()));
            inner.slots.push(v.map(|v| if v > view { v - 1 } else { v }));
            inner.owners.push(owner);
        }
        for s in inner.sessions.values() {
            for (slot, _) in &s.queues {
                let was = slot.load(Ordering::Acquire);
                // A session let go of keeps numbers no one holds.
                let now = renumber.get(was).copied().flatten().unwrap_or(usize::MAX);
                slot.store(now, Ordering::Release);
            }
        }
    }

    /// Applications attached to `target` (a view).
    pub(crate) fn attached_to(&self, target: &str) -> usize {
        self.lock().sessions.values().filter(|s| s.target == target && !s.dropped.load(Ordering::Acquire)).count()
    }

    /// Lets go of the applications attached to `target`, telling them `reason`: their slots
    /// are free, and no later domain takes their queues. The caller holds the device's claim.
    pub(crate) fn cut_off(&self, target: &str, reason: &str) {
        let sessions: Vec<(u64, Arc<Session>)> =
            self.lock().sessions.iter().filter(|(_, s)| s.target == target).map(|(id, s)| (*id, s.clone())).collect();
        for (id, s) in sessions {
            let _ = s.tell(&FromServe::Fail { reason: reason.to_string() });
            s.dropped.store(true, Ordering::Release);
            s.hang_up();
            self.release(id, &s.slot_list());
        }
    }

    /// Tells every attached application that the device failed.
    pub(crate) fn fail(&self, reason: &str) {
        let sessions: Vec<Arc<Session>> = self.lock().sessions.values().cloned().collect();
        for s in sessions {
            let _ = s.tell(&FromServe::Fail { reason: reason.to_string() });
        }
    }

    /// How many applications are attached.
    pub(crate) fn attached(&self) -> usize {
        self.lock().sessions.values().filter(|s| !s.dropped.load(Ordering::Acquire)).count()
    }

    /// The attached applications.
    pub(crate) fn status(&self) -> Vec<AttachedStatus> {
        let inner = self.lock();
        inner
            .sessions
            .values()
            .filter(|s| !s.dropped.load(Ordering::Acquire))
            .map(|s| AttachedStatus { name: s.target.clone(), pid: s.pid, uid: s.uid, slots: s.slots() })
            .collect()
    }
}

/// What an application must be told before it makes its queues.
pub(crate) fn offer(size: u64, qcfg: &bulkhead_channel::QueueConfig, read_only: bool, min_block: u32) -> Offer {
    Offer {
        size,
        nslots: qcfg.nslots,
        arena_bytes: qcfg.arena_bytes as u64,
        mode: qcfg.mode.as_str().to_string(),
        budget_ns: match qcfg.budget {
            bulkhead_doorbell::BudgetPolicy::Fixed(ns) => Some(ns),
            bulkhead_doorbell::BudgetPolicy::Auto { .. } => None,
        },
        read_only,
        min_block,
    }
}

/// Checks the five descriptors of one queue an application sent: the ring and arenas must be
/// memory files that can no longer shrink (the domain maps them: a file cut short under it
/// would kill it), of at least the sizes of the geometry; the doorbells eventfds.
pub(crate) fn check_queue(fds: &BackQueueFds, nslots: u32, arena_bytes: u64) -> Result<(), Error> {
    let ring = bulkhead_ring::RingLayout::new(nslots).map_err(|e| Error::invalid(e.to_string()))?.file_size() as u64;
    let arena = arena_bytes.next_multiple_of(bulkhead_shmem::PAGE_SIZE as u64);
    for (what, fd, want) in
        [("ring", &fds.ring, ring), ("write arena", &fds.write_arena, arena), ("read arena", &fds.read_arena, arena)]
    {
        let seals = bulkhead_shmem::memfd::seals(fd.as_raw_fd())
            .map_err(|e| Error::invalid(format!("{what}: not a sealed memory file ({e})")))?;
        if seals & libc::F_SEAL_SHRINK == 0 {
            return Err(Error::invalid(format!("{what}: not sealed against shrinking")));
        }
        let have = bulkhead_shmem::memfd::size_of(fd.as_raw_fd()).map_err(|e| Error::invalid(format!("{what}: {e}")))?;
        if have < want {
            return Err(Error::invalid(format!("{what}: {have} bytes, the geometry needs {want}")));
        }
    }
    for (what, fd) in [("kick doorbell", &fds.kick), ("irq doorbell", &fds.irq)] {
        let link = std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd()))
            .map_err(|e| Error::invalid(format!("{what}: {e}")))?;
        if link.as_os_str() != "anon_inode:[eventfd]" {
            return Err(Error::invalid(format!("{what}: not an eventfd ({})", link.display())));
        }
    }
    Ok(())
}

/// Takes five descriptors at a time as queues.
pub(crate) fn queues_from(fds: Vec<OwnedFd>, count: u32) -> Result<Vec<BackQueueFds>, Error> {
    if fds.len() != count as usize * 5 {
        return Err(Error::invalid(format!("{} descriptors for {count} queue(s): five each", fds.len())));
    }
    let mut it = fds.into_iter();
    let mut out = Vec::with_capacity(count as usize);
    while let (Some(ring), Some(write_arena), Some(read_arena), Some(kick), Some(irq)) =
        (it.next(), it.next(), it.next(), it.next(), it.next())
    {
        out.push(BackQueueFds { ring, write_arena, read_arena, kick, irq });
    }
    Ok(out)
}

/// Reads the application's answers to restarts until it hangs up.
pub(crate) fn listen(mut conn: UnixStream, session: &Session) {
    let _ = conn.set_read_timeout(None);
    loop {
        let line = match bulkhead_client::attach::read_line(&mut conn) {
            Ok(Some(l)) => l,
            Ok(None) | Err(_) => return,
        };
        match serde_json::from_str::<FromApp>(&line) {
            Ok(FromApp::Restarted { generation }) => session.answered(Ok(generation)),
            Ok(FromApp::Refused { why }) => session.answered(Err(Error::failed(why))),
            Ok(FromApp::Queues { .. }) | Err(_) => {
                session.answered(Err(Error::failed("unexpected message")));
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bulkhead_channel::{QueueConfig, QueueSetup};

    fn queue(cfg: &QueueConfig) -> BackQueueFds {
        QueueSetup::create("attach-test", cfg).unwrap().1
    }

    #[test]
    fn queues_come_five_descriptors_each() {
        let q = queue(&QueueConfig::default());
        let fds: Vec<OwnedFd> = q.as_array().iter().map(|fd| fd.try_clone().unwrap()).collect();
        assert_eq!(queues_from(fds, 1).unwrap().len(), 1);
        let four: Vec<OwnedFd> = q.as_array().iter().take(4).map(|fd| fd.try_clone().unwrap()).collect();
        assert!(queues_from(four, 1).unwrap_err().message().contains("five each"));
    }

    #[test]
    fn an_applications_queue_is_checked_against_the_geometry_and_the_kinds_of_its_descriptors() {
        let cfg = QueueConfig::default();
        let good = queue(&cfg);
        check_queue(&good, cfg.nslots, cfg.arena_bytes as u64).unwrap();
        // Arenas smaller than the geometry asks.
        let e = check_queue(&good, cfg.nslots, 2 * cfg.arena_bytes as u64).unwrap_err();
        assert!(e.message().contains("write arena") && e.message().contains("the geometry needs"), "{e}");
        // A doorbell that is not an eventfd.
        let (r, _w) = bulkhead_sys::pipe().unwrap();
        let BackQueueFds { ring, write_arena, read_arena, irq, .. } = queue(&cfg);
        let bad = BackQueueFds { ring, write_arena, read_arena, kick: r, irq };
        assert!(check_queue(&bad, cfg.nslots, cfg.arena_bytes as u64)
            .unwrap_err()
            .message()
            .contains("kick doorbell: not an eventfd"));
        // A ring that is not a sealed memory file.
        let f = std::fs::File::open("/dev/null").unwrap();
        let BackQueueFds { write_arena, read_arena, kick, irq, .. } = queue(&cfg);
        let bad = BackQueueFds { ring: f.into(), write_arena, read_arena, kick, irq };
        assert!(check_queue(&bad, cfg.nslots, cfg.arena_bytes as u64)
            .unwrap_err()
            .message()
            .starts_with("ring: not a sealed memory file"));
    }

    #[test]
    fn joining_a_device_with_no_running_domain_is_refused_and_frees_nothing() {
        let point = AttachPoint::new("d", vec![None, None, Some(0)]);
        assert_eq!((point.free(None), point.free(Some(0))), (2, 1));
        let (a, _b) = UnixStream::pair().unwrap();
        let e = point.join("d", None, &a, vec![queue(&QueueConfig::default())]).unwrap_err();
        assert!(e.message().contains("no running domain"), "{e}");
        assert_eq!(point.free(None), 2);
        assert_eq!((point.attached(), point.status().len()), (0, 0));
    }

    #[test]
    fn the_offer_carries_the_geometry_and_the_modes() {
        let cfg = QueueConfig::default();
        let o = offer(1 << 30, &cfg, true, 4096);
        assert_eq!(
            (o.size, o.nslots, o.arena_bytes, o.read_only, o.min_block),
            (1 << 30, cfg.nslots, cfg.arena_bytes as u64, true, 4096)
        );
        assert_eq!(o.mode, cfg.mode.as_str());
    }

    #[test]
    fn a_view_removed_takes_its_slots_and_the_later_views_move_down() {
        // The device's slot, then views 0, 1 and 2; view 3 comes later.
        let point = AttachPoint::new("d", vec![None, Some(0), Some(0), Some(1), Some(2)]);
        point.add_view(3, 2);
        assert_eq!((point.free(Some(3)), point.free(None)), (2, 1));
        // A slot of view 1 is held; view 0 goes.
        point.lock().owners[3] = Some(7);
        point.remove_view(0);
        let inner = point.lock();
        assert_eq!(inner.slots, [None, Some(0), Some(1), Some(2), Some(2)]);
        assert_eq!(inner.owners, [None, Some(7), None, None, None], "the holder keeps its slot, renumbered");
        drop(inner);
        assert_eq!((point.free(Some(0)), point.free(Some(2)), point.free(Some(3))), (0, 2, 0));
    }
}
