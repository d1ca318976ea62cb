//! Bad arguments give usage errors naming the option, and a stored run is read back; nothing
//! here measures anything.

use std::process::Command;

fn bench(args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_bulkhead-bench")).args(args).output().unwrap();
    (out.status.success(), String::from_utf8_lossy(&out.stderr).into_owned())
}

#[test]
fn bad_modes_and_combinations_are_usage_errors() {
    let (ok, err) = bench(&["channel", "--mode", "turbo"]);
    assert!(!ok && err.contains("turbo"), "{err}");
    // Killing the tap domain needs one of its own.
    let (ok, err) = bench(&["restart", "--kill", "tap"]);
    assert!(!ok && err.contains("--kill tap needs --tap interpose"), "{err}");
    let (ok, err) = bench(&["restart", "--tap", "interpose", "--kill", "both"]);
    assert!(!ok && err.contains("`both`"), "{err}");
}

#[test]
fn a_stored_fileio_run_is_read_back_with_its_goals() {
    let run = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/bench/fileio-ram-rounds5-paired");
    let out = Command::new(env!("CARGO_BIN_EXE_bulkhead-bench")).args(["fileio", "--from", run]).output().unwrap();
    let txt = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(txt.contains("rndrd: MiB/s, median of 5 rounds"), "{txt}");
    assert!(
        txt.contains("within 10% of the better of poll and irq: 34 of 36 points (misses: rndrd 2 thr 0.881, rndwr 1 thr 0.878)"),
        "{txt}"
    );
    let (ok, err) = bench(&["fileio", "--from", "/no/such/run"]);
    assert!(!ok && err.contains("/no/such/run"), "{err}");
    let (ok, err) = bench(&["fileio", "--from", run, "--rounds", "3"]);
    assert!(!ok && err.contains("--rounds"), "{err}");
}
