//! Write capture inside a domain, after Chariot (Zheng et al., "Using Shadow Page Cache to Improve
//! Isolated Drivers Performance"): while guarded code runs (a filter
//! called by the domain's runtime), the memory it must not write is write-protected; each write
//! to it is caught in the writing thread and checked against an access control table
//! ([`Act`]). Allowed: the page is opened and the write happens. Not allowed: the write does not
//! happen, the guard reports it ([`Violation`]) and ends the process, whose supervisor restarts
//! it with the runtime's state intact.
//!
//! Two [`Mode`]s let allowed writes through. DWC protects the page again right after the
//! write, by single-stepping the writing instruction (the x86 trap flag set in the signal
//! context), and protects every page at every call. SCDWC keeps the C most recently opened
//! pages open (the shadow page cache), protecting the oldest when a newer one pushes it out;
//! writes the runtime makes between calls open pages too, and what they push out of the cache
//! goes to a pool that the next call protects in one pass (Chariot's Algorithm 2). The cache
//! stays open across calls: a write of guarded code to one of its C pages is not caught, the
//! price of not faulting on the pages both sides write all the time.
//!
//! Protection keys ([`Guard::gate_keys`]) close that gap where the processor has them: each
//! owner's memory (the runtime's heap and rings, each filter's heap space) carries a key of
//! its own ([`heap::assign_keys`]), and while a filter runs its thread's PKRU denies writes
//! to every key but the filter's, whatever the cache holds open, for one register write each
//! way.
//!
//! Without keys, the page gate ([`Guard::gate_pages`]) closes it with page protection: at a
//! filter's entry the pages the cache holds open that belong to another owner are protected,
//! in ranges of adjacent pages, one system call each, and opened again at its exit (but
//! every 64th exit, which leaves them shut so that only the pages still written reopen).
//!
//! Two [`Mechanism`]s catch writes: userfaultfd write protection with its faults raised as
//! SIGBUS in the writing thread, and `mprotect` with SIGSEGV. `bulkhead-bench guard` measures
//! both; docs/guard.md says which is used and why.
//!
//! Limits: the guard sees writes made by the guarded thread's own instructions. A system call
//! that writes into a protected page fails with EFAULT instead of faulting, so memory the
//! kernel fills for guarded code belongs outside the guarded regions. Reads are not guarded,
//! nor is time: a guarded filter can still read what the domain holds or loop forever, which
//! the sandbox and the watchdog cover.
#![deny(missing_docs)]

pub mod act;
pub mod capture;
pub mod heap;
pub mod shadow;

pub use act::{Act, ActFull};
pub use capture::{kernel_fills, reopen_deferred, Guard, Handle, Mechanism, Stats, Violation, VIOLATION_EXIT};
pub use shadow::Mode;

/// Bytes of a page.
pub const PAGE: u64 = 4096;
