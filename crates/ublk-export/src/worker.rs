//! One ublk queue's worker: a thread that takes the kernel's requests from the queue's
//! io_uring, sends them down the device's channel queue, and commits each answer back.
//!
//! Data moves once each way, between the kernel's request and the channel's arena: a write's
//! bytes are read from `/dev/ublkcN` straight into the write arena, a read's written from the
//! read arena straight back (`UBLK_F_USER_COPY`). The driver domain sees the arena, never the
//! kernel's pages or any ublk descriptor.
//!
//! It waits as the other exports do: spinning for an adaptive budget while idle, then asleep
//! in the queue's own io_uring, which also watches the device's doorbell (a poll on it) and
//! the worker's stop signal, with a timeout for what must be looked at again.

use std::collections::VecDeque;
use std::mem::ManuallyDrop;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bulkhead_client::{Armed, Device, FillError, FrontRequest, IoError, QueueHandle, QueueLine, SharedSlice};
use bulkhead_doorbell::{now_ns, BudgetPolicy, IdleSpin, NotifyMode};
use bulkhead_sys::eventfd::EventFd;
use io_uring::{opcode, squeue, types, IoUring};
use libublk::io::{with_task_io_ring_mut, UblkDev, UblkIOCtx, UblkQueue};
use libublk::{sys, BufDesc, BufDescList, UblkError, UblkIORes};

/// Marks a completion of the worker's own (a wake-up), not a ublk command's.
const OWN: u64 = libublk::UblkUringData::Target as u64;
/// The worker's stop signal became readable.
const WAKE_STOP: u64 = OWN | 1 << 32;
/// The device's doorbell rang: the low 32 bits number the poll, so that one left over from
/// an earlier generation of the device is told apart.
const WAKE_IRQ: u64 = OWN | 2 << 32;
/// A cancellation of a stale doorbell poll completed.
const CANCELLED: u64 = OWN | 3 << 32;
/// Longest sleep before the loop looks at its device and stop flag again.
const SLICE: Duration = Duration::from_millis(50);
/// Sleep while the device is between generations or its queue is another user's.
const LATER: Duration = Duration::from_millis(1);

/// How a worker is told to stop leaving the device to the next `serve`: it takes nothing new,
/// answers what is at the device, and ends; the kernel keeps the rest for the next server.
#[derive(Debug)]
pub(crate) struct Stop {
    flag: AtomicBool,
    pub(crate) wake: EventFd,
}

impl Stop {
    pub(crate) fn new() -> std::io::Result<Stop> {
        Ok(Stop { flag: AtomicBool::new(false), wake: EventFd::new()? })
    }

    pub(crate) fn request(&self) {
        self.flag.store(true, Ordering::Release);
        self.wake.ring();
    }

    fn requested(&self) -> bool {
        self.flag.load(Ordering::Acquire)
    }
}

/// Counters of one queue, read by `status`.
#[derive(Debug, Default)]
pub struct QueueStats {
    /// Requests taken from the kernel.
    pub taken: AtomicU64,
    /// Requests committed back.
    pub committed: AtomicU64,
    /// Requests answered with an error.
    pub failed: AtomicU64,
    /// Most requests at the device at once.
    pub max_in_flight: AtomicU64,
}

/// What a worker needs.
pub(crate) struct QueueWork<'a> {
    pub udev: &'a UblkDev,
    pub qid: u16,
    pub dev: Arc<Device>,
    /// `/dev/ublkcN`, for the user copies.
    pub cdev: BorrowedFd<'a>,
    pub stop: &'a Stop,
    pub stats: &'a QueueStats,
    /// Where the worker says its thread id, once its queue is set up.
    pub started: std::sync::mpsc::Sender<(u16, i32)>,
}

/// Where a tag's request stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    /// The kernel has not given one.
    Free,
    /// Taken, waiting for room at the device.
    Waiting,
    /// At the device.
    Device,
}

/// One tag's request.
#[derive(Debug, Clone, Copy)]
struct Req {
    stage: Stage,
    op: u32,
    offset: u64,
    len: u64,
    fua: bool,
}

impl Req {
    const FREE: Req = Req { stage: Stage::Free, op: 0, offset: 0, len: 0, fua: false };
}

/// The worker's state between turns.
struct Work<'a> {
    /// Dropped only once the kernel has ended every command of the queue: libublk's drop
    /// unregisters the queue's files, which waits for commands still pending, so a worker
    /// that leaves the device to the next server lets the thread's end close the ring instead
    /// (which cancels them, and the kernel keeps their requests).
    q: ManuallyDrop<UblkQueue<'a>>,
    qid: u16,
    cdev: BorrowedFd<'a>,
    reqs: Vec<Req>,
    waiting: VecDeque<u16>,
    at_device: usize,
    stats: &'a QueueStats,
    /// The kernel is taking the queue down (the device is being stopped).
    down: bool,
    /// The pending doorbell poll: its number and the device generation it watches.
    irq_poll: Option<(u32, u32)>,
    polls: u32,
}

impl Work<'_> {
    /// The kernel's position of `tag`'s data, for the user copies.
    fn pos(&self, tag: u16) -> u64 {
        UblkIOCtx::ublk_user_copy_pos(self.qid, tag, 0)
    }

    /// Commits `tag` with `res` (bytes, or a negative errno).
    fn commit(&mut self, tag: u16, res: i32) {
        let req = &mut self.reqs[usize::from(tag)];
        req.stage = Stage::Free;
        if res < 0 {
            self.stats.failed.fetch_add(1, Ordering::Relaxed);
        }
        self.stats.committed.fetch_add(1, Ordering::Relaxed);
        if self.down {
            return;
        }
        if let Err(e) = self.q.complete_io_cmd_unified(tag, BufDesc::Slice(&[]), Ok(UblkIORes::Result(res))) {
            log::warn!("ublk queue {}: cannot commit tag {tag}: {e}", self.qid);
        }
    }

    /// The kernel gave `tag` a request: take it, or answer at once what needs no device.
    fn take(&mut self, tag: u16) {
        let iod = *self.q.get_iod(tag);
        let op = iod.op_flags & 0xff;
        let req = Req {
            stage: Stage::Waiting,
            op,
            offset: iod.start_sector << 9,
            len: u64::from(iod.nr_sectors) << 9,
            fua: iod.op_flags & sys::UBLK_IO_F_FUA != 0,
        };
        self.stats.taken.fetch_add(1, Ordering::Relaxed);
        match op {
            sys::UBLK_IO_OP_READ
            | sys::UBLK_IO_OP_WRITE
            | sys::UBLK_IO_OP_FLUSH
            | sys::UBLK_IO_OP_DISCARD
            | sys::UBLK_IO_OP_WRITE_ZEROES => {
                self.reqs[usize::from(tag)] = req;
                self.waiting.push_back(tag);
            }
            _ => {
                self.reqs[usize::from(tag)] = req;
                self.commit(tag, -libc::EOPNOTSUPP);
            }
        }
    }

    /// Sends `tag`'s request on `h`.
    fn send(&self, h: &mut QueueHandle<'_>, tag: u16) -> Result<(), IoError> {
        let r = self.reqs[usize::from(tag)];
        let token = u64::from(tag);
        match r.op {
            sys::UBLK_IO_OP_READ => h.submit(FrontRequest::Read { offset: r.offset, into: r.len }, token),
            sys::UBLK_IO_OP_WRITE => {
                let (cdev, pos) = (self.cdev, self.pos(tag));
                h.submit_write_with(r.offset, r.len, r.fua, token, &mut |win: SharedSlice<'_>| {
                    win.read_at(cdev, pos).map_err(|e| FillError(format!("/dev/ublkc: {e}")))
                })
            }
            sys::UBLK_IO_OP_FLUSH => h.submit(FrontRequest::Flush, token),
            sys::UBLK_IO_OP_DISCARD => h.submit(FrontRequest::Discard { offset: r.offset, len: r.len }, token),
            _ => h.submit(FrontRequest::WriteZeroes { offset: r.offset, len: r.len }, token),
        }
    }

    /// The device answered `tag`.
    fn answer(&mut self, tag: u16, result: Result<u64, IoError>, data: Option<SharedSlice<'_>>) {
        let Some(r) = self.reqs.get(usize::from(tag)).copied().filter(|r| r.stage == Stage::Device) else { return };
        self.at_device -= 1;
        let res = match (result, r.op) {
            (Ok(_), sys::UBLK_IO_OP_READ) => match data {
                Some(d) if d.len() as u64 == r.len => match d.write_at(self.cdev, self.pos(tag)) {
                    Ok(()) => r.len as i32,
                    Err(e) => {
                        log::warn!("ublk queue {}: a read's data could not be handed to the kernel: {e}", self.qid);
                        -libc::EIO
                    }
                },
                _ => -libc::EIO,
            },
            (Ok(_), sys::UBLK_IO_OP_WRITE) => r.len as i32,
            (Ok(_), _) => 0,
            (Err(e), _) => -e.errno(),
        };
        self.commit(tag, res);
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

/// Pushes `e` on the ring of `_q` (this thread's: libublk keeps it thread-local), submitted
/// with the next flush or wait.
fn push(_q: &UblkQueue<'_>, e: squeue::Entry) {
    with_task_io_ring_mut(|r: &mut IoUring<squeue::Entry>| {
        // SAFETY: the entries pushed here are polls on descriptors and cancellations, which
        // name no memory; io_uring holds its own reference to a polled file, so the poll is
        // sound even if the descriptor is closed before it completes.
        if unsafe { r.submission().push(&e) }.is_err() {
            // A full submission queue: submit what is there and push again.
            let _ = r.submit();
            // SAFETY: as above.
            let _ = unsafe { r.submission().push(&e) };
        }
    });
}

fn poll_entry(fd: i32, user_data: u64) -> squeue::Entry {
    opcode::PollAdd::new(types::Fd(fd), libc::POLLIN as u32).build().user_data(user_data)
}

/// Serves queue `qid` until the kernel takes it down (the device stopped) or, with the stop
/// signal, until what is at the device is answered.
pub(crate) fn run(w: QueueWork<'_>) -> Result<(), UblkError> {
    let QueueWork { udev, qid, dev, cdev, stop, stats, started } = w;
    let q = UblkQueue::new(qid, udev)?.submit_fetch_commands_unified(BufDescList::Slices(None))?;
    // SAFETY: gettid has no preconditions.
    let _ = started.send((qid, unsafe { libc::gettid() }));
    let depth = q.get_depth() as usize;
    let slot = usize::from(qid) % dev.queue_count().max(1);
    let mut wk = Work {
        q: ManuallyDrop::new(q),
        qid,
        cdev,
        reqs: vec![Req::FREE; depth],
        waiting: VecDeque::with_capacity(depth),
        at_device: 0,
        stats,
        down: false,
        irq_poll: None,
        polls: 0,
    };
    push(&wk.q, poll_entry(stop.wake.as_raw_fd(), WAKE_STOP));
    let mut handle: Option<QueueHandle<'_>> = None;
    let mut line: Option<QueueLine<'_>> = None;
    let mut idle = IdleSpin::new(wait_policy(&dev));
    let yield_after_ns = if dev.mode() == NotifyMode::Poll { 10_000 } else { 0 };
    let mut last_answer = Instant::now();
    let mut fresh: Vec<u16> = Vec::with_capacity(depth);
    loop {
        let stopping = stop.requested();
        let mut work = 0;
        // The kernel's new requests, and the worker's own wake-ups.
        let mut down = false;
        let mut irq_fired = false;
        let current_poll = wk.irq_poll.map(|(n, _)| n);
        let reaped = wk.q.flush_and_wake_io_tasks(
            |user_data, cqe, _| {
                if user_data & OWN != 0 {
                    if user_data & !0xffff_ffff == WAKE_IRQ && Some(user_data as u32) == current_poll {
                        irq_fired = true;
                    }
                    return;
                }
                match cqe.result() {
                    r if r == sys::UBLK_IO_RES_OK as i32 => fresh.push(UblkIOCtx::user_data_to_tag(user_data) as u16),
                    r if r == sys::UBLK_IO_RES_ABORT => down = true,
                    r => log::warn!("ublk queue {qid}: a command ended with {r}"),
                }
            },
            0,
        );
        if irq_fired {
            wk.irq_poll = None;
        }
        wk.down |= down;
        for tag in fresh.drain(..) {
            work += 1;
            wk.take(tag);
        }
        if matches!(reaped, Err(UblkError::QueueIsDown)) {
            wk.down = true;
        }
        // Send what waits, oldest first, while the device's queue has room.
        while !stopping || wk.down {
            let Some(&tag) = wk.waiting.front() else { break };
            if handle.is_none() {
                handle = dev.poll_queue(slot, &mut line);
            }
            let Some(h) = handle.as_mut().filter(|h| !h.turn_over()) else { break };
            let sent = wk.send(h, tag);
            match sent {
                Ok(()) => {
                    wk.waiting.pop_front();
                    wk.reqs[usize::from(tag)].stage = Stage::Device;
                    wk.at_device += 1;
                    work += 1;
                }
                Err(IoError::QueueFull) => break,
                Err(e) => {
                    wk.waiting.pop_front();
                    wk.reqs[usize::from(tag)].stage = Stage::Device;
                    wk.at_device += 1;
                    work += 1;
                    wk.answer(tag, Err(e), None);
                }
            }
        }
        stats.max_in_flight.fetch_max(wk.at_device as u64, Ordering::Relaxed);
        if let Some(h) = handle.as_mut() {
            let wkr = &mut wk;
            let mut on_answer =
                |token: u64, result: Result<u64, IoError>, data: Option<SharedSlice<'_>>| wkr.answer(token as u16, result, data);
            let n = h.poll(&mut on_answer);
            let given_up = h.expire(last_answer, &mut on_answer);
            if n > 0 {
                last_answer = Instant::now();
            }
            work += n + given_up;
            if h.in_flight() == 0 {
                handle = None;
            }
        }
        if wk.down && wk.at_device == 0 {
            // The kernel has taken the queue down: what it still had is its to fail.
            drop(ManuallyDrop::into_inner(wk.q));
            return Ok(());
        }
        if stopping && wk.at_device == 0 {
            // Leaving the device to the next server: the kernel reissues what was not
            // committed once it recovers the device. The queue is not dropped (see `Work::q`).
            return Ok(());
        }
        let now = now_ns();
        if work > 0 {
            idle.worked(now);
            continue;
        }
        let spin = if wk.at_device > 0 { idle.spin_for_answers(now) } else { idle.spin(now, true) };
        if spin && !has_completions(&wk.q) {
            if idle.idle_ns(now) >= yield_after_ns {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
            continue;
        }
        if !spin {
            sleep(&mut wk, &dev, &mut handle, stopping);
        }
    }
}

/// Whether the ring of `_q` holds completions not yet reaped (without a system call).
fn has_completions(_q: &UblkQueue<'_>) -> bool {
    with_task_io_ring_mut(|r: &mut IoUring<squeue::Entry>| !r.completion().is_empty())
}

/// Sleeps in the queue's ring until the kernel gives a request, the device answers, the
/// worker is told to stop, or a timeout passes.
fn sleep(wk: &mut Work<'_>, dev: &Device, handle: &mut Option<QueueHandle<'_>>, stopping: bool) {
    let mut timeout = SLICE;
    let mut now = false;
    let mut armed = false;
    if let Some(h) = handle.as_mut() {
        match h.arm() {
            Armed::Idle => {}
            Armed::Now => now = true,
            Armed::Spin => {
                std::thread::yield_now();
                return;
            }
            Armed::Later => timeout = LATER,
            Armed::Fd(fd) => {
                armed = true;
                let generation = dev.generation();
                match wk.irq_poll {
                    Some((_, g)) if g == generation => {}
                    stale => {
                        if let Some((n, _)) = stale {
                            // A poll on an earlier generation's doorbell: it would never fire.
                            push(&wk.q, opcode::AsyncCancel::new(WAKE_IRQ | u64::from(n)).build().user_data(CANCELLED));
                        }
                        wk.polls = wk.polls.wrapping_add(1);
                        push(&wk.q, poll_entry(fd, WAKE_IRQ | u64::from(wk.polls)));
                        wk.irq_poll = Some((wk.polls, generation));
                    }
                }
            }
        }
    }
    if !wk.waiting.is_empty() && !armed && !stopping {
        timeout = LATER;
    }
    if !now {
        let ts = types::Timespec::new().sec(timeout.as_secs()).nsec(timeout.subsec_nanos());
        let args = types::SubmitArgs::new().timespec(&ts);
        with_task_io_ring_mut(|r: &mut IoUring<squeue::Entry>| {
            // ETIME (the timeout) and EINTR are wake-ups like any other.
            let _ = r.submitter().submit_with_args(1, &args);
        });
    }
    if armed {
        if let Some(h) = handle.as_mut() {
            h.disarm();
        }
    }
}
