//! `bulkhead sim`: the performance modeling paper's worked example comes out as printed there, a
//! requests file is read and its mistakes named by line, and the JSON carries every scheduler.

use std::process::Command;

fn bulkhead(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_bulkhead")).args(args).output().unwrap();
    (out.status.success(), String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned())
}

#[test]
fn the_seed_example_prints_the_seed_tables() {
    let (ok, out, err) = bulkhead(&["sim", "--example"]);
    assert!(ok, "{err}");
    for row in [
        "95    45.00    0.00    45.00",
        "mean  49.75    88.75   138.50",
        "mean  37.00    25.00  62.00",
        "60    10.00    0.00   10.00",
        "mean  36.25    24.75  61.00",
    ] {
        assert!(out.contains(row), "no `{row}` in\n{out}");
    }
}

/// A scratch directory, removed when dropped: also when an assertion fails.
struct Scratch(std::path::PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn a_requests_file_runs_through_every_scheduler_and_its_mistakes_are_named_by_line() {
    let scratch = Scratch(std::env::temp_dir().join(format!("bulkhead-sim-{}", std::process::id())));
    let dir = &scratch.0;
    std::fs::create_dir_all(dir).unwrap();
    let good = dir.join("good.txt");
    std::fs::write(&good, "# arrival_ms position sectors r|w stream\n0 1000 8 r 0\n0.5 9000000 8 w 1\n1 1008 8 r 0\n").unwrap();
    let (ok, out, err) = bulkhead(&["sim", "--requests", good.to_str().unwrap(), "--json"]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let names: Vec<&str> = v["schedulers"].as_array().unwrap().iter().map(|s| s["scheduler"].as_str().unwrap()).collect();
    assert_eq!(names, ["fcfs", "satf", "opt", "deadline", "cats"]);
    for s in v["schedulers"].as_array().unwrap() {
        assert_eq!(s["summary"]["requests"], 3, "{s}");
        assert_eq!(s["served"].as_array().unwrap().len(), 3);
    }
    let bad = dir.join("bad.txt");
    std::fs::write(&bad, "0 1000 8 r\n1 2000 8 x\n").unwrap();
    let (ok, _, err) = bulkhead(&["sim", "--requests", bad.to_str().unwrap()]);
    assert!(!ok && err.contains("bad.txt line 2") && err.contains("`x` is neither r nor w"), "{err}");
    let (ok, _, err) = bulkhead(&["sim", "--requests", good.to_str().unwrap(), "--size", "1M"]);
    assert!(!ok && err.contains("beyond the modelled device"), "{err}");
    let (ok, _, err) = bulkhead(&["sim", "--example", "--schedulers", "fcfs,lifo"]);
    assert!(!ok && err.contains("'lifo'") && err.contains("possible values: fcfs, satf, opt, deadline, cats"), "{err}");
    let (ok, _, err) = bulkhead(&["sim"]);
    assert!(!ok && err.contains("--example"), "{err}");
}
