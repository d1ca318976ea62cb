//! A memory file mapped shared, for memory that lives as long as the process (the guarded
//! heap), without the shared-memory crate's bookkeeping.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

/// A close-on-exec memory file of `len` bytes (sparse: pages are allocated as they are written).
pub fn create(name: &str, len: u64) -> io::Result<OwnedFd> {
    let cname = CString::new(name).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: `cname` is NUL-terminated and outlives the call.
    let fd = unsafe { libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: memfd_create returned a fresh descriptor, owned from here on.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let len = libc::off_t::try_from(len).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: a plain system call on a descriptor this function owns.
    if unsafe { libc::ftruncate(fd.as_raw_fd(), len) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(fd)
}

/// Maps `len` bytes of `fd` read-write and shared, with `flags` added (`MAP_NORESERVE`), and
/// returns the address. The mapping is never unmapped: it lives as long as the process.
pub fn map_shared(fd: &OwnedFd, len: u64, flags: libc::c_int) -> io::Result<u64> {
    // SAFETY: a new mapping at an address the kernel chooses, so no existing memory changes.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len as usize,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED | flags,
            fd.as_raw_fd(),
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    Ok(p as u64)
}
