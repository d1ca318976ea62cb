//! The supervisor restarts dead, wedged and crash-looping driver domains without losing a
//! request, through the real kernel: ext4 over FUSE and a loop device, fio verifying.

#[path = "../common/mod.rs"]
mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use bulkhead_testkit::require_kernel;
use common::*;

fn fio_available() -> bool {
    if bulkhead_testkit::kernel::which("fio").is_some() {
        return true;
    }
    assert!(std::env::var("BULKHEAD_REQUIRE_KERNEL").as_deref() != Ok("1"), "fio required but not installed");
    eprintln!("SKIP: fio not installed");
    false
}

#[test]
fn sigkill_fifty_times_under_fio_verify_loses_nothing() {
    require_kernel!();
    if !fio_available() {
        return;
    }
    let tmp = TempDir::new("kill");
    let cfg = "[[device]]\nname = \"k\"\nsize = \"512M\"\nrestart_limit = 100000\n[device.backend]\ntype = \"ram\"\n";
    let serve = Serve::start(&tmp.path().join("run"), Some(cfg), &["k"]);
    let lo = LoopGuard::attach_direct(&serve.fuse_file("k"));
    run("mkfs.ext4", &["-q", "-F", &lo.dev]);
    let mnt = tmp.path().join("mnt");
    let m = MountGuard::mount(&lo.dev, &mnt);

    let mut rng = Rng::new(0x2545_f491_4f6c_dd1d);
    let killer =
        DomainKiller::start(serve.run_dir.clone(), move || Duration::from_millis(40 + rng.next_u64() % 160), driver_domain);
    let out = Command::new("timeout")
        .args([
            // A hung request fails the test instead of stalling the suite.
            "--kill-after=10",
            "180",
            "fio",
            "--name=killverify",
            &format!("--directory={}", mnt.display()),
            "--ioengine=libaio",
            "--direct=1",
            "--rw=randwrite",
            "--bsrange=4k-128k",
            "--iodepth=8",
            "--size=64M",
            "--runtime=20",
        ])
        .args(FIO_VERIFY)
        .output()
        .unwrap();
    let kills = killer.stop().first().copied().unwrap_or(0);
    assert!(out.status.success(), "fio: {}\n{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let job = &v["jobs"][0];
    assert_eq!(job["error"], 0, "fio saw an I/O or verify error");
    assert!(job["write"]["io_bytes"].as_u64().unwrap() > 0);
    assert!(job["read"]["io_bytes"].as_u64().unwrap() > 0, "verify_backlog read back data");
    assert!(kills >= 50, "only {kills} kills landed");
    m.unmount();
    let fsck = Command::new("e2fsck").args(["-fn", &lo.dev]).output().unwrap();
    assert!(fsck.status.success(), "e2fsck: {}", String::from_utf8_lossy(&fsck.stdout));
    let st = serve.status_json();
    let d = &st["devices"][0];
    assert!(d["restarts"].as_u64().unwrap() >= kills as u64, "restarts {} < kills {kills}", d["restarts"]);
    assert_eq!(d["state"], "running");
    assert!(d["p99_outage_ms"].as_f64().unwrap() > 0.0);
    eprintln!("{kills} kills; outage last {} ms, p99 {} ms", d["last_outage_ms"], d["p99_outage_ms"]);
}

/// An NBD client keeps sixteen requests in flight, which the export's leader holds on its
/// queue while the domain is killed again and again: every one is answered, and what was
/// written reads back.
#[test]
fn nbd_requests_in_flight_carry_over_kills_and_verify() {
    require_kernel!();
    if !fio_available() {
        return;
    }
    let tmp = TempDir::new("kill-nbd");
    let cfg = "[fuse]\nenabled = false\n[[device]]\nname = \"k\"\nsize = \"256M\"\nrestart_limit = 100000\n\
               [device.backend]\ntype = \"ram\"\n";
    let serve = Serve::start(&tmp.path().join("run"), Some(cfg), &[]);
    let uri = serve.nbd_uri("k");
    let mut rng = Rng::new(0x9e37_79b9_7f4a_7c15);
    let killer =
        DomainKiller::start(serve.run_dir.clone(), move || Duration::from_millis(40 + rng.next_u64() % 160), driver_domain);
    let job = fio_nbd_verify(&uri, "nbdkill", "64M", 8, 120);
    let kills = killer.stop().first().copied().unwrap_or(0);
    assert!(job["read"]["io_bytes"].as_u64().unwrap() > 0, "verify_backlog read back data");
    assert!(kills >= 10, "only {kills} kills landed");
    // Every kill is a replacement, except that a kill landing on a domain the supervisor is
    // already replacing (status shows it until its successor runs) is one restart, not two.
    let st = serve.status_json();
    let restarts = st["devices"][0]["restarts"].as_u64().unwrap();
    assert!(restarts * 4 >= kills as u64 * 3, "{kills} kills, {restarts} restarts: {st}");
}

#[test]
fn stopped_driver_is_restarted_by_the_watchdog_and_io_carries_on() {
    require_kernel!();
    let tmp = TempDir::new("stop");
    // A watchdog long enough that the replacement, starved of a CPU by the tests running
    // beside this one, is not taken for wedged too: the test counts one restart.
    let cfg = "[[device]]\nname = \"s\"\nsize = \"64M\"\nwatchdog_ms = 1000\n[device.backend]\ntype = \"ram\"\n";
    let serve = Serve::start(&tmp.path().join("run"), Some(cfg), &["s"]);
    let file = serve.fuse_file("s");
    let data = pattern(9, 8 << 20);
    let src = tmp.path().join("src");
    std::fs::write(&src, &data).unwrap();
    let old = serve.driver_pid(0);
    // SAFETY: stopping a driver domain of our serve by pid.
    assert_eq!(unsafe { libc::kill(old as i32, libc::SIGSTOP) }, 0);
    let t0 = Instant::now();
    // This write finds the domain stopped; it must complete once the watchdog has replaced it.
    dd(&src, &file, &["bs=1M", "oflag=direct", "conv=notrunc"]);
    let took = t0.elapsed();
    let new = serve.driver_pid(0);
    assert_ne!(new, old, "a new domain serves");
    assert!(took < Duration::from_millis(1000 + 2000), "restart took {took:?}");
    let back = tmp.path().join("back");
    dd(&file, &back, &["bs=1M", "count=8", "iflag=direct"]);
    assert!(std::fs::read(&back).unwrap() == data);
    let d = &serve.status_json()["devices"][0];
    assert_eq!(d["restarts"], 1, "{}", serve.log_text());
    // The stopped domain was killed, not left behind.
    std::thread::sleep(Duration::from_millis(100));
    let state = std::fs::read_to_string(format!("/proc/{old}/stat")).unwrap_or_default();
    assert!(state.is_empty() || state.contains(") Z "), "old domain still exists: {state}");
    assert!(serve.log_text().contains("answered nothing"), "{}", serve.log_text());
}

#[test]
fn driver_crashing_on_start_turns_the_device_failed_and_io_fails_promptly() {
    require_kernel!();
    let tmp = TempDir::new("crash");
    let cfg = "[[device]]\nname = \"c\"\nsize = \"16M\"\nrestart_limit = 3\nrestart_window_ms = 60000\n[device.backend]\ntype = \"ram\"\n";
    let Some(serve) =
        Serve::start_test_driver(&tmp.path().join("run"), Some(cfg), &["c"], &[("BULKHEAD_TEST_FAULT", "crash-on-start")])
    else {
        return;
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let d = serve.status_json()["devices"][0].clone();
        if d["state"] == "failed" {
            let why = d["failure"].as_str().unwrap();
            assert!(why.contains("restarts within") && why.contains("bulkhead device restart c"), "{why}");
            break;
        }
        assert!(Instant::now() < deadline, "device never turned failed: {d}");
        std::thread::sleep(Duration::from_millis(20));
    }
    let t0 = Instant::now();
    let out = Command::new("dd")
        .args([&format!("if={}", serve.fuse_file("c").display()), "of=/dev/null", "bs=4k", "count=1", "iflag=direct"])
        .output()
        .unwrap();
    assert!(!out.status.success(), "I/O on a failed device must fail");
    assert!(String::from_utf8_lossy(&out.stderr).contains("Input/output error"));
    assert!(t0.elapsed() < Duration::from_secs(1), "failed I/O took {:?}", t0.elapsed());
    // A manual restart tries again (and fails again, since the driver still crashes).
    let r = Command::new(exe()).args(["device", "restart", "c", "--run-dir"]).arg(&serve.run_dir).output().unwrap();
    let st = serve.status_json();
    assert!(
        !r.status.success() || st["devices"][0]["state"] == "running",
        "restart succeeded but the device is {}",
        st["devices"][0]["state"]
    );
    assert!(serve.log_text().contains("device failed"), "{}", serve.log_text());
}

#[test]
fn manual_restart_replaces_a_healthy_domain_and_keeps_the_data() {
    require_kernel!();
    let tmp = TempDir::new("manual");
    let serve = Serve::start(&tmp.path().join("run"), Some(&small_ram_config("m", "32M", "poll")), &["m"]);
    let data = pattern(3, 1 << 20);
    // O_TRUNC is ignored, as on a block device: this overwrites the first MiB.
    std::fs::write(serve.fuse_file("m"), &data).unwrap();
    assert_eq!(std::fs::metadata(serve.fuse_file("m")).unwrap().len(), 32 << 20);
    let old = serve.driver_pid(0);
    let out = Command::new(exe()).args(["device", "restart", "m", "--run-dir"]).arg(&serve.run_dir).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let new = serve.driver_pid(0);
    assert_ne!(old, new);
    assert!(
        String::from_utf8_lossy(&out.stdout).contains(&new.to_string()),
        "{} vs {new}\n{}",
        String::from_utf8_lossy(&out.stdout),
        serve.log_text()
    );
    let got = std::fs::read(serve.fuse_file("m")).unwrap();
    assert!(got[..data.len()] == data[..], "ramdisk contents survive the restart");
    let bad = Command::new(exe()).args(["device", "restart", "nosuch", "--run-dir"]).arg(&serve.run_dir).output().unwrap();
    assert!(!bad.status.success() && String::from_utf8_lossy(&bad.stderr).contains("no device `nosuch`"));
}

#[test]
fn io_uring_file_backend_keeps_requests_in_flight_and_loses_none_to_kills() {
    require_kernel!();
    if !fio_available() {
        return;
    }
    // The io_uring engine answers requests as they complete, so at a kill several are in
    // flight in the kernel on the old domain's ring: every one is sent again to the next.
    let tmp = TempDir::new("uring-kill");
    let img = tmp.path().join("disk.img");
    std::fs::File::create(&img).unwrap().set_len(256 << 20).unwrap();
    let cfg = format!(
        "[[device]]\nname = \"u\"\nqueues = 2\nrestart_limit = 100000\n[device.backend]\ntype = \"file\"\npath = \"{}\"\n\
         direct = true\nengine = \"io_uring\"\n",
        img.display()
    );
    let serve = Serve::start(&tmp.path().join("run"), Some(&cfg), &["u"]);
    let mut fs = Ext4::make(&serve.fuse_file("u"), &tmp.path().join("mnt"));
    let mnt = fs.mnt.clone();
    let mut rng = Rng::new(0x9e37_79b9_7f4a_7c15);
    let killer =
        DomainKiller::start(serve.run_dir.clone(), move || Duration::from_millis(60 + rng.next_u64() % 140), driver_domain);
    fio_verify(&mnt, "randrw", "4k-256k", "48M", 8);
    let kills = killer.stop().first().copied().unwrap_or(0);
    assert!(kills >= 8, "only {kills} kills landed");
    fs.unmount_and_check();
    let st = serve.status_json();
    let d = &st["devices"][0];
    assert_eq!((d["state"].as_str(), d["requests_failed"].as_u64()), (Some("running"), Some(0)), "{d}");
    eprintln!("{kills} kills of an io_uring file domain; outage p99 {} ms", d["p99_outage_ms"]);
}

/// The process ids of `serve`'s children whose command line starts with `what`.
fn children_running(serve: &Serve, what: &[u8]) -> Vec<u32> {
    let mut all: Vec<u32> = Vec::new();
    // Spares are children of the thread that keeps them, not of serve's main thread.
    for task in std::fs::read_dir(format!("/proc/{}/task", serve.pid())).unwrap().flatten() {
        let kids = std::fs::read_to_string(task.path().join("children")).unwrap_or_default();
        all.extend(kids.split_whitespace().filter_map(|p| p.parse::<u32>().ok()));
    }
    all.into_iter().filter(|pid| std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| c.starts_with(what))).collect()
}

/// A spare killed while it waits is replaced, and the next restart is served by a spare.
#[test]
fn a_spare_killed_while_idle_is_replaced_and_the_next_restart_takes_one() {
    require_kernel!();
    let tmp = TempDir::new("spare-idle");
    let serve = Serve::start(&tmp.path().join("run"), Some(&small_ram_config("s", "16M", "adaptive")), &["s"]);
    let data = pattern(5, 1 << 20);
    std::fs::write(serve.fuse_file("s"), &data).unwrap();
    let before = serve.spares_ready();
    let victim = before["ready"][0]["pid"].as_u64().unwrap() as u32;
    // SAFETY: signalling a spare of our own serve.
    unsafe { libc::kill(victim as i32, libc::SIGKILL) };
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let sp = serve.status_json()["spares"].clone();
        let pids = serve.spare_pids();
        if sp["lost"].as_u64().unwrap() > before["lost"].as_u64().unwrap() && pids.len() == 2 && !pids.contains(&victim) {
            break;
        }
        assert!(Instant::now() < deadline, "the killed spare was not replaced: {sp}\n{}", serve.log_text());
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(serve.log_text().contains(&format!("spare domain (pid {victim}) ended while it waited")), "{}", serve.log_text());
    let waiting = serve.spare_pids();
    let new = kill_driver_and_await_next(&serve);
    assert!(waiting.contains(&new), "the new domain {new} is one of the spares {waiting:?}");
    let got = std::fs::read(serve.fuse_file("s")).unwrap();
    assert!(got[..data.len()] == data[..], "the contents survive a restart into a spare");
    // The pool is whole again, and nothing it started is left over: the domain, two spares.
    serve.spares_ready();
    assert_eq!(children_running(&serve, b"bulkhead\0spare\0").len(), 2);
    assert_eq!(children_running(&serve, b"bulkhead\0driver\0").len(), 1);
}

/// A spare given a device whose backend then fails to open (a qcow2 image whose header was
/// overwritten under it) fails as an exec'd domain would: the device turns failed once its
/// restarts are used up, saying why, and the pool goes on; with the image mended, a restart
/// serves again from a spare.
#[test]
fn a_spare_given_a_backend_that_fails_to_open_fails_the_device_and_the_pool_carries_on() {
    require_kernel!();
    let Some(qemu_img) = bulkhead_testkit::kernel::which("qemu-img") else {
        assert!(std::env::var("BULKHEAD_REQUIRE_KERNEL").as_deref() != Ok("1"), "qemu-img required but not installed");
        eprintln!("SKIP: qemu-img not installed");
        return;
    };
    let tmp = TempDir::new("spare-open");
    let img = tmp.path().join("q.qcow2");
    assert!(Command::new(qemu_img).args(["create", "-q", "-f", "qcow2"]).arg(&img).arg("16M").status().unwrap().success());
    let cfg = format!(
        "[[device]]\nname = \"q\"\nrestart_limit = 3\nrestart_window_ms = 60000\n[device.backend]\ntype = \"file\"\nformat = \"qcow2\"\npath = \"{}\"\n",
        img.display()
    );
    let serve = Serve::start(&tmp.path().join("run"), Some(&cfg), &["q"]);
    let data = pattern(7, 256 << 10);
    std::fs::write(serve.fuse_file("q"), &data).unwrap();
    serve.spares_ready();
    // The image's magic, overwritten: no domain can open it now.
    let file = std::fs::OpenOptions::new().write(true).open(&img).unwrap();
    let mut head = [0u8; 4];
    std::os::unix::fs::FileExt::read_exact_at(&std::fs::File::open(&img).unwrap(), &mut head, 0).unwrap();
    std::os::unix::fs::FileExt::write_all_at(&file, &[0; 4], 0).unwrap();
    let old = serve.driver_pid(0);
    // SAFETY: signalling a domain of our own serve.
    unsafe { libc::kill(old as i32, libc::SIGKILL) };
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let d = serve.status_json()["devices"][0].clone();
        if d["state"] == "failed" {
            break;
        }
        assert!(Instant::now() < deadline, "device never turned failed: {d}\n{}", serve.log_text());
        std::thread::sleep(Duration::from_millis(20));
    }
    let log = serve.log_text();
    assert!(log.contains("not a qcow2 image"), "the domains said why they could not open the image:\n{log}");
    let sp = serve.status_json()["spares"].clone();
    assert!(sp["taken"].as_u64().unwrap() >= 1, "no spare was given the device: {sp}");
    // The pool fills again, with nothing left behind: only the spares run now.
    serve.spares_ready();
    assert_eq!(children_running(&serve, b"bulkhead\0driver\0").len(), 0, "{log}");
    assert_eq!(children_running(&serve, b"bulkhead\0spare\0").len(), 2);
    // Mended, the device serves again from a spare, its data intact.
    std::os::unix::fs::FileExt::write_all_at(&file, &head, 0).unwrap();
    let waiting = serve.spare_pids();
    let out = Command::new(exe()).args(["device", "restart", "q", "--run-dir"]).arg(&serve.run_dir).output().unwrap();
    assert!(out.status.success(), "{}\n{}", String::from_utf8_lossy(&out.stderr), serve.log_text());
    assert!(waiting.contains(&serve.driver_pid(0)), "{waiting:?}");
    let got = std::fs::read(serve.fuse_file("q")).unwrap_or_else(|e| panic!("{e}: {}", serve.log_text()));
    assert!(got[..data.len()] == data[..], "the image's data survives");
}

/// With no spares (`[domains] spares = 0`, or none ready), each domain is exec'd: restarts
/// work as before, and no spare runs.
#[test]
fn with_the_pool_empty_domains_are_execd_and_restarts_lose_nothing() {
    require_kernel!();
    let tmp = TempDir::new("spare-none");
    let cfg = format!("[domains]\nspares = 0\n{}", small_ram_config("n", "16M", "adaptive"));
    let serve = Serve::start(&tmp.path().join("run"), Some(&cfg), &["n"]);
    let data = pattern(9, 1 << 20);
    std::fs::write(serve.fuse_file("n"), &data).unwrap();
    for _ in 0..3 {
        kill_driver_and_await_next(&serve);
        let got = std::fs::read(serve.fuse_file("n")).unwrap();
        assert!(got[..data.len()] == data[..]);
    }
    let sp = serve.status_json()["spares"].clone();
    assert_eq!((sp["wanted"].as_u64(), sp["started"].as_u64(), sp["taken"].as_u64()), (Some(0), Some(0), Some(0)), "{sp}");
    assert!(children_running(&serve, b"bulkhead\0spare\0").is_empty());
    let text = Command::new(exe()).args(["status", "--run-dir"]).arg(&serve.run_dir).output().unwrap();
    assert!(!String::from_utf8_lossy(&text.stdout).contains("spare domains"), "{}", String::from_utf8_lossy(&text.stdout));
}

/// The pid of device `dev`'s standby domain, if it keeps one now.
fn standby_pid(serve: &Serve, dev: usize) -> Option<u32> {
    serve.status_json()["devices"][dev]["standby"]["pid"].as_u64().map(|p| p as u32)
}

/// Waits until device 0 keeps a standby other than those in `not`; returns its pid.
fn await_standby(serve: &Serve, not: &[u32]) -> u32 {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        if let Some(p) = standby_pid(serve, 0).filter(|p| !not.contains(p)) {
            return p;
        }
        assert!(Instant::now() < deadline, "no standby domain: {}\n{}", serve.status_json()["devices"][0], serve.log_text());
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// SIGKILLs device 0's driver domain and waits for the next one; returns its pid.
fn kill_driver_and_await_next(serve: &Serve) -> u32 {
    let old = serve.driver_pid(0);
    assert_ne!(old, 0, "no driver domain: {}", serve.log_text());
    // SAFETY: signalling a domain of our own serve.
    unsafe { libc::kill(old as i32, libc::SIGKILL) };
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let p = serve.driver_pid(0);
        if p != 0 && p != old && serve.status_json()["devices"][0]["state"] == "running" {
            return p;
        }
        assert!(Instant::now() < deadline, "no new domain: {}", serve.log_text());
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Asserts that `pid` is sandboxed in every layer a driver domain is: its own namespaces and
/// empty root, no new privileges, a seccomp filter, nobody outside.
fn confined_as_a_domain(pid: u32) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    assert!(status.contains("Seccomp:\t2") && status.contains("NoNewPrivs:\t1"), "{status}");
    let mounts = std::fs::read_to_string(format!("/proc/{pid}/mountinfo")).unwrap();
    assert_eq!(mounts.lines().count(), 1, "an empty root: {mounts}");
    let map = std::fs::read_to_string(format!("/proc/{pid}/uid_map")).unwrap();
    assert_eq!(map.split_whitespace().collect::<Vec<_>>(), ["0", "65534", "1"]);
    for ns in ["mnt", "net", "pid", "ipc", "user"] {
        let theirs = std::fs::read_link(format!("/proc/{pid}/ns/{ns}")).unwrap();
        let ours = std::fs::read_link(format!("/proc/self/ns/{ns}")).unwrap();
        assert_ne!(theirs, ours, "namespace {ns} is shared with the host");
    }
}

/// After its first restart a device keeps a standby domain: its next generation, confined in
/// every layer and waiting under its own name. The next restart lets it serve (no domain made
/// then), the data is intact, and another standby follows.
#[test]
fn a_device_keeps_a_standby_after_a_restart_and_the_next_restart_takes_it() {
    require_kernel!();
    let tmp = TempDir::new("standby");
    let serve = Serve::start(&tmp.path().join("run"), Some(&small_ram_config("s", "16M", "adaptive")), &["s"]);
    let data = pattern(11, 1 << 20);
    std::fs::write(serve.fuse_file("s"), &data).unwrap();
    assert_eq!(standby_pid(&serve, 0), None, "no standby before the first restart");
    kill_driver_and_await_next(&serve);
    let standby = await_standby(&serve, &[]);
    confined_as_a_domain(standby);
    let cmd = std::fs::read(format!("/proc/{standby}/cmdline")).unwrap();
    assert!(cmd.starts_with(b"bulkhead\0standby\0s\0"), "{}", String::from_utf8_lossy(&cmd));
    assert_eq!(serve.status_json()["spares"]["standbys_held"], 1);
    let text = Command::new(exe()).args(["status", "--run-dir"]).arg(&serve.run_dir).output().unwrap();
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(text.contains(&format!("standby domain of s: pid {standby} waiting")), "{text}");

    let new = kill_driver_and_await_next(&serve);
    assert_eq!(new, standby, "the standby serves the next generation");
    let d = serve.status_json()["devices"][0].clone();
    assert_eq!(d["standby_restarts"], 1, "{d}");
    let cmd = std::fs::read(format!("/proc/{new}/cmdline")).unwrap();
    assert!(cmd.starts_with(b"bulkhead\0driver\0s\0"), "{}", String::from_utf8_lossy(&cmd));
    confined_as_a_domain(new);
    let got = std::fs::read(serve.fuse_file("s")).unwrap();
    assert!(got[..data.len()] == data[..], "the contents survive a restart into a standby");
    let next = await_standby(&serve, &[standby]);
    assert_ne!(next, new);
    // Nothing is left over: one domain, one standby, the spares.
    serve.spares_ready();
    assert_eq!(children_running(&serve, b"bulkhead\0driver\0").len(), 1);
    assert_eq!(children_running(&serve, b"bulkhead\0standby\0").len(), 1);
}

/// A standby killed while it waits is replaced by another; one killed just before the
/// restart it was for leaves that restart to make its domain as usual. Nothing is lost.
#[test]
fn a_standby_killed_while_it_waits_is_replaced_and_restarts_go_on() {
    require_kernel!();
    let tmp = TempDir::new("standby-kill");
    let serve = Serve::start(&tmp.path().join("run"), Some(&small_ram_config("k", "16M", "adaptive")), &["k"]);
    let data = pattern(13, 1 << 20);
    std::fs::write(serve.fuse_file("k"), &data).unwrap();
    kill_driver_and_await_next(&serve);
    let victim = await_standby(&serve, &[]);
    // SAFETY: signalling a domain of our own serve.
    unsafe { libc::kill(victim as i32, libc::SIGKILL) };
    let second = await_standby(&serve, &[victim]);
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::fs::metadata(format!("/proc/{victim}")).is_ok() {
        assert!(Instant::now() < deadline, "the killed standby {victim} was not reaped");
        std::thread::sleep(Duration::from_millis(20));
    }
    // Killed, and the domain it stood by for killed at once after it.
    let before = serve.status_json()["devices"][0]["standby_restarts"].as_u64().unwrap();
    // SAFETY: as above.
    unsafe { libc::kill(second as i32, libc::SIGKILL) };
    let new = kill_driver_and_await_next(&serve);
    assert_ne!(new, second);
    let d = serve.status_json()["devices"][0].clone();
    assert_eq!(d["standby_restarts"].as_u64(), Some(before), "a dead standby served nothing: {d}");
    let got = std::fs::read(serve.fuse_file("k")).unwrap();
    assert!(got[..data.len()] == data[..]);
    assert_eq!(d["requests_failed"].as_u64(), Some(0), "{d}");
    // …and the device keeps standing by.
    await_standby(&serve, &[victim, second]);
}

/// A live change to the chain (a filter added) leaves the standby behind: the restart the
/// change makes builds the new chain, the old standby ends, and the next standby runs the new
/// chain, so that the next kill keeps the filter.
#[test]
fn a_filter_added_ends_the_standby_and_the_next_one_runs_the_new_chain() {
    require_kernel!();
    let tmp = TempDir::new("standby-chain");
    let serve = Serve::start(&tmp.path().join("run"), Some(&small_ram_config("c", "16M", "adaptive")), &["c"]);
    let data = pattern(17, 1 << 20);
    std::fs::write(serve.fuse_file("c"), &data).unwrap();
    kill_driver_and_await_next(&serve);
    let old = await_standby(&serve, &[]);
    let out =
        Command::new(exe()).args(["filter", "add", "c", "type = \"stats\"", "--run-dir"]).arg(&serve.run_dir).output().unwrap();
    assert!(out.status.success(), "{}\n{}", String::from_utf8_lossy(&out.stderr), serve.log_text());
    assert_ne!(serve.driver_pid(0), old, "a standby built for the old chain does not serve the new one");
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::fs::metadata(format!("/proc/{old}")).is_ok() {
        assert!(Instant::now() < deadline, "the old standby {old} still runs");
        std::thread::sleep(Duration::from_millis(20));
    }
    let next = await_standby(&serve, &[old]);
    assert_eq!(kill_driver_and_await_next(&serve), next);
    let d = serve.status_json()["devices"][0].clone();
    let filters: Vec<&str> = d["filters"].as_array().unwrap().iter().filter_map(|f| f["type"].as_str()).collect();
    assert_eq!(filters, ["stats"], "{d}");
    let got = std::fs::read(serve.fuse_file("c")).unwrap();
    assert!(got[..data.len()] == data[..]);
}
