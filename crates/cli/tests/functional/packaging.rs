//! What a package ships besides the binary, generated from the command-line definitions: the
//! manual pages and the shell completions.

use std::process::Command;

fn exe() -> &'static str {
    env!("CARGO_BIN_EXE_bulkhead")
}

#[test]
fn manual_pages_cover_every_command_and_its_options() {
    let out = std::env::temp_dir().join(format!("bulkhead-man-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let st = Command::new(exe()).args(["man", "--out"]).arg(&out).status().unwrap();
    assert!(st.success());
    for cmd in ["serve", "status", "device", "filter", "snapshot", "view", "completions"] {
        let page = std::fs::read_to_string(out.join(format!("bulkhead-{cmd}.1"))).unwrap();
        assert!(page.starts_with(".ie") || page.contains(&format!(".TH bulkhead-{cmd} 1")), "{cmd}: {page}");
    }
    let serve = std::fs::read_to_string(out.join("bulkhead-serve.1")).unwrap();
    assert!(serve.contains("config") && serve.contains("run\\-dir"), "{serve}");
    // Nested commands have pages of their own, which their parent's page names.
    for cmd in [
        "device-add",
        "device-remove",
        "device-restart",
        "device-tap",
        "view-add",
        "view-remove",
        "view-qos",
        "config-dump",
        "config-check",
        "filter-add",
        "filter-remove",
        "snapshot-create",
        "snapshot-list",
        "vdev-generate",
    ] {
        let page = std::fs::read_to_string(out.join(format!("bulkhead-{cmd}.1"))).unwrap_or_else(|e| panic!("{cmd}: {e}"));
        assert!(page.contains(&format!(".TH bulkhead-{cmd} 1")), "{cmd}: {page}");
    }
    let device = std::fs::read_to_string(out.join("bulkhead-device.1")).unwrap();
    assert!(device.contains("bulkhead\\-device\\-add(1)"), "{device}");
    assert!(!out.join("bulkhead-vdev-model.1").exists(), "hidden commands have no page");
    let top = std::fs::read_to_string(out.join("bulkhead.1")).unwrap();
    assert!(top.contains(".TH bulkhead 1") && top.contains("bulkhead\\-serve(1)"), "{top}");
    // The domains' role is not a command for people; the benchmarks' pages are their own
    // package's.
    assert!(!out.join("bulkhead-driver.1").exists());
    assert!(!out.join("bulkhead-bench.1").exists());
    std::fs::remove_dir_all(out).unwrap();
}

#[test]
fn completion_scripts_are_valid_for_their_shells() {
    let bash = Command::new(exe()).args(["completions", "bash"]).output().unwrap();
    assert!(bash.status.success());
    let script = String::from_utf8(bash.stdout).unwrap();
    assert!(script.contains("complete -F _bulkhead") && script.contains("snapshot"), "{script}");
    let path = std::env::temp_dir().join(format!("bulkhead-completion-{}.bash", std::process::id()));
    std::fs::write(&path, &script).unwrap();
    let check = Command::new("bash").arg("-n").arg(&path).output().unwrap();
    std::fs::remove_file(&path).unwrap();
    assert!(check.status.success(), "bash -n: {}", String::from_utf8_lossy(&check.stderr));
    for shell in ["zsh", "fish"] {
        let out = Command::new(exe()).args(["completions", shell]).output().unwrap();
        assert!(out.status.success() && String::from_utf8_lossy(&out.stdout).contains("serve"), "{shell}");
    }
    let bad = Command::new(exe()).args(["completions", "tcsh"]).output().unwrap();
    assert!(!bad.status.success() && String::from_utf8_lossy(&bad.stderr).contains("possible values"));
}
