//! What the server offers: each export is a device and who may reach it over TCP, kept
//! together so that an export taken out and offered again comes back as it was.

use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard};

use bulkhead_client::Device;
use bulkhead_nbd::allow::Cidr;

use crate::peer::Peer;

/// Who may reach an export over TCP. Clients of the unix socket are not asked: the socket's
/// file permissions guard it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Reach {
    /// Any address.
    #[default]
    Anywhere,
    /// Only addresses in these ranges.
    Only(Vec<Cidr>),
}

impl Reach {
    /// `Only(list)` for a list, `Anywhere` for none.
    pub fn from_list(list: Option<Vec<Cidr>>) -> Reach {
        list.map_or(Reach::Anywhere, Reach::Only)
    }

    /// Whether a client from `peer` may reach the export.
    pub(crate) fn allows(&self, peer: Peer) -> bool {
        match (peer, self) {
            (Peer::Local, _) | (_, Reach::Anywhere) => true,
            (Peer::Tcp(ip), Reach::Only(ranges)) => ranges.iter().any(|r| r.contains(ip)),
        }
    }
}

/// One export: a device, named after it, and who may reach it.
/// [`NbdServer::remove`](crate::NbdServer::remove) hands back the export it took out, so that
/// [`NbdServer::add`](crate::NbdServer::add) offers it again exactly as it was.
#[derive(Debug, Clone)]
pub struct Export {
    /// The device.
    pub device: Arc<Device>,
    /// Who may reach it over TCP.
    pub reach: Reach,
}

impl Export {
    /// `device`, reachable as `reach` says.
    pub fn new(device: Arc<Device>, reach: Reach) -> Export {
        Export { device, reach }
    }

    /// The export's name: its device's.
    pub fn name(&self) -> &str {
        self.device.name()
    }
}

/// Why an export could not be added or taken out.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ExportError {
    /// An export of that name is offered already.
    #[error("the NBD export has an export `{0}` already")]
    NameTaken(String),
    /// Clients are connected to the export and the removal was not forced.
    #[error("{clients} NBD client(s) are connected to it")]
    InUse {
        /// The export.
        name: String,
        /// How many.
        clients: usize,
    },
}

/// The exports on offer; they come and go while the server runs.
#[derive(Debug, Default)]
pub(crate) struct Exports {
    list: RwLock<Vec<Export>>,
}

impl Exports {
    pub(crate) fn new(list: Vec<Export>) -> Exports {
        Exports { list: RwLock::new(list) }
    }

    pub(crate) fn read(&self) -> RwLockReadGuard<'_, Vec<Export>> {
        self.list.read().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn write(&self) -> RwLockWriteGuard<'_, Vec<Export>> {
        self.list.write().unwrap_or_else(|e| e.into_inner())
    }

    /// The export named `name`; the empty name is the default export, the first.
    pub(crate) fn find(&self, name: &[u8]) -> Option<Export> {
        let list = self.read();
        if name.is_empty() {
            return list.first().cloned();
        }
        list.iter().find(|e| e.name().as_bytes() == name).cloned()
    }

    /// The names of the exports `peer` may reach, for a listing.
    pub(crate) fn names_for(&self, peer: Peer) -> Vec<String> {
        self.read().iter().filter(|e| e.reach.allows(peer)).map(|e| e.name().to_string()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reach_asks_only_tcp_peers_and_only_when_listed() {
        let only = Reach::Only(vec![Cidr::parse("10.0.0.0/8").unwrap()]);
        assert!(only.allows(Peer::Local), "the unix socket's permissions guard it");
        assert!(only.allows(Peer::Tcp("10.1.2.3".parse().unwrap())));
        assert!(!only.allows(Peer::Tcp("127.0.0.1".parse().unwrap())));
        assert!(Reach::Anywhere.allows(Peer::Tcp("127.0.0.1".parse().unwrap())));
        assert_eq!(Reach::from_list(None), Reach::Anywhere);
    }
}
