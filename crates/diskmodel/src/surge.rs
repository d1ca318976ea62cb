//! The SURGE-style workload of the VPT case study: processes that each draw a number of files
//! from a Pareto distribution, pick each file by its Zipf popularity, and read it page by page
//! with a Pareto-distributed think time after every page.
//!
//! The same [`Process`] drives both sides of the comparison: `bulkhead-bench surge` reads real
//! files on a filesystem with it, and [`SurgeSim`] feeds the simulator with it, over the
//! files' real placement on the device ([`Extent`]s). A process's draws depend on its seed and
//! index alone, so both sides read the same files in the same order with the same pauses.
//!
//! File sizes follow SURGE's hybrid distribution (Barford and Crovella, 1998): a lognormal
//! body (µ = 9.357, σ = 1.318, bytes) for 93% of files and a Pareto tail (α = 1.1, k = 133 KB)
//! for the rest, here rounded up to whole pages and capped.

use std::collections::HashMap;

use serde::Serialize;

use bulkhead_rng::Rng;

use crate::sim::{Arrival, Make, Workload};
use crate::Access;

/// Bytes in a page, the unit every read asks for.
pub const PAGE: u64 = 4096;
/// Sectors in a page.
pub const PAGE_SECTORS: u64 = PAGE / 512;

/// Pareto(α, k): `k / U^(1/α)`, at least `k`, mean `α·k/(α−1)` for `α > 1`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Pareto {
    /// Shape.
    pub alpha: f64,
    /// Scale (the smallest value).
    pub k: f64,
}

impl Pareto {
    /// One draw.
    pub fn sample(&self, rng: &mut Rng) -> f64 {
        // 1 − U lies in (0, 1]: never a division by zero.
        self.k / (1.0 - rng.unit()).powf(1.0 / self.alpha)
    }
}

/// Zipf's law over `n` ranks: rank `r` (from 0) with probability proportional to `1/(r+1)`.
#[derive(Debug, Clone)]
pub struct Zipf {
    cdf: Vec<f64>,
}

impl Zipf {
    /// Over `n` ranks (at least one).
    pub fn new(n: usize) -> Self {
        let mut cdf = Vec::with_capacity(n.max(1));
        let mut sum = 0.0;
        for r in 0..n.max(1) {
            sum += 1.0 / (r + 1) as f64;
            cdf.push(sum);
        }
        cdf.iter_mut().for_each(|c| *c /= sum);
        Zipf { cdf }
    }
    /// One rank.
    pub fn sample(&self, rng: &mut Rng) -> usize {
        let u = rng.unit();
        self.cdf.partition_point(|&c| c <= u).min(self.cdf.len() - 1)
    }
}

/// The workload's knobs.
#[derive(Debug, Clone, Serialize)]
pub struct Params {
    /// Processes reading at once.
    pub processes: u32,
    /// Files (the `L` of Zipf(L)).
    pub files: u32,
    /// Files each process reads before drawing again: Pareto(α1, k1), rounded down.
    pub count: Pareto,
    /// Think time after each page, ms: Pareto(α2, k2).
    pub think_ms: Pareto,
    /// Longest think time, ms (a Pareto tail with α ≤ 2 has no variance; one draw of minutes
    /// would idle a process for the rest of a run).
    pub max_think_ms: f64,
    /// Largest file, bytes.
    pub max_file_bytes: u64,
    /// Page reads in the run, all processes together.
    pub reads: u64,
    /// Seed of every draw.
    pub seed: u64,
}

impl Default for Params {
    /// 64 processes, 20,000 files, Pareto(2.43, 1) files per round (SURGE's embedded references),
    /// Pareto(1.5, 10 ms) think time (mean 30 ms) capped at 2 s, files of at most 2 MiB,
    /// 50,000 page reads.
    fn default() -> Self {
        Params {
            processes: 64,
            files: 20_000,
            count: Pareto { alpha: 2.43, k: 1.0 },
            think_ms: Pareto { alpha: 1.5, k: 10.0 },
            max_think_ms: 2000.0,
            max_file_bytes: 2 << 20,
            reads: 50_000,
            seed: 1,
        }
    }
}

impl Params {
    /// Each file's size in pages (at least one), and the files in order of popularity.
    pub fn catalogue(&self) -> Catalogue {
        let mut rng = Rng::new(self.seed ^ 0x5eed_f11e);
        let max_pages = (self.max_file_bytes / PAGE).max(1);
        let pages = (0..self.files.max(1))
            .map(|_| {
                let bytes = if rng.unit() < 0.93 {
                    // Box–Muller: a standard normal from two uniforms.
                    let (u1, u2) = (1.0 - rng.unit(), rng.unit());
                    let z = (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos();
                    (9.357 + 1.318 * z).exp()
                } else {
                    Pareto { alpha: 1.1, k: 133_000.0 }.sample(&mut rng)
                };
                ((bytes / PAGE as f64).ceil() as u64).clamp(1, max_pages)
            })
            .collect::<Vec<_>>();
        // Popularity is independent of size: a random order of the files.
        let mut by_rank: Vec<u32> = (0..pages.len() as u32).collect();
        for i in (1..by_rank.len()).rev() {
            let j = rng.below(i as u64 + 1) as usize;
            by_rank.swap(i, j);
        }
        Catalogue { zipf: Zipf::new(pages.len()), pages, by_rank }
    }

    /// Process `index`'s own generator.
    pub fn process(&self, index: u32) -> Process {
        Process {
            rng: Rng::new(self.seed.wrapping_add((index as u64 + 1).wrapping_mul(0xa076_1d64_78bd_642f))),
            files_left: 0,
            file: 0,
            page: 0,
            pages: 0,
        }
    }

    fn think_ns(&self, rng: &mut Rng) -> u64 {
        (self.think_ms.sample(rng).min(self.max_think_ms) * 1e6) as u64
    }
}

/// The files: their sizes and their popularity.
#[derive(Debug, Clone)]
pub struct Catalogue {
    /// Pages of each file.
    pub pages: Vec<u64>,
    /// File of each popularity rank, most popular first.
    pub by_rank: Vec<u32>,
    zipf: Zipf,
}

impl Catalogue {
    /// Bytes of all files together.
    pub fn bytes(&self) -> u64 {
        self.pages.iter().sum::<u64>() * PAGE
    }
}

/// One page a process reads next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Step {
    /// The file.
    pub file: u32,
    /// The page in it.
    pub page: u64,
}

/// One process of the workload: which page it reads next and how long it thinks after.
#[derive(Debug, Clone)]
pub struct Process {
    rng: Rng,
    files_left: u64,
    file: u32,
    page: u64,
    pages: u64,
}

impl Process {
    /// The page to read next.
    pub fn next(&mut self, params: &Params, cat: &Catalogue) -> Step {
        if self.page >= self.pages {
            if self.files_left == 0 {
                self.files_left = (params.count.sample(&mut self.rng) as u64).max(1);
            }
            self.files_left -= 1;
            self.file = cat.by_rank[cat.zipf.sample(&mut self.rng)];
            self.page = 0;
            self.pages = cat.pages[self.file as usize];
        }
        self.page += 1;
        Step { file: self.file, page: self.page - 1 }
    }

    /// The think time after a page, ns.
    pub fn think_ns(&mut self, params: &Params) -> u64 {
        params.think_ns(&mut self.rng)
    }
}

/// A run of a file's pages that lie together on the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Extent {
    /// First page of the file it holds.
    pub page: u64,
    /// Its first sector on the device.
    pub sector: u64,
    /// Pages.
    pub pages: u64,
}

/// Where a page of a file lies, and how many pages from it on lie contiguously in its extent.
fn locate(extents: &[Extent], page: u64) -> Option<(u64, u64)> {
    let e = extents.iter().find(|e| page >= e.page && page < e.page + e.pages)?;
    Some((e.sector + (page - e.page) * PAGE_SECTORS, e.page + e.pages - page))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Slot {
    /// Being read by the request this process made.
    Reading(u32),
    Cached,
}

/// The request a process has outstanding, and who waits for it.
#[derive(Debug, Clone, Default)]
struct Outstanding {
    file: u32,
    first: u64,
    pages: u64,
    waiters: Vec<u32>,
}

/// Each read of the workload as the application saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct PageRead {
    /// The process.
    pub process: u32,
    /// When it asked, ns.
    pub start_ns: u64,
    /// When it had the page, ns.
    pub done_ns: u64,
}

/// The workload for the simulator: `O_DIRECT` (every page read is a request of one page), or
/// through a page cache with read-ahead, as a filesystem reads without `O_DIRECT`.
///
/// The page cache holds every page once read (the files fit in memory). A read that misses
/// reads ahead: the first miss in a file reads 4 pages, each further miss in the same pass four
/// times (then twice) as many, up to `read_ahead_pages`, within the file's extent, as Linux's
/// read-ahead grows its window. Linux also reads the next window before it is needed
/// (asynchronous read-ahead); this model does not, so it waits on more misses than the kernel
/// does.
#[derive(Debug)]
pub struct SurgeSim<'a> {
    params: &'a Params,
    cat: &'a Catalogue,
    layout: &'a [Vec<Extent>],
    procs: Vec<Process>,
    left: u64,
    /// `None`: `O_DIRECT`.
    cache: Option<HashMap<(u32, u64), Slot>>,
    read_ahead_pages: u64,
    window: Vec<u64>,
    want: Vec<(Step, u64)>,
    outstanding: Vec<Option<Outstanding>>,
    reads: Vec<PageRead>,
}

impl<'a> SurgeSim<'a> {
    /// The workload over files placed as `layout` says (one list of extents per file of
    /// `cat`); `read_ahead_pages` `None` reads with `O_DIRECT`.
    pub fn new(params: &'a Params, cat: &'a Catalogue, layout: &'a [Vec<Extent>], read_ahead_pages: Option<u64>) -> Self {
        let n = params.processes as usize;
        SurgeSim {
            params,
            cat,
            layout,
            procs: (0..params.processes).map(|i| params.process(i)).collect(),
            left: params.reads,
            cache: read_ahead_pages.map(|_| HashMap::new()),
            read_ahead_pages: read_ahead_pages.unwrap_or(1).max(1),
            window: vec![0; n],
            want: vec![(Step { file: 0, page: 0 }, 0); n],
            outstanding: vec![None; n],
            reads: Vec::new(),
        }
    }

    /// Every page read, in the order they finished.
    pub fn reads(&self) -> &[PageRead] {
        &self.reads
    }

    /// Process `p` asks for its next page at `now`.
    fn begin(&mut self, p: u32, now: u64, out: &mut Make) {
        if self.left == 0 {
            return;
        }
        self.left -= 1;
        let step = self.procs[p as usize].next(self.params, self.cat);
        self.want[p as usize] = (step, now);
        let extents = &self.layout[step.file as usize];
        // A page outside every extent (a layout that lost it) costs nothing: it reads as a hole.
        let Some((sector, contiguous)) = locate(extents, step.page) else {
            return self.finish(p, now, out);
        };
        let Some(cache) = self.cache.as_mut() else {
            self.outstanding[p as usize] = Some(Outstanding { file: step.file, first: step.page, pages: 1, waiters: vec![p] });
            out.arrivals.push(Arrival {
                at_ns: now,
                access: Access { start: sector, sectors: PAGE_SECTORS, write: false },
                stream: p,
            });
            return;
        };
        match cache.get(&(step.file, step.page)) {
            Some(Slot::Cached) => self.finish(p, now, out),
            Some(Slot::Reading(by)) => {
                let by = *by as usize;
                self.outstanding[by].as_mut().expect("a page being read has its request").waiters.push(p);
            }
            None => {
                let w = &mut self.window[p as usize];
                let max = self.read_ahead_pages;
                *w = if step.page == 0 || *w == 0 {
                    4.min(max)
                } else if *w < max / 16 {
                    (*w * 4).min(max)
                } else {
                    (*w * 2).min(max)
                };
                let left_in_file = self.cat.pages[step.file as usize] - step.page;
                let mut pages = (*w).min(left_in_file).min(contiguous);
                // Stop before a page already cached or being read.
                for i in 1..pages {
                    if cache.contains_key(&(step.file, step.page + i)) {
                        pages = i;
                        break;
                    }
                }
                for i in 0..pages {
                    cache.insert((step.file, step.page + i), Slot::Reading(p));
                }
                self.outstanding[p as usize] = Some(Outstanding { file: step.file, first: step.page, pages, waiters: vec![p] });
                out.arrivals.push(Arrival {
                    at_ns: now,
                    access: Access { start: sector, sectors: pages * PAGE_SECTORS, write: false },
                    stream: p,
                });
            }
        }
    }

    /// Process `p` has its page at `now`: it thinks, then reads on.
    fn finish(&mut self, p: u32, now: u64, out: &mut Make) {
        let start_ns = self.want[p as usize].1;
        self.reads.push(PageRead { process: p, start_ns, done_ns: now });
        let think = self.procs[p as usize].think_ns(self.params);
        out.wakes.push((now + think, p));
    }
}

impl Workload for SurgeSim<'_> {
    fn start(&mut self, out: &mut Make) {
        for p in 0..self.params.processes {
            self.begin(p, 0, out);
        }
    }
    fn completed(&mut self, _: u64, stream: u32, now_ns: u64, out: &mut Make) {
        let Some(o) = self.outstanding.get_mut(stream as usize).and_then(Option::take) else { return };
        if let Some(cache) = self.cache.as_mut() {
            for i in 0..o.pages {
                cache.insert((o.file, o.first + i), Slot::Cached);
            }
        }
        for w in o.waiters {
            self.finish(w, now_ns, out);
        }
    }
    fn woken(&mut self, stream: u32, now_ns: u64, out: &mut Make) {
        self.begin(stream, now_ns, out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sched::{Policy, Tuning};
    use crate::sim;
    use crate::Drive;

    fn small() -> Params {
        Params { processes: 8, files: 50, reads: 2000, max_file_bytes: 64 << 10, ..Params::default() }
    }

    /// Each file in one extent, one after another from sector 2048.
    fn packed(cat: &Catalogue) -> Vec<Vec<Extent>> {
        let mut sector = 2048;
        cat.pages
            .iter()
            .map(|&pages| {
                let e = Extent { page: 0, sector, pages };
                sector += pages * PAGE_SECTORS;
                vec![e]
            })
            .collect()
    }

    #[test]
    fn pareto_draws_are_at_least_k_and_have_the_mean_alpha_k_over_alpha_minus_one() {
        let p = Pareto { alpha: 2.5, k: 3.0 };
        let mut rng = Rng::new(7);
        let v: Vec<f64> = (0..200_000).map(|_| p.sample(&mut rng)).collect();
        assert!(v.iter().all(|&x| x >= 3.0));
        let mean = v.iter().sum::<f64>() / v.len() as f64;
        assert!((mean - 5.0).abs() < 0.1, "mean {mean}, expected 5");
    }

    #[test]
    fn zipf_rank_r_comes_about_r_plus_one_times_less_often_than_the_first() {
        let z = Zipf::new(100);
        let mut rng = Rng::new(3);
        let mut n = [0u32; 100];
        for _ in 0..500_000 {
            n[z.sample(&mut rng)] += 1;
        }
        for r in [1, 3, 9] {
            let ratio = n[0] as f64 / n[r] as f64;
            assert!((ratio / (r + 1) as f64 - 1.0).abs() < 0.1, "rank {r}: ratio {ratio}");
        }
    }

    #[test]
    fn a_process_reads_whole_files_page_by_page_and_two_runs_agree() {
        let params = small();
        let cat = params.catalogue();
        let (mut a, mut b) = (params.process(5), params.process(5));
        let mut expect_page = 0;
        let mut file = None;
        for _ in 0..5000 {
            let s = a.next(&params, &cat);
            assert_eq!(s, b.next(&params, &cat));
            assert_eq!(a.think_ns(&params), b.think_ns(&params));
            if s.page == 0 {
                if let Some(f) = file {
                    assert_eq!(expect_page, cat.pages[f as usize], "file {f} read to its end before the next");
                }
                file = Some(s.file);
            }
            assert_eq!(Some(s.file), file);
            assert_eq!(s.page, if s.page == 0 { 0 } else { expect_page });
            expect_page = s.page + 1;
        }
        let seq = |i| {
            let mut p = params.process(i);
            (0..200).map(|_| p.next(&params, &cat)).collect::<Vec<_>>()
        };
        assert_ne!(seq(5), seq(6), "processes draw independently");
    }

    #[test]
    fn file_sizes_follow_surge_within_the_cap() {
        let params = Params { files: 20_000, ..Params::default() };
        let cat = params.catalogue();
        let max = params.max_file_bytes / PAGE;
        assert!(cat.pages.iter().all(|&p| (1..=max).contains(&p)));
        let mut bytes: Vec<u64> = cat.pages.iter().map(|p| p * PAGE).collect();
        bytes.sort_unstable();
        // The lognormal body's median is e^9.357 ≈ 11.6 KB: three pages once rounded up.
        let median = bytes[bytes.len() / 2];
        assert!((8192..=16384).contains(&median), "median {median}");
        // 7% in the tail, (133 KB / 2 MiB)^1.1 ≈ 5% of those above the cap: about 67 files.
        assert!(cat.pages.iter().filter(|&&p| p == max).count() > 30, "the tail reaches the cap");
    }

    #[test]
    fn with_o_direct_every_page_read_is_one_request_of_one_page_at_the_page() {
        let params = small();
        let cat = params.catalogue();
        let layout = packed(&cat);
        let mut w = SurgeSim::new(&params, &cat, &layout, None);
        let out = sim::run(&Drive::seed(1 << 21), 0, Policy::Fcfs, Tuning::default(), &mut w, u64::MAX);
        assert_eq!(out.served.len() as u64, params.reads);
        assert_eq!(w.reads().len() as u64, params.reads);
        assert!(out.served.iter().all(|r| r.sectors == PAGE_SECTORS && !r.write && r.start >= 2048));
        // A process waits for its read and then thinks at least k2: its next read comes later.
        for p in 0..params.processes {
            let mine: Vec<_> = out.served.iter().filter(|r| r.stream == p).collect();
            for pair in mine.windows(2) {
                assert!(pair[1].arrival_ns >= pair[0].done_ns + (params.think_ms.k * 1e6) as u64);
            }
        }
    }

    #[test]
    fn through_the_page_cache_pages_are_read_once_ahead_of_need_and_the_rest_are_hits() {
        let params = small();
        let cat = params.catalogue();
        let layout = packed(&cat);
        let mut w = SurgeSim::new(&params, &cat, &layout, Some(32));
        let out = sim::run(&Drive::seed(1 << 21), 0, Policy::Cats, Tuning::default(), &mut w, u64::MAX);
        assert_eq!(w.reads().len() as u64, params.reads);
        // No page is read from the device twice.
        let mut seen = std::collections::HashSet::new();
        for r in &out.served {
            assert!(r.sectors >= PAGE_SECTORS && r.sectors <= 32 * PAGE_SECTORS);
            for s in (r.start..r.start + r.sectors).step_by(PAGE_SECTORS as usize) {
                assert!(seen.insert(s), "sector {s} read twice");
            }
        }
        // Popular files are read again from memory: far fewer requests than reads.
        assert!((out.served.len() as u64) < params.reads / 4, "{} requests", out.served.len());
        let hits = w.reads().iter().filter(|r| r.done_ns == r.start_ns).count();
        assert!(hits as u64 > params.reads / 2);
    }
}
