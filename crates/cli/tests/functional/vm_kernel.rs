//! Real Linux guests under QEMU (TCG) on bulkhead's vhost-user-blk sockets: a file system
//! round trip, driver domains killed and wedged under the guest's I/O, `serve` itself killed
//! and restarted under it, a read-only view, guest memory kept out of the domains, and a
//! loaded guest live-migrated between two `serve`s in network namespaces of their own, the
//! disks handed over, on a shared file and on RBD. Each guest passes only if its dmesg shows
//! no I/O error and no "not a head", and every block it wrote reads back as written.

#[path = "../common/mod.rs"]
mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use bulkhead_guest::{Disk, Kit, Outcome, Qmp, Vm, VmOptions};
use bulkhead_testkit::require_kernel;
use common::*;

/// Held by each test for its whole run: guests run one after another (two CPUs are all there
/// is, and a TCG guest takes one), and the kit is built once.
static ONE_GUEST: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    ONE_GUEST.lock().unwrap_or_else(|e| e.into_inner())
}

/// The kit, or `None` (the test skips) where QEMU is missing and the kernel tests are not
/// required.
fn kit() -> Option<Kit> {
    if bulkhead_testkit::kernel::which("qemu-system-x86_64").is_none() {
        assert!(std::env::var("BULKHEAD_REQUIRE_KERNEL").as_deref() != Ok("1"), "qemu-system-x86_64 required but not installed");
        eprintln!("SKIP: qemu-system-x86_64 not installed");
        return None;
    }
    Some(Kit::ensure().unwrap_or_else(|e| panic!("guest kit: {e}")))
}

fn vm(kit: &Kit, tmp: &TempDir, disks: Vec<Disk>, script: &str) -> Vm {
    // As many vCPUs as queues: the guest's virtio-blk uses no more queues than CPUs.
    let cpus = disks.iter().map(|d| u32::from(d.queues)).max().unwrap_or(1);
    let opts = VmOptions { disks, script: script.to_string(), memory_mib: 256, cpus, scratch: tmp.path().join("initrd") };
    Vm::boot(kit, &opts).unwrap_or_else(|e| panic!("boot: {e}"))
}

fn passed(out: &Outcome, serve: &Serve) {
    if let Err(e) = out.check() {
        panic!("{e}\nserve log:\n{}", serve.log_text());
    }
}

const EXPORT: &str = "[fuse]\nenabled = false\n[nbd]\nenabled = false\n[vhost_user]\nenabled = true\n";

#[test]
fn a_guest_makes_a_file_system_and_reads_back_what_it_wrote() {
    require_kernel!();
    let _one = one_at_a_time();
    let Some(kit) = kit() else { return };
    let tmp = TempDir::new("vm-fs");
    let cfg = format!("{EXPORT}[[device]]\nname = \"disk\"\nsize = \"256M\"\nqueues = 2\n[device.backend]\ntype = \"ram\"\n");
    let serve = Serve::start(&tmp.path().join("run"), Some(&cfg), &[]);
    let script = r#"
test "$(cat /sys/block/vda/serial)" = disk
test "$(ls /sys/block/vda/mq | wc -l)" = 2
test "$(cat /sys/block/vda/ro)" = 0
test "$(cat /sys/block/vda/queue/discard_max_bytes)" -gt 0
test "$(cat /sys/block/vda/queue/write_zeroes_max_bytes)" -gt 0
guest-io stress /dev/vda 5 16
dd if=/dev/urandom of=/tmp/big bs=1M count=8 2>/dev/null
dd if=/tmp/big of=/dev/vda bs=1M seek=64 oflag=direct
test "$(dd if=/dev/vda bs=1M skip=64 count=8 iflag=direct 2>/dev/null | md5sum)" = "$(md5sum < /tmp/big)"
mke2fs -q /dev/vda
mount -t ext4 /dev/vda /mnt
dd if=/dev/urandom of=/tmp/p bs=1M count=24 2>/dev/null
cp /tmp/p /mnt/p
mkdir /mnt/d
for i in 1 2 3 4 5 6 7 8; do dd if=/dev/urandom of=/mnt/d/f$i bs=4k count=$((i * 16)) 2>/dev/null; done
md5sum /mnt/d/* > /tmp/sums
sync
umount /mnt
echo 3 > /proc/sys/vm/drop_caches
mount -t ext4 /dev/vda /mnt
test "$(md5sum < /mnt/p)" = "$(md5sum < /tmp/p)"
md5sum -c /tmp/sums
umount /mnt
echo FS-ROUND-TRIP-OK
"#;
    let g = vm(&kit, &tmp, vec![Disk { socket: serve.vhost_socket("disk"), queues: 2 }], script);
    let out = g.finish(Duration::from_secs(240));
    passed(&out, &serve);
    assert!(out.lines.iter().any(|l| l == "FS-ROUND-TRIP-OK"), "{}", out.tail(40));
    assert!(out.lines.iter().any(|l| l.starts_with("GUESTIO ok stress")), "{}", out.tail(40));
}

/// The export's status of device `dev`'s first queue.
fn vhost_queue(serve_status: &serde_json::Value, dev: &str) -> serde_json::Value {
    let e = serve_status["vhost_user"].as_array().and_then(|a| a.iter().find(|e| e["device"] == dev).cloned());
    e.map(|e| e["queues"][0].clone()).unwrap_or_default()
}

/// A `file` device on a tmpfs file, with a short watchdog so that a wedged domain is replaced
/// quickly.
fn file_config(img: &std::path::Path) -> String {
    std::fs::File::create(img).unwrap().set_len(128 << 20).unwrap();
    format!(
        "{EXPORT}[[device]]\nname = \"disk\"\nsize = \"128M\"\nwatchdog_ms = 300\nrestart_limit = 100000\n\
         [device.backend]\ntype = \"file\"\npath = \"{}\"\n",
        img.display()
    )
}

#[test]
fn thirty_driver_kills_and_wedges_under_guest_io_are_a_pause() {
    require_kernel!();
    let _one = one_at_a_time();
    let Some(kit) = kit() else { return };
    let tmp = TempDir::new("vm-kill");
    let cfg = file_config(&tmp.path().join("disk.img"));
    let serve = Serve::start(&tmp.path().join("run"), Some(&cfg), &[]);
    let g = vm(&kit, &tmp, vec![Disk { socket: serve.vhost_socket("disk"), queues: 1 }], "guest-io stress /dev/vda 75 16");
    assert!(g.wait_for("GUESTIO started", Duration::from_secs(60)).is_some(), "{}", g.lines().join("\n"));
    std::thread::sleep(Duration::from_secs(2));
    let mut rng = bulkhead_rng::Rng::new(0x2545_f491);
    let (mut kills, mut wedges) = (0, 0);
    for i in 0..30 {
        assert!(
            !g.lines().iter().any(|l| l.starts_with("GUESTIO ok") || l.starts_with("GUESTIO FAIL")),
            "the guest's load ended after {i} kills: {}",
            g.lines().join("\n")
        );
        let old = serve.driver_pid(0);
        assert_ne!(old, 0);
        let sig = if i % 3 == 2 { libc::SIGSTOP } else { libc::SIGKILL };
        // SAFETY: signalling a driver domain of our own serve by pid.
        assert_eq!(unsafe { libc::kill(old as i32, sig) }, 0);
        if sig == libc::SIGSTOP {
            wedges += 1;
        } else {
            kills += 1;
        }
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            let v = serve.status_json();
            let d = &v["devices"][0];
            if d["driver_pid"].as_u64().unwrap_or(0) as u32 != old
                && d["state"] == "running"
                && !d["restarting"].as_bool().unwrap_or(false)
            {
                break;
            }
            assert!(Instant::now() < deadline, "domain {old} was not replaced: {}", serve.log_text());
            std::thread::sleep(Duration::from_millis(20));
        }
        let x = rng.next_u64();
        std::thread::sleep(Duration::from_millis(400 + x % 800));
    }
    let q = vhost_queue(&serve.status_json(), "disk");
    let out = g.finish(Duration::from_secs(240));
    passed(&out, &serve);
    assert!(out.lines.iter().any(|l| l.starts_with("GUESTIO ok stress")), "{}", out.script_output());
    assert_eq!((kills, wedges), (20, 10));
    let max = q["max_in_flight"].as_u64().unwrap_or(0);
    assert!(max >= 10, "at most {max} requests were in flight: {q}");
    assert_eq!(q["failed"].as_u64(), Some(0), "{q}");
    eprintln!(
        "30 kills and wedges: {} requests returned, at most {max} in flight, {} calls sent again",
        q["returned"], q["recalls"]
    );
}

#[test]
fn twenty_kills_of_serve_under_guest_io_are_a_pause() {
    require_kernel!();
    let _one = one_at_a_time();
    let Some(kit) = kit() else { return };
    let tmp = TempDir::new("vm-serve-kill");
    let cfg = file_config(&tmp.path().join("disk.img"));
    let run_dir = tmp.path().join("run");
    let mut serve = Serve::start(&run_dir, Some(&cfg), &[]);
    let g = vm(&kit, &tmp, vec![Disk { socket: serve.vhost_socket("disk"), queues: 1 }], "guest-io stress /dev/vda 100 16");
    assert!(g.wait_for("GUESTIO started", Duration::from_secs(60)).is_some(), "{}", g.lines().join("\n"));
    let mut resubmitted = 0;
    let mut max_in_flight = 0;
    for i in 0..20 {
        // Wait for the guest to be served by this serve: connected, and requests returned.
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let q = vhost_queue(&serve.status_json(), "disk");
            if q["returned"].as_u64().unwrap_or(0) >= 200 {
                resubmitted += q["resubmitted"].as_u64().unwrap_or(0);
                max_in_flight = max_in_flight.max(q["max_in_flight"].as_u64().unwrap_or(0));
                break;
            }
            assert!(Instant::now() < deadline, "kill {i}: the guest was not served again: {}", serve.log_text());
            std::thread::sleep(Duration::from_millis(50));
        }
        assert!(
            !g.lines().iter().any(|l| l.starts_with("GUESTIO ok") || l.starts_with("GUESTIO FAIL")),
            "the guest's load ended after {i} kills of serve: {}",
            g.lines().join("\n")
        );
        // kill -9, then a new serve on the same run directory.
        let child = serve.child.0.as_mut().unwrap();
        child.kill().unwrap();
        child.wait().unwrap();
        serve.child.0 = None;
        // The dead serve's control socket is left behind: readiness is the new one's.
        let _ = std::fs::remove_file(run_dir.join("control.sock"));
        serve = Serve::start(&run_dir, Some(&cfg), &[]);
    }
    let out = g.finish(Duration::from_secs(300));
    passed(&out, &serve);
    assert!(out.lines.iter().any(|l| l.starts_with("GUESTIO ok stress")), "{}", out.script_output());
    assert!(max_in_flight >= 10, "at most {max_in_flight} requests were in flight");
    eprintln!("20 kills of serve: {resubmitted} requests served again from the in-flight record");
    assert!(resubmitted > 0, "no request was ever in flight at a kill");
}

/// The pid of the `serve` answering on `run_dir`, if one does.
fn hello_pid(run_dir: &std::path::Path) -> Option<u32> {
    let mut c = bulkhead_control::Client::connect(run_dir).ok()?;
    c.call(bulkhead_control::Hello {}).ok().map(|h| h.pid)
}

#[test]
fn with_a_keeper_kills_and_upgrades_of_serve_under_guest_io_are_a_pause() {
    require_kernel!();
    let _one = one_at_a_time();
    let Some(kit) = kit() else { return };
    let tmp = TempDir::new("vm-keeper");
    let cfg = format!("[keeper]\nenabled = true\n{}", file_config(&tmp.path().join("disk.img")));
    let run_dir = tmp.path().join("run");
    // `serve` becomes the keeper and starts the real one; nothing else restarts it here.
    let serve = Serve::start(&run_dir, Some(&cfg), &[]);
    let keeper = serve.pid();
    let g = vm(&kit, &tmp, vec![Disk { socket: serve.vhost_socket("disk"), queues: 1 }], "guest-io stress /dev/vda 35 16");
    assert!(g.wait_for("GUESTIO started", Duration::from_secs(60)).is_some(), "{}", g.lines().join("\n"));
    let mut resubmitted = 0;
    let mut pauses = Vec::new();
    let rounds = Instant::now();
    for i in 0..10 {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let q = vhost_queue(&serve.status_json(), "disk");
            if q["returned"].as_u64().unwrap_or(0) >= 200 {
                resubmitted += q["resubmitted"].as_u64().unwrap_or(0);
                break;
            }
            assert!(
                Instant::now() < deadline,
                "round {i}: the guest was not served again: {}\n{:#}\n{}",
                serve.log_text(),
                serve.status_json()["vhost_user"],
                g.lines().join("\n")
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        assert!(
            !g.lines().iter().any(|l| l.starts_with("GUESTIO ok") || l.starts_with("GUESTIO FAIL")),
            "the guest's load ended after round {i}: {}",
            g.lines().join("\n")
        );
        let old = hello_pid(&run_dir).expect("a serve answers");
        let started = Instant::now();
        if i % 2 == 0 {
            // kill -9 of the serve the keeper started: the keeper starts the next.
            bulkhead_sys::signal(old, libc::SIGKILL).unwrap();
        } else {
            let out = std::process::Command::new(exe()).args(["upgrade", "--run-dir"]).arg(&run_dir).output().unwrap();
            assert!(out.status.success(), "{}\n{}", String::from_utf8_lossy(&out.stderr), serve.log_text());
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        while hello_pid(&run_dir).is_none_or(|p| p == old) {
            assert!(Instant::now() < deadline, "round {i}: no new serve: {}", serve.log_text());
            std::thread::sleep(Duration::from_millis(2));
        }
        pauses.push(started.elapsed());
        assert!(Path::new(&format!("/proc/{keeper}")).exists(), "the keeper ended: {}", serve.log_text());
    }
    let took = rounds.elapsed();
    let out = g.finish(Duration::from_secs(300));
    passed(&out, &serve);
    assert!(out.lines.iter().any(|l| l.starts_with("GUESTIO ok stress")), "{}", out.script_output());
    let log = serve.log_text();
    assert_eq!(log.matches("taking over from the serve before this one").count(), 10, "{log}");
    pauses.sort();
    eprintln!(
        "5 kills and 5 upgrades of serve under a guest in {:?}: {resubmitted} requests served again from the in-flight \
         record; a new serve answered after p50 {:?}, max {:?}",
        took,
        pauses[pauses.len() / 2],
        pauses[pauses.len() - 1]
    );
}

#[test]
fn a_read_only_view_refuses_the_guests_writes() {
    require_kernel!();
    let _one = one_at_a_time();
    let Some(kit) = kit() else { return };
    let tmp = TempDir::new("vm-ro");
    let cfg = format!(
        "{EXPORT}[[device]]\nname = \"base\"\nsize = \"64M\"\n[device.backend]\ntype = \"ram\"\n\
         [[device.view]]\nname = \"golden\"\nread_only = true\n"
    );
    let serve = Serve::start(&tmp.path().join("run"), Some(&cfg), &[]);
    let script = r#"
test "$(cat /sys/block/vda/ro)" = 1
test "$(cat /sys/block/vda/queue/discard_max_bytes)" = 0
dd if=/dev/vda of=/dev/null bs=64k count=16 iflag=direct
if dd if=/dev/zero of=/dev/vda bs=4k count=1 oflag=direct 2>/tmp/err; then echo WROTE; exit 1; fi
cat /tmp/err
echo RO-REFUSED
"#;
    let g = vm(&kit, &tmp, vec![Disk { socket: serve.vhost_socket("golden"), queues: 1 }], script);
    let out = g.finish(Duration::from_secs(120));
    passed(&out, &serve);
    assert!(out.lines.iter().any(|l| l == "RO-REFUSED"), "{}", out.script_output());
}

#[test]
fn guest_memory_never_reaches_the_driver_domain() {
    require_kernel!();
    let _one = one_at_a_time();
    let Some(kit) = kit() else { return };
    let tmp = TempDir::new("vm-secret");
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos();
    // What the guest keeps in RAM, and what it writes to its disk (the search's control).
    let secret = format!("GUEST-RAM-SECRET-{nanos:032x}");
    let written = format!("GUEST-DISK-DATA--{nanos:032x}");
    let search = format!(
        "{},{}",
        bulkhead_testkit::memsearch::encode(secret.as_bytes()),
        bulkhead_testkit::memsearch::encode(written.as_bytes())
    );
    let cfg = format!("{EXPORT}[[device]]\nname = \"disk\"\nsize = \"64M\"\n[device.backend]\ntype = \"ram\"\n");
    let Some(serve) = Serve::start_test_driver(&tmp.path().join("run"), Some(&cfg), &[], &[("BULKHEAD_TEST_SEARCH", &search)])
    else {
        return;
    };
    let script = format!(
        "guest-io hold {secret} 64 12 /dev/vda\n\
         yes {written} | head -c 65536 > /tmp/w\n\
         dd if=/tmp/w of=/dev/vda bs=64k seek=3 oflag=direct\n\
         echo WROTE-DATA\n\
         sleep 4\n"
    );
    let g = vm(&kit, &tmp, vec![Disk { socket: serve.vhost_socket("disk"), queues: 1 }], &script);
    assert!(g.wait_for("GUESTIO holding", Duration::from_secs(60)).is_some(), "{}", g.lines().join("\n"));
    let scans_at = |log: &str| {
        log.lines()
            .filter_map(|l| l.split("bulkhead memory-search: ").nth(1))
            .filter_map(|l| l.split(' ').next().and_then(|n| n.parse::<u64>().ok()))
            .max()
            .unwrap_or(0)
    };
    let before = scans_at(&serve.log_text());
    assert!(g.wait_for("WROTE-DATA", Duration::from_secs(90)).is_some(), "{}", g.lines().join("\n"));
    let during = scans_at(&serve.log_text()) - before;
    // The control: data the guest wrote is in the domain, and the search finds it.
    let deadline = Instant::now() + Duration::from_secs(15);
    while !serve.log_text().contains("pattern 1 found") {
        assert!(Instant::now() < deadline, "the search never found the data the guest wrote: {}", serve.log_text());
        std::thread::sleep(Duration::from_millis(100));
    }
    let out = g.finish(Duration::from_secs(60));
    passed(&out, &serve);
    let log = serve.log_text();
    assert!(during >= 5, "only {during} scans while the guest held its secret: {log}");
    assert!(!log.contains("pattern 0 found"), "the driver domain found the guest's RAM: {log}");
}

/// Asks the `serve` at `run_dir` to activate or deactivate a device.
fn hand_over(
    run_dir: &Path,
    call: impl bulkhead_control::Call<Reply = bulkhead_control::Activity>,
) -> bulkhead_control::Activity {
    let mut c = bulkhead_control::Client::connect(run_dir).unwrap();
    c.call(call).unwrap_or_else(|e| panic!("{}: {e}", run_dir.display()))
}

/// The devices a moving guest has: `disk` under `guest-io stress`, `fs` an ext2 file system
/// under a file load.
const MOVED: [&str; 2] = ["disk", "fs"];

/// Whether every device of `serve` writes (`Some(true)`), none does (`Some(false)`), or some do.
fn active(serve: &Serve) -> Option<bool> {
    let st = serve.status_json();
    let states: Vec<bool> = st["devices"].as_array().unwrap().iter().map(|d| d["active"].as_bool().unwrap_or(false)).collect();
    if states.iter().all(|&a| a) {
        Some(true)
    } else if states.iter().all(|&a| !a) {
        Some(false)
    } else {
        None
    }
}

/// What a moving guest runs: a file load on an ext2 file system made on `/dev/vdb` (files
/// rewritten with their checksums beside them) while `guest-io stress` runs on `/dev/vda` for
/// `seconds`; then every file is checked after a remount and the file system unmounted clean.
fn moving_script(seconds: u32) -> String {
    format!(
        r#"mke2fs -q /dev/vdb
mount -t ext4 /dev/vdb /mnt
(set +x; i=0; while [ ! -e /tmp/stop ]; do i=$((i + 1)); f=/mnt/f$((i % 16)); dd if=/dev/urandom of=$f bs=4k count=$((i % 48 + 1)) 2>/dev/null; md5sum $f > $f.sum; done; echo "FSLOAD rewrites=$i") &
guest-io stress /dev/vda {seconds} 16
touch /tmp/stop
wait
umount /mnt
mount -t ext4 -o ro /dev/vdb /mnt
cat /mnt/*.sum > /tmp/sums
md5sum -c /tmp/sums
umount /mnt
echo FS-CHECKED"#
    )
}

/// A guest of one queue on each of `serve`'s moved devices, running [`moving_script`].
fn loaded(serve: &Serve, seconds: u32, scratch: std::path::PathBuf) -> VmOptions {
    VmOptions {
        disks: MOVED.iter().map(|d| Disk { socket: serve.vhost_socket(d), queues: 1 }).collect(),
        script: moving_script(seconds),
        memory_mib: 256,
        cpus: 1,
        scratch,
    }
}

/// What goes wrong during a move, besides the move.
enum Trouble<'f> {
    None,
    /// Runs while the memory is copied (the migration slowed to let it).
    WhileCopying(&'f dyn Fn()),
    /// Runs once QEMU has copied the memory, before the hand-over: it kills the source
    /// `serve`, so the hand-over only activates the destination.
    SourceDies(&'f dyn Fn()),
}

/// A guest under `guest-io stress` (every block written read back and checked, the
/// reads made during a migration too, into pages only the device writes) and a file load,
/// moved between `serve`s as libvirt moves one: the destination QEMU waits paused (`-S`) on
/// its `serve`'s inactive devices; once the source's migration completes, the source's
/// devices are deactivated (its guest stopped, its rings drained), the destination's
/// activated, the destination resumed.
struct Moving<'a> {
    kit: &'a Kit,
    tmp: &'a TempDir,
    guest: Vm,
    qmp: Qmp,
    /// Guests started so far (each QEMU's QMP socket and initramfs are named by it).
    started: usize,
    /// The console of every QEMU the guest has left.
    console: Vec<String>,
    /// QEMU's downtime of each completed migration, ms.
    downtimes: Vec<f64>,
}

impl<'a> Moving<'a> {
    /// Boots the guest on `serve` under a load of `seconds`.
    fn start(kit: &'a Kit, tmp: &'a TempDir, serve: &Serve, seconds: u32) -> Moving<'a> {
        let qmp_path = tmp.path().join("qmp-0.sock");
        let guest =
            Vm::boot_with(kit, &loaded(serve, seconds, tmp.path().join("initrd-0")), &bulkhead_guest::qmp_args(&qmp_path))
                .unwrap();
        let qmp = Qmp::connect(&qmp_path, Duration::from_secs(10)).unwrap();
        assert!(guest.wait_for("GUESTIO started", Duration::from_secs(60)).is_some(), "{}", guest.lines().join("\n"));
        Moving { kit, tmp, guest, qmp, started: 1, console: Vec::new(), downtimes: Vec::new() }
    }

    /// A destination QEMU on `dst`, paused, waiting for the guest; its QMP, and the port.
    fn destination(&mut self, dst: &Serve) -> (Vm, Qmp, u16) {
        let n = self.started;
        self.started += 1;
        let port = 47_000 + (std::process::id() % 1000) as u16 * 16 + n as u16 % 16;
        let qmp_path = self.tmp.path().join(format!("qmp-{n}.sock"));
        let mut more = bulkhead_guest::qmp_args(&qmp_path);
        more.extend(["-incoming".into(), format!("tcp:127.0.0.1:{port}"), "-S".into()]);
        // The load's script is the source's memory's to run: the destination's is never read.
        let vm = Vm::boot_with(self.kit, &loaded(dst, 0, self.tmp.path().join(format!("initrd-{n}"))), &more).unwrap();
        let qmp = Qmp::connect(&qmp_path, Duration::from_secs(10))
            .unwrap_or_else(|e| panic!("destination {n}: {e}: {}\n{}", vm.lines().join("\n"), dst.log_text()));
        (vm, qmp, port)
    }

    /// Starts migrating to `port`, at most `mib_s` MiB/s (0: QEMU's default).
    fn begin(&mut self, port: u16, mib_s: u64) {
        let bandwidth = if mib_s == 0 { 128 << 20 } else { mib_s << 20 };
        let dead = |e: bulkhead_guest::GuestError| panic!("{e}: {}", self.guest.lines().join("\n"));
        self.qmp.execute("migrate-set-parameters", &format!(r#"{{"max-bandwidth":{bandwidth}}}"#)).unwrap_or_else(dead);
        self.qmp.execute("migrate", &format!(r#"{{"uri":"tcp:127.0.0.1:{port}"}}"#)).unwrap_or_else(dead);
    }

    /// Moves the guest from `src` to `dst`, the disks handed over, with `trouble`.
    fn migrate(&mut self, src: &Serve, dst: &Serve, trouble: Trouble<'_>) {
        let (next, mut next_qmp, port) = self.destination(dst);
        self.begin(port, if matches!(trouble, Trouble::WhileCopying(_)) { 24 } else { 0 });
        if let Trouble::WhileCopying(f) = trouble {
            f();
        }
        let (status, downtime) = self.qmp.migration_ended(Duration::from_secs(120)).unwrap();
        let i = self.downtimes.len() + 1;
        assert_eq!(status, "completed", "migration {i}: {}\n{}", next.lines().join("\n"), src.log_text());
        let mut expect = Vec::new();
        match trouble {
            Trouble::SourceDies(kill) => kill(),
            _ => {
                for d in MOVED {
                    let was = hand_over(&src.run_dir, bulkhead_control::Deactivate { device: d.into() });
                    assert!(was.changed && !was.active, "{was:?}");
                    expect.push(was.geometry);
                }
            }
        }
        for (k, d) in MOVED.iter().enumerate() {
            let expect = expect.get(k).cloned();
            let now = hand_over(&dst.run_dir, bulkhead_control::Activate { device: d.to_string(), expect });
            assert!(now.changed && now.active, "{now:?}");
        }
        next_qmp.execute("cont", "{}").unwrap();
        self.downtimes.push(downtime);
        self.console.extend(self.guest.lines());
        self.guest = next;
        self.qmp = next_qmp;
        self.no_errors(&format!("migration {i}"));
    }

    fn no_errors(&self, when: &str) {
        let failed = |l: &String| l.contains("FAIL") || l.contains("I/O error") || l.contains("BUG:") || l.contains("Oops");
        assert!(!self.console.iter().chain(&self.guest.lines()).any(failed), "{when}: {}", self.console.join("\n"));
    }

    /// Waits for the load to end; checks every block read back as written, every file
    /// matched its checksum, and the guest saw no error.
    fn finish(self, serves: &[&Serve]) -> Vec<f64> {
        let out = self.guest.finish(Duration::from_secs(300));
        let mut lines = self.console;
        lines.extend(out.lines.iter().cloned());
        let all = Outcome { lines, status: out.status };
        if let Err(e) = all.check() {
            let logs: Vec<String> = serves.iter().map(|s| s.log_text()).collect();
            panic!("{e}\n{}", logs.join("\n----\n"));
        }
        assert!(all.lines.iter().any(|l| l.starts_with("GUESTIO ok stress")), "{}", all.script_output());
        assert!(all.lines.iter().any(|l| l == "FS-CHECKED"), "{}", all.script_output());
        self.downtimes
    }
}

/// The devices' tables with `active = false`.
fn inactive(cfg: &str) -> String {
    cfg.replace("[[device]]\n", "[[device]]\nactive = false\n")
}

/// `e2fsck -f -n` of a file system image: clean, or the test fails with its report.
fn fsck_clean(image: &Path) {
    let out = std::process::Command::new("e2fsck").arg("-f").arg("-n").arg(image).output().expect("e2fsck");
    assert!(
        out.status.success(),
        "e2fsck {}: {}{}",
        image.display(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Kills the driver domain of device `dev` of `serve`.
fn kill_driver(serve: &Serve, dev: &str) {
    let st = serve.status_json();
    let d = st["devices"].as_array().unwrap().iter().find(|d| d["name"] == dev).unwrap_or_else(|| panic!("no {dev}: {st}"));
    let pid = d["driver_pid"].as_i64().unwrap() as i32;
    // SAFETY: signalling the test's own driver domain.
    unsafe { libc::kill(pid, libc::SIGKILL) };
}

/// Five moves A → B → A … on files both `serve`s open, each `serve` in a network namespace
/// of its own, with the failures around them: a migration cancelled and the destination
/// `serve` killed while the memory is copied (each leaves the guest running on the source,
/// its devices active); driver domains killed while the memory is copied, on the
/// destination during one move and on the source during another (replaced as usual, the move
/// completes); the source `serve` killed once the memory is copied (the destination takes
/// over alone). The file system's image is clean after.
#[test]
fn a_guest_moves_between_two_serves_on_a_shared_file_and_survives_failed_moves() {
    require_kernel!();
    let _one = one_at_a_time();
    let Some(kit) = kit() else { return };
    let Some((host_a, host_b)) = common::netns::NetNs::create().zip(common::netns::NetNs::create()) else { return };
    let tmp = TempDir::new("vm-migrate");
    let fs_img = tmp.path().join("fs.img");
    std::fs::File::create(&fs_img).unwrap().set_len(64 << 20).unwrap();
    let cfg = format!(
        "{}[[device]]\nname = \"fs\"\nsize = \"64M\"\n[device.backend]\ntype = \"file\"\npath = \"{}\"\n",
        file_config(&tmp.path().join("shared.img")),
        fs_img.display()
    );
    let (a_dir, b_dir) = (tmp.path().join("a"), tmp.path().join("b"));
    let start = |dir: &Path, host: &common::netns::NetNs, cfg: &str| {
        Serve::start_in_netns(dir, cfg, &[], &[], &host.name, false).unwrap()
    };
    let a = start(&a_dir, &host_a, &cfg);
    let mut b = start(&b_dir, &host_b, &inactive(&cfg));
    let mut m = Moving::start(&kit, &tmp, &a, 150);
    // Cancelled: the source runs on, its devices active.
    let (dest, _dest_qmp, port) = m.destination(&b);
    m.begin(port, 16);
    std::thread::sleep(Duration::from_millis(500));
    m.qmp.execute("migrate_cancel", "{}").unwrap();
    assert_eq!(m.qmp.migration_ended(Duration::from_secs(60)).unwrap().0, "cancelled");
    drop(dest);
    assert_eq!((active(&a), active(&b)), (Some(true), Some(false)));
    // The destination's serve killed while the memory is copied: the source runs on.
    let (dest, _dest_qmp, port) = m.destination(&b);
    m.begin(port, 16);
    std::thread::sleep(Duration::from_millis(500));
    let child = b.child.0.as_mut().unwrap();
    child.kill().unwrap();
    child.wait().unwrap();
    b.child.0 = None;
    // QEMU may finish copying the memory all the same; the hand-over then has nobody to
    // activate, so the guest resumes on the source, whose devices were never deactivated.
    let (status, _) = m.qmp.migration_ended(Duration::from_secs(60)).unwrap();
    drop(dest);
    m.qmp.execute("cont", "{}").unwrap_or_else(|e| panic!("resuming the source after a migration {status}: {e}"));
    assert_eq!(active(&a), Some(true));
    m.no_errors("after the failed migrations");
    let _ = std::fs::remove_file(b_dir.join("control.sock"));
    let b = start(&b_dir, &host_b, &inactive(&cfg));
    // Five moves: a driver domain killed during the second (the destination's) and the third
    // (the source's); the source serve killed after the fifth's copy.
    let kill_serve = |s: &Serve| {
        let pid = s.child.0.as_ref().unwrap().id() as i32;
        // SAFETY: signalling the test's own serve.
        unsafe { libc::kill(pid, libc::SIGKILL) };
    };
    for i in 0..5 {
        let (src, dst) = if i % 2 == 0 { (&a, &b) } else { (&b, &a) };
        // Half a second into the copy, the disk's driver domain of `dst` (move 2) or `src` (3).
        let on = if i == 1 { dst } else { src };
        let kill_domain = || {
            std::thread::sleep(Duration::from_millis(500));
            kill_driver(on, "disk");
        };
        let src_dies = || kill_serve(src);
        let trouble = match i {
            1 | 2 => Trouble::WhileCopying(&kill_domain),
            4 => Trouble::SourceDies(&src_dies),
            _ => Trouble::None,
        };
        m.migrate(src, dst, trouble);
    }
    assert_eq!(active(&b), Some(true));
    let downtimes = m.finish(&[&a, &b]);
    fsck_clean(&fs_img);
    eprintln!("5 moves on a shared file: QEMU's downtime {downtimes:?} ms");
}

/// Five moves A → B → A … on two RBD images, each `serve` in a network namespace of its own
/// routed to the cluster's: the exclusive lock passes from the source, which releases it as
/// its deactivated domain closes the image, to the destination's first write, with no lock
/// timeout and no lock broken. The file system's image is clean after.
#[test]
fn a_guest_moves_between_two_serves_on_an_rbd_image_and_the_lock_follows_it() {
    require_kernel!();
    let _one = one_at_a_time();
    let Some(kit) = kit() else { return };
    let Some(cluster) = common::ceph::Cluster::routed("mig") else { return };
    let Some((host_a, host_b)) = cluster.host().zip(cluster.host()) else { return };
    cluster.rbd(&["create", "--size", "128M", "rbd/mig"]);
    cluster.rbd(&["create", "--size", "64M", "rbd/mig-fs"]);
    let tmp = TempDir::new("vm-migrate-rbd");
    let cfg = format!("{EXPORT}{}{}", cluster.device("disk", "mig", "128M", ""), cluster.device("fs", "mig-fs", "64M", ""));
    let start = |dir: &str, host: &common::netns::NetNs, cfg: &str| {
        Serve::start_in_netns(&tmp.path().join(dir), cfg, &[], &[], &host.name, false).unwrap()
    };
    let (a, b) = (start("a", &host_a, &cfg), start("b", &host_b, &inactive(&cfg)));
    let mut m = Moving::start(&kit, &tmp, &a, 100);
    for i in 0..5 {
        let (src, dst) = if i % 2 == 0 { (&a, &b) } else { (&b, &a) };
        m.migrate(src, dst, Trouble::None);
    }
    let downtimes = m.finish(&[&a, &b]);
    for s in [&a, &b] {
        assert!(!s.log_text().contains("broke the exclusive lock"), "{}", s.log_text());
    }
    drop((a, b));
    let fs_img = tmp.path().join("fs.img");
    cluster.rbd(&["export", "rbd/mig-fs", fs_img.to_str().unwrap()]);
    fsck_clean(&fs_img);
    eprintln!("5 moves on rbd: QEMU's downtime {downtimes:?} ms");
}
