//! Reading a process's resident memory and exit progress from /proc.

pub use bulkhead_control::Rss;

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

/// `PF_EXITING` in the flags of /proc/PID/stat.
const PF_EXITING: u64 = 0x4;

/// Whether every thread of `pid` is exiting and has released its memory: it can no longer
/// read or write anything it shared, though it has not finished exiting. A domain stays so
/// while the kernel finishes work for it that goes through the very device the domain served
/// (a filesystem its mount namespace kept alive did, before domains let go of their copy of
/// the host's mounts): only a new domain lets that exit end. `false` once it is gone.
pub fn memory_released(pid: u32) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return false };
    let mut any = false;
    for t in tasks.flatten() {
        let Ok(stat) = std::fs::read_to_string(t.path().join("stat")) else { return false };
        // Fields after the command (which may hold spaces and parentheses): state is the
        // first, flags the seventh, the virtual memory size the twenty-first.
        let Some((_, rest)) = stat.rsplit_once(')') else { return false };
        let f: Vec<&str> = rest.split_whitespace().collect();
        let flags: u64 = f.get(6).and_then(|v| v.parse().ok()).unwrap_or(0);
        let vsize: u64 = f.get(20).and_then(|v| v.parse().ok()).unwrap_or(1);
        if flags & PF_EXITING == 0 || vsize != 0 {
            return false;
        }
        any = true;
    }
    any
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_running_process_has_not_released_its_memory_and_a_gone_one_is_not_exiting() {
        assert!(!super::memory_released(std::process::id()));
        let mut c = std::process::Command::new("true").spawn().unwrap();
        let pid = c.id();
        c.wait().unwrap();
        assert!(!super::memory_released(pid));
    }

    #[test]
    fn own_rss_is_readable_and_nonzero() {
        let r = super::rss(std::process::id()).unwrap();
        assert!(r.total_kib > 0 && r.anon_kib > 0);
    }
}
