//! The `cow` filter for real: ext4 and fio verify over a cow on a read-only raw file while the
//! driver domain is killed and snapshots are taken under the load; the file below unchanged
//! to the byte, and qemu reading the overlay (over that file, its recorded backing) as exactly
//! what bulkhead served. Snapshots reverted and deleted through `bulkhead snapshot`, a revert
//! refused while the device is busy, and mistakes answered by name.

#[path = "../common/mod.rs"]
mod common;

use std::os::unix::fs::FileExt;
use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bulkhead_testkit::require_kernel;
use common::*;

/// `bulkhead snapshot …` against `run_dir`: its output, or its error text.
fn snapshot(run_dir: &Path, args: &[&str]) -> Result<String, String> {
    let out = Command::new(exe()).arg("snapshot").args(args).arg("--run-dir").arg(run_dir).output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    if out.status.success() {
        Ok(text)
    } else {
        Err(text)
    }
}

fn cow_device(name: &str, lower: &Path, overlay: &Path) -> String {
    format!(
        "[[device]]\nname = \"{name}\"\nrestart_limit = 100000\n[device.backend]\ntype = \"file\"\npath = \"{}\"\nread_only = true\n\
         [[device.filter]]\ntype = \"cow\"\noverlay = \"{}\"\n",
        lower.display(),
        overlay.display()
    )
}

/// Waits until device 0 has completed no request for half a second.
fn settle(serve: &Serve) {
    let mut last = serde_json::Value::Null;
    for _ in 0..40 {
        let now = serve.status_json()["devices"][0]["requests_completed"].clone();
        if now == last {
            return;
        }
        last = now;
        std::thread::sleep(Duration::from_millis(500));
    }
    panic!("device 0 never went quiet: {}", serve.log_text());
}

/// `qemu-img check` finds no error (a cluster leaked by a domain killed mid-allocation is
/// allowed: it is not an error, and `qemu-img check -r leaks` reclaims it).
fn check_image(img: &Path) {
    let out = Command::new("qemu-img").args(["check", img.to_str().unwrap()]).output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(matches!(out.status.code(), Some(0) | Some(3)) && !text.contains("ERROR"), "qemu-img check: {text}");
}

#[test]
fn ext4_and_fio_verify_over_a_cow_while_its_domain_is_killed_and_snapshots_are_taken_leave_the_file_below_unwritten() {
    require_kernel!();
    if !tools(&["qemu-img", "fio", "mkfs.ext4"]) {
        return;
    }
    let tmp = TempDir::new("cow-ext4");
    let lower = tmp.path().join("lower.raw");
    std::fs::write(&lower, pattern(11, 4 << 20)).unwrap();
    std::fs::File::options().write(true).open(&lower).unwrap().set_len(256 << 20).unwrap();
    let before = digest(&lower);
    let overlay = tmp.path().join("overlay.qcow2");
    let run_dir = tmp.path().join("run");
    let mut serve = Serve::start(&run_dir, Some(&cow_device("c", &lower, &overlay)), &["c"]);
    // The file below shows through the empty overlay.
    let mut head = vec![0u8; 4 << 20];
    std::fs::File::open(serve.fuse_file("c")).unwrap().read_exact_at(&mut head, 0).unwrap();
    assert!(head == pattern(11, 4 << 20), "the device below reads through the overlay");

    let mnt = tmp.path().join("mnt");
    let mut fs = Ext4::make(&serve.fuse_file("c"), &mnt);
    // Snapshots while fio runs and the domain is killed: each is a new generation too.
    let stop = Arc::new(AtomicBool::new(false));
    let taker = {
        let (stop, run_dir) = (stop.clone(), run_dir.clone());
        std::thread::spawn(move || {
            let mut taken = Vec::new();
            let mut i = 0;
            while !stop.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(900));
                i += 1;
                let name = format!("load-{i}");
                match snapshot(&run_dir, &["create", "c", &name]) {
                    Ok(_) => taken.push(name),
                    // A kill may land on the generation that carries the snapshot out; the
                    // answer then says so, and the snapshot may or may not exist.
                    Err(e) => eprintln!("snapshot {name}: {e}"),
                }
            }
            taken
        })
    };
    fio_verify_while_killing_the_driver(&serve, &fs.mnt, "4k-256k", "48M", 8, Duration::from_millis(700), 3);
    stop.store(true, Ordering::Relaxed);
    let taken = taker.join().unwrap();
    assert!(taken.len() >= 3, "snapshots taken under load: {taken:?}; serve's log:\n{}", serve.log_text());
    fs.unmount_and_check();
    drop(fs);
    let st = serve.status_json();
    assert_eq!(st["devices"][0]["requests_failed"], 0, "{st}");
    let report = &st["devices"][0]["filters"][0];
    assert!(report["allocated"].as_u64().unwrap() > 0 && report["read_below"].as_u64().unwrap() > 0, "{st}");
    let listed = snapshot(&run_dir, &["list", "c"]).unwrap();
    for name in &taken {
        assert!(listed.contains(name.as_str()), "{name} not in {listed}");
    }
    // A domain started while the file system was mounted holds a copy of the mount in its
    // namespace until it exits, and the file system's last writes (its journal) come only
    // then: a fresh generation lets them land before the device is read whole.
    let out = Command::new(exe()).args(["device", "restart", "c", "--run-dir"]).arg(&run_dir).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    settle(&serve);
    let served = tmp.path().join("served.raw");
    std::fs::copy(serve.fuse_file("c"), &served).unwrap();
    assert!(serve.stop().success());

    assert_eq!(digest(&lower), before, "the device below a cow is never written");
    check_image(&overlay);
    // qemu reads the overlay over the file it names as its backing: what bulkhead served.
    let info = sh("qemu-img", &["info", overlay.to_str().unwrap()]);
    assert!(info.contains(&format!("backing file: {}", lower.canonicalize().unwrap().display())), "{info}");
    sh("qemu-img", &["compare", "-f", "qcow2", "-F", "raw", overlay.to_str().unwrap(), served.to_str().unwrap()]);
    let qlist = sh("qemu-img", &["snapshot", "-l", overlay.to_str().unwrap()]);
    for name in &taken {
        assert!(qlist.contains(name.as_str()), "qemu-img lists {qlist}");
    }
}

#[test]
fn a_snapshot_reverts_only_when_the_device_is_idle_and_mistakes_are_named() {
    require_kernel!();
    if !tools(&["qemu-img"]) {
        return;
    }
    let tmp = TempDir::new("cow-revert");
    let lower = tmp.path().join("lower.raw");
    std::fs::write(&lower, vec![0x33u8; 32 << 20]).unwrap();
    let overlay = tmp.path().join("overlay.qcow2");
    let run_dir = tmp.path().join("run");
    let config = format!(
        "{}[[device]]\nname = \"plain\"\nsize = \"4M\"\n[device.backend]\ntype = \"ram\"\n",
        cow_device("c", &lower, &overlay)
    );
    let mut serve = Serve::start(&run_dir, Some(&config), &["c", "plain"]);
    let dev = std::fs::OpenOptions::new().read(true).write(true).open(serve.fuse_file("c")).unwrap();
    let a = pattern(1, 1 << 20);
    let b = pattern(2, 1 << 20);
    dev.write_all_at(&a, 10 << 20).unwrap();
    dev.sync_all().unwrap();
    snapshot(&run_dir, &["create", "c", "with-a"]).unwrap();
    dev.write_all_at(&b, (10 << 20) + 4096).unwrap();
    dev.sync_all().unwrap();

    // Mistakes, named.
    let e = snapshot(&run_dir, &["create", "c", "with-a"]).unwrap_err();
    assert!(e.contains("exists already"), "{e}");
    let e = snapshot(&run_dir, &["revert", "c", "nothing"]).unwrap_err();
    assert!(e.contains("no snapshot named `nothing`"), "{e}");
    let e = snapshot(&run_dir, &["create", "plain", "x"]).unwrap_err();
    assert!(e.contains("plain") && e.contains("no cow filter"), "{e}");
    let e = snapshot(&run_dir, &["create", "c"]).unwrap_err();
    assert!(e.contains("<NAME>"), "the name is required: {e}");

    // Busy: a reader keeps the device at work, and the revert says so.
    let stop = Arc::new(AtomicBool::new(false));
    let reader = {
        let (stop, path) = (stop.clone(), serve.fuse_file("c"));
        std::thread::spawn(move || {
            use std::os::unix::fs::OpenOptionsExt;
            // Direct reads, so every one reaches the device rather than the page cache.
            let f = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_DIRECT).open(path).unwrap();
            let mut raw = vec![0u8; 65536 + 4096];
            let skew = raw.as_ptr().align_offset(4096);
            let buf = &mut raw[skew..skew + 65536];
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let _ = f.read_at(buf, (i % 512) * 65536);
                i += 1;
            }
        })
    };
    std::thread::sleep(Duration::from_millis(100));
    let e = snapshot(&run_dir, &["revert", "c", "with-a"]).unwrap_err();
    stop.store(true, Ordering::Relaxed);
    reader.join().unwrap();
    assert!(e.contains("busy"), "{e}");

    let mut got = vec![0u8; 1 << 20];
    dev.read_exact_at(&mut got, 10 << 20).unwrap();
    assert!(got[4096..] == b[..(1 << 20) - 4096], "the later write is still there");
    snapshot(&run_dir, &["revert", "c", "with-a"]).unwrap();
    dev.read_exact_at(&mut got, 10 << 20).unwrap();
    assert!(got == a, "reverted to the snapshot");
    let mut tail = vec![0u8; 4096];
    dev.read_exact_at(&mut tail, 11 << 20).unwrap();
    assert!(tail.iter().all(|&x| x == 0x33), "past the snapshot's write, the file below shows");
    let listed = snapshot(&run_dir, &["list", "c", "--json"]).unwrap();
    assert!(listed.contains("\"with-a\""), "{listed}");
    snapshot(&run_dir, &["delete", "c", "with-a"]).unwrap();
    assert!(snapshot(&run_dir, &["list", "c"]).unwrap().contains("no snapshots"));
    dev.read_exact_at(&mut got, 10 << 20).unwrap();
    assert!(got == a, "deleting a snapshot leaves the device as it is");
    drop(dev);
    assert!(serve.stop().success());
    check_image(&overlay);

    // An overlay made for another device size is refused, naming the filter and the sizes.
    std::fs::write(&lower, vec![0u8; 16 << 20]).unwrap();
    let out = Command::new(exe())
        .args(["serve", "--config"])
        .arg({
            let p = tmp.path().join("bad.toml");
            std::fs::write(&p, format!("[fuse]\nenabled = false\n[nbd]\nenabled = false\n{}", cow_device("c", &lower, &overlay)))
                .unwrap();
            p
        })
        .arg("--run-dir")
        .arg(tmp.path().join("run2"))
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && text.contains("filter 1 (cow)") && text.contains("33554432") && text.contains("16777216"),
        "{text}"
    );
}

/// A cow over memory (through a `stats` filter) and over a remote NBD server: what is written
/// reads back, the server's data is untouched, and the overlays check clean.
#[test]
fn a_cow_serves_over_memory_through_another_filter_and_over_a_remote_server() {
    require_kernel!();
    if !tools(&["qemu-img", "qemu-io", "nbdkit"]) {
        return;
    }
    let tmp = TempDir::new("cow-any");
    let sock = tmp.path().join("nbdkit.sock");
    let kit = Command::new("nbdkit")
        .args(["--foreground", "--exit-with-parent", "--unix"])
        .arg(&sock)
        .args(["memory", "16M"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut kit = ChildGuard(Some(kit));
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while std::os::unix::net::UnixStream::connect(&sock).is_err() {
        assert!(std::time::Instant::now() < deadline, "nbdkit did not come up");
        std::thread::sleep(Duration::from_millis(20));
    }
    let remote = format!("nbd+unix:///?socket={}", sock.display());
    qemu_io("raw", false, &remote, &["write -P 0x4d 0 16M"]);
    let (mem_overlay, nbd_overlay) = (tmp.path().join("mem.qcow2"), tmp.path().join("nbd.qcow2"));
    let config = format!(
        "[[device]]\nname = \"mem\"\nsize = \"8M\"\n[device.backend]\ntype = \"ram\"\n\
         [[device.filter]]\ntype = \"cow\"\noverlay = \"{}\"\ncluster_size = \"4k\"\n[[device.filter]]\ntype = \"stats\"\n\
         [[device]]\nname = \"net\"\n[device.backend]\ntype = \"nbd\"\nuri = \"{remote}\"\n\
         [[device.filter]]\ntype = \"cow\"\noverlay = \"{}\"\n",
        mem_overlay.display(),
        nbd_overlay.display()
    );
    let run_dir = tmp.path().join("run");
    let mut serve = Serve::start(&run_dir, Some(&config), &["mem", "net"]);
    for (dev, below) in [("mem", 0u8), ("net", 0x4d)] {
        let f = std::fs::OpenOptions::new().read(true).write(true).open(serve.fuse_file(dev)).unwrap();
        let data = pattern(5, 300_000);
        f.write_all_at(&data, 1_000_000).unwrap();
        f.sync_all().unwrap();
        let mut got = vec![0u8; 400_000];
        f.read_exact_at(&mut got, 950_000).unwrap();
        assert!(got[..50_000].iter().all(|&b| b == below), "{dev}: below the write, the device below");
        assert!(got[50_000..350_000] == data[..], "{dev}: the write");
        assert!(got[350_000..].iter().all(|&b| b == below), "{dev}: past the write, the device below");
    }
    snapshot(&run_dir, &["create", "net", "one"]).unwrap();
    let st = serve.status_json();
    assert_eq!(st["devices"][0]["filters"][0]["type"], "cow", "{st}");
    // Confined with the file calls the overlay needs, and no more.
    assert_eq!(st["devices"][0]["sandbox"]["seccomp_role"], "file-sync", "{st}");
    assert_eq!(st["devices"][1]["sandbox"]["seccomp_role"], "network-file", "{st}");
    assert!(serve.stop().success());
    // The server below was only read.
    qemu_io("raw", true, &remote, &["read -P 0x4d 0 16M"]);
    kit.terminate();
    check_image(&mem_overlay);
    check_image(&nbd_overlay);
    assert!(sh("qemu-img", &["snapshot", "-l", nbd_overlay.to_str().unwrap()]).contains("one"));
}
