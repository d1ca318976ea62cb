//! FUSE over io_uring: one ring per CPU, as the kernel routes a request to the queue of the
//! CPU that issued it.
//!
//! Each queue registers `depth` entries with the kernel, each a header buffer and a payload
//! buffer. A request arrives as the completion of an entry's command, with its headers and
//! payload already in the entry's buffers; the reply is written back into them and goes
//! with the command that fetches the entry's next request (`COMMIT_AND_FETCH`), many per
//! `io_uring_enter`. Nothing is read from or written to `/dev/fuse` on this path.
//!
//! One worker thread serves a queue. It submits device I/O on queue handles and keeps as
//! many requests in flight as the ring has entries (and the device queue has slots). It
//! waits like the channel it talks to: it spins on both its ring's completions and the
//! device's answers for an adaptive budget ([`IdleSpin`]: tuned from the gaps it sees, and,
//! while no device owes it an answer, cut short when other threads wait for a CPU), yielding
//! its CPU between looks ([`yield_after`]), then sleeps in one `poll(2)` on the ring and the
//! armed device queues.

use std::alloc::Layout;
use std::collections::VecDeque;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::Ordering;
use std::time::Instant;

use bulkhead_client::{Armed, IoError, QueueHandle, SharedSlice};
use bulkhead_doorbell::{now_ns, BudgetPolicy, IdleSpin, NotifyMode};
use io_uring::{cqueue, opcode, squeue, types, IoUring};
use zerocopy::{FromBytes, IntoBytes};

use crate::abi::*;
use crate::ops::{dispatch, Incoming, Io, IoKind, Node, Shared, Sink, Step, MAX_WRITE};

/// The files a worker serves: a copy of the export's table, taken anew when it changes.
type Files<'d> = &'d [Option<std::sync::Arc<Node>>];

/// Bytes between two entries' header buffers: a page each, so the kernel may pin them.
const HEADER_STRIDE: usize = 4096;
/// Longest sleep while device requests are in flight: expiry is checked this often.
const SLICE_MS: i32 = 50;
/// Sleep while a device is between generations or its doorbell storms: it is looked at this
/// often.
const LATER_MS: i32 = 1;

/// The CPUs the kernel may route requests from: one queue each.
pub(crate) fn possible_cpus() -> usize {
    std::fs::read_to_string("/sys/devices/system/cpu/possible")
        .ok()
        .and_then(|s| parse_cpu_list(s.trim()))
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// The number of CPUs in a kernel CPU list ("0-3,5"): its highest index plus one, as the
/// kernel numbers queues by CPU index.
fn parse_cpu_list(s: &str) -> Option<usize> {
    let mut max = None;
    for part in s.split(',') {
        let last = part.rsplit('-').next()?;
        let n: usize = last.trim().parse().ok()?;
        max = Some(max.map_or(n, |m: usize| m.max(n)));
    }
    max.map(|m| m + 1)
}

/// Memory the kernel writes requests into and reads replies from, page-aligned.
struct Region {
    ptr: *mut u8,
    layout: Layout,
}

// SAFETY: the region is plain memory owned by one queue; whoever holds the queue is the only
// user-space accessor.
unsafe impl Send for Region {}

impl Region {
    fn new(len: usize) -> io::Result<Self> {
        let layout = Layout::from_size_align(len, 4096).map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
        // SAFETY: the layout has a non-zero size (callers ask for at least one page).
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            return Err(io::Error::from(io::ErrorKind::OutOfMemory));
        }
        Ok(Region { ptr, layout })
    }

    /// The address `offset` bytes in (computing it is safe; using it is the caller's care).
    fn at(&self, offset: usize) -> *mut u8 {
        debug_assert!(offset < self.layout.size());
        self.ptr.wrapping_add(offset)
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { std::alloc::dealloc(self.ptr, self.layout) };
    }
}

/// Who holds an entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Held {
    /// The kernel: a command is out for it.
    Kernel,
    /// This worker, answering it.
    Worker,
    /// This worker: a request waits for a device queue.
    Waiting(Io),
    /// A device: its request is in flight.
    Device(Io),
    /// Unusable after a command failed.
    Dead,
}

struct Ent {
    commit_id: u64,
    /// The command to send again if the kernel asks (`EINTR`, `EAGAIN`).
    last_cmd: u32,
    held: Held,
}

/// One queue: its ring, the session descriptor, and its entries' memory. Dropped only after
/// its worker thread has exited, so the kernel (which copies requests into the buffers from
/// that thread's context) can no longer write into them.
pub(crate) struct RingQueue {
    qid: u16,
    ring: IoUring<squeue::Entry128, cqueue::Entry>,
    fuse: OwnedFd,
    headers: Region,
    payloads: Region,
    /// Each entry's two iovecs, read by the kernel when the entry registers.
    iovs: Box<[[libc::iovec; 2]]>,
    ents: Vec<Ent>,
    /// Commands queued and not yet submitted.
    unsubmitted: usize,
    /// Requests that wait for room on a device queue, oldest first.
    waiting: VecDeque<usize>,
    /// Completions seen while starting, to be handled first.
    early: Vec<(u64, i32)>,
}

// SAFETY: the iovecs point into the queue's own regions; the queue moves between threads as
// a whole and one thread at a time uses it.
unsafe impl Send for RingQueue {}

/// Why a queue stopped.
#[derive(Debug)]
pub(crate) enum Ended {
    /// The export is stopping.
    Stopped,
    /// The connection is gone (unmounted or aborted).
    Disconnected,
    /// The ring failed.
    Failed(io::Error),
}

impl RingQueue {
    /// A queue `qid` of `depth` entries on the session `fuse`, its entries registered (the
    /// commands are queued; [`serve`](Self::serve) submits them).
    pub(crate) fn new(qid: u16, depth: usize, fuse: OwnedFd) -> io::Result<Self> {
        let ring = IoUring::<squeue::Entry128, cqueue::Entry>::builder()
            .setup_cqsize((2 * depth) as u32)
            .build(depth.next_power_of_two() as u32)?;
        let headers = Region::new(depth * HEADER_STRIDE)?;
        let payloads = Region::new(depth * MAX_WRITE)?;
        let iovs = (0..depth)
            .map(|i| {
                [
                    libc::iovec { iov_base: headers.at(i * HEADER_STRIDE).cast(), iov_len: URING_HEADER_SZ },
                    libc::iovec { iov_base: payloads.at(i * MAX_WRITE).cast(), iov_len: MAX_WRITE },
                ]
            })
            .collect();
        let ents = (0..depth).map(|_| Ent { commit_id: 0, last_cmd: URING_CMD_REGISTER, held: Held::Kernel }).collect();
        let mut q = RingQueue {
            qid,
            ring,
            fuse,
            headers,
            payloads,
            iovs,
            ents,
            unsubmitted: 0,
            waiting: VecDeque::new(),
            early: Vec::new(),
        };
        for i in 0..depth {
            q.push_cmd(i, URING_CMD_REGISTER)?;
        }
        Ok(q)
    }

    /// Submits the registrations. The kernel registers an entry as it takes its command, so
    /// a refusal (a bad buffer, a kernel without the feature) has completed when this returns.
    pub(crate) fn start(&mut self) -> io::Result<()> {
        self.ring.submit()?;
        self.unsubmitted = 0;
        for cqe in self.ring.completion() {
            self.early.push((cqe.user_data(), cqe.result()));
        }
        match self.early.iter().find(|(_, r)| *r < 0) {
            Some(&(_, r)) => Err(io::Error::from_raw_os_error(-r)),
            None => Ok(()),
        }
    }

    /// Queues entry `i`'s command `cmd` (register, or commit its reply and fetch).
    fn push_cmd(&mut self, i: usize, cmd: u32) -> io::Result<()> {
        let req = UringCmdReq { flags: 0, commit_id: self.ents[i].commit_id, qid: self.qid, padding: [0; 6] };
        let mut area = [0u8; 80];
        area[..std::mem::size_of::<UringCmdReq>()].copy_from_slice(req.as_bytes());
        let mut op = opcode::UringCmd80::new(types::Fd(self.fuse.as_raw_fd()), cmd).cmd(area);
        if cmd == URING_CMD_REGISTER {
            op = op.addr(Some(self.iovs[i].as_ptr() as u64));
        }
        let mut sqe = op.build().user_data(i as u64);
        if cmd == URING_CMD_REGISTER {
            sqe = with_len(sqe, 2);
        }
        self.ents[i].last_cmd = cmd;
        self.ents[i].held = Held::Kernel;
        // SAFETY: the iovecs and the buffers they name live as long as the ring (both are
        // fields of this queue, dropped together after the worker exits).
        let pushed = unsafe { self.ring.submission().push(&sqe) };
        if pushed.is_err() {
            // The submission ring has a slot for every entry; flush and retry once.
            self.ring.submit()?;
            // SAFETY: as above.
            unsafe { self.ring.submission().push(&sqe) }.map_err(|_| io::Error::other("submission ring full"))?;
        }
        self.unsubmitted += 1;
        Ok(())
    }

    fn header(&self, i: usize) -> *mut u8 {
        self.headers.at(i * HEADER_STRIDE)
    }

    fn payload_ptr(&self, i: usize) -> *mut u8 {
        self.payloads.at(i * MAX_WRITE)
    }

    /// Entry `i`'s payload buffer. Only for an entry this worker holds (the kernel writes
    /// into it only while a command is out for it).
    fn payload_mut(&mut self, i: usize) -> &mut [u8] {
        debug_assert_ne!(self.ents[i].held, Held::Kernel);
        // SAFETY: the buffer is MAX_WRITE bytes inside `payloads`, held by this worker, and
        // `&mut self` keeps any other reference to it from living meanwhile.
        unsafe { std::slice::from_raw_parts_mut(self.payload_ptr(i), MAX_WRITE) }
    }

    /// Writes the reply into entry `i` and queues its commit. `parts` go to the payload
    /// unless `in_place` bytes are already there.
    fn commit(&mut self, i: usize, unique: u64, errno: i32, parts: &[&[u8]], in_place: usize) -> io::Result<()> {
        let mut len = in_place;
        let mut errno = errno;
        if in_place == 0 {
            let total: usize = parts.iter().map(|p| p.len()).sum();
            if total > MAX_WRITE {
                errno = libc::EINVAL;
            } else {
                let buf = self.payload_mut(i);
                for p in parts {
                    buf[len..len + p.len()].copy_from_slice(p);
                    len += p.len();
                }
            }
        }
        if errno != 0 {
            len = 0;
        }
        let out = OutHeader { len: (16 + len) as u32, error: -errno, unique };
        let io = UringEntInOut { payload_sz: len as u32, commit_id: self.ents[i].commit_id, ..Default::default() };
        let hdr = self.header(i);
        // SAFETY: the header buffer is URING_HEADER_SZ bytes inside `headers`, held by this
        // worker; the writes stay within it.
        unsafe {
            std::ptr::copy_nonoverlapping(out.as_bytes().as_ptr(), hdr, out.as_bytes().len());
            let at = hdr.add(URING_IN_OUT_SZ + URING_OP_SZ);
            std::ptr::copy_nonoverlapping(io.as_bytes().as_ptr(), at, io.as_bytes().len());
        }
        self.push_cmd(i, URING_CMD_COMMIT_AND_FETCH)
    }

    /// Serves the queue until the export stops or the connection ends.
    pub(crate) fn serve(&mut self, sh: &Shared) -> Ended {
        match self.run(sh) {
            Ok(e) | Err(e) => e,
        }
    }

    fn run(&mut self, sh: &Shared) -> Result<Ended, Ended> {
        loop {
            // A device added or removed: once nothing is in flight at a device, the worker
            // takes the new table (requests for a new file wait for it meanwhile).
            let version = sh.version.load(Ordering::Acquire);
            let table = sh.table();
            if let Some(ended) = self.run_on(sh, &table, version)? {
                return Ok(ended);
            }
        }
    }

    /// Serves with the files `table`, as of `version`; returns `None` when the table has
    /// changed and no request is in flight at a device.
    fn run_on(&mut self, sh: &Shared, table: Files<'_>, version: u64) -> Result<Option<Ended>, Ended> {
        let mut handles: Vec<Option<QueueHandle<'_>>> = (0..table.len()).map(|_| None).collect();
        let policy = wait_policy(table);
        let yield_after_ns = yield_after(table);
        let mut idle = IdleSpin::new(policy);
        let mut last_answer = Instant::now();
        // Since when the worker has spun for answers (0: it is not spinning).
        let mut spinning_since = 0u64;
        loop {
            if sh.stop.load(Ordering::Acquire) {
                return Ok(Some(Ended::Stopped));
            }
            let changed = sh.version.load(Ordering::Acquire) != version;
            if changed && handles.iter().all(Option::is_none) {
                return Ok(None);
            }
            let mut work = self.take_requests(sh, table, &mut handles, changed)?;
            let mut answers = 0;
            for h in handles.iter_mut().flatten() {
                answers += self.reap(sh, table, h);
            }
            if answers > 0 {
                last_answer = Instant::now();
            }
            for h in handles.iter_mut().flatten() {
                let mut given_up = Vec::new();
                h.expire(last_answer, |token, r, _| given_up.push((token as usize, r)));
                for (i, r) in given_up {
                    self.finish(sh, table, i, r.map(|_| ()), None).map_err(Ended::Failed)?;
                }
            }
            if !changed {
                work += self.start_waiting(sh, table, &mut handles);
            }
            work += answers;
            for h in handles.iter_mut() {
                if h.as_ref().is_some_and(|h| h.in_flight() == 0) {
                    *h = None;
                }
            }
            if self.unsubmitted > 0 {
                self.ring.submit().map_err(Ended::Failed)?;
                self.unsubmitted = 0;
            }
            let now = now_ns();
            // The handles still held are those with requests in flight: the others were just
            // let go.
            let answers_due = handles.iter().any(Option::is_some);
            if spinning_since != 0 && (work > 0 || !answers_due) {
                count_spin(&handles, now - spinning_since);
                spinning_since = 0;
            }
            if work > 0 {
                idle.worked(now);
                continue;
            }
            // With requests at a device the wait is for its answers, and the crowd check does
            // not cut it short (`IdleSpin::spin_for_answers`).
            let spin = if answers_due { idle.spin_for_answers(now) } else { idle.spin(now, true) };
            if spin {
                if answers_due && spinning_since == 0 {
                    spinning_since = now;
                }
                if idle.idle_ns(now) >= yield_after_ns {
                    std::thread::yield_now();
                } else {
                    std::hint::spin_loop();
                }
                continue;
            }
            if spinning_since != 0 {
                count_spin(&handles, now - spinning_since);
                spinning_since = 0;
            }
            self.sleep(&mut handles)?;
        }
    }

    /// Takes the requests the kernel delivered; returns how many.
    fn take_requests<'d>(
        &mut self,
        sh: &Shared,
        table: Files<'d>,
        handles: &mut [Option<QueueHandle<'d>>],
        changed: bool,
    ) -> Result<usize, Ended> {
        let mut done: [(u64, i32); 32] = [(0, 0); 32];
        let mut total = 0;
        loop {
            let mut n = 0;
            let early = self.early.len().min(done.len());
            for e in self.early.drain(..early) {
                done[n] = e;
                n += 1;
            }
            for cqe in self.ring.completion().take(done.len() - n) {
                done[n] = (cqe.user_data(), cqe.result());
                n += 1;
            }
            if n == 0 {
                return Ok(total);
            }
            total += n;
            for &(user, res) in &done[..n] {
                let i = user as usize;
                if i >= self.ents.len() {
                    continue;
                }
                match res {
                    0 => self.take_request(sh, table, i, handles, changed)?,
                    r if r == -libc::EINTR || r == -libc::EAGAIN => {
                        let cmd = self.ents[i].last_cmd;
                        self.push_cmd(i, cmd).map_err(Ended::Failed)?;
                    }
                    r if r == -libc::ENOTCONN || r == -libc::ENODEV || r == -libc::ECANCELED => return Err(Ended::Disconnected),
                    r => {
                        self.ents[i].held = Held::Dead;
                        log::warn!("fuse ring {}: entry {i}: {}", self.qid, io::Error::from_raw_os_error(-r));
                        if self.ents.iter().all(|e| e.held == Held::Dead) {
                            return Err(Ended::Failed(io::Error::from_raw_os_error(-r)));
                        }
                    }
                }
            }
        }
    }

    /// Handles the request in entry `i`.
    fn take_request<'d>(
        &mut self,
        sh: &Shared,
        table: Files<'d>,
        i: usize,
        handles: &mut [Option<QueueHandle<'d>>],
        changed: bool,
    ) -> Result<(), Ended> {
        let hdr = self.header(i);
        let mut raw = [0u8; URING_HEADER_SZ];
        // SAFETY: the kernel has finished writing the entry's header (its command completed)
        // and the buffer is URING_HEADER_SZ bytes.
        unsafe { std::ptr::copy_nonoverlapping(hdr, raw.as_mut_ptr(), URING_HEADER_SZ) };
        let h = InHeader::read_from_prefix(&raw).expect("the header buffer holds an in-header").0;
        let ent = UringEntInOut::read_from_prefix(&raw[URING_IN_OUT_SZ + URING_OP_SZ..]).expect("and the entry's own part").0;
        self.ents[i].commit_id = ent.commit_id;
        self.ents[i].held = Held::Worker;
        let op = &raw[URING_IN_OUT_SZ..URING_IN_OUT_SZ + URING_OP_SZ];
        let len = (ent.payload_sz as usize).min(MAX_WRITE);
        let mut sink = Collected::default();
        let step = {
            let payload = &self.payload_mut(i)[..len];
            dispatch(sh, table, &Incoming { h, op, payload }, &mut sink)
        };
        match step {
            Step::Io(io) => {
                self.ents[i].held = Held::Waiting(io);
                self.waiting.push_back(i);
                if !changed {
                    self.start_waiting(sh, table, handles);
                }
                Ok(())
            }
            Step::Done | Step::Stop => {
                // Requests that want no answer (forgets, interrupts) come on /dev/fuse, never
                // here; an entry is recycled only by a commit, so one is always sent.
                let (errno, data) = sink.reply.unwrap_or((libc::ENOSYS, Vec::new()));
                self.commit(i, h.unique, errno, &[&data], 0).map_err(Ended::Failed)
            }
        }
    }

    /// Submits waiting requests, oldest first, while their devices take them. Returns how
    /// many left the wait.
    fn start_waiting<'d>(&mut self, sh: &Shared, table: Files<'d>, handles: &mut [Option<QueueHandle<'d>>]) -> usize {
        let mut started = 0;
        let mut blocked = Vec::new();
        while let Some(i) = self.waiting.pop_front() {
            let Held::Waiting(io) = self.ents[i].held else { continue };
            if blocked.contains(&io.dev) {
                self.waiting.push_front(i);
                break;
            }
            let dev = match table.get(io.dev) {
                Some(Some(node)) => &node.dev,
                // Removed: its users get EIO.
                Some(None) => {
                    started += 1;
                    if let Err(e) = self.finish(sh, table, i, Err(IoError::Unavailable("device removed".into())), None) {
                        log::info!("fuse ring {}: {e}", self.qid);
                    }
                    continue;
                }
                // Added since this worker took its table: it waits for the new one.
                None => {
                    self.waiting.push_front(i);
                    break;
                }
            };
            if handles[io.dev].is_none() {
                // Block for a queue only while holding none: then no two workers can wait
                // for each other's queues.
                handles[io.dev] = if handles.iter().all(Option::is_none) {
                    Some(dev.queue(self.qid as usize))
                } else {
                    dev.try_queue(self.qid as usize)
                };
            }
            let Some(h) = handles[io.dev].as_mut().filter(|h| !h.turn_over()) else {
                // Nobody's queue to take, or this worker's turn at it is over and others wait:
                // it drains, lets the queue go, and asks again.
                blocked.push(io.dev);
                self.waiting.push_front(i);
                break;
            };
            let payload = self.payload_ptr(i);
            let len = match io.kind {
                IoKind::Write { from: len, .. } => len as usize,
                _ => 0,
            };
            // SAFETY: the entry is held by this worker; its payload holds `len` bytes of the
            // write's data, read (copied into the arena) by `submit` before it returns.
            let data = unsafe { std::slice::from_raw_parts(payload, len) };
            match h.submit(io.request(data), i as u64) {
                Ok(()) => {
                    self.ents[i].held = Held::Device(io);
                    started += 1;
                }
                Err(IoError::QueueFull) => {
                    self.waiting.push_front(i);
                    break;
                }
                Err(e) => {
                    started += 1;
                    if let Err(e) = self.finish(sh, table, i, Err(e), None) {
                        log::info!("fuse ring {}: {e}", self.qid);
                    }
                }
            }
        }
        started
    }

    /// Delivers a device queue's answers; returns how many.
    fn reap(&mut self, sh: &Shared, table: Files<'_>, h: &mut QueueHandle<'_>) -> usize {
        let mut failed = None;
        let n = h.poll(|token, result, data| {
            if let Err(e) = self.finish(sh, table, token as usize, result.map(|_| ()), data) {
                failed = Some(e);
            }
        });
        if let Some(e) = failed {
            log::info!("fuse ring {}: {e}", self.qid);
        }
        n
    }

    /// Answers entry `i`'s device request.
    fn finish(
        &mut self,
        sh: &Shared,
        table: Files<'_>,
        i: usize,
        result: Result<(), IoError>,
        data: Option<SharedSlice<'_>>,
    ) -> io::Result<()> {
        let counters = |dev: usize| table.get(dev).and_then(Option::as_ref).map(|n| &n.dev.counters);
        let (Held::Device(io) | Held::Waiting(io)) = self.ents[i].held else {
            return Ok(());
        };
        if let (IoKind::Read { into: len, .. }, Ok(())) = (io.kind, &result) {
            let len = len as usize;
            return match data {
                Some(d) if d.len() == len => {
                    d.copy_to(&mut self.payload_mut(i)[..len]);
                    if let Some(c) = counters(io.dev) {
                        c.bytes_read.fetch_add(len as u64, Ordering::Relaxed);
                    }
                    self.commit(i, io.unique, 0, &[], len)
                }
                _ => self.commit(i, io.unique, libc::EIO, &[], 0),
            };
        }
        if let (IoKind::Write { from: len, .. }, Ok(())) = (io.kind, &result) {
            if let Some(c) = counters(io.dev) {
                c.bytes_written.fetch_add(len as u64, Ordering::Relaxed);
            }
        }
        // Nothing borrows the entry's buffers here: the reply goes straight into them.
        let mut sink = EntrySink { q: self, i, done: Ok(()) };
        io.reply(sh, &mut sink, result);
        sink.done
    }

    /// Sleeps until the kernel delivers a request or an armed device queue answers.
    fn sleep(&mut self, handles: &mut [Option<QueueHandle<'_>>]) -> Result<(), Ended> {
        let mut fds = vec![libc::pollfd { fd: self.ring.as_raw_fd(), events: libc::POLLIN, revents: 0 }];
        let mut armed = Vec::new();
        let mut timeout = -1;
        let mut now = false;
        let mut spin = false;
        for (d, h) in handles.iter_mut().enumerate() {
            let Some(h) = h else { continue };
            match h.arm() {
                Armed::Idle => {}
                Armed::Now => now = true,
                Armed::Spin => spin = true,
                Armed::Later => timeout = LATER_MS,
                Armed::Fd(fd) => {
                    armed.push(d);
                    fds.push(libc::pollfd { fd, events: libc::POLLIN, revents: 0 });
                    if timeout < 0 {
                        timeout = SLICE_MS;
                    }
                }
            }
        }
        if !now && !self.waiting.is_empty() && armed.is_empty() {
            // Waiting for a queue another user holds: look again soon.
            timeout = LATER_MS;
        }
        // A `poll` device's driver never rings (`spin`): no sleep, only a yield below.
        if !now && !spin {
            // SAFETY: `fds` is a valid array of pollfds for the call.
            let rc = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout) };
            if rc < 0 && io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
                return Err(Ended::Failed(io::Error::last_os_error()));
            }
        }
        for d in armed {
            if let Some(h) = handles[d].as_mut() {
                h.disarm();
            }
        }
        if spin && !now {
            // Look again, after any thread runnable on this CPU (the domain, the
            // application) has had its turn.
            std::thread::yield_now();
        }
        Ok(())
    }
}

/// Replies written straight into an entry and committed.
struct EntrySink<'q> {
    q: &'q mut RingQueue,
    i: usize,
    done: io::Result<()>,
}

impl Sink for EntrySink<'_> {
    fn reply(&mut self, unique: u64, errno: i32, parts: &[&[u8]]) {
        self.done = self.q.commit(self.i, unique, errno, parts, 0);
    }
}

/// A reply kept until the request's entry can take it (while the request's payload is still
/// borrowed).
#[derive(Default)]
struct Collected {
    reply: Option<(i32, Vec<u8>)>,
}

impl Sink for Collected {
    fn reply(&mut self, _unique: u64, errno: i32, parts: &[&[u8]]) {
        self.reply = Some((errno, parts.concat()));
    }
}

/// Adds `ns` spent spinning for answers to the devices with requests in flight (those whose
/// queues the worker holds), in equal parts.
fn count_spin(handles: &[Option<QueueHandle<'_>>], ns: u64) {
    let held = handles.iter().flatten().count();
    if held == 0 {
        return;
    }
    let each = ns / held as u64;
    for h in handles.iter().flatten() {
        h.device().queue_counters(h.index()).spin_ns.fetch_add(each, Ordering::Relaxed);
    }
}

/// How long a worker spins before sleeping, from its devices' notification modes: not at
/// all if every device is `irq`; up to the auto ceiling, tuned, otherwise (`poll` devices
/// included: a worker per CPU spinning without end would starve the CPUs it serves).
fn wait_policy(table: Files<'_>) -> BudgetPolicy {
    let mut devices = table.iter().flatten().map(|n| &n.dev).peekable();
    if devices.peek().is_some() && devices.all(|d| d.mode() == NotifyMode::Irq) {
        BudgetPolicy::Fixed(0)
    } else {
        BudgetPolicy::DEFAULT_AUTO
    }
}

/// How long a worker spins idle before it calls `sched_yield` between its looks, ns. A thread
/// runnable on its CPU (the application, the loop device's worker, the driver domain, the
/// other queue's worker) makes the next request or answer, and then goes first rather than
/// wait for the end of the worker's slice; alone on the CPU, the call returns at once. From
/// the first idle look, unless a device is `poll`: its domain never sleeps, and with a
/// worker yielding at every look one thread of reads lost about a tenth, where a 10 µs
/// grace kept it (docs/bench/tuning.md, "FUSE over io_uring").
fn yield_after(table: Files<'_>) -> u64 {
    if table.iter().flatten().any(|n| n.dev.mode() == NotifyMode::Poll) {
        10_000
    } else {
        0
    }
}

/// `sqe` with its `len` field set: registration names two iovecs there, and the crate's
/// command builder has no setter for it.
fn with_len(sqe: squeue::Entry128, len: u32) -> squeue::Entry128 {
    // SAFETY: `Entry128` is `#[repr(C)]`, a 64-byte `io_uring_sqe` followed by 64 bytes of
    // command, all plain integers, so it round-trips through bytes; `len` is the `u32` at
    // byte 24 of `io_uring_sqe`.
    let mut raw: [u8; 128] = unsafe { std::mem::transmute::<squeue::Entry128, [u8; 128]>(sqe) };
    raw[24..28].copy_from_slice(&len.to_ne_bytes());
    // SAFETY: as above.
    unsafe { std::mem::transmute::<[u8; 128], squeue::Entry128>(raw) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists_count_up_to_the_highest_cpu() {
        assert_eq!(parse_cpu_list("0-1"), Some(2));
        assert_eq!(parse_cpu_list("0"), Some(1));
        assert_eq!(parse_cpu_list("0-3,8-11"), Some(12));
        assert_eq!(parse_cpu_list(""), None);
        assert_eq!(parse_cpu_list("x"), None);
    }

    #[test]
    fn registration_sqes_carry_two_iovecs() {
        let sqe = opcode::UringCmd80::new(types::Fd(5), URING_CMD_REGISTER).addr(Some(0x1000)).build();
        // SAFETY: as in `with_len`: a repr(C) entry of plain integers, 128 bytes.
        let raw: [u8; 128] = unsafe { std::mem::transmute(with_len(sqe, 2)) };
        assert_eq!(raw[0], io_uring::opcode::UringCmd80::CODE);
        assert_eq!(u32::from_ne_bytes(raw[24..28].try_into().unwrap()), 2);
        assert_eq!(u64::from_ne_bytes(raw[16..24].try_into().unwrap()), 0x1000);
        assert_eq!(i32::from_ne_bytes(raw[4..8].try_into().unwrap()), 5);
        assert_eq!(u32::from_ne_bytes(raw[8..12].try_into().unwrap()), URING_CMD_REGISTER);
    }

    #[test]
    fn the_header_buffer_matches_the_kernel_layout() {
        assert_eq!(std::mem::size_of::<UringEntInOut>(), 32);
        assert_eq!(std::mem::size_of::<UringCmdReq>(), 24);
        assert_eq!(URING_HEADER_SZ, 288);
    }
}
