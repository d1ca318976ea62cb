//! NBD for bulkhead: the export that serves every device to NBD clients (qemu, libnbd tools,
//! the kernel's nbd client, other hosts), and the client the `nbd` backend uses.
#![deny(missing_docs)]

pub mod client;
pub mod proto;
pub mod server;

pub use server::{socket_path, NbdServer, ServerConfig, ServerStats, MAX_PAYLOAD};
