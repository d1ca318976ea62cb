//! Filters under write capture in a real device: faults injected into a guarded filter are
//! stopped before they land, the domain restarts, and fio's verified writes come back whole.
//! The faults are the test driver's (`bulkhead-test-driver`, told by
//! `BULKHEAD_TEST_GUARD_INJECT`): the shipped driver has no way to make them.

#[path = "../common/mod.rs"]
mod common;

use std::process::Command;

use bulkhead_testkit::require_kernel;
use common::*;

#[test]
fn injected_faults_in_a_guarded_filter_are_stopped_and_no_acknowledged_write_is_lost() {
    require_kernel!();
    if !tools(&["fio"]) {
        return;
    }
    let tmp = TempDir::new("guard-kernel");
    let trace = tmp.path().join("t.blktrace");
    // With protection keys `scdwc` stops every fault at any C. Without them the C pages it
    // keeps open include the runtime's rings, so a fault aimed there may land by design
    // (docs/guard.md, "Measured: isolation"); the faulting filter then runs under `dwc`.
    let keys = std::fs::read_to_string("/proc/cpuinfo").is_ok_and(|c| c.split_whitespace().any(|w| w == "ospke"));
    let guard = if keys { "guard = \"scdwc\"\nguard_cache = 20" } else { "guard = \"dwc\"" };
    let config = format!(
        "[nbd]\nenabled = false\n[[device]]\nname = \"g\"\nsize = \"64M\"\nrestart_limit = 100000\n\
         [device.backend]\ntype = \"ram\"\n\
         [[device.filter]]\ntype = \"trace\"\npath = \"{}\"\n{guard}\n\
         [[device.filter]]\ntype = \"stats\"\nguard = \"scdwc\"\n",
        trace.display()
    );
    // The trace filter, the first, faults at a random call of every 3000, with seed 7.
    let faults = [("BULKHEAD_TEST_GUARD_INJECT", "1:random:3000:7")];
    let Some(mut serve) = Serve::start_test_driver(&tmp.path().join("run"), Some(&config), &["g"], &faults) else {
        return;
    };
    let out = Command::new("timeout")
        .args(["--kill-after=10", "180", "fio", "--name=guard", "--direct=1", "--rw=randwrite", "--bs=4k"])
        .arg(format!("--filename={}", serve.fuse_file("g").display()))
        .args(["--size=24M", "--ioengine=psync", "--verify=crc32c", "--do_verify=1", "--verify_fatal=1"])
        .args(["--verify_state_save=0", "--output-format=json"])
        .output()
        .unwrap();
    let log = serve.log_text();
    assert!(
        out.status.success(),
        "fio: {}\n{}\n{log}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["jobs"][0]["error"], 0, "fio saw an I/O or verify error\n{log}");
    let injected = log.matches("injecting a fault from filter 1 (trace)").count();
    // The domain's own report of each stop (the supervisor's restart lines are rate-limited).
    let stopped = log.matches("which it may not write: stopped before the write").count();
    assert!(injected >= 2, "too few faults injected ({injected}) to show anything\n{log}");
    assert!(!log.contains("landed: not isolated"), "a fault landed (protection keys: {keys})\n{log}");
    assert!(stopped + 1 >= injected, "{injected} injected, {stopped} stopped\n{log}");
    let status = serve.status_json();
    assert!(status["devices"][0]["restarts"].as_u64().unwrap() >= 1, "{status}");
    serve.stop();
}
