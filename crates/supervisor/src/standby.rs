//! Standby domains: a device's next domain, started ahead of its next restart.
//!
//! A spare domain ([`crate::spares`]) knows no device, so a restart that takes one still waits
//! for the device's queues to be made, for the spare to be given them, to build its chain and
//! to narrow its sandbox to its role. A device that has restarted once is likely to again (a
//! driver with a bug, a storage that keeps failing it), so after its first restart it keeps a
//! standby: a domain given what its next domain will hold (from a spare, never exec'd), built,
//! confined and reported, waiting on a doorbell of its own ("go") without having touched
//! anything the running domain uses: no ring the running domain serves, no metadata read from
//! the storage, no filter opened, no state page written. It comes in two kinds:
//!
//! - [`Next::All`]: the next generation of a device with one domain (`passthrough`,
//!   `intercept`), on queues of its own. When the running domain dies the restart buries it,
//!   rings go and installs the standby's queues; the frontend sends its requests again.
//! - [`Next::Below`]: a driver domain for below an `interpose` device's tap domain, on the
//!   lower queues the tap domain and the running driver domain use. When the driver domain
//!   dies and the tap domain has started those queues over, the standby is told the
//!   generation on a line of its own and rung: it attaches to them and serves what the tap
//!   domain sends again. A replaced tap domain leaves it waiting.
//!
//! A standby fits the restart it was made for only: that generation (or those lower queues)
//! of a device whose chain, views and activity are as they were when it started
//! ([`Launcher::epoch`]). One that no longer fits, or has died, is buried and the restart
//! takes the usual path. Only devices whose backend reads nothing of its storage before
//! serving (`ram`, `null`, a raw `file`) keep one; `[domains] standbys` bounds how many devices
//! do at once.
//!
//! [`Launcher::epoch`]: crate::launcher::Launcher::epoch

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use bulkhead_channel::AboveControl;
use bulkhead_sys::eventfd::EventFd;

use crate::device::{DeviceRuntime, Slot};
use crate::domains::{Domain, Domains, Graveyard};
use crate::launcher::Launched;
use crate::lifecycle::{Disposition, Which};
use crate::state::DeviceState;

/// How many standbys the devices may hold at once (`[domains] standbys`), and how many they
/// hold now.
#[derive(Debug)]
pub(crate) struct Places {
    most: usize,
    held: AtomicUsize,
}

impl Places {
    /// Room for `most` standbys.
    pub fn new(most: usize) -> Arc<Places> {
        Arc::new(Places { most, held: AtomicUsize::new(0) })
    }

    /// Whether standbys are kept at all.
    pub fn enabled(&self) -> bool {
        self.most > 0
    }

    /// Standbys held now.
    pub fn held(&self) -> usize {
        self.held.load(Ordering::Relaxed)
    }

    /// The most standbys held at once.
    pub fn most(&self) -> usize {
        self.most
    }

    /// Takes a place, if one is free.
    fn take(self: &Arc<Self>) -> Option<Place> {
        self.held
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| (n < self.most).then_some(n + 1))
            .ok()
            .map(|_| Place(self.clone()))
    }
}

/// One standby's place among [`Places`]: given back when the standby is used or ended.
#[derive(Debug)]
struct Place(Arc<Places>);

impl Drop for Place {
    fn drop(&mut self) {
        self.0.held.fetch_sub(1, Ordering::AcqRel);
    }
}

/// What a standby will be.
#[derive(Debug)]
pub(crate) enum Next {
    /// The device's whole next generation: its queues and its one domain.
    All { launched: Box<Launched>, generation: u32 },
    /// A driver domain for below the tap domain, on the lower queues of [`Below::serial`]
    /// `serial`, with its own line about the tap domain.
    ///
    /// [`Below::serial`]: crate::domains::Below::serial
    Below { driver: Box<Domain>, line: AboveControl, serial: u64 },
}

/// A device's next domain, launched and waiting for go.
#[derive(Debug)]
pub(crate) struct Standby {
    next: Next,
    go: EventFd,
    /// Go was rung ahead of the restart ([`start_early`]): from then on the standby serves or
    /// is buried, never left waiting.
    rung: bool,
    /// The launcher's epoch it was made under.
    epoch: u64,
    _place: Place,
}

impl Standby {
    /// The waiting domain.
    fn domain(&self) -> Option<&Domain> {
        match &self.next {
            Next::All { launched, .. } => launched.domains.top(),
            Next::Below { driver, .. } => Some(&**driver),
        }
    }

    /// The waiting domain's process id.
    pub fn pid(&self) -> u32 {
        self.domain().map_or(0, Domain::pid)
    }

    /// Whether go was rung ahead of the restart ([`start_early`]).
    pub fn rung(&self) -> bool {
        self.rung
    }

    /// Whether it is alive and was made under the launcher's `epoch`.
    fn current(&self, epoch: u64) -> bool {
        self.epoch == epoch && self.domain().is_some_and(|d| !has_exited(d))
    }

    /// Whether it can start `generation` of a device whose launcher is at `epoch`.
    pub fn fits_all(&self, generation: u32, epoch: u64) -> bool {
        matches!(self.next, Next::All { generation: g, .. } if g == generation) && self.current(epoch)
    }

    /// Whether it can replace the driver domain below the tap domain on the lower queues of
    /// serial `serial`, for a launcher at `epoch`.
    pub fn fits_below(&self, serial: u64, epoch: u64) -> bool {
        matches!(self.next, Next::Below { serial: s, .. } if s == serial) && self.current(epoch)
    }

    /// Whether it still fits device `rt` as `slot` shows it.
    pub fn fits_slot(&self, rt: &DeviceRuntime, slot: &Slot) -> bool {
        let epoch = rt.launcher.epoch();
        match &slot.domains {
            Domains::Interpose { below, .. } => self.fits_below(below.serial, epoch),
            _ => self.fits_all(rt.device.generation().wrapping_add(1), epoch),
        }
    }

    /// Lets a standby of the whole generation serve: rings go (unless [`start_early`] did)
    /// and hands over what the launch made. The device's old domains must be gone.
    pub fn go(self) -> Result<Launched, Standby> {
        match self.next {
            Next::All { launched, .. } => {
                if !self.rung {
                    self.go.ring();
                }
                Ok(*launched)
            }
            next @ Next::Below { .. } => Err(Standby { next, ..self }),
        }
    }

    /// Wakes a standby driver domain for below the tap domain, which is starting the lower
    /// queues over as `generation`: it lets go of them on its line (it never held them) and
    /// waits, now awake, until [`Standby::attach_below`] lets it attach. Returns `Err(self)`
    /// for a standby of the whole generation.
    pub fn wake_below(mut self, generation: u32) -> Result<Standby, Standby> {
        match &self.next {
            Next::Below { line, .. } => {
                line.request_detach(generation);
                self.go.ring();
                self.rung = true;
                Ok(self)
            }
            Next::All { .. } => Err(self),
        }
    }

    /// Lets a standby woken by [`wake_below`](Self::wake_below) attach to the lower queues,
    /// which the tap domain has started over as `generation` and the old driver domain no
    /// longer holds. Returns the domain and the supervisor's end of its line.
    pub fn attach_below(self, generation: u32) -> Result<(Domain, AboveControl), Standby> {
        match self.next {
            Next::Below { driver, line, .. } if self.rung => {
                line.request_attach(generation);
                Ok((*driver, line))
            }
            next => Err(Standby { next, ..self }),
        }
    }

    /// Ends it, into `graveyard`.
    pub fn bury(self, device: &str, graveyard: &mut Graveyard) {
        match self.next {
            Next::All { launched, .. } => {
                let (domains, _) = { launched }.domains.take_all();
                for d in domains {
                    graveyard.bury(device, d);
                }
            }
            Next::Below { driver, .. } => graveyard.bury(device, *driver),
        }
    }

    /// Ends it, with a graveyard of its own (it borrowed no ring that holds work).
    pub fn dismiss(self, device: &str) {
        let mut g = Graveyard::default();
        self.bury(device, &mut g);
        g.wait_all(crate::reap::EXIT_WAIT);
    }
}

/// Lets device `rt`'s standby start at once, before the restart's job has even begun, when
/// what `disposition` replaces is a domain that has exited and left nothing to finish: it
/// held no borrowed ring with reads or writes that could still land, and the standby fits the
/// generation the job will start (no view leaves with it). The standby then opens its chain
/// while the job buries the old domain and installs its queues. Called by the watcher with the
/// device claimed for the job and its slot locked.
pub(crate) fn start_early(rt: &DeviceRuntime, slot: &mut Slot, disposition: &Disposition) {
    if !matches!(disposition, Disposition::Restart { which: Which::All, delay, .. } if delay.is_zero()) {
        return;
    }
    let exited = match &slot.domains {
        Domains::Passthrough { driver: d } | Domains::Intercept { tap: d } => d.rings.is_empty() && has_exited(d),
        Domains::None | Domains::Interpose { .. } => false,
    };
    if !exited || slot.graveyard.holds_rings() || rt.views_leaving() {
        return;
    }
    let generation = rt.device.generation().wrapping_add(1);
    if let Some(s) = slot.standby.as_mut().filter(|s| s.fits_all(generation, rt.launcher.epoch())) {
        s.go.ring();
        s.rung = true;
    }
}

/// Whether `d` has exited (its pidfd is readable).
fn has_exited(d: &Domain) -> bool {
    let mut pfd = [libc::pollfd { fd: std::os::fd::AsRawFd::as_raw_fd(&d.pidfd()), events: libc::POLLIN, revents: 0 }];
    bulkhead_sys::poll(&mut pfd, 0).is_ok_and(|n| n == 1)
}

/// Starts a standby for device `rt` if it wants one and has none, and keeps it if the device
/// is still as it was once the standby has reported. Runs on a worker, without the device's
/// claim: a restart that begins meanwhile takes the usual path, and the standby is ended.
pub(crate) fn prepare(rt: &DeviceRuntime, places: &Arc<Places>) {
    // What the standby is for, read under the lock: the next generation, or the lower queues
    // of an `interpose` device (their descriptors copied, so that the launch holds no lock).
    let (kind, epoch, place) = {
        let mut slot = rt.lock();
        if !wants(&slot) || !rt.launcher.standby_possible() {
            return;
        }
        // None ready: the watcher asks again later.
        if !rt.launcher.spare_ready() {
            return;
        }
        let kind = match &slot.domains {
            Domains::Interpose { below, .. } => match below.lower_fds() {
                Ok(fds) => Kind::Below { fds, nslots: below.nslots, arena_bytes: below.arena_bytes, serial: below.serial },
                Err(e) => {
                    log::warn!("device {}: no standby domain: {e}", rt.name);
                    return;
                }
            },
            _ => Kind::All(rt.device.generation().wrapping_add(1)),
        };
        let Some(place) = places.take() else { return };
        slot.standby_preparing = true;
        (kind, rt.launcher.epoch(), place)
    };
    let standby = make(rt, kind, epoch, place);
    let mut slot = rt.lock();
    slot.standby_preparing = false;
    let Some(standby) = standby else { return };
    let still = !slot.busy && slot.standby.is_none() && slot.life.state() == DeviceState::Running && standby.fits_slot(rt, &slot);
    if still {
        slot.standby = Some(standby);
        return;
    }
    drop(slot);
    standby.dismiss(&rt.name);
}

/// Whether device `rt`, as `slot` shows it, wants a standby made now: it has restarted, runs,
/// has none and is making none.
pub(crate) fn wants(slot: &Slot) -> bool {
    slot.standby_wanted
        && !slot.busy
        && slot.standby.is_none()
        && !slot.standby_preparing
        && slot.life.state() == DeviceState::Running
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
        Kind::All(generation) => rt.launcher.launch_standby(generation, &go).map(|launched| Next::All { launched: Box::new(launched), generation }),
        Kind::Below { fds, nslots, arena_bytes, serial } => rt.launcher.driver_line().and_then(|line| {
            let driver = rt.launcher.spawn_below_from(fds, nslots, arena_bytes, &line, None, Some(&go))?;
            Ok(Next::Below { driver: Box::new(driver), line, serial })
        }),
    };
    match next {
        Ok(next) => Some(Standby { next, go, rung: false, epoch, _place: place }),
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
}
