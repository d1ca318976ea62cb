//! The `crypt` filter on LUKS volumes made by cryptsetup and qemu-img: ext4 and fio verify on a
//! LUKS2 volume while its driver domain is killed, with no plaintext reaching the backing file;
//! data written by qemu's luks driver read through bulkhead and the other way round; in a tap
//! domain of its own, the key and the plaintext never reach the driver domain below, while
//! either domain is killed; a wrong key refused with a clear error.

#[path = "../common/mod.rs"]
mod common;

use std::process::Command;
use std::time::Duration;

use bulkhead_testkit::require_kernel;
use common::*;

const KEY: &[u8] = b"correct horse battery staple\n";

/// A file of `bytes` in `tmp` named `name`, formatted by cryptsetup as a LUKS volume of `kind`
/// (`luks1`, or `luks2` with 512-byte sectors) with a cheap key derivation; and the key file.
fn luks_volume(tmp: &TempDir, name: &str, bytes: u64, kind: &str) -> (std::path::PathBuf, std::path::PathBuf) {
    let img = tmp.path().join(name);
    std::fs::File::create(&img).unwrap().set_len(bytes).unwrap();
    let key = tmp.path().join("key");
    std::fs::write(&key, KEY).unwrap();
    let mut args = vec!["luksFormat", "-q", "--type", kind, "--pbkdf-force-iterations", "1000"];
    if kind == "luks2" {
        args.extend(["--pbkdf", "pbkdf2", "--sector-size", "512"]);
    }
    args.extend(["--key-file", key.to_str().unwrap(), img.to_str().unwrap()]);
    sh("cryptsetup", &args);
    (img, key)
}

fn crypt_device(name: &str, img: &std::path::Path, key: &std::path::Path, tap: &str) -> String {
    format!(
        "[[device]]\nname = \"{name}\"\ntap = \"{tap}\"\nrestart_limit = 100000\n[device.backend]\ntype = \"file\"\npath = \"{}\"\n\
         [[device.filter]]\ntype = \"crypt\"\nkey_file = \"{}\"\n",
        img.display(),
        key.display()
    )
}

/// `needle` anywhere in the file at `path`.
fn file_holds(path: &std::path::Path, needle: &[u8]) -> bool {
    let data = std::fs::read(path).unwrap();
    data.windows(needle.len()).any(|w| w == needle)
}

#[test]
fn ext4_and_fio_verify_on_a_luks2_volume_while_its_domain_is_killed_and_no_plaintext_reaches_the_file() {
    require_kernel!();
    if !tools(&["cryptsetup", "fio"]) {
        return;
    }
    let tmp = TempDir::new("crypt-ext4");
    let (img, key) = luks_volume(&tmp, "vol.img", 176 << 20, "luks2");
    let run_dir = tmp.path().join("run");
    let mut serve = Serve::start(&run_dir, Some(&crypt_device("c", &img, &key, "passthrough")), &["c"]);
    // The volume's data area: the file less LUKS2's 16 MiB header.
    assert_eq!(std::fs::metadata(serve.fuse_file("c")).unwrap().len(), 160 << 20);
    let mnt = tmp.path().join("mnt");
    let mut fs = Ext4::make(&serve.fuse_file("c"), &mnt);
    let marker: Vec<u8> = b"BULKHEAD-PLAINTEXT-MARKER-7f3a".iter().copied().cycle().take(1 << 20).collect();
    std::fs::write(mnt.join("marker"), &marker).unwrap();
    sh("sync", &[]);
    let kills = fio_verify_while_killing_the_driver(&serve, &fs.mnt, "4k-64k", "32M", 8, Duration::from_millis(700), 3);
    fs.unmount_and_check();
    drop(fs);
    let st = serve.status_json();
    let f = &st["devices"][0]["filters"][0];
    assert_eq!(f["type"], "crypt", "{st}");
    assert!(f["opened"].as_u64().unwrap() > kills as u64, "each generation opened the volume: {f}");
    assert!(f["encrypted"].as_u64().unwrap() > 32 << 20 && f["decrypted"].as_u64().unwrap() > 0, "{f}");
    assert!(!serve.log_text().contains("correct horse"), "the key is never logged");
    assert!(serve.stop().success());

    assert!(!file_holds(&img, b"BULKHEAD-PLAINTEXT-MARKER-7f3a"), "plaintext reached the backing file");
    // A new serve opens the volume again and finds the file as written.
    let serve = Serve::start(&run_dir, Some(&crypt_device("c", &img, &key, "passthrough")), &["c"]);
    let lo = LoopGuard::attach_direct(&serve.fuse_file("c"));
    let m = MountGuard::mount(&lo.dev, &mnt);
    assert!(std::fs::read(mnt.join("marker")).unwrap() == marker, "the marker reads back");
    m.unmount();
}

/// qemu's luks driver over the raw file `img`.
fn qemu_io_luks(key: &std::path::Path, img: &std::path::Path, cmds: &[&str]) -> String {
    let secret = format!("secret,id=sec0,file={}", key.display());
    let opts = format!("driver=luks,key-secret=sec0,file.filename={}", img.display());
    let mut args = vec!["--object", &secret, "--image-opts", &opts];
    for c in cmds {
        args.extend(["-c", c]);
    }
    let out = sh("qemu-io", &args);
    assert!(!out.contains("Pattern verification failed") && !out.contains("failed:"), "qemu-io {cmds:?}: {out}");
    out
}

#[test]
fn what_qemu_writes_to_a_luks1_image_reads_through_bulkhead_and_back() {
    require_kernel!();
    if !tools(&["qemu-img", "qemu-io"]) {
        return;
    }
    let tmp = TempDir::new("crypt-qemu");
    let img = tmp.path().join("q.luks");
    let key = tmp.path().join("key");
    std::fs::write(&key, KEY).unwrap();
    let secret = format!("secret,id=sec0,file={}", key.display());
    // qemu-img times its key derivation with the thread's CPU clock first, and on a loaded
    // machine that measurement can come out empty ("Unable to get accurate CPU usage"): the
    // format is retried then, any other failure fails the test.
    for attempt in 1..=5 {
        let out = Command::new("timeout")
            .args(["--kill-after=5", "120", "qemu-img", "create", "-q", "-f", "luks", "--object", &secret])
            .args(["-o", "key-secret=sec0,iter-time=10"])
            .arg(&img)
            .arg("64M")
            .output()
            .unwrap();
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        if out.status.success() {
            break;
        }
        assert!(text.contains("accurate CPU usage") && attempt < 5, "qemu-img create -f luks: {text}");
        let _ = std::fs::remove_file(&img);
    }
    qemu_io_luks(&key, &img, &["write -P 0x5a 1M 256k"]);
    let run_dir = tmp.path().join("run");
    let config = format!("[fuse]\nenabled = false\n[nbd]\n{}", crypt_device("q", &img, &key, "intercept"));
    let mut serve = Serve::start(&run_dir, Some(&config), &[]);
    let uri = serve.nbd_uri("q");
    let info = sh("qemu-img", &["info", "--output=json", &uri]);
    assert!(info.contains("\"virtual-size\": 67108864"), "the image's whole data area: {info}");
    qemu_io(
        "raw",
        false,
        &uri,
        &["read -P 0x5a 1M 256k", "write -P 0xc3 4M 128k", "write -z 8M 64k", "discard 12M 64k", "flush"],
    );
    assert!(serve.stop().success());
    qemu_io_luks(&key, &img, &["read -P 0xc3 4M 128k", "read -P 0 8M 64k", "read -P 0x5a 1M 256k"]);
}

#[test]
fn a_wrong_key_and_a_plain_file_are_refused_naming_the_cause_and_a_running_crypt_filter_stays() {
    require_kernel!();
    if !tools(&["cryptsetup"]) {
        return;
    }
    let tmp = TempDir::new("crypt-refused");
    let (img, key) = luks_volume(&tmp, "vol.img", 20 << 20, "luks1");
    let wrong = tmp.path().join("wrong");
    std::fs::write(&wrong, b"tr0ub4dor&3").unwrap();
    let e = refused(&tmp, &crypt_device("c", &img, &wrong, "passthrough"));
    assert!(e.contains("device c") || e.contains("`c`"), "{e}");
    assert!(e.contains("no key slot of the volume opens with key_file") && e.contains("wrong"), "{e}");
    assert!(!e.contains("tr0ub4dor"), "the key is never printed: {e}");

    let plain = tmp.path().join("plain.img");
    std::fs::File::create(&plain).unwrap().set_len(4 << 20).unwrap();
    let e = refused(&tmp, &crypt_device("p", &plain, &key, "passthrough"));
    assert!(e.contains("no LUKS header on the device"), "{e}");

    // A damaged header: its key-bytes field (LUKS1, offset 108) says 48. Refused naming the
    // device and the field; the volume's file is left as it was.
    let damaged = tmp.path().join("damaged.img");
    let mut bytes = std::fs::read(&img).unwrap();
    bytes[108..112].copy_from_slice(&48u32.to_be_bytes());
    std::fs::write(&damaged, &bytes).unwrap();
    let before = digest(&damaged);
    let e = refused(&tmp, &crypt_device("d", &damaged, &key, "interpose"));
    assert!(e.contains("`d`") || e.contains("device d"), "{e}");
    assert!(e.contains("filter 1 (crypt)") && e.contains("key-bytes") && e.contains("48"), "{e}");
    assert_eq!(digest(&damaged), before, "the damaged volume was written to");

    // A running device neither gains nor loses a crypt filter.
    let run_dir = tmp.path().join("run");
    let serve = Serve::start(&run_dir, Some(&crypt_device("c", &img, &key, "passthrough")), &["c"]);
    let rm = Command::new(exe()).args(["filter", "remove", "c", "0", "--run-dir"]).arg(&run_dir).output().unwrap();
    assert!(!rm.status.success(), "crypt filter removed from a running device");
    assert!(
        String::from_utf8_lossy(&rm.stderr).contains("cannot be removed from a running device"),
        "{}",
        String::from_utf8_lossy(&rm.stderr)
    );
    drop(serve);
}

/// Whether the memory of process `pid` holds `needle` anywhere it can be read, and where.
fn memory_holds(pid: u32, needle: &[u8]) -> Vec<String> {
    use std::io::{Read, Seek, SeekFrom};
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap();
    let mut mem = std::fs::File::open(format!("/proc/{pid}/mem")).unwrap();
    let mut hits = Vec::new();
    for line in maps.lines() {
        let mut f = line.split_whitespace();
        let (Some(range), Some(perms)) = (f.next(), f.next()) else { continue };
        let Some((lo, hi)) = range.split_once('-') else { continue };
        let (lo, hi) = (u64::from_str_radix(lo, 16).unwrap(), u64::from_str_radix(hi, 16).unwrap());
        if !perms.starts_with('r') || line.contains("[vvar") || line.contains("[vsyscall") {
            continue;
        }
        let mut data = vec![0u8; (hi - lo) as usize];
        if mem.seek(SeekFrom::Start(lo)).is_err() || mem.read_exact(&mut data).is_err() {
            continue;
        }
        if data.windows(needle.len()).any(|w| w == needle) {
            hits.push(line.to_string());
        }
    }
    hits
}

#[test]
fn in_a_tap_domain_the_key_and_the_plaintext_never_reach_the_driver_domain_below_while_either_is_killed() {
    require_kernel!();
    if !tools(&["cryptsetup", "fio"]) {
        return;
    }
    let tmp = TempDir::new("crypt-interpose");
    let (img, key) = luks_volume(&tmp, "vol.img", 112 << 20, "luks2");
    let run_dir = tmp.path().join("run");
    let mut serve = Serve::start(&run_dir, Some(&crypt_device("c", &img, &key, "interpose")), &["c"]);
    let d = serve.status_json()["devices"][0].clone();
    assert_ne!(d["tap_pid"], d["driver_pid"], "two domains: {d}");
    let mnt = tmp.path().join("mnt");
    let mut fs = Ext4::make(&serve.fuse_file("c"), &mnt);
    const MARKER: &[u8] = b"BULKHEAD-TAP-PLAINTEXT-5c91e0";
    let marker: Vec<u8> = MARKER.iter().copied().cycle().take(1 << 20).collect();
    std::fs::write(mnt.join("marker"), &marker).unwrap();
    sh("sync", &[]);
    // Kill the tap domain and the driver domain below it in turn while fio verifies.
    fio_verify_killing_both_domains(&serve, &fs.mnt, Duration::from_millis(600), 6);
    // The marker read back through the device, not the page cache, lands in the application's
    // arena and nowhere below.
    std::fs::write("/proc/sys/vm/drop_caches", "3").unwrap();
    assert!(std::fs::read(mnt.join("marker")).unwrap() == marker, "the marker reads back");
    let d = serve.status_json()["devices"][0].clone();
    let (tap, driver) = (d["tap_pid"].as_u64().unwrap() as u32, d["driver_pid"].as_u64().unwrap() as u32);
    // `engine = "auto"`: io_uring where the kernel allows it, and the role that goes with it.
    let role = if d["backend"].as_str().unwrap().contains(",io_uring") { "file-io_uring" } else { "file-sync" };
    assert_eq!(d["sandbox"]["seccomp_role"], role, "the driver domain below: {d}");
    let below = memory_holds(driver, MARKER);
    assert!(below.is_empty(), "plaintext in the driver domain's memory: {below:?}");
    assert!(!memory_holds(tap, MARKER).is_empty(), "the scan finds the marker where it is: the tap domain");
    assert!(memory_holds(driver, &KEY[..20]).is_empty(), "the key file's text in the driver domain");
    fs.unmount_and_check();
    drop(fs);
    assert!(serve.stop().success());
    assert!(!file_holds(&img, MARKER), "plaintext reached the backing file");
}

#[test]
fn crypt_over_cow_over_qcow2_survives_both_domains_being_killed_and_qemu_reads_what_it_holds() {
    require_kernel!();
    if !tools(&["cryptsetup", "fio", "qemu-img"]) {
        return;
    }
    let tmp = TempDir::new("crypt-chain");
    let (base, overlay) = (tmp.path().join("base.qcow2"), tmp.path().join("top.qcow2"));
    // LUKS1, which qemu's luks driver reads too, converted into a qcow2 image.
    let (raw, key) = luks_volume(&tmp, "vol.raw", 96 << 20, "luks1");
    sh("qemu-img", &["convert", "-q", "-f", "raw", "-O", "qcow2", raw.to_str().unwrap(), base.to_str().unwrap()]);
    std::fs::remove_file(&raw).unwrap();
    let base_digest = digest(&base);
    let config = |tap: &str| {
        format!(
            "[[device]]\nname = \"c\"\ntap = \"{tap}\"\nrestart_limit = 100000\n[device.backend]\ntype = \"file\"\npath = \"{}\"\n\
             format = \"qcow2\"\nread_only = true\n[[device.filter]]\ntype = \"crypt\"\nkey_file = \"{}\"\n\
             [[device.filter]]\ntype = \"cow\"\noverlay = \"{}\"\n",
            base.display(),
            key.display(),
            overlay.display()
        )
    };
    let run_dir = tmp.path().join("run");
    let mut serve = Serve::start(&run_dir, Some(&config("interpose")), &["c"]);
    // The LUKS header was read through the qcow2 image and the (new, empty) overlay.
    assert_eq!(std::fs::metadata(serve.fuse_file("c")).unwrap().len(), (96 << 20) - (2 << 20));
    let mnt = tmp.path().join("mnt");
    let mut fs = Ext4::make(&serve.fuse_file("c"), &mnt);
    fio_verify_killing_both_domains(&serve, &fs.mnt, Duration::from_millis(700), 8);
    fs.unmount_and_check();
    drop(fs);
    let st = serve.status_json();
    assert_eq!(st["devices"][0]["filters"][1]["type"], "cow", "{st}");
    assert!(st["devices"][0]["filters"][1]["allocated"].as_u64().unwrap() > 0, "{st}");
    assert!(serve.stop().success());

    // Every image is consistent, the one below untouched; qemu (luks over the overlay over the
    // image) reads the same plaintext a fresh bulkhead serves, in one domain this time.
    for img in [&base, &overlay] {
        let out = Command::new("qemu-img").args(["check", img.to_str().unwrap()]).output().unwrap();
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(matches!(out.status.code(), Some(0) | Some(3)) && !text.contains("ERROR"), "qemu-img check: {text}");
    }
    assert_eq!(digest(&base).split_whitespace().next(), base_digest.split_whitespace().next(), "the image below changed");
    let info = sh("qemu-img", &["info", overlay.to_str().unwrap()]);
    assert!(info.contains("backing file format: qcow2"), "{info}");
    let plain = tmp.path().join("plain.raw");
    let secret = format!("secret,id=sec0,file={}", key.display());
    let opts = format!("driver=luks,key-secret=sec0,file.driver=qcow2,file.file.filename={}", overlay.display());
    sh("qemu-img", &["convert", "-q", "--object", &secret, "--image-opts", &opts, "-O", "raw", plain.to_str().unwrap()]);
    let serve = Serve::start(&run_dir, Some(&config("passthrough")), &["c"]);
    let served = digest(&serve.fuse_file("c"));
    assert_eq!(served.split_whitespace().next(), digest(&plain).split_whitespace().next(), "qemu and bulkhead disagree");
    drop(serve);
}

/// fio verify on `mnt` for `seconds` while the tap domain and the driver domain below it are
/// killed in turn, one every `every`; fails unless fio passed and each was killed twice.
fn fio_verify_killing_both_domains(serve: &Serve, mnt: &std::path::Path, every: Duration, seconds: u32) {
    let killer = DomainKiller::start(
        serve.run_dir.clone(),
        move || every,
        |d, kills| {
            let kind = (kills % 2) as usize;
            let pid = d[if kind == 0 { "tap_pid" } else { "driver_pid" }].as_u64().unwrap_or(0);
            (kind, pid as u32, pid)
        },
    );
    let fio = std::panic::catch_unwind(|| fio_verify(mnt, "randrw", "4k-64k", "24M", seconds));
    let kills = killer.stop();
    assert!(fio.is_ok(), "fio failed; serve's log:\n{}", serve.log_text());
    assert!(kills.len() == 2 && kills.iter().all(|&k| k >= 2), "kills by kind (tap, driver): {kills:?}");
}
