//! The NBD export: serves every device to NBD clients (qemu, libnbd tools, the kernel's nbd
//! client, other hosts) on `<run-dir>/nbd.sock` and, when configured, TCP, with TLS
//! (`NBD_OPT_STARTTLS`, X.509 or pre-shared keys) when configured.
//!
//! One file a job: [`server`](NbdServer) accepts and owns the connections; `exports` holds
//! what is offered and who may reach it; `negotiate` runs the handshake; `transmit` serves a
//! connection's requests; `reply` sends the answers; `budget` bounds the payload memory of all
//! connections together; `sockbuf` reads the socket; `peer` says who a client is.
#![forbid(unsafe_code)]
#![deny(missing_docs)]

use std::sync::{Mutex, MutexGuard};

mod budget;
mod exports;
mod negotiate;
mod peer;
mod reply;
mod server;
mod sockbuf;
pub mod tls;
mod transmit;

pub use bulkhead_nbd::proto::MAX_PAYLOAD;
pub use exports::{Export, ExportError, Reach};
pub use negotiate::MAX_OPTION;
pub use server::{memory_bound, socket_path, Listeners, NbdServer, ServerConfig, ServerStats};

/// A lock, even if a thread that held it panicked: what it guards stays consistent between
/// statements.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
