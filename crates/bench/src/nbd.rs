//! `bulkhead-bench nbd`: bulkhead's NBD export against nbdkit and qemu-nbd serving the same
//! backing, with fio's nbd engine (libnbd) as the client over a unix socket: from RAM
//! (bulkhead `ram`, nbdkit `memory`, qemu-nbd on a /dev/shm file) or from a file on disk
//! (bulkhead `file`, nbdkit `file`, qemu-nbd, all bypassing the page cache).
//!
//! Rounds alternate the servers, each started afresh and its range written whole first. CPU
//! per 100k requests is given per process: `serve` and its domain apart, nbdkit, qemu-nbd, and
//! the fio job (the client, counted apart from the server).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::median;
use crate::{cpu_seconds, BenchError, CpuPer100k, Table};

/// What the servers serve from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum Backing {
    /// Memory.
    Ram,
    /// A file on the root file system, read and written around the page cache.
    File,
}

/// Options.
#[derive(Debug, Clone)]
pub struct Options {
    /// Alternated rounds.
    pub rounds: usize,
    /// Seconds per point.
    pub seconds: u64,
    /// The backing.
    pub backing: Backing,
}

/// The servers compared.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum System {
    /// bulkhead's NBD export.
    Bulkhead,
    /// nbdkit.
    Nbdkit,
    /// qemu-nbd.
    QemuNbd,
}

const SYSTEMS: [System; 3] = [System::Bulkhead, System::Nbdkit, System::QemuNbd];

use crate::FioPoint as Workload;

const WORKLOADS: [Workload; 6] = [
    Workload { name: "4k randread qd1", rw: "randread", bs: 4096, qd: 1 },
    Workload { name: "4k randwrite qd1", rw: "randwrite", bs: 4096, qd: 1 },
    Workload { name: "4k randread qd16", rw: "randread", bs: 4096, qd: 16 },
    Workload { name: "4k randwrite qd16", rw: "randwrite", bs: 4096, qd: 16 },
    Workload { name: "1m read qd4", rw: "read", bs: 1 << 20, qd: 4 },
    Workload { name: "1m write qd4", rw: "write", bs: 1 << 20, qd: 4 },
];

/// Bytes each point works over (and the fill writes).
const RANGE: u64 = 512 << 20;
/// The backing's size (the `1G` of bulkhead's configuration).
const SIZE: u64 = 1 << 30;

/// One server's rounds at one point.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Figures {
    /// IOPS of each round.
    pub iops: Vec<f64>,
    /// Median completion latency of each round, µs.
    pub p50_us: Vec<f64>,
    /// 99th percentile of each round, µs.
    pub p99_us: Vec<f64>,
    /// CPU per 100k requests of each round.
    pub cpu_per_100k: CpuPer100k,
}

/// One point.
#[derive(Debug, Clone, Serialize)]
pub struct Point {
    /// Workload.
    pub workload: String,
    /// Block size.
    pub bs: u32,
    /// Queue depth.
    pub qd: u32,
    /// bulkhead.
    pub bulkhead: Figures,
    /// nbdkit.
    pub nbdkit: Figures,
    /// qemu-nbd.
    pub qemu_nbd: Figures,
}

/// Results.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// Rounds.
    pub rounds: usize,
    /// The backing.
    pub backing: Backing,
    /// Points.
    pub points: Vec<Point>,
    /// Servers left out, and why.
    pub skipped: Vec<String>,
    /// Runs that failed, and why; their figures are left out.
    pub failures: Vec<String>,
}

/// A server under test, listening on a unix socket.
struct Server {
    child: Child,
    socket: PathBuf,
    /// bulkhead's run directory (for its domain's pid).
    run_dir: Option<PathBuf>,
    log: PathBuf,
}

impl Server {
    fn start(system: System, backing: Backing, exe: &Path, dir: &Path) -> Result<Server, BenchError> {
        let log = dir.join(format!("{system:?}.log"));
        let err = std::fs::File::create(&log).map_err(|e| BenchError::io(&log, e))?;
        let file = dir.join("disk.img");
        let shm = PathBuf::from(format!("/dev/shm/bulkhead-bench-nbd-{}.img", std::process::id()));
        let (mut cmd, socket, run_dir) = match system {
            System::Bulkhead => {
                let backend = match backing {
                    Backing::Ram => "type = \"ram\"".to_string(),
                    Backing::File => format!("type = \"file\"\npath = \"{}\"\ndirect = true", file.display()),
                };
                let cfg = dir.join("bulkhead.toml");
                std::fs::write(
                    &cfg,
                    format!("[fuse]\nenabled = false\n[[device]]\nname = \"d\"\nsize = \"1G\"\n[device.backend]\n{backend}\n"),
                )
                .map_err(|e| BenchError::io(&cfg, e))?;
                let run = dir.join("run");
                let _ = std::fs::remove_dir_all(&run);
                let mut c = Command::new(exe);
                c.arg("serve").arg("--config").arg(&cfg).arg("--run-dir").arg(&run);
                (c, run.join("nbd.sock"), Some(run))
            }
            System::Nbdkit => {
                let socket = dir.join("nbdkit.sock");
                let mut c = Command::new("nbdkit");
                c.arg("-f").arg("-U").arg(&socket);
                match backing {
                    Backing::Ram => c.arg("memory").arg(SIZE.to_string()),
                    Backing::File => c.arg("file").arg(&file).arg("cache=none"),
                };
                (c, socket, None)
            }
            System::QemuNbd => {
                let socket = dir.join("qemu-nbd.sock");
                let image = if backing == Backing::Ram { &shm } else { &file };
                let mut c = Command::new("qemu-nbd");
                c.args(["-f", "raw", "-t", "-e", "16", "--cache=none", "--aio=threads", "-k"]).arg(&socket).arg(image);
                (c, socket, None)
            }
        };
        let _ = std::fs::remove_file(&socket);
        let child = cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(err).spawn().map_err(|e| format!("{system:?}: {e}"))?;
        let s = Server { child, socket, run_dir, log };
        let deadline = Instant::now() + Duration::from_secs(30);
        while !s.socket.exists() || (s.run_dir.is_some() && s.domain() == 0) {
            if Instant::now() > deadline {
                let text = std::fs::read_to_string(&s.log).unwrap_or_default();
                return Err(BenchError::Run(format!("{system:?} did not start: {}", text.trim())));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(s)
    }

    fn uri(&self) -> String {
        match self.run_dir {
            Some(_) => format!("nbd+unix:///d?socket={}", self.socket.display()),
            None => format!("nbd+unix:///?socket={}", self.socket.display()),
        }
    }

    fn domain(&self) -> u32 {
        self.run_dir
            .as_ref()
            .and_then(|r| crate::serve_status(&r.join("control.sock")))
            .and_then(|s| s.devices.into_iter().next())
            .map_or(0, |d| d.driver_pid)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        crate::stop_child(&mut self.child, Duration::from_secs(20));
    }
}

/// One run of fio against `uri`.
struct Sample {
    iops: f64,
    p50_us: f64,
    p99_us: f64,
    fio_cpu: f64,
    requests: f64,
}

fn fio(uri: &str, w: &Workload, seconds: u64, what: &str) -> Result<Sample, BenchError> {
    let out = Command::new("timeout")
        .args(["--kill-after=10", &(seconds + 60).to_string(), "fio", "--name=p", "--ioengine=nbd"])
        .arg(format!("--uri={uri}"))
        .arg(format!("--rw={}", w.rw))
        .arg(format!("--bs={}", w.bs))
        .arg(format!("--iodepth={}", w.qd))
        .arg(format!("--size={RANGE}"))
        .args(["--time_based", "--randrepeat=0", "--output-format=json"])
        .arg(format!("--runtime={seconds}"))
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("fio: {e}"))?;
    if !out.status.success() {
        return Err(BenchError::Run(format!("fio on {what}: {}", String::from_utf8_lossy(&out.stderr).trim())));
    }
    let v = crate::fio_report(&out.stdout, what)?;
    let j = &v["jobs"][0];
    let d = if j["read"]["io_bytes"].as_f64().unwrap_or(0.0) > 0.0 { &j["read"] } else { &j["write"] };
    let pct = |p: &str| d["clat_ns"]["percentile"][p].as_f64().unwrap_or(0.0) / 1e3;
    Ok(Sample {
        iops: d["iops"].as_f64().unwrap_or(0.0),
        p50_us: pct("50.000000"),
        p99_us: pct("99.000000"),
        fio_cpu: crate::fio_job_cpu_seconds(j),
        requests: d["total_ios"].as_f64().unwrap_or(0.0),
    })
}

/// Writes the range whole, so that reads find data on every server.
fn fill(uri: &str) -> Result<(), BenchError> {
    let ok = Command::new("fio")
        .args(["--name=fill", "--ioengine=nbd", "--rw=write", "--bs=1M", "--iodepth=4"])
        .arg(format!("--uri={uri}"))
        .arg(format!("--size={RANGE}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map_err(|e| format!("fio: {e}"))?;
    if ok.success() {
        Ok(())
    } else {
        Err(BenchError::Run("fio could not fill the range".into()))
    }
}

fn installed(cmd: &str) -> bool {
    Command::new(cmd).arg("--version").stdout(Stdio::null()).stderr(Stdio::null()).status().is_ok_and(|s| s.success())
}

/// Runs the benchmark.
pub fn run(exe: &Path, opts: &Options, mut progress: impl FnMut(&str)) -> Result<Report, BenchError> {
    if !(1..=50).contains(&opts.rounds) || !(1..=600).contains(&opts.seconds) {
        return Err(BenchError::Options("rounds 1..=50, seconds 1..=600".into()));
    }
    // On the root file system (a disk, not tmpfs) for the file backing.
    let dir = PathBuf::from(format!("/var/tmp/bulkhead-bench-nbd-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| BenchError::io(&dir, e))?;
    let shm = PathBuf::from(format!("/dev/shm/bulkhead-bench-nbd-{}.img", std::process::id()));
    let result = (|| {
        for f in [dir.join("disk.img"), shm.clone()] {
            std::fs::File::create(&f).and_then(|h| h.set_len(SIZE)).map_err(|e| BenchError::io(&f, e))?;
        }
        let mut report =
            Report { rounds: opts.rounds, backing: opts.backing, points: Vec::new(), skipped: Vec::new(), failures: Vec::new() };
        let mut systems = SYSTEMS.to_vec();
        for (s, cmd) in [(System::Nbdkit, "nbdkit"), (System::QemuNbd, "qemu-nbd")] {
            if !installed(cmd) {
                report.skipped.push(format!("{cmd} is not installed"));
                systems.retain(|&x| x != s);
            }
        }
        let mut points: Vec<Point> = WORKLOADS
            .iter()
            .map(|w| Point {
                workload: w.name.into(),
                bs: w.bs,
                qd: w.qd,
                bulkhead: Figures::default(),
                nbdkit: Figures::default(),
                qemu_nbd: Figures::default(),
            })
            .collect();
        for r in 0..opts.rounds {
            let mut order = systems.clone();
            order.rotate_left(r % systems.len());
            for &system in &order {
                progress(&format!("round {}/{}: {system:?}", r + 1, opts.rounds));
                let server = match Server::start(system, opts.backing, exe, &dir).and_then(|s| fill(&s.uri()).map(|()| s)) {
                    Ok(s) => s,
                    Err(e) => {
                        report.failures.push(format!("round {}, {system:?}: {e}", r + 1));
                        continue;
                    }
                };
                let pids = [server.child.id(), server.domain()];
                for (i, w) in WORKLOADS.iter().enumerate() {
                    let c0 = pids.map(cpu_seconds);
                    match fio(&server.uri(), w, opts.seconds, &format!("{system:?} {}", w.name)) {
                        Ok(s) => {
                            let c1 = pids.map(cpu_seconds);
                            let per = |cpu: f64| cpu / (s.requests / 100_000.0).max(1e-9);
                            let f = match system {
                                System::Bulkhead => &mut points[i].bulkhead,
                                System::Nbdkit => &mut points[i].nbdkit,
                                System::QemuNbd => &mut points[i].qemu_nbd,
                            };
                            f.iops.push(s.iops);
                            f.p50_us.push(s.p50_us);
                            f.p99_us.push(s.p99_us);
                            let cpu = &mut f.cpu_per_100k;
                            cpu.load.push(per(s.fio_cpu));
                            // pids[1] is 0 (and counts nothing) for a server without domains.
                            cpu.server.push(per(c1[0] - c0[0] + c1[1] - c0[1]));
                            if system == System::Bulkhead {
                                cpu.serve.push(per(c1[0] - c0[0]));
                                cpu.domain.push(per(c1[1] - c0[1]));
                            }
                        }
                        Err(e) => report.failures.push(format!("round {}, {system:?}, {}: {e}", r + 1, w.name)),
                    }
                }
            }
        }
        report.points = points;
        Ok(report)
    })();
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_file(&shm);
    result
}

/// Renders the report: throughput and latency, CPU per request by process, and the goals.
pub fn render(r: &Report) -> String {
    let mut t = Table::new(&["point", "bulkhead", "nbdkit", "qemu-nbd", "bulkhead / nbdkit", "QD1 p50|p99 µs b|n|q"]);
    let ratio = |a: f64, b: f64| if a > 0.0 && b > 0.0 { format!("{:.2}", a / b) } else { "-".into() };
    for p in &r.points {
        let (b, n, q) = (median(&p.bulkhead.iops), median(&p.nbdkit.iops), median(&p.qemu_nbd.iops));
        let unit = |v: f64| {
            if v <= 0.0 {
                "-".into()
            } else if p.bs >= 1 << 20 {
                format!("{:.0} MiB/s", v * f64::from(p.bs) / 1048576.0)
            } else {
                format!("{v:.0}")
            }
        };
        let lat = |f: &Figures| format!("{:.1}|{:.1}", median(&f.p50_us), median(&f.p99_us));
        let lats = if p.qd == 1 { format!("{} {} {}", lat(&p.bulkhead), lat(&p.nbdkit), lat(&p.qemu_nbd)) } else { "-".into() };
        t.row(vec![p.workload.clone(), unit(b), unit(n), unit(q), ratio(b, n), lats]);
    }
    let backing = match r.backing {
        Backing::Ram => "from RAM",
        Backing::File => "from a file",
    };
    let mut out = format!("medians of {} alternated rounds, {backing}; IOPS (MiB/s for 1M)\n{}", r.rounds, t.render());
    let mut c = Table::new(&["CPU s/100k", "bulkhead: serve|domain|fio", "nbdkit: server|fio", "qemu-nbd: server|fio"]);
    let m = |v: &[f64]| if v.is_empty() { "-".to_string() } else { format!("{:.2}", median(v)) };
    for p in &r.points {
        c.row(vec![
            p.workload.clone(),
            format!(
                "{}|{}|{}",
                m(&p.bulkhead.cpu_per_100k.serve),
                m(&p.bulkhead.cpu_per_100k.domain),
                m(&p.bulkhead.cpu_per_100k.load)
            ),
            format!("{}|{}", m(&p.nbdkit.cpu_per_100k.server), m(&p.nbdkit.cpu_per_100k.load)),
            format!("{}|{}", m(&p.qemu_nbd.cpu_per_100k.server), m(&p.qemu_nbd.cpu_per_100k.load)),
        ]);
    }
    out += &c.render();
    // The export's goal at 4 KiB QD16: serve and domain ≤ 0.67× nbdkit's CPU per request,
    // IOPS ≥ nbdkit's.
    for p in r.points.iter().filter(|p| p.qd == 16) {
        let (ours, theirs) = (median(&p.bulkhead.cpu_per_100k.server), median(&p.nbdkit.cpu_per_100k.server));
        let (b, n) = (median(&p.bulkhead.iops), median(&p.nbdkit.iops));
        if theirs > 0.0 && n > 0.0 {
            let met = ours <= 0.67 * theirs && b >= n;
            out += &format!(
                "{}: server CPU {:.2}× nbdkit's (goal ≤ 0.67), IOPS {:.2}× (goal ≥ 1): {}\n",
                p.workload,
                ours / theirs,
                b / n,
                if met { "met" } else { "not met" }
            );
        }
    }
    for s in &r.skipped {
        out += &format!("left out: {s}\n");
    }
    for f in &r.failures {
        out += &format!("failed: {f}\n");
    }
    out
}
