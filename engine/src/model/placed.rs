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
use crate::backend::blocks::{Linears, Pass, PassState};
use crate::backend::{bytes_f32, f32_bytes};
use crate::error::BackendError;
use crate::sched::{self, Dag};
use llmd_device::{
    Bindings, Buffer, BufferUsage, DeviceDesc, DeviceError, Event, Executable, GgmlType, HostLayout, HostWeight,
    MemoryKind, SeqBinding, Subgraph, SubgraphKind, Weight, WeightRole,
};
use std::sync::Arc;

/// Positions of the smallest device KV cache (a sequence's buffer then doubles as it grows).
const MIN_DEVICE_KV: usize = 256;

fn dev_err(e: DeviceError) -> BackendError {
    BackendError::Device(e.to_string())
}

/// Where the residual stream is between two subgraphs.
enum Loc {
    Host,
    /// On device `i` (index into the placement's list, ≥ 1) in `buf`, ready when `ev` signals.
    Dev(usize, Buffer, Event),
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
            SubgraphKind::Group(site) => w
                .layers
                .get(sg.layer)
                .map_or_else(Vec::new, |l| site.roles().iter().filter_map(|&r| l.matrix(r).map(|m| (r, m))).collect()),
        }
    }

    /// The f32 vectors subgraph `sg` reads, by role.
    fn subgraph_vectors(&self, sg: Subgraph) -> Vec<(WeightRole, &[f32])> {
        let w = &self.weights;
        let mut v: Vec<(WeightRole, &[f32])> = Vec::new();
        match sg.kind {
            SubgraphKind::Embed => {}
            SubgraphKind::Head => v.push((WeightRole::OutputNorm, &w.output_norm)),
            SubgraphKind::Attention => {
                if let Some(l) = w.layers.get(sg.layer) {
                    v.push((WeightRole::AttnNorm, &l.attn_norm));
                    for (r, b) in [(WeightRole::Bq, &l.bq), (WeightRole::Bk, &l.bk), (WeightRole::Bv, &l.bv)] {
                        if let Some(b) = b {
                            v.push((r, b));
                        }
                    }
                }
                if let Some(f) = &w.rope_freqs {
                    v.push((WeightRole::RopeFreqs, f));
                }
            }
            SubgraphKind::Ffn => {
                if let Some(l) = w.layers.get(sg.layer) {
                    v.push((WeightRole::FfnNorm, &l.ffn_norm));
                }
            }
            SubgraphKind::Linear(_) | SubgraphKind::Group(_) => {}
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

    /// One pass over `batch` with its subgraphs placed across the host and `devs`; `stop`,
    /// when given, is asked before each of the host subgraphs' linear groups (a withdrawn job).
    pub(crate) fn forward_placed(
        &self,
        devs: &Devices,
        batch: &mut [(&mut KvCache, &[u32])],
        which: Logits,
        stop: Option<&(dyn Fn() -> bool + Sync)>,
    ) -> Result<Vec<Vec<f32>>, BackendError> {
        let descs: Vec<&DeviceDesc> = self.descs(devs)?;
        // The host's projections go through the splitter, where it divides any.
        // A stop flag is asked by the host's projections too, whatever the splitter.
        let splits =
            if devs.splitter.splits() || stop.is_some() { Some(self.split_linears_until(devs, stop)?) } else { None };
        let p = Pass { c: &self.shape, planner: &self.planner, linears: splits.as_ref().map(|s| s as &dyn Linears) };
        let w = &self.weights;
        let Some(mut st) = p.state(batch)? else {
            return Ok(vec![Vec::new(); batch.len()]);
        };
        let pass = Subgraph::pass(self.config.n_layers);
        // Placed by price alone: a sequence's KV cache of a layer follows that layer's
        // attention (handed to a device, or brought back, in the pass that needs it), so no
        // layer is pinned to where an earlier pass ran it. (Moving a cache is not priced: a
        // cost model that sends prompts to one device and decode steps to another — the GPU
        // decoding what the CPU read — moves each sequence's cache once per turn.)
        let no_homes = vec![None; self.config.n_layers];
        let placement =
            sched::place(&descs, &pass, &|sg| self.weight_types(sg), &self.shape, st.n, &no_homes, &*devs.cost)
                .map_err(|e| BackendError::NoBackend(e.to_string()))?;
        let d_bytes = st.n * self.shape.d_model * 4;
        let tokens: Arc<[u32]> = st.tokens.clone().into();
        let positions: Arc<[u32]> = st.positions.iter().map(|&p| p as u32).collect();
        let (rows, counts) = Pass::logit_rows(&st.spans, which);
        let mut loc = Loc::Host;
        let mut logits: Option<Vec<Vec<f32>>> = None;
        // The pass as one chunk of the job graph, each step on its device's processor, run one
        // job at a time in model order (every dependency is an earlier step).
        let procs: Vec<_> = placement.iter().map(|&d| descs[d].processor).collect();
        let dag = Dag::from_pass(&pass, &procs, 1);
        for job in dag.in_model_order() {
            let sg = pass[job.step];
            let d = placement[job.step];
            if d == 0 {
                to_host(devs, &mut loc, &mut st)?;
                match sg.kind {
                    SubgraphKind::Embed => p.embed(&mut st, &w.token_embd)?,
                    SubgraphKind::Attention => {
                        // A sequence whose layer is on a device (it decoded there) brings it back.
                        for (kv, _) in batch.iter_mut() {
                            kv.move_home(sg.layer)?;
                        }
                        let (a, _) = w.layers[sg.layer].blocks(w.rope_freqs.as_deref());
                        p.attention(&mut st, batch, sg.layer, sg.layer, a, None)?
                    }
                    SubgraphKind::Ffn => {
                        let (_, f) = w.layers[sg.layer].blocks(w.rope_freqs.as_deref());
                        p.ffn(&mut st, sg.layer, f, None)?
                    }
                    SubgraphKind::Head => logits = Some(p.head(&st, &w.output_norm, &w.output, which)?),
                    // A pass is made of whole blocks (`Subgraph::pass`); projections are the
                    // pieces of a split.
                    SubgraphKind::Linear(_) | SubgraphKind::Group(_) => {
                        return Err(BackendError::Device(format!("{sg:?} in a pass of whole blocks")))
                    }
                }
                continue;
            }
            let dev = &devs.list[d - 1];
            let exe = self.executable(devs, d, sg, st.n)?;
            // The residual stream onto device d (the embedding writes it there: no upload).
            let (x, after) = match std::mem::replace(&mut loc, Loc::Host) {
                Loc::Dev(i, buf, ev) if i == d => (buf, vec![ev]),
                other => {
                    loc = other;
                    to_host(devs, &mut loc, &mut st)?;
                    let buf = dev.alloc(BufferUsage::Activations, d_bytes).map_err(dev_err)?;
                    let ev = if sg.kind == SubgraphKind::Embed {
                        Event::ready(Ok(()))
                    } else {
                        dev.write(&buf, 0, &f32_bytes(&st.x), &[]).map_err(dev_err)?
                    };
                    (buf, vec![ev])
                }
            };
            let mut seqs = Vec::with_capacity(st.spans.len());
            for ((kv, _), &(offset, len, start)) in batch.iter_mut().zip(&st.spans) {
                let kv_buf = if sg.uses_kv() {
                    let here = kv.device_of_layer(sg.layer).is_some_and(|h| h.id() == dev.id());
                    let kv_dim = self.shape.kv_dim();
                    let held = kv.device_layer(sg.layer).map_or(0, |b| b.len / (4 * kv_dim.max(1)));
                    if !here || start + len > held {
                        // A device cache holds a power of two of positions (at least
                        // MIN_DEVICE_KV, at most the context), grown by doubling: a sequence
                        // does not take the whole context's memory from its first token.
                        let ctx = (start + len)
                            .max(MIN_DEVICE_KV)
                            .checked_next_power_of_two()
                            .unwrap_or(usize::MAX)
                            .min(self.shape.context_length);
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
                } else {
                    None
                };
                seqs.push(SeqBinding { offset, len, start, kv: kv_buf });
            }
            let logit_buf = if sg.kind == SubgraphKind::Head {
                Some(dev.alloc(BufferUsage::Activations, rows.len() * self.shape.vocab * 4).map_err(dev_err)?)
            } else {
                None
            };
            let bind = Bindings {
                x: x.clone(),
                tokens: tokens.clone(),
                positions: positions.clone(),
                seqs: seqs.into(),
                logit_rows: rows.iter().map(|&r| r as u32).collect(),
                logits: logit_buf.clone(),
                y: None,
            };
            let ev = dev.submit(&exe, &bind, &after).map_err(dev_err)?;
            if let Some(lb) = logit_buf {
                let mut raw = vec![0u8; rows.len() * self.shape.vocab * 4];
                dev.read(&lb, 0, &mut raw, std::slice::from_ref(&ev)).map_err(dev_err)?;
                let all = bytes_f32(&raw);
                let mut at = 0;
                logits = Some(
                    counts
                        .iter()
                        .map(|&c| {
                            let v = all[at * self.shape.vocab..(at + c) * self.shape.vocab].to_vec();
                            at += c;
                            v
                        })
                        .collect(),
                );
            }
            loc = Loc::Dev(d, x, ev);
        }
        if let Loc::Dev(_, _, ev) = &loc {
            ev.wait().map_err(dev_err)?;
        }
        for ((kv, _), &(_, len, _)) in batch.iter_mut().zip(&st.spans) {
            kv.advance(len);
        }
        logits.ok_or_else(|| BackendError::NoBackend("the pass had no head".into()))
    }
}

/// Brings the residual stream back to host memory if a device has it.
fn to_host(devs: &Devices, loc: &mut Loc, st: &mut PassState) -> Result<(), BackendError> {
    if let Loc::Dev(i, buf, ev) = std::mem::replace(loc, Loc::Host) {
        let mut raw = vec![0u8; st.x.len() * 4];
        devs.list[i - 1].read(&buf, 0, &mut raw, std::slice::from_ref(&ev)).map_err(dev_err)?;
        st.x = bytes_f32(&raw);
    }
    Ok(())
}
