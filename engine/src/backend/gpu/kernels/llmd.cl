// llmd's OpenCL kernels: the portable baseline (OpenCL C 1.2, fp32 math, f16 storage through
// vload_half/vstore_half, which need no cl_khr_fp16). Built once per device with
// -DLS=<work-group size> and cached as a program binary (backend/gpu/program.rs).
//
// Weights stay in the model file's block layouts (ggml's), or the CPU's tiles, read through
// `dq_<type>`, which dequantizes one 32-value sub-block `j` of a row: the K-quants' 256-value
// super-blocks are eight such sub-blocks, so every matrix kernel works in 32-value steps.
//
// The fp16 variant (-DLLMD_FP16, only where the device has cl_khr_fp16): weights dequantize to
// half and the matmul's products and four-term sums are half (`dot` of half4s), each
// four-term sum added to an f32 accumulator — half the registers and, on a GPU with packed
// fp16 ALUs (Adreno, Mali), twice the multiply rate of f32. Activations, norms, attention and
// the accumulators stay f32.

#ifndef LS
#define LS 64
#endif
// Token rows one matmul work-group computes per weight read.
#define TILE 8

typedef global const uchar* row_t;

#ifdef LLMD_FP16
#pragma OPENCL EXTENSION cl_khr_fp16 : enable
typedef half wt;
#else
typedef float wt;
#endif

inline float f16_at(row_t p) { return vload_half(0, (global const half*)p); }

inline void dq_f32(row_t w, size_t r, uint stride, uint j, wt* o) {
    row_t row = w + r * stride;
    global const float* p = (global const float*)row + 32 * j;
    for (int i = 0; i < 32; i++) o[i] = p[i];
}

inline void dq_f16(row_t w, size_t r, uint stride, uint j, wt* o) {
    row_t row = w + r * stride;
    global const half* p = (global const half*)row + 32 * j;
    for (int i = 0; i < 32; i++) o[i] = vload_half(i, p);
}

inline void dq_q4_0(row_t w, size_t r, uint stride, uint j, wt* o) {
    row_t row = w + r * stride;
    row_t b = row + 18 * j;
    float d = f16_at(b);
    for (int i = 0; i < 16; i++) {
        uchar q = b[2 + i];
        o[i] = ((int)(q & 15) - 8) * d;
        o[i + 16] = ((int)(q >> 4) - 8) * d;
    }
}

inline void dq_q4_1(row_t w, size_t r, uint stride, uint j, wt* o) {
    row_t row = w + r * stride;
    row_t b = row + 20 * j;
    float d = f16_at(b), m = f16_at(b + 2);
    for (int i = 0; i < 16; i++) {
        uchar q = b[4 + i];
        o[i] = (q & 15) * d + m;
        o[i + 16] = (q >> 4) * d + m;
    }
}

inline void dq_q5_0(row_t w, size_t r, uint stride, uint j, wt* o) {
    row_t row = w + r * stride;
    row_t b = row + 22 * j;
    float d = f16_at(b);
    uint qh = (uint)b[2] | ((uint)b[3] << 8) | ((uint)b[4] << 16) | ((uint)b[5] << 24);
    for (int i = 0; i < 16; i++) {
        uchar q = b[6 + i];
        int x0 = (q & 15) | (((qh >> i) << 4) & 0x10);
        int x1 = (q >> 4) | ((qh >> (i + 12)) & 0x10);
        o[i] = (x0 - 16) * d;
        o[i + 16] = (x1 - 16) * d;
    }
}

inline void dq_q5_1(row_t w, size_t r, uint stride, uint j, wt* o) {
    row_t row = w + r * stride;
    row_t b = row + 24 * j;
    float d = f16_at(b), m = f16_at(b + 2);
    uint qh = (uint)b[4] | ((uint)b[5] << 8) | ((uint)b[6] << 16) | ((uint)b[7] << 24);
    for (int i = 0; i < 16; i++) {
        uchar q = b[8 + i];
        int x0 = (q & 15) | (((qh >> i) << 4) & 0x10);
        int x1 = (q >> 4) | ((qh >> (i + 12)) & 0x10);
        o[i] = x0 * d + m;
        o[i + 16] = x1 * d + m;
    }
}

inline void dq_q8_0(row_t w, size_t r, uint stride, uint j, wt* o) {
    row_t row = w + r * stride;
    row_t b = row + 34 * j;
    float d = f16_at(b);
    global const char* q = (global const char*)(b + 2);
    for (int i = 0; i < 32; i++) o[i] = q[i] * d;
}

// Q4_K: 144-byte super-blocks (d, dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles).
inline void dq_q4_k(row_t w, size_t r, uint stride, uint j, wt* o) {
    row_t row = w + r * stride;
    row_t b = row + 144 * (j / 8);
    uint s = j % 8;
    float d = f16_at(b), dmin = f16_at(b + 2);
    row_t sc = b + 4;
    uint scv, mv;
    if (s < 4) {
        scv = sc[s] & 63;
        mv = sc[s + 4] & 63;
    } else {
        scv = (sc[s + 4] & 15) | ((sc[s - 4] >> 6) << 4);
        mv = (sc[s + 4] >> 4) | ((sc[s] >> 6) << 4);
    }
    row_t q = b + 16 + 32 * (s / 2);
    float dd = d * scv, mm = dmin * mv;
    uint shift = (s & 1) ? 4 : 0;
    for (int l = 0; l < 32; l++) o[l] = dd * ((q[l] >> shift) & 15) - mm;
}

// Q6_K: 210-byte super-blocks (128 bytes low nibbles, 64 bytes high bits, 16 int8 scales, d).
inline void dq_q6_k(row_t w, size_t r, uint stride, uint j, wt* o) {
    row_t row = w + r * stride;
    row_t b = row + 210 * (j / 8);
    uint s = j % 8, n = s / 4, k = s % 4;
    row_t ql = b + 64 * n + ((k & 1) ? 32 : 0);
    row_t qh = b + 128 + 32 * n;
    global const char* sc = (global const char*)(b + 192) + 8 * n + 2 * k;
    float d = f16_at(b + 208);
    uint sl = (k >= 2) ? 4 : 0, sh = 2 * k;
    for (int l = 0; l < 32; l++) {
        int q = ((ql[l] >> sl) & 15) | (((qh[l] >> sh) & 3) << 4);
        o[l] = d * sc[l / 16] * (q - 32);
    }
}

// The CPU kernels' own layouts (engine/src/backend/cpu/packed.rs and kpacked.rs), read in
// place where the GPU shares the host's memory, so a weight is in memory once: rows in tiles
// of 16, each tile a run of records (one per 32-column block, or per 256-column super-block
// for the K-quants) holding that block of all 16 rows. `stride` is a tile's bytes; row r is
// lane r % 16 of tile r / 16. Values equal the GGUF dequantization's.

// Q4_0 / Q4_1 / Q8_0 records: 16 f16 d (Q4_1: then 16 f16 m), then chunks of 64 bytes, byte
// 4·lane + i of chunk c holding weights 4c + i (Q4: low nibble; high nibble 16 + 4c + i).
inline row_t tile_rec(row_t w, size_t r, uint stride, uint rec, uint j) {
    return w + (r / 16) * stride + (size_t)j * rec;
}

inline void dq_pq4_0(row_t w, size_t r, uint stride, uint j, wt* o) {
    row_t b = tile_rec(w, r, stride, 288, j);
    uint lane = r % 16;
    float d = f16_at(b + 2 * lane);
    for (int c = 0; c < 4; c++)
        for (int i = 0; i < 4; i++) {
            uchar q = b[32 + 64 * c + 4 * lane + i];
            o[4 * c + i] = ((int)(q & 15) - 8) * d;
            o[16 + 4 * c + i] = ((int)(q >> 4) - 8) * d;
        }
}

inline void dq_pq4_1(row_t w, size_t r, uint stride, uint j, wt* o) {
    row_t b = tile_rec(w, r, stride, 320, j);
    uint lane = r % 16;
    float d = f16_at(b + 2 * lane), m = f16_at(b + 32 + 2 * lane);
    for (int c = 0; c < 4; c++)
        for (int i = 0; i < 4; i++) {
            uchar q = b[64 + 64 * c + 4 * lane + i];
            o[4 * c + i] = (q & 15) * d + m;
            o[16 + 4 * c + i] = (q >> 4) * d + m;
        }
}

// Q8_0 bytes are stored plus 128 (unsigned).
inline void dq_pq8_0(row_t w, size_t r, uint stride, uint j, wt* o) {
    row_t b = tile_rec(w, r, stride, 544, j);
    uint lane = r % 16;
    float d = f16_at(b + 2 * lane);
    for (int c = 0; c < 8; c++)
        for (int i = 0; i < 4; i++) o[4 * c + i] = ((int)b[32 + 64 * c + 4 * lane + i] - 128) * d;
}

// K-quant records (kpacked.rs): 16 f16 d, 16 f16 dmin (types with minimums), scales
// group-major (byte 16g + lane), Q4_K/Q5_K minimums in group pairs (byte 32(g/2) + 2·lane +
// g%2), then bit planes: chunk k (columns 4k..4k+3) of BB base bits at byte
// 64(k / (8/BB)) + 4·lane + i, shifted BB·(k % (8/BB)); HB high bits likewise. KIND: 2..6 for
// Q2_K..Q6_K. Values are (d·scale)·u − (dmin·min), or for Q3_K/Q6_K (d·scale)·u − o·(d·scale):
// ggml's products in another order (an f32 rounding apart, within the kernels' tolerance).
#define DQ_PK(T, KIND, BB, HB, GROUP, SC, MINS, BASE, HIGH, REC)                                    \
inline void dq_##T(row_t w, size_t r, uint stride, uint j, wt* o) {                               \
    row_t b = tile_rec(w, r, stride, REC, j / 8);                                                  \
    uint lane = r % 16;                                                                              \
    float d = f16_at(b + 2 * lane);                                                                  \
    float dmin = (KIND == 2 || KIND == 4 || KIND == 5) ? f16_at(b + 32 + 2 * lane) : 0.0f;         \
    /* One scale group (16 or 32 columns) at a time, its values a·u − m; four columns (one   \
       byte quad of each bit plane) at a time. */                                                    \
    for (uint e0 = 32 * (j % 8), l0 = 0; l0 < 32; e0 += GROUP, l0 += GROUP) {                      \
        uint g = e0 / GROUP;                                                                         \
        uchar sc = b[SC + 16 * g + lane];                                                            \
        float a, m;                                                                                  \
        if (KIND == 6) { a = d * (char)sc; m = 32.0f * a; }                                         \
        else if (KIND == 3) { a = d * (char)sc; m = 4.0f * a; }                                     \
        else if (KIND == 2) { a = d * (sc & 15); m = dmin * (sc >> 4); }                            \
        else { a = d * sc; m = dmin * b[MINS + 32 * (g / 2) + 2 * lane + g % 2]; }                 \
        for (uint k = e0 / 4; k < (e0 + GROUP) / 4; k++) {                                          \
            uchar4 q = vload4(0, b + BASE + 64 * (k / (8 / BB)) + 4 * lane);                        \
            uint4 u = (convert_uint4(q) >> (BB * (k % (8 / BB)))) & ((1u << BB) - 1);              \
            if (HB) {                                                                                \
                uint per = 8 / (HB ? HB : 1);                                                        \
                uchar4 hq = vload4(0, b + HIGH + 64 * (k / per) + 4 * lane);                        \
                u |= ((convert_uint4(hq) >> (HB * (k % per))) & ((1u << HB) - 1)) << BB;           \
            }                                                                                        \
            wt* ok = o + 4 * k - e0 + l0;                                                            \
            ok[0] = a * u.x - m;                                                                     \
            ok[1] = a * u.y - m;                                                                     \
            ok[2] = a * u.z - m;                                                                     \
            ok[3] = a * u.w - m;                                                                     \
        }                                                                                            \
    }                                                                                                \
}
// Offsets from kpacked.rs's KKind (scales_off, mins_off, base_off, high_off, record_bytes).
DQ_PK(pq2_k, 2, 2, 0, 16, 64, 320, 320, 1344, 1344)
DQ_PK(pq3_k, 3, 2, 1, 16, 32, 288, 288, 1312, 1824)
DQ_PK(pq4_k, 4, 4, 0, 32, 64, 192, 320, 2368, 2368)
DQ_PK(pq5_k, 5, 4, 1, 32, 64, 192, 320, 2368, 2880)
DQ_PK(pq6_k, 6, 4, 2, 16, 32, 288, 288, 2336, 3360)

// s += Σ_i wv[i] · xr[i] over a sub-block of 32: f32 fused multiply-adds, or (fp16) half
// dot products of four, each added to s in f32 — activations clamped to half's range first
// (converted, one past ±65,504 would be ±inf, and inf times a zero weight NaN).
#ifdef LLMD_FP16
#define DOT32(wv, xr, s)                                                                            \
    for (int i = 0; i < 32; i += 4)                                                                \
        s += (float)dot(vload4(0, wv + i), convert_half4(clamp(vload4(0, xr + i), -65504.0f, 65504.0f)));
#else
#define DOT32(wv, xr, s) for (int i = 0; i < 32; i++) s = fma(wv[i], xr[i], s);
#endif

// acc[k] = Σ over sub-blocks j0, j0 + dj, … of row · x[t0 + k], for k < nt: one work-item's (or
// lane's) share of a weight row's product with up to TILE token rows, each sub-block
// dequantized once for all of them. Every matmul variant below is built on it.
#define PARTIAL(T)                                                                                  \
inline void partial_##T(row_t w, size_t r, uint stride, uint nb, uint j0, uint dj,                \
                        global const float* x, uint cols, uint t0, uint nt, float* acc) {           \
    for (int k = 0; k < TILE; k++) acc[k] = 0.0f;                                                   \
    for (uint j = j0; j < nb; j += dj) {                                                            \
        wt wv[32];                                                                                   \
        dq_##T(w, r, stride, j, wv);                                                                 \
        for (uint k = 0; k < nt; k++) {                                                             \
            global const float* xr = x + (size_t)(t0 + k) * cols + 32 * j;                          \
            float s = 0.0f;                                                                          \
            DOT32(wv, xr, s);                                                                        \
            acc[k] += s;                                                                             \
        }                                                                                            \
    }                                                                                                \
}

// y[t, r] = (accumulate ? y[t, r] : 0) + bias[r] + Σ_k w[r, k] · x[t, k], for n token rows.
// The weight starts `woff` bytes into its buffer (a buffer over the host's memory starts on the
// device's alignment, the weight where the file put it).
// One work-group per weight row; its work-items split the row's 32-value sub-blocks.
#define MATMUL(T)                                                                                   \
PARTIAL(T)                                                                                          \
kernel void matmul_##T(global const uchar* w0, uint woff, uint stride, uint cols,                 \
                       global const float* x,                                                       \
                       global float* y, uint n, uint rows, uint accumulate,                          \
                       global const float* bias, uint has_bias) {                                   \
    uint r = get_group_id(0), lid = get_local_id(0);                                               \
    row_t w = w0 + woff;                                                                             \
    local float red[TILE * LS];                                                                      \
    uint nb = cols / 32;                                                                             \
    for (uint t0 = 0; t0 < n; t0 += TILE) {                                                         \
        uint nt = min((uint)TILE, n - t0);                                                          \
        float acc[TILE];                                                                             \
        partial_##T(w, r, stride, nb, lid, LS, x, cols, t0, nt, acc);                                         \
        for (int k = 0; k < TILE; k++) red[k * LS + lid] = acc[k];                                 \
        barrier(CLK_LOCAL_MEM_FENCE);                                                               \
        for (uint h = LS / 2; h > 0; h >>= 1) {                                                     \
            if (lid < h)                                                                             \
                for (int k = 0; k < TILE; k++) red[k * LS + lid] += red[k * LS + lid + h];          \
            barrier(CLK_LOCAL_MEM_FENCE);                                                           \
        }                                                                                            \
        if (lid < nt) {                                                                              \
            float v = red[lid * LS] + (has_bias ? bias[r] : 0.0f);                                  \
            size_t o = (size_t)(t0 + lid) * rows + r;                                               \
            y[o] = accumulate ? y[o] + v : v;                                                        \
        }                                                                                            \
        barrier(CLK_LOCAL_MEM_FENCE);                                                               \
    }                                                                                                \
}                                                                                                    \
/* The same product with one work-item per weight row and no local memory or barriers: the   \
   variant for CPU devices (PoCL), where a work-group's barriers cost more than they share. */  \
kernel void matmul_rows_##T(global const uchar* w0, uint woff, uint stride, uint cols,            \
                            global const float* x,                                                  \
                            global float* y, uint n, uint rows, uint accumulate,                    \
                            global const float* bias, uint has_bias) {                             \
    uint r = get_global_id(0);                                                                       \
    row_t w = w0 + woff;                                                                             \
    if (r >= rows) return;                                                                           \
    uint nb = cols / 32;                                                                             \
    for (uint t0 = 0; t0 < n; t0 += TILE) {                                                         \
        uint nt = min((uint)TILE, n - t0);                                                          \
        float acc[TILE];                                                                             \
        partial_##T(w, r, stride, nb, 0, 1, x, cols, t0, nt, acc);                                            \
        for (uint k = 0; k < nt; k++) {                                                             \
            float v = acc[k] + (has_bias ? bias[r] : 0.0f);                                         \
            size_t o = (size_t)(t0 + k) * rows + r;                                                 \
            y[o] = accumulate ? y[o] + v : v;                                                        \
        }                                                                                            \
    }                                                                                                \
}                                                                                                    \
/* x[t, :] = row tokens[t] of w, for t in 0..n (global size: cols / 32 × n). */                     \
kernel void get_rows_##T(global const uchar* w0, uint woff, uint stride, uint cols, uint n_rows,  \
                         global const uint* tokens, global float* x) {                              \
    uint j = get_global_id(0), t = get_global_id(1);                                               \
    row_t w = w0 + woff;                                                                             \
    uint tok = tokens[t];                                                                            \
    if (tok >= n_rows) return;                                                                       \
    wt v[32];                                                                                        \
    dq_##T(w, tok, stride, j, v);                                                      \
    global float* o = x + (size_t)t * cols + 32 * j;                                                \
    for (int i = 0; i < 32; i++) o[i] = v[i];                                                       \
}

MATMUL(f32)
MATMUL(f16)
MATMUL(q4_0)
MATMUL(q4_1)
MATMUL(q5_0)
MATMUL(q5_1)
MATMUL(q8_0)
MATMUL(q4_k)
MATMUL(q6_k)
MATMUL(pq4_0)
MATMUL(pq4_1)
MATMUL(pq8_0)
MATMUL(pq2_k)
MATMUL(pq3_k)
MATMUL(pq4_k)
MATMUL(pq5_k)
MATMUL(pq6_k)

#ifdef LLMD_SUBGROUPS
// (After the instantiations above: it uses their partial_<type>.)
// The subgroup variant: one subgroup per work-group, one weight row per subgroup; its lanes
// split the row's sub-blocks and sum with sub_group_reduce_add (no local memory, no barrier).
// Built with -DLLMD_SUBGROUPS -DSG=<lanes> only for a device with a way to fix the subgroup's
// size to the work-group's: Intel's cl_intel_subgroups, or Qualcomm's
// cl_qcom_reqd_sub_group_size ("half": 64 lanes on Adreno).
#if defined(cl_intel_subgroups)
#pragma OPENCL EXTENSION cl_intel_subgroups : enable
#define SG_ATTR __attribute__((intel_reqd_sub_group_size(SG)))
#elif defined(cl_qcom_reqd_sub_group_size)
#pragma OPENCL EXTENSION cl_qcom_reqd_sub_group_size : enable
#pragma OPENCL EXTENSION cl_khr_subgroups : enable
#define SG_ATTR __attribute__((qcom_reqd_sub_group_size("half")))
#else
#error "LLMD_SUBGROUPS needs cl_intel_subgroups or cl_qcom_reqd_sub_group_size"
#endif
#define MATMUL_SG(T)                                                                                \
kernel SG_ATTR void matmul_sg_##T(global const uchar* w0, uint woff, uint stride, uint cols,      \
                                  global const float* x, global float* y, uint n, uint rows,       \
                                  uint accumulate, global const float* bias, uint has_bias) {      \
    uint r = get_group_id(0), lane = get_sub_group_local_id(), lanes = get_sub_group_size();      \
    row_t w = w0 + woff;                                                                             \
    uint nb = cols / 32;                                                                             \
    for (uint t0 = 0; t0 < n; t0 += TILE) {                                                         \
        uint nt = min((uint)TILE, n - t0);                                                          \
        float acc[TILE];                                                                             \
        partial_##T(w, r, stride, nb, lane, lanes, x, cols, t0, nt, acc);                                     \
        for (uint k = 0; k < nt; k++) {                                                             \
            float v = sub_group_reduce_add(acc[k]);                                                  \
            if (lane == 0) {                                                                         \
                v += has_bias ? bias[r] : 0.0f;                                                      \
                size_t o = (size_t)(t0 + k) * rows + r;                                             \
                y[o] = accumulate ? y[o] + v : v;                                                    \
            }                                                                                        \
        }                                                                                            \
    }                                                                                                \
}
MATMUL_SG(f32)
MATMUL_SG(f16)
MATMUL_SG(q4_0)
MATMUL_SG(q4_1)
MATMUL_SG(q5_0)
MATMUL_SG(q5_1)
MATMUL_SG(q8_0)
MATMUL_SG(q4_k)
MATMUL_SG(q6_k)
MATMUL_SG(pq4_0)
MATMUL_SG(pq4_1)
MATMUL_SG(pq8_0)
MATMUL_SG(pq2_k)
MATMUL_SG(pq3_k)
MATMUL_SG(pq4_k)
MATMUL_SG(pq5_k)
MATMUL_SG(pq6_k)
#endif

// out[i, :] = x[src, :] / sqrt(mean(x[src, :]²) + eps) · w, src = map ? map[i] : i.
// One work-group per output row.
kernel void rms_norm(global const float* x, global float* out, global const float* w, uint d, float eps,
                     global const uint* map, uint use_map) {
    uint i = get_group_id(0), lid = get_local_id(0);
    uint src = use_map ? map[i] : i;
    global const float* xr = x + (size_t)src * d;
    local float red[LS];
    float s = 0.0f;
    for (uint k = lid; k < d; k += LS) s = fma(xr[k], xr[k], s);
    red[lid] = s;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (uint h = LS / 2; h > 0; h >>= 1) {
        if (lid < h) red[lid] += red[lid + h];
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    float scale = 1.0f / sqrt(red[0] / (float)d + eps);
    global float* o = out + (size_t)i * d;
    for (uint k = lid; k < d; k += LS) o[k] = (xr[k] * scale) * w[k];
}

// Rotary embedding in place over n rows of n_heads heads (global size: rope_dims / 2 × n_heads × n).
// The angle is built by repeated multiplication, as ggml (and the CPU backend) do.
kernel void rope(global float* x, global const uint* pos, uint n_heads, uint head_dim, uint rope_dims,
                 float theta_scale, float freq_scale, uint neox, global const float* ff, uint has_ff) {
    uint i = get_global_id(0), h = get_global_id(1), t = get_global_id(2);
    // volatile: the product is one multiplication after another, as on the host. A compiler
    // that reassociates floats (Intel's 2026 CPU runtime does, by default) would otherwise turn
    // the loop into a vectorised product reduction and move the angle by an ulp (6e-5 at 8,000).
    volatile float th = (float)pos[t];
    for (uint k = 0; k < i; k++) th = th * theta_scale;
    float a = freq_scale * (th / (has_ff ? ff[i] : 1.0f));
    float c = cos(a), s = sin(a);
    global float* hp = x + ((size_t)t * n_heads + h) * head_dim;
    uint i0 = neox ? i : 2 * i, i1 = neox ? i + rope_dims / 2 : 2 * i + 1;
    float x0 = hp[i0], x1 = hp[i1];
    hp[i0] = x0 * c - x1 * s;
    hp[i1] = x0 * s + x1 * c;
}

// A sequence's new keys and values (rows offset.. of k and v) into its f16 cache at positions
// start.. (global size: kv_dim × len). The cache: keys [ctx][kv_dim], then values.
kernel void kv_store(global const float* k, global const float* v, global half* cache, uint kv_dim,
                     uint v_base, uint start, uint offset) {
    uint c = get_global_id(0), t = get_global_id(1);
    size_t src = (size_t)(offset + t) * kv_dim + c, dst = (size_t)(start + t) * kv_dim + c;
    vstore_half_rte(k[src], dst, cache);
    vstore_half_rte(v[src], v_base + dst, cache);
}

// Causal attention of one sequence's `len` new queries (rows offset..) over its cache, which
// already holds their keys and values: one work-group per (head, token). Scores go through
// `scratch` ([len][n_heads][ctx_used]); grouped-query heads share a KV head.
kernel void attention(global const float* q, global const half* cache, global float* out, global float* scratch,
                      uint n_heads, uint n_kv_heads, uint head_dim, uint v_base, uint start, uint offset,
                      uint ctx_used, float scale) {
    uint h = get_group_id(0), t = get_group_id(1), lid = get_local_id(0);
    uint total = start + t + 1;
    uint kv_dim = n_kv_heads * head_dim;
    uint kvh = h / (n_heads / n_kv_heads);
    global const float* qr = q + ((size_t)(offset + t) * n_heads + h) * head_dim;
    global float* s = scratch + ((size_t)t * n_heads + h) * ctx_used;
    local float red[LS];
    float m = -INFINITY;
    for (uint p = lid; p < total; p += LS) {
        global const half* kr = cache + (size_t)p * kv_dim + kvh * head_dim;
        float dot = 0.0f;
        for (uint d = 0; d < head_dim; d++) dot = fma(qr[d], vload_half(d, kr), dot);
        dot *= scale;
        s[p] = dot;
        m = fmax(m, dot);
    }
    red[lid] = m;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (uint hh = LS / 2; hh > 0; hh >>= 1) {
        if (lid < hh) red[lid] = fmax(red[lid], red[lid + hh]);
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    float mx = red[0];
    barrier(CLK_LOCAL_MEM_FENCE);
    float l = 0.0f;
    for (uint p = lid; p < total; p += LS) {
        float e = exp(s[p] - mx);
        s[p] = e;
        l += e;
    }
    red[lid] = l;
    barrier(CLK_LOCAL_MEM_FENCE | CLK_GLOBAL_MEM_FENCE);
    for (uint hh = LS / 2; hh > 0; hh >>= 1) {
        if (lid < hh) red[lid] += red[lid + hh];
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    float inv = 1.0f / red[0];
    global float* o = out + ((size_t)(offset + t) * n_heads + h) * head_dim;
    for (uint d = lid; d < head_dim; d += LS) {
        float acc = 0.0f;
        for (uint p = 0; p < total; p++)
            acc = fma(s[p], vload_half((size_t)v_base + (size_t)p * kv_dim + kvh * head_dim + d, cache), acc);
        o[d] = acc * inv;
    }
}

// g = silu(g) · u, element-wise.
kernel void swiglu(global float* g, global const float* u) {
    size_t i = get_global_id(0);
    float a = g[i];
    g[i] = a / (1.0f + exp(-a)) * u[i];
}
