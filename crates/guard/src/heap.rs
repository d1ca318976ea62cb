//! The heap of a domain under write capture: one space for the runtime and one per filter, so
//! each filter's state lies in pages of its own that the guard can leave open to it and
//! protect from the others.
//!
//! [`Heap`] is the process's global allocator. Until [`activate`] it hands every request to
//! the system allocator, at the cost of one relaxed load. Once active, an allocation comes
//! from the space the calling thread has selected ([`with_space`]; the runtime's space 0
//! otherwise), and a release goes back to whichever allocator owns the address. So memory
//! allocated before activation, or spilled to the system allocator (a space full, an alignment
//! above a page), is freed where it came from.
//!
//! The spaces lie in one reservation of private memory: space `i` at `base + i *
//! SPACE_BYTES`. Small blocks come in power-of-two classes up to 2 KiB with a free list each;
//! larger blocks are whole pages, and pages freed whole are marked, so the guard can tell a
//! write to a freed block from a write to a live one.
//!
//! The allocator's own bookkeeping lives in statics, never in a space, so the guard never
//! protects it; free-list links live in the free blocks, in the space they belong to.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::{Cell, UnsafeCell};
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};

use crate::PAGE;

/// Spaces at most: the runtime's and fifteen filters'.
pub const MAX_SPACES: usize = 16;
/// Address space of each space (reserved; pages are used as blocks are handed out).
pub const SPACE_BYTES: u64 = 1 << 30;
/// The runtime's space.
pub const RUNTIME: Space = Space(0);

const PAGES_PER_SPACE: usize = (SPACE_BYTES / PAGE) as usize;
/// Small block classes: 16, 32, …, 2048 bytes.
const CLASSES: usize = 8;
const MIN_CLASS: usize = 16;
const MAX_SMALL: usize = MIN_CLASS << (CLASSES - 1);

/// A space of the heap.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Space(pub u8);

struct SpaceState {
    /// Bytes handed out from the start of the space, at most (its extent).
    top: u64,
    /// Heads of the small free lists (addresses; 0 for empty).
    small: [u64; CLASSES],
    /// Head of the free list of whole-page blocks.
    large: u64,
}

struct Spaces {
    states: [UnsafeCell<SpaceState>; MAX_SPACES],
    locks: [AtomicBool; MAX_SPACES],
    /// Each space's extent, for the guard's protect-all (mirrors `top`).
    extents: [AtomicU64; MAX_SPACES],
    /// Pages freed whole and not handed out again, one bit each.
    freed: [[AtomicU64; PAGES_PER_SPACE / 64]; MAX_SPACES],
}

// SAFETY: each `SpaceState` is only touched under its `locks` entry (see `Locked`).
unsafe impl Sync for Spaces {}

#[allow(clippy::declare_interior_mutable_const)]
const EMPTY_STATE: UnsafeCell<SpaceState> = UnsafeCell::new(SpaceState { top: 0, small: [0; CLASSES], large: 0 });
#[allow(clippy::declare_interior_mutable_const)]
const UNLOCKED: AtomicBool = AtomicBool::new(false);
#[allow(clippy::declare_interior_mutable_const)]
const ZERO: AtomicU64 = AtomicU64::new(0);
#[allow(clippy::declare_interior_mutable_const)]
#[allow(clippy::large_const_arrays)] // Only the static below is built from it.
const NO_PAGES: [AtomicU64; PAGES_PER_SPACE / 64] = [ZERO; PAGES_PER_SPACE / 64];

static SPACES: Spaces = Spaces {
    states: [EMPTY_STATE; MAX_SPACES],
    locks: [UNLOCKED; MAX_SPACES],
    extents: [ZERO; MAX_SPACES],
    freed: [NO_PAGES; MAX_SPACES],
};
static ACTIVE: AtomicBool = AtomicBool::new(false);
static BASE: AtomicU64 = AtomicU64::new(0);
static NSPACES: AtomicUsize = AtomicUsize::new(0);
static SPILLED: AtomicU64 = AtomicU64::new(0);
/// The spaces that asked for huge pages ([`prefer_huge`]), a bit each.
static HUGE: AtomicU32 = AtomicU32::new(0);
/// A transparent huge page of x86-64: what one entry of the level above the page table maps.
pub const HUGE_PAGE: u64 = 2 << 20;
/// Called with a range of pages a space has just taken into use, or freed whole: the guard
/// protects them (a `fn(u64, u64)` as usize; 0 for none).
static ON_PAGES: AtomicUsize = AtomicUsize::new(0);
/// Set while the allocator writes into a space on the guarded thread: its own writes to freed
/// blocks (links, splits) are not a filter's.
pub(crate) static BUSY: AtomicBool = AtomicBool::new(false);

thread_local! {
    static CURRENT: Cell<u8> = const { Cell::new(0) };
}

/// A space's state, under its lock.
struct Locked(usize);

impl Locked {
    fn take(i: usize) -> Locked {
        while SPACES.locks[i].compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed).is_err() {
            std::hint::spin_loop();
        }
        BUSY.store(true, Ordering::Relaxed);
        Locked(i)
    }

    fn state(&mut self) -> &mut SpaceState {
        // SAFETY: the lock is held for as long as `self` lives, and `&mut self` makes this the
        // only reference made through it.
        unsafe { &mut *SPACES.states[self.0].get() }
    }
}

impl Drop for Locked {
    fn drop(&mut self) {
        BUSY.store(false, Ordering::Relaxed);
        SPACES.locks[self.0].store(false, Ordering::Release);
    }
}

/// The memory the spaces live in, not yet used for allocation.
#[derive(Debug)]
pub struct Reservation {
    base: u64,
    spaces: usize,
}

impl Reservation {
    /// Reserves `spaces` spaces (at most [`MAX_SPACES`]) of private memory, as a domain's
    /// heap. Private, not a memory file: when the guard opens a written private page again,
    /// the kernel makes it writable in the same system call, where a shared page is left for
    /// its next write to fault (the kernel marks the file dirty then).
    pub fn new(spaces: usize) -> io::Result<Reservation> {
        let len = Self::len_of(spaces)?;
        // One huge page more than asked, so that the spaces can start on a huge page's
        // boundary ([`prefer_huge`]); the slack either side is given back.
        let mapped = len + HUGE_PAGE;
        // SAFETY: a new private mapping at an address the kernel chooses, so no existing
        // memory changes.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                mapped as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let p = p as u64;
        let base = p.next_multiple_of(HUGE_PAGE);
        for (start, n) in [(p, base - p), (base + len, p + mapped - (base + len))] {
            if n > 0 {
                // SAFETY: the slack of the mapping just made, outside the spaces; nothing
                // points into it.
                unsafe { libc::munmap(start as *mut libc::c_void, n as usize) };
            }
        }
        Ok(Reservation { base, spaces })
    }

    fn len_of(spaces: usize) -> io::Result<u64> {
        if spaces == 0 || spaces > MAX_SPACES {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("{spaces} heap spaces (1 to {MAX_SPACES})")));
        }
        Ok(spaces as u64 * SPACE_BYTES)
    }

    /// Where space `s` starts.
    pub fn start(&self, s: Space) -> u64 {
        self.base + s.0 as u64 * SPACE_BYTES
    }

    /// Spaces reserved.
    pub fn spaces(&self) -> usize {
        self.spaces
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        // SAFETY: the mapping is this reservation's own, `spaces` spaces long, and was never
        // handed to the allocator (`activate` forgets the reservation it takes), so nothing
        // of this process points into it.
        unsafe { libc::munmap(self.base as *mut libc::c_void, self.spaces * SPACE_BYTES as usize) };
    }
}

/// Makes the heap allocate from `r`'s spaces from now on, the runtime's first. One activation
/// per process; the reservation stays mapped for the process's life. Refused in a program
/// whose global allocator is not [`Heap`].
pub fn activate(r: Reservation) -> io::Result<()> {
    if ACTIVE.load(Ordering::Acquire) {
        return Err(io::Error::new(io::ErrorKind::AlreadyExists, "the heap is active already"));
    }
    BASE.store(r.base, Ordering::Relaxed);
    NSPACES.store(r.spaces, Ordering::Relaxed);
    let base = r.base;
    // The mapping lives as long as the process: its memory is the heap.
    std::mem::forget(r);
    ACTIVE.store(true, Ordering::Release);
    // Allocations reach the spaces only through this program's global allocator: a program
    // without it would run its guarded filters with their state anywhere, unprotected.
    let probe = std::hint::black_box(Box::new(0u64));
    let at = &*probe as *const u64 as u64;
    drop(probe);
    if !(base..base + SPACE_BYTES).contains(&at) {
        ACTIVE.store(false, Ordering::Release);
        return Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "bulkhead_guard::heap::Heap is not this program's global allocator, so no allocation would come from a space",
        ));
    }
    Ok(())
}

/// Each space's protection key, 0 for none ([`assign_keys`]).
static KEYS: [AtomicU32; MAX_SPACES] = [const { AtomicU32::new(0) }; MAX_SPACES];

/// Gives each space a protection key of its own (x86 PKU), so that a thread can take away
/// its right to write whole spaces with one instruction ([`bulkhead_sys::pkey`]). The
/// calling thread, and every thread it starts later, may write them all; a thread started
/// earlier could touch none of the heap, so this is refused when the process has one.
/// Call right after [`activate`], before any thread starts. Returns the keys, space by space.
pub fn assign_keys() -> io::Result<Vec<u32>> {
    if !active() {
        return Err(io::Error::other("the heap is not active"));
    }
    if !bulkhead_sys::pkey::supported() {
        return Err(io::Error::new(io::ErrorKind::Unsupported, "the processor has no protection keys"));
    }
    if KEYS[0].load(Ordering::Relaxed) != 0 {
        return Err(io::Error::new(io::ErrorKind::AlreadyExists, "the spaces have keys already"));
    }
    if let Ok(tasks) = std::fs::read_dir("/proc/self/task") {
        let n = tasks.count();
        if n > 1 {
            return Err(io::Error::other(format!(
                "the process runs {n} threads; those started before the keys could not touch the heap"
            )));
        }
    }
    let n = NSPACES.load(Ordering::Relaxed);
    let mut keys = Vec::with_capacity(n);
    for i in 0..n {
        let k = bulkhead_sys::pkey::alloc().map_err(|e| io::Error::new(e.kind(), format!("pkey_alloc for space {i}: {e}")))?;
        let start = BASE.load(Ordering::Relaxed) + i as u64 * SPACE_BYTES;
        bulkhead_sys::pkey::assign(start, SPACE_BYTES, k)
            .map_err(|e| io::Error::new(e.kind(), format!("pkey_mprotect of space {i}: {e}")))?;
        keys.push(k);
    }
    for (i, &k) in keys.iter().enumerate() {
        KEYS[i].store(k, Ordering::Relaxed);
    }
    Ok(keys)
}

/// Space `s`'s protection key, if [`assign_keys`] gave it one.
pub fn key_of(s: Space) -> Option<u32> {
    KEYS.get(s.0 as usize).map(|k| k.load(Ordering::Relaxed)).filter(|&k| k != 0)
}

/// Asks the kernel to back private space `s` with transparent huge pages, each
/// [`HUGE_PAGE`] bytes, so that write-protecting a huge page of it is one step of the kernel's
/// page walk, whatever it holds ([`crate::Guard::huge_region`]). Each huge page the space
/// touches takes its whole size of memory; the first is backed now. `false`, and the space is
/// made of ordinary pages, where the kernel backs none (transparent huge pages `never`, a
/// kernel before 6.1, no huge page free). Call before anything is allocated from the space.
pub fn prefer_huge(s: Space) -> bool {
    let Some((start, len)) = space_range(s) else { return false };
    if is_huge(s) {
        return true;
    }
    // SAFETY: advice on the space's own private mapping; it changes how its pages are backed,
    // not what they hold.
    if unsafe { libc::madvise(start as *mut libc::c_void, len as usize, libc::MADV_HUGEPAGE) } < 0 {
        return false;
    }
    if !back_huge(start) {
        // SAFETY: as above.
        unsafe { libc::madvise(start as *mut libc::c_void, len as usize, libc::MADV_NOHUGEPAGE) };
        return false;
    }
    HUGE.fetch_or(1 << s.0, Ordering::Relaxed);
    true
}

/// Has the kernel back the huge page at `at` (a boundary of [`HUGE_PAGE`] in private memory
/// advised `MADV_HUGEPAGE`: a space [`prefer_huge`] advised) with one, and says whether it
/// is: its first byte is rewritten with what it holds (a first write brings a huge page,
/// where one is free), and `MADV_COLLAPSE` (Linux 6.1) makes one of what small pages it
/// holds, or fails. The page must be mapped writable for the process's life, and not
/// write-protected. Any thread.
pub fn back_huge(at: u64) -> bool {
    // SAFETY: a byte of memory the caller maps writable (a heap space's pages are mapped for
    // the process's life), rewritten with what it holds.
    unsafe { std::ptr::write_volatile(at as *mut u8, std::ptr::read_volatile(at as *const u8)) };
    // SAFETY: advice on the space's own mapping; a collapse keeps what the pages hold.
    unsafe { libc::madvise(at as *mut libc::c_void, HUGE_PAGE as usize, libc::MADV_COLLAPSE) == 0 }
}

/// The space `addr` lies in, if it lies in one.
pub fn space_of_addr(addr: u64) -> Option<Space> {
    locate(addr).map(|(i, _)| Space(i as u8))
}

/// Whether space `s` asked for huge pages ([`prefer_huge`]).
pub fn is_huge(s: Space) -> bool {
    HUGE.load(Ordering::Relaxed) & (1 << s.0) != 0
}

/// Whether the heap allocates from spaces.
pub fn active() -> bool {
    ACTIVE.load(Ordering::Relaxed)
}

/// Space `i`'s address range, if the heap is active with that many.
pub fn space_range(s: Space) -> Option<(u64, u64)> {
    (active() && (s.0 as usize) < NSPACES.load(Ordering::Relaxed))
        .then(|| (BASE.load(Ordering::Relaxed) + s.0 as u64 * SPACE_BYTES, SPACE_BYTES))
}

/// Bytes space `s` has handed out from its start, at most: the guard protects that much.
pub fn extent(s: Space) -> &'static AtomicU64 {
    &SPACES.extents[s.0 as usize]
}

/// Bytes that went to the system allocator since activation (a space full, or an alignment
/// above a page): memory the guard does not protect.
pub fn spilled() -> u64 {
    SPILLED.load(Ordering::Relaxed)
}

/// Runs `f` with the calling thread's allocations coming from space `s`.
pub fn with_space<R>(s: Space, f: impl FnOnce() -> R) -> R {
    let old = CURRENT.with(|c| c.replace(s.0));
    let r = f();
    CURRENT.with(|c| c.set(old));
    r
}

/// Whether `addr` lies in a page of a space that was freed whole and not handed out again.
/// Async-signal-safe.
pub fn is_freed(addr: u64) -> bool {
    let Some((i, page)) = locate(addr) else { return false };
    SPACES.freed[i][page / 64].load(Ordering::Relaxed) & (1 << (page % 64)) != 0
}

/// Whether the allocator is writing its own links on this thread now. Async-signal-safe.
pub(crate) fn busy() -> bool {
    BUSY.load(Ordering::Relaxed)
}

/// Sets what is called with pages a space takes into use or frees whole.
pub(crate) fn on_pages(f: Option<fn(u64, u64)>) {
    ON_PAGES.store(f.map_or(0, |f| f as usize), Ordering::Release);
}

fn pages_changed(start: u64, len: u64) {
    let f = ON_PAGES.load(Ordering::Acquire);
    if f != 0 {
        // SAFETY: only `on_pages` stores here, and only `fn(u64, u64)` pointers.
        let f: fn(u64, u64) = unsafe { std::mem::transmute::<usize, fn(u64, u64)>(f) };
        f(start, len);
    }
}

/// The space and page index of an address of the reservation.
fn locate(addr: u64) -> Option<(usize, usize)> {
    let base = BASE.load(Ordering::Relaxed);
    let n = NSPACES.load(Ordering::Relaxed) as u64;
    if base == 0 || addr < base || addr >= base + n * SPACE_BYTES {
        return None;
    }
    let off = addr - base;
    Some(((off / SPACE_BYTES) as usize, ((off % SPACE_BYTES) / PAGE) as usize))
}

fn mark_freed(i: usize, first: usize, pages: usize, freed: bool) {
    for p in first..first + pages {
        let bit = 1u64 << (p % 64);
        if freed {
            SPACES.freed[i][p / 64].fetch_or(bit, Ordering::Relaxed);
        } else {
            SPACES.freed[i][p / 64].fetch_and(!bit, Ordering::Relaxed);
        }
    }
}

fn class_of(size: usize, align: usize) -> Option<usize> {
    let n = size.max(align).max(MIN_CLASS).next_power_of_two();
    (n <= MAX_SMALL).then(|| n.trailing_zeros() as usize - MIN_CLASS.trailing_zeros() as usize)
}

/// A free whole-page block's header, at its start.
#[repr(C)]
struct LargeFree {
    next: u64,
    pages: u64,
}

/// Hands out `len` bytes aligned to `align` from the top of space `i`; 0 if it is full.
fn bump(st: &mut SpaceState, i: usize, len: u64, align: u64) -> u64 {
    let start = st.top.next_multiple_of(align);
    let end = start + len;
    if end > SPACE_BYTES {
        return 0;
    }
    let old_pages = st.top.next_multiple_of(PAGE);
    st.top = end;
    let new_pages = end.next_multiple_of(PAGE);
    SPACES.extents[i].store(new_pages, Ordering::Relaxed);
    let base = BASE.load(Ordering::Relaxed) + i as u64 * SPACE_BYTES;
    if new_pages > old_pages {
        pages_changed(base + old_pages, new_pages - old_pages);
    }
    base + start
}

/// Allocates from space `i`; 0 when it cannot.
fn alloc_in(i: usize, layout: Layout) -> u64 {
    if layout.align() as u64 > PAGE {
        return 0;
    }
    let mut lock = Locked::take(i);
    let st = lock.state();
    if let Some(c) = class_of(layout.size(), layout.align()) {
        let head = st.small[c];
        if head != 0 {
            // SAFETY: `head` is a free block of this space's class `c`, at least 16 bytes,
            // whose first word its release wrote; the lock makes this thread its only user.
            st.small[c] = unsafe { (head as *const u64).read() };
            return head;
        }
        let size = (MIN_CLASS << c) as u64;
        return bump(st, i, size, size);
    }
    let pages = (layout.size() as u64).div_ceil(PAGE);
    let base = BASE.load(Ordering::Relaxed) + i as u64 * SPACE_BYTES;
    let mut prev: u64 = 0;
    let mut at = st.large;
    while at != 0 {
        // SAFETY: `at` is a free whole-page block of this space whose header its release
        // wrote; the lock makes this thread its only user.
        let h = unsafe { (at as *const LargeFree).read() };
        if h.pages >= pages {
            let next = if h.pages > pages {
                // The rest stays free, with a header of its own.
                let rest = at + pages * PAGE;
                // SAFETY: `rest` is inside the same free block, page-aligned, unused.
                unsafe { (rest as *mut LargeFree).write(LargeFree { next: h.next, pages: h.pages - pages }) };
                rest
            } else {
                h.next
            };
            if prev == 0 {
                st.large = next;
            } else {
                // SAFETY: `prev` is the free block before this one, as above.
                unsafe { (*(prev as *mut LargeFree)).next = next };
            }
            mark_freed(i, ((at - base) / PAGE) as usize, pages as usize, false);
            return at;
        }
        prev = at;
        at = h.next;
    }
    bump(st, i, pages * PAGE, PAGE)
}

fn dealloc_in(i: usize, ptr: u64, layout: Layout) {
    let mut lock = Locked::take(i);
    let st = lock.state();
    if let Some(c) = class_of(layout.size(), layout.align()) {
        // SAFETY: the block is this space's, of class `c` (its layout says so), and no longer
        // used by its owner; its first word becomes the link.
        unsafe { (ptr as *mut u64).write(st.small[c]) };
        st.small[c] = ptr;
        return;
    }
    let pages = (layout.size() as u64).div_ceil(PAGE);
    // SAFETY: a whole-page block of this space no longer used; its start becomes the header.
    unsafe { (ptr as *mut LargeFree).write(LargeFree { next: st.large, pages }) };
    st.large = ptr;
    let base = BASE.load(Ordering::Relaxed) + i as u64 * SPACE_BYTES;
    mark_freed(i, ((ptr - base) / PAGE) as usize, pages as usize, true);
    drop(lock);
    pages_changed(ptr, pages * PAGE);
}

/// The global allocator: see the module's documentation.
#[derive(Debug, Default)]
pub struct Heap;

impl Heap {
    /// The allocator (for `#[global_allocator]`).
    pub const fn new() -> Heap {
        Heap
    }
}

// SAFETY: blocks come either from the system allocator, under its contract, or from a space:
// aligned as asked (classes are powers of two at least the alignment, carved at their own
// alignment; large blocks are page-aligned and alignments above a page go to the system),
// never handed out twice (free lists are under the space's lock), and released to the
// allocator that owns their address.
unsafe impl GlobalAlloc for Heap {
    // SAFETY (for callers): GlobalAlloc's contract; this impl keeps it as said above.
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if !ACTIVE.load(Ordering::Relaxed) {
            // SAFETY: forwarded contract.
            return unsafe { System.alloc(layout) };
        }
        let i = CURRENT.try_with(Cell::get).unwrap_or(0) as usize;
        let i = if i < NSPACES.load(Ordering::Relaxed) { i } else { 0 };
        match alloc_in(i, layout) {
            0 => {
                SPILLED.fetch_add(layout.size() as u64, Ordering::Relaxed);
                // SAFETY: forwarded contract.
                unsafe { System.alloc(layout) }
            }
            p => p as *mut u8,
        }
    }

    // SAFETY (for callers): GlobalAlloc's contract, as `alloc`.
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded contract.
        let p = unsafe { self.alloc(layout) };
        if !p.is_null() {
            // SAFETY: `p` holds `layout.size()` bytes just allocated; blocks are reused, so
            // they are cleared here rather than trusted to be zero.
            unsafe { p.write_bytes(0, layout.size()) };
        }
        p
    }

    // SAFETY (for callers): GlobalAlloc's contract: `ptr` came from this allocator with `layout`.
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        match locate(ptr as u64) {
            Some((i, _)) => dealloc_in(i, ptr as u64, layout),
            // SAFETY: not a space's address, so the system allocator's, under the contract.
            None => unsafe { System.dealloc(ptr, layout) },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// This test program's global allocator is the system's: activation must say so rather
    /// than leave guarded state unprotected.
    #[test]
    fn activation_is_refused_where_the_heap_is_not_the_global_allocator() {
        let r = Reservation::new(2).unwrap();
        let e = activate(r).unwrap_err();
        assert!(e.to_string().contains("global allocator"), "{e}");
        assert!(!active());
    }

    #[test]
    fn classes_cover_sizes_and_alignments() {
        assert_eq!(class_of(1, 1), Some(0));
        assert_eq!(class_of(16, 8), Some(0));
        assert_eq!(class_of(17, 8), Some(1));
        assert_eq!(class_of(8, 64), Some(2));
        assert_eq!(class_of(2048, 8), Some(7));
        assert_eq!(class_of(2049, 8), None);
    }
}
