//! `type = "vdev"` devices end to end: a generated card's model in its device-model domain,
//! the reference driver in the driver domain, ext4, fsck and fio through FUSE and a loop
//! device, NBD, a hostile driver and a model that dies.

#[path = "../common/mod.rs"]
mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use bulkhead_testkit::require_kernel;
use common::*;

/// Devices per `serve` in the fifty-card test.
const PER_SERVE: u64 = 10;

fn vdev_device(name: &str, seed: u64, wait: &str, size: &str) -> String {
    format!(
        "[[device]]\nname = \"{name}\"\nsize = \"{size}\"\nqueues = 1\nqueue_depth = 16\narena = \"4M\"\n\
         [device.backend]\ntype = \"vdev\"\nseed = {seed}\nwait = \"{wait}\"\n"
    )
}

/// fio writes `size` of random blocks (4 KiB to 256 KiB: more than one command on most
/// cards) into a file on `dir` and reads every one back with its checksum.
fn fio_write_and_verify(dir: &std::path::Path, size: &str) {
    let out = Command::new("timeout")
        .args(["--kill-after=10", "120", "fio", "--name=verify", &format!("--directory={}", dir.display())])
        .args(["--ioengine=libaio", "--direct=1", "--rw=randwrite", "--bsrange=4k-256k", "--iodepth=8"])
        .args([&format!("--size={size}"), "--verify=crc32c", "--verify_fatal=1", "--verify_state_save=0"])
        .args(["--output-format=json"])
        .output()
        .unwrap();
    assert!(out.status.success(), "fio: {}\n{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["jobs"][0]["error"], 0, "fio saw an I/O or verify error");
    assert!(v["jobs"][0]["read"]["io_bytes"].as_u64().unwrap() > 0, "fio verified nothing");
}

/// The proof: fifty generated cards, each a different register map, descriptor layout
/// and set of codes, every one driven by the reference driver from its spec alone, half taking
/// interrupts and half polling: mkfs.ext4, fio verify on the file system, e2fsck clean.
#[test]
fn fifty_generated_cards_hold_ext4_and_pass_fio_verify() {
    require_kernel!();
    if !tools(&["fio", "mkfs.ext4", "e2fsck"]) {
        return;
    }
    let t0 = Instant::now();
    for batch in 0..50 / PER_SERVE {
        let tmp = TempDir::new("vdev50");
        let seeds: Vec<u64> = (batch * PER_SERVE..(batch + 1) * PER_SERVE).collect();
        let names: Vec<String> = seeds.iter().map(|s| format!("card{s}")).collect();
        let config: String = seeds
            .iter()
            .zip(&names)
            .map(|(&s, n)| vdev_device(n, s, if s.is_multiple_of(2) { "interrupt" } else { "poll" }, "64M"))
            .collect();
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        let mut serve = Serve::start(&tmp.path().join("run"), Some(&config), &refs);
        for name in &names {
            let mnt = tmp.path().join(format!("mnt-{name}"));
            let mut fs = Ext4::make(&serve.fuse_file(name), &mnt);
            fio_write_and_verify(&fs.mnt, "8M");
            fs.unmount_and_check();
        }
        let status = serve.status_json();
        for (i, d) in status["devices"].as_array().unwrap().iter().enumerate() {
            assert_eq!(d["state"], "running", "{}", serve.log_text());
            assert_eq!(d["restarts"], 0, "{}: restarted: {}", names[i], serve.log_text());
            assert_eq!(d["requests_failed"], 0, "{}", names[i]);
            let card = &d["card"];
            assert_eq!(card["model_starts"], 1);
            assert_eq!(card["stats"]["refused"], 0, "{}: the card refused the reference driver's commands", names[i]);
            assert!(card["stats"]["commands"].as_u64().unwrap() > 100, "{}: {card}", names[i]);
            assert!(card["stats"]["trapped_writes"].as_u64().unwrap() > 0, "{}: {card}", names[i]);
            let waits_for_interrupts = seeds[i].is_multiple_of(2);
            assert_eq!(card["stats"]["interrupts"].as_u64().unwrap() > 0, waits_for_interrupts, "{}: {card}", names[i]);
        }
        assert!(serve.stop().success(), "{}", serve.log_text());
    }
    eprintln!("fifty cards in {:.1} s", t0.elapsed().as_secs_f64());
}

/// A hostile driver sends the model junk for a trap, drives the card outside its DMA memory,
/// posts bad and random descriptors and storms the registers: the card answers each mistake
/// as its datasheet says, the model's domain keeps serving, the wedged driver is replaced by
/// the watchdog, and the next driver finds the card working and the data intact; NBD serves
/// the same bytes as FUSE.
#[test]
fn a_hostile_driver_leaves_the_model_serving_and_is_replaced() {
    require_kernel!();
    let tmp = TempDir::new("vdev-hostile");
    let config = vdev_device("h", 11, "interrupt", "64M").replace("[device.backend]", "watchdog_ms = 300\n[device.backend]");
    let Some(serve) =
        Serve::start_test_driver(&tmp.path().join("run"), Some(&config), &["h"], &[("BULKHEAD_TEST_FAULT", "vdev-hostile")])
    else {
        return;
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    while !serve.log_text().contains("hostile vdev: done") {
        assert!(!serve.log_text().contains("hostile vdev: FAILED"), "{}", serve.log_text());
        assert!(Instant::now() < deadline, "the hostile driver did not finish: {}", serve.log_text());
        std::thread::sleep(Duration::from_millis(50));
    }
    let before = serve.status_json()["devices"][0].clone();
    let model_pid = before["card"]["model_pid"].as_u64().unwrap();
    assert_ne!(model_pid, 0);
    let hostile_pid = before["driver_pid"].as_u64().unwrap();

    // A write now waits on the wedged driver until the watchdog replaces it.
    let data = pattern(17, 1 << 20);
    let file = serve.fuse_file("h");
    write_direct(&file, 3 << 20, &data, &serve);
    assert_eq!(read_direct(&file, 3 << 20, data.len()), data);

    let d = serve.status_json()["devices"][0].clone();
    assert_eq!(d["state"], "running");
    assert!(d["restarts"].as_u64().unwrap() >= 1, "{d}");
    assert_ne!(d["driver_pid"].as_u64().unwrap(), hostile_pid, "the hostile driver was replaced");
    assert!(serve.log_text().contains(&format!("driver domain (pid {hostile_pid}) ")), "{}", serve.log_text());
    let card = &d["card"];
    assert_eq!(card["model_pid"].as_u64().unwrap(), model_pid, "the model's domain lived through it all: {}", serve.log_text());
    assert_eq!(card["model_starts"], 1);
    let st = &card["stats"];
    assert!(st["refused_traps"].as_u64().unwrap() >= 3, "junk on the trap line refused: {st}");
    assert!(st["drivers"].as_u64().unwrap() >= 2, "{st}");
    assert!(st["refused"].as_u64().unwrap() >= 8, "every bad command answered with an error status: {st}");
    assert!(st["stops"].as_u64().unwrap() >= 4, "bad rings and a bad doorbell stop the card: {st}");
    // Most of a storm lands while the page is open for an earlier write: the model looks once
    // for the lot.
    assert!(serve.log_text().contains(&format!("{} storm writes", bulkhead_testkit::hostile_vdev::STORM_WRITES)));
    assert!(st["trapped_writes"].as_u64().unwrap() > 16, "{st}");
    assert_eq!(card["model_sandbox"]["seccomp_role"], "vdev-model");
    if tools(&["nbdcopy"]) {
        nbd_and_fuse_agree(&serve, "h", tmp.path());
    }
}

/// The model's domain killed under load: the device restarts with a new model over the same
/// storage, every acknowledged write is there, and NBD reads the same bytes as FUSE once the
/// file system is unmounted (the models started under the mount hold no copy of it).
#[test]
fn a_model_killed_under_load_comes_back_with_the_data() {
    require_kernel!();
    if !tools(&["fio", "mkfs.ext4", "e2fsck"]) {
        return;
    }
    let tmp = TempDir::new("vdev-model");
    let config = format!("[nbd]\nenabled = true\n{}", vdev_device("m", 5, "poll", "128M"));
    let serve = Serve::start(&tmp.path().join("run"), Some(&config), &["m"]);
    let mut fs = Ext4::make(&serve.fuse_file("m"), &tmp.path().join("mnt"));
    let killer = DomainKiller::start(
        serve.run_dir.clone(),
        || Duration::from_millis(700),
        |d, kills| {
            let pid = if kills < 3 { d["card"]["model_pid"].as_u64().unwrap_or(0) as u32 } else { 0 };
            (0, pid, u64::from(pid))
        },
    );
    fio_verify(&fs.mnt, "randrw", "4k-128k", "16M", 4);
    let kills = killer.stop();
    fs.unmount_and_check();
    assert!(kills.first().copied().unwrap_or(0) >= 2, "models killed: {kills:?}");
    let d = serve.status_json()["devices"][0].clone();
    assert_eq!(d["state"], "running", "{}", serve.log_text());
    assert_eq!(d["requests_failed"], 0, "{}", serve.log_text());
    assert!(d["card"]["model_starts"].as_u64().unwrap() >= 3, "{d}");
    assert!(serve.log_text().contains("device model (pid"), "{}", serve.log_text());
    if tools(&["nbdcopy"]) {
        nbd_and_fuse_agree(&serve, "m", tmp.path());
    }
}

/// Asserts that NBD serves device `name` of `serve` with the same bytes as FUSE (read with
/// O_DIRECT); on a difference, says where and whether reading again agrees.
fn nbd_and_fuse_agree(serve: &Serve, name: &str, scratch: &std::path::Path) {
    let via_nbd = scratch.join("via-nbd");
    run("nbdcopy", &[&serve.nbd_uri(name), via_nbd.to_str().unwrap()]);
    let nbd = std::fs::read(&via_nbd).unwrap();
    let fuse = read_direct(&serve.fuse_file(name), 0, nbd.len());
    let differ: Vec<usize> = (0..nbd.len() / 4096).filter(|&b| nbd[b * 4096..][..4096] != fuse[b * 4096..][..4096]).collect();
    if !differ.is_empty() {
        let again = read_direct(&serve.fuse_file(name), 0, nbd.len());
        run("nbdcopy", &[&serve.nbd_uri(name), via_nbd.to_str().unwrap()]);
        let nbd2 = std::fs::read(&via_nbd).unwrap();
        let b = differ[0] * 4096;
        panic!(
            "{} blocks differ between NBD and FUSE, first at {b}; FUSE again same as FUSE: {}, NBD again same as NBD: {}, \
             NBD again same as FUSE: {}\n{}",
            differ.len(),
            again[b..b + 4096] == fuse[b..b + 4096],
            nbd2[b..b + 4096] == nbd[b..b + 4096],
            nbd2[b..b + 4096] == fuse[b..b + 4096],
            serve.log_text()
        );
    }
    let _ = std::fs::remove_file(&via_nbd);
}

fn write_direct(file: &std::path::Path, offset: u64, data: &[u8], serve: &Serve) {
    use std::os::unix::fs::{FileExt, OpenOptionsExt};
    let f = std::fs::OpenOptions::new().write(true).custom_flags(libc::O_DIRECT).open(file).unwrap();
    let buf = aligned(data);
    if let Err(e) = f.write_all_at(&buf[..data.len()], offset) {
        panic!("write to {}: {e}: {}", file.display(), serve.log_text());
    }
}

fn read_direct(file: &std::path::Path, offset: u64, len: usize) -> Vec<u8> {
    use std::os::unix::fs::{FileExt, OpenOptionsExt};
    let f = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_DIRECT).open(file).unwrap();
    let mut buf = aligned(&vec![0u8; len]);
    f.read_exact_at(&mut buf[..len], offset).unwrap();
    buf[..len].to_vec()
}

/// `data` in a 4 KiB-aligned buffer (what O_DIRECT needs).
fn aligned(data: &[u8]) -> bulkhead_testkit::AlignedBuf {
    bulkhead_testkit::AlignedBuf::from_slice(data)
}

/// `bulkhead-bench vdev` runs end to end and reports every figure it names (the figures
/// themselves are recorded in docs/BENCHMARKS.md, not checked here).
#[test]
fn bench_vdev_reports_latency_iops_and_the_trap_cost() {
    require_kernel!();
    let out = Command::new(bench_exe())
        .args(["vdev", "--size", "16M", "--requests", "200", "--seconds", "1", "--writes", "200", "--json"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let systems: Vec<&str> = r["rows"].as_array().unwrap().iter().map(|x| x["system"].as_str().unwrap()).collect();
    assert_eq!(systems, ["vdev-interrupt", "vdev-poll", "ram"]);
    for row in r["rows"].as_array().unwrap() {
        for key in ["read_mean_us", "read_p99_us", "write_mean_us", "qd16_read_iops", "qd16_write_iops"] {
            assert!(row[key].as_f64().unwrap() > 0.0, "{key}: {row}");
        }
    }
    for row in &r["rows"].as_array().unwrap()[..2] {
        assert!(row["trapped_per_request"].as_f64().unwrap() > 0.0, "a vdev request rings the card's doorbell: {row}");
    }
    assert!(r["rows"][0]["commands_per_interrupt"].as_f64().unwrap() >= 1.0);
    assert!(r["rows"][1]["commands_per_interrupt"].is_null(), "a polling driver takes no interrupts");
    let t = &r["trap"];
    assert_eq!(t["writes"], 200);
    assert!(t["trapped_mean_us"].as_f64().unwrap() * 1000.0 > t["untrapped_mean_ns"].as_f64().unwrap());
    assert!(t["round_trip_mean_us"].as_f64().unwrap() >= t["trapped_p50_us"].as_f64().unwrap() * 0.5);
}
