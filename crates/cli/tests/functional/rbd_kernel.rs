//! The `rbd` backend against a real single-node Ceph cluster (`scripts/ceph-dev.sh`), each test
//! with a cluster of its own in a network namespace of its own, torn down even on failure.

#[path = "../common/mod.rs"]
mod common;

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use bulkhead_testkit::require_kernel;
use common::ceph::Cluster;
use common::*;

/// Runs `bulkhead ARGS` against `serve`'s control socket; its stdout, or its stderr if it failed.
fn cli(run_dir: &Path, args: &[&str]) -> Result<String, String> {
    let out = Command::new(exe()).args(args).arg("--run-dir").arg(run_dir).output().unwrap();
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

fn qemu_io(uri: &str, cmds: &[&str]) -> std::process::Output {
    let mut c = Command::new("timeout");
    c.args(["60", "qemu-io", "-f", "raw"]);
    for cmd in cmds {
        c.args(["-c", cmd]);
    }
    c.arg(uri).output().unwrap()
}

fn qemu_io_ok(uri: &str, cmds: &[&str]) {
    let out = qemu_io(uri, cmds);
    let text = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && !text.contains("fail") && !text.contains("error"), "qemu-io {cmds:?}: {text}");
}

#[test]
fn each_operation_round_trips_and_the_image_interoperates_with_rbd() {
    require_kernel!();
    let Some(cluster) = Cluster::up("ops") else { return };
    let tmp = TempDir::new("rbd-ops");
    // An image made by `rbd import` serves through bulkhead as it is.
    let seed: Vec<u8> = (0..4u32 << 20).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
    let src = tmp.path().join("seed.img");
    std::fs::write(&src, &seed).unwrap();
    cluster.rbd(&["import", src.to_str().unwrap(), "rbd/img"]);
    // No `size`: the device is the whole image, as a domain found it.
    let run_dir = tmp.path().join("run");
    let serve = Serve::start_in_netns(&run_dir, &cluster.config("img", "", ""), &[], &[], &cluster.netns, false).unwrap();
    assert!(serve.log_text().contains("size 4194304 bytes, the whole of image `rbd/img`"), "{}", serve.log_text());
    // An image that is not there is named, and nothing is added.
    let missing = tmp.path().join("missing.toml");
    std::fs::write(&missing, cluster.device("m", "nosuch", "", "")).unwrap();
    let e = cli(&run_dir, &["device", "add", missing.to_str().unwrap()]).unwrap_err();
    assert!(e.contains("device `m`") && e.contains("image `rbd/nosuch`") && e.contains("size is unknown"), "{e}");
    assert!(serve.status_json()["devices"].as_array().unwrap().len() == 1, "{}", serve.status_json());
    let uri = serve.nbd_uri("r");
    let got = tmp.path().join("got.img");
    let out = Command::new("nbdcopy").args([&uri, got.to_str().unwrap()]).output().unwrap();
    assert!(out.status.success(), "nbdcopy: {}", String::from_utf8_lossy(&out.stderr));
    assert!(std::fs::read(&got).unwrap() == seed, "the imported image reads back through bulkhead as written");
    // Writes (4 KiB, unaligned spans of blocks, 1 MiB), a FUA write, a flush; a 4 KiB discard
    // and a write-zeroes each read back as zeroes (no discard is dropped).
    qemu_io_ok(
        &uri,
        &[
            "write -P 0x11 0 4k",
            "write -P 0x22 12k 20k",
            "write -P 0x33 1M 1M",
            "write -f -P 0x44 3M 64k",
            "flush",
            "read -P 0x11 0 4k",
            "read -P 0x22 12k 20k",
            "read -P 0x33 1M 1M",
            "read -P 0x44 3M 64k",
            "discard 12k 4k",
            "read -P 0 12k 4k",
            "read -P 0x22 16k 16k",
            "write -z 1M 4k",
            "read -P 0 1M 4k",
            "read -P 0x33 1028k 1020k",
        ],
    );
    drop(serve);
    // What bulkhead wrote, `rbd export` reads byte for byte.
    let mut want = seed.clone();
    want[0..4096].fill(0x11);
    want[12 << 10..32 << 10].fill(0x22);
    want[1 << 20..2 << 20].fill(0x33);
    want[3 << 20..(3 << 20) + (64 << 10)].fill(0x44);
    want[12 << 10..16 << 10].fill(0);
    want[1 << 20..(1 << 20) + 4096].fill(0);
    let exported = cluster.rbd(&["export", "rbd/img", "-"]);
    assert_eq!(exported.len(), want.len());
    let first = exported.iter().zip(&want).position(|(a, b)| a != b);
    assert!(first.is_none(), "rbd export differs from what was written, first at byte {first:?}");
}

#[test]
fn a_killed_rbd_domain_breaks_only_its_own_lock_and_loses_nothing() {
    require_kernel!();
    let Some(cluster) = Cluster::up("kill") else { return };
    if bulkhead_testkit::kernel::which("fio").is_none() {
        assert!(std::env::var("BULKHEAD_REQUIRE_KERNEL").as_deref() != Ok("1"), "fio required");
        return;
    }
    let tmp = TempDir::new("rbd-kill");
    cluster.rbd(&["create", "--size", "256M", "rbd/k"]);
    let mut serve =
        Serve::start_in_netns(&tmp.path().join("run"), &cluster.config("k", "256M", ""), &[], &[], &cluster.netns, false)
            .unwrap();
    // A domain killed before its first write holds no lock, but leaves its watch on the image:
    // the next domain evicts it, or the last domain's flush and close at the end would wait
    // for it.
    let watchers = || String::from_utf8_lossy(&cluster.rbd(&["status", "rbd/k"])).matches("watcher=").count();
    let until = |what: &str, ok: &dyn Fn() -> bool| {
        let deadline = Instant::now() + Duration::from_secs(20);
        while !ok() {
            assert!(Instant::now() < deadline, "{what}: {}", serve.log_text());
            std::thread::sleep(Duration::from_millis(100));
        }
    };
    until("the domain did not open the image", &|| watchers() == 1);
    // SAFETY: killing the device's own driver domain.
    unsafe { libc::kill(serve.driver_pid(0) as i32, libc::SIGKILL) };
    until("the killed domain's watch was not evicted", &|| serve.log_text().contains("evicted the watch of an earlier domain"));
    assert_eq!(watchers(), 1, "{}", String::from_utf8_lossy(&cluster.rbd(&["status", "rbd/k"])));
    let uri = serve.nbd_uri("r");
    let mut rng = Rng::new(0x9e37_79b9_7f4a_7c15);
    let killer =
        DomainKiller::start(serve.run_dir.clone(), move || Duration::from_millis(150 + rng.next_u64() % 250), driver_domain);
    fio_nbd_verify(&uri, "rbdkill", "32M", 10, 180);
    let kills = killer.stop().first().copied().unwrap_or(0);
    assert!(kills >= 10, "only {kills} kills landed: {}", serve.log_text());
    let log = serve.log_text();
    let broke = log.matches("broke the exclusive lock of an earlier domain").count();
    assert!(broke >= 1, "no domain broke its predecessor's lock: {log}");
    let st = serve.status_json();
    let d = &st["devices"][0];
    let p99 = d["p99_outage_ms"].as_f64().unwrap_or(f64::MAX);
    eprintln!("rbd kills: {kills}, locks broken: {broke}, restarts {}, outage p99 {p99:.1} ms", d["restarts"]);
    // Without the lock break a new domain's first write waits ~30 s for the dead owner.
    assert!(p99 < 5000.0, "outage p99 {p99} ms: {st}");
    // With every dead domain's watch and lock gone, serve stops cleanly: a final flush, and
    // the last domain closes the image and exits when asked.
    let t = Instant::now();
    assert!(serve.stop().success());
    let log = serve.log_text();
    assert!(!log.contains("did not stop") && !log.contains("final flush did not complete"), "{log}");
    eprintln!("serve stopped in {} ms", t.elapsed().as_millis());
}

#[test]
fn an_rbd_domain_reaches_the_cluster_and_nothing_else() {
    require_kernel!();
    let Some(cluster) = Cluster::up("reach") else { return };
    let tmp = TempDir::new("rbd-reach");
    cluster.rbd(&["create", "--size", "16M", "rbd/n"]);
    let env = [("BULKHEAD_TEST_CONNECT", "127.0.0.1:3300,127.0.0.2:3300,10.9.9.9:80")];
    let Some(serve) =
        Serve::start_in_netns(&tmp.path().join("run"), &cluster.config("n", "16M", ""), &[], &env, &cluster.netns, true)
    else {
        return;
    };
    let uri = serve.nbd_uri("r");
    qemu_io_ok(&uri, &["write -P 0x5a 0 64k", "read -P 0x5a 0 64k"]);
    let deadline = Instant::now() + Duration::from_secs(10);
    while !serve.log_text().contains("TEST CONNECT 10.9.9.9:80") && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    let log = serve.log_text();
    assert!(log.contains("TEST CONNECT 127.0.0.1:3300: connected"), "a monitor is reachable: {log}");
    for refused in ["127.0.0.2:3300", "10.9.9.9:80"] {
        let line = log.lines().find(|l| l.contains(&format!("TEST CONNECT {refused}:"))).unwrap_or_else(|| panic!("{log}"));
        assert!(line.contains("Permission denied"), "a connect to {refused} is refused: {line}");
        assert!(log.contains(&format!("refused a connection to {refused}")), "the supervisor says so: {log}");
    }
    let st = serve.status_json();
    assert_eq!(st["devices"][0]["sandbox"]["seccomp_role"], "rbd", "{st}");
    assert_eq!(st["devices"][0]["sandbox"]["landlock"], "applied", "{st}");
}

#[test]
fn a_cluster_that_stops_answering_gives_a_bounded_pause_then_errors_and_the_device_recovers() {
    require_kernel!();
    let Some(cluster) = Cluster::up("osd") else { return };
    let tmp = TempDir::new("rbd-osd");
    cluster.rbd(&["create", "--size", "16M", "rbd/s"]);
    // A restart limit of 3: domains that the stalled cluster never answers are not counted.
    let cfg = cluster.config("s", "16M", "op_timeout_ms = 2000\n").replace("restart_limit = 100000", "restart_limit = 3");
    let serve = Serve::start_in_netns(&tmp.path().join("run"), &cfg, &[], &[], &cluster.netns, false).unwrap();
    let uri = serve.nbd_uri("r");
    qemu_io_ok(&uri, &["write -P 0x77 0 64k"]);
    stall_and_recover(&cluster, &serve, &uri, 0x78);
    restart_during_stall(&cluster, &serve, &uri);
    // With the monitor stopped too, a replaced domain is not started: the device reads
    // `reconnecting` until the cluster answers again.
    let mon = cluster.pid("mon.a");
    // SAFETY: stopping the cluster's own monitor.
    unsafe { libc::kill(mon, libc::SIGSTOP) };
    let driver = serve.status_json()["devices"][0]["driver_pid"].as_u64().unwrap() as i32;
    // SAFETY: killing a domain of our own serve.
    unsafe { libc::kill(driver, libc::SIGKILL) };
    let deadline = Instant::now() + Duration::from_secs(30);
    while serve.status_json()["devices"][0]["state"] != "reconnecting" {
        assert!(Instant::now() < deadline, "the device never read reconnecting: {}", serve.log_text());
        std::thread::sleep(Duration::from_millis(100));
    }
    // SAFETY: as above.
    unsafe { libc::kill(mon, libc::SIGCONT) };
    let deadline = Instant::now() + Duration::from_secs(30);
    while serve.status_json()["devices"][0]["state"] != "running" {
        assert!(Instant::now() < deadline, "the device did not reconnect: {}", serve.log_text());
        std::thread::sleep(Duration::from_millis(100));
    }
    qemu_io_ok(&uri, &["read -P 0x79 2M 64k"]);
    // Under a tap domain the rbd domain lies below it: the device still says so.
    cli(&serve.run_dir, &["device", "tap", "r", "interpose"]).unwrap();
    // The new domains have opened the image once a request is answered through them.
    qemu_io_ok(&uri, &["read -P 0x79 2M 64k"]);
    stall_and_recover(&cluster, &serve, &uri, 0x7a);
    restart_during_stall(&cluster, &serve, &uri);
    assert_eq!(serve.status_json()["devices"][0]["tap"], "interpose");
}

/// Kills the domain that holds the rbd backend while the OSD is stopped: each new domain
/// cannot open the image and ends after the op timeout, and is replaced after a back-off, the
/// device `reconnecting` throughout, more times than the restart limit without failing it;
/// once the OSD runs, a new domain opens the image and the device reads `running`.
fn restart_during_stall(cluster: &Cluster, serve: &Serve, uri: &str) {
    let device = || serve.status_json()["devices"][0].clone();
    let before = device()["restarts"].as_u64().unwrap_or(0);
    let osd = cluster.pid("osd.0");
    // SAFETY: stopping the cluster's own OSD.
    unsafe { libc::kill(osd, libc::SIGSTOP) };
    let holder = device()["driver_pid"].as_u64().unwrap_or(0) as i32;
    assert!(holder > 0, "{}", device());
    // SAFETY: killing the domain of our own serve that holds the backend.
    unsafe { libc::kill(holder, libc::SIGKILL) };
    let killed = Instant::now();
    let deadline = killed + Duration::from_secs(40);
    let mut states = std::collections::BTreeSet::new();
    let d = loop {
        let d = device();
        let state = d["state"].as_str().unwrap_or("?").to_string();
        // The first replacement, counted (a kill is a crash), opens the image while the OSD
        // is stopped: past the second's grace, the device waits for the cluster.
        let at = killed.elapsed();
        assert!(state != "running" || at < Duration::from_millis(1500), "{state} {at:?} after the kill: {d}");
        states.insert(state);
        if d["state"] == "failed" || d["restarts"].as_u64().unwrap_or(0) >= before + 5 || Instant::now() > deadline {
            break d;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    // SAFETY: as above.
    unsafe { libc::kill(osd, libc::SIGCONT) };
    assert!(d["restarts"].as_u64().unwrap_or(0) >= before + 5, "domains were not replaced during the stall: {d}");
    assert!(!states.contains("failed") && states.contains("reconnecting"), "{states:?}: {d}\n{}", serve.log_text());
    assert!(d["failure"].as_str().is_some_and(|f| f.contains("reconnecting") || f.contains("did not answer")), "{d}");
    let deadline = Instant::now() + Duration::from_secs(30);
    while device()["state"] != "running" {
        assert!(Instant::now() < deadline, "the device did not read running once the OSD ran: {}", serve.log_text());
        std::thread::sleep(Duration::from_millis(100));
    }
    qemu_io_ok(uri, &["read -P 0x77 0 64k"]);
    eprintln!("restarts during the stall ({}): {}, states {states:?}", d["tap"], d["restarts"].as_u64().unwrap_or(0) - before);
}

/// Stops the cluster's OSD under a write to `uri`'s device: the write fails within a bounded
/// time, the device reads `reconnecting` with its domain kept; once the OSD runs again, the
/// device works and reads `running`, and its log says both.
fn stall_and_recover(cluster: &Cluster, serve: &Serve, uri: &str, pattern: u8) {
    let logged = |what: &str| serve.log_text().matches(what).count();
    let (stopped_before, again_before) = (logged("remote stopped answering"), logged("remote answers again"));
    let osd = cluster.pid("osd.0");
    // SAFETY: stopping the cluster's own OSD.
    unsafe { libc::kill(osd, libc::SIGSTOP) };
    let t = Instant::now();
    let out = qemu_io(uri, &[&format!("write -P {pattern:#x} 1M 64k")]);
    let took = t.elapsed();
    // The device says it is waiting for the cluster, and keeps its domain: a new one would
    // fare no better.
    let d = serve.status_json()["devices"][0].clone();
    // SAFETY: as above.
    unsafe { libc::kill(osd, libc::SIGCONT) };
    assert_eq!(d["state"], "reconnecting", "while the OSD is stopped, after {took:?}: {d}\n{}", serve.log_text());
    assert!(d["failure"].as_str().is_some_and(|f| f.contains("stopped answering")), "{d}");
    assert!(d["driver_pid"].as_u64().unwrap_or(0) > 0, "the domain is kept: {d}");
    let text = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(text.contains("error") || text.contains("failed") || !out.status.success(), "the write fails: {text}");
    assert!(took < Duration::from_secs(20), "the pause is bounded: {took:?}");
    eprintln!("stopped OSD ({}): the write failed after {took:?}", d["tap"]);
    // Once the OSD runs again, so does the device.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let out = qemu_io(uri, &["write -P 0x79 2M 64k", "read -P 0x79 2M 64k", "read -P 0x77 0 64k"]);
        let text = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
        if out.status.success() && !text.contains("fail") && !text.contains("error") {
            break;
        }
        assert!(Instant::now() < deadline, "the device did not recover: {text}\n{}", serve.log_text());
        std::thread::sleep(Duration::from_millis(500));
    }
    assert_eq!(serve.status_json()["devices"][0]["state"], "running", "once the cluster answers again");
    let log = serve.log_text();
    assert!(logged("remote stopped answering") > stopped_before && logged("remote answers again") > again_before, "{log}");
}

#[test]
fn ext4_over_fuse_on_a_luks2_volume_cryptsetup_made_survives_rbd_domain_kills_and_reopens() {
    require_kernel!();
    if !tools(&["cryptsetup", "fio"]) {
        return;
    }
    let Some(cluster) = Cluster::up("luks") else { return };
    let tmp = TempDir::new("rbd-luks");
    // cryptsetup formats a file (there is no kernel rbd here), and `rbd import` makes it the image.
    let vol = tmp.path().join("vol.img");
    std::fs::File::create(&vol).unwrap().set_len(176 << 20).unwrap();
    let key = tmp.path().join("key");
    std::fs::write(&key, b"correct horse battery staple\n").unwrap();
    sh(
        "cryptsetup",
        &[
            "luksFormat",
            "-q",
            "--type",
            "luks2",
            "--pbkdf",
            "pbkdf2",
            "--pbkdf-force-iterations",
            "1000",
            "--sector-size",
            "512",
            "--key-file",
            key.to_str().unwrap(),
            vol.to_str().unwrap(),
        ],
    );
    cluster.rbd(&["import", vol.to_str().unwrap(), "rbd/lv"]);
    let filter = format!("[[device.filter]]\ntype = \"crypt\"\nkey_file = \"{}\"\n", key.display());
    let cfg = cluster.device("c", "lv", "176M", &filter);
    let mut serve = Serve::start_in_netns(&tmp.path().join("run"), &cfg, &["c"], &[], &cluster.netns, false).unwrap();
    assert_eq!(std::fs::metadata(serve.fuse_file("c")).unwrap().len(), 160 << 20, "the volume less its header");
    let mnt = tmp.path().join("mnt");
    let mut fs = Ext4::make(&serve.fuse_file("c"), &mnt);
    let marker: Vec<u8> = b"BULKHEAD-RBD-MARKER-41c9".iter().copied().cycle().take(1 << 20).collect();
    std::fs::write(mnt.join("marker"), &marker).unwrap();
    sh("sync", &[]);
    let kills = fio_verify_while_killing_the_driver(&serve, &fs.mnt, "4k-64k", "24M", 12, Duration::from_millis(400), 20);
    fs.unmount_and_check();
    drop(fs);
    let p99 = serve.status_json()["devices"][0]["p99_outage_ms"].as_f64().unwrap_or(0.0);
    eprintln!("ext4 over FUSE over crypt over rbd: {kills} kills, fio verify and e2fsck clean, outage p99 {p99:.1} ms");
    assert!(serve.stop().success());
    // What the cluster holds is ciphertext, under a LUKS2 header cryptsetup still opens.
    let exported = tmp.path().join("exported.img");
    cluster.rbd(&["export", "rbd/lv", exported.to_str().unwrap()]);
    let held = std::fs::read(&exported).unwrap();
    assert!(!held.windows(24).any(|w| w == b"BULKHEAD-RBD-MARKER-41c9"), "plaintext reached the cluster");
    sh("cryptsetup", &["open", "--test-passphrase", "--key-file", key.to_str().unwrap(), exported.to_str().unwrap()]);
    // A new serve opens the volume on the image again and finds the file as written.
    let serve = Serve::start_in_netns(&tmp.path().join("run2"), &cfg, &["c"], &[], &cluster.netns, false).unwrap();
    let lo = LoopGuard::attach_direct(&serve.fuse_file("c"));
    let m = MountGuard::mount(&lo.dev, &mnt);
    assert!(std::fs::read(mnt.join("marker")).unwrap() == marker, "the marker reads back");
    m.unmount();
}

#[test]
fn a_tap_domain_with_a_cow_and_snapshots_a_view_and_a_vm_socket_work_over_rbd_and_a_wedged_domain_is_replaced() {
    require_kernel!();
    let Some(cluster) = Cluster::up("stack") else { return };
    let tmp = TempDir::new("rbd-stack");
    cluster.rbd(&["create", "--size", "64M", "rbd/t"]);
    let overlay = tmp.path().join("overlay.qcow2");
    let cfg = format!(
        "[fuse]\nenabled = false\n[vhost_user]\nenabled = true\n\
         [[device]]\nname = \"t\"\nsize = \"64M\"\ntap = \"interpose\"\nrestart_limit = 100000\nwatchdog_ms = 2000\n\
         [device.backend]\ntype = \"rbd\"\nmon_host = \"127.0.0.1:3300\"\npool = \"rbd\"\nimage = \"t\"\nkey_file = \"{}\"\n\
         op_timeout_ms = 1000\n\
         [[device.filter]]\ntype = \"cow\"\noverlay = \"{}\"\n\
         [[device.view]]\nname = \"half\"\noffset = \"32M\"\nsize = \"32M\"\niops = 5000\n",
        cluster.key_file().display(),
        overlay.display()
    );
    let run_dir = tmp.path().join("run");
    let serve = Serve::start_in_netns(&run_dir, &cfg, &[], &[], &cluster.netns, false).unwrap();
    let dev = serve.nbd_uri("t");
    let view = serve.nbd_uri("half");
    qemu_io_ok(&dev, &["write -P 0x61 0 64k", "write -P 0x62 32M 64k", "read -P 0x61 0 64k"]);
    qemu_io_ok(&view, &["read -P 0x62 0 64k", "write -P 0x63 64k 64k"]);
    qemu_io_ok(&dev, &["read -P 0x63 32832k 64k"]);
    let snap = |args: &[&str]| {
        let out = Command::new(exe()).arg("snapshot").args(args).arg("--run-dir").arg(&run_dir).output().unwrap();
        assert!(out.status.success(), "snapshot {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    };
    snap(&["create", "t", "before"]);
    qemu_io_ok(&dev, &["write -P 0x64 0 64k"]);
    snap(&["revert", "t", "before"]);
    qemu_io_ok(&dev, &["read -P 0x61 0 64k"]);
    // The cow keeps writes in its overlay: the image below has none of them.
    let below = cluster.rbd(&["export", "rbd/t", "-"]);
    assert!(below.iter().all(|&b| b == 0), "the rbd image below a cow overlay stays unwritten");
    assert!(run_dir.join("vhost/t.sock").exists() && run_dir.join("vhost/half.sock").exists(), "a vhost-user socket each");
    // A wedged rbd domain (stopped, its requests pending) is replaced by the watchdog, and the
    // request completes on its successor. A read of what the overlay does not hold goes below.
    let st = serve.status_json();
    let below_pid = st["devices"][0]["driver_pid"].as_u64().unwrap() as i32;
    let reader = std::thread::spawn({
        let dev = dev.clone();
        move || {
            std::thread::sleep(Duration::from_millis(200));
            qemu_io(&dev, &["read -P 0 48M 64k"])
        }
    });
    // SAFETY: stopping a domain of our own serve.
    unsafe { libc::kill(below_pid, libc::SIGSTOP) };
    let out = reader.join().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && !text.contains("fail") && !text.contains("error"), "through the wedge: {text}");
    let d = &serve.status_json()["devices"][0];
    assert_ne!(d["driver_pid"].as_u64().unwrap() as i32, below_pid, "the wedged domain was replaced: {d}");
    assert_eq!(d["tap"], "interpose", "{d}");
}

#[test]
fn with_a_keeper_a_killed_serve_is_followed_by_one_that_breaks_its_domains_lock_at_once() {
    require_kernel!();
    let Some(cluster) = Cluster::up("keeper") else { return };
    let tmp = TempDir::new("rbd-keeper");
    cluster.rbd(&["create", "--size", "64M", "rbd/kk"]);
    let cfg = format!("[keeper]\nenabled = true\n{}", cluster.config("kk", "64M", ""));
    let serve = Serve::start_in_netns(&tmp.path().join("run"), &cfg, &[], &[], &cluster.netns, false).unwrap();
    let hello = || {
        bulkhead_control::Client::connect(&serve.run_dir)
            .ok()
            .and_then(|mut c| c.call(bulkhead_control::Hello {}).ok())
            .map(|h| h.pid)
    };
    let uri = serve.nbd_uri("r");
    // A write takes the image's exclusive lock for the domain.
    qemu_io_ok(&uri, &["write -P 0x5a 0 1M"]);
    for round in 0..2 {
        let old = hello().expect("a serve answers");
        // kill -9 of serve: its domains die with it, and their lock stays in the cluster.
        bulkhead_sys::signal(old, libc::SIGKILL).unwrap();
        let started = Instant::now();
        let deadline = started + Duration::from_secs(30);
        while hello().is_none_or(|p| p == old) {
            assert!(Instant::now() < deadline, "no new serve: {}", serve.log_text());
            std::thread::sleep(Duration::from_millis(5));
        }
        // Without the dead domain's owner kept, this first write waits ~30 s for its lock.
        let offset = format!("{}M", round + 1);
        qemu_io_ok(&uri, &[&format!("write -P 0x6b {offset} 1M"), "read -P 0x5a 0 1M", &format!("read -P 0x6b {offset} 1M")]);
        let took = started.elapsed();
        eprintln!("round {round}: a new serve wrote to the image {} ms after the kill", took.as_millis());
        assert!(took < Duration::from_secs(10), "the first write after a crash of serve took {took:?}: {}", serve.log_text());
        // The domain says so on its standard error, which serve copies to the log: wait for
        // the line before the next kill, which would lose it with serve's copy unread.
        let deadline = Instant::now() + Duration::from_secs(10);
        while serve.log_text().matches("broke the exclusive lock of an earlier domain").count() <= round {
            assert!(Instant::now() < deadline, "round {round}: no lock broken: {}", serve.log_text());
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    let log = serve.log_text();
    assert!(log.contains("lock owner(s) of the serve before this one kept"), "{log}");
    assert!(log.matches("broke the exclusive lock of an earlier domain").count() >= 2, "{log}");
}
