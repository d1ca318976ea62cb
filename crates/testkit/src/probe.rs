//! An escape probe: from inside a confined domain, try what a hostile driver would, and report
//! how each attempt failed. Run by the test driver (`bulkhead-test-driver`) under
//! `BULKHEAD_TEST_FAULT=escape`; the sandbox tests assert the exact errno of each attempt.

use std::fmt::Write as _;

/// What the probe may aim at.
#[derive(Debug, Clone, Copy)]
pub struct Targets {
    /// A process outside the domain (the supervisor), by its pid outside.
    pub outside_pid: i32,
    /// The start of the read-only write arena mapping.
    pub write_arena: *mut u8,
    /// Its length.
    pub write_arena_len: usize,
    /// A shared descriptor held by the domain (the ring file).
    pub shared_fd: i32,
    /// The write arena's (read-only) descriptor.
    pub write_arena_fd: i32,
}

fn errno_of(rc: i64) -> String {
    if rc >= 0 {
        return "succeeded".into();
    }
    let e = std::io::Error::last_os_error().raw_os_error().unwrap_or(0);
    let name = match e {
        libc::EPERM => "EPERM",
        libc::EACCES => "EACCES",
        libc::ENOMEM => "ENOMEM",
        libc::EBADF => "EBADF",
        libc::ESRCH => "ESRCH",
        libc::EINVAL => "EINVAL",
        libc::EMFILE => "EMFILE",
        _ => return format!("errno {e}"),
    };
    name.into()
}

/// Tries each escape and returns `name=outcome` pairs as one JSON object.
pub fn attempt_escapes(t: &Targets) -> String {
    let mut out: Vec<(&str, String)> = Vec::new();
    // SAFETY: every call below is a plain system call with valid (or deliberately hostile but
    // kernel-checked) arguments; none dereferences memory in this process except `buf`.
    unsafe {
        out.push(("open_file", errno_of(libc::open(c"/etc/passwd".as_ptr(), libc::O_RDONLY) as i64)));
        out.push(("openat_proc_mem", errno_of(libc::openat(libc::AT_FDCWD, c"/proc/1/mem".as_ptr(), libc::O_RDWR) as i64)));
        out.push(("socket_inet", errno_of(libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0) as i64)));
        out.push(("socket_unix", errno_of(libc::socket(libc::AF_UNIX, libc::SOCK_STREAM, 0) as i64)));
        // System V and POSIX IPC, and a pair of unix sockets: what two domains sharing a
        // network and IPC namespace could otherwise meet through.
        let mut pair = [0; 2];
        out.push(("socketpair_unix", errno_of(libc::socketpair(libc::AF_UNIX, libc::SOCK_STREAM, 0, pair.as_mut_ptr()) as i64)));
        out.push(("shmget", errno_of(libc::shmget(0x6268, 4096, libc::IPC_CREAT | 0o600) as i64)));
        out.push(("msgget", errno_of(libc::msgget(0x6268, libc::IPC_CREAT | 0o600) as i64)));
        out.push(("semget", errno_of(libc::semget(0x6268, 1, libc::IPC_CREAT | 0o600) as i64)));
        let mode: libc::mode_t = 0o600;
        out.push((
            "mq_open",
            errno_of(libc::syscall(
                libc::SYS_mq_open,
                c"bulkhead".as_ptr(),
                libc::O_CREAT | libc::O_RDWR,
                mode,
                std::ptr::null::<u8>(),
            )),
        ));
        out.push(("ptrace_attach", errno_of(libc::ptrace(libc::PTRACE_ATTACH, t.outside_pid, 0, 0))));
        let mut buf = [0u8; 16];
        let local = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: 16 };
        let remote = libc::iovec { iov_base: 0x1000 as *mut _, iov_len: 16 };
        out.push(("process_vm_readv", errno_of(libc::process_vm_readv(t.outside_pid, &local, 1, &remote, 1, 0) as i64)));
        out.push(("kill_outside", errno_of(libc::kill(t.outside_pid, 0) as i64)));
        out.push(("fork", errno_of(libc::syscall(libc::SYS_fork))));
        out.push(("clone3", errno_of(libc::syscall(libc::SYS_clone3, std::ptr::null::<u8>(), 0usize))));
        let argv = [c"/bin/true".as_ptr(), std::ptr::null()];
        out.push(("execve", errno_of(libc::execve(c"/bin/true".as_ptr(), argv.as_ptr(), std::ptr::null()) as i64)));
        out.push((
            "mprotect_write_arena_rw",
            errno_of(libc::mprotect(t.write_arena.cast(), t.write_arena_len, libc::PROT_READ | libc::PROT_WRITE) as i64),
        ));
        out.push(("pwrite_write_arena", errno_of(libc::pwrite(t.write_arena_fd, buf.as_ptr().cast(), 16, 0) as i64)));
        let p =
            libc::mmap(std::ptr::null_mut(), 1 << 20, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, t.write_arena_fd, 0);
        out.push(("mmap_write_arena_shared_rw", if p == libc::MAP_FAILED { errno_of(-1) } else { "succeeded".into() }));
        let p = libc::mmap(std::ptr::null_mut(), 1 << 30, libc::PROT_READ, libc::MAP_SHARED, t.shared_fd, 1 << 40);
        out.push(("mmap_beyond_ring", if p == libc::MAP_FAILED { errno_of(-1) } else { "succeeded".into() }));
        let p = libc::mmap(
            std::ptr::null_mut(),
            64 << 30,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        );
        out.push(("mmap_anon_64g", if p == libc::MAP_FAILED { errno_of(-1) } else { "succeeded".into() }));
        let p = libc::mmap(
            std::ptr::null_mut(),
            4096,
            libc::PROT_READ | libc::PROT_EXEC,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        );
        out.push(("mmap_exec", if p == libc::MAP_FAILED { errno_of(-1) } else { "succeeded".into() }));
        let big = libc::rlimit { rlim_cur: 1 << 20, rlim_max: 1 << 20 };
        out.push(("setrlimit_nofile", errno_of(libc::setrlimit(libc::RLIMIT_NOFILE, &big) as i64)));
        out.push(("prlimit_as", errno_of(libc::prlimit(0, libc::RLIMIT_AS, &big, std::ptr::null_mut()) as i64)));
    }
    let mut s = String::from("{");
    for (i, (k, v)) in out.iter().enumerate() {
        let _ = write!(s, "{}\"{k}\":\"{v}\"", if i > 0 { "," } else { "" });
    }
    s.push('}');
    s
}

/// The last attempt: store into the read-only write arena. The process dies with SIGSEGV.
///
/// # Safety
/// `p` must be the start of a mapping of at least one byte; the write is meant to fault.
pub unsafe fn write_into_readonly(p: *mut u8) {
    // SAFETY: deliberately faulting store, see the function contract.
    unsafe { std::ptr::write_volatile(p, 0x42) };
}
