//! `bulkhead-bench restart`: how long a device is out when its driver domain is killed.
//!
//! A real supervisor serves one `ram` device whose domains come from spares and, after the
//! first kill, from the device's standby (`--spares`, `--standbys`; 0 execs them); load threads
//! write and read back 4 KiB blocks through the client library without pause, checking every
//! byte; the driver is SIGKILLed at random moments. The outage of each kill runs from the
//! supervisor noticing the death to the first request completed after it (the Xen paper
//! measured ~275 ms per driver restart). With `--tap interpose` the device has a tap domain
//! (running a `stats` filter) over a driver domain, and one of them is killed each time
//! (`--kill driver`, the default, or `--kill tap`): it is replaced alone while the other runs
//! on, the tap domain sending again what it had passed down, or the frontend what it had sent.
//! The outages that overlapped a spare being started in the background (the supervisor forks
//! it, and it execs and builds its sandbox, while the restart runs) are told apart from the
//! rest.

use crate::BenchError;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bulkhead_config::Config;
use bulkhead_supervisor::Supervisor;
use serde::Serialize;

use crate::Table;

/// Options.
#[derive(Debug, Clone)]
pub struct Options {
    /// Kills to perform.
    pub kills: usize,
    /// Notification mode of the device.
    pub mode: String,
    /// Load threads.
    pub threads: usize,
    /// `passthrough` (the driver domain alone) or `interpose` (a tap domain above it).
    pub tap: String,
    /// The domain killed with `interpose`: `driver` or `tap`.
    pub kill: String,
    /// Spare domains kept ready.
    pub spares: usize,
    /// Standby domains that may be kept at once.
    pub standbys: usize,
}

impl Options {
    /// Refuses options that do not go together.
    pub fn check(&self) -> Result<(), BenchError> {
        let bad = |m: String| Err(BenchError::Options(m));
        match (self.tap.as_str(), self.kill.as_str()) {
            ("passthrough" | "interpose", "driver") | ("interpose", "tap") => {}
            ("passthrough", "tap") => {
                return bad("--kill tap needs --tap interpose (only then is there a tap domain of its own)".into())
            }
            ("passthrough" | "interpose", kill) => return bad(format!("--kill must be driver or tap, not `{kill}`")),
            (tap, _) => return bad(format!("--tap must be passthrough or interpose, not `{tap}`")),
        }
        if !(1..=100_000).contains(&self.kills) || !(1..=64).contains(&self.threads) {
            return bad(format!("{} kills and {} threads: kills are 1..=100000, threads 1..=64", self.kills, self.threads));
        }
        Ok(())
    }
}

/// Results.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// Mode.
    pub mode: String,
    /// Tap mode.
    pub tap: String,
    /// The domain killed: `driver` or `tap`.
    pub killed: String,
    /// Kills performed.
    pub kills: usize,
    /// Restarts the supervisor made.
    pub restarts: u64,
    /// Spare domains kept ready.
    pub spares: usize,
    /// Spares given a device (at a restart, or ahead of one as a standby); the rest of the
    /// domains were exec'd.
    pub from_spares: u64,
    /// Restarts a standby domain took.
    pub from_standby: u64,
    /// Private memory of each spare waiting at the end, KiB (`RssAnon`).
    pub spare_private_kib: Vec<u64>,
    /// Private memory of the device's standby domain waiting at the end, KiB (`RssAnon`).
    pub standby_private_kib: Option<u64>,
    /// Outages measured.
    pub outages: usize,
    /// Median outage, ms.
    pub outage_p50_ms: f64,
    /// 99th percentile outage, ms.
    pub outage_p99_ms: f64,
    /// Longest outage, ms.
    pub outage_max_ms: f64,
    /// Outages that overlapped a spare being started in the background, from its fork to its
    /// word that it is ready.
    pub during_spare_start: usize,
    /// Median of those outages, ms.
    pub during_spare_start_p50_ms: f64,
    /// Longest of them, ms.
    pub during_spare_start_max_ms: f64,
    /// Median of the other outages, ms.
    pub otherwise_p50_ms: f64,
    /// Longest of the other outages, ms.
    pub otherwise_max_ms: f64,
    /// Requests completed by the load.
    pub requests: u64,
    /// Requests that failed or read back wrong data (must be 0).
    pub errors: u64,
    /// Seconds the run took.
    pub seconds: f64,
}

/// Runs the benchmark, execing `exe` for the domains.
pub fn run(exe: &Path, opts: &Options, mut progress: impl FnMut(&str)) -> Result<Report, BenchError> {
    opts.check()?;
    let kill_tap = opts.kill == "tap";
    let filters = if opts.tap == "interpose" { "[[device.filter]]\ntype = \"stats\"\n" } else { "" };
    let text = format!(
        "[fuse]\nenabled = false\n[domains]\nspares = {}\nstandbys = {}\n[[device]]\nname = \"r\"\nsize = \"256M\"\nqueues = {}\nnotify = \"{}\"\ntap = \"{}\"\n\
         restart_limit = 1000000\n[device.backend]\ntype = \"ram\"\n{filters}",
        opts.spares, opts.standbys, opts.threads, opts.mode, opts.tap
    );
    let config = Config::parse(&text, "bench restart").map_err(|e| e.to_string())?;
    let sup = Supervisor::start(&config, Some(exe)).map_err(|e| e.to_string())?;
    let dev = sup.devices()[0].clone();
    let stop = Arc::new(AtomicBool::new(false));
    let requests = Arc::new(AtomicU64::new(0));
    let errors = Arc::new(AtomicU64::new(0));
    let mut load = Vec::new();
    for t in 0..opts.threads {
        let (dev, stop, requests, errors) = (dev.clone(), stop.clone(), requests.clone(), errors.clone());
        load.push(std::thread::spawn(move || {
            let blocks = dev.size() / 4096 / 64;
            let mut rng = bulkhead_rng::Rng::new(0x9e37_79b9_u64 + t as u64);
            let mut buf = vec![0u8; 4096];
            let mut back = vec![0u8; 4096];
            while !stop.load(Ordering::Relaxed) {
                let x = rng.next_u64();
                // Each thread owns every 64th block group, so threads never overlap.
                let off = ((x % blocks) * 64 + t as u64) * 4096;
                buf.iter_mut().enumerate().for_each(|(i, b)| *b = (x >> (i % 8 * 8)) as u8 ^ i as u8);
                let ok = dev.write(t, off, &buf, false).is_ok() && dev.read_into(t, off, &mut back).is_ok() && back == buf;
                requests.fetch_add(2, Ordering::Relaxed);
                if !ok {
                    errors.fetch_add(1, Ordering::Relaxed);
                }
            }
        }));
    }
    let start = Instant::now();
    let mut rng = bulkhead_rng::Rng::new(0x1234_5678);
    let mut kills = 0;
    let mut last_pid = 0;
    while kills < opts.kills {
        let x = rng.next_u64();
        std::thread::sleep(Duration::from_millis(10 + x % 40));
        // One outage at a time: the previous restart must have served a request first.
        if sup.outages_ms("r").len() < kills {
            continue;
        }
        let st = sup.status();
        let d = &st.devices[0];
        let victim = if kill_tap { d.tap_pid.unwrap_or(0) } else { d.driver_pid };
        if victim == 0 || victim == last_pid {
            continue;
        }
        // A domain of our own supervisor, by pid.
        if bulkhead_sys::signal(victim, libc::SIGKILL).is_ok() {
            kills += 1;
            last_pid = victim;
            if kills % 10 == 0 {
                progress(&format!("{kills}/{} kills", opts.kills));
            }
        }
    }
    // Let the last restart complete and be measured.
    let deadline = Instant::now() + Duration::from_secs(5);
    while sup.outages_ms("r").len() < kills && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    stop.store(true, Ordering::Relaxed);
    for t in load {
        let _ = t.join();
    }
    let seconds = start.elapsed().as_secs_f64();
    let status = sup.status();
    let restarts = status.devices[0].restarts;
    let spare_private_kib = status.spares.ready.iter().filter_map(|p| p.rss.map(|r| r.anon_kib)).collect();
    let spans = sup.outages("r");
    let starts = sup.spare_starts();
    sup.shutdown();
    let outages: Vec<f64> = spans.iter().map(|o| o.1).collect();
    let (during, otherwise) = part_by_spare_starts(&spans, &starts);
    Ok(Report {
        mode: opts.mode.clone(),
        tap: opts.tap.clone(),
        killed: opts.kill.clone(),
        kills,
        restarts,
        spares: opts.spares,
        from_spares: status.spares.taken,
        from_standby: status.devices[0].standby_restarts,
        spare_private_kib,
        standby_private_kib: status.devices[0].standby.as_ref().and_then(|p| p.rss.map(|r| r.anon_kib)),
        outages: outages.len(),
        outage_p50_ms: crate::percentile(&outages, 0.50),
        outage_p99_ms: crate::percentile(&outages, 0.99),
        outage_max_ms: crate::percentile(&outages, 1.0),
        during_spare_start: during.len(),
        during_spare_start_p50_ms: crate::percentile(&during, 0.50),
        during_spare_start_max_ms: crate::percentile(&during, 1.0),
        otherwise_p50_ms: crate::percentile(&otherwise, 0.50),
        otherwise_max_ms: crate::percentile(&otherwise, 1.0),
        requests: requests.load(Ordering::Relaxed),
        errors: errors.load(Ordering::Relaxed),
        seconds,
    })
}

/// The outages (detected at, ms) that overlapped one of the spare starts (began, ended), and
/// the others, in ms.
fn part_by_spare_starts(outages: &[(Instant, f64)], starts: &[(Instant, Instant)]) -> (Vec<f64>, Vec<f64>) {
    let (during, otherwise): (Vec<&(Instant, f64)>, Vec<_>) = outages.iter().partition(|(at, ms)| {
        let end = *at + Duration::from_secs_f64(ms / 1e3);
        starts.iter().any(|(began, ended)| *began <= end && *at <= *ended)
    });
    (during.iter().map(|o| o.1).collect(), otherwise.iter().map(|o| o.1).collect())
}

/// Renders the report.
pub fn render(r: &Report) -> String {
    let mut t = Table::new(&[
        "mode",
        "tap",
        "killed",
        "kills",
        "restarts",
        "spares",
        "from spares",
        "from standby",
        "outage p50 ms",
        "p99 ms",
        "max ms",
        "requests",
        "errors",
        "seed paper",
    ]);
    t.row(vec![
        r.mode.clone(),
        r.tap.clone(),
        r.killed.clone(),
        r.kills.to_string(),
        r.restarts.to_string(),
        r.spares.to_string(),
        r.from_spares.to_string(),
        r.from_standby.to_string(),
        format!("{:.2}", r.outage_p50_ms),
        format!("{:.2}", r.outage_p99_ms),
        format!("{:.2}", r.outage_max_ms),
        r.requests.to_string(),
        r.errors.to_string(),
        "~275 ms".into(),
    ]);
    let mut out = t.render();
    out.push_str(&format!(
        "outages overlapping a spare's start: {} (p50 {:.2} ms, max {:.2}); the other {}: p50 {:.2} ms, max {:.2}\n",
        r.during_spare_start,
        r.during_spare_start_p50_ms,
        r.during_spare_start_max_ms,
        r.outages - r.during_spare_start,
        r.otherwise_p50_ms,
        r.otherwise_max_ms
    ));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_outage_overlapping_a_spare_start_at_either_end_or_within_counts_as_during_one() {
        let t = Instant::now();
        let ms = |n: u64| t + Duration::from_millis(n);
        // Spares started over 10–20 ms and 50–60 ms.
        let starts = [(ms(10), ms(20)), (ms(50), ms(60))];
        let outages = [(ms(5), 6.0), (ms(12), 1.0), (ms(19), 3.0), (ms(30), 5.0), (ms(45), 2.0), (ms(61), 1.0)];
        let (during, otherwise) = part_by_spare_starts(&outages, &starts);
        assert_eq!(during, vec![6.0, 1.0, 3.0]);
        assert_eq!(otherwise, vec![5.0, 2.0, 1.0]);
        assert_eq!(part_by_spare_starts(&outages, &[]).0, Vec::<f64>::new(), "no spare started: none overlap");
    }
}
