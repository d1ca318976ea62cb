//! `serve` under a service manager: the sd_notify protocol checked against a socket of the
//! test's own, and the shipped unit and tmpfiles entry checked by systemd's own tools.

mod common;

use std::os::unix::net::UnixDatagram;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use bulkhead_testkit::require_kernel;
use common::{exe, ChildGuard, Serve, TempDir};

/// Starts `serve` on the embedded default with `env`, not waiting for it.
fn spawn(tmp: &TempDir, env: &[(&str, &std::ffi::OsStr)]) -> Serve {
    let run_dir = tmp.path().join("run");
    let log = run_dir.with_extension("log");
    let child = Command::new(exe())
        .args(["serve", "--run-dir"])
        .arg(&run_dir)
        .envs(env.iter().copied())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    Serve { child: ChildGuard(Some(child)), run_dir, log }
}

/// SIGTERM, and its exit status within 30 s.
fn stop(serve: &mut Serve) -> std::process::ExitStatus {
    bulkhead_sys::signal(serve.pid(), libc::SIGTERM).unwrap();
    exited(serve)
}

fn exited(serve: &mut Serve) -> std::process::ExitStatus {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(st) = serve.child.0.as_mut().unwrap().try_wait().unwrap() {
            serve.child.0 = None;
            return st;
        }
        assert!(Instant::now() < deadline, "serve did not exit: {}", serve.log_text());
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Every datagram that arrives within `wait`, or until `until` holds for one of them.
fn collect(sock: &UnixDatagram, wait: Duration, mut until: impl FnMut(&str) -> bool) -> Vec<String> {
    let deadline = Instant::now() + wait;
    let mut got = Vec::new();
    let mut buf = vec![0u8; 4096];
    while Instant::now() < deadline {
        sock.set_read_timeout(Some(deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1)))).unwrap();
        let Ok(n) = sock.recv(&mut buf) else { break };
        let msg = String::from_utf8_lossy(&buf[..n]).into_owned();
        let done = until(&msg);
        got.push(msg);
        if done {
            break;
        }
    }
    got
}

fn serve_log(run_dir: &Path) -> String {
    std::fs::read_to_string(run_dir.with_extension("log")).unwrap_or_default()
}

#[test]
fn serve_says_ready_once_exported_pets_the_watchdog_and_says_stopping() {
    require_kernel!();
    let tmp = TempDir::new("sd-notify");
    let sock_path = tmp.path().join("notify.sock");
    let sock = UnixDatagram::bind(&sock_path).unwrap();
    let mut serve = spawn(&tmp, &[("NOTIFY_SOCKET", sock_path.as_os_str()), ("WATCHDOG_USEC", "200000".as_ref())]);
    let run_dir = serve.run_dir.clone();
    let log = || serve_log(&run_dir);

    // READY=1 comes only once the device is exported and the control socket answers.
    let first = collect(&sock, Duration::from_secs(60), |m| m.lines().any(|l| l == "READY=1"));
    let ready = first.last().unwrap_or_else(|| panic!("no notification at all\n{}", log()));
    assert!(ready.lines().any(|l| l == "READY=1"), "{first:?}\n{}", log());
    assert!(run_dir.join("fuse/disk0").exists(), "READY before the FUSE export");
    assert!(run_dir.join("nbd.sock").exists(), "READY before the NBD export");
    let status = bulkhead_control::Client::connect(&run_dir).unwrap().call(bulkhead_control::Status {}).unwrap();
    assert_eq!(status.devices.len(), 1);
    assert!(ready.lines().any(|l| l == "STATUS=serving 1 of 1 device"), "{ready}");

    // WATCHDOG=1 at half the 200 ms asked: several within a second, each with a status line.
    let t = Instant::now();
    let pets = collect(&sock, Duration::from_secs(1), |_| false);
    let watchdogs = pets.iter().filter(|m| m.lines().any(|l| l == "WATCHDOG=1")).count();
    assert!((5..=30).contains(&watchdogs), "{watchdogs} pets in {:?}: {pets:?}", t.elapsed());
    assert!(pets.iter().all(|m| m.lines().any(|l| l.starts_with("STATUS=serving"))), "{pets:?}");

    // A domain restart shows in the status line.
    let pid = status.devices[0].driver_pid;
    bulkhead_sys::signal(pid, libc::SIGKILL).unwrap();
    let after = collect(&sock, Duration::from_secs(20), |m| m.contains("1 domain restart"));
    assert!(after.last().is_some_and(|m| m.contains("STATUS=serving 1 of 1 device; 1 domain restart")), "{after:?}");

    // SIGHUP (the unit's ExecReload): RELOADING=1 with the monotonic time systemd asks for,
    // then READY=1 once the reload is done. (On the embedded default there is no file: the
    // reload is refused, and serve goes on.)
    bulkhead_sys::signal(serve.pid(), libc::SIGHUP).unwrap();
    let reload = collect(&sock, Duration::from_secs(20), |m| m.lines().any(|l| l == "READY=1"));
    let at = reload.iter().position(|m| m.lines().any(|l| l == "RELOADING=1")).unwrap_or_else(|| panic!("{reload:?}"));
    assert!(reload[at].lines().any(|l| l.starts_with("MONOTONIC_USEC=")), "{reload:?}");
    assert!(reload[at..].iter().any(|m| m.lines().any(|l| l == "READY=1")), "{reload:?}");
    assert!(log().contains("reload refused: serve runs on its embedded default"), "{}", log());

    // SIGTERM: STOPPING=1, then a clean exit, and no pet after STOPPING.
    bulkhead_sys::signal(serve.pid(), libc::SIGTERM).unwrap();
    let end = collect(&sock, Duration::from_secs(30), |m| m.lines().any(|l| l == "STOPPING=1"));
    assert!(end.last().is_some_and(|m| m.lines().any(|l| l == "STOPPING=1")), "{end:?}\n{}", log());
    assert!(exited(&mut serve).success(), "{}", log());
    let late = collect(&sock, Duration::from_millis(300), |_| false);
    assert!(late.iter().all(|m| !m.contains("WATCHDOG=1")), "pets after STOPPING: {late:?}");
}

#[test]
fn domains_never_see_the_service_managers_socket() {
    require_kernel!();
    let tmp = TempDir::new("sd-env");
    let sock_path = tmp.path().join("notify.sock");
    let _sock = UnixDatagram::bind(&sock_path).unwrap();
    let mut serve = spawn(&tmp, &[("NOTIFY_SOCKET", sock_path.as_os_str())]);
    let run_dir = serve.run_dir.clone();
    let deadline = Instant::now() + Duration::from_secs(60);
    let pid = loop {
        let s = bulkhead_control::Client::connect(&run_dir).and_then(|mut c| c.call(bulkhead_control::Status {}));
        if let Some(d) = s.ok().and_then(|s| s.devices.into_iter().next()).filter(|d| d.driver_pid != 0) {
            break d.driver_pid;
        }
        assert!(Instant::now() < deadline, "serve did not come up");
        std::thread::sleep(Duration::from_millis(50));
    };
    let env = std::fs::read(format!("/proc/{pid}/environ")).unwrap();
    let env = String::from_utf8_lossy(&env);
    assert!(!env.contains("NOTIFY_SOCKET"), "a domain inherited NOTIFY_SOCKET");
    assert!(stop(&mut serve).success(), "{}", serve.log_text());
}

#[test]
fn the_unit_and_the_tmpfiles_entry_pass_systemds_own_checks() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../packaging");
    let unit = std::fs::read_to_string(root.join("bulkhead.service")).unwrap();
    for want in ["Type=notify", "WatchdogSec=", "KillMode=mixed", "NoNewPrivileges=yes", "ExecReload=/bin/kill -HUP $MAINPID"] {
        assert!(unit.contains(want), "the unit lacks {want}");
    }
    for never in ["ProtectSystem=", "PrivateTmp=", "ProtectHome=", "RestrictNamespaces="] {
        assert!(!unit.lines().any(|l| l.starts_with(never)), "{never} would hide the FUSE mount or block the sandbox");
    }
    let tmp = TempDir::new("unit");
    if Command::new("systemd-analyze").arg("--version").output().is_err() {
        assert!(std::env::var_os("BULKHEAD_REQUIRE_KERNEL").is_none(), "systemd-analyze is missing");
        eprintln!("SKIP: systemd-analyze is not installed");
        return;
    }
    // verify checks that ExecStart's program exists: point it at the one built here.
    let copy = tmp.path().join("bulkhead.service");
    std::fs::write(&copy, unit.replace("/usr/bin/bulkhead", exe())).unwrap();
    let out = Command::new("systemd-analyze").arg("verify").arg(&copy).output().unwrap();
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && said.trim().is_empty(), "systemd-analyze verify: {said}");
    // The tmpfiles entry, applied to a scratch root.
    let scratch = tmp.path().join("root");
    std::fs::create_dir_all(&scratch).unwrap();
    let out = Command::new("systemd-tmpfiles")
        .arg(format!("--root={}", scratch.display()))
        .arg("--create")
        .arg(root.join("bulkhead.tmpfiles").canonicalize().unwrap())
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    use std::os::unix::fs::PermissionsExt;
    let meta = std::fs::metadata(scratch.join("run/bulkhead")).unwrap();
    assert!(meta.is_dir());
    assert_eq!(meta.permissions().mode() & 0o777, 0o711);
}
