//! A hostile `vdev` driver domain, for tests.
//!
//! A card's model must survive any driver: it answers mistakes as a device does and never
//! stops serving, and a driver that wedges the card is replaced by the supervisor. [`abuse`]
//! takes a `vdev` domain's descriptors as the real driver does, sends the model junk on the
//! trap line, then its real trap, and drives the card at register level doing everything a
//! driver must not: a ring outside its DMA memory, descriptors that name memory outside it
//! or blocks past the card's end, unknown commands, descriptors of random bytes, a storm of
//! random register writes. It checks that the card answered each mistake as its datasheet
//! says, reports, and then stops answering its queues (wedged) until it is killed. The test
//! driver (`bulkhead-test-driver`) runs it in the first generation of a `vdev` device when
//! `BULKHEAD_TEST_FAULT=vdev-hostile` is set; later generations run the real driver.

use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use bulkhead_ring::HeaderOffsets;
use bulkhead_shmem::{Mapping, Protection};
use bulkhead_spec::{BackendSpec, DomainSpec};
use bulkhead_vdev::card::{Card, CardCommand, Reg, PAGE};
use bulkhead_vdev::domain::DMA_BYTES;
use bulkhead_vdev::regs::{self, RegisterPage};

/// Descriptors of random bytes posted.
pub const GARBAGE_DESCRIPTORS: u64 = 64;
/// Random register writes in the storm.
pub const STORM_WRITES: u64 = 5000;

/// The channel generation of a domain's first queue (1 for a device's first domain).
pub fn generation(spec: &DomainSpec) -> Option<u32> {
    let ring = spec.queues.first()?.fds[0];
    let map = Mapping::new(ring, PAGE as usize, Protection::ReadOnly).ok()?;
    map.atomic_u32(HeaderOffsets::GENERATION).ok().map(|a| a.load(Ordering::Acquire))
}

/// What the hostile driver did, and what the card answered.
#[derive(Debug, Default)]
pub struct Outcome {
    /// Junk messages sent on the trap line.
    pub junk_traps: u64,
    /// Bad commands posted, each answered with an error status.
    pub refused: u64,
    /// Times the card stopped with ERROR set as the datasheet says.
    pub stops: u64,
    /// Garbage descriptors posted.
    pub garbage: u64,
    /// Register writes in the storm.
    pub storm: u64,
}

struct Raw {
    card: Card,
    page: RegisterPage,
    dma: Mapping,
}

/// How long the card may take to answer one thing.
const CARD_TIME: Duration = Duration::from_secs(5);

impl Raw {
    fn w(&self, r: Reg, v: u64) {
        self.page.write(r, v);
    }
    fn r(&self, r: Reg) -> u64 {
        self.page.read(r)
    }
    fn until(&self, what: &str, f: impl Fn(&Raw) -> bool) -> Result<(), crate::KitError> {
        let t0 = Instant::now();
        while !f(self) {
            if t0.elapsed() > CARD_TIME {
                return Err(crate::KitError(format!("the card did not answer: {what}")));
            }
            std::thread::sleep(Duration::from_micros(100));
        }
        Ok(())
    }
    fn bit(&self, r: Reg, bit: u8) -> bool {
        self.r(r) >> bit & 1 == 1
    }
    fn reset(&self) -> Result<(), crate::KitError> {
        let c = self.card.registers.control;
        self.w(c, 1 << self.card.control.reset);
        self.until("reset", |x| x.r(c) == 0)
    }
    fn enable(&self, base: u64, entries: u64) -> Result<(), crate::KitError> {
        let r = &self.card.registers;
        self.w(r.queue_base, base);
        self.w(r.queue_entries, entries);
        self.w(r.control, 1 << self.card.control.enable);
        let s = self.card.status;
        self.until("ready or error after enable", |x| x.bit(r.status, s.ready) || x.bit(r.status, s.error))
    }
    fn post_bytes(&self, n: u64, desc: &[u8]) {
        let size = u64::from(self.card.descriptor.size);
        let _ = self.dma.write_from(((n % 8) * size) as usize, desc);
    }
    fn post(&self, n: u64, opcode: u8, lba: u64, blocks: u64, address: u64) {
        let d = &self.card.descriptor;
        let mut desc = vec![0u8; d.size as usize];
        d.encode(&CardCommand { opcode, lba, blocks, address, status: 0x77, ..CardCommand::default() }, &mut desc);
        self.post_bytes(n, &desc);
    }
    fn status_of(&self, n: u64) -> u16 {
        let d = &self.card.descriptor;
        let mut desc = vec![0u8; d.size as usize];
        let _ = self.dma.read_into(((n % 8) * u64::from(d.size)) as usize, &mut desc);
        d.status.get(&desc) as u16
    }
}

/// Takes the `vdev` descriptors of `spec`, sends junk and then a real trap to the model,
/// confines the domain (reporting as a domain does), abuses the card, and returns what it did;
/// the caller then wedges.
///
/// # Safety
/// Every descriptor named in the spec must be inherited for this domain and not used by
/// anything else in the process.
pub unsafe fn abuse(spec: &DomainSpec) -> Result<(Outcome, Wedged), crate::KitError> {
    let BackendSpec::Vdev { card, fds, .. } = &spec.backend else {
        return Err(crate::KitError("the hostile vdev driver needs a vdev backend".into()));
    };
    let card = Card::from_json(card)?;
    // SAFETY: forwarded from this function's contract.
    let claimed = fds.map(|fd| unsafe { bulkhead_sys::claim_inherited(fd) });
    let [regs_fd, dma_fd, _irq, line] = claimed.map(|r| r.map_err(|e| crate::KitError(e.to_string())));
    let (regs_fd, dma_fd, line): (OwnedFd, OwnedFd, OwnedFd) = (regs_fd?, dma_fd?, line?);
    let page =
        Mapping::new(regs_fd.as_raw_fd(), PAGE as usize, Protection::ReadWrite).map_err(|e| crate::KitError(e.to_string()))?;
    let page = RegisterPage::new(page)?;
    let dma = Mapping::new(dma_fd.as_raw_fd(), DMA_BYTES as usize, Protection::ReadWrite)
        .map_err(|e| crate::KitError(e.to_string()))?;
    let mut out = Outcome::default();

    // Junk on the trap line: a message with no descriptor, one of the wrong size, a pipe posing
    // as a trap, and a real trap that names an address it does not cover.
    let (pipe_r, _pipe_w) = bulkhead_sys::pipe().map_err(|e| crate::KitError(e.to_string()))?;
    let mut wrong = [0u8; 16];
    wrong[..8].copy_from_slice(&(page.mapping().base_ptr() as u64).to_le_bytes());
    wrong[8..].copy_from_slice(&u64::from(PAGE).to_le_bytes());
    let _ = bulkhead_sys::send_with_fd(line.as_fd(), &wrong[..3], pipe_r.as_fd());
    let _ = bulkhead_sys::send_with_fd(line.as_fd(), &wrong, pipe_r.as_fd());
    let other =
        Mapping::new(regs_fd.as_raw_fd(), PAGE as usize, Protection::ReadWrite).map_err(|e| crate::KitError(e.to_string()))?;
    let other = RegisterPage::new(other)?;
    let decoy = bulkhead_vdev::trap::arm(&other).map_err(|e| crate::KitError(e.to_string()))?;
    let mut elsewhere = wrong;
    elsewhere[..8].copy_from_slice(&(page.mapping().base_ptr() as u64 + u64::from(PAGE) * 16).to_le_bytes());
    let _ = bulkhead_sys::send_with_fd(line.as_fd(), &elsewhere, decoy.fd());
    out.junk_traps = 3;
    // Now the real one.
    bulkhead_vdev::domain::send_trap(&line, &page)?;
    drop((decoy, other));
    bulkhead_driver::confine_and_report(spec).map_err(|e| crate::KitError(e.to_string()))?;

    let raw = Raw { card: card.clone(), page, dma };
    let (r, s, k, o) = (card.registers.clone(), card.status, card.codes, card.opcodes);
    let capacity = raw.r(r.capacity);
    let expect_error = |raw: &Raw, code: u32, what: &str| -> Result<(), crate::KitError> {
        raw.until(what, |x| x.bit(r.status, s.error))?;
        if raw.r(r.error) != u64::from(code) {
            return Err(crate::KitError(format!("{what}: ERROR {:#x}, the datasheet says {code:#x}", raw.r(r.error))));
        }
        Ok(())
    };

    // Rings the card must refuse: outside DMA memory on either side, and not a power of two.
    for (base, entries) in [(card.dma_base + DMA_BYTES, 8), (card.dma_base.wrapping_sub(4096), 8), (card.dma_base, 3)] {
        raw.reset()?;
        raw.enable(base, entries)?;
        expect_error(&raw, card.errors.bad_queue, "a bad ring")?;
        out.stops += 1;
    }

    // A good ring, then one bad command of each kind: each gets its error status.
    raw.reset()?;
    raw.enable(card.dma_base, 8)?;
    let data = card.dma_base + 64 * 1024;
    let unknown =
        (0..=255u8).find(|op| ![o.read, o.write, o.flush, o.discard, o.write_zeroes].contains(op)).expect("a free code");
    let bad = [
        (unknown, 0, 1, data, k.bad_opcode),
        (o.read, capacity, 1, data, k.out_of_range),
        (o.write, capacity - 1, 2, data, k.out_of_range),
        (o.write, 0, 1, card.dma_base + DMA_BYTES, k.bad_address),
        (o.read, 0, 1, card.dma_base.wrapping_sub(512), k.bad_address),
        (o.read, 0, 8, card.dma_base + DMA_BYTES - 2048, k.bad_address),
        (o.read, 0, 0, data, k.bad_length),
        (o.read, 0, u64::from(card.max_blocks) + 1, data, k.bad_length),
    ];
    let mut posted = 0u64;
    let done_mask = regs::mask(r.complete_count);
    for (op, lba, blocks, addr, want) in bad {
        raw.post(posted, op, lba, blocks, addr);
        posted += 1;
        raw.w(r.submit_tail, posted & regs::mask(r.submit_tail));
        raw.until("a bad command's completion", |x| x.r(r.complete_count) == posted & done_mask)?;
        let got = raw.status_of(posted - 1);
        if got != want {
            return Err(crate::KitError(format!(
                "bad command {posted} (opcode {op:#x}): status {got:#x}, the datasheet says {want:#x}"
            )));
        }
        out.refused += 1;
    }

    // Descriptors of random bytes: whatever they say, each completes (with some status) and the
    // card stays up. A block count of random bytes rarely fits the card, so most are refused.
    let mut rng = bulkhead_rng::Rng::new(card.seed);
    let size = card.descriptor.size as usize;
    for _ in 0..GARBAGE_DESCRIPTORS {
        let desc: Vec<u8> = (0..size).map(|_| rng.next_u64() as u8).collect();
        raw.post_bytes(posted, &desc);
        posted += 1;
        raw.w(r.submit_tail, posted & regs::mask(r.submit_tail));
        raw.until("a garbage descriptor's completion", |x| {
            x.r(r.complete_count) == posted & done_mask || x.bit(r.status, s.error)
        })?;
        if raw.bit(r.status, s.error) {
            return Err(crate::KitError(format!("the card stopped on a garbage descriptor (ERROR {:#x})", raw.r(r.error))));
        }
        out.garbage += 1;
    }

    // A doorbell a whole ring ahead: the card stops with BAD_TAIL.
    raw.w(r.submit_tail, (posted + 9) & regs::mask(r.submit_tail));
    expect_error(&raw, card.errors.bad_tail, "a doorbell past the ring")?;
    out.stops += 1;

    // A storm of random writes anywhere in the register page.
    let all = card.registers.all();
    for _ in 0..STORM_WRITES {
        let x = rng.next_u64();
        let reg = if x & 1 == 0 {
            all[(x >> 1) as usize % all.len()].1
        } else {
            Reg { offset: ((x >> 8) as u32 % PAGE) & !3, width: 4 }
        };
        raw.w(reg, rng.next_u64());
    }
    out.storm = STORM_WRITES;
    Ok((out, Wedged { _raw: raw }))
}

/// The hostile driver once it is done: it holds the card as the storm left it, mapped and
/// trapped, and answers nothing.
pub struct Wedged {
    _raw: Raw,
}

impl Wedged {
    /// Stops answering: sleeps until `stop` (SIGTERM) or SIGKILL.
    pub fn wait(self, stop: &AtomicBool) {
        wedge(stop);
    }
}

/// Sleeps until `stop` (SIGTERM) or SIGKILL.
pub fn wedge(stop: &AtomicBool) {
    while !stop.load(Ordering::Relaxed) {
        std::thread::sleep(Duration::from_millis(50));
    }
}
