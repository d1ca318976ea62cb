//! `bulkhead bench guard` on a few writes: every mechanism and mode measured, and the writes
//! it says were caught are the ones each mode should catch.

mod common;

use std::process::Command;

use common::exe;

#[test]
fn bench_guard_catches_what_each_mode_should_for_both_mechanisms() {
    let writes = 640;
    let out = Command::new(exe()).args(["bench", "guard", "--json", "--writes", &writes.to_string()]).output().unwrap();
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
}

#[test]
fn bench_guard_refuses_fewer_writes_than_pages() {
    let out = Command::new(exe()).args(["bench", "guard", "--writes", "1"]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--writes"), "{}", String::from_utf8_lossy(&out.stderr));
}
