//! Launching a device's domains: the backend's storage, opened once when the device starts,
//! and for each generation new queues and the domains holding them, exec'd and confined.

use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bulkhead_channel::{AboveControl, BelowControl, BudgetPolicy, FrontQueue, LowerQueue, NotifyMode, QueueConfig, QueueSetup};
use bulkhead_client::Device;
use bulkhead_config::{BackendConfig, DeviceConfig, Engine, ImageFormat, NbdTarget, Notify, SpinBudget, Tap};
use bulkhead_filters::FilterSpec;
use bulkhead_sandbox::Policy;
use bulkhead_shmem::memfd;
use bulkhead_spec::{BackendSpec, DomainSpec, FilterSlot, LowerQueueSpec, QueueSpec, RingSpec, SandboxSpec};
use bulkhead_sys::uring::{self, RingWatch};

use crate::chain::{ChainSetup, FilterSetup};
use crate::domains::{Below, Domain, Domains};
use crate::spawn::{discard, exec_confined};
use crate::state::Shape;
use crate::views::ViewSetup;

/// How long a read through a domain started to read a LUKS header may take, at least, ms.
const PROBE_TIMEOUT_MS: u64 = 10_000;

/// How long a domain started only to learn an image's size has to stop once asked.
const PROBE_STOP: Duration = Duration::from_secs(5);

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

impl LaunchError {
    /// Whether the remote server could not be reached.
    pub fn unreachable(&self) -> bool {
        matches!(self, LaunchError::Connect(_))
    }
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

impl From<&str> for LaunchError {
    fn from(m: &str) -> Self {
        LaunchError::Other(m.to_string())
    }
}

/// A launched generation: its frontend queues (the device's, then each view's), its domains,
/// and the supervisor's end of the attach line of the domain that takes attached queues.
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
    /// Descriptors kept for the life of the device (ramdisk memfd, backing files): every
    /// generation of the domain gets the same ones, so a restart keeps the contents.
    backend_fds: Vec<OwnedFd>,
    /// The format of each of `backend_fds` for a disk image (the image, then its backing files).
    image_formats: Vec<bulkhead_image::Format>,
    policy: Policy,
    /// The domain's bound on waiting for a remote server, ms.
    io_timeout_ms: u64,
    /// Where the filters run and the filters; changed on a running device by `bulkhead tap`,
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
    pub(crate) fn open(cfg: &DeviceConfig, index: u32, exe: &Path, state_fds: [OwnedFd; 2]) -> Result<Launcher, String> {
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
        let storage = Storage::open(&name, cfg, &backend, sandbox)?;
        // Filter state pages and outputs, opened here: the domain opens nothing.
        let mut filters = Vec::new();
        for (i, f) in cfg.filters().into_iter().enumerate() {
            filters.push(FilterSetup::new(&name, index, f).map_err(|e| format!("filter {}: {e}", i + 1))?);
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
            backend_fds: storage.fds,
            image_formats: storage.formats,
            io_timeout_ms: cfg.watchdog_ms(),
            chain: Mutex::new(ChainSetup { tap: Tap::Passthrough, filters: Vec::new(), snapshot: None }),
            state_fd,
            below_state_fd,
            index,
            policy: sandbox,
            card: storage.card,
            rbd: storage.rbd,
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
        change(&mut self.layout.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Changes the chain for the next generation: `change` edits it and says what it did, or
    /// refuses (and the chain stays as it was).
    pub(crate) fn change_chain<T>(&self, change: impl FnOnce(&mut ChainSetup) -> Result<T, String>) -> Result<T, String> {
        let mut chain = self.chain.lock().unwrap_or_else(|e| e.into_inner());
        let mut next = chain.clone();
        let out = change(&mut next)?;
        *chain = next;
        Ok(out)
    }

    /// Opens what the filters need before their first generation, from the bottom of the
    /// chain up, each over the device the filters below it make: a `cow` filter's overlay is
    /// made the size of that device, and a `crypt` filter's LUKS header is read from it. Where
    /// that device is the backend's own bytes (memory, a raw file, through filters that move
    /// no data) the header is read from the storage directly; otherwise (a qcow2 image, a
    /// remote server, a `cow` below) the filters below run in a domain of their own for the
    /// read, so the header is read exactly as the filter will see it. Sets the chain to
    /// `filters` under `tap`; returns the size of the device they make.
    fn prepare_filters(&mut self, mut filters: Vec<FilterSetup>, tap: Tap) -> Result<u64, String> {
        let mut size = self.backend_size;
        let (mut crypt, mut cow) = (false, false);
        while let Some(mut f) = filters.pop() {
            let i = filters.len();
            let below = &self.chain.get_mut().unwrap_or_else(|e| e.into_inner()).filters;
            let direct = below.iter().all(|b| !b.spec.transforms());
            let no_filter_below = below.is_empty();
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
                        BackendConfig::File { format, path, .. } if no_filter_below => Some((
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
            self.chain.get_mut().unwrap_or_else(|e| e.into_inner()).filters.insert(0, Arc::new(f));
        }
        self.chain.get_mut().unwrap_or_else(|e| e.into_inner()).tap = tap;
        self.size = size;
        Ok(size)
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
            BackendConfig::Null | BackendConfig::Nbd { .. } | BackendConfig::Rbd { .. } => None,
        }
    }

    /// Runs `f` with a reader of the device the current chain makes (`self.size` bytes): a
    /// domain of its own serves it, in passthrough, and is ended afterwards.
    fn read_through<T>(&self, f: impl FnOnce(&mut bulkhead_crypt::ReadAt<'_>) -> Result<T, String>) -> Result<T, String> {
        let Launched { fronts, domains, .. } =
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
        let (domains, _) = { domains }.take_all();
        for d in domains {
            discard(d.child);
        }
        out
    }

    /// An `rbd` device's size when the configuration gives none: its image's, in whole
    /// sectors, as a domain started for the purpose finds it once it has opened the image (it
    /// tells its broker, [`crate::rbd::Opened::image_bytes`], and is ended). Waits up to the
    /// backend's connect and op timeouts.
    fn learn_image_size(&mut self) -> Result<u64, String> {
        let BackendConfig::Rbd { pool, image, connect_timeout_ms, op_timeout_ms, .. } = &self.backend else {
            return Err("only an rbd device learns its size from its backend".into());
        };
        let what = format!("image `{pool}/{image}`");
        let wait = Duration::from_millis(connect_timeout_ms + op_timeout_ms);
        let opened = self.rbd.as_ref().map(|(_, o)| o.clone()).ok_or("an rbd device has its cluster's addresses")?;
        // Any image of at least a sector opens at this size.
        (self.size, self.backend_size) = (512, 512);
        let Launched { domains, .. } =
            self.launch(1).map_err(|e| format!("{what}: cannot start a domain to learn its size: {e}"))?;
        let (mut domains, _) = { domains }.take_all();
        let deadline = Instant::now() + wait;
        let told = loop {
            if let Some(n) = opened.image_bytes() {
                break Ok(n);
            }
            if domains.iter_mut().any(|d| matches!(d.child.try_wait(), Ok(Some(_)))) {
                // What it said before it ended may still be on its way.
                std::thread::sleep(Duration::from_millis(100));
                break opened.image_bytes().ok_or_else(|| {
                    format!("{what}: its domain ended before it opened the image, so its size is unknown (its log lines say why)")
                });
            }
            if Instant::now() >= deadline {
                break Err(format!(
                    "{what}: its domain did not open the image within {} ms, so its size is unknown",
                    wait.as_millis()
                ));
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        // Asked to stop, so that it closes the image: a client killed instead leaves its watch
        // on the image for the cluster to time out, and the next domain's flush and close wait
        // for it (more than 5 s).
        for d in &domains {
            let _ = d.child.signal(libc::SIGTERM);
        }
        for mut d in domains {
            let _ = d.child.wait_timeout(PROBE_STOP);
            discard(d.child);
        }
        let bytes = told? / 512 * 512;
        if bytes == 0 {
            return Err(format!("{what} holds less than one 512-byte sector"));
        }
        log::info!("{}: size {bytes} bytes, the whole of {what}", self.name);
        Ok(bytes)
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
            BackendConfig::Nbd { reconnect_timeout_ms, .. } | BackendConfig::Rbd { reconnect_timeout_ms, .. } => {
                Some(Duration::from_millis(*reconnect_timeout_ms))
            }
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
            // The domain connects itself (through the broker); a cluster whose monitors cannot
            // be reached gets no domain.
            BackendConfig::Rbd { mon_host, connect_timeout_ms, .. } => {
                let (reach, _) = self.rbd.as_ref().ok_or("an rbd device has its cluster's addresses")?;
                reach
                    .probe(Duration::from_millis(*connect_timeout_ms))
                    .map_err(|e| LaunchError::Connect(format!("cluster at {mon_host}: {e}")))?;
                Ok(None)
            }
            _ => Ok(None),
        }
    }

    /// Creates the queues of `generation` and execs the domains holding them and the backend,
    /// laid out as the chain's tap mode says.
    pub(crate) fn launch(&self, generation: u32) -> Result<Launched, LaunchError> {
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
            let (front, fds) = QueueSetup::create(&format!("{}-q{q}", self.name), &qcfg).map_err(|e| e.to_string())?;
            if shape == Shape::Interpose {
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
        match shape {
            Shape::Passthrough | Shape::Intercept => {
                // One domain: the backend's own (passthrough), or a tap domain whose chain ends
                // in the soft device itself (intercept).
                let (backend, ring) = self.backend_spec(&mut upper, conn)?;
                let role = shape.top_role();
                let (mut top, attach_line) = self.spawn(role, upper, queue_specs, backend, Some(&chain), None)?;
                top.rings.extend(ring);
                let domains = match shape {
                    Shape::Intercept => Domains::Intercept { tap: top },
                    _ => Domains::Passthrough { driver: top },
                };
                Ok(Launched { fronts, domains, attach_line })
            }
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
    pub(crate) fn spawn_tap(&self, below: &Below, chain: &ChainSetup) -> Result<Domain, LaunchError> {
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
        Ok(self.spawn("tap", pass, queue_specs, backend, Some(chain), None)?.0)
    }

    /// Execs a driver domain below a tap domain, on the queues of `below` (whose headers the
    /// tap domain has written for `below.generation`). `conn`: a remote backend's connection;
    /// made here if `None` and needed.
    pub(crate) fn spawn_below(&self, below: &Below, conn: Option<OwnedFd>) -> Result<Domain, LaunchError> {
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
        let (mut driver, _) = self.spawn("driver", pass, specs, backend, None, Some(line))?;
        driver.rings.extend(ring);
        Ok(driver)
    }

    /// The backend's part of a spec, its descriptors added to `pass`; and the watch on the
    /// ring lent to an io_uring engine, which the supervisor keeps (see [`RingWatch`]).
    fn backend_spec(&self, pass: &mut Pass, conn: Option<OwnedFd>) -> Result<(BackendSpec, Option<RingWatch>), LaunchError> {
        let spec = match &self.backend {
            BackendConfig::Ram => BackendSpec::Ram { fd: pass.add(&self.backend_fds[0]) },
            BackendConfig::Null => BackendSpec::Null,
            BackendConfig::Vdev { wait, .. } => {
                let card = self.card.as_ref().ok_or("a vdev device has a card")?;
                let ([regs, dma, irq], line) = card.driver_fds()?;
                BackendSpec::Vdev {
                    card: card.card_json().to_string(),
                    wait: wait.as_str().to_string(),
                    fds: [pass.add(regs), pass.add(dma), pass.add(irq), pass.add_owned(line)],
                }
            }
            BackendConfig::Nbd { export, .. } => BackendSpec::Nbd {
                fd: pass.add_owned(conn.ok_or("an nbd backend connects before it launches")?),
                export: export.clone(),
                timeout_ms: self.io_timeout_ms,
            },
            BackendConfig::Rbd {
                mon_host,
                user,
                key_file,
                pool,
                namespace,
                image,
                cache,
                read_only,
                op_timeout_ms,
                connect_timeout_ms,
                lock_break,
                ..
            } => {
                // The key goes through a pipe: the domain reads no file.
                let key =
                    std::fs::read_to_string(key_file).map_err(|e| format!("backend key_file {}: {e}", key_file.display()))?;
                let (key_r, key_w) = bulkhead_sys::pipe().map_err(|e| format!("key pipe: {e}"))?;
                std::io::Write::write_all(&mut std::fs::File::from(key_w), key.trim().as_bytes())
                    .map_err(|e| format!("key pipe: {e}"))?;
                let (owner_r, owner_w) = bulkhead_sys::pipe().map_err(|e| format!("owner pipe: {e}"))?;
                pass.rbd_owner = Some(owner_r);
                let (_, opened) = self.rbd.as_ref().ok_or("an rbd device has its cluster's addresses")?;
                BackendSpec::Rbd {
                    key_fd: pass.add_owned(key_r),
                    owner_fd: pass.add_owned(owner_w),
                    mon_host: mon_host.clone(),
                    user: user.clone(),
                    pool: pool.clone(),
                    namespace: namespace.clone(),
                    image: image.clone(),
                    cache: *cache,
                    read_only: *read_only,
                    op_timeout_ms: *op_timeout_ms,
                    connect_timeout_ms: *connect_timeout_ms,
                    discard_granularity: 4096,
                    break_owners: if *lock_break { opened.owners() } else { Vec::new() },
                }
            }
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
    /// (`above_line`, in `pass` too). Waits for its sandbox report. Returns the domain and the
    /// supervisor's end of its attach line, if it takes attached applications' queues.
    fn spawn(
        &self,
        role: &str,
        mut pass: Pass,
        mut queues: Vec<QueueSpec>,
        backend: BackendSpec,
        chain: Option<&ChainSetup>,
        above_line: Option<[i32; 2]>,
    ) -> Result<(Domain, Option<OwnedFd>), LaunchError> {
        let mut filters = Vec::new();
        let state_fd;
        let mut views = Vec::new();
        let layout = self.layout();
        if let Some(chain) = chain {
            // The upper domain serves the views: the queues come in the launch's order.
            let lanes = layout.lanes();
            if queues.len() == lanes.len() {
                for (q, lane) in queues.iter_mut().zip(lanes) {
                    q.view = lane;
                }
                views = layout.views.iter().map(ViewSetup::spec).collect();
            }
            for f in &chain.filters {
                f.trim_output();
                let state_fd = pass.add(&f.state_fd);
                let output_fd = f.output.as_ref().map(|o| pass.add(o));
                let secret_fd = f.secret.as_ref().map(|o| pass.add(o));
                filters.push(FilterSlot { spec: chain.spec_of(f), state_fd, output_fd, secret_fd, guard: f.guard });
            }
            state_fd = Some(pass.add(&self.state_fd));
        } else {
            // The domain below a tap domain: a page of its own, for what its backend reports
            // (a remote that stopped answering).
            state_fd = Some(pass.add(&self.below_state_fd));
        }
        // The domain the frontend reaches takes attached applications' queues, unless it is a
        // tap domain over a domain below (whose channel has no room for them).
        let mut attach = None;
        let mut attach_line = None;
        let slots = layout.attach_slots();
        if chain.is_some_and(|c| c.tap != Tap::Interpose) && !slots.is_empty() {
            let (ours, theirs) = bulkhead_sys::seqpacket_pair().map_err(|e| format!("attach line: {e}"))?;
            attach = Some(bulkhead_spec::AttachSpec { fd: pass.add_owned(theirs), slots });
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
        let json = serde_json::to_string(&spec).map_err(|e| format!("domain spec: {e}"))?;
        let args: [&std::ffi::OsStr; 3] = ["driver".as_ref(), "--spec".as_ref(), json.as_ref()];
        let raw = std::mem::take(&mut pass.raw);
        let owner_pipe = pass.rbd_owner.take();
        let what = format!("{role} domain");
        let (child, layers) = exec_confined(&self.exe, &args, &raw, pass, &self.name, self.policy, &report_r, &what)?;
        // An rbd domain's connections go through a broker here.
        if let (Some((reach, opened)), Some(fd)) = (&self.rbd, layers.as_ref().and_then(|l| l.connect_listener)) {
            let taken = child.pidfd().try_clone().and_then(|pidfd| {
                let listener = bulkhead_sys::seccomp_notify::pidfd_getfd(child.pidfd().as_fd(), fd)?;
                Ok((pidfd, listener))
            });
            match taken {
                Ok((pidfd, listener)) => {
                    crate::rbd::broker(&self.name, pidfd, listener, owner_pipe, reach.clone(), opened.clone())
                }
                Err(e) => {
                    discard(child);
                    return Err(format!("cannot take the rbd domain's connect listener: {e}").into());
                }
            }
        }
        Ok((Domain { child, layers, rings: Vec::new() }, attach_line))
    }
}

/// The backend's storage as the supervisor opened it.
struct Storage {
    size: u64,
    desc: String,
    fds: Vec<OwnedFd>,
    formats: Vec<bulkhead_image::Format>,
    card: Option<crate::vdev::CardDevice>,
    rbd: Option<(crate::rbd::Reach, crate::rbd::Opened)>,
}

impl Storage {
    /// Opens (or creates) the storage of `backend` for device `name`.
    fn open(name: &str, cfg: &DeviceConfig, backend: &BackendConfig, sandbox: Policy) -> Result<Storage, String> {
        let sized =
            |size: u64, desc: String, fds: Vec<OwnedFd>| Storage { size, desc, fds, formats: Vec::new(), card: None, rbd: None };
        let configured = || cfg.size.as_ref().map(|s| s.get_ref().0);
        match backend {
            BackendConfig::Nbd { uri, target, export, connect_timeout_ms, .. } => {
                let export_size = probe_nbd(target, export, Duration::from_millis(*connect_timeout_ms))
                    .map_err(|e| format!("backend {uri}: {e}"))?;
                let size = match configured() {
                    Some(s) if s > export_size => return Err(format!("size {s} exceeds the {export_size} bytes of {uri}")),
                    Some(s) => s,
                    None => export_size / 512 * 512,
                };
                if size == 0 {
                    return Err(format!("{uri} is empty"));
                }
                Ok(sized(size, format!("nbd:{uri}"), Vec::new()))
            }
            BackendConfig::Rbd { mon_host, networks, pool, namespace, image, read_only, .. } => {
                // Without `size`, the image's: `Launcher::open` asks a domain for it.
                let size = configured().unwrap_or(0);
                let reach = crate::rbd::Reach::resolve(mon_host, networks).map_err(|e| format!("backend mon_host: {e}"))?;
                let ns = if namespace.is_empty() { String::new() } else { format!("{namespace}/") };
                let desc = format!("rbd:{pool}/{ns}{image}{}", if *read_only { ",ro" } else { "" });
                Ok(Storage { rbd: Some((reach, crate::rbd::Opened::of_device(name))), ..sized(size, desc, Vec::new()) })
            }
            BackendConfig::Ram => {
                let size = configured().ok_or("size is required for a ram device")?;
                let kept_as = crate::kept::ram_name(name);
                let fd = match crate::kept::store().and_then(|s| s.take(&kept_as)) {
                    // The contents a `serve` before this one left, kept across its end.
                    Some(fd) => {
                        let have = memfd::size_of(fd.as_raw_fd()).map_err(|e| format!("kept ramdisk: {e}"))?;
                        if have != size {
                            return Err(format!("the kept ramdisk holds {have} bytes, and size is {size}"));
                        }
                        log::info!("{name}: the ramdisk's contents were kept across the restart of serve");
                        fd
                    }
                    None => {
                        let fd = memfd::create(&format!("bulkhead-{name}-ram"), size).map_err(|e| format!("ramdisk: {e}"))?;
                        memfd::seal_size(fd.as_raw_fd()).map_err(|e| format!("ramdisk: {e}"))?;
                        fd
                    }
                };
                if let Some(s) = crate::kept::store() {
                    s.keep(&kept_as, fd.as_fd());
                }
                Ok(sized(size, "ram".into(), vec![fd]))
            }
            BackendConfig::Null => {
                Ok(sized(configured().ok_or("size is required for a null device")?, "null".into(), Vec::new()))
            }
            BackendConfig::Vdev { card, wait } => {
                let size = configured().ok_or("size is required for a vdev device")?;
                let c = crate::vdev::CardDevice::start(name, card, size, sandbox)?;
                let desc = crate::vdev::describe(card, c.name(), *wait);
                Ok(Storage { card: Some(c), ..sized(size, desc, Vec::new()) })
            }
            BackendConfig::File { path, read_only, format: ImageFormat::Qcow2, .. } => {
                let chain = crate::image::open_chain(path, *read_only)?;
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
                Ok(Storage { size: chain.size, desc, fds: chain.fds, formats: chain.formats, card: None, rbd: None })
            }
            BackendConfig::File { path, direct, engine, read_only, .. } => {
                let main = open_backing(path, *read_only, *direct)
                    .map_err(|e| format!("cannot open backing file {}: {e}", path.display()))?;
                let file_size = bulkhead_sys::storage_size(main.as_fd()).map_err(|e| format!("{}: {e}", path.display()))?.0;
                let size = match configured() {
                    Some(s) if s > file_size => {
                        return Err(format!("size {s} exceeds the {file_size} bytes of {}", path.display()))
                    }
                    Some(s) => s,
                    None => file_size / 512 * 512,
                };
                if size == 0 {
                    return Err(format!("{} is empty", path.display()));
                }
                let mut fds = vec![main];
                if *direct {
                    fds.push(
                        open_backing(path, *read_only, false)
                            .map_err(|e| format!("cannot open backing file {}: {e}", path.display()))?,
                    );
                }
                let desc = format!(
                    "file:{}{}{}{}",
                    path.display(),
                    if *direct { ",direct" } else { "" },
                    if *engine == Engine::IoUring { ",io_uring" } else { "" },
                    if *read_only { ",ro" } else { "" }
                );
                Ok(sized(size, desc, fds))
            }
        }
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
    let info = bulkhead_nbd::client::handshake(sock.as_fd(), export, timeout).map_err(|e| e.to_string())?;
    bulkhead_nbd::client::disconnect(sock.as_fd());
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

/// Descriptors handed to a domain, which finds them at 3, 4, … in the order added.
#[derive(Default)]
struct Pass {
    raw: Vec<i32>,
    /// Descriptors made for this domain alone, closed here once it holds its copies.
    owned: Vec<OwnedFd>,
    /// Rings lent to it, closed here once it holds its copies (the watch keeps each).
    lent: Vec<uring::LentRing>,
    /// An rbd domain's owner pipe (read end), for its broker.
    rbd_owner: Option<OwnedFd>,
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
        log::info!("device {device}: {} is on {fs}; the file backend uses the sync engine", path.display());
        return Engine::Sync;
    }
    match uring::lend(uring::FILE_ENGINE) {
        Ok(_) => Engine::IoUring,
        Err(e) => {
            log::info!("device {device}: io_uring is unavailable ({e}); the file backend uses the sync engine");
            Engine::Sync
        }
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
