//! `bench share` over NBD, next to qemu-storage-daemon: the noisy-neighbour and cap runs with
//! fio's nbd engine against two exports of one 1 GiB file on a tmpfs, a view each in
//! `bulkhead serve` (capped with `bulkhead view qos` on the running view) and a `raw` node each in
//! qemu-storage-daemon (capped with a throttle group, the daemon started anew per setting).

use crate::BenchError;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use serde::Serialize;

use crate::fileio::{wait_for, which, Procs};

/// One noisy-neighbour phase of one system.
#[derive(Debug, Clone, Serialize)]
pub struct NbdRow {
    /// `bulkhead` or `qsd`.
    pub system: String,
    /// What ran.
    pub setting: String,
    /// Whether the row counts against the ≤ 1.5× goal: bulkhead's caps at the grain an NBD
    /// client wants ([`NBD_GRAIN_US`]) and qemu-storage-daemon's; bulkhead's caps at the
    /// library's 1 ms grain are reported beside them.
    pub goal: bool,
    /// The quiet QD1 reader's completion latency, µs (fio's clat).
    pub p50_us: f64,
    /// The same, 99th percentile.
    pub p99_us: f64,
    /// The same, 99.9th percentile.
    pub p999_us: f64,
    /// The neighbour's throughput, MiB/s.
    pub noisy_mibs: f64,
    /// CPU seconds per 100k requests of both jobs together, by process: `serve` and its
    /// domain apart for bulkhead, qemu-storage-daemon as `server`, and fio.
    pub cpu_per_100k: crate::CpuPer100k,
}

/// What one fio run measured.
struct Measured {
    p50_us: f64,
    p99_us: f64,
    p999_us: f64,
    noisy_mibs: f64,
    cpu_per_100k: crate::CpuPer100k,
}

/// A cap measured on one system.
#[derive(Debug, Clone, Serialize)]
pub struct CapRow {
    /// `bulkhead` or `qsd`.
    pub system: String,
    /// The cap, MiB/s.
    pub cap_mibs: f64,
    /// Measured under QD8 64 KiB writes, MiB/s.
    pub measured_mibs: f64,
}

/// What the NBD part measured, and what it skipped.
#[derive(Debug, Clone, Default, Serialize)]
pub struct NbdReport {
    /// Noisy-neighbour phases.
    pub rows: Vec<NbdRow>,
    /// Caps.
    pub caps: Vec<CapRow>,
    /// Systems or parts skipped, and why.
    pub skipped: Vec<String>,
}

const HALF: u64 = 512 << 20;

/// A scratch directory on a tmpfs, removed when dropped.
struct Scratch(PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// `bulkhead serve` with the views `quiet` and `noisy` of a file in `dir`: its process, its
/// NBD socket and its control socket.
fn bulkhead(exe: &Path, dir: &Path, mode: &str) -> Result<(Procs, PathBuf, PathBuf), BenchError> {
    let img = dir.join("bulkhead.img");
    let config = format!(
        "[fuse]\nenabled = false\n[[device]]\nname = \"share\"\nqueues = 1\nnotify = \"{mode}\"\n\
         [device.backend]\ntype = \"file\"\npath = \"{}\"\n\
         [[device.view]]\nname = \"quiet\"\nsize = \"512M\"\n\
         [[device.view]]\nname = \"noisy\"\noffset = \"512M\"\nsize = \"512M\"\n",
        img.display()
    );
    let path = dir.join("bulkhead.toml");
    std::fs::write(&path, config).map_err(|e| e.to_string())?;
    let run = dir.join("run");
    let log = std::fs::File::create(dir.join("bulkhead.log")).map_err(|e| e.to_string())?;
    let mut child = Command::new(exe)
        .arg("serve")
        .arg("--config")
        .arg(&path)
        .arg("--run-dir")
        .arg(&run)
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .map_err(|e| format!("bulkhead serve: {e}"))?;
    let sock = run.join("nbd.sock");
    let up = wait_for(&sock, "bulkhead", Some(&mut child));
    let procs = Procs(vec![child]);
    up.map_err(|e| format!("{e}; its log: {}", std::fs::read_to_string(dir.join("bulkhead.log")).unwrap_or_default()))?;
    Ok((procs, sock, run.join("control.sock")))
}

/// qemu-storage-daemon with the neighbour behind a throttle group of `cap` bytes per second
/// (none: no throttle).
fn qsd(dir: &Path, cap: Option<u64>) -> Result<(Procs, PathBuf), BenchError> {
    let img = dir.join("qsd.img");
    let sock = dir.join("qsd.sock");
    let _ = std::fs::remove_file(&sock);
    let mut a: Vec<String> = Vec::new();
    let mut arg = |k: &str, v: String| a.extend([k.to_string(), v]);
    arg("--blockdev", format!("driver=file,node-name=f,filename={},cache.direct=off", img.display()));
    arg("--blockdev", format!("driver=raw,node-name=quiet,file=f,offset=0,size={HALF}"));
    match cap {
        Some(bps) => {
            arg("--object", format!("throttle-group,id=tg0,x-bps-total={bps}"));
            arg("--blockdev", format!("driver=raw,node-name=noisy0,file=f,offset={HALF},size={HALF}"));
            arg("--blockdev", "driver=throttle,node-name=noisy,throttle-group=tg0,file=noisy0".into());
        }
        None => arg("--blockdev", format!("driver=raw,node-name=noisy,file=f,offset={HALF},size={HALF}")),
    }
    arg("--nbd-server", format!("addr.type=unix,addr.path={}", sock.display()));
    arg("--export", "type=nbd,id=e0,node-name=quiet,name=quiet,writable=on".into());
    arg("--export", "type=nbd,id=e1,node-name=noisy,name=noisy,writable=on".into());
    let log = std::fs::File::create(dir.join("qsd.log")).map_err(|e| e.to_string())?;
    let mut child = Command::new("qemu-storage-daemon")
        .args(&a)
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .map_err(|e| format!("qemu-storage-daemon: {e}"))?;
    let up = wait_for(&sock, "qemu-storage-daemon", Some(&mut child));
    let procs = Procs(vec![child]);
    up.map_err(|e| format!("{e}; its log: {}", std::fs::read_to_string(dir.join("qsd.log")).unwrap_or_default()))?;
    Ok((procs, sock))
}

/// Sets the neighbour's cap on a running bulkhead (`None` lifts it).
fn bulkhead_cap(control: &Path, credit: Option<(&str, &str)>) -> Result<(), BenchError> {
    let set = match credit {
        Some((bytes, us)) => vec![("credit_bytes", bytes), ("credit_us", us)],
        None => vec![("credit_bytes", "none")],
    };
    let set = set.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    bulkhead_control::Client::connect_socket(control)
        .and_then(|mut c| c.call(bulkhead_control::SetQos { view: "noisy".into(), set }))
        .map(drop)
        .map_err(|e| BenchError::from(format!("control socket: {e}")))
}

/// One fio run: the quiet reader, and with `noisy` the neighbour beside it, against the server
/// whose process is `server`; with `domains`, its descendants are counted apart (bulkhead's
/// domains).
fn fio(sock: &Path, seconds: f64, noisy: bool, server: &Procs, domains: bool) -> Result<Measured, BenchError> {
    let pids = server.pids();
    let root = pids.first().copied().unwrap_or(0);
    let sample =
        || (crate::fileio::tree_jiffies(&pids) as f64 / bulkhead_sys::clock_ticks_per_second() as f64, crate::cpu_seconds(root));
    let c0 = sample();
    let uri = |e: &str| format!("--uri=nbd+unix:///{e}?socket={}", sock.display());
    let mut cmd = Command::new("timeout");
    cmd.args(["--kill-after=10", &format!("{}", seconds as u64 + 60), "fio", "--ioengine=nbd", "--time_based"])
        .args([&format!("--runtime={}", seconds.ceil() as u64), "--randrepeat=0", "--output-format=json"])
        .args(["--percentile_list=50:99:99.9", "--name=quiet", &uri("quiet"), "--rw=randread", "--bs=4k", "--iodepth=1"]);
    if noisy {
        cmd.args(["--name=noisy", &uri("noisy"), "--rw=randwrite", "--bs=4k", "--iodepth=32"]);
    }
    let out = cmd.output().map_err(|e| format!("fio: {e}"))?;
    let c1 = sample();
    if !out.status.success() {
        return Err(BenchError::Run(format!("fio: {}", String::from_utf8_lossy(&out.stderr).trim())));
    }
    let v = crate::fio_report(&out.stdout, "bench share over NBD")?;
    let jobs = v["jobs"].as_array().ok_or("fio: no jobs")?;
    let q = jobs.iter().find(|j| j["jobname"] == "quiet").ok_or("fio: no quiet job")?;
    let p = |k: &str| q["read"]["clat_ns"]["percentile"][k].as_f64().unwrap_or(0.0) / 1000.0;
    let noisy_mibs =
        jobs.iter().find(|j| j["jobname"] == "noisy").map_or(0.0, |j| j["write"]["bw"].as_f64().unwrap_or(0.0) / 1024.0);
    let ios: f64 = jobs
        .iter()
        .map(|j| j["read"]["total_ios"].as_f64().unwrap_or(0.0) + j["write"]["total_ios"].as_f64().unwrap_or(0.0))
        .sum();
    let per = |c: f64| vec![c / (ios.max(1.0) / 100_000.0)];
    let (tree, serve) = (c1.0 - c0.0, c1.1 - c0.1);
    let load: f64 = jobs.iter().map(crate::fio_job_cpu_seconds).sum();
    let mut cpu_per_100k = crate::CpuPer100k { server: per(tree), load: per(load), ..Default::default() };
    if domains {
        cpu_per_100k.serve = per(serve);
        cpu_per_100k.domain = per(tree - serve);
    }
    Ok(Measured { p50_us: p("50.000000"), p99_us: p("99.000000"), p999_us: p("99.900000"), noisy_mibs, cpu_per_100k })
}

/// QD8 64 KiB writes on the neighbour for `seconds`: MiB/s.
fn capped(sock: &Path, seconds: f64) -> Result<f64, BenchError> {
    let out = Command::new("timeout")
        .args(["--kill-after=10", &format!("{}", seconds as u64 + 60), "fio", "--ioengine=nbd", "--time_based"])
        .args([&format!("--runtime={}", seconds.ceil() as u64), "--randrepeat=0", "--output-format=json", "--name=cap"])
        .arg(format!("--uri=nbd+unix:///noisy?socket={}", sock.display()))
        .args(["--rw=randwrite", "--bs=64k", "--iodepth=8"])
        .output()
        .map_err(|e| format!("fio: {e}"))?;
    if !out.status.success() {
        return Err(BenchError::Run(format!("fio: {}", String::from_utf8_lossy(&out.stderr).trim())));
    }
    let v = crate::fio_report(&out.stdout, "bench share cap over NBD")?;
    Ok(v["jobs"][0]["write"]["bw"].as_f64().unwrap_or(0.0) / 1024.0)
}

/// The credit period of bulkhead's caps over NBD, µs. A grant's answers leave the domain
/// together, and over NBD each then costs a reply, a client's next request and a read of it,
/// on threads that share the two CPUs with the quiet reader: a 1 ms grant of a 32 MiB/s cap
/// is eight 4 KiB answers at once, and the reader's p99 was 1.1–3.0× alone with it, 0.6–1.8×
/// with a quarter of the grant four times as often (three runs). Through the library the
/// answers cost nearly nothing and each wake-up of the neighbour a lot, so the library's rows
/// keep 1 ms (docs/sharing.md, "Choosing the grain").
pub const NBD_GRAIN_US: u64 = 250;

/// The library's credit period, µs, also run over NBD for comparison.
const LIBRARY_GRAIN_US: u64 = 1000;

/// The 50 MiB/s cap of the cap-accuracy run, as bulkhead's credits and as a byte rate.
const CAP_CREDIT: (&str, &str) = ("512K", "10000");
const CAP_BPS: u64 = 50 << 20;

/// Runs both systems; `caps` are the neighbour's caps (bytes per second) in turn.
pub fn run(
    exe: &Path,
    mode: &str,
    seconds: f64,
    cap_seconds: f64,
    caps: &[u64],
    mut progress: impl FnMut(&str),
) -> Result<NbdReport, BenchError> {
    let mut r = NbdReport::default();
    if !which("fio") {
        r.skipped.push("over NBD: fio is not installed".into());
        return Ok(r);
    }
    let dir = Scratch(PathBuf::from(format!("/dev/shm/bench-share-{}", std::process::id())));
    std::fs::create_dir_all(&dir.0).map_err(|e| e.to_string())?;
    let row = |system: &str, setting: String, goal: bool, m: Measured| NbdRow {
        system: system.into(),
        setting,
        goal,
        p50_us: m.p50_us,
        p99_us: m.p99_us,
        p999_us: m.p999_us,
        noisy_mibs: m.noisy_mibs,
        cpu_per_100k: m.cpu_per_100k,
    };
    progress("over NBD: bulkhead");
    // Written once through, so neither system measures a file's first touches.
    let fill = |name: &str| {
        let of = format!("of={}", dir.0.join(name).display());
        crate::fileio::run("dd", &["if=/dev/zero", &of, "bs=1M", "count=1024", "conv=notrunc"])
    };
    fill("bulkhead.img")?;
    let (server, sock, control) = bulkhead(exe, &dir.0, mode)?;
    r.rows.push(row("bulkhead", "alone".into(), false, fio(&sock, seconds, false, &server, true)?));
    r.rows.push(row("bulkhead", "neighbour, no QoS".into(), false, fio(&sock, seconds, true, &server, true)?));
    for &c in caps {
        for grain in [NBD_GRAIN_US, LIBRARY_GRAIN_US] {
            let credit = (c * grain / 1_000_000).max(1).to_string();
            bulkhead_cap(&control, Some((&credit, &grain.to_string())))?;
            let setting = format!("neighbour capped at {} MiB/s, {grain} µs grants", c >> 20);
            r.rows.push(row("bulkhead", setting, grain == NBD_GRAIN_US, fio(&sock, seconds, true, &server, true)?));
        }
    }
    bulkhead_cap(&control, Some(CAP_CREDIT))?;
    r.caps.push(CapRow { system: "bulkhead".into(), cap_mibs: 50.0, measured_mibs: capped(&sock, cap_seconds)? });
    drop(server);
    if !which("qemu-storage-daemon") {
        r.skipped.push("qsd: qemu-storage-daemon is not installed (apt-get install qemu-system-common)".into());
        return Ok(r);
    }
    progress("over NBD: qemu-storage-daemon");
    fill("qsd.img")?;
    let (s, sock) = qsd(&dir.0, None)?;
    r.rows.push(row("qsd", "alone".into(), false, fio(&sock, seconds, false, &s, false)?));
    r.rows.push(row("qsd", "neighbour, no QoS".into(), false, fio(&sock, seconds, true, &s, false)?));
    drop(s);
    for &c in caps {
        let (s, sock) = qsd(&dir.0, Some(c))?;
        r.rows.push(row("qsd", format!("neighbour capped at {} MiB/s", c >> 20), true, fio(&sock, seconds, true, &s, false)?));
        drop(s);
    }
    let (s, sock) = qsd(&dir.0, Some(CAP_BPS))?;
    r.caps.push(CapRow { system: "qsd".into(), cap_mibs: 50.0, measured_mibs: capped(&sock, cap_seconds)? });
    drop(s);
    Ok(r)
}
