//! The chaos run, short: `bulkhead-bench chaos --minutes 2`. Faults of every kind at random
//! (domains SIGKILLed and SIGSTOPped, a filter added and removed, a tap mode switched,
//! snapshots, the remote NBD server restarted) under fio verify on six ext4 file systems, over
//! FUSE and NBD, on a device of each kind. Nothing may be lost: no I/O error, no block that
//! does not verify, every file system clean, no device failed. Nothing is left behind.

#[path = "../common/mod.rs"]
mod common;

use bulkhead_testkit::require_kernel;
use common::*;

#[test]
fn two_minutes_of_faults_of_every_kind_lose_nothing_under_fio_verify_on_ext4() {
    require_kernel!();
    if !tools(&["fio", "nbdkit", "nbdfuse", "qemu-img", "cryptsetup"]) {
        return;
    }
    let loops_before = sh("losetup", &["-a"]).lines().count();
    let (stdout, _stderr) = bench(600, &["chaos", "--minutes", "2", "--seed", "59", "--json"]);
    let r: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    let n = |k: &str| r[k].as_f64().unwrap_or_else(|| panic!("{k} in {r}"));
    assert_eq!((n("app_errors"), n("verify_failures")), (0.0, 0.0), "{r}");
    assert!(r["failed_devices"].as_array().unwrap().is_empty(), "{r}");
    assert!(r["fault_errors"].as_array().unwrap().is_empty(), "{r}");
    let filesystems = r["filesystems"].as_array().unwrap();
    assert_eq!(filesystems.len(), 6, "{r}");
    for fs in filesystems {
        assert_eq!(fs["fio_error"], 0, "{fs}");
        assert_eq!(fs["fsck_clean"], true, "{fs}");
        assert!(fs["written_mib"].as_f64().unwrap() > 0.0, "{fs}");
    }
    // Every kind of fault landed, and many of them: about 150 a minute here.
    let faults = r["faults"].as_object().unwrap();
    for kind in [
        "SIGKILL driver domain",
        "SIGKILL tap domain",
        "filter added",
        "filter removed",
        "tap mode switched",
        "snapshot created",
        "remote NBD server restarted",
    ] {
        assert!(faults.get(kind).and_then(|v| v.as_u64()).unwrap_or(0) > 0, "no `{kind}`: {r}");
    }
    let stops = ["SIGSTOP driver domain", "SIGSTOP driver domain, idle (resumed)"];
    assert!(stops.iter().any(|k| faults.get(*k).and_then(|v| v.as_u64()).unwrap_or(0) > 0), "no SIGSTOP: {r}");
    assert!(n("total_faults") >= 100.0, "{r}");
    assert!(n("outages") > 0.0, "{r}");
    eprintln!(
        "chaos, 2 min: {} faults, outage p50 {:.1} ms p99 {:.1} ms max {:.1} ms, serve {:.0} → {:.0} → {:.0} MiB",
        r["total_faults"],
        n("outage_p50_ms"),
        n("outage_p99_ms"),
        n("outage_max_ms"),
        n("rss_start_mib"),
        n("rss_before_mib"),
        n("rss_after_mib")
    );
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(!mounts.contains("bulkhead-chaos"), "a mount is left: {mounts}");
    assert_eq!(sh("losetup", &["-a"]).lines().count(), loops_before, "a loop device is left");
}
