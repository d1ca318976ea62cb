//! The plain system calls several of bulkhead's crates need, each wrapped once here with its
//! safety argument, so the supervisor and others can `forbid(unsafe_code)` (crosvm's `base` is
//! the model). Shared memory has its own crate (`bulkhead-shmem`), doorbells theirs.
#![deny(missing_docs)]

pub mod uffd;
pub mod uring;

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

/// A pipe, both ends close-on-exec: (read end, write end).
pub fn pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut p = [0; 2];
    // SAFETY: `p` is a valid array of two ints for pipe2 to fill.
    if unsafe { libc::pipe2(p.as_mut_ptr(), libc::O_CLOEXEC) } < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: pipe2 returned two fresh descriptors, owned from here on.
    Ok(unsafe { (OwnedFd::from_raw_fd(p[0]), OwnedFd::from_raw_fd(p[1])) })
}

/// `pidfd_open(2)`: a descriptor that turns readable when process `pid` exits.
pub fn pidfd_open(pid: u32) -> io::Result<OwnedFd> {
    // SAFETY: a system call with integer arguments only.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::c_int, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: pidfd_open returned a fresh descriptor, owned from here on.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// Size in bytes of a regular file or a block device, and whether it is a block device.
pub fn storage_size(fd: BorrowedFd<'_>) -> io::Result<(u64, bool)> {
    let meta = std::fs::File::from(fd.try_clone_to_owned()?).metadata()?;
    use std::os::unix::fs::FileTypeExt;
    if meta.file_type().is_block_device() {
        // BLKGETSIZE64 = _IOR(0x12, 114, size_t)
        const BLKGETSIZE64: libc::c_ulong = 0x8008_1272;
        let mut size: u64 = 0;
        // SAFETY: BLKGETSIZE64 writes one u64 into `size`, which outlives the call.
        if unsafe { libc::ioctl(fd.as_raw_fd(), BLKGETSIZE64, &mut size) } < 0 {
            return Err(io::Error::last_os_error());
        }
        return Ok((size, true));
    }
    if !meta.file_type().is_file() {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "not a regular file or block device"));
    }
    Ok((meta.len(), false))
}

/// Waits until one of `fds` is ready or `timeout_ms` passes (negative: no limit); returns how
/// many are ready (each entry's `revents` says which). An interrupted wait counts as none ready.
pub fn poll(fds: &mut [libc::pollfd], timeout_ms: i32) -> io::Result<usize> {
    // SAFETY: `fds` is a valid, exclusively borrowed array of pollfd of the length passed.
    let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout_ms) };
    if n < 0 {
        let e = io::Error::last_os_error();
        return if e.kind() == io::ErrorKind::Interrupted { Ok(0) } else { Err(e) };
    }
    Ok(n as usize)
}

/// CPU time the calling thread has used, ns.
pub fn thread_cpu_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes one timespec, which outlives the call.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Takes ownership of descriptor `fd`, inherited at exec for this purpose; fails if it is not
/// open.
///
/// # Safety
/// `fd` must be this process's to own (inherited for it, used by nothing else) and claimed once.
pub unsafe fn claim_inherited(fd: RawFd) -> io::Result<OwnedFd> {
    // SAFETY: F_GETFD only reads the descriptor's flags.
    if fd < 3 || unsafe { libc::fcntl(fd, libc::F_GETFD) } < 0 {
        return Err(io::Error::new(io::ErrorKind::NotFound, format!("descriptor {fd} is not open")));
    }
    // SAFETY: the caller guarantees the descriptor is this process's alone.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::os::fd::AsFd;

    #[test]
    fn pipe_carries_bytes_and_poll_sees_them() {
        let (r, w) = pipe().unwrap();
        let mut pfd = [libc::pollfd { fd: r.as_raw_fd(), events: libc::POLLIN, revents: 0 }];
        assert_eq!(poll(&mut pfd, 0).unwrap(), 0);
        std::fs::File::from(w).write_all(b"x").unwrap();
        assert_eq!(poll(&mut pfd, 1000).unwrap(), 1);
        let mut b = [0u8; 1];
        std::fs::File::from(r).read_exact(&mut b).unwrap();
        assert_eq!(&b, b"x");
    }

    #[test]
    fn pidfd_of_ourselves_opens_and_storage_size_reads_a_file() {
        assert!(pidfd_open(std::process::id()).is_ok());
        let path = std::env::temp_dir().join(format!("bulkhead-sys-{}", std::process::id()));
        let f = std::fs::File::create(&path).unwrap();
        f.set_len(12345).unwrap();
        assert_eq!(storage_size(f.as_fd()).unwrap(), (12345, false));
        std::fs::remove_file(&path).unwrap();
        let (r, _w) = pipe().unwrap();
        assert!(storage_size(r.as_fd()).is_err(), "a pipe is no storage");
    }

    #[test]
    fn claiming_a_closed_descriptor_fails() {
        // SAFETY: descriptor 1000 is not open here, which is what is tested.
        assert!(unsafe { claim_inherited(1000) }.is_err());
    }
}
