//! Sharing one driver domain among its clients (section 5.4 of Fraser et al., "Safe Hardware Access
//! with the Xen Virtual Machine Monitor").
//!
//! A domain serves several *views* of its device — each an offset and size with channels of
//! its own — and takes their queues round-robin in batches. This crate decides how much of a
//! turn each view gets:
//!
//! - [`Caps`]: what the operator set on a view: credits of `credit_bytes` every `credit_us`
//!   µs with a burst, an IOPS cap with a burst, or, with neither cap, a weight;
//! - [`Bucket`]: the credit state of a capped view, refilled by the clock;
//! - [`Deficit`]: proportional sharing among uncapped views (deficit round robin, in bytes):
//!   work-conserving, since an idle view's turns go to the busy ones;
//! - [`Shares`]: when weights differ, a lighter view held back while a heavier one is active,
//!   so a weight protects a client with one request in flight;
//! - [`page`]: where the caps and the credit state live in the domain's state page, so the
//!   supervisor can change a running view's caps and report its credits.
//!
//! No I/O and no clock of its own: callers pass the time in nanoseconds.
#![forbid(unsafe_code)]
#![deny(missing_docs)]

use serde::{Deserialize, Serialize};

/// Weight of a view, or of the device's own queues, when none is set.
pub const DEFAULT_WEIGHT: u32 = 1;

/// Largest weight.
pub const MAX_WEIGHT: u32 = 1000;

/// Bytes a weight of 1 earns per round of the domain's loop under [`Deficit`].
pub const QUANTUM_BYTES: i64 = 128 << 10;

/// The QoS of one view.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Caps {
    /// Bytes of credit granted every `credit_us` (0: no byte cap).
    pub credit_bytes: u64,
    /// The credit period, µs.
    pub credit_us: u64,
    /// Most byte credit a view may save up (its burst); at least `credit_bytes`.
    pub burst_bytes: u64,
    /// Requests per second (0: no IOPS cap).
    pub iops: u64,
    /// Most request credit a view may save up.
    pub burst_ios: u64,
    /// Share of the device among uncapped views, 1..=[`MAX_WEIGHT`].
    pub weight: u32,
}

impl Default for Caps {
    fn default() -> Self {
        Caps { credit_bytes: 0, credit_us: 1000, burst_bytes: 0, iops: 0, burst_ios: 0, weight: DEFAULT_WEIGHT }
    }
}

/// The keys [`Caps::set`] takes, as the configuration spells them.
pub const KEYS: [&str; 6] = ["credit_bytes", "credit_us", "burst_bytes", "iops", "burst_ios", "weight"];

impl Caps {
    /// Whether a byte or an IOPS cap is set.
    pub fn capped(&self) -> bool {
        self.credit_bytes > 0 || self.iops > 0
    }

    /// Bytes per second the byte cap allows (0: none).
    pub fn bytes_per_sec(&self) -> f64 {
        if self.credit_bytes == 0 || self.credit_us == 0 {
            return 0.0;
        }
        self.credit_bytes as f64 * 1e6 / self.credit_us as f64
    }

    /// Fills in the bursts left at 0: one period's credit, and a tenth of a second's requests
    /// (at least one).
    pub fn with_default_bursts(mut self) -> Caps {
        if self.credit_bytes > 0 && self.burst_bytes == 0 {
            self.burst_bytes = self.credit_bytes;
        }
        if self.iops > 0 && self.burst_ios == 0 {
            self.burst_ios = (self.iops / 10).max(1);
        }
        self
    }

    /// Checks the caps hang together; the error names the key.
    pub fn check(&self) -> Result<(), String> {
        if self.credit_bytes > 0 && !(1..=60_000_000).contains(&self.credit_us) {
            return Err(format!("key `credit_us`: {} is out of range 1..=60000000", self.credit_us));
        }
        if self.credit_bytes > 0 && self.burst_bytes < self.credit_bytes {
            return Err(format!(
                "key `burst_bytes`: {} is less than one period's credit (credit_bytes = {})",
                self.burst_bytes, self.credit_bytes
            ));
        }
        if self.credit_bytes == 0 && self.burst_bytes > 0 {
            return Err("key `burst_bytes`: set without `credit_bytes`".into());
        }
        if self.iops == 0 && self.burst_ios > 0 {
            return Err("key `burst_ios`: set without `iops`".into());
        }
        if !(1..=MAX_WEIGHT).contains(&self.weight) {
            return Err(format!("key `weight`: {} is out of range 1..={MAX_WEIGHT}", self.weight));
        }
        if self.capped() && self.weight != DEFAULT_WEIGHT {
            return Err("key `weight`: a view with a cap (credit_bytes or iops) takes no weight".into());
        }
        Ok(())
    }

    /// Sets one key from its text (a size with a K/M/G suffix for the byte keys; `0` or
    /// `none` lifts a cap); the error names the key. [`check`](Self::check) the result.
    pub fn set(&mut self, key: &str, value: &str) -> Result<(), String> {
        let v = value.trim();
        let number = |v: &str| -> Result<u64, String> {
            if v.eq_ignore_ascii_case("none") {
                return Ok(0);
            }
            v.parse::<u64>().map_err(|_| format!("key `{key}`: `{value}` is not a whole number"))
        };
        let bytes = |v: &str| -> Result<u64, String> {
            if v.eq_ignore_ascii_case("none") {
                return Ok(0);
            }
            parse_size(v).map_err(|e| format!("key `{key}`: {e}"))
        };
        match key {
            "credit_bytes" => {
                // A burst left at its default follows the new credit.
                if self.burst_bytes == self.credit_bytes {
                    self.burst_bytes = 0;
                }
                self.credit_bytes = bytes(v)?;
                if self.credit_bytes == 0 {
                    self.burst_bytes = 0;
                }
            }
            "credit_us" => self.credit_us = number(v)?,
            "burst_bytes" => self.burst_bytes = bytes(v)?,
            "iops" => {
                if self.iops > 0 && self.burst_ios == (self.iops / 10).max(1) {
                    self.burst_ios = 0;
                }
                self.iops = number(v)?;
                if self.iops == 0 {
                    self.burst_ios = 0;
                }
            }
            "burst_ios" => self.burst_ios = number(v)?,
            "weight" => self.weight = u32::try_from(number(v)?).map_err(|_| format!("key `weight`: `{value}` is too large"))?,
            _ => return Err(format!("unknown key `{key}` (one of {})", KEYS.join(", "))),
        }
        Ok(())
    }

    /// The caps as the page holds them (see [`page`]).
    pub fn to_slots(&self) -> [u64; page::CAP_SLOTS] {
        [self.credit_bytes, self.credit_us, self.burst_bytes, self.iops, self.burst_ios, u64::from(self.weight)]
    }

    /// Caps read back from the page, if they are whole: the page is shared with a domain.
    pub fn from_slots(s: [u64; page::CAP_SLOTS]) -> Option<Caps> {
        let c = Caps {
            credit_bytes: s[0],
            credit_us: s[1],
            burst_bytes: s[2],
            iops: s[3],
            burst_ios: s[4],
            weight: u32::try_from(s[5]).ok()?,
        };
        c.check().ok().map(|_| c)
    }
}

impl std::fmt::Display for Caps {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut parts = Vec::new();
        if self.credit_bytes > 0 {
            parts.push(format!(
                "{} B every {} µs ({:.1} MiB/s, burst {} B)",
                self.credit_bytes,
                self.credit_us,
                self.bytes_per_sec() / (1 << 20) as f64,
                self.burst_bytes
            ));
        }
        if self.iops > 0 {
            parts.push(format!("{} IOPS (burst {})", self.iops, self.burst_ios));
        }
        if parts.is_empty() {
            parts.push(format!("weight {}", self.weight));
        }
        f.write_str(&parts.join(", "))
    }
}

/// Parses "1G", "512M", "4096", "64k" (powers of 1024).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let (num, mul) = match t.char_indices().find(|(_, c)| !c.is_ascii_digit()) {
        None => (t, 1u64),
        Some((i, _)) => {
            let mul = match t[i..].to_ascii_uppercase().trim_end_matches("IB").trim_end_matches('B') {
                "" => 1,
                "K" => 1 << 10,
                "M" => 1 << 20,
                "G" => 1 << 30,
                "T" => 1 << 40,
                _ => return Err(format!("invalid size `{s}` (use bytes or a K, M, G, T suffix)")),
            };
            (&t[..i], mul)
        }
    };
    let n: u64 = num.parse().map_err(|_| format!("invalid size `{s}`"))?;
    n.checked_mul(mul).ok_or_else(|| format!("size `{s}` is too large"))
}

/// The credit state of a capped view: byte and request credit, refilled with time up to the
/// bursts. A view may start a request while it has any byte credit left and a whole request's
/// credit; the request's bytes are then taken in full, so a large request leaves a debt the
/// refill pays back before the next.
#[derive(Debug, Clone)]
pub struct Bucket {
    caps: Caps,
    bytes: f64,
    ios: f64,
    /// When request credit was last added (it accrues continuously).
    at: u64,
    /// When the last byte grant was made: bytes come `credit_bytes` at a time, every
    /// `credit_us`.
    granted_at: u64,
}

impl Bucket {
    /// A bucket for `caps`, full, at `now` (ns).
    pub fn new(caps: Caps, now: u64) -> Bucket {
        let caps = caps.with_default_bursts();
        Bucket { caps, bytes: caps.burst_bytes as f64, ios: caps.burst_ios as f64, at: now, granted_at: now }
    }

    /// The caps in force.
    pub fn caps(&self) -> Caps {
        self.caps
    }

    /// Changes the caps at `now`: credit saved is kept up to the new bursts.
    pub fn set_caps(&mut self, caps: Caps, now: u64) {
        self.refill(now);
        let caps = caps.with_default_bursts();
        let fresh = |had: u64, burst: u64, v: f64| if had == 0 { burst as f64 } else { v.min(burst as f64) };
        self.bytes = fresh(self.caps.credit_bytes, caps.burst_bytes, self.bytes);
        self.ios = fresh(self.caps.iops, caps.burst_ios, self.ios);
        self.caps = caps;
    }

    fn period_ns(&self) -> u64 {
        self.caps.credit_us.max(1) * 1000
    }

    fn refill(&mut self, now: u64) {
        let dt = now.saturating_sub(self.at) as f64;
        self.at = self.at.max(now);
        // Whole grants, as Xen's credits are: a view held back wakes its client once per
        // period with a period's worth, not once per request.
        if self.caps.credit_bytes > 0 {
            let n = now.saturating_sub(self.granted_at) / self.period_ns();
            if n > 0 {
                self.bytes = (self.bytes + n as f64 * self.caps.credit_bytes as f64).min(self.caps.burst_bytes as f64);
                self.granted_at += n * self.period_ns();
            }
        }
        if self.caps.iops > 0 {
            self.ios = (self.ios + dt * self.caps.iops as f64 / 1e9).min(self.caps.burst_ios as f64);
        }
    }

    /// Whether the view may start a request at `now`.
    pub fn ready(&mut self, now: u64) -> bool {
        self.refill(now);
        (self.caps.credit_bytes == 0 || self.bytes > 0.0) && (self.caps.iops == 0 || self.ios >= 1.0)
    }

    /// Takes the cost of a request moving `bytes` of data.
    pub fn charge(&mut self, bytes: u64) {
        if self.caps.credit_bytes > 0 {
            self.bytes -= bytes as f64;
        }
        if self.caps.iops > 0 {
            self.ios -= 1.0;
        }
    }

    /// When (ns) the view may start its next request: `now` if it may already.
    pub fn ready_at(&mut self, now: u64) -> u64 {
        self.refill(now);
        let mut wait = 0.0f64;
        if self.caps.credit_bytes > 0 && self.bytes <= 0.0 {
            let grants = (-self.bytes / self.caps.credit_bytes as f64).floor() as u64 + 1;
            let at = self.granted_at + grants * self.period_ns();
            wait = wait.max(at.saturating_sub(now) as f64);
        }
        if self.caps.iops > 0 && self.ios < 1.0 {
            wait = wait.max((1.0 - self.ios) * 1e9 / self.caps.iops as f64);
        }
        now + wait.ceil() as u64
    }

    /// Byte and request credit now (negative: a debt).
    pub fn credit(&self) -> (i64, i64) {
        (self.bytes as i64, self.ios as i64)
    }
}

/// Deficit round robin in bytes for one queue: each round of the domain's loop earns the
/// queue its quantum, each request it starts costs its bytes (at least one page, so requests
/// with no data are not free), and a queue found empty forgets what it saved.
#[derive(Debug, Clone, Copy, Default)]
pub struct Deficit {
    quantum: i64,
    saved: i64,
}

/// Least a request costs under [`Deficit`].
const MIN_COST: u64 = 4096;

impl Deficit {
    /// A queue earning `weight` quanta per round, shared among `queues` queues of its view.
    pub fn new(weight: u32, queues: usize) -> Deficit {
        let q = QUANTUM_BYTES * i64::from(weight.max(1)) / queues.max(1) as i64;
        Deficit { quantum: q.max(MIN_COST as i64), saved: 0 }
    }

    /// Starts the queue's turn: whether it may start requests in it.
    pub fn begin_turn(&mut self) -> bool {
        self.saved = (self.saved + self.quantum).min(self.quantum);
        self.saved > 0
    }

    /// Whether the queue may start another request in this turn.
    pub fn may_start(&self) -> bool {
        self.saved > 0
    }

    /// Takes a request's cost.
    pub fn charge(&mut self, bytes: u64) {
        self.saved -= bytes.max(MIN_COST) as i64;
    }

    /// The queue had nothing more to start: an idle queue saves nothing up.
    pub fn emptied(&mut self) {
        self.saved = self.saved.min(0);
    }
}

/// How long a view counts as active after its last answer, when weights differ ([`Shares`]):
/// longer than a scheduler time slice, so a client whose thread waits for its CPU between
/// two requests still counts.
pub const ACTIVE_NS: u64 = 3_000_000;

/// Proportional sharing across views whose weights differ, with anticipation.
///
/// [`Deficit`] shares the turns of one round among the queues that have requests. A view with
/// one request in flight at a time (a QD1 reader) never has more than one, so a round gives it
/// one request whatever its weight, and a lighter view with a deep queue takes the rest:
/// the weight protects nothing. Here each view has a virtual time, the bytes it was served
/// divided by its weight, and a view may start a request only while its virtual time is at
/// most one quantum ahead of the least among the other *active* views; once held back, only
/// when it is level with it again, so it goes on with a batch.
///
/// A view is active while it has requests in flight, and for [`ACTIVE_NS`] after its last
/// answer: long enough for its client to send the next request even if its thread first
/// waits out another's time slice. (With a shorter window, a reader that lost its CPU to the
/// neighbour's thread counted as idle, the neighbour went free, and its busier thread took
/// the reader's CPU more.) A lighter view is so held back while a heavier one is between
/// requests, as BFQ idles for a synchronous queue; once the heavier view has been quiet for
/// [`ACTIVE_NS`], the lighter one has the device to itself again (work-conserving beyond
/// that window). A view coming back from idle starts at the least active virtual time, so
/// idling earns it no credit.
///
/// With equal weights nothing is held: turns are shared round robin only. Capped views take
/// no part (their buckets set their rate).
#[derive(Debug, Clone, Default)]
pub struct Shares {
    views: Vec<ShareState>,
    /// Whether the weights of the views taking part differ.
    on: bool,
}

#[derive(Debug, Clone, Copy, Default)]
struct ShareState {
    /// `None`: the view has a cap and takes no part.
    weight: Option<u32>,
    /// Bytes served × [`MAX_WEIGHT`] / weight.
    vt: u64,
    in_flight: u64,
    /// When it last started a request or had one answered (ns).
    last: u64,
    /// Whether it was held back since it last started a request.
    held: bool,
}

impl ShareState {
    fn active(&self, now: u64) -> bool {
        self.in_flight > 0 || self.held || now.saturating_sub(self.last) < ACTIVE_NS
    }
}

/// How far (in virtual time) a view may run ahead of the least active one: one quantum.
const LEAD: u64 = QUANTUM_BYTES as u64 * MAX_WEIGHT as u64;

impl Shares {
    /// Sharing among `n` views, none of them capped, all of weight 1.
    pub fn new(n: usize) -> Shares {
        Shares { views: vec![ShareState { weight: Some(DEFAULT_WEIGHT), ..Default::default() }; n], on: false }
    }

    /// Sets view `v`'s weight (`None`: it has a cap and takes no part).
    pub fn set_weight(&mut self, v: usize, weight: Option<u32>) {
        self.views[v].weight = weight.map(|w| w.clamp(1, MAX_WEIGHT));
        let mut ws = self.views.iter().filter_map(|s| s.weight);
        let first = ws.next();
        let was = std::mem::replace(&mut self.on, ws.any(|w| Some(w) != first));
        if self.on && !was {
            // Virtual time is not kept while weights are equal: all start level.
            for s in &mut self.views {
                s.vt = 0;
                s.held = false;
            }
        }
    }

    /// Whether weights differ, so views may be held back (and the clock is needed).
    pub fn on(&self) -> bool {
        self.on
    }

    /// Whether view `v` may start a request at `now`; if not, `Err` with when (ns) the views
    /// holding it back stop counting as active unless they send more.
    pub fn admit(&mut self, v: usize, now: u64) -> Result<(), u64> {
        if !self.on || self.views[v].weight.is_none() {
            return Ok(());
        }
        let mut least = None::<u64>;
        for (i, s) in self.views.iter().enumerate() {
            if i != v && s.weight.is_some() && s.active(now) {
                least = Some(least.map_or(s.vt, |l| l.min(s.vt)));
            }
        }
        let Some(least) = least else { return Ok(()) };
        let me = &mut self.views[v];
        if !me.active(now) {
            me.vt = me.vt.max(least);
        }
        // Held back, a view goes on only once it is level again, then with a whole lead: its
        // client is woken for a batch, not for a request at a time.
        let limit = if me.held { least } else { least.saturating_add(LEAD) };
        if me.vt <= limit {
            return Ok(());
        }
        me.held = true;
        let vt = me.vt;
        let until = self
            .views
            .iter()
            .enumerate()
            .filter(|&(i, s)| i != v && s.weight.is_some() && s.active(now) && s.vt < vt)
            .map(|(_, s)| if s.in_flight > 0 { now + ACTIVE_NS } else { s.last + ACTIVE_NS })
            .max()
            .unwrap_or(now);
        Err(until)
    }

    /// View `v` started a request moving `bytes` of data at `now`.
    pub fn start(&mut self, v: usize, bytes: u64, now: u64) {
        let s = &mut self.views[v];
        if let (true, Some(w)) = (self.on, s.weight) {
            s.vt = s.vt.saturating_add(bytes.max(MIN_COST) * u64::from(MAX_WEIGHT) / u64::from(w));
        }
        s.in_flight += 1;
        s.last = now;
        s.held = false;
    }

    /// A request of view `v` was answered at `now`.
    pub fn finish(&mut self, v: usize, now: u64) {
        let s = &mut self.views[v];
        s.in_flight = s.in_flight.saturating_sub(1);
        s.last = s.last.max(now);
    }

    /// View `v` has nothing waiting any more: it no longer holds its place.
    pub fn emptied(&mut self, v: usize) {
        self.views[v].held = false;
    }
}

/// Where the views' caps and credit live in the domain's state page (`u64` slots).
///
/// The supervisor writes a view's caps and then bumps its sequence number (odd while it
/// writes); the domain reads them when the number changes and writes back its credit and what
/// it served, which the supervisor shows as untrusted numbers.
pub mod page {
    /// Slot of the first view's block.
    pub const BASE: usize = 16;
    /// Slots per view.
    pub const STRIDE: usize = 16;
    /// Views one page holds.
    pub const MAX_VIEWS: usize = (512 - BASE) / STRIDE;
    /// Slots the caps take.
    pub const CAP_SLOTS: usize = 6;
    /// The sequence number (even: caps whole; odd: being written).
    pub const SEQ: usize = 0;
    /// The first cap slot ([`super::Caps::to_slots`]).
    pub const CAPS: usize = 1;
    /// Byte credit (an `i64`), written by the domain.
    pub const CREDIT_BYTES: usize = 8;
    /// Request credit (an `i64`), written by the domain.
    pub const CREDIT_IOS: usize = 9;
    /// Bytes the domain served for the view.
    pub const SERVED_BYTES: usize = 10;
    /// Requests the domain served for the view.
    pub const SERVED_IOS: usize = 11;
    /// Times a request of the view waited, for credit or behind a heavier view.
    pub const WAITS: usize = 12;
    /// Time the view's requests were held back, for credit or behind a heavier view, ns.
    pub const HELD_NS: usize = 13;

    /// The page slot of `field` for view `view`.
    pub fn slot(view: usize, field: usize) -> usize {
        assert!(view < MAX_VIEWS && field < STRIDE, "view {view} field {field} outside the page");
        BASE + view * STRIDE + field
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    fn caps(spec: &[(&str, &str)]) -> Caps {
        let mut c = Caps::default();
        for (k, v) in spec {
            c.set(k, v).unwrap();
        }
        let c = c.with_default_bursts();
        c.check().unwrap();
        c
    }

    #[test]
    fn a_byte_cap_admits_its_rate_over_time() {
        // 50 MiB/s as 51200 bytes every 1000 µs.
        let c = caps(&[("credit_bytes", "51200"), ("credit_us", "1000")]);
        let mut b = Bucket::new(c, 0);
        let (mut now, mut moved) = (0u64, 0u64);
        while now < 10_000 * MS {
            if b.ready(now) {
                b.charge(4096);
                moved += 4096;
            } else {
                now = b.ready_at(now);
            }
        }
        let rate = moved as f64 / 10.0;
        let want = 51200.0 * 1000.0;
        assert!((rate - want).abs() / want < 0.01, "rate {rate} want {want}");
    }

    #[test]
    fn bytes_come_a_period_at_a_time() {
        let c = caps(&[("credit_bytes", "64K"), ("credit_us", "1000")]);
        let mut b = Bucket::new(c, 0);
        b.charge(64 << 10);
        assert!(!b.ready(999_999));
        assert_eq!(b.ready_at(500_000), MS);
        assert!(b.ready(MS));
        assert_eq!(b.credit().0, 64 << 10);
    }

    #[test]
    fn an_iops_cap_admits_its_rate_and_a_burst_at_once() {
        let c = caps(&[("iops", "1000"), ("burst_ios", "50")]);
        let mut b = Bucket::new(c, 0);
        let mut at_once = 0;
        while b.ready(0) {
            b.charge(0);
            at_once += 1;
        }
        assert_eq!(at_once, 50);
        let (mut now, mut n) = (0u64, 0u64);
        while now < 1000 * MS {
            if b.ready(now) {
                b.charge(1 << 20);
                n += 1;
            } else {
                now = b.ready_at(now);
            }
        }
        assert!((999..=1001).contains(&n), "{n} requests in a second");
    }

    #[test]
    fn a_large_request_leaves_a_debt_paid_before_the_next() {
        let c = caps(&[("credit_bytes", "1M"), ("credit_us", "1000000")]);
        let mut b = Bucket::new(c, 0);
        assert!(b.ready(0));
        b.charge(4 << 20);
        assert!(!b.ready(0));
        let at = b.ready_at(0);
        // 3 MiB of debt paid by three grants of 1 MiB a second; the fourth gives credit.
        assert_eq!(at, 4000 * MS);
        assert!(!b.ready(at - 1));
        assert!(b.ready(at));
    }

    #[test]
    fn caps_changed_keep_saved_credit_within_the_new_burst() {
        let mut b = Bucket::new(caps(&[("credit_bytes", "1M")]), 0);
        b.set_caps(caps(&[("credit_bytes", "64K")]), 0);
        assert_eq!(b.credit().0, 64 << 10);
        // Lifting the byte cap and setting an IOPS cap starts that one full.
        b.set_caps(caps(&[("iops", "100")]), 0);
        assert_eq!(b.credit().1, 10);
    }

    #[test]
    fn a_default_burst_follows_a_changed_cap_and_a_set_one_stays() {
        let mut c = caps(&[("credit_bytes", "64K"), ("iops", "1000")]);
        c.set("credit_bytes", "256K").unwrap();
        c.set("iops", "5000").unwrap();
        let c = c.with_default_bursts();
        assert_eq!((c.burst_bytes, c.burst_ios), (256 << 10, 500));
        let mut c = caps(&[("credit_bytes", "64K"), ("burst_bytes", "1M")]);
        c.set("credit_bytes", "128K").unwrap();
        assert_eq!(c.with_default_bursts().burst_bytes, 1 << 20);
    }

    #[test]
    fn bad_caps_name_the_key() {
        let mut c = Caps::default();
        assert!(c.set("rate", "1").unwrap_err().contains("unknown key `rate`"));
        assert!(c.set("iops", "fast").unwrap_err().contains("key `iops`"));
        c.set("credit_bytes", "64K").unwrap();
        c.set("burst_bytes", "4K").unwrap();
        assert!(c.check().unwrap_err().contains("key `burst_bytes`"));
        let mut c = Caps::default();
        c.set("iops", "10").unwrap();
        c.set("weight", "4").unwrap();
        assert!(c.check().unwrap_err().contains("key `weight`"));
        let mut c = Caps::default();
        c.set("weight", "0").unwrap();
        assert!(c.check().unwrap_err().contains("key `weight`"));
    }

    #[test]
    fn caps_survive_the_page_and_broken_ones_do_not() {
        let c = caps(&[("credit_bytes", "1M"), ("iops", "500")]);
        assert_eq!(Caps::from_slots(c.to_slots()), Some(c));
        let mut s = c.to_slots();
        s[5] = 0;
        assert_eq!(Caps::from_slots(s), None);
    }

    #[test]
    fn deficit_round_robin_shares_bytes_by_weight() {
        // Two queues always busy: one with 4 KiB requests and weight 1, one with 64 KiB
        // requests and weight 3. Bytes served come out 1 : 3.
        let mut a = Deficit::new(1, 1);
        let mut b = Deficit::new(3, 1);
        let (mut sa, mut sb) = (0u64, 0u64);
        for _ in 0..10_000 {
            if a.begin_turn() {
                while a.may_start() {
                    a.charge(4096);
                    sa += 4096;
                }
            }
            if b.begin_turn() {
                while b.may_start() {
                    b.charge(65536);
                    sb += 65536;
                }
            }
        }
        let ratio = sb as f64 / sa as f64;
        assert!((ratio - 3.0).abs() < 0.05, "ratio {ratio}");
    }

    /// A QD1 client on view 0 (weight `w0`) sending its next request 2 µs after each answer,
    /// each taking 1 µs, beside a client on view 1 (weight `w1`) that always has requests
    /// waiting; both 4 KiB. Returns the bytes each was served in 100 ms.
    fn qd1_beside_a_backlog(w0: u32, w1: u32) -> (u64, u64) {
        let mut s = Shares::new(2);
        s.set_weight(0, Some(w0));
        s.set_weight(1, Some(w1));
        let (mut now, mut next0, mut served) = (0u64, 0u64, [0u64; 2]);
        while now < 100 * MS {
            if now >= next0 && s.admit(0, now).is_ok() {
                s.start(0, 4096, now);
                s.finish(0, now + 1000);
                served[0] += 4096;
                next0 = now + 3000;
            }
            if s.admit(1, now).is_ok() {
                s.start(1, 4096, now);
                s.finish(1, now + 1000);
                served[1] += 4096;
            }
            now += 1000;
        }
        (served[0], served[1])
    }

    #[test]
    fn a_heavier_view_between_requests_holds_a_lighter_one_back() {
        let (quiet, noisy) = qd1_beside_a_backlog(32, 1);
        let ratio = quiet as f64 / noisy as f64;
        assert!((28.0..=36.0).contains(&ratio), "served {quiet} : {noisy}, ratio {ratio}");
    }

    #[test]
    fn equal_weights_hold_nothing_back() {
        let (quiet, noisy) = qd1_beside_a_backlog(4, 4);
        // The backlogged view starts a request every microsecond, as if alone.
        assert_eq!(noisy, 100_000 * 4096, "served {quiet} : {noisy}");
        let mut s = Shares::new(3);
        s.set_weight(1, None);
        s.set_weight(2, Some(1));
        assert!(!s.on(), "a capped view's weight takes no part");
    }

    #[test]
    fn a_lighter_view_gets_the_device_once_the_heavier_one_is_quiet() {
        let mut s = Shares::new(2);
        s.set_weight(0, Some(100));
        s.set_weight(1, Some(1));
        s.start(0, 4096, 0);
        s.finish(0, 1000);
        let mut now = 1000;
        while s.admit(1, now).is_ok() {
            s.start(1, 4096, now);
            s.finish(1, now);
        }
        let until = s.admit(1, now).unwrap_err();
        assert_eq!(until, 1000 + ACTIVE_NS);
        now = until;
        assert!(s.admit(1, now).is_ok(), "view 0 has been quiet for ACTIVE_NS");
        // Alone, it is never held.
        for i in 0..10_000 {
            assert!(s.admit(1, now + i).is_ok());
            s.start(1, 1 << 20, now + i);
            s.finish(1, now + i);
        }
    }

    #[test]
    fn a_view_back_from_idle_has_banked_nothing() {
        let mut s = Shares::new(2);
        s.set_weight(0, Some(1));
        s.set_weight(1, Some(2));
        // View 1 alone for a while; then view 0 comes back and both are busy.
        for i in 0..1000 {
            s.start(1, 1 << 20, i);
            s.finish(1, i);
        }
        let now = 1000;
        let mut served = [0u64; 2];
        for t in now..now + 100_000 {
            for (v, served) in served.iter_mut().enumerate() {
                while s.admit(v, t).is_ok() {
                    s.start(v, 4096, t);
                    s.finish(v, t);
                    *served += 4096;
                    if *served > 64 << 30 {
                        panic!("view {v} never held");
                    }
                }
            }
        }
        // Weight 2 : 1 from the moment both were active, not view 0 catching up first.
        let ratio = served[1] as f64 / served[0] as f64;
        assert!((1.9..=2.1).contains(&ratio), "served {served:?}");
    }

    #[test]
    fn an_idle_queue_saves_nothing_up() {
        let mut a = Deficit::new(1, 1);
        for _ in 0..100 {
            a.begin_turn();
            a.emptied();
        }
        assert!(a.begin_turn());
        a.charge(QUANTUM_BYTES as u64);
        assert!(!a.may_start());
    }
}
