//! The end of a chain: a [`Backend`] owns the storage and runs requests; what only some
//! backends can do is a small trait of its own, reached through the backend.
//!
//! - [`AsyncIo`]: requests complete after the call that starts them (an io_uring, a socket),
//!   so one slow request holds up no other (Cloud Hypervisor's `AsyncIo`).
//! - [`Remote`]: the backend depends on something outside the domain (a remote server).
//! - [`Upkeep`]: it has a doorbell and work of its own between requests (completions to
//!   collect, a channel below to start over).
//!
//! A backend without them is synchronous, local and quiet: `ram`, `null`, a qcow2 image.

use std::os::fd::RawFd;

use crate::{BlockError, Caps, Io, Request, Tag, TagSpace};

/// The end of a chain: owns the storage.
pub trait Backend: Send {
    /// Device size in bytes.
    fn size(&self) -> u64;
    /// What the backend can do.
    fn caps(&self) -> Caps;
    /// Executes every request of the batch, setting each `result`. Requests in one batch may
    /// complete in any order, except that a `Flush` covers every write before it in the batch.
    /// An asynchronous backend runs the batch on its engine and waits for it.
    fn execute(&mut self, ios: &mut [Io<'_>]);
    /// Its asynchronous engine, if requests complete after the call that starts them: the
    /// chain then starts each with [`AsyncIo::submit`] and collects it on a later turn, and
    /// [`execute`](Self::execute) is not used for requests.
    fn async_io(&mut self) -> Option<&mut dyn AsyncIo> {
        None
    }
    /// What it depends on outside the domain, if anything.
    fn remote(&mut self) -> Option<&mut dyn Remote> {
        None
    }
    /// Its doorbell and work of its own, if it has any.
    fn upkeep(&mut self) -> Option<&mut dyn Upkeep> {
        None
    }
}

/// An asynchronous engine: submission and completion by tag, with the request's windows owned
/// by the frontend until it is answered (Cloud Hypervisor's `AsyncIo`). Its backend's
/// [`Upkeep::wake_fd`] rings when a request completes.
pub trait AsyncIo {
    /// Called once before the first request with the tags there will be (as
    /// [`Layer::attach`](crate::Layer::attach)): per-request state is allocated here.
    fn attach(&mut self, tags: TagSpace);
    /// Starts `req` under `tag`. Its windows stay valid, and the tag unused, until its
    /// completion is reaped. `Some(result)` if it finished at once.
    fn submit(&mut self, tag: Tag, req: &Request<'_>) -> Option<Result<u64, BlockError>>;
    /// Lets the requests submitted since the last call start (one system call for them all).
    fn commit(&mut self);
    /// Hands each request that has completed since the last call to `done`.
    fn reap(&mut self, done: &mut dyn FnMut(Tag, Result<u64, BlockError>));
    /// Requests submitted and not yet reaped.
    fn in_flight(&self) -> usize;
}

/// A backend that depends on something outside the domain (a remote server, a ring the
/// supervisor lent).
pub trait Remote {
    /// Called once the domain is confined, before the first request: a backend that talks to
    /// something outside the domain connects here. An error is the same as
    /// [`lost`](Self::lost).
    fn start(&mut self) -> Result<(), crate::SetupError>;
    /// What it depends on is gone (the remote server closed the connection). The results of
    /// the last batch must then not be sent: the domain ends and the supervisor starts the next
    /// generation, to which the frontend reissues every unanswered request.
    fn lost(&self) -> Option<&str>;
    /// What it depends on is there but has stopped answering: requests fail by timeout
    /// rather than wait, and a new domain would fare no better. Cleared once a request is
    /// answered again. `bulkhead status` shows the device `reconnecting` meanwhile.
    fn stalled(&self) -> bool {
        false
    }
    /// Whether [`stalled`](Self::stalled) can ever say so: the domain then keeps the
    /// supervisor told, from its start.
    fn may_stall(&self) -> bool {
        false
    }
}

/// A backend with work of its own between requests.
pub trait Upkeep {
    /// A doorbell that says the backend has something to do (a completion, work of its
    /// own): the domain's loop wakes on it as on a request.
    fn wake_fd(&self) -> RawFd;
    /// Called between batches, whenever the domain's loop wakes or has spun idle a while. It
    /// must cost next to nothing when there is nothing to do.
    fn tend(&mut self);
}
