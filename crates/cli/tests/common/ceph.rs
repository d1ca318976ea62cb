//! A throwaway single-node Ceph cluster (`scripts/ceph-dev.sh`) in a network namespace of its
//! own, torn down even on failure: for the `rbd` tests and the migration tests on RBD.

use std::path::{Path, PathBuf};
use std::process::Command;

/// A throwaway cluster; `down` on drop.
pub struct Cluster {
    pub dir: PathBuf,
    pub netns: String,
    /// The monitor's and the OSD's address in `netns`.
    pub addr: String,
}

impl Cluster {
    /// Starts one on 127.0.0.1 of its namespace, or `None` (the test skips) without the ceph
    /// packages.
    pub fn up(tag: &str) -> Option<Cluster> {
        Self::up_at(tag, "127.0.0.1")
    }

    /// Starts one whose daemons listen on `addr`, which [`Cluster::host`]s reach.
    pub fn routed(tag: &str) -> Option<Cluster> {
        Self::up_at(tag, &format!("10.199.{}.1", std::process::id() % 250))
    }

    /// Another host, a client of this cluster: a namespace joined to the cluster's by a veth
    /// pair, routed to its address.
    pub fn host(&self) -> Option<super::netns::NetNs> {
        let h = super::netns::NetNs::joined_to(Some(&self.netns))?;
        h.route_to(&self.addr);
        Some(h)
    }

    fn up_at(tag: &str, addr: &str) -> Option<Cluster> {
        if bulkhead_testkit::kernel::which("ceph-mon").is_none() || bulkhead_testkit::kernel::which("ceph-osd").is_none() {
            assert!(std::env::var("BULKHEAD_REQUIRE_KERNEL").as_deref() != Ok("1"), "ceph-mon and ceph-osd are required");
            eprintln!("SKIP: the ceph packages are not installed");
            return None;
        }
        let netns = format!("bh-{tag}-{}", std::process::id());
        let dir = std::env::temp_dir().join(format!("bulkhead-ceph-{tag}-{}", std::process::id()));
        let c = Cluster { dir, netns, addr: addr.to_string() };
        let out = Command::new(script())
            .args(["up", "--dir"])
            .arg(&c.dir)
            .args(["--netns", &c.netns, "--addr", &c.addr])
            .output()
            .expect("scripts/ceph-dev.sh");
        assert!(out.status.success(), "cluster did not start: {}", String::from_utf8_lossy(&out.stderr));
        Some(c)
    }

    pub fn key_file(&self) -> PathBuf {
        self.dir.join("client.admin.key")
    }

    /// Runs `rbd ARGS` against the cluster; its stdout.
    pub fn rbd(&self, args: &[&str]) -> Vec<u8> {
        let out = Command::new("nsenter")
            .arg(format!("--net=/run/netns/{}", self.netns))
            .arg("rbd")
            .arg("-c")
            .arg(self.dir.join("ceph.conf"))
            .args(args)
            .output()
            .unwrap();
        assert!(out.status.success(), "rbd {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        out.stdout
    }

    pub fn config(&self, image: &str, size: &str, extra: &str) -> String {
        format!("[fuse]\nenabled = false\n{}", self.device("r", image, size, extra))
    }

    /// A `[[device]]` named `name` on `image`, of `size` (empty: none given, so the image's);
    /// `extra` goes in its backend table (and may open tables after it).
    pub fn device(&self, name: &str, image: &str, size: &str, extra: &str) -> String {
        let size = if size.is_empty() { String::new() } else { format!("size = \"{size}\"\n") };
        format!(
            "[[device]]\nname = \"{name}\"\n{size}restart_limit = 100000\n\
             [device.backend]\ntype = \"rbd\"\nmon_host = \"{}:3300\"\npool = \"rbd\"\nimage = \"{image}\"\n\
             key_file = \"{}\"\n{extra}",
            self.addr,
            self.key_file().display()
        )
    }

    pub fn pid(&self, daemon: &str) -> i32 {
        std::fs::read_to_string(self.dir.join(format!("run/{daemon}.pid"))).unwrap().trim().parse().unwrap()
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        // A stopped daemon must be able to die.
        for daemon in ["osd.0", "mon.a"] {
            if let Ok(p) = std::fs::read_to_string(self.dir.join(format!("run/{daemon}.pid"))) {
                if let Ok(pid) = p.trim().parse::<i32>() {
                    // SAFETY: signalling the cluster's own daemon.
                    unsafe { libc::kill(pid, libc::SIGCONT) };
                }
            }
        }
        let _ = Command::new(script()).args(["down", "--dir"]).arg(&self.dir).status();
    }
}

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/ceph-dev.sh")
}
