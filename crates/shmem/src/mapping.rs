//! `mmap` of a shared file and the only accessors to it.

use std::marker::PhantomData;
use std::os::fd::RawFd;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, AtomicU64};

use zerocopy::{FromBytes, Immutable, IntoBytes};

use crate::ShmError;

/// How a mapping may be accessed by this process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Protection {
    /// `PROT_READ` only.
    ReadOnly,
    /// `PROT_READ | PROT_WRITE`.
    ReadWrite,
}

/// A `MAP_SHARED` mapping of a file another process may also map (and write, unless it received
/// it read-only), or private memory ([`private`](Self::private)). Every access is bounds-checked and goes through a copy, an atomic, or a raw
/// pointer handed to a system call: no Rust reference to shared bytes is ever formed.
#[derive(Debug)]
pub struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
    prot: Protection,
}

// SAFETY: the mapping is plain memory; every access goes through volatile/atomic/copy accessors
// that are valid from any thread, and the mapping is unmapped only on drop (exclusive).
unsafe impl Send for Mapping {}
// SAFETY: as above: shared access never forms references to non-atomic shared bytes.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Maps `len` bytes of `fd` from offset 0.
    pub fn new(fd: RawFd, len: usize, prot: Protection) -> Result<Self, ShmError> {
        if len == 0 {
            return Err(ShmError::OutOfBounds { offset: 0, len: 0, size: 0 });
        }
        let p = match prot {
            Protection::ReadOnly => libc::PROT_READ,
            Protection::ReadWrite => libc::PROT_READ | libc::PROT_WRITE,
        };
        // SAFETY: a fresh mapping at an address the kernel chooses; it aliases no Rust object.
        let ptr = unsafe { libc::mmap(std::ptr::null_mut(), len, p, libc::MAP_SHARED, fd, 0) };
        if ptr == libc::MAP_FAILED {
            return Err(ShmError::last("mmap"));
        }
        let ptr = NonNull::new(ptr.cast::<u8>()).ok_or_else(|| ShmError::last("mmap"))?;
        Ok(Mapping { ptr, len, prot })
    }

    /// `len` bytes of private anonymous memory, zero-filled and backed only where touched: a
    /// layer's bounce buffers (data it encrypts or merges before sending it on), which no other
    /// process sees. Windows of it are [`SharedSlice`]s like those of a shared file, so the
    /// layers below cannot tell the two apart.
    pub fn private(len: usize) -> Result<Self, ShmError> {
        if len == 0 {
            return Err(ShmError::OutOfBounds { offset: 0, len: 0, size: 0 });
        }
        let flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE;
        // SAFETY: a fresh anonymous mapping at an address the kernel chooses; it aliases no
        // Rust object.
        let ptr = unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, flags, -1, 0) };
        if ptr == libc::MAP_FAILED {
            return Err(ShmError::last("mmap"));
        }
        let ptr = NonNull::new(ptr.cast::<u8>()).ok_or_else(|| ShmError::last("mmap"))?;
        Ok(Mapping { ptr, len, prot: Protection::ReadWrite })
    }

    /// Length of the mapping in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the mapping is empty (never true: `new` refuses a zero length).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The base address, for code that must aim a system call at the mapping as a whole (the
    /// sandbox's escape probe). Never dereferenced by this crate's callers.
    pub fn base_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// The protection this process mapped it with.
    pub fn protection(&self) -> Protection {
        self.prot
    }

    fn check(&self, offset: usize, len: usize) -> Result<(), ShmError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(ShmError::OutOfBounds { offset: offset as u64, len: len as u64, size: self.len as u64 }),
        }
    }

    /// An atomic view of the 4 bytes at `offset`, which must be aligned.
    ///
    /// Atomics are the one kind of reference allowed over shared memory: any value the peer
    /// stores is a valid `u32`, and atomic accesses tolerate concurrent writers.
    pub fn atomic_u32(&self, offset: usize) -> Result<&AtomicU32, ShmError> {
        self.check(offset, 4)?;
        assert_eq!(offset % 4, 0, "misaligned atomic");
        // SAFETY: in bounds (checked), aligned (asserted; the base is page aligned), and the
        // memory lives as long as `self`. Any bit pattern is a valid AtomicU32.
        Ok(unsafe { &*self.ptr.as_ptr().add(offset).cast::<AtomicU32>() })
    }

    /// An atomic view of the 8 bytes at `offset`, which must be aligned.
    pub fn atomic_u64(&self, offset: usize) -> Result<&AtomicU64, ShmError> {
        self.check(offset, 8)?;
        assert_eq!(offset % 8, 0, "misaligned atomic");
        // SAFETY: as for `atomic_u32`.
        Ok(unsafe { &*self.ptr.as_ptr().add(offset).cast::<AtomicU64>() })
    }

    /// Copies a `T` out of shared memory with volatile loads: the peer may change the bytes at
    /// any time, so the caller must validate the returned copy and never read the slot again.
    pub fn read_obj<T: FromBytes>(&self, offset: usize) -> Result<T, ShmError> {
        let size = std::mem::size_of::<T>();
        self.check(offset, size)?;
        let mut out = T::new_zeroed();
        let dst = out.as_mut_bytes_ptr();
        // SAFETY: source range checked in bounds; destination is our own local of `size` bytes.
        unsafe { volatile_copy(self.ptr.as_ptr().add(offset), dst, size) };
        Ok(out)
    }

    /// Copies the `dst.len()` bytes at `offset` into `dst` with volatile loads (a part of a slot;
    /// the same rules as [`read_obj`](Self::read_obj)).
    pub fn read_into(&self, offset: usize, dst: &mut [u8]) -> Result<(), ShmError> {
        self.check(offset, dst.len())?;
        // SAFETY: source range checked in bounds; destination is a private buffer of that length.
        unsafe { volatile_copy(self.ptr.as_ptr().add(offset), dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    /// Copies `src` into shared memory at `offset` with volatile stores.
    pub fn write_from(&self, offset: usize, src: &[u8]) -> Result<(), ShmError> {
        if self.prot != Protection::ReadWrite {
            return Err(ShmError::ReadOnly);
        }
        self.check(offset, src.len())?;
        // SAFETY: destination checked in bounds of a writable mapping; source is private.
        unsafe { volatile_copy(src.as_ptr(), self.ptr.as_ptr().add(offset), src.len()) };
        Ok(())
    }

    /// Copies `obj` into shared memory with volatile stores.
    pub fn write_obj<T: IntoBytes + Immutable>(&self, offset: usize, obj: &T) -> Result<(), ShmError> {
        if self.prot != Protection::ReadWrite {
            return Err(ShmError::ReadOnly);
        }
        let bytes = obj.as_bytes();
        self.check(offset, bytes.len())?;
        // SAFETY: destination checked in bounds of a writable mapping; source is a local.
        unsafe { volatile_copy(bytes.as_ptr(), self.ptr.as_ptr().add(offset), bytes.len()) };
        Ok(())
    }

    /// A bounds-checked window used as an I/O buffer.
    pub fn slice(&self, offset: usize, len: usize) -> Result<SharedSlice<'_>, ShmError> {
        self.check(offset, len)?;
        Ok(SharedSlice {
            // SAFETY: in bounds, checked above.
            ptr: unsafe { self.ptr.as_ptr().add(offset) },
            len,
            writable: self.prot == Protection::ReadWrite,
            _map: PhantomData,
        })
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: we created this mapping with exactly this address and length, and every
        // borrow of it (atomics, slices) is tied to `&self`, so none outlives it.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

trait AsMutBytesPtr {
    fn as_mut_bytes_ptr(&mut self) -> *mut u8;
}

impl<T: FromBytes> AsMutBytesPtr for T {
    fn as_mut_bytes_ptr(&mut self) -> *mut u8 {
        (self as *mut T).cast()
    }
}

/// Copies with volatile accesses, 8 bytes at a time where both sides allow.
///
/// # Safety
/// `src` must be valid for `len` reads and `dst` for `len` writes.
unsafe fn volatile_copy(src: *const u8, dst: *mut u8, len: usize) {
    let mut i = 0;
    if (src as usize).is_multiple_of(8) && (dst as usize).is_multiple_of(8) {
        while i + 8 <= len {
            // SAFETY: in bounds per the contract and 8-aligned (both bases aligned, i multiple of 8).
            unsafe {
                let v = std::ptr::read_volatile(src.add(i).cast::<u64>());
                std::ptr::write_volatile(dst.add(i).cast::<u64>(), v);
            }
            i += 8;
        }
    }
    while i < len {
        // SAFETY: in bounds per the contract.
        unsafe { std::ptr::write_volatile(dst.add(i), std::ptr::read_volatile(src.add(i))) };
        i += 1;
    }
}

/// A window of a [`Mapping`] used as a data buffer (a grant segment).
///
/// Data bytes are opaque to bulkhead: nothing branches on them, so a peer changing them during a
/// copy can only tear its own data. They are therefore moved with `memcpy` (fast) rather than the
/// volatile accessors used for ring slots, and handed to system calls as raw pointers.
#[derive(Clone, Copy, Debug)]
pub struct SharedSlice<'a> {
    ptr: *mut u8,
    len: usize,
    writable: bool,
    _map: PhantomData<&'a Mapping>,
}

// SAFETY: a SharedSlice is a bounds-checked pointer into a Send+Sync mapping it borrows.
unsafe impl Send for SharedSlice<'_> {}
// SAFETY: as above.
unsafe impl Sync for SharedSlice<'_> {}

impl<'a> SharedSlice<'a> {
    /// A window of no bytes, of no mapping.
    pub const fn empty() -> SharedSlice<'static> {
        SharedSlice { ptr: NonNull::dangling().as_ptr(), len: 0, writable: false, _map: PhantomData }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the window is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether this process may write the window.
    pub fn is_writable(&self) -> bool {
        self.writable
    }

    /// A sub-window.
    pub fn sub(&self, offset: usize, len: usize) -> Result<SharedSlice<'a>, ShmError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(SharedSlice {
                // SAFETY: within the window, checked above.
                ptr: unsafe { self.ptr.add(offset) },
                len,
                writable: self.writable,
                _map: PhantomData,
            }),
            _ => Err(ShmError::OutOfBounds { offset: offset as u64, len: len as u64, size: self.len as u64 }),
        }
    }

    /// Copies the window into `dst` (which must be the same length).
    pub fn copy_to(&self, dst: &mut [u8]) {
        assert_eq!(dst.len(), self.len, "copy_to length mismatch");
        // SAFETY: `self` is valid for `len` reads (bounds checked at creation); `dst` is a
        // distinct local buffer of the same length.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr, dst.as_mut_ptr(), self.len) };
    }

    /// Appends the window's bytes to `v`, without first zeroing the room they take.
    pub fn append_to(&self, v: &mut Vec<u8>) {
        v.reserve(self.len);
        let at = v.len();
        // SAFETY: `reserve` made room for `len` bytes past `at`; `self` is valid for `len`
        // reads (bounds checked at creation) and `v` is a distinct local buffer. The bytes are
        // written before `set_len` makes them part of `v`.
        unsafe {
            std::ptr::copy_nonoverlapping(self.ptr, v.as_mut_ptr().add(at), self.len);
            v.set_len(at + self.len);
        }
    }

    /// Copies `src` (same length) into the window.
    pub fn copy_from(&self, src: &[u8]) -> Result<(), ShmError> {
        assert_eq!(src.len(), self.len, "copy_from length mismatch");
        if !self.writable {
            return Err(ShmError::ReadOnly);
        }
        // SAFETY: writable window valid for `len` writes; `src` is private memory.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.ptr, self.len) };
        Ok(())
    }

    /// Copies this window into another shared window of the same length.
    pub fn copy_to_shared(&self, dst: &SharedSlice<'_>) -> Result<(), ShmError> {
        assert_eq!(dst.len, self.len, "copy_to_shared length mismatch");
        if !dst.writable {
            return Err(ShmError::ReadOnly);
        }
        // SAFETY: both windows are valid for `len` bytes. They may overlap only if they are
        // windows of the same file, which `copy` (memmove) tolerates.
        unsafe { std::ptr::copy(self.ptr, dst.ptr, self.len) };
        Ok(())
    }

    /// Fills the window with zeroes.
    pub fn zero(&self) -> Result<(), ShmError> {
        if !self.writable {
            return Err(ShmError::ReadOnly);
        }
        // SAFETY: writable window valid for `len` writes.
        unsafe { std::ptr::write_bytes(self.ptr, 0, self.len) };
        Ok(())
    }

    /// Raw address for a system call (`pread`, `pwrite`, `writev`). The pointer is valid for
    /// `len` bytes while the mapping lives.
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr
    }

    /// Raw writable address for a system call that fills the window (`pread`, `read`).
    pub fn as_mut_ptr(&self) -> Result<*mut u8, ShmError> {
        if !self.writable {
            return Err(ShmError::ReadOnly);
        }
        Ok(self.ptr)
    }

    /// Fills the whole window from `fd` at `pos` (`pread`, again after a short read). An end
    /// of file before the window is full is an error: the window would hold stale bytes.
    pub fn read_at(&self, fd: std::os::fd::BorrowedFd<'_>, pos: u64) -> Result<(), ShmError> {
        use std::os::fd::AsRawFd;
        let ptr = self.as_mut_ptr()?;
        let mut done = 0usize;
        while done < self.len {
            // SAFETY: the window is writable and valid for `len` bytes (bounds checked at
            // creation); the kernel writes at most `len - done` bytes past `done`.
            let n =
                unsafe { libc::pread(fd.as_raw_fd(), ptr.add(done).cast(), self.len - done, (pos + done as u64) as libc::off_t) };
            match n {
                n if n > 0 => done += n as usize,
                0 => return Err(ShmError::Sys { op: "pread", source: std::io::ErrorKind::UnexpectedEof.into() }),
                _ if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted => {}
                _ => return Err(ShmError::last("pread")),
            }
        }
        Ok(())
    }

    /// Writes the whole window to `fd` at `pos` (`pwrite`, again after a short write).
    pub fn write_at(&self, fd: std::os::fd::BorrowedFd<'_>, pos: u64) -> Result<(), ShmError> {
        use std::os::fd::AsRawFd;
        let mut done = 0usize;
        while done < self.len {
            // SAFETY: the window is valid for `len` reads (bounds checked at creation); the
            // kernel reads at most `len - done` bytes past `done`.
            let n = unsafe {
                libc::pwrite(fd.as_raw_fd(), self.ptr.add(done).cast(), self.len - done, (pos + done as u64) as libc::off_t)
            };
            match n {
                n if n > 0 => done += n as usize,
                0 => return Err(ShmError::Sys { op: "pwrite", source: std::io::ErrorKind::WriteZero.into() }),
                _ if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted => {}
                _ => return Err(ShmError::last("pwrite")),
            }
        }
        Ok(())
    }

    /// An iovec over the window, for vectored system calls.
    pub fn iovec(&self) -> libc::iovec {
        libc::iovec { iov_base: self.ptr.cast(), iov_len: self.len }
    }
}

/// Most windows one request can name.
pub const MAX_SLICES: usize = 6;

/// The data windows of one request, in device order (a small fixed array: no allocation).
#[derive(Debug, Clone, Copy)]
pub struct SliceList<'a> {
    bufs: [Option<SharedSlice<'a>>; MAX_SLICES],
    n: usize,
}

impl<'a> SliceList<'a> {
    /// An empty list.
    pub fn new() -> Self {
        SliceList { bufs: [None; MAX_SLICES], n: 0 }
    }

    /// A list of one window.
    pub fn one(s: SharedSlice<'a>) -> Self {
        let mut l = Self::new();
        l.push(s);
        l
    }

    /// Appends a window; panics past [`MAX_SLICES`] (callers validate counts first).
    pub fn push(&mut self, s: SharedSlice<'a>) {
        self.bufs[self.n] = Some(s);
        self.n += 1;
    }

    /// The windows.
    pub fn iter(&self) -> impl Iterator<Item = SharedSlice<'a>> + '_ {
        self.bufs[..self.n].iter().map(|b| b.expect("first n are set"))
    }

    /// Number of windows.
    pub fn len(&self) -> usize {
        self.n
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.n == 0
    }

    /// Total bytes.
    pub fn total_len(&self) -> u64 {
        self.iter().map(|s| s.len() as u64).sum()
    }

    /// The `len` bytes starting `at` bytes into the list, as a list of (sub-)windows; `None`
    /// if they run past its end.
    pub fn range(&self, at: u64, len: u64) -> Option<SliceList<'a>> {
        let end = at.checked_add(len)?;
        if end > self.total_len() {
            return None;
        }
        let mut out = SliceList::new();
        let mut start = 0u64;
        for s in self.iter() {
            let (lo, hi) = (start, start + s.len() as u64);
            start = hi;
            if hi <= at || lo >= end {
                continue;
            }
            let from = at.max(lo) - lo;
            let to = end.min(hi) - lo;
            out.push(s.sub(from as usize, (to - from) as usize).ok()?);
        }
        Some(out)
    }
}

impl Default for SliceList<'_> {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memfd;
    use std::os::fd::AsRawFd;
    use std::sync::atomic::Ordering;

    #[test]
    fn two_mappings_see_the_same_bytes() {
        let fd = memfd::create("t", 4096).unwrap();
        let a = Mapping::new(fd.as_raw_fd(), 4096, Protection::ReadWrite).unwrap();
        let b = Mapping::new(fd.as_raw_fd(), 4096, Protection::ReadOnly).unwrap();
        a.write_obj(8, &0xdead_beef_u64).unwrap();
        assert_eq!(b.read_obj::<u64>(8).unwrap(), 0xdead_beef);
        a.atomic_u32(64).unwrap().store(7, Ordering::Release);
        assert_eq!(b.atomic_u32(64).unwrap().load(Ordering::Acquire), 7);
    }

    #[test]
    fn out_of_bounds_access_is_refused() {
        let fd = memfd::create("t", 4096).unwrap();
        let m = Mapping::new(fd.as_raw_fd(), 4096, Protection::ReadWrite).unwrap();
        assert!(matches!(m.read_obj::<u64>(4090), Err(ShmError::OutOfBounds { .. })));
        assert!(matches!(m.slice(4000, 97), Err(ShmError::OutOfBounds { .. })));
        assert!(matches!(m.slice(usize::MAX, 2), Err(ShmError::OutOfBounds { .. })));
        let s = m.slice(0, 100).unwrap();
        assert!(s.sub(50, 51).is_err());
    }

    #[test]
    fn a_window_is_filled_from_and_written_to_a_file_at_an_offset() {
        use std::os::fd::AsFd;
        let fd = memfd::create("t", 4096).unwrap();
        let m = Mapping::new(fd.as_raw_fd(), 4096, Protection::ReadWrite).unwrap();
        let file = memfd::create("f", 8192).unwrap();
        let data: Vec<u8> = (0..=255u8).cycle().take(1000).collect();
        m.slice(0, 1000).unwrap().copy_from(&data).unwrap();
        m.slice(0, 1000).unwrap().write_at(file.as_fd(), 5000).unwrap();
        m.slice(2000, 1000).unwrap().read_at(file.as_fd(), 5000).unwrap();
        let mut back = vec![0; 1000];
        m.slice(2000, 1000).unwrap().copy_to(&mut back);
        assert_eq!(back, data);
        // Past the end of the file the window cannot be filled: an error, not stale bytes.
        assert!(m.slice(0, 100).unwrap().read_at(file.as_fd(), 8150).is_err());
        let ro = Mapping::new(fd.as_raw_fd(), 4096, Protection::ReadOnly).unwrap();
        assert!(matches!(ro.slice(0, 8).unwrap().read_at(file.as_fd(), 0), Err(ShmError::ReadOnly)));
    }

    #[test]
    fn readonly_mapping_refuses_writes() {
        let fd = memfd::create("t", 4096).unwrap();
        let m = Mapping::new(fd.as_raw_fd(), 4096, Protection::ReadOnly).unwrap();
        assert!(matches!(m.write_obj(0, &1u32), Err(ShmError::ReadOnly)));
        let s = m.slice(0, 16).unwrap();
        assert!(matches!(s.copy_from(&[0; 16]), Err(ShmError::ReadOnly)));
        assert!(s.as_mut_ptr().is_err());
    }

    #[test]
    fn a_range_of_a_list_cuts_its_windows_where_it_starts_and_ends() {
        let fd = memfd::create("t", 4096).unwrap();
        let m = Mapping::new(fd.as_raw_fd(), 4096, Protection::ReadWrite).unwrap();
        let mut l = SliceList::new();
        l.push(m.slice(0, 100).unwrap());
        l.push(m.slice(1000, 50).unwrap());
        l.push(m.slice(2000, 200).unwrap());
        let r = l.range(90, 80).unwrap();
        let parts: Vec<(usize, usize)> = r.iter().map(|s| (s.as_ptr() as usize - m.base_ptr() as usize, s.len())).collect();
        assert_eq!(parts, vec![(90, 10), (1000, 50), (2000, 20)]);
        assert_eq!(l.range(0, 350).unwrap().total_len(), 350);
        assert!(l.range(0, 351).is_none());
        assert!(l.range(u64::MAX, 2).is_none());
        assert!(l.range(350, 0).unwrap().is_empty());
    }

    #[test]
    fn private_memory_is_zeroed_writable_and_windowed_like_a_shared_file() {
        let m = Mapping::private(8192).unwrap();
        let s = m.slice(4096, 16).unwrap();
        let mut out = [1u8; 16];
        s.copy_to(&mut out);
        assert_eq!(out, [0; 16]);
        s.copy_from(&[7; 16]).unwrap();
        s.copy_to(&mut out);
        assert_eq!(out, [7; 16]);
        assert!(Mapping::private(0).is_err());
    }

    #[test]
    fn slice_copies_round_trip() {
        let fd = memfd::create("t", 8192).unwrap();
        let m = Mapping::new(fd.as_raw_fd(), 8192, Protection::ReadWrite).unwrap();
        let src: Vec<u8> = (0..4096u32).map(|i| i as u8).collect();
        let s = m.slice(4096, 4096).unwrap();
        s.copy_from(&src).unwrap();
        let t = m.slice(0, 4096).unwrap();
        s.copy_to_shared(&t).unwrap();
        let mut out = vec![0; 4096];
        t.copy_to(&mut out);
        assert_eq!(out, src);
        t.zero().unwrap();
        t.copy_to(&mut out);
        assert!(out.iter().all(|&b| b == 0));
        // Appended after what a vector holds, growing it.
        let mut v = vec![9u8; 3];
        s.append_to(&mut v);
        assert_eq!((&v[..3], &v[3..]), (&[9u8; 3][..], &src[..]));
        SharedSlice::empty().append_to(&mut v);
        assert_eq!(v.len(), 3 + 4096);
    }
}
