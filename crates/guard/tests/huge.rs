//! The runtime's heap guarded a huge page at a time ([`Guard::huge_region`]), in real
//! processes: this binary is its own global allocator's program, and each scenario runs in a
//! child process of its own (a stopped write ends the process), with no other thread.

use std::process::{Command, ExitCode};

use bulkhead_guard::heap::{self, Reservation, Space, HUGE_PAGE};
use bulkhead_guard::{Act, Guard, Mechanism, Mode, Violation, VIOLATION_EXIT};

#[global_allocator]
static HEAP: heap::Heap = heap::Heap::new();

/// What a scenario prints where the kernel backs no huge page.
const NO_HUGE: &str = "no huge pages";

fn main() -> ExitCode {
    if let Ok(which) = std::env::var("GUARD_HUGE_SCENARIO") {
        scenario(&which);
        return ExitCode::SUCCESS;
    }
    let mut failed = 0;
    for (name, check) in [
        ("a_filter_is_shut_out_of_the_runtimes_huge_page", stopped_in_the_runtime as fn(&str) -> Result<(), String>),
        ("a_table_reaching_into_the_runtimes_heap_turns_it_to_small_pages_still_shut", stopped_in_the_runtime),
    ] {
        let scenario = if name.starts_with("a_table") { "unhuge" } else { "huge" };
        match check(scenario) {
            Ok(()) => println!("test {name} ... ok"),
            Err(e) => {
                println!("test {name} ... FAILED\n{e}");
                failed += 1;
            }
        }
    }
    println!("\ntest result: {}. {} passed; {failed} failed", if failed > 0 { "FAILED" } else { "ok" }, 2 - failed);
    if failed > 0 {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}

/// Runs `scenario` in a child and checks that its last write, the filter's into the runtime's
/// heap, was stopped, after every check before it held.
fn stopped_in_the_runtime(scenario: &str) -> Result<(), String> {
    let out = Command::new(std::env::current_exe().unwrap())
        .env("GUARD_HUGE_SCENARIO", scenario)
        .output()
        .map_err(|e| e.to_string())?;
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    if stderr.contains(NO_HUGE) {
        println!("{scenario}: not checked: {stderr}");
        return Ok(());
    }
    if out.status.code() != Some(VIOLATION_EXIT) || !stdout.contains("checks held") {
        return Err(format!("{scenario}: {:?}\n{stdout}\n{stderr}", out.status));
    }
    let v = Violation::decode(out.stdout[out.stdout.len() - Violation::BYTES..].try_into().unwrap());
    if (v.region, v.filter) != (0, 0) {
        return Err(format!("{scenario}: stopped in region {} by filter {}, not the runtime's by filter 0", v.region, v.filter));
    }
    Ok(())
}

fn write(at: *mut u8, v: u8) {
    // SAFETY: a byte of a live block of the caller's; volatile, so exactly this write is made.
    unsafe { std::ptr::write_volatile(at, v) };
}

/// Whether the mapping holding `addr` is backed by huge pages, as `/proc/self/smaps` says.
fn huge_at(addr: u64) -> bool {
    bulkhead_sys::thp::bytes_in(None, addr, 1).unwrap() >= HUGE_PAGE
}

fn scenario(which: &str) {
    heap::activate(Reservation::new(2).unwrap()).unwrap();
    if !heap::prefer_huge(heap::RUNTIME) {
        eprintln!("{NO_HUGE} for the runtime's space");
        return;
    }
    // The runtime's state, and the filter's own, before the guard.
    let mut state = vec![0u8; 3 * 4096];
    let own = heap::with_space(Space(1), || vec![0u8; 4096]);
    let mut g = Guard::install(Mechanism::Userfault, Mode::Scdwc { cache: 8 }, Some(1)).unwrap();
    let runtime = g.add_heap_space(heap::RUNTIME, "runtime").unwrap();
    assert!(g.huge_region(runtime).unwrap(), "the runtime's space is huge");
    let filter = g.add_heap_space(Space(1), "filter").unwrap();
    g.own_region(filter, 0).unwrap();
    g.gate_pages(&[true]).unwrap();
    let mut act = Act::new();
    act.allow_slice(&own).unwrap();
    let own_at = own.as_ptr() as *mut u8;
    g.call(0, &act, || write(own_at, 1)).unwrap();
    // The runtime writes three pages of its state: one fault opens its whole huge page.
    for p in 0..3 {
        write(state[p * 4096..].as_mut_ptr(), 0x11);
    }
    let s = g.stats();
    assert_eq!(s.outside, 1, "one fault for the huge page: {s:?}");
    assert!(huge_at(state.as_ptr() as u64), "the runtime's state lies in a huge page");
    // Each call shuts that huge page in one range, whatever it holds, and opens it after.
    for _ in 0..3 {
        g.call(0, &act, || write(own_at, 2)).unwrap();
        write(state.as_mut_ptr(), 0x22);
    }
    let t = g.stats();
    assert_eq!((t.gated_ranges - s.gated_ranges, t.gated_pages - s.gated_pages), (3, 3 * HUGE_PAGE / 4096), "{t:?}");
    assert_eq!(t.outside, s.outside, "the runtime's writes found its huge page open: {t:?}");
    assert!(huge_at(state.as_ptr() as u64), "still a huge page");
    let at = state[4096..].as_mut_ptr();
    if which == "unhuge" {
        // A call allowed a page of the runtime's state: let through, and the space guarded
        // page by page from then on.
        let mut wide = act;
        wide.allow_slice(&state[4096..2 * 4096]).unwrap();
        g.call(0, &wide, || write(at, 0x33)).unwrap();
        let u = g.stats();
        assert_eq!((u.unhuged, u.allowed - t.allowed), (1, 1), "{u:?}");
        // The runtime's writes open its pages one at a time again.
        write(state.as_mut_ptr(), 0x44);
        write(state[2 * 4096..].as_mut_ptr(), 0x44);
        assert_eq!(g.stats().outside, u.outside + 2, "{:?}", g.stats());
        println!("checks held");
        g.call(0, &act, || write(state[2 * 4096..].as_mut_ptr(), 0x55)).unwrap();
    } else {
        println!("checks held");
        g.call(0, &act, || write(at, 0x55)).unwrap();
    }
    unreachable!("the filter's write into the runtime's state was let through");
}
