//! A block device served by a driver domain, as the application side sees it.
//!
//! [`Device`] owns the frontend end of every queue of one device channel. Each user of a queue
//! holds a [`QueueHandle`] to it (SPDK's I/O channel): its own queue, as many requests in
//! flight as the ring has slots, completions reaped when it asks. The synchronous calls
//! ([`Device::read`], [`Device::write`], …) take the queue of a *slot* (a worker index) for one
//! request, so exports with as many workers as queues never contend; a request that does not
//! fit one queue's arena is split. When the domain is restarted, the requests a handle has
//! without an answer move to the new generation with their data; the caller sees a pause.
//!
//! The supervisor drives the device through a [`DeviceControl`], its own face, made with the
//! device: restarts, outages, failure.
//!
//! ```no_run
//! # fn demo(dev: &bulkhead_client::Device) -> Result<(), bulkhead_client::IoError> {
//! use bulkhead_client::FrontRequest;
//! let mut buf = vec![0u8; 4096];
//! dev.write(0, 0, &buf, false)?;
//! dev.flush(0)?;
//! dev.read_into(0, 0, &mut buf)?;
//! // Several requests in flight on one queue.
//! let mut q = dev.queue(1);
//! for i in 0..8u64 {
//!     q.submit(FrontRequest::Read { offset: i * 4096, into: 4096 }, i)?;
//! }
//! let mut done = 0;
//! while done < 8 {
//!     done += q.wait(|_token, result, _data| assert!(result.is_ok()));
//! }
//! # Ok(()) }
//! ```
#![forbid(unsafe_code)]
#![deny(missing_docs)]

use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use bulkhead_channel::{ChannelError, FrontQueue, NotifyMode};
pub use bulkhead_channel::{Command, FillError, FrontRequest, Op, SharedSlice, Status};
use bulkhead_doorbell::EventFd;

pub mod attach;
mod queue;
mod turn;
pub use attach::{attach, attach_with, AttachError, AttachOptions, Attached};
pub use queue::{Armed, QueueHandle, QueueLine};
use turn::Turnstile;

/// Why an I/O failed, with the errno an export sends.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IoError {
    /// The device answered with an error status.
    #[error("device error: {0:?}")]
    Device(Status),
    /// The request is outside the device or malformed.
    #[error("invalid request: {0}")]
    Invalid(&'static str),
    /// The driver domain is unavailable (broken channel, dead or wedged domain, shutdown).
    #[error("device unavailable: {0}")]
    Unavailable(String),
    /// The queue has as many requests in flight as it holds: reap some first.
    #[error("queue full")]
    QueueFull,
    /// A write's data could not be read from where the caller had it: nothing was sent.
    #[error("the write's data could not be read: {0}")]
    Unreadable(String),
}

impl IoError {
    /// errno for this error.
    pub fn errno(&self) -> i32 {
        match self {
            IoError::Device(s) => s.errno(),
            IoError::Invalid(_) => libc::EINVAL,
            IoError::Unavailable(_) => libc::EIO,
            IoError::QueueFull => libc::EAGAIN,
            IoError::Unreadable(_) => libc::EIO,
        }
    }
}

/// Counters of a device.
#[derive(Debug, Default)]
pub struct DeviceCounters {
    /// Requests completed successfully.
    pub completed: AtomicU64,
    /// Requests failed.
    pub failed: AtomicU64,
    /// Bytes read.
    pub bytes_read: AtomicU64,
    /// Bytes written.
    pub bytes_written: AtomicU64,
}

/// The operations each queue counts ([`OpCounters`]), by name.
pub const OPS: [(bulkhead_channel::Op, &str); 5] = [
    (bulkhead_channel::Op::Read, "read"),
    (bulkhead_channel::Op::Write, "write"),
    (bulkhead_channel::Op::Flush, "flush"),
    (bulkhead_channel::Op::Discard, "discard"),
    (bulkhead_channel::Op::WriteZeroes, "write_zeroes"),
];

/// Upper bounds of the latency histogram's buckets, µs (a last bucket holds the rest).
pub const LATENCY_BOUNDS_US: [u64; 16] =
    [10, 25, 50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 25_000, 50_000, 100_000, 250_000, 1_000_000, 10_000_000];

/// One operation's counters: answers, errors, bytes asked for, and the latency from first
/// submission to answer (reissues after a restart included).
#[derive(Debug, Default)]
pub struct OpCounters {
    /// Requests answered (any status).
    pub requests: AtomicU64,
    /// Of them, answered with an error.
    pub errors: AtomicU64,
    /// Bytes the requests asked for.
    pub bytes: AtomicU64,
    /// Sum of the latencies, ns.
    pub latency_sum_ns: AtomicU64,
    /// Requests by latency: `buckets[i]` those within `LATENCY_BOUNDS_US[i]` and above the
    /// bound before it; the last, those above every bound.
    pub buckets: [AtomicU64; 17],
}

/// One queue's counters by operation, in the order of [`OPS`]. Each queue has its own, on
/// cache lines of their own: a queue is used by one thread at a time, so counting costs no
/// cache line moving between CPUs. [`Device::op_totals`] sums them.
#[derive(Debug, Default)]
#[repr(align(128))]
pub struct QueueCounters {
    /// By operation.
    pub ops: [OpCounters; 5],
    /// Time spent spinning for responses, ns (by the queue, or by an export waiting on it).
    pub spin_ns: AtomicU64,
    /// Time spent asleep waiting for responses, ns.
    pub sleep_ns: AtomicU64,
}

impl QueueCounters {
    /// Counts an answer to a request of `op` for `len` bytes after `latency_ns`.
    pub fn record(&self, op: bulkhead_channel::Op, len: u64, latency_ns: u64, ok: bool) {
        let Some(i) = OPS.iter().position(|(o, _)| *o == op) else { return };
        let c = &self.ops[i];
        c.requests.fetch_add(1, Ordering::Relaxed);
        if !ok {
            c.errors.fetch_add(1, Ordering::Relaxed);
        }
        c.bytes.fetch_add(len, Ordering::Relaxed);
        c.latency_sum_ns.fetch_add(latency_ns, Ordering::Relaxed);
        let us = latency_ns / 1000;
        let b = LATENCY_BOUNDS_US.iter().position(|&bound| us < bound).unwrap_or(LATENCY_BOUNDS_US.len());
        c.buckets[b].fetch_add(1, Ordering::Relaxed);
    }
}

/// One operation's totals over a device's queues.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OpTotals {
    /// Requests answered.
    pub requests: u64,
    /// Of them, with an error.
    pub errors: u64,
    /// Bytes asked for.
    pub bytes: u64,
    /// Sum of the latencies, ns.
    pub latency_sum_ns: u64,
    /// Requests by latency bucket ([`LATENCY_BOUNDS_US`], then the rest).
    pub buckets: [u64; 17],
}

/// Log lines a device may write in a burst; after that one per second, counting what it held
/// back: a hostile driver must not be able to flood the log.
const LOG_BURST: f64 = 5.0;

#[derive(Debug)]
struct LogLimit {
    tokens: f64,
    refilled: Instant,
    held_back: u64,
}

impl Default for LogLimit {
    fn default() -> Self {
        LogLimit { tokens: LOG_BURST, refilled: Instant::now(), held_back: 0 }
    }
}

/// Restart bookkeeping shared with the supervisor.
#[derive(Debug, Default)]
struct Generations {
    /// What each queue must do to reach the newest generation, done by its next user.
    staged: Vec<Option<Staged>>,
    /// Queues still to start over in place (see [`DeviceControl::start_over_in_place`]).
    in_place_left: usize,
    /// Duplicates of each current queue's irq doorbell, to wake sleepers on a restart.
    wakers: Vec<Option<EventFd>>,
    /// When the outage being repaired was detected.
    outage_since: Option<Instant>,
    /// Outages measured (detection to first completion after restart): when each was
    /// detected, and how long it lasted, ms.
    outages: Vec<(Instant, f64)>,
}

impl Generations {
    /// Ends the outage being timed, if one is, and records it; says whether one was.
    fn end_outage(&mut self) -> bool {
        let Some(t) = self.outage_since.take() else { return false };
        self.outages.push((t, t.elapsed().as_secs_f64() * 1e3));
        true
    }
}

/// How a queue reaches the newest generation.
#[derive(Debug)]
pub(crate) enum Staged {
    /// A new queue to move to: a new domain on new files.
    Queue(Box<FrontQueue>),
    /// Start this queue over in place as this generation: a new domain on the same files.
    InPlace(u32),
}

/// One queue of a device as its users share it.
#[derive(Debug)]
pub(crate) struct QueueState {
    /// The current generation's frontend end (or the newest this queue has taken).
    pub(crate) q: FrontQueue,
    /// A queue of an older generation whose unanswered requests have not moved yet: the
    /// generation after it broke before they could. They move to the next one.
    pub(crate) carry: Option<FrontQueue>,
    /// How much of `q`'s spin and sleep time the device's counters hold already.
    pub(crate) spin_counted: u64,
    pub(crate) sleep_counted: u64,
}

/// A device served by a driver domain, as applications and exports use it.
#[derive(Debug)]
pub struct Device {
    name: String,
    size: u64,
    mode: NotifyMode,
    queues: Vec<Mutex<QueueState>>,
    /// Who holds each queue, and who waits for one, in order.
    turns: Turnstile,
    /// Each queue's counters by operation.
    queue_counters: Vec<QueueCounters>,
    generation: AtomicU32,
    gens: Mutex<Generations>,
    changed: Condvar,
    failed: AtomicBool,
    fail_reason: Mutex<Option<String>>,
    broken_reported: AtomicBool,
    log_limit: Mutex<LogLimit>,
    alarm: EventFd,
    in_flight: AtomicUsize,
    /// Set from the supervisor's detection of a dead, wedged or broken domain until the next
    /// generation is installed: waiters stop spinning on a domain that will not answer.
    outage: AtomicBool,
    /// An outage is being timed (cheap check on the completion path before taking `gens`).
    outage_timed: AtomicBool,
    /// Largest request one queue carries (all queues share one geometry).
    max_request: u64,
    /// Slots of each queue's ring.
    depth: usize,
    /// Bytes a request's offset and length must be multiples of (see
    /// [`min_block`](Device::min_block)).
    min_block: AtomicU32,
    /// Exports offer it read-only (its domain refuses writes on its queues either way).
    read_only: AtomicBool,
    timeout_ms: Option<u64>,
    /// Counters.
    pub counters: DeviceCounters,
}

/// The supervisor's face of a [`Device`], made with it: installs the queues of each new
/// generation, marks outages and failure, and reads what the watchdog needs. Applications
/// hold the device alone and cannot reach these.
#[derive(Debug)]
pub struct DeviceControl {
    dev: Arc<Device>,
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Device {
    /// A device over `queues` (at least one, all of one generation), and its control face.
    /// With `timeout_ms`, a wait with requests in flight and no answer for that long fails them
    /// with `Unavailable`; without, it waits for the supervisor to restart or fail the domain.
    pub fn new(name: &str, size: u64, queues: Vec<FrontQueue>, timeout_ms: Option<u64>) -> (Arc<Device>, DeviceControl) {
        assert!(!queues.is_empty(), "a device has at least one queue");
        let mode = queues[0].mode();
        let generation = queues[0].generation();
        let max_request = queues[0].max_request();
        let depth = queues[0].capacity();
        let wakers = queues.iter().map(|q| q.irq_waker().ok().and_then(|fd| EventFd::from_owned(fd).ok())).collect();
        let n = queues.len();
        let dev = Arc::new(Device {
            name: name.to_string(),
            size,
            mode,
            queues: queues
                .into_iter()
                .map(|mut q| {
                    q.set_timed(true);
                    Mutex::new(QueueState { q, carry: None, spin_counted: 0, sleep_counted: 0 })
                })
                .collect(),
            turns: Turnstile::new(n),
            queue_counters: (0..n).map(|_| QueueCounters::default()).collect(),
            generation: AtomicU32::new(generation),
            gens: Mutex::new(Generations { staged: (0..n).map(|_| None).collect(), wakers, ..Default::default() }),
            changed: Condvar::new(),
            failed: AtomicBool::new(false),
            fail_reason: Mutex::new(None),
            broken_reported: AtomicBool::new(false),
            log_limit: Mutex::new(LogLimit::default()),
            alarm: EventFd::new().expect("eventfd"),
            in_flight: AtomicUsize::new(0),
            outage: AtomicBool::new(false),
            outage_timed: AtomicBool::new(false),
            max_request,
            depth,
            min_block: AtomicU32::new(1),
            read_only: AtomicBool::new(false),
            timeout_ms,
            counters: DeviceCounters::default(),
        });
        (dev.clone(), DeviceControl { dev })
    }

    /// Device name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Size in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Notification mode of its channel.
    pub fn mode(&self) -> NotifyMode {
        self.mode
    }

    /// Number of queues.
    pub fn queue_count(&self) -> usize {
        self.queues.len()
    }

    /// Requests one queue holds in flight at most.
    pub fn queue_depth(&self) -> usize {
        self.depth
    }

    /// The current channel generation.
    pub fn generation(&self) -> u32 {
        self.generation.load(Ordering::Acquire)
    }

    /// Requests, bytes and latencies of what the driver answered, all operations together,
    /// as `status` and the metrics show them.
    pub fn io_figures(&self) -> bulkhead_control::IoFigures {
        let ops = self.op_totals();
        let mut buckets = vec![0u64; LATENCY_BOUNDS_US.len() + 1];
        let mut requests = 0;
        for op in &ops {
            requests += op.requests;
            for (b, n) in buckets.iter_mut().zip(&op.buckets) {
                *b += n;
            }
        }
        bulkhead_control::IoFigures {
            requests,
            bytes_read: ops[0].bytes,
            bytes_written: ops[1].bytes,
            latency_bounds_us: LATENCY_BOUNDS_US.to_vec(),
            latency_buckets: buckets,
        }
    }

    /// What the driver answered, by operation ([`OPS`]), summed over the queues.
    pub fn op_totals(&self) -> [OpTotals; 5] {
        let mut t: [OpTotals; 5] = Default::default();
        for q in &self.queue_counters {
            for (t, c) in t.iter_mut().zip(&q.ops) {
                t.requests += c.requests.load(Ordering::Relaxed);
                t.errors += c.errors.load(Ordering::Relaxed);
                t.bytes += c.bytes.load(Ordering::Relaxed);
                t.latency_sum_ns += c.latency_sum_ns.load(Ordering::Relaxed);
                for (b, n) in t.buckets.iter_mut().zip(&c.buckets) {
                    *b += n.load(Ordering::Relaxed);
                }
            }
        }
        t
    }

    /// Time its queues spent spinning for responses and asleep waiting for them, ns.
    pub fn wait_totals(&self) -> (u64, u64) {
        self.queue_counters.iter().fold((0, 0), |(spin, sleep), q| {
            (spin + q.spin_ns.load(Ordering::Relaxed), sleep + q.sleep_ns.load(Ordering::Relaxed))
        })
    }

    /// The counters of queue `idx`.
    pub fn queue_counters(&self, idx: usize) -> &QueueCounters {
        &self.queue_counters[idx]
    }

    /// Requests submitted and not yet answered.
    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Acquire)
    }

    /// Why the device failed, if it did.
    pub fn failure(&self) -> Option<String> {
        if !self.failed.load(Ordering::Acquire) {
            return None;
        }
        lock(&self.fail_reason).clone()
    }

    /// Largest request one queue carries without splitting.
    pub fn max_request(&self) -> u64 {
        self.max_request
    }

    /// The smallest block the device takes: a request's offset and length must be multiples
    /// of it (1 unless a layer works in sectors, as `crypt` does in the volume's). Exports
    /// advertise it; requests that break it fail with `Invalid`.
    pub fn min_block(&self) -> u32 {
        self.min_block.load(Ordering::Relaxed)
    }

    /// Sets [`min_block`](Self::min_block) (a power of two), before the device is exported.
    pub fn set_min_block(&self, bytes: u32) {
        debug_assert!(bytes.is_power_of_two());
        self.min_block.store(bytes, Ordering::Relaxed);
    }

    /// Whether the device takes no writes: a read-only view. Exports say so to their clients;
    /// the domain refuses a write on its queues with `ReadOnly` whatever a client sends.
    pub fn read_only(&self) -> bool {
        self.read_only.load(Ordering::Relaxed)
    }

    /// Marks the device read-only, before it is exported.
    pub fn set_read_only(&self, on: bool) {
        self.read_only.store(on, Ordering::Relaxed);
    }

    /// A queue, held until the handle is dropped: its user alone submits on it and reaps from
    /// it. The queue of `slot` (modulo the queue count) if it is free, else any free one; if
    /// none is, blocks in line behind those who asked first for the first one let go.
    pub fn queue(&self, slot: usize) -> QueueHandle<'_> {
        let idx = self.turns.enter(slot % self.queues.len());
        QueueHandle::new(self, idx)
    }

    /// The first queue from `slot` on (modulo the queue count) that nobody holds, without
    /// waiting: for a user that already holds queues and must not block on another.
    pub fn try_queue(&self, slot: usize) -> Option<QueueHandle<'_>> {
        let idx = self.turns.try_enter(slot % self.queues.len())?;
        Some(QueueHandle::new(self, idx))
    }

    /// A place in line for a queue (that of `slot`, modulo the queue count, if free), without
    /// waiting: for a user that cannot block (it polls other work) yet must not be passed
    /// over by those who can. [`QueueLine::try_take`] gives the queue once its turn has come.
    pub fn line_up(&self, slot: usize) -> QueueLine<'_> {
        QueueLine::new(self, self.turns.line_up(slot % self.queues.len()))
    }

    /// A queue without waiting, for a user that polls other work: a free one at once, else a
    /// place in line kept in `line` (taken on a later call once its turn comes), so that users
    /// who can block do not pass this one over for ever. `None` while others are ahead.
    pub fn poll_queue<'a>(&'a self, slot: usize, line: &mut Option<QueueLine<'a>>) -> Option<QueueHandle<'a>> {
        let handle = match line.as_mut() {
            Some(l) => l.try_take(),
            None => self.try_queue(slot).or_else(|| line.insert(self.line_up(slot)).try_take()),
        };
        if handle.is_some() {
            *line = None;
        }
        handle
    }

    pub(crate) fn turnstile(&self) -> &Turnstile {
        &self.turns
    }

    /// Logs `line` (prefixed with the device) within a budget of a few lines in a burst and
    /// one a second after that; the next line logged says how many were held back. For
    /// everything a misbehaving driver can cause at a high rate.
    fn log_limited(&self, line: impl FnOnce() -> String) {
        let mut l = lock(&self.log_limit);
        let now = Instant::now();
        l.tokens = (l.tokens + now.duration_since(l.refilled).as_secs_f64()).min(LOG_BURST);
        l.refilled = now;
        if l.tokens < 1.0 {
            l.held_back += 1;
            return;
        }
        l.tokens -= 1.0;
        let held = std::mem::take(&mut l.held_back);
        drop(l);
        if held > 0 {
            eprintln!("bulkhead: device {}: {} ({held} similar lines held back)", self.name, line());
        } else {
            eprintln!("bulkhead: device {}: {}", self.name, line());
        }
    }

    pub(crate) fn report_broken(&self, e: &ChannelError) {
        if !self.broken_reported.swap(true, Ordering::AcqRel) {
            self.log_limited(|| format!("channel broken: {e}"));
        }
        self.alarm.ring();
    }

    pub(crate) fn check_range(&self, offset: u64, len: u64) -> Result<(), IoError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.size => Ok(()),
            _ => Err(IoError::Invalid("range beyond the end of the device")),
        }
    }

    pub(crate) fn is_failed(&self) -> bool {
        self.failed.load(Ordering::Acquire)
    }

    pub(crate) fn in_outage(&self) -> bool {
        self.outage.load(Ordering::Acquire)
    }

    pub(crate) fn outage_flag(&self) -> &AtomicBool {
        &self.outage
    }

    pub(crate) fn timeout(&self) -> Option<Duration> {
        self.timeout_ms.map(Duration::from_millis)
    }

    pub(crate) fn unavailable(&self) -> IoError {
        IoError::Unavailable(self.failure().unwrap_or_else(|| "device failed".into()))
    }

    pub(crate) fn queue_state(&self, idx: usize) -> MutexGuard<'_, QueueState> {
        lock(&self.queues[idx])
    }

    /// The newest generation's queue `idx`, if it has not been taken yet.
    pub(crate) fn take_staged(&self, idx: usize) -> Option<Staged> {
        lock(&self.gens).staged[idx].take()
    }

    /// Makes `generation`, staged in `g`, the device's current one: the outage ends for
    /// submitters, and users waiting for a generation look again.
    fn announce(&self, g: MutexGuard<'_, Generations>, generation: u32) {
        self.broken_reported.store(false, Ordering::Release);
        self.generation.store(generation, Ordering::Release);
        self.outage.store(false, Ordering::Release);
        drop(g);
        self.changed.notify_all();
    }

    /// One queue has started over in place.
    pub(crate) fn started_over(&self) {
        let mut g = lock(&self.gens);
        g.in_place_left = g.in_place_left.saturating_sub(1);
        drop(g);
        self.changed.notify_all();
    }

    /// Blocks until the generation moves past `gen`, the device fails, or `slice` passes.
    pub(crate) fn wait_for_generation(&self, gen: u32, slice: Duration) {
        let g = lock(&self.gens);
        let _ = self.changed.wait_timeout_while(g, slice, |_| self.generation() == gen && !self.failed.load(Ordering::Acquire));
    }

    pub(crate) fn started(&self) {
        self.in_flight.fetch_add(1, Ordering::AcqRel);
    }

    /// One request answered (`ok`: successfully) or given up.
    pub(crate) fn finished(&self, ok: Option<bool>) {
        self.in_flight.fetch_sub(1, Ordering::AcqRel);
        match ok {
            Some(true) => self.counters.completed.fetch_add(1, Ordering::Relaxed),
            Some(false) => self.counters.failed.fetch_add(1, Ordering::Relaxed),
            None => return,
        };
        // Hot path: only an open outage takes the lock.
        if !self.outage_timed.load(Ordering::Acquire) {
            return;
        }
        lock(&self.gens).end_outage();
        self.outage_timed.store(false, Ordering::Release);
    }

    pub(crate) fn log_storm(&self) {
        self.log_limited(|| {
            format!(
                "driver rings its doorbell with no response ({} wake-ups in a row): ignoring it for {} ms",
                bulkhead_channel::STORM_WAKES,
                bulkhead_channel::STORM_DAMP_MS
            )
        });
    }

    /// Runs one request on the queue of `slot` until it is answered. If the domain dies,
    /// wedges or breaks the channel meanwhile, the request moves to the next generation once
    /// the supervisor has restarted the domain.
    fn run(&self, slot: usize, req: FrontRequest<'_>, mut on_data: impl FnMut(SharedSlice<'_>)) -> Result<u64, IoError> {
        let mut q = self.queue(slot);
        q.submit(req, 0)?;
        let mut out = None;
        while out.is_none() {
            q.wait(|_, result, data| {
                if let (Ok(_), Some(d)) = (&result, data) {
                    on_data(d);
                }
                out = Some(result);
            });
        }
        out.expect("answered")
    }

    /// Reads `len` bytes at `offset`, handing the data to `f` as `(offset within the request,
    /// window)` pieces, in order. Copy out inside `f`: the window is reused afterwards.
    pub fn read(&self, slot: usize, offset: u64, len: u64, mut f: impl FnMut(u64, SharedSlice<'_>)) -> Result<(), IoError> {
        self.check_range(offset, len)?;
        let chunk = self.max_request;
        let mut done = 0;
        while done < len {
            let n = (len - done).min(chunk);
            self.run(slot, FrontRequest::Read { offset: offset + done, into: n }, |w| f(done, w))?;
            done += n;
        }
        self.counters.bytes_read.fetch_add(len, Ordering::Relaxed);
        Ok(())
    }

    /// Reads into `buf`.
    pub fn read_into(&self, slot: usize, offset: u64, buf: &mut [u8]) -> Result<(), IoError> {
        self.read(slot, offset, buf.len() as u64, |at, w| w.copy_to(&mut buf[at as usize..at as usize + w.len()]))
    }

    /// Writes `data` at `offset`; with `fua` the data is durable when this returns.
    pub fn write(&self, slot: usize, offset: u64, data: &[u8], fua: bool) -> Result<(), IoError> {
        self.check_range(offset, data.len() as u64)?;
        let chunk = self.max_request as usize;
        for (i, piece) in data.chunks(chunk.max(1)).enumerate() {
            let at = offset + (i * chunk) as u64;
            self.run(slot, FrontRequest::Write { offset: at, from: piece, fua }, |_| {})?;
        }
        self.counters.bytes_written.fetch_add(data.len() as u64, Ordering::Relaxed);
        Ok(())
    }

    /// Makes every acknowledged write durable. One flush on any queue suffices: a domain runs
    /// one chain over one backend and acknowledges a write only once the backend has accepted
    /// it, so the backend's flush covers writes acknowledged on every queue.
    pub fn flush(&self, slot: usize) -> Result<(), IoError> {
        self.run(slot, FrontRequest::Flush, |_| {}).map(|_| ())
    }

    /// Deallocates a range.
    pub fn discard(&self, slot: usize, offset: u64, len: u64) -> Result<(), IoError> {
        self.check_range(offset, len)?;
        if len == 0 {
            return Ok(());
        }
        self.run(slot, FrontRequest::Discard { offset, len }, |_| {}).map(|_| ())
    }

    /// Zeroes a range.
    pub fn write_zeroes(&self, slot: usize, offset: u64, len: u64) -> Result<(), IoError> {
        self.check_range(offset, len)?;
        if len == 0 {
            return Ok(());
        }
        self.run(slot, FrontRequest::WriteZeroes { offset, len }, |_| {}).map(|_| ())
    }
}

impl DeviceControl {
    /// The device, as the exports get it.
    pub fn device(&self) -> &Arc<Device> {
        &self.dev
    }

    /// Requests answered so far (any status): the watchdog's progress measure.
    pub fn answered(&self) -> u64 {
        self.dev.counters.completed.load(Ordering::Relaxed) + self.dev.counters.failed.load(Ordering::Relaxed)
    }

    /// Requests submitted and not yet answered.
    pub fn in_flight(&self) -> usize {
        self.dev.in_flight()
    }

    /// A doorbell rung when a queue reports its channel broken (for the supervisor to poll).
    pub fn alarm_fd(&self) -> RawFd {
        self.dev.alarm.as_raw_fd()
    }

    /// A copy of [`alarm_fd`](Self::alarm_fd), for a watcher to keep open while it watches it.
    pub fn alarm(&self) -> std::io::Result<std::os::fd::OwnedFd> {
        self.dev.alarm.try_clone().map(EventFd::into_owned)
    }

    /// Whether a queue reported a broken channel since the last restart; clears the report.
    pub fn take_broken_report(&self) -> bool {
        self.dev.alarm.drain();
        self.dev.broken_reported.swap(false, Ordering::AcqRel)
    }

    /// Logs `line` for the device, rate-limited (see the device's log budget).
    pub fn log_limited(&self, line: impl FnOnce() -> String) {
        self.dev.log_limited(line);
    }

    /// Marks the start of an outage (the supervisor detected a dead, wedged or broken domain).
    pub fn outage_started(&self, at: Instant) {
        let d = &self.dev;
        let mut g = lock(&d.gens);
        g.outage_since.get_or_insert(at);
        d.outage_timed.store(true, Ordering::Release);
        d.outage.store(true, Ordering::Release);
        for w in g.wakers.iter().flatten() {
            w.ring();
        }
    }

    /// Times an outage the frontend does not see as one (a domain below a tap domain is being
    /// replaced while the tap domain holds the requests): from `at` to the next answer.
    pub fn time_outage(&self, at: Instant) {
        let d = &self.dev;
        lock(&d.gens).outage_since.get_or_insert(at);
        d.outage_timed.store(true, Ordering::Release);
    }

    /// Ends the outage being timed now if no request waits on it (the replaced domain is up
    /// and nothing was in flight): it must not run on until the next request comes.
    pub fn outage_over_if_idle(&self) {
        let d = &self.dev;
        let mut g = lock(&d.gens);
        if d.in_flight() == 0 && g.end_outage() {
            d.outage_timed.store(false, Ordering::Release);
        }
    }

    /// Installs the queues of a new generation (a restarted domain). Each is taken by the next
    /// user of its queue, and the requests the old one had without a response move to it;
    /// users waiting on an old queue are woken.
    pub fn install_generation(&self, queues: Vec<FrontQueue>) {
        let d = &self.dev;
        assert_eq!(queues.len(), d.queues.len(), "a restart keeps the queue count");
        let generation = queues[0].generation();
        let mut g = lock(&d.gens);
        let old_wakers = std::mem::take(&mut g.wakers);
        g.wakers = queues.iter().map(|q| q.irq_waker().ok().and_then(|fd| EventFd::from_owned(fd).ok())).collect();
        g.staged = queues.into_iter().map(|q| Some(Staged::Queue(Box::new(q)))).collect();
        g.in_place_left = 0;
        // With nothing in flight, no caller waits on the outage: it ends with the new domain.
        if d.in_flight() == 0 && g.end_outage() {
            d.outage_timed.store(false, Ordering::Release);
        }
        d.failed.store(false, Ordering::Release);
        *lock(&d.fail_reason) = None;
        d.announce(g, generation);
        for w in old_wakers.into_iter().flatten() {
            w.ring();
        }
    }

    /// Starts every queue over in place as `generation`, for a new domain attached to the same
    /// files (a tap domain replaced while the driver domain below it, which maps the same
    /// arenas, stays): each queue's ring header is rewritten and its requests without a
    /// response are placed again over the same windows. A queue nobody holds is started over
    /// here; one a user holds, by that user as it next looks (a waiting user is woken). Returns
    /// once every queue has, or `Err` after `timeout` (a user holding a queue and not using it):
    /// the caller then installs a new generation instead, which supersedes this one. Call
    /// only once the old domain is gone and before the new one attaches.
    pub fn start_over_in_place(&self, generation: u32, timeout: Duration) -> Result<(), String> {
        let d = &self.dev;
        let mut g = lock(&d.gens);
        g.staged = (0..d.queues.len()).map(|_| Some(Staged::InPlace(generation))).collect();
        g.in_place_left = d.queues.len();
        d.announce(g, generation);
        for w in lock(&d.gens).wakers.iter().flatten() {
            w.ring();
        }
        for (idx, m) in d.queues.iter().enumerate() {
            let mut st = match m.try_lock() {
                Ok(st) => st,
                Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
                Err(std::sync::TryLockError::WouldBlock) => continue,
            };
            if let Some(staged) = d.take_staged(idx) {
                st.catch_up(d, staged);
            }
        }
        let g = lock(&d.gens);
        let (g, _) = d.changed.wait_timeout_while(g, timeout, |g| g.in_place_left > 0).unwrap_or_else(|e| e.into_inner());
        match g.in_place_left {
            0 => Ok(()),
            n => Err(format!("{n} queue(s) held by a user that did not look within {} ms", timeout.as_millis())),
        }
    }

    /// Outages measured so far, ms: from detection to the first completion after the restart,
    /// or to the new domain's installation when no request was waiting.
    pub fn outages_ms(&self) -> Vec<f64> {
        lock(&self.dev.gens).outages.iter().map(|o| o.1).collect()
    }

    /// The same outages, each with when it was detected.
    pub fn outages(&self) -> Vec<(Instant, f64)> {
        lock(&self.dev.gens).outages.clone()
    }

    /// Marks the device failed: waiting and future requests return `Unavailable` promptly.
    pub fn fail(&self, reason: &str) {
        let d = &self.dev;
        *lock(&d.fail_reason) = Some(reason.to_string());
        d.failed.store(true, Ordering::Release);
        let g = lock(&d.gens);
        for w in g.wakers.iter().flatten() {
            w.ring();
        }
        drop(g);
        d.changed.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bulkhead_channel::{pair, BackQueue, Op, Popped, QueueConfig};

    fn cfg(generation: u32) -> QueueConfig {
        QueueConfig { nslots: 8, arena_bytes: 1 << 20, mode: NotifyMode::Poll, generation, ..Default::default() }
    }

    /// Serves what is pending honestly against `disk`; returns how many.
    fn serve(back: &mut BackQueue, disk: &mut [u8]) -> usize {
        let mut n = 0;
        while let Some(Popped::Valid(r)) = back.pop().unwrap() {
            let mut off = r.offset() as usize;
            for w in back.buffers(&r).iter() {
                match r.op() {
                    Op::Write => w.copy_to(&mut disk[off..off + w.len()]),
                    Op::Read => w.copy_from(&disk[off..off + w.len()]).unwrap(),
                    _ => {}
                }
                off += w.len();
            }
            let len = if matches!(r.op(), Op::Read | Op::Write) { r.len() } else { 0 };
            back.complete(r.id(), r.generation(), Status::Ok, len);
            n += 1;
        }
        back.publish();
        n
    }

    /// Tokens and results, in the order they came.
    type Answers = Vec<(u64, Result<u64, IoError>)>;

    /// Waits on `q` for `n` answers; returns them in the order they came, with the data of the
    /// last read (`len` bytes).
    fn wait_for(q: &mut QueueHandle<'_>, n: usize, len: usize) -> (Answers, Vec<u8>) {
        let mut got = vec![];
        let mut read = vec![0u8; len];
        while got.len() < n {
            q.wait(|t, r, d| {
                if let Some(d) = d {
                    d.copy_to(&mut read);
                }
                got.push((t, r));
            });
        }
        (got, read)
    }

    #[test]
    fn one_handle_keeps_a_queue_full_and_gets_every_token_back() {
        let (front, mut back) = pair(&cfg(1), 1 << 20).unwrap();
        let (dev, _control) = Device::new("t", 1 << 20, vec![front], None);
        let mut disk = vec![0u8; 1 << 20];
        let mut q = dev.queue(0);
        assert_eq!(q.capacity(), 8);
        for i in 0..8u64 {
            q.submit(FrontRequest::Write { offset: i * 4096, from: &[i as u8 + 1; 4096], fua: false }, i).unwrap();
        }
        assert_eq!(q.submit(FrontRequest::Flush, 99), Err(IoError::QueueFull));
        assert_eq!((q.in_flight(), dev.in_flight()), (8, 8));
        assert_eq!(serve(&mut back, &mut disk), 8);
        let mut tokens = vec![];
        while tokens.len() < 8 {
            q.wait(|t, r, _| {
                assert_eq!(r, Ok(4096));
                tokens.push(t);
            });
        }
        tokens.sort_unstable();
        assert_eq!(tokens, (0..8).collect::<Vec<_>>());
        assert_eq!(disk[7 * 4096], 8);
        assert_eq!(dev.in_flight(), 0);
        assert_eq!(q.wait(|_, _, _| panic!("nothing in flight")), 0);
    }

    #[test]
    fn arming_says_what_a_sleep_can_end_with() {
        for (mode, unanswered) in [(NotifyMode::Poll, Armed::Spin), (NotifyMode::Irq, Armed::Fd(-1))] {
            let c = QueueConfig { mode, ..cfg(1) };
            let (front, mut back) = pair(&c, 1 << 20).unwrap();
            let (dev, _control) = Device::new("t", 1 << 20, vec![front], None);
            let mut q = dev.queue(0);
            assert_eq!(q.arm(), Armed::Idle, "{mode:?}: nothing in flight");
            q.submit(FrontRequest::Read { offset: 0, into: 4096 }, 1).unwrap();
            match (q.arm(), unanswered) {
                // A `poll` driver never rings: the caller must look again, yielding.
                (Armed::Spin, Armed::Spin) => {}
                (Armed::Fd(_), Armed::Fd(_)) => q.disarm(),
                (got, _) => panic!("{mode:?}, unanswered: {got:?}"),
            }
            let mut disk = vec![0u8; 1 << 20];
            assert_eq!(serve(&mut back, &mut disk), 1);
            assert_eq!(q.arm(), Armed::Now, "{mode:?}: the answer is there");
            assert_eq!(wait_for(&mut q, 1, 4096).0, [(1, Ok(4096))]);
        }
    }

    #[test]
    fn requests_in_flight_move_to_the_next_generation_with_their_data() {
        let (front, _dead) = pair(&cfg(1), 1 << 20).unwrap();
        let (dev, control) = Device::new("t", 1 << 20, vec![front], None);
        let mut q = dev.queue(0);
        let data: Vec<u8> = (0..8192u32).map(|i| (i * 5) as u8).collect();
        q.submit(FrontRequest::Write { offset: 4096, from: &data, fua: true }, 1).unwrap();
        q.submit(FrontRequest::Flush, 2).unwrap();
        q.submit(FrontRequest::Read { offset: 4096, into: 8192 }, 3).unwrap();
        // The domain dies unanswering; the supervisor installs generation 2 from another thread.
        let (front2, mut back2) = pair(&cfg(2), 1 << 20).unwrap();
        let server = std::thread::spawn(move || {
            control.outage_started(Instant::now());
            std::thread::sleep(Duration::from_millis(20));
            control.install_generation(vec![front2]);
            let mut disk = vec![0u8; 1 << 20];
            let mut served = 0;
            while served < 3 {
                served += serve(&mut back2, &mut disk);
            }
            (disk, control)
        });
        let (got, read) = wait_for(&mut q, 3, 8192);
        let (disk, control) = server.join().unwrap();
        assert_eq!(got, [(1, Ok(8192)), (2, Ok(0)), (3, Ok(8192))], "in submission order, same tokens");
        assert_eq!(&disk[4096..4096 + 8192], &data[..]);
        assert_eq!(read, data);
        assert_eq!(dev.generation(), 2);
        assert_eq!(control.outages_ms().len(), 1);
    }

    /// A queue and two driver ends over the same files (the old domain's and its successor's).
    fn queue_on_files(generation: u32) -> (FrontQueue, bulkhead_channel::BackQueueFds) {
        bulkhead_channel::QueueSetup::create("t", &cfg(generation)).unwrap()
    }

    fn back_end(fds: &bulkhead_channel::BackQueueFds) -> BackQueue {
        let arenas = bulkhead_channel::ArenaSizes { write: 1 << 20, read: 1 << 20 };
        BackQueue::from_fds(fds.try_clone().unwrap(), 8, arenas, 1 << 20).unwrap()
    }

    #[test]
    fn queues_start_over_in_place_whether_a_user_holds_them_or_not() {
        let (f0, fds0) = queue_on_files(1);
        let (f1, fds1) = queue_on_files(1);
        let (dev, control) = Device::new("t", 1 << 20, vec![f0, f1], None);
        let data: Vec<u8> = (0..8192u32).map(|i| (i * 3) as u8).collect();
        // Queue 1: a request the old domain takes and never answers; nobody holds the queue.
        let mut old1 = back_end(&fds1);
        let dev1 = dev.clone();
        let idle = std::thread::spawn(move || dev1.write(1, 0, &[9u8; 4096], false));
        while old1.pop().unwrap().is_none() {
            std::thread::yield_now();
        }
        // Queue 0: a user holds it, waiting on three requests the old domain never answers.
        let (tx, rx) = std::sync::mpsc::channel();
        let dev0 = dev.clone();
        let held = std::thread::spawn(move || {
            let mut q = dev0.queue(0);
            q.submit(
                FrontRequest::Write { offset: 4096, from: &(0..8192u32).map(|i| (i * 3) as u8).collect::<Vec<_>>(), fua: false },
                1,
            )
            .unwrap();
            q.submit(FrontRequest::Flush, 2).unwrap();
            q.submit(FrontRequest::Read { offset: 4096, into: 8192 }, 3).unwrap();
            tx.send(()).unwrap();
            wait_for(&mut q, 3, 8192)
        });
        rx.recv().unwrap();
        // The domain dies: both queues start over in place, the held one by its user.
        drop(old1);
        control.outage_started(Instant::now());
        control.start_over_in_place(2, Duration::from_secs(5)).unwrap();
        assert_eq!(dev.generation(), 2);
        let (mut new0, mut new1) = (back_end(&fds0), back_end(&fds1));
        let mut disk = vec![0u8; 1 << 20];
        let mut served = 0;
        while served < 4 {
            served += serve(&mut new0, &mut disk) + serve(&mut new1, &mut disk);
        }
        let (got, read) = held.join().unwrap();
        assert_eq!(got, [(1, Ok(8192)), (2, Ok(0)), (3, Ok(8192))], "in submission order, same tokens");
        assert_eq!(read, data);
        assert_eq!(idle.join().unwrap(), Ok(()));
        assert_eq!(&disk[..4096], &[9u8; 4096][..]);
        assert_eq!(dev.in_flight(), 0);
    }

    #[test]
    fn a_failed_device_answers_every_request_in_flight_unavailable() {
        let (front, _dead) = pair(&cfg(1), 1 << 20).unwrap();
        let (dev, control) = Device::new("t", 1 << 20, vec![front], None);
        let mut q = dev.queue(0);
        q.submit(FrontRequest::Read { offset: 0, into: 4096 }, 5).unwrap();
        q.submit(FrontRequest::Flush, 6).unwrap();
        control.fail("restart limit");
        let mut got = vec![];
        while got.len() < 2 {
            q.wait(|t, r, _| got.push((t, r)));
        }
        got.sort_by_key(|g| g.0);
        let e = IoError::Unavailable("restart limit".into());
        assert_eq!(got, [(5, Err(e.clone())), (6, Err(e.clone()))]);
        assert_eq!(q.submit(FrontRequest::Flush, 7), Err(e));
        assert_eq!(dev.in_flight(), 0);
    }

    #[test]
    fn the_application_face_checks_ranges_and_the_timeout_gives_up() {
        let (front, _dead) = pair(&cfg(1), 1 << 20).unwrap();
        let (dev, _control) = Device::new("t", 1 << 20, vec![front], Some(50));
        assert!(matches!(dev.read_into(0, (1 << 20) - 100, &mut [0u8; 4096]), Err(IoError::Invalid(_))));
        let e = dev.flush(0).unwrap_err();
        assert!(e.to_string().contains("no response within 50 ms"), "{e}");
    }
}
