//! A vhost-user-blk frontend of the project's own, playing QEMU and the guest's driver at
//! once: "guest" memory in a sealed memfd of this process, virtqueues written directly, and
//! the protocol spoken through `vhost`'s `Frontend`. `bulkhead-bench vm` drives bulkhead and
//! qemu-storage-daemon with it to measure the servers rather than an emulator, and the tests
//! use its raw calls to write the descriptors a hostile guest would.
//!
//! Memory layout, per queue: descriptor table, available ring, used ring, then one slot per
//! descriptor head: a 16-byte header, the status byte, the chain's indirect table at 2 KiB
//! and the data buffer at 4 KiB.

use std::fs::File;
use std::num::Wrapping;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::atomic::{fence, Ordering};

use vhost::vhost_user::message::{
    VhostUserConfigFlags, VhostUserInflight, VhostUserProtocolFeatures, VhostUserVirtioFeatures, VhostUserVringAddrFlags,
};
use vhost::vhost_user::{Frontend as VuFrontend, VhostUserFrontend};
use vhost::{VhostBackend, VhostUserDirtyLogRegion, VhostUserMemoryRegionInfo, VringConfigData};
use virtio_bindings::virtio_blk::{VIRTIO_BLK_T_FLUSH, VIRTIO_BLK_T_GET_ID, VIRTIO_BLK_T_IN, VIRTIO_BLK_T_OUT};
use virtio_bindings::virtio_ring::{VIRTIO_RING_F_EVENT_IDX, VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
use virtio_queue::desc::split::Descriptor;
use vm_memory::{Address, Bytes, FileOffset, GuestAddress, GuestMemoryBackend, GuestMemoryMmap, GuestRegionMmap, MmapRegion};
use vmm_sys_util::eventfd::EventFd;

use crate::blk::SECTOR;
use crate::dirty::LOG_PAGE;

/// Why the frontend failed.
#[derive(Debug, thiserror::Error)]
pub enum FrontendError {
    /// The backend refused or broke off a message.
    #[error("vhost-user: {0}")]
    Protocol(#[from] vhost::Error),
    /// Setting up this side failed.
    #[error("{0}")]
    Setup(String),
}

fn setup(e: impl std::fmt::Display) -> FrontendError {
    FrontendError::Setup(e.to_string())
}

/// How to set the frontend up.
#[derive(Debug, Clone)]
pub struct FrontendOptions {
    /// Virtqueues.
    pub queues: u16,
    /// Entries of each.
    pub queue_size: u16,
    /// Bytes of each slot's data buffer (the largest request it sends).
    pub slot_bytes: u64,
    /// Negotiate EVENT_IDX if offered.
    pub event_idx: bool,
    /// Ask for an in-flight file if offered.
    pub inflight: bool,
}

impl Default for FrontendOptions {
    fn default() -> Self {
        FrontendOptions { queues: 1, queue_size: 128, slot_bytes: 1 << 20, event_idx: true, inflight: false }
    }
}

/// One virtqueue, driven from this side.
#[derive(Debug)]
pub struct Queue {
    /// Its index.
    pub index: u16,
    /// Entries.
    pub size: u16,
    /// Descriptor table.
    pub desc: GuestAddress,
    /// Available ring.
    pub avail: GuestAddress,
    /// Used ring.
    pub used: GuestAddress,
    slots: GuestAddress,
    slot_bytes: u64,
    kick: EventFd,
    call: EventFd,
    event_idx: bool,
    next_avail: Wrapping<u16>,
    last_used: Wrapping<u16>,
    /// The available index at the last kick.
    kicked: Wrapping<u16>,
    free: Vec<u16>,
    /// Kicks sent.
    pub kicks: u64,
}

/// A completed request: its head, the bytes the device wrote, and the status byte.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Done {
    /// The chain's head.
    pub head: u16,
    /// Bytes written by the device.
    pub len: u32,
    /// The status byte (for chains built by [`Queue::request`]).
    pub status: u8,
}

/// The frontend.
pub struct Frontend {
    conn: VuFrontend,
    mem: GuestMemoryMmap,
    _memfd: File,
    /// The virtqueues.
    pub queues: Vec<Queue>,
    /// Negotiated virtio features.
    pub features: u64,
    /// Negotiated protocol features.
    pub protocol: VhostUserProtocolFeatures,
    /// The in-flight file, if the backend offered one.
    pub inflight: Option<(File, VhostUserInflight)>,
    /// The dirty log shared with the backend while logging (one bit per 4 KiB page).
    log: Option<File>,
}

fn per_queue(size: u16, slot_bytes: u64) -> (u64, u64) {
    let n = u64::from(size);
    let rings = (16 * n + 6 + 2 * n).next_multiple_of(4096) + (6 + 8 * n).next_multiple_of(4096);
    let slot = (16 + 1 + slot_bytes).next_multiple_of(4096);
    (rings, rings + slot * n)
}

impl Frontend {
    /// Connects to the vhost-user-blk socket at `path` and starts every queue.
    pub fn connect(path: &Path, opts: &FrontendOptions) -> Result<Frontend, FrontendError> {
        if opts.queue_size == 0 || !opts.queue_size.is_power_of_two() {
            return Err(setup("queue size must be a power of two"));
        }
        let (_, per) = per_queue(opts.queue_size, opts.slot_bytes);
        let total = per * u64::from(opts.queues);
        let fd = bulkhead_shmem::memfd::create("bulkhead-frontend", total).map_err(setup)?;
        bulkhead_shmem::memfd::seal_size(fd.as_raw_fd()).map_err(setup)?;
        let memfd = File::from(fd);
        let region =
            MmapRegion::from_file(FileOffset::new(memfd.try_clone().map_err(setup)?, 0), total as usize).map_err(setup)?;
        let region = GuestRegionMmap::new(region, GuestAddress(0)).ok_or_else(|| setup("guest region"))?;
        let mem = GuestMemoryMmap::from_regions(vec![region]).map_err(setup)?;
        let mut conn = VuFrontend::connect(path, u64::from(opts.queues))?;
        conn.set_owner()?;
        let offered = conn.get_features()?;
        let mut features = offered
            & (1 << virtio_bindings::virtio_config::VIRTIO_F_VERSION_1
                | 1 << virtio_bindings::virtio_ring::VIRTIO_RING_F_INDIRECT_DESC
                | VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits()
                | 1 << virtio_bindings::virtio_blk::VIRTIO_BLK_F_SEG_MAX
                | 1 << virtio_bindings::virtio_blk::VIRTIO_BLK_F_BLK_SIZE
                | 1 << virtio_bindings::virtio_blk::VIRTIO_BLK_F_FLUSH
                | 1 << virtio_bindings::virtio_blk::VIRTIO_BLK_F_MQ);
        if opts.event_idx {
            features |= offered & (1 << VIRTIO_RING_F_EVENT_IDX);
        }
        conn.set_features(features)?;
        let mut protocol = VhostUserProtocolFeatures::empty();
        if features & VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits() != 0 {
            let wanted = VhostUserProtocolFeatures::MQ
                | VhostUserProtocolFeatures::CONFIG
                | VhostUserProtocolFeatures::REPLY_ACK
                | VhostUserProtocolFeatures::LOG_SHMFD
                | if opts.inflight { VhostUserProtocolFeatures::INFLIGHT_SHMFD } else { VhostUserProtocolFeatures::empty() };
            protocol = conn.get_protocol_features()? & wanted;
            conn.set_protocol_features(protocol)?;
        }
        let region = mem.find_region(GuestAddress(0)).ok_or_else(|| setup("no region"))?;
        let info = VhostUserMemoryRegionInfo::from_guest_region(region)?;
        conn.set_mem_table(&[info])?;
        let inflight = if protocol.contains(VhostUserProtocolFeatures::INFLIGHT_SHMFD) {
            let ask = VhostUserInflight { mmap_size: 0, mmap_offset: 0, num_queues: opts.queues, queue_size: opts.queue_size };
            let (answer, file) = conn.get_inflight_fd(&ask)?;
            conn.set_inflight_fd(&answer, file.as_raw_fd())?;
            Some((file, answer))
        } else {
            None
        };
        let event_idx = features & (1 << VIRTIO_RING_F_EVENT_IDX) != 0;
        let mut queues = Vec::new();
        let host_base = region.as_ptr() as u64;
        for q in 0..opts.queues {
            let base = GuestAddress(per * u64::from(q));
            let n = u64::from(opts.queue_size);
            let desc = base;
            let avail = base.unchecked_add(16 * n);
            let used = base.unchecked_add((16 * n + 6 + 2 * n).next_multiple_of(4096));
            let (rings, _) = per_queue(opts.queue_size, opts.slot_bytes);
            let queue = Queue {
                index: q,
                size: opts.queue_size,
                desc,
                avail,
                used,
                slots: base.unchecked_add(rings),
                slot_bytes: opts.slot_bytes,
                kick: EventFd::new(libc::EFD_NONBLOCK).map_err(setup)?,
                call: EventFd::new(libc::EFD_NONBLOCK).map_err(setup)?,
                event_idx,
                next_avail: Wrapping(0),
                last_used: Wrapping(0),
                kicked: Wrapping(0),
                free: (0..opts.queue_size).rev().collect(),
                kicks: 0,
            };
            let i = usize::from(q);
            conn.set_vring_num(i, opts.queue_size)?;
            let cfg = VringConfigData {
                queue_max_size: opts.queue_size,
                queue_size: opts.queue_size,
                flags: 0,
                desc_table_addr: host_base + desc.raw_value(),
                used_ring_addr: host_base + used.raw_value(),
                avail_ring_addr: host_base + avail.raw_value(),
                log_addr: None,
            };
            conn.set_vring_addr(i, &cfg)?;
            conn.set_vring_base(i, 0)?;
            conn.set_vring_call(i, &queue.call)?;
            conn.set_vring_kick(i, &queue.kick)?;
            queues.push(queue);
        }
        let me = Frontend { conn, mem, _memfd: memfd, queues, features, protocol, inflight, log: None };
        for q in &me.queues {
            // Hear of used entries only when asked: this side polls.
            me.mem.write_obj(0x8000u16, q.avail.unchecked_add(4 + 2 * u64::from(q.size))).map_err(setup)?;
        }
        let mut me = me;
        if features & VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits() != 0 {
            for i in 0..me.queues.len() {
                me.conn.set_vring_enable(i, true)?;
            }
        }
        Ok(me)
    }

    /// The device's configuration space, `size` bytes.
    pub fn config(&mut self, size: u32) -> Result<Vec<u8>, FrontendError> {
        let buf = vec![0u8; size as usize];
        let (_, payload) = self.conn.get_config(0, size, VhostUserConfigFlags::empty(), &buf)?;
        Ok(payload)
    }

    /// The capacity in bytes, from the configuration space.
    pub fn capacity(&mut self) -> Result<u64, FrontendError> {
        let c = self.config(8)?;
        Ok(u64::from_le_bytes(c[0..8].try_into().expect("eight bytes")) * SECTOR)
    }

    /// Stops queue `i` (`GET_VRING_BASE`): the backend answers once every request it took is
    /// back. Returns the base.
    pub fn stop_queue(&mut self, i: usize) -> Result<u32, FrontendError> {
        Ok(self.conn.get_vring_base(i)?)
    }

    /// Turns dirty logging on as QEMU does when a migration starts: shares a log of one bit
    /// per 4 KiB page of this side's memory (`SET_LOG_BASE`), sets `VHOST_F_LOG_ALL`, and
    /// sends each ring's addresses again with `VHOST_VRING_F_LOG`, the rings running.
    pub fn start_logging(&mut self) -> Result<(), FrontendError> {
        if !self.protocol.contains(VhostUserProtocolFeatures::LOG_SHMFD) {
            return Err(setup("the backend does not offer LOG_SHMFD"));
        }
        let pages = self.mem.last_addr().raw_value() / LOG_PAGE + 1;
        let bytes = pages.div_ceil(8).next_multiple_of(4096);
        let fd = bulkhead_shmem::memfd::create("bulkhead-frontend-log", bytes).map_err(setup)?;
        let file = File::from(fd);
        let region = VhostUserDirtyLogRegion { mmap_size: bytes, mmap_offset: 0, mmap_handle: file.as_raw_fd() };
        self.conn.set_log_base(0, Some(region))?;
        self.conn.set_features(self.features | VhostUserVirtioFeatures::LOG_ALL.bits())?;
        let host_base = self.mem.find_region(GuestAddress(0)).ok_or_else(|| setup("no region"))?.as_ptr() as u64;
        for (i, q) in self.queues.iter().enumerate() {
            let cfg = VringConfigData {
                queue_max_size: q.size,
                queue_size: q.size,
                flags: VhostUserVringAddrFlags::VHOST_VRING_F_LOG.bits(),
                desc_table_addr: host_base + q.desc.raw_value(),
                used_ring_addr: host_base + q.used.raw_value(),
                avail_ring_addr: host_base + q.avail.raw_value(),
                log_addr: Some(q.used.raw_value()),
            };
            self.conn.set_vring_addr(i, &cfg)?;
        }
        self.log = Some(file);
        Ok(())
    }

    /// Turns dirty logging off (clears `VHOST_F_LOG_ALL`), as QEMU does after a migration
    /// that failed or was cancelled. The log stays readable here.
    pub fn stop_logging(&mut self) -> Result<(), FrontendError> {
        self.conn.set_features(self.features)?;
        Ok(())
    }

    /// Whether the page holding `addr` is marked in the dirty log.
    pub fn logged(&self, addr: GuestAddress) -> Result<bool, FrontendError> {
        let log = self.log.as_ref().ok_or_else(|| setup("logging was never started"))?;
        let page = addr.raw_value() / LOG_PAGE;
        let mut byte = [0u8];
        log.read_exact_at(&mut byte, page / 8).map_err(setup)?;
        Ok(byte[0] & (1 << (page % 8)) != 0)
    }

    /// Pages marked in the dirty log, by guest address, and clears it (QEMU's sync at each
    /// pass of a migration, which swaps each word atomically; this reads and clears the whole
    /// log, so call it with no request in flight).
    pub fn take_log(&self) -> Result<Vec<GuestAddress>, FrontendError> {
        let log = self.log.as_ref().ok_or_else(|| setup("logging was never started"))?;
        let mut bytes = vec![0u8; log.metadata().map_err(setup)?.len() as usize];
        log.read_exact_at(&mut bytes, 0).map_err(setup)?;
        log.write_all_at(&vec![0u8; bytes.len()], 0).map_err(setup)?;
        let mut pages = Vec::new();
        for (i, b) in bytes.iter().enumerate().filter(|(_, b)| **b != 0) {
            for bit in (0..8).filter(|bit| b & (1 << bit) != 0) {
                pages.push(GuestAddress((i as u64 * 8 + bit) * LOG_PAGE));
            }
        }
        Ok(pages)
    }

    /// The "guest" memory.
    pub fn memory(&self) -> &GuestMemoryMmap {
        &self.mem
    }

    /// Queue `i` and the memory, for driving it.
    pub fn queue(&mut self, i: usize) -> (&mut Queue, &GuestMemoryMmap) {
        (&mut self.queues[i], &self.mem)
    }
}

fn mem_err(e: impl std::fmt::Display) -> FrontendError {
    FrontendError::Setup(format!("guest memory: {e}"))
}

impl Queue {
    /// Slot `head`'s header, status byte and data buffer.
    pub fn slot(&self, head: u16) -> (GuestAddress, GuestAddress, GuestAddress) {
        let at = self.slots.unchecked_add(u64::from(head) * (16 + 1 + self.slot_bytes).next_multiple_of(4096));
        (at, at.unchecked_add(16), at.unchecked_add(4096))
    }

    /// Where slot `head` keeps the indirect table of its chain.
    pub fn slot_table(&self, head: u16) -> GuestAddress {
        self.slot(head).0.unchecked_add(2048)
    }

    /// Free heads.
    pub fn free(&self) -> usize {
        self.free.len()
    }

    /// Writes descriptor `i` of the table.
    pub fn write_desc(&self, mem: &GuestMemoryMmap, i: u16, d: Descriptor) -> Result<(), FrontendError> {
        mem.write_obj(d, self.desc.unchecked_add(16 * u64::from(i))).map_err(mem_err)
    }

    /// Makes `head` available (not yet visible: [`publish`](Self::publish)).
    pub fn offer(&mut self, mem: &GuestMemoryMmap, head: u16) -> Result<(), FrontendError> {
        let slot = u64::from(self.next_avail.0 % self.size);
        mem.write_obj(head, self.avail.unchecked_add(4 + 2 * slot)).map_err(mem_err)?;
        self.next_avail += 1;
        Ok(())
    }

    /// Sets the available index to `idx` whatever was offered (a hostile driver's move).
    pub fn force_avail_idx(&mut self, mem: &GuestMemoryMmap, idx: u16) -> Result<(), FrontendError> {
        self.next_avail = Wrapping(idx);
        self.publish(mem)
    }

    /// Publishes what was offered and kicks if the device asked for it.
    pub fn publish(&mut self, mem: &GuestMemoryMmap) -> Result<(), FrontendError> {
        mem.store(self.next_avail.0, self.avail.unchecked_add(2), Ordering::Release).map_err(mem_err)?;
        fence(Ordering::SeqCst);
        let kick = if self.event_idx {
            let event: u16 =
                mem.load(self.used.unchecked_add(4 + 8 * u64::from(self.size)), Ordering::Relaxed).map_err(mem_err)?;
            let (new, old) = (self.next_avail, self.kicked);
            (new - Wrapping(event) - Wrapping(1)).0 < (new - old).0
        } else {
            let flags: u16 = mem.load(self.used, Ordering::Relaxed).map_err(mem_err)?;
            flags & 1 == 0
        };
        self.kicked = self.next_avail;
        if kick {
            self.kicks += 1;
            self.kick.write(1).map_err(setup)?;
        }
        Ok(())
    }

    /// Builds a request in a free head's slot: a header, `len` bytes of data (device-written
    /// for a read, `fill` for a write), and the status byte; returns the head.
    pub fn request(
        &mut self,
        mem: &GuestMemoryMmap,
        kind: u32,
        sector: u64,
        len: u32,
        fill: u8,
    ) -> Result<Option<u16>, FrontendError> {
        let Some(head) = self.free.pop() else { return Ok(None) };
        let (hdr, status, data) = self.slot(head);
        let mut h = [0u8; 16];
        h[0..4].copy_from_slice(&kind.to_le_bytes());
        h[8..16].copy_from_slice(&sector.to_le_bytes());
        mem.write_slice(&h, hdr).map_err(mem_err)?;
        mem.write_obj(0xffu8, status).map_err(mem_err)?;
        // The chain is an indirect table in the slot: header, data (if any), status.
        let next = VRING_DESC_F_NEXT as u16;
        let write = VRING_DESC_F_WRITE as u16;
        let mut descs = vec![Descriptor::new(hdr.raw_value(), 16, next, 1)];
        if len > 0 {
            if kind == VIRTIO_BLK_T_OUT {
                mem.write_slice(&vec![fill; len as usize], data).map_err(mem_err)?;
            }
            let data_flags = if kind == VIRTIO_BLK_T_IN || kind == VIRTIO_BLK_T_GET_ID { write } else { 0 };
            descs.push(Descriptor::new(data.raw_value(), len, data_flags | next, 2));
        }
        descs.push(Descriptor::new(status.raw_value(), 1, write, 0));
        let table = self.slot_table(head);
        for (i, d) in descs.iter().enumerate() {
            mem.write_obj(*d, table.unchecked_add(16 * i as u64)).map_err(mem_err)?;
        }
        let indirect = virtio_bindings::virtio_ring::VRING_DESC_F_INDIRECT as u16;
        self.write_desc(mem, head, Descriptor::new(table.raw_value(), 16 * descs.len() as u32, indirect, 0))?;
        self.offer(mem, head)?;
        Ok(Some(head))
    }

    /// A read of `len` bytes at `sector`.
    pub fn read(&mut self, mem: &GuestMemoryMmap, sector: u64, len: u32) -> Result<Option<u16>, FrontendError> {
        self.request(mem, VIRTIO_BLK_T_IN, sector, len, 0)
    }

    /// A write of `len` bytes of `fill` at `sector`.
    pub fn write(&mut self, mem: &GuestMemoryMmap, sector: u64, len: u32, fill: u8) -> Result<Option<u16>, FrontendError> {
        self.request(mem, VIRTIO_BLK_T_OUT, sector, len, fill)
    }

    /// A flush.
    pub fn flush(&mut self, mem: &GuestMemoryMmap) -> Result<Option<u16>, FrontendError> {
        self.request(mem, VIRTIO_BLK_T_FLUSH, 0, 0, 0)
    }

    /// GET_ID into a 20-byte buffer.
    pub fn get_id(&mut self, mem: &GuestMemoryMmap) -> Result<Option<u16>, FrontendError> {
        self.request(mem, VIRTIO_BLK_T_GET_ID, 0, 20, 0)
    }

    /// Takes back a head of a chain this side built by hand (not through `request`).
    pub fn take_head(&mut self, head: u16) -> bool {
        match self.free.iter().position(|&h| h == head) {
            Some(i) => {
                self.free.swap_remove(i);
                true
            }
            None => false,
        }
    }

    /// Delivers every used entry that has arrived: `f(done)`; frees the heads. Returns how many.
    pub fn reap(&mut self, mem: &GuestMemoryMmap, mut f: impl FnMut(Done)) -> Result<usize, FrontendError> {
        let idx: u16 = mem.load(self.used.unchecked_add(2), Ordering::Acquire).map_err(mem_err)?;
        let mut n = 0;
        while self.last_used.0 != idx {
            let slot = u64::from(self.last_used.0 % self.size);
            let elem: [u32; 2] = mem.read_obj(self.used.unchecked_add(4 + 8 * slot)).map_err(mem_err)?;
            self.last_used += 1;
            let head = elem[0] as u16;
            let status = if head < self.size { mem.read_obj::<u8>(self.slot(head).1).map_err(mem_err)? } else { 0xff };
            if head < self.size && !self.free.contains(&head) {
                self.free.push(head);
            }
            f(Done { head, len: elem[1], status });
            n += 1;
        }
        // Hear of entries only when asked, well ahead of where this side is.
        mem.write_obj(self.last_used.0.wrapping_add(0x8000), self.avail.unchecked_add(4 + 2 * u64::from(self.size)))
            .map_err(mem_err)?;
        Ok(n)
    }

    /// Sleeps, as a guest's driver does, until the device calls or `timeout_ms` passes: asks
    /// for a call at the next used entry, and returns at once if one arrived meanwhile.
    pub fn wait_used(&mut self, mem: &GuestMemoryMmap, timeout_ms: i32) -> Result<(), FrontendError> {
        let used_event = self.avail.unchecked_add(4 + 2 * u64::from(self.size));
        mem.store(self.last_used.0, used_event, Ordering::Release).map_err(mem_err)?;
        fence(Ordering::SeqCst);
        if self.used_idx(mem)? != self.last_used.0 {
            return Ok(());
        }
        let mut fds = [libc::pollfd { fd: self.call.as_raw_fd(), events: libc::POLLIN, revents: 0 }];
        let _ = bulkhead_sys::poll(&mut fds, timeout_ms);
        let _ = self.call.read();
        Ok(())
    }

    /// The used index as the device left it.
    pub fn used_idx(&self, mem: &GuestMemoryMmap) -> Result<u16, FrontendError> {
        mem.load(self.used.unchecked_add(2), Ordering::Acquire).map_err(mem_err)
    }

    /// Calls (interrupts) the device sent since the last look.
    pub fn calls(&self) -> u64 {
        self.call.read().unwrap_or(0)
    }
}
