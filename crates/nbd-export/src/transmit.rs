//! Transmission: one connection's requests read off the socket, put in flight on the device's
//! queues and answered, by threads that take turns to lead.

use std::io::{self, Read};
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bulkhead_client::{Armed, Command, Device, FrontRequest, IoError, QueueHandle, SharedSlice};
use bulkhead_doorbell::{now_ns, BudgetPolicy, IdleSpin, NotifyMode};
use bulkhead_nbd::proto::*;

use crate::budget::{Budget, Held, CONNECTION_SHARE};
use crate::lock;
use crate::negotiate::{violation, Negotiated};
use crate::reply::{Replier, Reply, Spare, SPARE_MIN};
use crate::sockbuf::{timeout_says, SockBuf, SockReader};

/// What every connection in transmission shares: the payload budget, the spare buffers, the
/// count of requests answered, and the limits.
#[derive(Clone, Copy)]
pub(crate) struct Common<'a> {
    pub(crate) budget: &'a Arc<Budget>,
    pub(crate) spare: &'a Arc<Mutex<Spare>>,
    pub(crate) requests: &'a AtomicU64,
    /// Once a request has started to arrive, the rest of it must arrive within this; a
    /// client that takes no reply bytes for this long is broken off.
    pub(crate) request_timeout: Duration,
    /// Threads of one connection.
    pub(crate) workers: usize,
}

fn io_error(e: &IoError) -> u32 {
    error_of_errno(e.errno())
}

/// One request read off the socket and parsed, served by the thread that read it.
struct Job {
    cookie: u64,
    cmd: Command<u32, u32>,
    /// A trim or write-zeroes with FUA: a flush follows it before the reply.
    flush_after: bool,
    /// A write's data.
    payload: Vec<u8>,
    /// The payload budget its data takes: a write's payload, or a read's reply.
    held: Option<Held>,
}

impl Job {
    /// Whether it goes to the device as one queued request (anything else runs on its own,
    /// off the lead: a transfer larger than the queue carries, or a command of several steps).
    fn queued(&self, max_request: u64) -> bool {
        match self.cmd {
            Command::Read { into: len, .. } | Command::Write { from: len, .. } => u64::from(len) <= max_request,
            Command::Flush => true,
            Command::Discard { .. } => !self.flush_after,
            // It may fall back to writing zeroes, in several requests.
            Command::WriteZeroes { .. } => false,
        }
    }

    /// The device request it makes (a write's data is its payload).
    fn front(&self) -> FrontRequest<'_> {
        self.cmd.map(u64::from, |_| &self.payload[..])
    }
}

/// The read side of a connection and how it ended; held by the connection's leader.
struct Inbound {
    r: SockBuf,
    ended: Option<io::Result<()>>,
}

/// What the leader found on the socket.
enum Next {
    Job(Job),
    /// The client disconnected.
    End,
    /// Nothing more without waiting (or without payload budget).
    NotNow,
}

/// The requests one leader has read and not yet answered, by the token each goes to the
/// device under.
#[derive(Default)]
struct Jobs {
    slots: Vec<Option<Job>>,
    free: Vec<usize>,
    /// Read, not yet taken by the device (its queue was full), oldest first.
    waiting: std::collections::VecDeque<usize>,
}

impl Jobs {
    fn insert(&mut self, job: Job) -> usize {
        match self.free.pop() {
            Some(i) => {
                self.slots[i] = Some(job);
                i
            }
            None => {
                self.slots.push(Some(job));
                self.slots.len() - 1
            }
        }
    }

    fn take(&mut self, token: u64) -> Job {
        let i = token as usize;
        self.free.push(i);
        self.slots[i].take().expect("a request is answered once")
    }
}

/// One connection in transmission. Its leader runs the connection: it reads requests as they
/// come, puts each in flight on its queue at once, answers each as the device does, and
/// looks at the socket again whenever an answer went out, so a client that keeps sixteen
/// requests in flight finds sixteen in flight on the device, with no thread between the
/// socket and the channel. While requests are in flight it waits as the channel does: it
/// spins on the queue for an adaptive budget (with more than two in flight, a few
/// `sched_yield` calls instead), then sleeps on the socket and the queue's doorbell
/// together. The other threads wait for the lead (leader/follower, as
/// nbdkit's threads take turns): a request that cannot go in flight as one (larger than the
/// queue carries, or of several steps) makes its leader pass the lead on and serve it alone,
/// so it holds up no other request.
struct Connection<'a> {
    shared: Common<'a>,
    raw: RawFd,
    device: Arc<Device>,
    structured: bool,
    inbound: Mutex<Inbound>,
    replier: Replier,
    /// Payload budget this connection holds: its writes' data and its reads' replies until
    /// they are sent.
    held: Arc<AtomicU64>,
}

pub(crate) fn transmit(
    shared: Common<'_>,
    id: u64,
    raw: RawFd,
    r: SockReader,
    w: std::fs::File,
    neg: Negotiated,
) -> io::Result<()> {
    let threads = shared.workers.max(1);
    let conn = Connection {
        shared,
        raw,
        structured: neg.structured,
        device: neg.device,
        inbound: Mutex::new(Inbound { r: SockBuf::new(r), ended: None }),
        replier: Replier::new(w, neg.structured, shared.request_timeout, shared.spare.clone()),
        held: Arc::new(AtomicU64::new(0)),
    };
    // Spread connections and their threads over the device's queues.
    let slot = |i: usize| (id as usize).wrapping_mul(threads).wrapping_add(i);
    std::thread::scope(|s| {
        for i in 1..threads {
            let c = &conn;
            // A thread that cannot be started leaves fewer to share the work; this one serves.
            let _ = std::thread::Builder::new().name("nbd-worker".into()).spawn_scoped(s, move || c.serve(slot(i)));
        }
        conn.serve(slot(0));
    });
    // Every thread has answered what it read and queued its replies; the last writer sent them.
    let ended = lock(&conn.inbound).ended.take();
    ended.unwrap_or(Ok(()))
}

/// Requests in flight up to which the leader spins for an answer. With more, answers come in
/// groups and one wake-up serves several; a spinning leader would instead take the CPU from
/// the driver it waits for (two CPUs here, and the client on one of them: QD16 made 75–81k
/// IOPS with a p99 of 1.2 ms spinning at any depth, 80–90k with 0.35 ms spinning at 1–2).
const SPIN_DEPTH: usize = 2;

/// Deeper than [`SPIN_DEPTH`], the leader calls `sched_yield` this many times, looking at the
/// queue after each and at the socket after every other, before it sleeps. Alone on its CPU
/// the calls return at once (a few µs in all); with the driver or the client runnable on the
/// same CPU, that thread runs first, and its answers or next requests are often there when
/// the call returns, so no doorbell and no wake-up are needed. QD16 on a `ram` device, 16
/// runs against 14 without: 125k IOPS on average against 116k, p50 102 µs in most runs
/// against 124 µs (docs/BENCHMARKS.md).
const DEEP_YIELDS: u32 = 8;
/// Turns of an idle spin between looks at the socket (each look is a system call).
const LOOK_EVERY: u32 = 256;
/// Requests one leader holds read but not yet in flight (its queue is full) at most.
const MAX_WAITING: usize = 64;
/// How soon a queue between generations (or whose doorbell storms) is looked at again.
const LATER_MS: libc::c_int = 1;
/// How long a sleep on the socket and a queue lasts at most before the queue is looked at
/// again (its generation, its device's health, its timeout).
const SLEEP_SLICE_MS: libc::c_int = 50;

impl Connection<'_> {
    /// One thread's life: take the lead, run the connection until the lead must pass, answer
    /// what is still in flight and serve the requests that run alone; until the connection
    /// ends.
    fn serve(&self, slot: usize) {
        let dev = &*self.device;
        let policy = if dev.mode() == NotifyMode::Irq { BudgetPolicy::Fixed(0) } else { BudgetPolicy::DEFAULT_AUTO };
        // The leader spins only with one or two requests in flight (`SPIN_DEPTH`), or for the
        // client's next request: an answer or a request is due within one request's time.
        // There, a run-queue count mostly finds other clients' threads, and a sleep costs a
        // doorbell wake-up on every answer: beside a capped neighbour's connection, a QD1
        // reader's p99 was 124–136 µs with the check and 80–85 µs without it
        // (docs/bench/tuning.md, "Over NBD: a leader that spins whatever the crowd").
        let mut idle = IdleSpin::new(policy).without_crowd_check();
        let mut jobs = Jobs::default();
        let mut alone = Vec::new();
        loop {
            let mut q = None;
            {
                let mut inb = lock(&self.inbound);
                if inb.ended.is_some() {
                    return;
                }
                self.lead(&mut inb, slot, &mut q, &mut jobs, &mut alone, &mut idle);
            }
            if let Some(q) = q.as_mut() {
                loop {
                    self.submit_waiting(q, &mut jobs);
                    if q.in_flight() == 0 {
                        break;
                    }
                    q.wait(|token, result, data| self.finish(jobs.take(token), result.map(|_| ()), data));
                    self.replier.try_flush();
                }
            }
            drop(q);
            self.replier.flush();
            for j in alone.drain(..) {
                self.run_alone(slot, j);
            }
        }
    }

    /// Runs the connection while this thread leads: returns when the client has gone, or a
    /// request must run alone (in `alone`), leaving what is in flight on `q` to the caller.
    #[allow(clippy::too_many_arguments)]
    fn lead<'d>(
        &'d self,
        inb: &mut Inbound,
        slot: usize,
        q: &mut Option<QueueHandle<'d>>,
        jobs: &mut Jobs,
        alone: &mut Vec<Job>,
        idle: &mut IdleSpin,
    ) {
        let dev = &*self.device;
        let max = dev.max_request();
        // An `irq` device's leader never spins, not even by yielding.
        let deep_yields = if dev.mode() == NotifyMode::Irq { 0 } else { DEEP_YIELDS };
        let mut last_answer = Instant::now();
        let mut look = true;
        let mut spins = 0u32;
        let mut yields = 0u32;
        loop {
            if q.is_none() && self.replier.backed_up() {
                // The client is behind on its replies: wait for it here, holding no queue.
                self.replier.flush();
            }
            let in_flight = q.as_ref().map_or(0, |q| q.in_flight()) + jobs.waiting.len();
            let mut work = 0;
            // Requests: wait for one when nothing is in flight; otherwise take what is here.
            if look || in_flight == 0 {
                look = false;
                let mut wait = in_flight == 0;
                while jobs.waiting.len() < MAX_WAITING {
                    match self.next(&mut inb.r, wait) {
                        Ok(Next::Job(j)) if j.queued(max) => {
                            let i = jobs.insert(j);
                            jobs.waiting.push_back(i);
                        }
                        Ok(Next::Job(j)) => {
                            alone.push(j);
                            break;
                        }
                        Ok(Next::NotNow) => break,
                        Ok(Next::End) => {
                            inb.ended = Some(Ok(()));
                            break;
                        }
                        Err(e) => {
                            inb.ended = Some(Err(e));
                            break;
                        }
                    }
                    work += 1;
                    wait = false;
                }
            }
            // Into flight: every request read, while the queue has room.
            if !jobs.waiting.is_empty() {
                if in_flight == 0 {
                    // The device's timeout counts from here, not from the last answer before
                    // the client went quiet.
                    last_answer = Instant::now();
                }
                // Take any queue nobody holds; wait in line for one only while holding none.
                let h = q.get_or_insert_with(|| dev.try_queue(slot).unwrap_or_else(|| dev.queue(slot)));
                // After its turn, with others in line, or while its client is not reading
                // its replies, this connection only drains.
                if !h.turn_over() && !self.replier.backed_up() {
                    work += self.submit_waiting(h, jobs);
                }
            }
            // Answers.
            if let Some(h) = q.as_mut() {
                let n = h.poll(|token, result, data| self.finish(jobs.take(token), result.map(|_| ()), data));
                if n > 0 {
                    last_answer = Instant::now();
                    // The client sends its next requests as answers reach it.
                    look = true;
                }
                work += n;
                work += h.expire(last_answer, |token, result, _| self.finish(jobs.take(token), result.map(|_| ()), None));
                if work > 0 {
                    self.replier.try_flush();
                }
                if h.in_flight() == 0 && (jobs.waiting.is_empty() || h.turn_over() || self.replier.backed_up()) {
                    // Drained: the queue goes to the next in line, and this connection, with
                    // requests still to send, asks again at the back.
                    *q = None;
                }
            }
            if inb.ended.is_some() || !alone.is_empty() {
                return;
            }
            let now = now_ns();
            if work > 0 {
                idle.worked(now);
                spins = 0;
                yields = 0;
                continue;
            }
            let Some(h) = q.as_mut() else { continue };
            // Many in flight and nothing new: let a thread runnable on this CPU go first a
            // few times, then sleep.
            if h.in_flight() > SPIN_DEPTH && yields < deep_yields {
                yields += 1;
                look = yields.is_multiple_of(2);
                std::thread::yield_now();
                continue;
            }
            // Few in flight and nothing new: spin on the queue, looking at the socket now and
            // then; then sleep on both.
            if idle.spin(now, h.in_flight() <= SPIN_DEPTH) {
                spins += 1;
                look = spins.is_multiple_of(LOOK_EVERY);
                std::hint::spin_loop();
                continue;
            }
            look = self.sleep(h, &inb.r);
        }
    }

    /// Puts the requests read and waiting in flight while `h` has room, oldest first; one
    /// the device refuses on sight is answered (queued for the replier). Returns how many
    /// were refused.
    fn submit_waiting(&self, h: &mut QueueHandle<'_>, jobs: &mut Jobs) -> usize {
        let mut refused = 0;
        while let Some(&i) = jobs.waiting.front() {
            let job = jobs.slots[i].as_ref().expect("a waiting request is held");
            match h.submit(job.front(), i as u64) {
                Ok(()) => {
                    // The device has the data (copied into its arena): the buffer can go.
                    let job = jobs.slots[i].as_mut().expect("a waiting request is held");
                    if job.payload.capacity() >= SPARE_MIN {
                        lock(self.shared.spare).keep(std::mem::take(&mut job.payload));
                    }
                }
                Err(IoError::QueueFull) => break,
                Err(e) => {
                    let j = jobs.take(i as u64);
                    self.finish(j, Err(e), None);
                    refused += 1;
                }
            }
            jobs.waiting.pop_front();
        }
        refused
    }

    /// Sleeps until the socket has something to read or the queue answers; returns whether
    /// the socket is worth a look.
    fn sleep(&self, h: &mut QueueHandle<'_>, r: &SockBuf) -> bool {
        let mut fds = [
            libc::pollfd { fd: self.raw, events: libc::POLLIN, revents: 0 },
            libc::pollfd { fd: -1, events: libc::POLLIN, revents: 0 },
        ];
        let timeout = match h.arm() {
            Armed::Idle | Armed::Now => return true,
            Armed::Spin => {
                // A `poll` device's driver never rings: look again, after any thread runnable
                // on this CPU has had its turn.
                std::thread::yield_now();
                return true;
            }
            Armed::Later => LATER_MS,
            Armed::Fd(fd) => {
                fds[1].fd = fd;
                SLEEP_SLICE_MS
            }
        };
        // A whole header not taken (its payload budget is short, or enough requests wait for
        // the queue): the socket would say "readable" at once, for ever. Answers come first.
        let watch_socket = r.buffered().len() < RequestHeader::SIZE;
        let fds = if watch_socket { &mut fds[..] } else { &mut fds[1..] };
        // A failed wait is a short one: the caller looks again.
        let _ = bulkhead_sys::poll(fds, timeout);
        h.disarm();
        watch_socket && fds[0].revents != 0
    }
    /// Waits up to `timeout_ms` (-1: for ever) for the socket to have something to read (or to
    /// be closed or broken, which the read that follows finds out).
    fn readable(&self, timeout_ms: libc::c_int) -> io::Result<bool> {
        let mut pfd = [libc::pollfd { fd: self.raw, events: libc::POLLIN, revents: 0 }];
        // An interrupted wait reports nothing ready, as a timeout would: the caller looks again.
        match bulkhead_sys::poll(&mut pfd, timeout_ms)? {
            0 if timeout_ms < 0 => Err(io::Error::from(io::ErrorKind::Interrupted)),
            0 => Ok(false),
            _ => Ok(pfd[0].revents & libc::POLLIN != 0),
        }
    }

    /// Whether a whole request header is here, adding what the socket holds without waiting.
    fn more_waiting(&self, r: &mut SockBuf) -> io::Result<bool> {
        if r.buffered().len() < RequestHeader::SIZE {
            r.set_deadline(None);
            r.fill_now()?;
        }
        Ok(r.buffered().len() >= RequestHeader::SIZE)
    }

    /// Reads the next request to serve, answering the ones refused on sight. With `wait`
    /// (nothing is in flight), the request is waited for, as long as the client likes;
    /// otherwise only a request whose header is already here is taken, and only while the
    /// payload budget has room without waiting.
    fn next(&self, r: &mut SockBuf, wait: bool) -> io::Result<Next> {
        let shared = &self.shared;
        loop {
            if self.replier.broken() {
                return Err(io::Error::new(io::ErrorKind::BrokenPipe, "cannot write replies"));
            }
            let req = if wait {
                if r.buffered().is_empty() {
                    // Idle between requests is fine, for as long as the client likes.
                    match self.readable(-1) {
                        Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                        Err(e) => return Err(e),
                        Ok(_) => {}
                    }
                    r.set_deadline(None);
                    if r.fill()? == 0 {
                        return Ok(Next::End); // the client closed
                    }
                }
                // From its first byte, a request (header and payload) must arrive in time.
                r.set_deadline(Some(Instant::now() + shared.request_timeout));
                let mut hdr = [0u8; RequestHeader::SIZE];
                r.read_exact(&mut hdr).map_err(|e| timeout_says(e, "request"))?;
                RequestHeader::decode(&hdr).ok_or_else(|| violation("bad request magic"))?
            } else {
                if !self.more_waiting(r)? {
                    return Ok(Next::NotNow);
                }
                // Looked at, not taken: a request the budget cannot hold now stays for later.
                RequestHeader::decode(r.buffered()[..RequestHeader::SIZE].try_into().expect("a whole header"))
                    .ok_or_else(|| violation("bad request magic"))?
            };
            let (cookie, cmd, flush_after) = match req.parse(self.device.size(), self.structured) {
                Ok(Transmission::Io { cookie, cmd, flush_after }) => (cookie, cmd, flush_after),
                Ok(Transmission::Disconnect) => {
                    if !wait {
                        r.consume(RequestHeader::SIZE);
                    }
                    return Ok(Next::End);
                }
                Err(Refused { error, payload }) => {
                    if !wait {
                        r.consume(RequestHeader::SIZE);
                        r.set_deadline(Some(Instant::now() + shared.request_timeout));
                    }
                    if let Some(len) = payload {
                        if len > MAX_PAYLOAD {
                            // Cannot skip that much without reading it: refuse and close.
                            self.replier.push(self.replier.status(req.cookie, error));
                            return Err(violation(format!("write of {len} bytes (limit {MAX_PAYLOAD})")));
                        }
                        // Stay in step: consume the payload of the refused write.
                        io::copy(&mut r.take(len.into()), &mut io::sink()).map_err(|e| timeout_says(e, "request"))?;
                    }
                    // Sent now if the socket takes it (the leader may hold a queue: no
                    // waiting here); else with the leader's next flush.
                    self.replier.push(self.replier.status(req.cookie, error));
                    self.replier.try_flush();
                    shared.requests.fetch_add(1, Ordering::Relaxed);
                    continue;
                }
            };
            let bytes = match cmd {
                Command::Read { into: n, .. } | Command::Write { from: n, .. } => u64::from(n),
                Command::Flush | Command::Discard { .. } | Command::WriteZeroes { .. } => 0,
            };
            let held = match (bytes, wait) {
                (0, _) => None,
                (n, true) => Some(shared.budget.take(n, &self.held)),
                (n, false) => match shared.budget.try_take(n, &self.held, CONNECTION_SHARE) {
                    Some(h) => Some(h),
                    None => return Ok(Next::NotNow),
                },
            };
            if !wait {
                r.consume(RequestHeader::SIZE);
                r.set_deadline(Some(Instant::now() + shared.request_timeout));
            }
            let mut payload = Vec::new();
            if let Command::Write { from: len, .. } = cmd {
                payload = Spare::buffer(shared.spare, len as usize);
                payload.resize(len as usize, 0);
                r.read_exact(&mut payload).map_err(|e| timeout_says(e, "request"))?;
            }
            return Ok(Next::Job(Job { cookie, cmd, flush_after, payload, held }));
        }
    }

    /// Answers a queued request with its outcome (and a read's data). The reply is queued:
    /// the caller flushes the replier once it has answered what it holds.
    fn finish(&self, job: Job, result: Result<(), IoError>, data: Option<SharedSlice<'_>>) {
        self.shared.requests.fetch_add(1, Ordering::Relaxed);
        let counters = &self.device.counters;
        let cookie = job.cookie;
        let status = |r: Result<(), IoError>| r.err().map_or(0, |e| io_error(&e));
        let reply = match job.cmd {
            Command::Read { offset, into: len } => match (result, data) {
                (Ok(()), Some(d)) if d.len() == len as usize => {
                    counters.bytes_read.fetch_add(len.into(), Ordering::Relaxed);
                    let hdr = if self.structured { 20 + 8 } else { 16 };
                    let mut buf = self.replier.buffer(hdr + len as usize);
                    buf.resize(hdr, 0);
                    d.append_to(&mut buf);
                    self.data_reply(cookie, offset, buf, job.held)
                }
                // An answer without the data asked for.
                (Ok(()), _) => self.replier.status(cookie, EIO),
                (Err(e), _) => self.replier.status(cookie, io_error(&e)),
            },
            Command::Write { from: len, .. } => {
                if result.is_ok() {
                    counters.bytes_written.fetch_add(len.into(), Ordering::Relaxed);
                }
                drop(job.held);
                self.replier.status(cookie, status(result))
            }
            Command::Flush | Command::Discard { .. } | Command::WriteZeroes { .. } => self.replier.status(cookie, status(result)),
        };
        self.replier.push(reply);
    }

    /// A read's reply: `buf` holds room for the header, then the data.
    fn data_reply(&self, cookie: u64, offset: u64, mut buf: Vec<u8>, held: Option<Held>) -> Reply {
        if self.structured {
            let len = buf.len() - (20 + 8);
            let h = chunk_header(REPLY_FLAG_DONE, REPLY_TYPE_OFFSET_DATA, cookie, 8 + len as u32);
            buf[..20].copy_from_slice(&h);
            buf[20..28].copy_from_slice(&offset.to_be_bytes());
        } else {
            buf[..16].copy_from_slice(&simple_reply(0, cookie));
        }
        Reply { bytes: buf, _held: held }
    }

    /// Runs one request by itself, in as many steps as it takes, and answers it.
    fn run_alone(&self, slot: usize, job: Job) {
        let dev = &*self.device;
        let cookie = job.cookie;
        let status = |r: Result<(), IoError>| r.err().map_or(0, |e| io_error(&e));
        let then_flush = |r: Result<(), IoError>| r.and_then(|_| if job.flush_after { dev.flush(slot) } else { Ok(()) });
        self.shared.requests.fetch_add(1, Ordering::Relaxed);
        match job.cmd {
            Command::Read { offset, into: len } => {
                let hdr = if self.structured { 20 + 8 } else { 16 };
                let mut buf = vec![0u8; hdr + len as usize];
                match dev.read_into(slot, offset, &mut buf[hdr..]) {
                    Ok(()) => self.replier.send(self.data_reply(cookie, offset, buf, job.held)),
                    Err(e) => self.replier.done(cookie, io_error(&e)),
                }
            }
            Command::Write { offset, from: _, fua } => {
                let r = dev.write(slot, offset, &job.payload, fua);
                self.replier.done(cookie, status(r));
            }
            Command::Flush => self.replier.done(cookie, status(dev.flush(slot))),
            Command::Discard { offset, len } => self.replier.done(cookie, status(then_flush(dev.discard(slot, offset, len)))),
            Command::WriteZeroes { offset, len } => self.replier.done(cookie, status(then_flush(zero(dev, slot, offset, len)))),
        }
    }
}

/// Write-zeroes, falling back to writing zeroes where the device cannot zero a range itself.
fn zero(dev: &Device, slot: usize, offset: u64, len: u64) -> Result<(), IoError> {
    match dev.write_zeroes(slot, offset, len) {
        Err(IoError::Device(bulkhead_client::Status::NotSupported)) => {
            let chunk = vec![0u8; (len.min(1 << 20)) as usize];
            let mut done = 0;
            while done < len {
                let n = (len - done).min(chunk.len() as u64) as usize;
                dev.write(slot, offset + done, &chunk[..n], false)?;
                done += n as u64;
            }
            Ok(())
        }
        r => r,
    }
}
