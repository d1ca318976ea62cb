//! A LUKS1 or LUKS2 volume's header and key slots as the supervisor reads them from the
//! device before a `crypt` filter starts: never a panic, and unlocking with a passphrase reads
//! only within the device. Key derivation is bounded so each input runs in milliseconds.
#![no_main]

use bulkhead_crypt::Volume;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let size = data.len() as u64;
    let mut read = |at: u64, buf: &mut [u8]| -> std::io::Result<()> {
        let past = || std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "past the end");
        let end = at.checked_add(buf.len() as u64).filter(|&e| e <= size).ok_or_else(past)?;
        buf.copy_from_slice(&data[at as usize..end as usize]);
        Ok(())
    };
    let Ok(volume) = Volume::read(&mut read) else { return };
    let _ = volume.data_size(size);
    if volume.kdf_work() <= 1 << 14 {
        let _ = volume.unlock(b"fuzz", &mut read);
    }
});
