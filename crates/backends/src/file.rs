//! A regular file or block device (for instance a loop device) as backend.
//!
//! Two engines: `sync` (`preadv`/`pwritev2`, one request at a time) and `io_uring` (a whole
//! batch of reads and writes in flight at once). With `direct = true` the supervisor passes a
//! descriptor opened with `O_DIRECT` plus a buffered one: requests aligned to 4 KiB go direct,
//! any other falls back to the buffered descriptor (the kernel keeps the two coherent).

use std::os::fd::{AsRawFd, OwnedFd, RawFd};

use bulkhead_block::{Backend, BlockError, Caps, Io, Request, SliceList};
use io_uring::{opcode, types, IoUring};

use crate::{errno, BackendError};

const DIRECT_ALIGN: u64 = 4096;
const URING_DEPTH: u32 = 128;
/// Most io-wq workers of each kind (bounded, unbounded) an io_uring engine may use (the
/// sandbox's RLIMIT_NPROC for the io_uring role counts on this bound).
pub const IOWQ_WORKERS: u32 = 4;

/// Engine selection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Engine {
    /// Synchronous vectored system calls.
    Sync,
    /// io_uring with the batch in flight.
    IoUring,
}

/// Scratch iovecs of the batch in flight. They point into grant windows only between
/// submission and reaping inside one `execute` call.
struct IovecScratch(Vec<[libc::iovec; bulkhead_shmem::MAX_SLICES]>);

// SAFETY: the pointers are used only inside one `execute` call on the owning thread; between
// calls the vector holds stale values that are never dereferenced (it is cleared first).
unsafe impl Send for IovecScratch {}

// One per backend, built once and never moved on the data path: the size difference costs nothing.
#[allow(clippy::large_enum_variant)]
enum EngineState {
    Sync,
    Uring { ring: IoUring, iovecs: IovecScratch },
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

/// An io_uring that can only read, write and fsync: io_uring operations do not pass through
/// seccomp, so the ring is created disabled, restricted to the three operations the engine
/// uses, then enabled.
fn restricted_ring() -> std::io::Result<IoUring> {
    use io_uring::register::Restriction;
    let ring = IoUring::builder().setup_r_disabled().build(URING_DEPTH)?;
    // Operations the kernel cannot finish inline go to io-wq worker threads; bound them, as
    // the sandbox allows a domain only a few tasks (RLIMIT_NPROC).
    let mut workers = [IOWQ_WORKERS, IOWQ_WORKERS];
    ring.submitter().register_iowq_max_workers(&mut workers)?;
    let mut allowed = [
        Restriction::sqe_op(opcode::Readv::CODE),
        Restriction::sqe_op(opcode::Writev::CODE),
        Restriction::sqe_op(opcode::Fsync::CODE),
    ];
    ring.submitter().register_restrictions(&mut allowed)?;
    ring.submitter().register_enable_rings()?;
    Ok(ring)
}

impl FileBackend {
    /// A backend over `fd` (opened `O_DIRECT` when `buffered` is given for the unaligned path).
    pub fn new(fd: OwnedFd, buffered: Option<OwnedFd>, read_only: bool, engine: Engine) -> Result<Self, BackendError> {
        let (size, block_device) = bulkhead_sys::storage_size(std::os::fd::AsFd::as_fd(&fd))
            .map_err(|source| BackendError::Sys { op: "probe size", source })?;
        let engine = match engine {
            Engine::Sync => EngineState::Sync,
            Engine::IoUring => EngineState::Uring {
                ring: restricted_ring().map_err(|source| BackendError::Sys { op: "io_uring_setup", source })?,
                iovecs: IovecScratch(Vec::with_capacity(URING_DEPTH as usize)),
            },
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
        let want = bufs.total_len();
        let fd = self.fd_for(offset, bufs);
        let mut done = 0u64;
        // Transfer segment by segment so a short transfer can resume exactly where it stopped.
        for s in bufs.iter() {
            let mut seg_done = 0usize;
            while seg_done < s.len() {
                let off = (offset + done) as libc::off_t;
                // SAFETY: the window is valid for its length while the mapping lives (for the
                // whole call); for reads it is a writable window (validated by the channel).
                let n = unsafe {
                    let p = s.as_ptr().add(seg_done);
                    let len = s.len() - seg_done;
                    if write {
                        let iov = libc::iovec { iov_base: p as *mut _, iov_len: len };
                        libc::pwritev2(fd, &iov, 1, off, if fua { libc::RWF_DSYNC } else { 0 })
                    } else {
                        libc::pread(fd, p as *mut _, len, off)
                    }
                };
                if n < 0 {
                    let e = errno();
                    if e == libc::EINTR {
                        continue;
                    }
                    return Err(BlockError::Os { op: if write { "write" } else { "read" }, offset: offset + done, errno: e });
                }
                if n == 0 {
                    return Err(BlockError::Short { op: if write { "write" } else { "read" }, offset, done, want });
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
            Request::Read { offset, bufs } => self.rw_sync(false, offset, &bufs, false),
            Request::Write { .. } if self.read_only => Err(BlockError::ReadOnly),
            Request::Write { offset, bufs, fua } => self.rw_sync(true, offset, &bufs, fua),
            Request::Flush => {
                // SAFETY: plain syscall.
                if unsafe { libc::fdatasync(self.fd.as_raw_fd()) } < 0 {
                    return Err(BlockError::Os { op: "fdatasync", offset: 0, errno: errno() });
                }
                Ok(0)
            }
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

    fn uring_rw(&mut self, ios: &mut [Io<'_>]) {
        let mut chosen = [0 as RawFd; URING_DEPTH as usize];
        for (i, io) in ios.iter().enumerate() {
            if let Request::Read { offset, bufs } | Request::Write { offset, bufs, .. } = io.req {
                chosen[i] = self.fd_for(offset, &bufs);
            }
        }
        let EngineState::Uring { ring, iovecs } = &mut self.engine else { unreachable!("uring engine") };
        let iovecs = &mut iovecs.0;
        iovecs.clear();
        for io in ios.iter() {
            if let Request::Read { bufs, .. } | Request::Write { bufs, .. } = io.req {
                iovecs.push(Self::iovecs(&bufs).0);
            }
        }
        {
            let mut sq = ring.submission();
            for (i, io) in ios.iter().enumerate() {
                let fd = types::Fd(chosen[i]);
                let entry = match io.req {
                    Request::Read { offset, bufs } => {
                        opcode::Readv::new(fd, iovecs[i].as_ptr(), bufs.len() as u32).offset(offset).build()
                    }
                    Request::Write { offset, bufs, fua } => opcode::Writev::new(fd, iovecs[i].as_ptr(), bufs.len() as u32)
                        .offset(offset)
                        .rw_flags(if fua { libc::RWF_DSYNC } else { 0 })
                        .build(),
                    _ => unreachable!("only reads and writes are batched"),
                };
                // SAFETY: the iovecs and the windows they point to live until the completions
                // are reaped below, before this function returns.
                unsafe { sq.push(&entry.user_data(i as u64)).expect("batch no deeper than the ring") };
            }
        }
        let mut left = ios.len();
        let mut redo = [false; URING_DEPTH as usize];
        while left > 0 {
            if let Err(e) = ring.submit_and_wait(left) {
                if e.raw_os_error() == Some(libc::EINTR) {
                    continue;
                }
                // The ring failed as a whole: finish the batch synchronously.
                for r in redo.iter_mut().take(ios.len()) {
                    *r = true;
                }
                break;
            }
            for cqe in ring.completion() {
                let i = cqe.user_data() as usize;
                let want = ios[i].req.transfer_len();
                let res = cqe.result();
                ios[i].result = if res < 0 {
                    let op = if matches!(ios[i].req, Request::Write { .. }) { "write" } else { "read" };
                    let offset = match ios[i].req {
                        Request::Read { offset, .. } | Request::Write { offset, .. } => offset,
                        _ => 0,
                    };
                    Err(BlockError::Os { op, offset, errno: -res })
                } else if res as u64 != want {
                    redo[i] = true;
                    Err(BlockError::NotDone)
                } else {
                    Ok(want)
                };
                left -= 1;
            }
        }
        // Short transfers (rare: signals, EOF races) are finished synchronously.
        for (i, io) in ios.iter_mut().enumerate() {
            if redo[i] {
                io.result = self.sync_one(&io.req);
            }
        }
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
        if matches!(self.engine, EngineState::Sync) {
            for io in ios {
                io.result = self.sync_one(&io.req);
            }
            return;
        }
        // Batch runs of reads and writes through io_uring; other operations act as barriers
        // (a flush covers every write before it in the batch).
        let mut i = 0;
        while i < ios.len() {
            let start = i;
            while i < ios.len()
                && i - start < URING_DEPTH as usize
                && match ios[i].req {
                    Request::Read { .. } => true,
                    Request::Write { .. } => !self.read_only,
                    _ => false,
                }
            {
                i += 1;
            }
            if i > start {
                self.uring_rw(&mut ios[start..i]);
            } else {
                ios[i].result = self.sync_one(&ios[i].req);
                i += 1;
            }
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
            Io::new(Request::Write { offset: 4096, bufs: SliceList::one(w), fua: true }),
            Io::new(Request::Flush),
            Io::new(Request::Read { offset: 4096, bufs: rl }),
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
        let mut ios = [Io::new(Request::Read { offset: 4096, bufs: SliceList::one(r1) })];
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
        exercise(Engine::IoUring);
    }

    #[test]
    fn io_uring_ring_refuses_operations_outside_its_restrictions() {
        let mut ring = restricted_ring().unwrap();
        let nop = opcode::Nop::new().build().user_data(7);
        // SAFETY: a NOP carries no buffers.
        unsafe { ring.submission().push(&nop).unwrap() };
        ring.submit_and_wait(1).unwrap();
        let cqe = ring.completion().next().unwrap();
        assert_eq!(cqe.result(), -libc::EACCES, "a restricted ring refuses NOP (and openat, socket, …)");
    }

    #[test]
    fn read_only_file_refuses_writes() {
        let (path, fd) = temp_file(1 << 16);
        let mut b = FileBackend::new(fd, None, true, Engine::Sync).unwrap();
        let mfd = memfd::create("buf", 4096).unwrap();
        let m = Mapping::new(mfd.as_raw_fd(), 4096, Protection::ReadWrite).unwrap();
        let mut ios = [Io::new(Request::Write { offset: 0, bufs: SliceList::one(m.slice(0, 4096).unwrap()), fua: false })];
        b.execute(&mut ios);
        assert_eq!(ios[0].result, Err(BlockError::ReadOnly));
        std::fs::remove_file(path).unwrap();
    }
}
