//! Mounting, worker threads and request handling.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::thread::JoinHandleExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use bulkhead_client::{Device, IoError};
use zerocopy::{FromBytes, Immutable, IntoBytes};

use crate::abi::*;

/// Largest write the kernel may send (and read it may ask for).
const MAX_WRITE: usize = 1 << 20;
const MAX_PAGES: u16 = (MAX_WRITE / 4096) as u16;
const BUF_SIZE: usize = MAX_WRITE + 64 * 1024;
const ATTR_VALID_S: u64 = 3600;
const FUSE_DEV_IOC_CLONE: libc::c_ulong = 0x8004_e500;

/// FUSE export errors.
#[derive(Debug, thiserror::Error)]
pub enum FuseError {
    /// A system call failed.
    #[error("{op} {path}: {source}")]
    Sys {
        /// What was being done.
        op: &'static str,
        /// Path concerned.
        path: String,
        /// OS error.
        #[source]
        source: io::Error,
    },
    /// The kernel did not start the session in time.
    #[error("FUSE session at {0} did not initialise within 5 s")]
    InitTimeout(String),
}

struct Shared {
    devices: Vec<Arc<Device>>,
    /// The session, for notifications (a duplicate of the first worker's descriptor).
    notify: OwnedFd,
    stop: AtomicBool,
    initialized: AtomicBool,
    start_time: u64,
    errors_logged: AtomicUsize,
}

/// A mounted export and its workers. Dropping it unmounts (lazily if busy) and stops workers.
pub struct FuseExport {
    mountpoint: PathBuf,
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    mounted: bool,
}

impl std::fmt::Debug for FuseExport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FuseExport").field("mountpoint", &self.mountpoint).field("workers", &self.workers.len()).finish()
    }
}

fn sys(op: &'static str, path: &Path) -> FuseError {
    FuseError::Sys { op, path: path.display().to_string(), source: io::Error::last_os_error() }
}

fn open_dev_fuse() -> io::Result<OwnedFd> {
    // SAFETY: constant NUL-terminated path.
    let fd = unsafe { libc::open(c"/dev/fuse".as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fresh descriptor.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

extern "C" fn on_kick(_: libc::c_int) {}

/// Installs a no-op SIGUSR1 handler without SA_RESTART, so a kicked worker's blocking read of
/// /dev/fuse returns EINTR and it can see the stop flag.
fn install_kick_handler() {
    // SAFETY: a zeroed sigaction with a valid handler and empty mask is well-formed; the handler
    // is async-signal-safe (it does nothing).
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = on_kick as *const () as usize;
        libc::sigemptyset(&mut sa.sa_mask);
        sa.sa_flags = 0;
        libc::sigaction(libc::SIGUSR1, &sa, std::ptr::null_mut());
    }
}

impl FuseExport {
    /// Mounts `mountpoint` (created if missing) and starts `threads` workers serving `devices`.
    pub fn mount(mountpoint: &Path, devices: Vec<Arc<Device>>, threads: usize) -> Result<Self, FuseError> {
        std::fs::create_dir_all(mountpoint).map_err(|source| FuseError::Sys {
            op: "create",
            path: mountpoint.display().to_string(),
            source,
        })?;
        let master = open_dev_fuse().map_err(|source| FuseError::Sys { op: "open", path: "/dev/fuse".into(), source })?;
        let opts = format!(
            "fd={},rootmode=40000,user_id=0,group_id=0,allow_other,default_permissions,max_read={MAX_WRITE}",
            master.as_raw_fd()
        );
        let target = CString::new(mountpoint.as_os_str().as_bytes()).expect("path without NUL");
        let opts_c = CString::new(opts).expect("no NUL");
        // SAFETY: all pointers are valid NUL-terminated strings for the duration of the call.
        let rc = unsafe {
            libc::mount(
                c"bulkhead".as_ptr(),
                target.as_ptr(),
                c"fuse.bulkhead".as_ptr(),
                libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOATIME,
                opts_c.as_ptr().cast(),
            )
        };
        if rc < 0 {
            return Err(sys("mount FUSE at", mountpoint));
        }
        install_kick_handler();
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
        let notify = master.try_clone().map_err(|source| FuseError::Sys { op: "dup", path: "/dev/fuse".into(), source })?;
        let shared = Arc::new(Shared {
            devices,
            notify,
            stop: AtomicBool::new(false),
            initialized: AtomicBool::new(false),
            start_time: now,
            errors_logged: AtomicUsize::new(0),
        });
        let mut export =
            FuseExport { mountpoint: mountpoint.to_path_buf(), shared: shared.clone(), workers: vec![], mounted: true };
        let mut fds = vec![master];
        for _ in 1..threads.max(1) {
            let clone = open_dev_fuse().map_err(|source| FuseError::Sys { op: "open", path: "/dev/fuse".into(), source })?;
            let mut master_fd: u32 = fds[0].as_raw_fd() as u32;
            // SAFETY: the ioctl reads one u32 (the session's descriptor) from `master_fd`.
            if unsafe { libc::ioctl(clone.as_raw_fd(), FUSE_DEV_IOC_CLONE, &mut master_fd) } < 0 {
                return Err(sys("clone FUSE session of", mountpoint));
            }
            fds.push(clone);
        }
        for (slot, fd) in fds.into_iter().enumerate() {
            let sh = shared.clone();
            let handle = std::thread::Builder::new()
                .name(format!("fuse-{slot}"))
                .spawn(move || worker(fd, slot, sh))
                .map_err(|source| FuseError::Sys { op: "spawn worker for", path: "fuse".into(), source })?;
            export.workers.push(handle);
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        while !shared.initialized.load(Ordering::Acquire) {
            if Instant::now() > deadline {
                return Err(FuseError::InitTimeout(mountpoint.display().to_string()));
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        Ok(export)
    }

    /// A handle that makes the kernel drop the cached pages of a device's file, by name:
    /// after the device's contents changed under it (a snapshot revert), so files kept open
    /// read the device again instead of their page cache.
    pub fn invalidator(&self) -> impl Fn(&str) -> bool + Send + Sync + 'static {
        let sh = self.shared.clone();
        move |name: &str| {
            let Some(i) = sh.devices.iter().position(|d| d.name() == name) else { return false };
            // FUSE_NOTIFY_INVAL_INODE: the inode, offset 0, length 0 (everything).
            let mut body = [0u8; 24];
            body[..8].copy_from_slice(&(i as u64 + 2).to_ne_bytes());
            reply_raw(sh.notify.as_raw_fd(), 0, -FUSE_NOTIFY_INVAL_INODE, &[&body]);
            true
        }
    }

    /// The mount point.
    pub fn mountpoint(&self) -> &Path {
        &self.mountpoint
    }

    /// Unmounts and stops the workers after they finish the request in hand. If the mount is
    /// busy (a loop device or an open file still uses it), it is detached lazily and the
    /// connection is ended when the workers close their descriptors: remaining users then get
    /// ENOTCONN. Returns whether the unmount was clean.
    pub fn shutdown(mut self) -> bool {
        self.stop()
    }

    fn stop(&mut self) -> bool {
        let mut clean = true;
        if self.mounted {
            let target = CString::new(self.mountpoint.as_os_str().as_bytes()).expect("path without NUL");
            // SAFETY: valid path string.
            if unsafe { libc::umount2(target.as_ptr(), 0) } < 0 {
                let e = io::Error::last_os_error();
                eprintln!("bulkhead: {} is busy ({e}); detaching it lazily", self.mountpoint.display());
                // SAFETY: as above.
                unsafe { libc::umount2(target.as_ptr(), libc::MNT_DETACH) };
                clean = false;
            }
            self.mounted = false;
        }
        self.shared.stop.store(true, Ordering::Release);
        // The mount point was ours to create; leave no empty directory behind.
        let _ = std::fs::remove_dir(&self.mountpoint);
        let workers = std::mem::take(&mut self.workers);
        for w in workers {
            while !w.is_finished() {
                // SAFETY: the thread is alive (not finished and not joined), so its pthread_t
                // is valid; SIGUSR1 has a no-op handler.
                unsafe { libc::pthread_kill(w.as_pthread_t(), libc::SIGUSR1) };
                std::thread::sleep(Duration::from_millis(2));
            }
            let _ = w.join();
        }
        clean
    }
}

impl Drop for FuseExport {
    fn drop(&mut self) {
        if self.mounted || !self.workers.is_empty() {
            self.stop();
        }
    }
}

fn worker(fd: OwnedFd, slot: usize, sh: Arc<Shared>) {
    let mut buf = vec![0u8; BUF_SIZE];
    let mut scratch = Vec::new();
    while !sh.stop.load(Ordering::Acquire) {
        // SAFETY: reads into our own buffer of BUF_SIZE bytes.
        let n = unsafe { libc::read(fd.as_raw_fd(), buf.as_mut_ptr().cast(), BUF_SIZE) };
        if n < 0 {
            match io::Error::last_os_error().raw_os_error() {
                Some(libc::EINTR) | Some(libc::EAGAIN) | Some(libc::ENOENT) => continue,
                Some(libc::ENODEV) => break, // unmounted
                _ => {
                    eprintln!("bulkhead: fuse worker {slot}: read: {}", io::Error::last_os_error());
                    break;
                }
            }
        }
        let req = &buf[..n as usize];
        if handle(fd.as_raw_fd(), slot, &sh, req, &mut scratch) == Flow::Stop {
            break;
        }
    }
}

#[derive(PartialEq, Eq)]
enum Flow {
    Continue,
    Stop,
}

fn reply_raw(fd: RawFd, unique: u64, error: i32, parts: &[&[u8]]) {
    let len = 16 + parts.iter().map(|p| p.len()).sum::<usize>();
    let hdr = OutHeader { len: len as u32, error: -error, unique };
    let mut iov = [libc::iovec { iov_base: std::ptr::null_mut(), iov_len: 0 }; 4];
    iov[0] = libc::iovec { iov_base: hdr.as_bytes().as_ptr() as *mut _, iov_len: 16 };
    for (i, p) in parts.iter().enumerate() {
        iov[i + 1] = libc::iovec { iov_base: p.as_ptr() as *mut _, iov_len: p.len() };
    }
    // SAFETY: every iovec points at memory valid for the call; the kernel copies it.
    unsafe { libc::writev(fd, iov.as_ptr(), 1 + parts.len() as i32) };
}

fn reply_err(fd: RawFd, unique: u64, errno: i32) {
    reply_raw(fd, unique, errno, &[]);
}

fn reply<T: IntoBytes + Immutable>(fd: RawFd, unique: u64, v: &T) {
    reply_raw(fd, unique, 0, &[v.as_bytes()]);
}

fn parse<T: FromBytes>(body: &[u8]) -> Option<T> {
    T::read_from_prefix(body).ok().map(|(v, _)| v)
}

impl Shared {
    fn device(&self, nodeid: u64) -> Option<&Arc<Device>> {
        nodeid.checked_sub(2).and_then(|i| self.devices.get(i as usize))
    }

    fn attr(&self, nodeid: u64) -> Option<Attr> {
        let t = self.start_time;
        let base = Attr { ino: nodeid, atime: t, mtime: t, ctime: t, uid: 0, gid: 0, blksize: 4096, ..Default::default() };
        if nodeid == FUSE_ROOT_ID {
            return Some(Attr { mode: libc::S_IFDIR | 0o755, nlink: 2, ..base });
        }
        let d = self.device(nodeid)?;
        Some(Attr { mode: libc::S_IFREG | 0o600, nlink: 1, size: d.size(), blocks: d.size() / 512, ..base })
    }

    fn log_error(&self, what: &str, e: &IoError) {
        // Rate-limited: the first 10, then every 1000th.
        let n = self.errors_logged.fetch_add(1, Ordering::Relaxed);
        if n < 10 || n.is_multiple_of(1000) {
            eprintln!("bulkhead: fuse {what}: {e} ({} errors so far)", n + 1);
        }
    }
}

fn handle(fd: RawFd, slot: usize, sh: &Shared, req: &[u8], scratch: &mut Vec<u8>) -> Flow {
    let Some(h) = parse::<InHeader>(req) else {
        return Flow::Continue;
    };
    let body = &req[std::mem::size_of::<InHeader>().min(req.len())..];
    let u = h.unique;
    match h.opcode {
        INIT => {
            let Some(i) = parse::<InitIn>(body) else {
                reply_err(fd, u, libc::EINVAL);
                return Flow::Continue;
            };
            if i.major != FUSE_KERNEL_VERSION {
                reply_err(fd, u, libc::EPROTO);
                return Flow::Stop;
            }
            let want = FUSE_ASYNC_READ | FUSE_ATOMIC_O_TRUNC | FUSE_BIG_WRITES | FUSE_PARALLEL_DIROPS | FUSE_MAX_PAGES;
            let out = InitOut {
                major: FUSE_KERNEL_VERSION,
                minor: FUSE_KERNEL_MINOR_VERSION.min(i.minor),
                max_readahead: i.max_readahead,
                flags: i.flags & want,
                max_background: 64,
                congestion_threshold: 48,
                max_write: MAX_WRITE as u32,
                time_gran: 1,
                max_pages: MAX_PAGES,
                ..Default::default()
            };
            reply(fd, u, &out);
            sh.initialized.store(true, Ordering::Release);
        }
        DESTROY => {
            reply_err(fd, u, 0);
            return Flow::Stop;
        }
        FORGET | BATCH_FORGET | INTERRUPT => {} // no reply
        LOOKUP => {
            let name = body.split(|&b| b == 0).next().unwrap_or(&[]);
            let found = (h.nodeid == FUSE_ROOT_ID).then(|| sh.devices.iter().position(|d| d.name().as_bytes() == name)).flatten();
            match found {
                Some(i) => {
                    let nodeid = i as u64 + 2;
                    let attr = sh.attr(nodeid).expect("device node");
                    let out = EntryOut {
                        nodeid,
                        generation: 1,
                        entry_valid: ATTR_VALID_S,
                        attr_valid: ATTR_VALID_S,
                        attr,
                        ..Default::default()
                    };
                    reply(fd, u, &out);
                }
                None => reply_err(fd, u, libc::ENOENT),
            }
        }
        GETATTR => match sh.attr(h.nodeid) {
            Some(attr) => reply(fd, u, &AttrOut { attr_valid: ATTR_VALID_S, attr, ..Default::default() }),
            None => reply_err(fd, u, libc::ENOENT),
        },
        SETATTR => {
            let (Some(s), Some(attr)) = (parse::<SetattrIn>(body), sh.attr(h.nodeid)) else {
                reply_err(fd, u, libc::ENOENT);
                return Flow::Continue;
            };
            if s.valid & FATTR_SIZE != 0 && s.size != attr.size {
                // A device has a fixed size.
                reply_err(fd, u, libc::EPERM);
            } else {
                reply(fd, u, &AttrOut { attr_valid: ATTR_VALID_S, attr, ..Default::default() });
            }
        }
        OPEN => match (sh.device(h.nodeid), parse::<OpenIn>(body)) {
            (Some(_), Some(_)) => reply(fd, u, &OpenOut::default()),
            (None, _) if h.nodeid == FUSE_ROOT_ID => reply_err(fd, u, libc::EISDIR),
            _ => reply_err(fd, u, libc::ENOENT),
        },
        OPENDIR => {
            if h.nodeid == FUSE_ROOT_ID {
                reply(fd, u, &OpenOut::default())
            } else {
                reply_err(fd, u, libc::ENOTDIR)
            }
        }
        READDIR => readdir(fd, sh, u, h.nodeid, body),
        READ => read(fd, slot, sh, u, h.nodeid, body, scratch),
        WRITE => write(fd, slot, sh, u, h.nodeid, body),
        FSYNC => match sh.device(h.nodeid) {
            Some(d) => match d.flush(slot) {
                Ok(()) => reply_err(fd, u, 0),
                Err(e) => {
                    sh.log_error("fsync", &e);
                    reply_err(fd, u, e.errno())
                }
            },
            None => reply_err(fd, u, 0),
        },
        FALLOCATE => fallocate(fd, slot, sh, u, h.nodeid, body),
        STATFS => reply(
            fd,
            u,
            &StatfsOut { bsize: 4096, frsize: 4096, namelen: 255, files: sh.devices.len() as u64, ..Default::default() },
        ),
        FLUSH | RELEASE | RELEASEDIR | FSYNCDIR | ACCESS => reply_err(fd, u, 0),
        GETXATTR | LISTXATTR => reply_err(fd, u, libc::ENOSYS),
        _ => reply_err(fd, u, libc::ENOSYS),
    }
    Flow::Continue
}

fn readdir(fd: RawFd, sh: &Shared, u: u64, nodeid: u64, body: &[u8]) {
    let Some(r) = parse::<ReadIn>(body) else {
        return reply_err(fd, u, libc::EINVAL);
    };
    if nodeid != FUSE_ROOT_ID {
        return reply_err(fd, u, libc::ENOTDIR);
    }
    let mut out = Vec::with_capacity(r.size as usize);
    let entries = [(".", FUSE_ROOT_ID, 4u32), ("..", FUSE_ROOT_ID, 4)]
        .into_iter()
        .map(|(n, i, t)| (n.to_string(), i, t))
        .chain(sh.devices.iter().enumerate().map(|(i, d)| (d.name().to_string(), i as u64 + 2, 8)));
    for (idx, (name, ino, typ)) in entries.enumerate().skip(r.offset as usize) {
        let head = DirentHead { ino, off: idx as u64 + 1, namelen: name.len() as u32, typ };
        let rec = (24 + name.len()).div_ceil(8) * 8;
        if out.len() + rec > r.size as usize {
            break;
        }
        out.extend_from_slice(head.as_bytes());
        out.extend_from_slice(name.as_bytes());
        out.resize(out.len().div_ceil(8) * 8, 0);
    }
    reply_raw(fd, u, 0, &[&out]);
}

fn read(fd: RawFd, slot: usize, sh: &Shared, u: u64, nodeid: u64, body: &[u8], scratch: &mut Vec<u8>) {
    let Some(r) = parse::<ReadIn>(body) else {
        return reply_err(fd, u, libc::EINVAL);
    };
    let Some(d) = sh.device(nodeid) else {
        return reply_err(fd, u, libc::EISDIR);
    };
    let len = (r.size as u64).min(d.size().saturating_sub(r.offset));
    if len == 0 {
        return reply_raw(fd, u, 0, &[]);
    }
    // The common case: the reply goes from the grant window to the kernel in one writev.
    let mut replied = false;
    scratch.clear();
    let res = d.read(slot, r.offset, len, |at, w| {
        if at == 0 && w.len() as u64 == len {
            let hdr = OutHeader { len: 16 + len as u32, error: 0, unique: u };
            let iov = [libc::iovec { iov_base: hdr.as_bytes().as_ptr() as *mut _, iov_len: 16 }, w.iovec()];
            // SAFETY: both iovecs are valid for the call (the window lives until the callback
            // returns); the kernel copies the data.
            unsafe { libc::writev(fd, iov.as_ptr(), 2) };
            replied = true;
        } else {
            let start = scratch.len();
            scratch.resize(start + w.len(), 0);
            w.copy_to(&mut scratch[start..]);
        }
    });
    match res {
        Ok(()) if replied => {}
        Ok(()) => reply_raw(fd, u, 0, &[scratch]),
        Err(e) => {
            sh.log_error("read", &e);
            reply_err(fd, u, e.errno());
        }
    }
}

fn write(fd: RawFd, slot: usize, sh: &Shared, u: u64, nodeid: u64, body: &[u8]) {
    let Some(w) = parse::<WriteIn>(body) else {
        return reply_err(fd, u, libc::EINVAL);
    };
    let Some(d) = sh.device(nodeid) else {
        return reply_err(fd, u, libc::EISDIR);
    };
    let data = &body[std::mem::size_of::<WriteIn>()..];
    if data.len() != w.size as usize {
        return reply_err(fd, u, libc::EINVAL);
    }
    if w.offset.checked_add(data.len() as u64).is_none_or(|end| end > d.size()) {
        return reply_err(fd, u, libc::ENOSPC);
    }
    let fua = w.flags as i32 & libc::O_DSYNC != 0;
    match d.write(slot, w.offset, data, fua) {
        Ok(()) => reply(fd, u, &WriteOut { size: w.size, padding: 0 }),
        Err(e) => {
            sh.log_error("write", &e);
            reply_err(fd, u, e.errno());
        }
    }
}

fn fallocate(fd: RawFd, slot: usize, sh: &Shared, u: u64, nodeid: u64, body: &[u8]) {
    let Some(f) = parse::<FallocateIn>(body) else {
        return reply_err(fd, u, libc::EINVAL);
    };
    let Some(d) = sh.device(nodeid) else {
        return reply_err(fd, u, libc::EISDIR);
    };
    if f.offset.checked_add(f.length).is_none_or(|end| end > d.size()) {
        return reply_err(fd, u, if f.mode & FALLOC_FL_KEEP_SIZE != 0 { libc::EINVAL } else { libc::ENOSPC });
    }
    let r = if f.mode == 0 || f.mode == FALLOC_FL_KEEP_SIZE {
        Ok(()) // allocation within a fixed-size device: nothing to do
    } else if f.mode & FALLOC_FL_PUNCH_HOLE != 0 && f.mode & FALLOC_FL_KEEP_SIZE != 0 {
        d.discard(slot, f.offset, f.length)
    } else if f.mode & FALLOC_FL_ZERO_RANGE != 0 {
        d.write_zeroes(slot, f.offset, f.length)
    } else {
        return reply_err(fd, u, libc::EOPNOTSUPP);
    };
    match r {
        Ok(()) => reply_err(fd, u, 0),
        Err(e) => {
            sh.log_error("fallocate", &e);
            reply_err(fd, u, e.errno())
        }
    }
}
