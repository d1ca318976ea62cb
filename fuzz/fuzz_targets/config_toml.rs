//! A configuration as `serve --config`, `bulkhead device add`, `view add` and `filter add`
//! read it: never a panic; and a configuration that parses is written out by `config dump` as
//! a file that parses back to the same devices.
#![no_main]

use bulkhead_config::{parse_filter, parse_view, Config};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    if let Ok(cfg) = Config::parse(text, "fuzz") {
        let dump = cfg.dump();
        let again = Config::parse(&dump, "dump").unwrap_or_else(|e| panic!("the dump does not parse: {e}\n{dump}"));
        assert_eq!(again.devices, cfg.devices, "the dump reads back as other devices");
        if let Some(d) = cfg.devices.first() {
            let _ = parse_view(text, d);
        }
    }
    let _ = Config::parse_devices(text, "fuzz");
    let _ = parse_filter(text, "fuzz", 0, 1000);
});
