//! What the supervisor tells a domain about each filter, and building the layer from it.

use std::os::fd::{AsRawFd, OwnedFd};

use bulkhead_block::Layer;
use serde::{Deserialize, Serialize};

use crate::error::ErrorRule;
use crate::state::StatePage;
use crate::throttle::Limits;
use crate::FilterError;

/// One filter of a chain, as the domain receives it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum FilterSpec {
    /// blktrace records to the output descriptor.
    Trace {
        /// Device number stamped on every record.
        device_number: u32,
    },
    /// Counters and latency histograms in the state page.
    Stats {},
    /// A delay per operation, µs, by [`bulkhead_block::Op::index`].
    Delay {
        /// The delays.
        delay_us: [u64; 5],
    },
    /// Injected failures.
    Error {
        /// Which requests fail, and how.
        rule: ErrorRule,
    },
    /// Rate limits.
    Throttle {
        /// The limits.
        limits: Limits,
    },
    /// A LUKS volume below, as its header was when the device started; the passphrase comes
    /// as a descriptor of its own, never in the spec.
    Crypt {
        /// Where the data starts below, bytes.
        payload_offset: u64,
        /// Bytes of data.
        data_size: u64,
        /// Bytes per sector.
        sector_size: u32,
    },
    /// A virtual performance throttle: completions held to `k` times a modelled disk's time.
    Vpt {
        /// The modelled drive (its size is the device's).
        drive: crate::vpt::DriveSpec,
        /// The starting scale of model time to real time.
        k: f64,
        /// Keep `k` as given.
        lock_k: bool,
    },
    /// A disk scheduler.
    Scheduler {
        /// Its policy.
        policy: bulkhead_diskmodel::sched::Policy,
        /// Accesses in flight below at most.
        depth: u32,
        /// The modelled drive it predicts access times with.
        drive: crate::vpt::DriveSpec,
        /// Its knobs.
        tuning: bulkhead_diskmodel::sched::Tuning,
    },
    /// Copy-on-write into a qcow2 overlay, handed over as the output descriptor.
    Cow {
        /// log2 of the overlay's cluster size, as its header said when the device started.
        cluster_bits: u32,
        /// A snapshot operation to carry out on the overlay as the domain opens it.
        #[serde(default)]
        op: Option<crate::cow::SnapshotOp>,
    },
}

/// Write capture for a filter (`guard`, `guard_cache`, `guard_keys`, `guard_pages` in the
/// configuration).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GuardSpec {
    /// How its writes are captured.
    pub mode: GuardMode,
    /// Whether the domain's memory is also partitioned by protection key, where the
    /// processor has them: while the filter runs, it may not write any other owner's memory,
    /// whatever the page protection holds open.
    #[serde(default)]
    pub keys: bool,
    /// Whether, where protection keys do not gate its calls, each call is gated by page
    /// protection: the pages the shadow page cache holds open that are another owner's are
    /// shut while the filter runs.
    #[serde(default)]
    pub pages: bool,
}

impl GuardSpec {
    /// Whether the filter is guarded, so that the domain's filters each need a heap space of
    /// their own.
    pub fn wanted(&self) -> bool {
        self.mode != GuardMode::Off
    }

    /// Whether the filter's calls leave the runtime's memory shut to it by the page gate
    /// alone (SCDWC with `guard_pages`), or it is not guarded: a domain whose filters all are
    /// may guard its runtime's heap a huge page at a time.
    pub fn leaves_runtime_to_the_gate(&self) -> bool {
        !self.wanted() || (self.pages && matches!(self.mode, GuardMode::Scdwc { .. }))
    }
}

/// `guard`: how a filter's writes are captured.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GuardMode {
    /// Not at all.
    #[default]
    Off,
    /// Every write outside the filter's table caught, each allowed page protected again right
    /// after the write.
    Dwc,
    /// With a shadow page cache of `cache` pages.
    Scdwc {
        /// C, the pages kept open.
        cache: u32,
    },
}

impl GuardMode {
    /// As the configuration spells it.
    pub fn as_str(&self) -> &'static str {
        match self {
            GuardMode::Off => "off",
            GuardMode::Dwc => "dwc",
            GuardMode::Scdwc { .. } => "scdwc",
        }
    }
}

impl FilterSpec {
    /// The filter's type name, as in the configuration.
    pub fn type_name(&self) -> &'static str {
        match self {
            FilterSpec::Trace { .. } => "trace",
            FilterSpec::Stats {} => "stats",
            FilterSpec::Delay { .. } => "delay",
            FilterSpec::Error { .. } => "error",
            FilterSpec::Throttle { .. } => "throttle",
            FilterSpec::Vpt { .. } => "vpt",
            FilterSpec::Scheduler { .. } => "scheduler",
            FilterSpec::Crypt { .. } => "crypt",
            FilterSpec::Cow { .. } => "cow",
        }
    }

    /// Whether it needs a secret (a passphrase) handed over as a descriptor.
    pub fn needs_secret(&self) -> bool {
        matches!(self, FilterSpec::Crypt { .. })
    }

    /// Whether it changes where data lies or what it holds below (so the device's size and
    /// contents depend on it, and it cannot come or go while the device runs).
    pub fn transforms(&self) -> bool {
        matches!(self, FilterSpec::Crypt { .. } | FilterSpec::Cow { .. })
    }

    /// Whether it writes to an output descriptor of its own (a trace file, an overlay).
    pub fn needs_output(&self) -> bool {
        matches!(self, FilterSpec::Trace { .. } | FilterSpec::Cow { .. })
    }
}

/// The descriptors a filter was handed.
#[derive(Debug)]
pub struct FilterFds {
    /// Its state page.
    pub state: OwnedFd,
    /// Its output (a trace file, a cow overlay), when it has one.
    pub output: Option<OwnedFd>,
    /// Its secret (a passphrase in a sealed memory file), when it has one.
    pub secret: Option<OwnedFd>,
}

/// Builds the layer a spec describes over the descriptors given for it.
pub fn build(spec: &FilterSpec, fds: FilterFds) -> Result<Box<dyn Layer>, FilterError> {
    let name = spec.type_name();
    let page = StatePage::map(fds.state.as_raw_fd(), true).map_err(|source| FilterError::State { filter: name, source })?;
    // The mapping keeps the page; the descriptor is no longer needed.
    drop(fds.state);
    Ok(match spec {
        FilterSpec::Trace { device_number } => {
            let out = fds.output.ok_or(FilterError::MissingFd(name))?;
            Box::new(crate::trace::Trace::new(std::fs::File::from(out), page, *device_number))
        }
        FilterSpec::Stats {} => Box::new(crate::stats::Stats::new(page)),
        FilterSpec::Delay { delay_us } => Box::new(crate::delay::Delay::new(*delay_us, page)),
        FilterSpec::Error { rule } => {
            if !crate::error::ERRNOS.iter().any(|(_, e)| *e == rule.errno) {
                return Err(FilterError::Invalid {
                    filter: name,
                    message: format!("errno {} cannot cross the channel", rule.errno),
                });
            }
            Box::new(crate::error::ErrorFilter::new(*rule, page))
        }
        FilterSpec::Throttle { limits } => Box::new(crate::throttle::Throttle::new(*limits, page)),
        FilterSpec::Vpt { drive, k, lock_k } => {
            if !(k.is_finite() && *k > 0.0) {
                return Err(FilterError::Invalid { filter: name, message: format!("k = {k}") });
            }
            Box::new(crate::vpt::Vpt::new(*drive, *k, *lock_k, page))
        }
        FilterSpec::Scheduler { policy, depth, drive, tuning } => {
            Box::new(crate::scheduler::Scheduler::new(*policy, *depth, *drive, *tuning, page))
        }
        FilterSpec::Crypt { payload_offset, data_size, sector_size } => {
            let secret = fds.secret.ok_or(FilterError::MissingFd(name))?;
            let layout =
                crate::crypt::Layout { payload_offset: *payload_offset, data_size: *data_size, sector_size: *sector_size };
            Box::new(crate::crypt::Crypt::new(layout, crate::crypt::read_secret(secret)?, page))
        }
        FilterSpec::Cow { cluster_bits, op } => {
            if !(9..=21).contains(cluster_bits) {
                return Err(FilterError::Invalid { filter: name, message: format!("cluster_bits {cluster_bits}") });
            }
            let overlay = fds.output.ok_or(FilterError::MissingFd(name))?;
            let cow = crate::cow::Cow::new(overlay, *cluster_bits, op.clone(), page)
                .map_err(|message| FilterError::Invalid { filter: name, message })?;
            Box::new(cow)
        }
    })
}

/// A filter's figures for `bulkhead status`, read from its state page.
#[derive(Debug, Clone, PartialEq, Serialize, serde::Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum FilterReport {
    /// `trace`.
    Trace {
        /// Records written.
        records: u64,
        /// Records lost to write errors.
        lost: u64,
    },
    /// `stats`.
    Stats {
        /// Per operation.
        ops: Vec<crate::stats::OpStats>,
    },
    /// `delay`.
    Delay {
        /// Requests delayed so far.
        delayed: u64,
        /// Held now.
        held: u64,
    },
    /// `error`.
    Error {
        /// Requests that matched the rule.
        matched: u64,
        /// Failures injected.
        injected: u64,
    },
    /// `throttle`.
    Throttle {
        /// Requests that had to wait.
        throttled: u64,
        /// Waiting now.
        waiting: u64,
        /// Their total wait, ms.
        waited_ms: u64,
    },
    /// `vpt`.
    Vpt {
        /// Scale of model time to real time now.
        k: f64,
        /// Whether `k` is locked.
        locked: bool,
        /// Requests timed.
        requests: u64,
        /// Of those, completed below after their target.
        late: u64,
        /// The late fraction of the last full window.
        late_fraction: f64,
        /// Predicted cache hits.
        cache_hits: u64,
        /// Completions held now.
        held: u64,
        /// The modelled drive's busy time over every timed access, ms of model time (before
        /// `k`): divided by `requests`, the mean service time the model gave.
        model_ms: f64,
        /// Sectors of every timed access.
        sectors: u64,
        /// The model: one revolution, ms.
        rotation_ms: f64,
        /// Full-stroke seek, ms.
        full_seek_ms: f64,
        /// Media rate, bytes/s.
        transfer_bps: u64,
        /// Cache segments × sectors, prefetch sectors (absent: no cache modelled).
        cache: Option<(u32, u32, u32)>,
    },
    /// `scheduler`.
    Scheduler {
        /// Its policy.
        policy: String,
        /// Requests queued now.
        queued: u64,
        /// Accesses sent below.
        dispatched: u64,
        /// Requests that joined another's access.
        coalesced: u64,
        /// Mean wait in the queue, µs.
        mean_wait_us: u64,
        /// Longest wait, µs.
        max_wait_us: u64,
    },
    /// `crypt`.
    Crypt {
        /// Times a domain opened the volume.
        opened: u64,
        /// Bytes encrypted on their way down.
        encrypted: u64,
        /// Bytes decrypted on their way up.
        decrypted: u64,
    },
    /// `cow`.
    Cow {
        /// Times a domain opened the overlay.
        opened: u64,
        /// Bytes read from the device below.
        read_below: u64,
        /// Bytes written to the overlay.
        written: u64,
        /// Clusters allocated in the overlay.
        allocated: u64,
    },
}

impl FilterReport {
    /// The filter's type name, as in the configuration.
    pub fn type_name(&self) -> &'static str {
        match self {
            FilterReport::Trace { .. } => "trace",
            FilterReport::Stats { .. } => "stats",
            FilterReport::Delay { .. } => "delay",
            FilterReport::Error { .. } => "error",
            FilterReport::Throttle { .. } => "throttle",
            FilterReport::Vpt { .. } => "vpt",
            FilterReport::Scheduler { .. } => "scheduler",
            FilterReport::Crypt { .. } => "crypt",
            FilterReport::Cow { .. } => "cow",
        }
    }

    /// Reads the figures of a filter of `spec`'s type from its state page.
    pub fn read(spec: &FilterSpec, page: &StatePage) -> Self {
        match spec {
            FilterSpec::Trace { .. } => {
                let (records, lost) = crate::trace::read(page);
                FilterReport::Trace { records, lost }
            }
            FilterSpec::Stats {} => FilterReport::Stats { ops: crate::stats::read(page) },
            FilterSpec::Delay { .. } => {
                let (delayed, held) = crate::delay::read(page);
                FilterReport::Delay { delayed, held }
            }
            FilterSpec::Error { .. } => {
                let (matched, injected) = crate::error::read(page);
                FilterReport::Error { matched, injected }
            }
            FilterSpec::Throttle { .. } => {
                let (throttled, waiting, waited_ms) = crate::throttle::read(page);
                FilterReport::Throttle { throttled, waiting, waited_ms }
            }
            FilterSpec::Vpt { drive, lock_k, .. } => {
                let f = crate::vpt::read(page);
                FilterReport::Vpt {
                    k: f.k,
                    locked: *lock_k,
                    requests: f.requests,
                    late: f.late,
                    late_fraction: f.late_fraction,
                    cache_hits: f.cache_hits,
                    held: f.held,
                    model_ms: f.model_ns as f64 / 1e6,
                    sectors: f.sectors,
                    rotation_ms: drive.rotation_ns as f64 / 1e6,
                    full_seek_ms: drive.full_seek_ns as f64 / 1e6,
                    transfer_bps: drive.transfer_bps,
                    cache: drive.cache.map(|c| (c.segments, c.segment_sectors, c.prefetch_sectors)),
                }
            }
            FilterSpec::Scheduler { policy, .. } => {
                let (queued, dispatched, coalesced, waited_us, max_wait_us) = crate::scheduler::read(page);
                let requests = dispatched + coalesced;
                FilterReport::Scheduler {
                    policy: policy.as_str().to_string(),
                    queued,
                    dispatched,
                    coalesced,
                    mean_wait_us: waited_us.checked_div(requests).unwrap_or(0),
                    max_wait_us,
                }
            }
            FilterSpec::Crypt { .. } => {
                let (opened, encrypted, decrypted) = crate::crypt::read(page);
                FilterReport::Crypt { opened, encrypted, decrypted }
            }
            FilterSpec::Cow { .. } => {
                let (opened, read_below, written, allocated) = crate::cow::read(page);
                FilterReport::Cow { opened, read_below, written, allocated }
            }
        }
    }

    /// One line for the human status table.
    pub fn summary(&self) -> String {
        match self {
            FilterReport::Trace { records, lost } => format!("{records} records written, {lost} lost"),
            FilterReport::Stats { ops } => ops
                .iter()
                .map(|o| format!("{} {} ({} err, mean {:.1} µs, p99 < {} µs)", o.op, o.requests, o.errors, o.mean_us, o.p99_us))
                .collect::<Vec<_>>()
                .join("; "),
            FilterReport::Delay { delayed, held } => format!("{delayed} delayed, {held} held now"),
            FilterReport::Error { matched, injected } => format!("{matched} matched, {injected} failed"),
            FilterReport::Throttle { throttled, waiting, waited_ms } => {
                format!("{throttled} throttled, {waiting} waiting now, {waited_ms} ms waited")
            }
            FilterReport::Vpt {
                k,
                locked,
                requests,
                late,
                late_fraction,
                cache_hits,
                held,
                model_ms,
                rotation_ms,
                full_seek_ms,
                transfer_bps,
                cache,
                ..
            } => {
                let cache = match cache {
                    Some((n, s, p)) => format!("cache {n}×{s} sectors, prefetch {p}"),
                    None => "no cache".to_string(),
                };
                format!(
                    "k {k:.3}{}, {requests} timed (model service mean {:.2} ms), {late} late ({:.2}% in the last window), \
                     {cache_hits} cache hits, {held} held now; model R {rotation_ms} ms, S {full_seek_ms} ms, {:.0} MB/s, {cache}",
                    if *locked { " (locked)" } else { "" },
                    if *requests > 0 { model_ms / *requests as f64 } else { 0.0 },
                    late_fraction * 100.0,
                    *transfer_bps as f64 / 1e6
                )
            }
            FilterReport::Scheduler { policy, queued, dispatched, coalesced, mean_wait_us, max_wait_us } => format!(
                "{policy}: {queued} queued now, {dispatched} accesses sent, {coalesced} coalesced, wait mean {mean_wait_us} µs, max {max_wait_us} µs"
            ),
            FilterReport::Crypt { opened, encrypted, decrypted } => {
                format!("opened {opened} times, {encrypted} bytes encrypted, {decrypted} decrypted")
            }
            FilterReport::Cow { opened, read_below, written, allocated } => {
                format!("opened {opened} times, {read_below} bytes read below, {written} written to the overlay, {allocated} clusters allocated")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_round_trip_through_json_and_refuse_unknown_fields() {
        let rule = ErrorRule { ops: 3, offset: 0, len: 4096, probability_ppm: 10, after: 1, count: Some(2), errno: 5, seed: 9 };
        let specs = vec![
            FilterSpec::Trace { device_number: 5 },
            FilterSpec::Stats {},
            FilterSpec::Delay { delay_us: [1, 2, 3, 4, 5] },
            FilterSpec::Error { rule },
            FilterSpec::Throttle { limits: Limits { iops_size: 4096, ..Limits::default() } },
            FilterSpec::Crypt { payload_offset: 4096, data_size: 1 << 20, sector_size: 512 },
            FilterSpec::Cow {
                cluster_bits: 16,
                op: Some(crate::cow::SnapshotOp {
                    seq: 3,
                    action: crate::cow::SnapshotAction::Revert,
                    name: "before".into(),
                    date: (1, 2),
                }),
            },
        ];
        let json = serde_json::to_string(&specs).unwrap();
        assert!(json.contains(r#"{"type":"stats"}"#), "{json}");
        assert_eq!(serde_json::from_str::<Vec<FilterSpec>>(&json).unwrap(), specs);
        assert!(serde_json::from_str::<FilterSpec>(r#"{"type":"stats","extra":1}"#).is_err());
        assert!(serde_json::from_str::<FilterSpec>(r#"{"type":"passthrough"}"#).is_err());
    }
}

#[cfg(test)]
mod every_operation {
    use super::*;
    use bulkhead_block::{BlockError, Op, Request, SliceList, Tag, TagSpace, Verdict};
    use bulkhead_shmem::{memfd, Mapping, Protection};
    use std::os::fd::AsRawFd;

    /// Each filter, configured to act on everything it can, against each of the five
    /// operations: it must give a verdict, release what it holds, and take the completion of
    /// what it passed on.
    #[test]
    fn every_filter_handles_every_operation_of_the_request_enum() {
        let buf_fd = memfd::create("buf", 8192).unwrap();
        let map = Mapping::new(buf_fd.as_raw_fd(), 8192, Protection::ReadWrite).unwrap();
        let bufs = SliceList::one(map.slice(0, 8192).unwrap());
        let requests = [
            Request::Read { offset: 4096, into: bufs },
            Request::Write { offset: 4096, from: bufs, fua: true },
            Request::Flush,
            Request::Discard { offset: 0, len: 65536 },
            Request::WriteZeroes { offset: 8192, len: 4096 },
        ];
        assert_eq!(requests.map(|r| r.op()), Op::ALL, "one request of each kind");
        let trace_path = std::env::temp_dir().join(format!("bulkhead-every-op-{}", std::process::id()));
        let specs = [
            FilterSpec::Trace { device_number: 1 },
            FilterSpec::Stats {},
            FilterSpec::Delay { delay_us: [1; 5] },
            FilterSpec::Error {
                rule: ErrorRule {
                    ops: 0b1_1111,
                    offset: 0,
                    len: u64::MAX,
                    probability_ppm: 1_000_000,
                    after: 0,
                    count: None,
                    errno: 5,
                    seed: 1,
                },
            },
            FilterSpec::Throttle {
                limits: Limits {
                    iops_total: Some(crate::throttle::Limit { avg: 1.0, max: 0.0, max_length: 1.0 }),
                    ..Limits::default()
                },
            },
        ];
        for spec in specs {
            let state = memfd::create("state", crate::state::STATE_BYTES as u64).unwrap();
            let output = spec.needs_output().then(|| std::fs::File::create(&trace_path).unwrap().into());
            let mut layer = build(&spec, FilterFds { state, output, secret: None }).unwrap();
            layer.attach(TagSpace { queues: 1, per_queue: 8 });
            let mut passed = Vec::new();
            let mut answered = 0;
            let mut held = 0;
            for (i, r) in requests.iter().enumerate() {
                match layer.submit(Tag::new(i as u32), r, bulkhead_block::SharedSlice::empty(), 1_000) {
                    Verdict::Forward => passed.push(i),
                    Verdict::Complete(Err(_)) => answered += 1,
                    Verdict::Complete(Ok(_)) => panic!("{}: completed {:?} without the layers below", spec.type_name(), r.op()),
                    Verdict::Hold => held += 1,
                    Verdict::Send(sub) => panic!(
                        "{}: sent {sub:?} in place of {:?}: none of these filters changes a request",
                        spec.type_name(),
                        r.op()
                    ),
                }
            }
            // Whatever it holds comes back, in time, exactly once.
            let mut released = Vec::new();
            let mut now = 1_000;
            while released.len() < held {
                now += 500_000_000;
                layer.poll(now, &mut |t, v| released.push((t, v)));
                assert!(now < 60_000_000_000, "{}: held requests never released", spec.type_name());
            }
            assert_eq!(released.len(), held, "{}", spec.type_name());
            for (t, v) in released {
                assert_eq!(v, Verdict::Forward, "{}", spec.type_name());
                passed.push(t.index());
            }
            for i in passed.iter().copied() {
                let mut result: Result<u64, BlockError> = Ok(requests[i].transfer_len());
                layer.complete(Tag::new(i as u32), &requests[i], bulkhead_block::SharedSlice::empty(), &mut result, now);
                assert_eq!(result, Ok(requests[i].transfer_len()), "{} changed a result", spec.type_name());
            }
            assert_eq!(passed.len() + answered, requests.len(), "{}: a request vanished", spec.type_name());
            let expect_answered = if matches!(spec, FilterSpec::Error { .. }) { 5 } else { 0 };
            assert_eq!(answered, expect_answered, "{}", spec.type_name());
            layer.idle();
        }
        let trace = std::fs::read(&trace_path).unwrap();
        let _ = std::fs::remove_file(&trace_path);
        assert_eq!(trace.len(), 10 * crate::trace::RECORD_BYTES, "a queue and a complete record per operation");
    }
}
