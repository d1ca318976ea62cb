//! A driver domain's search of its own memory for patterns a test planted elsewhere (a
//! guest's RAM): what a hostile driver would do to find a guest's secrets. Run by the test
//! driver when `BULKHEAD_TEST_SEARCH` names patterns.
//!
//! The patterns travel masked (each byte XOR [`MASK`], in hex) and are compared masked, so the
//! search never holds one in plain form and cannot find itself. `/proc/self/maps` and
//! `/proc/self/mem` are opened before the domain confines itself; reads through the latter
//! fail cleanly on unreadable pages where a plain load would fault.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::os::unix::fs::FileExt;
use std::time::{Duration, Instant};

/// What each pattern byte is XORed with in transit.
pub const MASK: u8 = 0xa5;

/// `pattern` masked and in hex, as `BULKHEAD_TEST_SEARCH` carries it.
pub fn encode(pattern: &[u8]) -> String {
    pattern.iter().map(|b| format!("{:02x}", b ^ MASK)).collect()
}

fn decode(hex: &str) -> Option<Vec<u8>> {
    (0..hex.len()).step_by(2).map(|i| hex.get(i..i + 2).and_then(|h| u8::from_str_radix(h, 16).ok())).collect()
}

/// Whether `hay` holds the pattern whose masked bytes are `masked`.
fn contains_masked(hay: &[u8], masked: &[u8]) -> bool {
    let Some((&first, rest)) = masked.split_first() else { return false };
    let first = first ^ MASK;
    let mut at = 0;
    while let Some(p) = hay[at..].iter().position(|&b| b == first) {
        let i = at + p;
        if hay.len() - i > rest.len() && hay[i + 1..i + 1 + rest.len()].iter().zip(rest).all(|(&h, &m)| h == m ^ MASK) {
            return true;
        }
        at = i + 1;
    }
    false
}

/// Starts the search thread for the `,`-separated masked patterns in `spec`: every 300 ms it
/// reads every readable mapping of the process and reports on stderr, as
/// `bulkhead memory-search: …` lines, each pattern the first time it is found and every
/// second how much it has scanned.
pub fn spawn(spec: &str) -> std::io::Result<()> {
    let patterns: Vec<Vec<u8>> = spec.split(',').filter_map(decode).filter(|p| !p.is_empty()).collect();
    let maps = File::open("/proc/self/maps")?;
    let mem = File::open("/proc/self/mem")?;
    std::thread::Builder::new().name("memory-search".into()).spawn(move || search(maps, mem, patterns))?;
    Ok(())
}

fn search(mut maps: File, mem: File, patterns: Vec<Vec<u8>>) {
    let mut found = vec![false; patterns.len()];
    let mut chunk = vec![0u8; 1 << 20];
    let overlap = patterns.iter().map(Vec::len).max().unwrap_or(0);
    let mut scans = 0u64;
    let mut last_report = Instant::now();
    loop {
        std::thread::sleep(Duration::from_millis(300));
        let mut text = String::new();
        if maps.seek(SeekFrom::Start(0)).is_err() || maps.read_to_string(&mut text).is_err() {
            eprintln!("bulkhead memory-search: cannot read /proc/self/maps");
            return;
        }
        let mut bytes = 0u64;
        for line in text.lines() {
            let mut f = line.split_whitespace();
            let (Some(range), Some(perms)) = (f.next(), f.next()) else { continue };
            let name = line.split_whitespace().nth(5).unwrap_or("");
            if !perms.starts_with('r') || name.starts_with("[v") {
                continue;
            }
            let Some((lo, hi)) = range.split_once('-') else { continue };
            let (Ok(lo), Ok(hi)) = (u64::from_str_radix(lo, 16), u64::from_str_radix(hi, 16)) else { continue };
            let mut at = lo;
            while at < hi {
                let len = ((hi - at) as usize).min(chunk.len());
                let Ok(n) = mem.read_at(&mut chunk[..len], at) else { break };
                if n == 0 {
                    break;
                }
                bytes += n as u64;
                for (i, p) in patterns.iter().enumerate() {
                    if !found[i] && contains_masked(&chunk[..n], p) {
                        found[i] = true;
                        eprintln!("bulkhead memory-search: pattern {i} found at about {at:#x} ({name})");
                    }
                }
                // Step back a little so a pattern across two chunks is seen.
                at += (n as u64).saturating_sub(overlap as u64).max(1);
            }
        }
        scans += 1;
        if last_report.elapsed() >= Duration::from_secs(1) {
            last_report = Instant::now();
            eprintln!("bulkhead memory-search: {scans} scans, the last of {} MiB", bytes >> 20);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_a_masked_pattern_and_not_a_near_miss() {
        let p = b"a secret the guest keeps";
        let masked = decode(&encode(p)).unwrap();
        let mut hay = vec![0u8; 4096];
        hay[1000..1000 + p.len()].copy_from_slice(p);
        assert!(contains_masked(&hay, &masked));
        hay[1000 + p.len() - 1] ^= 1;
        assert!(!contains_masked(&hay, &masked));
        assert!(!contains_masked(&hay[..10], &masked));
    }
}
