//! Bad input gives clear errors naming the key, line, path or run directory.

use std::process::Command;

fn bulkhead(args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_bulkhead")).args(args).output().unwrap();
    (out.status.success(), String::from_utf8_lossy(&out.stderr).into_owned())
}

/// A fresh scratch directory of this test process.
fn scratch(tag: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("bulkhead-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
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
    let out = Command::new(env!("CARGO_BIN_EXE_bulkhead")).args(["status", "--run-dir", "/no/such/run"]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "no serve answers: exit status 3 ({err})");
    assert!(err.contains("no bulkhead serve is running") && err.contains("/no/such/run"), "{err}");
    // Without --run-dir, from a directory with no serve: where it looked.
    let dir = scratch("no-run-dir");
    let out = Command::new(env!("CARGO_BIN_EXE_bulkhead"))
        .arg("status")
        .current_dir(&dir)
        .env_remove("BULKHEAD_RUN_DIR")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    let _ = std::fs::remove_dir_all(&dir);
    if out.status.code() == Some(3) {
        assert!(err.contains("./bulkhead-run") && err.contains("BULKHEAD_RUN_DIR"), "{err}");
    }
}

#[test]
fn config_check_names_the_key_and_the_line_and_starts_nothing() {
    let dir = scratch("config-check");
    let bad = dir.join("bad.toml");
    std::fs::write(&bad, "[[device]]\nname = \"a\"\nsize = \"1M\"\nqueue_depth = 3\n[device.backend]\ntype = \"ram\"\n").unwrap();
    let (ok, err) = bulkhead(&["config", "check", bad.to_str().unwrap()]);
    assert!(!ok && err.contains("line 4") && err.contains("queue_depth"), "{err}");
    let good = dir.join("good.toml");
    std::fs::write(&good, "run_dir = \"/srv/bh\"\n[ublk]\nenabled = true\n[[device]]\nname = \"a\"\nsize = \"1M\"\n[device.backend]\ntype = \"ram\"\n").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_bulkhead")).args(["config", "check"]).arg(&good).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains("valid: 1 device(s)") && text.contains("ublk") && text.contains("/srv/bh"),
        "{text}"
    );
    let _ = std::fs::remove_dir_all(&dir);
    assert!(!std::path::Path::new("/srv/bh").exists(), "a check creates nothing");
}

#[test]
fn unknown_subcommand_is_a_usage_error() {
    let (ok, err) = bulkhead(&["frobnicate"]);
    assert!(!ok && err.contains("frobnicate"), "{err}");
}

/// `bulkhead bench` hands over to `bulkhead-bench` beside it, or says where to get it.
#[test]
fn bench_hands_over_to_the_benchmarks_program() {
    let bench = std::path::Path::new(env!("CARGO_BIN_EXE_bulkhead")).with_file_name("bulkhead-bench");
    let (ok, err) = bulkhead(&["bench", "channel", "--mode", "turbo"]);
    assert!(!ok);
    if bench.is_file() {
        assert!(err.contains("invalid value 'turbo'"), "{err}");
    } else {
        assert!(err.contains("bulkhead-bench") && err.contains("not installed"), "{err}");
    }
}

#[test]
fn driver_role_refuses_a_bad_spec() {
    let (ok, err) = bulkhead(&["driver", "--spec", "{\"device\":1}"]);
    assert!(!ok && err.contains("bad domain spec"), "{err}");
}
