//! Model files checked against what llmd saw when it registered them.
//!
//! At start each model's file (each regular file of an HF directory) is fingerprinted: its
//! identity and times from `stat` (device, inode, size, modification and change times) and a
//! CRC-32 of each of its sampled blocks (the first 64 KiB, where the header and tensor table
//! are, then 64 blocks of 4 KiB spread evenly over the rest, and the last 4 KiB). Checking a
//! fingerprint again costs one `stat` per file ([`Fingerprint::check_stat`], done at every
//! request for the model) or that and ~330 KB read ([`Fingerprint::check`], done before every
//! load and by a periodic check). A file written in place changes its change time (`ctime`),
//! which no program can set back, whatever it does to the modification time; one replaced
//! (renamed over, copied anew) changes its inode; a truncated or extended one its size; bytes
//! that change with no write through the file system (the storage's own corruption) are found
//! when they fall in a sampled block. A change is never repaired silently: the model is
//! refused (`MODEL_LOAD_FAILED`, saying what changed) until llmd restarts and registers the
//! file anew. Not a hash of the whole file: that would read every byte again at each load
//! (estimated at about a second for the 1.1 GB model at ~1 GB/s, against a cold start of
//! ~2.6 s), while a `stat` already sees every write through the file system.

use std::fs::File;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};

/// Bytes at the start of a file that are always sampled (GGUF header, metadata, tensor table).
const HEAD_BYTES: u64 = 64 << 10;
/// Size of every other sampled block.
const BLOCK_BYTES: u64 = 4 << 10;
/// Blocks sampled between the head and the tail.
const SAMPLED_BLOCKS: u64 = 64;

/// What `stat` says of a file: enough to see that it was written, replaced or resized.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Stat {
    len: u64,
    dev: u64,
    ino: u64,
    mtime_ns: i128,
    ctime_ns: i128,
}

impl Stat {
    fn of(path: &Path) -> std::io::Result<Self> {
        let m = std::fs::metadata(path)?;
        Ok(Self {
            len: m.len(),
            dev: m.dev(),
            ino: m.ino(),
            mtime_ns: m.mtime() as i128 * 1_000_000_000 + m.mtime_nsec() as i128,
            ctime_ns: m.ctime() as i128 * 1_000_000_000 + m.ctime_nsec() as i128,
        })
    }

    /// How `now` differs from `self`, in words, or `None`.
    fn differs(&self, now: &Self) -> Option<String> {
        if now.len != self.len {
            Some(format!("its size went from {} to {} bytes", self.len, now.len))
        } else if (now.dev, now.ino) != (self.dev, self.ino) {
            Some("it was replaced by another file (a new inode)".into())
        } else if now.mtime_ns != self.mtime_ns {
            Some("it was modified (its modification time changed)".into())
        } else if now.ctime_ns != self.ctime_ns {
            Some("it was written or its attributes changed (its change time moved)".into())
        } else {
            None
        }
    }
}

/// One file's fingerprint.
#[derive(Clone, Debug, PartialEq, Eq)]
struct FilePrint {
    path: PathBuf,
    stat: Stat,
    /// (offset, CRC-32) of each sampled block.
    samples: Vec<(u64, u32)>,
}

/// How a model's file no longer matches its fingerprint.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{path}: {what}")]
pub struct Change {
    pub path: String,
    pub what: String,
}

/// A model's files as registered.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fingerprint {
    files: Vec<FilePrint>,
}

/// Where the sampled blocks of a file of `len` bytes start, and how long each is.
fn sample_ranges(len: u64) -> Vec<(u64, u64)> {
    let mut out = vec![(0, len.min(HEAD_BYTES))];
    if len > HEAD_BYTES {
        let span = len - HEAD_BYTES;
        for i in 0..SAMPLED_BLOCKS {
            let at = HEAD_BYTES + span * i / SAMPLED_BLOCKS;
            out.push((at, BLOCK_BYTES.min(len - at)));
        }
        let tail = len.saturating_sub(BLOCK_BYTES).max(HEAD_BYTES);
        out.push((tail, len - tail));
    }
    out.dedup();
    out
}

fn read_samples(path: &Path, len: u64) -> std::io::Result<Vec<(u64, u32)>> {
    let f = File::open(path)?;
    let mut buf = vec![0u8; HEAD_BYTES.max(BLOCK_BYTES) as usize];
    sample_ranges(len)
        .into_iter()
        .map(|(at, n)| {
            let b = &mut buf[..n as usize];
            f.read_exact_at(b, at)?;
            Ok((at, crc32fast::hash(b)))
        })
        .collect()
}

/// The files a model is made of: the file itself, or each regular file of an HF directory.
fn files_of(path: &Path) -> std::io::Result<Vec<PathBuf>> {
    if !path.is_dir() {
        return Ok(vec![path.to_path_buf()]);
    }
    let mut files: Vec<PathBuf> =
        std::fs::read_dir(path)?.filter_map(|e| e.ok().map(|e| e.path())).filter(|p| p.is_file()).collect();
    files.sort();
    Ok(files)
}

impl Fingerprint {
    /// Fingerprints the model at `path` (a file, or an HF directory's files).
    pub fn take(path: &Path) -> std::io::Result<Self> {
        let files = files_of(path)?
            .into_iter()
            .map(|p| {
                let stat = Stat::of(&p)?;
                let samples = read_samples(&p, stat.len)?;
                Ok(FilePrint { path: p, stat, samples })
            })
            .collect::<std::io::Result<Vec<_>>>()?;
        Ok(Self { files })
    }

    /// The cheap check: one `stat` per file.
    pub fn check_stat(&self) -> Result<(), Change> {
        for f in &self.files {
            let change = |what: String| Change { path: f.path.display().to_string(), what };
            let now = Stat::of(&f.path).map_err(|e| change(format!("it can no longer be read ({e})")))?;
            if let Some(what) = f.stat.differs(&now) {
                return Err(change(what));
            }
        }
        Ok(())
    }

    /// `stat` and the sampled blocks' checksums.
    pub fn check(&self) -> Result<(), Change> {
        self.check_stat()?;
        self.check_bytes()
    }

    /// The sampled blocks' checksums alone.
    fn check_bytes(&self) -> Result<(), Change> {
        for f in &self.files {
            let change = |what: String| Change { path: f.path.display().to_string(), what };
            let now =
                read_samples(&f.path, f.stat.len).map_err(|e| change(format!("it can no longer be read ({e})")))?;
            if let Some(((at, _), _)) = f.samples.iter().zip(&now).find(|(a, b)| a != b) {
                return Err(change(format!("its bytes changed (the block at offset {at} no longer matches)")));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn scratch(tag: &str, len: usize) -> PathBuf {
        let p = std::env::temp_dir().join(format!("llmd-integrity-{tag}-{}", std::process::id()));
        let bytes: Vec<u8> = (0..len).map(|i| (i * 7 % 251) as u8).collect();
        std::fs::write(&p, bytes).expect("write");
        p
    }

    #[test]
    fn sampled_blocks_cover_head_spread_and_tail_within_the_file() {
        assert_eq!(sample_ranges(100), vec![(0, 100)]);
        let len = 10 << 20;
        let r = sample_ranges(len);
        assert_eq!(r[0], (0, HEAD_BYTES));
        assert_eq!(*r.last().expect("tail"), (len - BLOCK_BYTES, BLOCK_BYTES));
        assert!(r.iter().all(|&(at, n)| n > 0 && at + n <= len), "{r:?}");
        let short = HEAD_BYTES + 100;
        assert!(sample_ranges(short).iter().all(|&(at, n)| at + n <= short));
    }

    #[test]
    fn a_file_written_in_place_resized_or_replaced_is_a_change() {
        let p = scratch("inplace", 1 << 20);
        let print = Fingerprint::take(&p).expect("print");
        assert_eq!(print.check(), Ok(()));
        // Same size, a few bytes changed in the middle, times set back as best a program can.
        let before = std::fs::metadata(&p).expect("stat").modified().expect("mtime");
        let f = std::fs::OpenOptions::new().write(true).open(&p).expect("open");
        f.write_all_at(&[0xff; 16], 300_000).expect("write");
        f.set_modified(before).expect("mtime set back");
        drop(f);
        let e = print.check_stat().expect_err("a write is seen by stat alone");
        assert!(e.what.contains("change time"), "{e}");
        // Appended to.
        let p2 = scratch("grown", 1 << 20);
        let print2 = Fingerprint::take(&p2).expect("print");
        std::fs::OpenOptions::new().append(true).open(&p2).expect("open").write_all(b"x").expect("append");
        assert!(print2.check_stat().expect_err("size").what.contains("size"));
        // Replaced by a copy with other bytes (a new inode).
        let p3 = scratch("replaced", 1 << 20);
        let print3 = Fingerprint::take(&p3).expect("print");
        let tmp = p3.with_extension("new");
        std::fs::write(&tmp, vec![1u8; 1 << 20]).expect("write");
        std::fs::rename(&tmp, &p3).expect("rename");
        assert!(print3.check().is_err());
        for p in [p, p2, p3] {
            let _ = std::fs::remove_file(p);
        }
    }

    /// Bytes that change under an unchanged `stat` (the storage's own corruption) are found
    /// where they fall in a sampled block: here the header.
    #[test]
    fn changed_bytes_in_a_sampled_block_are_found_without_a_stat_change() {
        let p = scratch("bitrot", 1 << 20);
        let print = Fingerprint::take(&p).expect("print");
        let f = std::fs::OpenOptions::new().write(true).open(&p).expect("open");
        f.write_all_at(&[0xaa], 100).expect("write");
        drop(f);
        let e = print.check_bytes().expect_err("a header byte changed");
        assert!(e.what.contains("offset 0"), "{e}");
        let _ = std::fs::remove_file(p);
    }
}
