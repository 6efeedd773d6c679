//! [`QnnDevice`] as a device of the contract ([`llmd_device::Device`]): the NPU takes one
//! projection's rows ([`SubgraphKind::Linear`], the piece of a matmul HeteroLLM places on it)
//! as an fp16 `FullyConnected` graph — float compute, no activation quantization — built for
//! one token count of its `DeviceDesc::static_shapes` (an NPU graph is static: llm.npu's and
//! HeteroLLM's fixed sizes; a smaller piece is padded to a size by the caller).
//!
//! - **Memory:** host memory (a phone's NPU shares DRAM with the CPU: `MemoryKind::Unified`);
//!   `write` and `read` are copies. The NPU keeps no KV cache (attention is not its op here).
//! - **Weights:** `load_weight` dequantizes the rows it is given from the file's blocks to f16
//!   once (W4A16 / W8A16: HeteroLLM's float NPU path); `prepare` bakes them into the graph as a
//!   constant, so the graph holds the only NPU copy.
//! - **Submission:** `submit` runs the graph on the caller's thread (QNN's `graphExecute` is
//!   synchronous) and returns a signalled event: a `Linear`'s `x` holds its `n_tokens` rows (in
//!   f16 to the graph), `y` gets its output as f32. Each `Linear` executable's graph runs one
//!   submission at a time (its own lock), two side by side; groups run one at a time (they
//!   share the device's staging).
//! - **Graphs together:** `prepare_all` builds its graphs in one context and, with a cache
//!   directory ([`QnnDevice::with_cache_dir`]), keeps that context as one binary in the NPU's
//!   graph cache (`super::cache`, shared with the W8A8 groups), keyed by the library, the chip
//!   and every graph's name, shape and f16 weights: a second start loads it instead of
//!   finalizing ([`QnnDevice::prepare_cached`] says which happened).
//! - **Modelled time:** with llmd's emulator provider every execution is charged what a phone's
//!   NPU would take — a `Linear`'s in [`QnnDevice::modelled_ns`], a group's in its model's
//!   `NpuLinears::stats`; Qualcomm's x86 library runs for real and models nothing.
//! - **W8A8 groups:** llm.npu's linear groups ([`SubgraphKind::Group`]) — int8 weights and
//!   8-bit activations, with shadow outlier execution beside the graph — are the second graph
//!   kind. Their weights are loaded with the model's calibration: `crate::prefill::prepare`
//!   calibrates and quantizes a model and builds every group's graph in one context of this
//!   device (kept in the same graph cache), and [`QnnDevice::group_weights`] hands each group's
//!   graph out as this device's `Weight`s of that group (the graph holds the int8 weights). A
//!   group's executable, whatever count it was prepared for, runs the rows its bindings name
//!   (one position per row of `x`): its graphs' chunk size at a time, a short last chunk
//!   padded. `estimate` prices a `Linear` by HeteroLLM's fp16 model at its static count and a
//!   `Group` by llm.npu's INT8 model at the rows asked (not yet rounded up to its chunks).

use super::cache::{key_with, load_or_build_with, CacheOutcome, GraphIds};
use super::device::{describe, QnnDevice};
use super::f16::{build_f16, f16_io};
use crate::error::NpuError;
use llmd_device::{
    Bindings, BlockShape, Buffer, BufferUsage, Cost, Device, DeviceDesc, DeviceError, DeviceId, Event, Executable,
    HostWeight, Preparation, StaticShapes, Subgraph, SubgraphKind, Weight, WeightRole,
};
use std::ops::Range;
use std::path::PathBuf;

/// A whole projection's (output rows, input columns) in a model of `shape`.
fn linear_shape(shape: &BlockShape, role: WeightRole) -> Option<(usize, usize)> {
    let (d, q, kv, f) = (shape.d_model, shape.q_dim(), shape.kv_dim(), shape.ffn_dim);
    Some(match role {
        WeightRole::Wq => (q, d),
        WeightRole::Wk | WeightRole::Wv => (kv, d),
        WeightRole::Wo => (d, q),
        WeightRole::Gate | WeightRole::Up => (f, d),
        WeightRole::Down => (d, f),
        WeightRole::Output => (shape.vocab, d),
        _ => return None,
    })
}
use super::linears::NpuLinears;

#[cfg(target_endian = "big")]
compile_error!("llmd's device buffers are little-endian: a big-endian host is not supported");
use llmd_device::GroupSite;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard};

/// One W8A8 group's graph as a weight of the device: the model's groups, shared, and which.
struct GroupWeight {
    groups: Arc<NpuLinears>,
    layer: usize,
    site: GroupSite,
}

/// A prepared group: the model's groups and which, its input width and its projections' rows.
struct GroupExe {
    groups: Arc<NpuLinears>,
    layer: usize,
    site: GroupSite,
    cols: usize,
    rows: Vec<usize>,
}

/// The largest error of an fp16 `FullyConnected` against the f64 definition over the
/// dequantized weights, relative to Σ|w·x|: `x` and `w` are each rounded to f16 (2⁻¹¹ relative
/// each, so ≤ 2⁻¹⁰ ≈ 9.8e-4 of Σ|w·x| for their product), the output is rounded to f16 (2⁻¹¹ of
/// |y| ≤ Σ|w·x|), and the accumulation adds what its precision loses — the budget of the GPU's
/// fp16 kernels (`check::FP16_MATMUL_REL_TOL`), which round the same operands.
pub const F16_LINEAR_REL_TOL: f64 = 3e-3;

/// A buffer: host bytes.
type Mem = llmd_device::host::HostBytes;

/// A weight's rows in f16 (little-endian bytes), row-major.
struct F16Rows {
    rows: Range<usize>,
    cols: usize,
    w16: Vec<u16>,
}

/// A prepared linear subgraph: its graph and the staging of its f16 input and output.
struct Prepared {
    cols: usize,
    rows: usize,
    run: Mutex<Staged>,
}

struct Staged {
    graph: qnn_sys::api::Graph,
    x: Vec<u8>,
    y: Vec<u8>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl QnnDevice {
    /// The device building graphs for `counts` tokens (each at least 1) instead of
    /// [`super::device::DEFAULT_TOKEN_COUNTS`].
    pub fn with_token_counts(mut self, counts: &[usize]) -> Self {
        let counts: Vec<usize> = counts.iter().copied().filter(|&c| c > 0).collect();
        self.desc = describe(&self.provider().name, self.soc(), &counts);
        self
    }

    /// The modelled NPU time of every submission so far, in nanoseconds (0 with Qualcomm's
    /// library, which runs for real).
    pub fn modelled_ns(&self) -> u64 {
        self.modelled.load(Ordering::Relaxed)
    }

    fn invalid(&self, detail: impl Into<String>) -> DeviceError {
        DeviceError::Invalid { device: self.desc.name.clone(), detail: detail.into() }
    }

    fn unsupported(&self, what: impl Into<String>) -> DeviceError {
        DeviceError::Unsupported { device: self.desc.name.clone(), what: what.into() }
    }

    fn failed(&self, e: NpuError) -> DeviceError {
        DeviceError::Execution { device: self.desc.name.clone(), detail: e.to_string() }
    }

    fn mem<'a>(&self, b: &'a Buffer) -> Result<&'a Mem, DeviceError> {
        llmd_device::host::bytes(self.id, &self.desc.name, b)
    }
}

/// One graph to build: its name, token count and weight rows.
struct Planned<'w> {
    name: String,
    item: &'w Preparation,
    rows: &'w F16Rows,
}

impl QnnDevice {
    /// The NPU's graph cache for [`Device::prepare_all`]: a directory (made if missing), or
    /// none (graphs are built at each start).
    pub fn with_cache_dir(mut self, dir: Option<PathBuf>) -> Self {
        self.cache_dir = dir;
        self
    }

    /// [`Device::prepare_all`], and whether its context came from the cache (None without a
    /// cache directory).
    pub fn prepare_cached(
        &self,
        shape: &BlockShape,
        items: &[Preparation],
    ) -> Result<(Vec<Executable>, Option<CacheOutcome>), DeviceError> {
        let r = self.prepare_in_one_context(shape, items, self.cache_dir.as_deref())?;
        if let Some(o) = &r.1 {
            *lock(&self.last_cache) = Some(match o {
                CacheOutcome::Loaded => None,
                CacheOutcome::Built { reason } => Some(reason.clone()),
            });
        }
        Ok(r)
    }

    /// Prices its graphs by `soc`'s NPU figures ([`Device::estimate`]): HeteroLLM's model of an
    /// fp16 graph (launch, then the slower of its compute at the graph size's rate and its
    /// bytes), at the static token count a pass of `n` tokens runs in.
    pub fn with_profile(mut self, soc: crate::hetero::soc::Soc) -> Self {
        self.profile = Some(soc);
        self
    }

    /// [`Self::with_profile`] with the built-in profile of the chip it was opened for
    /// ([`crate::hetero::soc::for_qnn_chip`]), unless it has a profile or the chip has none:
    /// llm.npu's groups then have a modelled time for the job graph's order.
    pub fn with_chip_profile(self) -> Self {
        match (&self.profile, crate::hetero::soc::for_qnn_chip(self.soc())) {
            (None, Some(p)) => self.with_profile(p),
            _ => self,
        }
    }

    /// Where the last [`Device::prepare_all`] with a cache directory got its context (None:
    /// none has run, or there is no cache directory).
    pub fn last_cache_outcome(&self) -> Option<CacheOutcome> {
        lock(&self.last_cache).clone().map(|o| match o {
            None => CacheOutcome::Loaded,
            Some(reason) => CacheOutcome::Built { reason },
        })
    }

    fn plan<'w>(&self, shape: &BlockShape, item: &'w Preparation) -> Result<Planned<'w>, DeviceError> {
        let sg = item.subgraph;
        let SubgraphKind::Linear(role) = sg.kind else {
            return Err(self.unsupported(format!("{sg:?} (the NPU takes one projection's rows: a Linear subgraph)")));
        };
        self.desc.check(sg, &[], item.n_tokens).map_err(|what| self.unsupported(what))?;
        let roles = sg.weight_roles(shape);
        let [w] = item.weights.as_slice() else {
            return Err(self.invalid(format!("{sg:?} takes the weights {roles:?}")));
        };
        if w.role != role {
            return Err(self.invalid(format!("{sg:?} takes the weights {roles:?}, given {:?}", w.role)));
        }
        let rows = w.get::<F16Rows>(self.id).ok_or_else(|| self.invalid("a weight of another device"))?;
        let name = format!("l{}_{role:?}_r{}_{}_m{}", sg.layer, rows.rows.start, rows.rows.end, item.n_tokens);
        Ok(Planned { name, item, rows })
    }

    /// Builds `items`' graphs in one context — loaded from `cache`'s file for them when a sound
    /// one is there, else built, finalized and stored — and retrieves each as an executable.
    fn prepare_in_one_context(
        &self,
        shape: &BlockShape,
        items: &[Preparation],
        cache: Option<&std::path::Path>,
    ) -> Result<(Vec<Executable>, Option<CacheOutcome>), DeviceError> {
        let planned = items.iter().map(|i| self.plan(shape, i)).collect::<Result<Vec<_>, _>>()?;
        let mut names: Vec<&str> = planned.iter().map(|p| p.name.as_str()).collect();
        names.sort_unstable();
        if let Some(w) = names.windows(2).find(|w| w[0] == w[1]) {
            return Err(self.invalid(format!("graph {} asked for twice", w[0])));
        }
        let build = |context: &super::NpuContext| -> Result<GraphIds, NpuError> {
            planned
                .iter()
                .map(|p| {
                    let local = 0..p.rows.rows.len();
                    let io = build_f16(context, &p.name, &p.rows.w16, p.rows.cols, p.item.n_tokens, &local)?.io();
                    Ok((io.inputs.first().map_or(0, |i| i.1), io.outputs.iter().map(|o| o.1).collect()))
                })
                .collect()
        };
        let (context, ids, outcome) = match cache {
            Some(dir) => {
                let most = planned.iter().map(|p| p.item.n_tokens).max().unwrap_or(0);
                let key = key_with(self, most, planned.len(), &mut |f| {
                    for p in &planned {
                        f(p.name.as_bytes());
                        for v in [p.item.n_tokens, p.rows.rows.start, p.rows.rows.end, p.rows.cols] {
                            f(&(v as u64).to_le_bytes());
                        }
                        for chunk in p.rows.w16.chunks(4096) {
                            let bytes: Vec<u8> = chunk.iter().flat_map(|v| v.to_le_bytes()).collect();
                            f(&bytes);
                        }
                    }
                })
                .map_err(|e| self.failed(e))?;
                let (c, ids, outcome) =
                    load_or_build_with(self, dir, &key, planned.len(), build).map_err(|e| self.failed(e))?;
                (c, ids, Some(outcome))
            }
            None => {
                let c = self.context().map_err(|e| self.failed(e))?;
                let ids = build(&c).map_err(|e| self.failed(e))?;
                (c, ids, None)
            }
        };
        let mut exes = Vec::with_capacity(planned.len());
        for (p, (input, outputs)) in planned.iter().zip(&ids) {
            let (m, k, n) = (p.item.n_tokens, p.rows.cols, p.rows.rows.len());
            let (xs, ys) = f16_io(m, k, &(0..n));
            let output = *outputs.first().ok_or_else(|| self.invalid(format!("graph {}: no output id", p.name)))?;
            let io = qnn_sys::api::GraphIo { inputs: vec![(xs, *input)], outputs: vec![(ys, output)] };
            let graph = context.0.retrieve(&p.name, &io).map_err(|e| self.failed(e.into()))?;
            let staged = Staged { graph, x: vec![0u8; m * k * 2], y: vec![0u8; m * n * 2] };
            let prepared = Prepared { cols: k, rows: n, run: Mutex::new(staged) };
            exes.push(Executable::new(self.id, p.item.subgraph, m, Arc::new(prepared)));
        }
        Ok((exes, outcome))
    }
}

impl QnnDevice {
    /// A model's W8A8 groups (`crate::prefill::prepare`'s, their graphs in a context of this
    /// device) as this device's weights of every `Group` subgraph, in
    /// [`Subgraph::weight_roles`] order: one handle per projection, each naming the group's
    /// graph (which holds the int8 weights).
    pub fn group_weights(&self, groups: &Arc<NpuLinears>) -> Vec<(Subgraph, Vec<Weight>)> {
        let mut out = Vec::with_capacity(groups.layers() * 4);
        for layer in 0..groups.layers() {
            for site in GroupSite::ALL {
                let Some((cols, rows)) = groups.group_shape(layer, site) else { continue };
                let ws = site
                    .roles()
                    .iter()
                    .zip(&rows)
                    .map(|(&role, &n)| {
                        let inner = GroupWeight { groups: groups.clone(), layer, site };
                        Weight::new(self.id, role, 0..n, cols, n * cols, Arc::new(inner))
                    })
                    .collect();
                out.push((Subgraph::group(layer, site), ws));
            }
        }
        out
    }

    fn prepare_group(
        &self,
        sg: Subgraph,
        site: GroupSite,
        n_tokens: usize,
        weights: &[Weight],
    ) -> Result<Executable, DeviceError> {
        let roles = site.roles();
        if weights.len() != roles.len() || weights.iter().zip(roles).any(|(w, r)| w.role != *r) {
            return Err(self.invalid(format!("{sg:?} takes the weights {roles:?}")));
        }
        let mut named = None;
        for w in weights {
            let g = w.get::<GroupWeight>(self.id).ok_or_else(|| {
                self.invalid(format!("{sg:?}: {:?} is not a W8A8 group's graph of this device", w.role))
            })?;
            if g.layer != sg.layer || g.site != site {
                return Err(self.invalid(format!("{sg:?} given layer {}'s {:?} group", g.layer, g.site)));
            }
            named.get_or_insert(g);
        }
        let g = named.ok_or_else(|| self.invalid(format!("{sg:?} without weights")))?;
        let (cols, rows) = g
            .groups
            .group_shape(g.layer, site)
            .ok_or_else(|| self.invalid(format!("{sg:?}: no such group in the model's graphs")))?;
        let exe = GroupExe { groups: g.groups.clone(), layer: g.layer, site, cols, rows };
        Ok(Executable::new(self.id, sg, n_tokens, Arc::new(exe)))
    }

    /// Runs a group over the rows `bind` names (one position per row of `x`): `x`'s rows in,
    /// each projection's rows out to `y` in turn.
    fn submit_group(&self, g: &GroupExe, bind: &Bindings) -> Result<(), DeviceError> {
        let n = bind.positions.len();
        let y = bind.y.as_ref().ok_or_else(|| self.invalid("a Group subgraph without an output buffer"))?;
        let k = g.cols.max(1);
        let total: usize = g.rows.iter().map(|r| n * r).sum();
        if std::ptr::eq(self.mem(&bind.x)?, self.mem(y)?) {
            return Err(self.invalid("a Group subgraph bound to one buffer for its input and its outputs"));
        }
        // The buffers' bytes are read and written as f32 in place where they are aligned for
        // it (the host's little-endian bytes), else through the device's staging.
        let mut staged = lock(&self.group_staging);
        let (xs, ys) = &mut *staged;
        let xb = lock(self.mem(&bind.x)?);
        let src = xb.get(..n * k * 4).ok_or_else(|| {
            self.invalid(format!("x holds {} bytes, {n} rows of {k} f32 take {}", xb.len(), n * k * 4))
        })?;
        let x: &[f32] = match bytemuck::try_cast_slice(src) {
            Ok(x) => x,
            Err(_) => {
                xs.clear();
                xs.extend(src.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])));
                xs
            }
        };
        let mut yb = lock(self.mem(y)?);
        let dst = yb
            .get_mut(..total * 4)
            .ok_or_else(|| self.invalid(format!("y is shorter than the group's {total} outputs")))?;
        let in_place = bytemuck::try_cast_slice_mut::<u8, f32>(&mut dst[..]).is_ok();
        let out: &mut [f32] = if in_place {
            bytemuck::cast_slice_mut(&mut dst[..])
        } else {
            ys.clear();
            ys.resize(total, 0.0);
            ys
        };
        let mut views: Vec<&mut [f32]> = Vec::with_capacity(g.rows.len());
        let mut rest = out;
        for &r in &g.rows {
            let (one, more) = rest.split_at_mut(n * r);
            views.push(one);
            rest = more;
        }
        g.groups
            .run(g.layer, g.site, x, n, &mut views)
            .map_err(|e| DeviceError::Execution { device: self.desc.name.clone(), detail: e.to_string() })?;
        if !in_place {
            for (d, v) in dst.chunks_exact_mut(4).zip(ys.iter()) {
                d.copy_from_slice(&v.to_le_bytes());
            }
        }
        Ok(())
    }
}

impl Device for QnnDevice {
    fn id(&self) -> DeviceId {
        self.id
    }

    fn desc(&self) -> &DeviceDesc {
        &self.desc
    }

    fn alloc(&self, usage: BufferUsage, bytes: usize) -> Result<Buffer, DeviceError> {
        if usage == BufferUsage::Kv {
            return Err(self.unsupported("a KV cache (attention is not an NPU op here)"));
        }
        llmd_device::host::alloc(self.id, &self.desc.name, usage, bytes)
    }

    fn write(&self, dst: &Buffer, offset: usize, src: &[u8], after: &[Event]) -> Result<Event, DeviceError> {
        llmd_device::host::write(self.id, &self.desc.name, dst, offset, src, after)
    }

    fn read(&self, src: &Buffer, offset: usize, dst: &mut [u8], after: &[Event]) -> Result<(), DeviceError> {
        llmd_device::host::read(self.id, &self.desc.name, src, offset, dst, after)
    }

    fn load_weight(&self, w: &HostWeight<'_>, rows: Range<usize>) -> Result<Weight, DeviceError> {
        let bytes = w.rows_bytes(rows.clone()).ok_or_else(|| {
            self.invalid(format!(
                "{:?}: {} bytes of {} do not hold rows {rows:?} of {} × {} (the NPU reads the file's rows)",
                w.role,
                w.data.len(),
                w.ty,
                w.rows,
                w.cols
            ))
        })?;
        let rb = w.ty.row_bytes(w.cols).unwrap_or(0).max(1);
        let mut w16 = Vec::new();
        w16.try_reserve_exact(rows.len() * w.cols).map_err(|_| DeviceError::OutOfMemory {
            device: self.desc.name.clone(),
            usage: BufferUsage::Weights,
            bytes: rows.len() * w.cols * 2,
        })?;
        let mut row = vec![0f32; w.cols];
        for src in bytes.chunks_exact(rb) {
            crate::quant::dequantize_row(w.ty, src, &mut row)
                .map_err(|e| self.invalid(format!("{:?}: {e}", w.role)))?;
            w16.extend(row.iter().map(|&v| half::f16::from_f32(v).to_bits()));
        }
        let size = w16.len() * 2;
        Ok(Weight::new(self.id, w.role, rows.clone(), w.cols, size, Arc::new(F16Rows { rows, cols: w.cols, w16 })))
    }

    fn prepare(
        &self,
        sg: Subgraph,
        shape: &BlockShape,
        n_tokens: usize,
        weights: &[Weight],
    ) -> Result<Executable, DeviceError> {
        if let SubgraphKind::Group(site) = sg.kind {
            return self.prepare_group(sg, site, n_tokens, weights);
        }
        let item = Preparation { subgraph: sg, n_tokens, weights: weights.to_vec() };
        let (mut exes, _) = self.prepare_in_one_context(shape, std::slice::from_ref(&item), None)?;
        exes.pop().ok_or_else(|| self.invalid("no executable prepared"))
    }

    fn prepare_all(&self, shape: &BlockShape, items: &[Preparation]) -> Result<Vec<Executable>, DeviceError> {
        // A group wraps the graph its model's calibration built; the rest are built together in
        // one context (and the graph cache).
        let is_group = |i: &Preparation| matches!(i.subgraph.kind, SubgraphKind::Group(_));
        let linears: Vec<Preparation> = items.iter().filter(|i| !is_group(i)).cloned().collect();
        let mut built =
            if linears.is_empty() { Vec::new() } else { self.prepare_cached(shape, &linears)?.0 }.into_iter();
        items
            .iter()
            .map(|i| {
                if is_group(i) {
                    self.prepare(i.subgraph, shape, i.n_tokens, &i.weights)
                } else {
                    built.next().ok_or_else(|| self.invalid("fewer executables than graphs prepared"))
                }
            })
            .collect()
    }

    /// A subgraph's modelled time on the profile's NPU ([`QnnDevice::with_profile`]): a
    /// `Linear` at the smallest static count holding `n_tokens`, weights in f16 (HeteroLLM's
    /// model); a `Group` as one W8A8 graph of its projections over `n_tokens` rows (llm.npu's
    /// model, [`crate::hetero::soc::int8_graph_s`]). None without a profile, for other kinds,
    /// and past a `Linear`'s largest count.
    fn estimate(&self, sg: Subgraph, shape: &BlockShape, n_tokens: usize) -> Option<Cost> {
        let soc = self.profile.as_ref()?;
        if let SubgraphKind::Group(site) = sg.kind {
            let fcs: Vec<(usize, usize)> = site
                .roles()
                .iter()
                .map(|&r| linear_shape(shape, r).map(|(rows, cols)| (cols, rows)))
                .collect::<Option<_>>()?;
            return Some(Cost { compute_s: soc.npu_int8_graph_s(n_tokens, &fcs), transfer_s: 0.0 });
        }
        let SubgraphKind::Linear(role) = sg.kind else { return None };
        let (rows, cols) = linear_shape(shape, role)?;
        let m = match &self.desc.static_shapes {
            StaticShapes::Only(c) => c.iter().copied().filter(|&s| s >= n_tokens).min()?,
            StaticShapes::Any => n_tokens,
        };
        Some(Cost { compute_s: soc.npu_matmul_s(m, cols, rows, 16.0), transfer_s: 0.0 })
    }

    fn submit(&self, exe: &Executable, bind: &Bindings, after: &[Event]) -> Result<Event, DeviceError> {
        if let Some(g) = exe.get::<GroupExe>(self.id) {
            Event::wait_all(after)?;
            self.submit_group(g, bind)?;
            return Ok(Event::ready(Ok(())));
        }
        let p = exe.get::<Prepared>(self.id).ok_or_else(|| self.invalid("an executable of another device"))?;
        let y = bind.y.as_ref().ok_or_else(|| self.invalid("a Linear subgraph without an output buffer"))?;
        Event::wait_all(after)?;
        let (m, k, n) = (exe.n_tokens, p.cols, p.rows);
        let mut s = lock(&p.run);
        let Staged { graph, x: xs, y: ys } = &mut *s;
        {
            let x = lock(self.mem(&bind.x)?);
            let src = x.get(..m * k * 4).ok_or_else(|| {
                self.invalid(format!("x holds {} bytes, {m} rows of {k} f32 take {}", x.len(), m * k * 4))
            })?;
            for (d, c) in xs.chunks_exact_mut(2).zip(src.chunks_exact(4)) {
                let v = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                d.copy_from_slice(&half::f16::from_f32(v).to_bits().to_le_bytes());
            }
        }
        graph
            .execute(&[xs], &mut [ys])
            .map_err(|e| DeviceError::Execution { device: self.desc.name.clone(), detail: e.to_string() })?;
        if let Some((last, _)) = graph.modelled_ns() {
            self.modelled.fetch_add(last, Ordering::Relaxed);
        }
        let mut out = lock(self.mem(y)?);
        let dst = out.get_mut(..m * n * 4).ok_or_else(|| self.invalid(format!("y is shorter than {m} rows of {n}")))?;
        for (d, c) in dst.chunks_exact_mut(4).zip(ys.chunks_exact(2)) {
            d.copy_from_slice(&half::f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32().to_le_bytes());
        }
        Ok(Event::ready(Ok(())))
    }
}
