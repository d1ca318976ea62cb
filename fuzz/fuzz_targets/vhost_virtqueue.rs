//! A guest's virtqueue as the vhost-user-blk export walks it: the available ring, descriptor
//! chains (indirect tables included) and virtio-blk request headers, all written by the
//! guest, in a guest memory made of the input. Never a panic; every chain taken is whole and
//! within guest memory, and every request parsed lies within the device.
#![no_main]

use std::sync::Arc;

use bulkhead_block::Command;
use bulkhead_vhost_export::blk::{self, BlkOp, Geometry, Parsed};
use bulkhead_vhost_export::memory::GuestMem;
use bulkhead_vhost_export::virtq::{Chain, RingAddrs, RingPosition, Vring};
use libfuzzer_sys::fuzz_target;
use vhost::vhost_user::message::VhostUserMemoryRegion;
use vm_memory::GuestAddress;

/// Guest memory: 64 KiB at guest address 0x10000.
const BASE: u64 = 0x1_0000;
const SIZE: u64 = 64 << 10;

fuzz_target!(|data: &[u8]| {
    // The first bytes choose the ring: its size, features and where the device stands.
    let [size_bits, flags, a0, a1, rest @ ..] = data else { return };
    let size = 1u16 << (size_bits % 9);
    let (event_idx, indirect) = (flags & 1 != 0, flags & 2 != 0);
    let next_avail = u16::from_le_bytes([*a0, *a1]);
    let mem = guest_memory(rest);
    let n = u64::from(size);
    let desc = GuestAddress(BASE);
    let avail = GuestAddress(BASE + 16 * n);
    let used = GuestAddress((BASE + 16 * n + 6 + 2 * n + 3) & !3);
    let at = RingPosition { next_avail, next_used: next_avail };
    let Ok(mut ring) = Vring::new(mem.clone(), size, RingAddrs { desc, avail, used }, at, event_idx, indirect) else {
        return;
    };
    let g = Geometry { size: 1 << 20, block: 512, queues: 1, max_request: 1 << 20, read_only: flags & 4 != 0, id: "fuzz".into() };
    let (mut chain, mut data) = (Chain::default(), Vec::new());
    for _ in 0..2 * n {
        let Ok(Some(head)) = ring.pop() else { break };
        if ring.chain(head, &mut chain).is_err() {
            break;
        }
        for s in chain.readable.iter().chain(&chain.writable) {
            assert!(mem.holds(s.addr, u64::from(s.len)), "a buffer outside guest memory");
        }
        let written = match blk::parse(&mem, &chain, &g, &mut data) {
            Parsed::NoStatus => 0,
            Parsed::Refused { .. } => 1,
            Parsed::Request { op: BlkOp::GetId, .. } => blk::write_id(&mem, &data, &g.id),
            Parsed::Request { op: BlkOp::Io(cmd), .. } => {
                let range = match cmd {
                    Command::Read { offset, into: len } | Command::Write { offset, from: len, .. } => {
                        Some((offset, u64::from(len)))
                    }
                    Command::Discard { offset, len } | Command::WriteZeroes { offset, len } => Some((offset, len)),
                    Command::Flush => None,
                };
                if let Some((offset, len)) = range {
                    assert!(offset.checked_add(len).is_some_and(|end| end <= g.size), "a request beyond the device");
                }
                if let Command::Read { into, .. } | Command::Write { from: into, .. } = cmd {
                    let held: u64 = data.iter().map(|s| u64::from(s.len)).sum();
                    assert_eq!(held, u64::from(into), "the data buffers hold the request's bytes");
                }
                1
            }
        };
        if ring.push_used(head, written).is_err() {
            break;
        }
    }
});

/// One region of guest memory holding `bytes` (zeroes after them), in a sealed memory file.
fn guest_memory(bytes: &[u8]) -> Arc<GuestMem> {
    use std::io::Write;
    let fd = bulkhead_shmem::memfd::create("fuzz-guest", SIZE).unwrap();
    let mut file = std::fs::File::from(fd);
    file.write_all(&bytes[..bytes.len().min(SIZE as usize)]).unwrap();
    bulkhead_shmem::memfd::seal_size(std::os::fd::AsRawFd::as_raw_fd(&file)).unwrap();
    let region = VhostUserMemoryRegion::new(BASE, SIZE, 0x7f00_0000_0000, 0);
    Arc::new(GuestMem::map(&[region], vec![file], &Arc::default()).unwrap())
}
