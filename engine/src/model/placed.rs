//! A pass whose subgraphs run on several devices: placed by [`crate::sched::place`], run in
//! [`crate::sched::Dag`] order, the residual stream moved between host memory and a
//! device's buffers with events ordering each step. Subgraphs placed on the host run the host
//! blocks ([`crate::backend::blocks`]) in place; the others go through the device contract:
//! their weights loaded once per device ([`Device::load_weight`]), an executable prepared once
//! per device, subgraph and token count, each layer's KV cache in the memory of the device its
//! attention runs on (`KvCache::device_layer`). A projection of a host subgraph that the
//! devices' splitter divides runs as parts across devices (`split.rs`).

use super::devices::Devices;
use super::kv::{DeviceKv, KvCache};
use super::weights::WeightMatrix;
use super::{Logits, Transformer};
use crate::backend::blocks::{Batch, Linears, Pass, PassState};
use crate::backend::{bytes_f32, f32_bytes};
use crate::error::BackendError;
use crate::sched::{self, run_threads, Dag, Job, Policy, Processor, Split, Timeline};
use llmd_device::{
    Bindings, Buffer, BufferUsage, DeviceDesc, DeviceError, Event, Executable, GgmlType, HostLayout, HostWeight,
    MemoryKind, SeqBinding, Subgraph, SubgraphKind, Weight, WeightRole,
};
use std::sync::{Arc, Mutex};

/// Positions of the smallest device KV cache (a sequence's buffer then doubles as it grows).
const MIN_DEVICE_KV: usize = 256;

fn dev_err(e: DeviceError) -> BackendError {
    BackendError::Device(e.to_string())
}

impl Transformer {
    /// The weight types subgraph `sg` reads.
    fn weight_types(&self, sg: Subgraph) -> Vec<GgmlType> {
        self.subgraph_matrices(sg).iter().map(|(_, m)| m.ty).collect()
    }

    fn subgraph_matrices(&self, sg: Subgraph) -> Vec<(WeightRole, &WeightMatrix)> {
        let w = &self.weights;
        match sg.kind {
            SubgraphKind::Embed => vec![(WeightRole::TokenEmbd, &w.token_embd)],
            SubgraphKind::Head => vec![(WeightRole::Output, &w.output)],
            SubgraphKind::Attention => w.layers.get(sg.layer).map_or_else(Vec::new, |l| {
                vec![(WeightRole::Wq, &l.wq), (WeightRole::Wk, &l.wk), (WeightRole::Wv, &l.wv), (WeightRole::Wo, &l.wo)]
            }),
            SubgraphKind::Ffn => w.layers.get(sg.layer).map_or_else(Vec::new, |l| {
                vec![(WeightRole::Gate, &l.w_gate), (WeightRole::Up, &l.w_up), (WeightRole::Down, &l.w_down)]
            }),
            SubgraphKind::Linear(role) => w.layers.get(sg.layer).and_then(|l| l.matrix(role)).map_or_else(
                || match role {
                    WeightRole::Output => vec![(role, &w.output)],
                    WeightRole::TokenEmbd => vec![(role, &w.token_embd)],
                    _ => Vec::new(),
                },
                |m| vec![(role, m)],
            ),
            SubgraphKind::Group(_)
            | SubgraphKind::AttnQkv
            | SubgraphKind::AttnOut
            | SubgraphKind::FfnGateUp
            | SubgraphKind::FfnDown => w.layers.get(sg.layer).map_or_else(Vec::new, |l| {
                let roles = sg.group_site().map_or(&[][..], |s| s.roles());
                roles.iter().filter_map(|&r| l.matrix(r).map(|m| (r, m))).collect()
            }),
            SubgraphKind::AttnCore => Vec::new(),
        }
    }

    /// The f32 vectors subgraph `sg` reads, by role.
    fn subgraph_vectors(&self, sg: Subgraph) -> Vec<(WeightRole, &[f32])> {
        let w = &self.weights;
        let mut v: Vec<(WeightRole, &[f32])> = Vec::new();
        match sg.kind {
            SubgraphKind::Embed => {}
            SubgraphKind::Head => v.push((WeightRole::OutputNorm, &w.output_norm)),
            SubgraphKind::Attention | SubgraphKind::AttnQkv => {
                if let Some(l) = w.layers.get(sg.layer) {
                    v.push((WeightRole::AttnNorm, &l.attn_norm));
                    for (r, b) in [(WeightRole::Bq, &l.bq), (WeightRole::Bk, &l.bk), (WeightRole::Bv, &l.bv)] {
                        if let Some(b) = b {
                            v.push((r, b));
                        }
                    }
                }
                if let (Some(f), SubgraphKind::Attention) = (&w.rope_freqs, sg.kind) {
                    v.push((WeightRole::RopeFreqs, f));
                }
            }
            SubgraphKind::AttnCore => {
                if let Some(f) = &w.rope_freqs {
                    v.push((WeightRole::RopeFreqs, f));
                }
            }
            SubgraphKind::Ffn | SubgraphKind::FfnGateUp => {
                if let Some(l) = w.layers.get(sg.layer) {
                    v.push((WeightRole::FfnNorm, &l.ffn_norm));
                }
            }
            SubgraphKind::Linear(_) | SubgraphKind::Group(_) | SubgraphKind::AttnOut | SubgraphKind::FfnDown => {}
        }
        v
    }

    /// `sg`'s weights on device `d` (index ≥ 1), loaded at first use, in the order of
    /// [`Subgraph::weight_roles`].
    fn device_weights(&self, devs: &Devices, d: usize, sg: Subgraph) -> Result<Arc<Vec<Weight>>, BackendError> {
        if let Some(w) = devs.lock().weights.get(&(d, sg)) {
            return Ok(w.clone());
        }
        let dev = &devs.list[d - 1];
        let mats = self.subgraph_matrices(sg);
        let vecs = self.subgraph_vectors(sg);
        let mut out = Vec::new();
        for role in sg.weight_roles(&self.shape) {
            let w = if let Some((_, m)) = mats.iter().find(|(r, _)| *r == role) {
                // The file's rows, and the CPU's own copy (its packed tiles) for a device that
                // shares the host's memory to read in place; weights unpacked from an llmd file
                // have only the latter.
                let host = m.host_copy();
                let data = m.source_bytes().unwrap_or_default();
                let named = match (&host, data.is_empty()) {
                    (_, false) => data,
                    (Some(h), true) => h.weight_bytes(),
                    (None, true) => {
                        return Err(BackendError::Device(format!(
                            "{}: {} has no bytes of its type to load ({} weights on flash)",
                            dev.desc().name,
                            m.name,
                            m.ty
                        )))
                    }
                };
                // The model's own bytes (its map, or its packed copy) outlive every device
                // handle: their address names them.
                let key = (d, named.as_ptr() as usize, named.len());
                let known = devs.lock().by_bytes.get(&key).cloned();
                match known {
                    Some(mut w) if w.cols == m.cols => {
                        w.role = role;
                        w
                    }
                    _ => {
                        let hw = HostWeight { role, ty: m.ty, rows: m.rows, cols: m.cols, data, host: host.as_ref() };
                        let w = dev.load_weight(&hw, 0..m.rows).map_err(dev_err)?;
                        // A device with memory of its own holds its copy: the map's pages the
                        // upload read need not stay resident (the CPU's kernels read their own
                        // packed copies, or fault the pages back in). One that shares the host's
                        // memory may read those very pages (a file's rows in place).
                        let shares = dev.desc().memory.kind == MemoryKind::Unified;
                        if !(shares && host.as_ref().is_some_and(|h| h.layout == HostLayout::Rows)) {
                            m.release_source_pages();
                        }
                        devs.lock().by_bytes.insert(key, w.clone());
                        w
                    }
                }
            } else if let Some((_, v)) = vecs.iter().find(|(r, _)| *r == role) {
                let data = f32_bytes(v);
                let hw = HostWeight { role, ty: GgmlType::F32, rows: 1, cols: v.len(), data: &data, host: None };
                dev.load_weight(&hw, 0..1).map_err(dev_err)?
            } else {
                return Err(BackendError::Device(format!("{sg:?} has no weight {role:?}")));
            };
            out.push(w);
        }
        let out = Arc::new(out);
        devs.lock().weights.insert((d, sg), out.clone());
        Ok(out)
    }

    pub(super) fn executable(
        &self,
        devs: &Devices,
        d: usize,
        sg: Subgraph,
        n: usize,
    ) -> Result<Executable, BackendError> {
        if let Some(e) = devs.lock().exes.get(&(d, sg, n)) {
            return Ok(e.clone());
        }
        let weights = self.device_weights(devs, d, sg)?;
        let exe = devs.list[d - 1].prepare(sg, &self.shape, n, &weights).map_err(dev_err)?;
        devs.lock().exes.insert((d, sg, n), exe.clone());
        Ok(exe)
    }

    /// Places `steps` (a pass's subgraphs) at `n` tokens across the host and `devs`: a device
    /// index per step (0: the host). Placed by price alone: a sequence's KV cache of a layer
    /// follows that layer's attention (handed to a device, or brought back, in the pass that
    /// needs it), so no layer is pinned to where an earlier pass ran it. (Moving a cache is not
    /// priced: a cost model that sends prompts to one device and decode steps to another — the
    /// GPU decoding what the CPU read — moves each sequence's cache once per turn.)
    fn place_steps(&self, devs: &Devices, steps: &[Subgraph], n: usize) -> Result<Vec<usize>, BackendError> {
        let descs = self.descs(devs)?;
        let no_homes = vec![None; self.config.n_layers];
        sched::place(&descs, steps, &|sg| self.weight_types(sg), &self.shape, n, &no_homes, &*devs.cost)
            .map_err(|e| BackendError::NoBackend(e.to_string()))
    }

    /// The processor whose work step `sg`, placed on `d`, is at `n` tokens — the job graph's
    /// lane it runs in: its device's; for a step on the host whose linear group the devices'
    /// splitter places on devices (llm.npu's W8A8 groups on the NPU, HeteroLLM's cuts of each
    /// projection), the NPU's if any piece of the group is on one — QNN is called from the NPU
    /// lane's thread only (`sched::run_threads`) — else the first such device's, the host
    /// thread only feeding it; else the host's CPU.
    fn lane(&self, devs: &Devices, descs: &[&DeviceDesc], sg: Subgraph, d: usize, n: usize) -> Processor {
        if d > 0 {
            return descs[d].processor;
        }
        let Some(site) = sg.group_site() else { return descs[0].processor };
        let mut on: Vec<usize> = match devs.splitter.group(sg.layer, site, n, descs) {
            Some(g) => vec![g],
            None => self
                .subgraph_matrices(Subgraph::group(sg.layer, site))
                .into_iter()
                .flat_map(|(role, m)| match devs.splitter.split(sg.layer, role, m.rows, n, descs) {
                    Split::Whole => vec![],
                    Split::Rows(v) | Split::Tokens(v) => v.into_iter().map(|(d, _)| d).collect(),
                    Split::Hybrid(parts) => parts.into_iter().map(|p| p.dev).collect(),
                })
                .collect(),
        };
        on.retain(|&d| d > 0 && d < descs.len());
        let procs: Vec<Processor> = on.into_iter().map(|d| descs[d].processor).collect();
        if procs.contains(&Processor::Npu) {
            return Processor::Npu;
        }
        procs.first().copied().unwrap_or(descs[0].processor)
    }

    /// One pass over `batch` with its subgraphs placed across the host and `devs`, run by the
    /// executor in model order; `stop`, when given, is asked before each step and each of the
    /// host steps' linear groups (a withdrawn job).
    pub(crate) fn forward_placed(
        &self,
        devs: &Devices,
        batch: &mut [(&mut KvCache, &[u32])],
        which: Logits,
        stop: Option<&(dyn Fn() -> bool + Sync)>,
    ) -> Result<Vec<Vec<f32>>, BackendError> {
        // The host's projections go through the splitter, where it divides any.
        // A stop flag is asked by the host's projections too, whatever the splitter.
        let splits =
            if devs.splitter.splits() || stop.is_some() { Some(self.split_linears_until(devs, stop)?) } else { None };
        let sa = self.sparse_attention();
        let ex = Exec::new(self, devs, splits.as_ref().map(|s| s as &dyn Linears), sa.as_deref(), which, stop);
        let Some(st) = ex.p.state(batch)? else {
            return Ok(vec![Vec::new(); batch.len()]);
        };
        let pass = Subgraph::pass(self.config.n_layers);
        let placement = self.place_steps(devs, &pass, st.n)?;
        let mut ch = Chunk::new(st);
        // The pass as one chunk of the job graph, each step on its device's processor, run one
        // job at a time in model order (every dependency is an earlier step).
        let descs = self.descs(devs)?;
        let procs: Vec<_> = placement.iter().map(|&d| descs[d].processor).collect();
        for job in Dag::from_pass(&pass, &procs, 1).in_model_order() {
            ex.step(&mut ch, batch, pass[job.step], placement[job.step])?;
        }
        ch.settle()?;
        for ((kv, _), &(_, len, _)) in batch.iter_mut().zip(&ch.st.spans) {
            kv.advance(len);
        }
        ch.logits.ok_or_else(|| BackendError::NoBackend("the pass had no head".into()))
    }

    /// The steps of a prompt in chunks ([`Self::prefill_placed`]): every layer's parts
    /// ([`Subgraph::layer_parts`]), between the embedding and the head.
    pub(super) fn chunk_steps(&self) -> Vec<Subgraph> {
        let mut steps = vec![Subgraph::EMBED];
        steps.extend((0..self.config.n_layers).flat_map(Subgraph::layer_parts));
        steps.push(Subgraph::HEAD);
        steps
    }

    /// The job graph of a prompt of `chunks` chunks of `chunk` tokens on `devs`: each layer
    /// part of each chunk after the part before it, attention's core after the same layer's of
    /// the previous chunk (the KV cache it appends to), each in the lane of the processor that
    /// does its work ([`Self::lane`]). Its steps are [`Self::chunk_steps`] without the
    /// embedding and the head (each chunk's embedding runs before the graph, the last chunk's
    /// head after it).
    pub fn prefill_dag(&self, devs: &Devices, chunks: usize, chunk: usize) -> Result<Dag, BackendError> {
        let steps = self.chunk_steps();
        let placement = self.place_steps(devs, &steps, chunk)?;
        self.dag_of(devs, &steps, &placement, chunks, chunk)
    }

    /// [`Self::prefill_dag`] of `steps` already placed.
    fn dag_of(
        &self,
        devs: &Devices,
        steps: &[Subgraph],
        placement: &[usize],
        chunks: usize,
        chunk: usize,
    ) -> Result<Dag, BackendError> {
        let descs = self.descs(devs)?;
        let inner = 1..steps.len() - 1;
        let procs: Vec<_> = inner.clone().map(|i| self.lane(devs, &descs, steps[i], placement[i], chunk)).collect();
        Ok(Dag::from_pass(&steps[inner], &procs, chunks))
    }

    /// Prefills `tokens` after what `kv` holds in chunks of `chunk` tokens through the executor:
    /// each chunk's layer parts placed across the host and `devs` ([`Self::prefill_dag`]), the
    /// jobs taken by one thread per lane in the order `policy` picks over the job times `times`
    /// (llm.npu's T(G)); returns the last token's logits and the timeline. Every legal order
    /// gives the in-order bits, and `kv` ends as an in-order prefill leaves it; on an error it
    /// is cut back to where it was. `stop` is asked before each job and each host linear group.
    ///
    /// Decision: the steps that read or append the KV cache run on the host here (the CPU
    /// lane, as llm.npu's attention does): chunks that run out of order append to one cache
    /// whose length the host keeps per layer as it goes. A placement that puts attention on a
    /// device is refused (a whole-pass run takes it).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn prefill_placed(
        &self,
        devs: &Devices,
        kv: &mut KvCache,
        tokens: &[u32],
        chunk: usize,
        policy: Policy,
        times: &(dyn Fn(Job) -> f64 + Sync),
        stop: Option<&(dyn Fn() -> bool + Sync)>,
    ) -> Result<(Vec<f32>, Timeline), BackendError> {
        if self.devices.is_some() {
            return Err(BackendError::Device(
                "a prompt in chunks runs on the host's caches: detach the devices first".into(),
            ));
        }
        if chunk == 0 {
            return Err(BackendError::Shape { op: "prefill", detail: "a chunk of 0 tokens".into() });
        }
        if tokens.is_empty() {
            return Ok((Vec::new(), Timeline { runs: Vec::new(), makespan: 0.0, origin: None }));
        }
        let base = kv.len();
        if base + tokens.len() > self.config.context_length {
            return Err(BackendError::Shape {
                op: "prefill",
                detail: format!(
                    "{} positions exceed the context of {}",
                    base + tokens.len(),
                    self.config.context_length
                ),
            });
        }
        let steps = self.chunk_steps();
        let placement = self.place_steps(devs, &steps, chunk)?;
        if let Some(i) = (0..steps.len()).find(|&i| steps[i].uses_kv() && placement[i] != 0) {
            return Err(BackendError::Device(format!(
                "{:?} placed on {}: a prompt in chunks appends to its cache on the host",
                steps[i],
                self.descs(devs)?[placement[i]].name
            )));
        }
        kv.move_all_home()?;
        let linears = self.split_linears_until(devs, stop)?;
        let sa = self.sparse_attention();
        let ex = Exec::new(self, devs, Some(&linears), sa.as_deref(), Logits::Last, stop);
        let parts: Vec<&[u32]> = tokens.chunks(chunk).collect();
        let dag = self.dag_of(devs, &steps, &placement, parts.len(), chunk)?;
        let mut run = || -> Result<(Vec<f32>, Timeline), BackendError> {
            let mut chunks = Vec::with_capacity(parts.len());
            for (i, part) in parts.iter().enumerate() {
                let start = base + i * chunk;
                let st = PassState::new(
                    &self.shape,
                    part.to_vec(),
                    (start..start + part.len()).collect(),
                    vec![(0, part.len(), start)],
                );
                let mut ch = Chunk::new(st);
                ex.step(&mut ch, &mut [], steps[0], placement[0])?;
                chunks.push(Mutex::new(ch));
            }
            let kvm = Mutex::new(&mut *kv);
            let work = |j: Job| -> Result<(), BackendError> {
                let i = j.step + 1;
                let mut ch = chunks[j.chunk].lock().unwrap_or_else(|e| e.into_inner());
                if !steps[i].uses_kv() {
                    return ex.step(&mut ch, &mut [], steps[i], placement[i]);
                }
                let mut kv = kvm.lock().unwrap_or_else(|e| e.into_inner());
                // This layer holds exactly the earlier chunks' positions (the graph's
                // cross-chunk edge): the chunk appends after them.
                kv.set_len(base + j.chunk * chunk);
                ex.step(&mut ch, &mut [(&mut **kv, parts[j.chunk])], steps[i], placement[i])
            };
            let timeline = run_threads(&dag, policy, times, &work)?;
            for ch in &chunks {
                ch.lock().unwrap_or_else(|e| e.into_inner()).settle()?;
            }
            kv.set_len(base + tokens.len());
            let mut last = chunks.pop().map(|m| m.into_inner().unwrap_or_else(|e| e.into_inner()));
            let last = last.as_mut().ok_or_else(|| BackendError::NoBackend("no chunks".into()))?;
            let head = steps.len() - 1;
            ex.step(last, &mut [], steps[head], placement[head])?;
            last.settle()?;
            let logits = last.logits.take().and_then(|mut l| l.pop()).unwrap_or_default();
            self.weights.check_files()?;
            Ok((logits, timeline))
        };
        let out = run();
        if out.is_err() {
            // Layers hold different numbers of the prompt's positions: cut every one back.
            kv.set_len(base);
            kv.truncate(base);
        }
        out
    }
}

/// Where a chunk's tensor is between two steps.
enum Loc {
    /// In the chunk's host state.
    Host,
    /// On device `i` (index into the placement's list, ≥ 1) in a buffer, ready when the event
    /// signals.
    Dev(usize, Buffer, Event),
}

/// One chunk of a pass as the executor runs it: its host state, where its residual stream
/// and its last layer part's output are, and its logits once the head ran.
struct Chunk {
    st: PassState,
    x: Loc,
    /// What the last step wrote for the next one to read ([`Subgraph::part_widths`]); on the
    /// host, in `st`'s intermediate tensors ([`PassState::part_inputs`]).
    mid: Loc,
    tokens: Arc<[u32]>,
    positions: Arc<[u32]>,
    logits: Option<Vec<Vec<f32>>>,
}

impl Chunk {
    fn new(st: PassState) -> Self {
        let tokens: Arc<[u32]> = st.tokens.clone().into();
        let positions: Arc<[u32]> = st.positions.iter().map(|&p| p as u32).collect();
        Self { st, x: Loc::Host, mid: Loc::Host, tokens, positions, logits: None }
    }

    /// Waits for the chunk's last device work (its first failure, if any).
    fn settle(&self) -> Result<(), BackendError> {
        for loc in [&self.x, &self.mid] {
            if let Loc::Dev(_, _, ev) = loc {
                ev.wait().map_err(dev_err)?;
            }
        }
        Ok(())
    }

    /// Brings the residual stream back to host memory if a device has it.
    fn x_home(&mut self, devs: &Devices) -> Result<(), BackendError> {
        if let Loc::Dev(i, buf, ev) = std::mem::replace(&mut self.x, Loc::Host) {
            let mut raw = vec![0u8; self.st.x.len() * 4];
            devs.list[i - 1].read(&buf, 0, &mut raw, std::slice::from_ref(&ev)).map_err(dev_err)?;
            self.st.x = bytes_f32(&raw);
        }
        Ok(())
    }

    /// Brings the last part's output home, into the tensors part `kind` reads.
    fn mid_home(&mut self, devs: &Devices, kind: SubgraphKind) -> Result<(), BackendError> {
        if let Loc::Dev(i, buf, ev) = std::mem::replace(&mut self.mid, Loc::Host) {
            let ins = self.st.part_inputs(kind);
            let mut raw = vec![0u8; ins.iter().map(|t| t.len() * 4).sum()];
            devs.list[i - 1].read(&buf, 0, &mut raw, std::slice::from_ref(&ev)).map_err(dev_err)?;
            let vals = bytes_f32(&raw);
            let mut at = 0;
            for t in ins {
                let len = t.len();
                t.copy_from_slice(&vals[at..at + len]);
                at += len;
            }
        }
        Ok(())
    }
}

/// The executor of one pass: every step of every chunk goes through [`Exec::step`], on the
/// host's blocks (their linear groups where the devices' splitter places them) or through the
/// device contract.
struct Exec<'a> {
    t: &'a Transformer,
    devs: &'a Devices,
    p: Pass<'a>,
    which: Logits,
    stop: Option<&'a (dyn Fn() -> bool + Sync)>,
}

impl<'a> Exec<'a> {
    fn new(
        t: &'a Transformer,
        devs: &'a Devices,
        linears: Option<&'a dyn Linears>,
        sparse: Option<&'a crate::backend::sparse::SparseAttn>,
        which: Logits,
        stop: Option<&'a (dyn Fn() -> bool + Sync)>,
    ) -> Self {
        Self { t, devs, p: Pass { c: &t.shape, planner: &t.planner, linears, sparse }, which, stop }
    }

    /// Runs step `sg` of chunk `ch` on `d` (0: the host), over `batch` (the chunk's sequences'
    /// caches, for a step that reads them; else empty).
    fn step(&self, ch: &mut Chunk, batch: &mut Batch, sg: Subgraph, d: usize) -> Result<(), BackendError> {
        if self.stop.is_some_and(|stop| stop()) {
            return Err(BackendError::Device(format!("stopped before {sg:?} of layer {}", sg.layer)));
        }
        if sg.uses_kv() && batch.len() != ch.st.spans.len() {
            return Err(BackendError::Device(format!("{sg:?} without its sequences' caches")));
        }
        if d == 0 {
            self.on_host(ch, batch, sg)
        } else {
            self.on_device(ch, batch, sg, d)
        }
    }

    fn on_host(&self, ch: &mut Chunk, batch: &mut Batch, sg: Subgraph) -> Result<(), BackendError> {
        let (p, w, l) = (&self.p, &self.t.weights, sg.layer);
        ch.x_home(self.devs)?;
        if sg.part_widths(&self.t.shape).0 > 0 {
            ch.mid_home(self.devs, sg.kind)?;
        }
        let layer = || {
            w.layers
                .get(l)
                .map(|x| x.blocks(w.rope_freqs.as_deref()))
                .ok_or_else(|| BackendError::Device(format!("{sg:?}: the model has no layer {l}")))
        };
        let st = &mut ch.st;
        if sg.uses_kv() {
            // A sequence whose layer is on a device (it decoded there) brings it back.
            for (kv, _) in batch.iter_mut() {
                kv.move_home(l)?;
            }
        }
        match sg.kind {
            SubgraphKind::Embed => p.embed(st, &w.token_embd)?,
            SubgraphKind::Attention => p.attention(st, batch, l, l, layer()?.0, None)?,
            SubgraphKind::Ffn => p.ffn(st, l, layer()?.1, None)?,
            SubgraphKind::Head => ch.logits = Some(p.head(st, &w.output_norm, &w.output, self.which)?),
            SubgraphKind::AttnQkv => p.attn_qkv(st, l, layer()?.0.qkv(), None)?,
            SubgraphKind::AttnCore => {
                Pass::prepare_append(st, batch, l);
                p.attn_core(st, batch, l, l, layer()?.0.rope_freqs)?
            }
            SubgraphKind::AttnOut => p.attn_out(st, l, layer()?.0.wo, None)?,
            SubgraphKind::FfnGateUp => {
                let f = layer()?.1;
                p.ffn_gate_up(st, l, (f.norm, f.gate, f.up), None)?
            }
            SubgraphKind::FfnDown => p.ffn_down(st, l, layer()?.1.down, None)?,
            // Projections are the pieces of a split, run by the splitter.
            SubgraphKind::Linear(_) | SubgraphKind::Group(_) => {
                return Err(BackendError::Device(format!("{sg:?} as a step of a pass")))
            }
        }
        ch.mid = Loc::Host;
        Ok(())
    }

    fn on_device(&self, ch: &mut Chunk, batch: &mut Batch, sg: Subgraph, d: usize) -> Result<(), BackendError> {
        let (t, devs) = (self.t, self.devs);
        let dev = &devs.list[d - 1];
        let n = ch.st.n;
        let exe = t.executable(devs, d, sg, n)?;
        // The residual stream onto device d (the embedding writes it there: no upload).
        let mut after = Vec::new();
        let mut x_on_host = false;
        let x = match std::mem::replace(&mut ch.x, Loc::Host) {
            Loc::Dev(i, buf, ev) if i == d => {
                after.push(ev);
                buf
            }
            other => {
                x_on_host = true;
                ch.x = other;
                ch.x_home(devs)?;
                let buf = dev.alloc(BufferUsage::Activations, n * t.shape.d_model * 4).map_err(dev_err)?;
                if sg.kind != SubgraphKind::Embed {
                    after.push(dev.write(&buf, 0, &f32_bytes(&ch.st.x), &[]).map_err(dev_err)?);
                }
                buf
            }
        };
        // The last part's output, for a part that reads it.
        let (hw, yw) = sg.part_widths(&t.shape);
        let h = if hw == 0 {
            None
        } else {
            Some(match std::mem::replace(&mut ch.mid, Loc::Host) {
                Loc::Dev(i, buf, ev) if i == d => {
                    after.push(ev);
                    buf
                }
                other => {
                    ch.mid = other;
                    ch.mid_home(devs, sg.kind)?;
                    let vals: Vec<f32> =
                        ch.st.part_inputs(sg.kind).into_iter().flat_map(|v| v.iter().copied()).collect();
                    let buf = dev.alloc(BufferUsage::Activations, vals.len() * 4).map_err(dev_err)?;
                    after.push(dev.write(&buf, 0, &f32_bytes(&vals), &[]).map_err(dev_err)?);
                    buf
                }
            })
        };
        let y = if yw == 0 { None } else { Some(dev.alloc(BufferUsage::Activations, n * yw * 4).map_err(dev_err)?) };
        let seqs = self.seq_bindings(ch, batch, sg, dev)?;
        // Only the head binds logit rows (every other step of a decode pass skips working them out).
        let (rows, counts) =
            if sg.kind == SubgraphKind::Head { Pass::logit_rows(&ch.st.spans, self.which) } else { Default::default() };
        let logit_buf = if sg.kind == SubgraphKind::Head {
            Some(dev.alloc(BufferUsage::Activations, rows.len() * t.shape.vocab * 4).map_err(dev_err)?)
        } else {
            None
        };
        let bind = Bindings {
            x: x.clone(),
            tokens: ch.tokens.clone(),
            positions: ch.positions.clone(),
            seqs: seqs.into(),
            logit_rows: rows.iter().map(|&r| r as u32).collect(),
            logits: logit_buf.clone(),
            y: y.clone(),
            h,
        };
        let ev = dev.submit(&exe, &bind, &after).map_err(dev_err)?;
        if let Some(lb) = logit_buf {
            let vocab = t.shape.vocab;
            let mut raw = vec![0u8; rows.len() * vocab * 4];
            dev.read(&lb, 0, &mut raw, std::slice::from_ref(&ev)).map_err(dev_err)?;
            let all = bytes_f32(&raw);
            let mut at = 0;
            ch.logits = Some(
                counts
                    .iter()
                    .map(|&c| {
                        let v = all[at * vocab..(at + c) * vocab].to_vec();
                        at += c;
                        v
                    })
                    .collect(),
            );
        }
        ch.mid = y.map_or(Loc::Host, |y| Loc::Dev(d, y, ev.clone()));
        // A step that only reads the residual stream leaves the host's copy current: it stays
        // there (no download for a host step after it).
        let writes_x = matches!(
            sg.kind,
            SubgraphKind::Embed
                | SubgraphKind::Attention
                | SubgraphKind::Ffn
                | SubgraphKind::AttnOut
                | SubgraphKind::FfnDown
        );
        ch.x = if x_on_host && !writes_x { Loc::Host } else { Loc::Dev(d, x, ev) };
        Ok(())
    }

    /// The chunk's sequences as `sg` on `dev` binds them, each with its cache of the layer on
    /// that device for a step that reads it (handed over, or grown, as needed).
    fn seq_bindings(
        &self,
        ch: &Chunk,
        batch: &mut Batch,
        sg: Subgraph,
        dev: &Arc<dyn llmd_device::Device>,
    ) -> Result<Vec<SeqBinding>, BackendError> {
        let shape = &self.t.shape;
        let mut seqs = Vec::with_capacity(ch.st.spans.len());
        for (i, &(offset, len, start)) in ch.st.spans.iter().enumerate() {
            let kv_buf = match batch.get_mut(i) {
                Some((kv, _)) if sg.uses_kv() => {
                    let here = kv.device_of_layer(sg.layer).is_some_and(|h| h.id() == dev.id());
                    let kv_dim = shape.kv_dim();
                    let held = kv.device_layer(sg.layer).map_or(0, |b| b.len / (4 * kv_dim.max(1)));
                    if !here || start + len > held {
                        // A device cache holds a power of two of positions (at least
                        // MIN_DEVICE_KV, at most the context), grown by doubling: a sequence
                        // does not take the whole context's memory from its first token.
                        let ctx = (start + len)
                            .max(MIN_DEVICE_KV)
                            .checked_next_power_of_two()
                            .unwrap_or(usize::MAX)
                            .min(shape.context_length);
                        if start > 0 || kv.device_layer(sg.layer).is_some() {
                            // Its positions so far are in host memory (a CPU prefill), on
                            // another device, or in a smaller buffer here: handed over once.
                            kv.move_to_device(sg.layer, dev, ctx)?;
                        } else {
                            let b = dev.alloc(BufferUsage::Kv, 2 * ctx * kv_dim * 2).map_err(dev_err)?;
                            kv.set_device_layer(sg.layer, Some(DeviceKv { dev: dev.clone(), buf: b }));
                        }
                    }
                    kv.device_layer(sg.layer).cloned()
                }
                _ => None,
            };
            seqs.push(SeqBinding { offset, len, start, kv: kv_buf });
        }
        Ok(seqs)
    }
}
