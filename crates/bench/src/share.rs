//! `bulkhead-bench share`: one driver domain shared by several clients (section 5.4 of the Xen
//! driver domain paper).
//!
//! A `ram` device in a supervisor in this process, carved into views; each client is a thread
//! on a view's own queue through the client library (no export in the way), so what is measured
//! is the domain's sharing of its turns:
//!
//! - **noisy neighbour**: a QD1 4 KiB random reader's p99 on its view alone; then beside a
//!   neighbour doing QD32 4 KiB random writes on another view, with no QoS, with the
//!   neighbour capped (`bulkhead view qos` on the running view), and with weights instead of a cap;
//! - **fairness**: four equal-weight views, each client QD16 4 KiB random reads: Jain's index
//!   of their throughputs;
//! - **work conservation**: one of the four busy and three idle, against the same client on a
//!   device with no views, over as many bytes as a view holds; in each of three rounds both
//!   are started afresh and take four short slices each, in turns (ABBA), and the means are
//!   compared;
//! - **cap accuracy**: a 50 MiB/s cap (512 KiB every 10 000 µs) under QD8 64 KiB writes;
//! - the noisy-neighbour and cap phases again over NBD, next to qemu-storage-daemon with a
//!   throttle group (`share_nbd`).

use crate::BenchError;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bulkhead_channel::FrontRequest;
use bulkhead_client::Device;
use bulkhead_config::Config;
use bulkhead_supervisor::Supervisor;
use serde::Serialize;

use crate::tap::Goal;
use crate::Table;

/// Options.
#[derive(Debug, Clone)]
pub struct Options {
    /// Notification mode of the device.
    pub mode: String,
    /// Seconds per measured phase.
    pub seconds: f64,
    /// Seconds of the cap-accuracy phase.
    pub cap_seconds: f64,
    /// The noisy neighbour's caps, bytes per second, each measured in turn.
    pub noisy_caps: Vec<u64>,
    /// Also run the noisy-neighbour and cap phases over NBD, next to qemu-storage-daemon.
    pub nbd: bool,
}

/// One phase of the noisy-neighbour run.
#[derive(Debug, Clone, Serialize)]
pub struct NoisyRow {
    /// What ran.
    pub setting: String,
    /// The quiet reader's latency, µs.
    pub p50_us: f64,
    /// The same, 99th percentile.
    pub p99_us: f64,
    /// The same, 99.9th percentile: a reader that loses its CPU for whole time slices shows
    /// here, not at p99.
    pub p999_us: f64,
    /// The quiet reader's requests per second.
    pub quiet_iops: f64,
    /// The neighbour's throughput, MiB/s (0 alone).
    pub noisy_mibs: f64,
}

/// The whole run.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// Notification mode.
    pub mode: String,
    /// Seconds per phase.
    pub seconds: f64,
    /// Noisy neighbour phases.
    pub noisy: Vec<NoisyRow>,
    /// Each of four equal-weight clients' throughput, MiB/s.
    pub fair_mibs: Vec<f64>,
    /// Jain's index of them.
    pub jain: f64,
    /// Each of those clients' time on a CPU, and waiting in a run queue for one, s. The clients
    /// spin while they wait, so this is not their useful work: a slow client has had as much
    /// (docs/BENCHMARKS.md, the share section, on what its throughput does follow).
    pub fair_cpu_s: Vec<f64>,
    /// See `fair_cpu_s`.
    pub fair_waited_s: Vec<f64>,
    /// One busy client among idle views, MiB/s.
    pub busy_mibs: f64,
    /// The same client on a device with no views, MiB/s.
    pub alone_mibs: f64,
    /// The cap set, MiB/s, and what was measured.
    pub cap_mibs: f64,
    /// Measured under the cap, MiB/s.
    pub capped_mibs: f64,
    /// The same over NBD, next to qemu-storage-daemon.
    pub nbd: crate::share_nbd::NbdReport,
    /// QD1 4 KiB read latency of an attached application, beside FUSE and NBD.
    pub attach: Vec<crate::share_attach::AttachRow>,
    /// Paths of the attach row not measured, and why.
    pub attach_skipped: Vec<String>,
    /// Goals.
    pub goals: Vec<Goal>,
}

/// What a client does.
#[derive(Debug, Clone, Copy)]
struct Load {
    write: bool,
    bs: usize,
    qd: usize,
    /// Bytes from the start of the device the offsets fall in (0: all of it).
    span: u64,
}

/// What a client did.
#[derive(Debug, Default)]
struct Done {
    bytes: u64,
    ops: u64,
    secs: f64,
    /// The client's time on a CPU, and waiting in a run queue for one, s.
    cpu_s: f64,
    waited_s: f64,
    /// Per-request latency, µs (QD1 only).
    lat: Vec<f64>,
}

impl Done {
    fn mibs(&self) -> f64 {
        self.bytes as f64 / (1 << 20) as f64 / self.secs.max(1e-9)
    }
}

/// Runs `load` on `dev` until `stop` is set.
fn client(dev: &Device, load: Load, seed: u64, stop: &AtomicBool) -> Result<Done, BenchError> {
    let e = |e: bulkhead_client::IoError| format!("{}: {e}", dev.name());
    let span = if load.span == 0 { dev.size() } else { load.span.min(dev.size()) };
    let blocks = span / load.bs as u64;
    let mut rng = crate::random(seed);
    let data = vec![0x5au8; load.bs];
    let mut done = Done::default();
    let started = Instant::now();
    let (cpu0, waited0) = sched_times();
    if load.qd == 1 {
        let mut buf = vec![0u8; load.bs];
        while !stop.load(Ordering::Relaxed) {
            let off = rng.next().unwrap_or(1) % blocks * load.bs as u64;
            let t = Instant::now();
            if load.write {
                dev.write(0, off, &data, false).map_err(e)?;
            } else {
                dev.read_into(0, off, &mut buf).map_err(e)?;
            }
            done.lat.push(t.elapsed().as_secs_f64() * 1e6);
            done.ops += 1;
            done.bytes += load.bs as u64;
        }
    } else {
        let mut q = dev.queue(0);
        let mut failed = None;
        while !stop.load(Ordering::Relaxed) {
            while q.in_flight() < load.qd.min(q.capacity()) {
                let off = rng.next().unwrap_or(1) % blocks * load.bs as u64;
                let req = if load.write {
                    FrontRequest::Write { offset: off, from: &data, fua: false }
                } else {
                    FrontRequest::Read { offset: off, into: load.bs as u64 }
                };
                q.submit(req, 0).map_err(e)?;
            }
            q.wait(|_, r, _| match r {
                Ok(n) => {
                    done.ops += 1;
                    done.bytes += n;
                }
                Err(x) => failed = Some(x),
            });
            if let Some(x) = failed.take() {
                return Err(BenchError::from(e(x)));
            }
        }
        while q.in_flight() > 0 {
            q.wait(|_, _, _| {});
        }
    }
    done.secs = started.elapsed().as_secs_f64();
    let (cpu1, waited1) = sched_times();
    done.cpu_s = cpu1.saturating_sub(cpu0) as f64 / 1e9;
    done.waited_s = waited1.saturating_sub(waited0) as f64 / 1e9;
    Ok(done)
}

/// The calling thread's time on a CPU and waiting in a run queue for one, ns (the first two
/// fields of `/proc/thread-self/schedstat`); zeros where they cannot be read.
fn sched_times() -> (u64, u64) {
    let s = std::fs::read_to_string("/proc/thread-self/schedstat").unwrap_or_default();
    let mut f = s.split_whitespace().map(|v| v.parse::<u64>().unwrap_or(0));
    (f.next().unwrap_or(0), f.next().unwrap_or(0))
}

/// Runs each `(device, load)` in a thread of its own for `seconds`; what each did.
fn together(jobs: &[(Arc<Device>, Load)], seconds: f64) -> Result<Vec<Done>, BenchError> {
    let stop = Arc::new(AtomicBool::new(false));
    let handles: Vec<_> = jobs
        .iter()
        .enumerate()
        .map(|(i, (dev, load))| {
            let (dev, load, stop) = (dev.clone(), *load, stop.clone());
            std::thread::spawn(move || client(&dev, load, 0x9e37_79b9_7f4a_7c15 ^ ((i as u64 + 1) * 0x1234_5678), &stop))
        })
        .collect();
    std::thread::sleep(Duration::from_secs_f64(seconds));
    stop.store(true, Ordering::Relaxed);
    handles.into_iter().map(|h| h.join().map_err(|_| "a client thread panicked".to_string())?).collect()
}

/// Jain's fairness index of `x`: 1 when all are equal, 1/n when one has everything.
pub fn jain(x: &[f64]) -> f64 {
    let sum: f64 = x.iter().sum();
    let sq: f64 = x.iter().map(|v| v * v).sum();
    if sq == 0.0 {
        return 0.0;
    }
    sum * sum / (x.len() as f64 * sq)
}

/// A supervisor over a 1 GiB ramdisk `share` with `views` (each `(name, offset MiB, size MiB,
/// extra keys)`).
fn start(exe: &std::path::Path, mode: &str, views: &[(&str, u64, u64, &str)]) -> Result<Supervisor, BenchError> {
    let mut text = format!(
        "[fuse]\nenabled = false\n[nbd]\nenabled = false\n[[device]]\nname = \"share\"\nsize = \"1G\"\nqueues = 1\n\
         notify = \"{mode}\"\n[device.backend]\ntype = \"ram\"\n"
    );
    for (name, off, size, extra) in views {
        text += &format!("[[device.view]]\nname = \"{name}\"\noffset = \"{off}M\"\nsize = \"{size}M\"\n{extra}\n");
    }
    let config = Config::parse(&text, "bench share").map_err(|e| e.to_string())?;
    Supervisor::start(&config, Some(exe)).map_err(|e| BenchError::Run(e.to_string()))
}

fn device(sup: &Supervisor, name: &str) -> Result<Arc<Device>, BenchError> {
    sup.devices().into_iter().find(|d| d.name() == name).ok_or_else(|| BenchError::Run(format!("no device `{name}`")))
}

/// Writes every block of `dev` once, untimed: a fresh ramdisk's first touches are page faults.
fn fill(dev: &Device) -> Result<(), BenchError> {
    let buf = vec![0x11u8; 1 << 20];
    for off in (0..dev.size()).step_by(1 << 20) {
        dev.write(0, off, &buf, false).map_err(|e| e.to_string())?;
    }
    Ok(())
}

const QUIET: Load = Load { write: false, bs: 4096, qd: 1, span: 0 };
const NOISY: Load = Load { write: true, bs: 4096, qd: 32, span: 0 };
const SATURATE: Load = Load { write: false, bs: 4096, qd: 16, span: 0 };
const CAPPED: Load = Load { write: true, bs: 64 << 10, qd: 8, span: 0 };

/// Bytes of each of the four equal views: the device-alone run reads as many.
const VIEW_SPAN: u64 = 256 << 20;

/// Rounds of the work-conservation phase, each with a fresh busy view and device alone.
const CONSERVATION_ROUNDS: usize = 3;

/// Slices each of the two gets in a round, taken in turns.
const CONSERVATION_SLICES: usize = 4;

/// Runs every phase, execing `exe` for the domains.
pub fn run(exe: &std::path::Path, opts: &Options, mut progress: impl FnMut(&str)) -> Result<Report, BenchError> {
    let s = opts.seconds;
    // Noisy neighbour.
    progress("noisy neighbour");
    let sup = start(exe, &opts.mode, &[("quiet", 0, 512, ""), ("noisy", 512, 512, "")])?;
    let (quiet, noisy) = (device(&sup, "quiet")?, device(&sup, "noisy")?);
    let result = (|| -> Result<_, BenchError> {
        fill(&*device(&sup, "share")?)?;
        let mut rows = Vec::new();
        let mut row = |setting: &str, d: &[Done]| {
            let noisy_mibs = d.get(1).map_or(0.0, Done::mibs);
            rows.push(NoisyRow {
                setting: setting.into(),
                p50_us: crate::percentile(&d[0].lat, 0.5),
                p99_us: crate::percentile(&d[0].lat, 0.99),
                p999_us: crate::percentile(&d[0].lat, 0.999),
                quiet_iops: d[0].ops as f64 / d[0].secs,
                noisy_mibs,
            });
        };
        row("alone", &together(&[(quiet.clone(), QUIET)], s)?);
        let both = [(quiet.clone(), QUIET), (noisy.clone(), NOISY)];
        row("neighbour, no QoS", &together(&both, s)?);
        for &c in &opts.noisy_caps {
            let cap = (c / 1000).to_string();
            sup.set_qos("noisy", &[("credit_bytes".into(), cap), ("credit_us".into(), "1000".into())])?;
            row(&format!("neighbour capped at {} MiB/s", c >> 20), &together(&both, s)?);
        }
        sup.set_qos("noisy", &[("credit_bytes".into(), "none".into())])?;
        sup.set_qos("quiet", &[("weight".into(), "32".into())])?;
        row("neighbour, weights 32 : 1", &together(&both, s)?);
        Ok::<_, BenchError>(rows)
    })();
    sup.shutdown();
    let noisy_rows = result?;
    // Fairness and the cap, on four equal views.
    progress("fairness");
    let names = ["v0", "v1", "v2", "v3"];
    // Four views of 256 MiB each, one after the other.
    let four = names.map(|n| (n, 256 * (n.as_bytes()[1] - b'0') as u64, 256, ""));
    let sup = start(exe, &opts.mode, &four)?;
    let result = (|| -> Result<_, BenchError> {
        fill(&*device(&sup, "share")?)?;
        let devs: Vec<_> = names.iter().map(|n| device(&sup, n)).collect::<Result<_, _>>()?;
        let fair = together(&devs.iter().map(|d| (d.clone(), SATURATE)).collect::<Vec<_>>(), s)?;
        let fair_mibs: Vec<f64> = fair.iter().map(Done::mibs).collect();
        let fair_cpu: (Vec<f64>, Vec<f64>) = fair.iter().map(|d| (d.cpu_s, d.waited_s)).unzip();
        progress("cap accuracy");
        sup.set_qos("v0", &[("credit_bytes".into(), "512K".into()), ("credit_us".into(), "10000".into())])?;
        let capped = together(&[(devs[0].clone(), CAPPED)], opts.cap_seconds)?[0].mibs();
        Ok::<_, BenchError>((fair_mibs, fair_cpu, capped))
    })();
    sup.shutdown();
    let (fair_mibs, (fair_cpu_s, fair_waited_s), capped_mibs) = result?;
    // Work conservation: the busy view and the device with no views take turns. Each round
    // starts both afresh (a fresh ramdisk lands on other pages), and within it they alternate
    // in short slices, in the order ABBA, so that a machine whose speed drifts (a shared VM's
    // does, by a third over a run, and by some points from one second to the next) weighs on
    // both alike. The idle one's domain sleeps meanwhile.
    let (mut busy_mibs, mut alone_mibs) = (0.0, 0.0);
    let slices = CONSERVATION_ROUNDS * CONSERVATION_SLICES;
    let slice = (s / CONSERVATION_ROUNDS as f64).max(1.0) / CONSERVATION_SLICES as f64;
    for round in 1..=CONSERVATION_ROUNDS {
        progress(&format!("work conservation, round {round} of {CONSERVATION_ROUNDS}"));
        let views = start(exe, &opts.mode, &four)?;
        let alone = match start(exe, &opts.mode, &[]) {
            Ok(a) => a,
            Err(e) => {
                views.shutdown();
                return Err(e);
            }
        };
        let result = (|| -> Result<_, BenchError> {
            fill(&*device(&views, "share")?)?;
            let dev = device(&alone, "share")?;
            fill(&dev)?;
            let busy = (device(&views, "v0")?, SATURATE);
            // Over as many bytes as a view holds: the same working set.
            let lone = (dev, Load { span: VIEW_SPAN, ..SATURATE });
            // Total MiB/s over the slices: [busy view, device alone].
            let jobs = [busy, lone];
            let mut sum = [0.0; 2];
            for k in 0..CONSERVATION_SLICES {
                let order = if k % 2 == 0 { [0, 1] } else { [1, 0] };
                for j in order {
                    sum[j] += together(std::slice::from_ref(&jobs[j]), slice)?[0].mibs();
                }
            }
            Ok::<_, BenchError>((sum[0], sum[1]))
        })();
        views.shutdown();
        alone.shutdown();
        let (b, a) = result?;
        busy_mibs += b / slices as f64;
        alone_mibs += a / slices as f64;
    }
    let nbd = if opts.nbd {
        crate::share_nbd::run(exe, &opts.mode, s, opts.cap_seconds, &opts.noisy_caps, &mut progress)?
    } else {
        crate::share_nbd::NbdReport { skipped: vec!["over NBD: not asked for".into()], ..Default::default() }
    };
    let modes: Vec<&str> = if opts.mode == "poll" { vec!["poll"] } else { vec!["poll", opts.mode.as_str()] };
    let (attach, attach_skipped) = crate::share_attach::run(exe, &modes, s, &mut progress)?;
    let cap_mibs = 512.0 * 1024.0 / 0.01 / (1 << 20) as f64;
    let mut r = Report {
        mode: opts.mode.clone(),
        seconds: s,
        noisy: noisy_rows,
        jain: jain(&fair_mibs),
        fair_mibs,
        fair_cpu_s,
        fair_waited_s,
        busy_mibs,
        alone_mibs,
        cap_mibs,
        capped_mibs,
        nbd,
        attach,
        attach_skipped,
        goals: Vec::new(),
    };
    r.goals = goals(&r);
    Ok(r)
}

fn goals(r: &Report) -> Vec<Goal> {
    let mut g = Vec::new();
    let alone = r.noisy.first().map_or(0.0, |x| x.p99_us);
    for row in r.noisy.iter().skip(1) {
        let ratio = row.p99_us / alone.max(1e-9);
        let qos = !row.setting.contains("no QoS");
        g.push(Goal {
            what: format!("quiet p99, {} / alone", row.setting),
            measured: ratio,
            bound: if qos { "≤ 1.5".into() } else { "(reported)".into() },
            met: !qos || ratio <= 1.5,
        });
    }
    for sys in ["bulkhead", "qsd"] {
        let rows: Vec<_> = r.nbd.rows.iter().filter(|x| x.system == sys).collect();
        let Some(alone) = rows.first().map(|x| x.p99_us) else { continue };
        for row in rows.iter().skip(1).filter(|x| !x.setting.contains("no QoS")) {
            let ratio = row.p99_us / alone.max(1e-9);
            g.push(Goal {
                what: format!("{sys} over NBD: quiet p99, {} / alone", row.setting),
                measured: ratio,
                bound: if row.goal { "≤ 1.5".into() } else { "(reported)".into() },
                met: !row.goal || ratio <= 1.5,
            });
        }
    }
    for c in &r.nbd.caps {
        let err = (c.measured_mibs - c.cap_mibs) / c.cap_mibs;
        g.push(Goal {
            what: format!("{} over NBD: {:.0} MiB/s cap, error", c.system, c.cap_mibs),
            measured: err,
            bound: "within ±0.05".into(),
            met: err.abs() <= 0.05,
        });
    }
    g.push(Goal {
        what: "Jain's index, 4 equal clients".into(), measured: r.jain, bound: "≥ 0.98".into(), met: r.jain >= 0.98
    });
    let wc = r.busy_mibs / r.alone_mibs.max(1e-9);
    g.push(Goal { what: "one busy view / device alone".into(), measured: wc, bound: "≥ 0.95".into(), met: wc >= 0.95 });
    for row in r.attach.iter().filter(|x| x.path == "attach" && x.mode == "poll") {
        g.push(Goal {
            what: "attached application, poll: QD1 4 KiB read p50, µs".into(),
            measured: row.p50_us,
            bound: "≤ 2".into(),
            met: row.p50_us <= 2.0,
        });
    }
    let err = (r.capped_mibs - r.cap_mibs) / r.cap_mibs;
    g.push(Goal {
        what: format!("{:.0} MiB/s cap, measured error", r.cap_mibs),
        measured: err,
        bound: "within ±0.05".into(),
        met: err.abs() <= 0.05,
    });
    g
}

/// The human tables.
pub fn render(r: &Report) -> String {
    let mut out = format!("bench share: one ram domain, {} notification, {} s per phase\n\n", r.mode, r.seconds);
    let mut t =
        Table::new(&["NOISY NEIGHBOUR", "QUIET p50 µs", "QUIET p99 µs", "QUIET p99.9 µs", "QUIET IOPS", "NEIGHBOUR MiB/s"]);
    for row in &r.noisy {
        t.row(vec![
            row.setting.clone(),
            format!("{:.1}", row.p50_us),
            format!("{:.1}", row.p99_us),
            format!("{:.1}", row.p999_us),
            format!("{:.0}", row.quiet_iops),
            format!("{:.1}", row.noisy_mibs),
        ]);
    }
    out += &t.render();
    out += &format!(
        "\nfairness: 4 views, QD16 4 KiB reads: {} MiB/s; Jain's index {:.4}\n",
        r.fair_mibs.iter().map(|m| format!("{m:.1}")).collect::<Vec<_>>().join(" / "),
        r.jain
    );
    if r.fair_cpu_s.iter().any(|&c| c > 0.0) {
        let each = |v: &[f64]| v.iter().map(|x| format!("{x:.2}")).collect::<Vec<_>>().join(" / ");
        out += &format!(
            "  the clients' threads: on a CPU {} s, waiting for one {} s\n",
            each(&r.fair_cpu_s),
            each(&r.fair_waited_s)
        );
    }
    out += &format!(
        "work conservation: one busy view {:.1} MiB/s, device with no views {:.1} MiB/s ({:.1}%)\n",
        r.busy_mibs,
        r.alone_mibs,
        100.0 * r.busy_mibs / r.alone_mibs.max(1e-9)
    );
    out += &format!("cap: {:.1} MiB/s set, {:.2} MiB/s measured under QD8 64 KiB writes\n\n", r.cap_mibs, r.capped_mibs);
    if !r.attach.is_empty() {
        out += "an attached application beside the exports (QD1 4 KiB random reads, one ram device):\n";
        let mut t = Table::new(&["MODE", "PATH", "p50 µs", "p99 µs"]);
        for row in &r.attach {
            t.row(vec![row.mode.clone(), row.path.clone(), format!("{:.2}", row.p50_us), format!("{:.2}", row.p99_us)]);
        }
        out += &t.render();
        out += "\n";
    }
    for why in &r.attach_skipped {
        out += &format!("skipped: {why}\n");
    }
    if !r.nbd.rows.is_empty() {
        out += "over NBD (fio's nbd engine; quiet QD1 4 KiB reads, neighbour QD32 4 KiB writes):\n";
        let mut t = Table::new(&[
            "SYSTEM",
            "SETTING",
            "QUIET p50 µs",
            "QUIET p99 µs",
            "QUIET p99.9 µs",
            "NEIGHBOUR MiB/s",
            "CPU s/100k serve|domain|fio (qsd|fio)",
        ]);
        for row in &r.nbd.rows {
            t.row(vec![
                row.system.clone(),
                row.setting.clone(),
                format!("{:.1}", row.p50_us),
                format!("{:.1}", row.p99_us),
                format!("{:.1}", row.p999_us),
                format!("{:.1}", row.noisy_mibs),
                row.cpu_per_100k.by_process(),
            ]);
        }
        out += &t.render();
        for c in &r.nbd.caps {
            out += &format!("{}: {:.0} MiB/s cap, {:.2} MiB/s measured over NBD\n", c.system, c.cap_mibs, c.measured_mibs);
        }
        out += "\n";
    }
    for s in &r.nbd.skipped {
        out += &format!("skipped: {s}\n");
    }
    let mut t = Table::new(&["GOAL", "MEASURED", "BOUND", "MET"]);
    for g in &r.goals {
        t.row(vec![g.what.clone(), format!("{:.3}", g.measured), g.bound.clone(), if g.met { "yes" } else { "NO" }.into()]);
    }
    out += &t.render();
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jain_is_one_for_equal_shares_and_one_over_n_for_a_hog() {
        assert!((jain(&[5.0, 5.0, 5.0, 5.0]) - 1.0).abs() < 1e-12);
        assert!((jain(&[8.0, 0.0, 0.0, 0.0]) - 0.25).abs() < 1e-12);
        assert!(jain(&[10.0, 9.0, 10.0, 11.0]) > 0.98);
    }
}
