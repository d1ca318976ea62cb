//! `[[device.filter]]` tables: the filters of a device's chain, frontend side first.

use std::ops::Range;
use std::path::PathBuf;

use bulkhead_diskmodel::sched::{Policy, Tuning};
use bulkhead_diskmodel::CacheGeometry;
use bulkhead_filters::error::{ErrorRule, ERRNOS};
use bulkhead_filters::throttle::{Limit, Limits};
use bulkhead_filters::vpt::DriveSpec;
use bulkhead_filters::{FilterSpec, GuardMode, GuardSpec};
use serde::Deserialize;
use toml::Spanned;

use crate::Size;

/// Type of a filter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FilterKind {
    /// blktrace records of every request.
    Trace,
    /// Counts, bytes and latency histograms in `status`.
    Stats,
    /// A fixed delay per operation.
    Delay,
    /// Injected failures.
    Error,
    /// Bytes and operations per second.
    Throttle,
    /// A LUKS volume on the device below, opened with a key file.
    Crypt,
    /// Copy-on-write into a qcow2 overlay file, with snapshots.
    Cow,
    /// Completions held to a modelled disk's time.
    Vpt,
    /// A disk scheduler.
    Scheduler,
}

impl FilterKind {
    /// The configuration spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            FilterKind::Trace => "trace",
            FilterKind::Stats => "stats",
            FilterKind::Delay => "delay",
            FilterKind::Error => "error",
            FilterKind::Throttle => "throttle",
            FilterKind::Crypt => "crypt",
            FilterKind::Cow => "cow",
            FilterKind::Vpt => "vpt",
            FilterKind::Scheduler => "scheduler",
        }
    }
}

/// A `[[device.filter]]` table as written.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FilterTable {
    /// `type`.
    #[serde(rename = "type")]
    pub kind: Spanned<FilterKind>,
    /// `path` (trace): the trace file, created or truncated when the device starts.
    pub path: Option<Spanned<PathBuf>>,
    /// `delay_us` (delay): every operation.
    pub delay_us: Option<Spanned<u64>>,
    /// `read_us` (delay).
    pub read_us: Option<Spanned<u64>>,
    /// `write_us` (delay).
    pub write_us: Option<Spanned<u64>>,
    /// `flush_us` (delay).
    pub flush_us: Option<Spanned<u64>>,
    /// `discard_us` (delay).
    pub discard_us: Option<Spanned<u64>>,
    /// `write_zeroes_us` (delay).
    pub write_zeroes_us: Option<Spanned<u64>>,
    /// `ops` (error): operations that may fail (default: all).
    pub ops: Option<Spanned<Vec<String>>>,
    /// `offset` (error): start of the range that fails (default 0).
    pub offset: Option<Spanned<Size>>,
    /// `len` (error): its length (default: to the end).
    pub len: Option<Spanned<Size>>,
    /// `probability` (error): 0.0 to 1.0 (default 1.0).
    pub probability: Option<Spanned<f64>>,
    /// `after` (error): matching requests let through first.
    pub after: Option<Spanned<u64>>,
    /// `count` (error): failures at most.
    pub count: Option<Spanned<u64>>,
    /// `errno` (error): EIO, ENOSPC, EROFS, EINVAL or EOPNOTSUPP (default EIO).
    pub errno: Option<Spanned<String>>,
    /// `seed` (error): of the random choice.
    pub seed: Option<Spanned<u64>>,
    /// `bps` (throttle): bytes/s, reads and writes together.
    pub bps: Option<Spanned<Size>>,
    /// `bps_read` (throttle).
    pub bps_read: Option<Spanned<Size>>,
    /// `bps_write` (throttle).
    pub bps_write: Option<Spanned<Size>>,
    /// `iops` (throttle): operations/s together.
    pub iops: Option<Spanned<u64>>,
    /// `iops_read` (throttle).
    pub iops_read: Option<Spanned<u64>>,
    /// `iops_write` (throttle).
    pub iops_write: Option<Spanned<u64>>,
    /// `bps_max` (throttle): burst rate of `bps`.
    pub bps_max: Option<Spanned<Size>>,
    /// `bps_read_max` (throttle).
    pub bps_read_max: Option<Spanned<Size>>,
    /// `bps_write_max` (throttle).
    pub bps_write_max: Option<Spanned<Size>>,
    /// `iops_max` (throttle): burst rate of `iops`.
    pub iops_max: Option<Spanned<u64>>,
    /// `iops_read_max` (throttle).
    pub iops_read_max: Option<Spanned<u64>>,
    /// `iops_write_max` (throttle).
    pub iops_write_max: Option<Spanned<u64>>,
    /// `max_length` (throttle): seconds a burst may last (default 1).
    pub max_length: Option<Spanned<f64>>,
    /// `iops_size` (throttle): larger requests count as several operations.
    pub iops_size: Option<Spanned<Size>>,
    /// `key_file` (crypt): the file whose whole contents are the passphrase of a key slot.
    pub key_file: Option<Spanned<PathBuf>>,
    /// `overlay` (cow): the qcow2 file writes go to, created empty if missing.
    pub overlay: Option<Spanned<PathBuf>>,
    /// `cluster_size` (cow): of a new overlay (default 64k; 4k to 2M, a power of two).
    pub cluster_size: Option<Spanned<Size>>,
    /// `rpm` (vpt, scheduler): the modelled drive's rotation speed (default 15000).
    pub rpm: Option<Spanned<u64>>,
    /// `seek_ms` (vpt, scheduler): its full-stroke seek (default 7.5).
    pub seek_ms: Option<Spanned<f64>>,
    /// `transfer` (vpt, scheduler): its media rate, bytes/s (default 90M).
    pub transfer: Option<Spanned<Size>>,
    /// `cache` (vpt, scheduler): model the drive's read cache (default true).
    pub cache: Option<Spanned<bool>>,
    /// `cache_segments` (vpt, scheduler): default 64.
    pub cache_segments: Option<Spanned<u64>>,
    /// `cache_segment_sectors` (vpt, scheduler): default 221.
    pub cache_segment_sectors: Option<Spanned<u64>>,
    /// `cache_prefetch` (vpt, scheduler): sectors read ahead, default 64.
    pub cache_prefetch: Option<Spanned<u64>>,
    /// `cache_hit_us` (vpt, scheduler): service time of a hit, default 100.
    pub cache_hit_us: Option<Spanned<u64>>,
    /// `k` (vpt): scale of model time to real time to start with (default 1.0).
    pub k: Option<Spanned<f64>>,
    /// `lock_k` (vpt): keep `k` fixed (default false).
    pub lock_k: Option<Spanned<bool>>,
    /// `policy` (scheduler): fcfs, satf, opt, deadline or cats.
    pub policy: Option<Spanned<String>>,
    /// `depth` (scheduler): accesses in flight below at most (default 1).
    pub depth: Option<Spanned<u64>>,
    /// `expire_ms` (scheduler: satf, opt).
    pub expire_ms: Option<Spanned<u64>>,
    /// `read_expire_ms` (scheduler: deadline, cats).
    pub read_expire_ms: Option<Spanned<u64>>,
    /// `write_expire_ms` (scheduler: deadline).
    pub write_expire_ms: Option<Spanned<u64>>,
    /// `fifo_batch` (scheduler: deadline).
    pub fifo_batch: Option<Spanned<u64>>,
    /// `writes_starved` (scheduler: deadline).
    pub writes_starved: Option<Spanned<u64>>,
    /// `min_write_delay_ms` (scheduler: cats).
    pub min_write_delay_ms: Option<Spanned<u64>>,
    /// `max_write_delay_ms` (scheduler: cats).
    pub max_write_delay_ms: Option<Spanned<u64>>,
    /// `anticipate_ms` (scheduler: cats).
    pub anticipate_ms: Option<Spanned<u64>>,
    /// `guard` (any): `off`, `dwc` or `scdwc` write capture (default off).
    pub guard: Option<Spanned<String>>,
    /// `guard_cache` (with `guard = "scdwc"`): pages kept open, 0 to 256 (default 60).
    pub guard_cache: Option<Spanned<u64>>,
    /// `guard_keys` (with `guard`): also partition the domain's memory by x86 protection key,
    /// where the processor has them (default true).
    pub guard_keys: Option<Spanned<bool>>,
    /// `guard_pages` (with `guard = "scdwc"`): where protection keys do not gate a call, shut
    /// the other owners' open pages for it by page protection (default false).
    pub guard_pages: Option<Spanned<bool>>,
}

/// A resolved filter: what the domain gets, plus the trace file the supervisor opens for it.
#[derive(Debug, Clone, PartialEq)]
pub struct Filter {
    /// The filter (a trace's device number is set by the supervisor).
    pub spec: FilterSpec,
    /// The file the supervisor opens for it: a trace's output, a cow's overlay.
    pub path: Option<PathBuf>,
    /// The key file (crypt), read by the supervisor when the device starts.
    pub key_file: Option<PathBuf>,
    /// Write capture for it.
    pub guard: GuardSpec,
}

type Err<'a> = &'a dyn Fn(Range<usize>, String) -> crate::ConfigError;

/// A `'static` reference to a kind, for the table of which keys belong to which kinds.
fn kind_ref(kind: FilterKind) -> &'static FilterKind {
    use FilterKind::*;
    match kind {
        Trace => &Trace,
        Stats => &Stats,
        Delay => &Delay,
        Error => &Error,
        Throttle => &Throttle,
        Crypt => &Crypt,
        Cow => &Cow,
        Vpt => &Vpt,
        Scheduler => &Scheduler,
    }
}

impl FilterTable {
    /// Keys present, with their spans and the filter types they belong to.
    fn keys(&self) -> Vec<(&'static str, Range<usize>, &'static [FilterKind])> {
        use FilterKind::*;
        let mut v = Vec::new();
        let mut owned = |name: &'static str, span: Option<Range<usize>>, kinds: &'static [FilterKind]| {
            if let Some(s) = span {
                v.push((name, s, kinds));
            }
        };
        for (name, span) in [
            ("rpm", self.rpm.as_ref().map(Spanned::span)),
            ("seek_ms", self.seek_ms.as_ref().map(Spanned::span)),
            ("transfer", self.transfer.as_ref().map(Spanned::span)),
            ("cache", self.cache.as_ref().map(Spanned::span)),
            ("cache_segments", self.cache_segments.as_ref().map(Spanned::span)),
            ("cache_segment_sectors", self.cache_segment_sectors.as_ref().map(Spanned::span)),
            ("cache_prefetch", self.cache_prefetch.as_ref().map(Spanned::span)),
            ("cache_hit_us", self.cache_hit_us.as_ref().map(Spanned::span)),
        ] {
            owned(name, span, &[Vpt, Scheduler]);
        }
        owned("k", self.k.as_ref().map(Spanned::span), &[Vpt]);
        owned("lock_k", self.lock_k.as_ref().map(Spanned::span), &[Vpt]);
        for (name, span) in [
            ("policy", self.policy.as_ref().map(Spanned::span)),
            ("depth", self.depth.as_ref().map(Spanned::span)),
            ("expire_ms", self.expire_ms.as_ref().map(Spanned::span)),
            ("read_expire_ms", self.read_expire_ms.as_ref().map(Spanned::span)),
            ("write_expire_ms", self.write_expire_ms.as_ref().map(Spanned::span)),
            ("fifo_batch", self.fifo_batch.as_ref().map(Spanned::span)),
            ("writes_starved", self.writes_starved.as_ref().map(Spanned::span)),
            ("min_write_delay_ms", self.min_write_delay_ms.as_ref().map(Spanned::span)),
            ("max_write_delay_ms", self.max_write_delay_ms.as_ref().map(Spanned::span)),
            ("anticipate_ms", self.anticipate_ms.as_ref().map(Spanned::span)),
        ] {
            owned(name, span, &[Scheduler]);
        }
        let mut k = |name: &'static str, span: Option<Range<usize>>, kind: FilterKind| {
            if let Some(s) = span {
                v.push((name, s, std::slice::from_ref(kind_ref(kind))));
            }
        };
        k("path", self.path.as_ref().map(Spanned::span), Trace);
        for (name, x) in [
            ("delay_us", &self.delay_us),
            ("read_us", &self.read_us),
            ("write_us", &self.write_us),
            ("flush_us", &self.flush_us),
            ("discard_us", &self.discard_us),
            ("write_zeroes_us", &self.write_zeroes_us),
        ] {
            k(name, x.as_ref().map(Spanned::span), Delay);
        }
        k("ops", self.ops.as_ref().map(Spanned::span), Error);
        k("offset", self.offset.as_ref().map(Spanned::span), Error);
        k("len", self.len.as_ref().map(Spanned::span), Error);
        k("probability", self.probability.as_ref().map(Spanned::span), Error);
        k("after", self.after.as_ref().map(Spanned::span), Error);
        k("count", self.count.as_ref().map(Spanned::span), Error);
        k("errno", self.errno.as_ref().map(Spanned::span), Error);
        k("seed", self.seed.as_ref().map(Spanned::span), Error);
        for (name, x) in [("bps", &self.bps), ("bps_read", &self.bps_read), ("bps_write", &self.bps_write)] {
            k(name, x.as_ref().map(Spanned::span), Throttle);
        }
        for (name, x) in
            [("bps_max", &self.bps_max), ("bps_read_max", &self.bps_read_max), ("bps_write_max", &self.bps_write_max)]
        {
            k(name, x.as_ref().map(Spanned::span), Throttle);
        }
        for (name, x) in [("iops", &self.iops), ("iops_read", &self.iops_read), ("iops_write", &self.iops_write)] {
            k(name, x.as_ref().map(Spanned::span), Throttle);
        }
        for (name, x) in
            [("iops_max", &self.iops_max), ("iops_read_max", &self.iops_read_max), ("iops_write_max", &self.iops_write_max)]
        {
            k(name, x.as_ref().map(Spanned::span), Throttle);
        }
        k("max_length", self.max_length.as_ref().map(Spanned::span), Throttle);
        k("iops_size", self.iops_size.as_ref().map(Spanned::span), Throttle);
        k("key_file", self.key_file.as_ref().map(Spanned::span), Crypt);
        k("overlay", self.overlay.as_ref().map(Spanned::span), Cow);
        k("cluster_size", self.cluster_size.as_ref().map(Spanned::span), Cow);
        v
    }

    /// Validates the table and resolves it. `device` and `index` name it in errors; a delay
    /// must stay under the device's `watchdog_ms`, or the watchdog would take the held
    /// requests for a wedged domain.
    pub(crate) fn resolve(
        &self,
        device: &str,
        index: usize,
        watchdog_ms: u64,
        err: Err<'_>,
    ) -> Result<Filter, crate::ConfigError> {
        let mut f = self.resolve_kind(device, index, watchdog_ms, err)?;
        f.guard = self.guard_spec(device, index, err)?;
        Ok(f)
    }

    /// `guard`, `guard_cache`, `guard_keys` and `guard_pages`, which apply to every type.
    fn guard_spec(&self, device: &str, index: usize, err: Err<'_>) -> Result<GuardSpec, crate::ConfigError> {
        let kind = self.kind.get_ref().as_str();
        let at = |key: &str| format!("device `{device}`: filter {} ({kind}): key `filter.{key}`", index + 1);
        let mode = match self.guard.as_ref().map(|g| (g.get_ref().as_str(), g.span())) {
            None | Some(("off", _)) => GuardMode::Off,
            Some(("dwc", _)) => GuardMode::Dwc,
            Some(("scdwc", _)) => {
                let cache = match &self.guard_cache {
                    None => 60,
                    Some(c) if *c.get_ref() <= bulkhead_guard::shadow::MAX_CACHE as u64 => *c.get_ref() as u32,
                    Some(c) => {
                        let most = bulkhead_guard::shadow::MAX_CACHE;
                        return Err(err(c.span(), format!("{}: {} is out of range 0..={most}", at("guard_cache"), c.get_ref())));
                    }
                };
                GuardMode::Scdwc { cache }
            }
            Some((other, span)) => {
                return Err(err(span, format!("{}: `{other}` is not one of off, dwc, scdwc", at("guard"))));
            }
        };
        if let (Some(c), false) = (&self.guard_cache, matches!(mode, GuardMode::Scdwc { .. })) {
            return Err(err(c.span(), format!("{} only applies with guard = \"scdwc\"", at("guard_cache"))));
        }
        let keys = match (&self.guard_keys, mode) {
            (Some(k), GuardMode::Off) => {
                return Err(err(k.span(), format!("{} only applies with guard = \"dwc\" or \"scdwc\"", at("guard_keys"))));
            }
            (Some(k), _) => *k.get_ref(),
            (None, mode) => mode != GuardMode::Off,
        };
        let pages = match (&self.guard_pages, mode) {
            (Some(p), GuardMode::Scdwc { .. }) => *p.get_ref(),
            (Some(p), _) => {
                return Err(err(p.span(), format!("{} only applies with guard = \"scdwc\"", at("guard_pages"))));
            }
            (None, _) => false,
        };
        Ok(GuardSpec { mode, keys, pages })
    }

    fn resolve_kind(&self, device: &str, index: usize, watchdog_ms: u64, err: Err<'_>) -> Result<Filter, crate::ConfigError> {
        let kind = *self.kind.get_ref();
        let at = |key: &str| format!("device `{device}`: filter {} ({}): key `filter.{key}`", index + 1, kind.as_str());
        for (key, span, owners) in self.keys() {
            if !owners.contains(&kind) {
                let names: Vec<String> = owners.iter().map(|o| format!("type = \"{}\"", o.as_str())).collect();
                return Err(err(span, format!("{} only applies to {}", at(key), names.join(" or "))));
            }
        }
        let spec = match kind {
            FilterKind::Trace => {
                let Some(path) = &self.path else {
                    return Err(err(self.kind.span(), format!("{} is required for type = \"trace\"", at("path"))));
                };
                let parent = path.get_ref().parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(std::path::Path::new("."));
                if !parent.is_dir() {
                    return Err(err(path.span(), format!("{}: directory {} does not exist", at("path"), parent.display())));
                }
                return Ok(Filter {
                    spec: FilterSpec::Trace { device_number: 0 },
                    path: Some(path.get_ref().clone()),
                    key_file: None,
                    guard: GuardSpec::default(),
                });
            }
            FilterKind::Stats => FilterSpec::Stats {},
            FilterKind::Delay => {
                let all = self.delay_us.as_ref().map(|d| *d.get_ref()).unwrap_or(0);
                let mut delay_us = [all; 5];
                for (i, (key, v)) in [
                    ("read_us", &self.read_us),
                    ("write_us", &self.write_us),
                    ("flush_us", &self.flush_us),
                    ("discard_us", &self.discard_us),
                    ("write_zeroes_us", &self.write_zeroes_us),
                ]
                .into_iter()
                .enumerate()
                {
                    if let Some(v) = v {
                        delay_us[i] = *v.get_ref();
                    }
                    let limit_us = watchdog_ms.saturating_mul(1000) / 2;
                    if delay_us[i] > limit_us {
                        let (span, key) = match v {
                            Some(v) => (v.span(), key),
                            None => (self.delay_us.as_ref().map_or(self.kind.span(), Spanned::span), "delay_us"),
                        };
                        return Err(err(
                            span,
                            format!(
                                "{}: {} µs is more than half the device's watchdog_ms ({watchdog_ms} ms); raise watchdog_ms",
                                at(key),
                                delay_us[i]
                            ),
                        ));
                    }
                }
                if delay_us.iter().all(|&d| d == 0) {
                    return Err(err(
                        self.kind.span(),
                        format!("device `{device}`: filter {} (delay): set delay_us or a per-operation delay", index + 1),
                    ));
                }
                FilterSpec::Delay { delay_us }
            }
            FilterKind::Error => FilterSpec::Error { rule: self.error_rule(&at, err)? },
            FilterKind::Throttle => FilterSpec::Throttle { limits: self.limits(&at, err)? },
            FilterKind::Vpt => {
                let k = match &self.k {
                    None => 1.0,
                    Some(k) if k.get_ref().is_finite() && (0.001..=10_000.0).contains(k.get_ref()) => *k.get_ref(),
                    Some(k) => return Err(err(k.span(), format!("{}: {} is out of range 0.001..=10000", at("k"), k.get_ref()))),
                };
                FilterSpec::Vpt { drive: self.drive(&at, err)?, k, lock_k: self.lock_k.as_ref().is_some_and(|l| *l.get_ref()) }
            }
            FilterKind::Scheduler => self.scheduler(&at, err)?,
            FilterKind::Crypt => {
                let Some(key) = &self.key_file else {
                    return Err(err(self.kind.span(), format!("{} is required for type = \"crypt\"", at("key_file"))));
                };
                if !key.get_ref().is_file() {
                    return Err(err(key.span(), format!("{}: {} is not a file", at("key_file"), key.get_ref().display())));
                }
                // Where the volume's data starts and how much there is: read from its header
                // by the supervisor when the device starts.
                let spec = FilterSpec::Crypt { payload_offset: 0, data_size: 0, sector_size: 512 };
                return Ok(Filter { spec, path: None, key_file: Some(key.get_ref().clone()), guard: GuardSpec::default() });
            }
            FilterKind::Cow => {
                let Some(overlay) = &self.overlay else {
                    return Err(err(self.kind.span(), format!("{} is required for type = \"cow\"", at("overlay"))));
                };
                let p = overlay.get_ref();
                let parent = p.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(std::path::Path::new("."));
                if !parent.is_dir() {
                    return Err(err(overlay.span(), format!("{}: directory {} does not exist", at("overlay"), parent.display())));
                }
                let cluster_bits = match &self.cluster_size {
                    None => 16,
                    Some(c) => {
                        let v = c.get_ref().0;
                        if !v.is_power_of_two() || !(4096..=2 << 20).contains(&v) {
                            return Err(err(
                                c.span(),
                                format!("{}: {v} is not a power of two from 4k to 2M", at("cluster_size")),
                            ));
                        }
                        v.trailing_zeros()
                    }
                };
                // An overlay that exists keeps its own cluster size: the supervisor reads it.
                let spec = FilterSpec::Cow { cluster_bits, op: None };
                return Ok(Filter { spec, path: Some(p.clone()), key_file: None, guard: GuardSpec::default() });
            }
        };
        Ok(Filter { spec, path: None, key_file: None, guard: GuardSpec::default() })
    }

    /// The modelled drive of a vpt or scheduler.
    fn drive(&self, at: &dyn Fn(&str) -> String, err: Err<'_>) -> Result<DriveSpec, crate::ConfigError> {
        let seed = DriveSpec::seed();
        let rotation_ns = match &self.rpm {
            None => seed.rotation_ns,
            Some(r) if (1_000..=100_000).contains(r.get_ref()) => 60_000_000_000 / *r.get_ref(),
            Some(r) => return Err(err(r.span(), format!("{}: {} is out of range 1000..=100000", at("rpm"), r.get_ref()))),
        };
        let full_seek_ns = match &self.seek_ms {
            None => seed.full_seek_ns,
            Some(s) if s.get_ref().is_finite() && (0.0..=1000.0).contains(s.get_ref()) => (*s.get_ref() * 1e6) as u64,
            Some(s) => return Err(err(s.span(), format!("{}: {} is out of range 0..=1000 ms", at("seek_ms"), s.get_ref()))),
        };
        let transfer_bps = match &self.transfer {
            None => seed.transfer_bps,
            Some(t) if t.get_ref().0 >= 1 << 20 => t.get_ref().0,
            Some(t) => return Err(err(t.span(), format!("{}: {} bytes/s is below 1M", at("transfer"), t.get_ref().0))),
        };
        let geometry = seed.cache.expect("the seed's drive has a cache");
        let num = |key: &str, v: &Option<Spanned<u64>>, default: u64, range: std::ops::RangeInclusive<u64>| match v {
            None => Ok(default),
            Some(x) if range.contains(x.get_ref()) => Ok(*x.get_ref()),
            Some(x) => {
                Err(err(x.span(), format!("{}: {} is out of range {}..={}", at(key), x.get_ref(), range.start(), range.end())))
            }
        };
        let segments = num("cache_segments", &self.cache_segments, geometry.segments as u64, 1..=65_536)?;
        let segment_sectors =
            num("cache_segment_sectors", &self.cache_segment_sectors, geometry.segment_sectors as u64, 1..=1 << 20)?;
        let prefetch = num("cache_prefetch", &self.cache_prefetch, geometry.prefetch_sectors as u64, 0..=1 << 20)?;
        let hit_us = num("cache_hit_us", &self.cache_hit_us, geometry.hit_ns / 1000, 0..=1_000_000)?;
        let cache = self.cache.as_ref().is_none_or(|c| *c.get_ref()).then_some(CacheGeometry {
            segments: segments as u32,
            segment_sectors: segment_sectors as u32,
            prefetch_sectors: prefetch as u32,
            hit_ns: hit_us * 1000,
        });
        Ok(DriveSpec { rotation_ns, full_seek_ns, transfer_bps, cache })
    }

    fn scheduler(&self, at: &dyn Fn(&str) -> String, err: Err<'_>) -> Result<FilterSpec, crate::ConfigError> {
        let Some(p) = &self.policy else {
            return Err(err(self.kind.span(), format!("{} is required for type = \"scheduler\"", at("policy"))));
        };
        let Some(policy) = Policy::parse(p.get_ref()) else {
            return Err(err(
                p.span(),
                format!("{}: `{}` is not one of fcfs, satf, opt, deadline, cats", at("policy"), p.get_ref()),
            ));
        };
        let d = Tuning::default();
        let ms = |key: &str, v: &Option<Spanned<u64>>, default_ns: u64| match v {
            None => Ok(default_ns),
            Some(x) if (1..=600_000).contains(x.get_ref()) => Ok(*x.get_ref() * 1_000_000),
            Some(x) => Err(err(x.span(), format!("{}: {} is out of range 1..=600000 ms", at(key), x.get_ref()))),
        };
        let count = |key: &str, v: &Option<Spanned<u64>>, default: u32| match v {
            None => Ok(default),
            Some(x) if (1..=1024).contains(x.get_ref()) => Ok(*x.get_ref() as u32),
            Some(x) => Err(err(x.span(), format!("{}: {} is out of range 1..=1024", at(key), x.get_ref()))),
        };
        let anticipate_ns = match &self.anticipate_ms {
            None => d.anticipate_ns,
            Some(x) if *x.get_ref() <= 1000 => *x.get_ref() * 1_000_000,
            Some(x) => {
                return Err(err(x.span(), format!("{}: {} is out of range 0..=1000 ms", at("anticipate_ms"), x.get_ref())))
            }
        };
        let tuning = Tuning {
            expire_ns: ms("expire_ms", &self.expire_ms, d.expire_ns)?,
            read_expire_ns: ms("read_expire_ms", &self.read_expire_ms, d.read_expire_ns)?,
            write_expire_ns: ms("write_expire_ms", &self.write_expire_ms, d.write_expire_ns)?,
            fifo_batch: count("fifo_batch", &self.fifo_batch, d.fifo_batch)?,
            writes_starved: count("writes_starved", &self.writes_starved, d.writes_starved)?,
            min_write_delay_ns: ms("min_write_delay_ms", &self.min_write_delay_ms, d.min_write_delay_ns)?,
            max_write_delay_ns: ms("max_write_delay_ms", &self.max_write_delay_ms, d.max_write_delay_ns)?,
            anticipate_ns,
            ..d
        };
        if tuning.max_write_delay_ns < tuning.min_write_delay_ns {
            let span =
                self.max_write_delay_ms.as_ref().or(self.min_write_delay_ms.as_ref()).map_or(self.kind.span(), Spanned::span);
            return Err(err(span, format!("{} is below min_write_delay_ms", at("max_write_delay_ms"))));
        }
        let depth = count("depth", &self.depth, 1)?;
        Ok(FilterSpec::Scheduler { policy, depth, drive: self.drive(at, err)?, tuning })
    }

    fn error_rule(&self, at: &dyn Fn(&str) -> String, err: Err<'_>) -> Result<ErrorRule, crate::ConfigError> {
        let ops = match &self.ops {
            None => 0b1_1111,
            Some(list) => {
                let mut m = 0u8;
                for name in list.get_ref() {
                    let Some(op) = bulkhead_block::Op::parse(name) else {
                        return Err(err(
                            list.span(),
                            format!("{}: unknown operation `{name}` (read, write, flush, discard, write_zeroes)", at("ops")),
                        ));
                    };
                    m |= 1 << op.index();
                }
                if m == 0 {
                    return Err(err(list.span(), format!("{}: names no operation", at("ops"))));
                }
                m
            }
        };
        let probability = self.probability.as_ref().map(|p| (*p.get_ref(), p.span()));
        if let Some((p, span)) = &probability {
            if !(0.0..=1.0).contains(p) {
                return Err(err(span.clone(), format!("{}: {p} is not between 0.0 and 1.0", at("probability"))));
            }
        }
        let errno = match &self.errno {
            None => 5,
            Some(e) => match ERRNOS.iter().find(|(n, _)| n.eq_ignore_ascii_case(e.get_ref())) {
                Some((_, v)) => *v,
                None => {
                    let names: Vec<_> = ERRNOS.iter().map(|(n, _)| *n).collect();
                    return Err(err(e.span(), format!("{}: `{}` is not one of {}", at("errno"), e.get_ref(), names.join(", "))));
                }
            },
        };
        Ok(ErrorRule {
            ops,
            offset: self.offset.as_ref().map_or(0, |o| o.get_ref().0),
            len: self.len.as_ref().map_or(u64::MAX, |l| l.get_ref().0),
            probability_ppm: probability.map_or(1_000_000, |(p, _)| (p * 1e6).round() as u32),
            after: self.after.as_ref().map_or(0, |a| *a.get_ref()),
            count: self.count.as_ref().map(|c| *c.get_ref()),
            errno,
            seed: self.seed.as_ref().map_or(0x5eed, |s| *s.get_ref()),
        })
    }

    fn limits(&self, at: &dyn Fn(&str) -> String, err: Err<'_>) -> Result<Limits, crate::ConfigError> {
        let max_length = match &self.max_length {
            None => 1.0,
            Some(m) if (1.0..=86_400.0).contains(m.get_ref()) => *m.get_ref(),
            Some(m) => {
                return Err(err(m.span(), format!("{}: {} is out of range 1..=86400 seconds", at("max_length"), m.get_ref())))
            }
        };
        let limit = |avg_key: &str,
                     avg: Option<(u64, Range<usize>)>,
                     max_key: &str,
                     max: Option<(u64, Range<usize>)>|
         -> Result<Option<Limit>, crate::ConfigError> {
            match (avg, max) {
                (None, None) => Ok(None),
                (None, Some((_, span))) => Err(err(span, format!("{} needs `{avg_key}` as well", at(max_key)))),
                (Some((0, span)), _) => Err(err(span, format!("{}: must be positive", at(avg_key)))),
                (Some((a, _)), Some((m, span))) if m < a => {
                    Err(err(span, format!("{}: {m} is below the average rate `{avg_key}` = {a}", at(max_key))))
                }
                (Some((a, _)), m) => Ok(Some(Limit { avg: a as f64, max: m.map_or(0.0, |m| m.0 as f64), max_length })),
            }
        };
        let sz = |x: &Option<Spanned<Size>>| x.as_ref().map(|v| (v.get_ref().0, v.span()));
        let n = |x: &Option<Spanned<u64>>| x.as_ref().map(|v| (*v.get_ref(), v.span()));
        let limits = Limits {
            bps_total: limit("bps", sz(&self.bps), "bps_max", sz(&self.bps_max))?,
            bps_read: limit("bps_read", sz(&self.bps_read), "bps_read_max", sz(&self.bps_read_max))?,
            bps_write: limit("bps_write", sz(&self.bps_write), "bps_write_max", sz(&self.bps_write_max))?,
            iops_total: limit("iops", n(&self.iops), "iops_max", n(&self.iops_max))?,
            iops_read: limit("iops_read", n(&self.iops_read), "iops_read_max", n(&self.iops_read_max))?,
            iops_write: limit("iops_write", n(&self.iops_write), "iops_write_max", n(&self.iops_write_max))?,
            iops_size: self.iops_size.as_ref().map_or(0, |s| s.get_ref().0),
        };
        if [limits.bps_total, limits.bps_read, limits.bps_write, limits.iops_total, limits.iops_read, limits.iops_write]
            .iter()
            .all(Option::is_none)
        {
            return Err(err(
                self.kind.span(),
                format!("{}: set at least one of bps, iops and their _read/_write forms", at("type")),
            ));
        }
        Ok(limits)
    }
}
