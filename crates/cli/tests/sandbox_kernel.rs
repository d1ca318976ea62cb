//! The driver-domain sandbox, tested the way an attacker would: from inside a running, confined
//! domain, try to escape, and check each attempt fails with the exact errno (or signal).

mod common;

use std::time::{Duration, Instant};

use bulkhead_testkit::require_kernel;
use common::*;

#[test]
fn every_escape_attempt_from_a_domain_fails_with_the_expected_errno() {
    require_kernel!();
    let tmp = TempDir::new("escape");
    let cfg = "[[device]]\nname = \"e\"\nsize = \"16M\"\nrestart_limit = 1\n[device.backend]\ntype = \"ram\"\n";
    let me = std::process::id().to_string();
    let serve = Serve::start_with_env(
        &tmp.path().join("run"),
        Some(cfg),
        &["e"],
        &[("BULKHEAD_TEST_FAULT", "escape"), ("BULKHEAD_TEST_OUTSIDE_PID", &me)],
    );
    let deadline = Instant::now() + Duration::from_secs(15);
    let (probe, log) = loop {
        let log = serve.log_text();
        if let Some(line) = log.lines().find(|l| l.starts_with("bulkhead escape-probe: {")) {
            if log.contains("SIGSEGV") {
                break (line.trim_start_matches("bulkhead escape-probe: ").to_string(), log);
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
        assert_eq!(v[attempt], errno, "{attempt}: {probe}");
    }
    // The last attempt, a store into the read-only write arena, killed the domain.
    assert!(log.contains("exited: signal: 11 (SIGSEGV)"), "{log}");
    assert!(!log.contains("write into the read-only arena succeeded"), "{log}");
}

#[test]
fn status_shows_every_sandbox_layer_applied() {
    require_kernel!();
    let tmp = TempDir::new("layers");
    let serve = Serve::start(&tmp.path().join("run"), Some(&small_ram_config("l", "16M", "adaptive")), &["l"]);
    let st = serve.status_json();
    let s = &st["devices"][0]["sandbox"];
    for layer in ["namespaces", "rlimits", "no_new_privs", "landlock", "seccomp"] {
        assert_eq!(s[layer], "applied", "{layer}: {s}");
    }
    assert_eq!(s["seccomp_role"], "memory");
    let pid = st["devices"][0]["driver_pid"].as_u64().unwrap();
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    assert!(status.contains("Seccomp:\t2") && status.contains("NoNewPrivs:\t1"), "{status}");
    let map = std::fs::read_to_string(format!("/proc/{pid}/uid_map")).unwrap();
    assert_eq!(map.split_whitespace().collect::<Vec<_>>(), ["0", "65534", "1"], "root inside is nobody outside");
    // Only the passed descriptors are open: 5 per queue (4 queues), the ramdisk, and what the
    // domain created itself (epoll, signal pipe).
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).unwrap().count();
    assert!(fds <= 3 + 4 * 5 + 1 + 4, "{fds} descriptors open in the domain");
}
