//! `serve` is no longer the single point of failure: with `[keeper] enabled`, a `serve` that
//! is killed or upgraded is followed by another that takes over the FUSE session, the NBD
//! listening sockets and the ramdisks, so applications see a pause rather than an error.
//! Skipped where the kernel support is missing, unless BULKHEAD_REQUIRE_KERNEL=1.

#[path = "../common/mod.rs"]
mod common;

use std::io::{Read, Write};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use bulkhead_testkit::{pattern, require_kernel, AlignedBuf};
use common::{exe, fio_verify, tools, Ext4, LoopGuard, Serve, TempDir};

fn config(run_dir: &Path, give_up_ms: u64) -> String {
    let img = run_dir.with_extension("img");
    std::fs::File::create(&img).unwrap().set_len(64 << 20).unwrap();
    format!(
        "[keeper]\nenabled = true\ngive_up_ms = {give_up_ms}\n\n[nbd]\nenabled = true\n\n\
         [[device]]\nname = \"r0\"\nsize = \"256M\"\n[device.backend]\ntype = \"ram\"\n\n\
         [[device]]\nname = \"r1\"\nsize = \"16M\"\n[device.backend]\ntype = \"ram\"\n\n\
         [[device]]\nname = \"f0\"\n[device.backend]\ntype = \"file\"\npath = \"{}\"\n",
        img.display()
    )
}

/// The `serve` the keeper (`keeper`, the process the test started) runs now.
fn serve_pid(keeper: u32) -> Option<u32> {
    let children = std::fs::read_to_string(format!("/proc/{keeper}/task/{keeper}/children")).ok()?;
    children.split_whitespace().next()?.parse().ok()
}

/// The pid of the `serve` answering on `run_dir`'s control socket, if one does.
fn answering(run_dir: &Path) -> Option<u32> {
    let out = Command::new(exe()).args(["status", "--json", "--run-dir"]).arg(run_dir).output().ok()?;
    if !common::answered(&out.status) {
        return None;
    }
    serve_pid_from_hello(run_dir)
}

fn serve_pid_from_hello(run_dir: &Path) -> Option<u32> {
    let mut c = bulkhead_control::Client::connect(run_dir).ok()?;
    c.call(bulkhead_control::Hello {}).ok().map(|h| h.pid)
}

/// Waits until process `pid` has ended (its connections are closed).
fn gone(pid: u32) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| !s.contains(") Z ")) {
        assert!(Instant::now() < deadline, "process {pid} outlived SIGKILL");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Waits until a `serve` other than `old` answers; returns how long that took.
fn wait_for_new_serve(run_dir: &Path, old: u32, since: Instant, log: &dyn Fn() -> String) -> Duration {
    let deadline = since + Duration::from_secs(30);
    loop {
        if let Some(pid) = serve_pid_from_hello(run_dir) {
            if pid != old {
                return since.elapsed();
            }
        }
        assert!(Instant::now() < deadline, "no new serve answered after {old}: {}", log());
        std::thread::sleep(Duration::from_millis(2));
    }
}

fn percentile(sorted: &[Duration], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i].as_secs_f64() * 1e3
}

/// Writes `data` at `offset` of device `dev`'s FUSE file with O_DIRECT and flushes it.
fn write_direct(serve: &Serve, dev: &str, offset: u64, data: &[u8]) {
    let f = std::fs::OpenOptions::new().write(true).custom_flags(libc::O_DIRECT).open(serve.fuse_file(dev)).unwrap();
    f.write_all_at(&AlignedBuf::from_slice(data), offset).unwrap();
    f.sync_all().unwrap();
}

fn read_direct(serve: &Serve, dev: &str, offset: u64, len: usize) -> Vec<u8> {
    let f = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_DIRECT).open(serve.fuse_file(dev)).unwrap();
    let mut buf = AlignedBuf::zeroed(len);
    f.read_exact_at(&mut buf, offset).unwrap();
    buf.to_vec()
}

/// ext4 on a loop device over r0's FUSE file under fio verify while `serve` is ended 20 times
/// by `end` (which returns the pid it ended); each time a new `serve` must take over. Also
/// checks a ramdisk's and a file device's contents written before, and that no request failed.
fn twenty_ends_under_fio(tag: &str, end: impl Fn(&Path, u32) -> u32) {
    let tmp = TempDir::new(tag);
    let run_dir = tmp.path().join("run");
    let serve = Serve::start(&run_dir, Some(&config(&run_dir, 30_000)), &["r0", "r1", "f0"]);
    let keeper = serve.pid();
    let ram = pattern(7, 1 << 20);
    let file = pattern(8, 1 << 20);
    write_direct(&serve, "r1", 3 << 20, &ram);
    write_direct(&serve, "f0", 5 << 20, &file);
    let mut fs = Ext4::make(&serve.fuse_file("r0"), &tmp.path().join("mnt"));
    let mnt = fs.mnt.clone();
    let fio = std::thread::spawn(move || fio_verify(&mnt, "randrw", "4k-64k", "32M", 40));
    std::thread::sleep(Duration::from_secs(2));
    let mut back = Vec::new();
    for i in 0..20 {
        let old = serve_pid(keeper).unwrap_or_else(|| panic!("round {i}: the keeper has no serve: {}", serve.log_text()));
        let since = Instant::now();
        assert_eq!(end(&run_dir, old), old);
        back.push(wait_for_new_serve(&run_dir, old, since, &|| serve.log_text()));
        assert!(answering(&run_dir).is_some());
        std::thread::sleep(Duration::from_millis(700));
    }
    let report = fio.join().unwrap_or_else(|_| panic!("fio failed across the restarts of serve: {}", serve.log_text()));
    assert_eq!(report["jobs"][0]["error"], 0);
    fs.unmount_and_check();
    drop(fs);
    assert_eq!(read_direct(&serve, "r1", 3 << 20, 1 << 20), ram, "the ramdisk's contents changed");
    assert_eq!(read_direct(&serve, "f0", 5 << 20, 1 << 20), file, "the file device's contents changed");
    let st = serve.status_json();
    for d in st["devices"].as_array().unwrap() {
        assert_eq!(d["state"], "running", "{d}");
    }
    back.sort();
    eprintln!(
        "{tag}: 20 times a new serve answered after p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms; fio: {} reads, {} writes, 0 errors",
        percentile(&back, 0.5),
        percentile(&back, 0.99),
        percentile(&back, 1.0),
        report["jobs"][0]["read"]["total_ios"],
        report["jobs"][0]["write"]["total_ios"]
    );
    let log = serve.log_text();
    assert!(!log.contains("panicked"), "{log}");
}

#[test]
fn twenty_kills_of_serve_under_fio_verify_on_ext4_are_pauses() {
    require_kernel!();
    if !tools(&["fio", "mkfs.ext4", "e2fsck", "losetup"]) {
        return;
    }
    twenty_ends_under_fio("keeper-kill", |_, pid| {
        bulkhead_sys::signal(pid, libc::SIGKILL).unwrap();
        pid
    });
}

#[test]
fn twenty_upgrades_under_fio_verify_on_ext4_are_pauses() {
    require_kernel!();
    if !tools(&["fio", "mkfs.ext4", "e2fsck", "losetup"]) {
        return;
    }
    twenty_ends_under_fio("keeper-upgrade", |run_dir, pid| {
        let out = Command::new(exe()).args(["upgrade", "--timeout", "30", "--run-dir"]).arg(run_dir).output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "upgrade: {text}{}", String::from_utf8_lossy(&out.stderr));
        assert!(text.contains(&format!("serve (pid {pid}) is handing over")) && text.contains("is serving"), "{text}");
        pid
    });
}

/// qemu-io driven one command at a time: each answer ends with its prompt.
struct QemuIo {
    child: std::process::Child,
    out: std::process::ChildStdout,
}

const PROMPT: &str = "qemu-io> ";

impl QemuIo {
    fn open(opts: &str) -> QemuIo {
        let mut child = Command::new("qemu-io")
            .args(["--image-opts", opts])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let out = child.stdout.take().unwrap();
        let mut q = QemuIo { child, out };
        q.answer();
        q
    }

    /// What qemu-io writes up to its next prompt (all it wrote, if it ends first).
    fn answer(&mut self) -> String {
        let mut text = Vec::new();
        let mut byte = [0u8; 1];
        while !text.ends_with(PROMPT.as_bytes()) {
            if self.out.read(&mut byte).unwrap() == 0 {
                break;
            }
            text.push(byte[0]);
        }
        String::from_utf8_lossy(&text).trim_end_matches(PROMPT).to_string()
    }

    /// Runs `cmd` and returns its output.
    fn run(&mut self, cmd: &str) -> String {
        let stdin = self.child.stdin.as_mut().unwrap();
        writeln!(stdin, "{cmd}").unwrap();
        stdin.flush().unwrap();
        self.answer()
    }
}

impl Drop for QemuIo {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// An NBD client that never reconnects: one connection, one request at a time.
struct PlainClient {
    sock: std::os::unix::net::UnixStream,
}

impl PlainClient {
    fn connect(sock: &Path, export: &str) -> PlainClient {
        use std::os::fd::AsFd;
        let sock = std::os::unix::net::UnixStream::connect(sock).unwrap();
        bulkhead_nbd::client::handshake(sock.as_fd(), export, Duration::from_secs(10)).unwrap();
        sock.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        PlainClient { sock }
    }

    fn request(&mut self, kind: u16, offset: u64, data: &[u8], len: u32) -> std::io::Result<Vec<u8>> {
        let mut req = Vec::with_capacity(28 + data.len());
        req.extend_from_slice(&bulkhead_nbd::proto::REQUEST_MAGIC.to_be_bytes());
        req.extend_from_slice(&0u16.to_be_bytes());
        req.extend_from_slice(&kind.to_be_bytes());
        req.extend_from_slice(&7u64.to_be_bytes());
        req.extend_from_slice(&offset.to_be_bytes());
        req.extend_from_slice(&len.to_be_bytes());
        req.extend_from_slice(data);
        self.sock.write_all(&req)?;
        let mut reply = [0u8; 16];
        self.sock.read_exact(&mut reply)?;
        assert_eq!(u32::from_be_bytes(reply[..4].try_into().unwrap()), bulkhead_nbd::proto::SIMPLE_REPLY_MAGIC);
        let error = u32::from_be_bytes(reply[4..8].try_into().unwrap());
        if error != 0 {
            return Err(std::io::Error::from_raw_os_error(error as i32));
        }
        let mut got = vec![0u8; if kind == 0 { len as usize } else { 0 }];
        self.sock.read_exact(&mut got)?;
        Ok(got)
    }

    fn write(&mut self, offset: u64, data: &[u8]) -> std::io::Result<()> {
        self.request(1, offset, data, data.len() as u32).map(drop)
    }

    fn read(&mut self, offset: u64, len: u32) -> std::io::Result<Vec<u8>> {
        self.request(0, offset, &[], len)
    }
}

#[test]
fn an_nbd_client_that_reconnects_rides_through_a_crash_of_serve_and_one_that_does_not_is_cut_off_cleanly() {
    require_kernel!();
    if !tools(&["qemu-io"]) {
        return;
    }
    let tmp = TempDir::new("keeper-nbd");
    let run_dir = tmp.path().join("run");
    let serve = Serve::start(&run_dir, Some(&config(&run_dir, 30_000)), &["r0", "r1", "f0"]);
    let sock = run_dir.join("nbd.sock");
    // qemu's NBD client, told to wait up to 20 s for its server to come back.
    let mut patient =
        QemuIo::open(&format!("driver=nbd,server.type=unix,server.path={},export=r1,reconnect-delay=20", sock.display()));
    let mut plain = PlainClient::connect(&sock, "r1");
    let out = patient.run("write -P 0x5a 0 64k");
    assert!(out.contains("wrote 65536/65536"), "{out}");
    plain.write(1 << 20, &[0x3c; 65536]).unwrap();
    let old = serve_pid(serve.pid()).unwrap();
    bulkhead_sys::signal(old, libc::SIGKILL).unwrap();
    gone(old);
    // qemu's request is made while serve is down: it waits, and is served after.
    let out = patient.run("read -P 0x5a 0 64k");
    assert!(out.contains("read 65536/65536"), "the reconnecting client: {out}\n{}", serve.log_text());
    let out = patient.run("write -P 0x77 2M 64k");
    assert!(out.contains("wrote 65536/65536"), "the reconnecting client: {out}");
    wait_for_new_serve(&run_dir, old, Instant::now(), &|| serve.log_text());
    // The client that does not reconnect finds its connection closed; it does not hang.
    let err = plain.read(1 << 20, 65536).expect_err("a read through a dead serve's connection");
    assert!(
        matches!(
            err.kind(),
            std::io::ErrorKind::UnexpectedEof | std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::BrokenPipe
        ),
        "{err}"
    );
    // Nothing else broke: a new connection reads what each wrote, and so does FUSE.
    let mut again = PlainClient::connect(&sock, "r1");
    assert_eq!(again.read(1 << 20, 65536).unwrap(), vec![0x3c; 65536]);
    assert_eq!(read_direct(&serve, "r1", 0, 65536), vec![0x5a; 65536]);
    assert_eq!(read_direct(&serve, "r1", 2 << 20, 65536), vec![0x77; 65536]);
    eprintln!("qemu-io reconnected across the crash of serve {old}; the plain client was cut off ({err})");
}

#[test]
fn a_killed_keeper_stops_serve_cleanly_and_a_serve_that_never_returns_ends_the_connection() {
    require_kernel!();
    let tmp = TempDir::new("keeper-gone");
    // The keeper is killed: its serve shuts down cleanly (nothing could survive its crash now).
    let run_dir = tmp.path().join("run");
    let mut serve = Serve::start(&run_dir, Some(&config(&run_dir, 30_000)), &["r0"]);
    let keeper = serve.pid();
    let child = serve_pid(keeper).unwrap();
    let mut c = serve.child.0.take().unwrap();
    c.kill().unwrap();
    c.wait().unwrap();
    let deadline = Instant::now() + Duration::from_secs(15);
    while Path::new(&format!("/proc/{child}")).exists() {
        assert!(Instant::now() < deadline, "serve outlived its keeper: {}", serve.log_text());
        std::thread::sleep(Duration::from_millis(20));
    }
    let log = serve.log_text();
    assert!(log.contains("the keeper") && log.contains("has died") && log.contains("stopped"), "{log}");
    assert!(!std::fs::read_to_string("/proc/self/mountinfo").unwrap().contains(run_dir.to_str().unwrap()), "a mount is left");
    drop(serve);

    // A serve that never comes back (it dies at every start, and its binary is gone, so the
    // one the keeper falls back on dies too): the keeper gives up after `give_up_ms`, the
    // FUSE connection ends, and the loop device's reads fail instead of hanging.
    let bin = tmp.path().join("bulkhead-copy");
    std::fs::copy(exe(), &bin).unwrap();
    let run_dir = tmp.path().join("run2");
    let log_path = run_dir.with_extension("log");
    let _left = FuseLeft(run_dir.join("fuse"));
    let mut keeper = start_keeper(&bin, &run_dir, &config(&run_dir, 1500), &log_path);
    let deadline = Instant::now() + Duration::from_secs(20);
    let first = loop {
        if let Some(pid) = serve_pid_from_hello(&run_dir) {
            break pid;
        }
        assert!(Instant::now() < deadline, "{}", std::fs::read_to_string(&log_path).unwrap_or_default());
        std::thread::sleep(Duration::from_millis(20));
    };
    let lo = LoopGuard::attach_direct(&run_dir.join("fuse").join("r0"));
    let kpid = keeper.0.as_ref().unwrap().id();
    std::fs::remove_file(&bin).unwrap();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let killer = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                if let Some(child) = serve_pid(kpid) {
                    let _ = bulkhead_sys::signal(child, libc::SIGKILL);
                }
                std::thread::sleep(Duration::from_millis(2));
            }
        })
    };
    // The serve that answered first is gone before the first read: a read it took would
    // succeed.
    let deadline = Instant::now() + Duration::from_secs(20);
    while Path::new(&format!("/proc/{first}")).exists() {
        assert!(Instant::now() < deadline, "serve {first} was not killed");
        std::thread::sleep(Duration::from_millis(2));
    }
    let started = Instant::now();
    // A serve the keeper starts again may answer a read in the few milliseconds before the
    // killer finds it; once the keeper gives up, every read fails, and none ever hangs.
    let deadline = Instant::now() + Duration::from_secs(20);
    let err = loop {
        let mut dd = Command::new("dd")
            .args([&format!("if={}", lo.dev), "of=/dev/null", "bs=4k", "count=1", "skip=77", "iflag=direct", "status=none"])
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let status = loop {
            if let Some(s) = dd.try_wait().unwrap() {
                break s;
            }
            assert!(Instant::now() < deadline, "a read hung after the keeper should have given up");
            std::thread::sleep(Duration::from_millis(20));
        };
        let mut err = String::new();
        dd.stderr.take().unwrap().read_to_string(&mut err).unwrap();
        if !status.success() {
            break err;
        }
        assert!(Instant::now() < deadline, "reads still succeed 20 s after the keeper should have given up");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(err.contains("Input/output error"), "{err}");
    let waited = started.elapsed();
    let kst = keeper.0.as_mut().unwrap().wait().unwrap();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    killer.join().unwrap();
    assert!(!kst.success());
    let log = std::fs::read_to_string(&log_path).unwrap();
    assert!(log.contains("no serve has come back within 1.5 s") && log.contains("ending the FUSE connection"), "{log}");
    assert!(!std::fs::read_to_string("/proc/self/mountinfo").unwrap().contains(run_dir.to_str().unwrap()), "a mount is left");
    assert!(waited >= Duration::from_millis(1000), "the read failed before the keeper gave up: {waited:?}");
    drop(lo);
    keeper.0 = None;
}

/// The FUSE mount of a run directory, lazily unmounted on drop if still there: a keeper a
/// failing test kills leaves it behind. Declared before the keeper's guard, so dropped after.
struct FuseLeft(PathBuf);

impl Drop for FuseLeft {
    fn drop(&mut self) {
        if std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default().contains(self.0.to_str().unwrap()) {
            let _ = Command::new("umount").arg("-l").arg(&self.0).status();
        }
    }
}

/// Starts `bin serve` as a keeper on `run_dir` with `config`, logging to `log`, and waits until
/// its serve answers.
fn start_keeper(bin: &Path, run_dir: &Path, config: &str, log: &Path) -> common::ChildGuard {
    std::fs::write(run_dir.with_extension("toml"), config).unwrap();
    let keeper = common::ChildGuard(Some(
        Command::new(bin)
            .args(["serve", "--run-dir"])
            .arg(run_dir)
            .arg("--config")
            .arg(run_dir.with_extension("toml"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(log).unwrap())
            .spawn()
            .unwrap(),
    ));
    let deadline = Instant::now() + Duration::from_secs(20);
    while serve_pid_from_hello(run_dir).is_none() {
        assert!(Instant::now() < deadline, "{}", std::fs::read_to_string(log).unwrap_or_default());
        std::thread::sleep(Duration::from_millis(20));
    }
    keeper
}

/// Puts `content` at `path` as a new file, as a package manager replaces a binary.
fn replace_binary(path: &Path, content: &[u8]) {
    use std::os::unix::fs::PermissionsExt;
    let new = path.with_extension("new");
    std::fs::write(&new, content).unwrap();
    std::fs::set_permissions(&new, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::rename(&new, path).unwrap();
}

#[test]
fn an_upgrade_to_a_binary_that_does_not_start_falls_back_to_the_one_that_was_serving() {
    require_kernel!();
    let tmp = TempDir::new("keeper-fallback");
    let bin = tmp.path().join("bulkhead");
    std::fs::copy(exe(), &bin).unwrap();
    let run_dir = tmp.path().join("run");
    let log_path = run_dir.with_extension("log");
    let _left = FuseLeft(run_dir.join("fuse"));
    let mut keeper = start_keeper(&bin, &run_dir, &config(&run_dir, 4000), &log_path);
    let log = || std::fs::read_to_string(&log_path).unwrap_or_default();
    // One open of the FUSE file across everything: no upgrade makes its user reopen it.
    let file = std::fs::OpenOptions::new().read(true).write(true).open(run_dir.join("fuse").join("r1")).unwrap();
    let data = pattern(58, 1 << 20);
    file.write_all_at(&data, 0).unwrap();
    file.sync_all().unwrap();
    let upgrade = || {
        let started = Instant::now();
        let out = Command::new(exe()).args(["upgrade", "--timeout", "30", "--run-dir"]).arg(&run_dir).output().unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stderr).into_owned() + &String::from_utf8_lossy(&out.stdout),
            started.elapsed(),
        )
    };
    let hello = || {
        let mut c = bulkhead_control::Client::connect(&run_dir).unwrap();
        c.call(bulkhead_control::Hello {}).unwrap()
    };

    // A binary that exits at once.
    let before = hello().pid;
    replace_binary(&bin, b"#!/bin/sh\nexit 3\n");
    let (ok, out, took) = upgrade();
    assert!(!ok, "an upgrade to a broken binary said it worked: {out}");
    assert!(out.contains("the upgrade failed") && out.contains("exited with status 3 before it was serving"), "{out}\n{}", log());
    let h = hello();
    assert_ne!(h.pid, before);
    assert!(h.fell_back.as_deref().is_some_and(|w| w.contains("exited with status 3")), "{h:?}");
    let mut back = vec![0u8; data.len()];
    file.read_exact_at(&mut back, 0).unwrap();
    assert!(back == data, "the ram device lost its contents across a failed upgrade");
    eprintln!("a binary that exits: back on the previous one after {} ms", took.as_millis());

    // A binary that hangs: ended after half of give_up_ms (2 s), then the same.
    let before = h.pid;
    replace_binary(&bin, b"#!/bin/sh\nexec sleep 600\n");
    let (ok, out, took) = upgrade();
    assert!(!ok, "an upgrade to a hanging binary said it worked: {out}");
    assert!(out.contains("was not serving in time"), "{out}");
    assert!(took >= Duration::from_secs(2) && took < Duration::from_secs(4), "{took:?}: {}", log());
    let h = hello();
    assert_ne!(h.pid, before);
    file.read_exact_at(&mut back, 0).unwrap();
    assert!(back == data, "the ram device lost its contents across a failed upgrade");
    let l = log();
    assert!(l.contains("is not serving after 2.0 s; ending it"), "{l}");
    assert_eq!(serve_pid(keeper.0.as_ref().unwrap().id()), Some(h.pid), "the hanging binary outlived its end");

    // The real binary again: the upgrade works, and nothing says it fell back.
    replace_binary(&bin, &std::fs::read(exe()).unwrap());
    let (ok, out, _) = upgrade();
    assert!(ok, "{out}\n{}", log());
    assert!(hello().fell_back.is_none());
    file.write_all_at(&data[..4096], 1 << 20).unwrap();
    file.read_exact_at(&mut back, 0).unwrap();
    assert!(back == data);
    drop(file);
    // The keeper, asked to stop, stops its serve and ends cleanly.
    let k = keeper.0.as_ref().unwrap().id();
    bulkhead_sys::signal(k, libc::SIGTERM).unwrap();
    let st = keeper.0.as_mut().unwrap().wait().unwrap();
    assert!(st.success(), "{}", log());
    keeper.0 = None;
    assert!(!std::fs::read_to_string("/proc/self/mountinfo").unwrap().contains(run_dir.to_str().unwrap()), "a mount is left");
}
