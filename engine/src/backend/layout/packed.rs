//! Weights repacked at load for the integer GEMM/GEMV kernels, the activation format they
//! consume, and the scalar reference every SIMD kernel must equal bit for bit.
//!
//! # The packed layout
//! A matrix of Q4_0, Q4_1 or Q8_0 weights is cut into tiles of [`TILE_ROWS`] rows (the last tile
//! padded with zero rows). Each tile stores, block after block (32 columns each), one *record*:
//!
//! | type | record |
//! |---|---|
//! | Q4_0 | 16 × f16 scale `d`, then 4 chunks × 64 bytes of nibbles (288 B = 18 B per row-block, as GGUF) |
//! | Q4_1 | 16 × f16 `d`, 16 × f16 min `m`, then 4 × 64 nibble bytes (320 B = 20 B per row-block, as GGUF) |
//! | Q8_0 | 16 × f16 `d`, then 8 chunks × 64 bytes (544 B = 34 B per row-block, as GGUF) |
//!
//! A chunk holds 4 consecutive weights of each of the 16 rows (row `r` at bytes `4r..4r+4`), so
//! one 512-bit `vpdpbusd` (or four NEON `sdot`s) multiplies 16 rows by the same 4 activations.
//! Q4 chunk `c` is GGUF's `qs[4c..4c+4]` of each row: its low nibbles are weights `4c..4c+4`,
//! its high nibbles weights `16+4c..16+4c+4`. Q8_0 bytes are stored offset by 128 (`w ^ 0x80`),
//! so every weight is an *unsigned* byte: `u = w + o` with `o` = 8 (Q4_0), 0 (Q4_1), 128 (Q8_0).
//!
//! # The arithmetic (what every kernel computes, in this order)
//! Activations are quantized per 32-block to i8 (x · (127 / amax), rounded to nearest even), with
//! the scale kept as `a_d` = f16(amax / 127), per group of 4 values the integer sum `a_g`, and
//! `a_m` = f16(amax / 127 · Σ values). For row `r`, token `t` (groups `k` = elements `4k..4k+4`):
//!
//! ```text
//! lane[0..8] = 0, summs = 0
//! for each block b:
//!     for k in 0..8:
//!         isum = Σ_{i in group k} u[r,b,i] · a[t,b,i] − o · a_g[t,b,k]     (exact, i32)
//!         lane[k] = fma(d[r,b] · a_d[t,b], isum as f32, lane[k])
//!     Q4_1 only: summs = summs + m[r,b] · a_m[t,b]                        (not fused)
//! out = ((lane[4] + lane[0]) + (lane[6] + lane[2])) + ((lane[5] + lane[1]) + (lane[7] + lane[3])) + summs
//! ```
//! That is llama.cpp's x86 order for these types (`vpmaddubsw`/`vpmaddwd` lanes of four
//! products, one FMA per lane per block, `hsum_float_8`, then the Q4_1 minimum term), so our
//! logits reproduce its own. The integer part is exact; the float part is one fixed sequence per
//! row, the same in every SIMD lane of every kernel, so they equal [`reference`] bit for bit.
//!
//! # The output head's order ([`Order::BlockSum`])
//! The output head (logits) may instead sum each block in one integer:
//!
//! ```text
//! acc = 0, summs = 0
//! for each block b:
//!     isum = Σ_{i<32} u[r,b,i] · a[t,b,i] − o · a_s[t,b]                (exact, i32)
//!     acc = fma(d[r,b] · a_d[t,b], isum as f32, acc)
//!     Q4_1 only: summs = summs + m[r,b] · a_m[t,b]                        (not fused)
//! out = acc + summs (Q4_1), acc (the others)
//! ```
//! (llama.cpp's portable kernels' arithmetic: `sumi`, then `sumf += d · sumi`). One conversion
//! and one FMA per 512 multiply-adds instead of per 64, and four tokens share each unpacked
//! block: a batched decode pass's head runs at the memory's speed instead of the FMA pipes'
//! (B=8 pass measured below in docs/BENCHMARKS.md). Decision: only the head, because
//! its results are final. Every other matmul's output is re-quantized to int8 before the next
//! one, where a one-ulp difference can flip a rounding and grow through the layers (summing in
//! this order everywhere breaks the golden test's agreement with llama.cpp); logits
//! move by float rounding only (~1e-6 relative), far below the golden test's tolerances and
//! below any greedy margin it meets. Every kernel equals [`reference_order`] in both orders.

use crate::quant::GgmlType;
use half::f16;
use llmd_alloc_sys::{ArenaBuf, HugeArena};

/// Rows per tile: 16 i32 lanes of a 512-bit register; 4 NEON registers.
pub const TILE_ROWS: usize = 16;
/// Weights per block (the GGUF block size of Q4_0, Q4_1 and Q8_0).
pub const BLOCK: usize = 32;

/// The weight types that have a packed form.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PackKind {
    Q4_0,
    Q4_1,
    Q8_0,
}

impl PackKind {
    pub fn of(ty: GgmlType) -> Option<Self> {
        match ty {
            GgmlType::Q4_0 => Some(Self::Q4_0),
            GgmlType::Q4_1 => Some(Self::Q4_1),
            GgmlType::Q8_0 => Some(Self::Q8_0),
            _ => None,
        }
    }

    /// Bytes of one tile-block record.
    pub const fn record_bytes(self) -> usize {
        match self {
            Self::Q4_0 => 32 + 256,
            Self::Q4_1 => 64 + 256,
            Self::Q8_0 => 32 + 512,
        }
    }

    /// Offset of the weight bytes in a record.
    pub const fn qs_offset(self) -> usize {
        match self {
            Self::Q4_0 | Self::Q8_0 => 32,
            Self::Q4_1 => 64,
        }
    }

    /// The offset `o` subtracted from every unsigned weight.
    pub const fn offset(self) -> i32 {
        match self {
            Self::Q4_0 => 8,
            Self::Q4_1 => 0,
            Self::Q8_0 => 128,
        }
    }

    /// The GGML type whose blocks this layout holds.
    pub fn ggml_type(self) -> GgmlType {
        self.ggml()
    }

    fn ggml(self) -> GgmlType {
        match self {
            Self::Q4_0 => GgmlType::Q4_0,
            Self::Q4_1 => GgmlType::Q4_1,
            Self::Q8_0 => GgmlType::Q8_0,
        }
    }
}

/// A weight matrix in the packed layout.
pub struct PackedMatrix {
    pub kind: PackKind,
    pub rows: usize,
    pub cols: usize,
    data: Data,
}

/// Where a packed matrix's bytes live: its own heap allocation, or its buffer in the model's
/// huge-page arena ([`weight_arena`]).
enum Data {
    Heap(PageAligned),
    Arena(ArenaBuf),
}

/// The alignment of every packed matrix's bytes: a page, so that a device sharing the host's
/// memory can use them in place (OpenCL runtimes take a buffer over host memory without a copy
/// only where it starts on their `CL_DEVICE_MEM_BASE_ADDR_ALIGN`: 128 B for PoCL and Intel's
/// CPU runtime here; a page covers every such figure we know of). The arena's buffers start on
/// one too (`llmd_alloc_sys::HugeArena`).
pub const HOST_ALIGN: usize = 4096;

/// `len` zeroed bytes on the heap starting on a [`HOST_ALIGN`] boundary (a vector never
/// resized, with the aligned window inside it).
pub(crate) struct PageAligned {
    buf: Vec<u8>,
    off: usize,
    len: usize,
}

impl PageAligned {
    pub(crate) fn zeroed(len: usize) -> Self {
        let buf = vec![0u8; len + HOST_ALIGN - 1];
        let off = buf.as_ptr().align_offset(HOST_ALIGN).min(HOST_ALIGN - 1);
        Self { buf, off, len }
    }
}

impl std::ops::Deref for PageAligned {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.buf[self.off..self.off + self.len]
    }
}

impl AsRef<[u8]> for PageAligned {
    fn as_ref(&self) -> &[u8] {
        self
    }
}

impl std::ops::DerefMut for PageAligned {
    fn deref_mut(&mut self) -> &mut [u8] {
        &mut self.buf[self.off..self.off + self.len]
    }
}

impl Data {
    /// `n` zero bytes, from `arena` while it has room.
    fn zeroed(arena: Option<&HugeArena>, n: usize) -> Self {
        match arena.and_then(|a| a.alloc(n)) {
            Some(buf) => Data::Arena(buf),
            None => Data::Heap(PageAligned::zeroed(n)),
        }
    }
}

impl std::ops::Deref for Data {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Data::Heap(v) => v,
            Data::Arena(b) => b,
        }
    }
}

impl std::ops::DerefMut for Data {
    fn deref_mut(&mut self) -> &mut [u8] {
        match self {
            Data::Heap(v) => v,
            Data::Arena(b) => b,
        }
    }
}

/// An arena of `capacity` bytes for one model's packed matrices (see
/// `llmd_alloc_sys::HugeArena`: one mapping advised for transparent huge pages, so the
/// kernels' weight streams cross ~50 pages per pass instead of ~25,000). None when
/// `LLMD_HUGE_PAGES=0` (each matrix on the heap; for comparisons) or when the address space
/// cannot be reserved; a matrix that does not fit goes to the heap.
pub fn weight_arena(capacity: usize) -> Option<HugeArena> {
    static OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    if capacity == 0 || *OFF.get_or_init(|| std::env::var("LLMD_HUGE_PAGES").is_ok_and(|v| v == "0")) {
        return None;
    }
    match HugeArena::new(capacity) {
        Ok(a) => {
            tracing::debug!(capacity, huge_pages = a.huge_pages_advised(), "weight arena");
            Some(a)
        }
        Err(e) => {
            tracing::warn!(capacity, error = %e, "no weight arena; packed weights go to the heap");
            None
        }
    }
}

/// The packed bytes, tile after tile (what a device sharing the host's memory reads in place).
impl AsRef<[u8]> for PackedMatrix {
    fn as_ref(&self) -> &[u8] {
        &self.data
    }
}

impl PackedMatrix {
    /// Bytes of a packed `rows` × `cols` matrix of `kind` (None if `cols` is not whole
    /// blocks or the size overflows).
    pub fn packed_len(kind: PackKind, rows: usize, cols: usize) -> Option<usize> {
        if !cols.is_multiple_of(BLOCK) {
            return None;
        }
        rows.div_ceil(TILE_ROWS).checked_mul(cols / BLOCK)?.checked_mul(kind.record_bytes())
    }

    /// Packs `rows` GGUF rows of `kind` (each `cols` wide); `read(r0, buf)` fills `buf` with
    /// the whole rows starting at row `r0` (up to [`TILE_ROWS`] of them at a time).
    pub fn pack(
        kind: PackKind,
        rows: usize,
        cols: usize,
        read: impl FnMut(usize, &mut [u8]) -> std::io::Result<()>,
    ) -> std::io::Result<Self> {
        Self::pack_in(None, kind, rows, cols, read)
    }

    /// [`Self::pack`] into a buffer of `arena` when it has room.
    pub fn pack_in(
        arena: Option<&HugeArena>,
        kind: PackKind,
        rows: usize,
        cols: usize,
        mut read: impl FnMut(usize, &mut [u8]) -> std::io::Result<()>,
    ) -> std::io::Result<Self> {
        let invalid = |m: String| std::io::Error::new(std::io::ErrorKind::InvalidInput, m);
        if cols == 0 || !cols.is_multiple_of(BLOCK) {
            return Err(invalid(format!("{cols} columns are not whole blocks of {BLOCK}")));
        }
        let blocks = cols / BLOCK;
        let tiles = rows.div_ceil(TILE_ROWS);
        let rec = kind.record_bytes();
        let src_block = kind.ggml().type_size();
        let row_bytes = blocks * src_block;
        let mut data = Data::zeroed(arena, tiles * blocks * rec);
        let mut src = vec![0u8; TILE_ROWS * row_bytes];
        let qo = kind.qs_offset();
        for (tile, tdata) in data.chunks_exact_mut(blocks * rec).enumerate() {
            let r0 = tile * TILE_ROWS;
            let n = (rows - r0).min(TILE_ROWS);
            read(r0, &mut src[..n * row_bytes])?;
            for lane in 0..n {
                let srow = &src[lane * row_bytes..(lane + 1) * row_bytes];
                for (s, d) in srow.chunks_exact(src_block).zip(tdata.chunks_exact_mut(rec)) {
                    d[2 * lane..2 * lane + 2].copy_from_slice(&s[0..2]);
                    match kind {
                        PackKind::Q4_0 | PackKind::Q4_1 => {
                            let qs = if kind == PackKind::Q4_1 {
                                d[32 + 2 * lane..32 + 2 * lane + 2].copy_from_slice(&s[2..4]);
                                &s[4..20]
                            } else {
                                &s[2..18]
                            };
                            for c in 0..4 {
                                d[qo + 64 * c + 4 * lane..qo + 64 * c + 4 * lane + 4]
                                    .copy_from_slice(&qs[4 * c..4 * c + 4]);
                            }
                        }
                        PackKind::Q8_0 => {
                            for g in 0..8 {
                                for j in 0..4 {
                                    d[qo + 64 * g + 4 * lane + j] = s[2 + 4 * g + j] ^ 0x80;
                                }
                            }
                        }
                    }
                }
            }
        }
        Ok(Self { kind, rows, cols, data })
    }

    /// A Q8_0 matrix from int8 rows with one scale per row (every block of row `r` gets the
    /// scale `fill(r, buf)` returns after writing the row's `cols` int8 values into `buf`).
    /// This is how per-output-channel int8 weights (EdgeFlow, unpacked) run on the Q8_0 kernels.
    pub fn from_i8_rows<E>(
        rows: usize,
        cols: usize,
        row_buf: usize,
        fill: impl FnMut(usize, &mut [i8]) -> Result<f16, E>,
    ) -> Result<Self, E>
    where
        E: From<std::io::Error>,
    {
        Self::from_i8_rows_in(None, rows, cols, row_buf, fill)
    }

    /// [`Self::from_i8_rows`] into a buffer of `arena` when it has room.
    pub fn from_i8_rows_in<E>(
        arena: Option<&HugeArena>,
        rows: usize,
        cols: usize,
        row_buf: usize,
        mut fill: impl FnMut(usize, &mut [i8]) -> Result<f16, E>,
    ) -> Result<Self, E>
    where
        E: From<std::io::Error>,
    {
        if cols == 0 || !cols.is_multiple_of(BLOCK) || row_buf < cols {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("{cols} columns are not whole blocks of {BLOCK}"),
            )
            .into());
        }
        let kind = PackKind::Q8_0;
        let blocks = cols / BLOCK;
        let rec = kind.record_bytes();
        let qo = kind.qs_offset();
        let mut data = Data::zeroed(arena, rows.div_ceil(TILE_ROWS) * blocks * rec);
        let mut buf = vec![0i8; row_buf];
        for r in 0..rows {
            let (tile, lane) = (r / TILE_ROWS, r % TILE_ROWS);
            let d = fill(r, &mut buf)?.to_le_bytes();
            let tdata = &mut data[tile * blocks * rec..(tile + 1) * blocks * rec];
            for (b, rdata) in tdata.chunks_exact_mut(rec).enumerate() {
                rdata[2 * lane..2 * lane + 2].copy_from_slice(&d);
                let w = &buf[b * BLOCK..(b + 1) * BLOCK];
                for (g, quad) in w.chunks_exact(4).enumerate() {
                    // Four weights at once: the sign bit of each byte flips (w + 128).
                    let q =
                        u32::from_ne_bytes([quad[0] as u8, quad[1] as u8, quad[2] as u8, quad[3] as u8]) ^ 0x8080_8080;
                    let at = qo + 64 * g + 4 * lane;
                    rdata[at..at + 4].copy_from_slice(&q.to_ne_bytes());
                }
            }
        }
        Ok(Self { kind, rows, cols, data })
    }

    pub fn blocks(&self) -> usize {
        self.cols / BLOCK
    }

    pub fn tiles(&self) -> usize {
        self.rows.div_ceil(TILE_ROWS)
    }

    /// The records of one tile, block after block.
    pub fn tile(&self, t: usize) -> &[u8] {
        let n = self.blocks() * self.kind.record_bytes();
        &self.data[t * n..(t + 1) * n]
    }

    pub fn size_bytes(&self) -> usize {
        self.data.len()
    }

    /// Whether the bytes live in a weight arena (not on the heap).
    pub fn in_arena(&self) -> bool {
        matches!(self.data, Data::Arena(_))
    }

    /// Row `r` as f32 (the same values GGUF dequantization gives).
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        let (tile, lane) = (r / TILE_ROWS, r % TILE_ROWS);
        let t = self.tile(tile);
        let rec = self.kind.record_bytes();
        let qo = self.kind.qs_offset();
        for (b, o) in out.chunks_exact_mut(BLOCK).enumerate() {
            let d = &t[b * rec..(b + 1) * rec];
            let scale = f16::from_le_bytes([d[2 * lane], d[2 * lane + 1]]).to_f32();
            match self.kind {
                PackKind::Q4_0 | PackKind::Q4_1 => {
                    let (off, m) = if self.kind == PackKind::Q4_1 {
                        (0.0, f16::from_le_bytes([d[32 + 2 * lane], d[33 + 2 * lane]]).to_f32())
                    } else {
                        (8.0, 0.0)
                    };
                    for c in 0..4 {
                        for j in 0..4 {
                            let q = d[qo + 64 * c + 4 * lane + j];
                            o[4 * c + j] = ((q & 15) as f32 - off) * scale + m;
                            o[16 + 4 * c + j] = ((q >> 4) as f32 - off) * scale + m;
                        }
                    }
                }
                PackKind::Q8_0 => {
                    for g in 0..8 {
                        for j in 0..4 {
                            o[4 * g + j] = ((d[qo + 64 * g + 4 * lane + j] ^ 0x80) as i8) as f32 * scale;
                        }
                    }
                }
            }
        }
    }
}

/// Activations quantized for the packed kernels: per token, per 32-block, i8 values, an f32
/// scale and the integer sum of the values.
#[derive(Default)]
pub struct QuantActs {
    pub n: usize,
    pub cols: usize,
    pub qs: Vec<i8>,
    pub d: Vec<f32>,
    pub sum: Vec<i32>,
    /// `f16(d · sum)` per block: the term a Q4_1 minimum multiplies (llama.cpp's Q8_1 `s`).
    pub ms: Vec<f32>,
    /// Per block, the integer sums of its 8 groups of 4 values.
    pub gsum: Vec<i32>,
    /// Per block, the offset terms `−o · a_g` ready to add: 8 for `o` = 8 (Q4_0), then 8 for
    /// `o` = 128 (Q8_0), so a kernel broadcasts them straight from memory.
    pub gcorr: Vec<i32>,
}

impl QuantActs {
    /// Sizes the buffers for `n` rows of `cols` (a multiple of 32).
    pub fn resize(&mut self, n: usize, cols: usize) {
        let blocks = cols / BLOCK;
        self.n = n;
        self.cols = cols;
        self.qs.resize(n * cols, 0);
        self.d.resize(n * blocks, 0.0);
        self.sum.resize(n * blocks, 0);
        self.ms.resize(n * blocks, 0.0);
        self.gsum.resize(n * blocks * 8, 0);
        self.gcorr.resize(n * blocks * 16, 0);
    }

    pub fn blocks(&self) -> usize {
        self.cols / BLOCK
    }
}

/// The slices of a [`QuantActs`] that one run of the CPU's `quantize_rows` fills (whole blocks).
pub struct QuantOut<'a> {
    pub qs: &'a mut [i8],
    pub d: &'a mut [f32],
    pub sum: &'a mut [i32],
    pub ms: &'a mut [f32],
    pub gsum: &'a mut [i32],
    pub gcorr: &'a mut [i32],
}

/// The definition every quantizer must equal bit for bit.
#[inline(always)]
pub fn quantize_rows_body(x: &[f32], o: QuantOut<'_>) {
    let QuantOut { qs, d, sum, ms, gsum, gcorr } = o;
    for (i, (xb, qb)) in x.chunks_exact(BLOCK).zip(qs.chunks_exact_mut(BLOCK)).enumerate() {
        let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
        let dd = amax / 127.0;
        // 127 / amax, not 1 / d: the same rounding as llama.cpp's x86 quantizer.
        let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
        let mut s = 0i32;
        for (k, (q4, x4)) in qb.chunks_exact_mut(4).zip(xb.chunks_exact(4)).enumerate() {
            let mut g = 0i32;
            for (q, &v) in q4.iter_mut().zip(x4) {
                let r = (v * id).round_ties_even() as i32;
                *q = r as i8;
                g += r;
            }
            gsum[i * 8 + k] = g;
            gcorr[i * 16 + k] = -8 * g;
            gcorr[i * 16 + 8 + k] = -128 * g;
            s += g;
        }
        // Scales are rounded to f16 as llama.cpp's Q8_0 / Q8_1 blocks store them (the values
        // were quantized with the unrounded scale), which keeps logits within its own noise.
        d[i] = f16::from_f32(dd).to_f32();
        sum[i] = s;
        ms[i] = f16::from_f32(dd * s as f32).to_f32();
    }
}

/// llama.cpp's `hsum_float_8` order over the 8 group lanes.
#[inline(always)]
pub(crate) fn hsum8(l: &[f32; 8]) -> f32 {
    ((l[4] + l[0]) + (l[6] + l[2])) + ((l[5] + l[1]) + (l[7] + l[3]))
}

/// Weight `e` (0..32) of row `lane` in block record `d`, as the unsigned value `u = w + o` the
/// kernels multiply (see the layout above).
#[inline(always)]
pub(crate) fn unsigned_weight(kind: PackKind, d: &[u8], lane: usize, e: usize) -> i32 {
    let qo = kind.qs_offset();
    let (k, i) = (e / 4, e % 4);
    match kind {
        PackKind::Q4_0 | PackKind::Q4_1 => {
            let q = d[qo + 64 * (k % 4) + 4 * lane + i] as i32;
            if k < 4 {
                q & 15
            } else {
                q >> 4
            }
        }
        PackKind::Q8_0 => d[qo + 64 * k + 4 * lane + i] as i32,
    }
}

/// The float accumulation order of a packed matmul (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Order {
    /// llama.cpp's x86 order: eight float lanes per block. Every matmul but the output head.
    Lanes,
    /// One integer sum per block, one FMA. The output head.
    BlockSum,
}

/// The scalar reference in llama.cpp's order ([`Order::Lanes`]): `out[j * TILE_ROWS + lane]`
/// for tokens `t0..t0+nt`, rows of tile `tile`.
pub fn reference(w: &PackedMatrix, tile: usize, a: &QuantActs, t0: usize, nt: usize, out: &mut [f32]) {
    reference_order(Order::Lanes, w, tile, a, t0, nt, out)
}

/// The scalar reference in either order, exactly as the module docs write them.
pub fn reference_order(
    order: Order,
    w: &PackedMatrix,
    tile: usize,
    a: &QuantActs,
    t0: usize,
    nt: usize,
    out: &mut [f32],
) {
    let blocks = w.blocks();
    let rec = w.kind.record_bytes();
    let o = w.kind.offset();
    let tdata = w.tile(tile);
    for j in 0..nt {
        let t = t0 + j;
        for lane in 0..TILE_ROWS {
            let mut lanes = [0f32; 8];
            let mut acc = 0f32;
            let mut summs = 0f32;
            for b in 0..blocks {
                let d = &tdata[b * rec..(b + 1) * rec];
                let ab = t * blocks + b;
                let aq = &a.qs[ab * BLOCK..(ab + 1) * BLOCK];
                let wd = f16::from_le_bytes([d[2 * lane], d[2 * lane + 1]]).to_f32();
                let scale = wd * a.d[ab];
                match order {
                    Order::Lanes => {
                        for (k, l) in lanes.iter_mut().enumerate() {
                            let mut isum = -o * a.gsum[ab * 8 + k];
                            for i in 0..4 {
                                isum += unsigned_weight(w.kind, d, lane, 4 * k + i) * aq[4 * k + i] as i32;
                            }
                            *l = scale.mul_add(isum as f32, *l);
                        }
                    }
                    Order::BlockSum => {
                        let mut isum = -o * a.sum[ab];
                        for (e, &q) in aq.iter().enumerate() {
                            isum += unsigned_weight(w.kind, d, lane, e) * q as i32;
                        }
                        acc = scale.mul_add(isum as f32, acc);
                    }
                }
                if w.kind == PackKind::Q4_1 {
                    let m = f16::from_le_bytes([d[32 + 2 * lane], d[33 + 2 * lane]]).to_f32();
                    summs += m * a.ms[ab];
                }
            }
            out[j * TILE_ROWS + lane] = match order {
                Order::Lanes => hsum8(&lanes) + summs,
                Order::BlockSum if w.kind == PackKind::Q4_1 => acc + summs,
                Order::BlockSum => acc,
            };
        }
    }
}
