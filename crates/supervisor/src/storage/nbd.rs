//! A remote NBD server's export: its size read once at start, and the connections each
//! generation of the domain gets (the domain can open no socket itself).

use std::os::fd::{AsFd, OwnedFd};
use std::time::Duration;

use bulkhead_config::NbdTarget;

use super::Storage;
use crate::error::Error;

/// The storage of an `nbd` backend: nothing held, the export's size learned.
pub(super) fn open(uri: &str, target: &NbdTarget, export: &str, timeout: Duration, size: Option<u64>) -> Result<Storage, Error> {
    let export_size = probe(target, export, timeout).map_err(|e| e.context(format!("backend {uri}")))?;
    let size = super::fit(size, export_size, uri)?;
    Ok(Storage::held(size, format!("nbd:{uri}"), Vec::new()))
}

/// Connects to a remote NBD server within `timeout`. Refused connections and time-outs are
/// [`ErrorKind::Unreachable`](crate::ErrorKind::Unreachable): worth trying again.
pub(crate) fn connect(target: &NbdTarget, timeout: Duration) -> Result<OwnedFd, Error> {
    match target {
        NbdTarget::Unix(path) => std::os::unix::net::UnixStream::connect(path)
            .map(OwnedFd::from)
            .map_err(|e| Error::unreachable(format!("cannot connect to {}: {e}", path.display()))),
        NbdTarget::Tcp { host, port } => {
            use std::net::ToSocketAddrs;
            let addrs = (host.as_str(), *port)
                .to_socket_addrs()
                .map_err(|e| Error::unreachable(format!("cannot resolve {host}: {e}")))?;
            let mut last = format!("{host} has no address");
            for a in addrs {
                match std::net::TcpStream::connect_timeout(&a, timeout) {
                    Ok(s) => {
                        let _ = s.set_nodelay(true);
                        return Ok(OwnedFd::from(s));
                    }
                    Err(e) => last = format!("cannot connect to {a}: {e}"),
                }
            }
            Err(Error::unreachable(last))
        }
    }
}

/// Reads a remote export's size (the only negotiation outside a domain).
fn probe(target: &NbdTarget, export: &str, timeout: Duration) -> Result<u64, Error> {
    let sock = connect(target, timeout)?;
    let info = bulkhead_nbd::client::handshake(sock.as_fd(), export, timeout).map_err(|e| Error::failed(e.to_string()))?;
    bulkhead_nbd::client::disconnect(sock.as_fd());
    Ok(info.size)
}
