//! One driver domain, many clients: views of one device through the real exports (FUSE, NBD
//! with qemu-io and fio), each held to its range and its access, none able to stall the
//! others, none losing a write when the shared domain is killed under all of them.

#[path = "../common/mod.rs"]
mod common;

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::process::Command;
use std::time::{Duration, Instant};

use common::*;

/// A 48 MiB ramdisk with four 8 MiB views after its first 8 MiB (`vm3` read-only).
fn config(extra_view_keys: &str) -> String {
    let mut c = String::from(
        "[nbd]\nhandshake_timeout_ms = 2000\n\
         [[device]]\nname = \"disk0\"\nsize = \"48M\"\nqueues = 2\n[device.backend]\ntype = \"ram\"\n",
    );
    for i in 0..4 {
        c += &format!(
            "[[device.view]]\nname = \"vm{i}\"\noffset = \"{}M\"\nsize = \"8M\"\n{}{extra_view_keys}\n",
            8 + 8 * i,
            if i == 3 { "read_only = true\n" } else { "" }
        );
    }
    c
}

fn start(tag: &str, cfg: &str) -> (TempDir, Serve) {
    let tmp = TempDir::new(tag);
    let run_dir = tmp.path().join("run");
    let serve = Serve::start(&run_dir, Some(cfg), &[]);
    let deadline = Instant::now() + Duration::from_secs(10);
    while !run_dir.join("nbd.sock").exists() || !run_dir.join("fuse/vm0").exists() {
        assert!(Instant::now() < deadline, "exports not up: {}", serve.log_text());
        std::thread::sleep(Duration::from_millis(20));
    }
    (tmp, serve)
}

/// A view reads and writes its own range: past its end a client gets an error and nothing else
/// is touched; a read-only view refuses every way of writing, and the device around both keeps
/// what it held.
#[test]
fn a_view_is_held_to_its_range_and_its_access() {
    if !tools(&["qemu-io"]) {
        return;
    }
    let (_tmp, serve) = start("share-range", &config(""));
    // The whole device: 0x11 everywhere.
    qemu_io("raw", false, &serve.nbd_uri("disk0"), &["write -P 0x11 0 48M"]);
    // vm1 writes its whole range, then tries past it over NBD and FUSE.
    qemu_io("raw", false, &serve.nbd_uri("vm1"), &["write -P 0xab 0 8M"]);
    let past = Command::new("qemu-io")
        .args(["-f", "raw", "-c", "write -P 0xcd 8M 4k", "-c", "read 8M 4k", &serve.nbd_uri("vm1")])
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&past.stdout), String::from_utf8_lossy(&past.stderr));
    assert!(text.contains("out of range") || text.contains("Invalid argument") || !past.status.success(), "{text}");
    let f = serve.fuse_file("vm1");
    let dd = Command::new("dd")
        .args(["if=/dev/zero", &format!("of={}", f.display()), "bs=4k", "seek=2048", "count=4", "conv=notrunc", "oflag=direct"])
        .output()
        .unwrap();
    assert!(!dd.status.success() || String::from_utf8_lossy(&dd.stderr).contains("0 bytes"), "dd past the end: {dd:?}");
    // vm3 is read-only: NBD says so, FUSE will not open it for writing, a forced write fails.
    let ro = serve.nbd_uri("vm3");
    let info = Command::new("nbdinfo").arg(&ro).output().map(|o| String::from_utf8_lossy(&o.stdout).into_owned());
    if let Ok(info) = info {
        assert!(info.contains("is_read_only: true"), "{info}");
    }
    let w = Command::new("qemu-io").args(["-f", "raw", "-c", "write 0 4k", &ro]).output().unwrap();
    assert!(!w.status.success() || String::from_utf8_lossy(&w.stdout).contains("failed"), "{w:?}");
    let err = std::fs::OpenOptions::new().write(true).open(serve.fuse_file("vm3")).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EROFS), "{err}");
    qemu_io("raw", true, &ro, &["read -P 0x11 0 8M"]);
    // The device: vm1's range holds 0xab, everything else 0x11.
    qemu_io("raw", true, &serve.nbd_uri("disk0"), &["read -P 0x11 0 16M", "read -P 0xab 16M 8M", "read -P 0x11 24M 24M"]);
}

/// A client that sends requests and never reads the answers holds up its own connection only:
/// a client of another view is served meanwhile.
#[test]
fn a_client_that_never_reads_its_answers_does_not_stall_the_others() {
    if !tools(&["qemu-io"]) {
        return;
    }
    let (_tmp, serve) = start("share-stall", &config(""));
    let mut s = UnixStream::connect(serve.run_dir.join("nbd.sock")).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut greeting = [0u8; 18];
    s.read_exact(&mut greeting).unwrap();
    // Fixed newstyle, no zeroes; NBD_OPT_EXPORT_NAME "vm0".
    s.write_all(&3u32.to_be_bytes()).unwrap();
    let mut opt = 0x4948_4156_454f_5054u64.to_be_bytes().to_vec();
    opt.extend_from_slice(&1u32.to_be_bytes());
    opt.extend_from_slice(&3u32.to_be_bytes());
    opt.extend_from_slice(b"vm0");
    s.write_all(&opt).unwrap();
    let mut export = [0u8; 10];
    s.read_exact(&mut export).unwrap();
    // 1 MiB reads, far more than the socket holds answers for, never read.
    s.set_write_timeout(Some(Duration::from_secs(2))).unwrap();
    let mut sent = 0;
    for cookie in 0..512u64 {
        let mut r = 0x2560_9513u32.to_be_bytes().to_vec();
        r.extend_from_slice(&0u16.to_be_bytes());
        r.extend_from_slice(&0u16.to_be_bytes());
        r.extend_from_slice(&cookie.to_be_bytes());
        r.extend_from_slice(&((cookie % 7) << 20).to_be_bytes());
        r.extend_from_slice(&(1u32 << 20).to_be_bytes());
        if s.write_all(&r).is_err() {
            break;
        }
        sent += 1;
    }
    assert!(sent > 0);
    // Another view, and the device itself, are served while that client sits there.
    for target in ["vm1", "disk0"] {
        let started = Instant::now();
        qemu_io("raw", false, &serve.nbd_uri(target), &["write -P 0x42 0 1M", "read -P 0x42 0 1M", "flush"]);
        assert!(started.elapsed() < Duration::from_secs(60), "{target} waited {:?}", started.elapsed());
    }
    drop(s);
}

/// Four clients, one per view, run fio verify at once while the domain they share is killed
/// again and again: none of them sees an error.
#[test]
fn four_clients_lose_nothing_when_their_shared_domain_is_killed() {
    if !tools(&["fio"]) {
        return;
    }
    let cfg = config("queues = 2\n")
        .replace("read_only = true\n", "")
        .replace("queues = 2\n[device.backend]", "queues = 2\nrestart_limit = 1000\n[device.backend]");
    let (_tmp, serve) = start("share-kill", &cfg);
    let mut args: Vec<String> =
        ["--ioengine=libaio", "--direct=1", "--rw=randrw", "--bsrange=4k-128k", "--iodepth=8", "--size=8M", "--runtime=8"]
            .into_iter()
            .chain(FIO_VERIFY)
            .map(String::from)
            .collect();
    for i in 0..4 {
        args.push(format!("--name=vm{i}"));
        args.push(format!("--filename={}", serve.fuse_file(&format!("vm{i}")).display()));
    }
    let killer = DomainKiller::start(serve.run_dir.clone(), || Duration::from_millis(700), driver_domain);
    let out = Command::new("timeout").args(["--kill-after=10", "180", "fio"]).args(&args).output().unwrap();
    let kills = killer.stop();
    assert!(
        out.status.success(),
        "fio: {}\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
        serve.log_text()
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let jobs = v["jobs"].as_array().unwrap();
    assert_eq!(jobs.len(), 4);
    for j in jobs {
        assert_eq!(j["error"], 0, "{} saw an I/O or verify error", j["jobname"]);
        assert!(j["write"]["io_bytes"].as_u64().unwrap() > 0, "{} wrote nothing", j["jobname"]);
    }
    assert!(kills.first().copied().unwrap_or(0) >= 3, "killed {kills:?}: {}", serve.log_text());
}

/// A cap set on a running view holds, and lifting it frees the view: `bulkhead view qos` changes it
/// without a restart, and `status --json` shows the caps and the credit. A weight set on it
/// instead leaves every view readable.
#[test]
fn a_running_views_caps_change_without_a_restart() {
    let (_tmp, serve) = start("share-qos", &config(""));
    let pid = serve.driver_pid(0);
    let qos = |args: &[&str]| {
        let out = Command::new(exe()).args(["view", "qos"]).args(args).arg("--run-dir").arg(&serve.run_dir).output().unwrap();
        (out.status.success(), format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)))
    };
    let (ok, text) = qos(&["vm0", "iops=50", "burst_ios=1"]);
    assert!(ok, "{text}");
    assert!(text.contains("50 IOPS"), "{text}");
    // 26 reads at 50 a second after the first: half a second at least.
    let f = serve.fuse_file("vm0");
    let started = Instant::now();
    let dd = Command::new("dd")
        .args([&format!("if={}", f.display()), "of=/dev/null", "bs=4k", "count=26", "iflag=direct"])
        .output()
        .unwrap();
    assert!(dd.status.success(), "{dd:?}");
    assert!(started.elapsed() >= Duration::from_millis(480), "26 reads under 50 IOPS took {:?}", started.elapsed());
    let st = serve.status_json();
    let v = &st["devices"][0]["views"][0];
    assert_eq!(v["name"], "vm0");
    assert_eq!(v["qos"]["iops"], 50);
    assert!(v["credit_waits"].as_u64().unwrap_or(0) > 0, "{v}");
    // Lifted: the same reads go at once (no restart: the same domain).
    let (ok, text) = qos(&["vm0", "iops=none"]);
    assert!(ok, "{text}");
    // A weight on the running view, and a cap refused beside it (naming the key).
    let (ok, text) = qos(&["vm0", "weight=8"]);
    assert!(ok && text.contains("weight 8"), "{text}");
    assert_eq!(serve.status_json()["devices"][0]["views"][0]["qos"]["weight"], 8);
    let (ok, text) = qos(&["vm0", "iops=5"]);
    assert!(!ok && text.contains("key `weight`"), "{text}");
    // The heavier view and a lighter one both read: the lighter is held back only while the
    // heavier is active, never for good (a view held for good would leave dd stuck; `timeout`
    // turns that into a failure).
    for view in ["vm0", "vm1", "vm0"] {
        let file = format!("if={}", serve.fuse_file(view).display());
        let dd = Command::new("timeout")
            .args(["60", "dd", &file, "of=/dev/null", "bs=4k", "count=256", "iflag=direct"])
            .output()
            .unwrap();
        assert!(dd.status.success(), "{view}: {dd:?}");
    }
    let (ok, text) = qos(&["vm0", "rate=5"]);
    assert!(!ok && text.contains("unknown key `rate`"), "{text}");
    let (ok, text) = qos(&["nosuch", "iops=5"]);
    assert!(!ok && text.contains("no view `nosuch`"), "{text}");
    assert_eq!(serve.driver_pid(0), pid, "a cap change restarted the domain");
}
