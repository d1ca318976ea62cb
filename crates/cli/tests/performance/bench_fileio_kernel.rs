//! `bulkhead-bench fileio` end to end on a small matrix: bulkhead and the native loop peer
//! measured in two rounds, outputs written, nothing left behind.

#[path = "../common/mod.rs"]
mod common;

use bulkhead_testkit::require_kernel;
use common::*;

#[test]
fn bench_fileio_measures_a_small_matrix_and_cleans_up() {
    require_kernel!();
    if !tools(&["sysbench", "mkfs.ext2"]) {
        return;
    }
    let tmp = TempDir::new("bench-fileio");
    let out_dir = tmp.path().join("out");
    let before = leftovers("bh-fileio-");
    let (stdout, stderr) = bench(
        300,
        &["fileio", "--modes", "rndrd,seqwr", "--threads", "1", "--backends", "ram", "--notify", "poll", "--peers", "native"]
            .into_iter()
            .chain(["--seconds", "1", "--rounds", "2", "--out", out_dir.to_str().unwrap()])
            .collect::<Vec<_>>(),
    );
    assert!(stderr.contains("8/8"), "the progress counts every round and reaches the end: {stderr}");
    assert!(stdout.contains("median of 2 rounds"), "{stdout}");
    assert!(stdout.contains("bulkhead-ram-poll") && stdout.contains("native") && stdout.contains("goals"), "{stdout}");
    let report: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(out_dir.join("report.json")).unwrap()).unwrap();
    let points = report["points"].as_array().unwrap();
    assert_eq!(points.len(), 4, "2 systems x 2 modes x 1 thread count: {report}");
    for p in points {
        let total = p["total_mibs"].as_f64().unwrap();
        assert!(total > 1.0, "a real measurement: {p}");
        let rounds: Vec<f64> = p["rounds_mibs"].as_array().unwrap().iter().map(|r| r.as_f64().unwrap()).collect();
        assert_eq!(rounds.len(), 2, "both rounds kept: {p}");
        assert_eq!(total, rounds.iter().cloned().fold(f64::INFINITY, f64::min), "the lower middle of two rounds: {p}");
    }
    let bulkhead_cpu: f64 =
        points.iter().filter(|p| p["system"] == "bulkhead-ram-poll").map(|p| p["server_cpu_cores"].as_f64().unwrap()).sum();
    assert!(bulkhead_cpu > 0.5, "a polling driver domain uses CPU, and it is counted: {bulkhead_cpu}");
    assert_eq!(std::fs::read_to_string(out_dir.join("points.csv")).unwrap().lines().count(), 5);
    assert_eq!(std::fs::read_to_string(out_dir.join("fileio.svg")).unwrap().matches("<polyline").count(), 4);
    assert_eq!(leftovers("bh-fileio-"), before, "no mount or loop device left behind");
}
