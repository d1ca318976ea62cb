//! `channel`: the end of a tap domain's chain in `interpose` mode — the device channel to the
//! domain below, whose frontend this domain is.
//!
//! The channel below shares the arenas of the channel above (queue for queue): a request is
//! passed on naming the very windows it came in, so nothing is copied; a read's data lands in
//! the upper read arena where the frontend asked for it. Each request goes down on the queue
//! whose arenas hold its windows; one without data on the next queue in turn. The domain below
//! is untrusted like any driver: every response is validated by [`FrontQueue`], and one that
//! breaks the protocol makes the channel [`lost`](Backend::lost): this domain then ends without
//! answering the batch, and the supervisor restarts both domains, the frontend reissuing every
//! unanswered request.
//!
//! When the domain below dies, the supervisor replaces it alone ([`BelowControl`]): this domain
//! starts its queues below over as the new generation, sends again every request of the batch
//! in hand that had no answer, and carries on; the frontend above sees a pause.

use crate::BackendError;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use arrayvec::ArrayVec;
use bulkhead_block::SetupError;
use bulkhead_block::{Backend, BlockError, Caps, Io, Remote, Request, Upkeep};
use bulkhead_channel::{ArenaWindows, BelowControl, FrontQueue, FrontRequest, Op, Segment, SubmitError, ARENA_READ, ARENA_WRITE};

/// Longest one wait for the domain below, ms; the supervisor's watchdog decides before this.
const WAIT_SLICE_MS: i32 = 100;

/// Most segments a request names.
const MAX_SEGS: usize = bulkhead_shmem::MAX_SLICES;

/// The channel to the domain below.
#[derive(Debug)]
pub struct ChannelBackend {
    queues: Vec<FrontQueue>,
    /// Where this domain maps the arenas of each queue above (the same files as below).
    windows: Vec<ArenaWindows>,
    size: u64,
    next: usize,
    lost: Option<String>,
    stop: Arc<AtomicBool>,
    /// Scratch: the queue below each request of a batch goes to.
    route: Vec<usize>,
    /// The supervisor's line about replacing the domain below, and the generation below now.
    control: Option<BelowControl>,
    generation: u32,
    /// The queues below have arenas of their own (see [`bulkhead_channel::LowerQueue`]): each
    /// request's data is copied into them and out, and the domain below never sees the
    /// channel above.
    private: bool,
}

/// How sending one queue's part of a batch ended.
enum Sent {
    /// Every request has its answer.
    Answered,
    /// The domain below was replaced meanwhile and the queues started over: send again what
    /// has no answer.
    StartedOver,
}

/// Where one request goes below: its queue, operation and windows.
struct Route {
    queue: usize,
    op: Op,
    segs: ArrayVec<Segment, MAX_SEGS>,
}

impl ChannelBackend {
    /// Over the forwarding frontend ends `queues` (queue `i` sharing the arenas the upper
    /// queue `i` maps at `windows[i]`), for a device of `size` bytes; `stop` (the domain's stop
    /// flag) ends a wait.
    /// flag) ends a wait. With `control`, a domain below that dies is replaced alone.
    pub fn new(
        queues: Vec<FrontQueue>,
        windows: Vec<ArenaWindows>,
        size: u64,
        stop: Arc<AtomicBool>,
        control: Option<BelowControl>,
    ) -> Self {
        assert!(!queues.is_empty() && queues.len() == windows.len(), "one upper arena pair per queue below");
        let generation = queues[0].generation();
        let private = queues[0].carries_data();
        assert!(queues.iter().all(|q| q.carries_data() == private), "every queue below private, or none");
        ChannelBackend { queues, windows, size, next: 0, lost: None, stop, route: Vec::new(), control, generation, private }
    }

    /// Starts the queues below over if the supervisor has replaced the domain below; returns
    /// whether it did.
    fn start_over_if_asked(&mut self) -> Result<bool, BackendError> {
        let Some(g) = self.control.as_ref().and_then(|c| c.wanted(self.generation)) else {
            return Ok(false);
        };
        for q in &mut self.queues {
            q.restart(g).map_err(|e| BackendError::link(format!("starting the channel below over: {e}")))?;
        }
        self.generation = g;
        if let Some(c) = &self.control {
            c.report_ready(g);
        }
        Ok(true)
    }

    /// The queue and windows of a request, or why it cannot go down.
    fn route(&mut self, req: &Request<'_>) -> Result<Route, BlockError> {
        let (op, arena, bufs) = match req {
            Request::Read { into: bufs, .. } => (Op::Read, ARENA_READ, Some(bufs)),
            Request::Write { from: bufs, .. } => (Op::Write, ARENA_WRITE, Some(bufs)),
            Request::Flush => (Op::Flush, 0, None),
            Request::Discard { .. } => (Op::Discard, 0, None),
            Request::WriteZeroes { .. } => (Op::WriteZeroes, 0, None),
        };
        // Queues with arenas of their own take any request: the data is copied.
        let Some(bufs) = bufs.filter(|_| !self.private) else {
            self.next = (self.next + 1) % self.queues.len();
            return Ok(Route { queue: self.next, op, segs: ArrayVec::new() });
        };
        let first = bufs.iter().next().ok_or(BlockError::Invalid("data request without a window"))?;
        let queue = self
            .windows
            .iter()
            .position(|w| w.segment(arena, first.as_ptr() as usize, first.len()).is_some())
            .ok_or(BlockError::Invalid("buffer outside the channel's arenas"))?;
        let mut segs = ArrayVec::new();
        for b in bufs.iter() {
            let s = self.windows[queue]
                .segment(arena, b.as_ptr() as usize, b.len())
                .ok_or(BlockError::Invalid("buffer outside the channel's arenas"))?;
            segs.try_push(s).map_err(|_| BlockError::Invalid("too many windows"))?;
        }
        Ok(Route { queue, op, segs })
    }

    fn push(q: &mut FrontQueue, req: &Request<'_>, route: &Route, user: u64) -> Result<(), SubmitError> {
        let (offset, len) = req.range();
        let fua = matches!(req, Request::Write { fua: true, .. });
        if !q.carries_data() {
            return q.push_forward(route.op, offset, len, &route.segs, fua, user);
        }
        match req {
            Request::Read { .. } => q.push(FrontRequest::Read { offset, into: len }, user),
            Request::Write { from: bufs, .. } => q.push_gather(offset, bufs, fua, user),
            Request::Flush => q.push(FrontRequest::Flush, user),
            Request::Discard { .. } => q.push(FrontRequest::Discard { offset, len }, user),
            Request::WriteZeroes { .. } => q.push(FrontRequest::WriteZeroes { offset, len }, user),
        }
    }

    /// Sends the requests of `ios` routed to queue `qi` and waits for all of them, sending
    /// again those without an answer whenever the domain below is replaced meanwhile.
    fn run_queue(&mut self, qi: usize, ios: &mut [Io<'_>], routes: &[Option<Route>]) -> Result<(), BackendError> {
        while let Sent::StartedOver = self.send_queue(qi, ios, routes)? {}
        Ok(())
    }

    /// One try of [`run_queue`](Self::run_queue): sends what has no answer yet.
    fn send_queue(&mut self, qi: usize, ios: &mut [Io<'_>], routes: &[Option<Route>]) -> Result<Sent, BackendError> {
        let mine: ArrayVec<usize, 64> = routes
            .iter()
            .enumerate()
            .filter(|(i, r)| r.as_ref().is_some_and(|r| r.queue == qi) && ios[*i].result == Err(BlockError::NotDone))
            .map(|(i, _)| i)
            .collect();
        let (mut sent, mut pending) = (0, 0usize);
        while sent < mine.len() || pending > 0 {
            let q = &mut self.queues[qi];
            while sent < mine.len() {
                let i = mine[sent];
                let route = routes[i].as_ref().expect("routed");
                match Self::push(q, &ios[i].req, route, i as u64) {
                    Ok(()) => pending += 1,
                    Err(SubmitError::Full) if pending > 0 => break,
                    Err(SubmitError::Full | SubmitError::TooLarge(_)) => {
                        ios[i].result = Err(BlockError::Invalid("request larger than the channel below"))
                    }
                    // This end forwards windows or copies slices: it never fills one.
                    Err(SubmitError::Fill(_)) => ios[i].result = Err(BlockError::Invalid("a write's data could not be read")),
                    Err(SubmitError::Broken(e)) => return Err(BackendError::link(format!("channel to the domain below: {e}"))),
                }
                sent += 1;
            }
            q.publish();
            if pending == 0 {
                break;
            }
            let waited = q.wait_or(WAIT_SLICE_MS, &self.stop);
            if self.stop.load(Ordering::Relaxed) {
                return Err(BackendError::link("stopping"));
            }
            // A domain below that died leaves its requests unanswered: once the supervisor has
            // replaced it, they go again to the new one.
            if self.start_over_if_asked()? {
                return Ok(Sent::StartedOver);
            }
            waited.map_err(|e| BackendError::link(format!("channel to the domain below: {e}")))?;
            let q = &mut self.queues[qi];
            let reaped = q.reap(|c| {
                let io = &mut ios[c.user as usize];
                io.result = c.result.map_err(|status| BlockError::Os {
                    op: io.req.op().as_str(),
                    offset: io.req.range().0,
                    errno: status.errno(),
                });
                // A private queue's read landed in its own arena: copy it up.
                if let (Some(data), Request::Read { into: bufs, .. }) = (c.data, &io.req) {
                    let mut at = 0;
                    for w in bufs.iter() {
                        let part = data.sub(at, w.len()).expect("the response is the read's length");
                        if part.copy_to_shared(&w).is_err() {
                            io.result = Err(BlockError::Invalid("read into read-only memory"));
                        }
                        at += w.len();
                    }
                }
            });
            pending -= reaped.map_err(|e| BackendError::link(format!("channel to the domain below: {e}")))?;
        }
        Ok(Sent::Answered)
    }
}

impl Backend for ChannelBackend {
    fn size(&self) -> u64 {
        self.size
    }

    fn caps(&self) -> Caps {
        // The domain below answers what it cannot do with its own status.
        Caps { flush: true, fua: true, discard: true, write_zeroes: true, read_only: false }
    }

    fn execute(&mut self, ios: &mut [Io<'_>]) {
        for chunk in ios.chunks_mut(64) {
            self.execute_chunk(chunk);
        }
    }

    fn remote(&mut self) -> Option<&mut dyn Remote> {
        Some(self)
    }

    fn upkeep(&mut self) -> Option<&mut dyn Upkeep> {
        // Only a tap domain's channel below is started over by a line from the supervisor.
        if self.control.is_some() {
            Some(self)
        } else {
            None
        }
    }
}

/// The domain below is outside this one: it may break the channel or go away.
impl Remote for ChannelBackend {
    fn start(&mut self) -> Result<(), SetupError> {
        Ok(())
    }

    fn lost(&self) -> Option<&str> {
        self.lost.as_deref()
    }
}

impl Upkeep for ChannelBackend {
    fn wake_fd(&self) -> std::os::fd::RawFd {
        self.control.as_ref().map_or(-1, BelowControl::wake_fd)
    }

    fn tend(&mut self) {
        if let Some(c) = &self.control {
            c.drain();
        }
        if self.lost.is_none() {
            if let Err(e) = self.start_over_if_asked() {
                self.lost = Some(e.to_string());
            }
        }
    }
}

impl ChannelBackend {
    fn execute_chunk(&mut self, ios: &mut [Io<'_>]) {
        if self.lost.is_some() {
            return;
        }
        let mut used = std::mem::take(&mut self.route);
        used.clear();
        let mut routes: ArrayVec<Option<Route>, 64> = ArrayVec::new();
        for io in ios.iter_mut() {
            match self.route(&io.req) {
                Ok(r) => {
                    if !used.contains(&r.queue) {
                        used.push(r.queue);
                    }
                    routes.push(Some(r));
                }
                Err(e) => {
                    io.result = Err(e);
                    routes.push(None);
                }
            }
        }
        for &qi in &used {
            if let Err(why) = self.run_queue(qi, ios, &routes) {
                self.lost = Some(why.to_string());
                break;
            }
        }
        self.route = used;
    }
}
