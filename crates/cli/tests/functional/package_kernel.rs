//! The Debian package: built by scripts/package.sh (cargo-deb), unpacked into a scratch root,
//! its contents checked, and `serve` run from it on the configuration it ships; then its whole
//! life under a real systemd, booted as PID 1 in a container (systemd-nspawn) on a Debian root
//! made from Debian's packages (scripts/systemd-lab.sh): installed, started, given a device,
//! reloaded, upgraded under a file system in use, stopped, removed and purged.

#[path = "../common/mod.rs"]
mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use bulkhead_testkit::require_kernel;
use common::{ChildGuard, Serve, TempDir};

fn repo() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."))
}

/// Whether cargo-deb is there to build the package; a skip, or a failure under
/// `BULKHEAD_REQUIRE_KERNEL`, if not.
fn have_cargo_deb() -> bool {
    if Command::new("cargo").args(["deb", "--version"]).output().map(|o| !o.status.success()).unwrap_or(true) {
        assert!(std::env::var_os("BULKHEAD_REQUIRE_KERNEL").is_none(), "cargo-deb is missing (scripts/deps.sh test installs it)");
        eprintln!("SKIP: cargo-deb is not installed");
        return false;
    }
    true
}

/// Builds `bulkhead_VERSION-REVISION` and the benchmarks' package into `out` from the debug
/// build the tests run, as it is: the package is what is checked. Returns their paths.
/// scripts/package.sh writes its assets under target/, so one build runs at a time.
fn build(out: &Path, revision: &str) -> (PathBuf, PathBuf) {
    static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let built = Command::new(repo().join("scripts/package.sh"))
        .args(["--profile", "dev", "--prebuilt", "-o"])
        .arg(out)
        .args(["--deb-revision", revision])
        .output()
        .unwrap();
    assert!(built.status.success(), "{}", String::from_utf8_lossy(&built.stderr));
    let debs: Vec<_> = std::fs::read_dir(out).unwrap().map(|e| e.unwrap().path()).collect();
    let named = |prefix: &str| {
        debs.iter().find(|p| p.file_name().unwrap().to_string_lossy().starts_with(prefix)).cloned().unwrap_or_else(|| {
            panic!("no {prefix}*.deb written: {debs:?}");
        })
    };
    (named("bulkhead_"), named("bulkhead-bench_"))
}

#[test]
fn the_package_holds_what_a_service_needs_and_serves_from_a_scratch_root() {
    require_kernel!();
    if !have_cargo_deb() {
        return;
    }
    let tmp = TempDir::new("package");
    let (deb, bench_deb) = build(&tmp.path().join("out"), "1");

    // The control fields and the configuration kept across upgrades.
    let info = common::sh("dpkg-deb", &["-f", deb.to_str().unwrap()]);
    assert!(info.contains("Package: bulkhead") && info.contains("Depends: libc6"), "{info}");
    let root = tmp.path().join("root");
    common::sh("dpkg-deb", &["-x", deb.to_str().unwrap(), root.to_str().unwrap()]);
    let control = tmp.path().join("control");
    common::sh("dpkg-deb", &["-e", deb.to_str().unwrap(), control.to_str().unwrap()]);
    assert_eq!(std::fs::read_to_string(control.join("conffiles")).unwrap().trim(), "/etc/bulkhead/bulkhead.toml");

    // Every file a user or systemd looks for.
    for path in [
        "usr/bin/bulkhead",
        "etc/bulkhead/bulkhead.toml",
        "usr/lib/systemd/system/bulkhead.service",
        "usr/lib/tmpfiles.d/bulkhead.conf",
        "usr/share/man/man1/bulkhead.1.gz",
        "usr/share/man/man1/bulkhead-serve.1.gz",
        "usr/share/man/man1/bulkhead-status.1.gz",
        "usr/share/bash-completion/completions/bulkhead",
        "usr/share/zsh/vendor-completions/_bulkhead",
        "usr/share/fish/vendor_completions.d/bulkhead.fish",
        "usr/share/doc/bulkhead/README.md",
        "usr/share/doc/bulkhead/copyright",
        "usr/share/doc/bulkhead/docs/operations.md",
        "usr/lib/bulkhead/libbulkhead_fio.so",
    ] {
        assert!(root.join(path).is_file(), "{path} is not in the package");
    }
    assert!(!root.join("usr/bin/bulkhead-test-driver").exists(), "the test driver is never shipped");
    assert!(!root.join("usr/bin/bulkhead-bench").exists(), "the benchmarks are a package of their own");

    // The benchmarks' package: their program and pages, and a dependency on bulkhead itself.
    let bench_info = common::sh("dpkg-deb", &["-f", bench_deb.to_str().unwrap()]);
    assert!(bench_info.contains("Package: bulkhead-bench") && bench_info.contains("bulkhead (="), "{bench_info}");
    let bench_root = tmp.path().join("bench-root");
    common::sh("dpkg-deb", &["-x", bench_deb.to_str().unwrap(), bench_root.to_str().unwrap()]);
    for path in [
        "usr/bin/bulkhead-bench",
        "usr/share/man/man1/bulkhead-bench.1.gz",
        "usr/share/man/man1/bulkhead-bench-vm.1.gz",
        // What `bench vm`, `bench ublk` and `bench rbd` run, found beside the program.
        "usr/share/bulkhead-bench/scripts/guest-kit.sh",
        "usr/share/bulkhead-bench/scripts/guest-lab.sh",
        "usr/share/bulkhead-bench/scripts/ceph-dev.sh",
        "usr/lib/bulkhead-bench/guest-io",
    ] {
        assert!(bench_root.join(path).is_file(), "{path} is not in the benchmarks' package");
    }
    // The guests' program runs in an initramfs with no libraries: it must be static.
    let ldd = Command::new("ldd").arg(bench_root.join("usr/lib/bulkhead-bench/guest-io")).output().unwrap();
    let ldd = format!("{}{}", String::from_utf8_lossy(&ldd.stdout), String::from_utf8_lossy(&ldd.stderr));
    assert!(ldd.contains("not a dynamic executable") || ldd.contains("statically linked"), "{ldd}");
    // Neither program holds the test kit: its hostile domain's forged log line is in neither
    // (and is in the test build, which has it).
    let forged: &[u8] = b"forged: restarted, all is well";
    let holds = |bin: &Path| std::fs::read(bin).unwrap().windows(forged.len()).any(|w| w == forged);
    for bin in [root.join("usr/bin/bulkhead"), bench_root.join("usr/bin/bulkhead-bench")] {
        assert!(!holds(&bin), "{} holds the test kit", bin.display());
    }
    if let Some(test_driver) = Serve::test_driver() {
        assert!(holds(test_driver), "the marker is not the test kit's");
    }
    let unit = std::fs::read_to_string(root.join("usr/lib/systemd/system/bulkhead.service")).unwrap();
    assert!(unit.contains("ExecStart=/usr/bin/bulkhead serve --config /etc/bulkhead/bulkhead.toml --run-dir /run/bulkhead"));
    let bin = root.join("usr/bin/bulkhead");
    let verify_copy = tmp.path().join("bulkhead.service");
    std::fs::write(&verify_copy, unit.replace("/usr/bin/bulkhead", bin.to_str().unwrap())).unwrap();
    let v = Command::new("systemd-analyze").arg("verify").arg(&verify_copy).output().unwrap();
    assert!(v.status.success(), "{}", String::from_utf8_lossy(&v.stderr));

    // The group the docs suggest: sysusers makes it (tried on a scratch root), and the
    // postinst runs sysusers.
    let sysusers = root.join("usr/lib/sysusers.d/bulkhead.conf");
    let users_root = tmp.path().join("sysusers-root");
    std::fs::create_dir_all(users_root.join("etc")).unwrap();
    common::sh("systemd-sysusers", &[&format!("--root={}", users_root.display()), sysusers.to_str().unwrap()]);
    let groups = std::fs::read_to_string(users_root.join("etc/group")).unwrap();
    assert!(groups.lines().any(|l| l.starts_with("bulkhead:")), "{groups}");
    let postinst = std::fs::read_to_string(control.join("postinst")).unwrap();
    assert!(
        postinst.contains("systemd-sysusers ${DPKG_ROOT:+--root=\"$DPKG_ROOT\"} bulkhead.conf")
            && !postinst.contains("#DEBHELPER#"),
        "{postinst}"
    );
    // An upgrade hands serve over; nothing in the scripts stops or restarts the service then.
    assert!(postinst.contains("/usr/bin/bulkhead upgrade") && !postinst.contains("try-restart"), "{postinst}");
    for f in ["bulkhead-alerts.yml", "bulkhead-alerts.test.yml", "bulkhead-dashboard.json"] {
        assert!(root.join("usr/share/bulkhead/monitoring").join(f).is_file(), "the package ships {f}");
    }
    // The shipped configuration passes the check its own comment advises.
    let check = Command::new(&bin).args(["config", "check"]).arg(root.join("etc/bulkhead/bulkhead.toml")).output().unwrap();
    assert!(check.status.success(), "{}", String::from_utf8_lossy(&check.stderr));
    let config = std::fs::read_to_string(root.join("etc/bulkhead/bulkhead.toml")).unwrap();
    assert!(config.contains("systemctl reload bulkhead") && !config.contains("then `systemctl restart"), "{config}");

    // `serve --config /etc/bulkhead/bulkhead.toml` works as shipped (the run directory moved
    // under the scratch root).
    let run_dir = tmp.path().join("run");
    let log = run_dir.with_extension("log");
    let child = Command::new(&bin)
        .args(["serve", "--config"])
        .arg(root.join("etc/bulkhead/bulkhead.toml"))
        .arg("--run-dir")
        .arg(&run_dir)
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let mut serve = Serve { child: ChildGuard(Some(child)), run_dir: run_dir.clone(), log };
    let deadline = Instant::now() + Duration::from_secs(30);
    while !(run_dir.join("fuse/disk0").exists() && run_dir.join("nbd.sock").exists() && run_dir.join("control.sock").exists()) {
        assert!(Instant::now() < deadline, "the shipped config did not serve: {}", serve.log_text());
        std::thread::sleep(Duration::from_millis(20));
    }
    let status = Command::new(&bin).args(["status", "--run-dir"]).arg(&run_dir).output().unwrap();
    assert!(String::from_utf8_lossy(&status.stdout).contains("disk0"), "{}", String::from_utf8_lossy(&status.stderr));
    // The shipped fio engine loads into the installed fio and verifies what it wrote.
    let fio = Command::new("fio")
        .arg(format!("--ioengine=external:{}", root.join("usr/lib/bulkhead/libbulkhead_fio.so").display()))
        .arg(format!("--run_dir={}", run_dir.display()))
        .args(["--name=packaged", "--filename=disk0", "--rw=randwrite", "--bs=4k", "--iodepth=8", "--size=8M"])
        .args(["--verify=crc32c", "--verify_fatal=1", "--verify_state_save=0"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&fio.stdout).into_owned() + &String::from_utf8_lossy(&fio.stderr);
    assert!(fio.status.success() && text.contains("err= 0"), "{text}");
    assert!(serve.stop().success(), "{}", serve.log_text());
}

/// A Debian root booted with systemd as PID 1 by `systemd-nspawn --boot`, on a private network
/// (loopback alone), with the host's `/dev/fuse` and the packages' directory bound in. On drop
/// it is halted (SIGTERM to nspawn, which shuts systemd down; SIGKILL after 30 s) and the loop
/// devices it was given are detached.
struct Container {
    nspawn: ChildGuard,
    leader: u32,
    loops: Vec<String>,
    log: PathBuf,
}

impl Container {
    fn boot(root: &Path, name: &str, debs: &Path, log: PathBuf) -> Container {
        let child = Command::new("systemd-nspawn")
            .arg("-D")
            .arg(root)
            .args(["--boot", "--register=no", "--keep-unit", "--private-network", "--console=pipe"])
            .arg(format!("--machine={name}"))
            .arg("--bind=/dev/fuse")
            .arg(format!("--bind-ro={}:/debs", debs.display()))
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&log).unwrap())
            .stderr(Stdio::from(std::fs::File::options().append(true).open(&log).unwrap()))
            .spawn()
            .unwrap();
        let pid = child.id();
        let mut c = Container { nspawn: ChildGuard(Some(child)), leader: 0, loops: Vec::new(), log };
        // The container's first process becomes systemd once nspawn has set it up.
        let deadline = Instant::now() + Duration::from_secs(60);
        while c.leader == 0 || !c.run("[ -d /run/systemd/system ]").0 {
            let children = std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")).unwrap_or_default();
            let leader = children.split_whitespace().next().and_then(|p| p.parse().ok()).unwrap_or(0);
            let comm = std::fs::read_to_string(format!("/proc/{leader}/comm")).unwrap_or_default();
            c.leader = if comm.trim() == "systemd" { leader } else { 0 };
            assert!(Instant::now() < deadline, "systemd-nspawn booted no systemd: {}", c.log_text());
            std::thread::sleep(Duration::from_millis(50));
        }
        // `--wait` returns once boot is over: running, or degraded if a unit of the minimal
        // root failed (none of them is bulkhead's).
        loop {
            let state = c.run("timeout 60 systemctl is-system-running --wait").1;
            if state.contains("running") || state.contains("degraded") {
                return c;
            }
            assert!(Instant::now() < deadline, "systemd did not finish booting: {state}\n{}", c.log_text());
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// `sh -c script` in every namespace of the container: its output, and whether it succeeded.
    fn run(&self, script: &str) -> (bool, String) {
        let out = Command::new("timeout")
            .args(["--kill-after=5", "300", "nsenter", "-t", &self.leader.to_string(), "-a", "--", "sh", "-c", script])
            .output()
            .unwrap();
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        (out.status.success(), text)
    }

    fn run_ok(&self, script: &str) -> String {
        let (ok, text) = self.run(script);
        assert!(ok, "in the container: {script}\n{text}\n{}", self.journal());
        text
    }

    fn journal(&self) -> String {
        self.run("journalctl -u bulkhead --no-pager -o short-monotonic | tail -40").1
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// A loop device of the host's, made in the container (which has no udev) and attached
    /// there to `file`: a free one is looked up on the host and taken, and looked up again if
    /// another process took it first.
    fn attach_loop(&mut self, file: &str) -> String {
        for _ in 0..20 {
            let dev = common::sh("losetup", &["-f"]).trim().to_string();
            let minor = dev.trim_start_matches("/dev/loop");
            let (ok, text) = self.run(&format!("[ -b {dev} ] || mknod {dev} b 7 {minor}; losetup --direct-io=on {dev} {file}"));
            if ok {
                self.loops.push(dev.clone());
                return dev;
            }
            eprintln!("{dev} was taken: {text}");
        }
        panic!("no loop device could be attached to {file}");
    }
}

impl Drop for Container {
    fn drop(&mut self) {
        if let Some(child) = self.nspawn.0.as_mut() {
            let _ = bulkhead_sys::signal(child.id(), libc::SIGTERM);
            let deadline = Instant::now() + Duration::from_secs(30);
            while child.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        drop(self.nspawn.0.take().map(|c| ChildGuard(Some(c))));
        // The file system and the FUSE mount went with the container's mount namespace; a
        // loop device still bound to the dead mount's file is the host's to free.
        for dev in &self.loops {
            let _ = Command::new("losetup").args(["-d", dev]).status();
        }
    }
}

/// Whether `bulkhead status` printed `device` as running.
fn runs(status: &str, device: &str) -> bool {
    status.lines().any(|l| l.split_whitespace().take(2).eq([device, "running"]))
}

#[test]
fn the_package_lives_its_whole_life_under_systemd() {
    require_kernel!();
    if !have_cargo_deb() || !common::tools(&["systemd-nspawn", "mmdebstrap"]) {
        return;
    }
    let tmp = TempDir::new("package-life");
    let debs = tmp.path().join("debs");
    let (first, _) = build(&debs.join("1"), "1");
    let (second, _) = build(&debs.join("2"), "2");
    let in_container = |deb: &Path| format!("/debs/{}", deb.strip_prefix(&debs).unwrap().display());
    // A copy of the lab's root, so that every run starts from a root that never held bulkhead.
    let lab = common::sh(repo().join("scripts/systemd-lab.sh").to_str().unwrap(), &[]);
    let root = tmp.path().join("root");
    common::sh("cp", &["-a", "--reflink=auto", lab.trim(), root.to_str().unwrap()]);
    let name = format!("bulkhead-life-{}", std::process::id());
    let mut c = Container::boot(&root, &name, &debs, tmp.path().join("nspawn.log"));

    // Installed as the docs say: the group is made, the run directory is there, the service
    // is neither enabled nor started.
    let out = c.run_ok(&format!("apt-get install -y --no-install-recommends {} 2>&1", in_container(&first)));
    eprintln!("install:\n{out}");
    c.run_ok("getent group bulkhead && [ -d /run/bulkhead ] && [ -f /etc/bulkhead/bulkhead.toml ]");
    assert_eq!(c.run("systemctl is-enabled bulkhead").1.trim(), "disabled");
    assert_eq!(c.run("systemctl is-active bulkhead").1.trim(), "inactive");
    let (ok, text) = c.run("bulkhead status");
    assert!(!ok && text.contains("no bulkhead serve is running"), "status is a health check: {text}");

    // The admin's edit, checked before it is used: the NBD socket for the group's members,
    // vhost-user sockets too.
    c.run_ok(
        "sed -i 's/^\\[nbd\\]$/[nbd]\\ngroup = \"bulkhead\"/' /etc/bulkhead/bulkhead.toml && \
         printf '\\n[vhost_user]\\nenabled = true\\ngroup = \"bulkhead\"\\n' >> /etc/bulkhead/bulkhead.toml && \
         bulkhead config check /etc/bulkhead/bulkhead.toml",
    );
    c.run_ok("systemctl enable --now bulkhead");
    let status = c.run_ok("bulkhead status && systemctl show -p StatusText -p ActiveState bulkhead");
    assert!(runs(&status, "disk0") && status.contains("StatusText=serving 1 of 1 device"), "{status}");
    assert!(status.contains("ActiveState=active"), "{status}");
    let ps = c.run_ok("ps -e -o args");
    assert!(ps.contains("bulkhead driver disk0") && !ps.contains("--spec"), "{ps}");
    // The sockets the config gives the group, and a member who is not root using one.
    let socks =
        c.run_ok("stat -c '%a %U:%G %n' /run/bulkhead/nbd.sock /run/bulkhead/vhost/disk0.sock /run/bulkhead/control.sock");
    assert!(socks.contains("660 root:bulkhead /run/bulkhead/nbd.sock"), "{socks}");
    assert!(socks.contains("660 root:bulkhead /run/bulkhead/vhost/disk0.sock"), "{socks}");
    assert!(socks.contains("600 root:root /run/bulkhead/control.sock"), "{socks}");
    c.run_ok("useradd --no-create-home --groups bulkhead qemu-user");
    let size = c.run_ok("runuser -u qemu-user -- nbdinfo --size 'nbd+unix:///disk0?socket=/run/bulkhead/nbd.sock'");
    assert_eq!(size.trim(), (1u64 << 30).to_string());
    let (ok, text) = c.run("runuser -u nobody -- nbdinfo --size 'nbd+unix:///disk0?socket=/run/bulkhead/nbd.sock'");
    assert!(!ok && text.contains("Permission denied"), "one outside the group: {text}");

    // A device added while it runs, and one added to the file and reloaded, the file first
    // made the running configuration as the shipped file's comment advises.
    c.run_ok("printf '[[device]]\\nname = \"scratch\"\\nsize = \"64M\"\\n[device.backend]\\ntype = \"ram\"\\n' | bulkhead device add -");
    c.run_ok(
        "bulkhead config dump > /etc/bulkhead/bulkhead.toml && \
         printf '\\n[[device]]\\nname = \"disk1\"\\nsize = \"256M\"\\n[device.backend]\\ntype = \"ram\"\\n' >> /etc/bulkhead/bulkhead.toml && \
         bulkhead config check /etc/bulkhead/bulkhead.toml && systemctl reload bulkhead",
    );
    // `systemctl reload` returns once the reload is applied.
    let status = c.run_ok("bulkhead status");
    assert!(["disk0", "scratch", "disk1"].iter().all(|d| runs(&status, d)), "{status}");
    // One it refuses fails `systemctl reload`, and the service runs on.
    let (ok, text) = c.run(
        "cp /etc/bulkhead/bulkhead.toml /tmp/good.toml && echo 'bogus = [' >> /etc/bulkhead/bulkhead.toml && \
         systemctl reload bulkhead 2>&1; r=$?; cp /tmp/good.toml /etc/bulkhead/bulkhead.toml; exit $r",
    );
    assert!(!ok, "a reload of a file that does not parse succeeded: {text}");
    assert_eq!(c.run("systemctl is-active bulkhead").1.trim(), "active", "{}", c.journal());

    // ext4 on disk0 over a loop device, written with fsync by a unit of its own all through
    // the upgrade.
    let dev = c.attach_loop("/run/bulkhead/fuse/disk0");
    c.run_ok(&format!("mkfs.ext4 -q {dev} && mkdir -p /mnt/d && mount {dev} /mnt/d"));
    c.run_ok(
        "systemd-run --unit=writer --collect sh -c 'i=0; while [ ! -e /tmp/stop ]; do i=$((i+1)); \
         dd if=/dev/urandom of=/mnt/d/w$i bs=64k count=4 conv=fsync status=none || echo $i >> /tmp/failed; \
         md5sum /mnt/d/w$i >> /tmp/sums; done; touch /tmp/done'",
    );
    let written = || c.run_ok("wc -l < /tmp/sums 2>/dev/null || echo 0").trim().parse::<u64>().unwrap_or(0);
    let deadline = Instant::now() + Duration::from_secs(60);
    while written() < 20 {
        assert!(Instant::now() < deadline, "the writer wrote nothing: {}", c.journal());
        std::thread::sleep(Duration::from_millis(100));
    }
    let before = c.run_ok("systemctl show -p MainPID --value bulkhead").trim().to_string();
    let upgrade = c.run_ok(&format!("apt-get install -y --no-install-recommends {} 2>&1", in_container(&second)));
    eprintln!("upgrade:\n{upgrade}");
    assert!(upgrade.contains("handing the running serve over") && upgrade.contains("is serving"), "{upgrade}");
    let after = c.run_ok("systemctl show -p MainPID --value bulkhead").trim().to_string();
    assert_ne!(before, after, "the new binary serves");
    let at_upgrade = written();
    let deadline = Instant::now() + Duration::from_secs(60);
    while written() < at_upgrade + 20 {
        assert!(Instant::now() < deadline, "the writer stopped after the upgrade: {}", c.journal());
        std::thread::sleep(Duration::from_millis(100));
    }
    c.run_ok("touch /tmp/stop; for i in $(seq 600); do [ -e /tmp/done ] && exit 0; sleep 0.1; done; exit 1");
    // Every file read back from the device, not the page cache.
    c.run_ok("sync");
    std::fs::write("/proc/sys/vm/drop_caches", "3").unwrap();
    c.run_ok("md5sum --quiet -c /tmp/sums");
    let (failed, _) = c.run("[ -s /tmp/failed ]");
    assert!(!failed, "writes failed during the upgrade: {}", c.run("cat /tmp/failed").1);
    assert!(c.run_ok("grep ' /mnt/d ' /proc/mounts").contains(" rw,"), "ext4 stayed writable");
    let status = c.run_ok("bulkhead status; dpkg-query -W -f '${Version}' bulkhead");
    assert!(runs(&status, "disk0") && status.ends_with("0.1.0-2"), "{status}");
    // The edited configuration was kept across the upgrade (the same conffile in both).
    assert!(c.run_ok("cat /etc/bulkhead/bulkhead.toml").contains("name = \"disk1\""));
    c.run_ok(&format!("umount /mnt/d && e2fsck -fn {dev} && losetup -d {dev}"));
    c.loops.clear();

    // Stopped: nothing of serve's is left running, its run directory is empty.
    c.run_ok("systemctl stop bulkhead");
    let (ok, text) = c.run("bulkhead status");
    assert!(!ok && text.contains("no bulkhead serve is running"), "{text}");
    assert!(!c.run("pgrep -f 'bulkhead (serve|driver)'").0, "processes left after stop");
    assert_eq!(c.run_ok("ls -A /run/bulkhead").trim(), "", "the run directory after stop");
    // No error was logged at any step of the life, but the refused reload's.
    let errors = c.run_ok("journalctl -u bulkhead -p err --no-pager -q || true");
    let errors: Vec<&str> = errors.lines().filter(|l| !l.contains("Reload failed for bulkhead.service")).collect();
    assert!(errors.is_empty(), "errors in the journal: {errors:?}");

    // Removed: the configuration stays (a conffile), the unit is masked, the run directory goes.
    c.run_ok("apt-get remove -y bulkhead");
    let left = c.run_ok("ls /etc/bulkhead; readlink /etc/systemd/system/bulkhead.service; [ ! -e /usr/bin/bulkhead ]; [ ! -e /run/bulkhead ]; dpkg-query -W -f '${Status}' bulkhead");
    assert!(left.contains("bulkhead.toml") && left.contains("/dev/null") && left.contains("deinstall ok config-files"), "{left}");
    // Purged: nothing is left but the group (files elsewhere may still belong to it).
    c.run_ok("apt-get purge -y bulkhead");
    let left = c.run_ok("[ ! -e /etc/bulkhead ] && [ ! -e /etc/systemd/system/bulkhead.service ] && [ ! -e /run/bulkhead ] && getent group bulkhead; find / -xdev -name '*bulkhead*' -not -path '/proc/*' -not -path '/debs/*'");
    assert_eq!(left.lines().filter(|l| !l.starts_with("bulkhead:")).collect::<Vec<_>>(), Vec::<&str>::new(), "{left}");
}
