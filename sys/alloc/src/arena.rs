//! A huge-page arena for a model's weights.
//!
//! The CPU kernels stream every weight once per forward pass: ~100 MB for a 135M-parameter
//! model, in matrices of 70 KB–30 MB, each its own heap allocation in 4 KiB pages. Those are
//! ~25,000 pages per pass, more than the data TLB holds (our reading of the gain below: this
//! machine has no hardware counters to show the page walks). One mapping for all of a model's matrices, advised `MADV_HUGEPAGE` and
//! aligned to 2 MiB, lets the kernel back it with 2 MiB pages where transparent huge pages are
//! enabled (`always`, or `madvise` as on most Linux distributions; Android kernels mostly
//! disable them, and then this is an ordinary anonymous mapping). Measured on the host
//! (SmolLM2-135M Q4_1, 2 threads, six alternated pairs of processes): a batch of 8 decode
//! steps 3–16% faster, one sequence 0–6%; the same peak RSS once the loader trims the heap it
//! freed while parsing the file (`Model::load`).
//!
//! The arena is a bump allocator: [`HugeArena::alloc`] hands out disjoint buffers, each
//! holding the mapping alive; it is unmapped when the arena and every buffer are dropped (a
//! model's eviction). Untouched pages of the reservation cost no memory.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// The alignment of the arena's start (a transparent huge page on x86-64 and arm64 with
/// 4 KiB base pages).
const HUGE_PAGE: usize = 2 << 20;
/// The alignment of every buffer: a page (more than the kernels' 64-byte loads need), so that
/// a device that shares the host's memory can use a buffer in place (OpenCL runtimes want a
/// buffer over host memory to start on their `CL_DEVICE_MEM_BASE_ADDR_ALIGN`). A model's
/// few hundred matrices waste under 2 KiB each on average.
pub const BUF_ALIGN: usize = 4096;

struct Region {
    /// Owns the mapping; only `base` is used to reach it.
    _map: memmap2::MmapMut,
    /// The first byte of the 2 MiB-aligned usable range, inside `_map`.
    base: *mut u8,
    capacity: usize,
    next: AtomicUsize,
    /// Whether the kernel accepted `MADV_HUGEPAGE` for the range.
    advised: bool,
}

// SAFETY: `base` points into `_map`, which the region owns and which is itself Send and Sync;
// every byte of it is reached only through the one `ArenaBuf` that was handed its range.
unsafe impl Send for Region {}
// SAFETY: as above; the only shared mutable state is the atomic `next`.
unsafe impl Sync for Region {}

/// A reserved range of address space for weights (see the module docs).
#[derive(Clone)]
pub struct HugeArena {
    region: Arc<Region>,
}

/// One buffer of a [`HugeArena`], zero-filled at first; its bytes are its own.
pub struct ArenaBuf {
    region: Arc<Region>,
    offset: usize,
    len: usize,
}

impl HugeArena {
    /// Reserves `capacity` bytes (rounded up to whole huge pages) and asks for huge pages.
    /// Fails only if the address space cannot be reserved; whether huge pages back it is up
    /// to the kernel ([`Self::huge_pages_advised`] says whether it accepted the advice).
    pub fn new(capacity: usize) -> std::io::Result<Self> {
        let too_big = || std::io::Error::new(std::io::ErrorKind::InvalidInput, "arena size overflows");
        let capacity = capacity.max(1).div_ceil(HUGE_PAGE).checked_mul(HUGE_PAGE).ok_or_else(too_big)?;
        let len = capacity.checked_add(HUGE_PAGE).ok_or_else(too_big)?;
        let mut map = memmap2::MmapOptions::new().len(len).map_anon()?;
        let start = map.as_ptr() as usize;
        let skip = start.next_multiple_of(HUGE_PAGE) - start;
        // SAFETY: `skip < HUGE_PAGE` and the mapping is `capacity + HUGE_PAGE` long, so
        // `base .. base + capacity` lies inside it. The mapping does not move when `map`
        // moves into the region below (only the handle does).
        let base = unsafe { map.as_mut_ptr().add(skip) };
        let advised = advise_huge(base, capacity);
        Ok(Self { region: Arc::new(Region { _map: map, base, capacity, next: AtomicUsize::new(0), advised }) })
    }

    /// A buffer of `len` bytes, or None when the arena has too little left.
    pub fn alloc(&self, len: usize) -> Option<ArenaBuf> {
        let r = &self.region;
        let size = len.checked_next_multiple_of(BUF_ALIGN)?; // Self::footprint, checked
        let mut at = r.next.load(Ordering::Relaxed);
        loop {
            let end = at.checked_add(size).filter(|&e| e <= r.capacity)?;
            match r.next.compare_exchange_weak(at, end, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => return Some(ArenaBuf { region: r.clone(), offset: at, len }),
                Err(now) => at = now,
            }
        }
    }

    /// The arena bytes a buffer of `len` takes (its length rounded up to [`BUF_ALIGN`]): what
    /// a caller sizing an arena for several buffers adds up.
    pub fn footprint(len: usize) -> usize {
        len.next_multiple_of(BUF_ALIGN)
    }

    /// Bytes handed out so far (with alignment padding).
    pub fn used(&self) -> usize {
        self.region.next.load(Ordering::Relaxed)
    }

    /// Bytes reserved.
    pub fn capacity(&self) -> usize {
        self.region.capacity
    }

    /// Whether the kernel accepted `MADV_HUGEPAGE` for the arena (false where it has no
    /// transparent huge pages, or off Linux and Android).
    pub fn huge_pages_advised(&self) -> bool {
        self.region.advised
    }
}

impl std::ops::Deref for ArenaBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `offset .. offset + len` lies inside the region (checked in `alloc`) and
        // was handed to this buffer alone; the region lives while `self.region` does; `&self`
        // excludes a concurrent `&mut` through this buffer.
        unsafe { std::slice::from_raw_parts(self.region.base.add(self.offset), self.len) }
    }
}

impl std::ops::DerefMut for ArenaBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as `deref`; `&mut self` makes this the only reference to the range.
        unsafe { std::slice::from_raw_parts_mut(self.region.base.add(self.offset), self.len) }
    }
}

#[cfg(any(target_os = "linux", target_os = "android"))]
fn advise_huge(base: *mut u8, len: usize) -> bool {
    /// `MADV_HUGEPAGE`, the same value in every Linux architecture's headers.
    const MADV_HUGEPAGE: i32 = 14;
    extern "C" {
        fn madvise(addr: *mut std::ffi::c_void, len: usize, advice: i32) -> i32;
    }
    // SAFETY: `base .. base + len` is a page-aligned range of a live anonymous mapping (the
    // caller's region); the advice changes only how the kernel backs it, not its contents.
    unsafe { madvise(base.cast(), len, MADV_HUGEPAGE) == 0 }
}

#[cfg(not(any(target_os = "linux", target_os = "android")))]
fn advise_huge(_base: *mut u8, _len: usize) -> bool {
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_disjoint_aligned_zeroed_and_outlive_the_arena() {
        let arena = HugeArena::new(3 * HUGE_PAGE + 5).expect("reserve");
        assert_eq!(arena.capacity(), 4 * HUGE_PAGE);
        assert_eq!(arena.region.base as usize % HUGE_PAGE, 0);
        let mut bufs: Vec<ArenaBuf> = (0..100).map(|i| arena.alloc(1000 + 37 * i).expect("room")).collect();
        for (i, b) in bufs.iter_mut().enumerate() {
            assert_eq!(b.len(), 1000 + 37 * i);
            assert_eq!(b.as_ptr() as usize % BUF_ALIGN, 0);
            assert!(b.iter().all(|&x| x == 0));
            b.fill(i as u8);
        }
        drop(arena);
        for (i, b) in bufs.iter().enumerate() {
            assert!(b.iter().all(|&x| x == i as u8), "buffer {i} was overwritten");
        }
    }

    #[test]
    fn the_kernel_takes_the_advice_where_it_has_transparent_huge_pages() {
        let arena = HugeArena::new(HUGE_PAGE).expect("reserve");
        // The file exists exactly when the kernel was built with transparent huge pages, and
        // then MADV_HUGEPAGE succeeds whatever the mode (`never` included).
        let thp = std::path::Path::new("/sys/kernel/mm/transparent_hugepage/enabled").exists();
        assert_eq!(arena.huge_pages_advised(), thp && cfg!(any(target_os = "linux", target_os = "android")));
    }

    #[test]
    fn an_impossible_size_is_an_error() {
        for n in [usize::MAX, usize::MAX - HUGE_PAGE, usize::MAX / 2 + 1] {
            assert!(HugeArena::new(n).is_err(), "{n}");
        }
    }

    #[test]
    fn a_full_arena_says_so_and_threads_get_distinct_buffers() {
        let arena = HugeArena::new(HUGE_PAGE).expect("reserve");
        assert!(arena.alloc(HUGE_PAGE + 1).is_none());
        assert!(arena.alloc(usize::MAX).is_none());
        let per = HUGE_PAGE / 64;
        let got: Vec<Vec<usize>> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..4)
                .map(|_| s.spawn(|| (0..16).map(|_| arena.alloc(per - 10).expect("room").as_ptr() as usize).collect()))
                .collect();
            hs.into_iter().map(|h| h.join().expect("thread")).collect()
        });
        let mut all: Vec<usize> = got.into_iter().flatten().collect();
        all.sort_unstable();
        all.dedup();
        assert_eq!(all.len(), 64);
        assert_eq!(arena.used(), HUGE_PAGE);
        assert!(arena.alloc(1).is_none());
    }
}
