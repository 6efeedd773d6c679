//! A weight matrix as the CPU keeps it: the file's bytes (mapped) and, for the types the
//! packed kernels take, a copy in their tile layout.

use crate::backend::layout::kpacked::{KKind, KPackedMatrix};
use crate::backend::layout::packed::{PackKind, PackedMatrix};
use crate::format::TensorRef;
use crate::quant::{self, GgmlType};
use llmd_alloc_sys::HugeArena;
use llmd_device::{HostCopy, HostLayout};
use std::sync::Arc;

/// A range of a model file's bytes, shared with a device (the file outlives the handle).
struct FileRows {
    file: Arc<crate::format::ModelBytes>,
    range: std::ops::Range<usize>,
}

impl AsRef<[u8]> for FileRows {
    fn as_ref(&self) -> &[u8] {
        self.file.get(self.range.clone()).unwrap_or(&[])
    }
}

/// A 2-D weight: `rows` rows of `cols` elements, each row a whole number of blocks.
#[derive(Clone)]
pub struct WeightMatrix {
    pub name: String,
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    pub(crate) tensor: TensorRef,
    /// The same weights in the CPU kernels' tile layout, when the type has one (read from the
    /// file without touching the map, so the map's pages do not count against resident memory).
    pub packed: Option<Arc<PackedMatrix>>,
    /// The same weights in the K-quant kernels' tile layout (Q2_K … Q6_K; see `kpacked`).
    pub kpacked: Option<Arc<KPackedMatrix>>,
    /// Rows stay on storage and are read with `pread` when used (embeddings on flash).
    pub on_flash: bool,
}

impl WeightMatrix {
    /// Wraps a tensor already checked to hold `rows` × `cols` elements of its type.
    pub fn from_tensor(name: &str, rows: usize, cols: usize, tensor: TensorRef) -> Self {
        Self::from_tensor_in(None, name, rows, cols, tensor.clone())
            .unwrap_or_else(|_| Self::unpacked(name, rows, cols, tensor))
    }

    /// [`Self::from_tensor`], packing into `arena` while it has room; an error if the file
    /// could not be read.
    pub(crate) fn from_tensor_in(
        arena: Option<&HugeArena>,
        name: &str,
        rows: usize,
        cols: usize,
        tensor: TensorRef,
    ) -> std::io::Result<Self> {
        let p = pack(arena, &tensor, rows, cols)?;
        Ok(Self { packed: p.int8, kpacked: p.k, ..Self::unpacked(name, rows, cols, tensor) })
    }

    fn unpacked(name: &str, rows: usize, cols: usize, tensor: TensorRef) -> Self {
        Self { name: name.to_owned(), ty: tensor.ty, rows, cols, tensor, packed: None, kpacked: None, on_flash: false }
    }

    /// Weights a device handed over as bytes of a GGML type (`rows` × `cols`, row-major), in
    /// memory of their own, packed for the CPU kernels where the type has a packed layout.
    pub fn from_host_bytes(name: &str, ty: GgmlType, rows: usize, cols: usize, data: Vec<u8>) -> Option<Self> {
        if ty.row_bytes(cols)?.checked_mul(rows)? != data.len() {
            return None;
        }
        let len = data.len();
        let tensor = TensorRef {
            ty,
            dims: vec![cols as u64, rows as u64],
            file: Arc::new(crate::format::ModelBytes::Owned(data)),
            range: 0..len,
        };
        Some(Self::from_tensor(name, rows, cols, tensor))
    }

    /// The matrix as the CPU keeps it, for a device that shares the host's memory to use in
    /// place: the packed tiles where the type has them, else the file's rows (None for rows
    /// on flash or bytes that are not rows of its type).
    pub fn host_copy(&self) -> Option<HostCopy> {
        if let Some(p) = &self.packed {
            let ty = p.kind.ggml_type();
            return Some(HostCopy { layout: HostLayout::CpuTiles, ty, bytes: p.clone(), offset: 0 });
        }
        if let Some(k) = &self.kpacked {
            let ty = k.kind.ggml();
            // Records used in place from an llmd file start on 64 bytes only: shared from
            // their page, like a file's rows.
            if let Some((file, range)) = k.file_range() {
                return Some(Self::from_page(HostLayout::CpuTiles, ty, file, range));
            }
            return Some(HostCopy { layout: HostLayout::CpuTiles, ty, bytes: k.clone(), offset: 0 });
        }
        self.source_bytes()?;
        Some(Self::from_page(HostLayout::Rows, self.ty, &self.tensor.file, &self.tensor.range))
    }

    /// `range` of a mapped file, shared from the start of the page it begins in (a map starts
    /// on a page), so a device can start a buffer on its alignment: GGUF aligns tensors to 32
    /// bytes, llmd files to 64.
    fn from_page(
        layout: HostLayout,
        ty: GgmlType,
        file: &Arc<crate::format::ModelBytes>,
        r: &std::ops::Range<usize>,
    ) -> HostCopy {
        let start = r.start - r.start % crate::backend::layout::packed::HOST_ALIGN;
        let rows = FileRows { file: file.clone(), range: start..r.end };
        HostCopy { layout, ty, bytes: Arc::new(rows), offset: r.start - start }
    }

    /// Lets go of the process's resident pages of this matrix's bytes in the model file's map
    /// (after a device copied them: touched again, they are read back from the file).
    pub fn release_source_pages(&self) {
        self.tensor.file.release(self.tensor.range.clone());
    }

    /// The file's bytes of this matrix, if they are rows of its type (a GGUF or HF tensor; not
    /// weights unpacked from an llmd file, whose bytes are EdgeFlow's).
    pub fn source_bytes(&self) -> Option<&[u8]> {
        let expected = self.ty.row_bytes(self.cols)?.checked_mul(self.rows)?;
        (self.tensor.ty == self.ty && self.tensor.range.len() == expected && !self.on_flash).then(|| self.bytes())
    }

    /// Reads row `r`'s bytes from storage into `buf` (no page of the map is touched).
    pub fn read_row(&self, r: usize, buf: &mut Vec<u8>) -> std::io::Result<()> {
        let rb = self.row_bytes();
        if r >= self.rows {
            return Err(std::io::Error::new(std::io::ErrorKind::InvalidInput, format!("row {r} of {}", self.rows)));
        }
        buf.resize(rb, 0);
        self.tensor.file.read_at(self.tensor.range.start + r * rb, buf)
    }

    /// Wraps weights already in the packed layout (e.g. unpacked from an llmd file); `tensor`
    /// names where they live in the file, for accounting only.
    pub fn with_packed(name: &str, tensor: TensorRef, packed: PackedMatrix) -> Self {
        let ty = match packed.kind {
            PackKind::Q4_0 => GgmlType::Q4_0,
            PackKind::Q4_1 => GgmlType::Q4_1,
            PackKind::Q8_0 => GgmlType::Q8_0,
        };
        Self {
            name: name.to_owned(),
            ty,
            rows: packed.rows,
            cols: packed.cols,
            tensor,
            packed: Some(Arc::new(packed)),
            kpacked: None,
            on_flash: false,
        }
    }

    /// Wraps K-quant weights already in their packed layout (read from an llmd file);
    /// `tensor` names where they live in the file, for accounting only.
    pub fn with_kpacked(name: &str, tensor: TensorRef, k: KPackedMatrix) -> Self {
        Self {
            name: name.to_owned(),
            ty: k.kind.ggml(),
            rows: k.rows,
            cols: k.cols,
            tensor,
            packed: None,
            kpacked: Some(Arc::new(k)),
            on_flash: false,
        }
    }

    /// The same weights under another name (a tied output head).
    pub fn renamed(&self, name: &str) -> Self {
        Self { name: name.to_owned(), ..self.clone() }
    }

    /// Whether two matrices are the same weights (a tied output head).
    pub fn same_weights(&self, o: &Self) -> bool {
        match (&self.packed, &o.packed, &self.kpacked, &o.kpacked) {
            (Some(a), Some(b), _, _) => Arc::ptr_eq(a, b),
            (_, _, Some(a), Some(b)) => Arc::ptr_eq(a, b),
            _ => Arc::ptr_eq(&self.tensor.file, &o.tensor.file) && self.tensor.range == o.tensor.range,
        }
    }

    pub fn row_bytes(&self) -> usize {
        self.tensor.range.len() / self.rows.max(1)
    }
    pub fn bytes(&self) -> &[u8] {
        self.tensor.bytes()
    }
    pub fn row(&self, r: usize) -> Option<&[u8]> {
        let rb = self.row_bytes();
        (r < self.rows).then(|| &self.bytes()[r * rb..(r + 1) * rb])
    }
    /// Bytes of weights this matrix holds in memory (its packed copy, if it has one; none when
    /// its rows stay on storage).
    pub fn size_bytes(&self) -> usize {
        if self.on_flash {
            return 0;
        }
        match (&self.packed, &self.kpacked) {
            (Some(p), _) => p.size_bytes(),
            (_, Some(k)) => k.size_bytes(),
            _ => self.tensor.range.len(),
        }
    }
}

/// The tile-layout copies of a matrix (at most one of them).
#[derive(Default)]
pub(crate) struct Packed {
    pub int8: Option<Arc<PackedMatrix>>,
    pub k: Option<Arc<KPackedMatrix>>,
    /// Set when the file's type has no packed form and the weights were converted to Q8_0
    /// tiles at load (see [`convert_kind`]).
    pub converted_from: Option<GgmlType>,
}

/// The packed kind a quantized matrix of `ty` is converted to at load when its type has no
/// kernels of its own: Q5_0 exactly (its 5-bit values minus 16 are 8-bit values under the same
/// scale), Q5_1 requantized to Q8_0 per 32 values (llama.cpp's Q8_0 rounding: error at most
/// 1/254 of each block's largest weight). Float matrices (F32, F16, BF16) are not converted:
/// they run on the float row kernels, as llama.cpp runs them, and the load says so.
///
/// Decision: a quantized type without kernels of its own is converted once at
/// load, never run on a per-row integer path, and the load log names the type, the tensors and
/// the bytes before and after; a type the engine cannot read at all is refused by name.
pub fn convert_kind(ty: GgmlType) -> Option<PackKind> {
    match ty {
        GgmlType::Q5_0 | GgmlType::Q5_1 => Some(PackKind::Q8_0),
        _ => None,
    }
}

/// Bytes of the tile-layout copy of a `rows` × `cols` matrix of `ty`, if it has one.
pub(crate) fn packed_len(ty: GgmlType, rows: usize, cols: usize) -> Option<usize> {
    match (PackKind::of(ty), KKind::of(ty), convert_kind(ty)) {
        (Some(kind), _, _) => PackedMatrix::packed_len(kind, rows, cols),
        (_, Some(kind), _) => KPackedMatrix::packed_len(kind, rows, cols),
        (_, _, Some(kind)) => PackedMatrix::packed_len(kind, rows, cols),
        _ => None,
    }
}

/// The tile-layout copy of a tensor whose type has one (or converts to one), in `arena` while
/// it has room (read from the file without touching its map).
pub(crate) fn pack(arena: Option<&HugeArena>, t: &TensorRef, rows: usize, cols: usize) -> std::io::Result<Packed> {
    let row_bytes = t.range.len() / rows.max(1);
    let read = |r0: usize, buf: &mut [u8]| t.file.read_at(t.range.start + r0 * row_bytes, buf);
    if let Some(kind) = PackKind::of(t.ty) {
        let p = PackedMatrix::pack_in(arena, kind, rows, cols, read)?;
        return Ok(Packed { int8: Some(Arc::new(p)), ..Default::default() });
    }
    if let Some(kind) = KKind::of(t.ty) {
        let p = KPackedMatrix::pack_in(arena, kind, rows, cols, read)?;
        return Ok(Packed { k: Some(Arc::new(p)), ..Default::default() });
    }
    if let Some(kind) = convert_kind(t.ty) {
        if !cols.is_multiple_of(32) {
            return Ok(Packed::default());
        }
        let q8_row = GgmlType::Q8_0.row_bytes(cols).unwrap_or(0);
        let mut src = Vec::new();
        let mut vals = vec![0f32; cols];
        let p = PackedMatrix::pack_in(arena, kind, rows, cols, |r0, buf| {
            let n = buf.len() / q8_row.max(1);
            src.resize(n * row_bytes, 0);
            read(r0, &mut src)?;
            for (s, d) in src.chunks_exact(row_bytes).zip(buf.chunks_exact_mut(q8_row)) {
                to_q8_0(t.ty, s, d, &mut vals)?;
            }
            Ok(())
        })?;
        return Ok(Packed { int8: Some(Arc::new(p)), converted_from: Some(t.ty), ..Default::default() });
    }
    Ok(Packed::default())
}

/// One row of `ty` as Q8_0 blocks (see [`convert_kind`]); `vals` is scratch of the row's length.
fn to_q8_0(ty: GgmlType, src: &[u8], dst: &mut [u8], vals: &mut [f32]) -> std::io::Result<()> {
    let bad = |e: crate::error::BackendError| std::io::Error::new(std::io::ErrorKind::InvalidData, e.to_string());
    if ty == GgmlType::Q5_0 {
        // Exact: the same f16 scale, values q - 16 in -16..=15.
        for (s, d) in src.chunks_exact(22).zip(dst.chunks_exact_mut(34)) {
            d[0..2].copy_from_slice(&s[0..2]);
            let qh = u32::from_le_bytes([s[2], s[3], s[4], s[5]]);
            for j in 0..16 {
                let lo = (s[6 + j] & 0xF) | ((((qh >> j) & 1) as u8) << 4);
                let hi = (s[6 + j] >> 4) | ((((qh >> (j + 16)) & 1) as u8) << 4);
                d[2 + j] = (lo as i8 - 16) as u8;
                d[2 + 16 + j] = (hi as i8 - 16) as u8;
            }
        }
        return Ok(());
    }
    quant::dequantize_row(ty, src, vals).map_err(bad)?;
    quant::quantize_row(GgmlType::Q8_0, vals, dst).map_err(bad)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn random_blocks(ty: GgmlType, rows: usize, cols: usize) -> Vec<u8> {
        let mut s = 0x9E37_79B9u64;
        let mut v: Vec<u8> = (0..ty.row_bytes(cols).expect("test data fits") * rows)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                s as u8
            })
            .collect();
        // Sane f16 scales (and Q5_1 minimums) at the start of every block.
        for b in v.chunks_exact_mut(ty.type_size()) {
            let (x, y) = (b[2] as f32, b[4] as f32);
            b[0..2].copy_from_slice(&half::f16::from_f32(0.01 + x * 1e-4).to_le_bytes());
            if ty == GgmlType::Q5_1 {
                b[2..4].copy_from_slice(&half::f16::from_f32(-0.1 + y * 1e-3).to_le_bytes());
            }
        }
        v
    }

    #[test]
    fn q5_0_converts_to_q8_0_tiles_exactly_and_q5_1_within_q8_0_rounding() {
        let (rows, cols) = (19, 96);
        for ty in [GgmlType::Q5_0, GgmlType::Q5_1] {
            let raw = random_blocks(ty, rows, cols);
            let m = WeightMatrix::from_host_bytes("w", ty, rows, cols, raw.clone()).expect("test data fits");
            let p = m.packed.as_ref().expect("converted to Q8_0 tiles");
            assert_eq!(p.kind, PackKind::Q8_0);
            let rb = ty.row_bytes(cols).expect("test data fits");
            let (mut want, mut got) = (vec![0f32; cols], vec![0f32; cols]);
            for r in 0..rows {
                quant::dequantize_row(ty, &raw[r * rb..(r + 1) * rb], &mut want).expect("test data fits");
                p.dequantize_row(r, &mut got);
                for (wb, gb) in want.chunks_exact(32).zip(got.chunks_exact(32)) {
                    // Q8_0 rounding: half a step of amax / 127, plus the f16 scale's rounding.
                    let amax = wb.iter().fold(0f32, |a, v| a.max(v.abs()));
                    let tol = if ty == GgmlType::Q5_0 { 0.0 } else { amax / 254.0 * 1.01 + amax * 1e-3 };
                    for (w, g) in wb.iter().zip(gb) {
                        assert!((w - g).abs() <= tol, "{ty} row {r}: {g} vs {w} (tolerance {tol})");
                    }
                }
            }
        }
    }
}
