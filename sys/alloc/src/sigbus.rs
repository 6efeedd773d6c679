//! A guard for mapped model files that shrink under us. Reading a page of a file map past the
//! file's end raises SIGBUS, which kills the process: a model file truncated while the daemon
//! runs (a careless copy over it, a full disk during an update) would take every app's session
//! down with it. [`guard_map`] registers a map's address range; on SIGBUS inside a registered
//! range the handler puts a page of zeros where the lost page was (so the faulting read goes
//! on, with zeros) and marks the range faulted. Whoever computed with those bytes checks
//! [`MapGuard::faulted`] after the work and throws the result away with an error; a SIGBUS
//! anywhere else goes on to the previous handler (Rust's own stack-overflow check) or the
//! default action, as before.
//!
//! The handler only reads a fixed table of atomics and calls `mmap`, both async-signal-safe.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::OnceLock;

/// Maps guarded at once (models a daemon keeps mapped; more are simply unguarded).
const SLOTS: usize = 64;

struct Slot {
    start: AtomicUsize,
    end: AtomicUsize,
    faulted: AtomicBool,
}

#[allow(clippy::declare_interior_mutable_const)]
const EMPTY: Slot = Slot { start: AtomicUsize::new(0), end: AtomicUsize::new(0), faulted: AtomicBool::new(false) };
static TABLE: [Slot; SLOTS] = [EMPTY; SLOTS];
static PAGE: AtomicUsize = AtomicUsize::new(4096);
static PREVIOUS: OnceLock<Option<libc::sigaction>> = OnceLock::new();

/// A registered map; unregistered when dropped (drop it before the map is unmapped).
pub struct MapGuard {
    slot: usize,
}

impl MapGuard {
    /// Whether a page of the map was lost (the file shrank) and read as zeros since
    /// registration.
    pub fn faulted(&self) -> bool {
        TABLE[self.slot].faulted.load(Ordering::Acquire)
    }
}

impl Drop for MapGuard {
    fn drop(&mut self) {
        let s = &TABLE[self.slot];
        s.end.store(0, Ordering::Release);
        s.faulted.store(false, Ordering::Release);
        s.start.store(0, Ordering::Release);
    }
}

/// Registers `[start, start + len)` (a file map) with the SIGBUS guard, installing the handler
/// on first use. None if every slot is taken or the handler could not be installed (then the
/// map is unguarded, as any map is without this).
pub fn guard_map(start: *const u8, len: usize) -> Option<MapGuard> {
    if !install() || len == 0 {
        return None;
    }
    let (a, b) = (start as usize, (start as usize).checked_add(len)?);
    for (i, s) in TABLE.iter().enumerate() {
        if s.start.compare_exchange(0, a, Ordering::AcqRel, Ordering::Acquire).is_ok() {
            s.faulted.store(false, Ordering::Release);
            s.end.store(b, Ordering::Release);
            return Some(MapGuard { slot: i });
        }
    }
    None
}

fn install() -> bool {
    PREVIOUS
        .get_or_init(|| {
            // SAFETY: sysconf has no preconditions.
            let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
            if page > 0 {
                PAGE.store(page as usize, Ordering::Relaxed);
            }
            // SAFETY: a zeroed `sigaction` is a valid value to fill in; `handler` has the
            // SA_SIGINFO signature; `old` receives the action in place before ours.
            unsafe {
                let mut act: libc::sigaction = std::mem::zeroed();
                act.sa_sigaction = handler as *const () as usize;
                act.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK | libc::SA_NODEFER;
                libc::sigemptyset(&mut act.sa_mask);
                let mut old: libc::sigaction = std::mem::zeroed();
                (libc::sigaction(libc::SIGBUS, &act, &mut old) == 0).then_some(old)
            }
        })
        .is_some()
}

extern "C" fn handler(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo for a SIGBUS delivered with SA_SIGINFO.
    let addr = unsafe { (*info).si_addr() } as usize;
    let page = PAGE.load(Ordering::Relaxed);
    for s in TABLE.iter() {
        let (a, b) = (s.start.load(Ordering::Acquire), s.end.load(Ordering::Acquire));
        if a != 0 && addr >= a && addr < b {
            let at = addr & !(page - 1);
            // SAFETY: `at` is the page of a registered, still-mapped file map (a guard is
            // dropped before its map is unmapped); MAP_FIXED replaces just that page of it with
            // private zeros, which every reader of the map may see (they are told by `faulted`).
            let p = unsafe {
                libc::mmap(
                    at as *mut libc::c_void,
                    page,
                    libc::PROT_READ,
                    libc::MAP_FIXED | libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                )
            };
            if p != libc::MAP_FAILED {
                s.faulted.store(true, Ordering::Release);
                return;
            }
        }
    }
    // Not ours: the previous handler, or the default action (the faulting access runs again
    // and the signal kills the process, as without the guard).
    match PREVIOUS.get().copied().flatten() {
        Some(prev) if prev.sa_sigaction != libc::SIG_DFL && prev.sa_sigaction != libc::SIG_IGN => {
            // SAFETY: `prev` is the action installed before ours, called as it was registered
            // (with siginfo when it asked for it).
            unsafe {
                if prev.sa_flags & libc::SA_SIGINFO != 0 {
                    let f: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) =
                        std::mem::transmute(prev.sa_sigaction);
                    f(sig, info, ctx);
                } else {
                    let f: extern "C" fn(libc::c_int) = std::mem::transmute(prev.sa_sigaction);
                    f(sig);
                }
            }
        }
        _ => {
            // SAFETY: restoring the default action for SIGBUS has no preconditions.
            unsafe {
                let mut dfl: libc::sigaction = std::mem::zeroed();
                dfl.sa_sigaction = libc::SIG_DFL;
                libc::sigaction(libc::SIGBUS, &dfl, std::ptr::null_mut());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn a_page_lost_to_truncation_reads_as_zeros_and_is_reported() {
        let path = std::env::temp_dir().join(format!("llmd-sigbus-{}", std::process::id()));
        let page = PAGE.load(Ordering::Relaxed).max(4096) * 4;
        let mut f = std::fs::File::create(&path).expect("create");
        f.write_all(&vec![7u8; 3 * page]).expect("write");
        drop(f);
        let file = std::fs::File::open(&path).expect("open");
        let map = crate::map_readonly(&file).expect("map");
        let guard = guard_map(map.as_ptr(), map.len()).expect("a slot");
        assert_eq!(map[2 * page + 5], 7);
        assert!(!guard.faulted());
        std::fs::OpenOptions::new().write(true).open(&path).expect("open").set_len(page as u64).expect("truncate");
        // The first page is still there; the third is gone: zeros, and reported.
        assert_eq!(std::hint::black_box(&map[..])[5], 7);
        assert_eq!(std::hint::black_box(&map[..])[2 * page + 5], 0);
        assert!(guard.faulted());
        drop(guard);
        drop(map);
        let _ = std::fs::remove_file(&path);
    }
}
