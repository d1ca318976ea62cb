//! x86 memory protection keys: each page carries one of 16 keys, and each thread's PKRU
//! register says, per key, whether that thread may read and write pages with it. Changing
//! PKRU is one unprivileged instruction (no system call, no TLB work), so a thread can take
//! away its own right to write a whole partition of memory around a call and give it back
//! after, for a few nanoseconds each way.
//!
//! Caveats the kernel documents (`Documentation/core-api/protection-keys.rst`):
//! `pkey_alloc` sets the new key's rights in the calling thread's PKRU only. Threads started
//! earlier keep the default, which denies access to every key but 0; threads started later
//! copy their creator's PKRU. Signal handlers run with the default PKRU too, and the
//! interrupted thread's PKRU comes back at `sigreturn`. The kernel's own accesses to user
//! memory (a `read` into a buffer) obey the calling thread's PKRU.

use std::io;

/// Keys a process may hold; key 0 is every page's default.
pub const KEYS: u32 = 16;

/// Whether the processor has protection keys and the kernel turned them on (CPUID leaf 7:
/// PKU and OSPKE).
pub fn supported() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        // Leaf 7 exists on any processor with protection keys; on others its bits read as
        // absent.
        let r = std::arch::x86_64::__cpuid_count(7, 0);
        r.ecx & (1 << 3) != 0 && r.ecx & (1 << 4) != 0
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// `pkey_alloc(2)`: a fresh key, which the calling thread may read and write.
pub fn alloc() -> io::Result<u32> {
    // SAFETY: a system call with integer arguments only.
    let k = unsafe { libc::syscall(libc::SYS_pkey_alloc, 0, 0) };
    if k < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(k as u32)
}

/// `pkey_free(2)`.
pub fn free(key: u32) -> io::Result<()> {
    // SAFETY: a system call with integer arguments only.
    if unsafe { libc::syscall(libc::SYS_pkey_free, key as libc::c_int) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// `pkey_mprotect(2)` with `PROT_READ | PROT_WRITE`: gives the pages of `[start, start +
/// len)` key `key`. The range must be mapped read-write and page-aligned; its contents are
/// not touched.
pub fn assign(start: u64, len: u64, key: u32) -> io::Result<()> {
    // SAFETY: changes only the key (the protection stays read-write) of pages the caller
    // says are its own and mapped read-write; no memory is made inaccessible to this thread,
    // whose PKRU allows `key` (it allocated it).
    let r = unsafe {
        libc::syscall(
            libc::SYS_pkey_mprotect,
            start as usize,
            len as usize,
            libc::PROT_READ | libc::PROT_WRITE,
            key as libc::c_int,
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The PKRU bit that denies writes to pages with `key`.
pub const fn write_disable(key: u32) -> u32 {
    2 << (2 * key)
}

/// The PKRU bit that denies any access to pages with `key`.
pub const fn access_disable(key: u32) -> u32 {
    1 << (2 * key)
}

/// The calling thread's PKRU. Only where [`supported`] holds.
#[inline]
pub fn read() -> u32 {
    #[cfg(target_arch = "x86_64")]
    {
        let pkru: u32;
        // SAFETY: RDPKRU (with ECX = 0) reads the thread's PKRU into EAX and zeroes EDX; it
        // touches no memory. The callers run it only where `supported()` holds.
        unsafe {
            std::arch::asm!("rdpkru", in("ecx") 0u32, out("eax") pkru, out("edx") _, options(nomem, nostack, preserves_flags));
        }
        pkru
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        0
    }
}

/// Sets the calling thread's PKRU. Only where [`supported`] holds.
#[inline]
pub fn write(pkru: u32) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: WRPKRU (with ECX = EDX = 0) sets the thread's rights per key; it changes no
    // memory. Memory the thread loses the right to touch is the caller's business, which is
    // why this is the point of the module: the next access faults rather than corrupting.
    // Not `nomem`: accesses must not be moved across it.
    unsafe {
        std::arch::asm!("wrpkru", in("eax") pkru, in("ecx") 0u32, in("edx") 0u32, options(nostack, preserves_flags));
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = pkru;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bits_per_key() {
        assert_eq!(access_disable(0), 1);
        assert_eq!(write_disable(0), 2);
        assert_eq!(write_disable(1), 8);
        assert_eq!(access_disable(15) | write_disable(15), 0xC000_0000);
    }

    #[test]
    fn a_key_allocated_here_is_writable_here() {
        if !supported() {
            return;
        }
        let k = alloc().expect("pkey_alloc");
        assert!(k > 0 && k < KEYS);
        assert_eq!(read() & (access_disable(k) | write_disable(k)), 0);
        let old = read();
        write(old | write_disable(k));
        assert_ne!(read() & write_disable(k), 0);
        write(old);
        assert_eq!(read(), old);
        free(k).expect("pkey_free");
    }
}
