//! The plain system calls several of bulkhead's crates need, each wrapped once here with its
//! safety argument, so the supervisor and others can `forbid(unsafe_code)` (crosvm's `base` is
//! the model). Shared memory has its own crate (`bulkhead-shmem`), doorbells theirs.
#![deny(missing_docs)]

pub mod epoll;
pub mod eventfd;
pub mod memfd;
pub mod pkey;
pub mod process;
pub mod seccomp_notify;
pub mod thp;
pub mod uffd;
pub mod uring;

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

/// A pipe, both ends close-on-exec: (read end, write end).
pub fn pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut p = [0; 2];
    // SAFETY: `p` is a valid array of two ints for pipe2 to fill.
    if unsafe { libc::pipe2(p.as_mut_ptr(), libc::O_CLOEXEC) } < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: pipe2 returned two fresh descriptors, owned from here on.
    Ok(unsafe { (OwnedFd::from_raw_fd(p[0]), OwnedFd::from_raw_fd(p[1])) })
}

/// `pidfd_open(2)`: a descriptor that turns readable when process `pid` exits.
pub fn pidfd_open(pid: u32) -> io::Result<OwnedFd> {
    // SAFETY: a system call with integer arguments only.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::c_int, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: pidfd_open returned a fresh descriptor, owned from here on.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// Size in bytes of a regular file or a block device, and whether it is a block device.
pub fn storage_size(fd: BorrowedFd<'_>) -> io::Result<(u64, bool)> {
    let meta = std::fs::File::from(fd.try_clone_to_owned()?).metadata()?;
    use std::os::unix::fs::FileTypeExt;
    if meta.file_type().is_block_device() {
        // BLKGETSIZE64 = _IOR(0x12, 114, size_t)
        const BLKGETSIZE64: libc::c_ulong = 0x8008_1272;
        let mut size: u64 = 0;
        // SAFETY: BLKGETSIZE64 writes one u64 into `size`, which outlives the call.
        if unsafe { libc::ioctl(fd.as_raw_fd(), BLKGETSIZE64, &mut size) } < 0 {
            return Err(io::Error::last_os_error());
        }
        return Ok((size, true));
    }
    if !meta.file_type().is_file() {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "not a regular file or block device"));
    }
    Ok((meta.len(), false))
}

/// The name of the file system holding `path` if it keeps its files in memory: tmpfs
/// (`/dev/shm`, many `/tmp`s), ramfs or hugetlbfs, whose reads and writes are memory copies
/// that never wait for a device; `None` for any other.
pub fn in_memory_fs(path: &std::path::Path) -> io::Result<Option<&'static str>> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path holds a NUL byte"))?;
    // SAFETY: all-zero bytes are a valid `statfs`, which the call then fills.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a NUL-terminated path and `st` a writable statfs, both outliving the call.
    if unsafe { libc::statfs(c.as_ptr(), &mut st) } < 0 {
        return Err(io::Error::last_os_error());
    }
    // The magic numbers of linux/magic.h.
    Ok(match st.f_type as u64 {
        0x0102_1994 => Some("tmpfs"),
        0x8584_58f6 => Some("ramfs"),
        0x9584_58f6 => Some("hugetlbfs"),
        _ => None,
    })
}

/// Waits until one of `fds` is ready or `timeout_ms` passes (negative: no limit); returns how
/// many are ready (each entry's `revents` says which). An interrupted wait counts as none ready.
pub fn poll(fds: &mut [libc::pollfd], timeout_ms: i32) -> io::Result<usize> {
    // SAFETY: `fds` is a valid, exclusively borrowed array of pollfd of the length passed.
    let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout_ms) };
    if n < 0 {
        let e = io::Error::last_os_error();
        return if e.kind() == io::ErrorKind::Interrupted { Ok(0) } else { Err(e) };
    }
    Ok(n as usize)
}

/// Makes `fd`'s reads and writes return `WouldBlock` instead of waiting (`O_NONBLOCK`).
pub fn set_nonblocking(fd: BorrowedFd<'_>) -> io::Result<()> {
    // SAFETY: F_GETFL only reads the flags of an open descriptor (borrowed for the call).
    let fl = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFL) };
    // SAFETY: F_SETFL sets the status flags of the same descriptor.
    if fl < 0 || unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFL, fl | libc::O_NONBLOCK) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Receives what `sock` holds now into `buf`, without waiting: `Ok(0)` is the end of the
/// stream, `WouldBlock` nothing there yet.
pub fn recv_now(sock: BorrowedFd<'_>, buf: &mut [u8]) -> io::Result<usize> {
    // SAFETY: receives into `buf`, which the caller lends mutably for its length.
    let n = unsafe { libc::recv(sock.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), libc::MSG_DONTWAIT) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(n as usize)
}

/// Sends what `sock` takes now of `buf`, without waiting (`WouldBlock` when it takes none); a
/// peer that has gone gives `BrokenPipe`, never SIGPIPE.
pub fn send_now(sock: BorrowedFd<'_>, buf: &[u8]) -> io::Result<usize> {
    // SAFETY: sends from `buf`, which the caller lends for its length.
    let n = unsafe { libc::send(sock.as_raw_fd(), buf.as_ptr().cast(), buf.len(), libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(n as usize)
}

/// Sends what `sock` takes now of `bufs`, in order, without waiting (`WouldBlock` when it
/// takes none); a peer that has gone gives `BrokenPipe`, never SIGPIPE.
pub fn send_vectored_now(sock: BorrowedFd<'_>, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
    // SAFETY: an all-zero msghdr is valid (no name, no control data).
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    // `IoSlice` is ABI-compatible with `iovec` (std documents it); `sendmsg` only reads them.
    msg.msg_iov = bufs.as_ptr().cast_mut().cast();
    msg.msg_iovlen = bufs.len() as _;
    // SAFETY: `msg` points at `bufs`, which the caller lends for the call, and at nothing else.
    let n = unsafe { libc::sendmsg(sock.as_raw_fd(), &msg, libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(n as usize)
}

/// Which of a socket's time limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SocketTimeout {
    /// `SO_RCVTIMEO`: a read that waits longer fails with `WouldBlock`.
    Read,
    /// `SO_SNDTIMEO`: likewise a write.
    Write,
}

/// Sets a socket's time limit (`None`: none).
pub fn set_socket_timeout(sock: BorrowedFd<'_>, which: SocketTimeout, limit: Option<std::time::Duration>) -> io::Result<()> {
    let tv = match limit {
        Some(d) => libc::timeval { tv_sec: d.as_secs() as libc::time_t, tv_usec: d.subsec_micros() as libc::suseconds_t },
        None => libc::timeval { tv_sec: 0, tv_usec: 0 },
    };
    let opt = match which {
        SocketTimeout::Read => libc::SO_RCVTIMEO,
        SocketTimeout::Write => libc::SO_SNDTIMEO,
    };
    let len = std::mem::size_of::<libc::timeval>() as libc::socklen_t;
    // SAFETY: setsockopt reads one timeval, which outlives the call.
    if unsafe { libc::setsockopt(sock.as_raw_fd(), libc::SOL_SOCKET, opt, (&tv as *const libc::timeval).cast(), len) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Sends TCP segments at once (`TCP_NODELAY`); a unix socket refuses it harmlessly.
pub fn set_nodelay(sock: BorrowedFd<'_>) -> io::Result<()> {
    let one: libc::c_int = 1;
    let len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: setsockopt reads one int, which outlives the call.
    if unsafe {
        libc::setsockopt(sock.as_raw_fd(), libc::IPPROTO_TCP, libc::TCP_NODELAY, (&one as *const libc::c_int).cast(), len)
    } < 0
    {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Shuts both directions of `sock` down: a thread blocked on it wakes.
pub fn shutdown(sock: BorrowedFd<'_>) -> io::Result<()> {
    // SAFETY: a system call with integer arguments only, on a socket the caller holds open.
    if unsafe { libc::shutdown(sock.as_raw_fd(), libc::SHUT_RDWR) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Takes the next connection of a listening socket (close-on-exec); the peer's address is not
/// wanted.
pub fn accept(listener: BorrowedFd<'_>) -> io::Result<OwnedFd> {
    // SAFETY: accept4 with no address buffer on a socket the caller holds open.
    let fd = unsafe { libc::accept4(listener.as_raw_fd(), std::ptr::null_mut(), std::ptr::null_mut(), libc::SOCK_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: accept4 returned a fresh descriptor, owned from here on.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Takes an exclusive lock on `file` without waiting: `Ok(false)` if another holds it.
pub fn lock_exclusive(file: BorrowedFd<'_>) -> io::Result<bool> {
    // SAFETY: a system call with integer arguments only, on a descriptor the caller holds open.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } < 0 {
        let e = io::Error::last_os_error();
        return if e.raw_os_error() == Some(libc::EWOULDBLOCK) { Ok(false) } else { Err(e) };
    }
    Ok(true)
}

/// Gives the file (a socket) at `path` to group `gid` with mode `0660`: its owner and the
/// group's members may use it, nobody else.
pub fn share_with_group(path: &std::path::Path, gid: u32) -> io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::os::unix::fs::chown(path, None, Some(gid))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o660))
}

/// Detaches the mount at `path` (`umount2(MNT_DETACH)`): it is gone from the tree at once, and
/// released when its last user lets go.
pub fn detach_mount(path: &std::path::Path) -> io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path holds a NUL byte"))?;
    // SAFETY: `c` is a NUL-terminated path that outlives the call.
    if unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Tells the kernel the cached pages of `file` are not needed (`POSIX_FADV_DONTNEED`).
pub fn drop_cached_pages(file: BorrowedFd<'_>) -> io::Result<()> {
    // SAFETY: a system call with integer arguments only, on a descriptor the caller holds open.
    let r = unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    if r != 0 {
        return Err(io::Error::from_raw_os_error(r));
    }
    Ok(())
}

/// Monotonic nanoseconds (`CLOCK_MONOTONIC`, through the vDSO: ~20 ns).
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes one timespec, which outlives the call.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// How many clock ticks make a second, as /proc counts CPU time (`_SC_CLK_TCK`).
pub fn clock_ticks_per_second() -> u64 {
    // SAFETY: sysconf reads a system value and touches no memory of ours.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if t > 0 {
        t as u64
    } else {
        100
    }
}

/// CPUs online (`_SC_NPROCESSORS_ONLN`), at least 1.
pub fn cpus_online() -> usize {
    // SAFETY: sysconf reads a system value and touches no memory of ours.
    let n = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
    n.max(1) as usize
}

/// Sends signal `sig` to process `pid` (`kill(2)`). A process that is gone is not an error.
pub fn signal(pid: u32, sig: libc::c_int) -> io::Result<()> {
    let pid = libc::pid_t::try_from(pid).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "pid out of range"))?;
    // SAFETY: a system call with integer arguments only.
    if unsafe { libc::kill(pid, sig) } < 0 {
        let e = io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::ESRCH) {
            return Err(e);
        }
    }
    Ok(())
}

/// The caller's effective user id.
pub fn euid() -> u32 {
    // SAFETY: geteuid cannot fail and touches no memory.
    unsafe { libc::geteuid() }
}

/// Raises this process's soft limit on open descriptors to its hard limit (a `serve` of many
/// devices holds many); returns the limit now in force.
pub fn raise_open_files_limit() -> io::Result<u64> {
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes one rlimit, which outlives the call.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } < 0 {
        return Err(io::Error::last_os_error());
    }
    if lim.rlim_cur < lim.rlim_max {
        lim.rlim_cur = lim.rlim_max;
        // SAFETY: setrlimit reads one rlimit, which outlives the call.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) } < 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(lim.rlim_cur)
}

/// CPU time the calling thread has used, ns.
pub fn thread_cpu_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes one timespec, which outlives the call.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Restricts the calling thread to CPU `cpu`.
pub fn pin_thread(cpu: usize) -> io::Result<()> {
    // SAFETY: cpu_set_t is plain bits; all zeros is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    if cpu >= 8 * std::mem::size_of::<libc::cpu_set_t>() {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("CPU {cpu} is beyond the affinity mask")));
    }
    // SAFETY: `cpu` is within the set, checked above.
    unsafe { libc::CPU_SET(cpu, &mut set) };
    // SAFETY: the set outlives the call, which reads it; pid 0 is the calling thread.
    if unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Takes ownership of descriptor `fd`, inherited at exec for this purpose; fails if it is not
/// open.
///
/// # Safety
/// `fd` must be this process's to own (inherited for it, used by nothing else) and claimed once.
pub unsafe fn claim_inherited(fd: RawFd) -> io::Result<OwnedFd> {
    // SAFETY: F_GETFD only reads the descriptor's flags.
    if fd < 3 || unsafe { libc::fcntl(fd, libc::F_GETFD) } < 0 {
        return Err(io::Error::new(io::ErrorKind::NotFound, format!("descriptor {fd} is not open")));
    }
    // SAFETY: the caller guarantees the descriptor is this process's alone.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// `fd` moved to the lowest free number at `min` or above, close-on-exec (the old number is
/// closed): out of the way of descriptors a process is about to be handed by number.
pub fn move_above(fd: OwnedFd, min: RawFd) -> io::Result<OwnedFd> {
    // SAFETY: duplicates a descriptor `fd` owns.
    let high = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_DUPFD_CLOEXEC, min) };
    if high < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fcntl returned a fresh descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(high) })
}

/// A connected pair of sequenced-packet unix sockets, both ends close-on-exec: each message
/// arrives whole or not at all, with the descriptors sent along with it.
pub fn seqpacket_pair() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut p = [0; 2];
    // SAFETY: `p` is a valid array of two ints for socketpair to fill.
    if unsafe { libc::socketpair(libc::AF_UNIX, libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC, 0, p.as_mut_ptr()) } < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: socketpair returned two fresh descriptors, owned from here on.
    Ok(unsafe { (OwnedFd::from_raw_fd(p[0]), OwnedFd::from_raw_fd(p[1])) })
}

/// The process and user at the other end of a connected unix socket (`SO_PEERCRED`, as of
/// when it connected).
pub fn peer_credentials(sock: BorrowedFd<'_>) -> io::Result<(i32, u32)> {
    peer_ucred(sock).map(|(pid, uid, _)| (pid, uid))
}

/// The process, user and group at the other end of a connected unix socket (`SO_PEERCRED`).
pub fn peer_ucred(sock: BorrowedFd<'_>) -> io::Result<(i32, u32, u32)> {
    // SAFETY: ucred is plain data filled in by getsockopt.
    let mut cred: libc::ucred = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` and `len` are valid out pointers of the sizes given for the call.
    let rc = unsafe {
        libc::getsockopt(sock.as_raw_fd(), libc::SOL_SOCKET, libc::SO_PEERCRED, (&mut cred as *mut libc::ucred).cast(), &mut len)
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok((cred.pid, cred.uid, cred.gid))
}

/// Most descriptors one message carries.
pub const MAX_FDS: usize = 64;

/// Room for the control message of [`MAX_FDS`] descriptors (a 16-byte header, then the ints).
const CMSG_ROOM: usize = 16 + MAX_FDS * std::mem::size_of::<RawFd>();

#[repr(C, align(8))]
struct Control([u8; CMSG_ROOM]);

/// Sends `data` as one message on the unix socket `sock`, with `fd` alongside it
/// (`SCM_RIGHTS`): the receiver gets its own descriptor of the same open file. Never blocks
/// and never raises SIGPIPE: a full socket is `WouldBlock`, a closed peer `BrokenPipe`.
pub fn send_with_fd(sock: BorrowedFd<'_>, data: &[u8], fd: BorrowedFd<'_>) -> io::Result<()> {
    send_with_fds(sock, data, &[fd], false)
}

/// Sends `data` on the unix socket `sock` with `fds` alongside it (`SCM_RIGHTS`, at most
/// [`MAX_FDS`]): the receiver gets its own descriptors of the same open files, with the
/// first byte of `data`. Never raises SIGPIPE (a closed peer is `BrokenPipe`); `wait`: block
/// while the socket is full, else that is `WouldBlock`. A part sent is `WriteZero`.
pub fn send_with_fds(sock: BorrowedFd<'_>, data: &[u8], fds: &[BorrowedFd<'_>], wait: bool) -> io::Result<()> {
    let raw: Vec<RawFd> = fds.iter().map(|fd| fd.as_raw_fd()).collect();
    send_with_raw_fds(sock, data, &raw, wait)
}

/// [`send_with_fds`] with descriptors given by number: the caller keeps each open for the
/// duration of the call (one that is not open fails the send with `EBADF`).
pub fn send_with_raw_fds(sock: BorrowedFd<'_>, data: &[u8], fds: &[RawFd], wait: bool) -> io::Result<()> {
    if fds.len() > MAX_FDS || data.is_empty() {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "no data, or more descriptors than one message carries"));
    }
    let mut control = Control([0; CMSG_ROOM]);
    let mut iov = libc::iovec { iov_base: data.as_ptr().cast_mut().cast(), iov_len: data.len() };
    // SAFETY: msghdr is plain data; every field the kernel reads is set below.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    if !fds.is_empty() {
        let ints = std::mem::size_of_val(fds) as u32;
        msg.msg_control = control.0.as_mut_ptr().cast();
        // SAFETY: CMSG_SPACE only computes a length.
        msg.msg_controllen = unsafe { libc::CMSG_SPACE(ints) } as usize;
        debug_assert!(msg.msg_controllen <= CMSG_ROOM);
        // SAFETY: the control buffer is aligned and large enough for one header and
        // `fds.len()` ints (at most MAX_FDS), so CMSG_FIRSTHDR is non-null and the writes
        // through it and CMSG_DATA stay inside it.
        unsafe {
            let cmsg = libc::CMSG_FIRSTHDR(&msg);
            (*cmsg).cmsg_level = libc::SOL_SOCKET;
            (*cmsg).cmsg_type = libc::SCM_RIGHTS;
            (*cmsg).cmsg_len = libc::CMSG_LEN(ints) as usize;
            let data = libc::CMSG_DATA(cmsg).cast::<RawFd>();
            for (i, fd) in fds.iter().enumerate() {
                std::ptr::write_unaligned(data.add(i), *fd);
            }
        }
    }
    let flags = libc::MSG_NOSIGNAL | if wait { 0 } else { libc::MSG_DONTWAIT };
    let n = loop {
        // SAFETY: `msg` points at `iov` (over `data`) and `control`, all of which outlive the call.
        let n = unsafe { libc::sendmsg(sock.as_raw_fd(), &msg, flags) };
        if n >= 0 {
            break n as usize;
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    };
    if n != data.len() {
        return Err(io::Error::new(io::ErrorKind::WriteZero, "message sent in part"));
    }
    Ok(())
}

/// Receives one message from the unix socket `sock` into `buf`, without blocking (`Ok(None)`
/// when none waits): its length (0 when the peer has closed) and the first descriptor sent
/// with it, close-on-exec. Any further descriptors are closed; a message longer than `buf` is
/// `InvalidData`, as is one whose descriptors did not fit.
pub fn recv_with_fd(sock: BorrowedFd<'_>, buf: &mut [u8]) -> io::Result<Option<(usize, Option<OwnedFd>)>> {
    Ok(recv_with_fds(sock, buf, false)?.map(|(n, fds)| (n, fds.into_iter().next())))
}

/// Receives from the unix socket `sock` into `buf` (one message on a datagram or seqpacket
/// socket; what has arrived, up to `buf`, on a stream) and the descriptors sent with it
/// (close-on-exec, at most [`MAX_FDS`]). `wait`: block until something comes, else `Ok(None)`
/// when nothing waits. A length of 0 means the peer has closed. A message longer than `buf`
/// (datagram, seqpacket) is `InvalidData`, as is one whose descriptors did not fit (those
/// that did are closed).
pub fn recv_with_fds(sock: BorrowedFd<'_>, buf: &mut [u8], wait: bool) -> io::Result<Option<(usize, Vec<OwnedFd>)>> {
    let mut control = Control([0; CMSG_ROOM]);
    let mut iov = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() };
    // SAFETY: msghdr is plain data; every field the kernel reads is set below.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.0.as_mut_ptr().cast();
    msg.msg_controllen = CMSG_ROOM;
    let flags = libc::MSG_CMSG_CLOEXEC | if wait { 0 } else { libc::MSG_DONTWAIT };
    let n = loop {
        // SAFETY: `msg` points at `iov` (over `buf`) and `control`, all of which outlive the call
        // and are writable for the lengths given.
        let n = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, flags) };
        if n >= 0 {
            break n as usize;
        }
        let e = io::Error::last_os_error();
        match e.kind() {
            io::ErrorKind::Interrupted => continue,
            io::ErrorKind::WouldBlock if !wait => return Ok(None),
            _ => return Err(e),
        }
    };
    let mut fds = Vec::new();
    // SAFETY: the kernel set msg_controllen to what it wrote into `control`; CMSG_FIRSTHDR and
    // CMSG_NXTHDR walk only within it, and a header of SCM_RIGHTS carries ints after it.
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
        while !cmsg.is_null() {
            if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(cmsg);
                let count = ((*cmsg).cmsg_len - (data as usize - cmsg as usize)) / std::mem::size_of::<RawFd>();
                for i in 0..count {
                    let raw = std::ptr::read_unaligned(data.cast::<RawFd>().add(i));
                    // Each received descriptor is this process's own from here on.
                    fds.push(OwnedFd::from_raw_fd(raw));
                }
            }
            cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
        }
    }
    if msg.msg_flags & libc::MSG_TRUNC != 0 {
        return Err(io::Error::new(io::ErrorKind::InvalidData, "message longer than expected"));
    }
    if msg.msg_flags & libc::MSG_CTRUNC != 0 {
        return Err(io::Error::new(io::ErrorKind::InvalidData, "more descriptors than expected"));
    }
    Ok(Some((n, fds)))
}

/// Connects `sock` to `to`: `Ok` once connected; a non-blocking socket gives `EINPROGRESS`
/// while the connection is under way.
pub fn connect_nonblocking(sock: BorrowedFd<'_>, to: &std::net::SocketAddr) -> io::Result<()> {
    // SAFETY: zeroed sockaddr_storage is a valid value; it is filled below for the family.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let len = match to {
        std::net::SocketAddr::V4(a) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: a.port().to_be(),
                sin_addr: libc::in_addr { s_addr: u32::from_ne_bytes(a.ip().octets()) },
                sin_zero: [0; 8],
            };
            // SAFETY: sockaddr_storage is larger than sockaddr_in and suitably aligned.
            unsafe { std::ptr::write((&mut ss as *mut libc::sockaddr_storage).cast(), sin) };
            std::mem::size_of::<libc::sockaddr_in>()
        }
        std::net::SocketAddr::V6(a) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: a.port().to_be(),
                sin6_flowinfo: a.flowinfo(),
                sin6_addr: libc::in6_addr { s6_addr: a.ip().octets() },
                sin6_scope_id: a.scope_id(),
            };
            // SAFETY: sockaddr_storage is larger than sockaddr_in6 and suitably aligned.
            unsafe { std::ptr::write((&mut ss as *mut libc::sockaddr_storage).cast(), sin6) };
            std::mem::size_of::<libc::sockaddr_in6>()
        }
    };
    // SAFETY: a valid address of the length given.
    if unsafe { libc::connect(sock.as_raw_fd(), (&ss as *const libc::sockaddr_storage).cast(), len as libc::socklen_t) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// A new TCP socket of `family` (`AF_INET` or `AF_INET6`), close-on-exec.
pub fn tcp_socket(family: libc::c_int, nonblocking: bool) -> io::Result<OwnedFd> {
    let flags = libc::SOCK_CLOEXEC | if nonblocking { libc::SOCK_NONBLOCK } else { 0 };
    // SAFETY: plain socket creation.
    let fd = unsafe { libc::socket(family, libc::SOCK_STREAM | flags, libc::IPPROTO_TCP) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a new descriptor, ours alone.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Moves the calling thread (and the threads and processes it starts afterwards) into the
/// network namespace at `path` (`/run/netns/NAME`).
pub fn enter_netns(path: &std::path::Path) -> io::Result<()> {
    let f = std::fs::File::open(path)?;
    // SAFETY: plain setns on a namespace file we hold open.
    if unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::os::fd::AsFd;

    #[test]
    fn pipe_carries_bytes_and_poll_sees_them() {
        let (r, w) = pipe().unwrap();
        let mut pfd = [libc::pollfd { fd: r.as_raw_fd(), events: libc::POLLIN, revents: 0 }];
        assert_eq!(poll(&mut pfd, 0).unwrap(), 0);
        std::fs::File::from(w).write_all(b"x").unwrap();
        assert_eq!(poll(&mut pfd, 1000).unwrap(), 1);
        let mut b = [0u8; 1];
        std::fs::File::from(r).read_exact(&mut b).unwrap();
        assert_eq!(&b, b"x");
    }

    #[test]
    fn in_memory_fs_agrees_with_the_mount_table() {
        let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap();
        let fstype = |dir: &str| mounts.lines().map(|l| l.split(' ').collect::<Vec<_>>()).find(|f| f[1] == dir).map(|f| f[2]);
        assert_eq!(in_memory_fs(std::path::Path::new("/proc")).unwrap(), None);
        if let Some(t) = fstype("/dev/shm") {
            let expect = ["tmpfs", "ramfs", "hugetlbfs"].into_iter().find(|m| *m == t);
            assert_eq!(in_memory_fs(std::path::Path::new("/dev/shm/")).unwrap(), expect);
        }
        let gone = in_memory_fs(std::path::Path::new("/nonexistent/bulkhead")).unwrap_err();
        assert_eq!(gone.kind(), io::ErrorKind::NotFound);
    }

    #[test]
    fn pidfd_of_ourselves_opens_and_storage_size_reads_a_file() {
        assert!(pidfd_open(std::process::id()).is_ok());
        let path = std::env::temp_dir().join(format!("bulkhead-sys-{}", std::process::id()));
        let f = std::fs::File::create(&path).unwrap();
        f.set_len(12345).unwrap();
        assert_eq!(storage_size(f.as_fd()).unwrap(), (12345, false));
        std::fs::remove_file(&path).unwrap();
        let (r, _w) = pipe().unwrap();
        assert!(storage_size(r.as_fd()).is_err(), "a pipe is no storage");
    }

    #[test]
    fn claiming_a_closed_descriptor_fails() {
        // SAFETY: descriptor 1000 is not open here, which is what is tested.
        assert!(unsafe { claim_inherited(1000) }.is_err());
    }

    #[test]
    fn a_descriptor_crosses_a_seqpacket_pair_with_its_message() {
        use std::os::fd::AsFd;
        let (a, b) = seqpacket_pair().unwrap();
        let mut buf = [0u8; 16];
        assert!(recv_with_fd(b.as_fd(), &mut buf).unwrap().is_none(), "nothing sent yet");
        let (r, w) = pipe().unwrap();
        send_with_fd(a.as_fd(), b"hello", w.as_fd()).unwrap();
        drop(w);
        let (n, fd) = recv_with_fd(b.as_fd(), &mut buf).unwrap().unwrap();
        assert_eq!(&buf[..n], b"hello");
        std::fs::File::from(fd.expect("the pipe's write end came along")).write_all(b"y").unwrap();
        let mut got = [0u8; 1];
        std::fs::File::from(r).read_exact(&mut got).unwrap();
        assert_eq!(&got, b"y");
        let mut small = [0u8; 2];
        let (_r2, w2) = pipe().unwrap();
        send_with_fd(a.as_fd(), b"too long", w2.as_fd()).unwrap();
        assert_eq!(recv_with_fd(b.as_fd(), &mut small).unwrap_err().kind(), io::ErrorKind::InvalidData);
        drop(a);
        assert_eq!(recv_with_fd(b.as_fd(), &mut buf).unwrap().map(|(n, fd)| (n, fd.is_some())), Some((0, false)));
    }

    #[test]
    fn a_socket_pair_names_this_process_at_the_other_end() {
        use std::os::fd::AsFd;
        let (a, _b) = seqpacket_pair().unwrap();
        // SAFETY: getuid cannot fail.
        assert_eq!(peer_credentials(a.as_fd()).unwrap(), (std::process::id() as i32, unsafe { libc::getuid() }));
    }

    #[test]
    fn several_descriptors_cross_with_one_message_and_too_many_are_refused() {
        use std::os::fd::AsFd;
        let (a, b) = seqpacket_pair().unwrap();
        let pipes: Vec<_> = (0..5).map(|_| pipe().unwrap()).collect();
        let ends: Vec<BorrowedFd<'_>> = pipes.iter().map(|(_, w)| w.as_fd()).collect();
        send_with_fds(a.as_fd(), b"five", &ends, true).unwrap();
        let mut buf = [0u8; 8];
        let (n, fds) = recv_with_fds(b.as_fd(), &mut buf, true).unwrap().unwrap();
        assert_eq!((&buf[..n], fds.len()), (&b"five"[..], 5));
        for ((r, _), w) in pipes.into_iter().zip(fds) {
            std::fs::File::from(w).write_all(b"z").unwrap();
            let mut got = [0u8; 1];
            std::fs::File::from(r).read_exact(&mut got).unwrap();
            assert_eq!(&got, b"z");
        }
        let many: Vec<BorrowedFd<'_>> = (0..=MAX_FDS).map(|_| a.as_fd()).collect();
        assert_eq!(send_with_fds(a.as_fd(), b"x", &many, true).unwrap_err().kind(), io::ErrorKind::InvalidInput);
    }
}

/// A limit on log lines a peer can cause: `burst` lines per `window`, then none until the
/// window is over; the next line says how many were held back. For messages a client, a guest
/// or a domain triggers, which must not be able to flood the log.
#[derive(Debug)]
pub struct LogLimit {
    burst: u32,
    window: std::time::Duration,
    state: std::sync::Mutex<(Option<std::time::Instant>, u32, u64)>,
}

impl LogLimit {
    /// At most `burst` lines per `window`.
    pub const fn new(burst: u32, window: std::time::Duration) -> LogLimit {
        LogLimit { burst, window, state: std::sync::Mutex::new((None, 0, 0)) }
    }

    /// Whether a line may be logged now: `Some(n)` with the lines held back since the last
    /// one logged, `None` if it is held back.
    pub fn allow(&self) -> Option<u64> {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let now = std::time::Instant::now();
        if st.0.is_none_or(|start| now.duration_since(start) >= self.window) {
            st.0 = Some(now);
            st.1 = 0;
        }
        if st.1 >= self.burst {
            st.2 += 1;
            return None;
        }
        st.1 += 1;
        Some(std::mem::take(&mut st.2))
    }

    /// ` (N similar lines held back)` when `held` > 0, for the end of a line.
    pub fn held_note(held: u64) -> String {
        if held == 0 {
            String::new()
        } else {
            format!(" ({held} similar lines held back)")
        }
    }
}

#[cfg(test)]
mod log_limit_tests {
    use super::LogLimit;
    use std::time::Duration;

    #[test]
    fn a_burst_passes_then_lines_are_held_and_counted_until_the_window_ends() {
        let l = LogLimit::new(3, Duration::from_millis(100));
        assert_eq!((0..3).map(|_| l.allow()).collect::<Vec<_>>(), [Some(0), Some(0), Some(0)]);
        assert_eq!(l.allow(), None);
        assert_eq!(l.allow(), None);
        std::thread::sleep(Duration::from_millis(120));
        assert_eq!(l.allow(), Some(2), "the next line says two were held back");
        assert_eq!(LogLimit::held_note(2), " (2 similar lines held back)");
    }
}

extern "C" fn on_kick(_: libc::c_int) {}

/// Installs a no-op SIGUSR1 handler without SA_RESTART, so a thread's blocking system call
/// (an `accept`, a `read` of `/dev/fuse`) returns EINTR when [`kick_until_finished`] signals
/// it, and the thread can see that it is to stop.
pub fn install_kick_handler() {
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

/// Signals thread `w` (SIGUSR1, see [`install_kick_handler`]) every 2 ms until it has
/// finished: a signal that lands before the thread blocks is not lost, the next one comes.
pub fn kick_until_finished<T>(w: &std::thread::JoinHandle<T>) {
    use std::os::unix::thread::JoinHandleExt;
    while !w.is_finished() {
        // SAFETY: the thread is alive (not finished and not joined), so its pthread_t is
        // valid; SIGUSR1 has a no-op handler.
        unsafe { libc::pthread_kill(w.as_pthread_t(), libc::SIGUSR1) };
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
}
