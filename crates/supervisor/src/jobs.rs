//! The jobs that change a device's domains: replace them all (the next generation), replace
//! one domain of an `interpose` device alone, try a lost remote server again, fail the device.
//! Each runs on one of the supervisor's workers while the device is claimed, takes the domains
//! it works on out of the device's slot, and works with no lock held.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::device::DeviceRuntime;
use crate::domains::{Below, Domain, Domains, Graveyard};
use crate::error::{Error, ErrorKind};
use crate::launcher::Launched;
use crate::lifecycle::{Disposition, Event, Launch, Observation, Which};
use crate::mailbox::{Note, Reply};
use crate::standby::Standby;
use crate::state::{DeviceState, Shape};

/// How long each step of replacing one domain of an `interpose` device alone may take: the tap
/// domain starting its channel below over, or the driver domain below letting go of its queues
/// and attaching again, and the frontend's users starting theirs over. Past it, both domains
/// are replaced.
const SWITCH_STEP: Duration = Duration::from_secs(1);

/// Carries out `disposition` on the claimed device `rt` (detected at `detected`), then lets
/// go of the claim, or hands it on to the job the lifecycle wants next; answers `reply` with
/// the new driver pid, or why the device failed, once nothing more follows.
pub(crate) fn run(rt: &DeviceRuntime, disposition: Disposition, detected: Instant, reply: Option<Reply>, stopping: &AtomicBool) {
    let replaced = match disposition {
        Disposition::Fail { reason } => {
            fail(rt, &reason);
            Ok(())
        }
        Disposition::Restart { which: Which::All, why, .. } => {
            restart_all(rt, &why, detected, stopping);
            Ok(())
        }
        Disposition::Restart { which: Which::Tap, why, .. } => replace_tap(rt, &why, detected),
        Disposition::Restart { which: Which::Below, why, .. } => replace_below(rt, &why, detected),
    };
    if let Err(why) = replaced {
        // Both domains go, as the lifecycle says: at once, after a back-off, or not at all.
        let disposition = rt.lock().life.on_event(Event::ReplaceFailed { why: why.to_string() }, rt.control.answered());
        rt.hand_on(Note::Then { device: rt.id, disposition, detected, reply });
        return;
    }
    if let Some(reply) = reply {
        let slot = rt.lock();
        let _ = reply.send(match slot.life.state() {
            DeviceState::Running => Ok(slot.faces.driver_pid),
            _ => Err(Error::failed(slot.life.failure().unwrap_or("restart failed"))),
        });
    }
    rt.release();
}

/// Tries the launch of a `reconnecting` device's next generation again, then lets go of the
/// claim.
pub(crate) fn retry(rt: &DeviceRuntime, stopping: &AtomicBool) {
    if !stopping.load(Ordering::Acquire) {
        relaunch(rt, "remote server still unreachable", None);
    }
    rt.release();
}

/// Takes the domains and the graveyard out of the slot.
pub(crate) fn take_all(rt: &DeviceRuntime) -> (Vec<Domain>, Option<Below>, Graveyard) {
    let mut slot = rt.lock();
    let (domains, below) = slot.domains.take_all();
    let mut graveyard = std::mem::take(&mut slot.graveyard);
    // A standby tap domain goes with the channels it was made for.
    if let Some(s) = slot.tap_standby.take() {
        s.bury(&rt.name, &mut graveyard);
    }
    (domains, below, graveyard)
}

/// Kills `domains` and waits for what they left in the kernel; puts the graveyard back.
pub(crate) fn bury_all(rt: &DeviceRuntime, domains: Vec<Domain>, below: Option<Below>, mut graveyard: Graveyard) {
    for d in domains {
        graveyard.bury(&rt.name, d);
    }
    drop(below);
    graveyard.drain(&rt.name);
    let mut slot = rt.lock();
    slot.faces = Default::default();
    slot.graveyard = graveyard;
}

/// Ends the device's domains and fails it: its requests fail at once, attached applications
/// are told.
fn fail(rt: &DeviceRuntime, reason: &str) {
    let (domains, below, graveyard) = take_all(rt);
    let standby = rt.lock().standby.take();
    if let Some(s) = standby {
        s.dismiss(&rt.name);
    }
    bury_all(rt, domains, below, graveyard);
    log::error!("device {}: {reason}", rt.name);
    rt.control.fail(reason);
    rt.attach.fail(reason);
}

/// Replaces every domain of the device: kills what is left of the old ones, launches the next
/// generation with the same backend descriptors and hands its queues to the frontend, which
/// reissues every request that had no response.
fn restart_all(rt: &DeviceRuntime, why: &str, detected: Instant, stopping: &AtomicBool) {
    rt.control.outage_started(detected);
    let standby = rt.lock().take_standby();
    if standby.is_none() {
        rt.launcher.expect_launch();
    }
    let (domains, below, mut graveyard) = take_all(rt);
    if let Some(s) = standby.as_ref().filter(|s| s.rung() && !stopping.load(Ordering::Acquire)) {
        // Started already: the old domain exited and left nothing to finish
        // (`standing_by::start_early`). Its queues go to the frontend first, then the old domain
        // is reaped.
        debug_assert!(s.fits_all(rt.device.generation().wrapping_add(1), rt.launcher.epoch()));
        rt.control.log_limited(|| format!("{why}; restarting"));
        relaunch(rt, why, standby);
        for d in domains {
            graveyard.bury(&rt.name, d);
        }
        drop(below);
        rt.lock().graveyard = graveyard;
        return;
    }
    // One that no longer fits goes with the old domains.
    let generation = rt.device.generation().wrapping_add(1);
    let standby = match standby {
        Some(s) if s.fits_all(generation, rt.launcher.epoch()) => Some(s),
        Some(s) => {
            s.bury(&rt.name, &mut graveyard);
            None
        }
        None => None,
    };
    bury_all(rt, domains, below, graveyard);
    // Views being removed go now that no domain serves them.
    rt.drop_leaving();
    // A driver that breaks every generation restarts many times a second: rate-limited.
    rt.control.log_limited(|| format!("{why}; restarting"));
    if stopping.load(Ordering::Acquire) {
        if let Some(s) = standby {
            s.dismiss(&rt.name);
        }
        return;
    }
    relaunch(rt, why, standby);
}

/// Launches the next generation of the device's domains, or lets `standby` serve it if it
/// still fits (views just dropped change the layout). A remote server that cannot be reached
/// is tried again with back-off while the device is `reconnecting`, until its reconnect
/// timeout; any other failure turns the device failed.
fn relaunch(rt: &DeviceRuntime, why: &str, standby: Option<crate::standby::Standby>) {
    let generation = rt.device.generation().wrapping_add(1);
    // Read before the new domains can write their pages.
    let before = rt.observe();
    let epoch = rt.launcher.epoch();
    let launched = match standby.map(|s| if s.fits_all(generation, epoch) { s.go() } else { Err(s) }) {
        Some(Ok(launched)) => {
            rt.launcher.trim_outputs();
            rt.lock().standby_used += 1;
            Ok(launched)
        }
        other => {
            if let Some(Err(s)) = other {
                s.dismiss(&rt.name);
            }
            rt.launcher.launch(generation)
        }
    };
    match launched {
        Ok(Launched { fronts, domains, attach_line }) => {
            let shape = domains.shape().unwrap_or(Shape::Passthrough);
            let up = {
                let mut slot = rt.lock();
                slot.faces = domains.faces();
                slot.domains = domains;
                slot.life.on_launched(shape, &before, true)
            };
            if let Launch::Up { was_down: Some(down) } = up {
                log::info!("device {}: reconnected after {} ms", rt.name, down.as_millis());
            }
            rt.install_generation(fronts);
            // Attached applications start their queues over, and the new domain takes them.
            rt.attach.rejoin(attach_line);
        }
        Err(e) => {
            let outcome = rt.lock().life.on_launch_failed(why, &e.to_string(), e.kind() == ErrorKind::Unreachable);
            match outcome {
                Launch::Retry { after } => rt.control.log_limited(|| format!("{e}; trying again in {} ms", after.as_millis())),
                Launch::Fail { reason } => {
                    log::error!("device {}: {reason}", rt.name);
                    rt.control.fail(&reason);
                    rt.attach.fail(&reason);
                }
                Launch::Up { .. } => {}
            }
        }
    }
}

/// Takes an `interpose` device's domains out of the slot (and the graveyard), or leaves the
/// slot as it was if the device is not laid out so.
fn take_interpose(rt: &DeviceRuntime) -> Option<(Domain, Domain, Below, Graveyard)> {
    let mut slot = rt.lock();
    match std::mem::take(&mut slot.domains) {
        Domains::Interpose { tap, driver, below } => Some((tap, driver, below, std::mem::take(&mut slot.graveyard))),
        other => {
            slot.domains = other;
            None
        }
    }
}

/// Puts an `interpose` device's domains back after one of them was replaced alone.
/// `before`: what the watcher saw before the replacement; `holder_new`: the driver domain below
/// is the one replaced.
fn install_interpose(rt: &DeviceRuntime, replaced: (Domain, Domain, Below, Graveyard), before: &Observation, holder_new: bool) {
    let (tap, driver, below, graveyard) = replaced;
    let mut slot = rt.lock();
    let domains = Domains::Interpose { tap, driver, below };
    slot.faces = domains.faces();
    slot.domains = domains;
    slot.graveyard = graveyard;
    slot.life.on_launched(Shape::Interpose, before, holder_new);
}

/// Gives up replacing one domain alone: ends what is left, for a restart of both. `Err(why)`
/// for the caller to return.
fn give_up(rt: &DeviceRuntime, domains: Vec<Domain>, below: Below, graveyard: Graveyard, why: String) -> Result<(), Error> {
    bury_all(rt, domains, Some(below), graveyard);
    Err(Error::failed(why))
}

/// How long a wait for a domain's answer on its line looks again at once, yielding the core
/// between looks, before it sleeps between them: a domain that has a core answers within tens
/// of microseconds, and each sleep would add a timer's slack (50 µs) and a wake-up to an
/// outage the wait lies inside.
const ANSWER_SPIN: Duration = Duration::from_micros(500);

/// Waits up to [`SWITCH_STEP`] for `done`, while the process behind `pidfd` lives; says what
/// went wrong otherwise. Yields the core between looks for [`ANSWER_SPIN`] (the domain may
/// need it), then sleeps 100 µs between them.
fn await_domain(pidfd: std::os::fd::BorrowedFd<'_>, mut done: impl FnMut() -> bool) -> Result<(), &'static str> {
    use std::os::fd::AsRawFd;
    let start = Instant::now();
    let deadline = start + SWITCH_STEP;
    while !done() {
        let mut pfd = [libc::pollfd { fd: pidfd.as_raw_fd(), events: libc::POLLIN, revents: 0 }];
        if bulkhead_sys::poll(&mut pfd, 0).is_ok_and(|n| n > 0) {
            return Err("died");
        }
        let now = Instant::now();
        if now >= deadline {
            return Err("did not follow in time");
        }
        if now - start < ANSWER_SPIN {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(100));
        }
    }
    Ok(())
}

/// The standby `taken` from device `rt`'s slot if `fit` lets it serve the replacement about to
/// begin (`Ok`, woken if it must be), else buried in `graveyard`; with none, a spare is told
/// it will be wanted shortly ([`expect_launch`](crate::launcher::Launcher::expect_launch)).
fn fitting(
    rt: &DeviceRuntime,
    taken: Option<Standby>,
    graveyard: &mut Graveyard,
    fit: impl FnOnce(Standby) -> Result<Standby, Standby>,
) -> Option<Standby> {
    let standby = match taken.map(fit) {
        Some(Ok(s)) => Some(s),
        Some(Err(s)) => {
            s.bury(&rt.name, graveyard);
            None
        }
        None => None,
    };
    if standby.is_none() {
        rt.launcher.expect_launch();
    }
    standby
}

/// Replaces the driver domain below a tap domain, which has exited, leaving the tap domain
/// running: the tap domain starts the channel below over as the next generation and sends
/// again what had no answer, and a new driver domain attaches to the same queues. The frontend
/// above sees a pause, not a reissue. `Err(why)`: replace both for `why`.
fn replace_below(rt: &DeviceRuntime, why: &str, detected: Instant) -> Result<(), Error> {
    let before = rt.observe();
    let Some((tap, driver, mut below, mut graveyard)) = take_interpose(rt) else { return Err(Error::failed(why)) };
    rt.control.time_outage(detected);
    let standby = rt.lock().take_standby();
    let generation = below.generation.wrapping_add(1).max(1);
    // A standby wakes while the tap domain starts the queues over, and attaches after.
    let standby = fitting(rt, standby, &mut graveyard, |s| {
        if s.fits_below(below.serial, rt.launcher.epoch()) {
            s.wake_below(generation)
        } else {
            Err(s)
        }
    });
    rt.control.log_limited(|| format!("{why}; replacing it (the tap domain runs on)"));
    graveyard.bury(&rt.name, driver);
    below.control.request_restart(generation);
    below.wake_tap();
    let give_up = |standby: Option<Standby>, tap, below, mut graveyard: Graveyard, why| {
        if let Some(s) = standby {
            s.bury(&rt.name, &mut graveyard);
        }
        give_up(rt, vec![tap], below, graveyard, why)
    };
    // The tap domain starts its queues below over and says so; if it dies meanwhile, or says
    // nothing in time, both domains are replaced.
    if let Err(e) = await_domain(tap.pidfd(), || below.control.ready() == u64::from(generation)) {
        let why = format!("{why}; the tap domain (pid {}) {e}", tap.pid());
        return give_up(standby, tap, below, graveyard, why);
    }
    below.generation = generation;
    graveyard.drain(&rt.name);
    let driver = match standby.map(|s| s.attach_below(generation)) {
        // The standby has its own line, which nothing of the old domain's has touched: it
        // attaches as the generation the line names and serves.
        Some(Ok((driver, line))) => {
            below.driver_line = line;
            rt.lock().standby_used += 1;
            driver
        }
        other => {
            if let Some(Err(s)) = other {
                s.bury(&rt.name, &mut graveyard);
            }
            // A fresh line for the new domain below: nothing the old one wrote there can
            // mislead it.
            below.driver_line = match rt.launcher.driver_line() {
                Ok(l) => l,
                Err(e) => return give_up(None, tap, below, graveyard, format!("{why}; {e}")),
            };
            match rt.launcher.spawn_below(&below, None) {
                Ok(d) => d,
                Err(e) => {
                    let why = format!("{why}; a new driver domain below could not start: {e}");
                    return give_up(None, tap, below, graveyard, why);
                }
            }
        }
    };
    install_interpose(rt, (tap, driver, below, graveyard), &before, true);
    rt.control.outage_over_if_idle();
    Ok(())
}

/// Replaces the tap domain of an `interpose` device, which has exited, wedged or broken the
/// channel (or whose filters changed), leaving the driver domain below it running: the driver
/// domain lets go of the channel between them, the frontend starts its queues over in place
/// and sends again what had no answer, a new tap domain (the device's standby tap domain, if
/// it keeps one that fits) attaches to both channels, and the driver domain attaches again.
/// The backend's state (a remote connection, a file's cache) stays. `Err(why)`: replace both
/// for `why`.
fn replace_tap(rt: &DeviceRuntime, why: &str, detected: Instant) -> Result<(), Error> {
    let before = rt.observe();
    let Some((tap, driver, mut below, mut graveyard)) = take_interpose(rt) else { return Err(Error::failed(why)) };
    rt.control.outage_started(detected);
    let standby = {
        let mut slot = rt.lock();
        // A standby below stays as it is: the lower queues stay.
        slot.standby_wanted = true;
        slot.take_tap_standby()
    };
    let standby =
        fitting(rt, standby, &mut graveyard, |s| if s.fits_tap(below.serial, rt.launcher.epoch()) { Ok(s) } else { Err(s) });
    rt.control.log_limited(|| format!("{why}; replacing it (the driver domain below runs on)"));
    graveyard.bury(&rt.name, tap);
    graveyard.drain(&rt.name);
    let failed = |what: &str| format!("{why}; the driver domain below (pid {}) {what}", driver.pid());
    let generation = below.generation.wrapping_add(1).max(1);
    // The driver domain lets go of the channel between the two, finishing what it holds.
    below.driver_line.request_detach(generation);
    if let Err(e) = await_domain(driver.pidfd(), || below.driver_line.detached(generation)) {
        if let Some(s) = standby {
            s.bury(&rt.name, &mut graveyard);
        }
        let why = failed(e);
        return give_up(rt, vec![driver], below, graveyard, why);
    }
    below.generation = generation;
    // A standby starts the channel below over while the frontend starts the channel above over.
    let taken = standby.map(|s| {
        // What the old tap domain left half-written in the filters' outputs, as a launch trims.
        rt.launcher.trim_outputs();
        s.take_over(generation)
    });
    let standby = match taken {
        Some(Ok((tap, line))) => {
            // Its own line, which nothing of the old tap domain's has touched.
            below.control = line;
            Some(tap)
        }
        Some(Err(s)) => {
            s.bury(&rt.name, &mut graveyard);
            None
        }
        None => None,
    };
    let with = |tap: Option<Domain>, driver| tap.into_iter().chain([driver]).collect::<Vec<_>>();
    // The frontend's queues start over on the same files: the driver domain maps their arenas.
    let above = rt.device.generation().wrapping_add(1).max(1);
    if let Err(e) = rt.control.start_over_in_place(above, SWITCH_STEP) {
        return give_up(rt, with(standby, driver), below, graveyard, format!("{why}; {e}"));
    }
    let tap = match standby {
        Some(tap) => {
            below.control.allow_above(above);
            if let Err(e) = await_domain(tap.pidfd(), || below.control.ready() == u64::from(generation)) {
                let why = format!("{why}; the standby tap domain (pid {}) {e}", tap.pid());
                return give_up(rt, vec![tap, driver], below, graveyard, why);
            }
            rt.lock().standby_used += 1;
            tap
        }
        None => {
            // A fresh line for the new tap domain: nothing the old one wrote there can mislead it.
            below.control = match rt.launcher.tap_line() {
                Ok(c) => c,
                Err(e) => return give_up(rt, vec![driver], below, graveyard, format!("{why}; {e}")),
            };
            match rt.launcher.spawn_tap(&below, &rt.launcher.chain()) {
                Ok(t) => t,
                Err(e) => {
                    let why = format!("{why}; a new tap domain could not start: {e}");
                    return give_up(rt, vec![driver], below, graveyard, why);
                }
            }
        }
    };
    // The headers below are written: the driver domain attaches again.
    below.driver_line.request_attach(generation);
    if let Err(e) = await_domain(driver.pidfd(), || below.driver_line.attached(generation)) {
        let why = failed(e);
        return give_up(rt, vec![tap, driver], below, graveyard, why);
    }
    install_interpose(rt, (tap, driver, below, graveyard), &before, false);
    rt.control.outage_over_if_idle();
    Ok(())
}
