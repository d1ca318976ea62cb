//! The NBD export against real clients (qemu-io, qemu-img, nbdinfo, nbdcopy, nbdfuse), and
//! against hostile ones: one test per class of published nbdkit / qemu NBD server advisory.

#[path = "../common/mod.rs"]
mod common;

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use common::*;

const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
const OPT_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
const REP_ACK: u32 = 1;
const REP_INFO: u32 = 3;
const REP_ERR_UNSUP: u32 = (1 << 31) | 1;
const REP_ERR_INVALID: u32 = (1 << 31) | 3;
const REP_ERR_UNKNOWN: u32 = (1 << 31) | 6;

fn config(extra: &str) -> String {
    format!(
        "[fuse]\nenabled = false\n[nbd]\nhandshake_timeout_ms = 1500\nrequest_timeout_ms = 1500\n{extra}\n\
         [[device]]\nname = \"d0\"\nsize = \"64M\"\n[device.backend]\ntype = \"ram\"\n\
         [[device]]\nname = \"d1\"\nsize = \"16M\"\n[device.backend]\ntype = \"ram\"\n"
    )
}

fn start(tag: &str, extra: &str) -> (TempDir, Serve) {
    let tmp = TempDir::new(tag);
    let run_dir = tmp.path().join("run");
    let serve = Serve::start(&run_dir, Some(&config(extra)), &[]);
    let deadline = Instant::now() + Duration::from_secs(10);
    while !run_dir.join("nbd.sock").exists() {
        assert!(Instant::now() < deadline, "no nbd.sock: {}", serve.log_text());
        std::thread::sleep(Duration::from_millis(20));
    }
    (tmp, serve)
}

fn uri(serve: &Serve, export: &str) -> String {
    format!("nbd+unix:///{export}?socket={}", serve.run_dir.join("nbd.sock").display())
}

/// Runs a command under a time limit; its stdout, or a panic with its output.
fn sh(cmd: &str, args: &[&str]) -> String {
    let out = Command::new("timeout").args(["--kill-after=5", "60", cmd]).args(args).output().unwrap();
    assert!(
        out.status.success(),
        "{cmd} {args:?}: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn qemu_io_writes_patterns_and_reads_them_back() {
    if !tools(&["qemu-io"]) {
        return;
    }
    let (_tmp, serve) = start("nbd-qemu-io", "");
    let u = uri(&serve, "d0");
    let cmds = [
        "write -P 0xab 0 1M",
        "write -P 0xcd 1048575 65537",
        "write -P 0x44 5243657 3",
        "aio_write -P 0x11 8M 4k",
        "aio_write -P 0x22 9M 128k",
        "aio_flush",
        "write -z 16M 1M",
        "discard 20M 64k",
        "flush",
        "read -P 0xab 0 1048575",
        "read -P 0xcd 1048575 65537",
        "read -P 0x11 8M 4k",
        "read -P 0x22 9M 128k",
        "read -P 0x44 5243657 3",
        "read -P 0 16M 1M",
        // FUA writes
        "write -f -P 0x33 32M 64k",
        "read -P 0x33 32M 64k",
    ];
    let mut args = vec!["-f", "raw"];
    for c in &cmds {
        args.extend(["-c", c]);
    }
    args.push(&u);
    let out = sh("qemu-io", &args);
    assert!(!out.contains("Pattern verification failed"), "{out}");
    // Past the end: an error, not silence.
    let out = Command::new("qemu-io").args(["-f", "raw", "-c", "read 64M 512", &u]).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(text.contains("Input/output error") || text.contains("Invalid argument") || text.contains("out of range"), "{text}");
}

#[test]
fn qemu_img_converts_into_and_out_of_an_export_and_compares_equal() {
    if !tools(&["qemu-img"]) {
        return;
    }
    let (tmp, serve) = start("nbd-qemu-img", "");
    let u = uri(&serve, "d1");
    let src = tmp.path().join("src.img");
    std::fs::write(&src, pattern(3, 16 << 20)).unwrap();
    sh("qemu-img", &["convert", "-n", "-f", "raw", "-O", "raw", src.to_str().unwrap(), &u]);
    sh("qemu-img", &["compare", "-f", "raw", "-F", "raw", src.to_str().unwrap(), &u]);
    let out = tmp.path().join("out.qcow2");
    sh("qemu-img", &["convert", "-f", "raw", "-O", "qcow2", &u, out.to_str().unwrap()]);
    sh("qemu-img", &["compare", "-f", "qcow2", "-F", "raw", out.to_str().unwrap(), src.to_str().unwrap()]);
    let info = sh("qemu-img", &["info", "--output=json", &u]);
    assert!(info.contains("\"virtual-size\": 16777216"), "{info}");
}

#[test]
fn nbdinfo_lists_every_device_with_its_size_flags_and_block_sizes() {
    if !tools(&["nbdinfo"]) {
        return;
    }
    let (_tmp, serve) = start("nbd-info", "");
    let list = sh("nbdinfo", &["--list", "--json", &uri(&serve, "")]);
    assert!(list.contains("\"export-name\": \"d0\"") && list.contains("\"export-name\": \"d1\""), "{list}");
    let one = sh("nbdinfo", &["--json", &uri(&serve, "d0")]);
    for want in [
        "\"export-size\": 67108864",
        "\"can_flush\": true",
        "\"can_fua\": true",
        "\"can_trim\": true",
        "\"can_zero\": true",
        "\"can_multi_conn\": true",
        "\"block_size_minimum\": 1",
        "\"block_size_preferred\": 4096",
        "\"block_size_maximum\": 33554432",
    ] {
        assert!(one.contains(want), "{want} missing: {one}");
    }
    assert!(one.contains("structured"), "{one}");
}

#[test]
fn nbdcopy_round_trips_over_several_connections() {
    if !tools(&["nbdcopy"]) {
        return;
    }
    let (tmp, serve) = start("nbd-copy", "");
    let u = uri(&serve, "d0");
    let src = tmp.path().join("src.img");
    let data = pattern(11, 64 << 20);
    std::fs::write(&src, &data).unwrap();
    sh("nbdcopy", &["--connections=4", "--requests=16", src.to_str().unwrap(), &u]);
    let back = tmp.path().join("back.img");
    sh("nbdcopy", &["--connections=4", &u, back.to_str().unwrap()]);
    assert!(std::fs::read(&back).unwrap() == data, "nbdcopy round trip differs");
}

#[test]
fn nbdfuse_mounts_an_export() {
    if !tools(&["nbdfuse", "fusermount3"]) {
        return;
    }
    let (tmp, serve) = start("nbd-fuse", "");
    let mnt = tmp.path().join("mnt");
    std::fs::create_dir_all(&mnt).unwrap();
    let child =
        Command::new("nbdfuse").arg(&mnt).args(["--unix", serve.run_dir.join("nbd.sock").to_str().unwrap()]).spawn().unwrap();
    let mut guard = ChildGuard(Some(child));
    let file = mnt.join("nbd");
    let deadline = Instant::now() + Duration::from_secs(10);
    while !file.exists() {
        assert!(Instant::now() < deadline, "nbdfuse did not mount");
        std::thread::sleep(Duration::from_millis(50));
    }
    let data = pattern(21, 1 << 20);
    let src = tmp.path().join("src");
    std::fs::write(&src, &data).unwrap();
    dd(&src, &file, &["bs=64k", "seek=3", "conv=notrunc,fsync"]);
    let back = tmp.path().join("back");
    dd(&file, &back, &["bs=64k", "skip=3", "count=16"]);
    let unmounted = Command::new("fusermount3").arg("-u").arg(&mnt).status().map(|s| s.success()).unwrap_or(false);
    if !unmounted {
        let _ = Command::new("umount").arg("-l").arg(&mnt).status();
    }
    let _ = guard.0.as_mut().map(|c| c.wait());
    assert!(std::fs::read(&back).unwrap() == data, "nbdfuse round trip differs");
}

#[test]
fn tcp_export_serves_when_configured() {
    if !tools(&["nbdinfo", "qemu-io"]) {
        return;
    }
    // A free port: bind to 0 and let it go.
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let (_tmp, serve) = start("nbd-tcp", &format!("tcp = \"127.0.0.1:{port}\""));
    let u = format!("nbd://127.0.0.1:{port}/d1");
    let out = sh("nbdinfo", &["--size", &u]);
    assert_eq!(out.trim(), "16777216");
    sh("qemu-io", &["-f", "raw", "-c", "write -P 0x5a 0 1M", "-c", "read -P 0x5a 0 1M", &u]);
    assert!(serve.log_text().contains(&format!("TCP 127.0.0.1:{port}")), "{}", serve.log_text());
}

/// An export with `nbd_allow` serves TCP clients from those ranges only: another address is
/// refused at negotiation and does not see it listed; the unix socket is not asked.
#[test]
fn tcp_exports_serve_only_the_addresses_they_allow() {
    if !tools(&["nbdinfo"]) {
        return;
    }
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let cfg = format!(
        "[fuse]\nenabled = false\n[nbd]\ntcp = \"127.0.0.1:{port}\"\n\
         [[device]]\nname = \"d0\"\nsize = \"16M\"\nnbd_allow = [\"10.0.0.0/8\"]\n[device.backend]\ntype = \"ram\"\n\
         [[device]]\nname = \"d1\"\nsize = \"16M\"\nnbd_allow = [\"192.0.2.0/24\", \"127.0.0.1\"]\n[device.backend]\ntype = \"ram\"\n\
         [[device]]\nname = \"d2\"\nsize = \"16M\"\n[device.backend]\ntype = \"ram\"\n"
    );
    let tmp = TempDir::new("nbd-allow");
    let serve = Serve::start(&tmp.path().join("run"), Some(&cfg), &[]);
    let deadline = Instant::now() + Duration::from_secs(10);
    while !serve.run_dir.join("nbd.sock").exists() {
        assert!(Instant::now() < deadline, "no nbd.sock: {}", serve.log_text());
        std::thread::sleep(Duration::from_millis(20));
    }
    let tcp = |e: &str| format!("nbd://127.0.0.1:{port}/{e}");
    assert_eq!(sh("nbdinfo", &["--size", &tcp("d1")]).trim(), "16777216");
    assert_eq!(sh("nbdinfo", &["--size", &tcp("d2")]).trim(), "16777216");
    let refused = Command::new("nbdinfo").args(["--size", &tcp("d0")]).output().unwrap();
    assert!(!refused.status.success(), "d0 served to 127.0.0.1: {refused:?}");
    assert!(String::from_utf8_lossy(&refused.stderr).contains("policy"), "{refused:?}");
    let list = sh("nbdinfo", &["--list", &tcp("")]);
    assert!(list.contains("export=\"d1\"") && list.contains("export=\"d2\"") && !list.contains("export=\"d0\""), "{list}");
    // The unix socket: every export.
    assert_eq!(sh("nbdinfo", &["--size", &uri(&serve, "d0")]).trim(), "16777216");
}

/// A CA, a server certificate for localhost and 127.0.0.1, and a client certificate, in the
/// layout qemu, libnbd and the export read: `dir` gets ca-cert.pem, server-cert.pem,
/// server-key.pem, client-cert.pem and client-key.pem.
fn make_certificates(dir: &std::path::Path) {
    std::fs::create_dir_all(dir).unwrap();
    let at = |f: &str| dir.join(f).display().to_string();
    let openssl = |args: &[&str]| {
        let out = Command::new("openssl").args(args).output().unwrap();
        assert!(out.status.success(), "openssl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    };
    let ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"];
    openssl(
        &[
            &["req", "-x509"][..],
            &ec,
            &["-keyout", &at("ca-key.pem"), "-out", &at("ca-cert.pem"), "-days", "2", "-subj", "/CN=test CA"],
        ]
        .concat(),
    );
    for (who, ext) in [
        ("server", "subjectAltName=DNS:localhost,IP:127.0.0.1\nbasicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\n"),
        ("client", "basicConstraints=CA:FALSE\nextendedKeyUsage=clientAuth\n"),
    ] {
        let (key, csr, cert, extf) =
            (at(&format!("{who}-key.pem")), at(&format!("{who}.csr")), at(&format!("{who}-cert.pem")), at(&format!("{who}.ext")));
        std::fs::write(&extf, ext).unwrap();
        openssl(&[&["req"][..], &ec, &["-keyout", &key, "-out", &csr, "-subj", &format!("/CN={who}")]].concat());
        openssl(&[
            "x509",
            "-req",
            "-in",
            &csr,
            "-CA",
            &at("ca-cert.pem"),
            "-CAkey",
            &at("ca-key.pem"),
            "-CAcreateserial",
            "-out",
            &cert,
            "-days",
            "2",
            "-extfile",
            &extf,
        ]);
    }
}

/// `serve` with one device on TCP, TLS as `tls_keys` say; its port.
fn tls_serve(tmp: &TempDir, tls_keys: &str) -> (Serve, u16) {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let cfg = format!(
        "[fuse]\nenabled = false\n[nbd]\ntcp = \"127.0.0.1:{port}\"\n{tls_keys}\n\
         [[device]]\nname = \"d0\"\nsize = \"16M\"\n[device.backend]\ntype = \"ram\"\n"
    );
    let serve = Serve::start(&tmp.path().join("run"), Some(&cfg), &[]);
    let deadline = Instant::now() + Duration::from_secs(10);
    while !serve.run_dir.join("nbd.sock").exists() {
        assert!(Instant::now() < deadline, "no nbd.sock: {}", serve.log_text());
        std::thread::sleep(Duration::from_millis(20));
    }
    (serve, port)
}

#[test]
fn tls_is_required_of_tcp_clients_and_speaks_with_libnbd_and_qemu() {
    if !tools(&["nbdinfo", "nbdcopy", "qemu-io", "openssl"]) {
        return;
    }
    let tmp = TempDir::new("nbd-tls");
    let pki = tmp.path().join("pki");
    make_certificates(&pki);
    let keys = format!("tls = \"require\"\ntls_certificates = \"{}\"", pki.display());
    let (serve, port) = tls_serve(&tmp, &keys);
    let nbds = format!("nbds://localhost:{port}/d0?tls-certificates={}", pki.display());
    // Without TLS over TCP: refused, saying why.
    let plain = Command::new("nbdinfo").args(["--size", &format!("nbd://127.0.0.1:{port}/d0")]).output().unwrap();
    assert!(!plain.status.success(), "served without TLS: {plain:?}");
    let plain = Command::new("qemu-io")
        .args(["--image-opts", &format!("driver=nbd,host=127.0.0.1,port={port},export=d0"), "-c", "read 0 4k"])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&plain.stderr).contains("requires TLS"), "{plain:?}");
    // With it: libnbd's tools both ways, the data compared.
    assert_eq!(sh("nbdinfo", &["--size", &nbds]).trim(), "16777216");
    copy_through(&tmp, &nbds, &nbds, 77);
    // qemu with its X.509 credentials.
    let creds = format!("tls-creds-x509,id=tls0,dir={},endpoint=client", pki.display());
    let opts = format!("driver=nbd,host=localhost,port={port},export=d0,tls-creds=tls0");
    let out =
        qemu_io_args(&["--object", &creds, "--image-opts", &opts, "-c", "write -P 0x5c 1M 64k", "-c", "read -P 0x5c 1M 64k"]);
    assert!(out.contains("read 65536/65536 bytes"), "{out}");
    // The unix socket, guarded by its permissions, is not asked for TLS.
    assert_eq!(sh("nbdinfo", &["--size", &uri(&serve, "d0")]).trim(), "16777216");
    drop(serve);

    // Verifying peers: a client without a certificate the CA signed is refused.
    let tmp2 = TempDir::new("nbd-tls-peer");
    let keys = format!("tls = \"on\"\ntls_certificates = \"{}\"\ntls_verify_peer = true", pki.display());
    let (serve, port) = tls_serve(&tmp2, &keys);
    let with_cert = format!("nbds://localhost:{port}/d0?tls-certificates={}", pki.display());
    assert_eq!(sh("nbdinfo", &["--size", &with_cert]).trim(), "16777216");
    let ca_only = tmp2.path().join("ca-only");
    std::fs::create_dir_all(&ca_only).unwrap();
    std::fs::copy(pki.join("ca-cert.pem"), ca_only.join("ca-cert.pem")).unwrap();
    let out = Command::new("nbdinfo")
        .args(["--size", &format!("nbds://localhost:{port}/d0?tls-certificates={}", ca_only.display())])
        .output()
        .unwrap();
    assert!(!out.status.success(), "served a client with no certificate: {out:?}");
    // With `on`, a plaintext client is still served.
    assert_eq!(sh("nbdinfo", &["--size", &format!("nbd://127.0.0.1:{port}/d0")]).trim(), "16777216");
    assert!(serve.log_text().contains("peer sent no certificates"), "{}", serve.log_text());
}

#[test]
fn tls_with_pre_shared_keys_speaks_with_libnbd_and_qemu() {
    if !tools(&["nbdinfo", "nbdcopy", "qemu-io"]) {
        return;
    }
    let tmp = TempDir::new("nbd-tls-psk");
    let hex = |seed: u64| pattern(seed, 32).iter().map(|b| format!("{b:02x}")).collect::<String>();
    // qemu reads `keys.psk` in a directory, libnbd any file.
    let dir = tmp.path().join("psk");
    std::fs::create_dir_all(&dir).unwrap();
    let keys = dir.join("keys.psk");
    std::fs::write(&keys, format!("alice:{}\ncarol:{}\n", hex(1), hex(2))).unwrap();
    let cfg = format!("tls = \"require\"\ntls_psk = \"{}\"", keys.display());
    let (serve, port) = tls_serve(&tmp, &cfg);
    let nbds = |who: &str, file: &std::path::Path| format!("nbds://{who}@127.0.0.1:{port}/d0?tls-psk-file={}", file.display());
    // Without TLS over TCP: refused.
    let plain = Command::new("nbdinfo").args(["--size", &format!("nbd://127.0.0.1:{port}/d0")]).output().unwrap();
    assert!(!plain.status.success(), "served without TLS: {plain:?}");
    // With a key: libnbd's tools both ways, the data compared, for either identity.
    assert_eq!(sh("nbdinfo", &["--size", &nbds("alice", &keys)]).trim(), "16777216");
    assert_eq!(sh("nbdinfo", &["--size", &nbds("carol", &keys)]).trim(), "16777216");
    copy_through(&tmp, &nbds("alice", &keys), &nbds("carol", &keys), 78);
    // qemu with its PSK credentials.
    let creds = format!("tls-creds-psk,id=tls0,dir={},username=alice,endpoint=client", dir.display());
    let opts = format!("driver=nbd,host=127.0.0.1,port={port},export=d0,tls-creds=tls0");
    let out =
        qemu_io_args(&["--object", &creds, "--image-opts", &opts, "-c", "write -P 0x6d 1M 64k", "-c", "read -P 0x6d 1M 64k"]);
    assert!(out.contains("read 65536/65536 bytes"), "{out}");
    // A wrong key, and an identity the server does not know: refused.
    let wrong = tmp.path().join("wrong.psk");
    std::fs::write(&wrong, format!("alice:{}\nmallory:{}\n", hex(3), hex(1))).unwrap();
    for who in ["alice", "mallory"] {
        let out = Command::new("nbdinfo").args(["--size", &nbds(who, &wrong)]).output().unwrap();
        assert!(!out.status.success(), "{who} served with a wrong key: {out:?}");
    }
    assert!(serve.log_text().contains("no pre-shared key for identity `mallory`"), "{}", serve.log_text());
    assert!(serve.log_text().contains("TLS with PSK required of TCP clients"), "{}", serve.log_text());
}

/// 4 MiB of `seed`'s pattern copied up with `nbdcopy` to `up`, back down from `down`, and
/// compared.
fn copy_through(tmp: &TempDir, up: &str, down: &str, seed: u64) {
    let data = pattern(seed, 4 << 20);
    let (src, dst) = (tmp.path().join("in.bin"), tmp.path().join("out.bin"));
    std::fs::write(&src, &data).unwrap();
    sh("nbdcopy", &[src.to_str().unwrap(), up]);
    sh("nbdcopy", &[down, dst.to_str().unwrap()]);
    assert_eq!(&std::fs::read(&dst).unwrap()[..4 << 20], &data[..], "nbdcopy up to {up} and down from {down}");
}

/// qemu-io with `args`, its output and errors.
fn qemu_io_args(args: &[&str]) -> String {
    let out = Command::new("qemu-io").args(args).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "qemu-io {args:?}: {text}");
    text
}

#[test]
fn tls_settings_that_cannot_work_are_named() {
    let tmp = TempDir::new("nbd-tls-bad");
    let dev = "[[device]]\nname = \"d0\"\nsize = \"16M\"\n[device.backend]\ntype = \"ram\"\n";
    let err = refused(&tmp, &format!("[nbd]\ntls = \"require\"\n{dev}"));
    assert!(err.contains("line 2") && err.contains("nbd.tls_certificates"), "{err}");
    // Everything after `tls = "on"` (line 4) in the export's section.
    let with = |keys: &str| format!("[fuse]\nenabled = false\n[nbd]\ntls = \"on\"\n{keys}\n{dev}");
    let missing = tmp.path().join("nowhere");
    let err = refused(&tmp, &with(&format!("tls_certificates = \"{}\"", missing.display())));
    assert!(err.contains("server-cert.pem"), "{err}");
    // Pre-shared keys: a bad line is named, and so is asking for both kinds of credentials.
    let psk = tmp.path().join("keys.psk");
    std::fs::write(&psk, "alice:00ff\nbob:xyz\n").unwrap();
    let err = refused(&tmp, &with(&format!("tls_psk = \"{}\"", psk.display())));
    assert!(err.contains("nbd.tls_psk") && err.contains("keys.psk") && err.contains("line 2"), "{err}");
    let both = format!("tls_certificates = \"{}\"\ntls_psk = \"{}\"", missing.display(), psk.display());
    let err = refused(&tmp, &with(&both));
    assert!(err.contains("line 6") && err.contains("not both"), "{err}");
}

// ---- hostile clients ------------------------------------------------------------------------

/// A hand-rolled client that can send anything.
struct Raw(UnixStream);

impl Raw {
    fn connect(serve: &Serve) -> Raw {
        let s = UnixStream::connect(serve.run_dir.join("nbd.sock")).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        Raw(s)
    }

    /// Reads the greeting and sends the client flags.
    fn hello(serve: &Serve) -> Raw {
        let mut r = Raw::connect(serve);
        assert_eq!(r.u64(), NBDMAGIC);
        assert_eq!(r.u64(), IHAVEOPT);
        let flags = r.u16();
        assert_eq!(flags & 3, 3, "fixed newstyle, no zeroes");
        r.send(&3u32.to_be_bytes());
        r
    }

    fn send(&mut self, b: &[u8]) {
        self.0.write_all(b).unwrap();
    }

    fn exact(&mut self, n: usize) -> Vec<u8> {
        let mut b = vec![0u8; n];
        self.0.read_exact(&mut b).unwrap();
        b
    }
    fn u16(&mut self) -> u16 {
        u16::from_be_bytes(self.exact(2).try_into().unwrap())
    }
    fn u32(&mut self) -> u32 {
        u32::from_be_bytes(self.exact(4).try_into().unwrap())
    }
    fn u64(&mut self) -> u64 {
        u64::from_be_bytes(self.exact(8).try_into().unwrap())
    }

    fn option(&mut self, opt: u32, data: &[u8]) {
        let mut b = IHAVEOPT.to_be_bytes().to_vec();
        b.extend_from_slice(&opt.to_be_bytes());
        b.extend_from_slice(&(data.len() as u32).to_be_bytes());
        b.extend_from_slice(data);
        self.send(&b);
    }

    /// One option reply: (type, data).
    fn reply(&mut self, opt: u32) -> (u32, Vec<u8>) {
        assert_eq!(self.u64(), OPT_REPLY_MAGIC);
        assert_eq!(self.u32(), opt);
        let typ = self.u32();
        let len = self.u32() as usize;
        (typ, self.exact(len))
    }

    /// Whether the server closed the connection (EOF or reset) within the read timeout.
    fn closed(&mut self) -> bool {
        let mut b = [0u8; 1];
        matches!(self.0.read(&mut b), Ok(0) | Err(_))
    }

    /// NBD_OPT_GO on `name`; the transmission flags.
    fn go(&mut self, name: &str) -> u16 {
        let mut d = (name.len() as u32).to_be_bytes().to_vec();
        d.extend_from_slice(name.as_bytes());
        d.extend_from_slice(&0u16.to_be_bytes());
        self.option(7, &d);
        let mut flags = 0;
        loop {
            let (t, data) = self.reply(7);
            match t {
                REP_INFO if u16::from_be_bytes([data[0], data[1]]) == 0 => flags = u16::from_be_bytes([data[10], data[11]]),
                REP_INFO => {}
                REP_ACK => return flags,
                other => panic!("GO failed: {other:#x}"),
            }
        }
    }

    fn request(&mut self, typ: u16, flags: u16, cookie: u64, offset: u64, len: u32) {
        let mut b = 0x2560_9513u32.to_be_bytes().to_vec();
        b.extend_from_slice(&flags.to_be_bytes());
        b.extend_from_slice(&typ.to_be_bytes());
        b.extend_from_slice(&cookie.to_be_bytes());
        b.extend_from_slice(&offset.to_be_bytes());
        b.extend_from_slice(&len.to_be_bytes());
        self.send(&b);
    }

    /// A simple reply: (error, cookie).
    fn simple(&mut self) -> (u32, u64) {
        assert_eq!(self.u32(), 0x6744_6698);
        (self.u32(), self.u64())
    }
}

/// Requests sent back to back are read in batches and served with many in flight at once:
/// every one is answered exactly once, with its own data, whatever its kind — a refused one
/// amid the batch, one larger than a queue carries, a flush — and a disconnect at the end of a
/// burst still answers everything before it.
#[test]
fn a_pipelined_burst_is_answered_once_per_request_with_its_own_data() {
    let (_tmp, serve) = start("nbd-burst", "");
    let mut c = Raw::hello(&serve);
    c.go("d0");
    let pattern = |i: u64| vec![(i * 7 + 1) as u8; 4096];
    let big = |i: usize| (i % 251) as u8;
    // One burst: 200 writes of 4 KiB, a read past the end in the middle, a 12 MiB write (more
    // than one queue's arena carries), a flush.
    let mut burst = Vec::new();
    let header = |typ: u16, cookie: u64, offset: u64, len: u32| {
        let mut b = 0x2560_9513u32.to_be_bytes().to_vec();
        b.extend_from_slice(&0u16.to_be_bytes());
        b.extend_from_slice(&typ.to_be_bytes());
        b.extend_from_slice(&cookie.to_be_bytes());
        b.extend_from_slice(&offset.to_be_bytes());
        b.extend_from_slice(&len.to_be_bytes());
        b
    };
    for i in 0..200u64 {
        burst.extend(header(1, i, i * 8192, 4096));
        burst.extend(pattern(i));
        if i == 100 {
            burst.extend(header(0, 1000, 64 << 20, 4096));
        }
    }
    burst.extend(header(1, 2000, 32 << 20, 12 << 20));
    burst.extend((0..12 << 20).map(big));
    burst.extend(header(3, 3000, 0, 0));
    c.send(&burst);
    let mut answered = std::collections::HashMap::new();
    for _ in 0..203 {
        let (err, cookie) = c.simple();
        assert!(answered.insert(cookie, err).is_none(), "cookie {cookie} answered twice");
    }
    assert_eq!(answered.get(&1000), Some(&22), "the read past the end is refused: {answered:?}");
    assert!(answered.iter().all(|(&k, &e)| k == 1000 || e == 0), "{answered:?}");
    // A burst of reads, then a disconnect: all answered with their data, then closed.
    let mut burst = Vec::new();
    for i in 0..200u64 {
        burst.extend(header(0, i, i * 8192, 4096));
    }
    burst.extend(header(0, 2000, 32 << 20, 12 << 20));
    burst.extend(header(2, 9999, 0, 0));
    c.send(&burst);
    let mut seen = std::collections::HashSet::new();
    for _ in 0..201 {
        let (err, cookie) = c.simple();
        assert_eq!(err, 0, "read {cookie}");
        assert!(seen.insert(cookie), "cookie {cookie} answered twice");
        if cookie == 2000 {
            let data = c.exact(12 << 20);
            assert!(data.iter().enumerate().all(|(i, &b)| b == big(i)), "the 12 MiB read");
        } else {
            assert_eq!(c.exact(4096), pattern(cookie), "read {cookie}");
        }
    }
    assert!(c.closed(), "disconnect after the burst");
    still_serves(&serve);
}

/// A request header that arrives in pieces, behind requests still being served, is read whole
/// once the rest comes, and answered with the others.
#[test]
fn a_header_sent_in_pieces_behind_a_burst_is_read_whole() {
    let (_tmp, serve) = start("nbd-split", "");
    let mut c = Raw::hello(&serve);
    c.go("d0");
    let header = |cookie: u64, offset: u64| {
        let mut b = 0x2560_9513u32.to_be_bytes().to_vec();
        b.extend_from_slice(&0u16.to_be_bytes()); // flags
        b.extend_from_slice(&0u16.to_be_bytes()); // read
        b.extend_from_slice(&cookie.to_be_bytes());
        b.extend_from_slice(&offset.to_be_bytes());
        b.extend_from_slice(&4096u32.to_be_bytes());
        b
    };
    c.request(1, 0, 1, 8192, 4096);
    c.send(&[0x5a; 4096]);
    assert_eq!(c.simple(), (0, 1));
    let mut burst: Vec<u8> = (100..164).flat_map(|i| header(i, 0)).collect();
    let split = header(7, 8192);
    burst.extend_from_slice(&split[..11]);
    c.send(&burst);
    std::thread::sleep(std::time::Duration::from_millis(30));
    c.send(&split[11..20]);
    std::thread::sleep(std::time::Duration::from_millis(30));
    c.send(&split[20..]);
    let mut seen = std::collections::HashSet::new();
    for _ in 0..65 {
        let (err, cookie) = c.simple();
        assert_eq!(err, 0, "read {cookie}");
        assert!(seen.insert(cookie), "cookie {cookie} answered twice");
        let want = if cookie == 7 { 0x5a } else { 0 };
        assert_eq!(c.exact(4096), vec![want; 4096], "read {cookie}");
    }
    still_serves(&serve);
}

/// A well-behaved client still works: the server was not disturbed.
fn still_serves(serve: &Serve) {
    let mut c = Raw::hello(serve);
    c.go("d1");
    c.request(1, 0, 42, 4096, 512);
    c.send(&[0x77; 512]);
    assert_eq!(c.simple(), (0, 42));
    c.request(0, 0, 43, 4096, 512);
    assert_eq!(c.simple(), (0, 43));
    assert_eq!(c.exact(512), vec![0x77; 512]);
    c.request(2, 0, 44, 0, 0);
}

#[test]
fn bad_magic_unknown_flags_and_unknown_options_get_the_protocol_answer() {
    let (_tmp, serve) = start("nbd-bad", "");
    // Bad option magic: closed.
    let mut c = Raw::hello(&serve);
    c.send(&[0u8; 16]);
    assert!(c.closed());
    // Unknown client flags: closed.
    let mut c = Raw::connect(&serve);
    c.exact(18);
    c.send(&0x8000_0003u32.to_be_bytes());
    assert!(c.closed());
    // Unknown option: ERR_UNSUP, and negotiation goes on.
    let mut c = Raw::hello(&serve);
    c.option(0x7777, b"whatever");
    assert_eq!(c.reply(0x7777).0, REP_ERR_UNSUP);
    // Unknown export: ERR_UNKNOWN, and negotiation goes on.
    let mut d = 7u32.to_be_bytes().to_vec();
    d.extend_from_slice(b"missing");
    d.extend_from_slice(&0u16.to_be_bytes());
    c.option(6, &d);
    assert_eq!(c.reply(6).0, REP_ERR_UNKNOWN);
    // LIST with a payload is invalid; without, it lists both devices.
    c.option(3, b"x");
    assert_eq!(c.reply(3).0, REP_ERR_INVALID);
    c.option(3, &[]);
    let mut names = Vec::new();
    loop {
        let (t, data) = c.reply(3);
        if t == REP_ACK {
            break;
        }
        names.push(String::from_utf8(data[4..].to_vec()).unwrap());
    }
    assert_eq!(names, ["d0", "d1"]);
    // Unknown command, and flags that do not belong: EINVAL, connection kept.
    let flags = c.go("d0");
    assert_eq!(flags & 1, 1);
    c.request(0x99, 0, 1, 0, 512);
    assert_eq!(c.simple(), (22, 1));
    c.request(0, 1, 2, 0, 512); // FUA on a read
    assert_eq!(c.simple(), (22, 2));
    c.request(3, 0, 3, 0, 0); // flush
    assert_eq!(c.simple(), (0, 3));
    still_serves(&serve);
}

/// qemu CVE-2017-15119 class: an option length of gigabytes must not be read or allocated.
#[test]
fn advisory_class_huge_option_length_closes_without_allocating() {
    let (_tmp, serve) = start("nbd-bigopt", "");
    let mut c = Raw::hello(&serve);
    let mut b = IHAVEOPT.to_be_bytes().to_vec();
    b.extend_from_slice(&7u32.to_be_bytes());
    b.extend_from_slice(&u32::MAX.to_be_bytes());
    c.send(&b);
    assert!(c.closed());
    assert!(serve.log_text().contains("bytes (limit"), "{}", serve.log_text());
    still_serves(&serve);
}

/// qemu CVE-2017-15118 class: an over-long export name in NBD_OPT_INFO/GO.
#[test]
fn advisory_class_over_long_export_name_is_invalid() {
    let (_tmp, serve) = start("nbd-longname", "");
    let mut c = Raw::hello(&serve);
    let name = vec![b'a'; 8000];
    let mut d = (name.len() as u32).to_be_bytes().to_vec();
    d.extend_from_slice(&name);
    d.extend_from_slice(&0u16.to_be_bytes());
    c.option(7, &d);
    assert_eq!(c.reply(7).0, REP_ERR_INVALID);
    // A name length that lies about the payload.
    let mut d = 100u32.to_be_bytes().to_vec();
    d.extend_from_slice(b"d0");
    c.option(6, &d);
    assert_eq!(c.reply(6).0, REP_ERR_INVALID);
    // EXPORT_NAME too long: no error reply exists for it, so the connection closes.
    c.option(1, &vec![b'b'; 5000]);
    assert!(c.closed());
    still_serves(&serve);
}

/// nbdkit CVE-2019-14851 class: transmission commands sent while still negotiating (after
/// NBD_OPT_INFO, before NBD_OPT_GO) must not be taken as commands.
#[test]
fn advisory_class_commands_before_go_close_the_connection() {
    let (_tmp, serve) = start("nbd-order", "");
    let answered = || serve.status_json()["devices"][0]["completed"].as_u64().unwrap_or(0);
    let before = answered();
    let mut c = Raw::hello(&serve);
    let mut d = 2u32.to_be_bytes().to_vec();
    d.extend_from_slice(b"d0");
    d.extend_from_slice(&0u16.to_be_bytes());
    c.option(6, &d);
    loop {
        if c.reply(6).0 == REP_ACK {
            break;
        }
    }
    c.request(1, 0, 9, 0, 4);
    // The server may already have closed on the header: the payload may not get through.
    let _ = c.0.write_all(b"evil");
    assert!(c.closed());
    assert_eq!(answered(), before, "a command ran before GO");
    still_serves(&serve);
}

/// nbdkit CVE-2021-3716 class: state negotiated in plaintext must not change behind the
/// client's back. Here STARTTLS is refused (no TLS) and changes nothing; a second
/// STRUCTURED_REPLY is refused; replies follow exactly what was agreed.
#[test]
fn advisory_class_refused_options_change_no_state() {
    let (_tmp, serve) = start("nbd-tls", "");
    let mut c = Raw::hello(&serve);
    c.option(5, &[]);
    assert_eq!(c.reply(5).0, REP_ERR_UNSUP);
    // No structured replies were agreed: the export does not offer DF and replies are simple.
    let flags = c.go("d1");
    assert_eq!(flags & (1 << 7), 0, "DF without structured replies");
    c.request(0, 0, 5, 0, 16);
    assert_eq!(c.simple(), (0, 5));
    c.exact(16);

    let mut c = Raw::hello(&serve);
    c.option(8, &[]);
    assert_eq!(c.reply(8).0, REP_ACK);
    c.option(8, &[]);
    assert_eq!(c.reply(8).0, REP_ERR_INVALID, "structured replies agreed twice");
    c.option(5, &[]);
    assert_eq!(c.reply(5).0, REP_ERR_UNSUP);
    let flags = c.go("d1");
    assert_ne!(flags & (1 << 7), 0, "DF with structured replies");
    c.request(0, 0, 6, 0, 16);
    // A structured chunk: magic, DONE flag, OFFSET_DATA, cookie, length 8 + 16.
    assert_eq!(c.u32(), 0x668e_33ef);
    assert_eq!(c.u16(), 1);
    assert_eq!(c.u16(), 1);
    assert_eq!(c.u64(), 6);
    assert_eq!(c.u32(), 24);
    assert_eq!(c.u64(), 0);
    c.exact(16);
}

/// nbdkit CVE-2019-14850 class: clients that never finish negotiating must cost no device
/// work, are cut off at the handshake deadline (also when they trickle bytes), and do not
/// keep others out.
#[test]
fn advisory_class_stalled_negotiations_cost_nothing_and_time_out() {
    let (_tmp, serve) = start("nbd-stall", "");
    let t0 = Instant::now();
    let mut idle: Vec<Raw> = (0..8).map(|_| Raw::hello(&serve)).collect();
    let mut trickler = Raw::hello(&serve);
    // Half an option header now, a byte every 400 ms later.
    trickler.send(&IHAVEOPT.to_be_bytes()[..4]);
    still_serves(&serve);
    let mut trickle_closed = false;
    for b in IHAVEOPT.to_be_bytes()[4..].iter().chain([0u8; 8].iter()) {
        std::thread::sleep(Duration::from_millis(400));
        if trickler.0.write_all(&[*b]).is_err() {
            trickle_closed = true;
            break;
        }
    }
    for c in &mut idle {
        assert!(c.closed(), "a stalled negotiation was not cut off");
    }
    assert!(trickle_closed || trickler.closed(), "a trickling client was not cut off");
    // handshake_timeout_ms = 1500: cut off within the deadline plus one timeout.
    assert!(t0.elapsed() < Duration::from_secs(8), "took {:?}", t0.elapsed());
    assert!(serve.log_text().contains("negotiation did not finish in time"), "{}", serve.log_text());
}

/// Requests past the end, with offset + length overflowing, or longer than the maximum block
/// size: errors, not crashes; a write too large to skip closes the connection.
#[test]
fn advisory_class_out_of_range_and_oversized_requests() {
    let (_tmp, serve) = start("nbd-range", "");
    let mut c = Raw::hello(&serve);
    c.go("d1");
    let size = 16u64 << 20;
    c.request(0, 0, 1, size - 256, 512);
    assert_eq!(c.simple(), (22, 1), "read past the end");
    c.request(1, 0, 2, size - 256, 512);
    c.send(&[1u8; 512]);
    assert_eq!(c.simple(), (28, 2), "write past the end: ENOSPC, payload consumed");
    c.request(0, 0, 3, u64::MAX - 100, 4096);
    assert_eq!(c.simple(), (22, 3), "offset + length overflows");
    c.request(4, 0, 4, u64::MAX - 100, 4096);
    assert_eq!(c.simple(), (22, 4), "trim overflows");
    c.request(0, 0, 5, 0, 64 << 20);
    assert_eq!(c.simple(), (75, 5), "read beyond the maximum block size");
    // Still in step after all that:
    c.request(0, 0, 6, 0, 8);
    assert_eq!(c.simple(), (0, 6));
    c.exact(8);
    // A 4 GiB write cannot be skipped: error, then closed.
    c.request(1, 0, 7, 0, u32::MAX);
    assert_eq!(c.simple(), (75, 7));
    assert!(c.closed());
    still_serves(&serve);
}

/// A client that starts a request and stalls mid-way is cut off; an idle one is not.
#[test]
fn slow_request_is_cut_off_but_idle_connection_stays() {
    let (_tmp, serve) = start("nbd-slow", "");
    let mut idle = Raw::hello(&serve);
    idle.go("d0");
    let mut slow = Raw::hello(&serve);
    slow.go("d0");
    // A write header and half its payload, then nothing.
    slow.request(1, 0, 1, 0, 4096);
    slow.send(&[0u8; 2048]);
    std::thread::sleep(Duration::from_millis(3500));
    assert!(slow.closed(), "stalled request not cut off");
    // The idle connection (3.5 s > request_timeout_ms) still works.
    idle.request(0, 0, 9, 0, 512);
    assert_eq!(idle.simple(), (0, 9));
    idle.exact(512);
}

/// qemu CVE-2024-7409 class: shutting down with clients stuck in negotiation must neither hang
/// nor crash; connections beyond the limit are refused at accept without disturbing others.
#[test]
fn advisory_class_shutdown_with_clients_mid_negotiation_and_connection_limit() {
    let (_tmp, mut serve) = start("nbd-shutdown", "max_connections = 4");
    let stuck: Vec<Raw> = (0..4).map(|_| Raw::hello(&serve)).collect();
    // A fifth is over the limit: closed at accept.
    let mut extra = Raw::connect(&serve);
    assert!(extra.closed());
    let t0 = Instant::now();
    let st = serve.stop();
    assert!(st.success(), "serve: {st}\n{}", serve.log_text());
    assert!(t0.elapsed() < Duration::from_secs(5), "shutdown took {:?}", t0.elapsed());
    assert!(!Path::new(&serve.run_dir.join("nbd.sock")).exists(), "socket left behind");
    drop(stuck);
}

/// Whether user and group 65534 (nobody) can connect to the unix socket at `path`: the
/// server's first bytes arrive.
fn nobody_connects(path: &Path) -> Result<bool, String> {
    let script = format!(
        "import socket,sys\ns = socket.socket(socket.AF_UNIX)\ntry:\n    s.connect({:?})\nexcept PermissionError:\n    print('refused'); sys.exit(0)\nprint('connected')",
        path.display().to_string()
    );
    let out = Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3", "-c", &script])
        .output()
        .map_err(|e| e.to_string())?;
    let said = String::from_utf8_lossy(&out.stdout);
    match said.trim() {
        "connected" => Ok(true),
        "refused" => Ok(false),
        _ => Err(format!("{said} {}", String::from_utf8_lossy(&out.stderr))),
    }
}

/// `[nbd] group` and `[vhost_user] group` give the sockets to a group, mode 0660, so that a
/// QEMU run as another user (libvirt's) can connect; without them, others cannot.
#[test]
fn a_group_opens_the_nbd_and_vhost_user_sockets_to_its_members() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    bulkhead_testkit::require_kernel!();
    if bulkhead_sys::euid() != 0 || !tools(&["setpriv"]) || !Path::new("/usr/bin/python3").exists() {
        assert!(std::env::var_os("BULKHEAD_REQUIRE_KERNEL").is_none(), "needs root, setpriv and python3");
        eprintln!("SKIP: needs root, setpriv and python3");
        return;
    }
    for group in [Some("65534"), None] {
        let tmp = TempDir::new("socket-group");
        let g = group.map(|g| format!("group = \"{g}\"\n")).unwrap_or_default();
        let cfg = format!(
            "[nbd]\n{g}[vhost_user]\nenabled = true\n{g}[[device]]\nname = \"d\"\nsize = \"16M\"\n[device.backend]\ntype = \"ram\"\n"
        );
        let serve = Serve::start(&tmp.path().join("run"), Some(&cfg), &["d"]);
        // The way in: the run directory open to others, as the packaged one (0711) is.
        for dir in [tmp.path().to_path_buf(), serve.run_dir.clone(), serve.run_dir.join("vhost")] {
            std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o711)).unwrap();
        }
        for sock in [serve.run_dir.join("nbd.sock"), serve.vhost_socket("d")] {
            let meta = std::fs::metadata(&sock).unwrap();
            if group.is_some() {
                assert_eq!((meta.permissions().mode() & 0o777, meta.gid()), (0o660, 65534), "{}", sock.display());
                assert_eq!(nobody_connects(&sock), Ok(true), "a member connects to {}", sock.display());
            } else {
                assert_eq!(nobody_connects(&sock), Ok(false), "another user cannot connect to {}", sock.display());
            }
        }
    }
}

#[test]
fn an_unknown_socket_group_is_refused_naming_the_key() {
    let tmp = TempDir::new("socket-group-unknown");
    let err = refused(
        &tmp,
        "[nbd]\ngroup = \"no-such-group-here\"\n[[device]]\nname = \"d\"\nsize = \"1M\"\n[device.backend]\ntype = \"ram\"\n",
    );
    assert!(err.contains("key `nbd.group`") && err.contains("no group `no-such-group-here`"), "{err}");
}
