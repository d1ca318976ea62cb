//! `bulkhead`: serve block devices from isolated driver domains. The command line, as a
//! library so that a build of the test kit's driver can be the whole of `bulkhead` too.
//!
//! It parses arguments and prints; what it runs lives in the library crates. The only unsafe
//! code is the domains' own entry (`driver`, `vdev model`), which takes over the descriptors
//! the supervisor handed them by number.
#![deny(unsafe_code)]

mod api;
mod bench;
mod driver_cmd;
mod exports;
mod keeper;
mod kept;
mod live;
mod logging;
mod metrics;
mod notify;
mod run_dir;
mod serve;
mod sim_cmd;
mod status;
mod trace_cmd;
mod upgrade;
mod vdev_cmd;

use std::path::PathBuf;
use std::process::ExitCode;

use bulkhead_control::{AddFilter, RemoveFilter, SetTap, SnapshotAction};

use clap::{CommandFactory, Parser, Subcommand, ValueEnum};

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
        /// Directory for the exports, sockets and lock (default: $BULKHEAD_RUN_DIR, else the
        /// configuration's `run_dir`, else ./bulkhead-run).
        #[arg(long, env = "BULKHEAD_RUN_DIR", value_name = "DIR")]
        run_dir: Option<PathBuf>,
    },
    /// Print each device's state, driver pid, mode, requests, restarts, outages and memory.
    /// Exits 0 when every device runs, 1 when one is degraded (its remote being reconnected),
    /// 2 when one has failed, 3 when no serve answers: a health check.
    Status {
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        run_dir: RunDir,
    },
    /// A dashboard of every device and view: IOPS, MiB/s read and written, p99 latency and
    /// restarts over the last interval, refreshed every second.
    Top {
        /// Seconds between refreshes.
        #[arg(long, default_value_t = 1.0)]
        interval: f64,
        /// Stop after this many refreshes (default: until interrupted).
        #[arg(long)]
        count: Option<u64>,
        #[command(flatten)]
        run_dir: RunDir,
    },
    /// Restart a device's driver domain now (also one that turned `failed`).
    Restart {
        /// Device name.
        device: String,
        #[command(flatten)]
        run_dir: RunDir,
    },
    /// Move a running device's filters: `passthrough` (in its driver domain), `interpose` (in
    /// a tap domain of their own) or `intercept` (in a tap domain that ends in the soft device,
    /// no driver domain). Requests in flight are reissued to the new domains; nothing fails.
    Tap {
        /// Device name.
        device: String,
        /// passthrough | interpose | intercept.
        #[arg(value_enum)]
        mode: TapArg,
        #[command(flatten)]
        run_dir: RunDir,
    },
    /// Insert a filter into, or remove one from, a running device's chain. Requests in flight
    /// are reissued to the new domains; nothing fails.
    Filter {
        /// Device name.
        device: String,
        #[command(subcommand)]
        op: FilterOp,
        #[command(flatten)]
        run_dir: RunDir,
    },
    /// Shows or changes the QoS of a running view (`[[device.view]]`): `KEY=VALUE` settings of
    /// credit_bytes, credit_us, burst_bytes, iops, burst_ios, weight over its current caps
    /// (`0` or `none` lifts a cap). The domain takes them at once, without a restart.
    Qos {
        /// View name.
        view: String,
        /// KEY=VALUE settings; none shows the caps in force.
        settings: Vec<String>,
        #[command(flatten)]
        run_dir: RunDir,
    },
    /// Add devices to, or remove one from, a running serve.
    Device {
        #[command(subcommand)]
        op: DeviceOp,
        #[command(flatten)]
        run_dir: RunDir,
    },
    /// Add a view to, or remove one from, a running device.
    View {
        #[command(subcommand)]
        op: ViewOp,
        #[command(flatten)]
        run_dir: RunDir,
    },
    /// The running configuration, or a file's check.
    Config {
        #[command(subcommand)]
        op: ConfigOp,
        #[command(flatten)]
        run_dir: RunDir,
    },
    /// Make a running serve apply its configuration file as edited (as SIGHUP does): new
    /// devices start, removed ones go (refused while in use), tap modes, filters that do not
    /// transform the data and views' QoS change in place. Anything else is refused, naming
    /// it, and nothing is applied.
    Reload {
        #[command(flatten)]
        run_dir: RunDir,
    },
    /// Hands a running `serve` over to the binary now on disk: the keeper holds the FUSE
    /// session, the listening sockets and the ramdisks while the old `serve` ends and the new
    /// one starts; FUSE users see a pause, NBD clients reconnect. Needs `[keeper] enabled`
    /// (or systemd's descriptor store). Waits until the new `serve` answers.
    Upgrade {
        #[command(flatten)]
        run_dir: RunDir,
        /// Seconds to wait for the new `serve` to answer.
        #[arg(long, default_value_t = 60)]
        timeout: u64,
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
        #[command(flatten)]
        run_dir: RunDir,
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
    /// Virtual devices: generated storage controller cards with trapped register pages.
    Vdev {
        #[command(subcommand)]
        which: VdevCmd,
    },
    /// Benchmarks, against bulkhead's peers: runs `bulkhead-bench` (its own package) with
    /// the arguments given, as `bulkhead-bench BENCHMARK …` would.
    #[command(disable_help_flag = true)]
    Bench {
        /// The benchmark and its arguments (`bulkhead-bench --help` lists them).
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<std::ffi::OsString>,
    },
    /// Write the manual pages, generated from these definitions: `bulkhead.1` and one
    /// `bulkhead-COMMAND.1` per command.
    Man {
        /// Directory to write them to (created if missing).
        #[arg(long)]
        out: PathBuf,
    },
    /// Print a completion script for a shell: `bulkhead completions bash >
    /// /usr/share/bash-completion/completions/bulkhead`.
    Completions {
        /// bash | zsh | fish | elvish | powershell.
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// The driver-domain role (exec'd by the supervisor; not for direct use).
    #[command(hide = true)]
    Driver {
        /// The device and, for a tap domain, `tap`: what `ps` shows (the spec says the rest).
        what: Vec<String>,
        /// Domain description (JSON); the supervisor gives it in the environment.
        #[arg(long, env = "BULKHEAD_DOMAIN_SPEC", hide_env_values = true)]
        spec: String,
    },
}

/// `--run-dir`, for every command that talks to a running `serve`.
#[derive(clap::Args)]
struct RunDir {
    /// The run directory of the `serve` to ask (default: $BULKHEAD_RUN_DIR, else ./bulkhead-run
    /// or the packaged one, /run/bulkhead, whichever a serve listens in).
    #[arg(long = "run-dir", env = "BULKHEAD_RUN_DIR", value_name = "DIR", global = true)]
    dir: Option<PathBuf>,
}

impl RunDir {
    /// The directory, found as [`run_dir::find`] says.
    fn find(self) -> anyhow::Result<PathBuf> {
        run_dir::find(self.dir)
    }
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
        /// The device: what `ps` shows.
        device: Option<String>,
        /// Domain description (JSON); the supervisor gives it in the environment.
        #[arg(long, env = "BULKHEAD_DOMAIN_SPEC", hide_env_values = true)]
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

#[derive(Subcommand)]
enum DeviceOp {
    /// Start the devices of a file of `[[device]]` tables (`-`: standard input), in the
    /// configuration file's syntax, and export them on FUSE, NBD and vhost-user where those
    /// are on. Errors name the key and the line.
    Add {
        /// The file, or `-`.
        file: PathBuf,
    },
    /// Unexport a device and its views, drain and flush it, and end its domains. Refused
    /// while it is in use (its FUSE file open, an NBD client or a VM connected, an application
    /// attached) unless --force, which cuts the users off (their requests fail).
    Remove {
        /// Device name.
        name: String,
        /// Remove it even while it is in use.
        #[arg(long)]
        force: bool,
    },
}

#[derive(Subcommand)]
enum ViewOp {
    /// Add a view to a running device, given as the lines of its `[[device.view]]` table
    /// (`-`: read them from standard input): `bulkhead view add disk0 'name = "t1"' 'size =
    /// "1G"'`. It is exported where the device's views are. The device's domains are replaced
    /// by a generation that serves it too: its users see a pause, as in a restart, and no
    /// error. Errors name the key and the line.
    Add {
        /// Device name.
        device: String,
        /// The table's lines, or `-`.
        #[arg(required = true)]
        lines: Vec<String>,
    },
    /// Unexport a view, drain and flush it, and take it out of its device (whose users see a
    /// pause). Refused while it is in use (its FUSE file open, an NBD client or a VM
    /// connected, an application attached) unless --force, which cuts the users off.
    Remove {
        /// View name.
        name: String,
        /// Remove it even while it is in use.
        #[arg(long)]
        force: bool,
    },
}

#[derive(Subcommand)]
enum ConfigOp {
    /// Print the running configuration as TOML that `serve --config` accepts: the file it
    /// started with, and every device added, removed or changed since.
    Dump,
    /// Check a configuration file without starting anything: the errors `serve` would give
    /// (naming the key and the line), or a summary of what it would serve. Needs no `serve`.
    Check {
        /// The file.
        file: PathBuf,
    },
}

#[derive(Clone, Copy, ValueEnum)]
enum TapArg {
    Passthrough,
    Interpose,
    Intercept,
}

impl From<TapArg> for bulkhead_config::Tap {
    fn from(t: TapArg) -> Self {
        match t {
            TapArg::Passthrough => bulkhead_config::Tap::Passthrough,
            TapArg::Interpose => bulkhead_config::Tap::Interpose,
            TapArg::Intercept => bulkhead_config::Tap::Intercept,
        }
    }
}

#[derive(Clone, Copy, ValueEnum)]
enum SnapshotOpArg {
    Create,
    List,
    Revert,
    Delete,
}

/// Writes `bulkhead.1` and a page for each command that is not hidden, nested ones included
/// (`bulkhead-device-add.1`).
fn man_pages(out: &std::path::Path) -> anyhow::Result<ExitCode> {
    use anyhow::Context;
    std::fs::create_dir_all(out).with_context(|| format!("cannot create {}", out.display()))?;
    let mut top = Cli::command();
    // Built, so that each subcommand carries its full name and the global options it takes.
    top.build();
    fn write_tree(out: &std::path::Path, name: &str, cmd: &clap::Command) -> anyhow::Result<()> {
        // `bench` hands over to `bulkhead-bench`, whose own package has its pages.
        for sub in cmd.get_subcommands().filter(|c| !c.is_hide_set() && c.get_name() != "bench" && c.get_name() != "help") {
            write_tree(out, &format!("{name}-{}", sub.get_name()), sub)?;
        }
        let path = out.join(format!("{name}.1"));
        let mut page = Vec::new();
        clap_mangen::Man::new(cmd.clone().name(name.to_string())).render(&mut page)?;
        std::fs::write(&path, page).with_context(|| format!("cannot write {}", path.display()))
    }
    write_tree(out, "bulkhead", &top)?;
    Ok(ExitCode::SUCCESS)
}

/// Runs one command.
fn dispatch(cmd: Cmd) -> anyhow::Result<ExitCode> {
    match cmd {
        Cmd::Serve { config, run_dir } => serve::run(config.as_deref(), run_dir),
        Cmd::Status { json, run_dir } => status::run(run_dir.find(), json),
        Cmd::Restart { device, run_dir } => status::restart(&run_dir.find()?, &device),
        Cmd::Top { interval, count, run_dir } => match std::time::Duration::try_from_secs_f64(interval) {
            Ok(d) if d >= std::time::Duration::from_millis(100) => status::top(&run_dir.find()?, d, count),
            _ => Err(anyhow::anyhow!("--interval {interval}: give at least 0.1 seconds")),
        },
        Cmd::Driver { spec, .. } => driver_cmd::run(&spec),
        Cmd::Trace { file, json } => trace_cmd::run(&file, json),
        Cmd::Sim(args) => sim_cmd::run(args),
        Cmd::Vdev { which: VdevCmd::Generate { seed, out } } => vdev_cmd::generate(seed, &out),
        Cmd::Vdev { which: VdevCmd::Model { spec, .. } } => vdev_cmd::model(&spec),
        Cmd::Snapshot { device, op, name, json, run_dir } => {
            let op = match op {
                SnapshotOpArg::Create => Some(SnapshotAction::Create),
                SnapshotOpArg::List => None,
                SnapshotOpArg::Revert => Some(SnapshotAction::Revert),
                SnapshotOpArg::Delete => Some(SnapshotAction::Delete),
            };
            status::snapshot(&run_dir.find()?, &device, op, name.as_deref(), json)
        }
        Cmd::Qos { view, settings, run_dir } => status::qos(&run_dir.find()?, &view, &settings),
        Cmd::Tap { device, mode, run_dir } => {
            status::change(&run_dir.find()?, &device, SetTap { device: device.clone(), mode: mode.into() })
        }
        Cmd::Filter { device, op: FilterOp::Add { at, lines }, run_dir } => {
            status::change(&run_dir.find()?, &device, AddFilter { device: device.clone(), at, table: lines.join("\n") })
        }
        Cmd::Filter { device, op: FilterOp::Remove { at }, run_dir } => {
            status::change(&run_dir.find()?, &device, RemoveFilter { device: device.clone(), at })
        }
        Cmd::Device { op: DeviceOp::Add { file }, run_dir } => status::add_devices(&run_dir.find()?, &file),
        Cmd::Device { op: DeviceOp::Remove { name, force }, run_dir } => status::remove_device(&run_dir.find()?, &name, force),
        Cmd::View { op: ViewOp::Add { device, lines }, run_dir } => status::add_view(&run_dir.find()?, &device, &lines),
        Cmd::View { op: ViewOp::Remove { name, force }, run_dir } => status::remove_view(&run_dir.find()?, &name, force),
        Cmd::Config { op: ConfigOp::Dump, run_dir } => status::dump_config(&run_dir.find()?),
        Cmd::Config { op: ConfigOp::Check { file }, .. } => serve::check_config(&file),
        Cmd::Reload { run_dir } => status::reload(&run_dir.find()?),
        Cmd::Upgrade { run_dir, timeout } => status::upgrade(&run_dir.find()?, std::time::Duration::from_secs(timeout)),
        Cmd::Bench { args } => bench::hand_over(&args),
        Cmd::Man { out } => man_pages(&out),
        Cmd::Completions { shell } => {
            clap_complete::generate(shell, &mut Cli::command(), "bulkhead", &mut std::io::stdout());
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// Runs the command line `std::env::args` gives.
pub fn run() -> ExitCode {
    let cli = Cli::parse();
    logging::install();
    let result = dispatch(cli.cmd);
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("bulkhead: {e:#}");
            ExitCode::from(1)
        }
    }
}
