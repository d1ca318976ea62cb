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
//! - [`Next::Tap`]: a tap domain for above an `interpose` device's driver domain, on both its
//!   channels: the queues above mapped as any domain maps them, the queues below adopted
//!   without a byte written. When the tap domain dies and the driver domain below has let go
//!   of the lower queues, the standby is told their next generation on a line of its own and
//!   rung: it starts them over while the frontend starts the queues above over in place, then
//!   attaches above once the line names the frontend's generation. An `interpose` device keeps
//!   it beside a standby below, each in a place of its own.
//!
//! A standby fits the restart it was made for only: that generation (or those channels)
//! of a device whose chain, views and activity are as they were when it started
//! ([`Launcher::epoch`]). One that no longer fits, or has died, is buried and the restart
//! takes the usual path. Only devices whose backend reads nothing of its storage before
//! serving (`ram`, `null`, a raw `file`) keep one; `[domains] standbys` bounds how many devices
//! do at once.
//!
//! [`Launcher::epoch`]: crate::launcher::Launcher::epoch

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use bulkhead_channel::{AboveControl, BelowControl};
use bulkhead_sys::eventfd::EventFd;

use crate::domains::{Domain, Graveyard};
use crate::launcher::Launched;

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
    pub fn take(self: &Arc<Self>) -> Option<Place> {
        self.held
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| (n < self.most).then_some(n + 1))
            .ok()
            .map(|_| Place(self.clone()))
    }
}

/// One standby's place among [`Places`]: given back when the standby is used or ended.
#[derive(Debug)]
pub(crate) struct Place(Arc<Places>);

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
    /// A tap domain for above the driver domain of an `interpose` device, on the channels of
    /// [`Below::serial`] `serial` (both of them mapped, neither written), with its own line about
    /// the domain below.
    ///
    /// [`Below::serial`]: crate::domains::Below::serial
    Tap { tap: Box<Domain>, line: BelowControl, serial: u64 },
}

/// A device's next domain, launched and waiting for go.
#[derive(Debug)]
pub(crate) struct Standby {
    next: Next,
    go: EventFd,
    /// Go was rung ahead of the restart ([`start_early`](crate::standing_by::start_early)): from then on the standby serves or
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
            Next::Below { driver: d, .. } | Next::Tap { tap: d, .. } => Some(&**d),
        }
    }

    /// The waiting domain's process id.
    pub fn pid(&self) -> u32 {
        self.domain().map_or(0, Domain::pid)
    }

    /// Whether go was rung ahead of the restart ([`start_early`](crate::standing_by::start_early)).
    pub fn rung(&self) -> bool {
        self.rung
    }

    /// A standby of `next`, waiting for `go`, made under the launcher's `epoch` in `place`.
    pub fn new(next: Next, go: EventFd, epoch: u64, place: Place) -> Standby {
        Standby { next, go, rung: false, epoch, _place: place }
    }

    /// Rings go ahead of the restart ([`start_early`](crate::standing_by::start_early)).
    pub fn ring_early(&mut self) {
        self.go.ring();
        self.rung = true;
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

    /// Whether it can replace the tap domain over the driver domain on the channels of serial
    /// `serial`, for a launcher at `epoch`.
    pub fn fits_tap(&self, serial: u64, epoch: u64) -> bool {
        matches!(self.next, Next::Tap { serial: s, .. } if s == serial) && self.current(epoch)
    }

    /// Whether it is a tap domain ([`Next::Tap`]).
    pub fn is_tap(&self) -> bool {
        matches!(self.next, Next::Tap { .. })
    }

    /// Lets a standby tap domain take over: the tap domain before it is gone and the driver
    /// domain below has let go of the channel below. Asks it on its line to start that channel
    /// over as `below` and rings go; it says on the line when it has, and attaches to the
    /// channel above once [`BelowControl::allow_above`] names the generation the frontend
    /// started it over as. Returns the domain and the supervisor's end of its line; `Err(self)`
    /// for another kind.
    pub fn take_over(self, below: u32) -> Result<(Domain, BelowControl), Standby> {
        match self.next {
            Next::Tap { tap, line, .. } => {
                line.request_restart(below);
                self.go.ring();
                Ok((*tap, line))
            }
            next => Err(Standby { next, ..self }),
        }
    }

    /// Lets a standby of the whole generation serve: rings go (unless [`start_early`](crate::standing_by::start_early) did)
    /// and hands over what the launch made. The device's old domains must be gone.
    pub fn go(self) -> Result<Launched, Standby> {
        match self.next {
            Next::All { launched, .. } => {
                if !self.rung {
                    self.go.ring();
                }
                Ok(*launched)
            }
            next @ (Next::Below { .. } | Next::Tap { .. }) => Err(Standby { next, ..self }),
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
            Next::All { .. } | Next::Tap { .. } => Err(self),
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
            Next::Below { driver: d, .. } | Next::Tap { tap: d, .. } => graveyard.bury(device, *d),
        }
    }

    /// Ends it, with a graveyard of its own (it borrowed no ring that holds work).
    pub fn dismiss(self, device: &str) {
        let mut g = Graveyard::default();
        self.bury(device, &mut g);
        g.wait_all(crate::reap::EXIT_WAIT);
    }
}

/// Whether `d` has exited (its pidfd is readable).
pub(crate) fn has_exited(d: &Domain) -> bool {
    let mut pfd = [libc::pollfd { fd: std::os::fd::AsRawFd::as_raw_fd(&d.pidfd()), events: libc::POLLIN, revents: 0 }];
    bulkhead_sys::poll(&mut pfd, 0).is_ok_and(|n| n == 1)
}
