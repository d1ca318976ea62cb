//! `bulkhead-bench rbd`: the `rbd` backend against fio's own rbd engine (librbd in the
//! benchmark process: the floor of what a client can get) and qemu-storage-daemon's rbd
//! driver, on the same image of a throwaway single-node cluster (`scripts/ceph-dev.sh`, in a
//! network namespace of its own), and the outage of a killed rbd domain with and without the
//! lock break.
//!
//! bulkhead is driven by its own fio engine (`libbulkhead_fio.so`: fio attached to the device,
//! a queue over shared memory, no export protocol) and, as qemu-storage-daemon is, by fio's
//! nbd engine over a unix socket. All of them run librbd with its cache off (qemu-storage-daemon with `cache.direct=on`, fio with
//! `CEPH_ARGS=--rbd_cache=false`): with it on, writes are acknowledged before they are stored. CPU is that of
//! the process holding librbd and what serves it: `serve` and its domains, qemu-storage-daemon,
//! or the fio process of the rbd engine (fio's own work included); the fio job's own CPU (the
//! load generator, with the engine's library), `serve`'s and the domain's are also given apart.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::median;
use crate::{cpu_seconds, BenchError, CpuPer100k, Table};

/// Options.
#[derive(Debug, Clone)]
pub struct Options {
    /// Alternated rounds.
    pub rounds: usize,
    /// Seconds per point.
    pub seconds: u64,
    /// Kills with the lock break (without it each costs ~30 s: a third as many).
    pub kills: usize,
    /// qemu-storage-daemon to compare with (skipped if it has no rbd driver).
    pub qsd: PathBuf,
    /// Image size in MiB.
    pub image_mib: u64,
    /// bulkhead's fio engine (see [`crate::fio::find_engine`]).
    pub engine: Option<PathBuf>,
}

/// The systems compared.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum System {
    /// bulkhead's rbd backend, over NBD.
    Bulkhead,
    /// bulkhead's rbd backend, through bulkhead's fio engine.
    Engine,
    /// The same with `sandbox = "off"`: the rbd domain in the host's network namespace,
    /// connecting for itself, no seccomp filter (what the broker and the filters cost).
    Unconfined,
    /// fio's rbd engine.
    FioRbd,
    /// qemu-storage-daemon's rbd driver, over NBD.
    Qsd,
}

const SYSTEMS: [System; 5] = [System::Engine, System::Bulkhead, System::FioRbd, System::Qsd, System::Unconfined];

use crate::FioPoint as Workload;

const WORKLOADS: [Workload; 6] = [
    Workload { name: "4k randread qd1", rw: "randread", bs: 4096, qd: 1 },
    Workload { name: "4k randread qd32", rw: "randread", bs: 4096, qd: 32 },
    Workload { name: "4k randwrite qd1", rw: "randwrite", bs: 4096, qd: 1 },
    Workload { name: "4k randwrite qd32", rw: "randwrite", bs: 4096, qd: 32 },
    Workload { name: "1m read qd4", rw: "read", bs: 1 << 20, qd: 4 },
    Workload { name: "1m write qd4", rw: "write", bs: 1 << 20, qd: 4 },
];

/// One system's rounds at one point.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Figures {
    /// IOPS of each round.
    pub iops: Vec<f64>,
    /// CPU per 100k requests of each round; the server is what holds librbd and serves it
    /// (for fio's rbd engine, fio's whole process).
    pub cpu_per_100k: CpuPer100k,
}

/// One point.
#[derive(Debug, Clone, Serialize)]
pub struct Point {
    /// Workload.
    pub workload: String,
    /// Block size.
    pub bs: u32,
    /// bulkhead through its fio engine.
    pub engine: Figures,
    /// bulkhead over NBD.
    pub bulkhead: Figures,
    /// bulkhead with its sandbox off.
    pub unconfined: Figures,
    /// fio's rbd engine.
    pub fio_rbd: Figures,
    /// qemu-storage-daemon (empty when it has no rbd driver).
    pub qsd: Figures,
}

/// Outages of killed rbd domains.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Outages {
    /// Kills measured.
    pub kills: usize,
    /// Each outage, ms (from the death noticed to the first request answered after it).
    pub ms: Vec<f64>,
    /// Median, ms.
    pub p50_ms: f64,
    /// 99th percentile, ms.
    pub p99_ms: f64,
}

/// Results.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Report {
    /// Rounds.
    pub rounds: usize,
    /// Points.
    pub points: Vec<Point>,
    /// Kills with the lock break.
    pub lock_break: Outages,
    /// Kills without it.
    pub no_lock_break: Outages,
    /// Why qemu-storage-daemon was left out, if it was.
    pub qsd_skipped: Option<String>,
    /// Why bulkhead's fio engine was left out, if it was.
    pub engine_skipped: Option<String>,
    /// Runs that failed, and why; their figures are left out.
    pub failures: Vec<String>,
}

/// The cluster, up for the benchmark's life.
struct Cluster {
    dir: PathBuf,
    netns: String,
}

impl Cluster {
    fn up() -> Result<Cluster, BenchError> {
        let script = script()?;
        let c = Cluster {
            dir: std::env::temp_dir().join(format!("bulkhead-bench-rbd-{}", std::process::id())),
            netns: format!("bh-bench-rbd-{}", std::process::id()),
        };
        let out = Command::new(&script)
            .args(["up", "--dir"])
            .arg(&c.dir)
            .args(["--netns", &c.netns])
            .output()
            .map_err(|e| BenchError::io(&script, e))?;
        if !out.status.success() {
            return Err(BenchError::Run(format!("the cluster did not start: {}", String::from_utf8_lossy(&out.stderr).trim())));
        }
        Ok(c)
    }

    fn conf(&self) -> PathBuf {
        self.dir.join("ceph.conf")
    }

    fn rbd(&self, args: &[&str]) -> Result<(), BenchError> {
        let out = Command::new("rbd").arg("-c").arg(self.conf()).args(args).output().map_err(|e| format!("rbd: {e}"))?;
        if !out.status.success() {
            return Err(BenchError::Run(format!("rbd {args:?}: {}", String::from_utf8_lossy(&out.stderr).trim())));
        }
        Ok(())
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if let Ok(s) = script() {
            let _ = Command::new(s).args(["down", "--dir"]).arg(&self.dir).output();
        }
    }
}

/// `scripts/ceph-dev.sh`: the package's copy, or the source tree's.
fn script() -> Result<PathBuf, BenchError> {
    bulkhead_guest::script("ceph-dev.sh").map_err(|e| BenchError::Run(e.to_string()))
}

/// A server under test (bulkhead's `serve` or qemu-storage-daemon), serving `r` over NBD.
struct Server {
    system: System,
    child: Child,
    dir: PathBuf,
}

impl Server {
    fn start(system: System, opts: &Options, exe: &Path, cluster: &Cluster, backend_extra: &str) -> Result<Server, BenchError> {
        let qsd = &opts.qsd;
        let dir = std::env::temp_dir().join(format!("bulkhead-bench-rbd-srv-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).map_err(|e| BenchError::io(&dir, e))?;
        let log = dir.join("server.log");
        let err = std::fs::File::create(&log).map_err(|e| BenchError::io(&log, e))?;
        let mut cmd = match system {
            System::Bulkhead | System::Unconfined | System::Engine => {
                let sandbox = if system == System::Unconfined { "sandbox = \"off\"\n" } else { "" };
                let cfg = format!(
                    "[fuse]\nenabled = false\n[[device]]\nname = \"r\"\nsize = \"{}M\"\nrestart_limit = 100000\n{sandbox}\
                     [device.backend]\ntype = \"rbd\"\nmon_host = \"127.0.0.1:3300\"\npool = \"rbd\"\nimage = \"img\"\n\
                     key_file = \"{}\"\n{backend_extra}",
                    opts.image_mib,
                    cluster.dir.join("client.admin.key").display()
                );
                let path = dir.join("rbd.toml");
                std::fs::write(&path, cfg).map_err(|e| BenchError::io(&path, e))?;
                let mut c = Command::new(exe);
                c.arg("serve").arg("--config").arg(&path).arg("--run-dir").arg(dir.join("run"));
                c
            }
            System::Qsd => {
                let mut c = Command::new(qsd);
                c.arg("--blockdev")
                    .arg(format!(
                        "driver=rbd,node-name=disk,pool=rbd,image=img,conf={},user=admin,cache.direct=on",
                        cluster.conf().display()
                    ))
                    .arg("--nbd-server")
                    .arg(format!("addr.type=unix,addr.path={}", dir.join("run/nbd.sock").display()))
                    .arg("--export")
                    .arg("type=nbd,id=e,node-name=disk,name=r,writable=on");
                std::fs::create_dir_all(dir.join("run")).map_err(|e| BenchError::io(&dir, e))?;
                c
            }
            System::FioRbd => return Err("fio's rbd engine needs no server".into()),
        };
        let child = cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(err).spawn().map_err(|e| BenchError::io(exe, e))?;
        let s = Server { system, child, dir };
        let deadline = Instant::now() + Duration::from_secs(30);
        while !s.dir.join("run/nbd.sock").exists() {
            if Instant::now() > deadline {
                return Err(BenchError::Run(format!("{system:?} did not start: {}", s.log_tail())));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(s)
    }

    fn uri(&self) -> String {
        format!("nbd+unix:///r?socket={}", self.dir.join("run/nbd.sock").display())
    }

    fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(self.dir.join("server.log")).unwrap_or_default();
        text.lines().rev().take(10).collect::<Vec<_>>().into_iter().rev().collect::<Vec<_>>().join(" | ")
    }

    /// The device's status (`None` while `serve` does not answer).
    fn device(&self) -> Option<bulkhead_control::DeviceStatus> {
        crate::serve_status(&self.dir.join("run/control.sock")).and_then(|r| r.devices.into_iter().next())
    }

    /// The server and, for bulkhead, its domains.
    fn pids(&self) -> Vec<u32> {
        let mut pids = vec![self.child.id()];
        if matches!(self.system, System::Bulkhead | System::Unconfined | System::Engine) {
            pids.extend(self.device().map(|d| d.driver_pid).filter(|&p| p != 0));
        }
        pids
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        crate::stop_child(&mut self.child, Duration::from_secs(20));
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// fio's arguments for `w` against `target`.
fn fio_args(w: &Workload, seconds: u64) -> Vec<String> {
    vec![
        "--name=p".into(),
        format!("--rw={}", w.rw),
        format!("--bs={}", w.bs),
        format!("--iodepth={}", w.qd),
        "--time_based".into(),
        format!("--runtime={seconds}"),
        "--randrepeat=0".into(),
        "--output-format=json".into(),
    ]
}

/// What one run of a point gives.
struct Sample {
    iops: f64,
    /// CPU seconds of what holds librbd and serves it.
    server_cpu: f64,
    /// CPU seconds of the fio job, as fio counts them.
    fio_cpu: f64,
    /// CPU seconds of `serve` and of the domain (bulkhead only).
    serve_cpu: f64,
    domain_cpu: f64,
}

/// Runs `w` on `system`.
fn point(
    system: System,
    server: Option<&Server>,
    cluster: &Cluster,
    engine: Option<&Path>,
    w: &Workload,
    seconds: u64,
) -> Result<Sample, BenchError> {
    let mut cmd = Command::new("timeout");
    cmd.args(["--kill-after=10", &(seconds + 90).to_string(), "fio"]).args(fio_args(w, seconds));
    match (system, server) {
        (System::FioRbd, _) => {
            // librbd's cache is on by default, acknowledging writes before the OSDs hold them:
            // off, as in bulkhead and qemu-storage-daemon.
            cmd.args(["--ioengine=rbd", "--clientname=admin", "--pool=rbd", "--rbdname=img"])
                .env("CEPH_CONF", cluster.conf())
                .env("CEPH_ARGS", "--rbd_cache=false");
        }
        (System::Engine, Some(s)) => {
            let engine = engine.ok_or("no fio engine")?;
            cmd.arg(format!("--ioengine=external:{}", engine.display()))
                .arg(format!("--run_dir={}", s.dir.join("run").display()))
                .arg("--filename=r");
        }
        (_, Some(s)) => {
            cmd.arg("--ioengine=nbd").arg(format!("--uri={}", s.uri()));
        }
        (_, None) => return Err("a server is needed".into()),
    }
    let pids = server.map(Server::pids).unwrap_or_default();
    let c0: Vec<f64> = pids.iter().map(|&p| cpu_seconds(p)).collect();
    let child = cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().map_err(|e| format!("fio: {e}"))?;
    // The rbd engine's librbd runs in fio itself (its job, a process of its own): its CPU is
    // read just before it exits.
    let fio_pid = child.id();
    let mut fio_tree_cpu = 0.0;
    let out = {
        let waiter = std::thread::spawn(move || child.wait_with_output());
        while !waiter.is_finished() {
            fio_tree_cpu = descendants_cpu(fio_pid).max(fio_tree_cpu);
            std::thread::sleep(Duration::from_millis(100));
        }
        waiter.join().map_err(|_| "fio waiter")?.map_err(|e| format!("fio: {e}"))?
    };
    let c1: Vec<f64> = pids.iter().map(|&p| cpu_seconds(p)).collect();
    if !out.status.success() {
        return Err(BenchError::Run(format!("fio: {}", String::from_utf8_lossy(&out.stderr).trim())));
    }
    let v = crate::fio_report(&out.stdout, &format!("{system:?} {}", w.name))?;
    let j = &v["jobs"][0];
    let iops = j["read"]["iops"].as_f64().unwrap_or(0.0) + j["write"]["iops"].as_f64().unwrap_or(0.0);
    let fio_cpu = crate::fio_job_cpu_seconds(j);
    let delta = |i: usize| c1.get(i).zip(c0.get(i)).map_or(0.0, |(a, b)| a - b);
    let server_cpu = if system == System::FioRbd { fio_tree_cpu } else { c1.iter().sum::<f64>() - c0.iter().sum::<f64>() };
    Ok(Sample { iops, server_cpu, fio_cpu, serve_cpu: delta(0), domain_cpu: delta(1) })
}

/// CPU seconds of `pid` and all its descendants (`timeout` runs fio, which forks its jobs).
fn descendants_cpu(pid: u32) -> f64 {
    let mut parent_of = Vec::new();
    if let Ok(d) = std::fs::read_dir("/proc") {
        for e in d.flatten() {
            let Some(p) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else { continue };
            let stat = std::fs::read_to_string(format!("/proc/{p}/stat")).unwrap_or_default();
            if let Some(pp) = stat.rfind(')').and_then(|i| stat[i + 2..].split_whitespace().nth(1)?.parse::<u32>().ok()) {
                parent_of.push((p, pp));
            }
        }
    }
    let mut tree = vec![pid];
    let mut i = 0;
    while i < tree.len() {
        let at = tree[i];
        tree.extend(parent_of.iter().filter(|&&(_, pp)| pp == at).map(|&(p, _)| p));
        i += 1;
    }
    tree.iter().map(|&p| cpu_seconds(p)).sum()
}

/// Whether qemu-storage-daemon here has the rbd driver (`qemu-block-extra`): a driver it
/// lacks is refused by name before anything is opened.
fn qsd_has_rbd(qsd: &Path) -> Result<(), String> {
    let out = Command::new("timeout")
        .arg("10")
        .arg(qsd)
        .args(["--blockdev", "driver=rbd,node-name=probe,pool=p,image=i,conf=/nonexistent"])
        .output()
        .map_err(|e| format!("{}: {e}", qsd.display()))?;
    let text = String::from_utf8_lossy(&out.stderr);
    if text.contains("does not accept value 'rbd'") || text.contains("Unknown driver") {
        Err(format!("{} has no rbd driver (install qemu-block-extra)", qsd.display()))
    } else {
        Ok(())
    }
}

/// Kills the rbd domain `kills` times under a QD1 writer; each outage as `serve` measured it.
fn outages(exe: &Path, opts: &Options, cluster: &Cluster, kills: usize, lock_break: bool) -> Result<Outages, BenchError> {
    let server = Server::start(System::Bulkhead, opts, exe, cluster, &format!("lock_break = {lock_break}\n"))?;
    let w = Workload { name: "writer", rw: "randwrite", bs: 4096, qd: 1 };
    let seconds = 3600;
    let mut writer = Command::new("fio")
        .args(fio_args(&w, seconds))
        .arg("--ioengine=nbd")
        .arg(format!("--uri={}", server.uri()))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("fio: {e}"))?;
    let mut ms = Vec::new();
    let result = (|| -> Result<(), BenchError> {
        std::thread::sleep(Duration::from_secs(1));
        for k in 0..kills {
            let (pid, restarts) = server.device().map_or((0, 0), |d| (d.driver_pid, d.restarts));
            if pid == 0 {
                return Err(BenchError::Run(format!("no driver domain: {}", server.log_tail())));
            }
            bulkhead_sys::signal(pid, libc::SIGKILL).map_err(|e| format!("kill {pid}: {e}"))?;
            // Until the next generation has answered a request: its outage is then known.
            let deadline = Instant::now() + Duration::from_secs(120);
            loop {
                std::thread::sleep(Duration::from_millis(20));
                let settled = server.device().filter(|d| d.restarts > restarts && !d.restarting);
                if let Some(last) = settled.and_then(|d| d.last_outage_ms) {
                    if ms.len() == k && (k == 0 || Some(&last) != ms.last()) {
                        ms.push(last);
                        break;
                    }
                }
                if Instant::now() > deadline {
                    return Err(BenchError::Run(format!("kill {}: no request answered within 120 s", k + 1)));
                }
            }
            std::thread::sleep(Duration::from_millis(300));
        }
        Ok(())
    })();
    let _ = writer.kill();
    let _ = writer.wait();
    result?;
    Ok(Outages { kills: ms.len(), p50_ms: crate::percentile(&ms, 0.5), p99_ms: crate::percentile(&ms, 0.99), ms })
}

/// Runs the benchmark.
pub fn run(exe: &Path, opts: &Options, mut progress: impl FnMut(&str)) -> Result<Report, BenchError> {
    if !(1..=50).contains(&opts.rounds) || !(1..=600).contains(&opts.seconds) || opts.kills > 1000 {
        return Err(BenchError::Options("rounds 1..=50, seconds 1..=600, kills 0..=1000".into()));
    }
    progress("starting a single-node cluster");
    let cluster = Cluster::up()?;
    // Everything from here runs in the cluster's network namespace: serve, qsd and fio.
    bulkhead_sys::enter_netns(&PathBuf::from(format!("/run/netns/{}", cluster.netns)))
        .map_err(|e| format!("entering the cluster's network namespace: {e}"))?;
    cluster.rbd(&["create", "--size", &format!("{}M", opts.image_mib), "rbd/img"])?;
    // Written whole first, so that reads find objects.
    progress("filling the image");
    let fill = Command::new("rbd")
        .arg("-c")
        .arg(cluster.conf())
        .args(["bench", "--io-type", "write", "--io-size", "4M", "--io-pattern", "seq", "--io-total"])
        .arg(format!("{}M", opts.image_mib))
        .arg("rbd/img")
        .output()
        .map_err(|e| format!("rbd bench: {e}"))?;
    if !fill.status.success() {
        return Err(BenchError::Run(format!("rbd bench: {}", String::from_utf8_lossy(&fill.stderr).trim())));
    }
    let mut report = Report { rounds: opts.rounds, ..Default::default() };
    let mut systems = SYSTEMS.to_vec();
    if let Err(why) = qsd_has_rbd(&opts.qsd) {
        report.qsd_skipped = Some(why);
        systems.retain(|&s| s != System::Qsd);
    }
    let engine = match crate::fio::find_engine(opts.engine.as_deref()) {
        Ok(e) => Some(e),
        Err(why) => {
            report.engine_skipped = Some(why.to_string());
            systems.retain(|&s| s != System::Engine);
            None
        }
    };
    let mut points: Vec<Point> = WORKLOADS
        .iter()
        .map(|w| Point {
            workload: w.name.into(),
            bs: w.bs,
            engine: Figures::default(),
            bulkhead: Figures::default(),
            unconfined: Figures::default(),
            fio_rbd: Figures::default(),
            qsd: Figures::default(),
        })
        .collect();
    for r in 0..opts.rounds {
        let mut order = systems.clone();
        order.rotate_left(r % systems.len());
        for &system in &order {
            progress(&format!("round {}/{}: {system:?}", r + 1, opts.rounds));
            let server = match system {
                System::FioRbd => None,
                s => match Server::start(s, opts, exe, &cluster, "") {
                    Ok(srv) => Some(srv),
                    Err(e) => {
                        report.failures.push(format!("round {}, {system:?}: {e}", r + 1));
                        continue;
                    }
                },
            };
            for (i, w) in WORKLOADS.iter().enumerate() {
                match point(system, server.as_ref(), &cluster, engine.as_deref(), w, opts.seconds) {
                    Ok(sample) => {
                        let f = match system {
                            System::Engine => &mut points[i].engine,
                            System::Bulkhead => &mut points[i].bulkhead,
                            System::Unconfined => &mut points[i].unconfined,
                            System::FioRbd => &mut points[i].fio_rbd,
                            System::Qsd => &mut points[i].qsd,
                        };
                        let per_100k = |cpu: f64| cpu / (sample.iops * opts.seconds as f64 / 100_000.0).max(1e-9);
                        f.iops.push(sample.iops);
                        let cpu = &mut f.cpu_per_100k;
                        cpu.server.push(per_100k(sample.server_cpu));
                        cpu.load.push(per_100k(sample.fio_cpu));
                        if server.is_some() && system != System::Qsd {
                            cpu.serve.push(per_100k(sample.serve_cpu));
                            cpu.domain.push(per_100k(sample.domain_cpu));
                        }
                    }
                    Err(e) => report.failures.push(format!("round {}, {system:?}, {}: {e}", r + 1, w.name)),
                }
            }
        }
    }
    report.points = points;
    if opts.kills > 0 {
        progress(&format!("{} kills with the lock break", opts.kills));
        match outages(exe, opts, &cluster, opts.kills, true) {
            Ok(o) => report.lock_break = o,
            Err(e) => report.failures.push(format!("kills with the lock break: {e}")),
        }
        let without = opts.kills.div_ceil(3).min(5);
        progress(&format!("{without} kills without it (each waits for the dead owner's lock)"));
        match outages(exe, opts, &cluster, without, false) {
            Ok(o) => report.no_lock_break = o,
            Err(e) => report.failures.push(format!("kills without the lock break: {e}")),
        }
    }
    Ok(report)
}

/// Renders the report as tables: throughput, then CPU per request by process.
pub fn render(r: &Report) -> String {
    let mut t = Table::new(&[
        "point",
        "engine",
        "nbd",
        "fio-rbd",
        "qsd",
        "engine / fio-rbd",
        "nbd / fio-rbd",
        "nbd / qsd",
        "nbd, sandbox off",
    ]);
    let ratio = |a: f64, b: f64| if a > 0.0 && b > 0.0 { format!("{:.2}", a / b) } else { "-".into() };
    for p in &r.points {
        let (e, b, f, q) = (median(&p.engine.iops), median(&p.bulkhead.iops), median(&p.fio_rbd.iops), median(&p.qsd.iops));
        let unit = |v: f64| {
            if v <= 0.0 {
                "-".into()
            } else if p.bs >= 1 << 20 {
                format!("{:.0} MiB/s", v * f64::from(p.bs) / 1048576.0)
            } else {
                format!("{v:.0}")
            }
        };
        t.row(vec![
            p.workload.clone(),
            unit(e),
            unit(b),
            unit(f),
            unit(q),
            ratio(e, f),
            ratio(b, f),
            ratio(b, q),
            unit(median(&p.unconfined.iops)),
        ]);
    }
    let mut out = format!("medians of {} alternated rounds; IOPS (MiB/s for 1M)\n{}", r.rounds, t.render());
    // CPU per 100k requests: what holds librbd and serves it (serve and domain, qsd, or the
    // rbd engine's fio), then the fio job alone and, for bulkhead, serve and the domain apart.
    let mut c =
        Table::new(&["CPU s/100k", "engine: total|fio|serve|domain", "nbd: total|fio|serve|domain", "fio-rbd", "qsd: total|fio"]);
    let m = |v: &[f64]| if v.is_empty() { "-".to_string() } else { format!("{:.2}", median(v)) };
    for p in &r.points {
        let four = |f: &Figures| {
            let c = &f.cpu_per_100k;
            format!("{}|{}|{}|{}", m(&c.server), m(&c.load), m(&c.serve), m(&c.domain))
        };
        c.row(vec![
            p.workload.clone(),
            four(&p.engine),
            four(&p.bulkhead),
            m(&p.fio_rbd.cpu_per_100k.server),
            format!("{}|{}", m(&p.qsd.cpu_per_100k.server), m(&p.qsd.cpu_per_100k.load)),
        ]);
    }
    out += &c.render();
    for (what, o) in [("with the lock break", &r.lock_break), ("without it", &r.no_lock_break)] {
        if o.kills > 0 {
            out +=
                &format!("rbd domain killed {} times {what}: outage p50 {:.1} ms, p99 {:.1} ms\n", o.kills, o.p50_ms, o.p99_ms);
        }
    }
    if let Some(why) = &r.qsd_skipped {
        out += &format!("qemu-storage-daemon left out: {why}\n");
    }
    if let Some(why) = &r.engine_skipped {
        out += &format!("bulkhead's fio engine left out: {why}\n");
    }
    for f in &r.failures {
        out += &format!("failed: {f}\n");
    }
    out
}
