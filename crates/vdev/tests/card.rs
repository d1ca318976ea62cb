//! A card's model and its reference driver over a real trapped register page (a userfaultfd
//! across two threads), real DMA memory and a ram disk behind the card.

use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;

use bulkhead_backends::RamBackend;
use bulkhead_block::{Backend, BlockError, Io, Request, SliceList};
use bulkhead_doorbell::EventFd;
use bulkhead_shmem::{memfd, Mapping, Protection};
use bulkhead_testkit::pattern;
use bulkhead_vdev::card::{Card, CardCommand, BLOCK, PAGE};
use bulkhead_vdev::regs::RegisterPage;
use bulkhead_vdev::{trap, Driver, Model, ModelStats, Server, Trapped, Wait};

const MEDIA: u64 = 16 << 20;
const DMA: u64 = 4 << 20;

/// The card's side: its memory, and the model serving in a thread of its own.
struct Rig {
    card: Card,
    regs_fd: OwnedFd,
    dma_fd: OwnedFd,
    irq: EventFd,
    attach: mpsc::Sender<Trapped>,
    stop: Arc<AtomicBool>,
    model: Option<JoinHandle<Server>>,
}

impl Rig {
    fn new(seed: u64) -> Rig {
        let card = Card::generate(seed);
        let regs_fd = memfd::create("regs", u64::from(PAGE)).unwrap();
        let dma_fd = memfd::create("dma", DMA).unwrap();
        let media = RamBackend::new(memfd::create("media", MEDIA).unwrap(), MEDIA).unwrap();
        let irq = EventFd::new().unwrap();
        let irq_driver = irq.try_clone().unwrap();
        let regs = RegisterPage::new(Mapping::new(regs_fd.as_raw_fd(), PAGE as usize, Protection::ReadWrite).unwrap()).unwrap();
        let dma = Mapping::new(dma_fd.as_raw_fd(), DMA as usize, Protection::ReadWrite).unwrap();
        let mut server = Server::new(Model::new(card.clone(), regs, dma, Box::new(media), irq));
        let (attach, rx) = mpsc::channel::<Trapped>();
        let stop = Arc::new(AtomicBool::new(false));
        let quit = stop.clone();
        let model = std::thread::spawn(move || {
            while !quit.load(Ordering::Relaxed) {
                while let Ok(t) = rx.try_recv() {
                    server.attach(t);
                }
                match server.fd() {
                    Some(fd) => {
                        let mut p = [libc::pollfd { fd: fd.as_raw_fd(), events: libc::POLLIN, revents: 0 }];
                        let _ = bulkhead_sys::poll(&mut p, 5);
                    }
                    None => std::thread::sleep(std::time::Duration::from_millis(1)),
                }
                let _ = server.serve();
            }
            server
        });
        Rig { card, regs_fd, dma_fd, irq: irq_driver, attach, stop, model: Some(model) }
    }

    /// The driver's view: its own mapping of the registers, armed and handed to the model.
    fn driver_page(&self) -> RegisterPage {
        let page =
            RegisterPage::new(Mapping::new(self.regs_fd.as_raw_fd(), PAGE as usize, Protection::ReadWrite).unwrap()).unwrap();
        let t = trap::arm(&page).expect("userfaultfd write protection of shared memory");
        self.attach.send(Trapped::new(t, page.mapping().base_ptr() as u64)).unwrap();
        page
    }

    fn dma(&self) -> Mapping {
        Mapping::new(self.dma_fd.as_raw_fd(), DMA as usize, Protection::ReadWrite).unwrap()
    }

    fn driver(&self, wait: Wait) -> Driver {
        let irq = self.irq.try_clone().unwrap();
        let mut d = Driver::new(self.card.clone(), self.driver_page(), self.dma(), irq, wait).unwrap();
        d.init().unwrap();
        d
    }

    fn finish(mut self) -> (ModelStats, u64) {
        self.stop.store(true, Ordering::Relaxed);
        let server = self.model.take().unwrap().join().unwrap();
        (server.model().stats(), server.faults())
    }
}

impl Drop for Rig {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(m) = self.model.take() {
            let _ = m.join();
        }
    }
}

/// A buffer the tests fill and read, as the channel's arenas are.
fn buffer(len: usize) -> Mapping {
    let fd = memfd::create("buf", len as u64).unwrap();
    Mapping::new(fd.as_raw_fd(), len, Protection::ReadWrite).unwrap()
}

fn write(d: &mut Driver, offset: u64, data: &[u8]) -> Result<u64, BlockError> {
    let m = buffer(data.len());
    let s = m.slice(0, data.len()).unwrap();
    s.copy_from(data).unwrap();
    let mut io = [Io::new(Request::Write { offset, from: SliceList::one(s), fua: false })];
    d.execute(&mut io);
    io[0].result.clone()
}

fn read(d: &mut Driver, offset: u64, len: usize) -> Result<Vec<u8>, BlockError> {
    let m = buffer(len);
    // Two windows, as a request split over arena pages arrives.
    let half = len / 2 / BLOCK as usize * BLOCK as usize;
    let mut bufs = SliceList::one(m.slice(0, half.max(len.min(BLOCK as usize))).unwrap());
    if half > 0 {
        bufs.push(m.slice(half, len - half).unwrap());
    }
    let mut io = [Io::new(Request::Read { offset, into: bufs })];
    d.execute(&mut io);
    io[0].result.clone()?;
    let mut out = vec![0u8; len];
    m.slice(0, len).unwrap().copy_to(&mut out);
    Ok(out)
}

/// The proof: every generated card works with the reference driver. Fifty seeds,
/// half taking interrupts and half polling; writes of one block to a megabyte (more than one
/// command each), reads back through split buffers, write-zeroes, discard and flush.
#[test]
fn fifty_generated_cards_store_and_return_data_through_the_reference_driver() {
    for seed in 0..50 {
        let rig = Rig::new(seed);
        let wait = if seed % 2 == 0 { Wait::Interrupt } else { Wait::Poll };
        let mut d = rig.driver(wait);
        assert_eq!(d.size(), MEDIA);
        let cases = [(0u64, 512usize), (4096, 64 << 10), (3 << 20, 1 << 20), (MEDIA - 8192, 8192), (777 * 512, 130 * 1024)];
        for (i, &(off, len)) in cases.iter().enumerate() {
            let data = pattern(seed * 100 + i as u64, len);
            assert_eq!(write(&mut d, off, &data), Ok(len as u64), "seed {seed} write {off}+{len}");
            assert_eq!(read(&mut d, off, len).unwrap(), data, "seed {seed} read {off}+{len}");
        }
        // Several requests in one batch, a flush among them.
        let a = buffer(8192);
        a.slice(0, 8192).unwrap().copy_from(&pattern(seed, 8192)).unwrap();
        let mut ios = [
            Io::new(Request::Write { offset: 8 << 20, from: SliceList::one(a.slice(0, 4096).unwrap()), fua: false }),
            Io::new(Request::Write { offset: 9 << 20, from: SliceList::one(a.slice(4096, 4096).unwrap()), fua: false }),
            Io::new(Request::Flush),
            Io::new(Request::WriteZeroes { offset: 3 << 20, len: 4096 }),
            Io::new(Request::Discard { offset: 4096, len: 8192 }),
        ];
        d.execute(&mut ios);
        for io in &ios {
            assert!(io.result.is_ok(), "seed {seed}: {:?}", io.result);
        }
        assert_eq!(read(&mut d, 8 << 20, 4096).unwrap(), pattern(seed, 8192)[..4096]);
        assert_eq!(read(&mut d, 9 << 20, 4096).unwrap(), pattern(seed, 8192)[4096..]);
        assert!(read(&mut d, 3 << 20, 4096).unwrap().iter().all(|&b| b == 0));
        assert!(read(&mut d, 4096, 8192).unwrap().iter().all(|&b| b == 0));
        // Past the end, refused by the driver before the card sees it.
        assert!(matches!(read(&mut d, MEDIA, 512), Err(BlockError::Invalid(_))));
        drop(d);
        let (stats, faults) = rig.finish();
        assert_eq!(stats.refused, 0, "seed {seed}: {stats:?}");
        assert!(stats.commands >= 20, "seed {seed}: {stats:?}");
        assert!(faults >= 5, "seed {seed}: the register writes were trapped ({faults})");
        if wait == Wait::Interrupt {
            assert!(stats.interrupts > 0, "seed {seed}: {stats:?}");
        }
    }
}

/// Register writes a driver makes by hand, as a hostile or buggy driver would.
struct Raw {
    card: Card,
    page: RegisterPage,
    dma: Mapping,
}

impl Raw {
    fn w(&self, name: &str, v: u64) {
        self.page.write(self.reg(name), v);
    }
    fn r(&self, name: &str) -> u64 {
        self.page.read(self.reg(name))
    }
    fn reg(&self, name: &str) -> bulkhead_vdev::card::Reg {
        self.card.registers.all().iter().find(|(n, _)| *n == name).unwrap().1
    }
    /// Waits (bounded) until `f` holds of the registers.
    fn until(&self, what: &str, f: impl Fn(&Raw) -> bool) {
        let t0 = std::time::Instant::now();
        while !f(self) {
            assert!(t0.elapsed().as_secs() < 10, "timed out waiting for {what}");
            std::thread::sleep(std::time::Duration::from_micros(100));
        }
    }
    fn status(&self, bit: u8) -> bool {
        self.r("STATUS") >> bit & 1 == 1
    }
    fn reset(&self) {
        self.w("CONTROL", 1 << self.card.control.reset);
        self.until("reset", |r| r.r("CONTROL") == 0);
    }
    fn enable(&self, base: u64, entries: u64) {
        self.w("QUEUE_BASE", base);
        self.w("QUEUE_ENTRIES", entries);
        self.w("CONTROL", 1 << self.card.control.enable);
        let s = self.card.status;
        self.until("ready or error", |r| r.status(s.ready) || r.status(s.error));
    }
    /// Posts one descriptor at ring entry `n` of an 8-entry ring at DMA offset 0.
    fn post(&self, n: u64, opcode: u8, lba: u64, blocks: u64, address: u64) {
        let d = &self.card.descriptor;
        let mut desc = vec![0u8; d.size as usize];
        d.encode(&CardCommand { opcode, lba, blocks, address, status: 0x77, ..CardCommand::default() }, &mut desc);
        self.dma.write_from(((n % 8) * u64::from(d.size)) as usize, &desc).unwrap();
    }
    fn status_of(&self, n: u64) -> u16 {
        let d = &self.card.descriptor;
        let mut desc = vec![0u8; d.size as usize];
        self.dma.read_into(((n % 8) * u64::from(d.size)) as usize, &mut desc).unwrap();
        d.status.get(&desc) as u16
    }
}

#[test]
fn a_hostile_driver_gets_error_statuses_and_the_model_keeps_serving() {
    let rig = Rig::new(11);
    let card = rig.card.clone();
    let raw = Raw { card: card.clone(), page: rig.driver_page(), dma: rig.dma() };
    let (s, k, o) = (card.status, card.codes, card.opcodes);

    // A ring of 3 entries: not a power of two.
    raw.reset();
    raw.enable(card.dma_base, 3);
    assert!(raw.status(s.error));
    assert_eq!(raw.r("ERROR"), u64::from(card.errors.bad_queue));
    // A ring outside DMA memory.
    raw.reset();
    raw.enable(card.dma_base + DMA, 8);
    assert_eq!(raw.r("ERROR"), u64::from(card.errors.bad_queue));
    raw.reset();
    raw.enable(card.dma_base - 4096, 8);
    assert_eq!(raw.r("ERROR"), u64::from(card.errors.bad_queue));

    // A good ring; then one bad descriptor of each kind, and the card stays ready.
    raw.reset();
    raw.enable(card.dma_base, 8);
    assert!(raw.status(s.ready), "ready on a good ring");
    let data = card.dma_base + 64 * 1024;
    let unknown = (0..=255u8).find(|op| ![o.read, o.write, o.flush, o.discard, o.write_zeroes].contains(op)).unwrap();
    let bad = [
        (unknown, 0u64, 1u64, data),                       // no such command
        (o.read, MEDIA / 512, 1, data),                    // past the end
        (o.read, (MEDIA / 512) - 1, 2, data),              // straddles the end
        (o.write, 0, 1, card.dma_base + DMA),              // data outside DMA memory
        (o.write, 0, 1, card.dma_base - 512),              // below it
        (o.read, 0, 8, card.dma_base + DMA - 2048),        // runs out of it
        (o.read, 0, 0, data),                              // no blocks
        (o.read, 0, u64::from(card.max_blocks) + 1, data), // too many
    ];
    let want =
        [k.bad_opcode, k.out_of_range, k.out_of_range, k.bad_address, k.bad_address, k.bad_address, k.bad_length, k.bad_length];
    for (n, (&(op, lba, blocks, addr), want)) in bad.iter().zip(want).enumerate() {
        let n = n as u64;
        raw.post(n, op, lba, blocks, addr);
        raw.w("SUBMIT_TAIL", n + 1);
        raw.until("completion", |r| r.r("COMPLETE_COUNT") == n + 1);
        assert_eq!(raw.status_of(n), want, "descriptor {n}");
        assert!(raw.status(s.ready), "still ready after descriptor {n}");
    }

    // Read-only registers are put back.
    raw.w("CAPACITY", 1);
    raw.w("ID", 0);
    raw.w("COMPLETE_COUNT", 1000);
    raw.until("restored", |r| r.r("CAPACITY") == MEDIA / 512 && r.r("ID") == card.id() && r.r("COMPLETE_COUNT") == 8);

    // A storm of doorbell writes that post nothing new, then a tail a whole ring ahead.
    for _ in 0..200 {
        raw.w("SUBMIT_TAIL", 8);
        raw.w("IRQ_ACK", 8);
    }
    assert!(raw.status(s.ready));
    raw.w("SUBMIT_TAIL", 8 + 9);
    raw.until("bad tail", |r| r.status(s.error));
    assert_eq!(raw.r("ERROR"), u64::from(card.errors.bad_tail));

    // A reserved CONTROL bit.
    raw.reset();
    raw.enable(card.dma_base, 8);
    let c = card.control;
    let reserved = (0..32).find(|b| ![c.enable, c.reset, c.irq_enable].contains(b)).unwrap();
    raw.w("CONTROL", 1 << c.enable | 1 << reserved);
    raw.until("reserved bits", |r| r.status(s.error));
    assert_eq!(raw.r("ERROR"), u64::from(card.errors.reserved_bits));

    // The hostile driver goes; a good one takes the card over and it works.
    drop(raw);
    let mut d = rig.driver(Wait::Interrupt);
    let data = pattern(5, 64 << 10);
    write(&mut d, 1 << 20, &data).unwrap();
    assert_eq!(read(&mut d, 1 << 20, 64 << 10).unwrap(), data);
    drop(d);
    let (stats, _) = rig.finish();
    assert!(stats.stops >= 5, "{stats:?}");
    assert!(stats.ignored_writes >= 3, "{stats:?}");
}

/// A driver that is replaced (a restart) finds the card's storage as it was left, resets the
/// card and carries on.
#[test]
fn a_new_driver_takes_over_the_card_and_finds_the_data() {
    let rig = Rig::new(3);
    let data = pattern(9, 256 << 10);
    {
        let mut d = rig.driver(Wait::Poll);
        write(&mut d, 5 << 20, &data).unwrap();
        // Left mid-way: a doorbell rung with nothing behind it that the next driver resets.
        let raw = rig.driver_page();
        raw.write(rig.card.registers.submit_tail, 3);
    }
    let mut d = rig.driver(Wait::Interrupt);
    assert_eq!(read(&mut d, 5 << 20, 256 << 10).unwrap(), data);
    drop(d);
    let (stats, _) = rig.finish();
    assert!(stats.resets >= 2, "{stats:?}");
}

/// A storm of random writes anywhere in the register page, from a driver that also armed a
/// second trap of its own over another mapping: the model looks at all of it, puts the
/// read-only registers back, and the next driver finds the card it expects.
#[test]
fn a_storm_of_random_register_writes_leaves_the_card_usable() {
    let rig = Rig::new(11);
    let card = rig.card.clone();
    let page = rig.driver_page();
    {
        let other =
            RegisterPage::new(Mapping::new(rig.regs_fd.as_raw_fd(), PAGE as usize, Protection::ReadWrite).unwrap()).unwrap();
        let decoy = trap::arm(&other).unwrap();
        drop((decoy, other));
    }
    let all = card.registers.all();
    let mut rng = bulkhead_rng::Rng::new(0x1234_5678_9abc_def1);
    for _ in 0..5000 {
        let y = rng.next_u64();
        let reg = if y & 1 == 0 {
            all[(y >> 1) as usize % all.len()].1
        } else {
            bulkhead_vdev::card::Reg { offset: ((y >> 8) as u32 % PAGE) & !3, width: 4 }
        };
        page.write(reg, y.rotate_left(17));
    }
    // The storm's driver goes (its page unmapped); the next one takes over.
    drop(page);
    let mut d = rig.driver(Wait::Poll);
    let data = pattern(21, 128 << 10);
    write(&mut d, 4 << 20, &data).unwrap();
    assert_eq!(read(&mut d, 4 << 20, 128 << 10).unwrap(), data);
    drop(d);
    let (stats, faults) = rig.finish();
    assert!(stats.resets >= 2 && faults > 0, "{stats:?}");
}

/// A driver takes a clear reset bit to mean the card is back at its reset values and reads
/// ID next. While the model resets over and over, an observer on another thread never sees
/// the bit clear with anything but the card's ID and capacity beside it.
#[test]
fn a_reset_is_finished_before_its_bit_clears() {
    let card = Card::generate(16);
    let regs_fd = memfd::create("regs", u64::from(PAGE)).unwrap();
    let dma_fd = memfd::create("dma", DMA).unwrap();
    let media = RamBackend::new(memfd::create("media", MEDIA).unwrap(), MEDIA).unwrap();
    let map = || Mapping::new(regs_fd.as_raw_fd(), PAGE as usize, Protection::ReadWrite).unwrap();
    let dma = Mapping::new(dma_fd.as_raw_fd(), DMA as usize, Protection::ReadWrite).unwrap();
    let mut model = Model::new(card.clone(), RegisterPage::new(map()).unwrap(), dma, Box::new(media), EventFd::new().unwrap());
    let driver = RegisterPage::new(map()).unwrap();
    let observer = RegisterPage::new(map()).unwrap();
    let (r, reset) = (card.registers.clone(), 1u64 << card.control.reset);
    let done = Arc::new(AtomicBool::new(false));
    let watch = {
        let (done, r, id, capacity) = (done.clone(), r.clone(), card.id(), MEDIA / u64::from(BLOCK));
        std::thread::spawn(move || {
            let (mut looks, mut wrong) = (0u64, Vec::new());
            while !done.load(Ordering::Acquire) {
                if observer.read(r.control) & reset == 0 {
                    looks += 1;
                    let seen = (observer.read(r.id), observer.read(r.capacity));
                    if seen != (id, capacity) && wrong.len() < 8 {
                        wrong.push(seen);
                    }
                }
            }
            (looks, wrong)
        })
    };
    for _ in 0..200_000 {
        driver.write(r.control, reset);
        model.step();
        assert_eq!(driver.read(r.control) & reset, 0);
    }
    done.store(true, Ordering::Release);
    let (looks, wrong) = watch.join().unwrap();
    assert!(looks > 0, "the observer never saw the reset bit clear");
    assert!(wrong.is_empty(), "read with the reset bit clear (ID, CAPACITY): {wrong:x?}");
    assert_eq!(model.stats().resets, 200_000);
}
