//! `bulkhead vdev generate`: a card's spec and its datasheet.

use std::path::Path;
use std::process::ExitCode;

use anyhow::Context;
use bulkhead_vdev::{datasheet, Card};

pub fn generate(seed: u64, out: &Path) -> anyhow::Result<ExitCode> {
    let card = Card::generate(seed);
    std::fs::create_dir_all(out).with_context(|| format!("cannot create {}", out.display()))?;
    let files = [
        ("card.json", card.to_json() + "\n"),
        ("datasheet.md", datasheet::markdown(&card)),
        ("datasheet.html", datasheet::html(&card)),
    ];
    for (name, text) in files {
        let path = out.join(name);
        std::fs::write(&path, text).with_context(|| format!("cannot write {}", path.display()))?;
        println!("{}", path.display());
    }
    eprintln!(
        "card {seed}: {} (id {:#x}), {}-byte descriptors, DMA from {:#x}",
        card.name,
        card.id(),
        card.descriptor.size,
        card.dma_base
    );
    Ok(ExitCode::SUCCESS)
}
