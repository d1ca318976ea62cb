//! `bulkhead-bench tap`: what the block tap costs (figure 4 of Warfield et al., "Facilitating the
//! Development of Soft Devices", redone).
//!
//! One `ram` device, with no filter, with a `trace` filter in the driver domain (`passthrough`) and
//! with the same filter in a tap domain of its own (`interpose`), each measured through the client
//! library and through the FUSE export: sequential writes then reads of the whole device in 1 MiB
//! requests (after an untimed pass that fills the ramdisk), and the latency of synchronous 4 KiB
//! reads one at a time. For the reader's comparison, nbdkit's memory plugin through nbdfuse, bare
//! and with its `log` and `delay` filters (no delay), on the same FUSE measurements.

use crate::BenchError;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bulkhead_client::Device;
use bulkhead_config::Config;
use bulkhead_supervisor::Supervisor;
use serde::Serialize;

use crate::{Aligned, Table};

/// Options.
#[derive(Debug, Clone)]
pub struct Options {
    /// Notification mode of the bulkhead devices.
    pub mode: String,
    /// Bytes written and read sequentially (the device's size).
    pub bytes: u64,
    /// Synchronous small reads timed.
    pub requests: usize,
    /// Where trace files and mount points go (a tmpfs).
    pub scratch: PathBuf,
    /// Also measure nbdkit (when installed).
    pub nbdkit: bool,
}

/// One system through one path.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    /// `none`, `passthrough`, `interpose`, `nbdkit`, `nbdkit+log`, `nbdkit+delay`.
    pub system: String,
    /// `client` (the Rust library) or `fuse`.
    pub path: String,
    /// Sequential write, MiB/s.
    pub write_mibs: f64,
    /// Sequential read, MiB/s.
    pub read_mibs: f64,
    /// 4 KiB synchronous read latency: mean, median, 99th percentile, µs.
    pub lat_mean_us: f64,
    /// Median.
    pub lat_p50_us: f64,
    /// 99th percentile.
    pub lat_p99_us: f64,
    /// CPU seconds per 100k of the synchronous 4 KiB reads, by process. bulkhead: `load` is
    /// the reading thread, `serve` the rest of this process (the supervisor and the FUSE
    /// export's threads), `domain` the driver and tap domains. nbdkit: `server` is nbdfuse
    /// and nbdkit, `load` the reading thread.
    pub cpu_per_100k: crate::CpuPer100k,
}

/// Where a system's CPU goes: this process's reading thread, the rest of this process, and
/// the processes that serve.
struct CpuOf {
    /// Whether this process serves (bulkhead's supervisor and FUSE export run in it).
    in_process: bool,
    /// The processes that serve, with their descendants.
    servers: Vec<u32>,
}

impl CpuOf {
    /// (this process less the calling thread, the servers, the calling thread), seconds.
    fn sample(&self) -> (f64, f64, f64) {
        let thread = crate::thread_cpu_seconds();
        let process = if self.in_process { crate::process_cpu_seconds() - thread } else { 0.0 };
        let servers = crate::fileio::tree_jiffies(&self.servers) as f64 / bulkhead_sys::clock_ticks_per_second() as f64;
        (process, servers, thread)
    }

    /// CPU per 100k of `n` requests between two samples.
    fn per_100k(&self, a: (f64, f64, f64), b: (f64, f64, f64), n: usize) -> crate::CpuPer100k {
        let per = |c: f64| vec![c / (n.max(1) as f64 / 100_000.0)];
        let (serve, servers, load) = ((b.0 - a.0).max(0.0), b.1 - a.1, b.2 - a.2);
        if self.in_process {
            crate::CpuPer100k { server: per(serve + servers), serve: per(serve), domain: per(servers), load: per(load) }
        } else {
            crate::CpuPer100k { server: per(servers), load: per(load), ..Default::default() }
        }
    }
}

/// A goal of the issue, checked against this run.
#[derive(Debug, Clone, Serialize)]
pub struct Goal {
    /// What is compared.
    pub what: String,
    /// Measured value.
    pub measured: f64,
    /// The bound.
    pub bound: String,
    /// Whether it holds.
    pub met: bool,
}

/// The whole run.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// Notification mode.
    pub mode: String,
    /// Bytes per sequential phase.
    pub bytes: u64,
    /// Latency samples per row.
    pub requests: usize,
    /// Results.
    pub rows: Vec<Row>,
    /// Goals.
    pub goals: Vec<Goal>,
    /// Systems skipped, and why.
    pub skipped: Vec<String>,
}

/// The bulkhead systems, as (name, tap mode, with the trace filter).
const SYSTEMS: [(&str, &str, bool); 3] =
    [("none", "passthrough", false), ("passthrough", "passthrough", true), ("interpose", "interpose", true)];

const CHUNK: usize = 1 << 20;
const SMALL: usize = 4096;

fn pct(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    sorted[((sorted.len() as f64 * q).ceil() as usize).clamp(1, sorted.len()) - 1]
}

/// Small-read latencies, µs: mean, median, p99.
fn summarize(mut lat: Vec<f64>) -> (f64, f64, f64) {
    lat.sort_by(|a, b| a.total_cmp(b));
    let mean = lat.iter().sum::<f64>() / lat.len().max(1) as f64;
    (mean, pct(&lat, 0.5), pct(&lat, 0.99))
}

/// Offsets of the small reads: spread over the device, deterministic.
fn offsets(n: usize, size: u64) -> impl Iterator<Item = u64> {
    small_offsets(n, size, 0x2545_f491_4f6c_dd1d)
}

/// `n` 4 KiB-aligned offsets inside `size`, drawn from `seed`: the same `seed`, the same
/// offsets.
pub(crate) fn small_offsets(n: usize, size: u64, seed: u64) -> impl Iterator<Item = u64> {
    let blocks = size / SMALL as u64;
    crate::random(seed).take(n).map(move |x| (x % blocks) * SMALL as u64)
}

fn mibs(bytes: u64, d: Duration) -> f64 {
    bytes as f64 / (1u64 << 20) as f64 / d.as_secs_f64()
}

/// Through the client library, from one thread.
fn client_row(system: &str, dev: &Device, opts: &Options, cpu: &CpuOf) -> Result<Row, BenchError> {
    let e = |e: bulkhead_client::IoError| format!("{system}: {e}");
    let mut buf = vec![0u8; CHUNK];
    for (i, b) in buf.iter_mut().enumerate() {
        *b = (i * 7 % 251) as u8;
    }
    // A first, untimed pass: a fresh ramdisk's first writes are page faults, not the path.
    for off in (0..opts.bytes).step_by(CHUNK) {
        dev.write(0, off, &buf, false).map_err(e)?;
    }
    let t = Instant::now();
    for off in (0..opts.bytes).step_by(CHUNK) {
        dev.write(0, off, &buf, false).map_err(e)?;
    }
    dev.flush(0).map_err(e)?;
    let write_mibs = mibs(opts.bytes, t.elapsed());
    let t = Instant::now();
    for off in (0..opts.bytes).step_by(CHUNK) {
        dev.read_into(0, off, &mut buf).map_err(e)?;
    }
    let read_mibs = mibs(opts.bytes, t.elapsed());
    let mut small = vec![0u8; SMALL];
    for off in offsets(1000, opts.bytes) {
        dev.read_into(0, off, &mut small).map_err(e)?;
    }
    let seq = (write_mibs, read_mibs);
    timed_small_reads(system, "client", seq, opts, cpu, |off| {
        dev.read_into(0, off, &mut small).map(drop).map_err(|x| e(x).into())
    })
}

/// The row of one system through one path: its sequential figures, then `opts.requests`
/// synchronous 4 KiB reads by `read`, each timed, and the CPU they cost.
fn timed_small_reads(
    system: &str,
    path: &str,
    (write_mibs, read_mibs): (f64, f64),
    opts: &Options,
    cpu: &CpuOf,
    mut read: impl FnMut(u64) -> Result<(), BenchError>,
) -> Result<Row, BenchError> {
    let mut lat = Vec::with_capacity(opts.requests);
    let c0 = cpu.sample();
    for off in offsets(opts.requests, opts.bytes) {
        let t = Instant::now();
        read(off)?;
        lat.push(t.elapsed().as_secs_f64() * 1e6);
    }
    let cpu_per_100k = cpu.per_100k(c0, cpu.sample(), opts.requests);
    let (lat_mean_us, lat_p50_us, lat_p99_us) = summarize(lat);
    Ok(Row { system: system.into(), path: path.into(), write_mibs, read_mibs, lat_mean_us, lat_p50_us, lat_p99_us, cpu_per_100k })
}

/// Through a FUSE file opened with O_DIRECT, from one thread.
fn fuse_row(system: &str, file: &Path, opts: &Options, cpu: &CpuOf) -> Result<Row, BenchError> {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(file)
        .map_err(|e| format!("{system}: {}: {e}", file.display()))?;
    let e = |e: std::io::Error| format!("{system}: {e}");
    let mut big = Aligned::new(CHUNK);
    for (i, b) in big.buf().iter_mut().enumerate() {
        *b = (i * 7 % 251) as u8;
    }
    let t = Instant::now();
    for off in (0..opts.bytes).step_by(CHUNK) {
        f.write_all_at(big.buf(), off).map_err(e)?;
    }
    f.sync_data().map_err(e)?;
    let write_mibs = mibs(opts.bytes, t.elapsed());
    let t = Instant::now();
    for off in (0..opts.bytes).step_by(CHUNK) {
        f.read_exact_at(big.buf(), off).map_err(e)?;
    }
    let read_mibs = mibs(opts.bytes, t.elapsed());
    let mut small = Aligned::new(SMALL);
    for off in offsets(1000, opts.bytes) {
        f.read_exact_at(small.buf(), off).map_err(e)?;
    }
    let seq = (write_mibs, read_mibs);
    timed_small_reads(system, "fuse", seq, opts, cpu, |off| f.read_exact_at(small.buf(), off).map_err(|x| e(x).into()))
}

/// One bulkhead system: a supervisor in this process, measured through the library, then
/// through a FUSE export of its device.
fn bulkhead(exe: &Path, opts: &Options, system: &str, tap: &str, traced: bool) -> Result<Vec<Row>, BenchError> {
    let trace = opts.scratch.join(format!("bench-tap-{system}.blktrace"));
    let filter =
        if traced { format!("[[device.filter]]\ntype = \"trace\"\npath = \"{}\"\n", trace.display()) } else { String::new() };
    let text = format!(
        "[fuse]\nenabled = false\n[nbd]\nenabled = false\n[[device]]\nname = \"t\"\nsize = {}\nnotify = \"{}\"\ntap = \"{tap}\"\n\
         [device.backend]\ntype = \"ram\"\n{filter}",
        opts.bytes, opts.mode
    );
    let config = Config::parse(&text, "bench tap").map_err(|e| e.to_string())?;
    let sup = Supervisor::start(&config, Some(exe)).map_err(|e| e.to_string())?;
    let dev: Arc<Device> = sup.devices()[0].clone();
    let cpu = CpuOf { in_process: true, servers: crate::domain_pids(&sup.status()) };
    let mut rows = vec![client_row(system, &dev, opts, &cpu)?];
    let mnt = opts.scratch.join(format!("bench-tap-fuse-{}", std::process::id()));
    let fuse = bulkhead_fuse_export::FuseExport::mount(&mnt, sup.devices(), 4).map_err(|e| e.to_string())?;
    let row = fuse_row(system, &mnt.join("t"), opts, &cpu);
    drop(fuse);
    let _ = std::fs::remove_dir(&mnt);
    sup.shutdown();
    let _ = std::fs::remove_file(&trace);
    rows.push(row?);
    Ok(rows)
}

/// nbdfuse over `nbdkit -s [--filter=F …] memory SIZE`, killed and unmounted on drop.
struct NbdFuse {
    child: Child,
    mnt: PathBuf,
}

impl Drop for NbdFuse {
    fn drop(&mut self) {
        let _ = Command::new("fusermount3").arg("-u").arg(&self.mnt).stderr(Stdio::null()).status();
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir(&self.mnt);
    }
}

/// `filters` are nbdkit's `--filter=` options, `params` their parameters (after the plugin's).
fn nbdkit(opts: &Options, system: &str, filters: &[&str], params: &[&str]) -> Result<Row, BenchError> {
    let mnt = opts.scratch.join(format!("bench-tap-{system}-{}", std::process::id()));
    std::fs::create_dir_all(&mnt).map_err(|e| e.to_string())?;
    let mut cmd = Command::new("nbdfuse");
    cmd.arg(&mnt).args(["--command", "nbdkit", "-s"]).args(filters).args(["memory", &opts.bytes.to_string()]).args(params);
    let child =
        cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::null()).spawn().map_err(|e| format!("nbdfuse: {e}"))?;
    let mut n = NbdFuse { child, mnt: mnt.clone() };
    let file = mnt.join("nbd");
    let deadline = Instant::now() + Duration::from_secs(20);
    while !file.exists() {
        if Instant::now() > deadline || matches!(n.child.try_wait(), Ok(Some(_))) {
            return Err(BenchError::Run(format!("{system}: nbdfuse did not start")));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let row = fuse_row(system, &file, opts, &CpuOf { in_process: false, servers: vec![n.child.id()] });
    drop(n);
    row
}

fn which(tool: &str) -> bool {
    std::env::var_os("PATH").is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(tool).is_file()))
}

/// Runs every system, execing `exe` for the domains.
pub fn run(exe: &Path, opts: &Options, mut progress: impl FnMut(&str)) -> Result<Report, BenchError> {
    let mut rows = Vec::new();
    let mut skipped = Vec::new();
    for (system, tap, traced) in SYSTEMS {
        progress(&format!("bulkhead {system}"));
        rows.extend(bulkhead(exe, opts, system, tap, traced)?);
    }
    if opts.nbdkit {
        if which("nbdkit") && which("nbdfuse") {
            let log = opts.scratch.join(format!("bench-tap-nbdkit-{}.log", std::process::id()));
            let logfile = format!("logfile={}", log.display());
            for (system, filters, params) in [
                ("nbdkit", vec![], vec![]),
                ("nbdkit+log", vec!["--filter=log"], vec![logfile.as_str()]),
                ("nbdkit+delay", vec!["--filter=delay"], vec!["rdelay=0", "wdelay=0"]),
            ] {
                progress(system);
                match nbdkit(opts, system, &filters, &params) {
                    Ok(r) => rows.push(r),
                    Err(e) => skipped.push(format!("{system}: {e}")),
                }
            }
            let _ = std::fs::remove_file(&log);
        } else {
            skipped.push("nbdkit: nbdkit or nbdfuse not installed".into());
        }
    }
    let goals = goals(&rows, &opts.mode);
    Ok(Report { mode: opts.mode.clone(), bytes: opts.bytes, requests: opts.requests, rows, goals, skipped })
}

fn goals(rows: &[Row], mode: &str) -> Vec<Goal> {
    let get = |s: &str, p: &str| rows.iter().find(|r| r.system == s && r.path == p);
    let mut out = Vec::new();
    for path in ["client", "fuse"] {
        let (Some(none), Some(pass), Some(inter)) = (get("none", path), get("passthrough", path), get("interpose", path)) else {
            continue;
        };
        for (tap, point, floor) in [("passthrough", pass, 0.97), ("interpose", inter, 0.90)] {
            for (what, a, b) in [("write", point.write_mibs, none.write_mibs), ("read", point.read_mibs, none.read_mibs)] {
                let r = a / b;
                out.push(Goal {
                    what: format!("{path}: {tap} / none, seq {what}"),
                    measured: r,
                    bound: format!("≥ {floor:.2}"),
                    met: r >= floor,
                });
            }
        }
        let extra = inter.lat_mean_us - pass.lat_mean_us;
        let bound = if mode == "poll" { "≤ 2 µs (poll mode)" } else { "≤ 2 µs in poll mode; informational here" };
        out.push(Goal {
            what: format!("{path}: extra mean 4 KiB latency of the tap hop (interpose − passthrough), µs"),
            measured: extra,
            bound: bound.into(),
            met: extra <= 2.0,
        });
    }
    out
}

/// Renders the report.
pub fn render(r: &Report) -> String {
    let mut t = Table::new(&[
        "system",
        "path",
        "seq write MiB/s",
        "seq read MiB/s",
        "4K lat mean µs",
        "p50 µs",
        "p99 µs",
        "4K CPU s/100k serve|domains|reader",
    ]);
    for row in &r.rows {
        t.row(vec![
            row.system.clone(),
            row.path.clone(),
            format!("{:.0}", row.write_mibs),
            format!("{:.0}", row.read_mibs),
            format!("{:.2}", row.lat_mean_us),
            format!("{:.2}", row.lat_p50_us),
            format!("{:.2}", row.lat_p99_us),
            row.cpu_per_100k.by_process(),
        ]);
    }
    let mut out = format!(
        "bench tap: {} MiB sequential each way in 1 MiB requests, {} synchronous 4 KiB reads; bulkhead in {} mode, \
         trace filter in passthrough and interpose\n",
        r.bytes >> 20,
        r.requests,
        r.mode
    );
    out.push_str(&t.render());
    let mut g = Table::new(&["goal", "measured", "bound", "met"]);
    for goal in &r.goals {
        g.row(vec![
            goal.what.clone(),
            format!("{:.3}", goal.measured),
            goal.bound.clone(),
            if goal.met { "yes" } else { "no" }.into(),
        ]);
    }
    out.push('\n');
    out.push_str(&g.render());
    for s in &r.skipped {
        out.push_str(&format!("skipped: {s}\n"));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(system: &str, path: &str, w: f64, r: f64, lat: f64) -> Row {
        Row {
            system: system.into(),
            path: path.into(),
            write_mibs: w,
            read_mibs: r,
            lat_mean_us: lat,
            lat_p50_us: lat,
            lat_p99_us: lat,
            cpu_per_100k: crate::CpuPer100k::default(),
        }
    }

    #[test]
    fn goals_compare_each_tap_mode_with_no_filter_and_the_hop_with_passthrough() {
        let rows = vec![
            row("none", "client", 1000.0, 2000.0, 1.0),
            row("passthrough", "client", 980.0, 1900.0, 1.5),
            row("interpose", "client", 910.0, 1700.0, 4.0),
        ];
        let g = goals(&rows, "poll");
        let met: Vec<_> = g.iter().map(|g| (g.what.split(", ").last().unwrap().to_string(), g.met)).collect();
        assert_eq!(g.len(), 5, "{g:?}");
        assert!(g[0].met && !g[1].met, "{met:?}");
        assert!(g[2].met && !g[3].met, "{met:?}");
        assert!((g[4].measured - 2.5).abs() < 1e-9 && !g[4].met);
        assert!(render(&Report { mode: "poll".into(), bytes: 1 << 30, requests: 10, rows, goals: g, skipped: vec![] })
            .contains("interpose"));
    }

    #[test]
    fn small_read_offsets_stay_inside_the_device_and_aligned() {
        assert!(offsets(10_000, 1 << 20).all(|o| o % 4096 == 0 && o + 4096 <= 1 << 20));
    }
}
