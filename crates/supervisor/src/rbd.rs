//! The supervisor's side of an `rbd` device: what its domains may connect to, the broker that
//! makes those connections for them, and what earlier generations said once they had opened the
//! image (their lock owners, its size).
//!
//! An rbd domain keeps the empty network namespace every domain has. Its `socket` and `connect`
//! calls come here as seccomp notifications (`bulkhead_sys::seccomp_notify`). For `socket` the
//! broker makes a TCP socket in the host's namespace and installs it in the domain as the
//! call's result. For `connect` it reads the address from the domain's memory, checks it
//! against the cluster's (the monitors, and the OSD networks the configuration names), and
//! connects the domain's socket itself (through a copy of the descriptor), so the domain
//! never names an address the kernel acts on. Data never passes through the broker; a refused
//! address fails the call with EACCES and is logged once.

use crate::error::Error;
use std::collections::HashSet;
use std::net::{IpAddr, SocketAddr, ToSocketAddrs};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bulkhead_sys::seccomp_notify as notify;

/// Where an rbd device's domains may connect.
#[derive(Debug, Clone)]
pub(crate) struct Reach {
    /// The monitors, resolved.
    mons: Vec<SocketAddr>,
    /// Address ranges of the OSDs (any port).
    networks: Vec<(IpAddr, u8)>,
}

impl Reach {
    /// Resolves `mon_host` (monitors without a port listen on 3300 and 6789); `networks` are
    /// the OSDs' ranges, the monitors' hosts when empty.
    pub(crate) fn resolve(mon_host: &str, networks: &[String]) -> Result<Reach, Error> {
        let mut mons = Vec::new();
        for (host, port) in bulkhead_config::parse_mon_host(mon_host).map_err(|e| Error::invalid(e.to_string()))? {
            let ports = match port {
                Some(p) => vec![p],
                None => vec![3300, 6789],
            };
            for p in ports {
                let addrs =
                    (host.as_str(), p).to_socket_addrs().map_err(|e| Error::unreachable(format!("monitor `{host}`: {e}")))?;
                mons.extend(addrs);
            }
        }
        let mut nets = Vec::new();
        for n in networks {
            nets.push(bulkhead_config::parse_cidr(n).map_err(|e| Error::invalid(e.to_string()))?);
        }
        if nets.is_empty() {
            let hosts: HashSet<IpAddr> = mons.iter().map(|a| a.ip()).collect();
            nets = hosts.into_iter().map(|ip| (ip, if ip.is_ipv4() { 32 } else { 128 })).collect();
        }
        Ok(Reach { mons, networks: nets })
    }

    /// Whether a domain may connect to `to`.
    pub(crate) fn allows(&self, to: &SocketAddr) -> bool {
        self.mons.contains(to) || self.networks.iter().any(|(net, bits)| in_range(to.ip(), *net, *bits))
    }

    /// Reaches a monitor that answers within `timeout`, as the supervisor checks a remote
    /// server before it starts a domain for it: a cluster that cannot be reached leaves the
    /// device `reconnecting` rather than starting domains that cannot work. A monitor answers
    /// a connection with its banner (`ceph v2` or `ceph v027`) at once; a stopped one accepts
    /// the connection in the kernel and says nothing.
    pub(crate) fn probe(&self, timeout: Duration) -> Result<(), Error> {
        use std::io::Read;
        let mut last = "no monitor address".to_string();
        for a in &self.mons {
            let banner = std::net::TcpStream::connect_timeout(a, timeout).and_then(|mut s| {
                s.set_read_timeout(Some(timeout))?;
                let mut b = [0u8; 6];
                s.read_exact(&mut b)?;
                Ok(b)
            });
            match banner {
                Ok(b) if &b == b"ceph v" => return Ok(()),
                Ok(_) => last = format!("monitor {a}: not a Ceph monitor (no banner)"),
                Err(e) => last = format!("monitor {a}: {e}"),
            }
        }
        Err(Error::unreachable(last))
    }
}

fn in_range(ip: IpAddr, net: IpAddr, bits: u8) -> bool {
    match (ip, net) {
        (IpAddr::V4(a), IpAddr::V4(n)) => {
            let mask = if bits == 0 { 0 } else { u32::MAX << (32 - u32::from(bits)) };
            u32::from(a) & mask == u32::from(n) & mask
        }
        (IpAddr::V6(a), IpAddr::V6(n)) => {
            let mask = if bits == 0 { 0 } else { u128::MAX << (128 - u32::from(bits)) };
            u128::from(a) & mask == u128::from(n) & mask
        }
        _ => false,
    }
}

/// What a device's domains said once they had opened the image: their client addresses, the
/// lock owners a later domain may break (newest last, a few kept), and the image's size. With
/// a keeper the addresses are kept across a restart of `serve` too: its domains die with it,
/// and their locks with them only once the cluster notices, which takes about 30 s.
#[derive(Debug, Clone)]
pub(crate) struct Opened {
    owners: Arc<Mutex<Vec<String>>>,
    kept_as: Arc<str>,
    keep: crate::kept::Keep,
    image_bytes: Arc<AtomicU64>,
}

impl Opened {
    /// `device`'s, starting from what an earlier `serve` kept in `keep`.
    pub(crate) fn of_device(device: &str, keep: crate::kept::Keep) -> Opened {
        let kept_as = crate::kept::rbd_owners_name(device);
        let list: Vec<String> = keep
            .take_text(&kept_as)
            .map(|t| t.lines().map(str::trim).filter(|l| !l.is_empty()).map(String::from).collect())
            .unwrap_or_default();
        if !list.is_empty() {
            log::info!("device {device}: {} lock owner(s) of the serve before this one kept", list.len());
            // Kept again at once: this `serve` may die before its first domain says its own.
            keep.keep_text(&kept_as, &(list.join("\n") + "\n"));
        }
        Opened { owners: Arc::new(Mutex::new(list)), kept_as: kept_as.into(), keep, image_bytes: Arc::default() }
    }

    /// The image's size as a domain of this device last found it; `None` before one has
    /// opened it.
    pub(crate) fn image_bytes(&self) -> Option<u64> {
        Some(self.image_bytes.load(Ordering::Acquire)).filter(|&n| n > 0)
    }

    /// The earlier domains' client addresses, oldest first.
    pub(crate) fn owners(&self) -> Vec<String> {
        self.owners.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn push(&self, addr: String) {
        let mut v = self.owners.lock().unwrap_or_else(|e| e.into_inner());
        v.push(addr);
        let excess = v.len().saturating_sub(8);
        v.drain(..excess);
        self.keep.keep_text(&self.kept_as, &(v.join("\n") + "\n"));
    }
}

/// Starts the broker of one domain: it answers `listener`'s notifications until the domain
/// is gone, and records the client address the domain writes on `owner_pipe`.
pub(crate) fn broker(device: &str, pidfd: OwnedFd, listener: OwnedFd, owner_pipe: Option<OwnedFd>, reach: Reach, opened: Opened) {
    let device = device.to_string();
    let _ = std::thread::Builder::new().name(format!("rbd-broker-{device}")).spawn(move || {
        let mut refused: HashSet<String> = HashSet::new();
        let mut owner_pipe = owner_pipe.map(std::fs::File::from);
        let mut owner_line = Vec::new();
        loop {
            let mut fds = vec![libc::pollfd { fd: listener.as_raw_fd(), events: libc::POLLIN, revents: 0 }];
            if let Some(p) = &owner_pipe {
                fds.push(libc::pollfd { fd: p.as_raw_fd(), events: libc::POLLIN, revents: 0 });
            }
            if bulkhead_sys::poll(&mut fds, 1000).is_err() {
                continue;
            }
            if fds.get(1).is_some_and(|f| f.revents != 0) {
                let mut buf = [0u8; 256];
                let n = owner_pipe.as_mut().map_or(0, |p| std::io::Read::read(p, &mut buf).unwrap_or(0));
                owner_line.extend_from_slice(&buf[..n]);
                if n == 0 || owner_line.contains(&b'\n') || owner_line.len() > 1024 {
                    // `ADDRESS SIZE`, once the domain has opened the image.
                    let line = String::from_utf8_lossy(&owner_line).lines().next().unwrap_or("").to_string();
                    let mut words = line.split_whitespace();
                    if let Some(addr) = words.next() {
                        opened.push(addr.to_string());
                    }
                    if let Some(size) = words.next().and_then(|w| w.parse::<u64>().ok()) {
                        opened.image_bytes.store(size, Ordering::Release);
                    }
                    owner_pipe = None;
                }
            }
            let ev = fds[0].revents;
            if ev & libc::POLLIN != 0 {
                let n = match notify::receive(listener.as_fd()) {
                    Ok(n) => n,
                    // The caller went away (killed) between the poll and the receive.
                    Err(_) => continue,
                };
                let reply = match serve_call(&listener, &pidfd, &n, &reach) {
                    Ok(None) => continue,
                    Ok(Some(r)) => r,
                    Err(Refusal::Address(to)) => {
                        if refused.insert(to.clone()) {
                            log::warn!(
                                "device {device}: rbd domain: refused a connection to {to}: not a monitor, nor in `networks`"
                            );
                        }
                        Err(libc::EACCES)
                    }
                    Err(Refusal::Errno(e)) => Err(e),
                };
                let _ = notify::answer(listener.as_fd(), n.id, reply);
            } else if ev & (libc::POLLHUP | libc::POLLERR | libc::POLLNVAL) != 0 {
                // Every thread of the domain has exited.
                return;
            }
        }
    });
}

enum Refusal {
    Address(String),
    Errno(i32),
}

/// Answers notification `n` (a `socket` or a `connect`): `Ok(Some(result))` to reply with,
/// `Ok(None)` if installing a socket already answered it, or why it is refused.
fn serve_call(
    listener: &OwnedFd,
    pidfd: &OwnedFd,
    n: &notify::Notification,
    reach: &Reach,
) -> Result<Option<Result<i64, i32>>, Refusal> {
    if n.nr == libc::SYS_socket as i32 {
        let (family, kind, protocol) = (n.args[0] as i32, n.args[1] as i32, n.args[2] as i32);
        let flags = kind & (libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC);
        if !matches!(family, libc::AF_INET | libc::AF_INET6)
            || kind & !flags != libc::SOCK_STREAM
            || !matches!(protocol, 0 | libc::IPPROTO_TCP)
        {
            return Err(Refusal::Errno(libc::EACCES));
        }
        let sock = bulkhead_sys::tcp_socket(family, flags & libc::SOCK_NONBLOCK != 0)
            .map_err(|e| Refusal::Errno(e.raw_os_error().unwrap_or(libc::EMFILE)))?;
        notify::install_as_result(listener.as_fd(), n.id, sock.as_fd(), flags & libc::SOCK_CLOEXEC != 0)
            .map_err(|e| Refusal::Errno(e.raw_os_error().unwrap_or(libc::EMFILE)))?;
        return Ok(None);
    }
    if n.nr != libc::SYS_connect as i32 {
        return Err(Refusal::Errno(libc::ENOSYS));
    }
    let (fd, addr, len) = (n.args[0] as i32, n.args[1], n.args[2] as usize);
    if !(2..=128).contains(&len) {
        return Err(Refusal::Errno(libc::EINVAL));
    }
    let raw = notify::read_memory(n.pid, addr, len).map_err(|e| Refusal::Errno(e.raw_os_error().unwrap_or(libc::EFAULT)))?;
    // What was read is what the caller asked only if it is still waiting.
    if !notify::still_waiting(listener.as_fd(), n.id) {
        return Err(Refusal::Errno(libc::EINTR));
    }
    let family = u16::from_ne_bytes([raw[0], raw[1]]);
    let to = match i32::from(family) {
        libc::AF_INET if raw.len() >= 8 => {
            let port = u16::from_be_bytes([raw[2], raw[3]]);
            SocketAddr::from(([raw[4], raw[5], raw[6], raw[7]], port))
        }
        libc::AF_INET6 if raw.len() >= 24 => {
            let port = u16::from_be_bytes([raw[2], raw[3]]);
            let ip: [u8; 16] = raw[8..24].try_into().expect("16 bytes");
            SocketAddr::from((ip, port))
        }
        other => return Err(Refusal::Address(format!("an address of family {other}"))),
    };
    if !reach.allows(&to) {
        return Err(Refusal::Address(to.to_string()));
    }
    // The domain's socket itself (every TCP socket it has, the broker made): connected here,
    // to the address checked, whatever the domain's memory says by now.
    let theirs = notify::pidfd_getfd(pidfd.as_fd(), fd).map_err(|e| Refusal::Errno(e.raw_os_error().unwrap_or(libc::EBADF)))?;
    let result = match bulkhead_sys::connect_nonblocking(theirs.as_fd(), &to) {
        Ok(()) => Ok(0),
        Err(e) => Err(e.raw_os_error().unwrap_or(libc::ECONNREFUSED)),
    };
    Ok(Some(result))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reach_allows_the_monitors_and_the_osd_networks_only() {
        let r = Reach::resolve("v2:127.0.0.1:3300, [v2:127.0.0.2:3300,v1:127.0.0.2:6789]", &["10.1.0.0/16".into()]).unwrap();
        assert!(r.allows(&"127.0.0.1:3300".parse().unwrap()));
        assert!(r.allows(&"127.0.0.2:3300".parse().unwrap()));
        assert!(!r.allows(&"127.0.0.1:22".parse().unwrap()), "a monitor's host, another port, with networks given");
        assert!(r.allows(&"10.1.200.3:6800".parse().unwrap()));
        assert!(!r.allows(&"10.2.0.1:6800".parse().unwrap()));
        let local = Reach::resolve("127.0.0.1", &[]).unwrap();
        assert!(local.allows(&"127.0.0.1:6789".parse().unwrap()) && local.allows(&"127.0.0.1:6801".parse().unwrap()));
        assert!(!local.allows(&"127.0.0.9:6801".parse().unwrap()));
        assert!(!local.allows(&"[::1]:3300".parse().unwrap()));
    }
}
