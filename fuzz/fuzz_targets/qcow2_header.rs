//! The supervisor reading an untrusted qcow2 header: never a panic, and every header it accepts
//! is within the specification's limits.
#![no_main]

use bulkhead_image::Qcow2Header;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(h) = Qcow2Header::parse(data) else { return };
    assert!((9..=21).contains(&h.cluster_bits));
    assert!(h.size <= 1 << 61);
    if let Some(b) = &h.backing {
        assert!(!b.name.is_empty() && b.name.len() <= 1023 && !b.name.contains('\0'));
        assert!(!b.name.starts_with("json:") && !b.name.contains("://"));
    }
});
