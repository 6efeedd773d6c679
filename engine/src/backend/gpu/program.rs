//! The kernels' program: built from the embedded source once per device, then loaded from a
//! cached program binary. The cache key is a hash of everything the binary depends on — the
//! platform and its version, the device, the driver version, the source and the build
//! options — so a new driver or a changed kernel makes a new entry. A cache file carries its
//! own length and CRC-32: a truncated or corrupt file, or one the driver refuses, is rebuilt
//! from source and replaced, never handed to the driver unchecked.

use opencl_rt_sys::{ClError, Context, DeviceInfo, Program};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

/// The kernels' source, embedded at build time.
pub const SOURCE: &str = include_str!("kernels/llmd.cl");

const MAGIC: &[u8; 8] = b"LLMDCLB1";

/// Where the program came from, and how long that took.
#[derive(Clone, Debug, PartialEq)]
pub enum Origin {
    /// Compiled from source (no cache, a cache miss, or a cache file that was refused: why).
    Built { seconds: f64, cache_refused: Option<String> },
    /// Loaded from the cache file.
    Cached { seconds: f64 },
}

impl std::fmt::Display for Origin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Built { seconds, cache_refused: None } => write!(f, "built from source in {seconds:.2} s"),
            Self::Built { seconds, cache_refused: Some(why) } => {
                write!(f, "built from source in {seconds:.2} s (the cached binary was refused: {why})")
            }
            Self::Cached { seconds } => write!(f, "loaded from the program cache in {seconds:.3} s"),
        }
    }
}

/// FNV-1a, 64-bit: a stable hash for the cache key (std's hasher may change between releases).
fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for p in parts {
        for &b in p.iter().chain(&[0xffu8]) {
            h ^= b as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}

/// The cache file for this device, driver, source and options.
pub fn cache_path(dir: &Path, dev: &DeviceInfo, options: &str) -> PathBuf {
    let key = fnv1a(&[
        dev.platform.as_bytes(),
        dev.platform_version.as_bytes(),
        dev.name.as_bytes(),
        dev.vendor.as_bytes(),
        dev.version.as_bytes(),
        dev.driver_version.as_bytes(),
        SOURCE.as_bytes(),
        options.as_bytes(),
    ]);
    dir.join(format!("llmd-kernels-{key:016x}.bin"))
}

/// The binary in a cache file, if the file is whole.
fn read_cached(path: &Path) -> Result<Vec<u8>, String> {
    let b = std::fs::read(path).map_err(|e| e.to_string())?;
    if b.len() < 20 || &b[..8] != MAGIC {
        return Err("not an llmd program cache file".into());
    }
    let len = u64::from_le_bytes(b[8..16].try_into().unwrap_or_default()) as usize;
    let crc = u32::from_le_bytes(b[16..20].try_into().unwrap_or_default());
    let body = &b[20..];
    if body.len() != len {
        return Err(format!("truncated: {} of {len} bytes", body.len()));
    }
    if crc32fast::hash(body) != crc {
        return Err("corrupt: CRC-32 mismatch".into());
    }
    Ok(body.to_vec())
}

fn write_cached(path: &Path, bin: &[u8]) -> std::io::Result<()> {
    if let Some(d) = path.parent() {
        std::fs::create_dir_all(d)?;
    }
    let mut out = Vec::with_capacity(bin.len() + 20);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&(bin.len() as u64).to_le_bytes());
    out.extend_from_slice(&crc32fast::hash(bin).to_le_bytes());
    out.extend_from_slice(bin);
    // Unique per writer: two devices of one process (the NPU thread's for HeteroLLM's pieces,
    // the GPU thread's) may store the same program at once.
    static WRITES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = WRITES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = path.with_extension(format!("tmp{}.{n}", std::process::id()));
    std::fs::write(&tmp, &out)?;
    std::fs::rename(&tmp, path)
}

/// The program for `ctx`'s device: from `cache` when it holds a good binary, else built (and
/// stored there, when a cache folder is given).
pub fn load(
    ctx: &Arc<Context>,
    dev: &DeviceInfo,
    options: &str,
    cache: Option<&Path>,
) -> Result<(Program, Origin), ClError> {
    let t = Instant::now();
    let path = cache.map(|d| cache_path(d, dev, options));
    let mut refused = None;
    if let Some(p) = &path {
        if p.exists() {
            match read_cached(p).and_then(|bin| ctx.program_from_binary(&bin, options).map_err(|e| e.to_string())) {
                Ok(prog) => return Ok((prog, Origin::Cached { seconds: t.elapsed().as_secs_f64() })),
                Err(why) => {
                    tracing::warn!(path = %p.display(), %why, "OpenCL program cache file refused; rebuilding");
                    refused = Some(why);
                }
            }
        }
    }
    let prog = ctx.program_from_source(SOURCE, options)?;
    let seconds = t.elapsed().as_secs_f64();
    if let Some(p) = &path {
        match prog.binary() {
            Ok(bin) if !bin.is_empty() => {
                if let Err(e) = write_cached(p, &bin) {
                    tracing::warn!(path = %p.display(), error = %e, "cannot store the OpenCL program binary");
                }
            }
            Ok(_) => tracing::info!("the OpenCL driver gives no program binary; nothing cached"),
            Err(e) => tracing::warn!(error = %e, "cannot read the OpenCL program binary"),
        }
    }
    Ok((prog, Origin::Built { seconds, cache_refused: refused }))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn a_cache_file_is_checked_before_use() {
        let dir = std::env::temp_dir().join(format!("llmd-clcache-{}", std::process::id()));
        let p = dir.join("x.bin");
        write_cached(&p, b"binary bytes").unwrap();
        assert_eq!(read_cached(&p).unwrap(), b"binary bytes");
        let mut b = std::fs::read(&p).unwrap();
        let last = b.len() - 1;
        b[last] ^= 1;
        std::fs::write(&p, &b).unwrap();
        assert!(read_cached(&p).unwrap_err().contains("CRC"));
        std::fs::write(&p, &b[..b.len() - 3]).unwrap();
        assert!(read_cached(&p).unwrap_err().contains("truncated"));
        std::fs::write(&p, b"garbage").unwrap();
        assert!(read_cached(&p).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_key_changes_with_the_driver() {
        assert_ne!(fnv1a(&[b"dev", b"driver 1"]), fnv1a(&[b"dev", b"driver 2"]));
        assert_ne!(fnv1a(&[b"ab", b"c"]), fnv1a(&[b"a", b"bc"]), "parts are separated");
    }
}
