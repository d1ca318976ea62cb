//! FUSE requests as the kernel would send them, through the export's real dispatch and I/O
//! (a `/dev/fuse` worker) over a sequenced-packet socket pair, to two devices served from
//! memory. Never a panic or a hang; every reply is well formed and answers a request that was
//! sent.
#![no_main]

use std::collections::HashSet;
use std::os::unix::net::UnixDatagram;
use std::sync::OnceLock;
use std::time::Duration;

use bulkhead_testkit::memdev::MemoryDevice;
use libfuzzer_sys::fuzz_target;

fn devices() -> &'static Vec<MemoryDevice> {
    static D: OnceLock<Vec<MemoryDevice>> = OnceLock::new();
    D.get_or_init(|| {
        let d = vec![MemoryDevice::new("disk0", 1 << 20, 1), MemoryDevice::new("ro", 64 << 10, 1)];
        d[1].device.set_read_only(true);
        d
    })
}

/// The requests in `data`: each starts with its length (a `fuse_in_header`'s first field),
/// clamped to what is left.
fn requests(data: &[u8]) -> Vec<&[u8]> {
    let mut out = Vec::new();
    let mut rest = data;
    while rest.len() >= 4 && out.len() < 64 {
        let len = (u32::from_le_bytes(rest[..4].try_into().unwrap()) as usize).clamp(4, rest.len());
        out.push(&rest[..len]);
        rest = &rest[len..];
    }
    out
}

fuzz_target!(|data: &[u8]| {
    let devs: Vec<_> = devices().iter().map(|d| d.device.clone()).collect();
    let (kernel, served) = seqpacket_pair();
    let reqs = requests(data);
    let uniques: HashSet<u64> =
        reqs.iter().filter(|r| r.len() >= 16).map(|r| u64::from_le_bytes(r[8..16].try_into().unwrap())).collect();
    let worker = std::thread::spawn(move || bulkhead_fuse_export::serve_session(served, devs));
    // Sent from a thread of its own: replies are read meanwhile, so neither side's buffer
    // fills while the other waits.
    let sender = kernel.try_clone().unwrap();
    let owned: Vec<Vec<u8>> = reqs.iter().map(|r| r.to_vec()).collect();
    let feeder = std::thread::spawn(move || {
        for r in &owned {
            if sender.send(r).is_err() {
                break;
            }
        }
        let _ = sender.shutdown(std::net::Shutdown::Write);
    });
    kernel.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let mut buf = vec![0u8; 2 << 20];
    while let Ok(n) = kernel.recv(&mut buf) {
        if n == 0 {
            break;
        }
        assert!(n >= 16, "a reply shorter than its header");
        let len = u32::from_le_bytes(buf[..4].try_into().unwrap()) as usize;
        assert_eq!(len, n, "a reply's length field");
        let unique = u64::from_le_bytes(buf[8..16].try_into().unwrap());
        assert!(uniques.contains(&unique), "a reply to request {unique}, which was not sent");
    }
    worker.join().expect("the FUSE worker panicked");
    let _ = feeder.join();
});

/// A pair of connected `SOCK_SEQPACKET` sockets: one request or reply per message, as
/// `/dev/fuse` reads and writes.
fn seqpacket_pair() -> (UnixDatagram, std::os::fd::OwnedFd) {
    let (a, b) = bulkhead_sys::seqpacket_pair().unwrap();
    (UnixDatagram::from(a), b)
}
