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

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;

use bulkhead_channel::{ChannelError, FrontQueue, FrontRequest, NotifyMode, SharedSlice, Status, SubmitError};

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

/// How long one wait slice lasts before the device re-checks whether it was failed.
const WAIT_SLICE_MS: i32 = 100;

/// A device served by a driver domain.
#[derive(Debug)]
pub struct Device {
    name: String,
    size: u64,
    mode: NotifyMode,
    queues: Vec<Mutex<FrontQueue>>,
    failed: AtomicBool,
    fail_reason: Mutex<Option<String>>,
    timeout_ms: u64,
    /// Counters.
    pub counters: DeviceCounters,
}

impl Device {
    /// A device over `queues` (at least one). Requests give up after `timeout_ms` without an
    /// answer.
    pub fn new(name: &str, size: u64, queues: Vec<FrontQueue>, timeout_ms: u64) -> Self {
        assert!(!queues.is_empty(), "a device has at least one queue");
        let mode = queues[0].mode();
        Device {
            name: name.to_string(),
            size,
            mode,
            queues: queues.into_iter().map(Mutex::new).collect(),
            failed: AtomicBool::new(false),
            fail_reason: Mutex::new(None),
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

    /// Marks the device failed: waiting and future requests return `Unavailable` promptly.
    pub fn fail(&self, reason: &str) {
        *self.fail_reason.lock().unwrap_or_else(|e| e.into_inner()) = Some(reason.to_string());
        self.failed.store(true, Ordering::Release);
    }

    /// Why the device failed, if it did.
    pub fn failure(&self) -> Option<String> {
        if !self.failed.load(Ordering::Acquire) {
            return None;
        }
        self.fail_reason.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Requests the driver claims to have completed, summed over queues.
    pub fn driver_progress(&self) -> u64 {
        self.queues.iter().map(|q| q.lock().unwrap_or_else(|e| e.into_inner()).progress()).sum()
    }

    /// Why the channel is broken, if any queue reported a violation.
    pub fn broken(&self) -> Option<ChannelError> {
        self.queues.iter().find_map(|q| q.lock().unwrap_or_else(|e| e.into_inner()).broken().cloned())
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

    /// Runs one request on the queue of `slot`, waiting in slices so a failed device is noticed.
    fn run(&self, slot: usize, req: FrontRequest<'_>, mut on_data: impl FnMut(SharedSlice<'_>)) -> Result<u64, IoError> {
        if self.failed.load(Ordering::Acquire) {
            return Err(self.unavailable());
        }
        let mut q = self.queues[slot % self.queues.len()].lock().unwrap_or_else(|e| e.into_inner());
        const TOKEN: u64 = 0;
        loop {
            match q.submit(req, TOKEN) {
                Ok(()) => break,
                // Only this thread uses this queue while it holds the lock, and it waits for
                // each request, so a full queue means space leaked by a broken peer.
                Err(SubmitError::Full) => return Err(IoError::Unavailable("queue full".into())),
                Err(SubmitError::TooLarge(_)) => return Err(IoError::Invalid("request larger than the queue's arena")),
                Err(SubmitError::Broken(e)) => return Err(self.note_broken(e)),
            }
        }
        let mut waited = 0u64;
        let mut out = None;
        loop {
            let r = q.reap(|c| {
                if let Some(d) = c.data {
                    on_data(d);
                }
                out = Some(c.result);
            });
            if let Err(e) = r {
                return Err(self.note_broken(e));
            }
            if let Some(res) = out.take() {
                return match res {
                    Ok(n) => {
                        self.counters.completed.fetch_add(1, Ordering::Relaxed);
                        Ok(n)
                    }
                    Err(s) => {
                        self.counters.failed.fetch_add(1, Ordering::Relaxed);
                        Err(IoError::Device(s))
                    }
                };
            }
            if self.failed.load(Ordering::Acquire) {
                return Err(self.unavailable());
            }
            match q.wait(WAIT_SLICE_MS) {
                Ok(true) => {}
                Ok(false) => {
                    waited += WAIT_SLICE_MS as u64;
                    if waited >= self.timeout_ms {
                        return Err(IoError::Unavailable(format!("no response within {} ms", self.timeout_ms)));
                    }
                }
                Err(e) => return Err(self.note_broken(e)),
            }
        }
    }

    fn note_broken(&self, e: ChannelError) -> IoError {
        self.counters.failed.fetch_add(1, Ordering::Relaxed);
        IoError::Unavailable(e.to_string())
    }

    fn chunk(&self, slot: usize) -> u64 {
        self.queues[slot % self.queues.len()].lock().unwrap_or_else(|e| e.into_inner()).max_request()
    }

    /// Reads `len` bytes at `offset`, handing the data to `f` as `(offset within the request,
    /// window)` pieces, in order. Copy out inside `f`: the window is reused afterwards.
    pub fn read(&self, slot: usize, offset: u64, len: u64, mut f: impl FnMut(u64, SharedSlice<'_>)) -> Result<(), IoError> {
        self.check_range(offset, len)?;
        let chunk = self.chunk(slot);
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
        let chunk = self.chunk(slot) as usize;
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
