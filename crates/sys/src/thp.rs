//! Transparent huge pages, as the kernel reports them: whether it gives any, and how much of
//! a range of a process's memory they back.

use std::io;

/// Whether the kernel backs memory with transparent huge pages at all (the system setting is
/// not `never`; `madvise` counts, as that is how the guard asks for them).
pub fn available() -> bool {
    std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").is_ok_and(|t| !t.contains("[never]"))
}

/// Bytes of transparent huge pages in the mappings of process `pid` (this process for
/// `None`) that overlap `len` bytes from `start`: the `AnonHugePages` of each, from
/// `/proc/PID/smaps`.
pub fn bytes_in(pid: Option<u32>, start: u64, len: u64) -> io::Result<u64> {
    let path = pid.map_or_else(|| "/proc/self/smaps".to_string(), |p| format!("/proc/{p}/smaps"));
    let smaps = std::fs::read_to_string(&path).map_err(|e| io::Error::new(e.kind(), format!("{path}: {e}")))?;
    Ok(bytes_in_smaps(&smaps, start, len))
}

/// [`bytes_in`] over the text of an smaps file.
fn bytes_in_smaps(smaps: &str, start: u64, len: u64) -> u64 {
    let mut inside = false;
    let mut bytes = 0;
    for line in smaps.lines() {
        let mut words = line.split_whitespace();
        let Some(first) = words.next() else { continue };
        if let Some((lo, hi)) = first.split_once('-').filter(|_| !first.ends_with(':')) {
            let (lo, hi) = (u64::from_str_radix(lo, 16), u64::from_str_radix(hi, 16));
            inside = matches!((lo, hi), (Ok(lo), Ok(hi)) if lo < start + len && hi > start);
        } else if inside && first == "AnonHugePages:" {
            bytes += words.next().and_then(|kb| kb.parse::<u64>().ok()).unwrap_or(0) * 1024;
        }
    }
    bytes
}

#[cfg(test)]
mod tests {
    use super::*;

    const SMAPS: &str = "\
7f0000000000-7f0000400000 rw-p 00000000 00:00 0 
Size:               4096 kB
AnonHugePages:      2048 kB
7f0000400000-7f0000600000 rw-p 00000000 00:00 0 
Size:               2048 kB
AnonHugePages:         0 kB
7f0000600000-7f0000800000 rw-p 00000000 00:00 0                          [heap]
AnonHugePages:      2048 kB
";

    #[test]
    fn counts_the_mappings_a_range_overlaps_only() {
        assert_eq!(bytes_in_smaps(SMAPS, 0x7f00_0000_1000, 1), 2 << 20);
        assert_eq!(bytes_in_smaps(SMAPS, 0x7f00_0040_0000, 0x20_0000), 0);
        assert_eq!(bytes_in_smaps(SMAPS, 0x7f00_003f_f000, 0x30_0000), 4 << 20);
        assert_eq!(bytes_in_smaps(SMAPS, 0x7f00_0080_0000, 0x1000), 0);
    }
}
