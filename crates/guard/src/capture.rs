//! The fault handlers and the state they share with the guarded thread.
//!
//! Signal handlers are process-wide, so the guard is too: one [`Guard`] per process, for the
//! thread that installs it (a domain runs its filters on one thread). Its state is a static the
//! handlers and that thread both use. They never use it at the same time: a handler runs only
//! on a write fault or a single-step trap *of the guarded thread* (a fault in another thread,
//! or outside every guarded region, is not the guard's and takes the default action), and the
//! guarded thread touches the state only in [`Guard`]'s methods, which write no guarded page
//! and so cannot be interrupted by the guard's own faults.

use std::cell::UnsafeCell;
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, AtomicU8, Ordering};

use bulkhead_sys::uffd::{set_write_protect, WriteTrap};

use crate::act::Act;
use crate::heap::HUGE_PAGE;
use crate::shadow::{Evicted, Mode, Prepare, Shadow, MAX_CACHE};
use crate::PAGE;

/// Most regions one guard protects.
pub const MAX_REGIONS: usize = 32;
/// The exit status of a process whose guarded code was stopped.
pub const VIOLATION_EXIT: i32 = 86;
/// Guarded code named at most, for reports.
pub const MAX_FILTERS: usize = 16;
/// Bytes of a name in reports.
const NAME: usize = 24;

/// How writes to protected pages are caught.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mechanism {
    /// userfaultfd write protection, its faults raised as SIGBUS in the writing thread; pages
    /// are protected and opened in the page tables, without splitting the mapping.
    Userfault,
    /// `mprotect` and SIGSEGV; each page opened alone splits the mapping around it.
    Mprotect,
}

impl Mechanism {
    /// Its name, as options and reports spell it.
    pub fn as_str(self) -> &'static str {
        match self {
            Mechanism::Userfault => "userfaultfd",
            Mechanism::Mprotect => "mprotect",
        }
    }
}

/// What the guard has done since it was installed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stats {
    /// Calls into guarded code.
    pub calls: u64,
    /// Writes caught while guarded code ran and allowed by the table.
    pub allowed: u64,
    /// Writes caught while it did not run (the runtime's own), let through.
    pub outside: u64,
    /// Single steps taken to protect a page again right after a write (DWC).
    pub steps: u64,
    /// Pages protected one at a time (evictions, single steps, the pool).
    pub page_protects: u64,
    /// Whole regions protected at once.
    pub region_protects: u64,
    /// Calls run with the other owners' protection keys write-disabled ([`Guard::gate_keys`]).
    pub keyed: u64,
    /// Pages the SCDWC cache holds open now (at most C): with C above the write working set,
    /// the distinct pages written since the cache last started empty.
    pub open_pages: u64,
    /// Calls whose entry shut the other owners' open pages ([`Guard::gate_pages`]).
    pub gated: u64,
    /// Ranges those calls shut at entry and opened again at exit, one system call each way.
    pub gated_ranges: u64,
    /// Pages in those ranges.
    pub gated_pages: u64,
    /// Gated calls whose exit left the pages it shut shut, dropped from the cache: the
    /// runtime's next write to each reopens it, so the cache holds only what it still writes.
    pub trims: u64,
    /// Ranges of regions the runtime writes only at known points ([`Guard::defer_reopen`])
    /// that a gated call's exit left shut for the calls after it, until [`reopen_deferred`].
    pub deferred: u64,
    /// Times the huge region ([`Guard::huge_region`]) went back to ordinary pages, a call's
    /// table having reached into it.
    pub unhuged: u64,
}

/// A write guarded code was not allowed to make, as the handler reports it before the
/// process exits with [`VIOLATION_EXIT`]. The write did not happen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Violation {
    /// The address written.
    pub address: u64,
    /// The region it lies in, as [`Guard::add_region`] numbered it.
    pub region: u32,
    /// The guarded code that wrote, as the caller of [`Guard::enter`] named it.
    pub filter: u32,
}

impl Violation {
    /// Bytes of a report.
    pub const BYTES: usize = 16;

    fn encode(&self) -> [u8; Self::BYTES] {
        let mut b = [0u8; Self::BYTES];
        b[..8].copy_from_slice(&self.address.to_le_bytes());
        b[8..12].copy_from_slice(&self.region.to_le_bytes());
        b[12..].copy_from_slice(&self.filter.to_le_bytes());
        b
    }

    /// A report as the handler wrote it.
    pub fn decode(b: &[u8; Self::BYTES]) -> Self {
        Violation {
            address: u64::from_le_bytes(b[..8].try_into().expect("8 bytes")),
            region: u32::from_le_bytes(b[8..12].try_into().expect("4 bytes")),
            filter: u32::from_le_bytes(b[12..].try_into().expect("4 bytes")),
        }
    }
}

#[derive(Clone, Copy)]
struct Region {
    start: u64,
    end: u64,
    /// Bytes from `start` in use, if the region grows (a heap space): protecting the region
    /// protects that much; pages taken into use later are protected as they are.
    extent: Option<&'static AtomicU64>,
    /// Its protection key, 0 for none.
    key: u32,
    /// The guarded code whose own memory it is ([`Guard::own_region`]), or [`RUNTIME`].
    owner: u32,
    /// Written by the runtime only at points it announces ([`Guard::defer_reopen`]): what
    /// the page gate shuts here stays shut from call to call until [`reopen_deferred`].
    deferred: bool,
    /// Shared memory shut and opened whole with `mprotect`, outside the userfaultfd
    /// ([`Guard::add_shared_region`]).
    whole: bool,
    /// A heap space backed by transparent huge pages, which the runtime opens and the page
    /// gate shuts a huge page at a time ([`Guard::huge_region`]).
    huge: bool,
    name: [u8; NAME],
}

/// What the page gate keeps apart in its ranges: the exit treats deferred regions
/// ([`Guard::defer_reopen`]) apart from the others, and one system call protects a range of
/// one mechanism (regions shut whole, [`Guard::add_shared_region`], take `mprotect`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Kind {
    deferred: bool,
    whole: bool,
}

impl Kind {
    fn of(r: &Region) -> Kind {
        Kind { deferred: r.deferred, whole: r.whole }
    }
}

/// The owner of every region no guarded code owns: the runtime.
const RUNTIME: u32 = u32::MAX;
/// Pages of a gap between two runs of open pages that the page gate shuts and opens with
/// them, as one range: each page costs a step of the kernel's page walk, and a longer gap
/// more than the second system call it saves.
const GATE_GAP: u64 = 4;
/// Every this many gated calls, the exit leaves the other owners' pages it shut shut
/// ([`Stats::trims`]). Between two, a page the runtime wrote once (a ring slot it has moved
/// past, a block it freed) stays in the cache, and every call shuts and opens it for nothing;
/// a trim costs the runtime a fault for each page it still writes.
const TRIM_EVERY: u32 = 64;

impl Region {
    /// What protects it, for a guard of `mechanism`: `mprotect` if it is shut whole
    /// ([`Guard::add_shared_region`]).
    fn mechanism(&self, mechanism: Mechanism) -> Mechanism {
        if self.whole {
            Mechanism::Mprotect
        } else {
            mechanism
        }
    }

    fn protected_len(&self) -> u64 {
        match self.extent {
            Some(e) if self.huge => e.load(Ordering::Relaxed).next_multiple_of(HUGE_PAGE).min(self.end - self.start),
            Some(e) => e.load(Ordering::Relaxed).min(self.end - self.start),
            None => self.end - self.start,
        }
    }

    /// Whether the runtime opens it, and the cache holds it, in spans larger than a page
    /// ([`span_in`]): the whole region, or a huge page of it.
    fn opens_whole(&self) -> bool {
        self.whole || self.huge
    }

    /// The huge page of a huge region that holds `page`.
    fn chunk_of(&self, page: u64) -> (u64, u64) {
        let start = self.start + (page - self.start) / HUGE_PAGE * HUGE_PAGE;
        (start, (start + HUGE_PAGE).min(self.end))
    }
}

fn name_of(s: &str) -> [u8; NAME] {
    let mut n = [0u8; NAME];
    let b = s.as_bytes();
    let k = b.len().min(NAME);
    n[..k].copy_from_slice(&b[..k]);
    n
}

/// Pages a single step may have to protect again: one write may cross a page boundary.
const MAX_STEPPING: usize = 4;

struct State {
    tid: i32,
    mechanism: Mechanism,
    uffd: RawFd,
    report_fd: RawFd,
    regions: [Region; MAX_REGIONS],
    nregions: usize,
    act: Act,
    running: bool,
    filter: u32,
    /// The filter that ran last: when another runs, the cache is flushed to the pool.
    last_filter: u32,
    filter_names: [[u8; NAME]; MAX_FILTERS],
    text_fd: RawFd,
    shadow: Shadow,
    stepping: [u64; MAX_STEPPING],
    nstepping: usize,
    stats: Stats,
    /// Whether calls are gated by protection keys ([`Guard::gate_keys`]).
    keys: bool,
    /// The key each filter may write (its heap space's), 0 for none.
    own_key: [u32; MAX_FILTERS],
    /// The PKRU of the guarded thread before the running call was gated, if it was.
    saved_pkru: Option<u32>,
    /// Which filters' calls the page gate shuts other owners' open pages for
    /// ([`Guard::gate_pages`]).
    page_gate: [bool; MAX_FILTERS],
    /// The ranges the running call's entry shut, to open again at its exit.
    gated: [(u64, u64); MAX_CACHE],
    ngated: usize,
    /// The ranges opened again since the last call's entry (at a gated call's exit, or by
    /// [`reopen_deferred`]): they hold pages the cache does not (a gap, a page pushed out
    /// during the call), so the next call shuts them.
    loose: [(u64, u64); 2 * MAX_CACHE],
    nloose: usize,
    /// Ranges of deferred regions that gated calls shut and left shut: the cache holds their
    /// pages as open, but they are not, until [`reopen_deferred`] or a write into one.
    held: [(u64, u64); MAX_CACHE],
    nheld: usize,
    /// Gated calls until one whose exit leaves what it shut shut ([`TRIM_EVERY`]).
    trim_in: u32,
}

impl State {
    const EMPTY: State = State {
        tid: 0,
        mechanism: Mechanism::Userfault,
        uffd: -1,
        report_fd: -1,
        regions: [Region {
            start: 0,
            end: 0,
            extent: None,
            key: 0,
            owner: RUNTIME,
            deferred: false,
            whole: false,
            huge: false,
            name: [0; NAME],
        }; MAX_REGIONS],
        nregions: 0,
        act: Act::new(),
        running: false,
        filter: 0,
        last_filter: u32::MAX,
        filter_names: [[0; NAME]; MAX_FILTERS],
        text_fd: -1,
        shadow: Shadow::new(Mode::Dwc),
        stepping: [0; MAX_STEPPING],
        nstepping: 0,
        stats: Stats {
            calls: 0,
            allowed: 0,
            outside: 0,
            steps: 0,
            page_protects: 0,
            region_protects: 0,
            keyed: 0,
            open_pages: 0,
            gated: 0,
            gated_ranges: 0,
            gated_pages: 0,
            trims: 0,
            deferred: 0,
            unhuged: 0,
        },
        keys: false,
        own_key: [0; MAX_FILTERS],
        saved_pkru: None,
        page_gate: [false; MAX_FILTERS],
        gated: [(0, 0); MAX_CACHE],
        ngated: 0,
        loose: [(0, 0); 2 * MAX_CACHE],
        nloose: 0,
        held: [(0, 0); MAX_CACHE],
        nheld: 0,
        trim_in: TRIM_EVERY,
    };

    fn stats_now(&self) -> Stats {
        Stats { open_pages: self.shadow.cached() as u64, ..self.stats }
    }

    fn region_of(&self, addr: u64) -> Option<usize> {
        self.regions[..self.nregions].iter().position(|r| addr >= r.start && addr < r.end)
    }

    /// The PKRU bits that take away `filter`'s right to write every keyed region but its
    /// own; 0 when calls are not gated, the filter has no key of its own, or when the table allows a range in such a region
    /// (a write the keys would stop though the table allows it: that call is left to the
    /// page protection alone).
    fn deny_for(&self, filter: u32, act: &Act) -> u32 {
        if !self.keys {
            return 0;
        }
        let own = self.own_key.get(filter as usize).copied().unwrap_or(0);
        if own == 0 {
            return 0;
        }
        let mut deny = 0;
        for r in &self.regions[..self.nregions] {
            if r.key == 0 || r.key == own {
                continue;
            }
            if act.reaches(r.start, r.end) {
                return 0;
            }
            deny |= bulkhead_sys::pkey::write_disable(r.key);
        }
        deny
    }

    /// Whether the gap `[start, end)` between two runs of pages the page gate shuts for
    /// `filter` may be shut with them, as one range: it lies in guarded regions side by side
    /// (the system call takes one mapping after another), none of them `filter`'s own, and
    /// the call's table reaches none of it (a page it may write would fault for nothing).
    /// Regions join only regions of their kind ([`Kind`]).
    fn may_join(&self, start: u64, end: u64, filter: u32, kind: Kind) -> bool {
        if self.act.reaches(start, end) {
            return false;
        }
        let mut at = start;
        while at < end {
            match self.region_of(at) {
                Some(r) if self.regions[r].owner != filter && Kind::of(&self.regions[r]) == kind => at = self.regions[r].end,
                _ => return false,
            }
        }
        true
    }

    fn deferred_at(&self, addr: u64) -> bool {
        self.region_of(addr).is_some_and(|r| self.regions[r].deferred)
    }

    fn held_at(&self, addr: u64) -> bool {
        self.held[..self.nheld].iter().any(|&(a, b)| a <= addr && addr < b)
    }

    /// A write is let into `page`, which lies in what calls left shut: outside a call, every
    /// such range opens (the runtime writes on); inside one, the ranges holding the page
    /// only stop being taken for shut, the rest of them still shut and the page opened by the
    /// caller, and the next call's entry shuts what the cache holds of them as it does any
    /// other page. Either way no page the page gate takes for shut is open. Async-signal-safe.
    fn let_into_held(&mut self, page: u64) {
        if !self.running {
            return self.reopen_held();
        }
        // Every range holding it: a joined gap may lie in two.
        while let Some(i) = self.held[..self.nheld].iter().position(|&(a, b)| a <= page && page < b) {
            self.nheld -= 1;
            self.held[i] = self.held[self.nheld];
        }
    }

    /// Opens every range calls left shut, to be shut again by the next call's entry (as
    /// `loose`); async-signal-safe.
    fn reopen_held(&mut self) {
        for i in 0..std::mem::take(&mut self.nheld) {
            let (start, end) = self.held[i];
            let _ = self.set(start, end - start, false);
            self.loose[self.nloose] = (start, end);
            self.nloose += 1;
        }
    }

    /// Gives up huge pages for region `r`, which a call's table reaches into: opening one page
    /// alone for it would split its huge page, and a huge page split costs the kernel 512
    /// steps each time it is shut whole. Shuts what it holds, forgets its pages in the cache
    /// and in what calls shut, and guards it page by page from now on. Async-signal-safe.
    fn unhuge(&mut self, r: usize) {
        let (start, end) = (self.regions[r].start, self.regions[r].start + self.regions[r].protected_len());
        let _ = self.set(start, end - start, true);
        self.shadow.drop_shut(|p| start <= p && p < end);
        let inside = |&(a, b): &(u64, u64)| start <= a && b <= end;
        for (list, n) in [(&mut self.gated[..], &mut self.ngated), (&mut self.held[..], &mut self.nheld)] {
            let mut k = 0;
            for i in 0..*n {
                if !inside(&list[i]) {
                    list[k] = list[i];
                    k += 1;
                }
            }
            *n = k;
        }
        self.regions[r].huge = false;
        HUGE_REFUSED.store(true, Ordering::Relaxed);
        HUGE_REGION.store(0, Ordering::Relaxed);
        self.stats.unhuged += 1;
    }

    /// Protects or opens a range, which lies in regions of one mechanism; async-signal-safe.
    fn set(&self, start: u64, len: u64, protect: bool) -> io::Result<()> {
        set(mechanism_in(&self.regions[..self.nregions], self.mechanism, start), self.uffd, start, len, protect)
    }

    /// What the runtime's write into `page` opens, and the cache then holds: see [`span_in`].
    fn span_of(&self, page: u64) -> (u64, u64) {
        let (start, end, _) = span_in(&self.regions[..self.nregions], self.mechanism, page);
        (start, end)
    }
}

/// The mechanism that protects memory at `addr` of `regions`: that of the region it lies in
/// ([`Region::mechanism`]), the guard's own (`mechanism`) outside every region.
fn mechanism_in(regions: &[Region], mechanism: Mechanism, addr: u64) -> Mechanism {
    regions.iter().find(|r| addr >= r.start && addr < r.end).map_or(mechanism, |r| r.mechanism(mechanism))
}

/// The range that stands for `page` where the runtime opens it and the cache holds it open
/// or shuts it again, with the mechanism that protects it: the whole region, for a region shut
/// whole (the cache holds its first page for it), and the page itself elsewhere. Guarded
/// code's own writes open a page alone, whatever its region.
fn span_in(regions: &[Region], mechanism: Mechanism, page: u64) -> (u64, u64, Mechanism) {
    match regions.iter().find(|r| page >= r.start && page < r.end) {
        Some(r) if r.whole => (r.start, r.end, r.mechanism(mechanism)),
        Some(r) if r.huge => {
            let (start, end) = r.chunk_of(page);
            (start, end, r.mechanism(mechanism))
        }
        Some(r) => (page, page + PAGE, r.mechanism(mechanism)),
        None => (page, page + PAGE, mechanism),
    }
}

/// Protects or opens `[start, start + len)` of a guarded region with `mechanism` (`uffd`, the
/// userfaultfd, for [`Mechanism::Userfault`]); async-signal-safe.
fn set(mechanism: Mechanism, uffd: RawFd, start: u64, len: u64, protect: bool) -> io::Result<()> {
    match mechanism {
        Mechanism::Userfault => set_write_protect(uffd, start, len, protect),
        Mechanism::Mprotect => {
            let prot = if protect { libc::PROT_READ } else { libc::PROT_READ | libc::PROT_WRITE };
            // SAFETY: changes the protection of pages of a region the guard was given, which
            // is this process's memory and stays mapped while the guard lives.
            if unsafe { libc::mprotect(start as *mut libc::c_void, len as usize, prot) } < 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        }
    }
}

struct Global(UnsafeCell<State>);

// SAFETY: used by one thread only, the guarded one, and by the handlers running on it (see the
// module's documentation); `INSTALLED` keeps a second guard out.
unsafe impl Sync for Global {}

static STATE: Global = Global(UnsafeCell::new(State::EMPTY));
static INSTALLED: AtomicBool = AtomicBool::new(false);
/// The guarded thread, the mechanism and the userfaultfd, for the functions other threads may
/// call (the heap, protecting the pages it takes into use).
static TID: AtomicI32 = AtomicI32::new(0);
static MECH: AtomicU8 = AtomicU8::new(0);
static UFFD: AtomicI32 = AtomicI32::new(-1);

fn mechanism_now() -> Mechanism {
    if MECH.load(Ordering::Relaxed) == 1 {
        Mechanism::Mprotect
    } else {
        Mechanism::Userfault
    }
}

/// Protects pages a heap space has just taken into use or freed whole; any thread. In the huge
/// region ([`Guard::huge_region`]) only a huge page taken into use for the first time is
/// protected, whole, after a write that has the kernel back it with one: inside one already
/// in use the page gate and the runtime's faults shut and open whole huge pages, and a page
/// protected alone would split one.
fn protect_heap_pages(start: u64, len: u64) {
    if !INSTALLED.load(Ordering::Acquire) {
        return;
    }
    let (mechanism, uffd) = (mechanism_now(), UFFD.load(Ordering::Relaxed));
    let huge = HUGE_REGION.load(Ordering::Relaxed);
    if huge == 0 && !HUGE_REFUSED.load(Ordering::Relaxed) && crate::heap::space_of_addr(start).is_some_and(crate::heap::is_huge) {
        // Not yet taken for huge ([`Guard::huge_region`]): a page protected alone would split
        // its huge page, and the next call's entry protects the whole space in use anyway.
        return;
    }
    if huge != 0 && (huge..huge + crate::heap::SPACE_BYTES).contains(&start) {
        let top = HUGE_TOP.load(Ordering::Relaxed);
        let end = (start + len).next_multiple_of(HUGE_PAGE);
        let mut at = top.max(start / HUGE_PAGE * HUGE_PAGE);
        while at < end {
            // A huge page no block has reached before (the space hands out its pages in
            // order, and `HUGE_TOP` is past every one taken into use before), so not yet
            // protected. Without one, the range is still shut whole, page by page, and the
            // next call's entry guards the region page by page.
            if !crate::heap::back_huge(at) {
                HUGE_FAILED.store(true, Ordering::Relaxed);
            }
            let _ = set(mechanism, uffd, at, HUGE_PAGE, true);
            at += HUGE_PAGE;
        }
        HUGE_TOP.fetch_max(end, Ordering::Relaxed);
        return;
    }
    let _ = set(mechanism, uffd, start, len, true);
}

/// The start of the heap space guarded a huge page at a time ([`Guard::huge_region`]), 0 for
/// none, and the end of the huge pages of it taken into use.
static HUGE_REGION: AtomicU64 = AtomicU64::new(0);
static HUGE_TOP: AtomicU64 = AtomicU64::new(0);
/// Set once a space that asked for huge pages is guarded page by page after all.
static HUGE_REFUSED: AtomicBool = AtomicBool::new(false);
/// A huge page of it taken into use could not be backed by one ([`crate::heap::back_huge`]).
static HUGE_FAILED: AtomicBool = AtomicBool::new(false);

/// The guard's state.
///
/// # Safety
/// Only on the guarded thread, with no other reference to the state alive: in a handler (which
/// runs on that thread between two of its instructions, and only where none of `Guard`'s
/// methods runs, as they write no guarded page), or in a `Guard` method.
#[allow(clippy::mut_from_ref)]
unsafe fn state() -> &'static mut State {
    // SAFETY: as the caller promises.
    unsafe { &mut *STATE.0.get() }
}

std::thread_local! {
    /// The calling thread's id, once asked: every call into guarded code and every fault
    /// asks whether it runs on the guarded thread, and a system call each time would cost
    /// more than the rest of the check. Plain data without a destructor, so reading it is
    /// async-signal-safe; a forked child forgets it ([`forget_tid`]).
    static MY_TID: std::cell::Cell<i32> = const { std::cell::Cell::new(0) };
}

fn gettid() -> i32 {
    MY_TID.with(|t| match t.get() {
        0 => {
            // SAFETY: a system call without arguments.
            let tid = unsafe { libc::syscall(libc::SYS_gettid) as i32 };
            t.set(tid);
            tid
        }
        tid => tid,
    })
}

/// In a forked child, whose one thread has an id of its own: asked again.
extern "C" fn forget_tid() {
    MY_TID.with(|t| t.set(0));
}

/// Gives `sig` back its default action, so that the fault, repeated when the handler returns,
/// ends the process as it would have without the guard.
fn not_ours(sig: libc::c_int) {
    // SAFETY: signal(2) with the default disposition is async-signal-safe.
    unsafe { libc::signal(sig, libc::SIG_DFL) };
}

/// The x86 trap flag in RFLAGS: a trap after the next instruction.
#[cfg(target_arch = "x86_64")]
const TRAP_FLAG: i64 = 0x100;

#[cfg(target_arch = "x86_64")]
fn set_trap_flag(ctx: *mut libc::c_void, on: bool) -> bool {
    let uc = ctx.cast::<libc::ucontext_t>();
    // SAFETY: the kernel passes an SA_SIGINFO handler the interrupted context, which the
    // handler may change and sigreturn restores.
    unsafe {
        let flags = &mut (*uc).uc_mcontext.gregs[libc::REG_EFL as usize];
        if on {
            *flags |= TRAP_FLAG;
        } else {
            *flags &= !TRAP_FLAG;
        }
    }
    true
}

#[cfg(not(target_arch = "x86_64"))]
fn set_trap_flag(_ctx: *mut libc::c_void, _on: bool) -> bool {
    false
}

/// `SEGV_PKUERR`: a SIGSEGV raised by a page's protection key.
const SEGV_PKUERR: libc::c_int = 4;

extern "C" fn on_write_fault(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // SAFETY: the kernel passes an SA_SIGINFO handler a valid siginfo.
    let (addr, code) = unsafe { ((*info).si_addr() as u64, (*info).si_code) };
    // SAFETY: a handler on the guarded thread (checked first) — see `state`.
    let st = unsafe { state() };
    if st.tid != gettid() {
        return not_ours(sig);
    }
    let Some(region) = st.region_of(addr) else { return not_ours(sig) };
    if sig == libc::SIGSEGV && code == SEGV_PKUERR {
        // A key the running call was denied: never one its table allows (`deny_for`).
        if st.running && st.saved_pkru.is_some() {
            stop(st, addr, region);
        }
        return not_ours(sig);
    }
    if sig == libc::SIGSEGV && st.mechanism == Mechanism::Userfault && !st.regions[region].whole {
        return not_ours(sig);
    }
    let page = addr & !(PAGE - 1);
    if st.running && !allowed(st, addr) {
        stop(st, addr, region);
    }
    if st.held_at(page) {
        st.let_into_held(page);
    }
    if !st.running {
        // The runtime's write: a region shut whole opens whole.
        let (start, end) = st.span_of(page);
        if st.set(start, end - start, false).is_err() {
            return not_ours(sig);
        }
        st.stats.outside += 1;
        st.shadow.opened(start, false);
        return;
    }
    if st.regions[region].huge {
        st.unhuge(region);
    }
    if st.set(page, PAGE, false).is_err() {
        return not_ours(sig);
    }
    st.stats.allowed += 1;
    match st.shadow.mode() {
        Mode::Dwc => {
            if st.nstepping < MAX_STEPPING && set_trap_flag(ctx, true) {
                st.stepping[st.nstepping] = page;
                st.nstepping += 1;
            } else {
                // No single step to be had: the page waits in the pool for the next call.
                st.shadow.opened(page, false);
            }
        }
        Mode::Scdwc { .. } => {
            if let Some(Evicted::Protect(old)) = st.shadow.opened(page, true) {
                let (start, end) = st.span_of(old);
                let _ = st.set(start, end - start, true);
                st.stats.page_protects += 1;
            }
        }
    }
}

/// Whether the running guarded code may write `addr`: its table allows it, and it is not a
/// block of the heap freed whole (unless the allocator itself is writing its links there).
fn allowed(st: &State, addr: u64) -> bool {
    st.act.allows(addr) && (!crate::heap::is_freed(addr) || crate::heap::busy())
}

/// Reports a write guarded code may not make and ends the process; async-signal-safe.
fn stop(st: &State, addr: u64, region: usize) -> ! {
    let v = Violation { address: addr, region: region as u32, filter: st.filter };
    if st.report_fd >= 0 {
        let b = v.encode();
        // SAFETY: write(2) of a local buffer is async-signal-safe.
        unsafe { libc::write(st.report_fd, b.as_ptr().cast(), b.len()) };
    }
    if st.text_fd >= 0 {
        let mut line = Line::new();
        line.put(b"bulkhead guard: filter `");
        line.put_name(st.filter_names.get(st.filter as usize).unwrap_or(&[0; NAME]));
        line.put(b"` wrote at 0x");
        line.put_hex(addr);
        line.put(b" in `");
        line.put_name(&st.regions[region].name);
        line.put(b"`, which it may not write: stopped before the write\n");
        // SAFETY: write(2) of a local buffer is async-signal-safe.
        unsafe { libc::write(st.text_fd, line.buf.as_ptr().cast(), line.len) };
    }
    // SAFETY: _exit is async-signal-safe; the write never happened.
    unsafe { libc::_exit(VIOLATION_EXIT) }
}

/// A report line built without allocating.
struct Line {
    buf: [u8; 256],
    len: usize,
}

impl Line {
    fn new() -> Line {
        Line { buf: [0; 256], len: 0 }
    }

    fn put(&mut self, b: &[u8]) {
        let k = b.len().min(self.buf.len() - self.len);
        self.buf[self.len..self.len + k].copy_from_slice(&b[..k]);
        self.len += k;
    }

    fn put_name(&mut self, n: &[u8; NAME]) {
        let k = n.iter().position(|&c| c == 0).unwrap_or(NAME);
        self.put(&n[..k]);
    }

    fn put_hex(&mut self, v: u64) {
        let mut d = [0u8; 16];
        for (i, c) in d.iter_mut().enumerate() {
            *c = b"0123456789abcdef"[((v >> ((15 - i) * 4)) & 0xf) as usize];
        }
        let first = d.iter().position(|&c| c != b'0').unwrap_or(15);
        self.put(&d[first..]);
    }
}

extern "C" fn on_trap(sig: libc::c_int, _info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // SAFETY: a handler on the guarded thread (checked first) — see `state`.
    let st = unsafe { state() };
    if st.tid != gettid() || st.nstepping == 0 {
        return not_ours(sig);
    }
    for i in 0..st.nstepping {
        let _ = st.set(st.stepping[i], PAGE, true);
    }
    st.stats.page_protects += st.nstepping as u64;
    st.stats.steps += 1;
    st.nstepping = 0;
    set_trap_flag(ctx, false);
}

/// Write capture for the calling thread. See the crate's documentation.
#[derive(Debug)]
pub struct Guard {
    trap: Option<WriteTrap>,
    old: [libc::sigaction; 2],
    /// SIGSEGV's earlier action, when [`gate_keys`](Self::gate_keys) or a region shut whole
    /// ([`add_shared_region`](Self::add_shared_region)) took it under userfaultfd (whose faults
    /// come as SIGBUS).
    old_segv: Option<libc::sigaction>,
    owners: Vec<String>,
    /// Not Send: the guard belongs to the thread that installed it.
    _thread: std::marker::PhantomData<*const ()>,
}

fn sigaction(sig: libc::c_int, handler: usize) -> io::Result<libc::sigaction> {
    // SAFETY: zeroed sigaction is a valid "no flags, empty mask" value, then filled in.
    let mut sa: libc::sigaction = unsafe { std::mem::zeroed() };
    sa.sa_sigaction = handler;
    sa.sa_flags = libc::SA_SIGINFO;
    // SAFETY: zeroed as above, for the old action.
    let mut old: libc::sigaction = unsafe { std::mem::zeroed() };
    // SAFETY: both structs are valid and outlive the call; the handler is an extern "C"
    // function with the SA_SIGINFO signature.
    if unsafe { libc::sigaction(sig, &sa, &mut old) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(old)
}

impl Guard {
    /// Installs the guard for the calling thread, catching writes with `mechanism` and letting
    /// allowed ones through as `mode` says. A stopped write is reported on `report_fd` (a
    /// [`Violation`] of [`Violation::BYTES`] bytes), if given, before the process exits with
    /// [`VIOLATION_EXIT`]. One guard per process.
    pub fn install(mechanism: Mechanism, mode: Mode, report_fd: Option<RawFd>) -> io::Result<Guard> {
        if mode == Mode::Dwc && !cfg!(target_arch = "x86_64") {
            return Err(io::Error::new(io::ErrorKind::Unsupported, "dwc needs single steps, which only x86_64 has here"));
        }
        if INSTALLED.swap(true, Ordering::AcqRel) {
            return Err(io::Error::new(io::ErrorKind::AlreadyExists, "a guard is installed already"));
        }
        let trap = match mechanism {
            Mechanism::Userfault => match WriteTrap::signalling() {
                Ok(t) => Some(t),
                Err(e) => {
                    INSTALLED.store(false, Ordering::Release);
                    return Err(e);
                }
            },
            Mechanism::Mprotect => None,
        };
        {
            // SAFETY: on the installing thread, no handler installed yet.
            let st = unsafe { state() };
            *st = State::EMPTY;
            static AT_FORK: std::sync::Once = std::sync::Once::new();
            // SAFETY: registers a handler that only clears a thread-local integer.
            AT_FORK.call_once(|| unsafe {
                libc::pthread_atfork(None, None, Some(forget_tid));
            });
            st.tid = gettid();
            st.mechanism = mechanism;
            st.uffd = trap.as_ref().map_or(-1, |t| t.as_raw_fd());
            st.report_fd = report_fd.unwrap_or(-1);
            st.shadow = Shadow::new(mode);
            TID.store(st.tid, Ordering::Relaxed);
            MECH.store(u8::from(mechanism == Mechanism::Mprotect), Ordering::Relaxed);
            UFFD.store(st.uffd, Ordering::Relaxed);
        }
        let fault_sig = if mechanism == Mechanism::Userfault { libc::SIGBUS } else { libc::SIGSEGV };
        let fault = sigaction(fault_sig, on_write_fault as *const () as usize);
        let actions = fault.and_then(|f| Ok([f, sigaction(libc::SIGTRAP, on_trap as *const () as usize)?]));
        match actions {
            Ok(old) => Ok(Guard { trap, old, old_segv: None, owners: Vec::new(), _thread: std::marker::PhantomData }),
            Err(e) => {
                INSTALLED.store(false, Ordering::Release);
                Err(e)
            }
        }
    }

    /// Adds `[start, start + len)`, page-aligned memory of this process that is mapped
    /// read-write (anonymous or shared memory), to what guarded code may not write, under the
    /// name `owner`. Protected from the next [`enter`](Self::enter). Returns its number, as
    /// violations name it.
    pub fn add_region(&mut self, start: u64, len: u64, owner: &str) -> io::Result<u32> {
        self.add(start, len, owner, None, false)
    }

    /// As [`add_region`](Self::add_region), for a whole mapping of shared memory (a domain's
    /// ring): protected and opened whole with `mprotect`, whatever the guard's mechanism, and
    /// left out of the userfaultfd. Opened with `UFFDIO_WRITEPROTECT`, a shared page stays
    /// read-only in the page tables until its next write, which the kernel then resolves in a
    /// fault of its own, one a page each time; `mprotect` makes the mapping writable at once.
    /// The runtime's first write after the region was shut opens it whole; guarded code's
    /// allowed writes open their pages alone, as [`Mechanism::Mprotect`] does.
    pub fn add_shared_region(&mut self, start: u64, len: u64, owner: &str) -> io::Result<u32> {
        if self.mechanism() == Mechanism::Userfault && self.old_segv.is_none() {
            self.old_segv = Some(sigaction(libc::SIGSEGV, on_write_fault as *const () as usize)?);
        }
        self.add(start, len, owner, None, true)
    }

    /// Adds space `s` of the active heap as a region named `owner`: pages it takes into use
    /// later, or frees whole, are protected as that happens.
    pub fn add_heap_space(&mut self, s: crate::heap::Space, owner: &str) -> io::Result<u32> {
        let (start, len) = crate::heap::space_range(s)
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, format!("region {owner}: no heap space {}", s.0)))?;
        let n = self.add(start, len, owner, Some(crate::heap::extent(s)), false)?;
        crate::heap::on_pages(Some(protect_heap_pages));
        if let Some(k) = crate::heap::key_of(s) {
            // SAFETY: a `Guard` method on the guarded thread (not Send).
            unsafe { state() }.regions[n as usize].key = k;
        }
        Ok(n)
    }

    /// Gives region `region` protection key `key` (from [`bulkhead_sys::pkey::alloc`] on
    /// this thread, or a heap space's, [`crate::heap::key_of`]): a call gated by keys may
    /// not write it unless it is the caller's own key.
    pub fn key_region(&mut self, region: u32, key: u32) -> io::Result<()> {
        // SAFETY: a `Guard` method on the guarded thread (not Send).
        let st = unsafe { state() };
        let r = st.regions.get_mut(region as usize).filter(|_| (region as usize) < st.nregions);
        let r = r.ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, format!("no region {region}")))?;
        bulkhead_sys::pkey::assign(r.start, r.end - r.start, key)?;
        r.key = key;
        Ok(())
    }

    /// Gates each call with protection keys as well: while guarded code named `filter` runs,
    /// the guarded thread's PKRU denies writes to every keyed region but those with
    /// `own_keys[filter]` (its heap space's key; 0: that filter's calls are not gated), for
    /// two register writes per call. A write
    /// it is denied is stopped and reported as any other, whatever the page protection's
    /// cache holds open. The keyed regions are the partition by owner; the page protection
    /// still checks the table inside what a filter may reach (its blocks freed whole).
    pub fn gate_keys(&mut self, own_keys: &[u32]) -> io::Result<()> {
        if !bulkhead_sys::pkey::supported() {
            return Err(io::Error::new(io::ErrorKind::Unsupported, "the processor has no protection keys"));
        }
        if own_keys.len() > MAX_FILTERS {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("keys for {} filters", own_keys.len())));
        }
        let mechanism = self.mechanism();
        if mechanism == Mechanism::Userfault && self.old_segv.is_none() {
            self.old_segv = Some(sigaction(libc::SIGSEGV, on_write_fault as *const () as usize)?);
        }
        // SAFETY: a `Guard` method on the guarded thread (not Send).
        let st = unsafe { state() };
        st.own_key = [0; MAX_FILTERS];
        st.own_key[..own_keys.len()].copy_from_slice(own_keys);
        st.keys = true;
        Ok(())
    }

    /// Makes region `region` the own memory of the guarded code named `filter` (as
    /// [`enter`](Self::enter) numbers it), for [`gate_pages`](Self::gate_pages); every region
    /// is the runtime's until then.
    pub fn own_region(&mut self, region: u32, filter: u32) -> io::Result<()> {
        // SAFETY: a `Guard` method on the guarded thread (not Send).
        let st = unsafe { state() };
        let r = st.regions.get_mut(region as usize).filter(|_| (region as usize) < st.nregions);
        r.ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, format!("no region {region}")))?.owner = filter;
        Ok(())
    }

    /// Marks region `region` (the runtime's) as written by the runtime only at points it
    /// announces with [`reopen_deferred`], such as a domain's rings, written between turns of
    /// its chain: what the page gate shuts of it at a call's entry stays shut at the call's
    /// exit, so the calls that follow (a request's completion after its submission) find it
    /// shut already, for no system call; [`reopen_deferred`] opens it. A write into it before
    /// then is let through as any other, at the cost of a fault.
    pub fn defer_reopen(&mut self, region: u32) -> io::Result<()> {
        // SAFETY: a `Guard` method on the guarded thread (not Send).
        let st = unsafe { state() };
        let r = st.regions.get_mut(region as usize).filter(|_| (region as usize) < st.nregions);
        r.ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, format!("no region {region}")))?.deferred = true;
        Ok(())
    }

    /// Gates the calls of each guarded code `filter` with `gated[filter]` by page protection,
    /// where protection keys do not gate them ([`gate_keys`](Self::gate_keys)): at the call's
    /// entry, the pages the shadow page cache holds open that are another owner's (the
    /// runtime's, another filter's: [`own_region`](Self::own_region)) and that the call's
    /// table does not reach are protected, in runs of adjacent pages, one system call each;
    /// at its exit they are opened again ([`Stats::trims`]: now and then they are left shut).
    /// The cache then keeps the runtime's hot pages open for the runtime without opening them
    /// to the filter, for two system calls per run per call.
    pub fn gate_pages(&mut self, gated: &[bool]) -> io::Result<()> {
        if gated.len() > MAX_FILTERS {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("page gates for {} filters", gated.len())));
        }
        // SAFETY: a `Guard` method on the guarded thread (not Send).
        let st = unsafe { state() };
        st.page_gate = [false; MAX_FILTERS];
        st.page_gate[..gated.len()].copy_from_slice(gated);
        Ok(())
    }

    /// Guards heap region `region` (from [`add_heap_space`](Self::add_heap_space), a space that
    /// [`crate::heap::prefer_huge`] made of transparent huge pages) a huge page at a time:
    /// what the runtime opens by writing, what the cache holds and what the page gate shuts is
    /// the whole huge page, 2 MiB for one step of the kernel's page walk, where page by page
    /// each of the 4 KiB pages it holds open takes its own step and flush. Meant for the
    /// runtime's space in a domain whose guarded filters are all gated by pages
    /// ([`gate_pages`](Self::gate_pages)): plain SCDWC would then hold 2 MiB open for one
    /// written page. Should a call's table reach into the region, it is guarded page by page
    /// from that call on ([`Stats::unhuged`]). `false`, and nothing changes, where the space
    /// has no huge pages or the guard uses `mprotect`.
    pub fn huge_region(&mut self, region: u32) -> io::Result<bool> {
        let mechanism = self.mechanism();
        // SAFETY: a `Guard` method on the guarded thread (not Send).
        let st = unsafe { state() };
        let r = st.regions.get_mut(region as usize).filter(|_| (region as usize) < st.nregions);
        let r = r.ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, format!("no region {region}")))?;
        let space = crate::heap::space_of_addr(r.start);
        if mechanism != Mechanism::Userfault
            || r.extent.is_none()
            || !r.start.is_multiple_of(HUGE_PAGE)
            || !space.is_some_and(crate::heap::is_huge)
            || HUGE_REGION.load(Ordering::Relaxed) != 0
        {
            return Ok(false);
        }
        // What the space holds already: protected whole, after a write that backs each huge
        // page (the first byte of a page in use is a block's; rewritten as it is).
        let used = r.protected_len().next_multiple_of(HUGE_PAGE);
        let mut at = r.start;
        while at < r.start + used {
            if !crate::heap::back_huge(at) {
                HUGE_REFUSED.store(true, Ordering::Relaxed);
                st.shadow.reset();
                return Ok(false);
            }
            at += HUGE_PAGE;
        }
        r.huge = true;
        HUGE_TOP.store(at, Ordering::Relaxed);
        HUGE_REGION.store(r.start, Ordering::Relaxed);
        st.shadow.reset();
        Ok(true)
    }

    fn add(&mut self, start: u64, len: u64, owner: &str, extent: Option<&'static AtomicU64>, whole: bool) -> io::Result<u32> {
        let bad = |why: &str| Err(io::Error::new(io::ErrorKind::InvalidInput, format!("region {owner}: {why}")));
        if !start.is_multiple_of(PAGE) || !len.is_multiple_of(PAGE) || len == 0 {
            return bad("not whole pages");
        }
        let end = start.checked_add(len).ok_or_else(|| io::Error::from(io::ErrorKind::InvalidInput))?;
        let own = STATE.0.get() as u64;
        if own < end && own + std::mem::size_of::<State>() as u64 > start {
            return bad("holds the guard's own state");
        }
        // SAFETY: a `Guard` method on the guarded thread (not Send).
        let st = unsafe { state() };
        if st.nregions == MAX_REGIONS {
            return bad("too many regions");
        }
        if st.regions[..st.nregions].iter().any(|r| r.start < end && start < r.end) {
            return bad("overlaps another region");
        }
        if let Some(t) = self.trap.as_ref().filter(|_| !whole) {
            t.register(start, len).map_err(|e| io::Error::new(e.kind(), format!("region {owner}: userfaultfd: {e}")))?;
        }
        st.regions[st.nregions] =
            Region { start, end, extent, key: 0, owner: RUNTIME, deferred: false, whole, huge: false, name: name_of(owner) };
        st.nregions += 1;
        st.shadow.reset();
        self.owners.push(owner.to_string());
        Ok(st.nregions as u32 - 1)
    }

    /// Names guarded code `filter` (as [`enter`](Self::enter) numbers it) in reports.
    pub fn name_filter(&mut self, filter: u32, name: &str) {
        // SAFETY: a `Guard` method on the guarded thread (not Send).
        let st = unsafe { state() };
        if let Some(n) = st.filter_names.get_mut(filter as usize) {
            *n = name_of(name);
        }
    }

    /// Also reports a stopped write as a line of text on `fd` (the domain's standard error).
    pub fn report_text(&mut self, fd: RawFd) {
        // SAFETY: a `Guard` method on the guarded thread (not Send).
        unsafe { state() }.text_fd = fd;
    }

    /// A handle for entering and leaving guarded code from other owners on this thread.
    pub fn handle(&self) -> Handle {
        Handle(std::marker::PhantomData)
    }

    /// The name a region was added under.
    pub fn owner(&self, region: u32) -> Option<&str> {
        self.owners.get(region as usize).map(String::as_str)
    }

    /// Guarded code named `filter` starts running, allowed to write what `act` allows: protects
    /// what the mode says (every region under DWC and on SCDWC's first call; the pool
    /// otherwise).
    pub fn enter(&mut self, filter: u32, act: &Act) -> io::Result<()> {
        // SAFETY: a `Guard` method on the guarded thread (not Send).
        let mode = unsafe { state() }.shadow.mode();
        enter(filter, act, mode)
    }

    /// The guarded code has returned: writes are the runtime's again, let through and
    /// recorded for the next call.
    pub fn exit(&mut self) {
        exit();
    }

    /// Runs `f` as guarded code named `filter`, allowed to write what `act` allows.
    pub fn call<R>(&mut self, filter: u32, act: &Act, f: impl FnOnce() -> R) -> io::Result<R> {
        self.enter(filter, act)?;
        let r = f();
        self.exit();
        Ok(r)
    }

    /// What the guard has done.
    pub fn stats(&self) -> Stats {
        // SAFETY: a `Guard` method on the guarded thread (not Send); the state is only read.
        let st = unsafe { state() };
        st.stats_now()
    }

    /// The mechanism.
    pub fn mechanism(&self) -> Mechanism {
        // SAFETY: a `Guard` method on the guarded thread (not Send).
        unsafe { state() }.mechanism
    }
}

/// Enters guarded code on the guarded thread (checked by the callers).
fn enter(filter: u32, act: &Act, mode: Mode) -> io::Result<()> {
    {
        // SAFETY: on the guarded thread, outside any handler, no other reference alive.
        let st = unsafe { state() };
        if st.shadow.mode() != mode {
            st.shadow = Shadow::new(mode);
        } else if st.last_filter != filter {
            st.shadow.flush();
        }
        st.last_filter = filter;
    }
    {
        // SAFETY: as above.
        let st = unsafe { state() };
        st.act = *act;
        st.filter = filter;
        st.stats.calls += 1;
        if HUGE_FAILED.swap(false, Ordering::Relaxed) {
            if let Some(r) = st.regions[..st.nregions].iter().position(|r| r.huge) {
                st.unhuge(r);
            }
        }
        let (mechanism, uffd) = (st.mechanism, st.uffd);
        let regions = &st.regions[..st.nregions];
        match st.shadow.prepare() {
            Prepare::All => {
                for r in regions {
                    set(r.mechanism(mechanism), uffd, r.start, r.protected_len(), true)?;
                }
                st.stats.region_protects += st.nregions as u64;
            }
            Prepare::Pages(pages) => {
                for &p in pages {
                    let (start, end, by) = span_in(regions, mechanism, p);
                    set(by, uffd, start, end - start, true)?;
                }
                st.stats.page_protects += pages.len() as u64;
            }
        }
        let deny = st.deny_for(filter, act);
        if deny == 0 && st.page_gate.get(filter as usize).copied().unwrap_or(false) {
            gate(st, filter)?;
        }
        // What the last gated call opened beyond the cache is shut for every call.
        for i in 0..std::mem::take(&mut st.nloose) {
            let (start, end) = st.loose[i];
            if !st.gated[..st.ngated].iter().any(|&(a, b)| a <= start && end <= b) {
                st.set(start, end - start, true)?;
            }
        }
        st.running = true;
        if deny != 0 {
            let pkru = bulkhead_sys::pkey::read();
            st.saved_pkru = Some(pkru);
            st.stats.keyed += 1;
            // Last: the state above lies in key 0, which is never denied.
            bulkhead_sys::pkey::write(pkru | deny);
        }
    }
    Ok(())
}

/// Shuts, for the call of `filter` about to run, the pages the cache holds open that are
/// another owner's and outside the call's table, in ranges of adjacent pages (with gaps of at
/// most [`GATE_GAP`] pages, shut already, that [`State::may_join`] across), and records them
/// for [`exit`].
fn gate(st: &mut State, filter: u32) -> io::Result<()> {
    // What each cached page stands for, with its region's kind, which a range keeps from its
    // first ([`State::span_of`]). A region shut whole, or a huge page, is shut whole though
    // the table reaches into it: the call's allowed writes there open their pages alone (a
    // huge region turning to small pages first, `State::unhuge`).
    let mut spans = [(0u64, 0u64, Kind { deferred: false, whole: false }); MAX_CACHE];
    let mut n = 0;
    for p in st.shadow.cached_pages() {
        let Some(r) = st.region_of(p) else { continue };
        let region = &st.regions[r];
        if region.owner == filter || st.held_at(p) || (!region.opens_whole() && st.act.reaches(p, p + PAGE)) {
            continue;
        }
        let (start, end) = st.span_of(p);
        spans[n] = (start, end, Kind::of(region));
        n += 1;
    }
    let spans = &mut spans[..n];
    spans.sort_unstable_by_key(|&(start, _, _)| start);
    st.ngated = 0;
    let mut range_kind = Kind { deferred: false, whole: false };
    for &(start, end, kind) in spans.iter() {
        if st.ngated > 0 {
            let last = st.gated[st.ngated - 1].1;
            if start < last {
                continue;
            }
            if start <= last + GATE_GAP * PAGE && kind == range_kind && st.may_join(last, start, filter, kind) {
                st.gated[st.ngated - 1].1 = end;
                continue;
            }
        }
        st.gated[st.ngated] = (start, end);
        st.ngated += 1;
        range_kind = kind;
    }
    for i in 0..st.ngated {
        let (start, end) = st.gated[i];
        st.set(start, end - start, true)?;
        st.stats.gated_pages += (end - start) / PAGE;
    }
    st.stats.gated += 1;
    st.stats.gated_ranges += st.ngated as u64;
    Ok(())
}

fn exit() {
    // SAFETY: on the guarded thread, outside any handler, no other reference alive.
    let st = unsafe { state() };
    if let Some(pkru) = st.saved_pkru.take() {
        bulkhead_sys::pkey::write(pkru);
    }
    st.running = false;
    let n = std::mem::take(&mut st.ngated);
    if n > 0 {
        st.trim_in -= 1;
        if st.trim_in == 0 {
            // Leave them shut: the runtime reopens what it still writes, a fault a page.
            st.trim_in = TRIM_EVERY;
            let (gated, held) = (&st.gated[..n], &st.held[..st.nheld]);
            st.shadow.drop_shut(|p| gated.iter().chain(held).any(|&(a, b)| a <= p && p < b));
            st.nheld = 0;
            st.stats.trims += 1;
            return;
        }
    }
    for i in 0..n {
        let (start, end) = st.gated[i];
        if st.nheld < MAX_CACHE && st.deferred_at(start) {
            st.held[st.nheld] = (start, end);
            st.nheld += 1;
            st.stats.deferred += 1;
            continue;
        }
        let _ = st.set(start, end - start, false);
        st.loose[st.nloose] = (start, end);
        st.nloose += 1;
    }
}

/// The runtime is about to write its deferred regions ([`Guard::defer_reopen`]): opens what
/// gated calls left shut of them. Does nothing off the guarded thread, without a guard, or
/// while guarded code runs (whose calls must find them shut).
pub fn reopen_deferred() {
    if !INSTALLED.load(Ordering::Acquire) || TID.load(Ordering::Relaxed) != gettid() {
        return;
    }
    // SAFETY: on the guarded thread, outside any handler, no other reference alive.
    let st = unsafe { state() };
    if !st.running && st.nheld > 0 {
        st.reopen_held();
    }
}

/// Enters and leaves guarded code for its owners on the guarded thread (the layers a domain
/// wraps its filters in); refused on any other thread.
#[derive(Debug, Clone, Copy)]
pub struct Handle(std::marker::PhantomData<()>);

impl Default for Handle {
    fn default() -> Self {
        Self::new()
    }
}

impl Handle {
    /// A handle; it acts only on the guarded thread of an installed guard.
    pub const fn new() -> Handle {
        Handle(std::marker::PhantomData)
    }

    fn on_guarded_thread() -> io::Result<()> {
        if !INSTALLED.load(Ordering::Acquire) || TID.load(Ordering::Relaxed) != gettid() {
            return Err(io::Error::other("not the guarded thread"));
        }
        Ok(())
    }

    /// Guarded code named `filter` starts running, allowed to write what `act` allows, with
    /// writes let through as `mode` says (a change of mode protects everything first).
    pub fn enter(&self, filter: u32, act: &Act, mode: Mode) -> io::Result<()> {
        Self::on_guarded_thread()?;
        enter(filter, act, mode)
    }

    /// The guarded code has returned.
    pub fn exit(&self) {
        if Self::on_guarded_thread().is_ok() {
            exit();
        }
    }

    /// What the guard has done.
    pub fn stats(&self) -> Stats {
        if Self::on_guarded_thread().is_err() {
            return Stats::default();
        }
        // SAFETY: on the guarded thread, outside any handler, no other reference alive; the
        // state is only read.
        let st = unsafe { state() };
        st.stats_now()
    }

    /// Whether the running call's write of the word at `addr` would be stopped under DWC: it
    /// lies in a guarded region and outside the call's table. `false` outside a call and off
    /// the guarded thread. The test kit keeps only the faults this says DWC stops.
    pub fn would_stop(&self, addr: u64) -> bool {
        if Self::on_guarded_thread().is_err() {
            return false;
        }
        // SAFETY: as in `stats`.
        let st = unsafe { state() };
        st.running && st.region_of(addr).is_some() && !st.act.allows(addr) && !st.act.allows(addr + 7)
    }
}

/// Opens the guarded pages of `buf` before a system call fills it: the kernel's writes into a
/// protected page would fail with EFAULT rather than fault. Call on any thread before reading
/// into memory that may lie in a guarded region. On the guarded thread while guarded code
/// runs, a buffer outside its table is a write it may not make, stopped as any other; the
/// pages opened wait in the pool for the next call, as writes between calls do.
pub fn kernel_fills(buf: &mut [u8]) {
    if !INSTALLED.load(Ordering::Acquire) || buf.is_empty() || TID.load(Ordering::Relaxed) != gettid() {
        return;
    }
    let (start, end) = (buf.as_ptr() as u64, buf.as_ptr() as u64 + buf.len() as u64);
    // SAFETY: on the guarded thread, outside any handler (this function writes no guarded
    // page before it is done with the state), no other reference alive.
    let st = unsafe { state() };
    let mut page = start & !(PAGE - 1);
    while page < end {
        if let Some(region) = st.region_of(page) {
            let at = page.max(start);
            if st.running && !allowed(st, at) {
                stop(st, at, region);
            }
            if st.held_at(page) {
                st.let_into_held(page);
            }
            let (start, end) = if st.running { (page, page + PAGE) } else { st.span_of(page) };
            if st.set(start, end - start, false).is_ok() {
                st.shadow.pool(start);
            }
        }
        page += PAGE;
    }
}

impl Drop for Guard {
    /// Opens every region and gives the signals back their earlier handlers.
    fn drop(&mut self) {
        // SAFETY: a `Guard` method on the guarded thread (not Send).
        let st = unsafe { state() };
        if let Some(pkru) = st.saved_pkru.take() {
            bulkhead_sys::pkey::write(pkru);
        }
        st.running = false;
        for r in &st.regions[..st.nregions] {
            let _ = st.set(r.start, r.protected_len(), false);
        }
        let fault_sig = if st.mechanism == Mechanism::Userfault { libc::SIGBUS } else { libc::SIGSEGV };
        // SAFETY: restoring the actions sigaction returned at install.
        unsafe {
            libc::sigaction(fault_sig, &self.old[0], std::ptr::null_mut());
            libc::sigaction(libc::SIGTRAP, &self.old[1], std::ptr::null_mut());
            if let Some(old) = &self.old_segv {
                libc::sigaction(libc::SIGSEGV, old, std::ptr::null_mut());
            }
        }
        crate::heap::on_pages(None);
        *st = State::EMPTY;
        TID.store(0, Ordering::Relaxed);
        self.trap = None;
        INSTALLED.store(false, Ordering::Release);
    }
}
