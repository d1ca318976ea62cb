//! The export: a vhost-user socket per device at `<run-dir>/vhost/<name>.sock`, one thread
//! that accepts on all of them, and a thread per connected frontend that answers its
//! messages. A device serves one frontend at a time; a second is refused while the first is
//! connected.

use std::collections::{BTreeMap, HashMap};
use std::io;
use std::os::fd::AsFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use bulkhead_client::Device;
use bulkhead_sys::epoll::Epoll;
use bulkhead_sys::eventfd::EventFd;
use vhost::vhost_user::{BackendReqHandler, Error as VuError};

use crate::backend::{Session, SessionStats};

/// The directory of a run directory's vhost-user sockets.
pub fn socket_dir(run_dir: &Path) -> PathBuf {
    run_dir.join("vhost")
}

/// The socket of device `name`.
pub fn socket_path(run_dir: &Path, name: &str) -> PathBuf {
    socket_dir(run_dir).join(format!("{name}.sock"))
}

/// The epoll token of the stop signal (devices are numbered from 0).
const STOP: u64 = u64::MAX;

/// A connected frontend.
struct Connection {
    sock: UnixStream,
    thread: JoinHandle<()>,
}

/// One device's socket.
struct Exported {
    dev: Arc<Device>,
    name: String,
    path: PathBuf,
    listener: UnixListener,
    conn: Mutex<Option<Connection>>,
    stats: Arc<SessionStats>,
    sessions: AtomicU64,
    /// No longer exported: accept no frontend (set under `conn`'s lock).
    removed: AtomicBool,
}

pub use bulkhead_control::{VhostQueueStatus as QueueStatus, VhostStatus as ExportStatus};

/// The exported devices, by epoll token.
type Exports = Arc<Mutex<BTreeMap<u64, Arc<Exported>>>>;

/// The vhost-user-blk export.
pub struct VhostExport {
    exports: Exports,
    dir: PathBuf,
    /// The group given each socket, if any.
    group: Option<u32>,
    epoll: Arc<Epoll>,
    next: AtomicU64,
    stop: Arc<EventFd>,
    stopping: Arc<AtomicBool>,
    acceptor: Mutex<Option<JoinHandle<()>>>,
}

/// Why a device could not be exported or taken out of the export.
#[derive(Debug, thiserror::Error)]
pub enum VhostError {
    /// A device of that name is exported already.
    #[error("the vhost-user export has `{0}` already")]
    NameTaken(String),
    /// A virtual machine is connected and the removal was not forced.
    #[error("a virtual machine is connected to its vhost-user socket {}", path.display())]
    Connected {
        /// The device's socket.
        path: PathBuf,
    },
    /// The socket could not be made.
    #[error("{what} {}: {source}", path.display())]
    Socket {
        /// What was being done.
        what: &'static str,
        /// The socket's path.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// The export's own machinery (its epoll, its thread) failed.
    #[error("vhost-user export: {0}")]
    Io(#[from] io::Error),
}

impl VhostExport {
    /// Binds a socket for each of `devices` in `dir` (created if missing; stale sockets of an
    /// earlier `serve` are replaced) and starts accepting. With `group`, each socket is owned by
    /// that group and mode `0660`, so that its members (a QEMU that libvirt runs as its own
    /// user) may connect; without it, the process's umask decides.
    pub fn start(dir: &Path, devices: Vec<Arc<Device>>, group: Option<u32>) -> Result<VhostExport, VhostError> {
        std::fs::create_dir_all(dir)?;
        let stop = Arc::new(EventFd::new()?);
        let stopping = Arc::new(AtomicBool::new(false));
        let epoll = Arc::new(Epoll::new()?);
        epoll.add(stop.as_fd(), STOP)?;
        let exports: Exports = Arc::default();
        let (ex, halt, ep) = (exports.clone(), stopping.clone(), epoll.clone());
        let acceptor = std::thread::Builder::new().name("vhost-accept".into()).spawn(move || accept_loop(&ex, &ep, &halt))?;
        let export = VhostExport {
            exports,
            dir: dir.to_path_buf(),
            group,
            epoll,
            next: AtomicU64::new(0),
            stop,
            stopping,
            acceptor: Mutex::new(Some(acceptor)),
        };
        for dev in devices {
            export.add(dev)?;
        }
        Ok(export)
    }

    /// Binds a socket for `dev` (replacing a stale one) and accepts on it.
    pub fn add(&self, dev: Arc<Device>) -> Result<(), VhostError> {
        let name = dev.name().to_string();
        let mut exports = self.exports.lock().unwrap_or_else(|p| p.into_inner());
        if exports.values().any(|e| e.name == name) {
            return Err(VhostError::NameTaken(name));
        }
        let path = self.dir.join(format!("{name}.sock"));
        match std::fs::remove_file(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(source) => return Err(VhostError::Socket { what: "cannot replace", path, source }),
        }
        let listener = match UnixListener::bind(&path) {
            Ok(l) => l,
            Err(source) => return Err(VhostError::Socket { what: "cannot bind", path, source }),
        };
        if let Some(g) = self.group {
            if let Err(source) = bulkhead_sys::share_with_group(&path, g) {
                return Err(VhostError::Socket { what: "cannot give the group", path, source });
            }
        }
        listener.set_nonblocking(true)?;
        let token = self.next.fetch_add(1, Ordering::Relaxed);
        let e = Arc::new(Exported {
            dev,
            name,
            path,
            listener,
            conn: Mutex::new(None),
            stats: Arc::new(SessionStats::default()),
            sessions: AtomicU64::new(0),
            removed: AtomicBool::new(false),
        });
        if let Err(err) = self.epoll.add(e.listener.as_fd(), token) {
            let _ = std::fs::remove_file(&e.path);
            return Err(err.into());
        }
        exports.insert(token, e);
        Ok(())
    }

    /// Whether a frontend is connected to device `name`'s socket.
    pub fn connected(&self, name: &str) -> bool {
        self.exports.lock().unwrap_or_else(|p| p.into_inner()).values().any(|e| e.name == name && e.connected())
    }

    /// Stops exporting device `name`: its socket goes, and the device is handed back (`None`:
    /// it was not exported). Refused while a frontend is connected unless `force`, which
    /// disconnects it (its queues drained first).
    pub fn remove(&self, name: &str, force: bool) -> Result<Option<Arc<Device>>, VhostError> {
        let mut exports = self.exports.lock().unwrap_or_else(|p| p.into_inner());
        let Some((&token, e)) = exports.iter().find(|(_, e)| e.name == name) else { return Ok(None) };
        if e.connected() && !force {
            return Err(VhostError::Connected { path: e.path.clone() });
        }
        let _ = self.epoll.delete(e.listener.as_fd());
        let e = exports.remove(&token).expect("found above");
        drop(exports);
        let conn = {
            let mut slot = e.conn.lock().unwrap_or_else(|p| p.into_inner());
            e.removed.store(true, Ordering::Release);
            slot.take()
        };
        if let Some(c) = conn {
            let _ = c.sock.shutdown(std::net::Shutdown::Both);
            let _ = c.thread.join();
        }
        let _ = std::fs::remove_file(&e.path);
        Ok(Some(e.dev.clone()))
    }

    /// Each exported device's connection and counters.
    pub fn status(&self) -> Vec<ExportStatus> {
        self.exports
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .map(|e| {
                let connected = e.connected();
                let queues = e
                    .stats
                    .queues
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .iter()
                    .map(|q| QueueStatus {
                        taken: q.taken.load(Ordering::Relaxed),
                        returned: q.returned.load(Ordering::Relaxed),
                        refused: q.refused.load(Ordering::Relaxed),
                        failed: q.failed.load(Ordering::Relaxed),
                        resubmitted: q.resubmitted.load(Ordering::Relaxed),
                        max_in_flight: q.max_in_flight.load(Ordering::Relaxed),
                        recalls: q.recalls.load(Ordering::Relaxed),
                        broken: q.broken.load(Ordering::Relaxed),
                    })
                    .collect();
                ExportStatus {
                    device: e.name.clone(),
                    socket: e.path.clone(),
                    connected,
                    sessions: e.sessions.load(Ordering::Relaxed),
                    queues,
                }
            })
            .collect()
    }

    /// Stops accepting, ends every session (its queues drained first), and removes the
    /// sockets, and their directory if nothing else is in it. Later calls do nothing.
    pub fn shutdown(&self) {
        self.stopping.store(true, Ordering::Release);
        self.stop.ring();
        let acceptor = self.acceptor.lock().unwrap_or_else(|p| p.into_inner()).take();
        let Some(t) = acceptor else { return };
        let _ = t.join();
        let exports = std::mem::take(&mut *self.exports.lock().unwrap_or_else(|p| p.into_inner()));
        for e in exports.values() {
            let conn = e.conn.lock().unwrap_or_else(|p| p.into_inner()).take();
            if let Some(c) = conn {
                let _ = c.sock.shutdown(std::net::Shutdown::Both);
                let _ = c.thread.join();
            }
            let _ = std::fs::remove_file(&e.path);
        }
        let _ = std::fs::remove_dir(&self.dir);
    }
}

impl Drop for VhostExport {
    fn drop(&mut self) {
        self.shutdown();
    }
}

impl Exported {
    fn connected(&self) -> bool {
        self.conn.lock().unwrap_or_else(|p| p.into_inner()).as_ref().is_some_and(|c| !c.thread.is_finished())
    }
}

/// How long a new frontend waits for the session of the one before it to end.
const SESSION_ENDING: std::time::Duration = std::time::Duration::from_millis(300);

fn accept_loop(exports: &Exports, epoll: &Epoll, stopping: &AtomicBool) {
    let mut ready = Vec::new();
    // Names refused lately, so a frontend retrying every second does not fill the log.
    let mut refused: HashMap<u64, std::time::Instant> = HashMap::new();
    loop {
        ready.clear();
        if let Err(e) = epoll.wait(None, &mut ready) {
            if e.kind() != io::ErrorKind::Interrupted {
                log::info!("vhost-user export: {e}");
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
            continue;
        }
        if stopping.load(Ordering::Acquire) || ready.contains(&STOP) {
            return;
        }
        for &i in &ready {
            let Some(e) = exports.lock().unwrap_or_else(|p| p.into_inner()).get(&i).cloned() else { continue };
            loop {
                let stream = match e.listener.accept() {
                    Ok((s, _)) => s,
                    Err(err) if err.kind() == io::ErrorKind::WouldBlock => break,
                    Err(err) => {
                        log::info!("vhost-user {}: accept: {err}", e.name);
                        break;
                    }
                };
                let mut slot = e.conn.lock().unwrap_or_else(|p| p.into_inner());
                if e.removed.load(Ordering::Acquire) {
                    break;
                }
                // A frontend that hung up a moment ago (a migration's source QEMU, ended as
                // the guest comes back) may still have its session stopping its queues.
                let ending = std::time::Instant::now() + SESSION_ENDING;
                while slot.as_ref().is_some_and(|c| !c.thread.is_finished()) && std::time::Instant::now() < ending {
                    drop(slot);
                    std::thread::sleep(std::time::Duration::from_millis(5));
                    slot = e.conn.lock().unwrap_or_else(|p| p.into_inner());
                }
                if slot.as_ref().is_some_and(|c| !c.thread.is_finished()) {
                    let now = std::time::Instant::now();
                    if refused.get(&i).is_none_or(|t| now.duration_since(*t).as_secs() >= 10) {
                        log::warn!("vhost-user {}: refused a second frontend while one is connected", e.name);
                        refused.insert(i, now);
                    }
                    continue;
                }
                if let Some(old) = slot.take() {
                    let _ = old.thread.join();
                }
                match start_session(e.clone(), stream) {
                    Ok(c) => *slot = Some(c),
                    Err(err) => log::info!("vhost-user {}: {err}", e.name),
                }
            }
        }
    }
}

/// Frontends decide how often they connect and what they send: at most 10 lines a second of it.
static SESSION_LOG: bulkhead_sys::LogLimit = bulkhead_sys::LogLimit::new(10, std::time::Duration::from_secs(1));

/// Serves `dev` to the frontend connected on `stream`, on the calling thread, until it hangs
/// up (`None`) or breaks the protocol (why); its queues are stopped before this returns.
fn run_session(dev: Arc<Device>, name: &str, stats: Arc<SessionStats>, stream: UnixStream) -> Option<VuError> {
    let session = Arc::new(Mutex::new(Session::new(dev, name, stats)));
    let mut handler = BackendReqHandler::from_stream(stream, session.clone());
    let why = loop {
        match handler.handle_request() {
            Ok(()) => {}
            Err(VuError::Disconnected | VuError::PartialMessage) => break None,
            Err(VuError::SocketBroken(err) | VuError::SocketError(err)) if err.kind() != io::ErrorKind::InvalidData => {
                break None
            }
            Err(err) => break Some(err),
        }
    };
    drop(handler);
    session.lock().unwrap_or_else(|p| p.into_inner()).stop_all();
    why
}

/// Serves `dev` as a vhost-user-blk device to the frontend already connected on `stream` (a
/// socket handed over rather than accepted from the export's listener), on the calling
/// thread until it hangs up or breaks the protocol; returns why it was closed, if it broke it.
pub fn serve_frontend(dev: Arc<Device>, stream: UnixStream) -> Option<String> {
    let name = dev.name().to_string();
    run_session(dev, &name, Arc::default(), stream).map(|e| e.to_string())
}

fn start_session(e: Arc<Exported>, stream: UnixStream) -> io::Result<Connection> {
    stream.set_nonblocking(false)?;
    let sock = stream.try_clone()?;
    let thread = std::thread::Builder::new().name("vhost-session".into()).spawn(move || {
        e.sessions.fetch_add(1, Ordering::Relaxed);
        if let Some(held) = SESSION_LOG.allow() {
            log::info!("vhost-user {}: frontend connected{}", e.name, bulkhead_sys::LogLimit::held_note(held));
        }
        let why = run_session(e.dev.clone(), &e.name, e.stats.clone(), stream);
        match why {
            None => {
                if SESSION_LOG.allow().is_some() {
                    log::info!("vhost-user {}: frontend disconnected", e.name)
                }
            }
            Some(err) => {
                if let Some(held) = SESSION_LOG.allow() {
                    log::info!("vhost-user {}: closed the connection: {err}{}", e.name, bulkhead_sys::LogLimit::held_note(held))
                }
            }
        }
    })?;
    Ok(Connection { sock, thread })
}
