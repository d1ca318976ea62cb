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
    /// A delay per operation, µs, by [`bulkhead_block::OpKind::index`].
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
        }
    }

    /// Whether it writes to an output descriptor of its own.
    pub fn needs_output(&self) -> bool {
        matches!(self, FilterSpec::Trace { .. })
    }
}

/// The descriptors a filter was handed.
#[derive(Debug)]
pub struct FilterFds {
    /// Its state page.
    pub state: OwnedFd,
    /// Its output (a trace file), when it has one.
    pub output: Option<OwnedFd>,
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
    })
}

/// A filter's figures for `bulkhead status`, read from its state page.
#[derive(Debug, Clone, PartialEq, Serialize)]
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
}

impl FilterReport {
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
        ];
        let json = serde_json::to_string(&specs).unwrap();
        assert!(json.contains(r#"{"type":"stats"}"#), "{json}");
        assert_eq!(serde_json::from_str::<Vec<FilterSpec>>(&json).unwrap(), specs);
        assert!(serde_json::from_str::<FilterSpec>(r#"{"type":"stats","extra":1}"#).is_err());
        assert!(serde_json::from_str::<FilterSpec>(r#"{"type":"passthrough"}"#).is_err());
    }
}
