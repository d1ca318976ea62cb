//! Internal snapshots made here read in qemu, and qemu's read here: `qemu-img check` finds no
//! fault after each operation, and the contents match what `qemu-img convert` saved at the
//! moment of each snapshot.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::Command;

use bulkhead_image::snapshot::{self, SnapshotError};

struct Dir(PathBuf);
impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn dir(tag: &str) -> Dir {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos();
    let d = std::env::temp_dir().join(format!("bulkhead-snap-{tag}-{}-{nanos}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    Dir(d)
}

fn have_qemu() -> bool {
    Command::new("qemu-img").arg("--version").output().is_ok_and(|o| o.status.success())
}

fn run(cmd: &str, args: &[&str]) -> String {
    let out = Command::new(cmd).args(args).output().unwrap();
    assert!(
        out.status.success(),
        "{cmd} {args:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn io(img: &Path, cmd: &str) {
    let out = run("qemu-io", &["-f", "qcow2", "-c", cmd, img.to_str().unwrap()]);
    assert!(!out.contains("failed"), "qemu-io {cmd}: {out}");
}

/// `qemu-img check` with no errors and no leaks.
fn clean(img: &Path) {
    let out = Command::new("qemu-img").args(["check", "-f", "qcow2", img.to_str().unwrap()]).output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && text.contains("No errors were found"), "qemu-img check {}: {text}", img.display());
}

fn same(a: &Path, b: &Path) {
    run("qemu-img", &["compare", "-q", a.to_str().unwrap(), b.to_str().unwrap()]);
}

fn save(img: &Path, to: &Path) {
    run("qemu-img", &["convert", "-f", "qcow2", "-O", "raw", img.to_str().unwrap(), to.to_str().unwrap()]);
}

fn rw(p: &Path) -> File {
    std::fs::OpenOptions::new().read(true).write(true).open(p).unwrap()
}

/// Writes across whole and partial clusters, a zeroed range and a discard, in a round-specific
/// pattern.
fn scribble(img: &Path, round: u32) {
    let p = 0x10 + round;
    io(img, &format!("write -P {p:#x} {}k 200k", 64 * round));
    io(img, &format!("write -P {:#x} 3m 4k", p + 1));
    io(img, &format!("write -z {}k 64k", 1024 + 128 * round));
    io(img, &format!("discard {}k 128k", 2048 + 64 * round));
    io(img, &format!("write -P {:#x} 7m 1m", p + 2));
}

#[test]
fn snapshots_taken_reverted_and_deleted_here_agree_with_qemu() {
    if !have_qemu() {
        eprintln!("skipped: qemu-img is not installed");
        return;
    }
    let d = dir("ours");
    let img = d.0.join("a.qcow2");
    run("qemu-img", &["create", "-q", "-f", "qcow2", "-o", "cluster_size=64k", img.to_str().unwrap(), "16M"]);
    scribble(&img, 0);
    let at1 = d.0.join("at1.raw");
    save(&img, &at1);
    let s1 = snapshot::create(&rw(&img), "first", (1_700_000_000, 5)).unwrap();
    assert_eq!((s1.id.as_str(), s1.disk_size), ("1", Some(16 << 20)));
    clean(&img);
    let listed = run("qemu-img", &["snapshot", "-l", img.to_str().unwrap()]);
    assert!(listed.contains("first"), "{listed}");

    // Writes after the snapshot leave it alone.
    scribble(&img, 1);
    clean(&img);
    let at2 = d.0.join("at2.raw");
    save(&img, &at2);
    snapshot::create(&rw(&img), "second", (1_700_000_100, 0)).unwrap();
    scribble(&img, 2);
    clean(&img);
    let names: Vec<String> = snapshot::list(&rw(&img)).unwrap().into_iter().map(|s| s.name).collect();
    assert_eq!(names, ["first", "second"]);
    assert!(matches!(snapshot::create(&rw(&img), "first", (0, 0)), Err(SnapshotError::Exists(_))));
    assert!(matches!(snapshot::revert(&rw(&img), "third"), Err(SnapshotError::NotFound(_))));

    // qemu reads each snapshot as it was.
    let q1 = d.0.join("q1.raw");
    run("qemu-img", &["convert", "-l", "snapshot.name=first", "-O", "raw", img.to_str().unwrap(), q1.to_str().unwrap()]);
    same(&q1, &at1);

    snapshot::revert(&rw(&img), "first").unwrap();
    clean(&img);
    same(&img, &at1);
    scribble(&img, 3);
    clean(&img);
    snapshot::revert(&rw(&img), "second").unwrap();
    clean(&img);
    same(&img, &at2);

    snapshot::delete(&rw(&img), "first").unwrap();
    clean(&img);
    same(&img, &at2);
    snapshot::delete(&rw(&img), "second").unwrap();
    clean(&img);
    assert!(snapshot::list(&rw(&img)).unwrap().is_empty());
    // With no snapshot left, every cluster is the live image's alone again: writes go in place.
    scribble(&img, 4);
    clean(&img);
}

#[test]
fn snapshots_qemu_made_are_listed_reverted_and_deleted_here() {
    if !have_qemu() {
        eprintln!("skipped: qemu-img is not installed");
        return;
    }
    let d = dir("theirs");
    let img = d.0.join("b.qcow2");
    let i = img.to_str().unwrap();
    run("qemu-img", &["create", "-q", "-f", "qcow2", i, "8M"]);
    scribble(&img, 0);
    let at = d.0.join("at.raw");
    save(&img, &at);
    run("qemu-img", &["snapshot", "-c", "theirs", i]);
    // Compressed clusters count too.
    let comp = d.0.join("c.qcow2");
    run("qemu-img", &["convert", "-c", "-f", "qcow2", "-O", "qcow2", i, comp.to_str().unwrap()]);
    scribble(&img, 1);
    let listed = snapshot::list(&rw(&img)).unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!((listed[0].name.as_str(), listed[0].disk_size), ("theirs", Some(8 << 20)));
    snapshot::revert(&rw(&img), "theirs").unwrap();
    clean(&img);
    same(&img, &at);
    snapshot::delete(&rw(&img), "theirs").unwrap();
    clean(&img);
    same(&img, &at);

    let comp_at = d.0.join("comp.raw");
    save(&comp, &comp_at);
    snapshot::create(&rw(&comp), "c", (1, 2)).unwrap();
    clean(&comp);
    io(&comp, "write -P 0x77 0 1m");
    clean(&comp);
    snapshot::revert(&rw(&comp), "c").unwrap();
    clean(&comp);
    same(&comp, &comp_at);
    snapshot::delete(&rw(&comp), "c").unwrap();
    clean(&comp);
}

/// A new overlay written by [`bulkhead_image::new_image`] is an image qemu accepts.
#[test]
fn a_new_image_passes_qemu_img_check_and_reads_its_backing_file() {
    if !have_qemu() {
        eprintln!("skipped: qemu-img is not installed");
        return;
    }
    let d = dir("new");
    let base = d.0.join("base.raw");
    std::fs::write(&base, vec![0x5au8; 3 << 20]).unwrap();
    let b = bulkhead_image::Backing { name: base.to_str().unwrap().into(), format: bulkhead_image::Format::Raw };
    let img = d.0.join("new.qcow2");
    std::fs::write(&img, bulkhead_image::new_image(3 << 20, 16, Some(&b)).unwrap()).unwrap();
    clean(&img);
    same(&img, &base);
    let info = run("qemu-img", &["info", img.to_str().unwrap()]);
    assert!(info.contains("virtual size: 3 MiB") && info.contains("backing file format: raw"), "{info}");
}

/// Damaged metadata makes an operation fail, never panic.
#[test]
fn damaged_images_fail_cleanly() {
    if !have_qemu() {
        eprintln!("skipped: qemu-img is not installed");
        return;
    }
    let d = dir("damaged");
    let good = d.0.join("good.qcow2");
    run("qemu-img", &["create", "-q", "-f", "qcow2", "-o", "cluster_size=4k", good.to_str().unwrap(), "1M"]);
    io(&good, "write -P 0x11 0 300k");
    snapshot::create(&rw(&good), "s", (0, 0)).unwrap();
    io(&good, "write -P 0x12 100k 100k");
    let bytes = std::fs::read(&good).unwrap();
    let mut rng = bulkhead_rng::Rng::new(0x2545_f491_4f6c_dd1d);
    let mut next = || rng.next_u64();
    let img = d.0.join("bad.qcow2");
    let mut failed = 0;
    for round in 0..300 {
        let mut b = bytes.clone();
        for _ in 0..1 + next() % 3 {
            // Metadata lives in the first clusters and wherever the tables are: flip anywhere.
            let at = next() as usize % b.len();
            b[at] = next() as u8;
        }
        std::fs::write(&img, &b).unwrap();
        let f = rw(&img);
        let r = match round % 4 {
            0 => snapshot::list(&f).map(|_| ()),
            1 => snapshot::create(&f, "n", (0, 0)).map(|_| ()),
            2 => snapshot::revert(&f, "s"),
            _ => snapshot::delete(&f, "s"),
        };
        failed += usize::from(r.is_err());
    }
    assert!(failed > 0, "some damage must be noticed");
}
