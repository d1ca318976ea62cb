//! An empty filesystem view for a domain.
//!
//! `clone3(CLONE_NEWNS)` gives a domain a *copy* of the host's mount tree. A copy holds a
//! reference on every filesystem mounted at that moment, and mounts made later on shared host
//! mounts propagate into it. That is more than an information leak: a filesystem mounted on
//! the very device the domain serves stays alive in the domain's namespace after the host
//! unmounts it, and when the domain exits the kernel shuts that filesystem down from the
//! domain's exit path — syncing it through the domain that is exiting, which never returns.
//!
//! So a domain in its own mount namespace replaces its root with an empty, read-only tmpfs and
//! detaches the whole copied tree (the `pivot_root(".", ".")` sequence of pivot_root(2)).
//! Afterwards the namespace holds exactly one mount, and nothing in the domain can reach a host
//! filesystem. It may still *pin* one: the copied mounts are locked (they came from a more
//! privileged namespace), and a lazily detached locked mount stays connected to its detached
//! parent, the copied root, which the domain's own executable and libraries keep alive until
//! it exits. The supervisor therefore treats a domain whose memory is released as dead without
//! waiting for its exit to end (`proc_info::memory_released`), so the sync above runs through
//! the domain's successor instead of waiting for it forever.

use std::ffi::CStr;
use std::io;

fn check(op: &str, rc: libc::c_int) -> Result<(), String> {
    if rc < 0 {
        return Err(format!("{op}: {}", io::Error::last_os_error()));
    }
    Ok(())
}

/// Directories tried, in order, as the place to mount the new root: any existing directory
/// works, it only has to exist in the copied tree.
const MOUNT_POINTS: [&CStr; 4] = [c"/tmp", c"/mnt", c"/dev", c"/proc"];

/// Replaces the root of this process's mount namespace with an empty read-only tmpfs and
/// detaches every other mount. Call only in a mount namespace of the domain's own — in the
/// host's namespace this would take the host's filesystems away from this process (and its
/// threads) only, but is still never what is wanted, so callers check first.
pub fn isolate() -> Result<(), String> {
    // SAFETY: plain mount-namespace system calls on NUL-terminated constant strings; none
    // touches this process's memory beyond reading those strings.
    unsafe {
        // Nothing done below may propagate back to the host.
        check(
            "make mounts private",
            libc::mount(std::ptr::null(), c"/".as_ptr(), std::ptr::null(), libc::MS_REC | libc::MS_PRIVATE, std::ptr::null()),
        )?;
        let flags = libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC;
        let mut last = String::new();
        let mut dir = None;
        for d in MOUNT_POINTS {
            let rc = libc::mount(
                c"bulkhead-empty".as_ptr(),
                d.as_ptr(),
                c"tmpfs".as_ptr(),
                flags,
                c"size=4k,nr_inodes=2,mode=0555".as_ptr().cast(),
            );
            match check("mount tmpfs", rc) {
                Ok(()) => {
                    dir = Some(d);
                    break;
                }
                Err(e) => last = e,
            }
        }
        let dir = dir.ok_or(last)?;
        check("chdir to the new root", libc::chdir(dir.as_ptr()))?;
        check("pivot_root", libc::syscall(libc::SYS_pivot_root, c".".as_ptr(), c".".as_ptr()) as libc::c_int)?;
        // The old root now sits on top of the new one; detach it with everything below it.
        check("detach the old root", libc::umount2(c".".as_ptr(), libc::MNT_DETACH))?;
        check("chdir /", libc::chdir(c"/".as_ptr()))?;
        // Read-only from here on.
        check(
            "remount the root read-only",
            libc::mount(
                std::ptr::null(),
                c"/".as_ptr(),
                std::ptr::null(),
                libc::MS_REMOUNT | libc::MS_BIND | libc::MS_RDONLY | flags,
                std::ptr::null(),
            ),
        )?;
    }
    Ok(())
}
