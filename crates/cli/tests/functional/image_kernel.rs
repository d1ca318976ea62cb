//! qcow2 images through bulkhead, checked by qemu: ext4 and fio verify on a qcow2 over a qcow2
//! over a raw backing file while its driver domain is killed, then `qemu-img check` and `qemu-img compare`
//! against what bulkhead served; data written by `qemu-io` read through bulkhead and the other
//! way round, compressed clusters included; a corrupt header refused naming the device and the
//! field, with the file untouched.

#[path = "../common/mod.rs"]
mod common;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use bulkhead_testkit::require_kernel;
use common::*;

fn qcow2_device(name: &str, img: &Path, extra: &str) -> String {
    format!(
        "[[device]]\nname = \"{name}\"\nrestart_limit = 100000\n[device.backend]\ntype = \"file\"\nformat = \"qcow2\"\npath = \"{}\"\n{extra}",
        img.display()
    )
}

#[test]
fn ext4_and_fio_verify_on_a_qcow2_chain_over_a_raw_base_while_its_domain_is_killed_and_qemu_agrees() {
    require_kernel!();
    if !tools(&["qemu-img", "qemu-io", "fio"]) {
        return;
    }
    let tmp = TempDir::new("qcow2-ext4");
    let base = tmp.path().join("base.raw");
    std::fs::write(&base, pattern(7, 8 << 20)).unwrap();
    std::fs::File::options().write(true).open(&base).unwrap().set_len(256 << 20).unwrap();
    let before = digest(&base);
    // top.qcow2 over mid.qcow2 (which holds 1 MiB of its own) over base.raw.
    let mid = tmp.path().join("mid.qcow2");
    sh("qemu-img", &["create", "-q", "-f", "qcow2", "-b", "base.raw", "-F", "raw", mid.to_str().unwrap()]);
    qemu_io("qcow2", false, mid.to_str().unwrap(), &["write -P 0x3c 5M 1M"]);
    let mid_before = digest(&mid);
    let img = tmp.path().join("top.qcow2");
    sh("qemu-img", &["create", "-q", "-f", "qcow2", "-b", "mid.qcow2", "-F", "qcow2", img.to_str().unwrap()]);
    let run_dir = tmp.path().join("run");
    let mut serve = Serve::start(&run_dir, Some(&qcow2_device("q", &img, "")), &["q"]);
    assert_eq!(std::fs::metadata(serve.fuse_file("q")).unwrap().len(), 256 << 20);
    // What the base holds shows through the empty image.
    let mut head = vec![0u8; 1 << 20];
    {
        use std::os::unix::fs::FileExt;
        std::fs::File::open(serve.fuse_file("q")).unwrap().read_exact_at(&mut head, 3 << 20).unwrap();
    }
    assert!(head == pattern(7, 8 << 20)[3 << 20..4 << 20], "the base reads through both images");
    {
        use std::os::unix::fs::FileExt;
        std::fs::File::open(serve.fuse_file("q")).unwrap().read_exact_at(&mut head, 5 << 20).unwrap();
    }
    assert!(head.iter().all(|&b| b == 0x3c), "the middle image reads through the top one");
    let mnt = tmp.path().join("mnt");
    let mut fs = Ext4::make(&serve.fuse_file("q"), &mnt);
    fio_verify_while_killing_the_driver(&serve, &fs.mnt, "4k-256k", "48M", 8, Duration::from_millis(700), 3);
    fs.unmount_and_check();
    drop(fs);
    let st = serve.status_json();
    assert_eq!(st["devices"][0]["requests_failed"], 0, "{st}");
    // What bulkhead serves, read whole, is what qemu reads from the image.
    let served = tmp.path().join("served.raw");
    std::fs::copy(serve.fuse_file("q"), &served).unwrap();
    assert!(serve.stop().success());
    assert_eq!(digest(&base), before, "the backing files are never written");
    assert_eq!(digest(&mid), mid_before, "the backing files are never written");
    let check = sh("qemu-img", &["check", img.to_str().unwrap()]);
    assert!(check.contains("No errors were found"), "{check}");
    sh("qemu-img", &["compare", "-f", "qcow2", "-F", "raw", img.to_str().unwrap(), served.to_str().unwrap()]);
    let info = sh("qemu-img", &["info", img.to_str().unwrap()]);
    assert!(info.contains("backing file: mid.qcow2") && info.contains("256 MiB"), "{info}");
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
    qemu_io("qcow2", false, i, &["write -P 0x5a 1M 256k", "write -z 2M 128k", "write -P 0x11 60M 68k"]);
    // An internal snapshot: bulkhead's writes must leave it as it was.
    sh("qemu-img", &["snapshot", "-c", "before", i]);
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
    let uri = |e: &str| serve.nbd_uri(e);
    qemu_io(
        "raw",
        false,
        &uri("q"),
        &[
            "read -P 0x5a 1M 256k",
            "read -P 0 2M 128k",
            "read -P 0x11 60M 68k",
            "write -P 0xc3 4M 192k",
            "write -P 0x77 63M 4k",
            "write -z 1M 64k",
            "discard 60M 64k",
            "flush",
        ],
    );
    // Compressed clusters read.
    qemu_io("raw", true, &uri("p"), &["read -P 0x5a 1M 256k", "read -P 0x11 60M 68k"]);
    let out = Command::new("qemu-io").args(["-f", "raw", "-c", "write -P 1 0 4k", &uri("p")]).output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(
        !out.status.success() || text.contains("read-only") || text.contains("failed"),
        "a read-only image took a write: {text}"
    );
    assert!(serve.stop().success());
    qemu_io(
        "qcow2",
        true,
        i,
        &[
            "read -P 0xc3 4M 192k",
            "read -P 0x77 63M 4k",
            "read -P 0 1M 64k",
            "read -P 0x5a 1088k 192k",
            "read -P 0 60M 64k",
            "read -P 0x11 61504k 4k",
        ],
    );
    let check = sh("qemu-img", &["check", i]);
    assert!(check.contains("No errors were found"), "{check}");
    let snap = tmp.path().join("snap.raw");
    sh("qemu-img", &["convert", "-l", "snapshot.name=before", "-f", "qcow2", "-O", "raw", i, snap.to_str().unwrap()]);
    let snap = std::fs::read(&snap).unwrap();
    assert!(snap[1 << 20..(1 << 20) + (256 << 10)].iter().all(|&b| b == 0x5a), "the snapshot kept its data");
    assert!(snap[4 << 20..(4 << 20) + (192 << 10)].iter().all(|&b| b == 0), "and not what came after it");
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
    let e = refused(&tmp, &qcow2_device("b", &img, ""));
    assert!(e.contains("device b") || e.contains("`b`"), "{e}");
    assert!(e.contains("refcount_table_offset") && e.contains("bad.qcow2"), "{e}");
    assert!(std::fs::read(&img).unwrap() == bytes, "a refused image is not written");
}
