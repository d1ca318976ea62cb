//! `bulkhead driver`: the driver-domain process.

use std::process::ExitCode;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use anyhow::Context;
use bulkhead_driver::spec::DomainSpec;

fn harden() {
    // SAFETY: plain prctl/setrlimit calls with valid arguments.
    unsafe {
        libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0);
        let none = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        libc::setrlimit(libc::RLIMIT_CORE, &none);
    }
}

/// Test hook: `BULKHEAD_TEST_FAULT=crash-on-start` makes every domain exit at once, as a driver
/// with a start-up bug would. Tests use it to drive the supervisor's crash-loop handling.
fn test_fault() -> Option<ExitCode> {
    match std::env::var("BULKHEAD_TEST_FAULT").ok()?.as_str() {
        "crash-on-start" => {
            eprintln!("bulkhead driver: crashing on start (BULKHEAD_TEST_FAULT)");
            Some(ExitCode::from(70))
        }
        _ => None,
    }
}

pub fn run(spec_json: &str) -> anyhow::Result<ExitCode> {
    let spec: DomainSpec = serde_json::from_str(spec_json).context("bad domain spec")?;
    harden();
    if let Some(code) = test_fault() {
        return Ok(code);
    }
    let stop = Arc::new(AtomicBool::new(false));
    signal_hook::flag::register(signal_hook::consts::SIGTERM, stop.clone())?;
    signal_hook::flag::register(signal_hook::consts::SIGINT, stop.clone())?;
    // SAFETY: the supervisor placed exactly the descriptors the spec names, for this process
    // alone, and nothing else here uses them.
    let mut domain = unsafe { spec.build_inherited(stop) }.with_context(|| format!("device {}", spec.device))?;
    domain.run().with_context(|| format!("device {}", spec.device))?;
    Ok(ExitCode::SUCCESS)
}
