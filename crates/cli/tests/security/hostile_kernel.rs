//! A driver domain turns hostile while a real workload runs through FUSE (the test driver,
//! `bulkhead-test-driver`, plays it): for each way of
//! misbehaving, the frontend must not crash, hang or corrupt a request. Protocol violations
//! break the channel (logged, rate-limited) and the supervisor replaces the domain; requests
//! without an answer are held and reissued, so the data written reads back intact.

#[path = "../common/mod.rs"]
mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use bulkhead_testkit::require_kernel;
use common::*;

/// serve's CPU time so far (user + system), seconds.
fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // Fields after the command name, which is in parentheses and may hold spaces.
    let rest = &stat[stat.rfind(')').unwrap() + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    (f[11].parse::<f64>().unwrap() + f[12].parse::<f64>().unwrap()) / hz
}

fn dd(args: &[&str]) {
    let mut a = vec!["--kill-after=5", "60", "dd"];
    a.extend_from_slice(args);
    a.push("status=none");
    let out = Command::new("timeout").args(&a).output().unwrap();
    assert!(out.status.success(), "dd {args:?}: {}", String::from_utf8_lossy(&out.stderr));
}

struct Outcome {
    restarts: u64,
    log: String,
    /// serve's CPU use during the workload, in cores.
    busy_cores: f64,
    /// serve's CPU use during a second with no I/O afterwards, in cores.
    idle_cores: f64,
}

/// Runs a write-then-verify workload against a domain that turns hostile as `mode` says.
fn survive(mode: &str, notify: &str) -> Option<Outcome> {
    let tmp = TempDir::new(&format!("hostile-{mode}"));
    let cfg = format!(
        "[[device]]\nname = \"h\"\nsize = \"64M\"\nnotify = \"{notify}\"\nwatchdog_ms = 200\nrestart_limit = 100000\n\
         [device.backend]\ntype = \"ram\"\n"
    );
    let fault = format!("hostile:{mode}");
    let serve = Serve::start_test_driver(&tmp.path().join("run"), Some(&cfg), &["h"], &[("BULKHEAD_TEST_FAULT", &fault)])?;
    let file = serve.fuse_file("h");
    let data = pattern(0x4057, 16 << 20);
    let src = tmp.path().join("src");
    std::fs::write(&src, &data).unwrap();
    let back = tmp.path().join("back");

    let cpu0 = cpu_seconds(serve.pid());
    let t0 = Instant::now();
    // 256 writes of 64 KiB from four writers at once (four FUSE threads, four queues), then
    // the same reads: the domain turns after 64 answers, and every replacement does too.
    std::thread::scope(|s| {
        for i in 0..4 {
            let (src, file) = (&src, &file);
            s.spawn(move || {
                let (skip, seek) = (format!("skip={}", i * 64), format!("seek={}", i * 64));
                dd(&[
                    &format!("if={}", src.display()),
                    &format!("of={}", file.display()),
                    "bs=64k",
                    "count=64",
                    &skip,
                    &seek,
                    "oflag=direct",
                    "conv=notrunc",
                ]);
            });
        }
    });
    dd(&[&format!("if={}", file.display()), &format!("of={}", back.display()), "bs=64k", "count=256", "iflag=direct"]);
    let busy_cores = (cpu_seconds(serve.pid()) - cpu0) / t0.elapsed().as_secs_f64();
    assert!(std::fs::read(&back).unwrap() == data, "{mode}: data read back differs");

    let cpu1 = cpu_seconds(serve.pid());
    let t1 = Instant::now();
    std::thread::sleep(Duration::from_secs(1));
    let idle_cores = (cpu_seconds(serve.pid()) - cpu1) / t1.elapsed().as_secs_f64();

    let st = serve.status_json();
    let d = &st["devices"][0];
    assert_eq!(d["state"], "running", "{mode}: {d}");
    let restarts = d["restarts"].as_u64().unwrap();
    Some(Outcome { restarts, log: serve.log_text(), busy_cores, idle_cores })
}

/// A protocol violation: detected, logged without flooding, the domain replaced, data intact.
fn violation(mode: &str, why: &[&str]) {
    require_kernel!();
    let Some(o) = survive(mode, "adaptive") else { return };
    assert!(o.log.contains(&format!("hostile test mode {mode}: misbehaving")), "{}", o.log);
    assert!(o.restarts >= 2, "{mode}: {} restarts\n{}", o.restarts, o.log);
    assert!(
        o.log.contains("channel broken") && why.iter().any(|w| o.log.contains(w)),
        "{mode}: expected one of {why:?} in\n{}",
        o.log
    );
    // Rate-limited: far fewer frontend lines than restarts, once restarts come quickly.
    // (The domains' own lines, relayed behind "domain PID:", are bounded by their relay.)
    let lines =
        o.log.lines().filter(|l| l.starts_with("bulkhead: device h:") && !l.starts_with("bulkhead: device h: domain ")).count()
            as u64;
    assert!(lines <= 2 * (o.restarts.min(4) + 2) + 6, "{mode}: {lines} log lines for {} restarts\n{}", o.restarts, o.log);
}

#[test]
fn corrupt_response_index_breaks_the_channel() {
    violation("corrupt-index", &["beyond outstanding requests"]);
}

#[test]
fn garbage_response_slot_breaks_the_channel() {
    violation("corrupt-slot", &["bad response"]);
}

#[test]
fn unknown_id_breaks_the_channel() {
    violation("unknown-id", &["unknown or duplicate id"]);
}

#[test]
fn duplicate_id_breaks_the_channel() {
    // Caught as a duplicate, or earlier as more responses than requests outstanding.
    violation("duplicate-id", &["unknown or duplicate id", "beyond outstanding requests"]);
}

#[test]
fn stale_generation_breaks_the_channel() {
    violation("stale-generation", &["stale generation"]);
}

#[test]
fn length_beyond_the_request_breaks_the_channel() {
    violation("wrong-length", &["length beyond the request"]);
}

#[test]
fn undefined_status_breaks_the_channel() {
    violation("bad-status", &["unknown status"]);
}

#[test]
fn out_of_order_answers_are_fine() {
    require_kernel!();
    let Some(o) = survive("out-of-order", "adaptive") else { return };
    assert_eq!(o.restarts, 0, "{}", o.log);
    assert!(!o.log.contains("channel broken"), "{}", o.log);
}

#[test]
fn domain_that_stops_answering_is_replaced_by_the_watchdog() {
    require_kernel!();
    let Some(o) = survive("stop-answering", "adaptive") else { return };
    assert!(o.restarts >= 2, "{} restarts\n{}", o.restarts, o.log);
    assert!(o.log.contains("answered nothing"), "{}", o.log);
}

#[test]
fn domain_that_exits_mid_request_is_replaced_and_the_requests_reissued() {
    require_kernel!();
    let Some(o) = survive("exit-mid-request", "adaptive") else { return };
    assert!(o.restarts >= 2, "{} restarts\n{}", o.restarts, o.log);
    assert!(o.log.contains("exited: exit status: 3"), "{}", o.log);
}

#[test]
fn doorbell_storm_costs_the_frontend_at_most_one_core() {
    require_kernel!();
    // irq mode: every wait sleeps on the doorbell, which is what a storm attacks.
    let Some(o) = survive("doorbell-storm", "irq") else { return };
    eprintln!("doorbell storm: frontend {:.2} cores under load, {:.3} idle", o.busy_cores, o.idle_cores);
    assert_eq!(o.restarts, 0, "{}", o.log);
    assert!(o.log.contains("ignoring it for"), "storm not noticed:\n{}", o.log);
    assert!(o.busy_cores <= 1.0, "frontend used {:.2} cores under the storm", o.busy_cores);
    assert!(o.idle_cores <= 0.1, "frontend used {:.2} cores while idle under the storm", o.idle_cores);
}

#[test]
fn log_flood_reaches_the_log_prefixed_escaped_and_rate_limited() {
    require_kernel!();
    let tmp = TempDir::new("hostile-log-flood");
    let cfg = "[[device]]\nname = \"h\"\nsize = \"64M\"\nnotify = \"adaptive\"\n[device.backend]\ntype = \"ram\"\n";
    let Some(mut serve) =
        Serve::start_test_driver(&tmp.path().join("run"), Some(cfg), &["h"], &[("BULKHEAD_TEST_FAULT", "hostile:log-flood")])
    else {
        return;
    };
    let file = serve.fuse_file("h");
    let data = pattern(0x10f1, 4 << 20);
    let src = tmp.path().join("src");
    let back = tmp.path().join("back");
    std::fs::write(&src, &data).unwrap();
    // The domain floods after 64 answers; the workload goes on through it.
    let t0 = Instant::now();
    dd(&[&format!("if={}", src.display()), &format!("of={}", file.display()), "bs=16k", "oflag=direct", "conv=notrunc"]);
    dd(&[&format!("if={}", file.display()), &format!("of={}", back.display()), "bs=16k", "count=256", "iflag=direct"]);
    assert!(std::fs::read(&back).unwrap() == data, "data read back differs");
    let st = serve.status_json();
    assert_eq!(st["devices"][0]["restarts"], 0, "{st}");
    assert!(serve.stop().success());
    let secs = t0.elapsed().as_secs_f64();
    let raw = std::fs::read(&serve.log).unwrap();
    let log = String::from_utf8_lossy(&raw);
    eprintln!("log-flood: {} bytes of log for 100,002 lines printed in {secs:.1} s", raw.len());
    if std::env::var("SHOW_LOG").is_ok() {
        eprintln!("{log}");
    }
    // Nothing raw: no escape, bell or carriage return reached the log.
    assert!(!raw.iter().any(|&b| b == 0x1b || b == 0x07 || b == b'\r'), "control bytes in the log");
    let prefix = "bulkhead: device h: domain ";
    // Every line the domain printed carries the prefix, so none poses as serve's own.
    for l in log.lines().filter(|l| l.contains("forged") || l.contains("flood line")) {
        assert!(l.starts_with(prefix), "unprefixed domain line: {l}");
    }
    let relayed = log.lines().filter(|l| l.starts_with(prefix)).count();
    let bound = 100.0 + 10.0 * secs + 3.0;
    assert!((relayed as f64) <= bound, "{relayed} domain lines in {secs:.1} s");
    assert!(relayed >= 100, "the burst was not let through: {relayed} lines\n{log}");
    assert!(log.contains("\\u{1b}[2J") && log.contains("\\xff\\xfe not utf-8\\u{7}"), "escapes not shown:\n{log}");
    assert!(log.contains("lines dropped (a domain may print 100 lines at once, then 10 a second)"), "{log}");
    // The 1 MiB line came first, inside the burst: kept, cut to 1024 characters, saying so.
    assert!(log.contains(&format!("{} … (1047552 more bytes cut)", "L".repeat(1024))), "{log}");
    assert!(raw.len() < 512 << 10, "log grew to {} bytes", raw.len());
}

/// `bulkhead-bench storm` runs end to end on a short window: a phase without the storm and one
/// with it, the victim read without error in both, the storm's rate read from the driver's
/// log, and nothing left behind.
#[test]
fn bench_storm_runs_a_phase_without_and_one_with_the_storm_and_reads_its_rate() {
    require_kernel!();
    let Some(driver) = Serve::test_driver() else { return };
    let out = Command::new("timeout")
        .arg("120")
        .arg(driver)
        .args(["bench", "storm", "--seconds", "6", "--rounds", "1", "--json"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    let r: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    let phases = r["phases"].as_array().unwrap();
    assert_eq!(phases.iter().map(|p| p["storm"].as_bool().unwrap()).collect::<Vec<_>>(), [false, true], "{r}");
    for p in phases {
        assert!(p["reads"].as_u64().unwrap() > 100 && p["errors"].as_u64() == Some(0), "{p}");
    }
    assert!(r["rings_per_s"].as_f64().unwrap() > 0.0, "the storm's rate was not read: {r}");
    eprintln!(
        "bench storm, 6 s: victim p99 {} µs without, {} µs with; frontend {} cores; {} rings/s",
        r["normal_p99_us"], r["storm_p99_us"], r["storm_frontend_cores"], r["rings_per_s"]
    );
    assert!(!std::fs::read_to_string("/proc/self/mountinfo").unwrap().contains("bulkhead-bench-storm"), "a mount is left");
}
