//! A device's `[device.backend]` table: which storage, and each type's own keys, checked
//! against the type (a key of another type is refused, naming it), then resolved.

use std::path::PathBuf;

use serde::Deserialize;
use toml::Spanned;

use crate::{At, ConfigError, Size};

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

/// The device a backend table is checked for: its errors name it, and point at its name where
/// a key they are about is missing.
struct Owner<'a> {
    name: &'a str,
    at: std::ops::Range<usize>,
    size: Option<&'a Spanned<Size>>,
    err: &'a At<'a>,
}

impl Owner<'_> {
    /// An error at `span` about this device.
    fn error(&self, span: std::ops::Range<usize>, what: impl std::fmt::Display) -> ConfigError {
        (self.err)(span, format!("device `{}`: {what}", self.name))
    }

    /// An error at `span` about key `backend.{key}`: `what` follows the key.
    fn key(&self, span: std::ops::Range<usize>, key: &str, what: impl std::fmt::Display) -> ConfigError {
        self.error(span, format_args!("key `backend.{key}`{what}"))
    }

    /// Key `backend.{key}`, which type `kind` needs, is missing.
    fn missing(&self, key: &str, kind: &str) -> ConfigError {
        self.key(self.at.clone(), key, format_args!(" is required for type = \"{kind}\""))
    }

    /// The device has no `size`, which its backend needs.
    fn needs_size(&self) -> Result<(), ConfigError> {
        match self.size {
            Some(_) => Ok(()),
            None => Err(self.error(self.at.clone(), "key `size` is required for this backend")),
        }
    }
}

impl BackendTable {
    /// Checks the table of device `name` (named at `name_span`, of `size` bytes if given):
    /// keys of another type refused by name, each type's own keys required and in range.
    pub(crate) fn validate(
        &self,
        name: &str,
        name_span: &Spanned<String>,
        size: Option<&Spanned<Size>>,
        err: &At<'_>,
    ) -> Result<(), ConfigError> {
        let dev = Owner { name, at: name_span.span(), size, err };
        let file_keys = [
            ("path", self.path.as_ref().map(|x| x.span())),
            ("direct", self.direct.as_ref().map(|x| x.span())),
            ("engine", self.engine.as_ref().map(|x| x.span())),
            ("format", self.format.as_ref().map(|x| x.span())),
        ];
        let nbd_keys = [("uri", self.uri.as_ref().map(|x| x.span()))];
        let remote_keys = [
            ("connect_timeout_ms", self.connect_timeout_ms.as_ref().map(|x| x.span())),
            ("reconnect_timeout_ms", self.reconnect_timeout_ms.as_ref().map(|x| x.span())),
        ];
        let rbd_keys = [
            ("pool", self.pool.as_ref().map(|x| x.span())),
            ("image", self.image.as_ref().map(|x| x.span())),
            ("namespace", self.namespace.as_ref().map(|x| x.span())),
            ("mon_host", self.mon_host.as_ref().map(|x| x.span())),
            ("user", self.user.as_ref().map(|x| x.span())),
            ("key_file", self.key_file.as_ref().map(|x| x.span())),
            ("cache", self.cache.as_ref().map(|x| x.span())),
            ("op_timeout_ms", self.op_timeout_ms.as_ref().map(|x| x.span())),
            ("networks", self.networks.as_ref().map(|x| x.span())),
            ("lock_break", self.lock_break.as_ref().map(|x| x.span())),
        ];
        let foreign =
            |keys: &[(&'static str, Option<std::ops::Range<usize>>)], owner: &str| match keys.iter().find(|(_, s)| s.is_some()) {
                Some((key, Some(span))) => Err(dev.key(span.clone(), key, format_args!(" only applies to type = \"{owner}\""))),
                _ => Ok(()),
            };
        if self.kind != BackendKind::File {
            foreign(&file_keys, "file")?;
        }
        if self.kind != BackendKind::Nbd {
            foreign(&nbd_keys, "nbd")?;
        }
        if self.kind != BackendKind::Rbd {
            foreign(&rbd_keys, "rbd")?;
        }
        if !matches!(self.kind, BackendKind::Nbd | BackendKind::Rbd) {
            foreign(&remote_keys, "nbd\" or \"rbd")?;
        }
        if !matches!(self.kind, BackendKind::File | BackendKind::Rbd) {
            foreign(&[("read_only", self.read_only.as_ref().map(|x| x.span()))], "file\" or \"rbd")?;
        }
        let vdev_keys = [
            ("card", self.card.as_ref().map(|x| x.span())),
            ("seed", self.seed.as_ref().map(|x| x.span())),
            ("wait", self.wait.as_ref().map(|x| x.span())),
        ];
        if self.kind != BackendKind::Vdev {
            foreign(&vdev_keys, "vdev")?;
        }
        match self.kind {
            BackendKind::File => self.validate_file(&dev),
            BackendKind::Nbd => self.validate_nbd(&dev),
            BackendKind::Rbd => self.validate_rbd(&dev),
            BackendKind::Vdev => self.validate_vdev(&dev),
            BackendKind::Ram | BackendKind::Null => dev.needs_size(),
        }
    }

    fn validate_file(&self, dev: &Owner<'_>) -> Result<(), ConfigError> {
        let Some(path) = &self.path else {
            return Err(dev.missing("path", "file"));
        };
        let p = path.get_ref();
        if !p.exists() {
            return Err(dev.key(path.span(), "path", format_args!(": {} does not exist", p.display())));
        }
        if self.format.as_ref().is_some_and(|f| *f.get_ref() == ImageFormat::Qcow2) {
            // The image says its size, and its metadata is read and written by
            // plain system calls on the page cache.
            let clash = [
                ("direct", self.direct.as_ref().filter(|d| *d.get_ref()).map(|x| x.span())),
                ("engine", self.engine.as_ref().filter(|e| *e.get_ref() == Engine::IoUring).map(|x| x.span())),
                ("size", dev.size.as_ref().map(|x| x.span())),
            ];
            if let Some((key, Some(span))) = clash.into_iter().find(|(_, s)| s.is_some()) {
                return Err(dev.error(
                    span,
                    format_args!(
                        "key `{}{key}` cannot be used with format = \"qcow2\" (the image \
                             gives the size; its I/O is buffered and synchronous)",
                        if key == "size" { "" } else { "backend." }
                    ),
                ));
            }
        }
        Ok(())
    }

    fn validate_nbd(&self, dev: &Owner<'_>) -> Result<(), ConfigError> {
        let Some(uri) = &self.uri else {
            return Err(dev.missing("uri", "nbd"));
        };
        if let Err(e) = parse_nbd_uri(uri.get_ref()) {
            return Err(dev.key(uri.span(), "uri", format_args!(": `{}`: {e}", uri.get_ref())));
        }
        self.check_timeouts(dev, false)
    }

    /// The remote's timeouts that are set lie in their ranges: connecting and reconnecting
    /// (nbd, rbd), and with `request` the one for a single request (rbd).
    fn check_timeouts(&self, dev: &Owner<'_>, request: bool) -> Result<(), ConfigError> {
        let request = request.then_some(("op_timeout_ms", &self.op_timeout_ms, 1000, 3_600_000));
        let keys = [
            ("connect_timeout_ms", &self.connect_timeout_ms, 10, 600_000),
            ("reconnect_timeout_ms", &self.reconnect_timeout_ms, 0, 86_400_000),
        ];
        for (key, v, lo, hi) in keys.into_iter().chain(request) {
            if let Some(v) = v {
                if !(lo..=hi).contains(v.get_ref()) {
                    return Err(dev.key(v.span(), key, format_args!(": {} is out of range {lo}..={hi}", v.get_ref())));
                }
            }
        }
        Ok(())
    }

    fn validate_rbd(&self, dev: &Owner<'_>) -> Result<(), ConfigError> {
        for (key, v) in [("pool", &self.pool), ("image", &self.image), ("mon_host", &self.mon_host)] {
            match v {
                None => return Err(dev.missing(key, "rbd")),
                Some(v) if v.get_ref().trim().is_empty() || v.get_ref().contains('\0') => {
                    return Err(dev.key(v.span(), key, " is empty"))
                }
                Some(_) => {}
            }
        }
        if let Some(m) = &self.mon_host {
            if let Err(e) = parse_mon_host(m.get_ref()) {
                return Err(dev.key(m.span(), "mon_host", format_args!(": {e}")));
            }
        }
        let Some(key) = &self.key_file else {
            return Err(dev.key(
                dev.at.clone(),
                "key_file",
                " is required for type = \"rbd\" (the file `ceph auth get-key` writes)",
            ));
        };
        if let Err(e) = std::fs::metadata(key.get_ref()) {
            return Err(dev.key(key.span(), "key_file", format_args!(": {}: {e}", key.get_ref().display())));
        }
        if let Some(n) = &self.networks {
            for net in n.get_ref() {
                if let Err(e) = parse_cidr(net) {
                    return Err(dev.key(n.span(), "networks", format_args!(": `{net}`: {e}")));
                }
            }
        }
        self.check_timeouts(dev, true)
    }

    fn validate_vdev(&self, dev: &Owner<'_>) -> Result<(), ConfigError> {
        match (&self.card, &self.seed) {
            (Some(_), Some(seed)) => {
                return Err(dev.error(seed.span(), "keys `backend.card` and `backend.seed` both name the card: give one"))
            }
            (None, None) => {
                return Err(dev.error(dev.at.clone(), "type = \"vdev\" needs `backend.card` (a card spec) or `backend.seed`"))
            }
            (Some(card), None) => {
                let p = card.get_ref();
                let text = std::fs::read_to_string(p)
                    .map_err(|e| dev.key(card.span(), "card", format_args!(": cannot read {}: {e}", p.display())))?;
                if let Err(e) = bulkhead_vdev::Card::from_json(&text) {
                    return Err(dev.key(card.span(), "card", format_args!(": {}: {e}", p.display())));
                }
            }
            (None, Some(_)) => {}
        }
        dev.needs_size()
    }
}
