//! `serve` under a service manager: the sd_notify protocol checked against a socket of the
//! test's own, and the shipped unit and tmpfiles entry checked by systemd's own tools.

#[path = "../common/mod.rs"]
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

    // SIGHUP: RELOADING=1 with the monotonic time systemd asks for,
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
    for want in [
        "Type=notify",
        "WatchdogSec=",
        "KillMode=mixed",
        "NoNewPrivileges=yes",
        "ExecReload=/usr/bin/bulkhead reload --run-dir /run/bulkhead",
    ] {
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

/// systemd's file-descriptor store, as this test keeps it: names to descriptors, several under
/// one name, `FDSTOREREMOVE=1` dropping a name.
#[derive(Default)]
struct FdStore {
    held: Vec<(String, std::os::fd::OwnedFd)>,
    removes: Vec<String>,
}

impl FdStore {
    /// Takes every message waiting until READY=1 (or `wait` passes); returns whether READY came.
    fn serve_messages(&mut self, sock: &UnixDatagram, wait: Duration) -> bool {
        use std::os::fd::AsFd;
        let deadline = Instant::now() + wait;
        let mut buf = vec![0u8; 4096];
        while Instant::now() < deadline {
            let Some((n, fds)) = bulkhead_sys::recv_with_fds(sock.as_fd(), &mut buf, false).unwrap() else {
                std::thread::sleep(Duration::from_millis(2));
                continue;
            };
            let msg = String::from_utf8_lossy(&buf[..n]).into_owned();
            let name = msg.lines().find_map(|l| l.strip_prefix("FDNAME=")).unwrap_or("stored").to_string();
            if msg.lines().any(|l| l == "FDSTOREREMOVE=1") {
                self.held.retain(|(n, _)| *n != name);
                self.removes.push(name.clone());
            }
            if msg.lines().any(|l| l == "FDSTORE=1") {
                assert!(
                    msg.lines().any(|l| l == "FDPOLL=0"),
                    "systemd would close a FUSE descriptor that polls as an error: {msg}"
                );
                self.held.extend(fds.into_iter().map(|fd| (name.clone(), fd)));
            }
            if msg.lines().any(|l| l == "READY=1") {
                return true;
            }
        }
        false
    }

    fn names(&self) -> Vec<&str> {
        let mut n: Vec<&str> = self.held.iter().map(|(n, _)| n.as_str()).collect();
        n.dedup();
        n
    }
}

#[test]
fn with_a_keeper_under_systemd_serve_stores_its_descriptors_and_the_next_serve_takes_them_over() {
    require_kernel!();
    use std::os::fd::AsFd;
    use std::os::unix::fs::{FileExt, OpenOptionsExt};
    let tmp = TempDir::new("sd-fdstore");
    let sock_path = tmp.path().join("notify.sock");
    let sock = UnixDatagram::bind(&sock_path).unwrap();
    let run_dir = tmp.path().join("run");
    let cfg = tmp.path().join("keeper.toml");
    std::fs::write(
        &cfg,
        "[log]\nlevel = \"warn\"\n[keeper]\nenabled = true\n[nbd]\nenabled = true\n\
         [[device]]\nname = \"disk0\"\nsize = \"64M\"\n[device.backend]\ntype = \"ram\"\n",
    )
    .unwrap();
    let log = run_dir.with_extension("log");
    let args: Vec<std::ffi::OsString> =
        vec![exe().into(), "serve".into(), "--config".into(), cfg.clone().into(), "--run-dir".into(), run_dir.clone().into()];
    let first = Command::new(exe())
        .args(&args[1..])
        .env("NOTIFY_SOCKET", &sock_path)
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let mut serve = Serve { child: ChildGuard(Some(first)), run_dir: run_dir.clone(), log: log.clone() };
    let mut store = FdStore::default();
    assert!(store.serve_messages(&sock, Duration::from_secs(60)), "no READY=1: {}", serve.log_text());
    // Under systemd there is no keeper process: serve stores into systemd's store, each name
    // removed first (systemd keeps several under one name).
    let hello = bulkhead_control::Client::connect(&run_dir).unwrap().call(bulkhead_control::Hello {}).unwrap();
    assert_eq!(hello.pid, serve.pid(), "a keeper process of bulkhead's own runs under systemd");
    let mut names = store.names();
    names.sort();
    assert_eq!(names, ["config", "fuse", "fuse-state", "lock", "nbd-unix", "ram.disk0"], "{}", serve.log_text());
    for n in &names {
        assert!(store.removes.iter().any(|r| r == n), "`{n}` stored without FDSTOREREMOVE first");
    }
    assert_eq!(store.held.iter().filter(|(n, _)| n == "fuse").count(), 4, "one per FUSE worker");

    // Something on the ramdisk, through the FUSE file, then serve dies.
    let file = run_dir.join("fuse/disk0");
    // Closed before serve dies: a process that forks while it holds a FUSE file open closes
    // its copy at exec, and that close waits for an answer only the new serve can give.
    let open = || std::fs::OpenOptions::new().read(true).write(true).custom_flags(libc::O_DIRECT).open(&file).unwrap();
    let layout = std::alloc::Layout::from_size_align(65536, 4096).unwrap();
    // SAFETY: a valid layout; freed at the end of the test.
    let mem = unsafe { std::alloc::alloc_zeroed(layout) };
    // SAFETY: 65536 bytes just allocated.
    let buf = unsafe { std::slice::from_raw_parts_mut(mem, 65536) };
    buf.iter_mut().enumerate().for_each(|(i, b)| *b = (i * 7 + 3) as u8);
    let written = buf.to_vec();
    open().write_all_at(buf, 1 << 20).unwrap();
    let old = serve.pid();
    let mut c = serve.child.0.take().unwrap();
    c.kill().unwrap();
    c.wait().unwrap();

    // What systemd does next: the stored descriptors, as descriptors 3 and up.
    let fds: Vec<_> = store.held.iter().map(|(_, fd)| fd.as_fd()).collect();
    let names: Vec<&str> = store.held.iter().map(|(n, _)| n.as_str()).collect();
    let env: Vec<(std::ffi::OsString, std::ffi::OsString)> =
        vec![("NOTIFY_SOCKET".into(), sock_path.clone().into()), ("PATH".into(), std::env::var_os("PATH").unwrap_or_default())];
    let (pid, _pidfd) =
        bulkhead_sys::process::spawn_with_fds(Path::new(exe()), &args, &env, &fds, &names, libc::SIGKILL).unwrap();
    assert!(store.serve_messages(&sock, Duration::from_secs(60)), "the next serve said no READY=1");
    // The file reads what was written, from the new serve.
    buf.fill(0);
    open().read_exact_at(buf, 1 << 20).unwrap();
    assert!(buf == &written[..], "the ramdisk's contents changed across the restart");
    let hello = bulkhead_control::Client::connect(&run_dir).unwrap().call(bulkhead_control::Hello {}).unwrap();
    assert!(hello.pid == pid && pid != old);
    // SAFETY: allocated above with `layout`.
    unsafe { std::alloc::dealloc(mem, layout) };
    // A clean stop unmounts, as always.
    bulkhead_sys::signal(pid, libc::SIGTERM).unwrap();
    let st = bulkhead_sys::process::wait_child(pid).unwrap();
    assert_eq!(st, bulkhead_sys::process::Ended::Exited(0));
    assert!(!std::fs::read_to_string("/proc/self/mountinfo").unwrap().contains(run_dir.to_str().unwrap()));
}
