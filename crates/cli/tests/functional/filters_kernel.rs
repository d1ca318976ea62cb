//! Filters in a real device: ext4 over FUSE and a loop device with trace, stats, delay and
//! throttle in the chain; blkparse and btt reading the trace; the error filter's failures
//! reaching an application with their errno; throttled requests outlasting the watchdog without
//! a restart; and no acknowledged write lost while the domain holding requests is killed.

#[path = "../common/mod.rs"]
mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use bulkhead_testkit::require_kernel;
use common::*;

fn ram_device(name: &str, size: &str, extra: &str, filters: &str) -> String {
    format!("[[device]]\nname = \"{name}\"\nsize = \"{size}\"\n{extra}[device.backend]\ntype = \"ram\"\n{filters}")
}

fn filter<'a>(status: &'a serde_json::Value, ty: &str) -> &'a serde_json::Value {
    status["devices"][0]["filters"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["type"] == ty)
        .unwrap_or_else(|| panic!("no {ty} in {status}"))
}

#[test]
fn ext4_and_fio_verify_through_four_filters_and_blkparse_reads_the_trace() {
    require_kernel!();
    if !tools(&["fio", "blkparse", "btt"]) {
        return;
    }
    let tmp = TempDir::new("filters");
    let trace = tmp.path().join("f.blktrace");
    let filters = format!(
        "[[device.filter]]\ntype = \"trace\"\npath = \"{}\"\n[[device.filter]]\ntype = \"stats\"\n\
         [[device.filter]]\ntype = \"delay\"\nwrite_us = 100\nflush_us = 300\n[[device.filter]]\ntype = \"throttle\"\n\
         iops = 20000\nbps = \"400M\"\n",
        trace.display()
    );
    let mut serve = Serve::start(&tmp.path().join("run"), Some(&ram_device("f", "256M", "", &filters)), &["f"]);
    let lo = LoopGuard::attach_direct(&serve.fuse_file("f"));
    run("mkfs.ext4", &["-q", "-F", &lo.dev]);
    let mnt = tmp.path().join("mnt");
    let m = MountGuard::mount(&lo.dev, &mnt);
    fio_verify(&mnt, "randrw", "4k-256k", "48M", 6);
    m.unmount();
    let fsck = Command::new("e2fsck").args(["-fn", &lo.dev]).output().unwrap();
    assert!(fsck.status.success(), "e2fsck: {}", String::from_utf8_lossy(&fsck.stdout));
    drop(lo);

    let st = serve.status_json();
    let d = &st["devices"][0];
    assert_eq!(d["tap"], "passthrough");
    let types: Vec<_> = d["filters"].as_array().unwrap().iter().map(|f| f["type"].as_str().unwrap().to_string()).collect();
    assert_eq!(types, ["trace", "stats", "delay", "throttle"]);
    let ops = filter(&st, "stats")["ops"].as_array().unwrap().clone();
    let writes = ops.iter().find(|o| o["op"] == "write").expect("stats counted writes");
    assert!(writes["requests"].as_u64().unwrap() > 100 && writes["errors"] == 0, "{writes}");
    // Below the stats filter each write is delayed 100 µs.
    assert!(writes["mean_us"].as_f64().unwrap() >= 100.0, "{writes}");
    assert!(ops.iter().any(|o| o["op"] == "flush"), "ext4 and fio flush: {ops:?}");
    let delayed = filter(&st, "delay")["delayed"].as_u64().unwrap();
    assert!(delayed >= writes["requests"].as_u64().unwrap(), "delay saw fewer writes than stats below the trace");
    assert_eq!(d["restarts"], 0);

    // Stopping serve ends the domain, which writes out the rest of the trace.
    assert!(serve.stop().success());
    let parsed = Command::new("sh").arg("-c").arg(format!("blkparse -i - < {}", trace.display())).output().unwrap();
    assert!(parsed.status.success(), "blkparse: {}", String::from_utf8_lossy(&parsed.stderr));
    let out = String::from_utf8_lossy(&parsed.stdout).into_owned();
    let total = out.split("Total (240,0):").nth(1).unwrap_or_else(|| panic!("no totals in blkparse output:\n{out}"));
    let field = |name: &str| -> u64 {
        let at = total.find(name).unwrap_or_else(|| panic!("no {name} in\n{total}"));
        total[at + name.len()..].trim_start_matches([':', ' ']).split(',').next().unwrap().trim().parse().unwrap()
    };
    let (wq, wc, rq, rc) = (field("Writes Queued"), field("Writes Completed"), field("Reads Queued"), field("Reads Completed"));
    assert!(wq > 100 && rq > 100, "blkparse saw {wq} writes and {rq} reads queued");
    assert_eq!((wq, rq), (wc, rc), "every queued request completed");
    let summary = Command::new(exe()).args(["trace", "--json"]).arg(&trace).output().unwrap();
    assert!(summary.status.success(), "{}", String::from_utf8_lossy(&summary.stderr));
    let s: serde_json::Value = serde_json::from_slice(&summary.stdout).unwrap();
    let queued =
        |op: &str| s["ops"].as_array().unwrap().iter().find(|o| o["op"] == op).map_or(0, |o| o["queued"].as_u64().unwrap());
    // blktrace counts flushes, discards and write-zeroes as writes.
    let ours_w = queued("write") + queued("flush") + queued("discard") + queued("write_zeroes");
    assert_eq!((ours_w, queued("read")), (wq, rq), "bulkhead trace and blkparse disagree");
    assert_eq!((s["unpaired_completions"].as_u64(), s["in_flight_at_end"].as_u64()), (Some(0), Some(0)));
    // btt writes per-device data files into its working directory: the test's own.
    let btt = Command::new("btt").arg("-i").arg(&trace).current_dir(tmp.path()).output().unwrap();
    let btt_out = String::from_utf8_lossy(&btt.stdout);
    assert!(btt.status.success() && btt_out.contains("Q2C"), "btt: {btt_out}{}", String::from_utf8_lossy(&btt.stderr));
}

/// `dd` of one 4 KiB block at `offset` through the FUSE file with O_DIRECT; its stderr on failure.
fn dd_read(file: &std::path::Path, offset: u64) -> Result<(), String> {
    let out = Command::new("dd")
        .arg(format!("if={}", file.display()))
        .args(["of=/dev/null", "bs=4096", "count=1", "iflag=direct,skip_bytes", &format!("skip={offset}")])
        .output()
        .unwrap();
    if out.status.success() {
        Ok(())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

#[test]
fn error_filter_fails_chosen_reads_with_its_errno_and_its_count_outlives_a_restart() {
    require_kernel!();
    let tmp = TempDir::new("errfilter");
    let filters =
        "[[device.filter]]\ntype = \"error\"\nops = [\"read\"]\noffset = \"1M\"\nlen = \"1M\"\ncount = 2\nerrno = \"ENOSPC\"\n";
    let serve = Serve::start(&tmp.path().join("run"), Some(&ram_device("e", "8M", "", filters)), &["e"]);
    let f = serve.fuse_file("e");
    let e = dd_read(&f, 1 << 20).expect_err("a read in the range must fail");
    assert!(e.contains("No space left on device"), "{e}");
    dd_read(&f, 0).expect("outside the range");
    dd_read(&f, 2 << 20).expect("the range ends at 2M");
    let before = serve.driver_pid(0);
    let r = Command::new(exe()).args(["device", "restart", "e", "--run-dir"]).arg(&serve.run_dir).output().unwrap();
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    assert_ne!(serve.driver_pid(0), before);
    let e = dd_read(&f, (1 << 20) + 4096).expect_err("one failure is left after the restart");
    assert!(e.contains("No space left on device"), "{e}");
    dd_read(&f, 1 << 20).expect("count = 2 is spent for the life of the device");
    let st = serve.status_json();
    let ef = filter(&st, "error");
    assert_eq!((ef["matched"].as_u64(), ef["injected"].as_u64()), (Some(3), Some(2)), "{ef}");
}

#[test]
fn throttled_requests_outlast_the_watchdog_without_a_restart() {
    require_kernel!();
    let tmp = TempDir::new("throttle");
    // Two writes a second: after the first, each waits about half a second, more than twice the
    // 200 ms watchdog.
    let filters = "[[device.filter]]\ntype = \"throttle\"\niops_write = 2\n";
    let serve = Serve::start(&tmp.path().join("run"), Some(&ram_device("t", "8M", "watchdog_ms = 200\n", filters)), &["t"]);
    let start = Instant::now();
    let out = Command::new("dd")
        .arg(format!("of={}", serve.fuse_file("t").display()))
        .args(["if=/dev/zero", "bs=4096", "count=4", "oflag=direct", "conv=notrunc"])
        .output()
        .unwrap();
    let took = start.elapsed();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(took >= Duration::from_millis(1200), "4 writes at 2/s took only {took:?}");
    let st = serve.status_json();
    assert_eq!(st["devices"][0]["restarts"], 0, "the watchdog restarted a domain that was throttling: {}", serve.log_text());
    assert!(filter(&st, "throttle")["throttled"].as_u64().unwrap() >= 3);
    // Reads have no limit: they pass at once.
    let start = Instant::now();
    dd_read(&serve.fuse_file("t"), 0).unwrap();
    assert!(start.elapsed() < Duration::from_millis(400));
}

#[test]
fn domain_kills_while_filters_hold_requests_lose_no_acknowledged_write() {
    require_kernel!();
    if !tools(&["fio"]) {
        return;
    }
    let tmp = TempDir::new("filterkill");
    let filters = "[[device.filter]]\ntype = \"stats\"\n[[device.filter]]\ntype = \"delay\"\ndelay_us = 200\n\
                   [[device.filter]]\ntype = \"throttle\"\niops = 3000\n";
    let cfg = ram_device("k", "256M", "restart_limit = 100000\n", filters);
    let serve = Serve::start(&tmp.path().join("run"), Some(&cfg), &["k"]);
    let lo = LoopGuard::attach_direct(&serve.fuse_file("k"));
    run("mkfs.ext4", &["-q", "-F", &lo.dev]);
    let mnt = tmp.path().join("mnt");
    let m = MountGuard::mount(&lo.dev, &mnt);
    let killer = DomainKiller::start(serve.run_dir.clone(), || Duration::from_millis(300), driver_domain);
    fio_verify(&mnt, "randrw", "4k-256k", "48M", 8);
    let kills = killer.stop().first().copied().unwrap_or(0);
    assert!(kills >= 10, "only {kills} kills landed");
    m.unmount();
    let fsck = Command::new("e2fsck").args(["-fn", &lo.dev]).output().unwrap();
    assert!(fsck.status.success(), "e2fsck: {}", String::from_utf8_lossy(&fsck.stdout));
    let st = serve.status_json();
    assert!(st["devices"][0]["restarts"].as_u64().unwrap() >= kills as u64);
    assert_eq!(st["devices"][0]["state"], "running");
    // The counters carried on across every generation.
    let writes =
        filter(&st, "stats")["ops"].as_array().unwrap().iter().find(|o| o["op"] == "write").unwrap()["requests"].as_u64();
    assert!(writes.unwrap() > 500, "{writes:?}");
}

#[test]
fn ext4_and_fio_verify_through_a_cats_scheduler_over_a_vpt_with_domain_kills() {
    require_kernel!();
    if !tools(&["fio"]) {
        return;
    }
    let tmp = TempDir::new("vpt");
    // A small locked k keeps the modelled disk quick: about 0.1 ms a request.
    let filters = "[[device.filter]]\ntype = \"scheduler\"\npolicy = \"cats\"\n\
                   [[device.filter]]\ntype = \"vpt\"\nk = 0.03\nlock_k = true\n";
    let cfg = ram_device("v", "128M", "restart_limit = 100000\n", filters);
    let serve = Serve::start(&tmp.path().join("run"), Some(&cfg), &["v"]);
    let lo = LoopGuard::attach_direct(&serve.fuse_file("v"));
    run("mkfs.ext4", &["-q", "-F", &lo.dev]);
    let mnt = tmp.path().join("mnt");
    let m = MountGuard::mount(&lo.dev, &mnt);
    let killer = DomainKiller::start(serve.run_dir.clone(), || Duration::from_millis(400), driver_domain);
    fio_verify(&mnt, "randrw", "4k-64k", "16M", 4);
    let kills = killer.stop().first().copied().unwrap_or(0);
    m.unmount();
    let fsck = Command::new("e2fsck").args(["-fn", &lo.dev]).output().unwrap();
    assert!(fsck.status.success(), "e2fsck: {}", String::from_utf8_lossy(&fsck.stdout));
    drop(lo);
    let st = serve.status_json();
    assert!(kills >= 3, "only {kills} kills landed");
    assert!(st["devices"][0]["restarts"].as_u64().unwrap() >= kills as u64);
    let vpt = filter(&st, "vpt");
    assert_eq!((vpt["k"].as_f64(), vpt["locked"].as_bool(), vpt["held"].as_u64()), (Some(0.03), Some(true), Some(0)), "{vpt}");
    assert!(vpt["requests"].as_u64().unwrap() > 500, "{vpt}");
    let sched = filter(&st, "scheduler");
    assert_eq!(sched["policy"].as_str(), Some("cats"), "{sched}");
    // A request may still be on its way as the status is read; it is served too, and
    // nothing stays queued.
    let deadline = Instant::now() + Duration::from_secs(5);
    while filter(&serve.status_json(), "scheduler")["queued"] != 0 {
        assert!(Instant::now() < deadline, "a request stays queued: {}", filter(&serve.status_json(), "scheduler"));
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(sched["dispatched"].as_u64().unwrap() > 500, "{sched}");
}

#[test]
fn a_vpt_read_completes_no_sooner_than_k_times_the_modelled_access() {
    require_kernel!();
    let tmp = TempDir::new("vptk");
    // k = 4 with no cache: every read waits at least 4 × half a rotation (8 ms), plus its seek.
    let filters = "[[device.filter]]\ntype = \"vpt\"\nk = 4.0\nlock_k = true\ncache = false\n";
    let serve = Serve::start(&tmp.path().join("run"), Some(&ram_device("m", "64M", "", filters)), &["m"]);
    for i in 0..5u64 {
        let start = Instant::now();
        dd_read(&serve.fuse_file("m"), i * (12 << 20)).unwrap();
        let took = start.elapsed();
        assert!(took >= Duration::from_millis(8), "read {i} took only {took:?}");
    }
    let st = serve.status_json();
    let vpt = filter(&st, "vpt");
    assert!(vpt["requests"].as_u64().unwrap() >= 5 && vpt["cache_hits"] == 0, "{vpt}");
}
