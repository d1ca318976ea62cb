//! The device channel across a real process boundary: this test is the frontend, the driver
//! domain is `bulkhead driver`, exec'd (not forked) with only its descriptors. One million
//! requests per notification mode, every byte checked end to end.

use std::time::{Duration, Instant};

use bulkhead_channel::{BudgetPolicy, FrontRequest, NotifyMode, QueueConfig};

const BLOCK: usize = 4096;
const BLOCKS: u64 = 1024;
const DEPTH: usize = 16;
const REQUESTS: u64 = 1_000_000;

/// Block `b` written in round `r` holds this pattern.
fn fill(buf: &mut [u8], b: u64, r: u64) {
    for (i, chunk) in buf.chunks_mut(8).enumerate() {
        let v = (b << 40) ^ (r << 20) ^ i as u64 ^ 0x5bd1_e995;
        chunk.copy_from_slice(&v.to_le_bytes()[..chunk.len()]);
    }
}

fn run_mode(mode: NotifyMode) {
    let size = BLOCKS * BLOCK as u64;
    let cfg = QueueConfig { nslots: 64, arena_bytes: 4 << 20, mode, budget: BudgetPolicy::DEFAULT_AUTO, generation: 7 };
    let exe = std::path::Path::new(env!("CARGO_BIN_EXE_bulkhead"));
    let (mut front, mut child) = bulkhead_bench::channel::spawn_ram_domain(exe, &cfg, size).unwrap();
    assert_ne!(child.id(), std::process::id());

    // Even rounds write every block with the round's pattern; odd rounds read every block back
    // and check it against the previous round. In-flight requests always touch distinct blocks.
    let start = Instant::now();
    let mut wbuf = vec![0u8; BLOCK];
    let mut want = vec![0u8; BLOCK];
    let (mut next, mut done, mut inflight) = (0u64, 0u64, 0usize);
    let (mut verified, mut reads) = (0u64, 0u64);
    while done < REQUESTS {
        while inflight < DEPTH && next < REQUESTS {
            let (r, b) = (next / BLOCKS, next % BLOCKS);
            let offset = b * BLOCK as u64;
            if r % 2 == 0 {
                fill(&mut wbuf, b, r);
                front.push(FrontRequest::Write { offset, from: &wbuf, fua: false }, next).unwrap();
            } else {
                front.push(FrontRequest::Read { offset, into: BLOCK as u64 }, next).unwrap();
                reads += 1;
            }
            next += 1;
            inflight += 1;
        }
        front.publish();
        let mut failure = None;
        let n = front
            .reap(|c| {
                let (r, b) = (c.user / BLOCKS, c.user % BLOCKS);
                if c.result != Ok(BLOCK as u64) {
                    failure = Some(format!("request {} failed: {:?}", c.user, c.result));
                    return;
                }
                if r % 2 == 1 {
                    let mut got = vec![0u8; BLOCK];
                    c.data.expect("read data").copy_to(&mut got);
                    fill(&mut want, b, r - 1);
                    if got != want {
                        failure = Some(format!("block {b} round {r}: data differs"));
                    }
                    verified += 1;
                }
            })
            .unwrap();
        assert!(failure.is_none(), "{mode}: {}", failure.unwrap());
        done += n as u64;
        inflight -= n;
        if n == 0 {
            assert!(front.wait(10_000).unwrap(), "{mode}: driver stopped answering after {done} requests");
        }
    }
    let el = start.elapsed();
    eprintln!(
        "{mode}: {REQUESTS} requests in {:.2} s, {verified} reads verified, {} doorbells",
        el.as_secs_f64(),
        front.stats().kicks
    );
    assert_eq!(verified, reads, "every read was checked");
    assert!(reads > REQUESTS / 2 - BLOCKS, "half the requests are checked reads");
    child.signal(libc::SIGTERM).unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(Instant::now() < deadline, "driver did not stop on SIGTERM");
        std::thread::sleep(Duration::from_millis(5));
    };
    assert!(status.success(), "driver exit: {status}");
}

#[test]
fn million_requests_checked_end_to_end_in_poll_mode() {
    run_mode(NotifyMode::Poll);
}

#[test]
fn million_requests_checked_end_to_end_in_irq_mode() {
    run_mode(NotifyMode::Irq);
}

#[test]
fn million_requests_checked_end_to_end_in_adaptive_mode() {
    run_mode(NotifyMode::Adaptive);
}
