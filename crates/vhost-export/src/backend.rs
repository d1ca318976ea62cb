//! One frontend's session with one device: the vhost-user messages `vhost`'s request handler
//! parses, answered here. It keeps what the frontend has said of each virtqueue and starts a
//! worker for a queue once it has memory, addresses, a kick and (with protocol features) an
//! enable; it stops workers, draining them, when the frontend asks for a queue's base, changes
//! the memory table, resets, or goes away.

use std::fs::File;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;
use std::thread::JoinHandle;

use bulkhead_client::Device;
use bulkhead_sys::eventfd::EventFd;
use vhost::vhost_user::message::{
    VhostTransferStateDirection, VhostTransferStatePhase, VhostUserConfigFlags, VhostUserInflight, VhostUserLog,
    VhostUserMemoryRegion, VhostUserProtocolFeatures, VhostUserShMemConfig, VhostUserSharedMsg, VhostUserSingleMemoryRegion,
    VhostUserVirtioFeatures, VhostUserVringAddrFlags, VhostUserVringState,
};
use vhost::vhost_user::{Error as VuError, GpuBackend, Result as VuResult, VhostUserBackendReqHandlerMut};
use vhost::VhostUserMemoryRegionBase;
use virtio_bindings::virtio_ring::{VIRTIO_RING_F_EVENT_IDX, VIRTIO_RING_F_INDIRECT_DESC};

use crate::blk::{self, Geometry};
use crate::dirty::DirtyLog;
use crate::inflight::{Inflight, InflightQueue};
use crate::memory::GuestMem;
use crate::virtq::{RingAddrs, RingPosition, Vring, MAX_QUEUE_SIZE};
use crate::worker::{self, Notifier, QueueStats, QueueWork, Stop};

/// Largest configuration space read the export answers.
const MAX_CONFIG: u32 = 256;

fn refuse(why: impl Into<String>) -> VuError {
    VuError::ReqHandlerError(io::Error::other(why.into()))
}

/// A running worker.
struct Running {
    stop: Arc<Stop>,
    thread: JoinHandle<RingPosition>,
}

/// What the frontend has said of one virtqueue.
struct Queue {
    size: u16,
    /// Descriptor, used and available areas, as the frontend's virtual addresses.
    addrs: Option<(u64, u64, u64)>,
    /// Where to take up (`SET_VRING_BASE`), and where a stopped worker stood.
    base: u16,
    kick: Option<File>,
    call: Arc<Notifier>,
    err: Arc<Notifier>,
    enabled: bool,
    running: Option<Running>,
    stats: Arc<QueueStats>,
}

impl Queue {
    fn new() -> Queue {
        Queue {
            size: 0,
            addrs: None,
            base: 0,
            kick: None,
            call: Arc::new(Notifier::default()),
            err: Arc::new(Notifier::default()),
            enabled: false,
            running: None,
            stats: Arc::new(QueueStats::default()),
        }
    }
}

/// The session's counters, shared with the export's status.
#[derive(Debug, Default)]
pub struct SessionStats {
    /// Each virtqueue's counters, by index.
    pub queues: std::sync::Mutex<Vec<Arc<QueueStats>>>,
}

/// One frontend's session with a device.
pub struct Session {
    dev: Arc<Device>,
    name: String,
    geo: Arc<Geometry>,
    features: u64,
    protocol: u64,
    mem: Option<Arc<GuestMem>>,
    queues: Vec<Queue>,
    inflight: Option<Arc<Inflight>>,
    /// The frontend's dirty log, which every region of `mem` marks while logging is on.
    log: Arc<DirtyLog>,
}

impl Session {
    /// A session serving `dev` (exported under `name`).
    pub fn new(dev: Arc<Device>, name: &str, stats: Arc<SessionStats>) -> Session {
        let geo = Arc::new(Geometry {
            size: dev.size(),
            block: dev.min_block().max(blk::SECTOR as u32),
            queues: dev.queue_count().min(usize::from(u16::MAX)) as u16,
            max_request: dev.max_request(),
            read_only: dev.read_only(),
            id: name.to_string(),
        });
        let queues = (0..geo.queues).map(|_| Queue::new()).collect::<Vec<_>>();
        *stats.queues.lock().unwrap_or_else(|e| e.into_inner()) = queues.iter().map(|q| q.stats.clone()).collect();
        Session {
            dev,
            name: name.to_string(),
            geo,
            features: 0,
            protocol: 0,
            mem: None,
            queues,
            inflight: None,
            log: Arc::new(DirtyLog::default()),
        }
    }

    fn offered(&self) -> u64 {
        blk::features(self.geo.read_only)
            | VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits()
            | VhostUserVirtioFeatures::LOG_ALL.bits()
    }

    fn queue(&mut self, index: u32) -> VuResult<&mut Queue> {
        self.queues.get_mut(index as usize).ok_or_else(|| refuse(format!("no virtqueue {index}")))
    }

    /// Stops queue `index`'s worker, if it runs, after it has returned every request it took.
    fn stop_queue(&mut self, index: usize) {
        let q = &mut self.queues[index];
        if let Some(r) = q.running.take() {
            r.stop.request();
            match r.thread.join() {
                Ok(at) => q.base = at.next_avail,
                Err(_) => log::info!("vhost-user {}: the worker of queue {index} panicked", self.name),
            }
        }
    }

    /// Stops every worker (draining each).
    pub fn stop_all(&mut self) {
        for i in 0..self.queues.len() {
            self.stop_queue(i);
        }
    }

    /// Starts queue `index`'s worker if the frontend has said all it needs.
    fn try_start(&mut self, index: usize) -> VuResult<()> {
        let protocol_features = self.features & VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits() != 0;
        let q = &self.queues[index];
        let ready =
            q.running.is_none() && q.kick.is_some() && q.addrs.is_some() && q.size > 0 && (q.enabled || !protocol_features);
        let Some(mem) = self.mem.clone().filter(|_| ready) else { return Ok(()) };
        let (desc, used, avail) = q.addrs.expect("checked above");
        let n = u64::from(q.size);
        let place = |user: u64, len: u64, what: &str| {
            mem.guest_of_user(user, len)
                .ok_or_else(|| refuse(format!("virtqueue {index}: the {what} area is outside guest memory")))
        };
        let addrs = RingAddrs {
            desc: place(desc, 16 * n, "descriptor")?,
            avail: place(avail, 6 + 2 * n, "available")?,
            used: place(used, 6 + 8 * n, "used")?,
        };
        let event_idx = self.features & (1 << VIRTIO_RING_F_EVENT_IDX) != 0;
        let indirect = self.features & (1 << VIRTIO_RING_F_INDIRECT_DESC) != 0;
        let mut ring = Vring::new(mem, q.size, addrs, RingPosition { next_avail: q.base, next_used: 0 }, event_idx, indirect)
            .map_err(|e| refuse(format!("virtqueue {index}: {e}")))?;
        let used_idx = ring.used_idx_in_memory().map_err(|e| refuse(format!("virtqueue {index}: {e}")))?;
        let mut at = RingPosition { next_avail: q.base, next_used: used_idx };
        let mut resubmit = Vec::new();
        let inflight = match &self.inflight {
            Some(file) if index < usize::from(file.queues()) && file.size() == q.size => {
                let mut record = InflightQueue::new(file.clone(), index as u16);
                let found = record.recover(used_idx);
                // Every head taken is either used or recorded: the next to take follows them.
                at.next_avail = used_idx.wrapping_add(found.heads.len() as u16);
                resubmit = found.heads;
                if !resubmit.is_empty() {
                    log::info!(
                        "vhost-user {}: queue {index} serves {} requests again from the in-flight record",
                        self.name,
                        resubmit.len()
                    );
                }
                Some(record)
            }
            Some(_) => return Err(refuse(format!("virtqueue {index} does not fit the in-flight record"))),
            None => None,
        };
        ring = Vring::new(ring.memory().clone(), q.size, addrs, at, event_idx, indirect).map_err(|e| refuse(e.to_string()))?;
        let kick = q.kick.as_ref().expect("checked above").try_clone().map_err(VuError::ReqHandlerError)?;
        let kick = OwnedFd::from(kick);
        // A kick is drained only after poll says it rang; never block on one that did not.
        bulkhead_sys::set_nonblocking(kick.as_fd()).map_err(VuError::ReqHandlerError)?;
        let kick = EventFd::from_owned(kick).map_err(VuError::ReqHandlerError)?;
        let stop = Arc::new(Stop::new().map_err(VuError::ReqHandlerError)?);
        let work = QueueWork {
            dev: self.dev.clone(),
            slot: index,
            name: self.name.clone(),
            index: index as u16,
            ring,
            geo: self.geo.clone(),
            inflight,
            resubmit,
            kick,
            call: q.call.clone(),
            err: q.err.clone(),
            stop: stop.clone(),
            stats: q.stats.clone(),
        };
        q.stats.broken.store(false, std::sync::atomic::Ordering::Relaxed);
        let thread = std::thread::Builder::new()
            .name(format!("vhost-{index}"))
            .spawn(move || worker::run(work))
            .map_err(VuError::ReqHandlerError)?;
        self.queues[index].running = Some(Running { stop, thread });
        Ok(())
    }

    fn notifier(fd: Option<File>) -> VuResult<Option<EventFd>> {
        fd.map(|f| EventFd::from_owned(OwnedFd::from(f)).map_err(VuError::ReqHandlerError)).transpose()
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        self.stop_all();
    }
}

impl VhostUserBackendReqHandlerMut for Session {
    fn set_owner(&mut self) -> VuResult<()> {
        Ok(())
    }

    fn reset_owner(&mut self) -> VuResult<()> {
        self.reset_device()
    }

    fn reset_device(&mut self) -> VuResult<()> {
        self.stop_all();
        for q in &mut self.queues {
            let stats = q.stats.clone();
            *q = Queue::new();
            q.stats = stats;
        }
        self.inflight = None;
        self.features = 0;
        self.log.set_logging(false);
        Ok(())
    }

    fn get_features(&mut self) -> VuResult<u64> {
        Ok(self.offered())
    }

    fn set_features(&mut self, features: u64) -> VuResult<()> {
        if features & !self.offered() != 0 {
            return Err(refuse(format!("features {:#x} were not offered", features & !self.offered())));
        }
        let logging = features & VhostUserVirtioFeatures::LOG_ALL.bits() != 0;
        if logging != (self.features & VhostUserVirtioFeatures::LOG_ALL.bits() != 0) {
            log::info!("vhost-user {}: dirty logging {}", self.name, if logging { "on" } else { "off" });
        }
        // QEMU turns logging on and off with the rings running; nothing else may change then,
        // and the workers read the rest once, as they start.
        self.log.set_logging(logging);
        self.features = features;
        Ok(())
    }

    fn set_mem_table(
        &mut self,
        ctx: &[VhostUserMemoryRegion],
        files: Vec<File>,
        _postcopy_listening: Option<bool>,
    ) -> VuResult<Option<Vec<VhostUserMemoryRegionBase>>> {
        let mem = GuestMem::map(ctx, files, &self.log).map_err(|e| refuse(e.to_string()))?;
        let running: Vec<usize> = (0..self.queues.len()).filter(|&i| self.queues[i].running.is_some()).collect();
        for &i in &running {
            self.stop_queue(i);
        }
        self.mem = Some(Arc::new(mem));
        for i in running {
            self.try_start(i)?;
        }
        Ok(None)
    }

    fn set_vring_num(&mut self, index: u32, num: u32) -> VuResult<()> {
        if num == 0 || num > u32::from(MAX_QUEUE_SIZE) || !num.is_power_of_two() {
            return Err(refuse(format!("virtqueue {index}: size {num} is not a power of two up to {MAX_QUEUE_SIZE}")));
        }
        let q = self.queue(index)?;
        if q.running.is_some() {
            return Err(refuse(format!("virtqueue {index} is running")));
        }
        q.size = num as u16;
        Ok(())
    }

    fn set_vring_addr(
        &mut self,
        index: u32,
        _flags: VhostUserVringAddrFlags,
        descriptor: u64,
        used: u64,
        available: u64,
        _log: u64,
    ) -> VuResult<()> {
        // The used ring is logged by the guest address it is written at, which is what the
        // `log` address names (VHOST_VRING_F_LOG); QEMU sends the same addresses again with
        // that flag as it turns logging on, with the ring running.
        let q = self.queue(index)?;
        if q.running.is_some() && q.addrs != Some((descriptor, used, available)) {
            return Err(refuse(format!("virtqueue {index} is running")));
        }
        q.addrs = Some((descriptor, used, available));
        Ok(())
    }

    fn set_vring_base(&mut self, index: u32, base: u32) -> VuResult<()> {
        let q = self.queue(index)?;
        if q.running.is_some() {
            return Err(refuse(format!("virtqueue {index} is running")));
        }
        q.base = u16::try_from(base).map_err(|_| refuse(format!("virtqueue {index}: base {base} is not a 16-bit index")))?;
        Ok(())
    }

    fn get_vring_base(&mut self, index: u32) -> VuResult<VhostUserVringState> {
        self.queue(index)?;
        self.stop_queue(index as usize);
        let q = &mut self.queues[index as usize];
        // A stopped queue starts again only with a new kick.
        q.kick = None;
        Ok(VhostUserVringState::new(index, u32::from(q.base)))
    }

    fn set_vring_kick(&mut self, index: u8, fd: Option<File>) -> VuResult<()> {
        let i = usize::from(index);
        self.queue(u32::from(index))?;
        self.stop_queue(i);
        self.queues[i].kick = fd;
        self.try_start(i)
    }

    fn set_vring_call(&mut self, index: u8, fd: Option<File>) -> VuResult<()> {
        let fd = Self::notifier(fd)?;
        self.queue(u32::from(index))?.call.set(fd);
        Ok(())
    }

    fn set_vring_err(&mut self, index: u8, fd: Option<File>) -> VuResult<()> {
        let fd = Self::notifier(fd)?;
        self.queue(u32::from(index))?.err.set(fd);
        Ok(())
    }

    fn get_protocol_features(&mut self) -> VuResult<VhostUserProtocolFeatures> {
        Ok(VhostUserProtocolFeatures::MQ
            | VhostUserProtocolFeatures::CONFIG
            | VhostUserProtocolFeatures::INFLIGHT_SHMFD
            | VhostUserProtocolFeatures::LOG_SHMFD)
    }

    fn set_protocol_features(&mut self, features: u64) -> VuResult<()> {
        self.protocol = features;
        Ok(())
    }

    fn get_queue_num(&mut self) -> VuResult<u64> {
        Ok(u64::from(self.geo.queues))
    }

    fn set_vring_enable(&mut self, index: u32, enable: bool) -> VuResult<()> {
        self.queue(index)?.enabled = enable;
        if enable {
            self.try_start(index as usize)
        } else {
            self.stop_queue(index as usize);
            Ok(())
        }
    }

    fn get_config(&mut self, offset: u32, size: u32, _flags: VhostUserConfigFlags) -> VuResult<Vec<u8>> {
        let end =
            offset.checked_add(size).filter(|&e| e <= MAX_CONFIG).ok_or_else(|| refuse("configuration read out of range"))?;
        let mut space = blk::config_space(&self.geo);
        space.resize(MAX_CONFIG as usize, 0);
        Ok(space[offset as usize..end as usize].to_vec())
    }

    fn set_config(&mut self, _offset: u32, _buf: &[u8], _flags: VhostUserConfigFlags) -> VuResult<()> {
        Err(refuse("the configuration space is read-only"))
    }

    fn set_gpu_socket(&mut self, _gpu_backend: GpuBackend) -> VuResult<()> {
        Err(VuError::InvalidOperation("not a GPU"))
    }

    fn get_shared_object(&mut self, _uuid: VhostUserSharedMsg) -> VuResult<File> {
        Err(VuError::InvalidOperation("no shared objects"))
    }

    fn get_inflight_fd(&mut self, inflight: &VhostUserInflight) -> VuResult<(VhostUserInflight, File)> {
        let (file, fd, len) = Inflight::create(inflight.num_queues, inflight.queue_size).map_err(|e| refuse(e.to_string()))?;
        self.inflight = Some(file);
        let answer = VhostUserInflight {
            mmap_size: len,
            mmap_offset: 0,
            num_queues: inflight.num_queues,
            queue_size: inflight.queue_size,
        };
        Ok((answer, fd))
    }

    fn set_inflight_fd(&mut self, inflight: &VhostUserInflight, file: File) -> VuResult<()> {
        let f = Inflight::open(&file, inflight.mmap_size, inflight.mmap_offset, inflight.num_queues, inflight.queue_size)
            .map_err(|e| refuse(e.to_string()))?;
        self.inflight = Some(f);
        Ok(())
    }

    fn get_max_mem_slots(&mut self) -> VuResult<u64> {
        Err(VuError::InvalidOperation("memory slots are not offered"))
    }

    fn add_mem_region(
        &mut self,
        _region: &VhostUserSingleMemoryRegion,
        _fd: File,
        _postcopy_listening: Option<bool>,
    ) -> VuResult<Option<VhostUserMemoryRegionBase>> {
        Err(VuError::InvalidOperation("memory slots are not offered"))
    }

    fn remove_mem_region(&mut self, _region: &VhostUserSingleMemoryRegion) -> VuResult<()> {
        Err(VuError::InvalidOperation("memory slots are not offered"))
    }

    fn set_device_state_fd(
        &mut self,
        _direction: VhostTransferStateDirection,
        _phase: VhostTransferStatePhase,
        _fd: File,
    ) -> VuResult<Option<File>> {
        Err(VuError::InvalidOperation("device state transfer is not offered"))
    }

    fn check_device_state(&mut self) -> VuResult<()> {
        Err(VuError::InvalidOperation("device state transfer is not offered"))
    }

    fn get_shmem_config(&mut self) -> VuResult<VhostUserShMemConfig> {
        Err(VuError::InvalidOperation("no shared memory regions"))
    }

    fn set_log_base(&mut self, log: &VhostUserLog, file: File) -> VuResult<()> {
        self.log.set_base(&file, log.mmap_offset, log.mmap_size).map_err(|e| refuse(format!("dirty log: {e}")))
    }
}
