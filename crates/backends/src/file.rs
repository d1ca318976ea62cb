//! A regular file or block device (for instance a loop device) as backend.
//!
//! Two engines: `sync` (`preadv`/`pwritev2`, one request at a time) and `io_uring`
//! (asynchronous: reads, writes and flushes started as they arrive and answered as they
//! complete, so the domain's loop never waits on the disk while other requests are ready). The
//! io_uring engine's ring is lent by the supervisor, which keeps it after a kill until every
//! request the domain started has completed (`bulkhead_sys::uring`). With `direct = true` the
//! supervisor passes a descriptor opened with `O_DIRECT` plus a buffered one: requests aligned
//! to 4 KiB go direct, any other falls back to the buffered descriptor (the kernel keeps the
//! two coherent).

use std::os::fd::{AsRawFd, OwnedFd, RawFd};

use bulkhead_block::SetupError;
use bulkhead_block::{AsyncIo, Backend, BlockError, Caps, Io, Remote, Request, SliceList, Tag, TagSpace, Upkeep};
use bulkhead_doorbell::EventFd;
use bulkhead_sys::uring::LentRing;
use io_uring::{opcode, squeue, types, IoUring};

use crate::{errno, BackendError};

const DIRECT_ALIGN: u64 = 4096;

/// Engine selection.
#[derive(Debug)]
pub enum Engine {
    /// Synchronous vectored system calls.
    Sync,
    /// io_uring with the batch in flight, on a ring the supervisor made and lent (see
    /// [`bulkhead_sys::uring`]: it outlives a killed domain until every request it started has
    /// completed).
    IoUring(LentRing),
}

/// What a request in flight in the io_uring engine is, kept by tag from its submission to its
/// completion: enough to check its result, and to finish it synchronously if the kernel
/// transferred only part of it.
#[derive(Clone, Copy)]
struct Slot {
    iov: [libc::iovec; bulkhead_shmem::MAX_SLICES],
    niov: usize,
    op: SlotOp,
    offset: u64,
    want: u64,
    fua: bool,
    fd: RawFd,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum SlotOp {
    Read,
    Write,
    Flush,
}

impl Default for Slot {
    fn default() -> Self {
        let iov = [libc::iovec { iov_base: std::ptr::null_mut(), iov_len: 0 }; bulkhead_shmem::MAX_SLICES];
        Slot { iov, niov: 0, op: SlotOp::Flush, offset: 0, want: 0, fua: false, fd: -1 }
    }
}

/// The io_uring engine's state.
struct Uring {
    ring: IoUring,
    /// Requests in flight, by tag. Their iovecs point into grant windows, which the frontend
    /// keeps for a request until it is answered; the table is never resized while one is in
    /// flight, so the kernel's pointers to the iovecs stay valid.
    slots: Vec<Slot>,
    /// Submitted and not yet reaped.
    in_flight: usize,
    /// Placed in the submission queue and not yet handed to the kernel.
    unsubmitted: usize,
    /// Completions collected while waiting (for a barrier), handed out by the next reap.
    ready: Vec<(Tag, Result<u64, BlockError>)>,
    /// Rung by the kernel on each completion.
    wake: EventFd,
    /// Why the ring stopped working, if it did: requests in flight on it will never complete.
    failed: Option<String>,
    /// A write submitted with nothing else in flight, not yet on the ring: if the turn ends
    /// with it alone, it runs synchronously (see [`FileBackend::uring_submit`]).
    lone: Option<(Tag, squeue::Entry)>,
}

// SAFETY: the raw pointers in `slots` are only dereferenced by the kernel and by this engine
// on the thread that owns the backend; moving the backend to another thread moves them along.
unsafe impl Send for Uring {}

// One per backend, built once and never moved on the data path: the size difference costs nothing.
#[allow(clippy::large_enum_variant)]
enum EngineState {
    Sync,
    Uring(Uring),
}

/// A file or block device backend.
pub struct FileBackend {
    fd: OwnedFd,
    buffered: Option<OwnedFd>,
    size: u64,
    block_device: bool,
    read_only: bool,
    engine: EngineState,
}

impl std::fmt::Debug for FileBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FileBackend").field("size", &self.size).field("block_device", &self.block_device).finish()
    }
}

impl FileBackend {
    /// A backend over `fd` (opened `O_DIRECT` when `buffered` is given for the unaligned path).
    pub fn new(fd: OwnedFd, buffered: Option<OwnedFd>, read_only: bool, engine: Engine) -> Result<Self, BackendError> {
        let (size, block_device) = bulkhead_sys::storage_size(std::os::fd::AsFd::as_fd(&fd))
            .map_err(|source| BackendError::Sys { op: "probe size", source })?;
        let engine = match engine {
            Engine::Sync => EngineState::Sync,
            Engine::IoUring(lent) => {
                let (ring, wake) = lent.borrow().map_err(|source| BackendError::Sys { op: "io_uring mmap", source })?;
                let wake = EventFd::from_owned(wake).map_err(|source| BackendError::Sys { op: "eventfd", source })?;
                EngineState::Uring(Uring {
                    ring,
                    slots: Vec::new(),
                    in_flight: 0,
                    unsubmitted: 0,
                    ready: Vec::new(),
                    wake,
                    failed: None,
                    lone: None,
                })
            }
        };
        Ok(FileBackend { fd, buffered, size, block_device, read_only, engine })
    }

    fn fd_for(&self, offset: u64, bufs: &SliceList<'_>) -> RawFd {
        match &self.buffered {
            Some(b) => {
                let aligned = offset.is_multiple_of(DIRECT_ALIGN)
                    && bufs.iter().all(|s| {
                        (s.len() as u64).is_multiple_of(DIRECT_ALIGN) && (s.as_ptr() as u64).is_multiple_of(DIRECT_ALIGN)
                    });
                if aligned {
                    self.fd.as_raw_fd()
                } else {
                    b.as_raw_fd()
                }
            }
            None => self.fd.as_raw_fd(),
        }
    }

    fn iovecs(bufs: &SliceList<'_>) -> ([libc::iovec; bulkhead_shmem::MAX_SLICES], usize) {
        let mut v = [libc::iovec { iov_base: std::ptr::null_mut(), iov_len: 0 }; bulkhead_shmem::MAX_SLICES];
        for (i, s) in bufs.iter().enumerate() {
            v[i] = s.iovec();
        }
        (v, bufs.len())
    }

    fn rw_sync(&self, write: bool, offset: u64, bufs: &SliceList<'_>, fua: bool) -> Result<u64, BlockError> {
        Self::rw_list_sync(self.fd_for(offset, bufs), write, offset, bufs, fua)
    }

    /// Transfers the windows of `bufs` at `offset` of `fd` with plain system calls.
    pub fn rw_list_sync(fd: RawFd, write: bool, offset: u64, bufs: &SliceList<'_>, fua: bool) -> Result<u64, BlockError> {
        let (iov, n) = Self::iovecs(bufs);
        Self::rw_iov_sync(fd, write, offset, &iov[..n], fua)
    }

    /// Transfers `iov` at `offset` with plain system calls, segment by segment, so a short
    /// transfer resumes exactly where it stopped.
    fn rw_iov_sync(fd: RawFd, write: bool, offset: u64, iov: &[libc::iovec], fua: bool) -> Result<u64, BlockError> {
        let want: u64 = iov.iter().map(|v| v.iov_len as u64).sum();
        let op = if write { "write" } else { "read" };
        let mut done = 0u64;
        for v in iov {
            let mut seg_done = 0usize;
            while seg_done < v.iov_len {
                let off = (offset + done) as libc::off_t;
                // SAFETY: each iovec names a grant window, valid for its length while the
                // request is in flight (the whole call); a read's window is writable
                // (validated by the channel).
                let n = unsafe {
                    let p = v.iov_base.cast::<u8>().add(seg_done);
                    let len = v.iov_len - seg_done;
                    if write {
                        let one = libc::iovec { iov_base: p.cast(), iov_len: len };
                        libc::pwritev2(fd, &one, 1, off, if fua { libc::RWF_DSYNC } else { 0 })
                    } else {
                        libc::pread(fd, p.cast(), len, off)
                    }
                };
                if n < 0 {
                    let e = errno();
                    if e == libc::EINTR {
                        continue;
                    }
                    return Err(BlockError::Os { op, offset: offset + done, errno: e });
                }
                if n == 0 {
                    return Err(BlockError::Short { op, offset, done, want });
                }
                seg_done += n as usize;
                done += n as u64;
            }
        }
        Ok(want)
    }

    fn fallocate(&self, mode: libc::c_int, offset: u64, len: u64, op: &'static str) -> Result<u64, BlockError> {
        // SAFETY: plain syscall on our descriptor.
        let rc = unsafe { libc::fallocate(self.fd.as_raw_fd(), mode, offset as libc::off_t, len as libc::off_t) };
        if rc < 0 {
            return Err(BlockError::Os { op, offset, errno: errno() });
        }
        Ok(0)
    }

    fn blk_range(&self, req: libc::c_ulong, offset: u64, len: u64, op: &'static str) -> Result<u64, BlockError> {
        let range: [u64; 2] = [offset, len];
        // SAFETY: the ioctl reads two u64 from `range`.
        if unsafe { libc::ioctl(self.fd.as_raw_fd(), req, range.as_ptr()) } < 0 {
            return Err(BlockError::Os { op, offset, errno: errno() });
        }
        Ok(0)
    }

    fn sync_one(&self, req: &Request<'_>) -> Result<u64, BlockError> {
        const BLKDISCARD: libc::c_ulong = 0x1277;
        const BLKZEROOUT: libc::c_ulong = 0x127f;
        match *req {
            Request::Read { offset, into: bufs } => self.rw_sync(false, offset, &bufs, false),
            Request::Write { .. } if self.read_only => Err(BlockError::ReadOnly),
            Request::Write { offset, from: bufs, fua } => self.rw_sync(true, offset, &bufs, fua),
            Request::Flush => self.fdatasync(),
            Request::Discard { .. } | Request::WriteZeroes { .. } if self.read_only => Err(BlockError::ReadOnly),
            Request::Discard { offset, len } if self.block_device => self.blk_range(BLKDISCARD, offset, len, "discard"),
            Request::Discard { offset, len } => {
                self.fallocate(libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE, offset, len, "discard")
            }
            Request::WriteZeroes { offset, len } if self.block_device => self.blk_range(BLKZEROOUT, offset, len, "write zeroes"),
            Request::WriteZeroes { offset, len } => {
                self.fallocate(libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE, offset, len, "write zeroes")
            }
        }
    }

    fn fdatasync(&self) -> Result<u64, BlockError> {
        // SAFETY: plain syscall.
        if unsafe { libc::fdatasync(self.fd.as_raw_fd()) } < 0 {
            return Err(BlockError::Os { op: "fdatasync", offset: 0, errno: errno() });
        }
        Ok(0)
    }

    fn uring(&mut self) -> &mut Uring {
        match &mut self.engine {
            EngineState::Uring(u) => u,
            EngineState::Sync => unreachable!("the io_uring engine's path"),
        }
    }

    /// Starts a read, write or flush on the ring under `tag`; anything else (discard, write
    /// zeroes) waits for what is in flight and runs at once.
    fn uring_submit(&mut self, tag: Tag, req: &Request<'_>) -> Option<Result<u64, BlockError>> {
        let mut slot = Slot::default();
        match *req {
            Request::Write { .. } if self.read_only => return Some(Err(BlockError::ReadOnly)),
            Request::Read { offset, into: bufs } | Request::Write { offset, from: bufs, .. } => {
                (slot.iov, slot.niov) = Self::iovecs(&bufs);
                slot.op = if matches!(req, Request::Read { .. }) { SlotOp::Read } else { SlotOp::Write };
                slot.fua = matches!(req, Request::Write { fua: true, .. });
                (slot.offset, slot.want, slot.fd) = (offset, bufs.total_len(), self.fd_for(offset, &bufs));
            }
            Request::Flush => slot.fd = self.fd.as_raw_fd(),
            Request::Discard { .. } | Request::WriteZeroes { .. } => {
                // A barrier, as the synchronous engine is: what came before it is done first.
                self.uring_wait_all();
                return Some(self.sync_one(req));
            }
        }
        let u = self.uring();
        let Some(entry) = u.slots.get_mut(tag.index()) else {
            return Some(Err(BlockError::Invalid("tag beyond the io_uring engine's table")));
        };
        *entry = slot;
        let fd = types::Fd(slot.fd);
        let sqe = match slot.op {
            SlotOp::Read => opcode::Readv::new(fd, entry.iov.as_ptr(), slot.niov as u32).offset(slot.offset).build(),
            SlotOp::Write => opcode::Writev::new(fd, entry.iov.as_ptr(), slot.niov as u32)
                .offset(slot.offset)
                .rw_flags(if slot.fua { libc::RWF_DSYNC } else { 0 })
                .build(),
            // A flush covers every write started before it: the drain flag holds it until
            // they have completed.
            SlotOp::Flush => opcode::Fsync::new(fd).flags(types::FsyncFlags::DATASYNC).build().flags(squeue::Flags::IO_DRAIN),
        }
        .user_data(tag.index() as u64);
        // A write alone in flight costs a cross-CPU hop more asynchronously than synchronously:
        // the kernel completes an asynchronous direct write from a workqueue, while a waiting
        // writer finishes it itself. So a write that finds nothing in flight waits to see
        // whether the turn brings company; alone at the commit, it runs synchronously.
        if let Some((_, lone)) = u.lone.take() {
            Self::uring_push(u, &lone);
        } else if slot.op == SlotOp::Write && u.in_flight == 0 && u.unsubmitted == 0 {
            u.lone = Some((tag, sqe));
            return None;
        }
        Self::uring_push(u, &sqe);
        None
    }

    /// Places `sqe` (whose slot is filled) in the submission queue.
    fn uring_push(u: &mut Uring, sqe: &squeue::Entry) {
        loop {
            // SAFETY: `sqe` points at iovecs in `slots` (filled by `uring_submit`), which is not
            // resized while a request is in flight, and the windows they name stay valid until
            // the request is answered.
            if unsafe { u.ring.submission().push(sqe) }.is_ok() {
                break;
            }
            // The submission queue is full: hand it to the kernel and try again.
            Self::uring_commit(u);
        }
        u.unsubmitted += 1;
        u.in_flight += 1;
    }

    /// Hands what is in the submission queue to the kernel; a write alone in the turn runs
    /// synchronously, its result ready for the next reap.
    fn uring_commit(u: &mut Uring) {
        if let Some((tag, _)) = u.lone.take() {
            let slot = u.slots[tag.index()];
            let result = Self::rw_iov_sync(slot.fd, true, slot.offset, &slot.iov[..slot.niov], slot.fua);
            u.ready.push((tag, result));
        }
        while u.unsubmitted > 0 {
            match u.ring.submit() {
                Ok(n) => u.unsubmitted = u.unsubmitted.saturating_sub(n),
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => {}
                // The completion queue is full: collect completions, then try again.
                Err(e) if e.raw_os_error() == Some(libc::EBUSY) => Self::uring_collect(u),
                Err(e) => {
                    u.failed.get_or_insert_with(|| format!("io_uring submission failed: {e}"));
                    break;
                }
            }
        }
    }

    /// Moves every completion the kernel has posted into `ready`.
    fn uring_collect(u: &mut Uring) {
        for cqe in u.ring.completion() {
            let tag = Tag::new(cqe.user_data() as u32);
            let res = cqe.result();
            let Some(slot) = u.slots.get(tag.index()).copied() else { continue };
            u.in_flight -= 1;
            let op = match slot.op {
                SlotOp::Read => "read",
                SlotOp::Write => "write",
                SlotOp::Flush => "fdatasync",
            };
            let result = if res < 0 {
                Err(BlockError::Os { op, offset: slot.offset, errno: -res })
            } else if slot.op != SlotOp::Flush && res as u64 != slot.want {
                // Short (rare: a signal, an EOF race): finished with plain system calls.
                Self::rw_iov_sync(slot.fd, slot.op == SlotOp::Write, slot.offset, &slot.iov[..slot.niov], slot.fua)
            } else {
                Ok(if slot.op == SlotOp::Flush { 0 } else { slot.want })
            };
            u.ready.push((tag, result));
        }
    }

    /// Waits until nothing is in flight; completions go to `ready`.
    fn uring_wait_all(&mut self) {
        let u = self.uring();
        Self::uring_commit(u);
        while u.in_flight > 0 {
            match u.ring.submit_and_wait(1) {
                Ok(_) => {}
                Err(e) if matches!(e.raw_os_error(), Some(libc::EINTR) | Some(libc::EBUSY)) => {}
                Err(e) => {
                    // Nothing more will complete on this ring: the domain must end (see `lost`).
                    u.failed.get_or_insert_with(|| format!("io_uring wait failed: {e}"));
                    break;
                }
            }
            u.unsubmitted = 0;
            Self::uring_collect(u);
        }
    }

    /// A batch on the io_uring engine, waited for (the chain's path is `submit`/`reap`).
    fn uring_execute(&mut self, ios: &mut [Io<'_>]) {
        let u = self.uring();
        if u.in_flight == 0 && u.slots.len() < ios.len() {
            u.slots.resize(ios.len(), Slot::default());
        }
        for (i, io) in ios.iter_mut().enumerate() {
            if let Some(r) = self.uring_submit(Tag::new(i as u32), &io.req) {
                io.result = r;
            }
        }
        self.uring_wait_all();
        for (tag, r) in self.uring().ready.drain(..) {
            ios[tag.index()].result = r;
        }
        // Requests a failed ring never completed keep `NotDone`, an I/O error.
    }
}

impl Backend for FileBackend {
    fn size(&self) -> u64 {
        self.size
    }
    fn caps(&self) -> Caps {
        Caps { flush: true, fua: true, discard: true, write_zeroes: true, read_only: self.read_only }
    }
    fn execute(&mut self, ios: &mut [Io<'_>]) {
        if matches!(self.engine, EngineState::Uring(_)) {
            return self.uring_execute(ios);
        }
        for io in ios {
            io.result = self.sync_one(&io.req);
        }
    }
    fn async_io(&mut self) -> Option<&mut dyn AsyncIo> {
        match self.engine {
            EngineState::Uring(_) => Some(self),
            EngineState::Sync => None,
        }
    }
    fn remote(&mut self) -> Option<&mut dyn Remote> {
        match self.engine {
            EngineState::Uring(_) => Some(self),
            EngineState::Sync => None,
        }
    }
    fn upkeep(&mut self) -> Option<&mut dyn Upkeep> {
        match self.engine {
            EngineState::Uring(_) => Some(self),
            EngineState::Sync => None,
        }
    }
}

/// The io_uring engine (reached only while it runs).
impl AsyncIo for FileBackend {
    fn attach(&mut self, tags: TagSpace) {
        self.uring().slots = vec![Slot::default(); tags.capacity()];
    }
    fn submit(&mut self, tag: Tag, req: &Request<'_>) -> Option<Result<u64, BlockError>> {
        self.uring_submit(tag, req)
    }
    fn commit(&mut self) {
        Self::uring_commit(self.uring());
    }
    fn reap(&mut self, done: &mut dyn FnMut(Tag, Result<u64, BlockError>)) {
        let u = self.uring();
        Self::uring_collect(u);
        for (tag, r) in u.ready.drain(..) {
            done(tag, r);
        }
    }
    fn in_flight(&self) -> usize {
        match &self.engine {
            EngineState::Uring(u) => u.in_flight + u.ready.len(),
            EngineState::Sync => 0,
        }
    }
}

/// The io_uring engine's ring is the supervisor's, lent.
impl Remote for FileBackend {
    fn start(&mut self) -> Result<(), SetupError> {
        Ok(())
    }
    fn lost(&self) -> Option<&str> {
        match &self.engine {
            // A ring that fails leaves its requests unanswered for good: the next generation
            // of the domain, on a new ring, gets them again.
            EngineState::Uring(u) => u.failed.as_deref(),
            EngineState::Sync => None,
        }
    }
}

/// The io_uring engine's completions ring its eventfd.
impl Upkeep for FileBackend {
    fn wake_fd(&self) -> RawFd {
        match &self.engine {
            EngineState::Uring(u) => u.wake.as_raw_fd(),
            EngineState::Sync => -1,
        }
    }
    fn tend(&mut self) {
        if let EngineState::Uring(u) = &self.engine {
            // Cleared after a wake-up and before the next look at the completion queue: a
            // completion posted after this rings again.
            u.wake.drain();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bulkhead_shmem::{memfd, Mapping, Protection};
    use std::io::Write;

    fn temp_file(size: u64) -> (std::path::PathBuf, OwnedFd) {
        let dir = std::env::temp_dir();
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos();
        let path = dir.join(format!("bulkhead-file-test-{}-{nanos}", std::process::id()));
        let mut f = std::fs::File::create(&path).unwrap();
        f.set_len(size).unwrap();
        f.flush().unwrap();
        let f = std::fs::OpenOptions::new().read(true).write(true).open(&path).unwrap();
        (path, f.into())
    }

    fn lent() -> Engine {
        Engine::IoUring(bulkhead_sys::uring::lend(bulkhead_sys::uring::FILE_ENGINE).unwrap().0)
    }

    fn exercise(engine: Engine) {
        let (path, fd) = temp_file(1 << 20);
        let mut b = FileBackend::new(fd, None, false, engine).unwrap();
        assert_eq!(b.size(), 1 << 20);
        let mfd = memfd::create("buf", 1 << 16).unwrap();
        let m = Mapping::new(mfd.as_raw_fd(), 1 << 16, Protection::ReadWrite).unwrap();
        let w = m.slice(0, 8192).unwrap();
        let pattern: Vec<u8> = (0..8192u32).map(|i| (i % 253) as u8).collect();
        w.copy_from(&pattern).unwrap();
        let r1 = m.slice(16384, 4096).unwrap();
        let r2 = m.slice(32768, 4096).unwrap();
        let mut rl = SliceList::one(r1);
        rl.push(r2);
        let mut ios = [
            Io::new(Request::Write { offset: 4096, from: SliceList::one(w), fua: true }),
            Io::new(Request::Flush),
            Io::new(Request::Read { offset: 4096, into: rl }),
            Io::new(Request::WriteZeroes { offset: 4096, len: 4096 }),
        ];
        b.execute(&mut ios);
        for io in &ios {
            assert!(io.result.is_ok(), "{:?}", io.result);
        }
        let mut out = vec![0u8; 4096];
        r1.copy_to(&mut out);
        assert_eq!(out, pattern[..4096]);
        r2.copy_to(&mut out);
        assert_eq!(out, pattern[4096..]);
        let mut ios = [Io::new(Request::Read { offset: 4096, into: SliceList::one(r1) })];
        b.execute(&mut ios);
        r1.copy_to(&mut out);
        assert!(out.iter().all(|&x| x == 0), "write-zeroes zeroed the range");
        std::fs::remove_file(path).unwrap();
    }

    #[test]
    fn sync_engine_reads_writes_flushes_and_zeroes() {
        exercise(Engine::Sync);
    }

    #[test]
    fn io_uring_engine_reads_writes_flushes_and_zeroes() {
        exercise(lent());
    }

    #[test]
    fn io_uring_engine_answers_each_request_as_it_completes_under_its_tag() {
        let (path, fd) = temp_file(1 << 20);
        let mut b = FileBackend::new(fd, None, false, lent()).unwrap();
        assert!(b.async_io().is_some());
        b.attach(TagSpace { queues: 2, per_queue: 4 });
        let mfd = memfd::create("buf", 1 << 16).unwrap();
        let m = Mapping::new(mfd.as_raw_fd(), 1 << 16, Protection::ReadWrite).unwrap();
        let w = m.slice(0, 8192).unwrap();
        let pattern: Vec<u8> = (0..8192u32).map(|i| (i % 241) as u8).collect();
        w.copy_from(&pattern).unwrap();
        let r = m.slice(16384, 8192).unwrap();
        // Writes on two tags and a flush that must wait for them, started together.
        assert_eq!(b.submit(Tag::new(5), &Request::Write { offset: 0, from: SliceList::one(w), fua: false }), None);
        assert_eq!(b.submit(Tag::new(1), &Request::Write { offset: 65536, from: SliceList::one(w), fua: true }), None);
        assert_eq!(b.submit(Tag::new(6), &Request::Flush), None);
        b.commit();
        let mut got = Vec::new();
        let wait = |b: &mut FileBackend, got: &mut Vec<(usize, Result<u64, BlockError>)>, n: usize| {
            while got.len() < n {
                let mut pfd = [libc::pollfd { fd: b.wake_fd(), events: libc::POLLIN, revents: 0 }];
                bulkhead_sys::poll(&mut pfd, 1000).unwrap();
                b.tend();
                b.reap(&mut |t, r| got.push((t.index(), r)));
            }
        };
        wait(&mut b, &mut got, 3);
        got.sort_by_key(|g| g.0);
        assert_eq!(got, vec![(1, Ok(8192)), (5, Ok(8192)), (6, Ok(0))]);
        assert_eq!(b.in_flight(), 0);
        // A read on a tag just freed sees the write; write zeroes waits for it and runs at once.
        assert_eq!(b.submit(Tag::new(5), &Request::Read { offset: 65536, into: SliceList::one(r) }), None);
        assert_eq!(b.submit(Tag::new(2), &Request::WriteZeroes { offset: 0, len: 4096 }), Some(Ok(0)));
        b.commit();
        got.clear();
        wait(&mut b, &mut got, 1);
        assert_eq!(got, vec![(5, Ok(8192))]);
        let mut out = vec![0u8; 8192];
        r.copy_to(&mut out);
        assert_eq!(out, pattern);
        assert_eq!(b.lost(), None);
        std::fs::remove_file(path).unwrap();
    }

    #[test]
    fn a_write_alone_in_its_turn_runs_synchronously_and_one_in_company_goes_on_the_ring() {
        let (path, fd) = temp_file(1 << 20);
        let mut b = FileBackend::new(fd, None, false, lent()).unwrap();
        b.attach(TagSpace { queues: 1, per_queue: 4 });
        let mfd = memfd::create("buf", 1 << 16).unwrap();
        let m = Mapping::new(mfd.as_raw_fd(), 1 << 16, Protection::ReadWrite).unwrap();
        let w = m.slice(0, 4096).unwrap();
        w.copy_from(&[0x5a; 4096]).unwrap();
        let write = |offset| Request::Write { offset, from: SliceList::one(w), fua: false };
        let on_ring = |b: &mut FileBackend| b.uring().in_flight;
        // Alone: done by the commit, answered by the next reap without a wait.
        assert_eq!(b.submit(Tag::new(0), &write(0)), None);
        b.commit();
        assert_eq!((on_ring(&mut b), b.in_flight()), (0, 1));
        let mut got = Vec::new();
        b.reap(&mut |t, r| got.push((t.index(), r)));
        assert_eq!(got, vec![(0, Ok(4096))]);
        // With a read behind it in the same turn: both on the ring, in order.
        let r = m.slice(8192, 4096).unwrap();
        assert_eq!(b.submit(Tag::new(1), &write(4096)), None);
        assert_eq!(b.submit(Tag::new(2), &Request::Read { offset: 4096, into: SliceList::one(r) }), None);
        b.commit();
        assert_eq!(on_ring(&mut b) + b.uring().ready.len(), 2);
        got.clear();
        while got.len() < 2 {
            b.reap(&mut |t, r| got.push((t.index(), r)));
        }
        got.sort_by_key(|g| g.0);
        assert_eq!(got, vec![(1, Ok(4096)), (2, Ok(4096))]);
        // A write behind another in flight goes on the ring too.
        let read_first = b.submit(Tag::new(3), &Request::Read { offset: 0, into: SliceList::one(r) });
        assert_eq!(read_first, None);
        b.commit();
        assert_eq!(b.submit(Tag::new(0), &write(8192)), None);
        assert!(b.uring().lone.is_none(), "a read was in flight: the write went on the ring");
        b.commit();
        got.clear();
        while got.len() < 2 {
            b.reap(&mut |t, r| got.push((t.index(), r)));
        }
        let mut out = vec![0u8; 4096];
        r.copy_to(&mut out);
        assert!(out.iter().all(|&x| x == 0x5a));
        std::fs::remove_file(path).unwrap();
    }

    #[test]
    fn io_uring_engine_refuses_writes_to_a_read_only_file_at_once() {
        let (path, fd) = temp_file(1 << 16);
        let mut b = FileBackend::new(fd, None, true, lent()).unwrap();
        b.attach(TagSpace { queues: 1, per_queue: 2 });
        let mfd = memfd::create("buf", 4096).unwrap();
        let m = Mapping::new(mfd.as_raw_fd(), 4096, Protection::ReadWrite).unwrap();
        let req = Request::Write { offset: 0, from: SliceList::one(m.slice(0, 4096).unwrap()), fua: false };
        assert_eq!(b.submit(Tag::new(0), &req), Some(Err(BlockError::ReadOnly)));
        assert_eq!(b.in_flight(), 0);
        std::fs::remove_file(path).unwrap();
    }

    #[test]
    fn read_only_file_refuses_writes() {
        let (path, fd) = temp_file(1 << 16);
        let mut b = FileBackend::new(fd, None, true, Engine::Sync).unwrap();
        let mfd = memfd::create("buf", 4096).unwrap();
        let m = Mapping::new(mfd.as_raw_fd(), 4096, Protection::ReadWrite).unwrap();
        let mut ios = [Io::new(Request::Write { offset: 0, from: SliceList::one(m.slice(0, 4096).unwrap()), fua: false })];
        b.execute(&mut ios);
        assert_eq!(ios[0].result, Err(BlockError::ReadOnly));
        std::fs::remove_file(path).unwrap();
    }
}
