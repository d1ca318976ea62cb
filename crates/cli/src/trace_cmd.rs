//! `bulkhead trace FILE`.

use std::path::Path;
use std::process::ExitCode;

use anyhow::Context;
use bulkhead_control::table::Table;
use bulkhead_filters::trace_summary::summarize;

fn size(bytes: u64) -> String {
    match bytes {
        b if b >= 1 << 30 => format!("{:.1} GiB", b as f64 / (1u64 << 30) as f64),
        b if b >= 1 << 20 => format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64),
        b if b >= 1 << 10 => format!("{:.1} KiB", b as f64 / 1024.0),
        b => format!("{b} B"),
    }
}

pub fn run(path: &Path, json: bool) -> anyhow::Result<ExitCode> {
    let f = std::fs::File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    let s = summarize(std::io::BufReader::with_capacity(1 << 20, f)).with_context(|| format!("{}", path.display()))?;
    if json {
        println!("{}", serde_json::to_string_pretty(&s)?);
        return Ok(ExitCode::SUCCESS);
    }
    println!("{}: {} records over {:.3} s", path.display(), s.records, s.span_s);
    let mut t = Table::new(&["OP", "QUEUED", "COMPLETED", "ERRORS", "BYTES", "MEAN µs", "P50 µs", "P99 µs", "MAX µs", "MiB/s"]);
    for o in &s.ops {
        let rate = if s.span_s > 0.0 { format!("{:.1}", o.bytes as f64 / (1u64 << 20) as f64 / s.span_s) } else { "-".into() };
        t.row(vec![
            o.op.into(),
            o.queued.to_string(),
            o.completed.to_string(),
            o.errors.to_string(),
            size(o.bytes),
            format!("{:.1}", o.mean_us),
            format!("{:.1}", o.p50_us),
            format!("{:.1}", o.p99_us),
            format!("{:.1}", o.max_us),
            rate,
        ]);
    }
    print!("{}", t.render());
    let queues: Vec<String> = s.per_queue.iter().map(|(q, n)| format!("{q}: {n}")).collect();
    println!("requests per queue: {}", if queues.is_empty() { "-".into() } else { queues.join(", ") });
    if s.unpaired_completions > 0 || s.in_flight_at_end > 0 {
        println!(
            "{} completions without their queue record (records lost in a restart, or a trace begun mid-request); \
             {} requests still in flight at the end",
            s.unpaired_completions, s.in_flight_at_end
        );
    }
    if s.trailing_bytes > 0 {
        println!("{} bytes at the end are not a whole record (cut short)", s.trailing_bytes);
    }
    Ok(ExitCode::SUCCESS)
}
