//! A chain of layers over a backend, driven by tag.

use std::time::{Duration, Instant};

use arrayvec::ArrayVec;
use bulkhead_shmem::{Mapping, SharedSlice, SliceList};

use crate::layer::{After, Data, ReadBelow, Sub};
use crate::SetupError;
use crate::{AsyncIo, Backend, BlockError, Caps, Io, Layer, Request, Tag, TagSpace, Verdict};

/// Requests handed to the backend in one call at most.
const BACKEND_BATCH: usize = 64;

/// Bytes one read of a layer's [`open`](Layer::open) moves through the layers below at once.
const OPEN_CHUNK: usize = 256 << 10;

/// How long a layer's reads while it opens may take in all before the domain gives up.
const OPEN_TIMEOUT: Duration = Duration::from_secs(30);

/// Why a chain could not start.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StartError {
    /// The backend lost what it depends on (see [`Remote::start`](crate::Remote::start)): the next domain may
    /// succeed.
    #[error("{0}")]
    Lost(SetupError),
    /// A layer could not open (see [`Layer::open`]): a bad header, a wrong key. Starting over
    /// will not help.
    #[error("filter {layer}: {message}")]
    Open {
        /// The layer's name.
        layer: &'static str,
        /// What it said.
        message: SetupError,
    },
    /// The layers' scratch memory could not be made.
    #[error("the layers' scratch memory: {0}")]
    Scratch(String),
}

/// The scratch memory of every layer: for layer `i`, `per_tag[i]` bytes for each tag from
/// `base[i]`, in one private mapping made at attach.
#[derive(Default)]
struct Scratch {
    map: Option<Mapping>,
    base: Vec<usize>,
    per_tag: Vec<usize>,
}

impl Scratch {
    fn new(sizes: &[usize], capacity: usize) -> Result<Self, StartError> {
        let page = 4096;
        let per_tag: Vec<usize> = sizes.iter().map(|&b| b.div_ceil(page) * page).collect();
        let mut base = Vec::with_capacity(sizes.len());
        let mut total = 0usize;
        for &p in &per_tag {
            base.push(total);
            total = p
                .checked_mul(capacity)
                .and_then(|b| total.checked_add(b))
                .ok_or_else(|| StartError::Scratch("it does not fit the address space".into()))?;
        }
        let map = match total {
            0 => None,
            n => Some(Mapping::private(n).map_err(|e| StartError::Scratch(format!("{n} bytes: {e}")))?),
        };
        Ok(Scratch { map, base, per_tag })
    }

    /// Layer `layer`'s scratch for `tag` (empty if it has none).
    fn of(&self, layer: usize, tag: Tag) -> SharedSlice<'_> {
        let per = self.per_tag.get(layer).copied().unwrap_or(0);
        match &self.map {
            Some(m) if per > 0 => m.slice(self.base[layer] + tag.index() * per, per).unwrap_or(SharedSlice::empty()),
            _ => SharedSlice::empty(),
        }
    }
}

/// The request a layer's [`Sub`] stands for, given the request the layer was handed and its
/// scratch for the tag; `Invalid` if its data lies outside them.
fn resolve<'a>(sub: &Sub, handed: &Request<'a>, scratch: SharedSlice<'a>) -> Result<Request<'a>, BlockError> {
    let data = |d: Data| -> Result<SliceList<'a>, BlockError> {
        match d {
            Data::Handed { at, len } => match handed {
                Request::Read { into: bufs, .. } | Request::Write { from: bufs, .. } => {
                    bufs.range(at, len).ok_or(BlockError::Invalid("a layer sent data outside the request's buffers"))
                }
                Request::Flush | Request::Discard { .. } | Request::WriteZeroes { .. } => {
                    Err(BlockError::Invalid("a layer sent data of a request that has none"))
                }
            },
            Data::Scratch { at, len } => {
                let (at, len) = (usize::try_from(at), usize::try_from(len));
                match (at, len) {
                    (Ok(at), Ok(len)) => scratch
                        .sub(at, len)
                        .map(SliceList::one)
                        .map_err(|_| BlockError::Invalid("a layer sent data outside its scratch memory")),
                    _ => Err(BlockError::Invalid("a layer sent data outside its scratch memory")),
                }
            }
        }
    };
    Ok(match *sub {
        Sub::Read { offset, into } => {
            let bufs = data(into)?;
            if bufs.iter().any(|s| !s.is_writable()) {
                return Err(BlockError::Invalid("a layer read into a write's buffers"));
            }
            Request::Read { offset, into: bufs }
        }
        Sub::Write { offset, from, fua } => Request::Write { offset, from: data(from)?, fua },
        Sub::Flush => Request::Flush,
        Sub::Discard { offset, len } => Request::Discard { offset, len },
        Sub::WriteZeroes { offset, len } => Request::WriteZeroes { offset, len },
    })
}

/// Layers over a backend. The domain's runtime hands it new requests by tag
/// ([`run`](Self::run)); the chain walks each down through the layers' verdicts, gives the
/// backend in batches what reaches it, walks the results back up, and reports every request
/// that completes, including those layers held and released later.
pub struct Chain {
    layers: Vec<Box<dyn Layer>>,
    backend: Box<dyn Backend>,
    /// What each layer sent below in place of each request in flight (`None`: the request as
    /// handed), by layer, then tag.
    sent: Vec<Vec<Option<Sub>>>,
    /// Tags whose request a layer holds after it completed below ([`After::Hold`]).
    held_up: Vec<bool>,
    /// What one turn leaves to the next.
    turns: Turns,
    /// Last, so that it is unmapped after the backend, which may hold its windows, is gone.
    scratch: Scratch,
}

impl std::fmt::Debug for Chain {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Chain").field("layers", &self.layer_names()).field("held", &self.turns.held).finish()
    }
}

impl Chain {
    /// `layers[0]` is nearest the frontend.
    pub fn new(layers: Vec<Box<dyn Layer>>, mut backend: Box<dyn Backend>) -> Self {
        Chain {
            sent: layers.iter().map(|_| Vec::new()).collect(),
            layers,
            turns: Turns::new(backend.async_io().is_some()),
            backend,
            held_up: Vec::new(),
            scratch: Scratch::default(),
        }
    }

    /// Names of the layers, top first.
    pub fn layer_names(&self) -> Vec<&'static str> {
        self.layers.iter().map(|l| l.name()).collect()
    }

    /// Number of layers.
    pub fn layer_count(&self) -> usize {
        self.layers.len()
    }

    /// Tells every layer how many tags there can be and makes their scratch memory; call
    /// once before [`run`](Self::run).
    pub fn attach(&mut self, tags: TagSpace) -> Result<(), StartError> {
        let capacity = tags.capacity();
        let sizes: Vec<usize> = self.layers.iter().map(|l| l.scratch_bytes()).collect();
        self.scratch = Scratch::new(&sizes, capacity)?;
        for l in &mut self.layers {
            l.attach(tags);
        }
        if let Some(io) = self.backend.async_io() {
            io.attach(tags);
        }
        self.held_up = vec![false; capacity];
        self.turns.reserve(capacity.min(LIST_ROOM));
        // The tables of what each tag sent last, after the small ones: under write capture
        // their first entries, the busy ones, then lie next to the working lists and to the
        // domain's tag table made right after, so that the page gate shuts them in one range.
        for sent in &mut self.sent {
            *sent = vec![None; capacity];
        }
        Ok(())
    }

    /// Device size seen from the top.
    pub fn size(&self) -> u64 {
        self.size_below(0)
    }

    /// Size seen from above layer `from`.
    fn size_below(&self, from: usize) -> u64 {
        self.layers[from..].iter().rev().fold(self.backend.size(), |s, l| l.size(s))
    }

    /// Capabilities seen from the top.
    pub fn caps(&self) -> Caps {
        self.layers.iter().rev().fold(self.backend.caps(), |c, l| l.caps(c))
    }

    /// Requests some layer holds now.
    pub fn held(&self) -> usize {
        self.turns.held
    }

    /// Requests an asynchronous backend has started and not yet answered: the chain needs a
    /// [`run`](Self::run) to collect them even if no request arrives (the backend's
    /// [`wake_fd`](Self::backend_wake_fd) rings when one completes).
    pub fn at_backend(&mut self) -> usize {
        self.backend.async_io().map_or(0, |io| io.in_flight())
    }

    /// When the chain next needs a [`run`](Self::run) even if no request arrives (a held
    /// request's time), monotonic ns.
    pub fn next_poll(&self) -> Option<u64> {
        self.turns.next_poll
    }

    /// Starts the backend (see [`Remote::start`](crate::Remote::start)), then opens the layers from the bottom up
    /// (see [`Layer::open`]), each reading through those below it. `clock` is the monotonic
    /// clock in ns. Call after [`attach`](Self::attach).
    pub fn start(&mut self, clock: &dyn Fn() -> u64) -> Result<(), StartError> {
        if let Some(remote) = self.backend.remote() {
            remote.start().map_err(StartError::Lost)?;
        }
        for at in (0..self.layers.len()).rev() {
            let size = self.size_below(at + 1);
            let Chain { layers, backend, sent, scratch, held_up, .. } = self;
            let (upper, lower) = layers.split_at_mut(at + 1);
            let mut below = OpenRead {
                walk: Walk::new(lower, &mut sent[at + 1..], held_up, scratch, at + 1, backend.as_mut()),
                size,
                clock,
                buf: None,
            };
            let layer = &mut upper[at];
            layer.open(&mut below).map_err(|message| StartError::Open { layer: layer.name(), message })?;
            if let Some(why) = self.lost() {
                return Err(StartError::Lost(SetupError::new(why)));
            }
        }
        Ok(())
    }

    /// The backend lost what it depends on (see [`Remote::lost`](crate::Remote::lost)).
    pub fn lost(&mut self) -> Option<&str> {
        self.backend.remote().and_then(|r| r.lost())
    }

    /// Whether the backend's remote has stopped answering (see [`Remote::stalled`](crate::Remote::stalled)); `None`
    /// for a backend that cannot.
    pub fn stalled(&mut self) -> Option<bool> {
        self.backend.remote().filter(|r| r.may_stall()).map(|r| r.stalled())
    }

    /// The backend's doorbell for completions and work of its own (see [`Upkeep::wake_fd`](crate::Upkeep::wake_fd)).
    pub fn backend_wake_fd(&mut self) -> Option<std::os::fd::RawFd> {
        self.backend.upkeep().map(|u| u.wake_fd())
    }

    /// Lets the backend do work of its own (see [`Upkeep::tend`](crate::Upkeep::tend)).
    pub fn tend(&mut self) {
        if let Some(u) = self.backend.upkeep() {
            u.tend();
        }
    }

    /// Whether a layer has housekeeping to do (see [`Layer::idle_wanted`]).
    pub fn idle_wanted(&self) -> bool {
        self.layers.iter().any(|l| l.idle_wanted())
    }

    /// Lets layers write out what they buffer (see [`Layer::idle`]).
    pub fn idle(&mut self) {
        for l in &mut self.layers {
            l.idle();
        }
    }

    /// One turn: releases what layers let go of by now, walks each of `new` down, runs the
    /// backend on what reached it (an asynchronous backend: starts it, and collects what has
    /// completed since the last turn), walks results up — sending below what layers send
    /// next — and calls `done` once for every request that completed. `clock` is the
    /// monotonic clock in ns, read only when there are layers (before the walk down and after
    /// the backend, so layers time the backend's work); `req` gives the request a tag stands
    /// for; tags in `new` must not be in flight already.
    pub fn run<'q>(
        &mut self,
        new: &[Tag],
        clock: &dyn Fn() -> u64,
        req: &dyn Fn(Tag) -> Request<'q>,
        done: &mut dyn FnMut(Tag, Result<u64, BlockError>),
    ) {
        let Chain { layers, backend, sent, held_up, turns, scratch } = self;
        let turns = std::mem::take(turns);
        let mut walk = Walk { layers, sent, held_up, scratch, first: 0, backend: backend.as_mut(), turns };
        walk.turn(new, clock, req, done);
        self.turns = walk.turns;
    }
}

/// Where a request goes next on its walk.
enum Step {
    /// Hand it to the layers from this one down.
    Down(usize),
    /// This layer gave this verdict on it.
    Verdict(usize, Verdict),
    /// Hand this result up through the layers above this one.
    Up(usize, Result<u64, BlockError>),
}

/// A run of layers over the backend, borrowed from a [`Chain`]: all of it for requests, or
/// the part below one layer while that layer opens. Layer `i` of the walk is layer
/// `first + i` of the chain.
struct Walk<'c> {
    layers: &'c mut [Box<dyn Layer>],
    sent: &'c mut [Vec<Option<Sub>>],
    held_up: &'c mut [bool],
    scratch: &'c Scratch,
    first: usize,
    backend: &'c mut dyn Backend,
    turns: Turns,
}

/// What a chain carries from one turn to the next: the requests layers hold, when they next
/// need a poll, and the turn's working lists, kept so that a turn does not allocate once they
/// have grown to the deepest turn seen.
#[derive(Default)]
struct Turns {
    /// Requests held by a layer now.
    held: usize,
    /// When some layer next needs a poll (monotonic ns).
    next_poll: Option<u64>,
    released: Vec<(usize, Tag, Verdict)>,
    to_backend: Vec<Tag>,
    /// What goes to a synchronous backend in this round, while layers queue the next.
    batch: Vec<Tag>,
    reaped: Vec<(Tag, Result<u64, BlockError>)>,
    /// The backend completes requests later (see [`Backend::async_io`]).
    asynchronous: bool,
}

/// Requests a working list has room for at first ([`Chain::attach`]), rather than one per tag:
/// lists this small lie side by side in a page or two, which the page gate of a guarded domain
/// shuts in one range (docs/guard.md), where lists for every tag would each begin a page of
/// their own. A deeper turn grows them once.
pub const LIST_ROOM: usize = 32;

impl Turns {
    fn new(asynchronous: bool) -> Self {
        Turns { asynchronous, ..Default::default() }
    }

    /// Layers need a poll by `ns` at the latest.
    fn poll_by(&mut self, ns: u64) {
        self.next_poll = Some(self.next_poll.map_or(ns, |n| n.min(ns)));
    }

    /// Room in the working lists for `capacity` requests.
    fn reserve(&mut self, capacity: usize) {
        self.released.reserve(capacity);
        self.to_backend.reserve(capacity);
        self.batch.reserve(capacity);
        self.reaped.reserve(capacity);
    }
}

impl<'c> Walk<'c> {
    fn new(
        layers: &'c mut [Box<dyn Layer>],
        sent: &'c mut [Vec<Option<Sub>>],
        held_up: &'c mut [bool],
        scratch: &'c Scratch,
        first: usize,
        backend: &'c mut dyn Backend,
    ) -> Self {
        let turns = Turns::new(backend.async_io().is_some());
        Walk { layers, sent, held_up, scratch, first, backend, turns }
    }

    fn turn<'q>(
        &mut self,
        new: &[Tag],
        clock: &dyn Fn() -> u64,
        req: &dyn Fn(Tag) -> Request<'q>,
        done: &mut dyn FnMut(Tag, Result<u64, BlockError>),
    ) {
        let timed = !self.layers.is_empty();
        let now_ns = if timed { clock() } else { 0 };
        if self.turns.held > 0 && self.turns.next_poll.is_some_and(|t| t <= now_ns) {
            let mut released = std::mem::take(&mut self.turns.released);
            self.poll_layers(now_ns, &mut released);
            for (at, tag, verdict) in released.drain(..) {
                self.turns.held -= 1;
                let up = self.held_up.get_mut(tag.index()).map(std::mem::take).unwrap_or(false);
                let verdict = match verdict {
                    // A layer may not hold twice what it releases, nor send down again what
                    // already completed: treat it as a bug of that layer, answered rather
                    // than lost.
                    Verdict::Hold => Verdict::Complete(Err(BlockError::Invalid("layer released a request to hold"))),
                    Verdict::Forward | Verdict::Send(_) if up => {
                        Verdict::Complete(Err(BlockError::Invalid("layer sent a completed request down again")))
                    }
                    v => v,
                };
                self.walk(tag, Step::Verdict(at, verdict), now_ns, req, done);
            }
            self.turns.released = released;
        }
        for &tag in new {
            self.walk(tag, Step::Down(0), now_ns, req, done);
        }
        let below = self.layers.len();
        let mut to_backend = std::mem::take(&mut self.turns.to_backend);
        if self.turns.asynchronous {
            let mut reaped = std::mem::take(&mut self.turns.reaped);
            loop {
                for &tag in &to_backend {
                    match self.request_at(below, tag, req) {
                        Ok(r) => {
                            if let Some(result) = self.engine().submit(tag, &r) {
                                reaped.push((tag, result));
                            }
                        }
                        Err(e) => reaped.push((tag, Err(e))),
                    }
                }
                if !to_backend.is_empty() {
                    self.engine().commit();
                    to_backend.clear();
                }
                let engine = self.engine();
                if engine.in_flight() > 0 {
                    engine.reap(&mut |tag, result| reaped.push((tag, result)));
                }
                let now_ns = if timed && !reaped.is_empty() { clock() } else { 0 };
                // What layers send next goes to the backend in this turn too.
                self.turns.to_backend = std::mem::take(&mut to_backend);
                for (tag, result) in reaped.drain(..) {
                    self.walk(tag, Step::Up(below, result), now_ns, req, done);
                }
                to_backend = std::mem::take(&mut self.turns.to_backend);
                if to_backend.is_empty() {
                    break;
                }
            }
            self.turns.reaped = reaped;
        } else {
            let mut batch = std::mem::take(&mut self.turns.batch);
            while !to_backend.is_empty() {
                std::mem::swap(&mut batch, &mut to_backend);
                self.turns.to_backend = std::mem::take(&mut to_backend);
                for chunk in batch.chunks(BACKEND_BATCH) {
                    // These arrays are large (an `Io` is some 200 bytes): they are filled and
                    // drained in place, never moved, since a move is a copy of the whole array
                    // on every turn, which a polled 4 KiB read would feel.
                    let mut results: ArrayVec<(Tag, Result<u64, BlockError>), BACKEND_BATCH> = ArrayVec::new();
                    let mut failed: ArrayVec<(Tag, BlockError), BACKEND_BATCH> = ArrayVec::new();
                    {
                        let mut ios: ArrayVec<Io<'_>, BACKEND_BATCH> = ArrayVec::new();
                        let mut tags: ArrayVec<Tag, BACKEND_BATCH> = ArrayVec::new();
                        for &t in chunk {
                            match self.request_at(below, t, req) {
                                Ok(r) => {
                                    ios.push(Io::new(r));
                                    tags.push(t);
                                }
                                Err(e) => failed.push((t, e)),
                            }
                        }
                        self.backend.execute(&mut ios);
                        for (&tag, io) in tags.iter().zip(ios.iter_mut()) {
                            results.push((tag, std::mem::replace(&mut io.result, Err(BlockError::NotDone))));
                        }
                    }
                    let now_ns = if timed { clock() } else { 0 };
                    for (tag, result) in results.drain(..) {
                        self.walk(tag, Step::Up(below, result), now_ns, req, done);
                    }
                    for (tag, e) in failed.drain(..) {
                        self.walk(tag, Step::Up(below, Err(e)), now_ns, req, done);
                    }
                }
                batch.clear();
                to_backend = std::mem::take(&mut self.turns.to_backend);
            }
            self.turns.batch = batch;
        }
        to_backend.clear();
        self.turns.to_backend = to_backend;
        if self.turns.held == 0 {
            self.turns.next_poll = None;
        }
    }

    /// The backend's asynchronous engine (the walk is asynchronous only if it has one).
    fn engine(&mut self) -> &mut dyn AsyncIo {
        self.backend.async_io().expect("an asynchronous walk's backend keeps its engine")
    }

    /// Requests the backend has started and not answered.
    fn at_backend(&mut self) -> usize {
        self.backend.async_io().map_or(0, |io| io.in_flight())
    }

    fn poll_layers(&mut self, now_ns: u64, released: &mut Vec<(usize, Tag, Verdict)>) {
        let mut next: Option<u64> = None;
        for (i, l) in self.layers.iter_mut().enumerate() {
            if let Some(t) = l.poll(now_ns, &mut |tag, v| released.push((i, tag, v))) {
                next = Some(next.map_or(t, |n| n.min(t)));
            }
        }
        self.turns.next_poll = next;
    }

    /// The request layer `level` is handed for `tag` (`level` = the number of layers: what
    /// the backend gets): the tag's request with what each layer above sent in its place.
    /// It borrows the scratch memory and the request, not the walk.
    fn request_at<'x, 'q: 'x>(&self, level: usize, tag: Tag, req: &dyn Fn(Tag) -> Request<'q>) -> Result<Request<'x>, BlockError>
    where
        'c: 'x,
    {
        let scratch: &'c Scratch = self.scratch;
        let mut r: Request<'x> = req(tag);
        for (i, sent) in self.sent[..level].iter().enumerate() {
            if let Some(sub) = sent[tag.index()] {
                r = resolve(&sub, &r, scratch.of(self.first + i, tag))?;
            }
        }
        Ok(r)
    }

    fn scratch_of(scratch: &'c Scratch, layer: usize, tag: Tag) -> SharedSlice<'c> {
        scratch.of(layer, tag)
    }

    /// Takes `tag` from `step` until it reaches the backend's queue, a layer holds it, or it
    /// completes (then `done` hears of it). A loop rather than calls within calls: a layer
    /// may send one sub-request after another, each answered at once below.
    fn walk<'q>(
        &mut self,
        tag: Tag,
        mut step: Step,
        now_ns: u64,
        req: &dyn Fn(Tag) -> Request<'q>,
        done: &mut dyn FnMut(Tag, Result<u64, BlockError>),
    ) {
        let t = tag.index();
        loop {
            step = match step {
                Step::Down(from) => {
                    let mut r = match self.request_at(from, tag, req) {
                        Ok(r) => r,
                        Err(e) => {
                            step = Step::Up(from, Err(e));
                            continue;
                        }
                    };
                    // Down through the layers that pass it on, carrying the request each hands
                    // the next rather than working it out again.
                    let mut at = from;
                    let next = loop {
                        if at == self.layers.len() {
                            self.turns.to_backend.push(tag);
                            return;
                        }
                        let scratch = Self::scratch_of(self.scratch, self.first + at, tag);
                        match self.layers[at].submit(tag, &r, scratch, now_ns) {
                            Verdict::Forward => self.sent[at][t] = None,
                            Verdict::Send(sub) => match resolve(&sub, &r, scratch) {
                                Ok(below) => {
                                    self.sent[at][t] = Some(sub);
                                    r = below;
                                }
                                Err(e) => {
                                    self.sent[at][t] = None;
                                    break Step::Up(at, Err(e));
                                }
                            },
                            verdict => break Step::Verdict(at, verdict),
                        }
                        at += 1;
                    };
                    next
                }
                Step::Verdict(at, verdict) => match verdict {
                    Verdict::Forward => {
                        self.sent[at][t] = None;
                        Step::Down(at + 1)
                    }
                    Verdict::Send(sub) => self.send(at, tag, sub, req),
                    Verdict::Complete(result) => Step::Up(at, result),
                    Verdict::Hold => {
                        self.turns.held += 1;
                        // The holder's next poll time is learnt at the next poll; until then
                        // ask for one at once.
                        self.turns.poll_by(now_ns);
                        return;
                    }
                },
                Step::Up(mut below, mut result) => {
                    if self.turns.held > 0 {
                        // A layer holding requests may be waiting for this one to finish.
                        self.turns.poll_by(now_ns);
                    }
                    let mut next = None;
                    // Most requests pass every layer as they came: then each layer was handed
                    // the same one.
                    let unchanged = self.sent[..below].iter().all(|s| s[t].is_none());
                    let handed = if unchanged { Some(req(tag)) } else { None };
                    while below > 0 {
                        below -= 1;
                        let r = match handed.map_or_else(|| self.request_at(below, tag, req), Ok) {
                            Ok(r) => r,
                            Err(e) => {
                                result = Err(e);
                                continue;
                            }
                        };
                        let scratch = Self::scratch_of(self.scratch, self.first + below, tag);
                        match self.layers[below].complete(tag, &r, scratch, &mut result, now_ns) {
                            After::Up => self.sent[below][t] = None,
                            After::Send(sub) => {
                                next = Some(self.send(below, tag, sub, req));
                                break;
                            }
                            After::Hold => {
                                self.sent[below][t] = None;
                                self.turns.held += 1;
                                if let Some(h) = self.held_up.get_mut(t) {
                                    *h = true;
                                }
                                self.turns.poll_by(now_ns);
                                return;
                            }
                        }
                    }
                    match next {
                        Some(step) => step,
                        None => {
                            done(tag, result);
                            return;
                        }
                    }
                }
            };
        }
    }

    /// Layer `at` sends `sub` below for `tag`. A sub-request outside the handed request's
    /// buffers or the layer's scratch answers the handed request with `Invalid` from that
    /// layer up; the layer is not asked again about it.
    fn send<'q>(&mut self, at: usize, tag: Tag, sub: Sub, req: &dyn Fn(Tag) -> Request<'q>) -> Step {
        let scratch: &'c Scratch = self.scratch;
        let checked = self.request_at(at, tag, req).and_then(|r| resolve(&sub, &r, scratch.of(self.first + at, tag)).map(|_| ()));
        match checked {
            Ok(()) => {
                self.sent[at][tag.index()] = Some(sub);
                Step::Down(at + 1)
            }
            Err(e) => {
                self.sent[at][tag.index()] = None;
                Step::Up(at, Err(e))
            }
        }
    }
}

/// A layer's reads below while it opens: each runs through the layers below it and the
/// backend as a request of tag 0 (no request is in flight yet) into private memory, until it
/// completes.
struct OpenRead<'c, 'k> {
    walk: Walk<'c>,
    size: u64,
    clock: &'k dyn Fn() -> u64,
    buf: Option<Mapping>,
}

impl ReadBelow for OpenRead<'_, '_> {
    fn size(&self) -> u64 {
        self.size
    }

    fn read(&mut self, offset: u64, buf: &mut [u8]) -> Result<(), BlockError> {
        let invalid = BlockError::Invalid("a read while opening runs past the end of the device below");
        let end = offset.checked_add(buf.len() as u64).ok_or(invalid.clone())?;
        if end > self.size {
            return Err(invalid);
        }
        if self.buf.is_none() {
            let m = Mapping::private(OPEN_CHUNK).map_err(|_| BlockError::Os { op: "read", offset, errno: ENOMEM })?;
            self.buf = Some(m);
        }
        let map = self.buf.take().expect("made above");
        let mut r = Ok(());
        let deadline = Instant::now() + OPEN_TIMEOUT;
        for (i, chunk) in buf.chunks_mut(OPEN_CHUNK).enumerate() {
            let at = offset + (i * OPEN_CHUNK) as u64;
            let window = map.slice(0, chunk.len()).expect("a chunk fits the buffer");
            r = self.read_one(at, window, deadline);
            if r.is_err() {
                if self.walk.at_backend() > 0 {
                    // The backend may still fill the buffer: never unmap it under it.
                    std::mem::forget(map);
                    return r;
                }
                break;
            }
            window.copy_to(chunk);
        }
        self.buf = Some(map);
        r
    }
}

impl OpenRead<'_, '_> {
    fn read_one(&mut self, offset: u64, window: SharedSlice<'_>, deadline: Instant) -> Result<(), BlockError> {
        let want = window.len() as u64;
        let req = move |_: Tag| Request::Read { offset, into: SliceList::one(window) };
        let tag = Tag::new(0);
        let mut result = None;
        let mut first = true;
        while result.is_none() {
            if !first {
                if Instant::now() > deadline {
                    return Err(BlockError::Invalid("the device below did not answer a read while opening"));
                }
                std::thread::sleep(Duration::from_micros(100));
            }
            let new: &[Tag] = if first { &[tag] } else { &[] };
            first = false;
            // Borrowing `req` for this turn only: the walk keeps nothing of it after.
            let walk: &mut Walk<'_> = &mut self.walk;
            walk.turn(new, self.clock, &req, &mut |_, r| result = Some(r));
        }
        match result.expect("loop ends with a result") {
            Ok(n) if n == want => Ok(()),
            Ok(n) => Err(BlockError::Short { op: "read", offset, done: n, want }),
            Err(e) => Err(e),
        }
    }
}

/// Out of memory (errno).
const ENOMEM: i32 = 12;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Op, Outcome};
    use std::collections::VecDeque;

    /// A test backend's capabilities: a write cache to flush, discard and write-zeroes.
    const CACHED: Caps = Caps { flush: true, fua: false, discard: true, write_zeroes: true, read_only: false };

    struct Counting(u64);
    impl Backend for Counting {
        fn size(&self) -> u64 {
            1 << 20
        }
        fn caps(&self) -> Caps {
            CACHED
        }
        fn execute(&mut self, ios: &mut [Io<'_>]) {
            for io in ios {
                self.0 += 1;
                io.result = Ok(io.req.transfer_len());
            }
        }
    }

    /// Refuses discard, halves the size, and records the order it saw things in.
    #[derive(Default)]
    struct HideDiscard {
        log: Vec<String>,
    }
    impl Layer for HideDiscard {
        fn name(&self) -> &'static str {
            "hide-discard"
        }
        fn caps(&self, lower: Caps) -> Caps {
            Caps { discard: false, ..lower }
        }
        fn size(&self, lower: u64) -> u64 {
            lower / 2
        }
        fn submit(&mut self, tag: Tag, req: &Request<'_>, _: SharedSlice<'_>, _: u64) -> Verdict {
            self.log.push(format!("down {}", tag.index()));
            match req {
                Request::Discard { .. } => Verdict::Complete(Err(BlockError::NotSupported("discard"))),
                Request::Read { .. } | Request::Write { .. } | Request::Flush | Request::WriteZeroes { .. } => Verdict::Forward,
            }
        }
        fn complete(&mut self, tag: Tag, _: &Request<'_>, _: SharedSlice<'_>, _: &mut Outcome, _: u64) -> After {
            self.log.push(format!("up {}", tag.index()));
            After::Up
        }
        fn poll(&mut self, _: u64, _: &mut dyn FnMut(Tag, Verdict)) -> Option<u64> {
            None
        }
    }

    /// Holds every request until `until`, then forwards them in order.
    struct HoldUntil {
        until: u64,
        q: VecDeque<Tag>,
        /// Added to every byte count on the way up.
        bump: u64,
    }
    impl Layer for HoldUntil {
        fn name(&self) -> &'static str {
            "hold"
        }
        fn submit(&mut self, tag: Tag, req: &Request<'_>, _: SharedSlice<'_>, _: u64) -> Verdict {
            match req.op() {
                Op::Read | Op::Write | Op::Flush | Op::Discard | Op::WriteZeroes => {
                    self.q.push_back(tag);
                    Verdict::Hold
                }
            }
        }
        fn complete(&mut self, _: Tag, _: &Request<'_>, _: SharedSlice<'_>, r: &mut Outcome, _: u64) -> After {
            if let Ok(n) = r {
                *n += self.bump;
            }
            After::Up
        }
        fn poll(&mut self, now: u64, release: &mut dyn FnMut(Tag, Verdict)) -> Option<u64> {
            if now < self.until {
                return (!self.q.is_empty()).then_some(self.until);
            }
            while let Some(t) = self.q.pop_front() {
                release(t, Verdict::Forward);
            }
            None
        }
    }

    fn flush(_: Tag) -> Request<'static> {
        Request::Flush
    }

    /// An asynchronous backend whose requests complete only when the test says so.
    #[derive(Clone, Default)]
    struct Later(std::sync::Arc<std::sync::Mutex<(Vec<Tag>, Vec<Tag>)>>);
    impl Later {
        fn finish(&self, tag: Tag) {
            let mut s = self.0.lock().unwrap();
            s.0.retain(|&t| t != tag);
            s.1.push(tag);
        }
    }
    impl Backend for Later {
        fn size(&self) -> u64 {
            1 << 20
        }
        fn caps(&self) -> Caps {
            CACHED
        }
        fn execute(&mut self, _: &mut [Io<'_>]) {
            unreachable!("an asynchronous backend is driven by submit and reap")
        }
        fn async_io(&mut self) -> Option<&mut dyn AsyncIo> {
            Some(self)
        }
    }
    impl AsyncIo for Later {
        fn attach(&mut self, _: TagSpace) {}
        fn commit(&mut self) {}
        fn submit(&mut self, tag: Tag, _: &Request<'_>) -> Option<Result<u64, BlockError>> {
            self.0.lock().unwrap().0.push(tag);
            None
        }
        fn reap(&mut self, done: &mut dyn FnMut(Tag, Result<u64, BlockError>)) {
            for t in std::mem::take(&mut self.0.lock().unwrap().1) {
                done(t, Ok(7));
            }
        }
        fn in_flight(&self) -> usize {
            let s = self.0.lock().unwrap();
            s.0.len() + s.1.len()
        }
    }

    /// What a [`Mem`] backend looks like to the test: its data, and each request it saw.
    type View = std::sync::Arc<std::sync::Mutex<(Vec<u8>, Vec<(Op, u64, u64)>)>>;

    /// Memory, answering at once or (asynchronous) on the next reap.
    struct Mem {
        data: Vec<u8>,
        later: Option<Vec<(Tag, Result<u64, BlockError>)>>,
        seen: Vec<(Op, u64, u64)>,
        /// What the test inspects: the data and what was seen, copied after each request.
        view: View,
    }
    impl Mem {
        fn new(len: usize, asynchronous: bool) -> Self {
            Mem { data: vec![0; len], later: asynchronous.then(Vec::new), seen: Vec::new(), view: Default::default() }
        }
        fn apply(&mut self, req: &Request<'_>) -> Result<u64, BlockError> {
            let r = self.apply_inner(req);
            *self.view.lock().unwrap() = (self.data.clone(), self.seen.clone());
            r
        }
        fn apply_inner(&mut self, req: &Request<'_>) -> Result<u64, BlockError> {
            let (offset, len) = req.range();
            self.seen.push((req.op(), offset, len));
            let (o, n) = (offset as usize, len as usize);
            if o + n > self.data.len() {
                return Err(BlockError::Invalid("past the end"));
            }
            match req {
                Request::Read { into: bufs, .. } => {
                    let mut at = o;
                    for b in bufs.iter() {
                        b.copy_from(&self.data[at..at + b.len()]).unwrap();
                        at += b.len();
                    }
                }
                Request::Write { from: bufs, .. } => {
                    let mut at = o;
                    for b in bufs.iter() {
                        b.copy_to(&mut self.data[at..at + b.len()]);
                        at += b.len();
                    }
                }
                Request::WriteZeroes { .. } | Request::Discard { .. } => self.data[o..o + n].fill(0),
                Request::Flush => {}
            }
            Ok(req.transfer_len())
        }
    }
    impl Backend for Mem {
        fn size(&self) -> u64 {
            self.data.len() as u64
        }
        fn caps(&self) -> Caps {
            CACHED
        }
        fn execute(&mut self, ios: &mut [Io<'_>]) {
            for io in ios {
                io.result = self.apply(&io.req);
            }
        }
        fn async_io(&mut self) -> Option<&mut dyn AsyncIo> {
            match self.later {
                Some(_) => Some(self),
                None => None,
            }
        }
    }
    impl AsyncIo for Mem {
        fn attach(&mut self, _: TagSpace) {}
        fn commit(&mut self) {}
        fn submit(&mut self, tag: Tag, req: &Request<'_>) -> Option<Result<u64, BlockError>> {
            let r = self.apply(req);
            self.later.as_mut().expect("asynchronous").push((tag, r));
            None
        }
        fn reap(&mut self, done: &mut dyn FnMut(Tag, Result<u64, BlockError>)) {
            for (t, r) in self.later.as_mut().expect("asynchronous").drain(..) {
                done(t, r);
            }
        }
        fn in_flight(&self) -> usize {
            self.later.as_ref().map_or(0, Vec::len)
        }
    }

    /// A model of an encrypting layer: a header on the device below (read at open) names a
    /// key byte and where the data starts; writes go below XORed with the key from scratch
    /// memory, `CHUNK` bytes at a time; reads are XORed back in place; write-zeroes is
    /// written as the key's zeroes, chunk by chunk.
    struct Xor {
        key: u8,
        start: u64,
        /// Bytes of the handed request sent so far, per tag.
        done: Vec<u64>,
    }
    const CHUNK: u64 = 4096;
    impl Xor {
        fn new() -> Self {
            Xor { key: 0, start: 0, done: Vec::new() }
        }
        /// The next chunk of a write or write-zeroes, from `done` bytes in.
        fn next(&self, req: &Request<'_>, scratch: SharedSlice<'_>, done: u64) -> Option<Sub> {
            let (offset, len) = req.range();
            if done >= len {
                return None;
            }
            let n = CHUNK.min(len - done);
            let mut buf = vec![0u8; n as usize];
            if let Request::Write { from: bufs, .. } = req {
                let mut at = 0usize;
                for part in bufs.range(done, n).unwrap().iter() {
                    part.copy_to(&mut buf[at..at + part.len()]);
                    at += part.len();
                }
            }
            buf.iter_mut().for_each(|b| *b ^= self.key);
            scratch.sub(0, n as usize).unwrap().copy_from(&buf).unwrap();
            let fua = matches!(req, Request::Write { fua: true, .. });
            Some(Sub::Write { offset: self.start + offset + done, from: Data::Scratch { at: 0, len: n }, fua })
        }
    }
    impl Layer for Xor {
        fn name(&self) -> &'static str {
            "xor"
        }
        fn size(&self, lower: u64) -> u64 {
            lower.saturating_sub(self.start)
        }
        fn scratch_bytes(&self) -> usize {
            CHUNK as usize
        }
        fn open(&mut self, below: &mut dyn ReadBelow) -> Result<(), SetupError> {
            let mut header = [0u8; 9];
            below.read(0, &mut header).map_err(|e| SetupError::new(e.to_string()))?;
            if &header[..4] != b"XOR!" {
                return Err(SetupError::new("no header"));
            }
            self.key = header[4];
            self.start = u32::from_le_bytes(header[5..9].try_into().unwrap()) as u64;
            Ok(())
        }
        fn attach(&mut self, tags: TagSpace) {
            self.done = vec![0; tags.capacity()];
        }
        fn submit(&mut self, tag: Tag, req: &Request<'_>, scratch: SharedSlice<'_>, _: u64) -> Verdict {
            self.done[tag.index()] = 0;
            match *req {
                Request::Read { offset, into: bufs } => {
                    Verdict::Send(Sub::Read { offset: self.start + offset, into: Data::Handed { at: 0, len: bufs.total_len() } })
                }
                Request::Write { .. } | Request::WriteZeroes { .. } => match self.next(req, scratch, 0) {
                    Some(sub) => Verdict::Send(sub),
                    None => Verdict::Complete(Ok(0)),
                },
                Request::Discard { offset, len } => Verdict::Send(Sub::Discard { offset: self.start + offset, len }),
                Request::Flush => Verdict::Forward,
            }
        }
        fn complete(&mut self, tag: Tag, req: &Request<'_>, scratch: SharedSlice<'_>, result: &mut Outcome, _: u64) -> After {
            match req {
                Request::Read { into: bufs, .. } => {
                    if result.is_ok() {
                        for b in bufs.iter() {
                            let mut v = vec![0; b.len()];
                            b.copy_to(&mut v);
                            v.iter_mut().for_each(|x| *x ^= self.key);
                            b.copy_from(&v).unwrap();
                        }
                    }
                    After::Up
                }
                Request::Write { .. } | Request::WriteZeroes { .. } => {
                    let Ok(n) = *result else { return After::Up };
                    let done = self.done[tag.index()] + n;
                    self.done[tag.index()] = done;
                    match self.next(req, scratch, done) {
                        Some(sub) => After::Send(sub),
                        None => {
                            *result = Ok(req.transfer_len());
                            After::Up
                        }
                    }
                }
                Request::Discard { .. } | Request::Flush => After::Up,
            }
        }
        fn poll(&mut self, _: u64, _: &mut dyn FnMut(Tag, Verdict)) -> Option<u64> {
            None
        }
    }

    /// Application memory: one shared file the test reads and writes as the frontend would.
    fn arena(len: usize) -> Mapping {
        let fd = bulkhead_shmem::memfd::create("arena", len as u64).unwrap();
        Mapping::new(std::os::fd::AsRawFd::as_raw_fd(&fd), len, bulkhead_shmem::Protection::ReadWrite).unwrap()
    }

    fn xor_chain(asynchronous: bool, with_hold: bool) -> (Chain, View) {
        let mut mem = Mem::new(1 << 20, asynchronous);
        mem.data[..4].copy_from_slice(b"XOR!");
        mem.data[4] = 0x5a;
        mem.data[5..9].copy_from_slice(&8192u32.to_le_bytes());
        let view = mem.view.clone();
        let mem = Box::new(mem);
        let mut layers: Vec<Box<dyn Layer>> = vec![Box::new(Xor::new())];
        if with_hold {
            // Below the xor layer: its reads while opening wait on this layer too.
            layers.push(Box::new(HoldUntil { until: 0, q: VecDeque::new(), bump: 0 }));
        }
        let mut chain = Chain::new(layers, mem);
        chain.attach(TagSpace { queues: 2, per_queue: 4 }).unwrap();
        chain.start(&|| 1).unwrap();
        (chain, view)
    }

    /// Runs turns until every one of `tags` has completed.
    fn drive<'q>(chain: &mut Chain, tags: &[Tag], req: &dyn Fn(Tag) -> Request<'q>) -> Vec<(usize, Result<u64, BlockError>)> {
        let mut out = Vec::new();
        chain.run(tags, &|| 1, req, &mut |t, r| out.push((t.index(), r)));
        for _ in 0..1000 {
            if out.len() == tags.len() {
                break;
            }
            chain.run(&[], &|| 1, req, &mut |t, r| out.push((t.index(), r)));
        }
        out.sort_by_key(|x| x.0);
        out
    }

    #[test]
    fn a_layer_sends_its_own_data_below_in_chunks_and_reads_back_through_its_header() {
        for (asynchronous, with_hold) in [(false, false), (true, false), (false, true), (true, true)] {
            let what = format!("asynchronous {asynchronous}, holding layer below {with_hold}");
            let (mut chain, mem) = xor_chain(asynchronous, with_hold);
            assert_eq!(chain.size(), (1 << 20) - 8192, "{what}");
            let app = arena(64 << 10);
            let plain: Vec<u8> = (0..20_000u32).map(|i| (i * 7 + 3) as u8).collect();
            // The data in three windows, as a frontend may send it.
            let w = [app.slice(0, 5000).unwrap(), app.slice(8192, 10_000).unwrap(), app.slice(20_480, 5000).unwrap()];
            let mut at = 0;
            for s in &w {
                s.copy_from(&plain[at..at + s.len()]).unwrap();
                at += s.len();
            }
            let mut wl = SliceList::new();
            w.iter().for_each(|s| wl.push(*s));
            let rd = app.slice(32 << 10, 20_000).unwrap();
            let req = |t: Tag| match t.index() {
                0 => Request::Write { offset: 1000, from: wl, fua: true },
                1 => Request::WriteZeroes { offset: 100_000, len: 9000 },
                4 => Request::Read { offset: 1000, into: SliceList::one(rd) },
                _ => Request::Flush,
            };
            let out = drive(&mut chain, &[Tag::new(0), Tag::new(1), Tag::new(2)], &req);
            assert_eq!(out, vec![(0, Ok(20_000)), (1, Ok(0)), (2, Ok(0))], "{what}");
            {
                let below = mem.lock().unwrap();
                let (data, seen) = &*below;
                let stored = &data[8192 + 1000..8192 + 21_000];
                assert!(stored.iter().zip(&plain).all(|(s, p)| *s == p ^ 0x5a), "{what}: stored as the layer sent it");
                assert!(data[8192 + 100_000..8192 + 109_000].iter().all(|&b| b == 0x5a), "{what}");
                let writes = seen.iter().filter(|s| s.0 == Op::Write).count();
                assert_eq!(writes, 5 + 3, "{what}: 20,000 bytes and 9,000 bytes in chunks of 4 KiB");
                assert!(seen.iter().all(|s| s.0 != Op::WriteZeroes), "{what}");
            }
            let out = drive(&mut chain, &[Tag::new(4)], &req);
            assert_eq!(out, vec![(4, Ok(20_000))], "{what}");
            let mut back = vec![0; 20_000];
            rd.copy_to(&mut back);
            assert!(back == plain, "{what}: read back through the layer");
        }
    }

    /// Sends data it has no room for.
    struct Overreach;
    impl Layer for Overreach {
        fn name(&self) -> &'static str {
            "overreach"
        }
        fn scratch_bytes(&self) -> usize {
            100
        }
        fn submit(&mut self, _: Tag, req: &Request<'_>, _: SharedSlice<'_>, _: u64) -> Verdict {
            match req {
                Request::Read { .. } => Verdict::Send(Sub::Read { offset: 0, into: Data::Handed { at: 1, len: 4096 } }),
                Request::Write { .. } => {
                    Verdict::Send(Sub::Write { offset: 0, from: Data::Scratch { at: 0, len: 8192 }, fua: false })
                }
                Request::Flush => Verdict::Send(Sub::Write { offset: 0, from: Data::Handed { at: 0, len: 1 }, fua: false }),
                Request::Discard { .. } | Request::WriteZeroes { .. } => Verdict::Forward,
            }
        }
        fn complete(&mut self, _: Tag, _: &Request<'_>, _: SharedSlice<'_>, _: &mut Outcome, _: u64) -> After {
            panic!("never called: nothing it sent was valid")
        }
        fn poll(&mut self, _: u64, _: &mut dyn FnMut(Tag, Verdict)) -> Option<u64> {
            None
        }
    }

    #[test]
    fn a_sub_request_outside_the_buffers_it_may_use_is_answered_invalid_and_reaches_nothing() {
        let mut chain = Chain::new(vec![Box::new(Overreach)], Box::new(Counting(0)));
        chain.attach(TagSpace { queues: 1, per_queue: 4 }).unwrap();
        let app = arena(8192);
        let w = app.slice(0, 4096).unwrap();
        let req = |t: Tag| match t.index() {
            0 => Request::Read { offset: 0, into: SliceList::one(w) },
            1 => Request::Write { offset: 0, from: SliceList::one(w), fua: false },
            _ => Request::Flush,
        };
        let out = drive(&mut chain, &[Tag::new(0), Tag::new(1), Tag::new(2)], &req);
        for (t, r) in out {
            assert!(matches!(r, Err(BlockError::Invalid(_))), "tag {t}: {r:?}");
        }
    }

    #[test]
    fn a_layer_that_cannot_open_stops_the_start_naming_itself() {
        let mut chain = Chain::new(vec![Box::new(Xor::new())], Box::new(Mem::new(1 << 16, false)));
        chain.attach(TagSpace { queues: 1, per_queue: 4 }).unwrap();
        let e = chain.start(&|| 0).unwrap_err();
        assert_eq!(e, StartError::Open { layer: "xor", message: SetupError::new("no header") });
        assert_eq!(e.to_string(), "filter xor: no header");
    }

    #[test]
    fn an_asynchronous_backend_answers_each_request_on_a_later_turn_through_the_layers() {
        let later = Later::default();
        let mut chain = Chain::new(vec![Box::new(HideDiscard::default())], Box::new(later.clone()));
        chain.attach(TagSpace { queues: 1, per_queue: 4 }).unwrap();
        let mut out = Vec::new();
        chain.run(&[Tag::new(0), Tag::new(1)], &|| 0, &flush, &mut |t, r| out.push((t.index(), r)));
        assert!(out.is_empty(), "nothing has completed yet");
        assert_eq!(chain.at_backend(), 2);
        later.finish(Tag::new(1));
        chain.run(&[], &|| 0, &flush, &mut |t, r| out.push((t.index(), r)));
        assert_eq!(out, vec![(1, Ok(7))], "the later one first, as it completed");
        later.finish(Tag::new(0));
        chain.run(&[Tag::new(2)], &|| 0, &flush, &mut |t, r| out.push((t.index(), r)));
        assert_eq!(out, vec![(1, Ok(7)), (0, Ok(7))]);
        assert_eq!(chain.at_backend(), 1, "the new one is still at the backend");
    }

    #[test]
    fn chain_folds_caps_and_size_through_layers() {
        let chain = Chain::new(vec![Box::new(HideDiscard::default()), Box::new(HideDiscard::default())], Box::new(Counting(0)));
        assert_eq!(chain.size(), 1 << 18);
        assert!(!chain.caps().discard);
        assert!(chain.caps().flush);
        assert_eq!(chain.layer_names(), vec!["hide-discard", "hide-discard"]);
    }

    #[test]
    fn answered_request_never_reaches_lower_layers_and_others_pass_both_ways() {
        let mut chain = Chain::new(vec![Box::new(HideDiscard::default())], Box::new(Counting(0)));
        chain.attach(TagSpace { queues: 1, per_queue: 4 }).unwrap();
        let req = |t: Tag| if t.index() == 1 { Request::Discard { offset: 0, len: 4096 } } else { Request::Flush };
        let mut out = Vec::new();
        chain.run(&[Tag::new(0), Tag::new(1)], &|| 0, &req, &mut |t, r| out.push((t.index(), r)));
        out.sort_by_key(|x| x.0);
        assert_eq!(out, vec![(0, Ok(0)), (1, Err(BlockError::NotSupported("discard")))]);
    }

    #[test]
    fn held_request_completes_on_a_later_turn_after_its_time() {
        let mut chain =
            Chain::new(vec![Box::new(HoldUntil { until: 500, q: VecDeque::new(), bump: 1000 })], Box::new(Counting(0)));
        chain.attach(TagSpace { queues: 1, per_queue: 4 }).unwrap();
        let mut out = Vec::new();
        chain.run(&[Tag::new(2), Tag::new(3)], &|| 100, &flush, &mut |t, r| out.push((t.index(), r)));
        assert!(out.is_empty());
        assert_eq!(chain.held(), 2);
        assert_eq!(chain.next_poll(), Some(100));
        chain.run(&[], &|| 200, &flush, &mut |t, r| out.push((t.index(), r)));
        assert!(out.is_empty(), "released before its time");
        assert_eq!(chain.next_poll(), Some(500));
        chain.run(&[], &|| 500, &flush, &mut |t, r| out.push((t.index(), r)));
        assert_eq!(out, vec![(2, Ok(1000)), (3, Ok(1000))]);
        assert_eq!(chain.held(), 0);
        assert_eq!(chain.next_poll(), None);
    }

    /// Holds every completion until `until`, then hands it up (or, if `misbehave`, sends it
    /// down again, which the chain must refuse). It counts the completions it saw.
    struct HoldUp {
        until: u64,
        q: VecDeque<(Tag, Result<u64, BlockError>)>,
        misbehave: bool,
    }
    impl Layer for HoldUp {
        fn name(&self) -> &'static str {
            "hold-up"
        }
        fn submit(&mut self, _: Tag, _: &Request<'_>, _: SharedSlice<'_>, _: u64) -> Verdict {
            Verdict::Forward
        }
        fn complete(&mut self, tag: Tag, _: &Request<'_>, _: SharedSlice<'_>, r: &mut Outcome, _: u64) -> After {
            self.q.push_back((tag, r.clone()));
            After::Hold
        }
        fn poll(&mut self, now: u64, release: &mut dyn FnMut(Tag, Verdict)) -> Option<u64> {
            if now < self.until {
                return (!self.q.is_empty()).then_some(self.until);
            }
            while let Some((t, r)) = self.q.pop_front() {
                release(t, if self.misbehave { Verdict::Forward } else { Verdict::Complete(r) });
            }
            None
        }
    }

    #[test]
    fn a_completion_held_below_passes_the_layers_above_once_released() {
        // The holder below a layer that adds 1000 on the way up: its completion comes back
        // through that layer, once, at its time, and the backend sees each request once.
        let mut chain = Chain::new(
            vec![
                Box::new(HoldUntil { until: 0, q: VecDeque::new(), bump: 1000 }),
                Box::new(HoldUp { until: 700, q: VecDeque::new(), misbehave: false }),
            ],
            Box::new(Counting(0)),
        );
        chain.attach(TagSpace { queues: 1, per_queue: 4 }).unwrap();
        let mut out = Vec::new();
        chain.run(&[Tag::new(1)], &|| 100, &flush, &mut |t, r| out.push((t.index(), r)));
        // The first layer lets it go; the holder's time is learnt at the poll after.
        chain.run(&[], &|| 200, &flush, &mut |t, r| out.push((t.index(), r)));
        chain.run(&[], &|| 300, &flush, &mut |t, r| out.push((t.index(), r)));
        assert!(out.is_empty(), "released before its time");
        assert_eq!(chain.held(), 1);
        assert_eq!(chain.next_poll(), Some(700));
        chain.run(&[], &|| 700, &flush, &mut |t, r| out.push((t.index(), r)));
        assert_eq!(out, vec![(1, Ok(1000))]);
        assert_eq!((chain.held(), chain.next_poll()), (0, None));
    }

    #[test]
    fn a_held_completion_sent_down_again_fails_as_the_layers_bug() {
        let mut chain =
            Chain::new(vec![Box::new(HoldUp { until: 0, q: VecDeque::new(), misbehave: true })], Box::new(Counting(0)));
        chain.attach(TagSpace { queues: 1, per_queue: 4 }).unwrap();
        let mut out = Vec::new();
        chain.run(&[Tag::new(0)], &|| 5, &flush, &mut |t, r| out.push((t.index(), r)));
        chain.run(&[], &|| 6, &flush, &mut |t, r| out.push((t.index(), r)));
        assert_eq!(out, vec![(0, Err(BlockError::Invalid("layer sent a completed request down again")))]);
        assert_eq!(chain.held(), 0);
    }
}
