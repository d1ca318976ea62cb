//! A chain of layers over a backend, driven by tag.

use arrayvec::ArrayVec;

use crate::{Backend, BlockError, Caps, Io, Layer, Request, Tag, TagSpace, Verdict};

/// Requests handed to the backend in one call at most.
const BACKEND_BATCH: usize = 64;

/// Layers over a backend. The domain's runtime hands it new requests by tag
/// ([`run`](Self::run)); the chain walks each down through the layers' verdicts, gives the
/// backend in batches what reaches it, walks the results back up, and reports every request
/// that completes, including those layers held and released later.
pub struct Chain {
    layers: Vec<Box<dyn Layer>>,
    backend: Box<dyn Backend>,
    /// Requests held by a layer now.
    held: usize,
    /// When some layer next needs a poll (monotonic ns).
    next_poll: Option<u64>,
    /// Scratch of `run`, kept to avoid allocating per turn.
    released: Vec<(usize, Tag, Verdict)>,
    to_backend: Vec<Tag>,
    reaped: Vec<(Tag, Result<u64, BlockError>)>,
    /// The backend completes requests later (see [`Backend::asynchronous`]).
    asynchronous: bool,
}

impl std::fmt::Debug for Chain {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Chain").field("layers", &self.layer_names()).field("held", &self.held).finish()
    }
}

impl Chain {
    /// `layers[0]` is nearest the frontend.
    pub fn new(layers: Vec<Box<dyn Layer>>, backend: Box<dyn Backend>) -> Self {
        let asynchronous = backend.asynchronous();
        Chain {
            layers,
            backend,
            held: 0,
            next_poll: None,
            released: Vec::new(),
            to_backend: Vec::new(),
            reaped: Vec::new(),
            asynchronous,
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

    /// Tells every layer how many tags there can be; call once before [`run`](Self::run).
    pub fn attach(&mut self, tags: TagSpace) {
        let capacity = tags.capacity();
        for l in &mut self.layers {
            l.attach(tags);
        }
        self.backend.attach(tags);
        self.released.reserve(capacity);
        self.to_backend.reserve(capacity);
        self.reaped.reserve(capacity);
    }

    /// Device size seen from the top.
    pub fn size(&self) -> u64 {
        self.layers.iter().rev().fold(self.backend.size(), |s, l| l.size(s))
    }

    /// Capabilities seen from the top.
    pub fn caps(&self) -> Caps {
        self.layers.iter().rev().fold(self.backend.caps(), |c, l| l.caps(c))
    }

    /// Requests some layer holds now.
    pub fn held(&self) -> usize {
        self.held
    }

    /// Requests an asynchronous backend has started and not yet answered: the chain needs a
    /// [`run`](Self::run) to collect them even if no request arrives (the backend's
    /// [`wake_fd`](Self::backend_wake_fd) rings when one completes).
    pub fn at_backend(&self) -> usize {
        self.backend.in_flight()
    }

    /// When the chain next needs a [`run`](Self::run) even if no request arrives (a held
    /// request's time), monotonic ns.
    pub fn next_poll(&self) -> Option<u64> {
        self.next_poll
    }

    /// Starts the backend (see [`Backend::start`]).
    pub fn start(&mut self) -> Result<(), String> {
        self.backend.start()
    }

    /// The backend lost what it depends on (see [`Backend::lost`]).
    pub fn lost(&self) -> Option<&str> {
        self.backend.lost()
    }

    /// The backend's doorbell for work of its own (see [`Backend::wake_fd`]).
    pub fn backend_wake_fd(&self) -> Option<std::os::fd::RawFd> {
        self.backend.wake_fd()
    }

    /// Lets the backend do work of its own (see [`Backend::tend`]).
    pub fn tend(&mut self) {
        self.backend.tend();
    }

    /// Lets layers write out what they buffer (see [`Layer::idle`]).
    pub fn idle(&mut self) {
        for l in &mut self.layers {
            l.idle();
        }
    }

    /// One turn: releases what layers let go of by now, walks each of `new` down, runs the
    /// backend on what reached it (an asynchronous backend: starts it, and collects what has
    /// completed since the last turn), walks results up, and calls `done` once for every
    /// request that completed. `clock` is the monotonic clock in ns, read only when there are layers
    /// (before the walk down and after the backend, so layers time the backend's work);
    /// `req` gives the request a tag stands for; tags in `new` must not be in flight already.
    pub fn run<'q>(
        &mut self,
        new: &[Tag],
        clock: &dyn Fn() -> u64,
        req: &dyn Fn(Tag) -> Request<'q>,
        done: &mut dyn FnMut(Tag, Result<u64, BlockError>),
    ) {
        let timed = !self.layers.is_empty();
        let now_ns = if timed { clock() } else { 0 };
        let mut released = std::mem::take(&mut self.released);
        let mut to_backend = std::mem::take(&mut self.to_backend);
        if self.held > 0 && self.next_poll.is_some_and(|t| t <= now_ns) {
            self.poll_layers(now_ns, &mut released);
            for (at, tag, verdict) in released.drain(..) {
                self.held -= 1;
                match verdict {
                    Verdict::Forward => self.descend(tag, at + 1, now_ns, req, done, &mut to_backend),
                    Verdict::Complete(r) => self.ascend(tag, at, r, now_ns, req, done),
                    Verdict::Hold => {
                        // A layer may not hold twice what it releases: treat it as a bug of
                        // that layer, answered rather than lost.
                        self.ascend(tag, at, Err(BlockError::Invalid("layer released a request to hold")), now_ns, req, done)
                    }
                }
            }
        }
        for &tag in new {
            self.descend(tag, 0, now_ns, req, done, &mut to_backend);
        }
        let below = self.layers.len();
        if self.asynchronous {
            let mut reaped = std::mem::take(&mut self.reaped);
            for &tag in &to_backend {
                if let Some(result) = self.backend.submit(tag, &req(tag)) {
                    reaped.push((tag, result));
                }
            }
            if !to_backend.is_empty() {
                self.backend.commit();
            }
            if self.backend.in_flight() > 0 {
                self.backend.reap(&mut |tag, result| reaped.push((tag, result)));
            }
            let now_ns = if timed && !reaped.is_empty() { clock() } else { 0 };
            for (tag, result) in reaped.drain(..) {
                self.ascend(tag, below, result, now_ns, req, done);
            }
            self.reaped = reaped;
        } else {
            for chunk in to_backend.chunks(BACKEND_BATCH) {
                let mut ios: ArrayVec<Io<'q>, BACKEND_BATCH> = chunk.iter().map(|&t| Io::new(req(t))).collect();
                self.backend.execute(&mut ios);
                let now_ns = if timed { clock() } else { 0 };
                for (&tag, io) in chunk.iter().zip(ios) {
                    self.ascend(tag, below, io.result, now_ns, req, done);
                }
            }
        }
        to_backend.clear();
        self.released = released;
        self.to_backend = to_backend;
        if self.held == 0 {
            self.next_poll = None;
        }
    }

    fn poll_layers(&mut self, now_ns: u64, released: &mut Vec<(usize, Tag, Verdict)>) {
        let mut next: Option<u64> = None;
        for (i, l) in self.layers.iter_mut().enumerate() {
            if let Some(t) = l.poll(now_ns, &mut |tag, v| released.push((i, tag, v))) {
                next = Some(next.map_or(t, |n| n.min(t)));
            }
        }
        self.next_poll = next;
    }

    /// Hands `tag` to layers `from..`, down to the backend queue unless a layer answers or
    /// holds it.
    fn descend<'q>(
        &mut self,
        tag: Tag,
        from: usize,
        now_ns: u64,
        req: &dyn Fn(Tag) -> Request<'q>,
        done: &mut dyn FnMut(Tag, Result<u64, BlockError>),
        to_backend: &mut Vec<Tag>,
    ) {
        let r = req(tag);
        for at in from..self.layers.len() {
            match self.layers[at].submit(tag, &r, now_ns) {
                Verdict::Forward => {}
                Verdict::Complete(result) => return self.ascend(tag, at, result, now_ns, req, done),
                Verdict::Hold => {
                    self.held += 1;
                    // The holder's next poll time is learnt at the next poll; until then ask
                    // for one at once.
                    self.next_poll = Some(self.next_poll.map_or(now_ns, |n| n.min(now_ns)));
                    return;
                }
            }
        }
        to_backend.push(tag);
    }

    /// Hands the result of `tag` up through layers `..below`, then to `done`.
    fn ascend<'q>(
        &mut self,
        tag: Tag,
        below: usize,
        mut result: Result<u64, BlockError>,
        now_ns: u64,
        req: &dyn Fn(Tag) -> Request<'q>,
        done: &mut dyn FnMut(Tag, Result<u64, BlockError>),
    ) {
        if below > 0 {
            let r = req(tag);
            for l in self.layers[..below].iter_mut().rev() {
                l.complete(tag, &r, &mut result, now_ns);
            }
        }
        done(tag, result);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::VecDeque;

    struct Counting(u64);
    impl Backend for Counting {
        fn size(&self) -> u64 {
            1 << 20
        }
        fn caps(&self) -> Caps {
            Caps { flush: true, fua: false, discard: true, write_zeroes: true, read_only: false }
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
        fn attach(&mut self, _: TagSpace) {}
        fn submit(&mut self, tag: Tag, req: &Request<'_>, _: u64) -> Verdict {
            self.log.push(format!("down {}", tag.index()));
            match req {
                Request::Discard { .. } => Verdict::Complete(Err(BlockError::NotSupported("discard"))),
                Request::Read { .. } | Request::Write { .. } | Request::Flush | Request::WriteZeroes { .. } => Verdict::Forward,
            }
        }
        fn complete(&mut self, tag: Tag, _: &Request<'_>, _: &mut Result<u64, BlockError>, _: u64) {
            self.log.push(format!("up {}", tag.index()));
        }
        fn poll(&mut self, _: u64, _: &mut dyn FnMut(Tag, Verdict)) -> Option<u64> {
            None
        }
    }

    /// Holds every request until `until`, then forwards them in order.
    struct HoldUntil {
        until: u64,
        q: VecDeque<Tag>,
    }
    impl Layer for HoldUntil {
        fn name(&self) -> &'static str {
            "hold"
        }
        fn caps(&self, lower: Caps) -> Caps {
            lower
        }
        fn size(&self, lower: u64) -> u64 {
            lower
        }
        fn attach(&mut self, _: TagSpace) {}
        fn submit(&mut self, tag: Tag, req: &Request<'_>, _: u64) -> Verdict {
            match req {
                Request::Read { .. }
                | Request::Write { .. }
                | Request::Flush
                | Request::Discard { .. }
                | Request::WriteZeroes { .. } => {
                    self.q.push_back(tag);
                    Verdict::Hold
                }
            }
        }
        fn complete(&mut self, _: Tag, _: &Request<'_>, r: &mut Result<u64, BlockError>, _: u64) {
            if let Ok(n) = r {
                *n += 1000;
            }
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
            Caps { flush: true, fua: false, discard: true, write_zeroes: true, read_only: false }
        }
        fn execute(&mut self, _: &mut [Io<'_>]) {
            unreachable!("an asynchronous backend is driven by submit and reap")
        }
        fn asynchronous(&self) -> bool {
            true
        }
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

    #[test]
    fn an_asynchronous_backend_answers_each_request_on_a_later_turn_through_the_layers() {
        let later = Later::default();
        let mut chain = Chain::new(vec![Box::new(HideDiscard::default())], Box::new(later.clone()));
        chain.attach(TagSpace { queues: 1, per_queue: 4 });
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
        chain.attach(TagSpace { queues: 1, per_queue: 4 });
        let req = |t: Tag| if t.index() == 1 { Request::Discard { offset: 0, len: 4096 } } else { Request::Flush };
        let mut out = Vec::new();
        chain.run(&[Tag::new(0), Tag::new(1)], &|| 0, &req, &mut |t, r| out.push((t.index(), r)));
        out.sort_by_key(|x| x.0);
        assert_eq!(out, vec![(0, Ok(0)), (1, Err(BlockError::NotSupported("discard")))]);
    }

    #[test]
    fn held_request_completes_on_a_later_turn_after_its_time() {
        let mut chain = Chain::new(vec![Box::new(HoldUntil { until: 500, q: VecDeque::new() })], Box::new(Counting(0)));
        chain.attach(TagSpace { queues: 1, per_queue: 4 });
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
}
