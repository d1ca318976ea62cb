//! A frontend's vhost-user messages, through rust-vmm's message parsing and the export's own
//! handling of each (features, protocol features, rings, config space, in-flight tracking),
//! over a socket pair, for a device served from memory. Messages that must carry descriptors
//! come without them. Never a panic or a hang: the session ends when the bytes do.
#![no_main]

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::OnceLock;
use std::time::Duration;

use bulkhead_testkit::memdev::MemoryDevice;
use libfuzzer_sys::fuzz_target;

fn device() -> &'static MemoryDevice {
    static D: OnceLock<MemoryDevice> = OnceLock::new();
    D.get_or_init(|| MemoryDevice::new("disk0", 1 << 20, 2))
}

fuzz_target!(|data: &[u8]| {
    let dev = device().device.clone();
    let (frontend, backend) = UnixStream::pair().unwrap();
    let session = std::thread::spawn(move || bulkhead_vhost_export::serve_frontend(dev, backend));
    let mut writer = frontend.try_clone().unwrap();
    let input = data.to_vec();
    let feeder = std::thread::spawn(move || {
        let _ = writer.write_all(&input);
        let _ = writer.shutdown(std::net::Shutdown::Write);
    });
    let mut replies = Vec::new();
    let mut reader = frontend;
    reader.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let _ = reader.read_to_end(&mut replies);
    session.join().expect("the vhost-user session panicked");
    let _ = feeder.join();
});
