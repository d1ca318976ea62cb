//! `bulkhead serve`: supervisor, driver domains, exports, control socket; clean shutdown.

use std::fs::File;
use std::io::{Read, Seek, Write};
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use anyhow::{bail, Context};
use bulkhead_config::{Config, FuseUring};
use bulkhead_control::{Access, ControlServer};
use bulkhead_fuse_export::{FuseExport, FuseOptions, UringMode};
use bulkhead_nbd_export::{socket_path, Listeners, NbdServer, ServerConfig};
use bulkhead_supervisor::Supervisor;

use crate::api::ServeApi;
use crate::kept::{Keeper, Kept};
use crate::live::{Exports, Live};
use bulkhead_vhost_export::{socket_dir, VhostExport};
use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM, SIGUSR2};
use signal_hook::iterator::Signals;

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

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
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

/// Asked for by the `upgrade` call; SIGUSR2 wakes the main loop to see it.
static UPGRADE: AtomicBool = AtomicBool::new(false);

/// Starts the hand-over to a new `serve` (the `upgrade` call): the main loop does it.
pub fn request_upgrade() {
    UPGRADE.store(true, Ordering::Release);
    let _ = bulkhead_sys::signal(std::process::id(), SIGUSR2);
}

pub fn run(config_path: Option<&Path>, run_dir: &Path) -> anyhow::Result<ExitCode> {
    let mut config = match config_path {
        Some(p) => Config::load(p)?,
        None => Config::embedded_default(),
    };
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
    if keeper != Keeper::None {
        bulkhead_supervisor::kept::install(kept.clone());
    }
    let parent = std::os::unix::process::parent_id();
    // Signals first, so a SIGTERM during start-up is not lost.
    let mut signals = Signals::new([SIGINT, SIGTERM, SIGHUP, SIGUSR2]).context("cannot install signal handlers")?;
    std::fs::create_dir_all(run_dir).with_context(|| format!("cannot create run dir {}", run_dir.display()))?;
    let run_dir = run_dir.canonicalize().with_context(|| format!("run dir {}", run_dir.display()))?;
    let mut run_lock = match kept.take_all("lock").pop() {
        Some(fd) => RunLock::adopt(&run_dir, fd),
        None => RunLock::acquire(&run_dir)?,
    };
    kept.keep_fds("lock", &[run_lock.file.as_fd()]);
    let fuse_dir = run_dir.join("fuse");
    let takes_over = kept.takes_over();
    if takes_over {
        // What ran before: the devices and views added since start too.
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
    } else {
        clear_stale_mount(&fuse_dir);
    }

    let sup = Arc::new(Supervisor::start(&config, None)?);
    let kept_fuse = kept.take_all("fuse");
    let kept_fuse_state = kept.take_text("fuse-state");
    let fuse = if config.fuse.enabled && !kept_fuse.is_empty() {
        match FuseExport::adopt(&fuse_dir, sup.devices(), kept_fuse, kept_fuse_state.as_deref().unwrap_or("{}")) {
            Ok(f) => Some(f),
            Err(e) => {
                sup.shutdown();
                return Err(anyhow::Error::new(e).context("FUSE export (taking over the kept session)"));
            }
        }
    } else if config.fuse.enabled {
        let opts = FuseOptions {
            threads: *config.fuse.threads.get_ref() as usize,
            io_uring: match config.fuse.io_uring {
                FuseUring::Auto => UringMode::Auto,
                FuseUring::On => UringMode::On,
                FuseUring::Off => UringMode::Off,
            },
            queue_depth: *config.fuse.queue_depth.get_ref() as usize,
            kept: keeper != Keeper::None,
        };
        match FuseExport::mount_with(&fuse_dir, sup.devices(), opts) {
            Ok(f) => Some(f),
            Err(e) => {
                sup.shutdown();
                return Err(anyhow::Error::new(e).context("FUSE export (needs root and /dev/fuse)"));
            }
        }
    } else {
        None
    };
    if let Some(f) = &fuse {
        kept.keep_fds("fuse", &f.session_fds());
        let k = kept.clone();
        f.keep_state(move |state| k.keep_text("fuse-state", &state));
    }
    let mut tls_note = String::new();
    let nbd = if config.nbd.enabled {
        use bulkhead_nbd_export::tls::{Tls, TlsMode};
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
        let tls = match loaded.transpose() {
            Ok(t) => t,
            Err((key, e)) => {
                drop(fuse);
                sup.shutdown();
                return Err(anyhow::anyhow!("NBD export: key `nbd.{key}`: {e}"));
            }
        };
        if let Some(t) = &tls {
            let when = if t.mode == TlsMode::Require { "required of TCP clients" } else { "offered" };
            tls_note = format!("; TLS with {} {when}", t.kind());
        }
        let cfg = ServerConfig {
            unix: Some(socket_path(&run_dir)),
            tcp: config.nbd.tcp.as_ref().map(|t| t.get_ref().clone()),
            max_connections: *config.nbd.max_connections.get_ref() as usize,
            workers_per_connection: *config.nbd.workers.get_ref() as usize,
            handshake_timeout: std::time::Duration::from_millis(*config.nbd.handshake_timeout_ms.get_ref()),
            request_timeout: std::time::Duration::from_millis(*config.nbd.request_timeout_ms.get_ref()),
            allow: config
                .devices
                .iter()
                .flat_map(|d| {
                    let own = bulkhead_config::allow_list(&d.nbd_allow).map(|a| (d.name.get_ref().clone(), a));
                    let views = d
                        .views
                        .iter()
                        .filter_map(|v| bulkhead_config::allow_list(&v.nbd_allow).map(|a| (v.name.get_ref().clone(), a)));
                    own.into_iter().chain(views)
                })
                .collect(),
            tls,
        };
        let adopted = Listeners { unix: kept.take_all("nbd-unix").pop(), tcp: kept.take_all("nbd-tcp").pop() };
        match NbdServer::start_with(sup.devices(), cfg, adopted) {
            Ok(n) => {
                match n.listeners() {
                    Ok(l) => {
                        for (name, fd) in [("nbd-unix", l.unix), ("nbd-tcp", l.tcp)] {
                            if let Some(fd) = fd {
                                kept.keep_fds(name, &[fd.as_fd()]);
                            }
                        }
                    }
                    Err(e) => log::warn!("cannot keep the NBD listening sockets: {e}"),
                }
                Some(n)
            }
            Err(e) => {
                drop(fuse);
                sup.shutdown();
                return Err(anyhow::Error::new(e).context("NBD export"));
            }
        }
    } else {
        None
    };
    let vhost = if config.vhost_user.enabled {
        let devices = sup.devices().into_iter().filter(|d| config.vhost_user_exports(d.name())).collect();
        match VhostExport::start(&socket_dir(&run_dir), devices) {
            Ok(v) => Some(Arc::new(v)),
            Err(e) => {
                drop(nbd);
                drop(fuse);
                sup.shutdown();
                return Err(anyhow::Error::new(e).context("vhost-user export"));
            }
        }
    } else {
        None
    };
    let access = match &config.control.group {
        None => Ok(Access::owner_only()),
        Some(g) => Access::with_group(g.get_ref()).map_err(|e| anyhow::anyhow!("key `control.group`: {e}")),
    };
    let fuse_on = fuse.is_some();
    let fuse_status = fuse.as_ref().map(|f| crate::api::fuse_status(f.transport()));
    let invalidate = fuse.as_ref().map(|f| Box::new(f.invalidator()) as Box<crate::api::Invalidate>);
    let live = Arc::new(Live::new(
        sup.clone(),
        Exports { fuse: Mutex::new(fuse), nbd: Mutex::new(nbd), vhost: vhost.clone() },
        config.clone(),
        config_path.map(|p| p.canonicalize().unwrap_or_else(|_| p.to_path_buf())),
    ));
    if keeper != Keeper::None {
        live.keep_config(kept.clone());
    }
    let api = Arc::new(ServeApi {
        sup: sup.clone(),
        fuse: fuse_status,
        vhost: vhost.clone(),
        invalidate,
        live: live.clone(),
        keeper,
        fell_back: fell_back.clone(),
    });
    let attacher = sup.clone();
    let control = access.and_then(|access| {
        ControlServer::start(
            &bulkhead_control::socket_path(&run_dir),
            access,
            api,
            Some(Arc::new(move |conn, req| attacher.attach_session(conn, req))),
        )
        .with_context(|| format!("cannot bind {}", run_dir.join("control.sock").display()))
    });
    let mut control = match control {
        Ok(c) => c,
        Err(e) => {
            live.stop_exports();
            sup.shutdown();
            return Err(e);
        }
    };

    let metrics = match config.metrics.listen() {
        Some(at) => match crate::metrics::Endpoint::start(&at, live.clone()) {
            Ok(m) => Some(m),
            Err(e) => {
                control.stop();
                live.stop_exports();
                sup.shutdown();
                return Err(e);
            }
        },
        None => None,
    };
    for d in sup.status().devices {
        let at = if fuse_on { format!(" at {}", fuse_dir.join(&d.name).display()) } else { String::new() };
        log::info!(
            "serving {} ({} {}, {} notification, driver pid {}){at}",
            d.name,
            human(d.size_bytes),
            d.backend,
            d.mode,
            d.driver_pid
        );
    }
    if let Some(f) = lock(&live.exports.fuse).as_ref() {
        log::info!("FUSE export at {} over {}", fuse_dir.display(), f.transport());
    }
    if lock(&live.exports.nbd).is_some() {
        let tcp = config.nbd.tcp.as_ref().map(|t| format!(" and TCP {}", t.get_ref())).unwrap_or_default();
        log::info!("NBD export on {}{tcp} (export name = device name){tls_note}", socket_path(&run_dir).display());
    }
    if let Some(v) = &vhost {
        let n = v.status().len();
        log::info!("vhost-user-blk export of {n} device{} in {}", if n == 1 { "" } else { "s" }, socket_dir(&run_dir).display());
    }
    if let Some(m) = &metrics {
        log::info!("metrics at {}", m.address);
    }
    log::info!("control socket {}; reload with SIGHUP, stop with SIGINT or SIGTERM", run_dir.join("control.sock").display());
    crate::notify::ready(&sup);
    let watchdog = crate::notify::Watchdog::start(sup.clone());

    let sig = loop {
        match signals.forever().next().unwrap_or(SIGTERM) {
            SIGUSR2 if UPGRADE.load(Ordering::Acquire) => break SIGUSR2,
            SIGUSR2 => {}
            SIGHUP => {
                log::info!("SIGHUP received; reloading the configuration");
                crate::notify::reloading();
                match live.reload() {
                    Ok(r) => log::info!("reload applied: added {:?}, removed {:?}, changed {:?}", r.added, r.removed, r.changed),
                    Err(e) => log::warn!("reload refused: {}", e.message),
                }
                crate::notify::ready(&sup);
            }
            sig => break sig,
        }
    };
    if sig == SIGUSR2 {
        // An upgrade: everything the keeper holds stays as it is for the next serve.
        log::info!("handing over to a new serve ({} holds the descriptors)", keeper.name());
        kept.hand_over();
        drop(watchdog);
        control.stop();
        drop(metrics);
        live.release_exports();
        sup.shutdown();
        run_lock.remove = false;
        drop(run_lock);
        log::info!("handed over");
        return Ok(ExitCode::SUCCESS);
    }
    if keeper == Keeper::Own && std::os::unix::process::parent_id() != parent {
        log::error!("the keeper (pid {parent}) has died: shutting down, since a crash could no longer be survived");
    }
    log::info!("{} received; shutting down", if sig == SIGINT { "SIGINT" } else { "SIGTERM" });
    crate::notify::stopping();
    drop(watchdog);
    // Stop accepting: control first, then the exports (workers finish the request in hand;
    // each guest's queues are drained before its session ends).
    control.stop();
    drop(metrics);
    let clean = live.stop_exports();
    // Flush every device and end the domains.
    sup.shutdown();
    drop(run_lock);
    log::info!("stopped{}", if clean { "" } else { " (the FUSE mount was busy and was detached lazily)" });
    Ok(ExitCode::SUCCESS)
}
