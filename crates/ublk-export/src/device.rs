//! One device exported as `/dev/ublkbN`: a thread of its own holds the ublk control device
//! (libublk's control ring belongs to the thread that made it), starts a worker per queue,
//! and on the word ends the device one of two ways: deleted (a stop, a removal), or left to
//! the next `serve` (a hand-over; the kernel holds the device and its requests meanwhile).

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::sync::mpsc;
use std::sync::Arc;
use std::thread::JoinHandle;

use bulkhead_client::Device;
use libublk::ctrl::{UblkCtrl, UblkCtrlBuilder};
use libublk::io::UblkDev;
use libublk::{sys, UblkFlags};

use crate::worker::{self, QueueStats, QueueWork, Stop};
use crate::Error;

/// The largest request the kernel sends (it splits larger ones).
const MAX_IO: u64 = 1 << 20;

/// What a device is exported with.
#[derive(Debug, Clone)]
pub(crate) struct Setup {
    pub dev: Arc<Device>,
    /// The number to take (`None`: the kernel picks one).
    pub number: Option<u32>,
    /// The number was this device's in this run directory before: a device the kernel still
    /// holds under it is this one's, left by an earlier `serve`.
    pub ours: bool,
    /// Requests in flight per queue.
    pub depth: u16,
    /// Leave the device to the next `serve` if this one ends without deleting it.
    pub recovery: bool,
}

/// How the device ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum End {
    /// Stopped and deleted: `/dev/ublkbN` goes away.
    Delete,
    /// Left to the next `serve`: the kernel keeps `/dev/ublkbN` and its requests until one
    /// recovers it.
    Leave,
}

/// A device exported as `/dev/ublkbN`.
pub(crate) struct Exported {
    pub dev: Arc<Device>,
    pub number: u32,
    /// Taken over from an earlier `serve` rather than made.
    pub recovered: bool,
    pub queues: u16,
    pub depth: u16,
    pub stats: Arc<Vec<QueueStats>>,
    end: mpsc::Sender<End>,
    thread: Option<JoinHandle<()>>,
}

impl Exported {
    /// Exports `setup.dev`; returns once `/dev/ublkbN` serves (or could not be made).
    pub fn start(setup: Setup) -> Result<Exported, Error> {
        let name = setup.dev.name().to_string();
        let (ready_tx, ready_rx) = mpsc::channel();
        let (end_tx, end_rx) = mpsc::channel();
        let dev = setup.dev.clone();
        let thread = std::thread::Builder::new()
            .name(format!("ublk-{name}"))
            .spawn(move || manage(setup, &ready_tx, &end_rx))
            .map_err(|e| Error::Failed { name: name.clone(), what: format!("cannot start its thread: {e}") })?;
        match ready_rx.recv() {
            Ok(Ok(started)) => Ok(Exported {
                dev,
                number: started.number,
                recovered: started.recovered,
                queues: started.queues,
                depth: started.depth,
                stats: started.stats,
                end: end_tx,
                thread: Some(thread),
            }),
            Ok(Err(e)) => {
                let _ = thread.join();
                Err(e)
            }
            Err(_) => {
                let _ = thread.join();
                Err(Error::Failed { name, what: "its thread ended before the device started".into() })
            }
        }
    }

    /// The block device.
    pub fn path(&self) -> String {
        format!("/dev/ublkb{}", self.number)
    }

    /// Ends the device as `how` says, and waits until it has.
    pub fn end(mut self, how: End) {
        let _ = self.end.send(how);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// What the device's thread reports once it serves.
struct Started {
    number: u32,
    recovered: bool,
    queues: u16,
    depth: u16,
    stats: Arc<Vec<QueueStats>>,
}

fn failed(name: &str, what: impl std::fmt::Display) -> Error {
    Error::Failed { name: name.to_string(), what: what.to_string() }
}

/// The flags every device is made with: the user copies, and with `recovery` the kernel
/// keeping the device and reissuing its requests while no server runs.
fn ctrl_flags(recovery: bool) -> u64 {
    let mut f = u64::from(sys::UBLK_F_USER_COPY);
    if recovery {
        f |= u64::from(sys::UBLK_F_USER_RECOVERY | sys::UBLK_F_USER_RECOVERY_REISSUE);
    }
    f
}

fn state_name(state: u16) -> &'static str {
    match u32::from(state) {
        sys::UBLK_S_DEV_DEAD => "stopped",
        sys::UBLK_S_DEV_LIVE => "served",
        sys::UBLK_S_DEV_QUIESCED => "waiting for its server",
        sys::UBLK_S_DEV_FAIL_IO => "failing its requests",
        _ => "in an unknown state",
    }
}

/// The control device for `s`: the one an earlier `serve` left (recovered), or a new one.
fn open(s: &Setup) -> Result<(UblkCtrl, bool), Error> {
    let name = s.dev.name();
    let io_buf = (s.dev.max_request().min(MAX_IO) & !4095).max(4096) as u32;
    let queues = s.dev.queue_count().clamp(1, sys::UBLK_MAX_NR_QUEUES as usize) as u16;
    let builder = |id: i32, flags: UblkFlags| {
        UblkCtrlBuilder::default()
            .name("bulkhead")
            .id(id)
            .nr_queues(queues)
            .depth(s.depth)
            .io_buf_bytes(io_buf)
            .ctrl_flags(ctrl_flags(s.recovery))
            .dev_flags(flags)
            .build()
    };
    if let Some(n) = s.number {
        if let Ok(old) = UblkCtrl::new_simple(n as i32) {
            let info = old.dev_info();
            let waiting = u32::from(info.state) == sys::UBLK_S_DEV_QUIESCED;
            let mut params = sys::ublk_params::default();
            let same_size = old.get_params(&mut params).is_ok() && params.basic.dev_sectors == s.dev.size() >> 9;
            let recoverable = info.flags & u64::from(sys::UBLK_F_USER_RECOVERY) != 0;
            if s.ours && waiting && recoverable && same_size && s.recovery {
                drop(old);
                let ctrl = builder(n as i32, UblkFlags::UBLK_DEV_F_RECOVER_DEV)
                    .map_err(|e| failed(name, format!("/dev/ublkb{n}: cannot take it over: {e}")))?;
                ctrl.start_user_recover().map_err(|e| failed(name, format!("/dev/ublkb{n}: cannot take it over: {e}")))?;
                return Ok((ctrl, true));
            }
            if !s.ours || u32::from(info.state) == sys::UBLK_S_DEV_LIVE {
                return Err(Error::Taken { name: name.to_string(), number: n, state: state_name(info.state) });
            }
            // This device's, left by a `serve` that ended without a successor to take it (or
            // of another size now): it is replaced.
            log::info!("`{name}`: /dev/ublkb{n} was left {} by an earlier serve: replacing it", state_name(info.state));
            let _ = old.kill_dev();
            old.del_dev().map_err(|e| failed(name, format!("/dev/ublkb{n}: cannot remove the one left before: {e}")))?;
        }
    }
    let id = s.number.map_or(-1, |n| n as i32);
    let ctrl = builder(id, UblkFlags::UBLK_DEV_F_ADD_DEV).map_err(|e| match (s.number, e) {
        (Some(n), libublk::UblkError::OtherError(e)) if e == -libc::EEXIST => {
            Error::Taken { name: name.to_string(), number: n, state: "in use" }
        }
        (_, e) => failed(name, format!("cannot add a ublk device: {e}")),
    })?;
    Ok((ctrl, false))
}

/// The device's thread: makes it, serves it, ends it.
fn manage(setup: Setup, ready: &mpsc::Sender<Result<Started, Error>>, end: &mpsc::Receiver<End>) {
    let name = setup.dev.name().to_string();
    let (ctrl, recovered) = match open(&setup) {
        Ok(c) => c,
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    let info = ctrl.dev_info();
    let number = info.dev_id;
    let (size, block, read_only) = (setup.dev.size(), setup.dev.min_block().max(512), setup.dev.read_only());
    let udev = UblkDev::new(
        "bulkhead".into(),
        |d: &mut UblkDev| {
            d.set_default_params(size);
            let depth = d.dev_info.queue_depth;
            // Room for the worker's own entries (polls, cancellations) beside every commit.
            d.tgt.sq_depth = depth.saturating_mul(2).max(16);
            d.tgt.cq_depth = depth.saturating_mul(2).max(16);
            let p = &mut d.tgt.params;
            p.basic.logical_bs_shift = block.trailing_zeros() as u8;
            p.basic.physical_bs_shift = 12u8.max(p.basic.logical_bs_shift);
            p.basic.io_min_shift = p.basic.logical_bs_shift;
            p.basic.attrs = sys::UBLK_ATTR_VOLATILE_CACHE | sys::UBLK_ATTR_FUA;
            if read_only {
                p.basic.attrs |= sys::UBLK_ATTR_READ_ONLY;
            }
            p.types |= sys::UBLK_PARAM_TYPE_DISCARD;
            let max_range = (u32::MAX >> 9) & !((block >> 9) - 1);
            p.discard = sys::ublk_param_discard {
                discard_alignment: 0,
                discard_granularity: block,
                max_discard_sectors: max_range,
                max_write_zeroes_sectors: max_range,
                max_discard_segments: 1,
                reserved0: 0,
            };
            Ok(())
        },
        &ctrl,
    );
    let udev = match udev {
        Ok(u) => u,
        Err(e) => {
            let _ = ready.send(Err(failed(&name, format!("/dev/ublkc{number}: {e}"))));
            if !recovered {
                let _ = ctrl.del_dev();
            }
            return;
        }
    };
    // The workers' copies go through the descriptor libublk holds for the device.
    let cdev = match cdev_of(&udev) {
        Ok(fd) => fd,
        Err(e) => {
            let _ = ready.send(Err(failed(&name, format!("/dev/ublkc{number}: {e}"))));
            return;
        }
    };
    let queues = info.nr_hw_queues;
    let stats: Arc<Vec<QueueStats>> = Arc::new((0..queues).map(|_| QueueStats::default()).collect());
    let stops: Vec<Stop> = match (0..queues).map(|_| Stop::new()).collect() {
        Ok(s) => s,
        Err(e) => {
            let _ = ready.send(Err(failed(&name, format!("cannot make its queues' stop signals: {e}"))));
            return;
        }
    };
    let (started_tx, started_rx) = mpsc::channel();
    let how = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..queues)
            .map(|qid| {
                let w = QueueWork {
                    udev: &udev,
                    qid,
                    dev: setup.dev.clone(),
                    cdev: cdev.as_fd(),
                    stop: &stops[usize::from(qid)],
                    stats: &stats[usize::from(qid)],
                    started: started_tx.clone(),
                };
                std::thread::Builder::new().name(format!("ublk{number}-q{qid}")).spawn_scoped(scope, move || {
                    if let Err(e) = worker::run(w) {
                        log::warn!("ublk device {number} queue {qid}: {e}");
                    }
                })
            })
            .collect();
        // A start that fails ends the queues' commands (the workers see the queue go down).
        let abort = || {
            let _ = ctrl.kill_dev();
            stops.iter().for_each(Stop::request);
        };
        if let Some(e) = workers.iter().find_map(|w| w.as_ref().err()) {
            let _ = ready.send(Err(failed(&name, format!("cannot start a queue thread: {e}"))));
            abort();
            return None;
        }
        // Each queue's thread, for the record libublk keeps of the device under /run/ublksrvd
        // (what `ublk list` shows, and what a recovery reads back).
        for _ in 0..queues {
            match started_rx.recv_timeout(std::time::Duration::from_secs(10)) {
                Ok((qid, tid)) => {
                    let _ = ctrl.configure_queue(&udev, qid, tid);
                }
                Err(_) => break,
            }
        }
        if let Err(e) = ctrl.start_dev(&udev) {
            let what = if recovered { "cannot end its recovery" } else { "cannot start it" };
            let _ = ready.send(Err(failed(&name, format!("/dev/ublkb{number}: {what}: {e}"))));
            abort();
            return None;
        }
        let _ = ready.send(Ok(Started { number, recovered, queues, depth: info.queue_depth, stats: stats.clone() }));
        // Until told otherwise; if the export is dropped without a word, as it would have been
        // on a hand-over when a successor can take the device, else deleted.
        let how = end.recv().unwrap_or(if setup.recovery { End::Leave } else { End::Delete });
        match how {
            End::Delete => {
                // The kernel lets the requests in flight finish, then ends every queue's
                // commands: the workers see the queue go down and end.
                if let Err(e) = ctrl.kill_dev() {
                    log::warn!("`{name}`: stopping /dev/ublkb{number}: {e}");
                    stops.iter().for_each(Stop::request);
                }
            }
            End::Leave => stops.iter().for_each(Stop::request),
        }
        Some(how)
    });
    drop(cdev);
    match how {
        Some(End::Leave) => {
            ctrl.disown();
            drop(udev);
            log::info!("`{name}`: /dev/ublkb{number} left to the next serve");
        }
        Some(End::Delete) | None => {
            drop(udev);
            if let Err(e) = ctrl.del_dev() {
                log::warn!("`{name}`: deleting /dev/ublkb{number}: {e}");
            }
        }
    }
}

/// A descriptor of the device's `/dev/ublkcN` for the workers' copies (the device opens only
/// once: this is libublk's, duplicated).
fn cdev_of(udev: &UblkDev) -> std::io::Result<OwnedFd> {
    // SAFETY: `tgt.fds[0]` is the descriptor of `/dev/ublkcN` that `udev` opened and keeps open
    // for as long as it lives; it is only borrowed here to be duplicated.
    let fd = unsafe { BorrowedFd::borrow_raw(udev.tgt.fds[0]) };
    let owned = fd.try_clone_to_owned()?;
    debug_assert!(owned.as_raw_fd() >= 0);
    Ok(owned)
}
