//! Overload, the short version of `bulkhead bench overload`: 16 NBD clients at a queue depth
//! of 128 on one device, a FUSE user beside them, a slowloris and a client that never reads its
//! answers. Nothing the protocol allows is refused, no connection is dropped, and the
//! slowloris is closed at the negotiation deadline (10 s) rather than held. The shares of the
//! clients and the FUSE user's latency are printed; docs/BENCHMARKS.md ("Overload") records
//! them against their goals.

mod common;

use std::process::Command;

use bulkhead_testkit::require_kernel;
use common::*;

#[test]
fn sixteen_deep_nbd_clients_a_slowloris_and_a_client_that_never_reads_are_served_without_a_refusal() {
    require_kernel!();
    let out = Command::new("timeout")
        .args(["180", exe(), "bench", "overload", "--clients", "16", "--depth", "128", "--seconds", "12", "--json"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    let r: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    let n = |k: &str| r[k].as_f64().unwrap_or_else(|| panic!("{k} in {r}"));
    assert!(n("completed") > 16.0 * 128.0, "{r}");
    assert_eq!((n("refused"), n("dropped")), (0.0, 0.0), "{r}");
    let slow = n("slowloris_closed_after_s");
    assert!((9.5..12.5).contains(&slow), "the slowloris was closed after {slow} s, not at the 10 s deadline: {r}");
    assert!(n("unread_requests") > 0.0, "{r}");
    assert!(n("rss_peak_mib") > 0.0, "{r}");
    eprintln!(
        "overload, 16 × 128: {} requests, shares {:.3}..{:.2} of fair, FUSE {} reads (p99 {:.0} µs), serve {:.0} → {:.0} MiB",
        r["completed"],
        n("min_share"),
        n("max_share"),
        r["fuse_reads"],
        n("fuse_p99_us"),
        n("rss_before_mib"),
        n("rss_peak_mib")
    );
    assert!(!std::fs::read_to_string("/proc/self/mountinfo").unwrap().contains("bulkhead-bench-overload"), "a mount is left");
}
