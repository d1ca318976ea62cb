//! The command line of `bulkhead-bench`: each benchmark's arguments, parsed (ranges by clap's
//! own parsers, combinations by the benchmark's `Options::check`), run, and printed.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use crate::BenchError;
use anyhow::Context;
use clap::builder::{PossibleValuesParser, RangedU64ValueParser};
use clap::{Subcommand, ValueEnum};

/// Notification modes a benchmark runs in.
#[derive(Clone, Copy, ValueEnum)]
pub enum ModeArg {
    Irq,
    Poll,
    Adaptive,
    All,
}

/// The one notification mode a benchmark runs in.
#[derive(Clone, Copy, ValueEnum)]
pub enum OneMode {
    Irq,
    Poll,
    Adaptive,
}

impl OneMode {
    fn as_str(self) -> &'static str {
        match self {
            OneMode::Irq => "irq",
            OneMode::Poll => "poll",
            OneMode::Adaptive => "adaptive",
        }
    }
}

/// A count between `lo` and `hi`, for a `usize` option.
fn count(lo: u64, hi: u64) -> RangedU64ValueParser<usize> {
    RangedU64ValueParser::<usize>::new().range(lo..=hi)
}

/// Seconds as a decimal number between `lo` and `hi`.
fn seconds_f64(lo: f64, hi: f64) -> impl Fn(&str) -> Result<f64, String> + Clone + Send + Sync + 'static {
    move |s: &str| match s.parse::<f64>() {
        Ok(v) if (lo..=hi).contains(&v) => Ok(v),
        Ok(v) => Err(format!("{v} is not in {lo}..={hi}")),
        Err(e) => Err(format!("`{s}`: {e}")),
    }
}

/// A size (`64M`, `1G`) of whole MiB, at least `min` bytes.
fn size_mib(min: u64) -> impl Fn(&str) -> Result<u64, String> + Clone + Send + Sync + 'static {
    move |s: &str| {
        let v = bulkhead_config::parse_size(s)?;
        if v < min || v % (1 << 20) != 0 {
            return Err(format!("`{s}` is not a whole number of MiB of at least {}M", min >> 20));
        }
        Ok(v)
    }
}

/// A bytes-per-second cap of at least 1 MiB/s.
fn cap(s: &str) -> Result<u64, String> {
    let v = bulkhead_config::parse_size(s)?;
    if v < 1 << 20 {
        return Err(format!("`{s}` is less than 1M (bytes per second)"));
    }
    Ok(v)
}

/// A directory that exists.
fn dir(s: &str) -> Result<PathBuf, String> {
    let p = PathBuf::from(s);
    if !p.is_dir() {
        return Err(format!("{s}: not a directory"));
    }
    Ok(p)
}

/// A Pareto distribution given as "alpha,k", both positive.
fn pareto(s: &str) -> Result<bulkhead_diskmodel::surge::Pareto, String> {
    let v: Vec<f64> = s
        .split(',')
        .map(|x| x.trim().parse::<f64>())
        .collect::<Result<_, _>>()
        .map_err(|e| format!("`{s}`: {e} (expected \"alpha,k\")"))?;
    match v[..] {
        [alpha, k] if alpha > 0.0 && k > 0.0 && alpha.is_finite() && k.is_finite() => {
            Ok(bulkhead_diskmodel::surge::Pareto { alpha, k })
        }
        _ => Err(format!("`{s}`: expected \"alpha,k\", both positive")),
    }
}

/// A positive, finite number.
fn positive(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 => Ok(v),
        _ => Err(format!("`{s}` is not a positive number")),
    }
}

#[derive(Subcommand)]
pub enum BenchCmd {
    /// The device channel between two processes, per notification mode.
    Channel {
        /// Mode to measure.
        #[arg(long, value_enum, default_value = "all")]
        mode: ModeArg,
        /// JSON output.
        #[arg(long)]
        json: bool,
        /// Seconds per IOPS phase.
        #[arg(long, default_value_t = 2.0, value_parser = seconds_f64(0.1, 600.0))]
        seconds: f64,
        /// Round trips sampled per latency phase.
        #[arg(long, default_value_t = 200_000, value_parser = count(1000, 100_000_000))]
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
        mode: OneMode,
        /// Bytes written and read sequentially (the device's size), e.g. 1G.
        #[arg(long, default_value = "1G", value_parser = size_mib(16 << 20))]
        bytes: u64,
        /// Synchronous 4 KiB reads timed per system and path.
        #[arg(long, default_value_t = 100_000, value_parser = count(1, 10_000_000))]
        requests: usize,
        /// Skip nbdkit.
        #[arg(long)]
        no_nbdkit: bool,
        /// Scratch directory for trace files and mount points (a tmpfs).
        #[arg(long, default_value = "/dev/shm", value_parser = dir)]
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
        mode: OneMode,
        /// Seconds per phase.
        #[arg(long, default_value_t = 3.0, value_parser = seconds_f64(0.5, 600.0))]
        seconds: f64,
        /// Seconds of the cap-accuracy phase.
        #[arg(long, default_value_t = 10.0, value_parser = seconds_f64(1.0, 600.0))]
        cap_seconds: f64,
        /// The noisy neighbour's caps, bytes per second, comma-separated, each a phase.
        #[arg(long, default_value = "32M,4M", value_delimiter = ',', value_parser = cap)]
        noisy_caps: Vec<u64>,
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
        #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..=600))]
        seconds: u32,
        /// Bytes of each device, e.g. 1G.
        #[arg(long, default_value = "1G", value_parser = size_mib(64 << 20))]
        size: u64,
        /// Scratch directory for the images (a tmpfs measures the formats, not a disk).
        #[arg(long, default_value = "/dev/shm", value_parser = dir)]
        scratch: PathBuf,
        /// Skip qemu-storage-daemon.
        #[arg(long)]
        no_qsd: bool,
        /// JSON output.
        #[arg(long)]
        json: bool,
    },
    /// The sysbench fileio experiment of the driver domain thesis, bulkhead next to the peers
    /// (needs root).
    Fileio(FileioArgs),
    /// The VPT case study: a SURGE-style workload on ext4 over a vpt device, per disk scheduler
    /// (bulkhead's and the kernel's), with and without O_DIRECT, the simulator beside (needs root).
    Surge(SurgeArgs),
    /// Outage per driver-domain restart: SIGKILL the driver under load, again and again.
    Restart {
        /// Kills to perform.
        #[arg(long, default_value_t = 100, value_parser = count(1, 100_000))]
        kills: usize,
        /// Notification mode of the device.
        #[arg(long, value_enum, default_value = "adaptive")]
        mode: OneMode,
        /// Load threads (and queues).
        #[arg(long, default_value_t = 2, value_parser = count(1, 64))]
        threads: usize,
        /// `passthrough`: kill the device's only domain; `interpose`: a tap domain over a
        /// driver domain, the one `--kill` names being killed and replaced alone.
        #[arg(long, default_value = "passthrough")]
        tap: String,
        /// The domain to kill: `driver`, or with `--tap interpose` `tap`; or `serve` itself
        /// (a keeper starts another, which takes over): each round of it is measured beside a
        /// driver kill, by the pause an application on the FUSE file sees (needs root).
        #[arg(long, default_value = "driver")]
        kill: String,
        /// Spare domains kept ready (`[domains] spares`); 0 execs every domain.
        #[arg(long, default_value_t = 2, value_parser = count(0, 64))]
        spares: usize,
        /// Standby domains (`[domains] standbys`): after its first restart the device keeps
        /// its next domain waiting; 0 makes every domain at its restart.
        #[arg(long, default_value_t = 4, value_parser = count(0, 64))]
        standbys: usize,
        /// Upgrade `serve` (`bulkhead upgrade`) each round instead of killing a domain,
        /// measured as `--kill serve` is.
        #[arg(long)]
        upgrade: bool,
        /// JSON output.
        #[arg(long)]
        json: bool,
    },
    /// Write capture: what one caught write costs for each mechanism (userfaultfd, mprotect)
    /// and mode (DWC's single step, SCDWC's cache), beside an unguarded write.
    ///
    /// With `--filters`: throughput and CPU of the trace, crypt and cow filters under fio
    /// through FUSE, for `guard` off, dwc, and scdwc with C from 0 to 100, with `--plot` for
    /// an SVG.
    Guard {
        /// Writes timed per measurement.
        #[arg(long, default_value_t = 200_000, value_parser = count(crate::guard::PAGES_MIN as u64, 100_000_000))]
        writes: usize,
        /// Measure real filters under fio instead.
        #[arg(long)]
        filters: bool,
        /// With --filters: only these settings (comma-separated: `off`, `dwc`
        /// or a cache size C, each but `off` with `+keys` for protection keys, a cache size
        /// with `+pages` for the page gate), not all.
        #[arg(long, value_delimiter = ',', value_parser = crate::guard_filters::Setting::parse)]
        settings: Vec<crate::guard_filters::Setting>,
        /// With --filters: write the figures as an SVG here.
        #[arg(long)]
        plot: Option<PathBuf>,
        /// With --filters: seconds of fio per setting.
        #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..=600))]
        seconds: u32,
        /// With --filters: where the trace, volume and overlay files go.
        #[arg(long, default_value = "/tmp", value_parser = dir)]
        scratch: PathBuf,
        /// With --filters: the device's spin budget in µs (default: the self-tuning "auto").
        #[arg(long, requires = "filters", value_parser = clap::value_parser!(u64).range(0..=1_000_000))]
        spin_budget_us: Option<u64>,
        /// JSON output.
        #[arg(long)]
        json: bool,
    },
    /// What an idle `serve` costs as devices are added: CPU of serve and its domains, serve's
    /// threads and memory, for each device count (runs `serve` itself; needs root for FUSE).
    Idle {
        /// Device counts (comma-separated), each measured with a `serve` of its own.
        #[arg(long, value_delimiter = ',', default_value = "100,300,1000", value_parser = count(1, 5000))]
        devices: Vec<usize>,
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
    /// Overload: many NBD clients at a deep queue on one device, a FUSE user beside them, a
    /// slowloris and a client that never reads its answers; each client's share of the
    /// completions, refusals, and `serve`'s memory (runs `serve`; needs root for FUSE).
    Overload {
        /// NBD connections.
        #[arg(long, default_value_t = 64, value_parser = count(1, 1024))]
        clients: usize,
        /// Requests each keeps in flight.
        #[arg(long, default_value_t = 128, value_parser = count(1, 512))]
        depth: usize,
        /// Seconds of load.
        #[arg(long, default_value_t = 60, value_parser = count(1, 3600))]
        seconds: usize,
        /// JSON output.
        #[arg(long)]
        json: bool,
    },
    /// Power cuts: `serve` and every domain SIGKILLed at a random moment while writers with
    /// FUA and flushes run through FUSE, again and again; after each, every block must hold
    /// what was acknowledged durable (or a later write), and a qcow2 image must pass
    /// `qemu-img check`. Exits non-zero on any loss (runs `serve`; needs root for FUSE).
    Powercut {
        /// Kills, for each format.
        #[arg(long, default_value_t = 200, value_parser = count(1, 100_000))]
        rounds: usize,
        /// Image formats (comma-separated): raw, qcow2.
        #[arg(long, value_delimiter = ',', default_value = "raw,qcow2", value_parser = crate::powercut::Format::parse)]
        format: Vec<crate::powercut::Format>,
        /// Writer threads (one writes FUA, the others flush every 8 writes).
        #[arg(long, default_value_t = 3, value_parser = count(2, 16))]
        threads: usize,
        /// Seed of the kills' moments and the blocks written (default: from the clock).
        #[arg(long)]
        seed: Option<u64>,
        /// JSON output.
        #[arg(long)]
        json: bool,
    },
    /// Chaos: faults of every kind at random (SIGKILL and SIGSTOP of domains, filters added and
    /// removed, tap modes switched, snapshots, the remote NBD server restarted) under fio
    /// verify on ext4 over FUSE and NBD, on a device of each kind; the faults by kind, errors,
    /// verify failures, e2fsck, outages and memory. Exits non-zero on any loss (runs `serve`,
    /// nbdkit, nbdfuse, fio; needs root).
    Chaos {
        /// Minutes of faults.
        #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u64).range(1..=600))]
        minutes: u64,
        /// Seed of the faults' choices (default: from the clock).
        #[arg(long)]
        seed: Option<u64>,
        /// JSON output.
        #[arg(long)]
        json: bool,
    },
    /// The kernel's block devices in the kernel lab (a TCG guest with ublk and nbd): the ublk
    /// export against a loop device over the FUSE export, the kernel's NBD client on the NBD
    /// export and rublk's `loop` target, 4 KiB random and 1 MiB sequential, with CPU per
    /// request (runs `scripts/guest-lab.sh`, QEMU, fio, nbd-client, rublk).
    Ublk {
        /// Alternated rounds of each system.
        #[arg(long, default_value_t = 3, value_parser = count(1, 100))]
        rounds: usize,
        /// Seconds per point.
        #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..=600))]
        seconds: u32,
        /// The backing file's size in MiB (in the guest's memory).
        #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u32).range(16..=1024))]
        size_mib: u32,
        /// Queues of every system.
        #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u16).range(1..=8))]
        queues: u16,
        /// rublk to compare with (default: `rublk` on PATH or in ~/.cargo/bin; left out if none).
        #[arg(long)]
        rublk: Option<PathBuf>,
        /// bulkhead's device notification: `adaptive`, `irq` (always sleep) or `poll`.
        #[arg(long, default_value = "adaptive", value_parser = ["adaptive", "irq", "poll"])]
        notify: String,
        /// JSON output.
        #[arg(long)]
        json: bool,
    },
    /// bulkhead's NBD export against nbdkit and qemu-nbd on the same backing, fio's nbd engine
    /// the client: throughput, latency and CPU per request of each process.
    Nbd {
        /// Alternated rounds of each server.
        #[arg(long, default_value_t = 5, value_parser = count(1, 50))]
        rounds: usize,
        /// Seconds per point.
        #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..=600))]
        seconds: u64,
        /// What the servers serve from.
        #[arg(long, value_enum, default_value = "ram")]
        backing: crate::nbd::Backing,
        /// JSON output.
        #[arg(long)]
        json: bool,
    },
    /// bulkhead's block layer through its fio engine (libbulkhead_fio.so, on a ram device of
    /// a `serve` it runs) against fio's null engine and the channel alone, in the same rounds.
    Fio {
        /// Alternated rounds.
        #[arg(long, default_value_t = 5, value_parser = count(1, 50))]
        rounds: usize,
        /// Seconds per fio point.
        #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..=600))]
        seconds: u64,
        /// Round trips sampled per latency phase of the channel.
        #[arg(long, default_value_t = 200_000, value_parser = count(1000, 100_000_000))]
        samples: usize,
        /// The engine (default: libbulkhead_fio.so beside this program, else in /usr/lib/bulkhead).
        #[arg(long)]
        engine: Option<PathBuf>,
        /// Do not pin the fio job and the domain (nor the channel's two ends) to different CPUs.
        #[arg(long)]
        no_pin: bool,
        /// JSON output.
        #[arg(long)]
        json: bool,
    },
    /// Ceph RBD: the `rbd` backend through bulkhead's fio engine and over NBD, against fio's
    /// rbd engine and qemu-storage-daemon's rbd driver, on a throwaway single-node cluster, and
    /// the outage of a killed rbd domain with and without the lock break (runs
    /// `scripts/ceph-dev.sh`, `serve`, fio, qsd).
    Rbd {
        /// Alternated rounds of each system.
        #[arg(long, default_value_t = 3, value_parser = count(1, 50))]
        rounds: usize,
        /// Seconds per point.
        #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..=600))]
        seconds: u64,
        /// Kills with the lock break (a third as many, at most 5, without it: each waits ~30 s).
        #[arg(long, default_value_t = 20, value_parser = count(0, 1000))]
        kills: usize,
        /// Image size, MiB.
        #[arg(long, default_value_t = 512, value_parser = clap::value_parser!(u64).range(16..=65536))]
        image_mib: u64,
        /// qemu-storage-daemon to compare with (left out if it has no rbd driver).
        #[arg(long, default_value = "qemu-storage-daemon")]
        qsd: PathBuf,
        /// bulkhead's fio engine (default: libbulkhead_fio.so beside this program, else in
        /// /usr/lib/bulkhead; left out if there is none).
        #[arg(long)]
        engine: Option<PathBuf>,
        /// JSON output.
        #[arg(long)]
        json: bool,
    },
    /// Virtual machines: bulkhead's vhost-user-blk export against qemu-storage-daemon's, from
    /// a host-side frontend and from real guests (QEMU, TCG), and the pauses a guest sees
    /// when a driver domain or `serve` is killed (runs `serve` and qemu-storage-daemon).
    Vm {
        /// Alternated rounds of each system.
        #[arg(long, default_value_t = 5, value_parser = count(1, 100))]
        rounds: usize,
        /// Seconds per point with the host-side frontend.
        #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=600))]
        seconds: u32,
        /// Seconds per point in a guest.
        #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..=600))]
        guest_seconds: u64,
        /// Kills of each kind in the restart part, and migrations of each system in the
        /// migrate part.
        #[arg(long, default_value_t = 20, value_parser = count(1, 1000))]
        kills: usize,
        /// Parts to run (comma-separated): host, guest, restart, and migrate (a guest moved
        /// between two servers on one shared file, not run by default).
        #[arg(long, value_delimiter = ',', default_value = "host,guest,restart", value_parser = crate::vm::Part::parse)]
        parts: Vec<crate::vm::Part>,
        /// qemu-storage-daemon to compare with.
        #[arg(long, default_value = "qemu-storage-daemon")]
        qsd: PathBuf,
        /// How the host-side frontend waits: `call` (sleeps until the device calls, as a
        /// guest's driver whose vCPU halts) or `poll` (spins on the used ring).
        #[arg(long, default_value = "call", value_parser = crate::vm::FrontendWait::parse)]
        frontend: crate::vm::FrontendWait,
        /// bulkhead's device notification: `adaptive`, `irq` (always sleep) or `poll`.
        #[arg(long, default_value = "adaptive", value_parser = ["adaptive", "irq", "poll"])]
        notify: String,
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
        #[arg(long, default_value = "256M", value_parser = size_mib(16 << 20))]
        size: u64,
        /// Timed QD1 requests per direction and device.
        #[arg(long, default_value_t = 20_000, value_parser = count(1, 10_000_000))]
        requests: usize,
        /// Seconds of each QD16 run.
        #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..=600))]
        seconds: u32,
        /// Trapped register writes timed.
        #[arg(long, default_value_t = 20_000, value_parser = count(1, 10_000_000))]
        writes: usize,
        /// JSON output.
        #[arg(long)]
        json: bool,
    },
}

#[derive(clap::Args)]
pub struct SurgeArgs {
    /// Page reads per scheduler and mode, all processes together.
    #[arg(long, default_value_t = 50_000, value_parser = clap::value_parser!(u64).range(1..))]
    reads: u64,
    /// Processes reading at once.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..=1024))]
    processes: u32,
    /// Files (the L of Zipf(L)).
    #[arg(long, default_value_t = 20000, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    files: u32,
    /// Files a process reads a round: Pareto(α1, k1), as "α1,k1".
    #[arg(long, default_value = "2.43,1", value_parser = pareto)]
    count: bulkhead_diskmodel::surge::Pareto,
    /// Think time after each page, ms: Pareto(α2, k2), as "α2,k2".
    #[arg(long, default_value = "1.5,10", value_parser = pareto)]
    think: bulkhead_diskmodel::surge::Pareto,
    /// Seed of every draw.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Schedulers (comma-separated): bulkhead's fcfs, satf, opt, deadline, cats; the kernel's
    /// mq-deadline, bfq, none.
    #[arg(long, value_delimiter = ',', default_value = "cats,deadline,fcfs,mq-deadline,bfq,none",
          value_parser = crate::surge::Column::parse)]
    schedulers: Vec<crate::surge::Column>,
    /// Modes (comma-separated): direct (O_DIRECT), cached.
    #[arg(long, value_delimiter = ',', default_value = "direct,cached", value_parser = PossibleValuesParser::new(["direct", "cached"]))]
    modes: Vec<String>,
    /// bulkhead policies the simulator runs (comma-separated; `none` for none).
    #[arg(long, value_delimiter = ',', default_value = "cats,deadline,fcfs",
          value_parser = PossibleValuesParser::new(["fcfs", "satf", "opt", "deadline", "cats", "none"]))]
    sim: Vec<String>,
    /// The vpt's k, locked for the run.
    #[arg(long, default_value_t = 1.0, value_parser = positive)]
    k: f64,
    /// Bytes of the device (the model's D), e.g. 4G.
    #[arg(long, default_value = "4G", value_parser = bulkhead_config::parse_size)]
    size: u64,
    /// Accesses a bulkhead scheduler keeps in flight below.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=256))]
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

/// `bench fileio`'s options.
#[derive(clap::Args)]
pub struct FileioArgs {
    /// The quick subset (about two minutes).
    #[arg(long)]
    quick: bool,
    /// Modes (comma-separated): rndrd, rndwr, rndrw, seqrd, seqwr, seqrewr.
    #[arg(long, value_delimiter = ',', value_parser = PossibleValuesParser::new(crate::fileio::MODES))]
    modes: Option<Vec<String>>,
    /// Thread counts (comma-separated).
    #[arg(long, value_delimiter = ',', value_parser = clap::value_parser!(u32).range(1..=256))]
    threads: Option<Vec<u32>>,
    /// bulkhead backends (comma-separated): ram, file.
    #[arg(long, value_delimiter = ',', value_parser = PossibleValuesParser::new(["ram", "file"]))]
    backends: Option<Vec<String>>,
    /// Notification modes (comma-separated): irq, poll, adaptive.
    #[arg(long, value_delimiter = ',', value_parser = PossibleValuesParser::new(["irq", "poll", "adaptive"]))]
    notify: Option<Vec<String>>,
    /// Peers (comma-separated): native, nbdkit, qsd, bindfs; `none` for none.
    #[arg(long, value_delimiter = ',', value_parser = PossibleValuesParser::new(crate::fileio::PEERS.iter().copied().chain(["none"])))]
    peers: Option<Vec<String>>,
    /// Seconds per point.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=3600))]
    seconds: Option<u32>,
    /// Measure each point this many times, the systems in turns each time, and report
    /// each system's median round with the lowest and highest.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=100))]
    rounds: u32,
    /// Where to write report.json, points.csv, fileio.svg and report.txt.
    #[arg(long, default_value = "bench-fileio")]
    out: PathBuf,
    /// Scratch directory for images (tmpfs).
    #[arg(long, default_value = "/dev/shm")]
    scratch: PathBuf,
    /// bulkhead's spin budget in µs (default: the self-tuning "auto").
    #[arg(long, value_parser = clap::value_parser!(u64).range(0..=1_000_000))]
    spin_budget_us: Option<u64>,
    /// Print the JSON report instead of the tables.
    #[arg(long)]
    json: bool,
    /// Measure nothing: read a stored run (the directory `--out` wrote, or its report.json or
    /// points.csv) and print its tables and goals as this build renders them.
    #[arg(long, value_name = "RUN", conflicts_with_all = ["quick", "modes", "threads", "backends", "notify", "peers", "seconds", "rounds", "spin_budget_us"])]
    from: Option<PathBuf>,
}

/// Runs `cmd`.
pub fn run(cmd: BenchCmd) -> anyhow::Result<ExitCode> {
    match cmd {
        BenchCmd::Channel { mode, json, seconds, samples, no_pin } => channel(mode, json, seconds, samples, !no_pin),
        BenchCmd::Tap { mode, bytes, requests, no_nbdkit, scratch, json } => {
            need_root("bench tap mounts FUSE exports")?;
            let opts = crate::tap::Options { mode: mode.as_str().into(), bytes, requests, scratch, nbdkit: !no_nbdkit };
            let r = crate::tap::run(&exe()?, &opts, |p| eprintln!("bench tap: {p}"))?;
            emit(&r, json, crate::tap::render)
        }
        BenchCmd::Share { mode, seconds, cap_seconds, noisy_caps, no_nbd, json } => {
            let opts = crate::share::Options { mode: mode.as_str().into(), seconds, cap_seconds, noisy_caps, nbd: !no_nbd };
            let r = crate::share::run(&exe()?, &opts, |p| eprintln!("bench share: {p}"))?;
            emit(&r, json, crate::share::render)
        }
        BenchCmd::Images { seconds, size, scratch, no_qsd, json } => {
            let stop = stop_on_signals()?;
            let opts = crate::images::Options { seconds, size, scratch, qsd: !no_qsd };
            let r = crate::images::run_bench(&exe()?, &opts, &stop, |p| eprintln!("bench images: {p}"))?;
            emit(&r, json, crate::images::render)?;
            Ok(if r.interrupted { ExitCode::from(130) } else { ExitCode::SUCCESS })
        }
        BenchCmd::Fileio(args) => fileio(args),
        BenchCmd::Surge(args) => surge(args),
        BenchCmd::Restart { kills, threads, kill, upgrade, json, .. } if upgrade || kill == "serve" => {
            need_root("bench restart --kill serve and --upgrade run serve with its FUSE export")?;
            let opts = crate::serve_restart::Options { rounds: kills, upgrade, threads };
            let r = crate::serve_restart::run(&exe()?, &opts, |p| eprintln!("bench restart: {p}"))?;
            emit(&r, json, crate::serve_restart::render)?;
            Ok(if r.errors == 0 { ExitCode::SUCCESS } else { ExitCode::from(1) })
        }
        BenchCmd::Restart { kills, mode, threads, tap, kill, spares, standbys, json, .. } => {
            let opts = crate::restart::Options { kills, mode: mode.as_str().into(), threads, tap, kill, spares, standbys };
            opts.check()?;
            let r = crate::restart::run(&exe()?, &opts, |p| eprintln!("bench restart: {p}"))?;
            emit(&r, json, crate::restart::render)?;
            Ok(if r.errors == 0 { ExitCode::SUCCESS } else { ExitCode::from(1) })
        }
        BenchCmd::Guard { writes, filters, settings, plot, seconds, scratch, spin_budget_us, json } => {
            if filters {
                let which = GuardFigures { settings, plot, seconds, scratch, spin_budget_us };
                guard_figures(which, json)
            } else {
                let r = crate::guard::run(&crate::guard::Options { writes }, |p| eprintln!("bench guard: {p}"))?;
                emit(&r, json, crate::guard::render)
            }
        }
        BenchCmd::Idle { devices, seconds, exe: other, json } => {
            need_root("bench idle runs serve with its FUSE export")?;
            let exe = match other {
                Some(e) => e.canonicalize().with_context(|| format!("--exe {}", e.display()))?,
                None => exe()?,
            };
            let opts = crate::idle::Options { devices, seconds: seconds.into() };
            let r = crate::idle::run(&exe, &opts, |p| eprintln!("bench idle: {p}"))?;
            emit(&r, json, crate::idle::render)
        }
        BenchCmd::Overload { clients, depth, seconds, json } => {
            need_root("bench overload runs serve with its FUSE export")?;
            let opts = crate::overload::Options { clients, depth, seconds: seconds as u64 };
            let r = crate::overload::run(&exe()?, &opts, |p| eprintln!("bench overload: {p}"))?;
            emit(&r, json, crate::overload::render)
        }
        BenchCmd::Powercut { rounds, format, threads, seed, json } => {
            need_root("bench powercut runs serve with its FUSE export")?;
            let seed = seed.unwrap_or_else(|| {
                std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64)
            });
            let opts = crate::powercut::Options { rounds, formats: format, threads, seed };
            let r = crate::powercut::run(&exe()?, &opts, |p| eprintln!("bench powercut: {p}"))?;
            let lost = r.lost_anything();
            let code = emit(&r, json, crate::powercut::render)?;
            if lost {
                anyhow::bail!("a power cut lost acknowledged data (above)");
            }
            Ok(code)
        }
        BenchCmd::Chaos { minutes, seed, json } => {
            need_root("bench chaos mounts file systems on loop devices over FUSE and NBD")?;
            let seed = seed.unwrap_or_else(|| {
                std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64)
            });
            let stop = stop_on_signals()?;
            let opts = crate::chaos::Options { minutes, seed };
            let r = crate::chaos::run_chaos(&exe()?, &opts, &stop, |p| eprintln!("bench chaos: {p}"))?;
            let lost = r.lost_anything();
            let code = emit(&r, json, crate::chaos::render)?;
            if lost {
                anyhow::bail!("the chaos run lost data or broke a device (above)");
            }
            Ok(code)
        }
        BenchCmd::Vm { rounds, seconds, guest_seconds, kills, parts, qsd, frontend, notify, json } => {
            need_root("bench vm runs serve, qemu-storage-daemon and QEMU guests")?;
            let opts = crate::vm::Options { rounds, seconds: seconds.into(), guest_seconds, kills, parts, qsd, frontend, notify };
            let r = crate::vm::run(&exe()?, &opts, |p| eprintln!("bench vm: {p}"))?;
            emit(&r, json, crate::vm::render)
        }
        BenchCmd::Ublk { rounds, seconds, size_mib, queues, rublk, notify, json } => {
            need_root("bench ublk runs QEMU guests whose serve makes block devices")?;
            let rublk = rublk.or_else(find_rublk);
            let opts = crate::ublk::Options { rounds, seconds, size_mib, queues, rublk, notify };
            let r = crate::ublk::run(&exe()?, &opts, |p| eprintln!("bench ublk: {p}"))?;
            emit(&r, json, crate::ublk::render)
        }
        BenchCmd::Nbd { rounds, seconds, backing, json } => {
            let opts = crate::nbd::Options { rounds, seconds, backing };
            let r = crate::nbd::run(&exe()?, &opts, |p| eprintln!("bench nbd: {p}"))?;
            emit(&r, json, crate::nbd::render)
        }
        BenchCmd::Fio { rounds, seconds, samples, engine, no_pin, json } => {
            let opts = crate::fio::Options { rounds, seconds, samples, engine, pin: !no_pin };
            let r = crate::fio::run(&exe()?, &opts, |p| eprintln!("bench fio: {p}"))?;
            emit(&r, json, crate::fio::render)
        }
        BenchCmd::Rbd { rounds, seconds, kills, image_mib, qsd, engine, json } => {
            need_root("bench rbd starts a cluster in a network namespace")?;
            let opts = crate::rbd::Options { rounds, seconds, kills, qsd, image_mib, engine };
            let r = crate::rbd::run(&exe()?, &opts, |p| eprintln!("bench rbd: {p}"))?;
            emit(&r, json, crate::rbd::render)
        }
        BenchCmd::Vdev { seed, size, requests, seconds, writes, json } => {
            let opts = crate::vdev::Options { seed, size, requests, seconds, writes };
            let r = crate::vdev::run(&exe()?, &opts, |p| eprintln!("bench vdev: {p}"))?;
            emit(&r, json, crate::vdev::render)
        }
    }
}

/// rublk on `PATH`, or where `cargo install` puts it.
fn find_rublk() -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    let cargo_bin = std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cargo/bin"));
    std::env::split_paths(&path).chain(cargo_bin).map(|d| d.join("rublk")).find(|p| p.is_file())
}

/// The `bulkhead` the benchmarks run (its `serve`, and the domains it execs):
/// `$BULKHEAD_EXE`, else the one beside this executable (as a package and a build install
/// them), else the first on `PATH`.
pub fn exe() -> anyhow::Result<PathBuf> {
    if let Some(p) = std::env::var_os("BULKHEAD_EXE") {
        let p = PathBuf::from(p);
        return p.canonicalize().with_context(|| format!("BULKHEAD_EXE={}", p.display()));
    }
    let own = std::env::current_exe().context("cannot find this executable")?;
    let beside = own.with_file_name("bulkhead");
    if beside.is_file() {
        return Ok(beside);
    }
    let on_path = std::env::var_os("PATH")
        .into_iter()
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .map(|d| d.join("bulkhead"))
        .find(|p| p.is_file());
    on_path.ok_or_else(|| {
        anyhow::anyhow!(
            "the benchmarks run bulkhead itself: no `bulkhead` beside {} or on PATH (install the bulkhead package, \
             build it with `cargo build --release -p bulkhead`, or name it with BULKHEAD_EXE)",
            own.display()
        )
    })
}

/// Writes the manual page of `cmd` as `NAME.1` in `out`, and one of each command under it as
/// `NAME-SUB.1`, all the way down; hidden commands are left out.
pub fn man_pages(cmd: clap::Command, out: &std::path::Path) -> anyhow::Result<ExitCode> {
    fn write(cmd: clap::Command, name: String, out: &std::path::Path) -> anyhow::Result<()> {
        for sub in cmd.get_subcommands().filter(|c| !c.is_hide_set() && c.get_name() != "help") {
            let sub_name = format!("{name}-{}", sub.get_name());
            write(sub.clone().name(sub_name.clone()), sub_name, out)?;
        }
        let path = out.join(format!("{name}.1"));
        let mut page = Vec::new();
        clap_mangen::Man::new(cmd).render(&mut page)?;
        std::fs::write(&path, page).with_context(|| format!("cannot write {}", path.display()))
    }
    std::fs::create_dir_all(out).with_context(|| format!("cannot create {}", out.display()))?;
    let name = cmd.get_name().to_string();
    write(cmd, name, out)?;
    Ok(ExitCode::SUCCESS)
}

/// Refuses `what` unless run as root.
pub fn need_root(what: &str) -> anyhow::Result<()> {
    if bulkhead_sys::euid() != 0 {
        anyhow::bail!("{what}: run it as root");
    }
    Ok(())
}

/// A flag SIGINT and SIGTERM set: long benchmarks stop between measurements and keep what they
/// measured.
fn stop_on_signals() -> anyhow::Result<Arc<AtomicBool>> {
    let stop = Arc::new(AtomicBool::new(false));
    signal_hook::flag::register(signal_hook::consts::SIGINT, stop.clone())?;
    signal_hook::flag::register(signal_hook::consts::SIGTERM, stop.clone())?;
    Ok(stop)
}

/// Prints a benchmark's report as JSON or as its table.
pub fn emit<R: serde::Serialize>(r: &R, json: bool, render: fn(&R) -> String) -> anyhow::Result<ExitCode> {
    if json {
        println!("{}", serde_json::to_string_pretty(r)?);
    } else {
        print!("{}", render(r));
    }
    Ok(ExitCode::SUCCESS)
}

/// Progress on standard error: one line rewritten on a terminal, otherwise a line per part
/// and one every ten seconds within it.
struct Progress {
    name: &'static str,
    tty: bool,
    last: (String, std::time::Instant),
}

impl Progress {
    fn new(name: &'static str) -> Self {
        Progress {
            name,
            tty: std::io::IsTerminal::is_terminal(&std::io::stderr()),
            last: (String::new(), std::time::Instant::now()),
        }
    }

    fn show(&mut self, part: &str, line: &str) {
        if self.tty {
            eprint!("\r\x1b[2K{}: {line}", self.name);
        } else if part != self.last.0 || self.last.1.elapsed().as_secs() >= 10 {
            eprintln!("{}: {line}", self.name);
            self.last = (part.to_string(), std::time::Instant::now());
        }
    }

    fn end(&self) {
        if self.tty {
            eprintln!();
        }
    }
}

fn surge(a: SurgeArgs) -> anyhow::Result<ExitCode> {
    use crate::surge::{self, Mode};
    use bulkhead_diskmodel::sched::Policy;
    let mut opts = surge::Options::default();
    let p = &mut opts.params;
    (p.processes, p.files, p.reads, p.seed, p.count, p.think_ms) = (a.processes, a.files, a.reads, a.seed, a.count, a.think);
    opts.columns = a.schedulers;
    opts.modes = a.modes.iter().map(|m| if m == "direct" { Mode::Direct } else { Mode::Cached }).collect();
    opts.sim = a.sim.iter().filter_map(|s| Policy::parse(s)).collect();
    (opts.k, opts.size, opts.depth, opts.read_ahead_kb, opts.scratch) = (a.k, a.size, a.depth, a.read_ahead_kb, a.scratch);
    let stop = stop_on_signals()?;
    let mut progress = Progress::new("bench surge");
    let report = surge::run_bench(&exe()?, &opts, &stop, |p| {
        let line = if p.total > 0 { format!("{}: {}/{} reads", p.what, p.done, p.total) } else { p.what.clone() };
        progress.show(&p.what, &line);
    })?;
    progress.end();
    let files = surge::write_outputs(&report, &a.out)?;
    emit(&report, a.json, surge::Report::render)?;
    for f in files {
        eprintln!("bench surge: wrote {}", f.display());
    }
    Ok(if report.interrupted { ExitCode::from(130) } else { ExitCode::SUCCESS })
}

fn fileio(a: FileioArgs) -> anyhow::Result<ExitCode> {
    use crate::fileio::{self, System};
    if let Some(run) = &a.from {
        return emit(&fileio::Report::load(run)?, a.json, fileio::Report::render);
    }
    let mut opts = if a.quick { fileio::Options::quick() } else { fileio::Options::full() };
    if let Some(m) = a.modes {
        opts.modes = m;
    }
    if let Some(t) = a.threads {
        opts.threads = t;
    }
    if let Some(s) = a.seconds {
        opts.seconds = s;
    }
    opts.rounds = a.rounds;
    let (mut backends, mut notify, mut peers) = (Vec::new(), Vec::new(), Vec::new());
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
    backends = a.backends.unwrap_or(backends);
    notify = a.notify.unwrap_or(notify);
    if let Some(p) = a.peers {
        peers = p.into_iter().filter(|x| x != "none").collect();
    }
    opts.systems = backends
        .iter()
        .flat_map(|b| notify.iter().map(move |n| System::Bulkhead { backend: b.clone(), notify: n.clone() }))
        .chain(peers.into_iter().map(|name| System::Peer { name }))
        .collect();
    opts.scratch = a.scratch;
    opts.spin_budget_us = a.spin_budget_us;
    let stop = stop_on_signals()?;
    let mut progress = Progress::new("bench fileio");
    let report = fileio::run_matrix(&exe()?, &opts, &stop, |p| {
        let line = fileio::progress_line(p);
        // Every point is a part of its own: without a terminal, a line each.
        progress.show(&line, &line);
    })?;
    progress.end();
    let files = fileio::write_outputs(&report, &a.out)?;
    emit(&report, a.json, fileio::Report::render)?;
    for f in files {
        eprintln!("bench fileio: wrote {}", f.display());
    }
    Ok(if report.interrupted { ExitCode::from(130) } else { ExitCode::SUCCESS })
}

/// What `bench guard --filters` runs.
struct GuardFigures {
    settings: Vec<crate::guard_filters::Setting>,
    plot: Option<PathBuf>,
    seconds: u32,
    scratch: PathBuf,
    spin_budget_us: Option<u64>,
}

fn guard_figures(w: GuardFigures, json: bool) -> anyhow::Result<ExitCode> {
    use crate::guard_filters::Setting;
    let settings = if w.settings.is_empty() { Setting::all(true) } else { w.settings };
    let opts =
        crate::guard_filters::Options { seconds: w.seconds, scratch: w.scratch, settings, spin_budget_us: w.spin_budget_us };
    opts.check()?;
    need_root("bench guard --filters uses FUSE exports and userfaultfd on shared memory")?;
    let filters = crate::guard_filters::run(&exe()?, &opts, |p| eprintln!("bench guard: {p}"))?;
    let figures = crate::guard_figures::Figures { filters: Some(filters), isolation: None };
    if let Some(p) = &w.plot {
        std::fs::write(p, crate::guard_figures::svg(&figures)).map_err(|e| BenchError::io(p, e))?;
        eprintln!("bench guard: plot written to {}", p.display());
    }
    emit(&figures, json, crate::guard_figures::render)
}

fn channel(mode: ModeArg, json: bool, seconds: f64, samples: usize, pin: bool) -> anyhow::Result<ExitCode> {
    use bulkhead_channel::NotifyMode;
    let modes = match mode {
        ModeArg::Irq => vec![NotifyMode::Irq],
        ModeArg::Poll => vec![NotifyMode::Poll],
        ModeArg::Adaptive => vec![NotifyMode::Adaptive],
        ModeArg::All => vec![NotifyMode::Irq, NotifyMode::Poll, NotifyMode::Adaptive],
    };
    let opts = crate::channel::Options { modes, seconds, samples, pin };
    let report = crate::channel::run(&exe()?, &opts, |p| eprintln!("bench channel: {p}"))?;
    emit(&report, json, crate::channel::render)
}
