//! `bulkhead-bench surge`: the VPT case study's scheduler comparison. A SURGE-style workload
//! reads files on ext4 over a `vpt` device (`k` locked), once per scheduler, with `O_DIRECT`
//! and through the page cache, and the same workload runs through the simulator over the
//! files' real placement, the model as ground truth.
//!
//! The device is `bulkhead serve`'s FUSE export of a `ram` device under a `vpt` filter, with a
//! loop device (`--direct-io=on`) over it and ext4 on that. A bulkhead scheduler runs as a
//! `scheduler` filter inserted above the vpt (`bulkhead filter add`), the loop device's own
//! scheduler `none`; a kernel scheduler (`mq-deadline`, `bfq`) runs on the loop device with no
//! bulkhead scheduler, its dispatch limited to the fewest requests the kernel allows in flight
//! (4: `nr_requests` set under `none`, which shrinks the device's tags, before the scheduler is
//! chosen), so that requests queue where the scheduler can order them. The kernel's `none`
//! sends every request on at once, and the vpt serves them in arrival order.
//!
//! Per scheduler it reports the model's mean service time (the vpt's modelled busy time per
//! request), the mean response time of the loop device's requests (from its statistics: from
//! when a request entered the block layer until it completed), throughput in sectors per ms,
//! and the distribution of each page read's time as the reading process saw it.

use crate::BenchError;
use std::fs::File;
use std::io::Write;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use bulkhead_diskmodel::sched::{Policy, Tuning};
use bulkhead_diskmodel::sim;
use bulkhead_diskmodel::surge::{Catalogue, Extent, PageRead, Params, SurgeSim, PAGE};
use bulkhead_diskmodel::Drive;
use serde::Serialize;

use crate::fileio::{run, serve, which, Procs, Undo};

/// The kernel's schedulers measured, Jones' performance modeling paper's "dline" and "cfq" (bfq
/// replaced cfq) and none.
pub const KERNEL: [&str; 3] = ["mq-deadline", "bfq", "none"];
/// bulkhead's schedulers measured and simulated.
pub const BULKHEAD: [Policy; 3] = [Policy::Cats, Policy::Deadline, Policy::Fcfs];

/// A scheduler under test.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Column {
    /// A bulkhead `scheduler` filter above the vpt.
    Bulkhead {
        /// Its policy.
        policy: Policy,
    },
    /// The kernel's scheduler on the loop device.
    Kernel {
        /// Its name in `/sys/block/*/queue/scheduler`.
        name: String,
    },
}

impl Column {
    /// Its name in tables.
    pub fn label(&self) -> String {
        match self {
            Column::Bulkhead { policy } => policy.as_str().to_string(),
            Column::Kernel { name } => format!("kernel {name}"),
        }
    }

    /// From a name: a bulkhead policy, or a kernel scheduler.
    pub fn parse(s: &str) -> Result<Column, String> {
        if let Some(name) = KERNEL.iter().find(|k| **k == s) {
            return Ok(Column::Kernel { name: name.to_string() });
        }
        match Policy::parse(s) {
            Some(policy) => Ok(Column::Bulkhead { policy }),
            None => {
                Err(format!("unknown scheduler `{s}` (bulkhead: fcfs, satf, opt, deadline, cats; kernel: {})", KERNEL.join(", ")))
            }
        }
    }
}

/// How the files are read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// `O_DIRECT`: every page read goes to the device.
    Direct,
    /// Through the page cache, with the kernel's read-ahead.
    Cached,
}

impl Mode {
    /// Its name.
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Direct => "O_DIRECT",
            Mode::Cached => "non-O_DIRECT",
        }
    }
}

/// What to run.
#[derive(Debug, Clone)]
pub struct Options {
    /// The workload.
    pub params: Params,
    /// Schedulers, in order.
    pub columns: Vec<Column>,
    /// Modes, in order.
    pub modes: Vec<Mode>,
    /// bulkhead policies the simulator runs.
    pub sim: Vec<Policy>,
    /// The vpt's `k`, locked.
    pub k: f64,
    /// The device's size, bytes (the model's `D`).
    pub size: u64,
    /// The bulkhead scheduler's `depth`.
    pub depth: u32,
    /// The loop device's read-ahead, KiB.
    pub read_ahead_kb: u32,
    /// Scratch directory (a tmpfs).
    pub scratch: PathBuf,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            params: Params::default(),
            columns: BULKHEAD
                .iter()
                .map(|&policy| Column::Bulkhead { policy })
                .chain(KERNEL.iter().map(|n| Column::Kernel { name: n.to_string() }))
                .collect(),
            modes: vec![Mode::Direct, Mode::Cached],
            sim: BULKHEAD.to_vec(),
            k: 1.0,
            size: 4 << 30,
            depth: 1,
            read_ahead_kb: 128,
            scratch: PathBuf::from("/dev/shm"),
        }
    }
}

/// One scheduler's figures in one mode, measured or simulated.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    /// `measured` or `sim`.
    pub source: &'static str,
    /// The scheduler.
    pub label: String,
    /// The mode.
    pub mode: Mode,
    /// Page reads done.
    pub reads: u64,
    /// Requests the device served.
    pub requests: u64,
    /// Sectors they moved.
    pub sectors: u64,
    /// Requests the drive's cache served.
    pub hits: u64,
    /// Mean wait in a bulkhead scheduler's queue (measured) or the simulator's, ms; 0 for a
    /// kernel scheduler, whose queue bulkhead cannot see.
    pub mean_wait_ms: f64,
    /// Mean service time, ms of model time.
    pub mean_service_ms: f64,
    /// Mean response time of the device's requests, ms.
    pub mean_response_ms: f64,
    /// Sectors per ms.
    pub sectors_per_ms: f64,
    /// Mean time of a page read as the process saw it, ms.
    pub read_mean_ms: f64,
    /// Its median.
    pub read_p50_ms: f64,
    /// Its 99th percentile.
    pub read_p99_ms: f64,
    /// Measured only: the vpt's late fraction over the run.
    pub late_fraction: f64,
    /// Measured only: requests the device had in flight at most (the scheduler's dispatch
    /// limit for a kernel scheduler, the filter's `depth` for bulkhead's).
    pub device_depth: u32,
    /// Page-read times for the distribution plot: `(ms, fraction at or below)`.
    pub cdf: Vec<(f64, f64)>,
}

/// A scheduler that could not be measured.
#[derive(Debug, Clone, Serialize)]
pub struct Skipped {
    /// The scheduler and mode.
    pub what: String,
    /// Why.
    pub reason: String,
}

/// The whole run.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// The workload.
    pub params: Params,
    /// The vpt's `k`.
    pub k: f64,
    /// Device bytes.
    pub size: u64,
    /// Files and their bytes.
    pub files: u64,
    /// Bytes of all files.
    pub file_bytes: u64,
    /// Extents the files lie in.
    pub extents: u64,
    /// Rows, measured then simulated, per mode.
    pub rows: Vec<Row>,
    /// What was skipped.
    pub skipped: Vec<Skipped>,
    /// Stopped by SIGINT/SIGTERM.
    pub interrupted: bool,
}

/// Where a run is.
#[derive(Debug, Clone)]
pub struct Progress {
    /// What runs.
    pub what: String,
    /// Reads done of this part.
    pub done: u64,
    /// Reads in this part.
    pub total: u64,
}

/// The loop device's read statistics: requests, sectors, ms spent.
fn loop_reads(name: &str) -> Result<(u64, u64, u64), BenchError> {
    let s = std::fs::read_to_string(format!("/sys/block/{name}/stat")).map_err(|e| format!("{name} stat: {e}"))?;
    let v: Vec<u64> = s.split_whitespace().filter_map(|x| x.parse().ok()).collect();
    if v.len() < 4 {
        return Err(BenchError::Run(format!("{name} stat: `{}`", s.trim())));
    }
    Ok((v[0], v[2], v[3]))
}

fn sysfs_write(path: &str, value: &str) -> Result<(), BenchError> {
    std::fs::write(path, value).map_err(|e| BenchError::Run(format!("writing `{value}` to {path}: {e}")))
}

fn sysfs_read(path: &str) -> Result<String, BenchError> {
    std::fs::read_to_string(path).map(|s| s.trim().to_string()).map_err(|e| BenchError::Run(format!("{path}: {e}")))
}

/// The vpt's `(requests, model ms, late, cache hits)` and a bulkhead scheduler's mean wait in
/// its queue (ms, since it was inserted) from `bulkhead status --json`.
fn vpt_figures(exe: &Path, run_dir: &Path) -> Result<(u64, f64, u64, u64, f64), BenchError> {
    let out = run(&exe.display().to_string(), &["status", "--json", "--run-dir", &run_dir.display().to_string()])?;
    let v: serde_json::Value = serde_json::from_str(&out).map_err(|e| format!("status --json: {e}"))?;
    // Each filter's figures, flattened beside its `type`.
    let filters = v["devices"][0]["filters"].as_array().map(Vec::as_slice).unwrap_or_default();
    let of = |kind: &str| filters.iter().find(|f| f["type"] == kind);
    let vpt = of("vpt").ok_or_else(|| format!("status shows no vpt: {out}"))?;
    let n = |key: &str| vpt[key].as_u64().unwrap_or(0);
    let wait_ms = of("scheduler").map_or(0.0, |r| r["mean_wait_us"].as_u64().unwrap_or(0) as f64 / 1e3);
    Ok((n("requests"), vpt["model_ms"].as_f64().unwrap_or(0.0), n("late"), n("cache_hits"), wait_ms))
}

/// Where each block of a file lies, from `FS_IOC_FIEMAP`.
fn fiemap(file: &File) -> Result<Vec<Extent>, BenchError> {
    const FS_IOC_FIEMAP: libc::c_ulong = 0xC020_660B;
    const FIEMAP_FLAG_SYNC: u32 = 1;
    const FIEMAP_EXTENT_LAST: u32 = 1;
    const COUNT: usize = 64;
    #[repr(C)]
    #[derive(Clone, Copy, Default)]
    struct FiemapExtent {
        logical: u64,
        physical: u64,
        length: u64,
        reserved64: [u64; 2],
        flags: u32,
        reserved: [u32; 3],
    }
    #[repr(C)]
    struct Fiemap {
        start: u64,
        length: u64,
        flags: u32,
        mapped: u32,
        count: u32,
        reserved: u32,
        extents: [FiemapExtent; COUNT],
    }
    let mut out = Vec::new();
    let mut start = 0u64;
    loop {
        let mut m = Fiemap {
            start,
            length: u64::MAX - start,
            flags: FIEMAP_FLAG_SYNC,
            mapped: 0,
            count: COUNT as u32,
            reserved: 0,
            extents: [FiemapExtent::default(); COUNT],
        };
        // SAFETY: `m` is a `struct fiemap` followed by room for `count` extents, as the ioctl
        // expects; the kernel writes only within it.
        if unsafe { libc::ioctl(file.as_raw_fd(), FS_IOC_FIEMAP, &mut m as *mut Fiemap) } != 0 {
            return Err(BenchError::Run(format!("FIEMAP: {}", std::io::Error::last_os_error())));
        }
        let mapped = (m.mapped as usize).min(COUNT);
        for e in &m.extents[..mapped] {
            out.push(Extent { page: e.logical / PAGE, sector: e.physical / 512, pages: e.length.div_ceil(PAGE) });
        }
        match m.extents[..mapped].last() {
            Some(e) if e.flags & FIEMAP_EXTENT_LAST == 0 && mapped == COUNT => start = e.logical + e.length,
            _ => return Ok(out),
        }
    }
}

/// What the first bytes of each page hold: its file and page number, checked on every read.
fn page_tag(file: u32, page: u64) -> [u8; 16] {
    let mut tag = [0; 16];
    tag[..8].copy_from_slice(&(file as u64).to_le_bytes());
    tag[8..].copy_from_slice(&page.to_le_bytes());
    tag
}

fn file_path(mnt: &Path, f: u32) -> PathBuf {
    mnt.join(format!("d{:02}", f % 32)).join(format!("f{f}"))
}

/// Writes every file of `cat` under `mnt` and returns where each lies.
fn lay_out(mnt: &Path, cat: &Catalogue) -> Result<Vec<Vec<Extent>>, BenchError> {
    for d in 0..32 {
        std::fs::create_dir_all(mnt.join(format!("d{d:02}"))).map_err(|e| format!("mkdir: {e}"))?;
    }
    let mut page = vec![0u8; PAGE as usize];
    for (f, &pages) in cat.pages.iter().enumerate() {
        let path = file_path(mnt, f as u32);
        let mut file = File::create(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        for p in 0..pages {
            page[..16].copy_from_slice(&page_tag(f as u32, p));
            file.write_all(&page).map_err(|e| format!("{}: {e}", path.display()))?;
        }
    }
    run("sync", &[])?;
    (0..cat.pages.len() as u32)
        .map(|f| {
            let path = file_path(mnt, f);
            File::open(&path).map_err(|e| BenchError::io(&path, e)).and_then(|file| fiemap(&file))
        })
        .collect()
}

/// Drops the files' pages from the page cache, so each run starts cold.
fn drop_pages(mnt: &Path, files: usize) -> Result<(), BenchError> {
    for f in 0..files as u32 {
        let path = file_path(mnt, f);
        let file = File::open(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        // Advice only: a kernel that ignores it leaves the pages, and the run reads warmer.
        let _ = bulkhead_sys::drop_cached_pages(std::os::fd::AsFd::as_fd(&file));
    }
    Ok(())
}

/// Runs the workload's processes (as threads, each its own I/O context) against the files.
/// Returns each read and the run's wall time.
fn read_files(
    opts: &Options,
    cat: &Catalogue,
    mnt: &Path,
    mode: Mode,
    stop: &AtomicBool,
    progress: &mut dyn FnMut(u64),
) -> Result<(Vec<PageRead>, Duration), BenchError> {
    let p = &opts.params;
    let issued = AtomicU64::new(0);
    let done = AtomicU64::new(0);
    let failed: Mutex<Option<String>> = Mutex::new(None);
    let quit = AtomicBool::new(false);
    let started = Instant::now();
    let reads = std::thread::scope(|s| {
        let workers: Vec<_> = (0..p.processes)
            .map(|i| {
                let (issued, done, failed, quit) = (&issued, &done, &failed, &quit);
                s.spawn(move || {
                    let mut proc = p.process(i);
                    let mut buf = vec![0u8; 2 * PAGE as usize];
                    let skew = buf.as_ptr().align_offset(PAGE as usize);
                    let buf = &mut buf[skew..skew + PAGE as usize];
                    let mut open: Option<(u32, File)> = None;
                    let mut mine = Vec::new();
                    let fail = |why: String| {
                        *failed.lock().unwrap_or_else(|e| e.into_inner()) = Some(why);
                        quit.store(true, Ordering::Relaxed);
                    };
                    while !quit.load(Ordering::Relaxed) && issued.fetch_add(1, Ordering::Relaxed) < p.reads {
                        let step = proc.next(p, cat);
                        if open.as_ref().is_none_or(|(f, _)| *f != step.file) {
                            let path = file_path(mnt, step.file);
                            let mut o = std::fs::OpenOptions::new();
                            o.read(true);
                            if mode == Mode::Direct {
                                o.custom_flags(libc::O_DIRECT);
                            }
                            match o.open(&path) {
                                Ok(f) => open = Some((step.file, f)),
                                Err(e) => {
                                    fail(format!("{}: {e}", path.display()));
                                    break;
                                }
                            }
                        }
                        let file = &open.as_ref().expect("opened above").1;
                        let t0 = started.elapsed().as_nanos() as u64;
                        if let Err(e) = file.read_exact_at(buf, step.page * PAGE) {
                            fail(format!("reading page {} of {}: {e}", step.page, file_path(mnt, step.file).display()));
                            break;
                        }
                        let t1 = started.elapsed().as_nanos() as u64;
                        if buf[..16] != page_tag(step.file, step.page) {
                            fail(format!("page {} of file {} read back wrong", step.page, step.file));
                            break;
                        }
                        mine.push(PageRead { process: i, start_ns: t0, done_ns: t1 });
                        done.fetch_add(1, Ordering::Relaxed);
                        std::thread::sleep(Duration::from_nanos(proc.think_ns(p)));
                    }
                    mine
                })
            })
            .collect();
        while !workers.iter().all(|w| w.is_finished()) {
            if stop.load(Ordering::Relaxed) {
                quit.store(true, Ordering::Relaxed);
            }
            progress(done.load(Ordering::Relaxed));
            std::thread::sleep(Duration::from_millis(200));
        }
        workers.into_iter().flat_map(|w| w.join().unwrap_or_default()).collect::<Vec<_>>()
    });
    let wall = reads.iter().map(|r| r.done_ns).max().map(Duration::from_nanos).unwrap_or_default();
    match failed.into_inner().unwrap_or_else(|e| e.into_inner()) {
        Some(e) => Err(BenchError::from(e)),
        None => Ok((reads, wall)),
    }
}

/// `(mean, p50, p99)` of the reads' times, ms, and their distribution.
fn read_stats(reads: &[PageRead]) -> (f64, f64, f64, Vec<(f64, f64)>) {
    let mut t: Vec<f64> = reads.iter().map(|r| (r.done_ns - r.start_ns) as f64 / 1e6).collect();
    if t.is_empty() {
        return (0.0, 0.0, 0.0, Vec::new());
    }
    t.sort_by(f64::total_cmp);
    let n = t.len();
    let pct = |q: f64| t[((n as f64 * q).ceil() as usize).clamp(1, n) - 1];
    // 200 points of the distribution, evenly spaced in rank.
    let cdf = (1..=200).map(|i| i as f64 / 200.0).map(|q| (pct(q), q)).collect();
    (t.iter().sum::<f64>() / n as f64, pct(0.5), pct(0.99), cdf)
}

/// Sets the loop device's own tag depth (under the `none` scheduler, where `nr_requests` is
/// that depth). The kernel keeps a shrunken depth across scheduler changes while
/// `nr_requests` reads as the full one again, and takes writing the value it shows as nothing
/// to do: a different value goes first.
fn set_tag_depth(q: &str, depth: u32) -> Result<u32, BenchError> {
    let path = format!("{q}/nr_requests");
    let other = if depth > 4 { depth - 1 } else { depth + 1 };
    sysfs_write(&path, &other.to_string())?;
    sysfs_write(&path, &depth.to_string())?;
    sysfs_read(&path)?.parse().map_err(|e| BenchError::Run(format!("{path}: {e}")))
}

/// Puts `col` in place: the loop device's scheduler and depth, and bulkhead's filter.
fn set_column(col: &Column, exe: &Path, run_dir: &Path, lo: &str, opts: &Options, full_depth: u32) -> Result<u32, BenchError> {
    let q = format!("/sys/block/{lo}/queue");
    sysfs_write(&format!("{q}/scheduler"), "none")?;
    match col {
        Column::Bulkhead { policy } => {
            set_tag_depth(&q, full_depth)?;
            let rd = run_dir.display().to_string();
            let (policy, depth) = (format!("policy = \"{}\"", policy.as_str()), format!("depth = {}", opts.depth));
            run(
                &exe.display().to_string(),
                &["filter", "add", "disk0", "--at", "0", "--run-dir", &rd, "type = \"scheduler\"", &policy, &depth],
            )?;
            Ok(opts.depth)
        }
        Column::Kernel { name } => {
            // `none` sends every request on at once, and the vpt serves them in arrival order.
            if name == "none" {
                return set_tag_depth(&q, full_depth);
            }
            // The kernel raises 1 to its least; the scheduler chosen after keeps that depth for
            // dispatch.
            let depth = set_tag_depth(&q, 1)?;
            {
                let avail = sysfs_read(&format!("{q}/scheduler"))?;
                if !avail.split_whitespace().any(|s| s.trim_matches(['[', ']']) == name) {
                    return Err(BenchError::Run(format!("the kernel has no `{name}` scheduler (it offers: {avail})")));
                }
                sysfs_write(&format!("{q}/scheduler"), name)?;
            }
            Ok(depth)
        }
    }
}

fn unset_column(col: &Column, exe: &Path, run_dir: &Path) -> Result<(), BenchError> {
    if let Column::Bulkhead { .. } = col {
        run(&exe.display().to_string(), &["filter", "remove", "disk0", "0", "--run-dir", &run_dir.display().to_string()])?;
    }
    Ok(())
}

/// Why the benchmark cannot run here, if it cannot.
fn missing() -> Option<String> {
    if bulkhead_sys::euid() != 0 {
        return Some("bench surge needs root (loop devices, mount, FUSE)".into());
    }
    ["losetup", "mkfs.ext4", "mount", "umount", "sync"]
        .iter()
        .find(|t| !which(t))
        .map(|t| format!("bench surge needs `{t}` (util-linux, e2fsprogs)"))
}

/// Runs the simulator over the layout for every policy and mode.
pub fn simulate(opts: &Options, cat: &Catalogue, layout: &[Vec<Extent>]) -> Vec<Row> {
    let drive = Drive::seed(opts.size / 512);
    let mut rows = Vec::new();
    for &mode in &opts.modes {
        for &policy in &opts.sim {
            let ra = (mode == Mode::Cached).then_some((opts.read_ahead_kb as u64 * 1024 / PAGE).max(1));
            let mut w = SurgeSim::new(&opts.params, cat, layout, ra);
            let out = sim::run(&drive, 0, policy, Tuning::default(), &mut w, u64::MAX);
            let s = out.summary();
            let (read_mean_ms, read_p50_ms, read_p99_ms, cdf) = read_stats(w.reads());
            rows.push(Row {
                source: "sim",
                label: policy.as_str().to_string(),
                mode,
                reads: w.reads().len() as u64,
                requests: s.requests,
                sectors: out.served.iter().map(|r| r.sectors).sum(),
                hits: s.hits,
                mean_wait_ms: s.mean_wait_ms,
                mean_service_ms: s.mean_service_ms,
                mean_response_ms: s.mean_response_ms,
                sectors_per_ms: s.sectors_per_ms,
                read_mean_ms,
                read_p50_ms,
                read_p99_ms,
                late_fraction: 0.0,
                device_depth: 1,
                cdf,
            });
        }
    }
    rows
}

/// Runs the benchmark. `stop` ends it early; everything set up is torn down.
pub fn run_bench(
    exe: &Path,
    opts: &Options,
    stop: &AtomicBool,
    mut progress: impl FnMut(&Progress),
) -> Result<Report, BenchError> {
    if let Some(why) = missing() {
        return Err(BenchError::from(why));
    }
    let cat = opts.params.catalogue();
    if cat.bytes() > opts.size / 2 {
        return Err(BenchError::Run(format!(
            "the files take {} MiB: more than half the {} MiB device; give --size more or --files fewer",
            cat.bytes() >> 20,
            opts.size >> 20
        )));
    }
    let nonce = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
    let work = opts.scratch.join(format!("bh-surge-{}-{}", std::process::id(), nonce % 1_000_000));
    std::fs::create_dir_all(&work).map_err(|e| format!("{}: {e}", work.display()))?;
    struct RmDir(PathBuf);
    impl Drop for RmDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
    let _rm = RmDir(work.clone());
    let mut undo = Undo::default();
    let mut procs = Procs(Vec::new());

    progress(&Progress { what: "starting bulkhead serve with a vpt device".into(), done: 0, total: 0 });
    // A FUSE thread holds its device queue until its request is answered: a queue per thread
    // lets every outstanding request reach the scheduler, which can only order what it holds.
    let cfg = format!(
        "[nbd]\nenabled = false\n[fuse]\nthreads = 64\nio_uring = \"off\"\n\
         [[device]]\nname = \"disk0\"\nsize = \"{}\"\nnotify = \"irq\"\nqueues = 64\nqueue_depth = 4\narena = \"4M\"\n\
         [device.backend]\ntype = \"ram\"\n\
         [[device.filter]]\ntype = \"vpt\"\nk = {}\nlock_k = true\n",
        opts.size, opts.k
    );
    let disk = serve(exe, &work, &cfg, &mut procs)?;
    let run_dir = work.join("run");
    let lo_dev = run("losetup", &["--direct-io=on", "-f", "--show", &disk.display().to_string()])?.trim().to_string();
    undo.push("losetup", &["-d", &lo_dev]);
    let lo = lo_dev.trim_start_matches("/dev/").to_string();
    let q = format!("/sys/block/{lo}/queue");
    sysfs_write(&format!("{q}/scheduler"), "none")?;
    // The loop driver's tag set depth; a loop device used before may still have fewer tags.
    let full_depth: u32 =
        sysfs_read("/sys/module/loop/parameters/hw_queue_depth").ok().and_then(|d| d.parse().ok()).unwrap_or(128);
    let restore = format!("{full_depth}");
    undo.push(
        "sh",
        &[
            "-c",
            &format!("echo none > {q}/scheduler; echo {} > {q}/nr_requests; echo {restore} > {q}/nr_requests", full_depth - 1),
        ],
    );
    sysfs_write(&format!("{q}/read_ahead_kb"), &opts.read_ahead_kb.to_string())?;
    // The model is a spinning disk; a loop device over a file with no block device below
    // (FUSE) calls itself non-rotational, and the kernel's schedulers then behave as for flash
    // (bfq stops idling on a process's queue, for one).
    let rotational = sysfs_read(&format!("{q}/rotational"))?;
    undo.push("sh", &["-c", &format!("echo {rotational} > {q}/rotational")]);
    sysfs_write(&format!("{q}/rotational"), "1")?;
    progress(&Progress { what: format!("mkfs.ext4 on {lo_dev}"), done: 0, total: 0 });
    run("mkfs.ext4", &["-q", "-F", "-E", "lazy_itable_init=0,lazy_journal_init=0", &lo_dev])?;
    let mnt = work.join("mnt");
    std::fs::create_dir_all(&mnt).map_err(|e| e.to_string())?;
    run("mount", &["-o", "noatime", &lo_dev, &mnt.display().to_string()])?;
    undo.push("umount", &[&mnt.display().to_string()]);
    progress(&Progress { what: format!("writing {} files of {} MiB", cat.pages.len(), cat.bytes() >> 20), done: 0, total: 0 });
    let layout = lay_out(&mnt, &cat)?;

    let mut report = Report {
        params: opts.params.clone(),
        k: opts.k,
        size: opts.size,
        files: cat.pages.len() as u64,
        file_bytes: cat.bytes(),
        extents: layout.iter().map(|e| e.len() as u64).sum(),
        rows: Vec::new(),
        skipped: Vec::new(),
        interrupted: false,
    };
    'all: for &mode in &opts.modes {
        for col in &opts.columns {
            if stop.load(Ordering::Relaxed) {
                report.interrupted = true;
                break 'all;
            }
            let what = format!("{} {}", mode.as_str(), col.label());
            progress(&Progress { what: what.clone(), done: 0, total: opts.params.reads });
            let depth = match set_column(col, exe, &run_dir, &lo, opts, full_depth) {
                Ok(d) => d,
                Err(reason) => {
                    report.skipped.push(Skipped { what, reason: reason.to_string() });
                    continue;
                }
            };
            let measured = (|| -> Result<_, BenchError> {
                drop_pages(&mnt, cat.pages.len())?;
                run("sync", &[])?;
                let (n0, s0, t0) = loop_reads(&lo)?;
                let (v0, m0, l0, h0, _) = vpt_figures(exe, &run_dir)?;
                let (reads, wall) = read_files(opts, &cat, &mnt, mode, stop, &mut |done| {
                    progress(&Progress { what: what.clone(), done, total: opts.params.reads })
                })?;
                let (n1, s1, t1) = loop_reads(&lo)?;
                let (v1, m1, l1, h1, wait_ms) = vpt_figures(exe, &run_dir)?;
                Ok::<_, BenchError>((reads, wall, n1 - n0, s1 - s0, t1 - t0, v1 - v0, m1 - m0, l1 - l0, h1 - h0, wait_ms))
            })();
            let undone = unset_column(col, exe, &run_dir);
            let (reads, wall, requests, sectors, ticks_ms, timed, model_ms, late, hits, wait_ms) =
                match measured.and_then(|m| undone.map(|()| m)) {
                    Ok(m) => m,
                    Err(reason) => {
                        report.skipped.push(Skipped { what, reason: reason.to_string() });
                        continue;
                    }
                };
            let (read_mean_ms, read_p50_ms, read_p99_ms, cdf) = read_stats(&reads);
            report.rows.push(Row {
                source: "measured",
                label: col.label(),
                mode,
                reads: reads.len() as u64,
                requests,
                sectors,
                hits,
                mean_wait_ms: if let Column::Bulkhead { .. } = col { wait_ms } else { 0.0 },
                mean_service_ms: if timed > 0 { model_ms / timed as f64 } else { 0.0 },
                mean_response_ms: if requests > 0 { ticks_ms as f64 / requests as f64 } else { 0.0 },
                sectors_per_ms: sectors as f64 / (wall.as_secs_f64() * 1e3).max(1e-9),
                read_mean_ms,
                read_p50_ms,
                read_p99_ms,
                late_fraction: if timed > 0 { late as f64 / timed as f64 } else { 0.0 },
                device_depth: depth,
                cdf,
            });
        }
    }
    drop(undo);
    drop(procs);
    if !report.interrupted {
        progress(&Progress { what: "simulating".into(), done: 0, total: 0 });
        report.rows.extend(simulate(opts, &cat, &layout));
    }
    Ok(report)
}

impl Report {
    fn rows(&self, mode: Mode) -> Vec<&Row> {
        self.rows.iter().filter(|r| r.mode == mode).collect()
    }

    fn find(&self, source: &str, label: &str, mode: Mode) -> Option<&Row> {
        self.rows.iter().find(|r| r.source == source && r.label == label && r.mode == mode)
    }

    fn modes(&self) -> Vec<Mode> {
        let mut m: Vec<Mode> = Vec::new();
        for r in &self.rows {
            if !m.contains(&r.mode) {
                m.push(r.mode);
            }
        }
        m
    }

    /// The tables, as that paper prints them, one per mode; then the goals.
    pub fn render(&self) -> String {
        let p = &self.params;
        let mut s = format!(
            "SURGE: {} processes, {} files ({} MiB in {} extents) by Zipf, Pareto({}, {}) files a round, \
             Pareto({}, {} ms) think time; {} page reads; ext4 over a vpt of {} MiB, k = {} (locked)\n",
            p.processes,
            self.files,
            self.file_bytes >> 20,
            self.extents,
            p.count.alpha,
            p.count.k,
            p.think_ms.alpha,
            p.think_ms.k,
            p.reads,
            self.size >> 20,
            self.k
        );
        for mode in self.modes() {
            let rows = self.rows(mode);
            s.push_str(&format!("\n{} — service and response times in ms, throughput in sectors/ms\n", mode.as_str()));
            let head: Vec<String> =
                rows.iter().map(|r| if r.source == "sim" { format!("sim {}", r.label) } else { r.label.clone() }).collect();
            let mut t = crate::Table::new(&std::iter::once("").chain(head.iter().map(String::as_str)).collect::<Vec<_>>());
            let line = |name: &str, f: &dyn Fn(&Row) -> String| {
                std::iter::once(name.to_string()).chain(rows.iter().map(|r| f(r))).collect::<Vec<_>>()
            };
            t.row(line("Mean service", &|r| format!("{:.2}", r.mean_service_ms)));
            t.row(line("Mean response", &|r| format!("{:.2}", r.mean_response_ms)));
            t.row(line("Mean wait", &|r| {
                if r.source == "measured" && r.label.starts_with("kernel") {
                    "-".into()
                } else {
                    format!("{:.2}", r.mean_wait_ms)
                }
            }));
            t.row(line("Throughput", &|r| format!("{:.2}", r.sectors_per_ms)));
            t.row(line("Requests", &|r| r.requests.to_string()));
            t.row(line("Cache hits", &|r| r.hits.to_string()));
            t.row(line("Read mean", &|r| format!("{:.2}", r.read_mean_ms)));
            t.row(line("Read p50", &|r| format!("{:.2}", r.read_p50_ms)));
            t.row(line("Read p99", &|r| format!("{:.1}", r.read_p99_ms)));
            t.row(line("Late %", &|r| if r.source == "sim" { "-".into() } else { format!("{:.1}", r.late_fraction * 100.0) }));
            t.row(line("Depth", &|r| r.device_depth.to_string()));
            s.push_str(&t.render());
        }
        for k in &self.skipped {
            s.push_str(&format!("skipped {}: {}\n", k.what, k.reason));
        }
        s.push_str(&self.goals());
        s
    }

    /// That paper's order (CATS, then deadline, then bfq, by mean response) and whether the
    /// measured order of bulkhead's schedulers is the simulator's.
    pub fn goals(&self) -> String {
        let mut s = String::from("\nGoals (mean response time)\n");
        for mode in self.modes() {
            let m = |l: &str| self.find("measured", l, mode).map(|r| r.mean_response_ms);
            if let (Some(c), Some(d), Some(b)) = (m("cats"), m("deadline"), m("kernel bfq")) {
                let ok = c < d && d < b;
                s.push_str(&format!(
                    "  {} {}: cats {c:.2} < deadline {d:.2} < bfq {b:.2}\n",
                    if ok { "met " } else { "MISS" },
                    mode.as_str()
                ));
            }
            let order = |source: &str| {
                let mut v: Vec<&Row> = self
                    .rows
                    .iter()
                    .filter(|r| r.source == source && r.mode == mode && Policy::parse(&r.label).is_some())
                    .collect();
                v.sort_by(|a, b| a.mean_response_ms.total_cmp(&b.mean_response_ms));
                v.into_iter().map(|r| r.label.clone()).collect::<Vec<_>>()
            };
            let (measured, simulated) = (order("measured"), order("sim"));
            let simulated: Vec<String> = simulated.into_iter().filter(|l| measured.contains(l)).collect();
            if measured.len() >= 2 && measured.len() == simulated.len() {
                s.push_str(&format!(
                    "  {} {}: through the vpt {} ; simulated {}\n",
                    if measured == simulated { "met " } else { "MISS" },
                    mode.as_str(),
                    measured.join(" < "),
                    simulated.join(" < ")
                ));
            }
        }
        s
    }

    /// The page-read time distributions, one panel per mode, a line per scheduler (the
    /// simulated ones dashed), time on a log scale.
    pub fn svg(&self) -> String {
        let modes = self.modes();
        let (pw, ph, ml, mt) = (560.0, 320.0, 60.0, 30.0);
        let w = ml + pw + 180.0;
        let h = (mt + ph + 50.0) * modes.len().max(1) as f64;
        let mut s = format!(
            "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"11\">\n"
        );
        let colours = ["#1b9e77", "#d95f02", "#7570b3", "#e7298a", "#66a61e", "#e6ab02", "#a6761d", "#666666", "#1f78b4"];
        let (lo, hi) = (-3.0f64, 4.0f64); // 1 µs to 10 s
        for (mi, mode) in modes.iter().enumerate() {
            let y0 = mi as f64 * (mt + ph + 50.0) + mt;
            s.push_str(&format!(
                "<text x=\"{ml}\" y=\"{}\" font-size=\"13\">{} page reads: fraction done within a time</text>\n",
                y0 - 10.0,
                mode.as_str()
            ));
            s.push_str(&format!("<rect x=\"{ml}\" y=\"{y0}\" width=\"{pw}\" height=\"{ph}\" fill=\"none\" stroke=\"#999\"/>\n"));
            for e in lo as i32..=hi as i32 {
                let x = ml + (e as f64 - lo) / (hi - lo) * pw;
                let label = match e {
                    -3 => "1µs".to_string(),
                    -2 => "10µs".to_string(),
                    -1 => "0.1ms".to_string(),
                    0 => "1ms".to_string(),
                    1 => "10ms".to_string(),
                    2 => "100ms".to_string(),
                    3 => "1s".to_string(),
                    _ => "10s".to_string(),
                };
                s.push_str(&format!(
                    "<line x1=\"{x}\" y1=\"{y0}\" x2=\"{x}\" y2=\"{}\" stroke=\"#eee\"/><text x=\"{x}\" y=\"{}\" text-anchor=\"middle\">{label}</text>\n",
                    y0 + ph,
                    y0 + ph + 14.0
                ));
            }
            for q in [0.0, 0.5, 1.0] {
                let y = y0 + ph - q * ph;
                s.push_str(&format!("<text x=\"{}\" y=\"{}\" text-anchor=\"end\">{q}</text>\n", ml - 4.0, y + 4.0));
            }
            for (i, r) in self.rows(*mode).iter().enumerate() {
                let colour = colours[i % colours.len()];
                let pts: Vec<String> = r
                    .cdf
                    .iter()
                    .map(|&(ms, q)| {
                        let e = ms.max(1e-6).log10().clamp(lo, hi);
                        format!("{:.1},{:.1}", ml + (e - lo) / (hi - lo) * pw, y0 + ph - q * ph)
                    })
                    .collect();
                let dash = if r.source == "sim" { " stroke-dasharray=\"5,3\"" } else { "" };
                s.push_str(&format!(
                    "<polyline fill=\"none\" stroke=\"{colour}\" stroke-width=\"1.5\"{dash} points=\"{}\"/>\n",
                    pts.join(" ")
                ));
                let name = if r.source == "sim" { format!("sim {}", r.label) } else { r.label.clone() };
                s.push_str(&format!(
                    "<text x=\"{}\" y=\"{}\" fill=\"{colour}\">{name} ({:.1} ms)</text>\n",
                    ml + pw + 10.0,
                    y0 + 12.0 + i as f64 * 15.0,
                    r.read_mean_ms
                ));
            }
        }
        s.push_str("</svg>\n");
        s
    }
}

/// Writes `report.json`, `surge.svg` and `report.txt` into `dir`.
pub fn write_outputs(report: &Report, dir: &Path) -> Result<Vec<PathBuf>, BenchError> {
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let json = serde_json::to_string_pretty(report).map_err(|e| e.to_string())?;
    let mut out = Vec::new();
    for (name, text) in [("report.json", json), ("surge.svg", report.svg()), ("report.txt", report.render())] {
        let path = dir.join(name);
        std::fs::write(&path, text).map_err(|e| format!("{}: {e}", path.display()))?;
        out.push(path);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn packed(cat: &Catalogue) -> Vec<Vec<Extent>> {
        let mut sector = 4096;
        cat.pages
            .iter()
            .map(|&pages| {
                let e = Extent { page: 0, sector, pages };
                sector += pages * 8 + 64;
                vec![e]
            })
            .collect()
    }

    fn small() -> Options {
        let params = Params { processes: 16, files: 200, reads: 3000, ..Params::default() };
        Options { params, ..Options::default() }
    }

    #[test]
    fn columns_parse_from_bulkhead_policies_and_kernel_schedulers() {
        assert_eq!(Column::parse("cats"), Ok(Column::Bulkhead { policy: Policy::Cats }));
        assert_eq!(Column::parse("bfq"), Ok(Column::Kernel { name: "bfq".into() }));
        assert_eq!(Column::parse("none").map(|c| c.label()), Ok("kernel none".to_string()));
        assert!(Column::parse("cfq").unwrap_err().contains("unknown scheduler `cfq`"));
    }

    #[test]
    fn the_simulated_rows_cover_every_policy_and_mode_and_report_every_read() {
        let opts = small();
        let cat = opts.params.catalogue();
        let rows = simulate(&opts, &cat, &packed(&cat));
        assert_eq!(rows.len(), 6);
        for r in &rows {
            assert_eq!(r.reads, opts.params.reads, "{} {:?}", r.label, r.mode);
            assert!(r.mean_response_ms >= r.mean_service_ms && r.mean_service_ms > 0.0);
            assert_eq!(r.cdf.len(), 200);
            assert!(r.cdf.windows(2).all(|w| w[0].0 <= w[1].0));
        }
        let direct: Vec<_> = rows.iter().filter(|r| r.mode == Mode::Direct).collect();
        assert!(direct.iter().all(|r| r.requests == opts.params.reads));
        let report = Report {
            params: opts.params.clone(),
            k: 1.0,
            size: opts.size,
            files: 200,
            file_bytes: cat.bytes(),
            extents: 200,
            rows,
            skipped: vec![],
            interrupted: false,
        };
        let text = report.render();
        assert!(text.contains("sim cats") && text.contains("Mean response") && text.contains("non-O_DIRECT"));
        let svg = report.svg();
        assert_eq!(svg.matches("<polyline").count(), 6);
        assert_eq!(svg.matches("stroke-dasharray").count(), 6);
    }
}
