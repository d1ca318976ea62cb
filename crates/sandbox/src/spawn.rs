//! Starting a domain: `clone3` into new namespaces, descriptors placed by number, exec.

use std::ffi::{CString, OsStr};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::ExitStatus;

use crate::Layer;

/// Most descriptors one domain can be handed.
pub const MAX_FDS: usize = 400;

/// A domain process started by [`spawn`]. Unlike `std::process::Child` it may live in its own
/// pid namespace, and it carries a pidfd.
#[derive(Debug)]
pub struct DomainChild {
    pid: u32,
    pidfd: OwnedFd,
    status: Option<ExitStatus>,
}

impl DomainChild {
    /// Process id (in the supervisor's pid namespace).
    pub fn id(&self) -> u32 {
        self.pid
    }

    /// The pidfd: readable once the process has exited.
    pub fn pidfd(&self) -> &OwnedFd {
        &self.pidfd
    }

    /// Sends `sig` through the pidfd (never to a recycled pid).
    pub fn signal(&self, sig: i32) -> io::Result<()> {
        // SAFETY: pidfd_send_signal with a pidfd we own and no siginfo.
        let r = unsafe { libc::syscall(libc::SYS_pidfd_send_signal, self.pidfd.as_raw_fd(), sig, std::ptr::null::<u8>(), 0) };
        if r < 0 {
            let e = io::Error::last_os_error();
            // Already exited: nothing to signal.
            if e.raw_os_error() == Some(libc::ESRCH) {
                return Ok(());
            }
            return Err(e);
        }
        Ok(())
    }

    /// SIGKILL.
    pub fn kill(&mut self) -> io::Result<()> {
        self.signal(libc::SIGKILL)
    }

    fn reap(&mut self, flags: i32) -> io::Result<Option<ExitStatus>> {
        if let Some(s) = self.status {
            return Ok(Some(s));
        }
        let mut st = 0;
        loop {
            // SAFETY: waiting for our own child.
            let r = unsafe { libc::waitpid(self.pid as i32, &mut st, flags) };
            if r < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e);
            }
            if r == 0 {
                return Ok(None);
            }
            let s = ExitStatus::from_raw(st);
            self.status = Some(s);
            return Ok(Some(s));
        }
    }

    /// The exit status if the process has exited.
    pub fn try_wait(&mut self) -> io::Result<Option<ExitStatus>> {
        self.reap(libc::WNOHANG)
    }

    /// Waits up to `timeout` for the process to exit; `None` if it has not. A killed process
    /// can take a while to finish exiting (its exit may have to release kernel resources that
    /// wait on I/O), so callers that must stay responsive use this rather than [`wait`](Self::wait).
    pub fn wait_timeout(&mut self, timeout: std::time::Duration) -> io::Result<Option<ExitStatus>> {
        let deadline = std::time::Instant::now() + timeout;
        loop {
            if let Some(s) = self.try_wait()? {
                return Ok(Some(s));
            }
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return Ok(None);
            }
            let mut pfd = libc::pollfd { fd: self.pidfd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
            // SAFETY: polls one valid pollfd; the pidfd turns readable when the process exits.
            unsafe { libc::poll(&mut pfd, 1, left.as_millis().clamp(1, i32::MAX as u128) as i32) };
        }
    }

    /// Waits for the process to exit.
    pub fn wait(&mut self) -> io::Result<ExitStatus> {
        Ok(self.reap(0)?.expect("blocking waitpid returns a status"))
    }
}

#[repr(C)]
#[derive(Default)]
struct CloneArgs {
    flags: u64,
    pidfd: u64,
    child_tid: u64,
    parent_tid: u64,
    exit_signal: u64,
    stack: u64,
    stack_size: u64,
    tls: u64,
    set_tid: u64,
    set_tid_size: u64,
    cgroup: u64,
}

fn pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    bulkhead_sys::pipe()
}

fn cstr(s: &OsStr) -> io::Result<CString> {
    CString::new(s.as_bytes()).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "NUL in argument"))
}

/// The variables through which a service manager speaks to `serve` (sd_notify, its watchdog,
/// socket activation, the keeper): not passed on to domains.
const SERVICE_MANAGER_VARS: [&str; 8] = [
    "NOTIFY_SOCKET",
    "WATCHDOG_USEC",
    "WATCHDOG_PID",
    "LISTEN_FDS",
    "LISTEN_PID",
    "LISTEN_FDNAMES",
    "BULKHEAD_KEEPER",
    "BULKHEAD_FELL_BACK",
];

/// How long a child waits for its parent to let it go on before it gives up, ms.
const SYNC_WAIT_MS: libc::c_int = 10_000;

/// The namespaces a domain starts in. Not a mount namespace: the domain makes its own when it
/// confines itself, so that no copy of the host's mounts outlives that moment
/// ([`crate::mounts`]).
const NS_FLAGS: u64 = (libc::CLONE_NEWUSER | libc::CLONE_NEWPID | libc::CLONE_NEWNET | libc::CLONE_NEWIPC) as u64;

/// Starts `exe args…`, with `env` added to this process's environment, `fds` at descriptors
/// 3, 4, … and every other descriptor closed at exec. With `namespaces`, the process starts in new user, pid, network and IPC namespaces
/// (it makes its mount namespace itself: [`crate::mounts::isolate`]), root inside mapped to `nobody` outside (to our own uid when not root); if the
/// kernel refuses, it starts without them and the returned layer says why. `output`, when
/// given, becomes the process's descriptors 1 and 2 (otherwise it shares the caller's).
///
/// The process dies with the calling *thread* (PR_SET_PDEATHSIG): call this only from a thread
/// that outlives the domain.
pub fn spawn(
    exe: &Path,
    args: &[&OsStr],
    env: &[(&str, &OsStr)],
    fds: &[RawFd],
    output: Option<RawFd>,
    namespaces: bool,
) -> io::Result<(DomainChild, Layer)> {
    if fds.len() > MAX_FDS {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "too many descriptors for one domain"));
    }
    // Everything the child touches is prepared here: after clone3 it may not allocate.
    let path = cstr(exe.as_os_str())?;
    // Through /proc/self/exe the domain is this very binary: `ps` names it `bulkhead`.
    let argv0 = if exe == Path::new("/proc/self/exe") { cstr(OsStr::new("bulkhead"))? } else { path.clone() };
    let mut argv_c = vec![argv0];
    for a in args {
        argv_c.push(cstr(a)?);
    }
    // The service manager's variables are `serve`'s alone: a domain never speaks to systemd.
    let envp_c: Vec<CString> = std::env::vars_os()
        .filter(|(k, _)| !SERVICE_MANAGER_VARS.iter().any(|m| k.as_bytes() == m.as_bytes()))
        .filter(|(k, _)| !env.iter().any(|(e, _)| k.as_bytes() == e.as_bytes()))
        .chain(env.iter().map(|(k, v)| (OsStr::new(k).to_os_string(), v.to_os_string())))
        .filter_map(|(k, v)| {
            let mut kv = k.as_bytes().to_vec();
            kv.push(b'=');
            kv.extend_from_slice(v.as_bytes());
            CString::new(kv).ok()
        })
        .collect();
    let mut argv: Vec<*const libc::c_char> = argv_c.iter().map(|c| c.as_ptr()).collect();
    argv.push(std::ptr::null());
    let mut envp: Vec<*const libc::c_char> = envp_c.iter().map(|c| c.as_ptr()).collect();
    envp.push(std::ptr::null());
    let mut srcs = [0 as RawFd; MAX_FDS];
    srcs[..fds.len()].copy_from_slice(fds);
    let n = fds.len();

    let mut want_ns = namespaces;
    let mut layer = if namespaces { Layer::Applied } else { Layer::Off };
    loop {
        let (sync_r, sync_w) = pipe()?;
        let (err_r, err_w) = pipe()?;
        let mut pidfd: libc::c_int = -1;
        let args = CloneArgs {
            flags: libc::CLONE_PIDFD as u64 | if want_ns { NS_FLAGS } else { 0 },
            pidfd: &mut pidfd as *mut libc::c_int as u64,
            exit_signal: libc::SIGCHLD as u64,
            ..Default::default()
        };
        // SAFETY: clone3 without CLONE_VM behaves like fork. The child branch below only makes
        // async-signal-safe system calls on data prepared above, then execs or _exits.
        let pid = unsafe { libc::syscall(libc::SYS_clone3, &args as *const CloneArgs, std::mem::size_of::<CloneArgs>()) };
        if pid == 0 {
            // SAFETY: child side; see above.
            unsafe {
                child(
                    (sync_r.as_raw_fd(), sync_w.as_raw_fd()),
                    err_w.as_raw_fd(),
                    &srcs,
                    n,
                    output,
                    want_ns,
                    path.as_ptr(),
                    argv.as_ptr(),
                    envp.as_ptr(),
                )
            }
        }
        if pid < 0 {
            let e = io::Error::last_os_error();
            if want_ns {
                // Namespaces refused (no user namespaces, limits, a container): go without.
                layer = Layer::Unavailable(format!("clone3 with namespaces: {e}"));
                want_ns = false;
                continue;
            }
            return Err(e);
        }
        drop(sync_r);
        drop(err_w);
        // SAFETY: the kernel stored a fresh pidfd for the child.
        let pidfd = unsafe { OwnedFd::from_raw_fd(pidfd) };
        let mut child_proc = DomainChild { pid: pid as u32, pidfd, status: None };
        if want_ns {
            if let Err(e) = map_ids(pid as u32) {
                let _ = child_proc.kill();
                let _ = child_proc.wait();
                layer = Layer::Unavailable(format!("uid/gid map: {e}"));
                want_ns = false;
                continue;
            }
        }
        // Let the child go on to exec. The write end stays open until it has: the child checks
        // it to know this thread was alive when its parent-death signal was armed.
        // SAFETY: writes one byte from a local.
        unsafe { libc::write(sync_w.as_raw_fd(), [1u8].as_ptr().cast(), 1) };
        let mut errno = [0u8; 4];
        // SAFETY: reads up to 4 bytes into a local; EOF means the exec succeeded.
        let got = unsafe { libc::read(err_r.as_raw_fd(), errno.as_mut_ptr().cast(), 4) };
        drop(sync_w);
        if got == 4 {
            let _ = child_proc.wait();
            return Err(io::Error::from_raw_os_error(i32::from_ne_bytes(errno)));
        }
        return Ok((child_proc, layer));
    }
}

/// Whether this process runs in a user namespace other than the initial one, as [`spawn`]
/// makes it, reported as the namespaces layer.
pub fn namespaces_layer(policy: crate::Policy) -> Layer {
    if policy == crate::Policy::Off {
        return Layer::Off;
    }
    // A spare looked before its root was emptied.
    if let Some(p) = crate::spare::prepared() {
        return p.layers.namespaces.clone();
    }
    crate::spare::namespaces_now()
}

fn map_ids(pid: u32) -> io::Result<()> {
    // SAFETY: plain getters.
    let (uid, gid) = unsafe { (libc::geteuid(), libc::getegid()) };
    let (out_uid, out_gid) = if uid == 0 { (65534, 65534) } else { (uid, gid) };
    // Root may map another user's ids and leave setgroups(2) allowed, so the child can drop
    // root's supplementary groups; anyone else must deny setgroups to map at all.
    if uid != 0 {
        std::fs::write(format!("/proc/{pid}/setgroups"), "deny")?;
    }
    std::fs::write(format!("/proc/{pid}/uid_map"), format!("0 {out_uid} 1"))?;
    std::fs::write(format!("/proc/{pid}/gid_map"), format!("0 {out_gid} 1"))?;
    Ok(())
}

/// The child between clone3 and exec.
///
/// # Safety
/// Runs in a copy of a possibly multi-threaded process: it may only make async-signal-safe
/// calls and must not return.
#[allow(clippy::too_many_arguments)]
unsafe fn child(
    (sync_r, sync_w): (RawFd, RawFd),
    err_w: RawFd,
    srcs: &[RawFd; MAX_FDS],
    n: usize,
    output: Option<RawFd>,
    in_ns: bool,
    path: *const libc::c_char,
    argv: *const *const libc::c_char,
    envp: *const *const libc::c_char,
) -> ! {
    // SAFETY: only async-signal-safe system calls on integers and on memory prepared before
    // clone3, which this copy of the address space still holds.
    unsafe {
        let fail = |err_fd: RawFd| -> ! {
            let e = *libc::__errno_location();
            libc::write(err_fd, (&e as *const i32).cast(), 4);
            libc::_exit(127)
        };
        // Die with the spawning thread while waiting for it, too: this copy holds every
        // descriptor the parent had at the clone (the FUSE session's among them), and so may
        // other domains' children that are waiting as well, so a parent that dies before it
        // writes must not leave it waiting on a pipe whose write end it keeps open itself.
        libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
        libc::close(sync_w);
        // Wait until the parent has written our uid/gid maps: one byte, within a bound (the
        // parent may have died before the signal above was armed).
        let mut pfd = libc::pollfd { fd: sync_r, events: libc::POLLIN, revents: 0 };
        let mut b = 0u8;
        if libc::poll(&mut pfd, 1, SYNC_WAIT_MS) != 1 || libc::read(sync_r, (&mut b as *mut u8).cast(), 1) != 1 {
            libc::_exit(127);
        }
        if in_ns {
            // Become the mapped root of the new namespace: until now this process has the
            // creator's ids, which the namespace does not map. Raw system calls, as glibc's
            // wrappers would try to reach threads this copy does not have. Dropping the
            // supplementary groups is only possible where the creator was root; otherwise
            // setgroups is denied and the process never had groups beyond its own.
            libc::syscall(libc::SYS_setgroups, 0, std::ptr::null::<libc::gid_t>());
            if libc::syscall(libc::SYS_setresgid, 0, 0, 0) < 0 || libc::syscall(libc::SYS_setresuid, 0, 0, 0) < 0 {
                fail(err_w);
            }
        }
        // Die with the spawning thread. Set only now: a change of credentials (the setresuid
        // above) clears it, which once left domains running after a SIGKILLed serve. The
        // parent keeps the sync pipe open until this process has exec'd: if it is already
        // closed, the parent died before the signal was armed.
        libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
        let mut pfd = libc::pollfd { fd: sync_r, events: libc::POLLIN, revents: 0 };
        if libc::poll(&mut pfd, 1, 0) > 0 && pfd.revents & libc::POLLHUP != 0 {
            libc::_exit(127);
        }
        // A process group of its own: a Ctrl-C at serve's terminal is for serve, which ends
        // its domains in order, not for the domains directly.
        libc::setpgid(0, 0);
        let err_hi = libc::fcntl(err_w, libc::F_DUPFD_CLOEXEC, 2048);
        if err_hi < 0 {
            fail(err_w);
        }
        let mut high = [0 as RawFd; MAX_FDS];
        for i in 0..n {
            high[i] = libc::fcntl(srcs[i], libc::F_DUPFD_CLOEXEC, 1024);
            if high[i] < 0 {
                fail(err_hi);
            }
        }
        let out_hi = match output {
            Some(fd) => libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 1024),
            None => -1,
        };
        if output.is_some() && out_hi < 0 {
            fail(err_hi);
        }
        for (i, &h) in high.iter().enumerate().take(n) {
            // dup2 leaves the target without FD_CLOEXEC: it survives exec.
            if libc::dup2(h, 3 + i as RawFd) < 0 {
                fail(err_hi);
            }
        }
        if out_hi >= 0 && (libc::dup2(out_hi, 1) < 0 || libc::dup2(out_hi, 2) < 0) {
            fail(err_hi);
        }
        const CLOSE_RANGE_CLOEXEC: libc::c_uint = 1 << 2;
        libc::syscall(libc::SYS_close_range, 3 + n as libc::c_uint, libc::c_uint::MAX, CLOSE_RANGE_CLOEXEC);
        libc::execve(path, argv, envp);
        fail(err_hi)
    }
}
