//! Helpers for tests that run `bulkhead serve` for real.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[allow(unused_imports)] // each test file uses a different subset
pub use bulkhead_testkit::kernel::{run, ChildGuard, LoopGuard, MountGuard};

pub mod ceph;
pub mod netns;

pub fn exe() -> &'static str {
    env!("CARGO_BIN_EXE_bulkhead")
}

/// `bulkhead-bench`, beside `bulkhead` in the target directory (where it finds the `bulkhead`
/// it runs): a package of its own, built here if this test run did not build it (a run of this
/// package's tests alone).
pub fn bench_exe() -> &'static str {
    static BUILT: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    BUILT.get_or_init(|| {
        let path = Path::new(exe()).with_file_name("bulkhead-bench");
        if !path.is_file() {
            let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
            let profile = if path.parent().is_some_and(|d| d.ends_with("release")) { "release" } else { "dev" };
            let built = Command::new(cargo)
                .args(["build", "--locked", "-q", "-p", "bulkhead-bench", "--profile", profile])
                .current_dir(env!("CARGO_MANIFEST_DIR"))
                .status()
                .expect("cargo");
            assert!(built.success() && path.is_file(), "cannot build bulkhead-bench at {}", path.display());
        }
        path.to_str().expect("a UTF-8 path").to_string()
    })
}

/// A fresh directory under /tmp, removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> Self {
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos();
        let p = std::env::temp_dir().join(format!("bulkhead-test-{tag}-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A running `bulkhead serve`; stopped with SIGTERM (then SIGKILL and a lazy unmount) on drop.
pub struct Serve {
    pub child: ChildGuard,
    pub run_dir: PathBuf,
    pub log: PathBuf,
}

impl Serve {
    /// Starts serve with `config` (TOML text) or the embedded default, and waits until every
    /// device named in `devices` has its FUSE file.
    pub fn start(run_dir: &Path, config: Option<&str>, devices: &[&str]) -> Serve {
        Self::start_with_env(run_dir, config, devices, &[])
    }

    /// As [`start`](Self::start), with extra environment variables for serve and its domains.
    pub fn start_with_env(run_dir: &Path, config: Option<&str>, devices: &[&str], env: &[(&str, &str)]) -> Serve {
        Self::spawn(run_dir, config, devices, env, None)
    }

    /// As [`start_with_env`](Self::start_with_env), with domains run by the test driver
    /// (`bulkhead-test-driver`: hostile and escape-probe modes chosen by `BULKHEAD_TEST_FAULT`
    /// in `env`). `None` (the test skips) when the test driver was not built, which fails
    /// the test where the kernel tests are required.
    pub fn start_test_driver(run_dir: &Path, config: Option<&str>, devices: &[&str], env: &[(&str, &str)]) -> Option<Serve> {
        let driver = Self::test_driver()?;
        Some(Self::spawn(run_dir, config, devices, env, Some(driver)))
    }

    /// The test driver's path, or `None` (the test skips) as for
    /// [`start_test_driver`](Self::start_test_driver).
    pub fn test_driver() -> Option<&'static Path> {
        let Some(driver) = option_env!("CARGO_BIN_EXE_bulkhead-test-driver") else {
            assert!(
                std::env::var("BULKHEAD_REQUIRE_KERNEL").as_deref() != Ok("1"),
                "the test driver is required: build with --features bulkhead/test-driver"
            );
            eprintln!("SKIP: bulkhead-test-driver not built (--features bulkhead/test-driver)");
            return None;
        };
        Some(Path::new(driver))
    }

    /// As [`start_with_env`](Self::start_with_env), waiting for the FUSE files of `devices`,
    /// in network namespace `netns` (made by `ip netns add`; serve's mounts stay in the host's
    /// mount namespace), with the test driver if `test_driver` (`None`: not built; skip).
    #[allow(dead_code)]
    pub fn start_in_netns(
        run_dir: &Path,
        config: &str,
        devices: &[&str],
        env: &[(&str, &str)],
        netns: &str,
        test_driver: bool,
    ) -> Option<Serve> {
        let driver = if test_driver { Some(Self::test_driver()?) } else { None };
        Some(Self::spawn_in(run_dir, Some(config), devices, env, driver, Some(netns)))
    }

    fn spawn(run_dir: &Path, config: Option<&str>, devices: &[&str], env: &[(&str, &str)], driver: Option<&Path>) -> Serve {
        Self::spawn_in(run_dir, config, devices, env, driver, None)
    }

    fn spawn_in(
        run_dir: &Path,
        config: Option<&str>,
        devices: &[&str],
        env: &[(&str, &str)],
        driver: Option<&Path>,
        netns: Option<&str>,
    ) -> Serve {
        let log = run_dir.with_extension("log");
        // The test build is the whole of `bulkhead`: its `serve` runs its own domains.
        let program = driver.unwrap_or(Path::new(exe()));
        // nsenter execs serve in place: the child is serve itself.
        let mut cmd = match netns {
            Some(ns) => {
                let mut c = Command::new("nsenter");
                c.arg(format!("--net=/run/netns/{ns}")).arg(program);
                c
            }
            None => Command::new(program),
        };
        cmd.envs(env.iter().copied());
        cmd.arg("serve").arg("--run-dir").arg(run_dir);
        if let Some(text) = config {
            let path = run_dir.with_extension("toml");
            std::fs::write(&path, text).unwrap();
            cmd.arg("--config").arg(path);
        }
        let child = cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(std::fs::File::create(&log).unwrap()).spawn().unwrap();
        let mut s = Serve { child: ChildGuard(Some(child)), run_dir: run_dir.to_path_buf(), log };
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let ready = run_dir.join("control.sock").exists() && devices.iter().all(|d| run_dir.join("fuse").join(d).exists());
            if ready {
                break;
            }
            if let Some(c) = s.child.0.as_mut() {
                if let Ok(Some(st)) = c.try_wait() {
                    panic!("serve exited early ({st}): {}", std::fs::read_to_string(&s.log).unwrap_or_default());
                }
            }
            assert!(Instant::now() < deadline, "serve did not become ready: {}", s.log_text());
            std::thread::sleep(Duration::from_millis(20));
        }
        s
    }

    pub fn fuse_file(&self, dev: &str) -> PathBuf {
        self.run_dir.join("fuse").join(dev)
    }

    /// Waits for the vhost-user socket of `name` and returns its path.
    #[allow(dead_code)]
    pub fn vhost_socket(&self, name: &str) -> PathBuf {
        let p = self.run_dir.join("vhost").join(format!("{name}.sock"));
        let deadline = Instant::now() + Duration::from_secs(10);
        while !p.exists() {
            assert!(Instant::now() < deadline, "no socket {}: {}", p.display(), self.log_text());
            std::thread::sleep(Duration::from_millis(20));
        }
        p
    }

    /// Waits for the NBD export's unix socket and returns the URI of `export` on it.
    #[allow(dead_code)]
    pub fn nbd_uri(&self, export: &str) -> String {
        let sock = self.run_dir.join("nbd.sock");
        let deadline = Instant::now() + Duration::from_secs(10);
        while !sock.exists() {
            assert!(Instant::now() < deadline, "no nbd.sock: {}", self.log_text());
            std::thread::sleep(Duration::from_millis(20));
        }
        format!("nbd+unix:///{export}?socket={}", sock.display())
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn status_json(&self) -> serde_json::Value {
        let out = Command::new(exe()).args(["status", "--json", "--run-dir"]).arg(&self.run_dir).output().unwrap();
        // 0 to 2 say the devices' health; 3 that no serve answered.
        assert!(answered(&out.status), "status failed: {}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice(&out.stdout).unwrap()
    }

    /// Waits until every spare domain `serve` wants is ready; returns the spares' status.
    #[allow(dead_code)]
    pub fn spares_ready(&self) -> serde_json::Value {
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            let sp = self.status_json()["spares"].clone();
            let wanted = sp["wanted"].as_u64().unwrap();
            if wanted > 0 && sp["ready"].as_array().unwrap().len() as u64 == wanted {
                return sp;
            }
            assert!(Instant::now() < deadline, "spares never ready: {sp}\n{}", self.log_text());
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The pids of the spare domains waiting now.
    #[allow(dead_code)]
    pub fn spare_pids(&self) -> Vec<u32> {
        let st = self.status_json();
        st["spares"]["ready"].as_array().unwrap().iter().map(|p| p["pid"].as_u64().unwrap() as u32).collect()
    }

    pub fn driver_pid(&self, dev: usize) -> u32 {
        self.status_json()["devices"][dev]["driver_pid"].as_u64().unwrap_or(0) as u32
    }

    pub fn pid(&self) -> u32 {
        self.child.0.as_ref().unwrap().id()
    }

    /// SIGTERM and wait; returns the exit status.
    pub fn stop(&mut self) -> std::process::ExitStatus {
        self.child.terminate()
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        if let Some(c) = self.child.0.as_mut() {
            // SAFETY: signalling our own child.
            unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
            let deadline = Instant::now() + Duration::from_secs(10);
            while Instant::now() < deadline {
                if let Ok(Some(_)) = c.try_wait() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        // ChildGuard kills if still running; then make sure no mount is left.
        let fuse = self.run_dir.join("fuse");
        if std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default().contains(fuse.to_str().unwrap()) {
            let _ = Command::new("umount").arg("-l").arg(&fuse).status();
        }
    }
}

#[allow(unused_imports)] // Not every test binary writes patterns.
pub use bulkhead_testkit::pattern;

/// Whether `bulkhead status` got an answer: it exits 0 (all running), 1 (degraded) or 2 (a
/// device failed) then, and 3 when no serve answered.
pub fn answered(status: &std::process::ExitStatus) -> bool {
    status.code().is_some_and(|c| c <= 2)
}

pub fn small_ram_config(name: &str, size: &str, notify: &str) -> String {
    format!("[[device]]\nname = \"{name}\"\nsize = \"{size}\"\nnotify = \"{notify}\"\n[device.backend]\ntype = \"ram\"\n")
}

/// Serve's errors when it refuses to start with `config` (written under `tmp`); fails if it
/// starts. A serve that hangs instead is killed after a minute.
#[allow(dead_code)]
pub fn refused(tmp: &TempDir, config: &str) -> String {
    let path = tmp.path().join("refused.toml");
    std::fs::write(&path, config).unwrap();
    let out = Command::new("timeout")
        .args(["--kill-after=5", "60", exe(), "serve", "--config"])
        .arg(&path)
        .arg("--run-dir")
        .arg(tmp.path().join("refused-run"))
        .output()
        .unwrap();
    assert!(!out.status.success(), "serve started with {config}");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Whether every tool is installed; a missing one skips the test, or fails it when
/// `BULKHEAD_REQUIRE_KERNEL=1` (as in CI).
pub fn tools(names: &[&str]) -> bool {
    for n in names {
        if bulkhead_testkit::kernel::which(n).is_none() {
            assert!(std::env::var("BULKHEAD_REQUIRE_KERNEL").as_deref() != Ok("1"), "{n} required but not installed");
            eprintln!("SKIP: {n} not installed");
            return false;
        }
    }
    true
}

/// fio's verification options every verifying job here uses: crc32c, checked as it goes (32
/// blocks behind), the first mismatch fatal, no state file left behind, a JSON report.
///
/// `serialize_overlap`: a time-based random job starts over the file once every block is
/// written, so a new write may overlap a block whose verifying read is in flight. Reads and
/// writes in flight together have no order on any block device; the read may return part of
/// each, which fails that block's checksum with no fault below. fio holds back an I/O that
/// overlaps one in flight instead. (Without it, a run over `crypt` failed about one time in
/// fifty, always on the same read of fio's fixed random sequence, the block's header from a
/// later write to it than the one verified and its data not the data that header sums.)
#[allow(dead_code)]
pub const FIO_VERIFY: [&str; 7] = [
    "--verify=crc32c",
    "--verify_backlog=32",
    "--verify_fatal=1",
    "--verify_state_save=0",
    "--serialize_overlap=1",
    "--output-format=json",
    "--time_based",
];

/// fio with crc32c verification on a directory (ext4 over the device): `rw` and `bsrange` as
/// fio takes them, `size` per job, for `seconds`. Fails the test on any I/O or verify error and
/// returns fio's JSON report. A block that fails verification is dumped (`--verify_dump`) into
/// a scratch directory, and the failure names the byte ranges that differ from what fio wrote.
pub fn fio_verify(dir: &Path, rw: &str, bsrange: &str, size: &str, seconds: u32) -> serde_json::Value {
    let dump = TempDir::new("fio-dump");
    let out = Command::new("timeout")
        // A hung request fails the test instead of stalling the suite.
        .args(["--kill-after=10", "180", "fio", "--name=verify", &format!("--directory={}", dir.display())])
        .args(["--ioengine=libaio", "--direct=1", &format!("--rw={rw}"), &format!("--bsrange={bsrange}"), "--iodepth=8"])
        .args([&format!("--size={size}"), &format!("--runtime={seconds}"), "--verify_dump=1"])
        .args(FIO_VERIFY)
        .current_dir(dump.path())
        .output()
        .unwrap();
    let report = serde_json::from_slice::<serde_json::Value>(&out.stdout);
    let error = report.as_ref().map(|v| v["jobs"][0]["error"].clone()).unwrap_or_default();
    if !out.status.success() || error != 0 {
        // fio's own account first: the JSON report is long, and what went wrong is on stderr.
        panic!(
            "fio failed ({}), job error {error}: {}\n{}\nfio's report: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr),
            describe_dumps(dump.path(), dir),
            String::from_utf8_lossy(&out.stdout).chars().take(2000).collect::<String>()
        );
    }
    let v = report.unwrap();
    assert!(v["jobs"][0]["write"]["io_bytes"].as_u64().unwrap() > 0, "fio wrote nothing");
    v
}

/// For each block fio dumped (`FILE.OFFSET.received` beside `FILE.OFFSET.expected`): the byte
/// ranges that differ, whether the bytes received there are zeroes, the first bytes of each
/// side, and whether the block reads back from `data` (fio's directory) as expected now.
fn describe_dumps(dir: &Path, data: &Path) -> String {
    let mut text = String::new();
    let Ok(entries) = std::fs::read_dir(dir) else { return text };
    for e in entries.flatten() {
        let received = e.path();
        let Some(name) = received.file_name().and_then(|n| n.to_str()).and_then(|n| n.strip_suffix(".received")) else {
            continue;
        };
        let (Ok(got), Ok(want)) = (std::fs::read(&received), std::fs::read(dir.join(format!("{name}.expected")))) else {
            continue;
        };
        text += &format!("dumped block {name}: {} bytes received, {} expected\n", got.len(), want.len());
        if let Some((file, offset)) = name.rsplit_once('.').and_then(|(f, o)| Some((f, o.parse::<u64>().ok()?))) {
            use std::os::unix::fs::FileExt;
            let mut again = vec![0; want.len()];
            let read = std::fs::File::open(data.join(file)).and_then(|f| f.read_exact_at(&mut again, offset));
            text += &match read {
                Ok(()) if again == want => "  read again, it holds what fio expected\n".to_string(),
                Ok(()) if again == got => "  read again, it holds what fio received\n".to_string(),
                Ok(()) => "  read again, it holds neither what fio expected nor what it received\n".to_string(),
                Err(e) => format!("  read again: {e}\n"),
            };
        }
        let mut at = 0;
        while at < got.len().min(want.len()) {
            if got[at] == want[at] {
                at += 1;
                continue;
            }
            // A range runs on until 16 bytes in a row agree (random bytes agree by chance).
            let (start, n) = (at, got.len().min(want.len()));
            while at < n && (at..(at + 16).min(n)).any(|k| got[k] != want[k]) {
                at += 1;
            }
            let zeroes = got[start..at].iter().all(|&b| b == 0);
            let head = |b: &[u8]| b[start..(start + 16).min(at)].iter().map(|x| format!("{x:02x}")).collect::<String>();
            text += &format!(
                "  bytes {start}..{at} ({} bytes) differ{}: received {} expected {}\n",
                at - start,
                if zeroes { ", received as zeroes" } else { "" },
                head(&got),
                head(&want)
            );
        }
    }
    text
}

/// Deterministic numbers for kill timing: the same seed, the same times.
#[allow(unused_imports)] // each test file uses a different subset
pub use bulkhead_rng::Rng;

/// fio's nbd engine on `uri`: random writes of 4–64 KiB at depth 16 over `size` for `runtime`
/// s, crc32c-verified (killed after `limit` s). Asserts that it ran without an I/O or verify
/// error and returns its job's report.
#[allow(dead_code)]
pub fn fio_nbd_verify(uri: &str, name: &str, size: &str, runtime: u32, limit: u32) -> serde_json::Value {
    let out = Command::new("timeout")
        .args([
            "--kill-after=10",
            &limit.to_string(),
            "fio",
            &format!("--name={name}"),
            "--ioengine=nbd",
            &format!("--uri={uri}"),
        ])
        .args(["--rw=randwrite", "--bsrange=4k-64k", "--iodepth=16", &format!("--size={size}"), &format!("--runtime={runtime}")])
        .args(FIO_VERIFY)
        .output()
        .unwrap();
    assert!(out.status.success(), "fio: {}\n{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    // fio's nbd engine may print a line of its own before the JSON.
    let text = String::from_utf8_lossy(&out.stdout);
    let v: serde_json::Value = serde_json::from_str(&text[text.find('{').expect("fio's JSON")..]).unwrap();
    let job = v["jobs"][0].clone();
    assert_eq!(job["error"], 0, "fio saw an I/O or verify error");
    job
}

/// A thread that SIGKILLs a serve's domains while a workload runs. Every `pause()` it reads the
/// first device's status and asks `pick` which domain to kill, given that device and the kills
/// so far: `(kind, pid, generation)`, where `kind` indexes the counts returned by
/// [`stop`](Self::stop) and `generation` names the generation (each is killed once).
pub struct DomainKiller {
    done: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: std::thread::JoinHandle<Vec<u32>>,
}

impl DomainKiller {
    pub fn start(
        run_dir: PathBuf,
        mut pause: impl FnMut() -> Duration + Send + 'static,
        mut pick: impl FnMut(&serde_json::Value, u32) -> (usize, u32, u64) + Send + 'static,
    ) -> Self {
        use std::sync::atomic::Ordering;
        let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let stop = done.clone();
        let thread = std::thread::spawn(move || {
            let mut counts: Vec<u32> = Vec::new();
            let mut last = 0u64;
            let mut completed_at_kill = 0u64;
            while !stop.load(Ordering::Acquire) {
                std::thread::sleep(pause());
                let out = Command::new(exe()).args(["status", "--json", "--run-dir"]).arg(&run_dir).output().unwrap();
                let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
                // A device being restarted already has its domain on the way out; and each
                // generation serves a request before it is killed, so the workload moves on
                // (kills faster than a generation can answer would starve it forever).
                let d = &v["devices"][0];
                let views = d["views"].as_array().into_iter().flatten();
                let completed = d["requests_completed"].as_u64().unwrap_or(0)
                    + views.map(|w| w["requests_completed"].as_u64().unwrap_or(0)).sum::<u64>();
                if v["devices"][0]["restarting"].as_bool() == Some(true) || (last != 0 && completed <= completed_at_kill) {
                    continue;
                }
                let (kind, pid, generation) = pick(&v["devices"][0], counts.iter().sum());
                // Kill each generation once, and only a running one.
                // SAFETY: signalling a domain of our own serve by pid.
                if pid != 0 && generation != last && unsafe { libc::kill(pid as i32, libc::SIGKILL) } == 0 {
                    if counts.len() <= kind {
                        counts.resize(kind + 1, 0);
                    }
                    counts[kind] += 1;
                    last = generation;
                    completed_at_kill = completed;
                }
            }
            counts
        });
        DomainKiller { done, thread }
    }

    /// Stops killing; the kills that landed, by kind.
    pub fn stop(self) -> Vec<u32> {
        self.done.store(true, std::sync::atomic::Ordering::Release);
        self.thread.join().unwrap()
    }
}

/// The driver pid of a device's status, as [`DomainKiller`]'s `pick` for killing driver domains.
pub fn driver_domain(d: &serde_json::Value, _kills: u32) -> (usize, u32, u64) {
    let pid = d["driver_pid"].as_u64().unwrap_or(0);
    (0, pid as u32, pid)
}

/// An ext4 file system made on a loop device over a device's FUSE file and mounted; every guard
/// undone on drop.
pub struct Ext4 {
    pub mnt: PathBuf,
    pub lo: LoopGuard,
    mount: Option<MountGuard>,
}

impl Ext4 {
    /// mkfs.ext4 on a direct-I/O loop device over `file`, mounted at `mnt`.
    pub fn make(file: &Path, mnt: &Path) -> Ext4 {
        let lo = LoopGuard::attach_direct(file);
        run("mkfs.ext4", &["-q", "-F", &lo.dev]);
        let mount = Some(MountGuard::mount(&lo.dev, mnt));
        Ext4 { mnt: mnt.to_path_buf(), lo, mount }
    }

    /// Unmounts, asserts that the file system is gone from the kernel (no domain's mount
    /// namespace kept a copy of the mount alive), and that `e2fsck -fn` finds it clean.
    pub fn unmount_and_check(&mut self) {
        if let Some(m) = self.mount.take() {
            m.unmount();
        }
        // ext4 unregisters its /sys directory when the file system shuts down; a copy of the
        // mount held elsewhere keeps it running, still writing back behind the unmount. A
        // domain starting anywhere on the machine (another test's) copies every mount for the
        // few system calls between its `unshare` and its detach (`bulkhead_sandbox::mounts`),
        // so the file system may outlive the unmount by that long; a copy kept is still there
        // seconds later.
        let name = Path::new(&self.lo.dev).file_name().unwrap().to_string_lossy().into_owned();
        let sys = PathBuf::from(format!("/sys/fs/ext4/{name}"));
        let deadline = Instant::now() + Duration::from_secs(5);
        while sys.exists() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(
            !sys.exists(),
            "the file system on {} is still alive 5 s after its unmount ({} exists)",
            self.lo.dev,
            sys.display()
        );
        let fsck = Command::new("e2fsck").args(["-fn", &self.lo.dev]).output().unwrap();
        assert!(fsck.status.success(), "e2fsck: {}", String::from_utf8_lossy(&fsck.stdout));
    }
}

/// Runs `qemu-io -f FORMAT [-r] -c CMD… TARGET` and returns what it printed; fails the test if
/// it fails or a pattern does not verify.
pub fn qemu_io(format: &str, read_only: bool, target: &str, cmds: &[&str]) -> String {
    let mut args = vec!["--kill-after=5", "120", "qemu-io", "-f", format];
    if read_only {
        args.push("-r");
    }
    for c in cmds {
        args.extend(["-c", c]);
    }
    args.push(target);
    let out = Command::new("timeout").args(&args).output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && !text.contains("Pattern verification failed"), "qemu-io {cmds:?} {target}: {text}");
    text
}

/// fio verify (randrw over `bsrange`) in `mnt` while the driver domain of `serve`'s first
/// device is killed every `every`; fails the test, with serve's log, if fio fails or fewer than
/// `min_kills` kills landed. Returns the number of kills.
#[allow(dead_code)]
pub fn fio_verify_while_killing_the_driver(
    serve: &Serve,
    mnt: &Path,
    bsrange: &str,
    size: &str,
    seconds: u32,
    every: Duration,
    min_kills: u32,
) -> u32 {
    let killer = DomainKiller::start(serve.run_dir.clone(), move || every, driver_domain);
    let fio = std::panic::catch_unwind(|| fio_verify(mnt, "randrw", bsrange, size, seconds));
    let kills = killer.stop();
    assert!(fio.is_ok(), "fio failed; serve's log:\n{}", serve.log_text());
    let n = kills.first().copied().unwrap_or(0);
    assert!(n >= min_kills, "killed {kills:?}: {}", serve.log_text());
    n
}

/// Runs `cmd` (killed after 300 s) and returns what it printed; fails the test if it fails.
pub fn sh(cmd: &str, args: &[&str]) -> String {
    let out = Command::new("timeout").args(["--kill-after=5", "300", cmd]).args(args).output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{cmd} {args:?}: {text}");
    text
}

/// Runs `bulkhead-bench` with `args`, killed after `seconds`, and returns what it printed on
/// stdout and on stderr; fails the test if it fails.
#[allow(dead_code)]
pub fn bench(seconds: u32, args: &[&str]) -> (String, String) {
    let out = Command::new("timeout").args(["--kill-after=30", &seconds.to_string(), bench_exe()]).args(args).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "bulkhead-bench {args:?}: {stdout}\n{stderr}");
    (stdout, stderr)
}

/// Copies `from` to `to` with dd and the operands in `opts` (block size, offsets, flags);
/// fails the test if dd fails.
#[allow(dead_code)]
pub fn dd(from: &Path, to: &Path, opts: &[&str]) {
    let (i, o) = (format!("if={}", from.display()), format!("of={}", to.display()));
    let mut args = vec![i.as_str(), o.as_str(), "status=none"];
    args.extend(opts);
    sh("dd", &args);
}

/// The SHA-256 of a file, as `sha256sum` prints it.
pub fn digest(path: &Path) -> String {
    sh("sha256sum", &[path.to_str().unwrap()])
}

/// Mounts and loop devices whose paths hold `tag` (a benchmark's scratch directory): `(mounts,
/// loop devices)`.
#[allow(dead_code)]
pub fn leftovers(tag: &str) -> (usize, usize) {
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let loops = std::process::Command::new("losetup")
        .arg("-a")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default();
    (mounts.matches(tag).count(), loops.matches(tag).count())
}
