//! The Debian package: built by scripts/package.sh (cargo-deb), unpacked into a scratch root,
//! its contents checked, and `serve` run from it on the configuration it ships.

#[path = "../common/mod.rs"]
mod common;

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use bulkhead_testkit::require_kernel;
use common::{ChildGuard, Serve, TempDir};

fn repo() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."))
}

#[test]
fn the_package_holds_what_a_service_needs_and_serves_from_a_scratch_root() {
    require_kernel!();
    if Command::new("cargo").args(["deb", "--version"]).output().map(|o| !o.status.success()).unwrap_or(true) {
        assert!(std::env::var_os("BULKHEAD_REQUIRE_KERNEL").is_none(), "cargo-deb is missing (scripts/deps.sh test installs it)");
        eprintln!("SKIP: cargo-deb is not installed");
        return;
    }
    let tmp = TempDir::new("package");
    let out = tmp.path().join("out");
    // The debug build the tests run, as it is: the package's contents are what is checked here.
    let built = Command::new(repo().join("scripts/package.sh"))
        .args(["--profile", "dev", "--prebuilt", "-o"])
        .arg(&out)
        .output()
        .unwrap();
    assert!(built.status.success(), "{}", String::from_utf8_lossy(&built.stderr));
    let debs: Vec<_> = std::fs::read_dir(&out).unwrap().map(|e| e.unwrap().path()).collect();
    let named = |prefix: &str| {
        debs.iter().find(|p| p.file_name().unwrap().to_string_lossy().starts_with(prefix)).cloned().unwrap_or_else(|| {
            panic!("no {prefix}*.deb written: {debs:?}");
        })
    };
    let deb = named("bulkhead_");
    let bench_deb = named("bulkhead-bench_");

    // The control fields and the configuration kept across upgrades.
    let info = common::sh("dpkg-deb", &["-f", deb.to_str().unwrap()]);
    assert!(info.contains("Package: bulkhead") && info.contains("Depends: libc6"), "{info}");
    let root = tmp.path().join("root");
    common::sh("dpkg-deb", &["-x", deb.to_str().unwrap(), root.to_str().unwrap()]);
    let control = tmp.path().join("control");
    common::sh("dpkg-deb", &["-e", deb.to_str().unwrap(), control.to_str().unwrap()]);
    assert_eq!(std::fs::read_to_string(control.join("conffiles")).unwrap().trim(), "/etc/bulkhead/bulkhead.toml");

    // Every file a user or systemd looks for.
    for path in [
        "usr/bin/bulkhead",
        "etc/bulkhead/bulkhead.toml",
        "usr/lib/systemd/system/bulkhead.service",
        "usr/lib/tmpfiles.d/bulkhead.conf",
        "usr/share/man/man1/bulkhead.1.gz",
        "usr/share/man/man1/bulkhead-serve.1.gz",
        "usr/share/man/man1/bulkhead-status.1.gz",
        "usr/share/bash-completion/completions/bulkhead",
        "usr/share/zsh/vendor-completions/_bulkhead",
        "usr/share/fish/vendor_completions.d/bulkhead.fish",
        "usr/share/doc/bulkhead/README.md",
        "usr/share/doc/bulkhead/copyright",
        "usr/share/doc/bulkhead/docs/operations.md",
    ] {
        assert!(root.join(path).is_file(), "{path} is not in the package");
    }
    assert!(!root.join("usr/bin/bulkhead-test-driver").exists(), "the test driver is never shipped");
    assert!(!root.join("usr/bin/bulkhead-bench").exists(), "the benchmarks are a package of their own");

    // The benchmarks' package: their program and pages, and a dependency on bulkhead itself.
    let bench_info = common::sh("dpkg-deb", &["-f", bench_deb.to_str().unwrap()]);
    assert!(bench_info.contains("Package: bulkhead-bench") && bench_info.contains("bulkhead (="), "{bench_info}");
    let bench_root = tmp.path().join("bench-root");
    common::sh("dpkg-deb", &["-x", bench_deb.to_str().unwrap(), bench_root.to_str().unwrap()]);
    for path in ["usr/bin/bulkhead-bench", "usr/share/man/man1/bulkhead-bench.1.gz", "usr/share/man/man1/bulkhead-bench-vm.1.gz"]
    {
        assert!(bench_root.join(path).is_file(), "{path} is not in the benchmarks' package");
    }
    // Neither program holds the test kit: its hostile domain's forged log line is in neither
    // (and is in the test build, which has it).
    let forged: &[u8] = b"forged: restarted, all is well";
    let holds = |bin: &Path| std::fs::read(bin).unwrap().windows(forged.len()).any(|w| w == forged);
    for bin in [root.join("usr/bin/bulkhead"), bench_root.join("usr/bin/bulkhead-bench")] {
        assert!(!holds(&bin), "{} holds the test kit", bin.display());
    }
    if let Some(test_driver) = Serve::test_driver() {
        assert!(holds(test_driver), "the marker is not the test kit's");
    }
    let unit = std::fs::read_to_string(root.join("usr/lib/systemd/system/bulkhead.service")).unwrap();
    assert!(unit.contains("ExecStart=/usr/bin/bulkhead serve --config /etc/bulkhead/bulkhead.toml --run-dir /run/bulkhead"));
    let bin = root.join("usr/bin/bulkhead");
    let verify_copy = tmp.path().join("bulkhead.service");
    std::fs::write(&verify_copy, unit.replace("/usr/bin/bulkhead", bin.to_str().unwrap())).unwrap();
    let v = Command::new("systemd-analyze").arg("verify").arg(&verify_copy).output().unwrap();
    assert!(v.status.success(), "{}", String::from_utf8_lossy(&v.stderr));

    // The group the docs suggest: sysusers makes it (tried on a scratch root), and the
    // postinst runs sysusers.
    let sysusers = root.join("usr/lib/sysusers.d/bulkhead.conf");
    let users_root = tmp.path().join("sysusers-root");
    std::fs::create_dir_all(users_root.join("etc")).unwrap();
    common::sh("systemd-sysusers", &[&format!("--root={}", users_root.display()), sysusers.to_str().unwrap()]);
    let groups = std::fs::read_to_string(users_root.join("etc/group")).unwrap();
    assert!(groups.lines().any(|l| l.starts_with("bulkhead:")), "{groups}");
    let control = tmp.path().join("control");
    common::sh("dpkg-deb", &["-e", deb.to_str().unwrap(), control.to_str().unwrap()]);
    let postinst = std::fs::read_to_string(control.join("postinst")).unwrap();
    assert!(postinst.contains("systemd-sysusers bulkhead.conf") && !postinst.contains("#DEBHELPER#"), "{postinst}");
    for f in ["bulkhead-alerts.yml", "bulkhead-alerts.test.yml", "bulkhead-dashboard.json"] {
        assert!(root.join("usr/share/bulkhead/monitoring").join(f).is_file(), "the package ships {f}");
    }
    // The shipped configuration passes the check its own comment advises.
    let check = Command::new(&bin).args(["config", "check"]).arg(root.join("etc/bulkhead/bulkhead.toml")).output().unwrap();
    assert!(check.status.success(), "{}", String::from_utf8_lossy(&check.stderr));
    let config = std::fs::read_to_string(root.join("etc/bulkhead/bulkhead.toml")).unwrap();
    assert!(config.contains("systemctl reload bulkhead") && !config.contains("then `systemctl restart"), "{config}");

    // `serve --config /etc/bulkhead/bulkhead.toml` works as shipped (the run directory moved
    // under the scratch root).
    let run_dir = tmp.path().join("run");
    let log = run_dir.with_extension("log");
    let child = Command::new(&bin)
        .args(["serve", "--config"])
        .arg(root.join("etc/bulkhead/bulkhead.toml"))
        .arg("--run-dir")
        .arg(&run_dir)
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let mut serve = Serve { child: ChildGuard(Some(child)), run_dir: run_dir.clone(), log };
    let deadline = Instant::now() + Duration::from_secs(30);
    while !(run_dir.join("fuse/disk0").exists() && run_dir.join("nbd.sock").exists() && run_dir.join("control.sock").exists()) {
        assert!(Instant::now() < deadline, "the shipped config did not serve: {}", serve.log_text());
        std::thread::sleep(Duration::from_millis(20));
    }
    let status = Command::new(&bin).args(["status", "--run-dir"]).arg(&run_dir).output().unwrap();
    assert!(String::from_utf8_lossy(&status.stdout).contains("disk0"), "{}", String::from_utf8_lossy(&status.stderr));
    assert!(serve.stop().success(), "{}", serve.log_text());
}
