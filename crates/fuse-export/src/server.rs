//! Mounting, the choice of transport, and the `/dev/fuse` workers.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use bulkhead_client::Device;
use zerocopy::IntoBytes;

use crate::abi::*;
use crate::ops::{dispatch, Incoming, Io, IoKind, Node, Shared, Sink, Step, MAX_WRITE};
use crate::uring::{possible_cpus, Ended, RingQueue};

const BUF_SIZE: usize = MAX_WRITE + 64 * 1024;
const FUSE_DEV_IOC_CLONE: libc::c_ulong = 0x8004_e500;
/// The `fuse` module's switch for FUSE over io_uring.
pub const ENABLE_URING: &str = "/sys/module/fuse/parameters/enable_uring";

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
    /// FUSE over io_uring was required and is not available.
    #[error("FUSE over io_uring (fuse.io_uring = \"on\"): {0}")]
    Uring(String),
    /// A file of that name is exported already.
    #[error("the FUSE export has a file `{0}` already")]
    NameTaken(String),
    /// The file is open and its removal was not forced.
    #[error("its FUSE file {} is open {opens} time(s) (a loop device, a mount on one, or a program)", path.display())]
    Open {
        /// The file.
        path: PathBuf,
        /// Opens not yet released.
        opens: usize,
    },
}

/// Whether to carry requests over io_uring.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum UringMode {
    /// Never: `/dev/fuse` reads and writes.
    Off,
    /// When the kernel has it (switching the `fuse` module's `enable_uring` on if it can),
    /// else `/dev/fuse`.
    #[default]
    Auto,
    /// Always; mounting fails without it.
    On,
}

/// How the export is set up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FuseOptions {
    /// Threads reading `/dev/fuse` (which also carries what the rings do not).
    pub threads: usize,
    /// FUSE over io_uring.
    pub io_uring: UringMode,
    /// Requests each per-CPU ring holds (each entry has a 1 MiB buffer).
    pub queue_depth: usize,
    /// A keeper holds the session for the next `serve`: requests then go through
    /// `/dev/fuse`, whose taken requests the kernel sends again to a successor (FUSE over
    /// io_uring's are not; ARCHITECTURE.md, "When `serve` itself dies").
    pub kept: bool,
}

impl Default for FuseOptions {
    fn default() -> Self {
        FuseOptions { threads: 4, io_uring: UringMode::Auto, queue_depth: 16, kept: false }
    }
}

/// How requests reach the export.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Transport {
    /// Worker threads read requests from `/dev/fuse` and write replies to it.
    DevFuse {
        /// Worker threads.
        threads: usize,
        /// Why not io_uring, when it was asked for.
        why_not_uring: Option<String>,
    },
    /// FUSE over io_uring: a ring and a worker per CPU.
    IoUring {
        /// Rings (one per possible CPU).
        queues: usize,
        /// Requests each ring holds.
        depth: usize,
    },
}

impl std::fmt::Display for Transport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Transport::DevFuse { threads, why_not_uring: None } => write!(f, "/dev/fuse, {threads} threads"),
            Transport::DevFuse { threads, why_not_uring: Some(w) } => {
                write!(f, "/dev/fuse, {threads} threads (not io_uring: {w})")
            }
            Transport::IoUring { queues, depth } => write!(f, "io_uring, {queues} rings × {depth} requests"),
        }
    }
}

/// A mounted export and its workers. Dropping it unmounts (lazily if busy) and stops workers.
pub struct FuseExport {
    mountpoint: PathBuf,
    shared: Arc<Shared>,
    /// The session, for notifications (a duplicate of the first worker's descriptor).
    notify: Arc<OwnedFd>,
    workers: Vec<JoinHandle<()>>,
    rings: Vec<JoinHandle<Option<RingQueue>>>,
    transport: Transport,
    mounted: bool,
    /// A copy of every worker's session descriptor, for a keeper to hold.
    session: Vec<OwnedFd>,
}

/// `FUSE_NOTIFY_RESEND`: the kernel puts every request that a reader has taken and not
/// answered back on the queue, to be read again (Linux 6.9).
const FUSE_NOTIFY_RESEND: i32 = 7;

impl std::fmt::Debug for FuseExport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FuseExport").field("mountpoint", &self.mountpoint).field("transport", &self.transport).finish()
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

/// Why FUSE requests do not go over io_uring, in words for `status` and the log.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct NoUring(pub String);

/// Whether this kernel carries FUSE over io_uring, switching the module's parameter on if it
/// is off and this process may. `Err` says why not.
pub fn uring_ready() -> Result<(), NoUring> {
    match std::fs::read_to_string(ENABLE_URING) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            Err(NoUring("this kernel's fuse module has no io_uring support (no enable_uring parameter)".into()))
        }
        Err(e) => Err(NoUring(format!("cannot read {ENABLE_URING}: {e}"))),
        Ok(v) if v.trim() == "Y" || v.trim() == "1" => Ok(()),
        Ok(_) => match std::fs::write(ENABLE_URING, "1") {
            Ok(()) => {
                log::info!("switched FUSE over io_uring on ({ENABLE_URING})");
                Ok(())
            }
            Err(e) => Err(NoUring(format!("{ENABLE_URING} is off and cannot be switched on: {e}"))),
        },
    }
}

impl FuseExport {
    /// Mounts `mountpoint` (created if missing) and starts `threads` `/dev/fuse` workers serving
    /// `devices`, with FUSE over io_uring where the kernel has it.
    pub fn mount(mountpoint: &Path, devices: Vec<Arc<Device>>, threads: usize) -> Result<Self, FuseError> {
        Self::mount_with(mountpoint, devices, FuseOptions { threads, ..FuseOptions::default() })
    }

    /// Mounts `mountpoint` (created if missing) and serves `devices` as `opts` says.
    pub fn mount_with(mountpoint: &Path, devices: Vec<Arc<Device>>, opts: FuseOptions) -> Result<Self, FuseError> {
        let threads = opts.threads.max(1);
        let why_not = match opts.io_uring {
            _ if opts.kept => Some("a keeper holds the session, and a dead serve's io_uring requests are not sent again".into()),
            UringMode::Off => Some("switched off (fuse.io_uring = \"off\")".to_string()),
            UringMode::Auto => uring_ready().err().map(|e| e.0),
            UringMode::On => {
                uring_ready().map_err(|e| FuseError::Uring(e.0))?;
                None
            }
        };
        std::fs::create_dir_all(mountpoint).map_err(|source| FuseError::Sys {
            op: "create",
            path: mountpoint.display().to_string(),
            source,
        })?;
        let master = open_dev_fuse().map_err(|source| FuseError::Sys { op: "open", path: "/dev/fuse".into(), source })?;
        let opts_s = format!(
            "fd={},rootmode=40000,user_id=0,group_id=0,allow_other,default_permissions,max_read={MAX_WRITE}",
            master.as_raw_fd()
        );
        let target = CString::new(mountpoint.as_os_str().as_bytes()).expect("path without NUL");
        let opts_c = CString::new(opts_s).expect("no NUL");
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
        bulkhead_sys::install_kick_handler();
        let dup = |fd: &OwnedFd| fd.try_clone().map_err(|source| FuseError::Sys { op: "dup", path: "/dev/fuse".into(), source });
        let notify = Arc::new(dup(&master)?);
        let shared = Arc::new(Shared::new(devices, why_not.is_none()));
        let mut export = FuseExport {
            mountpoint: mountpoint.to_path_buf(),
            shared: shared.clone(),
            notify: notify.clone(),
            workers: vec![],
            rings: vec![],
            transport: Transport::DevFuse { threads, why_not_uring: why_not.clone() },
            mounted: true,
            session: Vec::new(),
        };
        let ring_fd = dup(&master)?;
        let mut fds = vec![master];
        for _ in 1..threads {
            let clone = open_dev_fuse().map_err(|source| FuseError::Sys { op: "open", path: "/dev/fuse".into(), source })?;
            let mut master_fd: u32 = fds[0].as_raw_fd() as u32;
            // SAFETY: the ioctl reads one u32 (the session's descriptor) from `master_fd`.
            if unsafe { libc::ioctl(clone.as_raw_fd(), FUSE_DEV_IOC_CLONE, &mut master_fd) } < 0 {
                return Err(sys("clone FUSE session of", mountpoint));
            }
            fds.push(clone);
        }
        export.start_workers(fds)?;
        let deadline = Instant::now() + Duration::from_secs(5);
        while !shared.initialized.load(Ordering::Acquire) {
            if Instant::now() > deadline {
                return Err(FuseError::InitTimeout(mountpoint.display().to_string()));
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        if why_not.is_none() {
            let started = if shared.uring_granted.load(Ordering::Acquire) {
                export.start_rings(ring_fd, opts.queue_depth.max(1))
            } else {
                Err(NoUring("the kernel did not accept it at INIT".to_string()))
            };
            match started {
                Ok(t) => export.transport = t,
                Err(e) if opts.io_uring == UringMode::On => return Err(FuseError::Uring(e.0)),
                Err(e) => export.transport = Transport::DevFuse { threads, why_not_uring: Some(e.0) },
            }
        }
        Ok(export)
    }

    /// Serves a session that a `serve` before this one mounted: `fds` are its `/dev/fuse`
    /// descriptors (the one it mounted with and its clones, as a keeper held them), `state`
    /// what [`keep_state`](Self::keep_state) last gave. The kernel knows the files by the node
    /// ids the state gives; every request the dead `serve` had taken and not answered is
    /// asked for again (`FUSE_NOTIFY_RESEND`), and a worker per descriptor serves them.
    pub fn adopt(mountpoint: &Path, devices: Vec<Arc<Device>>, fds: Vec<OwnedFd>, state: &str) -> Result<Self, FuseError> {
        let bad =
            |m: String| FuseError::Sys { op: "take over", path: mountpoint.display().to_string(), source: io::Error::other(m) };
        if fds.is_empty() {
            return Err(bad("no /dev/fuse descriptor was kept".into()));
        }
        let shared = Arc::new(Shared::adopt(devices, state).map_err(|e| bad(e.to_string()))?);
        bulkhead_sys::install_kick_handler();
        let notify =
            Arc::new(fds[0].try_clone().map_err(|source| FuseError::Sys { op: "dup", path: "/dev/fuse".into(), source })?);
        let mut export = FuseExport {
            mountpoint: mountpoint.to_path_buf(),
            shared,
            notify: notify.clone(),
            workers: vec![],
            rings: vec![],
            transport: Transport::DevFuse {
                threads: fds.len(),
                why_not_uring: Some("taken over from a serve that ended; a keeper holds the session".into()),
            },
            mounted: true,
            session: Vec::new(),
        };
        export.start_workers(fds)?;
        DevSink(notify.as_raw_fd()).reply(0, -FUSE_NOTIFY_RESEND, &[]);
        Ok(export)
    }

    /// Starts a `/dev/fuse` worker on each of `fds`, keeping a copy of each.
    fn start_workers(&mut self, fds: Vec<OwnedFd>) -> Result<(), FuseError> {
        for (slot, fd) in fds.into_iter().enumerate() {
            self.session.push(fd.try_clone().map_err(|source| FuseError::Sys { op: "dup", path: "/dev/fuse".into(), source })?);
            let sh = self.shared.clone();
            let handle = std::thread::Builder::new()
                .name(format!("fuse-{slot}"))
                .spawn(move || worker(fd, slot, sh))
                .map_err(|source| FuseError::Sys { op: "spawn worker for", path: "fuse".into(), source })?;
            self.workers.push(handle);
        }
        Ok(())
    }

    /// The session's `/dev/fuse` descriptors (the mounting one and its clones), for a keeper
    /// to hold: while it does, requests taken and not answered by a `serve` that dies stay
    /// with the kernel, to be sent again to the next.
    pub fn session_fds(&self) -> Vec<std::os::fd::BorrowedFd<'_>> {
        use std::os::fd::AsFd;
        self.session.iter().map(|fd| fd.as_fd()).collect()
    }

    /// Gives `keep` the files' state (which device each node id is, how often it is open)
    /// now and whenever it changes, for [`adopt`](Self::adopt) to read back.
    pub fn keep_state(&self, keep: impl Fn(String) + Send + Sync + 'static) {
        let _ = self.shared.keep.set(Box::new(keep));
        self.shared.save();
    }

    /// Stops the workers once each has answered the request in hand, and leaves the mount
    /// and the session to the keeper: requests that come meanwhile wait in the kernel for
    /// the next `serve` (an upgrade).
    pub fn release(mut self) {
        self.mounted = false;
        self.shared.stop.store(true, Ordering::Release);
        for w in std::mem::take(&mut self.workers) {
            bulkhead_sys::kick_until_finished(&w);
            let _ = w.join();
        }
        self.stop();
    }

    /// Starts a ring and its worker per possible CPU on the session `fuse`. Requests move to
    /// the rings once every CPU has one; until then (and if this fails) `/dev/fuse` carries them.
    fn start_rings(&mut self, fuse: OwnedFd, depth: usize) -> Result<Transport, NoUring> {
        let queues = possible_cpus();
        let (tx, rx) = std::sync::mpsc::channel();
        for qid in 0..queues {
            let fd = fuse.try_clone().map_err(|e| NoUring(format!("dup /dev/fuse: {e}")))?;
            let (sh, tx) = (self.shared.clone(), tx.clone());
            let spawned = std::thread::Builder::new().name(format!("fuse-ring-{qid}")).spawn(move || {
                // The kernel queues a request on the ring of the CPU it was issued from, so the
                // worker runs there too: it serves the request where it was made and is woken
                // there. Left free, a worker woken by the driver domain's doorbell was pulled
                // onto the domain's CPU, and at one thread of writes the two then shared a CPU
                // while the other idled (docs/bench/tuning.md, "Ring workers on their CPUs").
                // A CPU this process may not run on (offline, or outside a container's cpuset:
                // EINVAL) leaves its worker free; requests issued there are still served.
                match bulkhead_sys::pin_thread(qid) {
                    Err(e) if e.raw_os_error() != Some(libc::EINVAL) => {
                        log::warn!("fuse ring {qid}: not bound to CPU {qid} ({e}); its worker runs anywhere")
                    }
                    _ => {}
                }
                let mut q = match RingQueue::new(qid as u16, depth, fd).and_then(|mut q| q.start().map(|()| q)) {
                    Ok(q) => q,
                    Err(e) => {
                        let _ = tx.send(Err(format!("ring {qid}: {e}")));
                        return None;
                    }
                };
                let _ = tx.send(Ok(()));
                match q.serve(&sh) {
                    Ended::Stopped | Ended::Disconnected => {}
                    Ended::Failed(e) => {
                        log::warn!("fuse ring {qid} failed: {e}; requests issued on CPU {qid} stop being answered")
                    }
                }
                Some(q)
            });
            self.rings.push(spawned.map_err(|e| NoUring(format!("spawn ring worker: {e}")))?);
        }
        drop(tx);
        for _ in 0..queues {
            match rx.recv_timeout(Duration::from_secs(5)) {
                Ok(Ok(())) => {}
                Ok(Err(e)) => return Err(NoUring(e)),
                Err(_) => return Err(NoUring("a ring worker did not start within 5 s".into())),
            }
        }
        Ok(Transport::IoUring { queues, depth })
    }

    /// How requests reach the export.
    pub fn transport(&self) -> &Transport {
        &self.transport
    }

    /// Makes the kernel drop the cached pages of device `name`'s file, after the device's
    /// contents changed under it (a snapshot revert), so files kept open read the device again
    /// instead of their page cache. Returns whether there is such a file.
    pub fn invalidate(&self, name: &str) -> bool {
        let Some(nodeid) = self.shared.lookup(name.as_bytes()) else { return false };
        inval_inode(&self.notify, nodeid);
        true
    }

    /// Adds a file for `dev`. Refused if a file of that name is there.
    pub fn add(&self, dev: Arc<Device>) -> Result<(), FuseError> {
        let name = dev.name().to_string();
        self.shared.change(|t| {
            if t.iter().flatten().any(|n| n.dev.name() == name) {
                return Err(FuseError::NameTaken(name.clone()));
            }
            t.push(Some(Arc::new(Node { dev, opens: std::sync::atomic::AtomicUsize::new(0) })));
            Ok(())
        })?;
        self.shared.save();
        // A lookup that failed before may be cached as missing: forget it.
        inval_entry(&self.notify, name.as_bytes());
        Ok(())
    }

    /// How many times device `name`'s file is open (by a loop device, a mount on one, a
    /// program); `None` if there is no such file.
    pub fn opens(&self, name: &str) -> Option<usize> {
        let nodeid = self.shared.lookup(name.as_bytes())?;
        self.shared.node(nodeid).map(|n| n.opens.load(Ordering::Acquire))
    }

    /// Removes device `name`'s file and hands its device back (`None`: there was no such
    /// file). Refused while it is open unless `force`: the users' requests then fail with EIO.
    pub fn remove(&self, name: &str, force: bool) -> Result<Option<Arc<Device>>, FuseError> {
        let removed = self.shared.change(|t| {
            let Some(i) = t.iter().position(|n| n.as_ref().is_some_and(|n| n.dev.name() == name)) else {
                return Ok(None);
            };
            let opens = t[i].as_ref().map_or(0, |n| n.opens.load(Ordering::Acquire));
            if opens > 0 && !force {
                return Err(FuseError::Open { path: self.mountpoint.join(name), opens });
            }
            Ok(t[i].take().map(|node| (i as u64 + 2, node.dev.clone())))
        })?;
        let Some((nodeid, dev)) = removed else { return Ok(None) };
        self.shared.save();
        inval_entry(&self.notify, name.as_bytes());
        inval_inode(&self.notify, nodeid);
        Ok(Some(dev))
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
                log::info!("{} is busy ({e}); detaching it lazily", self.mountpoint.display());
                // SAFETY: as above.
                unsafe { libc::umount2(target.as_ptr(), libc::MNT_DETACH) };
                clean = false;
            }
            self.mounted = false;
        }
        self.shared.stop.store(true, Ordering::Release);
        // The mount point was ours to create; leave no empty directory behind.
        let _ = std::fs::remove_dir(&self.mountpoint);
        for w in std::mem::take(&mut self.workers) {
            bulkhead_sys::kick_until_finished(&w);
            let _ = w.join();
        }
        for w in std::mem::take(&mut self.rings) {
            bulkhead_sys::kick_until_finished(&w);
            // The ring and its buffers go only now, with the thread that the kernel copied
            // requests for gone.
            drop(w.join());
        }
        clean
    }
}

impl Drop for FuseExport {
    fn drop(&mut self) {
        if self.mounted || !self.workers.is_empty() || !self.rings.is_empty() {
            self.stop();
        }
    }
}

/// Replies written to `/dev/fuse`.
struct DevSink(RawFd);

impl Sink for DevSink {
    fn reply(&mut self, unique: u64, errno: i32, parts: &[&[u8]]) {
        let len = 16 + parts.iter().map(|p| p.len()).sum::<usize>();
        let hdr = OutHeader { len: len as u32, error: -errno, unique };
        let mut iov = [libc::iovec { iov_base: std::ptr::null_mut(), iov_len: 0 }; 4];
        iov[0] = libc::iovec { iov_base: hdr.as_bytes().as_ptr() as *mut _, iov_len: 16 };
        for (i, p) in parts.iter().enumerate() {
            iov[i + 1] = libc::iovec { iov_base: p.as_ptr() as *mut _, iov_len: p.len() };
        }
        // SAFETY: every iovec points at memory valid for the call; the kernel copies it.
        unsafe { libc::writev(self.0, iov.as_ptr(), 1 + parts.len() as i32) };
    }
}

/// Serves `devices` on `fd` with one worker on the calling thread, until the session ends
/// (DESTROY, the file system unmounted, or end of file). `fd` is a FUSE session's descriptor
/// mounted elsewhere and handed over, or anything that gives one request per `read` and takes
/// one reply per `write` (a `SOCK_SEQPACKET` socket, as the fuzz target drives it). FUSE over
/// io_uring is not offered.
pub fn serve_session(fd: OwnedFd, devices: Vec<Arc<Device>>) {
    worker(fd, 0, Arc::new(Shared::new(devices, false)));
}

fn worker(fd: OwnedFd, slot: usize, sh: Arc<Shared>) {
    let mut buf = vec![0u8; BUF_SIZE];
    let mut scratch = Vec::new();
    let mut sink = DevSink(fd.as_raw_fd());
    // A copy of the files, taken again when a device comes or goes.
    let (mut version, mut files) = (sh.version.load(Ordering::Acquire), sh.table());
    while !sh.stop.load(Ordering::Acquire) {
        // SAFETY: reads into our own buffer of BUF_SIZE bytes.
        let n = unsafe { libc::read(fd.as_raw_fd(), buf.as_mut_ptr().cast(), BUF_SIZE) };
        if n < 0 {
            match io::Error::last_os_error().raw_os_error() {
                Some(libc::EINTR) | Some(libc::EAGAIN) | Some(libc::ENOENT) => continue,
                Some(libc::ENODEV) => break, // unmounted
                _ => {
                    log::warn!("fuse worker {slot}: read: {}", io::Error::last_os_error());
                    break;
                }
            }
        }
        if n == 0 {
            break; // end of file: `/dev/fuse` never reads 0, a socket's peer hung up
        }
        let Some(req) = Incoming::from_dev(&buf[..n as usize]) else { continue };
        let now = sh.version.load(Ordering::Acquire);
        if now != version {
            (version, files) = (now, sh.table());
        }
        match dispatch(&sh, &files, &req, &mut sink) {
            Step::Done => {}
            Step::Stop => break,
            Step::Io(io) => run_io(&sh, &files, slot, &io, req.payload, &mut sink, &mut scratch),
        }
    }
}

/// Runs one request to the end on the queue of `slot` and answers it.
fn run_io(
    sh: &Shared,
    files: &[Option<Arc<crate::ops::Node>>],
    slot: usize,
    io: &Io,
    payload: &[u8],
    sink: &mut DevSink,
    scratch: &mut Vec<u8>,
) {
    let Some(node) = sh.node_in(files, io.dev as u64 + 2) else {
        // Removed since the request was looked at.
        return io.reply(sh, sink, Err(bulkhead_client::IoError::Unavailable("device removed".into())));
    };
    let d = &node.dev;
    let result = match io.kind {
        IoKind::Read { offset, into: len } => return read(sh, d, slot, io, (offset, len), sink.0, scratch),
        IoKind::Write { offset, from: len, fua } => d.write(slot, offset, &payload[..len as usize], fua),
        IoKind::Flush => d.flush(slot),
        IoKind::Discard { offset, len } => d.discard(slot, offset, len),
        IoKind::WriteZeroes { offset, len } => d.write_zeroes(slot, offset, len),
    };
    io.reply(sh, sink, result);
}

/// A read answered straight from the grant window with one `writev` when it comes in one
/// piece; split reads are gathered first.
fn read(sh: &Shared, d: &Device, slot: usize, io: &Io, (offset, len): (u64, u64), fd: RawFd, scratch: &mut Vec<u8>) {
    let u = io.unique;
    let mut replied = false;
    scratch.clear();
    let res = d.read(slot, offset, len, |at, w| {
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
        Ok(()) => DevSink(fd).reply(u, 0, &[scratch]),
        Err(e) => {
            sh.log_error("read", &e);
            DevSink(fd).error(u, e.errno());
        }
    }
}

/// Makes the kernel drop the cached pages of node `nodeid` (FUSE_NOTIFY_INVAL_INODE: the
/// inode, offset 0, length 0: everything).
fn inval_inode(notify: &OwnedFd, nodeid: u64) {
    let mut body = [0u8; 24];
    body[..8].copy_from_slice(&nodeid.to_ne_bytes());
    DevSink(notify.as_raw_fd()).reply(0, -FUSE_NOTIFY_INVAL_INODE, &[&body]);
}

/// Makes the kernel forget what it knows of the name `name` in the root (FUSE_NOTIFY_INVAL_ENTRY:
/// the parent, the name's length, flags, then the name and a NUL).
fn inval_entry(notify: &OwnedFd, name: &[u8]) {
    let mut body = Vec::with_capacity(16 + name.len() + 1);
    body.extend_from_slice(&FUSE_ROOT_ID.to_ne_bytes());
    body.extend_from_slice(&(name.len() as u32).to_ne_bytes());
    body.extend_from_slice(&0u32.to_ne_bytes());
    body.extend_from_slice(name);
    body.push(0);
    DevSink(notify.as_raw_fd()).reply(0, -FUSE_NOTIFY_INVAL_ENTRY, &[&body]);
}
