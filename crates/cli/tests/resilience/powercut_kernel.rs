//! Power cuts, the short version of `bulkhead-bench powercut`: `serve` and every domain are
//! killed at a random moment under FUA and flushing writers, ten times on a raw file and ten
//! on a qcow2 image; every block must then hold what was acknowledged durable or a later
//! write, and the image must pass `qemu-img check`. Nothing is left mounted or running.

#[path = "../common/mod.rs"]
mod common;

use bulkhead_testkit::require_kernel;
use common::*;

#[test]
fn twenty_power_cuts_lose_nothing_acknowledged_and_leave_the_qcow2_image_consistent() {
    require_kernel!();
    if !tools(&["qemu-img"]) {
        return;
    }
    let (stdout, _stderr) = bench(300, &["powercut", "--rounds", "10", "--seed", "59", "--json"]);
    let report: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    let formats = report["formats"].as_array().unwrap();
    assert_eq!(formats.len(), 2, "{report}");
    for f in formats {
        let n = |k: &str| f[k].as_u64().unwrap_or_else(|| panic!("{k} in {f}"));
        assert_eq!(n("kills"), 10, "{f}");
        assert_eq!((n("lost"), n("torn"), n("check_errors")), (0, 0, 0), "{f}");
        // The cuts fell on a workload that was writing: FUA writes and flushes were acknowledged,
        // and after each cut the blocks written were read back and judged.
        assert!(n("fua_writes") > 0 && n("flushes") > 0 && n("writes") > n("fua_writes"), "{f}");
        assert!(n("blocks_checked") >= n("kills") * 100, "{f}");
        eprintln!(
            "{}: 10 cuts, {} writes acknowledged ({} FUA, {} flushes), {} blocks checked, 0 lost",
            f["format"],
            n("writes"),
            n("fua_writes"),
            n("flushes"),
            n("blocks_checked")
        );
    }
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(!mounts.contains("bulkhead-bench-powercut"), "a mount is left: {mounts}");
}
