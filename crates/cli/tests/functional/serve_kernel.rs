//! `bulkhead serve` end to end through the real kernel: FUSE, loop devices, ext4, dd, fio.
//! Skipped with a message where the kernel support is missing, unless BULKHEAD_REQUIRE_KERNEL=1.

#[path = "../common/mod.rs"]
mod common;

use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::process::Command;

use bulkhead_testkit::require_kernel;
use common::*;

#[test]
fn ext4_through_loop_survives_remount_and_fsck() {
    require_kernel!();
    let tmp = TempDir::new("ext4");
    let serve = Serve::start(&tmp.path().join("run"), Some(&small_ram_config("disk0", "512M", "adaptive")), &["disk0"]);
    let lo = LoopGuard::attach_direct(&serve.fuse_file("disk0"));
    assert!(lo.direct_io(), "loop device should run with direct I/O on the FUSE file");
    run("mkfs.ext4", &["-q", "-F", &lo.dev]);
    let mnt = tmp.path().join("mnt");
    let files: Vec<(String, Vec<u8>)> = (0..8)
        .map(|i| (format!("f{i}"), pattern(i, [4096, 1 << 20, 3 << 20, 12345, 7 << 20, 1, 65536, 5 << 20][i as usize])))
        .collect();
    {
        let m = MountGuard::mount(&lo.dev, &mnt);
        for (name, data) in &files {
            std::fs::write(mnt.join(name), data).unwrap();
        }
        run("sync", &[]);
        m.unmount();
    }
    {
        let m = MountGuard::mount(&lo.dev, &mnt);
        for (name, data) in &files {
            let got = std::fs::read(mnt.join(name)).unwrap();
            assert!(got == *data, "{name} differs after remount");
        }
        m.unmount();
    }
    let fsck = Command::new("e2fsck").args(["-fn", &lo.dev]).output().unwrap();
    assert!(
        fsck.status.success(),
        "e2fsck -fn: {}\n{}",
        String::from_utf8_lossy(&fsck.stdout),
        String::from_utf8_lossy(&fsck.stderr)
    );
    drop(lo);
    let st = serve.status_json();
    assert!(st["devices"][0]["requests_completed"].as_u64().unwrap() > 100);
}

fn dd(args: &[&str]) {
    let out = Command::new("dd").args(args).arg("status=none").output().unwrap();
    assert!(out.status.success(), "dd {args:?}: {}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn direct_io_at_4k_1m_4m_and_unaligned_offsets_reads_back_equal() {
    require_kernel!();
    let tmp = TempDir::new("dd");
    let serve = Serve::start(&tmp.path().join("run"), Some(&small_ram_config("d", "256M", "poll")), &["d"]);
    let lo = LoopGuard::attach_direct(&serve.fuse_file("d"));
    // (block size, byte offset): offsets not aligned to the block size, only to 512.
    let cases: [(usize, u64); 6] = [
        (4096, 0),
        (4096, 512 * 7),
        (1 << 20, 1 << 20),
        (1 << 20, (5 << 20) + 3584),
        (4 << 20, 16 << 20),
        (4 << 20, (40 << 20) + 512),
    ];
    for (i, (bs, off)) in cases.iter().enumerate() {
        let src = tmp.path().join(format!("src{i}"));
        let back = tmp.path().join(format!("back{i}"));
        let data = pattern(100 + i as u64, bs * 2);
        std::fs::write(&src, &data).unwrap();
        let bs_arg = format!("bs={bs}");
        let seek = format!("seek={off}");
        let skip = format!("skip={off}");
        dd(&[
            &format!("if={}", src.display()),
            &format!("of={}", lo.dev),
            &bs_arg,
            "count=2",
            &seek,
            "oflag=direct,seek_bytes",
            "conv=notrunc",
        ]);
        dd(&[&format!("if={}", lo.dev), &format!("of={}", back.display()), &bs_arg, "count=2", &skip, "iflag=direct,skip_bytes"]);
        assert!(std::fs::read(&back).unwrap() == data, "case {i}: bs={bs} offset={off} read back differs");
    }
    drop(lo);
    // The FUSE file itself, buffered, at byte offsets no block device would allow.
    let f = serve.fuse_file("d");
    let mut h = std::fs::OpenOptions::new().read(true).write(true).open(&f).unwrap();
    let data = pattern(7, 10_000);
    h.seek(SeekFrom::Start(123_457)).unwrap();
    h.write_all(&data).unwrap();
    h.sync_all().unwrap();
    let mut h = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_DIRECT).open(&f).unwrap();
    let mut aligned = vec![0u8; 3 * 4096 + 4096];
    // O_DIRECT needs an aligned buffer: use a page-aligned window of a larger allocation.
    let pad = aligned.as_ptr().align_offset(4096);
    let buf = &mut aligned[pad..pad + 3 * 4096];
    h.seek(SeekFrom::Start(122_880)).unwrap();
    h.read_exact(buf).unwrap();
    assert!(buf[577..577 + 10_000] == data[..], "O_DIRECT read of bytes written buffered at an odd offset");
}

#[test]
fn fio_crc32c_verify_passes_over_io_uring() {
    require_kernel!();
    // Where the kernel has FUSE over io_uring, `auto` must use it.
    let has_uring = std::path::Path::new(bulkhead_fuse_export::ENABLE_URING).exists();
    fio_crc32c_verify("auto", has_uring.then_some("io_uring"));
}

#[test]
fn fio_crc32c_verify_passes_over_dev_fuse() {
    require_kernel!();
    fio_crc32c_verify("off", Some("dev_fuse"));
}

/// fio writes and verifies through a loop device over the FUSE file, the export's transport
/// set by `io_uring` and checked in `status` against `expect`.
fn fio_crc32c_verify(io_uring: &str, expect: Option<&str>) {
    if bulkhead_testkit::kernel::which("fio").is_none() {
        assert!(std::env::var("BULKHEAD_REQUIRE_KERNEL").as_deref() != Ok("1"), "fio required but not installed");
        eprintln!("SKIP: fio not installed");
        return;
    }
    let tmp = TempDir::new("fio");
    let config = format!("[fuse]\nio_uring = \"{io_uring}\"\n{}", small_ram_config("f", "256M", "adaptive"));
    let serve = Serve::start(&tmp.path().join("run"), Some(&config), &["f"]);
    let status = serve.status_json();
    if let Some(t) = expect {
        assert_eq!(status["fuse"]["transport"], t, "fuse transport in status: {}", status["fuse"]);
    }
    if status["fuse"]["transport"] == "io_uring" {
        // Each ring's worker runs on the CPU whose requests the ring carries.
        let mut workers = 0;
        for task in std::fs::read_dir(format!("/proc/{}/task", serve.pid())).unwrap().flatten() {
            let comm = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
            let Some(qid) = comm.trim().strip_prefix("fuse-ring-") else { continue };
            let status = std::fs::read_to_string(task.path().join("status")).unwrap_or_default();
            let allowed = status.lines().find_map(|l| l.strip_prefix("Cpus_allowed_list:")).map(str::trim);
            assert_eq!(allowed, Some(qid), "ring worker {qid} bound to its CPU");
            workers += 1;
        }
        assert!(workers > 0, "no ring worker threads found in serve");
    }
    let lo = LoopGuard::attach_direct(&serve.fuse_file("f"));
    for (name, rw) in [("randwrite-verify", "randwrite"), ("mixed-verify", "randrw")] {
        let out = Command::new("timeout")
            .args([
                // A hung request fails the test instead of stalling the suite.
                "--kill-after=10",
                "180",
                "fio",
                &format!("--name={name}"),
                &format!("--filename={}", lo.dev),
                "--ioengine=libaio",
                "--direct=1",
                &format!("--rw={rw}"),
                "--bsrange=4k-256k",
                "--iodepth=8",
                "--numjobs=1",
                "--size=96M",
                "--verify=crc32c",
                "--do_verify=1",
                "--verify_fatal=1",
                "--verify_state_save=0",
                "--randrepeat=0",
                "--output-format=json",
            ])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "fio {name}: {}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let job = &v["jobs"][0];
        assert_eq!(job["error"], 0, "fio {name} reported an error");
        assert!(job["write"]["io_bytes"].as_u64().unwrap() > 0, "fio {name} wrote nothing");
        assert!(job["read"]["io_bytes"].as_u64().unwrap() > 0, "fio {name} verified nothing");
    }
}

#[test]
fn file_backend_keeps_flushed_data_across_serve_restarts() {
    require_kernel!();
    let tmp = TempDir::new("file");
    let img = tmp.path().join("disk.img");
    std::fs::File::create(&img).unwrap().set_len(64 << 20).unwrap();
    for (direct, engine) in [(false, "sync"), (true, "io_uring")] {
        let cfg = format!(
            "[[device]]\nname = \"fd\"\nqueues = 2\n[device.backend]\ntype = \"file\"\npath = \"{}\"\ndirect = {direct}\nengine = \"{engine}\"\n",
            img.display()
        );
        let data = pattern(if direct { 1 } else { 2 }, 3 << 20);
        {
            let mut serve = Serve::start(&tmp.path().join("run"), Some(&cfg), &["fd"]);
            let mut f = std::fs::OpenOptions::new().write(true).open(serve.fuse_file("fd")).unwrap();
            f.seek(SeekFrom::Start(1 << 20)).unwrap();
            f.write_all(&data).unwrap();
            f.sync_all().unwrap();
            drop(f);
            assert!(serve.stop().success());
        }
        // The data is in the backing file itself.
        let mut raw = vec![0u8; data.len()];
        let mut b = std::fs::File::open(&img).unwrap();
        b.seek(SeekFrom::Start(1 << 20)).unwrap();
        b.read_exact(&mut raw).unwrap();
        assert!(raw == data, "backing file holds the flushed data (direct={direct})");
        // And a new serve reads it back.
        let serve = Serve::start(&tmp.path().join("run"), Some(&cfg), &["fd"]);
        let mut got = vec![0u8; data.len()];
        let mut f = std::fs::File::open(serve.fuse_file("fd")).unwrap();
        f.seek(SeekFrom::Start(1 << 20)).unwrap();
        f.read_exact(&mut got).unwrap();
        assert!(got == data, "restarted serve reads the data back (direct={direct}, {engine})");
    }
}

fn mounted(path: &std::path::Path) -> bool {
    std::fs::read_to_string("/proc/self/mountinfo").unwrap().contains(path.to_str().unwrap())
}

#[test]
fn sigterm_leaves_no_mount_loop_process_or_socket() {
    require_kernel!();
    let tmp = TempDir::new("term");
    let run_dir = tmp.path().join("run");
    let mut serve = Serve::start(&run_dir, Some(&small_ram_config("t", "64M", "adaptive")), &["t"]);
    let driver = serve.status_json()["devices"][0]["driver_pid"].as_u64().unwrap() as i32;
    assert!(driver > 0);
    let lo = LoopGuard::attach_direct(&serve.fuse_file("t"));
    dd(&["if=/dev/zero", &format!("of={}", lo.dev), "bs=1M", "count=8", "oflag=direct"]);
    let lo_dev = lo.dev.clone();
    drop(lo);
    assert!(serve.stop().success(), "serve exits 0 on SIGTERM:\n{}", serve.log_text());
    assert!(!mounted(&run_dir.join("fuse")), "FUSE still mounted");
    assert!(!run_dir.join("control.sock").exists(), "control socket left behind");
    assert!(!run_dir.join("serve.lock").exists(), "lock file left behind");
    // SAFETY: probing a pid with signal 0.
    assert_eq!(unsafe { libc::kill(driver, 0) }, -1, "driver domain still alive");
    let loops = run("losetup", &["-a"]);
    assert!(!loops.contains(run_dir.to_str().unwrap()), "loop device still attached: {loops} ({lo_dev})");
    assert!(serve.log_text().contains("SIGTERM received"));
}

#[test]
fn serve_sigkilled_leaves_no_domain_behind_and_a_new_serve_takes_over() {
    require_kernel!();
    let tmp = TempDir::new("sigkill");
    let run_dir = tmp.path().join("run");
    let cfg = format!("{}{}", small_ram_config("a", "16M", "adaptive"), small_ram_config("b", "16M", "irq"));
    let mut serve = Serve::start(&run_dir, Some(&cfg), &["a", "b"]);
    // One domain started at start-up, one by the watcher thread on a restart.
    let r = Command::new(exe()).args(["device", "restart", "b", "--run-dir"]).arg(&run_dir).output().unwrap();
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    let domains = [serve.driver_pid(0) as i32, serve.driver_pid(1) as i32];
    assert!(domains.iter().all(|&p| p > 0));
    let c = serve.child.0.as_mut().unwrap();
    c.kill().unwrap();
    c.wait().unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(3);
    // SAFETY: probing pids with signal 0.
    while domains.iter().any(|&p| unsafe { libc::kill(p, 0) } == 0) {
        assert!(std::time::Instant::now() < deadline, "driver domains {domains:?} outlived their serve");
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let orphans = run("ps", &["-eo", "ppid=,args="]);
    assert!(
        !orphans.lines().any(|l| l.trim_start().starts_with("1 ")
            && l.contains("bulkhead driver")
            && l.contains(&format!("{run_dir:?}").replace('"', ""))),
        "{orphans}"
    );
    // The next serve on the same run directory takes over (stale mount, socket and lock
    // cleared); the old socket file is still there until it does, so ask until it answers.
    let next = Serve::start(&run_dir, Some(&cfg), &["a", "b"]);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let out = Command::new(exe()).args(["status", "--json", "--run-dir"]).arg(&run_dir).output().unwrap();
        if out.status.success() {
            let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
            assert_eq!(v["devices"][1]["state"], "running");
            break;
        }
        assert!(std::time::Instant::now() < deadline, "the next serve never answered: {}", next.log_text());
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

#[test]
fn second_serve_on_same_run_dir_is_refused() {
    require_kernel!();
    let tmp = TempDir::new("twice");
    let run_dir = tmp.path().join("run");
    let serve = Serve::start(&run_dir, Some(&small_ram_config("a", "16M", "irq")), &["a"]);
    let out = Command::new(exe()).args(["serve", "--run-dir"]).arg(&run_dir).output().unwrap();
    assert!(!out.status.success());
    let msg = String::from_utf8_lossy(&out.stderr);
    assert!(msg.contains("already running") && msg.contains(&serve.pid().to_string()), "{msg}");
    // The first one still serves.
    assert_eq!(serve.status_json()["devices"][0]["state"], "running");
}

#[test]
fn status_reports_fields_and_a_fresh_ram_device_costs_little() {
    require_kernel!();
    let tmp = TempDir::new("status");
    let serve = Serve::start(&tmp.path().join("run"), None, &["disk0"]);
    let st = serve.status_json();
    let d = &st["devices"][0];
    assert_eq!(d["name"], "disk0");
    assert_eq!(d["state"], "running");
    assert_eq!(d["mode"], "adaptive");
    assert_eq!(d["size_bytes"], 1u64 << 30);
    assert_eq!(d["restarts"], 0);
    for key in ["driver_pid", "requests_completed", "last_outage_ms", "p99_outage_ms", "driver_memory"] {
        assert!(d.get(key).is_some(), "status lacks {key}");
    }
    // A fresh 1 GiB ramdisk: the driver domain holds a few MiB, not the device size.
    let drv_kib = d["driver_memory"]["total_kib"].as_u64().unwrap();
    assert!(drv_kib < 16 * 1024, "fresh 1 GiB ram device uses {drv_kib} KiB in its domain");
    let fe_anon = st["frontend"]["rss"]["anon_kib"].as_u64().unwrap();
    assert!(fe_anon < 64 * 1024, "frontend private memory {fe_anon} KiB");
    let text = Command::new(exe()).args(["status", "--run-dir"]).arg(&serve.run_dir).output().unwrap();
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(text.contains("disk0") && text.contains("running") && text.contains("adaptive"), "{text}");
}

/// Context switches of `pid`'s threads so far, voluntary and not: each wake-up is one.
fn switches(pid: u32) -> u64 {
    let mut n = 0;
    for t in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap() {
        let status = std::fs::read_to_string(t.unwrap().path().join("status")).unwrap_or_default();
        n += status
            .lines()
            .filter(|l| l.starts_with("voluntary_ctxt_switches") || l.starts_with("nonvoluntary_ctxt_switches"))
            .filter_map(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
            .sum::<u64>();
    }
    n
}

#[test]
fn an_idle_domain_sleeps_until_asked_and_still_stops_at_once() {
    require_kernel!();
    let tmp = TempDir::new("idle-domain");
    let config = format!("{}\n[[device]]\nname = \"t\"\nsize = \"64M\"\n[[device.filter]]\ntype = \"trace\"\npath = \"{}\"\n[device.backend]\ntype = \"ram\"\n",
        small_ram_config("disk0", "64M", "adaptive"), tmp.path().join("t.trace").display());
    let mut serve = Serve::start(&tmp.path().join("run"), Some(&config), &["disk0", "t"]);
    let (plain, traced) = (serve.driver_pid(0), serve.driver_pid(1));
    // Settle: the domain's start, the first look at its queues.
    std::thread::sleep(std::time::Duration::from_millis(500));
    let before = (switches(plain), switches(traced));
    std::thread::sleep(std::time::Duration::from_secs(3));
    let after = (switches(plain), switches(traced));
    // No timer of its own: 3 s idle without a wake-up (the old half-second bound woke it 6
    // times). A trace with nothing buffered has no housekeeping either.
    assert!(after.0 - before.0 <= 1, "an idle domain woke {} times in 3 s", after.0 - before.0);
    assert!(after.1 - before.1 <= 1, "an idle domain with a trace woke {} times in 3 s", after.1 - before.1);
    // Asked, it answers at once.
    for dev in ["disk0", "t"] {
        let mut f = std::fs::OpenOptions::new().read(true).write(true).open(serve.fuse_file(dev)).unwrap();
        f.write_all(&[7u8; 4096]).unwrap();
        f.seek(SeekFrom::Start(0)).unwrap();
        let mut back = [0u8; 4096];
        f.read_exact(&mut back).unwrap();
        assert_eq!(back, [7u8; 4096]);
    }
    // The trace wrote its records out within its housekeeping interval, and is idle again.
    std::thread::sleep(std::time::Duration::from_millis(400));
    let written = std::fs::metadata(tmp.path().join("t.trace")).map(|m| m.len()).unwrap_or(0);
    assert!(written > 0, "the trace's records were not written out while idle");
    let settled = switches(traced);
    std::thread::sleep(std::time::Duration::from_secs(2));
    assert!(switches(traced) - settled <= 1, "the traced domain keeps waking once its records are out");
    // Asleep with no timeout, the domains still end as soon as serve stops them.
    let started = std::time::Instant::now();
    assert!(serve.stop().success(), "{}", serve.log_text());
    assert!(started.elapsed() < std::time::Duration::from_secs(3), "stopping took {:?}", started.elapsed());
    assert!(
        !std::path::Path::new(&format!("/proc/{plain}")).exists() && !std::path::Path::new(&format!("/proc/{traced}")).exists()
    );
}

/// Private memory of `pid` in KiB (`RssAnon`), 0 once it is gone.
fn anon_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("RssAnon:").and_then(|v| v.split_whitespace().next()?.parse().ok()))
        .unwrap_or(0)
}

#[test]
fn frontend_memory_stays_bounded_under_fuse_and_nbd_load() {
    require_kernel!();
    if !tools(&["fio", "nbdcopy"]) {
        return;
    }
    let tmp = TempDir::new("memload");
    // The default device geometry (4 queues of 8 MiB arenas), FUSE and NBD both on.
    let serve = Serve::start(&tmp.path().join("run"), Some(&small_ram_config("m", "512M", "adaptive")), &["m"]);
    let lo = LoopGuard::attach_direct(&serve.fuse_file("m"));
    let pid = serve.pid();
    let base = anon_kib(pid);
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sampler = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut peak = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                peak = peak.max(anon_kib(pid));
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            peak
        })
    };
    let uri = format!("nbd+unix:///m?socket={}", serve.run_dir.join("nbd.sock").display());
    // Large requests from every side at once: 4 fio jobs of 4 MiB direct writes and reads on the
    // loop device, and nbdcopy writing then reading the device over 4 NBD connections with
    // 32 MiB requests in flight on each.
    let fio = Command::new("timeout")
        .args(["--kill-after=10", "120", "fio", "--name=big", &format!("--filename={}", lo.dev)])
        .args(["--ioengine=libaio", "--direct=1", "--rw=randrw", "--bs=4M", "--iodepth=8", "--numjobs=4"])
        .args(["--size=256M", "--time_based=1", "--runtime=6", "--group_reporting=1", "--output-format=json"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let src = tmp.path().join("src.img");
    std::fs::write(&src, pattern(7, 128 << 20)).unwrap();
    for _ in 0..2 {
        for (from, to) in [(src.to_str().unwrap(), uri.as_str()), (uri.as_str(), "null:")] {
            let st = Command::new("timeout")
                .args(["60", "nbdcopy", "--connections=4", "--requests=16", "--request-size=33554432", "--allocated", from, to])
                .status()
                .unwrap();
            assert!(st.success(), "nbdcopy {from} -> {to}: {st}");
        }
    }
    let out = fio.wait_with_output().unwrap();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let peak = sampler.join().unwrap();
    assert!(out.status.success(), "fio: {}", String::from_utf8_lossy(&out.stdout));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["jobs"][0]["error"], 0);
    assert!(v["jobs"][0]["write"]["io_bytes"].as_u64().unwrap() > 0);
    let st = serve.status_json();
    let now = st["frontend"]["rss"]["anon_kib"].as_u64().unwrap();
    eprintln!("frontend private memory: {base} KiB idle, peak {peak} KiB under load, {now} KiB after");
    // Arenas are shared memory (RssShmem); everything else the frontend holds must stay under
    // 64 MiB however hard it is driven, plus the FUSE rings' buffers where they are used: a
    // fixed 1 MiB per entry of each per-CPU ring.
    let fuse = &st["fuse"];
    let rings_kib = fuse["queues"].as_u64().unwrap_or(0) * fuse["depth"].as_u64().unwrap_or(0) * 1024;
    assert!(peak > base, "the sampler saw no load");
    assert!(peak < 64 * 1024 + rings_kib, "frontend private memory peaked at {peak} KiB under load ({rings_kib} KiB of rings)");
}

#[test]
fn sigterm_with_writes_in_flight_keeps_every_acknowledged_write() {
    require_kernel!();
    let tmp = TempDir::new("drain");
    let img = tmp.path().join("disk.img");
    std::fs::File::create(&img).unwrap().set_len(64 << 20).unwrap();
    let cfg = format!(
        "[[device]]\nname = \"d\"\nnotify = \"irq\"\n[device.backend]\ntype = \"file\"\npath = \"{}\"\ndirect = false\n",
        img.display()
    );
    let mut serve = Serve::start(&tmp.path().join("run"), Some(&cfg), &["d"]);
    let file = serve.fuse_file("d");
    const BLOCK: usize = 64 << 10;
    const PER_WRITER: u64 = 256;
    // Write number n of writer w goes to block w + 4 * (n % 256) with pattern seed 4n + w:
    // four writers cycle over the 64 MiB device with O_DIRECT and no pause until the first
    // error, and each counts the writes acknowledged to it.
    let seed = |w: u64, n: u64| 4 * n + w;
    let block_of = |w: u64, n: u64| w + 4 * (n % PER_WRITER);
    let progress: Vec<std::sync::atomic::AtomicU64> = (0..4).map(|_| Default::default()).collect();
    let acked: Vec<u64> = std::thread::scope(|s| {
        let writers: Vec<_> = (0..4u64)
            .map(|w| {
                let (file, progress) = (&file, &progress);
                s.spawn(move || {
                    use std::os::unix::fs::FileExt;
                    let f = std::fs::OpenOptions::new().write(true).custom_flags(libc::O_DIRECT).open(file).unwrap();
                    let mut buf = vec![0u8; 2 * BLOCK];
                    let pad = buf.as_ptr().align_offset(4096);
                    let mut n = 0u64;
                    loop {
                        buf[pad..pad + BLOCK].copy_from_slice(&pattern(seed(w, n), BLOCK));
                        if f.write_all_at(&buf[pad..pad + BLOCK], block_of(w, n) * BLOCK as u64).is_err() {
                            return n;
                        }
                        n += 1;
                        progress[w as usize].store(n, std::sync::atomic::Ordering::Relaxed);
                    }
                })
            })
            .collect();
        // SIGTERM once every writer has gone round the device at least once.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while progress.iter().any(|p| p.load(std::sync::atomic::Ordering::Relaxed) <= PER_WRITER) {
            assert!(std::time::Instant::now() < deadline, "writers too slow: {progress:?}");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert!(serve.stop().success(), "serve exits 0 on SIGTERM with writers in flight:\n{}", serve.log_text());
        writers.into_iter().map(|h| h.join().unwrap()).collect()
    });
    eprintln!("writes of 64 KiB acknowledged until the shutdown refused more: {acked:?}");
    assert!(acked.iter().all(|&n| n > PER_WRITER), "the writers did not get going before the SIGTERM: {acked:?}");
    // Every block holds its last acknowledged write, or the write that was refused (which may
    // or may not have reached the device before the refusal).
    let raw = std::fs::read(&img).unwrap();
    for (w, &n_acked) in acked.iter().enumerate() {
        let w = w as u64;
        for k in 0..PER_WRITER {
            let block = w + 4 * k;
            let last = (0..n_acked).rev().find(|n| n % PER_WRITER == k).unwrap();
            let at = block as usize * BLOCK;
            let got = &raw[at..at + BLOCK];
            let ok = got == &pattern(seed(w, last), BLOCK)[..]
                || (n_acked % PER_WRITER == k && got == &pattern(seed(w, n_acked), BLOCK)[..]);
            assert!(ok, "writer {w}: block {block} does not hold acknowledged write {last}");
        }
    }
    assert!(!mounted(&tmp.path().join("run").join("fuse")), "FUSE still mounted");
}

/// `bulkhead status` is a health check (0 running, 2 a device failed, 3 no serve), and a
/// domain shows in `ps` as `bulkhead driver DEVICE`, its spec out of sight.
#[test]
fn status_exits_by_health_and_domains_show_their_device_in_ps() {
    require_kernel!();
    let tmp = TempDir::new("health");
    let cfg = "[[device]]\nname = \"h\"\nsize = \"16M\"\nrestart_limit = 1\n[device.backend]\ntype = \"ram\"\n";
    let mut serve = Serve::start(&tmp.path().join("run"), Some(cfg), &["h"]);
    let run_dir = serve.run_dir.clone();
    let code = || Command::new(exe()).args(["status", "--run-dir"]).arg(&run_dir).output().unwrap().status.code();
    assert_eq!(code(), Some(0));
    let pid = serve.driver_pid(0);
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap();
    let args: Vec<String> =
        cmdline.split(|&b| b == 0).filter(|a| !a.is_empty()).map(|a| String::from_utf8_lossy(a).into_owned()).collect();
    assert_eq!(args, ["bulkhead", "driver", "h"], "the domain's command line");
    // With restart_limit = 1 the second death fails the device.
    let state = |s: &Serve| s.status_json()["devices"][0]["state"].as_str().unwrap_or_default().to_string();
    let mut last = 0;
    for _ in 0..2 {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        let mut now = serve.driver_pid(0);
        while (now == 0 || now == last) && state(&serve) == "running" {
            assert!(std::time::Instant::now() < deadline, "no new domain: {}", serve.log_text());
            std::thread::sleep(std::time::Duration::from_millis(20));
            now = serve.driver_pid(0);
        }
        if state(&serve) != "running" {
            break;
        }
        // SAFETY: signalling the device's own domain.
        unsafe { libc::kill(now as i32, libc::SIGKILL) };
        last = now;
    }
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while state(&serve) != "failed" {
        assert!(std::time::Instant::now() < deadline, "the device did not fail: {}", serve.log_text());
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert_eq!(code(), Some(2), "a failed device");
    let out = Command::new(exe()).args(["device", "restart", "h", "--run-dir"]).arg(&run_dir).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(code(), Some(0), "restarted");
    assert!(serve.stop().success());
    assert_eq!(code(), Some(3), "no serve");
}
