//! Reading a process's resident memory from /proc.

use serde::Serialize;

/// Resident memory of a process, in KiB, as /proc/PID/status reports it.
#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq, Eq)]
pub struct Rss {
    /// Total resident set (`VmRSS`).
    pub total_kib: u64,
    /// Private anonymous memory (`RssAnon`): heap, stacks.
    pub anon_kib: u64,
    /// Shared memory mapped and touched (`RssShmem`): rings, arenas, ramdisk pages.
    pub shmem_kib: u64,
}

/// Resident memory of `pid` (`None` if it is gone).
pub fn rss(pid: u32) -> Option<Rss> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let mut r = Rss::default();
    for line in s.lines() {
        let mut it = line.split_whitespace();
        let key = it.next().unwrap_or("");
        let val: u64 = it.next().and_then(|v| v.parse().ok()).unwrap_or(0);
        match key {
            "VmRSS:" => r.total_kib = val,
            "RssAnon:" => r.anon_kib = val,
            "RssShmem:" => r.shmem_kib = val,
            _ => {}
        }
    }
    Some(r)
}

#[cfg(test)]
mod tests {
    #[test]
    fn own_rss_is_readable_and_nonzero() {
        let r = super::rss(std::process::id()).unwrap();
        assert!(r.total_kib > 0 && r.anon_kib > 0);
    }
}
