//! `bulkhead-bench vdev`: what a register-level driver over a trapped virtual card costs.
//!
//! Three devices of the same size, each in a supervisor of its own: `vdev` with the driver
//! taking the card's interrupt, `vdev` with the driver polling the card's completion counter,
//! and `ram` for reference. Each is measured through the client library: 4 KiB random reads
//! and writes one at a time (QD1 latency), and with 16 in flight on one queue (QD16 IOPS). The model's
//! counters say how many register writes were trapped per request.
//!
//! Then the cost of one trapped register write on its own: a card's model domain serving in a
//! thread of this process (the same code as the device-model domain), the driver's side
//! writing a register whose write the model acts on and waiting, after each, until the model
//! has protected the page again, so that every write is trapped. Beside it, the same write to
//! an untrapped mapping.

use crate::BenchError;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bulkhead_client::Device;
use bulkhead_config::Config;
use bulkhead_shmem::{memfd, Mapping, Protection};
use bulkhead_supervisor::Supervisor;
use bulkhead_vdev::card::{Card, PAGE};
use bulkhead_vdev::domain::{send_trap, ModelDomain, StatsPage, DMA_BYTES, STATS_BYTES};
use bulkhead_vdev::regs::RegisterPage;
use serde::Serialize;

use crate::Table;

/// Options.
#[derive(Debug, Clone)]
pub struct Options {
    /// The card's seed.
    pub seed: u64,
    /// Bytes of each device.
    pub size: u64,
    /// Timed QD1 requests per direction and device.
    pub requests: usize,
    /// Seconds of each QD16 run.
    pub seconds: u32,
    /// Trapped register writes timed.
    pub writes: usize,
}

/// One device.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    /// `vdev-interrupt`, `vdev-poll` or `ram`.
    pub system: String,
    /// QD1 4 KiB random read latency: mean, median, 99th percentile, µs.
    pub read_mean_us: f64,
    /// Median.
    pub read_p50_us: f64,
    /// 99th percentile.
    pub read_p99_us: f64,
    /// QD1 4 KiB random write latency, mean, µs.
    pub write_mean_us: f64,
    /// Median.
    pub write_p50_us: f64,
    /// 99th percentile.
    pub write_p99_us: f64,
    /// QD16 4 KiB random reads, IOPS.
    pub qd16_read_iops: f64,
    /// QD16 4 KiB random writes, IOPS.
    pub qd16_write_iops: f64,
    /// Register writes the model was told of, per request (whole run), for a `vdev`.
    pub trapped_per_request: Option<f64>,
    /// Commands the card completed per interrupt it raised, for `vdev-interrupt`.
    pub commands_per_interrupt: Option<f64>,
}

/// The cost of one register write.
#[derive(Debug, Clone, Serialize)]
pub struct TrapCost {
    /// Writes timed.
    pub writes: usize,
    /// From the store to the writer going on, trapped: mean, median, 99th percentile, µs.
    pub trapped_mean_us: f64,
    /// Median.
    pub trapped_p50_us: f64,
    /// 99th percentile.
    pub trapped_p99_us: f64,
    /// From the store until the model has acted on it and protected the page again, mean, µs.
    pub round_trip_mean_us: f64,
    /// The same store to an untrapped mapping, mean, ns.
    pub untrapped_mean_ns: f64,
}

/// The whole run.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// The card.
    pub card: String,
    /// Its seed.
    pub seed: u64,
    /// Bytes of each device.
    pub size: u64,
    /// QD1 requests per direction.
    pub requests: usize,
    /// Seconds per QD16 run.
    pub seconds: u32,
    /// The devices.
    pub rows: Vec<Row>,
    /// One trapped register write.
    pub trap: TrapCost,
}

const SMALL: usize = 4096;
/// Requests kept in flight for the QD16 figures.
const DEPTH: usize = 16;

/// Deterministic 4 KiB-aligned offsets inside `size`.
fn offsets(n: usize, size: u64, seed: u64) -> impl Iterator<Item = u64> {
    crate::tap::small_offsets(n, size, seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
}

fn summarize(mut v: Vec<f64>) -> (f64, f64, f64) {
    if v.is_empty() {
        return (0.0, 0.0, 0.0);
    }
    v.sort_by(f64::total_cmp);
    let mean = v.iter().sum::<f64>() / v.len() as f64;
    let pct = |q: f64| v[((v.len() - 1) as f64 * q).round() as usize];
    (mean, pct(0.5), pct(0.99))
}

fn qd1(dev: &Device, opts: &Options, write: bool) -> Result<(f64, f64, f64), BenchError> {
    let e = |e: bulkhead_client::IoError| e.to_string();
    let mut buf = vec![0x5au8; SMALL];
    let mut lat = Vec::with_capacity(opts.requests);
    for (i, off) in offsets(opts.requests + 1000, opts.size, if write { 7 } else { 3 }).enumerate() {
        let t = Instant::now();
        if write {
            dev.write(0, off, &buf, false).map_err(e)?;
        } else {
            dev.read_into(0, off, &mut buf).map_err(e)?;
        }
        // The first thousand warm up.
        if i >= 1000 {
            lat.push(t.elapsed().as_secs_f64() * 1e6);
        }
    }
    Ok(summarize(lat))
}

/// Keeps [`DEPTH`] requests in flight on one queue from one thread for the run's time;
/// returns the rate at which they complete.
fn qd16(dev: &Device, opts: &Options, write: bool) -> Result<f64, BenchError> {
    let buf = vec![0xa5u8; SMALL];
    let mut q = dev.queue(0);
    let mut next = offsets(usize::MAX, opts.size, if write { 11 } else { 13 });
    let mut submit = |q: &mut bulkhead_client::QueueHandle<'_>| -> Result<(), BenchError> {
        let offset = next.next().expect("endless");
        let req = if write {
            bulkhead_channel::FrontRequest::Write { offset, from: &buf, fua: false }
        } else {
            bulkhead_channel::FrontRequest::Read { offset, into: SMALL as u64 }
        };
        q.submit(req, offset).map_err(|e| BenchError::Run(e.to_string()))
    };
    for _ in 0..DEPTH {
        submit(&mut q)?;
    }
    let t0 = Instant::now();
    let end = t0 + Duration::from_secs(u64::from(opts.seconds));
    let (mut done, mut failed) = (0u64, None);
    while Instant::now() < end {
        let mut answered = 0;
        q.wait(|_, r, _| {
            answered += 1;
            if let Err(e) = r {
                failed.get_or_insert(e.to_string());
            }
        });
        if let Some(e) = failed {
            return Err(BenchError::from(e));
        }
        done += answered;
        for _ in 0..answered {
            submit(&mut q)?;
        }
    }
    let rate = done as f64 / t0.elapsed().as_secs_f64();
    // Let the last ones finish.
    while q.in_flight() > 0 {
        q.wait(|_, _, _| {});
    }
    Ok(rate)
}

fn device(exe: &Path, opts: &Options, system: &str) -> Result<Row, BenchError> {
    let backend = match system {
        "vdev-interrupt" => format!("type = \"vdev\"\nseed = {}\nwait = \"interrupt\"\n", opts.seed),
        "vdev-poll" => format!("type = \"vdev\"\nseed = {}\nwait = \"poll\"\n", opts.seed),
        _ => "type = \"ram\"\n".to_string(),
    };
    let text = format!(
        "[fuse]\nenabled = false\n[nbd]\nenabled = false\n[[device]]\nname = \"v\"\nsize = {}\nqueues = 1\nnotify = \"poll\"\n\
         [device.backend]\n{backend}",
        opts.size
    );
    let config = Config::parse(&text, "bench vdev").map_err(|e| e.to_string())?;
    let sup = Supervisor::start(&config, Some(exe)).map_err(|e| e.to_string())?;
    let dev = sup.devices()[0].clone();
    // Fill the device once: a fresh memory file's first touch of each page is a page fault.
    let chunk = vec![1u8; 1 << 20];
    for off in (0..opts.size).step_by(chunk.len()) {
        dev.write(0, off, &chunk, false).map_err(|e| format!("{system}: fill: {e}"))?;
    }
    let start = sup.status().devices[0].card.clone();
    let done = dev.counters.completed.load(Ordering::Relaxed);
    let (read_mean_us, read_p50_us, read_p99_us) = qd1(&dev, opts, false).map_err(|e| format!("{system}: {e}"))?;
    let (write_mean_us, write_p50_us, write_p99_us) = qd1(&dev, opts, true).map_err(|e| format!("{system}: {e}"))?;
    let qd16_read_iops = qd16(&dev, opts, false).map_err(|e| format!("{system}: {e}"))?;
    let qd16_write_iops = qd16(&dev, opts, true).map_err(|e| format!("{system}: {e}"))?;
    let requests = (dev.counters.completed.load(Ordering::Relaxed) - done) as f64;
    let end = sup.status().devices[0].card.clone();
    sup.shutdown();
    let (trapped_per_request, commands_per_interrupt) = match (start, end) {
        (Some(a), Some(b)) => {
            let trapped = (b.stats.trapped_writes - a.stats.trapped_writes) as f64;
            let commands = (b.stats.model.commands - a.stats.model.commands) as f64;
            let irqs = (b.stats.model.interrupts - a.stats.model.interrupts) as f64;
            (Some(trapped / requests.max(1.0)), (irqs > 0.0).then(|| commands / irqs))
        }
        _ => (None, None),
    };
    Ok(Row {
        system: system.into(),
        read_mean_us,
        read_p50_us,
        read_p99_us,
        write_mean_us,
        write_p50_us,
        write_p99_us,
        qd16_read_iops,
        qd16_write_iops,
        trapped_per_request,
        commands_per_interrupt,
    })
}

/// One trapped register write, timed with a card's model serving in a thread of its own.
fn trap_cost(opts: &Options) -> Result<TrapCost, BenchError> {
    let e = |e: &dyn std::fmt::Display| e.to_string();
    let card = Card::generate(opts.seed);
    let regs = memfd::create("bench-vdev-regs", u64::from(PAGE)).map_err(|x| e(&x))?;
    let dma = memfd::create("bench-vdev-dma", DMA_BYTES).map_err(|x| e(&x))?;
    let media_fd = memfd::create("bench-vdev-media", 1 << 20).map_err(|x| e(&x))?;
    let stats_fd = memfd::create("bench-vdev-stats", STATS_BYTES).map_err(|x| e(&x))?;
    let media = bulkhead_backends::RamBackend::new(media_fd, 1 << 20).map_err(|x| e(&x))?;
    let irq = bulkhead_doorbell::EventFd::new().map_err(|x| e(&x))?;
    let (model_end, driver_end) = bulkhead_sys::seqpacket_pair().map_err(|x| e(&x))?;
    let stats = StatsPage::map(&stats_fd, false).map_err(|x| e(&x))?;
    let mut model = ModelDomain::new(
        card.clone(),
        &regs,
        &dma,
        Box::new(media),
        irq,
        model_end,
        StatsPage::map(&stats_fd, true).map_err(|x| e(&x))?,
    )?;
    let stop = Arc::new(AtomicBool::new(false));
    let quit = stop.clone();
    let server = std::thread::spawn(move || model.run(&quit));
    let page = RegisterPage::new(Mapping::new(regs.as_raw_fd(), PAGE as usize, Protection::ReadWrite).map_err(|x| e(&x))?)?;
    send_trap(&driver_end, &page)?;
    // QUEUE_ENTRIES: a register the model reads, with no effect while the card is disabled.
    let reg = card.registers.queue_entries;
    let mut trapped = Vec::with_capacity(opts.writes);
    let mut round = Vec::with_capacity(opts.writes);
    let result = (|| -> Result<_, BenchError> {
        for i in 0..opts.writes + 100 {
            let before = stats.read().trapped_writes;
            let t = Instant::now();
            page.write(reg, (i % 64) as u64 + 1);
            let stored = t.elapsed();
            // Wait until the model has protected the page again, so the next write traps too.
            let deadline = Instant::now() + Duration::from_secs(5);
            while stats.read().trapped_writes == before {
                if Instant::now() > deadline {
                    return Err("the model did not serve a trapped write within 5 s".into());
                }
                std::hint::spin_loop();
            }
            if i >= 100 {
                trapped.push(stored.as_secs_f64() * 1e6);
                round.push(t.elapsed().as_secs_f64() * 1e6);
            }
        }
        Ok(())
    })();
    stop.store(true, Ordering::Relaxed);
    let served = server.join().map_err(|_| "the model thread panicked".to_string())?;
    result?;
    served?;
    // The same store to an untrapped mapping of the page.
    let plain = RegisterPage::new(Mapping::new(regs.as_raw_fd(), PAGE as usize, Protection::ReadWrite).map_err(|x| e(&x))?)?;
    let n = 1_000_000u64;
    let t = Instant::now();
    for i in 0..n {
        plain.write(reg, std::hint::black_box(i % 64 + 1));
    }
    let untrapped_mean_ns = t.elapsed().as_secs_f64() * 1e9 / n as f64;
    let (trapped_mean_us, trapped_p50_us, trapped_p99_us) = summarize(trapped);
    let (round_trip_mean_us, _, _) = summarize(round);
    Ok(TrapCost { writes: opts.writes, trapped_mean_us, trapped_p50_us, trapped_p99_us, round_trip_mean_us, untrapped_mean_ns })
}

/// Runs every device and the trap measurement, execing `exe` for the domains.
pub fn run(exe: &Path, opts: &Options, mut progress: impl FnMut(&str)) -> Result<Report, BenchError> {
    let mut rows = Vec::new();
    for system in ["vdev-interrupt", "vdev-poll", "ram"] {
        progress(system);
        rows.push(device(exe, opts, system)?);
    }
    progress("one trapped register write");
    let trap = trap_cost(opts)?;
    Ok(Report {
        card: Card::generate(opts.seed).name,
        seed: opts.seed,
        size: opts.size,
        requests: opts.requests,
        seconds: opts.seconds,
        rows,
        trap,
    })
}

/// The report as tables.
pub fn render(r: &Report) -> String {
    let mut t = Table::new(&[
        "SYSTEM",
        "READ QD1 us mean/p50/p99",
        "WRITE QD1 us mean/p50/p99",
        "QD16 READ IOPS",
        "QD16 WRITE IOPS",
        "TRAPPED/REQ",
        "CMDS/IRQ",
    ]);
    for row in &r.rows {
        t.row(vec![
            row.system.clone(),
            format!("{:.1} / {:.1} / {:.1}", row.read_mean_us, row.read_p50_us, row.read_p99_us),
            format!("{:.1} / {:.1} / {:.1}", row.write_mean_us, row.write_p50_us, row.write_p99_us),
            format!("{:.0}", row.qd16_read_iops),
            format!("{:.0}", row.qd16_write_iops),
            row.trapped_per_request.map_or("-".into(), |v| format!("{v:.2}")),
            row.commands_per_interrupt.map_or("-".into(), |v| format!("{v:.1}")),
        ]);
    }
    let tc = &r.trap;
    format!(
        "card {} (seed {}), {} MiB devices, {} QD1 requests per direction, {} s per QD16 run\n{}\n\
         one trapped register write ({} timed): the writer waits {:.1} us mean ({:.1} p50, {:.1} p99); \
         {:.1} us until the model has acted and protected the page again; the same store untrapped: {:.1} ns\n",
        r.card,
        r.seed,
        r.size >> 20,
        r.requests,
        r.seconds,
        t.render(),
        tc.writes,
        tc.trapped_mean_us,
        tc.trapped_p50_us,
        tc.trapped_p99_us,
        tc.round_trip_mean_us,
        tc.untrapped_mean_ns
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offsets_are_aligned_inside_the_device_and_repeatable() {
        let a: Vec<u64> = offsets(1000, 64 << 20, 3).collect();
        assert!(a.iter().all(|&o| o % 4096 == 0 && o + 4096 <= 64 << 20));
        assert_eq!(a, offsets(1000, 64 << 20, 3).collect::<Vec<_>>());
        assert_ne!(a, offsets(1000, 64 << 20, 4).collect::<Vec<_>>());
    }

    #[test]
    fn summaries_are_mean_median_and_tail() {
        let (mean, p50, p99) = summarize((1..=100).map(f64::from).collect());
        assert_eq!((mean, p50), (50.5, 51.0));
        assert_eq!(p99, 99.0);
    }
}
