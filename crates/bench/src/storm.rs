//! `bulkhead-test-driver bench storm`: a hostile driver domain rings its doorbell as fast as it can, and
//! the frontend must not pay for it: `serve` stays under one core, and another device's
//! latency stays near what it is without the storm.
//!
//! The hostile driver is the test driver's: `exe` is `bulkhead-test-driver`, built with the
//! `test-driver` feature, which is the whole of `bulkhead` with the test kit's faults in its
//! domains; the shipped binary has no hostile behaviour. A `serve` runs two `ram` devices with it, `storm` (irq notification: every wait of the frontend
//! sleeps on the doorbell a storm attacks) and `victim`. A load thread keeps `storm` busy at
//! the same pace in both phases; after a few dozen requests its driver turns hostile and rings the frontend in a tight
//! loop, answering slowly. A probe reads 4 KiB at random offsets of `victim` with O_DIRECT,
//! one at a time, for `--seconds`, and records each latency. Rounds alternate: the same run
//! without the fault (the test driver then runs the real driver runtime), then with it.
//! The driver says how often it rang (its log lines reach `serve`'s log); `serve`'s own CPU
//! time over the probe's window is the frontend's cost.

use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::{quantile, Aligned, BenchError, BenchServe, Table};

/// Options.
#[derive(Debug, Clone)]
pub struct Options {
    /// Seconds each phase's probe runs.
    pub seconds: u64,
    /// Rounds, each without and then with the storm.
    pub rounds: usize,
}

/// One phase of one round.
#[derive(Debug, Clone, Serialize)]
pub struct Phase {
    /// Whether the storm was on.
    pub storm: bool,
    /// The victim's reads.
    pub reads: u64,
    /// Their median latency, µs.
    pub p50_us: f64,
    /// Their 99th percentile latency, µs.
    pub p99_us: f64,
    /// `serve`'s CPU over the window, in cores.
    pub frontend_cores: f64,
    /// The driver's doorbell rings per second (storm only).
    pub rings_per_s: f64,
    /// Reads of the victim that failed.
    pub errors: u64,
}

/// Results.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// Seconds of each phase.
    pub seconds: u64,
    /// Every phase, in the order run.
    pub phases: Vec<Phase>,
    /// Medians over the rounds, without the storm.
    pub normal_p99_us: f64,
    /// Medians over the rounds, with it.
    pub storm_p99_us: f64,
    /// The victim's p99 under the storm over its p99 without (goal ≤ 2).
    pub p99_ratio: f64,
    /// The frontend's CPU under the storm, median, in cores (goal < 1).
    pub storm_frontend_cores: f64,
    /// The storm's rate, median, rings per second (at least 10⁶ asked).
    pub rings_per_s: f64,
}

const CONFIG: &str = "[nbd]\nenabled = false\n\n\
    [[device]]\nname = \"storm\"\nsize = \"64M\"\nnotify = \"irq\"\nwatchdog_ms = 2000\nrestart_limit = 100000\n\
    [device.backend]\ntype = \"ram\"\n\n\
    [[device]]\nname = \"victim\"\nsize = \"64M\"\n[device.backend]\ntype = \"ram\"\n";

/// The benchmark's `serve`, with the fault or without.
fn start(exe: &Path, storm: bool) -> Result<BenchServe, BenchError> {
    let env: &[(&str, &str)] =
        if storm { &[("BULKHEAD_TEST_FAULT", "hostile:doorbell-storm"), ("BULKHEAD_TEST_FAULT_DEVICE", "storm")] } else { &[] };
    BenchServe::start(exe, "storm", CONFIG, &[], env, |s| {
        s.run_dir().join("fuse/storm").exists() && s.run_dir().join("fuse/victim").exists()
    })
}

/// `dev`'s FUSE file, opened for O_DIRECT.
fn open(serve: &BenchServe, dev: &str) -> Result<std::fs::File, BenchError> {
    let path = serve.run_dir().join("fuse").join(dev);
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(&path)
        .map_err(|e| BenchError::io(&path, e))
}

/// Keeps `file` busy at the same pace with or without the storm, a 4 KiB write then a read of
/// it every 2 ms (a storming driver answers a batch every 2 ms), until `stop`; counts
/// completions.
fn busy(file: std::fs::File, stop: Arc<AtomicBool>, done: Arc<AtomicU64>) {
    let mut buf = Aligned::new(4096);
    let mut i = 0u64;
    while !stop.load(Ordering::Relaxed) {
        let at = (i % 4096) * 4096;
        buf.buf()[..8].copy_from_slice(&i.to_le_bytes());
        if file.write_all_at(buf.buf(), at).is_err() || file.read_exact_at(buf.buf(), at).is_err() {
            std::thread::sleep(Duration::from_millis(10));
        }
        done.fetch_add(2, Ordering::Relaxed);
        i += 1;
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// The last rate the storming driver said, rings per second.
fn rings_per_s(log: &str) -> f64 {
    log.lines()
        .rev()
        .find_map(|l| {
            let rest = &l[l.find("doorbell storm: ")? + "doorbell storm: ".len()..];
            let (rings, rest) = rest.split_once(" rings in ")?;
            let secs = rest.strip_suffix(" s")?;
            Some(rings.trim().parse::<f64>().ok()? / secs.trim().parse::<f64>().ok()?.max(1e-9))
        })
        .unwrap_or(0.0)
}

/// Runs one phase.
fn phase(exe: &Path, opts: &Options, storm: bool) -> Result<Phase, BenchError> {
    let serve = start(exe, storm)?;
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicU64::new(0));
    let loader = {
        let (f, stop, done) = (open(&serve, "storm")?, stop.clone(), done.clone());
        std::thread::spawn(move || busy(f, stop, done))
    };
    // The driver turns hostile after a few hundred requests; wait for it to say so.
    let deadline = Instant::now() + Duration::from_secs(30);
    while done.load(Ordering::Relaxed) < 400 || (storm && !serve.log().contains("misbehaving from now on")) {
        if Instant::now() > deadline {
            stop.store(true, Ordering::Relaxed);
            let _ = loader.join();
            return Err(BenchError::Run(format!("the storm device never got going:\n{}", serve.log())));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let victim = open(&serve, "victim")?;
    let mut buf = Aligned::new(4096);
    let mut lat = Vec::new();
    let mut errors = 0;
    let mut rng = bulkhead_rng::Rng::new(0);
    let cpu0 = crate::cpu_seconds(serve.child.id());
    let t0 = Instant::now();
    let until = t0 + Duration::from_secs(opts.seconds);
    while Instant::now() < until {
        let x = rng.next_u64();
        let at = (x % (16384 - 1)) * 4096;
        let t = Instant::now();
        match victim.read_exact_at(buf.buf(), at) {
            Ok(()) => lat.push(t.elapsed().as_secs_f64() * 1e6),
            Err(_) => errors += 1,
        }
    }
    let window = t0.elapsed().as_secs_f64();
    let frontend_cores = (crate::cpu_seconds(serve.child.id()) - cpu0) / window;
    stop.store(true, Ordering::Relaxed);
    let _ = loader.join();
    let log = serve.log();
    lat.sort_by(f64::total_cmp);
    Ok(Phase {
        storm,
        reads: lat.len() as u64,
        p50_us: quantile(&lat, 0.5),
        p99_us: quantile(&lat, 0.99),
        frontend_cores,
        rings_per_s: if storm { rings_per_s(&log) } else { 0.0 },
        errors,
    })
}

/// Runs the rounds with `exe` (the test build, which takes `serve` as `bulkhead` does; needs
/// root for FUSE).
pub fn run(exe: &Path, opts: &Options, mut progress: impl FnMut(&str)) -> Result<Report, BenchError> {
    if !(1..=3600).contains(&opts.seconds) || !(1..=100).contains(&opts.rounds) {
        return Err(BenchError::Options(format!(
            "{} s and {} rounds: seconds are 1..=3600, rounds 1..=100",
            opts.seconds, opts.rounds
        )));
    }
    let mut phases = Vec::new();
    for round in 0..opts.rounds {
        for storm in [false, true] {
            let p = phase(exe, opts, storm)?;
            progress(&format!(
                "round {}: {}: victim p99 {:.0} µs, frontend {:.2} cores{}",
                round + 1,
                if storm { "storm" } else { "normal" },
                p.p99_us,
                p.frontend_cores,
                if storm { format!(", {:.2e} rings/s", p.rings_per_s) } else { String::new() }
            ));
            phases.push(p);
        }
    }
    let of =
        |storm: bool, f: fn(&Phase) -> f64| crate::median(&phases.iter().filter(|p| p.storm == storm).map(f).collect::<Vec<_>>());
    let (normal_p99_us, storm_p99_us) = (of(false, |p| p.p99_us), of(true, |p| p.p99_us));
    Ok(Report {
        seconds: opts.seconds,
        normal_p99_us,
        storm_p99_us,
        p99_ratio: storm_p99_us / normal_p99_us.max(1e-9),
        storm_frontend_cores: of(true, |p| p.frontend_cores),
        rings_per_s: of(true, |p| p.rings_per_s),
        phases,
    })
}

/// The report as a table.
pub fn render(r: &Report) -> String {
    let mut t = Table::new(&["phase", "victim reads", "p50 µs", "p99 µs", "frontend cores", "rings/s", "errors"]);
    for p in &r.phases {
        t.row(vec![
            if p.storm { "storm" } else { "normal" }.to_string(),
            p.reads.to_string(),
            format!("{:.0}", p.p50_us),
            format!("{:.0}", p.p99_us),
            format!("{:.2}", p.frontend_cores),
            if p.storm { format!("{:.2e}", p.rings_per_s) } else { "-".into() },
            p.errors.to_string(),
        ]);
    }
    let mut out = format!("Doorbell storm: {} s per phase, alternated\n", r.seconds);
    out.push_str(&t.render());
    out.push_str(&format!(
        "victim p99 {:.0} µs under the storm, {:.0} µs without: {:.2}x (goal ≤ 2); frontend {:.2} cores under it (goal < 1); \
         {:.2e} rings/s\n",
        r.storm_p99_us, r.normal_p99_us, r.p99_ratio, r.storm_frontend_cores, r.rings_per_s,
    ));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rate_is_the_last_the_driver_said() {
        let log = "bulkhead: device storm: driver: doorbell storm: 5000000 rings in 5.000 s\n\
                   other\nbulkhead: device storm: driver: doorbell storm: 12000000 rings in 10.000 s\n";
        assert_eq!(rings_per_s(log), 1_200_000.0);
        assert_eq!(rings_per_s("nothing said"), 0.0);
    }
}
