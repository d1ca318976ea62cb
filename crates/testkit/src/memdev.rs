//! A device served in this process from memory: a frontend [`Device`] whose requests one
//! thread answers against a byte vector, with no domain behind it. For the fuzz targets and
//! tests of the exports (NBD, FUSE), which need a device to drive and nothing else.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use bulkhead_channel::{pair, BackQueue, NotifyMode, Op, Popped, QueueConfig, Status};
use bulkhead_client::{Device, DeviceControl};

/// Empty looks at the queues before the server naps between them.
const SPINS: u32 = 256;

/// A device whose requests a thread of this process serves from memory.
pub struct MemoryDevice {
    /// The frontend, as the exports take it.
    pub device: Arc<Device>,
    /// What it holds (locked by the serving thread while it moves bytes).
    pub bytes: Arc<Mutex<Vec<u8>>>,
    _control: DeviceControl,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl MemoryDevice {
    /// `size` bytes of zeroes named `name`, over `queues` queues of 16 slots and 1 MiB arenas.
    pub fn new(name: &str, size: u64, queues: usize) -> MemoryDevice {
        let cfg = QueueConfig { nslots: 16, arena_bytes: 1 << 20, mode: NotifyMode::Poll, generation: 1, ..Default::default() };
        let (fronts, backs): (Vec<_>, Vec<_>) =
            (0..queues.max(1)).map(|_| pair(&cfg, size).expect("an in-process queue pair")).unzip();
        let (device, control) = Device::new(name, size, fronts, None);
        let bytes = Arc::new(Mutex::new(vec![0u8; size as usize]));
        let stop = Arc::new(AtomicBool::new(false));
        let (b, s) = (bytes.clone(), stop.clone());
        let thread = std::thread::Builder::new()
            .name(format!("memdev-{name}"))
            .spawn(move || serve(backs, &b, &s))
            .expect("a thread to serve the device");
        MemoryDevice { device, bytes, _control: control, stop, thread: Some(thread) }
    }
}

impl Drop for MemoryDevice {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Answers every queue's requests until `stop`.
fn serve(mut backs: Vec<BackQueue>, bytes: &Mutex<Vec<u8>>, stop: &AtomicBool) {
    let mut idle = 0u32;
    while !stop.load(Ordering::Acquire) {
        let mut served = 0;
        for back in &mut backs {
            served += serve_pending(back, bytes);
        }
        if served > 0 {
            idle = 0;
        } else if idle < SPINS {
            idle += 1;
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(50));
        }
    }
}

/// Answers what `back` holds now; returns how many.
fn serve_pending(back: &mut BackQueue, bytes: &Mutex<Vec<u8>>) -> usize {
    let mut n = 0;
    let mut disk = bytes.lock().unwrap_or_else(|e| e.into_inner());
    loop {
        let r = match back.pop() {
            Ok(Some(Popped::Valid(r))) => r,
            Ok(Some(Popped::Invalid { id, generation, .. })) => {
                back.complete(id, generation, Status::Invalid, 0);
                n += 1;
                continue;
            }
            Ok(None) | Err(_) => break,
        };
        let (off, len) = (r.offset() as usize, r.len() as usize);
        match r.op() {
            Op::Read | Op::Write => {
                let mut at = off;
                for w in back.buffers(&r).iter() {
                    if r.op() == Op::Write {
                        w.copy_to(&mut disk[at..at + w.len()]);
                    } else if w.copy_from(&disk[at..at + w.len()]).is_err() {
                        break;
                    }
                    at += w.len();
                }
            }
            Op::Discard | Op::WriteZeroes => disk[off..off + len].fill(0),
            Op::Flush => {}
        }
        let moved = if matches!(r.op(), Op::Read | Op::Write) { r.len() } else { 0 };
        back.complete(r.id(), r.generation(), Status::Ok, moved);
        n += 1;
    }
    drop(disk);
    if n > 0 {
        back.publish();
    }
    n
}
