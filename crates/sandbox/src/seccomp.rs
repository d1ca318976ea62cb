//! The seccomp allowlist of a driver domain: every system call a domain may make once
//! confined, with the reason it needs it. Anything else fails with EPERM.
//!
//! Set up (mapping the channel, creating the io_uring, opening the epoll set) happens before
//! the filter is installed, so none of it appears here.

use crate::Unavailable;
use std::collections::BTreeMap;

use seccompiler::{SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter, SeccompRule, TargetArch};

/// What the domain's backend needs beyond the common set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// `ram` or `null`: memory only.
    Memory,
    /// `file` with the sync engine.
    FileSync,
    /// `file` with the io_uring engine.
    FileIoUring,
    /// `nbd`: a connected socket passed in, no way to make another.
    Network,
    /// `nbd` under a filter that keeps a file of its own (a `cow` overlay): the socket and
    /// positioned file I/O on descriptors passed in.
    NetworkFile,
    /// A tap domain in `interpose` mode: the frontend of the domain below over a channel.
    Tap,
    /// A tap domain whose filters keep a file of their own (a `cow` overlay): the channel below
    /// and positioned file I/O on descriptors passed in.
    TapFile,
    /// `vdev`: a register-level driver over a card's memory (its trap was armed and sent
    /// before confinement); it waits for the card's interrupt or polls its registers.
    Vdev,
    /// `vdev` under a filter that keeps a file of its own (a `cow` overlay).
    VdevFile,
    /// A device-model domain: a card's model over its memory, taking traps on the line from
    /// the driver domains and serving them.
    VdevModel,
    /// `rbd`: librbd's threads and its sockets to the cluster. Every `connect` goes to the
    /// supervisor (see [`bulkhead_sys::seccomp_notify`]), which connects a socket of its own to
    /// a cluster address and puts it in place of the domain's; the domain's own network
    /// namespace is empty.
    Rbd,
}

impl Role {
    /// Every role.
    pub const ALL: [Role; 11] = [
        Role::Memory,
        Role::FileSync,
        Role::FileIoUring,
        Role::Network,
        Role::NetworkFile,
        Role::Tap,
        Role::TapFile,
        Role::Vdev,
        Role::VdevFile,
        Role::VdevModel,
        Role::Rbd,
    ];

    /// Whether a domain of this role may be made from a spare ([`crate::spare`]): all but an
    /// `rbd` domain's (librados reads the host's files as it connects) and a device model's (it
    /// lives as long as its device).
    pub fn from_spare(self) -> bool {
        !matches!(self, Role::Rbd | Role::VdevModel)
    }

    /// Name for status.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Memory => "memory",
            Role::FileSync => "file-sync",
            Role::FileIoUring => "file-io_uring",
            Role::Network => "network",
            Role::NetworkFile => "network-file",
            Role::Tap => "tap",
            Role::TapFile => "tap-file",
            Role::Vdev => "vdev",
            Role::VdevFile => "vdev-file",
            Role::VdevModel => "vdev-model",
            Role::Rbd => "rbd",
        }
    }
}

/// System calls every domain may make, with the reason.
const COMMON: &[(i64, &str)] = &[
    (libc::SYS_read, "drain the kick doorbell (eventfd)"),
    (libc::SYS_write, "ring the irq doorbell (eventfd); log lines on stderr"),
    (libc::SYS_epoll_wait, "sleep on the kick doorbells of all queues"),
    (libc::SYS_epoll_pwait, "as epoll_wait (libc may use this form)"),
    (libc::SYS_clock_gettime, "spin budget timing when the vDSO falls back to the system call"),
    (libc::SYS_futex, "std's one-time initialisation and locks"),
    (libc::SYS_rt_sigreturn, "return from the SIGTERM/SIGINT handler"),
    (libc::SYS_rt_sigprocmask, "signal masking around handlers"),
    (libc::SYS_munmap, "the allocator returning memory"),
    (libc::SYS_mremap, "the allocator growing a large allocation"),
    (libc::SYS_brk, "the allocator's heap"),
    (libc::SYS_madvise, "the allocator releasing pages"),
    (libc::SYS_fallocate, "discard and write-zeroes: punch holes in the ramdisk or file"),
    (libc::SYS_getrandom, "std's hash map seeds"),
    (libc::SYS_getpid, "logging and signal handling"),
    (libc::SYS_gettid, "logging and signal handling"),
    (libc::SYS_sched_yield, "politeness while spinning"),
    (libc::SYS_restart_syscall, "resuming an interrupted sleep"),
    (libc::SYS_exit, "thread exit"),
    (libc::SYS_exit_group, "process exit"),
];

/// Extra system calls of the file roles.
const FILE: &[(i64, &str)] = &[
    (libc::SYS_pread64, "sync engine reads"),
    (libc::SYS_pwrite64, "sync engine writes"),
    (libc::SYS_preadv, "vectored reads"),
    (libc::SYS_pwritev, "vectored writes"),
    (libc::SYS_preadv2, "vectored reads with flags"),
    (libc::SYS_pwritev2, "FUA writes (RWF_DSYNC)"),
    (libc::SYS_fdatasync, "flush"),
    (libc::SYS_fsync, "flush fallback"),
];

/// Extra system calls of the io_uring role.
const IO_URING: &[(i64, &str)] =
    &[(libc::SYS_io_uring_enter, "submit and reap a batch (the ring is restricted to readv, writev and fsync at setup)")];

/// Extra system calls of the tap role.
const TAP: &[(i64, &str)] = &[
    (libc::SYS_poll, "wait on the doorbell of the channel to the domain below"),
    (libc::SYS_ppoll, "as poll (libc may use this form)"),
    (
        libc::SYS_clock_nanosleep,
        "nap instead of sleeping on a doorbell the domain below storms (a domain below being replaced rings spuriously)",
    ),
    (libc::SYS_nanosleep, "as clock_nanosleep (libc may use this form)"),
];

/// Extra system calls of the network role (the socket was connected by the supervisor;
/// `socket`, `connect`, `bind` and `accept` stay forbidden).
const NETWORK: &[(i64, &str)] = &[
    (libc::SYS_sendmsg, "send requests with their payload from the grant windows"),
    (libc::SYS_recvmsg, "receive replies into the grant windows"),
    (libc::SYS_sendto, "negotiation (send)"),
    (libc::SYS_recvfrom, "negotiation (recv)"),
    (libc::SYS_poll, "wait for the socket with a deadline"),
    (libc::SYS_ppoll, "as poll (libc may use this form)"),
];

/// Extra system calls of a `vdev` driver domain.
const VDEV: &[(i64, &str)] = &[
    (libc::SYS_poll, "wait for the card's interrupt (eventfd) with a deadline"),
    (libc::SYS_ppoll, "as poll (libc may use this form)"),
    (libc::SYS_clock_nanosleep, "pause between looks at a register while the card resets"),
    (libc::SYS_nanosleep, "as clock_nanosleep (libc may use this form)"),
];

/// Extra system calls of a device-model domain.
const VDEV_MODEL: &[(i64, &str)] = &[
    (libc::SYS_poll, "wait on the trap line and the driver's trap"),
    (libc::SYS_ppoll, "as poll (libc may use this form)"),
    (libc::SYS_recvmsg, "take a driver's trap from the trap line (the socket was made by the supervisor)"),
    (libc::SYS_close, "let go of a trap it refused or that a new driver's replaced (else each would hold a descriptor)"),
];

/// Extra system calls of a domain whose filters run under write capture (`guard`).
const GUARD: &[(i64, &str)] = &[
    (libc::SYS_ioctl, "UFFDIO_WRITEPROTECT only: protect and open pages around a guarded filter's writes"),
    (libc::SYS_rt_sigaction, "give a fault that is not the guard's its default action"),
    (libc::SYS_pkey_alloc, "a protection key per heap space, to gate a guarded filter's calls"),
    (libc::SYS_pkey_mprotect, "give the heap spaces and the rings their keys: never executable"),
];

/// Extra system calls of a domain that takes attached applications' queues while it runs.
const ATTACH: &[(i64, &str)] = &[
    (libc::SYS_recvmsg, "take an attached queue's descriptors from the attach line (the socket was made by the supervisor)"),
    (libc::SYS_sendmsg, "answer on the attach line"),
    (libc::SYS_close, "let go of a detached queue's descriptors"),
    (libc::SYS_epoll_ctl, "watch an attached queue's doorbell, and stop when it leaves"),
    (libc::SYS_fstat, "check an attached queue's arena sizes"),
    (libc::SYS_newfstatat, "as fstat (libc may use this form)"),
    (libc::SYS_fcntl, "make an attached queue's doorbells non-blocking"),
];

/// Extra system calls of an `rbd` domain: what librados and librbd make once connected, each
/// for their own threads and sockets. Files stay closed: `openat` is not here (librados looks
/// for keyrings and configuration files and carries on without them).
const RBD: &[(i64, &str)] = &[
    (
        libc::SYS_socket,
        "passed to the supervisor by the connect filter, which makes a TCP socket in the host's network namespace \
         (the domain's is empty) and returns it",
    ),
    (
        libc::SYS_connect,
        "passed to the supervisor by the connect filter, which connects the socket to the address if it is the \
         cluster's and refuses it otherwise",
    ),
    (libc::SYS_setsockopt, "TCP_NODELAY and buffer sizes on the cluster sockets"),
    (libc::SYS_getsockopt, "SO_ERROR after a non-blocking connect"),
    (libc::SYS_getsockname, "the messenger learns its own address"),
    (libc::SYS_getpeername, "the messenger checks its peer"),
    (libc::SYS_sendmsg, "messages to the cluster (never MSG_FASTOPEN)"),
    (libc::SYS_recvmsg, "messages from the cluster"),
    (libc::SYS_sendto, "messages to the cluster, libc's form (never MSG_FASTOPEN)"),
    (libc::SYS_recvfrom, "messages from the cluster (libc may use this form)"),
    (libc::SYS_shutdown, "closing a connection to an OSD or monitor"),
    (libc::SYS_close, "a closed connection's socket, a finished thread's descriptors"),
    (libc::SYS_epoll_create1, "the messenger's event loops"),
    (libc::SYS_epoll_create, "as epoll_create1 (older form)"),
    (libc::SYS_epoll_ctl, "the messenger's event loops watch their sockets"),
    (libc::SYS_poll, "waits with a deadline"),
    (libc::SYS_ppoll, "as poll (libc may use this form)"),
    (libc::SYS_pipe2, "the messenger's wake-up pipes"),
    (libc::SYS_eventfd2, "the messenger's wake-ups"),
    (libc::SYS_fcntl, "non-blocking sockets"),
    (libc::SYS_clone, "librados's threads: only with CLONE_THREAD, never a new process"),
    (libc::SYS_clone3, "refused with ENOSYS by the connect filter, so that libc makes threads with clone"),
    (libc::SYS_set_robust_list, "a new thread's futex list"),
    (libc::SYS_rseq, "a new thread's restartable sequences"),
    (libc::SYS_sigaltstack, "a new thread's signal stack"),
    (libc::SYS_rt_sigaction, "librados's signal setup"),
    (libc::SYS_prctl, "PR_SET_NAME only: librados names its threads"),
    (libc::SYS_uname, "librados's host name"),
    (libc::SYS_sched_getaffinity, "thread pool sizes"),
    (libc::SYS_nanosleep, "librados's timers"),
    (libc::SYS_clock_nanosleep, "librados's timers (libc may use this form)"),
];

fn cond(arg: u8, len: SeccompCmpArgLen, op: SeccompCmpOp, v: u64) -> SeccompCondition {
    SeccompCondition::new(arg, len, op, v).expect("valid seccomp condition")
}

/// The rules, as (syscall, reason) for documentation and for the filter; `guarded` adds what
/// write capture needs.
pub fn allowlist_guarded(role: Role, guarded: bool) -> Vec<(i64, &'static str)> {
    allowlist_with(role, guarded, false)
}

/// The rules, as (syscall, reason): `role`'s, with what write capture needs if `guarded`,
/// and what taking attached queues needs if `attach` (shared mappings of the memory files
/// that come on the attach line are then allowed too, never executable).
pub fn allowlist_with(role: Role, guarded: bool, attach: bool) -> Vec<(i64, &'static str)> {
    let mut v = allowlist(role);
    for (on, extra) in [(guarded, GUARD), (attach, ATTACH)] {
        if on {
            v.retain(|(nr, _)| !extra.iter().any(|(g, _)| g == nr));
            v.extend_from_slice(extra);
        }
    }
    v
}

/// The rules, as (syscall, reason, conditions) for documentation and for the filter.
pub fn allowlist(role: Role) -> Vec<(i64, &'static str)> {
    let mut v: Vec<(i64, &'static str)> = COMMON.to_vec();
    // An rbd domain may keep a cow overlay's file (passed in; it can open none).
    if matches!(role, Role::FileSync | Role::FileIoUring | Role::NetworkFile | Role::TapFile | Role::VdevFile | Role::Rbd) {
        v.extend_from_slice(FILE);
    }
    if matches!(role, Role::Vdev | Role::VdevFile) {
        v.extend_from_slice(VDEV);
    }
    if role == Role::VdevModel {
        v.extend_from_slice(VDEV_MODEL);
    }
    if matches!(role, Role::Network | Role::NetworkFile) {
        v.extend_from_slice(NETWORK);
    }
    if role == Role::FileIoUring {
        v.extend_from_slice(IO_URING);
    }
    if matches!(role, Role::Tap | Role::TapFile) {
        v.extend_from_slice(TAP);
    }
    if role == Role::Rbd {
        v.extend_from_slice(RBD);
    }
    v.push((libc::SYS_mmap, "the allocator: anonymous private memory only, never executable"));
    v.push((libc::SYS_mprotect, "the allocator: never executable"));
    if matches!(role, Role::FileSync | Role::FileIoUring) {
        v.push((libc::SYS_ioctl, "BLKDISCARD and BLKZEROOUT on a block-device backend only"));
    }
    if role == Role::VdevModel {
        v.push((libc::SYS_ioctl, "UFFDIO_WRITEPROTECT only: open and protect the driver's register page"));
    }
    v
}

/// Builds the BPF program for `role`, with what write capture needs if `guarded`: EPERM for
/// anything not allowed.
pub fn filter(role: Role, guarded: bool) -> Result<seccompiler::BpfProgram, Unavailable> {
    filter_with(role, guarded, false)
}

/// [`filter`], with what taking attached queues needs if `attach` (see [`allowlist_with`]).
pub fn filter_with(role: Role, guarded: bool, attach: bool) -> Result<seccompiler::BpfProgram, Unavailable> {
    let mut ioctls = Vec::new();
    if matches!(role, Role::FileSync | Role::FileIoUring) {
        ioctls.extend([BLKDISCARD, BLKZEROOUT]);
    }
    if role == Role::VdevModel || guarded {
        ioctls.push(UFFDIO_WRITEPROTECT);
    }
    let conditions = Conditions { shared_mmap: attach, pkey_mprotect: guarded, ioctls, rbd: role == Role::Rbd };
    compile(allowlist_with(role, guarded, attach), conditions)
}

const BLKDISCARD: u64 = 0x1277;
const BLKZEROOUT: u64 = 0x127f;
const BLKGETSIZE64: u64 = 0x8008_1272;
const UFFDIO_WRITEPROTECT: u64 = 0xC018_AA06;
const UFFDIO_API: u64 = 0xC018_AA3F;
const UFFDIO_REGISTER: u64 = 0xC020_AA00;

/// The argument checks a filter makes beyond its list of system calls.
#[derive(Debug, Clone, Default)]
pub struct Conditions {
    /// `mmap` may map shared files too (attached queues' rings and arenas), not only
    /// anonymous private memory.
    pub shared_mmap: bool,
    /// `pkey_mprotect` is allowed, never executable.
    pub pkey_mprotect: bool,
    /// The `ioctl` commands allowed (none: `ioctl` as the list says).
    pub ioctls: Vec<u64>,
    /// An `rbd` domain's: sockets of the internet families only, threads only, `PR_SET_NAME`
    /// only, never `MSG_FASTOPEN`.
    pub rbd: bool,
}

impl Conditions {
    /// A spare's first filter ([`crate::spare`]): shared mappings (every queue's), protection
    /// keys, and the `ioctl` commands of any role it may take and of write capture's setup.
    pub fn spare() -> Conditions {
        Conditions {
            shared_mmap: true,
            pkey_mprotect: true,
            ioctls: vec![BLKDISCARD, BLKZEROOUT, BLKGETSIZE64, UFFDIO_WRITEPROTECT, UFFDIO_API, UFFDIO_REGISTER],
            rbd: false,
        }
    }
}

/// Compiles `allowlist` into a filter that refuses everything else with EPERM, making the
/// checks of `conditions`; `mmap` and `mprotect` are never executable.
pub fn compile(allowlist: Vec<(i64, &'static str)>, conditions: Conditions) -> Result<seccompiler::BpfProgram, Unavailable> {
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> = BTreeMap::new();
    for (nr, _) in allowlist {
        rules.insert(nr, vec![]);
    }
    use SeccompCmpArgLen::{Dword, Qword};
    use SeccompCmpOp::{Eq, MaskedEq};
    let rule = |c: Vec<SeccompCondition>| SeccompRule::new(c).map_err(|e| Unavailable(e.to_string()));
    let no_exec = cond(2, Dword, MaskedEq(libc::PROT_EXEC as u64), 0);
    let anon = libc::MAP_ANONYMOUS as u64 | libc::MAP_PRIVATE as u64;
    let mut mmap = vec![rule(vec![no_exec.clone(), cond(3, Dword, MaskedEq(anon | libc::MAP_SHARED as u64), anon)])?];
    if conditions.shared_mmap {
        let shared = libc::MAP_ANONYMOUS as u64 | libc::MAP_SHARED as u64 | libc::MAP_PRIVATE as u64;
        mmap.push(rule(vec![no_exec.clone(), cond(3, Dword, MaskedEq(shared), libc::MAP_SHARED as u64)])?);
    }
    rules.insert(libc::SYS_mmap, mmap);
    rules.insert(libc::SYS_mprotect, vec![rule(vec![no_exec.clone()])?]);
    if conditions.pkey_mprotect {
        rules.insert(libc::SYS_pkey_mprotect, vec![rule(vec![no_exec])?]);
    }
    if !conditions.ioctls.is_empty() {
        let each = conditions.ioctls.iter().map(|&cmd| rule(vec![cond(1, Qword, Eq, cmd)])).collect::<Result<Vec<_>, _>>()?;
        rules.insert(libc::SYS_ioctl, each);
    }
    if conditions.rbd {
        rules.insert(
            libc::SYS_socket,
            vec![rule(vec![cond(0, Dword, Eq, libc::AF_INET as u64)])?, rule(vec![cond(0, Dword, Eq, libc::AF_INET6 as u64)])?],
        );
        let thread = libc::CLONE_THREAD as u64;
        rules.insert(libc::SYS_clone, vec![rule(vec![cond(0, Qword, MaskedEq(thread), thread)])?]);
        rules.insert(libc::SYS_prctl, vec![rule(vec![cond(0, Dword, Eq, libc::PR_SET_NAME as u64)])?]);
        let fast_open = libc::MSG_FASTOPEN as u64;
        rules.insert(libc::SYS_sendmsg, vec![rule(vec![cond(2, Dword, MaskedEq(fast_open), 0)])?]);
        rules.insert(libc::SYS_sendto, vec![rule(vec![cond(3, Dword, MaskedEq(fast_open), 0)])?]);
    }
    let f = SeccompFilter::new(rules, SeccompAction::Errno(libc::EPERM as u32), SeccompAction::Allow, TargetArch::x86_64)
        .map_err(|e| Unavailable(e.to_string()))?;
    f.try_into().map_err(|e: seccompiler::BackendError| Unavailable(e.to_string()))
}

/// Installs the filter for `role` (`guarded`: with write capture's calls) on the calling
/// thread (the domain is single-threaded).
pub fn apply(role: Role, guarded: bool, attach: bool) -> Result<(), Unavailable> {
    let prog = filter_with(role, guarded, attach)?;
    seccompiler::apply_filter(&prog).map_err(|e| Unavailable(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_role_compiles_and_lists_a_reason_per_syscall() {
        for role in Role::ALL {
            assert!(filter(role, false).is_ok() && filter(role, true).is_ok(), "{role:?}");
            for (nr, why) in allowlist(role) {
                assert!(!why.is_empty(), "syscall {nr} has no reason");
            }
        }
        let mem: Vec<i64> = allowlist(Role::Memory).iter().map(|x| x.0).collect();
        assert!(!mem.contains(&libc::SYS_pwrite64), "memory role cannot write files");
        for banned in
            [libc::SYS_openat, libc::SYS_socket, libc::SYS_clone, libc::SYS_execve, libc::SYS_ptrace, libc::SYS_setrlimit]
        {
            assert!(!allowlist(Role::FileIoUring).iter().any(|x| x.0 == banned), "{banned} must not be allowed");
        }
        for role in [Role::Vdev, Role::VdevModel] {
            let l: Vec<i64> = allowlist(role).iter().map(|x| x.0).collect();
            for banned in [libc::SYS_socket, libc::SYS_sendmsg, libc::SYS_openat, libc::SYS_pwrite64, libc::SYS_userfaultfd] {
                assert!(!l.contains(&banned), "{role:?} must not make {banned}");
            }
        }
        let rbd: Vec<i64> = allowlist(Role::Rbd).iter().map(|x| x.0).collect();
        for banned in [
            libc::SYS_openat,
            libc::SYS_open,
            libc::SYS_execve,
            libc::SYS_ioctl,
            libc::SYS_bind,
            libc::SYS_listen,
            libc::SYS_ptrace,
        ] {
            assert!(!rbd.contains(&banned), "an rbd domain must not make {banned}");
        }
        let net: Vec<i64> = allowlist(Role::Network).iter().map(|x| x.0).collect();
        assert!(!net.contains(&libc::SYS_pwrite64) && !net.contains(&libc::SYS_ioctl), "network role touches no file");
        for banned in [libc::SYS_socket, libc::SYS_connect, libc::SYS_bind, libc::SYS_accept4, libc::SYS_openat] {
            assert!(!net.contains(&banned), "network role must not make connections ({banned})");
        }
    }

    #[test]
    fn filter_denies_open_with_eperm_and_allows_io() {
        // SAFETY: the child only makes plain system calls and exits.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            // SAFETY: plain prctl.
            unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) };
            let code = if apply(Role::Memory, false, false).is_err() {
                3
            } else {
                // SAFETY: constant path.
                let fd = unsafe { libc::open(c"/etc/hostname".as_ptr(), libc::O_RDONLY) };
                let e = std::io::Error::last_os_error().raw_os_error().unwrap_or(0);
                // SAFETY: a zero-length write from a valid pointer.
                let ok_write = unsafe { libc::write(2, c"".as_ptr().cast(), 0) } == 0;
                if fd < 0 && e == libc::EPERM && ok_write {
                    0
                } else {
                    1
                }
            };
            // SAFETY: leave the child without the parent's destructors.
            unsafe { libc::_exit(code) };
        }
        let mut st = 0;
        // SAFETY: waiting for our child.
        unsafe { libc::waitpid(pid, &mut st, 0) };
        assert_eq!(libc::WEXITSTATUS(st), 0);
    }

    /// Maps `fd` shared with `prot`; whether the kernel allowed it.
    fn maps_shared(fd: i32, prot: i32) -> bool {
        // SAFETY: a fresh mapping of a memory file this process owns, unmapped at once.
        unsafe {
            let p = libc::mmap(std::ptr::null_mut(), 4096, prot, libc::MAP_SHARED, fd, 0);
            if p == libc::MAP_FAILED {
                return false;
            }
            libc::munmap(p, 4096);
        }
        true
    }

    #[test]
    fn attach_extras_map_received_memory_shared_but_never_executable() {
        let l: Vec<i64> = allowlist_with(Role::Memory, false, true).iter().map(|x| x.0).collect();
        for needed in [libc::SYS_recvmsg, libc::SYS_close, libc::SYS_epoll_ctl, libc::SYS_fstat] {
            assert!(l.contains(&needed), "attach needs {needed}");
        }
        for banned in [libc::SYS_socket, libc::SYS_connect, libc::SYS_openat, libc::SYS_memfd_create] {
            assert!(!l.contains(&banned), "attach must not allow {banned}");
        }
        // SAFETY: plain memfd_create with a constant name.
        let fd = unsafe { libc::memfd_create(c"seccomp-attach".as_ptr(), 0) };
        // SAFETY: sizing the file just made.
        assert!(fd >= 0 && unsafe { libc::ftruncate(fd, 4096) } == 0);
        for attach in [false, true] {
            // SAFETY: the child only makes plain system calls and exits.
            let pid = unsafe { libc::fork() };
            if pid == 0 {
                // SAFETY: plain prctl.
                unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) };
                let code = if apply(Role::Memory, false, attach).is_err() {
                    3
                } else {
                    let rw = maps_shared(fd, libc::PROT_READ | libc::PROT_WRITE);
                    let exec = maps_shared(fd, libc::PROT_READ | libc::PROT_EXEC);
                    i32::from(rw != attach) + 2 * i32::from(exec)
                };
                // SAFETY: leave the child without the parent's destructors.
                unsafe { libc::_exit(code) };
            }
            let mut st = 0;
            // SAFETY: waiting for our child.
            unsafe { libc::waitpid(pid, &mut st, 0) };
            assert_eq!(
                libc::WEXITSTATUS(st),
                0,
                "attach {attach}: 1 = shared mapping allowed wrongly or refused, 2 = executable"
            );
        }
        // SAFETY: closing the file made above.
        unsafe { libc::close(fd) };
    }
}
