//! The two ends of a queue: [`FrontRing`] (frontend: requests out, responses in) and
//! [`BackRing`] (driver domain: requests in, responses out).

use std::sync::atomic::{AtomicU32, Ordering};

use bulkhead_shmem::Mapping;

use crate::layout::{HeaderOffsets as H, RingLayout, MAGIC, VERSION};
use crate::notify::{self, IndexCell, PeerState};
use crate::wire::{RequestSlot, ResponseSlot, HEAD_SEGMENTS, REQ_SLOT_HEAD, REQ_SLOT_SIZE, RSP_SLOT_SIZE};
use crate::RingError;
use zerocopy::{FromZeros, IntoBytes};

fn cell(map: &Mapping, off: usize) -> &AtomicU32 {
    map.atomic_u32(off).expect("header field inside the mapping (layout checked at attach)")
}

/// The frontend's end of a queue.
///
/// The frontend keeps its own copies of every index it owns (`req_prod`, `rsp_cons`) and never
/// reads them back from shared memory, so a driver scribbling on the header cannot move them.
#[derive(Debug)]
pub struct FrontRing {
    map: Mapping,
    layout: RingLayout,
    req_prod: u32,
    req_published: u32,
    rsp_cons: u32,
    rsp_prod_seen: u32,
    peer_polls: bool,
}

impl FrontRing {
    /// Initialises the header of a fresh queue file mapped read-write and returns its front end.
    pub fn create(map: Mapping, layout: RingLayout, generation: u32) -> Result<Self, RingError> {
        if map.len() < layout.file_size() {
            return Err(RingError::BadHeader("queue file smaller than its layout"));
        }
        Self::write_header(&map, layout, generation)?;
        Ok(FrontRing { map, layout, req_prod: 0, req_published: 0, rsp_cons: 0, rsp_prod_seen: 0, peer_polls: false })
    }

    /// The front end of a queue file whose header another front end writes now, mapped
    /// read-write but left as it is: nothing is written until [`restart`](Self::restart), which
    /// must come before the first [`push`](Self::push). For a standby tap domain, which takes the
    /// queue over once the front end before it is gone.
    pub fn adopt(map: Mapping, layout: RingLayout) -> Result<Self, RingError> {
        if map.len() < layout.file_size() {
            return Err(RingError::BadHeader("queue file smaller than its layout"));
        }
        Ok(FrontRing { map, layout, req_prod: 0, req_published: 0, rsp_cons: 0, rsp_prod_seen: 0, peer_polls: false })
    }

    fn write_header(map: &Mapping, layout: RingLayout, generation: u32) -> Result<(), RingError> {
        map.write_obj(H::MAGIC, &MAGIC)?;
        map.write_obj(H::VERSION, &VERSION)?;
        map.write_obj(H::NSLOTS, &layout.nslots)?;
        map.write_obj(H::REQ_SLOT, &(REQ_SLOT_SIZE as u32))?;
        map.write_obj(H::RSP_SLOT, &(RSP_SLOT_SIZE as u32))?;
        for off in [H::REQ_PROD, H::REQ_CONS, H::REQ_EVENT, H::BACK_STATE, H::RSP_PROD, H::RSP_CONS, H::RSP_EVENT, H::FRONT_STATE]
        {
            cell(map, off).store(0, Ordering::Relaxed);
        }
        map.atomic_u64(H::PROGRESS)?.store(0, Ordering::Relaxed);
        cell(map, H::GENERATION).store(generation, Ordering::Release);
        Ok(())
    }

    /// Starts the queue over as a fresh one of `generation`, for a new driver end: the header
    /// is rewritten whatever the old driver left in it, and every request outstanding is
    /// forgotten. Call only once no driver end is attached any more (the old driver domain has
    /// exited) and before the new one attaches.
    pub fn restart(&mut self, generation: u32) -> Result<(), RingError> {
        Self::write_header(&self.map, self.layout, generation)?;
        (self.req_prod, self.req_published, self.rsp_cons, self.rsp_prod_seen) = (0, 0, 0, 0);
        Ok(())
    }

    /// Ring geometry.
    pub fn layout(&self) -> RingLayout {
        self.layout
    }

    /// Declares that the driver never sleeps (`poll` mode on both sides): publication is then a
    /// plain release store, without the fence and event-index check of the sleep handshake.
    pub fn set_peer_polls(&mut self, polls: bool) {
        self.peer_polls = polls;
    }

    /// Requests pushed whose responses have not been consumed.
    pub fn outstanding(&self) -> u32 {
        self.req_prod.wrapping_sub(self.rsp_cons)
    }

    /// Whether another request fits.
    pub fn has_space(&self) -> bool {
        self.outstanding() < self.layout.nslots
    }

    /// Writes a request into the next slot (not yet visible to the driver; see
    /// [`publish`](Self::publish)).
    pub fn push(&mut self, slot: &RequestSlot) -> Result<(), RingError> {
        if !self.has_space() {
            return Err(RingError::Full);
        }
        // A request whose segments fit the first line is written as that line alone: the rest of
        // the slot may hold an older request's bytes, which the driver does not read.
        let n = if slot.nsegs as usize <= HEAD_SEGMENTS { REQ_SLOT_HEAD } else { REQ_SLOT_SIZE };
        self.map.write_from(self.layout.req_slot(self.req_prod), &slot.as_bytes()[..n])?;
        self.req_prod = self.req_prod.wrapping_add(1);
        Ok(())
    }

    /// Makes pushed requests visible with one release store; returns whether the driver must be
    /// rung (it published SLEEPING with an event index inside the new batch).
    pub fn publish(&mut self) -> bool {
        if self.req_prod == self.req_published {
            return false;
        }
        let old = self.req_published;
        self.req_published = self.req_prod;
        if self.peer_polls {
            cell(&self.map, H::REQ_PROD).store_release(self.req_prod);
            return false;
        }
        notify::publish(cell(&self.map, H::REQ_PROD), cell(&self.map, H::REQ_EVENT), old, self.req_prod)
    }

    /// Takes the next response, if one is published. The slot is copied once; the caller must
    /// validate the copy. An index claiming more responses than requests outstanding is a
    /// protocol violation.
    pub fn pop_response(&mut self) -> Result<Option<ResponseSlot>, RingError> {
        if self.rsp_cons == self.rsp_prod_seen {
            let prod = cell(&self.map, H::RSP_PROD).load_acquire();
            let ahead = prod.wrapping_sub(self.rsp_cons);
            if ahead > self.outstanding() {
                return Err(RingError::IndexOutOfRange { prod, cons: self.rsp_cons, ahead, nslots: self.layout.nslots });
            }
            self.rsp_prod_seen = prod;
            if ahead == 0 {
                return Ok(None);
            }
        }
        let slot = self.map.read_obj::<ResponseSlot>(self.layout.rsp_slot(self.rsp_cons))?;
        self.rsp_cons = self.rsp_cons.wrapping_add(1);
        Ok(Some(slot))
    }

    /// Publishes the response consumer index (informational for the driver).
    pub fn finish_responses(&self) {
        cell(&self.map, H::RSP_CONS).store_release(self.rsp_cons);
    }

    /// Whether a response is published and not consumed (cheap poll).
    pub fn response_pending(&self) -> bool {
        self.rsp_cons != self.rsp_prod_seen || cell(&self.map, H::RSP_PROD).load_acquire() != self.rsp_cons
    }

    /// Announces SLEEPING; returns `true` if a response is already pending (do not sleep).
    pub fn prepare_sleep(&self) -> bool {
        self.finish_responses();
        notify::prepare_sleep(
            cell(&self.map, H::RSP_PROD),
            cell(&self.map, H::RSP_EVENT),
            cell(&self.map, H::FRONT_STATE),
            self.rsp_cons,
        )
    }

    /// Announces RUNNING.
    pub fn set_running(&self) {
        notify::wake(cell(&self.map, H::FRONT_STATE));
    }

    /// The driver's published state, as it claims it.
    pub fn peer_state(&self) -> PeerState {
        match cell(&self.map, H::BACK_STATE).load_relaxed() {
            1 => PeerState::Sleeping,
            _ => PeerState::Running,
        }
    }

    /// Requests the driver claims to have completed (for the supervisor's progress watch).
    pub fn progress(&self) -> u64 {
        self.map.atomic_u64(H::PROGRESS).map(|a| a.load(Ordering::Relaxed)).unwrap_or(0)
    }
}

/// The driver domain's end of a queue.
#[derive(Debug)]
pub struct BackRing {
    map: Mapping,
    layout: RingLayout,
    generation: u32,
    req_cons: u32,
    req_prod_seen: u32,
    rsp_prod: u32,
    rsp_published: u32,
    progress: u64,
    peer_polls: bool,
}

impl BackRing {
    /// Attaches to a queue file initialised by the frontend, checking its header against the
    /// geometry the driver was told to expect.
    pub fn attach(map: Mapping, layout: RingLayout) -> Result<Self, RingError> {
        let (generation, req_cons, rsp_prod) = Self::read_header(&map, layout)?;
        Ok(BackRing {
            map,
            layout,
            generation,
            req_cons,
            req_prod_seen: req_cons,
            rsp_prod,
            rsp_published: rsp_prod,
            progress: 0,
            peer_polls: false,
        })
    }

    /// Attaches again to the same queue file, which a new frontend end has started over (a
    /// tap domain above this driver was replaced while this end stayed): the header is checked
    /// as at [`attach`](Self::attach) and every index taken from it afresh. Call only once this
    /// end has stopped using the ring and the new frontend has written the header. On an error
    /// this end is left as it was, and must not be used.
    pub fn reattach(&mut self) -> Result<(), RingError> {
        let (generation, req_cons, rsp_prod) = Self::read_header(&self.map, self.layout)?;
        self.generation = generation;
        (self.req_cons, self.req_prod_seen) = (req_cons, req_cons);
        (self.rsp_prod, self.rsp_published) = (rsp_prod, rsp_prod);
        self.progress = 0;
        Ok(())
    }

    /// Checks the header against `layout`; returns its generation, request consumer index and
    /// response producer index.
    fn read_header(map: &Mapping, layout: RingLayout) -> Result<(u32, u32, u32), RingError> {
        if map.len() < layout.file_size() {
            return Err(RingError::BadHeader("queue file smaller than its layout"));
        }
        if map.read_obj::<u32>(H::MAGIC)? != MAGIC {
            return Err(RingError::BadHeader("bad magic"));
        }
        if map.read_obj::<u32>(H::VERSION)? != VERSION {
            return Err(RingError::BadHeader("unsupported version"));
        }
        if map.read_obj::<u32>(H::NSLOTS)? != layout.nslots
            || map.read_obj::<u32>(H::REQ_SLOT)? != REQ_SLOT_SIZE as u32
            || map.read_obj::<u32>(H::RSP_SLOT)? != RSP_SLOT_SIZE as u32
        {
            return Err(RingError::BadHeader("geometry differs from the one expected"));
        }
        let generation = cell(map, H::GENERATION).load_acquire();
        let req_cons = cell(map, H::REQ_CONS).load_relaxed();
        let rsp_prod = cell(map, H::RSP_PROD).load_relaxed();
        Ok((generation, req_cons, rsp_prod))
    }

    /// Slots in each ring.
    pub fn nslots(&self) -> u32 {
        self.layout.nslots
    }

    /// Channel generation.
    pub fn generation(&self) -> u32 {
        self.generation
    }

    /// Declares that the frontend never sleeps (`poll` mode): publication is then a plain
    /// release store, without the fence and event-index check of the sleep handshake.
    pub fn set_peer_polls(&mut self, polls: bool) {
        self.peer_polls = polls;
    }

    /// Takes the next request, if one is published, as a copy to validate.
    pub fn pop_request(&mut self) -> Result<Option<RequestSlot>, RingError> {
        if self.req_cons == self.req_prod_seen {
            let prod = cell(&self.map, H::REQ_PROD).load_acquire();
            let ahead = prod.wrapping_sub(self.req_cons);
            if ahead > self.layout.nslots {
                return Err(RingError::IndexOutOfRange { prod, cons: self.req_cons, ahead, nslots: self.layout.nslots });
            }
            self.req_prod_seen = prod;
            if ahead == 0 {
                return Ok(None);
            }
        }
        // The first line, then the rest only if the copy says it names more segments: each byte
        // is read once, and the copy is what gets validated.
        let off = self.layout.req_slot(self.req_cons);
        let mut slot = RequestSlot::new_zeroed();
        self.map.read_into(off, &mut slot.as_mut_bytes()[..REQ_SLOT_HEAD])?;
        if slot.nsegs as usize > HEAD_SEGMENTS {
            self.map.read_into(off + REQ_SLOT_HEAD, &mut slot.as_mut_bytes()[REQ_SLOT_HEAD..])?;
        }
        self.req_cons = self.req_cons.wrapping_add(1);
        Ok(Some(slot))
    }

    /// Whether a request is published and not consumed (cheap poll).
    pub fn request_pending(&self) -> bool {
        self.req_cons != self.req_prod_seen || cell(&self.map, H::REQ_PROD).load_acquire() != self.req_cons
    }

    /// Writes a response into the next slot (visible after [`publish`](Self::publish)).
    pub fn push(&mut self, rsp: &ResponseSlot) -> Result<(), RingError> {
        self.map.write_obj(self.layout.rsp_slot(self.rsp_prod), rsp)?;
        self.rsp_prod = self.rsp_prod.wrapping_add(1);
        self.progress += 1;
        Ok(())
    }

    /// Publishes pushed responses and the consumer index with release stores; returns whether
    /// the frontend must be rung.
    pub fn publish(&mut self) -> bool {
        cell(&self.map, H::REQ_CONS).store_release(self.req_cons);
        if self.rsp_prod == self.rsp_published {
            return false;
        }
        if let Ok(p) = self.map.atomic_u64(H::PROGRESS) {
            p.store(self.progress, Ordering::Relaxed);
        }
        let old = self.rsp_published;
        self.rsp_published = self.rsp_prod;
        if self.peer_polls {
            cell(&self.map, H::RSP_PROD).store_release(self.rsp_prod);
            return false;
        }
        notify::publish(cell(&self.map, H::RSP_PROD), cell(&self.map, H::RSP_EVENT), old, self.rsp_prod)
    }

    /// Announces SLEEPING; returns `true` if a request is already pending (do not sleep).
    pub fn prepare_sleep(&self) -> bool {
        notify::prepare_sleep(
            cell(&self.map, H::REQ_PROD),
            cell(&self.map, H::REQ_EVENT),
            cell(&self.map, H::BACK_STATE),
            self.req_cons,
        )
    }

    /// Announces RUNNING.
    pub fn set_running(&self) {
        notify::wake(cell(&self.map, H::BACK_STATE));
    }

    /// Responses this end has produced since attach.
    pub fn completed(&self) -> u64 {
        self.progress
    }

    /// Raw access for tests and the hostile-driver test mode: the mapping itself.
    pub fn mapping(&self) -> &Mapping {
        &self.map
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::op_code;
    use bulkhead_block::Op;
    use bulkhead_shmem::{memfd, Protection};
    use std::os::fd::AsRawFd;

    fn pair(nslots: u32) -> (FrontRing, BackRing) {
        let (front, back, _fd) = pair_with_file(nslots);
        (front, back)
    }

    fn pair_with_file(nslots: u32) -> (FrontRing, BackRing, std::os::fd::OwnedFd) {
        let layout = RingLayout::new(nslots).unwrap();
        let fd = memfd::create("q", layout.file_size() as u64).unwrap();
        let fm = Mapping::new(fd.as_raw_fd(), layout.file_size(), Protection::ReadWrite).unwrap();
        let bm = Mapping::new(fd.as_raw_fd(), layout.file_size(), Protection::ReadWrite).unwrap();
        let front = FrontRing::create(fm, layout, 5).unwrap();
        let back = BackRing::attach(bm, layout).unwrap();
        (front, back, fd)
    }

    fn req(id: u64) -> RequestSlot {
        RequestSlot { id, generation: 5, op: op_code(Op::Flush), ..Default::default() }
    }

    #[test]
    fn request_and_response_round_trip() {
        let (mut f, mut b) = pair(8);
        assert_eq!(b.generation(), 5);
        f.push(&req(1)).unwrap();
        assert_eq!(b.pop_request().unwrap(), None, "unpublished request is invisible");
        f.publish();
        let r = b.pop_request().unwrap().unwrap();
        assert_eq!(r.id, 1);
        b.push(&ResponseSlot { id: 1, generation: 5, ..Default::default() }).unwrap();
        assert_eq!(f.pop_response().unwrap(), None, "unpublished response is invisible");
        b.publish();
        assert_eq!(f.pop_response().unwrap().unwrap().id, 1);
        assert_eq!(f.outstanding(), 0);
    }

    #[test]
    fn a_restarted_ring_serves_a_new_driver_end_from_scratch() {
        let (mut f, mut b, fd) = pair_with_file(4);
        for i in 0..3 {
            f.push(&req(i)).unwrap();
        }
        f.publish();
        b.pop_request().unwrap().unwrap();
        // The old driver dies leaving a scribbled header; the ring starts over as generation 6.
        cell(b.mapping(), H::RSP_PROD).store(77, Ordering::Release);
        drop(b);
        f.restart(6).unwrap();
        assert_eq!(f.outstanding(), 0);
        let bm = Mapping::new(fd.as_raw_fd(), f.layout.file_size(), Protection::ReadWrite).unwrap();
        let mut b = BackRing::attach(bm, f.layout).unwrap();
        assert_eq!(b.generation(), 6);
        assert_eq!(b.pop_request().unwrap(), None, "nothing of the old generation is left");
        f.push(&RequestSlot { id: 9, generation: 6, op: op_code(Op::Flush), ..Default::default() }).unwrap();
        f.publish();
        assert_eq!(b.pop_request().unwrap().unwrap().id, 9);
        b.push(&ResponseSlot { id: 9, generation: 6, ..Default::default() }).unwrap();
        b.publish();
        assert_eq!(f.pop_response().unwrap().unwrap().id, 9);
    }

    #[test]
    fn a_driver_end_reattaches_to_a_ring_a_new_frontend_started_over() {
        let (mut f, mut b, fd) = pair_with_file(4);
        for i in 0..3 {
            f.push(&req(i)).unwrap();
        }
        f.publish();
        b.pop_request().unwrap().unwrap();
        b.push(&ResponseSlot { id: 0, generation: 5, ..Default::default() }).unwrap();
        b.publish();
        // The frontend end is replaced (a new tap domain above): the file is the same, the
        // header written afresh as generation 7; the driver end stays and attaches again.
        drop(f);
        let fm = Mapping::new(fd.as_raw_fd(), b.layout.file_size(), Protection::ReadWrite).unwrap();
        let mut f = FrontRing::create(fm, b.layout, 7).unwrap();
        b.reattach().unwrap();
        assert_eq!((b.generation(), b.completed()), (7, 0));
        assert_eq!(b.pop_request().unwrap(), None, "nothing of the old frontend is left");
        f.push(&RequestSlot { id: 3, generation: 7, op: op_code(Op::Flush), ..Default::default() }).unwrap();
        f.publish();
        assert_eq!(b.pop_request().unwrap().unwrap().id, 3);
        b.push(&ResponseSlot { id: 3, generation: 7, ..Default::default() }).unwrap();
        b.publish();
        assert_eq!(f.pop_response().unwrap().unwrap().id, 3);
        // A header that is not a ring any more is refused.
        cell(b.mapping(), H::NSLOTS).store(8, Ordering::Release);
        assert!(matches!(b.reattach(), Err(RingError::BadHeader(_))));
    }

    #[test]
    fn ring_full_rejects_push() {
        let (mut f, _b) = pair(4);
        for i in 0..4 {
            f.push(&req(i)).unwrap();
        }
        assert_eq!(f.push(&req(9)), Err(RingError::Full));
    }

    #[test]
    fn indexes_wrap_around_many_times() {
        let (mut f, mut b) = pair(4);
        for round in 0..10_000u64 {
            for i in 0..3 {
                f.push(&req(round * 3 + i)).unwrap();
            }
            f.publish();
            for i in 0..3 {
                let r = b.pop_request().unwrap().unwrap();
                assert_eq!(r.id, round * 3 + i);
                b.push(&ResponseSlot { id: r.id, generation: 5, ..Default::default() }).unwrap();
            }
            b.publish();
            for i in 0..3 {
                assert_eq!(f.pop_response().unwrap().unwrap().id, round * 3 + i);
            }
        }
    }

    #[test]
    fn response_index_beyond_outstanding_is_a_violation() {
        let (mut f, b) = pair(8);
        f.push(&req(1)).unwrap();
        f.publish();
        // A hostile driver claims three responses for one request.
        cell(b.mapping(), H::RSP_PROD).store(3, Ordering::Release);
        assert!(matches!(f.pop_response(), Err(RingError::IndexOutOfRange { ahead: 3, .. })));
    }

    #[test]
    fn request_index_beyond_ring_is_a_violation() {
        let (f, mut b) = pair(8);
        cell(&f.map, H::REQ_PROD).store(1000, Ordering::Release);
        assert!(matches!(b.pop_request(), Err(RingError::IndexOutOfRange { .. })));
    }

    #[test]
    fn corrupted_header_fields_do_not_move_private_indexes() {
        let (mut f, mut b) = pair(8);
        f.push(&req(1)).unwrap();
        f.publish();
        // The driver overwrites the frontend-owned indexes.
        cell(b.mapping(), H::REQ_PROD).store(0, Ordering::Release);
        cell(b.mapping(), H::RSP_CONS).store(77, Ordering::Release);
        f.push(&req(2)).unwrap();
        f.publish();
        // The frontend republished its own index: both requests are visible again.
        assert_eq!(b.pop_request().unwrap().unwrap().id, 1);
        assert_eq!(b.pop_request().unwrap().unwrap().id, 2);
        assert_eq!(f.outstanding(), 2);
    }

    #[test]
    fn bad_header_is_refused_at_attach() {
        let layout = RingLayout::new(8).unwrap();
        let fd = memfd::create("q", layout.file_size() as u64).unwrap();
        let m = Mapping::new(fd.as_raw_fd(), layout.file_size(), Protection::ReadWrite).unwrap();
        assert!(matches!(BackRing::attach(m, layout), Err(RingError::BadHeader("bad magic"))));
        let fm = Mapping::new(fd.as_raw_fd(), layout.file_size(), Protection::ReadWrite).unwrap();
        let _f = FrontRing::create(fm, layout, 0).unwrap();
        let m = Mapping::new(fd.as_raw_fd(), layout.file_size(), Protection::ReadWrite).unwrap();
        assert!(BackRing::attach(m, RingLayout::new(16).unwrap()).is_err());
    }

    fn seg(i: u64) -> crate::wire::Segment {
        crate::wire::Segment { arena: 1, len: 4096, offset: i * 4096 }
    }

    #[test]
    fn short_request_is_one_line_and_ignores_stale_tail() {
        let (mut f, mut b) = pair(2);
        // A six-segment request fills the whole slot 0.
        let mut long = req(1);
        long.nsegs = 6;
        for i in 0..6 {
            long.segs[i] = seg(i as u64 + 1);
        }
        f.push(&long).unwrap();
        f.publish();
        assert_eq!(b.pop_request().unwrap().unwrap(), long, "a long request is read whole");
        b.push(&ResponseSlot { id: 1, generation: 5, ..Default::default() }).unwrap();
        b.publish();
        f.pop_response().unwrap().unwrap();
        // Slot 1, then slot 0 again with one segment: its tail still holds the long request's
        // segments, and the copy the driver gets must not.
        let mut short = req(2);
        short.nsegs = 1;
        short.segs[0] = seg(9);
        f.push(&req(3)).unwrap();
        f.push(&short).unwrap();
        f.publish();
        assert_eq!(b.pop_request().unwrap().unwrap().id, 3);
        let got = b.pop_request().unwrap().unwrap();
        assert_eq!(got, short);
        assert!(got.segs[2..].iter().all(|s| *s == Default::default()), "stale tail not read");
        let raw = b.mapping().read_obj::<RequestSlot>(RingLayout::new(2).unwrap().req_slot(0)).unwrap();
        assert_eq!(raw.segs[5], seg(6), "the tail in shared memory was indeed stale");
    }

    #[test]
    fn a_slot_claiming_many_segments_is_read_whole_for_validation() {
        let (mut f, mut b) = pair(2);
        let mut s = req(1);
        s.nsegs = 1;
        f.push(&s).unwrap();
        // A hostile frontend rewrites nsegs after the push: the driver's copy reads the tail too
        // (and validation, not the ring, judges the segments).
        f.map.write_obj(RingLayout::new(2).unwrap().req_slot(0) + 14, &7u16).unwrap();
        f.publish();
        let got = b.pop_request().unwrap().unwrap();
        assert_eq!(got.nsegs, 7);
    }

    #[test]
    fn polling_peers_publish_without_ringing() {
        let (mut f, mut b) = pair(8);
        f.set_peer_polls(true);
        b.set_peer_polls(true);
        // Even a peer that claims to sleep is not rung in poll mode: it never does.
        assert!(!b.prepare_sleep());
        f.push(&req(1)).unwrap();
        assert!(!f.publish());
        assert_eq!(b.pop_request().unwrap().unwrap().id, 1);
        assert!(!f.prepare_sleep());
        b.push(&ResponseSlot { id: 1, generation: 5, ..Default::default() }).unwrap();
        assert!(!b.publish());
        assert_eq!(f.pop_response().unwrap().unwrap().id, 1);
    }

    #[test]
    fn sleep_handshake_over_shared_memory() {
        let (mut f, b) = pair(8);
        assert!(!b.prepare_sleep(), "empty ring: driver may sleep");
        f.push(&req(1)).unwrap();
        assert!(f.publish(), "driver asleep: frontend must ring");
        f.push(&req(2)).unwrap();
        assert!(!f.publish(), "already rung for this sleep");
        assert!(b.prepare_sleep(), "work pending: driver must not sleep");
        b.set_running();
    }
}
