//! `bulkhead driver`: the driver-domain process.

use std::process::ExitCode;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use anyhow::Context;
use bulkhead_spec::DomainSpec;

/// Exit status of a domain whose backend lost its remote server (EX_TEMPFAIL): the supervisor
/// reconnects and starts the next generation, which gets the unanswered requests again.
pub const LOST_EXIT: u8 = bulkhead_supervisor::LOST_EXIT;

#[allow(unsafe_code)] // claims the descriptors inherited at exec
pub fn run(spec_json: &str) -> anyhow::Result<ExitCode> {
    let spec: DomainSpec = serde_json::from_str(spec_json).context("bad domain spec")?;
    // A former spare shows in `ps` what it now is.
    bulkhead_driver::spare::retitle_for(&spec, spec.standby_fd.is_some());
    let stop = Arc::new(AtomicBool::new(false));
    let bell = bulkhead_driver::stop_on_signals(&stop)?;
    // SAFETY: the supervisor placed exactly the descriptors the spec names, for this process
    // alone, and nothing else here uses them.
    let built = unsafe { bulkhead_driver::build_inherited(&spec, stop) };
    let mut domain = built.with_context(|| format!("device {}", spec.device))?;
    domain.wake_on_stop(bell)?;
    // SAFETY: as above: the go doorbell the spec names is this process's alone.
    unsafe { bulkhead_driver::claim_standby(&mut domain, &spec) }?;
    bulkhead_driver::confine_and_report(&spec).with_context(|| format!("device {}", spec.device))?;
    // A standby waits, confined, for its device's domain to die.
    if !bulkhead_driver::stand_by(&mut domain, &spec)? {
        return Ok(ExitCode::SUCCESS);
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

/// `bulkhead spare`: waits, sandboxed, for the supervisor to hand it a device, then serves it
/// as [`run`] does. Ends quietly if the supervisor lets it go instead.
#[allow(unsafe_code)] // takes over the hand-over line and the descriptors it brings
pub fn spare() -> anyhow::Result<ExitCode> {
    // SAFETY: the supervisor started this process with its hand-over line at 3 and nothing
    // else open beyond the standard descriptors.
    match unsafe { bulkhead_driver::spare::wait_for_work() }? {
        Some(spec) => run(&spec),
        None => Ok(ExitCode::SUCCESS),
    }
}
