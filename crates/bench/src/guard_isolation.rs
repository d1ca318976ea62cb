//! `bench guard --isolation`: the share of injected faults write capture stops before they
//! change the state they aim at, against C (Chariot's figure 7).
//!
//! Each fault is made by a domain of its own, in a child process forked from this one: the
//! domain runs a chain of the filter measured (trace, crypt or cow, guarded as the setting
//! says, injecting one fault) and a `stats` filter (whose state is one of the targets), over a
//! `ram` backend or a LUKS2 file, behind one queue this process drives with 4 KiB random reads
//! and writes. The fault strikes at a random call among the filter's first [`EVERY`]. Two
//! populations ([`Population`]): the targeted faults aim at the ring, the runtime's heap, the
//! other filter's state or a block the filter just freed, in turn; the seed-like ones write
//! through a corrupted live pointer, past a buffer of the call, or at a wild address weighted
//! by size, before or after the filter's own work, and only where DWC stops them.
//!
//! Before the faults, each filter's write working set is counted (the distinct pages written
//! over the same window, by SCDWC's cache at its largest), so that C is also reported as a
//! multiple of it.
//!
//! The child's heap is private memory, as any domain's is, with the runtime's space in a huge
//! page where the domain's would be. Once the fault is due, this process traces the child to
//! its end, and as it exits reads the word the fault aimed at from its memory: still the old
//! value, the fault was isolated; the written value, it landed. The child's own account (its
//! exit status) is only compared with what the memory shows, never trusted in its place.

use crate::BenchError;
use std::path::PathBuf;

use serde::Serialize;

use crate::guard_filters::{Gate, Setting};
use crate::Table;

#[cfg(feature = "test-driver")]
mod child;
#[cfg(feature = "test-driver")]
mod measure;
#[cfg(feature = "test-driver")]
pub use measure::run;

/// Without the `isolation` feature (enabled by the `bulkhead` package's `test-driver`): the
/// faults are made by code the shipped binary does not have, so the measurement is refused.
#[cfg(not(feature = "test-driver"))]
pub fn run(_opts: &Options, _progress: impl FnMut(&str)) -> Result<Report, BenchError> {
    Err(unavailable())
}

/// Why this build cannot measure isolation, and how to build one that can.
fn unavailable() -> BenchError {
    BenchError::Options(
        "--isolation makes faults in filters on purpose, which only a build with the test-driver feature can: \
         cargo build --release -p bulkhead --features bulkhead/test-driver"
            .into(),
    )
}

/// Which faults.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Population {
    /// Aimed at the state a filter could do the most harm to, at the start of a call.
    Targeted,
    /// Modelled on the bugs a fault-injection tool plants, kept only where DWC stops them.
    SeedLike,
}

impl Population {
    /// Both, as the benchmark runs them by default.
    pub const ALL: [Population; 2] = [Population::Targeted, Population::SeedLike];

    /// As `--population` spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            Population::Targeted => "targeted",
            Population::SeedLike => "seed-like",
        }
    }

    /// `targeted` or `seed-like`.
    pub fn parse(s: &str) -> Result<Population, String> {
        Population::ALL.into_iter().find(|p| p.as_str() == s).ok_or_else(|| format!("`{s}` is not targeted or seed-like"))
    }

    /// Where its faults aim, in turn (the test kit's targets).
    pub fn targets(self) -> &'static [&'static str] {
        match self {
            Population::Targeted => &TARGETS,
            Population::SeedLike => &SEED_TARGETS,
        }
    }
}

/// What to run.
#[derive(Debug, Clone)]
pub struct Options {
    /// Faults per setting and population, spread evenly over the filters and the targets.
    pub faults: u32,
    /// The fault populations.
    pub populations: Vec<Population>,
    /// Where the LUKS volume goes.
    pub scratch: PathBuf,
    /// The settings (`off` isolates nothing and is left out).
    pub settings: Vec<Setting>,
}

impl Options {
    /// Refuses settings that measure nothing (only `off`) or that this machine cannot run,
    /// and a build without the faults ([`run`]).
    pub fn check(&self) -> Result<(), BenchError> {
        if cfg!(not(feature = "test-driver")) {
            return Err(unavailable());
        }
        if !self.settings.iter().any(|s| s.mode != bulkhead_filters::GuardMode::Off) {
            return Err(BenchError::Options("--settings: --isolation needs a setting other than `off`".into()));
        }
        if self.settings.iter().any(|s| s.gate == Gate::Keys) && !bulkhead_sys::pkey::supported() {
            return Err(BenchError::Options(
                "--settings: `+keys` needs protection keys, which this processor does not have".into(),
            ));
        }
        Ok(())
    }
}

/// The fault strikes at a random call among this many calls into the filter (a request is
/// two: its submit and its completion).
pub const EVERY: u64 = 200;

/// Where the targeted faults aim, in turn.
pub const TARGETS: [&str; 4] = ["ring", "heap", "filter", "freed"];

/// How the seed-like faults are made, in turn.
pub const SEED_TARGETS: [&str; 3] = ["pointer", "overrun", "wild"];

/// Faults counted by what the memory showed.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Count {
    /// Still the old value: stopped before it changed the state.
    pub isolated: u32,
    /// The written value: the state changed.
    pub landed: u32,
    /// Neither (something else wrote the word since: the frontend, in the ring).
    pub undecided: u32,
}

impl Count {
    /// Isolated faults as a share of the decided ones, percent.
    pub fn rate_pct(&self) -> f64 {
        let decided = self.isolated + self.landed;
        if decided == 0 {
            return 0.0;
        }
        100.0 * self.isolated as f64 / decided as f64
    }
}

/// One setting, for one population.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    /// `targeted` or `seed-like`.
    pub population: Population,
    /// `dwc` or `scdwc`.
    pub guard: String,
    /// C, for scdwc.
    pub cache: Option<u32>,
    /// What gated the calls too.
    pub gate: Gate,
    /// Every fault.
    pub all: Count,
    /// Per target, in the order of the population's [`Population::targets`].
    pub by_target: Vec<(String, Count)>,
    /// Per filter.
    pub by_filter: Vec<(String, Count)>,
    /// Faults whose child's exit status said otherwise than the memory (a stop reported for a
    /// write that landed, or the reverse).
    pub disagreed: u32,
    /// Faults with no result: the child ended before making its fault, or in another way.
    pub lost: u32,
    /// Faults whose domain had its runtime's heap in huge pages as it exited (where every
    /// guarded filter is page-gated, [`bulkhead_driver::guarded::prepare_heap`]).
    pub huge: u32,
    /// Mean milliseconds per fault, child and all.
    pub ms_per_fault: f64,
}

/// A filter's write working set.
#[derive(Debug, Clone, Serialize)]
pub struct WorkingSet {
    /// The filter measured.
    pub filter: String,
    /// Distinct pages the runtime and the filters wrote over the filter's first [`EVERY`]
    /// calls.
    pub pages: u32,
    /// Pages of guarded memory in use then: the ring, the used part of every heap space.
    pub guarded: u32,
}

/// The whole run.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// Faults per setting and population.
    pub faults: u32,
    /// The call window a fault strikes in.
    pub every: u64,
    /// The filters measured.
    pub filters: Vec<String>,
    /// Each filter's write working set, where it was counted.
    pub working_sets: Vec<WorkingSet>,
    /// The rows, population by population.
    pub rows: Vec<Row>,
    /// For each gate measured with a DWC reference (DWC with the same gate, or without one),
    /// the first C whose isolation rate of the targeted faults is below it, if any.
    pub drops_at: Vec<(Gate, Option<u32>)>,
    /// Filters left out, and why; why faults were lost.
    pub notes: Vec<String>,
}

impl Report {
    /// C as a multiple of the filters' write working sets: the smallest and the largest.
    pub fn cache_multiple(&self, cache: u32) -> Option<(f64, f64)> {
        let m: Vec<f64> = self.working_sets.iter().filter(|w| w.pages > 0).map(|w| cache as f64 / w.pages as f64).collect();
        let lo = m.iter().copied().fold(f64::INFINITY, f64::min);
        let hi = m.iter().copied().fold(0.0, f64::max);
        (!m.is_empty()).then_some((lo, hi))
    }
}

/// The report as tables: the working sets, every fault, then per target.
pub fn render(r: &Report) -> String {
    let gate = |row: &Row| row.gate.cell().to_string();
    let mut s = String::new();
    if !r.working_sets.is_empty() {
        let ws: Vec<String> =
            r.working_sets.iter().map(|w| format!("{} {} pages of {} guarded in use", w.filter, w.pages, w.guarded)).collect();
        s.push_str(&format!("write working set over a filter's first {} calls: {}\n", r.every, ws.join(", ")));
    }
    let multiple = |row: &Row| match row.cache.and_then(|c| r.cache_multiple(c)) {
        Some((lo, hi)) if (hi - lo) < 0.05 => format!("{lo:.1}×"),
        Some((lo, hi)) => format!("{lo:.1}–{hi:.1}×"),
        None => "-".into(),
    };
    let mut t = Table::new(&[
        "population",
        "guard",
        "C",
        "C/ws",
        "gate",
        "faults",
        "isolated",
        "landed",
        "undecided",
        "lost",
        "huge",
        "rate",
        "ms/fault",
    ]);
    for row in &r.rows {
        t.row(vec![
            row.population.as_str().into(),
            row.guard.clone(),
            row.cache.map_or("-".into(), |c| c.to_string()),
            multiple(row),
            gate(row),
            (row.all.isolated + row.all.landed + row.all.undecided + row.lost).to_string(),
            row.all.isolated.to_string(),
            row.all.landed.to_string(),
            row.all.undecided.to_string(),
            row.lost.to_string(),
            row.huge.to_string(),
            format!("{:.1}%", row.all.rate_pct()),
            format!("{:.1}", row.ms_per_fault),
        ]);
    }
    s.push_str(&format!(
        "isolation: {} faults per setting and population over {}, each at a random call of the filter's first {}; state read as the domain exited; huge: of those, domains whose runtime heap was in huge pages\n{}",
        r.faults,
        r.filters.join(", "),
        r.every,
        t.render()
    ));
    for p in Population::ALL {
        let rows: Vec<&Row> = r.rows.iter().filter(|row| row.population == p).collect();
        if rows.is_empty() {
            continue;
        }
        let mut names: Vec<&str> = vec!["guard", "C", "gate"];
        names.extend(p.targets());
        names.extend(r.filters.iter().map(String::as_str));
        let mut t = Table::new(&names);
        for row in &rows {
            let mut cells = vec![row.guard.clone(), row.cache.map_or("-".into(), |c| c.to_string()), gate(row)];
            for (_, c) in row.by_target.iter().chain(&row.by_filter) {
                let decided = c.isolated + c.landed;
                cells.push(if decided == 0 { "-".into() } else { format!("{:.0}% of {decided}", c.rate_pct()) });
            }
            t.row(cells);
        }
        s.push_str(&format!("{} faults: isolation rate per target and per filter (of the decided faults)\n", p.as_str()));
        s.push_str(&t.render());
        // The reference is Chariot's: DWC without keys, else with them.
        let dwc_of = |g: Gate| rows.iter().find(|x| x.cache.is_none() && x.gate == g).map(|x| x.all.rate_pct());
        if let Some(d) = dwc_of(Gate::None).or_else(|| dwc_of(Gate::Keys)) {
            for c60 in rows.iter().filter(|x| x.cache == Some(60)) {
                let rate = c60.all.rate_pct();
                let met = if rate >= 90.0 { "met" } else { "not met" };
                s.push_str(&format!(
                    "goal: scdwc C=60{} isolates at least 90% of the {} faults (dwc: {d:.1}%): {rate:.1}% ({met})\n",
                    c60.gate.suffix(),
                    p.as_str()
                ));
            }
        }
    }
    for &(gate, drops) in &r.drops_at {
        let k = match gate {
            Gate::None => "",
            Gate::Keys => " with keys",
            Gate::Pages => " with the page gate",
        };
        match drops {
            Some(c) => s.push_str(&format!("the targeted faults' isolation rate{k} first drops below dwc's at C={c}\n")),
            None => s.push_str(&format!("the targeted faults' isolation rate{k} stays at dwc's for every C measured\n")),
        }
    }
    let disagreed: u32 = r.rows.iter().map(|x| x.disagreed).sum();
    if disagreed > 0 {
        s.push_str(&format!(
            "{disagreed} faults whose domain's exit status disagreed with the memory (counted as the memory says)\n"
        ));
    }
    for n in &r.notes {
        s.push_str(&format!("note: {n}\n"));
    }
    s
}
