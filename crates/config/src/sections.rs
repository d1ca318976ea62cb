//! The sections of `serve` itself: the exports, the control socket, the log, the metrics and
//! the keeper. None of their keys may change on a running `serve` (a reload that changes one
//! is refused, naming it): they shape the process.

use std::path::PathBuf;

use serde::Deserialize;
use toml::Spanned;

use crate::{At, ConfigError};

/// The FUSE export.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Fuse {
    /// Export devices under `<run-dir>/fuse/`.
    #[serde(default = "yes")]
    pub enabled: bool,
    /// Threads reading `/dev/fuse`.
    #[serde(default = "default_threads")]
    pub threads: Spanned<u32>,
    /// FUSE over io_uring.
    #[serde(default)]
    pub io_uring: FuseUring,
    /// Requests each io_uring ring holds.
    #[serde(default = "default_fuse_depth")]
    pub queue_depth: Spanned<u32>,
}

/// Whether the FUSE export carries requests over io_uring.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FuseUring {
    /// Where the kernel has it (switching the `fuse` module's `enable_uring` on when it may),
    /// else `/dev/fuse`.
    #[default]
    Auto,
    /// Always: `serve` fails without it.
    On,
    /// Never.
    Off,
}

fn default_fuse_depth() -> Spanned<u32> {
    Spanned::new(0..0, 16)
}

fn yes() -> bool {
    true
}
fn default_threads() -> Spanned<u32> {
    Spanned::new(0..0, 4)
}

impl Default for Fuse {
    fn default() -> Self {
        Fuse { enabled: true, threads: default_threads(), io_uring: FuseUring::Auto, queue_depth: default_fuse_depth() }
    }
}

/// The NBD export.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Nbd {
    /// Serve `<run-dir>/nbd.sock`.
    #[serde(default = "yes")]
    pub enabled: bool,
    /// Also serve TCP at this address (`host:port`).
    #[serde(default)]
    pub tcp: Option<Spanned<String>>,
    /// Connections served at once.
    #[serde(default = "default_max_connections")]
    pub max_connections: Spanned<u32>,
    /// Threads of one connection: one leads (reads requests and keeps them in flight); the
    /// others take the lead while it serves a request too large to go in flight as one.
    #[serde(default = "default_nbd_workers")]
    pub workers: Spanned<u32>,
    /// Negotiation must finish within this, ms.
    #[serde(default = "default_handshake_ms")]
    pub handshake_timeout_ms: Spanned<u64>,
    /// A request that has started to arrive must arrive whole within this, ms.
    #[serde(default = "default_request_ms")]
    pub request_timeout_ms: Spanned<u64>,
    /// TLS (`NBD_OPT_STARTTLS`): off, offered, or required of TCP clients.
    #[serde(default = "default_nbd_tls")]
    pub tls: Spanned<NbdTls>,
    /// Directory of `server-cert.pem`, `server-key.pem` and (for `tls_verify_peer`) `ca-cert.pem`.
    #[serde(default)]
    pub tls_certificates: Option<Spanned<PathBuf>>,
    /// Clients must show a certificate that `ca-cert.pem` signed.
    #[serde(default)]
    pub tls_verify_peer: bool,
    /// Pre-shared keys instead of certificates: a file of `identity:hexkey` lines, as GnuTLS's
    /// `psktool` writes them and qemu, nbdkit and libnbd read them.
    #[serde(default)]
    pub tls_psk: Option<Spanned<PathBuf>>,
    /// A group (name or number) given the unix socket, mode `0660`, so that its members may
    /// connect; without it, `serve`'s umask decides.
    #[serde(default)]
    pub group: Option<Spanned<String>>,
}

/// When the NBD export uses TLS.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NbdTls {
    /// Never (the default).
    #[default]
    Off,
    /// Offered to clients that ask.
    On,
    /// Required of TCP clients before anything else.
    Require,
}

fn default_nbd_tls() -> Spanned<NbdTls> {
    Spanned::new(0..0, NbdTls::Off)
}

fn default_handshake_ms() -> Spanned<u64> {
    Spanned::new(0..0, 10_000)
}
fn default_request_ms() -> Spanned<u64> {
    Spanned::new(0..0, 30_000)
}

fn default_max_connections() -> Spanned<u32> {
    Spanned::new(0..0, 64)
}
fn default_nbd_workers() -> Spanned<u32> {
    Spanned::new(0..0, 4)
}

impl Default for Nbd {
    fn default() -> Self {
        Nbd {
            enabled: true,
            tcp: None,
            max_connections: default_max_connections(),
            workers: default_nbd_workers(),
            handshake_timeout_ms: default_handshake_ms(),
            request_timeout_ms: default_request_ms(),
            tls: default_nbd_tls(),
            tls_certificates: None,
            tls_verify_peer: false,
            tls_psk: None,
            group: None,
        }
    }
}

/// The vhost-user-blk export.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VhostUser {
    /// Serve `<run-dir>/vhost/<name>.sock` for virtual machines.
    #[serde(default)]
    pub enabled: bool,
    /// Only these devices and views (all of them when absent).
    #[serde(default)]
    pub devices: Option<Spanned<Vec<String>>>,
    /// A group (name or number) given each socket, mode `0660`, so that its members (a QEMU
    /// that libvirt runs as its own user) may connect; without it, `serve`'s umask decides.
    #[serde(default)]
    pub group: Option<Spanned<String>>,
}

/// The ublk export: devices and views as the kernel's own block devices, `/dev/ublkbN`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Ublk {
    /// Export them (the host needs ublk: Linux ≥ 6.5 with the `ublk_drv` module).
    #[serde(default)]
    pub enabled: bool,
    /// Only these devices and views (all of them when absent).
    #[serde(default)]
    pub devices: Option<Spanned<Vec<String>>>,
    /// Requests in flight per queue.
    #[serde(default = "default_ublk_depth")]
    pub depth: Spanned<u16>,
    /// Fixed numbers (`/dev/ublkb<number>`) by device or view; the others get one from the
    /// kernel the first time, kept in the run directory from then on.
    #[serde(default)]
    pub numbers: Option<Spanned<std::collections::BTreeMap<String, u32>>>,
}

impl Default for Ublk {
    fn default() -> Self {
        Ublk { enabled: false, devices: None, depth: default_ublk_depth(), numbers: None }
    }
}

fn default_ublk_depth() -> Spanned<u16> {
    Spanned::new(0..0, 128)
}

/// The largest number ublk gives a device (its minor numbers).
const UBLK_MAX_NUMBER: u32 = (1 << 20) - 1;

impl Ublk {
    /// Checks the depth and the numbers; `names` are the devices' and views' names.
    pub(crate) fn validate(&self, names: &std::collections::HashSet<String>, err: &At<'_>) -> Result<(), ConfigError> {
        let d = &self.depth;
        if !(1..=4096).contains(d.get_ref()) {
            return Err(err(d.span(), format!("key `ublk.depth`: {} is out of range 1..=4096", d.get_ref())));
        }
        if let Some(list) = &self.devices {
            if let Some(unknown) = list.get_ref().iter().find(|n| !names.contains(*n)) {
                return Err(err(list.span(), format!("key `ublk.devices`: no device or view is named `{unknown}`")));
            }
        }
        if let Some(numbers) = &self.numbers {
            let mut seen = std::collections::HashMap::new();
            for (name, &n) in numbers.get_ref() {
                if !names.contains(name) {
                    return Err(err(numbers.span(), format!("key `ublk.numbers`: no device or view is named `{name}`")));
                }
                if n > UBLK_MAX_NUMBER {
                    return Err(err(
                        numbers.span(),
                        format!("key `ublk.numbers`: `{name}` = {n} is out of range 0..={UBLK_MAX_NUMBER}"),
                    ));
                }
                if let Some(other) = seen.insert(n, name) {
                    return Err(err(numbers.span(), format!("key `ublk.numbers`: `{other}` and `{name}` both have number {n}")));
                }
            }
        }
        Ok(())
    }
}

/// The control socket (`<run-dir>/control.sock`).
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Control {
    /// A group whose members may use the socket too (name or number); without one, only the
    /// user `serve` runs as (and root) may.
    #[serde(default)]
    pub group: Option<Spanned<String>>,
}

/// What `serve` logs.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Log {
    /// The least severe events logged.
    #[serde(default)]
    pub level: LogLevel,
}

/// A log level.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LogLevel {
    /// Errors only.
    Error,
    /// Errors and warnings.
    Warn,
    /// And what happens: devices started, restarted, added, removed; clients connected.
    #[default]
    Info,
    /// And detail for debugging.
    Debug,
}

/// The Prometheus endpoint.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Metrics {
    /// Where to serve `GET /metrics`: `host:port`, or the path of a unix socket (starting
    /// with `/`). None: no endpoint.
    #[serde(default)]
    pub listen: Option<Spanned<String>>,
}

/// Where the metrics endpoint listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MetricsListen {
    /// A TCP address.
    Tcp(String),
    /// A unix socket.
    Unix(PathBuf),
}

impl Metrics {
    /// Where the endpoint listens, if it is on.
    pub fn listen(&self) -> Option<MetricsListen> {
        let l = self.listen.as_ref()?.get_ref();
        Some(if l.starts_with('/') { MetricsListen::Unix(PathBuf::from(l)) } else { MetricsListen::Tcp(l.clone()) })
    }
}

/// What keeps `serve`'s descriptors (FUSE session, listening sockets, `ram` memfds, its state)
/// across a crash or an upgrade of `serve` (ARCHITECTURE.md, "When `serve` itself dies").
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Keeper {
    /// Run a keeper: `bulkhead serve` becomes a small process that holds the descriptors and
    /// starts the real `serve` again when it dies or is upgraded. Under systemd with
    /// `FileDescriptorStoreMax=` set, systemd's store is the keeper and this is not needed.
    #[serde(default)]
    pub enabled: bool,
    /// How long, in milliseconds, a keeper waits for a `serve` that died to come back (say it
    /// is serving) before it gives up: it ends the FUSE connection, so applications get
    /// errors instead of waiting forever, and exits.
    #[serde(default = "default_give_up_ms")]
    pub give_up_ms: Spanned<u64>,
}

fn default_give_up_ms() -> Spanned<u64> {
    Spanned::new(0..0, 30_000)
}

impl Default for Keeper {
    fn default() -> Self {
        Keeper { enabled: false, give_up_ms: default_give_up_ms() }
    }
}

impl Fuse {
    pub(crate) fn validate(&self, err: &At<'_>) -> Result<(), ConfigError> {
        let t = &self.threads;
        if !(1..=64).contains(t.get_ref()) {
            return Err(err(t.span(), format!("key `fuse.threads`: {} is out of range 1..=64", t.get_ref())));
        }
        let q = &self.queue_depth;
        if !(1..=256).contains(q.get_ref()) {
            return Err(err(q.span(), format!("key `fuse.queue_depth`: {} is out of range 1..=256", q.get_ref())));
        }
        Ok(())
    }
}

impl Nbd {
    pub(crate) fn validate(&self, err: &At<'_>) -> Result<(), ConfigError> {
        let m = &self.max_connections;
        if !(1..=4096).contains(m.get_ref()) {
            return Err(err(m.span(), format!("key `nbd.max_connections`: {} is out of range 1..=4096", m.get_ref())));
        }
        let w = &self.workers;
        if !(1..=64).contains(w.get_ref()) {
            return Err(err(w.span(), format!("key `nbd.workers`: {} is out of range 1..=64", w.get_ref())));
        }
        for (key, v) in [("handshake_timeout_ms", &self.handshake_timeout_ms), ("request_timeout_ms", &self.request_timeout_ms)] {
            if !(100..=3_600_000).contains(v.get_ref()) {
                return Err(err(v.span(), format!("key `nbd.{key}`: {} is out of range 100..=3600000", v.get_ref())));
            }
        }
        if *self.tls.get_ref() != NbdTls::Off && self.tls_certificates.is_none() && self.tls_psk.is_none() {
            return Err(err(
                self.tls.span(),
                "key `nbd.tls`: TLS needs `nbd.tls_certificates`, the directory of server-cert.pem and server-key.pem, \
                 or `nbd.tls_psk`, a file of pre-shared keys"
                    .into(),
            ));
        }
        if let (Some(_), Some(psk)) = (&self.tls_certificates, &self.tls_psk) {
            return Err(err(
                psk.span(),
                "key `nbd.tls_psk`: choose certificates (`nbd.tls_certificates`) or pre-shared keys, not both".into(),
            ));
        }
        if let (true, Some(psk)) = (self.tls_verify_peer, &self.tls_psk) {
            return Err(err(
                psk.span(),
                "key `nbd.tls_psk`: `nbd.tls_verify_peer` asks clients for certificates; with pre-shared keys the key is the proof".into(),
            ));
        }
        if let Some(t) = &self.tcp {
            if t.get_ref().parse::<std::net::SocketAddr>().is_err() && !t.get_ref().contains(':') {
                return Err(err(t.span(), format!("key `nbd.tcp`: `{}` is not host:port", t.get_ref())));
            }
        }
        Ok(())
    }
}

/// The domains `serve` keeps ready ahead of need (ARCHITECTURE.md, "Spare domains").
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Domains {
    /// Spare domain processes kept waiting, already sandboxed, to take the place of one that
    /// dies or wedges: a restart then costs no process start. Each costs no CPU while it waits
    /// and a few MiB of memory. 0 starts every domain afresh.
    #[serde(default = "default_spares")]
    pub spares: Spanned<u32>,
    /// Standby domains kept at once: after its first restart a device keeps its next domain
    /// started, confined and waiting (an `interpose` device may keep one for each of its two),
    /// so that the next restart only lets it go. Each costs no CPU while it waits and a few MiB
    /// of memory. 0 keeps none.
    #[serde(default = "default_standbys")]
    pub standbys: Spanned<u32>,
}

fn default_spares() -> Spanned<u32> {
    Spanned::new(0..0, 2)
}

fn default_standbys() -> Spanned<u32> {
    Spanned::new(0..0, 4)
}

impl Default for Domains {
    fn default() -> Self {
        Domains { spares: default_spares(), standbys: default_standbys() }
    }
}

impl Domains {
    pub(crate) fn validate(&self, err: &At<'_>) -> Result<(), ConfigError> {
        for (key, n) in [("spares", &self.spares), ("standbys", &self.standbys)] {
            if *n.get_ref() > 64 {
                return Err(err(n.span(), format!("key `domains.{key}`: {} is outside 0..=64", n.get_ref())));
            }
        }
        Ok(())
    }
}

impl Keeper {
    pub(crate) fn validate(&self, err: &At<'_>) -> Result<(), ConfigError> {
        let g = &self.give_up_ms;
        if !(100..=86_400_000).contains(g.get_ref()) {
            return Err(err(g.span(), format!("key `keeper.give_up_ms`: {} is outside 100..=86400000", g.get_ref())));
        }
        Ok(())
    }
}

impl Metrics {
    pub(crate) fn validate(&self, err: &At<'_>) -> Result<(), ConfigError> {
        if let Some(l) = &self.listen {
            let v = l.get_ref();
            if !v.starts_with('/') && v.parse::<std::net::SocketAddr>().is_err() {
                return Err(err(
                    l.span(),
                    format!("key `metrics.listen`: `{v}` is neither host:port (an IP address and a port) nor a socket path starting with /"),
                ));
            }
        }
        Ok(())
    }
}
