//! `bulkhead`: serve block devices from isolated driver domains.
#![deny(unsafe_code)]

/// The system allocator until a domain with guarded filters activates heap spaces (see
/// `bulkhead_guard::heap`); one relaxed load per allocation otherwise. The library's users
/// (this and the test build) each set it.
#[global_allocator]
static HEAP: bulkhead_guard::heap::Heap = bulkhead_guard::heap::Heap::new();

fn main() -> std::process::ExitCode {
    bulkhead_cli::run()
}
