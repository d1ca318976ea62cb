//! A virtqueue's worker: one thread per started queue that takes the guest's requests, sends
//! them down the device's channel queue, and returns them to the guest when the device answers.
//!
//! It waits the way the other exports do: while idle it spins for an adaptive budget
//! (`IdleSpin`), with the guest's kicks suppressed (EVENT_IDX), and only then arms kicks and
//! the device's doorbell and sleeps. Data is copied between guest buffers and the channel's
//! arenas here, in `serve`: the driver domain sees the arena, never the guest.

use std::collections::VecDeque;
use std::os::fd::{AsFd, AsRawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use bulkhead_block::Command;
use bulkhead_client::{Armed, Device, FrontRequest, IoError, QueueHandle, QueueLine, SharedSlice, Status};
use bulkhead_doorbell::{now_ns, BudgetPolicy, IdleSpin, NotifyMode};
use bulkhead_sys::eventfd::EventFd;
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, VolatileSlice};

use crate::blk::{self, BlkOp, Geometry, Parsed, S_IOERR, S_OK, S_UNSUPP};
use crate::inflight::InflightQueue;
use crate::memory::GuestMem;
use crate::virtq::{Chain, RingError, RingPosition, Seg, Vring};

/// Heads taken from the available ring in one round before answers are looked at.
const TAKE_BATCH: usize = 64;
/// Sleep while waiting for a queue another user holds, or for the next generation, ms.
const LATER_MS: i32 = 1;
/// Longest sleep before the loop looks at its device and stop flag again, ms.
const SLICE_MS: i32 = 50;
/// Quiet time (nothing taken, nothing answered) after which a driver still waiting to hear of
/// used entries is called again, ns.
const RECALL_AFTER_NS: u64 = SLICE_MS as u64 * 1_000_000;

/// Counters of one virtqueue, read by `status`.
#[derive(Debug, Default)]
pub struct QueueStats {
    /// Requests taken from the guest.
    pub taken: AtomicU64,
    /// Requests returned to the guest.
    pub returned: AtomicU64,
    /// Requests refused as malformed or not supported.
    pub refused: AtomicU64,
    /// Requests the device failed.
    pub failed: AtomicU64,
    /// Requests served again from the in-flight record after a restart of `serve`.
    pub resubmitted: AtomicU64,
    /// Most requests in flight at the device at once.
    pub max_in_flight: AtomicU64,
    /// Calls (interrupts) sent to the guest.
    pub calls: AtomicU64,
    /// Calls sent again to a guest left waiting for entries already used (see
    /// [`Vring::call_missed`]).
    pub recalls: AtomicU64,
    /// The queue stopped on an error of the ring (the reason is logged).
    pub broken: AtomicBool,
}

/// A descriptor that may be replaced while the worker runs (the frontend changes its call and
/// error descriptors at will).
#[derive(Debug, Default)]
pub struct Notifier(Mutex<Option<EventFd>>);

impl Notifier {
    /// Replaces the descriptor.
    pub fn set(&self, fd: Option<EventFd>) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = fd;
    }

    /// Signals it, if there is one.
    pub fn signal(&self) {
        if let Some(fd) = self.0.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
            fd.ring();
        }
    }
}

/// How a worker is told to stop.
#[derive(Debug)]
pub struct Stop {
    flag: AtomicBool,
    wake: EventFd,
}

impl Stop {
    /// A signal not yet given.
    pub fn new() -> std::io::Result<Stop> {
        Ok(Stop { flag: AtomicBool::new(false), wake: EventFd::new()? })
    }

    /// Asks the worker to stop: it takes no more requests, finishes those it has, and ends.
    pub fn request(&self) {
        self.flag.store(true, Ordering::Release);
        self.wake.ring();
    }

    fn requested(&self) -> bool {
        self.flag.load(Ordering::Acquire)
    }
}

/// What a worker needs.
pub struct QueueWork {
    /// The device and the channel queue this virtqueue uses.
    pub dev: Arc<Device>,
    /// Which channel queue.
    pub slot: usize,
    /// The device's name, for the log.
    pub name: String,
    /// The virtqueue's index, for the log.
    pub index: u16,
    /// The ring.
    pub ring: Vring,
    /// What the configuration space says.
    pub geo: Arc<Geometry>,
    /// The in-flight record, when the frontend keeps one.
    pub inflight: Option<InflightQueue>,
    /// Heads to serve again first (from the in-flight record), oldest first.
    pub resubmit: Vec<u16>,
    /// The guest's kick.
    pub kick: EventFd,
    /// The device's call.
    pub call: Arc<Notifier>,
    /// The error descriptor, signalled when the ring breaks.
    pub err: Arc<Notifier>,
    /// The stop signal.
    pub stop: Arc<Stop>,
    /// Counters.
    pub stats: Arc<QueueStats>,
}

/// Where a request stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    /// Not taken.
    Free,
    /// Taken, waiting for room at the device.
    Waiting,
    /// At the device.
    Device,
}

/// One head's request.
#[derive(Debug)]
struct Req {
    stage: Stage,
    status: GuestAddress,
    cmd: Command<u32, u32>,
    data: Vec<Seg>,
}

/// The part of a worker that completions touch.
struct Served {
    ring: Vring,
    inflight: Option<InflightQueue>,
    reqs: Vec<Req>,
    stats: Arc<QueueStats>,
    /// Returned since the last call.
    unsignalled: usize,
}

impl Served {
    fn mem(&self) -> &GuestMem {
        self.ring.memory()
    }

    /// Writes `code` to the status byte and returns `head` with `len` bytes written.
    fn finish(&mut self, head: u16, status: Option<(GuestAddress, u8)>, len: u32) -> Result<(), RingError> {
        if let Some((at, code)) = status {
            self.mem().memory().write_obj(code, at).map_err(|e| RingError::Memory(e.to_string()))?;
        }
        let used = self.ring.position().next_used;
        if let Some(q) = &self.inflight {
            q.returning(head, used);
        }
        self.ring.push_used(head, len)?;
        if let Some(q) = &self.inflight {
            q.returned(head, used.wrapping_add(1));
        }
        self.reqs[usize::from(head)].stage = Stage::Free;
        self.stats.returned.fetch_add(1, Ordering::Relaxed);
        self.unsignalled += 1;
        Ok(())
    }

    /// The device answered `head`.
    fn answer(&mut self, head: u16, result: Result<u64, IoError>, data: Option<SharedSlice<'_>>) -> Result<(), RingError> {
        let Some(req) = self.reqs.get(usize::from(head)).filter(|r| r.stage == Stage::Device) else {
            return Ok(());
        };
        let (status, cmd) = (req.status, req.cmd);
        let code = match (&result, cmd) {
            (Ok(_), Command::Read { into, .. }) => match data {
                Some(d) if d.len() == into as usize => {
                    arena_to_guest(self.mem(), &d, &self.reqs[usize::from(head)].data);
                    S_OK
                }
                _ => S_IOERR,
            },
            (Ok(_), _) => S_OK,
            (Err(IoError::Device(Status::NotSupported)), _) => S_UNSUPP,
            (Err(_), _) => S_IOERR,
        };
        if code != S_OK {
            self.stats.failed.fetch_add(1, Ordering::Relaxed);
        }
        let len = match cmd {
            Command::Read { into, .. } if code == S_OK => into + 1,
            _ => 1,
        };
        self.finish(head, Some((status, code)), len)
    }
}

/// A window of a channel arena as `vm-memory` sees memory.
fn arena_volatile<'a>(s: &'a SharedSlice<'_>) -> VolatileSlice<'a> {
    // SAFETY: `s` is a bounds-checked window of a shared mapping that lives at least as long
    // as the borrow, valid for `s.len()` bytes. No Rust reference is ever formed over it;
    // volatile accesses tolerate the driver domain writing it meanwhile. Read windows are only
    // read through the slice (by `copy_to_volatile_slice` from it), write windows are mapped
    // read-write by this end.
    unsafe { VolatileSlice::new(s.as_ptr().cast_mut(), s.len()) }
}

/// Copies a write's data from guest buffers into the channel window `win`.
fn guest_to_arena(mem: &GuestMem, segs: &[Seg], win: &SharedSlice<'_>) {
    let dst = arena_volatile(win);
    let mut at = 0usize;
    for s in segs {
        let len = s.len as usize;
        // The chain was checked against guest memory when it was taken, and the memory does
        // not change under a running worker: neither slice can fail.
        if let (Ok(src), Ok(to)) = (mem.memory().get_slice(s.addr, len), dst.subslice(at, len)) {
            src.copy_to_volatile_slice(to);
        }
        at += len;
    }
}

/// Copies a read's data from the channel window `win` into guest buffers.
fn arena_to_guest(mem: &GuestMem, win: &SharedSlice<'_>, segs: &[Seg]) {
    let src = arena_volatile(win);
    let mut at = 0usize;
    for s in segs {
        let len = s.len as usize;
        if let (Ok(from), Ok(to)) = (src.subslice(at, len), mem.memory().get_slice(s.addr, len)) {
            from.copy_to_volatile_slice(to);
        }
        at += len;
    }
}

/// How long the worker spins idle, from the device's notification mode.
fn wait_policy(dev: &Device) -> BudgetPolicy {
    if dev.mode() == NotifyMode::Irq {
        BudgetPolicy::Fixed(0)
    } else {
        BudgetPolicy::DEFAULT_AUTO
    }
}

/// Runs a virtqueue until told to stop or until its ring breaks and drains; returns where it
/// stands.
pub fn run(w: QueueWork) -> RingPosition {
    let QueueWork { dev, slot, name, index, ring, geo, inflight, resubmit, kick, call, err, stop, stats } = w;
    let size = usize::from(ring.size());
    let reqs =
        (0..size).map(|_| Req { stage: Stage::Free, status: GuestAddress(0), cmd: Command::Flush, data: Vec::new() }).collect();
    let mut sv = Served { ring, inflight, reqs, stats: stats.clone(), unsignalled: 0 };
    let mut resubmit: VecDeque<u16> = resubmit.into();
    stats.resubmitted.fetch_add(resubmit.len() as u64, Ordering::Relaxed);
    let mut waiting: VecDeque<u16> = VecDeque::with_capacity(size);
    let mut chain = Chain::default();
    let mut handle: Option<QueueHandle<'_>> = None;
    // A place in line for the device's queue while another user holds it.
    let mut line: Option<QueueLine<'_>> = None;
    let mut broken: Option<RingError> = None;
    let mut idle = IdleSpin::new(wait_policy(&dev));
    let yield_after_ns = if dev.mode() == NotifyMode::Poll { 10_000 } else { 0 };
    let mut last_answer = Instant::now();
    // When a quiet queue next looks for a missed call (every RECALL_AFTER_NS while quiet), and
    // the driver's wait last answered with a recall.
    let mut recall_check = now_ns() + RECALL_AFTER_NS;
    let mut recalled: Option<(u16, u16)> = None;
    let mut at_device = 0usize;
    let break_ring = |e: RingError, broken: &mut Option<RingError>| {
        if broken.is_none() {
            log::info!("vhost-user {name} queue {index}: {e}; the queue stops until the frontend resets it");
            stats.broken.store(true, Ordering::Relaxed);
            err.signal();
            *broken = Some(e);
        }
    };
    if let Err(e) = sv.ring.suppress_kicks() {
        break_ring(e, &mut broken);
    }
    // The used ring may hold answers whose interrupt never reached the guest: a `serve` that
    // died between returning a head and calling, or one whose last answers came after the
    // frontend had set its old call aside. One call now costs a spurious interrupt at most.
    call.signal();
    loop {
        let stopping = stop.requested();
        let mut work = 0;
        if !stopping && broken.is_none() {
            match take(&mut sv, &geo, &mut resubmit, &mut waiting, &mut chain) {
                Ok(n) => work += n,
                Err(e) => break_ring(e, &mut broken),
            }
        }
        // Send what waits, oldest first, while the device's queue has room.
        while let Some(&head) = waiting.front() {
            if handle.is_none() {
                handle = dev.poll_queue(slot, &mut line);
            }
            // After its turn, with others in line, the worker only drains.
            let Some(h) = handle.as_mut().filter(|h| !h.turn_over()) else { break };
            let req = &sv.reqs[usize::from(head)];
            let token = u64::from(head);
            let sent = match req.cmd {
                Command::Write { offset, from, .. } => {
                    let (mem, data) = (sv.ring.memory(), &req.data);
                    h.submit_write_with(offset, u64::from(from), false, token, &mut |win| {
                        guest_to_arena(mem, data, &win);
                        Ok(())
                    })
                }
                Command::Read { offset, into } => h.submit(FrontRequest::Read { offset, into: u64::from(into) }, token),
                Command::Flush => h.submit(FrontRequest::Flush, token),
                Command::Discard { offset, len } => h.submit(FrontRequest::Discard { offset, len }, token),
                Command::WriteZeroes { offset, len } => h.submit(FrontRequest::WriteZeroes { offset, len }, token),
            };
            match sent {
                Ok(()) => {
                    waiting.pop_front();
                    sv.reqs[usize::from(head)].stage = Stage::Device;
                    at_device += 1;
                    work += 1;
                }
                Err(IoError::QueueFull) => break,
                Err(e) => {
                    waiting.pop_front();
                    sv.reqs[usize::from(head)].stage = Stage::Device;
                    work += 1;
                    if let Err(e) = sv.answer(head, Err(e), None) {
                        break_ring(e, &mut broken);
                    }
                }
            }
        }
        stats.max_in_flight.fetch_max(at_device as u64, Ordering::Relaxed);
        if let Some(h) = handle.as_mut() {
            let mut failed = None;
            let mut answer = |token: u64, result, data: Option<SharedSlice<'_>>| {
                if let Err(e) = sv.answer(token as u16, result, data) {
                    failed = Some(e);
                }
            };
            let n = h.poll(&mut answer);
            let given_up = h.expire(last_answer, &mut answer);
            if n > 0 {
                last_answer = Instant::now();
            }
            at_device -= n + given_up;
            work += n + given_up;
            if let Some(e) = failed {
                break_ring(e, &mut broken);
            }
            if h.in_flight() == 0 {
                handle = None;
            }
        }
        if sv.unsignalled > 0 {
            sv.unsignalled = 0;
            match sv.ring.needs_call() {
                Ok(true) => {
                    call.signal();
                    stats.calls.fetch_add(1, Ordering::Relaxed);
                }
                Ok(false) => {}
                Err(e) => break_ring(e, &mut broken),
            }
        }
        if (stopping || broken.is_some()) && at_device == 0 && waiting.is_empty() {
            if stopping {
                return sv.ring.position();
            }
            // Broken and drained: wait for the frontend to stop the queue.
            let _ = bulkhead_sys::poll(&mut [pollfd(stop.wake.as_fd().as_raw_fd())], SLICE_MS);
            continue;
        }
        let now = now_ns();
        if work > 0 {
            idle.worked(now);
            recall_check = now + RECALL_AFTER_NS;
            continue;
        }
        // Quiet for a while with nothing outstanding, yet the driver still waits to hear of
        // entries it has not taken: its call is missed (a guest of one vCPU under QEMU TCG 7.2,
        // which drops the guest's barriers, loses the race the event index relies on). Call
        // again, once for each such wait: a driver that polls instead costs one interrupt.
        if now >= recall_check && at_device == 0 && waiting.is_empty() && broken.is_none() {
            // Once a slice, not on every turn of a spinning loop.
            recall_check = now + RECALL_AFTER_NS;
            match sv.ring.call_missed() {
                Ok(Some(mark)) if recalled != Some(mark) => {
                    recalled = Some(mark);
                    call.signal();
                    stats.recalls.fetch_add(1, Ordering::Relaxed);
                }
                Ok(_) => {}
                Err(e) => break_ring(e, &mut broken),
            }
        }
        let answers_due = at_device > 0;
        let spin = if answers_due { idle.spin_for_answers(now) } else { idle.spin(now, true) };
        if spin {
            if idle.idle_ns(now) >= yield_after_ns {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
            continue;
        }
        sleep(&mut sv, &kick, &stop, &mut handle, !waiting.is_empty(), stopping || broken.is_some());
        if let Err(e) = sv.ring.suppress_kicks() {
            break_ring(e, &mut broken);
        }
    }
}

/// Takes new heads (those to serve again first), answering at once what needs no device;
/// returns how many.
fn take(
    sv: &mut Served,
    geo: &Geometry,
    resubmit: &mut VecDeque<u16>,
    waiting: &mut VecDeque<u16>,
    chain: &mut Chain,
) -> Result<usize, RingError> {
    let mut n = 0;
    while n < TAKE_BATCH {
        let head = match resubmit.pop_front() {
            Some(h) => h,
            None => match sv.ring.pop()? {
                Some(h) => {
                    if sv.reqs[usize::from(h)].stage != Stage::Free {
                        return Err(RingError::Memory(format!("head {h} was made available again while in use")));
                    }
                    if let Some(q) = sv.inflight.as_mut() {
                        q.taken(h);
                    }
                    h
                }
                None => break,
            },
        };
        n += 1;
        sv.stats.taken.fetch_add(1, Ordering::Relaxed);
        sv.ring.chain(head, chain)?;
        let req = &mut sv.reqs[usize::from(head)];
        let parsed = blk::parse(sv.ring.memory(), chain, geo, &mut req.data);
        match parsed {
            Parsed::NoStatus => {
                sv.stats.refused.fetch_add(1, Ordering::Relaxed);
                sv.finish(head, None, 0)?;
            }
            Parsed::Refused { status, code, why: _ } => {
                sv.stats.refused.fetch_add(1, Ordering::Relaxed);
                sv.finish(head, Some((status, code)), 1)?;
            }
            Parsed::Request { status, op: BlkOp::GetId } => {
                let written = blk::write_id(sv.ring.memory(), &req.data, &geo.id);
                sv.finish(head, Some((status, S_OK)), written + 1)?;
            }
            Parsed::Request { status, op: BlkOp::Io(cmd) } => {
                req.status = status;
                req.cmd = cmd;
                req.stage = Stage::Waiting;
                waiting.push_back(head);
            }
        }
    }
    Ok(n)
}

fn pollfd(fd: i32) -> libc::pollfd {
    libc::pollfd { fd, events: libc::POLLIN, revents: 0 }
}

/// Sleeps until the guest kicks, the device answers, or the worker is told to stop. With
/// `blocked` (requests wait for a queue someone else holds) or while the device is between
/// generations it looks again soon.
fn sleep(sv: &mut Served, kick: &EventFd, stop: &Stop, handle: &mut Option<QueueHandle<'_>>, blocked: bool, draining: bool) {
    let mut fds = vec![pollfd(kick.as_fd().as_raw_fd()), pollfd(stop.wake.as_fd().as_raw_fd())];
    let mut timeout = SLICE_MS;
    let mut now = false;
    let mut armed = false;
    if let Some(h) = handle.as_mut() {
        match h.arm() {
            Armed::Idle => {}
            Armed::Now => now = true,
            Armed::Spin => {
                // A `poll` device's driver never rings: look again after others had the CPU.
                std::thread::yield_now();
                return;
            }
            Armed::Later => timeout = LATER_MS,
            Armed::Fd(fd) => {
                armed = true;
                fds.push(pollfd(fd));
            }
        }
    }
    if blocked && !armed {
        timeout = LATER_MS;
    }
    // Kicks are wanted from here on; if requests came meanwhile, do not sleep.
    let arrived = !draining && sv.ring.enable_kicks().unwrap_or(true);
    if !now && !arrived {
        let _ = bulkhead_sys::poll(&mut fds, timeout);
    }
    if armed {
        if let Some(h) = handle.as_mut() {
            h.disarm();
        }
    }
    if fds[0].revents != 0 {
        kick.drain();
    }
}
