//! `bulkhead vdev generate`: a card's spec and its datasheet; `bulkhead vdev model`: the
//! device-model domain of a `vdev` device.

use std::path::Path;
use std::process::ExitCode;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use anyhow::Context;
use bulkhead_vdev::{datasheet, Card};

/// Writes the files and prints their paths, or with `out` JSON, one object: the seed, the
/// card's name and id, and the files.
pub fn generate(seed: u64, out: &Path, print: crate::status::Out) -> anyhow::Result<ExitCode> {
    let card = Card::generate(seed);
    std::fs::create_dir_all(out).with_context(|| format!("cannot create {}", out.display()))?;
    let files = [
        ("card.json", card.to_json() + "\n"),
        ("datasheet.md", datasheet::markdown(&card)),
        ("datasheet.html", datasheet::html(&card)),
    ];
    let mut written = Vec::new();
    for (name, text) in files {
        let path = out.join(name);
        std::fs::write(&path, text).with_context(|| format!("cannot write {}", path.display()))?;
        written.push(path);
    }
    let json = serde_json::json!({ "seed": seed, "name": card.name, "id": card.id(), "files": written });
    if print.json(&json)? {
        return Ok(ExitCode::SUCCESS);
    }
    for path in &written {
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

/// The device-model domain: builds the card's model from the descriptors the supervisor
/// passed, confines itself as a `vdev-model` domain, and serves the drivers' traps until told
/// to stop or the supervisor goes.
#[allow(unsafe_code)] // claims the descriptors inherited at exec
pub fn model(spec_json: &str) -> anyhow::Result<ExitCode> {
    let spec: bulkhead_spec::ModelSpec = serde_json::from_str(spec_json).context("bad model spec")?;
    let stop = Arc::new(AtomicBool::new(false));
    signal_hook::flag::register(signal_hook::consts::SIGTERM, stop.clone())?;
    signal_hook::flag::register(signal_hook::consts::SIGINT, stop.clone())?;
    let device = || format!("device {} (device model)", spec.device);
    // SAFETY: the supervisor placed exactly the descriptors the spec names, for this process
    // alone, and nothing else here uses them.
    let mut domain = unsafe { bulkhead_driver::build_model_inherited(&spec) }.with_context(device)?;
    bulkhead_driver::confine_as(spec.sandbox.policy, spec.seccomp_role(), false, spec.report_fd, Vec::new(), (0, 0))
        .with_context(device)?;
    domain.run(&stop).map_err(anyhow::Error::msg).with_context(device)?;
    Ok(ExitCode::SUCCESS)
}
