//! A driver domain serving an untrusted qcow2 image: the file's bytes are the input; opening
//! it, reading it whole, writing, discarding and flushing either fail or succeed, never panic
//! or hang.
#![no_main]

use std::os::fd::AsRawFd;

use bulkhead_backends::{ImageLayer, Qcow2Backend};
use bulkhead_block::{Backend, Io, Request, SliceList};
use bulkhead_image::Format;
use bulkhead_shmem::{memfd, Mapping, Protection};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if data.len() > 1 << 20 {
        return;
    }
    let fd = memfd::create("image", 0).unwrap();
    let file = std::fs::File::from(fd);
    std::os::unix::fs::FileExt::write_all_at(&file, data, 0).unwrap();
    let Ok(mut q) = Qcow2Backend::open(vec![ImageLayer { fd: file.into(), format: Format::Qcow2 }], false) else {
        return;
    };
    let buf = memfd::create("buf", 1 << 16).unwrap();
    let m = Mapping::new(buf.as_raw_fd(), 1 << 16, Protection::ReadWrite).unwrap();
    let w = m.slice(0, 1 << 16).unwrap();
    let size = q.size().min(8 << 20);
    let mut at = 0;
    while at + (1 << 16) <= size {
        let mut ios = [Io::new(Request::Read { offset: at, into: SliceList::one(w) })];
        q.execute(&mut ios);
        at += 1 << 16;
    }
    if size >= 1 << 16 {
        let mut ios = [
            Io::new(Request::Write { offset: 0, from: SliceList::one(w), fua: false }),
            Io::new(Request::Discard { offset: 0, len: 4096 }),
            Io::new(Request::WriteZeroes { offset: size - 4096, len: 4096 }),
            Io::new(Request::Flush),
        ];
        q.execute(&mut ios);
    }
});
