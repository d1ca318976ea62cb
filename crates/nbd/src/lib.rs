//! NBD for bulkhead: the protocol's wire format and the client the `nbd` backend uses to reach
//! a remote server. The export that serves bulkhead's devices is `bulkhead-nbd-export`.
#![forbid(unsafe_code)]
#![deny(missing_docs)]

pub mod allow;
pub mod client;
pub mod proto;
