//! One domain, many clients: which view each queue serves, and how much of a turn it gets.
//!
//! A queue that serves a view sees only the view: its ring validates requests against the
//! view's size, and here each request is moved by the view's offset and refused if it would
//! write a read-only view. Queues are grouped by view (the device's own queues are one group
//! more); a group with caps starts requests only while it has credit
//! ([`bulkhead_qos::Bucket`]), and every queue takes its turn by deficit round robin in bytes
//! ([`bulkhead_qos::Deficit`]) by its group's weight. The caps are read from the domain's
//! state page when the supervisor changes them; the credit and what each view was served are
//! written back there for `status`.

use bulkhead_filters::state::StatePage;
use bulkhead_qos::{page, Bucket, Caps, Deficit};
use bulkhead_ring::Op;
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
}

/// The queues' views and their shares of the domain.
#[derive(Debug)]
pub(crate) struct Sharing {
    lanes: Vec<Lane>,
    groups: Vec<Group>,
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
            .map(|view| Group { view, caps: Caps::default(), bucket: None, seq: 0, served_bytes: 0, served_ios: 0, waits: 0 })
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
        let mut s = Sharing { lanes: out, groups };
        s.set_quanta();
        Ok(s)
    }

    /// Gives each queue its quantum: its group's weight shared among the group's queues.
    fn set_quanta(&mut self) {
        for i in 0..self.lanes.len() {
            let g = self.lanes[i].group;
            let n = self.lanes.iter().filter(|l| l.group == g).count();
            self.lanes[i].deficit = Deficit::new(self.groups[g].caps.weight, n);
        }
    }

    /// Whether a view has a cap: the turns then need the clock.
    pub(crate) fn timed(&self) -> bool {
        self.groups.iter().any(|g| g.bucket.is_some())
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
                return Turn::NoCredit(b.ready_at(now));
            }
        }
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
        let g = &mut self.groups[lane.group];
        let ready = g.bucket.as_mut().is_none_or(|b| b.ready(now));
        if !ready {
            g.waits += 1;
        }
        ready
    }

    /// Takes the cost of a request queue `qi` starts.
    pub(crate) fn charge(&mut self, qi: usize, op: Op, len: u64) {
        let bytes = if matches!(op, Op::Read | Op::Write) { len } else { 0 };
        let lane = &mut self.lanes[qi];
        lane.deficit.charge(bytes);
        let g = &mut self.groups[lane.group];
        if let Some(b) = &mut g.bucket {
            b.charge(bytes);
        }
        g.served_bytes += bytes;
        g.served_ios += 1;
    }

    /// Queue `qi` had nothing more to start.
    pub(crate) fn emptied(&mut self, qi: usize) {
        self.lanes[qi].deficit.emptied();
    }

    /// Whether queue `qi`'s view is out of credit now (it may sleep with requests pending:
    /// the credit, not a doorbell, wakes it).
    pub(crate) fn starved(&mut self, qi: usize, now: u64) -> Option<u64> {
        let g = &mut self.groups[self.lanes[qi].group];
        let b = g.bucket.as_mut()?;
        (!b.ready(now)).then(|| b.ready_at(now))
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
