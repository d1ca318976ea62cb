//! The card's model: what the card does when its registers change.
//!
//! The model owns the card's state (enabled, the ring it was given, how far it has got, an
//! error that stopped it) and looks at the register page after each trapped write
//! ([`Model::step`]). Everything it reads there or in DMA memory comes from the driver and is
//! checked: a register a driver may not write is put back, a ring or a transfer outside DMA
//! memory is refused, a descriptor is copied once and then decoded. Mistakes are answered as a
//! card answers them (a status code in the descriptor, ERROR and an interrupt), never by
//! stopping the model.

use bulkhead_block::{Backend, Io, Request, SliceList};
use bulkhead_doorbell::EventFd;
use bulkhead_shmem::Mapping;

use crate::card::{Card, BLOCK};
use crate::regs::{self, RegisterPage};

/// What the model has done, for status and tests.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ModelStats {
    /// Descriptors completed (with any status).
    pub commands: u64,
    /// Descriptors completed with a status other than OK.
    pub refused: u64,
    /// Times the card stopped on an error (ERROR set).
    pub stops: u64,
    /// Interrupts raised.
    pub interrupts: u64,
    /// Writes to read-only registers, undone.
    pub ignored_writes: u64,
    /// Resets.
    pub resets: u64,
    /// Times [`Model::step`] ran.
    pub steps: u64,
}

/// A card's model over its register page (the model's own, untrapped mapping), the DMA
/// memory granted to it, the storage behind it and the interrupt line.
pub struct Model {
    card: Card,
    regs: RegisterPage,
    dma: Mapping,
    media: Box<dyn Backend>,
    irq: EventFd,
    capacity_blocks: u64,
    enabled: bool,
    stopped: bool,
    error_code: u32,
    ring_offset: u64,
    entries: u64,
    /// Descriptors taken from the ring, free-running.
    head: u64,
    /// Descriptors completed, free-running.
    completed: u64,
    /// COMPLETE_COUNT when the interrupt was last raised.
    signalled: u64,
    stats: ModelStats,
}

impl std::fmt::Debug for Model {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Model").field("card", &self.card.name).field("stats", &self.stats).finish_non_exhaustive()
    }
}

impl Model {
    /// A powered-on card of `card` over `media`, its registers at their reset values.
    pub fn new(card: Card, regs: RegisterPage, dma: Mapping, media: Box<dyn Backend>, irq: EventFd) -> Self {
        let capacity_blocks = media.size() / u64::from(BLOCK);
        let mut m = Model {
            card,
            regs,
            dma,
            media,
            irq,
            capacity_blocks,
            enabled: false,
            stopped: false,
            error_code: 0,
            ring_offset: 0,
            entries: 0,
            head: 0,
            completed: 0,
            signalled: 0,
            stats: ModelStats::default(),
        };
        m.reset();
        m.stats.resets = 0;
        m
    }

    /// The card.
    pub fn card(&self) -> &Card {
        &self.card
    }

    /// What the model has done.
    pub fn stats(&self) -> ModelStats {
        self.stats
    }

    /// The register page (the model's mapping).
    pub fn registers(&self) -> &RegisterPage {
        &self.regs
    }

    /// Every register to its reset value; the ring forgotten.
    ///
    /// A driver polls CONTROL's reset bit and then reads ID, so every register holds its
    /// reset value (never a passing 0 in ID or CAPACITY) before CONTROL is cleared, last.
    fn reset(&mut self) {
        let r = &self.card.registers;
        for (_, reg) in r.all() {
            let value = if reg == r.id {
                self.card.id()
            } else if reg == r.capacity {
                self.capacity_blocks
            } else {
                0
            };
            if reg != r.control {
                self.regs.write(reg, value);
            }
        }
        self.regs.write(r.control, 0);
        self.enabled = false;
        self.stopped = false;
        self.error_code = 0;
        self.ring_offset = 0;
        self.entries = 0;
        self.head = 0;
        self.completed = 0;
        self.signalled = 0;
        self.stats.resets += 1;
    }

    /// The value STATUS should hold.
    fn status_value(&self) -> u64 {
        let s = self.card.status;
        (u64::from(self.enabled && !self.stopped) << s.ready) | (u64::from(self.stopped) << s.error)
    }

    /// Puts back every register the driver may not write, counting the writes undone.
    fn restore_read_only(&mut self) {
        let r = self.card.registers.clone();
        let want = [
            (r.id, self.card.id()),
            (r.capacity, self.capacity_blocks),
            (r.status, self.status_value()),
            (r.error, u64::from(self.error_code)),
            (r.complete_count, self.completed & regs::mask(r.complete_count)),
        ];
        for (reg, v) in want {
            if self.regs.read(reg) != v {
                self.regs.write(reg, v);
                self.stats.ignored_writes += 1;
            }
        }
    }

    /// Stops the card with `code` in ERROR, and interrupts.
    fn stop(&mut self, code: u32) {
        self.stopped = true;
        self.error_code = code;
        self.stats.stops += 1;
        self.regs.write(self.card.registers.error, u64::from(code));
        self.regs.write(self.card.registers.status, self.status_value());
        self.interrupt();
    }

    fn interrupt(&mut self) {
        let c = self.card.control;
        if self.regs.read(self.card.registers.control) >> c.irq_enable & 1 == 1 {
            self.irq.ring();
            self.stats.interrupts += 1;
            self.signalled = self.completed;
        }
    }

    /// Acts on the registers as they are now: called after every trapped write (and may be
    /// called at any other time; it does nothing when nothing changed).
    pub fn step(&mut self) {
        self.stats.steps += 1;
        let r = self.card.registers.clone();
        let c = self.card.control;
        let control = self.regs.read(r.control);
        let known = 1u64 << c.enable | 1u64 << c.reset | 1u64 << c.irq_enable;
        if control >> c.reset & 1 == 1 {
            // Reset clears everything, the reset bit included, as the datasheet says.
            self.reset();
            return;
        }
        self.restore_read_only();
        if self.stopped {
            return;
        }
        if control & !known != 0 {
            return self.stop(self.card.errors.reserved_bits);
        }
        let enable = control >> c.enable & 1 == 1;
        if enable && !self.enabled {
            match self.ring(self.regs.read(r.queue_base), self.regs.read(r.queue_entries)) {
                Some((offset, entries)) => {
                    self.ring_offset = offset;
                    self.entries = entries;
                    self.enabled = true;
                    self.regs.write(r.status, self.status_value());
                }
                None => return self.stop(self.card.errors.bad_queue),
            }
        } else if !enable && self.enabled {
            self.enabled = false;
            self.regs.write(r.status, self.status_value());
        }
        if !self.enabled {
            return;
        }
        let tmask = regs::mask(r.submit_tail);
        let tail = self.regs.read(r.submit_tail);
        let pending = tail.wrapping_sub(self.head) & tmask;
        if pending > self.entries {
            return self.stop(self.card.errors.bad_tail);
        }
        for _ in 0..pending {
            self.serve_one();
            if self.completed - self.signalled >= u64::from(self.card.irq_coalesce) {
                self.interrupt();
            }
        }
        // The line stays raised while completions are unacknowledged: an acknowledgement that
        // leaves some unseen raises it again.
        let cmask = regs::mask(r.complete_count);
        let acked = self.regs.read(r.irq_ack) & regs::mask(r.irq_ack);
        let unacked = (self.completed & cmask) != (acked & cmask);
        if self.completed != self.signalled || (pending == 0 && unacked) {
            self.interrupt();
        }
    }

    /// The ring QUEUE_BASE and QUEUE_ENTRIES describe, as (offset in DMA memory, entries), if
    /// it is one: a power of two of at most 4096 entries, aligned to a descriptor, all inside
    /// DMA memory.
    fn ring(&self, base: u64, entries: u64) -> Option<(u64, u64)> {
        let size = u64::from(self.card.descriptor.size);
        if entries == 0 || !entries.is_power_of_two() || entries > 4096 {
            return None;
        }
        let offset = base.checked_sub(self.card.dma_base)?;
        if offset % size != 0 || offset.checked_add(entries * size)? > self.dma.len() as u64 {
            return None;
        }
        Some((offset, entries))
    }

    /// Takes the descriptor at the head, does it, writes its status, counts it complete.
    fn serve_one(&mut self) {
        let d = self.card.descriptor.clone();
        let size = d.size as usize;
        let at = (self.ring_offset + (self.head % self.entries) * d.size as u64) as usize;
        // One copy of the descriptor, then only the copy is read (no double fetch).
        let mut desc = [0u8; 64];
        let desc = &mut desc[..size];
        // The ring was checked to lie inside DMA memory when the card was enabled.
        let _ = self.dma.read_into(at, desc);
        let status = self.execute(desc);
        if status != self.card.codes.ok {
            self.stats.refused += 1;
        }
        // Only the status field goes back: the rest of the descriptor is the driver's.
        d.status.put(desc, u64::from(status));
        let field = d.status.offset as usize..d.status.offset as usize + d.status.width as usize;
        let _ = self.dma.write_from(at + field.start, &desc[field]);
        self.head += 1;
        self.completed += 1;
        self.stats.commands += 1;
        let r = &self.card.registers;
        self.regs.write(r.complete_count, self.completed & regs::mask(r.complete_count));
    }

    /// Does one command; its status code.
    fn execute(&mut self, desc: &[u8]) -> u16 {
        let d = &self.card.descriptor;
        let (o, k) = (self.card.opcodes, self.card.codes);
        let opcode = d.opcode.get(desc) as u8;
        let lba = d.lba.get(desc);
        let blocks = d.blocks.get(desc);
        let address = d.address.get(desc);
        if opcode == o.flush {
            let mut io = [Io::new(Request::Flush)];
            self.media.execute(&mut io);
            return if io[0].result.is_ok() { k.ok } else { k.media_error };
        }
        if ![o.read, o.write, o.discard, o.write_zeroes].contains(&opcode) {
            return k.bad_opcode;
        }
        if blocks == 0 || blocks > u64::from(self.card.max_blocks) {
            return k.bad_length;
        }
        if lba.checked_add(blocks).is_none_or(|end| end > self.capacity_blocks) {
            return k.out_of_range;
        }
        let (offset, len) = (lba * u64::from(BLOCK), blocks * u64::from(BLOCK));
        if opcode == o.discard || opcode == o.write_zeroes {
            let req = if opcode == o.discard { Request::Discard { offset, len } } else { Request::WriteZeroes { offset, len } };
            let mut io = [Io::new(req)];
            self.media.execute(&mut io);
            return if io[0].result.is_ok() { k.ok } else { k.media_error };
        }
        let Some(buf) = address.checked_sub(self.card.dma_base).and_then(|a| self.dma.slice(a as usize, len as usize).ok())
        else {
            return k.bad_address;
        };
        let bufs = SliceList::one(buf);
        let req = if opcode == o.read {
            Request::Read { offset, into: bufs }
        } else {
            Request::Write { offset, from: bufs, fua: false }
        };
        let mut io = [Io::new(req)];
        self.media.execute(&mut io);
        match io[0].result {
            Ok(_) => k.ok,
            Err(_) => k.media_error,
        }
    }
}
