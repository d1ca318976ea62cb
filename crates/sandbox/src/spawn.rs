//! Starting a domain: `clone` into new namespaces, sharing `serve`'s memory until the exec
//! (no fork's copy of it), descriptors placed by number, exec.

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

/// The stack a child runs on between `clone` and exec. The child shares this process's memory
/// until its exec (`CLONE_VM`), so that starting a domain neither copies the page tables of a
/// large, many-threaded `serve` (with its memory map locked meanwhile) nor turns every page
/// `serve` writes afterwards into a copy-on-write fault, as a fork does; it needs a stack of
/// its own, kept until the child has exec'd or died.
struct ChildStack {
    base: *mut libc::c_void,
}

impl ChildStack {
    /// Room for `child`'s frames (its largest local is `MAX_FDS` descriptors) and libc's.
    const LEN: usize = 256 << 10;

    fn new() -> io::Result<ChildStack> {
        // SAFETY: a fresh anonymous mapping; nothing else refers to it.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                Self::LEN,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_STACK | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let stack = ChildStack { base };
        // A guard page at the bottom: an overflow faults rather than writing below it.
        // SAFETY: the first page of the mapping made above.
        if unsafe { libc::mprotect(base, 4096, libc::PROT_NONE) } < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(stack)
    }

    /// Where the child's stack pointer starts (stacks grow down; 16-byte aligned).
    fn top(&self) -> *mut libc::c_void {
        // SAFETY: one past the end of the mapping, which is page-aligned.
        unsafe { self.base.cast::<u8>().add(Self::LEN).cast() }
    }
}

impl Drop for ChildStack {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, which no child uses any more (see `spawn`).
        unsafe { libc::munmap(self.base, Self::LEN) };
    }
}

/// What the child needs, in the parent's memory (shared with it until it execs).
struct ChildArgs<'a> {
    sync: (RawFd, RawFd),
    err_w: RawFd,
    srcs: &'a [RawFd; MAX_FDS],
    n: usize,
    output: Option<RawFd>,
    in_ns: bool,
    path: *const libc::c_char,
    argv: *const *const libc::c_char,
    envp: *const *const libc::c_char,
    /// The spawning thread's signal mask before it blocked every signal for the clone.
    mask: libc::sigset_t,
}

/// The kernel's `struct sigaction` (not libc's), for `rt_sigaction` called directly.
#[repr(C)]
struct KernelSigaction {
    handler: usize,
    flags: libc::c_ulong,
    restorer: usize,
    mask: u64,
}

/// The child's entry point, on its own stack.
extern "C" fn child_main(arg: *mut libc::c_void) -> libc::c_int {
    // SAFETY: `arg` is the `ChildArgs` that `spawn` keeps alive until this child has exec'd or
    // died; what follows makes only async-signal-safe system calls.
    unsafe {
        let a = &*(arg as *const ChildArgs<'_>);
        // Every signal is blocked (the parent blocked them for the clone). A handler of
        // `serve`'s would run here on `serve`'s memory, so each is set back to the default
        // before signals are let through again; ignored ones stay ignored, as across a fork.
        for sig in 1..=64 {
            if sig == libc::SIGKILL || sig == libc::SIGSTOP {
                continue;
            }
            let mut old: KernelSigaction = std::mem::zeroed();
            let ksize = std::mem::size_of::<u64>();
            if libc::syscall(libc::SYS_rt_sigaction, sig, std::ptr::null::<KernelSigaction>(), &mut old, ksize) == 0
                && old.handler != libc::SIG_DFL
                && old.handler != libc::SIG_IGN
            {
                let dfl = KernelSigaction { handler: libc::SIG_DFL, flags: 0, restorer: 0, mask: 0 };
                libc::syscall(libc::SYS_rt_sigaction, sig, &dfl, std::ptr::null_mut::<KernelSigaction>(), ksize);
            }
        }
        libc::syscall(libc::SYS_rt_sigprocmask, libc::SIG_SETMASK, &a.mask, std::ptr::null_mut::<libc::sigset_t>(), 8);
        child(a.sync, a.err_w, a.srcs, a.n, a.output, a.in_ns, a.path, a.argv, a.envp)
    }
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
/// ([`crate::mounts`]). Network and IPC: new ones, unless the domains share the empty ones
/// of [`SharedNs`].
const NS_FLAGS: libc::c_int = libc::CLONE_NEWUSER | libc::CLONE_NEWPID | libc::CLONE_NEWNET | libc::CLONE_NEWIPC;

/// One empty network namespace and one IPC namespace that every domain starts in, made once,
/// where this host lets the domains' own layers keep them apart within them.
///
/// A network namespace costs about a millisecond of CPU to make and as much to tear down (in
/// a kernel worker, after the domain has died); with two CPUs, a spare's start and a killed
/// domain's end then compete with the restart that follows. What a domain could do with a
/// namespace it shares with other domains is closed by layers it has anyway: no domain's
/// seccomp filter allows `socket`, `socketpair` or any System V or POSIX IPC call (an `rbd`
/// domain's sockets are made by the supervisor, in the host's namespace), and Landlock scopes
/// abstract unix sockets and signals to each domain's own (ABI 6). Both namespaces are owned
/// by the host's user namespace, in which no domain has any capability: the loopback device
/// stays down. So they are shared only where the kernel has seccomp and Landlock ABI ≥ 6 and
/// `serve` may make them (root); elsewhere each domain gets its own, as before.
struct SharedNs {
    net: OwnedFd,
    ipc: OwnedFd,
    /// The host's, to go back to after each clone.
    host_net: OwnedFd,
    host_ipc: OwnedFd,
}

static SHARED_NS: std::sync::OnceLock<Option<SharedNs>> = std::sync::OnceLock::new();

impl SharedNs {
    /// The shared namespaces, made on first use; `None` where the host does not allow them.
    fn get() -> Option<&'static SharedNs> {
        SHARED_NS
            .get_or_init(|| {
                let layers_hold = crate::landlock::abi() >= 6 && Path::new("/proc/sys/kernel/seccomp/actions_avail").exists();
                layers_hold.then(SharedNs::make).and_then(Result::ok)
            })
            .as_ref()
    }

    fn make() -> io::Result<SharedNs> {
        let open = |p: &str| std::fs::File::open(p).map(OwnedFd::from);
        let host_net = open("/proc/thread-self/ns/net")?;
        let host_ipc = open("/proc/thread-self/ns/ipc")?;
        // `unshare` moves the calling thread only: a thread of its own makes them and ends,
        // and the descriptors keep them.
        let made = std::thread::Builder::new()
            .name("domain-ns".into())
            .spawn(move || {
                // SAFETY: a system call with an integer argument, on this thread only.
                if unsafe { libc::unshare(libc::CLONE_NEWNET | libc::CLONE_NEWIPC) } < 0 {
                    return Err(io::Error::last_os_error());
                }
                Ok((open("/proc/thread-self/ns/net")?, open("/proc/thread-self/ns/ipc")?))
            })?
            .join()
            .map_err(|_| io::Error::other("the thread making the namespaces panicked"))?;
        let (net, ipc) = made?;
        Ok(SharedNs { net, ipc, host_net, host_ipc })
    }

    /// Moves the calling thread into the shared namespaces, for a clone whose child is to
    /// start in them; the guard moves it back.
    fn enter(&'static self) -> io::Result<EnteredNs> {
        setns(&self.net, libc::CLONE_NEWNET)?;
        if let Err(e) = setns(&self.ipc, libc::CLONE_NEWIPC) {
            let _ = setns(&self.host_net, libc::CLONE_NEWNET);
            return Err(e);
        }
        Ok(EnteredNs(self))
    }
}

/// The calling thread is in the shared namespaces until this drops.
struct EnteredNs(&'static SharedNs);

impl Drop for EnteredNs {
    fn drop(&mut self) {
        // Back to the host's: with our own descriptors and the capability that entered, this
        // does not fail; if it did, the thread would be left without a network, not with more.
        let _ = setns(&self.0.host_net, libc::CLONE_NEWNET);
        let _ = setns(&self.0.host_ipc, libc::CLONE_NEWIPC);
    }
}

fn setns(fd: &OwnedFd, kind: libc::c_int) -> io::Result<()> {
    // SAFETY: a system call on a namespace descriptor we own.
    if unsafe { libc::setns(fd.as_raw_fd(), kind) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Starts `exe args…`, with `env` added to this process's environment, `fds` at descriptors
/// 3, 4, … and every other descriptor closed at exec. With `namespaces`, the process starts in
/// new user and pid namespaces and empty network and IPC ones (`SharedNs`: the ones every
/// domain shares, or new ones where they cannot be shared; it makes its mount namespace
/// itself: [`crate::mounts::isolate`]), root inside mapped to `nobody` outside (to our own uid when not root); if the
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
    // Everything the child touches is prepared here: after the clone it may not allocate.
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
        let stack = ChildStack::new()?;
        // SAFETY: a zeroed sigset_t is a valid value for the calls below to fill.
        let (mut all, mut mask) = unsafe { (std::mem::zeroed::<libc::sigset_t>(), std::mem::zeroed::<libc::sigset_t>()) };
        // SAFETY: fills a local set.
        unsafe { libc::sigfillset(&mut all) };
        // No handler may run in the child before it has set them back (see `child_main`).
        // SAFETY: changes this thread's mask only, restored right after the clone.
        unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &all, &mut mask) };
        let child_args = ChildArgs {
            sync: (sync_r.as_raw_fd(), sync_w.as_raw_fd()),
            err_w: err_w.as_raw_fd(),
            srcs: &srcs,
            n,
            output,
            in_ns: want_ns,
            path: path.as_ptr(),
            argv: argv.as_ptr(),
            envp: envp.as_ptr(),
            mask,
        };
        // In the shared network and IPC namespaces, where there are some, for the clone only.
        let entered = if want_ns { SharedNs::get().and_then(|s| s.enter().ok()) } else { None };
        let ns_flags = match (want_ns, &entered) {
            (false, _) => 0,
            (true, Some(_)) => NS_FLAGS & !(libc::CLONE_NEWNET | libc::CLONE_NEWIPC),
            (true, None) => NS_FLAGS,
        };
        let flags = libc::CLONE_VM | libc::CLONE_PIDFD | ns_flags | libc::SIGCHLD;
        // SAFETY: the child runs `child_main` on `stack` in this process's memory, reading only
        // `child_args` and what it points to, all of which (and the stack) outlive it: this
        // function does not return before the child has exec'd or died, which the error pipe
        // (closed at exec or exit, after the child has left this memory) or a wait says.
        let pid = unsafe {
            libc::clone(
                child_main,
                stack.top(),
                flags,
                (&child_args as *const ChildArgs<'_>).cast_mut().cast(),
                &mut pidfd as *mut libc::c_int,
            )
        };
        // Taken before the calls below could overwrite errno.
        let clone_error = (pid < 0).then(io::Error::last_os_error);
        drop(entered);
        // SAFETY: restores this thread's mask.
        unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &mask, std::ptr::null_mut()) };
        if let Some(e) = clone_error {
            if want_ns {
                // Namespaces refused (no user namespaces, limits, a container): go without.
                layer = Layer::Unavailable(format!("clone with namespaces: {e}"));
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
        // EOF means the exec succeeded. Only then (or once it has died) has the child left
        // this memory and its stack: an interrupted read is made again, never taken for it.
        let got = loop {
            // SAFETY: reads up to 4 bytes into a local.
            let got = unsafe { libc::read(err_r.as_raw_fd(), errno.as_mut_ptr().cast(), 4) };
            if got >= 0 || io::Error::last_os_error().kind() != io::ErrorKind::Interrupted {
                break got;
            }
        };
        if got < 0 {
            // Cannot tell whether it has exec'd: it must not run on after the stack is freed.
            let e = io::Error::last_os_error();
            let _ = child_proc.kill();
            let _ = child_proc.wait();
            return Err(e);
        }
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

/// The child between clone and exec.
///
/// # Safety
/// Runs in the memory of a possibly multi-threaded process, on a stack of its own: it may only
/// make async-signal-safe calls, write nothing but its own locals, and must not return. (Its
/// errno is the spawning thread's, which is blocked reading the error pipe meanwhile.)
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
    // the clone, which the parent keeps until this child has exec'd.
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
            // wrappers would try to reach the threads of serve, whose memory this child shares
            // but which are not its own. Dropping the supplementary groups is only possible
            // where the creator was root; otherwise setgroups is denied and the process never
            // had groups beyond its own.
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
