//! The frontend's handling of responses from a hostile driver: arbitrary response slots and
//! producer indexes, interleaved with submissions. The frontend must never panic, must deliver
//! each submitted request at most once, and once it reports the channel broken it must stay so.
#![no_main]

use bulkhead_channel::{pair, FrontRequest, NotifyMode, QueueConfig};
use bulkhead_ring::{HeaderOffsets, ResponseSlot, RingLayout};
use libfuzzer_sys::fuzz_target;
use std::collections::HashSet;
use std::sync::atomic::Ordering;

const NSLOTS: u32 = 8;

fuzz_target!(|data: &[u8]| {
    let cfg = QueueConfig { nslots: NSLOTS, arena_bytes: 64 << 10, mode: NotifyMode::Poll, ..Default::default() };
    let Ok((mut front, mut back)) = pair(&cfg, 1 << 20) else { return };
    let layout = RingLayout::new(NSLOTS).unwrap();
    let mut submitted = HashSet::new();
    let mut delivered = HashSet::new();
    let mut next_user = 0u64;
    let mut ids: Vec<u64> = Vec::new();
    let mut broken = false;
    let mut rsp_prod = 0u32;
    for op in data.chunks(24) {
        let k = op[0] % 4;
        match k {
            0 => {
                let len = 512 * (1 + (op.get(1).copied().unwrap_or(0) as u64 % 16));
                let req = if op.get(2).copied().unwrap_or(0) % 2 == 0 {
                    FrontRequest::Read { offset: 0, into: len }
                } else {
                    FrontRequest::Flush
                };
                if front.submit(req, next_user).is_ok() {
                    submitted.insert(next_user);
                }
                next_user += 1;
                // Learn the real id the driver would see.
                while let Ok(Some(bulkhead_channel::Popped::Valid(r))) = back.pop() {
                    ids.push(r.id());
                }
            }
            1 | 2 => {
                // A response slot: either a real id (honest-looking) or arbitrary bytes.
                let b = |i: usize| op.get(i).copied().unwrap_or(0);
                let id = if k == 1 && !ids.is_empty() {
                    ids[b(1) as usize % ids.len()]
                } else {
                    u64::from_le_bytes([b(1), b(2), b(3), b(4), b(5), b(6), b(7), b(8)])
                };
                let rsp = ResponseSlot {
                    id,
                    generation: if b(9) % 8 == 0 { b(10) as u32 } else { cfg.generation },
                    status: if b(11) % 8 == 0 { b(12) as u32 } else { 0 },
                    len: if b(13) % 4 == 0 { b(14) as u64 * 512 } else { 512 * (1 + b(15) as u64 % 16) },
                    reserved: 0,
                };
                let map = back.ring_mapping();
                map.write_obj(layout.rsp_slot(rsp_prod), &rsp).unwrap();
                rsp_prod = rsp_prod.wrapping_add(if b(16) % 16 == 0 { b(17) as u32 } else { 1 });
                map.atomic_u32(HeaderOffsets::RSP_PROD).unwrap().store(rsp_prod, Ordering::Release);
            }
            _ => {
                let r = front.reap(|c| {
                    assert!(submitted.contains(&c.user), "delivered a request never submitted");
                    assert!(delivered.insert(c.user), "delivered a request twice");
                    if let Some(d) = c.data {
                        let mut buf = vec![0u8; d.len()];
                        d.copy_to(&mut buf);
                    }
                });
                match r {
                    Ok(_) => assert!(!broken, "a broken channel delivered again"),
                    Err(_) => broken = true,
                }
            }
        }
    }
});
