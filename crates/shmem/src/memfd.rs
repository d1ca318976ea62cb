//! Memory files: creation, sealing and read-only reopening.

use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use crate::ShmError;

/// Creates a sparse memory file of `size` bytes that allows sealing and is closed on exec
/// (the supervisor clears that flag only on the descriptors it passes to a domain).
///
/// Nothing is allocated until a page is written, so a fresh 1 GiB ramdisk costs no memory.
pub fn create(name: &str, size: u64) -> Result<OwnedFd, ShmError> {
    let cname = CString::new(name).unwrap_or_else(|_| CString::new("bulkhead").unwrap());
    // SAFETY: `cname` is a valid NUL-terminated string that outlives the call.
    let fd = unsafe { libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    if fd < 0 {
        return Err(ShmError::last("memfd_create"));
    }
    // SAFETY: memfd_create returned a fresh descriptor that nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: plain syscall on a descriptor we own.
    if unsafe { libc::ftruncate(fd.as_raw_fd(), size as libc::off_t) } < 0 {
        return Err(ShmError::last("ftruncate"));
    }
    Ok(fd)
}

/// Seals the size of a memory file, so that a peer holding it cannot shrink it (which would make
/// our accesses fault with SIGBUS) or grow it.
pub fn seal_size(fd: RawFd) -> Result<(), ShmError> {
    add_seals(fd, libc::F_SEAL_SHRINK | libc::F_SEAL_GROW)
}

/// Forbids any new writable mapping or `write(2)` of the file; mappings that already exist keep
/// working. Used on write arenas after the frontend has mapped them.
pub fn seal_future_write(fd: RawFd) -> Result<(), ShmError> {
    add_seals(fd, libc::F_SEAL_FUTURE_WRITE)
}

/// The file's seals (`F_SEAL_*` bits). Only memory files carry seals: anything else is an
/// error.
pub fn seals(fd: RawFd) -> Result<libc::c_int, ShmError> {
    // SAFETY: plain fcntl on a descriptor the caller owns.
    let s = unsafe { libc::fcntl(fd, libc::F_GET_SEALS) };
    if s < 0 {
        return Err(ShmError::last("fcntl(F_GET_SEALS)"));
    }
    Ok(s)
}

fn add_seals(fd: RawFd, seals: libc::c_int) -> Result<(), ShmError> {
    // SAFETY: plain fcntl on a descriptor the caller owns.
    if unsafe { libc::fcntl(fd, libc::F_ADD_SEALS, seals) } < 0 {
        return Err(ShmError::last("fcntl(F_ADD_SEALS)"));
    }
    Ok(())
}

/// Reopens a memory file through `/proc/self/fd` with `O_RDONLY`. A peer that receives only this
/// descriptor can never map the file writable: `mmap(PROT_WRITE, MAP_SHARED)` and a later
/// `mprotect` both fail.
pub fn reopen_readonly(fd: RawFd) -> Result<OwnedFd, ShmError> {
    let path = CString::new(format!("/proc/self/fd/{fd}")).expect("no NUL in path");
    // SAFETY: `path` is a valid NUL-terminated string.
    let ro = unsafe { libc::open(path.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) };
    if ro < 0 {
        return Err(ShmError::last("open(/proc/self/fd, O_RDONLY)"));
    }
    // SAFETY: open returned a fresh descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(ro) })
}

/// Size of the file behind `fd`.
pub fn size_of(fd: RawFd) -> Result<u64, ShmError> {
    // SAFETY: `st` is plain data filled in by fstat.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `st` is a valid out pointer for the duration of the call.
    if unsafe { libc::fstat(fd, &mut st) } < 0 {
        return Err(ShmError::last("fstat"));
    }
    Ok(st.st_size as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readonly_reopen_refuses_writable_shared_map() {
        let fd = create("t", 8192).unwrap();
        let ro = reopen_readonly(fd.as_raw_fd()).unwrap();
        let err = crate::Mapping::new(ro.as_raw_fd(), 8192, crate::Protection::ReadWrite).unwrap_err();
        assert!(matches!(err, ShmError::Sys { source, .. } if source.raw_os_error() == Some(libc::EACCES)));
    }

    #[test]
    fn sealed_size_refuses_truncate() {
        let fd = create("t", 8192).unwrap();
        seal_size(fd.as_raw_fd()).unwrap();
        assert_eq!(seals(fd.as_raw_fd()).unwrap() & libc::F_SEAL_SHRINK, libc::F_SEAL_SHRINK);
        // SAFETY: plain syscall on our descriptor.
        let rc = unsafe { libc::ftruncate(fd.as_raw_fd(), 0) };
        assert_eq!(rc, -1);
        assert_eq!(std::io::Error::last_os_error().raw_os_error(), Some(libc::EPERM));
    }

    #[test]
    fn future_write_seal_refuses_new_writable_map() {
        let fd = create("t", 8192).unwrap();
        let _rw = crate::Mapping::new(fd.as_raw_fd(), 8192, crate::Protection::ReadWrite).unwrap();
        seal_future_write(fd.as_raw_fd()).unwrap();
        let err = crate::Mapping::new(fd.as_raw_fd(), 8192, crate::Protection::ReadWrite).unwrap_err();
        assert!(matches!(err, ShmError::Sys { source, .. } if source.raw_os_error() == Some(libc::EPERM)));
    }
}
