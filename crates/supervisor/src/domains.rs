//! A device's running domains, as one value per tap mode, and the graveyard of killed ones
//! until they are reaped and what they left in the kernel has completed.

use std::os::fd::{AsFd, BorrowedFd};
use std::time::{Duration, Instant};

use bulkhead_channel::{AboveControl, BackQueueFds, BelowControl, LowerQueue};
use bulkhead_sandbox::spawn::DomainChild;
use bulkhead_sandbox::Layers;
use bulkhead_sys::uring::RingWatch;

use crate::spawn::{finish_or_release, EXIT_WAIT};
use crate::state::{Role, Shape};

/// How long a restart waits for the reads and writes a dead domain left in the kernel (on a
/// ring it borrowed) to complete before it starts the next generation anyway, and says so.
pub(crate) const DRAIN_WAIT: Duration = Duration::from_secs(30);

/// One domain process.
#[derive(Debug)]
pub(crate) struct Domain {
    pub child: DomainChild,
    /// Its sandbox layers, as it reported them (`None`: it said nothing in time).
    pub layers: Option<Layers>,
    /// Rings its backend borrowed from the supervisor.
    pub rings: Vec<RingWatch>,
}

impl Domain {
    /// Its process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Its pidfd: readable once it has exited.
    pub fn pidfd(&self) -> BorrowedFd<'_> {
        self.child.pidfd().as_fd()
    }
}

/// The channel between a tap domain and the driver domain below it: its queues (which a new
/// domain below attaches to when the old one dies), the line to the tap domain about that, and
/// the generation of the domain below; and what a new tap domain over the same driver domain
/// needs: the tap domain's descriptors of the channel above, and the line to the driver domain
/// about the switch.
#[derive(Debug)]
pub(crate) struct Below {
    pub queues: Vec<LowerQueue>,
    pub control: BelowControl,
    pub generation: u32,
    /// The tap domain's end of each queue of the channel above.
    pub tap_fds: Vec<BackQueueFds>,
    /// The line to the driver domain about replacing the tap domain above it.
    pub driver_line: AboveControl,
    pub nslots: u32,
    pub arena_bytes: u64,
    /// Names these lower queues among all a launcher makes: a standby driver domain made for
    /// them fits them alone ([`crate::standby`]).
    pub serial: u64,
}

impl Below {
    /// The driver domain's end of each lower queue, copied.
    pub fn lower_fds(&self) -> Result<Vec<BackQueueFds>, bulkhead_channel::ChannelError> {
        self.queues.iter().map(LowerQueue::back_fds).collect()
    }

    /// The tap domain's ends of both channels, copied, with the generation below now.
    pub fn tap_queues(&self) -> Result<TapQueues, bulkhead_channel::ChannelError> {
        Ok(TapQueues {
            above: self.tap_fds.iter().map(BackQueueFds::try_clone).collect::<Result<_, _>>()?,
            below: self.queues.iter().map(LowerQueue::front_fds).collect::<Result<_, _>>()?,
            nslots: self.nslots,
            arena_bytes: self.arena_bytes,
            generation: self.generation,
        })
    }

    /// Wakes the tap domain wherever it waits (its loop, or a response from below).
    pub fn wake_tap(&self) {
        for q in &self.queues {
            q.interrupt_front();
        }
    }
}

/// What a tap domain is given of the channels of a [`Below`]: its end of each queue above and
/// of each queue below (`nslots` slots, arenas of `arena_bytes`), the latter of `generation`.
#[derive(Debug)]
pub(crate) struct TapQueues {
    pub above: Vec<BackQueueFds>,
    pub below: Vec<bulkhead_channel::ForwardQueueFds>,
    pub nslots: u32,
    pub arena_bytes: u64,
    pub generation: u32,
}

/// A device's running domains: one variant per tap mode.
// One per device, moved only when a job takes it out or puts it back: the size costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Default)]
pub(crate) enum Domains {
    /// None runs: between generations, while reconnecting, failed or stopped.
    #[default]
    None,
    /// One driver domain runs the filters and the backend.
    Passthrough { driver: Domain },
    /// A tap domain runs the filters over a driver domain of its own, on the channel `below`.
    Interpose { tap: Domain, driver: Domain, below: Below },
    /// One tap domain runs the filters and ends in the soft device.
    Intercept { tap: Domain },
}

/// What `status` shows of a device's domains: recorded when a generation is installed, so it
/// is read without waiting while the domains are being replaced.
#[derive(Debug, Clone, Default)]
pub(crate) struct Faces {
    /// The domain that runs the backend (0: none).
    pub driver_pid: u32,
    pub driver_layers: Option<Layers>,
    /// The tap domain (interpose and intercept; in intercept it is the driver too).
    pub tap_pid: Option<u32>,
    pub tap_layers: Option<Layers>,
}

impl Domains {
    /// The layout, or `None` when nothing runs.
    pub fn shape(&self) -> Option<Shape> {
        match self {
            Domains::None => None,
            Domains::Passthrough { .. } => Some(Shape::Passthrough),
            Domains::Interpose { .. } => Some(Shape::Interpose),
            Domains::Intercept { .. } => Some(Shape::Intercept),
        }
    }

    /// The domain the frontend reaches.
    pub fn top(&self) -> Option<&Domain> {
        match self {
            Domains::None => None,
            Domains::Passthrough { driver: top } | Domains::Interpose { tap: top, .. } | Domains::Intercept { tap: top } => {
                Some(top)
            }
        }
    }

    /// The domain `role` names.
    pub fn get(&self, role: Role) -> Option<&Domain> {
        match (self, role) {
            (_, Role::Top) => self.top(),
            (Domains::Interpose { driver, .. }, Role::Below) => Some(driver),
            (_, Role::Below) => None,
        }
    }

    /// The domain `role` names, to reap.
    pub fn get_mut(&mut self, role: Role) -> Option<&mut Domain> {
        match (self, role) {
            (Domains::None, _) => None,
            (
                Domains::Passthrough { driver: top } | Domains::Interpose { tap: top, .. } | Domains::Intercept { tap: top },
                Role::Top,
            ) => Some(top),
            (Domains::Interpose { driver, .. }, Role::Below) => Some(driver),
            (_, Role::Below) => None,
        }
    }

    /// What `status` shows of them.
    pub fn faces(&self) -> Faces {
        let face = |d: &Domain| (d.pid(), d.layers.clone());
        match self {
            Domains::None => Faces::default(),
            Domains::Passthrough { driver } => {
                let (driver_pid, driver_layers) = face(driver);
                Faces { driver_pid, driver_layers, ..Faces::default() }
            }
            Domains::Interpose { tap, driver, .. } => {
                let ((driver_pid, driver_layers), (tap_pid, tap_layers)) = (face(driver), face(tap));
                Faces { driver_pid, driver_layers, tap_pid: Some(tap_pid), tap_layers }
            }
            Domains::Intercept { tap } => {
                let (pid, layers) = face(tap);
                Faces { driver_pid: pid, driver_layers: layers.clone(), tap_pid: Some(pid), tap_layers: layers }
            }
        }
    }

    /// Every domain, each with its role.
    pub fn each(&self) -> impl Iterator<Item = (Role, &Domain)> {
        let (top, below) = match self {
            Domains::None => (None, None),
            Domains::Passthrough { driver: top } | Domains::Intercept { tap: top } => (Some(top), None),
            Domains::Interpose { tap, driver, .. } => (Some(tap), Some(driver)),
        };
        top.map(|d| (Role::Top, d)).into_iter().chain(below.map(|d| (Role::Below, d)))
    }

    /// Takes every domain out, leaving `None`: the domains and the channel between them.
    pub fn take_all(&mut self) -> (Vec<Domain>, Option<Below>) {
        match std::mem::take(self) {
            Domains::None => (Vec::new(), None),
            Domains::Passthrough { driver } => (vec![driver], None),
            Domains::Interpose { tap, driver, below } => (vec![tap, driver], Some(below)),
            Domains::Intercept { tap } => (vec![tap], None),
        }
    }
}

/// Killed domains that had not finished exiting when they were replaced, and the rings of
/// domains that are gone, kept until the requests those domains left in the kernel have
/// completed.
#[derive(Debug, Default)]
pub(crate) struct Graveyard {
    lingering: Vec<DomainChild>,
    retired: Vec<RingWatch>,
}

impl Graveyard {
    /// Kills `d` and reaps it if it exits within [`EXIT_WAIT`]. One that has released its
    /// memory but not finished exiting (the kernel finishing work for it through this very
    /// device: [`crate::proc_info::memory_released`]) can touch nothing any more: it is kept,
    /// to be reaped once the next generation lets that work end. One still running after the
    /// wait is kept too, and said so. Its rings are retired.
    pub fn bury(&mut self, device: &str, d: Domain) {
        self.retired.extend(d.rings);
        let mut c = d.child;
        let _ = c.kill();
        if !finish_or_release(&mut c) {
            log::warn!(
                "device {device}: killed domain (pid {}) has not finished exiting after {} ms; \
                 carrying on without it",
                c.id(),
                EXIT_WAIT.as_millis()
            );
        }
        if c.try_wait().ok().flatten().is_none() {
            self.lingering.push(c);
        }
    }

    /// Reaps the domains that have exited since.
    pub fn reap(&mut self) {
        self.lingering.retain_mut(|c| !matches!(c.try_wait(), Ok(Some(_)) | Err(_)));
    }

    /// Whether it keeps rings of dead domains whose reads and writes may not have completed.
    pub fn holds_rings(&self) -> bool {
        !self.retired.is_empty()
    }

    /// Whether it keeps anything.
    pub fn is_empty(&self) -> bool {
        self.lingering.is_empty() && self.retired.is_empty()
    }

    /// Waits until every read and write that buried domains started on their borrowed rings
    /// has completed, up to [`DRAIN_WAIT`]. A direct write the disk has not finished outlives
    /// the process that issued it; landing after the next generation wrote newer data at the
    /// same place, it would undo an acknowledged write (and a late read would fill a buffer
    /// since reused). So no new generation starts while one is in flight. Killed domains still
    /// running (stuck in the kernel) are waited for too: they may yet submit what they hold.
    pub fn drain(&mut self, device: &str) {
        if self.retired.is_empty() {
            return;
        }
        let start = Instant::now();
        let mut said = start;
        let mut pause = Duration::from_micros(50);
        loop {
            self.reap();
            let running = self.lingering.iter().filter(|c| !crate::proc_info::memory_released(c.id())).count();
            let left: u32 = self.retired.iter().map(RingWatch::settle).sum();
            if left == 0 && running == 0 {
                break;
            }
            if start.elapsed() >= DRAIN_WAIT {
                log::warn!(
                    "device {device}: {left} reads or writes of a dead domain are still in the kernel \
                     after {} s ({running} killed domain(s) still running); starting the next generation anyway: \
                     a late write may land over a newer one",
                    DRAIN_WAIT.as_secs()
                );
                break;
            }
            if said.elapsed() >= Duration::from_secs(2) {
                log::info!(
                    "device {device}: waiting for {left} reads or writes a dead domain left in the kernel \
                     ({} ms so far)",
                    start.elapsed().as_millis()
                );
                said = Instant::now();
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(5));
        }
        self.retired.clear();
    }

    /// Waits up to `each` for every lingering domain to finish exiting (at shutdown).
    pub fn wait_all(&mut self, each: Duration) {
        for c in &mut self.lingering {
            let _ = c.wait_timeout(each);
        }
        self.reap();
    }
}
