//! `bulkhead-bench fio`: bulkhead's block layer through its fio engine (`libbulkhead_fio.so`:
//! fio attached to a ram device of a running `serve`, a queue of its own over shared memory,
//! no export protocol), against fio's `null` engine (fio's own cost per request, with no
//! device at all) and against the channel alone (`bench channel`'s adaptive figures, measured
//! in the same rounds). What the engine adds to `null` is what bulkhead's block layer costs
//! an application; the channel is the floor of that.
//!
//! Rounds alternate the three. CPU per 100k requests is given per process: the fio job (the
//! load generator, the engine's library included), `serve` and the domain. As `bench channel`
//! does, the fio job and the domain are pinned to different CPUs unless `--no-pin`: on two
//! cores, where the scheduler places a spinning domain beside its client decides the figure
//! more than anything either does (a 4 KiB read at depth 1 takes 0.9 µs apart and 2–5 µs
//! when they share a core).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use bulkhead_channel::NotifyMode;
use serde::Serialize;

use crate::median;
use crate::{cpu_seconds, BenchError, CpuPer100k, Table};

/// Options.
#[derive(Debug, Clone)]
pub struct Options {
    /// Alternated rounds.
    pub rounds: usize,
    /// Seconds per fio point.
    pub seconds: u64,
    /// Round trips sampled per latency phase of the channel.
    pub samples: usize,
    /// The engine (found beside the program, or where the package puts it, if not given).
    pub engine: Option<PathBuf>,
    /// Pin the fio job to CPU 0 and the domain to CPU 1 (and the channel's two ends likewise).
    pub pin: bool,
}

/// One system's rounds.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Side {
    /// 4 KiB random reads at depth 1: median completion latency (submission to answer), ns.
    pub qd1_p50_ns: Vec<f64>,
    /// IOPS at depth 1.
    pub qd1_iops: Vec<f64>,
    /// IOPS at depth 32.
    pub qd32_iops: Vec<f64>,
    /// CPU per 100k requests at depth 32 (`serve` and the domain empty for `null`).
    pub qd32_cpu_per_100k: CpuPer100k,
}

/// Results.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Report {
    /// Rounds.
    pub rounds: usize,
    /// The engine measured.
    pub engine: String,
    /// Whether the fio job and the domain were pinned to different CPUs.
    pub pinned: bool,
    /// fio's null engine.
    pub null: Side,
    /// bulkhead's engine on a ram device.
    pub bulkhead: Side,
    /// `bench channel`, adaptive: a 4 KiB read's round trip, p50 ns, each round.
    pub channel_rtt_ns: Vec<f64>,
    /// `bench channel`, adaptive: 4 KiB reads at depth 32, IOPS, each round.
    pub channel_qd32_iops: Vec<f64>,
    /// Runs that failed, and why; their figures are left out.
    pub failures: Vec<String>,
}

/// Where the engine is: `given`, else beside this program (a build tree, after
/// `scripts/fio-engine.sh target/release/libbulkhead_fio.so`), else where the package puts it.
pub fn find_engine(given: Option<&Path>) -> Result<PathBuf, BenchError> {
    if let Some(p) = given {
        return if p.is_file() {
            Ok(p.to_path_buf())
        } else {
            Err(BenchError::Options(format!("{}: no such file", p.display())))
        };
    }
    let beside = std::env::current_exe().ok().and_then(|e| e.parent().map(|d| d.join("libbulkhead_fio.so")));
    let packaged = PathBuf::from("/usr/lib/bulkhead/libbulkhead_fio.so");
    beside.into_iter().chain([packaged]).find(|p| p.is_file()).ok_or_else(|| {
        BenchError::Options(
            "no libbulkhead_fio.so beside this program or in /usr/lib/bulkhead: build it with \
             `scripts/fio-engine.sh target/release/libbulkhead_fio.so`, or name it with --engine"
                .into(),
        )
    })
}

/// A `serve` with one 1 GiB ram device, `disk0`, and no export.
struct Serve {
    child: std::process::Child,
    dir: PathBuf,
}

impl Serve {
    fn start(exe: &Path) -> Result<Serve, BenchError> {
        let dir = std::env::temp_dir().join(format!("bulkhead-bench-fio-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).map_err(|e| BenchError::io(&dir, e))?;
        let cfg = dir.join("fio.toml");
        std::fs::write(
            &cfg,
            "[fuse]\nenabled = false\n[[device]]\nname = \"disk0\"\nsize = \"1G\"\nnotify = \"adaptive\"\n\
             [device.backend]\ntype = \"ram\"\n",
        )
        .map_err(|e| BenchError::io(&cfg, e))?;
        let log = dir.join("serve.log");
        let err = std::fs::File::create(&log).map_err(|e| BenchError::io(&log, e))?;
        let child = Command::new(exe)
            .arg("serve")
            .arg("--config")
            .arg(&cfg)
            .arg("--run-dir")
            .arg(dir.join("run"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(err)
            .spawn()
            .map_err(|e| BenchError::io(exe, e))?;
        let s = Serve { child, dir };
        let deadline = Instant::now() + Duration::from_secs(30);
        while s.domain() == 0 {
            if Instant::now() > deadline {
                let text = std::fs::read_to_string(&log).unwrap_or_default();
                return Err(BenchError::Run(format!("serve did not start: {}", text.trim())));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(s)
    }

    fn run_dir(&self) -> PathBuf {
        self.dir.join("run")
    }

    fn domain(&self) -> u32 {
        crate::serve_status(&self.run_dir().join("control.sock"))
            .and_then(|r| r.devices.into_iter().next())
            .map_or(0, |d| d.driver_pid)
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        crate::stop_child(&mut self.child, Duration::from_secs(20));
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// One fio run: (p50 completion latency ns, IOPS, CPU seconds of the fio job, requests).
fn fio(engine_args: &[String], qd: u32, seconds: u64, what: &str) -> Result<(f64, f64, f64, f64), BenchError> {
    let out = Command::new("timeout")
        .args(["--kill-after=10", &(seconds + 60).to_string(), "fio", "--name=p", "--rw=randread", "--bs=4k"])
        .arg(format!("--iodepth={qd}"))
        .args(["--size=1G", "--time_based", "--randrepeat=0", "--lat_percentiles=1", "--output-format=json"])
        .arg(format!("--runtime={seconds}"))
        .args(engine_args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("fio: {e}"))?;
    if !out.status.success() {
        return Err(BenchError::Run(format!("fio on {what}: {}", String::from_utf8_lossy(&out.stderr).trim())));
    }
    let v = crate::fio_report(&out.stdout, what)?;
    let j = &v["jobs"][0];
    let r = &j["read"];
    let p50 = r["lat_ns"]["percentile"]["50.000000"].as_f64().unwrap_or(0.0);
    let iops = r["iops"].as_f64().unwrap_or(0.0);
    let ios = r["total_ios"].as_f64().unwrap_or(0.0);
    let cpu = crate::fio_job_cpu_seconds(j);
    Ok((p50, iops, cpu, ios))
}

fn per_100k(cpu: f64, ios: f64) -> f64 {
    cpu / (ios / 100_000.0).max(1e-9)
}

/// One round of one engine: depth 1, then depth 32 with every process's CPU counted.
fn engine_round(side: &mut Side, args: &[String], serve: Option<&Serve>, seconds: u64, what: &str) -> Result<(), BenchError> {
    let (p50, qd1, _, _) = fio(args, 1, seconds, what)?;
    let pids = serve.map(|s| (s.child.id(), s.domain()));
    let before = pids.map(|(s, d)| (cpu_seconds(s), cpu_seconds(d)));
    let (_, qd32, fio_cpu, ios) = fio(args, 32, seconds, what)?;
    side.qd1_p50_ns.push(p50);
    side.qd1_iops.push(qd1);
    side.qd32_iops.push(qd32);
    let cpu = &mut side.qd32_cpu_per_100k;
    cpu.load.push(per_100k(fio_cpu, ios));
    if let (Some((s, d)), Some((s0, d0))) = (pids, before) {
        let (serve, domain) = (cpu_seconds(s) - s0, cpu_seconds(d) - d0);
        cpu.serve.push(per_100k(serve, ios));
        cpu.domain.push(per_100k(domain, ios));
        cpu.server.push(per_100k(serve + domain, ios));
    }
    Ok(())
}

#[derive(Debug, Clone, Copy)]
enum Part {
    Channel,
    Null,
    Engine,
}

/// Runs the benchmark.
pub fn run(exe: &Path, opts: &Options, mut progress: impl FnMut(&str)) -> Result<Report, BenchError> {
    if !(1..=50).contains(&opts.rounds) || !(1..=600).contains(&opts.seconds) {
        return Err(BenchError::Options("rounds 1..=50, seconds 1..=600".into()));
    }
    let engine = find_engine(opts.engine.as_deref())?;
    let serve = Serve::start(exe)?;
    let cpus = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let pinned = opts.pin && cpus >= 2 && crate::channel::pin(serve.domain(), 1);
    let mut report = Report { rounds: opts.rounds, engine: engine.display().to_string(), pinned, ..Default::default() };
    let mut ours = vec![
        format!("--ioengine=external:{}", engine.display()),
        format!("--run_dir={}", serve.run_dir().display()),
        "--filename=disk0".to_string(),
    ];
    let mut null = vec!["--ioengine=null".to_string()];
    if pinned {
        ours.push("--cpus_allowed=0".into());
        null.push("--cpus_allowed=0".into());
    }
    let parts = [Part::Channel, Part::Null, Part::Engine];
    for r in 0..opts.rounds {
        let mut order = parts;
        order.rotate_left(r % parts.len());
        for part in order {
            progress(&format!("round {}/{}: {part:?}", r + 1, opts.rounds));
            let done = match part {
                Part::Channel => {
                    let copts = crate::channel::Options {
                        modes: vec![NotifyMode::Adaptive],
                        seconds: opts.seconds as f64,
                        samples: opts.samples,
                        pin: opts.pin,
                    };
                    // On a thread of its own: it pins its caller to a CPU, and fio must not
                    // inherit that.
                    let ran = std::thread::scope(|sc| sc.spawn(|| crate::channel::run(exe, &copts, |_| {})).join());
                    let ran = ran.unwrap_or_else(|_| Err(BenchError::Run("bench channel panicked".into())));
                    ran.map(|c| {
                        let m = &c.modes[0];
                        report.channel_rtt_ns.push(m.rtt_read_4k.p50_ns as f64);
                        report.channel_qd32_iops.push(m.qd32.iops);
                    })
                }
                Part::Null => engine_round(&mut report.null, &null, None, opts.seconds, "null"),
                Part::Engine => engine_round(&mut report.bulkhead, &ours, Some(&serve), opts.seconds, "bulkhead"),
            };
            if let Err(e) = done {
                report.failures.push(format!("round {}, {part:?}: {e}", r + 1));
            }
        }
    }
    Ok(report)
}

/// Renders the report: the figures, then the two goals against them.
pub fn render(r: &Report) -> String {
    let mut t = Table::new(&["system", "QD1 p50 µs", "QD1 IOPS", "QD32 IOPS", "CPU s/100k at QD32: fio|serve|domain"]);
    let us = |v: &[f64]| format!("{:.2}", median(v) / 1e3);
    let n = |v: &[f64]| format!("{:.0}", median(v));
    let cpu = |v: &[f64]| if v.is_empty() { "-".to_string() } else { format!("{:.2}", median(v)) };
    for (name, s) in [("fio null engine", &r.null), ("bulkhead engine, ram", &r.bulkhead)] {
        t.row(vec![
            name.into(),
            us(&s.qd1_p50_ns),
            n(&s.qd1_iops),
            n(&s.qd32_iops),
            format!(
                "{}|{}|{}",
                cpu(&s.qd32_cpu_per_100k.load),
                cpu(&s.qd32_cpu_per_100k.serve),
                cpu(&s.qd32_cpu_per_100k.domain)
            ),
        ]);
    }
    t.row(vec!["bench channel, adaptive".into(), us(&r.channel_rtt_ns), "-".into(), n(&r.channel_qd32_iops), "-".into()]);
    let placement = if r.pinned { "fio on CPU 0, the domain on CPU 1" } else { "not pinned" };
    let mut out =
        format!("medians of {} alternated rounds, 4 KiB random reads ({}; {placement})\n{}", r.rounds, r.engine, t.render());
    let (ours, null, rtt) = (median(&r.bulkhead.qd1_p50_ns), median(&r.null.qd1_p50_ns), median(&r.channel_rtt_ns));
    let bound = null + 1.3 * rtt;
    let met = |ok: bool| if ok { "met" } else { "not met" };
    out += &format!(
        "QD1 p50 {:.2} µs against null's {:.2} + 1.3 × the channel's {:.2} = {:.2} µs: {}\n",
        ours / 1e3,
        null / 1e3,
        rtt / 1e3,
        bound / 1e3,
        met(ours > 0.0 && ours <= bound)
    );
    let (qd32, chan) = (median(&r.bulkhead.qd32_iops), median(&r.channel_qd32_iops));
    out += &format!(
        "QD32 {:.0} IOPS against 0.7 × the channel's {:.0} = {:.0}: {}\n",
        qd32,
        chan,
        0.7 * chan,
        met(qd32 > 0.0 && qd32 >= 0.7 * chan)
    );
    for f in &r.failures {
        out += &format!("failed: {f}\n");
    }
    out
}
