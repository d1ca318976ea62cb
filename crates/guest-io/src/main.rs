//! `guest-io`: what the test guests run against their virtio disk, built static so that it
//! runs from a busybox initramfs.
//!
//! - `stress DEV SECONDS [THREADS]`: each thread owns the blocks `b % THREADS == t` and
//!   rewrites random ones of them with `O_DIRECT`, each write carrying its block number and a
//!   generation, and reads some back; at the end every block written is read and checked
//!   against the last generation acknowledged. THREADS requests are in flight at once. Reads
//!   land in a buffer the CPU never writes, so only the device's writes change it: on a
//!   migrating guest, a read whose page the backend did not mark dirty arrives stale.
//! - `bench DEV MODE BS QD SECONDS`: MODE is `randread`, `randwrite`, `read` or `write`;
//!   prints requests per second and MiB/s.
//! - `pauses DEV SECONDS [TOP]`: 4 KiB random writes one at a time to the upper half of DEV
//!   (`stress` may run on the lower), each timed; prints the TOP longest (the pauses a
//!   restart causes) and the median.
//! - `hold PATTERN MIB SECONDS DEV`: keeps MIB MiB of memory filled with PATTERN (which must
//!   never reach a driver domain) while reading DEV.
//!
//! Lines it prints start with `GUESTIO`; a failure ends with `GUESTIO FAIL` and exit status 1.
#![forbid(unsafe_code)]

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bulkhead_rng::Rng;

/// Why a run failed: said on the console for the host to read.
#[derive(Debug)]
struct Failure(String);

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

const BLOCK: usize = 4096;
const MAGIC: u32 = 0xb10c_4ead;

/// A buffer aligned for `O_DIRECT`.
struct Aligned {
    raw: Vec<u8>,
    off: usize,
    len: usize,
}

impl Aligned {
    fn new(len: usize) -> Aligned {
        let raw = vec![0u8; len + 4096];
        let off = raw.as_ptr().align_offset(4096);
        Aligned { raw, off, len }
    }
    fn buf(&mut self) -> &mut [u8] {
        &mut self.raw[self.off..self.off + self.len]
    }
}

/// The contents of `block` at generation `gen`.
fn fill(buf: &mut [u8], block: u64, gen: u32) {
    buf[0..4].copy_from_slice(&MAGIC.to_le_bytes());
    buf[4..8].copy_from_slice(&gen.to_le_bytes());
    buf[8..16].copy_from_slice(&block.to_le_bytes());
    Rng::new(block << 32 | u64::from(gen)).fill(&mut buf[16..]);
}

/// Checks `buf` holds `block` at generation `gen` (0: never written, all zero).
fn check(buf: &[u8], block: u64, gen: u32, scratch: &mut [u8]) -> Result<(), Failure> {
    if gen == 0 {
        return if buf.iter().all(|&b| b == 0) {
            Ok(())
        } else {
            Err(Failure(format!("block {block}: never written, yet not zero")))
        };
    }
    fill(scratch, block, gen);
    if buf == scratch {
        return Ok(());
    }
    let found_gen = u32::from_le_bytes(buf[4..8].try_into().expect("four bytes"));
    let found_block = u64::from_le_bytes(buf[8..16].try_into().expect("eight bytes"));
    Err(Failure(format!("block {block}: expected generation {gen}, found block {found_block} generation {found_gen}")))
}

fn open(dev: &str) -> Result<File, Failure> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(dev)
        .map_err(|e| Failure(format!("open {dev}: {e}")))
}

fn blocks_of(f: &File) -> Result<u64, Failure> {
    use std::io::{Seek, SeekFrom};
    let mut f = f;
    let size = f.seek(SeekFrom::End(0)).map_err(|e| Failure(format!("size: {e}")))?;
    Ok(size / BLOCK as u64)
}

fn stress(dev: &str, seconds: u64, threads: u64) -> Result<(), Failure> {
    let file = Arc::new(open(dev)?);
    // A region small enough that blocks are rewritten often, large enough to spread out.
    let blocks = blocks_of(&file)?.min(16384);
    let deadline = Instant::now() + Duration::from_secs(seconds);
    let ops = Arc::new(AtomicU64::new(0));
    let failed = Arc::new(AtomicBool::new(false));
    println!("GUESTIO started stress on {dev}: {blocks} blocks, {threads} threads, {seconds} s");
    let mut workers = Vec::new();
    for t in 0..threads {
        let (file, ops, failed) = (file.clone(), ops.clone(), failed.clone());
        workers.push(std::thread::spawn(move || -> Result<(Vec<u32>, u64), Failure> {
            let owned: Vec<u64> = (0..blocks).filter(|b| b % threads == t).collect();
            let mut gens = vec![0u32; owned.len()];
            let mut rng = Rng::new(t + 1);
            let (mut buf, mut scratch) = (Aligned::new(BLOCK), vec![0u8; BLOCK]);
            // Written by the device alone (the CPU only reads it).
            let mut rbuf = Aligned::new(BLOCK);
            let mut reads = 0;
            while Instant::now() < deadline && !failed.load(Ordering::Relaxed) {
                let i = (rng.next_u64() % owned.len() as u64) as usize;
                let b = owned[i];
                if rng.next_u64().is_multiple_of(4) {
                    file.read_exact_at(rbuf.buf(), b * BLOCK as u64).map_err(|e| Failure(format!("read block {b}: {e}")))?;
                    check(rbuf.buf(), b, gens[i], &mut scratch)?;
                    reads += 1;
                } else {
                    let gen = gens[i] + 1;
                    fill(buf.buf(), b, gen);
                    file.write_all_at(buf.buf(), b * BLOCK as u64).map_err(|e| Failure(format!("write block {b}: {e}")))?;
                    gens[i] = gen;
                }
                ops.fetch_add(1, Ordering::Relaxed);
            }
            Ok((gens, reads))
        }));
    }
    let mut last = Instant::now();
    while workers.iter().any(|w| !w.is_finished()) {
        std::thread::sleep(Duration::from_millis(100));
        if last.elapsed() >= Duration::from_secs(5) {
            println!("GUESTIO progress ops={}", ops.load(Ordering::Relaxed));
            last = Instant::now();
        }
    }
    let mut results = Vec::new();
    let mut first_err = None;
    for w in workers {
        match w.join().map_err(|_| Failure("a worker panicked".into())).and_then(|r| r) {
            Ok(r) => results.push(r),
            Err(e) => {
                failed.store(true, Ordering::Relaxed);
                first_err.get_or_insert(e);
            }
        }
    }
    if let Some(e) = first_err {
        return Err(e);
    }
    // Every block, read back.
    let (mut buf, mut scratch) = (Aligned::new(BLOCK), vec![0u8; BLOCK]);
    let mut verified = 0u64;
    let mut reads = 0;
    for (t, (gens, r)) in results.iter().enumerate() {
        reads += r;
        let owned = (0..blocks).filter(|b| b % threads == t as u64);
        for (b, &gen) in owned.zip(gens) {
            file.read_exact_at(buf.buf(), b * BLOCK as u64).map_err(|e| Failure(format!("verify block {b}: {e}")))?;
            check(buf.buf(), b, gen, &mut scratch)?;
            verified += 1;
        }
    }
    println!("GUESTIO ok stress ops={} reads={reads} verified={verified}", ops.load(Ordering::Relaxed));
    Ok(())
}

fn bench(dev: &str, mode: &str, bs: usize, qd: u64, seconds: u64) -> Result<(), Failure> {
    let file = Arc::new(open(dev)?);
    let blocks = blocks_of(&file)? * BLOCK as u64 / bs as u64;
    let (random, write) = match mode {
        "randread" => (true, false),
        "randwrite" => (true, true),
        "read" => (false, false),
        "write" => (false, true),
        other => return Err(Failure(format!("unknown mode {other} (randread, randwrite, read, write)"))),
    };
    let deadline = Instant::now() + Duration::from_secs(seconds);
    let started = Instant::now();
    let mut workers = Vec::new();
    for t in 0..qd {
        let file = file.clone();
        workers.push(std::thread::spawn(move || -> Result<u64, Failure> {
            let mut buf = Aligned::new(bs);
            buf.buf().fill(0x5a);
            let mut rng = Rng::new(t + 7);
            let mut n = 0u64;
            let mut seq = t * (blocks / qd.max(1));
            while Instant::now() < deadline {
                let b = if random { rng.next_u64() % blocks } else { seq % blocks };
                seq += 1;
                let at = b * bs as u64;
                if write {
                    file.write_all_at(buf.buf(), at).map_err(|e| Failure(format!("write at {at}: {e}")))?;
                } else {
                    file.read_exact_at(buf.buf(), at).map_err(|e| Failure(format!("read at {at}: {e}")))?;
                }
                n += 1;
            }
            Ok(n)
        }));
    }
    let mut total = 0;
    for w in workers {
        total += w.join().map_err(|_| Failure("a worker panicked".into()))??;
    }
    let secs = started.elapsed().as_secs_f64();
    let iops = total as f64 / secs;
    println!(
        "GUESTIO bench {mode} bs={bs} qd={qd} iops={iops:.0} mibs={:.1} requests={total} seconds={secs:.2}",
        iops * bs as f64 / 1048576.0
    );
    Ok(())
}

/// QD1 4 KiB random writes for `seconds` to the upper half of the device, each timed; prints
/// the `top` longest, ms, and the median.
fn pauses(dev: &str, seconds: u64, top: usize) -> Result<(), Failure> {
    let file = open(dev)?;
    // The upper half of the device: `stress` may run beside, on the lower.
    let total = blocks_of(&file)?;
    let (base, blocks) = (total / 2, (total / 2).clamp(1, 16384));
    let mut buf = Aligned::new(BLOCK);
    buf.buf().fill(0x3c);
    let mut rng = Rng::new(11);
    let mut lat: Vec<f64> = Vec::new();
    println!("GUESTIO started pauses on {dev}");
    let deadline = Instant::now() + Duration::from_secs(seconds);
    while Instant::now() < deadline {
        let b = base + rng.next_u64() % blocks;
        let t = Instant::now();
        file.write_all_at(buf.buf(), b * BLOCK as u64).map_err(|e| Failure(format!("write block {b}: {e}")))?;
        lat.push(t.elapsed().as_secs_f64() * 1000.0);
    }
    lat.sort_by(f64::total_cmp);
    let median = lat.get(lat.len() / 2).copied().unwrap_or(0.0);
    let longest: Vec<String> = lat.iter().rev().take(top).map(|l| format!("{l:.3}")).collect();
    println!("GUESTIO pauses requests={} median_ms={median:.3} longest_ms={}", lat.len(), longest.join(","));
    Ok(())
}

fn hold(pattern: &str, mib: usize, seconds: u64, dev: &str) -> Result<(), Failure> {
    let p = pattern.as_bytes();
    if p.is_empty() {
        return Err(Failure("empty pattern".into()));
    }
    let mut mem: Vec<u8> = p.iter().copied().cycle().take(mib << 20).collect();
    let file = open(dev)?;
    let blocks = blocks_of(&file)?;
    let mut buf = Aligned::new(BLOCK);
    let mut rng = Rng::new(3);
    println!("GUESTIO holding {mib} MiB of the pattern");
    let deadline = Instant::now() + Duration::from_secs(seconds);
    let mut n = 0u64;
    while Instant::now() < deadline {
        let b = rng.next_u64() % blocks;
        file.read_exact_at(buf.buf(), b * BLOCK as u64).map_err(|e| Failure(format!("read block {b}: {e}")))?;
        // Keep the pattern in use so the guest keeps it resident.
        let i = (n as usize * 4096) % mem.len();
        mem[i] = p[i % p.len()];
        n += 1;
    }
    println!("GUESTIO ok hold reads={n} pattern_bytes={}", mem.len());
    Ok(())
}

fn run(args: &[String]) -> Result<(), Failure> {
    let num = |i: usize, what: &str| -> Result<u64, Failure> {
        args.get(i).ok_or_else(|| Failure(format!("missing {what}")))?.parse::<u64>().map_err(|e| Failure(format!("{what}: {e}")))
    };
    match args.first().map(String::as_str) {
        Some("stress") => {
            stress(args.get(1).ok_or_else(|| Failure("missing DEV".into()))?, num(2, "SECONDS")?, num(3, "THREADS").unwrap_or(16))
        }
        Some("bench") => bench(
            args.get(1).ok_or_else(|| Failure("missing DEV".into()))?,
            args.get(2).ok_or_else(|| Failure("missing MODE".into()))?,
            num(3, "BS")? as usize,
            num(4, "QD")?,
            num(5, "SECONDS")?,
        ),
        Some("pauses") => pauses(
            args.get(1).ok_or_else(|| Failure("missing DEV".into()))?,
            num(2, "SECONDS")?,
            num(3, "TOP").unwrap_or(64) as usize,
        ),
        Some("hold") => hold(
            args.get(1).ok_or_else(|| Failure("missing PATTERN".into()))?,
            num(2, "MIB")? as usize,
            num(3, "SECONDS")?,
            args.get(4).ok_or_else(|| Failure("missing DEV".into()))?,
        ),
        _ => Err(Failure(
            "usage: guest-io stress DEV SECONDS [THREADS] | bench DEV MODE BS QD SECONDS | pauses DEV SECONDS [TOP] | \
             hold PATTERN MIB SECONDS DEV"
                .into(),
        )),
    }
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            println!("GUESTIO FAIL {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_block_checks_only_at_its_own_generation() {
        let (mut a, mut s) = (vec![0u8; BLOCK], vec![0u8; BLOCK]);
        fill(&mut a, 7, 3);
        assert!(check(&a, 7, 3, &mut s).is_ok());
        assert!(check(&a, 7, 2, &mut s).unwrap_err().0.contains("generation 3"));
        assert!(check(&a, 8, 3, &mut s).is_err());
        assert!(check(&vec![0u8; BLOCK], 9, 0, &mut s).is_ok());
        assert!(check(&a, 9, 0, &mut s).is_err());
    }
}
