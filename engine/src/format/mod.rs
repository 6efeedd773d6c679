//! Model file formats: the strict GGUF reader, the HF layout (config.json + safetensors +
//! tokenizer.json), and the tensor map both produce for the model builder.

pub mod gguf;
pub mod hf;
pub mod llmd;

use crate::error::FormatError;
use crate::quant::GgmlType;
use std::collections::BTreeMap;
use std::ops::{Deref, Range};
use std::path::Path;
use std::sync::Arc;

/// The bytes of a model file: memory-mapped from disk, or owned (tests, generated files).
pub enum ModelBytes {
    /// The map and the open file (read with `pread` where touching the map would cost
    /// resident memory, e.g. when repacking weights into a copy).
    Mapped {
        /// Registered with the SIGBUS guard (a page lost to truncation reads as zeros and is
        /// reported by [`ModelBytes::faulted`]); dropped before the map.
        guard: Option<llmd_alloc_sys::MapGuard>,
        map: memmap2::Mmap,
        file: std::fs::File,
    },
    Owned(Vec<u8>),
}

impl ModelBytes {
    /// Memory-maps a file read-only.
    pub fn map(path: &Path) -> Result<Self, FormatError> {
        let io = |source| FormatError::Io { path: path.display().to_string(), source };
        let file = std::fs::File::open(path).map_err(io)?;
        let map = llmd_alloc_sys::map_readonly(&file).map_err(io)?;
        let guard = llmd_alloc_sys::guard_map(map.as_ptr(), map.len());
        Ok(Self::Mapped { guard, map, file })
    }

    /// Copies `buf.len()` bytes at `offset` into `buf` without touching the map's pages.
    pub fn read_at(&self, offset: usize, buf: &mut [u8]) -> std::io::Result<()> {
        match self {
            Self::Mapped { file, .. } => std::os::unix::fs::FileExt::read_exact_at(file, buf, offset as u64),
            Self::Owned(v) => {
                let src = v.get(offset..offset + buf.len()).ok_or(std::io::ErrorKind::UnexpectedEof)?;
                buf.copy_from_slice(src);
                Ok(())
            }
        }
    }
}

impl ModelBytes {
    /// Asks the kernel to start reading `range` of the map (no effect on owned bytes).
    pub fn will_need(&self, range: std::ops::Range<usize>) {
        if let Self::Mapped { map: m, .. } = self {
            let _ = m.advise_range(memmap2::Advice::WillNeed, range.start, range.len());
        }
    }

    /// Whether a page of the map was lost since it was mapped (the file shrank under us) and
    /// read as zeros: anything computed from this file since then is wrong.
    pub fn faulted(&self) -> bool {
        matches!(self, Self::Mapped { guard: Some(g), .. } if g.faulted())
    }

    /// Lets go of this process's resident pages of `range` of the map (the whole pages inside
    /// it; touched again, they are read back from the file).
    pub fn release(&self, range: std::ops::Range<usize>) {
        if let Self::Mapped { map: m, .. } = self {
            llmd_alloc_sys::release_mapped_pages(m, range);
        }
    }
}

impl Deref for ModelBytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Self::Mapped { map, .. } => map,
            Self::Owned(v) => v,
        }
    }
}

/// A tensor ready to use: its type, its shape (innermost dimension first) and its bytes.
#[derive(Clone)]
pub struct TensorRef {
    pub ty: GgmlType,
    pub dims: Vec<u64>,
    pub file: Arc<ModelBytes>,
    pub range: Range<usize>,
}

impl TensorRef {
    pub fn bytes(&self) -> &[u8] {
        &self.file[self.range.clone()]
    }
}

/// Tensors by GGUF-style name (`blk.N.attn_q.weight`), whatever the file format.
pub type TensorMap = BTreeMap<String, TensorRef>;

/// Which on-disk layout a path holds.
pub fn is_hf_dir(path: &Path) -> bool {
    path.is_dir() && path.join("config.json").is_file()
}
