//! The CPU backend: every op, on a persistent spinning worker pool ([`Pool`]) sized to the cores
//! the engine is given.
//!
//! Numerics follow llama.cpp's CPU backend where it matters for agreement: activations are
//! quantized to the weight type's `vec_dot_type` before integer dot products, the KV cache is
//! f16, queries are rounded to f16 before `K·q` and softmax weights before `V·p`, and sums of
//! squares and softmax denominators accumulate in f64.

mod arch;
pub mod attn_kernels;
pub mod device;
pub mod features;
pub mod kpacked;
pub mod packed;
pub mod pilot;
pub mod pool;
pub mod rows;
pub mod sgemm;
mod sparse;
pub mod unpack;

pub use packed::{int8_peak_macs_per_s, read_peak_bytes_per_s};

/// The name of the packed-weight kernel this process uses.
pub fn kernel_name() -> &'static str {
    packed_kernel_name(packed::Kernel::best())
}

/// The kernel the Q4_0/Q4_1/Q8_0 tiles run on with `k` (AMX is for K-quant prompts only).
fn packed_kernel_name(k: packed::Kernel) -> &'static str {
    if k.kind() == packed::KernelKind::Avx512Amx {
        "avx512-vnni"
    } else {
        k.name()
    }
}

/// What matrix `m` runs on in this process: the kernel and the layout (for listings).
pub fn matrix_kernel(m: &WeightMatrix) -> String {
    let k = packed::Kernel::best();
    if m.on_flash {
        return "rows read from storage when used".into();
    }
    match (&m.packed, &m.kpacked) {
        (Some(p), _) if p.kind.ggml_type() != m.ty => {
            format!("{}, {:?} tiles (converted at load)", packed_kernel_name(k), p.kind)
        }
        (Some(p), _) => format!("{}, {:?} tiles", packed_kernel_name(k), p.kind),
        (_, Some(kp)) => format!("{}, K-quant tiles", kpacked::kernel_name(k, kp.kind)),
        _ => format!("{} row dot products", rows::row_kernel_name()),
    }
}

/// What a matrix of file type `ty` would run on in this process (the rule
/// [`matrix_kernel`] reports after loading; for listing a model file without loading it).
pub fn type_kernel(ty: GgmlType) -> String {
    let k = packed::Kernel::best();
    if let Some(p) = packed::PackKind::of(ty) {
        return format!("{}, {p:?} tiles", packed_kernel_name(k));
    }
    if let Some(kind) = kpacked::KKind::of(ty) {
        return format!("{}, K-quant tiles", kpacked::kernel_name(k, kind));
    }
    if let Some(p) = crate::backend::weight::convert_kind(ty) {
        return format!("{}, {p:?} tiles (converted at load)", packed_kernel_name(k));
    }
    format!("{} row dot products", rows::row_kernel_name())
}

use crate::backend::kv::{append_head, KvInput, KvLayer};
use crate::backend::weight::WeightMatrix;
use crate::backend::{check_append, AttentionItem, AttentionShape, Backend, DeviceDesc, OpKind, Processor, RopeParams};
use crate::config::RopeStyle;
use crate::error::BackendError;
use crate::quant::{self, GgmlType};
use attn_kernels::{prefetch, AttnKernels};
use kpacked::{KActs, KPackedMatrix};
use packed::{Kernel, PackedMatrix, QuantActs, TILE_ROWS};
use pool::Pool;
use std::sync::Mutex;

/// Rows at the start of a key or value stream prefetched ahead of the attention kernels.
const ATTN_PREFETCH_ROWS: usize = 32;

/// Weight rows per parallel task in a matmul.
const ROWS_PER_TASK: usize = 32;

pub struct CpuBackend {
    desc: DeviceDesc,
    pool: Pool,
}

/// `(cos, sin)` per (position, rotated pair) for `positions` under `key`.
#[derive(Default)]
struct RopeTable {
    /// theta, freq_scale (bits), rope_dims, and the frequency factors' bits if any.
    key: (u32, u32, usize, Option<Vec<u32>>),
    positions: Vec<usize>,
    cs: Vec<(f32, f32)>,
}

impl CpuBackend {
    /// A CPU backend with `threads` workers (0 = one per available core).
    pub fn new(threads: usize) -> Self {
        let threads =
            if threads == 0 { std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1) } else { threads };
        let pool = Pool::new(threads);
        let desc = DeviceDesc {
            name: "cpu".into(),
            processor: Processor::Cpu,
            available: true,
            ops: vec![
                OpKind::GetRows,
                OpKind::MatMul,
                OpKind::RmsNorm,
                OpKind::Rope,
                OpKind::Attention,
                OpKind::SwiGlu,
            ],
            weight_types: GgmlType::ALL.to_vec(),
            static_shapes: llmd_device::StaticShapes::Any,
            memory: llmd_device::MemoryDesc { kind: llmd_device::MemoryKind::Host, capacity: None },
            max_tokens: None,
            threads,
        };
        Self { desc, pool }
    }
}

pub(super) fn check_attention(s: &AttentionShape, q: &[f32], kv: KvLayer<'_>, out: &[f32]) -> Result<(), BackendError> {
    let q_row = s.n_heads * s.head_dim;
    let kv_row = s.n_kv_heads * s.head_dim;
    let total = s.start + s.n_tokens;
    let scales_ok = match kv {
        KvLayer::F16 { k, v } => k.len() == s.n_kv_heads && v.len() == s.n_kv_heads,
        KvLayer::Q8 { ks, vs, .. } => ks.len() >= total * s.n_kv_heads && vs.len() >= total * s.n_kv_heads,
    };
    if s.n_kv_heads == 0
        || s.head_dim == 0
        || !s.n_heads.is_multiple_of(s.n_kv_heads)
        || q.len() != s.n_tokens * q_row
        || out.len() != q.len()
        || kv.positions(kv_row) < total
        || !scales_ok
    {
        return Err(shape_err(
            "attention",
            format!("{s:?} with q {} over {} positions, out {}", q.len(), kv.positions(kv_row), out.len()),
        ));
    }
    Ok(())
}

/// One (token, head) of causal attention: f16-rounded query, scores over the cache, softmax
/// (`exp_sub`, f64 denominator), f16-rounded weights, weighted sum of values into `o`.
#[allow(clippy::too_many_arguments)]
fn attend_one(
    s: &AttentionShape,
    q: &[f32],
    kv: KvLayer<'_>,
    t: usize,
    h: usize,
    o: &mut [f32],
    scratch: &mut (Vec<f32>, Vec<f32>),
    kern: &AttnKernels,
) {
    let hd = s.head_dim;
    let q_row = s.n_heads * hd;
    let kv_row = s.n_kv_heads * hd;
    let kvh = h / (s.n_heads / s.n_kv_heads);
    let scale = 1.0 / (hd as f32).sqrt();
    let n_ctx = s.start + t + 1;
    let (qh, p) = scratch;
    qh.clear();
    // The query rounded to f16 (`scale_round` by 1: x · 1 is x).
    qh.extend_from_slice(&q[t * q_row + h * hd..t * q_row + (h + 1) * hd]);
    (kern.scale_round)(qh, 1.0);
    let qh = &qh[..];
    p.clear();
    let at = |j: usize| j * kv_row + kvh * hd..j * kv_row + (kvh + 1) * hd;
    match kv {
        KvLayer::F16 { k, .. } => {
            p.resize(n_ctx, 0.0);
            (kern.dots)(qh, &k[kvh], hd, p);
        }
        KvLayer::Q8 { k, ks, .. } => {
            p.extend((0..n_ctx).map(|j| (kern.dot_q8)(qh, &k[at(j)]) * ks[j * s.n_kv_heads + kvh]))
        }
    }
    softmax_rounded(p, scale, kern);
    o.fill(0.0);
    match kv {
        KvLayer::F16 { v, .. } => (kern.axpys)(p, &v[kvh], hd, o),
        KvLayer::Q8 { v, vs, .. } => {
            for (j, &w) in p.iter().enumerate() {
                (kern.axpy_q8)(w * vs[j * s.n_kv_heads + kvh], &v[at(j)], o);
            }
        }
    }
}

/// Dot products to softmax weights in place: each times `scale` (f32), `exp_sub` (see
/// `attn_kernels::exp_ref`) of each score minus the largest, the sum in f64, then each weight
/// times 1/sum rounded to f16 (llama.cpp's order).
pub(super) fn softmax_rounded(p: &mut [f32], scale: f32, kern: &AttnKernels) {
    let max = (kern.scale_max)(p, scale);
    let mut sum = 0f64;
    (kern.exp_sub)(p, max);
    for x in p.iter() {
        sum += *x as f64;
    }
    (kern.scale_round)(p, (1.0 / sum) as f32);
}

/// [`softmax_rounded`] of each `n_ctx`-long row of `p` (one per query head), with the f64
/// denominators of up to four rows summed in one loop: each sum keeps its own order, so the
/// weights are the same, but the dependent adds of the rows overlap (a sum alone waits on each
/// add's latency; B=8 decode pass ~2% faster, means 19.07/18.40/18.28 against
/// 18.57/17.95/17.91 ms alternating pass by pass).
fn softmax_rounded_heads(p: &mut [f32], n_ctx: usize, scale: f32, kern: &AttnKernels) {
    if n_ctx == 0 {
        return;
    }
    for rows in p.chunks_mut(4 * n_ctx) {
        let mut sums = [0f64; 4];
        for ph in rows.chunks_exact_mut(n_ctx) {
            let max = (kern.scale_max)(ph, scale);
            (kern.exp_sub)(ph, max);
        }
        // Each head's sum runs left to right; three or four heads' run side by side.
        let r = rows.len() / n_ctx;
        if r == 4 {
            let (a, rest) = rows.split_at(n_ctx);
            let (b, rest) = rest.split_at(n_ctx);
            let (c, d) = rest.split_at(n_ctx);
            for (((a, b), c), d) in a.iter().zip(b).zip(c).zip(d) {
                sums[0] += *a as f64;
                sums[1] += *b as f64;
                sums[2] += *c as f64;
                sums[3] += *d as f64;
            }
        } else if r == 3 {
            let (a, rest) = rows.split_at(n_ctx);
            let (b, c) = rest.split_at(n_ctx);
            for ((a, b), c) in a.iter().zip(b).zip(c) {
                sums[0] += *a as f64;
                sums[1] += *b as f64;
                sums[2] += *c as f64;
            }
        } else {
            for (ph, s) in rows.chunks_exact(n_ctx).zip(sums.iter_mut()) {
                for &x in ph {
                    *s += x as f64;
                }
            }
        }
        for (ph, sum) in rows.chunks_exact_mut(n_ctx).zip(sums) {
            (kern.scale_round)(ph, (1.0 / sum) as f32);
        }
    }
}

/// Heads `h0..h0 + outs.len() / head_dim` of token `t`, which share one KV head: with an f16
/// cache each key and value row is converted once for all of them (`dots_group`,
/// `axpys_group`); each head's arithmetic is [`attend_one`]'s, so the values are the same.
#[allow(clippy::too_many_arguments)]
fn attend_group(
    s: &AttentionShape,
    q: &[f32],
    kv: KvLayer<'_>,
    t: usize,
    h0: usize,
    outs: &mut [f32],
    scratch: &mut (Vec<f32>, Vec<f32>),
    kern: &AttnKernels,
) {
    let hd = s.head_dim;
    let KvLayer::F16 { k, v } = kv else {
        for (i, o) in outs.chunks_exact_mut(hd).enumerate() {
            attend_one(s, q, kv, t, h0 + i, o, scratch, kern);
        }
        return;
    };
    let kvh = h0 / (s.n_heads / s.n_kv_heads);
    attend_group_f16(s, q, (&k[kvh], &v[kvh]), k.get(kvh + 1).map(|x| &x[..]), t, h0, outs, scratch, kern);
}

/// [`attend_group`] over one f16 KV head's keys and values (`head`); `next_keys` (the next
/// head's, if any) are prefetched.
#[allow(clippy::too_many_arguments)]
fn attend_group_f16(
    s: &AttentionShape,
    q: &[f32],
    head: (&[half::f16], &[half::f16]),
    next_keys: Option<&[half::f16]>,
    t: usize,
    h0: usize,
    outs: &mut [f32],
    scratch: &mut (Vec<f32>, Vec<f32>),
    kern: &AttnKernels,
) {
    let (k, v) = head;
    let hd = s.head_dim;
    let g = outs.len() / hd;
    let q_row = s.n_heads * hd;
    let scale = 1.0 / (hd as f32).sqrt();
    let n_ctx = s.start + t + 1;
    let (qh, p) = scratch;
    qh.clear();
    qh.extend_from_slice(&q[t * q_row + h0 * hd..t * q_row + (h0 + g) * hd]);
    (kern.scale_round)(qh, 1.0);
    // The kernels prefetch ahead within a stream, not its start: the first value rows are
    // fetched while the keys are read, and the next KV head's first keys while this one is
    // attended (B=8 pass 1–2% faster each, measured alternating pass by pass).
    let prefetch_start = |x: &[half::f16]| prefetch(&x[..(n_ctx.min(ATTN_PREFETCH_ROWS) * hd).min(x.len())]);
    prefetch_start(v);
    if let Some(next) = next_keys {
        prefetch_start(next);
    }
    p.clear();
    p.resize(g * n_ctx, 0.0);
    {
        let qs: Vec<&[f32]> = qh.chunks_exact(hd).collect();
        let mut ps: Vec<&mut [f32]> = p.chunks_exact_mut(n_ctx).collect();
        (kern.dots_group)(&qs, k, hd, &mut ps);
    }
    softmax_rounded_heads(p, n_ctx, scale, kern);
    outs.fill(0.0);
    let ws: Vec<&[f32]> = p.chunks_exact(n_ctx).collect();
    let mut os: Vec<&mut [f32]> = outs.chunks_exact_mut(hd).collect();
    (kern.axpys_group)(&ws, v, hd, &mut os);
}

/// The second half of RMS norm: `row · 1/sqrt(mean + eps) · weight` from the row's f64 sum of
/// squares.
fn scale_row(row: &mut [f32], weight: &[f32], sum: f64, eps: f32) {
    let mean = (sum / row.len() as f64) as f32;
    let scale = 1.0 / (mean + eps).sqrt();
    for (v, w) in row.iter_mut().zip(weight) {
        *v = (*v * scale) * w;
    }
}

/// Runs `f(i, chunk_i)` over `chunk`-sized pieces of `data` on the pool.
fn par_chunks<T: Send>(pool: &Pool, data: &mut [T], chunk: usize, f: impl Fn(usize, &mut [T]) + Sync) {
    let chunks: Vec<Mutex<&mut [T]>> = data.chunks_mut(chunk.max(1)).map(Mutex::new).collect();
    pool.run(chunks.len(), &|i| {
        let mut c = chunks[i].lock().unwrap_or_else(|e| e.into_inner());
        f(i, &mut c)
    });
}

impl CpuBackend {
    /// Quantizes `n` rows of `x` into `acts`, in parallel over tokens for large batches.
    fn quantize(&self, acts: &mut QuantActs, x: &[f32], n: usize, cols: usize) {
        acts.resize(n, cols);
        // Prompt chunks split over the threads; fewer than 4 rows are not worth a parallel
        // step (decode batches of 4–16 are quantized by each thread itself: `matmul_packed`).
        let rows_per_task = if n >= 16 {
            n.div_ceil(self.desc.threads * TASKS_PER_THREAD)
        } else if n >= 4 {
            n.div_ceil(self.desc.threads)
        } else {
            n
        };
        let blocks = cols / packed::BLOCK;
        let QuantActs { qs, d, sum, ms, gsum, gcorr, .. } = acts;
        let parts: Vec<Mutex<_>> = qs
            .chunks_mut(rows_per_task * cols)
            .zip(d.chunks_mut(rows_per_task * blocks))
            .zip(sum.chunks_mut(rows_per_task * blocks))
            .zip(ms.chunks_mut(rows_per_task * blocks))
            .zip(gsum.chunks_mut(rows_per_task * blocks * 8))
            .zip(gcorr.chunks_mut(rows_per_task * blocks * 16))
            .map(Mutex::new)
            .collect();
        let run = |i: usize| {
            let mut g = parts[i].lock().unwrap_or_else(|e| e.into_inner());
            let (((((qs, d), sum), ms), gsum), gcorr) = &mut *g;
            let x = &x[i * rows_per_task * cols..(i * rows_per_task * cols + qs.len()).min(n * cols)];
            packed::quantize_rows(x, packed::QuantOut { qs, d, sum, ms, gsum, gcorr });
        };
        if parts.len() == 1 {
            run(0);
        } else {
            self.pool.run(parts.len(), &run);
        }
    }

    /// `outs[i][t][r]` (matrix `i`, token `t`, row `r`) for packed weights sharing `cols`, from
    /// one quantization of `x` and one parallel step over all their tiles (shapes checked by
    /// the caller). Each task owns a run of one matrix's tiles and writes their rows of every
    /// token straight into `outs` (through a 16-row buffer that stays in L1).
    fn matmul_packed(
        &self,
        ws: &[&PackedMatrix],
        x: &[f32],
        n: usize,
        outs: &mut [Vec<&mut [f32]>],
        order: packed::Order,
    ) {
        let kernel = Kernel::best();
        let cols = ws[0].cols;
        ACTS.with(|acts| {
            let mut acts = acts.borrow_mut();
            // A decode batch's few rows are quantized by every thread for itself, at its first
            // task of the step ([`OWN_ACTS`]): one parallel step and its barrier fewer per
            // matmul. Same values (each row is quantized alone). B=8 pass 0.1–3.2% faster in
            // six runs (median ratio 0.988), B=4 0.984–1.001, alternating pass by pass.
            let own = (4..=16).contains(&n) && self.desc.threads > 1;
            let step = MATMUL_STEP.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
            if !own {
                self.quantize(&mut acts, x, n, cols);
            }
            let acts = &*acts;
            let shapes: Vec<(usize, usize)> = ws.iter().map(|w| (w.rows, w.tiles())).collect();
            let tasks = tile_tasks(self.desc.threads, n, &shapes, outs);
            self.pool.run(tasks.len(), &|i| {
                let mut g = tasks[i].lock().unwrap_or_else(|e| e.into_inner());
                let (m, t0, nt, ref mut dst) = *g;
                let w = ws[m];
                SCRATCH.with(|buf| {
                    let mut buf = buf.borrow_mut();
                    for tile in t0..t0 + nt {
                        let r0 = (tile - t0) * TILE_ROWS;
                        if own {
                            OWN_ACTS.with(|o| {
                                let mut o = o.borrow_mut();
                                let (seen, mine) = &mut *o;
                                if *seen != step {
                                    mine.resize(n, cols);
                                    let QuantActs { qs, d, sum, ms, gsum, gcorr, .. } = mine;
                                    packed::quantize_rows(x, packed::QuantOut { qs, d, sum, ms, gsum, gcorr });
                                    *seen = step;
                                }
                                kernel.run_rows(order, w, tile, mine, 0, dst, r0, &mut buf);
                            });
                        } else {
                            kernel.run_rows(order, w, tile, acts, 0, dst, r0, &mut buf);
                        }
                    }
                });
            });
        });
    }
}

impl CpuBackend {
    /// Quantizes `n` rows of `x` to Q8_K into `acts`, in parallel over tokens for prompt chunks.
    fn quantize_k(&self, acts: &mut KActs, x: &[f32], n: usize, cols: usize) {
        acts.resize(n, cols);
        let rows_per_task = if n >= 16 { n.div_ceil(self.desc.threads * TASKS_PER_THREAD) } else { n };
        let sbs = cols / kpacked::SB;
        let KActs { qs, d, bs16, bs32, .. } = acts;
        let parts: Vec<Mutex<_>> = qs
            .chunks_mut(rows_per_task * cols)
            .zip(d.chunks_mut(rows_per_task * sbs))
            .zip(bs16.chunks_mut(rows_per_task * sbs * 16))
            .zip(bs32.chunks_mut(rows_per_task * sbs * 8))
            .map(Mutex::new)
            .collect();
        let run = |i: usize| {
            let mut g = parts[i].lock().unwrap_or_else(|e| e.into_inner());
            let (((qs, d), bs16), bs32) = &mut *g;
            let x = &x[i * rows_per_task * cols..(i * rows_per_task * cols + qs.len()).min(n * cols)];
            kpacked::quantize_rows(x, kpacked::KActsOut { qs, d, bs16, bs32 });
        };
        if parts.len() == 1 {
            run(0);
        } else {
            self.pool.run(parts.len(), &run);
        }
    }

    /// [`Self::matmul_packed`] for K-quant matrices sharing `cols` (Q8_K activations, one
    /// quantization of `x`, one parallel step over all their tiles).
    fn matmul_kpacked(&self, ws: &[&KPackedMatrix], x: &[f32], n: usize, outs: &mut [Vec<&mut [f32]>]) {
        let kernel = Kernel::best();
        let cols = ws[0].cols;
        KACTS.with(|acts| {
            let mut acts = acts.borrow_mut();
            self.quantize_k(&mut acts, x, n, cols);
            let acts = &*acts;
            let shapes: Vec<(usize, usize)> = ws.iter().map(|w| (w.rows, w.tiles())).collect();
            let tasks = tile_tasks(self.desc.threads, n, &shapes, outs);
            let block = kpacked_token_block(cols, n);
            self.pool.run(tasks.len(), &|i| {
                let mut g = tasks[i].lock().unwrap_or_else(|e| e.into_inner());
                let (m, t0, nt, ref mut dst) = *g;
                let w = ws[m];
                SCRATCH.with(|buf| {
                    let mut buf = buf.borrow_mut();
                    for b0 in (0..n).step_by(block) {
                        let rows = &mut dst[b0..(b0 + block).min(n)];
                        for tile in t0..t0 + nt {
                            let r0 = (tile - t0) * TILE_ROWS;
                            kpacked::run_rows(kernel, w, tile, acts, b0, rows, r0, &mut buf);
                        }
                    }
                });
            });
        });
    }
}

/// Activation bytes a K-quant matmul keeps in flight per tile pass: its tokens are taken in
/// blocks of about this many bytes of Q8_K activations, every tile over one block before the
/// next, so a block stays in L2 while the tiles stream by. With all 256 tokens of a prompt
/// chunk at once, a 1536 × 8960 down projection read 2.3 MB of activations per tile from
/// memory: `kkbench` (one thread, Q4_K, 256 tokens) 168 G MAC/s at once, 201 / 218 / 204 in
/// blocks of 120 / 60 / 30 tokens; Q6_K within noise (152–162).
const KPACKED_ACT_BLOCK_BYTES: usize = 512 << 10;

/// Tokens per block for a K-quant matmul of `cols` columns over `n` tokens: as few blocks as
/// keep each within [`KPACKED_ACT_BLOCK_BYTES`] (plus half again: a 64-token chunk of the
/// down projection, 573 KB, stays whole), the tokens shared evenly between them in whole calls
/// of the buffered kernel (6 tokens), so no block is a small remainder.
fn kpacked_token_block(cols: usize, n: usize) -> usize {
    let per = 6;
    let bytes = n.saturating_mul(cols);
    let blocks = bytes.div_ceil(KPACKED_ACT_BLOCK_BYTES + KPACKED_ACT_BLOCK_BYTES / 2).max(1);
    n.div_ceil(blocks).next_multiple_of(per).clamp(1, n.max(1))
}

/// One task of a packed matmul's parallel step: (matrix, first tile, tiles, each token's rows
/// of those tiles).
type TileTask<'a> = (usize, usize, usize, Vec<&'a mut [f32]>);

/// The tasks of one parallel step over the tiles of several matrices (`shapes[m]` = rows and
/// tiles of matrix `m`, `outs[m][t]` its output row for token `t`, taken): each task a run of
/// one matrix's tiles with every token's rows of them.
fn tile_tasks<'a>(
    threads: usize,
    n: usize,
    shapes: &[(usize, usize)],
    outs: &mut [Vec<&'a mut [f32]>],
) -> Vec<Mutex<TileTask<'a>>> {
    let total_tiles: usize = shapes.iter().map(|&(_, t)| t).sum();
    let tpt = if n <= 16 { MATMUL_TASKS_PER_THREAD } else { MATMUL_TASKS_PER_THREAD_PREFILL };
    let tasks_wanted = threads * tpt;
    let mut tasks = Vec::new();
    for (m, (&(rows, tiles), out)) in shapes.iter().zip(outs.iter_mut()).enumerate() {
        // Each matrix gets its share of the tasks by its share of the tiles, in runs as even as
        // it allows: Q, K and V of 36, 12 and 12 tiles make 18, 18, 12 and 12 for 4 tasks (2 per
        // thread), not 15, 15, 6, 12 and 12 (runs of a fixed length leave one thread 6 tiles
        // more). B=8 pass 0.9–1.3% faster in four runs, one sequence 0.5–1.2% in three,
        // alternating pass by pass.
        let pieces = match tiles {
            0 => 0,
            t => ((t * tasks_wanted + total_tiles / 2) / total_tiles).clamp(1, t),
        };
        let starts: Vec<usize> = (0..pieces).map(|p| p * tiles / pieces).collect();
        let mut per_token: Vec<Vec<&mut [f32]>> = (0..starts.len()).map(|_| Vec::with_capacity(n)).collect();
        for row in out.iter_mut().take(n) {
            let mut rest: &mut [f32] = std::mem::take(row);
            for (k, &t0) in starts.iter().enumerate() {
                let end = starts.get(k + 1).map_or(rows, |&t1| t1 * TILE_ROWS);
                let (mine, tail) = std::mem::take(&mut rest).split_at_mut(end - t0 * TILE_ROWS);
                per_token[k].push(mine);
                rest = tail;
            }
        }
        for (k, dst) in per_token.into_iter().enumerate() {
            let t0 = starts[k];
            let nt = starts.get(k + 1).copied().unwrap_or(tiles) - t0;
            tasks.push(Mutex::new((m, t0, nt, dst)));
        }
    }
    tasks
}

/// Numbers every packed matmul, so a thread knows whether its [`OWN_ACTS`] are this step's.
static MATMUL_STEP: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

thread_local! {
    /// The rotation table of this thread's last `rope` call (every layer of a pass rotates Q
    /// and K at the same positions, so it is computed once per pass instead of 2 × layers
    /// times). Per thread: the parts of a split pass rotate at their own positions.
    static ROPE_TABLE: std::cell::RefCell<RopeTable> = std::cell::RefCell::new(RopeTable::default());
    /// The current (token, head)'s rounded query and attention scores, reused on this thread.
    static SCORES: std::cell::RefCell<(Vec<f32>, Vec<f32>)> = const { std::cell::RefCell::new((Vec::new(), Vec::new())) };
    /// Q8_K activations of the current K-quant matmul, reused between calls on this thread.
    static KACTS: std::cell::RefCell<KActs> = std::cell::RefCell::new(KActs::default());
    /// Quantized activations of the current matmul, reused between calls on this thread.
    static ACTS: std::cell::RefCell<QuantActs> = std::cell::RefCell::new(QuantActs::default());
    /// This thread's own quantization of a decode batch's activations, and the matmul step
    /// ([`MATMUL_STEP`]) it belongs to.
    static OWN_ACTS: std::cell::RefCell<(u64, QuantActs)> = std::cell::RefCell::new((0, QuantActs::default()));
    /// One tile's results for every token of a matmul where a kernel cannot store them in
    /// place (`Kernel::run_rows`), reused on this thread.
    static SCRATCH: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Parallel tasks per worker thread in a packed matmul of a few tokens (decode steps). Few, so
/// that each thread streams long runs of tiles (a task starts on a tile not yet in cache; the
/// next-tile prefetch covers the rest): the batched-decode pass measured fastest at 2
/// (`batchbench`, B=8: 19.3 ms against 21.0–23.3 ms at 1, 4 and 8; best of 4 runs each).
const MATMUL_TASKS_PER_THREAD: usize = 2;
/// The same for prompt chunks, whose tiles take long: more slack for uneven progress.
const MATMUL_TASKS_PER_THREAD_PREFILL: usize = 4;
/// Parallel tasks per worker thread for attention and quantization (slack for uneven work).
const TASKS_PER_THREAD: usize = 8;

fn shape_err(op: &'static str, detail: String) -> BackendError {
    BackendError::Shape { op, detail }
}

impl Backend for CpuBackend {
    fn descriptor(&self) -> &DeviceDesc {
        &self.desc
    }

    fn split_parts(&self) -> usize {
        if Pool::in_split() {
            1
        } else {
            self.pool.threads()
        }
    }

    fn split(&self, parts: usize, f: &(dyn Fn(usize) + Sync)) -> bool {
        if self.split_parts() < 2 {
            return false;
        }
        self.pool.run_split(parts, f);
        true
    }

    fn matmul(&self, w: &WeightMatrix, x: &[f32], n: usize, out: &mut [f32]) -> Result<(), BackendError> {
        let (rows, cols) = (w.rows, w.cols);
        if x.len() != n * cols || out.len() != n * rows {
            return Err(shape_err(
                "matmul",
                format!("{}: {rows}x{cols} weights, {} inputs, {} outputs for {n} tokens", w.name, x.len(), out.len()),
            ));
        }
        if let Some(p) = &w.packed {
            self.matmul_packed(&[p], x, n, &mut [out.chunks_exact_mut(rows).collect()], packed::Order::Lanes);
            return Ok(());
        }
        if let Some(k) = &w.kpacked {
            self.matmul_kpacked(&[k], x, n, &mut [out.chunks_exact_mut(rows).collect()]);
            return Ok(());
        }
        let at = w.ty.vec_dot_type();
        let arow = at.row_bytes(cols).ok_or_else(|| shape_err("matmul", format!("{cols} columns for {at}")))?;
        let mut xq = vec![0u8; n * arow];
        for (xr, qr) in x.chunks_exact(cols).zip(xq.chunks_exact_mut(arow)) {
            quant::quantize_row(at, xr, qr)?;
        }
        let wrow = w.row_bytes();
        let wb = w.bytes();
        let ty = w.ty;
        {
            if n == 1 {
                par_chunks(&self.pool, out, ROWS_PER_TASK, |ci, o| {
                    for (i, v) in o.iter_mut().enumerate() {
                        let r = ci * ROWS_PER_TASK + i;
                        *v = rows::dot(ty, &wb[r * wrow..(r + 1) * wrow], &xq);
                    }
                });
            } else {
                // Each task takes a band of weight rows and all tokens, so a weight row is
                // read once per batch; results land transposed and are put back after.
                let mut out_t = vec![0f32; rows * n];
                par_chunks(&self.pool, &mut out_t, ROWS_PER_TASK * n, |ci, o| {
                    for (rr, orow) in o.chunks_exact_mut(n).enumerate() {
                        let r = ci * ROWS_PER_TASK + rr;
                        let wr = &wb[r * wrow..(r + 1) * wrow];
                        for (t, v) in orow.iter_mut().enumerate() {
                            *v = rows::dot(ty, wr, &xq[t * arow..(t + 1) * arow]);
                        }
                    }
                });
                for (r, col) in out_t.chunks_exact(n).enumerate() {
                    for (t, v) in col.iter().enumerate() {
                        out[t * rows + r] = *v;
                    }
                }
            }
        }
        Ok(())
    }

    fn matmul_many(
        &self,
        ws: &[&WeightMatrix],
        x: &[f32],
        n: usize,
        outs: &mut [&mut [f32]],
    ) -> Result<(), BackendError> {
        let packed: Option<Vec<&PackedMatrix>> = ws.iter().map(|w| w.packed.as_deref()).collect();
        let kpacked: Option<Vec<&KPackedMatrix>> = ws.iter().map(|w| w.kpacked.as_deref()).collect();
        let fits = ws.len() == outs.len()
            && !ws.is_empty()
            && ws.iter().all(|w| w.cols == ws[0].cols && x.len() == n * w.cols)
            && ws.iter().zip(outs.iter()).all(|(w, o)| o.len() == n * w.rows);
        match packed {
            Some(p) if fits => {
                let mut rows: Vec<Vec<&mut [f32]>> =
                    ws.iter().zip(outs.iter_mut()).map(|(w, o)| o.chunks_exact_mut(w.rows).collect()).collect();
                self.matmul_packed(&p, x, n, &mut rows, packed::Order::Lanes);
                Ok(())
            }
            _ if fits && kpacked.is_some() => {
                let mut rows: Vec<Vec<&mut [f32]>> =
                    ws.iter().zip(outs.iter_mut()).map(|(w, o)| o.chunks_exact_mut(w.rows).collect()).collect();
                self.matmul_kpacked(&kpacked.unwrap_or_default(), x, n, &mut rows);
                Ok(())
            }
            _ => {
                for (w, o) in ws.iter().zip(outs.iter_mut()) {
                    self.matmul(w, x, n, o)?;
                }
                Ok(())
            }
        }
    }

    fn matmul_rows(&self, w: &WeightMatrix, x: &[f32], rows: &mut [&mut [f32]]) -> Result<(), BackendError> {
        let n = rows.len();
        if x.len() != n * w.cols || rows.iter().any(|r| r.len() != w.rows) {
            return Err(shape_err(
                "matmul_rows",
                format!("{}: {}x{} weights, {} inputs for {n} output rows", w.name, w.rows, w.cols, x.len()),
            ));
        }
        match &w.packed {
            Some(p) => {
                let mut outs = vec![rows.iter_mut().map(|r| &mut **r).collect::<Vec<&mut [f32]>>()];
                // The output head: its results are final, so it sums each block in one integer
                // (`packed::Order::BlockSum`, see there).
                self.matmul_packed(&[p], x, n, &mut outs, packed::Order::BlockSum);
                Ok(())
            }
            None if w.kpacked.is_some() => {
                let k = w.kpacked.as_deref().into_iter().collect::<Vec<_>>();
                let mut outs = vec![rows.iter_mut().map(|r| &mut **r).collect::<Vec<&mut [f32]>>()];
                self.matmul_kpacked(&k, x, n, &mut outs);
                Ok(())
            }
            _ => {
                let mut out = vec![0f32; n * w.rows];
                self.matmul(w, x, n, &mut out)?;
                for (r, o) in rows.iter_mut().zip(out.chunks_exact(w.rows.max(1))) {
                    r.copy_from_slice(o);
                }
                Ok(())
            }
        }
    }

    fn get_rows(&self, w: &WeightMatrix, ids: &[u32], out: &mut [f32]) -> Result<(), BackendError> {
        if out.len() != ids.len() * w.cols {
            return Err(shape_err("get_rows", format!("{} outputs for {} ids of {}", out.len(), ids.len(), w.cols)));
        }
        for (&id, o) in ids.iter().zip(out.chunks_exact_mut(w.cols)) {
            if let Some(p) = &w.packed {
                if (id as usize) < p.rows {
                    p.dequantize_row(id as usize, o);
                    continue;
                }
            }
            if let Some(p) = &w.kpacked {
                if (id as usize) < p.rows {
                    p.dequantize_row(id as usize, o);
                    continue;
                }
            }
            if w.on_flash {
                let mut buf = Vec::new();
                w.read_row(id as usize, &mut buf)
                    .map_err(|e| shape_err("get_rows", format!("row {id} of {} from storage: {e}", w.name)))?;
                quant::dequantize_row(w.ty, &buf, o)?;
                continue;
            }
            let row = w
                .row(id as usize)
                .ok_or_else(|| shape_err("get_rows", format!("row {id} of {} in {}", w.rows, w.name)))?;
            quant::dequantize_row(w.ty, row, o)?;
        }
        Ok(())
    }

    fn rms_norm(&self, x: &mut [f32], weight: &[f32], eps: f32) -> Result<(), BackendError> {
        let d = weight.len();
        if d == 0 || !x.len().is_multiple_of(d) {
            return Err(shape_err("rms_norm", format!("{} values for rows of {d}", x.len())));
        }
        // Four rows at a time: each row's sum runs in the same order as alone (so the values
        // are the same), but the four dependent f64 add chains overlap (B=8 pass ~1% faster,
        // measured alternating pass by pass).
        let mut groups = x.chunks_exact_mut(4 * d);
        for g in &mut groups {
            let mut sums = [0f64; 4];
            for i in 0..d {
                for (r, s) in sums.iter_mut().enumerate() {
                    let v = g[r * d + i];
                    *s += (v * v) as f64;
                }
            }
            for (row, sum) in g.chunks_exact_mut(d).zip(sums) {
                scale_row(row, weight, sum, eps);
            }
        }
        for row in groups.into_remainder().chunks_exact_mut(d) {
            let sum: f64 = row.iter().map(|&v| (v * v) as f64).sum();
            scale_row(row, weight, sum, eps);
        }
        Ok(())
    }

    fn rope(
        &self,
        x: &mut [f32],
        positions: &[usize],
        p: &RopeParams,
        freq_factors: Option<&[f32]>,
    ) -> Result<(), BackendError> {
        let row = p.n_heads * p.head_dim;
        if x.len() != positions.len() * row || p.rope_dims > p.head_dim || !p.rope_dims.is_multiple_of(2) {
            return Err(shape_err("rope", format!("{} values for {} positions of {row}", x.len(), positions.len())));
        }
        if freq_factors.is_some_and(|f| f.len() < p.rope_dims / 2) {
            return Err(shape_err("rope", "fewer frequency factors than rotated pairs".into()));
        }
        let half = p.rope_dims / 2;
        let key = (
            p.theta.to_bits(),
            p.freq_scale.to_bits(),
            p.rope_dims,
            freq_factors.map(|f| f[..half].iter().map(|v| v.to_bits()).collect()),
        );
        ROPE_TABLE.with_borrow_mut(|table| {
            if table.key != key || table.positions != positions {
                let theta_scale = p.theta.powf(-2.0 / p.rope_dims as f32);
                table.cs.clear();
                for &pos in positions {
                    // ggml computes the angle by repeated multiplication; we do the same.
                    let mut theta = pos as f32;
                    for i in 0..half {
                        let ff = freq_factors.map_or(1.0, |f| f[i]);
                        let t = p.freq_scale * (theta / ff);
                        table.cs.push((t.cos(), t.sin()));
                        theta *= theta_scale;
                    }
                }
                table.key = key;
                table.positions.clear();
                table.positions.extend_from_slice(positions);
            }
            for (xr, cs) in x.chunks_exact_mut(row).zip(table.cs.chunks_exact(half.max(1))) {
                let rotate = |x0: &mut f32, x1: &mut f32, (cos, sin): (f32, f32)| {
                    let (a, b) = (*x0, *x1);
                    *x0 = a * cos - b * sin;
                    *x1 = a * sin + b * cos;
                };
                for head in xr.chunks_exact_mut(p.head_dim) {
                    match p.style {
                        RopeStyle::Interleaved => {
                            for (pair, &c) in head[..2 * half].chunks_exact_mut(2).zip(cs) {
                                let [x0, x1] = pair else { continue };
                                rotate(x0, x1, c);
                            }
                        }
                        RopeStyle::Neox => {
                            let (lo, hi) = head[..2 * half].split_at_mut(half);
                            for ((x0, x1), &c) in lo.iter_mut().zip(hi.iter_mut()).zip(cs) {
                                rotate(x0, x1, c);
                            }
                        }
                    }
                }
            }
        });
        Ok(())
    }

    fn attention(&self, s: &AttentionShape, q: &[f32], kv: KvLayer<'_>, out: &mut [f32]) -> Result<(), BackendError> {
        self.attention_many(&mut [AttentionItem { shape: *s, q, kv: KvInput::Ready(kv), out }])
    }

    fn attention_many(&self, items: &mut [AttentionItem<'_>]) -> Result<(), BackendError> {
        for it in items.iter() {
            match &it.kv {
                KvInput::Ready(kv) => check_attention(&it.shape, it.q, *kv, it.out)?,
                KvInput::AppendF16 { k, v, k_new, v_new } => {
                    check_append(&it.shape, (it.q, it.out), (k, v), (k_new, v_new))?
                }
            }
        }
        // The unit of work: the query heads of one token that share a KV head (converting
        // each key and value row once for all of them), or single heads when that leaves too
        // few units to keep every thread busy (one token decoding: a few KV heads).
        let kv_units: usize = items.iter().map(|it| it.shape.n_tokens * it.shape.n_kv_heads).sum();
        let grouped = kv_units >= self.desc.threads * 4;
        let unit_heads = |s: &AttentionShape| {
            if grouped && s.n_heads.is_multiple_of(s.n_kv_heads) {
                s.n_heads / s.n_kv_heads
            } else {
                1
            }
        };
        let units: usize = items.iter().map(|it| it.shape.n_tokens * it.shape.n_heads / unit_heads(&it.shape)).sum();
        let per_task = units.div_ceil(self.desc.threads * TASKS_PER_THREAD).max(1);
        // Tasks: runs of up to `per_task` units of one sequence. A one-token item whose units
        // are its KV heads appends each head's new key and value in the task that then attends
        // over that head (`fold`): on the calling thread, the appends of a B=8 pass would be
        // serial work while the workers wait. Other items' new rows are appended here first.
        type Fold<'a> = (&'a mut [Vec<half::f16>], &'a mut [Vec<half::f16>], &'a [f32], &'a [f32]);
        type Task<'a> = Mutex<(usize, usize, &'a mut [f32], Option<Fold<'a>>)>;
        let mut tasks: Vec<Task<'_>> = Vec::new();
        let mut views = Vec::with_capacity(items.len());
        for (i, it) in items.iter_mut().enumerate() {
            let s = it.shape;
            let gh = unit_heads(&s);
            let hd = s.head_dim;
            let fold = gh > 1 && s.n_tokens == 1 && matches!(it.kv, KvInput::AppendF16 { .. });
            let kv = if fold { KvLayer::F16 { k: &[], v: &[] } } else { it.append_all()? };
            views.push((s, it.q, kv, gh));
            let outs = it.out.chunks_mut(hd * gh * per_task);
            match std::mem::replace(&mut it.kv, KvInput::Ready(kv)) {
                KvInput::AppendF16 { k, v, k_new, v_new } if fold => {
                    for (c, ((chunk, kc), vc)) in
                        outs.zip(k.chunks_mut(per_task)).zip(v.chunks_mut(per_task)).enumerate()
                    {
                        tasks.push(Mutex::new((i, c * per_task, chunk, Some((kc, vc, k_new, v_new)))));
                    }
                }
                _ => {
                    for (c, chunk) in outs.enumerate() {
                        tasks.push(Mutex::new((i, c * per_task, chunk, None)));
                    }
                }
            }
        }
        let kern = AttnKernels::best();
        self.pool.run(tasks.len(), &|ti| {
            let mut g = tasks[ti].lock().unwrap_or_else(|e| e.into_inner());
            let (i, first, ref mut chunk, ref mut fold) = *g;
            let (s, q, kv, gh) = views[i];
            let per_token = s.n_heads / gh;
            let kv_dim = s.n_kv_heads * s.head_dim;
            SCORES.with(|p| {
                let mut p = p.borrow_mut();
                for (k, o) in chunk.chunks_exact_mut(s.head_dim * gh).enumerate() {
                    let u = first + k;
                    let (t, h0) = (u / per_token, (u % per_token) * gh);
                    match fold {
                        // One token: unit `u` is KV head `u`, the task's head `k`.
                        Some((kh, vh, k_new, v_new)) => {
                            append_head(&mut kh[k], s.start, u, s.head_dim, k_new, kv_dim, kern.to_f16);
                            append_head(&mut vh[k], s.start, u, s.head_dim, v_new, kv_dim, kern.to_f16);
                            let next = kh.get(k + 1).map(|x| &x[..]);
                            attend_group_f16(&s, q, (&kh[k], &vh[k]), next, t, h0, o, &mut p, &kern);
                        }
                        None if gh == 1 => attend_one(&s, q, kv, t, h0, o, &mut p, &kern),
                        None => attend_group(&s, q, kv, t, h0, o, &mut p, &kern),
                    }
                }
            });
        });
        Ok(())
    }

    fn attention_sparse(
        &self,
        items: &mut [AttentionItem<'_>],
        layer: usize,
        sa: &crate::backend::sparse::SparseAttn,
    ) -> Result<(), BackendError> {
        self.sparse_attention(items, layer, sa)
    }

    fn swiglu(&self, gate: &mut [f32], up: &[f32]) -> Result<(), BackendError> {
        if gate.len() != up.len() {
            return Err(shape_err("swiglu", format!("gate {} vs up {}", gate.len(), up.len())));
        }
        let kern = AttnKernels::best();
        let f = |g: &mut [f32], u: &[f32]| {
            (kern.swiglu)(g, u);
        };
        // Element-wise, so any split gives the same values; large batches use every thread.
        if gate.len() >= 8192 && self.desc.threads > 1 {
            let chunk = gate.len().div_ceil(self.desc.threads * 2);
            par_chunks(&self.pool, gate, chunk, |i, g| f(g, &up[i * chunk..i * chunk + g.len()]));
        } else {
            f(gate, up);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::{ModelBytes, TensorRef};
    use half::f16;
    use std::sync::Arc;

    /// f16 rounding of queries, keys, values and softmax weights: ~2^-11 relative each.
    const ATTENTION_TOL: f32 = 5e-3;

    fn det(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| (((i as u32).wrapping_mul(2654435761).wrapping_add(seed) >> 8) % 2001) as f32 / 1000.0 - 1.0)
            .collect()
    }

    fn rope(style: RopeStyle) -> RopeParams {
        RopeParams { n_heads: 2, head_dim: 8, rope_dims: 8, theta: 10000.0, freq_scale: 1.0, style }
    }

    #[test]
    fn rope_reuses_its_table_only_for_the_same_positions_and_parameters() {
        // One backend across calls against a fresh backend per call: any stale table shows.
        let shared = CpuBackend::new(1);
        let ff = [1.0f32, 2.0, 4.0, 8.0];
        let ff2 = [1.0f32, 2.0, 4.0, 9.0];
        let mut p2 = rope(RopeStyle::Neox);
        p2.theta = 500.0;
        let mut p3 = rope(RopeStyle::Neox);
        p3.rope_dims = 4;
        type Call<'a> = (&'a [usize], RopeParams, Option<&'a [f32]>);
        let calls: [Call; 7] = [
            (&[3, 4], rope(RopeStyle::Neox), None),
            (&[3, 4], rope(RopeStyle::Interleaved), None),
            (&[3, 5], rope(RopeStyle::Neox), None),
            (&[3, 5], p2, None),
            (&[3, 5], p3, None),
            (&[3, 5], rope(RopeStyle::Neox), Some(&ff)),
            (&[3, 5], rope(RopeStyle::Neox), Some(&ff2)),
        ];
        for (i, (pos, p, f)) in calls.iter().enumerate() {
            let x = det(pos.len() * p.n_heads * p.head_dim, 40 + i as u32);
            let (mut a, mut b) = (x.clone(), x);
            shared.rope(&mut a, pos, p, *f).expect("shape");
            CpuBackend::new(1).rope(&mut b, pos, p, *f).expect("shape");
            assert_eq!(a, b, "call {i}");
        }
    }

    #[test]
    fn interleaved_rope_on_gguf_permuted_rows_equals_neox_rope() {
        // GGUF's converter reorders each head's rows so that pair (2i, 2i+1) holds HF's (i, i+d/2).
        let cpu = CpuBackend::new(1);
        let hd = 8;
        let x = det(2 * hd, 3);
        let permute = |v: &[f32]| -> Vec<f32> {
            let mut out = vec![0f32; v.len()];
            for h in 0..2 {
                for i in 0..hd / 2 {
                    out[h * hd + 2 * i] = v[h * hd + i];
                    out[h * hd + 2 * i + 1] = v[h * hd + i + hd / 2];
                }
            }
            out
        };
        for pos in [0usize, 1, 7, 1000] {
            let mut neox = x.clone();
            cpu.rope(&mut neox, &[pos], &rope(RopeStyle::Neox), None).expect("rope");
            let mut inter = permute(&x);
            cpu.rope(&mut inter, &[pos], &rope(RopeStyle::Interleaved), None).expect("rope");
            assert_eq!(inter, permute(&neox), "position {pos}");
        }
    }

    /// One-token items whose new keys and values attention appends itself: grouped (8 KV units
    /// on 2 threads, each task appending its heads) and not (2 units) give the same bits as
    /// the caches appended first, and leave the same caches; a wrong append is a typed error.
    #[test]
    fn attention_appends_new_keys_and_values_exactly_as_a_prior_append() {
        let cpu = CpuBackend::new(2);
        let (n_heads, n_kv, hd) = (6, 2, 16);
        let kv_dim = n_kv * hd;
        let to_f16 = AttnKernels::best().to_f16;
        for seqs in [1usize, 4] {
            let starts: Vec<usize> = (0..seqs).map(|i| 3 + 5 * i).collect();
            type HeadCaches = (Vec<Vec<f16>>, Vec<Vec<f16>>);
            let caches: Vec<HeadCaches> = starts
                .iter()
                .enumerate()
                .map(|(i, &st)| {
                    let h = |seed: u32| -> Vec<Vec<f16>> {
                        (0..n_kv)
                            .map(|j| det(st * hd, seed + j as u32).into_iter().map(f16::from_f32).collect())
                            .collect()
                    };
                    (h(10 * i as u32), h(10 * i as u32 + 5))
                })
                .collect();
            let qs: Vec<Vec<f32>> = (0..seqs).map(|i| det(n_heads * hd, 100 + i as u32)).collect();
            let news: Vec<(Vec<f32>, Vec<f32>)> =
                (0..seqs).map(|i| (det(kv_dim, 200 + i as u32), det(kv_dim, 300 + i as u32))).collect();
            let shape = |st: usize| AttentionShape { n_heads, n_kv_heads: n_kv, head_dim: hd, start: st, n_tokens: 1 };
            // Appended first, then attended.
            let mut ready = caches.clone();
            for ((k, v), ((kn, vn), &st)) in ready.iter_mut().zip(news.iter().zip(&starts)) {
                for h in 0..n_kv {
                    crate::backend::kv::append_head(&mut k[h], st, h, hd, kn, kv_dim, to_f16);
                    crate::backend::kv::append_head(&mut v[h], st, h, hd, vn, kv_dim, to_f16);
                }
            }
            let mut want = vec![vec![0f32; n_heads * hd]; seqs];
            let mut items: Vec<AttentionItem<'_>> = ready
                .iter()
                .zip(&qs)
                .zip(want.iter_mut())
                .zip(&starts)
                .map(|((((k, v), q), out), &st)| AttentionItem {
                    shape: shape(st),
                    q,
                    kv: KvInput::Ready(KvLayer::F16 { k, v }),
                    out,
                })
                .collect();
            cpu.attention_many(&mut items).expect("ready");
            drop(items);
            // Appended by attention.
            let mut own = caches.clone();
            let mut got = vec![vec![0f32; n_heads * hd]; seqs];
            let mut items: Vec<AttentionItem<'_>> = own
                .iter_mut()
                .zip(&qs)
                .zip(got.iter_mut())
                .zip(news.iter().zip(&starts))
                .map(|((((k, v), q), out), ((kn, vn), &st))| AttentionItem {
                    shape: shape(st),
                    q,
                    kv: KvInput::AppendF16 { k, v, k_new: kn, v_new: vn },
                    out,
                })
                .collect();
            cpu.attention_many(&mut items).expect("append");
            drop(items);
            assert_eq!(got, want, "{seqs} sequences");
            assert_eq!(own, ready, "{seqs} sequences: caches");
        }
        // Three values short of a row: an error, and nothing attended.
        let (mut k, mut v) = (vec![Vec::new(); n_kv], vec![Vec::new(); n_kv]);
        let (q, short) = (det(n_heads * hd, 1), det(kv_dim - 3, 2));
        let mut out = vec![0f32; n_heads * hd];
        let mut items = [AttentionItem {
            shape: AttentionShape { n_heads, n_kv_heads: n_kv, head_dim: hd, start: 0, n_tokens: 1 },
            q: &q,
            kv: KvInput::AppendF16 { k: &mut k, v: &mut v, k_new: &short, v_new: &short },
            out: &mut out,
        }];
        assert!(matches!(cpu.attention_many(&mut items), Err(BackendError::Shape { op: "attention", .. })));
    }

    #[test]
    fn attention_matches_a_float64_reference() {
        // 3 tokens × 2 KV heads run head by head; 7 tokens (14 units ≥ 4 × 2 threads) run the
        // heads of each KV head together.
        for n in [3, 7] {
            attention_case(n);
        }
    }

    fn attention_case(n: usize) {
        let cpu = CpuBackend::new(2);
        let (n_heads, n_kv, hd, start) = (6, 2, 16, 5);
        let total = start + n;
        let q = det(n * n_heads * hd, 1);
        let k: Vec<f16> = det(total * n_kv * hd, 2).into_iter().map(f16::from_f32).collect();
        let v: Vec<f16> = det(total * n_kv * hd, 3).into_iter().map(f16::from_f32).collect();
        let mut out = vec![0f32; q.len()];
        let s = AttentionShape { n_heads, n_kv_heads: n_kv, head_dim: hd, start, n_tokens: n };
        // The cache keeps one vector per KV head.
        let per_head = |x: &[f16]| -> Vec<Vec<f16>> {
            (0..n_kv)
                .map(|h| x.chunks_exact(n_kv * hd).flat_map(|row| &row[h * hd..(h + 1) * hd]).copied().collect())
                .collect()
        };
        let (kh, vh) = (per_head(&k), per_head(&v));
        cpu.attention(&s, &q, KvLayer::F16 { k: &kh, v: &vh }, &mut out).expect("attention");
        for t in 0..n {
            for h in 0..n_heads {
                let kvh = h / (n_heads / n_kv);
                let ctx = start + t + 1;
                let scores: Vec<f64> = (0..ctx)
                    .map(|j| {
                        (0..hd)
                            .map(|d| q[(t * n_heads + h) * hd + d] as f64 * k[(j * n_kv + kvh) * hd + d].to_f64())
                            .sum::<f64>()
                            / (hd as f64).sqrt()
                    })
                    .collect();
                let m = scores.iter().cloned().fold(f64::MIN, f64::max);
                let z: f64 = scores.iter().map(|s| (s - m).exp()).sum();
                for d in 0..hd {
                    let want: f64 =
                        (0..ctx).map(|j| (scores[j] - m).exp() / z * v[(j * n_kv + kvh) * hd + d].to_f64()).sum();
                    let got = out[(t * n_heads + h) * hd + d];
                    assert!((got as f64 - want).abs() <= ATTENTION_TOL as f64, "t{t} h{h} d{d}: {got} vs {want}");
                }
            }
        }
        // Each token alone (one unit per head) gives the same bits as all of them at once.
        for t in 0..n {
            let st = AttentionShape { start: start + t, n_tokens: 1, ..s };
            let trunc =
                |x: &Vec<Vec<f16>>| -> Vec<Vec<f16>> { x.iter().map(|h| h[..(start + t + 1) * hd].to_vec()).collect() };
            let (kt, vt) = (trunc(&kh), trunc(&vh));
            let row = n_heads * hd;
            let mut one = vec![0f32; row];
            cpu.attention(&st, &q[t * row..(t + 1) * row], KvLayer::F16 { k: &kt, v: &vt }, &mut one)
                .expect("attention");
            assert_eq!(one, out[t * row..(t + 1) * row], "token {t} of {n}");
        }
    }

    #[test]
    fn rms_norm_of_many_rows_equals_each_row_alone_and_the_definition() {
        let cpu = CpuBackend::new(2);
        let d = 96;
        let w = det(d, 5);
        for rows in [1usize, 3, 4, 7, 9] {
            let x: Vec<f32> = det(rows * d, 6).iter().map(|v| v * 3.0).collect();
            let mut all = x.clone();
            cpu.rms_norm(&mut all, &w, 1e-5).expect("rows of d");
            for (r, got) in all.chunks_exact(d).enumerate() {
                let mut one = x[r * d..(r + 1) * d].to_vec();
                cpu.rms_norm(&mut one, &w, 1e-5).expect("one row");
                assert_eq!(got, &one[..], "rows={rows} row {r}");
                let row = &x[r * d..(r + 1) * d];
                let ms = row.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / d as f64;
                for ((g, &v), &wi) in got.iter().zip(row).zip(&w) {
                    let want = v as f64 / (ms + 1e-5).sqrt() * wi as f64;
                    assert!((*g as f64 - want).abs() <= 1e-5 * (1.0 + want.abs()), "rows={rows} row {r}");
                }
            }
        }
        assert!(cpu.rms_norm(&mut [0.0; 5], &w, 1e-5).is_err());
    }

    #[test]
    fn batched_matmul_equals_one_token_at_a_time() {
        let cpu = CpuBackend::new(2);
        let (rows, cols, n) = (70, 64, 5);
        let mut raw = vec![0u8; rows * GgmlType::Q8_0.row_bytes(cols).expect("blocks")];
        for (r, chunk) in raw.chunks_exact_mut(GgmlType::Q8_0.row_bytes(cols).expect("blocks")).enumerate() {
            quant::quantize_row(GgmlType::Q8_0, &det(cols, r as u32), chunk).expect("quantize");
        }
        let len = raw.len();
        let tensor = TensorRef {
            ty: GgmlType::Q8_0,
            dims: vec![cols as u64, rows as u64],
            file: Arc::new(ModelBytes::Owned(raw)),
            range: 0..len,
        };
        let w = WeightMatrix::from_tensor("w", rows, cols, tensor);
        let x = det(n * cols, 99);
        let mut batched = vec![0f32; n * rows];
        cpu.matmul(&w, &x, n, &mut batched).expect("matmul");
        for t in 0..n {
            let mut one = vec![0f32; rows];
            cpu.matmul(&w, &x[t * cols..(t + 1) * cols], 1, &mut one).expect("matmul");
            assert_eq!(&batched[t * rows..(t + 1) * rows], &one[..], "token {t}");
        }
        assert!(cpu.matmul(&w, &x, n + 1, &mut batched).is_err(), "shape mismatch is an error");
        // `matmul_rows` (the output head) hands out one row per token. Unpacked, it equals the
        // contiguous result; packed, it sums in the head's order (`packed::Order::BlockSum`):
        // equal to that order's scalar reference, and each token alone to the batch.
        let p = w.packed.as_ref().expect("Q8_0 packs");
        let mut a = QuantActs::default();
        a.quantize(&x, n, cols);
        let mut tile = vec![0f32; TILE_ROWS * n];
        let mut head_ref = vec![0f32; n * rows];
        for t in 0..p.tiles() {
            packed::reference_order(packed::Order::BlockSum, p, t, &a, 0, n, &mut tile);
            for j in 0..n {
                for lane in 0..TILE_ROWS.min(rows - t * TILE_ROWS) {
                    head_ref[j * rows + t * TILE_ROWS + lane] = tile[j * TILE_ROWS + lane];
                }
            }
        }
        assert_ne!(head_ref, batched, "the orders round differently here");
        let mut unpacked = w.clone();
        unpacked.packed = None;
        for (m, want) in [(&w, &head_ref), (&unpacked, &batched)] {
            let mut rows_out = vec![vec![0f32; rows]; n];
            let mut refs: Vec<&mut [f32]> = rows_out.iter_mut().map(|r| &mut r[..]).collect();
            cpu.matmul_rows(m, &x, &mut refs).expect("matmul_rows");
            assert_eq!(&rows_out.concat(), want, "packed: {}", m.packed.is_some());
            for t in 0..n {
                let mut one = vec![0f32; rows];
                cpu.matmul_rows(m, &x[t * cols..(t + 1) * cols], &mut [&mut one[..]]).expect("matmul_rows");
                assert_eq!(one, rows_out[t], "packed: {}, token {t} alone", m.packed.is_some());
            }
            let mut short = vec![vec![0f32; rows - 1]; n];
            let mut refs: Vec<&mut [f32]> = short.iter_mut().map(|r| &mut r[..]).collect();
            assert!(cpu.matmul_rows(m, &x, &mut refs).is_err(), "a short output row is an error");
        }
    }

    /// A wide K-quant matrix over a prompt chunk runs its tokens in blocks
    /// (`kpacked_token_block`); every token's outputs equal that token run alone, and the
    /// scalar reference.
    #[test]
    fn a_wide_k_quant_matmul_in_token_blocks_equals_each_token_alone() {
        let cpu = CpuBackend::new(2);
        let (rows, cols, n) = (40, 8960, 128);
        assert_eq!(kpacked_token_block(cols, 64), 64, "a 64-token chunk stays whole");
        assert!(kpacked_token_block(cols, n) < n, "the test must cut the tokens into blocks");
        let ty = GgmlType::Q4_K;
        let rb = ty.row_bytes(cols).expect("super-blocks");
        let mut raw = vec![0u8; rows * rb];
        for (r, chunk) in raw.chunks_exact_mut(rb).enumerate() {
            // Random bits with small positive scales: any bytes are a valid Q4_K row.
            let mut s = 0x9E37_79B9u32.wrapping_mul(r as u32 + 1);
            for b in chunk.iter_mut() {
                s ^= s << 13;
                s ^= s >> 17;
                s ^= s << 5;
                *b = s as u8;
            }
            for sb in chunk.chunks_exact_mut(ty.type_size()) {
                sb[..4].copy_from_slice(&[0, 0x20, 0, 0x20]);
            }
        }
        let len = raw.len();
        let tensor = TensorRef {
            ty,
            dims: vec![cols as u64, rows as u64],
            file: Arc::new(ModelBytes::Owned(raw)),
            range: 0..len,
        };
        let w = WeightMatrix::from_tensor("w", rows, cols, tensor);
        assert!(w.kpacked.is_some());
        let x = det(n * cols, 7);
        let mut batched = vec![0f32; n * rows];
        cpu.matmul(&w, &x, n, &mut batched).expect("matmul");
        for t in [0, 1, 63, 64, 65, n - 1] {
            let mut one = vec![0f32; rows];
            cpu.matmul(&w, &x[t * cols..(t + 1) * cols], 1, &mut one).expect("matmul");
            assert_eq!(&batched[t * rows..(t + 1) * rows], &one[..], "token {t}");
        }
    }
}
