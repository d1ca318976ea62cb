//! `bulkhead-bench images`: disk images, copy-on-write and encryption, next to
//! qemu-storage-daemon.
//!
//! Six devices, the same in both systems, each exported over NBD under the same name and
//! measured by fio's `nbd` engine (libnbd), so both systems are reached by the same path:
//!
//! - `raw`: an allocated raw file;
//! - `qcow2-full`: a qcow2 image preallocated with `falloc` (every cluster allocated);
//! - `qcow2-fresh`: an empty qcow2 image (first writes allocate; the jobs run in the order
//!   listed, so the write jobs after the first find part of it allocated);
//! - `cow`: a fresh copy-on-write overlay over an allocated raw file (bulkhead's `cow` filter;
//!   for qemu, a qcow2 image with that raw file as its backing file);
//! - `crypt`: a LUKS volume (made by `qemu-img create -f luks`) in a raw file;
//! - `crypt-qcow2`: the same volume inside a preallocated qcow2 image (bulkhead's `crypt`
//!   filter over its qcow2 backend; for qemu, its `luks` driver over its `qcow2` driver).
//!
//! Each system gets its own freshly made files, in a scratch directory (a tmpfs by default, so
//! the formats and the servers are measured, not a disk). Jobs: 4 KiB random writes and reads
//! and 1 MiB sequential writes and reads, at queue depths 1 and 16. The server's CPU time (all
//! its processes) is reported next to each figure. Alongside, the speed of AES-XTS on one core
//! as the `crypt` filter runs it.

use crate::BenchError;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use serde::Serialize;

use crate::fileio::{clock_ticks, run, tree_jiffies, wait_for, which, Procs};
pub use crate::tap::Goal;
use crate::Table;

/// The devices, in the order measured.
pub const DEVICES: [&str; 6] = ["raw", "qcow2-full", "qcow2-fresh", "cow", "crypt", "crypt-qcow2"];

/// The jobs: fio `rw`, block size, queue depth.
pub const JOBS: [(&str, &str, u32); 8] = [
    ("randwrite", "4k", 1),
    ("randwrite", "4k", 16),
    ("write", "1M", 1),
    ("write", "1M", 16),
    ("randread", "4k", 1),
    ("randread", "4k", 16),
    ("read", "1M", 1),
    ("read", "1M", 16),
];

/// The passphrase of the LUKS volumes (the benchmark's own, in its scratch directory).
const PASSPHRASE: &[u8] = b"bulkhead-bench images";

/// Options.
#[derive(Debug, Clone)]
pub struct Options {
    /// Seconds per job.
    pub seconds: u32,
    /// Bytes of each device.
    pub size: u64,
    /// Where the images go (a tmpfs is best).
    pub scratch: PathBuf,
    /// Also measure qemu-storage-daemon (when installed).
    pub qsd: bool,
}

/// One device, one job, one system.
#[derive(Debug, Clone, Serialize)]
pub struct Point {
    /// `bulkhead` or `qsd`.
    pub system: String,
    /// One of [`DEVICES`].
    pub device: String,
    /// fio's `rw`.
    pub rw: String,
    /// Block size.
    pub bs: String,
    /// Queue depth.
    pub qd: u32,
    /// Operations per second.
    pub iops: f64,
    /// MiB per second.
    pub mibs: f64,
    /// CPU the server's processes used, in cores (1.0 = one core busy all the time).
    pub server_cpu_cores: f64,
    /// CPU seconds per 100k requests by process (one round): `serve` and its domains apart
    /// for bulkhead, qemu-storage-daemon as `server`, and fio's job.
    pub cpu_per_100k: crate::CpuPer100k,
}

/// The whole run.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// Seconds per job.
    pub seconds: u32,
    /// Bytes per device.
    pub size: u64,
    /// AES-XTS on one core, 512-byte sectors, GiB/s (encrypt, decrypt).
    pub xts_gibs: (f64, f64),
    /// Points.
    pub points: Vec<Point>,
    /// Goals.
    pub goals: Vec<Goal>,
    /// Why a system was left out, if one was.
    pub skipped: Vec<String>,
    /// Whether the run was interrupted (SIGINT/SIGTERM) before the end.
    pub interrupted: bool,
}

/// Measures AES-XTS as the `crypt` filter runs it: 128 KiB chunks of 512-byte sectors, one
/// thread, for about `seconds` each way; GiB/s encrypting and decrypting.
pub fn xts_speed(seconds: f64) -> (f64, f64) {
    let key: Vec<u8> = (0..64u8).collect();
    let cipher = bulkhead_crypt::SectorCipher::new(&key, 512).expect("a 512-bit XTS key");
    let mut buf = vec![0x5au8; 128 << 10];
    let mut time = |enc: bool| {
        let started = Instant::now();
        let mut bytes = 0u64;
        let mut sector = 0u64;
        while started.elapsed().as_secs_f64() < seconds {
            for _ in 0..64 {
                if enc {
                    cipher.encrypt(&mut buf, sector);
                } else {
                    cipher.decrypt(&mut buf, sector);
                }
                sector += (buf.len() / 512) as u64;
                bytes += buf.len() as u64;
            }
        }
        bytes as f64 / started.elapsed().as_secs_f64() / f64::from(1u32 << 30)
    };
    (time(true), time(false))
}

/// Makes a LUKS volume of `size` data bytes at `path` with qemu-img. qemu-img times its key
/// derivation with the thread's CPU clock first, and on a loaded machine that can come out
/// empty ("Unable to get accurate CPU usage"): the format is tried again then.
fn make_luks(path: &Path, key: &Path, size: u64) -> Result<(), BenchError> {
    let secret = format!("secret,id=s0,file={}", key.display());
    let mut last = String::new();
    for _ in 0..5 {
        let _ = std::fs::remove_file(path);
        let out = Command::new("qemu-img")
            .args(["create", "-q", "-f", "luks", "--object", &secret, "-o", "key-secret=s0,iter-time=10"])
            .arg(path)
            .arg(size.to_string())
            .output()
            .map_err(|e| format!("qemu-img: {e}"))?;
        if out.status.success() {
            return Ok(());
        }
        last = String::from_utf8_lossy(&out.stderr).trim().to_string();
        if !last.contains("accurate CPU usage") {
            break;
        }
    }
    Err(BenchError::Run(format!("qemu-img create -f luks: {last}")))
}

/// Makes the images of one system in `dir`.
fn make_images(dir: &Path, size: u64) -> Result<(), BenchError> {
    let p = |n: &str| dir.join(n).to_string_lossy().into_owned();
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(dir.join("key"))
        .and_then(|mut f| std::io::Write::write_all(&mut f, PASSPHRASE))
        .map_err(|e| format!("key file: {e}"))?;
    for f in ["raw.img", "base.img"] {
        run("fallocate", &["-l", &size.to_string(), &p(f)])?;
    }
    run("qemu-img", &["create", "-q", "-f", "qcow2", "-o", "preallocation=falloc", &p("full.qcow2"), &size.to_string()])?;
    run("qemu-img", &["create", "-q", "-f", "qcow2", &p("fresh.qcow2"), &size.to_string()])?;
    make_luks(&dir.join("luks.img"), &dir.join("key"), size)?;
    run(
        "qemu-img",
        &["convert", "-q", "-f", "raw", "-O", "qcow2", "-o", "preallocation=falloc", &p("luks.img"), &p("luks.qcow2")],
    )?;
    Ok(())
}

/// bulkhead serve's configuration for the devices in `dir`, NBD only.
fn bulkhead_config(dir: &Path) -> String {
    let p = |n: &str| dir.join(n).display().to_string();
    let file = |name: &str, path: &str, format: &str, extra: &str| {
        format!(
            "[[device]]\nname = \"{name}\"\n[device.backend]\ntype = \"file\"\npath = \"{path}\"\nformat = \"{format}\"\n{extra}"
        )
    };
    let mut c = String::from("[fuse]\nenabled = false\n[nbd]\n");
    c += &file("raw", &p("raw.img"), "raw", "");
    c += &file("qcow2-full", &p("full.qcow2"), "qcow2", "");
    c += &file("qcow2-fresh", &p("fresh.qcow2"), "qcow2", "");
    c += &file(
        "cow",
        &p("base.img"),
        "raw",
        &format!("read_only = true\n[[device.filter]]\ntype = \"cow\"\noverlay = \"{}\"\n", p("cow.qcow2")),
    );
    let crypt = format!("[[device.filter]]\ntype = \"crypt\"\nkey_file = \"{}\"\n", p("key"));
    c += &file("crypt", &p("luks.img"), "raw", &crypt);
    c += &file("crypt-qcow2", &p("luks.qcow2"), "qcow2", &crypt);
    c
}

/// qemu-storage-daemon's arguments for the devices in `dir`: buffered I/O, as bulkhead's file
/// backend does.
fn qsd_args(dir: &Path) -> Result<Vec<String>, BenchError> {
    let p = |n: &str| dir.join(n).display().to_string();
    run("qemu-img", &["create", "-q", "-f", "qcow2", "-b", &p("base.img"), "-F", "raw", &p("cow.qcow2")])?;
    let mut a = vec!["--object".to_string(), format!("secret,id=sec0,file={}", p("key"))];
    let mut blockdev = |s: String| a.extend(["--blockdev".to_string(), s]);
    for (node, file) in [("raw", "raw.img"), ("full", "full.qcow2"), ("fresh", "fresh.qcow2"), ("cowf", "cow.qcow2")] {
        blockdev(format!("driver=file,node-name={node}-f,filename={},cache.direct=off", p(file)));
    }
    blockdev(format!("driver=file,node-name=luks-f,filename={},cache.direct=off", p("luks.img")));
    blockdev(format!("driver=file,node-name=luksq-f,filename={},cache.direct=off", p("luks.qcow2")));
    blockdev("driver=raw,node-name=raw,file=raw-f".into());
    blockdev("driver=qcow2,node-name=qcow2-full,file=full-f".into());
    blockdev("driver=qcow2,node-name=qcow2-fresh,file=fresh-f".into());
    blockdev("driver=qcow2,node-name=cow,file=cowf-f".into());
    blockdev("driver=luks,node-name=crypt,file=luks-f,key-secret=sec0".into());
    blockdev("driver=qcow2,node-name=luksq-q,file=luksq-f".into());
    blockdev("driver=luks,node-name=crypt-qcow2,file=luksq-q,key-secret=sec0".into());
    a.extend(["--nbd-server".to_string(), format!("addr.type=unix,addr.path={}", p("nbd.sock"))]);
    for (i, d) in DEVICES.iter().enumerate() {
        a.extend(["--export".to_string(), format!("type=nbd,id=e{i},node-name={d},name={d},writable=on")]);
    }
    Ok(a)
}

/// Where `system` serves NBD for the images in `dir`.
fn socket(system: &str, dir: &Path) -> PathBuf {
    match system {
        "bulkhead" => dir.join("run").join("nbd.sock"),
        _ => dir.join("nbd.sock"),
    }
}

/// Starts one system over the images in `dir`; its processes, stopped when dropped.
fn bring_up(system: &str, exe: &Path, dir: &Path) -> Result<Procs, BenchError> {
    let log = std::fs::File::create(dir.join(format!("{system}.log"))).map_err(|e| e.to_string())?;
    let mut child = match system {
        "bulkhead" => {
            let config = dir.join("bulkhead.toml");
            std::fs::write(&config, bulkhead_config(dir)).map_err(|e| e.to_string())?;
            Command::new(exe)
                .arg("serve")
                .arg("--config")
                .arg(&config)
                .arg("--run-dir")
                .arg(dir.join("run"))
                .stdout(Stdio::null())
                .stderr(log)
                .spawn()
                .map_err(|e| format!("bulkhead serve: {e}"))?
        }
        _ => Command::new("qemu-storage-daemon")
            .args(qsd_args(dir)?)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .map_err(|e| format!("qemu-storage-daemon: {e}"))?,
    };
    let up = wait_for(&socket(system, dir), system, Some(&mut child));
    let procs = Procs(vec![child]);
    up.map_err(|e| format!("{e}; its log: {}", std::fs::read_to_string(dir.join(format!("{system}.log"))).unwrap_or_default()))?;
    Ok(procs)
}

/// Runs one fio job on one export.
fn point(
    system: &str,
    sock: &Path,
    device: &str,
    job: (&str, &str, u32),
    seconds: u32,
    server: &[u32],
) -> Result<Point, BenchError> {
    let (rw, bs, qd) = job;
    let root = server.first().copied().unwrap_or(0);
    let (s0, r0) = (tree_jiffies(server), crate::cpu_seconds(root));
    let started = Instant::now();
    let out = Command::new("timeout")
        .args(["--kill-after=10", &(seconds + 60).to_string(), "fio", "--name=images", "--ioengine=nbd"])
        .arg(format!("--uri=nbd+unix:///{device}?socket={}", sock.display()))
        .args([&format!("--rw={rw}"), &format!("--bs={bs}"), &format!("--iodepth={qd}")])
        .args([&format!("--runtime={seconds}"), "--time_based", "--randrepeat=0", "--output-format=json"])
        .output()
        .map_err(|e| format!("fio: {e}"))?;
    let wall = started.elapsed().as_secs_f64();
    let (s1, r1) = (tree_jiffies(server), crate::cpu_seconds(root));
    let what = format!("{system} {device} {rw} {bs} QD{qd}");
    if !out.status.success() {
        return Err(BenchError::Run(format!("fio on {what}: {}", String::from_utf8_lossy(&out.stderr).trim())));
    }
    let v = crate::fio_report(&out.stdout, &what)?;
    let job = &v["jobs"][0];
    let side = if rw.contains("write") { "write" } else { "read" };
    let ios = job[side]["total_ios"].as_f64().unwrap_or(0.0).max(1.0);
    let per = |c: f64| c / (ios / 100_000.0);
    let tree = s1.saturating_sub(s0) as f64 / clock_ticks();
    let serve = r1 - r0;
    let mut cpu =
        crate::CpuPer100k { server: vec![per(tree)], load: vec![per(crate::fio_job_cpu_seconds(job))], ..Default::default() };
    if system == "bulkhead" {
        cpu.serve.push(per(serve));
        cpu.domain.push(per((tree - serve).max(0.0)));
    }
    Ok(Point {
        system: system.into(),
        device: device.into(),
        rw: rw.into(),
        bs: bs.into(),
        qd,
        iops: job[side]["iops"].as_f64().unwrap_or(0.0),
        mibs: job[side]["bw"].as_f64().unwrap_or(0.0) / 1024.0,
        server_cpu_cores: tree / wall,
        cpu_per_100k: cpu,
    })
}

/// Runs the benchmark; `progress` hears what runs now; `stop` ends it early (the report then
/// says so).
pub fn run_bench(exe: &Path, opts: &Options, stop: &AtomicBool, mut progress: impl FnMut(&str)) -> Result<Report, BenchError> {
    for tool in ["fio", "qemu-img", "fallocate"] {
        if !which(tool) {
            return Err(BenchError::Run(format!("bench images needs `{tool}`")));
        }
    }
    let fio_nbd = Command::new("fio").arg("--enghelp").output().map_err(|e| format!("fio: {e}"))?;
    if !String::from_utf8_lossy(&fio_nbd.stdout).lines().any(|l| l.trim() == "nbd") {
        return Err("bench images needs fio's nbd engine (fio built with libnbd)".into());
    }
    let mut report = Report {
        seconds: opts.seconds,
        size: opts.size,
        xts_gibs: (0.0, 0.0),
        points: Vec::new(),
        goals: Vec::new(),
        skipped: Vec::new(),
        interrupted: false,
    };
    progress("AES-XTS on one core");
    report.xts_gibs = xts_speed(1.0);
    let mut systems = vec!["bulkhead"];
    if !opts.qsd {
        report.skipped.push("qsd: left out (--no-qsd)".into());
    } else if !which("qemu-storage-daemon") {
        report.skipped.push("qsd: qemu-storage-daemon is not installed (apt-get install qemu-system-common)".into());
    } else {
        systems.push("qsd");
    }
    let work = opts.scratch.join(format!("bulkhead-bench-images-{}", std::process::id()));
    let _cleanup = crate::RemoveDir(work.clone());
    let total = systems.len() * DEVICES.len() * JOBS.len();
    let mut done = 0;
    'systems: for system in systems {
        let dir = work.join(system);
        progress(&format!("{system}: making the images"));
        make_images(&dir, opts.size)?;
        let procs = bring_up(system, exe, &dir)?;
        let server = procs.pids();
        for device in DEVICES {
            for job in JOBS {
                if stop.load(Ordering::Relaxed) {
                    report.interrupted = true;
                    break 'systems;
                }
                done += 1;
                progress(&format!("[{done}/{total}] {system} {device} {} {} QD{}", job.0, job.1, job.2));
                report.points.push(point(system, &socket(system, &dir), device, job, opts.seconds, &server)?);
            }
        }
        drop(procs);
        if system == "bulkhead" {
            // The images bulkhead wrote are consistent.
            for img in ["full.qcow2", "fresh.qcow2", "cow.qcow2", "luks.qcow2"] {
                let out = Command::new("qemu-img").arg("check").arg(dir.join(img)).output().map_err(|e| e.to_string())?;
                if !matches!(out.status.code(), Some(0) | Some(3)) {
                    return Err(BenchError::Run(format!(
                        "qemu-img check {img} after the run: {}",
                        String::from_utf8_lossy(&out.stdout)
                    )));
                }
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
    report.goals = goals(&report);
    Ok(report)
}

fn find<'a>(r: &'a Report, system: &str, device: &str, job: (&str, &str, u32)) -> Option<&'a Point> {
    r.points.iter().find(|p| p.system == system && p.device == device && (p.rw.as_str(), p.bs.as_str(), p.qd) == job)
}

/// The goals, against this run.
fn goals(r: &Report) -> Vec<Goal> {
    let mut g = Vec::new();
    let worst = |sys_a: &str, dev_a: &str, sys_b: &str, dev_b: &str| {
        JOBS.iter()
            .filter_map(|&j| Some(find(r, sys_a, dev_a, j)?.iops / find(r, sys_b, dev_b, j)?.iops.max(1e-9)))
            .fold(None, |m: Option<f64>, x| Some(m.map_or(x, |m| m.min(x))))
    };
    if let Some(w) = worst("bulkhead", "qcow2-full", "bulkhead", "raw") {
        g.push(Goal {
            what: "qcow2 fully allocated / raw, worst point".into(),
            measured: w,
            bound: "≥ 0.90".into(),
            met: w >= 0.90,
        });
    }
    let xts = r.xts_gibs.0.min(r.xts_gibs.1);
    g.push(Goal { what: "AES-XTS on one core, GiB/s".into(), measured: xts, bound: "≥ 1.0".into(), met: xts >= 1.0 });
    for dev in ["crypt", "crypt-qcow2"] {
        if let Some(w) = worst("bulkhead", dev, "qsd", dev) {
            g.push(Goal {
                what: format!("{dev}: bulkhead / qsd, worst point"),
                measured: w,
                bound: "≥ 1.00".into(),
                met: w >= 1.0,
            });
        }
    }
    g
}

/// The report as tables: per device and job, each system's IOPS, MiB/s and server CPU, and
/// bulkhead's ratio to qsd; then the goals.
pub fn render(r: &Report) -> String {
    let mut out = format!(
        "bench images: {} MiB per device, {} s per job, fio's nbd engine on both systems' NBD exports\n\
         AES-XTS (one core, 128 KiB of 512-byte sectors): {:.2} GiB/s encrypt, {:.2} GiB/s decrypt\n\n",
        r.size >> 20,
        r.seconds,
        r.xts_gibs.0,
        r.xts_gibs.1
    );
    let mut t = Table::new(&[
        "device",
        "job",
        "bulkhead IOPS",
        "MiB/s",
        "CPU",
        "s/100k serve|domain|fio",
        "qsd IOPS",
        "MiB/s",
        "CPU",
        "s/100k qsd|fio",
        "bulkhead/qsd",
    ]);
    for device in DEVICES {
        for job in JOBS {
            let b = find(r, "bulkhead", device, job);
            let q = find(r, "qsd", device, job);
            if b.is_none() && q.is_none() {
                continue;
            }
            let cells = |p: Option<&Point>| match p {
                Some(p) => vec![
                    format!("{:.0}", p.iops),
                    format!("{:.1}", p.mibs),
                    format!("{:.2}", p.server_cpu_cores),
                    p.cpu_per_100k.by_process(),
                ],
                None => vec!["-".into(), "-".into(), "-".into(), "-".into()],
            };
            let mut row = vec![device.to_string(), format!("{} {} QD{}", job.0, job.1, job.2)];
            row.extend(cells(b));
            row.extend(cells(q));
            row.push(match (b, q) {
                (Some(b), Some(q)) if q.iops > 0.0 => format!("{:.2}", b.iops / q.iops),
                _ => "-".into(),
            });
            t.row(row);
        }
    }
    out += &t.render();
    out += "\nCPU: the server's processes (bulkhead serve and its domains; qemu-storage-daemon), in cores; then CPU \
            seconds per 100k requests of each process (fio's job as fio counts it).\n\n";
    for g in &r.goals {
        out += &format!("goal {}: {:.2} (want {}) {}\n", g.what, g.measured, g.bound, if g.met { "met" } else { "NOT met" });
    }
    for s in &r.skipped {
        out += &format!("skipped {s}\n");
    }
    if r.interrupted {
        out += "interrupted: the results above are partial\n";
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(system: &str, device: &str, job: (&str, &str, u32), iops: f64) -> Point {
        Point {
            system: system.into(),
            device: device.into(),
            rw: job.0.into(),
            bs: job.1.into(),
            qd: job.2,
            iops,
            mibs: iops / 256.0,
            server_cpu_cores: 1.0,
            cpu_per_100k: crate::CpuPer100k::default(),
        }
    }

    #[test]
    fn goals_take_the_worst_point_and_the_table_shows_each_ratio() {
        let mut r = Report {
            seconds: 1,
            size: 64 << 20,
            xts_gibs: (2.0, 0.9),
            points: Vec::new(),
            goals: Vec::new(),
            skipped: vec!["qsd: left out (--no-qsd)".into()],
            interrupted: false,
        };
        for (i, job) in JOBS.iter().enumerate() {
            r.points.push(p("bulkhead", "raw", *job, 1000.0));
            // One point of the allocated image at 85% of raw, the others above.
            r.points.push(p("bulkhead", "qcow2-full", *job, if i == 3 { 850.0 } else { 990.0 }));
            r.points.push(p("bulkhead", "crypt", *job, 500.0));
            r.points.push(p("qsd", "crypt", *job, 400.0));
        }
        let g = goals(&r);
        assert_eq!(g.len(), 3, "no crypt-qcow2 points, no goal for it: {g:?}");
        assert!((g[0].measured - 0.85).abs() < 1e-9 && !g[0].met, "{:?}", g[0]);
        assert!((g[1].measured - 0.9).abs() < 1e-9 && !g[1].met, "the slower direction counts: {:?}", g[1]);
        assert!((g[2].measured - 1.25).abs() < 1e-9 && g[2].met, "{:?}", g[2]);
        r.goals = g;
        let text = render(&r);
        let row = text.lines().find(|l| l.starts_with("crypt ") && l.contains("randwrite 4k QD1 ")).unwrap();
        assert!(row.trim_end().ends_with("1.25"), "{row}");
        assert!(text.contains("NOT met") && text.contains("skipped qsd"), "{text}");
    }

    #[test]
    fn both_systems_name_the_same_devices_and_the_cipher_is_measured() {
        let dir = Path::new("/srv/x");
        let c = bulkhead_config(dir);
        for d in DEVICES {
            assert!(c.contains(&format!("name = \"{d}\"")), "{d} missing from bulkhead's config:\n{c}");
        }
        let parsed: toml::Value = toml::from_str(&c).unwrap();
        assert_eq!(parsed["device"].as_array().unwrap().len(), DEVICES.len());
        let (enc, dec) = xts_speed(0.05);
        assert!(enc > 0.0 && dec > 0.0);
    }
}
