//! `bulkhead bench …`: the benchmarks are a program of their own, `bulkhead-bench`, in a
//! package of their own; this hands the command line over to it.

use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::ExitCode;

/// The name of the benchmarks' program.
const BENCH: &str = "bulkhead-bench";

/// Runs `bulkhead-bench` (beside this executable, else on `PATH`) with `args`, in place of
/// this process; returns only if it cannot.
pub fn hand_over(args: &[std::ffi::OsString]) -> anyhow::Result<ExitCode> {
    let own = std::env::current_exe().ok();
    let beside = own.as_ref().map(|e| e.with_file_name(BENCH)).filter(|p| p.is_file());
    let Some(bench) = beside.or_else(on_path) else {
        anyhow::bail!(
            "the benchmarks are a program of their own, {BENCH}, and it is not installed: install its package \
             (bulkhead-bench_*.deb, which scripts/package.sh builds) or build it with `cargo build --release -p \
             bulkhead-bench`"
        );
    };
    let mut cmd = std::process::Command::new(&bench);
    cmd.args(args);
    // The benchmarks run this `bulkhead`, not another one on PATH.
    if let Some(own) = own {
        cmd.env("BULKHEAD_EXE", own);
    }
    let e = cmd.exec();
    Err(anyhow::anyhow!("cannot run {}: {e}", bench.display()))
}

fn on_path() -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path).map(|d| d.join(BENCH)).find(|p| p.is_file())
}
