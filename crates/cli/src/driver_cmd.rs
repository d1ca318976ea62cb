//! `bulkhead driver`: the driver-domain process.

use std::io::Write;
use std::os::fd::FromRawFd;
use std::process::ExitCode;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use anyhow::Context;
use bulkhead_driver::spec::DomainSpec;
use bulkhead_sandbox::confine::{confine, Options};
use bulkhead_sandbox::Report;

/// Test hooks, read from `BULKHEAD_TEST_FAULT` (inherited from `serve`):
/// - `crash-on-start`: exit at once, as a driver with a start-up bug would;
/// - `escape`: once confined, try to escape and report how each attempt failed, then store into
///   the read-only write arena (which must kill the domain with SIGSEGV);
/// - `hostile:<behaviour>`: serve honestly for a while, then misbehave as
///   [`Hostility`](bulkhead_driver::hostile::Hostility) names (corrupt indexes, bad ids, …).
fn test_fault() -> Option<String> {
    std::env::var("BULKHEAD_TEST_FAULT").ok()
}

/// Exit status of a domain whose backend lost its remote server (EX_TEMPFAIL): the supervisor
/// reconnects and starts the next generation, which gets the unanswered requests again.
pub const LOST_EXIT: u8 = bulkhead_supervisor::LOST_EXIT;

/// Address space allowed beyond what a domain has mapped at confinement: the allocator's needs.
const HEADROOM: u64 = 256 << 20;

pub fn run(spec_json: &str) -> anyhow::Result<ExitCode> {
    let spec: DomainSpec = serde_json::from_str(spec_json).context("bad domain spec")?;
    let fault = test_fault();
    if fault.as_deref() == Some("crash-on-start") {
        eprintln!("bulkhead driver: crashing on start (BULKHEAD_TEST_FAULT)");
        return Ok(ExitCode::from(70));
    }
    let stop = Arc::new(AtomicBool::new(false));
    signal_hook::flag::register(signal_hook::consts::SIGTERM, stop.clone())?;
    signal_hook::flag::register(signal_hook::consts::SIGINT, stop.clone())?;
    // SAFETY: the supervisor placed exactly the descriptors the spec names, for this process
    // alone, and nothing else here uses them.
    let mut domain = unsafe { spec.build_inherited(stop) }.with_context(|| format!("device {}", spec.device))?;
    let opts = Options {
        policy: spec.sandbox.policy,
        role: spec.seccomp_role(),
        namespaces: bulkhead_sandbox::spawn::namespaces_layer(spec.sandbox.policy),
        address_space_headroom: HEADROOM,
    };
    let confined = confine(&opts);
    if let Some(fd) = spec.report_fd {
        // SAFETY: the report pipe named in the spec is ours alone; File closes it.
        let mut f = unsafe { std::fs::File::from_raw_fd(fd) };
        let report = match &confined {
            Ok(layers) => Report::Confined(layers.clone()),
            Err(e) => Report::Refused { refused: e.to_string() },
        };
        let _ = writeln!(f, "{}", serde_json::to_string(&report)?);
    }
    confined.with_context(|| format!("device {}: sandbox", spec.device))?;
    if fault.as_deref() == Some("escape") {
        let q = domain.queue(0).context("escape probe needs a queue")?;
        let w = q.write_arena_mapping();
        let targets = bulkhead_sandbox::probe::Targets {
            outside_pid: std::env::var("BULKHEAD_TEST_OUTSIDE_PID").ok().and_then(|p| p.parse().ok()).unwrap_or(1),
            write_arena: w.base_ptr(),
            write_arena_len: w.len(),
            shared_fd: spec.queues[0].fds[0],
            write_arena_fd: spec.queues[0].fds[1],
        };
        eprintln!("bulkhead escape-probe: {}", bulkhead_sandbox::probe::attempt_escapes(&targets));
        // SAFETY: the arena mapping is at least one page; the store is meant to fault.
        unsafe { bulkhead_sandbox::probe::write_into_readonly(w.base_ptr()) };
        eprintln!("bulkhead escape-probe: write into the read-only arena succeeded");
        return Ok(ExitCode::from(99));
    }
    if let Some(name) = fault.as_deref().and_then(|f| f.strip_prefix("hostile:")) {
        let h =
            bulkhead_driver::hostile::Hostility::parse(name).with_context(|| format!("unknown hostile test mode {name:?}"))?;
        domain.set_hostility(h);
    }
    match domain.run() {
        Ok(()) => Ok(ExitCode::SUCCESS),
        Err(bulkhead_driver::DriverError::BackendLost(why)) => {
            eprintln!("bulkhead driver: device {}: backend lost: {why}", spec.device);
            Ok(ExitCode::from(LOST_EXIT))
        }
        Err(e) => Err(e).with_context(|| format!("device {}", spec.device)),
    }
}
