//! Landlock through its three system calls: a ruleset that handles every access right the
//! kernel knows and grants none.

use crate::Unavailable;
use std::os::fd::{FromRawFd, OwnedFd};

const SYS_LANDLOCK_CREATE_RULESET: libc::c_long = 444;
const SYS_LANDLOCK_RESTRICT_SELF: libc::c_long = 446;
const LANDLOCK_CREATE_RULESET_VERSION: u32 = 1;

#[repr(C)]
struct RulesetAttr {
    handled_access_fs: u64,
    handled_access_net: u64,
    scoped: u64,
}

/// The kernel's Landlock ABI version (0 if Landlock is unavailable).
pub fn abi() -> u32 {
    // SAFETY: the version query takes a null attribute and size 0.
    let v = unsafe {
        libc::syscall(SYS_LANDLOCK_CREATE_RULESET, std::ptr::null::<RulesetAttr>(), 0usize, LANDLOCK_CREATE_RULESET_VERSION)
    };
    if v < 0 {
        0
    } else {
        v as u32
    }
}

/// Every filesystem right of `abi` (v1: 13 rights; v2 REFER; v3 TRUNCATE; v5 IOCTL_DEV).
fn fs_rights(abi: u32) -> u64 {
    let mut r = (1u64 << 13) - 1;
    if abi >= 2 {
        r |= 1 << 13;
    }
    if abi >= 3 {
        r |= 1 << 14;
    }
    if abi >= 5 {
        r |= 1 << 15;
    }
    r
}

/// Forbids, for the calling process and its future children, every filesystem access, TCP
/// bind and connect (ABI 4+), and signals and abstract unix sockets reaching outside the domain
/// (ABI 6+). Needs no_new_privs first. Returns the ABI used.
pub fn deny_all() -> Result<u32, Unavailable> {
    let abi = abi();
    if abi == 0 {
        return Err(Unavailable("Landlock is not enabled in this kernel".into()));
    }
    let attr = RulesetAttr {
        handled_access_fs: fs_rights(abi),
        handled_access_net: if abi >= 4 { 0b11 } else { 0 },
        scoped: if abi >= 6 { 0b11 } else { 0 },
    };
    let size = match abi {
        1..=3 => 8,
        4 | 5 => 16,
        _ => 24,
    };
    // SAFETY: `attr` is valid for `size` bytes (a prefix of the struct).
    let fd = unsafe { libc::syscall(SYS_LANDLOCK_CREATE_RULESET, &attr as *const RulesetAttr, size as usize, 0u32) };
    if fd < 0 {
        return Err(Unavailable(format!("landlock_create_ruleset: {}", std::io::Error::last_os_error())));
    }
    // SAFETY: fresh descriptor from the kernel.
    let fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
    // SAFETY: restricts the calling thread with a ruleset descriptor we own.
    if unsafe { libc::syscall(SYS_LANDLOCK_RESTRICT_SELF, std::os::fd::AsRawFd::as_raw_fd(&fd), 0u32) } < 0 {
        return Err(Unavailable(format!("landlock_restrict_self: {}", std::io::Error::last_os_error())));
    }
    Ok(abi)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `f` in a forked child and returns its exit code (so the restriction does not leak
    /// into the test process).
    fn in_child(f: impl FnOnce() -> i32) -> i32 {
        // SAFETY: the child only runs `f` (plain system calls) and exits.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            let code = f();
            // SAFETY: leave the child without running the parent's destructors.
            unsafe { libc::_exit(code) };
        }
        let mut st = 0;
        // SAFETY: waiting for our own child.
        unsafe { libc::waitpid(pid, &mut st, 0) };
        libc::WEXITSTATUS(st)
    }

    #[test]
    fn deny_all_forbids_opening_any_file() {
        if abi() == 0 {
            eprintln!("SKIP: no Landlock");
            return;
        }
        let code = in_child(|| {
            // SAFETY: plain prctl.
            unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) };
            if deny_all().is_err() {
                return 2;
            }
            // SAFETY: constant NUL-terminated path.
            let fd = unsafe { libc::open(c"/etc/hostname".as_ptr(), libc::O_RDONLY) };
            let e = std::io::Error::last_os_error().raw_os_error().unwrap_or(0);
            if fd < 0 && e == libc::EACCES {
                0
            } else {
                1
            }
        });
        assert_eq!(code, 0, "open after deny_all must fail with EACCES");
    }
}
