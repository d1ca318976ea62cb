//! The guard in real processes: each scenario runs in a child process of its own (the guard is
//! process-wide and a stopped write ends the process), for both mechanisms.

use std::process::Command;

use bulkhead_guard::{Act, Guard, Mechanism, Mode, Violation, PAGE, VIOLATION_EXIT};

const PAGES: usize = 16;
/// What a scenario prints when every check in it held.
const PASSED: &str = "scenario passed";

/// Runs `scenario` under `mechanism` in a child process (this test binary again).
fn child(scenario: &str, mechanism: &str, shm: &str) -> std::process::Output {
    Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "scenario", "--nocapture", "--test-threads=1"])
        .env("GUARD_SCENARIO", scenario)
        .env("GUARD_MECHANISM", mechanism)
        .env("GUARD_SHM", shm)
        .output()
        .unwrap()
}

fn mechanisms() -> [&'static str; 2] {
    ["userfaultfd", "mprotect"]
}

/// A shared memory file of PAGES pages, mapped read-write.
fn map_shm(path: &str) -> &'static mut [u8] {
    use std::os::fd::AsRawFd;
    let f = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(false).open(path).unwrap();
    f.set_len(PAGES as u64 * PAGE).unwrap();
    // SAFETY: a new shared mapping of a file of that length, never unmapped (the process ends).
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            PAGES * PAGE as usize,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            f.as_raw_fd(),
            0,
        )
    };
    assert_ne!(p, libc::MAP_FAILED);
    // SAFETY: the mapping above, PAGES pages long, used by this process only through this slice.
    unsafe { std::slice::from_raw_parts_mut(p.cast::<u8>(), PAGES * PAGE as usize) }
}

fn write(mem: &mut [u8], page: usize, v: u8) {
    // A volatile store: the compiler must make exactly this write.
    // SAFETY: in bounds of the slice.
    unsafe { std::ptr::write_volatile(mem.as_mut_ptr().add(page * PAGE as usize + 8), v) };
}

fn act_for(mem: &[u8], pages: &[usize]) -> Act {
    let mut a = Act::new();
    for &p in pages {
        a.allow_slice(&mem[p * PAGE as usize..(p + 1) * PAGE as usize]).unwrap();
    }
    a
}

/// A guard under SCDWC with C = 8 whose page gate shuts `mem`'s pages 0..8, the runtime's,
/// to filter 0, whose own pages 8..16 are its table.
fn gated_halves(mechanism: Mechanism, mem: &[u8]) -> (Guard, Act) {
    let base = mem.as_ptr() as u64;
    let mut g = Guard::install(mechanism, Mode::Scdwc { cache: 8 }, Some(1)).unwrap();
    g.add_region(base, 8 * PAGE, "runtime").unwrap();
    let own = g.add_region(base + 8 * PAGE, 8 * PAGE, "filter").unwrap();
    g.own_region(own, 0).unwrap();
    g.gate_pages(&[true]).unwrap();
    (g, act_for(mem, &(8..16).collect::<Vec<_>>()))
}

/// The scenarios; does nothing unless run by `child`.
#[test]
fn scenario() {
    let Ok(which) = std::env::var("GUARD_SCENARIO") else { return };
    let mechanism = match std::env::var("GUARD_MECHANISM").unwrap().as_str() {
        "userfaultfd" => Mechanism::Userfault,
        _ => Mechanism::Mprotect,
    };
    let mem = map_shm(&std::env::var("GUARD_SHM").unwrap());
    let base = mem.as_ptr() as u64;
    match which.as_str() {
        "dwc" => {
            let mut g = Guard::install(mechanism, Mode::Dwc, None).unwrap();
            g.add_region(base, PAGES as u64 * PAGE, "runtime").unwrap();
            let act = act_for(mem, &[3]);
            g.call(7, &act, || {
                write(mem, 3, 1);
                // Protected again one instruction after the first write: caught again.
                write(mem, 3, 2);
            })
            .unwrap();
            let s = g.stats();
            assert_eq!((s.allowed, s.steps), (2, 2), "{s:?}");
            // The runtime's own write, between calls, is let through.
            write(mem, 5, 5);
            assert_eq!(g.stats().outside, 1);
            g.call(7, &act, || write(mem, 3, 3)).unwrap();
            assert_eq!(g.stats().allowed, 3);
            assert_eq!(g.stats().region_protects, 2, "every call protects every region");
            println!("{PASSED}");
        }
        "scdwc" => {
            let mut g = Guard::install(mechanism, Mode::Scdwc { cache: 2 }, None).unwrap();
            g.add_region(base, PAGES as u64 * PAGE, "runtime").unwrap();
            let act = act_for(mem, &[1, 2, 3]);
            g.call(1, &act, || {
                write(mem, 1, 1);
                write(mem, 1, 1);
                write(mem, 2, 2);
                // Pushes page 1 out, protected again.
                write(mem, 3, 3);
            })
            .unwrap();
            let s = g.stats();
            assert_eq!((s.allowed, s.steps, s.page_protects), (3, 0, 1), "{s:?}");
            assert_eq!(s.open_pages, 2, "the cache holds C pages open: {s:?}");
            // What DWC would stop, asked from inside a call: a guarded page outside the table,
            // not a page in it, nor memory outside every region; and nothing outside a call.
            let h = bulkhead_guard::capture::Handle::new();
            let at = |page: u64| base + page * PAGE + 8;
            let outside = [0u64; 1].as_ptr() as u64;
            let seen = g.call(1, &act, || (h.would_stop(at(5)), h.would_stop(at(2)), h.would_stop(outside))).unwrap();
            assert_eq!(seen, (true, false, false));
            assert!(!h.would_stop(at(5)), "no call runs");
            // Runtime writes between calls: page 9 and 10 enter the cache, pushing 2 and 3 out
            // to the pool; 9 goes to the pool when 11 comes.
            write(mem, 9, 9);
            write(mem, 10, 10);
            write(mem, 11, 11);
            assert_eq!(g.stats().outside, 3);
            g.call(1, &act, || {
                // Page 10 and 11 are still open (cached); 1, 2 and 3 fault again.
                write(mem, 10, 1);
                write(mem, 11, 1);
                write(mem, 2, 1);
            })
            .unwrap();
            let s = g.stats();
            assert_eq!(s.allowed, 4, "{s:?}");
            assert_eq!(s.page_protects, 1 + 3 + 1, "pool of 2, 3, 9, then 10 pushed out: {s:?}");
            assert_eq!(s.region_protects, 1, "only the first call protects everything: {s:?}");
            println!("{PASSED}");
        }
        "violation" => {
            write(mem, 5, 0xaa);
            let mut g = Guard::install(mechanism, Mode::Scdwc { cache: 8 }, Some(1)).unwrap();
            g.add_region(base, PAGES as u64 * PAGE, "ring state").unwrap();
            let act = act_for(mem, &[3]);
            g.call(42, &act, || {
                write(mem, 3, 3);
                write(mem, 5, 0x55);
            })
            .unwrap();
            unreachable!("the write to page 5 was let through");
        }
        "not-ours" => {
            let mut g = Guard::install(mechanism, Mode::Dwc, None).unwrap();
            g.add_region(base, 4 * PAGE, "runtime").unwrap();
            // SAFETY: pages of this process's own mapping, outside the guarded region.
            unsafe { libc::mprotect(mem.as_mut_ptr().add(8 * PAGE as usize).cast(), PAGE as usize, libc::PROT_READ) };
            g.call(0, &Act::new(), || write(mem, 8, 1)).unwrap();
            unreachable!("a write to read-only memory outside every region succeeded");
        }
        "anonymous" => {
            // Private anonymous memory never touched: protection covers its pages too.
            // SAFETY: a new private anonymous mapping, never unmapped (the process ends).
            let p = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    PAGES * PAGE as usize,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                )
            };
            assert_ne!(p, libc::MAP_FAILED);
            // SAFETY: the mapping above, used only through this slice.
            let anon = unsafe { std::slice::from_raw_parts_mut(p.cast::<u8>(), PAGES * PAGE as usize) };
            let mut g = Guard::install(mechanism, Mode::Dwc, None).unwrap();
            g.add_region(anon.as_ptr() as u64, PAGES as u64 * PAGE, "heap").unwrap();
            let act = act_for(anon, &[0, 1, 2, 3]);
            g.call(0, &act, || (0..4).for_each(|i| write(anon, i, 1))).unwrap();
            assert_eq!(g.stats().allowed, 4, "{:?}", g.stats());
            println!("{PASSED}");
        }
        "keys" | "keys-off" => {
            // Pages 0..8 are the runtime's, 8..16 the filter's own; SCDWC keeps a runtime
            // page the runtime wrote between calls open into the next call.
            write(mem, 5, 0xaa);
            let mut g = Guard::install(mechanism, Mode::Scdwc { cache: 8 }, Some(1)).unwrap();
            let runtime = g.add_region(base, 8 * PAGE, "runtime").unwrap();
            let own = g.add_region(base + 8 * PAGE, 8 * PAGE, "filter").unwrap();
            if which == "keys" {
                let (a, b) = (bulkhead_sys::pkey::alloc().unwrap(), bulkhead_sys::pkey::alloc().unwrap());
                g.key_region(runtime, a).unwrap();
                g.key_region(own, b).unwrap();
                g.gate_keys(&[b]).unwrap();
            }
            let act = act_for(mem, &[8, 9, 10]);
            g.call(0, &act, || write(mem, 9, 9)).unwrap();
            write(mem, 5, 0x11);
            // An allowed range in a denied key: that call is left to the page protection.
            let wide = act_for(mem, &[4, 9]);
            g.call(0, &wide, || write(mem, 4, 4)).unwrap();
            let s = g.stats();
            let keyed = if which == "keys" { 1 } else { 0 };
            assert_eq!((s.calls, s.keyed), (2, keyed), "{s:?}");
            g.call(0, &act, || {
                write(mem, 9, 10);
                // Page 5 is in the cache, open: only the key stops this.
                write(mem, 5, 0x55);
            })
            .unwrap();
            println!("{PASSED}");
        }
        "pages" => {
            // Pages 0..8 are the runtime's, 8..16 the filter's own; the page gate shuts the
            // runtime's pages the cache holds open for each of the filter's calls.
            let (mut g, act) = gated_halves(mechanism, mem);
            g.call(0, &act, || write(mem, 9, 9)).unwrap();
            // The runtime's writes between calls: 5, 6 and 7 enter the cache.
            write(mem, 5, 0x11);
            write(mem, 6, 0x11);
            write(mem, 7, 0x11);
            assert_eq!(g.stats().outside, 3);
            g.call(0, &act, || write(mem, 9, 10)).unwrap();
            let s = g.stats();
            assert_eq!((s.gated, s.gated_ranges, s.gated_pages, s.allowed), (2, 1, 3, 1), "one range of three: {s:?}");
            // Open again for the runtime after the call: no fault.
            write(mem, 5, 0x11);
            assert_eq!(g.stats().outside, 3);
            // The filter's own writes push 9 and then 5 out of the cache (C = 8). The range
            // 5..8 is opened again whole at exit, so the runtime writes 5 without a fault...
            g.call(0, &act, || (10..16).for_each(|p| write(mem, p, 1))).unwrap();
            assert_eq!(g.stats().allowed, 7);
            write(mem, 6, 0x11);
            write(mem, 5, 0x11);
            assert_eq!(g.stats().outside, 3, "the range was opened again whole");
            // ...and the next call shuts it, though the cache no longer holds 5.
            g.call(0, &act, || write(mem, 5, 0x55)).unwrap();
            unreachable!("the gate let a write to the runtime's open page through");
        }
        "pages-join" => {
            // Two regions of the runtime side by side (0..4, 4..6), the filter's own (6..8),
            // and the runtime's again (8..10): the gate joins open pages across the first
            // boundary, not across the filter's own pages.
            let mut g = Guard::install(mechanism, Mode::Scdwc { cache: 8 }, Some(1)).unwrap();
            g.add_region(base, 4 * PAGE, "runtime a").unwrap();
            g.add_region(base + 4 * PAGE, 2 * PAGE, "runtime b").unwrap();
            let own = g.add_region(base + 6 * PAGE, 2 * PAGE, "filter").unwrap();
            g.own_region(own, 0).unwrap();
            g.add_region(base + 8 * PAGE, 2 * PAGE, "runtime c").unwrap();
            g.gate_pages(&[true]).unwrap();
            let act = act_for(mem, &[6, 7]);
            g.call(0, &act, || write(mem, 6, 1)).unwrap();
            for p in [3, 4, 9] {
                write(mem, p, 0x11);
            }
            g.call(0, &act, || write(mem, 7, 1)).unwrap();
            let s = g.stats();
            assert_eq!((s.gated_ranges, s.gated_pages), (2, 3), "3..5 across the boundary, and 9: {s:?}");
            g.call(0, &act, || write(mem, 4, 0x44)).unwrap();
            unreachable!("the gate let a write to the runtime's open page through");
        }
        "pages-trim" => {
            // Pages 0..8 are the runtime's, 8..16 the filter's own. The runtime writes 6 once
            // and 5 before every call; a trim leaves both shut, and only 5 comes back.
            let (mut g, act) = gated_halves(mechanism, mem);
            g.call(0, &act, || write(mem, 9, 9)).unwrap();
            write(mem, 6, 0x11);
            let mut calls = 1;
            while g.stats().trims == 0 {
                write(mem, 5, 0x11);
                g.call(0, &act, || write(mem, 9, 9)).unwrap();
                calls += 1;
                assert!(calls < 1000, "no trim in {calls} calls");
            }
            let s = g.stats();
            assert_eq!((s.trims, s.outside), (1, 2), "6 and 5 each reopened once: {s:?}");
            assert_eq!(s.gated_pages, 2 * (calls - 1), "5..7 shut by every call after the first: {s:?}");
            // Shut after the trim: the runtime's write reopens 5, and the next call shuts it alone.
            write(mem, 5, 0x11);
            assert_eq!(g.stats().outside, 3);
            g.call(0, &act, || write(mem, 9, 9)).unwrap();
            let t = g.stats();
            assert_eq!((t.gated_ranges - s.gated_ranges, t.gated_pages - s.gated_pages), (1, 1), "5 alone: {t:?}");
            // 6 stayed shut: the runtime's write to it faults once more.
            write(mem, 6, 0x11);
            assert_eq!(g.stats().outside, 4);
            println!("{PASSED}");
        }
        "pages-deferred" => {
            // Pages 0..8 are the runtime's, written only where it says so (a domain's rings),
            // 8..16 the filter's own: what a call shuts stays shut for the calls after it.
            let (mut g, act) = gated_halves(mechanism, mem);
            g.defer_reopen(0).unwrap();
            g.call(0, &act, || write(mem, 9, 9)).unwrap();
            write(mem, 5, 0x11);
            g.call(0, &act, || write(mem, 9, 9)).unwrap();
            g.call(0, &act, || write(mem, 9, 9)).unwrap();
            let s = g.stats();
            assert_eq!((s.gated_ranges, s.deferred, s.outside), (1, 1, 1), "5 shut once, for both calls: {s:?}");
            // Announced, the runtime's write finds 5 open.
            bulkhead_guard::reopen_deferred();
            write(mem, 5, 0x11);
            write(mem, 4, 0x11);
            assert_eq!(g.stats().outside, 2, "only 4 was shut");
            g.call(0, &act, || write(mem, 9, 9)).unwrap();
            // Unannounced, it faults, and what was left shut counts as open again.
            write(mem, 5, 0x11);
            let s = g.stats();
            assert_eq!((s.gated_ranges, s.deferred, s.outside), (2, 2, 3), "4..6 shut, then written: {s:?}");
            g.call(0, &act, || write(mem, 9, 9)).unwrap();
            assert_eq!(g.stats().gated_ranges, 3, "4..6 shut again");
            // A call whose table reaches 4 writes it: let through, and no longer taken for
            // shut, so the next call of a table without it shuts it again.
            let wide = act_for(mem, &(4..16).collect::<Vec<_>>());
            g.call(0, &wide, || write(mem, 4, 0x22)).unwrap();
            assert_eq!(g.stats().allowed, 2, "9 once, then 4");
            g.call(0, &act, || write(mem, 4, 0x44)).unwrap();
            unreachable!("a page left shut and then written was taken for shut");
        }
        "pages-shared" => {
            // Pages 0..4 are shared memory the runtime writes where it says so (a domain's
            // ring), shut and opened whole; 4..8 the runtime's other memory; 8..16 the
            // filter's own. Each page is in the page tables before the guard starts.
            (0..16).for_each(|p| write(mem, p, 0x11));
            let mut g = Guard::install(mechanism, Mode::Scdwc { cache: 8 }, Some(1)).unwrap();
            let ring = g.add_shared_region(base, 4 * PAGE, "ring").unwrap();
            g.defer_reopen(ring).unwrap();
            g.add_region(base + 4 * PAGE, 4 * PAGE, "runtime").unwrap();
            let own = g.add_region(base + 8 * PAGE, 8 * PAGE, "filter").unwrap();
            g.own_region(own, 0).unwrap();
            g.gate_pages(&[true]).unwrap();
            let act = act_for(mem, &(8..16).collect::<Vec<_>>());
            g.call(0, &act, || write(mem, 9, 9)).unwrap();
            // The first call shut everything: the runtime's first write opens the ring whole.
            write(mem, 1, 0x11);
            write(mem, 2, 0x11);
            write(mem, 5, 0x11);
            assert_eq!(g.stats().outside, 2, "the ring once, page 5 once");
            // A call shuts the ring whole and page 5 apart; the ring stays shut for the next.
            g.call(0, &act, || write(mem, 9, 9)).unwrap();
            g.call(0, &act, || write(mem, 9, 9)).unwrap();
            let s = g.stats();
            assert_eq!((s.gated_ranges, s.gated_pages, s.deferred), (3, 6, 1), "ring and 5, then 5: {s:?}");
            // Announced, the ring opens writable at once: no fault of the guard's or the kernel's.
            bulkhead_guard::reopen_deferred();
            let before = minor_faults();
            (0..4).for_each(|p| write(mem, p, 0x11));
            assert_eq!(minor_faults() - before, 0, "writes into the opened ring faulted");
            assert_eq!(g.stats().outside, 2);
            // A call whose table reaches ring page 2 writes it, and only that page opens.
            let wide = act_for(mem, &[2, 8]);
            g.call(0, &wide, || {
                write(mem, 2, 0x22);
                write(mem, 3, 0x33);
            })
            .unwrap();
            unreachable!("the write to ring page 3 was let through");
        }
        other => panic!("no scenario {other}"),
    }
}

/// Minor faults of the calling thread so far, the kernel's own included.
fn minor_faults() -> i64 {
    // SAFETY: zeroed rusage is a valid value for getrusage to fill.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: fills the struct above, which outlives the call.
    assert_eq!(unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut u) }, 0);
    u.ru_minflt
}

fn shm(tag: &str, mechanism: &str) -> String {
    format!("/dev/shm/bulkhead-guard-test-{}-{tag}-{mechanism}", std::process::id())
}

/// Runs `scenario` under `mechanism` and returns its output and what its memory held after.
fn run_reading(scenario: &str, mechanism: &str) -> (std::process::Output, Vec<u8>) {
    let path = shm(scenario, mechanism);
    let out = child(scenario, mechanism, &path);
    let bytes = std::fs::read(&path).unwrap();
    let _ = std::fs::remove_file(&path);
    (out, bytes)
}

/// The report a stopped write left last on the child's output.
fn report_of(out: &std::process::Output) -> Violation {
    Violation::decode(out.stdout[out.stdout.len() - Violation::BYTES..].try_into().unwrap())
}

/// Runs `scenario` under `mechanism`, asserts that a write of it was stopped, and returns what
/// its memory held after and the report.
fn stopped(scenario: &str, mechanism: &str) -> (Vec<u8>, Violation) {
    let (out, bytes) = run_reading(scenario, mechanism);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(VIOLATION_EXIT), "{mechanism}: {err}");
    (bytes, report_of(&out))
}

/// Runs `scenario` under both mechanisms and asserts every check in it held.
fn passes_under_both(scenario: &str) {
    for m in mechanisms() {
        let path = shm(scenario, m);
        let out = child(scenario, m, &path);
        let _ = std::fs::remove_file(&path);
        assert!(out.status.success(), "{m}: {}", String::from_utf8_lossy(&out.stderr));
        assert!(String::from_utf8_lossy(&out.stdout).contains(PASSED), "{m}: {}", String::from_utf8_lossy(&out.stdout));
    }
}

#[test]
fn the_page_gate_shuts_open_pages_of_regions_side_by_side_in_one_range() {
    for m in mechanisms() {
        let (bytes, v) = stopped("pages-join", m);
        assert_eq!(bytes[4 * PAGE as usize + 8], 0x11, "{m}: the gated write landed");
        assert_eq!((v.region, v.filter), (1, 0), "{m}: {v:?}");
    }
}

#[test]
fn the_page_gate_now_and_then_leaves_what_it_shut_shut_so_that_only_pages_still_written_stay_open() {
    passes_under_both("pages-trim");
}

#[test]
fn the_page_gate_leaves_a_deferred_region_shut_from_call_to_call_until_the_runtime_says_it_writes() {
    for m in mechanisms() {
        let (bytes, v) = stopped("pages-deferred", m);
        let at = |p: usize| bytes[p * PAGE as usize + 8];
        assert_eq!((at(4), at(5)), (0x22, 0x11), "{m}: the allowed write landed, the stopped one not");
        assert_eq!((v.region, v.filter, v.address % PAGE), (0, 0, 8), "{m}: {v:?}");
    }
}

#[test]
fn dwc_lets_allowed_writes_through_and_protects_the_page_again_after_each() {
    passes_under_both("dwc");
}

#[test]
fn scdwc_keeps_the_last_pages_open_and_protects_only_the_pool_at_the_next_call() {
    passes_under_both("scdwc");
}

#[test]
fn a_write_outside_the_table_does_not_happen_and_is_reported() {
    for m in mechanisms() {
        let (out, bytes) = run_reading("violation", m);
        assert_eq!(out.status.code(), Some(VIOLATION_EXIT), "{m}: {}", String::from_utf8_lossy(&out.stderr));
        // The state, not the handler's word: the allowed write landed, the other did not.
        let at = |p: usize| bytes[p * PAGE as usize + 8];
        assert_eq!((at(3), at(5)), (3, 0xaa), "{m}");
        // The report is the last thing on the child's output.
        let v = report_of(&out);
        assert_eq!((v.region, v.filter), (0, 42), "{m}: {v:?}");
        assert_eq!(v.address % PAGE, 8, "{m}: {v:?}");
    }
}

#[test]
fn a_fault_outside_every_region_is_not_swallowed() {
    for m in mechanisms() {
        let path = shm("not-ours", m);
        let out = child("not-ours", m, &path);
        let _ = std::fs::remove_file(&path);
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(out.status.signal(), Some(libc::SIGSEGV), "{m}: {:?} {}", out.status, String::from_utf8_lossy(&out.stderr));
    }
}

#[test]
fn anonymous_memory_never_touched_is_guarded_too() {
    passes_under_both("anonymous");
}

#[test]
fn protection_keys_stop_a_write_to_a_page_the_cache_holds_open() {
    if !bulkhead_sys::pkey::supported() {
        eprintln!("skipped: the processor has no protection keys");
        return;
    }
    for m in mechanisms() {
        for (which, stopped) in [("keys", true), ("keys-off", false)] {
            let (out, bytes) = run_reading(which, m);
            let at = |p: usize| bytes[p * PAGE as usize + 8];
            let err = String::from_utf8_lossy(&out.stderr);
            if stopped {
                assert_eq!(out.status.code(), Some(VIOLATION_EXIT), "{m} {which}: {err}");
                // The state: the filter's own writes landed, the one into the cached page not.
                assert_eq!((at(9), at(4), at(5)), (10, 4, 0x11), "{m} {which}");
                let v = report_of(&out);
                assert_eq!((v.region, v.filter, v.address % PAGE), (0, 0, 8), "{m}: {v:?}");
            } else {
                // Without keys the cache lets it through: what the keys add.
                assert!(out.status.success(), "{m} {which}: {err}");
                assert_eq!((at(9), at(5)), (10, 0x55), "{m} {which}");
            }
        }
    }
}

#[test]
fn the_page_gate_shuts_the_runtimes_open_pages_for_each_call_and_opens_them_after() {
    for m in mechanisms() {
        let (bytes, v) = stopped("pages", m);
        let at = |p: usize| bytes[p * PAGE as usize + 8];
        // The state: the runtime's writes and the filter's own landed, the gated one not.
        assert_eq!((at(5), at(6), at(9), at(15)), (0x11, 0x11, 10, 1), "{m}");
        assert_eq!((v.region, v.filter, v.address % PAGE), (0, 0, 8), "{m}: {v:?}");
    }
}

#[test]
fn a_shared_region_opens_writable_at_once_and_stays_shut_to_the_filter_but_its_allowed_pages() {
    for m in mechanisms() {
        let (bytes, v) = stopped("pages-shared", m);
        let at = |p: usize| bytes[p * PAGE as usize + 8];
        assert_eq!((at(2), at(3)), (0x22, 0x11), "{m}: the allowed write landed, the stopped one not");
        assert_eq!((v.region, v.filter, v.address % PAGE), (0, 0, 8), "{m}: {v:?}");
    }
}
