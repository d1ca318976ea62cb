//! A block device served by a driver domain, as the application side sees it.
//!
//! [`Device`] owns the frontend end of every queue of one device channel. It is shared by the
//! exports (FUSE, NBD) and by Rust callers: each caller passes a *slot* (its worker index) that
//! picks its queue, so with as many queues as workers no two threads contend. A request that
//! does not fit one queue's arena is split.
//!
//! ```no_run
//! # fn demo(dev: &bulkhead_client::Device) -> Result<(), bulkhead_client::IoError> {
//! let mut buf = vec![0u8; 4096];
//! dev.write(0, 0, &buf, false)?;
//! dev.flush(0)?;
//! dev.read_into(0, 0, &mut buf)?;
//! # Ok(()) }
//! ```
#![forbid(unsafe_code)]
#![deny(missing_docs)]

use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

pub use bulkhead_channel::Status;
use bulkhead_channel::{ChannelError, FrontQueue, FrontRequest, NotifyMode, SharedSlice, SubmitError};
use bulkhead_doorbell::EventFd;

enum Answer {
    Done(Result<u64, Status>),
    Failed(IoError),
    Reissue,
}

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
}

impl IoError {
    /// errno for this error.
    pub fn errno(&self) -> i32 {
        match self {
            IoError::Device(s) => s.errno(),
            IoError::Invalid(_) => libc::EINVAL,
            IoError::Unavailable(_) => libc::EIO,
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

/// How long one wait slice lasts before the device re-checks its generation and state.
const WAIT_SLICE_MS: i32 = 50;

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
    /// Replacement queues of the newest generation, taken by the next user of each queue.
    staged: Vec<Option<FrontQueue>>,
    /// Duplicates of each current queue's irq doorbell, to wake sleepers on a restart.
    wakers: Vec<Option<EventFd>>,
    /// When the outage being repaired was detected.
    outage_since: Option<Instant>,
    /// Outages measured (detection to first completion after restart), ms.
    outages_ms: Vec<f64>,
}

/// A device served by a driver domain.
#[derive(Debug)]
pub struct Device {
    name: String,
    size: u64,
    mode: NotifyMode,
    queues: Vec<Mutex<FrontQueue>>,
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
    timeout_ms: Option<u64>,
    /// Counters.
    pub counters: DeviceCounters,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Device {
    /// A device over `queues` (at least one, all of one generation). With `timeout_ms`, a
    /// request with no answer for that long fails with `Unavailable`; without, it waits for the
    /// supervisor to restart or fail the domain.
    pub fn new(name: &str, size: u64, queues: Vec<FrontQueue>, timeout_ms: Option<u64>) -> Self {
        assert!(!queues.is_empty(), "a device has at least one queue");
        let mode = queues[0].mode();
        let generation = queues[0].generation();
        let max_request = queues[0].max_request();
        let wakers = queues.iter().map(|q| q.irq_waker().ok().and_then(|fd| EventFd::from_owned(fd).ok())).collect();
        let n = queues.len();
        Device {
            name: name.to_string(),
            size,
            mode,
            queues: queues.into_iter().map(Mutex::new).collect(),
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
            timeout_ms,
            counters: DeviceCounters::default(),
        }
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

    /// The current channel generation.
    pub fn generation(&self) -> u32 {
        self.generation.load(Ordering::Acquire)
    }

    /// Requests submitted and not yet answered.
    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Acquire)
    }

    /// Requests answered so far (any status): the supervisor's progress measure.
    pub fn answered(&self) -> u64 {
        self.counters.completed.load(Ordering::Relaxed) + self.counters.failed.load(Ordering::Relaxed)
    }

    /// A doorbell rung when a queue reports its channel broken (for the supervisor to poll).
    pub fn alarm_fd(&self) -> RawFd {
        self.alarm.as_raw_fd()
    }

    /// Whether a queue reported a broken channel since the last restart; clears the report.
    pub fn take_broken_report(&self) -> bool {
        self.alarm.drain();
        self.broken_reported.swap(false, Ordering::AcqRel)
    }

    /// Logs `line` (prefixed with the device) within a budget of a few lines in a burst and
    /// one a second after that; the next line logged says how many were held back. For
    /// everything a misbehaving driver can cause at a high rate.
    pub fn log_limited(&self, line: impl FnOnce() -> String) {
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

    fn report_broken(&self, e: &ChannelError) {
        if !self.broken_reported.swap(true, Ordering::AcqRel) {
            self.log_limited(|| format!("channel broken: {e}"));
        }
        self.alarm.ring();
    }

    /// Marks the start of an outage (the supervisor detected a dead, wedged or broken domain).
    pub fn outage_started(&self, at: Instant) {
        let mut g = lock(&self.gens);
        g.outage_since.get_or_insert(at);
        self.outage_timed.store(true, Ordering::Release);
        self.outage.store(true, Ordering::Release);
        for w in g.wakers.iter().flatten() {
            w.ring();
        }
    }

    /// Installs the queues of a new generation (a restarted domain). Each is taken by the next
    /// thread to use its queue; threads waiting on an old queue are woken and reissue their
    /// request on the new one. The requests they reissue are exactly those without a response.
    pub fn install_generation(&self, queues: Vec<FrontQueue>) {
        assert_eq!(queues.len(), self.queues.len(), "a restart keeps the queue count");
        let generation = queues[0].generation();
        let mut g = lock(&self.gens);
        let old_wakers = std::mem::take(&mut g.wakers);
        g.wakers = queues.iter().map(|q| q.irq_waker().ok().and_then(|fd| EventFd::from_owned(fd).ok())).collect();
        g.staged = queues.into_iter().map(Some).collect();
        self.broken_reported.store(false, Ordering::Release);
        // With nothing in flight, no caller waits on the outage: it ends with the new domain.
        if self.in_flight() == 0 {
            if let Some(t) = g.outage_since.take() {
                g.outages_ms.push(t.elapsed().as_secs_f64() * 1e3);
                self.outage_timed.store(false, Ordering::Release);
            }
        }
        self.generation.store(generation, Ordering::Release);
        self.outage.store(false, Ordering::Release);
        self.failed.store(false, Ordering::Release);
        *lock(&self.fail_reason) = None;
        drop(g);
        self.changed.notify_all();
        for w in old_wakers.into_iter().flatten() {
            w.ring();
        }
    }

    /// Records an outage the frontend did not see as one: a domain below a tap domain was
    /// replaced while the tap domain held the requests (`took`: detection to the new domain).
    pub fn note_outage(&self, took: Duration) {
        lock(&self.gens).outages_ms.push(took.as_secs_f64() * 1e3);
    }

    /// Outages measured so far, ms: from detection to the first completion after the restart,
    /// or to the new domain's installation when no request was waiting.
    pub fn outages_ms(&self) -> Vec<f64> {
        lock(&self.gens).outages_ms.clone()
    }

    /// Marks the device failed: waiting and future requests return `Unavailable` promptly.
    pub fn fail(&self, reason: &str) {
        *lock(&self.fail_reason) = Some(reason.to_string());
        self.failed.store(true, Ordering::Release);
        let g = lock(&self.gens);
        for w in g.wakers.iter().flatten() {
            w.ring();
        }
        drop(g);
        self.changed.notify_all();
    }

    /// Why the device failed, if it did.
    pub fn failure(&self) -> Option<String> {
        if !self.failed.load(Ordering::Acquire) {
            return None;
        }
        lock(&self.fail_reason).clone()
    }

    fn check_range(&self, offset: u64, len: u64) -> Result<(), IoError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.size => Ok(()),
            _ => Err(IoError::Invalid("range beyond the end of the device")),
        }
    }

    fn unavailable(&self) -> IoError {
        IoError::Unavailable(self.failure().unwrap_or_else(|| "device failed".into()))
    }

    /// Brings queue `idx` (locked by the caller) to the current generation.
    fn refresh(&self, idx: usize, q: &mut FrontQueue) {
        if q.generation() == self.generation() {
            return;
        }
        if let Some(newer) = lock(&self.gens).staged[idx].take() {
            *q = newer;
        }
    }

    /// Blocks until the generation moves past `gen`, the device fails, or `slice` passes.
    fn wait_for_generation(&self, gen: u32, slice: Duration) {
        let g = lock(&self.gens);
        let _ = self.changed.wait_timeout_while(g, slice, |_| self.generation() == gen && !self.failed.load(Ordering::Acquire));
    }

    fn note_completion(&self) {
        // Hot path: only an open outage takes the lock.
        if !self.outage_timed.load(Ordering::Acquire) {
            return;
        }
        let mut g = lock(&self.gens);
        if let Some(t) = g.outage_since.take() {
            g.outages_ms.push(t.elapsed().as_secs_f64() * 1e3);
        }
        self.outage_timed.store(false, Ordering::Release);
    }

    /// Runs one request on the queue of `slot` until it is answered. If the domain dies, wedges
    /// or breaks the channel meanwhile, the request is reissued on the next generation once the
    /// supervisor has restarted the domain.
    fn run(&self, slot: usize, req: FrontRequest<'_>, mut on_data: impl FnMut(SharedSlice<'_>)) -> Result<u64, IoError> {
        let idx = slot % self.queues.len();
        let started = Instant::now();
        loop {
            if self.failed.load(Ordering::Acquire) {
                return Err(self.unavailable());
            }
            let mut q = lock(&self.queues[idx]);
            self.refresh(idx, &mut q);
            let gen = q.generation();
            if q.broken().is_some() || self.outage.load(Ordering::Acquire) {
                // This generation is finished (or being replaced, which may take a while when
                // a remote server must be reconnected): wait for the next one rather than
                // piling reissues into a queue nobody serves.
                drop(q);
                self.wait_for_generation(gen, Duration::from_millis(WAIT_SLICE_MS as u64));
                self.check_timeout(started)?;
                continue;
            }
            const TOKEN: u64 = 0;
            match q.submit(req, TOKEN) {
                Ok(()) => {}
                Err(SubmitError::Full) => {
                    // Only the holder of the lock uses this queue and it waits for each
                    // request, so a full queue means a driver that stopped answering.
                    let e = ChannelError::Protocol("queue full with no request of ours outstanding".into());
                    self.report_broken(&e);
                    drop(q);
                    self.wait_for_generation(gen, Duration::from_millis(WAIT_SLICE_MS as u64));
                    self.check_timeout(started)?;
                    continue;
                }
                Err(SubmitError::TooLarge(_)) => return Err(IoError::Invalid("request larger than the queue's arena")),
                Err(SubmitError::Broken(e)) => {
                    self.report_broken(&e);
                    continue;
                }
            }
            self.in_flight.fetch_add(1, Ordering::AcqRel);
            let outcome = self.await_answer(&mut q, gen, started, &mut on_data);
            self.in_flight.fetch_sub(1, Ordering::AcqRel);
            match outcome {
                Answer::Done(Ok(n)) => {
                    self.counters.completed.fetch_add(1, Ordering::Relaxed);
                    self.note_completion();
                    return Ok(n);
                }
                Answer::Done(Err(s)) => {
                    self.counters.failed.fetch_add(1, Ordering::Relaxed);
                    self.note_completion();
                    return Err(IoError::Device(s));
                }
                Answer::Failed(e) => return Err(e),
                Answer::Reissue => {
                    drop(q);
                    self.wait_for_generation(gen, Duration::from_millis(WAIT_SLICE_MS as u64));
                    self.check_timeout(started)?;
                }
            }
        }
    }

    fn check_timeout(&self, started: Instant) -> Result<(), IoError> {
        match self.timeout_ms {
            Some(ms) if started.elapsed() >= Duration::from_millis(ms) => {
                Err(IoError::Unavailable(format!("no response within {ms} ms")))
            }
            _ => Ok(()),
        }
    }

    fn await_answer(&self, q: &mut FrontQueue, gen: u32, started: Instant, on_data: &mut impl FnMut(SharedSlice<'_>)) -> Answer {
        loop {
            let mut out = None;
            let r = q.reap(|c| {
                if let Some(d) = c.data {
                    on_data(d);
                }
                out = Some(c.result);
            });
            if let Err(e) = r {
                self.report_broken(&e);
                return Answer::Reissue;
            }
            if let Some(res) = out {
                return Answer::Done(res);
            }
            if self.failed.load(Ordering::Acquire) {
                return Answer::Failed(self.unavailable());
            }
            if self.generation() != gen {
                // The domain was replaced while we waited: reissue on the new generation.
                return Answer::Reissue;
            }
            if let Err(e) = self.check_timeout(started) {
                return Answer::Failed(e);
            }
            if self.outage.load(Ordering::Acquire) {
                // The domain is being replaced: block until the next generation, then reissue.
                return Answer::Reissue;
            }
            let storms = q.stats().storms;
            if let Err(e) = q.wait_or(WAIT_SLICE_MS, &self.outage) {
                self.report_broken(&e);
                return Answer::Reissue;
            }
            if q.stats().storms != storms {
                self.log_limited(|| {
                    format!(
                        "driver rings its doorbell with no response ({} wake-ups in a row): ignoring it for {} ms",
                        bulkhead_channel::STORM_WAKES,
                        bulkhead_channel::STORM_DAMP_MS
                    )
                });
            }
        }
    }

    /// Largest request one queue carries without splitting.
    pub fn max_request(&self) -> u64 {
        self.max_request
    }

    /// Reads `len` bytes at `offset`, handing the data to `f` as `(offset within the request,
    /// window)` pieces, in order. Copy out inside `f`: the window is reused afterwards.
    pub fn read(&self, slot: usize, offset: u64, len: u64, mut f: impl FnMut(u64, SharedSlice<'_>)) -> Result<(), IoError> {
        self.check_range(offset, len)?;
        let chunk = self.max_request;
        let mut done = 0;
        while done < len {
            let n = (len - done).min(chunk);
            self.run(slot, FrontRequest::Read { offset: offset + done, len: n }, |w| f(done, w))?;
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
            self.run(slot, FrontRequest::Write { offset: at, data: piece, fua }, |_| {})?;
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
