//! Building a domain from its spec and the descriptors it inherited.

use bulkhead_filters::FilterFds;
use bulkhead_spec::{BackendSpec, DomainSpec};
use bulkhead_sys::uring::{LentRing, PARAMS_BYTES};
use std::os::fd::OwnedFd;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use bulkhead_backends::{
    ChannelBackend, Engine, FileBackend, ImageLayer, NbdBackend, NullBackend, Qcow2Backend, RamBackend, RbdBackend, RbdOptions,
};
use bulkhead_block::{Backend, Chain, Layer};
use bulkhead_channel::{AboveControl, BackQueue, BackQueueFds, BelowControl, ForwardQueueFds, FrontQueue, QueueConfig};
use bulkhead_ring::ArenaSizes;

use crate::{guarded, Domain, DriverError};

/// Spins a tap domain's wait on the domain below makes before it starts yielding the CPU.
const YIELD_AFTER_SPINS: u32 = 64;

/// Takes ownership of an inherited descriptor named in the spec.
///
/// # Safety
/// `fd` must be open, inherited for this purpose, and claimed only once.
unsafe fn claim(fd: i32) -> Result<OwnedFd, DriverError> {
    // SAFETY: forwarded from this function's contract.
    unsafe { bulkhead_sys::claim_inherited(fd) }
        .map_err(|_| DriverError::Setup(format!("descriptor {fd} named in the spec is not open")))
}

/// [`claim`] for a descriptor the spec may leave out.
///
/// # Safety
/// As for [`claim`], when `fd` is `Some`.
unsafe fn claim_opt(fd: Option<i32>) -> Result<Option<OwnedFd>, DriverError> {
    // SAFETY: forwarded from this function's contract.
    fd.map(|fd| unsafe { claim(fd) }).transpose()
}

/// Builds the domain `spec` describes from descriptors inherited at exec.
///
/// # Safety
/// Every descriptor named in the spec must be inherited for this domain and not used by
/// anything else in the process.
pub unsafe fn build_inherited(spec: &DomainSpec, stop: Arc<AtomicBool>) -> Result<Domain, DriverError> {
    // SAFETY: forwarded from this function's contract.
    unsafe { build_with(spec, stop, &|f, rings| guarded::build_filters(f, rings)) }
}

/// As [`build_inherited`], with each filter's layer handed to `wrap` first
/// ([`guarded::build_filters_wrapping`]; some filter must be guarded).
///
/// # Safety
/// As for [`build_inherited`].
// SAFETY: callers keep the contract in `# Safety`, which is `build_inherited`'s.
pub unsafe fn build_inherited_wrapping(
    spec: &DomainSpec,
    stop: Arc<AtomicBool>,
    wrap: guarded::Wrap<'_>,
) -> Result<Domain, DriverError> {
    // SAFETY: the descriptors are as this function's contract says, which is all `build_with` asks.
    unsafe { build_with(spec, stop, &|f, rings| guarded::build_filters_wrapping(f, rings, wrap)) }
}

/// How a domain's filters are built over its queues' rings.
type FilterBuilder<'a> = &'a dyn Fn(Vec<guarded::FilterParts>, &[(u64, u64)]) -> Result<Vec<Box<dyn Layer>>, String>;

/// [`build_inherited`], with the filters built by `filters`.
///
/// # Safety
/// As for [`build_inherited`].
unsafe fn build_with(spec: &DomainSpec, stop: Arc<AtomicBool>, filters: FilterBuilder<'_>) -> Result<Domain, DriverError> {
    let this = spec;
    let lower_stop = stop.clone();
    // Write capture: every allocation from here on comes from a heap space, the runtime's or
    // a filter's, so each filter's state lies in pages of its own.
    if this.filters.iter().any(|f| f.guard.wanted()) {
        let r = bulkhead_guard::heap::Reservation::new(1 + this.filters.len())
            .map_err(|e| DriverError::Setup(format!("write capture: heap: {e}")))?;
        let guards: Vec<_> = this.filters.iter().map(|f| f.guard).collect();
        guarded::prepare_heap(r, &guards).map_err(DriverError::Setup)?;
    }
    let mode = this.notify_mode().map_err(|e| DriverError::Setup(e.to_string()))?;
    let view_size = |view: Option<u32>| match view {
        None => Ok(this.size),
        Some(v) => this
            .views
            .get(v as usize)
            .map(|v| v.size)
            .ok_or_else(|| DriverError::Setup(format!("a queue names view {v}; the spec gives {}", this.views.len()))),
    };
    // The rings first, each mapped right after the last, so that they lie side by side and
    // write capture shuts them in one range; the arenas after them.
    let mut claimed = Vec::with_capacity(this.queues.len());
    for q in &this.queues {
        // SAFETY: forwarded from this function's contract.
        let [ring, write_arena, read_arena, kick, irq] = q.fds.map(|fd| unsafe { claim(fd) });
        let fds = BackQueueFds { ring: ring?, write_arena: write_arena?, read_arena: read_arena?, kick: kick?, irq: irq? };
        let ring = BackQueue::map_ring(&fds, q.nslots).map_err(|e| DriverError::Setup(e.to_string()))?;
        claimed.push((q, fds, ring));
    }
    let mut queues = Vec::with_capacity(this.queues.len());
    for (q, fds, ring) in claimed {
        let arenas = ArenaSizes { write: q.arena_bytes, read: q.arena_bytes };
        // A queue of a view takes requests within the view only: its ring checks them
        // against the view's size, and the domain moves them by its offset.
        let size = view_size(q.view)?;
        queues.push(BackQueue::from_mapped(ring, fds, arenas, size).map_err(|e| DriverError::Setup(e.to_string()))?);
    }
    let setup = |e: bulkhead_backends::BackendError| DriverError::Setup(e.to_string());
    let standby = this.standby_fd.is_some();
    // A standby tap domain's own handle on its line: it is told there what to take over.
    let mut takeover = None;
    let backend: Box<dyn Backend> = match &this.backend {
        // SAFETY: forwarded from this function's contract.
        BackendSpec::Ram { fd } => Box::new(RamBackend::new(unsafe { claim(*fd)? }, this.backend_size).map_err(setup)?),
        BackendSpec::File { fd, buffered_fd, read_only, engine, ring } => {
            let engine = match (engine.as_str(), ring) {
                ("sync", None) => Engine::Sync,
                ("io_uring", Some(r)) => {
                    let params = r.params.as_slice().try_into().map_err(|_| {
                        DriverError::Setup(format!("the lent ring's parameters are {} bytes, not {PARAMS_BYTES}", r.params.len()))
                    })?;
                    // SAFETY: forwarded from this function's contract: the supervisor lent
                    // the ring with these parameters and passed both descriptors for this
                    // domain alone.
                    let [ring_fd, wake] = r.fds.map(|fd| unsafe { claim(fd) });
                    // SAFETY: as above.
                    Engine::IoUring(unsafe { LentRing::from_parts(ring_fd?, wake?, params) })
                }
                ("io_uring", None) => return Err(DriverError::Setup("the io_uring engine needs a lent ring".into())),
                ("sync", Some(_)) => return Err(DriverError::Setup("the sync engine takes no ring".into())),
                (other, _) => return Err(DriverError::Setup(format!("unknown engine `{other}`"))),
            };
            // SAFETY: forwarded from this function's contract.
            let main = unsafe { claim(*fd)? };
            // SAFETY: as above.
            let buffered = unsafe { claim_opt(*buffered_fd)? };
            Box::new(FileBackend::new(main, buffered, *read_only, engine).map_err(setup)?)
        }
        BackendSpec::Qcow2 { layers, read_only } => {
            let mut images = Vec::with_capacity(layers.len());
            for (fd, format) in layers {
                let format = bulkhead_image::Format::parse(format)
                    .ok_or_else(|| DriverError::Setup(format!("unknown image format `{format}`")))?;
                // SAFETY: forwarded from this function's contract.
                images.push(ImageLayer { fd: unsafe { claim(*fd)? }, format });
            }
            Box::new(Qcow2Backend::open(images, *read_only).map_err(setup)?)
        }
        BackendSpec::Nbd { fd, export, timeout_ms } => {
            // SAFETY: forwarded from this function's contract.
            let sock = unsafe { claim(*fd)? };
            Box::new(NbdBackend::new(sock, export, this.backend_size, std::time::Duration::from_millis(*timeout_ms)))
        }
        BackendSpec::Rbd {
            key_fd,
            owner_fd,
            mon_host,
            user,
            pool,
            namespace,
            image,
            cache,
            read_only,
            op_timeout_ms,
            connect_timeout_ms,
            discard_granularity,
            break_owners,
        } => {
            use std::io::Read;
            // SAFETY: forwarded from this function's contract.
            let key_pipe = unsafe { claim(*key_fd)? };
            let mut key = String::new();
            std::fs::File::from(key_pipe)
                .read_to_string(&mut key)
                .map_err(|e| DriverError::Setup(format!("rbd: reading the key: {e}")))?;
            // SAFETY: as above.
            let owner = unsafe { claim(*owner_fd)? };
            let opts = RbdOptions {
                mon_host: mon_host.clone(),
                user: user.clone(),
                key: key.trim().to_string(),
                pool: pool.clone(),
                namespace: namespace.clone(),
                image: image.clone(),
                cache: *cache,
                read_only: *read_only,
                op_timeout: std::time::Duration::from_millis(*op_timeout_ms),
                connect_timeout: std::time::Duration::from_millis(*connect_timeout_ms),
                discard_granularity: *discard_granularity,
                break_owners: break_owners.clone(),
            };
            Box::new(RbdBackend::new(opts, this.backend_size, Some(owner)).map_err(|e| DriverError::Setup(format!("rbd: {e}")))?)
        }
        BackendSpec::Null => Box::new(NullBackend::new(this.backend_size)),
        BackendSpec::Vdev { card, wait, fds } => {
            let card = bulkhead_vdev::Card::from_json(card).map_err(|e| DriverError::Setup(format!("card: {e}")))?;
            let wait = wait.parse::<bulkhead_vdev::Wait>().map_err(|e| DriverError::Setup(e.to_string()))?;
            // SAFETY: forwarded from this function's contract.
            let [regs, dma, irq, line] = fds.map(|fd| unsafe { claim(fd) });
            let irq = bulkhead_doorbell::EventFd::from_owned(irq?).map_err(|e| DriverError::Setup(format!("interrupt: {e}")))?;
            let driver = bulkhead_vdev::domain::connect_driver(card, wait, regs?, dma?, irq, line?)
                .map_err(|e| DriverError::Setup(e.to_string()))?;
            Box::new(driver)
        }
        BackendSpec::Channel { queues: lower, generation, control_fds } => {
            if lower.len() != queues.len() {
                return Err(DriverError::Setup("the channel below needs one queue per queue above".into()));
            }
            let mut fronts = Vec::with_capacity(lower.len());
            for (q, above) in lower.iter().zip(&this.queues) {
                // SAFETY: forwarded from this function's contract.
                let [ring, kick, irq] = q.fds.map(|fd| unsafe { claim(fd) });
                let cfg = QueueConfig {
                    nslots: q.nslots,
                    arena_bytes: above.arena_bytes as usize,
                    mode,
                    budget: this.budget(),
                    generation: *generation,
                };
                // SAFETY: as above.
                let arenas = match q.arena_fds.map(|fds| fds.map(|fd| unsafe { claim(fd) })) {
                    Some([w, r]) => Some([w?, r?]),
                    None => None,
                };
                let fds = ForwardQueueFds { ring: ring?, kick: kick?, irq: irq?, arenas };
                // A standby leaves the queues below to the running tap domain until it takes over.
                let front = if standby { FrontQueue::forwarding_adopted(fds, &cfg) } else { FrontQueue::forwarding(fds, &cfg) };
                let mut front = front.map_err(|e| DriverError::Setup(format!("channel below: {e}")))?;
                front.set_yield_after(YIELD_AFTER_SPINS);
                fronts.push(front);
            }
            let windows = queues.iter().map(BackQueue::arena_windows).collect();
            let control = match control_fds {
                Some(fds) => {
                    // SAFETY: forwarded from this function's contract.
                    let [page, wake] = fds.map(|fd| unsafe { claim(fd) });
                    let c = BelowControl::attach(page?, wake?).map_err(|e| DriverError::Setup(e.to_string()))?;
                    if standby {
                        let [page, wake] = c.fds().map_err(|e| DriverError::Setup(e.to_string()))?;
                        takeover = Some(BelowControl::attach(page, wake).map_err(|e| DriverError::Setup(e.to_string()))?);
                    }
                    Some(c)
                }
                None => None,
            };
            Box::new(ChannelBackend::new(fronts, windows, this.backend_size, lower_stop, control))
        }
    };
    let rings: Vec<(u64, u64)> = queues.iter().map(BackQueue::ring_region).collect();
    let mut parts = Vec::with_capacity(this.filters.len());
    for f in &this.filters {
        // SAFETY: forwarded from this function's contract.
        let state = unsafe { claim(f.state_fd)? };
        // SAFETY: as above.
        let output = unsafe { claim_opt(f.output_fd)? };
        // SAFETY: as above.
        let secret = unsafe { claim_opt(f.secret_fd)? };
        parts.push(guarded::FilterParts { spec: f.spec.clone(), fds: FilterFds { state, output, secret }, guard: f.guard });
    }
    let layers = filters(parts, &rings).map_err(|e| DriverError::Setup(e.to_string()))?;
    let chain = Chain::new(layers, backend);
    // The device may use a prefix of what the chain offers (a file longer than `size`).
    if chain.size() < this.size {
        return Err(DriverError::Setup(format!("the chain offers {} bytes, the device is {}", chain.size(), this.size)));
    }
    // SAFETY: as above.
    let state = unsafe { claim_opt(this.state_fd)? };
    let first = this.queues.first().ok_or_else(|| DriverError::Setup("a domain has at least one queue".into()))?;
    let slots = this.attach.as_ref().map_or(0, |a| a.slots.len());
    let mut domain = Domain::with_slots(queues, slots, first.nslots, chain, mode, this.budget(), stop)?;
    if this.inactive {
        domain.set_inactive();
    }
    if let Some(a) = &this.attach {
        // SAFETY: forwarded from this function's contract.
        let line = unsafe { claim(a.fd)? };
        let sizes = a.slots.iter().map(|&v| view_size(v)).collect::<Result<Vec<_>, _>>()?;
        domain.set_attach_line(line, sizes, first.arena_bytes)?;
    }
    // The tap domain of an `interpose` device, and the driver domain below it.
    domain.set_hands_off(matches!(this.backend, BackendSpec::Channel { .. }) || this.above_control_fds.is_some());
    if let Some(line) = takeover {
        domain.set_takeover_line(line);
    }
    if let Some(fds) = this.above_control_fds {
        // SAFETY: forwarded from this function's contract.
        let [page, wake] = fds.map(|fd| unsafe { claim(fd) });
        let line = AboveControl::attach(page?, wake?).map_err(|e| DriverError::Setup(e.to_string()))?;
        domain.set_above_control(line)?;
    }
    if let Some(fd) = state {
        let page = bulkhead_filters::state::StatePage::map(std::os::fd::AsRawFd::as_raw_fd(&fd), true)
            .map_err(|e| DriverError::Setup(format!("state page: {e}")))?;
        domain.set_state_page(page, this.heartbeat_ms);
    }
    let slots = this.attach.iter().flat_map(|a| a.slots.iter().copied());
    let lanes: Vec<Option<u32>> = this.queues.iter().map(|q| q.view).chain(slots).collect();
    domain.set_views(&this.views, &lanes, this.size)?;
    Ok(domain)
}

#[cfg(test)]
mod tests {
    use super::*;
    use bulkhead_spec::{QueueSpec, SandboxSpec};

    #[test]
    fn closed_descriptor_is_a_setup_error() {
        let spec = DomainSpec {
            device: "d".into(),
            size: 4096,
            backend_size: 4096,
            mode: "poll".into(),
            budget_ns: None,
            queues: vec![QueueSpec { nslots: 8, arena_bytes: 4096, fds: [1000, 1001, 1002, 1003, 1004], view: None }],
            views: Vec::new(),
            backend: BackendSpec::Null,
            filters: Vec::new(),
            state_fd: None,
            heartbeat_ms: 100,
            above_control_fds: None,
            attach: None,
            inactive: false,
            sandbox: SandboxSpec::default(),
            report_fd: None,
            standby_fd: None,
        };
        // SAFETY: the descriptors named are not open, which is what is being tested.
        let e = unsafe { build_inherited(&spec, Arc::new(AtomicBool::new(false))) }.unwrap_err();
        assert!(e.to_string().contains("descriptor 1000"), "{e}");
    }
}
