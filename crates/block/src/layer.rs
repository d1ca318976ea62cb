//! The interface of a filter or soft device: tagged submission and completion.

use crate::{BlockError, Caps, Command, Outcome, Request, SharedSlice};

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
    /// Send this request below in its place, under the same tag: an encrypting layer writes
    /// ciphertext from its scratch memory, a layer with a header moves the offset, a
    /// copy-on-write layer reads a whole cluster to merge a partial write into. Its result
    /// comes back to [`complete`](Layer::complete), which may send another.
    Send(Sub),
    /// Answer it here with this result; nothing below sees it.
    Complete(Result<u64, BlockError>),
    /// Keep it for now; the layer's [`poll`](Layer::poll) hands it back later with a verdict
    /// of `Forward`, `Send` or `Complete`, exactly once.
    Hold,
}

/// Where the data of a [`Sub`] lives: a byte range of the request the layer was handed, or of
/// its scratch memory for the tag (private to the domain: what the layers below and the
/// backend see of it is only what the layer put there).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Data {
    /// `len` bytes from `at` bytes into the handed request's windows.
    Handed {
        /// Byte position in the handed request's data.
        at: u64,
        /// Bytes.
        len: u64,
    },
    /// `len` bytes from `at` bytes into the layer's scratch memory for this tag.
    Scratch {
        /// Byte position in the scratch memory.
        at: u64,
        /// Bytes.
        len: u64,
    },
}

impl Data {
    /// Bytes.
    pub fn len(&self) -> u64 {
        match *self {
            Data::Handed { len, .. } | Data::Scratch { len, .. } => len,
        }
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A request a layer sends below in place of the one it was handed ([`Verdict::Send`]): its
/// data is in the handed request's windows or the layer's scratch memory.
pub type Sub = Command<Data, Data>;

/// What a layer does with the result of a request it passed on, once that has completed
/// below ([`Layer::complete`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum After {
    /// Hand the result (as the layer may have changed it) up.
    Up,
    /// Send another request below for the same handed request, under the same tag (the next
    /// chunk of a large write, the write after a read that merges a cluster).
    Send(Sub),
    /// Keep the completed request for now (a performance model delaying its completion): the
    /// layer's [`poll`](Layer::poll) hands it up later, exactly once, with
    /// `Verdict::Complete(result)`; any other verdict for it fails the request as the
    /// layer's bug.
    Hold,
}

/// Reads the device below a layer while it opens ([`Layer::open`]), through the layers below
/// it, before any request arrives.
pub trait ReadBelow {
    /// Fills `buf` from `offset` below.
    fn read(&mut self, offset: u64, buf: &mut [u8]) -> Result<(), BlockError>;
    /// Size below, in bytes.
    fn size(&self) -> u64;
}

/// A filter or soft device between the frontend and the backend.
///
/// Every layer matches [`Request`] in full: there is no default pass-through, because a filter
/// that forwards an operation it does not understand corrupts data. A layer sees each request
/// on its way down (`submit`) and, unless it answered the request itself, on its way up
/// (`complete`), where it may change the result. Read buffers are writable at completion, so a
/// layer may also transform what was read in place.
///
/// A layer that must change what goes below — move it, split it, send data of its own —
/// sends a [`Sub`] instead of forwarding, one at a time per tag, with its data in the handed
/// request's windows or in the layer's scratch memory ([`scratch_bytes`](Self::scratch_bytes)
/// per tag, allocated once at attach; SPDK's per-I/O context). Everything a layer needs per
/// request is thus allocated before the first one.
pub trait Layer: Send {
    /// Short name for logs and status.
    fn name(&self) -> &'static str;
    /// Capabilities seen from above, given those below: by default the same.
    fn caps(&self, lower: Caps) -> Caps {
        lower
    }
    /// Size seen from above, given the size below: by default the same.
    fn size(&self, lower: u64) -> u64 {
        lower
    }
    /// Private memory this layer wants for each tag, for the data of the [`Sub`]s it sends.
    /// Asked once, before [`attach`](Self::attach).
    fn scratch_bytes(&self) -> usize {
        0
    }
    /// Called once, after the backend has started and the layers below have opened, before
    /// any request: a layer with metadata on the device below (an encryption header) reads it
    /// here. An error ends the domain with this message.
    fn open(&mut self, _below: &mut dyn ReadBelow) -> Result<(), crate::SetupError> {
        Ok(())
    }
    /// Called once before any request with the tags there will be. Per-request state is
    /// allocated here; a layer that keeps none has nothing to do.
    fn attach(&mut self, _tags: TagSpace) {}
    /// A request on its way down. `scratch` is the layer's scratch memory for `tag` (empty
    /// if it asked for none); `now_ns` is the monotonic clock.
    fn submit(&mut self, tag: Tag, req: &Request<'_>, scratch: SharedSlice<'_>, now_ns: u64) -> Verdict;
    /// What this layer passed on (the request, or its last [`Sub`]) has completed below;
    /// `result` may be changed, and is the handed request's once this returns [`After::Up`]
    /// (the chain does not mend a sub-request's byte count: the layer sets what the handed
    /// request transferred).
    fn complete(&mut self, tag: Tag, req: &Request<'_>, scratch: SharedSlice<'_>, result: &mut Outcome, now_ns: u64) -> After;
    /// Releases held requests whose time has come, through `release`, and returns when it next
    /// needs to be polled (monotonic ns), or `None` if it holds nothing. While any layer holds
    /// requests, the chain also polls soon after each completion passes through it, so a layer
    /// that waits for what it sent below to finish (a disk scheduler) can send the next.
    fn poll(&mut self, now_ns: u64, release: &mut dyn FnMut(Tag, Verdict)) -> Option<u64>;
    /// Called between turns of the domain (every 100 ms or so while [`idle_wanted`] says so,
    /// and once as it stops): a layer that buffers output (a trace) writes it out here.
    ///
    /// [`idle_wanted`]: Self::idle_wanted
    fn idle(&mut self) {}
    /// Whether [`idle`](Self::idle) has something to do (output buffered and not yet written).
    /// A domain with nothing to do sleeps until asked unless a layer says so.
    fn idle_wanted(&self) -> bool {
        false
    }
}
