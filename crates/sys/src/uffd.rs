//! userfaultfd write protection: a process arms a descriptor over pages of its own, and
//! whoever holds the descriptor (this process or another it was sent to) is told of each
//! write to a protected page, with the writing thread stopped until the page is opened.
//!
//! This is what a trapped register page needs (a virtual device's model learns of the driver's
//! register writes as the virtual PCI bus' fault handler of Jones' virtual device paper did), and
//! what write capture needs to see a guarded filter's writes. The kernel's structures are spelled
//! out here (the `libc` crate has none of them) from `include/uapi/linux/userfaultfd.h`.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

/// `UFFD_API`.
const API: u64 = 0xAA;
/// `UFFD_USER_MODE_ONLY`: faults from user mode only, which unprivileged processes may ask
/// for whatever `vm.unprivileged_userfaultfd` says.
const USER_MODE_ONLY: libc::c_int = 1;
/// `UFFD_FEATURE_WP_HUGETLBFS_SHMEM`: write protection of shared memory (memfd), Linux 5.19.
const FEATURE_WP_SHMEM: u64 = 1 << 12;
/// `UFFD_FEATURE_THREAD_ID`: the faulting thread's id in each message.
const FEATURE_THREAD_ID: u64 = 1 << 8;
/// `UFFD_FEATURE_SIGBUS`: the faulting thread gets SIGBUS instead of waiting for a reader.
const FEATURE_SIGBUS: u64 = 1 << 7;
/// `UFFD_FEATURE_WP_UNPOPULATED`: protecting a range also protects its pages never touched
/// (anonymous memory), Linux 6.4.
const FEATURE_WP_UNPOPULATED: u64 = 1 << 13;
/// `UFFDIO_API = _IOWR(0xAA, 0x3F, struct uffdio_api)`.
const UFFDIO_API: libc::c_ulong = 0xC018_AA3F;
/// `UFFDIO_REGISTER = _IOWR(0xAA, 0x00, struct uffdio_register)`.
const UFFDIO_REGISTER: libc::c_ulong = 0xC020_AA00;
/// `UFFDIO_WRITEPROTECT = _IOWR(0xAA, 0x06, struct uffdio_writeprotect)`.
const UFFDIO_WRITEPROTECT: libc::c_ulong = 0xC018_AA06;
/// `UFFDIO_REGISTER_MODE_WP`.
const REGISTER_MODE_WP: u64 = 2;
/// `UFFDIO_WRITEPROTECT_MODE_WP`.
const WRITEPROTECT_MODE_WP: u64 = 1;
/// `UFFD_EVENT_PAGEFAULT`.
const EVENT_PAGEFAULT: u8 = 0x12;
/// `UFFD_PAGEFAULT_FLAG_WP`.
const PAGEFAULT_FLAG_WP: u64 = 2;

#[repr(C)]
struct UffdioApi {
    api: u64,
    features: u64,
    ioctls: u64,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct UffdioRange {
    start: u64,
    len: u64,
}

#[repr(C)]
struct UffdioRegister {
    range: UffdioRange,
    mode: u64,
    ioctls: u64,
}

#[repr(C)]
struct UffdioWriteprotect {
    range: UffdioRange,
    mode: u64,
}

/// `struct uffd_msg`, of which only page faults are read.
#[repr(C)]
struct UffdMsg {
    event: u8,
    reserved1: u8,
    reserved2: u16,
    reserved3: u32,
    flags: u64,
    address: u64,
    ptid: u32,
    pad: u32,
}

/// A write to a protected page.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WriteFault {
    /// The address written (in the armed process's address space).
    pub address: u64,
    /// The writing thread.
    pub thread: u32,
}

/// A userfaultfd descriptor in write-protect mode.
#[derive(Debug)]
pub struct WriteTrap {
    fd: OwnedFd,
}

impl WriteTrap {
    /// A new descriptor for this process's memory (non-blocking, close-on-exec), with shared
    /// memory write protection. Fails where the kernel lacks it.
    pub fn new() -> io::Result<Self> {
        Self::with_features(FEATURE_WP_SHMEM | FEATURE_THREAD_ID)
    }

    /// A descriptor whose faults are signals: a write to a protected page raises SIGBUS in
    /// the writing thread (at the address written) instead of queueing a [`WriteFault`], so
    /// the thread itself can decide and open the page ([`set_write_protect`]). Protection
    /// covers shared memory and pages never touched. Fails where the kernel lacks any of it.
    pub fn signalling() -> io::Result<Self> {
        Self::with_features(FEATURE_WP_SHMEM | FEATURE_SIGBUS | FEATURE_WP_UNPOPULATED)
    }

    fn with_features(features: u64) -> io::Result<Self> {
        let flags = libc::O_CLOEXEC | libc::O_NONBLOCK | USER_MODE_ONLY;
        // SAFETY: a system call with integer arguments only.
        let fd = unsafe { libc::syscall(libc::SYS_userfaultfd, flags) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: userfaultfd returned a fresh descriptor, owned from here on.
        let fd = unsafe { OwnedFd::from_raw_fd(fd as RawFd) };
        let mut api = UffdioApi { api: API, features, ioctls: 0 };
        // SAFETY: UFFDIO_API reads and writes one uffdio_api, which outlives the call.
        if unsafe { libc::ioctl(fd.as_raw_fd(), UFFDIO_API, &mut api) } < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(WriteTrap { fd })
    }

    /// Takes over a descriptor made by [`new`](Self::new), in this process or another (it
    /// came over a socket). Whether it is one is only known at its first use: every call
    /// then fails.
    pub fn from_fd(fd: OwnedFd) -> Self {
        WriteTrap { fd }
    }

    /// The descriptor, to send or to poll (readable when a fault waits).
    pub fn fd(&self) -> BorrowedFd<'_> {
        // SAFETY: the descriptor is owned by self and open while self lives.
        unsafe { BorrowedFd::borrow_raw(self.fd.as_raw_fd()) }
    }

    /// Registers `[start, start + len)` of this process's memory, page-aligned and already
    /// populated (a page never touched is not protected), for write protection. It is not
    /// protected until [`protect`](Self::protect).
    pub fn register(&self, start: u64, len: u64) -> io::Result<()> {
        let mut reg = UffdioRegister { range: UffdioRange { start, len }, mode: REGISTER_MODE_WP, ioctls: 0 };
        // SAFETY: UFFDIO_REGISTER reads and writes one uffdio_register, which outlives the call;
        // the range is memory of the registering process, checked by the kernel.
        if unsafe { libc::ioctl(self.fd.as_raw_fd(), UFFDIO_REGISTER, &mut reg) } < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Protects the range against writes: the next write to it stops its thread and queues a
    /// [`WriteFault`].
    pub fn protect(&self, start: u64, len: u64) -> io::Result<()> {
        self.writeprotect(start, len, WRITEPROTECT_MODE_WP)
    }

    /// Opens the range for writes and lets every thread stopped on it go on.
    pub fn open(&self, start: u64, len: u64) -> io::Result<()> {
        self.writeprotect(start, len, 0)
    }

    fn writeprotect(&self, start: u64, len: u64, mode: u64) -> io::Result<()> {
        set_write_protect(self.fd.as_raw_fd(), start, len, mode == WRITEPROTECT_MODE_WP)
    }

    /// The next write fault waiting, if any (the descriptor never blocks). Other events, and
    /// faults that are not write protection, are skipped.
    pub fn next_fault(&self) -> io::Result<Option<WriteFault>> {
        loop {
            let mut msg = std::mem::MaybeUninit::<UffdMsg>::zeroed();
            let want = std::mem::size_of::<UffdMsg>();
            // SAFETY: reads at most `want` bytes into `msg`, which is that large and outlives
            // the call.
            let n = unsafe { libc::read(self.fd.as_raw_fd(), msg.as_mut_ptr().cast(), want) };
            if n < 0 {
                let e = io::Error::last_os_error();
                return match e.kind() {
                    io::ErrorKind::WouldBlock => Ok(None),
                    io::ErrorKind::Interrupted => continue,
                    _ => Err(e),
                };
            }
            if n as usize != want {
                return Err(io::Error::new(io::ErrorKind::InvalidData, format!("short userfaultfd message ({n} bytes)")));
            }
            // SAFETY: the kernel filled all `want` bytes; every bit pattern is a valid UffdMsg.
            let msg = unsafe { msg.assume_init() };
            if msg.event == EVENT_PAGEFAULT && msg.flags & PAGEFAULT_FLAG_WP != 0 {
                return Ok(Some(WriteFault { address: msg.address, thread: msg.ptid }));
            }
        }
    }
}

/// Protects (`protect`) or opens `[start, start + len)` through the userfaultfd `fd`, waking
/// any thread stopped on it when opening. Async-signal-safe: one ioctl, no allocation (the
/// error is the errno), so a signal handler may call it.
pub fn set_write_protect(fd: RawFd, start: u64, len: u64, protect: bool) -> io::Result<()> {
    let mode = if protect { WRITEPROTECT_MODE_WP } else { 0 };
    let mut wp = UffdioWriteprotect { range: UffdioRange { start, len }, mode };
    // SAFETY: UFFDIO_WRITEPROTECT reads one uffdio_writeprotect, which outlives the call; the
    // kernel checks the range against the descriptor's registrations.
    if unsafe { libc::ioctl(fd, UFFDIO_WRITEPROTECT, &mut wp) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

impl AsRawFd for WriteTrap {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};

    /// A thread's write to a protected shared page stops until the page is opened, and the
    /// fault names the page.
    #[test]
    fn a_write_to_a_protected_shared_page_waits_for_the_holder() {
        let page = 4096usize;
        // SAFETY: a fresh shared anonymous mapping of one page; unmapped at the end.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                page,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        let word = p as *const AtomicU32;
        // SAFETY: the mapping is page-aligned, so its first word is an aligned u32 that lives
        // until the unmap at the end, after the writer has joined.
        let word: &AtomicU32 = unsafe { &*word };
        word.store(1, Ordering::SeqCst);
        let trap = WriteTrap::new().expect("userfaultfd with shared-memory write protection (Linux 5.19+)");
        trap.register(p as u64, page as u64).unwrap();
        trap.protect(p as u64, page as u64).unwrap();
        let writer = std::thread::scope(|s| {
            let w = s.spawn(|| word.store(7, Ordering::SeqCst));
            let fault = loop {
                if let Some(f) = trap.next_fault().unwrap() {
                    break f;
                }
                std::thread::sleep(std::time::Duration::from_millis(1));
            };
            assert_eq!(fault.address & !(page as u64 - 1), p as u64);
            assert_eq!(word.load(Ordering::SeqCst), 1, "the write waits for the page to open");
            trap.open(p as u64, page as u64).unwrap();
            w.join()
        });
        writer.unwrap();
        assert_eq!(word.load(Ordering::SeqCst), 7);
        // SAFETY: the mapping made above; no thread uses it any more.
        unsafe { libc::munmap(p, page) };
    }
}
