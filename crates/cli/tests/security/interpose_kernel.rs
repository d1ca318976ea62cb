//! Tap domains. `tap = "interpose"`: the filters run in a tap domain of their own between the
//! frontend and the driver domain. Through the real kernel: a three-filter chain under ext4 and
//! fio verify while the tap domain and the driver domain are each killed again and again, and
//! each replaced alone while the other runs on; a driver domain breaking the channel below the
//! tap domain; a hostile tap domain; status naming both domains.
//! `tap = "intercept"`: one tap domain terminates every request in a soft device, and refuses a
//! device node. Mode switches among all three under load.

#[path = "../common/mod.rs"]
mod common;

use std::process::Command;
use std::time::Duration;

use bulkhead_testkit::require_kernel;
use common::*;

fn interpose_config(name: &str, extra: &str, filters: &str) -> String {
    format!(
        "[[device]]\nname = \"{name}\"\nsize = \"256M\"\ntap = \"interpose\"\n{extra}[device.backend]\ntype = \"ram\"\n{filters}"
    )
}

const THREE: &str = "[[device.filter]]\ntype = \"stats\"\n[[device.filter]]\ntype = \"delay\"\nwrite_us = 50\n\
                     [[device.filter]]\ntype = \"throttle\"\niops = 20000\n";

#[test]
fn status_names_the_tap_domain_and_the_driver_domain_with_their_sandboxes() {
    require_kernel!();
    let tmp = TempDir::new("interpose-status");
    let serve = Serve::start(&tmp.path().join("run"), Some(&interpose_config("s", "", THREE)), &["s"]);
    let st = serve.status_json();
    let d = &st["devices"][0];
    let (tap, driver) = (d["tap_pid"].as_u64().unwrap(), d["driver_pid"].as_u64().unwrap());
    assert!(tap > 0 && driver > 0 && tap != driver, "{d}");
    assert_eq!(d["tap"], "interpose");
    assert_eq!(d["tap_sandbox"]["seccomp_role"], "tap", "{d}");
    assert_eq!(d["sandbox"]["seccomp_role"], "memory", "{d}");
    // Both are separate sandboxed processes, neither a child of the other.
    let ppid = |pid: u64| -> u64 {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
        stat[stat.rfind(')').unwrap() + 2..].split_whitespace().nth(1).unwrap().parse().unwrap()
    };
    assert_eq!((ppid(tap), ppid(driver)), (serve.pid() as u64, serve.pid() as u64));
}

#[test]
fn three_filter_tap_under_fio_verify_survives_killing_the_tap_and_the_driver_domain() {
    require_kernel!();
    if !tools(&["fio"]) {
        return;
    }
    let tmp = TempDir::new("interpose-kill");
    let cfg = interpose_config("k", "restart_limit = 100000\n", THREE);
    let serve = Serve::start(&tmp.path().join("run"), Some(&cfg), &["k"]);
    let mut fs = Ext4::make(&serve.fuse_file("k"), &tmp.path().join("mnt"));
    let mnt = fs.mnt.clone();
    // The tap domain and the driver domain in turn, each process once. A driver domain killed
    // below a running tap domain is replaced alone: the tap domain it was under is then killed
    // next, so every tap domain killed has seen its driver domain replaced at least once.
    let killer = DomainKiller::start(
        serve.run_dir.clone(),
        || Duration::from_millis(250),
        |d, kills| {
            let tap = d["tap_pid"].as_u64().unwrap_or(0);
            let kind = (kills % 2) as usize;
            let victim = if kind == 0 { d["driver_pid"].as_u64().unwrap_or(0) } else { tap };
            let victim = if tap == 0 { 0 } else { victim };
            (kind, victim as u32, victim)
        },
    );
    fio_verify(&mnt, "randrw", "4k-256k", "48M", 8);
    let kills = killer.stop();
    let (drivers, taps) = (kills.first().copied().unwrap_or(0), kills.get(1).copied().unwrap_or(0));
    assert!(taps >= 5 && drivers >= 5, "only {taps} tap and {drivers} driver kills landed");
    fs.unmount_and_check();
    let st = serve.status_json();
    let d = &st["devices"][0];
    assert_eq!(d["state"], "running");
    assert!(d["restarts"].as_u64().unwrap() >= (taps + drivers) as u64, "{d}");
    let log = serve.log_text();
    // A driver domain below is seen either once it has exited or while it exits (the watcher
    // finds its memory released first when the tap domain waits on it).
    let below_seen = log.contains("below the tap domain exited") || log.contains("below the tap domain is exiting");
    assert!(log.contains("tap domain (pid") && below_seen, "{log}");
    // Driver domains were replaced under a tap domain that ran on, and tap domains over a
    // driver domain that ran on.
    assert!(log.contains("replacing it (the tap domain runs on)"), "{log}");
    assert!(log.contains("replacing it (the driver domain below runs on)"), "{log}");
    // Each new domain was told only what was meant for it.
    assert!(!log.contains("protocol violation"), "{log}");
    eprintln!("{taps} tap and {drivers} driver kills; outage p99 {} ms", d["p99_outage_ms"]);
}

/// Writes 8 MiB through an interpose device whose `role` domain (`tap` or `driver`) turns hostile
/// as `mode` says, reads it back and compares; returns serve's log once at least two restarts
/// replaced the misbehaving generations.
#[test]
fn a_driver_domain_killed_below_a_tap_domain_is_replaced_alone_under_fio_verify() {
    require_kernel!();
    if !tools(&["fio"]) {
        return;
    }
    let tmp = TempDir::new("interpose-below");
    let cfg = interpose_config("b", "restart_limit = 100000\n", THREE);
    let serve = Serve::start(&tmp.path().join("run"), Some(&cfg), &["b"]);
    let tap = serve.status_json()["devices"][0]["tap_pid"].as_u64().unwrap();
    let mut fs = Ext4::make(&serve.fuse_file("b"), &tmp.path().join("mnt"));
    let mnt = fs.mnt.clone();
    let killer = DomainKiller::start(
        serve.run_dir.clone(),
        || Duration::from_millis(200),
        |d, _| {
            let driver = d["driver_pid"].as_u64().unwrap_or(0) as u32;
            (0, driver, driver as u64)
        },
    );
    fio_verify(&mnt, "randrw", "4k-256k", "48M", 6);
    let kills = killer.stop()[0];
    assert!(kills >= 8, "only {kills} driver kills landed");
    fs.unmount_and_check();
    let st = serve.status_json();
    let d = &st["devices"][0];
    // The same tap domain throughout, its filters' state in hand; a new driver domain each time.
    assert_eq!(d["tap_pid"].as_u64(), Some(tap), "{}", serve.log_text());
    assert_eq!((d["state"].as_str(), d["requests_failed"].as_u64()), (Some("running"), Some(0)), "{d}");
    assert!(d["restarts"].as_u64().unwrap() >= kills as u64, "{d}");
    let log = serve.log_text();
    assert!(!log.contains("restarting"), "the pair was restarted: {log}");
    eprintln!("{kills} driver kills below one tap domain; outage p99 {} ms", d["p99_outage_ms"]);
}

#[test]
fn a_tap_domain_killed_over_a_driver_domain_is_replaced_alone_under_fio_verify() {
    require_kernel!();
    if !tools(&["fio"]) {
        return;
    }
    let tmp = TempDir::new("interpose-above");
    let cfg = interpose_config("a", "restart_limit = 100000\n", THREE);
    let serve = Serve::start(&tmp.path().join("run"), Some(&cfg), &["a"]);
    let driver = serve.status_json()["devices"][0]["driver_pid"].as_u64().unwrap();
    let mut fs = Ext4::make(&serve.fuse_file("a"), &tmp.path().join("mnt"));
    let mnt = fs.mnt.clone();
    let killer = DomainKiller::start(
        serve.run_dir.clone(),
        || Duration::from_millis(200),
        |d, _| {
            let tap = d["tap_pid"].as_u64().unwrap_or(0) as u32;
            (0, tap, tap as u64)
        },
    );
    fio_verify(&mnt, "randrw", "4k-256k", "48M", 6);
    let kills = killer.stop()[0];
    assert!(kills >= 8, "only {kills} tap kills landed");
    fs.unmount_and_check();
    let st = serve.status_json();
    let d = &st["devices"][0];
    // The same driver domain throughout; a new tap domain each time, its filters' figures
    // carried on in their state pages.
    assert_eq!(d["driver_pid"].as_u64(), Some(driver), "{}", serve.log_text());
    assert_eq!((d["state"].as_str(), d["requests_failed"].as_u64()), (Some("running"), Some(0)), "{d}");
    assert!(d["restarts"].as_u64().unwrap() >= kills as u64, "{d}");
    let writes = d["filters"][0]["ops"].as_array().unwrap().iter().find(|o| o["op"] == "write").unwrap()["requests"].as_u64();
    assert!(writes.unwrap() > 200, "{writes:?}");
    let log = serve.log_text();
    assert!(log.contains("replacing it (the driver domain below runs on)"), "{log}");
    assert!(!log.contains("restarting") && !log.contains("protocol violation"), "the pair was restarted: {log}");
    eprintln!("{kills} tap kills over one driver domain; outage p99 {} ms", d["p99_outage_ms"]);
}

fn survive_hostile(role: &str, mode: &str) -> Option<String> {
    survive_hostile_with(role, mode, "")
}

/// [`survive_hostile`] with more device keys (`extra`, one per line).
fn survive_hostile_with(role: &str, mode: &str, extra: &str) -> Option<String> {
    let tmp = TempDir::new(&format!("interpose-hostile-{role}"));
    let keys = format!("restart_limit = 100000\n{extra}");
    let cfg = interpose_config("h", &keys, "[[device.filter]]\ntype = \"stats\"\n");
    let fault = format!("hostile:{mode}");
    let env = [("BULKHEAD_TEST_FAULT", fault.as_str()), ("BULKHEAD_TEST_FAULT_ROLE", role)];
    let serve = Serve::start_test_driver(&tmp.path().join("run"), Some(&cfg), &["h"], &env)?;
    let file = serve.fuse_file("h");
    let data = pattern(0x1e7, 8 << 20);
    let src = tmp.path().join("src");
    let back = tmp.path().join("back");
    std::fs::write(&src, &data).unwrap();
    dd(&src, &file, &["bs=64k", "oflag=direct", "conv=notrunc"]);
    dd(&file, &back, &["bs=64k", "count=128", "iflag=direct"]);
    assert!(std::fs::read(&back).unwrap() == data, "{role} {mode}: data read back differs\n{}", serve.log_text());
    let st = serve.status_json();
    assert!(st["devices"][0]["restarts"].as_u64().unwrap() >= 2, "{st}");
    let log = serve.log_text();
    assert!(log.contains(&format!("hostile test mode {mode}: misbehaving")), "{log}");
    Some(log)
}

#[test]
fn a_driver_domain_breaking_the_channel_below_the_tap_is_caught_and_both_restart() {
    require_kernel!();
    let Some(log) = survive_hostile("driver", "unknown-id") else { return };
    assert!(log.contains("lost the driver domain below it"), "{log}");
    assert!(log.contains("unknown or duplicate id"), "the tap domain says why: {log}");
}

#[test]
fn a_driver_domain_wedged_below_the_tap_does_not_let_go_and_both_are_replaced() {
    require_kernel!();
    // The tap domain waits on the wedged domain below and answers nothing: the watchdog blames
    // it, and its replacement alone is tried first; the driver domain below cannot let go of
    // its queues, so both go.
    let Some(log) = survive_hostile_with("driver", "stop-answering", "watchdog_ms = 300\n") else { return };
    assert!(log.contains("tap domain (pid") && log.contains("did not follow in time; restarting"), "{log}");
}

#[test]
fn a_hostile_tap_domain_is_caught_by_the_frontend_and_replaced_alone() {
    require_kernel!();
    let Some(log) = survive_hostile("tap", "duplicate-id") else { return };
    assert!(log.contains("tap domain (pid") && log.contains("broke the channel protocol"), "{log}");
    assert!(log.contains("replacing it (the driver domain below runs on)"), "{log}");
}

fn cli(run_dir: &std::path::Path, args: &[&str]) -> Result<String, String> {
    let out = Command::new(exe()).args(args).arg("--run-dir").arg(run_dir).output().unwrap();
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

fn chain(serve: &Serve) -> (String, Vec<String>) {
    let st = serve.status_json();
    let d = &st["devices"][0];
    let filters = d["filters"].as_array().unwrap().iter().map(|f| f["type"].as_str().unwrap().to_string()).collect();
    (d["tap"].as_str().unwrap().to_string(), filters)
}

#[test]
fn tap_mode_switches_and_filter_changes_under_fio_verify_fail_nothing() {
    require_kernel!();
    if !tools(&["fio"]) {
        return;
    }
    let tmp = TempDir::new("interpose-switch");
    let cfg =
        "[[device]]\nname = \"w\"\nsize = \"256M\"\n[device.backend]\ntype = \"ram\"\n[[device.filter]]\ntype = \"stats\"\n";
    let serve = Serve::start(&tmp.path().join("run"), Some(cfg), &["w"]);
    let run_dir = serve.run_dir.clone();
    let mut fs = Ext4::make(&serve.fuse_file("w"), &tmp.path().join("mnt"));
    let mnt = fs.mnt.clone();
    let fio = {
        let dir = mnt.clone();
        std::thread::spawn(move || fio_verify(&dir, "randrw", "4k-128k", "32M", 8))
    };
    let pause = || std::thread::sleep(Duration::from_millis(700));
    pause();
    cli(&run_dir, &["device", "tap", "w", "interpose"]).unwrap();
    assert_eq!(chain(&serve), ("interpose".into(), vec!["stats".into()]));
    pause();
    let driver = serve.status_json()["devices"][0]["driver_pid"].clone();
    cli(&run_dir, &["filter", "add", "w", "--at", "0", "type = \"delay\"", "write_us = 100"]).unwrap();
    cli(&run_dir, &["filter", "add", "w", "type = \"throttle\"", "iops = 50000"]).unwrap();
    assert_eq!(chain(&serve).1, ["delay", "stats", "throttle"]);
    // Filters in a tap domain of their own change that domain alone.
    assert_eq!(serve.status_json()["devices"][0]["driver_pid"], driver);
    pause();
    // Intercept: one tap domain, which is the driver domain too.
    cli(&run_dir, &["device", "tap", "w", "intercept"]).unwrap();
    let st = serve.status_json();
    let d = &st["devices"][0];
    assert_eq!(d["tap"], "intercept");
    assert_eq!(d["tap_pid"], d["driver_pid"], "{d}");
    assert_eq!(d["tap_sandbox"]["seccomp_role"], "memory", "{d}");
    pause();
    cli(&run_dir, &["device", "tap", "w", "interpose"]).unwrap();
    // A bad table is refused, naming the key and its line, and the device runs on unchanged.
    let e = cli(&run_dir, &["filter", "add", "w", "type = \"delay\"", "flush_us = 99999999"]).unwrap_err();
    assert!(e.contains("flush_us") && e.contains("line 2"), "{e}");
    let e = cli(&run_dir, &["filter", "remove", "w", "7"]).unwrap_err();
    assert!(e.contains("no filter at position 7"), "{e}");
    let e = cli(&run_dir, &["device", "tap", "w", "sideways"]).unwrap_err();
    assert!(e.contains("sideways"), "{e}");
    pause();
    cli(&run_dir, &["device", "tap", "w", "passthrough"]).unwrap();
    pause();
    cli(&run_dir, &["filter", "remove", "w", "0"]).unwrap();
    assert_eq!(chain(&serve), ("passthrough".into(), vec!["stats".into(), "throttle".into()]));
    fio.join().expect("fio verified every block");
    fs.unmount_and_check();
    let st = serve.status_json();
    let d = &st["devices"][0];
    assert_eq!(d["state"], "running");
    assert_eq!(d["requests_failed"], 0, "{d}");
    // The stats filter's counters carried on through every change.
    let writes = d["filters"][0]["ops"].as_array().unwrap().iter().find(|o| o["op"] == "write").unwrap()["requests"].as_u64();
    assert!(writes.unwrap() > 200, "{writes:?}");
    let log = serve.log_text();
    for what in [
        "tap mode passthrough → interpose",
        "filter delay inserted at position 0",
        "tap mode interpose → intercept",
        "tap mode intercept → interpose",
        "filter delay at position 0 removed",
    ] {
        assert!(log.contains(what), "{what}: {log}");
    }
}

/// The pids of `serve`'s children: its domains.
fn domains_of(serve: &Serve) -> Vec<u32> {
    let children = std::fs::read_to_string(format!("/proc/{0}/task/{0}/children", serve.pid())).unwrap_or_default();
    let mut pids: Vec<u32> = children.split_whitespace().filter_map(|p| p.parse().ok()).collect();
    // Domains spawned from the supervisor's other threads are listed under those threads.
    for t in std::fs::read_dir(format!("/proc/{}/task", serve.pid())).unwrap().flatten() {
        let tid = t.file_name().to_string_lossy().to_string();
        if tid != serve.pid().to_string() {
            let c = std::fs::read_to_string(t.path().join("children")).unwrap_or_default();
            pids.extend(c.split_whitespace().filter_map(|p| p.parse::<u32>().ok()));
        }
    }
    // Spare domains wait for a device of their own: not this device's.
    pids.retain(|p| !std::fs::read(format!("/proc/{p}/cmdline")).is_ok_and(|c| c.starts_with(b"bulkhead\0spare\0")));
    pids.sort_unstable();
    pids.dedup();
    pids
}

#[test]
fn intercept_terminates_every_request_in_one_tap_domain_through_kills_and_refuses_a_device_node() {
    require_kernel!();
    if !tools(&["fio"]) {
        return;
    }
    let tmp = TempDir::new("intercept");
    let image = tmp.path().join("disk.img");
    std::fs::File::create(&image).unwrap().set_len(256 << 20).unwrap();
    let trace = tmp.path().join("i.trace");
    let cfg = format!(
        "[[device]]\nname = \"i\"\ntap = \"intercept\"\nrestart_limit = 100000\n[device.backend]\ntype = \"file\"\n\
         path = \"{}\"\n[[device.filter]]\ntype = \"stats\"\n[[device.filter]]\ntype = \"trace\"\npath = \"{}\"\n",
        image.display(),
        trace.display()
    );
    let serve = Serve::start(&tmp.path().join("run"), Some(&cfg), &["i"]);
    let d = serve.status_json()["devices"][0].clone();
    assert_eq!(d["tap"], "intercept");
    assert_eq!(d["tap_pid"], d["driver_pid"], "{d}");
    assert!(d["tap_sandbox"]["seccomp_role"].as_str().unwrap().starts_with("file"), "{d}");
    // No domain below the tap domain: serve has exactly one.
    assert_eq!(domains_of(&serve), [d["tap_pid"].as_u64().unwrap() as u32]);

    let mut fs = Ext4::make(&serve.fuse_file("i"), &tmp.path().join("mnt"));
    let mnt = fs.mnt.clone();
    let killer = DomainKiller::start(
        serve.run_dir.clone(),
        || Duration::from_millis(300),
        |d, _| {
            let tap = d["tap_pid"].as_u64().unwrap_or(0) as u32;
            (0, tap, tap as u64)
        },
    );
    fio_verify(&mnt, "randrw", "4k-256k", "48M", 6);
    let kills = killer.stop();
    assert!(kills.first().copied().unwrap_or(0) >= 5, "only {kills:?} kills landed");
    fs.unmount_and_check();
    drop(fs);
    let st = serve.status_json();
    let d = &st["devices"][0];
    assert_eq!((d["state"].as_str(), d["requests_failed"].as_u64()), (Some("running"), Some(0)), "{d}");
    // Every request went through the tap domain's chain: the trace holds them.
    assert!(std::fs::metadata(&trace).unwrap().len() > 1000 * 64);
    // A domain killed while the filesystem was mounted may finish exiting only as it is
    // unmounted (its copy of the mount tree pinned it): it is reaped within the watch loop's
    // tick, so allow a moment.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    let mut left = domains_of(&serve);
    while left.len() > 1 && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
        left = domains_of(&serve);
    }
    let states: Vec<String> = left
        .iter()
        .map(|p| {
            let stat = std::fs::read_to_string(format!("/proc/{p}/stat")).unwrap_or_default();
            let stack = std::fs::read_to_string(format!("/proc/{p}/stack")).unwrap_or_default();
            format!("{stat}\n{stack}")
        })
        .collect();
    assert_eq!(left.len(), 1, "{states:#?}\n{}", serve.log_text());
    drop(serve);

    // A device node is no soft device: refused at start, and by `bulkhead device tap` on a running
    // device, which runs on unchanged.
    let node = LoopGuard::attach_direct(&image);
    let cfg = format!("[[device]]\nname = \"n\"\n[device.backend]\ntype = \"file\"\npath = \"{}\"\n", node.dev);
    let serve = Serve::start(&tmp.path().join("run2"), Some(&cfg), &["n"]);
    let e = cli(&serve.run_dir, &["device", "tap", "n", "intercept"]).unwrap_err();
    assert!(e.contains("device node") && e.contains(&node.dev), "{e}");
    assert_eq!(chain(&serve).0, "passthrough");
    drop(serve);
    let cfg_path = tmp.path().join("n.toml");
    std::fs::write(&cfg_path, cfg.replace("name = \"n\"\n", "name = \"n\"\ntap = \"intercept\"\n")).unwrap();
    let out = Command::new("timeout")
        .args(["30", exe(), "serve", "--config"])
        .arg(&cfg_path)
        .arg("--run-dir")
        .arg(tmp.path().join("run3"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("intercept") && err.contains("device node"), "{err}");
}

/// Waits until `field` of device 0 names a live process other than those in `not`.
fn await_pid(serve: &Serve, field: &str, not: &[u32]) -> u32 {
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    loop {
        let d = serve.status_json()["devices"][0].clone();
        let pid = match field {
            "standby" => d["standby"]["pid"].as_u64(),
            "tap_standby" => d["tap_standby"]["pid"].as_u64(),
            f => d[f].as_u64(),
        };
        if let Some(p) = pid.map(|p| p as u32).filter(|p| *p != 0 && !not.contains(p)) {
            if d["state"] == "running" {
                return p;
            }
        }
        assert!(std::time::Instant::now() < deadline, "no new {field}: {d}\n{}", serve.log_text());
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Checks that standby `pid` of device `s` waits confined: seccomp and no_new_privs, an empty
/// root, and the standby's title.
fn waits_confined(pid: u32) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    assert!(status.contains("Seccomp:\t2") && status.contains("NoNewPrivs:\t1"), "{status}");
    let mounts = std::fs::read_to_string(format!("/proc/{pid}/mountinfo")).unwrap();
    assert_eq!(mounts.lines().count(), 1, "an empty root: {mounts}");
    let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap();
    assert!(cmd.starts_with(b"bulkhead\0standby\0s\0"), "{}", String::from_utf8_lossy(&cmd));
}

/// After its first replacement below, an `interpose` device keeps a standby driver domain:
/// confined and waiting on the lower queues without touching them. A tap domain replaced meanwhile
/// leaves it waiting (the lower queues stay); the next driver kill lets it attach and serve,
/// the tap domain running on and the data intact.
#[test]
fn a_standby_driver_domain_below_the_tap_takes_the_next_kill_and_outlives_a_tap_kill() {
    require_kernel!();
    let tmp = TempDir::new("interpose-standby");
    let cfg = interpose_config("s", "", "[[device.filter]]\ntype = \"stats\"\n");
    let serve = Serve::start(&tmp.path().join("run"), Some(&cfg), &["s"]);
    let data: Vec<u8> = (0..1u32 << 20).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
    std::fs::write(serve.fuse_file("s"), &data).unwrap();
    let kill = |pid: u32| {
        // SAFETY: signalling a domain of our own serve.
        unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    };
    let first = await_pid(&serve, "driver_pid", &[]);
    kill(first);
    let second = await_pid(&serve, "driver_pid", &[first]);
    let standby = await_pid(&serve, "standby", &[]);
    waits_confined(standby);

    let tap = await_pid(&serve, "tap_pid", &[]);
    kill(tap);
    let new_tap = await_pid(&serve, "tap_pid", &[tap]);
    assert_eq!(await_pid(&serve, "standby", &[]), standby, "a tap domain replaced leaves the standby below waiting");
    assert_eq!(await_pid(&serve, "driver_pid", &[]), second);

    kill(second);
    let third = await_pid(&serve, "driver_pid", &[first, second]);
    assert_eq!(third, standby, "the standby serves below the tap domain");
    let d = serve.status_json()["devices"][0].clone();
    assert_eq!(d["standby_restarts"], 1, "{d}");
    assert_eq!(d["tap_pid"].as_u64(), Some(u64::from(new_tap)), "the tap domain ran on");
    let cmd = std::fs::read(format!("/proc/{third}/cmdline")).unwrap();
    assert!(cmd.starts_with(b"bulkhead\0driver\0s\0"), "{}", String::from_utf8_lossy(&cmd));
    let got = std::fs::read(serve.fuse_file("s")).unwrap();
    assert!(got[..data.len()] == data[..], "the contents survive");
    await_pid(&serve, "standby", &[standby]);
    let log = serve.log_text();
    assert!(!log.contains("restarting"), "the pair was restarted: {log}");
}

/// After its tap domain's first replacement, an `interpose` device keeps a standby tap domain:
/// confined, both channels mapped and neither written. The next tap kill lets it take over
/// (the driver domain below running on, the filters' figures carried on, the data intact); a
/// standby tap domain killed while it waits is replaced, and the kill after that is served by
/// the new one.
#[test]
fn a_standby_tap_domain_takes_the_next_tap_kill_and_one_killed_while_it_waits_is_replaced() {
    require_kernel!();
    let tmp = TempDir::new("interpose-tap-standby");
    let cfg = interpose_config("s", "", "[[device.filter]]\ntype = \"stats\"\n");
    let serve = Serve::start(&tmp.path().join("run"), Some(&cfg), &["s"]);
    let data: Vec<u8> = (0..1u32 << 20).map(|i| (i.wrapping_mul(2_246_822_519) >> 11) as u8).collect();
    std::fs::write(serve.fuse_file("s"), &data).unwrap();
    let kill = |pid: u32| {
        // SAFETY: signalling a domain of our own serve.
        unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    };
    let writes = |serve: &Serve| {
        let d = serve.status_json()["devices"][0].clone();
        d["filters"][0]["ops"].as_array().unwrap().iter().find(|o| o["op"] == "write").unwrap()["requests"].as_u64().unwrap()
    };
    let driver = await_pid(&serve, "driver_pid", &[]);
    let first = await_pid(&serve, "tap_pid", &[]);
    assert_eq!(serve.status_json()["devices"][0]["tap_standby"], serde_json::Value::Null, "none before a replacement");
    kill(first);
    let second = await_pid(&serve, "tap_pid", &[first]);
    let standby = await_pid(&serve, "tap_standby", &[]);
    waits_confined(standby);
    // Waiting, it has written nothing: the running tap domain serves on.
    let got = std::fs::read(serve.fuse_file("s")).unwrap();
    assert!(got[..data.len()] == data[..], "the contents, through the running tap domain");
    let counted = writes(&serve);
    assert!(counted > 0, "the stats filter counts the writes");

    kill(second);
    let third = await_pid(&serve, "tap_pid", &[first, second]);
    assert_eq!(third, standby, "the standby tap domain takes over");
    let d = serve.status_json()["devices"][0].clone();
    assert_eq!(d["standby_restarts"], 1, "{d}");
    assert_eq!(d["driver_pid"].as_u64(), Some(u64::from(driver)), "the driver domain below ran on: {d}");
    let cmd = std::fs::read(format!("/proc/{third}/cmdline")).unwrap();
    assert!(cmd.starts_with(b"bulkhead\0driver\0s\0tap\0"), "{}", String::from_utf8_lossy(&cmd));
    let got = std::fs::read(serve.fuse_file("s")).unwrap();
    assert!(got[..data.len()] == data[..], "the contents survive a takeover");
    std::fs::write(serve.fuse_file("s"), &data[..1 << 16]).unwrap();
    assert!(writes(&serve) > counted, "the filter's figures carry on in the standby");

    // A standby killed while it waits is replaced by another, which takes the next kill.
    let victim = await_pid(&serve, "tap_standby", &[standby]);
    kill(victim);
    let next = await_pid(&serve, "tap_standby", &[standby, victim]);
    kill(third);
    assert_eq!(await_pid(&serve, "tap_pid", &[first, second, third]), next);
    let d = serve.status_json()["devices"][0].clone();
    assert_eq!(d["standby_restarts"], 2, "{d}");
    assert_eq!(d["driver_pid"].as_u64(), Some(u64::from(driver)), "{d}");
    let got = std::fs::read(serve.fuse_file("s")).unwrap();
    assert!(got[..data.len()] == data[..], "the contents survive");
    let log = serve.log_text();
    assert!(!log.contains("restarting"), "the pair was restarted: {log}");
}
