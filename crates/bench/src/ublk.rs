//! `bulkhead-bench ublk`: the kernel's block devices a host gets from bulkhead, side by side,
//! in the kernel lab (a TCG guest of bookworm-backports' 6.12, running this host's programs):
//!
//! - **ublk**: `serve`'s ublk export, `/dev/ublkb0`;
//! - **loop-fuse**: a loop device (`--direct-io=on`) over the FUSE export's file;
//! - **nbd**: the kernel's NBD client (`nbd-client`) on the NBD export's unix socket;
//! - **rublk**: a peer ublk server, rublk's `loop` target (`cargo install rublk`).
//!
//! Each serves the same file on the guest's tmpfs with `O_DIRECT`, with the same queues. fio
//! (libaio, direct) runs each point against the block device. Rounds alternate the systems
//! (each round starts one later); figures are medians of the rounds. CPU is counted two ways
//! over each point: the server's processes (`serve` and its domains, or rublk's daemon), and
//! the whole guest (every vCPU's busy time: fio, the kernel's block layer and the server). Under
//! TCG every instruction is emulated, so only ratios between the systems mean anything.
//!
//! The guest's half is `ublk_guest.py`, run by the host's `python3` inside the guest.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use bulkhead_guest::{Lab, LabOptions, Vm};
use serde::Serialize;

use crate::median;
use crate::{BenchError, Table};

/// The systems, in the order of the first round.
pub const SYSTEMS: [&str; 4] = ["ublk", "loop-fuse", "nbd", "rublk"];

/// One point: fio's `rw`, block size and queue depth.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Workload {
    /// The point's name in reports.
    pub name: &'static str,
    /// fio's `rw`.
    pub rw: &'static str,
    /// Bytes per request.
    pub bs: u32,
    /// Requests in flight.
    pub qd: u32,
}

/// The points: 4 KiB random at QD1 and QD32, and 1 MiB sequential.
pub const WORKLOADS: [Workload; 6] = [
    Workload { name: "4k randread QD1", rw: "randread", bs: 4096, qd: 1 },
    Workload { name: "4k randread QD32", rw: "randread", bs: 4096, qd: 32 },
    Workload { name: "4k randwrite QD1", rw: "randwrite", bs: 4096, qd: 1 },
    Workload { name: "4k randwrite QD32", rw: "randwrite", bs: 4096, qd: 32 },
    Workload { name: "1M read QD4", rw: "read", bs: 1 << 20, qd: 4 },
    Workload { name: "1M write QD4", rw: "write", bs: 1 << 20, qd: 4 },
];

/// Options.
#[derive(Debug, Clone)]
pub struct Options {
    /// Alternated rounds.
    pub rounds: usize,
    /// Seconds per point.
    pub seconds: u32,
    /// The backing file's size.
    pub size_mib: u32,
    /// Queues of every system.
    pub queues: u16,
    /// rublk's binary; without it the peer is left out (and the report says so).
    pub rublk: Option<PathBuf>,
    /// The bulkhead device's notification mode (`adaptive`, `irq`, `poll`).
    pub notify: String,
}

/// One system at one point, a figure per round.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Figures {
    /// Requests a second.
    pub iops: Vec<f64>,
    /// MiB a second.
    pub mib_s: Vec<f64>,
    /// CPU µs per request of the server's processes.
    pub server_us: Vec<f64>,
    /// Of which bulkhead's domains (the rest is `serve`).
    pub domains_us: Vec<f64>,
    /// CPU µs per request of the whole guest.
    pub guest_us: Vec<f64>,
}

/// Every system at one point.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    /// The point.
    pub workload: Workload,
    /// By system, in [`SYSTEMS`] order.
    pub systems: Vec<(String, Figures)>,
}

impl Row {
    fn of(&self, system: &str) -> Option<&Figures> {
        self.systems.iter().find(|(s, f)| s == system && !f.iops.is_empty()).map(|(_, f)| f)
    }
}

/// The report.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// The lab's kernel package.
    pub kernel: String,
    /// Rounds run.
    pub rounds: usize,
    /// Seconds per point.
    pub seconds: u32,
    /// The bulkhead device's notification mode.
    pub notify: String,
    /// One row per point.
    pub rows: Vec<Row>,
    /// Systems left out, and why.
    pub left_out: Vec<String>,
    /// What failed.
    pub failures: Vec<String>,
}

/// What the guest's half is told (ublk_guest.py reads it as JSON).
#[derive(Serialize)]
struct GuestPlan<'a> {
    bulkhead: &'a Path,
    rublk: Option<&'a Path>,
    systems: Vec<&'static str>,
    rounds: usize,
    seconds: u32,
    size_mib: u32,
    queues: u16,
    depth: u16,
    notify: &'a str,
    points: Vec<GuestPoint>,
}

#[derive(Serialize)]
struct GuestPoint {
    name: &'static str,
    rw: &'static str,
    bs: u32,
    qd: u32,
}

/// A line the guest's half prints.
#[derive(serde::Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
enum Said {
    Point {
        system: String,
        point: String,
        requests: u64,
        bytes: u64,
        seconds: f64,
        server_cpu: f64,
        domains_cpu: f64,
        guest_cpu: f64,
    },
    Error {
        system: String,
        round: usize,
        what: String,
    },
    Progress {
        what: String,
    },
    End,
}

const GUEST_HALF: &str = include_str!("ublk_guest.py");

/// The shell script the guest runs: the guest's half with its plan.
fn script(plan: &GuestPlan<'_>) -> String {
    let json = serde_json::to_string(plan).expect("a plan serializes");
    // The plan is JSON of paths and names: quoted for the shell as one word.
    let quoted = format!("'{}'", json.replace('\'', r"'\''"));
    format!("python3 - {quoted} <<'BULKHEAD_PY'\n{GUEST_HALF}\nBULKHEAD_PY\n")
}

fn parse(line: &str) -> Option<Said> {
    serde_json::from_str(line.split_once("UBLKBENCH ")?.1).ok()
}

/// Runs the benchmark; `progress` hears what the guest is doing.
pub fn run(exe: &Path, opts: &Options, mut progress: impl FnMut(&str)) -> Result<Report, BenchError> {
    if opts.rounds == 0 || opts.seconds == 0 {
        return Err(BenchError::Options("--rounds and --seconds must be at least 1".into()));
    }
    let mut left_out = Vec::new();
    let mut systems: Vec<&'static str> = SYSTEMS.to_vec();
    if opts.rublk.is_none() {
        systems.retain(|s| *s != "rublk");
        left_out.push("rublk: not installed (`cargo install rublk --no-default-features`, or --rublk PATH)".to_string());
    }
    if !crate::fileio::which("nbd-client") {
        systems.retain(|s| *s != "nbd");
        left_out.push("nbd: nbd-client is not installed (Debian's nbd-client)".to_string());
    }
    progress("building the kernel lab (scripts/guest-lab.sh), once");
    let lab = Lab::ensure().map_err(|e| BenchError::Run(e.to_string()))?;
    let plan = GuestPlan {
        bulkhead: exe,
        rublk: opts.rublk.as_deref(),
        systems: systems.clone(),
        rounds: opts.rounds,
        seconds: opts.seconds,
        size_mib: opts.size_mib,
        queues: opts.queues,
        depth: 128,
        notify: &opts.notify,
        points: WORKLOADS.iter().map(|w| GuestPoint { name: w.name, rw: w.rw, bs: w.bs, qd: w.qd }).collect(),
    };
    let scratch = std::env::temp_dir().join(format!("bulkhead-bench-ublk-initrd-{}", std::process::id()));
    let vm_opts = LabOptions { script: script(&plan), memory_mib: 3072, cpus: 2, scratch: scratch.clone() };
    let vm = Vm::boot_lab(&lab, &vm_opts).map_err(|e| BenchError::Run(e.to_string()))?;
    // Each point is fio's seconds and a few of setup; each system a few more to come up.
    let points = (opts.rounds * systems.len() * WORKLOADS.len()) as u64;
    let budget = Duration::from_secs(180 + points * (u64::from(opts.seconds) + 6) + (opts.rounds * systems.len()) as u64 * 20);
    let deadline = Instant::now() + budget;
    let mut heard = 0;
    let mut ended = false;
    while Instant::now() < deadline && !ended {
        let lines = vm.lines();
        for l in &lines[heard.min(lines.len())..] {
            match parse(l) {
                Some(Said::Progress { what }) => progress(&what),
                Some(Said::End) => ended = true,
                _ => {}
            }
            if l.starts_with("GUEST EXIT") {
                ended = true;
            }
        }
        heard = lines.len();
        std::thread::sleep(Duration::from_millis(100));
    }
    let out = vm.finish(Duration::from_secs(if ended { 60 } else { 1 }));
    let _ = std::fs::remove_file(&scratch);
    let mut failures = Vec::new();
    if !ended {
        failures.push(format!("the guest did not finish within {} s: {}", budget.as_secs(), out.tail(5).replace('\n', " | ")));
    } else if let Err(e) = out.check() {
        failures.push(e.0.lines().next().unwrap_or("the guest failed").to_string());
    }
    let mut rows: Vec<Row> = WORKLOADS
        .iter()
        .map(|w| Row { workload: *w, systems: systems.iter().map(|s| (s.to_string(), Figures::default())).collect() })
        .collect();
    for l in &out.lines {
        match parse(l) {
            Some(Said::Point { system, point, requests, bytes, seconds, server_cpu, domains_cpu, guest_cpu, .. }) => {
                let Some(row) = rows.iter_mut().find(|r| r.workload.name == point) else { continue };
                let Some((_, f)) = row.systems.iter_mut().find(|(s, _)| *s == system) else { continue };
                let (secs, reqs) = (seconds.max(1e-9), (requests as f64).max(1.0));
                f.iops.push(requests as f64 / secs);
                f.mib_s.push(bytes as f64 / secs / (1 << 20) as f64);
                f.server_us.push(server_cpu * 1e6 / reqs);
                f.domains_us.push(domains_cpu * 1e6 / reqs);
                f.guest_us.push(guest_cpu * 1e6 / reqs);
            }
            Some(Said::Error { system, round, what }) => failures.push(format!("round {}, {system}: {what}", round + 1)),
            _ => {}
        }
    }
    Ok(Report {
        kernel: lab.kernel,
        rounds: opts.rounds,
        seconds: opts.seconds,
        notify: opts.notify.clone(),
        rows,
        left_out,
        failures,
    })
}

/// `a / b` of two medians, or `-` where either is missing.
fn ratio(a: Option<&Figures>, b: Option<&Figures>, pick: fn(&Figures) -> &Vec<f64>) -> String {
    match (a, b) {
        (Some(a), Some(b)) if median(pick(b)) > 0.0 => format!("{:.2}", median(pick(a)) / median(pick(b))),
        _ => "-".into(),
    }
}

/// Renders a report.
pub fn render(r: &Report) -> String {
    let mut out = format!(
        "kernel lab: {} under QEMU TCG, 2 vCPUs; medians of {} alternated rounds of {} s a point; \
         bulkhead's device with `{}` notification.\nUnder TCG only the ratios between systems mean anything.\n\n",
        r.kernel, r.rounds, r.seconds, r.notify
    );
    let names: Vec<&str> = r.rows.first().map(|row| row.systems.iter().map(|(s, _)| s.as_str()).collect()).unwrap_or_default();
    // The median and, over more than one round, the range of the rounds.
    let rate = |w: &Workload, f: &Figures| {
        let v = if w.bs >= 1 << 20 { &f.mib_s } else { &f.iops };
        let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
        let hi = v.iter().copied().fold(0.0, f64::max);
        if v.len() > 1 {
            format!("{:.0} ({lo:.0}–{hi:.0})", median(v))
        } else {
            format!("{:.0}", median(v))
        }
    };
    let mut header = vec!["point"];
    header.extend(names.iter().copied());
    header.extend(["ublk / loop-fuse", "ublk / nbd", "ublk / rublk"]);
    let mut t = Table::new(&header);
    for row in &r.rows {
        let mut cells = vec![row.workload.name.to_string()];
        for n in &names {
            cells.push(row.of(n).map_or("-".into(), |f| rate(&row.workload, f)));
        }
        for peer in ["loop-fuse", "nbd", "rublk"] {
            cells.push(ratio(row.of("ublk"), row.of(peer), |f| &f.iops));
        }
        t.row(cells);
    }
    out.push_str(&format!("throughput: IOPS, or MiB/s at 1 MiB (median and range of the rounds)\n{}\n", t.render()));
    let mut header = vec!["point"];
    let cols: Vec<String> = names.iter().map(|n| format!("{n} server|guest")).collect();
    header.extend(cols.iter().map(String::as_str));
    header.push("ublk / rublk server");
    let mut t = Table::new(&header);
    for row in &r.rows {
        let mut cells = vec![row.workload.name.to_string()];
        for n in &names {
            cells.push(row.of(n).map_or("-".into(), |f| format!("{:.0}|{:.0}", median(&f.server_us), median(&f.guest_us))));
        }
        cells.push(ratio(row.of("ublk"), row.of("rublk"), |f| &f.server_us));
        t.row(cells);
    }
    out.push_str(&format!(
        "CPU µs per request: the server's processes | the whole guest (fio and the kernel included)\n{}\n",
        t.render()
    ));
    let bulkhead: Vec<&str> = names.iter().copied().filter(|n| *n != "rublk").collect();
    let mut header = vec!["point"];
    header.extend(bulkhead.iter().copied());
    let mut t = Table::new(&header);
    for row in &r.rows {
        let mut cells = vec![row.workload.name.to_string()];
        for n in &bulkhead {
            cells.push(row.of(n).map_or("-".into(), |f| {
                let d = median(&f.domains_us);
                format!("{:.0}|{d:.0}", median(&f.server_us) - d)
            }));
        }
        t.row(cells);
    }
    out.push_str(&format!("bulkhead's server CPU µs per request: serve | its domains\n{}\n", t.render()));
    let qd32 = r.rows.iter().find(|row| row.workload.name == "4k randread QD32");
    out.push_str(&format!(
        "goals: ublk >= 2x loop-fuse at QD32 (randread: {}); ublk >= rublk at every point ({}); \
         server CPU per request <= rublk's ({})\n",
        qd32.map_or("-".into(), |row| ratio(row.of("ublk"), row.of("loop-fuse"), |f| &f.iops)),
        count(r, |u, p| median(&u.iops) >= median(&p.iops)),
        count(r, |u, p| median(&u.server_us) <= median(&p.server_us)),
    ));
    for l in &r.left_out {
        out.push_str(&format!("left out: {l}\n"));
    }
    for f in &r.failures {
        out.push_str(&format!("failed: {f}\n"));
    }
    out
}

/// "N of M points" where `ok(ublk, rublk)` holds.
fn count(r: &Report, ok: fn(&Figures, &Figures) -> bool) -> String {
    let pairs: Vec<(&Figures, &Figures)> = r.rows.iter().filter_map(|row| Some((row.of("ublk")?, row.of("rublk")?))).collect();
    if pairs.is_empty() {
        return "no rublk figures".into();
    }
    format!("{} of {} points", pairs.iter().filter(|(u, p)| ok(u, p)).count(), pairs.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_guest_half_is_handed_its_plan_as_one_shell_word() {
        let plan = GuestPlan {
            bulkhead: Path::new("/opt/it's/bulkhead"),
            rublk: None,
            systems: vec!["ublk"],
            rounds: 1,
            seconds: 1,
            size_mib: 64,
            queues: 2,
            depth: 128,
            notify: "adaptive",
            points: vec![],
        };
        let s = script(&plan);
        assert!(s.starts_with("python3 - '{"), "{s}");
        assert!(s.contains(r"it'\''s"), "{s}");
        assert!(s.contains("def point(") && s.trim_end().ends_with("BULKHEAD_PY"));
    }

    #[test]
    fn lines_the_guest_prints_are_read_and_others_ignored() {
        let p = parse(
            r#"UBLKBENCH {"kind":"point","system":"ublk","round":0,"point":"x","requests":10,"bytes":40960,"seconds":1.0,"server_cpu":0.5,"domains_cpu":0.2,"guest_cpu":1.0,"wall":1.2}"#,
        );
        assert!(matches!(p, Some(Said::Point { requests: 10, .. })));
        assert!(matches!(parse(r#"UBLKBENCH {"kind":"end"}"#), Some(Said::End)));
        assert!(parse("[ 1.0] random kernel line").is_none());
    }
}
