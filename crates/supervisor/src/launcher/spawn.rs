//! Execing a generation's domains: each domain's spec (its queues, backend, filters, views
//! and the descriptors that go with them), the exec into its sandbox, and an `rbd` domain's
//! connection broker.

use std::os::fd::{AsFd, AsRawFd, OwnedFd};

use bulkhead_channel::BudgetPolicy;
use bulkhead_config::{BackendConfig, Engine, ImageFormat, Tap};
use bulkhead_spec::{BackendSpec, DomainSpec, FilterSlot, LowerQueueSpec, QueueSpec, RingSpec, SandboxSpec};
use bulkhead_sys::uring::{self, RingWatch};

use super::{failed, Launcher};
use crate::chain::ChainSetup;
use crate::domains::{Below, Domain, TapQueues};
use crate::error::Error;
use crate::spawn::{discard, exec_confined, From};
use crate::views::ViewSetup;

impl Launcher {
    /// Execs a tap domain in `interpose` mode over the channels of `below`: the channel above
    /// (its queues' files, as the frontend last wrote their headers) and the channel below,
    /// whose headers it writes as `below.generation` before it reports.
    pub(crate) fn spawn_tap(&self, below: &Below, chain: &ChainSetup) -> Result<Domain, Error> {
        self.spawn_tap_from(below.tap_queues().map_err(failed)?, &below.control, chain, None)
    }

    /// [`spawn_tap`](Self::spawn_tap) on the queues `queues` with `line` about the domain below;
    /// as a standby waiting for `go` if given one: it then writes nothing of either channel
    /// until it is told on its line to take them over (see [`crate::standby`]).
    pub(crate) fn spawn_tap_from(
        &self,
        queues: TapQueues,
        line: &bulkhead_channel::BelowControl,
        chain: &ChainSetup,
        go: Option<&bulkhead_sys::eventfd::EventFd>,
    ) -> Result<Domain, Error> {
        let TapQueues { above, below, nslots, arena_bytes, generation } = queues;
        let mut pass = Pass::default();
        let mut queue_specs = Vec::new();
        for bulkhead_channel::BackQueueFds { ring, write_arena, read_arena, kick, irq } in above {
            queue_specs.push(pass.queue([ring, write_arena, read_arena, kick, irq], nslots, arena_bytes));
        }
        let mut below_specs = Vec::new();
        for bulkhead_channel::ForwardQueueFds { ring, kick, irq, arenas } in below {
            below_specs.push(LowerQueueSpec {
                nslots,
                fds: [ring, kick, irq].map(|fd| pass.add_owned(fd)),
                arena_fds: arenas.map(|a| a.map(|fd| pass.add_owned(fd))),
            });
        }
        let control_fds = Some(line.fds().map_err(failed)?.map(|fd| pass.add_owned(fd)));
        let backend = BackendSpec::Channel { queues: below_specs, generation, control_fds };
        Ok(self.spawn("tap", pass, queue_specs, backend, Some(chain), None, go)?.0)
    }

    /// Execs a driver domain below a tap domain, on the queues of `below` (whose headers the
    /// tap domain has written for `below.generation`). `conn`: a remote backend's connection;
    /// made here if `None` and needed.
    pub(crate) fn spawn_below(&self, below: &Below, conn: Option<OwnedFd>) -> Result<Domain, Error> {
        let fds = below.lower_fds().map_err(failed)?;
        self.spawn_below_from(fds, below.nslots, below.arena_bytes, &below.driver_line, conn, None)
    }

    /// [`spawn_below`](Self::spawn_below) on the lower queues `fds` (`nslots` slots, arenas of
    /// `arena_bytes`), with `line` about the tap domain; as a standby waiting for `go` if given
    /// one (it attaches to the queues once told their generation, see [`crate::standby`]).
    pub(crate) fn spawn_below_from(
        &self,
        fds: Vec<bulkhead_channel::BackQueueFds>,
        nslots: u32,
        arena_bytes: u64,
        line: &bulkhead_channel::AboveControl,
        conn: Option<OwnedFd>,
        go: Option<&bulkhead_sys::eventfd::EventFd>,
    ) -> Result<Domain, Error> {
        let conn = match conn {
            Some(c) => Some(c),
            None => self.connect()?,
        };
        let mut pass = Pass::default();
        let mut specs = Vec::new();
        for bulkhead_channel::BackQueueFds { ring, write_arena, read_arena, kick, irq } in fds {
            specs.push(pass.queue([ring, write_arena, read_arena, kick, irq], nslots, arena_bytes));
        }
        let (backend, ring) = self.backend_spec(&mut pass, conn)?;
        let line = line.fds().map_err(failed)?.map(|fd| pass.add_owned(fd));
        let (mut driver, _) = self.spawn("driver", pass, specs, backend, None, Some(line), go)?;
        driver.rings.extend(ring);
        Ok(driver)
    }

    /// The backend's part of a spec, its descriptors added to `pass`; and the watch on the
    /// ring lent to an io_uring engine, which the supervisor keeps (see [`RingWatch`]).
    pub(super) fn backend_spec(&self, pass: &mut Pass, conn: Option<OwnedFd>) -> Result<(BackendSpec, Option<RingWatch>), Error> {
        let held = self.held();
        let spec = match &self.backend {
            BackendConfig::Ram => BackendSpec::Ram { fd: pass.add(&held.fds[0]) },
            BackendConfig::Null => BackendSpec::Null,
            BackendConfig::Vdev { wait, .. } => {
                let card = self.card.as_ref().ok_or_else(|| Error::failed("a vdev device has a card"))?;
                let ([regs, dma, irq], line) = card.driver_fds()?;
                BackendSpec::Vdev {
                    card: card.card_json().to_string(),
                    wait: wait.as_str().to_string(),
                    fds: [pass.add(regs), pass.add(dma), pass.add(irq), pass.add_owned(line)],
                }
            }
            BackendConfig::Nbd { export, .. } => BackendSpec::Nbd {
                fd: pass.add_owned(conn.ok_or_else(|| Error::failed("an nbd backend connects before it launches"))?),
                export: export.clone(),
                timeout_ms: self.io_timeout_ms,
            },
            BackendConfig::Rbd {
                mon_host,
                user,
                key_file,
                pool,
                namespace,
                image,
                cache,
                read_only,
                op_timeout_ms,
                connect_timeout_ms,
                lock_break,
                ..
            } => {
                // The key goes through a pipe: the domain reads no file.
                let key = std::fs::read_to_string(key_file)
                    .map_err(|e| Error::failed(format!("backend key_file {}: {e}", key_file.display())))?;
                let (key_r, key_w) = bulkhead_sys::pipe().map_err(|e| Error::failed(format!("key pipe: {e}")))?;
                std::io::Write::write_all(&mut std::fs::File::from(key_w), key.trim().as_bytes())
                    .map_err(|e| Error::failed(format!("key pipe: {e}")))?;
                let (owner_r, owner_w) = bulkhead_sys::pipe().map_err(|e| Error::failed(format!("owner pipe: {e}")))?;
                pass.rbd_owner = Some(owner_r);
                let (_, opened) = self.rbd()?;
                BackendSpec::Rbd {
                    key_fd: pass.add_owned(key_r),
                    owner_fd: pass.add_owned(owner_w),
                    mon_host: mon_host.clone(),
                    user: user.clone(),
                    pool: pool.clone(),
                    namespace: namespace.clone(),
                    image: image.clone(),
                    cache: *cache,
                    // Inactive, the image is opened read-only: no lock taken, none asked for.
                    read_only: *read_only || !held.active,
                    op_timeout_ms: *op_timeout_ms,
                    connect_timeout_ms: *connect_timeout_ms,
                    discard_granularity: 4096,
                    break_owners: if *lock_break { opened.owners() } else { Vec::new() },
                }
            }
            BackendConfig::File { read_only, format: ImageFormat::Qcow2, .. } => BackendSpec::Qcow2 {
                layers: held.fds.iter().zip(&held.formats).map(|(fd, f)| (pass.add(fd), f.as_str().to_string())).collect(),
                read_only: *read_only || !held.active,
            },
            BackendConfig::File { direct, engine, read_only, .. } => {
                let (ring, watch) = match engine {
                    Engine::IoUring => {
                        let (lent, watch) = uring::lend(uring::FILE_ENGINE)
                            .map_err(|e| Error::failed(format!("cannot create the io_uring for the file backend: {e}")))?;
                        let spec = RingSpec {
                            fds: [pass.add(lent.ring_fd()), pass.add(lent.wake_fd())],
                            params: lent.params().to_vec(),
                        };
                        pass.lent.push(lent);
                        (Some(spec), Some(watch))
                    }
                    // `auto` is resolved when the device starts (`auto_engine`).
                    Engine::Sync | Engine::Auto => (None, None),
                };
                let spec = BackendSpec::File {
                    fd: pass.add(&held.fds[0]),
                    buffered_fd: direct.then(|| pass.add(&held.fds[1])),
                    read_only: *read_only || !held.active,
                    engine: engine.as_str().to_string(),
                    ring,
                };
                return Ok((spec, watch));
            }
        };
        Ok((spec, None))
    }

    /// Execs one domain (`role` names it in messages): its queues and backend are in `pass`
    /// already; the upper domain of a device also gets `chain`'s filters, their descriptors and
    /// the domain state page; a driver domain below a tap domain, its line about the tap domain
    /// (`above_line`, in `pass` too). A standby gets `go`, and waits for it once it has
    /// reported. Waits for its sandbox report. Returns the domain and the supervisor's end of
    /// its attach line, if it takes attached applications' queues.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn spawn(
        &self,
        role: &str,
        mut pass: Pass,
        mut queues: Vec<QueueSpec>,
        backend: BackendSpec,
        chain: Option<&ChainSetup>,
        above_line: Option<[i32; 2]>,
        go: Option<&bulkhead_sys::eventfd::EventFd>,
    ) -> Result<(Domain, Option<OwnedFd>), Error> {
        let mut filters = Vec::new();
        let state_fd;
        let mut views = Vec::new();
        let layout = self.layout();
        if let Some(chain) = chain {
            // The upper domain serves the views: the queues come in the launch's order.
            let lanes = layout.lanes();
            if queues.len() == lanes.len() {
                for (q, lane) in queues.iter_mut().zip(lanes) {
                    q.view = lane;
                }
                views = layout.views.iter().map(ViewSetup::spec).collect();
            }
            for f in &chain.filters {
                // A standby's filters may still be written by the domain it will replace: it
                // is trimmed when it is let go ([`Launcher::trim_outputs`]).
                if go.is_none() {
                    f.trim_output();
                }
                let state_fd = pass.add(&f.state_fd);
                let output_fd = f.output.as_ref().map(|o| pass.add(o));
                let secret_fd = f.secret.as_ref().map(|o| pass.add(o));
                filters.push(FilterSlot { spec: chain.spec_of(f), state_fd, output_fd, secret_fd, guard: f.guard });
            }
            state_fd = Some(pass.add(&self.state_fd));
        } else {
            // The domain below a tap domain: a page of its own, for what its backend reports
            // (a remote that stopped answering).
            state_fd = Some(pass.add(&self.below_state_fd));
        }
        // The domain the frontend reaches takes attached applications' queues, unless it is a
        // tap domain over a domain below (whose channel has no room for them).
        let mut attach = None;
        let mut attach_line = None;
        let slots = layout.attach_slots();
        if chain.is_some_and(|c| c.tap != Tap::Interpose) && !slots.is_empty() {
            let (ours, theirs) = bulkhead_sys::seqpacket_pair().map_err(|e| Error::failed(format!("attach line: {e}")))?;
            attach = Some(bulkhead_spec::AttachSpec { fd: pass.add_owned(theirs), slots });
            attach_line = Some(ours);
        }
        let (report_r, report_w) = bulkhead_sys::pipe().map_err(|e| Error::failed(format!("report pipe: {e}")))?;
        let report_fd = pass.add_owned(report_w);
        let spec = DomainSpec {
            device: self.name.clone(),
            // The driver domain below a tap domain serves the backend's bytes as they are.
            size: if chain.is_some() { self.size } else { self.backend_size },
            backend_size: self.backend_size,
            mode: self.mode.as_str().to_string(),
            budget_ns: match self.qcfg.budget {
                BudgetPolicy::Fixed(ns) => Some(ns),
                BudgetPolicy::Auto { .. } => None,
            },
            queues,
            views,
            backend,
            filters,
            state_fd,
            // Four beats within the watchdog's time.
            heartbeat_ms: (self.io_timeout_ms / 4).max(2),
            above_control_fds: above_line,
            attach,
            inactive: !self.held().active,
            sandbox: SandboxSpec { policy: self.policy },
            report_fd: Some(report_fd),
            standby_fd: go.map(|g| pass.add(g)),
        };
        let json = serde_json::to_string(&spec).map_err(|e| Error::failed(format!("domain spec: {e}")))?;
        // `ps` shows `bulkhead driver DEVICE`, and `tap` after it for a tap domain.
        let args: Vec<&std::ffi::OsStr> = ["driver", self.name.as_str(), if role == "tap" { "tap" } else { "" }]
            .into_iter()
            .filter(|a| !a.is_empty())
            .map(std::ffi::OsStr::new)
            .collect();
        let raw = std::mem::take(&mut pass.raw);
        let owner_pipe = pass.rbd_owner.take();
        let what = format!("{role} domain");
        let (child, layers) = exec_confined(
            &self.exe,
            &args,
            &json,
            &raw,
            pass,
            &self.name,
            self.policy,
            &report_r,
            &what,
            match (self.spares.as_deref(), go) {
                (Some(s), Some(_)) => From::Spare(s),
                (Some(s), None) => From::SpareElseExec(s),
                (None, _) => From::Exec,
            },
        )?;
        // An rbd domain's connections go through a broker here.
        if let (Some((reach, opened)), Some(fd)) = (&self.rbd, layers.as_ref().and_then(|l| l.connect_listener)) {
            let taken = child.pidfd().try_clone().and_then(|pidfd| {
                let listener = bulkhead_sys::seccomp_notify::pidfd_getfd(child.pidfd().as_fd(), fd)?;
                Ok((pidfd, listener))
            });
            match taken {
                Ok((pidfd, listener)) => {
                    crate::rbd::broker(&self.name, pidfd, listener, owner_pipe, reach.clone(), opened.clone())
                }
                Err(e) => {
                    discard(child);
                    return Err(Error::failed(format!("cannot take the rbd domain's connect listener: {e}")));
                }
            }
        }
        Ok((Domain { child, layers, rings: Vec::new() }, attach_line))
    }
}

/// Descriptors handed to a domain, which finds them at 3, 4, … in the order added.
#[derive(Default)]
pub(super) struct Pass {
    raw: Vec<i32>,
    /// Descriptors made for this domain alone, closed here once it holds its copies.
    owned: Vec<OwnedFd>,
    /// Rings lent to it, closed here once it holds its copies (the watch keeps each).
    lent: Vec<uring::LentRing>,
    /// An rbd domain's owner pipe (read end), for its broker.
    rbd_owner: Option<OwnedFd>,
}

impl Pass {
    /// Passes `fd` (kept open by the caller); returns its number in the domain.
    pub(super) fn add(&mut self, fd: &impl AsRawFd) -> i32 {
        self.raw.push(fd.as_raw_fd());
        2 + self.raw.len() as i32
    }

    /// Passes `fd`, closing it here after the spawn.
    pub(super) fn add_owned(&mut self, fd: OwnedFd) -> i32 {
        let n = self.add(&fd);
        self.owned.push(fd);
        n
    }

    /// Passes one queue's five descriptors.
    pub(super) fn queue(&mut self, fds: [OwnedFd; 5], nslots: u32, arena_bytes: u64) -> QueueSpec {
        QueueSpec { nslots, arena_bytes, fds: fds.map(|fd| self.add_owned(fd)), view: None }
    }
}
