//! One device's runtime: its channel, backend descriptors and driver-domain process.

use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bulkhead_channel::{
    AboveControl, BackQueueFds, BelowControl, BudgetPolicy, FrontQueue, LowerQueue, NotifyMode, QueueConfig, QueueSetup,
};
use bulkhead_client::Device;
use bulkhead_config::{BackendConfig, DeviceConfig, Engine, ImageFormat, NbdTarget, Notify, SpinBudget, Tap};
use bulkhead_filters::state::StatePage;
use bulkhead_filters::FilterSpec;
use bulkhead_sandbox::spawn::DomainChild;
use bulkhead_sandbox::{Layer, Layers, Policy, Report};
use bulkhead_shmem::memfd;
use bulkhead_spec::{BackendSpec, DomainSpec, FilterSlot, LowerQueueSpec, QueueSpec, RingSpec, SandboxSpec};
use bulkhead_sys::uring::{self, RingWatch};

use crate::chain::{shared_page, ChainSetup, FilterSetup};
use crate::domain_log;
use crate::lifecycle::Lifecycle;
use crate::supervisor::SupervisorError;
use crate::views::{Controls, ViewRuntime, ViewSetup};

/// A device's running domains — the one its frontend reaches (`child`: the driver domain, or
/// in `interpose` mode the tap domain) and the driver domain below a tap domain (`lower`, on
/// the queues of `below`) — and its restart history. A generation starts its domains
/// together; the domain below a tap domain may then be replaced alone.
#[derive(Debug)]
pub(crate) struct DomainProc {
    pub child: Option<DomainChild>,
    pub layers: Option<Layers>,
    pub pidfd: Option<OwnedFd>,
    pub pid: u32,
    pub lower: Option<Spawned>,
    /// The channel between a tap domain and the domain below it.
    pub below: Option<Below>,
    /// Whether the domain at `pid` is a tap domain (interpose or intercept).
    pub tap: bool,
    /// State, restart history and the watchdog's view.
    pub life: Lifecycle,
    /// Killed domains that had not finished exiting when they were replaced; reaped later.
    pub lingering: Vec<DomainChild>,
    /// Rings the domain at `pid` borrowed for its backend.
    pub rings: Vec<RingWatch>,
    /// Rings of domains that have exited or been killed, kept until the requests those domains
    /// left in the kernel have completed ([`drain_retired`](Self::drain_retired)).
    pub retired: Vec<RingWatch>,
}

/// How long a restart waits for a killed domain to finish exiting before it starts the next
/// generation anyway (the old one can no longer run code; it is reaped later).
pub(crate) const EXIT_WAIT: Duration = Duration::from_millis(500);

/// How long a restart waits for the reads and writes a dead domain left in the kernel (on a
/// ring it borrowed) to complete before it starts the next generation anyway, and says so.
pub(crate) const DRAIN_WAIT: Duration = Duration::from_secs(30);

impl DomainProc {
    /// A device's first generation.
    pub fn new(top: Spawned, lower: Option<Spawned>, below: Option<Below>, life: Lifecycle) -> Self {
        DomainProc {
            pid: top.child.id(),
            child: Some(top.child),
            layers: top.layers,
            pidfd: Some(top.pidfd),
            tap: top.tap,
            lower,
            below,
            life,
            lingering: Vec::new(),
            rings: top.rings,
            retired: Vec::new(),
        }
    }

    /// Takes the domains of a new generation.
    pub fn install(&mut self, top: Spawned, lower: Option<Spawned>, below: Option<Below>) {
        self.install_top(top);
        self.lower = lower;
        self.below = below;
    }

    /// The pid of the domain that runs the backend (the one below a tap domain, if any).
    pub fn driver_pid(&self) -> u32 {
        self.lower.as_ref().map_or(self.pid, |l| l.child.id())
    }

    /// Kills the current domains and reaps each that exits within [`EXIT_WAIT`]. One that has
    /// released its memory but not finished exiting (the kernel finishing work for it through
    /// this very device: [`crate::proc_info::memory_released`]) can touch nothing any more: it
    /// is kept in `lingering`, to be reaped once the next generation lets that work end.
    /// One still running after the wait is kept there too, and said so. Returns once the
    /// requests they left in the kernel have completed ([`drain_retired`](Self::drain_retired)).
    pub fn kill_current(&mut self, device: &str) {
        self.kill_top_only(device);
        if let Some(l) = self.lower.take() {
            self.retired.extend(l.rings);
            self.kill_one(device, l.child);
        }
        self.reap_lingering();
        self.drain_retired(device);
    }

    /// Kills the domain the frontend reaches (the tap domain, in `interpose` mode) and leaves
    /// the one below it running, as [`kill_current`](Self::kill_current) does for both.
    pub fn kill_top(&mut self, device: &str) {
        self.kill_top_only(device);
        self.reap_lingering();
        self.drain_retired(device);
    }

    fn kill_top_only(&mut self, device: &str) {
        self.pidfd = None;
        self.retired.append(&mut self.rings);
        if let Some(c) = self.child.take() {
            self.kill_one(device, c);
        }
    }

    /// Takes the driver domain below a tap domain, which has exited or is exiting, out of
    /// service: its rings are retired, and the child returned to be reaped.
    pub fn retire_lower(&mut self) -> Option<DomainChild> {
        let l = self.lower.take()?;
        self.retired.extend(l.rings);
        Some(l.child)
    }

    /// Waits until every read and write that retired domains started on their borrowed rings
    /// has completed, up to [`DRAIN_WAIT`]. A direct write the disk has not finished outlives
    /// the process that issued it; landing after the next generation wrote newer data at the
    /// same place, it would undo an acknowledged write (and a late read would fill a buffer
    /// since reused). So no new generation starts while one is in flight. Killed domains still
    /// running (stuck in the kernel) are waited for too: they may yet submit what they hold.
    pub fn drain_retired(&mut self, device: &str) {
        if self.retired.is_empty() {
            return;
        }
        let start = Instant::now();
        let mut said = start;
        let mut pause = Duration::from_micros(50);
        loop {
            self.reap_lingering();
            let running = self.lingering.iter().filter(|c| !crate::proc_info::memory_released(c.id())).count();
            let left: u32 = self.retired.iter().map(RingWatch::settle).sum();
            if left == 0 && running == 0 {
                break;
            }
            if start.elapsed() >= DRAIN_WAIT {
                eprintln!(
                    "bulkhead: device {device}: {left} reads or writes of a dead domain are still in the kernel \
                     after {} s ({running} killed domain(s) still running); starting the next generation anyway: \
                     a late write may land over a newer one",
                    DRAIN_WAIT.as_secs()
                );
                break;
            }
            if said.elapsed() >= Duration::from_secs(2) {
                eprintln!(
                    "bulkhead: device {device}: waiting for {left} reads or writes a dead domain left in the kernel \
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

    fn kill_one(&mut self, device: &str, mut c: DomainChild) {
        let _ = c.kill();
        if !finish_or_release(&mut c) {
            eprintln!(
                "bulkhead: device {device}: killed domain (pid {}) has not finished exiting after {} ms; \
                 carrying on without it",
                c.id(),
                EXIT_WAIT.as_millis()
            );
        }
        if c.try_wait().ok().flatten().is_none() {
            self.lingering.push(c);
        }
    }

    /// Takes a new tap domain over the driver domain that stays below.
    pub fn install_top(&mut self, top: Spawned) {
        debug_assert!(self.rings.is_empty(), "the domain replaced has been killed and its rings retired");
        self.rings = top.rings;
        self.pid = top.child.id();
        self.child = Some(top.child);
        self.layers = top.layers;
        self.pidfd = Some(top.pidfd);
        self.tap = top.tap;
    }

    /// Whether a tap domain runs over a driver domain of its own (`interpose`): each can then
    /// be replaced alone.
    pub fn interposed(&self) -> bool {
        self.below.is_some() && self.lower.is_some()
    }

    /// Reaps lingering domains that have exited since.
    pub fn reap_lingering(&mut self) {
        self.lingering.retain_mut(|c| !matches!(c.try_wait(), Ok(Some(_)) | Err(_)));
    }
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

/// Restart policy of a device.
#[derive(Debug, Clone, Copy)]
pub struct RestartPolicy {
    /// A domain with requests pending and no answer for this long is wedged.
    pub watchdog: Duration,
    /// Restarts allowed within `window` before the device turns failed.
    pub limit: u32,
    /// The window.
    pub window: Duration,
}

/// A configured device: channel frontend, backend descriptors, driver process.
#[derive(Debug)]
pub struct DeviceRuntime {
    /// Device name.
    pub name: String,
    /// The frontend, shared with the exports.
    pub device: Arc<Device>,
    /// The supervisor's face of it and of its views.
    pub(crate) control: Controls,
    /// Applications attached to it and its views.
    pub(crate) attach: crate::attach::AttachPoint,
    /// Its views, each exported as a device of its own.
    pub views: Vec<ViewRuntime>,
    /// Notification mode.
    pub mode: NotifyMode,
    /// Backend, described for status.
    pub backend_desc: String,
    /// Number of queues.
    pub queues: usize,
    /// Restart policy.
    pub policy: RestartPolicy,
    /// The domain's state page: its heartbeat while layers hold requests.
    pub(crate) state: StatePage,
    pub(crate) proc_: Mutex<DomainProc>,
    pub(crate) launcher: Launcher,
    pub(crate) restart_lock: Mutex<()>,
}

/// Everything needed to launch another generation of a device's domain.
#[derive(Debug)]
pub(crate) struct Launcher {
    name: String,
    mode: NotifyMode,
    /// Queues of each generation: the device's own, then each view's.
    queues: usize,
    /// The views, and the view each queue serves (`None`: the device's own).
    views: Vec<ViewSetup>,
    lanes: Vec<Option<u32>>,
    qcfg: QueueConfig,
    /// Bytes the frontend sees, above the filters.
    size: u64,
    /// Bytes of the backend, below them (more than `size` under a `crypt` filter's header).
    backend_size: u64,
    backend: BackendConfig,
    exe: PathBuf,
    /// Descriptors kept for the life of the device (ramdisk memfd, backing files): every
    /// generation of the domain gets the same ones, so a restart keeps the contents.
    backend_fds: Vec<OwnedFd>,
    /// The format of each of `backend_fds` for a disk image (the image, then its backing files).
    image_formats: Vec<bulkhead_image::Format>,
    policy: Policy,
    /// The domain's bound on waiting for a remote server, ms.
    io_timeout_ms: u64,
    /// Where the filters run (with `interpose` each generation is a tap domain over a driver
    /// domain) and the filters; changed on a running device by `bulkhead tap` and `bulkhead
    /// filter`, taking effect with the next generation.
    pub(crate) chain: Mutex<ChainSetup>,
    /// The domain's state page.
    state_fd: OwnedFd,
    /// The device's place in the configuration (for trace device numbers).
    pub(crate) index: u32,
    /// A `vdev` device's card and its model's domain.
    pub(crate) card: Option<crate::vdev::CardDevice>,
    /// The view of each slot for attached applications' queues (`None`: the device).
    attach_slots: Vec<Option<u32>>,
}

/// How long a read through a domain started to read a LUKS header may take, at least, ms.
const PROBE_TIMEOUT_MS: u64 = 10_000;

/// Spins a frontend waiting on a tap domain makes before it yields between looks (about 10 µs).
const FRONTEND_YIELD_AFTER_SPINS: u32 = 2048;

/// Why a launch failed.
#[derive(Debug)]
pub(crate) enum LaunchError {
    /// The remote server could not be reached: worth trying again.
    Connect(String),
    /// Anything else.
    Other(String),
}

impl std::fmt::Display for LaunchError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LaunchError::Connect(m) | LaunchError::Other(m) => f.write_str(m),
        }
    }
}

impl From<String> for LaunchError {
    fn from(m: String) -> Self {
        LaunchError::Other(m)
    }
}

/// Connects to a remote NBD server within `timeout` (the domain can open no socket itself).
pub(crate) fn connect_nbd(target: &NbdTarget, timeout: Duration) -> Result<OwnedFd, String> {
    match target {
        NbdTarget::Unix(path) => std::os::unix::net::UnixStream::connect(path)
            .map(OwnedFd::from)
            .map_err(|e| format!("cannot connect to {}: {e}", path.display())),
        NbdTarget::Tcp { host, port } => {
            use std::net::ToSocketAddrs;
            let addrs = (host.as_str(), *port).to_socket_addrs().map_err(|e| format!("cannot resolve {host}: {e}"))?;
            let mut last = format!("{host} has no address");
            for a in addrs {
                match std::net::TcpStream::connect_timeout(&a, timeout) {
                    Ok(s) => {
                        let _ = s.set_nodelay(true);
                        return Ok(OwnedFd::from(s));
                    }
                    Err(e) => last = format!("cannot connect to {a}: {e}"),
                }
            }
            Err(last)
        }
    }
}

/// Reads a remote export's size at device start (the only negotiation outside a domain).
fn probe_nbd(target: &NbdTarget, export: &str, timeout: Duration) -> Result<u64, String> {
    let sock = connect_nbd(target, timeout)?;
    let info = bulkhead_nbd::client::handshake(sock.as_raw_fd(), export, timeout).map_err(|e| e.to_string())?;
    bulkhead_nbd::client::disconnect(sock.as_raw_fd());
    Ok(info.size)
}

fn notify_mode(n: Notify) -> NotifyMode {
    match n {
        Notify::Irq => NotifyMode::Irq,
        Notify::Poll => NotifyMode::Poll,
        Notify::Adaptive => NotifyMode::Adaptive,
    }
}

fn open_backing(path: &Path, read_only: bool, direct: bool) -> Result<OwnedFd, std::io::Error> {
    use std::os::unix::fs::OpenOptionsExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(!read_only)
        .custom_flags(libc::O_CLOEXEC | if direct { libc::O_DIRECT } else { 0 })
        .open(path)?;
    Ok(OwnedFd::from(f))
}

fn backing_size(fd: &OwnedFd) -> std::io::Result<u64> {
    bulkhead_sys::storage_size(fd.as_fd()).map(|(size, _)| size)
}

/// A launched generation: its frontend queues, the domain they reach (the driver domain, or
/// in `interpose` mode the tap domain) and the domain below it, if any, with their channel.
pub(crate) struct Launched {
    pub fronts: Vec<FrontQueue>,
    pub top: Spawned,
    pub lower: Option<Spawned>,
    pub below: Option<Below>,
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
    nslots: u32,
    arena_bytes: u64,
}

impl Below {
    /// Wakes the tap domain wherever it waits (its loop, or a response from below).
    pub fn wake_tap(&self) {
        for q in &self.queues {
            q.interrupt_front();
        }
    }
}

impl DeviceRuntime {
    /// Creates the backend storage for `cfg` and starts generation 1 of its driver domain.
    pub(crate) fn start(cfg: &DeviceConfig, index: u32, exe: &Path) -> Result<Self, SupervisorError> {
        let name = cfg.name.get_ref().clone();
        let err = |what: String| SupervisorError::Device { device: name.clone(), message: what };
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
        // Backend storage, opened here so the domain never opens a path.
        let mut backend_fds: Vec<OwnedFd> = Vec::new();
        let mut card_device = None;
        // The format of each of `backend_fds` when the backend is a disk image.
        let mut image_formats = Vec::new();
        let mut backend = cfg.backend.resolve();
        if let BackendConfig::File { engine: engine @ Engine::Auto, format: ImageFormat::Raw, path, .. } = &mut backend {
            *engine = auto_engine(&name, path);
        }
        let (size, backend_desc) = match &backend {
            BackendConfig::Nbd { uri, target, export, connect_timeout_ms, .. } => {
                let export_size = probe_nbd(target, export, Duration::from_millis(*connect_timeout_ms))
                    .map_err(|e| err(format!("backend {uri}: {e}")))?;
                let size = match &cfg.size {
                    Some(s) if s.get_ref().0 > export_size => {
                        return Err(err(format!("size {} exceeds the {export_size} bytes of {uri}", s.get_ref().0)))
                    }
                    Some(s) => s.get_ref().0,
                    None => export_size / 512 * 512,
                };
                if size == 0 {
                    return Err(err(format!("{uri} is empty")));
                }
                (size, format!("nbd:{uri}"))
            }
            BackendConfig::Ram | BackendConfig::Null => {
                let size = cfg.size.as_ref().expect("validated: size required").get_ref().0;
                if matches!(backend, BackendConfig::Ram) {
                    let fd = memfd::create(&format!("bulkhead-{name}-ram"), size).map_err(|e| err(format!("ramdisk: {e}")))?;
                    memfd::seal_size(fd.as_raw_fd()).map_err(|e| err(format!("ramdisk: {e}")))?;
                    backend_fds.push(fd);
                    (size, "ram".to_string())
                } else {
                    (size, "null".to_string())
                }
            }
            BackendConfig::Vdev { card, wait } => {
                let size = cfg.size.as_ref().expect("validated: size required").get_ref().0;
                let c = crate::vdev::CardDevice::start(&name, card, size, sandbox).map_err(err)?;
                let desc = crate::vdev::describe(card, c.name(), *wait);
                card_device = Some(c);
                (size, desc)
            }
            BackendConfig::File { path, read_only, format: ImageFormat::Qcow2, .. } => {
                let chain = crate::image::open_chain(path, *read_only).map_err(err)?;
                let desc = format!(
                    "qcow2:{}{}{}",
                    path.display(),
                    match chain.paths.len() - 1 {
                        0 => String::new(),
                        1 => format!(" over {}", chain.paths[1].display()),
                        n => format!(" over {} and {} more", chain.paths[1].display(), n - 1),
                    },
                    if *read_only { ",ro" } else { "" }
                );
                image_formats = chain.formats;
                backend_fds = chain.fds;
                (chain.size, desc)
            }
            BackendConfig::File { path, direct, engine, read_only, .. } => {
                let main = open_backing(path, *read_only, *direct)
                    .map_err(|e| err(format!("cannot open backing file {}: {e}", path.display())))?;
                let file_size = backing_size(&main).map_err(|e| err(format!("{}: {e}", path.display())))?;
                let size = match &cfg.size {
                    Some(s) if s.get_ref().0 > file_size => {
                        return Err(err(format!("size {} exceeds the {} bytes of {}", s.get_ref().0, file_size, path.display())))
                    }
                    Some(s) => s.get_ref().0,
                    None => file_size / 512 * 512,
                };
                if size == 0 {
                    return Err(err(format!("{} is empty", path.display())));
                }
                backend_fds.push(main);
                if *direct {
                    let buffered = open_backing(path, *read_only, false)
                        .map_err(|e| err(format!("cannot open backing file {}: {e}", path.display())))?;
                    backend_fds.push(buffered);
                }
                let desc = format!(
                    "file:{}{}{}{}",
                    path.display(),
                    if *direct { ",direct" } else { "" },
                    if *engine == Engine::IoUring { ",io_uring" } else { "" },
                    if *read_only { ",ro" } else { "" }
                );
                (size, desc)
            }
        };
        // Filter state pages and outputs, opened here: the domain opens nothing.
        let mut filters = Vec::new();
        for (i, f) in cfg.filters().into_iter().enumerate() {
            filters.push(FilterSetup::new(&name, index, f).map_err(|e| err(format!("filter {}: {e}", i + 1)))?);
        }
        let backend_size = size;
        // Writable here too: the views' caps are set in it.
        let (state_fd, state) = shared_page(&format!("bulkhead-{name}-domain"), true).map_err(err)?;
        let qcfg = QueueConfig {
            nslots: *cfg.queue_depth.get_ref(),
            arena_bytes: cfg.arena.get_ref().0 as usize,
            mode,
            budget,
            generation: 1,
        };
        let nqueues = *cfg.queues.get_ref() as usize;
        let policy = RestartPolicy {
            watchdog: Duration::from_millis(cfg.watchdog_ms()),
            limit: *cfg.restart_limit.get_ref(),
            window: Duration::from_millis(*cfg.restart_window_ms.get_ref()),
        };
        let launcher = Launcher {
            name: name.clone(),
            mode,
            queues: nqueues,
            views: Vec::new(),
            lanes: vec![None; nqueues],
            qcfg,
            size: backend_size,
            backend_size,
            backend,
            exe: exe.to_path_buf(),
            backend_fds,
            image_formats,
            io_timeout_ms: cfg.watchdog_ms(),
            chain: Mutex::new(ChainSetup { tap: Tap::Passthrough, filters: Vec::new() }),
            state_fd,
            index,
            policy: sandbox,
            card: card_device,
            attach_slots: Vec::new(),
        };
        let mut launcher = launcher;
        let size = launcher.prepare_filters(filters, cfg.tap).map_err(err)?;
        // Views, against the size the filters leave: each adds queues of its own.
        launcher.views = ViewSetup::resolve(&name, &cfg.views, size).map_err(err)?;
        for (i, v) in launcher.views.iter().enumerate() {
            launcher.lanes.extend(std::iter::repeat_n(Some(i as u32), v.queues));
        }
        launcher.queues = launcher.lanes.len();
        // Slots for attached applications: the device's, then each view's.
        launcher.attach_slots = std::iter::repeat_n(None, cfg.attach_slots() as usize)
            .chain(cfg.views.iter().enumerate().flat_map(|(i, v)| std::iter::repeat_n(Some(i as u32), v.attach_slots() as usize)))
            .collect();
        let attach = crate::attach::AttachPoint::new(&name, launcher.attach_slots.clone());
        let Launched { mut fronts, mut top, lower, below } = launcher.launch(1).map_err(|e| err(e.to_string()))?;
        attach.rejoin(top.attach_line.take());
        let mut view_fronts = fronts.split_off(nqueues);
        let (device, control) = Device::new(&name, size, fronts, None);
        device.set_min_block(launcher.min_block());
        let mut controls = Controls::new(control, nqueues);
        let mut views = Vec::with_capacity(launcher.views.len());
        for (i, v) in launcher.views.iter().enumerate() {
            let rest = view_fronts.split_off(v.queues);
            let (view, control) = ViewRuntime::new(v, i, std::mem::replace(&mut view_fronts, rest), &state);
            view.device.set_min_block(launcher.min_block());
            controls.push(control, v.queues);
            views.push(view);
        }
        Ok(DeviceRuntime {
            name: name.clone(),
            device,
            control: controls,
            attach,
            views,
            mode,
            backend_desc,
            queues: nqueues,
            policy,
            state,
            proc_: Mutex::new(DomainProc::new(top, lower, below, Lifecycle::new(&name, policy, Instant::now()))),
            launcher,
            restart_lock: Mutex::new(()),
        })
    }
}

impl DeviceRuntime {
    /// Applies `change` to the chain the next generation runs; returns what to log for the
    /// restart, or why the change is refused (the chain is then as it was).
    pub(crate) fn change_chain(&self, change: &crate::DeviceChange) -> Result<String, String> {
        use crate::DeviceChange;
        let mut chain = self.launcher.chain.lock().unwrap_or_else(|e| e.into_inner());
        match change {
            DeviceChange::Restart => Ok("restart requested".into()),
            DeviceChange::Tap(t) => {
                if *t == Tap::Intercept {
                    self.launcher.soft_terminal()?;
                }
                let was = chain.tap;
                chain.tap = *t;
                Ok(format!("tap mode {} → {}", was.as_str(), t.as_str()))
            }
            DeviceChange::AddFilter { at, table } => {
                let at = at.unwrap_or(chain.filters.len());
                if at > chain.filters.len() {
                    return Err(format!("position {at} is past the end of the chain ({} filters)", chain.filters.len()));
                }
                let watchdog_ms = self.policy.watchdog.as_millis() as u64;
                let f = bulkhead_config::parse_filter(table, &self.name, at, watchdog_ms).map_err(|e| e.to_string())?;
                if f.spec.transforms() {
                    return Err(format!(
                        "a {} filter changes what the device holds; it cannot be added to a running device",
                        f.spec.type_name()
                    ));
                }
                let setup = FilterSetup::new(&self.name, self.launcher.index, f)?;
                let what = setup.spec.type_name();
                chain.filters.insert(at, setup);
                Ok(format!("filter {what} inserted at position {at}"))
            }
            DeviceChange::Snapshot(op) => {
                let cow = chain.filters.iter_mut().find(|f| matches!(f.spec, FilterSpec::Cow { .. }));
                let Some(FilterSpec::Cow { op: pending, .. }) = cow.map(|f| &mut f.spec) else {
                    return Err("the device has no cow filter".into());
                };
                *pending = Some(op.clone());
                Ok(format!("snapshot {} `{}`", op.action.as_str(), op.name))
            }
            DeviceChange::RemoveFilter(at) => {
                if *at >= chain.filters.len() {
                    return Err(format!("no filter at position {at} ({} filters)", chain.filters.len()));
                }
                if chain.filters[*at].spec.transforms() {
                    return Err(format!(
                        "the {} filter at position {at} holds what the device holds; it cannot be removed from a running device",
                        chain.filters[*at].spec.type_name()
                    ));
                }
                let gone = chain.filters.remove(*at);
                Ok(format!("filter {} at position {at} removed", gone.spec.type_name()))
            }
        }
    }
}

impl Launcher {
    /// Opens what the filters need before their first generation, from the bottom of the
    /// chain up, each over the device the filters below it make: a `cow` filter's overlay is
    /// made the size of that device, and a `crypt` filter's LUKS header is read from it. Where
    /// that device is the backend's own bytes (memory, a raw file, through filters that move
    /// no data) the header is read from the storage directly; otherwise (a qcow2 image, a
    /// remote server, a `cow` below) the filters below run in a domain of their own for the
    /// read, so the header is read exactly as the filter will see it. Sets the chain to
    /// `filters` under `tap`; returns the size of the device they make.
    pub(crate) fn prepare_filters(&mut self, mut filters: Vec<FilterSetup>, tap: Tap) -> Result<u64, String> {
        let mut size = self.backend_size;
        let (mut crypt, mut cow) = (false, false);
        while let Some(mut f) = filters.pop() {
            let i = filters.len();
            let below = &self.chain.get_mut().unwrap_or_else(|e| e.into_inner()).filters;
            let direct = below.iter().all(|b| !b.spec.transforms());
            match f.spec {
                FilterSpec::Crypt { .. } => {
                    if std::mem::replace(&mut crypt, true) {
                        return Err(format!("filter {} (crypt): one crypt filter per device", i + 1));
                    }
                    size = if direct && self.reads_storage_directly() {
                        let file = match self.header_fd() {
                            Some(fd) => {
                                Some(std::fs::File::from(fd.try_clone().map_err(|e| format!("filter {} (crypt): {e}", i + 1))?))
                            }
                            None => None,
                        };
                        let mut read = |at: u64, buf: &mut [u8]| -> Result<(), String> {
                            use std::os::unix::fs::FileExt;
                            match &file {
                                Some(f) => f.read_exact_at(buf, at).map_err(|e| e.to_string()),
                                None => {
                                    buf.fill(0);
                                    Ok(())
                                }
                            }
                        };
                        crate::chain::open_volume(&self.name, i, &mut f, size, &mut read)?
                    } else {
                        self.size = size;
                        let name = self.name.clone();
                        self.read_through(|read| crate::chain::open_volume(&name, i, &mut f, size, read))
                            .map_err(|e| format!("filter {} (crypt): {e}", i + 1))?
                    };
                }
                FilterSpec::Cow { .. } => {
                    if std::mem::replace(&mut cow, true) {
                        return Err(format!("filter {} (cow): one cow filter per device", i + 1));
                    }
                    let backing = match &self.backend {
                        BackendConfig::File { format, path, .. } if below.is_empty() => Some((
                            path.clone(),
                            match format {
                                ImageFormat::Raw => bulkhead_image::Format::Raw,
                                ImageFormat::Qcow2 => bulkhead_image::Format::Qcow2,
                            },
                        )),
                        _ => None,
                    };
                    crate::chain::open_cow_overlay(i, &mut f, size, backing.as_ref().map(|(p, f)| (p.as_path(), *f)))?;
                }
                _ => {}
            }
            self.chain.get_mut().unwrap_or_else(|e| e.into_inner()).filters.insert(0, f);
        }
        self.chain.get_mut().unwrap_or_else(|e| e.into_inner()).tap = tap;
        self.size = size;
        Ok(size)
    }

    /// The smallest block the chain takes: a `crypt` filter's sector, or 1.
    fn min_block(&self) -> u32 {
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

    /// Whether the backend's bytes are in storage the supervisor holds (memory, a raw file).
    fn reads_storage_directly(&self) -> bool {
        matches!(
            self.backend,
            BackendConfig::Ram
                | BackendConfig::Null
                | BackendConfig::Vdev { .. }
                | BackendConfig::File { format: ImageFormat::Raw, .. }
        )
    }

    /// The descriptor to read the backend's storage through: a direct file's buffered one (no
    /// alignment rules for a header read); `None` for the null backend (it reads as zeroes).
    fn header_fd(&self) -> Option<&OwnedFd> {
        match &self.backend {
            BackendConfig::File { direct, .. } => self.backend_fds.get(usize::from(*direct)),
            BackendConfig::Ram => self.backend_fds.first(),
            // The card keeps the device's bytes as they are, in storage the supervisor made.
            BackendConfig::Vdev { .. } => self.card.as_ref().map(|c| c.media()),
            _ => None,
        }
    }

    /// Runs `f` with a reader of the device the current chain makes (`self.size` bytes): a
    /// domain of its own serves it, in passthrough, and is ended afterwards.
    fn read_through<T>(&self, f: impl FnOnce(&mut bulkhead_crypt::ReadAt<'_>) -> Result<T, String>) -> Result<T, String> {
        let Launched { fronts, top, lower, .. } =
            self.launch(1).map_err(|e| format!("cannot start a domain to read the device below: {e}"))?;
        let timeout = self.io_timeout_ms.max(PROBE_TIMEOUT_MS);
        let (dev, _control) = Device::new(&self.name, self.size, fronts, Some(timeout));
        let size = self.size;
        let mut read = |at: u64, buf: &mut [u8]| -> Result<(), String> {
            // The device takes whole sectors.
            let start = at / 512 * 512;
            let end = (at + buf.len() as u64).div_ceil(512) * 512;
            if end > size {
                return Err(format!("{} bytes at {at} run past the end of the device below ({size} bytes)", buf.len()));
            }
            let mut whole = vec![0u8; (end - start) as usize];
            dev.read_into(0, start, &mut whole).map_err(|e| format!("reading the device below: {e}"))?;
            let from = (at - start) as usize;
            buf.copy_from_slice(&whole[from..from + buf.len()]);
            Ok(())
        };
        let out = f(&mut read);
        discard(top.child);
        if let Some(l) = lower {
            discard(l.child);
        }
        out
    }

    /// Refuses a terminal that is not a soft device: `intercept` ends the chain in memory, a
    /// file on a mounted file system or a remote server, never in a device node (that is what
    /// a driver domain is for).
    pub(crate) fn soft_terminal(&self) -> Result<(), String> {
        use std::os::unix::fs::FileTypeExt;
        let BackendConfig::File { path, .. } = &self.backend else { return Ok(()) };
        let dup = self.backend_fds[0].try_clone().map_err(|e| format!("{}: {e}", path.display()))?;
        let kind = std::fs::File::from(dup).metadata().map_err(|e| format!("{}: {e}", path.display()))?.file_type();
        if kind.is_block_device() || kind.is_char_device() {
            return Err(format!(
                "tap = \"intercept\" terminates in a soft device (memory, a file on a mounted file system, a remote \
                 server), and {} is a device node: use \"passthrough\" or \"interpose\"",
                path.display()
            ));
        }
        Ok(())
    }

    /// How long to keep reconnecting to a lost remote server; `None` for local backends.
    pub(crate) fn reconnect_timeout(&self) -> Option<Duration> {
        match &self.backend {
            BackendConfig::Nbd { reconnect_timeout_ms, .. } => Some(Duration::from_millis(*reconnect_timeout_ms)),
            _ => None,
        }
    }

    /// A fresh connection for a remote backend (each generation of its domain gets one).
    fn connect(&self) -> Result<Option<OwnedFd>, LaunchError> {
        match &self.backend {
            BackendConfig::Nbd { uri, target, connect_timeout_ms, .. } => Ok(Some(
                connect_nbd(target, Duration::from_millis(*connect_timeout_ms))
                    .map_err(|e| LaunchError::Connect(format!("{uri}: {e}")))?,
            )),
            _ => Ok(None),
        }
    }

    /// Creates the queues of `generation` and execs a domain holding them and the backend.
    pub(crate) fn launch(&self, generation: u32) -> Result<Launched, LaunchError> {
        let conn = self.connect()?;
        let qcfg = QueueConfig { generation, ..self.qcfg };
        let arena = |f: &FrontQueue| f.arena_bytes() as u64;
        let chain = self.chain.lock().unwrap_or_else(|e| e.into_inner());
        let interpose = chain.tap == Tap::Interpose;
        // A chain that changes what the device holds keeps the channel above from the domain
        // below: the application's data is the tap domain's alone (see `LowerQueue`).
        let private = chain.filters.iter().any(|f| f.spec.transforms());
        if chain.tap == Tap::Intercept {
            self.soft_terminal()?;
        }
        let mut upper = Pass::default();
        let mut fronts = Vec::new();
        let mut queue_specs = Vec::new();
        // With a tap domain, the channel below it shares the arenas of the channel above, queue
        // for queue: only its queue files and doorbells are new.
        let mut lowers = Vec::new();
        let mut tap_fds = Vec::new();
        for q in 0..self.queues {
            let (front, fds) = QueueSetup::create(&format!("{}-q{q}", self.name), &qcfg).map_err(|e| e.to_string())?;
            if interpose {
                lowers.push(
                    LowerQueue::create(&format!("{}-lower-q{q}", self.name), &qcfg, &fds, private).map_err(|e| e.to_string())?,
                );
                tap_fds.push(fds);
            } else {
                let bulkhead_channel::BackQueueFds { ring, write_arena, read_arena, kick, irq } = fds;
                queue_specs.push(upper.queue([ring, write_arena, read_arena, kick, irq], qcfg.nslots, arena(&front)));
            }
            fronts.push(front);
        }
        if !interpose {
            // One domain: the backend's own (passthrough), or a tap domain whose chain ends in
            // the soft device itself (intercept).
            let role = if chain.tap == Tap::Intercept { "tap" } else { "driver" };
            let (backend, ring) = self.backend_spec(&mut upper, conn)?;
            let mut top = self.spawn(role, upper, queue_specs, backend, Some(&chain), None)?;
            top.rings.extend(ring);
            return Ok(Launched { fronts, top, lower: None, below: None });
        }
        // Three spinners (this frontend, the tap domain, the driver domain) may share two
        // CPUs: a wait that has spun a while lets a thread runnable on its CPU go first.
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
        };
        let top = self.spawn_tap(&below, &chain)?;
        // The tap domain has written the lower queues' headers (it reports once confined):
        // start the domain below.
        match self.spawn_below(&below, conn) {
            Ok(lower) => Ok(Launched { fronts, top, lower: Some(lower), below: Some(below) }),
            Err(e) => {
                discard(top.child);
                Err(e)
            }
        }
    }

    /// The geometry and policy of the device's queues.
    pub(crate) fn queue_config(&self) -> QueueConfig {
        self.qcfg
    }

    /// A new line to a tap domain about the domain below it (one for each tap domain).
    pub(crate) fn tap_line(&self) -> Result<BelowControl, String> {
        BelowControl::create(&self.name).map_err(|e| e.to_string())
    }

    /// A new line to a driver domain about the tap domain above it (one for each driver domain).
    pub(crate) fn driver_line(&self) -> Result<AboveControl, String> {
        AboveControl::create(&self.name).map_err(|e| e.to_string())
    }

    /// Execs a tap domain in `interpose` mode over the channels of `below`: the channel above
    /// (its queues' files, as the frontend last wrote their headers) and the channel below,
    /// whose headers it writes as `below.generation` before it reports.
    pub(crate) fn spawn_tap(&self, below: &Below, chain: &ChainSetup) -> Result<Spawned, LaunchError> {
        let mut pass = Pass::default();
        let mut queue_specs = Vec::new();
        for fds in &below.tap_fds {
            let bulkhead_channel::BackQueueFds { ring, write_arena, read_arena, kick, irq } =
                fds.try_clone().map_err(|e| e.to_string())?;
            queue_specs.push(pass.queue([ring, write_arena, read_arena, kick, irq], below.nslots, below.arena_bytes));
        }
        let mut below_specs = Vec::new();
        for l in &below.queues {
            let bulkhead_channel::ForwardQueueFds { ring, kick, irq, arenas } = l.front_fds().map_err(|e| e.to_string())?;
            below_specs.push(LowerQueueSpec {
                nslots: below.nslots,
                fds: [ring, kick, irq].map(|fd| pass.add_owned(fd)),
                arena_fds: arenas.map(|a| a.map(|fd| pass.add_owned(fd))),
            });
        }
        let control_fds = Some(below.control.fds().map_err(|e| e.to_string())?.map(|fd| pass.add_owned(fd)));
        let backend = BackendSpec::Channel { queues: below_specs, generation: below.generation, control_fds };
        self.spawn("tap", pass, queue_specs, backend, Some(chain), None)
    }

    /// Execs a driver domain below a tap domain, on the queues of `below` (whose headers the
    /// tap domain has written for `below.generation`). `conn`: a remote backend's connection;
    /// made here if `None` and needed.
    pub(crate) fn spawn_below(&self, below: &Below, conn: Option<OwnedFd>) -> Result<Spawned, LaunchError> {
        let conn = match conn {
            Some(c) => Some(c),
            None => self.connect()?,
        };
        let mut pass = Pass::default();
        let mut specs = Vec::new();
        for l in &below.queues {
            let bulkhead_channel::BackQueueFds { ring, write_arena, read_arena, kick, irq } =
                l.back_fds().map_err(|e| e.to_string())?;
            specs.push(pass.queue([ring, write_arena, read_arena, kick, irq], below.nslots, below.arena_bytes));
        }
        let (backend, ring) = self.backend_spec(&mut pass, conn)?;
        let line = below.driver_line.fds().map_err(|e| e.to_string())?.map(|fd| pass.add_owned(fd));
        let mut lower = self.spawn("driver", pass, specs, backend, None, Some(line))?;
        lower.rings.extend(ring);
        Ok(lower)
    }

    /// The backend's part of a spec, its descriptors added to `pass`; and the watch on the
    /// ring lent to an io_uring engine, which the supervisor keeps (see [`RingWatch`]).
    fn backend_spec(&self, pass: &mut Pass, conn: Option<OwnedFd>) -> Result<(BackendSpec, Option<RingWatch>), LaunchError> {
        let spec = match &self.backend {
            BackendConfig::Ram => BackendSpec::Ram { fd: pass.add(&self.backend_fds[0]) },
            BackendConfig::Null => BackendSpec::Null,
            BackendConfig::Vdev { wait, .. } => {
                let card = self.card.as_ref().expect("a vdev device has a card");
                let ([regs, dma, irq], line) = card.driver_fds()?;
                BackendSpec::Vdev {
                    card: card.card_json().to_string(),
                    wait: wait.as_str().to_string(),
                    fds: [pass.add(regs), pass.add(dma), pass.add(irq), pass.add_owned(line)],
                }
            }
            BackendConfig::Nbd { export, .. } => BackendSpec::Nbd {
                fd: pass.add_owned(conn.expect("an nbd backend connects before it launches")),
                export: export.clone(),
                timeout_ms: self.io_timeout_ms,
            },
            BackendConfig::File { read_only, format: ImageFormat::Qcow2, .. } => BackendSpec::Qcow2 {
                layers: self
                    .backend_fds
                    .iter()
                    .zip(&self.image_formats)
                    .map(|(fd, f)| (pass.add(fd), f.as_str().to_string()))
                    .collect(),
                read_only: *read_only,
            },
            BackendConfig::File { direct, engine, read_only, .. } => {
                let (ring, watch) = match engine {
                    Engine::IoUring => {
                        let (lent, watch) = uring::lend(uring::FILE_ENGINE)
                            .map_err(|e| format!("cannot create the io_uring for the file backend: {e}"))?;
                        let spec = RingSpec {
                            fds: [pass.add(lent.ring_fd()), pass.add(lent.wake_fd())],
                            params: lent.params().to_vec(),
                        };
                        pass.lent.push(lent);
                        (Some(spec), Some(watch))
                    }
                    // `auto` is resolved when the device starts (`auto_engine`).
                    Engine::Sync | Engine::Auto => (None, None),
                };
                let spec = BackendSpec::File {
                    fd: pass.add(&self.backend_fds[0]),
                    buffered_fd: direct.then(|| pass.add(&self.backend_fds[1])),
                    read_only: *read_only,
                    engine: engine.as_str().to_string(),
                    ring,
                };
                return Ok((spec, watch));
            }
        };
        Ok((spec, None))
    }

    /// Execs one domain (`role` names it in messages): its queues and backend are in `pass`
    /// already; the upper domain of a device also gets `chain`'s filters, their descriptors and
    /// the domain state page; a driver domain below a tap domain, its line about the tap domain
    /// (`above_line`, in `pass` too). Waits for its sandbox report.
    fn spawn(
        &self,
        role: &str,
        mut pass: Pass,
        mut queues: Vec<QueueSpec>,
        backend: BackendSpec,
        chain: Option<&ChainSetup>,
        above_line: Option<[i32; 2]>,
    ) -> Result<Spawned, LaunchError> {
        let mut filters = Vec::new();
        let mut state_fd = None;
        let mut views = Vec::new();
        if let Some(chain) = chain {
            // The upper domain serves the views: the queues come in the launch's order.
            if queues.len() == self.lanes.len() {
                for (q, lane) in queues.iter_mut().zip(&self.lanes) {
                    q.view = *lane;
                }
                views = self.views.iter().map(ViewSetup::spec).collect();
            }
            for f in &chain.filters {
                f.trim_output();
                let state_fd = pass.add(&f.state_fd);
                let output_fd = f.output.as_ref().map(|o| pass.add(o));
                let secret_fd = f.secret.as_ref().map(|o| pass.add(o));
                filters.push(FilterSlot { spec: f.spec.clone(), state_fd, output_fd, secret_fd, guard: f.guard });
            }
            state_fd = Some(pass.add(&self.state_fd));
        }
        // The domain the frontend reaches takes attached applications' queues, unless it is a
        // tap domain over a domain below (whose channel has no room for them).
        let mut attach = None;
        let mut attach_line = None;
        if chain.is_some_and(|c| c.tap != Tap::Interpose) && !self.attach_slots.is_empty() {
            let (ours, theirs) = bulkhead_sys::seqpacket_pair().map_err(|e| format!("attach line: {e}"))?;
            attach = Some(bulkhead_spec::AttachSpec { fd: pass.add_owned(theirs), slots: self.attach_slots.clone() });
            attach_line = Some(ours);
        }
        let (report_r, report_w) = bulkhead_sys::pipe().map_err(|e| format!("report pipe: {e}"))?;
        let report_fd = pass.add_owned(report_w);
        let spec = DomainSpec {
            device: self.name.clone(),
            // The driver domain below a tap domain serves the backend's bytes as they are.
            size: if chain.is_some() { self.size } else { self.backend_size },
            backend_size: self.backend_size,
            mode: self.mode.as_str().to_string(),
            budget_ns: match self.qcfg.budget {
                BudgetPolicy::Fixed(ns) => Some(ns),
                BudgetPolicy::Auto { .. } => None,
            },
            queues,
            views,
            backend,
            filters,
            state_fd,
            // Four beats within the watchdog's time.
            heartbeat_ms: (self.io_timeout_ms / 4).max(2),
            above_control_fds: above_line,
            attach,
            sandbox: SandboxSpec { policy: self.policy },
            report_fd: Some(report_fd),
        };
        let json = serde_json::to_string(&spec).expect("spec serialises");
        let args: [&std::ffi::OsStr; 3] = ["driver".as_ref(), "--spec".as_ref(), json.as_ref()];
        let raw = std::mem::take(&mut pass.raw);
        let what = format!("{role} domain");
        let (child, layers) = exec_confined(&self.exe, &args, &raw, pass, &self.name, self.policy, &report_r, &what)?;
        let pidfd = pidfd_open(child.id()).map_err(|e| format!("pidfd_open: {e}"))?;
        Ok(Spawned { child, pidfd, layers, tap: role == "tap", rings: Vec::new(), attach_line })
    }
}

/// Execs `exe ARGS` as a sandboxed domain of `device` (`what` names it in messages) holding
/// `fds` at 3, 4, …, its output relayed to the log; drops `handed` (the supervisor's copies of
/// what it passed, the write end of the report pipe among them) once the domain holds its own;
/// and waits for its sandbox report on `report`. Under `Policy::Required`, a domain without
/// namespaces, or one that refused to confine itself, is ended and the launch fails. The
/// layers are `None` if the domain said nothing (it failed before confinement, or is slow).
#[allow(clippy::too_many_arguments)]
pub(crate) fn exec_confined<T>(
    exe: &Path,
    args: &[&std::ffi::OsStr],
    fds: &[RawFd],
    handed: T,
    device: &str,
    policy: Policy,
    report: &OwnedFd,
    what: &str,
) -> Result<(DomainChild, Option<Layers>), String> {
    let (out_r, out_w) = domain_log::pipe().map_err(|e| format!("cannot make the domain's output pipe: {e}"))?;
    let (mut child, ns) = bulkhead_sandbox::spawn::spawn(exe, args, fds, Some(out_w.as_raw_fd()), policy != Policy::Off)
        .map_err(|e| format!("cannot start {what}: {e}"))?;
    // The domain holds its own copies now.
    drop(handed);
    drop(out_w);
    domain_log::relay(device, child.id(), out_r);
    if let (Policy::Required, Layer::Unavailable(why)) = (policy, &ns) {
        discard(child);
        return Err(format!("sandbox = \"required\" but namespaces are unavailable: {why}"));
    }
    match read_report(report) {
        Some(Report::Confined(layers)) => Ok((child, Some(layers))),
        Some(Report::Refused { refused }) => {
            // It exits on its own after reporting; give it the time to say why.
            let _ = child.wait_timeout(EXIT_WAIT);
            discard(child);
            Err(format!("{what} refused to start: {refused} (sandbox = \"required\")"))
        }
        None => Ok((child, None)),
    }
}

/// Descriptors handed to a domain, which finds them at 3, 4, … in the order added.
#[derive(Default)]
struct Pass {
    raw: Vec<RawFd>,
    /// Descriptors made for this domain alone, closed here once it holds its copies.
    owned: Vec<OwnedFd>,
    /// Rings lent to it, closed here once it holds its copies (the watch keeps each).
    lent: Vec<uring::LentRing>,
}

impl Pass {
    /// Passes `fd` (kept open by the caller); returns its number in the domain.
    fn add(&mut self, fd: &impl AsRawFd) -> i32 {
        self.raw.push(fd.as_raw_fd());
        2 + self.raw.len() as i32
    }

    /// Passes `fd`, closing it here after the spawn.
    fn add_owned(&mut self, fd: OwnedFd) -> i32 {
        let n = self.add(&fd);
        self.owned.push(fd);
        n
    }

    /// Passes one queue's five descriptors.
    fn queue(&mut self, fds: [OwnedFd; 5], nslots: u32, arena_bytes: u64) -> QueueSpec {
        QueueSpec { nslots, arena_bytes, fds: fds.map(|fd| self.add_owned(fd)), view: None }
    }
}

/// One domain process just started.
#[derive(Debug)]
pub(crate) struct Spawned {
    pub child: DomainChild,
    pub pidfd: OwnedFd,
    pub layers: Option<Layers>,
    /// A tap domain (it runs the filters: interpose or intercept).
    pub tap: bool,
    /// Rings its backend borrowed from the supervisor.
    pub rings: Vec<RingWatch>,
    /// The supervisor's end of its attach line, until the attach point takes it.
    pub attach_line: Option<OwnedFd>,
}

/// Reads the domain's sandbox report: one JSON line, written once it is confined. `None` if it
/// exits or stays silent for 5 s.
pub(crate) fn read_report(fd: &OwnedFd) -> Option<Report> {
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

pub use bulkhead_sys::pidfd_open;

/// Execs `exe driver --spec JSON` as a sandboxed domain (see [`bulkhead_sandbox::spawn`]):
/// `fds` at 3, 4, …, everything else closed at exec, new namespaces when `namespaces`.
///
/// The domain dies with the *thread* that calls this (PR_SET_PDEATHSIG): call it only from a
/// thread that outlives the domain (the main thread or the supervisor's watcher).
pub fn spawn_domain(exe: &Path, spec_json: &str, fds: &[RawFd], namespaces: bool) -> std::io::Result<(DomainChild, Layer)> {
    let args: [&std::ffi::OsStr; 3] = ["driver".as_ref(), "--spec".as_ref(), spec_json.as_ref()];
    bulkhead_sandbox::spawn::spawn(exe, &args, fds, None, namespaces)
}

/// The engine `engine = "auto"` (the default) picks for a raw file, and says why when it is
/// not io_uring: sync for a regular file on a file system held in memory; else io_uring if
/// the supervisor can make a ring to lend (the kernel may have io_uring switched off:
/// `kernel.io_uring_disabled`, or a seccomp policy around `serve`), else sync. On a disk,
/// io_uring is faster at every point measured (docs/BENCHMARKS.md, "The `file` backend's
/// engines").
fn auto_engine(device: &str, path: &Path) -> Engine {
    // A regular file in memory never waits for a device, and the kernel (6.18 here)
    // completes none of its requests from a ring on the spot: each goes to an io-wq worker
    // thread and back, a hop the sync engine's plain copy does not take.
    let regular = std::fs::metadata(path).is_ok_and(|m| m.is_file());
    if let (true, Ok(Some(fs))) = (regular, bulkhead_sys::in_memory_fs(path)) {
        eprintln!("bulkhead: device {device}: {} is on {fs}; the file backend uses the sync engine", path.display());
        return Engine::Sync;
    }
    match uring::lend(uring::FILE_ENGINE) {
        Ok(_) => Engine::IoUring,
        Err(e) => {
            eprintln!("bulkhead: device {device}: io_uring is unavailable ({e}); the file backend uses the sync engine");
            Engine::Sync
        }
    }
}

/// Ends a domain that will not be used: kills it and reaps it, on a thread of its own if it
/// does not finish exiting at once (a killed process can take a while; see [`EXIT_WAIT`]).
pub(crate) fn discard(mut child: DomainChild) {
    let _ = child.kill();
    if let Ok(None) = child.wait_timeout(EXIT_WAIT) {
        let _ = std::thread::Builder::new().name("reap-domain".into()).spawn(move || {
            let _ = child.wait();
        });
    }
}

/// The `bulkhead` executable to exec for domains.
pub(crate) fn current_exe() -> PathBuf {
    std::env::current_exe().unwrap_or_else(|_| PathBuf::from("bulkhead"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_takes_the_sync_engine_for_a_file_in_memory_and_io_uring_for_one_on_a_disk() {
        let uring = if uring::lend(uring::FILE_ENGINE).is_ok() { Engine::IoUring } else { Engine::Sync };
        let shm = Path::new("/dev/shm");
        if bulkhead_sys::in_memory_fs(shm).is_ok_and(|fs| fs.is_some()) {
            let f = shm.join(format!("bulkhead-auto-engine-{}", std::process::id()));
            std::fs::write(&f, [0u8; 4096]).unwrap();
            let picked = auto_engine("t", &f);
            std::fs::remove_file(&f).unwrap();
            assert_eq!(picked, Engine::Sync, "a file on {}", shm.display());
        }
        // The build's own directory: on a disk, unless this machine keeps it in memory too.
        let dir = Path::new(env!("CARGO_MANIFEST_DIR"));
        let f = dir.join("Cargo.toml");
        let expect = if bulkhead_sys::in_memory_fs(dir).unwrap().is_some() { Engine::Sync } else { uring };
        assert_eq!(auto_engine("t", &f), expect, "{}", f.display());
        // A device is not judged by the file system its node is on (devtmpfs).
        assert_eq!(auto_engine("t", Path::new("/dev/null")), uring, "a device node");
    }
}
