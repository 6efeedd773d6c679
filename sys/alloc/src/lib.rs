//! The daemon frees a whole model when it evicts one, but the C allocator keeps freed small
//! allocations (a tokenizer's vocabulary, scratch) in its arenas, so the process's resident size
//! would stay at its peak. [`release_free_memory`] asks the allocator to give free pages back:
//! glibc's `malloc_trim(0)` (returns free pages inside arenas with `madvise`), bionic's
//! `mallopt(M_PURGE, 0)` on Android. Elsewhere it does nothing.
//!
//! Call it after freeing a lot at once, from a quiet point: it walks every arena under its lock.
//!
//! [`HugeArena`] is one anonymous mapping for a model's repacked weights, advised for
//! transparent huge pages, from which each matrix takes its own disjoint buffer.
//!
//! [`map_readonly`] maps a model file (the one `unsafe` call the engine needs for it).
//!
//! [`request_tile_data`] asks the kernel for the AMX tile state the x86 prompt kernels use.
//!
//! [`limit_process`] bounds a child process's memory and CPU (the chat-template sandbox).

mod arena;
mod sigbus;
pub use arena::{ArenaBuf, HugeArena, BUF_ALIGN};
pub use sigbus::{guard_map, MapGuard};

/// Returns free allocator memory to the OS; true if the allocator says it released some.
pub fn release_free_memory() -> bool {
    imp::release()
}

/// Limits this process to `address_space` bytes of virtual memory and `cpu_seconds` of CPU
/// (`setrlimit` `RLIMIT_AS` and `RLIMIT_CPU`, soft and hard alike, so they cannot be raised
/// again). Past the first, allocations fail (Rust aborts the process); past the second, the
/// kernel kills it. For a child process that runs untrusted work (a model file's chat template).
pub fn limit_process(address_space: u64, cpu_seconds: u64) -> std::io::Result<()> {
    for (resource, value) in [(libc::RLIMIT_AS, address_space), (libc::RLIMIT_CPU, cpu_seconds)] {
        // A value past rlim_t (32-bit targets) is the largest finite limit, never "unlimited".
        let v = libc::rlim_t::try_from(value).unwrap_or(libc::RLIM_INFINITY - 1);
        let lim = libc::rlimit { rlim_cur: v, rlim_max: v };
        // SAFETY: `lim` is a valid, initialised rlimit that outlives the call; setrlimit only
        // reads it.
        if unsafe { libc::setrlimit(resource, &lim) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Whether a large block was freed since the last [`release_if_freed`].
static FREED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Notes that a large block (a session's KV cache) was freed, on whatever thread freed it, so
/// that the next [`release_if_freed`] gives the allocator's free pages back: the allocator keeps
/// them for reuse, and a client's closed sessions otherwise stay resident (88 MB after a
/// 30-second soak of 8 clients).
pub fn note_freed() {
    FREED.store(true, std::sync::atomic::Ordering::Release);
}

/// [`release_free_memory`] if [`note_freed`] was called since the last call; true if it ran.
/// Called where a pause is harmless (the scheduler's worker when it has nothing to run).
pub fn release_if_freed() -> bool {
    FREED.swap(false, std::sync::atomic::Ordering::AcqRel) && {
        release_free_memory();
        true
    }
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
mod imp {
    extern "C" {
        fn malloc_trim(pad: usize) -> i32;
    }
    pub fn release() -> bool {
        // SAFETY: malloc_trim is a glibc function with no preconditions; pad 0 means "keep no
        // extra free space". It only returns free pages and touches no live allocation.
        unsafe { malloc_trim(0) != 0 }
    }
}

#[cfg(target_os = "android")]
mod imp {
    /// bionic's `M_PURGE`: release as much free memory as possible.
    const M_PURGE: i32 = -101;
    extern "C" {
        fn mallopt(param: i32, value: i32) -> i32;
    }
    pub fn release() -> bool {
        // SAFETY: mallopt with M_PURGE has no preconditions and only returns free pages.
        unsafe { mallopt(M_PURGE, 0) == 1 }
    }
}

#[cfg(not(any(all(target_os = "linux", target_env = "gnu"), target_os = "android")))]
mod imp {
    pub fn release() -> bool {
        false
    }
}

/// Maps a model file read-only into this process.
pub fn map_readonly(file: &std::fs::File) -> std::io::Result<memmap2::Mmap> {
    // SAFETY: the map is read-only and private to this process. Model files are installed by
    // the system and are not modified while in use; if one were truncated underneath us, reads
    // would fault (SIGBUS) rather than return wrong data — the same contract as llama.cpp's
    // mmap loader. The caller keeps the map no longer than it keeps `file` open.
    unsafe { memmap2::Mmap::map(file) }
}

/// Drops this process's resident pages of `range` of a read-only file map: the whole pages
/// inside the range only, so bytes of the map next to it stay resident. Touched again, the
/// pages are read back from the file (the page cache), with the same contents.
pub fn release_mapped_pages(map: &memmap2::Mmap, range: std::ops::Range<usize>) {
    let page = 4096usize;
    let base = map.as_ptr() as usize;
    let first = (base + range.start).next_multiple_of(page) - base;
    let end = ((base + range.end.min(map.len())) / page * page).saturating_sub(base);
    if end > first {
        // SAFETY: `MADV_DONTNEED` on a private, read-only file map only drops page-table
        // entries: the next access faults the same bytes back in from the file, so no
        // reference into the map ever sees different contents (the file is not written while
        // mapped: see `map_readonly`). The range lies inside the map (checked above).
        let _ = unsafe { map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, first, end - first) };
    }
}

/// Asks Linux for this process's permission to use AMX tile data
/// (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`), which it must hold before any thread
/// runs a tile instruction (without it the first one is killed with SIGILL). Granted once for
/// the whole process; asking again is harmless. True if granted; false where refused (an old
/// kernel, a CPU without AMX, a thread whose alternate signal stack is too small for the tile
/// state) and on every other platform.
pub fn request_tile_data() -> bool {
    #[cfg(all(any(target_os = "linux", target_os = "android"), target_arch = "x86_64"))]
    {
        const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
        const XFEATURE_XTILEDATA: libc::c_long = 18;
        // SAFETY: this `arch_prctl` only records a permission in the kernel's view of the
        // process (it reads and writes no memory of ours); failure is reported by the result.
        unsafe { libc::syscall(libc::SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 }
    }
    #[cfg(not(all(any(target_os = "linux", target_os = "android"), target_arch = "x86_64")))]
    false
}

#[cfg(test)]
mod tests {
    #[test]
    fn freed_heap_goes_back_to_the_os() {
        let rss = || {
            std::fs::read_to_string("/proc/self/status")
                .ok()
                .and_then(|s| {
                    s.lines()
                        .find(|l| l.starts_with("VmRSS:"))
                        .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
                })
                .unwrap_or(0)
        };
        // Many small allocations (below the mmap threshold), freed out of order so the heap's
        // top stays in use: only a trim can return the middle.
        let mut v: Vec<Vec<u8>> = (0..200_000).map(|i| vec![(i % 251) as u8; 512]).collect();
        let keep = v.pop();
        let before = rss();
        for (i, x) in v.iter_mut().enumerate() {
            if i % 64 != 0 {
                *x = Vec::new();
            }
        }
        let freed = rss();
        let released = super::release_free_memory();
        let after = rss();
        eprintln!("RSS KB: {before} allocated, {freed} after free, {after} after release ({released})");
        if cfg!(all(target_os = "linux", target_env = "gnu")) {
            assert!(after + 20_000 < freed, "release gave back less than 20 MB");
        }
        drop(keep);
    }
}
