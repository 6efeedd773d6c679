//! llmd's native model format: EdgeFlow-packed linear weights in execution order, every byte
//! covered by a checksum, laid out for `pread` of whole layers and SIMD unpacking.
//!
//! ```text
//! offset  size  field
//! 0       8     magic "LLMDWTS\0"
//! 8       4     version (u32 LE) = 1
//! 12      4     header CRC-32: bytes [0, 64) with this field read as zero
//! 16      8     metadata offset (= 64)
//! 24      8     metadata length
//! 32      8     data offset (a multiple of 4096)
//! 40      8     data length (= file length − data offset)
//! 48      4     data CRC-32: bytes [data_offset, end of file)
//! 52      4     metadata CRC-32: bytes [64, data_offset) (the JSON and its padding)
//! 56      8     zero
//! 64      …     metadata: one JSON document ([`Metadata`]), then zero padding to the data offset
//! data    …     regions: the embedding region, one per layer, the head region — each starting on
//!               a 4096-byte boundary, tensors inside it on 64-byte boundaries, in the order the
//!               forward pass uses them; the regions cover the data exactly.
//! ```
//! Every byte after the magic is covered: the header CRC is checked first (before any field is
//! trusted), then the metadata CRC, and every tensor carries its own CRC-32 that the streaming
//! loader checks as it arrives, with the whole data's CRC checked at the end. (A changed magic
//! means "not an llmd file" and is reported as such.)
//!
//! An EdgeFlow tensor of `C` rows (output channels) and `D` columns is
//! `[bit-widths: ⌈3C/8⌉ bytes, INT3 codes b−1][pad to 64][scales: C × f16][pad to 64][channels]`,
//! channel `i` taking `B_i · ⌈D/128⌉ · 16` bytes (see [`crate::quant::edgeflow`]).
//!
//! A tensor of kind `k_packed` holds a K-quant tensor in the CPU kernels' tile records
//! (`backend::layout::kpacked`, its `RECORD_LAYOUT` number stored with it): the converter keeps
//! a source's K-quant tensors this way, so loading them is a read with no repacking.

use crate::config::ModelConfig;
use crate::error::FormatError;
use crate::quant::edgeflow;
use crate::quant::GgmlType;
use serde::{Deserialize, Serialize};
use std::io::Write;
use std::path::Path;

pub const MAGIC: &[u8; 8] = b"LLMDWTS\0";
pub const VERSION: u32 = 1;
pub const HEADER_BYTES: usize = 64;
/// Regions start on page boundaries (whole-page reads, `O_DIRECT`-ready).
pub const REGION_ALIGN: usize = 4096;
/// Tensors start on cache-line boundaries (aligned SIMD loads).
pub const TENSOR_ALIGN: usize = 64;
/// Metadata larger than this is refused before it is parsed.
pub const MAX_METADATA: u64 = 256 << 20;

/// How a tensor's bytes are laid out.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum TensorKind {
    /// GGUF block rows of a GGML type (by its GGUF type id): embeddings, the head, norms.
    Ggml { type_id: u32 },
    /// EdgeFlow mixed-precision channels (one bit-width and one f16 scale per row).
    Edgeflow,
    /// A K-quant tensor (Q2_K … Q6_K, by GGUF type id) already in the CPU kernels' tile
    /// records (`backend::layout::kpacked`), record layout `layout`: loading is a read and a copy,
    /// with no repacking. The loader checks the layout number and the length.
    KPacked { type_id: u32, layout: u32 },
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct TensorEntry {
    /// GGUF-style name (`blk.3.attn_q.weight`).
    pub name: String,
    #[serde(flatten)]
    pub kind: TensorKind,
    pub rows: u64,
    pub cols: u64,
    /// Offset from the start of the data.
    pub offset: u64,
    pub len: u64,
    pub crc32: u32,
}

/// A contiguous part of the data read as one unit: `embed`, `layer N` or `head`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Region {
    pub name: String,
    pub offset: u64,
    pub len: u64,
    /// Indices into [`Metadata::tensors`].
    pub tensors: Vec<usize>,
}

/// How the linear weights were quantized.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct QuantInfo {
    pub method: String,
    /// The average bit budget per channel (per tensor).
    pub bits: f64,
    /// The smoothing exponent α per layer (empty: no smoothing).
    #[serde(default)]
    pub smoothing_alpha: Vec<f32>,
    /// The calibration text's token count (0: no calibration).
    #[serde(default)]
    pub calibration_tokens: usize,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Metadata {
    pub producer: String,
    /// The source file's name.
    pub source: String,
    pub quant: QuantInfo,
    pub config: ModelConfig,
    pub tokenizer: TokenizerSnapshot,
    pub chat_template: Option<String>,
    pub tensors: Vec<TensorEntry>,
    pub regions: Vec<Region>,
}

/// The fixed header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    pub header_crc: u32,
    pub metadata_len: u64,
    pub data_offset: u64,
    pub data_len: u64,
    pub data_crc: u32,
    pub metadata_crc: u32,
}

fn u32_at(b: &[u8], o: usize) -> u32 {
    u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]])
}
fn u64_at(b: &[u8], o: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[o..o + 8]);
    u64::from_le_bytes(a)
}

fn layout(m: impl Into<String>) -> FormatError {
    FormatError::NativeLayout(m.into())
}

/// Whether `bytes` (a file's first bytes) start like an llmd model file.
pub fn is_llmd(first: &[u8]) -> bool {
    first.len() >= 8 && &first[..8] == MAGIC
}

/// Reads the header and metadata of the llmd file at `path` (checked as [`parse_head`] does) and
/// its length; no tensor data is read.
pub fn read_head(path: &Path) -> Result<(Header, Metadata, u64), FormatError> {
    use std::os::unix::fs::FileExt;
    let io = |source| FormatError::Io { path: path.display().to_string(), source };
    let file = std::fs::File::open(path).map_err(io)?;
    let file_len = file.metadata().map_err(io)?.len();
    let mut head = vec![0u8; HEADER_BYTES.min(usize::try_from(file_len).unwrap_or(usize::MAX))];
    file.read_exact_at(&mut head, 0).map_err(io)?;
    if head.len() == HEADER_BYTES && is_llmd(&head) {
        let data_offset = u64::from_le_bytes(head[32..40].try_into().unwrap_or_default());
        if data_offset <= file_len && data_offset <= MAX_METADATA + REGION_ALIGN as u64 {
            head.resize(data_offset as usize, 0);
            file.read_exact_at(&mut head, 0).map_err(io)?;
        }
    }
    let (header, meta) = parse_head(&head, file_len)?;
    Ok((header, meta, file_len))
}

/// Whether the file at `path` is an llmd model file (by its magic).
pub fn path_is_llmd(path: &Path) -> bool {
    use std::io::Read;
    let mut b = [0u8; 8];
    std::fs::File::open(path).and_then(|mut f| f.read_exact(&mut b)).is_ok() && is_llmd(&b)
}

/// Bytes of an EdgeFlow tensor's bit-width array and scales, each padded to 64.
pub fn edgeflow_prefix(rows: usize) -> (usize, usize) {
    let bits = (3 * rows).div_ceil(8).next_multiple_of(TENSOR_ALIGN);
    let scales = (2 * rows).next_multiple_of(TENSOR_ALIGN);
    (bits, scales)
}

/// Reads and checks the header and metadata of an llmd file (`head` holds at least the
/// file's first `data_offset` bytes, `file_len` its length). The data is checked as it is read.
pub fn parse_head(head: &[u8], file_len: u64) -> Result<(Header, Metadata), FormatError> {
    if head.len() < HEADER_BYTES {
        return Err(FormatError::Truncated {
            what: "llmd header",
            offset: 0,
            needed: HEADER_BYTES as u64,
            len: head.len() as u64,
        });
    }
    if !is_llmd(head) {
        return Err(FormatError::NativeBadMagic { found: head[..8].to_vec() });
    }
    let stored = u32_at(head, 12);
    let mut crc = crc32fast::Hasher::new();
    crc.update(&head[..12]);
    crc.update(&[0u8; 4]);
    crc.update(&head[16..HEADER_BYTES]);
    let computed = crc.finalize();
    if computed != stored {
        return Err(FormatError::ChecksumMismatch { what: "header".into(), stored, computed });
    }
    let version = u32_at(head, 8);
    if version != VERSION {
        return Err(FormatError::NativeVersion { found: version, supported: VERSION });
    }
    let h = Header {
        header_crc: stored,
        metadata_len: u64_at(head, 24),
        data_offset: u64_at(head, 32),
        data_len: u64_at(head, 40),
        data_crc: u32_at(head, 48),
        metadata_crc: u32_at(head, 52),
    };
    if u64_at(head, 16) != HEADER_BYTES as u64 || head[56..64].iter().any(|&b| b != 0) {
        return Err(layout(format!(
            "metadata offset {} (expected {HEADER_BYTES}) or reserved bytes set",
            u64_at(head, 16)
        )));
    }
    if h.metadata_len > MAX_METADATA {
        return Err(layout(format!("metadata of {} bytes (at most {MAX_METADATA})", h.metadata_len)));
    }
    let want_data = (HEADER_BYTES as u64 + h.metadata_len).next_multiple_of(REGION_ALIGN as u64);
    if h.data_offset != want_data {
        return Err(layout(format!("data offset {} (expected {want_data})", h.data_offset)));
    }
    if h.data_offset.checked_add(h.data_len) != Some(file_len) {
        return Err(layout(format!(
            "data of {} bytes at {} does not end the file of {file_len} bytes",
            h.data_len, h.data_offset
        )));
    }
    if (head.len() as u64) < h.data_offset {
        return Err(FormatError::Truncated {
            what: "llmd metadata",
            offset: 0,
            needed: h.data_offset,
            len: head.len() as u64,
        });
    }
    let computed = crc32fast::hash(&head[HEADER_BYTES..h.data_offset as usize]);
    if computed != h.metadata_crc {
        return Err(FormatError::ChecksumMismatch { what: "metadata".into(), stored: h.metadata_crc, computed });
    }
    let meta_bytes = &head[HEADER_BYTES..HEADER_BYTES + h.metadata_len as usize];
    let meta: Metadata =
        serde_json::from_slice(meta_bytes).map_err(|e| layout(format!("metadata is not valid: {e}")))?;
    meta.config.validate()?;
    check_tables(&meta, h.data_len)?;
    Ok((h, meta))
}

/// The tensor table and regions: inside the data, aligned, non-overlapping, sizes matching
/// their kinds, regions contiguous and covering the data.
fn check_tables(m: &Metadata, data_len: u64) -> Result<(), FormatError> {
    let mut names = std::collections::HashSet::new();
    for t in &m.tensors {
        if !names.insert(t.name.as_str()) {
            return Err(FormatError::DuplicateTensor(t.name.clone()));
        }
        let end = t.offset.checked_add(t.len).filter(|&e| e <= data_len);
        if end.is_none() {
            return Err(FormatError::TensorOutOfBounds {
                name: t.name.clone(),
                start: t.offset,
                end: t.offset.saturating_add(t.len),
                data_len,
            });
        }
        if t.offset % TENSOR_ALIGN as u64 != 0 {
            return Err(FormatError::MisalignedTensor {
                name: t.name.clone(),
                offset: t.offset,
                alignment: TENSOR_ALIGN as u64,
            });
        }
        if t.rows == 0 || t.cols == 0 || t.rows > 1 << 24 || t.cols > 1 << 24 {
            return Err(FormatError::BadDimension { name: t.name.clone(), axis: 0, dim: t.rows.max(t.cols) });
        }
        match t.kind {
            TensorKind::Ggml { type_id } => {
                let ty = GgmlType::from_id(type_id)
                    .ok_or_else(|| FormatError::UnknownTensorType { name: t.name.clone(), type_id })?;
                let need = ty.row_bytes(t.cols as usize).and_then(|r| r.checked_mul(t.rows as usize));
                if need != Some(t.len as usize) {
                    return Err(layout(format!(
                        "tensor {:?}: {} bytes for {} × {} {}",
                        t.name,
                        t.len,
                        t.rows,
                        t.cols,
                        ty.name()
                    )));
                }
            }
            TensorKind::KPacked { type_id, .. } => {
                let ty = GgmlType::from_id(type_id)
                    .ok_or_else(|| FormatError::UnknownTensorType { name: t.name.clone(), type_id })?;
                let k_quant =
                    matches!(ty, GgmlType::Q2_K | GgmlType::Q3_K | GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q6_K);
                if !k_quant || t.cols % 256 != 0 {
                    return Err(layout(format!(
                        "tensor {:?}: packed records of {} × {} {} (only K-quants, whole super-blocks of 256)",
                        t.name,
                        t.rows,
                        t.cols,
                        ty.name()
                    )));
                }
            }
            TensorKind::Edgeflow => {
                let (b, s) = edgeflow_prefix(t.rows as usize);
                let min = (b + s) as u64 + t.rows * edgeflow::channel_bytes(1, t.cols as usize) as u64;
                let max = (b + s) as u64 + t.rows * edgeflow::channel_bytes(8, t.cols as usize) as u64;
                if t.len < min || t.len > max {
                    return Err(layout(format!(
                        "EdgeFlow tensor {:?}: {} bytes, outside {min}..={max}",
                        t.name, t.len
                    )));
                }
            }
        }
    }
    let mut at = 0u64;
    let mut seen = vec![false; m.tensors.len()];
    for r in &m.regions {
        if r.offset != at || r.offset % REGION_ALIGN as u64 != 0 {
            return Err(layout(format!("region {:?} at {} (expected {at}, page-aligned)", r.name, r.offset)));
        }
        at = r.offset.checked_add(r.len).ok_or_else(|| layout("region length overflows"))?;
        for &i in &r.tensors {
            let t = m.tensors.get(i).ok_or_else(|| layout(format!("region {:?} names tensor {i}", r.name)))?;
            if std::mem::replace(&mut seen[i], true) {
                return Err(layout(format!("tensor {:?} is in two regions", t.name)));
            }
            if t.offset < r.offset || t.offset + t.len > at {
                return Err(layout(format!("tensor {:?} lies outside its region {:?}", t.name, r.name)));
            }
        }
    }
    if at != data_len {
        return Err(layout(format!("regions cover {at} of {data_len} data bytes")));
    }
    if let Some(i) = seen.iter().position(|s| !s) {
        return Err(layout(format!("tensor {:?} is in no region", m.tensors[i].name)));
    }
    let mut spans: Vec<(u64, u64, &str)> =
        m.tensors.iter().map(|t| (t.offset, t.offset + t.len, t.name.as_str())).collect();
    spans.sort();
    for w in spans.windows(2) {
        if w[1].0 < w[0].1 {
            return Err(FormatError::OverlappingTensors { a: w[0].2.into(), b: w[1].2.into() });
        }
    }
    Ok(())
}

/// Writes an llmd file: tensors are added region by region in execution order, then
/// [`Writer::finish`] writes header and metadata and renames the file into place (a failed
/// conversion never leaves a partial file under the output name).
pub struct Writer {
    out: std::path::PathBuf,
    data_path: std::path::PathBuf,
    data: std::io::BufWriter<std::fs::File>,
    at: u64,
    crc: crc32fast::Hasher,
    tensors: Vec<TensorEntry>,
    regions: Vec<Region>,
}

impl Writer {
    pub fn create(out: &Path) -> std::io::Result<Self> {
        let data_path = out.with_extension("llmd-data.tmp");
        let f = std::fs::File::create(&data_path)?;
        Ok(Self {
            out: out.to_owned(),
            data_path,
            data: std::io::BufWriter::with_capacity(1 << 20, f),
            at: 0,
            crc: crc32fast::Hasher::new(),
            tensors: Vec::new(),
            regions: Vec::new(),
        })
    }

    fn pad_to(&mut self, align: u64) -> std::io::Result<()> {
        let n = (self.at.next_multiple_of(align) - self.at) as usize;
        let zeros = vec![0u8; n];
        self.data.write_all(&zeros)?;
        self.crc.update(&zeros);
        self.at += n as u64;
        Ok(())
    }

    /// Starts a region (closing the previous one).
    pub fn begin_region(&mut self, name: &str) -> std::io::Result<()> {
        self.end_region()?;
        self.regions.push(Region { name: name.into(), offset: self.at, len: 0, tensors: Vec::new() });
        Ok(())
    }

    fn end_region(&mut self) -> std::io::Result<()> {
        if let Some(last) = self.regions.last() {
            if last.len == 0 {
                self.pad_to(REGION_ALIGN as u64)?;
                let r = self.regions.last_mut().expect("checked");
                r.len = self.at - r.offset;
            }
        }
        Ok(())
    }

    /// Appends one tensor's bytes to the current region.
    pub fn tensor(
        &mut self,
        name: &str,
        kind: TensorKind,
        rows: usize,
        cols: usize,
        bytes: &[u8],
    ) -> std::io::Result<()> {
        if self.regions.is_empty() {
            self.begin_region("data")?;
        }
        self.pad_to(TENSOR_ALIGN as u64)?;
        self.data.write_all(bytes)?;
        self.crc.update(bytes);
        self.tensors.push(TensorEntry {
            name: name.into(),
            kind,
            rows: rows as u64,
            cols: cols as u64,
            offset: self.at,
            len: bytes.len() as u64,
            crc32: crc32fast::hash(bytes),
        });
        let i = self.tensors.len() - 1;
        if let Some(r) = self.regions.last_mut() {
            r.tensors.push(i);
        }
        self.at += bytes.len() as u64;
        Ok(())
    }

    /// Writes the header and metadata, appends the data and moves the file into place.
    pub fn finish(mut self, mut meta: Metadata) -> std::io::Result<u64> {
        self.end_region()?;
        self.data.flush()?;
        meta.tensors = std::mem::take(&mut self.tensors);
        meta.regions = std::mem::take(&mut self.regions);
        let json = serde_json::to_vec(&meta).map_err(std::io::Error::other)?;
        let data_offset = (HEADER_BYTES + json.len()).next_multiple_of(REGION_ALIGN);
        let mut head = vec![0u8; data_offset];
        head[..8].copy_from_slice(MAGIC);
        head[8..12].copy_from_slice(&VERSION.to_le_bytes());
        head[16..24].copy_from_slice(&(HEADER_BYTES as u64).to_le_bytes());
        head[24..32].copy_from_slice(&(json.len() as u64).to_le_bytes());
        head[32..40].copy_from_slice(&(data_offset as u64).to_le_bytes());
        head[40..48].copy_from_slice(&self.at.to_le_bytes());
        head[48..52].copy_from_slice(&self.crc.clone().finalize().to_le_bytes());
        head[HEADER_BYTES..HEADER_BYTES + json.len()].copy_from_slice(&json);
        let meta_crc = crc32fast::hash(&head[HEADER_BYTES..]);
        head[52..56].copy_from_slice(&meta_crc.to_le_bytes());
        let crc = crc32fast::hash(&head[..HEADER_BYTES]);
        head[12..16].copy_from_slice(&crc.to_le_bytes());
        let tmp = self.out.with_extension("llmd.tmp");
        let result = (|| {
            let mut f = std::fs::File::create(&tmp)?;
            f.write_all(&head)?;
            let mut data = std::fs::File::open(&self.data_path)?;
            std::io::copy(&mut data, &mut f)?;
            f.sync_all()?;
            std::fs::rename(&tmp, &self.out)
        })();
        let _ = std::fs::remove_file(&self.data_path);
        if result.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        result.map(|_| data_offset as u64 + self.at)
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        // A conversion that failed part-way leaves nothing behind.
        let _ = std::fs::remove_file(&self.data_path);
    }
}

/// A tokenizer as stored in an llmd model file: the `tokenizer.json` document plus what llmd
/// derives from the source format (token bytes in hex, BOS/EOS, end-of-generation tokens).
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct TokenizerSnapshot {
    pub hf_json: String,
    pub pieces: Vec<String>,
    pub texts: Vec<String>,
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    pub add_bos: bool,
    pub eog: Vec<u32>,
}

/// EdgeFlow-encodes an f32 matrix: bit-width array, scales, then the channels.
pub fn encode_edgeflow(w: &[f32], rows: usize, cols: usize, bits: f64, threads: usize) -> (Vec<u8>, Vec<u8>) {
    let crest: Vec<f64> = w.chunks_exact(cols).map(edgeflow::crest2).collect();
    let widths = edgeflow::allocate(&crest, bits);
    let (bits_len, scales_len) = edgeflow_prefix(rows);
    let mut offsets = Vec::with_capacity(rows);
    let mut at = bits_len + scales_len;
    for &b in &widths {
        offsets.push(at);
        at += edgeflow::channel_bytes(b, cols);
    }
    let mut out = vec![0u8; at];
    let packed_bits = edgeflow::pack_bit_widths(&widths);
    out[..packed_bits.len()].copy_from_slice(&packed_bits);
    let (head, body) = out.split_at_mut(bits_len + scales_len);
    let scales = &mut head[bits_len..bits_len + 2 * rows];
    // Rows are independent: split them across threads, each writing its own channels.
    let threads =
        if threads == 0 { std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1) } else { threads };
    let per = rows.div_ceil(threads.max(1)).max(1);
    let mut scale_chunks = scales.chunks_mut(2 * per);
    let mut body_rest = body;
    std::thread::scope(|s| {
        for r0 in (0..rows).step_by(per) {
            let r1 = (r0 + per).min(rows);
            let end = if r1 < rows { offsets[r1] } else { at };
            let (mine, rest) = std::mem::take(&mut body_rest).split_at_mut(end - offsets[r0]);
            body_rest = rest;
            let sc = scale_chunks.next().unwrap_or_default();
            let (widths, offsets) = (&widths, &offsets);
            s.spawn(move || {
                for r in r0..r1 {
                    let row = &w[r * cols..(r + 1) * cols];
                    let (d, codes) = edgeflow::quantize_channel(row, widths[r]);
                    sc[2 * (r - r0)..2 * (r - r0) + 2].copy_from_slice(&d.to_le_bytes());
                    let o = offsets[r] - offsets[r0];
                    let n = edgeflow::channel_bytes(widths[r], cols);
                    edgeflow::pack_channel(&codes, widths[r], &mut mine[o..o + n]);
                }
            });
        }
    });
    (out, widths)
}
