//! Building a device-model domain (`bulkhead vdev model`) from its spec and the descriptors it
//! inherited.

use bulkhead_backends::RamBackend;
use bulkhead_spec::ModelSpec;
use bulkhead_vdev::domain::{ModelDomain, StatsPage};
use bulkhead_vdev::Card;

use crate::DriverError;

/// Builds the model domain `spec` describes: the card's model over its register page, DMA
/// memory and storage, with its interrupt, the trap line and the counter page. Maps
/// everything it needs and closes what it no longer does (so traps that arrive once it is
/// confined have descriptor numbers free).
///
/// # Safety
/// Every descriptor named in the spec must be inherited for this domain and not used by
/// anything else in the process.
pub unsafe fn build_model_inherited(spec: &ModelSpec) -> Result<ModelDomain, DriverError> {
    fn setup<E: std::fmt::Display>(what: &'static str) -> impl Fn(E) -> DriverError {
        move |e| DriverError::Setup(format!("{what}: {e}"))
    }
    let card = Card::from_json(&spec.card).map_err(setup("card"))?;
    // SAFETY: forwarded from this function's contract.
    let claimed = spec.fds.map(|fd| unsafe { bulkhead_sys::claim_inherited(fd) });
    let [regs, dma, media, irq, line, stats] =
        claimed.map(|r| r.map_err(|e| DriverError::Setup(format!("descriptor named in the spec: {e}"))));
    let (regs, dma) = (regs?, dma?);
    let media = RamBackend::new(media?, spec.media_size).map_err(|e| setup("storage")(e.to_string()))?;
    let irq = bulkhead_doorbell::EventFd::from_owned(irq?).map_err(|e| setup("interrupt")(e.to_string()))?;
    let stats = StatsPage::map(&stats?, true).map_err(|e| setup("counter page")(e.to_string()))?;
    let domain =
        ModelDomain::new(card, &regs, &dma, Box::new(media), irq, line?, stats).map_err(|e| DriverError::Setup(e.to_string()))?;
    // Mapped: the descriptors are not needed any more.
    drop((regs, dma));
    Ok(domain)
}
