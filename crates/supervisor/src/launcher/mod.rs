//! Launching a device's domains: the backend's storage, opened once when the device starts,
//! and for each generation new queues and the domains holding them, exec'd and confined.

use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bulkhead_channel::{AboveControl, BelowControl, BudgetPolicy, FrontQueue, LowerQueue, NotifyMode, QueueConfig, QueueSetup};
use bulkhead_config::{BackendConfig, DeviceConfig, Engine, ImageFormat, Notify, SpinBudget, Tap};
use bulkhead_filters::FilterSpec;
use bulkhead_sandbox::Policy;

use crate::chain::{ChainSetup, FilterSetup};
use crate::domains::{Below, Domains};
use crate::error::Error;
use crate::spares::Spares;
use crate::spawn::discard;
use crate::state::Shape;
use crate::storage::{auto_engine, connect_nbd, Storage};
use crate::views::ViewSetup;

mod probe;
mod spawn;

use spawn::Pass;

/// How long a read through a domain started to read a LUKS header may take, at least, ms.
const PROBE_TIMEOUT_MS: u64 = 10_000;

/// How long a domain started only to learn an image's size has to stop once asked.
const PROBE_STOP: Duration = Duration::from_secs(5);

/// Spins a frontend waiting on a tap domain makes before it yields between looks (about 10 µs).
const FRONTEND_YIELD_AFTER_SPINS: u32 = 2048;

/// A launched generation: its frontend queues (the device's, then each view's), its domains,
/// and the supervisor's end of the attach line of the domain that takes attached queues.
#[derive(Debug)]
pub(crate) struct Launched {
    pub fronts: Vec<FrontQueue>,
    pub domains: Domains,
    pub attach_line: Option<OwnedFd>,
}

/// Everything needed to launch another generation of a device's domains.
#[derive(Debug)]
pub(crate) struct Launcher {
    name: String,
    mode: NotifyMode,
    /// The device's queues and its views, as the next generation lays them out; changed on a
    /// running device by `bulkhead view add` and `view remove`. Each launch takes a copy.
    layout: Mutex<Layout>,
    qcfg: QueueConfig,
    /// Bytes the frontend sees, above the filters.
    size: u64,
    /// Bytes of the backend, below them (more than `size` under a `crypt` filter's header).
    backend_size: u64,
    backend: BackendConfig,
    /// The backend, described for status.
    pub(crate) backend_desc: String,
    exe: PathBuf,
    /// The backend's descriptors and whether the device writes; reopened when the device is
    /// activated or deactivated. Each launch takes a copy.
    held: Mutex<Arc<Held>>,
    policy: Policy,
    /// The domain's bound on waiting for a remote server, ms.
    io_timeout_ms: u64,
    /// Where the filters run and the filters; changed on a running device by `bulkhead device tap`,
    /// `bulkhead filter` and `bulkhead snapshot`, taking effect with the next generation. Each
    /// launch takes a copy, so nothing waits on it while a domain starts.
    chain: Mutex<ChainSetup>,
    /// The state page of the domain the frontend reaches.
    state_fd: OwnedFd,
    /// The state page of the domain below a tap domain.
    below_state_fd: OwnedFd,
    /// The device's place in the configuration (for trace device numbers).
    pub(crate) index: u32,
    /// A `vdev` device's card and its model's domain.
    pub(crate) card: Option<crate::vdev::CardDevice>,
    /// An `rbd` device's cluster addresses, and what its domains said once they had opened the image.
    rbd: Option<(crate::rbd::Reach, crate::rbd::Opened)>,
    /// The spare domains its domains may be made from (`None`: each is exec'd).
    spares: Option<Arc<Spares>>,
    /// Bumped by every change the next generation would see (its chain, its layout, whether
    /// it writes): a standby made before one no longer fits ([`crate::standby`]).
    epoch: AtomicU64,
    /// Lower queues made so far (`interpose`), each set's [`Below::serial`].
    belows: AtomicU64,
}

/// The backend's descriptors as the supervisor holds them, and whether the device writes.
#[derive(Debug)]
pub(crate) struct Held {
    /// The device writes. Inactive, its storage is opened read-only (a file, an image) and
    /// its domains refuse writes (`DomainSpec::inactive`); an rbd domain opens the image
    /// read-only and takes no lock.
    pub active: bool,
    /// Descriptors kept while the device runs as it is (ramdisk memfd, backing files): every
    /// generation of the domain gets the same ones, so a restart keeps the contents.
    pub fds: Vec<OwnedFd>,
    /// The format of each of `fds` for a disk image (the image, then its backing files).
    pub formats: Vec<bulkhead_image::Format>,
}

/// How a generation lays out the device's queues: the device's own, then each view's; and
/// the slots for attached applications' queues, likewise.
#[derive(Debug, Clone)]
pub(crate) struct Layout {
    /// Queues of the device's own.
    pub queues: usize,
    /// Attach slots of the device's own.
    pub attach: usize,
    /// The views, in the order of their queues, slots and state page entries.
    pub views: Vec<ViewSetup>,
}

impl Layout {
    /// The view each queue of a generation serves (`None`: the device's own).
    pub fn lanes(&self) -> Vec<Option<u32>> {
        let views = self.views.iter().enumerate().flat_map(|(i, v)| std::iter::repeat_n(Some(i as u32), v.queues));
        std::iter::repeat_n(None, self.queues).chain(views).collect()
    }

    /// The view each attach slot serves (`None`: the device).
    pub fn attach_slots(&self) -> Vec<Option<u32>> {
        let views = self.views.iter().enumerate().flat_map(|(i, v)| std::iter::repeat_n(Some(i as u32), v.attach));
        std::iter::repeat_n(None, self.attach).chain(views).collect()
    }

    /// The index of view `name`.
    pub fn find(&self, name: &str) -> Option<usize> {
        self.views.iter().position(|v| v.name == name)
    }
}

impl Launcher {
    /// Opens the backend's storage for `cfg` (the domain opens nothing) and what its filters
    /// need, and resolves its views: everything but the first launch. `state_fds` are the
    /// state pages of the domain the frontend reaches and of the domain below a tap domain.
    pub(crate) fn open(
        cfg: &DeviceConfig,
        index: u32,
        exe: &Path,
        keep: &crate::kept::Keep,
        state_fds: [OwnedFd; 2],
        spares: &Arc<Spares>,
    ) -> Result<Launcher, Error> {
        let [state_fd, below_state_fd] = state_fds;
        let name = cfg.name.get_ref().clone();
        let mode = notify_mode(cfg.notify);
        let budget = match cfg.spin_budget_us {
            SpinBudget::Auto => BudgetPolicy::DEFAULT_AUTO,
            SpinBudget::Micros(us) => BudgetPolicy::Fixed(us * 1000),
        };
        let sandbox = match cfg.sandbox {
            bulkhead_config::Sandbox::Required => Policy::Required,
            bulkhead_config::Sandbox::BestEffort => Policy::BestEffort,
            bulkhead_config::Sandbox::Off => Policy::Off,
        };
        let mut backend = cfg.backend.resolve();
        if let BackendConfig::File { engine: engine @ Engine::Auto, format: ImageFormat::Raw, path, .. } = &mut backend {
            *engine = auto_engine(&name, path);
        }
        let active = cfg.starts_active();
        let storage = Storage::open(&name, cfg, &backend, active, sandbox, exe, keep)?;
        // An rbd domain loads librados's plug-ins from the host's files as it connects, before
        // it confines itself, and a spare's root is empty already; a domain without a sandbox
        // is exec'd as it is.
        let spares = (!matches!(backend, BackendConfig::Rbd { .. }) && sandbox != Policy::Off).then(|| spares.clone());
        // Filter state pages and outputs, opened here: the domain opens nothing.
        let mut filters = Vec::new();
        for (i, f) in cfg.filters().into_iter().enumerate() {
            filters.push(FilterSetup::new(&name, index, f).map_err(|e| e.context(format!("filter {}", i + 1)))?);
        }
        let nqueues = *cfg.queues.get_ref() as usize;
        let mut launcher = Launcher {
            name: name.clone(),
            mode,
            layout: Mutex::new(Layout { queues: nqueues, attach: cfg.attach_slots() as usize, views: Vec::new() }),
            qcfg: QueueConfig {
                nslots: *cfg.queue_depth.get_ref(),
                arena_bytes: cfg.arena.get_ref().0 as usize,
                mode,
                budget,
                generation: 1,
            },
            size: storage.size,
            backend_size: storage.size,
            backend,
            backend_desc: storage.desc,
            exe: exe.to_path_buf(),
            held: Mutex::new(Arc::new(Held { active, fds: storage.fds, formats: storage.formats })),
            io_timeout_ms: cfg.watchdog_ms(),
            chain: Mutex::new(ChainSetup { tap: Tap::Passthrough, filters: Vec::new(), snapshot: None }),
            state_fd,
            below_state_fd,
            index,
            policy: sandbox,
            card: storage.card,
            spares,
            rbd: storage.rbd,
            epoch: AtomicU64::new(0),
            belows: AtomicU64::new(0),
        };
        if let (Some(_), None) = (&launcher.rbd, &cfg.size) {
            let bytes = launcher.learn_image_size()?;
            (launcher.size, launcher.backend_size) = (bytes, bytes);
        }
        let size = launcher.prepare_filters(filters, cfg.tap)?;
        // Views, against the size the filters leave: each adds queues of its own.
        launcher.layout.get_mut().unwrap_or_else(|e| e.into_inner()).views = ViewSetup::resolve(&name, &cfg.views, size)?;
        Ok(launcher)
    }

    /// Tells a spare that a domain of this device will be wanted shortly (a restart has
    /// begun), so that it is awake when it is given the device.
    pub(crate) fn expect_launch(&self) {
        if let Some(s) = &self.spares {
            s.expect();
        }
    }

    /// Bytes the frontend sees.
    pub(crate) fn size(&self) -> u64 {
        self.size
    }

    /// Notification mode.
    pub(crate) fn mode(&self) -> NotifyMode {
        self.mode
    }

    /// The geometry and policy of the device's queues.
    pub(crate) fn queue_config(&self) -> QueueConfig {
        self.qcfg
    }

    /// The backend's descriptors and whether the device writes, as the next generation gets
    /// them.
    pub(crate) fn held(&self) -> Arc<Held> {
        self.held.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Makes the next generation write (`active`) or not: a file or an image is opened again,
    /// read-only or not, and must still be the size it was. Nothing changes if it cannot be.
    /// The caller holds the device's claim and ends the running generation itself.
    pub(crate) fn set_active(&self, active: bool) -> Result<(), Error> {
        let mut held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        if held.active == active {
            return Ok(());
        }
        let (fds, formats) = match &self.backend {
            BackendConfig::File { .. } => {
                let s = Storage::reopen(&self.backend, active, Some(self.backend_size))
                    .ok_or_else(|| Error::failed("a file backend is opened again by Storage::reopen"))??;
                if s.size != self.backend_size {
                    return Err(Error::invalid(format!(
                        "{} is {} bytes now, and the device is {}: the storage changed under it",
                        self.backend_desc, s.size, self.backend_size
                    )));
                }
                (s.fds, s.formats)
            }
            // The same memory, connection or cluster: the domains open it as the spec says.
            _ => (held.fds.iter().map(|fd| fd.try_clone()).collect::<Result<_, _>>().map_err(failed)?, held.formats.clone()),
        };
        *held = Arc::new(Held { active, fds, formats });
        self.epoch.fetch_add(1, Ordering::AcqRel);
        Ok(())
    }

    /// How many changes the next generation has seen: chain, layout, activity.
    pub(crate) fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::Acquire)
    }

    /// A copy of the chain as the next generation will run it.
    pub(crate) fn chain(&self) -> ChainSetup {
        self.chain.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// A copy of the layout the next generation runs.
    pub(crate) fn layout(&self) -> Layout {
        self.layout.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Changes the layout for the next generation (the caller holds the device's claim).
    pub(crate) fn change_layout<T>(&self, change: impl FnOnce(&mut Layout) -> T) -> T {
        let out = change(&mut self.layout.lock().unwrap_or_else(|e| e.into_inner()));
        self.epoch.fetch_add(1, Ordering::AcqRel);
        out
    }

    /// Changes the chain for the next generation: `change` edits it and says what it did, or
    /// refuses (and the chain stays as it was).
    pub(crate) fn change_chain<T>(&self, change: impl FnOnce(&mut ChainSetup) -> Result<T, Error>) -> Result<T, Error> {
        let mut chain = self.chain.lock().unwrap_or_else(|e| e.into_inner());
        let mut next = chain.clone();
        let out = change(&mut next)?;
        *chain = next;
        self.epoch.fetch_add(1, Ordering::AcqRel);
        Ok(out)
    }

    /// The smallest block the chain takes: a `crypt` filter's sector, or 1.
    pub(crate) fn min_block(&self) -> u32 {
        let chain = self.chain.lock().unwrap_or_else(|e| e.into_inner());
        chain
            .filters
            .iter()
            .filter_map(|f| match f.spec {
                FilterSpec::Crypt { sector_size, .. } => Some(sector_size),
                _ => None,
            })
            .max()
            .unwrap_or(1)
    }

    /// An `rbd` device's cluster addresses and what its domains said once they had opened the
    /// image.
    fn rbd(&self) -> Result<&(crate::rbd::Reach, crate::rbd::Opened), Error> {
        self.rbd.as_ref().ok_or_else(|| Error::failed("an rbd device has its cluster's addresses"))
    }

    /// How long to keep reconnecting to a lost remote server; `None` for local backends.
    pub(crate) fn reconnect_timeout(&self) -> Option<Duration> {
        match &self.backend {
            BackendConfig::Nbd { reconnect_timeout_ms, .. } | BackendConfig::Rbd { reconnect_timeout_ms, .. } => {
                Some(Duration::from_millis(*reconnect_timeout_ms))
            }
            _ => None,
        }
    }

    /// A fresh connection for a remote backend (each generation of its domain gets one).
    fn connect(&self) -> Result<Option<OwnedFd>, Error> {
        match &self.backend {
            BackendConfig::Nbd { uri, target, connect_timeout_ms, .. } => {
                Ok(Some(connect_nbd(target, Duration::from_millis(*connect_timeout_ms)).map_err(|e| e.context(uri))?))
            }
            // The domain connects itself (through the broker); a cluster whose monitors cannot
            // be reached gets no domain.
            BackendConfig::Rbd { mon_host, connect_timeout_ms, .. } => {
                let (reach, _) = self.rbd()?;
                reach
                    .probe(Duration::from_millis(*connect_timeout_ms))
                    .map_err(|e| e.context(format!("cluster at {mon_host}")))?;
                Ok(None)
            }
            _ => Ok(None),
        }
    }

    /// Creates the queues of `generation` and execs the domains holding them and the backend,
    /// laid out as the chain's tap mode says.
    pub(crate) fn launch(&self, generation: u32) -> Result<Launched, Error> {
        self.launch_as(generation, None)
    }

    /// Whether the device may keep a standby ([`crate::standby`]): its backend reads nothing of its storage before it serves (a qcow2 image's tables, read
    /// while it is built, could change under a standby while the running domain writes; a
    /// remote connection would sit idle), and its domains may come from spares (a standby is
    /// a spare given its device early, never an exec).
    pub(crate) fn standby_possible(&self) -> bool {
        let local = match &self.backend {
            BackendConfig::Ram | BackendConfig::Null => true,
            BackendConfig::File { format, .. } => *format == ImageFormat::Raw,
            BackendConfig::Nbd { .. } | BackendConfig::Rbd { .. } | BackendConfig::Vdev { .. } => false,
        };
        local && self.spares.is_some() && self.card.is_none()
    }

    /// Whether a spare is ready now to become a standby.
    pub(crate) fn spare_ready(&self) -> bool {
        self.spares.as_ref().is_some_and(|s| s.counts().ready > 0)
    }

    /// Launches `generation` as a standby: its domain builds, confines itself and reports,
    /// then waits until `go` is rung (see [`crate::standby`]).
    pub(crate) fn launch_standby(&self, generation: u32, go: &bulkhead_sys::eventfd::EventFd) -> Result<Launched, Error> {
        if !self.standby_possible() {
            return Err(Error::failed("this device's domains are not started ahead"));
        }
        self.launch_as(generation, Some(go))
    }

    /// Trims what the filters' outputs hold to whole records, as each launch does: for a
    /// standby, once the domain before it is gone.
    pub(crate) fn trim_outputs(&self) {
        for f in &self.chain().filters {
            f.trim_output();
        }
    }

    /// [`launch`](Self::launch), as a standby waiting for `go` if given one (one domain only).
    fn launch_as(&self, generation: u32, go: Option<&bulkhead_sys::eventfd::EventFd>) -> Result<Launched, Error> {
        let conn = self.connect()?;
        let layout = self.layout();
        let lanes = layout.lanes();
        let qcfg = QueueConfig { generation, ..self.qcfg };
        let arena = |f: &FrontQueue| f.arena_bytes() as u64;
        let chain = self.chain();
        let shape = Shape::of(chain.tap);
        // A chain that changes what the device holds keeps the channel above from the domain
        // below: the application's data is the tap domain's alone (see `LowerQueue`).
        let private = chain.filters.iter().any(|f| f.spec.transforms());
        if shape == Shape::Intercept {
            self.soft_terminal()?;
        }
        let mut upper = Pass::default();
        let mut fronts = Vec::new();
        let mut queue_specs = Vec::new();
        // With a tap domain, the channel below it shares the arenas of the channel above, queue
        // for queue: only its queue files and doorbells are new.
        let mut lowers = Vec::new();
        let mut tap_fds = Vec::new();
        for q in 0..lanes.len() {
            let (front, fds) = QueueSetup::create(&format!("{}-q{q}", self.name), &qcfg).map_err(failed)?;
            if shape == Shape::Interpose {
                lowers.push(LowerQueue::create(&format!("{}-lower-q{q}", self.name), &qcfg, &fds, private).map_err(failed)?);
                tap_fds.push(fds);
            } else {
                let bulkhead_channel::BackQueueFds { ring, write_arena, read_arena, kick, irq } = fds;
                queue_specs.push(upper.queue([ring, write_arena, read_arena, kick, irq], qcfg.nslots, arena(&front)));
            }
            fronts.push(front);
        }
        match shape {
            Shape::Passthrough | Shape::Intercept => {
                // One domain: the backend's own (passthrough), or a tap domain whose chain ends
                // in the soft device itself (intercept).
                let (backend, ring) = self.backend_spec(&mut upper, conn)?;
                let role = shape.top_role();
                let (mut top, attach_line) = self.spawn(role, upper, queue_specs, backend, Some(&chain), None, go)?;
                top.rings.extend(ring);
                let domains = match shape {
                    Shape::Intercept => Domains::Intercept { tap: top },
                    _ => Domains::Passthrough { driver: top },
                };
                Ok(Launched { fronts, domains, attach_line })
            }
            // Its standby is a driver domain below the running tap domain (`spawn_below_from`).
            Shape::Interpose if go.is_some() => Err(Error::failed("an interpose device's generation is not started ahead")),
            Shape::Interpose => {
                // Three spinners (this frontend, the tap domain, the driver domain) may share
                // two CPUs: a wait that has spun a while lets a thread runnable on its CPU go
                // first.
                for f in &mut fronts {
                    f.set_yield_after(FRONTEND_YIELD_AFTER_SPINS);
                }
                let below = Below {
                    queues: lowers,
                    control: self.tap_line()?,
                    generation,
                    tap_fds,
                    driver_line: self.driver_line()?,
                    nslots: qcfg.nslots,
                    arena_bytes: arena(&fronts[0]),
                    serial: self.belows.fetch_add(1, Ordering::Relaxed),
                };
                let tap = self.spawn_tap(&below, &chain)?;
                // The tap domain has written the lower queues' headers (it reports once
                // confined): start the domain below.
                match self.spawn_below(&below, conn) {
                    Ok(driver) => Ok(Launched { fronts, domains: Domains::Interpose { tap, driver, below }, attach_line: None }),
                    Err(e) => {
                        discard(tap.child);
                        Err(e)
                    }
                }
            }
        }
    }

    /// A new line to a tap domain about the domain below it (one for each tap domain).
    pub(crate) fn tap_line(&self) -> Result<BelowControl, Error> {
        BelowControl::create(&self.name).map_err(failed)
    }

    /// A new line to a driver domain about the tap domain above it (one for each driver domain).
    pub(crate) fn driver_line(&self) -> Result<AboveControl, Error> {
        AboveControl::create(&self.name).map_err(failed)
    }
}

/// An error of a lower layer, whose words say it all, as a failure.
fn failed(e: impl std::fmt::Display) -> Error {
    Error::failed(e.to_string())
}

fn notify_mode(n: Notify) -> NotifyMode {
    match n {
        Notify::Irq => NotifyMode::Irq,
        Notify::Poll => NotifyMode::Poll,
        Notify::Adaptive => NotifyMode::Adaptive,
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_layout_lays_out_the_device_then_each_view() {
        let view = |name: &str, queues, attach| crate::views::ViewSetup {
            name: name.into(),
            offset: 0,
            size: 1 << 20,
            read_only: false,
            queues,
            attach,
            caps: Default::default(),
        };
        let mut l = super::Layout { queues: 2, attach: 1, views: vec![view("a", 1, 0), view("b", 2, 2)] };
        assert_eq!(l.lanes(), [None, None, Some(0), Some(1), Some(1)]);
        assert_eq!(l.attach_slots(), [None, Some(1), Some(1)]);
        assert_eq!(l.find("b"), Some(1));
        l.views.remove(0);
        assert_eq!(l.lanes(), [None, None, Some(0), Some(0)]);
        assert_eq!(l.attach_slots(), [None, Some(0), Some(0)]);
    }
}
