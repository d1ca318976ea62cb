//! Volumes made by `cryptsetup luksFormat` (LUKS1, LUKS2 with PBKDF2 and with Argon2id) and by
//! `qemu-img create -f luks` open here with the same key to the same master key, and data
//! encrypted by one side decrypts on the other.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use bulkhead_crypt::{CryptError, Volume};

/// Whether the tools are here; without them the test is skipped, unless CI asked for every
/// test to run (`BULKHEAD_REQUIRE_KERNEL=1`).
fn tools(names: &[&str]) -> bool {
    let missing: Vec<&&str> = names
        .iter()
        .filter(|t| !["/usr/sbin", "/sbin", "/usr/bin", "/bin"].iter().any(|d| Path::new(d).join(t).is_file()))
        .collect();
    if missing.is_empty() {
        return true;
    }
    assert!(std::env::var("BULKHEAD_REQUIRE_KERNEL").as_deref() != Ok("1"), "missing {missing:?}");
    eprintln!("skipped: {missing:?} not installed");
    false
}

fn run(cmd: &str, args: &[&str]) -> String {
    let out = Command::new(cmd).args(args).output().unwrap_or_else(|e| panic!("{cmd}: {e}"));
    assert!(out.status.success(), "{cmd} {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

struct Dir(PathBuf);
impl Dir {
    fn new(name: &str) -> Self {
        let d = std::env::temp_dir().join(format!("bulkhead-crypt-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        Dir(d)
    }
    fn path(&self, f: &str) -> String {
        self.0.join(f).to_string_lossy().into_owned()
    }
}
impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn open(path: &str) -> (File, Volume) {
    let f = File::open(path).unwrap();
    let v = Volume::read(&mut |at, buf| f.read_exact_at(buf, at)).unwrap();
    (f, v)
}

const KEY: &[u8] = b"correct horse battery staple\n";

/// cryptsetup's own view of the master key.
fn cryptsetup_key(dir: &Dir, vol: &str) -> Vec<u8> {
    let mk = dir.path("mk");
    let _ = std::fs::remove_file(&mk);
    run("cryptsetup", &["luksDump", "-q", "--dump-volume-key", "--volume-key-file", &mk, "--key-file", &dir.path("key"), vol]);
    std::fs::read(mk).unwrap()
}

#[test]
fn cryptsetup_volumes_open_to_the_master_key_cryptsetup_sees() {
    if !tools(&["cryptsetup"]) {
        return;
    }
    let dir = Dir::new("cs");
    std::fs::write(dir.path("key"), KEY).unwrap();
    let cases: [(&str, &[&str], u8, u32); 4] = [
        ("luks1", &["--type", "luks1", "--pbkdf-force-iterations", "1000"], 1, 512),
        ("luks2-pbkdf2", &["--type", "luks2", "--pbkdf", "pbkdf2", "--pbkdf-force-iterations", "1000"], 2, 4096),
        (
            "luks2-argon2id",
            &["--type", "luks2", "--pbkdf", "argon2id", "--pbkdf-memory", "32768", "--pbkdf-force-iterations", "4"],
            2,
            4096,
        ),
        (
            "luks2-argon2i-aes128-512",
            &[
                "--type",
                "luks2",
                "--pbkdf",
                "argon2i",
                "--pbkdf-memory",
                "16384",
                "--pbkdf-force-iterations",
                "4",
                "--key-size",
                "256",
                "--sector-size",
                "512",
            ],
            2,
            512,
        ),
    ];
    for (name, args, version, sector) in cases {
        let vol = dir.path(&format!("{name}.img"));
        File::create(&vol).unwrap().set_len(32 << 20).unwrap();
        let key = dir.path("key");
        let mut a = vec!["luksFormat", "-q", "--key-file", &key];
        a.extend_from_slice(args);
        a.push(&vol);
        run("cryptsetup", &a);
        let (f, v) = open(&vol);
        assert_eq!(v.version, version, "{name}");
        assert_eq!(v.sector_size, sector, "{name}");
        let uuid = run("cryptsetup", &["luksUUID", &vol]);
        assert_eq!(v.uuid, uuid.trim(), "{name}");
        let mk = v.unlock(KEY, &mut |at, buf| f.read_exact_at(buf, at)).unwrap();
        assert_eq!(mk.bytes(), cryptsetup_key(&dir, &vol), "{name}: the master key");
        let wrong = v.unlock(b"correct horse battery staple", &mut |at, buf| f.read_exact_at(buf, at));
        assert_eq!(wrong.unwrap_err(), CryptError::WrongKey, "{name}: the passphrase without its newline is another key");
        assert_eq!(v.data_size(32 << 20).unwrap(), (32 << 20) - v.payload_offset, "{name}");
    }
}

/// qemu's luks driver over a raw file of `path`, with the key in `key`.
fn qemu_io(key: &str, path: &str, cmd: &str) -> String {
    let secret = format!("secret,id=sec0,file={key}");
    let opts = format!("driver=luks,key-secret=sec0,file.filename={path}");
    let out = run("qemu-io", &["--object", &secret, "--image-opts", &opts, "-c", cmd]);
    assert!(!out.contains("failed"), "qemu-io {cmd}: {out}");
    out
}

#[test]
fn what_qemu_encrypts_decrypts_here_and_what_is_encrypted_here_qemu_reads() {
    if !tools(&["qemu-img", "qemu-io"]) {
        return;
    }
    let dir = Dir::new("qemu");
    let key = dir.path("key");
    std::fs::write(&key, KEY).unwrap();
    let vol = dir.path("q.luks");
    let secret = format!("secret,id=sec0,file={key}");
    // qemu-img calibrates its key derivation on the thread's CPU clock; on a loaded machine the
    // measurement can come out empty ("Unable to get accurate CPU usage"): retried then.
    for attempt in 1..=5 {
        let out = Command::new("qemu-img")
            .args(["create", "-q", "-f", "luks", "--object", &secret, "-o", "key-secret=sec0,iter-time=10", &vol, "4M"])
            .output()
            .unwrap();
        if out.status.success() {
            break;
        }
        let text = String::from_utf8_lossy(&out.stderr);
        assert!(text.contains("accurate CPU usage") && attempt < 5, "qemu-img create -f luks: {text}");
        let _ = std::fs::remove_file(&vol);
    }
    qemu_io(&key, &vol, "write -P 0xa5 65536 8192");
    let (f, v) = open(&vol);
    assert_eq!(v.version, 1);
    let mk = v.unlock(KEY, &mut |at, buf| f.read_exact_at(buf, at)).unwrap();
    let cipher = v.cipher(&mk).unwrap();
    let mut data = vec![0u8; 8192];
    f.read_exact_at(&mut data, v.payload_offset + 65536).unwrap();
    assert!(data.iter().any(|&b| b != 0xa5), "stored encrypted");
    cipher.decrypt(&mut data, 65536 / 512);
    assert!(data.iter().all(|&b| b == 0xa5), "decrypted here");
    // The other way: sectors encrypted here, read by qemu.
    let mut plain = vec![0x3cu8; 4096];
    cipher.encrypt(&mut plain, 1 << 20 >> 9);
    let w = std::fs::OpenOptions::new().write(true).open(&vol).unwrap();
    w.write_all_at(&plain, v.payload_offset + (1 << 20)).unwrap();
    qemu_io(&key, &vol, "read -P 0x3c 1048576 4096");
}

#[test]
fn a_damaged_header_names_the_field_and_a_plain_device_is_not_luks() {
    if !tools(&["cryptsetup"]) {
        return;
    }
    let dir = Dir::new("bad");
    std::fs::write(dir.path("key"), KEY).unwrap();
    let vol = dir.path("v1.img");
    File::create(&vol).unwrap().set_len(8 << 20).unwrap();
    let key = dir.path("key");
    run("cryptsetup", &["luksFormat", "-q", "--type", "luks1", "--pbkdf-force-iterations", "1000", "--key-file", &key, &vol]);
    let w = std::fs::OpenOptions::new().read(true).write(true).open(&vol).unwrap();
    // Key slot 0's stripes: 0.
    w.write_all_at(&0u32.to_be_bytes(), 208 + 44).unwrap();
    let e = Volume::read(&mut |at, buf| w.read_exact_at(buf, at)).unwrap_err();
    assert_eq!(e.to_string(), "LUKS header: key-slot 0 stripes: 0 (1 to 65536)");
    // The cipher mode.
    w.write_all_at(b"cbc-essiv:sha256\0", 40).unwrap();
    let e = Volume::read(&mut |at, buf| w.read_exact_at(buf, at)).unwrap_err();
    assert!(e.to_string().contains("aes-cbc-essiv:sha256"), "{e}");

    let vol2 = dir.path("v2.img");
    File::create(&vol2).unwrap().set_len(32 << 20).unwrap();
    run(
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
            "--key-file",
            &key,
            &vol2,
        ],
    );
    let w2 = std::fs::OpenOptions::new().read(true).write(true).open(&vol2).unwrap();
    // A byte of the primary JSON area: its checksum fails, and the secondary copy serves.
    w2.write_all_at(b"X", 4096 + 10).unwrap();
    let v = Volume::read(&mut |at, buf| w2.read_exact_at(buf, at)).unwrap();
    assert_eq!(v.version, 2);
    // Both copies damaged: the primary's fault is named.
    w2.write_all_at(b"X", 16384 + 4096 + 10).unwrap();
    let e = Volume::read(&mut |at, buf| w2.read_exact_at(buf, at)).unwrap_err();
    assert_eq!(e.to_string(), "LUKS header: csum: does not match the header (damaged or changed)");

    let plain = dir.path("plain.img");
    File::create(&plain).unwrap().set_len(1 << 20).unwrap();
    let p = File::open(&plain).unwrap();
    assert_eq!(Volume::read(&mut |at, buf| p.read_exact_at(buf, at)).unwrap_err(), CryptError::NotLuks);
}

#[test]
fn mangled_headers_are_refused_or_read_never_panic() {
    if !tools(&["cryptsetup"]) {
        return;
    }
    let dir = Dir::new("fuzz");
    std::fs::write(dir.path("key"), KEY).unwrap();
    let key = dir.path("key");
    let mut images = Vec::new();
    for t in ["luks1", "luks2"] {
        let vol = dir.path(&format!("{t}.img"));
        File::create(&vol).unwrap().set_len(20 << 20).unwrap();
        run(
            "cryptsetup",
            &["luksFormat", "-q", "--type", t, "--pbkdf", "pbkdf2", "--pbkdf-force-iterations", "1000", "--key-file", &key, &vol],
        );
        let mut img = std::fs::read(&vol).unwrap();
        img.truncate(1 << 20);
        images.push(img);
    }
    // A small deterministic generator: no dependency, the same cases every run.
    let mut rng = bulkhead_rng::Rng::new(0x9e37_79b9_7f4a_7c15);
    let mut next = || rng.next_u64();
    let mut refused = 0;
    for round in 0..4000 {
        let mut img = images[round % 2].clone();
        // Flip bytes within the binary header (and, for LUKS2, its JSON area, after which the
        // checksum is recomputed so the parser, not the checksum, meets the damage).
        let span = if round % 2 == 0 { 592 } else { 16384 };
        for _ in 0..1 + next() % 4 {
            let at = (next() % span) as usize;
            img[at] = next() as u8;
        }
        if round % 2 == 1 && round % 4 == 1 {
            let mut all = img[..16384].to_vec();
            all[448..512].fill(0);
            let sum = bulkhead_crypt::Hash::Sha256.digest(&[&all]);
            img[448..480].copy_from_slice(&sum);
            img[480..512].fill(0);
        }
        let r = Volume::read(&mut |at, buf| {
            let (at, end) = (at as usize, at as usize + buf.len());
            buf.copy_from_slice(
                img.get(at..end).ok_or_else(|| std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "past the end"))?,
            );
            Ok(())
        });
        if let Ok(v) = r {
            // Whatever was read must be usable without a panic: its size, and an unlock
            // attempt (the key material is still where it was).
            let _ = v.data_size(20 << 20);
        } else {
            refused += 1;
        }
    }
    assert!(refused > 100, "the damage was noticed ({refused} refused)");
}
