//! A Ceph RBD image as backend, through librbd (`bulkhead_rbd`).
//!
//! librbd is loaded before the domain is confined; the cluster is reached once it is
//! ([`Remote::start`]), every `connect` brokered by the supervisor. Requests go to librbd's
//! aio calls; completions are announced on the backend's eventfd (its [`Upkeep::wake_fd`]) and
//! collected on the domain's own thread, never in librbd's callbacks.
//!
//! - The client cache is off unless asked for: a write is then acknowledged once the OSDs
//!   hold it, so FUA needs nothing more, and librbd sends it from the request's window
//!   without copying it first. With the cache on, a FUA write is followed by a flush before
//!   it is answered.
//! - Discards smaller than librbd's discard granularity would be dropped silently; the
//!   domain sets the granularity to the device's block.
//! - A new domain breaks the exclusive lock of this device's earlier domains (the supervisor
//!   names them), never another client's: without that, its first write waits ~30 s for the
//!   dead owner to time out.

use crate::BackendError;
use std::io::Write;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bulkhead_block::SetupError;
use bulkhead_block::{AsyncIo, Backend, BlockError, Caps, Io, Op, Remote, Request, Tag, TagSpace, Upkeep};
use bulkhead_rbd::{Aio, Api, Cluster, Completed, Image};
use bulkhead_sys::eventfd::EventFd;

/// What the domain needs to reach the image.
#[derive(Debug, Clone)]
pub struct RbdOptions {
    /// Monitor addresses.
    pub mon_host: String,
    /// Client name, without `client.`.
    pub user: String,
    /// The client's secret key.
    pub key: String,
    /// Pool.
    pub pool: String,
    /// Namespace ("" for none).
    pub namespace: String,
    /// Image.
    pub image: String,
    /// librbd's client cache.
    pub cache: bool,
    /// Refuse writes.
    pub read_only: bool,
    /// A request not answered for this long fails.
    pub op_timeout: Duration,
    /// Connecting may take this long.
    pub connect_timeout: Duration,
    /// librbd's discard granularity (bytes).
    pub discard_granularity: u64,
    /// Client addresses of the device's earlier domains, whose locks are broken at once.
    pub break_owners: Vec<String>,
}

/// Per-request state, kept until its completion: librbd reads a vectored read's iovec array
/// when the data arrives.
#[derive(Clone, Copy)]
struct Slot {
    op: Op,
    offset: u64,
    want: u64,
    /// A FUA write under the client cache: a flush follows before it is answered.
    flush_after: bool,
    iov: [libc::iovec; bulkhead_shmem::MAX_SLICES],
    niov: usize,
}

impl Default for Slot {
    fn default() -> Self {
        Slot {
            op: Op::Read,
            offset: 0,
            want: 0,
            flush_after: false,
            iov: [libc::iovec { iov_base: std::ptr::null_mut(), iov_len: 0 }; bulkhead_shmem::MAX_SLICES],
            niov: 0,
        }
    }
}

/// Tags of [`Backend::execute`]'s batch are numbered from here, apart from the chain's.
const EXECUTE_BASE: u64 = 1 << 40;

/// How long an earlier domain's client stays evicted: it is dead, so any time will do; an
/// hour is what a lock break gives it.
const EVICT_SECONDS: u32 = 3600;

/// An RBD image.
pub struct RbdBackend {
    opts: RbdOptions,
    size: u64,
    api: Arc<Api>,
    // Dropped in this order: the image closes before its cluster shuts down.
    image: Option<Image>,
    cluster: Option<Cluster>,
    wake: EventFd,
    owner_pipe: Option<OwnedFd>,
    slots: Vec<Slot>,
    in_flight: usize,
    ready: Vec<(Tag, Result<u64, BlockError>)>,
    done: Vec<Completed>,
    lost: Option<String>,
    /// The last request failed for want of an answer (`op_timeout`), and none has been
    /// answered since.
    stalled: bool,
}

// SAFETY: the slots' iovecs point into the request windows the frontend lent this domain; they
// are used from the domain's one thread only.
unsafe impl Send for RbdBackend {}

impl std::fmt::Debug for RbdBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RbdBackend")
            .field("pool", &self.opts.pool)
            .field("image", &self.opts.image)
            .field("size", &self.size)
            .finish()
    }
}

impl RbdBackend {
    /// A backend for a device of `size` bytes; `owner_pipe` is told the client's address and
    /// the image's size once the image is open. Loads librbd (call it before confinement).
    pub fn new(opts: RbdOptions, size: u64, owner_pipe: Option<OwnedFd>) -> Result<Self, BackendError> {
        let api = Arc::new(Api::load().map_err(|e| BackendError::link(e.to_string()))?);
        let wake = EventFd::new().map_err(|e| BackendError::link(format!("eventfd: {e}")))?;
        Ok(RbdBackend {
            opts,
            size,
            api,
            image: None,
            cluster: None,
            wake,
            owner_pipe,
            slots: Vec::new(),
            in_flight: 0,
            ready: Vec::new(),
            done: Vec::new(),
            lost: None,
            stalled: false,
        })
    }

    fn connect(&mut self) -> Result<(), BackendError> {
        let o = &self.opts;
        let mut c = Cluster::create(self.api.clone(), &o.user).map_err(|e| BackendError::link(e.to_string()))?;
        let secs = |d: Duration| d.as_millis().div_ceil(1000).max(1).to_string();
        let settings = [
            ("mon_host", o.mon_host.clone()),
            ("key", o.key.clone()),
            // No files: no keyring search that matters, no admin socket, no log file.
            ("keyring", String::new()),
            ("admin_socket", String::new()),
            ("log_file", String::new()),
            ("log_to_stderr", "false".into()),
            ("err_to_stderr", "true".into()),
            ("rbd_cache", o.cache.to_string()),
            // Without the cache, librbd sends a write's data from the request's own window
            // rather than a copy of it, and answers only once nothing of its holds the window
            // any more: the window is the frontend's until then anyway.
            ("rbd_disable_zero_copy_writes", o.cache.to_string()),
            ("rbd_discard_granularity_bytes", o.discard_granularity.to_string()),
            ("rados_osd_op_timeout", secs(o.op_timeout)),
            ("rados_mon_op_timeout", secs(o.op_timeout)),
            ("client_mount_timeout", secs(o.connect_timeout)),
        ];
        for (k, v) in &settings {
            c.set(k, v).map_err(|e| BackendError::link(e.to_string()))?;
        }
        c.connect(&o.pool, &o.namespace).map_err(|e| BackendError::link(format!("cluster at {}: {e}", o.mon_host)))?;
        let image = c.open(&o.image, o.read_only).map_err(|e| BackendError::link(e.to_string()))?;
        let stat = image.stat().map_err(|e| BackendError::link(e.to_string()))?;
        if let Some(pipe) = self.owner_pipe.take() {
            // The supervisor keeps the address for the next generation's lock break (no write
            // has been made, so no lock taken, before it is told), and learns the image's size
            // from the second word when the configuration gives none.
            if let Ok(addr) = c.addrs() {
                let _ = std::fs::File::from(pipe).write_all(format!("{addr} {}\n", stat.size).as_bytes());
            }
        }
        if stat.size < self.size {
            return Err(BackendError::link(format!(
                "image `{}/{}` is {} bytes, smaller than the device's {}",
                o.pool, o.image, stat.size, self.size
            )));
        }
        // A lock held by one of this device's earlier domains: break it now rather than wait
        // for it to time out. Any other owner is a live client and is left alone.
        let ours: Vec<&str> = o.break_owners.iter().filter_map(|a| nonce(a)).collect();
        // A read-only domain (an inactive device's) breaks it too, on its way out of writing.
        for owner in image.lock_owners().map_err(|e| BackendError::link(e.to_string()))? {
            if nonce(&owner).is_some_and(|n| ours.contains(&n)) {
                match image.break_lock(&owner) {
                    Ok(()) => eprintln!("bulkhead driver: rbd: broke the exclusive lock of an earlier domain ({owner})"),
                    Err(e) if o.read_only => {
                        eprintln!("bulkhead driver: rbd: could not break the lock of an earlier domain ({owner}): {e}")
                    }
                    Err(e) => return Err(BackendError::link(e.to_string())),
                }
            }
        }
        // An earlier domain killed before it took the lock left its watch on the image, which
        // the cluster keeps for 30 s: until then, taking or releasing the lock notifies it and
        // waits for an answer that never comes, so this domain's final flush and close would
        // take more than 5 s. Evicted too; failing that, the watch times out on its own.
        match image.watchers() {
            Ok(watchers) => {
                for w in watchers.iter().filter(|w| nonce(w).is_some_and(|n| ours.contains(&n))) {
                    match c.blocklist(w, EVICT_SECONDS) {
                        Ok(()) => eprintln!("bulkhead driver: rbd: evicted the watch of an earlier domain ({w})"),
                        Err(e) => eprintln!("bulkhead driver: rbd: could not evict an earlier domain's watch ({w}): {e}"),
                    }
                }
            }
            Err(e) => eprintln!("bulkhead driver: rbd: could not list the image's watchers: {e}"),
        }
        image.notify_on(self.wake.as_raw_fd()).map_err(|e| BackendError::link(e.to_string()))?;
        self.image = Some(image);
        self.cluster = Some(c);
        Ok(())
    }

    /// Starts the request in `slot` under `arg`.
    fn start_slot(image: &Image, slot: &Slot, arg: u64) -> Result<(), BlockError> {
        let iov = &slot.iov[..slot.niov];
        let op = match slot.op {
            Op::Read => Aio::Read { offset: slot.offset, into: iov },
            Op::Write => Aio::Write { offset: slot.offset, from: iov, fua: false },
            Op::Flush => Aio::Flush,
            Op::Discard => Aio::Discard { offset: slot.offset, len: slot.want },
            Op::WriteZeroes => Aio::WriteZeroes { offset: slot.offset, len: slot.want },
        };
        // SAFETY: the iovecs live in the slot, which stays in place until the completion is
        // collected, and name request windows the frontend keeps until it is answered.
        unsafe { image.start(&op, arg) }.map_err(|e| BlockError::Os {
            op: "rbd",
            offset: slot.offset,
            errno: e.errno().unwrap_or(libc::EIO),
        })
    }

    /// The slot for `req`, or its immediate answer.
    fn plan(&self, req: &Request<'_>) -> Result<Slot, Result<u64, BlockError>> {
        let in_range = |offset: u64, len: u64| offset.checked_add(len).is_some_and(|e| e <= self.size);
        let mut s = Slot::default();
        match *req {
            Request::Write { .. } | Request::Discard { .. } | Request::WriteZeroes { .. } if self.opts.read_only => {
                return Err(Err(BlockError::ReadOnly))
            }
            Request::Read { offset, into: bufs } | Request::Write { offset, from: bufs, .. } => {
                let len = bufs.total_len();
                if !in_range(offset, len) {
                    return Err(Err(BlockError::Invalid("range beyond device")));
                }
                for (i, b) in bufs.iter().enumerate() {
                    s.iov[i] = b.iovec();
                }
                s.niov = bufs.len();
                s.op = req.op();
                s.flush_after = self.opts.cache && matches!(req, Request::Write { fua: true, .. });
                (s.offset, s.want) = (offset, len);
            }
            Request::Flush => s.op = Op::Flush,
            Request::Discard { offset, len } | Request::WriteZeroes { offset, len } => {
                if !in_range(offset, len) {
                    return Err(Err(BlockError::Invalid("range beyond device")));
                }
                s.op = req.op();
                (s.offset, s.want) = (offset, len);
            }
        }
        if s.want == 0 && s.op != Op::Flush {
            return Err(Ok(0));
        }
        Ok(s)
    }

    /// The result of a completed request in `slot`.
    fn result(slot: &Slot, r: isize) -> Result<u64, BlockError> {
        if r < 0 {
            let op = match slot.op {
                Op::Read => "rbd read",
                Op::Write => "rbd write",
                Op::Flush => "rbd flush",
                Op::Discard => "rbd discard",
                Op::WriteZeroes => "rbd write-zeroes",
            };
            return Err(BlockError::Os { op, offset: slot.offset, errno: -r as i32 });
        }
        Ok(match slot.op {
            Op::Read | Op::Write | Op::Discard | Op::WriteZeroes => slot.want,
            Op::Flush => 0,
        })
    }

    /// Moves librbd's completions of chain requests to `ready`, starting the flush a FUA write
    /// under the cache still needs.
    fn collect(&mut self) {
        let Some(image) = &self.image else { return };
        self.done.clear();
        image.poll_completions(&mut self.done, usize::MAX);
        for c in std::mem::take(&mut self.done) {
            let Some(slot) = self.slots.get_mut(c.arg as usize) else { continue };
            heard(&mut self.stalled, slot.op, c.result);
            let tag = Tag::new(c.arg as u32);
            if c.result >= 0 && slot.flush_after {
                slot.flush_after = false;
                if Self::start_slot(image, &Slot { op: Op::Flush, ..Slot::default() }, c.arg).is_ok() {
                    continue;
                }
                self.in_flight -= 1;
                self.ready.push((tag, Err(BlockError::Os { op: "rbd flush", offset: slot.offset, errno: libc::EIO })));
                continue;
            }
            self.in_flight -= 1;
            // A write whose flush followed answers its own length, as any write.
            let r = Self::result(slot, c.result);
            self.ready.push((tag, r));
        }
    }
}

/// Notes in `stalled` what librbd's result `r` of an `op` says of the cluster: a timeout that
/// it has stopped answering, and an answer that it answers. A flush without the cache
/// completes without asking the cluster, so its success says nothing.
fn heard(stalled: &mut bool, op: Op, r: isize) {
    if r == -(libc::ETIMEDOUT as isize) {
        *stalled = true;
    } else if op != Op::Flush {
        *stalled = false;
    }
}

/// The nonce of a client address (`127.0.0.1:0/3141592` or `[v2:…/3141592]`): what names one
/// client instance.
fn nonce(addr: &str) -> Option<&str> {
    let n = addr.rsplit('/').next()?.trim_end_matches([']', ',']);
    (!n.is_empty() && n.bytes().all(|b| b.is_ascii_digit())).then_some(n)
}

impl Backend for RbdBackend {
    fn size(&self) -> u64 {
        self.size
    }
    fn caps(&self) -> Caps {
        Caps { flush: self.opts.cache, fua: true, discard: true, write_zeroes: true, read_only: self.opts.read_only }
    }
    fn execute(&mut self, ios: &mut [Io<'_>]) {
        let Some(image) = &self.image else {
            for io in ios.iter_mut() {
                io.result = Err(BlockError::Os { op: "rbd", offset: 0, errno: libc::ENOTCONN });
            }
            return;
        };
        let mut slots = Vec::with_capacity(ios.len());
        for io in ios.iter_mut() {
            match self.plan(&io.req) {
                Ok(s) => slots.push(Some(s)),
                Err(r) => {
                    io.result = r;
                    slots.push(None);
                }
            }
        }
        // A flush covers the writes before it in the batch: each runs once they are done.
        let mut waiting = 0;
        let deadline = Instant::now() + self.opts.op_timeout + Duration::from_secs(5);
        let mut i = 0;
        while i < ios.len() || waiting > 0 {
            let barrier = slots.get(i).and_then(|s| s.as_ref()).is_some_and(|s| s.op == Op::Flush) && waiting > 0;
            if i < ios.len() && !barrier {
                if let Some(s) = &slots[i] {
                    match Self::start_slot(image, s, EXECUTE_BASE + i as u64) {
                        Ok(()) => waiting += 1,
                        Err(e) => ios[i].result = Err(e),
                    }
                }
                i += 1;
                continue;
            }
            let _ = self.wake.wait(100);
            self.wake.drain();
            let mut got = Vec::new();
            image.poll_completions(&mut got, usize::MAX);
            for c in got {
                if c.arg >= EXECUTE_BASE {
                    let k = (c.arg - EXECUTE_BASE) as usize;
                    if let Some(Some(s)) = slots.get(k) {
                        heard(&mut self.stalled, s.op, c.result);
                        ios[k].result = Self::result(s, c.result);
                        waiting -= 1;
                    }
                } else {
                    self.done.push(c);
                }
            }
            if Instant::now() > deadline {
                self.lost.get_or_insert_with(|| "librbd did not complete a request within its timeout".into());
                return;
            }
        }
    }
    fn async_io(&mut self) -> Option<&mut dyn AsyncIo> {
        Some(self)
    }
    fn remote(&mut self) -> Option<&mut dyn Remote> {
        Some(self)
    }
    fn upkeep(&mut self) -> Option<&mut dyn Upkeep> {
        Some(self)
    }
}

impl AsyncIo for RbdBackend {
    fn attach(&mut self, tags: TagSpace) {
        self.slots = vec![Slot::default(); tags.capacity()];
    }
    fn submit(&mut self, tag: Tag, req: &Request<'_>) -> Option<Result<u64, BlockError>> {
        let slot = match self.plan(req) {
            Ok(s) => s,
            Err(r) => return Some(r),
        };
        let Some(image) = &self.image else { return Some(Err(BlockError::Os { op: "rbd", offset: 0, errno: libc::ENOTCONN })) };
        let Some(entry) = self.slots.get_mut(tag.index()) else {
            return Some(Err(BlockError::Invalid("tag beyond the rbd backend's table")));
        };
        *entry = slot;
        match Self::start_slot(image, entry, tag.index() as u64) {
            Ok(()) => {
                self.in_flight += 1;
                None
            }
            Err(e) => Some(Err(e)),
        }
    }
    fn commit(&mut self) {}
    fn reap(&mut self, done: &mut dyn FnMut(Tag, Result<u64, BlockError>)) {
        self.collect();
        for (tag, r) in self.ready.drain(..) {
            done(tag, r);
        }
    }
    fn in_flight(&self) -> usize {
        self.in_flight + self.ready.len()
    }
}

impl Remote for RbdBackend {
    fn start(&mut self) -> Result<(), SetupError> {
        self.connect().map_err(SetupError::of)
    }
    fn lost(&self) -> Option<&str> {
        self.lost.as_deref()
    }
    fn stalled(&self) -> bool {
        self.stalled
    }
    fn may_stall(&self) -> bool {
        true
    }
}

impl Upkeep for RbdBackend {
    fn wake_fd(&self) -> std::os::fd::RawFd {
        self.wake.as_raw_fd()
    }
    fn tend(&mut self) {
        // Cleared before the next look at librbd's completions: one that comes after rings
        // again.
        self.wake.drain();
    }
}

#[cfg(test)]
mod tests {
    use super::{heard, nonce};
    use bulkhead_block::Op;

    #[test]
    fn a_timeout_marks_the_cluster_stalled_until_it_answers_a_request_that_reaches_it() {
        let mut stalled = false;
        heard(&mut stalled, Op::Write, -(libc::ETIMEDOUT as isize));
        assert!(stalled);
        // A flush without the cache asks the cluster nothing.
        heard(&mut stalled, Op::Flush, 0);
        assert!(stalled);
        // Another error is an answer, if not a good one.
        heard(&mut stalled, Op::Read, -(libc::EIO as isize));
        assert!(!stalled);
        heard(&mut stalled, Op::Flush, -(libc::ETIMEDOUT as isize));
        assert!(stalled);
        heard(&mut stalled, Op::Read, 4096);
        assert!(!stalled);
    }

    #[test]
    fn a_client_is_named_by_the_nonce_of_its_address() {
        assert_eq!(nonce("127.0.0.1:0/1831736635"), Some("1831736635"));
        assert_eq!(nonce("[v2:10.0.0.1:0/42,v1:10.0.0.1:0/42]"), Some("42"));
        assert_eq!(nonce("v2:10.0.0.1:0/42"), Some("42"));
        assert_eq!(nonce("10.0.0.1:0"), None);
        assert_eq!(nonce(""), None);
    }
}
