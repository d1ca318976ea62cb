//! The service loop.
//!
//! Each turn takes up to [`BATCH`] requests from one queue, gives every valid one a [`Tag`] from
//! that queue's share of the tag table, and runs the [`Chain`]: requests a layer holds (a
//! delay, a throttle) stay in the table and complete on a later turn, possibly after requests
//! that came after them — the protocol lets the driver answer out of order. A queue whose
//! every tag is in flight is not read until one comes back, so a frontend can never make the
//! domain hold more than its ring's slots.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use arrayvec::ArrayVec;
use bulkhead_block::{BlockError, Chain, Request, StartError, Tag, TagSpace};
use bulkhead_block::{Op, Status};
use bulkhead_channel::{AboveControl, BackQueue, BelowControl, Popped};
use bulkhead_doorbell::{now_ns, BudgetPolicy, EventFd, Handoff, NotifyMode, Poller, SpinBudget};
use bulkhead_filters::state::StatePage;
use bulkhead_ring::ValidRequest;
use bulkhead_spec::attach_line::FromDomain;
use bulkhead_spec::state_slots::{HEARTBEAT, HELD, LOOP, STALLED};
use bulkhead_spec::ViewSpec;

use crate::attach::{Asked, AttachLine};
use crate::sharing::{Sharing, Turn};
use crate::DriverError;

/// Requests taken from one queue per turn.
const BATCH: usize = 32;

/// Idle turns (each a look at every queue and eight spins) before an idle spinner yields.
const IDLE_SPINS_BEFORE_YIELD: u32 = 4;

/// Longest sleep between turns of a domain that has no stop doorbell
/// ([`Domain::wake_on_stop`]), so that a stop request is seen within it.
const MAX_SLEEP_MS: u64 = 500;

/// How often layers get their housekeeping call while one asks for it (a trace's records).
const IDLE_EVERY_NS: u64 = 100_000_000;

/// Counters of a running domain.
#[derive(Debug, Clone, Copy, Default)]
pub struct DomainStats {
    /// Requests answered.
    pub completed: u64,
    /// Requests refused as malformed.
    pub invalid: u64,
    /// Times the loop slept.
    pub sleeps: u64,
    /// Idle turns that yielded the CPU before spinning, having learned that the thread that
    /// makes the next request runs on this CPU (see `bulkhead_doorbell::Handoff`).
    pub yielded_first: u64,
    /// Idle turns that yielded the CPU, first or after spinning.
    pub idle_yields: u64,
}

/// A request in the chain: the queue it came from and its validated copy.
#[derive(Debug, Clone, Copy)]
struct InFlight {
    queue: usize,
    req: ValidRequest,
    /// Where the queue's view starts in the device (0: the queue serves the device).
    base: u64,
}

/// The tag table: every request between its pop and its response.
#[derive(Debug)]
struct Tags {
    slots: Vec<Option<InFlight>>,
    /// Free tags of each queue (each queue owns as many tags as its ring has slots).
    free: Vec<Vec<Tag>>,
}

impl Tags {
    /// A table for `queues` queues of `per_queue` slots each.
    fn new(queues: usize, per_queue: u32) -> Self {
        let mut free = Vec::with_capacity(queues);
        let mut next = 0u32;
        for _ in 0..queues {
            free.push((next..next + per_queue).rev().map(Tag::new).collect());
            next += per_queue;
        }
        Tags { slots: vec![None; next as usize], free }
    }

    /// Whether every tag of queue `qi` is free (none of its requests is in the chain).
    fn idle(&self, qi: usize, per_queue: u32) -> bool {
        self.free[qi].len() == per_queue as usize
    }

    fn in_flight(&self) -> usize {
        self.slots.len() - self.free.iter().map(Vec::len).sum::<usize>()
    }
}

/// The block request a validated ring request stands for, over its arena windows.
fn request<'q>(queues: &'q [Option<BackQueue>], f: &InFlight) -> Request<'q> {
    let r = &f.req;
    // A queue leaves only once none of its requests is in the chain.
    let q = || queues[f.queue].as_ref().expect("a queue with requests in flight is served");
    q().request(r).shifted(f.base)
}

/// A driver domain's queues and chain.
pub struct Domain {
    /// The queues: those the domain started with, then the slots of attached applications
    /// (`None` while empty).
    queues: Vec<Option<BackQueue>>,
    /// Slots per ring, the same for every queue.
    per_queue: u32,
    /// Attached queues being let go of: no request is taken from them, and what the chain
    /// returns of theirs is dropped; each leaves once the chain holds none of its requests.
    leaving: Vec<bool>,
    /// Leaving queues whose removal the supervisor asked for: answered once they are gone
    /// (a queue let go of for a broken ring is answered only when asked).
    removal_asked: Vec<bool>,
    chain: Chain,
    tags: Tags,
    /// Results of the current turn, by tag (scratch, kept to avoid allocating).
    done: Vec<(Tag, Result<u64, BlockError>)>,
    /// Queues with responses written and not yet published.
    dirty: Vec<bool>,
    mode: NotifyMode,
    budget: SpinBudget,
    poller: Poller,
    stop: Arc<AtomicBool>,
    stats: DomainStats,
    /// Whether the thread making the next request shares this domain's CPU, learned from
    /// the idle loop's yields (when `hands_off`).
    handoff: Handoff,
    /// The idle loop yields at once once the thread making the next request is seen to share
    /// its CPU (see [`set_hands_off`](Self::set_hands_off)).
    hands_off: bool,
    /// When layers last had their idle call.
    idled_at: u64,
    /// Where the domain shows the supervisor it is alive while layers hold requests.
    state: Option<StatePage>,
    /// What the state page last said of a remote that stopped answering; `None` for a
    /// backend that cannot (the page is then left to the domain whose backend can).
    stalled_shown: Option<bool>,
    /// How often it must show it (under the supervisor's watchdog), and when it last did.
    heartbeat_ns: u64,
    beat_at: u64,
    /// When the loop last showed it turns (`LOOP`).
    loop_beat_at: u64,
    /// A driver domain below a tap domain: the supervisor's line about replacing the tap
    /// domain, and with it the frontend end of every queue.
    above: Option<AboveControl>,
    /// Queues that serve views: their offsets, and each view's share (`None`: every queue
    /// serves the whole device, round-robin in batches).
    sharing: Option<Sharing>,
    /// When the views' credit was last written to the state page.
    reported_at: u64,
    /// Rounds over the queues with views (the report's clock when the turns are not timed).
    visits: u64,
    /// The supervisor's line about attached applications' queues.
    attach: Option<AttachLine>,
    /// Readable once the domain is asked to stop (the stop signals' pipe): with it, a domain
    /// with nothing to do sleeps until a doorbell rings, without a timeout.
    stop_bell: Option<std::os::fd::OwnedFd>,
    /// The device is inactive: writes refused so far (`None`: it is active). See
    /// [`set_inactive`](Self::set_inactive).
    inactive: Option<u64>,
    /// A standby domain's go doorbell and the poller it waits on, until it rings
    /// ([`set_standby`](Self::set_standby)).
    go: Option<(EventFd, Poller)>,
    /// The poller a standby below a tap domain waits on to attach, once go has rung.
    waits: Option<Poller>,
    /// A standby tap domain's line, on which it is told what to take over once go rings
    /// ([`set_takeover_line`](Self::set_takeover_line)).
    takeover: Option<BelowControl>,
}

/// Whether `op` is refused because the device is inactive (`inactive`: refusals so far, `None`
/// when it is active); counts and logs the refusal.
fn refused_inactive(inactive: &mut Option<u64>, op: Op) -> bool {
    let Some(n) = inactive else { return false };
    if !matches!(op, Op::Write | Op::Discard | Op::WriteZeroes) {
        return false;
    }
    *n += 1;
    if n.is_power_of_two() {
        eprintln!(
            "bulkhead driver: the device is inactive: a {} was refused ({n} so far); `bulkhead device activate` lets it write",
            op.as_str()
        );
    }
    true
}

/// How often the views' credit is written to the state page, ns; with the turns not timed
/// (no clock read), every so many rounds. Timed, the clock is looked at every
/// `REPORT_LOOK_ROUNDS` rounds.
const REPORT_EVERY_NS: u64 = 50_000_000;
const REPORT_EVERY_VISITS: u64 = 1 << 14;
const REPORT_LOOK_ROUNDS: u64 = 256;

/// Poller token of the line about the domain above.
const ABOVE_TOKEN: u64 = u64::MAX - 1;

/// Poller token of the attach line.
const ATTACH_TOKEN: u64 = u64::MAX - 2;

/// Poller token of the stop doorbell.
const STOP_TOKEN: u64 = u64::MAX - 3;

/// Poller token of a standby domain's go doorbell.
const GO_TOKEN: u64 = u64::MAX - 4;

/// Turns of the loop, busy or idle, between looks at the line about the domain above.
const ABOVE_LOOK_EVERY: u32 = 1024;

impl std::fmt::Debug for Domain {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Domain").field("queues", &self.queues.len()).field("mode", &self.mode).finish_non_exhaustive()
    }
}

impl Domain {
    /// A domain serving `queues` through `chain`; `stop` ends [`run`](Self::run).
    pub fn new(
        queues: Vec<BackQueue>,
        chain: Chain,
        mode: NotifyMode,
        budget: BudgetPolicy,
        stop: Arc<AtomicBool>,
    ) -> Result<Self, DriverError> {
        let per_queue = queues.first().map_or(0, BackQueue::nslots);
        Self::with_slots(queues, 0, per_queue, chain, mode, budget, stop)
    }

    /// [`new`](Self::new), with `slots` empty slots after `queues` for queues of attached
    /// applications, each of `per_queue` ring slots (see [`set_attach_line`](Self::set_attach_line)).
    pub fn with_slots(
        queues: Vec<BackQueue>,
        slots: usize,
        per_queue: u32,
        mut chain: Chain,
        mode: NotifyMode,
        budget: BudgetPolicy,
        stop: Arc<AtomicBool>,
    ) -> Result<Self, DriverError> {
        let poller = Poller::new().map_err(|e| DriverError::Setup(e.to_string()))?;
        if queues.iter().any(|q| q.nslots() != per_queue) {
            return Err(DriverError::Setup("every queue of a device has the same depth".into()));
        }
        let mut queues: Vec<Option<BackQueue>> = queues.into_iter().map(Some).chain((0..slots).map(|_| None)).collect();
        for (i, q) in queues.iter_mut().enumerate() {
            if let Some(q) = q {
                q.set_peer_polls(mode == NotifyMode::Poll);
                poller.add(q.kick_fd(), i as u64).map_err(|e| DriverError::Setup(e.to_string()))?;
            }
        }
        if let Some(fd) = chain.backend_wake_fd() {
            poller.add(fd, u64::MAX).map_err(|e| DriverError::Setup(e.to_string()))?;
        }
        // The runtime's busy state in the order that packs it into the fewest pages under write
        // capture (one range for the page gate to shut): the small lists, the chain's tables,
        // then the tag table, whose first entries are the busy ones.
        let space = TagSpace { queues: queues.len() as u32, per_queue };
        let done = Vec::with_capacity(space.capacity().min(bulkhead_block::LIST_ROOM));
        let dirty = vec![false; queues.len()];
        chain.attach(space).map_err(|e| DriverError::Setup(e.to_string()))?;
        let tags = Tags::new(queues.len(), per_queue);
        Ok(Domain {
            done,
            dirty,
            leaving: vec![false; queues.len()],
            removal_asked: vec![false; queues.len()],
            per_queue,
            queues,
            chain,
            tags,
            mode,
            budget: SpinBudget::new(budget),
            poller,
            stop,
            stats: DomainStats::default(),
            handoff: Handoff::default(),
            hands_off: false,
            idled_at: now_ns(),
            state: None,
            stalled_shown: None,
            heartbeat_ns: 100_000_000,
            beat_at: 0,
            loop_beat_at: 0,
            above: None,
            sharing: None,
            reported_at: 0,
            visits: 0,
            attach: None,
            stop_bell: None,
            inactive: None,
            go: None,
            waits: None,
            takeover: None,
        })
    }

    /// Makes the domain a standby: [`await_go`](Self::await_go) waits until `go` is written.
    /// Call before the domain is confined and after [`wake_on_stop`](Self::wake_on_stop): the
    /// wait has a poller of its own, holding only `go` and the stop doorbell (the queues'
    /// doorbells may be rung for the domain it will replace, and must not wake it).
    pub fn set_standby(&mut self, go: EventFd) -> Result<(), DriverError> {
        use std::os::fd::AsRawFd;
        let setup = |e: std::io::Error| DriverError::Setup(e.to_string());
        let waits = Poller::new().map_err(setup)?;
        waits.add(go.as_raw_fd(), GO_TOKEN).map_err(setup)?;
        if let Some(bell) = &self.stop_bell {
            waits.add(bell.as_raw_fd(), STOP_TOKEN).map_err(setup)?;
        }
        // A driver domain below a tap domain is let attach on its line, after go.
        if let Some(line) = &self.above {
            waits.add(line.wake_fd(), ABOVE_TOKEN).map_err(setup)?;
        }
        self.go = Some((go, waits));
        Ok(())
    }

    /// A standby waits here, built and confined, until its supervisor rings go (its device's
    /// domain has died and its queues are this domain's to serve): no CPU, and nothing of the
    /// device's touched. A driver domain below a tap domain then attaches to its queues as the
    /// generation its line names (the tap domain has started them over). Returns `false` if it
    /// was asked to stop first. Returns at once for a domain that is no standby.
    pub fn await_go(&mut self) -> Result<bool, DriverError> {
        let Some((go, waits)) = self.go.take() else { return Ok(true) };
        loop {
            if self.stop.load(Ordering::Relaxed) {
                return Ok(false);
            }
            if go.drain() > 0 {
                break;
            }
            waits.wait(-1, |_| {}).map_err(|e| DriverError::Setup(e.to_string()))?;
            // Its line may be rung before go (level-triggered, it would wake this wait again).
            if let Some(line) = &self.above {
                line.drain();
            }
        }
        self.take_over()?;
        // Still on its own poller: the tap domain may ring the queues' doorbells before this
        // domain may attach to them.
        self.waits = Some(waits);
        let attached = self.tend_above();
        self.waits = None;
        attached?;
        Ok(!self.stop.load(Ordering::Relaxed))
    }

    /// Makes the domain a standby tap domain, told on `line` (its line about the domain below,
    /// a second handle) what to take over once go rings: its queues above were mapped, and
    /// its queues below adopted, without a byte written (see
    /// [`FrontQueue::forwarding_adopted`](bulkhead_channel::FrontQueue::forwarding_adopted)).
    pub fn set_takeover_line(&mut self, line: BelowControl) {
        self.takeover = Some(line);
    }

    /// A standby tap domain, let go once the tap domain before it is gone: lets its backend
    /// start the queues below over as the line asks (the driver domain there has let go of
    /// them), which it reports there; then, once the frontend has started the queues above
    /// over and the line says as which generation, attaches to them. Nothing is served before
    /// both are done. Returns early if asked to stop.
    fn take_over(&mut self) -> Result<(), DriverError> {
        let Some(line) = self.takeover.take() else { return Ok(()) };
        self.chain.tend();
        if let Some(why) = self.chain.lost() {
            return Err(DriverError::BackendLost(why.to_string()));
        }
        let generation = loop {
            if let Some(g) = line.above_allowed() {
                break g;
            }
            if self.stop.load(Ordering::Relaxed) {
                return Ok(());
            }
            let bell = self.stop_bell.as_ref().map_or(-1, std::os::fd::AsRawFd::as_raw_fd);
            let mut pfd = [line.wake_fd(), bell].map(|fd| libc::pollfd { fd, events: libc::POLLIN, revents: 0 });
            bulkhead_sys::poll(&mut pfd, 100).map_err(|e| DriverError::Setup(format!("waiting to take over: {e}")))?;
            line.drain();
        };
        for (queue, q) in self.queues.iter_mut().enumerate() {
            if let Some(q) = q {
                q.reattach(generation).map_err(|source| DriverError::Channel { queue, source })?;
            }
        }
        self.dirty.iter_mut().for_each(|d| *d = false);
        Ok(())
    }

    /// Makes the domain serve an inactive device, the destination of a live migration before
    /// its switchover: every write, discard and write-zeroes is answered `ReadOnly` before the
    /// chain sees it, and said in the log (the first, then at every power of two).
    pub fn set_inactive(&mut self) {
        self.inactive = Some(0);
    }

    /// Gives the domain its attach line: the supervisor adds attached applications' queues to
    /// the empty slots (from the first after the queues the domain started with) and removes
    /// them. `sizes`: each slot's bound on request ranges (its view's size, or the device's).
    pub fn set_attach_line(&mut self, sock: std::os::fd::OwnedFd, sizes: Vec<u64>, arena_bytes: u64) -> Result<(), DriverError> {
        let first = self.queues.iter().take_while(|q| q.is_some()).count();
        if first + sizes.len() != self.queues.len() {
            return Err(DriverError::Setup(format!("{} attach slots for {} empty", sizes.len(), self.queues.len() - first)));
        }
        let line = AttachLine::new(sock, first, sizes, self.per_queue, arena_bytes);
        self.poller.add(line.fd(), ATTACH_TOKEN).map_err(|e| DriverError::Setup(e.to_string()))?;
        self.attach = Some(line);
        Ok(())
    }

    /// Watches `bell`, which becomes readable once the domain is asked to stop (see
    /// [`stop_on_signals`](crate::stop_on_signals)). From then on a domain with nothing to do
    /// sleeps until a request, a completion or a line wakes it, with no timer of its own.
    pub fn wake_on_stop(&mut self, bell: std::os::fd::OwnedFd) -> Result<(), DriverError> {
        use std::os::fd::AsRawFd;
        self.poller.add(bell.as_raw_fd(), STOP_TOKEN).map_err(|e| DriverError::Setup(e.to_string()))?;
        self.stop_bell = Some(bell);
        Ok(())
    }

    /// Follows the attach line: adds the queues it brings, starts letting go of those it
    /// asks, and lets go of every leaving queue the chain no longer holds requests of.
    fn tend_attached(&mut self) {
        let Some(line) = &mut self.attach else { return };
        let first = line.first;
        let mut answers = Vec::new();
        while let Some(asked) = line.next() {
            match asked {
                Asked::Add { slot, mut queue } => {
                    let qi = first + slot;
                    if self.queues[qi].is_some() || self.leaving[qi] {
                        answers.push(FromDomain::Refused { slot: slot as u32, why: "the slot holds a queue".into() });
                        continue;
                    }
                    queue.set_peer_polls(self.mode == NotifyMode::Poll);
                    if let Err(e) = self.poller.add(queue.kick_fd(), qi as u64) {
                        answers.push(FromDomain::Refused { slot: slot as u32, why: format!("cannot watch its doorbell: {e}") });
                        continue;
                    }
                    self.queues[qi] = Some(queue);
                    answers.push(FromDomain::Added { slot: slot as u32 });
                }
                Asked::Remove { slot } => {
                    let qi = first + slot;
                    if self.queues[qi].is_none() {
                        answers.push(FromDomain::Removed { slot: slot as u32 });
                    } else {
                        self.leaving[qi] = true;
                        self.removal_asked[qi] = true;
                    }
                }
                Asked::Refused { slot, why } => answers.push(FromDomain::Refused { slot, why }),
            }
        }
        for qi in first..self.queues.len() {
            if self.leaving[qi] && self.tags.idle(qi, self.per_queue) {
                self.leaving[qi] = false;
                self.dirty[qi] = false;
                if let Some(q) = self.queues[qi].take() {
                    let _ = self.poller.remove(q.kick_fd());
                }
                if let Some(s) = &mut self.sharing {
                    s.emptied(qi);
                }
                if std::mem::take(&mut self.removal_asked[qi]) {
                    answers.push(FromDomain::Removed { slot: (qi - first) as u32 });
                }
            }
        }
        if let Some(line) = &self.attach {
            for a in &answers {
                line.answer(a);
            }
        }
    }

    /// An attached queue whose frontend broke the protocol: it is let go of (the application
    /// that holds it is told through the supervisor), and the domain serves on.
    fn evict(&mut self, qi: usize, why: &str) {
        let Some(line) = &self.attach else { return };
        if !self.leaving[qi] {
            eprintln!("bulkhead driver: attached queue {}: {why}; letting it go", qi - line.first);
            line.answer(&FromDomain::Refused { slot: (qi - line.first) as u32, why: why.to_string() });
            self.leaving[qi] = true;
        }
    }

    /// Gives the domain its state page: while layers hold requests (a delay, a throttle) and
    /// nothing is answered, the supervisor's watchdog looks there for signs of life.
    /// The page must show a beat at least every `heartbeat_ms`.
    pub fn set_state_page(&mut self, page: StatePage, heartbeat_ms: u64) {
        self.state = Some(page);
        self.heartbeat_ns = heartbeat_ms.max(2) * 1_000_000;
    }

    /// Makes queues serve views: `lanes` gives each queue's view (an index into `views`, or
    /// `None` for the device), each queue's ring already bounded by its view's size. Call
    /// after [`set_state_page`](Self::set_state_page): the views' caps are read from there.
    pub fn set_views(&mut self, views: &[ViewSpec], lanes: &[Option<u32>], device_size: u64) -> Result<(), DriverError> {
        if lanes.len() != self.queues.len() {
            return Err(DriverError::Setup(format!("{} queue views for {} queues", lanes.len(), self.queues.len())));
        }
        if views.is_empty() {
            self.sharing = None;
            return Ok(());
        }
        let s = Sharing::new(views, lanes, device_size, self.state.as_ref(), now_ns())
            .map_err(|e| DriverError::Setup(e.to_string()))?;
        self.sharing = Some(s);
        Ok(())
    }

    /// Lets the idle loop learn whether the thread making the next request shares this
    /// domain's CPU, and then yield as soon as it finds nothing rather than after a few idle
    /// turns: for the two domains of an `interpose` device, which with its frontend are
    /// three spinners, so on two CPUs the tap domain and the driver domain below it often
    /// take turns on one (docs/bench/tuning.md, "The tap hop's floor on two CPUs"). Elsewhere
    /// the thread that makes the next request is a frontend whose own work takes longer than
    /// the idle turns, and yielding at once measured slower (1-thread FUSE reads).
    pub fn set_hands_off(&mut self, on: bool) {
        self.hands_off = on;
    }

    /// Gives a driver domain below a tap domain its line to the supervisor about the tap
    /// domain: when the tap domain is replaced, this domain lets go of its queues and attaches
    /// to them again as the new one starts them over (see [`AboveControl`]).
    pub fn set_above_control(&mut self, line: AboveControl) -> Result<(), DriverError> {
        self.poller.add(line.wake_fd(), ABOVE_TOKEN).map_err(|e| DriverError::Setup(e.to_string()))?;
        self.above = Some(line);
        Ok(())
    }

    /// Follows the supervisor's line about the domain above, if it asks for something: lets
    /// go of every queue (finishing what the chain holds, answering none of it: the frontend
    /// sends it all again), waits to be told the new tap domain has started them over, and
    /// attaches to them again. Returns at once if nothing is asked, or when stopped.
    fn tend_above(&mut self) -> Result<(), DriverError> {
        let Some(line) = &self.above else { return Ok(()) };
        let current = self.queues.first().and_then(Option::as_ref).map_or(0, BackQueue::generation);
        let Some(mut generation) = line.detach_wanted(current) else { return Ok(()) };
        line.drain();
        self.finish_unanswered()?;
        let line = self.above.as_ref().expect("checked above");
        line.report_detached(generation);
        loop {
            if self.stop.load(Ordering::Relaxed) {
                return Ok(());
            }
            // The supervisor may give up on one replacement and ask for the next.
            if let Some(newer) = line.detach_wanted(current).filter(|&g| g != generation) {
                generation = newer;
                line.report_detached(generation);
            }
            if line.attach_allowed(generation) {
                break;
            }
            let poller = self.waits.as_ref().unwrap_or(&self.poller);
            poller.wait(100, |_| {}).map_err(|e| DriverError::Setup(e.to_string()))?;
            line.drain();
        }
        for (queue, q) in self.queues.iter_mut().enumerate() {
            if let Some(q) = q {
                q.reattach(generation).map_err(|source| DriverError::Channel { queue, source })?;
            }
        }
        self.dirty.iter_mut().for_each(|d| *d = false);
        line.report_attached(generation);
        Ok(())
    }

    /// Runs the chain until it holds no request, dropping every result: the queues they came
    /// on are being started over, and the frontend sends each again.
    fn finish_unanswered(&mut self) -> Result<(), DriverError> {
        while self.tags.in_flight() > 0 && !self.stop.load(Ordering::Relaxed) {
            let Domain { queues, chain, tags, done, .. } = self;
            let lookup = |t: Tag| request(queues, tags.slots[t.index()].as_ref().expect("tag in flight"));
            chain.run(&[], &now_ns, &lookup, &mut |t, r| done.push((t, r)));
            if let Some(why) = self.chain.lost() {
                return Err(DriverError::BackendLost(why.to_string()));
            }
            for (tag, _) in self.done.drain(..) {
                let f = self.tags.slots[tag.index()].take().expect("completed tag was in flight");
                self.tags.free[f.queue].push(tag);
            }
            if self.tags.in_flight() > 0 {
                let ms = self.chain.next_poll().map_or(1, |t| t.saturating_sub(now_ns()).div_ceil(1_000_000).clamp(1, 100));
                self.poller.wait(ms as i32, |_| {}).map_err(|e| DriverError::Setup(e.to_string()))?;
                self.idle_layers(false);
            }
        }
        Ok(())
    }

    /// Counters.
    pub fn stats(&self) -> DomainStats {
        self.stats
    }

    /// Serves one batch from queue `qi` (and whatever held requests come due meanwhile);
    /// returns how many requests it answered.
    fn serve_queue(&mut self, qi: usize) -> Result<usize, DriverError> {
        let mut new: ArrayVec<Tag, BATCH> = ArrayVec::new();
        let mut refused = 0;
        let mut broken = None;
        // With views: the queue's turn, by its view's credit and share. The clock only where
        // a view has a cap or the weights differ: equal weights need none.
        let now = match &self.sharing {
            Some(s) if s.timed() => now_ns(),
            _ => 0,
        };
        {
            // An empty slot, or an attached queue being let go of: nothing is taken from it.
            let mut q = match &mut self.queues[qi] {
                Some(q) if !self.leaving[qi] => Some(q),
                _ => None,
            };
            let free = &mut self.tags.free[qi];
            let open = match &mut self.sharing {
                _ if q.is_none() => false,
                None => true,
                Some(s) => s.begin(qi, self.state.as_ref(), now) == Turn::Open,
            };
            while let (true, Some(q)) = (open && new.len() + refused < BATCH && !free.is_empty(), q.as_deref_mut()) {
                if let Some(s) = &mut self.sharing {
                    if !s.may_start(qi, now) {
                        break;
                    }
                }
                let popped = match q.pop() {
                    Ok(p) => p,
                    // An attached application's broken ring costs it its queue, not the
                    // domain its life.
                    Err(source) if self.attach.as_ref().is_some_and(|l| qi >= l.first) => {
                        broken = Some(source.to_string());
                        break;
                    }
                    Err(source) => return Err(DriverError::Channel { queue: qi, source }),
                };
                match popped {
                    None => {
                        if let Some(s) = &mut self.sharing {
                            s.emptied(qi);
                        }
                        break;
                    }
                    Some(Popped::Valid(req)) => {
                        if refused_inactive(&mut self.inactive, req.op()) {
                            q.complete(req.id(), req.generation(), Status::ReadOnly, 0);
                            self.dirty[qi] = true;
                            refused += 1;
                            continue;
                        }
                        let mut base = 0;
                        if let Some(s) = &mut self.sharing {
                            if s.read_only(qi) && matches!(req.op(), Op::Write | Op::Discard | Op::WriteZeroes) {
                                q.complete(req.id(), req.generation(), Status::ReadOnly, 0);
                                self.dirty[qi] = true;
                                refused += 1;
                                continue;
                            }
                            s.charge(qi, req.op(), req.len(), now);
                            base = s.base(qi);
                        }
                        let tag = free.pop().expect("checked non-empty");
                        self.tags.slots[tag.index()] = Some(InFlight { queue: qi, req, base });
                        new.push(tag);
                    }
                    Some(Popped::Invalid { id, generation, error }) => {
                        if self.stats.invalid.is_power_of_two() {
                            eprintln!(
                                "bulkhead driver: queue {qi}: refused request {id:#x}: {error} ({} so far)",
                                self.stats.invalid + 1
                            );
                        }
                        self.stats.invalid += 1;
                        q.complete(id, generation, Status::Invalid, 0);
                        self.dirty[qi] = true;
                        refused += 1;
                    }
                }
            }
        }
        if let Some(why) = broken {
            self.evict(qi, &why);
        }
        // Held requests whose time has come, or requests an asynchronous backend has started,
        // need a turn of the chain even with nothing new.
        let due = self.chain.next_poll().is_some_and(|t| t <= now_ns()) || self.chain.at_backend() > 0;
        if new.is_empty() && refused == 0 && !due {
            return Ok(0);
        }
        // Without layers the chain reads no clock: a polled request reads none.
        let Domain { queues, chain, tags, done, .. } = self;
        let lookup = |t: Tag| request(queues, tags.slots[t.index()].as_ref().expect("tag in flight"));
        chain.run(&new, &now_ns, &lookup, &mut |t, r| done.push((t, r)));
        if let Some(why) = self.chain.lost() {
            // Answer nothing: the next generation gets every unanswered request again.
            return Err(DriverError::BackendLost(why.to_string()));
        }
        if self.stalled_shown.is_some() {
            self.show_stalled();
        }
        let mut n = refused;
        let mut finished = std::mem::take(&mut self.done);
        if !finished.is_empty() {
            // The responses go into the rings: under write capture, what the filters' calls
            // left shut of them opens now, once for the whole turn.
            bulkhead_guard::reopen_deferred();
        }
        for (tag, result) in finished.drain(..) {
            let f = self.tags.slots[tag.index()].take().expect("completed tag was in flight");
            self.tags.free[f.queue].push(tag);
            if let Some(s) = &mut self.sharing {
                s.finished(f.queue, now);
            }
            let (status, len) = match result {
                Ok(len) => (Status::Ok, len),
                Err(e) => {
                    self.log_failure(f.req.id(), &e);
                    (e.status(), 0)
                }
            };
            // What a leaving queue's requests return is dropped: its application is gone.
            if let (Some(q), false) = (&mut self.queues[f.queue], self.leaving[f.queue]) {
                q.complete(f.req.id(), f.req.generation(), status, len);
                self.dirty[f.queue] = true;
            }
            n += 1;
        }
        self.done = finished;
        for (i, q) in self.queues.iter_mut().enumerate() {
            if let (true, Some(q)) = (std::mem::take(&mut self.dirty[i]), q) {
                q.publish();
            }
        }
        self.stats.completed += n as u64;
        Ok(n)
    }

    /// Logs a failed request: the first few, then one in each power of two.
    fn log_failure(&mut self, id: u64, e: &BlockError) {
        static FAILED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = FAILED.fetch_add(1, Ordering::Relaxed) + 1;
        if n <= 8 || n.is_power_of_two() {
            eprintln!("bulkhead driver: request {id:#x}: {e} ({n} failed so far)");
        }
    }

    /// One round over every queue.
    pub fn poll_once(&mut self) -> Result<usize, DriverError> {
        let mut n = 0;
        let mut quiet = None;
        for qi in 0..self.queues.len() {
            // A queue with nothing waiting (or none there) costs one look at its ring: most
            // of a shared domain's queues are idle at any moment.
            let waiting = match &self.queues[qi] {
                Some(q) => !self.leaving[qi] && q.pending(),
                None => false,
            };
            if !waiting {
                if let (Some(s), Some(_)) = (&mut self.sharing, &self.queues[qi]) {
                    s.emptied(qi);
                }
                quiet.get_or_insert(qi);
                continue;
            }
            n += self.serve_queue(qi)?;
        }
        // Held requests whose time has come, or requests an asynchronous backend has started,
        // need a turn of the chain even when no queue had anything new: one per round.
        if let Some(qi) = quiet.filter(|_| n == 0) {
            n += self.serve_queue(qi)?;
        }
        self.report_views();
        Ok(n)
    }

    /// Writes the views' credit and what they were served to the state page, if it is due.
    fn report_views(&mut self) {
        let (Some(s), Some(p)) = (&self.sharing, &self.state) else { return };
        self.visits = self.visits.wrapping_add(1);
        if s.timed() {
            if self.visits.is_multiple_of(REPORT_LOOK_ROUNDS) {
                let now = now_ns();
                if now.saturating_sub(self.reported_at) >= REPORT_EVERY_NS {
                    self.reported_at = now;
                    s.report(p);
                }
            }
        } else if self.visits.is_multiple_of(REPORT_EVERY_VISITS) {
            s.report(p);
        }
    }

    fn any_pending(&self) -> bool {
        self.queues.iter().flatten().any(BackQueue::pending)
    }

    /// When the loop must turn next whatever the doorbells say: a held request comes due, or
    /// a view with requests waiting gets credit again.
    fn next_due(&mut self) -> Option<u64> {
        let mut due = self.chain.next_poll();
        if let Some(s) = &mut self.sharing {
            let now = now_ns();
            for (i, q) in self.queues.iter().enumerate() {
                let Some(q) = q else { continue };
                if let Some(t) = s.starved(i, now).filter(|_| q.pending()) {
                    due = Some(due.map_or(t, |d| d.min(t)));
                }
            }
        }
        due
    }

    /// Requests between pop and response (held by a layer or at the backend).
    pub fn in_flight(&self) -> usize {
        self.tags.in_flight()
    }

    /// Gives layers their housekeeping call if it is due (see [`bulkhead_block::Layer::idle`]).
    fn idle_layers(&mut self, force: bool) {
        if self.chain.layer_count() == 0 {
            return;
        }
        let now = now_ns();
        if force || now - self.idled_at >= IDLE_EVERY_NS {
            self.idled_at = now;
            self.chain.idle();
        }
        // While layers hold requests nothing may be answered for a while: beat, so the
        // watchdog sees the loop still turns.
        if let Some(p) = &self.state {
            let held = self.chain.held() as u64;
            if (held > 0 || p.get(HELD) > 0) && now - self.beat_at >= self.heartbeat_ns / 2 {
                self.beat_at = now;
                p.add(HEARTBEAT, 1);
                p.set(HELD, held);
            }
        }
    }

    /// Tells the supervisor, through the state page, whether the backend's remote has stopped
    /// answering, when that changes, and says so in the log.
    fn show_stalled(&mut self) {
        let now = self.chain.stalled();
        if now == self.stalled_shown {
            return;
        }
        self.stalled_shown = now;
        if let Some(s) = now {
            if s {
                eprintln!("bulkhead driver: the backend's remote stopped answering: requests fail after its timeout");
            } else {
                eprintln!("bulkhead driver: the backend's remote answers again");
            }
            self.write_stalled(s);
        }
    }

    /// Writes whether the backend's remote has stopped answering into the state page.
    fn write_stalled(&self, stalled: bool) {
        if let Some(p) = &self.state {
            p.set(STALLED, u64::from(stalled));
        }
    }

    /// Shows the supervisor the loop still turns, at most every half heartbeat.
    fn beat_loop(&mut self, now: u64) {
        if let Some(p) = &self.state {
            if now.saturating_sub(self.loop_beat_at) >= self.heartbeat_ns / 2 {
                self.loop_beat_at = now;
                p.add(LOOP, 1);
            }
        }
    }

    /// Whether an application's queue is attached.
    fn has_attached(&self) -> bool {
        self.attach.as_ref().is_some_and(|l| self.queues[l.first..].iter().any(Option::is_some))
    }

    /// Serves until the stop flag is set, spinning and sleeping per the notification mode.
    pub fn run(&mut self) -> Result<(), DriverError> {
        let r = self.serve();
        self.idle_layers(true);
        r
    }

    fn serve(&mut self) -> Result<(), DriverError> {
        self.chain.start(&now_ns).map_err(|e| match e {
            StartError::Lost(why) => DriverError::BackendLost(why.to_string()),
            e @ (StartError::Open { .. } | StartError::Scratch(_)) => DriverError::Setup(e.to_string()),
        })?;
        // An earlier domain may have left the page saying its remote had stalled.
        self.stalled_shown = self.chain.stalled();
        if let Some(s) = self.stalled_shown {
            self.write_stalled(s);
        }
        let mut idle_since: Option<u64> = None;
        let mut spins = 0u32;
        let mut slept = false;
        let tunes = self.mode == NotifyMode::Adaptive && self.budget.tunes();
        let mut turns = 0u32;
        let mut backend_gap = false;
        // The backend is open: one beat says so to the supervisor, which counts a domain that
        // has neither beaten nor answered as still reaching its remote. An idle domain may
        // sleep from here on with no timer to beat by.
        self.beat_loop(now_ns());
        while !self.stop.load(Ordering::Relaxed) {
            turns = turns.wrapping_add(1);
            if turns.is_multiple_of(ABOVE_LOOK_EVERY) {
                if self.above.is_some() {
                    self.tend_above()?;
                }
                self.tend_attached();
                self.beat_loop(now_ns());
            }
            if self.poll_once()? > 0 {
                if self.hands_off {
                    self.handoff.arrived();
                }
                if let Some(t) = idle_since.take() {
                    // Gaps that layers made by holding requests, or the backend by working on
                    // them, say nothing of the frontend.
                    if tunes && self.chain.held() == 0 && !std::mem::take(&mut backend_gap) {
                        if std::mem::take(&mut slept) {
                            self.budget.record_after_sleep(now_ns() - t);
                        } else {
                            self.budget.record(now_ns() - t);
                        }
                    }
                }
                spins = 0;
                continue;
            }
            let sleep = match self.mode {
                NotifyMode::Poll => {
                    spins = spins.wrapping_add(1);
                    false
                }
                NotifyMode::Irq => true,
                NotifyMode::Adaptive => {
                    // Only this mode times the idle gap: poll and irq read no clock per request.
                    let at_backend = self.chain.at_backend() > 0;
                    backend_gap |= at_backend;
                    let since = *idle_since.get_or_insert_with(now_ns);
                    spins = spins.wrapping_add(1);
                    // A disk takes longer than a wake-up: waiting on one, spinning only takes
                    // the CPU from the threads that make the next request. The clock is read
                    // every 32 turns while they are turns of a tight spin, and on every turn
                    // once each turn yields: a yield that runs another thread (a TCG guest's
                    // vCPU on the same CPU) takes microseconds, and 28 of them before the
                    // first look overran a budget that said sleep (bench vm: the domain slept
                    // on 0.4–0.6 of a TCG guest's requests and spent 60% of its CPU yielding).
                    let look = spins.is_multiple_of(32) || spins >= IDLE_SPINS_BEFORE_YIELD;
                    look && (at_backend || now_ns() - since >= self.budget.budget_ns())
                }
            };
            // A held request due within a millisecond is waited for spinning: a sleep has
            // millisecond granularity.
            let sleep = sleep && self.next_due().is_none_or(|t| t > now_ns() + 1_000_000);
            if !sleep {
                if spins.is_multiple_of(1024) {
                    self.chain.tend();
                    self.idle_layers(false);
                }
                // A spinner that has found nothing for a while lets a thread runnable on its
                // CPU go first. That thread is most often one that makes the next request:
                // the application, the export's leader, a FUSE worker, or with a tap domain the
                // other spinner of three on two CPUs here, any of which may otherwise wait for
                // this one's slice to end. Alone on its CPU, the call returns at once, so a
                // domain with a CPU to itself spins as before (docs/ring-protocol.md). Once a
                // request has come just after a yield that ran another thread, that thread is
                // taken to share this CPU, and the loop yields as soon as it finds nothing.
                let first = self.hands_off && self.handoff.yield_first();
                if !first {
                    for _ in 0..8 {
                        if self.any_pending() {
                            break;
                        }
                        std::hint::spin_loop();
                    }
                }
                if first || spins >= IDLE_SPINS_BEFORE_YIELD {
                    self.stats.yielded_first += u64::from(first);
                    self.stats.idle_yields += 1;
                    if self.hands_off {
                        // Timed, to learn from.
                        self.handoff.yield_now();
                    } else {
                        std::thread::yield_now();
                    }
                }
                continue;
            }
            self.handoff.abandoned();
            self.sleep()?;
            self.beat_loop(now_ns());
            self.chain.tend();
            self.tend_above()?;
            self.tend_attached();
            self.idle_layers(false);
            slept = true;
        }
        Ok(())
    }

    fn sleep(&mut self) -> Result<(), DriverError> {
        // The rings are written next; under write capture, what calls left shut of them opens.
        bulkhead_guard::reopen_deferred();
        let mut pending = false;
        let now = now_ns();
        for (i, q) in self.queues.iter().enumerate() {
            let Some(q) = q else { continue };
            // A queue with requests waiting for its view's credit is not woken by its
            // doorbell: the credit wakes it (see `next_due`).
            if let Some(s) = &mut self.sharing {
                if s.starved(i, now).is_some() && q.pending() {
                    continue;
                }
            }
            pending |= q.prepare_sleep();
        }
        if !pending {
            self.stats.sleeps += 1;
            // What the views were served is up to date in the page while the domain sleeps.
            if let (Some(s), Some(p)) = (&self.sharing, &self.state) {
                s.report(p);
                self.reported_at = now;
            }
            // No longer than until a held request is due: whole milliseconds short of it, the
            // rest spun (a `vpt` completion is due to the microsecond). With nothing due, until
            // a doorbell rings: requests, completions, the lines and the stop signals all have
            // one. A domain without a stop doorbell wakes now and then to see a stop request.
            let mut ms: Option<u64> = match self.next_due() {
                Some(t) => Some(t.saturating_sub(now_ns()) / 1_000_000),
                None if self.stop_bell.is_some() => None,
                None => Some(MAX_SLEEP_MS),
            };
            let mut at_most = |cap: u64| ms = Some(ms.map_or(cap, |m| m.min(cap)));
            // Held requests, and attached applications whose requests the supervisor cannot
            // count, leave the watchdog only the beats to go by: wake for them. Idle and
            // alone, a domain shows no beat and needs none: the watchdog asks for progress
            // only of a domain with requests waiting.
            if self.chain.held() > 0 || self.has_attached() {
                at_most((self.heartbeat_ns / 2_000_000).max(1));
            }
            if self.chain.idle_wanted() {
                at_most(IDLE_EVERY_NS / 1_000_000);
            }
            if ms != Some(0) {
                let timeout = ms.map_or(-1, |m| m.min(i32::MAX as u64) as i32);
                self.poller.wait(timeout, |_| {}).map_err(|e| DriverError::Setup(e.to_string()))?;
            }
        }
        for q in self.queues.iter().flatten() {
            q.set_running();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bulkhead_backends::RamBackend;
    use bulkhead_block::{Layer, Op};
    use bulkhead_channel::{pair, FrontQueue, FrontRequest, QueueConfig};
    use bulkhead_filters::error::ErrorRule;
    use bulkhead_filters::{FilterFds, FilterSpec};
    use bulkhead_shmem::{memfd, Mapping, Protection};
    use std::os::fd::AsRawFd;
    use std::time::{Duration, Instant};

    fn filter(spec: FilterSpec) -> Box<dyn Layer> {
        let state = memfd::create("state", bulkhead_filters::state::STATE_BYTES as u64).unwrap();
        bulkhead_filters::build(&spec, FilterFds { state, output: None, secret: None }).unwrap()
    }

    /// Refuses write-zeroes with EOPNOTSUPP, holds reads for `read_delay_us`.
    fn test_chain(ram: RamBackend, read_delay_us: u64) -> Chain {
        let rule = ErrorRule {
            ops: 1 << Op::WriteZeroes.index(),
            offset: 0,
            len: u64::MAX,
            probability_ppm: 1_000_000,
            after: 0,
            count: None,
            errno: 95,
            seed: 1,
        };
        let delay = FilterSpec::Delay { delay_us: [read_delay_us, 0, 0, 0, 0] };
        Chain::new(vec![filter(FilterSpec::Error { rule }), filter(delay)], Box::new(ram))
    }

    fn ram(size: u64) -> (RamBackend, Mapping) {
        let fd = memfd::create("ram", size).unwrap();
        let probe = Mapping::new(fd.as_raw_fd(), size as usize, Protection::ReadOnly).unwrap();
        (RamBackend::new(fd, size).unwrap(), probe)
    }

    fn run_chain_test(mode: NotifyMode) {
        let size = 4 << 20;
        let cfg = QueueConfig { nslots: 16, arena_bytes: 1 << 20, mode, ..Default::default() };
        let (mut front, back) = pair(&cfg, size).unwrap();
        let (ram, probe) = ram(size);
        let stop = Arc::new(AtomicBool::new(false));
        let mut dom = Domain::new(vec![back], test_chain(ram, 2_000), mode, BudgetPolicy::DEFAULT_AUTO, stop.clone()).unwrap();
        let t = std::thread::spawn(move || {
            dom.run().unwrap();
            dom.stats()
        });

        let data: Vec<u8> = (0..65536u32).map(|i| (i * 31 % 256) as u8).collect();
        let r = front.execute(FrontRequest::Write { offset: 8192, from: &data, fua: false }, 5000, |_| {}).unwrap();
        assert_eq!(r, Ok(65536));
        assert_eq!(front.execute(FrontRequest::Flush, 5000, |_| {}).unwrap(), Ok(0));
        let mut stored = vec![0u8; 65536];
        probe.slice(8192, 65536).unwrap().copy_to(&mut stored);
        assert_eq!(stored, data);
        // The read is held by the delay layer for 2 ms and still comes back whole.
        let mut back_out = vec![0u8; 65536];
        let start = Instant::now();
        let r = front.execute(FrontRequest::Read { offset: 8192, into: 65536 }, 5000, |w| w.copy_to(&mut back_out)).unwrap();
        assert!(start.elapsed() >= Duration::from_millis(2), "the read was not held");
        assert_eq!(r, Ok(65536));
        assert_eq!(back_out, data);
        // An operation a layer refuses comes back as its status, not as silent success.
        let r = front.execute(FrontRequest::WriteZeroes { offset: 0, len: 4096 }, 5000, |_| {}).unwrap();
        assert_eq!(r, Err(Status::NotSupported));
        stop.store(true, Ordering::Relaxed);
        let stats = t.join().unwrap();
        assert_eq!(stats.completed, 4);
    }

    #[test]
    fn chain_with_filters_serves_in_poll_mode() {
        run_chain_test(NotifyMode::Poll);
    }

    #[test]
    fn chain_with_filters_serves_in_irq_mode() {
        run_chain_test(NotifyMode::Irq);
    }

    #[test]
    fn chain_with_filters_serves_in_adaptive_mode() {
        run_chain_test(NotifyMode::Adaptive);
    }

    #[test]
    fn a_held_request_holds_up_neither_its_queue_nor_the_others() {
        let size = 1 << 20;
        let cfg = QueueConfig { nslots: 8, arena_bytes: 1 << 20, mode: NotifyMode::Adaptive, ..Default::default() };
        let (front0, back0) = pair(&cfg, size).unwrap();
        let (mut front1, back1) = pair(&cfg, size).unwrap();
        let (ram, _) = ram(size);
        let stop = Arc::new(AtomicBool::new(false));
        let chain = test_chain(ram, 300_000);
        let mut dom =
            Domain::new(vec![back0, back1], chain, NotifyMode::Adaptive, BudgetPolicy::DEFAULT_AUTO, stop.clone()).unwrap();
        let t = std::thread::spawn(move || dom.run());
        let reader = std::thread::spawn(move || {
            let mut front0: FrontQueue = front0;
            let start = Instant::now();
            let r = front0.execute(FrontRequest::Read { offset: 0, into: 4096 }, 5000, |_| {}).unwrap();
            (r, start.elapsed())
        });
        // While queue 0's read is held for 300 ms, queue 1 is served.
        std::thread::sleep(Duration::from_millis(20));
        let data = [7u8; 4096];
        for i in 0..50 {
            let r = front1.execute(FrontRequest::Write { offset: i * 4096, from: &data, fua: false }, 5000, |_| {}).unwrap();
            assert_eq!(r, Ok(4096));
        }
        assert!(!reader.is_finished(), "the read finished before its delay");
        let (r, took) = reader.join().unwrap();
        assert_eq!(r, Ok(4096));
        assert!(took >= Duration::from_millis(300), "read came back after {took:?}");
        stop.store(true, Ordering::Relaxed);
        t.join().unwrap().unwrap();
    }

    #[test]
    fn request_past_device_end_is_answered_invalid() {
        let cfg = QueueConfig { nslots: 8, arena_bytes: 1 << 16, mode: NotifyMode::Poll, ..Default::default() };
        let (mut front, back) = pair(&cfg, 1 << 16).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let null = Chain::new(Vec::new(), Box::new(bulkhead_backends::NullBackend::new(1 << 16)));
        let mut dom = Domain::new(vec![back], null, NotifyMode::Poll, BudgetPolicy::DEFAULT_AUTO, stop.clone()).unwrap();
        let t = std::thread::spawn(move || dom.run());
        let r = front.execute(FrontRequest::Read { offset: 1 << 16, into: 4096 }, 5000, |_| {}).unwrap();
        assert_eq!(r, Err(Status::Invalid));
        stop.store(true, Ordering::Relaxed);
        t.join().unwrap().unwrap();
    }

    /// A domain in `poll` mode and its frontend, both on CPU 0, for 200 reads; the domain's
    /// stats.
    fn on_one_cpu(hands_off: bool) -> DomainStats {
        let cfg = QueueConfig { nslots: 8, arena_bytes: 1 << 16, mode: NotifyMode::Poll, ..Default::default() };
        let (mut front, back) = pair(&cfg, 1 << 16).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let null = Chain::new(Vec::new(), Box::new(bulkhead_backends::NullBackend::new(1 << 16)));
        let mut dom = Domain::new(vec![back], null, NotifyMode::Poll, BudgetPolicy::DEFAULT_AUTO, stop.clone()).unwrap();
        dom.set_hands_off(hands_off);
        bulkhead_sys::pin_thread(0).unwrap();
        let t = std::thread::spawn(move || {
            bulkhead_sys::pin_thread(0).unwrap();
            dom.run().unwrap();
            dom.stats()
        });
        for i in 0..200u64 {
            let r = front.execute(FrontRequest::Read { offset: (i % 16) * 4096, into: 4096 }, 5000, |_| {}).unwrap();
            assert_eq!(r, Ok(4096));
            // The frontend makes its next request after a yield, as one that shares the
            // domain's CPU would after its own work.
            std::thread::yield_now();
        }
        stop.store(true, Ordering::Relaxed);
        t.join().unwrap()
    }

    #[test]
    fn a_domain_that_hands_off_yields_first_once_its_frontend_shares_its_cpu() {
        let s = on_one_cpu(true);
        assert_eq!(s.completed, 200);
        assert!(s.yielded_first > 0, "200 requests from a frontend on the domain's CPU, no idle turn yielded first: {s:?}");
    }

    #[test]
    fn a_domain_that_does_not_hand_off_spins_first_as_before() {
        let s = on_one_cpu(false);
        assert_eq!(s.completed, 200);
        assert_eq!(s.yielded_first, 0);
    }

    #[test]
    fn an_adaptive_domain_whose_budget_is_spent_sleeps_before_it_yields() {
        // A budget of nothing: the first look says sleep. Looks come on every turn that
        // would yield, so none does (they came every 32 turns, after 28 yields, and a yield
        // that runs another thread takes microseconds each).
        let cfg = QueueConfig { nslots: 8, arena_bytes: 1 << 16, mode: NotifyMode::Adaptive, ..Default::default() };
        let (mut front, back) = pair(&cfg, 1 << 16).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let null = Chain::new(Vec::new(), Box::new(bulkhead_backends::NullBackend::new(1 << 16)));
        let mut dom = Domain::new(vec![back], null, NotifyMode::Adaptive, BudgetPolicy::Fixed(0), stop.clone()).unwrap();
        let t = std::thread::spawn(move || {
            dom.run().unwrap();
            dom.stats()
        });
        for i in 0..50u64 {
            let r = front.execute(FrontRequest::Read { offset: (i % 16) * 4096, into: 4096 }, 5000, |_| {}).unwrap();
            assert_eq!(r, Ok(4096));
            std::thread::sleep(std::time::Duration::from_micros(200));
        }
        stop.store(true, Ordering::Relaxed);
        let s = t.join().unwrap();
        assert_eq!(s.completed, 50);
        assert!(s.sleeps >= 50, "a domain with no budget slept {} times for 50 requests 200 µs apart: {s:?}", s.sleeps);
        assert_eq!(s.idle_yields, 0, "{s:?}");
    }

    fn view(name: &str, offset: u64, size: u64, read_only: bool) -> ViewSpec {
        ViewSpec { name: name.into(), offset, size, read_only }
    }

    #[test]
    fn a_view_reaches_its_range_only_and_a_read_only_view_never_writes() {
        let cfg = QueueConfig { nslots: 8, arena_bytes: 1 << 16, mode: NotifyMode::Poll, ..Default::default() };
        let (ram, probe) = ram(1 << 20);
        let (mut whole, b0) = pair(&cfg, 1 << 20).unwrap();
        let (mut vm1, b1) = pair(&cfg, 64 << 10).unwrap();
        let (mut ro, b2) = pair(&cfg, 64 << 10).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let chain = Chain::new(Vec::new(), Box::new(ram));
        let mut dom = Domain::new(vec![b0, b1, b2], chain, NotifyMode::Poll, BudgetPolicy::DEFAULT_AUTO, stop.clone()).unwrap();
        let views = [view("vm1", 256 << 10, 64 << 10, false), view("ro", 512 << 10, 64 << 10, true)];
        dom.set_views(&views, &[None, Some(0), Some(1)], 1 << 20).unwrap();
        let t = std::thread::spawn(move || dom.run());
        let bytes = |off: usize, len: usize| {
            let mut v = vec![0u8; len];
            probe.read_into(off, &mut v).unwrap();
            v
        };
        let at = |off: usize| bytes(off, 1)[0];
        // A write at the view's start lands at its offset in the device.
        let w = vm1.execute(FrontRequest::Write { offset: 0, from: &[0xab; 4096], fua: false }, 5000, |_| {}).unwrap();
        assert_eq!(w, Ok(4096));
        assert_eq!((at(256 << 10), at((256 << 10) + 4095), at((256 << 10) - 1)), (0xab, 0xab, 0));
        // Past the view's end: refused, and nothing after the view is touched.
        for off in [64 << 10, (64 << 10) - 2048] {
            let r = vm1.execute(FrontRequest::Write { offset: off, from: &[0xcd; 4096], fua: false }, 5000, |_| {}).unwrap();
            assert_eq!(r, Err(Status::Invalid), "write at {off}");
            let r = vm1.execute(FrontRequest::Read { offset: off, into: 4096 }, 5000, |_| {}).unwrap();
            assert_eq!(r, Err(Status::Invalid), "read at {off}");
        }
        assert!(bytes((320 << 10) - 4096, 8192).iter().all(|&b| b != 0xcd));
        // The read-only view reads its own range and refuses every kind of write.
        whole.execute(FrontRequest::Write { offset: 512 << 10, from: &[0x5a; 4096], fua: false }, 5000, |_| {}).unwrap().unwrap();
        let mut seen = vec![];
        ro.execute(FrontRequest::Read { offset: 0, into: 4096 }, 5000, |d| {
            let mut b = [0u8; 1];
            d.sub(0, 1).unwrap().copy_to(&mut b);
            seen.push(b[0]);
        })
        .unwrap()
        .unwrap();
        assert_eq!(seen, vec![0x5a]);
        let w = ro.execute(FrontRequest::Write { offset: 0, from: &[1; 4096], fua: false }, 5000, |_| {}).unwrap();
        assert_eq!(w, Err(Status::ReadOnly));
        let d = ro.execute(FrontRequest::Discard { offset: 0, len: 4096 }, 5000, |_| {}).unwrap();
        assert_eq!(d, Err(Status::ReadOnly));
        assert_eq!(at(512 << 10), 0x5a);
        stop.store(true, Ordering::Relaxed);
        t.join().unwrap().unwrap();
    }

    #[test]
    fn a_capped_view_waits_for_credit_and_its_neighbour_does_not() {
        use bulkhead_qos::{page, Caps};
        let cfg = QueueConfig { nslots: 8, arena_bytes: 1 << 16, mode: NotifyMode::Adaptive, ..Default::default() };
        let (mut slow, b0) = pair(&cfg, 1 << 20).unwrap();
        let (mut free, b1) = pair(&cfg, 1 << 20).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let chain = Chain::new(Vec::new(), Box::new(bulkhead_backends::NullBackend::new(2 << 20)));
        let mut dom = Domain::new(vec![b0, b1], chain, NotifyMode::Adaptive, BudgetPolicy::DEFAULT_AUTO, stop.clone()).unwrap();
        // 100 requests a second, one at a time, for the first view; none for the second.
        let state = memfd::create("state", bulkhead_filters::state::STATE_BYTES as u64).unwrap();
        let sup = StatePage::map(state.as_raw_fd(), true).unwrap();
        let caps = Caps { iops: 100, burst_ios: 1, ..Caps::default() };
        for (i, v) in caps.to_slots().into_iter().enumerate() {
            sup.set(page::slot(0, page::CAPS + i), v);
        }
        sup.set(page::slot(0, page::SEQ), 2);
        dom.set_state_page(StatePage::map(state.as_raw_fd(), true).unwrap(), 100);
        let views = [view("slow", 0, 1 << 20, false), view("free", 1 << 20, 1 << 20, false)];
        dom.set_views(&views, &[Some(0), Some(1)], 2 << 20).unwrap();
        let t = std::thread::spawn(move || dom.run());
        let read = |q: &mut FrontQueue| q.execute(FrontRequest::Read { offset: 0, into: 4096 }, 5000, |_| {}).unwrap().unwrap();
        let started = Instant::now();
        for _ in 0..21 {
            read(&mut slow);
        }
        // One at once, then one each 10 ms: at least 200 ms, however fast the machine.
        assert!(started.elapsed() >= Duration::from_millis(195), "{:?}", started.elapsed());
        // The uncapped view is not held to it.
        let started = Instant::now();
        for _ in 0..21 {
            read(&mut free);
        }
        let free_took = started.elapsed();
        std::thread::sleep(Duration::from_millis(120));
        assert_eq!(sup.get(page::slot(0, page::SERVED_IOS)), 21);
        assert_eq!(sup.get(page::slot(1, page::SERVED_IOS)), 21);
        assert!(sup.get(page::slot(0, page::WAITS)) > 0);
        // Lifting the cap on the running view takes effect at once.
        let lifted = Caps::default();
        sup.set(page::slot(0, page::SEQ), 3);
        for (i, v) in lifted.to_slots().into_iter().enumerate() {
            sup.set(page::slot(0, page::CAPS + i), v);
        }
        sup.set(page::slot(0, page::SEQ), 4);
        let started = Instant::now();
        for _ in 0..21 {
            read(&mut slow);
        }
        assert!(started.elapsed() < Duration::from_millis(150) || started.elapsed() < free_took * 4, "{:?}", started.elapsed());
        stop.store(true, Ordering::Relaxed);
        t.join().unwrap().unwrap();
    }

    #[test]
    fn a_view_outside_the_device_is_refused() {
        let cfg = QueueConfig { nslots: 8, arena_bytes: 1 << 16, mode: NotifyMode::Poll, ..Default::default() };
        let (_f, b) = pair(&cfg, 1 << 16).unwrap();
        let null = Chain::new(Vec::new(), Box::new(bulkhead_backends::NullBackend::new(1 << 20)));
        let mut dom =
            Domain::new(vec![b], null, NotifyMode::Poll, BudgetPolicy::DEFAULT_AUTO, Arc::new(AtomicBool::new(false))).unwrap();
        let e = dom.set_views(&[view("v", 1 << 20, 1 << 16, false)], &[Some(0)], 1 << 20).unwrap_err();
        assert!(e.to_string().contains("view `v`"), "{e}");
        let e = dom.set_views(&[view("v", 0, 1 << 16, false)], &[Some(3)], 1 << 20).unwrap_err();
        assert!(e.to_string().contains("view 3"), "{e}");
    }

    /// Sends `msg` on the supervisor's end of an attach line, with `fds`, and returns the
    /// domain's answer (waiting up to 5 s).
    fn on_line(line: &std::os::fd::OwnedFd, msg: ToDomainMsg, fds: &[std::os::fd::BorrowedFd<'_>]) -> FromDomain {
        use std::os::fd::AsFd;
        let bytes = serde_json::to_vec(&msg).unwrap();
        bulkhead_sys::send_with_fds(line.as_fd(), &bytes, fds, true).unwrap();
        let mut pfd = [libc::pollfd { fd: line.as_raw_fd(), events: libc::POLLIN, revents: 0 }];
        assert_eq!(bulkhead_sys::poll(&mut pfd, 5000).unwrap(), 1, "the domain answers");
        let mut buf = [0u8; 256];
        let (n, _) = bulkhead_sys::recv_with_fds(line.as_fd(), &mut buf, false).unwrap().unwrap();
        serde_json::from_slice(&buf[..n]).unwrap()
    }

    use bulkhead_spec::attach_line::ToDomain as ToDomainMsg;

    #[test]
    fn attached_queues_join_a_running_domain_leave_it_and_a_broken_one_is_let_go() {
        use std::os::fd::AsFd;
        let size = 4 << 20;
        let cfg = QueueConfig { nslots: 16, arena_bytes: 1 << 20, mode: NotifyMode::Irq, ..Default::default() };
        let (mut own, back) = pair(&cfg, size).unwrap();
        let (ram, probe) = ram(size);
        let stop = Arc::new(AtomicBool::new(false));
        let chain = Chain::new(Vec::new(), Box::new(ram));
        let mut dom =
            Domain::with_slots(vec![back], 2, 16, chain, NotifyMode::Irq, BudgetPolicy::DEFAULT_AUTO, stop.clone()).unwrap();
        let (ours, theirs) = bulkhead_sys::seqpacket_pair().unwrap();
        // Slot 0 serves the whole device, slot 1 a 1 MiB view at 2 MiB.
        dom.set_attach_line(theirs, vec![size, 1 << 20], 1 << 20).unwrap();
        dom.set_views(&[view("v", 2 << 20, 1 << 20, false)], &[None, None, Some(0)], size).unwrap();
        let t = std::thread::spawn(move || dom.run().unwrap());

        let (mut app, fds) = bulkhead_channel::QueueSetup::create("app", &cfg).unwrap();
        let added = on_line(&ours, ToDomainMsg::Add { slot: 1 }, &fds.as_array().map(|f| f.as_fd()));
        assert_eq!(added, FromDomain::Added { slot: 1 });
        let again = on_line(&ours, ToDomainMsg::Add { slot: 1 }, &fds.as_array().map(|f| f.as_fd()));
        assert!(matches!(again, FromDomain::Refused { slot: 1, .. }), "{again:?}");
        drop(fds);
        let data = vec![0xa5u8; 8192];
        let r = app.execute(FrontRequest::Write { offset: 4096, from: &data, fua: false }, 5000, |_| {}).unwrap();
        assert_eq!(r, Ok(8192));
        let mut stored = vec![0u8; 8192];
        probe.slice((2 << 20) + 4096, 8192).unwrap().copy_to(&mut stored);
        assert_eq!(stored, data, "the view's slot writes at the view's offset");
        // Past the view's end: refused by the ring, nothing written.
        let r = app.execute(FrontRequest::Write { offset: 1 << 20, from: &data, fua: false }, 5000, |_| {});
        assert!(!matches!(r, Ok(Ok(_))), "{r:?}");
        // The domain's own queue is served meanwhile.
        assert_eq!(own.execute(FrontRequest::Flush, 5000, |_| {}).unwrap(), Ok(0));
        assert_eq!(on_line(&ours, ToDomainMsg::Remove { slot: 1 }, &[]), FromDomain::Removed { slot: 1 });

        // A queue whose ring turns to garbage is let go of, and the domain serves on.
        let (_breaker, fds) = bulkhead_channel::QueueSetup::create("breaker", &cfg).unwrap();
        assert_eq!(
            on_line(&ours, ToDomainMsg::Add { slot: 0 }, &fds.as_array().map(|f| f.as_fd())),
            FromDomain::Added { slot: 0 }
        );
        let ring = Mapping::new(fds.ring.as_raw_fd(), 4096, Protection::ReadWrite).unwrap();
        for off in (0..4096).step_by(8) {
            let _ = ring.atomic_u64(off).map(|a| a.store(u64::MAX / 3, Ordering::Release));
        }
        bulkhead_doorbell::EventFd::from_owned(fds.kick.try_clone().unwrap()).unwrap().ring();
        let mut pfd = [libc::pollfd { fd: ours.as_raw_fd(), events: libc::POLLIN, revents: 0 }];
        assert_eq!(bulkhead_sys::poll(&mut pfd, 5000).unwrap(), 1, "the domain reports the eviction");
        let mut buf = [0u8; 256];
        let (n, _) = bulkhead_sys::recv_with_fds(ours.as_fd(), &mut buf, false).unwrap().unwrap();
        let told: FromDomain = serde_json::from_slice(&buf[..n]).unwrap();
        assert!(matches!(told, FromDomain::Refused { slot: 0, .. }), "{told:?}");
        assert_eq!(on_line(&ours, ToDomainMsg::Remove { slot: 0 }, &[]), FromDomain::Removed { slot: 0 });
        assert_eq!(own.execute(FrontRequest::Flush, 5000, |_| {}).unwrap(), Ok(0));
        stop.store(true, Ordering::Relaxed);
        t.join().unwrap();
    }
}
