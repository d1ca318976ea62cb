//! Attaches to a device or view of a running `bulkhead serve`, writes a block, reads it back,
//! and times 4 KiB reads at queue depth 1.
//!
//! ```sh
//! cargo run --release -p bulkhead-client --example attach -- /run/bulkhead disk0
//! ```

use std::path::Path;
use std::time::Instant;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let (Some(run_dir), Some(name)) = (args.get(1), args.get(2)) else {
        eprintln!("usage: attach RUN_DIR NAME [READS]");
        std::process::exit(2);
    };
    let reads: usize = args.get(3).and_then(|n| n.parse().ok()).unwrap_or(10_000);
    let dev = match bulkhead_client::attach(Path::new(run_dir), name) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("attach: {name}: {e}");
            std::process::exit(1);
        }
    };
    println!("attached to {name}: {} bytes, {} queue(s), read-only: {}", dev.size(), dev.queue_count(), dev.read_only());
    let block: Vec<u8> = (0..4096u32).map(|i| (i * 7 + 3) as u8).collect();
    if !dev.read_only() {
        if let Err(e) = dev.write(0, 0, &block, true) {
            eprintln!("write: {e}");
            std::process::exit(1);
        }
        let mut back = vec![0u8; 4096];
        if let Err(e) = dev.read_into(0, 0, &mut back) {
            eprintln!("read: {e}");
            std::process::exit(1);
        }
        assert_eq!(back, block, "read back what was written");
        println!("wrote and read back 4 KiB at offset 0");
    }
    let blocks = dev.size() / 4096;
    let mut buf = vec![0u8; 4096];
    let mut lat = Vec::with_capacity(reads);
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    for _ in 0..reads {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let t = Instant::now();
        if let Err(e) = dev.read_into(0, (x % blocks) * 4096, &mut buf) {
            eprintln!("read: {e}");
            std::process::exit(1);
        }
        lat.push(t.elapsed().as_nanos() as u64);
    }
    lat.sort_unstable();
    let pct = |p: f64| lat[((lat.len() - 1) as f64 * p) as usize] as f64 / 1000.0;
    println!("{reads} reads of 4 KiB at QD1: p50 {:.2} µs, p99 {:.2} µs", pct(0.5), pct(0.99));
}
