//! `bulkhead serve`: supervisor, driver domains, exports, control socket; clean shutdown.

use std::fs::File;
use std::io::{Read, Seek, Write};
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::{bail, Context};
use bulkhead_config::{Config, FuseUring};
use bulkhead_control::{Access, ControlServer};
use bulkhead_fuse_export::{FuseExport, FuseOptions, UringMode};
use bulkhead_nbd_export::{socket_path, Listeners, NbdServer, ServerConfig};
use bulkhead_supervisor::Supervisor;
use bulkhead_vhost_export::{socket_dir, VhostExport};
use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM, SIGUSR2};
use signal_hook::iterator::Signals;

use crate::api::ServeApi;
use crate::exports::{Exports, Offer, Running};
use crate::kept::{Keeper, Kept};
use crate::live::Live;
use crate::upgrade;

/// The exclusive lock on a run directory, held for the life of `serve` (and of its keeper,
/// which hands it to each `serve` it starts).
struct RunLock {
    file: File,
    path: PathBuf,
    /// Remove the lock file when dropped: not after a hand-over to the next `serve`.
    remove: bool,
}

impl RunLock {
    fn acquire(run_dir: &Path) -> anyhow::Result<RunLock> {
        let path = run_dir.join("serve.lock");
        let mut file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .with_context(|| format!("cannot open {}", path.display()))?;
        if !bulkhead_sys::lock_exclusive(file.as_fd()).with_context(|| format!("cannot lock {}", path.display()))? {
            let mut pid = String::new();
            let _ = file.read_to_string(&mut pid);
            bail!(
                "another bulkhead serve (pid {}) is already running on run dir {}",
                pid.trim().parse::<u32>().map(|p| p.to_string()).unwrap_or_else(|_| "?".into()),
                run_dir.display()
            );
        }
        file.set_len(0)?;
        file.rewind()?;
        write!(file, "{}", std::process::id())?;
        Ok(RunLock { file, path, remove: true })
    }

    /// The lock an earlier `serve` or the keeper held, handed over.
    fn adopt(run_dir: &Path, fd: std::os::fd::OwnedFd) -> RunLock {
        RunLock { file: File::from(fd), path: run_dir.join("serve.lock"), remove: true }
    }

    /// The locked file, for the keeper to hold; the lock file stays.
    fn into_file(mut self) -> anyhow::Result<File> {
        self.remove = false;
        Ok(self.file.try_clone()?)
    }
}

impl Drop for RunLock {
    fn drop(&mut self) {
        if self.remove {
            let _ = std::fs::remove_file(&self.path);
        }
        let _ = &self.file;
    }
}

fn is_mountpoint(p: &Path) -> bool {
    let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return false;
    };
    let want = p.to_string_lossy();
    info.lines().any(|l| l.split(' ').nth(4).is_some_and(|m| m == want))
}

/// A FUSE mount left by a serve that was killed is dead (ENOTCONN); detach it.
fn clear_stale_mount(dir: &Path) {
    if is_mountpoint(dir) {
        log::warn!("removing a stale FUSE mount at {} left by an earlier serve", dir.display());
        if let Err(e) = bulkhead_sys::detach_mount(dir) {
            log::warn!("cannot detach the stale mount at {}: {e}", dir.display());
        }
    }
}

fn human(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut u = 0;
    while v >= 1024.0 && u < UNITS.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    format!("{v:.1} {}", UNITS[u]).replace(".0 ", " ")
}

/// What `serve` runs, ended in the reverse order of its start on every path: a start that
/// fails part way (each `?` drops what started before it), a stop, a hand-over to the next
/// `serve`. The supervisor and the exports live in [`Live`], which the control socket shares.
struct Serving {
    live: Arc<Live>,
    run_lock: Option<RunLock>,
    control: Option<ControlServer>,
    metrics: Option<crate::metrics::Endpoint>,
    watchdog: Option<crate::notify::Watchdog>,
    /// End as a hand-over: what the keeper holds stays for the next `serve`.
    handing_over: bool,
    /// Whether the FUSE unmount was clean, once ended.
    clean: Option<bool>,
}

impl Serving {
    fn sup(&self) -> &Arc<Supervisor> {
        &self.live.sup
    }

    /// Stops accepting (control first, then the exports: workers finish the request in hand,
    /// each guest's queues are drained before its session ends), flushes every device and
    /// ends the domains. Returns whether the FUSE unmount was clean. Later calls do nothing.
    fn end(&mut self) -> bool {
        if let Some(clean) = self.clean {
            return clean;
        }
        drop(self.watchdog.take());
        if let Some(mut c) = self.control.take() {
            c.stop();
        }
        drop(self.metrics.take());
        let clean = if self.handing_over {
            self.live.exports.release();
            true
        } else {
            self.live.exports.stop()
        };
        self.live.sup.shutdown();
        if let Some(mut lock) = self.run_lock.take() {
            lock.remove = !self.handing_over;
        }
        self.clean = Some(clean);
        clean
    }
}

impl Drop for Serving {
    fn drop(&mut self) {
        self.end();
    }
}

/// The group id a socket is to be given (`key` names the setting in errors).
fn socket_group(group: Option<&toml::Spanned<String>>, key: &str) -> anyhow::Result<Option<u32>> {
    group
        .map(|g| Access::with_group(g.get_ref()).map(|a| a.group).map_err(|e| anyhow::anyhow!("key `{key}`: {e}")))
        .transpose()
        .map(Option::flatten)
}

/// `bulkhead config check FILE`: the file parsed and validated as `serve` would, and what it
/// would serve.
pub fn check_config(path: &Path, out: crate::status::Out) -> anyhow::Result<ExitCode> {
    let config = match Config::load(path) {
        Ok(c) => c,
        // With --json the error is an answer too: `valid` false, and serve's message.
        Err(e) if out == crate::status::Out::Json => {
            out.json(&serde_json::json!({ "file": path, "valid": false, "error": format!("{e:#}") }))?;
            return Ok(ExitCode::from(1));
        }
        Err(e) => return Err(e.into()),
    };
    let run_dir = crate::run_dir::for_serve(None, config.run_dir.as_ref().map(|d| d.get_ref().as_path()));
    let exports: Vec<&str> = [
        (config.fuse.enabled, "fuse"),
        (config.nbd.enabled, "nbd"),
        (config.vhost_user.enabled, "vhost_user"),
        (config.ublk.enabled, "ublk"),
    ]
    .into_iter()
    .filter_map(|(on, name)| on.then_some(name))
    .collect();
    let views: usize = config.devices.iter().map(|d| d.views.len()).sum();
    let json = serde_json::json!({
        "file": path, "valid": true, "devices": config.devices.iter().map(|d| d.name.get_ref().as_str()).collect::<Vec<_>>(),
        "views": views, "exports": exports, "keeper": config.keeper.enabled, "run_dir": run_dir,
    });
    if out.json(&json)? {
        return Ok(ExitCode::SUCCESS);
    }
    println!(
        "{}: valid: {} device(s), {views} view(s); exports: {}; keeper {}; run dir {} (unless --run-dir or BULKHEAD_RUN_DIR)",
        path.display(),
        config.devices.len(),
        if exports.is_empty() { "none".to_string() } else { exports.join(", ") },
        if config.keeper.enabled { "on" } else { "off" },
        run_dir.display()
    );
    Ok(ExitCode::SUCCESS)
}

/// `bulkhead serve`: the configuration at `config_path` (or the embedded default) in the run
/// directory `run_dir` gives or the configuration names, until SIGINT or SIGTERM.
pub fn run(config_path: Option<&Path>, run_dir: Option<PathBuf>) -> anyhow::Result<ExitCode> {
    let config = match config_path {
        Some(p) => Config::load(p)?,
        None => Config::embedded_default(),
    };
    let run_dir = crate::run_dir::for_serve(run_dir, config.run_dir.as_ref().map(|d| d.get_ref().as_path()));
    let run_dir = run_dir.as_path();
    crate::logging::set_level(config.log.level);
    // A serve of many devices holds many descriptors: allow as many as the hard limit does.
    if let Err(e) = bulkhead_sys::raise_open_files_limit() {
        log::warn!("cannot raise the limit on open files: {e}");
    }
    let keeper = Keeper::of_this_process(config.keeper.enabled);
    if config.keeper.enabled && keeper == Keeper::None {
        // This process becomes the keeper, and the `serve` it starts does the work.
        std::fs::create_dir_all(run_dir).with_context(|| format!("cannot create run dir {}", run_dir.display()))?;
        let run_dir = run_dir.canonicalize().with_context(|| format!("run dir {}", run_dir.display()))?;
        let lock = RunLock::acquire(&run_dir)?.into_file()?;
        clear_stale_mount(&run_dir.join("fuse"));
        let give_up = std::time::Duration::from_millis(*config.keeper.give_up_ms.get_ref());
        return crate::keeper::run(&run_dir, lock, give_up);
    }
    let kept = Arc::new(Kept::from_env(keeper));
    let fell_back = std::env::var(crate::kept::FELL_BACK_ENV).ok().filter(|_| keeper == Keeper::Own);
    if let Some(why) = &fell_back {
        log::error!("{why}: this serve runs the binary of the serve before it");
    }
    let parent = std::os::unix::process::parent_id();
    // Signals first, so a SIGTERM during start-up is not lost.
    let mut signals = Signals::new([SIGINT, SIGTERM, SIGHUP, SIGUSR2]).context("cannot install signal handlers")?;
    std::fs::create_dir_all(run_dir).with_context(|| format!("cannot create run dir {}", run_dir.display()))?;
    let run_dir = run_dir.canonicalize().with_context(|| format!("run dir {}", run_dir.display()))?;
    let run_lock = match kept.take_all("lock").pop() {
        Some(fd) => RunLock::adopt(&run_dir, fd),
        None => RunLock::acquire(&run_dir)?,
    };
    kept.keep_fds("lock", &[run_lock.file.as_fd()]);
    let config = if kept.takes_over() { config_taken_over(config, config_path, &kept, keeper) } else { config };
    if !kept.takes_over() {
        clear_stale_mount(&run_dir.join("fuse"));
    }
    let start = Start { config: &config, config_path, run_dir: &run_dir, kept: &kept, keeper, fell_back };
    let mut serving = start.serve(run_lock)?;
    crate::notify::ready(serving.sup());
    serving.watchdog = crate::notify::Watchdog::start(serving.sup().clone());

    let sig = wait_for_signal(&mut signals, &serving.live);
    if sig == SIGUSR2 {
        // An upgrade: everything the keeper holds stays as it is for the next serve.
        log::info!("handing over to a new serve ({} holds the descriptors)", keeper.name());
        kept.hand_over();
        serving.handing_over = true;
        serving.end();
        log::info!("handed over");
        return Ok(ExitCode::SUCCESS);
    }
    if keeper == Keeper::Own && std::os::unix::process::parent_id() != parent {
        log::error!("the keeper (pid {parent}) has died: shutting down, since a crash could no longer be survived");
    }
    log::info!("{} received; shutting down", if sig == SIGINT { "SIGINT" } else { "SIGTERM" });
    crate::notify::stopping();
    let clean = serving.end();
    log::info!("stopped{}", if clean { "" } else { " (the FUSE mount was busy and was detached lazily)" });
    Ok(ExitCode::SUCCESS)
}

/// What the `serve` before this one ran (the devices and views added since its start too), or
/// `config` if it kept none that parses.
fn config_taken_over(config: Config, config_path: Option<&Path>, kept: &Kept, keeper: Keeper) -> Config {
    let mut config = config;
    if let Some(text) = kept.take_text("config") {
        match Config::parse(&text, "the configuration kept across a restart of serve") {
            Ok(c) => config = c,
            Err(e) => log::warn!(
                "{e}; serving {} instead",
                config_path.map_or("the embedded default".into(), |p| p.display().to_string())
            ),
        }
    }
    log::info!("taking over from the serve before this one ({} holds its descriptors)", keeper.name());
    config
}

/// Waits for the signal that ends `serve`, reloading on SIGHUP meanwhile: SIGINT, SIGTERM, or
/// SIGUSR2 for an upgrade that was asked for.
fn wait_for_signal(signals: &mut Signals, live: &Live) -> i32 {
    loop {
        match signals.forever().next().unwrap_or(SIGTERM) {
            SIGUSR2 if upgrade::requested() => return SIGUSR2,
            SIGUSR2 => {}
            SIGHUP => {
                log::info!("SIGHUP received; reloading the configuration");
                crate::notify::reloading();
                match live.reload() {
                    Ok(r) => log::info!("reload applied: added {:?}, removed {:?}, changed {:?}", r.added, r.removed, r.changed),
                    Err(e) => log::warn!("reload refused: {}", e.message),
                }
                crate::notify::ready(&live.sup);
            }
            sig => return sig,
        }
    }
}

/// What a start needs to know.
struct Start<'a> {
    config: &'a Config,
    config_path: Option<&'a Path>,
    run_dir: &'a Path,
    kept: &'a Arc<Kept>,
    keeper: Keeper,
    fell_back: Option<String>,
}

impl Start<'_> {
    /// Starts the supervisor, the exports, the control socket and the metrics, in that order.
    fn serve(&self, run_lock: RunLock) -> anyhow::Result<Serving> {
        let config = self.config;
        // What must outlive this serve is kept where its keeper (or systemd) holds it.
        let store = (self.keeper != Keeper::None).then(|| self.kept.clone() as Arc<dyn bulkhead_supervisor::kept::FdStore>);
        if config.ublk.enabled {
            // Before any domain starts: a host without ublk is told so at once.
            bulkhead_ublk_export::probe().map_err(|e| anyhow::anyhow!("key `ublk.enabled`: {e}"))?;
        }
        let sup = Arc::new(Supervisor::start_keeping(config, None, store)?);
        let live = Arc::new(Live::new(
            sup.clone(),
            Exports::default(),
            config.clone(),
            self.config_path.map(|p| p.canonicalize().unwrap_or_else(|_| p.to_path_buf())),
        ));
        let mut serving = Serving {
            live: live.clone(),
            run_lock: Some(run_lock),
            control: None,
            metrics: None,
            watchdog: None,
            handing_over: false,
            clean: None,
        };
        let offers = Offer::all(config, &sup.devices());
        let mut fuse_transport = None;
        if let Some(f) = self.fuse(&sup)? {
            fuse_transport = Some(f.transport().to_string());
            live.exports.push(Running::Fuse(f));
        }
        let tls_note = match self.nbd(&offers)? {
            Some((n, note)) => {
                live.exports.push(Running::Nbd(n));
                note
            }
            None => String::new(),
        };
        if config.vhost_user.enabled {
            let devices = offers.iter().filter(|o| o.vhost_user).map(|o| o.front.clone()).collect();
            let group = socket_group(config.vhost_user.group.as_ref(), "vhost_user.group")?;
            let v = VhostExport::start(&socket_dir(self.run_dir), devices, group).context("vhost-user export")?;
            live.exports.push(Running::VhostUser(v));
        }
        if config.ublk.enabled {
            let settings = bulkhead_ublk_export::Settings {
                dir: self.run_dir.join("ublk"),
                depth: *config.ublk.depth.get_ref(),
                recovery: self.keeper != Keeper::None,
                numbers: config.ublk_numbers(),
            };
            let devices = offers.iter().filter(|o| o.ublk).map(|o| o.front.clone()).collect();
            let u = bulkhead_ublk_export::UblkExport::start(settings, devices).context("ublk export")?;
            live.exports.push(Running::Ublk(u));
        }
        if self.keeper != Keeper::None {
            live.keep_config(self.kept.clone());
        }
        serving.control = Some(self.control(&live)?);
        serving.metrics = match config.metrics.listen() {
            Some(at) => Some(crate::metrics::Endpoint::start(&at, live.clone())?),
            None => None,
        };
        self.announce(&serving, fuse_transport.as_deref(), &tls_note);
        Ok(serving)
    }

    /// The FUSE export, if it is on: the session a keeper holds taken over, or a new mount.
    fn fuse(&self, sup: &Supervisor) -> anyhow::Result<Option<FuseExport>> {
        let config = self.config;
        if !config.fuse.enabled {
            return Ok(None);
        }
        let fuse_dir = self.run_dir.join("fuse");
        let kept_fuse = self.kept.take_all("fuse");
        let kept_fuse_state = self.kept.take_text("fuse-state");
        let f = if !kept_fuse.is_empty() {
            FuseExport::adopt(&fuse_dir, sup.devices(), kept_fuse, kept_fuse_state.as_deref().unwrap_or("{}"))
                .context("FUSE export (taking over the kept session)")?
        } else {
            let opts = FuseOptions {
                threads: *config.fuse.threads.get_ref() as usize,
                io_uring: match config.fuse.io_uring {
                    FuseUring::Auto => UringMode::Auto,
                    FuseUring::On => UringMode::On,
                    FuseUring::Off => UringMode::Off,
                },
                queue_depth: *config.fuse.queue_depth.get_ref() as usize,
                kept: self.keeper != Keeper::None,
            };
            FuseExport::mount_with(&fuse_dir, sup.devices(), opts).context("FUSE export (needs root and /dev/fuse)")?
        };
        self.kept.keep_fds("fuse", &f.session_fds());
        let k = self.kept.clone();
        f.keep_state(move |state| k.keep_text("fuse-state", &state));
        Ok(Some(f))
    }

    /// The NBD export, if it is on, with how it offers TLS, in words for the log.
    fn nbd(&self, offers: &[Offer]) -> anyhow::Result<Option<(NbdServer, String)>> {
        use bulkhead_nbd_export::tls::{Tls, TlsMode};
        let config = self.config;
        if !config.nbd.enabled {
            return Ok(None);
        }
        let mode = match config.nbd.tls.get_ref() {
            bulkhead_config::NbdTls::Off => None,
            bulkhead_config::NbdTls::On => Some(TlsMode::On),
            bulkhead_config::NbdTls::Require => Some(TlsMode::Require),
        };
        // The configuration's check makes exactly one of the two present when TLS is on.
        let loaded = match (mode, &config.nbd.tls_certificates, &config.nbd.tls_psk) {
            (None, ..) | (_, None, None) => None,
            (Some(mode), Some(dir), _) => {
                Some(Tls::load(dir.get_ref(), mode, config.nbd.tls_verify_peer).map_err(|e| ("tls_certificates", e)))
            }
            (Some(mode), None, Some(file)) => Some(Tls::load_psk(file.get_ref(), mode).map_err(|e| ("tls_psk", e))),
        };
        let tls = loaded.transpose().map_err(|(key, e)| anyhow::anyhow!("NBD export: key `nbd.{key}`: {e}"))?;
        let tls_note = match &tls {
            Some(t) => {
                let when = if t.mode == TlsMode::Require { "required of TCP clients" } else { "offered" };
                format!("; TLS with {} {when}", t.kind())
            }
            None => String::new(),
        };
        let cfg = ServerConfig {
            unix: Some(socket_path(self.run_dir)),
            tcp: config.nbd.tcp.as_ref().map(|t| t.get_ref().clone()),
            max_connections: *config.nbd.max_connections.get_ref() as usize,
            workers_per_connection: *config.nbd.workers.get_ref() as usize,
            handshake_timeout: std::time::Duration::from_millis(*config.nbd.handshake_timeout_ms.get_ref()),
            request_timeout: std::time::Duration::from_millis(*config.nbd.request_timeout_ms.get_ref()),
            tls,
        };
        let exports = offers.iter().map(|o| bulkhead_nbd_export::Export::new(o.front.clone(), o.reach.clone())).collect();
        let adopted = Listeners { unix: self.kept.take_all("nbd-unix").pop(), tcp: self.kept.take_all("nbd-tcp").pop() };
        let group = socket_group(config.nbd.group.as_ref(), "nbd.group")?;
        let n = NbdServer::start_with(exports, cfg, adopted).context("NBD export")?;
        if let Some(g) = group {
            let path = socket_path(self.run_dir);
            bulkhead_sys::share_with_group(&path, g)
                .with_context(|| format!("key `nbd.group`: cannot give {} to group {g}", path.display()))?;
        }
        match n.listeners() {
            Ok(l) => {
                for (name, fd) in [("nbd-unix", l.unix), ("nbd-tcp", l.tcp)] {
                    if let Some(fd) = fd {
                        self.kept.keep_fds(name, &[fd.as_fd()]);
                    }
                }
            }
            Err(e) => log::warn!("cannot keep the NBD listening sockets: {e}"),
        }
        Ok(Some((n, tls_note)))
    }

    /// The control socket, answering through `live`.
    fn control(&self, live: &Arc<Live>) -> anyhow::Result<ControlServer> {
        let access = match &self.config.control.group {
            None => Access::owner_only(),
            Some(g) => Access::with_group(g.get_ref()).map_err(|e| anyhow::anyhow!("key `control.group`: {e}"))?,
        };
        let api = Arc::new(ServeApi { live: live.clone(), keeper: self.keeper, fell_back: self.fell_back.clone() });
        let attacher = live.sup.clone();
        ControlServer::start(
            &bulkhead_control::socket_path(self.run_dir),
            access,
            api,
            Some(Arc::new(move |conn, req| attacher.attach_session(conn, req))),
        )
        .with_context(|| format!("cannot bind {}", self.run_dir.join("control.sock").display()))
    }

    /// Says in the log what serves where.
    fn announce(&self, serving: &Serving, fuse: Option<&str>, tls_note: &str) {
        let (config, run_dir) = (self.config, self.run_dir);
        let fuse_dir = run_dir.join("fuse");
        for d in serving.sup().status().devices {
            let at = if fuse.is_some() { format!(" at {}", fuse_dir.join(&d.name).display()) } else { String::new() };
            log::info!(
                "serving {} ({} {}, {} notification, driver pid {}){at}",
                d.name,
                human(d.size_bytes),
                d.backend,
                d.mode,
                d.driver_pid
            );
        }
        if let Some(f) = &fuse {
            log::info!("FUSE export at {} over {f}", fuse_dir.display());
        }
        if config.nbd.enabled {
            let tcp = config.nbd.tcp.as_ref().map(|t| format!(" and TCP {}", t.get_ref())).unwrap_or_default();
            log::info!("NBD export on {}{tcp} (export name = device name){tls_note}", socket_path(run_dir).display());
        }
        if let Some(v) = serving.live.exports.vhost_status() {
            let n = v.len();
            log::info!(
                "vhost-user-blk export of {n} device{} in {}",
                if n == 1 { "" } else { "s" },
                socket_dir(run_dir).display()
            );
        }
        if let Some(m) = &serving.metrics {
            log::info!("metrics at {}", m.address);
        }
        log::info!("control socket {}; reload with SIGHUP, stop with SIGINT or SIGTERM", run_dir.join("control.sock").display());
    }
}
