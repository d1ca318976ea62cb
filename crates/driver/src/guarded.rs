//! Filters under write capture (`guard = "dwc" | "scdwc"`).
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

use bulkhead_block::{After, Caps, Layer, ReadBelow, Request, SharedSlice, Tag, TagSpace, Verdict};
use bulkhead_block::{Outcome, SetupError};
use bulkhead_filters::{FilterFds, FilterSpec, GuardMode, GuardSpec};
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

/// Makes every allocation of this process come from `r`'s heap spaces from now on: the
/// runtime's first, then one for each filter of `guards` (chain order; `r` has
/// `1 + guards.len()` spaces), so that each filter's state lies in pages of its own.
///
/// Where every guarded filter is gated by pages alone, the runtime's space is asked for huge
/// pages ([`heap::prefer_huge`]; [`install`] then shuts and opens it a huge page at a time).
/// Where a guarded filter wants protection keys, each space is given one
/// ([`heap::assign_keys`]); where there are none, says so on standard error, and the filters
/// are guarded by page protection alone. Call before any thread starts (a thread started
/// earlier could not touch a keyed space) and before anything the domain keeps is allocated.
pub fn prepare_heap(r: heap::Reservation, guards: &[GuardSpec]) -> Result<(), String> {
    heap::activate(r).map_err(|e| format!("write capture: heap: {e}"))?;
    if guards.iter().all(|g| g.leaves_runtime_to_the_gate()) {
        heap::prefer_huge(heap::RUNTIME);
    }
    if guards.iter().any(|g| g.keys && g.wanted()) {
        if let Err(e) = heap::assign_keys() {
            eprintln!("bulkhead guard: no protection keys ({e}); guarded filters rely on page protection alone");
        }
    }
    Ok(())
}

/// How one filter of a guarded domain wants its calls gated, for [`install`].
#[derive(Debug, Clone)]
pub struct Gates {
    /// The filter's type, for reports.
    pub name: String,
    /// By protection keys, where the processor has them (`guard_keys`).
    pub keys: bool,
    /// By page protection, where keys do not gate it (`guard_pages`).
    pub pages: bool,
    /// Whether it is guarded at all (`guard` is not `off`).
    pub guarded: bool,
}

/// Installs write capture for the calling thread of a domain whose filters (`names`, in
/// chain order, each with how it wants its calls gated) have spaces of their own: the
/// runtime's heap, each filter's space and each queue's ring are guarded regions; a stopped
/// write is reported as a line on standard error
/// before the domain exits with [`bulkhead_guard::VIOLATION_EXIT`], and as a binary
/// [`bulkhead_guard::Violation`] on `report`, if given.
pub fn install(rings: &[(u64, u64)], names: &[Gates], report: Option<i32>) -> std::io::Result<Guard> {
    let mut g = Guard::install(Mechanism::Userfault, Mode::Scdwc { cache: 0 }, report)?;
    g.report_text(2);
    let runtime = g.add_heap_space(heap::RUNTIME, "the runtime's heap")?;
    // Right away: a page of it protected alone would split a huge page.
    if heap::is_huge(heap::RUNTIME) && g.huge_region(runtime)? {
        eprintln!(
            "bulkhead guard: every guarded filter is gated by pages: the runtime's heap is shut and opened 2 MiB at a time"
        );
    }
    for (i, f) in names.iter().enumerate() {
        let region = g.add_heap_space(space_of(i), &format!("filter {} ({})", i + 1, f.name))?;
        g.own_region(region, i as u32)?;
        g.name_filter(i as u32, &format!("{} ({})", i + 1, f.name));
    }
    g.gate_pages(&names.iter().map(|f| f.pages).collect::<Vec<_>>())?;
    // Under the page gate a ring is shut and opened whole, writable at once after each turn
    // (`Guard::add_shared_region`). Plain SCDWC would then hold a whole ring open for one page
    // of its cache, so a domain with a guarded filter its page gate leaves out guards the
    // rings page by page.
    let whole = names.iter().all(|f| !f.guarded || f.pages);
    let mut ring_regions = Vec::with_capacity(rings.len());
    for (i, &(start, len)) in rings.iter().enumerate() {
        let name = format!("the ring of queue {i}");
        let r = if whole { g.add_shared_region(start, len, &name)? } else { g.add_region(start, len, &name)? };
        // The runtime writes a ring only after a turn of the chain (`Domain::serve_queue`) and
        // before it sleeps, and says so first: what the page gate shuts of it stays shut from
        // a request's submission to its completion.
        g.defer_reopen(r)?;
        ring_regions.push(r);
    }
    // With keys (`prepare_heap`), the rings are the runtime's too, and each filter that wants
    // keys may write only its own space's key while it runs.
    if let Some(runtime) = heap::key_of(heap::RUNTIME) {
        for r in ring_regions {
            g.key_region(r, runtime)?;
        }
        let own: Vec<u32> =
            names.iter().enumerate().map(|(i, f)| if f.keys { heap::key_of(space_of(i)).unwrap_or(0) } else { 0 }).collect();
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
    /// Write capture for it.
    pub guard: GuardSpec,
}

/// Builds a domain's filters, frontend side first, over queues whose rings lie at `rings`.
///
/// When any filter is guarded, the heap must be active with a space for the runtime and one
/// per filter ([`heap::activate`]): each filter is built in its own space and wrapped in
/// [`Guarded`], and write capture is installed on the calling thread for the rest of the
/// process's life (a stopped write ends the process).
pub fn build_filters(filters: Vec<FilterParts>, rings: &[(u64, u64)]) -> Result<Vec<Box<dyn Layer>>, String> {
    build_layers(filters, rings, None)
}

/// Where a filter lies in its domain, for a [`Wrap`].
#[derive(Debug, Clone)]
pub struct FilterSite {
    /// Its place in the chain, from 0 at the frontend side (its heap space is
    /// [`space_of`] this).
    pub index: usize,
    /// Its type.
    pub name: &'static str,
    /// How many filters the domain has.
    pub filters: usize,
    /// The queues' descriptor rings, as (start, bytes).
    pub rings: Vec<(u64, u64)>,
}

/// Wraps a filter's layer (or hands it back as it is) before write capture wraps it.
pub type Wrap<'a> = &'a dyn Fn(&FilterSite, Box<dyn Layer>) -> Box<dyn Layer>;

/// As [`build_filters`], with each filter's layer handed to `wrap` first, in the filter's heap
/// space: what the wrapper does runs as the filter's own code, under its write capture. Some
/// filter must be guarded. The test kit's faults on purpose are made this way.
pub fn build_filters_wrapping(
    filters: Vec<FilterParts>,
    rings: &[(u64, u64)],
    wrap: Wrap<'_>,
) -> Result<Vec<Box<dyn Layer>>, String> {
    if !filters.iter().any(|f| f.guard.wanted()) {
        return Err("filters are wrapped only under write capture, and none is guarded".into());
    }
    build_layers(filters, rings, Some(wrap))
}

/// Builds the filters. If any is guarded, each is built in its heap space (and handed to
/// `wrap`, if given) and wrapped in [`Guarded`], and write capture is installed.
fn build_layers(filters: Vec<FilterParts>, rings: &[(u64, u64)], wrap: Option<Wrap<'_>>) -> Result<Vec<Box<dyn Layer>>, String> {
    let guarded = filters.iter().any(|f| f.guard.wanted());
    if guarded && heap::space_range(space_of(filters.len().saturating_sub(1))).is_none() {
        return Err(format!("write capture: the heap has no space for each of {} filters", filters.len()));
    }
    let names: Vec<Gates> = filters
        .iter()
        .map(|f| Gates {
            name: f.spec.type_name().to_string(),
            keys: f.guard.keys,
            pages: f.guard.pages,
            guarded: f.guard.wanted(),
        })
        .collect();
    let n = filters.len();
    let mut layers: Vec<Box<dyn Layer>> = Vec::with_capacity(n);
    for (i, f) in filters.into_iter().enumerate() {
        let FilterParts { spec, fds, guard } = f;
        if !guarded {
            layers.push(bulkhead_filters::build(&spec, fds).map_err(|e| e.to_string())?);
            continue;
        }
        let layer = heap::with_space(space_of(i), || {
            let layer = bulkhead_filters::build(&spec, fds)?;
            Ok::<_, bulkhead_filters::FilterError>(match wrap {
                Some(w) => w(&FilterSite { index: i, name: layer.name(), filters: n, rings: rings.to_vec() }, layer),
                None => layer,
            })
        })
        .map_err(|e| e.to_string())?;
        layers.push(Box::new(Guarded::new(layer, i, guard.mode)));
    }
    if guarded {
        let guard = install(rings, &names, None).map_err(|e| format!("write capture: {e}"))?;
        // The guard lives as long as the process; a stopped write ends it.
        std::mem::forget(guard);
    }
    Ok(layers)
}

/// A filter's layer under write capture. See the module's documentation.
pub struct Guarded {
    inner: Box<dyn Layer>,
    id: u32,
    space: Space,
    mode: Option<Mode>,
    handle: Handle,
}

impl Guarded {
    /// Wraps `inner`, the filter at `index` in the chain, whose state was allocated in its
    /// space ([`space_of`]), guarded as `mode` says.
    pub fn new(inner: Box<dyn Layer>, index: usize, mode: GuardMode) -> Guarded {
        Guarded { inner, id: index as u32, space: space_of(index), mode: mode_of(mode), handle: Handle::new() }
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

    /// Runs `f` on the filter as guarded code allowed `act`, in its space.
    fn run<R>(&mut self, act: Act, f: impl FnOnce(&mut dyn Layer, bool) -> R) -> R {
        heap::with_space(self.space, || {
            let entered = match self.mode {
                Some(m) => self.handle.enter(self.id, &act, m).is_ok(),
                None => false,
            };
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

    fn open(&mut self, below: &mut dyn ReadBelow) -> Result<(), SetupError> {
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

    fn complete(&mut self, tag: Tag, req: &Request<'_>, scratch: SharedSlice<'_>, result: &mut Outcome, now_ns: u64) -> After {
        // The filter changes a copy on this stack, not the runtime's own, which lies in the
        // runtime's heap: a table reaching into it would open one of its pages alone.
        let mut copy = result.clone();
        let at = (&mut copy as *mut Outcome as u64, std::mem::size_of_val(&copy) as u64);
        let act = self.act(Some(req), &scratch, Some(at));
        let after = self.run(act, |l, _| l.complete(tag, req, scratch, &mut copy, now_ns));
        *result = copy;
        after
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

    fn idle_wanted(&self) -> bool {
        // A read of the filter's own state: nothing for write capture to catch.
        self.inner.idle_wanted()
    }

    fn idle(&mut self) {
        let act = self.act(None, &SharedSlice::empty(), None);
        self.run(act, |l, _| l.idle());
    }
}
