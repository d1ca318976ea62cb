//! Applications attached to a running serve (`bulkhead_client::attach` and the C API): their
//! requests reach the domain with no hop, land in their device's or view's range, ride
//! through SIGKILLs of the shared domain, and leave nothing behind when they detach; bad
//! requests and hostile descriptors are refused by name and harm nobody.

#[path = "../common/mod.rs"]
mod common;

use std::io::Write;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bulkhead_client::{attach, attach_with, AttachOptions};
use bulkhead_testkit::require_kernel;
use common::*;

/// A 64 MiB ramdisk with a view `vm0` (16 MiB at 16 MiB), a read-only view `ro` (8 MiB at
/// 32 MiB) with one attach slot, and a second device that interposes.
const CONFIG: &str = "\
[[device]]\nname = \"disk0\"\nsize = \"64M\"\n[device.backend]\ntype = \"ram\"\n\
[[device.view]]\nname = \"vm0\"\noffset = \"16M\"\nsize = \"16M\"\n\
[[device.view]]\nname = \"ro\"\noffset = \"32M\"\nsize = \"8M\"\nread_only = true\nattach = 1\n\
[[device]]\nname = \"tapped\"\nsize = \"8M\"\ntap = \"interpose\"\n[device.backend]\ntype = \"ram\"\n\
[[device.filter]]\ntype = \"stats\"\n";

fn start(tag: &str) -> (TempDir, Serve, PathBuf) {
    let tmp = TempDir::new(tag);
    let run_dir = tmp.path().join("run");
    let serve = Serve::start(&run_dir, Some(CONFIG), &["disk0", "tapped"]);
    let deadline = Instant::now() + Duration::from_secs(10);
    while !run_dir.join("control.sock").exists() {
        assert!(Instant::now() < deadline, "control socket not up: {}", serve.log_text());
        std::thread::sleep(Duration::from_millis(20));
    }
    (tmp, serve, run_dir)
}

/// Open descriptors and mappings of files (memfds among them) of a process. Anonymous
/// mappings are left out: the C library keeps the stacks of exited threads and its allocation
/// arenas mapped for reuse, and how many depends on how many threads happened to overlap.
fn footprint(pid: u32) -> (usize, usize) {
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).map(|d| d.count()).unwrap_or(0);
    (fds, maps(pid).len())
}

/// A process's mappings of files, one line each.
fn maps(pid: u32) -> Vec<String> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap_or_default();
    // address perms offset dev inode [path]: a path that is not [heap], [stack], [vdso]...
    text.lines().filter(|l| l.split_whitespace().nth(5).is_some_and(|p| !p.starts_with('['))).map(str::to_owned).collect()
}

/// A process's footprint once it holds still for 200 ms (a control connection's thread, or
/// a detach being finished, leaves it moving for a moment).
fn settled_footprint(pid: u32) -> (usize, usize) {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut last = footprint(pid);
    let mut same = 0;
    while same < 10 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
        let now = footprint(pid);
        same = if now == last { same + 1 } else { 0 };
        last = now;
    }
    last
}

/// Lines of `now` that `before` did not have.
fn new_lines(before: &[String], now: &[String]) -> Vec<String> {
    now.iter().filter(|l| !before.contains(l)).cloned().collect()
}

/// Waits until `ok` holds (up to 10 s); says what it saw otherwise.
fn eventually<T: std::fmt::Debug>(what: &str, look: impl FnMut() -> T, ok: impl Fn(&T) -> bool) -> T {
    let v = settle(look, &ok);
    assert!(ok(&v), "{what}: {v:?}");
    v
}

/// What `look` sees once `ok` holds, or after 10 s whatever it last saw.
fn settle<T>(mut look: impl FnMut() -> T, ok: impl Fn(&T) -> bool) -> T {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let v = look();
        if ok(&v) || Instant::now() >= deadline {
            return v;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The block written at `off` by round `round` (every block is told apart by both).
fn block(off: u64, round: u64, len: usize) -> Vec<u8> {
    pattern(off.wrapping_mul(31) ^ round, len)
}

#[test]
fn an_attached_application_lands_in_its_view_and_rides_through_domain_kills() {
    require_kernel!();
    let (_tmp, serve, run_dir) = start("attach-restart");
    let vm0 = Arc::new(attach_with(&run_dir, "vm0", AttachOptions { queues: 2 }).unwrap());
    assert_eq!((vm0.size(), vm0.queue_count(), vm0.read_only()), (16 << 20, 2, false));
    let status = serve.status_json();
    let attached = &status["devices"][0]["attached"];
    assert_eq!(attached[0]["name"], "vm0", "{status}");
    assert_eq!(attached[0]["pid"], std::process::id(), "{status}");
    assert_eq!(attached[0]["slots"].as_array().unwrap().len(), 2, "{status}");

    // Two threads, one per queue, write and read back 64 KiB blocks over the view while the
    // shared domain is SIGKILLed three times.
    let stop = Arc::new(AtomicBool::new(false));
    let rounds = Arc::new(AtomicU64::new(0));
    let workers: Vec<_> = (0..2u64)
        .map(|q| {
            let (dev, stop, rounds) = (vm0.clone(), stop.clone(), rounds.clone());
            std::thread::spawn(move || -> Result<(), String> {
                let mut round = 0u64;
                while !stop.load(Ordering::Relaxed) || round < 4 {
                    round += 1;
                    // Queue q owns the blocks of its parity.
                    for i in (q..128).step_by(2) {
                        let off = i * (64 << 10);
                        let data = block(off, round, 64 << 10);
                        dev.write(q as usize, off, &data, false).map_err(|e| format!("write at {off}: {e}"))?;
                        let mut back = vec![0u8; 64 << 10];
                        dev.read_into(q as usize, off, &mut back).map_err(|e| format!("read at {off}: {e}"))?;
                        if back != data {
                            return Err(format!("queue {q} round {round}: block at {off} read back wrong"));
                        }
                    }
                    rounds.fetch_max(round, Ordering::Relaxed);
                }
                Ok(())
            })
        })
        .collect();
    let mut killed = Vec::new();
    for _ in 0..3 {
        std::thread::sleep(Duration::from_millis(400));
        let pid = serve.driver_pid(0);
        // SAFETY: signalling a domain process of this test's serve.
        unsafe { libc::kill(pid as i32, libc::SIGKILL) };
        killed.push(pid);
        eventually("a new domain", || serve.driver_pid(0), |p| *p != 0 && *p != pid);
    }
    std::thread::sleep(Duration::from_millis(300));
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        w.join().unwrap().unwrap_or_else(|e| panic!("{e}\n{}", serve.log_text()));
    }
    let status = serve.status_json();
    assert!(status["devices"][0]["restarts"].as_u64().unwrap() >= 3, "{status}");
    assert!(rounds.load(Ordering::Relaxed) >= 4);

    // The view's bytes are the device's from 16 MiB on: read them through the device itself,
    // attached separately, and through the FUSE file.
    let disk = attach(&run_dir, "disk0").unwrap();
    let fuse = std::fs::File::open(serve.fuse_file("disk0")).unwrap();
    for i in [0u64, 1, 77, 127] {
        let off = i * (64 << 10);
        let mut via_disk = vec![0u8; 64 << 10];
        disk.read_into(0, (16 << 20) + off, &mut via_disk).unwrap();
        let mut via_fuse = vec![0u8; 64 << 10];
        std::os::unix::fs::FileExt::read_exact_at(&fuse, &mut via_fuse, (16 << 20) + off).unwrap();
        let mut via_view = vec![0u8; 64 << 10];
        vm0.read_into(0, off, &mut via_view).unwrap();
        assert_eq!(via_disk, via_view, "block {i} through disk0 and vm0");
        assert_eq!(via_fuse, via_view, "block {i} through FUSE and vm0");
    }
    // The view ends at 16 MiB: past it is refused, on the client's side and the domain's.
    assert!(vm0.write(0, (16 << 20) - 4096, &[1u8; 8192], false).is_err());
    drop(disk);
    drop(vm0);
    eventually("no attached application left", || serve.status_json()["devices"][0]["attached"].clone(), |a| a.is_null());
}

#[test]
fn sixty_four_attach_detach_cycles_leave_no_descriptor_or_mapping_behind() {
    require_kernel!();
    let (_tmp, serve, run_dir) = start("attach-cycles");
    // One cycle first: threads and allocations made once are not leaks.
    for name in ["disk0", "vm0"] {
        let d = attach(&run_dir, name).unwrap();
        d.write(0, 0, &[7u8; 4096], false).unwrap();
    }
    let domain = serve.driver_pid(0);
    let settled = |serve: &Serve| serve.status_json()["devices"][0]["attached"].is_null();
    eventually("first cycle detached", || settled(&serve), |s| *s);
    let before = (settled_footprint(serve.pid()), settled_footprint(domain));
    let maps_before = (maps(serve.pid()), maps(domain));
    for i in 0..64u64 {
        // The last cycle's session ends in serve after its application hung up, on serve's
        // time: counted before it has, its queues would be counted with this cycle's.
        eventually("the last cycle detached", || settled(&serve), |s| *s);
        let name = if i % 2 == 0 { "disk0" } else { "vm0" };
        let d = attach_with(&run_dir, name, AttachOptions { queues: 1 + (i % 3) as u32 }).unwrap();
        let data = block(i, 1, 8192);
        d.write(0, i * 8192, &data, false).unwrap();
        let mut back = vec![0u8; 8192];
        d.read_into(d.queue_count() - 1, i * 8192, &mut back).unwrap();
        assert_eq!(back, data, "cycle {i}");
        // The domain keeps each queue's two doorbells open and maps its ring and arenas.
        let (fds, maps) = footprint(domain);
        assert_eq!(fds, before.1 .0 + 2 * d.queue_count(), "cycle {i}: descriptors of the domain");
        assert!(maps >= before.1 .1 + 3 * d.queue_count(), "cycle {i}: mappings of the domain");
        drop(d);
    }
    eventually("every cycle detached", || settled(&serve), |s| *s);
    let after = settle(|| (footprint(serve.pid()), footprint(domain)), |a| *a == before);
    assert_eq!(
        after,
        before,
        "serve and the domain back where they were; mappings new in serve: {:?}, in the domain: {:?}",
        new_lines(&maps_before.0, &maps(serve.pid())),
        new_lines(&maps_before.1, &maps(domain)),
    );
    assert_eq!(serve.driver_pid(0), domain, "the domain was never restarted");
}

#[test]
fn a_domain_that_stops_with_only_an_attached_application_is_restarted_by_the_watchdog() {
    require_kernel!();
    let tmp = TempDir::new("attach-stop");
    let run_dir = tmp.path().join("run");
    // Interrupt notification: the idle domain sleeps, and must still show it is alive.
    let cfg = "[[device]]\nname = \"solo\"\nsize = \"16M\"\nnotify = \"irq\"\nwatchdog_ms = 300\n\
               [device.backend]\ntype = \"ram\"\n";
    let serve = Serve::start(&run_dir, Some(cfg), &["solo"]);
    let dev = attach(&run_dir, "solo").unwrap();
    let first = block(0, 1, 64 << 10);
    dev.write(0, 0, &first, false).unwrap();
    // Attached and idle for five times the watchdog's time: a healthy sleeping domain is left be.
    let old = serve.driver_pid(0);
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(serve.status_json()["devices"][0]["restarts"], 0, "{}", serve.log_text());
    assert_eq!(serve.driver_pid(0), old);

    // Stopped while nothing is in flight: no export has a request to miss, only the
    // application's next one would wait. The watchdog replaces the domain, and the request
    // placed meanwhile is answered by the next one.
    // SAFETY: stopping a domain process of this test's serve.
    assert_eq!(unsafe { libc::kill(old as i32, libc::SIGSTOP) }, 0);
    std::thread::sleep(Duration::from_millis(50));
    let t0 = Instant::now();
    let second = block(64 << 10, 2, 64 << 10);
    dev.write(0, 64 << 10, &second, false).unwrap_or_else(|e| panic!("write: {e}\n{}", serve.log_text()));
    let took = t0.elapsed();
    assert!(took < Duration::from_millis(300 + 3000), "the write waited {took:?}");
    let new = serve.driver_pid(0);
    assert_ne!(new, old, "a new domain serves");
    for (off, want) in [(0u64, &first), (64 << 10, &second)] {
        let mut back = vec![0u8; 64 << 10];
        dev.read_into(0, off, &mut back).unwrap();
        assert!(back == *want, "block at {off} after the restart");
    }
    let log = serve.log_text();
    assert!(log.contains("showed no sign of life for"), "{log}");
    assert_eq!(serve.status_json()["devices"][0]["restarts"], 1, "{log}");
    // The stopped domain was killed, not left behind.
    eventually(
        "the stopped domain gone",
        || std::fs::read_to_string(format!("/proc/{old}/stat")).unwrap_or_default(),
        |s| s.is_empty() || s.contains(") Z "),
    );
}

/// Sends the attach conversation by hand up to the queues, with `fds` as the queue's five;
/// returns the answer and the connection (the attachment lasts as long as it).
fn hand_attach(run_dir: &Path, name: &str, fds: &[BorrowedFd<'_>]) -> (String, UnixStream) {
    let mut conn = UnixStream::connect(run_dir.join("control.sock")).unwrap();
    conn.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    writeln!(conn, "{}", serde_json::json!({"cmd": "attach", "name": name, "queues": 1})).unwrap();
    let offer = bulkhead_client::attach::read_line(&mut conn).unwrap().unwrap();
    assert!(offer.contains("offer"), "{offer}");
    bulkhead_sys::send_with_fds(conn.as_fd(), b"{\"queues\":{\"count\":1}}\n", fds, true).unwrap();
    (bulkhead_client::attach::read_line(&mut conn).unwrap().unwrap_or_default(), conn)
}

#[test]
fn bad_attaches_are_refused_by_name_and_hostile_descriptors_harm_nobody() {
    require_kernel!();
    let (_tmp, serve, run_dir) = start("attach-refused");
    let domain = serve.driver_pid(0);
    let refused = |name: &str, queues: u32| match attach_with(&run_dir, name, AttachOptions { queues }) {
        Ok(_) => panic!("attach to {name} with {queues} queue(s) was accepted"),
        Err(e) => e.to_string(),
    };
    assert!(refused("nosuch", 1).contains("no device or view `nosuch`"));
    assert!(refused("ro", 2).contains("1 attach slot(s) free, 2 asked"));
    assert!(refused("disk0", 5).contains("4 attach slot(s) free, 5 asked"));
    assert!(refused("tapped", 1).contains("interpose"));

    // A read-only view: reads work, writes are refused by the domain.
    let ro = attach(&run_dir, "ro").unwrap();
    assert!(ro.read_only());
    let mut buf = vec![0u8; 4096];
    ro.read_into(0, 0, &mut buf).unwrap();
    let e = ro.write(0, 0, &buf, false).unwrap_err();
    assert_eq!(e.errno(), libc::EROFS, "{e}");
    // Its one slot is taken.
    assert!(refused("ro", 1).contains("0 attach slot(s) free"));
    drop(ro);

    // Hand-made queues: a pipe as a doorbell, an arena that could still shrink, too few
    // descriptors. Each is refused, naming the part.
    let cfg = bulkhead_channel::QueueConfig { nslots: 64, arena_bytes: 8 << 20, ..Default::default() };
    let (_front, good) = bulkhead_channel::QueueSetup::create("hostile", &cfg).unwrap();
    let (pipe_r, _pipe_w) = bulkhead_sys::pipe().unwrap();
    let loose = bulkhead_shmem::memfd::create("loose", 8 << 20).unwrap();
    let [ring, w, r, kick, _irq] = good.as_array().map(|f| f.as_fd());
    let (answer, _) = hand_attach(&run_dir, "disk0", &[ring, w, r, kick, pipe_r.as_fd()]);
    assert!(answer.contains("irq doorbell: not an eventfd"), "{answer}");
    let (answer, _) = hand_attach(&run_dir, "disk0", &[ring, w, loose.as_fd(), kick, good.irq.as_fd()]);
    assert!(answer.contains("read arena: not sealed against shrinking"), "{answer}");
    let (answer, _) = hand_attach(&run_dir, "disk0", &[ring, w, r]);
    assert!(answer.contains("3 descriptors for 1 queue(s)"), "{answer}");

    // A queue that breaks its ring once attached is let go of; the domain serves on.
    let (_front, fds) = bulkhead_channel::QueueSetup::create("breaker", &cfg).unwrap();
    let (answer, _held) = hand_attach(&run_dir, "disk0", &fds.as_array().map(|f| f.as_fd()));
    assert!(answer.contains("attached"), "{answer}");
    let ring_map = bulkhead_shmem::Mapping::new(fds.ring.as_raw_fd(), 4096, bulkhead_shmem::Protection::ReadWrite).unwrap();
    // The request producer index jumps far past the ring's slots.
    for off in (0..4096).step_by(8) {
        let _ = ring_map.atomic_u64(off).map(|a| a.store(u64::MAX / 3, Ordering::Release));
    }
    // Its doorbell rung by hand (the front end would write a sane index back).
    let one = 1u64.to_ne_bytes();
    std::fs::File::from(fds.kick.try_clone().unwrap()).write_all(&one).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    // The next change on the line tells serve, which hangs up on the breaker.
    let disk = attach(&run_dir, "disk0").unwrap();
    disk.write(0, 0, &[9u8; 4096], true).unwrap();
    assert!(serve.log_text().contains("letting it go"), "{}", serve.log_text());
    let mut left = [0u8; 1];
    let mut held = _held;
    held.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    assert_eq!(std::io::Read::read(&mut held, &mut left).unwrap_or(0), 0, "serve hung up on the breaker");
    eventually(
        "only the well-behaved application attached",
        || serve.status_json()["devices"][0]["attached"].as_array().map_or(0, Vec::len),
        |n| *n == 1,
    );
    // A breaker that hangs up itself before anything else reads the domain's notice: its
    // slot is freed all the same, and every other slot can be taken and used after it.
    let (_front2, fds2) = bulkhead_channel::QueueSetup::create("breaker2", &cfg).unwrap();
    let (answer, held2) = hand_attach(&run_dir, "disk0", &fds2.as_array().map(|f| f.as_fd()));
    assert!(answer.contains("attached"), "{answer}");
    let ring2 = bulkhead_shmem::Mapping::new(fds2.ring.as_raw_fd(), 4096, bulkhead_shmem::Protection::ReadWrite).unwrap();
    for off in (0..4096).step_by(8) {
        let _ = ring2.atomic_u64(off).map(|a| a.store(u64::MAX / 3, Ordering::Release));
    }
    std::fs::File::from(fds2.kick.try_clone().unwrap()).write_all(&one).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    drop(held2);
    eventually(
        "the second breaker detached",
        || serve.status_json()["devices"][0]["attached"].as_array().map_or(0, Vec::len),
        |n| *n == 1,
    );
    let rest = attach_with(&run_dir, "disk0", AttachOptions { queues: 3 }).unwrap();
    for q in 0..3 {
        rest.write(q, (q as u64 + 1) << 20, &[q as u8; 4096], false).unwrap();
    }
    assert_eq!(serve.driver_pid(0), domain, "no request above restarted the domain:\n{}", serve.log_text());
    assert_eq!(serve.status_json()["devices"][0]["restarts"], 0);
}

#[test]
fn the_c_example_builds_against_libbulkhead_and_runs() {
    require_kernel!();
    if !tools(&["cc"]) {
        return;
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let target = Path::new(exe()).parent().unwrap().to_path_buf();
    let profile = if target.ends_with("release") { vec!["--release"] } else { vec![] };
    let built = Command::new(env!("CARGO"))
        .args(["build", "-q", "--locked", "-p", "bulkhead-capi"])
        .args(&profile)
        .current_dir(&root)
        .status()
        .unwrap();
    assert!(built.success(), "cargo build -p bulkhead-capi");
    let (tmp, serve, run_dir) = start("attach-c");
    let bin = tmp.path().join("attach-c");
    let cc = Command::new("cc")
        .args(["-O2", "-Wall", "-Wextra", "-Werror", "-I"])
        .arg(root.join("crates/capi/include"))
        .arg(root.join("examples/attach.c"))
        .arg("-L")
        .arg(&target)
        .args(["-lbulkhead", "-o"])
        .arg(&bin)
        .output()
        .unwrap();
    assert!(cc.status.success(), "cc: {}", String::from_utf8_lossy(&cc.stderr));
    let run =
        |name: &str| Command::new(&bin).arg(&run_dir).arg(name).arg("2000").env("LD_LIBRARY_PATH", &target).output().unwrap();
    let out = run("vm0");
    let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("wrote and read back 4 KiB") && text.contains("2000 reads of 4 KiB at QD1"), "{text}");
    // What it wrote at the view's offset 0 is the device's at 16 MiB.
    let mut got = vec![0u8; 4096];
    std::os::unix::fs::FileExt::read_exact_at(&std::fs::File::open(serve.fuse_file("disk0")).unwrap(), &mut got, 16 << 20)
        .unwrap();
    let want: Vec<u8> = (0..4096u32).map(|i| (i * 7 + 3) as u8).collect();
    assert_eq!(got, want);
    let out = run("nosuch");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("no device or view `nosuch`"));
}

/// Builds the fio engine (scripts/fio-engine.sh) for this build's profile into `dir`.
fn build_fio_engine(dir: &Path) -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let target = Path::new(exe()).parent().unwrap().to_path_buf();
    let profile = if target.ends_with("release") { "release" } else { "dev" };
    let so = dir.join("libbulkhead_fio.so");
    let out = Command::new(root.join("scripts/fio-engine.sh")).args(["--profile", profile]).arg(&so).output().unwrap();
    assert!(out.status.success(), "fio-engine.sh: {}", String::from_utf8_lossy(&out.stderr));
    so
}

#[test]
fn fio_drives_a_device_through_the_engine_verifies_every_block_and_rides_through_domain_kills() {
    require_kernel!();
    if !tools(&["cc", "fio", "curl"]) {
        return;
    }
    let (tmp, serve, run_dir) = start("attach-fio");
    let engine = build_fio_engine(tmp.path());
    let fio = |args: &[&str]| {
        let out = Command::new("fio")
            .arg(format!("--ioengine=external:{}", engine.display()))
            .arg(format!("--run_dir={}", run_dir.display()))
            .args(["--name=bh", "--verify=crc32c", "--verify_fatal=1", "--verify_state_save=0"])
            .args(args)
            .output()
            .unwrap();
        (out.status.success(), String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr))
    };
    // A view, with requests of 16 MiB (twice the queue's 8 MiB arena: each goes as two pieces,
    // the second placed once the first is answered), 1 MiB (eight fill the arena) and 4 KiB,
    // every block read back and checked.
    for bs in ["16M", "1M", "4k"] {
        let (ok, text) = fio(&["--filename=vm0", "--rw=randwrite", &format!("--bs={bs}"), "--iodepth=8", "--size=16M"]);
        assert!(ok && text.contains("err= 0"), "{bs}: {text}");
        assert!(text.contains("READ: bw="), "{bs}: fio read nothing back: {text}");
    }
    // The view's first block is the device's at 16 MiB.
    let mut dev = vec![0u8; 4096];
    std::os::unix::fs::FileExt::read_exact_at(&std::fs::File::open(serve.fuse_file("disk0")).unwrap(), &mut dev, 16 << 20)
        .unwrap();
    assert!(dev.iter().any(|&b| b != 0), "the view's writes did not land at its offset");

    // Two jobs at QD16, their writes spread over two seconds (4096 each at 2000 a second), while
    // the domain is killed twice.
    let before = serve.status_json()["devices"][0]["restarts"].as_u64().unwrap();
    let killer = {
        let serve_dir = run_dir.clone();
        std::thread::spawn(move || {
            for _ in 0..2 {
                std::thread::sleep(Duration::from_millis(600));
                let out = Command::new(exe()).args(["status", "--json", "--run-dir"]).arg(&serve_dir).output().unwrap();
                let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
                let pid = v["devices"][0]["driver_pid"].as_u64().unwrap() as i32;
                // SAFETY: signalling the domain of our own serve.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
        })
    };
    let (ok, text) = fio(&[
        "--filename=disk0",
        "--rw=randwrite",
        "--bs=4k",
        "--iodepth=16",
        "--numjobs=2",
        "--size=16M",
        "--offset_increment=16M",
        "--rate_iops=2000",
        "--group_reporting",
    ]);
    killer.join().unwrap();
    assert!(ok && text.contains("err= 0"), "{text}");
    let after = serve.status_json()["devices"][0]["restarts"].as_u64().unwrap();
    assert!(after >= before + 2, "the domain was not restarted twice during the run ({before} -> {after}):\n{text}");

    // A device that does not exist is named in fio's error.
    let (ok, text) = fio(&["--filename=nosuch", "--rw=read", "--bs=4k", "--size=1M"]);
    assert!(!ok && text.contains("no device or view `nosuch`"), "{text}");
}

/// `bulkhead ARGS --run-dir RUN`: its success and what it said.
fn cli(run_dir: &Path, args: &[&str]) -> (bool, String) {
    let out = Command::new(exe()).args(args).arg("--run-dir").arg(run_dir).output().unwrap();
    (out.status.success(), format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)))
}

#[test]
fn attached_applications_ride_through_views_coming_and_going_before_and_after_theirs() {
    require_kernel!();
    let (_tmp, serve, run_dir) = start("attach-views");
    // What `ro` shows: written through the device itself at 32 MiB.
    let disk = attach(&run_dir, "disk0").unwrap();
    let data = block(32 << 20, 1, 64 << 10);
    disk.write(0, 32 << 20, &data, false).unwrap();
    // Attached to the last view; then a view after it comes, and one is attached to it too.
    let ro = attach(&run_dir, "ro").unwrap();
    let (good, said) = cli(&run_dir, &["view", "add", "disk0", "name = \"late\"", "offset = \"48M\"", "attach = 2"]);
    assert!(good, "{said}");
    let late = attach_with(&run_dir, "late", AttachOptions { queues: 2 }).unwrap();
    let mine = block(48 << 20, 2, 64 << 10);
    late.write(1, 0, &mine, false).unwrap();
    // The view before theirs goes: their slots are numbered down, and the new domain takes
    // their queues under the new numbers.
    let (good, said) = cli(&run_dir, &["view", "remove", "vm0"]);
    assert!(good, "{said}");
    let mut back = vec![0u8; 64 << 10];
    ro.read_into(0, 0, &mut back).unwrap();
    assert!(back == data, "ro after vm0 went");
    late.read_into(0, 0, &mut back).unwrap();
    assert!(back == mine, "late after vm0 went");
    let status = serve.status_json();
    let attached = status["devices"][0]["attached"].as_array().unwrap().clone();
    let slots = |name: &str| attached.iter().find(|a| a["name"] == name).map(|a| a["slots"].clone()).unwrap();
    // The device's 4 slots, then ro's one (was 8), then late's two (were 9 and 10).
    assert_eq!((slots("ro"), slots("late")), (serde_json::json!([4]), serde_json::json!([5, 6])), "{status}");
    // A view with an application attached is refused, then removed by force: the application
    // is told, and the other goes on.
    let (good, said) = cli(&run_dir, &["view", "remove", "ro"]);
    assert!(!good && said.contains("attached to view `ro`"), "{said}");
    let (good, said) = cli(&run_dir, &["view", "remove", "ro", "--force"]);
    assert!(good, "{said}");
    eventually("ro's application told", || ro.read_into(0, 0, &mut vec![0u8; 4096]).is_err(), |e| *e);
    late.read_into(1, 0, &mut back).unwrap();
    assert!(back == mine, "late after ro went");
    let status = serve.status_json();
    assert_eq!(status["devices"][0]["requests_failed"], 0, "{status}");
}
