//! `bulkhead-test-driver`: the whole of `bulkhead`, whose domains misbehave on purpose, for
//! the tests and the benchmarks that need faults.
//!
//! Any command but those below runs as `bulkhead`'s, so `bulkhead-test-driver serve` runs
//! its domains from this executable. Two benchmarks exist only here:
//! - `bench storm [--seconds N] [--rounds N] [--json]`: a doorbell storm
//!   ([`bulkhead_bench::storm`]);
//! - `bench guard --isolation [--faults N] [--population LIST] [--settings LIST] [--plot FILE]
//!   [--scratch DIR] [--json]`: the share of injected faults write capture stops
//!   ([`bulkhead_bench::guard_isolation`]).
//!
//! As a domain it takes `driver --spec JSON` as `bulkhead` does and, by `BULKHEAD_TEST_FAULT`:
//! - `crash-on-start`: exits at once, as a driver with a start-up bug would;
//! - `escape`: confines itself, tries to escape and reports how each attempt failed, then stores
//!   into the read-only write arena (which must kill it with SIGSEGV);
//! - `hostile:<behaviour>`: serves honestly for a while, then misbehaves as
//!   [`Hostility`](bulkhead_testkit::hostile::Hostility) names;
//! - `vdev-hostile`: in a `vdev` device's first generation, abuses the card at register level
//!   ([`bulkhead_testkit::hostile_vdev`]), says so, and wedges; later generations run the real
//!   driver runtime;
//! - unset: runs the real driver runtime, like `bulkhead driver`.
//!
//! `BULKHEAD_TEST_GUARD_INJECT=FILTER:TARGET[:EVERY[:SEED]]` makes a guarded filter write
//! where it must not ([`bulkhead_testkit::faults`], [`bulkhead_testkit::inject`]): the
//! shipped driver has no way to. `BULKHEAD_TEST_FAULT_DEVICE` limits it to one device too.
//!
//! `BULKHEAD_TEST_UNAVAILABLE_LAYERS=landlock,seccomp` confines as on a host without those
//! layers.
//!
//! `BULKHEAD_TEST_SEARCH=<masked patterns>` searches the domain's own memory for them while it
//! serves ([`bulkhead_testkit::memsearch`]).
//!
//! `BULKHEAD_TEST_CONNECT=ADDR,ADDR…` connects to each address once the domain is confined
//! and says how each attempt went (an `rbd` domain's connects go through the supervisor).
//!
//! `BULKHEAD_TEST_FAULT_FROM_SPARE=1` limits the fault to domains made from spare domains
//! (`spare`, which waits for a device as `bulkhead spare` does).
//!
//! `BULKHEAD_TEST_FAULT_ROLE=tap|driver` limits the fault to that domain of an `interpose`
//! device; `BULKHEAD_TEST_FAULT_DEVICE=NAME` limits it to that device's domains.
//!
//! A standby domain runs the real runtime whatever the fault: the faults' own paths serve at
//! once, where a standby must wait for its go and touch nothing the running domain uses (a
//! standby below a tap domain shares the lower queues with the driver domain serving them).
//!
//! Built only with the `test-driver` feature: none of this is in the shipped binary.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use clap::Parser;

use bulkhead_shmem::{Mapping, Protection};
use bulkhead_spec::DomainSpec;
use bulkhead_testkit::hostile::Hostility;

/// As `bulkhead`'s: guarded filters allocate from heap spaces of their own.
#[global_allocator]
static HEAP: bulkhead_guard::heap::Heap = bulkhead_guard::heap::Heap::new();

fn fail(msg: String) -> ExitCode {
    eprintln!("bulkhead-test-driver: {msg}");
    ExitCode::from(1)
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let word = |i: usize| args.get(i).map(String::as_str);
    let result = match (word(1), word(2)) {
        (Some("driver"), _) => return domain(&args),
        (Some("spare"), _) => return spare(),
        (Some("bench"), Some("storm")) => storm(&args[2..]),
        (Some("bench"), Some("guard")) if args.iter().any(|a| a == "--isolation") => isolation(&args[2..]),
        _ => return bulkhead_cli::run(),
    };
    result.unwrap_or_else(|e| fail(format!("{e:#}")))
}

/// `bench storm`'s options.
#[derive(Parser)]
#[command(name = "bulkhead-test-driver bench storm")]
struct StormArgs {
    /// Seconds of each phase.
    #[arg(long, default_value_t = 60)]
    seconds: u64,
    /// Rounds, each without and then with the storm.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// JSON output.
    #[arg(long)]
    json: bool,
}

/// A doorbell storm: a hostile driver domain rings the frontend in a tight loop; the
/// frontend's CPU and another device's 4 KiB read latency, alternated with rounds without it.
fn storm(args: &[String]) -> anyhow::Result<ExitCode> {
    let a = StormArgs::parse_from(named("bulkhead-test-driver bench storm", args));
    bulkhead_bench::cli::need_root("bench storm runs serve with its FUSE export")?;
    let opts = bulkhead_bench::storm::Options { seconds: a.seconds, rounds: a.rounds };
    let r = bulkhead_bench::storm::run(&std::env::current_exe()?, &opts, |p| eprintln!("bench storm: {p}"))?;
    bulkhead_bench::cli::emit(&r, a.json, bulkhead_bench::storm::render)
}

/// `bench guard --isolation`'s options.
#[derive(Parser)]
#[command(name = "bulkhead-test-driver bench guard")]
struct IsolationArgs {
    /// Measure the isolation rate: faults injected into real filters, checked in memory.
    #[arg(long, required = true)]
    isolation: bool,
    /// Faults per setting and population, spread over the filters and the targets.
    #[arg(long, default_value_t = 300, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    faults: u32,
    /// Only these fault populations (comma-separated: `targeted`, aimed at the state a filter
    /// could harm most; `seed-like`, corrupted pointers, overruns and wild writes that DWC
    /// stops), not both.
    #[arg(long, value_delimiter = ',', value_parser = bulkhead_bench::guard_isolation::Population::parse)]
    population: Vec<bulkhead_bench::guard_isolation::Population>,
    /// Only these settings (comma-separated: `dwc` or a cache size C, each with `+keys` for
    /// protection keys, a cache size with `+pages` for the page gate), not all.
    #[arg(long, value_delimiter = ',', value_parser = bulkhead_bench::guard_filters::Setting::parse)]
    settings: Vec<bulkhead_bench::guard_filters::Setting>,
    /// Write the figures as an SVG here.
    #[arg(long)]
    plot: Option<PathBuf>,
    /// Where the LUKS volume goes.
    #[arg(long, default_value = "/tmp")]
    scratch: PathBuf,
    /// JSON output.
    #[arg(long)]
    json: bool,
}

/// The share of injected faults, made by the test kit inside real filters, that write
/// capture stops before the state they aim at changes, per setting.
fn isolation(args: &[String]) -> anyhow::Result<ExitCode> {
    use bulkhead_bench::guard_filters::Setting;
    let a = IsolationArgs::parse_from(named("bulkhead-test-driver bench guard", args));
    let settings = if a.settings.is_empty() { Setting::all(true) } else { a.settings };
    let populations =
        if a.population.is_empty() { bulkhead_bench::guard_isolation::Population::ALL.to_vec() } else { a.population };
    let opts = bulkhead_bench::guard_isolation::Options { faults: a.faults, populations, scratch: a.scratch, settings };
    opts.check()?;
    bulkhead_bench::cli::need_root("bench guard --isolation uses userfaultfd on shared memory")?;
    let isolation = bulkhead_bench::guard_isolation::run(&opts, |p| eprintln!("bench guard: {p}"))?;
    let figures = bulkhead_bench::guard_figures::Figures { filters: None, isolation: Some(isolation) };
    if let Some(p) = &a.plot {
        std::fs::write(p, bulkhead_bench::guard_figures::svg(&figures))?;
        eprintln!("bench guard: plot written to {}", p.display());
    }
    bulkhead_bench::cli::emit(&figures, a.json, bulkhead_bench::guard_figures::render)
}

/// `args` (a subcommand and its options) with the subcommand called `name` in messages.
fn named<'a>(name: &'a str, args: &'a [String]) -> impl Iterator<Item = &'a str> {
    std::iter::once(name).chain(args.iter().skip(1).map(String::as_str))
}

/// A domain, as `serve` starts it: `driver DEVICE [tap]`, its spec in the environment.
fn domain(args: &[String]) -> ExitCode {
    if args.get(1).map(String::as_str) != Some("driver") {
        return fail("usage: bulkhead-test-driver driver DEVICE (spec in BULKHEAD_DOMAIN_SPEC)".into());
    }
    let Ok(json) = std::env::var(bulkhead_spec::SPEC_ENV) else {
        return fail(format!("no domain spec: {} is not set", bulkhead_spec::SPEC_ENV));
    };
    serve_spec(&json)
}

/// This domain was made from a spare.
static FROM_SPARE: AtomicBool = AtomicBool::new(false);

/// As `bulkhead spare`: waits for a device, then is its domain as [`domain`] is, faults and all.
fn spare() -> ExitCode {
    // SAFETY: the supervisor started this process with its hand-over line at 3 and nothing
    // else open beyond the standard descriptors.
    match unsafe { bulkhead_driver::spare::wait_for_work() } {
        Ok(Some(json)) => {
            FROM_SPARE.store(true, std::sync::atomic::Ordering::Relaxed);
            serve_spec(&json)
        }
        Ok(None) => ExitCode::SUCCESS,
        Err(e) => fail(e.to_string()),
    }
}

/// A domain's life from its spec on.
fn serve_spec(json: &str) -> ExitCode {
    let spec: DomainSpec = match serde_json::from_str(json) {
        Ok(s) => s,
        Err(e) => return fail(format!("bad spec: {e}")),
    };
    bulkhead_driver::spare::retitle_for(&spec, spec.standby_fd.is_some());
    let stop = Arc::new(AtomicBool::new(false));
    let bell = match bulkhead_driver::stop_on_signals(&stop) {
        Ok(b) => b,
        Err(e) => return fail(format!("signal handler: {e}")),
    };
    if let Ok(search) = std::env::var("BULKHEAD_TEST_SEARCH") {
        if let Err(e) = bulkhead_testkit::memsearch::spawn(&search) {
            return fail(format!("memory search: {e}"));
        }
    }
    let mut fault = std::env::var("BULKHEAD_TEST_FAULT").unwrap_or_default();
    // With `BULKHEAD_TEST_FAULT_ROLE=tap` or `=driver`, only that domain of an `interpose`
    // device misbehaves; the other runs the real runtime.
    if let Ok(role) = std::env::var("BULKHEAD_TEST_FAULT_ROLE") {
        let is_tap = matches!(spec.backend, bulkhead_spec::BackendSpec::Channel { .. });
        if (role == "tap") != is_tap {
            fault.clear();
        }
    }
    if !for_this_device(&spec) || spec.standby_fd.is_some() {
        fault.clear();
    }
    // With `BULKHEAD_TEST_FAULT_FROM_SPARE=1`, only domains made from spares misbehave.
    if std::env::var_os("BULKHEAD_TEST_FAULT_FROM_SPARE").is_some() && !FROM_SPARE.load(std::sync::atomic::Ordering::Relaxed) {
        fault.clear();
    }
    if fault == "vdev-hostile" {
        if bulkhead_testkit::hostile_vdev::generation(&spec) == Some(1) {
            // SAFETY: the supervisor placed exactly the descriptors the spec names, for this
            // process alone.
            return match unsafe { bulkhead_testkit::hostile_vdev::abuse(&spec) } {
                Ok((o, wedged)) => {
                    eprintln!(
                        "hostile vdev: done: {} junk traps, {} bad commands refused, {} stops, {} garbage descriptors, \
                         {} storm writes; wedging",
                        o.junk_traps, o.refused, o.stops, o.garbage, o.storm
                    );
                    wedged.wait(&stop);
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("hostile vdev: FAILED: {e}");
                    bulkhead_testkit::hostile_vdev::wedge(&stop);
                    ExitCode::from(1)
                }
            };
        }
        fault.clear();
    }
    match fault.as_str() {
        "crash-on-start" => {
            eprintln!("bulkhead driver: crashing on start (BULKHEAD_TEST_FAULT)");
            ExitCode::from(70)
        }
        "escape" => escape(&spec, stop),
        f if f.starts_with("hostile:") => {
            let Some(h) = Hostility::parse(&f["hostile:".len()..]) else {
                return fail(format!("unknown hostile mode {f:?}"));
            };
            // SAFETY: the supervisor placed exactly the descriptors the spec names, for this
            // process alone.
            match unsafe { bulkhead_testkit::hostile::serve(&spec, h, &stop) } {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => fail(e.0),
            }
        }
        _ => {
            // The filter `BULKHEAD_TEST_GUARD_INJECT` names, if any, makes its faults.
            let inject = match std::env::var(bulkhead_testkit::inject::INJECT_ENV) {
                Ok(v) if for_this_device(&spec) => match bulkhead_testkit::inject::InjectSpec::parse_env(&v) {
                    Ok(i) => Some(i),
                    Err(e) => return fail(e.0),
                },
                _ => None,
            };
            let built = match inject {
                Some((filter, faults)) => {
                    // The filter must be there, and guarded: the faults are for write capture to stop.
                    match spec.filters.get(filter) {
                        Some(f) if f.guard.wanted() => {}
                        _ => {
                            return fail(format!(
                                "BULKHEAD_TEST_GUARD_INJECT names filter {}, which is not a guarded filter of this domain",
                                filter + 1
                            ))
                        }
                    }
                    let wrap = bulkhead_testkit::faults::wrap_one(filter, faults);
                    // SAFETY: the supervisor placed exactly the descriptors the spec names, for
                    // this process alone, which is all `build_inherited_wrapping` asks.
                    unsafe { bulkhead_driver::build_inherited_wrapping(&spec, stop, &wrap) }
                }
                // SAFETY: as above.
                None => unsafe { bulkhead_driver::build_inherited(&spec, stop) },
            };
            let mut domain = match built {
                Ok(d) => d,
                Err(e) => return fail(e.to_string()),
            };
            if let Err(e) = domain.wake_on_stop(bell) {
                return fail(e.to_string());
            }
            // SAFETY: as above.
            if let Err(e) = unsafe { bulkhead_driver::claim_standby(&mut domain, &spec) } {
                return fail(e.to_string());
            }
            let withhold = std::env::var("BULKHEAD_TEST_UNAVAILABLE_LAYERS").unwrap_or_default();
            let withhold = withhold.split(',').filter(|l| !l.is_empty()).map(String::from).collect();
            if let Err(e) = bulkhead_driver::confine_and_report_withholding(&spec, withhold) {
                return fail(e.to_string());
            }
            match bulkhead_driver::stand_by(&mut domain, &spec) {
                Ok(true) => {}
                Ok(false) => return ExitCode::SUCCESS,
                Err(e) => return fail(e.to_string()),
            }
            if let Ok(addrs) = std::env::var("BULKHEAD_TEST_CONNECT") {
                for a in addrs.split(',').filter_map(|a| a.parse::<std::net::SocketAddr>().ok()) {
                    // A blocking connect: std's timeout form sets O_NONBLOCK with an ioctl, which
                    // no domain may make.
                    match std::net::TcpStream::connect(a) {
                        Ok(_) => eprintln!("TEST CONNECT {a}: connected"),
                        Err(e) => eprintln!("TEST CONNECT {a}: {e}"),
                    }
                }
            }
            match domain.run() {
                Ok(()) => ExitCode::SUCCESS,
                Err(bulkhead_driver::DriverError::BackendLost(why)) => {
                    eprintln!("bulkhead-test-driver: backend lost: {why}");
                    ExitCode::from(bulkhead_supervisor::LOST_EXIT)
                }
                Err(e) => fail(e.to_string()),
            }
        }
    }
}

/// Whether the faults asked for apply to this domain's device (`BULKHEAD_TEST_FAULT_DEVICE`,
/// when set, names the one they apply to).
fn for_this_device(spec: &DomainSpec) -> bool {
    std::env::var("BULKHEAD_TEST_FAULT_DEVICE").map_or(true, |d| d == spec.device)
}

/// Builds the domain as the real driver does, confines it, then attempts escapes.
fn escape(spec: &DomainSpec, stop: Arc<AtomicBool>) -> ExitCode {
    let Some(q) = spec.queues.first() else {
        return fail("the escape probe needs a queue".into());
    };
    let (ring_fd, warena_fd) = (q.fds[0], q.fds[1]);
    // The write arena as the domain maps it: read-only (its descriptor allows nothing else).
    let warena = match Mapping::new(warena_fd, q.arena_bytes as usize, Protection::ReadOnly) {
        Ok(m) => m,
        Err(e) => return fail(format!("write arena: {e}")),
    };
    // SAFETY: the supervisor placed exactly the descriptors the spec names, for this process
    // alone; the mapping above does not use the descriptor after it is made.
    let _domain = match unsafe { bulkhead_driver::build_inherited(spec, stop) } {
        Ok(d) => d,
        Err(e) => return fail(e.to_string()),
    };
    if let Err(e) = bulkhead_driver::confine_and_report(spec) {
        return fail(e.to_string());
    }
    let targets = bulkhead_testkit::probe::Targets {
        outside_pid: std::env::var("BULKHEAD_TEST_OUTSIDE_PID").ok().and_then(|p| p.parse().ok()).unwrap_or(1),
        write_arena: warena.base_ptr(),
        write_arena_len: warena.len(),
        shared_fd: ring_fd,
        write_arena_fd: warena_fd,
    };
    eprintln!("bulkhead escape-probe: {}", bulkhead_testkit::probe::attempt_escapes(&targets));
    // SAFETY: the arena mapping is at least one page; the store is meant to fault.
    unsafe { bulkhead_testkit::probe::write_into_readonly(warena.base_ptr()) };
    eprintln!("bulkhead escape-probe: write into the read-only arena succeeded");
    ExitCode::from(99)
}
