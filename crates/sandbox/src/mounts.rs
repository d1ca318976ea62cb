//! An empty filesystem view for a domain.
//!
//! A mount namespace made by copying the host's holds a reference on every filesystem
//! mounted at that moment. That is more than an information leak: a filesystem mounted on the
//! very device the domain serves (ext4 on a loop device over the FUSE file) stays alive in the
//! copy after the host unmounts it. The host's `umount` then returns without shutting it down;
//! it goes on writing back behind the unmount, so a reader of the device sees its last
//! metadata land seconds later, and when the domain exits the kernel shuts it down from the
//! domain's exit path, syncing it through the domain that is exiting.
//!
//! Where the copy is made decides whether it can be let go. A copy made in a new *user*
//! namespace (clone3 with `CLONE_NEWUSER | CLONE_NEWNS`) is locked: its mounts came from a
//! more privileged namespace, and a lazily detached locked mount stays connected to its
//! detached parent, the copied root, which the domain's executable and libraries (mapped from
//! that copy at exec) keep alive until the domain exits. So the domain is spawned without
//! `CLONE_NEWNS`: it execs in the host's mount namespace, its executable and libraries mapped
//! from the host's mounts, and only here, confining itself, does it take a namespace of its
//! own (`unshare(CLONE_NEWNS)`), replace its root with an empty read-only tmpfs and detach
//! the whole copied tree (the `pivot_root(".", ".")` sequence of pivot_root(2)). Nothing in
//! the domain refers to the copy any more, so the kernel frees it at once, locked mounts
//! included, and the namespace holds exactly one mount. The copy lives for the few system
//! calls between the `unshare` and the detach.

use crate::Unavailable;
use std::ffi::CStr;
use std::io;

fn check(op: &str, rc: libc::c_int) -> Result<(), Unavailable> {
    if rc < 0 {
        return Err(Unavailable(format!("{op}: {}", io::Error::last_os_error())));
    }
    Ok(())
}

/// Directories tried, in order, as the place to mount the new root: any existing directory
/// works, it only has to exist in the copied tree.
const MOUNT_POINTS: [&CStr; 4] = [c"/tmp", c"/mnt", c"/dev", c"/proc"];

/// Moves this process into a mount namespace of its own whose only mount is an empty
/// read-only tmpfs at its root. Call only in a user namespace of the domain's own (which gives
/// it the right to make a mount namespace), single-threaded, before anything is opened by path
/// that must stay reachable.
pub fn isolate() -> Result<(), Unavailable> {
    // A namespace is taken per thread: another thread would stay in the host's.
    let threads = std::fs::read_dir("/proc/self/task").map(|d| d.count()).unwrap_or(0);
    if threads != 1 {
        return Err(Unavailable(format!("{threads} threads: a mount namespace of its own would hold only one of them")));
    }
    // SAFETY: plain mount-namespace system calls on NUL-terminated constant strings; none
    // touches this process's memory beyond reading those strings.
    unsafe {
        check("a mount namespace of its own", libc::unshare(libc::CLONE_NEWNS))?;
        // Nothing done below may propagate back to the host.
        check(
            "make mounts private",
            libc::mount(std::ptr::null(), c"/".as_ptr(), std::ptr::null(), libc::MS_REC | libc::MS_PRIVATE, std::ptr::null()),
        )?;
        let flags = libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC;
        let mut last = Unavailable(String::new());
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
