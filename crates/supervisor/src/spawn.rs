//! Starting and ending one domain process: exec it confined, read its sandbox report, and
//! end one that will not be used. Shared by the launcher (driver and tap domains) and the
//! `vdev` card (its model's domain).

use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use bulkhead_sandbox::spawn::DomainChild;
use bulkhead_sandbox::{Layer, Layers, Policy, Report};

use crate::domain_log;
use crate::error::Error;
use crate::spares::Spares;

pub(crate) use crate::reap::{discard, EXIT_WAIT};

/// Where a domain process comes from.
#[derive(Debug, Clone, Copy)]
pub(crate) enum From<'a> {
    /// An exec.
    Exec,
    /// A spare of the pool, if one is ready; an exec otherwise.
    SpareElseExec(&'a Spares),
    /// A spare of the pool, or none at all.
    Spare(&'a Spares),
}

/// Execs `exe ARGS` as a sandboxed domain of `device` (`what` names it in messages), its spec
/// `spec_json` in its environment ([`bulkhead_spec::SPEC_ENV`], out of `ps`'s sight), holding
/// `fds` at 3, 4, …, its output relayed to the log; drops `handed` (the supervisor's copies of
/// what it passed, the write end of the report pipe among them) once the domain holds its own;
/// and waits for its sandbox report on `report`. From a spare, as `from` says, one that is
/// ready takes the spec and descriptors instead of an exec ([`crate::spares`]). Under `Policy::Required`, a domain without
/// namespaces, or one that refused to confine itself, is ended and the launch fails. The
/// layers are `None` if the domain said nothing (it failed before confinement, or is slow).
///
/// The domain dies with the *thread* that calls this (PR_SET_PDEATHSIG): call it only from a
/// thread that outlives the domain (the supervisor's workers).
#[allow(clippy::too_many_arguments)]
pub(crate) fn exec_confined<T>(
    exe: &Path,
    args: &[&std::ffi::OsStr],
    spec_json: &str,
    fds: &[RawFd],
    handed: T,
    device: &str,
    policy: Policy,
    report: &OwnedFd,
    what: &str,
    from: From<'_>,
) -> Result<(DomainChild, Option<Layers>), Error> {
    // A spare, if one is ready, sandboxed already; an exec otherwise.
    let spares = match from {
        From::Exec => None,
        From::SpareElseExec(s) | From::Spare(s) => Some(s),
    };
    let (child, ns) = match spares.and_then(|s| s.hand_over(device, spec_json, fds)) {
        Some(taken) => taken,
        None if matches!(from, From::Spare(_)) => return Err(Error::busy(format!("no spare domain is ready for {what}"))),
        None => {
            let (out_r, out_w) =
                domain_log::pipe().map_err(|e| Error::failed(format!("cannot make the domain's output pipe: {e}")))?;
            let env = [(bulkhead_spec::SPEC_ENV, std::ffi::OsStr::new(spec_json))];
            let (child, ns) =
                bulkhead_sandbox::spawn::spawn(exe, args, &env, fds, Some(out_w.as_raw_fd()), policy != Policy::Off)
                    .map_err(|e| Error::failed(format!("cannot start {what}: {e}")))?;
            drop(out_w);
            domain_log::relay(device, child.id(), out_r);
            (child, ns)
        }
    };
    let mut child = child;
    // The domain holds its own copies now.
    drop(handed);
    if let (Policy::Required, Layer::Unavailable(why)) = (policy, &ns) {
        discard(child);
        return Err(Error::failed(format!("sandbox = \"required\" but namespaces are unavailable: {why}")));
    }
    match read_report(report) {
        Some(Report::Confined(layers)) => Ok((child, Some(layers))),
        Some(Report::Refused { refused }) => {
            // It exits on its own after reporting; give it the time to say why.
            let _ = child.wait_timeout(EXIT_WAIT);
            discard(child);
            Err(Error::failed(format!("{what} refused to start: {refused} (sandbox = \"required\")")))
        }
        None => Ok((child, None)),
    }
}

/// Reads the domain's sandbox report: one JSON line, written once it is confined. `None` if it
/// exits or stays silent for 5 s.
fn read_report(fd: &OwnedFd) -> Option<Report> {
    use std::io::Read;
    let mut f = std::fs::File::from(fd.try_clone().ok()?);
    let mut buf = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let left = deadline.saturating_duration_since(Instant::now()).as_millis() as i32;
        let mut pfd = [libc::pollfd { fd: fd.as_raw_fd(), events: libc::POLLIN, revents: 0 }];
        if left <= 0 || bulkhead_sys::poll(&mut pfd, left).ok()? == 0 {
            return None;
        }
        let mut chunk = [0u8; 1024];
        let n = f.read(&mut chunk).ok()?;
        if n == 0 {
            break;
        }
        buf.extend_from_slice(&chunk[..n]);
        if buf.contains(&b'\n') || buf.len() > 64 * 1024 {
            break;
        }
    }
    serde_json::from_slice(buf.split(|&b| b == b'\n').next()?).ok()
}

/// Waits up to [`EXIT_WAIT`] for a killed domain to exit or to release its memory; returns
/// whether it did either.
pub(crate) fn finish_or_release(c: &mut DomainChild) -> bool {
    let deadline = Instant::now() + EXIT_WAIT;
    loop {
        if matches!(c.wait_timeout(Duration::from_millis(2)), Ok(Some(_)) | Err(_)) || crate::proc_info::memory_released(c.id()) {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
    }
}

/// The `bulkhead` executable to exec for domains: the very binary this process runs, through
/// `/proc/self/exe`, not the path it was started from. A package upgrade replaces the file at
/// that path while `serve` runs on; its domains must still speak its own version, and a `serve`
/// its keeper fell back to runs a binary no path names any more.
pub(crate) fn current_exe() -> PathBuf {
    let own = PathBuf::from("/proc/self/exe");
    if own.exists() {
        return own;
    }
    std::env::current_exe().unwrap_or_else(|_| PathBuf::from("bulkhead"))
}

/// Execs `exe driver DEVICE` as a sandboxed domain of spec `spec_json` (see
/// [`bulkhead_sandbox::spawn`]): `fds` at 3, 4, …, everything else closed at exec, new
/// namespaces when `namespaces`.
///
/// The domain dies with the *thread* that calls this (PR_SET_PDEATHSIG): call it only from a
/// thread that outlives the domain.
pub fn spawn_domain(
    exe: &Path,
    device: &str,
    spec_json: &str,
    fds: &[RawFd],
    namespaces: bool,
) -> std::io::Result<(DomainChild, Layer)> {
    let args: [&std::ffi::OsStr; 2] = ["driver".as_ref(), device.as_ref()];
    let env = [(bulkhead_spec::SPEC_ENV, std::ffi::OsStr::new(spec_json))];
    bulkhead_sandbox::spawn::spawn(exe, &args, &env, fds, None, namespaces)
}
