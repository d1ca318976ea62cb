//! The interface of a filter or soft device: tagged submission and completion.

use crate::{BlockError, Caps, Request};

/// A request in flight in one domain: a dense index below the capacity the chain was attached
/// with ([`Layer::attach`]), so a layer keeps per-request state in a table allocated once
/// (SPDK's per-I/O context) and never allocates per request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Tag(u32);

impl Tag {
    /// The tag with index `i`.
    pub const fn new(i: u32) -> Self {
        Tag(i)
    }

    /// Its index, below the attached capacity.
    pub const fn index(self) -> usize {
        self.0 as usize
    }
}

/// How a domain's tags are laid out: each queue owns `per_queue` consecutive tags, so a layer
/// can tell which queue a request came in on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TagSpace {
    /// Queues.
    pub queues: u32,
    /// Tags of each queue (its ring's slots).
    pub per_queue: u32,
}

impl TagSpace {
    /// Every tag there can be.
    pub fn capacity(&self) -> usize {
        self.queues as usize * self.per_queue as usize
    }

    /// The queue a tag belongs to.
    pub fn queue_of(&self, tag: Tag) -> u32 {
        tag.0 / self.per_queue.max(1)
    }
}

/// What a layer does with a request it was handed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Pass it on to the layer below, unchanged.
    Forward,
    /// Answer it here with this result; nothing below sees it.
    Complete(Result<u64, BlockError>),
    /// Keep it for now; the layer's [`poll`](Layer::poll) hands it back later with a verdict
    /// of `Forward` or `Complete`, exactly once.
    Hold,
}

/// A filter or soft device between the frontend and the backend.
///
/// Every layer matches [`Request`] in full: there is no default pass-through, because a filter
/// that forwards an operation it does not understand corrupts data. A layer sees each request
/// on its way down (`submit`) and, unless it answered the request itself, on its way up
/// (`complete`), where it may change the result. Read buffers are writable at completion, so a
/// layer may also transform what was read in place.
pub trait Layer: Send {
    /// Short name for logs and status.
    fn name(&self) -> &'static str;
    /// Capabilities seen from above, given those below.
    fn caps(&self, lower: Caps) -> Caps;
    /// Size seen from above, given the size below.
    fn size(&self, lower: u64) -> u64;
    /// Called once before any request with the tags there will be. Per-request state is
    /// allocated here.
    fn attach(&mut self, tags: TagSpace);
    /// A request on its way down. `now_ns` is the monotonic clock.
    fn submit(&mut self, tag: Tag, req: &Request<'_>, now_ns: u64) -> Verdict;
    /// A request this layer passed on has completed below; `result` may be changed.
    fn complete(&mut self, tag: Tag, req: &Request<'_>, result: &mut Result<u64, BlockError>, now_ns: u64);
    /// Releases held requests whose time has come, through `release`, and returns when it next
    /// needs to be polled (monotonic ns), or `None` if it holds nothing.
    fn poll(&mut self, now_ns: u64, release: &mut dyn FnMut(Tag, Verdict)) -> Option<u64>;
    /// Called between turns of the domain (at least every half second while it runs, and once
    /// as it stops): a layer that buffers output (a trace) writes it out here.
    fn idle(&mut self) {}
}
