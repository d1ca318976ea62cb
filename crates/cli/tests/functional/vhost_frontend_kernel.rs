//! The vhost-user-blk export driven by a frontend of the test's own (`bulkhead_vhost_export::
//! frontend`): requests round trip, and a hostile frontend that writes crafted descriptors
//! gets errors for its requests or a stopped queue, never a crash of `serve` or a change to
//! another device.

#[path = "../common/mod.rs"]
mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use bulkhead_testkit::require_kernel;
use bulkhead_vhost_export::frontend::{Done, Frontend, FrontendOptions, Queue};
use common::*;
use virtio_queue::desc::split::Descriptor;
use vm_memory::{Address, Bytes, GuestMemoryMmap};

const IOERR: u8 = 1;
const UNSUPP: u8 = 2;
const NEXT: u16 = 1;
const WRITE: u16 = 2;
const INDIRECT: u16 = 4;

fn config() -> String {
    "[fuse]\nenabled = false\n[nbd]\nenabled = false\n[vhost_user]\nenabled = true\n\
     [[device]]\nname = \"a\"\nsize = \"64M\"\nqueues = 2\n[device.backend]\ntype = \"ram\"\n\
     [[device.view]]\nname = \"a-ro\"\nread_only = true\n\
     [[device]]\nname = \"b\"\nsize = \"64M\"\n[device.backend]\ntype = \"ram\"\n"
        .to_string()
}

fn connect(path: &Path, queues: u16) -> Frontend {
    Frontend::connect(path, &FrontendOptions { queues, queue_size: 64, slot_bytes: 128 << 10, ..Default::default() })
        .unwrap_or_else(|e| panic!("connect {}: {e}", path.display()))
}

/// Publishes and waits for `n` used entries.
fn complete(q: &mut Queue, mem: &GuestMemoryMmap, n: usize) -> Vec<Done> {
    q.publish(mem).unwrap();
    let mut done = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    while done.len() < n {
        q.reap(mem, |d| done.push(d)).unwrap();
        assert!(Instant::now() < deadline, "only {} of {n} requests came back", done.len());
        std::thread::yield_now();
    }
    done
}

fn one(q: &mut Queue, mem: &GuestMemoryMmap) -> Done {
    complete(q, mem, 1)[0]
}

/// The queue's status in `serve`'s status: (refused, broken).
fn queue_status(serve: &Serve, dev: &str, q: usize) -> (u64, bool) {
    let v = serve.status_json();
    let e = v["vhost_user"].as_array().unwrap().iter().find(|e| e["device"] == dev).unwrap().clone();
    let s = &e["queues"][q];
    (s["refused"].as_u64().unwrap_or(0), s["broken"].as_bool().unwrap_or(false))
}

fn wait_broken(serve: &Serve, dev: &str, q: usize) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !queue_status(serve, dev, q).1 {
        assert!(Instant::now() < deadline, "queue {q} of {dev} did not stop: {}", serve.log_text());
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Writes a pattern to device `b` and reads it back, as the bystander that must not notice.
fn bystander_round_trip(serve: &Serve, fill: u8) {
    let mut f = connect(&serve.vhost_socket("b"), 1);
    let (q, mem) = f.queue(0);
    q.write(mem, 2048, 65536, fill).unwrap();
    assert_eq!(one(q, mem).status, 0);
    let head = q.read(mem, 2048, 65536).unwrap().unwrap();
    let d = one(q, mem);
    assert_eq!((d.head, d.status, d.len), (head, 0, 65537));
    let mut buf = vec![0u8; 65536];
    mem.read_slice(&mut buf, q.slot(head).2).unwrap();
    assert!(buf.iter().all(|&b| b == fill), "device b changed");
}

#[test]
fn requests_round_trip_through_a_frontend_of_our_own() {
    require_kernel!();
    let tmp = TempDir::new("vhost-rt");
    let serve = Serve::start(&tmp.path().join("run"), Some(&config()), &[]);
    let mut f = connect(&serve.vhost_socket("a"), 2);
    assert_eq!(f.capacity().unwrap(), 64 << 20);
    let cfg = f.config(60).unwrap();
    assert_eq!(u16::from_le_bytes(cfg[34..36].try_into().unwrap()), 2, "num_queues");
    for qi in 0..2 {
        let (q, mem) = f.queue(qi);
        // Sixteen writes in flight at once, then their reads.
        for i in 0..16u64 {
            q.write(mem, i * 8, 4096, i as u8 + 1 + qi as u8 * 16).unwrap().unwrap();
        }
        let done = complete(q, mem, 16);
        assert!(done.iter().all(|d| d.status == 0 && d.len == 1), "{done:?}");
        let mut heads = Vec::new();
        for i in 0..16u64 {
            heads.push((q.read(mem, i * 8, 4096).unwrap().unwrap(), i));
        }
        let done = complete(q, mem, 16);
        assert!(done.iter().all(|d| d.status == 0 && d.len == 4097), "{done:?}");
        for (head, i) in heads {
            let mut buf = vec![0u8; 4096];
            mem.read_slice(&mut buf, q.slot(head).2).unwrap();
            assert!(buf.iter().all(|&b| b == i as u8 + 1 + qi as u8 * 16), "queue {qi} block {i}");
        }
        q.flush(mem).unwrap();
        assert_eq!(one(q, mem).status, 0);
    }
    let (q, mem) = f.queue(0);
    let head = q.get_id(mem).unwrap().unwrap();
    let d = one(q, mem);
    assert_eq!((d.status, d.len), (0, 21));
    let mut id = [0xffu8; 20];
    mem.read_slice(&mut id, q.slot(head).2).unwrap();
    assert_eq!(&id[..2], b"a\0", "a NUL-padded id");
    // A clean stop returns the base past every request taken.
    let base = f.stop_queue(0).unwrap();
    assert_eq!(base, 16 + 16 + 1 + 1);
}

/// The start of the 4 KiB page holding `a`.
fn page(a: vm_memory::GuestAddress) -> vm_memory::GuestAddress {
    vm_memory::GuestAddress(a.raw_value() & !4095)
}

/// What a live migration needs of the export: with the frontend's dirty log on (turned on as
/// QEMU does, the queue running), every page `serve` writes into guest memory is marked by the
/// time the request is seen complete: a read's data, the status byte, the used ring. The
/// guest's own pages are not, and with logging off again nothing is.
#[test]
fn pages_serve_writes_are_marked_in_the_dirty_log_while_logging() {
    require_kernel!();
    let tmp = TempDir::new("vhost-log");
    let serve = Serve::start(&tmp.path().join("run"), Some(&config()), &[]);
    let mut f = connect(&serve.vhost_socket("a"), 1);
    {
        let (q, mem) = f.queue(0);
        q.write(mem, 0, 65536, 7).unwrap().unwrap();
        assert_eq!(one(q, mem).status, 0);
    }
    f.start_logging().unwrap();
    // An idle worker rewrites its avail event in the used ring whenever it goes back to sleep,
    // so the used ring may be marked at any time; the rest only by requests.
    f.take_log().unwrap();
    let (q, mem) = f.queue(0);
    let head = q.read(mem, 0, 65536).unwrap().unwrap();
    let d = one(q, mem);
    assert_eq!((d.head, d.status, d.len), (head, 0, 65537));
    let (_, status, data) = q.slot(head);
    let mut buf = vec![0u8; 65536];
    mem.read_slice(&mut buf, data).unwrap();
    assert!(buf.iter().all(|&b| b == 7));
    let (used, desc) = (q.used, q.desc);
    let logged = f.take_log().unwrap();
    for p in 0..16u64 {
        assert!(logged.contains(&data.unchecked_add(p * 4096)), "data page {p} of the read not logged: {logged:?}");
    }
    assert!(logged.contains(&page(status)), "the status byte's page not logged");
    assert!(logged.contains(&page(used)), "the used ring not logged");
    assert!(!logged.contains(&page(desc)), "the descriptor table and available ring are the guest's to write");
    assert_eq!(logged.len(), 16 + 2, "{logged:?}");
    // A write's data is only read: its status byte and the used ring are logged.
    let (q, mem) = f.queue(0);
    let head = q.write(mem, 128, 8192, 9).unwrap().unwrap();
    assert_eq!(one(q, mem).status, 0);
    let (_, status, data) = q.slot(head);
    let logged = f.take_log().unwrap();
    assert!(logged.contains(&page(status)) && logged.contains(&page(used)), "{logged:?}");
    assert!(!logged.contains(&data), "a write's data is the guest's");
    // Logging off, as after a cancelled migration: nothing is marked. (What an idle worker
    // wrote before it heard is cleared first.)
    f.stop_logging().unwrap();
    std::thread::sleep(Duration::from_millis(100));
    f.take_log().unwrap();
    let (q, mem) = f.queue(0);
    q.read(mem, 0, 65536).unwrap().unwrap();
    assert_eq!(one(q, mem).status, 0);
    assert!(f.take_log().unwrap().is_empty(), "logging is off");
}

/// One crafted chain at head 0 of a fresh connection's queue 0, made available and
/// published: the queue must stop (`broken`), and serve and device `b` must carry on.
fn breaks_the_queue(serve: &Serve, what: &str, craft: impl FnOnce(&mut Queue, &GuestMemoryMmap)) {
    let mut f = connect(&serve.vhost_socket("a"), 1);
    let (q, mem) = f.queue(0);
    craft(q, mem);
    q.publish(mem).unwrap();
    wait_broken(serve, "a", 0);
    assert!(serve.log_text().contains("the queue stops"), "{what}: {}", serve.log_text());
    drop(f);
    wait_disconnected(serve, "a");
    bystander_round_trip(serve, what.len() as u8);
    wait_disconnected(serve, "b");
}

fn wait_disconnected(serve: &Serve, dev: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let v = serve.status_json();
        let e = v["vhost_user"].as_array().unwrap().iter().find(|e| e["device"] == dev).unwrap().clone();
        if e["connected"] == false {
            return;
        }
        assert!(Instant::now() < deadline, "{dev} still connected: {}", serve.log_text());
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_hostile_frontend_stops_only_its_own_queue() {
    require_kernel!();
    let tmp = TempDir::new("vhost-hostile");
    let serve = Serve::start(&tmp.path().join("run"), Some(&config()), &[]);
    bystander_round_trip(&serve, 0x11);
    wait_disconnected(&serve, "b");
    breaks_the_queue(&serve, "a descriptor loop", |q, mem| {
        q.take_head(0);
        q.write_desc(mem, 0, Descriptor::new(0x10_0000, 16, NEXT, 1)).unwrap();
        q.write_desc(mem, 1, Descriptor::new(0x10_0000, 16, NEXT, 0)).unwrap();
        q.offer(mem, 0).unwrap();
    });
    breaks_the_queue(&serve, "a head outside the table", |q, mem| {
        q.offer(mem, 999).unwrap();
    });
    breaks_the_queue(&serve, "a runaway available index", |q, mem| {
        q.force_avail_idx(mem, 1000).unwrap();
    });
    breaks_the_queue(&serve, "a buffer outside guest memory", |q, mem| {
        q.take_head(0);
        q.write_desc(mem, 0, Descriptor::new(1 << 40, 4096, WRITE, 0)).unwrap();
        q.offer(mem, 0).unwrap();
    });
    breaks_the_queue(&serve, "a nested indirect table", |q, mem| {
        q.take_head(0);
        let table = q.slot_table(0);
        q.write_desc(mem, 0, Descriptor::new(table.raw_value(), 16, INDIRECT, 0)).unwrap();
        mem.write_obj(Descriptor::new(table.raw_value(), 16, INDIRECT, 0), table).unwrap();
        q.offer(mem, 0).unwrap();
    });
    breaks_the_queue(&serve, "a head made available twice", |q, mem| {
        let h = q.read(mem, 0, 4096).unwrap().unwrap();
        q.offer(mem, h).unwrap();
    });
    assert!(serve.child.0.is_some());
    assert!(serve.status_json()["devices"].as_array().unwrap().iter().all(|d| d["state"] == "running"));
}

#[test]
fn malformed_requests_fail_alone_and_the_queue_carries_on() {
    require_kernel!();
    let tmp = TempDir::new("vhost-bad-req");
    let serve = Serve::start(&tmp.path().join("run"), Some(&config()), &[]);
    let mut f = connect(&serve.vhost_socket("a"), 1);
    let (q, mem) = f.queue(0);
    // Past the end of the device.
    q.read(mem, (64 << 20) / 512, 4096).unwrap();
    assert_eq!(one(q, mem).status, IOERR);
    // A ragged length.
    q.read(mem, 0, 100).unwrap();
    assert_eq!(one(q, mem).status, IOERR);
    // An unknown request type.
    q.request(mem, 77, 0, 512, 0).unwrap();
    assert_eq!(one(q, mem).status, UNSUPP);
    // A header of 8 bytes.
    let h = q.read(mem, 0, 4096).unwrap().unwrap();
    let table = q.slot_table(h);
    let first: Descriptor = mem.read_obj(table).unwrap();
    mem.write_obj(Descriptor::new(first.addr().raw_value(), 8, NEXT, 1), table).unwrap();
    assert_eq!(one(q, mem).status, IOERR);
    // No status byte: every buffer device-readable. It comes back with nothing written.
    let h = q.read(mem, 0, 4096).unwrap().unwrap();
    let table = q.slot_table(h);
    for i in 0..3u64 {
        let d: Descriptor = mem.read_obj(table.unchecked_add(16 * i)).unwrap();
        mem.write_obj(Descriptor::new(d.addr().raw_value(), d.len(), d.flags() & !WRITE, d.next()), table.unchecked_add(16 * i))
            .unwrap();
    }
    let d = one(q, mem);
    assert_eq!((d.head, d.len), (h, 0));
    // And the queue still serves.
    q.write(mem, 8, 4096, 0x5a).unwrap();
    assert_eq!(one(q, mem).status, 0);
    assert_eq!(queue_status(&serve, "a", 0), (5, false));
    // A read-only view refuses writes.
    let mut ro = connect(&serve.vhost_socket("a-ro"), 1);
    let (q, mem) = ro.queue(0);
    q.write(mem, 8, 4096, 0).unwrap();
    assert_eq!(one(q, mem).status, IOERR);
    let h = q.read(mem, 8, 4096).unwrap().unwrap();
    assert_eq!(one(q, mem).status, 0);
    let mut buf = vec![0u8; 4096];
    mem.read_slice(&mut buf, q.slot(h).2).unwrap();
    assert!(buf.iter().all(|&b| b == 0x5a));
}

#[test]
fn a_second_frontend_is_refused_while_one_is_connected() {
    require_kernel!();
    let tmp = TempDir::new("vhost-second");
    let serve = Serve::start(&tmp.path().join("run"), Some(&config()), &[]);
    let path = serve.vhost_socket("b");
    let mut first = connect(&path, 1);
    let second = Frontend::connect(&path, &FrontendOptions::default());
    assert!(second.is_err(), "a second frontend was served");
    let (q, mem) = first.queue(0);
    q.write(mem, 0, 4096, 1).unwrap();
    assert_eq!(one(q, mem).status, 0);
    drop(first);
    // Once the first has gone, a new one is served.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match Frontend::connect(&path, &FrontendOptions::default()) {
            Ok(_) => break,
            Err(e) => assert!(Instant::now() < deadline, "not served after the first left: {e}"),
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}
