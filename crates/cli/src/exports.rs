//! The exports `serve` runs (FUSE, NBD, vhost-user-blk, ublk), each a value that carries its own
//! settings, held together by [`Exports`], which ends them in order however `serve` ends.
//!
//! A device or view goes on every export that is on with [`Exports::offer`], and comes off
//! all of them with [`Exports::withdraw`]. A withdrawal refused part way (a user arrived since
//! the in-use check) puts back exactly what it had taken before it refuses; a withdrawal that
//! succeeded hands back what it took ([`Withdrawn`]), for [`Exports::restore`] to put back if
//! a later step fails. What comes back is what was taken: an NBD export is handed back by the
//! NBD server with its allow list, so it cannot come back open to every address.

use std::sync::{Arc, Mutex, MutexGuard};

use bulkhead_client::Device;
use bulkhead_config::Config;
use bulkhead_control::{FuseStatus, UblkStatus, VhostStatus};
use bulkhead_fuse_export::{FuseError, FuseExport, Transport};
use bulkhead_nbd_export::{Export as NbdOffer, NbdServer, Reach};
use bulkhead_ublk_export::UblkExport;
use bulkhead_vhost_export::{VhostError, VhostExport};

/// An export kind, named as the control API and the logs name it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Fuse,
    Nbd,
    VhostUser,
    Ublk,
}

impl Kind {
    pub fn name(self) -> &'static str {
        match self {
            Kind::Fuse => "fuse",
            Kind::Nbd => "nbd",
            Kind::VhostUser => "vhost_user",
            Kind::Ublk => "ublk",
        }
    }
}

/// Why an export refused a change.
#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    #[error(transparent)]
    Fuse(#[from] FuseError),
    #[error(transparent)]
    Nbd(#[from] bulkhead_nbd_export::ExportError),
    #[error(transparent)]
    VhostUser(#[from] VhostError),
    #[error(transparent)]
    Ublk(#[from] bulkhead_ublk_export::Error),
}

impl ExportError {
    /// Whether a user holds the device (and a forced change would cut it off), rather than
    /// something having failed.
    pub fn in_use(&self) -> bool {
        matches!(
            self,
            ExportError::Fuse(FuseError::Open { .. })
                | ExportError::Nbd(bulkhead_nbd_export::ExportError::InUse { .. })
                | ExportError::VhostUser(VhostError::Connected { .. })
                | ExportError::Ublk(bulkhead_ublk_export::Error::InUse { .. })
        )
    }
}

/// A change an export refused for one device or view, with what refused it.
#[derive(Debug, thiserror::Error)]
#[error("`{name}`: {source}")]
pub struct Refused {
    /// The device or view.
    pub name: String,
    /// The export that refused.
    pub export: Kind,
    #[source]
    pub source: ExportError,
}

/// What the configuration says of one device or view, for the exports.
pub struct Offer {
    pub front: Arc<Device>,
    /// Who may reach it over NBD's TCP listener.
    pub reach: Reach,
    /// Whether it goes on the vhost-user export.
    pub vhost_user: bool,
    /// Whether it goes on the ublk export.
    pub ublk: bool,
}

impl Offer {
    /// How `cfg` offers each of `fronts` (a device and its views).
    pub fn all(cfg: &Config, fronts: &[Arc<Device>]) -> Vec<Offer> {
        fronts
            .iter()
            .map(|front| {
                let name = front.name();
                let allow = cfg.devices.iter().find_map(|d| {
                    if d.name.get_ref() == name {
                        return Some(&d.nbd_allow);
                    }
                    d.views.iter().find(|v| v.name.get_ref() == name).map(|v| &v.nbd_allow)
                });
                Offer {
                    front: front.clone(),
                    reach: Reach::from_list(allow.and_then(bulkhead_config::allow_list)),
                    vhost_user: cfg.vhost_user_exports(name),
                    ublk: cfg.ublk_exports(name),
                }
            })
            .collect()
    }
}

/// What one export took out, as it was: given back unchanged by [`Exports::restore`].
enum Taken {
    Fuse(Arc<Device>),
    Nbd(NbdOffer),
    VhostUser(Arc<Device>),
    Ublk(Arc<Device>),
}

/// What a withdrawal took from the exports, in the order it took it.
#[must_use = "a withdrawal that a later step undoes restores what it took"]
pub struct Withdrawn(Vec<Taken>);

/// One export that runs.
pub enum Running {
    Fuse(FuseExport),
    Nbd(NbdServer),
    VhostUser(VhostExport),
    Ublk(UblkExport),
}

impl Running {
    fn kind(&self) -> Kind {
        match self {
            Running::Fuse(_) => Kind::Fuse,
            Running::Nbd(_) => Kind::Nbd,
            Running::VhostUser(_) => Kind::VhostUser,
            Running::Ublk(_) => Kind::Ublk,
        }
    }

    /// Offers `o`; whether this export took it (vhost-user and ublk take only what is
    /// configured for them).
    fn offer(&self, o: &Offer) -> Result<bool, ExportError> {
        match self {
            Running::Fuse(f) => f.add(o.front.clone())?,
            Running::Nbd(n) => n.add(NbdOffer::new(o.front.clone(), o.reach.clone()))?,
            Running::VhostUser(v) if o.vhost_user => v.add(o.front.clone())?,
            Running::VhostUser(_) => return Ok(false),
            Running::Ublk(u) if o.ublk => u.add(o.front.clone())?,
            Running::Ublk(_) => return Ok(false),
        }
        Ok(true)
    }

    fn take(&self, name: &str, force: bool) -> Result<Option<Taken>, ExportError> {
        Ok(match self {
            Running::Fuse(f) => f.remove(name, force)?.map(Taken::Fuse),
            Running::Nbd(n) => n.remove(name, force)?.map(Taken::Nbd),
            Running::VhostUser(v) => v.remove(name, force)?.map(Taken::VhostUser),
            Running::Ublk(u) => u.remove(name, force)?.map(Taken::Ublk),
        })
    }

    fn give_back(&self, taken: Taken) -> Result<(), ExportError> {
        match (self, taken) {
            (Running::Fuse(f), Taken::Fuse(dev)) => f.add(dev)?,
            (Running::Nbd(n), Taken::Nbd(export)) => n.add(export)?,
            (Running::VhostUser(v), Taken::VhostUser(dev)) => v.add(dev)?,
            (Running::Ublk(u), Taken::Ublk(dev)) => u.add(dev)?,
            _ => unreachable!("each export is given back what it took"),
        }
        Ok(())
    }

    /// Who uses `name` through this export, in a phrase.
    fn user(&self, name: &str) -> Option<String> {
        match self {
            Running::Fuse(f) => f.opens(name).filter(|&o| o > 0).map(|opens| {
                format!("`{name}`: its FUSE file is open {opens} time(s) (a loop device, a mount on one, or a program)")
            }),
            Running::Nbd(n) => {
                Some(n.clients_of(name)).filter(|&c| c > 0).map(|c| format!("`{name}`: {c} NBD client(s) are connected"))
            }
            Running::VhostUser(v) => {
                v.connected(name).then(|| format!("`{name}`: a virtual machine is connected to its vhost-user socket"))
            }
            Running::Ublk(u) => u.in_use(name).then(|| {
                let path = u.path_of(name).map_or_else(|| "its ublk device".into(), |p| p.display().to_string());
                format!("`{name}`: {path} is mounted or held by a program")
            }),
        }
    }
}

/// The exports' figures, for the metrics.
pub struct ExportFigures {
    /// Each device's FUSE file's opens.
    pub fuse_opens: Vec<(String, usize)>,
    pub nbd: Option<NbdFigures>,
    pub vhost: Option<Vec<VhostStatus>>,
    pub ublk: Option<Vec<UblkStatus>>,
}

/// The NBD export's figures.
pub struct NbdFigures {
    pub accepted: u64,
    pub refused: u64,
    pub dropped: u64,
    /// Clients connected now, by export.
    pub clients: Vec<(String, usize)>,
}

/// The exports `serve` runs, in the order they started. They end in the reverse order:
/// ublk (requests in flight answered first), vhost-user (each guest's queues drained first),
/// then NBD, then FUSE, on a stop, a hand-over and a start that failed part way alike.
#[derive(Default)]
pub struct Exports {
    on: Mutex<Vec<Running>>,
}

impl Exports {
    fn lock(&self) -> MutexGuard<'_, Vec<Running>> {
        self.on.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Adds an export that has started.
    pub fn push(&self, export: Running) {
        self.lock().push(export);
    }

    /// Offers `offers` on every export that is on; returns the exports that took them. If
    /// one refuses, what this call offered is withdrawn again and the refusal returned.
    pub fn offer(&self, offers: &[Offer]) -> Result<Vec<Kind>, Refused> {
        let on = self.lock();
        let mut kinds = Vec::new();
        let mut given: Vec<(usize, &str)> = Vec::new();
        for o in offers {
            for (i, export) in on.iter().enumerate() {
                match export.offer(o) {
                    Ok(true) => {
                        given.push((i, o.front.name()));
                        if !kinds.contains(&export.kind()) {
                            kinds.push(export.kind());
                        }
                    }
                    Ok(false) => {}
                    Err(source) => {
                        for &(i, name) in given.iter().rev() {
                            if let Err(e) = on[i].take(name, true) {
                                log::warn!("`{name}`: cannot withdraw it from {} again: {e}", on[i].kind().name());
                            }
                        }
                        return Err(Refused { name: o.front.name().to_string(), export: export.kind(), source });
                    }
                }
            }
        }
        kinds.sort_by_key(|k| on.iter().position(|e| e.kind() == *k));
        Ok(kinds)
    }

    /// Withdraws each of `names` from every export; with `force`, their users are cut off.
    /// If an export refuses (a user arrived since the check), everything taken before it is
    /// put back as it was, and the refusal is returned.
    pub fn withdraw(&self, names: &[&str], force: bool) -> Result<Withdrawn, Refused> {
        let on = self.lock();
        let mut taken = Vec::new();
        for &name in names {
            for export in on.iter() {
                match export.take(name, force) {
                    Ok(Some(t)) => taken.push(t),
                    Ok(None) => {}
                    Err(source) => {
                        give_back(&on, Withdrawn(taken));
                        return Err(Refused { name: name.to_string(), export: export.kind(), source });
                    }
                }
            }
        }
        Ok(Withdrawn(taken))
    }

    /// Puts back what a withdrawal took, as it was (a later step of a removal failed).
    pub fn restore(&self, withdrawn: Withdrawn) {
        give_back(&self.lock(), withdrawn);
    }

    /// Who uses device or view `name` through the exports, a phrase each.
    pub fn users(&self, name: &str) -> Vec<String> {
        self.lock().iter().filter_map(|e| e.user(name)).collect()
    }

    /// Ends every export, the last started first. Returns whether the FUSE unmount was
    /// clean. Later calls do nothing.
    pub fn stop(&self) -> bool {
        let mut clean = true;
        while let Some(export) = self.lock().pop() {
            match export {
                Running::Fuse(f) => clean = f.shutdown(),
                Running::Nbd(n) => n.shutdown(),
                Running::VhostUser(v) => v.shutdown(),
                Running::Ublk(u) => u.shutdown(),
            }
        }
        clean
    }

    /// Ends the exports as [`stop`](Self::stop) does, but leaves what a keeper holds (the FUSE
    /// mount and session, the NBD listening sockets) and what the kernel holds (the ublk
    /// devices) to the `serve` that takes over.
    pub fn release(&self) {
        while let Some(export) = self.lock().pop() {
            match export {
                Running::Fuse(f) => f.release(),
                Running::Nbd(n) => n.release(),
                Running::VhostUser(v) => v.shutdown(),
                Running::Ublk(u) => u.release(),
            }
        }
    }

    /// The FUSE export's transport, if it is on.
    pub fn fuse_status(&self) -> Option<FuseStatus> {
        self.lock().iter().find_map(|e| match e {
            Running::Fuse(f) => Some(fuse_status(f.transport())),
            _ => None,
        })
    }

    /// Drops the kernel's cached pages of `name`'s FUSE file; whether there is one.
    pub fn invalidate(&self, name: &str) -> bool {
        self.lock().iter().any(|e| matches!(e, Running::Fuse(f) if f.invalidate(name)))
    }

    /// Each vhost-user export's connection and counters, if the export is on.
    pub fn vhost_status(&self) -> Option<Vec<VhostStatus>> {
        self.lock().iter().find_map(|e| match e {
            Running::VhostUser(v) => Some(v.status()),
            _ => None,
        })
    }

    /// Each ublk device's block device and counters, if the export is on.
    pub fn ublk_status(&self) -> Option<Vec<UblkStatus>> {
        self.lock().iter().find_map(|e| match e {
            Running::Ublk(u) => Some(u.status()),
            _ => None,
        })
    }

    /// The exports' figures for devices and views `names`.
    pub fn figures(&self, names: &[String]) -> ExportFigures {
        let on = self.lock();
        let mut x = ExportFigures { fuse_opens: Vec::new(), nbd: None, vhost: None, ublk: None };
        for e in on.iter() {
            match e {
                Running::Fuse(f) => x.fuse_opens = names.iter().filter_map(|n| f.opens(n).map(|o| (n.clone(), o))).collect(),
                Running::Nbd(s) => {
                    let st = s.stats();
                    let load = |a: &std::sync::atomic::AtomicU64| a.load(std::sync::atomic::Ordering::Relaxed);
                    x.nbd = Some(NbdFigures {
                        accepted: load(&st.accepted),
                        refused: load(&st.refused),
                        dropped: load(&st.dropped),
                        clients: names.iter().map(|n| (n.clone(), s.clients_of(n))).collect(),
                    });
                }
                Running::VhostUser(v) => x.vhost = Some(v.status()),
                Running::Ublk(u) => x.ublk = Some(u.status()),
            }
        }
        x
    }
}

/// Puts back what `withdrawn` took, last taken first.
fn give_back(on: &[Running], withdrawn: Withdrawn) {
    for taken in withdrawn.0.into_iter().rev() {
        let (kind, name) = match &taken {
            Taken::Fuse(d) => (Kind::Fuse, d.name().to_string()),
            Taken::Nbd(x) => (Kind::Nbd, x.name().to_string()),
            Taken::VhostUser(d) => (Kind::VhostUser, d.name().to_string()),
            Taken::Ublk(d) => (Kind::Ublk, d.name().to_string()),
        };
        let Some(export) = on.iter().find(|e| e.kind() == kind) else { continue };
        if let Err(e) = export.give_back(taken) {
            log::warn!("`{name}`: cannot offer it on {} again: {e}", kind.name());
        }
    }
}

/// The FUSE export's transport as `status` shows it.
fn fuse_status(t: &Transport) -> FuseStatus {
    match t {
        Transport::DevFuse { threads, why_not_uring } => {
            FuseStatus::DevFuse { threads: *threads, why_not_io_uring: why_not_uring.clone() }
        }
        Transport::IoUring { queues, depth } => FuseStatus::IoUring { queues: *queues, depth: *depth },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::net::{SocketAddr, TcpStream};
    use std::os::unix::net::UnixStream;
    use std::path::PathBuf;
    use std::time::{Duration, Instant};

    use bulkhead_nbd::allow::Cidr;
    use bulkhead_nbd::proto::{FLAG_C_FIXED_NEWSTYLE, IHAVEOPT, OPT_GO, OPT_STARTTLS, REP_ACK, REP_ERR_POLICY};
    use bulkhead_nbd_export::tls::{Tls, TlsMode};
    use bulkhead_nbd_export::ServerConfig;
    use bulkhead_testkit::memdev::MemoryDevice;

    const NAMES: [&str; 3] = ["a", "a-1", "a-2"];

    /// A device and two views, offered on NBD (unix and TCP, TLS offered, TCP clients only from
    /// 10.0.0.0/8) and on vhost-user, in a directory of their own.
    struct Rig {
        dir: PathBuf,
        exports: Exports,
        tcp: SocketAddr,
        _devices: Vec<MemoryDevice>,
    }

    impl Rig {
        fn new(tag: &str) -> Rig {
            let dir = std::env::temp_dir().join(format!("bulkhead-exports-{tag}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).unwrap();
            let psk = dir.join("keys.psk");
            std::fs::write(&psk, "client:00112233445566778899aabbccddeeff\n").unwrap();
            let devices: Vec<MemoryDevice> = NAMES.iter().map(|n| MemoryDevice::new(n, 1 << 20, 1)).collect();
            let reach = Reach::Only(vec![Cidr::parse("10.0.0.0/8").unwrap()]);
            let offers: Vec<Offer> = devices
                .iter()
                .map(|d| Offer { front: d.device.clone(), reach: reach.clone(), vhost_user: true, ublk: false })
                .collect();
            let cfg = ServerConfig {
                unix: Some(dir.join("nbd.sock")),
                tcp: Some("127.0.0.1:0".into()),
                max_connections: 8,
                workers_per_connection: 1,
                handshake_timeout: Duration::from_secs(5),
                request_timeout: Duration::from_secs(5),
                tls: Some(Tls::load_psk(&psk, TlsMode::On).unwrap()),
            };
            let nbd_exports = offers.iter().map(|o| NbdOffer::new(o.front.clone(), o.reach.clone())).collect();
            let nbd = NbdServer::start(nbd_exports, cfg).unwrap();
            let tcp = std::net::TcpListener::from(nbd.listeners().unwrap().tcp.unwrap()).local_addr().unwrap();
            let vhost = VhostExport::start(&dir.join("vhost"), offers.iter().map(|o| o.front.clone()).collect(), None).unwrap();
            let exports = Exports::default();
            exports.push(Running::Nbd(nbd));
            exports.push(Running::VhostUser(vhost));
            Rig { dir, exports, tcp, _devices: devices }
        }

        /// The NBD exports' names and reach, and the vhost-user sockets, as they are now.
        fn state(&self) -> (Vec<(String, Reach)>, Vec<String>) {
            let on = self.exports.lock();
            let mut nbd = Vec::new();
            let mut vhost = Vec::new();
            for e in on.iter() {
                match e {
                    Running::Nbd(n) => nbd = n.exports().iter().map(|x| (x.name().to_string(), x.reach.clone())).collect(),
                    Running::VhostUser(v) => vhost = v.status().into_iter().map(|s| s.device).collect(),
                    Running::Fuse(_) | Running::Ublk(_) => {}
                }
            }
            nbd.sort_by(|a, b| a.0.cmp(&b.0));
            vhost.sort();
            (nbd, vhost)
        }

        /// Connects to `name`'s vhost-user socket and waits until the export counts it.
        fn occupy_vhost(&self, name: &str) -> UnixStream {
            let s = UnixStream::connect(self.dir.join("vhost").join(format!("{name}.sock"))).unwrap();
            self.wait_for_user(name);
            s
        }

        /// Connects to export `name` over the unix socket and waits until the server counts it.
        fn occupy_nbd(&self, name: &str) -> UnixStream {
            let mut s = UnixStream::connect(self.dir.join("nbd.sock")).unwrap();
            assert_eq!(option(&mut s, OPT_GO, &go_payload(name)), 3, "NBD_REP_INFO first: the export was chosen");
            self.wait_for_user(name);
            s
        }

        fn wait_for_user(&self, name: &str) {
            let t = Instant::now();
            while self.exports.users(name).is_empty() {
                assert!(t.elapsed() < Duration::from_secs(5), "`{name}` never counted its user");
                std::thread::sleep(Duration::from_millis(5));
            }
        }

        /// The reply type a TCP client from 127.0.0.1 gets to option `opt` for export `name`.
        fn tcp_reply(&self, opt: u32, name: &str) -> u32 {
            let mut s = TcpStream::connect(self.tcp).unwrap();
            let payload = if opt == OPT_GO { go_payload(name) } else { Vec::new() };
            option(&mut s, opt, &payload)
        }
    }

    impl Drop for Rig {
        fn drop(&mut self) {
            self.exports.stop();
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }

    fn go_payload(name: &str) -> Vec<u8> {
        let mut p = (name.len() as u32).to_be_bytes().to_vec();
        p.extend_from_slice(name.as_bytes());
        p.extend_from_slice(&0u16.to_be_bytes());
        p
    }

    /// Greets, sends option `opt` and returns the type of the first reply.
    fn option(s: &mut (impl Read + Write), opt: u32, payload: &[u8]) -> u32 {
        let mut greeting = [0u8; 18];
        s.read_exact(&mut greeting).unwrap();
        s.write_all(&FLAG_C_FIXED_NEWSTYLE.to_be_bytes()).unwrap();
        let mut o = IHAVEOPT.to_be_bytes().to_vec();
        o.extend_from_slice(&opt.to_be_bytes());
        o.extend_from_slice(&(payload.len() as u32).to_be_bytes());
        o.extend_from_slice(payload);
        s.write_all(&o).unwrap();
        let mut reply = [0u8; 20];
        s.read_exact(&mut reply).unwrap();
        u32::from_be_bytes(reply[12..16].try_into().unwrap())
    }

    #[test]
    fn a_withdrawal_refused_at_any_step_leaves_every_export_as_it_was() {
        let rig = Rig::new("refused");
        let before = rig.state();
        assert_eq!(before.0.len(), 3);
        // Refused by vhost-user at each name in turn (everything before it was taken), then by NBD.
        let users = [(Kind::VhostUser, "a"), (Kind::VhostUser, "a-1"), (Kind::VhostUser, "a-2"), (Kind::Nbd, "a-1")];
        for (kind, name) in users {
            let user = if kind == Kind::Nbd { rig.occupy_nbd(name) } else { rig.occupy_vhost(name) };
            let refused = match rig.exports.withdraw(&NAMES, false) {
                Err(r) => r,
                Ok(_) => panic!("withdrawn while `{name}` was in use"),
            };
            assert_eq!((refused.name.as_str(), refused.export), (name, kind));
            assert!(refused.source.in_use(), "{refused}");
            assert_eq!(rig.state(), before, "refused at `{name}` by {}", refused.export.name());
            drop(user);
            let t = Instant::now();
            while !rig.exports.users(name).is_empty() {
                assert!(t.elapsed() < Duration::from_secs(5));
                std::thread::sleep(Duration::from_millis(5));
            }
        }
        // The allow list still holds for a client from outside it, and TLS is still offered.
        assert_eq!(rig.tcp_reply(OPT_GO, "a"), REP_ERR_POLICY);
        assert_eq!(rig.tcp_reply(OPT_STARTTLS, "a"), REP_ACK);
    }

    #[test]
    fn what_a_withdrawal_took_is_restored_as_it_was() {
        let rig = Rig::new("restored");
        let before = rig.state();
        let withdrawn = rig.exports.withdraw(&NAMES, false).unwrap();
        assert_eq!(rig.state(), (Vec::new(), Vec::new()));
        // A later step of the removal failed: everything comes back, allow lists included.
        rig.exports.restore(withdrawn);
        assert_eq!(rig.state(), before);
        assert_eq!(rig.tcp_reply(OPT_GO, "a-2"), REP_ERR_POLICY);
    }

    #[test]
    fn an_offer_refused_part_way_takes_back_what_it_gave() {
        let rig = Rig::new("offer");
        let extra = MemoryDevice::new("b", 1 << 20, 1);
        let taken = MemoryDevice::new("a-1", 1 << 20, 1);
        let before = rig.state();
        let offers = [
            Offer { front: extra.device.clone(), reach: Reach::Anywhere, vhost_user: true, ublk: false },
            Offer { front: taken.device.clone(), reach: Reach::Anywhere, vhost_user: true, ublk: false },
        ];
        let refused = rig.exports.offer(&offers).unwrap_err();
        assert_eq!((refused.name.as_str(), refused.export), ("a-1", Kind::Nbd));
        assert_eq!(rig.state(), before, "`b` was taken back");
    }
}
