//! Snapshot operations on an untrusted qcow2 file: the supervisor lists the snapshot table,
//! the domain creates, reverts to and deletes snapshots. Never a panic, never a write past a
//! bounded size, and on an image the operations accept, a snapshot just taken is listed.
//!
//! The input is a small qcow2 image made by `bulkhead_image::new_image` with the fuzzer's
//! bytes laid over its clusters, so the mutations reach the tables rather than failing at the
//! magic.
#![no_main]

use std::cell::RefCell;
use std::io;

use bulkhead_image::snapshot::{self, ImageFile};
use libfuzzer_sys::fuzz_target;

/// Larger than any image the input makes, so a write far past the end is a finding.
const LIMIT: u64 = 64 << 20;

struct Mem(RefCell<Vec<u8>>);

impl ImageFile for Mem {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let d = self.0.borrow();
        for (i, b) in buf.iter_mut().enumerate() {
            *b = d.get(offset as usize + i).copied().unwrap_or(0);
        }
        Ok(())
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        let end = offset + buf.len() as u64;
        assert!(end <= LIMIT, "a write to {end}");
        let mut d = self.0.borrow_mut();
        if d.len() < end as usize {
            d.resize(end as usize, 0);
        }
        d[offset as usize..end as usize].copy_from_slice(buf);
        Ok(())
    }

    fn file_len(&self) -> io::Result<u64> {
        Ok(self.0.borrow().len() as u64)
    }

    fn sync(&self) -> io::Result<()> {
        Ok(())
    }
}

fuzz_target!(|data: &[u8]| {
    if data.is_empty() {
        return;
    }
    let mut img = bulkhead_image::new_image(1 << 20, 12, None).expect("a valid image");
    // The first byte picks the operation; the rest overwrite the image from byte 72 on (past
    // the fields that make it qcow2 at all), wrapping, as XOR so the base layout survives
    // where the input is zero.
    let (op, rest) = (data[0], &data[1..]);
    for (i, b) in rest.iter().enumerate() {
        let at = 72 + i % (img.len() - 72);
        img[at] ^= b;
    }
    let f = Mem(RefCell::new(img));
    let _ = snapshot::list(&f);
    match op % 4 {
        0 => {
            if snapshot::create(&f, "fuzz", (1, 2)).is_ok() {
                let names: Vec<String> = snapshot::list(&f).expect("listable").into_iter().map(|s| s.name).collect();
                assert!(names.iter().any(|n| n == "fuzz"), "{names:?}");
            }
        }
        1 => {
            let _ = snapshot::create(&f, "a", (0, 0));
            let _ = snapshot::revert(&f, "a");
        }
        2 => {
            let _ = snapshot::create(&f, "a", (0, 0));
            let _ = snapshot::delete(&f, "a");
        }
        _ => {
            let _ = snapshot::revert(&f, "a");
            let _ = snapshot::delete(&f, "a");
        }
    }
});
