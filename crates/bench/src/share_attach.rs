//! `bench share`'s attached-application row: QD1 4 KiB random reads on one ram device of a
//! `bulkhead serve`, through `bulkhead_client::attach` (this process attached, no hop), through
//! the FUSE file (fio, O_DIRECT) and through the NBD export (fio's nbd engine), per
//! notification mode.

use crate::BenchError;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::fileio::{wait_for, which, Procs};

/// One path's latency.
#[derive(Debug, Clone, Serialize)]
pub struct AttachRow {
    /// Notification mode of the device.
    pub mode: String,
    /// `attach`, `fuse` or `nbd`.
    pub path: String,
    /// Completion latency, µs.
    pub p50_us: f64,
    /// The same, 99th percentile.
    pub p99_us: f64,
}

const SIZE: u64 = 256 << 20;

/// A run directory removed when dropped (after the serve in it has stopped).
struct Scratch(PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn serve(exe: &Path, dir: &Path, mode: &str) -> Result<Procs, BenchError> {
    let config = format!(
        "[[device]]\nname = \"disk0\"\nsize = \"{}M\"\nnotify = \"{mode}\"\n[device.backend]\ntype = \"ram\"\n",
        SIZE >> 20
    );
    let path = dir.join("serve.toml");
    std::fs::write(&path, config).map_err(|e| e.to_string())?;
    let log = std::fs::File::create(dir.join("serve.log")).map_err(|e| e.to_string())?;
    let mut child = Command::new(exe)
        .args(["serve", "--config"])
        .arg(&path)
        .arg("--run-dir")
        .arg(dir.join("run"))
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .map_err(|e| format!("bulkhead serve: {e}"))?;
    let up = wait_for(&dir.join("run/control.sock"), "bulkhead", Some(&mut child))
        .and_then(|()| wait_for(&dir.join("run/fuse/disk0"), "bulkhead", Some(&mut child)));
    let procs = Procs(vec![child]);
    up.map_err(|e| format!("{e}; its log: {}", std::fs::read_to_string(dir.join("serve.log")).unwrap_or_default()))?;
    Ok(procs)
}

/// Reads through an attachment for `seconds`: (p50, p99) µs.
fn attached(run: &Path, seconds: f64) -> Result<(f64, f64), BenchError> {
    let dev = bulkhead_client::attach(run, "disk0").map_err(|e| format!("attach: {e}"))?;
    let blocks = dev.size() / 4096;
    let mut buf = vec![0u8; 4096];
    let mut lat = Vec::with_capacity(1 << 20);
    let mut offsets = crate::random(0x2545_f491_4f6c_dd1d);
    let end = Instant::now() + Duration::from_secs_f64(seconds);
    while Instant::now() < end {
        let off = offsets.next().unwrap_or(1) % blocks * 4096;
        let t = Instant::now();
        dev.read_into(0, off, &mut buf).map_err(|e| format!("attached read: {e}"))?;
        lat.push(t.elapsed().as_secs_f64() * 1e6);
    }
    Ok((crate::percentile(&lat, 0.5), crate::percentile(&lat, 0.99)))
}

/// fio QD1 4 KiB random reads with `target` args: (p50, p99) µs.
fn fio(target: &[String], seconds: f64) -> Result<(f64, f64), BenchError> {
    let out = Command::new("timeout")
        .args(["--kill-after=10", &format!("{}", seconds as u64 + 60), "fio", "--name=qd1", "--time_based"])
        .args([&format!("--runtime={}", seconds.ceil() as u64), "--randrepeat=0", "--output-format=json"])
        .args(["--percentile_list=50:99", "--rw=randread", "--bs=4k", "--iodepth=1"])
        .args(target)
        .output()
        .map_err(|e| format!("fio: {e}"))?;
    if !out.status.success() {
        return Err(BenchError::Run(format!("fio: {}", String::from_utf8_lossy(&out.stderr).trim())));
    }
    let v = crate::fio_report(&out.stdout, "bench share attach")?;
    let p = |k: &str| v["jobs"][0]["read"]["clat_ns"]["percentile"][k].as_f64().unwrap_or(0.0) / 1000.0;
    Ok((p("50.000000"), p("99.000000")))
}

/// Runs every path in each of `modes`.
pub fn run(
    exe: &Path,
    modes: &[&str],
    seconds: f64,
    mut progress: impl FnMut(&str),
) -> Result<(Vec<AttachRow>, Vec<String>), BenchError> {
    let mut rows = Vec::new();
    let mut skipped = Vec::new();
    if !which("fio") {
        skipped.push("FUSE and NBD beside attach: fio is not installed".into());
    }
    for &mode in modes {
        progress(&format!("attached application, {mode}"));
        let dir = Scratch(PathBuf::from(format!("/tmp/bench-share-attach-{}-{mode}", std::process::id())));
        std::fs::create_dir_all(&dir.0).map_err(|e| e.to_string())?;
        let procs = serve(exe, &dir.0, mode)?;
        let run = dir.0.join("run");
        let row =
            |path: &str, (p50, p99): (f64, f64)| AttachRow { mode: mode.into(), path: path.into(), p50_us: p50, p99_us: p99 };
        // Written once through, so no path measures a page's first touch.
        {
            let dev = bulkhead_client::attach(&run, "disk0").map_err(|e| format!("attach: {e}"))?;
            let chunk = vec![0x5au8; 1 << 20];
            for i in 0..SIZE >> 20 {
                dev.write(0, i << 20, &chunk, false).map_err(|e| format!("fill: {e}"))?;
            }
        }
        rows.push(row("attach", attached(&run, seconds)?));
        if which("fio") {
            let file = format!("--filename={}", run.join("fuse/disk0").display());
            rows.push(row("fuse", fio(&["--ioengine=psync".into(), "--direct=1".into(), file], seconds)?));
            let uri = format!("--uri=nbd+unix:///disk0?socket={}", run.join("nbd.sock").display());
            // An engine's options follow it.
            rows.push(row("nbd", fio(&["--ioengine=nbd".into(), uri], seconds)?));
        }
        drop(procs);
    }
    Ok((rows, skipped))
}
