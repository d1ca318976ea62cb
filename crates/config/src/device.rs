//! A `[[device]]` table: its queues, notification, restart policy, sandbox, tap mode, its
//! backend (`backend.rs`), filters (`filter.rs`) and views (`view.rs`).

use serde::de::{self, Deserializer};
use serde::Deserialize;
use toml::Spanned;

use crate::{
    check_allow, check_attach, valid_name, view, At, BackendKind, BackendTable, ConfigError, Filter, FilterTable, Size, View,
};

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
    /// Whether the device starts writing (default `true`). `false` starts it *inactive*, as
    /// the destination of a live migration does: opened and exported, its storage read-only
    /// and every write refused, until `bulkhead device activate` (docs/vm.md, "Live
    /// migration"). Where it starts only: `reload` leaves a running device as it is.
    pub active: Option<Spanned<bool>>,
}

/// Queues applications may attach to a device or a view unless its `attach` says otherwise.
pub const DEFAULT_ATTACH: u32 = 4;

/// Most queues `attach` may give a device or a view.
pub const MAX_ATTACH: u32 = 64;

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

    /// Whether the device starts writing (`active`, default `true`).
    pub fn starts_active(&self) -> bool {
        self.active.as_ref().is_none_or(|a| *a.get_ref())
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

impl DeviceConfig {
    /// The keys of a device that may change on a running `serve` (`bulkhead reload`): its tap
    /// mode, its filters that do not transform the data, and its views (added, removed, and
    /// their [`View::LIVE`] keys). `active` says where a device starts, so a reload leaves a
    /// running device active or not as it is (`bulkhead device activate` changes it). A change
    /// to any other key is refused, naming it.
    pub const LIVE: [&'static str; 4] = ["tap", "filter", "view", "active"];

    pub(crate) fn validate(&self, err: &At<'_>) -> Result<(), ConfigError> {
        let d = self;
        let name = d.name.get_ref();
        if !valid_name(name) {
            return Err(err(
                d.name.span(),
                format!("key `name`: `{name}` is not a valid device name (1-64 of A-Z a-z 0-9 - _ ., not starting with .)"),
            ));
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
        self.backend.validate(name, &self.name, self.size.as_ref(), err)?;
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
        if let Some(a) = d.active.as_ref().filter(|a| !*a.get_ref()) {
            let local = match d.backend.kind {
                BackendKind::Ram => Some("a ram device's contents stay in this serve"),
                BackendKind::Null => Some("a null device holds nothing to hand over"),
                BackendKind::Vdev => Some("a vdev device's disk model runs in this serve"),
                _ => None,
            };
            if let Some(why) = local {
                return Err(err(
                    a.span(),
                    format!(
                        "device `{name}`: key `active`: false is for storage another host reaches too (file, rbd, nbd): {why}"
                    ),
                ));
            }
            if let Some(i) = d.filters.iter().position(|f| *f.kind.get_ref() == crate::FilterKind::Cow) {
                return Err(err(
                    a.span(),
                    format!(
                        "device `{name}`: key `active`: false cannot go with filter {} (cow): its overlay is this host's, \
                         written as the device opens",
                        i + 1
                    ),
                ));
            }
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
        Ok(())
    }
}
