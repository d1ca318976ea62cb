//! `bulkhead-bench fileio`: the evaluation of Shirole's "Performance Improvement of the
//! Driver Domain" (ch. 5, figures 5.1–5.5) for bulkhead
//! and the systems a user would pick instead, in one run.
//!
//! Every system is measured the same way: ext2 on a loop device (`--direct-io=on`) over the
//! exported file, sysbench fileio with 16 KiB blocks and `O_DIRECT` over 256 MiB in 16 files,
//! each mode at each thread count. Systems: bulkhead (`serve` with a 1 GiB `ram` device, or a
//! `file` device on a loop device over a tmpfs file, in each notification mode) and the peers
//! of `shared/tools/peers_fileio.sh` — the native loop device, nbdkit's memory plugin through
//! nbdfuse, and qemu-storage-daemon's NBD export through nbdfuse. A peer whose tools are not
//! installed is skipped with a note.
//!
//! CPU is reported per point two ways: the cores the whole host was busy (from `/proc/stat`,
//! sysbench and the kernel included) and the cores used by the serving processes alone
//! (`serve` and its driver domains; nbdkit, qemu-storage-daemon and nbdfuse).

use crate::{median, BenchError};
use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

/// sysbench fileio modes, in the thesis' order.
pub const MODES: [&str; 6] = ["rndrd", "rndwr", "rndrw", "seqrd", "seqwr", "seqrewr"];
/// Thread counts of the thesis' figures.
pub const THREADS: [u32; 6] = [1, 2, 4, 8, 16, 32];
/// The peers: the kernel's own loop over a tmpfs file, nbdkit's memory plugin and
/// qemu-storage-daemon (each through nbdfuse), and bindfs, a plain libfuse passthrough server,
/// over a tmpfs file (the FUSE hop alone, with no device behind it).
pub const PEERS: [&str; 4] = ["native", "nbdkit", "qsd", "bindfs"];

/// One system under test.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum System {
    /// bulkhead with a backend and a notification mode.
    Bulkhead {
        /// `ram` or `file`.
        backend: String,
        /// `irq`, `poll` or `adaptive`.
        notify: String,
    },
    /// A peer (`native`, `nbdkit`, `qsd`, `bindfs`).
    Peer {
        /// Its name.
        name: String,
    },
}

impl System {
    /// Short name for tables and plots.
    pub fn label(&self) -> String {
        match self {
            System::Bulkhead { backend, notify } => format!("bulkhead-{backend}-{notify}"),
            System::Peer { name } => name.clone(),
        }
    }
}

/// What to run.
#[derive(Debug, Clone)]
pub struct Options {
    /// sysbench modes.
    pub modes: Vec<String>,
    /// Thread counts.
    pub threads: Vec<u32>,
    /// Systems, in order.
    pub systems: Vec<System>,
    /// Seconds per point.
    pub seconds: u32,
    /// How many times each point is measured (the systems in turns each time); the median
    /// round is the point reported.
    pub rounds: u32,
    /// Scratch directory (tmpfs is best: images live there).
    pub scratch: PathBuf,
    /// bulkhead's `spin_budget_us` (`None`: "auto").
    pub spin_budget_us: Option<u64>,
}

impl Options {
    /// The full matrix: every mode and thread count, bulkhead `ram` and `file` in every mode,
    /// every peer.
    pub fn full() -> Self {
        let mut systems = Vec::new();
        for backend in ["ram", "file"] {
            for notify in ["irq", "poll", "adaptive"] {
                systems.push(System::Bulkhead { backend: backend.into(), notify: notify.into() });
            }
        }
        systems.extend(PEERS.iter().map(|p| System::Peer { name: p.to_string() }));
        Options {
            modes: MODES.iter().map(|s| s.to_string()).collect(),
            threads: THREADS.to_vec(),
            systems,
            seconds: 5,
            rounds: 1,
            scratch: PathBuf::from("/dev/shm"),
            spin_budget_us: None,
        }
    }

    /// The quick subset (about two minutes): random read and sequential write at 1 and 8
    /// threads, bulkhead `ram` in every mode and every peer, 3 s per point.
    pub fn quick() -> Self {
        let mut o = Options::full();
        o.modes = vec!["rndrd".into(), "seqwr".into()];
        o.threads = vec![1, 8];
        o.systems.retain(|s| !matches!(s, System::Bulkhead { backend, .. } if backend == "file"));
        o.seconds = 3;
        o
    }
}

/// One measured point.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Point {
    /// System label.
    pub system: String,
    /// sysbench mode.
    pub mode: String,
    /// Threads.
    pub threads: u32,
    /// Read throughput, MiB/s.
    pub read_mibs: f64,
    /// Write throughput, MiB/s.
    pub write_mibs: f64,
    /// Read plus write, MiB/s (the figure plotted and compared).
    pub total_mibs: f64,
    /// 95th percentile latency, ms.
    pub p95_ms: f64,
    /// Cores the host was busy during the point.
    pub host_cpu_cores: f64,
    /// Cores the serving processes used (0 for the native loop: its work is in the kernel).
    pub server_cpu_cores: f64,
    /// Read plus write of every round of this point, MiB/s, in the order measured. The fields
    /// above are those of the median round (the lower middle one for an even count). Empty in
    /// results from before rounds were kept.
    #[serde(default)]
    pub rounds_mibs: Vec<f64>,
    /// CPU seconds per 100k requests (sysbench's events) by process, in the median round:
    /// `serve` and its domains apart for bulkhead, the peer's server as `server`, and
    /// sysbench as `load`. Not in the CSV.
    #[serde(default)]
    pub cpu_per_100k: crate::CpuPer100k,
}

impl Point {
    /// The median of `rounds` (by total throughput), carrying every round's total with it.
    fn median_of(mut rounds: Vec<Point>) -> Option<Point> {
        let totals: Vec<f64> = rounds.iter().map(|p| p.total_mibs).collect();
        rounds.sort_by(|a, b| a.total_mibs.total_cmp(&b.total_mibs));
        let mid = rounds.len().checked_sub(1)? / 2;
        let mut p = rounds.swap_remove(mid);
        p.rounds_mibs = totals;
        Some(p)
    }

    /// Lowest and highest round, MiB/s.
    fn range(&self) -> (f64, f64) {
        let lo = self.rounds_mibs.iter().cloned().fold(f64::INFINITY, f64::min);
        let hi = self.rounds_mibs.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        if lo.is_finite() {
            (lo, hi)
        } else {
            (self.total_mibs, self.total_mibs)
        }
    }
}

/// A system that could not be measured.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Skipped {
    /// System label.
    pub system: String,
    /// Why.
    pub reason: String,
}

/// The whole run.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Report {
    /// Seconds per point (0 when not known: a report read back from `points.csv` alone).
    pub seconds: u32,
    /// Rounds per point (each point is the median round).
    #[serde(default = "one_round")]
    pub rounds: u32,
    /// Modes.
    pub modes: Vec<String>,
    /// Thread counts.
    pub threads: Vec<u32>,
    /// Systems measured, in order.
    pub systems: Vec<String>,
    /// Points.
    pub points: Vec<Point>,
    /// Systems skipped.
    pub skipped: Vec<Skipped>,
    /// Whether the run was interrupted (SIGINT/SIGTERM) before the end.
    pub interrupted: bool,
}

/// The columns of `points.csv`, in order.
const CSV_COLUMNS: [&str; 10] = [
    "system",
    "mode",
    "threads",
    "read_mibs",
    "write_mibs",
    "total_mibs",
    "p95_ms",
    "host_cpu_cores",
    "server_cpu_cores",
    "rounds_mibs",
];

fn one_round() -> u32 {
    1
}

impl Report {
    /// Reads back a stored run: `path` is its `report.json` or `points.csv`, or the directory
    /// `--out` wrote (its `report.json`, or for a run from before reports were kept whole, its
    /// `points.csv`). The tables and goals rendered from it are this build's, so old runs can
    /// be read with later goals.
    pub fn load(path: &Path) -> Result<Report, BenchError> {
        let file = match (path.is_dir(), path.join("report.json")) {
            (true, json) if !json.exists() => path.join("points.csv"),
            (true, json) => json,
            (false, _) => path.to_path_buf(),
        };
        let text = std::fs::read_to_string(&file).map_err(|e| {
            let beside = if path.is_dir() { " (and no report.json beside it)" } else { "" };
            format!("{}: {e}{beside}", file.display())
        })?;
        if file.extension().is_some_and(|e| e == "csv") {
            Report::from_csv(&text).map_err(|e| BenchError::Run(format!("{}: {e}", file.display())))
        } else {
            serde_json::from_str(&text)
                .map_err(|e| BenchError::Run(format!("{}: not a bench fileio report: {e}", file.display())))
        }
    }

    /// A report from `points.csv` alone: the systems, modes and thread counts in the order
    /// their rows first name them; seconds and skipped systems are not in it.
    fn from_csv(text: &str) -> Result<Report, BenchError> {
        let mut lines = text.lines().enumerate();
        let (_, header) = lines.next().ok_or("empty file")?;
        let cols: Vec<&str> = header.split(',').collect();
        // Every column but the last, `rounds_mibs`, which older runs did not write.
        let needed = &CSV_COLUMNS[..CSV_COLUMNS.len() - 1];
        if let Some(missing) = needed.iter().find(|c| !cols.contains(c)) {
            return Err(BenchError::Run(format!("line 1: no `{missing}` column")));
        }
        let mut r = Report {
            seconds: 0,
            rounds: 1,
            modes: Vec::new(),
            threads: Vec::new(),
            systems: Vec::new(),
            points: Vec::new(),
            skipped: Vec::new(),
            interrupted: false,
        };
        for (i, line) in lines.filter(|(_, l)| !l.trim().is_empty()) {
            let at = |e: String| format!("line {}: {e}", i + 1);
            let fields: Vec<&str> = line.split(',').collect();
            if fields.len() != cols.len() {
                return Err(BenchError::from(at(format!("{} fields where the header has {}", fields.len(), cols.len()))));
            }
            let get = |c: &str| cols.iter().position(|h| *h == c).map(|k| fields[k]);
            let num = |c: &str| -> Result<f64, BenchError> {
                let v = get(c).unwrap_or_default();
                v.parse().map_err(|_| BenchError::Run(at(format!("`{c}` is `{v}`, not a number"))))
            };
            let t = get("threads").unwrap_or_default();
            let threads: u32 = t.parse().map_err(|_| at(format!("`threads` is `{t}`, not a thread count")))?;
            let rounds_mibs = match get("rounds_mibs").filter(|v| !v.is_empty()) {
                Some(v) => v
                    .split(';')
                    .map(|x| x.parse().map_err(|_| at(format!("`rounds_mibs` holds `{x}`, not a number"))))
                    .collect::<Result<Vec<f64>, _>>()?,
                None => Vec::new(),
            };
            let p = Point {
                system: get("system").unwrap_or_default().to_string(),
                mode: get("mode").unwrap_or_default().to_string(),
                threads,
                read_mibs: num("read_mibs")?,
                write_mibs: num("write_mibs")?,
                total_mibs: num("total_mibs")?,
                p95_ms: num("p95_ms")?,
                host_cpu_cores: num("host_cpu_cores")?,
                server_cpu_cores: num("server_cpu_cores")?,
                rounds_mibs,
                cpu_per_100k: Default::default(),
            };
            r.rounds = r.rounds.max(p.rounds_mibs.len() as u32);
            for (seen, v) in [(&mut r.systems, &p.system), (&mut r.modes, &p.mode)] {
                if !seen.contains(v) {
                    seen.push(v.clone());
                }
            }
            if !r.threads.contains(&threads) {
                r.threads.push(threads);
            }
            r.points.push(p);
        }
        Ok(r)
    }
}

/// Progress of a run, for a progress bar.
#[derive(Debug, Clone)]
pub struct Progress {
    /// Points done.
    pub done: usize,
    /// Points in all.
    pub total: usize,
    /// What runs now.
    pub what: String,
    /// Estimated time left.
    pub eta: Duration,
}

pub(crate) fn which(tool: &str) -> bool {
    std::env::var_os("PATH").map(|p| std::env::split_paths(&p).any(|d| d.join(tool).is_file())).unwrap_or(false)
}

pub(crate) fn run(cmd: &str, args: &[&str]) -> Result<String, BenchError> {
    let out = Command::new(cmd).args(args).output().map_err(|e| format!("{cmd}: {e}"))?;
    if !out.status.success() {
        return Err(BenchError::Run(format!("{cmd} {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim())));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Processes started for a system; SIGTERM, then SIGKILL, on drop.
pub(crate) struct Procs(pub(crate) Vec<Child>);

impl Procs {
    pub(crate) fn pids(&self) -> Vec<u32> {
        self.0.iter().map(|c| c.id()).collect()
    }
}

impl Drop for Procs {
    fn drop(&mut self) {
        for c in self.0.iter_mut().rev() {
            let _ = bulkhead_sys::signal(c.id(), libc::SIGTERM);
            let deadline = Instant::now() + Duration::from_secs(10);
            while Instant::now() < deadline && !matches!(c.try_wait(), Ok(Some(_))) {
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Mounts, loop devices and FUSE mounts to undo, last first.
#[derive(Default)]
pub(crate) struct Undo(Vec<(String, Vec<String>)>);

impl Undo {
    pub(crate) fn push(&mut self, cmd: &str, args: &[&str]) {
        self.0.push((cmd.to_string(), args.iter().map(|s| s.to_string()).collect()));
    }
}

impl Drop for Undo {
    fn drop(&mut self) {
        while let Some((cmd, args)) = self.0.pop() {
            let _ = Command::new(&cmd).args(&args).stdout(Stdio::null()).stderr(Stdio::null()).status();
        }
    }
}

pub(crate) fn wait_for(path: &Path, what: &str, child: Option<&mut Child>) -> Result<(), BenchError> {
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut child = child;
    while !path.exists() {
        if let Some(c) = child.as_deref_mut() {
            if let Ok(Some(st)) = c.try_wait() {
                return Err(BenchError::Run(format!("{what} exited ({st}) before {} appeared", path.display())));
            }
        }
        if Instant::now() > deadline {
            return Err(BenchError::Run(format!("{what}: {} did not appear within 30 s", path.display())));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}

fn losetup(file: &Path, undo: &mut Undo) -> Result<String, BenchError> {
    let dev = run("losetup", &["--direct-io=on", "-f", "--show", &file.display().to_string()])?.trim().to_string();
    undo.push("losetup", &["-d", &dev]);
    Ok(dev)
}

/// A system set up and mounted: ext2 on a loop device at `mnt`, sysbench files prepared.
struct Mounted {
    procs: Procs,
    _undo: Undo,
}

fn image(path: &Path) -> Result<(), BenchError> {
    let f = std::fs::File::create(path).map_err(|e| format!("{}: {e}", path.display()))?;
    f.set_len(1 << 30).map_err(|e| BenchError::Run(format!("{}: {e}", path.display())))
}

/// Starts `cmd` with no output, owned by `procs`.
fn spawn_quiet(mut cmd: Command, what: &str, procs: &mut Procs) -> Result<(), BenchError> {
    let child =
        cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::null()).spawn().map_err(|e| format!("{what}: {e}"))?;
    procs.0.push(child);
    Ok(())
}

/// Starts an nbdfuse command mounting at `fuse`; its file once it is there.
fn nbdfuse(cmd: Command, fuse: &Path, procs: &mut Procs, undo: &mut Undo) -> Result<PathBuf, BenchError> {
    spawn_quiet(cmd, "nbdfuse", procs)?;
    undo.push("fusermount3", &["-u", &fuse.display().to_string()]);
    let f = fuse.join("nbd");
    wait_for(&f, "nbdfuse", procs.0.last_mut())?;
    Ok(f)
}

/// Starts `bulkhead serve` with `cfg` under `dir` (its configuration, log and run directory),
/// owned by `procs`; the path of the FUSE export of its device `disk0` once it is there.
pub(crate) fn serve(exe: &Path, dir: &Path, cfg: &str, procs: &mut Procs) -> Result<PathBuf, BenchError> {
    let cfg_path = dir.join("serve.toml");
    std::fs::write(&cfg_path, cfg).map_err(|e| e.to_string())?;
    let run_dir = dir.join("run");
    let log = std::fs::File::create(dir.join("serve.log")).map_err(|e| e.to_string())?;
    let child = Command::new(exe)
        .arg("serve")
        .arg("--config")
        .arg(&cfg_path)
        .arg("--run-dir")
        .arg(&run_dir)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .map_err(|e| format!("cannot start bulkhead serve: {e}"))?;
    procs.0.push(child);
    let f = run_dir.join("fuse/disk0");
    if let Err(e) = wait_for(&f, "bulkhead serve", procs.0.last_mut()) {
        let log = std::fs::read_to_string(dir.join("serve.log")).unwrap_or_default();
        return Err(BenchError::Run(format!("{e}: {}", log.lines().last().unwrap_or(""))));
    }
    Ok(f)
}

/// Brings `sys` up under `dir` and mounts ext2 on it at `mnt`.
fn bring_up(sys: &System, exe: &Path, dir: &Path, mnt: &Path, budget_us: Option<u64>) -> Result<Mounted, BenchError> {
    let mut undo = Undo::default();
    let mut procs = Procs(Vec::new());
    let fuse = dir.join("fuse");
    std::fs::create_dir_all(&fuse).map_err(|e| e.to_string())?;
    let device_file = match sys {
        System::Bulkhead { backend, notify } => {
            let backend_toml = if backend == "file" {
                let img = dir.join("backing.img");
                image(&img)?;
                let lo = losetup(&img, &mut undo)?;
                // The sync engine, as in the runs recorded in docs/BENCHMARKS.md.
                format!("type = \"file\"\npath = \"{lo}\"\ndirect = true\nengine = \"sync\"\n")
            } else {
                "type = \"ram\"\n".to_string()
            };
            let size = if backend == "file" { "" } else { "size = \"1G\"\n" };
            let budget = budget_us.map(|us| us.to_string()).unwrap_or_else(|| "\"auto\"".into());
            let cfg = format!(
                "[nbd]\nenabled = false\n[[device]]\nname = \"disk0\"\n{size}notify = \"{notify}\"\nspin_budget_us = {budget}\n[device.backend]\n{backend_toml}"
            );
            serve(exe, dir, &cfg, &mut procs)?
        }
        System::Peer { name } if name == "native" => {
            let img = dir.join("native.img");
            image(&img)?;
            img
        }
        System::Peer { name } if name == "nbdkit" => {
            let mut c = Command::new("nbdfuse");
            c.arg(&fuse).args(["--command", "nbdkit", "-s", "memory", "1G"]);
            nbdfuse(c, &fuse, &mut procs, &mut undo)?
        }
        System::Peer { name } if name == "qsd" => {
            let img = dir.join("qsd.img");
            image(&img)?;
            let sock = dir.join("qsd.sock");
            let mut c = Command::new("qemu-storage-daemon");
            c.arg("--blockdev")
                .arg(format!("driver=file,node-name=f,filename={},cache.direct=off", img.display()))
                .arg("--nbd-server")
                .arg(format!("addr.type=unix,addr.path={}", sock.display()))
                .args(["--export", "type=nbd,id=e,node-name=f,writable=on"]);
            spawn_quiet(c, "qemu-storage-daemon", &mut procs)?;
            wait_for(&sock, "qemu-storage-daemon", procs.0.last_mut())?;
            let mut c = Command::new("nbdfuse");
            c.arg(&fuse).arg(format!("nbd+unix:///f?socket={}", sock.display()));
            nbdfuse(c, &fuse, &mut procs, &mut undo)?
        }
        System::Peer { name } if name == "bindfs" => {
            let src = dir.join("bindfs-src");
            std::fs::create_dir_all(&src).map_err(|e| e.to_string())?;
            image(&src.join("disk.img"))?;
            let mut c = Command::new("bindfs");
            c.arg("-f").arg(&src).arg(&fuse);
            spawn_quiet(c, "bindfs", &mut procs)?;
            undo.push("fusermount3", &["-u", &fuse.display().to_string()]);
            let f = fuse.join("disk.img");
            wait_for(&f, "bindfs", procs.0.last_mut())?;
            f
        }
        System::Peer { name } => return Err(BenchError::Run(format!("unknown peer `{name}`"))),
    };
    let lo = losetup(&device_file, &mut undo)?;
    run("mkfs.ext2", &["-q", "-F", &lo])?;
    std::fs::create_dir_all(mnt).map_err(|e| e.to_string())?;
    run("mount", &[&lo, &mnt.display().to_string()])?;
    undo.push("umount", &[&mnt.display().to_string()]);
    prepare(mnt)?;
    Ok(Mounted { procs, _undo: undo })
}

/// Creates (or brings back to full size) sysbench's 16 files of 16 MiB.
fn prepare(mnt: &Path) -> Result<(), BenchError> {
    let out = Command::new("sysbench")
        .current_dir(mnt)
        .args(["fileio", "--file-total-size=256M", "--file-num=16", "prepare"])
        .output()
        .map_err(|e| format!("sysbench: {e}"))?;
    if !out.status.success() {
        return Err(BenchError::Run(format!("sysbench prepare: {}", String::from_utf8_lossy(&out.stderr).trim())));
    }
    Ok(())
}

/// Busy and total jiffies of the whole host.
fn host_jiffies() -> (u64, u64) {
    let s = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let v: Vec<u64> = s.lines().next().unwrap_or("").split_whitespace().skip(1).filter_map(|x| x.parse().ok()).collect();
    let total: u64 = v.iter().take(8).sum();
    let idle = v.get(3).copied().unwrap_or(0) + v.get(4).copied().unwrap_or(0);
    (total - idle, total)
}

/// utime + stime (jiffies) of `roots` and all their descendants.
pub(crate) fn tree_jiffies(roots: &[u32]) -> u64 {
    let mut parent: HashMap<u32, u32> = HashMap::new();
    let mut cpu: HashMap<u32, u64> = HashMap::new();
    let Ok(dir) = std::fs::read_dir("/proc") else { return 0 };
    for e in dir.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else { continue };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { continue };
        // Fields after the command name, which may hold spaces, closed by the last ')'.
        let Some(rest) = stat.rfind(')').map(|i| &stat[i + 2..]) else { continue };
        let f: Vec<&str> = rest.split_whitespace().collect();
        if f.len() < 13 {
            continue;
        }
        parent.insert(pid, f[1].parse().unwrap_or(0));
        cpu.insert(pid, f[11].parse::<u64>().unwrap_or(0) + f[12].parse::<u64>().unwrap_or(0));
    }
    let mut sum = 0;
    for (&pid, &j) in &cpu {
        let mut p = pid;
        for _ in 0..64 {
            if roots.contains(&p) {
                sum += j;
                break;
            }
            match parent.get(&p) {
                Some(&pp) if pp != 0 && pp != p => p = pp,
                _ => break,
            }
        }
    }
    sum
}

pub(crate) fn clock_ticks() -> f64 {
    bulkhead_sys::clock_ticks_per_second() as f64
}

fn field(out: &str, key: &str) -> f64 {
    out.lines().find(|l| l.contains(key)).and_then(|l| l.split_whitespace().last()).and_then(|v| v.parse().ok()).unwrap_or(0.0)
}

/// Runs one sysbench point on the mounted filesystem.
fn point(sys: &str, mnt: &Path, mode: &str, threads: u32, seconds: u32, server: &[u32]) -> Result<Point, BenchError> {
    let (b0, t0) = host_jiffies();
    let root = server.first().copied().unwrap_or(0);
    let (s0, r0, l0) = (tree_jiffies(server), crate::cpu_seconds(root), children_cpu_seconds());
    let started = Instant::now();
    let out = Command::new("sysbench")
        .current_dir(mnt)
        .args([
            "fileio",
            "--file-total-size=256M",
            "--file-num=16",
            &format!("--file-test-mode={mode}"),
            "--file-block-size=16384",
            "--file-extra-flags=direct",
            &format!("--threads={threads}"),
            &format!("--time={seconds}"),
            "run",
        ])
        .output()
        .map_err(|e| format!("sysbench: {e}"))?;
    let wall = started.elapsed().as_secs_f64();
    let (b1, t1) = host_jiffies();
    let (s1, r1, l1) = (tree_jiffies(server), crate::cpu_seconds(root), children_cpu_seconds());
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        // sysbench reports its fatal errors on stdout.
        let err = String::from_utf8_lossy(&out.stderr);
        let why: Vec<&str> =
            text.lines().chain(err.lines()).filter(|l| l.contains("FATAL") || l.contains("rror")).map(str::trim).collect();
        let why = if why.is_empty() { format!("exit {}", out.status) } else { why.join("; ") };
        return Err(BenchError::Run(format!("sysbench {mode} threads={threads}: {why}")));
    }
    let read = field(&text, "read, MiB/s:");
    let write = field(&text, "written, MiB/s:");
    let ncpu = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1) as f64;
    let host = if t1 > t0 { (b1 - b0) as f64 / (t1 - t0) as f64 * ncpu } else { 0.0 };
    let events = field(&text, "total number of events:").max(1.0);
    let per = |c: f64| c / (events / 100_000.0);
    let tree = s1.saturating_sub(s0) as f64 / clock_ticks();
    let mut cpu = crate::CpuPer100k { server: vec![per(tree)], load: vec![per(l1 - l0)], ..Default::default() };
    if sys.starts_with("bulkhead") {
        cpu.serve.push(per(r1 - r0));
        cpu.domain.push(per((tree - (r1 - r0)).max(0.0)));
    }
    Ok(Point {
        system: sys.to_string(),
        mode: mode.to_string(),
        threads,
        read_mibs: read,
        write_mibs: write,
        total_mibs: read + write,
        p95_ms: field(&text, "95th percentile:"),
        host_cpu_cores: host,
        server_cpu_cores: tree / wall,
        rounds_mibs: vec![read + write],
        cpu_per_100k: cpu,
    })
}

/// User and system CPU seconds of this process's waited-for children (sysbench, once it has
/// exited).
fn children_cpu_seconds() -> f64 {
    // SAFETY: rusage is plain integers, for which all zeroes is a value.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `ru` is a valid rusage for the kernel to fill.
    if unsafe { libc::getrusage(libc::RUSAGE_CHILDREN, &mut ru) } != 0 {
        return 0.0;
    }
    let s = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    s(ru.ru_utime) + s(ru.ru_stime)
}

/// Why a system cannot run here, if it cannot.
fn missing(sys: &System) -> Option<String> {
    if !which("sysbench") {
        return Some("sysbench not installed".into());
    }
    let tools: &[&str] = match sys {
        System::Bulkhead { .. } => &[],
        System::Peer { name } if name == "native" => &[],
        System::Peer { name } if name == "nbdkit" => &["nbdkit", "nbdfuse"],
        System::Peer { name } if name == "qsd" => &["qemu-storage-daemon", "nbdfuse"],
        System::Peer { name } if name == "bindfs" => &["bindfs", "fusermount3"],
        System::Peer { name } => return Some(format!("unknown peer `{name}`")),
    };
    tools.iter().find(|t| !which(t)).map(|t| format!("{t} not installed"))
}

/// Runs the matrix. `stop` ends it early (between points; what was set up is torn down).
pub fn run_matrix(
    exe: &Path,
    opts: &Options,
    stop: &AtomicBool,
    mut progress: impl FnMut(&Progress),
) -> Result<Report, BenchError> {
    if ["losetup", "mkfs.ext2", "mount"].iter().any(|t| !which(t)) {
        return Err("bench fileio needs losetup, mkfs.ext2 and mount (util-linux, e2fsprogs)".into());
    }
    if bulkhead_sys::euid() != 0 {
        return Err("bench fileio needs root (loop devices, mount, FUSE)".into());
    }
    let nonce = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
    // Short: unix socket paths under it must stay within 108 bytes.
    let work = opts.scratch.join(format!("bh-fileio-{}-{}", std::process::id(), nonce % 1_000_000));
    std::fs::create_dir_all(&work).map_err(|e| format!("{}: {e}", work.display()))?;
    struct RmDir(PathBuf);
    impl Drop for RmDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
    let _rm = RmDir(work.clone());

    let mut report = Report {
        seconds: opts.seconds,
        rounds: opts.rounds.max(1),
        modes: opts.modes.clone(),
        threads: opts.threads.clone(),
        systems: Vec::new(),
        points: Vec::new(),
        skipped: Vec::new(),
        interrupted: false,
    };
    let runnable: Vec<&System> = opts
        .systems
        .iter()
        .filter(|s| match missing(s) {
            Some(reason) => {
                report.skipped.push(Skipped { system: s.label(), reason });
                false
            }
            None => true,
        })
        .collect();
    let rounds = opts.rounds.max(1) as usize;
    let per_system = opts.modes.len() * opts.threads.len() * rounds;
    let total = per_system * runnable.len();
    let started = Instant::now();
    let mut done = 0;
    // The systems take turns at each point, each brought up afresh for it (well under a second
    // here, sysbench's files included), so that the points compared with one another are
    // measured seconds apart rather than minutes: this machine's speed drifts by a third over
    // minutes, which a system-by-system order turned into differences between the systems. A
    // system is never up while another is measured (an idle `poll` device spins), and every
    // point starts from whole files (a time-limited seqwr leaves them as long as it got). With
    // more than one round, the turns repeat and each system's median round is its point.
    let mut failed = vec![false; runnable.len()];
    'points: for mode in &opts.modes {
        for &t in &opts.threads {
            let mut measured: Vec<Vec<Point>> = vec![Vec::new(); runnable.len()];
            'rounds: for round in 0..rounds {
                for (si, sys) in runnable.iter().enumerate() {
                    if stop.load(Ordering::Relaxed) {
                        report.interrupted = true;
                        break 'rounds;
                    }
                    if failed[si] {
                        done += 1;
                        continue;
                    }
                    let label = sys.label();
                    // A directory of its own per bring-up: nothing of the last one (a socket,
                    // an image) is taken for this one's.
                    let dir = work.join(format!("s{si}-{done}"));
                    let mnt = dir.join("mnt");
                    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
                    let mut what = format!("{label} {mode} threads={t}");
                    if rounds > 1 {
                        what.push_str(&format!(" round {}/{rounds}", round + 1));
                    }
                    progress(&Progress { done, total, what, eta: eta(started, done, total) });
                    let m = match bring_up(sys, exe, &dir, &mnt, opts.spin_budget_us) {
                        Ok(m) => m,
                        Err(reason) => {
                            let _ = std::fs::remove_dir_all(&dir);
                            report.skipped.push(Skipped { system: label.clone(), reason: reason.to_string() });
                            failed[si] = true;
                            done += 1;
                            continue;
                        }
                    };
                    if !report.systems.contains(&label) {
                        report.systems.push(label.clone());
                    }
                    match point(&label, &mnt, mode, t, opts.seconds, &m.procs.pids()) {
                        Ok(p) => measured[si].push(p),
                        Err(e) => report.skipped.push(Skipped { system: label.clone(), reason: e.to_string() }),
                    }
                    drop(m);
                    let _ = std::fs::remove_dir_all(&dir);
                    done += 1;
                }
            }
            // Interrupted, a point keeps the rounds it has (the report says it is partial).
            report.points.extend(measured.into_iter().filter_map(Point::median_of));
            if report.interrupted {
                break 'points;
            }
        }
    }
    progress(&Progress { done: total, total, what: "done".into(), eta: Duration::ZERO });
    Ok(report)
}

fn eta(started: Instant, done: usize, total: usize) -> Duration {
    if done == 0 {
        return Duration::ZERO;
    }
    started.elapsed().mul_f64((total - done) as f64 / done as f64)
}

/// A one-line progress bar.
pub fn progress_line(p: &Progress) -> String {
    let width = 30;
    let filled = (p.done * width).checked_div(p.total).unwrap_or(width);
    let eta = if p.eta.is_zero() { "--".to_string() } else { format!("{}m{:02}s", p.eta.as_secs() / 60, p.eta.as_secs() % 60) };
    format!("[{}{}] {}/{} ETA {eta} {}", "#".repeat(filled), ".".repeat(width - filled), p.done, p.total, p.what)
}

impl Report {
    fn get(&self, sys: &str, mode: &str, t: u32) -> Option<&Point> {
        self.points.iter().find(|p| p.system == sys && p.mode == mode && p.threads == t)
    }

    fn peers(&self) -> Vec<&String> {
        self.systems.iter().filter(|s| !s.starts_with("bulkhead-")).collect()
    }

    /// ", median of N rounds" when points are medians, else nothing.
    fn of_rounds(&self) -> String {
        if self.rounds > 1 {
            format!(", median of {} rounds", self.rounds)
        } else {
            String::new()
        }
    }

    /// CSV, one line per point.
    pub fn csv(&self) -> String {
        let mut s = CSV_COLUMNS.join(",") + "\n";
        for p in &self.points {
            let rounds: Vec<String> = p.rounds_mibs.iter().map(|r| format!("{r:.2}")).collect();
            s.push_str(&format!(
                "{},{},{},{:.2},{:.2},{:.2},{:.2},{:.3},{:.3},{}\n",
                p.system,
                p.mode,
                p.threads,
                p.read_mibs,
                p.write_mibs,
                p.total_mibs,
                p.p95_ms,
                p.host_cpu_cores,
                p.server_cpu_cores,
                rounds.join(";")
            ));
        }
        s
    }

    /// The tables: throughput per mode, CPU, ratios to each peer, and the goals.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let ths: Vec<String> = self.threads.iter().map(|t| format!("{t} thr")).collect();
        for mode in &self.modes {
            let range = if self.rounds > 1 { " [lowest-highest]" } else { "" };
            out.push_str(&format!("\n{mode}: MiB/s{}{range} (server CPU cores)\n", self.of_rounds()));
            let mut header = vec!["system"];
            header.extend(ths.iter().map(|s| s.as_str()));
            let mut t = crate::Table::new(&header);
            for sys in &self.systems {
                let mut row = vec![sys.clone()];
                for &th in &self.threads {
                    row.push(match self.get(sys, mode, th) {
                        Some(p) if self.rounds > 1 => {
                            let (lo, hi) = p.range();
                            format!("{:.0} [{lo:.0}-{hi:.0}] ({:.2})", p.total_mibs, p.server_cpu_cores)
                        }
                        Some(p) => format!("{:.0} ({:.2})", p.total_mibs, p.server_cpu_cores),
                        None => "-".into(),
                    });
                }
                t.row(row);
            }
            out.push_str(&t.render());
            if self.points.iter().any(|p| !p.cpu_per_100k.server.is_empty()) {
                out.push_str(&format!("{mode}: CPU s per 100k requests, serve|domain|sysbench (a peer: its server|sysbench)\n"));
                let mut t = crate::Table::new(&header);
                for sys in &self.systems {
                    let mut row = vec![sys.clone()];
                    for &th in &self.threads {
                        row.push(self.get(sys, mode, th).map_or("-".into(), |p| p.cpu_per_100k.by_process()));
                    }
                    t.row(row);
                }
                out.push_str(&t.render());
            }
        }
        let peers = self.peers();
        if !peers.is_empty() {
            out.push_str("\nratio of each bulkhead system to each peer over all points (min / median / max; at 1 thread)\n");
            let mut t = crate::Table::new(&["bulkhead", "peer", "min", "median", "max", "1 thread (median)"]);
            for sys in self.systems.iter().filter(|s| s.starts_with("bulkhead-")) {
                for peer in &peers {
                    let (all, one) = self.ratios(sys, peer);
                    if all.is_empty() {
                        continue;
                    }
                    t.row(vec![
                        sys.clone(),
                        peer.to_string(),
                        format!("{:.2}", all[0]),
                        format!("{:.2}", median(&all)),
                        format!("{:.2}", all[all.len() - 1]),
                        if one.is_empty() { "-".into() } else { format!("{:.2}", median(&one)) },
                    ]);
                }
            }
            out.push_str(&t.render());
        }
        out.push_str(&self.goals());
        for s in &self.skipped {
            out.push_str(&format!("skipped {}: {}\n", s.system, s.reason));
        }
        if self.interrupted {
            out.push_str("interrupted: the results above are partial\n");
        }
        out
    }

    /// Sorted ratios of `sys` to `peer` over all points, and over the 1-thread points.
    fn ratios(&self, sys: &str, peer: &str) -> (Vec<f64>, Vec<f64>) {
        let mut all = Vec::new();
        let mut one = Vec::new();
        for p in self.points.iter().filter(|p| p.system == sys) {
            if let Some(q) = self.get(peer, &p.mode, p.threads) {
                if q.total_mibs > 0.0 {
                    all.push(p.total_mibs / q.total_mibs);
                    if p.threads == 1 {
                        one.push(p.total_mibs / q.total_mibs);
                    }
                }
            }
        }
        all.sort_by(|a, b| a.total_cmp(b));
        one.sort_by(|a, b| a.total_cmp(b));
        (all, one)
    }

    /// The goals, checked on this run's points.
    pub fn goals(&self) -> String {
        let mut out = String::from("\ngoals\n");
        for sys in self.systems.iter().filter(|s| s.ends_with("-adaptive")) {
            let base = sys.trim_end_matches("-adaptive");
            let (mut worst, mut at) = (f64::INFINITY, String::new());
            let mut vs_native = Vec::new();
            for p in self.points.iter().filter(|p| &p.system == sys) {
                let best = ["nbdkit", "qsd"]
                    .iter()
                    .filter_map(|q| self.get(q, &p.mode, p.threads))
                    .map(|q| q.total_mibs)
                    .fold(0.0, f64::max);
                if best > 0.0 && p.total_mibs / best < worst {
                    worst = p.total_mibs / best;
                    at = format!("{} threads={}", p.mode, p.threads);
                }
                if p.threads <= 4 {
                    if let Some(n) = self.get("native", &p.mode, p.threads) {
                        vs_native.push(p.total_mibs / n.total_mibs.max(f64::MIN_POSITIVE));
                    }
                }
            }
            if worst.is_finite() {
                out.push_str(&format!(
                    "{sys} >= 2x best peer at every point: {} (worst {worst:.2}x at {at})\n",
                    if worst >= 2.0 { "met" } else { "NOT met" }
                ));
            }
            if !vs_native.is_empty() {
                let m = vs_native.iter().cloned().fold(f64::INFINITY, f64::min);
                out.push_str(&format!(
                    "{sys} >= 50% of native at 1-4 threads: {} (worst {:.0}%)\n",
                    if m >= 0.5 { "met" } else { "NOT met" },
                    m * 100.0
                ));
            }
            let hop: Vec<f64> = self
                .points
                .iter()
                .filter(|p| &p.system == sys)
                .filter_map(|p| Some(p.total_mibs / self.get("bindfs", &p.mode, p.threads)?.total_mibs.max(f64::MIN_POSITIVE)))
                .collect();
            if !hop.is_empty() {
                let worst = hop.iter().cloned().fold(f64::INFINITY, f64::min);
                out.push_str(&format!(
                    "{sys} against bindfs (a libfuse passthrough, the FUSE hop alone): median {:.2}x, worst {worst:.2}x\n",
                    median(&hop)
                ));
            }
            let (poll, irq) = (format!("{base}-poll"), format!("{base}-irq"));
            let (mut within, mut paired) = (Within::default(), Within::default());
            for p in self.points.iter().filter(|p| &p.system == sys) {
                let modes: Vec<&Point> = [&poll, &irq].iter().filter_map(|s| self.get(s, &p.mode, p.threads)).collect();
                let better = modes.iter().map(|q| q.total_mibs).fold(0.0, f64::max);
                if better > 0.0 {
                    within.count(p, p.total_mibs / better);
                }
                if let Some(r) = round_by_round(p, &modes) {
                    paired.count(p, r);
                }
            }
            out.push_str(&within.line(sys, ""));
            out.push_str(&paired.line(sys, ", round by round"));
            let mut low = (0, 0);
            for p in self.points.iter().filter(|p| p.system == poll && p.threads <= 2) {
                if let Some(i) = self.get(&irq, &p.mode, p.threads) {
                    low.1 += 1;
                    if p.total_mibs > i.total_mibs {
                        low.0 += 1;
                    }
                }
            }
            if low.1 > 0 {
                out.push_str(&format!("{poll} beats {irq} at 1-2 threads: {} of {} points\n", low.0, low.1));
            }
        }
        out
    }

    /// An SVG with one panel per mode: throughput against threads (log scale), a line per system.
    pub fn svg(&self) -> String {
        const COLORS: [&str; 9] =
            ["#1f77b4", "#ff7f0e", "#2ca02c", "#17becf", "#bcbd22", "#9467bd", "#7f7f7f", "#d62728", "#8c564b"];
        let (pw, ph, cols) = (380.0, 260.0, 3usize);
        let rows = self.modes.len().div_ceil(cols).max(1);
        let legend_h = 24.0 * self.systems.len().div_ceil(3) as f64 + 10.0;
        let (w, h) = (pw * cols as f64 + 20.0, ph * rows as f64 + legend_h + 40.0);
        let mut s = format!(
            "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"11\">\n\
             <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
             <text x=\"10\" y=\"20\" font-size=\"14\">sysbench fileio, 16 KiB O_DIRECT, ext2 on loop (--direct-io=on); MiB/s against threads; {} s per point{}</text>\n",
            self.seconds,
            self.of_rounds()
        );
        let tmin = self.threads.iter().copied().min().unwrap_or(1).max(1) as f64;
        let tmax = self.threads.iter().copied().max().unwrap_or(1).max(2) as f64;
        for (i, mode) in self.modes.iter().enumerate() {
            let (ox, oy) = (10.0 + pw * (i % cols) as f64, 30.0 + ph * (i / cols) as f64);
            let (l, r, t, b) = (ox + 50.0, ox + pw - 15.0, oy + 20.0, oy + ph - 35.0);
            let ymax = self.points.iter().filter(|p| &p.mode == mode).map(|p| p.total_mibs).fold(0.0, f64::max).max(1.0) * 1.1;
            let x =
                |th: f64| if tmax > tmin { l + (th.ln() - tmin.ln()) / (tmax.ln() - tmin.ln()) * (r - l) } else { (l + r) / 2.0 };
            let y = |v: f64| b - v / ymax * (b - t);
            s.push_str(&format!("<text x=\"{}\" y=\"{}\" font-size=\"13\" font-weight=\"bold\">{mode}</text>\n", l, t - 6.0));
            s.push_str(&format!(
                "<rect x=\"{l}\" y=\"{t}\" width=\"{}\" height=\"{}\" fill=\"none\" stroke=\"#888\"/>\n",
                r - l,
                b - t
            ));
            for k in 0..=4 {
                let v = ymax / 1.1 * k as f64 / 4.0;
                s.push_str(&format!(
                    "<line x1=\"{l}\" x2=\"{r}\" y1=\"{0:.1}\" y2=\"{0:.1}\" stroke=\"#eee\"/><text x=\"{1}\" y=\"{2:.1}\" text-anchor=\"end\">{3:.0}</text>\n",
                    y(v),
                    l - 4.0,
                    y(v) + 4.0,
                    v
                ));
            }
            for &th in &self.threads {
                s.push_str(&format!("<text x=\"{:.1}\" y=\"{}\" text-anchor=\"middle\">{th}</text>\n", x(th as f64), b + 14.0));
            }
            s.push_str(&format!("<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">threads</text>\n", (l + r) / 2.0, b + 28.0));
            for (si, sys) in self.systems.iter().enumerate() {
                let pts: Vec<String> = self
                    .threads
                    .iter()
                    .filter_map(|&th| self.get(sys, mode, th).map(|p| format!("{:.1},{:.1}", x(th as f64), y(p.total_mibs))))
                    .collect();
                if pts.is_empty() {
                    continue;
                }
                let c = COLORS[si % COLORS.len()];
                let dash = if sys.starts_with("bulkhead-") { "" } else { " stroke-dasharray=\"5,3\"" };
                s.push_str(&format!(
                    "<polyline points=\"{}\" fill=\"none\" stroke=\"{c}\" stroke-width=\"2\"{dash}/>\n",
                    pts.join(" ")
                ));
                for p in &pts {
                    let (px, py) = p.split_once(',').unwrap_or(("0", "0"));
                    s.push_str(&format!("<circle cx=\"{px}\" cy=\"{py}\" r=\"2.5\" fill=\"{c}\"/>\n"));
                }
            }
        }
        let ly = 30.0 + ph * rows as f64 + 10.0;
        for (si, sys) in self.systems.iter().enumerate() {
            let (lx, yy) = (20.0 + 300.0 * (si % 3) as f64, ly + 24.0 * (si / 3) as f64);
            let c = COLORS[si % COLORS.len()];
            let dash = if sys.starts_with("bulkhead-") { "" } else { " stroke-dasharray=\"5,3\"" };
            s.push_str(&format!(
                "<line x1=\"{lx}\" x2=\"{}\" y1=\"{yy}\" y2=\"{yy}\" stroke=\"{c}\" stroke-width=\"2\"{dash}/><text x=\"{}\" y=\"{}\">{sys}</text>\n",
                lx + 30.0,
                lx + 36.0,
                yy + 4.0
            ));
        }
        s.push_str("</svg>\n");
        s
    }
}

/// A count of points within 10% of the better mode, and the points that were not.
#[derive(Default)]
struct Within {
    met: usize,
    points: usize,
    misses: Vec<String>,
}

impl Within {
    fn count(&mut self, p: &Point, ratio: f64) {
        self.points += 1;
        if ratio >= 0.9 {
            self.met += 1;
        } else {
            self.misses.push(format!("{} {} thr {ratio:.3}", p.mode, p.threads));
        }
    }

    /// The goal's line, or nothing when no point had both modes to compare with.
    fn line(&self, sys: &str, how: &str) -> String {
        if self.points == 0 {
            return String::new();
        }
        let misses = if self.misses.is_empty() { String::new() } else { format!(" (misses: {})", self.misses.join(", ")) };
        format!("{sys} within 10% of the better of poll and irq{how}: {} of {} points{misses}\n", self.met, self.points)
    }
}

/// A system's throughput at a point over the better of `others` at it, taken round by round
/// and then the median: each round's turns are seconds apart, so the ratio within a round
/// leaves out the drift of this machine's speed between rounds, which a ratio of medians
/// (each median from its own rounds) keeps. `None` unless every system has the same number of
/// rounds, more than one (a failed measurement leaves a round out, and then they do not line
/// up).
fn round_by_round(p: &Point, others: &[&Point]) -> Option<f64> {
    let n = p.rounds_mibs.len();
    if n < 2 || others.is_empty() || others.iter().any(|q| q.rounds_mibs.len() != n) {
        return None;
    }
    let ratios: Vec<f64> = (0..n)
        .map(|r| {
            let better = others.iter().map(|q| q.rounds_mibs[r]).fold(0.0, f64::max);
            p.rounds_mibs[r] / better.max(f64::MIN_POSITIVE)
        })
        .collect();
    Some(median(&ratios))
}

/// Writes `report.json`, `points.csv`, `fileio.svg` and `report.txt` into `dir`.
pub fn write_outputs(report: &Report, dir: &Path) -> Result<Vec<PathBuf>, BenchError> {
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let files = [
        ("report.json", serde_json::to_string_pretty(report).map_err(|e| e.to_string())? + "\n"),
        ("points.csv", report.csv()),
        ("fileio.svg", report.svg()),
        ("report.txt", report.render()),
    ];
    let mut out = Vec::new();
    for (name, text) in files {
        let p = dir.join(name);
        let mut f = std::fs::File::create(&p).map_err(|e| format!("{}: {e}", p.display()))?;
        f.write_all(text.as_bytes()).map_err(|e| format!("{}: {e}", p.display()))?;
        out.push(p);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Report {
        let mut points = Vec::new();
        for (sys, base) in [
            ("bulkhead-ram-adaptive", 300.0),
            ("bulkhead-ram-poll", 320.0),
            ("bulkhead-ram-irq", 150.0),
            ("native", 500.0),
            ("nbdkit", 100.0),
            ("qsd", 140.0),
            ("bindfs", 200.0),
        ] {
            for mode in ["rndrd", "seqwr"] {
                for t in [1u32, 8] {
                    let v = base * if t == 8 { 1.5 } else { 1.0 };
                    points.push(Point {
                        system: sys.into(),
                        mode: mode.into(),
                        threads: t,
                        read_mibs: if mode == "rndrd" { v } else { 0.0 },
                        write_mibs: if mode == "seqwr" { v } else { 0.0 },
                        total_mibs: v,
                        p95_ms: 0.1,
                        host_cpu_cores: 1.5,
                        server_cpu_cores: 0.8,
                        rounds_mibs: vec![v],
                        cpu_per_100k: Default::default(),
                    });
                }
            }
        }
        Report {
            seconds: 3,
            rounds: 1,
            modes: vec!["rndrd".into(), "seqwr".into()],
            threads: vec![1, 8],
            systems: ["bulkhead-ram-irq", "bulkhead-ram-poll", "bulkhead-ram-adaptive", "native", "nbdkit", "qsd", "bindfs"]
                .map(String::from)
                .to_vec(),
            points,
            skipped: vec![Skipped { system: "bulkhead-file-irq".into(), reason: "not asked".into() }],
            interrupted: false,
        }
    }

    #[test]
    fn goals_are_checked_against_the_best_peer_and_native() {
        let g = sample().goals();
        // 300 / 140 = 2.14 against qsd, the better peer: met. 300 / 500 = 60% of native: met.
        assert!(g.contains("bulkhead-ram-adaptive >= 2x best peer at every point: met (worst 2.14x"), "{g}");
        assert!(g.contains(">= 50% of native at 1-4 threads: met (worst 60%)"), "{g}");
        assert!(g.contains("against bindfs (a libfuse passthrough, the FUSE hop alone): median 1.50x, worst 1.50x"), "{g}");
        assert!(g.contains("within 10% of the better of poll and irq: 4 of 4 points"), "{g}");
        assert!(g.contains("bulkhead-ram-poll beats bulkhead-ram-irq at 1-2 threads: 2 of 2 points"), "{g}");
    }

    #[test]
    fn outputs_hold_every_point() {
        let r = sample();
        let csv = r.csv();
        assert_eq!(csv.lines().count(), 1 + r.points.len());
        assert!(csv.contains("nbdkit,seqwr,8,0.00,150.00,150.00"), "{csv}");
        let txt = r.render();
        assert!(txt.contains("rndrd: MiB/s") && txt.contains("skipped bulkhead-file-irq: not asked"), "{txt}");
        assert!(txt.contains("bulkhead-ram-adaptive  nbdkit  3.00"), "{txt}");
        let svg = r.svg();
        assert_eq!(svg.matches("<polyline").count(), 14, "a line per system per mode");
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        let dir = std::env::temp_dir().join(format!("bulkhead-fileio-out-{}", std::process::id()));
        let files = write_outputs(&r, &dir).unwrap();
        assert_eq!(files.len(), 4);
        let back: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("report.json")).unwrap()).unwrap();
        assert_eq!(back["points"].as_array().unwrap().len(), r.points.len());
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_stored_run_reads_back_from_its_report_or_its_points() {
        let mut r = sample();
        r.rounds = 3;
        for p in r.points.iter_mut() {
            p.rounds_mibs = vec![p.total_mibs * 0.8, p.total_mibs, p.total_mibs * 1.1];
        }
        let dir = std::env::temp_dir().join(format!("bulkhead-fileio-load-{}", std::process::id()));
        write_outputs(&r, &dir).unwrap();
        let from_json = Report::load(&dir).unwrap();
        assert_eq!(from_json.render(), r.render());
        assert_eq!(Report::load(&dir.join("report.json")).unwrap().render(), r.render());
        // A run from before reports were kept whole has points.csv alone; seconds and skipped
        // systems are lost, the tables and goals are not.
        std::fs::remove_file(dir.join("report.json")).unwrap();
        let mut from_csv = Report::load(&dir).unwrap();
        assert_eq!(Report::load(&dir.join("points.csv")).unwrap().goals(), r.goals());
        assert_eq!((from_csv.rounds, &from_csv.modes, &from_csv.threads), (3, &r.modes, &r.threads));
        // Systems come in the order the rows name them, which in a real run is the run's.
        let mut sorted = r.systems.clone();
        sorted.sort();
        from_csv.systems.sort();
        assert_eq!(from_csv.systems, sorted);
        assert_eq!(from_csv.goals(), r.goals());
        // Older still: no rounds column, one figure a point.
        let old: String = r.csv().lines().map(|l| l.rsplit_once(',').unwrap().0.to_string() + "\n").collect();
        std::fs::write(dir.join("points.csv"), old).unwrap();
        let one = Report::load(&dir).unwrap();
        assert_eq!(one.rounds, 1);
        assert!(one.goals().contains("within 10% of the better of poll and irq: 4 of 4 points\n"));
        assert!(!one.goals().contains("round by round"));
        // Bad input names the file and the line.
        std::fs::write(dir.join("points.csv"), "system,mode,threads\n").unwrap();
        let e = Report::load(&dir).unwrap_err().to_string();
        assert!(e.contains("points.csv") && e.contains("line 1: no `read_mibs` column"), "{e}");
        std::fs::write(dir.join("points.csv"), r.csv().replace("nbdkit,seqwr,8,0.00", "nbdkit,seqwr,8,lots")).unwrap();
        let e = Report::load(&dir).unwrap_err().to_string();
        assert!(e.contains("`read_mibs` is `lots`, not a number") && e.contains("line "), "{e}");
        std::fs::write(dir.join("points.csv"), r.csv().replace("nbdkit,seqwr,8,", "nbdkit,seqwr,-8,")).unwrap();
        let e = Report::load(&dir).unwrap_err().to_string();
        assert!(e.contains("`threads` is `-8`, not a thread count"), "{e}");
        std::fs::write(dir.join("report.json"), "{\"seconds\": 3}").unwrap();
        let e = Report::load(&dir).unwrap_err().to_string();
        assert!(e.contains("report.json: not a bench fileio report") && e.contains("line 1"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
        std::fs::create_dir_all(&dir).unwrap();
        let e = Report::load(&dir).unwrap_err().to_string();
        assert!(e.contains("points.csv") && e.contains("no report.json"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
        let e = Report::load(&dir).unwrap_err().to_string();
        assert!(e.contains(&dir.display().to_string()), "{e}");
    }

    #[test]
    fn a_point_of_several_rounds_is_its_median_round() {
        let round = |total: f64, p95: f64| Point {
            system: "native".into(),
            mode: "rndrd".into(),
            threads: 1,
            read_mibs: total,
            write_mibs: 0.0,
            total_mibs: total,
            p95_ms: p95,
            host_cpu_cores: 1.0,
            server_cpu_cores: 0.0,
            rounds_mibs: vec![total],
            cpu_per_100k: Default::default(),
        };
        let p = Point::median_of(vec![round(400.0, 0.1), round(300.0, 0.3), round(500.0, 0.2)]).unwrap();
        // The whole median round is kept, with every round's total in the order measured.
        assert_eq!((p.total_mibs, p.p95_ms), (400.0, 0.1));
        assert_eq!(p.rounds_mibs, [400.0, 300.0, 500.0]);
        assert_eq!(p.range(), (300.0, 500.0));
        // An even count takes the lower middle round; none gives no point.
        let p = Point::median_of(vec![round(400.0, 0.1), round(300.0, 0.3)]).unwrap();
        assert_eq!(p.total_mibs, 300.0);
        assert!(Point::median_of(Vec::new()).is_none());

        let mut r = sample();
        r.rounds = 3;
        for p in r.points.iter_mut() {
            p.rounds_mibs = vec![p.total_mibs * 0.9, p.total_mibs, p.total_mibs * 1.2];
        }
        let txt = r.render();
        assert!(txt.contains("rndrd: MiB/s, median of 3 rounds [lowest-highest] (server CPU cores)"), "{txt}");
        assert!(txt.contains("300 [270-360] (0.80)"), "{txt}");
        assert!(r.csv().contains("native,rndrd,1,500.00,0.00,500.00,0.10,1.500,0.800,450.00;500.00;600.00"), "{}", r.csv());
    }

    #[test]
    fn the_better_mode_is_compared_round_by_round_too() {
        let mut r = sample();
        r.rounds = 3;
        let rounds = |sys: &str, mode: &str, t: u32| -> Option<Vec<f64>> {
            match (sys, mode, t) {
                // The machine slows in the first round and speeds up in the third for both:
                // by medians 480 against 560 (0.86), round by round 0.94, 0.86 and 0.97.
                ("bulkhead-ram-adaptive", "rndrd", 1) => Some(vec![300.0, 480.0, 560.0]),
                ("bulkhead-ram-poll", "rndrd", 1) => Some(vec![320.0, 560.0, 580.0]),
                // A steady loss: 0.8 of poll in every round, a miss either way.
                ("bulkhead-ram-adaptive", "seqwr", 8) => Some(vec![400.0, 400.0, 400.0]),
                ("bulkhead-ram-poll", "seqwr", 8) => Some(vec![500.0, 500.0, 500.0]),
                _ => None,
            }
        };
        for p in r.points.iter_mut() {
            p.rounds_mibs = rounds(&p.system, &p.mode, p.threads).unwrap_or_else(|| vec![p.total_mibs; 3]);
            p.total_mibs = p.rounds_mibs[1];
        }
        let g = r.goals();
        assert!(
            g.contains(
                "within 10% of the better of poll and irq: 2 of 4 points (misses: rndrd 1 thr 0.857, seqwr 8 thr 0.800)\n"
            ),
            "{g}"
        );
        assert!(
            g.contains("within 10% of the better of poll and irq, round by round: 3 of 4 points (misses: seqwr 8 thr 0.800)\n"),
            "{g}"
        );
        // Rounds that do not line up (a system failed in one) are not paired.
        let poll = r.points.iter().find(|p| p.system == "bulkhead-ram-poll").unwrap().clone();
        let mut short = poll.clone();
        short.rounds_mibs.pop();
        assert!(round_by_round(&poll, &[&short]).is_none());
        assert!(round_by_round(&poll, &[&poll]).is_some_and(|x| x == 1.0));
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0, "in any order");
    }

    #[test]
    fn sysbench_fields_parse() {
        let out = "File operations:\n    reads/s:                      17044.94\nThroughput:\n    read, MiB/s:                  266.33\n    written, MiB/s:               0.00\nLatency (ms):\n         95th percentile:                        0.09\n";
        assert_eq!(field(out, "read, MiB/s:"), 266.33);
        assert_eq!(field(out, "written, MiB/s:"), 0.0);
        assert_eq!(field(out, "95th percentile:"), 0.09);
    }

    #[test]
    fn quick_is_a_subset_of_full() {
        let (q, f) = (Options::quick(), Options::full());
        assert!(q.systems.iter().all(|s| f.systems.contains(s)));
        assert_eq!(f.systems.len(), 10);
        assert_eq!(q.modes.len() * q.threads.len() * q.systems.len() * q.seconds as usize, 84);
    }
}
