//! Other hosts, for the tests: network namespaces joined by veth pairs, deleted (their veth
//! pairs with them) on drop, also when a test fails.

use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

/// A network namespace joined to another (the test's own, or a cluster's) by a veth pair.
pub struct NetNs {
    /// Its name under /run/netns.
    pub name: String,
    /// The address of the other end, as seen from inside.
    pub host_ip: String,
    /// Its own address.
    pub peer_ip: String,
}

/// Namespaces made so far by this test process: each gets its own names and subnet.
static MADE: AtomicU32 = AtomicU32::new(0);

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip").args(args).output().map_err(|e| format!("ip: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

impl NetNs {
    /// A namespace joined to the test's own; `None` (the test skips) where namespaces cannot
    /// be made, unless the kernel is required.
    pub fn create() -> Option<NetNs> {
        Self::joined_to(None)
    }

    /// A namespace joined to `outer` (`None`: the test's own).
    pub fn joined_to(outer: Option<&str>) -> Option<NetNs> {
        let id = std::process::id();
        let n = MADE.fetch_add(1, Ordering::Relaxed);
        let name = format!("bh-test-{id}-{n}");
        // Interface names hold at most 15 bytes.
        let (a, b) = (format!("bh{}x{n}a", id % 1_000_000), format!("bh{}x{n}b", id % 1_000_000));
        let net = format!("10.{}.{}", 200 + n % 50, 1 + id % 250);
        let ns = NetNs { name: name.clone(), host_ip: format!("{net}.1"), peer_ip: format!("{net}.2") };
        let on_outer = |args: &[&str]| -> Vec<String> {
            let mut v: Vec<String> = outer.map(|o| vec!["-n".to_string(), o.to_string()]).unwrap_or_default();
            v.extend(args.iter().map(|s| s.to_string()));
            v
        };
        let steps: Vec<Vec<String>> = vec![
            vec!["netns".into(), "add".into(), name.clone()],
            on_outer(&["link", "add", &a, "type", "veth", "peer", "name", &b]),
            on_outer(&["link", "set", &b, "netns", &name]),
            on_outer(&["addr", "add", &format!("{}/24", ns.host_ip), "dev", &a]),
            on_outer(&["link", "set", &a, "up"]),
            vec!["-n".into(), name.clone(), "addr".into(), "add".into(), format!("{}/24", ns.peer_ip), "dev".into(), b.clone()],
            vec!["-n".into(), name.clone(), "link".into(), "set".into(), b.clone(), "up".into()],
            vec!["-n".into(), name.clone(), "link".into(), "set".into(), "lo".into(), "up".into()],
        ];
        for s in &steps {
            let args: Vec<&str> = s.iter().map(String::as_str).collect();
            if let Err(e) = ip(&args) {
                // What was made goes with the namespace, or with its veth end left outside.
                let _ = ip(&on_outer(&["link", "del", &a]).iter().map(String::as_str).collect::<Vec<_>>());
                let _ = ip(&["netns", "del", &name]);
                assert!(std::env::var("BULKHEAD_REQUIRE_KERNEL").as_deref() != Ok("1"), "ip {s:?}: {e}");
                eprintln!("SKIP: cannot make a network namespace: ip {s:?}: {e}");
                return None;
            }
        }
        Some(ns)
    }

    /// Routes `addr` (an address of the other end's namespace beyond the veth) from inside.
    pub fn route_to(&self, addr: &str) {
        ip(&["-n", &self.name, "route", "add", &format!("{addr}/32"), "via", &self.host_ip])
            .unwrap_or_else(|e| panic!("route to {addr} in {}: {e}", self.name));
    }
}

impl Drop for NetNs {
    fn drop(&mut self) {
        // Deleting the namespace deletes the veth pair with it.
        let _ = ip(&["netns", "del", &self.name]);
    }
}
