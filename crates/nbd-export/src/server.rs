//! The NBD server: every device of `serve` as an export named after it, on a unix socket and,
//! when configured, TCP.
//!
//! One thread accepts on each listener. Each connection gets a thread that negotiates and then
//! `workers` threads in all. One of them leads: it reads requests as they arrive, keeps them
//! in flight on its queue and answers each as the device does, waiting on the socket and the
//! queue together; the others take the lead while it serves a request that cannot go in
//! flight as one (`Connection`). Replies go out through a combining writer, so no thread waits
//! on another's write. Clients are
//! untrusted: negotiation has a deadline and bounded option sizes, requests are checked before
//! anything is allocated for them, payload memory is bounded across all connections, and a
//! client that breaks the protocol loses its connection and nothing else.

use std::collections::HashMap;
use std::io::{self, BufReader};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use bulkhead_sys::SocketTimeout;

use crate::budget::{Budget, PAYLOAD_BUDGET};
use crate::exports::{Export, ExportError, Exports};
use crate::lock;
use crate::negotiate::{greet, negotiate, violation, Haggle, Outcome};
use crate::peer::{peer_of, CLIENT_LOG};
use crate::reply::{Spare, SPARE_BYTES};
use crate::sockbuf::{sock_file, timeout_says, DeadlineReader, SockBuf};
use crate::transmit::{transmit, Common};

/// What one thread of a connection takes beyond the payload: its stack as used, its share of
/// the allocator's per-thread caches, its reply list. About 75 KiB measured
/// (`bulkhead-bench overload` at 1, 16 and 64 clients); this leaves room.
const THREAD_MEMORY: u64 = 96 << 10;

/// How much the export's private memory grows at most under any load from `connections`
/// connections of `workers` threads each: the payload budget (every write's data and read's
/// reply held, across connections), the spare buffers kept for reuse, and each connection's
/// read buffer and threads. Replies a client does not read count against the payload budget,
/// so a client that stops reading cannot grow it either.
pub fn memory_bound(connections: usize, workers: usize) -> u64 {
    let per_connection = SockBuf::CAPACITY as u64 + workers.max(1) as u64 * THREAD_MEMORY;
    PAYLOAD_BUDGET + SPARE_BYTES as u64 + connections as u64 * per_connection
}

/// Where and how to serve.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Unix socket path (removed and re-created).
    pub unix: Option<PathBuf>,
    /// TCP address, e.g. `127.0.0.1:10809`.
    pub tcp: Option<String>,
    /// Connections served at once; more are closed at accept.
    pub max_connections: usize,
    /// Threads of one connection: one leads (reads requests and keeps them in flight); the
    /// others take the lead while it serves a request too large to go in flight as one.
    pub workers_per_connection: usize,
    /// Negotiation must finish within this.
    pub handshake_timeout: Duration,
    /// Once a request has started to arrive, the rest of it must arrive within this.
    pub request_timeout: Duration,
    /// TLS, if offered.
    pub tls: Option<crate::tls::Tls>,
}

/// Counters of the server.
#[derive(Debug, Default)]
pub struct ServerStats {
    /// Connections accepted.
    pub accepted: AtomicU64,
    /// Connections refused (over the limit).
    pub refused: AtomicU64,
    /// Connections closed for breaking the protocol or missing a deadline.
    pub dropped: AtomicU64,
    /// Requests answered.
    pub requests: AtomicU64,
}

/// A live connection.
struct Conn {
    sock: Arc<OwnedFd>,
    /// The export it chose, once it has.
    export: Option<String>,
}

struct Shared {
    /// The exports; they come and go while the server runs.
    exports: Exports,
    cfg: ServerConfig,
    stop: AtomicBool,
    /// Live connections (to shut them down on stop, or when their export goes).
    conns: Mutex<HashMap<u64, Conn>>,
    next_id: AtomicU64,
    active: AtomicUsize,
    budget: Arc<Budget>,
    /// Large buffers kept for reuse by every connection.
    spare: Arc<Mutex<Spare>>,
    stats: ServerStats,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

/// Listening sockets bound before the server starts (or copies of its own).
#[derive(Debug, Default)]
pub struct Listeners {
    /// On the unix socket's path.
    pub unix: Option<OwnedFd>,
    /// On the TCP address.
    pub tcp: Option<OwnedFd>,
}

/// A running NBD server.
pub struct NbdServer {
    shared: Arc<Shared>,
    listeners: Vec<(Arc<OwnedFd>, JoinHandle<()>)>,
    unix_path: Option<PathBuf>,
}

impl std::fmt::Debug for NbdServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NbdServer").field("unix", &self.unix_path).field("tcp", &self.shared.cfg.tcp).finish()
    }
}

/// Sets a time limit of a client's socket (a failure leaves it without one: the deadlines of
/// negotiation and of each request still hold).
fn set_timeout(sock: &OwnedFd, which: SocketTimeout, limit: Option<Duration>) {
    let _ = bulkhead_sys::set_socket_timeout(sock.as_fd(), which, limit);
}

impl NbdServer {
    /// Binds the configured listeners and starts accepting.
    pub fn start(exports: Vec<Export>, cfg: ServerConfig) -> io::Result<NbdServer> {
        Self::start_with(exports, cfg, Listeners::default())
    }

    /// Starts accepting on the listeners given (sockets already bound and listening, kept by
    /// a keeper across a restart of `serve`: clients that connected meanwhile wait in their
    /// backlog), binding those not given.
    pub fn start_with(exports: Vec<Export>, cfg: ServerConfig, adopted: Listeners) -> io::Result<NbdServer> {
        let shared = Arc::new(Shared {
            exports: Exports::new(exports),
            cfg: cfg.clone(),
            stop: AtomicBool::new(false),
            conns: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(0),
            active: AtomicUsize::new(0),
            budget: Arc::new(Budget::new(PAYLOAD_BUDGET)),
            spare: Arc::default(),
            stats: ServerStats::default(),
            threads: Mutex::new(Vec::new()),
        });
        let mut fds: Vec<OwnedFd> = Vec::new();
        let Listeners { unix, tcp } = adopted;
        if let Some(p) = &cfg.unix {
            let fd = match unix {
                Some(fd) => fd,
                None => {
                    let _ = std::fs::remove_file(p);
                    UnixListener::bind(p)
                        .map_err(|e| io::Error::new(e.kind(), format!("cannot bind {}: {e}", p.display())))?
                        .into()
                }
            };
            fds.push(fd);
        }
        if let Some(addr) = &cfg.tcp {
            let fd = match tcp {
                Some(fd) => fd,
                None => std::net::TcpListener::bind(addr)
                    .map_err(|e| io::Error::new(e.kind(), format!("cannot bind TCP {addr}: {e}")))?
                    .into(),
            };
            fds.push(fd);
        }
        bulkhead_sys::install_kick_handler();
        let mut listeners = Vec::new();
        for fd in fds {
            let fd = Arc::new(fd);
            let (s, f) = (shared.clone(), fd.clone());
            let t = std::thread::Builder::new().name("nbd-accept".into()).spawn(move || accept_loop(s, f))?;
            listeners.push((fd, t));
        }
        Ok(NbdServer { shared, listeners, unix_path: cfg.unix })
    }

    /// Copies of the listening sockets, for a keeper to hold: unix first, then TCP.
    pub fn listeners(&self) -> io::Result<Listeners> {
        let mut fds = self.listeners.iter().map(|(fd, _)| fd.try_clone());
        let unix = if self.unix_path.is_some() { fds.next().transpose()? } else { None };
        let tcp = if self.shared.cfg.tcp.is_some() { fds.next().transpose()? } else { None };
        Ok(Listeners { unix, tcp })
    }

    /// Stops as [`shutdown`](Self::shutdown) does, but leaves the listening sockets as they
    /// are (a keeper holds them for the next `serve`): the accept threads are interrupted
    /// rather than the sockets shut down, and the unix socket's path stays.
    pub fn release(mut self) {
        self.shared.stop.store(true, Ordering::Release);
        for (_, t) in self.listeners.drain(..) {
            bulkhead_sys::kick_until_finished(&t);
            let _ = t.join();
        }
        self.unix_path = None;
        self.stop_all();
    }

    /// Serves one client already connected on `sock` (a socket handed over, as nbdkit `-s`
    /// serves the one on its standard input) on the calling thread, until it hangs up or the
    /// server stops. It counts among the connections as an accepted one does.
    pub fn serve_connection(&self, sock: OwnedFd) -> io::Result<()> {
        let shared = &self.shared;
        shared.stats.accepted.fetch_add(1, Ordering::Relaxed);
        shared.active.fetch_add(1, Ordering::AcqRel);
        let id = shared.next_id.fetch_add(1, Ordering::Relaxed);
        let sock = Arc::new(sock);
        lock(&shared.conns).insert(id, Conn { sock: sock.clone(), export: None });
        let r = serve_connection(shared, id, sock);
        lock(&shared.conns).remove(&id);
        shared.active.fetch_sub(1, Ordering::AcqRel);
        r
    }

    /// Counters.
    pub fn stats(&self) -> &ServerStats {
        &self.shared.stats
    }

    /// Connections open now.
    pub fn active(&self) -> usize {
        self.shared.active.load(Ordering::Acquire)
    }

    /// Connections open now on export `name`.
    pub fn clients_of(&self, name: &str) -> usize {
        lock(&self.shared.conns).values().filter(|c| c.export.as_deref() == Some(name)).count()
    }

    /// Offers `export` too. Refused if an export has its name.
    pub fn add(&self, export: Export) -> Result<(), ExportError> {
        let mut list = self.shared.exports.write();
        if list.iter().any(|e| e.name() == export.name()) {
            return Err(ExportError::NameTaken(export.name().to_string()));
        }
        list.push(export);
        Ok(())
    }

    /// Stops offering export `name` and hands it back, as it was offered: `None` if there was
    /// no such export. Refused while clients are connected to it unless `force`, which
    /// disconnects them.
    pub fn remove(&self, name: &str, force: bool) -> Result<Option<Export>, ExportError> {
        let mut list = self.shared.exports.write();
        let Some(i) = list.iter().position(|e| e.name() == name) else { return Ok(None) };
        let conns = lock(&self.shared.conns);
        let users: Vec<&Conn> = conns.values().filter(|c| c.export.as_deref() == Some(name)).collect();
        if !users.is_empty() && !force {
            return Err(ExportError::InUse { name: name.to_string(), clients: users.len() });
        }
        for c in users {
            let _ = bulkhead_sys::shutdown(c.sock.as_fd());
        }
        Ok(Some(list.remove(i)))
    }

    /// The exports on offer now, in order.
    pub fn exports(&self) -> Vec<Export> {
        self.shared.exports.read().clone()
    }

    /// Stops accepting, ends every connection (requests in hand finish first) and removes the
    /// unix socket.
    pub fn shutdown(mut self) {
        self.stop_all();
    }

    fn stop_all(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        for (fd, _) in &self.listeners {
            let _ = bulkhead_sys::shutdown(fd.as_fd());
        }
        for (_, t) in self.listeners.drain(..) {
            let _ = t.join();
        }
        for c in lock(&self.shared.conns).values() {
            let _ = bulkhead_sys::shutdown(c.sock.as_fd());
        }
        let threads = std::mem::take(&mut *lock(&self.shared.threads));
        for t in threads {
            let _ = t.join();
        }
        if let Some(p) = self.unix_path.take() {
            let _ = std::fs::remove_file(p);
        }
    }
}

impl Drop for NbdServer {
    fn drop(&mut self) {
        self.stop_all();
    }
}

fn accept_loop(shared: Arc<Shared>, listener: Arc<OwnedFd>) {
    loop {
        let accepted = bulkhead_sys::accept(listener.as_fd());
        if shared.stop.load(Ordering::Acquire) {
            return; // what was accepted is closed as it drops
        }
        let sock = match accepted {
            Ok(s) => s,
            Err(e) => match e.raw_os_error() {
                Some(libc::EINTR) | Some(libc::ECONNABORTED) => continue,
                Some(libc::EMFILE) | Some(libc::ENFILE) | Some(libc::ENOBUFS) | Some(libc::ENOMEM) => {
                    // Out of descriptors or memory: wait a little instead of spinning.
                    std::thread::sleep(Duration::from_millis(50));
                    continue;
                }
                _ => return,
            },
        };
        if shared.active.load(Ordering::Acquire) >= shared.cfg.max_connections {
            shared.stats.refused.fetch_add(1, Ordering::Relaxed);
            continue; // dropped: closed at once
        }
        // Unix sockets refuse it, harmlessly.
        let _ = bulkhead_sys::set_nodelay(sock.as_fd());
        shared.stats.accepted.fetch_add(1, Ordering::Relaxed);
        shared.active.fetch_add(1, Ordering::AcqRel);
        let id = shared.next_id.fetch_add(1, Ordering::Relaxed);
        let sock = Arc::new(sock);
        lock(&shared.conns).insert(id, Conn { sock: sock.clone(), export: None });
        let s = shared.clone();
        let t = std::thread::Builder::new().name("nbd-conn".into()).spawn(move || {
            let sh = s.clone();
            let r = serve_connection(&s, id, sock);
            if let Err(e) = r {
                if !sh.stop.load(Ordering::Acquire) {
                    sh.stats.dropped.fetch_add(1, Ordering::Relaxed);
                    if let Some(held) = CLIENT_LOG.allow() {
                        log::info!("nbd client {id}: {e}; connection closed{}", bulkhead_sys::LogLimit::held_note(held));
                    }
                }
            }
            lock(&sh.conns).remove(&id);
            sh.active.fetch_sub(1, Ordering::AcqRel);
        });
        match t {
            Ok(t) => {
                let mut threads = lock(&shared.threads);
                threads.retain(|t| !t.is_finished());
                threads.push(t);
            }
            Err(_) => {
                lock(&shared.conns).remove(&id);
                shared.active.fetch_sub(1, Ordering::AcqRel);
            }
        }
    }
}

fn serve_connection(shared: &Arc<Shared>, id: u64, sock: Arc<OwnedFd>) -> io::Result<()> {
    let peer = peer_of(&sock)?;
    let cfg = &shared.cfg;
    let deadline = std::time::Instant::now() + cfg.handshake_timeout;
    let mut sock = sock;
    let mut haggle = Haggle { peer, tls: false, no_zeroes: false };
    let mut greeted = false;
    loop {
        let raw = sock.as_raw_fd();
        set_timeout(&sock, SocketTimeout::Read, Some(cfg.handshake_timeout));
        set_timeout(&sock, SocketTimeout::Write, Some(cfg.request_timeout));
        let mut reader = BufReader::with_capacity(
            64 << 10,
            DeadlineReader { file: sock_file(&sock)?, deadline: Some(deadline), nonblocking: false },
        );
        let mut writer = sock_file(&sock)?;
        if !greeted {
            haggle.no_zeroes = greet(&mut reader, &mut writer).map_err(|e| timeout_says(e, "negotiation"))?;
            greeted = true;
        }
        match negotiate(&shared.exports, cfg.tls.as_ref(), &haggle, &mut reader, &mut writer)
            .map_err(|e| timeout_says(e, "negotiation"))?
        {
            Outcome::Abort => return Ok(()),
            Outcome::Go(neg) => {
                // Checked against the exports as they are now, under their lock: a removal
                // either sees this client or this client sees the removal.
                {
                    let exports = shared.exports.read();
                    if !exports.iter().any(|e| Arc::ptr_eq(&e.device, &neg.device)) {
                        return Err(violation(format!("export {} was removed during negotiation", neg.device.name())));
                    }
                    if let Some(c) = lock(&shared.conns).get_mut(&id) {
                        c.export = Some(neg.device.name().to_string());
                    }
                }
                set_timeout(&sock, SocketTimeout::Read, Some(cfg.request_timeout));
                let common = Common {
                    budget: &shared.budget,
                    spare: &shared.spare,
                    requests: &shared.stats.requests,
                    request_timeout: cfg.request_timeout,
                    workers: cfg.workers_per_connection,
                };
                return transmit(common, id, raw, reader, writer, neg);
            }
            Outcome::StartTls => {
                // The client waits for the ACK before its first TLS record: anything already
                // here came before it, outside TLS.
                if !reader.buffer().is_empty() {
                    return Err(violation("bytes sent between STARTTLS and the TLS handshake"));
                }
                let tls = cfg.tls.as_ref().ok_or_else(|| violation("TLS started without TLS configured"))?;
                // Negotiation goes on, in plaintext on the relay's end; what was agreed
                // before TLS is forgotten.
                sock = Arc::new(crate::tls::relay(sock, tls)?);
                haggle.tls = true;
            }
        }
    }
}

/// The unix socket path of a run directory.
pub fn socket_path(run_dir: &Path) -> PathBuf {
    run_dir.join("nbd.sock")
}
