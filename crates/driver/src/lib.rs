//! The driver-domain runtime.
//!
//! A domain is a separate process (`bulkhead driver`, exec'd by the supervisor) that holds only
//! the descriptors it was given: each queue's ring, arenas and doorbells, and its backend's
//! files. [`bulkhead_spec::DomainSpec`] says which descriptor is which ([`build_inherited`]
//! claims them); [`Domain`] serves every queue of
//! the device from one thread, round-robin, one batch per queue per turn, through a
//! [`bulkhead_block::Chain`]. Queues may serve views of the device, each with its credit and
//! share of the turns (`sharing`).
#![deny(missing_docs)]

mod attach;
mod build;
pub mod guarded;
mod model;
mod runtime;
mod sharing;
pub mod spare;

pub use build::{build_inherited, build_inherited_wrapping};
pub use model::build_model_inherited;
pub use runtime::{Domain, DomainStats};

/// Makes SIGTERM and SIGINT set `stop` and make the returned descriptor readable, for
/// [`Domain::wake_on_stop`]: a domain asleep with nothing to do wakes for them at once.
pub fn stop_on_signals(stop: &std::sync::Arc<std::sync::atomic::AtomicBool>) -> std::io::Result<std::os::fd::OwnedFd> {
    // A pipe, written with write(2) from the handler, which every domain's seccomp role allows.
    let (bell, ring) = std::io::pipe()?;
    for sig in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT] {
        // The flag first: the handlers run in the order registered, so the flag is set when
        // the domain wakes.
        signal_hook::flag::register(sig, stop.clone())?;
        signal_hook::low_level::pipe::register(sig, ring.try_clone()?)?;
    }
    Ok(bell.into())
}

/// Why a domain stopped.
#[derive(Debug, thiserror::Error)]
pub enum DriverError {
    /// The frontend broke the ring protocol on a queue.
    #[error("queue {queue}: {source}")]
    Channel {
        /// Queue index.
        queue: usize,
        /// What happened.
        #[source]
        source: bulkhead_channel::ChannelError,
    },
    /// The backend lost something outside the domain it depends on (its remote server). The
    /// last batch was not answered; the supervisor reconnects and the frontend reissues it.
    #[error("backend lost: {0}")]
    BackendLost(String),
    /// The spec or a descriptor in it was unusable.
    #[error("setup: {0}")]
    Setup(String),
    /// The sandbox could not be applied as the policy requires.
    #[error("sandbox: {0}")]
    Sandbox(String),
}

/// Address space allowed beyond what a domain has mapped at confinement: the allocator's needs.
const HEADROOM: u64 = 256 << 20;

/// The same for an `rbd` domain: librados's threads each reserve a stack and a malloc arena
/// (most of it never touched).
const RBD_HEADROOM: u64 = 8 << 30;

/// Makes `domain` a standby if `spec` names a go doorbell (`standby_fd`): once confined it
/// waits in [`stand_by`] until the supervisor rings it. Call after
/// [`Domain::wake_on_stop`] and before [`confine_and_report`].
///
/// # Safety
///
/// As [`build_inherited`]: the descriptor the spec names is this process's alone, and nothing
/// else here uses it.
pub unsafe fn claim_standby(domain: &mut Domain, spec: &bulkhead_spec::DomainSpec) -> Result<(), DriverError> {
    let Some(fd) = spec.standby_fd else { return Ok(()) };
    let setup = |e: std::io::Error| DriverError::Setup(format!("the standby's go doorbell: {e}"));
    // SAFETY: the caller's promise.
    let go = unsafe { bulkhead_sys::claim_inherited(fd) }.map_err(setup)?;
    domain.set_standby(bulkhead_sys::eventfd::EventFd::from_owned(go).map_err(setup)?)
}

/// A standby, confined and reported, waits here until its device's domain has died and it is
/// let serve ([`Domain::await_go`]), then shows its role in `ps`. Returns `false` if it was
/// asked to stop first. Returns `true` at once for a domain that is no standby.
pub fn stand_by(domain: &mut Domain, spec: &bulkhead_spec::DomainSpec) -> Result<bool, DriverError> {
    if spec.standby_fd.is_none() {
        return Ok(true);
    }
    if !domain.await_go()? {
        return Ok(false);
    }
    spare::retitle_for(spec, false);
    Ok(true)
}

/// Confines this process as the domain `spec` describes (namespaces were entered at spawn;
/// this applies the empty mount tree, rlimits, no_new_privs, Landlock and the seccomp allowlist
/// of its role) and reports the layers in force, or why it refused, on the spec's report pipe.
/// Call it once every descriptor and mapping the domain needs exists: afterwards it can open
/// nothing more.
pub fn confine_and_report(spec: &bulkhead_spec::DomainSpec) -> Result<bulkhead_sandbox::Layers, DriverError> {
    confine_and_report_withholding(spec, Vec::new())
}

/// [`confine_and_report`], with the named layers treated as unavailable on this host (see
/// [`bulkhead_sandbox::confine::Options::withhold`]).
pub fn confine_and_report_withholding(
    spec: &bulkhead_spec::DomainSpec,
    withhold: Vec<String>,
) -> Result<bulkhead_sandbox::Layers, DriverError> {
    let guarded = spec.filters.iter().any(|f| f.guard.wanted());
    // Each attached queue maps its ring and two arenas of the geometry of the others.
    let slots = spec.attach.as_ref().map_or(0, |a| a.slots.len());
    let per_slot = spec.queues.first().map_or(0, |q| {
        let ring = bulkhead_ring::RingLayout::new(q.nslots).map_or(0, |l| l.file_size() as u64);
        ring + 2 * q.arena_bytes.next_multiple_of(bulkhead_shmem::PAGE_SIZE as u64)
    });
    confine_as(spec.sandbox.policy, spec.seccomp_role(), guarded, spec.report_fd, withhold, (slots, per_slot))
}

/// Confines this process as a domain of seccomp `role` under `policy` (with room for
/// `attach_slots` attached queues of `per_slot` mapped bytes each), and reports the layers
/// in force, or why it refused, on the pipe `report_fd` (inherited, claimed here): what
/// [`confine_and_report`] does for a driver or tap domain, for any domain (a device model's).
pub fn confine_as(
    policy: bulkhead_sandbox::Policy,
    role: bulkhead_sandbox::seccomp::Role,
    guarded: bool,
    report_fd: Option<i32>,
    withhold: Vec<String>,
    (attach_slots, per_slot): (usize, u64),
) -> Result<bulkhead_sandbox::Layers, DriverError> {
    use std::io::Write;
    let opts = bulkhead_sandbox::confine::Options {
        policy,
        role,
        guarded,
        attach_slots,
        namespaces: bulkhead_sandbox::spawn::namespaces_layer(policy),
        address_space_headroom: if role == bulkhead_sandbox::seccomp::Role::Rbd { RBD_HEADROOM } else { HEADROOM }
            + attach_slots as u64 * per_slot,
        withhold,
    };
    // Claimed before confinement: the seccomp allowlist has no fcntl to check it with after.
    let report_pipe = match report_fd {
        // SAFETY: the report pipe named in the spec is this process's alone, claimed once here.
        Some(fd) => Some(unsafe { bulkhead_sys::claim_inherited(fd) }.map_err(|e| DriverError::Setup(e.to_string()))?),
        None => None,
    };
    let confined = bulkhead_sandbox::confine::confine(&opts);
    if let Some(fd) = report_pipe {
        let mut f = std::fs::File::from(fd);
        let report = match &confined {
            Ok(layers) => bulkhead_sandbox::Report::Confined(layers.clone()),
            Err(e) => bulkhead_sandbox::Report::Refused { refused: e.to_string() },
        };
        let _ = writeln!(f, "{}", serde_json::to_string(&report).expect("report serialises"));
    }
    confined.map_err(|e| DriverError::Sandbox(e.to_string()))
}
