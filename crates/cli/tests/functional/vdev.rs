//! `bulkhead vdev generate`: a card's spec and datasheet, the same for the same seed, and a
//! spec the library reads back as the card of that seed.

use std::process::Command;

fn generate(seed: &str, out: &std::path::Path) -> (bool, String) {
    let o = Command::new(env!("CARGO_BIN_EXE_bulkhead"))
        .args(["vdev", "generate", "--seed", seed, "--out"])
        .arg(out)
        .output()
        .unwrap();
    (o.status.success(), String::from_utf8_lossy(&o.stderr).into_owned())
}

#[test]
fn a_seed_writes_its_card_and_datasheet_the_same_every_time() {
    let dir = std::env::temp_dir().join(format!("bulkhead-vdev-{}", std::process::id()));
    let (a, b, c) = (dir.join("a"), dir.join("b"), dir.join("c"));
    for (seed, out) in [("12", &a), ("12", &b), ("13", &c)] {
        let (ok, err) = generate(seed, out);
        assert!(ok, "{err}");
    }
    for name in ["card.json", "datasheet.md", "datasheet.html"] {
        let x = std::fs::read(a.join(name)).unwrap();
        assert!(!x.is_empty(), "{name}");
        assert_eq!(x, std::fs::read(b.join(name)).unwrap(), "{name}: the same seed, the same bytes");
        assert_ne!(x, std::fs::read(c.join(name)).unwrap(), "{name}: another seed, another card");
    }
    let card = bulkhead_vdev::Card::from_json(&std::fs::read_to_string(a.join("card.json")).unwrap()).unwrap();
    assert_eq!(card, bulkhead_vdev::Card::generate(12));
    let md = std::fs::read_to_string(a.join("datasheet.md")).unwrap();
    assert!(md.contains(&format!("# {} storage controller (card 12)", card.name)));
    // A seed that is not a number is named.
    let (ok, err) = generate("twelve", &dir.join("d"));
    assert!(!ok);
    assert!(err.contains("--seed"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}
