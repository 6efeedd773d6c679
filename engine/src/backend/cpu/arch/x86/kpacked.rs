//! AVX-512 VNNI kernels over the K-quant packed layout (see `kpacked.rs` for the layout and the
//! arithmetic they reproduce bit for bit). One call computes a tile of 16 rows for up to four
//! tokens at a time, so each group's unpacked weights feed every token while they are in
//! registers: per chunk (4 columns × 16 rows) one `vpdpbusd` per token, per group one
//! `vpmulld` by the 16 rows' scales, per super-block two FMAs.

use crate::backend::layout::kpacked::{KActs, KKind, KPackedMatrix, SB};
use crate::backend::layout::packed::TILE_ROWS;
use std::arch::asm;
use std::arch::x86_64::*;

/// `acc += w · a` per 32-bit lane, `a` the 4 bytes at `p` broadcast (`vpdpbusd` with a memory
/// broadcast). Inline assembly so that every chunk is one instruction on its token's chain: the
/// compiler's version zeroed a register, ran `vpdpbusd` into it and added that to the chain
/// (three instructions for one); measured within noise of it (`kkbench`, Q4_K, 256 tokens, one
/// thread: 184 vs 180 G MAC/s), kept for the instructions it saves.
///
/// # Safety
/// `p` is valid for reading 4 bytes.
#[inline]
#[target_feature(enable = "avx512f,avx512vnni")]
unsafe fn dpbusd_bcst(acc: __m512i, w: __m512i, p: *const u8) -> __m512i {
    let mut acc = acc;
    // SAFETY: reads 4 bytes at `p` (the caller's contract); registers otherwise.
    unsafe {
        asm!(
            "vpdpbusd {acc}, {w}, dword ptr [{p}]{{1to16}}",
            acc = inout(zmm_reg) acc,
            w = in(zmm_reg) w,
            p = in(reg) p,
            options(pure, readonly, nostack, preserves_flags)
        );
    }
    acc
}

use crate::backend::layout::kpacked::{kind_of, K_Q2K, K_Q3K, K_Q4K, K_Q5K, K_Q6K};

/// Tokens per inner call (4 × 4 accumulators of 16 lanes stay in registers).
const MAX_NT: usize = 4;

/// Tokens per inner call on buffered weights (`kkbench`, one thread, 256 tokens: Q4_K 220, 239
/// and 204 G MAC/s at 4, 6 and 8, where the registers run out).
const BUFFERED_NT: usize = 6;

/// How far ahead of the record being computed the streamed (decode) path prefetches into L2,
/// one line with each chunk's arithmetic. Decode reads every weight once, so it is won or lost
/// on keeping the memory busy. The 1.5B Q4_K_M (`llmctl bench --local --prefill 1
/// --decode-prompt 16 --decode-tokens 64 --threads 2`, tok/s, same machine and session):
/// - the hardware prefetchers alone: 17.2 (measured apart from the rest);
/// - record `b` of the next tile, all its lines at once: 23.5, 24.1, 23.2,
///   22.3;
/// - a fixed distance, all the record's lines at once: 23.6, 23.9 — the burst fills the line
///   fill buffers and the demand loads queue behind it; a group's lines with each group: 27.2,
///   27.5 (every other line: 19.3 — each line is needed);
/// - a line with each chunk at 2, 4, 8, 16 KiB: 28.7 / 28.4, 30.0 / 29.6, 29.9 / 29.6, 29.6
///   / 29.6 (two rounds); into L1 or L3 instead of L2 was slower in the fixed-distance runs.
///
/// A task's tiles follow one another in the matrix, so the distance runs ahead across tiles.
pub(crate) const STREAM_PREFETCH_BYTES: usize = 8 << 10;

/// From this many tokens on, each super-block's weights are unpacked once into a buffer and
/// every group of [`MAX_NT`] tokens reads them from there (prompt chunks); below, each group of
/// tokens unpacks them in registers as it goes (decode: no store and reload).
const BUFFER_FROM: usize = 8;

/// With `amx`, prompt chunks of [`AMX_TOKENS`] tokens and more run their integer sums on AMX
/// tiles ([`amx_block`]); the results are the same bits either way.
///
/// # Safety
/// The CPU must support AVX-512 F/BW and VNNI, FMA and F16C, and with `amx` AMX-INT8 with the
/// process granted its tile state (`Features::amx`); the shapes were checked by `kpacked::run`
/// (`out` holds `nt * TILE_ROWS` values, tokens `t0..t0 + nt` are quantized).
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,fma,f16c")]
pub unsafe fn tile_avx512vnni(
    w: &KPackedMatrix,
    tile: usize,
    a: &KActs,
    t0: usize,
    nt: usize,
    out: &mut [f32],
    amx: bool,
) {
    assert!(out.len() >= nt * TILE_ROWS);
    let base = out.as_mut_ptr();
    // SAFETY: the same contract; token `j`'s 16 values go to `out[16j..16j + 16]`, inside `out`
    // (asserted), and no two tokens share them.
    unsafe { by_kind(w, tile, a, t0, nt, amx, &|j| base.add(j * TILE_ROWS)) }
}

/// [`tile_avx512vnni`] with each token's 16 values stored straight into its own output row:
/// `rows[j][r0..r0 + 16]`.
///
/// # Safety
/// As [`tile_avx512vnni`], with `rows.len()` tokens, each row holding at least `r0 + 16` values
/// (a whole tile).
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,fma,f16c")]
pub unsafe fn tile_avx512vnni_rows(
    w: &KPackedMatrix,
    tile: usize,
    a: &KActs,
    t0: usize,
    rows: &mut [&mut [f32]],
    r0: usize,
    amx: bool,
) {
    assert!(rows.iter().all(|r| r.len() >= r0 + TILE_ROWS));
    // Decode batches (a few tokens) keep the row pointers on the stack: this runs once per
    // tile, thousands of times per token.
    let mut small = [std::ptr::null_mut::<f32>(); 16];
    let mut heap = Vec::new();
    let ptrs: &mut [*mut f32] = if rows.len() <= small.len() {
        &mut small[..rows.len()]
    } else {
        heap.resize(rows.len(), std::ptr::null_mut());
        &mut heap
    };
    for (p, r) in ptrs.iter_mut().zip(rows.iter_mut()) {
        *p = r.as_mut_ptr();
    }
    let ptrs = &*ptrs;
    // SAFETY: token `j`'s 16 values go to `rows[j][r0..r0 + 16]`, inside the row (asserted);
    // the rows are distinct slices.
    unsafe { by_kind(w, tile, a, t0, rows.len(), amx, &|j| ptrs[j].add(r0)) }
}

/// `dst(j)` for `j < nt` is valid for reading and writing 16 f32s, distinct for distinct `j`.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,fma,f16c")]
unsafe fn by_kind(
    w: &KPackedMatrix,
    tile: usize,
    a: &KActs,
    t0: usize,
    nt: usize,
    amx: bool,
    dst: &impl Fn(usize) -> *mut f32,
) {
    // SAFETY: the caller's contract; each inner loop checks its own shapes.
    unsafe {
        match w.kind {
            KKind::Q2K => tile_k::<K_Q2K>(w, tile, a, t0, nt, amx, dst),
            KKind::Q3K => tile_k::<K_Q3K>(w, tile, a, t0, nt, amx, dst),
            KKind::Q4K => tile_k::<K_Q4K>(w, tile, a, t0, nt, amx, dst),
            KKind::Q5K => tile_k::<K_Q5K>(w, tile, a, t0, nt, amx, dst),
            KKind::Q6K => tile_k::<K_Q6K>(w, tile, a, t0, nt, amx, dst),
        }
    }
}

/// Every byte shifted left by `N` bits (a 16-bit shift: the callers keep only bits that come
/// from the same byte).
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
fn shl<const N: u32>(x: __m512i) -> __m512i {
    _mm512_slli_epi16::<N>(x)
}

/// Every byte shifted right by `N` bits (as [`shl`]).
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
fn shr<const N: u32>(x: __m512i) -> __m512i {
    _mm512_srli_epi16::<N>(x)
}

#[inline(always)]
fn same(x: __m512i) -> __m512i {
    x
}

/// The byte masks the unpacking uses.
#[derive(Clone, Copy)]
struct Masks {
    m0f: __m512i,
    m03: __m512i,
    m04: __m512i,
    m10: __m512i,
    m30: __m512i,
}

impl Masks {
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    fn new() -> Self {
        Self {
            m0f: _mm512_set1_epi8(0x0F),
            m03: _mm512_set1_epi8(0x03),
            m04: _mm512_set1_epi8(0x04),
            m10: _mm512_set1_epi8(0x10),
            m30: _mm512_set1_epi8(0x30),
        }
    }
}

/// Group `g`'s chunks of record `r`, unpacked to unsigned weight bytes: `feed(k, w)` for each
/// chunk `k` of the group, in order.
///
/// # Safety
/// `r` points at a whole record of `KIND`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,fma,f16c")]
unsafe fn unpack_group<const KIND: u8>(r: *const u8, g: usize, mk: Masks, mut feed: impl FnMut(usize, __m512i)) {
    let kind = kind_of::<KIND>();
    let Masks { m0f, m03, m04, m10, m30 } = mk;
    // SAFETY: every offset below is inside the record (the layout of `kind`, see kpacked.rs).
    unsafe {
        let base = r.add(kind.base_off());
        let high = r.add(kind.high_off());
        match kind {
            KKind::Q4K | KKind::Q5K => {
                // Group g: chunks 8g..8g+8, base blocks 4g..4g+4, 1-bit block g (Q5_K).
                let h = if kind == KKind::Q5K {
                    _mm512_loadu_si512(high.add(64 * g) as *const _)
                } else {
                    _mm512_setzero_si512()
                };
                // `$lo`/`$hi` move chunk 2i's / 2i+1's high bit (bits 2i, 2i+1) to bit 4.
                macro_rules! pair {
                    ($i:literal, $lo:expr, $hi:expr) => {{
                        let x = _mm512_loadu_si512(base.add(64 * (4 * g + $i)) as *const _);
                        let mut lo = _mm512_and_si512(x, m0f);
                        let mut hi = _mm512_and_si512(_mm512_srli_epi16::<4>(x), m0f);
                        if kind == KKind::Q5K {
                            lo = _mm512_or_si512(lo, _mm512_and_si512($lo(h), m10));
                            hi = _mm512_or_si512(hi, _mm512_and_si512($hi(h), m10));
                        }
                        feed(8 * g + 2 * $i, lo);
                        feed(8 * g + 2 * $i + 1, hi);
                    }};
                }
                pair!(0, shl::<4>, shl::<3>);
                pair!(1, shl::<2>, shl::<1>);
                pair!(2, same, shr::<1>);
                pair!(3, shr::<2>, shr::<3>);
            }
            KKind::Q6K => {
                // Group g: chunks 4g..4g+4, base blocks 2g, 2g+1, 2-bit block g.
                let h = _mm512_loadu_si512(high.add(64 * g) as *const _);
                let x0 = _mm512_loadu_si512(base.add(64 * (2 * g)) as *const _);
                let x1 = _mm512_loadu_si512(base.add(64 * (2 * g + 1)) as *const _);
                let w0 = _mm512_or_si512(_mm512_and_si512(x0, m0f), _mm512_and_si512(shl::<4>(h), m30));
                feed(4 * g, w0);
                let w1 = _mm512_or_si512(
                    _mm512_and_si512(_mm512_srli_epi16::<4>(x0), m0f),
                    _mm512_and_si512(shl::<2>(h), m30),
                );
                feed(4 * g + 1, w1);
                let w2 = _mm512_or_si512(_mm512_and_si512(x1, m0f), _mm512_and_si512(h, m30));
                feed(4 * g + 2, w2);
                let w3 = _mm512_or_si512(
                    _mm512_and_si512(_mm512_srli_epi16::<4>(x1), m0f),
                    _mm512_and_si512(shr::<2>(h), m30),
                );
                feed(4 * g + 3, w3);
            }
            KKind::Q2K | KKind::Q3K => {
                // Group g: chunks 4g..4g+4, 2-bit block g; Q3_K: 1-bit block g/2, bits
                // 4(g%2)..4(g%2)+4.
                let x = _mm512_loadu_si512(base.add(64 * g) as *const _);
                let b0 = _mm512_and_si512(x, m03);
                let b1 = _mm512_and_si512(_mm512_srli_epi16::<2>(x), m03);
                let b2 = _mm512_and_si512(_mm512_srli_epi16::<4>(x), m03);
                let b3 = _mm512_and_si512(_mm512_srli_epi16::<6>(x), m03);
                if kind == KKind::Q3K {
                    let h = _mm512_loadu_si512(high.add(64 * (g / 2)) as *const _);
                    let hb = |v: __m512i| _mm512_and_si512(v, m04);
                    let (h0, h1, h2, h3) = if g.is_multiple_of(2) {
                        (hb(shl::<2>(h)), hb(shl::<1>(h)), hb(h), hb(shr::<1>(h)))
                    } else {
                        (hb(shr::<2>(h)), hb(shr::<3>(h)), hb(shr::<4>(h)), hb(shr::<5>(h)))
                    };
                    feed(4 * g, _mm512_or_si512(b0, h0));
                    feed(4 * g + 1, _mm512_or_si512(b1, h1));
                    feed(4 * g + 2, _mm512_or_si512(b2, h2));
                    feed(4 * g + 3, _mm512_or_si512(b3, h3));
                } else {
                    feed(4 * g, b0);
                    feed(4 * g + 1, b1);
                    feed(4 * g + 2, b2);
                    feed(4 * g + 3, b3);
                }
            }
        }
    }
}

/// Group `g`'s scales as 16 i32 lanes, and for Q2_K its minimums.
///
/// # Safety
/// `r` points at a whole record of `KIND`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,fma,f16c")]
unsafe fn group_scales<const KIND: u8>(r: *const u8, g: usize) -> (__m512i, __m512i) {
    let kind = kind_of::<KIND>();
    // SAFETY: the scales of group `g` are 16 bytes inside the record.
    let sc_bytes = unsafe { _mm_loadu_si128(r.add(kind.scales_off() + 16 * g) as *const _) };
    match kind {
        KKind::Q3K | KKind::Q6K => (_mm512_cvtepi8_epi32(sc_bytes), _mm512_setzero_si512()),
        KKind::Q2K => {
            let v = _mm512_cvtepu8_epi32(sc_bytes);
            (_mm512_and_si512(v, _mm512_set1_epi32(0xF)), _mm512_srli_epi32::<4>(v))
        }
        _ => (_mm512_cvtepu8_epi32(sc_bytes), _mm512_setzero_si512()),
    }
}

/// One super-block (record `r`) for `NT` tokens (activation super-blocks `ab[j]`): the integer
/// sums, then `acc[j]`'s two fused multiply-adds, in the reference's order. The record's worth
/// of lines from `pf` (any address) are prefetched into L2 on the way.
///
/// # Safety
/// `r` points at a whole record of `KIND`; `ab[j]` are super-blocks inside `a`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,fma,f16c")]
unsafe fn superblock<const KIND: u8, const NT: usize>(
    r: *const u8,
    a: &KActs,
    ab: [usize; NT],
    mk: Masks,
    acc: &mut [__m512; NT],
    pf: *const u8,
) {
    let kind = kind_of::<KIND>();
    let lines = kind.record_bytes().div_ceil(64);
    // SAFETY: activation reads are inside token super-blocks `ab[j]` (the caller's contract),
    // record reads inside `r`'s record.
    unsafe {
        let q: [*const u8; NT] = std::array::from_fn(|j| a.qs.as_ptr().add(ab[j] * SB) as *const u8);
        let word = |j: usize, k: usize| q[j].add(4 * k);
        let mut si = [_mm512_setzero_si512(); NT];
        let mut sm = [_mm512_setzero_si512(); NT];
        for g in 0..kind.groups() {
            // Two accumulators per token (even and odd chunks): `vpdpbusd` has a latency of
            // several cycles, and one chain per token would leave the units idle.
            let mut even = [_mm512_setzero_si512(); NT];
            let mut odd = [_mm512_setzero_si512(); NT];
            let mut feed = |k: usize, wv: __m512i| {
                // Line `k` of the record [`STREAM_PREFETCH_BYTES`] ahead with chunk `k` (64
                // chunks, at most 53 lines a record): one prefetch between each chunk's work.
                if k < lines {
                    _mm_prefetch::<_MM_HINT_T1>(pf.wrapping_add(64 * k) as *const i8);
                }
                let dot = if k.is_multiple_of(2) { &mut even } else { &mut odd };
                for (j, d) in dot.iter_mut().enumerate() {
                    *d = dpbusd_bcst(*d, wv, word(j, k));
                }
            };
            unpack_group::<KIND>(r, g, mk, &mut feed);
            let (sc, q2k_min) = group_scales::<KIND>(r, g);
            for j in 0..NT {
                let mut dj = _mm512_add_epi32(even[j], odd[j]);
                if kind.offset() != 0 {
                    let s = *a.bs16.get_unchecked(16 * ab[j] + g) as i32;
                    dj = _mm512_sub_epi32(dj, _mm512_set1_epi32(kind.offset() * s));
                }
                si[j] = _mm512_add_epi32(si[j], _mm512_mullo_epi32(dj, sc));
            }
            if kind == KKind::Q2K {
                for j in 0..NT {
                    let s = *a.bs16.get_unchecked(16 * ab[j] + g) as i32;
                    sm[j] = _mm512_add_epi32(sm[j], _mm512_mullo_epi32(q2k_min, _mm512_set1_epi32(s)));
                }
            }
        }
        finish::<KIND, NT>(r, a, ab, si, sm, acc);
    }
}

/// The end of a super-block: the Q4_K/Q5_K minimums' integer sums onto `sm`, then `acc[j]`'s
/// two fused multiply-adds in the reference's order.
///
/// # Safety
/// As [`superblock`].
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,fma,f16c")]
unsafe fn finish<const KIND: u8, const NT: usize>(
    r: *const u8,
    a: &KActs,
    ab: [usize; NT],
    si: [__m512i; NT],
    mut sm: [__m512i; NT],
    acc: &mut [__m512; NT],
) {
    let kind = kind_of::<KIND>();
    // SAFETY: the caller's contract.
    unsafe {
        if kind.mins_bytes() > 0 {
            // Q4_K/Q5_K: minimums in group pairs, i16 pairs against the pair's activation sums.
            for p in 0..kind.groups() / 2 {
                let m16 = _mm512_cvtepu8_epi16(_mm256_loadu_si256(r.add(kind.mins_off() + 32 * p) as *const _));
                for j in 0..NT {
                    let pair = (a.bs32.as_ptr().add(8 * ab[j] + 2 * p) as *const i32).read_unaligned();
                    sm[j] = _mm512_dpwssd_epi32(sm[j], m16, _mm512_set1_epi32(pair));
                }
            }
        }
        let dv = _mm512_cvtph_ps(_mm256_loadu_si256(r as *const _));
        for j in 0..NT {
            let fd = _mm512_mul_ps(dv, _mm512_set1_ps(*a.d.get_unchecked(ab[j])));
            acc[j] = _mm512_fmadd_ps(fd, _mm512_cvtepi32_ps(si[j]), acc[j]);
        }
        if kind.has_min() {
            let dm = _mm512_cvtph_ps(_mm256_loadu_si256(r.add(kind.dmin_off()) as *const _));
            for j in 0..NT {
                let fm = _mm512_mul_ps(dm, _mm512_set1_ps(*a.d.get_unchecked(ab[j])));
                acc[j] = _mm512_fnmadd_ps(fm, _mm512_cvtepi32_ps(sm[j]), acc[j]);
            }
        }
    }
}

/// [`superblock`] on buffered weights, two groups at a time: one `vpdpbusd` chain per token
/// and group (no even/odd chains to add), activations at constant displacements.
///
/// # Safety
/// As [`superblock`].
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,fma,f16c")]
unsafe fn superblock_buf<const KIND: u8, const NT: usize>(
    r: *const u8,
    a: &KActs,
    ab: [usize; NT],
    buf: &[__m512i; 64],
    acc: &mut [__m512; NT],
) {
    let kind = kind_of::<KIND>();
    let gsz = kind.group();
    // SAFETY: as in `superblock`.
    unsafe {
        let q: [*const u8; NT] = std::array::from_fn(|j| a.qs.as_ptr().add(ab[j] * SB) as *const u8);
        let mut si = [_mm512_setzero_si512(); NT];
        let mut sm = [_mm512_setzero_si512(); NT];
        for ga in (0..kind.groups()).step_by(2) {
            let gb = ga + 1;
            let (ka, kb) = (ga * gsz / 4, gb * gsz / 4);
            let pa: [*const u8; NT] = std::array::from_fn(|j| q[j].add(4 * ka));
            let pb: [*const u8; NT] = std::array::from_fn(|j| q[j].add(4 * kb));
            let mut da = [_mm512_setzero_si512(); NT];
            let mut db = [_mm512_setzero_si512(); NT];
            macro_rules! chunk {
                ($c:literal) => {{
                    let (wa, wb) = (buf[ka + $c], buf[kb + $c]);
                    for j in 0..NT {
                        asm!(
                            concat!("vpdpbusd {a}, {wa}, dword ptr [{pa} + 4*", $c, "]{{1to16}}"),
                            concat!("vpdpbusd {b}, {wb}, dword ptr [{pb} + 4*", $c, "]{{1to16}}"),
                            a = inout(zmm_reg) da[j],
                            b = inout(zmm_reg) db[j],
                            wa = in(zmm_reg) wa,
                            wb = in(zmm_reg) wb,
                            pa = in(reg) pa[j],
                            pb = in(reg) pb[j],
                            options(pure, readonly, nostack, preserves_flags)
                        );
                    }
                }};
            }
            chunk!(0);
            chunk!(1);
            chunk!(2);
            chunk!(3);
            if gsz == 32 {
                chunk!(4);
                chunk!(5);
                chunk!(6);
                chunk!(7);
            }
            let (sca, q2a) = group_scales::<KIND>(r, ga);
            let (scb, q2b) = group_scales::<KIND>(r, gb);
            for j in 0..NT {
                si[j] = _mm512_add_epi32(si[j], _mm512_mullo_epi32(da[j], sca));
                si[j] = _mm512_add_epi32(si[j], _mm512_mullo_epi32(db[j], scb));
            }
            if kind.offset() != 0 {
                // Q3_K/Q6_K (no minimums; `sm` is free): Σ s_g · s_act,g over the pair in one
                // `vpdpwssd` (scales as i16 pairs, the two groups' activation sums adjacent),
                // taken off `si` times the offset after the last group.
                let spair =
                    _mm512_or_si512(_mm512_and_si512(sca, _mm512_set1_epi32(0xFFFF)), _mm512_slli_epi32::<16>(scb));
                for j in 0..NT {
                    let pair = (a.bs16.as_ptr().add(16 * ab[j] + ga) as *const i32).read_unaligned();
                    sm[j] = _mm512_dpwssd_epi32(sm[j], spair, _mm512_set1_epi32(pair));
                }
            }
            if kind == KKind::Q2K {
                for j in 0..NT {
                    let sa = *a.bs16.get_unchecked(16 * ab[j] + ga) as i32;
                    let sb = *a.bs16.get_unchecked(16 * ab[j] + gb) as i32;
                    sm[j] = _mm512_add_epi32(sm[j], _mm512_mullo_epi32(q2a, _mm512_set1_epi32(sa)));
                    sm[j] = _mm512_add_epi32(sm[j], _mm512_mullo_epi32(q2b, _mm512_set1_epi32(sb)));
                }
            }
        }
        if kind.offset() != 0 {
            let shift = _mm_cvtsi32_si128(kind.offset().trailing_zeros() as i32);
            for j in 0..NT {
                si[j] = _mm512_sub_epi32(si[j], _mm512_sll_epi32(sm[j], shift));
                sm[j] = _mm512_setzero_si512();
            }
        }
        finish::<KIND, NT>(r, a, ab, si, sm, acc);
    }
}

/// Tile `tile` for tokens `t0..t0 + nt`, token `j`'s 16 results to `dst(j)`.
///
/// # Safety
/// As [`by_kind`].
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,fma,f16c")]
unsafe fn tile_k<const KIND: u8>(
    w: &KPackedMatrix,
    tile: usize,
    a: &KActs,
    t0: usize,
    nt: usize,
    amx: bool,
    dst: &impl Fn(usize) -> *mut f32,
) {
    let kind = kind_of::<KIND>();
    let sbs = w.superblocks();
    let rec = kind.record_bytes();
    let data = w.tile(tile);
    assert!(
        w.kind == kind
            && data.len() == sbs * rec
            && a.cols == w.cols
            && a.qs.len() >= (t0 + nt) * w.cols
            && a.d.len() >= (t0 + nt) * sbs
            && a.bs16.len() >= (t0 + nt) * sbs * 16
            && a.bs32.len() >= (t0 + nt) * sbs * 8
    );
    let mk = Masks::new();
    // SAFETY: record `b` of this tile is `data[b * rec..(b + 1) * rec]` (asserted length);
    // activation super-blocks `(t0 + j) * sbs + b` exist for `j < nt` (asserted); `dst(j)` is
    // the caller's contract, and so is AMX being usable when `amx` is set; the tile
    // configuration is loaded before the first `amx_block` and released after the last.
    unsafe {
        if nt < BUFFER_FROM {
            let mut j = 0;
            while j < nt {
                let m = (nt - j).min(MAX_NT);
                match m {
                    4 => streamed::<KIND, 4>(data.as_ptr(), rec, sbs, a, t0 + j, mk, |i| dst(j + i)),
                    3 => streamed::<KIND, 3>(data.as_ptr(), rec, sbs, a, t0 + j, mk, |i| dst(j + i)),
                    2 => streamed::<KIND, 2>(data.as_ptr(), rec, sbs, a, t0 + j, mk, |i| dst(j + i)),
                    _ => streamed::<KIND, 1>(data.as_ptr(), rec, sbs, a, t0 + j, mk, |i| dst(j + i)),
                }
                j += m;
            }
            return;
        }
        // Every token's accumulators in one contiguous buffer (in L1), each row written once
        // at the end: loading and storing them in the output rows per super-block would touch a
        // line of a different page per token each time (the rows are a matrix's width apart).
        let mut accs = vec![_mm512_setzero_ps(); nt];
        let mut buf = [_mm512_setzero_si512(); 64];
        // AMX for the kinds of 32-column groups (Q4_K, Q5_K) only: each group's sums go through
        // memory to be scaled, and with 16-column groups (Q2_K, Q3_K, Q6_K) twice as often,
        // which makes them slower than VNNI (`kkbench`, 256 tokens, 8960 × 1536, one thread,
        // G MAC/s: Q4_K 292.8 against 242.1 on VNNI, Q6_K 163.6 against 169.4). On AMX the
        // tokens go in spans of at most [`AMX_MAX_TOKENS`] (see there), each over the whole
        // tile (its records, read again per span, stay in cache).
        let use_amx = amx && kind.group() == 32 && nt >= AMX_TOKENS;
        let span = if use_amx { AMX_MAX_TOKENS } else { nt };
        if use_amx {
            load_tile_config(kind.group());
        }
        for lo in (0..nt).step_by(span) {
            let hi = (lo + span).min(nt);
            let amx_end = if use_amx { lo + (hi - lo) / AMX_TOKENS * AMX_TOKENS } else { lo };
            for b in 0..sbs {
                let r = data.as_ptr().add(b * rec);
                for g in 0..kind.groups() {
                    unpack_group::<KIND>(r, g, mk, |k, wv| buf[k] = wv);
                }
                let mut j = lo;
                while j < amx_end {
                    amx_block::<KIND>(r, a, t0 + j, sbs, b, &buf, &mut accs[j..j + AMX_TOKENS]);
                    if b + 1 == sbs {
                        for (i, v) in accs[j..j + AMX_TOKENS].iter().enumerate() {
                            _mm512_storeu_ps(dst(j + i), *v);
                        }
                    }
                    j += AMX_TOKENS;
                }
                while j < hi {
                    let m = (hi - j).min(BUFFERED_NT);
                    match m {
                        6 => buffered::<KIND, 6>(r, a, t0 + j, sbs, b, &buf, &mut accs[j..j + 6]),
                        5 => buffered::<KIND, 5>(r, a, t0 + j, sbs, b, &buf, &mut accs[j..j + 5]),
                        4 => buffered::<KIND, 4>(r, a, t0 + j, sbs, b, &buf, &mut accs[j..j + 4]),
                        3 => buffered::<KIND, 3>(r, a, t0 + j, sbs, b, &buf, &mut accs[j..j + 3]),
                        2 => buffered::<KIND, 2>(r, a, t0 + j, sbs, b, &buf, &mut accs[j..j + 2]),
                        _ => buffered::<KIND, 1>(r, a, t0 + j, sbs, b, &buf, &mut accs[j..j + 1]),
                    }
                    if b + 1 == sbs {
                        // Final: into the output rows now, between the blocks' arithmetic (all
                        // at the end, the stores to a new line of each row queued behind one
                        // another).
                        for (i, v) in accs[j..j + m].iter().enumerate() {
                            _mm512_storeu_ps(dst(j + i), *v);
                        }
                    }
                    j += m;
                }
            }
        }
        if use_amx {
            release_tiles();
        }
    }
}

/// `NT` tokens from `t0` over every super-block, unpacking as they go; accumulators in
/// registers, stored once at the end.
///
/// # Safety
/// As [`tile_k`] (its assertions hold for these tokens).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn streamed<const KIND: u8, const NT: usize>(
    data: *const u8,
    rec: usize,
    sbs: usize,
    a: &KActs,
    t0: usize,
    mk: Masks,
    dst: impl Fn(usize) -> *mut f32,
) {
    let mut acc = [_mm512_setzero_ps(); NT];
    // SAFETY: the caller's contract.
    unsafe {
        for b in 0..sbs {
            // The record [`STREAM_PREFETCH_BYTES`] past this one is prefetched as it computes:
            // a task's tiles follow one another in the matrix, so this runs ahead of the whole
            // stream, across tiles. Past the matrix's end it touches whatever is there (a
            // prefetch never faults, and `wrapping_add` makes no claim on the allocation).
            let ab: [usize; NT] = std::array::from_fn(|j| (t0 + j) * sbs + b);
            superblock::<KIND, NT>(
                data.add(b * rec),
                a,
                ab,
                mk,
                &mut acc,
                data.wrapping_add(b * rec + STREAM_PREFETCH_BYTES),
            );
        }
        for (j, v) in acc.iter().enumerate() {
            _mm512_storeu_ps(dst(j), *v);
        }
    }
}

/// `NT` tokens from `t0`, super-block `b` from already unpacked weights, onto `acc`.
///
/// # Safety
/// As [`tile_k`] (its assertions hold for these tokens).
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,fma,f16c")]
unsafe fn buffered<const KIND: u8, const NT: usize>(
    r: *const u8,
    a: &KActs,
    t0: usize,
    sbs: usize,
    b: usize,
    buf: &[__m512i; 64],
    acc: &mut [__m512],
) {
    let acc: &mut [__m512; NT] = acc.try_into().expect("NT accumulators");
    let ab: [usize; NT] = std::array::from_fn(|j| (t0 + j) * sbs + b);
    // SAFETY: the caller's contract.
    unsafe { superblock_buf::<KIND, NT>(r, a, ab, buf, acc) }
}

/// Tokens per AMX call: a tile's 16 rows, one token each.
pub const AMX_TOKENS: usize = 16;

/// Tokens per span on AMX: a tile's records are run over the tokens of one span, then again
/// over the next. Alone (`kkbench`, weights in cache) AMX was faster at every block size, but
/// in the model a whole 256-token block on AMX was not: the 1.5B Q4_K_M, one chunk from an
/// empty cache (`cargo run --release -p llmd-engine --example prefillbench -- MODEL 2
/// 64,128,256 4`, best of 4, tok/s), AMX over whole blocks 253.4 / 247.4 / 221.9 against VNNI's
/// 227.2 / 245.9 / 229.9 (profiled at 256 tokens the AMX blocks took 6,669 samples against
/// VNNI's 6,217); in spans of 64, without zeroing the sums, 271.5 / 261.6 / 231.4 against
/// 225.2 / 236.4 / 224.0. At 256 tokens spans of 32, 64, 128 and whole blocks, alternated
/// twice, were 228.5 / 224.8, 224.8 / 232.6, 230.5 / 242.4, 232.3 / 242.9 against VNNI's
/// 223.4 / 237.8: within this machine's drift. Why AMX gains less at 256 tokens is not settled.
pub const AMX_MAX_TOKENS: usize = 64;

/// The tile configuration of one kind's AMX blocks (palette 1), two sets so one group's
/// product runs while the one before is scaled: `tmm0`/`tmm3` the activations (16 tokens × one
/// group's bytes), `tmm1`/`tmm4` the group's weights (its 4-column chunks, each a row of 16
/// rows × 4 bytes), `tmm2`/`tmm5` the sums (16 tokens × 16 rows of i32).
#[repr(C, align(64))]
struct TileConfig([u8; 64]);

/// Loads the tile configuration for groups of `group` columns into this thread.
///
/// # Safety
/// AMX must be usable (`Features::amx`); [`release_tiles`] before this thread returns to code
/// that does not know of tiles.
#[inline]
unsafe fn load_tile_config(group: usize) {
    let mut c = [0u8; 64];
    c[0] = 1;
    // (colsb, rows) of tmm0..tmm5 (two sets of three): bytes 16 + 2i (little-endian u16) and
    // 48 + i.
    let shapes = [(group, AMX_TOKENS), (64, group / 4), (64, AMX_TOKENS)];
    for (i, (colsb, rows)) in shapes.into_iter().chain(shapes).enumerate() {
        c[16 + 2 * i..18 + 2 * i].copy_from_slice(&(colsb as u16).to_le_bytes());
        c[48 + i] = rows as u8;
    }
    let cfg = TileConfig(c);
    // SAFETY: AMX is usable (the caller's contract); `cfg` is a valid 64-byte palette-1
    // configuration (rows ≤ 16, bytes per row ≤ 64).
    unsafe { asm!("ldtilecfg [{}]", in(reg) cfg.0.as_ptr(), options(nostack, readonly, preserves_flags)) };
}

/// Returns the tile state to its initial (unconfigured) state.
///
/// # Safety
/// AMX must be usable (`Features::amx`).
#[inline]
unsafe fn release_tiles() {
    // SAFETY: AMX is usable (the caller's contract); `tilerelease` touches no memory.
    unsafe { asm!("tilerelease", options(nostack, nomem, preserves_flags)) };
}

/// [`superblock_buf`] for [`AMX_TOKENS`] tokens from `t0` on AMX tiles: per group one
/// `tdpbsud` (16 tokens' signed activations × the group's unsigned weights, as the `vpdpbusd`
/// chains sum them), the sums stored and scaled by the rows' group scales in the same integer
/// arithmetic, then [`finish`]. The same bits as [`superblock_buf`].
///
/// # Safety
/// As [`superblock`], and the tile configuration of this kind is loaded ([`load_tile_config`]);
/// `buf` holds super-block `b`'s unpacked weights.
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,fma,f16c")]
unsafe fn amx_block<const KIND: u8>(
    r: *const u8,
    a: &KActs,
    t0: usize,
    sbs: usize,
    b: usize,
    buf: &[__m512i; 64],
    acc: &mut [__m512],
) {
    #[repr(C, align(64))]
    struct Sums([[__m512i; AMX_TOKENS]; 2]);
    let kind = kind_of::<KIND>();
    let gsz = kind.group();
    let acc: &mut [__m512; AMX_TOKENS] = acc.try_into().expect("16 accumulators");
    let ab: [usize; AMX_TOKENS] = std::array::from_fn(|j| (t0 + j) * sbs + b);
    let stride = sbs * SB;
    // Written by `tilestored` before each read (no zeroing: `memset` was 4% of a profiled chunk).
    let mut sums = std::mem::MaybeUninit::<Sums>::uninit();
    let sums = sums.as_mut_ptr() as *mut __m512i;
    let mut si = [_mm512_setzero_si512(); AMX_TOKENS];
    let mut sm = [_mm512_setzero_si512(); AMX_TOKENS];
    // SAFETY: token `t0 + j`'s bytes of group `g` are `gsz` bytes at `stride * j` past the first
    // token's, inside its super-block `ab[j]` (the caller's contract: these tokens are
    // quantized); the weights are `gsz / 4` chunks of `buf`; each half of `sums` holds 16 rows of
    // 64 bytes.
    unsafe {
        let acts = a.qs.as_ptr().add(ab[0] * SB) as *const u8;
        // Group `g`'s product into `sums` half `g % 2` (16 rows each), on tile set `g % 2`.
        let product = |g: usize, out: *mut __m512i| {
            macro_rules! on {
                ($a:literal, $w:literal, $s:literal) => {
                    asm!(
                        concat!("tilezero ", $s),
                        concat!("tileloadd ", $a, ", [{a} + {sa} * 1]"),
                        concat!("tileloadd ", $w, ", [{w} + {sw} * 1]"),
                        concat!("tdpbsud ", $s, ", ", $a, ", ", $w),
                        concat!("tilestored [{s} + {sw} * 1], ", $s),
                        a = in(reg) acts.add(g * gsz),
                        sa = in(reg) stride,
                        w = in(reg) buf.as_ptr().add(g * gsz / 4),
                        sw = in(reg) 64usize,
                        s = in(reg) out,
                        options(nostack, preserves_flags)
                    )
                };
            }
            if g.is_multiple_of(2) {
                on!("tmm0", "tmm1", "tmm2")
            } else {
                on!("tmm3", "tmm4", "tmm5")
            }
        };
        let groups = kind.groups();
        product(0, sums);
        for g in 0..groups {
            // The next group's product is issued before this one's sums are scaled: the tile
            // unit works on it while the vector units scale.
            if g + 1 < groups {
                product(g + 1, sums.add(AMX_TOKENS * ((g + 1) % 2)));
            }
            let (sc, q2k_min) = group_scales::<KIND>(r, g);
            for j in 0..AMX_TOKENS {
                let mut dj = _mm512_load_si512(sums.add(AMX_TOKENS * (g % 2) + j) as *const _);
                if kind.offset() != 0 {
                    let s = *a.bs16.get_unchecked(16 * ab[j] + g) as i32;
                    dj = _mm512_sub_epi32(dj, _mm512_set1_epi32(kind.offset() * s));
                }
                si[j] = _mm512_add_epi32(si[j], _mm512_mullo_epi32(dj, sc));
                if kind == KKind::Q2K {
                    let s = *a.bs16.get_unchecked(16 * ab[j] + g) as i32;
                    sm[j] = _mm512_add_epi32(sm[j], _mm512_mullo_epi32(q2k_min, _mm512_set1_epi32(s)));
                }
            }
        }
        finish::<KIND, AMX_TOKENS>(r, a, ab, si, sm, acc);
    }
}

/// Q8_K quantization of whole super-blocks (`kpacked::quantize_rows_body`, bit for bit): the
/// value of largest magnitude (the first such, as the scalar loop finds it), `q` rounded to
/// nearest even by `vcvtps2dq`, capped at 127, and the sums of each 16 values.
///
/// # Safety
/// The CPU must support AVX-512 F/BW/VL; the slices hold exactly `x.len() / 256` super-blocks
/// (asserted by the caller).
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
pub unsafe fn quantize_rows_avx512(x: &[f32], o: crate::backend::layout::kpacked::KActsOut<'_>) {
    let crate::backend::layout::kpacked::KActsOut { qs, d, bs16, bs32 } = o;
    for (i, (xb, qb)) in x.chunks_exact(SB).zip(qs.chunks_exact_mut(SB)).enumerate() {
        // SAFETY: `xb` holds 256 values, `qb` 256 bytes: 16 loads and stores of 16 each.
        unsafe {
            let v: [__m512; 16] = std::array::from_fn(|c| _mm512_loadu_ps(xb.as_ptr().add(16 * c)));
            let mut amax = _mm512_setzero_ps();
            for vc in &v {
                amax = _mm512_max_ps(amax, _mm512_abs_ps(*vc));
            }
            let amax = _mm512_reduce_max_ps(amax);
            if amax == 0.0 {
                qb.fill(0);
                d[i] = 0.0;
                bs16[16 * i..16 * i + 16].fill(0);
                bs32[8 * i..8 * i + 8].fill(0);
                continue;
            }
            // The first value whose magnitude is `amax` (the scalar loop keeps the first).
            let target = _mm512_set1_ps(amax);
            let mut max = amax;
            for (c, vc) in v.iter().enumerate() {
                let hit = _mm512_cmp_ps_mask::<_CMP_EQ_OQ>(_mm512_abs_ps(*vc), target);
                if hit != 0 {
                    max = xb[16 * c + hit.trailing_zeros() as usize];
                    break;
                }
            }
            let iscale = -127.0 / max;
            let is = _mm512_set1_ps(iscale);
            let cap = _mm512_set1_epi32(127);
            for (c, vc) in v.iter().enumerate() {
                let q = _mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(is, *vc)), cap);
                _mm_storeu_si128(qb.as_mut_ptr().add(16 * c) as *mut __m128i, _mm512_cvtepi32_epi8(q));
                bs16[16 * i + c] = _mm512_reduce_add_epi32(q) as i16;
            }
            for g in 0..8 {
                bs32[8 * i + g] = bs16[16 * i + 2 * g] + bs16[16 * i + 2 * g + 1];
            }
            d[i] = 1.0 / iscale;
        }
    }
}
