//! Faults made on purpose in a guarded filter: a filter writes 8 bytes where it must not, at a
//! random call, and write capture must stop the write before it lands.
//!
//! The faults are made by a layer of this kit, [`Faulty`], which the test driver
//! (`bulkhead-test-driver`, told what to make by `BULKHEAD_TEST_GUARD_INJECT`, see
//! [`crate::inject`]) and `bulkhead-bench guard --isolation`, both built with the `test-driver`
//! feature, put around a filter's layer inside its write capture
//! (`bulkhead_driver::guarded::build_filters_wrapping`): each call into the filter may first make
//! the fault, as the filter's own code. Nothing in the configuration asks for faults, and the
//! driver has no code that makes them.

use std::io::Write;
use std::os::fd::OwnedFd;

use bulkhead_block::{After, Caps, Layer, ReadBelow, Request, SharedSlice, Tag, TagSpace, Verdict};
use bulkhead_block::{Outcome, SetupError};
use bulkhead_driver::guarded::{space_of, FilterSite};
use bulkhead_guard::heap::{self, Space};
use bulkhead_rng::Rng;

use crate::inject::{InjectSpec, InjectTarget};

/// One fault, as a probe's descriptor receives it before the write: two 8-byte words, the
/// address and the value to be written there (the old value with every bit of [`FAULT_FLIP`]
/// flipped).
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
}

impl Injector {
    /// The faults `spec` asks of the filter at `site`.
    ///
    /// With a `probe` (a measurement of isolation), the filter makes one fault only: its
    /// [`FAULT_RECORD`] goes to the probe before the write, and if the write is not stopped
    /// the process ends at once with [`PROBE_EXIT`], so a process sharing the memory reads
    /// whether the protected state changed. A stopped write ends it with
    /// [`bulkhead_guard::VIOLATION_EXIT`], as always.
    pub fn new(site: &FilterSite, spec: InjectSpec, probe: Option<OwnedFd>) -> Injector {
        let who = format!("{} ({})", site.index + 1, site.name);
        let rng = Rng::new(spec.seed);
        let (site, own) = (site.clone(), space_of(site.index));
        let mut i = Injector { site, own, spec, rng, calls: 0, next_at: 0, who, probe: probe.map(std::fs::File::from) };
        i.schedule();
        i
    }

    fn schedule(&mut self) {
        self.next_at = self.calls + 1 + self.rng.next_u64() % self.spec.every;
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
        }
    }
}

/// A fault ready to strike: 8 bytes at `addr`, to become `value`.
struct Fault {
    addr: u64,
    value: u64,
}

impl Injector {
    /// Counts a call into the filter, and makes the fault if one is due.
    fn call(&mut self) {
        if let Some(f) = self.due() {
            self.strike(&f);
            self.landed(&f);
        }
    }

    fn due(&mut self) -> Option<Fault> {
        self.calls += 1;
        if self.calls < self.next_at {
            return None;
        }
        self.schedule();
        let addr = self.address(self.spec.target, self.own)?;
        // SAFETY: `addr` is a word-aligned address inside memory this process maps read-write
        // for as long as it runs (a ring, a heap space); reading it races with nothing, as the
        // domain is single-threaded.
        let old = unsafe { std::ptr::read_volatile(addr as *const u64) };
        let value = old ^ FAULT_FLIP;
        eprintln!(
            "bulkhead guard: injecting a fault from filter {}: 8 bytes at {addr:#x} ({})",
            self.who,
            self.spec.target.as_str()
        );
        if let Some(r) = &mut self.probe {
            let mut rec = [0u8; FAULT_RECORD];
            rec[..8].copy_from_slice(&addr.to_le_bytes());
            rec[8..].copy_from_slice(&value.to_le_bytes());
            if r.write_all(&rec).is_err() {
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
        // read-write (see `due`); under write capture it is stopped before it lands.
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
        // SAFETY: as in `due`.
        let now = unsafe { std::ptr::read_volatile(f.addr as *const u64) };
        if now == f.value {
            eprintln!("bulkhead guard: the injected write at {:#x} landed: not isolated", f.addr);
        }
    }
}

/// A filter's layer that makes its [`Injector`]'s faults: at each call, before the filter
/// itself runs, as its own code.
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
        self.injector.call();
        self.inner.submit(tag, req, scratch, now_ns)
    }

    fn complete(&mut self, tag: Tag, req: &Request<'_>, scratch: SharedSlice<'_>, result: &mut Outcome, now_ns: u64) -> After {
        self.injector.call();
        self.inner.complete(tag, req, scratch, result, now_ns)
    }

    fn poll(&mut self, now_ns: u64, release: &mut dyn FnMut(Tag, Verdict)) -> Option<u64> {
        self.injector.call();
        self.inner.poll(now_ns, release)
    }

    fn idle(&mut self) {
        self.injector.call();
        self.inner.idle()
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
