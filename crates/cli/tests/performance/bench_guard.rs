//! `bulkhead-bench guard` on a few writes: every mechanism and mode measured, and the writes
//! it says were caught are the ones each mode should catch.

#[path = "../common/mod.rs"]
mod common;

use std::process::Command;

use common::bench_exe;

#[test]
fn bench_guard_catches_what_each_mode_should_for_both_mechanisms() {
    let writes = 640;
    let out = Command::new(bench_exe()).args(["guard", "--json", "--writes", &writes.to_string()]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(r["unguarded_ns"].as_f64().unwrap() > 0.0, "{r}");
    for m in ["userfaultfd", "mprotect"] {
        let row = |op: &str| {
            r["rows"]
                .as_array()
                .unwrap()
                .iter()
                .find(|x| x["mechanism"] == m && x["operation"].as_str().unwrap().starts_with(op))
                .unwrap_or_else(|| panic!("{m} {op}: {r}"))
                .clone()
        };
        assert_eq!(row("dwc: caught write")["caught"], writes, "{m}: every DWC write faults");
        assert_eq!(row("scdwc, cache miss")["caught"], writes, "{m}: C = 1 over 64 pages misses every time");
        assert_eq!(row("scdwc, cache hit")["caught"], 0, "{m}: C = 64 over 64 pages never misses");
        assert!(row("scdwc: the runtime's write")["caught"].as_u64().unwrap() > 0, "{m}");
        assert!(row("scdwc: protecting one pooled page")["ns"].as_f64().unwrap() > 0.0, "{m}");
    }
    if bulkhead_sys::pkey::supported() {
        let gated = r["rows"]
            .as_array()
            .unwrap()
            .iter()
            .find(|x| x["mechanism"] == "pkey" && x["operation"].as_str().unwrap().contains("gated"));
        assert!(gated.is_some_and(|g| g["ns"].as_f64().unwrap() > 0.0), "{r}");
    }
}

#[test]
fn bench_guard_refuses_fewer_writes_than_pages() {
    let out = Command::new(bench_exe()).args(["guard", "--writes", "1"]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--writes"), "{}", String::from_utf8_lossy(&out.stderr));
}

/// `bench guard --isolation`, a few faults per setting and population: the memory check sees
/// the faults DWC and SCDWC with no cache stop, and sees the targeted ones a cache of 256 pages
/// lets land (the pages the runtime keeps writing stay open), so it measures rather than echoes
/// the handler. The page gate, and protection keys where the processor has them, shut what
/// the same cache holds open for each call: none lands, in either population. The seed-like faults are
/// made only where DWC stops them, so DWC stops all of them; each filter's write working set
/// is counted. The faults are the test kit's: only a build with the `test-driver` feature
/// measures isolation.
#[test]
fn bench_guard_isolation_reads_what_each_fault_left() {
    let Some(driver) = common::Serve::test_driver() else {
        return;
    };
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: needs root (userfaultfd on shared memory, tracing the domain)");
        return;
    }
    let keys = bulkhead_sys::pkey::supported();
    let settings = if keys { "dwc,0,256,256+pages,256+keys" } else { "dwc,0,256,256+pages" };
    let out = Command::new(driver)
        .args(["bench", "guard", "--isolation", "--json", "--faults", "12", "--settings", settings])
        .args(["--population", "targeted,seed-like"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let all_rows = r["isolation"]["rows"].as_array().unwrap();
    let per = if keys { 5 } else { 4 };
    assert_eq!(all_rows.len(), 2 * per, "{r}");
    for row in all_rows {
        let all = &row["all"];
        let decided = all["isolated"].as_u64().unwrap() + all["landed"].as_u64().unwrap();
        assert_eq!(row["lost"], 0, "{row}");
        assert!(decided >= 10, "at most the ring's few words rewritten by the frontend: {row}");
        assert_eq!(row["disagreed"], 0, "the exit status and the memory agree: {row}");
    }
    let (rows, seed) = all_rows.split_at(per);
    assert!(rows.iter().all(|row| row["population"] == "targeted") && seed.iter().all(|row| row["population"] == "seed-like"));
    assert_eq!(seed[0]["all"]["landed"], 0, "the seed-like faults are made only where DWC stops them: {}", seed[0]);
    assert_eq!(seed[1]["all"]["landed"], 0, "SCDWC with no cache stops every seed-like fault: {}", seed[1]);
    for target in ["pointer", "overrun", "wild"] {
        assert!(seed[0]["by_target"].as_array().unwrap().iter().any(|t| t[0] == target), "{}", seed[0]);
    }
    let sets = r["isolation"]["working_sets"].as_array().unwrap();
    assert_eq!(sets.len(), r["isolation"]["filters"].as_array().unwrap().len(), "{r}");
    for w in sets {
        let (pages, guarded) = (w["pages"].as_u64().unwrap(), w["guarded"].as_u64().unwrap());
        assert!(pages > 0 && pages <= guarded, "{w}");
    }
    assert_eq!(rows[0]["all"]["landed"], 0, "DWC stops every fault: {}", rows[0]);
    assert_eq!(rows[1]["all"]["landed"], 0, "SCDWC with no cache stops every fault: {}", rows[1]);
    assert!(rows[2]["all"]["landed"].as_u64().unwrap() > 0, "a cache of 256 pages lets some land: {}", rows[2]);
    for (i, gate) in [(3, "pages"), (4, "keys")].into_iter().take(per - 3) {
        for row in [&rows[i], &seed[i]] {
            assert_eq!(row["gate"], gate, "{row}");
            assert_eq!(row["all"]["landed"], 0, "gated by {gate}, a cache of 256 pages lets none land: {row}");
        }
    }
    // The domain's heap is private, as a real domain's is: with every guarded filter page-gated,
    // its runtime's space is in a huge page to the end, read from the domain's memory as it exits.
    let thp = bulkhead_sys::thp::available();
    for row in all_rows {
        let decided = row["all"]["isolated"].as_u64().unwrap() + row["all"]["landed"].as_u64().unwrap();
        let faults = decided + row["all"]["undecided"].as_u64().unwrap();
        let want = if row["gate"] == "pages" && thp { faults } else { 0 };
        assert_eq!(row["huge"], want, "the runtime's heap in huge pages where every guarded filter is page-gated: {row}");
    }
    if !thp {
        eprintln!("huge pages not checked: the kernel gives none");
    }
    if !keys {
        eprintln!("protection keys not checked: the processor has none");
    }
}
