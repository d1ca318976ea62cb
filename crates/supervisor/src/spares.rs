//! Spare domains: a few `bulkhead spare` processes started ahead of need, each already in its
//! namespaces, its empty root, its rlimits, no_new_privs, Landlock and a first seccomp filter
//! ([`bulkhead_sandbox::spare`]), waiting on a line of its own. When a device needs a domain
//! (a restart, a new generation) it takes one and hands it the spec and descriptors an exec
//! would have passed ([`bulkhead_spec::handover`]); the spare narrows itself to the role's
//! sandbox and reports as an exec'd domain does. A keeper thread starts another in the
//! background, and replaces one that dies while it waits. With none ready, a domain is exec'd
//! as before.
//!
//! The keeper thread starts every spare, so the spares (and the domains they become) die with
//! it (PR_SET_PDEATHSIG): it lives until [`Spares::stop`], which `serve` calls once every
//! device's domains have ended.

use std::collections::VecDeque;
use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use bulkhead_sandbox::spawn::DomainChild;
use bulkhead_sandbox::Layer;
use bulkhead_spec::handover;
use bulkhead_sys::eventfd::EventFd;

use crate::domain_log;
use crate::error::Error;
use crate::reap::{discard, EXIT_WAIT};

/// Spaces after `spare` on a spare's command line, where it writes the words of the domain it
/// becomes: `driver`, a device name (at most 64 bytes) and `tap`.
const SPARE_ROOM: &str = "                                                                                ";

/// How long a new spare has to sandbox itself and say it is ready.
const READY_WAIT: Duration = Duration::from_secs(5);

/// How long after a spare was given a device the next is started: long enough for the
/// restart that took it to be over.
const QUIET: Duration = Duration::from_millis(5);

/// How many spare starts [`Spares::starts`] remembers.
const STARTS_KEPT: usize = 1024;

/// The longest pause between attempts to start a spare after one failed.
const MOST_BACK_OFF: Duration = Duration::from_secs(30);

/// A spare that dies sooner than this after its start counts as a failure to start one.
const STEADY: Duration = Duration::from_secs(10);

/// One spare, ready.
#[derive(Debug)]
pub(crate) struct Spare {
    child: DomainChild,
    line: OwnedFd,
    /// The namespaces it was started in.
    namespaces: Layer,
    /// When it said it was ready.
    since: Instant,
}

/// What the pool has done, for status and the tests.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SpareCounts {
    /// Spares waiting now.
    pub ready: usize,
    /// Spares started.
    pub started: u64,
    /// Spares given a device.
    pub taken: u64,
    /// Spares that ended while they waited.
    pub lost: u64,
}

#[derive(Debug)]
struct Inner {
    want: usize,
    exe: PathBuf,
    ready: Mutex<VecDeque<Spare>>,
    /// Wakes the keeper thread: a spare was taken, or the pool stops.
    bell: EventFd,
    stopping: AtomicBool,
    /// When each of the last [`STARTS_KEPT`] spare starts began and ended.
    starts: Mutex<VecDeque<(Instant, Instant)>>,
    /// When a spare was last given a device (monotonic ns; 0: never).
    last_taken: AtomicU64,
    started: AtomicU64,
    taken: AtomicU64,
    lost: AtomicU64,
}

/// The pool of spare domains `serve` keeps (`[domains] spares`).
#[derive(Debug)]
pub(crate) struct Spares {
    inner: Arc<Inner>,
    keeper: Mutex<Option<JoinHandle<()>>>,
}

impl Spares {
    /// Starts keeping `want` spares of executable `exe` (none: a pool that never has one).
    pub fn start(want: usize, exe: PathBuf) -> std::io::Result<Arc<Spares>> {
        let inner = Arc::new(Inner {
            want,
            exe,
            ready: Mutex::new(VecDeque::new()),
            starts: Mutex::new(VecDeque::new()),
            bell: EventFd::new()?,
            stopping: AtomicBool::new(false),
            last_taken: AtomicU64::new(0),
            started: AtomicU64::new(0),
            taken: AtomicU64::new(0),
            lost: AtomicU64::new(0),
        });
        let keeper = if want > 0 {
            let i = inner.clone();
            Some(std::thread::Builder::new().name("spare-domains".into()).spawn(move || keep(&i))?)
        } else {
            None
        };
        Ok(Arc::new(Spares { inner, keeper: Mutex::new(keeper) }))
    }

    /// How many spares it keeps.
    pub fn wanted(&self) -> usize {
        self.inner.want
    }

    /// What the pool has done.
    pub fn counts(&self) -> SpareCounts {
        SpareCounts {
            ready: self.inner.ready.lock().unwrap_or_else(|e| e.into_inner()).len(),
            started: self.inner.started.load(Ordering::Relaxed),
            taken: self.inner.taken.load(Ordering::Relaxed),
            lost: self.inner.lost.load(Ordering::Relaxed),
        }
    }

    /// When each of the last spare starts began and ended, oldest first.
    pub fn starts(&self) -> Vec<(Instant, Instant)> {
        self.inner.starts.lock().unwrap_or_else(|e| e.into_inner()).iter().copied().collect()
    }

    /// The process ids of the spares waiting now.
    pub fn pids(&self) -> Vec<u32> {
        self.inner.ready.lock().unwrap_or_else(|e| e.into_inner()).iter().map(|s| s.child.id()).collect()
    }

    /// Tells the spare that the next [`hand_over`](Self::hand_over) will take that a device is
    /// on its way, so that it is awake when it comes: called as a restart begins, before the
    /// old domains are buried and the new queues made.
    pub fn expect(&self) {
        let ready = self.inner.ready.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(s) = ready.front() {
            // Never blocks; a spare that misses it only takes its device a little later.
            let _ = bulkhead_sys::send_with_fds(s.line.as_fd(), &[handover::SOON], &[], false);
        }
    }

    /// Hands device `device`'s domain to a spare: `spec_json` and `fds` (which the domain finds
    /// at 3, 4, …, as an exec'd one would), its output relayed to the log. Returns the domain
    /// and the namespaces it runs in; `None` if no spare was ready (or each one tried had
    /// died), for the caller to exec one.
    pub fn hand_over(&self, device: &str, spec_json: &str, fds: &[RawFd]) -> Option<(DomainChild, Layer)> {
        loop {
            let spare = self.inner.ready.lock().unwrap_or_else(|e| e.into_inner()).pop_front()?;
            self.inner.last_taken.store(bulkhead_sys::monotonic_ns(), Ordering::Relaxed);
            self.inner.bell.ring();
            match give(&spare, device, spec_json, fds) {
                Ok(()) => {
                    self.inner.taken.fetch_add(1, Ordering::Relaxed);
                    return Some((spare.child, spare.namespaces));
                }
                Err(e) => {
                    log::warn!("spare domain (pid {}) could not take device {device}: {e}; trying another", spare.child.id());
                    self.inner.lost.fetch_add(1, Ordering::Relaxed);
                    discard(spare.child);
                }
            }
        }
    }

    /// Ends the spares still waiting and the keeper thread, with it anything it started that
    /// still runs: call once every device's domains have ended.
    pub fn stop(&self) {
        self.inner.stopping.store(true, Ordering::Release);
        self.inner.bell.ring();
        if let Some(k) = self.keeper.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = k.join();
        }
    }
}

impl Drop for Spares {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Sends `spare` the header, the spec and the descriptors, and relays its output as the
/// device's from now on.
fn give(spare: &Spare, device: &str, spec_json: &str, fds: &[RawFd]) -> std::io::Result<()> {
    let (out_r, out_w) = domain_log::pipe()?;
    let mut all = fds.to_vec();
    all.push(out_w.as_raw_fd());
    let json = spec_json.as_bytes();
    let (mut sent_json, mut sent_fds) = (0, 0);
    let mut msg = Vec::with_capacity(handover::HEADER_LEN + handover::CHUNK);
    msg.extend_from_slice(&handover::header(json.len(), all.len()));
    loop {
        let bytes = &json[sent_json..(sent_json + handover::CHUNK).min(json.len())];
        let these = &all[sent_fds..(sent_fds + handover::FDS_PER_MESSAGE).min(all.len())];
        msg.extend_from_slice(bytes);
        bulkhead_sys::send_with_raw_fds(spare.line.as_fd(), &msg, these, true)?;
        sent_json += bytes.len();
        sent_fds += these.len();
        if sent_json == json.len() && sent_fds == all.len() {
            break;
        }
        msg.clear();
        msg.push(handover::MORE);
    }
    drop(out_w);
    domain_log::relay(device, spare.child.id(), out_r);
    Ok(())
}

/// Starts one spare and waits for it to say it is sandboxed.
fn start_one(exe: &std::path::Path) -> Result<Spare, Error> {
    let failed = |what: &str, e: std::io::Error| Error::failed(format!("spare domain: {what}: {e}"));
    let (ours, theirs) = bulkhead_sys::seqpacket_pair().map_err(|e| failed("its line", e))?;
    let (out_r, out_w) = domain_log::pipe().map_err(|e| failed("its output pipe", e))?;
    // Room for `ps` to show the domain it becomes as `driver DEVICE` (see `bulkhead_driver::spare`).
    let args: [&std::ffi::OsStr; 2] = ["spare".as_ref(), SPARE_ROOM.as_ref()];
    let (mut child, namespaces) =
        bulkhead_sandbox::spawn::spawn(exe, &args, &[], &[theirs.as_raw_fd()], Some(out_w.as_raw_fd()), true)
            .map_err(|e| failed("start", e))?;
    drop(theirs);
    drop(out_w);
    domain_log::relay("(spare)", child.id(), out_r);
    let mut pfd = [libc::pollfd { fd: ours.as_raw_fd(), events: libc::POLLIN, revents: 0 }];
    let said = match bulkhead_sys::poll(&mut pfd, READY_WAIT.as_millis() as i32) {
        Ok(1) => {
            let mut b = [0u8; 1];
            matches!(bulkhead_sys::recv_with_fds(ours.as_fd(), &mut b, false), Ok(Some((1, _)))) && b[0] == handover::READY
        }
        _ => false,
    };
    if !said {
        let _ = child.kill();
        let _ = child.wait_timeout(EXIT_WAIT);
        discard(child);
        return Err(Error::failed(format!("spare domain did not say it was ready within {} s", READY_WAIT.as_secs())));
    }
    Ok(Spare { child, line: ours, namespaces, since: Instant::now() })
}

/// The keeper thread: keeps `want` spares ready until the pool stops.
fn keep(inner: &Inner) {
    let mut back_off = Duration::ZERO;
    let mut retry_at: Option<Instant> = None;
    while !inner.stopping.load(Ordering::Acquire) {
        let short = inner.ready.lock().unwrap_or_else(|e| e.into_inner()).len() < inner.want;
        // Not while a spare is being given a device: starting a process copies this one's
        // page tables, and the restart under way would wait for that.
        let since_taken =
            Duration::from_nanos(bulkhead_sys::monotonic_ns().saturating_sub(inner.last_taken.load(Ordering::Relaxed)));
        if short && since_taken < QUIET {
            let later = Instant::now() + (QUIET - since_taken);
            retry_at = Some(retry_at.map_or(later, |t| t.max(later)));
        }
        if short && retry_at.is_none_or(|t| Instant::now() >= t) {
            let began = Instant::now();
            let started = start_one(&inner.exe);
            {
                let mut starts = inner.starts.lock().unwrap_or_else(|e| e.into_inner());
                if starts.len() == STARTS_KEPT {
                    starts.pop_front();
                }
                starts.push_back((began, Instant::now()));
            }
            match started {
                Ok(s) => {
                    inner.started.fetch_add(1, Ordering::Relaxed);
                    inner.ready.lock().unwrap_or_else(|e| e.into_inner()).push_back(s);
                    back_off = Duration::ZERO;
                    retry_at = None;
                }
                Err(e) => {
                    back_off = (back_off * 2).clamp(Duration::from_millis(100), MOST_BACK_OFF);
                    log::warn!("{e}; trying again in {} ms (domains are exec'd meanwhile)", back_off.as_millis());
                    retry_at = Some(Instant::now() + back_off);
                }
            }
            continue;
        }
        // Wait for a spare to be taken or to die, the pool to stop, or the next attempt.
        let watched: Vec<(u32, OwnedFd)> = inner
            .ready
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .filter_map(|s| Some((s.child.id(), s.child.pidfd().try_clone().ok()?)))
            .collect();
        let mut pfds: Vec<libc::pollfd> = std::iter::once(inner.bell.as_raw_fd())
            .chain(watched.iter().map(|(_, fd)| fd.as_raw_fd()))
            .map(|fd| libc::pollfd { fd, events: libc::POLLIN, revents: 0 })
            .collect();
        let timeout = match (short, retry_at) {
            (true, Some(t)) => t.saturating_duration_since(Instant::now()).as_millis().max(1) as i32,
            _ => -1,
        };
        if bulkhead_sys::poll(&mut pfds, timeout).is_err() {
            std::thread::sleep(Duration::from_millis(10));
            continue;
        }
        if pfds[0].revents != 0 {
            inner.bell.drain();
        }
        for (p, (pid, _)) in pfds[1..].iter().zip(&watched) {
            if p.revents == 0 {
                continue;
            }
            let gone = {
                let mut ready = inner.ready.lock().unwrap_or_else(|e| e.into_inner());
                ready.iter().position(|s| s.child.id() == *pid).and_then(|i| ready.remove(i))
            };
            if let Some(s) = gone {
                inner.lost.fetch_add(1, Ordering::Relaxed);
                // One that dies soon after its start is failing, not unlucky: back off.
                if s.since.elapsed() < STEADY {
                    back_off = (back_off * 2).clamp(Duration::from_millis(100), MOST_BACK_OFF);
                    retry_at = Some(Instant::now() + back_off);
                }
                log::warn!("spare domain (pid {pid}) ended while it waited; starting another");
                discard(s.child);
            }
        }
    }
    // Stopping: the spares still waiting are let go (their lines close, and they exit).
    let left: Vec<Spare> = inner.ready.lock().unwrap_or_else(|e| e.into_inner()).drain(..).collect();
    for s in left {
        discard(s.child);
    }
}
