//! The benchmarks of `bulkhead-bench` (and `bulkhead-bench`, which hands over to it).
//!
//! Each benchmark runs the real pieces: the channel benchmark execs a real driver domain
//! (`bulkhead driver`) with a `ram` backend and drives it from this process; the fileio benchmark
//! runs `bulkhead serve` and the peers under sysbench, through the kernel; the tap benchmark
//! runs a supervisor in this process with and without filters, through the library and FUSE;
//! the surge benchmark reads files on ext4 over a `vpt` device per disk scheduler, beside the
//! simulator.
#![deny(missing_docs)]

pub mod channel;
pub mod chaos;
// The command line: its items are documented by the help text clap makes of their comments.
#[allow(missing_docs)]
pub mod cli;
pub mod fileio;
pub mod fio;
pub mod guard;
pub mod guard_figures;
pub mod guard_filters;
pub mod guard_isolation;
pub mod idle;
pub mod images;
pub mod nbd;
pub mod overload;
pub mod powercut;
pub mod rbd;
pub mod restart;
pub mod serve_restart;
pub mod share;
pub mod share_attach;
pub mod share_nbd;
#[cfg(feature = "test-driver")]
pub mod storm;
pub mod surge;
pub mod tap;
pub mod ublk;
pub mod vdev;
pub mod vm;

pub use bulkhead_control::table::Table;

use std::path::{Path, PathBuf};

/// Why a benchmark could not run or finish.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// An option is out of its range, or options conflict.
    #[error("{0}")]
    Options(String),
    /// A file or program could not be used.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file or program.
        path: PathBuf,
        /// What went wrong.
        source: std::io::Error,
    },
    /// What was measured failed: a system under test, a workload, a check.
    #[error("{0}")]
    Run(String),
}

impl BenchError {
    /// An I/O error on `path`.
    pub fn io(path: &Path, source: std::io::Error) -> Self {
        BenchError::Io { path: path.to_path_buf(), source }
    }
}

impl From<String> for BenchError {
    fn from(m: String) -> Self {
        BenchError::Run(m)
    }
}

impl From<bulkhead_supervisor::Error> for BenchError {
    fn from(e: bulkhead_supervisor::Error) -> Self {
        BenchError::Run(e.to_string())
    }
}

impl From<bulkhead_vdev::VdevError> for BenchError {
    fn from(e: bulkhead_vdev::VdevError) -> Self {
        BenchError::Run(e.to_string())
    }
}

impl From<&str> for BenchError {
    fn from(m: &str) -> Self {
        BenchError::Run(m.to_string())
    }
}

/// fio's JSON report from its standard output (an I/O engine may print before the report),
/// refused if its first job saw an error; `what` names the run in errors.
pub fn fio_report(stdout: &[u8], what: &str) -> Result<serde_json::Value, BenchError> {
    let text = String::from_utf8_lossy(stdout);
    let json = text.find('{').map(|at| &text[at..]).ok_or_else(|| format!("fio on {what}: no report"))?;
    let v: serde_json::Value = serde_json::from_str(json).map_err(|e| format!("fio on {what}: {e}"))?;
    if v["jobs"][0]["error"].as_i64() != Some(0) {
        return Err(BenchError::Run(format!("fio on {what}: error {}", v["jobs"][0]["error"])));
    }
    Ok(v)
}

/// One point of a benchmark that runs fio: its name, `rw`, block size and queue depth.
#[derive(Debug, Clone, Copy)]
pub(crate) struct FioPoint {
    pub name: &'static str,
    pub rw: &'static str,
    pub bs: u32,
    pub qd: u32,
}

/// CPU seconds per 100k requests, by process, one entry per round: what every benchmark that
/// compares systems gives for each of them.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct CpuPer100k {
    /// What serves the requests, together: `serve` and its domain, or the peer's process.
    pub server: Vec<f64>,
    /// `serve` alone (bulkhead only).
    pub serve: Vec<f64>,
    /// The device's domain alone (bulkhead only).
    pub domain: Vec<f64>,
    /// The load generator: fio's job with its engine's library, the guest's QEMU, or the
    /// bench's own frontend.
    pub load: Vec<f64>,
}

impl CpuPer100k {
    /// The medians as `serve|domain|load` (bulkhead) or `server|load` (a peer), two decimals.
    pub fn by_process(&self) -> String {
        let m = |v: &[f64]| if v.is_empty() { "-".to_string() } else { format!("{:.2}", crate::median(v)) };
        if self.serve.is_empty() {
            format!("{}|{}", m(&self.server), m(&self.load))
        } else {
            format!("{}|{}|{}", m(&self.serve), m(&self.domain), m(&self.load))
        }
    }
}

/// CPU seconds of one job of a fio report, as fio counts them (its user and system shares of
/// the job's run time): the load generator, with its engine's library.
pub(crate) fn fio_job_cpu_seconds(job: &serde_json::Value) -> f64 {
    let runtime_s = job["job_runtime"].as_f64().unwrap_or(0.0) / 1e3;
    (job["usr_cpu"].as_f64().unwrap_or(0.0) + job["sys_cpu"].as_f64().unwrap_or(0.0)) / 100.0 * runtime_s
}

/// A page-aligned buffer for O_DIRECT.
pub(crate) struct Aligned {
    ptr: *mut u8,
    layout: std::alloc::Layout,
}

impl Aligned {
    pub(crate) fn new(len: usize) -> Self {
        let layout = std::alloc::Layout::from_size_align(len, 4096).expect("valid layout");
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        assert!(!ptr.is_null(), "allocation of {len} bytes failed");
        Aligned { ptr, layout }
    }

    pub(crate) fn buf(&mut self) -> &mut [u8] {
        // SAFETY: `ptr` is a live allocation of `layout.size()` bytes owned by `self`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.layout.size()) }
    }
}

impl Drop for Aligned {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { std::alloc::dealloc(self.ptr, self.layout) };
    }
}

/// An endless sequence of random numbers from `seed`: the same `seed`, the same numbers.
pub(crate) fn random(seed: u64) -> impl Iterator<Item = u64> {
    let mut rng = bulkhead_rng::Rng::new(seed);
    std::iter::repeat_with(move || rng.next_u64())
}

/// A duration from `from` to `to` ms, drawn from `rng`.
pub(crate) fn millis(rng: &mut bulkhead_rng::Rng, from: u64, to: u64) -> std::time::Duration {
    std::time::Duration::from_millis(from + rng.below(to - from + 1))
}

/// The nearest-rank percentile `q` (0 to 1) of `v`, in any order: the smallest value with at
/// least `q` of them at or below it (0 for none).
pub(crate) fn percentile(v: &[f64], q: f64) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    if s.is_empty() {
        return 0.0;
    }
    s[((s.len() as f64 * q).ceil() as usize).clamp(1, s.len()) - 1]
}

/// The median of `v`, in any order: the middle value, or the mean of the two middle ones (0
/// for none).
pub fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    match s.len() {
        0 => 0.0,
        n if !n.is_multiple_of(2) => s[n / 2],
        n => (s[n / 2 - 1] + s[n / 2]) / 2.0,
    }
}

/// The `q` quantile of `sorted` (0 when empty).
pub(crate) fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

/// A `bulkhead serve` a benchmark started in a directory of its own (`bench.toml`, `serve.log`,
/// the run directory `run`); stopped, and the directory removed, on drop.
pub(crate) struct BenchServe {
    pub(crate) child: std::process::Child,
    pub(crate) dir: std::path::PathBuf,
}

impl BenchServe {
    /// Starts `exe serve` with `config` and `args`, `env` set, and waits up to a minute until
    /// `ready` says it serves.
    pub(crate) fn start(
        exe: &std::path::Path,
        tag: &str,
        config: &str,
        args: &[&std::ffi::OsStr],
        env: &[(&str, &str)],
        ready: impl Fn(&BenchServe) -> bool,
    ) -> Result<BenchServe, BenchError> {
        Self::start_grouped(exe, tag, config, args, env, false, ready)
    }

    /// As [`start`](Self::start), with `own_group` in a process group of its own: a Ctrl-C at
    /// the terminal then reaches only the benchmark, which unmounts what it mounted over
    /// serve's exports before it stops serve.
    pub(crate) fn start_grouped(
        exe: &std::path::Path,
        tag: &str,
        config: &str,
        args: &[&std::ffi::OsStr],
        env: &[(&str, &str)],
        own_group: bool,
        ready: impl Fn(&BenchServe) -> bool,
    ) -> Result<BenchServe, BenchError> {
        use std::os::unix::process::CommandExt;
        let dir = std::env::temp_dir().join(format!("bulkhead-bench-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).map_err(|e| BenchError::io(&dir, e))?;
        let cfg = dir.join("bench.toml");
        std::fs::write(&cfg, config).map_err(|e| BenchError::io(&cfg, e))?;
        let log = dir.join("serve.log");
        let err = std::fs::File::create(&log).map_err(|e| BenchError::io(&log, e))?;
        let mut cmd = std::process::Command::new(exe);
        if own_group {
            cmd.process_group(0);
        }
        let child = cmd
            .arg("serve")
            .arg("--config")
            .arg(&cfg)
            .arg("--run-dir")
            .arg(dir.join("run"))
            .args(args)
            .envs(env.iter().copied())
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(err)
            .spawn()
            .map_err(|e| BenchError::io(exe, e))?;
        let s = BenchServe { child, dir };
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while !ready(&s) {
            if std::time::Instant::now() > deadline {
                return Err(BenchError::Run(format!("serve did not start:\n{}", s.log_tail())));
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        Ok(s)
    }

    /// The run directory.
    pub(crate) fn run_dir(&self) -> std::path::PathBuf {
        self.dir.join("run")
    }

    /// What it logged so far.
    pub(crate) fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("serve.log")).unwrap_or_default()
    }

    /// The last 20 lines of it, for an error.
    pub(crate) fn log_tail(&self) -> String {
        let text = self.log();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }
}

impl Drop for BenchServe {
    fn drop(&mut self) {
        // A keeper's serve flushes and ends its domains first: give it time.
        stop_child(&mut self.child, std::time::Duration::from_secs(60));
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// CPU seconds of the calling thread, to the nanosecond.
pub(crate) fn thread_cpu_seconds() -> f64 {
    cpu_clock_seconds(libc::CLOCK_THREAD_CPUTIME_ID)
}

/// CPU seconds of this process, to the nanosecond (`/proc` counts clock ticks).
pub(crate) fn process_cpu_seconds() -> f64 {
    cpu_clock_seconds(libc::CLOCK_PROCESS_CPUTIME_ID)
}

fn cpu_clock_seconds(clock: libc::clockid_t) -> f64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `ts` is a valid timespec for the kernel to fill.
    if unsafe { libc::clock_gettime(clock, &mut ts) } != 0 {
        return 0.0;
    }
    ts.tv_sec as f64 + ts.tv_nsec as f64 / 1e9
}

/// User and system CPU seconds of `pid`.
pub(crate) fn cpu_seconds(pid: u32) -> f64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { return 0.0 };
    let Some(rest) = stat.rfind(')').map(|i| &stat[i + 2..]) else { return 0.0 };
    let f: Vec<&str> = rest.split_whitespace().collect();
    let t = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    (t(11) + t(12)) as f64 / bulkhead_sys::clock_ticks_per_second() as f64
}

/// The status of the `serve` whose control socket is `socket` (`None` while it does not answer).
pub fn serve_status(socket: &std::path::Path) -> Option<bulkhead_control::StatusReport> {
    bulkhead_control::Client::connect_socket(socket).ok()?.call(bulkhead_control::Status {}).ok()
}

/// The processes of every domain of a `serve`, from its status: driver and tap domains.
pub fn domain_pids(report: &bulkhead_control::StatusReport) -> Vec<u32> {
    let mut pids: Vec<u32> =
        report.devices.iter().flat_map(|d| [Some(d.driver_pid), d.tap_pid]).flatten().filter(|&p| p != 0).collect();
    pids.sort_unstable();
    pids.dedup();
    pids
}

/// Removes a directory, with what it holds, when dropped: a run's scratch files, however
/// the run ends.
pub(crate) struct RemoveDir(pub(crate) std::path::PathBuf);

impl Drop for RemoveDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Ends a server this benchmark started: SIGTERM (it stops cleanly), up to `grace` to exit,
/// then SIGKILL; reaped either way.
pub(crate) fn stop_child(child: &mut std::process::Child, grace: std::time::Duration) {
    let _ = bulkhead_sys::signal(child.id(), libc::SIGTERM);
    let deadline = std::time::Instant::now() + grace;
    while std::time::Instant::now() < deadline {
        if let Ok(Some(_)) = child.try_wait() {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_by_process_splits_bulkhead_and_gives_a_peer_its_server_and_load() {
        let ours = CpuPer100k { server: vec![3.0, 5.0], serve: vec![1.0, 2.0], domain: vec![2.0, 3.0], load: vec![4.0, 6.0] };
        assert_eq!(ours.by_process(), "1.50|2.50|5.00");
        let peer = CpuPer100k { server: vec![2.25], load: vec![7.0], ..Default::default() };
        assert_eq!(peer.by_process(), "2.25|7.00");
        assert_eq!(CpuPer100k::default().by_process(), "-|-");
    }
}
