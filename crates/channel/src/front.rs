//! The frontend's end of a queue: submission, the shadow table of outstanding requests, and
//! validation of every response.

use std::os::fd::{AsRawFd, RawFd};

use bulkhead_block::{Command, Op, Status};
use bulkhead_doorbell::{now_ns, BudgetPolicy, CrowdWatch, EventFd, Handoff, NotifyMode, SpinBudget};
use bulkhead_ring::{
    op_code, status_of_code, FrontRing, RequestSlot, ResponseSlot, RingError, Segment, ARENA_READ, ARENA_WRITE, FLAG_FUA,
    MAX_REQUEST_BYTES,
};
use bulkhead_shmem::{Mapping, PageAllocator, SharedSlice, SliceList};

use crate::{ChannelError, FillError, QueueConfig, SubmitError};

/// What the frontend asks of the device: a read names how many bytes to read (the queue places
/// them in its read arena), a write borrows the bytes to write (copied into its write arena).
pub type FrontRequest<'a> = Command<u64, &'a [u8]>;

/// A validated completion, handed to the caller of [`FrontQueue::reap`].
#[derive(Debug)]
pub struct Completion<'a> {
    /// The caller's token given at submission.
    pub user: u64,
    /// `Ok(bytes)` or the device's status.
    pub result: Result<u64, Status>,
    /// For a successful read: the data, in the read arena. Copy it out once (or hand it to a
    /// system call) inside the callback; the space is reused afterwards. `None` for a request
    /// placed with [`FrontQueue::push_forward`], whose data is where it asked for it.
    pub data: Option<SharedSlice<'a>>,
    /// What the request was.
    pub op: Op,
    /// Bytes it asked for.
    pub len: u64,
    /// From its first submission (to any generation) to its answer, ns (0 unless the queue is
    /// [timed](FrontQueue::set_timed)).
    pub latency_ns: u64,
}

/// The two grant arenas of a queue, as its frontend maps them, with their allocators.
#[derive(Debug)]
struct Arenas {
    w: Mapping,
    r: Mapping,
    walloc: PageAllocator,
    ralloc: PageAllocator,
}

/// Where a request's data comes from.
enum Payload<'d> {
    /// No data.
    None,
    /// Read-arena space for the driver to fill.
    ReadSpace,
    /// Bytes of the caller's.
    Bytes(&'d [u8]),
    /// Bytes of the caller's, in windows.
    Gather(&'d SliceList<'d>),
    /// Windows the driver already has, named as they are.
    Forward(&'d [Segment]),
    /// Bytes the caller writes into the write-arena window it is given (from memory it cannot
    /// lend as a slice, such as a guest's, or from a file); a fill that fails places nothing.
    Fill(&'d mut dyn FnMut(SharedSlice<'_>) -> Result<(), FillError>),
}

/// One request in the shadow table: what the frontend sent, against which responses are checked.
#[derive(Debug, Clone, Copy)]
struct Entry {
    live: bool,
    id: u64,
    user: u64,
    op: Op,
    offset: u64,
    len: u64,
    fua: bool,
    arena_off: usize,
    arena_len: usize,
    /// When it was first submitted ([`now_ns`]), carried to the generations it is reissued to.
    submitted_ns: u64,
}

impl Default for Entry {
    fn default() -> Self {
        Entry {
            live: false,
            id: 0,
            user: 0,
            op: Op::Flush,
            offset: 0,
            len: 0,
            fua: false,
            arena_off: 0,
            arena_len: 0,
            submitted_ns: 0,
        }
    }
}

/// Counters of a queue.
#[derive(Debug, Clone, Copy, Default)]
pub struct QueueStats {
    /// Requests completed (any status).
    pub completed: u64,
    /// Doorbells rung towards the driver.
    pub kicks: u64,
    /// Times the frontend slept waiting for a response.
    pub sleeps: u64,
    /// Of the sleeps, those that cut the spin short because threads were waiting for a CPU
    /// (adaptive mode; see `bulkhead_doorbell::Crowd`).
    pub crowded: u64,
    /// Doorbell storms seen: runs of [`STORM_WAKES`] wake-ups in a row with no response, after
    /// which waits stop listening to the doorbell for [`STORM_DAMP_MS`].
    pub storms: u64,
    /// Waits that yielded the CPU before spinning, having learned that the driver runs on this
    /// queue's CPU (a queue that yields; see [`FrontQueue::set_yield_after`]).
    pub yielded_first: u64,
    /// Time spent spinning for responses, ns (spins shorter than 64 looks are not timed).
    pub spin_ns: u64,
    /// Time spent asleep waiting for responses, ns (armed sleeps included).
    pub sleep_ns: u64,
}

/// Wake-ups in a row without a response that make a doorbell storm.
pub const STORM_WAKES: u32 = 32;
/// How long waits ignore a storming doorbell and look at the ring on a timer instead, ms.
pub const STORM_DAMP_MS: u64 = 100;
/// The timer's period while damped, µs: bounds both the CPU a storm costs and the latency it
/// adds.
const STORM_NAP_US: u64 = 500;

/// The frontend end of one queue. Owned by one thread (`&mut self` everywhere): no lock on the
/// data path.
#[derive(Debug)]
pub struct FrontQueue {
    ring: FrontRing,
    /// The arenas this end fills and reads; `None` for a forwarding end (see
    /// [`FrontQueue::forwarding`]), whose requests name windows of arenas the driver already has.
    arenas: Option<Arenas>,
    /// Bytes in each arena (the forwarded-to arenas for a forwarding end).
    arena_bytes: usize,
    /// A tap domain's end of the queue to the domain below: it restarts in place.
    forwarding: bool,
    kick: EventFd,
    irq: EventFd,
    mode: NotifyMode,
    budget: SpinBudget,
    /// Whether threads wait for a CPU while this one spins.
    crowd: CrowdWatch,
    generation: u32,
    table: Vec<Entry>,
    free: Vec<u32>,
    seq: u64,
    broken: Option<ChannelError>,
    stats: QueueStats,
    /// The shadow-table index of the request placed last.
    last_placed: usize,
    /// When an armed sleep began ([`now_ns`]; 0: none).
    armed_at: u64,
    /// Requests are timed ([`FrontQueue::set_timed`]).
    timed: bool,
    /// Wake-ups in a row that found no response.
    spurious: u32,
    /// The next wait sleeps at once: the requests it waits for were sent again to a domain
    /// that has just started ([`reissue_onto`](Self::reissue_onto)), whose first answers come
    /// later than a spin lasts, and a spin here would only take the CPU it needs.
    sleep_first: bool,
    /// Until when (ns) waits ignore the doorbell: a storm was detected.
    damped_until: u64,
    /// Spins after which a wait yields the CPU between looks (0: never).
    yield_after: u32,
    /// Where the driver runs, learned from the waits' yields (used when `yield_after` is set).
    handoff: Handoff,
}

const INDEX_BITS: u32 = 16;

/// The frontend waits only while it has a request outstanding: a response is certain to come,
/// so spinning up to the wake-up cost (the auto ceiling) is always 2-competitive and needs no
/// tuning. Tuning both sides from each other's gaps feeds back (one side's sleep lengthens the
/// other's gaps) into a stable, interrupt-like equilibrium; only the driver, which waits for
/// requests that may never come, tunes its budget.
fn frontend_policy(p: BudgetPolicy) -> BudgetPolicy {
    match p {
        BudgetPolicy::Auto { max_ns, .. } => BudgetPolicy::Fixed(max_ns),
        fixed => fixed,
    }
}

impl FrontQueue {
    pub(crate) fn new(ring: FrontRing, warena: Mapping, rarena: Mapping, kick: EventFd, irq: EventFd, cfg: &QueueConfig) -> Self {
        let arena_bytes = warena.len();
        let arenas =
            Arenas { walloc: PageAllocator::new(warena.len()), ralloc: PageAllocator::new(rarena.len()), w: warena, r: rarena };
        Self::assemble(ring, Some(arenas), arena_bytes, kick, irq, cfg)
    }

    /// A queue over its ring, doorbells and (unless it forwards) arenas, with nothing in flight.
    fn assemble(
        mut ring: FrontRing,
        arenas: Option<Arenas>,
        arena_bytes: usize,
        kick: EventFd,
        irq: EventFd,
        cfg: &QueueConfig,
    ) -> Self {
        let n = ring.layout().nslots;
        // Both sides run the device's mode: in `poll` neither ever sleeps.
        ring.set_peer_polls(cfg.mode == NotifyMode::Poll);
        FrontQueue {
            arenas,
            arena_bytes,
            forwarding: false,
            ring,
            kick,
            irq,
            mode: cfg.mode,
            budget: SpinBudget::new(frontend_policy(cfg.budget)),
            crowd: CrowdWatch::default(),
            generation: cfg.generation,
            table: vec![Entry::default(); n as usize],
            free: (0..n).rev().collect(),
            seq: 0,
            broken: None,
            stats: QueueStats::default(),
            last_placed: 0,
            armed_at: 0,
            timed: false,
            spurious: 0,
            sleep_first: false,
            damped_until: 0,
            yield_after: 0,
            handoff: Handoff::default(),
        }
    }

    /// A forwarding frontend end, for a tap domain passing requests on to the domain below: the
    /// queue's ring and doorbells are its own, its arenas are those of the channel above, which
    /// the domain below maps too. Requests are placed with [`push_forward`](Self::push_forward)
    /// naming the windows they came in, so no data is copied. Writes the ring's header: the
    /// driver end must not attach before this returns.
    pub fn forwarding(fds: crate::ForwardQueueFds, cfg: &QueueConfig) -> Result<Self, ChannelError> {
        Self::forwarding_as(fds, cfg, true)
    }

    /// A forwarding end over a queue another tap domain serves now, for a standby tap domain:
    /// as [`forwarding`](Self::forwarding), but nothing of the queue is written (its header is
    /// the running tap domain's) and nothing can be sent until [`restart`](Self::restart) starts
    /// it over, once that domain is gone.
    pub fn forwarding_adopted(fds: crate::ForwardQueueFds, cfg: &QueueConfig) -> Result<Self, ChannelError> {
        Self::forwarding_as(fds, cfg, false)
    }

    fn forwarding_as(fds: crate::ForwardQueueFds, cfg: &QueueConfig, write_header: bool) -> Result<Self, ChannelError> {
        let err = |e: &dyn std::fmt::Display| ChannelError::Setup(e.to_string());
        let layout = bulkhead_ring::RingLayout::new(cfg.nslots).map_err(|e| err(&e))?;
        let prot = bulkhead_shmem::Protection::ReadWrite;
        let ring_map = Mapping::new(fds.ring.as_raw_fd(), layout.file_size(), prot).map_err(|e| err(&e))?;
        let arenas = match &fds.arenas {
            Some([w, r]) => {
                let bytes = cfg.arena_len();
                for fd in [w, r] {
                    let have = bulkhead_shmem::memfd::size_of(fd.as_raw_fd()).map_err(|e| err(&e))?;
                    if have < bytes as u64 {
                        return Err(ChannelError::Setup(format!("arena of {have} bytes, expected {bytes}")));
                    }
                }
                let w = Mapping::new(w.as_raw_fd(), bytes, prot).map_err(|e| err(&e))?;
                let r = Mapping::new(r.as_raw_fd(), bytes, prot).map_err(|e| err(&e))?;
                Some(Arenas { walloc: PageAllocator::new(w.len()), ralloc: PageAllocator::new(r.len()), w, r })
            }
            None => None,
        };
        let ring =
            if write_header { FrontRing::create(ring_map, layout, cfg.generation) } else { FrontRing::adopt(ring_map, layout) }
                .map_err(|e| err(&e))?;
        let kick = EventFd::from_owned(fds.kick).map_err(|e| err(&e))?;
        let irq = EventFd::from_owned(fds.irq).map_err(|e| err(&e))?;
        let mut q = Self::assemble(ring, arenas, cfg.arena_bytes, kick, irq, cfg);
        q.forwarding = true;
        if !write_header {
            q.broken = Some(ChannelError::Setup("the queue below is not started over yet".into()));
        }
        Ok(q)
    }

    /// Whether this end has arenas of its own to fill and read (see
    /// [`LowerQueue`](crate::LowerQueue)): requests then carry data with
    /// [`push`](Self::push) and [`push_gather`](Self::push_gather), not by naming windows.
    pub fn carries_data(&self) -> bool {
        self.arenas.is_some()
    }

    /// Starts a forwarding end over as a fresh queue of `generation`, for a new domain below
    /// (the old one has exited and nothing of it is attached any more): the ring's header is
    /// rewritten and every request outstanding is forgotten, so the caller reissues those it
    /// still wants answered; arenas of its own are emptied. Only a forwarding end restarts in
    /// place: a frontend's queue gets new arenas with each generation.
    pub fn restart(&mut self, generation: u32) -> Result<(), ChannelError> {
        if !self.forwarding {
            return Err(ChannelError::Setup("only a forwarding end restarts in place".into()));
        }
        if let Some(a) = &mut self.arenas {
            a.walloc = PageAllocator::new(a.w.len());
            a.ralloc = PageAllocator::new(a.r.len());
        }
        self.ring.restart(generation).map_err(|e| ChannelError::Setup(e.to_string()))?;
        self.generation = generation;
        let n = self.table.len();
        self.table = vec![Entry::default(); n];
        self.free = (0..n as u32).rev().collect();
        self.broken = None;
        self.spurious = 0;
        self.damped_until = 0;
        // A doorbell rung to wake this end for the restart carries no response.
        self.irq.drain();
        Ok(())
    }

    /// Starts a queue with arenas of its own over in place as `generation`, for a new domain
    /// attached to the same files (a tap domain replaced while the domain below it stays, and
    /// with it the arenas both map): the ring's header is rewritten, and every request without
    /// a response is placed again, in the order first submitted, with its user token and over
    /// the same arena windows. A write's data is still where it was: only this end writes the
    /// write arena. Publishes them; returns how many. Call only once the old domain is gone
    /// and before the new one attaches.
    pub fn start_over(&mut self, generation: u32) -> Result<usize, ChannelError> {
        if self.arenas.is_none() || self.forwarding {
            return Err(ChannelError::Setup("a forwarding end restarts with `restart` and reissues itself".into()));
        }
        self.ring.restart(generation).map_err(|e| ChannelError::Setup(e.to_string()))?;
        self.generation = generation;
        self.broken = None;
        self.spurious = 0;
        self.damped_until = 0;
        self.irq.drain();
        let mut live: Vec<usize> = (0..self.table.len()).filter(|&i| self.table[i].live).collect();
        live.sort_unstable_by_key(|&i| self.table[i].id >> INDEX_BITS);
        for &index in &live {
            let e = self.table[index];
            let mut slot = RequestSlot { generation, op: op_code(e.op), offset: e.offset, len: e.len, ..Default::default() };
            if e.fua {
                slot.flags = FLAG_FUA;
            }
            if e.arena_len > 0 {
                let which = if e.op == Op::Write { ARENA_WRITE } else { ARENA_READ };
                slot.nsegs = 1;
                slot.segs[0] = Segment { arena: which, len: e.arena_len as u32, offset: e.arena_off as u64 };
            }
            self.seq += 1;
            slot.id = (self.seq << INDEX_BITS) | index as u64;
            self.table[index].id = slot.id;
            // As many live entries as the table has slots, and the ring as many: it fits.
            self.ring.push(&slot).expect("a fresh ring holds every slot of the table");
        }
        if !live.is_empty() {
            self.publish();
        }
        Ok(live.len())
    }

    /// Makes waits yield the CPU between looks once they have spun `spins` times (0: never):
    /// for a frontend that is itself a domain (a tap domain), one of three spinners for two
    /// CPUs, whose peer may be runnable on its CPU. When an answer comes just after a yield
    /// that ran another thread, the driver is taken to share this CPU and the next wait
    /// yields before spinning (see [`Handoff`]).
    pub fn set_yield_after(&mut self, spins: u32) {
        self.yield_after = spins;
    }

    /// Bytes in each arena: the largest request this queue can carry.
    pub fn arena_bytes(&self) -> usize {
        self.arena_bytes
    }

    /// Largest data request.
    pub fn max_request(&self) -> u64 {
        (self.arena_bytes as u64).min(MAX_REQUEST_BYTES)
    }

    /// Requests this queue holds in flight at most (its ring's slots).
    pub fn capacity(&self) -> usize {
        self.table.len()
    }

    /// Requests submitted and not yet completed.
    pub fn in_flight(&self) -> usize {
        self.table.len() - self.free.len()
    }

    /// Counters.
    pub fn stats(&self) -> QueueStats {
        self.stats
    }

    /// Whether a response waits to be reaped.
    pub fn has_answer(&self) -> bool {
        self.ring.response_pending()
    }

    /// The notification mode.
    pub fn mode(&self) -> NotifyMode {
        self.mode
    }

    /// The channel generation this queue belongs to.
    pub fn generation(&self) -> u32 {
        self.generation
    }

    /// A duplicate of the doorbell the driver rings, so a supervisor can wake a thread sleeping
    /// on this queue without taking it.
    pub fn irq_waker(&self) -> std::io::Result<std::os::fd::OwnedFd> {
        use std::os::fd::AsFd;
        self.irq.as_fd().try_clone_to_owned()
    }

    /// Current spin budget in nanoseconds.
    pub fn budget_ns(&self) -> u64 {
        self.budget.budget_ns()
    }

    /// Requests the driver claims to have completed.
    pub fn progress(&self) -> u64 {
        self.ring.progress()
    }

    /// The doorbell the driver rings (for callers that poll several queues).
    pub fn irq_fd(&self) -> RawFd {
        self.irq.as_raw_fd()
    }

    /// Why the channel is broken, if it is.
    pub fn broken(&self) -> Option<&ChannelError> {
        self.broken.as_ref()
    }

    fn mark_broken(&mut self, e: ChannelError) -> ChannelError {
        if self.broken.is_none() {
            self.broken = Some(e.clone());
        }
        e
    }

    /// Places a request in the ring (not yet visible: call [`publish`](Self::publish), or use
    /// [`submit`](Self::submit)). `user` comes back in the completion.
    pub fn push(&mut self, req: FrontRequest<'_>, user: u64) -> Result<(), SubmitError> {
        let (op, offset, len, payload, fua) = match req {
            FrontRequest::Read { offset, into: len } => (Op::Read, offset, len, Payload::ReadSpace, false),
            FrontRequest::Write { offset, from: data, fua } => (Op::Write, offset, data.len() as u64, Payload::Bytes(data), fua),
            FrontRequest::Flush => (Op::Flush, 0, 0, Payload::None, false),
            FrontRequest::Discard { offset, len } => (Op::Discard, offset, len, Payload::None, false),
            FrontRequest::WriteZeroes { offset, len } => (Op::WriteZeroes, offset, len, Payload::None, false),
        };
        self.place(op, offset, len, payload, fua, user)
    }

    /// Places a request whose data windows the driver already has (a forwarding end's: windows
    /// of the channel above, named by arena, offset and length as they came in). Nothing is
    /// copied; a read's data lands where the request above asked for it. `len` is the request's
    /// length; the segments must add up to it for a read or write and be empty otherwise (the
    /// driver checks them against its arenas like any request).
    pub fn push_forward(
        &mut self,
        op: Op,
        offset: u64,
        len: u64,
        segments: &[Segment],
        fua: bool,
        user: u64,
    ) -> Result<(), SubmitError> {
        self.place(op, offset, len, Payload::Forward(segments), fua, user)
    }

    fn place(&mut self, op: Op, offset: u64, len: u64, payload: Payload<'_>, fua: bool, user: u64) -> Result<(), SubmitError> {
        if let Some(e) = &self.broken {
            return Err(SubmitError::Broken(e.clone()));
        }
        if !self.ring.has_space() || self.free.is_empty() {
            return Err(SubmitError::Full);
        }
        let mut slot = RequestSlot { generation: self.generation, ..Default::default() };
        if fua {
            slot.flags = FLAG_FUA;
        }
        let (mut arena_off, mut arena_len) = (0, 0);
        if let Payload::Forward(segs) = payload {
            if segs.len() > slot.segs.len() {
                return Err(SubmitError::TooLarge(len));
            }
            slot.nsegs = segs.len() as u16;
            slot.segs[..segs.len()].copy_from_slice(segs);
        } else if !matches!(payload, Payload::None) {
            let Some(arenas) = self.arenas.as_mut() else {
                return Err(SubmitError::Broken(ChannelError::Setup("a forwarding queue carries no data of its own".into())));
            };
            let n = len as usize;
            if n == 0 {
                return Err(SubmitError::TooLarge(0));
            }
            if len > (self.arena_bytes as u64).min(MAX_REQUEST_BYTES) || len > u32::MAX as u64 {
                return Err(SubmitError::TooLarge(len));
            }
            let which = if op == Op::Write { ARENA_WRITE } else { ARENA_READ };
            let alloc = if which == ARENA_WRITE { &mut arenas.walloc } else { &mut arenas.ralloc };
            arena_off = alloc.alloc(n).ok_or(SubmitError::Full)?;
            arena_len = n;
            match payload {
                Payload::Bytes(data) => {
                    let win = arenas.w.slice(arena_off, n).expect("allocator stays inside the arena");
                    win.copy_from(data).expect("frontend maps the write arena read-write");
                }
                Payload::Gather(bufs) => {
                    let mut at = arena_off;
                    for b in bufs.iter() {
                        let win = arenas.w.slice(at, b.len()).expect("allocator stays inside the arena");
                        b.copy_to_shared(&win).expect("frontend maps the write arena read-write");
                        at += b.len();
                    }
                }
                Payload::Fill(fill) => {
                    if let Err(e) = fill(arenas.w.slice(arena_off, n).expect("allocator stays inside the arena")) {
                        // Nothing of it is placed: the window goes back, unwritten data and all.
                        arenas.walloc.free(arena_off, n);
                        return Err(SubmitError::Fill(e));
                    }
                }
                Payload::None | Payload::ReadSpace | Payload::Forward(_) => {}
            }
            slot.nsegs = 1;
            slot.segs[0] = Segment { arena: which, len: n as u32, offset: arena_off as u64 };
        }
        let index = self.free.pop().expect("checked non-empty");
        self.seq += 1;
        let id = (self.seq << INDEX_BITS) | index as u64;
        slot.id = id;
        slot.op = op_code(op);
        slot.offset = offset;
        slot.len = len;
        self.table[index as usize] =
            Entry { live: true, id, user, op, offset, len, fua, arena_off, arena_len, submitted_ns: self.clock() };
        self.last_placed = index as usize;
        self.ring.push(&slot).expect("space checked above");
        Ok(())
    }

    /// Places a write of the data in `bufs` (copied into this end's write arena) at `offset`.
    pub fn push_gather(&mut self, offset: u64, bufs: &SliceList<'_>, fua: bool, user: u64) -> Result<(), SubmitError> {
        self.place(Op::Write, offset, bufs.total_len(), Payload::Gather(bufs), fua, user)
    }

    /// Places a write of `len` bytes at `offset` whose data `fill` writes into the write-arena
    /// window it is given (exactly `len` bytes; called once, when there is room for the
    /// request). If `fill` fails, nothing is placed and its error is returned.
    pub fn push_write_with(
        &mut self,
        offset: u64,
        len: u64,
        fua: bool,
        user: u64,
        fill: &mut dyn FnMut(SharedSlice<'_>) -> Result<(), FillError>,
    ) -> Result<(), SubmitError> {
        self.place(Op::Write, offset, len, Payload::Fill(fill), fua, user)
    }

    /// Makes pushed requests visible with one release store and rings the driver if it sleeps.
    pub fn publish(&mut self) {
        if self.ring.publish() {
            self.stats.kicks += 1;
            self.kick.ring();
        }
    }

    /// [`push`](Self::push) then [`publish`](Self::publish).
    pub fn submit(&mut self, req: FrontRequest<'_>, user: u64) -> Result<(), SubmitError> {
        self.push(req, user)?;
        self.publish();
        Ok(())
    }

    fn validate(&self, rsp: &ResponseSlot) -> Result<(usize, Result<u64, Status>), ChannelError> {
        let index = (rsp.id & ((1 << INDEX_BITS) - 1)) as usize;
        let e = self.table.get(index).ok_or(ChannelError::BadResponse { id: rsp.id, why: "unknown id" })?;
        if !e.live || e.id != rsp.id {
            return Err(ChannelError::BadResponse { id: rsp.id, why: "unknown or duplicate id" });
        }
        if rsp.generation != self.generation {
            return Err(ChannelError::BadResponse { id: rsp.id, why: "stale generation" });
        }
        let status = status_of_code(rsp.status).ok_or(ChannelError::BadResponse { id: rsp.id, why: "unknown status" })?;
        if rsp.len > e.len {
            return Err(ChannelError::BadResponse { id: rsp.id, why: "length beyond the request" });
        }
        let data_op = matches!(e.op, Op::Read | Op::Write);
        let result = match status {
            // A data request is all or nothing: a short transfer is reported as an I/O error.
            Status::Ok if data_op && rsp.len != e.len => Err(Status::IoError),
            Status::Ok => Ok(rsp.len),
            s => Err(s),
        };
        Ok((index, result))
    }

    /// Times each request from its submission to its answer ([`Completion::latency_ns`]): two
    /// clock reads per request (~20 ns each), which the device client pays for its metrics
    /// and a bare channel does not.
    pub fn set_timed(&mut self, timed: bool) {
        self.timed = timed;
    }

    fn clock(&self) -> u64 {
        if self.timed {
            now_ns()
        } else {
            0
        }
    }

    /// Validates and delivers every published response. A response that does not match an
    /// outstanding request breaks the channel: the error is returned and outstanding requests
    /// stay in the shadow table for reissue.
    pub fn reap(&mut self, mut f: impl FnMut(Completion<'_>)) -> Result<usize, ChannelError> {
        if let Some(e) = &self.broken {
            return Err(e.clone());
        }
        let mut n = 0;
        loop {
            let rsp = match self.ring.pop_response() {
                Ok(Some(r)) => r,
                Ok(None) => break,
                Err(RingError::IndexOutOfRange { prod, cons, .. }) => {
                    return Err(self.mark_broken(ChannelError::Protocol(format!(
                        "response index {prod} beyond outstanding requests (consumer {cons})"
                    ))))
                }
                Err(e) => return Err(self.mark_broken(ChannelError::Protocol(e.to_string()))),
            };
            let (index, result) = match self.validate(&rsp) {
                Ok(v) => v,
                Err(e) => return Err(self.mark_broken(e)),
            };
            let e = self.table[index];
            let data = match &self.arenas {
                Some(a) if e.op == Op::Read && result.is_ok() && e.arena_len > 0 => {
                    Some(a.r.slice(e.arena_off, e.arena_len).expect("allocator stays inside the arena"))
                }
                _ => None,
            };
            let latency_ns = if self.timed { now_ns().saturating_sub(e.submitted_ns) } else { 0 };
            f(Completion { user: e.user, result, data, op: e.op, len: e.len, latency_ns });
            self.retire(index);
            self.stats.completed += 1;
            n += 1;
        }
        if n > 0 {
            self.ring.finish_responses();
            // A response ends a run of empty wake-ups, however it was found: a ring left over
            // from a sleep or an arm that found its response already there wakes the next
            // sleep with nothing new, and a waiter that finds its answers by spinning or
            // polling must not count those into a storm.
            self.spurious = 0;
        }
        Ok(n)
    }

    /// Places every request this queue has without a response into `newer` (the same queue of
    /// the next generation, of the same geometry), in the order they were first submitted, with
    /// the same user tokens; a write's data is copied from this queue's write arena, which only
    /// this end ever wrote. Publishes them; returns how many. This queue is left as it was: drop
    /// it afterwards. Requests of a forwarding end cannot move (their windows belong to the
    /// channel above): an error.
    pub fn reissue_onto(&self, newer: &mut FrontQueue) -> Result<usize, SubmitError> {
        let mut live: Vec<Entry> = self.table.iter().filter(|e| e.live).copied().collect();
        live.sort_unstable_by_key(|e| e.id >> INDEX_BITS);
        let mut data = Vec::new();
        for e in &live {
            let req = match e.op {
                Op::Read => FrontRequest::Read { offset: e.offset, into: e.len },
                Op::Write => {
                    let arenas = self.arenas.as_ref().ok_or_else(|| {
                        SubmitError::Broken(ChannelError::Setup("a forwarding queue's requests cannot move".into()))
                    })?;
                    data.resize(e.arena_len, 0);
                    arenas.w.slice(e.arena_off, e.arena_len).expect("allocator stays inside the arena").copy_to(&mut data);
                    FrontRequest::Write { offset: e.offset, from: &data, fua: e.fua }
                }
                Op::Flush => FrontRequest::Flush,
                Op::Discard => FrontRequest::Discard { offset: e.offset, len: e.len },
                Op::WriteZeroes => FrontRequest::WriteZeroes { offset: e.offset, len: e.len },
            };
            newer.push(req, e.user)?;
            // It was asked for when it first was.
            newer.table[newer.last_placed].submitted_ns = e.submitted_ns;
        }
        if !live.is_empty() {
            newer.publish();
            newer.sleep_first = true;
        }
        Ok(live.len())
    }

    /// Frees the shadow-table entry at `index` and its arena space.
    fn retire(&mut self, index: usize) {
        let e = self.table[index];
        if let (Some(a), true) = (&mut self.arenas, e.arena_len > 0) {
            match e.op {
                Op::Read => a.ralloc.free(e.arena_off, e.arena_len),
                Op::Write => a.walloc.free(e.arena_off, e.arena_len),
                Op::Flush | Op::Discard | Op::WriteZeroes => {}
            }
        }
        self.table[index].live = false;
        self.free.push(index as u32);
    }

    /// Gives up every request without a response (the device failed), calling `f` with each
    /// one's user token, and frees their arena space. The ring still counts them: the queue
    /// takes no more requests and is replaced when the device is revived.
    pub fn abandon(&mut self, mut f: impl FnMut(u64)) {
        for index in 0..self.table.len() {
            let e = self.table[index];
            if !e.live {
                continue;
            }
            f(e.user);
            self.retire(index);
        }
    }

    /// Waits until a response is published or the doorbell rings, following the queue's
    /// notification mode, or until `timeout_ms` passes. Returns `Ok(false)` on timeout. A ring
    /// with no response (spurious, or the supervisor waking the caller) also returns `Ok(true)`:
    /// callers reap and look again.
    pub fn wait(&mut self, timeout_ms: i32) -> Result<bool, ChannelError> {
        self.wait_or(timeout_ms, &std::sync::atomic::AtomicBool::new(false))
    }

    /// As [`wait`](Self::wait), but also returns `Ok(false)` as soon as `abort` is set (checked
    /// while spinning; a sleeper must be rung as well).
    pub fn wait_or(&mut self, timeout_ms: i32, abort: &std::sync::atomic::AtomicBool) -> Result<bool, ChannelError> {
        if let Some(e) = &self.broken {
            return Err(e.clone());
        }
        if self.ring.response_pending() {
            if self.yield_after != 0 {
                self.handoff.arrived();
            }
            return Ok(true);
        }
        let spin = match self.mode {
            NotifyMode::Irq => 0,
            NotifyMode::Poll => u64::MAX,
            NotifyMode::Adaptive if std::mem::take(&mut self.sleep_first) => 0,
            NotifyMode::Adaptive => self.budget.budget_ns(),
        };
        // The clock is read every 64 turns of the spin. A budget that does not tune needs no
        // reading at the start either: the wait starts at the first look at the clock, and a
        // polled response (well under a microsecond) costs no clock read at all.
        let tunes = self.budget.tunes();
        let mut start = if tunes { now_ns() } else { 0 };
        let mut deadline = None;
        let mut i = 0u32;
        let yields = self.yield_after != 0;
        // Once the driver is seen on this CPU every look yields: a look that spins only
        // keeps the driver off the CPU.
        let yield_from = if yields && self.handoff.yield_first() { 0 } else { self.yield_after };
        loop {
            if self.ring.response_pending() {
                if tunes || deadline.is_some() {
                    let spun = now_ns() - start;
                    self.stats.spin_ns += spun;
                    if tunes {
                        self.budget.record(spun);
                    }
                }
                if yields {
                    self.handoff.arrived();
                }
                return Ok(true);
            }
            if yields && i >= yield_from {
                self.stats.yielded_first += u64::from(i == 0);
                self.handoff.yield_now();
            } else {
                std::hint::spin_loop();
            }
            i = i.wrapping_add(1);
            if i.is_multiple_of(64) {
                let now = now_ns();
                let deadline = *deadline.get_or_insert_with(|| {
                    if !tunes {
                        start = now;
                    }
                    if timeout_ms < 0 {
                        u64::MAX
                    } else {
                        start + timeout_ms as u64 * 1_000_000
                    }
                });
                if now >= deadline || abort.load(std::sync::atomic::Ordering::Relaxed) {
                    self.stats.spin_ns += now - start;
                    self.handoff.abandoned();
                    return Ok(false);
                }
                if now - start >= spin {
                    self.stats.spin_ns += now - start;
                    break;
                }
                // Spinning while threads wait for a CPU delays the very thread whose work
                // ends this wait: ask now and then, and sleep if so.
                if self.mode == NotifyMode::Adaptive && self.crowd.should_sleep(start, now) {
                    self.stats.spin_ns += now - start;
                    self.stats.crowded += 1;
                    break;
                }
            }
        }
        let deadline = deadline.expect("the spin reads the clock before it gives up");
        // Sleep: publish SLEEPING + event index, re-check, block.
        self.handoff.abandoned();
        if self.ring.prepare_sleep() {
            self.ring.set_running();
            if tunes {
                self.budget.record(now_ns() - start);
            }
            self.spurious = 0;
            return Ok(true);
        }
        self.stats.sleeps += 1;
        let now = now_ns();
        if now < self.damped_until {
            // A storming doorbell says nothing: look at the ring on a timer instead. The
            // supervisor's wake-ups are seen within one nap, as callers re-check their state.
            self.ring.set_running();
            self.irq.drain();
            let nap = (STORM_NAP_US * 1000).min(deadline.saturating_sub(now));
            std::thread::sleep(std::time::Duration::from_nanos(nap));
            self.stats.sleep_ns += now_ns() - now;
            return Ok(self.ring.response_pending() || now_ns() < deadline);
        }
        let left = if deadline == u64::MAX { -1 } else { (deadline.saturating_sub(now) / 1_000_000) as i32 };
        let rung = self.irq.wait(left).map_err(|e| ChannelError::Setup(e.to_string()));
        self.stats.sleep_ns += now_ns() - now;
        let rung = rung?;
        self.ring.set_running();
        let answered = self.ring.response_pending();
        self.note_wake(rung, answered);
        // A ring without a response is not ignored: the supervisor rings to say the channel was
        // replaced, and the caller must look at its state.
        Ok(rung || answered)
    }

    /// For a caller that sleeps on more than this queue (an export waiting on its own ring as
    /// well): says this side is about to sleep, so the driver rings [`irq_fd`](Self::irq_fd)
    /// for the next response. `false` when a response is already there, the queue is broken,
    /// or it runs in `poll` mode (the driver never rings): nothing is armed, reap instead of
    /// sleeping. After an armed sleep, whether woken by this queue or not, call
    /// [`disarm`](Self::disarm).
    pub fn arm(&mut self) -> bool {
        // In `poll` mode the driver never rings: its peer is taken to spin.
        if self.mode == NotifyMode::Poll || self.broken.is_some() || self.ring.response_pending() {
            return false;
        }
        if self.ring.prepare_sleep() {
            self.ring.set_running();
            return false;
        }
        self.stats.sleeps += 1;
        self.armed_at = now_ns();
        true
    }

    /// Ends an armed sleep: the driver stops ringing, and a ring that came is consumed. Rings
    /// that keep coming with no response are a storm, as in [`wait`](Self::wait): the queue is
    /// then [`damped`](Self::damped) for a while and its stats count the storm.
    pub fn disarm(&mut self) {
        if self.armed_at != 0 {
            self.stats.sleep_ns += now_ns().saturating_sub(self.armed_at);
            self.armed_at = 0;
        }
        self.ring.set_running();
        let rung = self.irq.drain() > 0;
        let answered = self.ring.response_pending();
        self.note_wake(rung, answered);
    }

    /// Counts a wake-up: `STORM_WAKES` rings in a row with no response are a storm, and the
    /// doorbell is ignored for `STORM_DAMP_MS`.
    fn note_wake(&mut self, rung: bool, answered: bool) {
        if rung && !answered {
            self.spurious += 1;
            if self.spurious >= STORM_WAKES {
                self.spurious = 0;
                self.stats.storms += 1;
                self.damped_until = now_ns() + STORM_DAMP_MS * 1_000_000;
            }
        } else if answered {
            self.spurious = 0;
        }
    }

    /// Whether the doorbell is being ignored after a storm: look at the ring on a timer
    /// instead of arming it.
    pub fn damped(&self) -> bool {
        self.damped_until != 0 && now_ns() < self.damped_until
    }

    /// Submits one request and waits for its completion, calling `on_data` with the read data.
    /// Other completions that arrive meanwhile are delivered to `others`.
    pub fn execute(
        &mut self,
        req: FrontRequest<'_>,
        timeout_ms: i32,
        mut on_data: impl FnMut(SharedSlice<'_>),
    ) -> Result<Result<u64, Status>, SubmitError> {
        const TOKEN: u64 = u64::MAX;
        self.submit(req, TOKEN)?;
        let mut out = None;
        while out.is_none() {
            self.reap(|c| {
                if c.user == TOKEN {
                    if let Some(d) = c.data {
                        on_data(d);
                    }
                    out = Some(c.result);
                }
            })?;
            if out.is_none() && !self.wait(timeout_ms)? {
                let e = ChannelError::Timeout(timeout_ms as u64);
                return Err(SubmitError::Broken(e));
            }
        }
        Ok(out.expect("loop ends with a result"))
    }
}
