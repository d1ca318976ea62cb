//! The configuration of `bulkhead serve`.
//!
//! ```toml
//! [fuse]
//! enabled = true          # export <run-dir>/fuse/<device>
//! threads = 4             # threads reading /dev/fuse
//! io_uring = "auto"       # FUSE over io_uring: auto | on | off (a ring per CPU)
//! queue_depth = 16        # requests each io_uring ring holds (1 MiB buffer each)
//!
//! [nbd]
//! enabled = true          # export every device on <run-dir>/nbd.sock (export name = device)
//! # tcp = "0.0.0.0:10809" # also on TCP
//! max_connections = 64    # more are closed at accept
//! workers = 4             # threads of one connection: one leads, the others take over while it serves a large request
//! handshake_timeout_ms = 10000 # negotiation must finish within this
//! request_timeout_ms = 30000   # a request, once started, must arrive within this
//! # tls = "require"       # off | on (offered) | require (TCP clients must start TLS)
//! # tls_certificates = "/etc/bulkhead/tls"  # server-cert.pem, server-key.pem[, ca-cert.pem]
//! # tls_verify_peer = false  # clients must show a certificate ca-cert.pem signed
//! # tls_psk = "/etc/bulkhead/keys.psk"  # or pre-shared keys instead: `identity:hexkey` lines (psktool)
//!
//! [[device]]
//! name = "disk0"
//! size = "1G"             # bytes, or with K/M/G/T suffix (powers of 1024)
//! queues = 4              # channel queues
//! queue_depth = 64        # slots per ring (power of two)
//! arena = "8M"            # bytes per grant arena (≥ the largest request, 4M at least)
//! notify = "adaptive"     # irq | poll | adaptive
//! spin_budget_us = "auto" # or a number of microseconds
//! watchdog_ms = 1000      # restart a domain that answers nothing for this long
//! restart_limit = 5       # restarts allowed within restart_window_ms, then `failed`
//! restart_window_ms = 60000
//! sandbox = "best_effort" # required | best_effort | off
//! tap = "passthrough"     # where filters run: passthrough | interpose
//! # nbd_allow = ["10.0.0.0/8", "::1"]  # TCP clients of its NBD export: only from these
//! # attach = 4            # queues applications may attach (bulkhead_client::attach); 0: none
//!
//! [device.backend]
//! type = "ram"            # ram | file | nbd | null | vdev
//! # path = "/var/lib/img" # file: a regular file or block device
//! # direct = false        # file: O_DIRECT
//! # engine = "auto"       # file: auto (sync in memory, else io_uring) | sync | io_uring
//! # read_only = false     # file
//! # format = "raw"        # file: raw | qcow2 (backing files as the image names them)
//! # uri = "nbd://host:10809/export"  # nbd: or nbd+unix:///export?socket=/path
//! # connect_timeout_ms = 5000        # nbd: one connection attempt
//! # reconnect_timeout_ms = 60000     # nbd: keep reconnecting this long, then `failed`
//! # card = "card7/card.json"         # vdev: a card spec (bulkhead vdev generate), or
//! # seed = 7                         # vdev: the card of this seed
//! # wait = "interrupt"               # vdev: interrupt | poll (the driver's wait for the card)
//!
//! [[device.filter]]       # zero or more, frontend side first (docs/filters/)
//! type = "trace"          # trace | stats | delay | error | throttle
//! path = "/var/log/disk0.blktrace"
//!
//! [[device.view]]         # zero or more: parts exported under names of their own (docs/sharing.md)
//! name = "vm1"            # FUSE file and NBD export name
//! offset = "0"            # where it starts in the device
//! size = "256M"           # default: the rest of the device
//! read_only = false
//! queues = 1              # channel queues of its own
//! # credit_bytes = "512K" # QoS: credits of this many bytes …
//! # credit_us = 10000     # … every this many µs
//! # burst_bytes = "2M"    # most credit saved up (default: one period's)
//! # iops = 5000           # requests per second
//! # burst_ios = 500       # (default: a tenth of a second's)
//! # weight = 1            # share among uncapped views (1..=1000)
//! # nbd_allow = ["192.0.2.7"]  # TCP clients of its NBD export: only from these
//! # attach = 4            # queues applications may attach to the view; 0: none
//! ```
//!
//! Unknown keys and bad values are errors naming the key and the line.
#![forbid(unsafe_code)]
#![deny(missing_docs)]

use std::path::{Path, PathBuf};

mod filter;
mod view;

pub use filter::{Filter, FilterKind, FilterTable};
pub use view::View;

use serde::de::{self, Deserializer};
use serde::Deserialize;
use toml::Spanned;

/// The embedded default: one 1 GiB `ram` device `disk0`, adaptive notification, FUSE export.
pub const DEFAULT_CONFIG: &str = r#"
[fuse]
enabled = true

[[device]]
name = "disk0"
size = "1G"
notify = "adaptive"

[device.backend]
type = "ram"
"#;

/// A configuration error, with the file and line when known.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read config {path}: {source}")]
    Read {
        /// The path.
        path: PathBuf,
        /// OS error.
        #[source]
        source: std::io::Error,
    },
    /// TOML syntax, unknown key or bad value (toml's message names key, line and column).
    #[error("{origin}: {message}")]
    Parse {
        /// File name or "embedded default".
        origin: String,
        /// The message.
        message: String,
    },
    /// A semantic error at a line.
    #[error("{origin}, line {line}: {message}")]
    Invalid {
        /// File name.
        origin: String,
        /// 1-based line.
        line: usize,
        /// What is wrong, naming the key.
        message: String,
    },
}

/// Byte size written as an integer or a string with a K/M/G/T suffix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Size(pub u64);

/// Parses "1G", "512M", "4096", "64k".
pub use bulkhead_qos::parse_size;

impl<'de> Deserialize<'de> for Size {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl de::Visitor<'_> for V {
            type Value = Size;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a size in bytes or a string such as \"1G\"")
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Size, E> {
                u64::try_from(v).map(Size).map_err(|_| E::custom("size must not be negative"))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Size, E> {
                Ok(Size(v))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Size, E> {
                parse_size(v).map(Size).map_err(E::custom)
            }
        }
        d.deserialize_any(V)
    }
}

/// Notification mode of a device's channel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Notify {
    /// Always sleep, always ring.
    Irq,
    /// Spin forever.
    Poll,
    /// Spin up to a budget, then sleep.
    Adaptive,
}

impl Notify {
    /// The configuration spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Notify::Irq => "irq",
            Notify::Poll => "poll",
            Notify::Adaptive => "adaptive",
        }
    }
}

/// Spin budget: "auto" or microseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpinBudget {
    /// Self-tuning.
    Auto,
    /// Fixed microseconds.
    Micros(u64),
}

impl<'de> Deserialize<'de> for SpinBudget {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl de::Visitor<'_> for V {
            type Value = SpinBudget;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("\"auto\" or a number of microseconds")
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<SpinBudget, E> {
                u64::try_from(v).map(SpinBudget::Micros).map_err(|_| E::custom("spin budget must not be negative"))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<SpinBudget, E> {
                Ok(SpinBudget::Micros(v))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<SpinBudget, E> {
                if v == "auto" {
                    Ok(SpinBudget::Auto)
                } else {
                    Err(E::custom(format!("invalid spin budget `{v}` (expected \"auto\" or microseconds)")))
                }
            }
        }
        d.deserialize_any(V)
    }
}

/// File backend engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Engine {
    /// The default: sync for a regular file on a file system in memory (tmpfs, ramfs), where
    /// a ring only adds a worker thread's hop; elsewhere io_uring where the kernel allows it
    /// (the supervisor can make a ring), else sync.
    Auto,
    /// Synchronous system calls.
    Sync,
    /// io_uring.
    IoUring,
}

impl Engine {
    /// The configuration spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Engine::Auto => "auto",
            Engine::Sync => "sync",
            Engine::IoUring => "io_uring",
        }
    }
}

/// What a file backend's file holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ImageFormat {
    /// The device's bytes, as they are.
    Raw,
    /// A qcow2 (v2 or v3) image, possibly over a chain of backing files.
    Qcow2,
}

impl ImageFormat {
    /// The configuration spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            ImageFormat::Raw => "raw",
            ImageFormat::Qcow2 => "qcow2",
        }
    }
}

/// Kind of backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BackendKind {
    /// A ramdisk (sparse memfd).
    Ram,
    /// A regular file or block device.
    File,
    /// Reads zeroes, drops writes.
    Null,
    /// A remote NBD server.
    Nbd,
    /// A Ceph RBD image.
    Rbd,
    /// A virtual device: a generated card's model in a device-model domain, its reference
    /// driver in the driver domain.
    Vdev,
}

/// How a `vdev` driver learns the card has completed its commands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum VdevWait {
    /// The card's interrupt.
    Interrupt,
    /// Polling its completion counter (interrupts off).
    Poll,
}

impl VdevWait {
    /// The configuration spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            VdevWait::Interrupt => "interrupt",
            VdevWait::Poll => "poll",
        }
    }
}

/// Which card a `vdev` backend models.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VdevCard {
    /// A card spec written by `bulkhead vdev generate` (or by hand).
    File(PathBuf),
    /// The card of this seed.
    Seed(u64),
}

/// The `[device.backend]` table as written.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BackendTable {
    /// `type`.
    #[serde(rename = "type")]
    pub kind: BackendKind,
    /// `path` (file).
    pub path: Option<Spanned<PathBuf>>,
    /// `direct` (file).
    pub direct: Option<Spanned<bool>>,
    /// `engine` (file).
    pub engine: Option<Spanned<Engine>>,
    /// `read_only` (file).
    pub read_only: Option<Spanned<bool>>,
    /// `format` (file).
    pub format: Option<Spanned<ImageFormat>>,
    /// `uri` (nbd).
    pub uri: Option<Spanned<String>>,
    /// `connect_timeout_ms` (nbd).
    pub connect_timeout_ms: Option<Spanned<u64>>,
    /// `reconnect_timeout_ms` (nbd).
    pub reconnect_timeout_ms: Option<Spanned<u64>>,
    /// `card` (vdev).
    pub card: Option<Spanned<PathBuf>>,
    /// `seed` (vdev).
    pub seed: Option<Spanned<u64>>,
    /// `wait` (vdev).
    pub wait: Option<Spanned<VdevWait>>,
    /// `pool` (rbd).
    pub pool: Option<Spanned<String>>,
    /// `image` (rbd).
    pub image: Option<Spanned<String>>,
    /// `namespace` (rbd).
    pub namespace: Option<Spanned<String>>,
    /// `mon_host` (rbd).
    pub mon_host: Option<Spanned<String>>,
    /// `user` (rbd).
    pub user: Option<Spanned<String>>,
    /// `key_file` (rbd).
    pub key_file: Option<Spanned<PathBuf>>,
    /// `cache` (rbd).
    pub cache: Option<Spanned<bool>>,
    /// `op_timeout_ms` (rbd).
    pub op_timeout_ms: Option<Spanned<u64>>,
    /// `networks` (rbd).
    pub networks: Option<Spanned<Vec<String>>>,
    /// `lock_break` (rbd).
    pub lock_break: Option<Spanned<bool>>,
}

/// The monitors of a `mon_host` value: `host[:port]` entries separated by commas or spaces,
/// each optionally written as `v2:host:port` or in brackets as Ceph prints them. A monitor
/// without a port listens on 3300 (msgr2) and 6789.
pub fn parse_mon_host(s: &str) -> Result<Vec<(String, Option<u16>)>, String> {
    let mut out = Vec::new();
    for part in s.split([',', ' ', ';']).map(str::trim).filter(|p| !p.is_empty()) {
        let part = part.trim_start_matches('[').trim_end_matches(']');
        let part = part.strip_prefix("v2:").or_else(|| part.strip_prefix("v1:")).unwrap_or(part);
        let part = part.split('/').next().unwrap_or(part);
        let (host, port) = if let Some(rest) = part.strip_prefix('[') {
            // [ipv6]:port
            let (h, p) = rest.split_once(']').ok_or_else(|| format!("`{part}`: unclosed `[`"))?;
            (h.to_string(), p.strip_prefix(':'))
        } else if part.matches(':').count() > 1 {
            (part.to_string(), None)
        } else {
            match part.split_once(':') {
                Some((h, p)) => (h.to_string(), Some(p)),
                None => (part.to_string(), None),
            }
        };
        let port = match port {
            Some(p) => Some(p.parse::<u16>().map_err(|_| format!("`{part}`: bad port `{p}`"))?),
            None => None,
        };
        if host.is_empty() {
            return Err(format!("`{part}` names no host"));
        }
        out.push((host, port));
    }
    if out.is_empty() {
        return Err("names no monitor".into());
    }
    Ok(out)
}

/// An address range `ip/bits` (or one address).
pub fn parse_cidr(s: &str) -> Result<(std::net::IpAddr, u8), String> {
    let (ip, bits) = match s.split_once('/') {
        Some((ip, b)) => (ip, Some(b)),
        None => (s, None),
    };
    let ip: std::net::IpAddr = ip.trim().parse().map_err(|_| format!("`{ip}` is not an IP address"))?;
    let max = if ip.is_ipv4() { 32 } else { 128 };
    let bits = match bits {
        Some(b) => b.trim().parse::<u8>().ok().filter(|b| *b <= max).ok_or_else(|| format!("`/{b}` is not a prefix length"))?,
        None => max,
    };
    Ok((ip, bits))
}

/// Where a remote NBD server listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NbdTarget {
    /// A unix socket.
    Unix(PathBuf),
    /// TCP.
    Tcp {
        /// Host name or address.
        host: String,
        /// Port.
        port: u16,
    },
}

/// The NBD port assigned by IANA.
pub const NBD_DEFAULT_PORT: u16 = 10809;

/// Parses an NBD URI (`nbd://host[:port]/export` or `nbd+unix:///export?socket=PATH`) into
/// its target and export name.
pub fn parse_nbd_uri(uri: &str) -> Result<(NbdTarget, String), String> {
    let decode = |s: &str| -> Result<String, String> {
        let b = s.as_bytes();
        let mut out = Vec::with_capacity(b.len());
        let mut i = 0;
        while i < b.len() {
            if b[i] == b'%' {
                let hex = s.get(i + 1..i + 3).ok_or_else(|| format!("bad percent escape in `{s}`"))?;
                out.push(u8::from_str_radix(hex, 16).map_err(|_| format!("bad percent escape in `{s}`"))?);
                i += 3;
            } else {
                out.push(b[i]);
                i += 1;
            }
        }
        String::from_utf8(out).map_err(|_| format!("`{s}` is not UTF-8 once decoded"))
    };
    let (scheme, rest) = uri.split_once("://").ok_or("expected nbd://host[:port]/export or nbd+unix:///export?socket=PATH")?;
    let (authority, path_query) = rest.split_once('/').unwrap_or((rest, ""));
    let (path, query) = path_query.split_once('?').unwrap_or((path_query, ""));
    let export = decode(path)?;
    if export.len() > 4096 {
        return Err("export name longer than 4096 bytes".into());
    }
    match scheme {
        "nbd" => {
            if !query.is_empty() {
                return Err(format!("unexpected query `?{query}` for nbd://"));
            }
            let (host, port) = if let Some(h) = authority.strip_prefix('[') {
                let (h, after) = h.split_once(']').ok_or("unclosed [ in host")?;
                (h.to_string(), after.strip_prefix(':'))
            } else {
                match authority.rsplit_once(':') {
                    Some((h, p)) => (h.to_string(), Some(p)),
                    None => (authority.to_string(), None),
                }
            };
            if host.is_empty() {
                return Err("no host in nbd:// URI".into());
            }
            let port = match port {
                None => NBD_DEFAULT_PORT,
                Some(p) => p.parse::<u16>().ok().filter(|p| *p != 0).ok_or_else(|| format!("bad port `{p}`"))?,
            };
            Ok((NbdTarget::Tcp { host, port }, export))
        }
        "nbd+unix" => {
            if !authority.is_empty() {
                return Err(format!("nbd+unix:// takes no host (found `{authority}`)"));
            }
            let socket = query.split('&').find_map(|kv| kv.strip_prefix("socket=")).ok_or("nbd+unix:// needs ?socket=PATH")?;
            let socket = decode(socket)?;
            if !socket.starts_with('/') {
                return Err(format!("socket path `{socket}` is not absolute"));
            }
            Ok((NbdTarget::Unix(PathBuf::from(socket)), export))
        }
        other => Err(format!("unsupported scheme `{other}` (nbd or nbd+unix; TLS is not supported)")),
    }
}

/// A device's backend, resolved.
#[derive(Debug, Clone, PartialEq)]
pub enum BackendConfig {
    /// A ramdisk.
    Ram,
    /// A file or block device.
    File {
        /// Path of the file or device.
        path: PathBuf,
        /// Open with O_DIRECT.
        direct: bool,
        /// I/O engine.
        engine: Engine,
        /// Refuse writes.
        read_only: bool,
        /// What the file holds.
        format: ImageFormat,
    },
    /// Reads zeroes, drops writes.
    Null,
    /// A remote NBD server.
    Nbd {
        /// The URI as written.
        uri: String,
        /// Where the server listens.
        target: NbdTarget,
        /// Export name.
        export: String,
        /// One connection attempt may take this long, ms.
        connect_timeout_ms: u64,
        /// After losing the server, keep reconnecting this long before the device fails, ms.
        reconnect_timeout_ms: u64,
    },
    /// A Ceph RBD image.
    Rbd {
        /// Monitor addresses as written (`host[:port]`, comma-separated).
        mon_host: String,
        /// Client name, without `client.`.
        user: String,
        /// The file holding the client's secret key.
        key_file: PathBuf,
        /// Pool.
        pool: String,
        /// Namespace ("" for none).
        namespace: String,
        /// Image.
        image: String,
        /// librbd's client cache.
        cache: bool,
        /// Refuse writes.
        read_only: bool,
        /// A request the cluster does not answer for this long fails, ms.
        op_timeout_ms: u64,
        /// Reaching the cluster may take this long, ms.
        connect_timeout_ms: u64,
        /// After losing the cluster, keep trying this long before the device fails, ms.
        reconnect_timeout_ms: u64,
        /// Address ranges (CIDR) the domain may connect to besides the monitors: where the
        /// OSDs are. Empty: the monitors' hosts.
        networks: Vec<String>,
        /// A new domain breaks the exclusive lock of the device's earlier domains (else it
        /// waits for the lock to expire, as any librbd client).
        lock_break: bool,
    },
    /// A virtual device.
    Vdev {
        /// The card.
        card: VdevCard,
        /// How the driver waits for the card.
        wait: VdevWait,
    },
}

impl BackendTable {
    /// The resolved backend (after validation).
    pub fn resolve(&self) -> BackendConfig {
        match self.kind {
            BackendKind::Ram => BackendConfig::Ram,
            BackendKind::Null => BackendConfig::Null,
            BackendKind::File => BackendConfig::File {
                path: self.path.as_ref().map(|p| p.get_ref().clone()).unwrap_or_default(),
                direct: self.direct.as_ref().map(|d| *d.get_ref()).unwrap_or(false),
                engine: self.engine.as_ref().map(|e| *e.get_ref()).unwrap_or(Engine::Auto),
                read_only: self.read_only.as_ref().map(|r| *r.get_ref()).unwrap_or(false),
                format: self.format.as_ref().map(|f| *f.get_ref()).unwrap_or(ImageFormat::Raw),
            },
            BackendKind::Nbd => {
                let uri = self.uri.as_ref().map(|u| u.get_ref().clone()).unwrap_or_default();
                let (target, export) = parse_nbd_uri(&uri).unwrap_or((NbdTarget::Unix(PathBuf::new()), String::new()));
                BackendConfig::Nbd {
                    uri,
                    target,
                    export,
                    connect_timeout_ms: self.connect_timeout_ms.as_ref().map(|t| *t.get_ref()).unwrap_or(5000),
                    reconnect_timeout_ms: self.reconnect_timeout_ms.as_ref().map(|t| *t.get_ref()).unwrap_or(60_000),
                }
            }
            BackendKind::Rbd => {
                let s = |v: &Option<Spanned<String>>| v.as_ref().map(|x| x.get_ref().clone()).unwrap_or_default();
                BackendConfig::Rbd {
                    mon_host: s(&self.mon_host),
                    user: self.user.as_ref().map_or_else(|| "admin".to_string(), |u| u.get_ref().clone()),
                    key_file: self.key_file.as_ref().map(|k| k.get_ref().clone()).unwrap_or_default(),
                    pool: s(&self.pool),
                    namespace: s(&self.namespace),
                    image: s(&self.image),
                    cache: self.cache.as_ref().is_some_and(|c| *c.get_ref()),
                    read_only: self.read_only.as_ref().is_some_and(|r| *r.get_ref()),
                    op_timeout_ms: self.op_timeout_ms.as_ref().map_or(RBD_OP_TIMEOUT_MS, |t| *t.get_ref()),
                    connect_timeout_ms: self.connect_timeout_ms.as_ref().map_or(5000, |t| *t.get_ref()),
                    reconnect_timeout_ms: self.reconnect_timeout_ms.as_ref().map_or(60_000, |t| *t.get_ref()),
                    networks: self.networks.as_ref().map(|n| n.get_ref().clone()).unwrap_or_default(),
                    lock_break: self.lock_break.as_ref().is_none_or(|b| *b.get_ref()),
                }
            }
            BackendKind::Vdev => BackendConfig::Vdev {
                card: match (&self.card, &self.seed) {
                    (Some(p), _) => VdevCard::File(p.get_ref().clone()),
                    (None, s) => VdevCard::Seed(s.as_ref().map_or(0, |s| *s.get_ref())),
                },
                wait: self.wait.as_ref().map_or(VdevWait::Interrupt, |w| *w.get_ref()),
            },
        }
    }
}

/// An `rbd` request the cluster does not answer is failed after this long unless
/// `op_timeout_ms` says otherwise (below the device's default watchdog, so a stopped OSD gives
/// errors rather than a restart).
pub const RBD_OP_TIMEOUT_MS: u64 = 8_000;

/// One device.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeviceConfig {
    /// Name: the FUSE file and NBD export name.
    pub name: Spanned<String>,
    /// Size in bytes (defaults to the file size for `file`; required otherwise).
    pub size: Option<Spanned<Size>>,
    /// Number of queues.
    #[serde(default = "default_queues")]
    pub queues: Spanned<u32>,
    /// Slots per ring.
    #[serde(default = "default_depth")]
    pub queue_depth: Spanned<u32>,
    /// Bytes per grant arena.
    #[serde(default = "default_arena")]
    pub arena: Spanned<Size>,
    /// Notification mode.
    #[serde(default = "default_notify")]
    pub notify: Notify,
    /// Spin budget.
    #[serde(default = "default_budget")]
    pub spin_budget_us: SpinBudget,
    /// A domain with requests pending and no answer for this long is restarted (default 1000
    /// ms; 10000 for `nbd`, whose requests cross a network). See [`DeviceConfig::watchdog_ms`].
    pub watchdog_ms: Option<Spanned<u64>>,
    /// Restarts allowed within `restart_window_ms` before the device turns failed.
    #[serde(default = "default_restart_limit")]
    pub restart_limit: Spanned<u32>,
    /// The window of `restart_limit`.
    #[serde(default = "default_restart_window")]
    pub restart_window_ms: Spanned<u64>,
    /// Sandbox policy: `required` refuses to start a domain a layer of which is unavailable;
    /// `best_effort` starts it with a warning; `off` applies none (debugging only).
    #[serde(default = "default_sandbox")]
    pub sandbox: Sandbox,
    /// Where the filters run.
    #[serde(default)]
    pub tap: Tap,
    /// The `[device.backend]` table..
    pub backend: BackendTable,
    /// `[[device.filter]]` tables, frontend side first.
    #[serde(default, rename = "filter")]
    pub filters: Vec<FilterTable>,
    /// `[[device.view]]` tables: parts of the device exported under names of their own.
    #[serde(default, rename = "view")]
    pub views: Vec<View>,
    /// Address ranges TCP clients of its NBD export may come from (default: any).
    pub nbd_allow: Option<Spanned<Vec<String>>>,
    /// Queues applications may attach to the device ([`DEFAULT_ATTACH`] unless given; 0: none).
    pub attach: Option<Spanned<u32>>,
}

/// Queues applications may attach to a device or a view unless its `attach` says otherwise.
pub const DEFAULT_ATTACH: u32 = 4;

/// Most queues `attach` may give a device or a view.
pub const MAX_ATTACH: u32 = 64;

/// Checks an `attach` key; errors name `what`, the key and (through `err`) the line.
pub(crate) fn check_attach(
    attach: &Option<Spanned<u32>>,
    what: &str,
    err: &impl Fn(std::ops::Range<usize>, String) -> ConfigError,
) -> Result<(), ConfigError> {
    match attach {
        Some(a) if *a.get_ref() > MAX_ATTACH => {
            Err(err(a.span(), format!("{what}: key `attach`: {} is more than {MAX_ATTACH}", a.get_ref())))
        }
        _ => Ok(()),
    }
}

/// Where a device's filters run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Tap {
    /// In the backend's own driver domain.
    #[default]
    Passthrough,
    /// In a tap domain of their own between the frontend and the backend domain.
    Interpose,
    /// In a tap domain that ends the chain itself, with no backend domain.
    Intercept,
}

impl Tap {
    /// The configuration spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Tap::Passthrough => "passthrough",
            Tap::Interpose => "interpose",
            Tap::Intercept => "intercept",
        }
    }
}

fn default_queues() -> Spanned<u32> {
    Spanned::new(0..0, 4)
}
fn default_depth() -> Spanned<u32> {
    Spanned::new(0..0, 64)
}
fn default_arena() -> Spanned<Size> {
    Spanned::new(0..0, Size(8 << 20))
}
impl DeviceConfig {
    /// The filters, resolved (validated with the rest of the configuration).
    pub fn filters(&self) -> Vec<Filter> {
        let watchdog = self.watchdog_ms();
        let name = self.name.get_ref();
        let err = |_: std::ops::Range<usize>, m: String| ConfigError::Parse { origin: String::new(), message: m };
        self.filters.iter().enumerate().filter_map(|(i, f)| f.resolve(name, i, watchdog, &err).ok()).collect()
    }

    /// Queues applications may attach to the device itself.
    pub fn attach_slots(&self) -> u32 {
        self.attach.as_ref().map_or(DEFAULT_ATTACH, |a| *a.get_ref())
    }

    /// The watchdog in ms: as configured, else 1000 (10000 for an `nbd` backend).
    pub fn watchdog_ms(&self) -> u64 {
        match &self.watchdog_ms {
            Some(w) => *w.get_ref(),
            None if matches!(self.backend.kind, BackendKind::Nbd | BackendKind::Rbd) => 10_000,
            None => 1000,
        }
    }
}

/// Sandbox policy of a device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Sandbox {
    /// Refuse to start without every layer.
    Required,
    /// Warn and go on without an unavailable layer.
    BestEffort,
    /// No sandbox.
    Off,
}

fn default_sandbox() -> Sandbox {
    Sandbox::BestEffort
}

fn default_restart_limit() -> Spanned<u32> {
    Spanned::new(0..0, 5)
}
fn default_restart_window() -> Spanned<u64> {
    Spanned::new(0..0, 60_000)
}
fn default_notify() -> Notify {
    Notify::Adaptive
}
fn default_budget() -> SpinBudget {
    SpinBudget::Auto
}

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
/// across a crash or an upgrade of `serve` (docs/ARCHITECTURE.md, "When `serve` itself dies").
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

/// The whole configuration.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// The control socket.
    #[serde(default)]
    pub control: Control,
    /// The Prometheus endpoint.
    #[serde(default)]
    pub metrics: Metrics,
    /// What is logged.
    #[serde(default)]
    pub log: Log,
    /// FUSE export settings.
    #[serde(default)]
    pub fuse: Fuse,
    /// NBD export settings.
    #[serde(default)]
    pub nbd: Nbd,
    /// vhost-user-blk export settings.
    #[serde(default)]
    pub vhost_user: VhostUser,
    /// The keeper of `serve`'s descriptors.
    #[serde(default)]
    pub keeper: Keeper,
    /// Devices.
    #[serde(default, rename = "device")]
    pub devices: Vec<DeviceConfig>,
    /// The configuration as written, table by table: what `bulkhead config dump` prints and
    /// what live changes edit (see [`Config::from_table`]).
    #[serde(skip)]
    pub raw: toml::Table,
}

/// Parses and validates one filter given as the body of a `[[device.filter]]` table (`type =
/// "delay"` and its keys, one per line), for device `device` with watchdog `watchdog_ms`, to
/// stand at position `index`: what `bulkhead filter DEVICE add` sends. Errors name the key and
/// the line of `text`.
pub fn parse_filter(text: &str, device: &str, index: usize, watchdog_ms: u64) -> Result<Filter, ConfigError> {
    let origin = "filter";
    let table: FilterTable =
        toml::from_str(text).map_err(|e| ConfigError::Parse { origin: origin.to_string(), message: e.to_string() })?;
    let err = |span: std::ops::Range<usize>, message: String| ConfigError::Invalid {
        origin: origin.to_string(),
        line: line_of(text, span.start),
        message,
    };
    table.resolve(device, index, watchdog_ms, &err)
}

/// Parses a `[[device.view]]` table given as its keys (`name = "tenant1"`, `size = "1G"`,
/// ..., one per line) for the running device `device`: what `bulkhead view DEVICE add` sends.
/// Checked as the configuration checks a view; errors name the key and the line of `text`.
/// Returns the view and its table as written.
pub fn parse_view(text: &str, device: &DeviceConfig) -> Result<(View, toml::Table), ConfigError> {
    let origin = "view table";
    let parse_error = |e: toml::de::Error| ConfigError::Parse { origin: origin.to_string(), message: e.to_string() };
    let view: View = toml::from_str(text).map_err(parse_error)?;
    let table: toml::Table = toml::from_str(text).map_err(parse_error)?;
    let err = |span: std::ops::Range<usize>, message: String| ConfigError::Invalid {
        origin: origin.to_string(),
        line: line_of(text, span.start),
        message,
    };
    let name = view.name.get_ref();
    if !valid_name(name) {
        return Err(err(
            view.name.span(),
            format!("key `name`: `{name}` is not a valid view name (1-64 of A-Z a-z 0-9 - _ ., not starting with .)"),
        ));
    }
    view.check(device.name.get_ref(), device.size.as_ref().map(|s| s.get_ref().0), &err)?;
    Ok((view, table))
}

fn line_of(src: &str, offset: usize) -> usize {
    src[..offset.min(src.len())].bytes().filter(|&b| b == b'\n').count() + 1
}

impl Config {
    /// Parses and validates `src`; `origin` names it in errors.
    pub fn parse(src: &str, origin: &str) -> Result<Config, ConfigError> {
        let parse_error = |e: toml::de::Error| ConfigError::Parse { origin: origin.to_string(), message: e.to_string() };
        let mut cfg: Config = toml::from_str(src).map_err(parse_error)?;
        cfg.validate(src, origin)?;
        cfg.raw = toml::from_str(src).map_err(parse_error)?;
        Ok(cfg)
    }

    /// Parses and validates a configuration given as tables (as [`Config::raw`] holds them);
    /// errors name lines of its [`Config::dump`].
    pub fn from_table(raw: &toml::Table, origin: &str) -> Result<Config, ConfigError> {
        let src = toml::to_string(raw).map_err(|e| ConfigError::Parse { origin: origin.to_string(), message: e.to_string() })?;
        Config::parse(&src, origin)
    }

    /// The configuration as TOML that `serve --config` accepts.
    pub fn dump(&self) -> String {
        toml::to_string(&self.raw).unwrap_or_else(|e| format!("# cannot be written as TOML: {e}\n"))
    }

    /// Parses `[[device]]` tables given on their own (`bulkhead device add`), checked as the
    /// configuration checks them, each with its table as written. Anything but `[[device]]`
    /// tables is refused, naming the key.
    pub fn parse_devices(src: &str, origin: &str) -> Result<Vec<(DeviceConfig, toml::Table)>, ConfigError> {
        let cfg = Config::parse(src, origin)?;
        if let Some(key) = cfg.raw.keys().find(|k| *k != "device") {
            let line =
                src.lines().position(|l| l.trim_start().trim_start_matches('[').starts_with(key.as_str())).map_or(1, |i| i + 1);
            return Err(ConfigError::Invalid {
                origin: origin.into(),
                line,
                message: format!("key `{key}`: only [[device]] tables can be added to a running serve"),
            });
        }
        if cfg.devices.is_empty() {
            return Err(ConfigError::Invalid { origin: origin.into(), line: 1, message: "no [[device]] table".into() });
        }
        let raws = match cfg.raw.get("device") {
            Some(toml::Value::Array(a)) => a.iter().filter_map(|v| v.as_table().cloned()).collect::<Vec<_>>(),
            _ => Vec::new(),
        };
        Ok(cfg.devices.into_iter().zip(raws).collect())
    }

    /// Reads, parses and validates a file.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let src = std::fs::read_to_string(path).map_err(|source| ConfigError::Read { path: path.to_path_buf(), source })?;
        Config::parse(&src, &path.display().to_string())
    }

    /// The embedded default.
    pub fn embedded_default() -> Config {
        Config::parse(DEFAULT_CONFIG, "embedded default").expect("embedded default is valid")
    }

    fn validate(&self, src: &str, origin: &str) -> Result<(), ConfigError> {
        let err = |span: std::ops::Range<usize>, message: String| ConfigError::Invalid {
            origin: origin.to_string(),
            line: line_of(src, span.start),
            message,
        };
        let t = &self.fuse.threads;
        if !(1..=64).contains(t.get_ref()) {
            return Err(err(t.span(), format!("key `fuse.threads`: {} is out of range 1..=64", t.get_ref())));
        }
        let q = &self.fuse.queue_depth;
        if !(1..=256).contains(q.get_ref()) {
            return Err(err(q.span(), format!("key `fuse.queue_depth`: {} is out of range 1..=256", q.get_ref())));
        }
        let m = &self.nbd.max_connections;
        if !(1..=4096).contains(m.get_ref()) {
            return Err(err(m.span(), format!("key `nbd.max_connections`: {} is out of range 1..=4096", m.get_ref())));
        }
        let w = &self.nbd.workers;
        if !(1..=64).contains(w.get_ref()) {
            return Err(err(w.span(), format!("key `nbd.workers`: {} is out of range 1..=64", w.get_ref())));
        }
        for (key, v) in
            [("handshake_timeout_ms", &self.nbd.handshake_timeout_ms), ("request_timeout_ms", &self.nbd.request_timeout_ms)]
        {
            if !(100..=3_600_000).contains(v.get_ref()) {
                return Err(err(v.span(), format!("key `nbd.{key}`: {} is out of range 100..=3600000", v.get_ref())));
            }
        }
        if *self.nbd.tls.get_ref() != NbdTls::Off && self.nbd.tls_certificates.is_none() && self.nbd.tls_psk.is_none() {
            return Err(err(
                self.nbd.tls.span(),
                "key `nbd.tls`: TLS needs `nbd.tls_certificates`, the directory of server-cert.pem and server-key.pem, \
                 or `nbd.tls_psk`, a file of pre-shared keys"
                    .into(),
            ));
        }
        if let (Some(_), Some(psk)) = (&self.nbd.tls_certificates, &self.nbd.tls_psk) {
            return Err(err(
                psk.span(),
                "key `nbd.tls_psk`: choose certificates (`nbd.tls_certificates`) or pre-shared keys, not both".into(),
            ));
        }
        if let (true, Some(psk)) = (self.nbd.tls_verify_peer, &self.nbd.tls_psk) {
            return Err(err(
                psk.span(),
                "key `nbd.tls_psk`: `nbd.tls_verify_peer` asks clients for certificates; with pre-shared keys the key is the proof".into(),
            ));
        }
        let g = &self.keeper.give_up_ms;
        if !(100..=86_400_000).contains(g.get_ref()) {
            return Err(err(g.span(), format!("key `keeper.give_up_ms`: {} is outside 100..=86400000", g.get_ref())));
        }
        if self.keeper.enabled && self.fuse.io_uring == FuseUring::On {
            let line = src.lines().position(|l| l.trim_start().starts_with("io_uring")).map_or(1, |i| i + 1);
            return Err(ConfigError::Invalid {
                origin: origin.to_string(),
                line,
                message: "key `fuse.io_uring`: \"on\" cannot be kept across a crash of serve (the kernel does not send a dead ring's requests again); with `keeper.enabled` use \"auto\" or \"off\"".into(),
            });
        }
        if let Some(l) = &self.metrics.listen {
            let v = l.get_ref();
            if !v.starts_with('/') && v.parse::<std::net::SocketAddr>().is_err() {
                return Err(err(
                    l.span(),
                    format!("key `metrics.listen`: `{v}` is neither host:port (an IP address and a port) nor a socket path starting with /"),
                ));
            }
        }
        if let Some(t) = &self.nbd.tcp {
            if t.get_ref().parse::<std::net::SocketAddr>().is_err() && !t.get_ref().contains(':') {
                return Err(err(t.span(), format!("key `nbd.tcp`: `{}` is not host:port", t.get_ref())));
            }
        }
        let mut names = std::collections::HashSet::new();
        for d in &self.devices {
            let name = d.name.get_ref();
            if !valid_name(name) {
                return Err(err(
                    d.name.span(),
                    format!("key `name`: `{name}` is not a valid device name (1-64 of A-Z a-z 0-9 - _ ., not starting with .)"),
                ));
            }
            if !names.insert(name.clone()) {
                return Err(err(d.name.span(), format!("key `name`: device `{name}` is defined twice")));
            }
            let q = &d.queues;
            if !(1..=64).contains(q.get_ref()) {
                return Err(err(q.span(), format!("device `{name}`: key `queues`: {} is out of range 1..=64", q.get_ref())));
            }
            let depth = &d.queue_depth;
            if !depth.get_ref().is_power_of_two() || !(2..=4096).contains(depth.get_ref()) {
                return Err(err(
                    depth.span(),
                    format!("device `{name}`: key `queue_depth`: {} must be a power of two in 2..=4096", depth.get_ref()),
                ));
            }
            let arena = &d.arena;
            if arena.get_ref().0 < 4 << 20 || arena.get_ref().0 > 1 << 30 {
                return Err(err(
                    arena.span(),
                    format!("device `{name}`: key `arena`: {} bytes is out of range 4M..=1G", arena.get_ref().0),
                ));
            }
            if let Some(w) = &d.watchdog_ms {
                if !(10..=3_600_000).contains(w.get_ref()) {
                    return Err(err(
                        w.span(),
                        format!("device `{name}`: key `watchdog_ms`: {} is out of range 10..=3600000", w.get_ref()),
                    ));
                }
            }
            let l = &d.restart_limit;
            if !(1..=1_000_000).contains(l.get_ref()) {
                return Err(err(
                    l.span(),
                    format!("device `{name}`: key `restart_limit`: {} is out of range 1..=1000000", l.get_ref()),
                ));
            }
            let rw = &d.restart_window_ms;
            if !(1..=86_400_000).contains(rw.get_ref()) {
                return Err(err(
                    rw.span(),
                    format!("device `{name}`: key `restart_window_ms`: {} is out of range 1..=86400000", rw.get_ref()),
                ));
            }
            if let SpinBudget::Micros(us) = d.spin_budget_us {
                if us > 1_000_000 {
                    return Err(err(d.name.span(), format!("device `{name}`: key `spin_budget_us`: {us} exceeds one second")));
                }
            }
            let b = &d.backend;
            let file_keys = [
                ("path", b.path.as_ref().map(|x| x.span())),
                ("direct", b.direct.as_ref().map(|x| x.span())),
                ("engine", b.engine.as_ref().map(|x| x.span())),
                ("format", b.format.as_ref().map(|x| x.span())),
            ];
            let nbd_keys = [("uri", b.uri.as_ref().map(|x| x.span()))];
            let remote_keys = [
                ("connect_timeout_ms", b.connect_timeout_ms.as_ref().map(|x| x.span())),
                ("reconnect_timeout_ms", b.reconnect_timeout_ms.as_ref().map(|x| x.span())),
            ];
            let rbd_keys = [
                ("pool", b.pool.as_ref().map(|x| x.span())),
                ("image", b.image.as_ref().map(|x| x.span())),
                ("namespace", b.namespace.as_ref().map(|x| x.span())),
                ("mon_host", b.mon_host.as_ref().map(|x| x.span())),
                ("user", b.user.as_ref().map(|x| x.span())),
                ("key_file", b.key_file.as_ref().map(|x| x.span())),
                ("cache", b.cache.as_ref().map(|x| x.span())),
                ("op_timeout_ms", b.op_timeout_ms.as_ref().map(|x| x.span())),
                ("networks", b.networks.as_ref().map(|x| x.span())),
                ("lock_break", b.lock_break.as_ref().map(|x| x.span())),
            ];
            let foreign = |keys: &[(&'static str, Option<std::ops::Range<usize>>)], owner: &str| match keys
                .iter()
                .find(|(_, s)| s.is_some())
            {
                Some((key, Some(span))) => {
                    Err(err(span.clone(), format!("device `{name}`: key `backend.{key}` only applies to type = \"{owner}\"")))
                }
                _ => Ok(()),
            };
            if b.kind != BackendKind::File {
                foreign(&file_keys, "file")?;
            }
            if b.kind != BackendKind::Nbd {
                foreign(&nbd_keys, "nbd")?;
            }
            if b.kind != BackendKind::Rbd {
                foreign(&rbd_keys, "rbd")?;
            }
            if !matches!(b.kind, BackendKind::Nbd | BackendKind::Rbd) {
                foreign(&remote_keys, "nbd\" or \"rbd")?;
            }
            if !matches!(b.kind, BackendKind::File | BackendKind::Rbd) {
                foreign(&[("read_only", b.read_only.as_ref().map(|x| x.span()))], "file\" or \"rbd")?;
            }
            let vdev_keys = [
                ("card", b.card.as_ref().map(|x| x.span())),
                ("seed", b.seed.as_ref().map(|x| x.span())),
                ("wait", b.wait.as_ref().map(|x| x.span())),
            ];
            if b.kind != BackendKind::Vdev {
                foreign(&vdev_keys, "vdev")?;
            }
            match b.kind {
                BackendKind::File => {
                    let Some(path) = &b.path else {
                        return Err(err(
                            d.name.span(),
                            format!("device `{name}`: key `backend.path` is required for type = \"file\""),
                        ));
                    };
                    let p = path.get_ref();
                    if !p.exists() {
                        return Err(err(
                            path.span(),
                            format!("device `{name}`: key `backend.path`: {} does not exist", p.display()),
                        ));
                    }
                    if b.format.as_ref().is_some_and(|f| *f.get_ref() == ImageFormat::Qcow2) {
                        // The image says its size, and its metadata is read and written by
                        // plain system calls on the page cache.
                        let clash = [
                            ("direct", b.direct.as_ref().filter(|d| *d.get_ref()).map(|x| x.span())),
                            ("engine", b.engine.as_ref().filter(|e| *e.get_ref() == Engine::IoUring).map(|x| x.span())),
                            ("size", d.size.as_ref().map(|x| x.span())),
                        ];
                        if let Some((key, Some(span))) = clash.into_iter().find(|(_, s)| s.is_some()) {
                            return Err(err(
                                span,
                                format!(
                                    "device `{name}`: key `{}{key}` cannot be used with format = \"qcow2\" (the image \
                                     gives the size; its I/O is buffered and synchronous)",
                                    if key == "size" { "" } else { "backend." }
                                ),
                            ));
                        }
                    }
                }
                BackendKind::Nbd => {
                    let Some(uri) = &b.uri else {
                        return Err(err(
                            d.name.span(),
                            format!("device `{name}`: key `backend.uri` is required for type = \"nbd\""),
                        ));
                    };
                    if let Err(e) = parse_nbd_uri(uri.get_ref()) {
                        return Err(err(uri.span(), format!("device `{name}`: key `backend.uri`: `{}`: {e}", uri.get_ref())));
                    }
                    for (key, v, lo, hi) in [
                        ("connect_timeout_ms", &b.connect_timeout_ms, 10, 600_000),
                        ("reconnect_timeout_ms", &b.reconnect_timeout_ms, 0, 86_400_000),
                    ] {
                        if let Some(v) = v {
                            if !(lo..=hi).contains(v.get_ref()) {
                                return Err(err(
                                    v.span(),
                                    format!("device `{name}`: key `backend.{key}`: {} is out of range {lo}..={hi}", v.get_ref()),
                                ));
                            }
                        }
                    }
                }
                BackendKind::Rbd => {
                    for (key, v) in [("pool", &b.pool), ("image", &b.image), ("mon_host", &b.mon_host)] {
                        match v {
                            None => {
                                return Err(err(
                                    d.name.span(),
                                    format!("device `{name}`: key `backend.{key}` is required for type = \"rbd\""),
                                ))
                            }
                            Some(v) if v.get_ref().trim().is_empty() || v.get_ref().contains('\0') => {
                                return Err(err(v.span(), format!("device `{name}`: key `backend.{key}` is empty")))
                            }
                            Some(_) => {}
                        }
                    }
                    if let Some(m) = &b.mon_host {
                        if let Err(e) = parse_mon_host(m.get_ref()) {
                            return Err(err(m.span(), format!("device `{name}`: key `backend.mon_host`: {e}")));
                        }
                    }
                    let Some(key) = &b.key_file else {
                        return Err(err(
                            d.name.span(),
                            format!("device `{name}`: key `backend.key_file` is required for type = \"rbd\" (the file `ceph auth get-key` writes)"),
                        ));
                    };
                    if let Err(e) = std::fs::metadata(key.get_ref()) {
                        return Err(err(
                            key.span(),
                            format!("device `{name}`: key `backend.key_file`: {}: {e}", key.get_ref().display()),
                        ));
                    }
                    if let Some(n) = &b.networks {
                        for net in n.get_ref() {
                            if let Err(e) = parse_cidr(net) {
                                return Err(err(n.span(), format!("device `{name}`: key `backend.networks`: `{net}`: {e}")));
                            }
                        }
                    }
                    for (key, v, lo, hi) in [
                        ("connect_timeout_ms", &b.connect_timeout_ms, 10, 600_000),
                        ("reconnect_timeout_ms", &b.reconnect_timeout_ms, 0, 86_400_000),
                        ("op_timeout_ms", &b.op_timeout_ms, 1000, 3_600_000),
                    ] {
                        if let Some(v) = v {
                            if !(lo..=hi).contains(v.get_ref()) {
                                return Err(err(
                                    v.span(),
                                    format!("device `{name}`: key `backend.{key}`: {} is out of range {lo}..={hi}", v.get_ref()),
                                ));
                            }
                        }
                    }
                }
                BackendKind::Vdev => {
                    match (&b.card, &b.seed) {
                        (Some(_), Some(seed)) => {
                            return Err(err(
                                seed.span(),
                                format!("device `{name}`: keys `backend.card` and `backend.seed` both name the card: give one"),
                            ))
                        }
                        (None, None) => {
                            return Err(err(
                                d.name.span(),
                                format!("device `{name}`: type = \"vdev\" needs `backend.card` (a card spec) or `backend.seed`"),
                            ))
                        }
                        (Some(card), None) => {
                            let p = card.get_ref();
                            let text = std::fs::read_to_string(p).map_err(|e| {
                                err(card.span(), format!("device `{name}`: key `backend.card`: cannot read {}: {e}", p.display()))
                            })?;
                            if let Err(e) = bulkhead_vdev::Card::from_json(&text) {
                                return Err(err(
                                    card.span(),
                                    format!("device `{name}`: key `backend.card`: {}: {e}", p.display()),
                                ));
                            }
                        }
                        (None, Some(_)) => {}
                    }
                    if d.size.is_none() {
                        return Err(err(d.name.span(), format!("device `{name}`: key `size` is required for this backend")));
                    }
                }
                BackendKind::Ram | BackendKind::Null => {
                    if d.size.is_none() {
                        return Err(err(d.name.span(), format!("device `{name}`: key `size` is required for this backend")));
                    }
                }
            }
            for (i, f) in d.filters.iter().enumerate() {
                f.resolve(name, i, d.watchdog_ms(), &err)?;
            }
            if d.views.len() > view::MAX_VIEWS {
                return Err(err(
                    d.views[view::MAX_VIEWS].name.span(),
                    format!("device `{name}`: more than {} views", view::MAX_VIEWS),
                ));
            }
            for v in &d.views {
                v.check(name, d.size.as_ref().map(|s| s.get_ref().0), &err)?;
            }
            check_allow(&d.nbd_allow, &format!("device `{name}`"), &err)?;
            check_attach(&d.attach, &format!("device `{name}`"), &err)?;
            if let Some(s) = &d.size {
                if s.get_ref().0 == 0 || s.get_ref().0 % 512 != 0 {
                    return Err(err(
                        s.span(),
                        format!("device `{name}`: key `size`: {} is not a positive multiple of 512", s.get_ref().0),
                    ));
                }
            }
        }
        // Views share the devices' namespace: each is an export of its own.
        for d in &self.devices {
            for v in &d.views {
                let vname = v.name.get_ref();
                if !valid_name(vname) {
                    return Err(err(
                        v.name.span(),
                        format!(
                            "device `{}`: key `name`: `{vname}` is not a valid view name (1-64 of A-Z a-z 0-9 - _ ., not starting with .)",
                            d.name.get_ref()
                        ),
                    ));
                }
                if !names.insert(vname.clone()) {
                    return Err(err(
                        v.name.span(),
                        format!(
                            "device `{}`: key `name`: `{vname}` is defined twice (devices and views share one namespace)",
                            d.name.get_ref()
                        ),
                    ));
                }
            }
        }
        if let Some(list) = &self.vhost_user.devices {
            if let Some(unknown) = list.get_ref().iter().find(|n| !names.contains(*n)) {
                return Err(err(list.span(), format!("key `vhost_user.devices`: no device or view is named `{unknown}`")));
            }
        }
        Ok(())
    }

    /// Whether the vhost-user export serves device or view `name`.
    pub fn vhost_user_exports(&self, name: &str) -> bool {
        self.vhost_user.enabled && self.vhost_user.devices.as_ref().is_none_or(|l| l.get_ref().iter().any(|n| n == name))
    }
}

/// Checks an `nbd_allow` list: each entry an address or an address/prefix.
pub(crate) fn check_allow(
    list: &Option<Spanned<Vec<String>>>,
    what: &str,
    err: &impl Fn(std::ops::Range<usize>, String) -> ConfigError,
) -> Result<(), ConfigError> {
    if let Some(l) = list {
        for a in l.get_ref() {
            if let Err(e) = bulkhead_nbd::allow::Cidr::parse(a) {
                return Err(err(l.span(), format!("{what}: key `nbd_allow`: {e}")));
            }
        }
    }
    Ok(())
}

/// The ranges of a checked `nbd_allow` list (`None`: no list, anyone).
pub fn allow_list(list: &Option<Spanned<Vec<String>>>) -> Option<Vec<bulkhead_nbd::allow::Cidr>> {
    list.as_ref().map(|l| l.get_ref().iter().filter_map(|a| bulkhead_nbd::allow::Cidr::parse(a).ok()).collect())
}

/// Whether `name` may name a device or a view (a file name and an export name).
fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        && !name.starts_with('.')
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Result<Config, ConfigError> {
        Config::parse(s, "test.toml")
    }

    #[test]
    fn rbd_backend_names_missing_and_misplaced_keys() {
        let key = std::env::temp_dir().join(format!("bulkhead-config-rbd-key-{}", std::process::id()));
        std::fs::write(&key, "AQBexample==\n").unwrap();
        let dev = |backend: &str| format!("[[device]]\nname = \"r\"\nsize = \"1G\"\n[device.backend]\ntype = \"rbd\"\n{backend}");
        let full =
            format!("mon_host = \"10.0.0.1,10.0.0.2:6789\"\npool = \"p\"\nimage = \"i\"\nkey_file = \"{}\"\n", key.display());
        let cfg = parse(&dev(&full)).unwrap();
        match cfg.devices[0].backend.resolve() {
            BackendConfig::Rbd { user, cache, op_timeout_ms, namespace, .. } => {
                assert_eq!((user.as_str(), cache, op_timeout_ms, namespace.as_str()), ("admin", false, RBD_OP_TIMEOUT_MS, ""));
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(cfg.devices[0].watchdog_ms(), 10_000);
        let e = parse(&dev(&full.replace("pool = \"p\"\n", ""))).unwrap_err().to_string();
        assert!(e.contains("`backend.pool` is required"), "{e}");
        let e = parse(&dev(&full.replace(&key.display().to_string(), "/nonexistent/key"))).unwrap_err().to_string();
        assert!(e.contains("`backend.key_file`") && e.contains("line 9"), "{e}");
        let e = parse(&dev(&format!("{full}networks = [\"10.0.0.0/33\"]\n"))).unwrap_err().to_string();
        assert!(e.contains("`backend.networks`") && e.contains("10.0.0.0/33"), "{e}");
        let e = parse(&dev(&full.replace("10.0.0.2:6789", "10.0.0.2:x"))).unwrap_err().to_string();
        assert!(e.contains("`backend.mon_host`") && e.contains("bad port"), "{e}");
        let ram = "[[device]]\nname = \"m\"\nsize = \"1G\"\n[device.backend]\ntype = \"ram\"\npool = \"p\"\n";
        let e = parse(ram).unwrap_err().to_string();
        assert!(e.contains("`backend.pool` only applies to type = \"rbd\""), "{e}");
        assert_eq!(parse_mon_host("[v2:10.0.0.1:3300,v1:10.0.0.1:6789]").unwrap()[0], ("10.0.0.1".to_string(), Some(3300)));
        let _ = std::fs::remove_file(key);
    }

    #[test]
    fn vhost_user_lists_only_known_devices_and_views() {
        let base = "[[device]]\nname = \"a\"\nsize = \"16M\"\n[device.backend]\ntype = \"ram\"\n[[device.view]]\nname = \"a-ro\"\nread_only = true\n";
        let off = parse(base).unwrap();
        assert!(!off.vhost_user_exports("a"));
        let all = parse(&format!("[vhost_user]\nenabled = true\n{base}")).unwrap();
        assert!(all.vhost_user_exports("a") && all.vhost_user_exports("a-ro"));
        let some = parse(&format!("[vhost_user]\nenabled = true\ndevices = [\"a-ro\"]\n{base}")).unwrap();
        assert!(!some.vhost_user_exports("a") && some.vhost_user_exports("a-ro"));
        let e = parse(&format!("[vhost_user]\nenabled = true\ndevices = [\"b\"]\n{base}")).unwrap_err().to_string();
        assert!(e.contains("line 3") && e.contains("vhost_user.devices") && e.contains("`b`"), "{e}");
        let e = parse(&format!("[vhost_user]\nenable = true\n{base}")).unwrap_err().to_string();
        assert!(e.contains("enable"), "{e}");
    }

    #[test]
    fn nbd_section_is_validated_with_key_and_line() {
        let dev = "[[device]]\nname = \"a\"\nsize = \"1M\"\n[device.backend]\ntype = \"ram\"\n";
        let c = parse(&format!("[nbd]\ntcp = \"127.0.0.1:10809\"\nworkers = 8\n{dev}")).unwrap();
        assert_eq!(c.nbd.tcp.as_ref().map(|t| t.get_ref().as_str()), Some("127.0.0.1:10809"));
        assert_eq!(*c.nbd.workers.get_ref(), 8);
        assert!(c.nbd.enabled);
        let e = parse(&format!("[nbd]\nmax_connections = 0\n{dev}")).unwrap_err().to_string();
        assert!(e.contains("nbd.max_connections") && e.contains("line 2"), "{e}");
        let e = parse(&format!("[nbd]\n\ntcp = \"nowhere\"\n{dev}")).unwrap_err().to_string();
        assert!(e.contains("nbd.tcp") && e.contains("line 3"), "{e}");
        let e = parse(&format!("[nbd]\nport = 1\n{dev}")).unwrap_err().to_string();
        assert!(e.contains("port"), "{e}");
    }

    #[test]
    fn tls_takes_certificates_or_keys_and_names_the_conflict() {
        let dev = "[[device]]\nname = \"a\"\nsize = \"1M\"\n[device.backend]\ntype = \"ram\"\n";
        let c = parse(&format!("[nbd]\ntls = \"require\"\ntls_psk = \"/k.psk\"\n{dev}")).unwrap();
        assert_eq!(c.nbd.tls_psk.as_ref().map(|p| p.get_ref().clone()), Some(PathBuf::from("/k.psk")));
        let e = parse(&format!("[nbd]\ntls = \"on\"\n{dev}")).unwrap_err().to_string();
        assert!(e.contains("nbd.tls_certificates") && e.contains("nbd.tls_psk") && e.contains("line 2"), "{e}");
        let e = parse(&format!("[nbd]\ntls = \"on\"\ntls_certificates = \"/d\"\ntls_psk = \"/k.psk\"\n{dev}"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("not both") && e.contains("line 4"), "{e}");
        let e =
            parse(&format!("[nbd]\ntls = \"on\"\ntls_verify_peer = true\ntls_psk = \"/k.psk\"\n{dev}")).unwrap_err().to_string();
        assert!(e.contains("tls_verify_peer") && e.contains("line 4"), "{e}");
    }

    #[test]
    fn embedded_default_is_one_gib_ram_adaptive_with_fuse() {
        let c = Config::embedded_default();
        assert_eq!(c.devices.len(), 1);
        let d = &c.devices[0];
        assert_eq!(d.name.get_ref(), "disk0");
        assert_eq!(d.size.as_ref().unwrap().get_ref().0, 1 << 30);
        assert_eq!(d.notify, Notify::Adaptive);
        assert_eq!(d.backend.resolve(), BackendConfig::Ram);
        assert!(c.fuse.enabled);
    }

    #[test]
    fn sizes_parse_with_suffixes() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("64k"), Ok(64 << 10));
        assert_eq!(parse_size("1G"), Ok(1 << 30));
        assert_eq!(parse_size("2GiB"), Ok(2 << 30));
        assert!(parse_size("1X").is_err());
        assert!(parse_size("G").is_err());
        assert!(parse_size("99999999999T").is_err());
    }

    #[test]
    fn unknown_key_names_key_and_line() {
        let e = parse("[[device]]\nname = \"a\"\nsize = \"1M\"\ncolour = 3\n[device.backend]\ntype = \"ram\"\n").unwrap_err();
        let m = e.to_string();
        assert!(m.contains("colour") && m.contains("line 4"), "{m}");
    }

    #[test]
    fn bad_value_names_key_and_line() {
        let e = parse("[[device]]\nname = \"a\"\nsize = \"1X\"\n[device.backend]\ntype = \"ram\"\n").unwrap_err();
        let m = e.to_string();
        assert!(m.contains("size") && m.contains("line 3") && m.contains("1X"), "{m}");
        let e = parse("[[device]]\nname = \"a\"\nsize = \"1M\"\nnotify = \"sometimes\"\n[device.backend]\ntype = \"ram\"\n")
            .unwrap_err();
        let m = e.to_string();
        assert!(m.contains("notify") && m.contains("line 4"), "{m}");
    }

    #[test]
    fn missing_backing_file_names_the_path_and_line() {
        let e = parse("[[device]]\nname = \"a\"\n[device.backend]\ntype = \"file\"\npath = \"/nonexistent/img\"\n").unwrap_err();
        let m = e.to_string();
        assert!(m.contains("/nonexistent/img") && m.contains("line 5") && m.contains("backend.path"), "{m}");
    }

    #[test]
    fn semantic_errors_name_key_and_line() {
        let e =
            parse("[[device]]\nname = \"a\"\nsize = \"1M\"\nqueue_depth = 3\n[device.backend]\ntype = \"ram\"\n").unwrap_err();
        assert!(e.to_string().contains("queue_depth") && e.to_string().contains("line 4"), "{e}");
        let e = parse("[[device]]\nname = \"a/b\"\nsize = \"1M\"\n[device.backend]\ntype = \"ram\"\n").unwrap_err();
        assert!(e.to_string().contains("line 2") && e.to_string().contains("a/b"), "{e}");
        let dup = "[[device]]\nname = \"a\"\nsize = \"1M\"\n[device.backend]\ntype = \"ram\"\n";
        let e = parse(&format!("{dup}{dup}")).unwrap_err();
        assert!(e.to_string().contains("twice") && e.to_string().contains("line 7"), "{e}");
        let e = parse("[[device]]\nname = \"a\"\n[device.backend]\ntype = \"ram\"\n").unwrap_err();
        assert!(e.to_string().contains("`size` is required"), "{e}");
        let e = parse("[[device]]\nname = \"a\"\nsize = 1000\n[device.backend]\ntype = \"ram\"\n").unwrap_err();
        assert!(e.to_string().contains("multiple of 512"), "{e}");
        let e =
            parse("[[device]]\nname = \"a\"\nsize = \"1M\"\nwatchdog_ms = 1\n[device.backend]\ntype = \"ram\"\n").unwrap_err();
        assert!(e.to_string().contains("watchdog_ms") && e.to_string().contains("line 4"), "{e}");
        let e = parse("[fuse]\nio_uring = \"on\"\nqueue_depth = 300\n[[device]]\nname = \"a\"\nsize = \"1M\"\n[device.backend]\ntype = \"ram\"\n")
            .unwrap_err();
        assert!(e.to_string().contains("fuse.queue_depth") && e.to_string().contains("line 3"), "{e}");
        let e =
            parse("[fuse]\nio_uring = \"maybe\"\n[[device]]\nname = \"a\"\nsize = \"1M\"\n[device.backend]\ntype = \"ram\"\n")
                .unwrap_err();
        assert!(e.to_string().contains("io_uring") && e.to_string().contains("line 2"), "{e}");
        let c = parse("[fuse]\nio_uring = \"off\"\nqueue_depth = 8\n[[device]]\nname = \"a\"\nsize = \"1M\"\n[device.backend]\ntype = \"ram\"\n")
            .unwrap();
        assert_eq!((c.fuse.io_uring, *c.fuse.queue_depth.get_ref()), (FuseUring::Off, 8));
        let e = parse("[fuse]\nthreads = 0\n[[device]]\nname = \"a\"\nsize = \"1M\"\n[device.backend]\ntype = \"ram\"\n")
            .unwrap_err();
        assert!(e.to_string().contains("fuse.threads") && e.to_string().contains("line 2"), "{e}");
    }

    #[test]
    fn file_backend_takes_its_options() {
        let c = parse("[[device]]\nname = \"f\"\n[device.backend]\ntype = \"file\"\npath = \"/dev/null\"\ndirect = true\nengine = \"io_uring\"\n").unwrap();
        match c.devices[0].backend.resolve() {
            BackendConfig::File { direct, engine, read_only, .. } => {
                assert!(direct);
                assert_eq!(engine, Engine::IoUring);
                assert!(!read_only);
            }
            other => panic!("{other:?}"),
        }
        let c = parse("[[device]]\nname = \"f\"\n[device.backend]\ntype = \"file\"\npath = \"/dev/null\"\n").unwrap();
        assert!(matches!(c.devices[0].backend.resolve(), BackendConfig::File { engine: Engine::Auto, .. }), "auto by default");
        let e = parse("[[device]]\nname = \"f\"\n[device.backend]\ntype = \"file\"\npath = \"/dev/null\"\nengine = \"aio\"\n")
            .unwrap_err();
        assert!(e.to_string().contains("aio") && e.to_string().contains("line 6"), "{e}");
        let e = parse("[[device]]\nname = \"r\"\nsize = \"1M\"\n[device.backend]\ntype = \"ram\"\ndirect = true\n").unwrap_err();
        assert!(e.to_string().contains("backend.direct") && e.to_string().contains("line 6"), "{e}");
    }

    #[test]
    fn a_file_backend_holds_a_qcow2_image_without_size_direct_or_io_uring() {
        let head = "[[device]]\nname = \"q\"\n[device.backend]\ntype = \"file\"\npath = \"/dev/null\"\nformat = \"qcow2\"\n";
        match parse(head).unwrap().devices[0].backend.resolve() {
            BackendConfig::File { format, .. } => assert_eq!(format, ImageFormat::Qcow2),
            other => panic!("{other:?}"),
        }
        for (extra, key, line) in [("direct = true\n", "backend.direct", 7), ("engine = \"io_uring\"\n", "backend.engine", 7)] {
            let e = parse(&format!("{head}{extra}")).unwrap_err().to_string();
            assert!(e.contains(key) && e.contains("qcow2") && e.contains(&format!("line {line}")), "{e}");
        }
        let e = parse(&head.replace("name = \"q\"\n", "name = \"q\"\nsize = \"1M\"\n")).unwrap_err().to_string();
        assert!(e.contains("key `size`") && e.contains("line 3"), "{e}");
        let e = parse(&head.replace("qcow2", "vmdk")).unwrap_err().to_string();
        assert!(e.contains("vmdk") && e.contains("line 6"), "{e}");
        let e =
            parse("[[device]]\nname = \"r\"\nsize = \"1M\"\n[device.backend]\ntype = \"ram\"\nformat = \"qcow2\"\n").unwrap_err();
        assert!(e.to_string().contains("backend.format` only applies"), "{e}");
    }

    #[test]
    fn nbd_backend_takes_a_uri_and_names_bad_ones() {
        let c = parse("[[device]]\nname = \"n\"\n[device.backend]\ntype = \"nbd\"\nuri = \"nbd://10.0.0.2/disk0\"\n").unwrap();
        match c.devices[0].backend.resolve() {
            BackendConfig::Nbd { target, export, reconnect_timeout_ms, .. } => {
                assert_eq!(target, NbdTarget::Tcp { host: "10.0.0.2".into(), port: NBD_DEFAULT_PORT });
                assert_eq!(export, "disk0");
                assert_eq!(reconnect_timeout_ms, 60_000);
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(c.devices[0].watchdog_ms(), 10_000, "network requests get a longer watchdog");
        let e = parse("[[device]]\nname = \"n\"\n[device.backend]\ntype = \"nbd\"\nuri = \"http://x/y\"\n").unwrap_err();
        assert!(
            e.to_string().contains("backend.uri") && e.to_string().contains("line 5") && e.to_string().contains("scheme"),
            "{e}"
        );
        let e = parse("[[device]]\nname = \"n\"\n[device.backend]\ntype = \"nbd\"\n").unwrap_err();
        assert!(e.to_string().contains("backend.uri` is required"), "{e}");
        let e = parse("[[device]]\nname = \"n\"\nsize = \"1M\"\n[device.backend]\ntype = \"ram\"\nuri = \"nbd://h/e\"\n")
            .unwrap_err();
        assert!(e.to_string().contains("only applies to type = \"nbd\""), "{e}");
        let e =
            parse("[[device]]\nname = \"n\"\n[device.backend]\ntype = \"nbd\"\nuri = \"nbd://h/e\"\npath = \"/\"\n").unwrap_err();
        assert!(e.to_string().contains("backend.path` only applies to type = \"file\""), "{e}");
    }

    #[test]
    fn vdev_backend_takes_a_card_file_or_a_seed_and_names_bad_ones() {
        let dev = "[[device]]\nname = \"v\"\nsize = \"64M\"\n[device.backend]\ntype = \"vdev\"\n";
        let c = parse(&format!("{dev}seed = 7\nwait = \"poll\"\n")).unwrap();
        assert_eq!(c.devices[0].backend.resolve(), BackendConfig::Vdev { card: VdevCard::Seed(7), wait: VdevWait::Poll });
        let c = parse(&format!("{dev}seed = 3\n")).unwrap();
        assert!(
            matches!(c.devices[0].backend.resolve(), BackendConfig::Vdev { wait: VdevWait::Interrupt, .. }),
            "interrupts by default"
        );

        let dir = std::env::temp_dir().join(format!("bulkhead-config-vdev-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let good = dir.join("card.json");
        std::fs::write(&good, bulkhead_vdev::Card::generate(9).to_json()).unwrap();
        let c = parse(&format!("{dev}card = \"{}\"\n", good.display())).unwrap();
        assert!(matches!(c.devices[0].backend.resolve(), BackendConfig::Vdev { card: VdevCard::File(p), .. } if p == good));
        // A card whose registers overlap is refused at load, naming the file and the line.
        let mut bad = bulkhead_vdev::Card::generate(9);
        bad.registers.status.offset = bad.registers.control.offset;
        let bad_path = dir.join("bad.json");
        std::fs::write(&bad_path, bad.to_json()).unwrap();
        let e = parse(&format!("{dev}card = \"{}\"\n", bad_path.display())).unwrap_err().to_string();
        assert!(e.contains("backend.card") && e.contains("line 6") && e.contains("bad.json"), "{e}");
        let e = parse(&format!("{dev}card = \"{}\"\n", dir.join("none.json").display())).unwrap_err().to_string();
        assert!(e.contains("backend.card") && e.contains("cannot read"), "{e}");
        let e = parse(&format!("{dev}card = \"{}\"\nseed = 1\n", good.display())).unwrap_err().to_string();
        assert!(e.contains("both name the card") && e.contains("line 7"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();

        let e = parse(dev).unwrap_err().to_string();
        assert!(e.contains("needs `backend.card`"), "{e}");
        let e = parse(&format!("{dev}seed = 1\nwait = \"sometimes\"\n")).unwrap_err().to_string();
        assert!(e.contains("wait") && e.contains("line 7"), "{e}");
        let e = parse("[[device]]\nname = \"v\"\n[device.backend]\ntype = \"vdev\"\nseed = 1\n").unwrap_err().to_string();
        assert!(e.contains("key `size` is required"), "{e}");
        let e = parse("[[device]]\nname = \"n\"\nsize = \"1M\"\n[device.backend]\ntype = \"ram\"\nseed = 1\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("backend.seed` only applies to type = \"vdev\""), "{e}");
    }

    #[test]
    fn nbd_uris_parse_like_the_uri_specification() {
        assert_eq!(
            parse_nbd_uri("nbd+unix:///d%2F0?socket=/run/b/nbd.sock").unwrap(),
            (NbdTarget::Unix("/run/b/nbd.sock".into()), "d/0".into())
        );
        assert_eq!(
            parse_nbd_uri("nbd://[::1]:10900/").unwrap(),
            (NbdTarget::Tcp { host: "::1".into(), port: 10900 }, String::new())
        );
        assert_eq!(parse_nbd_uri("nbd://host").unwrap(), (NbdTarget::Tcp { host: "host".into(), port: 10809 }, String::new()));
        for bad in [
            "nbd://h:0/x",
            "nbd://h:99999/x",
            "nbd:///x",
            "nbd+unix:///x",
            "nbd+unix://h/x?socket=/s",
            "nbds://h/x",
            "nbd://h/%zz",
        ] {
            assert!(parse_nbd_uri(bad).is_err(), "{bad}");
        }
    }

    const RAM: &str = "[[device]]\nname = \"a\"\nsize = \"1M\"\n[device.backend]\ntype = \"ram\"\n";

    #[test]
    fn filters_resolve_in_order_frontend_side_first() {
        let c = parse(&format!(
            "{RAM}[[device.filter]]\ntype = \"trace\"\npath = \"/tmp/t.blktrace\"\n[[device.filter]]\ntype = \"stats\"\n\
             [[device.filter]]\ntype = \"delay\"\ndelay_us = 100\nflush_us = 0\n[[device.filter]]\ntype = \"error\"\n\
             ops = [\"write\", \"flush\"]\nprobability = 0.5\nerrno = \"ENOSPC\"\ncount = 3\noffset = \"1M\"\n\
             [[device.filter]]\ntype = \"throttle\"\niops = 100\niops_max = 200\nmax_length = 2.0\nbps_write = \"10M\"\n"
        ))
        .unwrap();
        let f = c.devices[0].filters();
        let types: Vec<_> = f.iter().map(|f| f.spec.type_name()).collect();
        assert_eq!(types, ["trace", "stats", "delay", "error", "throttle"]);
        assert_eq!(f[0].path.as_deref(), Some(Path::new("/tmp/t.blktrace")));
        assert_eq!(f[2].spec, bulkhead_filters::FilterSpec::Delay { delay_us: [100, 100, 0, 100, 100] });
        match &f[3].spec {
            bulkhead_filters::FilterSpec::Error { rule } => {
                assert_eq!(
                    (rule.ops, rule.probability_ppm, rule.errno, rule.count, rule.offset),
                    (0b110, 500_000, 28, Some(3), 1 << 20)
                );
            }
            other => panic!("{other:?}"),
        }
        match &f[4].spec {
            bulkhead_filters::FilterSpec::Throttle { limits } => {
                let iops = limits.iops_total.unwrap();
                assert_eq!((iops.avg, iops.max, iops.max_length), (100.0, 200.0, 2.0));
                assert_eq!(limits.bps_write.unwrap().avg, 10.0 * 1048576.0);
                assert!(limits.bps_total.is_none());
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn filter_errors_name_the_key_the_filter_and_the_line() {
        let cases = [
            ("type = \"trace\"\n", "filter.path", 7),
            ("type = \"stats\"\ndelay_us = 5\n", "only applies to type = \"delay\"", 8),
            ("type = \"delay\"\ndelay_us = 900000\n", "watchdog_ms", 8),
            ("type = \"delay\"\n", "set delay_us", 7),
            ("type = \"error\"\nops = [\"read\", \"trim\"]\n", "unknown operation `trim`", 8),
            ("type = \"error\"\nprobability = 1.5\n", "filter.probability", 8),
            ("type = \"error\"\nerrno = \"EPERM\"\n", "filter.errno", 8),
            ("type = \"throttle\"\n", "at least one", 7),
            ("type = \"throttle\"\niops_max = 5\n", "needs `iops`", 8),
            ("type = \"throttle\"\niops = 50\niops_max = 5\n", "below the average", 9),
            ("type = \"throttle\"\niops = 0\n", "positive", 8),
            ("type = \"zip\"\n", "zip", 7),
            ("type = \"stats\"\nguard = \"always\"\n", "filter.guard`: `always` is not one of off, dwc, scdwc", 8),
            ("type = \"stats\"\nguard = \"dwc\"\nguard_cache = 5\n", "guard_cache` only applies with guard = \"scdwc\"", 9),
            ("type = \"stats\"\nguard = \"scdwc\"\nguard_cache = 300\n", "guard_cache`: 300 is out of range 0..=256", 9),
            ("type = \"stats\"\nguard_keys = false\n", "guard_keys` only applies with guard = \"dwc\" or \"scdwc\"", 8),
            ("type = \"stats\"\nguard = \"dwc\"\nguard_keys = \"yes\"\n", "guard_keys", 9),
            ("type = \"crypt\"\n", "filter.key_file` is required", 7),
            ("type = \"crypt\"\nkey_file = \"/nonexistent/key\"\n", "/nonexistent/key is not a file", 8),
            ("type = \"stats\"\nkey_file = \"/etc/hostname\"\n", "only applies to type = \"crypt\"", 8),
            ("type = \"cow\"\n", "filter.overlay` is required", 7),
            ("type = \"cow\"\noverlay = \"/nonexistent/o.qcow2\"\n", "directory /nonexistent does not exist", 8),
            ("type = \"cow\"\noverlay = \"/tmp/o.qcow2\"\ncluster_size = \"3000\"\n", "filter.cluster_size`: 3000", 9),
            ("type = \"stats\"\noverlay = \"/tmp/o.qcow2\"\n", "only applies to type = \"cow\"", 8),
        ];
        for (table, want, line) in cases {
            let e = parse(&format!("{RAM}[[device.filter]]\n{table}")).unwrap_err().to_string();
            assert!(e.contains(want) && e.contains(&format!("line {line}")), "{table:?}: {e}");
        }
    }

    #[test]
    fn guard_keys_resolve_for_any_filter_type() {
        use bulkhead_filters::GuardMode;
        let f = parse_filter("type = \"stats\"\nguard = \"scdwc\"\n", "d", 0, 5000).unwrap();
        assert_eq!(f.guard.mode, GuardMode::Scdwc { cache: 60 });
        assert!(f.guard.keys, "keys are on wherever a filter is guarded, unless turned off");
        let f = parse_filter("type = \"stats\"\nguard = \"scdwc\"\nguard_keys = false\n", "d", 0, 5000).unwrap();
        assert!(!f.guard.keys);
        let f = parse_filter("type = \"stats\"\nguard = \"dwc\"\n", "d", 0, 5000).unwrap();
        assert_eq!(f.guard.mode, GuardMode::Dwc);
        let f = parse_filter("type = \"stats\"\n", "d", 0, 5000).unwrap();
        assert!(!f.guard.wanted() && !f.guard.keys);
    }

    #[test]
    fn vpt_and_scheduler_filters_share_the_drive_keys_and_refuse_bad_values_by_line() {
        let c = parse(&format!(
            "{RAM}[[device.filter]]\ntype = \"scheduler\"\npolicy = \"cats\"\nrpm = 7200\ncache = false\n\
             anticipate_ms = 0\n[[device.filter]]\ntype = \"vpt\"\nk = 8.0\nlock_k = true\nseek_ms = 10.0\n\
             cache_segments = 16\n"
        ))
        .unwrap();
        let f = c.devices[0].filters();
        match &f[0].spec {
            bulkhead_filters::FilterSpec::Scheduler { policy, depth, drive, tuning } => {
                assert_eq!((*policy, *depth), (bulkhead_diskmodel::sched::Policy::Cats, 1));
                assert_eq!((drive.rotation_ns, drive.cache), (8_333_333, None));
                assert_eq!(tuning.anticipate_ns, 0);
            }
            other => panic!("{other:?}"),
        }
        match &f[1].spec {
            bulkhead_filters::FilterSpec::Vpt { drive, k, lock_k } => {
                assert_eq!((*k, *lock_k, drive.full_seek_ns, drive.rotation_ns), (8.0, true, 10_000_000, 4_000_000));
                assert_eq!(drive.cache.map(|c| (c.segments, c.segment_sectors)), Some((16, 221)));
            }
            other => panic!("{other:?}"),
        }
        let cases = [
            ("type = \"scheduler\"\n", "filter.policy` is required", 7),
            ("type = \"scheduler\"\npolicy = \"elevator\"\n", "`elevator` is not one of", 8),
            ("type = \"scheduler\"\npolicy = \"cats\"\nk = 2.0\n", "only applies to type = \"vpt\"", 9),
            (
                "type = \"scheduler\"\npolicy = \"cats\"\nmin_write_delay_ms = 50\nmax_write_delay_ms = 20\n",
                "below min_write_delay_ms",
                10,
            ),
            ("type = \"vpt\"\nk = 0.0\n", "filter.k`: 0 is out of range", 8),
            ("type = \"vpt\"\nrpm = 10\n", "filter.rpm`: 10 is out of range", 8),
            ("type = \"vpt\"\ndepth = 2\n", "only applies to type = \"scheduler\"", 8),
            ("type = \"stats\"\nseek_ms = 2.0\n", "type = \"vpt\" or type = \"scheduler\"", 8),
        ];
        for (table, want, line) in cases {
            let e = parse(&format!("{RAM}[[device.filter]]\n{table}")).unwrap_err().to_string();
            assert!(e.contains(want) && e.contains(&format!("line {line}")), "{table:?}: {e}");
        }
    }

    #[test]
    fn tap_modes_parse_and_unknown_ones_are_refused_by_line() {
        let c = parse(&RAM.replace("size = \"1M\"", "size = \"1M\"\ntap = \"passthrough\"")).unwrap();
        assert_eq!(c.devices[0].tap, Tap::Passthrough);
        let c = parse(&RAM.replace("size = \"1M\"", "size = \"1M\"\ntap = \"interpose\"")).unwrap();
        assert_eq!(c.devices[0].tap, Tap::Interpose);
        let c = parse(&RAM.replace("size = \"1M\"", "size = \"1M\"\ntap = \"intercept\"")).unwrap();
        assert_eq!(c.devices[0].tap, Tap::Intercept);
        let e = parse(&RAM.replace("size = \"1M\"", "size = \"1M\"\ntap = \"sideways\"")).unwrap_err().to_string();
        assert!(e.contains("sideways") && e.contains("line 4"), "{e}");
    }

    #[test]
    fn a_filter_table_on_its_own_parses_and_its_errors_name_key_and_line() {
        let f = parse_filter("type = \"delay\"\nread_us = 100", "d", 0, 1000).unwrap();
        assert_eq!(f.spec, bulkhead_filters::FilterSpec::Delay { delay_us: [100, 0, 0, 0, 0] });
        let e = parse_filter("type = \"delay\"\nread_us = 900000", "d", 2, 1000).unwrap_err().to_string();
        assert!(e.contains("filter 3") && e.contains("read_us") && e.contains("line 2"), "{e}");
        let e = parse_filter("type = \"stats\"\ncolour = 1", "d", 0, 1000).unwrap_err().to_string();
        assert!(e.contains("colour") && e.contains("line 2"), "{e}");
    }
}
