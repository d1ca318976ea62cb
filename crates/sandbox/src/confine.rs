//! Confining a domain once it is set up.

use crate::seccomp::Role;
use crate::Unavailable;
use crate::{landlock, mounts, seccomp, Layer, Layers, Policy, SandboxError};

/// What to confine and how strictly.
#[derive(Debug, Clone)]
pub struct Options {
    /// Policy for unavailable layers.
    pub policy: Policy,
    /// Seccomp role.
    pub role: Role,
    /// Its filters run under write capture: the seccomp allowlist adds what that needs.
    pub guarded: bool,
    /// Slots for attached applications' queues: descriptors and system calls to take them.
    pub attach_slots: usize,
    /// What the supervisor reported for the namespaces layer.
    pub namespaces: Layer,
    /// Address space allowed beyond what is mapped now (bytes).
    pub address_space_headroom: u64,
    /// Layers treated as unavailable, as on a host without them, so the best-effort warning
    /// and the required refusal can be rehearsed on a host that has every layer. Empty in
    /// `bulkhead driver`.
    pub withhold: Vec<String>,
}

fn setrlimit(res: libc::__rlimit_resource_t, cur: u64, max: u64) -> Result<(), Unavailable> {
    let r = libc::rlimit { rlim_cur: cur, rlim_max: max };
    // SAFETY: plain setrlimit with a valid struct.
    if unsafe { libc::setrlimit(res, &r) } < 0 {
        return Err(Unavailable(format!("setrlimit({res}): {}", std::io::Error::last_os_error())));
    }
    Ok(())
}

fn highest_open_fd() -> i32 {
    std::fs::read_dir("/proc/self/fd")
        .map(|d| d.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok()).max().unwrap_or(2))
        .unwrap_or(1023)
}

fn mapped_bytes() -> u64 {
    let pages: u64 =
        std::fs::read_to_string("/proc/self/statm").ok().and_then(|s| s.split_whitespace().next()?.parse().ok()).unwrap_or(0);
    pages * 4096
}

/// What the rlimits are derived from, read from /proc before the domain's filesystem view is
/// emptied.
struct Footprint {
    highest_fd: i32,
    mapped: u64,
}

/// Tasks a domain may have. None of its own making (seccomp refuses clone), but an io_uring
/// engine's io-wq workers are tasks of the domain too: its lent ring bounds them
/// (`bulkhead_sys::uring::FILE_ENGINE`, bounded and unbounded), plus the domain's own thread
/// and a margin.
fn nproc_limit(role: Role) -> u64 {
    match role {
        Role::FileIoUring => 2 * u64::from(bulkhead_sys::uring::FILE_ENGINE.max_workers) + 4,
        // librados and librbd start about 20 threads; the limit counts every task of the
        // user the domain runs as.
        Role::Rbd => 256,
        Role::Memory
        | Role::FileSync
        | Role::Network
        | Role::NetworkFile
        | Role::Tap
        | Role::TapFile
        | Role::Vdev
        | Role::VdevFile
        | Role::VdevModel => 0,
    }
}

fn rlimits(now: &Footprint, role: Role, headroom: u64, attach_slots: usize) -> Result<(), Unavailable> {
    setrlimit(libc::RLIMIT_CORE, 0, 0)?;
    let nproc = nproc_limit(role);
    setrlimit(libc::RLIMIT_NPROC, nproc, nproc)?;
    setrlimit(libc::RLIMIT_MEMLOCK, 0, 0)?;
    // No descriptor beyond those it holds (one spare for the kernel's own needs) and those of
    // the attached queues it may take.
    // Each attached queue comes with five descriptors.
    let fds = now.highest_fd as u64 + 2 + 5 * attach_slots as u64;
    setrlimit(libc::RLIMIT_NOFILE, fds, fds)?;
    // Address space: what is mapped now (channel, arenas, ramdisk) plus the headroom.
    let limit = now.mapped + headroom;
    setrlimit(libc::RLIMIT_AS, limit, limit)
}

/// Applies every layer in order; returns what is in force. With [`Policy::Required`], the
/// first unavailable layer is an error.
pub fn confine(opts: &Options) -> Result<Layers, SandboxError> {
    let mut layers = Layers {
        namespaces: opts.namespaces.clone(),
        mounts: Layer::Off,
        rlimits: Layer::Off,
        no_new_privs: Layer::Off,
        landlock: Layer::Off,
        landlock_abi: crate::spare::prepared().map_or_else(landlock::abi, |p| p.layers.landlock_abi),
        seccomp: Layer::Off,
        seccomp_role: opts.role.as_str().to_string(),
        connect_listener: None,
    };
    if opts.policy == Policy::Off {
        return Ok(layers);
    }
    let required = opts.policy == Policy::Required;
    let apply = |layer: &'static str, f: &dyn Fn() -> Result<(), Unavailable>| -> Result<(), Unavailable> {
        if opts.withhold.iter().any(|l| l == layer) {
            return Err(Unavailable("not available on this host (withheld)".into()));
        }
        f()
    };
    let check = |layer: &'static str, r: Result<(), Unavailable>| -> Result<Layer, SandboxError> {
        match r {
            Ok(()) => Ok(Layer::Applied),
            Err(reason) if required => Err(SandboxError::Required { layer, reason: reason.0 }),
            Err(reason) => {
                eprintln!("bulkhead driver: warning: sandbox layer {layer} unavailable: {reason}");
                Ok(Layer::Unavailable(reason.0))
            }
        }
    };
    // Memory faults must kill the domain at once. Rust's stack-overflow handler would try to
    // reinstall the default action with rt_sigaction, which seccomp refuses, and the fault
    // would repeat forever.
    // A guarded domain keeps its SIGBUS and SIGSEGV handlers: that is how write capture
    // catches writes (userfaultfd raises SIGBUS; a protection key or mprotect, SIGSEGV), and
    // its allowlist has rt_sigaction, for the handlers' own "not mine" case.
    if !opts.guarded {
        // SAFETY: restoring default dispositions; no handler code is involved.
        unsafe {
            libc::signal(libc::SIGSEGV, libc::SIG_DFL);
            libc::signal(libc::SIGBUS, libc::SIG_DFL);
        }
    }
    if let Layer::Unavailable(reason) = &opts.namespaces {
        check("namespaces", Err(Unavailable(reason.clone())))?;
    }
    // A spare applied the layers that do not depend on the device before it was given one
    // ([`crate::spare`]): they are checked against the policy here as if applied now.
    let spare = crate::spare::prepared();
    let done = |l: &Layer| match l {
        Layer::Unavailable(why) => Err(Unavailable(why.clone())),
        _ => Ok(()),
    };
    let footprint = match spare {
        Some(p) => Footprint { highest_fd: p.highest_fd().unwrap_or(1023), mapped: p.mapped_bytes().unwrap_or(0) },
        None => Footprint { highest_fd: highest_open_fd(), mapped: mapped_bytes() },
    };
    // Only a domain in a mount namespace of its own may empty it.
    layers.mounts = match (spare, &opts.namespaces) {
        (Some(p), _) => check("mounts", apply("mounts", &|| done(&p.layers.mounts)))?,
        (None, Layer::Applied) => check("mounts", apply("mounts", &mounts::isolate))?,
        (None, _) => check("mounts", Err(Unavailable("no mount namespace of the domain's own".into())))?,
    };
    layers.rlimits =
        check("rlimits", apply("rlimits", &|| rlimits(&footprint, opts.role, opts.address_space_headroom, opts.attach_slots)))?;
    layers.no_new_privs = check("no_new_privs", apply("no_new_privs", &crate::spare::no_new_privs))?;
    if let Some(p) = spare {
        p.let_go();
        layers.rlimits = match (&layers.rlimits, &p.layers.rlimits) {
            (Layer::Applied, Layer::Unavailable(_)) => check("rlimits", apply("rlimits", &|| done(&p.layers.rlimits)))?,
            (l, _) => l.clone(),
        };
    }
    // The same ruleset a spare applied: once is enough.
    layers.landlock = match spare {
        Some(p) => check("landlock", apply("landlock", &|| done(&p.layers.landlock)))?,
        None => check("landlock", apply("landlock", &|| landlock::deny_all().map(|_| ())))?,
    };

    // An rbd domain's connects go to the supervisor: that filter first (installing a filter
    // is itself a system call the allowlist refuses).
    let mut listener = None;
    let filters = || -> Result<(), Unavailable> {
        if opts.role == Role::Rbd {
            let fd = bulkhead_sys::seccomp_notify::install_connect_listener()
                .map_err(|e| Unavailable(format!("connect filter: {e}")))?;
            listener = Some(fd);
        }
        seccomp::apply(opts.role, opts.guarded, opts.attach_slots > 0)
    };
    let filters = std::cell::RefCell::new(filters);
    layers.seccomp = check("seccomp", apply("seccomp", &|| (filters.borrow_mut())()))?;
    let _ = filters.into_inner();
    // The listener stays open here (the domain can do nothing with it: its allowlist has no
    // ioctl); the supervisor takes a copy of it by number.
    layers.connect_listener = listener.map(std::os::fd::IntoRawFd::into_raw_fd);
    Ok(layers)
}
