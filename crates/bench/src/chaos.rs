//! `bulkhead-bench chaos`: faults of every kind, at random, for minutes, under file systems
//! that verify every block they write.
//!
//! One `serve` with a device of each kind: `ram`; `file` on a raw image through io_uring, with
//! a `stats` filter; a qcow2 image; a LUKS2 volume opened by `crypt` over a `cow` overlay, in a
//! tap domain of its own (`interpose`); a view with an IOPS cap on a `ram` device; and an `nbd`
//! backend to a local nbdkit. Each carries ext4 on a loop device, over FUSE, except the `ram`
//! device, whose ext4 is over NBD (nbdfuse, a FUSE file of its NBD export). On each, fio writes
//! and reads 4–64 KiB blocks at random with crc32c verification (`verify_backlog`), for the
//! whole run.
//!
//! Meanwhile faults come one after another, at random: SIGKILL of a driver domain or of a tap
//! domain, SIGSTOP of a driver domain (the watchdog replaces it), a `delay` filter added and
//! removed, the file device's filters moved between its driver domain and a tap domain, a
//! snapshot of the overlay taken (the third-last deleted), and nbdkit killed and started
//! again (nbdkit 1.32 also aborts by itself now and then when a killed domain leaves with
//! requests in flight; it is started again, and counted apart). After each fault that replaces a domain the run waits for the device to serve
//! again, and reads the outage `serve` measured from its status.
//!
//! At the end: the faults of each kind, fio's errors (goal 0) and verify failures (goal 0),
//! `e2fsck -fn` on each file system (goal clean), the outages' p50, p99 and max, and serve's
//! private memory before and after. [`Report::lost_anything`] says whether anything was lost;
//! the command exits non-zero then.
//!
//! Every process the run starts is in a process group of its own, so that a Ctrl-C reaches
//! only the run: it stops making faults, stops fio, checks and unmounts the file systems, and
//! reports what it saw.

use std::collections::BTreeMap;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use bulkhead_control::DeviceState;
use serde::Serialize;

use crate::fileio::{run, which, Procs, Undo};
use crate::{millis, quantile, serve_status, BenchError, BenchServe, Table};
use bulkhead_rng::Rng;

/// What to run.
#[derive(Debug, Clone)]
pub struct Options {
    /// Minutes of faults under the load.
    pub minutes: u64,
    /// Seed of the faults' choices.
    pub seed: u64,
}

/// One file system's account.
#[derive(Debug, Clone, Serialize)]
pub struct FsReport {
    /// The device (or view) under it.
    pub device: String,
    /// How it reaches the device: FUSE or NBD.
    pub over: String,
    /// fio's job error (0: none; 84, EILSEQ: a block did not verify).
    pub fio_error: i64,
    /// What fio said went wrong, if anything.
    pub fio_says: String,
    /// MiB fio wrote.
    pub written_mib: f64,
    /// Whether `e2fsck -fn` found it clean.
    pub fsck_clean: bool,
    /// What e2fsck said when it did not.
    pub fsck_says: String,
}

/// What a run found.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Report {
    /// Seconds of faults.
    pub seconds: f64,
    /// The seed of the faults' choices.
    pub seed: u64,
    /// Faults by kind.
    pub faults: BTreeMap<String, u64>,
    /// Faults in all.
    pub total_faults: u64,
    /// Each file system.
    pub filesystems: Vec<FsReport>,
    /// I/O errors the applications saw (goal 0).
    pub app_errors: u64,
    /// Blocks that did not read back as written (goal 0).
    pub verify_failures: u64,
    /// Outages measured (one per domain replaced and serving again).
    pub outages: usize,
    /// Their median, ms.
    pub outage_p50_ms: f64,
    /// Their 99th percentile, ms.
    pub outage_p99_ms: f64,
    /// The longest, ms.
    pub outage_max_ms: f64,
    /// serve's private memory (`RssAnon`) as the faults begin, MiB.
    pub rss_start_mib: f64,
    /// The same a third into the run, once the load has touched the buffers it uses (the FUSE
    /// rings' 1 MiB entries fill as larger requests come): the reference for growth, MiB.
    pub rss_before_mib: f64,
    /// The same after the last fault, MiB.
    pub rss_after_mib: f64,
    /// Devices that ended `failed`.
    pub failed_devices: Vec<String>,
    /// Faults that could not be made or that the device did not recover from (the first few).
    pub fault_errors: Vec<String>,
    /// Stopped by SIGINT/SIGTERM before the end.
    pub interrupted: bool,
    /// The end of serve's log, when something was lost or a fault was not recovered from.
    pub serve_log: String,
}

/// Growth of serve's private memory over a run taken as noise, MiB: the allocator's caches
/// and the spare reply buffers fill and empty with the load.
pub const MEMORY_NOISE_MIB: f64 = 16.0;

impl Report {
    /// Whether anything was lost or broken: an application error, a block that did not
    /// verify, a file system not clean, a device failed, or a fault it did not recover from.
    pub fn lost_anything(&self) -> bool {
        self.app_errors > 0
            || self.verify_failures > 0
            || self.filesystems.iter().any(|f| !f.fsck_clean)
            || !self.failed_devices.is_empty()
            || !self.fault_errors.is_empty()
    }

    /// Whether serve's memory grew beyond [`MEMORY_NOISE_MIB`].
    pub fn memory_grew(&self) -> bool {
        self.rss_after_mib > self.rss_before_mib + MEMORY_NOISE_MIB
    }
}

/// The size of every device's file system.
const FS_MIB: u64 = 160;
/// fio's file on each.
const FIO_SIZE: &str = "32M";
/// A LUKS2 header, before the volume's data.
const LUKS2_HEADER_MIB: u64 = 16;

/// The kinds of fault.
const KILL_DRIVER: &str = "SIGKILL driver domain";
const KILL_TAP: &str = "SIGKILL tap domain";
const STOP_DRIVER: &str = "SIGSTOP driver domain";
const STOP_IDLE: &str = "SIGSTOP driver domain, idle (resumed)";
const FILTER_ADD: &str = "filter added";
const FILTER_REMOVE: &str = "filter removed";
const TAP_SWITCH: &str = "tap mode switched";
const SNAPSHOT: &str = "snapshot created";
const REMOTE_RESTART: &str = "remote NBD server restarted";
/// nbdkit 1.32 aborts now and then when a client goes with requests in flight (an assertion in
/// its `raw_send_socket`): the run starts it again, and counts it apart.
const REMOTE_DIED: &str = "remote NBD server died by itself, restarted";

/// Tools the run needs.
const TOOLS: [&str; 10] =
    ["fio", "nbdkit", "nbdfuse", "fusermount3", "qemu-img", "cryptsetup", "losetup", "mkfs.ext4", "e2fsck", "mount"];

/// Why the run cannot start here, if it cannot.
pub fn unavailable() -> Option<String> {
    if bulkhead_sys::euid() != 0 {
        return Some("bench chaos needs root (loop devices, mounts, FUSE)".into());
    }
    let missing: Vec<&str> = TOOLS.iter().copied().filter(|t| !which(t)).collect();
    (!missing.is_empty()).then(|| format!("bench chaos needs {}", missing.join(", ")))
}

/// A device of the run and where its file system is.
struct Disk {
    /// Device name (the device of a view: the view's own is `export`).
    device: &'static str,
    /// The FUSE file or NBD export carrying the file system.
    export: &'static str,
    over: &'static str,
}

const DISKS: [Disk; 6] = [
    Disk { device: "ram0", export: "ram0", over: "NBD" },
    Disk { device: "file0", export: "file0", over: "FUSE" },
    Disk { device: "qcow0", export: "qcow0", over: "FUSE" },
    Disk { device: "sec0", export: "sec0", over: "FUSE" },
    Disk { device: "shared0", export: "v0", over: "FUSE" },
    Disk { device: "remote0", export: "remote0", over: "FUSE" },
];

/// The local NBD server behind `remote0`: nbdkit's `file` plugin on an image, so that its data
/// outlives a kill.
struct Remote {
    sock: PathBuf,
    image: PathBuf,
    child: Option<Child>,
}

impl Remote {
    fn start(&mut self) -> Result<(), BenchError> {
        let _ = std::fs::remove_file(&self.sock);
        let child = Command::new("nbdkit")
            .process_group(0)
            .args(["--foreground", "--exit-with-parent", "--unix"])
            .arg(&self.sock)
            .arg("file")
            .arg(format!("file={}", self.image.display()))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| BenchError::Run(format!("nbdkit: {e}")))?;
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        while !self.sock.exists() {
            if Instant::now() > deadline {
                return Err(BenchError::Run("nbdkit did not make its socket within 10 s".into()));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Ok(())
    }

    /// Whether nbdkit has ended by itself (then it is reaped).
    fn died(&mut self) -> bool {
        match self.child.as_mut().map(|c| c.try_wait()) {
            Some(Ok(Some(_))) => {
                self.child = None;
                true
            }
            _ => false,
        }
    }

    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Remote {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A mounted file system to check at the end.
struct Mounted {
    dev: String,
    mnt: PathBuf,
}

fn config(dir: &Path, remote_sock: &Path) -> String {
    let restartable = "restart_limit = 1000000\nrestart_window_ms = 1000\n";
    let path = |f: &str| dir.join(f).display().to_string();
    format!(
        "[nbd]\nenabled = true\n\n\
         [[device]]\nname = \"ram0\"\nsize = \"{FS_MIB}M\"\n{restartable}[device.backend]\ntype = \"ram\"\n\n\
         [[device]]\nname = \"file0\"\n{restartable}[device.backend]\ntype = \"file\"\npath = \"{file0}\"\nengine = \"io_uring\"\n\
         [[device.filter]]\ntype = \"stats\"\n\n\
         [[device]]\nname = \"qcow0\"\n{restartable}[device.backend]\ntype = \"file\"\npath = \"{qcow0}\"\nformat = \"qcow2\"\n\n\
         [[device]]\nname = \"sec0\"\ntap = \"interpose\"\n{restartable}[device.backend]\ntype = \"file\"\npath = \"{sec0}\"\n\
         [[device.filter]]\ntype = \"crypt\"\nkey_file = \"{key}\"\n\
         [[device.filter]]\ntype = \"cow\"\noverlay = \"{overlay}\"\n\n\
         [[device]]\nname = \"shared0\"\nsize = \"{shared}M\"\n{restartable}[device.backend]\ntype = \"ram\"\n\
         [[device.view]]\nname = \"v0\"\nsize = \"{FS_MIB}M\"\niops = 20000\n\n\
         [[device]]\nname = \"remote0\"\nsize = \"{FS_MIB}M\"\nwatchdog_ms = 2000\n{restartable}[device.backend]\ntype = \"nbd\"\n\
         uri = \"nbd+unix:///?socket={remote}\"\n",
        file0 = path("file0.img"),
        qcow0 = path("qcow0.qcow2"),
        sec0 = path("sec0.img"),
        key = path("sec0.key"),
        overlay = path("sec0-overlay.qcow2"),
        shared = FS_MIB + 32,
        remote = remote_sock.display(),
    )
}

/// Makes the images the devices serve.
fn images(dir: &Path) -> Result<(), BenchError> {
    let sparse = |name: &str, mib: u64| -> Result<(), BenchError> {
        let p = dir.join(name);
        std::fs::File::create(&p).and_then(|f| f.set_len(mib << 20)).map_err(|e| BenchError::io(&p, e))
    };
    sparse("file0.img", FS_MIB)?;
    sparse("remote0.img", FS_MIB)?;
    sparse("sec0.img", FS_MIB + LUKS2_HEADER_MIB)?;
    run("qemu-img", &["create", "-q", "-f", "qcow2", &dir.join("qcow0.qcow2").display().to_string(), &format!("{FS_MIB}M")])?;
    let key = dir.join("sec0.key");
    std::fs::write(&key, b"chaos passphrase\n").map_err(|e| BenchError::io(&key, e))?;
    // LUKS2 with 512-byte sectors, a cheap key derivation (the key is not what is tested).
    let (key, vol) = (key.display().to_string(), dir.join("sec0.img").display().to_string());
    let mut args: Vec<&str> =
        "luksFormat -q --type luks2 --pbkdf pbkdf2 --pbkdf-force-iterations 1000 --sector-size 512".split(' ').collect();
    args.extend(["--key-file", &key, &vol]);
    run("cryptsetup", &args)?;
    Ok(())
}

/// ext4 on a direct-I/O loop device over `file`, mounted at `mnt`.
fn ext4(file: &Path, mnt: &Path, undo: &mut Undo) -> Result<Mounted, BenchError> {
    let dev = run("losetup", &["--direct-io=on", "-f", "--show", &file.display().to_string()])?.trim().to_string();
    undo.push("losetup", &["-d", &dev]);
    run("mkfs.ext4", &["-q", "-F", "-E", "lazy_itable_init=0,lazy_journal_init=0", &dev])?;
    std::fs::create_dir_all(mnt).map_err(|e| BenchError::io(mnt, e))?;
    run("mount", &["-o", "noatime", &dev, &mnt.display().to_string()])?;
    undo.push("umount", &[&mnt.display().to_string()]);
    Ok(Mounted { dev, mnt: mnt.to_path_buf() })
}

/// fio verifying on `mnt` for `seconds`, its JSON report to `out`.
fn fio(mnt: &Path, seconds: u64, seed: u64, out: &Path) -> Result<Child, BenchError> {
    Command::new("fio")
        .process_group(0)
        .args(["--name=chaos", &format!("--directory={}", mnt.display()), "--ioengine=libaio", "--direct=1"])
        .args(["--rw=randrw", "--bsrange=4k-64k", "--iodepth=8", &format!("--size={FIO_SIZE}")])
        .args(["--verify=crc32c", "--verify_backlog=32", "--verify_fatal=1", "--verify_state_save=0"])
        .args(["--serialize_overlap=1", "--time_based", &format!("--runtime={seconds}"), &format!("--randseed={seed}")])
        .args(["--output-format=json", &format!("--output={}", out.display())])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| BenchError::Run(format!("fio: {e}")))
}

/// serve's private memory, MiB, from its status.
fn rss_mib(sock: &Path) -> f64 {
    serve_status(sock).and_then(|s| s.frontend.rss).map_or(0.0, |r| r.anon_kib as f64 / 1024.0)
}

/// A device's status, by name.
fn device(sock: &Path, name: &str) -> Option<bulkhead_control::DeviceStatus> {
    serve_status(sock)?.devices.into_iter().find(|d| d.name == name)
}

/// Runs the load and the faults with `exe` (a `bulkhead` that takes `serve`).
pub fn run_chaos(exe: &Path, opts: &Options, stop: &AtomicBool, mut progress: impl FnMut(&str)) -> Result<Report, BenchError> {
    if let Some(why) = unavailable() {
        return Err(BenchError::Run(why));
    }
    if !(1..=600).contains(&opts.minutes) {
        return Err(BenchError::Options(format!("{} minutes: 1..=600", opts.minutes)));
    }
    let work = std::env::temp_dir().join(format!("bulkhead-chaos-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work).map_err(|e| BenchError::io(&work, e))?;
    let result = chaos_in(exe, opts, stop, &work, &mut progress);
    let _ = std::fs::remove_dir_all(&work);
    result
}

fn chaos_in(
    exe: &Path,
    opts: &Options,
    stop: &AtomicBool,
    work: &Path,
    progress: &mut impl FnMut(&str),
) -> Result<Report, BenchError> {
    progress("making the images");
    images(work)?;
    let mut remote = Remote { sock: work.join("nbdkit.sock"), image: work.join("remote0.img"), child: None };
    remote.start()?;
    let text = config(work, &remote.sock);
    let serve = BenchServe::start_grouped(exe, "chaos", &text, &[], &[], true, |s| {
        let run = s.run_dir();
        run.join("nbd.sock").exists() && DISKS.iter().all(|d| d.over == "NBD" || run.join("fuse").join(d.export).exists())
    })?;
    let run_dir = serve.run_dir();
    let control = run_dir.join("control.sock");
    // Mounts and loop devices go before the processes under them (nbdfuse), and those before
    // serve: declared in the opposite order.
    let mut helpers = Procs(Vec::new());
    let mut undo = Undo::default();
    let mut mounted = Vec::new();
    progress("making the file systems");
    for (i, d) in DISKS.iter().enumerate() {
        let file = if d.over == "NBD" {
            let fuse = work.join(format!("nbdfuse-{}", d.export));
            std::fs::create_dir_all(&fuse).map_err(|e| BenchError::io(&fuse, e))?;
            let child = Command::new("nbdfuse")
                .process_group(0)
                .arg(&fuse)
                .arg(format!("nbd+unix:///{}?socket={}", d.export, run_dir.join("nbd.sock").display()))
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .map_err(|e| BenchError::Run(format!("nbdfuse: {e}")))?;
            helpers.0.push(child);
            undo.push("fusermount3", &["-u", &fuse.display().to_string()]);
            let f = fuse.join("nbd");
            crate::fileio::wait_for(&f, "nbdfuse", helpers.0.last_mut())?;
            f
        } else {
            run_dir.join("fuse").join(d.export)
        };
        mounted.push(ext4(&file, &work.join(format!("mnt{i}")), &mut undo)?);
    }
    let seconds = opts.minutes * 60;
    let mut fios = Procs(Vec::new());
    let outs: Vec<PathBuf> = (0..DISKS.len()).map(|i| work.join(format!("fio{i}.json"))).collect();
    for (i, m) in mounted.iter().enumerate() {
        fios.0.push(fio(&m.mnt, seconds, opts.seed.wrapping_add(i as u64), &outs[i])?);
    }
    std::thread::sleep(Duration::from_secs(3));
    let mut report = Report { seed: opts.seed, rss_start_mib: rss_mib(&control), ..Default::default() };
    let mut outages = Vec::new();
    let mut rng = Rng::new(opts.seed);
    let started = Instant::now();
    // Faults stop a little before fio does, so that every fault's outage ends under the load.
    let until = started + Duration::from_secs(seconds.saturating_sub(5).max(1));
    let mut snapshots = 0u64;
    let mut said = 0;
    let warmed = started + (until - started) / 3;
    let mut rss_warm = None;
    let mut faults =
        Faults { exe, run_dir: &run_dir, control: &control, remote: &mut remote, report: &mut report, outages: &mut outages };
    while Instant::now() < until {
        if stop.load(Ordering::Relaxed) {
            faults.report.interrupted = true;
            break;
        }
        faults.keep_remote_up();
        if fios.0.iter_mut().any(|c| matches!(c.try_wait(), Ok(Some(_)))) {
            // A fio that ended early failed: nothing more to learn from faults.
            break;
        }
        match rng.below(20) {
            0..=7 => faults.kill_driver(DISKS[rng.below(DISKS.len() as u64) as usize].device, libc::SIGKILL, KILL_DRIVER),
            8..=9 => faults.kill_tap(if rng.below(2) == 0 { "sec0" } else { "file0" }),
            10..=11 => faults.kill_driver(
                ["ram0", "file0", "qcow0", "sec0", "shared0"][rng.below(5) as usize],
                libc::SIGSTOP,
                STOP_DRIVER,
            ),
            12..=13 => faults.filter_add_remove("qcow0", millis(&mut rng, 50, 500)),
            14..=15 => faults.tap_switch("file0"),
            16..=17 => {
                snapshots += 1;
                faults.snapshot("sec0", snapshots);
            }
            _ => faults.remote_restart(millis(&mut rng, 50, 500)),
        }
        if faults.report.fault_errors.len() >= 5 {
            break;
        }
        std::thread::sleep(millis(&mut rng, 0, 200));
        if rss_warm.is_none() && Instant::now() >= warmed {
            rss_warm = Some(rss_mib(&control));
        }
        let s = started.elapsed().as_secs();
        if s >= said + 10 {
            said = s;
            progress(&format!(
                "{s} s: {} faults, serve's private memory {:.0} MiB",
                faults.report.total_faults,
                rss_mib(&control)
            ));
        }
    }
    report.seconds = started.elapsed().as_secs_f64();
    report.rss_after_mib = rss_mib(&control);
    report.rss_before_mib = rss_warm.unwrap_or(report.rss_after_mib);
    let stopped_early = report.interrupted || Instant::now() < until;
    if stopped_early {
        // Stopped early: fio stops too (it writes its report on SIGTERM, and exits non-zero).
        for c in &fios.0 {
            let _ = bulkhead_sys::signal(c.id(), libc::SIGTERM);
        }
    }
    progress("waiting for fio");
    let deadline = Instant::now() + Duration::from_secs(seconds + 180);
    for (i, c) in fios.0.iter_mut().enumerate() {
        let status = loop {
            match c.try_wait() {
                Ok(Some(st)) => break Some(st),
                Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(100)),
                _ => break None,
            }
        };
        let mut stderr = String::new();
        if let Some(mut e) = c.stderr.take() {
            use std::io::Read;
            let _ = e.read_to_string(&mut stderr);
        }
        let fs = fio_result(DISKS[i].export, DISKS[i].over, &outs[i], status, stopped_early, &stderr);
        match fs.fio_error {
            0 => {}
            84 => report.verify_failures += 1,
            _ => report.app_errors += 1,
        }
        report.filesystems.push(fs);
    }
    drop(fios);
    progress("unmounting and checking the file systems");
    for (fs, m) in report.filesystems.iter_mut().zip(&mounted) {
        let (clean, says) = fsck(m);
        fs.fsck_clean = clean;
        fs.fsck_says = says;
    }
    if let Some(st) = serve_status(&control) {
        report.failed_devices = st.devices.iter().filter(|d| d.state == DeviceState::Failed).map(|d| d.name.clone()).collect();
    }
    drop(undo);
    drop(helpers);
    drop(remote);
    if report.lost_anything() {
        let log = serve.log();
        let lines: Vec<&str> = log.lines().collect();
        report.serve_log = lines[lines.len().saturating_sub(40)..].join("\n");
    }
    drop(serve);
    outages.sort_by(f64::total_cmp);
    report.outages = outages.len();
    report.outage_p50_ms = quantile(&outages, 0.5);
    report.outage_p99_ms = quantile(&outages, 0.99);
    report.outage_max_ms = outages.last().copied().unwrap_or(0.0);
    report.total_faults = report.faults.values().sum();
    Ok(report)
}

/// One file system's fio account, from its report file and how it ended (`stopped`: by the
/// run's SIGTERM, which makes fio exit non-zero however its job went).
fn fio_result(
    device: &str,
    over: &str,
    out: &Path,
    status: Option<std::process::ExitStatus>,
    stopped: bool,
    stderr: &str,
) -> FsReport {
    let text = std::fs::read_to_string(out).unwrap_or_default();
    let json = text.find('{').and_then(|i| serde_json::from_str::<serde_json::Value>(&text[i..]).ok());
    let job = json.as_ref().map(|v| v["jobs"][0].clone()).unwrap_or_default();
    // No report (or none that parses) is an error of its own: -1.
    let mut fio_error = job["error"].as_i64().unwrap_or(-1);
    let mut says = stderr.lines().filter(|l| !l.trim().is_empty()).take(5).collect::<Vec<_>>().join("; ");
    match status {
        None => {
            fio_error = if fio_error > 0 { fio_error } else { -1 };
            says = format!("fio did not end in time; {says}");
        }
        Some(st) if !st.success() && fio_error == 0 && !stopped => {
            fio_error = -1;
            says = format!("fio exited {st}; {says}");
        }
        _ => {}
    }
    FsReport {
        device: device.to_string(),
        over: over.to_string(),
        fio_error,
        fio_says: if fio_error == 0 { String::new() } else { says },
        written_mib: job["write"]["io_bytes"].as_f64().unwrap_or(0.0) / (1 << 20) as f64,
        fsck_clean: false,
        fsck_says: String::new(),
    }
}

/// Unmounts `m` and checks it with `e2fsck -fn`.
fn fsck(m: &Mounted) -> (bool, String) {
    if let Err(e) = run("umount", &[&m.mnt.display().to_string()]) {
        return (false, format!("umount: {e}"));
    }
    // A domain starting elsewhere may hold a copy of the mount for a moment (see the tests'
    // `Ext4::unmount_and_check`): wait for ext4 to let the device go.
    let sys = PathBuf::from(format!("/sys/fs/ext4/{}", Path::new(&m.dev).file_name().unwrap_or_default().to_string_lossy()));
    let deadline = Instant::now() + Duration::from_secs(5);
    while sys.exists() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    match Command::new("e2fsck").args(["-fn", &m.dev]).output() {
        Ok(out) if out.status.success() => (true, String::new()),
        Ok(out) => (false, String::from_utf8_lossy(&out.stdout).lines().take(10).collect::<Vec<_>>().join("; ")),
        Err(e) => (false, format!("e2fsck: {e}")),
    }
}

/// Makes faults and records them.
struct Faults<'a> {
    exe: &'a Path,
    run_dir: &'a Path,
    control: &'a Path,
    remote: &'a mut Remote,
    report: &'a mut Report,
    outages: &'a mut Vec<f64>,
}

impl Faults<'_> {
    /// Starts nbdkit again if it died by itself (see [`REMOTE_DIED`]).
    fn keep_remote_up(&mut self) {
        if self.remote.died() {
            self.counted(REMOTE_DIED);
            if let Err(e) = self.remote.start() {
                self.error(format!("{REMOTE_DIED}: {e}"));
            }
        }
    }

    fn counted(&mut self, kind: &str) {
        *self.report.faults.entry(kind.to_string()).or_default() += 1;
        self.report.total_faults += 1;
    }

    fn error(&mut self, what: String) {
        self.report.fault_errors.push(what);
    }

    /// `bulkhead ARGS --run-dir RUN`; its error as text.
    fn cli(&self, args: &[&str]) -> Result<(), String> {
        let out = Command::new(self.exe)
            .args(args)
            .arg("--run-dir")
            .arg(self.run_dir)
            .stdin(Stdio::null())
            .output()
            .map_err(|e| format!("bulkhead {}: {e}", args.join(" ")))?;
        if out.status.success() {
            Ok(())
        } else {
            Err(format!("bulkhead {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim()))
        }
    }

    /// Waits until `name` has been restarted past `restarts` and serves; then reads the
    /// outage serve measured, once the first request after it has completed.
    fn recovered(&mut self, name: &str, restarts: u64, last: Option<f64>, what: &str) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            match device(self.control, name) {
                Some(d) if d.restarts > restarts && !d.restarting && d.state == DeviceState::Running => break,
                Some(d) if d.state == DeviceState::Failed => {
                    self.error(format!("{what} on {name}: the device failed: {}", d.failure.unwrap_or_default()));
                    return;
                }
                _ if Instant::now() > deadline => {
                    self.error(format!("{what} on {name}: not serving again within 30 s"));
                    return;
                }
                _ => {
                    self.keep_remote_up();
                    std::thread::sleep(Duration::from_millis(5));
                }
            }
        }
        // The outage ends with the first request answered after it: fio sends one soon.
        let deadline = Instant::now() + Duration::from_secs(3);
        while Instant::now() < deadline {
            if let Some(ms) = device(self.control, name).and_then(|d| d.last_outage_ms).filter(|&ms| Some(ms) != last) {
                self.outages.push(ms);
                return;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// `signal` to `name`'s driver domain; waits for its replacement.
    fn kill_driver(&mut self, name: &str, signal: i32, kind: &str) {
        let Some(d) = device(self.control, name) else { return self.error(format!("{kind}: no status of {name}")) };
        if d.driver_pid == 0 || d.restarting {
            return;
        }
        let (restarts, last, pid) = (d.restarts, d.last_outage_ms, d.driver_pid);
        if bulkhead_sys::signal(pid, signal).is_err() {
            return;
        }
        if signal == libc::SIGSTOP {
            // The watchdog replaces a stopped domain once a request waits on it for
            // `watchdog_ms`. One nothing is asked of (a driver below a `cow` whose reads all
            // come from the overlay) stays stopped, harmlessly: resumed after a while.
            let deadline = Instant::now() + Duration::from_secs(5);
            while Instant::now() < deadline && device(self.control, name).is_some_and(|d| d.restarts == restarts) {
                std::thread::sleep(Duration::from_millis(10));
            }
            if device(self.control, name).is_some_and(|d| d.restarts == restarts) {
                let _ = bulkhead_sys::signal(pid, libc::SIGCONT);
                self.counted(STOP_IDLE);
                return;
            }
        }
        self.counted(kind);
        self.recovered(name, restarts, last, kind);
    }

    /// SIGKILL to `name`'s tap domain, if it has one now; waits for its replacement.
    fn kill_tap(&mut self, name: &str) {
        let Some(d) = device(self.control, name) else { return self.error(format!("{KILL_TAP}: no status of {name}")) };
        let Some(pid) = d.tap_pid.filter(|&p| p != 0 && p != d.driver_pid) else { return };
        if d.restarting {
            return;
        }
        let (restarts, last) = (d.restarts, d.last_outage_ms);
        if bulkhead_sys::signal(pid, libc::SIGKILL).is_err() {
            return;
        }
        self.counted(KILL_TAP);
        self.recovered(name, restarts, last, KILL_TAP);
    }

    /// A `delay` filter added to `name`, and removed after `hold`.
    fn filter_add_remove(&mut self, name: &str, hold: Duration) {
        if let Err(e) = self.cli(&["filter", "add", name, "type = \"delay\"", "read_us = 20", "write_us = 20"]) {
            return self.error(e);
        }
        self.counted(FILTER_ADD);
        std::thread::sleep(hold);
        match self.cli(&["filter", "remove", name, "0"]) {
            Ok(()) => self.counted(FILTER_REMOVE),
            Err(e) => self.error(e),
        }
    }

    /// `name`'s filters moved to the other side: its driver domain or a tap domain.
    fn tap_switch(&mut self, name: &str) {
        let Some(d) = device(self.control, name) else { return self.error(format!("{TAP_SWITCH}: no status of {name}")) };
        let to = if d.tap == "passthrough" { "interpose" } else { "passthrough" };
        match self.cli(&["device", "tap", name, to]) {
            Ok(()) => self.counted(TAP_SWITCH),
            Err(e) => self.error(e),
        }
    }

    /// Snapshot `n` of `name`'s overlay taken, and the third-last deleted.
    fn snapshot(&mut self, name: &str, n: u64) {
        if let Err(e) = self.cli(&["snapshot", "create", name, &format!("chaos{n}")]) {
            return self.error(e);
        }
        self.counted(SNAPSHOT);
        if n > 3 {
            if let Err(e) = self.cli(&["snapshot", "delete", name, &format!("chaos{}", n - 3)]) {
                self.error(e);
            }
        }
    }

    /// nbdkit killed, and started again after `down`; waits until `remote0` serves again.
    fn remote_restart(&mut self, down: Duration) {
        self.remote.kill();
        self.counted(REMOTE_RESTART);
        std::thread::sleep(down);
        if let Err(e) = self.remote.start() {
            return self.error(format!("{REMOTE_RESTART}: {e}"));
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            match device(self.control, "remote0") {
                Some(d) if d.state == DeviceState::Failed => {
                    return self.error(format!("{REMOTE_RESTART}: remote0 failed: {}", d.failure.unwrap_or_default()))
                }
                Some(d) if !d.restarting && d.state == DeviceState::Running => return,
                _ if Instant::now() > deadline => {
                    return self.error(format!("{REMOTE_RESTART}: remote0 not serving within 30 s"))
                }
                _ => {
                    self.keep_remote_up();
                    std::thread::sleep(Duration::from_millis(10));
                }
            }
        }
    }
}

/// The report as tables.
pub fn render(r: &Report) -> String {
    let mut t = Table::new(&["fault", "count"]);
    for (k, n) in &r.faults {
        t.row(vec![k.clone(), n.to_string()]);
    }
    t.row(vec!["all (goal ≥ 1,000 in 30 min)".into(), r.total_faults.to_string()]);
    let mut f = Table::new(&["file system", "over", "fio error", "written", "e2fsck"]);
    for fs in &r.filesystems {
        let err = if fs.fio_error == 0 { "0".to_string() } else { format!("{} ({})", fs.fio_error, fs.fio_says) };
        let fsck = if fs.fsck_clean { "clean".to_string() } else { format!("NOT clean: {}", fs.fsck_says) };
        f.row(vec![fs.device.clone(), fs.over.clone(), err, format!("{:.0} MiB", fs.written_mib), fsck]);
    }
    let mut s = Table::new(&["what", "figure"]);
    s.row(vec!["seconds of faults".into(), format!("{:.0}", r.seconds)]);
    s.row(vec!["application errors (goal 0)".into(), r.app_errors.to_string()]);
    s.row(vec!["verify failures (goal 0)".into(), r.verify_failures.to_string()]);
    s.row(vec![
        "outage p50, p99, max".into(),
        format!("{:.1} ms, {:.1} ms, {:.1} ms ({} outages)", r.outage_p50_ms, r.outage_p99_ms, r.outage_max_ms, r.outages),
    ]);
    s.row(vec![
        format!("serve's private memory: start, a third in, end (goal: growth from a third in ≤ {MEMORY_NOISE_MIB:.0} MiB)"),
        format!(
            "{:.0} MiB, {:.0} MiB, {:.0} MiB{}",
            r.rss_start_mib,
            r.rss_before_mib,
            r.rss_after_mib,
            if r.memory_grew() { ": grew" } else { "" }
        ),
    ]);
    s.row(vec!["devices failed".into(), if r.failed_devices.is_empty() { "none".into() } else { r.failed_devices.join(", ") }]);
    for e in &r.fault_errors {
        s.row(vec!["fault error".into(), e.clone()]);
    }
    let mut out =
        format!("Chaos: faults under fio verify on ext4 (seed {})\n{}\n{}\n{}", r.seed, t.render(), f.render(), s.render());
    if r.interrupted {
        out.push_str("interrupted: the results above are partial\n");
    }
    if !r.serve_log.is_empty() {
        out.push_str(&format!("serve's log, last lines:\n{}\n", r.serve_log));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn clean() -> Report {
        Report {
            filesystems: vec![FsReport {
                device: "d".into(),
                over: "FUSE".into(),
                fio_error: 0,
                fio_says: String::new(),
                written_mib: 1.0,
                fsck_clean: true,
                fsck_says: String::new(),
            }],
            ..Default::default()
        }
    }

    #[test]
    fn a_clean_run_lost_nothing_and_each_kind_of_loss_is_one() {
        assert!(!clean().lost_anything());
        let mut r = clean();
        r.app_errors = 1;
        assert!(r.lost_anything());
        let mut r = clean();
        r.verify_failures = 1;
        assert!(r.lost_anything());
        let mut r = clean();
        r.filesystems[0].fsck_clean = false;
        assert!(r.lost_anything());
        let mut r = clean();
        r.failed_devices.push("d".into());
        assert!(r.lost_anything());
        let mut r = clean();
        r.fault_errors.push("not serving again".into());
        assert!(r.lost_anything());
    }

    #[test]
    fn memory_counts_as_grown_only_beyond_the_noise_from_a_third_in() {
        let mut r = clean();
        (r.rss_start_mib, r.rss_before_mib, r.rss_after_mib) = (40.0, 80.0, 80.0 + MEMORY_NOISE_MIB);
        assert!(!r.memory_grew(), "the warm-up before a third in is not growth");
        r.rss_after_mib += 1.0;
        assert!(r.memory_grew());
    }

    #[test]
    fn fio_reports_become_errors_verify_failures_or_nothing() {
        let dir = std::env::temp_dir().join(format!("chaos-fio-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let ok = std::process::Command::new("true").status().unwrap();
        let failed = std::process::Command::new("false").status().unwrap();
        let out = dir.join("r.json");
        std::fs::write(&out, r#"note: a line first{"jobs":[{"error":0,"write":{"io_bytes":2097152}}]}"#).unwrap();
        let r = fio_result("d", "FUSE", &out, Some(ok), false, "");
        assert_eq!((r.fio_error, r.written_mib), (0, 2.0));
        std::fs::write(&out, r#"{"jobs":[{"error":84,"write":{"io_bytes":0}}]}"#).unwrap();
        assert_eq!(fio_result("d", "FUSE", &out, Some(failed), false, "verify: bad header").fio_error, 84);
        assert_eq!(fio_result("d", "FUSE", &out, Some(failed), true, "").fio_error, 84, "stopped, yet it failed first");
        // No report, or killed at the deadline: an error, never a pass.
        std::fs::remove_file(&out).unwrap();
        assert_eq!(fio_result("d", "FUSE", &out, Some(ok), false, "").fio_error, -1);
        assert_eq!(fio_result("d", "FUSE", &out, None, false, "").fio_error, -1);
        std::fs::write(&out, r#"{"jobs":[{"error":0}]}"#).unwrap();
        assert_eq!(fio_result("d", "FUSE", &out, Some(failed), false, "").fio_error, -1, "fio exited non-zero");
        assert_eq!(fio_result("d", "FUSE", &out, Some(failed), true, "").fio_error, 0, "stopped by the run: fine");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
