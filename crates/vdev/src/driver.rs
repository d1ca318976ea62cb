//! The reference driver: a bulkhead backend that drives a card at register level, written
//! from the datasheet alone (it reads the card's spec for every offset, bit and code). It
//! does what a driver for hardware does: resets the card, gives it a descriptor ring in DMA
//! memory, bounces data through DMA buffers, rings the doorbell, and takes the interrupt or
//! polls the completion counter.

use crate::VdevError;
use std::time::{Duration, Instant};

use bulkhead_block::SetupError;
use bulkhead_block::{Backend, BlockError, Caps, Io, Remote, Request};
use bulkhead_doorbell::EventFd;
use bulkhead_shmem::Mapping;

use crate::card::{Card, CardCommand, BLOCK, PAGE};
use crate::regs::{self, RegisterPage};

/// How the driver learns of completions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wait {
    /// Sleep until the card's interrupt.
    Interrupt,
    /// Read COMPLETE_COUNT until it moves (interrupts disabled).
    Poll,
}

impl std::str::FromStr for Wait {
    type Err = VdevError;
    fn from_str(s: &str) -> Result<Self, VdevError> {
        match s {
            "interrupt" => Ok(Wait::Interrupt),
            "poll" => Ok(Wait::Poll),
            other => Err(VdevError::Card(format!("unknown wait mode {other:?} (interrupt, poll)"))),
        }
    }
}

/// Descriptors the driver keeps in its ring.
const ENTRIES: u64 = 32;
/// How long the card may take over a batch, or a reset, before the driver gives up on it.
const CARD_TIMEOUT: Duration = Duration::from_secs(10);

/// One command of a batch: which request it serves, and its part of it.
#[derive(Debug, Clone, Copy)]
struct Piece {
    io: usize,
    opcode: u8,
    lba: u64,
    blocks: u64,
    /// Byte offset of its data in the request's buffers.
    at: u64,
}

/// The driver of one card.
pub struct Driver {
    card: Card,
    regs: RegisterPage,
    dma: Mapping,
    irq: EventFd,
    wait: Wait,
    size: u64,
    /// Descriptor ring, then one data buffer per ring entry, in DMA memory.
    ring_offset: u64,
    data_offset: u64,
    chunk: u64,
    /// Descriptors posted, free-running.
    tail: u64,
    ready: bool,
}

impl std::fmt::Debug for Driver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Driver").field("card", &self.card.name).field("wait", &self.wait).finish_non_exhaustive()
    }
}

impl Driver {
    /// A driver for `card` over its register page (the driver's trapped mapping), its DMA
    /// memory and its interrupt line. It resets the card (its first register write, which
    /// reaches the model only once the model holds this driver's trap, so what it reads after
    /// is the card's and not what an earlier driver left) and reads what the card is and how
    /// large; it starts the card in [`init`](Self::init).
    pub fn new(card: Card, regs: RegisterPage, dma: Mapping, irq: EventFd, wait: Wait) -> Result<Self, VdevError> {
        let ring_bytes = ENTRIES * u64::from(card.descriptor.size);
        let data_offset = ring_bytes.next_multiple_of(u64::from(PAGE));
        let room = (dma.len() as u64).saturating_sub(data_offset) / ENTRIES;
        let chunk = (room / u64::from(PAGE) * u64::from(PAGE)).min(u64::from(card.max_blocks) * u64::from(BLOCK));
        if chunk == 0 {
            return Err(VdevError::Device(format!(
                "{} bytes of DMA memory is too little for a ring and {ENTRIES} buffers",
                dma.len()
            )));
        }
        let mut d = Driver { card, regs, dma, irq, wait, size: 0, ring_offset: 0, data_offset, chunk, tail: 0, ready: false };
        d.reset()?;
        let (r, card) = (&d.card.registers, &d.card);
        if d.regs.read(r.id) != card.id() {
            return Err(VdevError::Device(format!(
                "the card answers with id {:#x}, not {:#x} ({}): the spec is for another card",
                d.regs.read(r.id),
                card.id(),
                card.name
            )));
        }
        d.size = d.regs.read(r.capacity).saturating_mul(u64::from(BLOCK));
        Ok(d)
    }

    /// Resets the card and waits until it has.
    fn reset(&mut self) -> Result<(), VdevError> {
        let (r, c) = (self.card.registers.control, self.card.control);
        self.ready = false;
        self.regs.write(r, 1 << c.reset);
        self.until("the card to finish its reset", |d| d.regs.read(r) >> c.reset & 1 == 0)
    }

    /// Resets the card and starts it on the driver's ring.
    pub fn init(&mut self) -> Result<(), VdevError> {
        let r = self.card.registers.clone();
        let (c, s) = (self.card.control, self.card.status);
        self.reset()?;
        self.tail = 0;
        self.regs.write(r.queue_base, self.card.dma_base + self.ring_offset);
        self.regs.write(r.queue_entries, ENTRIES);
        let irq = if self.wait == Wait::Interrupt { 1 << c.irq_enable } else { 0 };
        self.regs.write(r.control, 1 << c.enable | irq);
        self.until("the card to be ready", |d| d.regs.read(r.status) & (1 << s.ready | 1 << s.error) != 0)?;
        if self.regs.read(r.status) >> s.error & 1 == 1 {
            return Err(VdevError::Device(format!("the card refused its ring (ERROR {:#x})", self.regs.read(r.error))));
        }
        self.irq.drain();
        self.ready = true;
        Ok(())
    }

    /// Polls `done` (register reads only) until it holds or the card's time is up.
    fn until(&self, what: &str, done: impl Fn(&Self) -> bool) -> Result<(), VdevError> {
        let t0 = Instant::now();
        while !done(self) {
            if t0.elapsed() > CARD_TIMEOUT {
                return Err(VdevError::Device(format!("timed out waiting for {what}")));
            }
            std::thread::sleep(Duration::from_micros(50));
        }
        Ok(())
    }

    /// Cuts the batch into commands of at most one buffer each.
    fn plan(&self, ios: &mut [Io<'_>]) -> Vec<Piece> {
        let o = self.card.opcodes;
        let b = u64::from(BLOCK);
        let mut pieces = Vec::new();
        for (i, io) in ios.iter_mut().enumerate() {
            let (opcode, offset, len, per) = match io.req {
                Request::Read { offset, into: bufs } => (o.read, offset, bufs.total_len(), self.chunk),
                Request::Write { offset, from: bufs, .. } => (o.write, offset, bufs.total_len(), self.chunk),
                Request::Flush => {
                    pieces.push(Piece { io: i, opcode: o.flush, lba: 0, blocks: 0, at: 0 });
                    io.result = Ok(0);
                    continue;
                }
                Request::Discard { offset, len } => (o.discard, offset, len, u64::from(self.card.max_blocks) * b),
                Request::WriteZeroes { offset, len } => (o.write_zeroes, offset, len, u64::from(self.card.max_blocks) * b),
            };
            if offset % b != 0 || len % b != 0 {
                io.result = Err(BlockError::Invalid("not aligned to the card's 512-byte blocks"));
                continue;
            }
            if offset.checked_add(len).is_none_or(|end| end > self.size) {
                io.result = Err(BlockError::Invalid("beyond the card's capacity"));
                continue;
            }
            let mut at = 0;
            while at < len {
                let n = per.min(len - at);
                pieces.push(Piece { io: i, opcode, lba: (offset + at) / b, blocks: n / b, at });
                at += n;
            }
            io.result = Ok(len);
        }
        pieces
    }

    /// Posts `group` (at most a ring of commands), rings the doorbell once, waits for all of
    /// them and sets each request's result.
    fn run_group(&mut self, ios: &mut [Io<'_>], group: &[Piece]) -> Result<(), VdevError> {
        let d = self.card.descriptor.clone();
        let r = self.card.registers.clone();
        for (j, p) in group.iter().enumerate() {
            let buf = self.data_offset + j as u64 * self.chunk;
            let len = p.blocks * u64::from(BLOCK);
            if p.opcode == self.card.opcodes.write {
                if let Request::Write { from: bufs, .. } = ios[p.io].req {
                    let mut pos = buf as usize;
                    let part =
                        bufs.range(p.at, len).ok_or_else(|| VdevError::Device("a write's buffers are shorter than it".into()))?;
                    for s in part.iter() {
                        let dst = self.dma.slice(pos, s.len()).map_err(|e| VdevError::Device(e.to_string()))?;
                        s.copy_to_shared(&dst).map_err(|e| VdevError::Device(e.to_string()))?;
                        pos += s.len();
                    }
                }
            }
            let mut desc = [0u8; 64];
            let command = CardCommand {
                opcode: p.opcode,
                tag: j as u64,
                lba: p.lba,
                blocks: p.blocks,
                address: self.card.dma_base + buf,
                // A status the card never writes, so a descriptor it skipped cannot read as done.
                status: crate::card::width_max(d.status.width),
            };
            d.encode(&command, &mut desc);
            let slot = self.ring_offset + (self.tail % ENTRIES) * u64::from(d.size);
            self.dma.write_from(slot as usize, &desc[..d.size as usize]).map_err(|e| VdevError::Device(e.to_string()))?;
            self.tail += 1;
        }
        // The acknowledgement of the last batch's completions rides with this doorbell.
        if self.wait == Wait::Interrupt {
            self.regs.write(r.irq_ack, self.regs.read(r.complete_count));
        }
        self.regs.write(r.submit_tail, self.tail & regs::mask(r.submit_tail));
        let want = self.tail & regs::mask(r.complete_count);
        let t0 = Instant::now();
        let err = 1u64 << self.card.status.error;
        loop {
            if self.regs.read(r.complete_count) == want {
                break;
            }
            if self.regs.read(r.status) & err != 0 {
                return Err(VdevError::Device(format!("the card stopped (ERROR {:#x})", self.regs.read(r.error))));
            }
            let left = CARD_TIMEOUT.saturating_sub(t0.elapsed());
            if left.is_zero() {
                return Err(VdevError::Device("the card did not complete its commands in time".into()));
            }
            match self.wait {
                Wait::Interrupt => {
                    let _ = self.irq.wait(left.as_millis().min(100) as i32);
                    self.irq.drain();
                }
                Wait::Poll => std::thread::yield_now(),
            }
        }
        let k = self.card.codes;
        let first = self.tail - group.len() as u64;
        for (j, p) in group.iter().enumerate() {
            let slot = self.ring_offset + ((first + j as u64) % ENTRIES) * u64::from(d.size);
            let mut desc = [0u8; 64];
            let desc = &mut desc[..d.size as usize];
            self.dma.read_into(slot as usize, desc).map_err(|e| VdevError::Device(e.to_string()))?;
            let status = d.status.get(desc) as u16;
            let io = &mut ios[p.io];
            if status != k.ok {
                let why = if status == k.out_of_range {
                    BlockError::Invalid("beyond the card's capacity")
                } else if status == k.bad_opcode {
                    BlockError::NotSupported("the card's command")
                } else {
                    BlockError::Os { op: "card command", offset: p.lba * u64::from(BLOCK), errno: libc::EIO }
                };
                if io.result.is_ok() {
                    io.result = Err(why);
                }
                continue;
            }
            if p.opcode == self.card.opcodes.read && io.result.is_ok() {
                if let Request::Read { into: bufs, .. } = io.req {
                    let mut pos = (self.data_offset + j as u64 * self.chunk) as usize;
                    let len = p.blocks * u64::from(BLOCK);
                    let part =
                        bufs.range(p.at, len).ok_or_else(|| VdevError::Device("a read's buffers are shorter than it".into()))?;
                    for s in part.iter() {
                        let src = self.dma.slice(pos, s.len()).map_err(|e| VdevError::Device(e.to_string()))?;
                        if src.copy_to_shared(&s).is_err() {
                            io.result = Err(BlockError::Invalid("read into a read-only buffer"));
                            break;
                        }
                        pos += s.len();
                    }
                }
            }
        }
        Ok(())
    }
}

impl Backend for Driver {
    fn size(&self) -> u64 {
        self.size
    }

    fn caps(&self) -> Caps {
        Caps { flush: true, fua: false, discard: true, write_zeroes: true, read_only: false }
    }

    fn remote(&mut self) -> Option<&mut dyn Remote> {
        Some(self)
    }

    fn execute(&mut self, ios: &mut [Io<'_>]) {
        if !self.ready {
            if let Err(e) = self.init() {
                eprintln!("vdev {}: {e}", self.card.name);
                for io in ios.iter_mut() {
                    io.result = Err(BlockError::Os { op: "card reset", offset: 0, errno: libc::EIO });
                }
                return;
            }
        }
        let pieces = self.plan(ios);
        for (g, group) in pieces.chunks(ENTRIES as usize).enumerate() {
            if let Err(e) = self.run_group(ios, group) {
                // The card is in an unknown state: fail this group and the rest, and reset the
                // card before the next batch.
                eprintln!("vdev {}: {e}", self.card.name);
                self.ready = false;
                for p in &pieces[g * ENTRIES as usize..] {
                    ios[p.io].result =
                        Err(BlockError::Os { op: "card command", offset: p.lba * u64::from(BLOCK), errno: libc::EIO });
                }
                return;
            }
        }
    }
}

/// The card is a device of its own, in the model's domain: it is reset before the first
/// request, and a card that fails a command is reset before the next batch.
impl Remote for Driver {
    fn start(&mut self) -> Result<(), SetupError> {
        self.init().map_err(SetupError::of)
    }

    fn lost(&self) -> Option<&str> {
        None
    }
}
