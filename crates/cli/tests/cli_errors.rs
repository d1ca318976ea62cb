//! Bad input gives clear errors naming the key, line, path or run directory.

use std::process::Command;

fn bulkhead(args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_bulkhead")).args(args).output().unwrap();
    (out.status.success(), String::from_utf8_lossy(&out.stderr).into_owned())
}

fn with_config(text: &str) -> (bool, String) {
    let dir = std::env::temp_dir().join(format!("bulkhead-cfg-{}-{}", std::process::id(), text.len()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("c.toml");
    std::fs::write(&path, text).unwrap();
    let r = bulkhead(&["serve", "--config", path.to_str().unwrap(), "--run-dir", dir.join("run").to_str().unwrap()]);
    let _ = std::fs::remove_dir_all(&dir);
    r
}

#[test]
fn unknown_key_is_named_with_its_line() {
    let (ok, err) = with_config("[[device]]\nname = \"a\"\nsize = \"1G\"\nspeed = 9\n[device.backend]\ntype = \"ram\"\n");
    assert!(!ok);
    assert!(err.contains("speed") && err.contains("line 4"), "{err}");
}

#[test]
fn bad_value_is_named_with_its_line() {
    let (ok, err) = with_config("[[device]]\nname = \"a\"\nsize = \"lots\"\n[device.backend]\ntype = \"ram\"\n");
    assert!(!ok);
    assert!(err.contains("lots") && err.contains("line 3"), "{err}");
}

#[test]
fn missing_backing_file_is_named() {
    let (ok, err) = with_config("[[device]]\nname = \"a\"\n[device.backend]\ntype = \"file\"\npath = \"/no/such/disk.img\"\n");
    assert!(!ok);
    assert!(err.contains("/no/such/disk.img") && err.contains("does not exist") && err.contains("line 5"), "{err}");
}

#[test]
fn faults_on_purpose_are_not_in_the_configuration() {
    // Faults are made on purpose only by the test driver, told by its environment: the
    // configuration has no key for them, and says so as for any unknown key.
    let (ok, err) = with_config(
        "[[device]]\nname = \"a\"\nsize = \"16M\"\n[device.backend]\ntype = \"ram\"\n\
         [[device.filter]]\ntype = \"stats\"\nguard = \"dwc\"\nguard_inject = \"ring\"\n",
    );
    assert!(!ok);
    assert!(err.contains("unknown field `guard_inject`") && err.contains("line 9"), "{err}");
}

#[test]
fn missing_config_file_is_named() {
    let (ok, err) = bulkhead(&["serve", "--config", "/no/such/bulkhead.toml"]);
    assert!(!ok);
    assert!(err.contains("/no/such/bulkhead.toml"), "{err}");
}

#[test]
fn status_without_serve_names_the_run_dir() {
    let (ok, err) = bulkhead(&["status", "--run-dir", "/no/such/run"]);
    assert!(!ok);
    assert!(err.contains("no bulkhead serve is running") && err.contains("/no/such/run"), "{err}");
}

#[test]
fn unknown_subcommand_and_bad_bench_mode_are_usage_errors() {
    let (ok, err) = bulkhead(&["frobnicate"]);
    assert!(!ok && err.contains("frobnicate"), "{err}");
    let (ok, err) = bulkhead(&["bench", "channel", "--mode", "turbo"]);
    assert!(!ok && err.contains("turbo"), "{err}");
    // Killing the tap domain needs one of its own.
    let (ok, err) = bulkhead(&["bench", "restart", "--kill", "tap"]);
    assert!(!ok && err.contains("--kill tap needs --tap interpose"), "{err}");
    let (ok, err) = bulkhead(&["bench", "restart", "--tap", "interpose", "--kill", "both"]);
    assert!(!ok && err.contains("`both`"), "{err}");
}

#[test]
fn driver_role_refuses_a_bad_spec() {
    let (ok, err) = bulkhead(&["driver", "--spec", "{\"device\":1}"]);
    assert!(!ok && err.contains("bad domain spec"), "{err}");
}

#[test]
fn a_stored_fileio_run_is_read_back_with_its_goals() {
    let run = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/bench/fileio-ram-rounds5-paired");
    let out = Command::new(env!("CARGO_BIN_EXE_bulkhead")).args(["bench", "fileio", "--from", run]).output().unwrap();
    let txt = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(txt.contains("rndrd: MiB/s, median of 5 rounds"), "{txt}");
    assert!(
        txt.contains("within 10% of the better of poll and irq: 34 of 36 points (misses: rndrd 2 thr 0.881, rndwr 1 thr 0.878)"),
        "{txt}"
    );
    let (ok, err) = bulkhead(&["bench", "fileio", "--from", "/no/such/run"]);
    assert!(!ok && err.contains("/no/such/run"), "{err}");
    let (ok, err) = bulkhead(&["bench", "fileio", "--from", run, "--rounds", "3"]);
    assert!(!ok && err.contains("--rounds"), "{err}");
}
