//! `bulkhead`: serve block devices from isolated driver domains.

mod driver_cmd;
mod serve;
mod sim_cmd;
mod status;
mod trace_cmd;
mod vdev_cmd;

use std::path::PathBuf;
use std::process::ExitCode;

/// The system allocator until a domain with guarded filters activates heap spaces (see
/// `bulkhead_guard::heap`); one relaxed load per allocation otherwise.
#[global_allocator]
static HEAP: bulkhead_guard::heap::Heap = bulkhead_guard::heap::Heap::new();

use clap::{Parser, Subcommand, ValueEnum};

#[derive(Parser)]
#[command(name = "bulkhead", version, about = "Block devices served by isolated, restartable driver domains")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run the supervisor, driver domains and exports until SIGINT/SIGTERM.
    Serve {
        /// TOML configuration (default: one 1 GiB ram device `disk0`, adaptive, FUSE export).
        #[arg(long)]
        config: Option<PathBuf>,
        /// Directory for the FUSE export, sockets and lock.
        #[arg(long, default_value = "./bulkhead-run")]
        run_dir: PathBuf,
        /// Run the driver domains from this executable, which must take `driver --spec JSON`
        /// as `bulkhead` does (a driver under development; default: this executable).
        #[arg(long)]
        driver_exe: Option<PathBuf>,
    },
    /// Print each device's state, driver pid, mode, requests, restarts, outages and memory.
    Status {
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
        /// Run directory of the `serve` to ask.
        #[arg(long, default_value = "./bulkhead-run")]
        run_dir: PathBuf,
    },
    /// Restart a device's driver domain now (also one that turned `failed`).
    Restart {
        /// Device name.
        device: String,
        /// Run directory of the `serve` to ask.
        #[arg(long, default_value = "./bulkhead-run")]
        run_dir: PathBuf,
    },
    /// Move a running device's filters: `passthrough` (in its driver domain), `interpose` (in
    /// a tap domain of their own) or `intercept` (in a tap domain that ends in the soft device,
    /// no driver domain). Requests in flight are reissued to the new domains; nothing fails.
    Tap {
        /// Device name.
        device: String,
        /// passthrough | interpose | intercept.
        mode: String,
        /// Run directory of the `serve` to ask.
        #[arg(long, default_value = "./bulkhead-run")]
        run_dir: PathBuf,
    },
    /// Insert a filter into, or remove one from, a running device's chain. Requests in flight
    /// are reissued to the new domains; nothing fails.
    Filter {
        /// Device name.
        device: String,
        #[command(subcommand)]
        op: FilterOp,
        /// Run directory of the `serve` to ask.
        #[arg(long, default_value = "./bulkhead-run", global = true)]
        run_dir: PathBuf,
    },
    /// Shows or changes the QoS of a running view (`[[device.view]]`): `KEY=VALUE` settings of
    /// credit_bytes, credit_us, burst_bytes, iops, burst_ios, weight over its current caps
    /// (`0` or `none` lifts a cap). The domain takes them at once, without a restart.
    Qos {
        /// View name.
        view: String,
        /// KEY=VALUE settings; none shows the caps in force.
        settings: Vec<String>,
        /// Run directory of the `serve` to ask.
        #[arg(long, default_value = "./bulkhead-run")]
        run_dir: PathBuf,
    },
    /// Snapshots of a device's `cow` overlay (qcow2 internal snapshots, which `qemu-img
    /// snapshot -l` lists too): `create` takes one while I/O runs (every acknowledged write is
    /// in it), `revert` makes the device's contents a snapshot's again (the device must be
    /// idle: unmount its file system first), `delete` frees what only it held.
    Snapshot {
        /// Device name.
        device: String,
        /// create | list | revert | delete.
        #[arg(value_enum)]
        op: SnapshotOpArg,
        /// The snapshot's name (not for `list`).
        name: Option<String>,
        /// Machine-readable output (`list`).
        #[arg(long)]
        json: bool,
        /// Run directory of the `serve` to ask.
        #[arg(long, default_value = "./bulkhead-run")]
        run_dir: PathBuf,
    },
    /// Summarise a trace written by a `trace` filter: requests, bytes, errors and latency per
    /// operation, requests per queue.
    Trace {
        /// The trace file.
        file: PathBuf,
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
    },
    /// Run a workload through disk schedulers on the modelled disk, with no device: per
    /// scheduler, each request's service, wait and response time and their means, mean
    /// service and response, the 99th percentile and throughput in sectors/ms.
    Sim(sim_cmd::SimArgs),
    /// Virtual devices: generated storage controller cards (seed 002's VPCI).
    Vdev {
        #[command(subcommand)]
        which: VdevCmd,
    },
    /// Benchmarks.
    Bench {
        #[command(subcommand)]
        which: BenchCmd,
    },
    /// The driver-domain role (exec'd by the supervisor; not for direct use).
    #[command(hide = true)]
    Driver {
        /// Domain description (JSON).
        #[arg(long)]
        spec: String,
    },
}

#[derive(Subcommand)]
enum VdevCmd {
    /// Write a card's spec (`card.json`) and datasheet (`datasheet.md`, `datasheet.html`):
    /// every seed is a different card, and the same seed always the same one.
    Generate {
        /// The card's seed.
        #[arg(long)]
        seed: u64,
        /// Directory to write to (created if missing).
        #[arg(long)]
        out: PathBuf,
    },
    /// The device-model domain of a `vdev` device (exec'd by the supervisor; not for direct
    /// use).
    #[command(hide = true)]
    Model {
        /// Domain description (JSON).
        #[arg(long)]
        spec: String,
    },
}

#[derive(Subcommand)]
enum FilterOp {
    /// Insert a filter, given as the lines of its `[[device.filter]]` table:
    /// `bulkhead filter disk0 add 'type = "delay"' 'read_us = 200'`.
    Add {
        /// Position (0: nearest the frontend; default: nearest the backend).
        #[arg(long)]
        at: Option<usize>,
        /// The table's lines.
        #[arg(required = true)]
        lines: Vec<String>,
    },
    /// Remove the filter at a position (0: nearest the frontend; `bulkhead status` lists them).
    Remove {
        /// Position.
        at: usize,
    },
}

#[derive(Clone, Copy, ValueEnum)]
enum SnapshotOpArg {
    Create,
    List,
    Revert,
    Delete,
}

#[derive(Clone, Copy, ValueEnum)]
enum ModeArg {
    Irq,
    Poll,
    Adaptive,
    All,
}

#[derive(Subcommand)]
enum BenchCmd {
    /// The device channel between two processes, per notification mode.
    Channel {
        /// Mode to measure.
        #[arg(long, value_enum, default_value = "all")]
        mode: ModeArg,
        /// JSON output.
        #[arg(long)]
        json: bool,
        /// Seconds per IOPS phase.
        #[arg(long, default_value_t = 2.0)]
        seconds: f64,
        /// Round trips sampled per latency phase.
        #[arg(long, default_value_t = 200_000)]
        samples: usize,
        /// Do not pin the frontend and the driver domain to different CPUs.
        #[arg(long)]
        no_pin: bool,
    },
    /// The cost of the block tap: no filter, a trace filter in the driver domain (passthrough)
    /// and in a tap domain (interpose), through the library and FUSE; nbdkit's filters beside.
    Tap {
        /// Notification mode of the devices.
        #[arg(long, value_enum, default_value = "poll")]
        mode: ModeArg,
        /// Bytes written and read sequentially (the device's size), e.g. 1G.
        #[arg(long, default_value = "1G")]
        bytes: String,
        /// Synchronous 4 KiB reads timed per system and path.
        #[arg(long, default_value_t = 100_000)]
        requests: usize,
        /// Skip nbdkit.
        #[arg(long)]
        no_nbdkit: bool,
        /// Scratch directory for trace files and mount points (a tmpfs).
        #[arg(long, default_value = "/dev/shm")]
        scratch: PathBuf,
        /// JSON output.
        #[arg(long)]
        json: bool,
    },
    /// One driver domain shared by views: a QD1 reader beside a noisy neighbour (no QoS, a
    /// cap, weights), four equal clients' fairness, one busy view against the device alone,
    /// and a 50 MiB/s cap's accuracy.
    Share {
        /// Notification mode of the device.
        #[arg(long, value_enum, default_value = "adaptive")]
        mode: ModeArg,
        /// Seconds per phase.
        #[arg(long, default_value_t = 3.0)]
        seconds: f64,
        /// Seconds of the cap-accuracy phase.
        #[arg(long, default_value_t = 10.0)]
        cap_seconds: f64,
        /// The noisy neighbour's caps, bytes per second, comma-separated, each a phase.
        #[arg(long, default_value = "32M,4M")]
        noisy_caps: String,
        /// Skip the phases over NBD next to qemu-storage-daemon.
        #[arg(long)]
        no_nbd: bool,
        /// JSON output.
        #[arg(long)]
        json: bool,
    },
    /// Disk images, copy-on-write and encryption (raw, qcow2, cow, crypt, crypt over qcow2) next
    /// to qemu-storage-daemon, both over NBD through fio's nbd engine.
    Images {
        /// Seconds per job.
        #[arg(long, default_value_t = 5)]
        seconds: u32,
        /// Bytes of each device, e.g. 1G.
        #[arg(long, default_value = "1G")]
        size: String,
        /// Scratch directory for the images (a tmpfs measures the formats, not a disk).
        #[arg(long, default_value = "/dev/shm")]
        scratch: PathBuf,
        /// Skip qemu-storage-daemon.
        #[arg(long)]
        no_qsd: bool,
        /// JSON output.
        #[arg(long)]
        json: bool,
    },
    /// The IDDR thesis' sysbench fileio experiment, bulkhead next to the peers (needs root).
    Fileio(FileioArgs),
    /// The VPT case study: a SURGE-style workload on ext4 over a vpt device, per disk scheduler
    /// (bulkhead's and the kernel's), with and without O_DIRECT, the simulator beside (needs root).
    Surge(SurgeArgs),
    /// Outage per driver-domain restart: SIGKILL the driver under load, again and again.
    Restart {
        /// Kills to perform (at least 1).
        #[arg(long, default_value_t = 100)]
        kills: usize,
        /// Notification mode of the device.
        #[arg(long, value_enum, default_value = "adaptive")]
        mode: ModeArg,
        /// Load threads (and queues).
        #[arg(long, default_value_t = 2)]
        threads: usize,
        /// `passthrough`: kill the device's only domain; `interpose`: a tap domain over a
        /// driver domain, the one `--kill` names being killed and replaced alone.
        #[arg(long, default_value = "passthrough")]
        tap: String,
        /// With `--tap interpose`, the domain to kill: `driver` (below the tap domain) or `tap`.
        #[arg(long, default_value = "driver")]
        kill: String,
        /// JSON output.
        #[arg(long)]
        json: bool,
    },
    /// Write capture: what one caught write costs for each mechanism (userfaultfd, mprotect)
    /// and mode (DWC's single step, SCDWC's cache), beside an unguarded write.
    ///
    /// With `--filters`: throughput and CPU of the trace, crypt and cow filters under fio
    /// through FUSE, for `guard` off, dwc, and scdwc with C from 0 to 100. With
    /// `--isolation`: the share of injected faults those filters make that is stopped before
    /// the state it aims at changes, per setting. Either or both, with `--plot` for an SVG.
    Guard {
        /// Writes timed per measurement.
        #[arg(long, default_value_t = 200_000)]
        writes: usize,
        /// Measure real filters under fio instead.
        #[arg(long)]
        filters: bool,
        /// Measure the isolation rate: faults injected into real filters, checked in memory.
        #[arg(long)]
        isolation: bool,
        /// With --isolation: faults per setting, spread over the filters and the targets.
        #[arg(long, default_value_t = 300)]
        faults: u32,
        /// With --filters or --isolation: only these settings (comma-separated: `off`, `dwc`
        /// or a cache size C, each but `off` with `+keys` for protection keys), not all.
        #[arg(long, value_delimiter = ',')]
        settings: Vec<String>,
        /// With --filters or --isolation: write the figures as an SVG here.
        #[arg(long)]
        plot: Option<PathBuf>,
        /// With --filters: seconds of fio per setting.
        #[arg(long, default_value_t = 5)]
        seconds: u32,
        /// With --filters: where the trace, volume and overlay files go.
        #[arg(long, default_value = "/tmp")]
        scratch: PathBuf,
        /// JSON output.
        #[arg(long)]
        json: bool,
    },
    /// What an idle `serve` costs as devices are added: CPU of serve and its domains, serve's
    /// threads and memory, for each device count (runs `serve` itself; needs root for FUSE).
    Idle {
        /// Device counts (comma-separated), each measured with a `serve` of its own.
        #[arg(long, value_delimiter = ',', default_value = "100,300,1000", value_parser = clap::value_parser!(u32).range(1..=5000))]
        devices: Vec<u32>,
        /// Seconds of quiet measured at each count.
        #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u32).range(1..=600))]
        seconds: u32,
        /// Measure this build of `bulkhead` instead (a `serve` of another version).
        #[arg(long)]
        exe: Option<PathBuf>,
        /// JSON output.
        #[arg(long)]
        json: bool,
    },
    /// Virtual devices: 4 KiB QD1 latency and QD16 IOPS through a `vdev` card with the driver
    /// taking interrupts and polling, `ram` beside; the cost of one trapped register write.
    Vdev {
        /// The card's seed.
        #[arg(long, default_value_t = 7)]
        seed: u64,
        /// Bytes of each device, e.g. 256M.
        #[arg(long, default_value = "256M")]
        size: String,
        /// Timed QD1 requests per direction and device.
        #[arg(long, default_value_t = 20_000)]
        requests: usize,
        /// Seconds of each QD16 run.
        #[arg(long, default_value_t = 5)]
        seconds: u32,
        /// Trapped register writes timed.
        #[arg(long, default_value_t = 20_000)]
        writes: usize,
        /// JSON output.
        #[arg(long)]
        json: bool,
    },
}

#[derive(clap::Args)]
struct SurgeArgs {
    /// Page reads per scheduler and mode, all processes together.
    #[arg(long, default_value_t = 50_000)]
    reads: u64,
    /// Processes reading at once.
    #[arg(long, default_value_t = 64)]
    processes: u32,
    /// Files (the L of Zipf(L)).
    #[arg(long, default_value_t = 20000)]
    files: u32,
    /// Files a process reads a round: Pareto(α1, k1), as "α1,k1".
    #[arg(long, default_value = "2.43,1")]
    count: String,
    /// Think time after each page, ms: Pareto(α2, k2), as "α2,k2".
    #[arg(long, default_value = "1.5,10")]
    think: String,
    /// Seed of every draw.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Schedulers (comma-separated): bulkhead's fcfs, satf, opt, deadline, cats; the kernel's
    /// mq-deadline, bfq, none.
    #[arg(long, value_delimiter = ',', default_value = "cats,deadline,fcfs,mq-deadline,bfq,none")]
    schedulers: Vec<String>,
    /// Modes (comma-separated): direct (O_DIRECT), cached.
    #[arg(long, value_delimiter = ',', default_value = "direct,cached")]
    modes: Vec<String>,
    /// bulkhead policies the simulator runs (comma-separated; `none` for none).
    #[arg(long, value_delimiter = ',', default_value = "cats,deadline,fcfs")]
    sim: Vec<String>,
    /// The vpt's k, locked for the run.
    #[arg(long, default_value_t = 1.0)]
    k: f64,
    /// Bytes of the device (the model's D), e.g. 4G.
    #[arg(long, default_value = "4G")]
    size: String,
    /// Accesses a bulkhead scheduler keeps in flight below.
    #[arg(long, default_value_t = 1)]
    depth: u32,
    /// The loop device's read-ahead, KiB.
    #[arg(long, default_value_t = 128)]
    read_ahead_kb: u32,
    /// Where to write report.json, surge.svg and report.txt.
    #[arg(long, default_value = "bench-surge")]
    out: PathBuf,
    /// Scratch directory (a tmpfs).
    #[arg(long, default_value = "/dev/shm")]
    scratch: PathBuf,
    /// Print the JSON report instead of the tables.
    #[arg(long)]
    json: bool,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.cmd {
        Cmd::Serve { config, run_dir, driver_exe } => serve::run(config.as_deref(), &run_dir, driver_exe.as_deref()),
        Cmd::Status { json, run_dir } => status::run(&run_dir, json),
        Cmd::Restart { device, run_dir } => status::restart(&run_dir, &device),
        Cmd::Driver { spec } => driver_cmd::run(&spec),
        Cmd::Trace { file, json } => trace_cmd::run(&file, json),
        Cmd::Sim(args) => sim_cmd::run(args),
        Cmd::Vdev { which: VdevCmd::Generate { seed, out } } => vdev_cmd::generate(seed, &out),
        Cmd::Vdev { which: VdevCmd::Model { spec } } => vdev_cmd::model(&spec),
        Cmd::Snapshot { device, op, name, json, run_dir } => {
            let op = match op {
                SnapshotOpArg::Create => "create",
                SnapshotOpArg::List => "list",
                SnapshotOpArg::Revert => "revert",
                SnapshotOpArg::Delete => "delete",
            };
            status::snapshot(&run_dir, &device, op, name.as_deref(), json)
        }
        Cmd::Qos { view, settings, run_dir } => status::qos(&run_dir, &view, &settings),
        Cmd::Tap { device, mode, run_dir } => status::change(&run_dir, &device, serde_json::json!({"cmd": "tap", "mode": mode})),
        Cmd::Filter { device, op: FilterOp::Add { at, lines }, run_dir } => status::change(
            &run_dir,
            &device,
            serde_json::json!({"cmd": "filter", "op": "add", "at": at, "table": lines.join("\n")}),
        ),
        Cmd::Filter { device, op: FilterOp::Remove { at }, run_dir } => {
            status::change(&run_dir, &device, serde_json::json!({"cmd": "filter", "op": "remove", "at": at}))
        }
        Cmd::Bench { which: BenchCmd::Channel { mode, json, seconds, samples, no_pin } } => {
            bench_channel(mode, json, seconds, samples, !no_pin)
        }
        Cmd::Bench { which: BenchCmd::Surge(args) } => bench_surge(args),
        Cmd::Bench { which: BenchCmd::Restart { kills, mode, threads, tap, kill, json } } => {
            bench_restart(kills, mode, threads, &tap, &kill, json)
        }
        Cmd::Bench { which: BenchCmd::Guard { writes, filters, isolation, faults, settings, plot, seconds, scratch, json } } => {
            if filters || isolation {
                let which = GuardFigures { filters, isolation, faults, settings, plot, seconds, scratch };
                bench_guard_figures(which, json)
            } else {
                bench_guard(writes, json)
            }
        }
        Cmd::Bench { which: BenchCmd::Vdev { seed, size, requests, seconds, writes, json } } => {
            bench_vdev(seed, &size, requests, seconds, writes, json)
        }
        Cmd::Bench { which: BenchCmd::Tap { mode, bytes, requests, no_nbdkit, scratch, json } } => {
            bench_tap(mode, &bytes, requests, !no_nbdkit, scratch, json)
        }
        Cmd::Bench { which: BenchCmd::Share { mode, seconds, cap_seconds, noisy_caps, no_nbd, json } } => {
            bench_share(mode, seconds, cap_seconds, &noisy_caps, !no_nbd, json)
        }
        Cmd::Bench { which: BenchCmd::Images { seconds, size, scratch, no_qsd, json } } => {
            bench_images(seconds, &size, scratch, !no_qsd, json)
        }
        Cmd::Bench { which: BenchCmd::Fileio(args) } => bench_fileio(args),
        Cmd::Bench { which: BenchCmd::Idle { devices, seconds, exe, json } } => bench_idle(devices, seconds, exe, json),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("bulkhead: {e:#}");
            ExitCode::from(1)
        }
    }
}

fn bench_surge(a: SurgeArgs) -> anyhow::Result<ExitCode> {
    use bulkhead_bench::surge::{self, Column, Mode};
    use bulkhead_diskmodel::sched::Policy;
    use bulkhead_diskmodel::surge::Pareto;
    let pareto = |key: &str, s: &str| -> anyhow::Result<Pareto> {
        let v: Vec<f64> = s
            .split(',')
            .map(|x| x.trim().parse::<f64>())
            .collect::<Result<_, _>>()
            .map_err(|e| anyhow::anyhow!("--{key}: `{s}`: {e} (expected \"alpha,k\")"))?;
        match v[..] {
            [alpha, k] if alpha > 0.0 && k > 0.0 && alpha.is_finite() && k.is_finite() => Ok(Pareto { alpha, k }),
            _ => anyhow::bail!("--{key}: `{s}`: expected \"alpha,k\", both positive"),
        }
    };
    let mut opts = surge::Options::default();
    let p = &mut opts.params;
    if !(1..=1024).contains(&a.processes) {
        anyhow::bail!("--processes: {} is out of range 1..=1024", a.processes);
    }
    if !(1..=1_000_000).contains(&a.files) {
        anyhow::bail!("--files: {} is out of range 1..=1000000", a.files);
    }
    if a.reads == 0 {
        anyhow::bail!("--reads: must be at least 1");
    }
    (p.processes, p.files, p.reads, p.seed) = (a.processes, a.files, a.reads, a.seed);
    p.count = pareto("count", &a.count)?;
    p.think_ms = pareto("think", &a.think)?;
    opts.columns = a
        .schedulers
        .iter()
        .map(|s| Column::parse(s).map_err(|e| anyhow::anyhow!("--schedulers: {e}")))
        .collect::<Result<_, _>>()?;
    opts.modes = a
        .modes
        .iter()
        .map(|m| match m.as_str() {
            "direct" => Ok(Mode::Direct),
            "cached" => Ok(Mode::Cached),
            other => anyhow::bail!("--modes: unknown mode `{other}` (direct, cached)"),
        })
        .collect::<Result<_, _>>()?;
    opts.sim = a
        .sim
        .iter()
        .filter(|s| s.as_str() != "none")
        .map(|s| Policy::parse(s).ok_or_else(|| anyhow::anyhow!("--sim: unknown policy `{s}` (fcfs, satf, opt, deadline, cats)")))
        .collect::<Result<_, _>>()?;
    if !(a.k.is_finite() && a.k > 0.0) {
        anyhow::bail!("--k: {} must be a positive number", a.k);
    }
    opts.k = a.k;
    opts.size = bulkhead_config::parse_size(&a.size).map_err(|e| anyhow::anyhow!("--size: {e}"))?;
    if !(1..=256).contains(&a.depth) {
        anyhow::bail!("--depth: {} is out of range 1..=256", a.depth);
    }
    opts.depth = a.depth;
    opts.read_ahead_kb = a.read_ahead_kb;
    opts.scratch = a.scratch;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    signal_hook::flag::register(signal_hook::consts::SIGINT, stop.clone())?;
    signal_hook::flag::register(signal_hook::consts::SIGTERM, stop.clone())?;
    let exe = std::env::current_exe()?;
    let tty = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let mut last = (String::new(), std::time::Instant::now());
    let report = surge::run_bench(&exe, &opts, &stop, |p| {
        let line = if p.total > 0 { format!("{}: {}/{} reads", p.what, p.done, p.total) } else { p.what.clone() };
        if tty {
            eprint!("\r\x1b[2Kbench surge: {line}");
        } else if p.what != last.0 || last.1.elapsed().as_secs() >= 10 {
            // Without a terminal: a line per part, and one every ten seconds within it.
            eprintln!("bench surge: {line}");
            last = (p.what.clone(), std::time::Instant::now());
        }
    })
    .map_err(anyhow::Error::msg)?;
    if tty {
        eprintln!();
    }
    let files = surge::write_outputs(&report, &a.out).map_err(anyhow::Error::msg)?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", report.render());
    }
    for f in files {
        eprintln!("bench surge: wrote {}", f.display());
    }
    Ok(if report.interrupted { ExitCode::from(130) } else { ExitCode::SUCCESS })
}

/// `bench fileio`'s options.
#[derive(clap::Args)]
struct FileioArgs {
    /// The quick subset (about two minutes).
    #[arg(long)]
    quick: bool,
    /// Modes (comma-separated): rndrd, rndwr, rndrw, seqrd, seqwr, seqrewr.
    #[arg(long, value_delimiter = ',')]
    modes: Option<Vec<String>>,
    /// Thread counts (comma-separated).
    #[arg(long, value_delimiter = ',')]
    threads: Option<Vec<u32>>,
    /// bulkhead backends (comma-separated): ram, file.
    #[arg(long, value_delimiter = ',')]
    backends: Option<Vec<String>>,
    /// Notification modes (comma-separated): irq, poll, adaptive.
    #[arg(long, value_delimiter = ',')]
    notify: Option<Vec<String>>,
    /// Peers (comma-separated): native, nbdkit, qsd, bindfs; `none` for none.
    #[arg(long, value_delimiter = ',')]
    peers: Option<Vec<String>>,
    /// Seconds per point.
    #[arg(long)]
    seconds: Option<u32>,
    /// Measure each point this many times, the systems in turns each time, and report
    /// each system's median round with the lowest and highest.
    #[arg(long, default_value_t = 1)]
    rounds: u32,
    /// Where to write report.json, points.csv, fileio.svg and report.txt.
    #[arg(long, default_value = "bench-fileio")]
    out: PathBuf,
    /// Scratch directory for images (tmpfs).
    #[arg(long, default_value = "/dev/shm")]
    scratch: PathBuf,
    /// bulkhead's spin budget in µs (default: the self-tuning "auto").
    #[arg(long)]
    spin_budget_us: Option<u64>,
    /// Print the JSON report instead of the tables.
    #[arg(long)]
    json: bool,
    /// Measure nothing: read a stored run (the directory `--out` wrote, or its report.json or points.csv)
    /// and print its tables and goals as this build renders them.
    #[arg(long, value_name = "RUN", conflicts_with_all = ["quick", "modes", "threads", "backends", "notify", "peers", "seconds", "rounds", "spin_budget_us"])]
    from: Option<PathBuf>,
}

fn bench_fileio(a: FileioArgs) -> anyhow::Result<ExitCode> {
    use bulkhead_bench::fileio::{self, System};
    let show = |report: &fileio::Report| -> anyhow::Result<()> {
        if a.json {
            println!("{}", serde_json::to_string_pretty(report)?);
        } else {
            print!("{}", report.render());
        }
        Ok(())
    };
    if let Some(run) = &a.from {
        show(&fileio::Report::load(run).map_err(anyhow::Error::msg)?)?;
        return Ok(ExitCode::SUCCESS);
    }
    let mut opts = if a.quick { fileio::Options::quick() } else { fileio::Options::full() };
    let check = |key: &str, given: &[String], allowed: &[&str]| -> anyhow::Result<()> {
        match given.iter().find(|g| !allowed.contains(&g.as_str())) {
            Some(bad) => anyhow::bail!("--{key}: unknown value `{bad}` (one of {})", allowed.join(", ")),
            None => Ok(()),
        }
    };
    if let Some(m) = a.modes {
        check("modes", &m, &fileio::MODES)?;
        opts.modes = m;
    }
    if let Some(t) = a.threads {
        if let Some(bad) = t.iter().find(|t| !(1..=256).contains(*t)) {
            anyhow::bail!("--threads: {bad} is out of range 1..=256");
        }
        opts.threads = t;
    }
    if let Some(s) = a.seconds {
        if !(1..=3600).contains(&s) {
            anyhow::bail!("--seconds: {s} is out of range 1..=3600");
        }
        opts.seconds = s;
    }
    if !(1..=100).contains(&a.rounds) {
        anyhow::bail!("--rounds: {} is out of range 1..=100", a.rounds);
    }
    opts.rounds = a.rounds;
    let (mut backends, mut notify): (Vec<String>, Vec<String>) = (Vec::new(), Vec::new());
    let mut peers: Vec<String> = Vec::new();
    for s in &opts.systems {
        match s {
            System::Bulkhead { backend, notify: n } => {
                if !backends.contains(backend) {
                    backends.push(backend.clone());
                }
                if !notify.contains(n) {
                    notify.push(n.clone());
                }
            }
            System::Peer { name } => peers.push(name.clone()),
        }
    }
    if let Some(b) = a.backends {
        check("backends", &b, &["ram", "file"])?;
        backends = b;
    }
    if let Some(n) = a.notify {
        check("notify", &n, &["irq", "poll", "adaptive"])?;
        notify = n;
    }
    if let Some(p) = a.peers {
        let p: Vec<String> = p.into_iter().filter(|x| x != "none").collect();
        check("peers", &p, &fileio::PEERS)?;
        peers = p;
    }
    opts.systems = backends
        .iter()
        .flat_map(|b| notify.iter().map(move |n| System::Bulkhead { backend: b.clone(), notify: n.clone() }))
        .chain(peers.into_iter().map(|name| System::Peer { name }))
        .collect();
    opts.scratch = a.scratch;
    if let Some(us) = a.spin_budget_us {
        if us > 1_000_000 {
            anyhow::bail!("--spin-budget-us: {us} exceeds one second");
        }
    }
    opts.spin_budget_us = a.spin_budget_us;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    signal_hook::flag::register(signal_hook::consts::SIGINT, stop.clone())?;
    signal_hook::flag::register(signal_hook::consts::SIGTERM, stop.clone())?;
    let exe = std::env::current_exe()?;
    let tty = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let report = fileio::run_matrix(&exe, &opts, &stop, |p| {
        if tty {
            eprint!("\r\x1b[2K{}", fileio::progress_line(p));
        } else {
            eprintln!("bench fileio: {}", fileio::progress_line(p));
        }
    })
    .map_err(anyhow::Error::msg)?;
    if tty {
        eprintln!();
    }
    let files = fileio::write_outputs(&report, &a.out).map_err(anyhow::Error::msg)?;
    show(&report)?;
    for f in files {
        eprintln!("bench fileio: wrote {}", f.display());
    }
    Ok(if report.interrupted { ExitCode::from(130) } else { ExitCode::SUCCESS })
}

fn bench_restart(kills: usize, mode: ModeArg, threads: usize, tap: &str, kill: &str, json: bool) -> anyhow::Result<ExitCode> {
    if !matches!(tap, "passthrough" | "interpose") {
        anyhow::bail!("--tap must be passthrough or interpose, not `{tap}`");
    }
    match (kill, tap) {
        ("driver", _) | ("tap", "interpose") => {}
        ("tap", _) => anyhow::bail!("--kill tap needs --tap interpose (only then is there a tap domain of its own)"),
        _ => anyhow::bail!("--kill must be driver or tap, not `{kill}`"),
    }
    if kills == 0 || kills > 100_000 {
        anyhow::bail!("--kills must be between 1 and 100000");
    }
    if threads == 0 || threads > 64 {
        anyhow::bail!("--threads must be between 1 and 64");
    }
    let mode = one_mode(mode, "restart")?;
    let exe = std::env::current_exe()?;
    let opts = bulkhead_bench::restart::Options { kills, mode: mode.into(), threads, tap: tap.into(), kill: kill.into() };
    let r = bulkhead_bench::restart::run(&exe, &opts, |p| eprintln!("bench restart: {p}")).map_err(anyhow::Error::msg)?;
    if json {
        println!("{}", serde_json::to_string_pretty(&r)?);
    } else {
        print!("{}", bulkhead_bench::restart::render(&r));
    }
    Ok(if r.errors == 0 { ExitCode::SUCCESS } else { ExitCode::from(1) })
}

/// The one notification mode a benchmark runs in (`all` is refused, naming the benchmark).
fn one_mode(mode: ModeArg, bench: &str) -> anyhow::Result<&'static str> {
    Ok(match mode {
        ModeArg::Irq => "irq",
        ModeArg::Poll => "poll",
        ModeArg::Adaptive => "adaptive",
        ModeArg::All => anyhow::bail!("bench {bench} takes one mode"),
    })
}

fn bench_share(
    mode: ModeArg,
    seconds: f64,
    cap_seconds: f64,
    noisy_caps: &str,
    nbd: bool,
    json: bool,
) -> anyhow::Result<ExitCode> {
    let mode = one_mode(mode, "share")?;
    if !(0.5..=600.0).contains(&seconds) || !(1.0..=600.0).contains(&cap_seconds) {
        anyhow::bail!("--seconds must be in 0.5..=600 and --cap-seconds in 1..=600");
    }
    let mut caps = Vec::new();
    for c in noisy_caps.split(',') {
        let cap = bulkhead_config::parse_size(c).map_err(|e| anyhow::anyhow!("--noisy-caps: {e}"))?;
        if cap < 1 << 20 {
            anyhow::bail!("--noisy-caps: `{c}` is less than 1M (bytes per second)");
        }
        caps.push(cap);
    }
    let exe = std::env::current_exe()?;
    let opts = bulkhead_bench::share::Options { mode: mode.into(), seconds, cap_seconds, noisy_caps: caps, nbd };
    let r = bulkhead_bench::share::run(&exe, &opts, |p| eprintln!("bench share: {p}")).map_err(anyhow::Error::msg)?;
    emit(&r, json, bulkhead_bench::share::render)
}

fn bench_tap(
    mode: ModeArg,
    bytes: &str,
    requests: usize,
    nbdkit: bool,
    scratch: PathBuf,
    json: bool,
) -> anyhow::Result<ExitCode> {
    let mode = one_mode(mode, "tap")?;
    let bytes = bulkhead_config::parse_size(bytes).map_err(anyhow::Error::msg)?;
    if bytes < 16 << 20 || bytes % (1 << 20) != 0 {
        anyhow::bail!("--bytes must be a whole number of MiB, at least 16M");
    }
    if requests == 0 || requests > 10_000_000 {
        anyhow::bail!("--requests must be between 1 and 10000000");
    }
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        anyhow::bail!("bench tap mounts FUSE exports: run it as root");
    }
    let exe = std::env::current_exe()?;
    let opts = bulkhead_bench::tap::Options { mode: mode.into(), bytes, requests, scratch, nbdkit };
    let r = bulkhead_bench::tap::run(&exe, &opts, |p| eprintln!("bench tap: {p}")).map_err(anyhow::Error::msg)?;
    emit(&r, json, bulkhead_bench::tap::render)
}

fn bench_vdev(seed: u64, size: &str, requests: usize, seconds: u32, writes: usize, json: bool) -> anyhow::Result<ExitCode> {
    let size = bulkhead_config::parse_size(size).map_err(|e| anyhow::anyhow!("--size: {e}"))?;
    if size < 16 << 20 || size % (1 << 20) != 0 {
        anyhow::bail!("--size must be a whole number of MiB, at least 16M");
    }
    if !(1..=10_000_000).contains(&requests) || !(1..=10_000_000).contains(&writes) {
        anyhow::bail!("--requests and --writes must be between 1 and 10000000");
    }
    check_seconds(seconds)?;
    let exe = std::env::current_exe()?;
    let opts = bulkhead_bench::vdev::Options { seed, size, requests, seconds, writes };
    let r = bulkhead_bench::vdev::run(&exe, &opts, |p| eprintln!("bench vdev: {p}")).map_err(anyhow::Error::msg)?;
    emit(&r, json, bulkhead_bench::vdev::render)
}

/// Prints a benchmark's report as JSON or as its table.
fn emit<R: serde::Serialize>(r: &R, json: bool, render: fn(&R) -> String) -> anyhow::Result<ExitCode> {
    if json {
        println!("{}", serde_json::to_string_pretty(r)?);
    } else {
        print!("{}", render(r));
    }
    Ok(ExitCode::SUCCESS)
}

/// `--seconds` of a timed benchmark.
fn check_seconds(seconds: u32) -> anyhow::Result<()> {
    if !(1..=600).contains(&seconds) {
        anyhow::bail!("--seconds must be between 1 and 600");
    }
    Ok(())
}

fn bench_guard(writes: usize, json: bool) -> anyhow::Result<ExitCode> {
    if !(bulkhead_bench::guard::PAGES_MIN..=100_000_000).contains(&writes) {
        anyhow::bail!("--writes must be between {} and 100000000", bulkhead_bench::guard::PAGES_MIN);
    }
    let opts = bulkhead_bench::guard::Options { writes };
    let r = bulkhead_bench::guard::run(&opts, |p| eprintln!("bench guard: {p}")).map_err(anyhow::Error::msg)?;
    emit(&r, json, bulkhead_bench::guard::render)
}

/// What `bench guard --filters` and `--isolation` run.
struct GuardFigures {
    filters: bool,
    isolation: bool,
    faults: u32,
    settings: Vec<String>,
    plot: Option<PathBuf>,
    seconds: u32,
    scratch: PathBuf,
}

fn bench_guard_figures(w: GuardFigures, json: bool) -> anyhow::Result<ExitCode> {
    check_seconds(w.seconds)?;
    if !w.scratch.is_dir() {
        anyhow::bail!("--scratch {}: not a directory", w.scratch.display());
    }
    if !(1..=100_000).contains(&w.faults) {
        anyhow::bail!("--faults must be between 1 and 100000");
    }
    use bulkhead_bench::guard_filters::Setting;
    let settings = if w.settings.is_empty() {
        Setting::all(true)
    } else {
        let parse = |s: &String| Setting::parse(s).map_err(|e| anyhow::anyhow!("--settings: {e}"));
        w.settings.iter().map(parse).collect::<anyhow::Result<Vec<_>>>()?
    };
    if w.isolation && !settings.iter().any(|s| s.mode != bulkhead_filters::GuardMode::Off) {
        anyhow::bail!("--settings: --isolation needs a setting other than `off`");
    }
    if (w.filters || w.isolation) && settings.iter().any(|s| s.keys) && !bulkhead_sys::pkey::supported() {
        anyhow::bail!("--settings: `+keys` needs protection keys, which this processor does not have");
    }
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        anyhow::bail!("bench guard --filters and --isolation need root (FUSE exports, userfaultfd on shared memory)");
    }
    let progress = |p: &str| eprintln!("bench guard: {p}");
    let filters = if w.filters {
        let exe = std::env::current_exe()?;
        let opts =
            bulkhead_bench::guard_filters::Options { seconds: w.seconds, scratch: w.scratch.clone(), settings: settings.clone() };
        Some(bulkhead_bench::guard_filters::run(&exe, &opts, progress).map_err(anyhow::Error::msg)?)
    } else {
        None
    };
    let isolation = if w.isolation {
        let opts = bulkhead_bench::guard_isolation::Options { faults: w.faults, scratch: w.scratch, settings };
        Some(bulkhead_bench::guard_isolation::run(&opts, progress).map_err(anyhow::Error::msg)?)
    } else {
        None
    };
    let figures = bulkhead_bench::guard_figures::Figures { filters, isolation };
    if let Some(p) = &w.plot {
        std::fs::write(p, bulkhead_bench::guard_figures::svg(&figures))
            .map_err(|e| anyhow::anyhow!("--plot {}: {e}", p.display()))?;
        eprintln!("bench guard: plot written to {}", p.display());
    }
    emit(&figures, json, bulkhead_bench::guard_figures::render)
}

fn bench_images(seconds: u32, size: &str, scratch: PathBuf, qsd: bool, json: bool) -> anyhow::Result<ExitCode> {
    let size = bulkhead_config::parse_size(size).map_err(|e| anyhow::anyhow!("--size: {e}"))?;
    if size < 64 << 20 || size % (1 << 20) != 0 {
        anyhow::bail!("--size must be a whole number of MiB, at least 64M");
    }
    check_seconds(seconds)?;
    if !scratch.is_dir() {
        anyhow::bail!("--scratch {}: not a directory", scratch.display());
    }
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    signal_hook::flag::register(signal_hook::consts::SIGINT, stop.clone())?;
    signal_hook::flag::register(signal_hook::consts::SIGTERM, stop.clone())?;
    let exe = std::env::current_exe()?;
    let opts = bulkhead_bench::images::Options { seconds, size, scratch, qsd };
    let r =
        bulkhead_bench::images::run_bench(&exe, &opts, &stop, |p| eprintln!("bench images: {p}")).map_err(anyhow::Error::msg)?;
    if json {
        println!("{}", serde_json::to_string_pretty(&r)?);
    } else {
        print!("{}", bulkhead_bench::images::render(&r));
    }
    Ok(if r.interrupted { ExitCode::from(130) } else { ExitCode::SUCCESS })
}

fn bench_channel(mode: ModeArg, json: bool, seconds: f64, samples: usize, pin: bool) -> anyhow::Result<ExitCode> {
    use bulkhead_channel::NotifyMode;
    if !(0.1..=600.0).contains(&seconds) {
        anyhow::bail!("--seconds must be between 0.1 and 600");
    }
    if !(1000..=100_000_000).contains(&samples) {
        anyhow::bail!("--samples must be between 1000 and 100000000");
    }
    let modes = match mode {
        ModeArg::Irq => vec![NotifyMode::Irq],
        ModeArg::Poll => vec![NotifyMode::Poll],
        ModeArg::Adaptive => vec![NotifyMode::Adaptive],
        ModeArg::All => vec![NotifyMode::Irq, NotifyMode::Poll, NotifyMode::Adaptive],
    };
    let exe = std::env::current_exe()?;
    let opts = bulkhead_bench::channel::Options { modes, seconds, samples, pin };
    let report = bulkhead_bench::channel::run(&exe, &opts, |p| eprintln!("bench channel: {p}")).map_err(anyhow::Error::msg)?;
    if json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", bulkhead_bench::channel::render(&report));
    }
    Ok(ExitCode::SUCCESS)
}

fn bench_idle(devices: Vec<u32>, seconds: u32, exe: Option<PathBuf>, json: bool) -> anyhow::Result<ExitCode> {
    if bulkhead_sys::euid() != 0 {
        anyhow::bail!("bench idle runs serve with its FUSE export: run it as root");
    }
    let exe = match exe {
        Some(e) => e.canonicalize().map_err(|err| anyhow::anyhow!("--exe {}: {err}", e.display()))?,
        None => std::env::current_exe()?,
    };
    let opts =
        bulkhead_bench::idle::Options { devices: devices.into_iter().map(|d| d as usize).collect(), seconds: seconds.into() };
    let r = bulkhead_bench::idle::run(&exe, &opts, |p| eprintln!("bench idle: {p}"))?;
    emit(&r, json, bulkhead_bench::idle::render)
}
