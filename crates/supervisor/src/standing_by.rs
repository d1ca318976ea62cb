//! Standing by: which devices keep a standby domain ([`crate::standby`]), making one for a
//! device, checking that it still fits, and letting it start ahead of a restart. An
//! `interpose` device may keep two: one for its tap domain, one for the domain below.

use std::sync::Arc;

use bulkhead_sys::eventfd::EventFd;

use crate::device::{DeviceRuntime, Slot};
use crate::domains::Domains;
use crate::lifecycle::{Disposition, Which};
use crate::standby::{has_exited, Next, Place, Places, Standby};
use crate::state::DeviceState;

/// Whether `standby` still fits device `rt` as `slot` shows it.
pub(crate) fn fits(standby: &Standby, rt: &DeviceRuntime, slot: &Slot) -> bool {
    let epoch = rt.launcher.epoch();
    match &slot.domains {
        Domains::Interpose { below, .. } if standby.is_tap() => standby.fits_tap(below.serial, epoch),
        Domains::Interpose { below, .. } => standby.fits_below(below.serial, epoch),
        _ => standby.fits_all(rt.device.generation().wrapping_add(1), epoch),
    }
}

/// Lets device `rt`'s standby start at once, before the restart's job has even begun, when
/// what `disposition` replaces is a domain that has exited, or released its memory on the way
/// out, and left nothing to finish: it held no borrowed ring with reads or writes that could
/// still land, and the standby fits the generation the job will start (no view leaves with
/// it). The standby then opens its chain while the job buries the old domain and installs its
/// queues. Called by the watcher with the device claimed for the job and its slot locked,
/// whether it saw the exit itself or the memory released first. Returns whether go was rung.
pub(crate) fn start_early(rt: &DeviceRuntime, slot: &mut Slot, disposition: &Disposition) -> bool {
    if !matches!(disposition, Disposition::Restart { which: Which::All, delay, .. } if delay.is_zero()) {
        return false;
    }
    let exited = match &slot.domains {
        // Memory released, a domain can write nothing it shared any more: it is past every
        // system call, and its only writes that could still land are a borrowed ring's.
        Domains::Passthrough { driver: d } | Domains::Intercept { tap: d } => {
            d.rings.is_empty() && (has_exited(d) || crate::proc_info::memory_released(d.pid()))
        }
        Domains::None | Domains::Interpose { .. } => false,
    };
    if !exited || slot.graveyard.holds_rings() || rt.views_leaving() {
        return false;
    }
    let generation = rt.device.generation().wrapping_add(1);
    match slot.standby.as_mut().filter(|s| s.fits_all(generation, rt.launcher.epoch())) {
        Some(s) => {
            s.ring_early();
            true
        }
        None => false,
    }
}

/// Starts a standby for device `rt` if it wants one and has none, and keeps it if the device
/// is still as it was once the standby has reported. Runs on a worker, without the device's
/// claim: a restart that begins meanwhile takes the usual path, and the standby is ended.
pub(crate) fn prepare(rt: &DeviceRuntime, places: &Arc<Places>) {
    // What the standby is for, read under the lock: the next generation, or the lower queues
    // of an `interpose` device (their descriptors copied, so that the launch holds no lock).
    let (kind, epoch, place) = {
        let mut slot = rt.lock();
        let Some(which) = wanted(&slot).filter(|_| rt.launcher.standby_possible()) else { return };
        // None ready: the watcher asks again later.
        if !rt.launcher.spare_ready() {
            return;
        }
        let kind = match (&slot.domains, which) {
            (Domains::Interpose { below, .. }, Wanted::Tap) => match below.tap_queues() {
                Ok(queues) => Kind::Tap { queues, serial: below.serial },
                Err(e) => {
                    log::warn!("device {}: no standby tap domain: {e}", rt.name);
                    return;
                }
            },
            (Domains::Interpose { below, .. }, Wanted::Next) => match below.lower_fds() {
                Ok(fds) => Kind::Below { fds, nslots: below.nslots, arena_bytes: below.arena_bytes, serial: below.serial },
                Err(e) => {
                    log::warn!("device {}: no standby domain: {e}", rt.name);
                    return;
                }
            },
            (_, Wanted::Tap) => return,
            (_, Wanted::Next) => Kind::All(rt.device.generation().wrapping_add(1)),
        };
        let Some(place) = places.take() else { return };
        slot.standby_preparing = true;
        (kind, rt.launcher.epoch(), place)
    };
    let standby = make(rt, kind, epoch, place);
    let mut slot = rt.lock();
    slot.standby_preparing = false;
    let Some(standby) = standby else { return };
    let tap = standby.is_tap();
    let still =
        !slot.busy && slot.standby_place(tap).is_none() && slot.life.state() == DeviceState::Running && fits(&standby, rt, &slot);
    if still {
        *slot.standby_place(tap) = Some(standby);
        return;
    }
    drop(slot);
    standby.dismiss(&rt.name);
}

/// Whether device `rt`, as `slot` shows it, wants a standby made now: it has restarted, runs,
/// lacks one and is making none.
pub(crate) fn wants(slot: &Slot) -> bool {
    wanted(slot).is_some()
}

/// Which standby device `rt`, as `slot` shows it, wants made now, if any: a tap domain first
/// (its replacement has the most to build), then its next generation or driver domain below.
fn wanted(slot: &Slot) -> Option<Wanted> {
    if slot.busy || slot.standby_preparing || slot.life.state() != DeviceState::Running {
        return None;
    }
    let interpose = matches!(slot.domains, Domains::Interpose { .. });
    if slot.tap_standby_wanted && slot.tap_standby.is_none() && interpose {
        Some(Wanted::Tap)
    } else if slot.standby_wanted && slot.standby.is_none() {
        Some(Wanted::Next)
    } else {
        None
    }
}

/// Which of a device's standbys is to be made.
#[derive(Clone, Copy)]
enum Wanted {
    /// An `interpose` device's next tap domain.
    Tap,
    /// Its next generation, or the driver domain below its tap domain.
    Next,
}

/// Launches a standby of `kind` for device `rt`.
fn make(rt: &DeviceRuntime, kind: Kind, epoch: u64, place: Place) -> Option<Standby> {
    let go = match EventFd::new() {
        Ok(g) => g,
        Err(e) => {
            log::warn!("device {}: no standby domain: {e}", rt.name);
            return None;
        }
    };
    let next = match kind {
        Kind::All(generation) => {
            rt.launcher.launch_standby(generation, &go).map(|launched| Next::All { launched: Box::new(launched), generation })
        }
        Kind::Below { fds, nslots, arena_bytes, serial } => rt.launcher.driver_line().and_then(|line| {
            let driver = rt.launcher.spawn_below_from(fds, nslots, arena_bytes, &line, None, Some(&go))?;
            Ok(Next::Below { driver: Box::new(driver), line, serial })
        }),
        Kind::Tap { queues, serial } => rt.launcher.tap_line().and_then(|line| {
            let tap = rt.launcher.spawn_tap_from(queues, &line, &rt.launcher.chain(), Some(&go))?;
            Ok(Next::Tap { tap: Box::new(tap), line, serial })
        }),
    };
    match next {
        Ok(next) => Some(Standby::new(next, go, epoch, place)),
        Err(e) => {
            // Not the device's log: that one says what happens to the device itself.
            log::info!("device {}: no standby domain: {e}", rt.name);
            None
        }
    }
}

/// What [`prepare`] makes a standby for.
enum Kind {
    /// The whole next generation, this one.
    All(u32),
    /// A driver domain on these lower queues.
    Below { fds: Vec<bulkhead_channel::BackQueueFds>, nslots: u32, arena_bytes: u64, serial: u64 },
    /// A tap domain over these channels.
    Tap { queues: crate::domains::TapQueues, serial: u64 },
}
