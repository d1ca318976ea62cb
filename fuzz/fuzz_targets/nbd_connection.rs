//! A client's bytes on an NBD connection, through the server's real connection code:
//! greeting, option haggling (STARTTLS with a pre-shared key offered), transmission, over a
//! socket pair to a device served from memory. Never a panic or a hang: the server answers
//! what it can and closes the connection when the bytes end.
#![no_main]

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::OnceLock;
use std::time::Duration;

use bulkhead_nbd_export::tls::{Tls, TlsMode};
use bulkhead_nbd_export::{Export, NbdServer, Reach, ServerConfig};
use bulkhead_testkit::memdev::MemoryDevice;
use libfuzzer_sys::fuzz_target;

struct Fixture {
    server: NbdServer,
    _devices: Vec<MemoryDevice>,
}

/// Threads of this process.
fn threads() -> usize {
    std::fs::read_dir("/proc/self/task").map_or(0, |d| d.count())
}

fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| {
        let devices = vec![MemoryDevice::new("disk0", 1 << 20, 1), MemoryDevice::new("ro", 64 << 10, 1)];
        devices[1].device.set_read_only(true);
        let dir = std::env::temp_dir().join(format!("bulkhead-fuzz-nbd-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let psk = dir.join("keys.psk");
        std::fs::write(&psk, "fuzz:000102030405060708090a0b0c0d0e0f\n").unwrap();
        let tls = Tls::load_psk(&psk, TlsMode::On).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        let cfg = ServerConfig {
            unix: None,
            tcp: None,
            max_connections: 4,
            workers_per_connection: 2,
            handshake_timeout: Duration::from_secs(2),
            request_timeout: Duration::from_secs(2),
            tls: Some(tls),
        };
        let server = NbdServer::start(devices.iter().map(|d| Export::new(d.device.clone(), Reach::Anywhere)).collect(), cfg).unwrap();
        Fixture { server, _devices: devices }
    })
}

fuzz_target!(|data: &[u8]| {
    let f = fixture();
    let before = threads();
    let (client, served) = UnixStream::pair().unwrap();
    let input = data.to_vec();
    let mut writer = client.try_clone().unwrap();
    let feeder = std::thread::spawn(move || {
        let _ = writer.write_all(&input);
        let _ = writer.shutdown(std::net::Shutdown::Write);
    });
    let server = std::thread::scope(|s| {
        let h = s.spawn(|| f.server.serve_connection(served.into()));
        // Everything the server says, until it closes.
        let mut answers = Vec::new();
        let mut reader = client;
        reader.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        let _ = reader.read_to_end(&mut answers);
        h.join()
    });
    let _ = server.expect("the connection's thread panicked");
    let _ = feeder.join();
    // A scoped thread is joined once its closure returns, and a TLS relay's thread is not
    // joined at all: either may still be freeing what it held (its name, its handle) as its
    // OS thread ends. Wait until they are all gone, so the leak check counts only what stays.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while threads() > before && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_micros(50));
    }
});
