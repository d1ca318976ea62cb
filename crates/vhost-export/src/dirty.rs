//! Dirty logging for live migration (`VHOST_F_LOG_ALL` with `VHOST_USER_PROTOCOL_F_LOG_SHMFD`).
//!
//! QEMU copies a migrating guest's memory in passes, each pass sending the pages that changed
//! since the one before. It tracks the guest's own writes; the pages `serve` writes (a read's
//! data, status bytes, an id, the used ring) it learns from a log it shares with the backend
//! (`VHOST_USER_SET_LOG_BASE`): one bit per 4 KiB page of guest-physical memory, bit `p % 8` of
//! byte `p / 8` for page `p`, set by the backend, read and cleared by QEMU.
//!
//! Every write `serve` makes to guest memory goes through `vm-memory`, and each region of
//! [`GuestMem`](crate::memory::GuestMem) carries a [`RegionLog`] as its dirty bitmap:
//! `vm-memory` marks the bytes it wrote, and while the frontend has logging on
//! ([`DirtyLog::set_logging`]) that sets their pages' bits in the shared log. A write is
//! marked as it is made, before the used index that makes it visible is published (the used
//! ring's own page is marked too). So no path that writes guest memory can forget to log it.
//! `vhost-user-backend` has the same bitmap, but its mapping of the log can only be made
//! inside that crate.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, RwLock};

use vm_memory::bitmap::{Bitmap, BitmapSlice, WithBitmapSlice};

/// Bytes of guest memory one bit of the log stands for (the protocol's `VHOST_LOG_PAGE`).
pub const LOG_PAGE: u64 = 4096;

/// Largest log accepted: one bit a page covers 4 TiB of guest memory in 128 MiB.
const MAX_LOG_BYTES: u64 = 128 << 20;

/// The frontend's log, mapped in `serve`.
#[derive(Debug)]
struct LogMap {
    addr: NonNull<AtomicU8>,
    len: usize,
}

// SAFETY: the mapping is owned by this value until it is dropped, and every access to it is
// atomic, so it can be shared and sent between threads.
unsafe impl Send for LogMap {}
// SAFETY: as above.
unsafe impl Sync for LogMap {}

impl LogMap {
    fn map(file: &File, offset: u64, size: u64) -> io::Result<LogMap> {
        let bad = |why: String| io::Error::new(io::ErrorKind::InvalidInput, why);
        if size == 0 || size > MAX_LOG_BYTES {
            return Err(bad(format!("a dirty log of {size} bytes (1 to {MAX_LOG_BYTES})")));
        }
        let end = offset.checked_add(size).ok_or_else(|| bad("the dirty log's offset wraps".into()))?;
        let file_len = file.metadata()?.len();
        if file_len < end {
            // Writing past the file's end would kill `serve` with SIGBUS.
            return Err(bad(format!("the dirty log's file holds {file_len} bytes, the log needs {end}")));
        }
        let off = libc::off_t::try_from(offset).map_err(|_| bad(format!("dirty log offset {offset}")))?;
        let len = size as usize;
        // SAFETY: a new shared mapping of a file descriptor we hold, at no fixed address; the
        // result is checked before use.
        let addr = unsafe {
            libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, file.as_raw_fd(), off)
        };
        if addr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let addr = NonNull::new(addr.cast::<AtomicU8>()).ok_or_else(|| bad("mmap returned null".into()))?;
        Ok(LogMap { addr, len })
    }

    /// The byte of the log holding page `page`'s bit, if the log reaches it.
    fn byte(&self, page: u64) -> Option<&AtomicU8> {
        let i = usize::try_from(page / 8).ok().filter(|&i| i < self.len)?;
        // SAFETY: `i` is inside the mapping, which lives as long as `self`; `AtomicU8` has the
        // size and alignment of a byte.
        Some(unsafe { &*self.addr.as_ptr().add(i) })
    }

    /// Sets the bits of every page `len` bytes at guest address `gpa` touch; returns the pages
    /// past the log's end (none with a log sized to the guest's memory, as QEMU sizes it).
    fn mark(&self, gpa: u64, len: usize) -> u64 {
        if len == 0 {
            return 0;
        }
        let first = gpa / LOG_PAGE;
        let last = gpa.saturating_add(len as u64 - 1) / LOG_PAGE;
        let mut outside = 0;
        for page in first..=last {
            match self.byte(page) {
                Some(b) => {
                    b.fetch_or(1 << (page % 8), Ordering::Relaxed);
                }
                None => outside += 1,
            }
        }
        outside
    }

    fn dirty(&self, gpa: u64) -> bool {
        let page = gpa / LOG_PAGE;
        self.byte(page).is_some_and(|b| b.load(Ordering::Relaxed) & (1 << (page % 8)) != 0)
    }
}

impl Drop for LogMap {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `map`, unmapped once; no reference into it outlives
        // `self` (`byte` borrows `self`).
        unsafe {
            libc::munmap(self.addr.as_ptr().cast(), self.len);
        }
    }
}

/// A session's dirty log: the frontend's shared log once it has sent one, and whether it has
/// logging on. Every region's [`RegionLog`] marks through it.
#[derive(Debug, Default)]
pub struct DirtyLog {
    on: AtomicBool,
    map: RwLock<Option<Arc<LogMap>>>,
    /// Pages written while logging, past the log's end.
    outside: AtomicU64,
}

impl DirtyLog {
    /// Maps the log the frontend shares (`size` bytes at `offset` of `file`), in place of any
    /// before it.
    pub fn set_base(&self, file: &File, offset: u64, size: u64) -> io::Result<()> {
        let map = LogMap::map(file, offset, size)?;
        *self.map.write().unwrap_or_else(|e| e.into_inner()) = Some(Arc::new(map));
        Ok(())
    }

    /// Turns logging on or off (the frontend's `VHOST_F_LOG_ALL`).
    pub fn set_logging(&self, on: bool) {
        self.on.store(on, Ordering::Release);
    }

    /// Whether writes are logged now: logging is on and there is a log.
    pub fn logging(&self) -> bool {
        self.on.load(Ordering::Acquire) && self.map.read().unwrap_or_else(|e| e.into_inner()).is_some()
    }

    /// Pages written while logging that lay past the log's end.
    pub fn outside(&self) -> u64 {
        self.outside.load(Ordering::Relaxed)
    }

    fn mark(&self, gpa: u64, len: usize) {
        if !self.on.load(Ordering::Acquire) {
            return;
        }
        if let Some(map) = self.map.read().unwrap_or_else(|e| e.into_inner()).as_ref() {
            let outside = map.mark(gpa, len);
            if outside > 0 {
                self.outside.fetch_add(outside, Ordering::Relaxed);
            }
        }
    }

    /// Whether the page holding `gpa` is marked in the log.
    pub fn dirty(&self, gpa: u64) -> bool {
        self.map.read().unwrap_or_else(|e| e.into_inner()).as_ref().is_some_and(|m| m.dirty(gpa))
    }
}

/// A region's, or a slice's, view of its session's [`DirtyLog`]: `vm-memory`'s dirty bitmap
/// for guest memory, which turns offsets into guest addresses.
#[derive(Debug, Clone)]
pub struct RegionLog {
    log: Arc<DirtyLog>,
    /// Guest address of offset 0.
    base: u64,
}

impl RegionLog {
    /// The view of `log` for a region that starts at guest address `base`.
    pub fn new(log: Arc<DirtyLog>, base: u64) -> RegionLog {
        RegionLog { log, base }
    }
}

impl WithBitmapSlice<'_> for RegionLog {
    type S = Self;
}

impl BitmapSlice for RegionLog {}

impl Bitmap for RegionLog {
    fn mark_dirty(&self, offset: usize, len: usize) {
        self.log.mark(self.base.wrapping_add(offset as u64), len);
    }

    fn dirty_at(&self, offset: usize) -> bool {
        self.log.dirty(self.base.wrapping_add(offset as u64))
    }

    fn slice_at(&self, offset: usize) -> Self {
        RegionLog { log: self.log.clone(), base: self.base.wrapping_add(offset as u64) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn log_file(len: u64) -> File {
        File::from(bulkhead_shmem::memfd::create("log", len).unwrap())
    }

    #[test]
    fn marks_every_page_a_write_touches_only_while_logging() {
        let log = Arc::new(DirtyLog::default());
        let region = RegionLog::new(log.clone(), 1 << 20);
        region.mark_dirty(0, 100);
        assert!(!log.dirty(1 << 20), "no log yet");
        log.set_base(&log_file(4096), 0, 4096).unwrap();
        region.mark_dirty(0, 100);
        assert!(!log.dirty(1 << 20), "logging is off");
        log.set_logging(true);
        assert!(log.logging());
        // 4095 bytes from 10 bytes before the end of page 3 of the region: pages 3 and 4.
        region.slice_at(3 * 4096).mark_dirty(4096 - 10, 4096 - 1);
        let page = |p: u64| (1 << 20) + p * LOG_PAGE;
        assert!(!log.dirty(page(2)));
        assert!(log.dirty(page(3)) && log.dirty(page(4)));
        assert!(!log.dirty(page(5)));
        assert!(region.dirty_at(3 * 4096 + 7));
        // Past the log's 4096 bytes (128 MiB of guest memory): counted, not written.
        RegionLog::new(log.clone(), 128 << 20).mark_dirty(0, 1);
        assert_eq!(log.outside(), 1);
        log.set_logging(false);
        region.mark_dirty(10 * 4096, 1);
        assert!(!log.dirty(page(10)));
    }

    #[test]
    fn refuses_a_log_its_file_does_not_hold() {
        let log = DirtyLog::default();
        assert!(log.set_base(&log_file(4096), 0, 8192).is_err());
        assert!(log.set_base(&log_file(4096), 4096, 1).is_err());
        assert!(log.set_base(&log_file(4096), 0, 0).is_err());
        assert!(log.set_base(&log_file(8192), 4096, 4096).is_ok());
    }
}
