//! Benchmarks behind `bulkhead bench`.
//!
//! Each benchmark runs the real pieces: the channel benchmark execs a real driver domain
//! (`bulkhead driver`) with a `ram` backend and drives it from this process; the fileio benchmark
//! runs `bulkhead serve` and the peers under sysbench, through the kernel; the tap benchmark
//! runs a supervisor in this process with and without filters, through the library and FUSE;
//! the surge benchmark reads files on ext4 over a `vpt` device per disk scheduler, beside the
//! simulator.
#![deny(missing_docs)]

pub mod channel;
pub mod fileio;
pub mod guard;
pub mod guard_figures;
pub mod guard_filters;
pub mod guard_isolation;
pub mod idle;
pub mod images;
pub mod powercut;
pub mod rbd;
pub mod restart;
pub mod serve_restart;
pub mod share;
pub mod share_attach;
pub mod share_nbd;
pub mod surge;
mod table;
pub mod tap;
pub mod vdev;
pub mod vm;

pub use table::Table;

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

/// User and system CPU seconds of `pid`.
pub(crate) fn cpu_seconds(pid: u32) -> f64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { return 0.0 };
    let Some(rest) = stat.rfind(')').map(|i| &stat[i + 2..]) else { return 0.0 };
    let f: Vec<&str> = rest.split_whitespace().collect();
    let t = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    (t(11) + t(12)) as f64 / bulkhead_sys::clock_ticks_per_second() as f64
}

/// Ends a server this benchmark started: SIGTERM (it stops cleanly), up to `grace` to exit,
/// then SIGKILL; reaped either way.
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
