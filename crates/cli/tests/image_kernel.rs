//! qcow2 images through bulkhead, checked by qemu: ext4 and fio verify on a qcow2 over a raw
//! backing file while its driver domain is killed, then `qemu-img check` and `qemu-img compare`
//! against what bulkhead served; data written by `qemu-io` read through bulkhead and the other
//! way round, compressed clusters included; a corrupt header refused naming the device and the
//! field, with the file untouched.

mod common;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use bulkhead_testkit::require_kernel;
use common::*;

fn sh(cmd: &str, args: &[&str]) -> String {
    let out = Command::new("timeout").args(["--kill-after=5", "300", cmd]).args(args).output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{cmd} {args:?}: {text}");
    text
}

fn qcow2_device(name: &str, img: &Path, extra: &str) -> String {
    format!(
        "[[device]]\nname = \"{name}\"\nrestart_limit = 100000\n[device.backend]\ntype = \"file\"\nformat = \"qcow2\"\npath = \"{}\"\n{extra}",
        img.display()
    )
}

fn digest(path: &Path) -> String {
    sh("sha256sum", &[path.to_str().unwrap()])
}

#[test]
fn ext4_and_fio_verify_on_a_qcow2_over_a_raw_base_while_its_domain_is_killed_and_qemu_agrees() {
    require_kernel!();
    if !tools(&["qemu-img", "fio"]) {
        return;
    }
    let tmp = TempDir::new("qcow2-ext4");
    let base = tmp.path().join("base.raw");
    std::fs::write(&base, pattern(7, 8 << 20)).unwrap();
    std::fs::File::options().write(true).open(&base).unwrap().set_len(256 << 20).unwrap();
    let before = digest(&base);
    let img = tmp.path().join("top.qcow2");
    sh("qemu-img", &["create", "-q", "-f", "qcow2", "-b", "base.raw", "-F", "raw", img.to_str().unwrap()]);
    let run_dir = tmp.path().join("run");
    let mut serve = Serve::start(&run_dir, Some(&qcow2_device("q", &img, "")), &["q"]);
    assert_eq!(std::fs::metadata(serve.fuse_file("q")).unwrap().len(), 256 << 20);
    // What the base holds shows through the empty image.
    let mut head = vec![0u8; 1 << 20];
    {
        use std::os::unix::fs::FileExt;
        std::fs::File::open(serve.fuse_file("q")).unwrap().read_exact_at(&mut head, 3 << 20).unwrap();
    }
    assert!(head == pattern(7, 8 << 20)[3 << 20..4 << 20], "the base reads through the image");
    let mnt = tmp.path().join("mnt");
    let mut fs = Ext4::make(&serve.fuse_file("q"), &mnt);
    let killer = DomainKiller::start(run_dir.clone(), || Duration::from_millis(700), driver_domain);
    let fio = std::panic::catch_unwind(|| fio_verify(&fs.mnt, "randrw", "4k-256k", "48M", 8));
    assert!(fio.is_ok(), "fio failed; serve's log:\n{}", serve.log_text());
    let kills = killer.stop();
    assert!(kills.first().copied().unwrap_or(0) >= 3, "killed {kills:?}: {}", serve.log_text());
    fs.unmount_and_check();
    drop(fs);
    let st = serve.status_json();
    assert_eq!(st["devices"][0]["requests_failed"], 0, "{st}");
    // What bulkhead serves, read whole, is what qemu reads from the image.
    let served = tmp.path().join("served.raw");
    std::fs::copy(serve.fuse_file("q"), &served).unwrap();
    assert!(serve.stop().success());
    assert_eq!(digest(&base), before, "the backing file is never written");
    let check = sh("qemu-img", &["check", img.to_str().unwrap()]);
    assert!(check.contains("No errors were found"), "{check}");
    sh("qemu-img", &["compare", "-f", "qcow2", "-F", "raw", img.to_str().unwrap(), served.to_str().unwrap()]);
    let info = sh("qemu-img", &["info", img.to_str().unwrap()]);
    assert!(info.contains("backing file: base.raw") && info.contains("256 MiB"), "{info}");
}

#[test]
fn what_qemu_io_writes_reads_through_bulkhead_and_the_other_way_round() {
    require_kernel!();
    if !tools(&["qemu-img", "qemu-io"]) {
        return;
    }
    let tmp = TempDir::new("qcow2-qemu");
    let img = tmp.path().join("q.qcow2");
    let i = img.to_str().unwrap();
    sh("qemu-img", &["create", "-q", "-f", "qcow2", i, "64M"]);
    sh("qemu-io", &["-f", "qcow2", "-c", "write -P 0x5a 1M 256k", "-c", "write -z 2M 128k", "-c", "write -P 0x11 60M 68k", i]);
    // A compressed copy, served read-only.
    let packed = tmp.path().join("packed.qcow2");
    sh("qemu-img", &["convert", "-c", "-f", "qcow2", "-O", "qcow2", i, packed.to_str().unwrap()]);
    let run_dir = tmp.path().join("run");
    let config = format!(
        "[fuse]\nenabled = false\n[nbd]\n{}{}",
        qcow2_device("q", &img, ""),
        qcow2_device("p", &packed, "read_only = true\n")
    );
    let mut serve = Serve::start(&run_dir, Some(&config), &[]);
    let sock = run_dir.join("nbd.sock");
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !sock.exists() {
        assert!(std::time::Instant::now() < deadline, "no nbd.sock: {}", serve.log_text());
        std::thread::sleep(Duration::from_millis(20));
    }
    let uri = |e: &str| format!("nbd+unix:///{e}?socket={}", sock.display());
    let out = sh(
        "qemu-io",
        &[
            "-f",
            "raw",
            "-c",
            "read -P 0x5a 1M 256k",
            "-c",
            "read -P 0 2M 128k",
            "-c",
            "read -P 0x11 60M 68k",
            "-c",
            "write -P 0xc3 4M 192k",
            "-c",
            "write -P 0x77 63M 4k",
            "-c",
            "write -z 1M 64k",
            "-c",
            "discard 60M 64k",
            "-c",
            "flush",
            &uri("q"),
        ],
    );
    assert!(!out.contains("Pattern verification failed"), "{out}");
    let out = sh("qemu-io", &["-f", "raw", "-r", "-c", "read -P 0x5a 1M 256k", "-c", "read -P 0x11 60M 68k", &uri("p")]);
    assert!(!out.contains("Pattern verification failed"), "compressed clusters read: {out}");
    let out = Command::new("qemu-io").args(["-f", "raw", "-c", "write -P 1 0 4k", &uri("p")]).output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(!out.status.success() || text.contains("read-only") || text.contains("failed"), "a read-only image took a write: {text}");
    assert!(serve.stop().success());
    let out = sh(
        "qemu-io",
        &[
            "-f",
            "qcow2",
            "-r",
            "-c",
            "read -P 0xc3 4M 192k",
            "-c",
            "read -P 0x77 63M 4k",
            "-c",
            "read -P 0 1M 64k",
            "-c",
            "read -P 0x5a 1088k 192k",
            "-c",
            "read -P 0 60M 64k",
            "-c",
            "read -P 0x11 61504k 4k",
            i,
        ],
    );
    assert!(!out.contains("Pattern verification failed"), "{out}");
    let check = sh("qemu-img", &["check", i]);
    assert!(check.contains("No errors were found"), "{check}");
}

#[test]
fn a_corrupt_header_is_refused_naming_the_device_and_the_field_and_the_file_is_untouched() {
    require_kernel!();
    if !tools(&["qemu-img"]) {
        return;
    }
    let tmp = TempDir::new("qcow2-corrupt");
    let img = tmp.path().join("bad.qcow2");
    sh("qemu-img", &["create", "-q", "-f", "qcow2", img.to_str().unwrap(), "16M"]);
    let mut bytes = std::fs::read(&img).unwrap();
    bytes[48..56].copy_from_slice(&12345u64.to_be_bytes()); // refcount_table_offset, unaligned
    std::fs::write(&img, &bytes).unwrap();
    let cfg_path = tmp.path().join("bad.toml");
    std::fs::write(&cfg_path, qcow2_device("b", &img, "")).unwrap();
    let out = Command::new("timeout")
        .args(["--kill-after=5", "60", exe(), "serve", "--config"])
        .arg(&cfg_path)
        .arg("--run-dir")
        .arg(tmp.path().join("run"))
        .output()
        .unwrap();
    assert!(!out.status.success(), "serve started on a corrupt image");
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(e.contains("device b") || e.contains("`b`"), "{e}");
    assert!(e.contains("refcount_table_offset") && e.contains("bad.qcow2"), "{e}");
    assert!(std::fs::read(&img).unwrap() == bytes, "a refused image is not written");
}
