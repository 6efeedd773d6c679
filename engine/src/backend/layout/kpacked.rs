//! K-quant weights (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K) repacked at load for the integer kernels,
//! the Q8_K activations they consume, and the scalar reference every SIMD kernel must equal
//! bit for bit. The kernels: AVX-512 VNNI (`cpu/arch/x86/kpacked.rs`), AVX2 (`cpu/arch/x86/kpacked_avx2.rs`) and NEON
//! with the dot-product extension (`cpu/arch/arm/kpacked.rs`).
//!
//! # Why a layout of their own
//! A K-quant super-block covers 256 columns of one row: a float scale `d` (and for some types a
//! float `dmin`), one small integer scale (and minimum) per group of 16 or 32 columns, and
//! 2 to 6 bits per weight. The packed kernels of `packed.rs` multiply 16 rows by 4 activations
//! per instruction; here the same instruction runs over a *tile* of 16 rows × 256 columns, and
//! the per-group integer scales are applied to whole-group integer sums, as llama.cpp's own
//! K-quant dot products do. The weight bits stay as narrow as in the file (decode reads every
//! weight once per token: it is memory-bound, and widening 4.5–6.6 bits to 8 would cost decode
//! speed in proportion), so a tile's record is the same size as the file's 16 rows, or a few
//! percent more where a 6-bit scale is stored as a byte.
//!
//! # The record of one tile (16 rows) and one super-block (256 columns)
//! | part | bytes | holds |
//! |---|---|---|
//! | `d` | 32 | 16 × f16, one per row |
//! | `dmin` | 32 | 16 × f16 (Q2_K, Q4_K, Q5_K only) |
//! | scales | 16 × groups | group-major: byte `16g + r` is row `r`'s scale of group `g` (u8; i8 for Q3_K/Q6_K, already minus 32 for Q3_K; Q2_K: scale in the low nibble, minimum in the high) |
//! | mins | 16 × groups | Q4_K/Q5_K only, in group *pairs*: byte `32p + 2r + e` is row `r`'s minimum of group `2p + e` |
//! | base bits | 512 × bits | 4 bits (Q4_K, Q5_K, Q6_K) or 2 bits (Q2_K, Q3_K) of every weight |
//! | high bits | 512 × bits | the 5th bit (Q5_K), 6th–5th (Q6_K) or 3rd (Q3_K) |
//!
//! A *chunk* is 4 consecutive columns of all 16 rows (64 weights), numbered `k` = 0..64 along
//! the super-block; in every 64-byte plane block, byte `4r + j` belongs to row `r`, column
//! `4k + j`. Base bits: 4-bit blocks hold chunks `2i` (low nibbles) and `2i + 1` (high); 2-bit
//! blocks hold chunks `4i + c` at bits `2c`. High bits: 1-bit blocks hold chunks `8i + c` at bit
//! `c`; 2-bit blocks chunks `4i + c` at bits `2c`. Every weight is an unsigned integer
//! `u = base | high << base_bits` (0..2^bits) that one `vpdpbusd` / `sdot` multiplies by a
//! signed activation byte.
//!
//! # The arithmetic (what every kernel computes, in this order)
//! Activations are Q8_K (as llama.cpp quantizes them for these types: per 256 values, the value
//! of largest magnitude `max` gives `q = min(round(−127 / max · x), 127)` and the f32 scale
//! `a_d = 1 / (−127 / max)`; the sums of each 16 values are kept). For row `r`, token `t`, per
//! super-block, with group sums `dot_g = Σ u·q` and activation sums `s_g = Σ q` over group `g`:
//!
//! ```text
//! SI = Σ_g sc_g · (dot_g − o · s_g)         (exact, i32; o = 32 for Q6_K, 4 for Q3_K, else 0)
//! SM = Σ_g m_g · s_g                         (exact, i32; types with minimums)
//! acc = fma(d · a_d, SI as f32, acc)
//! acc = fma(−(dmin · a_d), SM as f32, acc)   (types with minimums)
//! out = acc (after the last super-block)
//! ```
//! Integer parts are exact (kernels may sum them in any order); the float part is this one
//! sequence per row, so every kernel equals [`reference`] bit for bit. llama.cpp computes the
//! same integers and sums its floats in another order, so logits agree to float rounding.

use super::packed::{PageAligned, TILE_ROWS};
use crate::format::ModelBytes;
use crate::quant::{q3k_scales, GgmlType};
use half::f16;
use llmd_alloc_sys::{ArenaBuf, HugeArena};
use std::ops::Range;
use std::sync::Arc;

/// Columns per super-block.
pub const SB: usize = 256;

/// The version of the record layout above. llmd files store packed records as they are
/// (`TensorKind::KPacked`, tagged with this number, so loading is a read); any change to the
/// layout must bump it, and a file with another number is refused with "convert it again".
pub const RECORD_LAYOUT: u32 = 1;

/// The K-quant types that have a packed form.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KKind {
    Q2K,
    Q3K,
    Q4K,
    Q5K,
    Q6K,
}

impl KKind {
    pub fn of(ty: GgmlType) -> Option<Self> {
        match ty {
            GgmlType::Q2_K => Some(Self::Q2K),
            GgmlType::Q3_K => Some(Self::Q3K),
            GgmlType::Q4_K => Some(Self::Q4K),
            GgmlType::Q5_K => Some(Self::Q5K),
            GgmlType::Q6_K => Some(Self::Q6K),
            _ => None,
        }
    }

    pub fn ggml(self) -> GgmlType {
        match self {
            Self::Q2K => GgmlType::Q2_K,
            Self::Q3K => GgmlType::Q3_K,
            Self::Q4K => GgmlType::Q4_K,
            Self::Q5K => GgmlType::Q5_K,
            Self::Q6K => GgmlType::Q6_K,
        }
    }

    /// Columns per scale group.
    pub const fn group(self) -> usize {
        match self {
            Self::Q4K | Self::Q5K => 32,
            _ => 16,
        }
    }

    pub const fn groups(self) -> usize {
        SB / self.group()
    }

    pub const fn base_bits(self) -> usize {
        match self {
            Self::Q2K | Self::Q3K => 2,
            _ => 4,
        }
    }

    pub const fn high_bits(self) -> usize {
        match self {
            Self::Q3K | Self::Q5K => 1,
            Self::Q6K => 2,
            _ => 0,
        }
    }

    /// Whether the type has per-group minimums (and a `dmin`).
    pub const fn has_min(self) -> bool {
        matches!(self, Self::Q2K | Self::Q4K | Self::Q5K)
    }

    /// The offset `o` subtracted from every unsigned weight (types without minimums).
    pub const fn offset(self) -> i32 {
        match self {
            Self::Q3K => 4,
            Self::Q6K => 32,
            _ => 0,
        }
    }

    pub const fn dmin_off(self) -> usize {
        32
    }

    pub const fn scales_off(self) -> usize {
        if self.has_min() {
            64
        } else {
            32
        }
    }

    pub const fn mins_off(self) -> usize {
        self.scales_off() + 16 * self.groups()
    }

    /// Bytes of the separate minimums (Q4_K, Q5_K; Q2_K keeps them with the scales).
    pub const fn mins_bytes(self) -> usize {
        match self {
            Self::Q4K | Self::Q5K => 16 * self.groups(),
            _ => 0,
        }
    }

    pub const fn base_off(self) -> usize {
        self.mins_off() + self.mins_bytes()
    }

    pub const fn high_off(self) -> usize {
        self.base_off() + 512 * self.base_bits()
    }

    /// Bytes of one tile-super-block record.
    pub const fn record_bytes(self) -> usize {
        self.high_off() + 512 * self.high_bits()
    }
}

/// `KKind` as a const parameter of the kernels (one inner loop per type, no branches).
pub const K_Q2K: u8 = 0;
pub const K_Q3K: u8 = 1;
pub const K_Q4K: u8 = 2;
pub const K_Q5K: u8 = 3;
pub const K_Q6K: u8 = 4;

/// The `KKind` of a `KIND` const parameter.
pub const fn kind_of<const KIND: u8>() -> KKind {
    match KIND {
        K_Q2K => KKind::Q2K,
        K_Q3K => KKind::Q3K,
        K_Q4K => KKind::Q4K,
        K_Q5K => KKind::Q5K,
        _ => KKind::Q6K,
    }
}

/// One GGUF super-block of one row, decoded to what a record stores.
struct Decoded {
    d: u16,
    dmin: u16,
    /// Unsigned weights `u`.
    u: [u8; SB],
    /// Scale per group (as stored: i8 bits for Q3_K/Q6_K).
    sc: [u8; 16],
    /// Minimum per group.
    m: [u8; 16],
}

fn le16(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

/// 6-bit scale and min `j` of a Q4_K/Q5_K super-block (ggml's `get_scale_min_k4`).
fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        ((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4))
    }
}

fn decode(kind: KKind, b: &[u8]) -> Decoded {
    let mut o = Decoded { d: 0, dmin: 0, u: [0; SB], sc: [0; 16], m: [0; 16] };
    match kind {
        KKind::Q2K => {
            o.d = le16(b, 80);
            o.dmin = le16(b, 82);
            for ((sc, m), &v) in o.sc.iter_mut().zip(o.m.iter_mut()).zip(&b[..16]) {
                *sc = v & 0xF;
                *m = v >> 4;
            }
            for n in 0..2 {
                for j in 0..4 {
                    for l in 0..32 {
                        o.u[128 * n + 32 * j + l] = (b[16 + 32 * n + l] >> (2 * j)) & 3;
                    }
                }
            }
        }
        KKind::Q3K => {
            o.d = le16(b, 108);
            let sc = q3k_scales(&b[96..108]);
            for (o, &v) in o.sc.iter_mut().zip(&sc) {
                *o = (v as i8 - 32) as u8;
            }
            for n in 0..2 {
                for j in 0..4 {
                    for l in 0..32 {
                        let low = (b[32 + 32 * n + l] >> (2 * j)) & 3;
                        let h = (b[l] >> (4 * n + j)) & 1;
                        o.u[128 * n + 32 * j + l] = low | (h << 2);
                    }
                }
            }
        }
        KKind::Q4K | KKind::Q5K => {
            o.d = le16(b, 0);
            o.dmin = le16(b, 2);
            let scales = &b[4..16];
            for g in 0..8 {
                (o.sc[g], o.m[g]) = scale_min_k4(g, scales);
            }
            let (qh, ql) = if kind == KKind::Q5K { (&b[16..48], &b[48..176]) } else { (&b[0..0], &b[16..144]) };
            for p in 0..4 {
                for l in 0..32 {
                    let q = ql[32 * p + l];
                    let (mut lo, mut hi) = (q & 0xF, q >> 4);
                    if kind == KKind::Q5K {
                        lo |= ((qh[l] >> (2 * p)) & 1) << 4;
                        hi |= ((qh[l] >> (2 * p + 1)) & 1) << 4;
                    }
                    o.u[64 * p + l] = lo;
                    o.u[64 * p + 32 + l] = hi;
                }
            }
        }
        KKind::Q6K => {
            o.d = le16(b, 208);
            o.sc.copy_from_slice(&b[192..208]);
            let (ql, qh) = (&b[0..128], &b[128..192]);
            for n in 0..2 {
                let (ql, qh) = (&ql[64 * n..64 * n + 64], &qh[32 * n..32 * n + 32]);
                for l in 0..32 {
                    let base = 128 * n + l;
                    o.u[base] = (ql[l] & 0xF) | ((qh[l] & 3) << 4);
                    o.u[base + 32] = (ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4);
                    o.u[base + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
                    o.u[base + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
                }
            }
        }
    }
    o
}

/// Where a packed matrix's bytes live.
enum Data {
    Heap(PageAligned),
    Arena(ArenaBuf),
    /// In place in a mapped llmd file that stores the records (no copy: the page cache's
    /// pages are the weights, filled by the storage's own transfers).
    File(Arc<ModelBytes>, Range<usize>),
}

impl Data {
    /// A zeroed buffer of `len` bytes in `arena` when it has room, else on the heap.
    fn alloc(arena: Option<&HugeArena>, len: usize) -> Self {
        match arena.and_then(|a| a.alloc(len)) {
            Some(buf) => Data::Arena(buf),
            None => Data::Heap(PageAligned::zeroed(len)),
        }
    }

    /// The bytes to fill, for the buffers this process owns.
    fn owned_mut(&mut self) -> &mut [u8] {
        match self {
            Data::Heap(v) => v,
            Data::Arena(b) => b,
            Data::File(..) => &mut [],
        }
    }
}

impl std::ops::Deref for Data {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Data::Heap(v) => v,
            Data::Arena(b) => b,
            Data::File(f, r) => &f[r.clone()],
        }
    }
}

/// A K-quant weight matrix in the packed layout.
pub struct KPackedMatrix {
    pub kind: KKind,
    pub rows: usize,
    pub cols: usize,
    data: Data,
}

/// The records, tile after tile (what a device sharing the host's memory reads in place).
impl AsRef<[u8]> for KPackedMatrix {
    fn as_ref(&self) -> &[u8] {
        &self.data
    }
}

impl KPackedMatrix {
    /// Bytes of a packed `rows` × `cols` matrix of `kind` (None if `cols` is not whole
    /// super-blocks or the size overflows).
    pub fn packed_len(kind: KKind, rows: usize, cols: usize) -> Option<usize> {
        if !cols.is_multiple_of(SB) {
            return None;
        }
        rows.div_ceil(TILE_ROWS).checked_mul(cols / SB)?.checked_mul(kind.record_bytes())
    }

    /// Packs `rows` GGUF rows of `kind` (each `cols` wide) into a buffer of `arena` when it has
    /// room; `read(r0, buf)` fills `buf` with the whole rows starting at row `r0` (up to
    /// [`TILE_ROWS`] of them at a time).
    pub fn pack_in(
        arena: Option<&HugeArena>,
        kind: KKind,
        rows: usize,
        cols: usize,
        mut read: impl FnMut(usize, &mut [u8]) -> std::io::Result<()>,
    ) -> std::io::Result<Self> {
        let invalid = |m: String| std::io::Error::new(std::io::ErrorKind::InvalidInput, m);
        if cols == 0 || !cols.is_multiple_of(SB) {
            return Err(invalid(format!("{cols} columns are not whole super-blocks of {SB}")));
        }
        let Some(len) = Self::packed_len(kind, rows, cols) else {
            return Err(invalid(format!("{rows} x {cols} is too large")));
        };
        let sbs = cols / SB;
        let rec = kind.record_bytes();
        let src_block = kind.ggml().type_size();
        let row_bytes = sbs * src_block;
        let mut data = Data::alloc(arena, len);
        let mut src = vec![0u8; TILE_ROWS * row_bytes];
        for (tile, tdata) in data.owned_mut().chunks_exact_mut(sbs * rec).enumerate() {
            let r0 = tile * TILE_ROWS;
            let n = (rows - r0).min(TILE_ROWS);
            read(r0, &mut src[..n * row_bytes])?;
            for lane in 0..n {
                let srow = &src[lane * row_bytes..(lane + 1) * row_bytes];
                for (s, d) in srow.chunks_exact(src_block).zip(tdata.chunks_exact_mut(rec)) {
                    write_lane(kind, &decode(kind, s), lane, d);
                }
            }
        }
        Ok(Self { kind, rows, cols, data })
    }

    /// Checks that `len` bytes are the records of a `rows` × `cols` matrix of `kind`.
    fn check_records(kind: KKind, rows: usize, cols: usize, len: usize) -> std::io::Result<()> {
        let invalid = |m: String| std::io::Error::new(std::io::ErrorKind::InvalidData, m);
        let want = Self::packed_len(kind, rows, cols)
            .ok_or_else(|| invalid(format!("{rows} x {cols} is not whole super-blocks of {SB}")))?;
        if len != want {
            return Err(invalid(format!(
                "{len} bytes of packed {} records for {rows} x {cols} (expected {want})",
                kind.ggml().name()
            )));
        }
        Ok(())
    }

    /// A matrix from records packed before (an llmd file stores [`Self::records`] as they are,
    /// tagged with [`RECORD_LAYOUT`]), copied into a buffer of `arena` when it has room.
    pub fn from_records_in(
        arena: Option<&HugeArena>,
        kind: KKind,
        rows: usize,
        cols: usize,
        records: &[u8],
    ) -> std::io::Result<Self> {
        Self::check_records(kind, rows, cols, records.len())?;
        let mut data = Data::alloc(arena, records.len());
        data.owned_mut().copy_from_slice(records);
        Ok(Self { kind, rows, cols, data })
    }

    /// A matrix whose records are `range` of a mapped file, used in place (no copy). The
    /// records must start on a 64-byte boundary of the map (llmd tensors do).
    pub fn from_file(
        file: Arc<ModelBytes>,
        range: Range<usize>,
        kind: KKind,
        rows: usize,
        cols: usize,
    ) -> std::io::Result<Self> {
        Self::check_records(kind, rows, cols, range.len())?;
        let bytes = file.get(range.clone()).ok_or(std::io::ErrorKind::UnexpectedEof)?;
        if !(bytes.as_ptr() as usize).is_multiple_of(64) {
            return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, "packed records not 64-byte aligned"));
        }
        Ok(Self { kind, rows, cols, data: Data::File(file, range) })
    }

    /// Whether the records are used in place from a mapped file.
    pub fn in_file(&self) -> bool {
        matches!(self.data, Data::File(..))
    }

    /// The mapped file and the range of it the records are, when they are used in place.
    pub(crate) fn file_range(&self) -> Option<(&Arc<ModelBytes>, &Range<usize>)> {
        match &self.data {
            Data::File(f, r) => Some((f, r)),
            _ => None,
        }
    }

    /// The packed records, tile after tile (what [`Self::from_records_in`] takes back).
    pub fn records(&self) -> &[u8] {
        &self.data
    }

    pub fn superblocks(&self) -> usize {
        self.cols / SB
    }

    pub fn tiles(&self) -> usize {
        self.rows.div_ceil(TILE_ROWS)
    }

    /// The records of one tile, super-block after super-block.
    pub fn tile(&self, t: usize) -> &[u8] {
        let n = self.superblocks() * self.kind.record_bytes();
        &self.data[t * n..(t + 1) * n]
    }

    pub fn size_bytes(&self) -> usize {
        self.data.len()
    }

    pub fn in_arena(&self) -> bool {
        matches!(self.data, Data::Arena(_))
    }

    /// Row `r` as f32: the same values GGUF dequantization gives, bit for bit.
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        let (tile, lane) = (r / TILE_ROWS, r % TILE_ROWS);
        let t = self.tile(tile);
        let rec = self.kind.record_bytes();
        let k = self.kind;
        let gsz = k.group();
        for (b, o) in out.chunks_exact_mut(SB).enumerate() {
            let d = &t[b * rec..(b + 1) * rec];
            let dd = f16::from_bits(le16(d, 2 * lane)).to_f32();
            let dmin = if k.has_min() { f16::from_bits(le16(d, k.dmin_off() + 2 * lane)).to_f32() } else { 0.0 };
            for (e, v) in o.iter_mut().enumerate() {
                let g = e / gsz;
                let u = unsigned_weight(k, d, lane, e) as f32;
                let (sc, m) = scale_min(k, d, lane, g);
                // The expression order of ggml's dequantize_row_* for each type.
                *v = match k {
                    KKind::Q6K => dd * sc as f32 * (u - 32.0),
                    KKind::Q3K => (dd * sc as f32) * (u - 4.0),
                    _ => (dd * sc as f32) * u - dmin * m as f32,
                };
            }
        }
    }
}

/// Writes one row's decoded super-block into lane `lane` of a record.
fn write_lane(kind: KKind, s: &Decoded, lane: usize, d: &mut [u8]) {
    d[2 * lane..2 * lane + 2].copy_from_slice(&s.d.to_le_bytes());
    if kind.has_min() {
        let o = kind.dmin_off() + 2 * lane;
        d[o..o + 2].copy_from_slice(&s.dmin.to_le_bytes());
    }
    let so = kind.scales_off();
    for g in 0..kind.groups() {
        d[so + 16 * g + lane] = if kind == KKind::Q2K { s.sc[g] | (s.m[g] << 4) } else { s.sc[g] };
    }
    if kind.mins_bytes() > 0 {
        let mo = kind.mins_off();
        for g in 0..kind.groups() {
            d[mo + 32 * (g / 2) + 2 * lane + g % 2] = s.m[g];
        }
    }
    let (bo, ho) = (kind.base_off(), kind.high_off());
    match (kind.base_bits(), kind.high_bits()) {
        (4, 0) => write_bits::<4, 0>(&s.u, lane, d, bo, ho),
        (4, 1) => write_bits::<4, 1>(&s.u, lane, d, bo, ho),
        (4, 2) => write_bits::<4, 2>(&s.u, lane, d, bo, ho),
        (2, 0) => write_bits::<2, 0>(&s.u, lane, d, bo, ho),
        _ => write_bits::<2, 1>(&s.u, lane, d, bo, ho),
    }
}

/// The bit planes of one row's unsigned weights `u` into lane `lane` (the layout in the module
/// docs: `BB` base bits, `HB` high bits; constants, so the loop has no divisions).
#[inline(always)]
fn write_bits<const BB: usize, const HB: usize>(u: &[u8; SB], lane: usize, d: &mut [u8], bo: usize, ho: usize) {
    let per_base = 8 / BB;
    for (k, quad) in u.chunks_exact(4).enumerate() {
        let at = 4 * lane;
        let bs = BB * (k % per_base);
        let base = &mut d[bo + 64 * (k / per_base) + at..][..4];
        for (o, &v) in base.iter_mut().zip(quad) {
            *o |= (v & ((1 << BB) - 1)) << bs;
        }
        if let Some(per_high) = 8usize.checked_div(HB) {
            let hs = HB * (k % per_high);
            let high = &mut d[ho + 64 * (k / per_high) + at..][..4];
            for (o, &v) in high.iter_mut().zip(quad) {
                *o |= (v >> BB) << hs;
            }
        }
    }
}

/// Weight `e` (0..256) of row `lane` in record `d`, as the unsigned value `u`.
#[inline(always)]
pub(crate) fn unsigned_weight(kind: KKind, d: &[u8], lane: usize, e: usize) -> i32 {
    let (bb, hb) = (kind.base_bits(), kind.high_bits());
    let (k, j) = (e / 4, e % 4);
    let at = 4 * lane + j;
    let per_base = 8 / bb;
    let base = (d[kind.base_off() + 64 * (k / per_base) + at] >> (bb * (k % per_base))) & ((1 << bb) - 1);
    let high = match 8usize.checked_div(hb) {
        Some(per_high) => (d[kind.high_off() + 64 * (k / per_high) + at] >> (hb * (k % per_high))) & ((1 << hb) - 1),
        None => 0,
    };
    (base | (high << bb)) as i32
}

/// Scale and minimum of group `g` of row `lane` in record `d` (the scale signed for Q3_K/Q6_K).
#[inline(always)]
pub(crate) fn scale_min(kind: KKind, d: &[u8], lane: usize, g: usize) -> (i32, i32) {
    let s = d[kind.scales_off() + 16 * g + lane];
    match kind {
        KKind::Q2K => ((s & 0xF) as i32, (s >> 4) as i32),
        KKind::Q3K | KKind::Q6K => (s as i8 as i32, 0),
        KKind::Q4K | KKind::Q5K => (s as i32, d[kind.mins_off() + 32 * (g / 2) + 2 * lane + g % 2] as i32),
    }
}

/// Activations quantized to Q8_K for the K-quant kernels: per token, per super-block, 256 i8
/// values, the f32 scale, and the sums of each 16 and each 32 values (i16).
#[derive(Default)]
pub struct KActs {
    pub n: usize,
    pub cols: usize,
    pub qs: Vec<i8>,
    pub d: Vec<f32>,
    /// Per token-super-block: 16 sums of 16 values.
    pub bs16: Vec<i16>,
    /// Per token-super-block: 8 sums of 32 values.
    pub bs32: Vec<i16>,
}

impl KActs {
    pub fn resize(&mut self, n: usize, cols: usize) {
        let sbs = cols / SB;
        self.n = n;
        self.cols = cols;
        self.qs.resize(n * cols, 0);
        self.d.resize(n * sbs, 0.0);
        self.bs16.resize(n * sbs * 16, 0);
        self.bs32.resize(n * sbs * 8, 0);
    }

    pub fn superblocks(&self) -> usize {
        self.cols / SB
    }
}

/// The slices of a [`KActs`] one run of the CPU's `quantize_rows` fills (whole super-blocks).
pub struct KActsOut<'a> {
    pub qs: &'a mut [i8],
    pub d: &'a mut [f32],
    pub bs16: &'a mut [i16],
    pub bs32: &'a mut [i16],
}

/// The definition (llama.cpp's `quantize_row_q8_K_ref`): every quantizer equals it.
#[inline(always)]
pub fn quantize_rows_body(x: &[f32], o: KActsOut<'_>) {
    let KActsOut { qs, d, bs16, bs32 } = o;
    for (i, (xb, qb)) in x.chunks_exact(SB).zip(qs.chunks_exact_mut(SB)).enumerate() {
        let (mut amax, mut max) = (0f32, 0f32);
        for &v in xb {
            if v.abs() > amax {
                amax = v.abs();
                max = v;
            }
        }
        if amax == 0.0 {
            qb.fill(0);
            d[i] = 0.0;
            bs16[16 * i..16 * i + 16].fill(0);
            bs32[8 * i..8 * i + 8].fill(0);
            continue;
        }
        let iscale = -127.0 / max;
        for (q, &v) in qb.iter_mut().zip(xb) {
            *q = ((iscale * v).round_ties_even() as i32).min(127) as i8;
        }
        for g in 0..16 {
            bs16[16 * i + g] = qb[16 * g..16 * g + 16].iter().map(|&q| q as i16).sum();
        }
        for g in 0..8 {
            bs32[8 * i + g] = bs16[16 * i + 2 * g] + bs16[16 * i + 2 * g + 1];
        }
        d[i] = 1.0 / iscale;
    }
}

/// The scalar reference: `out[j * TILE_ROWS + lane]` for tokens `t0..t0+nt`, rows of tile
/// `tile`, exactly as the module docs write it.
pub fn reference(w: &KPackedMatrix, tile: usize, a: &KActs, t0: usize, nt: usize, out: &mut [f32]) {
    let k = w.kind;
    let sbs = w.superblocks();
    let rec = k.record_bytes();
    let gsz = k.group();
    let tdata = w.tile(tile);
    for j in 0..nt {
        let t = t0 + j;
        for lane in 0..TILE_ROWS {
            let mut acc = 0f32;
            for b in 0..sbs {
                let d = &tdata[b * rec..(b + 1) * rec];
                let ab = t * sbs + b;
                let aq = &a.qs[ab * SB..(ab + 1) * SB];
                let (mut si, mut sm) = (0i32, 0i32);
                for g in 0..k.groups() {
                    let s_g = if gsz == 16 { a.bs16[16 * ab + g] } else { a.bs32[8 * ab + g] } as i32;
                    let mut dot = 0i32;
                    for (e, &q) in aq.iter().enumerate().skip(g * gsz).take(gsz) {
                        dot += unsigned_weight(k, d, lane, e) * q as i32;
                    }
                    let (sc, m) = scale_min(k, d, lane, g);
                    si += sc * (dot - k.offset() * s_g);
                    sm += m * s_g;
                }
                let wd = f16::from_bits(le16(d, 2 * lane)).to_f32();
                acc = (wd * a.d[ab]).mul_add(si as f32, acc);
                if k.has_min() {
                    let dmin = f16::from_bits(le16(d, k.dmin_off() + 2 * lane)).to_f32();
                    acc = (-(dmin * a.d[ab])).mul_add(sm as f32, acc);
                }
            }
            out[j * TILE_ROWS + lane] = acc;
        }
    }
}
