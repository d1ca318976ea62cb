//! Brokered `connect`: a seccomp filter that hands a domain's `connect` calls to the
//! supervisor (seccomp user notification), and what the supervisor needs to answer them
//! (read the address, install a socket of its own in the domain, reply).

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

/// `struct sock_filter`.
#[repr(C)]
#[derive(Clone, Copy)]
struct SockFilter {
    code: u16,
    jt: u8,
    jf: u8,
    k: u32,
}

/// `struct sock_fprog`.
#[repr(C)]
struct SockFprog {
    len: u16,
    filter: *const SockFilter,
}

const BPF_LD_W_ABS: u16 = 0x20;
const BPF_JEQ_K: u16 = 0x15;
const BPF_RET_K: u16 = 0x06;
const AUDIT_ARCH_X86_64: u32 = 0xc000_003e;
/// Offsets in `struct seccomp_data`.
const NR: u32 = 0;
const ARCH: u32 = 4;

const fn stmt(code: u16, k: u32) -> SockFilter {
    SockFilter { code, jt: 0, jf: 0, k }
}
const fn jump(k: u32, jt: u8, jf: u8) -> SockFilter {
    SockFilter { code: BPF_JEQ_K, jt, jf, k }
}

/// Installs, on the calling thread (and the threads it makes afterwards), a filter that turns
/// every `socket` and `connect` into a notification for whoever holds the returned listener
/// (who makes the socket in a network namespace of its own choosing, and connects it), and makes
/// `clone3` fail with ENOSYS (so threads are made with `clone`, whose flags a filter can
/// check). Everything else passes to the filters installed after it. Needs no_new_privs.
pub fn install_connect_listener() -> io::Result<OwnedFd> {
    let prog = [
        stmt(BPF_LD_W_ABS, ARCH),
        jump(AUDIT_ARCH_X86_64, 1, 0),
        stmt(BPF_RET_K, libc::SECCOMP_RET_KILL_PROCESS),
        stmt(BPF_LD_W_ABS, NR),
        jump(libc::SYS_connect as u32, 1, 0),
        jump(libc::SYS_socket as u32, 0, 1),
        stmt(BPF_RET_K, libc::SECCOMP_RET_USER_NOTIF),
        jump(libc::SYS_clone3 as u32, 0, 1),
        stmt(BPF_RET_K, libc::SECCOMP_RET_ERRNO | libc::ENOSYS as u32),
        stmt(BPF_RET_K, libc::SECCOMP_RET_ALLOW),
    ];
    let fprog = SockFprog { len: prog.len() as u16, filter: prog.as_ptr() };
    // SAFETY: a valid filter program that outlives the call; the kernel copies it.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_seccomp,
            libc::SECCOMP_SET_MODE_FILTER,
            libc::SECCOMP_FILTER_FLAG_NEW_LISTENER,
            &fprog as *const SockFprog,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the kernel just returned this descriptor to us.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// A copy of descriptor `fd` of the process behind `pidfd`.
pub fn pidfd_getfd(pidfd: BorrowedFd<'_>, fd: RawFd) -> io::Result<OwnedFd> {
    // SAFETY: plain system call; the result is a new descriptor of ours.
    let r = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), fd, 0) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a new descriptor, ours alone.
    Ok(unsafe { OwnedFd::from_raw_fd(r as RawFd) })
}

/// One system call waiting for an answer.
#[derive(Debug, Clone, Copy)]
pub struct Notification {
    /// Its cookie.
    pub id: u64,
    /// The calling thread, in our pid namespace.
    pub pid: u32,
    /// System call number.
    pub nr: i32,
    /// Its arguments.
    pub args: [u64; 6],
}

/// Takes the next notification (blocks until there is one; poll the listener first).
pub fn receive(listener: BorrowedFd<'_>) -> io::Result<Notification> {
    // SAFETY: a plain C struct the kernel fills; it must be zeroed before the call.
    let mut n: libc::seccomp_notif = unsafe { std::mem::zeroed() };
    // SAFETY: a valid, zeroed struct of the size the ioctl expects.
    if unsafe { libc::ioctl(listener.as_raw_fd(), libc::SECCOMP_IOCTL_NOTIF_RECV, &mut n) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(Notification { id: n.id, pid: n.pid, nr: n.data.nr, args: n.data.args })
}

/// Whether notification `id` is still waiting (its thread has not died or been interrupted):
/// what was read from the caller's memory before this returned true is what it asked.
pub fn still_waiting(listener: BorrowedFd<'_>, id: u64) -> bool {
    // SAFETY: the ioctl reads one u64.
    unsafe { libc::ioctl(listener.as_raw_fd(), libc::SECCOMP_IOCTL_NOTIF_ID_VALID, &id) == 0 }
}

/// Reads `len` bytes at `addr` of process `pid`.
pub fn read_memory(pid: u32, addr: u64, len: usize) -> io::Result<Vec<u8>> {
    let mut buf = vec![0u8; len];
    let local = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: len };
    let remote = libc::iovec { iov_base: addr as usize as *mut libc::c_void, iov_len: len };
    // SAFETY: the local iovec names our own buffer; the remote one is only read by the kernel.
    let n = unsafe { libc::process_vm_readv(pid as libc::pid_t, &local, 1, &remote, 1, 0) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    buf.truncate(n as usize);
    Ok(buf)
}

/// Installs `fd` in the waiting caller's process as the result of its call (a new descriptor
/// number, close-on-exec if `cloexec`), which answers it.
pub fn install_as_result(listener: BorrowedFd<'_>, id: u64, fd: BorrowedFd<'_>, cloexec: bool) -> io::Result<i32> {
    let add = libc::seccomp_notif_addfd {
        id,
        flags: libc::SECCOMP_ADDFD_FLAG_SEND as u32,
        srcfd: fd.as_raw_fd() as u32,
        newfd: 0,
        newfd_flags: if cloexec { libc::O_CLOEXEC as u32 } else { 0 },
    };
    // SAFETY: a valid struct the ioctl reads.
    let r = unsafe { libc::ioctl(listener.as_raw_fd(), libc::SECCOMP_IOCTL_NOTIF_ADDFD, &add) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(r)
}

/// Answers notification `id`: the call returns `Ok(value)` or fails with `Err(errno)`.
pub fn answer(listener: BorrowedFd<'_>, id: u64, result: Result<i64, i32>) -> io::Result<()> {
    let (val, error) = match result {
        Ok(v) => (v, 0),
        Err(errno) => (0, -errno),
    };
    let resp = libc::seccomp_notif_resp { id, val, error, flags: 0 };
    // SAFETY: a valid struct the ioctl reads.
    if unsafe { libc::ioctl(listener.as_raw_fd(), libc::SECCOMP_IOCTL_NOTIF_SEND, &resp) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}
