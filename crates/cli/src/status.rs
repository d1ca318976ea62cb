//! `bulkhead status`.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context;
use bulkhead_control::table::Table;
use bulkhead_control::{
    Call, Changed, Client, DeviceState, FuseStatus, ListSnapshots, Restart, SetQos, Snapshot, SnapshotAction, Status,
    StatusReport,
};

fn mib(kib: Option<u64>) -> String {
    kib.map(|k| format!("{:.1} MiB", k as f64 / 1024.0)).unwrap_or_else(|| "-".into())
}

fn ms(v: Option<f64>) -> String {
    v.map(|x| format!("{x:.1}")).unwrap_or_else(|| "-".into())
}

/// How a command prints its result: text for people, or JSON (`--json`) for programs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Out {
    Text,
    Json,
}

impl Out {
    /// Prints `value` as JSON and says so, or says it printed nothing (the caller prints text).
    pub fn json<T: serde::Serialize>(self, value: &T) -> anyhow::Result<bool> {
        if self == Out::Json {
            println!("{}", serde_json::to_string_pretty(value)?);
        }
        Ok(self == Out::Json)
    }
}

/// Makes `call` to the `serve` of `run_dir`.
pub fn ask<C: Call>(run_dir: &Path, call: C) -> anyhow::Result<C::Reply> {
    Ok(Client::connect(run_dir)?.call(call)?)
}

/// `bulkhead device restart DEVICE`.
pub fn restart(run_dir: &Path, device: &str, out: Out) -> anyhow::Result<ExitCode> {
    let a = ask(run_dir, Restart { device: device.into() })?;
    if out.json(&a)? {
        return Ok(ExitCode::SUCCESS);
    }
    println!("{device}: restarted, driver pid {}", a.driver_pid);
    Ok(ExitCode::SUCCESS)
}

/// Activates or deactivates a device and prints what it is now, and its geometry as
/// `device activate --expect` takes it.
pub fn activity<C: Call<Reply = bulkhead_control::Activity>>(run_dir: &Path, call: C, out: Out) -> anyhow::Result<ExitCode> {
    let a = ask(run_dir, call)?;
    if out.json(&a)? {
        return Ok(ExitCode::SUCCESS);
    }
    let now = if a.active { "active: it writes" } else { "inactive: writes are refused" };
    let done = if a.changed { "" } else { " (already)" };
    println!("{}: {now}{done}; driver pid {}", a.device, a.driver_pid);
    let g = a.geometry;
    println!("geometry: size={},block={},read_only={}", g.size_bytes, g.block_size, g.read_only);
    Ok(ExitCode::SUCCESS)
}

/// Asks for a change to a running device (`device tap`, `filter`) and prints the outcome: the
/// new driver pid, the tap mode and the filters now in force.
pub fn change<C: Call<Reply = Changed>>(run_dir: &Path, device: &str, call: C, out: Out) -> anyhow::Result<ExitCode> {
    let mut client = Client::connect(run_dir)?;
    let a = client.call(call)?;
    let status = client.call(Status {})?;
    let now = status.devices.iter().find(|d| d.name == device);
    let names: Vec<&str> = now.map(|d| d.filters.iter().map(|f| f.report.type_name()).collect()).unwrap_or_default();
    let json = serde_json::json!({
        "device": device,
        "driver_pid": a.driver_pid,
        "tap": now.map(|d| d.tap.to_string()),
        "filters": names,
    });
    if out.json(&json)? {
        return Ok(ExitCode::SUCCESS);
    }
    println!("{device}: changed; new driver pid {}", a.driver_pid);
    if let Some(d) = now {
        println!(
            "{device}: tap {}, filters (frontend side first): {}",
            d.tap,
            if names.is_empty() { "none".into() } else { names.join(", ") }
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// `bulkhead snapshot create|list|revert|delete DEVICE [NAME]`.
pub fn snapshot(
    run_dir: &Path,
    device: &str,
    op: Option<SnapshotAction>,
    name: Option<&str>,
    out: Out,
) -> anyhow::Result<ExitCode> {
    let Some(op) = op else {
        let list = ask(run_dir, ListSnapshots { device: device.into() })?.snapshots;
        if out.json(&list)? {
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
    if out.json(&a)? {
        return Ok(ExitCode::SUCCESS);
    }
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

/// `bulkhead status`'s exit status, for health checks: the worst that holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Health {
    /// `serve` answers and every device runs.
    Running = 0,
    /// A device is degraded: its remote server is being reconnected (I/O waits or fails).
    Degraded = 1,
    /// A device has failed (I/O fails) or stopped.
    Failed = 2,
    /// No `serve` answers.
    NotRunning = 3,
}

impl Health {
    /// What `report` says of the devices' health.
    pub fn of(report: &StatusReport) -> Health {
        report
            .devices
            .iter()
            .map(|d| match d.state {
                DeviceState::Running => Health::Running,
                DeviceState::Reconnecting => Health::Degraded,
                DeviceState::Failed | DeviceState::Stopped => Health::Failed,
            })
            .max()
            .unwrap_or(Health::Running)
    }
}

/// `bulkhead status`: exits with its [`Health`], also when no `serve` answers (the reason on
/// standard error).
pub fn run(run_dir: anyhow::Result<PathBuf>, out: Out) -> anyhow::Result<ExitCode> {
    let report = match run_dir.and_then(|d| ask(&d, Status {})) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("bulkhead: {e:#}");
            return Ok(ExitCode::from(Health::NotRunning as u8));
        }
    };
    let health = Health::of(&report);
    if out.json(&report)? {
        return Ok(ExitCode::from(health as u8));
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
            if d.active { d.state.as_str().into() } else { format!("{} (inactive)", d.state.as_str()) },
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
    let sp = &report.spares;
    if sp.wanted > 0 || sp.started > 0 {
        let pids: Vec<String> = sp.ready.iter().map(|p| p.pid.to_string()).collect();
        let private: u64 = sp.ready.iter().filter_map(|p| p.rss.map(|r| r.anon_kib)).sum();
        println!(
            "spare domains: {} of {} ready (pids {}; private {} in all), {} taken, {} lost, {} started",
            sp.ready.len(),
            sp.wanted,
            if pids.is_empty() { "-".into() } else { pids.join(" ") },
            mib(Some(private)),
            sp.taken,
            sp.lost,
            sp.started
        );
    }
    for d in report.devices.iter().filter(|d| d.standby.is_some() || d.tap_standby.is_some() || d.standby_restarts > 0) {
        let waiting = |s: &Option<bulkhead_control::ProcessMemory>| match s {
            Some(p) => format!("pid {} waiting (private {})", p.pid, mib(p.rss.map(|r| r.anon_kib))),
            None => "none waiting".into(),
        };
        let tap = match &d.tap_standby {
            Some(_) => format!(", tap domain {}", waiting(&d.tap_standby)),
            None => String::new(),
        };
        println!(
            "standby domain of {}: {}{tap}; {} of {} restarts taken by one",
            d.name,
            waiting(&d.standby),
            d.standby_restarts,
            d.restarts
        );
    }
    match &report.fuse {
        Some(FuseStatus::IoUring { queues, depth }) => println!("fuse: io_uring, {queues} rings x {depth} requests"),
        Some(FuseStatus::DevFuse { threads, why_not_io_uring: Some(why) }) => {
            println!("fuse: /dev/fuse, {threads} threads (not io_uring: {why})")
        }
        Some(FuseStatus::DevFuse { threads, why_not_io_uring: None }) => println!("fuse: /dev/fuse, {threads} threads"),
        None => {}
    }
    for u in report.ublk.iter().flatten() {
        println!(
            "ublk: {} is {}{}, {} queues x {}: {} requests, {} failed",
            u.path.display(),
            u.device,
            if u.recovered { " (taken over from the serve before)" } else { "" },
            u.queues,
            u.depth,
            u.taken,
            u.failed
        );
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
    Ok(ExitCode::from(health as u8))
}

/// `bulkhead view qos VIEW [KEY=VALUE …]`: shows or changes a running view's QoS.
pub fn qos(run_dir: &Path, view: &str, settings: &[String], out: Out) -> anyhow::Result<ExitCode> {
    let mut set = std::collections::BTreeMap::new();
    for s in settings {
        let (k, v) =
            s.split_once('=').with_context(|| format!("`{s}` is not KEY=VALUE (keys: {})", bulkhead_qos::KEYS.join(", ")))?;
        set.insert(k.trim().to_string(), v.trim().to_string());
    }
    let a = ask(run_dir, SetQos { view: view.into(), set })?;
    if out.json(&a)? {
        return Ok(ExitCode::SUCCESS);
    }
    println!("{view}: {}", a.summary);
    Ok(ExitCode::SUCCESS)
}

/// `bulkhead device add FILE|-`.
pub fn add_devices(run_dir: &Path, file: &Path, out: Out) -> anyhow::Result<ExitCode> {
    let table = if file == Path::new("-") {
        let mut s = String::new();
        std::io::Read::read_to_string(&mut std::io::stdin(), &mut s).context("cannot read standard input")?;
        s
    } else {
        std::fs::read_to_string(file).with_context(|| format!("cannot read {}", file.display()))?
    };
    let added = ask(run_dir, bulkhead_control::AddDevice { table })?;
    if out.json(&added)? {
        return Ok(ExitCode::SUCCESS);
    }
    for d in added.devices {
        let views = if d.views.is_empty() { String::new() } else { format!(" with views {}", d.views.join(", ")) };
        let on = if d.exports.is_empty() { "not exported".to_string() } else { format!("exported on {}", d.exports.join(", ")) };
        println!("{}: added{views}, {on}", d.name);
    }
    Ok(ExitCode::SUCCESS)
}

/// `bulkhead device remove NAME [--force]`.
pub fn remove_device(run_dir: &Path, name: &str, force: bool, out: Out) -> anyhow::Result<ExitCode> {
    let r = ask(run_dir, bulkhead_control::RemoveDevice { name: name.into(), force })?;
    if out.json(&r)? {
        return Ok(ExitCode::SUCCESS);
    }
    if r.cut_off.is_empty() {
        println!("{name}: removed");
    } else {
        println!("{name}: removed; cut off: {}", r.cut_off.join("; "));
    }
    Ok(ExitCode::SUCCESS)
}

/// `bulkhead view add DEVICE LINES...|-`.
pub fn add_view(run_dir: &Path, device: &str, lines: &[String], out: Out) -> anyhow::Result<ExitCode> {
    let table = if lines == ["-"] {
        let mut s = String::new();
        std::io::Read::read_to_string(&mut std::io::stdin(), &mut s).context("cannot read standard input")?;
        s
    } else {
        lines.join("\n")
    };
    let r = ask(run_dir, bulkhead_control::AddView { device: device.into(), table })?;
    if out.json(&r)? {
        return Ok(ExitCode::SUCCESS);
    }
    let on = if r.exports.is_empty() { "not exported".to_string() } else { format!("exported on {}", r.exports.join(", ")) };
    println!("{}: added to {}, {on}", r.name, r.device);
    Ok(ExitCode::SUCCESS)
}

/// `bulkhead view remove NAME [--force]`.
pub fn remove_view(run_dir: &Path, name: &str, force: bool, out: Out) -> anyhow::Result<ExitCode> {
    let r = ask(run_dir, bulkhead_control::RemoveView { name: name.into(), force })?;
    if out.json(&r)? {
        return Ok(ExitCode::SUCCESS);
    }
    if r.cut_off.is_empty() {
        println!("{name}: removed from {}", r.device);
    } else {
        println!("{name}: removed from {}; cut off: {}", r.device, r.cut_off.join("; "));
    }
    Ok(ExitCode::SUCCESS)
}

/// `bulkhead config dump`: the TOML, or with `--json` the same tables as JSON.
pub fn dump_config(run_dir: &Path, out: Out) -> anyhow::Result<ExitCode> {
    let text = ask(run_dir, bulkhead_control::DumpConfig {})?.toml;
    let table: toml::Table = text.parse().context("serve dumped TOML that does not parse")?;
    if !out.json(&table)? {
        print!("{text}");
    }
    Ok(ExitCode::SUCCESS)
}

/// `bulkhead reload`.
pub fn reload(run_dir: &Path, out: Out) -> anyhow::Result<ExitCode> {
    let r = ask(run_dir, bulkhead_control::Reload {})?;
    if out.json(&r)? {
        return Ok(ExitCode::SUCCESS);
    }
    println!("reloaded {}", r.path);
    for d in &r.added {
        println!("  added {d}");
    }
    for d in &r.removed {
        println!("  removed {d}");
    }
    for c in &r.changed {
        println!("  {c}");
    }
    if r.added.is_empty() && r.removed.is_empty() && r.changed.is_empty() {
        println!("  nothing changed");
    }
    Ok(ExitCode::SUCCESS)
}

/// `bulkhead upgrade`: asks `serve` to hand over to the binary on disk, then waits until a
/// new `serve` answers on the control socket.
/// With `--json`, one object once it is over: the old serve's pid and keeper, the new one's pid
/// and version, the milliseconds since the request.
pub fn upgrade(run_dir: &Path, timeout: std::time::Duration, out: Out) -> anyhow::Result<ExitCode> {
    let started = std::time::Instant::now();
    let r = ask(run_dir, bulkhead_control::Upgrade {})?;
    if out == Out::Text {
        println!("serve (pid {}) is handing over ({} holds the descriptors)", r.pid, r.keeper);
    }
    let deadline = started + timeout;
    loop {
        if let Ok(h) = ask(run_dir, bulkhead_control::Hello {}) {
            if h.pid != r.pid {
                if let Some(why) = h.fell_back {
                    anyhow::bail!(
                        "the upgrade failed: {why}; serve (pid {}, version {}) runs the previous binary again, {} ms after the request",
                        h.pid,
                        h.version,
                        started.elapsed().as_millis()
                    );
                }
                let ms = started.elapsed().as_millis();
                let json = serde_json::json!({
                    "handed_over_by": r.pid, "keeper": r.keeper, "pid": h.pid, "version": h.version, "ms": ms
                });
                if !out.json(&json)? {
                    println!("serve (pid {}, version {}) is serving, {ms} ms after the request", h.pid, h.version);
                }
                return Ok(ExitCode::SUCCESS);
            }
        }
        if std::time::Instant::now() > deadline {
            anyhow::bail!("no new serve answered on {} within {} s", run_dir.join("control.sock").display(), timeout.as_secs());
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

/// `bulkhead top`: every device and view with its IOPS, MiB/s read and written, p99 latency
/// and restarts over the last interval, refreshed every `interval`; `frames` of them, or until
/// interrupted.
///
/// With `json`, each refresh is one line of JSON: `uptime_s` and, per device and view, its
/// `name`, `state`, `view_of`, `restarts`, and over the interval `iops`, `read_mib_s`,
/// `write_mib_s`, `p99_us` (an upper bound; null without requests) and `new_restarts`; the
/// rates are null in the first.
pub fn top(run_dir: &Path, interval: std::time::Duration, frames: Option<u64>, json: bool) -> anyhow::Result<ExitCode> {
    use std::collections::HashMap;
    use std::io::IsTerminal;
    let tty = std::io::stdout().is_terminal();
    let mut client = Client::connect(run_dir)?;
    let mut before: HashMap<String, (std::time::Instant, bulkhead_control::IoFigures, u64)> = HashMap::new();
    let mut shown = 0u64;
    loop {
        let report = client.call(Status {})?;
        let now = std::time::Instant::now();
        let mut t = Table::new(&["DEVICE", "STATE", "IOPS", "READ MiB/s", "WRITE MiB/s", "P99", "RESTARTS", "VIEW OF"]);
        let mut rows = Vec::new();
        let mut objects = Vec::new();
        for d in &report.devices {
            rows.push((d.name.clone(), format!("{:?}", d.state).to_lowercase(), d.io.clone(), d.restarts, String::new()));
            for v in &d.views {
                rows.push((v.name.clone(), "view".into(), v.io.clone(), d.restarts, d.name.clone()));
            }
        }
        for (name, state, io, restarts, of) in rows {
            let rates = before.get(&name).map(|(at, was, restarts_was)| {
                let secs = now.duration_since(*at).as_secs_f64().max(1e-3);
                let per = |a: u64, b: u64| a.saturating_sub(b) as f64 / secs;
                let mib = (1u64 << 20) as f64;
                (
                    per(io.requests, was.requests),
                    per(io.bytes_read, was.bytes_read) / mib,
                    per(io.bytes_written, was.bytes_written) / mib,
                    io.quantile_since(was, 0.99),
                    restarts.saturating_sub(*restarts_was),
                )
            });
            objects.push(serde_json::json!({
                "name": name, "state": state, "view_of": (!of.is_empty()).then_some(&of), "restarts": restarts,
                "iops": rates.map(|r| r.0), "read_mib_s": rates.map(|r| r.1), "write_mib_s": rates.map(|r| r.2),
                "p99_us": rates.and_then(|r| r.3), "new_restarts": rates.map(|r| r.4),
            }));
            let (iops, rd, wr, p99, new_restarts) = match (rates, before.get(&name)) {
                (Some((iops, rd, wr, p99, new_restarts)), Some((_, was, _))) => {
                    let p99 = match p99 {
                        Some(us) if us >= 1000 => format!("<{} ms", us / 1000),
                        Some(us) => format!("<{us} µs"),
                        None if io.requests > was.requests => {
                            format!(">{} s", io.latency_bounds_us.last().unwrap_or(&0) / 1_000_000)
                        }
                        None => "-".into(),
                    };
                    (format!("{iops:.0}"), format!("{rd:.1}"), format!("{wr:.1}"), p99, new_restarts)
                }
                _ => ("-".into(), "-".into(), "-".into(), "-".into(), 0),
            };
            let restarts_shown = if new_restarts > 0 { format!("{restarts} (+{new_restarts})") } else { restarts.to_string() };
            t.row(vec![name.clone(), state, iops, rd, wr, p99, restarts_shown, of]);
            before.insert(name, (now, io, restarts));
        }
        if json {
            println!("{}", serde_json::json!({ "uptime_s": report.uptime_s, "devices": objects }));
        } else {
            if tty {
                print!("\x1b[H\x1b[2J");
            }
            println!(
                "bulkhead top: {} device(s), serve up {:.0} s, every {:.1} s (interrupt to stop)",
                report.devices.len(),
                report.uptime_s,
                interval.as_secs_f64()
            );
            print!("{}", t.render());
            if !tty {
                println!();
            }
        }
        std::io::Write::flush(&mut std::io::stdout())?;
        shown += 1;
        if frames.is_some_and(|n| shown >= n) {
            return Ok(ExitCode::SUCCESS);
        }
        std::thread::sleep(interval);
    }
}
