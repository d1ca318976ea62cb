//! What `serve` reads about attached applications from peers it does not trust: the lines an
//! application sends on its attach connection, and the
//! messages a domain sends on its attach line. Never a panic.
#![no_main]

use bulkhead_client::attach::wire::FromApp;
use bulkhead_spec::attach_line::FromDomain;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut conn = std::io::Cursor::new(data);
    while let Ok(Some(line)) = bulkhead_client::attach::read_line(&mut conn) {
        let _ = serde_json::from_str::<FromApp>(&line);
    }
    // A domain's attach line carries one message per datagram.
    let _ = serde_json::from_slice::<FromDomain>(&data[..data.len().min(bulkhead_spec::attach_line::MAX_MESSAGE)]);
});
