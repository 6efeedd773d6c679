//! The KV cache of one sequence: keys and values per layer, grown as tokens arrive, stored as f16
//! (the default, as llama.cpp) or as int8 with one f32 scale per position and KV head (half the
//! memory, for long contexts).

use half::f16;

/// New positions per sequence whose room [`KvCache::prepare_append`] prefetches (a decode
/// step appends one).
const PREFETCH_ROWS: usize = 4;

/// How keys and values are stored.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KvType {
    #[default]
    F16,
    /// Symmetric int8 per (position, KV head): scale = amax / 127, rounding to nearest even.
    Q8,
}

impl std::str::FromStr for KvType {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "f16" => Ok(Self::F16),
            "q8" | "int8" => Ok(Self::Q8),
            other => Err(format!("unknown KV cache type {other:?} (f16 or q8)")),
        }
    }
}

/// One layer's keys and values as attention reads them.
#[derive(Clone, Copy)]
pub enum KvLayer<'a> {
    /// One vector per KV head, `[position][head_dim]` inside it: a head's keys and values
    /// are contiguous, so attention streams them (a position-major row of all heads made
    /// attention ~6x slower once the caches left the CPU caches: measured by `attnbench`).
    F16 { k: &'a [Vec<f16>], v: &'a [Vec<f16>] },
    /// `ks`/`vs`: one scale per (position, KV head).
    Q8 { k: &'a [i8], ks: &'a [f32], v: &'a [i8], vs: &'a [f32] },
}

impl KvLayer<'_> {
    /// Positions whose keys and values are present (for a row of `kv_dim`).
    pub fn positions(&self, kv_dim: usize) -> usize {
        match self {
            Self::F16 { k, v } => {
                let heads = k.len();
                if heads == 0 || v.len() != heads || !kv_dim.is_multiple_of(heads) {
                    return 0;
                }
                let hd = (kv_dim / heads).max(1);
                k.iter().chain(v.iter()).map(|x| x.len() / hd).min().unwrap_or(0)
            }
            Self::Q8 { k, v, .. } => k.len().min(v.len()) / kv_dim.max(1),
        }
    }
}

/// One layer's cache as one sequence's attention takes it: ready to read, or f16 heads still
/// to receive this step's keys and values.
pub enum KvInput<'a> {
    /// The cache already holds every position attended to.
    Ready(KvLayer<'a>),
    /// One vector per KV head holding (at least) the first `start` positions of the item's
    /// [`AttentionShape`](crate::backend::AttentionShape), and the item's new keys and values
    /// (`n_tokens` rows of `kv_dim`). The backend appends each head's share with
    /// [`append_head`] before attending over that head, so a parallel step can do each head's
    /// append in the task that then reads it.
    AppendF16 { k: &'a mut [Vec<f16>], v: &'a mut [Vec<f16>], k_new: &'a [f32], v_new: &'a [f32] },
}

/// Keeps the first `keep` positions of one head's vector `x` (`hd` values each) and appends
/// head `head`'s values of each new row (`kv_dim` long) as f16, rounded to nearest even
/// (`to_f16`, as `f16::from_f32`).
pub fn append_head(
    x: &mut Vec<f16>,
    keep: usize,
    head: usize,
    hd: usize,
    new: &[f32],
    kv_dim: usize,
    to_f16: fn(&[f32], &mut [f16]),
) {
    if hd == 0 || kv_dim < (head + 1) * hd {
        return;
    }
    x.truncate(keep * hd);
    x.reserve(new.len() / kv_dim.max(1) * hd);
    for row in new.chunks_exact(kv_dim) {
        let at = x.len();
        x.resize(at + hd, f16::ZERO);
        (to_f16)(&row[head * hd..(head + 1) * hd], &mut x[at..]);
    }
}

enum Store {
    /// Indexed `[layer * kv_heads + head]`.
    F16 {
        k: Vec<Vec<f16>>,
        v: Vec<Vec<f16>>,
    },
    Q8 {
        k: Vec<Vec<i8>>,
        ks: Vec<Vec<f32>>,
        v: Vec<Vec<i8>>,
        vs: Vec<Vec<f32>>,
    },
}

pub struct KvCache {
    kv_dim: usize,
    head_dim: usize,
    len: usize,
    store: Store,
    /// Per layer, the cache a device holds for this sequence when that layer's attention runs
    /// there (memory of the device's; it writes positions `start..` at each pass, so a
    /// truncation here needs nothing of it). Empty while every layer is on the host. A layer
    /// is held in one place: on its device (the host's vectors of it then empty) or here.
    device: Vec<Option<DeviceKv>>,
}

/// One layer of a sequence's cache on a device: the device and its [`BufferUsage::Kv`] buffer,
/// in the contract's layout ([`llmd_device::SeqBinding::kv`]: f16 keys `[ctx][kv_dim]`, then
/// the values).
///
/// [`BufferUsage::Kv`]: llmd_device::BufferUsage::Kv
#[derive(Clone)]
pub struct DeviceKv {
    pub dev: std::sync::Arc<dyn llmd_device::Device>,
    pub buf: llmd_device::Buffer,
}

fn kv_err(detail: String) -> crate::error::BackendError {
    crate::error::BackendError::Device(detail)
}

/// Quantizes one head's values to int8, returning the scale.
fn quantize_head(x: &[f32], out: &mut Vec<i8>) -> f32 {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
    out.extend(x.iter().map(|&v| (v * id).round_ties_even() as i8));
    d
}

/// Keeps the first `keep` values and `heads_keep` scales of an int8 layer and appends `x`
/// quantized per head of `hd`.
fn append_q8(q: &mut Vec<i8>, s: &mut Vec<f32>, keep: usize, heads_keep: usize, hd: usize, x: &[f32]) {
    q.truncate(keep);
    s.truncate(heads_keep);
    q.reserve(x.len());
    s.reserve(x.len() / hd);
    for head in x.chunks_exact(hd) {
        s.push(quantize_head(head, q));
    }
}

impl KvCache {
    pub fn new(n_layers: usize, kv_dim: usize) -> Self {
        Self::with_type(n_layers, kv_dim, kv_dim, KvType::F16)
    }

    /// A cache of `ty` for heads of `head_dim` (which divides `kv_dim`).
    pub fn with_type(n_layers: usize, kv_dim: usize, head_dim: usize, ty: KvType) -> Self {
        let store = match ty {
            KvType::F16 => {
                let n = n_layers * (kv_dim / head_dim.max(1)).max(1);
                Store::F16 { k: vec![Vec::new(); n], v: vec![Vec::new(); n] }
            }
            KvType::Q8 => Store::Q8 {
                k: vec![Vec::new(); n_layers],
                ks: vec![Vec::new(); n_layers],
                v: vec![Vec::new(); n_layers],
                vs: vec![Vec::new(); n_layers],
            },
        };
        Self { kv_dim, head_dim: head_dim.max(1), len: 0, store, device: Vec::new() }
    }

    fn kv_heads(&self) -> usize {
        (self.kv_dim / self.head_dim).max(1)
    }

    pub fn kv_type(&self) -> KvType {
        match self.store {
            Store::F16 { .. } => KvType::F16,
            Store::Q8 { .. } => KvType::Q8,
        }
    }

    /// Positions held.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The buffer a device holds for layer `layer` of this sequence, if any.
    pub(crate) fn device_layer(&self, layer: usize) -> Option<&llmd_device::Buffer> {
        self.device.get(layer).and_then(Option::as_ref).map(|d| &d.buf)
    }

    /// The device holding layer `layer`, if one does.
    pub(crate) fn device_of_layer(&self, layer: usize) -> Option<&std::sync::Arc<dyn llmd_device::Device>> {
        self.device.get(layer).and_then(Option::as_ref).map(|d| &d.dev)
    }

    /// Sets (or, with `None`, drops) the device buffer of layer `layer`.
    pub(crate) fn set_device_layer(&mut self, layer: usize, kv: Option<DeviceKv>) {
        if self.device.len() <= layer {
            self.device.resize(layer + 1, None);
        }
        self.device[layer] = kv;
    }

    /// Hands layer `layer`'s positions to `dev`: a KV buffer of `ctx` positions there, the
    /// host's positions written into it (two writes), and the host's copy freed — the cache a
    /// CPU prefill made, handed once to the device that decodes. f16 caches only.
    pub(crate) fn move_to_device(
        &mut self,
        layer: usize,
        dev: &std::sync::Arc<dyn llmd_device::Device>,
        ctx: usize,
    ) -> Result<(), crate::error::BackendError> {
        if self.device_layer(layer).is_some() {
            self.move_home(layer)?;
        }
        let (heads, hd, kvd, len) = (self.kv_heads(), self.head_dim, self.kv_dim, self.len);
        let Store::F16 { k, v } = &mut self.store else {
            return Err(kv_err("only an f16 KV cache moves to a device".into()));
        };
        if len > ctx {
            return Err(kv_err(format!("{len} positions do not fit a device cache of {ctx}")));
        }
        let name = dev.desc().name.clone();
        let buf = dev.alloc(llmd_device::BufferUsage::Kv, 2 * ctx * kvd * 2).map_err(|e| kv_err(e.to_string()))?;
        // Both regions written before either host copy is let go: a refused write leaves the
        // host's cache whole.
        for (region, store) in [(0, &*k), (1, &*v)] {
            let heads_of = &store[layer * heads..(layer + 1) * heads];
            if heads_of.iter().any(|x| x.len() < len * hd) {
                return Err(kv_err(format!("layer {layer} holds fewer than {len} positions on the host")));
            }
            let mut bytes = Vec::with_capacity(len * kvd * 2);
            for p in 0..len {
                for x in heads_of {
                    bytes.extend(x[p * hd..(p + 1) * hd].iter().flat_map(|h| h.to_le_bytes()));
                }
            }
            let ev = dev.write(&buf, region * ctx * kvd * 2, &bytes, &[]).map_err(|e| kv_err(e.to_string()))?;
            ev.wait().map_err(|e| kv_err(format!("{name}: {e}")))?;
        }
        for x in
            k[layer * heads..(layer + 1) * heads].iter_mut().chain(v[layer * heads..(layer + 1) * heads].iter_mut())
        {
            x.clear();
            x.shrink_to_fit();
        }
        self.set_device_layer(layer, Some(DeviceKv { dev: dev.clone(), buf }));
        Ok(())
    }

    /// Brings layer `layer`'s positions back from its device into host memory (two reads) and
    /// lets the device's buffer go.
    pub(crate) fn move_home(&mut self, layer: usize) -> Result<(), crate::error::BackendError> {
        let Some(d) = self.device.get(layer).cloned().flatten() else { return Ok(()) };
        let (heads, hd, kvd, len) = (self.kv_heads(), self.head_dim, self.kv_dim, self.len);
        let Store::F16 { k, v } = &mut self.store else {
            return Err(kv_err("only an f16 KV cache moves from a device".into()));
        };
        let ctx = d.buf.len / (4 * kvd.max(1));
        if len > ctx {
            return Err(kv_err(format!("{len} positions in a device cache of {ctx}")));
        }
        for (region, store) in [(0, &mut *k), (1, &mut *v)] {
            let mut bytes = vec![0u8; len * kvd * 2];
            d.dev.read(&d.buf, region * ctx * kvd * 2, &mut bytes, &[]).map_err(|e| kv_err(e.to_string()))?;
            for (h, x) in store[layer * heads..(layer + 1) * heads].iter_mut().enumerate() {
                x.clear();
                x.reserve(len * hd);
                for p in 0..len {
                    let at = (p * kvd + h * hd) * 2;
                    x.extend(bytes[at..at + hd * 2].chunks_exact(2).map(|c| f16::from_le_bytes([c[0], c[1]])));
                }
            }
        }
        self.set_device_layer(layer, None);
        Ok(())
    }

    /// Brings every layer held on a device back into host memory.
    pub fn move_all_home(&mut self) -> Result<(), crate::error::BackendError> {
        for layer in 0..self.device.len() {
            self.move_home(layer)?;
        }
        self.device.clear();
        Ok(())
    }

    /// Bytes allocated for keys and values (on the host and on devices).
    pub fn size_bytes(&self) -> usize {
        let on_devices: usize = self.device.iter().flatten().map(|d| d.buf.len).sum();
        on_devices + self.host_bytes()
    }

    fn host_bytes(&self) -> usize {
        match &self.store {
            Store::F16 { k, v } => k.iter().chain(v).map(|x| x.capacity() * 2).sum(),
            Store::Q8 { k, ks, v, vs } => {
                k.iter().chain(v).map(|x| x.capacity()).sum::<usize>()
                    + ks.iter().chain(vs).map(|x| x.capacity() * 4).sum::<usize>()
            }
        }
    }

    /// Makes room in layer `layer` for `rows` new positions and prefetches the first of them
    /// (at most [`PREFETCH_ROWS`]), so that the append that follows ([`Self::attention_input`],
    /// [`append_head`]) does not wait on memory: the rows written last were evicted long since,
    /// and unfetched, those cache misses are most of a decode step's append time. A prompt chunk's many
    /// rows are written in order, which the hardware prefetcher follows; prefetching them all
    /// would only flush L1.
    pub(crate) fn prepare_append(&mut self, layer: usize, rows: usize) {
        use crate::backend::cpu::attn_kernels::prefetch;
        let pf = rows.min(PREFETCH_ROWS);
        let keep = self.len * self.kv_dim;
        let heads_keep = keep / self.head_dim;
        match &mut self.store {
            Store::F16 { k, v } => {
                let (heads, hd) = (self.kv_dim / self.head_dim, self.head_dim);
                for store in [k, v] {
                    for x in store[layer * heads..(layer + 1) * heads].iter_mut() {
                        x.truncate(self.len * hd);
                        x.reserve(rows * hd);
                        prefetch(&x.spare_capacity_mut()[..pf * hd]);
                    }
                }
            }
            Store::Q8 { k, ks, v, vs } => {
                for (q, s) in [(&mut k[layer], &mut ks[layer]), (&mut v[layer], &mut vs[layer])] {
                    q.truncate(keep);
                    s.truncate(heads_keep);
                    q.reserve(rows * self.kv_dim);
                    s.reserve(rows * self.kv_dim / self.head_dim);
                    prefetch(&q.spare_capacity_mut()[..pf * self.kv_dim]);
                    prefetch(&s.spare_capacity_mut()[..pf * self.kv_dim / self.head_dim]);
                }
            }
        }
    }

    /// Layer `layer` for this step's attention, whose new keys and values are `k_new` and
    /// `v_new` (rows of `kv_dim`; committed by [`Self::advance`]): an f16 cache's heads are
    /// handed over for the backend to append to ([`KvInput::AppendF16`]); an int8 cache
    /// appends here.
    pub(crate) fn attention_input<'a>(&'a mut self, layer: usize, k_new: &'a [f32], v_new: &'a [f32]) -> KvInput<'a> {
        let heads = self.kv_heads();
        let (keep, hd) = (self.len * self.kv_dim, self.head_dim);
        match &mut self.store {
            Store::F16 { k, v } => KvInput::AppendF16 {
                k: &mut k[layer * heads..(layer + 1) * heads],
                v: &mut v[layer * heads..(layer + 1) * heads],
                k_new,
                v_new,
            },
            Store::Q8 { k, ks, v, vs } => {
                append_q8(&mut k[layer], &mut ks[layer], keep, keep / hd, hd, k_new);
                append_q8(&mut v[layer], &mut vs[layer], keep, keep / hd, hd, v_new);
                KvInput::Ready(KvLayer::Q8 { k: &k[layer], ks: &ks[layer], v: &v[layer], vs: &vs[layer] })
            }
        }
    }

    /// Sets how many positions the cache holds: the out-of-order prefill (the executor's
    /// `prefill_placed`) sets
    /// it to a chunk's first position before that chunk's attention in a layer, whose earlier
    /// chunks (and only they) have appended their keys and values there.
    pub(crate) fn set_len(&mut self, len: usize) {
        self.len = len;
    }

    /// Counts `n` more positions as held (after a pass appended them to every layer; a device
    /// keeping one layer per cache, after its own append).
    pub(crate) fn advance(&mut self, n: usize) {
        self.len += n;
    }

    /// Forgets every position after the first `len` (e.g. to rewind a cancelled turn) and
    /// returns the memory they held.
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
        let keep = self.len * self.kv_dim;
        let heads = keep / self.head_dim;
        match &mut self.store {
            Store::F16 { k, v } => {
                for x in k.iter_mut().chain(v.iter_mut()) {
                    x.truncate(self.len * self.head_dim);
                    x.shrink_to_fit();
                }
            }
            Store::Q8 { k, ks, v, vs } => {
                for x in k.iter_mut().chain(v.iter_mut()) {
                    x.truncate(keep);
                    x.shrink_to_fit();
                }
                for x in ks.iter_mut().chain(vs.iter_mut()) {
                    x.truncate(heads);
                    x.shrink_to_fit();
                }
            }
        }
    }

    /// Drops all positions and frees the memory.
    /// Drops every position and frees the memory, on the host and on devices.
    pub fn clear(&mut self) {
        self.truncate(0);
        self.device.clear();
    }

    /// Whether some layer's keys and values are held on a device.
    pub fn has_device_layers(&self) -> bool {
        self.device.iter().any(Option::is_some)
    }

    /// Writes the cache (type, shape, positions, every layer's bytes, a CRC-32) so that
    /// [`Self::read_from`] restores it exactly — the daemon spills idle sessions' caches to
    /// flash under memory pressure.
    pub fn write_to(&self, w: &mut impl std::io::Write) -> std::io::Result<()> {
        if self.has_device_layers() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::Unsupported,
                "part of this KV cache is held on a device; spilling it is not supported yet",
            ));
        }
        let mut body = Vec::with_capacity(self.host_bytes() + 64);
        let (ty, layers) = match &self.store {
            Store::F16 { k, .. } => (0u32, k.len() / self.kv_heads()),
            Store::Q8 { k, .. } => (1u32, k.len()),
        };
        for v in [ty as u64, layers as u64, self.kv_dim as u64, self.head_dim as u64, self.len as u64] {
            body.extend_from_slice(&v.to_le_bytes());
        }
        match &self.store {
            Store::F16 { k, v } => {
                // Position-major rows of all heads per layer, keys' layers then values'.
                let (heads, hd) = (self.kv_heads(), self.head_dim);
                for layer in k.chunks_exact(heads).chain(v.chunks_exact(heads)) {
                    for p in 0..self.len {
                        for x in layer {
                            x[p * hd..(p + 1) * hd].iter().for_each(|h| body.extend_from_slice(&h.to_le_bytes()));
                        }
                    }
                }
            }
            Store::Q8 { k, ks, v, vs } => {
                let heads = self.len * self.kv_dim / self.head_dim;
                for (q, s) in k.iter().zip(ks).chain(v.iter().zip(vs)) {
                    q[..self.len * self.kv_dim].iter().for_each(|b| body.push(*b as u8));
                    s[..heads].iter().for_each(|f| body.extend_from_slice(&f.to_le_bytes()));
                }
            }
        }
        w.write_all(b"LLMDKV01")?;
        w.write_all(&(body.len() as u64).to_le_bytes())?;
        w.write_all(&crc32fast::hash(&body).to_le_bytes())?;
        w.write_all(&body)
    }

    /// Reads a cache written by [`Self::write_to`], checking its CRC and that it fits a model
    /// of `n_layers` layers and `kv_dim` (a spill file of another model is refused).
    pub fn read_from(r: &mut impl std::io::Read, n_layers: usize, kv_dim: usize) -> std::io::Result<Self> {
        let bad = |m: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, format!("KV spill file: {m}"));
        let mut head = [0u8; 20];
        r.read_exact(&mut head)?;
        if &head[..8] != b"LLMDKV01" {
            return Err(bad("bad magic"));
        }
        let len = u64::from_le_bytes(head[8..16].try_into().map_err(|_| bad("header"))?) as usize;
        let crc = u32::from_le_bytes(head[16..20].try_into().map_err(|_| bad("header"))?);
        if len > 64 << 30 {
            return Err(bad("too large"));
        }
        let mut body = vec![0u8; len];
        r.read_exact(&mut body)?;
        if crc32fast::hash(&body) != crc {
            return Err(bad("checksum mismatch"));
        }
        let u = |i: usize| u64::from_le_bytes(body[8 * i..8 * i + 8].try_into().unwrap_or_default()) as usize;
        if body.len() < 40 {
            return Err(bad("truncated"));
        }
        let (ty, layers, kd, hd, n) = (u(0), u(1), u(2), u(3), u(4));
        if layers != n_layers || kd != kv_dim || hd == 0 || kd % hd != 0 {
            return Err(bad("shape does not match the model"));
        }
        let per = n.checked_mul(kd).ok_or_else(|| bad("size"))?;
        let heads = per / hd;
        let want = match ty {
            0 => 2 * layers * per * 2,
            1 => 2 * layers * (per + heads * 4),
            _ => return Err(bad("unknown type")),
        };
        if body.len() != 40 + want {
            return Err(bad("size does not match its shape"));
        }
        let mut at = 40;
        let mut cache = Self::with_type(layers, kd, hd, if ty == 0 { KvType::F16 } else { KvType::Q8 });
        match &mut cache.store {
            Store::F16 { k, v } => {
                let heads = kd / hd;
                for layer in k.chunks_exact_mut(heads).chain(v.chunks_exact_mut(heads)) {
                    for row in body[at..at + 2 * per].chunks_exact(2 * kd) {
                        for (x, part) in layer.iter_mut().zip(row.chunks_exact(2 * hd)) {
                            x.extend(part.chunks_exact(2).map(|c| f16::from_le_bytes([c[0], c[1]])));
                        }
                    }
                    at += 2 * per;
                }
            }
            Store::Q8 { k, ks, v, vs } => {
                for (q, s) in k.iter_mut().zip(ks.iter_mut()).chain(v.iter_mut().zip(vs.iter_mut())) {
                    q.extend(body[at..at + per].iter().map(|&b| b as i8));
                    at += per;
                    s.extend(
                        body[at..at + 4 * heads].chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
                    );
                    at += 4 * heads;
                }
            }
        }
        cache.len = n;
        Ok(cache)
    }
}
