//! `crypt`: a LUKS volume on the device below, seen decrypted from above.
//!
//! The supervisor opens the volume with the configured key file when the device starts and
//! hands the filter the master key as a descriptor (never in the spec or a log). The filter
//! reads the volume's header through the layers below when its domain starts, checks that the
//! key is the volume's (its digest) and that the layout is the one the device started with,
//! and then serves the volume's data area:
//! offsets move past the header, writes go below as `aes-xts-plain64` ciphertext from the
//! filter's scratch memory, a large one in chunks, reads are decrypted in place where they
//! landed. Write-zeroes is written as encrypted zeroes (the layers below cannot know what
//! ciphertext zeroes are); a discard passes on for its whole sectors.
//!
//! Requests must cover whole sectors of the volume (512 bytes, or what its LUKS2 header says);
//! others fail with `Invalid`.

use std::os::fd::OwnedFd;
use std::os::unix::fs::FileExt;

use bulkhead_block::{
    After, BlockError, Caps, Data, Layer, ReadBelow, Request, SharedSlice, SliceList, Sub, Tag, TagSpace, Verdict,
};
use bulkhead_block::{Outcome, SetupError};
use bulkhead_crypt::{MasterKey, SectorCipher, Volume};
use zeroize::Zeroizing;

use crate::state::StatePage;
use crate::FilterError;

/// Bytes encrypted and written below at a time, per request: the scratch memory of each tag.
const CHUNK: usize = 128 << 10;
/// Counters in the state page.
const OPENED: usize = 0;
const ENCRYPTED: usize = 1;
const DECRYPTED: usize = 2;

/// What the supervisor read from the volume's header when the device started.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    /// Where the data starts on the device below, bytes.
    pub payload_offset: u64,
    /// Bytes of data.
    pub data_size: u64,
    /// Bytes per sector.
    pub sector_size: u32,
}

/// The filter.
pub struct Crypt {
    layout: Layout,
    /// Until the volume is open.
    key: Option<MasterKey>,
    cipher: Option<SectorCipher>,
    iv_tweak: u64,
    /// Plaintext on its way to ciphertext and back; zeroed when dropped.
    work: Zeroizing<Vec<u8>>,
    /// Bytes of each tag's write sent below so far.
    done: Vec<u64>,
    page: StatePage,
}

impl std::fmt::Debug for Crypt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Crypt").field("layout", &self.layout).field("open", &self.cipher.is_some()).finish_non_exhaustive()
    }
}

/// Reads the master key the supervisor put in `secret` (a sealed memory file).
pub fn read_secret(secret: OwnedFd) -> Result<MasterKey, FilterError> {
    let f = std::fs::File::from(secret);
    let bad = |message: String| FilterError::Invalid { filter: "crypt", message };
    let len = f.metadata().map_err(|e| bad(format!("key: {e}")))?.len();
    if len != 32 && len != 64 {
        return Err(bad(format!("the key handed over is {len} bytes (32 or 64)")));
    }
    let mut key = Zeroizing::new(vec![0u8; len as usize]);
    f.read_exact_at(&mut key, 0).map_err(|e| bad(format!("key: {e}")))?;
    Ok(MasterKey::from_bytes(&key))
}

impl Crypt {
    /// A filter for the volume laid out as `layout`, with master key `key`.
    pub fn new(layout: Layout, key: MasterKey, page: StatePage) -> Self {
        Crypt {
            layout,
            key: Some(key),
            cipher: None,
            iv_tweak: 0,
            work: Zeroizing::new(vec![0u8; CHUNK]),
            done: Vec::new(),
            page,
        }
    }

    fn sector(&self) -> u64 {
        u64::from(self.layout.sector_size)
    }

    fn whole_sectors(&self, offset: u64, len: u64) -> bool {
        let s = self.sector();
        offset.is_multiple_of(s) && len.is_multiple_of(s) && offset.checked_add(len).is_some_and(|e| e <= self.layout.data_size)
    }

    /// The next chunk of a write or write-zeroes, `done` bytes in: encrypted into scratch.
    fn next_write(&mut self, req: &Request<'_>, scratch: SharedSlice<'_>, done: u64) -> Result<Option<Sub>, BlockError> {
        let (offset, len) = req.range();
        if done >= len {
            return Ok(None);
        }
        let n = (CHUNK as u64).min(len - done) as usize;
        let fua = match req {
            Request::Write { from: bufs, fua, .. } => {
                gather(bufs, done, &mut self.work[..n])?;
                *fua
            }
            Request::WriteZeroes { .. } => {
                self.work[..n].fill(0);
                false
            }
            Request::Read { .. } | Request::Flush | Request::Discard { .. } => return Ok(None),
        };
        let first = (offset + done) / self.sector() + self.iv_tweak;
        let cipher = self.cipher.as_ref().ok_or(BlockError::Invalid("crypt: the volume is not open"))?;
        cipher.encrypt(&mut self.work[..n], first);
        let window = scratch.sub(0, n).map_err(|_| BlockError::Invalid("crypt: scratch memory smaller than a chunk"))?;
        window.copy_from(&self.work[..n]).map_err(|_| BlockError::Invalid("crypt: scratch memory is read-only"))?;
        self.page.add(ENCRYPTED, n as u64);
        Ok(Some(Sub::Write {
            offset: self.layout.payload_offset + offset + done,
            from: Data::Scratch { at: 0, len: n as u64 },
            fua,
        }))
    }

    /// Decrypts a completed read where it landed.
    fn decrypt_in_place(&mut self, offset: u64, bufs: &SliceList<'_>) -> Result<(), BlockError> {
        let cipher = self.cipher.as_ref().ok_or(BlockError::Invalid("crypt: the volume is not open"))?;
        let len = bufs.total_len();
        let mut at = 0;
        while at < len {
            let n = (CHUNK as u64).min(len - at) as usize;
            gather(bufs, at, &mut self.work[..n])?;
            cipher.decrypt(&mut self.work[..n], (offset + at) / u64::from(self.layout.sector_size) + self.iv_tweak);
            let part = bufs.range(at, n as u64).ok_or(BlockError::Invalid("crypt: read buffers shorter than the read"))?;
            let mut from = 0;
            for w in part.iter() {
                w.copy_from(&self.work[from..from + w.len()])
                    .map_err(|_| BlockError::Invalid("crypt: read into read-only memory"))?;
                from += w.len();
            }
            at += n as u64;
        }
        self.page.add(DECRYPTED, len);
        Ok(())
    }
}

/// Copies `out.len()` bytes from `at` bytes into `bufs`.
fn gather(bufs: &SliceList<'_>, at: u64, out: &mut [u8]) -> Result<(), BlockError> {
    let part = bufs.range(at, out.len() as u64).ok_or(BlockError::Invalid("crypt: buffers shorter than the request"))?;
    let mut to = 0;
    for w in part.iter() {
        w.copy_to(&mut out[to..to + w.len()]);
        to += w.len();
    }
    Ok(())
}

const NOT_WHOLE: BlockError = BlockError::Invalid("crypt: requests must cover whole sectors of the volume");

impl Layer for Crypt {
    fn name(&self) -> &'static str {
        "crypt"
    }

    fn caps(&self, lower: Caps) -> Caps {
        // Write-zeroes becomes a loop of encrypted writes here: not efficient.
        Caps { write_zeroes: false, ..lower }
    }

    fn size(&self, lower: u64) -> u64 {
        let room = lower.saturating_sub(self.layout.payload_offset);
        self.layout.data_size.min(room) / self.sector() * self.sector()
    }

    fn scratch_bytes(&self) -> usize {
        CHUNK
    }

    fn open(&mut self, below: &mut dyn ReadBelow) -> Result<(), SetupError> {
        let size = below.size();
        let mut read = |at: u64, buf: &mut [u8]| below.read(at, buf).map_err(std::io::Error::other);
        let volume = Volume::read(&mut read).map_err(|e| SetupError::new(e.to_string()))?;
        let data_size = volume.data_size(size).map_err(|e| SetupError::new(e.to_string()))?;
        let now = Layout { payload_offset: volume.payload_offset, data_size, sector_size: volume.sector_size };
        if now.payload_offset != self.layout.payload_offset
            || now.sector_size != self.layout.sector_size
            || now.data_size < self.layout.data_size
        {
            return Err(SetupError::new(format!(
                "the LUKS header changed since the device started (data at {} in sectors of {} now, {} and {} then)",
                now.payload_offset, now.sector_size, self.layout.payload_offset, self.layout.sector_size
            )));
        }
        let key = self.key.take().ok_or_else(|| SetupError::new("the volume was opened already"))?;
        if !volume.check(key.bytes()) {
            return Err(SetupError::new(
                "the key handed over is not this volume's (its header changed since the device started?)",
            ));
        }
        self.cipher = Some(volume.cipher(&key).map_err(|e| SetupError::new(e.to_string()))?);
        self.iv_tweak = volume.iv_tweak;
        self.page.add(OPENED, 1);
        Ok(())
    }

    fn attach(&mut self, tags: TagSpace) {
        self.done = vec![0; tags.capacity()];
    }

    fn submit(&mut self, tag: Tag, req: &Request<'_>, scratch: SharedSlice<'_>, _: u64) -> Verdict {
        self.done[tag.index()] = 0;
        let (offset, len) = req.range();
        match req {
            Request::Read { .. } => {
                if !self.whole_sectors(offset, len) {
                    return Verdict::Complete(Err(NOT_WHOLE));
                }
                Verdict::Send(Sub::Read { offset: self.layout.payload_offset + offset, into: Data::Handed { at: 0, len } })
            }
            Request::Write { .. } | Request::WriteZeroes { .. } => {
                if !self.whole_sectors(offset, len) {
                    return Verdict::Complete(Err(NOT_WHOLE));
                }
                match self.next_write(req, scratch, 0) {
                    Ok(Some(sub)) => Verdict::Send(sub),
                    Ok(None) => Verdict::Complete(Ok(req.transfer_len())),
                    Err(e) => Verdict::Complete(Err(e)),
                }
            }
            Request::Discard { .. } => {
                // Only whole sectors are freed; a part of one stays as it is.
                let s = self.sector();
                let (start, end) = (offset.div_ceil(s) * s, (offset + len) / s * s);
                if end <= start || offset + len > self.layout.data_size {
                    return Verdict::Complete(if offset + len > self.layout.data_size { Err(NOT_WHOLE) } else { Ok(0) });
                }
                Verdict::Send(Sub::Discard { offset: self.layout.payload_offset + start, len: end - start })
            }
            Request::Flush => Verdict::Forward,
        }
    }

    fn complete(&mut self, tag: Tag, req: &Request<'_>, scratch: SharedSlice<'_>, result: &mut Outcome, _: u64) -> After {
        match req {
            Request::Read { offset, into: bufs } => {
                if result.is_ok() {
                    if let Err(e) = self.decrypt_in_place(*offset, bufs) {
                        *result = Err(e);
                    }
                }
                After::Up
            }
            Request::Write { .. } | Request::WriteZeroes { .. } => {
                let Ok(n) = *result else { return After::Up };
                let (_, len) = req.range();
                // A write's result is what it moved; a write-zeroes below answers 0, but here
                // each chunk is a write of its length.
                let sent = (CHUNK as u64).min(len - self.done[tag.index()].min(len));
                if n != sent {
                    *result = Err(BlockError::Short { op: "write", offset: req.range().0, done: n, want: sent });
                    return After::Up;
                }
                let done = self.done[tag.index()] + n;
                self.done[tag.index()] = done;
                match self.next_write(req, scratch, done) {
                    Ok(Some(sub)) => After::Send(sub),
                    Ok(None) => {
                        *result = Ok(req.transfer_len());
                        After::Up
                    }
                    Err(e) => {
                        *result = Err(e);
                        After::Up
                    }
                }
            }
            Request::Discard { .. } | Request::Flush => {
                if result.is_ok() {
                    *result = Ok(0);
                }
                After::Up
            }
        }
    }

    fn poll(&mut self, _: u64, _: &mut dyn FnMut(Tag, Verdict)) -> Option<u64> {
        None
    }
}

/// The counters of a crypt filter: times opened, bytes encrypted, bytes decrypted.
pub fn read(page: &StatePage) -> (u64, u64, u64) {
    (page.get(OPENED), page.get(ENCRYPTED), page.get(DECRYPTED))
}
