//! Starting a process with descriptors handed over as systemd hands them (descriptors 3 and
//! up, `LISTEN_FDS`, `LISTEN_PID`), waiting for it, and signals read from a descriptor: what
//! the keeper of `serve` needs.

use std::ffi::{CString, OsString};
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

/// How a child ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ended {
    /// It exited with this status.
    Exited(i32),
    /// A signal killed it.
    Killed(i32),
}

impl std::fmt::Display for Ended {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Ended::Exited(code) => write!(f, "exited with status {code}"),
            Ended::Killed(libc::SIGKILL) => write!(f, "was killed by signal 9 (SIGKILL)"),
            Ended::Killed(sig) => write!(f, "was killed by signal {sig}"),
        }
    }
}

/// Reaps child `pid`, waiting for it to end.
pub fn wait_child(pid: u32) -> io::Result<Ended> {
    let mut status = 0;
    loop {
        // SAFETY: a system call writing only `status`.
        if unsafe { libc::waitpid(pid as libc::pid_t, &mut status, 0) } >= 0 {
            break;
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
    Ok(if libc::WIFSIGNALED(status) { Ended::Killed(libc::WTERMSIG(status)) } else { Ended::Exited(libc::WEXITSTATUS(status)) })
}

fn cstring(b: &[u8]) -> io::Result<CString> {
    CString::new(b).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "a NUL byte in an argument or the environment"))
}

/// Starts `exe` with arguments `argv` (`argv[0]` included) and environment `env`, with `fds`
/// as its descriptors 3 and up and `LISTEN_FDS`, `LISTEN_FDNAMES` (`names`, one per
/// descriptor) and `LISTEN_PID` set to say so. It gets `death_signal` when the calling thread
/// ends, and an empty signal mask. Returns its pid and a pidfd.
///
/// Everything is prepared before the fork; the child makes only async-signal-safe calls, so
/// any process may call this, threads or not.
pub fn spawn_with_fds(
    exe: &Path,
    argv: &[OsString],
    env: &[(OsString, OsString)],
    fds: &[BorrowedFd<'_>],
    names: &[&str],
    death_signal: libc::c_int,
) -> io::Result<(u32, OwnedFd)> {
    let exe = cstring(exe.as_os_str().as_bytes())?;
    let argv: Vec<CString> = argv.iter().map(|a| cstring(a.as_bytes())).collect::<io::Result<_>>()?;
    let mut env: Vec<CString> =
        env.iter().map(|(k, v)| cstring(&[k.as_bytes(), b"=", v.as_bytes()].concat())).collect::<io::Result<_>>()?;
    env.push(cstring(format!("LISTEN_FDS={}", fds.len()).as_bytes())?);
    env.push(cstring(format!("LISTEN_FDNAMES={}", names.join(":")).as_bytes())?);
    // The child writes its pid over the zeroes (leading zeroes parse as the same number).
    let mut listen_pid = b"LISTEN_PID=0000000000\0".to_vec();
    let listen_pid = listen_pid.as_mut_ptr();
    let mut envp: Vec<*const libc::c_char> = env.iter().map(|c| c.as_ptr()).collect();
    envp.push(listen_pid.cast_const().cast());
    envp.push(std::ptr::null());
    let mut argp: Vec<*const libc::c_char> = argv.iter().map(|c| c.as_ptr()).collect();
    argp.push(std::ptr::null());
    let raws: Vec<RawFd> = fds.iter().map(|fd| fd.as_raw_fd()).collect();
    let mut high: Vec<RawFd> = vec![-1; raws.len()];
    // SAFETY: a system call without arguments.
    let parent = unsafe { libc::getpid() };
    // SAFETY: the child touches only memory prepared above and makes async-signal-safe calls.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(io::Error::last_os_error());
    }
    if pid == 0 {
        // SAFETY: in the child of the fork above, with every pointer valid (prepared before it).
        unsafe { exec_child(&exe, &argp, &envp, &raws, &mut high, listen_pid, parent, death_signal) };
    }
    let pidfd = crate::pidfd_open(pid as u32)?;
    Ok((pid as u32, pidfd))
}

/// # Safety
/// Only in the child of a fork; `argp` and `envp` are NULL-terminated arrays of valid strings,
/// one of which is `listen_pid`, 22 writable bytes (`LISTEN_PID=`, ten digits, NUL).
// SAFETY: an unsafe fn, called once from `spawn_with_fds` in the forked child with every
// pointer prepared before the fork (the contract in `# Safety`).
#[allow(clippy::too_many_arguments)]
unsafe fn exec_child(
    exe: &CString,
    argp: &[*const libc::c_char],
    envp: &[*const libc::c_char],
    raws: &[RawFd],
    high: &mut [RawFd],
    listen_pid: *mut u8,
    parent: i32,
    sig: libc::c_int,
) -> ! {
    // SAFETY: the caller's contract: a forked child, which only moves descriptors, sets its
    // mask and parent-death signal, writes its pid into memory prepared for it, and execs or
    // exits.
    unsafe {
        let n = raws.len() as RawFd;
        // Out of the way first (at 3+n and above), so moving one down never overwrites another.
        for (h, &fd) in high.iter_mut().zip(raws) {
            *h = libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 3 + n);
        }
        for (i, &fd) in high.iter().enumerate() {
            // dup2 leaves the new descriptor without close-on-exec.
            if fd < 0 || libc::dup2(fd, 3 + i as RawFd) < 0 {
                libc::_exit(127);
            }
        }
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigprocmask(libc::SIG_SETMASK, &set, std::ptr::null_mut());
        libc::prctl(libc::PR_SET_PDEATHSIG, sig);
        if libc::getppid() != parent {
            libc::_exit(127);
        }
        // "LISTEN_PID=" then ten digits, then the NUL.
        let mut pid = libc::getpid() as u32;
        for i in (11..21).rev() {
            *listen_pid.add(i) = b'0' + (pid % 10) as u8;
            pid /= 10;
        }
        libc::execve(exe.as_ptr(), argp.as_ptr(), envp.as_ptr());
        libc::_exit(127)
    }
}

/// Signals read from a descriptor instead of run in handlers: the signals given are blocked
/// for the calling thread (and the threads it starts after), and become readable here.
#[derive(Debug)]
pub struct SignalFd {
    fd: OwnedFd,
}

impl SignalFd {
    /// Blocks `sigs` and reads them from a new signalfd.
    pub fn new(sigs: &[libc::c_int]) -> io::Result<SignalFd> {
        // SAFETY: plain data, initialised by sigemptyset.
        let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
        // SAFETY: `set` is a valid sigset_t for each call.
        unsafe {
            libc::sigemptyset(&mut set);
            for &s in sigs {
                libc::sigaddset(&mut set, s);
            }
            if libc::sigprocmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) < 0 {
                return Err(io::Error::last_os_error());
            }
        }
        // SAFETY: `set` is valid; a new descriptor is returned.
        let fd = unsafe { libc::signalfd(-1, &set, libc::SFD_CLOEXEC | libc::SFD_NONBLOCK) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: fresh descriptor, owned from here on.
        Ok(SignalFd { fd: unsafe { OwnedFd::from_raw_fd(fd) } })
    }

    /// The next signal waiting, if one is.
    pub fn read(&self) -> Option<libc::c_int> {
        // SAFETY: plain data, filled by the kernel.
        let mut info: libc::signalfd_siginfo = unsafe { std::mem::zeroed() };
        let len = std::mem::size_of::<libc::signalfd_siginfo>();
        // SAFETY: reads at most `len` bytes into `info`.
        let n = unsafe { libc::read(self.fd.as_raw_fd(), (&mut info as *mut libc::signalfd_siginfo).cast(), len) };
        (n == len as isize).then_some(info.ssi_signo as libc::c_int)
    }

    /// The descriptor, to poll.
    pub fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}
