//! A spare domain's sandbox, made before it knows its device.
//!
//! The supervisor keeps a few domain processes started ahead of time, so that a dead domain's
//! place is taken without the cost of making a process: namespaces (at spawn), an empty root,
//! rlimits, no_new_privs, Landlock and a first seccomp filter are all in force while a spare
//! waits. [`prepare`] applies them; when the spare is given a device, [`crate::confine::confine`]
//! finds them done ([`prepared`]) and only narrows: rlimits sized to what the domain then holds,
//! and its role's seccomp allowlist stacked on the first filter. Nothing is loosened: Landlock
//! and seccomp cannot be, and an rlimit lowered stays lowered.
//!
//! The first filter ([`first_filter`]) allows what any role but `rbd` and `vdev-model` needs,
//! and what building a domain and taking its device needs, and nothing else: no `open`, no
//! `socket`, no `execve`, no process. An `rbd` domain is not made from a spare (librados loads
//! its plug-ins from the host's filesystem while it connects, before the domain confines
//! itself), nor is a device model's (it lives as long as its device).
//!
//! What can no longer be read once the root is empty is opened before: the process's own
//! `/proc/PID/statm` and `/proc/PID/fd`, which size the rlimits at hand-over and are closed
//! then.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::{Mutex, OnceLock};

use crate::seccomp::{self, Role};
use crate::{landlock, mounts, Layer, Layers, Unavailable};

/// What a spare applied before it knew its device (its `seccomp_role` is `spare`: the first
/// filter), and the descriptors that size its rlimits once it does.
#[derive(Debug)]
pub struct Prepared {
    /// The layers in force.
    pub layers: Layers,
    /// `/proc/PID/statm` of this process, opened before the root was emptied; closed once the
    /// rlimits are set.
    statm: Mutex<Option<OwnedFd>>,
    /// `/proc/PID/fd` of this process, likewise.
    fd_dir: Mutex<Option<OwnedFd>>,
}

static PREPARED: OnceLock<Prepared> = OnceLock::new();

/// What [`prepare`] applied, if this process is a spare that did.
pub fn prepared() -> Option<&'static Prepared> {
    PREPARED.get()
}

/// System calls a spare may make beyond every role's (but `rbd`'s and `vdev-model`'s): building
/// a domain and taking its device. The role's own allowlist, stacked at hand-over, takes away
/// whatever of these the role does not need.
const SPARE: &[(i64, &str)] = &[
    (libc::SYS_recvmsg, "take the device's spec and descriptors from the supervisor"),
    (libc::SYS_close, "close the hand-over line and descriptors moved into place"),
    (libc::SYS_dup2, "put each descriptor handed over at the number its spec gives"),
    (libc::SYS_dup3, "as dup2 (libc may use this form)"),
    (libc::SYS_fcntl, "move the handed descriptors out of the way first; doorbells non-blocking"),
    (libc::SYS_fstat, "the sizes of the files handed over (arenas, ramdisk)"),
    (libc::SYS_newfstatat, "as fstat (libc may use this form)"),
    (libc::SYS_statx, "as fstat (std's form, on a descriptor: AT_EMPTY_PATH)"),
    (libc::SYS_lseek, "read statm and the descriptor list again from their start"),
    (libc::SYS_pread64, "read this process's statm to size RLIMIT_AS"),
    (libc::SYS_getdents64, "list this process's descriptors to size RLIMIT_NOFILE"),
    (libc::SYS_epoll_create1, "the domain's sleep on its doorbells"),
    (libc::SYS_epoll_ctl, "watch each queue's doorbell"),
    (libc::SYS_eventfd2, "wake-ups made while the domain is built"),
    (libc::SYS_pipe2, "the stop bell rung from the SIGTERM handler"),
    (libc::SYS_rt_sigaction, "install the SIGTERM and SIGINT handlers; write capture's fault handlers"),
    (libc::SYS_sigaltstack, "the fault handlers' stack"),
    (libc::SYS_userfaultfd, "write capture of a guarded filter's pages"),
    (libc::SYS_memfd_create, "memory a filter keeps of its own"),
    (libc::SYS_ftruncate, "size that memory"),
    (libc::SYS_prctl, "PR_SET_NO_NEW_PRIVS and PR_SET_DUMPABLE again while confining"),
    (libc::SYS_seccomp, "stack the role's allowlist on this filter"),
    (libc::SYS_prlimit64, "lower the rlimits to what the domain holds"),
    (libc::SYS_setrlimit, "as prlimit64 (libc may use this form)"),
    (libc::SYS_getrlimit, "read a limit before lowering it"),
    (libc::SYS_sched_getaffinity, "the CPUs the spin policy compares with"),
    (libc::SYS_ioctl, "UFFDIO_API, UFFDIO_REGISTER and UFFDIO_WRITEPROTECT; BLKDISCARD and BLKZEROOUT"),
];

/// Every system call the first filter allows, with a reason: each role's allowlist (guarded
/// and with attached queues), and [`SPARE`].
pub fn first_allowlist() -> Vec<(i64, &'static str)> {
    let mut v: Vec<(i64, &'static str)> = Vec::new();
    for role in Role::ALL.into_iter().filter(|r| r.from_spare()) {
        for (nr, why) in seccomp::allowlist_with(role, true, true).into_iter().chain(SPARE.iter().copied()) {
            if !v.iter().any(|(n, _)| *n == nr) {
                v.push((nr, why));
            }
        }
    }
    v
}

/// The first filter, compiled: [`first_allowlist`], with `mmap` and `mprotect` never
/// executable and `ioctl` limited to the commands any role uses.
pub fn first_filter() -> Result<seccompiler::BpfProgram, Unavailable> {
    seccomp::compile(first_allowlist(), seccomp::Conditions::spare())
}

fn setrlimit(res: libc::__rlimit_resource_t, v: u64) -> Result<(), Unavailable> {
    let r = libc::rlimit { rlim_cur: v, rlim_max: v };
    // SAFETY: plain setrlimit with a valid struct.
    if unsafe { libc::setrlimit(res, &r) } < 0 {
        return Err(Unavailable(format!("setrlimit({res}): {}", std::io::Error::last_os_error())));
    }
    Ok(())
}

/// The lowest number a spare's own descriptors take: the device's are handed over below it,
/// at 3, 4, … (at most [`crate::spawn::MAX_FDS`] of them and the output pipe).
pub const OWN_FDS_FROM: i32 = 512;

fn open_own(what: &str, flags: libc::c_int) -> Option<OwnedFd> {
    let path = std::ffi::CString::new(format!("/proc/{}/{what}", std::process::id())).ok()?;
    // SAFETY: `path` is a valid NUL-terminated string.
    let fd = unsafe { libc::open(path.as_ptr(), flags | libc::O_CLOEXEC) };
    // SAFETY: open returned a fresh descriptor that nothing else owns.
    let fd = (fd >= 0).then(|| unsafe { OwnedFd::from_raw_fd(fd) })?;
    bulkhead_sys::move_above(fd, OWN_FDS_FROM).ok()
}

/// Whether this process runs in a user namespace other than the initial one, as
/// [`crate::spawn::spawn`] makes it: the namespaces layer, read from `/proc/self/uid_map`.
pub(crate) fn namespaces_now() -> Layer {
    match std::fs::read_to_string("/proc/self/uid_map") {
        Ok(m) if m.split_whitespace().collect::<Vec<_>>() == ["0", "0", "4294967295"] => {
            Layer::Unavailable("the domain runs in the initial user namespace".into())
        }
        Ok(_) => Layer::Applied,
        Err(e) => Layer::Unavailable(format!("/proc/self/uid_map: {e}")),
    }
}

/// no_new_privs, and not dumpable: no core, no ptrace attach, `/proc/PID/mem` closed to
/// same-uid peers. For any domain ([`crate::confine`]), a spare's early.
pub(crate) fn no_new_privs() -> Result<(), Unavailable> {
    // SAFETY: plain prctl calls.
    unsafe {
        if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0 {
            return Err(Unavailable(format!("PR_SET_NO_NEW_PRIVS: {}", std::io::Error::last_os_error())));
        }
        libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0);
    }
    Ok(())
}

/// Applies, in this single-threaded process started by [`crate::spawn::spawn`], every layer
/// that does not depend on the device the spare will serve, and remembers what it applied for
/// [`crate::confine::confine`]. Unavailable layers are recorded, not refused: the policy is the
/// device's, applied at hand-over. Call once; a second call changes nothing.
pub fn prepare() -> &'static Prepared {
    if let Some(p) = PREPARED.get() {
        return p;
    }
    let namespaces = namespaces_now();
    let statm = open_own("statm", libc::O_RDONLY);
    let fd_dir = open_own("fd", libc::O_RDONLY | libc::O_DIRECTORY);
    let layer = |r: Result<(), Unavailable>| match r {
        Ok(()) => Layer::Applied,
        Err(e) => Layer::Unavailable(e.0),
    };
    let mounts = match namespaces {
        Layer::Applied => layer(mounts::isolate()),
        _ => Layer::Unavailable("no mount namespace of the domain's own".into()),
    };
    // No core, no locked memory; no more tasks than the roomiest role's (an io_uring engine's
    // workers): narrowed to the role's at hand-over.
    let nproc = 2 * u64::from(bulkhead_sys::uring::FILE_ENGINE.max_workers) + 4;
    let rlimits = layer(
        setrlimit(libc::RLIMIT_CORE, 0)
            .and_then(|()| setrlimit(libc::RLIMIT_MEMLOCK, 0))
            .and_then(|()| setrlimit(libc::RLIMIT_NPROC, nproc)),
    );
    let no_new_privs = layer(no_new_privs());
    let landlock_abi = landlock::abi();
    let landlock = layer(landlock::deny_all().map(|_| ()));
    let seccomp = layer(first_filter().and_then(|prog| seccompiler::apply_filter(&prog).map_err(|e| Unavailable(e.to_string()))));
    let layers = Layers {
        namespaces,
        mounts,
        rlimits,
        no_new_privs,
        landlock,
        landlock_abi,
        seccomp,
        seccomp_role: "spare".into(),
        connect_listener: None,
    };
    PREPARED.get_or_init(|| Prepared { layers, statm: Mutex::new(statm), fd_dir: Mutex::new(fd_dir) })
}

impl Prepared {
    /// Bytes this process has mapped now (`None`: statm could not be opened or read).
    pub(crate) fn mapped_bytes(&self) -> Option<u64> {
        let statm = self.statm.lock().unwrap_or_else(|e| e.into_inner());
        let fd = statm.as_ref()?;
        let mut buf = [0u8; 128];
        // SAFETY: reads into a local buffer of the length given.
        let n = unsafe { libc::pread(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
        if n <= 0 {
            return None;
        }
        let pages: u64 = std::str::from_utf8(&buf[..n as usize]).ok()?.split_whitespace().next()?.parse().ok()?;
        Some(pages * 4096)
    }

    /// The highest descriptor open now, the one listing them aside (`None`: the list could not
    /// be read).
    pub(crate) fn highest_fd(&self) -> Option<i32> {
        let fd_dir = self.fd_dir.lock().unwrap_or_else(|e| e.into_inner());
        let dir = fd_dir.as_ref()?;
        // SAFETY: lseek on a directory descriptor this value owns.
        if unsafe { libc::lseek(dir.as_raw_fd(), 0, libc::SEEK_SET) } < 0 {
            return None;
        }
        let mut highest = 2;
        let mut buf = [0u8; 4096];
        loop {
            // SAFETY: getdents64 fills at most `buf.len()` bytes of a local buffer.
            let n = unsafe { libc::syscall(libc::SYS_getdents64, dir.as_raw_fd(), buf.as_mut_ptr(), buf.len()) };
            if n < 0 {
                return None;
            }
            if n == 0 {
                break;
            }
            let mut off = 0usize;
            while off + 19 < n as usize {
                // struct linux_dirent64: d_ino (8), d_off (8), d_reclen (2), d_type (1), d_name.
                let reclen = u16::from_ne_bytes([buf[off + 16], buf[off + 17]]) as usize;
                if reclen == 0 {
                    break;
                }
                let name = &buf[off + 19..(off + reclen).min(n as usize)];
                let name = name.split(|&b| b == 0).next().unwrap_or_default();
                if let Some(fd) = std::str::from_utf8(name).ok().and_then(|s| s.parse::<i32>().ok()) {
                    if fd != dir.as_raw_fd() {
                        highest = highest.max(fd);
                    }
                }
                off += reclen;
            }
        }
        Some(highest)
    }

    /// Closes the descriptors that sized the rlimits: the domain serving needs neither.
    pub(crate) fn let_go(&self) {
        for fd in [&self.statm, &self.fd_dir] {
            drop(fd.lock().unwrap_or_else(|e| e.into_inner()).take());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_filter_compiles_and_allows_no_way_out() {
        assert!(first_filter().is_ok());
        let list: Vec<i64> = first_allowlist().iter().map(|x| x.0).collect();
        for banned in [
            libc::SYS_open,
            libc::SYS_openat,
            libc::SYS_openat2,
            libc::SYS_socket,
            libc::SYS_connect,
            libc::SYS_bind,
            libc::SYS_execve,
            libc::SYS_execveat,
            libc::SYS_clone,
            libc::SYS_clone3,
            libc::SYS_fork,
            libc::SYS_ptrace,
            libc::SYS_process_vm_readv,
            libc::SYS_mount,
            libc::SYS_unshare,
            libc::SYS_setns,
            libc::SYS_kill,
            libc::SYS_bpf,
        ] {
            assert!(!list.contains(&banned), "a spare must not make system call {banned}");
        }
        // Every role a spare may take is within it, so stacking the role's allowlist narrows.
        for role in Role::ALL.into_iter().filter(|r| r.from_spare()) {
            for (nr, _) in seccomp::allowlist_with(role, true, true) {
                assert!(list.contains(&nr), "{role:?} needs {nr}, which the first filter refuses");
            }
        }
        for (nr, why) in first_allowlist() {
            assert!(!why.is_empty(), "system call {nr} has no reason");
        }
    }
}
