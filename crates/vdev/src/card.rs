//! A card: the register map, bit fields, command codes, descriptor layout and interrupt behaviour
//! of one storage controller, drawn from a seed so that every seed is a different card (the
//! "virtual card generation" of Jones' virtual device paper), and validated when read from a file,
//! so a card spec is never trusted for its shape.
//!
//! Every card works the same way (see the datasheet, [`crate::datasheet`]): a ring of
//! descriptors in DMA memory, a doorbell register that carries the ring's tail, a completion
//! counter the card advances, and an interrupt. What differs is where each register and bit
//! sits, how wide some are, what the command and status codes are, how a descriptor is laid
//! out, where DMA addresses start, and how interrupts coalesce.

use crate::VdevError;
use bulkhead_rng::Rng;
use serde::{Deserialize, Serialize};

/// The register page's size: one page.
pub const PAGE: u32 = 4096;
/// Bytes in a block (the card's addressing unit).
pub const BLOCK: u32 = 512;

/// A register: its byte offset in the register page and its width in bytes (4 or 8).
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct Reg {
    /// Byte offset in the page.
    pub offset: u32,
    /// Bytes: 4 or 8.
    pub width: u8,
}

/// The card's registers.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct Registers {
    /// Read-only: the card's identity, `vendor << 16 | device`.
    pub id: Reg,
    /// Read/write: enable, reset, interrupt enable ([`ControlBits`]).
    pub control: Reg,
    /// Read-only: ready, error ([`StatusBits`]).
    pub status: Reg,
    /// Read-only: why the card stopped (an [`ErrorCodes`] value), 0 when it has not.
    pub error: Reg,
    /// Read-only: the card's size in blocks.
    pub capacity: Reg,
    /// Read/write: the bus address of the descriptor ring.
    pub queue_base: Reg,
    /// Read/write: descriptors in the ring (a power of two).
    pub queue_entries: Reg,
    /// Read/write: the doorbell, descriptors posted so far (free-running, wraps at the
    /// register's width).
    pub submit_tail: Reg,
    /// Read-only: descriptors completed so far (free-running, as the tail).
    pub complete_count: Reg,
    /// Read/write: completions the driver has seen (the interrupt's acknowledgement).
    pub irq_ack: Reg,
}

impl Registers {
    /// Every register with its name, in datasheet order.
    pub fn all(&self) -> [(&'static str, Reg); 10] {
        [
            ("ID", self.id),
            ("CONTROL", self.control),
            ("STATUS", self.status),
            ("ERROR", self.error),
            ("CAPACITY", self.capacity),
            ("QUEUE_BASE", self.queue_base),
            ("QUEUE_ENTRIES", self.queue_entries),
            ("SUBMIT_TAIL", self.submit_tail),
            ("COMPLETE_COUNT", self.complete_count),
            ("IRQ_ACK", self.irq_ack),
        ]
    }
}

/// Bit positions in CONTROL.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct ControlBits {
    /// Start serving the ring.
    pub enable: u8,
    /// Stop, forget the ring and clear errors; the card clears the bit when done.
    pub reset: u8,
    /// Raise interrupts.
    pub irq_enable: u8,
}

/// Bit positions in STATUS.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct StatusBits {
    /// Enabled with a valid ring.
    pub ready: u8,
    /// Stopped on an error (see ERROR).
    pub error: u8,
}

/// The values ERROR takes.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct ErrorCodes {
    /// Enabled with QUEUE_BASE/QUEUE_ENTRIES that do not describe a ring in DMA memory.
    pub bad_queue: u32,
    /// SUBMIT_TAIL ran more than a ring ahead of COMPLETE_COUNT.
    pub bad_tail: u32,
    /// A reserved CONTROL bit was set.
    pub reserved_bits: u32,
}

/// Command codes (a descriptor's opcode field).
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct Opcodes {
    /// Blocks to memory.
    pub read: u8,
    /// Memory to blocks.
    pub write: u8,
    /// Make every completed write durable.
    pub flush: u8,
    /// Forget blocks (they read back as zeroes).
    pub discard: u8,
    /// Zero blocks.
    pub write_zeroes: u8,
}

/// The values a descriptor's status field takes when the card completes it.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct StatusCodes {
    /// Done.
    pub ok: u16,
    /// Unknown opcode, or a reserved flag set.
    pub bad_opcode: u16,
    /// Blocks past the card's capacity.
    pub out_of_range: u16,
    /// A transfer outside DMA memory.
    pub bad_address: u16,
    /// A block count of 0 or above the card's maximum.
    pub bad_length: u16,
    /// The storage behind the card failed.
    pub media_error: u16,
}

/// A field of a descriptor: byte offset and width (1, 2, 4 or 8).
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct Field {
    /// Byte offset in the descriptor.
    pub offset: u32,
    /// Bytes.
    pub width: u8,
}

impl Field {
    /// Reads the field, little-endian, from `desc`.
    pub fn get(self, desc: &[u8]) -> u64 {
        let mut b = [0u8; 8];
        let at = self.offset as usize;
        b[..self.width as usize].copy_from_slice(&desc[at..at + self.width as usize]);
        u64::from_le_bytes(b)
    }

    /// Writes `v` little-endian into the field in `desc` (bits beyond its width dropped).
    pub fn put(self, desc: &mut [u8], v: u64) {
        let at = self.offset as usize;
        desc[at..at + self.width as usize].copy_from_slice(&v.to_le_bytes()[..self.width as usize]);
    }
}

/// A descriptor's layout.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct Descriptor {
    /// Bytes per descriptor (32 or 64); descriptors sit back to back in the ring.
    pub size: u32,
    /// The command ([`Opcodes`]).
    pub opcode: Field,
    /// Written by the card on completion ([`StatusCodes`]).
    pub status: Field,
    /// The driver's own tag, never read by the card.
    pub tag: Field,
    /// First block.
    pub lba: Field,
    /// Blocks.
    pub blocks: Field,
    /// Bus address of the data.
    pub address: Field,
}

/// The fields a driver fills in for one command.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CardCommand {
    /// The command ([`Opcodes`]).
    pub opcode: u8,
    /// The driver's own tag.
    pub tag: u64,
    /// First block.
    pub lba: u64,
    /// Blocks.
    pub blocks: u64,
    /// Bus address of the data.
    pub address: u64,
    /// The status the descriptor holds until the card writes its own.
    pub status: u64,
}

impl Descriptor {
    /// Writes `c` into `desc` (at least [`size`](Self::size) bytes) in this layout, every
    /// other byte of the descriptor zero.
    pub fn encode(&self, c: &CardCommand, desc: &mut [u8]) {
        let desc = &mut desc[..self.size as usize];
        desc.fill(0);
        self.opcode.put(desc, c.opcode.into());
        self.tag.put(desc, c.tag);
        self.lba.put(desc, c.lba);
        self.blocks.put(desc, c.blocks);
        self.address.put(desc, c.address);
        self.status.put(desc, c.status);
    }

    /// Every field with its name, in datasheet order.
    pub fn all(&self) -> [(&'static str, Field); 6] {
        [
            ("OPCODE", self.opcode),
            ("STATUS", self.status),
            ("TAG", self.tag),
            ("LBA", self.lba),
            ("BLOCKS", self.blocks),
            ("ADDRESS", self.address),
        ]
    }
}

/// A card spec.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct Card {
    /// The seed it was drawn from.
    pub seed: u64,
    /// Its model name.
    pub name: String,
    /// Vendor id (ID's high half).
    pub vendor: u16,
    /// Device id (ID's low half).
    pub device: u16,
    /// The register map.
    pub registers: Registers,
    /// CONTROL's bits.
    pub control: ControlBits,
    /// STATUS's bits.
    pub status: StatusBits,
    /// ERROR's values.
    pub errors: ErrorCodes,
    /// Command codes.
    pub opcodes: Opcodes,
    /// Completion status codes.
    pub codes: StatusCodes,
    /// Descriptor layout.
    pub descriptor: Descriptor,
    /// Bus address at which DMA memory starts (a page multiple).
    pub dma_base: u64,
    /// Most blocks one descriptor may move.
    pub max_blocks: u32,
    /// The card raises its interrupt after this many completions, and when it runs out of
    /// posted descriptors with completions not yet signalled.
    pub irq_coalesce: u32,
}

/// Picks `n` distinct values from `choices`.
fn distinct(rng: &mut Rng, choices: &mut Vec<u64>, n: usize) -> Vec<u64> {
    (0..n).map(|_| choices.swap_remove(rng.below(choices.len() as u64) as usize)).collect()
}

/// Lays out fields of the given widths in random order, each aligned to its width, with
/// random gaps, within `size` bytes; `None` if they do not fit (the caller draws again).
fn place(rng: &mut Rng, widths: &[u8], size: u32) -> Option<Vec<u32>> {
    let mut order: Vec<usize> = (0..widths.len()).collect();
    for i in (1..order.len()).rev() {
        order.swap(i, rng.below(i as u64 + 1) as usize);
    }
    let total: u32 = widths.iter().map(|&w| u32::from(w)).sum();
    let mut slack = size.checked_sub(total)?;
    let mut at = 0u32;
    let mut offsets = vec![0; widths.len()];
    for i in order {
        let w = u32::from(widths[i]);
        let gap = rng.below(u64::from(slack / widths.len() as u32 + 1)) as u32;
        at = (at + gap).next_multiple_of(w);
        slack = slack.saturating_sub(gap);
        if at + w > size {
            return None;
        }
        offsets[i] = at;
        at += w;
    }
    Some(offsets)
}

impl Card {
    /// The card of `seed`: the same seed always gives the same card.
    pub fn generate(seed: u64) -> Card {
        let mut rng = Rng::new(seed ^ 0x7663_6172_6400_0000);
        let vendor = 0x1000 + rng.below(0xE000) as u16;
        let device = 0x0100 + rng.below(0xFE00) as u16;
        let letters = b"ABCDEFGHJKLMNPRSTVWXZ";
        let name = format!(
            "{}{}-{}",
            letters[rng.below(letters.len() as u64) as usize] as char,
            letters[rng.below(letters.len() as u64) as usize] as char,
            100 + rng.below(900)
        );
        // Registers: widths first, then distinct aligned slots in the page.
        let wide = |rng: &mut Rng| if rng.below(2) == 0 { 4u8 } else { 8 };
        let widths = [4u8, 4, 4, 4, 8, 8, 4, wide(&mut rng), wide(&mut rng), wide(&mut rng)];
        // Each register has a 16-byte slot of its own, and sits at an aligned place in it.
        let mut slots: Vec<u64> = (0..u64::from(PAGE / 16)).collect();
        let at = distinct(&mut rng, &mut slots, widths.len());
        let within: Vec<u32> = widths.iter().map(|&w| rng.below(16 / u64::from(w)) as u32 * u32::from(w)).collect();
        let reg = |i: usize| Reg { offset: at[i] as u32 * 16 + within[i], width: widths[i] };
        let registers = Registers {
            id: reg(0),
            control: reg(1),
            status: reg(2),
            error: reg(3),
            capacity: reg(4),
            queue_base: reg(5),
            queue_entries: reg(6),
            submit_tail: reg(7),
            complete_count: reg(8),
            irq_ack: reg(9),
        };
        let mut bits: Vec<u64> = (0..32).collect();
        let c = distinct(&mut rng, &mut bits, 3);
        let control = ControlBits { enable: c[0] as u8, reset: c[1] as u8, irq_enable: c[2] as u8 };
        let mut bits: Vec<u64> = (0..32).collect();
        let s = distinct(&mut rng, &mut bits, 2);
        let status = StatusBits { ready: s[0] as u8, error: s[1] as u8 };
        let mut vals: Vec<u64> = (1..256).collect();
        let e = distinct(&mut rng, &mut vals, 3);
        let errors = ErrorCodes { bad_queue: e[0] as u32, bad_tail: e[1] as u32, reserved_bits: e[2] as u32 };
        let mut vals: Vec<u64> = (1..256).collect();
        let o = distinct(&mut rng, &mut vals, 5);
        let opcodes =
            Opcodes { read: o[0] as u8, write: o[1] as u8, flush: o[2] as u8, discard: o[3] as u8, write_zeroes: o[4] as u8 };
        let status_width = if rng.below(2) == 0 { 1u8 } else { 2 };
        // All ones is never a code: a driver can mark a descriptor not yet completed with it.
        let mut vals: Vec<u64> = (1..width_max(status_width)).collect();
        let mut sc = distinct(&mut rng, &mut vals, 6);
        // OK is 0 on some cards, a code of its own on others.
        if rng.below(2) == 0 {
            sc[0] = 0;
        }
        let codes = StatusCodes {
            ok: sc[0] as u16,
            bad_opcode: sc[1] as u16,
            out_of_range: sc[2] as u16,
            bad_address: sc[3] as u16,
            bad_length: sc[4] as u16,
            media_error: sc[5] as u16,
        };
        let blocks_width = if rng.below(2) == 0 { 2u8 } else { 4 };
        let tag_width = if rng.below(2) == 0 { 2u8 } else { 4 };
        let size = if rng.below(2) == 0 { 32 } else { 64 };
        let widths = [1u8, status_width, tag_width, 8, blocks_width, 8];
        let offsets = loop {
            if let Some(o) = place(&mut rng, &widths, size) {
                break o;
            }
        };
        let field = |i: usize| Field { offset: offsets[i], width: widths[i] };
        let descriptor = Descriptor {
            size,
            opcode: field(0),
            status: field(1),
            tag: field(2),
            lba: field(3),
            blocks: field(4),
            address: field(5),
        };
        let dma_base = (1 + rng.below(1 << 20)) << 12;
        // 64 KiB to 1 MiB a descriptor.
        let max_blocks = 128 << rng.below(5);
        let irq_coalesce = 1 << rng.below(4);
        Card {
            seed,
            name,
            vendor,
            device,
            registers,
            control,
            status,
            errors,
            opcodes,
            codes,
            descriptor,
            dma_base,
            max_blocks,
            irq_coalesce,
        }
    }

    /// The value of ID.
    pub fn id(&self) -> u64 {
        u64::from(self.vendor) << 16 | u64::from(self.device)
    }

    /// Reads a card spec (JSON), checked with [`validate`](Self::validate).
    pub fn from_json(text: &str) -> Result<Card, VdevError> {
        let card: Card = serde_json::from_str(text).map_err(|e| VdevError::Card(format!("card spec: {e}")))?;
        card.validate()?;
        Ok(card)
    }

    /// The spec as JSON.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("a card serialises")
    }

    /// Checks the spec describes a card that can work: registers inside the page, aligned,
    /// apart; distinct bits and codes; descriptor fields inside the descriptor, aligned,
    /// apart, and wide enough.
    pub fn validate(&self) -> Result<(), VdevError> {
        let regs = self.registers.all();
        for (name, r) in regs {
            if r.width != 4 && r.width != 8 {
                return Err(VdevError::Card(format!("card spec: register {name}: width {} (4 or 8)", r.width)));
            }
            if r.offset % u32::from(r.width) != 0 || r.offset + u32::from(r.width) > PAGE {
                return Err(VdevError::Card(format!(
                    "card spec: register {name}: offset {:#x} is not aligned inside the page",
                    r.offset
                )));
            }
        }
        for (i, (a, ra)) in regs.iter().enumerate() {
            for (b, rb) in &regs[i + 1..] {
                if ra.offset < rb.offset + u32::from(rb.width) && rb.offset < ra.offset + u32::from(ra.width) {
                    return Err(VdevError::Card(format!("card spec: registers {a} and {b} overlap")));
                }
            }
        }
        for (name, r) in [("CAPACITY", self.registers.capacity), ("QUEUE_BASE", self.registers.queue_base)] {
            if r.width != 8 {
                return Err(VdevError::Card(format!("card spec: register {name} must be 8 bytes wide")));
            }
        }
        let c = self.control;
        let s = self.status;
        if [c.enable, c.reset, c.irq_enable, s.ready, s.error].iter().any(|&b| b >= 32) {
            return Err(VdevError::Card("card spec: a CONTROL or STATUS bit is past bit 31".into()));
        }
        if c.enable == c.reset || c.enable == c.irq_enable || c.reset == c.irq_enable || s.ready == s.error {
            return Err(VdevError::Card("card spec: two CONTROL or STATUS bits share a position".into()));
        }
        let o = self.opcodes;
        let ops = [o.read, o.write, o.flush, o.discard, o.write_zeroes];
        if (0..ops.len()).any(|i| ops[i + 1..].contains(&ops[i])) {
            return Err(VdevError::Card("card spec: two opcodes share a value".into()));
        }
        let k = self.codes;
        let codes = [k.ok, k.bad_opcode, k.out_of_range, k.bad_address, k.bad_length, k.media_error];
        if (0..codes.len()).any(|i| codes[i + 1..].contains(&codes[i])) {
            return Err(VdevError::Card("card spec: two status codes share a value".into()));
        }
        let e = self.errors;
        if [e.bad_queue, e.bad_tail, e.reserved_bits].contains(&0)
            || e.bad_queue == e.bad_tail
            || e.bad_tail == e.reserved_bits
            || e.bad_queue == e.reserved_bits
        {
            return Err(VdevError::Card("card spec: error codes must be distinct and not 0".into()));
        }
        let d = &self.descriptor;
        if d.size != 32 && d.size != 64 {
            return Err(VdevError::Card(format!("card spec: descriptor size {} (32 or 64)", d.size)));
        }
        let fields = d.all();
        for (name, f) in fields {
            if ![1, 2, 4, 8].contains(&f.width) || f.offset % u32::from(f.width) != 0 || f.offset + u32::from(f.width) > d.size {
                return Err(VdevError::Card(format!(
                    "card spec: descriptor field {name} at {} width {} does not fit",
                    f.offset, f.width
                )));
            }
        }
        for (i, (a, fa)) in fields.iter().enumerate() {
            for (b, fb) in &fields[i + 1..] {
                if fa.offset < fb.offset + u32::from(fb.width) && fb.offset < fa.offset + u32::from(fa.width) {
                    return Err(VdevError::Card(format!("card spec: descriptor fields {a} and {b} overlap")));
                }
            }
        }
        if d.lba.width != 8 || d.address.width != 8 || d.opcode.width != 1 || d.blocks.width < 2 || d.status.width > 2 {
            return Err(VdevError::Card(
                "card spec: descriptor fields LBA and ADDRESS must be 8 bytes, OPCODE 1, BLOCKS at least 2, STATUS at most 2"
                    .into(),
            ));
        }
        if width_max(d.status.width) <= u64::from(*codes.iter().max().expect("six codes")) {
            return Err(VdevError::Card(
                "card spec: a status code does not fit its field, or is all ones (kept for \"not completed\")".into(),
            ));
        }
        if self.max_blocks == 0 || u64::from(self.max_blocks) > width_max(d.blocks.width) {
            return Err(VdevError::Card(format!("card spec: max_blocks {} does not fit the BLOCKS field", self.max_blocks)));
        }
        if !self.dma_base.is_multiple_of(u64::from(PAGE)) {
            return Err(VdevError::Card(format!("card spec: dma_base {:#x} is not a page multiple", self.dma_base)));
        }
        if self.irq_coalesce == 0 {
            return Err(VdevError::Card("card spec: irq_coalesce must be at least 1".into()));
        }
        Ok(())
    }
}

/// The largest value a field of `width` bytes holds.
pub fn width_max(width: u8) -> u64 {
    if width >= 8 {
        u64::MAX
    } else {
        (1u64 << (8 * u32::from(width))) - 1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_seed_makes_a_valid_card_and_the_same_seed_the_same_card() {
        for seed in 0..500 {
            let card = Card::generate(seed);
            card.validate().unwrap_or_else(|e| panic!("seed {seed}: {e}"));
            assert_eq!(card, Card::generate(seed));
            assert_eq!(Card::from_json(&card.to_json()).unwrap(), card);
        }
        // Different seeds, different cards.
        let a = Card::generate(1);
        let b = Card::generate(2);
        assert_ne!(a.registers, b.registers);
        assert_ne!(a.descriptor, b.descriptor);
    }

    #[test]
    fn a_spec_that_cannot_work_is_refused_by_name() {
        let mut card = Card::generate(7);
        card.registers.status = card.registers.control;
        assert!(Card::from_json(&card.to_json()).unwrap_err().to_string().contains("CONTROL and STATUS overlap"));
        let mut card = Card::generate(7);
        card.registers.id.offset = 4094;
        assert!(card.validate().unwrap_err().to_string().contains("register ID"));
        let mut card = Card::generate(7);
        card.opcodes.flush = card.opcodes.read;
        assert!(card.validate().unwrap_err().to_string().contains("opcodes"));
        let mut card = Card::generate(7);
        card.descriptor.lba.offset = card.descriptor.address.offset;
        assert!(card.validate().unwrap_err().to_string().contains("overlap"));
        assert!(Card::from_json("{\"seed\": 1}").unwrap_err().to_string().starts_with("card spec:"));
    }
}
