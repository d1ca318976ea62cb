//! Who a client is: where it connects from, and how often its failures may be logged.

use std::io;
use std::os::fd::OwnedFd;
use std::time::Duration;

/// Clients decide how often their connections fail: at most 10 lines a second of it.
pub(crate) static CLIENT_LOG: bulkhead_sys::LogLimit = bulkhead_sys::LogLimit::new(10, Duration::from_secs(1));

/// Where a client connects from: `Local` over the unix socket, its address over TCP.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Peer {
    Local,
    Tcp(std::net::IpAddr),
}

/// The peer of `sock`; an error (a TCP peer whose address cannot be read) refuses it.
pub(crate) fn peer_of(sock: &OwnedFd) -> io::Result<Peer> {
    if std::os::unix::net::UnixStream::from(sock.try_clone()?).local_addr().is_ok() {
        return Ok(Peer::Local);
    }
    Ok(Peer::Tcp(std::net::TcpStream::from(sock.try_clone()?).peer_addr()?.ip()))
}
