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
use status::Out;

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
        #[command(flatten)]
        out: Json,
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
        /// One JSON object a refresh, a line each, instead of the table.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        run_dir: RunDir,
    },
    /// Insert a filter into, or remove one from, a running device's chain. Requests in flight
    /// are reissued to the new domains; nothing fails.
    Filter {
        #[command(subcommand)]
        op: FilterOp,
        #[command(flatten)]
        run_dir: RunDir,
    },
    /// Add devices to or remove one from a running serve, restart a device's driver domain,
    /// move its filters between domains.
    Device {
        #[command(subcommand)]
        op: DeviceOp,
        #[command(flatten)]
        run_dir: RunDir,
    },
    /// Add a view to or remove one from a running device, show or change a view's QoS.
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
        out: Json,
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
        #[command(flatten)]
        out: Json,
    },
    /// Snapshots of a device's `cow` overlay (qcow2 internal snapshots, which `qemu-img
    /// snapshot -l` lists too): `create` takes one while I/O runs (every acknowledged write is
    /// in it), `revert` makes the device's contents a snapshot's again (the device must be
    /// idle: unmount its file system first), `delete` frees what only it held.
    Snapshot {
        #[command(subcommand)]
        op: SnapshotOp,
        #[command(flatten)]
        run_dir: RunDir,
    },
    /// Summarise a trace written by a `trace` filter: requests, bytes, errors and latency per
    /// operation, requests per queue.
    Trace {
        /// The trace file.
        file: PathBuf,
        #[command(flatten)]
        out: Json,
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
    /// A spare domain, waiting for a device (started by the supervisor; not for direct use).
    #[command(hide = true)]
    Spare {
        /// Room on the command line for the words of the domain it becomes.
        #[arg(hide = true)]
        room: Vec<String>,
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

/// `--json`, for every command that prints a result.
#[derive(clap::Args, Clone, Copy)]
struct Json {
    /// Print the result as JSON (the control API's reply) instead of text.
    #[arg(long)]
    json: bool,
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
        #[command(flatten)]
        print: Json,
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
    /// `bulkhead filter add disk0 'type = "delay"' 'read_us = 200'`.
    Add {
        /// Device name.
        device: String,
        /// Position (0: nearest the frontend; default: nearest the backend).
        #[arg(long)]
        at: Option<usize>,
        /// The table's lines.
        #[arg(required = true)]
        lines: Vec<String>,
        #[command(flatten)]
        out: Json,
    },
    /// Remove the filter at a position (0: nearest the frontend; `bulkhead status` lists them).
    Remove {
        /// Device name.
        device: String,
        /// Position.
        at: usize,
        #[command(flatten)]
        out: Json,
    },
}

#[derive(Subcommand)]
enum SnapshotOp {
    /// Take a snapshot while I/O runs: every acknowledged write is in it.
    Create {
        /// Device name.
        device: String,
        /// The snapshot's name.
        name: String,
        #[command(flatten)]
        out: Json,
    },
    /// List a device's snapshots: id, name, when taken, the space only it holds.
    List {
        /// Device name.
        device: String,
        #[command(flatten)]
        out: Json,
    },
    /// Make the device's contents the snapshot's again (the device must be idle: unmount its
    /// file system first).
    Revert {
        /// Device name.
        device: String,
        /// The snapshot's name.
        name: String,
        #[command(flatten)]
        out: Json,
    },
    /// Delete a snapshot, freeing what only it held.
    Delete {
        /// Device name.
        device: String,
        /// The snapshot's name.
        name: String,
        #[command(flatten)]
        out: Json,
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
        #[command(flatten)]
        out: Json,
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
        #[command(flatten)]
        out: Json,
    },
    /// Restart a device's driver domain now (also one that turned `failed`).
    Restart {
        /// Device name.
        device: String,
        #[command(flatten)]
        out: Json,
    },
    /// Make an inactive device write (`active = false` in its table): the destination's half
    /// of a live migration's hand-over, run once the source is deactivated (docs/vm.md, "Live
    /// migration"). Its domains are replaced by ones on storage opened to write; an rbd
    /// image's lock is taken at its first write. Nothing is done if it writes already.
    Activate {
        /// Device name.
        device: String,
        /// What the source printed as its geometry (`size=BYTES,block=BYTES,read_only=BOOL`):
        /// a device that differs stays inactive, and the error names the difference.
        #[arg(long, value_parser = parse_geometry)]
        expect: Option<bulkhead_control::Geometry>,
        #[command(flatten)]
        out: Json,
    },
    /// Make a device stop writing: the source's half of a live migration's hand-over, run
    /// once its guest is stopped. Waits for its requests in flight (refused if some are left
    /// after 5 s), flushes it, and replaces its domains by ones on storage opened read-only
    /// (an rbd image's lock is released as the old domain closes it); writes are refused from
    /// then on. Prints the geometry for `device activate --expect` at the other end.
    Deactivate {
        /// Device name.
        device: String,
        #[command(flatten)]
        out: Json,
    },
    /// Move a running device's filters: `passthrough` (in its driver domain), `interpose` (in
    /// a tap domain of their own) or `intercept` (in a tap domain that ends in the soft
    /// device, no driver domain). Requests in flight are reissued to the new domains; nothing
    /// fails.
    Tap {
        /// Device name.
        device: String,
        #[arg(value_enum)]
        mode: TapArg,
        #[command(flatten)]
        out: Json,
    },
}

/// `size=BYTES,block=BYTES,read_only=BOOL`, as `device deactivate` prints it.
fn parse_geometry(s: &str) -> Result<bulkhead_control::Geometry, String> {
    let (mut size, mut block, mut ro) = (None, None, None);
    for part in s.split(',') {
        let (k, v) = part.split_once('=').ok_or_else(|| format!("`{part}` is not KEY=VALUE"))?;
        let bad = |e: &dyn std::fmt::Display| format!("`{k}`: {e}");
        match k.trim() {
            "size" => size = Some(v.trim().parse::<u64>().map_err(|e| bad(&e))?),
            "block" => block = Some(v.trim().parse::<u32>().map_err(|e| bad(&e))?),
            "read_only" => ro = Some(v.trim().parse::<bool>().map_err(|e| bad(&e))?),
            other => return Err(format!("unknown key `{other}` (size, block, read_only)")),
        }
    }
    match (size, block, ro) {
        (Some(size_bytes), Some(block_size), Some(read_only)) => {
            Ok(bulkhead_control::Geometry { size_bytes, block_size, read_only })
        }
        _ => Err("give size, block and read_only, as `device deactivate` prints them".into()),
    }
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
        #[command(flatten)]
        out: Json,
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
        #[command(flatten)]
        out: Json,
    },
    /// Show or change the QoS of a running view (`[[device.view]]`): `KEY=VALUE` settings of
    /// credit_bytes, credit_us, burst_bytes, iops, burst_ios, weight over its current caps
    /// (`0` or `none` lifts a cap). The domain takes them at once, without a restart.
    Qos {
        /// View name.
        view: String,
        /// KEY=VALUE settings; none shows the caps in force.
        settings: Vec<String>,
        #[command(flatten)]
        out: Json,
    },
}

#[derive(Subcommand)]
enum ConfigOp {
    /// Print the running configuration as TOML that `serve --config` accepts: the file it
    /// started with, and every device added, removed or changed since.
    Dump {
        #[command(flatten)]
        out: Json,
    },
    /// Check a configuration file without starting anything: the errors `serve` would give
    /// (naming the key and the line), or a summary of what it would serve. Needs no `serve`.
    Check {
        /// The file.
        file: PathBuf,
        #[command(flatten)]
        out: Json,
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
    let out = |j: Json| if j.json { Out::Json } else { Out::Text };
    match cmd {
        Cmd::Serve { config, run_dir } => serve::run(config.as_deref(), run_dir),
        Cmd::Status { out: o, run_dir } => status::run(run_dir.find(), out(o)),
        Cmd::Top { interval, count, json, run_dir } => match std::time::Duration::try_from_secs_f64(interval) {
            Ok(d) if d >= std::time::Duration::from_millis(100) => status::top(&run_dir.find()?, d, count, json),
            _ => Err(anyhow::anyhow!("--interval {interval}: give at least 0.1 seconds")),
        },
        Cmd::Driver { spec, .. } => driver_cmd::run(&spec),
        Cmd::Spare { .. } => driver_cmd::spare(),
        Cmd::Trace { file, out: o } => trace_cmd::run(&file, o.json),
        Cmd::Sim(args) => sim_cmd::run(args),
        Cmd::Vdev { which: VdevCmd::Generate { seed, out: dir, print } } => vdev_cmd::generate(seed, &dir, out(print)),
        Cmd::Vdev { which: VdevCmd::Model { spec, .. } } => vdev_cmd::model(&spec),
        Cmd::Snapshot { op, run_dir } => {
            let (device, action, name, o) = match op {
                SnapshotOp::Create { device, name, out } => (device, Some(SnapshotAction::Create), Some(name), out),
                SnapshotOp::List { device, out } => (device, None, None, out),
                SnapshotOp::Revert { device, name, out } => (device, Some(SnapshotAction::Revert), Some(name), out),
                SnapshotOp::Delete { device, name, out } => (device, Some(SnapshotAction::Delete), Some(name), out),
            };
            status::snapshot(&run_dir.find()?, &device, action, name.as_deref(), out(o))
        }
        Cmd::Filter { op: FilterOp::Add { device, at, lines, out: o }, run_dir } => {
            status::change(&run_dir.find()?, &device, AddFilter { device: device.clone(), at, table: lines.join("\n") }, out(o))
        }
        Cmd::Filter { op: FilterOp::Remove { device, at, out: o }, run_dir } => {
            status::change(&run_dir.find()?, &device, RemoveFilter { device: device.clone(), at }, out(o))
        }
        Cmd::Device { op: DeviceOp::Add { file, out: o }, run_dir } => status::add_devices(&run_dir.find()?, &file, out(o)),
        Cmd::Device { op: DeviceOp::Remove { name, force, out: o }, run_dir } => {
            status::remove_device(&run_dir.find()?, &name, force, out(o))
        }
        Cmd::Device { op: DeviceOp::Restart { device, out: o }, run_dir } => status::restart(&run_dir.find()?, &device, out(o)),
        Cmd::Device { op: DeviceOp::Activate { device, expect, out: o }, run_dir } => {
            status::activity(&run_dir.find()?, bulkhead_control::Activate { device, expect }, out(o))
        }
        Cmd::Device { op: DeviceOp::Deactivate { device, out: o }, run_dir } => {
            status::activity(&run_dir.find()?, bulkhead_control::Deactivate { device }, out(o))
        }
        Cmd::Device { op: DeviceOp::Tap { device, mode, out: o }, run_dir } => {
            status::change(&run_dir.find()?, &device, SetTap { device: device.clone(), mode: mode.into() }, out(o))
        }
        Cmd::View { op: ViewOp::Add { device, lines, out: o }, run_dir } => {
            status::add_view(&run_dir.find()?, &device, &lines, out(o))
        }
        Cmd::View { op: ViewOp::Remove { name, force, out: o }, run_dir } => {
            status::remove_view(&run_dir.find()?, &name, force, out(o))
        }
        Cmd::View { op: ViewOp::Qos { view, settings, out: o }, run_dir } => {
            status::qos(&run_dir.find()?, &view, &settings, out(o))
        }
        Cmd::Config { op: ConfigOp::Dump { out: o }, run_dir } => status::dump_config(&run_dir.find()?, out(o)),
        Cmd::Config { op: ConfigOp::Check { file, out: o }, .. } => serve::check_config(&file, out(o)),
        Cmd::Reload { out: o, run_dir } => status::reload(&run_dir.find()?, out(o)),
        Cmd::Upgrade { run_dir, timeout, out: o } => {
            status::upgrade(&run_dir.find()?, std::time::Duration::from_secs(timeout), out(o))
        }
        Cmd::Bench { args } => bench::hand_over(&args),
        Cmd::Man { out } => man_pages(&out),
        Cmd::Completions { shell } => {
            clap_complete::generate(shell, &mut Cli::command(), "bulkhead", &mut std::io::stdout());
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// The forms of the command line before it read noun, verb, operands, kept for one release:
/// `restart DEVICE`, `tap DEVICE MODE`, `qos VIEW …`, `filter DEVICE add|remove …` and
/// `snapshot DEVICE create|list|revert|delete …`. Returns the arguments in today's form and,
/// for an old one, the note to print.
fn old_forms(mut args: Vec<std::ffi::OsString>) -> (Vec<std::ffi::OsString>, Option<String>) {
    let word = |args: &[std::ffi::OsString], i: usize| args.get(i).and_then(|a| a.to_str()).unwrap_or("").to_string();
    let (cmd, second, third) = (word(&args, 1), word(&args, 2), word(&args, 3));
    let operand = !second.is_empty() && !second.starts_with('-');
    let verbs = |cmd: &str| match cmd {
        "filter" => &["add", "remove"][..],
        _ => &["create", "list", "revert", "delete"][..],
    };
    let (old, new) = match cmd.as_str() {
        "restart" | "tap" => {
            args.insert(1, "device".into());
            (format!("{cmd} DEVICE"), format!("device {cmd} DEVICE"))
        }
        "qos" => {
            args.insert(1, "view".into());
            ("qos VIEW".into(), "view qos VIEW".into())
        }
        "filter" | "snapshot" if operand && verbs(&cmd).contains(&third.as_str()) => {
            args.swap(2, 3);
            (format!("{cmd} DEVICE {third}"), format!("{cmd} {third} DEVICE"))
        }
        _ => return (args, None),
    };
    (args, Some(format!("bulkhead: `bulkhead {old}` is the old form, kept for this release: use `bulkhead {new}`")))
}

/// Runs the command line `std::env::args` gives.
pub fn run() -> ExitCode {
    let (args, note) = old_forms(std::env::args_os().collect());
    if let Some(note) = note {
        eprintln!("{note}");
    }
    let cli = Cli::parse_from(args);
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Every command that prints a result takes `--json`, and every command is noun, verb,
    /// operands: a command with subcommands takes no operand of its own before them.
    #[test]
    fn every_command_that_prints_takes_json_and_reads_noun_verb_operands() {
        // Those that print no result of their own: they run, write files, or hand over.
        let exempt = ["serve", "man", "completions", "bench", "help"];
        let mut top = Cli::command();
        top.build();
        fn leaves(cmd: &clap::Command, path: String, out: &mut Vec<(String, clap::Command)>) {
            if cmd.has_subcommands() {
                let operands: Vec<_> = cmd.get_positionals().map(|a| a.get_id().to_string()).collect();
                assert!(operands.is_empty(), "`{path}` takes {operands:?} before its verb");
                for sub in cmd.get_subcommands().filter(|c| !c.is_hide_set() && c.get_name() != "help") {
                    leaves(sub, format!("{path} {}", sub.get_name()), out);
                }
            } else {
                out.push((path, cmd.clone()));
            }
        }
        let mut all = Vec::new();
        for sub in top.get_subcommands().filter(|c| !c.is_hide_set() && !exempt.contains(&c.get_name())) {
            leaves(sub, sub.get_name().to_string(), &mut all);
        }
        let without: Vec<_> =
            all.iter().filter(|(_, c)| !c.get_arguments().any(|a| a.get_long() == Some("json"))).map(|(p, _)| p).collect();
        assert!(without.is_empty(), "commands without --json: {without:?}");
        assert!(all.len() >= 20, "{all:?}");
    }

    #[test]
    fn the_old_forms_become_todays_with_a_note() {
        let args = |s: &str| s.split(' ').map(std::ffi::OsString::from).collect::<Vec<_>>();
        for (old, new) in [
            ("bulkhead restart d0", "bulkhead device restart d0"),
            ("bulkhead tap d0 interpose", "bulkhead device tap d0 interpose"),
            ("bulkhead qos v iops=5", "bulkhead view qos v iops=5"),
            ("bulkhead filter d0 add --at 0 type=x", "bulkhead filter add d0 --at 0 type=x"),
            ("bulkhead filter d0 remove 1", "bulkhead filter remove d0 1"),
            ("bulkhead snapshot d0 create s", "bulkhead snapshot create d0 s"),
            ("bulkhead snapshot d0 list --json", "bulkhead snapshot list d0 --json"),
        ] {
            let (got, note) = old_forms(args(old));
            assert_eq!(got, args(new), "{old}");
            let note = note.unwrap_or_default();
            assert!(note.contains("old form") && note.contains(new.split(' ').nth(1).unwrap()), "{note}");
            Cli::try_parse_from(got).unwrap_or_else(|e| panic!("{new}: {e}"));
        }
        for today in ["bulkhead filter add d0 type=x", "bulkhead snapshot list d0", "bulkhead status", "bulkhead device add -"] {
            let (got, note) = old_forms(args(today));
            assert!(note.is_none() && got == args(today), "{today}");
        }
    }
}
