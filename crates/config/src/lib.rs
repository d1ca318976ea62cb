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

mod backend;
mod device;
mod filter;
mod sections;
mod view;

pub use backend::{
    parse_cidr, parse_mon_host, parse_nbd_uri, BackendConfig, BackendKind, BackendTable, Engine, ImageFormat, NbdTarget,
    VdevCard, VdevWait, NBD_DEFAULT_PORT, RBD_OP_TIMEOUT_MS,
};
pub use device::{DeviceConfig, Notify, Sandbox, SpinBudget, Tap, DEFAULT_ATTACH, MAX_ATTACH};
pub use filter::{Filter, FilterKind, FilterTable};
pub use sections::{
    Control, Domains, Fuse, FuseUring, Keeper, Log, LogLevel, Metrics, MetricsListen, Nbd, NbdTls, Ublk, VhostUser,
};
pub use view::View;

/// Makes the error of a key at a span of the text: the file and the line it is on.
pub(crate) type At<'a> = dyn Fn(std::ops::Range<usize>, String) -> ConfigError + 'a;

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

/// The whole configuration.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Where `serve` keeps its exports, sockets and lock, unless `--run-dir` or
    /// `BULKHEAD_RUN_DIR` says otherwise (a top-level key, before the first table).
    #[serde(default)]
    pub run_dir: Option<Spanned<PathBuf>>,
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
    /// ublk export settings.
    #[serde(default)]
    pub ublk: Ublk,
    /// The keeper of `serve`'s descriptors.
    #[serde(default)]
    pub keeper: Keeper,
    /// The spare domains kept ready.
    #[serde(default)]
    pub domains: Domains,
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
/// stand at position `index`: what `bulkhead filter add DEVICE` sends. Errors name the key and
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
    /// The top-level keys that may change on a running `serve` (`bulkhead reload`): the
    /// devices, each as [`DeviceConfig::LIVE`] says. Every other section shapes `serve` itself
    /// (its exports, sockets, logging): a change to it is refused, naming the key.
    pub const LIVE: [&'static str; 1] = ["device"];

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
        if let Some(dir) = &self.run_dir {
            if dir.get_ref().as_os_str().is_empty() {
                return Err(err(dir.span(), "key `run_dir`: give a directory".to_string()));
            }
        }
        self.fuse.validate(&err)?;
        self.nbd.validate(&err)?;
        self.keeper.validate(&err)?;
        self.domains.validate(&err)?;
        if self.keeper.enabled && self.fuse.io_uring == FuseUring::On {
            let line = src.lines().position(|l| l.trim_start().starts_with("io_uring")).map_or(1, |i| i + 1);
            return Err(ConfigError::Invalid {
                origin: origin.to_string(),
                line,
                message: "key `fuse.io_uring`: \"on\" cannot be kept across a crash of serve (the kernel does not send a dead ring's requests again); with `keeper.enabled` use \"auto\" or \"off\"".into(),
            });
        }
        self.metrics.validate(&err)?;
        // Devices and views share one namespace: each is an export of its own.
        let mut names = std::collections::HashSet::new();
        for d in &self.devices {
            d.validate(&err)?;
            let name = d.name.get_ref();
            if !names.insert(name.clone()) {
                return Err(err(d.name.span(), format!("key `name`: device `{name}` is defined twice")));
            }
        }
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
        self.ublk.validate(&names, &err)?;
        Ok(())
    }

    /// Whether the ublk export serves device or view `name`.
    pub fn ublk_exports(&self, name: &str) -> bool {
        self.ublk.enabled && self.ublk.devices.as_ref().is_none_or(|l| l.get_ref().iter().any(|n| n == name))
    }

    /// The numbers the configuration fixes for the ublk export, by device or view.
    pub fn ublk_numbers(&self) -> Vec<(String, u32)> {
        self.ublk.numbers.as_ref().map(|m| m.get_ref().iter().map(|(k, v)| (k.clone(), *v)).collect()).unwrap_or_default()
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
    fn domains_spares_and_standbys_default_and_name_their_line_when_out_of_range() {
        let ram = "[[device]]\nname = \"m\"\nsize = \"1M\"\n[device.backend]\ntype = \"ram\"\n";
        let cfg = parse(ram).unwrap();
        assert_eq!((*cfg.domains.spares.get_ref(), *cfg.domains.standbys.get_ref()), (2, 4));
        let cfg = parse(&format!("[domains]\nspares = 3\nstandbys = 0\n{ram}")).unwrap();
        assert_eq!((*cfg.domains.spares.get_ref(), *cfg.domains.standbys.get_ref()), (3, 0));
        let e = parse(&format!("[domains]\nspares = 1\nstandbys = 65\n{ram}")).unwrap_err().to_string();
        assert!(e.contains("`domains.standbys`") && e.contains("65") && e.contains("line 3"), "{e}");
        let e = parse(&format!("[domains]\nstandby = 1\n{ram}")).unwrap_err().to_string();
        assert!(e.contains("standby") && e.contains("line 2"), "{e}");
    }

    #[test]
    fn active_false_is_for_storage_another_host_reaches_and_names_its_line() {
        let file = |extra: &str| {
            format!("[[device]]\nname = \"f\"\nactive = false\n[device.backend]\ntype = \"file\"\npath = \"/dev/null\"\n{extra}")
        };
        let cfg = parse(&file("")).unwrap();
        assert!(!cfg.devices[0].starts_active());
        assert!(parse(&file("").replace("active = false\n", "")).unwrap().devices[0].starts_active());
        let ram = "[[device]]\nname = \"m\"\nsize = \"1M\"\nactive = false\n[device.backend]\ntype = \"ram\"\n";
        let e = parse(ram).unwrap_err().to_string();
        assert!(e.contains("key `active`") && e.contains("line 4") && e.contains("ram device"), "{e}");
        let cow = file("[[device.filter]]\ntype = \"cow\"\noverlay = \"/tmp/o.qcow2\"\n");
        let e = parse(&cow).unwrap_err().to_string();
        assert!(e.contains("key `active`") && e.contains("filter 1 (cow)"), "{e}");
        let e = parse(&file("").replace("active = false", "active = \"no\"")).unwrap_err().to_string();
        assert!(e.contains("active"), "{e}");
    }

    #[test]
    fn ublk_lists_known_devices_and_gives_distinct_numbers_in_range() {
        let base = "[[device]]\nname = \"a\"\nsize = \"16M\"\n[device.backend]\ntype = \"ram\"\n[[device.view]]\nname = \"a-ro\"\nread_only = true\n";
        let off = parse(base).unwrap();
        assert!(!off.ublk_exports("a") && off.ublk_numbers().is_empty());
        let all = parse(&format!("[ublk]\nenabled = true\nnumbers = {{ a = 3 }}\n{base}")).unwrap();
        assert!(all.ublk_exports("a") && all.ublk_exports("a-ro"));
        assert_eq!(all.ublk_numbers(), vec![("a".to_string(), 3)]);
        assert_eq!(*all.ublk.depth.get_ref(), 128);
        let some = parse(&format!("[ublk]\nenabled = true\ndevices = [\"a-ro\"]\n{base}")).unwrap();
        assert!(!some.ublk_exports("a") && some.ublk_exports("a-ro"));
        for (section, want) in [
            ("devices = [\"b\"]", "key `ublk.devices`: no device or view is named `b`"),
            ("numbers = { b = 1 }", "key `ublk.numbers`: no device or view is named `b`"),
            ("numbers = { a = 2, a-ro = 2 }", "both have number 2"),
            ("numbers = { a = 1048576 }", "out of range 0..=1048575"),
            ("depth = 0", "key `ublk.depth`: 0 is out of range 1..=4096"),
            ("enable = true", "unknown field `enable`"),
        ] {
            let e = parse(&format!("[ublk]\nenabled = true\n{section}\n{base}")).unwrap_err().to_string();
            assert!(e.contains(want), "{section}: {e}");
            if !section.starts_with("enable ") {
                assert!(e.contains("line 3"), "{section}: {e}");
            }
        }
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
            ("type = \"stats\"\nguard = \"dwc\"\nguard_pages = true\n", "guard_pages` only applies with guard = \"scdwc\"", 9),
            ("type = \"stats\"\nguard = \"scdwc\"\nguard_pages = 1\n", "guard_pages", 9),
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
        let f = parse_filter("type = \"stats\"\nguard = \"scdwc\"\n", "d", 0, 5000).unwrap();
        assert!(!f.guard.pages, "the page gate is off unless asked for");
        let f = parse_filter("type = \"stats\"\nguard = \"scdwc\"\nguard_pages = true\n", "d", 0, 5000).unwrap();
        assert!(f.guard.pages && f.guard.keys);
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
