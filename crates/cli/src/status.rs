//! `bulkhead status`.

use std::path::Path;
use std::process::ExitCode;

use anyhow::Context;
use bulkhead_bench::Table;

fn mib(kib: Option<u64>) -> String {
    kib.map(|k| format!("{:.1} MiB", k as f64 / 1024.0)).unwrap_or_else(|| "-".into())
}

fn ms(v: &serde_json::Value) -> String {
    v.as_f64().map(|x| format!("{x:.1}")).unwrap_or_else(|| "-".into())
}

fn ask(run_dir: &Path, req: serde_json::Value) -> anyhow::Result<serde_json::Value> {
    let sock = run_dir.join("control.sock");
    if !sock.exists() {
        anyhow::bail!("no bulkhead serve is running on run dir {} ({} not found)", run_dir.display(), sock.display());
    }
    let answer =
        bulkhead_supervisor::control::request(&sock, &req).with_context(|| format!("cannot reach {}", sock.display()))?;
    if let Some(e) = answer.get("error").and_then(|e| e.as_str()) {
        anyhow::bail!("{e}");
    }
    Ok(answer)
}

pub fn restart(run_dir: &Path, device: &str) -> anyhow::Result<ExitCode> {
    let a = ask(run_dir, serde_json::json!({"cmd": "restart", "device": device}))?;
    println!("{device}: restarted, driver pid {}", a["driver_pid"]);
    Ok(ExitCode::SUCCESS)
}

/// Asks for a change to a running device (`tap`, `filter`) and prints the outcome.
pub fn change(run_dir: &Path, device: &str, mut req: serde_json::Value) -> anyhow::Result<ExitCode> {
    req["device"] = serde_json::Value::from(device);
    let a = ask(run_dir, req)?;
    println!("{device}: changed; new driver pid {}", a["driver_pid"]);
    let status = ask(run_dir, serde_json::json!({"cmd": "status"}))?;
    if let Some(d) = status["devices"].as_array().into_iter().flatten().find(|d| d["name"] == device) {
        let names: Vec<&str> = d["filters"].as_array().into_iter().flatten().filter_map(|f| f["type"].as_str()).collect();
        let tap = d["tap"].as_str().unwrap_or("?");
        println!(
            "{device}: tap {tap}, filters (frontend side first): {}",
            if names.is_empty() { "none".into() } else { names.join(", ") }
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// `bulkhead snapshot DEVICE OP [NAME]`.
pub fn snapshot(run_dir: &Path, device: &str, op: &str, name: Option<&str>, json: bool) -> anyhow::Result<ExitCode> {
    if op != "list" && name.is_none() {
        anyhow::bail!("snapshot {op} needs a NAME");
    }
    let a = ask(run_dir, serde_json::json!({"cmd": "snapshot", "device": device, "op": op, "name": name}))?;
    if op != "list" {
        let done = match op {
            "create" => "taken",
            "revert" => "reverted to",
            _ => "deleted",
        };
        println!("{device}: snapshot `{}` {done}; driver pid {}", name.unwrap_or_default(), a["driver_pid"]);
        return Ok(ExitCode::SUCCESS);
    }
    if json {
        println!("{}", serde_json::to_string_pretty(&a["snapshots"])?);
        return Ok(ExitCode::SUCCESS);
    }
    let list = a["snapshots"].as_array().cloned().unwrap_or_default();
    if list.is_empty() {
        println!("{device}: no snapshots");
        return Ok(ExitCode::SUCCESS);
    }
    let mut t = Table::new(&["ID", "NAME", "TAKEN (UTC)", "DISK SIZE"]);
    for s in &list {
        let size = s["disk_size"].as_u64().map(|b| format!("{:.1} MiB", b as f64 / 1048576.0)).unwrap_or_else(|| "-".into());
        t.row(vec![
            s["id"].as_str().unwrap_or("?").to_string(),
            s["name"].as_str().unwrap_or("?").to_string(),
            utc(s["date_sec"].as_u64().unwrap_or(0)),
            size,
        ]);
    }
    print!("{}", t.render());
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
    let report = ask(run_dir, serde_json::json!({"cmd": "status"}))?;
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
    for d in report["devices"].as_array().into_iter().flatten() {
        t.row(vec![
            d["name"].as_str().unwrap_or("?").into(),
            d["state"].as_str().unwrap_or("?").into(),
            d["driver_pid"].as_u64().filter(|&p| p != 0).map(|p| p.to_string()).unwrap_or_else(|| "-".into()),
            d["mode"].as_str().unwrap_or("?").into(),
            d["requests_completed"].to_string(),
            d["requests_failed"].to_string(),
            d["restarts"].to_string(),
            ms(&d["last_outage_ms"]),
            ms(&d["p99_outage_ms"]),
            mib(d["driver_memory"]["total_kib"].as_u64()),
            d["backend"].as_str().unwrap_or("?").into(),
        ]);
    }
    print!("{}", t.render());
    let fe = &report["frontend"];
    println!(
        "frontend pid {}: rss {} (private {}, shared {})",
        fe["pid"],
        mib(fe["rss"]["total_kib"].as_u64()),
        mib(fe["rss"]["anon_kib"].as_u64()),
        mib(fe["rss"]["shmem_kib"].as_u64())
    );
    let fuse = &report["fuse"];
    match fuse["transport"].as_str() {
        Some("io_uring") => println!("fuse: io_uring, {} rings x {} requests", fuse["queues"], fuse["depth"]),
        Some(_) => match fuse["why_not_io_uring"].as_str() {
            Some(why) => println!("fuse: /dev/fuse, {} threads (not io_uring: {why})", fuse["threads"]),
            None => println!("fuse: /dev/fuse, {} threads", fuse["threads"]),
        },
        None => {}
    }
    for d in report["devices"].as_array().into_iter().flatten() {
        let name = d["name"].as_str().unwrap_or("?");
        if let Some(pid) = d["tap_pid"].as_u64() {
            let tap = d["tap"].as_str().unwrap_or("?");
            println!("{name}: tap domain pid {pid} ({tap}), rss {}", mib(d["tap_memory"]["total_kib"].as_u64()));
        }
        let filters = d["filters"].as_array().map(Vec::as_slice).unwrap_or_default();
        if !filters.is_empty() {
            println!("{name}: filters ({}), frontend side first:", d["tap"].as_str().unwrap_or("?"));
            for f in filters {
                println!("  {:<9} {}", f["type"].as_str().unwrap_or("?"), f["summary"].as_str().unwrap_or(""));
            }
        }
        let card = &d["card"];
        if let Some(card_name) = card["card"].as_str() {
            let st = &card["stats"];
            let model = match card["model_pid"].as_u64().filter(|&p| p != 0) {
                Some(pid) => format!("model pid {pid}"),
                None => "no model running".into(),
            };
            println!(
                "{name}: card {card_name}, {model} (started {}x): {} commands ({} refused, {} stops), {} interrupts, \
                 {} trapped writes from {} drivers, {} resets",
                card["model_starts"],
                st["commands"],
                st["refused"],
                st["stops"],
                st["interrupts"],
                st["trapped_writes"],
                st["drivers"],
                st["resets"]
            );
        }
        if let Some(f) = d["failure"].as_str() {
            println!("{}: {f}", d["name"].as_str().unwrap_or("?"));
        }
        let views = d["views"].as_array().map(Vec::as_slice).unwrap_or_default();
        if !views.is_empty() {
            println!("{name}: views:");
            let mut t = Table::new(&["VIEW", "OFFSET", "SIZE", "ACCESS", "QOS", "CREDIT", "MiB/s", "IOPS", "COMPLETED"]);
            for v in views {
                t.row(vec![
                    v["name"].as_str().unwrap_or("?").into(),
                    v["offset"].to_string(),
                    v["size_bytes"].to_string(),
                    if v["read_only"].as_bool() == Some(true) { "ro".into() } else { "rw".into() },
                    v["qos_summary"].as_str().unwrap_or("?").into(),
                    format!("{} B, {} req", v["credit_bytes"], v["credit_ios"]),
                    format!("{:.1}", v["throughput_mib_s"].as_f64().unwrap_or(0.0)),
                    format!("{:.0}", v["iops"].as_f64().unwrap_or(0.0)),
                    v["requests_completed"].to_string(),
                ]);
            }
            print!("{}", t.render());
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// `bulkhead qos VIEW [KEY=VALUE …]`: shows or changes a running view's QoS.
pub fn qos(run_dir: &Path, view: &str, settings: &[String]) -> anyhow::Result<ExitCode> {
    let mut set = serde_json::Map::new();
    for s in settings {
        let (k, v) =
            s.split_once('=').with_context(|| format!("`{s}` is not KEY=VALUE (keys: {})", bulkhead_qos::KEYS.join(", ")))?;
        set.insert(k.trim().to_string(), serde_json::Value::from(v.trim()));
    }
    let a = ask(run_dir, serde_json::json!({"cmd": "qos", "view": view, "set": set}))?;
    println!("{view}: {}", a["summary"].as_str().unwrap_or("?"));
    Ok(ExitCode::SUCCESS)
}
