//! The driver domain's validation of a request slot written by a hostile frontend.
#![no_main]

use bulkhead_block::Op;
use bulkhead_ring::{validate_request, ArenaSizes, RequestSlot, ARENA_READ, ARENA_WRITE, MAX_REQUEST_BYTES};
use libfuzzer_sys::fuzz_target;
use zerocopy::FromBytes;

fuzz_target!(|data: &[u8]| {
    let Ok((slot, rest)) = RequestSlot::read_from_prefix(data) else { return };
    let word = |i: usize| rest.get(i * 8..i * 8 + 8).map(|b| u64::from_le_bytes(b.try_into().unwrap())).unwrap_or(0);
    let arenas = ArenaSizes { write: word(0) % (1 << 31), read: word(1) % (1 << 31) };
    let device = word(2);
    let generation = word(3) as u32;
    let Ok(v) = validate_request(&slot, arenas, device, generation) else { return };
    // Everything the runtime will act on holds.
    assert_eq!(v.generation(), generation);
    assert!(v.offset().checked_add(v.len()).is_some_and(|e| e <= device));
    let mut sum = 0u64;
    for s in v.segments() {
        let (arena, size) = if v.op() == Op::Write { (ARENA_WRITE, arenas.write) } else { (ARENA_READ, arenas.read) };
        assert_eq!(s.arena, arena);
        assert!(s.len > 0 && s.offset + s.len as u64 <= size);
        sum += s.len as u64;
    }
    match v.op() {
        Op::Read | Op::Write => assert!(sum == v.len() && v.len() <= MAX_REQUEST_BYTES && v.segments().len() > 0),
        _ => assert_eq!(v.segments().len(), 0),
    }
    assert!(!v.fua() || v.op() == Op::Write);
});
