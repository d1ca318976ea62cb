//! Overload, the short version of `bulkhead-bench overload`: 16 NBD clients at a queue depth
//! of 128 on one device, a FUSE user beside them, a slowloris and a client that never reads its
//! answers. Nothing the protocol allows is refused, no connection is dropped, every client
//! gets at least half of its fair share, the FUSE user is served, serve's private memory grows
//! within the export's bound, and the slowloris is closed at the negotiation deadline (10 s)
//! rather than held. docs/BENCHMARKS.md ("Overload") records the full run.

#[path = "../common/mod.rs"]
mod common;

use bulkhead_testkit::require_kernel;
use common::*;

#[test]
fn sixteen_deep_nbd_clients_a_slowloris_and_a_client_that_never_reads_are_served_fairly_within_the_memory_bound() {
    require_kernel!();
    let (stdout, _) = bench(180, &["overload", "--clients", "16", "--depth", "128", "--seconds", "12", "--json"]);
    let r: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    let n = |k: &str| r[k].as_f64().unwrap_or_else(|| panic!("{k} in {r}"));
    assert!(n("completed") > 16.0 * 128.0, "{r}");
    assert_eq!((n("refused"), n("dropped")), (0.0, 0.0), "{r}");
    let slow = n("slowloris_closed_after_s");
    assert!((9.5..12.5).contains(&slow), "the slowloris was closed after {slow} s, not at the 10 s deadline: {r}");
    assert!(n("unread_requests") > 0.0, "{r}");
    assert!(n("min_share") >= 0.5, "a client starved: {r}");
    // One read at a time behind 16 deep clients taking turns at the queues: tens of
    // milliseconds each, hundreds in 12 s (none at all before the turns).
    assert!(n("fuse_reads") >= 20.0, "the FUSE user starved: {r}");
    let (before, peak, bound) = (n("rss_before_mib"), n("rss_peak_mib"), n("growth_bound_mib"));
    assert!(before > 0.0 && peak <= before + bound, "serve grew beyond its bound: {r}");
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
