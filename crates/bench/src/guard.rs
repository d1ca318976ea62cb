//! `bulkhead-bench guard`: what write capture costs, per caught write, for each mechanism
//! (userfaultfd write protection raised as SIGBUS, `mprotect` and SIGSEGV) and each way of
//! letting a write through (DWC's single step, SCDWC's cache), beside a write nobody guards;
//! what the page gate's ranges cost to shut and open, in small pages and as one huge page;
//! and what gating a call with protection keys adds to its entry and exit. Run in this process, on this thread, over page-aligned memory of its own.

use crate::BenchError;
use std::time::Instant;

use bulkhead_guard::{Act, Guard, Mechanism, Mode, PAGE};

use crate::Table;

/// What to run.
#[derive(Debug, Clone)]
pub struct Options {
    /// Writes timed per measurement.
    pub writes: usize,
}

/// Pages written in turn.
const PAGES: usize = 64;
/// The fewest writes a measurement may time: one per page.
pub const PAGES_MIN: usize = PAGES;

/// One measurement.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Row {
    /// `userfaultfd` or `mprotect`.
    pub mechanism: String,
    /// What was timed.
    pub operation: String,
    /// Mean nanoseconds per write (or per page, for the pool).
    pub ns: f64,
    /// Writes caught while it ran.
    pub caught: u64,
}

/// The whole run.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Report {
    /// Writes timed per measurement.
    pub writes: usize,
    /// Pages written in turn.
    pub pages: usize,
    /// A write to memory nobody guards, ns.
    pub unguarded_ns: f64,
    /// Each mechanism's figures.
    pub rows: Vec<Row>,
}

/// Page-aligned memory of `PAGES` pages inside a vector of this process.
struct Pages {
    buf: Vec<u8>,
    start: usize,
}

impl Pages {
    fn new() -> Self {
        let buf = vec![0u8; (PAGES + 1) * PAGE as usize];
        let start = (buf.as_ptr() as usize).next_multiple_of(PAGE as usize) - buf.as_ptr() as usize;
        Pages { buf, start }
    }

    fn base(&self) -> u64 {
        self.buf[self.start..].as_ptr() as u64
    }

    fn write(&mut self, page: usize, v: u8) {
        self.buf[self.start + page * PAGE as usize + 64] = v;
        std::hint::black_box(&mut self.buf);
    }

    fn act(&self) -> Act {
        let mut a = Act::new();
        a.allow_slice(&self.buf[self.start..self.start + PAGES * PAGE as usize]).expect("one range");
        a
    }
}

fn per(t: Instant, n: usize) -> f64 {
    t.elapsed().as_nanos() as f64 / n as f64
}

/// Writes `n` times, page after page, inside one call into guarded code.
fn writes_in_a_call(g: &mut Guard, mem: &mut Pages, n: usize) -> Result<f64, BenchError> {
    let act = mem.act();
    g.enter(0, &act).map_err(|e| e.to_string())?;
    let t = Instant::now();
    for i in 0..n {
        mem.write(i % PAGES, i as u8);
    }
    let ns = per(t, n);
    g.exit();
    Ok(ns)
}

fn measure(mechanism: Mechanism, opts: &Options, progress: &mut impl FnMut(&str)) -> Result<Vec<Row>, BenchError> {
    let name = mechanism.as_str();
    let mut rows = Vec::new();
    let mut row = |operation: &str, ns: f64, caught: u64| {
        rows.push(Row { mechanism: name.into(), operation: operation.into(), ns, caught });
    };
    let install = |mode| Guard::install(mechanism, mode, None).map_err(|e| format!("{name}: {e}"));

    progress(&format!("{name}: DWC"));
    let mut mem = Pages::new();
    let mut g = install(Mode::Dwc)?;
    g.add_region(mem.base(), PAGES as u64 * PAGE, "bench").map_err(|e| e.to_string())?;
    let ns = writes_in_a_call(&mut g, &mut mem, opts.writes)?;
    row("dwc: caught write (fault, open, single step, protect)", ns, g.stats().allowed);
    drop(g);

    progress(&format!("{name}: SCDWC, C = 1"));
    let mut g = install(Mode::Scdwc { cache: 1 })?;
    g.add_region(mem.base(), PAGES as u64 * PAGE, "bench").map_err(|e| e.to_string())?;
    let ns = writes_in_a_call(&mut g, &mut mem, opts.writes)?;
    row("scdwc, cache miss: caught write (fault, open, protect the oldest)", ns, g.stats().allowed);
    drop(g);

    progress(&format!("{name}: SCDWC, C = {PAGES}"));
    let mut g = install(Mode::Scdwc { cache: PAGES })?;
    g.add_region(mem.base(), PAGES as u64 * PAGE, "bench").map_err(|e| e.to_string())?;
    writes_in_a_call(&mut g, &mut mem, PAGES)?;
    let before = g.stats().allowed;
    let ns = writes_in_a_call(&mut g, &mut mem, opts.writes)?;
    row("scdwc, cache hit: write to a page the cache holds open", ns, g.stats().allowed - before);
    drop(g);

    progress(&format!("{name}: SCDWC pool"));
    let mut g = install(Mode::Scdwc { cache: 1 })?;
    g.add_region(mem.base(), PAGES as u64 * PAGE, "bench").map_err(|e| e.to_string())?;
    let act = mem.act();
    g.call(0, &act, || ()).map_err(|e| e.to_string())?;
    let rounds = (opts.writes / PAGES).max(1);
    let (mut outside_ns, mut pool_ns) = (0.0, 0.0);
    for _ in 0..rounds {
        // The runtime writes every page between calls (each one caught once and let through);
        // the next call protects the PAGES - 1 the cache let go of.
        let t = Instant::now();
        for p in 0..PAGES {
            mem.write(p, p as u8);
        }
        outside_ns += per(t, PAGES);
        let t = Instant::now();
        g.enter(0, &act).map_err(|e| e.to_string())?;
        pool_ns += per(t, PAGES - 1);
        g.exit();
    }
    let s = g.stats();
    row("scdwc: the runtime's write between calls (fault, open)", outside_ns / rounds as f64, s.outside);
    row("scdwc: protecting one pooled page at the next call", pool_ns / rounds as f64, 0);
    Ok(rows)
}

/// What a call's entry and exit cost with and without protection keys gating it: an empty
/// call, `n` times, under SCDWC with no page to protect. The region the keys deny is an
/// anonymous mapping of its own, given a fresh key.
fn gate(opts: &Options) -> Result<Vec<Row>, BenchError> {
    let len = PAGES * PAGE as usize;
    // SAFETY: a new private anonymous mapping, unmapped below, used only through the guard.
    let p = unsafe {
        libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0)
    };
    if p == libc::MAP_FAILED {
        return Err(BenchError::Run(format!("mmap: {}", std::io::Error::last_os_error())));
    }
    let result = (|| -> Result<_, BenchError> {
        let mut g = Guard::install(Mechanism::Userfault, Mode::Scdwc { cache: PAGES }, None).map_err(|e| e.to_string())?;
        let region = g.add_region(p as u64, len as u64, "other").map_err(|e| e.to_string())?;
        let act = Act::new();
        let calls = |g: &mut Guard| -> Result<f64, BenchError> {
            g.call(0, &act, || ()).map_err(|e| e.to_string())?;
            let t = Instant::now();
            for _ in 0..opts.writes {
                g.call(0, &act, || ()).map_err(|e| e.to_string())?;
            }
            Ok(per(t, opts.writes))
        };
        let plain = calls(&mut g)?;
        let key = bulkhead_sys::pkey::alloc().map_err(|e| format!("pkey_alloc: {e}"))?;
        g.key_region(region, key).map_err(|e| e.to_string())?;
        // Filter 0's own key is one it never meets here: every keyed region is denied to it.
        let own = bulkhead_sys::pkey::alloc().map_err(|e| format!("pkey_alloc: {e}"))?;
        g.gate_keys(&[own]).map_err(|e| e.to_string())?;
        let before = g.stats().keyed;
        let keyed = calls(&mut g)?;
        let gated = g.stats().keyed - before;
        drop(g);
        if gated != opts.writes as u64 + 1 {
            return Err(format!("protection keys gated {gated} of {} calls", opts.writes + 1).into());
        }
        let _ = bulkhead_sys::pkey::free(key);
        let _ = bulkhead_sys::pkey::free(own);
        Ok(vec![
            Row {
                mechanism: "pkey".into(),
                operation: "a call's entry and exit, page protection only".into(),
                ns: plain,
                caught: 0,
            },
            Row {
                mechanism: "pkey".into(),
                operation: "a call's entry and exit, gated by keys (RDPKRU, two WRPKRU)".into(),
                ns: keyed,
                caught: 0,
            },
        ])
    })();
    // SAFETY: the mapping made above; the guard that used it is gone.
    unsafe { libc::munmap(p, len) };
    result
}

/// What the page gate's two system calls cost for one range: write-protecting and opening
/// `n` written pages of private memory registered with a userfaultfd, 1, 11 (a trace call's
/// heap range in small pages) and 33 (the most the kernel flushes a page at a time), and one
/// transparent huge page, where the kernel backs one (the runtime's heap of a domain whose
/// filters are all gated by pages). Nanoseconds per pair.
fn ranges(opts: &Options) -> Result<Vec<Row>, BenchError> {
    const HUGE: usize = bulkhead_guard::heap::HUGE_PAGE as usize;
    // Twice a huge page, so that one lies inside on its boundary.
    let len = 2 * HUGE;
    // SAFETY: a new private anonymous mapping, unmapped below, used only here.
    let p = unsafe {
        libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0)
    };
    if p == libc::MAP_FAILED {
        return Err(BenchError::Run(format!("mmap: {}", std::io::Error::last_os_error())));
    }
    let result = (|| -> Result<_, BenchError> {
        let at = (p as usize).next_multiple_of(HUGE);
        // SAFETY: advice on the mapping above, which changes how it is backed, not what it holds.
        unsafe { libc::madvise(at as *mut libc::c_void, HUGE, libc::MADV_HUGEPAGE) };
        // SAFETY: the huge page's worth of the mapping above, written only here.
        unsafe { std::ptr::write_bytes(at as *mut u8, 1, HUGE) };
        let huge = bulkhead_guard::heap::back_huge(at as u64);
        let small = at + HUGE;
        // SAFETY: as above.
        unsafe { libc::madvise(small as *mut libc::c_void, HUGE, libc::MADV_NOHUGEPAGE) };
        // SAFETY: the second huge page's worth of the mapping, written only here.
        unsafe { std::ptr::write_bytes(small as *mut u8, 1, 64 * PAGE as usize) };
        let trap = bulkhead_sys::uffd::WriteTrap::new().map_err(|e| format!("userfaultfd: {e}"))?;
        trap.register(at as u64, 2 * HUGE as u64).map_err(|e| format!("userfaultfd: {e}"))?;
        let pairs = |start: usize, bytes: usize| -> Result<f64, BenchError> {
            let t = Instant::now();
            for _ in 0..opts.writes {
                trap.protect(start as u64, bytes as u64).map_err(|e| format!("write-protect: {e}"))?;
                trap.open(start as u64, bytes as u64).map_err(|e| format!("open: {e}"))?;
            }
            Ok(per(t, opts.writes))
        };
        let mut rows = Vec::new();
        for n in [1, 11, 33] {
            let ns = pairs(small, n * PAGE as usize)?;
            rows.push(Row {
                mechanism: "userfaultfd".into(),
                operation: format!("page gate: shut and open {n} page{}", if n == 1 { "" } else { "s" }),
                ns,
                caught: 0,
            });
        }
        if huge {
            let ns = pairs(at, HUGE)?;
            rows.push(Row {
                mechanism: "userfaultfd".into(),
                operation: "page gate: shut and open a 2 MiB huge page".into(),
                ns,
                caught: 0,
            });
        }
        Ok(rows)
    })();
    // SAFETY: the mapping made above; the userfaultfd that registered it is closed.
    unsafe { libc::munmap(p, len) };
    result
}

/// Runs every measurement.
pub fn run(opts: &Options, mut progress: impl FnMut(&str)) -> Result<Report, BenchError> {
    let mut mem = Pages::new();
    let t = Instant::now();
    for i in 0..opts.writes {
        mem.write(i % PAGES, i as u8);
    }
    let unguarded_ns = per(t, opts.writes);
    let mut rows = Vec::new();
    for m in [Mechanism::Userfault, Mechanism::Mprotect] {
        rows.extend(measure(m, opts, &mut progress)?);
    }
    progress("page gate ranges");
    rows.extend(ranges(opts)?);
    if bulkhead_sys::pkey::supported() {
        progress("protection keys");
        rows.extend(gate(opts)?);
    }
    Ok(Report { writes: opts.writes, pages: PAGES, unguarded_ns, rows })
}

/// The report as a table.
pub fn render(r: &Report) -> String {
    let mut t = Table::new(&["mechanism", "operation", "ns", "caught"]);
    t.row(vec!["none".into(), "unguarded write".into(), format!("{:.1}", r.unguarded_ns), "0".into()]);
    for row in &r.rows {
        t.row(vec![row.mechanism.clone(), row.operation.clone(), format!("{:.0}", row.ns), row.caught.to_string()]);
    }
    format!("{} writes per measurement over {} pages\n{}", r.writes, r.pages, t.render())
}
