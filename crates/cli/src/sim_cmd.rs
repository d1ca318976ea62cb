//! `bulkhead sim`: a workload through disk schedulers on the modelled disk, with no device.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{bail, Context};
use bulkhead_control::table::Table;
use bulkhead_diskmodel::sched::{Policy, Tuning};
use bulkhead_diskmodel::sim::{self, Arrival, Outcome, Trace, Uniform, Workload};
use bulkhead_diskmodel::{Access, Drive};

/// What `bulkhead sim` was asked.
#[derive(clap::Args)]
pub struct SimArgs {
    /// The worked example of Jones' performance modeling paper: requests at 95, 10, 60, 41, the
    /// head at 50, one ms of travel per unit of distance and nothing else; fcfs, satf and opt.
    #[arg(long)]
    example: bool,
    /// A requests file: one per line, `arrival_ms position [sectors] [r|w] [stream]`.
    #[arg(long)]
    requests: Option<PathBuf>,
    /// Generate this many requests: Poisson arrivals at uniform random positions.
    #[arg(long)]
    generate: Option<u64>,
    /// Seed of the generated workload.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Mean time between generated arrivals, ms.
    #[arg(long, default_value_t = 5.0)]
    interval_ms: f64,
    /// Fraction of generated requests that write.
    #[arg(long, default_value_t = 0.3)]
    write_fraction: f64,
    /// Sectors of each generated request.
    #[arg(long, default_value_t = 8)]
    sectors: u64,
    /// Streams the generated requests come from, in turn.
    #[arg(long, default_value_t = 4)]
    streams: u32,
    /// Where the head starts, sector (default 0; 50 for --example).
    #[arg(long)]
    head: Option<u64>,
    /// Size of the modelled device (default the 73.4 GB drive of Jones' performance modeling
    /// paper).
    #[arg(long)]
    size: Option<String>,
    /// Model travel time only, one ms per sector of distance.
    #[arg(long)]
    travel_only: bool,
    /// Schedulers to run, comma-separated.
    #[arg(long, value_enum, value_delimiter = ',')]
    schedulers: Vec<Scheduler>,
    /// Print every request (done anyway for up to 20).
    #[arg(long)]
    each: bool,
    /// Machine-readable output.
    #[arg(long)]
    json: bool,
}

/// Reads a requests file: one request per line, `arrival_ms position [sectors] [r|w]
/// [stream]`, `#` starting a comment.
fn read_requests(path: &Path) -> anyhow::Result<Vec<Arrival>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        let at = |what: &str| format!("{} line {}: {what}", path.display(), i + 1);
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.len() < 2 || f.len() > 5 {
            bail!(at("expected `arrival_ms position [sectors] [r|w] [stream]`"));
        }
        let arrival: f64 = f[0].parse().map_err(|_| anyhow::anyhow!(at(&format!("arrival `{}` is not a number", f[0]))))?;
        if !(arrival.is_finite() && arrival >= 0.0) {
            bail!(at(&format!("arrival `{}` is not a time", f[0])));
        }
        let start: u64 = f[1].parse().map_err(|_| anyhow::anyhow!(at(&format!("position `{}` is not a sector", f[1]))))?;
        let sectors: u64 = match f.get(2) {
            None => 0,
            Some(s) => s.parse().map_err(|_| anyhow::anyhow!(at(&format!("sectors `{s}` is not a count"))))?,
        };
        let write = match f.get(3).copied() {
            None | Some("r") => false,
            Some("w") => true,
            Some(o) => bail!(at(&format!("`{o}` is neither r nor w"))),
        };
        let stream: u32 = match f.get(4) {
            None => 0,
            Some(s) => s.parse().map_err(|_| anyhow::anyhow!(at(&format!("stream `{s}` is not a number"))))?,
        };
        out.push(Arrival { at_ns: (arrival * 1e6) as u64, access: Access { start, sectors, write }, stream });
    }
    if out.is_empty() {
        bail!("{}: no requests", path.display());
    }
    Ok(out)
}

/// The schedulers `--schedulers` names.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum Scheduler {
    Fcfs,
    Satf,
    Opt,
    Deadline,
    Cats,
}

impl From<Scheduler> for Policy {
    fn from(s: Scheduler) -> Policy {
        match s {
            Scheduler::Fcfs => Policy::Fcfs,
            Scheduler::Satf => Policy::Satf,
            Scheduler::Opt => Policy::Opt,
            Scheduler::Deadline => Policy::Deadline,
            Scheduler::Cats => Policy::Cats,
        }
    }
}

fn ms(ns: u64) -> String {
    format!("{:.2}", ns as f64 / 1e6)
}

pub fn run(a: SimArgs) -> anyhow::Result<ExitCode> {
    let sources = [a.example, a.requests.is_some(), a.generate.is_some()].iter().filter(|&&x| x).count();
    if sources != 1 {
        bail!("give one of --example, --requests FILE and --generate N");
    }
    let (trace, mut drive, default_head, default_policies): (Option<Vec<Arrival>>, Drive, u64, &[Policy]) = if a.example {
        let t = [95, 10, 60, 41]
            .into_iter()
            .map(|p| Arrival { at_ns: 0, access: Access { start: p, sectors: 0, write: false }, stream: 0 })
            .collect();
        (Some(t), Drive::travel_only(100), 50, &[Policy::Fcfs, Policy::Satf, Policy::Opt])
    } else {
        let sectors = match a.size.as_deref() {
            Some(s) => bulkhead_config::parse_size(s).map_err(|e| anyhow::anyhow!("--size: {e}"))? / 512,
            None => 73_400_000_000 / 512,
        };
        let trace = a.requests.as_deref().map(read_requests).transpose()?;
        (trace, Drive::seed(sectors), 0, &Policy::ALL)
    };
    if a.travel_only {
        drive = Drive::travel_only(drive.sectors);
    }
    drive.validate().map_err(|e| anyhow::anyhow!("the model: {e}"))?;
    if let Some(t) = &trace {
        if let Some(r) = t.iter().find(|r| r.access.end() > drive.sectors) {
            bail!(
                "a request at sector {} of {} sectors lies beyond the modelled device's {} sectors (--size)",
                r.access.start,
                r.access.sectors,
                drive.sectors
            );
        }
    }
    if let Some(n) = a.generate {
        if n == 0 || n > 10_000_000 {
            bail!("--generate {n}: from 1 to 10000000 requests");
        }
        if !(0.0..=1.0).contains(&a.write_fraction) {
            bail!("--write-fraction {}: from 0 to 1", a.write_fraction);
        }
        if !(a.interval_ms.is_finite() && a.interval_ms > 0.0) {
            bail!("--interval-ms {}: must be positive", a.interval_ms);
        }
    }
    let policies: Vec<Policy> =
        if a.schedulers.is_empty() { default_policies.to_vec() } else { a.schedulers.iter().map(|&s| s.into()).collect() };
    let head = a.head.unwrap_or(default_head);
    let mut outcomes: Vec<Outcome> = Vec::new();
    for &p in &policies {
        let mut w: Box<dyn Workload> = match (&trace, a.generate) {
            (Some(t), _) => Box::new(Trace(t.clone())),
            (None, Some(n)) => Box::new(Uniform {
                requests: n,
                interval_ns: (a.interval_ms * 1e6) as u64,
                device_sectors: drive.sectors,
                sectors: a.sectors,
                write_fraction: a.write_fraction,
                streams: a.streams.max(1),
                seed: a.seed,
            }),
            (None, None) => unreachable!("one source was checked"),
        };
        outcomes.push(sim::run(&drive, head, p, Tuning::default(), w.as_mut(), u64::MAX));
    }
    if a.json {
        let v: Vec<serde_json::Value> = outcomes
            .iter()
            .map(|o| {
                let mut v = serde_json::json!({ "scheduler": o.policy.as_str(), "summary": o.summary() });
                if a.each || o.served.len() <= 20 {
                    v["served"] = serde_json::to_value(&o.served).expect("records serialise");
                }
                v
            })
            .collect();
        let doc = serde_json::json!({ "drive": drive, "head": head, "schedulers": v });
        println!("{}", serde_json::to_string_pretty(&doc)?);
        return Ok(ExitCode::SUCCESS);
    }
    for o in &outcomes {
        if !(a.each || o.served.len() <= 20) {
            continue;
        }
        let mut t = Table::new(&[&o.policy.as_str().to_uppercase(), "SERVICE", "WAIT", "RESPONSE"]);
        for r in &o.served {
            t.row(vec![r.start.to_string(), ms(r.service_ns()), ms(r.wait_ns()), ms(r.response_ns())]);
        }
        let s = o.summary();
        t.row(vec![
            "mean".into(),
            format!("{:.2}", s.mean_service_ms),
            format!("{:.2}", s.mean_wait_ms),
            format!("{:.2}", s.mean_response_ms),
        ]);
        print!("{}", t.render());
        println!();
    }
    let mut t = Table::new(&[
        "SCHEDULER",
        "REQUESTS",
        "MEAN SERVICE ms",
        "MEAN WAIT ms",
        "MEAN RESPONSE ms",
        "P99 ms",
        "SECTORS/ms",
        "CACHE HITS",
    ]);
    for o in &outcomes {
        let s = o.summary();
        t.row(vec![
            o.policy.as_str().into(),
            s.requests.to_string(),
            format!("{:.2}", s.mean_service_ms),
            format!("{:.2}", s.mean_wait_ms),
            format!("{:.2}", s.mean_response_ms),
            format!("{:.2}", s.p99_response_ms),
            format!("{:.2}", s.sectors_per_ms),
            s.hits.to_string(),
        ]);
    }
    print!("{}", t.render());
    Ok(ExitCode::SUCCESS)
}
