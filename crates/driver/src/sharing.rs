//! One domain, many clients: which view each queue serves, and how much of a turn it gets.
//!
//! A queue that serves a view sees only the view: its ring validates requests against the
//! view's size, and here each request is moved by the view's offset and refused if it would
//! write a read-only view. Queues are grouped by view (the device's own queues are one group
//! more); a group with caps starts requests only while it has credit
//! ([`bulkhead_qos::Bucket`]), and every queue takes its turn by deficit round robin in bytes
//! ([`bulkhead_qos::Deficit`]) by its group's weight. When the uncapped groups' weights differ,
//! a lighter group is also held back while a heavier one is active ([`bulkhead_qos::Shares`]).
//! The caps are read from the domain's state page when the supervisor changes them; the
//! credit and what each view was served are written back there for `status`.

use bulkhead_block::Op;
use bulkhead_filters::state::StatePage;
use bulkhead_qos::{page, Bucket, Caps, Deficit, Shares};
use bulkhead_spec::ViewSpec;

/// What a queue serves.
#[derive(Debug, Clone, Copy)]
struct Lane {
    /// The view's offset in the device (0 for the device's own queues).
    base: u64,
    read_only: bool,
    /// Index into `Sharing::groups`.
    group: usize,
    deficit: Deficit,
}

/// A view (or the device's own queues) and its credit.
#[derive(Debug)]
struct Group {
    /// Its block in the state page (`None`: the device's own queues).
    view: Option<usize>,
    /// Its caps (the device's own queues: none, weight 1).
    caps: Caps,
    /// Its credit, when a cap is set.
    bucket: Option<Bucket>,
    /// The caps' sequence number last read from the page.
    seq: u64,
    served_bytes: u64,
    served_ios: u64,
    waits: u64,
    /// Since when its requests have been held back (0: they are not).
    held_since: u64,
    /// Time its requests were held back for credit or behind a heavier view, ns.
    held_ns: u64,
}

impl Group {
    /// Notes at `now` whether the group's requests are held back.
    fn hold(&mut self, held: bool, now: u64) {
        if now == 0 {
            // Untimed turns (no cap, equal weights) hold nothing back.
            self.held_since = 0;
            return;
        }
        match (held, self.held_since) {
            (true, 0) => self.held_since = now.max(1),
            (false, since) if since != 0 => {
                self.held_ns += now.saturating_sub(since);
                self.held_since = 0;
            }
            _ => {}
        }
    }
}

/// The queues' views and their shares of the domain.
#[derive(Debug)]
pub(crate) struct Sharing {
    lanes: Vec<Lane>,
    groups: Vec<Group>,
    /// Proportional shares of the uncapped groups, by index into `groups`.
    shares: Shares,
}

/// Whether a queue may start requests in this turn.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Turn {
    /// It may.
    Open,
    /// Its view has no credit until the given time (ns).
    NoCredit(u64),
    /// Its share of the round is spent.
    Spent,
    /// A heavier view is active: its view is held back until the given time (ns) at most.
    Behind(u64),
}

impl Sharing {
    /// The sharing of queues that serve `lanes` (`None`: the device) of `views`, with caps
    /// from `page` (none without one) at `now`. Checks every view lies within `device_size`.
    pub(crate) fn new(
        views: &[ViewSpec],
        lanes: &[Option<u32>],
        device_size: u64,
        page: Option<&StatePage>,
        now: u64,
    ) -> Result<Sharing, String> {
        if views.len() > page::MAX_VIEWS {
            return Err(format!("{} views; a domain serves at most {}", views.len(), page::MAX_VIEWS));
        }
        for v in views {
            if v.offset.checked_add(v.size).is_none_or(|end| end > device_size) || v.size == 0 {
                return Err(format!(
                    "view `{}`: {} bytes at {} do not lie within the device ({device_size} bytes)",
                    v.name, v.size, v.offset
                ));
            }
        }
        let mut groups: Vec<Group> = std::iter::once(None)
            .chain((0..views.len()).map(Some))
            .map(|view| Group {
                view,
                caps: Caps::default(),
                bucket: None,
                seq: 0,
                served_bytes: 0,
                served_ios: 0,
                waits: 0,
                held_since: 0,
                held_ns: 0,
            })
            .collect();
        let mut out = Vec::with_capacity(lanes.len());
        for l in lanes {
            let (base, read_only, group) = match *l {
                None => (0, false, 0),
                Some(v) => {
                    let view = views.get(v as usize).ok_or_else(|| format!("a queue names view {v}, which is not given"))?;
                    (view.offset, view.read_only, v as usize + 1)
                }
            };
            out.push(Lane { base, read_only, group, deficit: Deficit::default() });
        }
        if let Some(p) = page {
            for g in &mut groups {
                read_caps(g, p, now);
            }
        }
        let shares = Shares::new(groups.len());
        let mut s = Sharing { lanes: out, groups, shares };
        s.set_quanta();
        Ok(s)
    }

    /// Gives each queue its quantum (its group's weight shared among the group's queues),
    /// and each uncapped group its weight among the others.
    fn set_quanta(&mut self) {
        for (gi, g) in self.groups.iter().enumerate() {
            self.shares.set_weight(gi, (!g.caps.capped()).then_some(g.caps.weight));
        }
        for i in 0..self.lanes.len() {
            let g = self.lanes[i].group;
            let n = self.lanes.iter().filter(|l| l.group == g).count();
            self.lanes[i].deficit = Deficit::new(self.groups[g].caps.weight, n);
        }
    }

    /// Whether a view has a cap, or the weights differ: the turns then need the clock.
    pub(crate) fn timed(&self) -> bool {
        self.shares.on() || self.groups.iter().any(|g| g.bucket.is_some())
    }

    /// The offset queue `qi`'s requests are moved by.
    pub(crate) fn base(&self, qi: usize) -> u64 {
        self.lanes[qi].base
    }

    /// Whether queue `qi` may not write.
    pub(crate) fn read_only(&self, qi: usize) -> bool {
        self.lanes[qi].read_only
    }

    /// Starts queue `qi`'s turn at `now`: reads its view's caps if the supervisor changed
    /// them, and says whether the queue may start requests.
    pub(crate) fn begin(&mut self, qi: usize, page: Option<&StatePage>, now: u64) -> Turn {
        let gi = self.lanes[qi].group;
        if let Some(p) = page {
            if read_caps(&mut self.groups[gi], p, now) {
                self.set_quanta();
            }
        }
        if let Some(b) = &mut self.groups[gi].bucket {
            if !b.ready(now) {
                let at = b.ready_at(now);
                self.groups[gi].hold(true, now);
                return Turn::NoCredit(at);
            }
        }
        if let Err(until) = self.shares.admit(gi, now) {
            self.groups[gi].hold(true, now);
            return Turn::Behind(until);
        }
        self.groups[gi].hold(false, now);
        if self.lanes[qi].deficit.begin_turn() {
            Turn::Open
        } else {
            Turn::Spent
        }
    }

    /// Whether queue `qi` may start another request in this turn.
    pub(crate) fn may_start(&mut self, qi: usize, now: u64) -> bool {
        let lane = &self.lanes[qi];
        if !lane.deficit.may_start() {
            return false;
        }
        let gi = lane.group;
        let g = &mut self.groups[gi];
        let ready = g.bucket.as_mut().is_none_or(|b| b.ready(now)) && self.shares.admit(gi, now).is_ok();
        if !ready {
            g.waits += 1;
        }
        g.hold(!ready, now);
        ready
    }

    /// Takes the cost of a request queue `qi` starts at `now` (0 when the turns are not
    /// timed).
    pub(crate) fn charge(&mut self, qi: usize, op: Op, len: u64, now: u64) {
        let bytes = if matches!(op, Op::Read | Op::Write) { len } else { 0 };
        let lane = &mut self.lanes[qi];
        lane.deficit.charge(bytes);
        let gi = lane.group;
        let g = &mut self.groups[gi];
        if let Some(b) = &mut g.bucket {
            b.charge(bytes);
        }
        g.served_bytes += bytes;
        g.served_ios += 1;
        self.shares.start(gi, bytes, now);
    }

    /// A request queue `qi` started was answered at `now` (0 when the turns are not timed).
    pub(crate) fn finished(&mut self, qi: usize, now: u64) {
        self.shares.finish(self.lanes[qi].group, now);
    }

    /// Queue `qi` had nothing more to start.
    pub(crate) fn emptied(&mut self, qi: usize) {
        self.lanes[qi].deficit.emptied();
        self.shares.emptied(self.lanes[qi].group);
    }

    /// Whether queue `qi`'s view is out of credit, or held behind a heavier view, now, and
    /// until when: it may then sleep with requests pending, since the credit or the time, not
    /// a doorbell, lets it go on.
    pub(crate) fn starved(&mut self, qi: usize, now: u64) -> Option<u64> {
        let gi = self.lanes[qi].group;
        if let Some(b) = self.groups[gi].bucket.as_mut() {
            if !b.ready(now) {
                return Some(b.ready_at(now));
            }
        }
        self.shares.admit(gi, now).err()
    }

    /// Writes each view's credit and what it was served to `page`.
    pub(crate) fn report(&self, page: &StatePage) {
        for g in &self.groups {
            let Some(v) = g.view else { continue };
            let (bytes, ios) = g.bucket.as_ref().map_or((0, 0), Bucket::credit);
            page.set(page::slot(v, page::CREDIT_BYTES), bytes as u64);
            page.set(page::slot(v, page::CREDIT_IOS), ios as u64);
            page.set(page::slot(v, page::SERVED_BYTES), g.served_bytes);
            page.set(page::slot(v, page::SERVED_IOS), g.served_ios);
            page.set(page::slot(v, page::WAITS), g.waits);
            page.set(page::slot(v, page::HELD_NS), g.held_ns);
        }
    }
}

/// Reads group `g`'s caps from `p` if their sequence number moved and they are whole; returns
/// whether they changed. A page the domain could not make sense of leaves the caps as they were.
fn read_caps(g: &mut Group, p: &StatePage, now: u64) -> bool {
    let Some(v) = g.view else { return false };
    let seq = p.get(page::slot(v, page::SEQ));
    if seq == g.seq || seq % 2 == 1 {
        return false;
    }
    let mut slots = [0u64; page::CAP_SLOTS];
    for (i, s) in slots.iter_mut().enumerate() {
        *s = p.get(page::slot(v, page::CAPS + i));
    }
    std::sync::atomic::fence(std::sync::atomic::Ordering::Acquire);
    if p.get(page::slot(v, page::SEQ)) != seq {
        return false;
    }
    g.seq = seq;
    let Some(caps) = Caps::from_slots(slots) else { return false };
    apply(g, caps, now);
    true
}

fn apply(g: &mut Group, caps: Caps, now: u64) {
    if caps.capped() {
        match &mut g.bucket {
            Some(b) => b.set_caps(caps, now),
            None => g.bucket = Some(Bucket::new(caps, now)),
        }
    } else {
        g.bucket = None;
    }
    g.caps = caps;
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    fn view(name: &str, offset: u64) -> ViewSpec {
        ViewSpec { name: name.into(), offset, size: 1 << 20, read_only: false }
    }

    fn set_weight(p: &StatePage, v: usize, weight: u32, seq: u64) {
        let caps = Caps { weight, ..Caps::default() };
        for (i, s) in caps.to_slots().into_iter().enumerate() {
            p.set(page::slot(v, page::CAPS + i), s);
        }
        p.set(page::slot(v, page::SEQ), seq);
    }

    /// The domain's turns for two views, a microsecond each: view 0's client keeps one 4 KiB
    /// read in flight and sends the next 2 µs after each answer, view 1's always has requests
    /// waiting. Returns what each was served in `ms` and how often view 1 started a batch.
    fn run(s: &mut Sharing, p: &StatePage, ms: u64) -> ([u64; 2], u64) {
        let (mut served, mut batches, mut next0) = ([0u64; 2], 0u64, 0u64);
        for now in (1..ms * 1000).map(|us| us * 1000) {
            if now >= next0 && s.begin(0, Some(p), now) == Turn::Open && s.may_start(0, now) {
                s.charge(0, Op::Read, 4096, now);
                s.finished(0, now + 1000);
                served[0] += 4096;
                next0 = now + 3000;
            }
            if s.begin(1, Some(p), now) == Turn::Open {
                batches += 1;
                while s.may_start(1, now) {
                    s.charge(1, Op::Write, 4096, now);
                    s.finished(1, now);
                    served[1] += 4096;
                }
            } else {
                assert!(s.starved(1, now).is_some(), "a view held back is not woken by its doorbell");
            }
        }
        (served, batches)
    }

    #[test]
    fn a_heavier_view_with_one_request_in_flight_keeps_its_share() {
        let fd = bulkhead_shmem::memfd::create("state", bulkhead_filters::state::STATE_BYTES as u64).unwrap();
        let p = StatePage::map(fd.as_raw_fd(), true).unwrap();
        set_weight(&p, 0, 32, 2);
        let views = [view("quiet", 0), view("noisy", 1 << 20)];
        let mut s = Sharing::new(&views, &[Some(0), Some(1)], 2 << 20, Some(&p), 0).unwrap();
        assert!(s.timed());
        let ([quiet, noisy], batches) = run(&mut s, &p, 100);
        let ratio = quiet as f64 / noisy as f64;
        assert!((24.0..=40.0).contains(&ratio), "served {quiet} : {noisy}");
        // Held back, the lighter view goes on in whole batches (32 requests), not one at a time.
        assert!(noisy / 4096 >= batches * 16, "{} requests in {batches} batches", noisy / 4096);

        // Equal weights again (set on the running view): nothing is held back, and the turns
        // need no clock.
        set_weight(&p, 0, 1, 4);
        s.begin(0, Some(&p), 0);
        assert!(!s.timed());
        let ([quiet, noisy], _) = run(&mut s, &p, 10);
        assert!(noisy > 10 * quiet, "served {quiet} : {noisy}");
    }
}
