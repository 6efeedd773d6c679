//! x86 kernels over the packed layout (see `packed.rs` for the layout and the arithmetic they
//! must reproduce bit for bit): AVX-512 VNNI (`vpdpbusd`, 16 rows per instruction) and AVX2
//! (`vpmaddubsw` + `vpmaddwd`, 8 rows per instruction). Each call computes one tile of 16 rows for
//! `nt` tokens. With AVX-512, tokens go in pairs ([`pair512`], in assembly, so that a block's
//! weights are unpacked once and used by both tokens while all 16 lanes stay in registers) and
//! a last odd token goes alone ([`group512`]); one token (GEMV) streams the weights once.

use crate::backend::layout::packed::{PackKind, PackedMatrix, QuantActs, QuantOut, BLOCK, TILE_ROWS};
use std::arch::x86_64::*;

/// Tokens per call of the AVX-512 inner loop (2 × 8 group lanes fill zmm16–zmm31).
const GROUP: usize = 2;

/// Token `t`'s block `b`: its 32 values, 8 group sums, scale and minimum term.
#[inline(always)]
fn act(a: &QuantActs, ab: usize) -> (&[i8; 32], &[i32; 8], f32, f32) {
    let q: &[i8; 32] = a.qs[ab * BLOCK..(ab + 1) * BLOCK].try_into().expect("32 values per block");
    let g: &[i32; 8] = a.gsum[ab * 8..(ab + 1) * 8].try_into().expect("8 groups per block");
    (q, g, a.d[ab], a.ms[ab])
}

#[inline(always)]
fn word(q: &[i8; 32], k: usize) -> i32 {
    i32::from_le_bytes([q[4 * k] as u8, q[4 * k + 1] as u8, q[4 * k + 2] as u8, q[4 * k + 3] as u8])
}

/// `PackKind` as a const parameter, so each kind gets its own inner loop with no branches.
const K_Q4_0: u8 = 0;
const K_Q4_1: u8 = 1;
const K_Q8_0: u8 = 2;

/// `PackKind` of a `KIND` const parameter.
const fn kind_of<const KIND: u8>() -> PackKind {
    match KIND {
        K_Q4_0 => PackKind::Q4_0,
        K_Q4_1 => PackKind::Q4_1,
        _ => PackKind::Q8_0,
    }
}

/// The checks every inner loop starts with (a panic, never out-of-bounds access): tile `tile`
/// of `w` is of kind `KIND` and whole, and the activations hold tokens `t0..t0 + nt` of
/// `w.cols` columns. Returns the tile's bytes. (The outputs are the callers' contract.)
#[inline(always)]
fn checked_tile<'w, const KIND: u8>(w: &'w PackedMatrix, tile: usize, a: &QuantActs, t0: usize, nt: usize) -> &'w [u8] {
    let blocks = w.blocks();
    let data = w.tile(tile);
    let ab_end = (t0 + nt) * blocks;
    assert!(
        w.kind == kind_of::<KIND>()
            && data.len() == blocks * kind_of::<KIND>().record_bytes()
            && a.qs.len() >= ab_end * BLOCK
            && a.d.len() >= ab_end
            && a.ms.len() >= ab_end
            && a.sum.len() >= ab_end
            && a.gcorr.len() >= ab_end * 16
    );
    data
}

/// Prefetches the line `ahead` bytes past `p` into L2 (any address: a prefetch never faults,
/// and `wrapping_add` makes no claim on an allocation).
#[inline(always)]
pub fn prefetch_l2(p: *const u8, ahead: usize) {
    // SAFETY: prefetching reads nothing the program sees and never faults; SSE is part of x86-64.
    unsafe { _mm_prefetch::<_MM_HINT_T1>(p.wrapping_add(ahead) as *const i8) };
}

/// Prefetches record `b` (`rec` bytes) of the next tile into L2; same-sized tiles, so it is at
/// the same offset as this tile's record `b`.
#[inline(always)]
fn prefetch_record(next: &[u8], b: usize, rec: usize) {
    let mut o = b * rec;
    while o < (b + 1) * rec && o < next.len() {
        // SAFETY: `o` is inside `next`; a prefetch never faults anyway (SSE is part of x86-64).
        unsafe { _mm_prefetch::<_MM_HINT_T1>(next.as_ptr().add(o) as *const i8) };
        o += 64;
    }
}

/// # Safety
/// The CPU must support AVX-512 F/BW and VNNI, FMA and F16C; `out` holds `nt * TILE_ROWS`
/// values and `t0 + nt <= a.n`, `a.cols == w.cols`, `tile < w.tiles()` (checked by the caller).
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,fma,f16c")]
pub unsafe fn tile_avx512vnni(w: &PackedMatrix, tile: usize, a: &QuantActs, t0: usize, nt: usize, out: &mut [f32]) {
    assert!(out.len() >= nt * TILE_ROWS);
    let base = out.as_mut_ptr();
    // SAFETY: the same contract; token `j`'s 16 values go to `out[16j..16j + 16]`, inside
    // `out` (asserted), and no two tokens share them.
    unsafe { tile512_dispatch(w, tile, a, t0, nt, |j| base.add(j * TILE_ROWS)) }
}

/// [`tile_avx512vnni`] with each token's 16 values stored straight into its own output row:
/// `rows[j][r0..r0 + 16]` for token `t0 + j` (no copy through a buffer).
///
/// # Safety
/// As [`tile_avx512vnni`], with `rows.len() == nt` instead of `out`, and every row holding at
/// least `r0 + 16` values (checked by the caller, `Kernel::run_rows`).
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,fma,f16c")]
pub unsafe fn tile_avx512vnni_rows(
    w: &PackedMatrix,
    tile: usize,
    a: &QuantActs,
    t0: usize,
    rows: &mut [&mut [f32]],
    r0: usize,
) {
    let nt = rows.len();
    let base = rows.as_mut_ptr();
    // SAFETY: the same contract; token `j`'s 16 values go to `rows[j][r0..r0 + 16]`, inside
    // that row (the caller's check); the rows are distinct `&mut` slices, so no two tokens
    // share them.
    unsafe { tile512_dispatch(w, tile, a, t0, nt, |j| (*base.add(j)).as_mut_ptr().add(r0)) }
}

/// # Safety
/// As [`tile_avx512vnni`]; `dst(j)` for `j < nt` is valid for writing 16 f32s, and distinct
/// tokens' are disjoint.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,fma,f16c")]
unsafe fn tile512_dispatch(
    w: &PackedMatrix,
    tile: usize,
    a: &QuantActs,
    t0: usize,
    nt: usize,
    dst: impl Fn(usize) -> *mut f32,
) {
    // SAFETY: the same contract, passed on.
    unsafe {
        match w.kind {
            PackKind::Q4_0 => tile512::<K_Q4_0>(w, tile, a, t0, nt, &dst),
            PackKind::Q4_1 => tile512::<K_Q4_1>(w, tile, a, t0, nt, &dst),
            PackKind::Q8_0 => tile512::<K_Q8_0>(w, tile, a, t0, nt, &dst),
        }
    }
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,fma,f16c")]
unsafe fn tile512<const KIND: u8>(
    w: &PackedMatrix,
    tile: usize,
    a: &QuantActs,
    t0: usize,
    nt: usize,
    dst: &impl Fn(usize) -> *mut f32,
) {
    // While this tile is computed, a later one (a later call's) is prefetched into L2: token
    // group `j` of `groups` prefetches the records of the blocks `b` with `b % groups == j`, so
    // the prefetches spread over the whole tile's work. Measured with `batchbench`, B=8,
    // variants alternating pass by pass, median ms per pass in three runs: into L2 vs into L1
    // (both from the first group) 15.5/19.2/19.4 vs 16.8/20.5/21.2; spread vs
    // first group only (both L2) 18.0/18.1/18.5 vs 18.7/18.8/19.1; L2 vs L1 (both spread)
    // 18.5/19.1/19.4 vs 18.5/19.5/20.1, no prefetch 20.4/21.0/21.7 in those runs. Into L1 the
    // next tile evicts this one's weights, which the later token groups re-read. One sequence:
    // 4.9/4.6/4.2 against 5.4/4.9/4.5 into L1 from the first group.
    // Q8_0 tiles carry twice the bytes per multiply-add (the output head of tied-embedding
    // models is Q8_0 and partly memory-bound even at B=8), so they prefetch the tile after
    // next: B=8 pass 1–3% faster (means 16.52/14.64/14.19 against 15.99/14.52/13.83 ms,
    // alternating pass by pass); one sequence unchanged; the 4-bit kinds gained nothing.
    let ahead = if KIND == K_Q8_0 { 2 } else { 1 };
    let next = if tile + ahead < w.tiles() { Some(w.tile(tile + ahead)) } else { None };
    let groups = nt.div_ceil(GROUP);
    let mut j = 0;
    while j < nt {
        let g = (nt - j).min(GROUP);
        let pf = next.map(|n| (n, j / GROUP, groups));
        // SAFETY: same contract as this function, for tokens t0+j..t0+j+g.
        unsafe {
            if g == 2 {
                pair512::<KIND>(w, tile, a, t0 + j, [dst(j), dst(j + 1)], pf);
            } else {
                group512::<KIND, 1>(w, tile, a, t0 + j, [dst(j)], pf);
            }
        }
        j += g;
    }
}

/// `NT` tokens of one tile in intrinsics (used for a single token; [`pair512`] is the
/// two-token loop: at `NT` = 2 the compiler spilled lanes to the stack).
///
/// # Safety
/// As [`tile_avx512vnni`], for tokens `t0..t0 + NT`, whose 16 values go to `out[j]` (each
/// valid for 16 f32s, disjoint).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,fma,f16c")]
unsafe fn group512<const KIND: u8, const NT: usize>(
    w: &PackedMatrix,
    tile: usize,
    a: &QuantActs,
    t0: usize,
    out: [*mut f32; NT],
    prefetch: Option<(&[u8], usize, usize)>,
) {
    let data = checked_tile::<KIND>(w, tile, a, t0, NT);
    let blocks = w.blocks();
    let rec = kind_of::<KIND>().record_bytes();
    let qo = kind_of::<KIND>().qs_offset();
    // Where this kind's offset terms sit among a block's 16 (none for Q4_1: its offset is 0).
    let corr = if KIND == K_Q8_0 { 8 } else { 0 };
    let mut lanes = [[_mm512_setzero_ps(); 8]; NT];
    let mut summs = [_mm512_setzero_ps(); NT];
    let mask = _mm512_set1_epi8(0x0F);
    let p = data.as_ptr();
    let (aq, ad, am, ac) = (a.qs.as_ptr(), a.d.as_ptr(), a.ms.as_ptr(), a.gcorr.as_ptr());
    for b in 0..blocks {
        if let Some((next, _, _)) = prefetch.filter(|&(_, group, groups)| b % groups == group) {
            prefetch_record(next, b, rec);
        }
        // SAFETY: record `b` spans `rec` bytes inside `data` (asserted above): the scales at
        // offsets 0 and 32 (32 bytes each) and the weights at `qo..qo + 256` or `qo + 512`.
        let (dv, mv, wv) = unsafe {
            let r = p.add(b * rec);
            let dv = _mm512_cvtph_ps(_mm256_loadu_si256(r as *const __m256i));
            let mv = if KIND == K_Q4_1 {
                _mm512_cvtph_ps(_mm256_loadu_si256(r.add(32) as *const __m256i))
            } else {
                _mm512_setzero_ps()
            };
            let q = r.add(qo);
            let mut wv = [_mm512_setzero_si512(); 8];
            if KIND == K_Q8_0 {
                for (g, v) in wv.iter_mut().enumerate() {
                    *v = _mm512_loadu_si512(q.add(64 * g) as *const _);
                }
            } else {
                for c in 0..4 {
                    let x = _mm512_loadu_si512(q.add(64 * c) as *const _);
                    wv[c] = _mm512_and_si512(x, mask);
                    wv[c + 4] = _mm512_and_si512(_mm512_srli_epi16(x, 4), mask);
                }
            }
            (dv, mv, wv)
        };
        for j in 0..NT {
            let ab = (t0 + j) * blocks + b;
            // SAFETY: `ab < ab_end`, so its 32 activations, 16 offset terms, scale and minimum
            // term are inside the buffers (asserted above); unaligned 4-byte reads.
            unsafe {
                let q4 = aq.add(ab * BLOCK) as *const i32;
                let scale = _mm512_mul_ps(dv, _mm512_set1_ps(*ad.add(ab)));
                for k in 0..8 {
                    let init = if KIND == K_Q4_1 {
                        _mm512_setzero_si512()
                    } else {
                        _mm512_set1_epi32(*ac.add(ab * 16 + corr + k))
                    };
                    let isum = _mm512_dpbusd_epi32(init, wv[k], _mm512_set1_epi32(q4.add(k).read_unaligned()));
                    lanes[j][k] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(isum), lanes[j][k]);
                }
                if KIND == K_Q4_1 {
                    summs[j] = _mm512_add_ps(summs[j], _mm512_mul_ps(mv, _mm512_set1_ps(*am.add(ab))));
                }
            }
        }
    }
    for j in 0..NT {
        let l = &lanes[j];
        let r = _mm512_add_ps(
            _mm512_add_ps(_mm512_add_ps(l[4], l[0]), _mm512_add_ps(l[6], l[2])),
            _mm512_add_ps(_mm512_add_ps(l[5], l[1]), _mm512_add_ps(l[7], l[3])),
        );
        let r = if KIND == K_Q4_1 { _mm512_add_ps(r, summs[j]) } else { r };
        // SAFETY: `out[j]` is valid for 16 f32s (this function's contract).
        unsafe { _mm512_storeu_ps(out[j], r) };
    }
}

/// The start of one group's integer sum in `t`: zero (Q4_1), or the group's offset term
/// `−o · a_g` from the activations' `gcorr` at byte `off` of `c` (Q4_0, Q8_0).
macro_rules! isum_init {
    (zero, $t:literal, $c:literal, $off:literal) => {
        concat!("vpxord ", $t, ", ", $t, ", ", $t, "\n")
    };
    (corr, $t:literal, $c:literal, $off:literal) => {
        concat!("vpbroadcastd ", $t, ", dword ptr [", $c, " + ", $off, "]\n")
    };
}

/// Group `k` of one block for one token: its integer sum in `t` (started by [`isum_init`]
/// from offset-term pointer `c`, then one `vpdpbusd` of the group's weights `w` against the
/// token's 4 activations at byte `act` of `q`), converted and fused into lane `l` with scale `s`.
macro_rules! group_one {
    ($mode:ident, $t:literal, $c:literal, $q:literal, $s:literal, $w:literal, $act:literal, $corr:literal, $l:literal) => {
        concat!(
            isum_init!($mode, $t, $c, $corr),
            "vpdpbusd ",
            $t,
            ", ",
            $w,
            ", dword ptr [",
            $q,
            " + ",
            $act,
            "]{{1to16}}\n",
            "vcvtdq2ps ",
            $t,
            ", ",
            $t,
            "\n",
            "vfmadd231ps ",
            $l,
            ", ",
            $s,
            ", ",
            $t,
            "\n",
        )
    };
}

/// Group `k` of one block for both tokens (lanes `l0`, `l1`), with the group's weights in `w`.
macro_rules! group_pair {
    ($mode:ident, $w:literal, $act:literal, $corr:literal, $l0:literal, $l1:literal) => {
        concat!(
            group_one!($mode, "{t0}", "{c0}", "{q0}", "{s0}", $w, $act, $corr, $l0),
            group_one!($mode, "{t1}", "{c1}", "{q1}", "{s1}", $w, $act, $corr, $l1),
        )
    };
}

/// One 4-bit chunk (4 weights of each of 16 rows at byte `woff` of the record): its low
/// nibbles are group `c` (activations at byte `lo`, offset term at `clo`), its high nibbles
/// group `c + 4` (`hi`, `chi`).
macro_rules! q4_chunk {
    ($mode:ident, $woff:literal, $lo:literal, $hi:literal, $clo:literal, $chi:literal,
     $l0lo:literal, $l1lo:literal, $l0hi:literal, $l1hi:literal) => {
        concat!(
            "vmovdqu64 {x}, zmmword ptr [{r} + ",
            $woff,
            "]\n",
            "vpsrlw {h}, {x}, 4\n",
            "vpandq {x}, {x}, {mask}\n",
            "vpandq {h}, {h}, {mask}\n",
            group_pair!($mode, "{x}", $lo, $clo, $l0lo, $l1lo),
            group_pair!($mode, "{h}", $hi, $chi, $l0hi, $l1hi),
        )
    };
}

/// Two 8-bit chunks (groups `k` and `k + 1`, at bytes `w0` and `w1` of the record).
macro_rules! q8_pair {
    ($w0:literal, $w1:literal, $a0:literal, $a1:literal, $c0:literal, $c1:literal,
     $l0a:literal, $l1a:literal, $l0b:literal, $l1b:literal) => {
        concat!(
            "vmovdqu64 {x}, zmmword ptr [{r} + ",
            $w0,
            "]\n",
            "vmovdqu64 {h}, zmmword ptr [{r} + ",
            $w1,
            "]\n",
            group_pair!(corr, "{x}", $a0, $c0, $l0a, $l1a),
            group_pair!(corr, "{h}", $a1, $c1, $l0b, $l1b),
        )
    };
}

/// Token `j`'s scale for this block: the rows' f16 scales (record bytes 0..32) times the
/// token's activation scale at `d_j`, in `s_j`.
macro_rules! pair_scales {
    () => {
        concat!(
            "vcvtph2ps {x}, ymmword ptr [{r}]\n",
            "vmulps {s0}, {x}, dword ptr [{d0}]{{1to16}}\n",
            "vmulps {s1}, {x}, dword ptr [{d1}]{{1to16}}\n",
        )
    };
}

/// [`group512`] for two tokens, in assembly. The compiler's version of that loop keeps the
/// block's 8 weight vectors live at once, so 5 of the 16 lanes go to the stack and the rest
/// are copied between registers every block; with the lanes pinned here (token `j`'s lane `k`
/// in `zmm(16 + 8j + k)` for the whole tile) and each chunk's weights live only while used,
/// nothing spills: B=8 passes measured 11.6–13.8 ms against 14.3–19.5 (`batchbench`,
/// alternated runs). Same operations on the same values in the same order per lane as
/// [`group512`] and [`crate::backend::layout::packed::reference`] (tested bit for bit).
///
/// # Safety
/// As [`tile_avx512vnni`], for tokens `t0` and `t0 + 1`, whose 16 values go to `out[0]` and
/// `out[1]` (each valid for 16 f32s, disjoint).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,fma,f16c")]
unsafe fn pair512<const KIND: u8>(
    w: &PackedMatrix,
    tile: usize,
    a: &QuantActs,
    t0: usize,
    out: [*mut f32; 2],
    prefetch: Option<(&[u8], usize, usize)>,
) {
    let data = checked_tile::<KIND>(w, tile, a, t0, 2);
    let blocks = w.blocks();
    let rec = kind_of::<KIND>().record_bytes();
    let z = _mm512_setzero_ps();
    let (mut l00, mut l01, mut l02, mut l03, mut l04, mut l05, mut l06, mut l07) = (z, z, z, z, z, z, z, z);
    let (mut l10, mut l11, mut l12, mut l13, mut l14, mut l15, mut l16, mut l17) = (z, z, z, z, z, z, z, z);
    let (mut sm0, mut sm1) = (z, z);
    let mask = _mm512_set1_epi8(0x0F);
    for b in 0..blocks {
        if let Some((next, _, _)) = prefetch.filter(|&(_, group, groups)| b % groups == group) {
            prefetch_record(next, b, rec);
        }
        let (ab0, ab1) = (t0 * blocks + b, (t0 + 1) * blocks + b);
        // SAFETY: record `b` (`rec` bytes: scales, Q4_1 minimums, weights) is inside `data`;
        // blocks `ab0`, `ab1` < `ab_end` of the activations (32 values, a scale, a minimum
        // term, 16 offset terms each) are inside their buffers (asserted above). The assembly
        // reads only those and writes only its register operands.
        unsafe {
            let r = data.as_ptr().add(b * rec);
            let (q0, q1) = (a.qs.as_ptr().add(ab0 * BLOCK), a.qs.as_ptr().add(ab1 * BLOCK));
            let (d0, d1) = (a.d.as_ptr().add(ab0), a.d.as_ptr().add(ab1));
            // The operands every kind passes: record, activations, scales, scratch registers
            // and the 16 pinned lanes; each kind adds its own (minimum terms or offset terms).
            macro_rules! pair_asm {
                ([$($body:expr),* $(,)?], $($extra:tt)*) => {
                    std::arch::asm!(
                        pair_scales!(),
                        $($body,)*
                        r = in(reg) r,
                        q0 = in(reg) q0,
                        q1 = in(reg) q1,
                        d0 = in(reg) d0,
                        d1 = in(reg) d1,
                        x = out(zmm_reg) _,
                        h = out(zmm_reg) _,
                        s0 = out(zmm_reg) _,
                        s1 = out(zmm_reg) _,
                        t0 = out(zmm_reg) _,
                        t1 = out(zmm_reg) _,
                        $($extra)*
                        inout("zmm16") l00, inout("zmm17") l01, inout("zmm18") l02, inout("zmm19") l03,
                        inout("zmm20") l04, inout("zmm21") l05, inout("zmm22") l06, inout("zmm23") l07,
                        inout("zmm24") l10, inout("zmm25") l11, inout("zmm26") l12, inout("zmm27") l13,
                        inout("zmm28") l14, inout("zmm29") l15, inout("zmm30") l16, inout("zmm31") l17,
                        options(pure, readonly, nostack, preserves_flags),
                    )
                };
            }
            let (c0, c1) = (a.gcorr.as_ptr().add(ab0 * 16), a.gcorr.as_ptr().add(ab1 * 16));
            if KIND == K_Q4_1 {
                pair_asm!(
                    [
                        // The minimum term: summs + m · a_m, not fused.
                        "vcvtph2ps {x}, ymmword ptr [{r} + 32]",
                        "vmulps {t0}, {x}, dword ptr [{m0}]{{1to16}}",
                        "vaddps {sm0}, {sm0}, {t0}",
                        "vmulps {t1}, {x}, dword ptr [{m1}]{{1to16}}",
                        "vaddps {sm1}, {sm1}, {t1}",
                        q4_chunk!(zero, "64", "0", "16", "0", "0", "zmm16", "zmm24", "zmm20", "zmm28"),
                        q4_chunk!(zero, "128", "4", "20", "0", "0", "zmm17", "zmm25", "zmm21", "zmm29"),
                        q4_chunk!(zero, "192", "8", "24", "0", "0", "zmm18", "zmm26", "zmm22", "zmm30"),
                        q4_chunk!(zero, "256", "12", "28", "0", "0", "zmm19", "zmm27", "zmm23", "zmm31"),
                    ],
                    m0 = in(reg) a.ms.as_ptr().add(ab0),
                    m1 = in(reg) a.ms.as_ptr().add(ab1),
                    mask = in(zmm_reg) mask,
                    sm0 = inout(zmm_reg) sm0,
                    sm1 = inout(zmm_reg) sm1,
                );
            } else if KIND == K_Q4_0 {
                pair_asm!(
                    [
                        q4_chunk!(corr, "32", "0", "16", "0", "16", "zmm16", "zmm24", "zmm20", "zmm28"),
                        q4_chunk!(corr, "96", "4", "20", "4", "20", "zmm17", "zmm25", "zmm21", "zmm29"),
                        q4_chunk!(corr, "160", "8", "24", "8", "24", "zmm18", "zmm26", "zmm22", "zmm30"),
                        q4_chunk!(corr, "224", "12", "28", "12", "28", "zmm19", "zmm27", "zmm23", "zmm31"),
                    ],
                    c0 = in(reg) c0,
                    c1 = in(reg) c1,
                    mask = in(zmm_reg) mask,
                );
            } else {
                pair_asm!(
                    [
                        q8_pair!("32", "96", "0", "4", "32", "36", "zmm16", "zmm24", "zmm17", "zmm25"),
                        q8_pair!("160", "224", "8", "12", "40", "44", "zmm18", "zmm26", "zmm19", "zmm27"),
                        q8_pair!("288", "352", "16", "20", "48", "52", "zmm20", "zmm28", "zmm21", "zmm29"),
                        q8_pair!("416", "480", "24", "28", "56", "60", "zmm22", "zmm30", "zmm23", "zmm31"),
                    ],
                    c0 = in(reg) c0,
                    c1 = in(reg) c1,
                );
            }
        }
    }
    let sum = |l: [__m512; 8], sm: __m512| {
        let r = _mm512_add_ps(
            _mm512_add_ps(_mm512_add_ps(l[4], l[0]), _mm512_add_ps(l[6], l[2])),
            _mm512_add_ps(_mm512_add_ps(l[5], l[1]), _mm512_add_ps(l[7], l[3])),
        );
        if KIND == K_Q4_1 {
            _mm512_add_ps(r, sm)
        } else {
            r
        }
    };
    let r0 = sum([l00, l01, l02, l03, l04, l05, l06, l07], sm0);
    let r1 = sum([l10, l11, l12, l13, l14, l15, l16, l17], sm1);
    // SAFETY: `out[0]` and `out[1]` are each valid for 16 f32s (this function's contract).
    unsafe {
        _mm512_storeu_ps(out[0], r0);
        _mm512_storeu_ps(out[1], r1);
    }
}

/// Tokens per call of the AVX-512 loop in the output head's order: per token it keeps two
/// integer chains, a float accumulator and the Q4_1 minimum term, so four tokens leave room
/// for a block's weights in the 32 registers.
const GROUP_BLOCKSUM: usize = 4;

/// [`tile_avx512vnni`] in the output head's order (`packed::Order::BlockSum`): per block and
/// token, eight `vpdpbusd`s build one exact integer sum (two chains, added), then one
/// conversion and one FMA; up to [`GROUP_BLOCKSUM`] tokens share each unpacked block.
///
/// # Safety
/// As [`tile_avx512vnni`].
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,fma,f16c")]
pub unsafe fn tile_avx512vnni_blocksum(
    w: &PackedMatrix,
    tile: usize,
    a: &QuantActs,
    t0: usize,
    nt: usize,
    out: &mut [f32],
) {
    assert!(out.len() >= nt * TILE_ROWS);
    // SAFETY: the same contract, passed on; `out` holds `nt * 16` values (asserted).
    unsafe {
        match w.kind {
            PackKind::Q4_0 => tile512_blocksum::<K_Q4_0>(w, tile, a, t0, nt, out),
            PackKind::Q4_1 => tile512_blocksum::<K_Q4_1>(w, tile, a, t0, nt, out),
            PackKind::Q8_0 => tile512_blocksum::<K_Q8_0>(w, tile, a, t0, nt, out),
        }
    }
}

/// # Safety
/// As [`tile_avx512vnni_blocksum`].
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,fma,f16c")]
unsafe fn tile512_blocksum<const KIND: u8>(
    w: &PackedMatrix,
    tile: usize,
    a: &QuantActs,
    t0: usize,
    nt: usize,
    out: &mut [f32],
) {
    // The next tiles are prefetched into L2 as in [`tile512`].
    let ahead = if KIND == K_Q8_0 { 2 } else { 1 };
    let next = if tile + ahead < w.tiles() { Some(w.tile(tile + ahead)) } else { None };
    let groups = nt.div_ceil(GROUP_BLOCKSUM);
    let base = out.as_mut_ptr();
    let mut j = 0;
    while j < nt {
        let g = (nt - j).min(GROUP_BLOCKSUM);
        let pf = next.map(|n| (n, j / GROUP_BLOCKSUM, groups));
        // SAFETY: same contract, for tokens t0+j..t0+j+g, whose values go to
        // `out[16j..16(j + g)]`, inside `out` (the caller's assertion).
        unsafe {
            let o = base.add(j * TILE_ROWS);
            match g {
                4 => group512_blocksum::<KIND, 4>(w, tile, a, t0 + j, o, pf),
                3 => group512_blocksum::<KIND, 3>(w, tile, a, t0 + j, o, pf),
                2 => group512_blocksum::<KIND, 2>(w, tile, a, t0 + j, o, pf),
                _ => group512_blocksum::<KIND, 1>(w, tile, a, t0 + j, o, pf),
            }
        }
        j += g;
    }
}

/// `NT` tokens of one tile in the output head's order: per block the weights are unpacked once
/// (4-bit kinds: a 64-byte chunk gives the low-nibble group `c` and the high-nibble group
/// `c + 4`) and each token's integer sum runs through the block's 8 `vpdpbusd`s in two chains
/// (integer sums are exact in any order), starting from the offset term `−o · a_s`.
///
/// # Safety
/// As [`tile_avx512vnni_blocksum`], for tokens `t0..t0 + NT`, whose 16 values each go to
/// `out[16j..16j + 16]` (valid for writing).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,fma,f16c")]
unsafe fn group512_blocksum<const KIND: u8, const NT: usize>(
    w: &PackedMatrix,
    tile: usize,
    a: &QuantActs,
    t0: usize,
    out: *mut f32,
    prefetch: Option<(&[u8], usize, usize)>,
) {
    let data = checked_tile::<KIND>(w, tile, a, t0, NT);
    let blocks = w.blocks();
    let rec = kind_of::<KIND>().record_bytes();
    let qo = kind_of::<KIND>().qs_offset();
    let o = kind_of::<KIND>().offset();
    let mut acc = [_mm512_setzero_ps(); NT];
    let mut summs = [_mm512_setzero_ps(); NT];
    let mask = _mm512_set1_epi8(0x0F);
    let p = data.as_ptr();
    let (aq, ad, am, asum) = (a.qs.as_ptr(), a.d.as_ptr(), a.ms.as_ptr(), a.sum.as_ptr());
    for b in 0..blocks {
        if let Some((next, _, _)) = prefetch.filter(|&(_, group, groups)| b % groups == group) {
            prefetch_record(next, b, rec);
        }
        // SAFETY: record `b` spans `rec` bytes inside `data` (asserted above): the scales at
        // offsets 0 and 32 (32 bytes each) and the weights at `qo..qo + 256` or `qo + 512`.
        // Blocks `(t0 + j) * blocks + b` of the activations (32 values, a scale, a sum and a
        // minimum term each) are inside their buffers (asserted above); unaligned 4-byte reads.
        unsafe {
            let r = p.add(b * rec);
            let q = r.add(qo);
            let mut lo = [_mm512_setzero_si512(); NT];
            let mut hi = [_mm512_setzero_si512(); NT];
            let mut qp = [aq as *const i32; NT];
            for j in 0..NT {
                let ab = (t0 + j) * blocks + b;
                qp[j] = aq.add(ab * BLOCK) as *const i32;
                if KIND != K_Q4_1 {
                    lo[j] = _mm512_set1_epi32(-o * *asum.add(ab));
                }
            }
            if KIND == K_Q8_0 {
                for c in 0..4 {
                    let x = _mm512_loadu_si512(q.add(64 * c) as *const _);
                    let y = _mm512_loadu_si512(q.add(64 * (c + 4)) as *const _);
                    for j in 0..NT {
                        lo[j] = _mm512_dpbusd_epi32(lo[j], x, _mm512_set1_epi32(qp[j].add(c).read_unaligned()));
                        hi[j] = _mm512_dpbusd_epi32(hi[j], y, _mm512_set1_epi32(qp[j].add(c + 4).read_unaligned()));
                    }
                }
            } else {
                for c in 0..4 {
                    let x = _mm512_loadu_si512(q.add(64 * c) as *const _);
                    let wl = _mm512_and_si512(x, mask);
                    let wh = _mm512_and_si512(_mm512_srli_epi16(x, 4), mask);
                    for j in 0..NT {
                        lo[j] = _mm512_dpbusd_epi32(lo[j], wl, _mm512_set1_epi32(qp[j].add(c).read_unaligned()));
                        hi[j] = _mm512_dpbusd_epi32(hi[j], wh, _mm512_set1_epi32(qp[j].add(c + 4).read_unaligned()));
                    }
                }
            }
            let dv = _mm512_cvtph_ps(_mm256_loadu_si256(r as *const __m256i));
            for j in 0..NT {
                let ab = (t0 + j) * blocks + b;
                let scale = _mm512_mul_ps(dv, _mm512_set1_ps(*ad.add(ab)));
                acc[j] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(_mm512_add_epi32(lo[j], hi[j])), acc[j]);
            }
            if KIND == K_Q4_1 {
                let mv = _mm512_cvtph_ps(_mm256_loadu_si256(r.add(32) as *const __m256i));
                for (j, s) in summs.iter_mut().enumerate() {
                    let ab = (t0 + j) * blocks + b;
                    *s = _mm512_add_ps(*s, _mm512_mul_ps(mv, _mm512_set1_ps(*am.add(ab))));
                }
            }
        }
    }
    for j in 0..NT {
        let r = if KIND == K_Q4_1 { _mm512_add_ps(acc[j], summs[j]) } else { acc[j] };
        // SAFETY: `out[16j..16j + 16]` is valid for writing (this function's contract).
        unsafe { _mm512_storeu_ps(out.add(j * TILE_ROWS), r) };
    }
}

/// [`crate::backend::layout::packed::quantize_rows_body`] with AVX-512: per block, two 16-lane loads, the
/// maximum magnitude, one multiply and one round-to-nearest-even conversion per 16 values,
/// and the group sums from one `vpdpbusd` against ones. Equal to the definition bit for bit
/// (tested) for finite inputs; with NaNs both give garbage, neither panics.
///
/// # Safety
/// The CPU must support AVX-512 F/BW/VL and VNNI and F16C; the slices hold exactly
/// `x.len() / 32` blocks (asserted by the caller).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,f16c")]
pub unsafe fn quantize_rows_avx512(x: &[f32], o: QuantOut<'_>) {
    let QuantOut { qs, d, sum, ms, gsum, gcorr } = o;
    let blocks = x.len() / BLOCK;
    assert!(qs.len() == x.len() && d.len() == blocks && gsum.len() == 8 * blocks && gcorr.len() == 16 * blocks);
    let ones = _mm256_set1_epi8(1);
    let zero = _mm256_setzero_si256();
    let f16r = |v: f32| -> f32 {
        let h = _mm_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm_set_ss(v));
        _mm_cvtss_f32(_mm_cvtph_ps(h))
    };
    for i in 0..blocks {
        // SAFETY: block `i` is 32 f32s of `x`, 32 bytes of `qs`, 8 and 16 i32s of `gsum` and
        // `gcorr` (sizes asserted above).
        unsafe {
            let p = x.as_ptr().add(BLOCK * i);
            let x0 = _mm512_loadu_ps(p);
            let x1 = _mm512_loadu_ps(p.add(16));
            let amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
            let dd = amax / 127.0;
            let id = _mm512_set1_ps(if amax != 0.0 { 127.0 / amax } else { 0.0 });
            const RNE: i32 = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
            let r0 = _mm512_cvt_roundps_epi32::<RNE>(_mm512_mul_ps(x0, id));
            let r1 = _mm512_cvt_roundps_epi32::<RNE>(_mm512_mul_ps(x1, id));
            let q = _mm256_set_m128i(_mm512_cvtepi32_epi8(r1), _mm512_cvtepi32_epi8(r0));
            _mm256_storeu_si256(qs.as_mut_ptr().add(BLOCK * i) as *mut __m256i, q);
            let g = _mm256_dpbusd_epi32(zero, ones, q);
            _mm256_storeu_si256(gsum.as_mut_ptr().add(8 * i) as *mut __m256i, g);
            let c = gcorr.as_mut_ptr().add(16 * i) as *mut __m256i;
            _mm256_storeu_si256(c, _mm256_sub_epi32(zero, _mm256_slli_epi32::<3>(g)));
            _mm256_storeu_si256(c.add(1), _mm256_sub_epi32(zero, _mm256_slli_epi32::<7>(g)));
            let s: i32 = gsum[8 * i..8 * i + 8].iter().sum();
            d[i] = f16r(dd);
            sum[i] = s;
            ms[i] = f16r(dd * s as f32);
        }
    }
}

/// With `BLOCKSUM`, the output head's order (`packed::Order::BlockSum`): the eight groups'
/// integer sums are added (exact) and each block takes one FMA.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; the same shape contract as [`tile_avx512vnni`].
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn tile_avx2<const BLOCKSUM: bool>(
    w: &PackedMatrix,
    tile: usize,
    a: &QuantActs,
    t0: usize,
    nt: usize,
    out: &mut [f32],
) {
    let kind = w.kind;
    let blocks = w.blocks();
    let rec = kind.record_bytes();
    let qo = kind.qs_offset();
    // Q8_0 takes the signed path (sign moved onto the activations), which needs no offset.
    let off = if kind == PackKind::Q8_0 { 0 } else { kind.offset() };
    let data = w.tile(tile);
    assert!(data.len() == blocks * rec && out.len() >= nt * TILE_ROWS && a.qs.len() >= (t0 + nt) * a.cols);
    let mask = _mm256_set1_epi8(0x0F);
    let flip = _mm256_set1_epi8(-128);
    let ones = _mm256_set1_epi16(1);
    let p = data.as_ptr();
    for j in 0..nt {
        for h in 0..2 {
            let mut lanes = [_mm256_setzero_ps(); 8];
            let mut acc = _mm256_setzero_ps();
            let mut summs = _mm256_setzero_ps();
            for b in 0..blocks {
                // SAFETY: record `b` spans `rec` bytes inside `data` (asserted above); half `h`
                // reads rows 8h..8h+8: 16 bytes of each scale array and 32 bytes of each chunk.
                let (dv, mv, wv) = unsafe {
                    let r = p.add(b * rec);
                    let dv = _mm256_cvtph_ps(_mm_loadu_si128(r.add(16 * h) as *const __m128i));
                    let mv = if kind == PackKind::Q4_1 {
                        _mm256_cvtph_ps(_mm_loadu_si128(r.add(32 + 16 * h) as *const __m128i))
                    } else {
                        _mm256_setzero_ps()
                    };
                    let q = r.add(qo + 32 * h);
                    let mut wv = [_mm256_setzero_si256(); 8];
                    if kind == PackKind::Q8_0 {
                        for (g, v) in wv.iter_mut().enumerate() {
                            *v = _mm256_xor_si256(_mm256_loadu_si256(q.add(64 * g) as *const __m256i), flip);
                        }
                    } else {
                        for c in 0..4 {
                            let x = _mm256_loadu_si256(q.add(64 * c) as *const __m256i);
                            wv[c] = _mm256_and_si256(x, mask);
                            wv[c + 4] = _mm256_and_si256(_mm256_srli_epi16(x, 4), mask);
                        }
                    }
                    (dv, mv, wv)
                };
                let (aq, ag, ad, am) = act(a, (t0 + j) * blocks + b);
                let scale = _mm256_mul_ps(dv, _mm256_set1_ps(ad));
                let mut total = _mm256_setzero_si256();
                for k in 0..8 {
                    let av = _mm256_set1_epi32(word(aq, k));
                    let pairs = if kind == PackKind::Q8_0 {
                        // |w| ≤ 128 and |a| ≤ 127: each pair sum ≤ 32512, below i16 saturation.
                        _mm256_maddubs_epi16(_mm256_abs_epi8(wv[k]), _mm256_sign_epi8(av, wv[k]))
                    } else {
                        // Nibbles ≤ 15: each pair sum ≤ 3810.
                        _mm256_maddubs_epi16(wv[k], av)
                    };
                    let isum = _mm256_add_epi32(_mm256_madd_epi16(pairs, ones), _mm256_set1_epi32(-off * ag[k]));
                    if BLOCKSUM {
                        total = _mm256_add_epi32(total, isum);
                    } else {
                        lanes[k] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(isum), lanes[k]);
                    }
                }
                if BLOCKSUM {
                    acc = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(total), acc);
                }
                if kind == PackKind::Q4_1 {
                    summs = _mm256_add_ps(summs, _mm256_mul_ps(mv, _mm256_set1_ps(am)));
                }
            }
            let r = if BLOCKSUM {
                if kind == PackKind::Q4_1 {
                    _mm256_add_ps(acc, summs)
                } else {
                    acc
                }
            } else {
                let l = &lanes;
                let r = _mm256_add_ps(
                    _mm256_add_ps(_mm256_add_ps(l[4], l[0]), _mm256_add_ps(l[6], l[2])),
                    _mm256_add_ps(_mm256_add_ps(l[5], l[1]), _mm256_add_ps(l[7], l[3])),
                );
                _mm256_add_ps(r, summs)
            };
            let o = &mut out[j * TILE_ROWS + 8 * h..j * TILE_ROWS + 8 * h + 8];
            // SAFETY: `o` is 8 writable f32s.
            unsafe { _mm256_storeu_ps(o.as_mut_ptr(), r) };
        }
    }
}

/// Multiply-accumulates one thread sustains on 16 independent `vpdpbusd` chains (512-bit,
/// enough to cover the instruction's latency), over `iters` iterations of 16 instructions.
///
/// # Safety
/// The CPU must support AVX-512 F and VNNI.
#[target_feature(enable = "avx512f,avx512vnni")]
pub unsafe fn vnni_peak_loop(iters: u64) -> i32 {
    let mut acc = [_mm512_setzero_si512(); 16];
    let x = _mm512_set1_epi8(3);
    let y = _mm512_set1_epi8(-2);
    for _ in 0..iters {
        for v in acc.iter_mut() {
            *v = _mm512_dpbusd_epi32(*v, x, y);
        }
    }
    let mut s = acc[0];
    for v in &acc[1..] {
        s = _mm512_add_epi32(s, *v);
    }
    _mm512_reduce_add_epi32(s)
}

/// Multiply-accumulates one thread sustains in llama.cpp's x86 rounding order, which every
/// kernel here must follow: per 64 MACs (16 rows × 4 columns of one token) one `vpdpbusd` from
/// zero, one int→float conversion and one FMA into that group's float lane. 12 independent
/// chains over `iters` iterations; the activation word changes every iteration, so nothing is
/// hoisted out of the loop. This is the packed kernel's ceiling, below [`vnni_peak_loop`]'s.
///
/// # Safety
/// The CPU must support AVX-512 F and VNNI, and FMA.
#[target_feature(enable = "avx512f,avx512vnni,fma")]
pub unsafe fn order_peak_loop(iters: u64) -> f32 {
    let mut acc = [_mm512_setzero_ps(); 12];
    let w = _mm512_set1_epi8(3);
    let scale = _mm512_set1_ps(1e-9);
    let words: Vec<i32> = (0..64).collect();
    for it in 0..iters {
        let base = &words[(it & 31) as usize..];
        for (k, v) in acc.iter_mut().enumerate() {
            // SAFETY: `k < 12 < base.len()`; a volatile read, so the kernel's per-token
            // activation load is not folded away.
            let word = unsafe { std::ptr::read_volatile(base.as_ptr().add(k)) };
            let isum = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, _mm512_set1_epi32(word));
            *v = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(isum), *v);
        }
    }
    let mut s = acc[0];
    for v in &acc[1..] {
        s = _mm512_add_ps(s, *v);
    }
    _mm512_reduce_add_ps(s)
}
