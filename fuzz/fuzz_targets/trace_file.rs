//! `bulkhead trace FILE` reading an untrusted trace file: never a panic, and what it reports
//! stays consistent with what it read.
#![no_main]

use bulkhead_filters::trace_summary::summarize;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(s) = summarize(data) else { return };
    assert!(s.trailing_bytes < 48);
    let queued: u64 = s.ops.iter().map(|o| o.queued).sum();
    let completed: u64 = s.ops.iter().map(|o| o.completed).sum();
    assert!(queued + completed <= s.records);
    assert_eq!(s.per_queue.iter().map(|q| q.1).sum::<u64>(), queued);
    for o in &s.ops {
        assert!(o.errors <= o.completed);
        assert!(o.p50_us <= o.p99_us && o.p99_us <= o.max_us);
    }
});
