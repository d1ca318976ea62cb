//! Faults made on purpose in a guarded filter: a filter writes 8 bytes where it must not, at a
//! random call, and write capture must stop the write before it lands.
//!
//! Two populations. The targeted faults aim, at the start of a call, at the state a filter
//! could do the most harm to: the ring, the runtime's heap, another filter's state, a block it
//! just freed. The seed-like faults are modelled on the bugs a fault-injection tool plants:
//! a write through a corrupted live pointer, an overrun past a buffer the call was given, a
//! wild address weighted by size over the guarded memory. They strike before or after the
//! filter's own work in the call, and only where DWC would stop them
//! ([`bulkhead_guard::capture::Handle::would_stop`]): the paper kept only faults DWC isolated.
//!
//! The faults are made by a layer of this kit, [`Faulty`], which the test driver
//! (`bulkhead-test-driver`, told what to make by `BULKHEAD_TEST_GUARD_INJECT`, see
//! [`crate::inject`]) and `bulkhead-bench guard --isolation`, both built with the `test-driver`
//! feature, put around a filter's layer inside its write capture
//! (`bulkhead_driver::guarded::build_filters_wrapping`): each call into the filter may first make
//! the fault, as the filter's own code. Nothing in the configuration asks for faults, and the
//! driver has no code that makes them.

use std::io::{Read, Write};
use std::os::fd::OwnedFd;

use bulkhead_block::{After, Caps, Layer, ReadBelow, Request, SharedSlice, Tag, TagSpace, Verdict};
use bulkhead_block::{Outcome, SetupError};
use bulkhead_driver::guarded::{space_of, FilterSite};
use bulkhead_guard::capture::Handle;
use bulkhead_guard::heap::{self, Space};
use bulkhead_rng::Rng;

use crate::inject::{InjectSpec, InjectTarget};

/// One fault, as a probe's descriptor receives it before the write: two 8-byte words, the
/// address and the value to be written there (the old value with every bit of [`FAULT_FLIP`]
/// flipped). The filter then waits for one byte back: the probe is watching the memory.
pub const FAULT_RECORD: usize = 16;

/// What a fault flips in the word it writes: the old value is the written one with these bits
/// flipped back, so whoever checks the memory can tell "unchanged" from "written" from
/// "changed by something else".
pub const FAULT_FLIP: u64 = 0xA5A5_A5A5_5A5A_5A5A;

/// The exit status of a probed process whose write was not stopped: it ends right after the
/// write, so the memory holds what the write left (see [`Injector::new`]).
pub const PROBE_EXIT: i32 = 87;

/// The faults of one filter: one at a random call of every `spec.every` calls, aimed at
/// `spec.target`.
pub struct Injector {
    site: FilterSite,
    /// Its own heap space.
    own: Space,
    spec: InjectSpec,
    rng: Rng,
    calls: u64,
    next_at: u64,
    /// The filter's number and type, for reports.
    who: String,
    /// A measurement's descriptor: one fault only, recorded here; the process ends with it,
    /// stopped or not.
    probe: Option<std::fs::File>,
    /// The next fault strikes after the filter's own work in its call, not before.
    after: bool,
    /// A fault is due at the end of the running call.
    pending: bool,
    /// Counts the write working set instead of making a fault ([`Injector::census`]).
    census: bool,
}

impl Injector {
    /// The faults `spec` asks of the filter at `site`.
    ///
    /// With a `probe` (a measurement of isolation: a stream socket), the filter makes one
    /// fault only: its [`FAULT_RECORD`] goes to the probe before the write, and the write waits
    /// for the probe's one byte back, sent once it watches the process's end. If the write is
    /// not stopped the process ends at once with [`PROBE_EXIT`], so the probe reads, as the
    /// process ends, whether the protected state changed. A stopped write ends it with
    /// [`bulkhead_guard::VIOLATION_EXIT`], as always.
    pub fn new(site: &FilterSite, spec: InjectSpec, probe: Option<OwnedFd>) -> Injector {
        let who = format!("{} ({})", site.index + 1, site.name);
        let rng = Rng::new(spec.seed);
        let (site, own) = (site.clone(), space_of(site.index));
        let probe = probe.map(std::fs::File::from);
        let mut i =
            Injector { site, own, spec, rng, calls: 0, next_at: 0, who, probe, after: false, pending: false, census: false };
        i.schedule();
        i
    }

    /// No fault: at the filter's call number `calls`, writes to `probe` how many pages write
    /// capture's cache holds open and how many pages of guarded memory are in use (the rings,
    /// the used part of every heap space), as two 8-byte words, and ends the process with
    /// [`PROBE_EXIT`]. Under SCDWC with a cache larger than the working set (C =
    /// [`bulkhead_guard::shadow::MAX_CACHE`]) that is the write working set: the distinct pages
    /// the runtime and the filters wrote over those calls.
    pub fn census(site: &FilterSite, calls: u64, probe: OwnedFd) -> Injector {
        let spec = InjectSpec { target: InjectTarget::Wild, every: calls.max(1), seed: 0 };
        let mut i = Injector::new(site, spec, Some(probe));
        (i.next_at, i.census) = (calls.max(1), true);
        i
    }

    fn schedule(&mut self) {
        self.next_at = self.calls + 1 + self.rng.next_u64() % self.spec.every;
        if self.spec.target.seed_like() {
            self.after = self.rng.next_u64() & 1 == 1;
        }
    }

    /// A word-aligned address in `len` bytes from `start`.
    fn pick(&mut self, start: u64, len: u64) -> Option<u64> {
        (len >= 8).then(|| start + (self.rng.next_u64() % (len / 8)) * 8)
    }

    fn in_space(&mut self, s: Space) -> Option<u64> {
        let (start, _) = heap::space_range(s)?;
        let used = heap::extent(s).load(std::sync::atomic::Ordering::Relaxed);
        self.pick(start, used)
    }

    fn address(&mut self, target: InjectTarget, own: Space) -> Option<u64> {
        match target {
            InjectTarget::Ring => {
                let n = self.site.rings.len();
                let k = self.rng.next_u64() as usize % n.max(1);
                let (start, len) = *self.site.rings.get(k)?;
                self.pick(start, len)
            }
            InjectTarget::Heap => self.in_space(heap::RUNTIME),
            InjectTarget::Filter => {
                // Another filter's space.
                let others = self.site.filters.saturating_sub(1);
                let k = self.rng.next_u64() as usize % others.max(1);
                let j = (0..self.site.filters).filter(|&j| j != self.site.index).nth(k)?;
                self.in_space(space_of(j))
            }
            InjectTarget::Freed => {
                // A buffer of the filter's own, freed whole: its pages are no longer its to write.
                let block = heap::with_space(own, || vec![0u8; 2 * bulkhead_guard::PAGE as usize]);
                let at = block.as_ptr() as u64;
                drop(block);
                self.pick(at, 2 * bulkhead_guard::PAGE)
            }
            InjectTarget::Random => {
                let choices = [InjectTarget::Ring, InjectTarget::Heap, InjectTarget::Filter];
                let t = choices[self.rng.next_u64() as usize % choices.len()];
                self.address(t, own).or_else(|| self.address(InjectTarget::Heap, own))
            }
            // Made in `seed_address`, which knows the call's buffers.
            InjectTarget::Pointer | InjectTarget::Overrun | InjectTarget::Wild => None,
        }
    }

    /// The guarded memory in use, as (start, bytes): the rings, and the used part of the
    /// runtime's heap and of each filter's space, the filter's own too if `with_own`.
    fn guarded(&self, with_own: bool) -> Vec<(u64, u64)> {
        let mut v: Vec<(u64, u64)> = self.site.rings.clone();
        let spaces = std::iter::once(heap::RUNTIME).chain((0..self.site.filters).map(space_of));
        for s in spaces.filter(|&s| with_own || s != self.own) {
            if let Some((start, len)) = heap::space_range(s) {
                let used = heap::extent(s).load(std::sync::atomic::Ordering::Relaxed).min(len);
                v.push((start, used));
            }
        }
        v.retain(|&(_, len)| len >= 8);
        v
    }

    /// A word of `regions`, drawn weighted by their sizes.
    fn weighted(&mut self, regions: &[(u64, u64)]) -> Option<u64> {
        let words: u64 = regions.iter().map(|&(_, len)| len / 8).sum();
        if words == 0 {
            return None;
        }
        let mut k = self.rng.next_u64() % words;
        for &(start, len) in regions {
            if k < len / 8 {
                return Some(start + k * 8);
            }
            k -= len / 8;
        }
        None
    }

    /// Where a seed-like fault writes, inside the running call whose buffers are `bufs`: only
    /// where DWC would stop the write; `None` if no such place was found.
    fn seed_address(&mut self, bufs: &[(u64, u64)]) -> Option<u64> {
        let guard = Handle::new();
        let others = self.guarded(false);
        let made = match self.spec.target {
            InjectTarget::Pointer => {
                // A live pointer: a word anywhere in the guarded memory, the filter's own too,
                // whose value points into it; one low bit flipped, as a bit error or a bad
                // offset would.
                let all = self.guarded(true);
                (0..4096).find_map(|_| {
                    let at = self.weighted(&all)?;
                    // SAFETY: a word-aligned address inside memory this process maps for as
                    // long as it runs; read only.
                    let v = unsafe { std::ptr::read_volatile(at as *const u64) };
                    let live = v.is_multiple_of(8) && all.iter().any(|&(s, n)| v >= s && v < s + n);
                    let bad = v ^ (1u64 << (3 + self.rng.next_u64() % 10));
                    (live && within(&all, bad) && guard.would_stop(bad)).then_some(bad)
                })
            }
            InjectTarget::Overrun => {
                let bufs: Vec<(u64, u64)> = bufs.iter().copied().filter(|&(_, n)| n > 0).collect();
                (0..64).find_map(|_| {
                    let &(start, len) = bufs.get(self.rng.next_u64() as usize % bufs.len().max(1))?;
                    let at = (start + len).next_multiple_of(8) + 8 * (self.rng.next_u64() % 64);
                    (within(&others, at) && guard.would_stop(at)).then_some(at)
                })
            }
            _ => None,
        };
        // A wild write, and what the others fall back to.
        made.or_else(|| (0..64).find_map(|_| self.weighted(&others).filter(|&a| guard.would_stop(a))))
    }
}

/// Whether the word at `addr` lies inside one of `regions`.
fn within(regions: &[(u64, u64)], addr: u64) -> bool {
    addr.is_multiple_of(8) && regions.iter().any(|&(s, n)| addr >= s && addr + 8 <= s + n)
}

/// A fault ready to strike: 8 bytes at `addr`, to become `value`.
struct Fault {
    addr: u64,
    value: u64,
}

impl Injector {
    /// Whether the next call is the one a fault (or the census) is due at: only then does it
    /// need the call's buffers.
    fn due_next(&self) -> bool {
        self.calls + 1 >= self.next_at
    }

    /// Counts a call into the filter, whose buffers are `bufs`, and makes the fault if one is
    /// due before the filter's own work.
    fn before(&mut self, bufs: &[(u64, u64)]) {
        self.calls += 1;
        if self.calls < self.next_at {
            return;
        }
        if self.census {
            let open = Handle::new().stats().open_pages;
            let in_use: u64 = self.guarded(true).iter().map(|&(_, n)| n.div_ceil(bulkhead_guard::PAGE)).sum();
            if let Some(r) = &mut self.probe {
                let mut rec = [0u8; 16];
                rec[..8].copy_from_slice(&open.to_le_bytes());
                rec[8..].copy_from_slice(&in_use.to_le_bytes());
                let _ = r.write_all(&rec);
            }
            // SAFETY: ends the process at once, as a probed fault does.
            unsafe { libc::_exit(PROBE_EXIT) };
        }
        let after = self.after;
        self.schedule();
        if after {
            self.pending = true;
        } else {
            self.make(bufs, false);
        }
    }

    /// The filter's own work in the call is done: makes the fault due after it, if any.
    fn after(&mut self, bufs: &[(u64, u64)]) {
        if std::mem::take(&mut self.pending) {
            self.make(bufs, true);
        }
    }

    /// Makes the fault; `late`: after the filter's own work.
    fn make(&mut self, bufs: &[(u64, u64)], late: bool) {
        if let Some(f) = self.prepare(bufs, late) {
            self.strike(&f);
            self.landed(&f);
        }
    }

    fn prepare(&mut self, bufs: &[(u64, u64)], late: bool) -> Option<Fault> {
        let target = self.spec.target;
        let addr = if target.seed_like() { self.seed_address(bufs) } else { self.address(target, self.own) }?;
        // SAFETY: `addr` is a word-aligned address inside memory this process maps read-write
        // for as long as it runs (a ring, a heap space); reading it races with nothing, as the
        // domain is single-threaded.
        let old = unsafe { std::ptr::read_volatile(addr as *const u64) };
        let value = old ^ FAULT_FLIP;
        eprintln!(
            "bulkhead guard: injecting a fault from filter {}: 8 bytes at {addr:#x} ({}{})",
            self.who,
            target.as_str(),
            if late { ", after its work" } else { "" }
        );
        if let Some(r) = &mut self.probe {
            let mut rec = [0u8; FAULT_RECORD];
            rec[..8].copy_from_slice(&addr.to_le_bytes());
            rec[8..].copy_from_slice(&value.to_le_bytes());
            if r.write_all(&rec).and_then(|()| r.read_exact(&mut [0u8])).is_err() {
                // Nobody is left to check the memory: a fault nobody measures is not made.
                return None;
            }
        }
        Some(Fault { addr, value })
    }

    /// Makes the write, as the filter's own code: under write capture, which stops it (and
    /// ends the process) before it lands.
    fn strike(&mut self, f: &Fault) {
        // SAFETY: deliberately a write the filter must not make, into memory this process maps
        // read-write (see `prepare`); under write capture it is stopped before it lands.
        unsafe { std::ptr::write_volatile(f.addr as *mut u64, f.value) };
    }

    /// After a write that was not stopped: says so, read from the memory itself; a probe ends
    /// the process here, leaving the memory as the write left it.
    fn landed(&mut self, f: &Fault) {
        if self.probe.is_some() {
            // SAFETY: ends the process at once, running nothing of it (nothing that could write
            // guarded memory on the way out).
            unsafe { libc::_exit(PROBE_EXIT) };
        }
        // SAFETY: as in `prepare`.
        let now = unsafe { std::ptr::read_volatile(f.addr as *const u64) };
        if now == f.value {
            eprintln!("bulkhead guard: the injected write at {:#x} landed: not isolated", f.addr);
        }
    }
}

/// At most this many of a call's buffers are overrun candidates: its scratch and its first
/// data buffers.
const CALL_BUFS: usize = 8;

/// A call's buffers, as (start, bytes): its scratch, then its request's data, if `injector`
/// makes its fault in this call (none otherwise); kept on the stack, so that counting a call
/// allocates nothing in the filter's space.
fn call_bufs(injector: &Injector, req: &Request<'_>, scratch: &SharedSlice<'_>) -> ([(u64, u64); CALL_BUFS], usize) {
    let mut v = [(0, 0); CALL_BUFS];
    if !injector.due_next() {
        return (v, 0);
    }
    v[0] = (scratch.as_ptr() as u64, scratch.len() as u64);
    let mut n = 1;
    if let Request::Read { into: bufs, .. } | Request::Write { from: bufs, .. } = req {
        for b in bufs.iter().take(CALL_BUFS - 1) {
            v[n] = (b.as_ptr() as u64, b.len() as u64);
            n += 1;
        }
    }
    (v, n)
}

/// A filter's layer that makes its [`Injector`]'s faults: at each call, before the filter
/// itself runs or after its work, as its own code.
pub struct Faulty {
    inner: Box<dyn Layer>,
    injector: Injector,
}

impl Faulty {
    /// `inner`, making `injector`'s faults.
    pub fn new(inner: Box<dyn Layer>, injector: Injector) -> Faulty {
        Faulty { inner, injector }
    }
}

impl Layer for Faulty {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn caps(&self, lower: Caps) -> Caps {
        self.inner.caps(lower)
    }

    fn size(&self, lower: u64) -> u64 {
        self.inner.size(lower)
    }

    fn scratch_bytes(&self) -> usize {
        self.inner.scratch_bytes()
    }

    fn open(&mut self, below: &mut dyn ReadBelow) -> Result<(), SetupError> {
        self.inner.open(below)
    }

    fn attach(&mut self, tags: TagSpace) {
        self.inner.attach(tags)
    }

    fn submit(&mut self, tag: Tag, req: &Request<'_>, scratch: SharedSlice<'_>, now_ns: u64) -> Verdict {
        let (bufs, n) = call_bufs(&self.injector, req, &scratch);
        self.injector.before(&bufs[..n]);
        let v = self.inner.submit(tag, req, scratch, now_ns);
        self.injector.after(&bufs[..n]);
        v
    }

    fn complete(&mut self, tag: Tag, req: &Request<'_>, scratch: SharedSlice<'_>, result: &mut Outcome, now_ns: u64) -> After {
        let (bufs, n) = call_bufs(&self.injector, req, &scratch);
        self.injector.before(&bufs[..n]);
        let a = self.inner.complete(tag, req, scratch, result, now_ns);
        self.injector.after(&bufs[..n]);
        a
    }

    fn poll(&mut self, now_ns: u64, release: &mut dyn FnMut(Tag, Verdict)) -> Option<u64> {
        self.injector.before(&[]);
        let p = self.inner.poll(now_ns, release);
        self.injector.after(&[]);
        p
    }

    fn idle(&mut self) {
        self.injector.before(&[]);
        self.inner.idle();
        self.injector.after(&[]);
    }

    fn idle_wanted(&self) -> bool {
        self.inner.idle_wanted()
    }
}

/// Wraps the filter at `index` (from 0) of a domain in a [`Faulty`] making `spec`'s faults
/// (with no probe), and hands the others back as they are: the test driver's
/// [`bulkhead_driver::guarded::Wrap`].
pub fn wrap_one(index: usize, spec: InjectSpec) -> impl Fn(&FilterSite, Box<dyn Layer>) -> Box<dyn Layer> {
    move |site, layer| {
        if site.index == index {
            Box::new(Faulty::new(layer, Injector::new(site, spec, None)))
        } else {
            layer
        }
    }
}
