//! Chariot's figures 5 to 7 from `bench guard --filters` and `bench guard --isolation`
//! together: one report, and one SVG with a panel per figure (throughput, CPU, isolation
//! rate), each against the setting: off, DWC, then SCDWC with C from 0 to 100. Settings
//! measured with protection keys as well are drawn as dashed lines beside the plain ones, and
//! those gated by page protection as dotted ones.

use serde::Serialize;

use crate::guard_filters::Gate;
use crate::guard_isolation::Population;
use crate::{guard_filters, guard_isolation};

/// Either run, or both.
#[derive(Debug, Clone, Serialize)]
pub struct Figures {
    /// Throughput and CPU under fio.
    pub filters: Option<guard_filters::Report>,
    /// Isolation rate.
    pub isolation: Option<guard_isolation::Report>,
}

/// Both reports as text.
pub fn render(f: &Figures) -> String {
    let mut s = String::new();
    if let Some(r) = &f.filters {
        s.push_str(&guard_filters::render(r));
    }
    if let Some(r) = &f.isolation {
        if !s.is_empty() {
            s.push('\n');
        }
        s.push_str(&guard_isolation::render(r));
    }
    s
}

/// The x axis: every setting either run has, in Chariot's order.
fn settings() -> Vec<(String, Option<u32>)> {
    let mut v = vec![("off".to_string(), None), ("dwc".to_string(), None)];
    v.extend(guard_filters::CACHES.iter().map(|c| (c.to_string(), Some(*c))));
    v
}

/// One line of a panel: a name and a value per setting.
struct Series {
    name: String,
    values: Vec<Option<f64>>,
    /// Gated: drawn dashed (keys) or dotted (pages), in the colour of the plain line it pairs
    /// with.
    gate: Gate,
}

const COLOURS: [&str; 8] = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#17becf", "#7f7f7f"];

/// One panel at (`ox`, `oy`): a line per series against the settings, y from 0 to `ymax`.
fn panel(s: &mut String, (ox, oy): (f64, f64), title: &str, ymax: f64, series: &[Series]) {
    let (pw, ph) = (420.0, 280.0);
    // The legend goes right of the plot, clear of the lines.
    let (l, r, t, b) = (ox + 50.0, ox + pw - 110.0, oy + 24.0, oy + ph - 40.0);
    let xs = settings();
    let x = |i: usize| l + (i as f64 + 0.5) / xs.len() as f64 * (r - l);
    let y = |v: f64| b - (v / ymax).clamp(0.0, 1.0) * (b - t);
    s.push_str(&format!("<text x=\"{l}\" y=\"{}\" font-size=\"13\" font-weight=\"bold\">{title}</text>\n", t - 8.0));
    s.push_str(&format!("<rect x=\"{l}\" y=\"{t}\" width=\"{}\" height=\"{}\" fill=\"none\" stroke=\"#888\"/>\n", r - l, b - t));
    for k in 0..=4 {
        let v = ymax * k as f64 / 4.0;
        s.push_str(&format!(
            "<line x1=\"{l}\" x2=\"{r}\" y1=\"{0:.1}\" y2=\"{0:.1}\" stroke=\"#eee\"/><text x=\"{1}\" y=\"{2:.1}\" text-anchor=\"end\">{3:.0}</text>\n",
            y(v),
            l - 4.0,
            y(v) + 4.0,
            v
        ));
    }
    for (i, (label, _)) in xs.iter().enumerate() {
        s.push_str(&format!("<text x=\"{:.1}\" y=\"{}\" text-anchor=\"middle\">{label}</text>\n", x(i), b + 14.0));
    }
    s.push_str(&format!("<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">setting (SCDWC: C)</text>\n", (l + r) / 2.0, b + 30.0));
    // A keyed line takes the colour of the plain line of the same name.
    let base = |n: &str| n.trim_end_matches(Gate::Keys.suffix()).trim_end_matches(Gate::Pages.suffix()).to_string();
    let plain: Vec<String> = series.iter().filter(|x| x.gate == Gate::None).map(|x| base(&x.name)).collect();
    for (si, line) in series.iter().enumerate() {
        let colour = plain.iter().position(|n| *n == base(&line.name)).unwrap_or(plain.len() + si);
        let c = COLOURS[colour % COLOURS.len()];
        let dash = match line.gate {
            Gate::None => "",
            Gate::Keys => " stroke-dasharray=\"5,3\"",
            Gate::Pages => " stroke-dasharray=\"1.5,2.5\"",
        };
        let pts: Vec<String> =
            line.values.iter().enumerate().filter_map(|(i, v)| v.map(|v| format!("{:.1},{:.1}", x(i), y(v)))).collect();
        s.push_str(&format!("<polyline points=\"{}\" fill=\"none\" stroke=\"{c}\" stroke-width=\"2\"{dash}/>\n", pts.join(" ")));
        for p in &pts {
            let (px, py) = p.split_once(',').unwrap_or(("0", "0"));
            s.push_str(&format!("<circle cx=\"{px}\" cy=\"{py}\" r=\"2.5\" fill=\"{c}\"/>\n"));
        }
        s.push_str(&format!("<text x=\"{}\" y=\"{}\" fill=\"{c}\">{}</text>\n", r + 8.0, t + 14.0 + 14.0 * si as f64, line.name));
    }
}

/// The value of a filters row at each setting.
fn filter_series(r: &guard_filters::Report, filter: &str, gate: Gate, value: fn(&guard_filters::Row) -> f64) -> Series {
    let values = settings()
        .iter()
        .map(|(label, cache)| {
            r.rows
                .iter()
                .find(|row| {
                    row.filter == filter
                        // `off` has no gate: every line starts at it.
                        && (row.gate == gate || row.guard == "off")
                        && match cache {
                            Some(c) => row.cache == Some(*c),
                            None => row.guard == *label,
                        }
                })
                .map(value)
        })
        .collect();
    Series { name: format!("{filter}{}", gate.suffix()), values, gate }
}

/// The isolation rate at each setting, of every fault of `population` (`None`) or of one
/// target's.
fn isolation_series(r: &guard_isolation::Report, population: Population, target: Option<&str>, gate: Gate) -> Series {
    let values = settings()
        .iter()
        .map(|(label, cache)| {
            let row = r.rows.iter().find(|row| {
                row.gate == gate
                    && row.population == population
                    && match cache {
                        Some(c) => row.cache == Some(*c),
                        None => row.guard == *label,
                    }
            })?;
            let count = match target {
                None => &row.all,
                Some(t) => &row.by_target.iter().find(|(n, _)| n == t)?.1,
            };
            (count.isolated + count.landed > 0).then(|| count.rate_pct())
        })
        .collect();
    let name = match (population, target) {
        (_, Some(t)) => t,
        (Population::Targeted, None) => "all targeted",
        (Population::SeedLike, None) => "all seed-like",
    };
    Series { name: format!("{name}{}", gate.suffix()), values, gate }
}

/// The figures as an SVG: throughput (MiB/s) and CPU (%) per filter, and the isolation rate
/// (%) of all faults and per target, each against the setting.
pub fn svg(f: &Figures) -> String {
    let mut body = String::new();
    let mut ox = 10.0;
    if let Some(r) = &f.filters {
        let mut names: Vec<&str> = Vec::new();
        for row in &r.rows {
            if !names.contains(&row.filter.as_str()) {
                names.push(&row.filter);
            }
        }
        let gates: Vec<Gate> =
            [Gate::None, Gate::Keys, Gate::Pages].into_iter().filter(|g| r.rows.iter().any(|row| row.gate == *g)).collect();
        let lines = |value: fn(&guard_filters::Row) -> f64| -> Vec<Series> {
            let mut v = Vec::new();
            for n in &names {
                v.push(filter_series(r, n, Gate::None, value));
                v.extend(gates.iter().filter(|g| **g != Gate::None).map(|g| filter_series(r, n, *g, value)));
            }
            v
        };
        let tput = lines(|row| row.mibs);
        let ymax = r.rows.iter().map(|row| row.mibs).fold(1.0, f64::max) * 1.1;
        panel(&mut body, (ox, 30.0), "throughput, MiB/s (fio 4 KiB randrw)", ymax, &tput);
        ox += 430.0;
        let cpu = lines(|row| row.cpu_pct);
        panel(&mut body, (ox, 30.0), "CPU busy, % of both CPUs", 100.0, &cpu);
        ox += 430.0;
    }
    if let Some(r) = &f.isolation {
        // The targeted faults, all and per target; the seed-like ones, all.
        let has = |p: Population| r.rows.iter().any(|row| row.population == p);
        let mut lines = Vec::new();
        if has(Population::Targeted) {
            lines.push(isolation_series(r, Population::Targeted, None, Gate::None));
            lines.extend(guard_isolation::TARGETS.iter().map(|t| isolation_series(r, Population::Targeted, Some(t), Gate::None)));
        }
        if has(Population::SeedLike) {
            lines.push(isolation_series(r, Population::SeedLike, None, Gate::None));
        }
        // Last, so that they are drawn over the plain lines they meet at 100%.
        for gate in [Gate::Keys, Gate::Pages] {
            for p in Population::ALL {
                if r.rows.iter().any(|row| row.gate == gate && row.population == p) {
                    lines.push(isolation_series(r, p, None, gate));
                }
            }
        }
        panel(&mut body, (ox, 30.0), &format!("isolation rate, % ({} faults per setting)", r.faults), 100.0, &lines);
        ox += 430.0;
    }
    let (w, h) = ((ox + 10.0).max(560.0), 330.0);
    format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"11\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"10\" y=\"18\" font-size=\"14\">bulkhead-bench guard: filters under write capture, against the setting</text>\n\
         {body}</svg>\n"
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use guard_isolation::{Count, Row};

    fn isolation() -> guard_isolation::Report {
        let count = |isolated, landed| Count { isolated, landed, undecided: 0 };
        let row = |cache: Option<u32>, landed| Row {
            population: Population::Targeted,
            guard: if cache.is_some() { "scdwc" } else { "dwc" }.into(),
            cache,
            gate: Gate::None,
            all: count(100 - landed, landed),
            by_target: vec![("ring".into(), count(25 - landed.min(25), landed.min(25)))],
            by_filter: vec![("trace".into(), count(100 - landed, landed))],
            disagreed: 0,
            lost: 0,
            huge: 0,
            ms_per_fault: 5.0,
        };
        guard_isolation::Report {
            faults: 100,
            every: 200,
            filters: vec!["trace".into()],
            working_sets: vec![guard_isolation::WorkingSet { filter: "trace".into(), pages: 20, guarded: 90 }],
            rows: vec![row(None, 0), row(Some(0), 0), row(Some(60), 10)],
            drops_at: vec![(Gate::None, Some(60))],
            notes: Vec::new(),
        }
    }

    #[test]
    fn the_isolation_panel_has_a_line_for_all_faults_and_one_per_target() {
        let svg = svg(&Figures { filters: None, isolation: Some(isolation()) });
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        assert_eq!(svg.matches("<polyline").count(), 1 + guard_isolation::TARGETS.len());
        // The seed-like faults add a line of their own, in a colour of its own.
        let mut r = isolation();
        let mut seed = r.rows.clone();
        seed.iter_mut().for_each(|row| row.population = Population::SeedLike);
        r.rows.extend(seed);
        let both = super::svg(&Figures { filters: None, isolation: Some(r) });
        assert_eq!(both.matches("<polyline").count(), 2 + guard_isolation::TARGETS.len());
        let colour = |name: &str| {
            let at = both.find(&format!(">{name}</text>")).unwrap();
            let fill = both[..at].rfind("fill=\"").unwrap();
            both[fill..fill + 14].to_string()
        };
        assert_ne!(colour("all targeted"), colour("all seed-like"), "{both}");
        // dwc, C=0 and C=60 for "all": three points.
        let all = svg.lines().find(|l| l.starts_with("<polyline")).unwrap();
        assert_eq!(all.matches(',').count(), 3);
    }

    #[test]
    fn rates_and_the_drop_are_rendered() {
        let r = isolation();
        assert_eq!(r.rows[2].all.rate_pct(), 90.0);
        let text = render(&Figures { filters: None, isolation: Some(r) });
        assert!(text.contains("first drops below dwc's at C=60"), "{text}");
        assert!(text.contains("at least 90% of the targeted faults (dwc: 100.0%): 90.0% (met)"), "{text}");
        assert!(text.contains("trace 20 pages") && text.contains("3.0×"), "C as a multiple of the working set: {text}");
    }

    #[test]
    fn keyed_settings_get_a_dashed_line_and_a_goal_of_their_own() {
        let mut r = isolation();
        let mut keyed = r.rows[2].clone();
        keyed.gate = Gate::Keys;
        keyed.all = Count { isolated: 100, landed: 0, undecided: 0 };
        r.rows.push(keyed);
        let svg = svg(&Figures { filters: None, isolation: Some(r.clone()) });
        assert_eq!(svg.matches("stroke-dasharray").count(), 1, "{svg}");
        let text = render(&Figures { filters: None, isolation: Some(r) });
        assert!(
            text.contains("goal: scdwc C=60 +keys isolates at least 90% of the targeted faults (dwc: 100.0%): 100.0% (met)"),
            "{text}"
        );
    }
}
