//! The `crypt` filter on LUKS volumes made by cryptsetup and qemu-img: ext4 and fio verify on a
//! LUKS2 volume while its driver domain is killed, with no plaintext reaching the backing file;
//! data written by qemu's luks driver read through bulkhead and the other way round; a wrong key
//! and a filter that cannot run where it is asked to each refused with a clear error.

mod common;

use std::process::Command;
use std::time::Duration;

use bulkhead_testkit::require_kernel;
use common::*;

const KEY: &[u8] = b"correct horse battery staple\n";

fn sh(cmd: &str, args: &[&str]) -> String {
    let out = Command::new("timeout").args(["--kill-after=5", "120", cmd]).args(args).output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{cmd} {args:?}: {text}");
    text
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
    let img = tmp.path().join("vol.img");
    std::fs::File::create(&img).unwrap().set_len(176 << 20).unwrap();
    let key = tmp.path().join("key");
    std::fs::write(&key, KEY).unwrap();
    let (i, k) = (img.to_string_lossy().into_owned(), key.to_string_lossy().into_owned());
    sh(
        "cryptsetup",
        &["luksFormat", "-q", "--type", "luks2", "--pbkdf", "pbkdf2", "--pbkdf-force-iterations", "1000"]
            .into_iter()
            .chain(["--sector-size", "512", "--key-file", &k, &i])
            .collect::<Vec<_>>(),
    );
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

/// Serve's output when it refuses to start with `config`.
fn refused(tmp: &TempDir, config: &str) -> String {
    let path = tmp.path().join("refused.toml");
    std::fs::write(&path, config).unwrap();
    let out = Command::new("timeout")
        .args(["--kill-after=5", "60", exe(), "serve", "--config"])
        .arg(&path)
        .arg("--run-dir")
        .arg(tmp.path().join("refused-run"))
        .output()
        .unwrap();
    assert!(!out.status.success(), "serve started");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn a_wrong_key_a_plain_file_and_a_tap_domain_are_refused_naming_the_cause() {
    require_kernel!();
    if !tools(&["cryptsetup"]) {
        return;
    }
    let tmp = TempDir::new("crypt-refused");
    let img = tmp.path().join("vol.img");
    std::fs::File::create(&img).unwrap().set_len(20 << 20).unwrap();
    let key = tmp.path().join("key");
    std::fs::write(&key, KEY).unwrap();
    sh(
        "cryptsetup",
        &["luksFormat", "-q", "--type", "luks1", "--pbkdf-force-iterations", "1000", "--key-file"]
            .into_iter()
            .chain([key.to_str().unwrap(), img.to_str().unwrap()])
            .collect::<Vec<_>>(),
    );
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

    let e = refused(&tmp, &crypt_device("c", &img, &key, "interpose"));
    assert!(e.contains("cannot run in a tap domain yet"), "{e}");

    // A running device neither gains nor loses a crypt filter, nor moves it into a tap domain.
    let run_dir = tmp.path().join("run");
    let serve = Serve::start(&run_dir, Some(&crypt_device("c", &img, &key, "passthrough")), &["c"]);
    let tap = Command::new(exe()).args(["tap", "c", "interpose", "--run-dir"]).arg(&run_dir).output().unwrap();
    assert!(!tap.status.success(), "tap switch accepted");
    assert!(
        String::from_utf8_lossy(&tap.stderr).contains("cannot run in a tap domain yet"),
        "{}",
        String::from_utf8_lossy(&tap.stderr)
    );
    let rm = Command::new(exe()).args(["filter", "c", "remove", "0", "--run-dir"]).arg(&run_dir).output().unwrap();
    assert!(!rm.status.success(), "crypt filter removed from a running device");
    assert!(
        String::from_utf8_lossy(&rm.stderr).contains("cannot be removed from a running device"),
        "{}",
        String::from_utf8_lossy(&rm.stderr)
    );
    drop(serve);
}
