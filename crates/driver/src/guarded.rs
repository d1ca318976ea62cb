//! Filters under write capture (`guard = "dwc" | "scdwc"`), and faults injected into them
//! (`guard_inject`).
//!
//! Every filter of a guarded domain allocates from a heap space of its own
//! ([`bulkhead_guard::heap`]); the runtime keeps space 0. [`Guarded`] wraps a filter's layer:
//! each call into it selects its space and, while guarded code runs, write-protects what it may
//! not write. Its table ([`Act`]) holds its own space, its scratch memory for the tag, the
//! buffers of the request it was handed, and the result it may change. The guard protects the
//! runtime's heap, the other filters' spaces and the queues' descriptor rings ([`install`]).
//!
//! Not guarded: memory the kernel fills for the backend (the read arena, the layers' scratch),
//! which a protected page would make fail with EFAULT, and the write arena, which the domain
//! maps read-only anyway. `open` runs unguarded, before the guard starts, as the filter reads
//! its metadata through the runtime then.

use std::io::Write;
use std::os::fd::OwnedFd;

use bulkhead_block::{After, BlockError, Caps, Layer, ReadBelow, Request, SharedSlice, Tag, TagSpace, Verdict};
use bulkhead_filters::{FilterFds, FilterSpec, GuardMode, GuardSpec, InjectSpec, InjectTarget};
use bulkhead_guard::heap::{self, Space};
use bulkhead_guard::{Act, Guard, Handle, Mechanism, Mode};

/// The guard's mode for a filter's `guard` setting, `None` for off.
pub fn mode_of(g: GuardMode) -> Option<Mode> {
    match g {
        GuardMode::Off => None,
        GuardMode::Dwc => Some(Mode::Dwc),
        GuardMode::Scdwc { cache } => Some(Mode::Scdwc { cache: cache as usize }),
    }
}

/// The heap space of the `index`-th filter of a guarded domain.
pub fn space_of(index: usize) -> Space {
    Space(index as u8 + 1)
}

/// Gives each heap space a protection key, for [`install`] to gate guarded calls with. Where
/// the processor or the kernel has none, says so on standard error: the filters are then
/// guarded by page protection alone.
pub fn assign_keys() {
    if let Err(e) = heap::assign_keys() {
        eprintln!("bulkhead guard: no protection keys ({e}); guarded filters rely on page protection alone");
    }
}

/// Installs write capture for the calling thread of a domain whose filters (`names`, in
/// chain order, each with whether it wants protection keys) have spaces of their own: the
/// runtime's heap, each filter's space and each queue's ring are guarded regions; a stopped
/// write is reported as a line on standard error
/// before the domain exits with [`bulkhead_guard::VIOLATION_EXIT`], and as a binary
/// [`bulkhead_guard::Violation`] on `report`, if given.
pub fn install(rings: &[(u64, u64)], names: &[(String, bool)], report: Option<i32>) -> std::io::Result<Guard> {
    let mut g = Guard::install(Mechanism::Userfault, Mode::Scdwc { cache: 0 }, report)?;
    g.report_text(2);
    g.add_heap_space(heap::RUNTIME, "the runtime's heap")?;
    for (i, (n, _)) in names.iter().enumerate() {
        g.add_heap_space(space_of(i), &format!("filter {} ({n})", i + 1))?;
        g.name_filter(i as u32, &format!("{} ({n})", i + 1));
    }
    let mut ring_regions = Vec::with_capacity(rings.len());
    for (i, &(start, len)) in rings.iter().enumerate() {
        ring_regions.push(g.add_region(start, len, &format!("the ring of queue {i}"))?);
    }
    // With keys (`assign_keys`), the rings are the runtime's too, and each filter that wants
    // keys may write only its own space's key while it runs.
    if let Some(runtime) = heap::key_of(heap::RUNTIME) {
        for r in ring_regions {
            g.key_region(r, runtime)?;
        }
        let own: Vec<u32> = names
            .iter()
            .enumerate()
            .map(|(i, (_, keys))| if *keys { heap::key_of(space_of(i)).unwrap_or(0) } else { 0 })
            .collect();
        g.gate_keys(&own)?;
    }
    Ok(g)
}

/// One filter of a domain, ready to build: what it is, its descriptors, and how it is guarded.
pub struct FilterParts {
    /// What it is.
    pub spec: FilterSpec,
    /// Its state page, output and secret.
    pub fds: FilterFds,
    /// Write capture and fault injection for it.
    pub guard: GuardSpec,
}

/// Builds a domain's filters, frontend side first, over queues whose rings lie at `rings`.
///
/// When any filter is guarded or has faults injected, the heap must be active with a space
/// for the runtime and one per filter ([`heap::activate`]): each filter is built in its own
/// space and wrapped in [`Guarded`], and write capture is installed on the calling thread for
/// the rest of the process's life (a stopped write ends the process). `probe` goes to the
/// first filter that injects faults (see [`Guarded::new`]).
pub fn build_filters(
    filters: Vec<FilterParts>,
    rings: &[(u64, u64)],
    mut probe: Option<OwnedFd>,
) -> Result<Vec<Box<dyn Layer>>, String> {
    let guarded = filters.iter().any(|f| f.guard.wanted());
    if guarded && heap::space_range(space_of(filters.len().saturating_sub(1))).is_none() {
        return Err(format!("write capture: the heap has no space for each of {} filters", filters.len()));
    }
    let names: Vec<(String, bool)> = filters.iter().map(|f| (f.spec.type_name().to_string(), f.guard.keys)).collect();
    let mut layers: Vec<Box<dyn Layer>> = Vec::with_capacity(filters.len());
    let n = filters.len();
    for (i, f) in filters.into_iter().enumerate() {
        let FilterParts { spec, fds, guard } = f;
        let make = || bulkhead_filters::build(&spec, fds);
        let layer = if guarded { heap::with_space(space_of(i), make) } else { make() }.map_err(|e| e.to_string())?;
        if !guarded {
            layers.push(layer);
            continue;
        }
        let others = (0..n).filter(|&j| j != i).map(space_of).collect();
        let targets = Targets { rings: rings.to_vec(), others };
        let probe = if guard.inject.is_some() { probe.take() } else { None };
        layers.push(Box::new(Guarded::new(layer, i, guard, targets, probe)));
    }
    if guarded {
        let guard = install(rings, &names, None).map_err(|e| format!("write capture: {e}"))?;
        // The guard lives as long as the process; a stopped write ends it.
        std::mem::forget(guard);
    }
    Ok(layers)
}

/// Where injected faults may write, other than the filter's own memory.
#[derive(Debug, Clone, Default)]
pub struct Targets {
    /// The queues' rings, as (start, bytes).
    pub rings: Vec<(u64, u64)>,
    /// The other filters' spaces.
    pub others: Vec<Space>,
}

/// One injected fault, as a probe's descriptor receives it before the write: two 8-byte
/// words, the address and the value to be written there (the old value with every bit of
/// [`FAULT_FLIP`] flipped).
pub const FAULT_RECORD: usize = 16;

/// What an injected fault flips in the word it writes: the old value is the written one with
/// these bits flipped back, so whoever checks the memory can tell "unchanged" from "written"
/// from "changed by something else".
pub const FAULT_FLIP: u64 = 0xA5A5_A5A5_5A5A_5A5A;

/// The exit status of a probed process whose injected write was not stopped: it ends right
/// after the write, so the memory holds what the write left (see [`Guarded::new`]).
pub const PROBE_EXIT: i32 = 87;

struct Injector {
    spec: InjectSpec,
    rng: u64,
    calls: u64,
    next_at: u64,
    targets: Targets,
    /// The filter's number and type, for reports.
    who: String,
    /// A measurement's descriptor: one fault only, recorded here (see [`Guarded::new`]); the
    /// process ends with it, stopped or not.
    probe: Option<std::fs::File>,
}

/// A fault ready to strike: 8 bytes at `addr`, to become `value`.
struct Fault {
    addr: u64,
    value: u64,
}

impl Injector {
    fn next(&mut self) -> u64 {
        // xorshift64*.
        self.rng ^= self.rng >> 12;
        self.rng ^= self.rng << 25;
        self.rng ^= self.rng >> 27;
        self.rng.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn schedule(&mut self) {
        self.next_at = self.calls + 1 + self.next() % self.spec.every;
    }

    /// A word-aligned address in `len` bytes from `start`.
    fn pick(&mut self, start: u64, len: u64) -> Option<u64> {
        (len >= 8).then(|| start + (self.next() % (len / 8)) * 8)
    }

    fn in_space(&mut self, s: Space) -> Option<u64> {
        let (start, _) = heap::space_range(s)?;
        let used = heap::extent(s).load(std::sync::atomic::Ordering::Relaxed);
        self.pick(start, used)
    }

    fn address(&mut self, target: InjectTarget, own: Space) -> Option<u64> {
        match target {
            InjectTarget::Ring => {
                let n = self.targets.rings.len();
                let k = self.next() as usize % n.max(1);
                let (start, len) = *self.targets.rings.get(k)?;
                self.pick(start, len)
            }
            InjectTarget::Heap => self.in_space(heap::RUNTIME),
            InjectTarget::Filter => {
                let n = self.targets.others.len();
                let k = self.next() as usize % n.max(1);
                let s = *self.targets.others.get(k)?;
                self.in_space(s)
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
                let t = choices[self.next() as usize % choices.len()];
                self.address(t, own).or_else(|| self.address(InjectTarget::Heap, own))
            }
        }
    }

    /// Counts a call; the fault to strike in it, if one is due.
    fn due(&mut self, own: Space) -> Option<Fault> {
        self.calls += 1;
        if self.calls < self.next_at {
            return None;
        }
        self.schedule();
        let addr = self.address(self.spec.target, own)?;
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

    /// After a write that was not stopped: says so, read from the memory itself; a probe
    /// ends the process here, leaving the memory as the write left it.
    fn landed(&mut self, f: &Fault) {
        if self.probe.is_some() {
            std::process::exit(PROBE_EXIT);
        }
        // SAFETY: as in `due`.
        let now = unsafe { std::ptr::read_volatile(f.addr as *const u64) };
        if now == f.value {
            eprintln!("bulkhead guard: the injected write at {:#x} landed: not isolated", f.addr);
        }
    }
}

impl Fault {
    /// The write, made as the filter's own.
    fn strike(&self) {
        // SAFETY: deliberately a write the filter must not make, into memory this process maps
        // read-write (see `Injector::due`); under write capture it is stopped before it lands.
        unsafe { std::ptr::write_volatile(self.addr as *mut u64, self.value) };
    }
}

/// A filter's layer under write capture, fault injection, or both. See the module's
/// documentation.
pub struct Guarded {
    inner: Box<dyn Layer>,
    id: u32,
    space: Space,
    mode: Option<Mode>,
    handle: Handle,
    injector: Option<Injector>,
}

impl Guarded {
    /// Wraps `inner`, the filter at `index` in the chain, whose state was allocated in its
    /// space ([`space_of`]).
    ///
    /// With a `probe` (a measurement of isolation), the filter injects one fault only: its
    /// [`FAULT_RECORD`] goes to the probe before the write, and if the write is not stopped
    /// the process ends at once with [`PROBE_EXIT`], so a process sharing the memory reads
    /// whether the protected state changed. A stopped write ends it with
    /// [`bulkhead_guard::VIOLATION_EXIT`], as always.
    pub fn new(inner: Box<dyn Layer>, index: usize, guard: GuardSpec, targets: Targets, probe: Option<OwnedFd>) -> Guarded {
        let injector = guard.inject.map(|spec| {
            let mut i = Injector {
                spec,
                rng: spec.seed.max(1),
                calls: 0,
                next_at: 0,
                targets,
                who: format!("{} ({})", index + 1, inner.name()),
                probe: probe.map(std::fs::File::from),
            };
            i.schedule();
            i
        });
        Guarded { inner, id: index as u32, space: space_of(index), mode: mode_of(guard.mode), handle: Handle::new(), injector }
    }

    fn own(&self) -> (u64, u64) {
        heap::space_range(self.space).unwrap_or((0, 0))
    }

    /// The table for one call.
    fn act(&self, req: Option<&Request<'_>>, scratch: &SharedSlice<'_>, result: Option<(u64, u64)>) -> Act {
        let mut act = Act::new();
        let (start, len) = self.own();
        let _ = act.allow(start, len);
        let _ = act.allow(scratch.as_ptr() as u64, scratch.len() as u64);
        if let Some((at, n)) = result {
            let _ = act.allow(at, n);
        }
        if let Some(Request::Read { into: bufs, .. } | Request::Write { from: bufs, .. }) = req {
            for b in bufs.iter() {
                if act.allow(b.as_ptr() as u64, b.len() as u64).is_err() {
                    break;
                }
            }
        }
        act
    }

    /// Runs `f` on the filter as guarded code allowed `act`, in its space, with a fault struck
    /// first if one is due.
    fn run<R>(&mut self, act: Act, f: impl FnOnce(&mut dyn Layer, bool) -> R) -> R {
        let space = self.space;
        heap::with_space(space, || {
            let fault = self.injector.as_mut().and_then(|i| i.due(space));
            let entered = match self.mode {
                Some(m) => self.handle.enter(self.id, &act, m).is_ok(),
                None => false,
            };
            if let Some(f) = &fault {
                f.strike();
            }
            if let (Some(f), Some(i)) = (&fault, self.injector.as_mut()) {
                if entered {
                    self.handle.exit();
                }
                i.landed(f);
                if entered {
                    let _ = self.handle.enter(self.id, &act, self.mode.unwrap_or(Mode::Dwc));
                }
            }
            let r = f(&mut *self.inner, entered);
            if entered {
                self.handle.exit();
            }
            r
        })
    }
}

impl Layer for Guarded {
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

    fn open(&mut self, below: &mut dyn ReadBelow) -> Result<(), String> {
        let inner = &mut self.inner;
        heap::with_space(self.space, || inner.open(below))
    }

    fn attach(&mut self, tags: TagSpace) {
        let inner = &mut self.inner;
        heap::with_space(self.space, || inner.attach(tags));
    }

    fn submit(&mut self, tag: Tag, req: &Request<'_>, scratch: SharedSlice<'_>, now_ns: u64) -> Verdict {
        let act = self.act(Some(req), &scratch, None);
        self.run(act, |l, _| l.submit(tag, req, scratch, now_ns))
    }

    fn complete(
        &mut self,
        tag: Tag,
        req: &Request<'_>,
        scratch: SharedSlice<'_>,
        result: &mut Result<u64, BlockError>,
        now_ns: u64,
    ) -> After {
        let at = (result as *mut Result<u64, BlockError> as u64, std::mem::size_of_val(result) as u64);
        let act = self.act(Some(req), &scratch, Some(at));
        self.run(act, |l, _| l.complete(tag, req, scratch, result, now_ns))
    }

    fn poll(&mut self, now_ns: u64, release: &mut dyn FnMut(Tag, Verdict)) -> Option<u64> {
        let act = self.act(None, &SharedSlice::empty(), None);
        let (handle, id, mode) = (self.handle, self.id, self.mode);
        self.run(act, |l, entered| {
            // What the filter releases goes to the runtime's own code, which runs unguarded.
            let mut release = |tag: Tag, v: Verdict| {
                if entered {
                    handle.exit();
                }
                release(tag, v);
                if let (true, Some(m)) = (entered, mode) {
                    let _ = handle.enter(id, &act, m);
                }
            };
            l.poll(now_ns, &mut release)
        })
    }

    fn idle(&mut self) {
        let act = self.act(None, &SharedSlice::empty(), None);
        self.run(act, |l, _| l.idle());
    }
}
