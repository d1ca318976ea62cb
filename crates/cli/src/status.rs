//! `bulkhead status`.

use std::path::Path;
use std::process::ExitCode;

use anyhow::Context;
use bulkhead_bench::Table;
use bulkhead_control::{Call, Changed, Client, FuseStatus, ListSnapshots, Restart, SetQos, Snapshot, SnapshotAction, Status};

fn mib(kib: Option<u64>) -> String {
    kib.map(|k| format!("{:.1} MiB", k as f64 / 1024.0)).unwrap_or_else(|| "-".into())
}

fn ms(v: Option<f64>) -> String {
    v.map(|x| format!("{x:.1}")).unwrap_or_else(|| "-".into())
}

/// Makes `call` to the `serve` of `run_dir`.
pub fn ask<C: Call>(run_dir: &Path, call: C) -> anyhow::Result<C::Reply> {
    Ok(Client::connect(run_dir)?.call(call)?)
}

pub fn restart(run_dir: &Path, device: &str) -> anyhow::Result<ExitCode> {
    let a = ask(run_dir, Restart { device: device.into() })?;
    println!("{device}: restarted, driver pid {}", a.driver_pid);
    Ok(ExitCode::SUCCESS)
}

/// Asks for a change to a running device (`tap`, `filter`) and prints the outcome.
pub fn change<C: Call<Reply = Changed>>(run_dir: &Path, device: &str, call: C) -> anyhow::Result<ExitCode> {
    let mut client = Client::connect(run_dir)?;
    let a = client.call(call)?;
    println!("{device}: changed; new driver pid {}", a.driver_pid);
    let status = client.call(Status {})?;
    if let Some(d) = status.devices.iter().find(|d| d.name == device) {
        let names: Vec<&str> = d.filters.iter().map(|f| f.report.type_name()).collect();
        println!(
            "{device}: tap {}, filters (frontend side first): {}",
            d.tap,
            if names.is_empty() { "none".into() } else { names.join(", ") }
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// `bulkhead snapshot DEVICE OP [NAME]`.
pub fn snapshot(
    run_dir: &Path,
    device: &str,
    op: Option<SnapshotAction>,
    name: Option<&str>,
    json: bool,
) -> anyhow::Result<ExitCode> {
    let Some(op) = op else {
        let list = ask(run_dir, ListSnapshots { device: device.into() })?.snapshots;
        if json {
            println!("{}", serde_json::to_string_pretty(&list)?);
            return Ok(ExitCode::SUCCESS);
        }
        if list.is_empty() {
            println!("{device}: no snapshots");
            return Ok(ExitCode::SUCCESS);
        }
        let mut t = Table::new(&["ID", "NAME", "TAKEN (UTC)", "DISK SIZE"]);
        for s in &list {
            let size = s.disk_size.map(|b| format!("{:.1} MiB", b as f64 / 1048576.0)).unwrap_or_else(|| "-".into());
            t.row(vec![s.id.clone(), s.name.clone(), utc(u64::from(s.date_sec)), size]);
        }
        print!("{}", t.render());
        return Ok(ExitCode::SUCCESS);
    };
    let Some(name) = name else {
        anyhow::bail!("snapshot {} needs a NAME", op.as_str());
    };
    let a = ask(run_dir, Snapshot { device: device.into(), op, name: name.into() })?;
    let done = match op {
        SnapshotAction::Create => "taken",
        SnapshotAction::Revert => "reverted to",
        SnapshotAction::Delete => "deleted",
    };
    println!("{device}: snapshot `{name}` {done}; driver pid {}", a.driver_pid);
    Ok(ExitCode::SUCCESS)
}

/// Seconds since the epoch as `YYYY-MM-DD HH:MM:SS` (UTC).
fn utc(secs: u64) -> String {
    let (days, rem) = (secs / 86400, secs % 86400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02}", rem / 3600, rem % 3600 / 60, rem % 60)
}

pub fn run(run_dir: &Path, json: bool) -> anyhow::Result<ExitCode> {
    let report = ask(run_dir, Status {})?;
    if json {
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(ExitCode::SUCCESS);
    }
    let mut t = Table::new(&[
        "DEVICE",
        "STATE",
        "DRIVER PID",
        "MODE",
        "COMPLETED",
        "FAILED",
        "RESTARTS",
        "LAST OUTAGE ms",
        "P99 OUTAGE ms",
        "DRIVER RSS",
        "BACKEND",
    ]);
    for d in &report.devices {
        t.row(vec![
            d.name.clone(),
            d.state.as_str().into(),
            if d.driver_pid != 0 { d.driver_pid.to_string() } else { "-".into() },
            d.mode.clone(),
            d.requests_completed.to_string(),
            d.requests_failed.to_string(),
            d.restarts.to_string(),
            ms(d.last_outage_ms),
            ms(d.p99_outage_ms),
            mib(d.driver_memory.map(|m| m.total_kib)),
            d.backend.clone(),
        ]);
    }
    print!("{}", t.render());
    let fe = &report.frontend;
    println!(
        "frontend pid {}: rss {} (private {}, shared {})",
        fe.pid,
        mib(fe.rss.map(|r| r.total_kib)),
        mib(fe.rss.map(|r| r.anon_kib)),
        mib(fe.rss.map(|r| r.shmem_kib))
    );
    match &report.fuse {
        Some(FuseStatus::IoUring { queues, depth }) => println!("fuse: io_uring, {queues} rings x {depth} requests"),
        Some(FuseStatus::DevFuse { threads, why_not_io_uring: Some(why) }) => {
            println!("fuse: /dev/fuse, {threads} threads (not io_uring: {why})")
        }
        Some(FuseStatus::DevFuse { threads, why_not_io_uring: None }) => println!("fuse: /dev/fuse, {threads} threads"),
        None => {}
    }
    for d in &report.devices {
        let name = &d.name;
        if let Some(pid) = d.tap_pid {
            println!("{name}: tap domain pid {pid} ({}), rss {}", d.tap, mib(d.tap_memory.map(|m| m.total_kib)));
        }
        if !d.filters.is_empty() {
            println!("{name}: filters ({}), frontend side first:", d.tap);
            for f in &d.filters {
                println!("  {:<9} {}", f.report.type_name(), f.summary);
            }
        }
        if let Some(card) = &d.card {
            let st = &card.stats;
            let model = if card.model_pid != 0 { format!("model pid {}", card.model_pid) } else { "no model running".into() };
            println!(
                "{name}: card {}, {model} (started {}x): {} commands ({} refused, {} stops), {} interrupts, \
                 {} trapped writes from {} drivers, {} resets",
                card.card,
                card.model_starts,
                st.model.commands,
                st.model.refused,
                st.model.stops,
                st.model.interrupts,
                st.trapped_writes,
                st.drivers,
                st.model.resets
            );
        }
        if let Some(f) = &d.failure {
            println!("{name}: {f}");
        }
        if !d.views.is_empty() {
            println!("{name}: views:");
            let mut t = Table::new(&["VIEW", "OFFSET", "SIZE", "ACCESS", "QOS", "CREDIT", "MiB/s", "IOPS", "COMPLETED"]);
            for v in &d.views {
                t.row(vec![
                    v.name.clone(),
                    v.offset.to_string(),
                    v.size_bytes.to_string(),
                    if v.read_only { "ro".into() } else { "rw".into() },
                    v.qos_summary.clone(),
                    format!("{} B, {} req", v.credit_bytes, v.credit_ios),
                    format!("{:.1}", v.throughput_mib_s),
                    format!("{:.0}", v.iops),
                    v.requests_completed.to_string(),
                ]);
            }
            print!("{}", t.render());
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// `bulkhead qos VIEW [KEY=VALUE …]`: shows or changes a running view's QoS.
pub fn qos(run_dir: &Path, view: &str, settings: &[String]) -> anyhow::Result<ExitCode> {
    let mut set = std::collections::BTreeMap::new();
    for s in settings {
        let (k, v) =
            s.split_once('=').with_context(|| format!("`{s}` is not KEY=VALUE (keys: {})", bulkhead_qos::KEYS.join(", ")))?;
        set.insert(k.trim().to_string(), v.trim().to_string());
    }
    let a = ask(run_dir, SetQos { view: view.into(), set })?;
    println!("{view}: {}", a.summary);
    Ok(ExitCode::SUCCESS)
}
