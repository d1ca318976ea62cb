//! Tests of a frontend and a driver end in one process; the driver end is driven by hand so each
//! test can play an honest or a hostile peer.

use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;

use bulkhead_ring::{op_code, RequestSlot, ResponseSlot};

use crate::*;

fn cfg() -> QueueConfig {
    QueueConfig { nslots: 8, arena_bytes: 1 << 20, mode: NotifyMode::Poll, ..Default::default() }
}

/// Serves every pending request honestly: writes land in `disk`, reads come from it.
fn serve(back: &mut BackQueue, disk: &mut [u8]) -> usize {
    serve_seeing(back, disk, |_| {})
}

/// As [`serve`], showing `seen` each valid request before it is served.
fn serve_seeing(back: &mut BackQueue, disk: &mut [u8], mut seen: impl FnMut(&bulkhead_ring::ValidRequest)) -> usize {
    let mut n = 0;
    while let Some(p) = back.pop().unwrap() {
        match p {
            Popped::Valid(r) => {
                seen(&r);
                let bufs = back.buffers(&r);
                let mut off = r.offset() as usize;
                for b in bufs.iter() {
                    match r.op() {
                        Op::Write => b.copy_to(&mut disk[off..off + b.len()]),
                        Op::Read => b.copy_from(&disk[off..off + b.len()]).unwrap(),
                        _ => {}
                    }
                    off += b.len();
                }
                let len = if matches!(r.op(), Op::Read | Op::Write) { r.len() } else { 0 };
                back.complete(r.id(), r.generation(), Status::Ok, len);
            }
            Popped::Invalid { id, generation, .. } => back.complete(id, generation, Status::Invalid, 0),
        }
        n += 1;
    }
    back.publish();
    n
}

#[test]
fn write_then_read_round_trips_data() {
    let (mut f, mut b) = pair(&cfg(), 1 << 20).unwrap();
    let mut disk = vec![0u8; 1 << 20];
    let data: Vec<u8> = (0..8192u32).map(|i| (i * 7) as u8).collect();
    f.submit(FrontRequest::Write { offset: 4096, from: &data, fua: true }, 1).unwrap();
    serve(&mut b, &mut disk);
    let mut got = vec![];
    f.reap(|c| got.push((c.user, c.result))).unwrap();
    assert_eq!(got, vec![(1, Ok(8192))]);
    f.submit(FrontRequest::Read { offset: 4096, into: 8192 }, 2).unwrap();
    serve(&mut b, &mut disk);
    let mut out = vec![0u8; 8192];
    f.reap(|c| c.data.unwrap().copy_to(&mut out)).unwrap();
    assert_eq!(out, data);
    assert_eq!(f.in_flight(), 0);
}

#[test]
fn full_queue_refuses_then_recovers() {
    let (mut f, mut b) = pair(&cfg(), 1 << 20).unwrap();
    for i in 0..8 {
        f.submit(FrontRequest::Flush, i).unwrap();
    }
    assert_eq!(f.submit(FrontRequest::Flush, 9), Err(SubmitError::Full));
    serve(&mut b, &mut vec![0; 1 << 20]);
    assert_eq!(f.reap(|_| {}).unwrap(), 8);
    f.submit(FrontRequest::Flush, 9).unwrap();
}

#[test]
fn arena_exhaustion_is_full_and_oversize_is_too_large() {
    let (mut f, _b) = pair(&cfg(), 1 << 30).unwrap();
    f.submit(FrontRequest::Read { offset: 0, into: 1 << 20 }, 1).unwrap();
    assert_eq!(f.submit(FrontRequest::Read { offset: 0, into: 4096 }, 2), Err(SubmitError::Full));
    assert_eq!(f.submit(FrontRequest::Read { offset: 0, into: 2 << 20 }, 3), Err(SubmitError::TooLarge(2 << 20)));
}

#[test]
fn a_write_whose_fill_fails_is_not_placed_and_gives_its_window_back() {
    let (mut f, mut b) = pair(&cfg(), 1 << 20).unwrap();
    let e = f.push_write_with(0, 1 << 20, false, 1, &mut |_| Err(FillError("the source is gone".into())));
    assert_eq!(e, Err(SubmitError::Fill(FillError("the source is gone".into()))));
    assert_eq!(f.in_flight(), 0);
    // The whole arena is free again: a write of all of it fits.
    f.push_write_with(0, 1 << 20, false, 2, &mut |w| {
        w.copy_from(&vec![7; 1 << 20]).unwrap();
        Ok(())
    })
    .unwrap();
    f.publish();
    let mut disk = vec![0u8; 1 << 20];
    assert_eq!(serve(&mut b, &mut disk), 1);
    assert!(disk.iter().all(|&x| x == 7));
}

#[test]
fn four_mib_request_round_trips() {
    let c = QueueConfig { arena_bytes: 8 << 20, ..cfg() };
    let (mut f, mut b) = pair(&c, 16 << 20).unwrap();
    let mut disk = vec![0u8; 16 << 20];
    let data: Vec<u8> = (0..4 << 20).map(|i: u32| (i % 251) as u8).collect();
    f.submit(FrontRequest::Write { offset: 1 << 20, from: &data, fua: false }, 1).unwrap();
    serve(&mut b, &mut disk);
    f.reap(|c| assert_eq!(c.result, Ok(4 << 20))).unwrap();
    assert_eq!(&disk[1 << 20..5 << 20], &data[..]);
}

fn hostile_answer(b: &mut BackQueue, edit: impl Fn(&mut ResponseSlot, &bulkhead_ring::ValidRequest)) {
    let Popped::Valid(r) = b.pop().unwrap().unwrap() else { panic!("expected a valid request") };
    let mut rsp = ResponseSlot { id: r.id(), generation: r.generation(), status: 0, len: r.len(), reserved: 0 };
    edit(&mut rsp, &r);
    b.complete(rsp.id, rsp.generation, Status::Ok, rsp.len);
    // Overwrite the slot just pushed with the hostile content (status may be out of range).
    let layout = bulkhead_ring::RingLayout::new(8).unwrap();
    let prod_private = (b.completed() - 1) as u32;
    b.ring_mapping().write_obj(layout.rsp_slot(prod_private), &rsp).unwrap();
    b.publish();
}

fn expect_broken(edit: impl Fn(&mut ResponseSlot, &bulkhead_ring::ValidRequest), why: &str) {
    let (mut f, mut b) = pair(&cfg(), 1 << 20).unwrap();
    f.submit(FrontRequest::Read { offset: 0, into: 4096 }, 1).unwrap();
    hostile_answer(&mut b, edit);
    let mut delivered = 0;
    let e = f.reap(|_| delivered += 1).unwrap_err();
    assert_eq!(delivered, 0, "{why}: nothing delivered");
    assert!(e.to_string().contains(why), "{e} should mention {why}");
    assert!(f.broken().is_some());
    assert!(matches!(f.submit(FrontRequest::Flush, 2), Err(SubmitError::Broken(_))));
    assert_eq!(f.in_flight(), 1, "the request stays in the shadow table for reissue");
}

#[test]
fn unknown_id_breaks_channel() {
    expect_broken(|r, _| r.id ^= 0x5555_0000, "unknown");
}

#[test]
fn stale_generation_breaks_channel() {
    expect_broken(|r, _| r.generation = r.generation.wrapping_sub(1), "stale generation");
}

#[test]
fn unknown_status_breaks_channel() {
    expect_broken(|r, _| r.status = 99, "unknown status");
}

#[test]
fn length_beyond_request_breaks_channel() {
    expect_broken(|r, req| r.len = req.len() + 1, "length beyond");
}

#[test]
fn duplicate_response_breaks_channel() {
    let (mut f, mut b) = pair(&cfg(), 1 << 20).unwrap();
    f.submit(FrontRequest::Flush, 1).unwrap();
    f.submit(FrontRequest::Flush, 2).unwrap();
    let Popped::Valid(r) = b.pop().unwrap().unwrap() else { panic!() };
    b.complete(r.id(), r.generation(), Status::Ok, 0);
    b.complete(r.id(), r.generation(), Status::Ok, 0);
    b.publish();
    let mut n = 0;
    let e = f.reap(|_| n += 1).unwrap_err();
    assert_eq!(n, 1, "the first answer is delivered once");
    assert!(e.to_string().contains("duplicate"));
}

#[test]
fn out_of_order_completion_is_accepted() {
    let (mut f, mut b) = pair(&cfg(), 1 << 20).unwrap();
    for u in 1..=3 {
        f.submit(FrontRequest::Flush, u).unwrap();
    }
    let mut reqs = vec![];
    while let Some(Popped::Valid(r)) = b.pop().unwrap() {
        reqs.push(r);
    }
    for r in reqs.iter().rev() {
        b.complete(r.id(), r.generation(), Status::Ok, 0);
    }
    b.publish();
    let mut users = vec![];
    f.reap(|c| users.push(c.user)).unwrap();
    assert_eq!(users, vec![3, 2, 1]);
}

#[test]
fn short_read_reports_io_error_without_breaking() {
    let (mut f, mut b) = pair(&cfg(), 1 << 20).unwrap();
    f.submit(FrontRequest::Read { offset: 0, into: 8192 }, 1).unwrap();
    let Popped::Valid(r) = b.pop().unwrap().unwrap() else { panic!() };
    b.complete(r.id(), r.generation(), Status::Ok, 4096);
    b.publish();
    let mut res = None;
    f.reap(|c| res = Some((c.result, c.data.is_some()))).unwrap();
    assert_eq!(res, Some((Err(Status::IoError), false)));
    assert!(f.broken().is_none());
}

#[test]
fn driver_rejects_segment_outside_arena() {
    let (mut f, mut b) = pair(&cfg(), 1 << 20).unwrap();
    f.submit(FrontRequest::Flush, 1).unwrap();
    // A hostile frontend rewrites the slot to name bytes past the arena.
    let layout = bulkhead_ring::RingLayout::new(8).unwrap();
    let mut slot: RequestSlot = b.ring_mapping().read_obj(layout.req_slot(0)).unwrap();
    slot.op = op_code(Op::Write);
    slot.nsegs = 1;
    slot.len = 4096;
    slot.segs[0] = bulkhead_ring::Segment { arena: bulkhead_ring::ARENA_WRITE, len: 4096, offset: 1 << 20 };
    b.ring_mapping().write_obj(layout.req_slot(0), &slot).unwrap();
    match b.pop().unwrap().unwrap() {
        Popped::Invalid { error, .. } => assert!(matches!(error, bulkhead_ring::RequestError::SegmentOutOfArena { .. })),
        Popped::Valid(_) => panic!("accepted a segment outside the arena"),
    }
}

#[test]
fn wait_times_out_when_driver_never_answers() {
    let c = QueueConfig { mode: NotifyMode::Adaptive, budget: BudgetPolicy::Fixed(10_000), ..cfg() };
    let (mut f, _b) = pair(&c, 1 << 20).unwrap();
    f.submit(FrontRequest::Flush, 1).unwrap();
    assert_eq!(f.wait(20), Ok(false));
    let e = f.execute(FrontRequest::Flush, 20, |_| {}).unwrap_err();
    assert!(matches!(e, SubmitError::Broken(ChannelError::Timeout(20))));
}

#[test]
fn irq_mode_wakes_sleeping_frontend() {
    let c = QueueConfig { mode: NotifyMode::Irq, ..cfg() };
    let (mut f, mut b) = pair(&c, 1 << 20).unwrap();
    let t = std::thread::spawn(move || {
        let mut disk = vec![0u8; 1 << 20];
        let mut served = 0;
        while served < 100 {
            served += serve(&mut b, &mut disk);
            std::thread::yield_now();
        }
    });
    for i in 0..100 {
        assert_eq!(f.execute(FrontRequest::Flush, 10_000, |_| {}).unwrap(), Ok(0), "request {i}");
    }
    assert!(f.stats().sleeps > 0, "irq mode sleeps");
    t.join().unwrap();
}

fn thread_cpu_ns() -> u64 {
    bulkhead_sys::thread_cpu_ns()
}

#[test]
fn a_queue_that_yields_learns_to_yield_first_when_its_driver_shares_its_cpu() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    // Frontend and driver on one CPU: an answer can only come while the frontend is off it,
    // so a yield that ran the driver precedes it.
    let (mut f, mut b) = pair(&cfg(), 1 << 20).unwrap();
    f.set_yield_after(64);
    bulkhead_sys::pin_thread(0).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let driver = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            bulkhead_sys::pin_thread(0).unwrap();
            let mut disk = vec![0u8; 1 << 20];
            while !stop.load(Ordering::Relaxed) {
                if serve(&mut b, &mut disk) == 0 {
                    std::thread::yield_now();
                }
            }
        })
    };
    for i in 0..200u64 {
        let r = f.execute(FrontRequest::Read { offset: (i % 64) * 4096, into: 4096 }, 5000, |_| {}).unwrap();
        assert_eq!(r, Ok(4096));
    }
    stop.store(true, Ordering::Relaxed);
    driver.join().unwrap();
    let s = f.stats();
    assert!(s.yielded_first > 0, "200 answers from a driver on the same CPU, no wait yielded first: {s:?}");
}

#[test]
fn a_queue_that_never_yields_never_yields_first() {
    let (mut f, mut b) = pair(&cfg(), 1 << 20).unwrap();
    let mut disk = vec![0u8; 1 << 20];
    for i in 0..50u64 {
        f.submit(FrontRequest::Read { offset: i * 4096, into: 4096 }, i).unwrap();
        serve(&mut b, &mut disk);
        assert!(f.wait(1000).unwrap());
        f.reap(|_| {}).unwrap();
    }
    assert_eq!(f.stats().yielded_first, 0);
}

#[test]
fn doorbell_storm_is_damped_and_the_answer_still_arrives() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    use std::time::{Duration, Instant};
    let cfg = QueueConfig { nslots: 8, arena_bytes: 1 << 16, mode: NotifyMode::Irq, ..Default::default() };
    let (mut f, mut b) = pair(&cfg, 1 << 16).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let storm_for = Duration::from_millis(400);
    // Timed from before the driver starts, so the storm cannot begin before the clock does.
    let t0 = Instant::now();
    let driver = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            // Ring without answering for a while, then answer honestly.
            let t0 = Instant::now();
            while t0.elapsed() < storm_for {
                b.ring_peer();
            }
            let mut disk = vec![0u8; 1 << 16];
            while !stop.load(Ordering::Relaxed) {
                serve(&mut b, &mut disk);
                std::thread::yield_now();
            }
        })
    };
    let cpu0 = thread_cpu_ns();
    let r = f.execute(FrontRequest::Read { offset: 0, into: 4096 }, 5000, |_| {}).unwrap();
    let wall = t0.elapsed();
    let cpu = thread_cpu_ns() - cpu0;
    stop.store(true, Ordering::Relaxed);
    driver.join().unwrap();
    assert_eq!(r, Ok(4096));
    assert!(wall >= storm_for, "answered before the storm ended: {wall:?}");
    assert!(f.stats().storms >= 1, "storm not detected: {:?}", f.stats());
    // Undamped, the waiter would burn the whole storm on wake-ups; damped it naps.
    let share = cpu as f64 / wall.as_nanos() as f64;
    assert!(share < 0.5, "waiter used {:.0}% of a core during the storm", share * 100.0);
}

#[test]
fn an_armed_sleeper_counts_a_storm_and_is_damped() {
    let cfg = QueueConfig { nslots: 8, arena_bytes: 1 << 16, mode: NotifyMode::Irq, ..Default::default() };
    let (mut f, mut b) = pair(&cfg, 1 << 16).unwrap();
    f.submit(FrontRequest::Read { offset: 0, into: 4096 }, 1).unwrap();
    assert!(!f.damped());
    for _ in 0..STORM_WAKES {
        assert!(f.arm(), "nothing answered yet: the queue arms");
        b.ring_peer();
        f.disarm();
    }
    assert_eq!(f.stats().storms, 1, "{:?}", f.stats());
    assert!(f.damped(), "a storm damps the doorbell");
    // An honest answer is still delivered, and a queue with an answer waiting never arms.
    let mut disk = vec![0u8; 1 << 16];
    serve(&mut b, &mut disk);
    assert!(!f.arm());
    let mut got = 0;
    f.reap(|c| {
        assert_eq!((c.user, c.result), (1, Ok(4096)));
        got += 1;
    })
    .unwrap();
    assert_eq!(got, 1);
    // A poll-mode queue never arms: its driver does not ring.
    let cfg = QueueConfig { mode: NotifyMode::Poll, ..cfg };
    let (mut f, _b) = pair(&cfg, 1 << 16).unwrap();
    f.submit(FrontRequest::Read { offset: 0, into: 4096 }, 1).unwrap();
    assert!(!f.arm());
}

#[test]
fn rings_left_over_from_answers_found_by_polling_are_no_storm() {
    // An export's loop (the NBD leader): it puts a request in flight, finds the answer by
    // polling, then sleeps on its socket and the queue until the client's next request. The
    // arm before that sleep leaves the queue's event index set, so the driver rings for the
    // next answer even though it is found by polling again, and each sleep after that wakes at
    // once on the ring left over, with nothing new. That is an honest driver, not a storm: its
    // doorbell must stay on, or every later answer waits for a timer.
    let cfg = QueueConfig { nslots: 8, arena_bytes: 1 << 16, mode: NotifyMode::Irq, ..Default::default() };
    let (mut f, mut b) = pair(&cfg, 1 << 16).unwrap();
    let mut disk = vec![0u8; 1 << 16];
    let mut leftover = 0;
    for i in 0..4 * STORM_WAKES as u64 {
        f.submit(FrontRequest::Read { offset: 0, into: 4096 }, i).unwrap();
        assert_eq!(serve(&mut b, &mut disk), 1, "round {i}");
        assert_eq!(f.reap(|c| assert_eq!(c.result, Ok(4096))).unwrap(), 1, "round {i}: found by polling");
        // The sleep on the socket and the queue: woken at once by the ring left over.
        assert!(f.arm(), "round {i}: nothing is waiting, the queue arms");
        let mut pfd = [libc::pollfd { fd: f.irq_fd(), events: libc::POLLIN, revents: 0 }];
        leftover += bulkhead_sys::poll(&mut pfd, 0).unwrap() as i32;
        f.disarm();
    }
    assert!(leftover >= 2 * STORM_WAKES as i32, "the driver rang for answers found by polling ({leftover} rounds)");
    assert_eq!(f.stats().storms, 0, "{:?}", f.stats());
    assert!(!f.damped(), "an honest driver's doorbell stays on");
}

/// Plays a tap domain for every pending request of `tap`: forwards it below naming the same
/// windows, lets `below` serve it from `disk`, and answers above with the result from below.
fn forward_all(tap: &mut BackQueue, fwd: &mut FrontQueue, below: &mut BackQueue, disk: &mut [u8]) -> usize {
    let windows = tap.arena_windows();
    let mut n = 0;
    while let Some(Popped::Valid(r)) = tap.pop().unwrap() {
        let arena = if r.op() == Op::Write { ARENA_WRITE } else { ARENA_READ };
        let segs: Vec<Segment> =
            tap.buffers(&r).iter().map(|w| windows.segment(arena, w.as_ptr() as usize, w.len()).unwrap()).collect();
        fwd.push_forward(r.op(), r.offset(), r.len(), &segs, r.fua(), r.id()).unwrap();
        fwd.publish();
        assert_eq!(serve(below, disk), 1);
        let mut got = Vec::new();
        fwd.reap(|c| got.push((c.user, c.result, c.data.is_none()))).unwrap();
        assert_eq!(got.len(), 1);
        let (id, result, no_copy) = got[0];
        assert!(no_copy, "a forwarded read's data is already where it was asked for");
        assert_eq!(id, r.id());
        tap.complete(r.id(), r.generation(), Status::Ok, result.unwrap());
        tap.publish();
        n += 1;
    }
    n
}

#[test]
fn lower_queue_forwards_requests_without_copying_through_the_upper_arenas() {
    let cfg = cfg();
    let (mut front, upper) = QueueSetup::create("upper", &cfg).unwrap();
    let lower = LowerQueue::create("lower", &cfg, &upper, false).unwrap();
    let arenas = bulkhead_ring::ArenaSizes { write: 1 << 20, read: 1 << 20 };
    let mut tap = BackQueue::from_fds(upper, cfg.nslots, arenas, 1 << 20).unwrap();
    let mut fwd = FrontQueue::forwarding(lower.front_fds().unwrap(), &cfg).unwrap();
    let mut below = BackQueue::from_fds(lower.back_fds().unwrap(), cfg.nslots, arenas, 1 << 20).unwrap();
    let mut disk = vec![0u8; 1 << 20];
    let data: Vec<u8> = (0..8192u32).map(|i| (i % 251) as u8).collect();
    front.submit(FrontRequest::Write { offset: 12288, from: &data, fua: false }, 1).unwrap();
    assert_eq!(forward_all(&mut tap, &mut fwd, &mut below, &mut disk), 1);
    assert_eq!(&disk[12288..12288 + 8192], &data[..]);
    let mut results = Vec::new();
    front.reap(|c| results.push((c.user, c.result))).unwrap();
    assert_eq!(results, vec![(1, Ok(8192))]);
    front.submit(FrontRequest::Read { offset: 12288, into: 8192 }, 2).unwrap();
    assert_eq!(forward_all(&mut tap, &mut fwd, &mut below, &mut disk), 1);
    let mut back = vec![0u8; 8192];
    front.reap(|c| c.data.unwrap().copy_to(&mut back)).unwrap();
    assert_eq!(back, data);
    // A forwarding end has no arenas of its own to carry data in.
    assert!(matches!(fwd.push(FrontRequest::Read { offset: 0, into: 4096 }, 3), Err(SubmitError::Broken(_))));
}

#[test]
fn a_private_lower_queue_carries_copies_and_the_domain_below_never_maps_the_upper_arenas() {
    let cfg = cfg();
    let (mut front, upper) = QueueSetup::create("upper", &cfg).unwrap();
    let lower = LowerQueue::create("lower", &cfg, &upper, true).unwrap();
    assert!(lower.is_private());
    let arenas = bulkhead_ring::ArenaSizes { write: 1 << 20, read: 1 << 20 };
    let upper_w = bulkhead_shmem::memfd::size_of(upper.write_arena.as_raw_fd()).unwrap();
    let mut tap = BackQueue::from_fds(upper, cfg.nslots, arenas, 1 << 20).unwrap();
    let mut fwd = FrontQueue::forwarding(lower.front_fds().unwrap(), &cfg).unwrap();
    assert!(fwd.carries_data());
    let below_fds = lower.back_fds().unwrap();
    // The domain below gets files of the lower queue alone: not the upper arenas' inodes.
    let ino = |fd: &std::os::fd::OwnedFd| std::fs::File::from(fd.try_clone().unwrap()).metadata().unwrap().ino();
    let up = tap.arena_windows();
    assert_eq!(up.write.1 as u64, upper_w);
    let mut below = BackQueue::from_fds(below_fds.try_clone().unwrap(), cfg.nslots, arenas, 1 << 20).unwrap();
    let own = lower.front_fds().unwrap().arenas.unwrap();
    assert_eq!((ino(&below_fds.write_arena), ino(&below_fds.read_arena)), (ino(&own[0]), ino(&own[1])));

    let mut disk = vec![0u8; 1 << 20];
    let data: Vec<u8> = (0..8192u32).map(|i| (i % 251) as u8).collect();
    front.submit(FrontRequest::Write { offset: 12288, from: &data, fua: true }, 1).unwrap();
    // The tap domain copies the write's windows into the queue below.
    let Some(Popped::Valid(r)) = tap.pop().unwrap() else { panic!("no request") };
    fwd.push_gather(r.offset(), &tap.buffers(&r), r.fua(), 7).unwrap();
    fwd.publish();
    let mut seen = Vec::new();
    serve_seeing(&mut below, &mut disk, |v| seen.push((v.op(), v.fua(), v.segments()[0].arena)));
    assert_eq!(seen, [(Op::Write, true, bulkhead_ring::ARENA_WRITE)]);
    assert_eq!(&disk[12288..12288 + 8192], &data[..]);
    let mut done = Vec::new();
    fwd.reap(|c| done.push((c.user, c.result))).unwrap();
    assert_eq!(done, [(7, Ok(8192))]);
    // A read lands in the queue's own read arena, for the tap domain to copy up.
    fwd.submit(FrontRequest::Read { offset: 12288, into: 8192 }, 8).unwrap();
    serve(&mut below, &mut disk);
    let mut back = vec![0u8; 8192];
    fwd.reap(|c| c.data.unwrap().copy_to(&mut back)).unwrap();
    assert_eq!(back, data);
    // Restarted in place for a new domain below, it forgets what it held and frees its arenas.
    fwd.submit(FrontRequest::Read { offset: 0, into: 1 << 20 }, 9).unwrap();
    assert!(matches!(fwd.push(FrontRequest::Read { offset: 0, into: 4096 }, 10), Err(SubmitError::Full)));
    fwd.restart(2).unwrap();
    assert_eq!(fwd.in_flight(), 0);
    fwd.submit(FrontRequest::Read { offset: 0, into: 1 << 20 }, 11).unwrap();
    drop(tap);
}

#[test]
fn unanswered_requests_move_to_the_next_generation_in_order_with_their_data() {
    let (mut old, mut old_back) = pair(&cfg(), 1 << 20).unwrap();
    let mut disk = vec![0u8; 1 << 20];
    let a: Vec<u8> = (0..4096u32).map(|i| i as u8).collect();
    let b: Vec<u8> = (0..8192u32).map(|i| (i * 3) as u8).collect();
    old.submit(FrontRequest::Write { offset: 0, from: &a, fua: false }, 10).unwrap();
    serve(&mut old_back, &mut disk);
    old.reap(|_| {}).unwrap();
    // Four requests the old driver never answers.
    old.submit(FrontRequest::Write { offset: 8192, from: &b, fua: true }, 11).unwrap();
    old.submit(FrontRequest::Flush, 12).unwrap();
    old.submit(FrontRequest::Read { offset: 0, into: 4096 }, 13).unwrap();
    old.submit(FrontRequest::Discard { offset: 65536, len: 4096 }, 14).unwrap();
    let next = QueueConfig { generation: 2, ..cfg() };
    let (mut new, mut new_back) = pair(&next, 1 << 20).unwrap();
    assert_eq!(old.reissue_onto(&mut new).unwrap(), 4);
    let mut order = vec![];
    serve_seeing(&mut new_back, &mut disk, |r| order.push((r.op(), r.offset(), r.generation(), r.fua())));
    assert_eq!(
        order,
        [(Op::Write, 8192, 2, true), (Op::Flush, 0, 2, false), (Op::Read, 0, 2, false), (Op::Discard, 65536, 2, false)]
    );
    assert_eq!(&disk[8192..8192 + 8192], &b[..], "the write's data moved with it");
    let mut got = vec![];
    let mut read = vec![0u8; 4096];
    new.reap(|c| {
        if let Some(d) = c.data {
            d.copy_to(&mut read);
        }
        got.push(c.user);
    })
    .unwrap();
    assert_eq!(got, [11, 12, 13, 14], "the same tokens come back");
    assert_eq!(read, a);
}

#[test]
fn abandoned_requests_are_reported_once_and_free_their_space() {
    let (mut f, _b) = pair(&cfg(), 1 << 20).unwrap();
    f.submit(FrontRequest::Write { offset: 0, from: &[1u8; 4096], fua: false }, 7).unwrap();
    f.submit(FrontRequest::Read { offset: 0, into: 4096 }, 8).unwrap();
    let mut gone = vec![];
    f.abandon(|u| gone.push(u));
    gone.sort_unstable();
    assert_eq!(gone, [7, 8]);
    assert_eq!(f.in_flight(), 0);
    f.abandon(|u| panic!("{u} reported twice"));
}

/// Arenas of the queues [`interposed`] makes.
const ARENAS: bulkhead_ring::ArenaSizes = bulkhead_ring::ArenaSizes { write: 1 << 20, read: 1 << 20 };

/// A frontend's queue, a tap domain's ends of it and of the queue below, and the driver end
/// below: the channels of an `interpose` device, sharing the upper arenas.
struct Interposed {
    front: FrontQueue,
    upper: BackQueueFds,
    lower: LowerQueue,
    tap: BackQueue,
    fwd: FrontQueue,
    below: BackQueue,
}

fn interposed(cfg: &QueueConfig) -> Interposed {
    let (front, upper) = QueueSetup::create("upper", cfg).unwrap();
    let lower = LowerQueue::create("lower", cfg, &upper, false).unwrap();
    let tap = BackQueue::from_fds(upper.try_clone().unwrap(), cfg.nslots, ARENAS, 1 << 20).unwrap();
    let fwd = FrontQueue::forwarding(lower.front_fds().unwrap(), cfg).unwrap();
    let below = BackQueue::from_fds(lower.back_fds().unwrap(), cfg.nslots, ARENAS, 1 << 20).unwrap();
    Interposed { front, upper, lower, tap, fwd, below }
}

#[test]
fn a_tap_replaced_alone_gets_every_unanswered_request_again_and_the_driver_below_reattaches() {
    let (cfg, arenas) = (cfg(), ARENAS);
    let Interposed { mut front, upper, lower, mut tap, mut fwd, mut below } = interposed(&cfg);
    let mut disk = vec![0u8; 1 << 20];
    let a: Vec<u8> = (0..4096u32).map(|i| (i * 7) as u8).collect();
    let b: Vec<u8> = (0..8192u32).map(|i| (i * 5) as u8).collect();
    front.submit(FrontRequest::Write { offset: 0, from: &a, fua: false }, 1).unwrap();
    assert_eq!(forward_all(&mut tap, &mut fwd, &mut below, &mut disk), 1);
    front.reap(|_| {}).unwrap();
    // The old tap takes three requests and forwards one below, then dies answering nothing.
    front.submit(FrontRequest::Write { offset: 16384, from: &b, fua: true }, 2).unwrap();
    front.submit(FrontRequest::Read { offset: 0, into: 4096 }, 3).unwrap();
    front.submit(FrontRequest::Flush, 4).unwrap();
    let Some(Popped::Valid(r)) = tap.pop().unwrap() else { panic!("a request") };
    let windows = tap.arena_windows();
    let segs: Vec<Segment> =
        tap.buffers(&r).iter().map(|w| windows.segment(ARENA_WRITE, w.as_ptr() as usize, w.len()).unwrap()).collect();
    fwd.push_forward(r.op(), r.offset(), r.len(), &segs, r.fua(), 0).unwrap();
    fwd.publish();
    tap.pop().unwrap().unwrap();
    drop((tap, fwd));
    // The driver below finishes what it took (its answer goes nowhere) and lets go.
    assert_eq!(serve(&mut below, &mut disk), 1);
    // The frontend starts its queue over in place; the new tap attaches to the same files and
    // writes the header of the queue below; the driver below attaches again.
    assert_eq!(front.start_over(2).unwrap(), 3);
    let mut tap = BackQueue::from_fds(upper.try_clone().unwrap(), cfg.nslots, arenas, 1 << 20).unwrap();
    assert_eq!(tap.generation(), 2);
    let mut fwd = FrontQueue::forwarding(lower.front_fds().unwrap(), &QueueConfig { generation: 5, ..cfg }).unwrap();
    below.reattach(5).unwrap();
    assert_eq!(forward_all(&mut tap, &mut fwd, &mut below, &mut disk), 3);
    let mut got = vec![];
    let mut read = vec![0u8; 4096];
    front
        .reap(|c| {
            if let Some(d) = c.data {
                d.copy_to(&mut read);
            }
            got.push((c.user, c.result));
        })
        .unwrap();
    assert_eq!(got, [(2, Ok(8192)), (3, Ok(4096)), (4, Ok(0))], "the same tokens, in the order first sent");
    assert_eq!(&disk[16384..16384 + 8192], &b[..], "the write's data was still in its window");
    assert_eq!(read, a);
    // A driver below told the wrong generation refuses the ring.
    assert!(matches!(below.reattach(6), Err(ChannelError::Protocol(_))));
    // A forwarding end does not start over this way.
    assert!(fwd.start_over(3).is_err());
}

#[test]
fn a_standby_tap_maps_both_channels_without_writing_and_takes_over_once_started_over() {
    let (cfg, arenas) = (cfg(), ARENAS);
    let Interposed { mut front, upper, lower, mut tap, mut fwd, mut below } = interposed(&cfg);
    let mut disk = vec![0u8; 1 << 20];
    let a: Vec<u8> = (0..4096u32).map(|i| (i * 3) as u8).collect();
    front.submit(FrontRequest::Write { offset: 0, from: &a, fua: false }, 1).unwrap();
    assert_eq!(forward_all(&mut tap, &mut fwd, &mut below, &mut disk), 1);
    front.reap(|_| {}).unwrap();
    // The running tap has a request outstanding below when the standby maps the queues.
    front.submit(FrontRequest::Flush, 2).unwrap();
    front.submit(FrontRequest::Read { offset: 0, into: 4096 }, 3).unwrap();
    let Some(Popped::Valid(r)) = tap.pop().unwrap() else { panic!("a request") };
    fwd.push_forward(r.op(), r.offset(), r.len(), &[], r.fua(), 0).unwrap();
    fwd.publish();
    let ring_bytes = |fd: &std::os::fd::OwnedFd| std::fs::read(format!("/proc/self/fd/{}", fd.as_raw_fd())).unwrap();
    let lower_fds = lower.front_fds().unwrap();
    let (upper_before, lower_before) = (ring_bytes(&upper.ring), ring_bytes(&lower_fds.ring));
    let mut standby_above = BackQueue::from_fds(upper.try_clone().unwrap(), cfg.nslots, arenas, 1 << 20).unwrap();
    let mut standby_below = FrontQueue::forwarding_adopted(lower_fds, &QueueConfig { generation: 1, ..cfg }).unwrap();
    assert_eq!(ring_bytes(&upper.ring), upper_before, "the channel above is as the running tap left it");
    assert_eq!(ring_bytes(&lower.front_fds().unwrap().ring), lower_before, "the channel below too");
    assert!(
        matches!(standby_below.push_forward(Op::Flush, 0, 0, &[], false, 9), Err(SubmitError::Broken(_))),
        "nothing goes down before the queue is started over"
    );
    // The running tap dies; the driver below finishes what it took and lets go; the frontend
    // starts over in place; the standby attaches above and starts the queue below over.
    drop((tap, fwd));
    serve(&mut below, &mut disk);
    assert_eq!(front.start_over(2).unwrap(), 2);
    standby_above.reattach(2).unwrap();
    standby_below.restart(7).unwrap();
    below.reattach(7).unwrap();
    assert_eq!(forward_all(&mut standby_above, &mut standby_below, &mut below, &mut disk), 2);
    let mut read = vec![0u8; 4096];
    let mut got = Vec::new();
    front
        .reap(|c| {
            if let Some(d) = c.data {
                d.copy_to(&mut read);
            }
            got.push(c.user);
        })
        .unwrap();
    assert_eq!((got, read), (vec![2, 3], a), "what the dead tap held is answered through the standby");
}
