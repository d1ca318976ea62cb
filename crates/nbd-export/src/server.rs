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
use std::io::{self, BufReader, Read, Write};
use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};

use bulkhead_sys::SocketTimeout;
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, RwLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use bulkhead_client::{Armed, Command, Device, FrontRequest, IoError, QueueHandle, SharedSlice};
use bulkhead_doorbell::{now_ns, BudgetPolicy, IdleSpin, NotifyMode};

use bulkhead_nbd::allow::Cidr;
use bulkhead_nbd::proto::*;

pub use bulkhead_nbd::proto::MAX_PAYLOAD;
/// Largest option payload accepted in negotiation (an export name is at most 4096 bytes).
pub const MAX_OPTION: u32 = 16 << 10;
/// Longest name or query string in an option.
const MAX_STRING: u32 = 4096;
/// Options one connection may send before it must pick an export.
const MAX_OPTIONS: u32 = 64;
/// Payload bytes held in memory by all connections together: one request of the largest size,
/// or many smaller ones, however many clients push at once (see [`memory_bound`]).
const PAYLOAD_BUDGET: u64 = MAX_PAYLOAD as u64;
/// What one thread of a connection takes beyond the payload: its stack as used, its share of
/// the allocator's per-thread caches, its reply list. About 75 KiB measured
/// (`bulkhead bench overload` at 1, 16 and 64 clients); this leaves room.
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
/// Payload bytes one connection takes ahead, beyond the request it waits for: a client that
/// sends and never reads its answers holds this much (and one request more) of the budget,
/// and the other connections keep the rest.
const CONNECTION_SHARE: u64 = PAYLOAD_BUDGET / 4;

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
    /// Exports TCP clients may reach only from these address ranges (by export name; an
    /// export not named here: from anywhere). Clients of the unix socket are not asked:
    /// the socket's file permissions guard it.
    pub allow: HashMap<String, Vec<Cidr>>,
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

/// A byte budget shared by every connection.
#[derive(Debug)]
struct Budget {
    state: Mutex<BudgetState>,
    cv: Condvar,
}

#[derive(Debug)]
struct BudgetState {
    free: u64,
    /// Threads waiting in [`Budget::take`]: a grant given back wakes them only if there are
    /// any, so the common return costs no system call.
    waiting: usize,
}

impl Budget {
    fn new(bytes: u64) -> Self {
        Budget { state: Mutex::new(BudgetState { free: bytes, waiting: 0 }), cv: Condvar::new() }
    }

    /// Waits until `n` bytes are free and takes them for connection `conn` (which counts what
    /// it holds); they return when the grant drops.
    fn take(self: &Arc<Self>, n: u64, conn: &Arc<AtomicU64>) -> Held {
        let mut st = lock(&self.state);
        while st.free < n {
            st.waiting += 1;
            st = self.cv.wait(st).unwrap_or_else(|e| e.into_inner());
            st.waiting -= 1;
        }
        st.free -= n;
        Held::new(self, n, conn)
    }

    /// Takes `n` bytes for `conn` if they are free now and `conn` would hold no more than
    /// `share` with them.
    fn try_take(self: &Arc<Self>, n: u64, conn: &Arc<AtomicU64>, share: u64) -> Option<Held> {
        if conn.load(Ordering::Acquire) + n > share {
            return None;
        }
        let mut st = lock(&self.state);
        if st.free < n {
            return None;
        }
        st.free -= n;
        Some(Held::new(self, n, conn))
    }
}

/// Bytes taken from the [`Budget`]; given back on drop, wherever the payload ends up.
struct Held {
    budget: Arc<Budget>,
    n: u64,
    /// What the connection that took them holds.
    conn: Arc<AtomicU64>,
}

impl Held {
    fn new(budget: &Arc<Budget>, n: u64, conn: &Arc<AtomicU64>) -> Held {
        conn.fetch_add(n, Ordering::AcqRel);
        Held { budget: budget.clone(), n, conn: conn.clone() }
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.conn.fetch_sub(self.n, Ordering::AcqRel);
        let waiting = {
            let mut st = lock(&self.budget.state);
            st.free += self.n;
            st.waiting
        };
        if waiting > 0 {
            self.budget.cv.notify_all();
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A live connection.
struct Conn {
    sock: Arc<OwnedFd>,
    /// The export it chose, once it has.
    export: Option<String>,
}

struct Shared {
    /// The exports; devices come and go while the server runs.
    devices: RwLock<Vec<Arc<Device>>>,
    /// `cfg.allow`, with the lists of devices added since.
    allow: RwLock<HashMap<String, Vec<Cidr>>>,
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
    pub fn start(devices: Vec<Arc<Device>>, cfg: ServerConfig) -> io::Result<NbdServer> {
        Self::start_with(devices, cfg, Listeners::default())
    }

    /// Starts accepting on the listeners given (sockets already bound and listening, kept by
    /// a keeper across a restart of `serve`: clients that connected meanwhile wait in their
    /// backlog), binding those not given.
    pub fn start_with(devices: Vec<Arc<Device>>, cfg: ServerConfig, adopted: Listeners) -> io::Result<NbdServer> {
        let shared = Arc::new(Shared {
            devices: RwLock::new(devices),
            allow: RwLock::new(cfg.allow.clone()),
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

    /// Offers `device` as an export too; TCP clients may reach it only from `allow` if given.
    /// Refused if an export has its name.
    pub fn add(&self, device: Arc<Device>, allow: Option<Vec<Cidr>>) -> Result<(), String> {
        let mut devices = self.shared.devices.write().unwrap_or_else(|e| e.into_inner());
        if devices.iter().any(|d| d.name() == device.name()) {
            return Err(format!("the NBD export has an export `{}` already", device.name()));
        }
        let mut list = self.shared.allow.write().unwrap_or_else(|e| e.into_inner());
        match allow {
            Some(a) => list.insert(device.name().to_string(), a),
            None => list.remove(device.name()),
        };
        devices.push(device);
        Ok(())
    }

    /// Stops offering export `name`. Refused while clients are connected to it unless
    /// `force`, which disconnects them. Returns whether there was such an export.
    pub fn remove(&self, name: &str, force: bool) -> Result<bool, String> {
        let mut devices = self.shared.devices.write().unwrap_or_else(|e| e.into_inner());
        let Some(i) = devices.iter().position(|d| d.name() == name) else { return Ok(false) };
        let conns = lock(&self.shared.conns);
        let users: Vec<&Conn> = conns.values().filter(|c| c.export.as_deref() == Some(name)).collect();
        if !users.is_empty() && !force {
            return Err(format!("{} NBD client(s) are connected to it", users.len()));
        }
        for c in users {
            let _ = bulkhead_sys::shutdown(c.sock.as_fd());
        }
        devices.remove(i);
        self.shared.allow.write().unwrap_or_else(|e| e.into_inner()).remove(name);
        Ok(true)
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

/// Clients decide how often their connections fail: at most 10 lines a second of it.
pub(crate) static CLIENT_LOG: bulkhead_sys::LogLimit = bulkhead_sys::LogLimit::new(10, Duration::from_secs(1));

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

/// A protocol error that ends the connection.
fn violation(msg: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.into())
}

/// What negotiation settled on.
struct Negotiated {
    device: Arc<Device>,
    structured: bool,
}

/// The socket's read side with a deadline: a read after the deadline fails. With the socket's
/// receive timeout as well, a client that trickles bytes is cut off within the deadline plus
/// one timeout, however it spaces them.
struct DeadlineReader {
    file: std::fs::File,
    deadline: Option<std::time::Instant>,
    /// Reads take only what is already here: `WouldBlock` rather than a wait.
    nonblocking: bool,
}

impl Read for DeadlineReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.deadline.is_some_and(|d| std::time::Instant::now() > d) {
            return Err(io::Error::new(io::ErrorKind::TimedOut, "deadline passed"));
        }
        if !self.nonblocking {
            return self.file.read(buf);
        }
        // What the socket (the client's, or the TLS relay's pair) holds now.
        bulkhead_sys::recv_now(self.file.as_fd(), buf)
    }
}

type SockReader = BufReader<DeadlineReader>;

fn sock_file(fd: &Arc<OwnedFd>) -> io::Result<std::fs::File> {
    Ok(std::fs::File::from(fd.try_clone()?))
}

/// Where a client connects from: `Local` over the unix socket, its address over TCP.
#[derive(Debug, Clone, Copy)]
enum Peer {
    Local,
    Tcp(std::net::IpAddr),
}

/// The peer of `sock`; an error (a TCP peer whose address cannot be read) refuses it.
fn peer_of(sock: &OwnedFd) -> io::Result<Peer> {
    if std::os::unix::net::UnixStream::from(sock.try_clone()?).local_addr().is_ok() {
        return Ok(Peer::Local);
    }
    Ok(Peer::Tcp(std::net::TcpStream::from(sock.try_clone()?).peer_addr()?.ip()))
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
        match negotiate(shared, &haggle, &mut reader, &mut writer).map_err(|e| timeout_says(e, "negotiation"))? {
            Outcome::Abort => return Ok(()),
            Outcome::Go(neg) => {
                // Checked against the exports as they are now, under their lock: a removal
                // either sees this client or this client sees the removal.
                {
                    let devices = shared.devices.read().unwrap_or_else(|e| e.into_inner());
                    if !devices.iter().any(|d| Arc::ptr_eq(d, &neg.device)) {
                        return Err(violation(format!("export {} was removed during negotiation", neg.device.name())));
                    }
                    if let Some(c) = lock(&shared.conns).get_mut(&id) {
                        c.export = Some(neg.device.name().to_string());
                    }
                }
                set_timeout(&sock, SocketTimeout::Read, Some(cfg.request_timeout));
                return transmit(shared, id, raw, reader, writer, neg);
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

/// Where option haggling stands.
struct Haggle {
    peer: Peer,
    /// TLS is on.
    tls: bool,
    /// The client asked for no zeroes after `NBD_OPT_EXPORT_NAME`'s reply.
    no_zeroes: bool,
}

/// How option haggling ended.
enum Outcome {
    /// The client aborted.
    Abort,
    /// Transmission on this export.
    Go(Negotiated),
    /// The client asked for TLS and was told yes: the handshake comes next.
    StartTls,
}

/// Sends the server's greeting and reads the client's flags; returns whether the client
/// asked for no zeroes.
fn greet(r: &mut SockReader, w: &mut std::fs::File) -> io::Result<bool> {
    let mut hello = Vec::with_capacity(18);
    hello.extend_from_slice(&NBDMAGIC.to_be_bytes());
    hello.extend_from_slice(&IHAVEOPT.to_be_bytes());
    hello.extend_from_slice(&(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).to_be_bytes());
    w.write_all(&hello)?;
    let cflags = read_u32(r)?;
    if cflags & !(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES) != 0 {
        return Err(violation(format!("unknown client flags {cflags:#x}")));
    }
    if cflags & FLAG_C_FIXED_NEWSTYLE == 0 {
        return Err(violation("client does not speak fixed newstyle"));
    }
    Ok(cflags & FLAG_C_NO_ZEROES != 0)
}

fn timeout_says(e: io::Error, phase: &str) -> io::Error {
    match e.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => {
            io::Error::new(io::ErrorKind::TimedOut, format!("{phase} did not finish in time"))
        }
        _ => e,
    }
}

fn read_u32(r: &mut impl Read) -> io::Result<u32> {
    let mut b = [0u8; 4];
    r.read_exact(&mut b)?;
    Ok(u32::from_be_bytes(b))
}

fn read_u64(r: &mut impl Read) -> io::Result<u64> {
    let mut b = [0u8; 8];
    r.read_exact(&mut b)?;
    Ok(u64::from_be_bytes(b))
}

/// Whether `peer` may reach `device`.
fn allowed(shared: &Shared, peer: Peer, device: &Device) -> bool {
    match (peer, shared.allow.read().unwrap_or_else(|e| e.into_inner()).get(device.name())) {
        (Peer::Local, _) | (_, None) => true,
        (Peer::Tcp(ip), Some(ranges)) => ranges.iter().any(|r| r.contains(ip)),
    }
}

fn find_device(shared: &Shared, name: &[u8]) -> Option<Arc<Device>> {
    if name.is_empty() {
        // The default export: the first device.
        return shared.devices.read().unwrap_or_else(|e| e.into_inner()).first().cloned();
    }
    shared.devices.read().unwrap_or_else(|e| e.into_inner()).iter().find(|d| d.name().as_bytes() == name).cloned()
}

fn transmission_flags(structured: bool, read_only: bool) -> u16 {
    let mut f =
        TFLAG_HAS_FLAGS | TFLAG_SEND_FLUSH | TFLAG_SEND_FUA | TFLAG_SEND_TRIM | TFLAG_SEND_WRITE_ZEROES | TFLAG_CAN_MULTI_CONN;
    if structured {
        f |= TFLAG_SEND_DF;
    }
    if read_only {
        f |= TFLAG_READ_ONLY;
    }
    f
}

/// Parses the payload of NBD_OPT_INFO / NBD_OPT_GO: name, then the information requested.
fn parse_info_request(data: &[u8]) -> Option<(&[u8], Vec<u16>)> {
    if data.len() < 6 {
        return None;
    }
    let nlen = be32(data) as usize;
    if nlen > MAX_STRING as usize || data.len() < 4 + nlen + 2 {
        return None;
    }
    let name = &data[4..4 + nlen];
    let n = be16(&data[4 + nlen..]) as usize;
    let rest = &data[4 + nlen + 2..];
    if rest.len() != 2 * n {
        return None;
    }
    Some((name, rest.chunks(2).map(be16).collect()))
}

/// Checks the payload of NBD_OPT_LIST_META_CONTEXT / SET_META_CONTEXT.
fn meta_request_valid(data: &[u8]) -> bool {
    if data.len() < 8 {
        return false;
    }
    let nlen = be32(data) as usize;
    if nlen > MAX_STRING as usize || data.len() < 4 + nlen + 4 {
        return false;
    }
    let n = be32(&data[4 + nlen..]) as usize;
    let mut rest = &data[4 + nlen + 4..];
    for _ in 0..n {
        if rest.len() < 4 {
            return false;
        }
        let qlen = be32(rest) as usize;
        if qlen > MAX_STRING as usize || rest.len() < 4 + qlen {
            return false;
        }
        rest = &rest[4 + qlen..];
    }
    rest.is_empty()
}

/// Fixed newstyle negotiation. `None`: the client aborted cleanly.
fn negotiate(shared: &Shared, haggle: &Haggle, r: &mut SockReader, w: &mut std::fs::File) -> io::Result<Outcome> {
    let (peer, no_zeroes) = (haggle.peer, haggle.no_zeroes);
    // TCP clients of an export that requires TLS may do nothing else before it.
    let tls_required = !haggle.tls
        && matches!(peer, Peer::Tcp(_))
        && shared.cfg.tls.as_ref().is_some_and(|t| t.mode == crate::tls::TlsMode::Require);
    let mut structured = false;
    for _ in 0..MAX_OPTIONS {
        let magic = read_u64(r)?;
        if magic != IHAVEOPT {
            return Err(violation(format!("bad option magic {magic:#x}")));
        }
        let opt = read_u32(r)?;
        let len = read_u32(r)?;
        if len > MAX_OPTION {
            // Reading it to stay in step would let a client make us read up to 4 GiB.
            return Err(violation(format!("option {opt} of {len} bytes (limit {MAX_OPTION})")));
        }
        let mut data = vec![0u8; len as usize];
        r.read_exact(&mut data)?;
        let reply = |w: &mut std::fs::File, typ: u32, payload: &[u8]| w.write_all(&option_reply(opt, typ, payload));
        if tls_required && !matches!(opt, OPT_STARTTLS | OPT_ABORT) {
            if opt == OPT_EXPORT_NAME {
                // No error reply exists for this option.
                return Err(violation("NBD_OPT_EXPORT_NAME before TLS, which this server requires"));
            }
            reply(w, REP_ERR_TLS_REQD, b"this server requires TLS")?;
            continue;
        }
        match opt {
            OPT_STARTTLS => {
                if !data.is_empty() || haggle.tls {
                    reply(w, REP_ERR_INVALID, &[])?;
                    continue;
                }
                if shared.cfg.tls.is_none() {
                    reply(w, REP_ERR_UNSUP, b"this server has no TLS configured")?;
                    continue;
                }
                reply(w, REP_ACK, &[])?;
                return Ok(Outcome::StartTls);
            }
            OPT_EXPORT_NAME => {
                if data.len() > MAX_STRING as usize {
                    return Err(violation("export name too long"));
                }
                // No error reply exists for this option: an unknown name closes the connection.
                let device = find_device(shared, &data).ok_or_else(|| violation("unknown export name"))?;
                if !allowed(shared, peer, &device) {
                    return Err(violation(format!("export {} is not allowed from {peer:?}", device.name())));
                }
                let mut v = Vec::with_capacity(10 + 124);
                v.extend_from_slice(&device.size().to_be_bytes());
                v.extend_from_slice(&transmission_flags(structured, device.read_only()).to_be_bytes());
                if !no_zeroes {
                    v.extend_from_slice(&[0u8; 124]);
                }
                w.write_all(&v)?;
                return Ok(Outcome::Go(Negotiated { device, structured }));
            }
            OPT_ABORT => {
                let _ = reply(w, REP_ACK, &[]);
                return Ok(Outcome::Abort);
            }
            OPT_LIST => {
                if !data.is_empty() {
                    reply(w, REP_ERR_INVALID, &[])?;
                    continue;
                }
                let devices = shared.devices.read().unwrap_or_else(|e| e.into_inner()).clone();
                for d in devices.iter().filter(|d| allowed(shared, peer, d)) {
                    let mut p = (d.name().len() as u32).to_be_bytes().to_vec();
                    p.extend_from_slice(d.name().as_bytes());
                    reply(w, REP_SERVER, &p)?;
                }
                reply(w, REP_ACK, &[])?;
            }
            OPT_INFO | OPT_GO => {
                let Some((name, infos)) = parse_info_request(&data) else {
                    reply(w, REP_ERR_INVALID, &[])?;
                    continue;
                };
                let Some(device) = find_device(shared, name) else {
                    reply(w, REP_ERR_UNKNOWN, b"no such export")?;
                    continue;
                };
                if !allowed(shared, peer, &device) {
                    reply(w, REP_ERR_POLICY, b"this export is not allowed from your address")?;
                    continue;
                }
                let mut export = INFO_EXPORT.to_be_bytes().to_vec();
                export.extend_from_slice(&device.size().to_be_bytes());
                export.extend_from_slice(&transmission_flags(structured, device.read_only()).to_be_bytes());
                reply(w, REP_INFO, &export)?;
                for i in infos {
                    let mut p = i.to_be_bytes().to_vec();
                    match i {
                        INFO_NAME => p.extend_from_slice(device.name().as_bytes()),
                        INFO_DESCRIPTION => p.extend_from_slice(b"bulkhead device"),
                        INFO_BLOCK_SIZE => {
                            let min = device.min_block();
                            p.extend_from_slice(&min.to_be_bytes());
                            p.extend_from_slice(&min.max(4096).to_be_bytes());
                            p.extend_from_slice(&MAX_PAYLOAD.to_be_bytes());
                        }
                        _ => continue, // unknown information: ignored, as the protocol asks
                    }
                    reply(w, REP_INFO, &p)?;
                }
                reply(w, REP_ACK, &[])?;
                if opt == OPT_GO {
                    return Ok(Outcome::Go(Negotiated { device, structured }));
                }
            }
            OPT_STRUCTURED_REPLY => {
                if !data.is_empty() || structured {
                    reply(w, REP_ERR_INVALID, &[])?;
                    continue;
                }
                structured = true;
                reply(w, REP_ACK, &[])?;
            }
            OPT_LIST_META_CONTEXT | OPT_SET_META_CONTEXT => {
                // No metadata context is offered; the reply lists none.
                if !structured || !meta_request_valid(&data) {
                    reply(w, REP_ERR_INVALID, &[])?;
                    continue;
                }
                reply(w, REP_ACK, &[])?;
            }
            // No extended headers, nothing else: refused without changing any state.
            _ => reply(w, REP_ERR_UNSUP, &[])?,
        }
    }
    Err(violation(format!("more than {MAX_OPTIONS} options without choosing an export")))
}

/// A reply on its way out: the bytes, and the payload grant its data holds until written.
struct Reply {
    bytes: Vec<u8>,
    _held: Option<Held>,
}

/// Replies queued, in order.
#[derive(Default)]
struct Pending {
    replies: Vec<Reply>,
    /// Bytes of the first reply already sent.
    sent: usize,
}

/// Writes replies for every thread of one connection without a lock convoy: a thread with a
/// reply queues it, and whichever thread finds nobody writing becomes the writer and sends
/// everything queued in as few `sendmsg` calls as it takes (flat combining). No thread ever
/// waits for another's write; a reply queued while a writer is busy goes out with its next
/// batch. A thread holding a device queue only writes what the socket takes now
/// ([`try_flush`](Self::try_flush)): a client that stops reading its replies must not keep a
/// queue others wait for.
struct Replier {
    sock: std::fs::File,
    structured: bool,
    pending: Mutex<Pending>,
    writing: AtomicBool,
    broken: AtomicBool,
    /// The socket took less than was queued at the last non-blocking write: the client is
    /// not reading its replies (or not as fast as they come).
    backed_up: AtomicBool,
    /// A client that takes no reply bytes for this long is broken off.
    write_timeout: Duration,
    /// Where large reply buffers go once sent.
    spare: Arc<Mutex<Spare>>,
}

/// Large buffers of replies sent and of writes the device has, kept for the next ones,
/// by the whole server: a 1 MiB buffer freshly allocated costs 256 page faults (the
/// allocator maps it anew, and unmaps it once freed).
#[derive(Default)]
struct Spare {
    bufs: Vec<Vec<u8>>,
    /// Their capacities together.
    bytes: usize,
}

/// Buffers smaller than this come from the allocator each time.
const SPARE_MIN: usize = 64 << 10;
/// Bytes of spare buffers the server keeps at most.
const SPARE_BYTES: usize = 8 << 20;

impl Spare {
    /// A buffer with room for `len` bytes: a spare one if one is large enough, still holding
    /// its old bytes (a caller that resizes it zeroes only what it grows by), else a new one.
    fn buffer(spare: &Mutex<Spare>, len: usize) -> Vec<u8> {
        if len >= SPARE_MIN {
            let mut sp = lock(spare);
            if let Some(i) = sp.bufs.iter().position(|b| b.capacity() >= len) {
                let b = sp.bufs.swap_remove(i);
                sp.bytes -= b.capacity();
                return b;
            }
        }
        Vec::with_capacity(len)
    }

    /// Keeps `b` if it is large and there is room.
    fn keep(&mut self, b: Vec<u8>) {
        if b.capacity() >= SPARE_MIN && self.bytes + b.capacity() <= SPARE_BYTES {
            self.bytes += b.capacity();
            self.bufs.push(b);
        }
    }
}

impl Replier {
    fn new(sock: std::fs::File, structured: bool, write_timeout: Duration, spare: Arc<Mutex<Spare>>) -> Self {
        Replier {
            sock,
            structured,
            pending: Mutex::new(Pending::default()),
            writing: AtomicBool::new(false),
            broken: AtomicBool::new(false),
            backed_up: AtomicBool::new(false),
            write_timeout,
            spare,
        }
    }

    /// Queues a reply and sends what is queued, waiting for the socket if it must.
    fn send(&self, reply: Reply) {
        self.push(reply);
        self.flush();
    }

    /// Queues a reply, to go out with the next flush (this thread's or another's): a thread
    /// answering several requests at once sends them in one `sendmsg`.
    fn push(&self, reply: Reply) {
        lock(&self.pending).replies.push(reply);
    }

    /// Sends every queued reply, waiting for the socket to take them, unless another thread
    /// is writing (which then sends them). Only for a thread that holds no device queue.
    fn flush(&self) {
        self.write_out(true);
    }

    /// Sends what the socket takes now of the queued replies; the rest waits for the next
    /// flush. Returns whether the client keeps up ([`backed_up`](Self::backed_up) is clear).
    fn try_flush(&self) -> bool {
        self.write_out(false);
        !self.backed_up()
    }

    /// Whether the last write found the socket full: the client is not reading its replies.
    fn backed_up(&self) -> bool {
        self.backed_up.load(Ordering::Acquire) && !self.broken.load(Ordering::Acquire)
    }

    fn write_out(&self, wait: bool) {
        loop {
            if self.writing.compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire).is_err() {
                return; // the writer at work takes it
            }
            loop {
                let (batch, sent) = {
                    let mut p = lock(&self.pending);
                    (std::mem::take(&mut p.replies), std::mem::take(&mut p.sent))
                };
                if batch.is_empty() {
                    self.backed_up.store(false, Ordering::Release);
                    break;
                }
                let stopped = if self.broken.load(Ordering::Acquire) {
                    None
                } else {
                    match self.write_batch(&batch, sent, wait) {
                        Ok(stopped) => stopped,
                        Err(_) => {
                            self.broken.store(true, Ordering::Release);
                            None
                        }
                    }
                };
                let Some((first, sent)) = stopped else {
                    self.recycle(batch);
                    continue;
                };
                // The socket is full: what it did not take goes back ahead of what was
                // queued meanwhile.
                self.backed_up.store(true, Ordering::Release);
                let mut batch = batch;
                let rest = batch.split_off(first);
                self.recycle(batch);
                let mut p = lock(&self.pending);
                let newer = std::mem::replace(&mut p.replies, rest);
                p.replies.extend(newer);
                p.sent = sent;
                break;
            }
            self.writing.store(false, Ordering::Release);
            // A reply queued after the last look but before the flag dropped found the flag
            // still up and left: look once more (unless the socket is full and this thread
            // must not wait for it).
            if lock(&self.pending).replies.is_empty() || self.backed_up() && !wait {
                return;
            }
        }
    }

    /// A buffer with room for a reply of `len` bytes ([`Spare::buffer`]).
    fn buffer(&self, len: usize) -> Vec<u8> {
        Spare::buffer(&self.spare, len)
    }

    /// Gives the payload grants of replies sent back, and their large buffers to the spares.
    fn recycle(&self, batch: Vec<Reply>) {
        let mut spare = None;
        for Reply { bytes, _held } in batch {
            drop(_held);
            if bytes.capacity() >= SPARE_MIN {
                spare.get_or_insert_with(|| lock(&self.spare)).keep(bytes);
            }
        }
    }

    /// Writes `batch`, from byte `sent` of its first reply. Without `wait`, stops when the
    /// socket is full, returning where: the reply and the bytes of it sent.
    fn write_batch(&self, batch: &[Reply], mut sent: usize, wait: bool) -> io::Result<Option<(usize, usize)>> {
        const MAX_IOV: usize = 1024;
        let mut first = 0;
        let mut stalled: Option<Instant> = None;
        while first < batch.len() {
            let group = &batch[first..(first + MAX_IOV).min(batch.len())];
            let slices: Vec<io::IoSlice<'_>> = group
                .iter()
                .enumerate()
                .map(|(i, r)| io::IoSlice::new(if i == 0 { &r.bytes[sent..] } else { &r.bytes }))
                .collect();
            match bulkhead_sys::send_vectored_now(self.sock.as_fd(), &slices) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(mut n) => {
                    stalled = None;
                    // Past the replies sent whole, into the one sent in part.
                    while first < batch.len() && n >= batch[first].bytes.len() - sent {
                        n -= batch[first].bytes.len() - sent;
                        first += 1;
                        sent = 0;
                    }
                    sent += n;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    if !wait {
                        return Ok(Some((first, sent)));
                    }
                    // Until the socket takes more; a client that takes nothing for the request
                    // timeout is broken off.
                    let since = *stalled.get_or_insert_with(Instant::now);
                    let left = self.write_timeout.saturating_sub(since.elapsed());
                    if left.is_zero() {
                        return Err(io::Error::new(
                            io::ErrorKind::TimedOut,
                            "the client took no reply within the request timeout",
                        ));
                    }
                    let mut fds = [libc::pollfd { fd: self.sock.as_raw_fd(), events: libc::POLLOUT, revents: 0 }];
                    bulkhead_sys::poll(&mut fds, left.as_millis().clamp(1, i32::MAX as u128) as i32)?;
                    continue;
                }
                Err(e) => return Err(e),
            }
        }
        Ok(None)
    }

    /// A reply without data, sent: success or an error.
    fn done(&self, cookie: u64, error: u32) {
        self.send(self.status(cookie, error));
    }

    /// A reply without data.
    fn status(&self, cookie: u64, error: u32) -> Reply {
        let bytes = if !self.structured {
            simple_reply(error, cookie).to_vec()
        } else if error == 0 {
            chunk_header(REPLY_FLAG_DONE, REPLY_TYPE_NONE, cookie, 0).to_vec()
        } else {
            let mut b = chunk_header(REPLY_FLAG_DONE, REPLY_TYPE_ERROR, cookie, 6).to_vec();
            b.extend_from_slice(&error.to_be_bytes());
            b.extend_from_slice(&0u16.to_be_bytes());
            b
        };
        Reply { bytes, _held: None }
    }
}

fn io_error(e: &IoError) -> u32 {
    error_of_errno(e.errno())
}

/// One request read off the socket and parsed, served by the thread that read it.
struct Job {
    cookie: u64,
    cmd: Command<u32, u32>,
    /// A trim or write-zeroes with FUA: a flush follows it before the reply.
    flush_after: bool,
    /// A write's data.
    payload: Vec<u8>,
    /// The payload budget its data takes: a write's payload, or a read's reply.
    held: Option<Held>,
}

impl Job {
    /// Whether it goes to the device as one queued request (anything else runs on its own,
    /// off the lead: a transfer larger than the queue carries, or a command of several steps).
    fn queued(&self, max_request: u64) -> bool {
        match self.cmd {
            Command::Read { into: len, .. } | Command::Write { from: len, .. } => u64::from(len) <= max_request,
            Command::Flush => true,
            Command::Discard { .. } => !self.flush_after,
            // It may fall back to writing zeroes, in several requests.
            Command::WriteZeroes { .. } => false,
        }
    }

    /// The device request it makes (a write's data is its payload).
    fn front(&self) -> FrontRequest<'_> {
        self.cmd.map(u64::from, |_| &self.payload[..])
    }
}

/// The socket's read side during transmission: a buffer that can also be filled without
/// waiting, and topped up when a request's header arrived in pieces.
struct SockBuf {
    r: DeadlineReader,
    buf: Box<[u8]>,
    start: usize,
    end: usize,
}

impl SockBuf {
    const CAPACITY: usize = 64 << 10;

    /// Takes over negotiation's reader, with what it had read ahead.
    fn new(r: SockReader) -> Self {
        let mut buf = vec![0u8; Self::CAPACITY].into_boxed_slice();
        let ahead = r.buffer().len();
        buf[..ahead].copy_from_slice(r.buffer());
        SockBuf { r: r.into_inner(), buf, start: 0, end: ahead }
    }

    fn buffered(&self) -> &[u8] {
        &self.buf[self.start..self.end]
    }

    fn consume(&mut self, n: usize) {
        self.start = (self.start + n).min(self.end);
    }

    /// Reads into the buffer's free space, after moving what is buffered to its front;
    /// `Ok(0)`: the client closed (or the buffer is full).
    fn fill(&mut self) -> io::Result<usize> {
        if self.start > 0 {
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        loop {
            match self.r.read(&mut self.buf[self.end..]) {
                Ok(n) => {
                    self.end += n;
                    return Ok(n);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
    }

    /// Adds what the socket holds now, without waiting: whether anything came (or the
    /// client closed, which the next read finds out).
    fn fill_now(&mut self) -> io::Result<bool> {
        self.r.nonblocking = true;
        let filled = match self.fill() {
            Ok(_) => Ok(true),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(false),
            Err(e) => Err(e),
        };
        self.r.nonblocking = false;
        filled
    }
}

impl Read for SockBuf {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        if self.start == self.end {
            if out.len() >= self.buf.len() {
                return self.r.read(out);
            }
            self.start = 0;
            self.end = 0;
            if self.fill()? == 0 {
                return Ok(0);
            }
        }
        let n = out.len().min(self.end - self.start);
        out[..n].copy_from_slice(&self.buf[self.start..self.start + n]);
        self.start += n;
        Ok(n)
    }
}

/// The read side of a connection and how it ended; held by the connection's leader.
struct Inbound {
    r: SockBuf,
    ended: Option<io::Result<()>>,
}

/// What the leader found on the socket.
enum Next {
    Job(Job),
    /// The client disconnected.
    End,
    /// Nothing more without waiting (or without payload budget).
    NotNow,
}

/// The requests one leader has read and not yet answered, by the token each goes to the
/// device under.
#[derive(Default)]
struct Jobs {
    slots: Vec<Option<Job>>,
    free: Vec<usize>,
    /// Read, not yet taken by the device (its queue was full), oldest first.
    waiting: std::collections::VecDeque<usize>,
}

impl Jobs {
    fn insert(&mut self, job: Job) -> usize {
        match self.free.pop() {
            Some(i) => {
                self.slots[i] = Some(job);
                i
            }
            None => {
                self.slots.push(Some(job));
                self.slots.len() - 1
            }
        }
    }

    fn take(&mut self, token: u64) -> Job {
        let i = token as usize;
        self.free.push(i);
        self.slots[i].take().expect("a request is answered once")
    }
}

/// One connection in transmission. Its leader runs the connection: it reads requests as they
/// come, puts each in flight on its queue at once, answers each as the device does, and
/// looks at the socket again whenever an answer went out, so a client that keeps sixteen
/// requests in flight finds sixteen in flight on the device, with no thread between the
/// socket and the channel. While requests are in flight it waits as the channel does: it
/// spins on the queue for an adaptive budget (with more than two in flight, a few
/// `sched_yield` calls instead), then sleeps on the socket and the queue's doorbell
/// together. The other threads wait for the lead (leader/follower, as
/// nbdkit's threads take turns): a request that cannot go in flight as one (larger than the
/// queue carries, or of several steps) makes its leader pass the lead on and serve it alone,
/// so it holds up no other request.
struct Connection<'a> {
    shared: &'a Shared,
    raw: RawFd,
    device: Arc<Device>,
    structured: bool,
    inbound: Mutex<Inbound>,
    replier: Replier,
    /// Payload budget this connection holds: its writes' data and its reads' replies until
    /// they are sent.
    held: Arc<AtomicU64>,
}

fn transmit(shared: &Shared, id: u64, raw: RawFd, r: SockReader, w: std::fs::File, neg: Negotiated) -> io::Result<()> {
    let conn = Connection {
        shared,
        raw,
        structured: neg.structured,
        device: neg.device,
        inbound: Mutex::new(Inbound { r: SockBuf::new(r), ended: None }),
        replier: Replier::new(w, neg.structured, shared.cfg.request_timeout, shared.spare.clone()),
        held: Arc::new(AtomicU64::new(0)),
    };
    let threads = shared.cfg.workers_per_connection.max(1);
    // Spread connections and their threads over the device's queues.
    let slot = |i: usize| (id as usize).wrapping_mul(threads).wrapping_add(i);
    std::thread::scope(|s| {
        for i in 1..threads {
            let c = &conn;
            // A thread that cannot be started leaves fewer to share the work; this one serves.
            let _ = std::thread::Builder::new().name("nbd-worker".into()).spawn_scoped(s, move || c.serve(slot(i)));
        }
        conn.serve(slot(0));
    });
    // Every thread has answered what it read and queued its replies; the last writer sent them.
    let ended = lock(&conn.inbound).ended.take();
    ended.unwrap_or(Ok(()))
}

/// Requests in flight up to which the leader spins for an answer. With more, answers come in
/// groups and one wake-up serves several; a spinning leader would instead take the CPU from
/// the driver it waits for (two CPUs here, and the client on one of them: QD16 made 75–81k
/// IOPS with a p99 of 1.2 ms spinning at any depth, 80–90k with 0.35 ms spinning at 1–2).
const SPIN_DEPTH: usize = 2;

/// Deeper than [`SPIN_DEPTH`], the leader calls `sched_yield` this many times, looking at the
/// queue after each and at the socket after every other, before it sleeps. Alone on its CPU
/// the calls return at once (a few µs in all); with the driver or the client runnable on the
/// same CPU, that thread runs first, and its answers or next requests are often there when
/// the call returns, so no doorbell and no wake-up are needed. QD16 on a `ram` device, 16
/// runs against 14 without: 125k IOPS on average against 116k, p50 102 µs in most runs
/// against 124 µs (docs/BENCHMARKS.md).
const DEEP_YIELDS: u32 = 8;
/// Turns of an idle spin between looks at the socket (each look is a system call).
const LOOK_EVERY: u32 = 256;
/// Requests one leader holds read but not yet in flight (its queue is full) at most.
const MAX_WAITING: usize = 64;
/// How soon a queue between generations (or whose doorbell storms) is looked at again.
const LATER_MS: libc::c_int = 1;
/// How long a sleep on the socket and a queue lasts at most before the queue is looked at
/// again (its generation, its device's health, its timeout).
const SLEEP_SLICE_MS: libc::c_int = 50;

impl Connection<'_> {
    /// One thread's life: take the lead, run the connection until the lead must pass, answer
    /// what is still in flight and serve the requests that run alone; until the connection
    /// ends.
    fn serve(&self, slot: usize) {
        let dev = &*self.device;
        let policy = if dev.mode() == NotifyMode::Irq { BudgetPolicy::Fixed(0) } else { BudgetPolicy::DEFAULT_AUTO };
        // The leader spins only with one or two requests in flight (`SPIN_DEPTH`), or for the
        // client's next request: an answer or a request is due within one request's time.
        // There, a run-queue count mostly finds other clients' threads, and a sleep costs a
        // doorbell wake-up on every answer: beside a capped neighbour's connection, a QD1
        // reader's p99 was 124–136 µs with the check and 80–85 µs without it
        // (docs/BENCHMARKS.md, "Over NBD: a leader that spins whatever the crowd").
        let mut idle = IdleSpin::new(policy).without_crowd_check();
        let mut jobs = Jobs::default();
        let mut alone = Vec::new();
        loop {
            let mut q = None;
            {
                let mut inb = lock(&self.inbound);
                if inb.ended.is_some() {
                    return;
                }
                self.lead(&mut inb, slot, &mut q, &mut jobs, &mut alone, &mut idle);
            }
            if let Some(q) = q.as_mut() {
                loop {
                    self.submit_waiting(q, &mut jobs);
                    if q.in_flight() == 0 {
                        break;
                    }
                    q.wait(|token, result, data| self.finish(jobs.take(token), result.map(|_| ()), data));
                    self.replier.try_flush();
                }
            }
            drop(q);
            self.replier.flush();
            for j in alone.drain(..) {
                self.run_alone(slot, j);
            }
        }
    }

    /// Runs the connection while this thread leads: returns when the client has gone, or a
    /// request must run alone (in `alone`), leaving what is in flight on `q` to the caller.
    #[allow(clippy::too_many_arguments)]
    fn lead<'d>(
        &'d self,
        inb: &mut Inbound,
        slot: usize,
        q: &mut Option<QueueHandle<'d>>,
        jobs: &mut Jobs,
        alone: &mut Vec<Job>,
        idle: &mut IdleSpin,
    ) {
        let dev = &*self.device;
        let max = dev.max_request();
        // An `irq` device's leader never spins, not even by yielding.
        let deep_yields = if dev.mode() == NotifyMode::Irq { 0 } else { DEEP_YIELDS };
        let mut last_answer = Instant::now();
        let mut look = true;
        let mut spins = 0u32;
        let mut yields = 0u32;
        loop {
            if q.is_none() && self.replier.backed_up() {
                // The client is behind on its replies: wait for it here, holding no queue.
                self.replier.flush();
            }
            let in_flight = q.as_ref().map_or(0, |q| q.in_flight()) + jobs.waiting.len();
            let mut work = 0;
            // Requests: wait for one when nothing is in flight; otherwise take what is here.
            if look || in_flight == 0 {
                look = false;
                let mut wait = in_flight == 0;
                while jobs.waiting.len() < MAX_WAITING {
                    match self.next(&mut inb.r, wait) {
                        Ok(Next::Job(j)) if j.queued(max) => {
                            let i = jobs.insert(j);
                            jobs.waiting.push_back(i);
                        }
                        Ok(Next::Job(j)) => {
                            alone.push(j);
                            break;
                        }
                        Ok(Next::NotNow) => break,
                        Ok(Next::End) => {
                            inb.ended = Some(Ok(()));
                            break;
                        }
                        Err(e) => {
                            inb.ended = Some(Err(e));
                            break;
                        }
                    }
                    work += 1;
                    wait = false;
                }
            }
            // Into flight: every request read, while the queue has room.
            if !jobs.waiting.is_empty() {
                if in_flight == 0 {
                    // The device's timeout counts from here, not from the last answer before
                    // the client went quiet.
                    last_answer = Instant::now();
                }
                // Take any queue nobody holds; wait in line for one only while holding none.
                let h = q.get_or_insert_with(|| dev.try_queue(slot).unwrap_or_else(|| dev.queue(slot)));
                // After its turn, with others in line, or while its client is not reading
                // its replies, this connection only drains.
                if !h.turn_over() && !self.replier.backed_up() {
                    work += self.submit_waiting(h, jobs);
                }
            }
            // Answers.
            if let Some(h) = q.as_mut() {
                let n = h.poll(|token, result, data| self.finish(jobs.take(token), result.map(|_| ()), data));
                if n > 0 {
                    last_answer = Instant::now();
                    // The client sends its next requests as answers reach it.
                    look = true;
                }
                work += n;
                work += h.expire(last_answer, |token, result, _| self.finish(jobs.take(token), result.map(|_| ()), None));
                if work > 0 {
                    self.replier.try_flush();
                }
                if h.in_flight() == 0 && (jobs.waiting.is_empty() || h.turn_over() || self.replier.backed_up()) {
                    // Drained: the queue goes to the next in line, and this connection, with
                    // requests still to send, asks again at the back.
                    *q = None;
                }
            }
            if inb.ended.is_some() || !alone.is_empty() {
                return;
            }
            let now = now_ns();
            if work > 0 {
                idle.worked(now);
                spins = 0;
                yields = 0;
                continue;
            }
            let Some(h) = q.as_mut() else { continue };
            // Many in flight and nothing new: let a thread runnable on this CPU go first a
            // few times, then sleep.
            if h.in_flight() > SPIN_DEPTH && yields < deep_yields {
                yields += 1;
                look = yields.is_multiple_of(2);
                std::thread::yield_now();
                continue;
            }
            // Few in flight and nothing new: spin on the queue, looking at the socket now and
            // then; then sleep on both.
            if idle.spin(now, h.in_flight() <= SPIN_DEPTH) {
                spins += 1;
                look = spins.is_multiple_of(LOOK_EVERY);
                std::hint::spin_loop();
                continue;
            }
            look = self.sleep(h, &inb.r);
        }
    }

    /// Puts the requests read and waiting in flight while `h` has room, oldest first; one
    /// the device refuses on sight is answered (queued for the replier). Returns how many
    /// were refused.
    fn submit_waiting(&self, h: &mut QueueHandle<'_>, jobs: &mut Jobs) -> usize {
        let mut refused = 0;
        while let Some(&i) = jobs.waiting.front() {
            let job = jobs.slots[i].as_ref().expect("a waiting request is held");
            match h.submit(job.front(), i as u64) {
                Ok(()) => {
                    // The device has the data (copied into its arena): the buffer can go.
                    let job = jobs.slots[i].as_mut().expect("a waiting request is held");
                    if job.payload.capacity() >= SPARE_MIN {
                        lock(&self.shared.spare).keep(std::mem::take(&mut job.payload));
                    }
                }
                Err(IoError::QueueFull) => break,
                Err(e) => {
                    let j = jobs.take(i as u64);
                    self.finish(j, Err(e), None);
                    refused += 1;
                }
            }
            jobs.waiting.pop_front();
        }
        refused
    }

    /// Sleeps until the socket has something to read or the queue answers; returns whether
    /// the socket is worth a look.
    fn sleep(&self, h: &mut QueueHandle<'_>, r: &SockBuf) -> bool {
        let mut fds = [
            libc::pollfd { fd: self.raw, events: libc::POLLIN, revents: 0 },
            libc::pollfd { fd: -1, events: libc::POLLIN, revents: 0 },
        ];
        let timeout = match h.arm() {
            Armed::Idle | Armed::Now => return true,
            Armed::Spin => {
                // A `poll` device's driver never rings: look again, after any thread runnable
                // on this CPU has had its turn.
                std::thread::yield_now();
                return true;
            }
            Armed::Later => LATER_MS,
            Armed::Fd(fd) => {
                fds[1].fd = fd;
                SLEEP_SLICE_MS
            }
        };
        // A whole header not taken (its payload budget is short, or enough requests wait for
        // the queue): the socket would say "readable" at once, for ever. Answers come first.
        let watch_socket = r.buffered().len() < RequestHeader::SIZE;
        let fds = if watch_socket { &mut fds[..] } else { &mut fds[1..] };
        // A failed wait is a short one: the caller looks again.
        let _ = bulkhead_sys::poll(fds, timeout);
        h.disarm();
        watch_socket && fds[0].revents != 0
    }
    /// Waits up to `timeout_ms` (-1: for ever) for the socket to have something to read (or to
    /// be closed or broken, which the read that follows finds out).
    fn readable(&self, timeout_ms: libc::c_int) -> io::Result<bool> {
        let mut pfd = [libc::pollfd { fd: self.raw, events: libc::POLLIN, revents: 0 }];
        // An interrupted wait reports nothing ready, as a timeout would: the caller looks again.
        match bulkhead_sys::poll(&mut pfd, timeout_ms)? {
            0 if timeout_ms < 0 => Err(io::Error::from(io::ErrorKind::Interrupted)),
            0 => Ok(false),
            _ => Ok(pfd[0].revents & libc::POLLIN != 0),
        }
    }

    /// Whether a whole request header is here, adding what the socket holds without waiting.
    fn more_waiting(&self, r: &mut SockBuf) -> io::Result<bool> {
        if r.buffered().len() < RequestHeader::SIZE {
            r.r.deadline = None;
            r.fill_now()?;
        }
        Ok(r.buffered().len() >= RequestHeader::SIZE)
    }

    /// Reads the next request to serve, answering the ones refused on sight. With `wait`
    /// (nothing is in flight), the request is waited for, as long as the client likes;
    /// otherwise only a request whose header is already here is taken, and only while the
    /// payload budget has room without waiting.
    fn next(&self, r: &mut SockBuf, wait: bool) -> io::Result<Next> {
        let shared = self.shared;
        loop {
            if self.replier.broken.load(Ordering::Acquire) {
                return Err(io::Error::new(io::ErrorKind::BrokenPipe, "cannot write replies"));
            }
            let req = if wait {
                if r.buffered().is_empty() {
                    // Idle between requests is fine, for as long as the client likes.
                    match self.readable(-1) {
                        Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                        Err(e) => return Err(e),
                        Ok(_) => {}
                    }
                    r.r.deadline = None;
                    if r.fill()? == 0 {
                        return Ok(Next::End); // the client closed
                    }
                }
                // From its first byte, a request (header and payload) must arrive in time.
                r.r.deadline = Some(Instant::now() + shared.cfg.request_timeout);
                let mut hdr = [0u8; RequestHeader::SIZE];
                r.read_exact(&mut hdr).map_err(|e| timeout_says(e, "request"))?;
                RequestHeader::decode(&hdr).ok_or_else(|| violation("bad request magic"))?
            } else {
                if !self.more_waiting(r)? {
                    return Ok(Next::NotNow);
                }
                // Looked at, not taken: a request the budget cannot hold now stays for later.
                RequestHeader::decode(r.buffered()[..RequestHeader::SIZE].try_into().expect("a whole header"))
                    .ok_or_else(|| violation("bad request magic"))?
            };
            let (cookie, cmd, flush_after) = match req.parse(self.device.size(), self.structured) {
                Ok(Transmission::Io { cookie, cmd, flush_after }) => (cookie, cmd, flush_after),
                Ok(Transmission::Disconnect) => {
                    if !wait {
                        r.consume(RequestHeader::SIZE);
                    }
                    return Ok(Next::End);
                }
                Err(Refused { error, payload }) => {
                    if !wait {
                        r.consume(RequestHeader::SIZE);
                        r.r.deadline = Some(Instant::now() + shared.cfg.request_timeout);
                    }
                    if let Some(len) = payload {
                        if len > MAX_PAYLOAD {
                            // Cannot skip that much without reading it: refuse and close.
                            self.replier.push(self.replier.status(req.cookie, error));
                            return Err(violation(format!("write of {len} bytes (limit {MAX_PAYLOAD})")));
                        }
                        // Stay in step: consume the payload of the refused write.
                        io::copy(&mut r.take(len.into()), &mut io::sink()).map_err(|e| timeout_says(e, "request"))?;
                    }
                    // Sent now if the socket takes it (the leader may hold a queue: no
                    // waiting here); else with the leader's next flush.
                    self.replier.push(self.replier.status(req.cookie, error));
                    self.replier.try_flush();
                    shared.stats.requests.fetch_add(1, Ordering::Relaxed);
                    continue;
                }
            };
            let bytes = match cmd {
                Command::Read { into: n, .. } | Command::Write { from: n, .. } => u64::from(n),
                Command::Flush | Command::Discard { .. } | Command::WriteZeroes { .. } => 0,
            };
            let held = match (bytes, wait) {
                (0, _) => None,
                (n, true) => Some(shared.budget.take(n, &self.held)),
                (n, false) => match shared.budget.try_take(n, &self.held, CONNECTION_SHARE) {
                    Some(h) => Some(h),
                    None => return Ok(Next::NotNow),
                },
            };
            if !wait {
                r.consume(RequestHeader::SIZE);
                r.r.deadline = Some(Instant::now() + shared.cfg.request_timeout);
            }
            let mut payload = Vec::new();
            if let Command::Write { from: len, .. } = cmd {
                payload = Spare::buffer(&shared.spare, len as usize);
                payload.resize(len as usize, 0);
                r.read_exact(&mut payload).map_err(|e| timeout_says(e, "request"))?;
            }
            return Ok(Next::Job(Job { cookie, cmd, flush_after, payload, held }));
        }
    }

    /// Answers a queued request with its outcome (and a read's data). The reply is queued:
    /// the caller flushes the replier once it has answered what it holds.
    fn finish(&self, job: Job, result: Result<(), IoError>, data: Option<SharedSlice<'_>>) {
        self.shared.stats.requests.fetch_add(1, Ordering::Relaxed);
        let counters = &self.device.counters;
        let cookie = job.cookie;
        let status = |r: Result<(), IoError>| r.err().map_or(0, |e| io_error(&e));
        let reply = match job.cmd {
            Command::Read { offset, into: len } => match (result, data) {
                (Ok(()), Some(d)) if d.len() == len as usize => {
                    counters.bytes_read.fetch_add(len.into(), Ordering::Relaxed);
                    let hdr = if self.structured { 20 + 8 } else { 16 };
                    let mut buf = self.replier.buffer(hdr + len as usize);
                    buf.resize(hdr, 0);
                    d.append_to(&mut buf);
                    self.data_reply(cookie, offset, buf, job.held)
                }
                // An answer without the data asked for.
                (Ok(()), _) => self.replier.status(cookie, EIO),
                (Err(e), _) => self.replier.status(cookie, io_error(&e)),
            },
            Command::Write { from: len, .. } => {
                if result.is_ok() {
                    counters.bytes_written.fetch_add(len.into(), Ordering::Relaxed);
                }
                drop(job.held);
                self.replier.status(cookie, status(result))
            }
            Command::Flush | Command::Discard { .. } | Command::WriteZeroes { .. } => self.replier.status(cookie, status(result)),
        };
        self.replier.push(reply);
    }

    /// A read's reply: `buf` holds room for the header, then the data.
    fn data_reply(&self, cookie: u64, offset: u64, mut buf: Vec<u8>, held: Option<Held>) -> Reply {
        if self.structured {
            let len = buf.len() - (20 + 8);
            let h = chunk_header(REPLY_FLAG_DONE, REPLY_TYPE_OFFSET_DATA, cookie, 8 + len as u32);
            buf[..20].copy_from_slice(&h);
            buf[20..28].copy_from_slice(&offset.to_be_bytes());
        } else {
            buf[..16].copy_from_slice(&simple_reply(0, cookie));
        }
        Reply { bytes: buf, _held: held }
    }

    /// Runs one request by itself, in as many steps as it takes, and answers it.
    fn run_alone(&self, slot: usize, job: Job) {
        let dev = &*self.device;
        let cookie = job.cookie;
        let status = |r: Result<(), IoError>| r.err().map_or(0, |e| io_error(&e));
        let then_flush = |r: Result<(), IoError>| r.and_then(|_| if job.flush_after { dev.flush(slot) } else { Ok(()) });
        self.shared.stats.requests.fetch_add(1, Ordering::Relaxed);
        match job.cmd {
            Command::Read { offset, into: len } => {
                let hdr = if self.structured { 20 + 8 } else { 16 };
                let mut buf = vec![0u8; hdr + len as usize];
                match dev.read_into(slot, offset, &mut buf[hdr..]) {
                    Ok(()) => self.replier.send(self.data_reply(cookie, offset, buf, job.held)),
                    Err(e) => self.replier.done(cookie, io_error(&e)),
                }
            }
            Command::Write { offset, from: _, fua } => {
                let r = dev.write(slot, offset, &job.payload, fua);
                self.replier.done(cookie, status(r));
            }
            Command::Flush => self.replier.done(cookie, status(dev.flush(slot))),
            Command::Discard { offset, len } => self.replier.done(cookie, status(then_flush(dev.discard(slot, offset, len)))),
            Command::WriteZeroes { offset, len } => self.replier.done(cookie, status(then_flush(zero(dev, slot, offset, len)))),
        }
    }
}

/// Write-zeroes, falling back to writing zeroes where the device cannot zero a range itself.
fn zero(dev: &Device, slot: usize, offset: u64, len: u64) -> Result<(), IoError> {
    match dev.write_zeroes(slot, offset, len) {
        Err(IoError::Device(bulkhead_client::Status::NotSupported)) => {
            let chunk = vec![0u8; (len.min(1 << 20)) as usize];
            let mut done = 0;
            while done < len {
                let n = (len - done).min(chunk.len() as u64) as usize;
                dev.write(slot, offset + done, &chunk[..n], false)?;
                done += n as u64;
            }
            Ok(())
        }
        r => r,
    }
}

/// The unix socket path of a run directory.
pub fn socket_path(run_dir: &Path) -> PathBuf {
    run_dir.join("nbd.sock")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replies_a_client_does_not_read_wait_in_order_without_blocking_the_writer() {
        let (ours, theirs) = std::os::unix::net::UnixStream::pair().unwrap();
        let replier =
            Replier::new(OwnedFd::from(ours).into(), false, Duration::from_secs(5), Arc::new(Mutex::new(Spare::default())));
        // Far more than the socket holds: replies of 1000 bytes, each filled with its number.
        let count = 2000u32;
        for i in 0..count {
            replier.push(Reply { bytes: vec![i as u8; 1000], _held: None });
        }
        assert!(!replier.try_flush(), "the socket cannot hold 2 MB: the writer must stop, not wait");
        assert!(replier.backed_up());
        let reader = std::thread::spawn(move || {
            let mut all = Vec::new();
            (&theirs).read_to_end(&mut all).unwrap();
            all
        });
        replier.flush();
        assert!(!replier.backed_up(), "all written");
        drop(replier);
        let all = reader.join().unwrap();
        assert_eq!(all.len(), count as usize * 1000);
        for (i, reply) in all.chunks(1000).enumerate() {
            assert!(reply.iter().all(|&b| b == i as u8), "reply {i} out of order or torn");
        }
    }

    #[test]
    fn a_client_that_takes_no_reply_for_the_timeout_is_broken_off() {
        let (ours, _theirs) = std::os::unix::net::UnixStream::pair().unwrap();
        let replier =
            Replier::new(OwnedFd::from(ours).into(), false, Duration::from_millis(200), Arc::new(Mutex::new(Spare::default())));
        for _ in 0..2000 {
            replier.push(Reply { bytes: vec![0; 1000], _held: None });
        }
        let t = Instant::now();
        replier.flush();
        assert!(replier.broken.load(Ordering::Acquire));
        assert!(t.elapsed() >= Duration::from_millis(200) && t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
    }

    #[test]
    fn payload_budget_waits_and_returns_on_drop() {
        let b = Arc::new(Budget::new(100));
        let conn = Arc::new(AtomicU64::new(0));
        let first = b.take(80, &conn);
        assert!(b.try_take(10, &conn, 85).is_none(), "beyond the connection's share");
        let (b2, c2, t0) = (b.clone(), conn.clone(), std::time::Instant::now());
        let waiter = std::thread::spawn(move || {
            let _second = b2.take(50, &c2);
            t0.elapsed()
        });
        std::thread::sleep(Duration::from_millis(50));
        drop(first);
        assert!(waiter.join().unwrap() >= Duration::from_millis(50), "took bytes that were not free");
        assert_eq!(lock(&b.state).free, 100, "every grant came back");
        assert_eq!(conn.load(Ordering::Acquire), 0, "and the connection holds none");
    }

    #[test]
    fn info_and_meta_payloads_are_parsed_strictly() {
        let mut ok = 4u32.to_be_bytes().to_vec();
        ok.extend_from_slice(b"disk");
        ok.extend_from_slice(&2u16.to_be_bytes());
        ok.extend_from_slice(&INFO_BLOCK_SIZE.to_be_bytes());
        ok.extend_from_slice(&INFO_NAME.to_be_bytes());
        let (name, infos) = parse_info_request(&ok).unwrap();
        assert_eq!((name, infos), (&b"disk"[..], vec![INFO_BLOCK_SIZE, INFO_NAME]));
        assert!(parse_info_request(&ok[..ok.len() - 1]).is_none(), "truncated");
        let mut long = ok.clone();
        long.push(0);
        assert!(parse_info_request(&long).is_none(), "trailing byte");
        let mut huge = u32::MAX.to_be_bytes().to_vec();
        huge.extend_from_slice(&[0; 8]);
        assert!(parse_info_request(&huge).is_none(), "name length beyond the payload");

        let mut m = 4u32.to_be_bytes().to_vec();
        m.extend_from_slice(b"disk");
        m.extend_from_slice(&1u32.to_be_bytes());
        m.extend_from_slice(&15u32.to_be_bytes());
        m.extend_from_slice(b"base:allocation");
        assert!(meta_request_valid(&m));
        assert!(!meta_request_valid(&m[..m.len() - 1]));
        let mut lie = m.clone();
        lie[8 + 3] = 9; // claims 9 queries
        assert!(!meta_request_valid(&lie));
    }
}
