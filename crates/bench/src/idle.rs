//! `bulkhead-bench idle`: what an idle `serve` costs as devices are added.
//!
//! For each device count, a real `serve` runs that many `ram` devices (FUSE export on, as by
//! default) and nothing uses them. Once every device serves and the start-up has settled, the
//! CPU time `serve` and its domains use over a quiet stretch is read from /proc, with the
//! threads of `serve` and its resident memory. An idle supervisor should wake a few times a
//! second whatever the number of devices, and its threads should not grow with them.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::{BenchError, Table};

/// Options.
#[derive(Debug, Clone)]
pub struct Options {
    /// Device counts to measure, in turn.
    pub devices: Vec<usize>,
    /// The quiet stretch measured at each count.
    pub seconds: f64,
}

/// One device count.
#[derive(Debug, Clone, Serialize)]
pub struct Point {
    /// Devices served.
    pub devices: usize,
    /// Seconds from exec to every device serving.
    pub startup_s: f64,
    /// CPU `serve` used while idle, percent of one core.
    pub serve_cpu_pct: f64,
    /// Threads of `serve`.
    pub serve_threads: u64,
    /// Resident memory of `serve`, MiB.
    pub serve_rss_mib: f64,
    /// CPU all its domains used together while idle, percent of one core.
    pub domains_cpu_pct: f64,
    /// Domains running.
    pub domains: usize,
}

/// Results.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// The executable measured.
    pub exe: PathBuf,
    /// Seconds each point was measured over.
    pub seconds: f64,
    /// One point per device count.
    pub points: Vec<Point>,
}

/// The goal: at 1,000 devices, idle `serve` uses at most this much of a core.
pub const GOAL_CPU_PCT: f64 = 0.5;

/// Clock ticks a second, as /proc counts CPU time.
fn ticks_per_second() -> f64 {
    bulkhead_sys::clock_ticks_per_second() as f64
}

/// User and system CPU time of `pid` (all its threads), seconds; `None` once it is gone.
fn cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may hold spaces: the fields start after its closing parenthesis.
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let (utime, stime): (u64, u64) = (f.get(11)?.parse().ok()?, f.get(12)?.parse().ok()?);
    Some((utime + stime) as f64 / ticks_per_second())
}

/// A field of /proc/PID/status, as a number.
fn status_field(pid: u32, key: &str) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    s.lines().find_map(|l| l.strip_prefix(key)?.split_whitespace().next()?.parse().ok())
}

/// A `serve` this benchmark started, ended (and its run directory removed) when dropped.
struct Serve {
    child: Child,
    dir: PathBuf,
    log: PathBuf,
}

impl Drop for Serve {
    fn drop(&mut self) {
        // SIGTERM: serve stops cleanly (unmounts, ends its domains).
        crate::stop_child(&mut self.child, Duration::from_secs(60));
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Serve {
    fn log_tail(&self) -> String {
        let mut s = String::new();
        if let Ok(mut f) = std::fs::File::open(&self.log) {
            let _ = f.read_to_string(&mut s);
        }
        s.lines().rev().take(20).collect::<Vec<_>>().into_iter().rev().collect::<Vec<_>>().join("\n")
    }
}

/// A configuration of `n` idle `ram` devices.
fn config(n: usize) -> String {
    let mut c = String::from("[fuse]\nenabled = true\n");
    for i in 0..n {
        c.push_str(&format!(
            "[[device]]\nname = \"idle{i}\"\nsize = \"64M\"\nqueues = 1\nqueue_depth = 32\narena = \"4M\"\n[device.backend]\ntype = \"ram\"\n"
        ));
    }
    c
}

/// Starts `exe serve` with `n` devices and waits until all of them serve.
fn start(exe: &Path, n: usize) -> Result<(Serve, f64), BenchError> {
    let dir = std::env::temp_dir().join(format!("bulkhead-bench-idle-{}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).map_err(|e| BenchError::io(&dir, e))?;
    let cfg = dir.join("idle.toml");
    std::fs::write(&cfg, config(n)).map_err(|e| BenchError::io(&cfg, e))?;
    let log = dir.join("serve.log");
    let err = std::fs::File::create(&log).map_err(|e| BenchError::io(&log, e))?;
    let run_dir = dir.join("run");
    let t0 = Instant::now();
    let child = Command::new(exe)
        .arg("serve")
        .arg("--config")
        .arg(&cfg)
        .arg("--run-dir")
        .arg(&run_dir)
        .stdout(Stdio::null())
        .stderr(err)
        .spawn()
        .map_err(|e| BenchError::io(exe, e))?;
    let serve = Serve { child, dir, log };
    let sock = run_dir.join("control.sock");
    let deadline = t0 + Duration::from_secs(60 + n as u64 / 5);
    loop {
        let ready = crate::serve_status(&sock)
            .is_some_and(|r| r.devices.len() == n && r.devices.iter().all(|d| d.state == bulkhead_control::DeviceState::Running));
        if ready {
            return Ok((serve, t0.elapsed().as_secs_f64()));
        }
        if Instant::now() > deadline {
            return Err(BenchError::Run(format!("{n} devices did not all serve in time:\n{}", serve.log_tail())));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The pids of the domains of the `serve` behind `sock`.
fn domain_pids(sock: &Path) -> Vec<u32> {
    crate::serve_status(sock).map(|r| crate::domain_pids(&r)).unwrap_or_default()
}

/// Measures each device count of `opts` with `exe` (a `bulkhead` that takes `serve`).
pub fn run(exe: &Path, opts: &Options, mut progress: impl FnMut(&str)) -> Result<Report, BenchError> {
    let mut points = Vec::new();
    for &n in &opts.devices {
        progress(&format!("{n} devices: starting"));
        let (serve, startup_s) = start(exe, n)?;
        let pid = serve.child.id();
        let sock = serve.dir.join("run").join("control.sock");
        // Let the start-up's last work (domains settling, the FUSE mount) pass.
        std::thread::sleep(Duration::from_secs(2));
        let domains = domain_pids(&sock);
        progress(&format!("{n} devices: measuring {:.0} s", opts.seconds));
        let cpu = |pids: &[u32]| pids.iter().filter_map(|&p| cpu_seconds(p)).sum::<f64>();
        let (s0, d0, t0) = (cpu_seconds(pid), cpu(&domains), Instant::now());
        std::thread::sleep(Duration::from_secs_f64(opts.seconds));
        let (s1, d1, dt) = (cpu_seconds(pid), cpu(&domains), t0.elapsed().as_secs_f64());
        let (Some(s0), Some(s1)) = (s0, s1) else {
            return Err(BenchError::Run(format!("serve (pid {pid}) ended while idle:\n{}", serve.log_tail())));
        };
        points.push(Point {
            devices: n,
            startup_s,
            serve_cpu_pct: 100.0 * (s1 - s0) / dt,
            serve_threads: status_field(pid, "Threads:").unwrap_or(0),
            serve_rss_mib: status_field(pid, "VmRSS:").unwrap_or(0) as f64 / 1024.0,
            domains_cpu_pct: 100.0 * (d1 - d0).max(0.0) / dt,
            domains: domains.len(),
        });
        progress(&format!("{n} devices: stopping"));
        drop(serve);
    }
    Ok(Report { exe: exe.to_path_buf(), seconds: opts.seconds, points })
}

/// The report as tables, with the goal.
pub fn render(r: &Report) -> String {
    let mut t =
        Table::new(&["devices", "start-up s", "serve CPU %", "serve threads", "serve RSS MiB", "domains", "domains CPU %"]);
    for p in &r.points {
        t.row(vec![
            p.devices.to_string(),
            format!("{:.1}", p.startup_s),
            format!("{:.2}", p.serve_cpu_pct),
            p.serve_threads.to_string(),
            format!("{:.0}", p.serve_rss_mib),
            p.domains.to_string(),
            format!("{:.2}", p.domains_cpu_pct),
        ]);
    }
    let mut out = format!("idle serve ({}, {:.0} s per point; CPU in percent of one core)\n", r.exe.display(), r.seconds);
    out.push_str(&t.render());
    if let Some(p) = r.points.iter().find(|p| p.devices >= 1000) {
        let met = if p.serve_cpu_pct <= GOAL_CPU_PCT { "met" } else { "NOT met" };
        out.push_str(&format!(
            "goal: {} devices idle at <= {GOAL_CPU_PCT}% of a core: {:.2}% ({met})\n",
            p.devices, p.serve_cpu_pct
        ));
    }
    let threads: Vec<u64> = r.points.iter().map(|p| p.serve_threads).collect();
    if let (Some(lo), Some(hi)) = (threads.iter().min(), threads.iter().max()) {
        if r.points.len() > 1 {
            let same = if hi - lo <= 2 { "not growing with devices" } else { "GROWING with devices" };
            out.push_str(&format!("threads of serve: {lo}..{hi} over {} device counts ({same})\n", r.points.len()));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_configuration_names_every_device_and_serve_reads_it() {
        let c = config(3);
        let parsed = bulkhead_config::Config::parse(&c, "idle.toml").unwrap();
        assert_eq!(parsed.devices.len(), 3);
        assert_eq!(parsed.devices[2].name.get_ref(), "idle2");
    }

    #[test]
    fn this_process_uses_cpu_time_by_proc() {
        let me = std::process::id();
        let before = cpu_seconds(me).unwrap();
        let t = Instant::now();
        while t.elapsed() < Duration::from_millis(200) {
            std::hint::black_box(0u64);
        }
        assert!(cpu_seconds(me).unwrap() > before, "200 ms of spinning shows");
        assert!(status_field(me, "Threads:").unwrap() >= 1);
        assert_eq!(cpu_seconds(u32::MAX), None);
    }
}
