//! `bulkhead-bench surge` end to end on a small run: a bulkhead scheduler and a kernel one,
//! the simulator beside, outputs written, the loop device as it was, nothing left behind.

#[path = "../common/mod.rs"]
mod common;

use bulkhead_testkit::require_kernel;
use common::*;

#[test]
fn bench_surge_measures_schedulers_through_a_vpt_beside_the_simulator_and_cleans_up() {
    require_kernel!();
    if !tools(&["mkfs.ext4"]) {
        return;
    }
    let has_deadline = std::fs::read_dir("/sys/block")
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("loop"))
        .any(|e| std::fs::read_to_string(e.path().join("queue/scheduler")).unwrap_or_default().contains("mq-deadline"));
    let kernel = if has_deadline { "mq-deadline" } else { "none" };
    let tmp = TempDir::new("bench-surge");
    let out_dir = tmp.path().join("out");
    let before = leftovers("bh-surge-");
    let reads = 600;
    let (n_reads, schedulers) = (reads.to_string(), format!("cats,{kernel}"));
    let (stdout, _) = bench(
        300,
        &["surge", "--reads", &n_reads, "--processes", "8", "--files", "60", "--size", "256M", "--modes", "direct,cached"]
            .into_iter()
            .chain(["--schedulers", &schedulers, "--sim", "cats", "--out", out_dir.to_str().unwrap()])
            .collect::<Vec<_>>(),
    );
    assert!(stdout.contains("O_DIRECT") && stdout.contains("non-O_DIRECT") && stdout.contains("sim cats"), "{stdout}");
    let report: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(out_dir.join("report.json")).unwrap()).unwrap();
    assert_eq!(report["skipped"].as_array().unwrap().len(), 0, "{report}");
    let rows = report["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 6, "2 schedulers measured and 1 simulated, in 2 modes: {report}");
    let extents = report["extents"].as_u64().unwrap();
    assert!(extents >= 60, "every file's place was read back: {extents}");
    for r in rows {
        assert_eq!(r["reads"], reads, "every page read done and counted: {r}");
        let requests = r["requests"].as_u64().unwrap();
        assert!(requests > 0 && r["mean_service_ms"].as_f64().unwrap() > 0.0, "{r}");
        assert!(r["mean_response_ms"].as_f64().unwrap() >= r["mean_service_ms"].as_f64().unwrap() * 0.9, "{r}");
        if r["mode"] == "direct" && r["source"] == "sim" {
            // With O_DIRECT each page read is one request of the device.
            assert_eq!(requests, reads, "{r}");
        } else if r["mode"] == "direct" {
            // The filesystem reads the odd block of metadata too, and a kernel scheduler merges
            // two processes' reads of neighbouring pages.
            assert!((reads * 9 / 10..=reads + 16).contains(&requests), "{r}");
        } else {
            assert!(requests < reads, "the page cache serves files read again: {r}");
        }
        if r["source"] == "measured" {
            assert!(r["late_fraction"].as_f64().unwrap() < 0.5, "{r}");
        }
    }
    let cats = rows.iter().find(|r| r["source"] == "measured" && r["label"] == "cats").unwrap();
    assert_eq!(cats["device_depth"], 1);
    assert!(cats["mean_wait_ms"].as_f64().unwrap() > 0.0, "requests waited in bulkhead's scheduler: {cats}");
    let k = rows.iter().find(|r| r["label"] == format!("kernel {kernel}")).unwrap();
    if kernel == "mq-deadline" {
        assert_eq!(k["device_depth"], 4, "the kernel's scheduler dispatches at its least depth: {k}");
    }
    let svg = std::fs::read_to_string(out_dir.join("surge.svg")).unwrap();
    assert_eq!(svg.matches("<polyline").count(), 6);
    assert!(std::fs::read_to_string(out_dir.join("report.txt")).unwrap().contains("Mean response"));
    assert_eq!(leftovers("bh-surge-"), before, "no mount or loop device left behind");
}
