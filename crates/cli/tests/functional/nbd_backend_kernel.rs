//! The `nbd` backend against real servers: nbdkit, qemu-nbd, and a bulkhead export running on a
//! second host (a network namespace joined by veth, over TCP). Reconnects when the server
//! goes away and comes back; fails the device, clearly, when it stays away.

#[path = "../common/mod.rs"]
mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use bulkhead_testkit::require_kernel;
use common::*;

/// Runs a command under a time limit; `Ok(stdout)` or `Err(stdout + stderr)`.
fn try_sh(cmd: &str, args: &[&str], secs: u32) -> Result<String, String> {
    let out = Command::new("timeout").args(["--kill-after=5", &secs.to_string(), cmd]).args(args).output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    if out.status.success() {
        Ok(text)
    } else {
        Err(text)
    }
}

fn sh(cmd: &str, args: &[&str]) -> String {
    try_sh(cmd, args, 60).unwrap_or_else(|e| panic!("{cmd} {args:?}: {e}"))
}

/// Writes `count` blocks of `bs` (a dd size) of pattern `seed` at block `at` of a loop device
/// over `fuse_file` with direct I/O, reads them back the same way, and says whether they match.
fn direct_round_trip(tmp: &std::path::Path, fuse_file: &std::path::Path, bs: &str, at: u64, count: u64, seed: u64) -> bool {
    let block = bs.trim_end_matches('M').parse::<usize>().unwrap() << 20;
    let lo = LoopGuard::attach_direct(fuse_file);
    let data = pattern(seed, block * count as usize);
    let (src, back) = (tmp.join("src"), tmp.join("back"));
    std::fs::write(&src, &data).unwrap();
    let (bs, seek, skip, count) = (format!("bs={bs}"), format!("seek={at}"), format!("skip={at}"), format!("count={count}"));
    let (inf, of) = (format!("if={}", src.display()), format!("of={}", lo.dev));
    sh("dd", &[&inf, &of, &bs, &seek, "oflag=direct", "status=none"]);
    let (inf, of) = (format!("if={}", lo.dev), format!("of={}", back.display()));
    sh("dd", &[&inf, &of, &bs, &skip, &count, "iflag=direct", "status=none"]);
    std::fs::read(&back).unwrap() == data
}

/// qemu-io commands against an NBD URI; panics unless all succeed.
fn qemu_io(uri: &str, cmds: &[&str]) -> String {
    let mut args = vec!["-f", "raw"];
    for c in cmds {
        args.extend(["-c", c]);
    }
    args.push(uri);
    let out = sh("qemu-io", &args);
    assert!(!out.contains("Pattern verification failed") && !out.contains("failed:"), "qemu-io {cmds:?}: {out}");
    out
}

/// A server process (nbdkit, qemu-nbd, serve in a namespace): SIGTERM, then SIGKILL, on drop.
struct Server {
    child: Option<Child>,
    socket: PathBuf,
}

impl Server {
    fn spawn(cmd: &mut Command, socket: &Path) -> Server {
        let _ = std::fs::remove_file(socket);
        let child = cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap();
        let s = Server { child: Some(child), socket: socket.to_path_buf() };
        let deadline = Instant::now() + Duration::from_secs(20);
        while std::os::unix::net::UnixStream::connect(socket).is_err() {
            assert!(Instant::now() < deadline, "server on {} did not come up", socket.display());
            std::thread::sleep(Duration::from_millis(20));
        }
        s
    }

    fn nbdkit(socket: &Path, plugin_args: &[&str]) -> Server {
        let mut c = Command::new("nbdkit");
        c.args(["--foreground", "--exit-with-parent", "--unix"]).arg(socket).args(plugin_args);
        Server::spawn(&mut c, socket)
    }

    /// Kills the server and removes its socket (once: a later server may own that path).
    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
            let _ = std::fs::remove_file(&self.socket);
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(c) = &mut self.child {
            // SAFETY: signalling our own child.
            unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
            let deadline = Instant::now() + Duration::from_secs(10);
            while Instant::now() < deadline && !matches!(c.try_wait(), Ok(Some(_))) {
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        self.kill();
    }
}

fn unix_uri(socket: &Path, export: &str) -> String {
    format!("nbd+unix:///{export}?socket={}", socket.display())
}

fn nbd_device(name: &str, uri: &str, extra: &str) -> String {
    format!("[[device]]\nname = \"{name}\"\nqueues = 2\n{extra}\n[device.backend]\ntype = \"nbd\"\nuri = \"{uri}\"\n")
}

fn wait_state(serve: &Serve, want: &str, within: Duration) -> serde_json::Value {
    let deadline = Instant::now() + within;
    loop {
        let st = serve.status_json();
        if st["devices"][0]["state"] == want {
            return st;
        }
        assert!(Instant::now() < deadline, "device never turned {want}: {st}\n{}", serve.log_text());
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn nbd_backend_serves_a_device_from_nbdkit() {
    require_kernel!();
    if !tools(&["nbdkit", "qemu-io"]) {
        return;
    }
    let tmp = TempDir::new("nbdb-nbdkit");
    let sock = tmp.path().join("nbdkit.sock");
    let _kit = Server::nbdkit(&sock, &["memory", "64M"]);
    let run = tmp.path().join("run");
    let serve = Serve::start(&run, Some(&nbd_device("r", &unix_uri(&sock, ""), "")), &["r"]);
    let st = serve.status_json();
    let d = &st["devices"][0];
    assert_eq!(d["size_bytes"], 64 << 20, "size probed from the export: {st}");
    assert!(d["backend"].as_str().unwrap().starts_with("nbd:nbd+unix://"), "{st}");
    assert_eq!(d["sandbox"]["seccomp_role"], "network", "{st}");

    // Through bulkhead's own export: NBD client → frontend → channel → domain → nbdkit.
    let ours = unix_uri(&run.join("nbd.sock"), "r");
    qemu_io(&ours, &["write -P 0x5a 0 1M", "write -P 0xa5 1048577 70000", "write -z 4M 1M", "write -P 0x3c -f 8M 64k", "flush"]);
    qemu_io(&ours, &["read -P 0x5a 0 1M", "read -P 0xa5 1048577 70000", "read -P 0 4M 1M", "read -P 0x3c 8M 64k"]);
    // The bytes live on the remote server: read them there directly.
    qemu_io(&unix_uri(&sock, ""), &["read -P 0x5a 0 1M", "read -P 0xa5 1048577 70000", "read -P 0x3c 8M 64k"]);

    // And through the kernel: FUSE file → loop device with direct I/O, 4 MiB requests.
    assert!(
        direct_round_trip(tmp.path(), &serve.fuse_file("r"), "4M", 4, 2, 31),
        "4 MiB direct I/O through the nbd backend differs"
    );
    let st = serve.status_json();
    assert_eq!(st["devices"][0]["restarts"], 0, "{st}");
    assert_eq!(st["devices"][0]["requests_failed"], 0, "{st}");
}

#[test]
fn nbd_backend_writes_reach_a_qemu_nbd_image_file() {
    require_kernel!();
    if !tools(&["qemu-nbd", "qemu-io"]) {
        return;
    }
    let tmp = TempDir::new("nbdb-qemu");
    let img = tmp.path().join("disk.img");
    std::fs::File::create(&img).unwrap().set_len(64 << 20).unwrap();
    let sock = tmp.path().join("qemu.sock");
    let mut c = Command::new("qemu-nbd");
    c.args(["--persistent", "--shared=4", "--format=raw", "--export-name=vm", "--socket"]).arg(&sock).arg(&img);
    let _q = Server::spawn(&mut c, &sock);
    let run = tmp.path().join("run");
    // A device smaller than the export is allowed.
    let mut serve = Serve::start(&run, Some(&nbd_device("q", &unix_uri(&sock, "vm"), "size = \"32M\"")), &[]);
    assert_eq!(serve.status_json()["devices"][0]["size_bytes"], 32 << 20);
    let ours = unix_uri(&run.join("nbd.sock"), "q");
    qemu_io(&ours, &["write -P 0x11 4096 3M", "write -P 0x22 -f 20M 512", "write -z 4096 4096", "discard 8M 1M", "flush"]);
    qemu_io(&ours, &["read -P 0x11 8192 2M", "read -P 0 4096 4096", "read -P 0x22 20M 512"]);
    // Past the device's end (but inside the export) is refused.
    assert!(try_sh("qemu-io", &["-f", "raw", "-c", "read 32M 4k", &ours], 30).is_err());
    assert!(serve.stop().success(), "{}", serve.log_text());
    // The image file itself holds what was written.
    let bytes = std::fs::read(&img).unwrap();
    assert!(bytes[8192..8192 + (2 << 20)].iter().all(|&b| b == 0x11));
    assert!(bytes[4096..8192].iter().all(|&b| b == 0));
    assert!(bytes[20 << 20..(20 << 20) + 512].iter().all(|&b| b == 0x22));
}

#[test]
fn nbd_backend_bad_targets_are_clear_errors() {
    require_kernel!();
    if !tools(&["nbdkit"]) {
        return;
    }
    let tmp = TempDir::new("nbdb-bad");
    let cfg = tmp.path().join("c.toml");
    let serve = |config: &str| {
        std::fs::write(&cfg, config).unwrap();
        let out = Command::new("timeout")
            .args(["30", exe(), "serve", "--run-dir"])
            .arg(tmp.path().join("run"))
            .arg("--config")
            .arg(&cfg)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(1), "{out:?}");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let missing = tmp.path().join("nobody.sock");
    let e = serve(&nbd_device("r", &unix_uri(&missing, ""), ""));
    assert!(e.contains("cannot connect to") && e.contains("nobody.sock"), "{e}");
    let sock = tmp.path().join("kit.sock");
    let _kit = Server::nbdkit(&sock, &["memory", "16M"]);
    let e = serve(&nbd_device("r", &unix_uri(&sock, ""), "size = \"32M\""));
    assert!(e.contains("exceeds the 16777216 bytes"), "{e}");
    let e = serve(&nbd_device("r", "nbd://127.0.0.1:1/x", "[device.backend.x]"));
    assert!(e.contains("line"), "{e}");
}

#[test]
fn nbd_backend_reconnects_when_the_server_restarts_and_loses_no_write() {
    require_kernel!();
    if !tools(&["nbdkit", "qemu-io"]) {
        return;
    }
    let tmp = TempDir::new("nbdb-reconnect");
    let img = tmp.path().join("disk.img");
    std::fs::File::create(&img).unwrap().set_len(32 << 20).unwrap();
    let sock = tmp.path().join("kit.sock");
    let img_arg = format!("file={}", img.display());
    let mut kit = Server::nbdkit(&sock, &["file", &img_arg]);
    let run = tmp.path().join("run");
    let serve = Serve::start(&run, Some(&nbd_device("r", &unix_uri(&sock, ""), "")), &[]);
    let ours = unix_uri(&run.join("nbd.sock"), "r");
    qemu_io(&ours, &["write -P 0x01 0 1M", "flush"]);

    for round in 0..3u8 {
        // The server dies; a write issued while it is down waits for it to come back.
        kit.kill();
        let u = ours.clone();
        let pat = format!("write -P {:#x} {}M 1M", 0x10 + round, 2 + round);
        let writer = std::thread::spawn(move || qemu_io(&u, &[&pat, "flush"]));
        std::thread::sleep(Duration::from_millis(800));
        assert!(!writer.is_finished(), "a write cannot complete with the server down");
        let st = serve.status_json();
        assert_eq!(st["devices"][0]["state"], "reconnecting", "{st}");
        kit = Server::nbdkit(&sock, &["file", &img_arg]);
        if writer.join().is_err() {
            panic!("round {round}: the write did not complete once the server was back:\n{}", serve.log_text());
        }
        wait_state(&serve, "running", Duration::from_secs(10));
    }
    qemu_io(&ours, &["read -P 0x01 0 1M", "read -P 0x10 2M 1M", "read -P 0x11 3M 1M", "read -P 0x12 4M 1M"]);
    let st = serve.status_json();
    assert!(st["devices"][0]["restarts"].as_u64().unwrap() >= 3, "{st}");
    assert_eq!(st["devices"][0]["requests_failed"], 0, "{st}");
    let log = serve.log_text();
    assert!(log.contains("lost its remote server") && log.contains("reconnected after"), "{log}");
    drop(kit);
    let bytes = std::fs::read(&img).unwrap();
    assert!(bytes[3 << 20..4 << 20].iter().all(|&b| b == 0x11), "the write made while the server was down reached it");
}

#[test]
fn nbd_backend_fails_after_the_reconnect_timeout_and_restart_revives_it() {
    require_kernel!();
    if !tools(&["nbdkit", "qemu-io"]) {
        return;
    }
    let tmp = TempDir::new("nbdb-timeout");
    let sock = tmp.path().join("kit.sock");
    let mut kit = Server::nbdkit(&sock, &["memory", "16M"]);
    let run = tmp.path().join("run");
    let cfg = nbd_device("r", &unix_uri(&sock, ""), "").replace("type = \"nbd\"", "type = \"nbd\"\nreconnect_timeout_ms = 1000");
    let serve = Serve::start(&run, Some(&cfg), &[]);
    let ours = unix_uri(&run.join("nbd.sock"), "r");
    qemu_io(&ours, &["write -P 0x77 0 64k"]);
    kit.kill();
    let t0 = Instant::now();
    let r = try_sh("qemu-io", &["-f", "raw", "-c", "read 0 64k", &ours], 30);
    assert!(r.is_err(), "a read with the server gone for good fails: {r:?}");
    assert!(t0.elapsed() < Duration::from_secs(15), "and fails promptly ({:?})", t0.elapsed());
    let st = wait_state(&serve, "failed", Duration::from_secs(5));
    let why = st["devices"][0]["failure"].as_str().unwrap();
    assert!(why.contains("no connection for 1000 ms") && why.contains("bulkhead device restart r"), "{why}");
    // The server comes back; `bulkhead device restart` brings the device back.
    let _kit = Server::nbdkit(&sock, &["memory", "16M"]);
    let out = Command::new(exe()).args(["device", "restart", "r", "--run-dir"]).arg(&run).output().unwrap();
    assert!(out.status.success(), "{out:?}");
    wait_state(&serve, "running", Duration::from_secs(5));
    qemu_io(&ours, &["write -P 0x78 0 64k", "read -P 0x78 0 64k"]);
}

#[test]
fn nbd_backend_reaches_a_bulkhead_export_on_a_second_host_over_tcp() {
    require_kernel!();
    if !tools(&["ip", "qemu-io"]) {
        return;
    }
    let Some(ns) = common::netns::NetNs::create() else { return };
    let tmp = TempDir::new("nbdb-netns");
    // The remote host: bulkhead serve inside the namespace, exporting a ram device on TCP.
    let remote_run = tmp.path().join("remote");
    let remote_cfg = tmp.path().join("remote.toml");
    std::fs::write(
        &remote_cfg,
        format!(
            "[fuse]\nenabled = false\n[nbd]\ntcp = \"{}:10809\"\n\
             [[device]]\nname = \"remote0\"\nsize = \"64M\"\n[device.backend]\ntype = \"ram\"\n",
            ns.peer_ip
        ),
    )
    .unwrap();
    let mut c = Command::new("ip");
    c.args(["netns", "exec", &ns.name, exe(), "serve", "--run-dir"]).arg(&remote_run).arg("--config").arg(&remote_cfg);
    let _remote = Server::spawn(&mut c, &remote_run.join("nbd.sock"));

    // This host: a device whose driver domain speaks TCP to the other one.
    let run = tmp.path().join("local");
    let uri = format!("nbd://{}:10809/remote0", ns.peer_ip);
    let serve = Serve::start(&run, Some(&nbd_device("far", &uri, "")), &["far"]);
    let st = serve.status_json();
    assert_eq!(st["devices"][0]["size_bytes"], 64 << 20, "{st}");
    let ours = unix_uri(&run.join("nbd.sock"), "far");
    qemu_io(&ours, &["write -P 0x42 0 4M", "write -P 0x43 6291457 12345", "flush"]);
    qemu_io(&ours, &["read -P 0x42 0 4M", "read -P 0x43 6291457 12345"]);
    // The remote host holds the data: read it there, over its own unix socket.
    qemu_io(&unix_uri(&remote_run.join("nbd.sock"), "remote0"), &["read -P 0x42 0 4M", "read -P 0x43 6291457 12345"]);
    // And this host's kernel sees it as a block device.
    assert!(
        direct_round_trip(tmp.path(), &serve.fuse_file("far"), "1M", 20, 1, 5),
        "1 MiB direct I/O through the remote device differs"
    );
    let st = serve.status_json();
    assert_eq!(st["devices"][0]["requests_failed"], 0, "{st}");
}
