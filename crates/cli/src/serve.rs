//! `bulkhead serve`: supervisor, driver domains, exports, control socket; clean shutdown.

use std::fs::File;
use std::io::{Read, Seek, Write};
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::{bail, Context};
use bulkhead_config::{Config, FuseUring, Tap};
use bulkhead_fuse_export::{FuseExport, FuseOptions, Transport, UringMode};
use bulkhead_nbd_export::{socket_path, NbdServer, ServerConfig};
use bulkhead_supervisor::control::ControlServer;
use bulkhead_supervisor::{DeviceChange, Supervisor};
use bulkhead_vhost_export::{socket_dir, VhostExport};
use signal_hook::consts::{SIGINT, SIGTERM};
use signal_hook::iterator::Signals;

/// The exclusive lock on a run directory, held for the life of `serve`.
struct RunLock {
    file: File,
    path: PathBuf,
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
        Ok(RunLock { file, path })
    }
}

impl Drop for RunLock {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
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
        eprintln!("bulkhead: removing a stale FUSE mount at {} left by an earlier serve", dir.display());
        if let Err(e) = bulkhead_sys::detach_mount(dir) {
            eprintln!("bulkhead: cannot detach the stale mount at {}: {e}", dir.display());
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

/// The change a control request asks for: `restart`; `tap` with `mode`; `filter` with `op`
/// `add` (`table`, optional `at`) or `remove` (`at`).
fn device_change(cmd: &str, req: &serde_json::Value) -> Result<DeviceChange, String> {
    match cmd {
        "restart" => Ok(DeviceChange::Restart),
        "tap" => match req["mode"].as_str() {
            Some("passthrough") => Ok(DeviceChange::Tap(Tap::Passthrough)),
            Some("interpose") => Ok(DeviceChange::Tap(Tap::Interpose)),
            Some("intercept") => Ok(DeviceChange::Tap(Tap::Intercept)),
            Some(other) => Err(format!("unknown tap mode `{other}` (passthrough, interpose, intercept)")),
            None => Err("tap needs `mode`".into()),
        },
        _ => {
            let at = match &req["at"] {
                serde_json::Value::Null => None,
                v => Some(v.as_u64().ok_or("`at` must be a position (0, 1, …)")? as usize),
            };
            match req["op"].as_str() {
                Some("add") => {
                    let table = req["table"].as_str().ok_or("filter add needs `table`")?.to_string();
                    Ok(DeviceChange::AddFilter { at, table })
                }
                Some("remove") => Ok(DeviceChange::RemoveFilter(at.ok_or("filter remove needs `at`")?)),
                _ => Err("filter needs `op`: add or remove".into()),
            }
        }
    }
}

/// Drops the kernel's cached pages of a device's FUSE file.
type Invalidate = dyn Fn(&str) -> bool + Send + Sync;

/// `{"cmd":"snapshot","device":D,"op":"list"|"create"|"revert"|"delete","name":N}`. After a
/// revert, `invalidate` drops the kernel's cached pages of the device's FUSE file.
fn snapshot_request(s: &Supervisor, req: &serde_json::Value, invalidate: Option<&Invalidate>) -> serde_json::Value {
    use bulkhead_filters::cow::SnapshotAction;
    let Some(device) = req["device"].as_str() else {
        return serde_json::json!({ "error": "snapshot needs `device`" });
    };
    let action = match req["op"].as_str() {
        Some("list") => {
            return match s.snapshots(device) {
                Ok(list) => serde_json::json!({
                    "device": device,
                    "snapshots": list.iter().map(|i| serde_json::json!({
                        "id": i.id,
                        "name": i.name,
                        "date_sec": i.date_sec,
                        "date_nsec": i.date_nsec,
                        "disk_size": i.disk_size,
                        "vm_state_size": i.vm_state_size,
                    })).collect::<Vec<_>>(),
                }),
                Err(e) => serde_json::json!({ "error": format!("device `{device}`: {e}") }),
            };
        }
        Some("create") => SnapshotAction::Create,
        Some("revert") => SnapshotAction::Revert,
        Some("delete") => SnapshotAction::Delete,
        Some(other) => {
            return serde_json::json!({ "error": format!("unknown snapshot operation `{other}` (create, list, revert, delete)") })
        }
        None => return serde_json::json!({ "error": "snapshot needs `op`: create, list, revert or delete" }),
    };
    let Some(name) = req["name"].as_str() else {
        return serde_json::json!({ "error": format!("snapshot {} needs `name`", action.as_str()) });
    };
    match s.snapshot(device, action, name) {
        Ok(pid) => {
            if action == SnapshotAction::Revert {
                if let Some(inval) = invalidate {
                    inval(device);
                }
            }
            serde_json::json!({ "device": device, "snapshot": name, "op": action.as_str(), "driver_pid": pid })
        }
        Err(e) => serde_json::json!({ "error": format!("device `{device}`: snapshot {} `{name}`: {e}", action.as_str()) }),
    }
}

pub fn run(config_path: Option<&Path>, run_dir: &Path, driver_exe: Option<&Path>) -> anyhow::Result<ExitCode> {
    let config = match config_path {
        Some(p) => Config::load(p)?,
        None => Config::embedded_default(),
    };
    // A serve of many devices holds many descriptors: allow as many as the hard limit does.
    if let Err(e) = bulkhead_sys::raise_open_files_limit() {
        eprintln!("bulkhead: cannot raise the limit on open files: {e}");
    }
    // Signals first, so a SIGTERM during start-up is not lost.
    let mut signals = Signals::new([SIGINT, SIGTERM]).context("cannot install signal handlers")?;
    std::fs::create_dir_all(run_dir).with_context(|| format!("cannot create run dir {}", run_dir.display()))?;
    let run_dir = run_dir.canonicalize().with_context(|| format!("run dir {}", run_dir.display()))?;
    let lock = RunLock::acquire(&run_dir)?;
    let fuse_dir = run_dir.join("fuse");
    clear_stale_mount(&fuse_dir);

    let driver_exe = match driver_exe {
        Some(p) => Some(p.canonicalize().with_context(|| format!("--driver-exe {}", p.display()))?),
        None => None,
    };
    let sup = Arc::new(Supervisor::start(&config, driver_exe.as_deref())?);
    let fuse = if config.fuse.enabled {
        let opts = FuseOptions {
            threads: *config.fuse.threads.get_ref() as usize,
            io_uring: match config.fuse.io_uring {
                FuseUring::Auto => UringMode::Auto,
                FuseUring::On => UringMode::On,
                FuseUring::Off => UringMode::Off,
            },
            queue_depth: *config.fuse.queue_depth.get_ref() as usize,
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
        match NbdServer::start(sup.devices(), cfg) {
            Ok(n) => Some(n),
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
    let s = sup.clone();
    let vhost_status = vhost.clone();
    let fuse_status = fuse.as_ref().map(|f| fuse_status(f.transport()));
    let invalidate: Option<Box<Invalidate>> = fuse.as_ref().map(|f| Box::new(f.invalidator()) as Box<Invalidate>);
    let attacher = sup.clone();
    let control = ControlServer::start_with_attach(
        &run_dir.join("control.sock"),
        Arc::new(move |req| match req["cmd"].as_str() {
            Some("status") => match serde_json::to_value(s.status()) {
                Ok(mut v) => {
                    v["fuse"] = fuse_status.clone().unwrap_or(serde_json::Value::Null);
                    v["vhost_user"] = vhost_status.as_ref().map_or(serde_json::Value::Null, |x| vhost_json(x));
                    v
                }
                Err(e) => serde_json::json!({"error": e.to_string()}),
            },
            Some(cmd @ ("restart" | "tap" | "filter")) => {
                let Some(name) = req["device"].as_str() else {
                    return serde_json::json!({ "error": format!("{cmd} needs `device`") });
                };
                let change = match device_change(cmd, req) {
                    Ok(c) => c,
                    Err(e) => return serde_json::json!({ "error": e }),
                };
                match s.change_device(name, change) {
                    Ok(pid) => serde_json::json!({ "device": name, "driver_pid": pid }),
                    Err(e) => serde_json::json!({ "error": format!("device `{name}`: {e}") }),
                }
            }
            Some("snapshot") => snapshot_request(&s, req, invalidate.as_deref()),
            Some("qos") => {
                let Some(view) = req["view"].as_str() else {
                    return serde_json::json!({ "error": "qos needs `view`" });
                };
                let changes: Vec<(String, String)> = req["set"]
                    .as_object()
                    .into_iter()
                    .flatten()
                    .map(|(k, v)| (k.clone(), v.as_str().map_or_else(|| v.to_string(), String::from)))
                    .collect();
                match s.set_qos(view, &changes) {
                    Ok(caps) => serde_json::json!({ "view": view, "qos": caps, "summary": caps.to_string() }),
                    Err(e) => serde_json::json!({ "error": format!("view `{view}`: {e}") }),
                }
            }
            Some(other) => serde_json::json!({ "error": format!("unknown command `{other}`") }),
            None => serde_json::json!({ "error": "missing `cmd`" }),
        }),
        Some(Arc::new(move |conn, req| attacher.attach_session(conn, req))),
    )
    .with_context(|| format!("cannot bind {}", run_dir.join("control.sock").display()));
    let mut control = match control {
        Ok(c) => c,
        Err(e) => {
            drop(vhost);
            drop(nbd);
            drop(fuse);
            sup.shutdown();
            return Err(e);
        }
    };

    for d in sup.status().devices {
        let at = if fuse.is_some() { format!(" at {}", fuse_dir.join(&d.name).display()) } else { String::new() };
        eprintln!(
            "bulkhead: serving {} ({} {}, {} notification, driver pid {}){at}",
            d.name,
            human(d.size_bytes),
            d.backend,
            d.mode,
            d.driver_pid
        );
    }
    if let Some(f) = &fuse {
        eprintln!("bulkhead: FUSE export at {} over {}", fuse_dir.display(), f.transport());
    }
    if nbd.is_some() {
        let tcp = config.nbd.tcp.as_ref().map(|t| format!(" and TCP {}", t.get_ref())).unwrap_or_default();
        eprintln!("bulkhead: NBD export on {}{tcp} (export name = device name){tls_note}", socket_path(&run_dir).display());
    }
    if let Some(v) = &vhost {
        let n = v.status().len();
        eprintln!(
            "bulkhead: vhost-user-blk export of {n} device{} in {}",
            if n == 1 { "" } else { "s" },
            socket_dir(&run_dir).display()
        );
    }
    eprintln!("bulkhead: control socket {}; stop with SIGINT or SIGTERM", run_dir.join("control.sock").display());

    let sig = signals.forever().next().unwrap_or(SIGTERM);
    eprintln!("bulkhead: {} received; shutting down", if sig == SIGINT { "SIGINT" } else { "SIGTERM" });
    // Stop accepting: control first, then the exports (workers finish the request in hand).
    control.stop();
    if let Some(n) = nbd {
        n.shutdown();
    }
    // Each guest's queues are drained before its session ends: nothing taken is left unanswered.
    if let Some(v) = &vhost {
        v.shutdown();
    }
    let clean = fuse.map(FuseExport::shutdown).unwrap_or(true);
    // Flush every device and end the domains.
    sup.shutdown();
    drop(lock);
    eprintln!("bulkhead: stopped{}", if clean { "" } else { " (the FUSE mount was busy and was detached lazily)" });
    Ok(ExitCode::SUCCESS)
}

/// The vhost-user export as `status --json` shows it.
fn vhost_json(v: &VhostExport) -> serde_json::Value {
    serde_json::Value::Array(
        v.status()
            .into_iter()
            .map(|e| {
                serde_json::json!({
                    "device": e.name,
                    "socket": e.socket,
                    "connected": e.connected,
                    "sessions": e.sessions,
                    "queues": e.queues.iter().map(|q| serde_json::json!({
                        "taken": q.taken,
                        "returned": q.returned,
                        "refused": q.refused,
                        "failed": q.failed,
                        "resubmitted": q.resubmitted,
                        "max_in_flight": q.max_in_flight,
                        "broken": q.broken,
                    })).collect::<Vec<_>>(),
                })
            })
            .collect(),
    )
}

/// The FUSE export's transport as `status --json` shows it.
fn fuse_status(t: &Transport) -> serde_json::Value {
    match t {
        Transport::DevFuse { threads, why_not_uring } => {
            serde_json::json!({ "transport": "dev_fuse", "threads": threads, "why_not_io_uring": why_not_uring })
        }
        Transport::IoUring { queues, depth } => serde_json::json!({ "transport": "io_uring", "queues": queues, "depth": depth }),
    }
}
