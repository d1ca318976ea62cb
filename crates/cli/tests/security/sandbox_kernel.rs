//! The driver-domain sandbox, tested the way an attacker would: from inside a running, confined
//! domain, try to escape, and check each attempt fails with the exact errno (or signal).

#[path = "../common/mod.rs"]
mod common;

use std::time::{Duration, Instant};

use bulkhead_testkit::require_kernel;
use common::*;

#[test]
fn every_escape_attempt_from_a_domain_fails_with_the_expected_errno() {
    require_kernel!();
    // With no attach slots the domain may make no shared mapping at all.
    escapes_fail("escape", "attach = 0\n", &[], false);
}

/// A domain made from a spare (sandboxed before it knew its device, then narrowed to its
/// role) fails every escape the same way.
#[test]
fn every_escape_attempt_from_a_domain_made_from_a_spare_fails_alike() {
    require_kernel!();
    escapes_fail("escape-spare", "attach = 0\n", &[], true);
}

/// A domain that takes attached queues may map memory files shared: the same escapes fail,
/// the two shared mappings now refused by the kernel (the descriptors they name are closed
/// once mapped, or cannot be mapped) rather than by seccomp.
#[test]
fn escapes_fail_too_from_a_domain_that_takes_attached_queues() {
    require_kernel!();
    escapes_fail("escape-attach", "attach = 4\n", &["mmap_write_arena_shared_rw", "mmap_beyond_ring"], false);
}

/// Runs the escape probe in a ram domain of a device with `keys`; every attempt must fail with
/// its errno, those in `any_error` with any error. `from_spare`: only a domain made from a
/// spare runs it, once one has been made (a restart asked for once the spares are ready).
fn escapes_fail(tag: &str, keys: &str, any_error: &[&str], from_spare: bool) {
    let tmp = TempDir::new(tag);
    let cfg = format!("[[device]]\nname = \"e\"\nsize = \"16M\"\nrestart_limit = 1\n{keys}[device.backend]\ntype = \"ram\"\n");
    let me = std::process::id().to_string();
    let mut env = vec![("BULKHEAD_TEST_FAULT", "escape"), ("BULKHEAD_TEST_OUTSIDE_PID", me.as_str())];
    if from_spare {
        env.push(("BULKHEAD_TEST_FAULT_FROM_SPARE", "1"));
    }
    let Some(serve) = Serve::start_test_driver(&tmp.path().join("run"), Some(&cfg), &["e"], &env) else {
        return;
    };
    if from_spare {
        let st = serve.spares_ready();
        if st["taken"] == 0 {
            let out = std::process::Command::new(exe())
                .args(["device", "restart", "e", "--run-dir"])
                .arg(&serve.run_dir)
                .output()
                .unwrap();
            assert!(
                out.status.success() || serve.log_text().contains("escape-probe"),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }
    let deadline = Instant::now() + Duration::from_secs(15);
    let (probe, log) = loop {
        let log = serve.log_text();
        // The domain's output reaches the log behind its relay's prefix.
        if let Some((_, json)) = log.lines().find_map(|l| l.split_once("bulkhead escape-probe: {")) {
            if log.contains("SIGSEGV") {
                break (format!("{{{json}"), log);
            }
        }
        assert!(Instant::now() < deadline, "no probe report:\n{log}");
        std::thread::sleep(Duration::from_millis(50));
    };
    let v: serde_json::Value = serde_json::from_str(&probe).unwrap();
    let expect = [
        ("open_file", "EPERM"),
        ("openat_proc_mem", "EPERM"),
        ("socket_inet", "EPERM"),
        ("socket_unix", "EPERM"),
        ("socketpair_unix", "EPERM"),
        ("shmget", "EPERM"),
        ("msgget", "EPERM"),
        ("semget", "EPERM"),
        ("mq_open", "EPERM"),
        ("ptrace_attach", "EPERM"),
        ("process_vm_readv", "EPERM"),
        ("kill_outside", "EPERM"),
        ("fork", "EPERM"),
        ("clone3", "EPERM"),
        ("execve", "EPERM"),
        // The kernel itself refuses: the write arena came as an O_RDONLY descriptor.
        ("mprotect_write_arena_rw", "EACCES"),
        // A ramdisk domain has no pwrite at all (its seccomp role is memory only).
        ("pwrite_write_arena", "EPERM"),
        ("mmap_write_arena_shared_rw", "EPERM"),
        ("mmap_beyond_ring", "EPERM"),
        ("mmap_anon_64g", "ENOMEM"),
        ("mmap_exec", "EPERM"),
        ("setrlimit_nofile", "EPERM"),
        ("prlimit_as", "EPERM"),
    ];
    for (attempt, errno) in expect {
        if any_error.contains(&attempt) {
            let got = v[attempt].as_str().unwrap_or("");
            assert!(!got.is_empty() && got != "succeeded", "{attempt}: {probe}");
        } else {
            assert_eq!(v[attempt], errno, "{attempt}: {probe}");
        }
    }
    // The last attempt, a store into the read-only write arena, killed the domain.
    assert!(log.contains("exited: signal: 11 (SIGSEGV)"), "{log}");
    assert!(!log.contains("write into the read-only arena succeeded"), "{log}");
    if from_spare {
        assert!(serve.status_json()["spares"]["taken"].as_u64().unwrap() >= 1, "no domain was made from a spare");
    }
}

#[test]
fn status_shows_every_sandbox_layer_applied() {
    require_kernel!();
    let tmp = TempDir::new("layers");
    let serve = Serve::start(&tmp.path().join("run"), Some(&small_ram_config("l", "16M", "adaptive")), &["l"]);
    layers_applied(&serve);
    // A domain made from a spare is confined as fully, and `ps` names it as an exec'd one.
    let before = serve.spares_ready();
    let waiting: Vec<u64> = before["ready"].as_array().unwrap().iter().map(|p| p["pid"].as_u64().unwrap()).collect();
    for pid in &waiting {
        let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap();
        assert!(cmd.starts_with(b"bulkhead\0spare\0"), "{}", String::from_utf8_lossy(&cmd));
        let mounts = std::fs::read_to_string(format!("/proc/{pid}/mountinfo")).unwrap();
        assert_eq!(mounts.lines().count(), 1, "a waiting spare has its empty root: {mounts}");
    }
    namespaces_shared(&serve, &waiting);
    let out =
        std::process::Command::new(exe()).args(["device", "restart", "l", "--run-dir"]).arg(&serve.run_dir).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let pid = layers_applied(&serve);
    assert!(waiting.contains(&pid), "the new domain {pid} is one of the spares {waiting:?}");
    // One for the domain; a second may have become the device's standby since.
    let taken = serve.status_json()["spares"]["taken"].as_u64().unwrap() - before["taken"].as_u64().unwrap();
    assert!((1..=2).contains(&taken), "{taken} spares taken");
    let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap();
    assert!(cmd.starts_with(b"bulkhead\0driver\0l\0"), "{}", String::from_utf8_lossy(&cmd));
}

/// The device's domain and the waiting spares are in one network and one IPC namespace, not
/// the host's, where the kernel's Landlock scopes abstract sockets (ABI 6: every domain's
/// filters and Landlock then keep them apart within it); elsewhere each has its own. Each
/// has a pid namespace of its own either way.
fn namespaces_shared(serve: &Serve, spares: &[u64]) {
    let st = serve.status_json();
    let domain = st["devices"][0]["driver_pid"].as_u64().unwrap();
    let shared = st["devices"][0]["sandbox"]["landlock_abi"].as_u64().unwrap() >= 6;
    let ns = |pid: &str, kind: &str| std::fs::read_link(format!("/proc/{pid}/ns/{kind}")).unwrap();
    let mut all = vec![domain];
    all.extend_from_slice(spares);
    for kind in ["net", "ipc"] {
        let host = ns("self", kind);
        for p in &all {
            assert_ne!(ns(&p.to_string(), kind), host, "{p} is in the host's {kind} namespace");
        }
        for p in spares {
            let (a, b) = (ns(&p.to_string(), kind), ns(&domain.to_string(), kind));
            assert_eq!(a == b, shared, "{kind} namespaces of spare {p} ({a:?}) and domain {domain} ({b:?})");
        }
    }
    let pids: std::collections::BTreeSet<_> = all.iter().map(|p| ns(&p.to_string(), "pid")).collect();
    assert_eq!(pids.len(), all.len(), "each has a pid namespace of its own");
}

/// Checks that every layer of the device's domain is in force, from status and from `/proc`;
/// returns its pid.
fn layers_applied(serve: &Serve) -> u64 {
    let st = serve.status_json();
    let s = &st["devices"][0]["sandbox"];
    for layer in ["namespaces", "mounts", "rlimits", "no_new_privs", "landlock", "seccomp"] {
        assert_eq!(s[layer], "applied", "{layer}: {s}");
    }
    assert_eq!(s["seccomp_role"], "memory");
    assert!(s["landlock_abi"].as_u64().unwrap() > 0, "{s}");
    let pid = st["devices"][0]["driver_pid"].as_u64().unwrap();
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    assert!(status.contains("Seccomp:\t2") && status.contains("NoNewPrivs:\t1"), "{status}");
    let map = std::fs::read_to_string(format!("/proc/{pid}/uid_map")).unwrap();
    assert_eq!(map.split_whitespace().collect::<Vec<_>>(), ["0", "65534", "1"], "root inside is nobody outside");
    // …and the domain runs as that user, seen from outside: not as the supervisor's root.
    let ids = |key: &str| status.lines().find(|l| l.starts_with(key)).unwrap().split_whitespace().skip(1).collect::<Vec<_>>();
    assert_eq!(ids("Uid:"), ["65534"; 4], "{status}");
    assert_eq!(ids("Gid:"), ["65534"; 4], "{status}");
    assert_eq!(ids("Groups:"), Vec::<&str>::new(), "{status}");
    // Its own process group: a Ctrl-C at serve's terminal reaches serve, not the domain.
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let pgrp: u64 = stat[stat.rfind(')').unwrap() + 2..].split_whitespace().nth(2).unwrap().parse().unwrap();
    assert_eq!(pgrp, pid, "domain shares a process group");
    // The domain's mount namespace holds one empty read-only root and no copy of a host mount:
    // a copy would pin host filesystems (one mounted on this very device included).
    let mounts = std::fs::read_to_string(format!("/proc/{pid}/mountinfo")).unwrap();
    let lines: Vec<&str> = mounts.lines().collect();
    assert_eq!(lines.len(), 1, "{mounts}");
    assert!(lines[0].contains(" / / ro,") && lines[0].contains(" - tmpfs bulkhead-empty "), "{mounts}");
    // Only the passed descriptors are open: 5 per queue (4 queues), the ramdisk, and what the
    // domain created itself (epoll, signal pipe).
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).unwrap().count();
    assert!(fds <= 3 + 4 * 5 + 1 + 4, "{fds} descriptors open in the domain");
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).unwrap();
    let limit =
        |name: &str| limits.lines().find(|l| l.starts_with(name)).unwrap().split_whitespace().rev().nth(1).unwrap().to_string();
    assert_eq!(limit("Max processes"), "0", "{limits}");
    assert_eq!(limit("Max core file size"), "0", "{limits}");
    assert_ne!(limit("Max address space"), "unlimited", "{limits}");
    pid
}

/// A domain started while a file system is mounted on its own device (a restart under a
/// mount) holds no copy of the mount: the host's `umount` shuts the file system down, with
/// nothing left to write back behind it.
#[test]
fn a_domain_started_under_a_mounted_file_system_lets_it_go_at_unmount() {
    require_kernel!();
    if !tools(&["mkfs.ext4", "e2fsck"]) {
        return;
    }
    let tmp = TempDir::new("unpinned");
    let serve = Serve::start(&tmp.path().join("run"), Some(&small_ram_config("u", "64M", "adaptive")), &["u"]);
    let mut fs = Ext4::make(&serve.fuse_file("u"), &tmp.path().join("mnt"));
    std::fs::write(fs.mnt.join("f"), vec![7u8; 1 << 20]).unwrap();
    let first = serve.driver_pid(0);
    // SAFETY: signalling a domain of our own serve by pid.
    assert_eq!(unsafe { libc::kill(first as i32, libc::SIGKILL) }, 0);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let d = serve.status_json()["devices"][0].clone();
        if d["state"] == "running" && d["driver_pid"].as_u64().is_some_and(|p| p != 0 && p != u64::from(first)) {
            break;
        }
        assert!(Instant::now() < deadline, "no new driver domain: {d}\n{}", serve.log_text());
        std::thread::sleep(Duration::from_millis(20));
    }
    // Dirty data for the new domain to carry at unmount.
    std::fs::write(fs.mnt.join("g"), vec![9u8; 1 << 20]).unwrap();
    fs.unmount_and_check();
    let pid = serve.driver_pid(0);
    let mounts = std::fs::read_to_string(format!("/proc/{pid}/mountinfo")).unwrap();
    assert_eq!(mounts.lines().count(), 1, "{mounts}");
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

/// Every memfd a process maps or holds under bulkhead's names (rings, arenas, ramdisk), with
/// its contents, keyed by inode.
fn shared_files(pid: u32, into: &mut std::collections::BTreeMap<String, (String, Vec<u8>)>) {
    for line in std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap().lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.len() > 5 && f[5].starts_with("/memfd:bulkhead-") && !into.contains_key(f[4]) {
            // map_files opens the mapped file itself (root only), whatever the mapping's protection.
            let bytes = std::fs::read(format!("/proc/{pid}/map_files/{}", f[0])).unwrap();
            into.insert(f[4].to_string(), (f[5].to_string(), bytes));
        }
    }
    for e in std::fs::read_dir(format!("/proc/{pid}/fd")).unwrap().flatten() {
        let Ok(target) = std::fs::read_link(e.path()) else {
            continue;
        };
        let name = target.to_string_lossy().to_string();
        if name.starts_with("/memfd:bulkhead-") {
            let ino = std::fs::metadata(e.path()).map(|m| std::os::unix::fs::MetadataExt::ino(&m).to_string()).unwrap();
            into.entry(ino).or_insert_with(|| (name, std::fs::read(e.path()).unwrap()));
        }
    }
}

/// Whether `needle` is in `pid`'s private anonymous memory (heap and anonymous mappings).
fn in_private_memory(pid: u32, needle: &[u8]) -> bool {
    use std::os::unix::fs::FileExt;
    let mem = std::fs::File::open(format!("/proc/{pid}/mem")).unwrap();
    for line in std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap().lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        if !f[1].starts_with("rw") || f[1].ends_with('s') || (f.len() > 5 && f[5] != "[heap]") {
            continue;
        }
        let (a, b) = f[0].split_once('-').unwrap();
        let (a, b) = (u64::from_str_radix(a, 16).unwrap(), u64::from_str_radix(b, 16).unwrap());
        let mut buf = vec![0u8; (b - a) as usize];
        if mem.read_exact_at(&mut buf, a).is_ok() && contains(&buf, needle) {
            return true;
        }
    }
    false
}

/// Fills heap blocks with `marker`, frees half of them so the allocator hands their stale bytes
/// to whatever is allocated next (the frontend's I/O buffers included), and keeps the other
/// half alive for the probe to find.
fn plant_canaries(marker: &[u8]) -> Vec<Vec<u8>> {
    // Below malloc's mmap threshold, so freed blocks stay in the heap for reuse.
    const BLOCK: usize = 64 << 10;
    let blocks: Vec<Vec<u8>> = (0..64).map(|_| marker.iter().copied().cycle().take(BLOCK).collect()).collect();
    blocks.into_iter().step_by(2).collect()
}

/// The frontend of this test is this process: the supervisor and the FUSE export run here, as
/// in `bulkhead serve`, so the test can plant canaries in the frontend's own heap.
#[test]
fn frontend_heap_canaries_never_reach_an_arena_ring_or_backend() {
    require_kernel!();
    let tmp = TempDir::new("canary");
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos();
    let marker = format!("<frontend-canary-{nanos:x}>");
    let _canaries = plant_canaries(marker.as_bytes());
    let config = bulkhead_config::Config::parse(&small_ram_config("c", "32M", "adaptive"), "canary test").unwrap();
    let sup = bulkhead_supervisor::Supervisor::start(&config, Some(std::path::Path::new(exe()))).unwrap();
    let mnt = tmp.path().join("fuse");
    std::fs::create_dir_all(&mnt).unwrap();
    // Unmounts (and the supervisor ends its domain) on every way out of the test.
    let fuse = bulkhead_fuse_export::FuseExport::mount(&mnt, sup.devices(), 2).unwrap();
    let file = mnt.join("c");
    let src = tmp.path().join("src");
    std::fs::write(&src, pattern(77, 4 << 20)).unwrap();
    let of = format!("of={}", file.display());
    let iff = format!("if={}", src.display());
    // Direct writes of many sizes, buffered writes at odd offsets, then reads of all of it.
    for (bs, seek) in [("4k", "3"), ("1M", "5"), ("4M", "2"), ("12k", "101")] {
        run(
            "dd",
            &[&iff, &of, &format!("bs={bs}"), "count=1", &format!("seek={seek}"), "oflag=direct", "conv=notrunc", "status=none"],
        );
    }
    run("dd", &[&iff, &of, "bs=1000", "count=700", "seek=7777", "conv=notrunc,fsync", "status=none"]);
    run("dd", &[&format!("if={}", file.display()), "of=/dev/null", "bs=1M", "iflag=direct", "status=none"]);
    run("dd", &[&format!("if={}", file.display()), "of=/dev/null", "bs=7777", "count=500", "skip=13", "status=none"]);

    let needle = marker.as_bytes();
    let me = std::process::id();
    // The probe finds the marker where it is: the frontend's heap.
    assert!(in_private_memory(me, needle), "canary not planted in the frontend's heap");
    let driver = sup.status().devices[0].driver_pid;
    let mut files = std::collections::BTreeMap::new();
    for pid in [me, driver] {
        shared_files(pid, &mut files);
    }
    drop(fuse);
    sup.shutdown();
    for (name, bytes) in files.values() {
        assert!(!contains(bytes, needle), "frontend heap bytes reached {name}");
    }
    // Rings and both arenas of four queues, the ramdisk, the domain's state page and the one
    // kept for a domain below a tap domain: all were looked at.
    assert_eq!(files.len(), 4 * 3 + 3, "{:?}", files.values().map(|v| &v.0).collect::<Vec<_>>());
}

#[test]
fn unavailable_layer_warns_under_best_effort_and_refuses_under_required() {
    require_kernel!();
    // The test driver confines as on a host without Landlock.
    let missing = [("BULKHEAD_TEST_UNAVAILABLE_LAYERS", "landlock")];
    let Some(driver) = Serve::test_driver() else {
        return;
    };
    // best_effort: the domain starts, says so, and status shows the layer missing.
    let tmp = TempDir::new("layer-missing");
    let Some(serve) =
        Serve::start_test_driver(&tmp.path().join("run"), Some(&small_ram_config("w", "16M", "adaptive")), &["w"], &missing)
    else {
        return;
    };
    let s = serve.status_json()["devices"][0]["sandbox"].clone();
    assert!(s["landlock"]["unavailable"].as_str().unwrap().contains("not available"), "{s}");
    assert_eq!(s["seccomp"], "applied", "{s}");
    assert!(serve.log_text().contains("warning: sandbox layer landlock unavailable"), "{}", serve.log_text());
    let data = pattern(5, 1 << 20);
    let src = tmp.path().join("src");
    std::fs::write(&src, &data).unwrap();
    dd(&src, &serve.fuse_file("w"), &["bs=1M", "oflag=direct", "conv=notrunc"]);
    drop(serve);

    // required: serve refuses the device, naming the layer.
    let tmp = TempDir::new("layer-required");
    let cfg = "[[device]]\nname = \"r\"\nsize = \"16M\"\nsandbox = \"required\"\n[device.backend]\ntype = \"ram\"\n";
    let cfg_path = tmp.path().join("r.toml");
    std::fs::write(&cfg_path, cfg).unwrap();
    let out = std::process::Command::new("timeout")
        .arg("30")
        .arg(driver)
        .args(["serve", "--config"])
        .arg(&cfg_path)
        .arg("--run-dir")
        .arg(tmp.path().join("run"))
        .envs(missing)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("device r") && err.contains("refused to start") && err.contains("landlock"), "{err}");
    assert!(!tmp.path().join("run").join("control.sock").exists());
}
