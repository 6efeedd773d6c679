//! The executor's split matmuls: a projection the scheduler's [`Splitter`] divides between
//! devices runs as [`Part`]s — each device's rectangles of the one output buffer — through the
//! device contract: each part's row range loaded once per device ([`Device::load_weight`]), a
//! [`Subgraph::linear`] prepared once per (tokens, rows) (all of a static device's up front:
//! [`Transformer::prepare_splits`]), `write` → `submit` after the write → `read` after the
//! run. A part's executable and its input and output buffers are kept between passes on a
//! device with static shapes (a fixed set of graphs) and for passes of the splitter's planned
//! token counts; other passes' are made for their pass only (none are kept for a splitter that
//! plans no counts), so a long-lived plan keeps no buffers per prompt length it meets. No
//! thread is made: a device with a queue (the GPU) works while the caller submits to the next.
//!
//! **Decisions.** Parts on an NPU are submitted last: QNN executes in `submit`, on the caller's
//! thread, so the queued devices' parts are already running meanwhile. When both kinds took
//! part, the caller then waits for the rest by HeteroLLM's fast synchronisation (sleep the
//! operator's predicted remainder, then poll the events), and learns a time only from a wait
//! that found the others still busy (one that found them done knows an upper bound only). The
//! host (device 0) takes no part of a split: a split's CPU share runs on a `CpuDevice`.
//!
//! A linear group the splitter places whole on a device ([`crate::sched::Splitter::group`]:
//! llm.npu's W8A8 groups on the NPU) runs as one [`Subgraph::group`] there, on the weights the
//! device was given for it ([`Devices::hold`]): its input written, the group submitted, its
//! projections' outputs read back in turn.

use super::devices::{Devices, GroupBufs, PartKey, Slot};
use super::Transformer;
use crate::backend::blocks::{CaptureSite, Linears};
use crate::backend::weight::WeightMatrix;
use crate::backend::{bytes_f32, f32_bytes, OpDesc, OpKind};
use crate::error::BackendError;
use crate::hetero::plan::Projection;
use crate::hetero::sync::Polled;
use crate::sched::{views, Part};
use llmd_device::{
    Bindings, BlockShape, BufferUsage, Device, DeviceDesc, DeviceError, Event, HostWeight, Preparation, Processor,
    StaticShapes, Subgraph, Weight, WeightRole,
};
use std::collections::HashMap;
use std::ops::Range;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

/// Idle group buffer pairs kept across devices (`DevState::group_bufs`): a group takes the first
/// pair large enough, so a layer's four kinds need a few; the smallest go beyond this.
const MAX_IDLE_GROUP_BUFFERS: usize = 4;

// The contract's f32 buffers hold little-endian bytes; the executor moves f32 rows to and from
// them as the host's own bytes.
#[cfg(target_endian = "big")]
compile_error!("llmd's device buffers are little-endian: a big-endian host is not supported");

fn dev_err(d: &dyn Device, e: DeviceError) -> BackendError {
    BackendError::Device(format!("{}: {e}", d.desc().name))
}

/// The token count part `p` runs in on `dev`: its graph's on a device with static shapes, its
/// own elsewhere.
fn run_tokens(dev: &dyn Device, p: &Part) -> usize {
    match dev.desc().static_shapes {
        StaticShapes::Only(_) => p.graph.unwrap_or(p.tokens.len()).max(p.tokens.len()),
        StaticShapes::Any => p.tokens.len(),
    }
}

impl Devices {
    /// The place's device (index ≥ 1 in the placement's list).
    fn part_device(&self, d: usize) -> Result<&Arc<dyn Device>, BackendError> {
        d.checked_sub(1).and_then(|i| self.list.get(i)).ok_or_else(|| {
            BackendError::Device(format!(
                "a split part on device {d}: the host takes no part of a split, and there are {} devices",
                self.list.len()
            ))
        })
    }

    /// Rows `rows` of `w` (projection `role` of layer `layer`) on device `d`, loaded at first use.
    fn part_weight(
        &self,
        d: usize,
        (layer, role): (usize, WeightRole),
        w: &WeightMatrix,
        rows: &Range<usize>,
    ) -> Result<Weight, BackendError> {
        let key = (d, layer, role, rows.start, rows.end);
        if let Some(w) = self.lock_parts().weights.get(&key) {
            return Ok(w.clone());
        }
        let dev = self.part_device(d)?;
        let data = w.source_bytes().ok_or_else(|| BackendError::Device(format!("{}: rows not in memory", w.name)))?;
        let hw = HostWeight { role, ty: w.ty, rows: w.rows, cols: w.cols, data, host: None };
        let loaded = dev.load_weight(&hw, rows.clone()).map_err(|e| dev_err(&**dev, e))?;
        self.lock_parts().weights.insert(key, loaded.clone());
        Ok(loaded)
    }

    /// Whether a part on `dev` of a pass of `n` tokens keeps its executable and buffers after
    /// the pass (see the module).
    fn keeps(&self, dev: &dyn Device, n: usize) -> bool {
        matches!(dev.desc().static_shapes, StaticShapes::Only(_))
            || self.planned.as_ref().is_some_and(|c| c.contains(&n))
    }

    /// An idle slot for `key`, made (and its executable prepared) on first use; `keep`: the
    /// executable is kept for later passes.
    fn slot(&self, shape: &BlockShape, key: PartKey, w: &WeightMatrix, keep: bool) -> Result<Slot, BackendError> {
        if let Some(s) = self.lock_parts().slots.get_mut(&key).and_then(Vec::pop) {
            return Ok(s);
        }
        let (d, layer, role, m, r0, r1) = key;
        let dev = self.part_device(d)?;
        let e = |e| dev_err(&**dev, e);
        let known = self.lock_parts().exes.get(&key).cloned();
        let exe = match known {
            Some(x) => x,
            None => {
                let weight = self.part_weight(d, (layer, role), w, &(r0..r1))?;
                let exe = dev.prepare(Subgraph::linear(layer, role), shape, m, &[weight]).map_err(e)?;
                if keep {
                    self.lock_parts().exes.insert(key, exe.clone());
                }
                exe
            }
        };
        let x = dev.alloc(BufferUsage::Activations, m * w.cols * 4).map_err(e)?;
        let y = dev.alloc(BufferUsage::Activations, m * (r1 - r0) * 4).map_err(e)?;
        let zeros: Arc<[u32]> = vec![0u32; m].into();
        let bind = Bindings {
            x,
            tokens: zeros.clone(),
            positions: zeros,
            seqs: Arc::new([]),
            logit_rows: Arc::new([]),
            logits: None,
            y: Some(y.clone()),
            h: None,
        };
        Ok(Slot { key, exe, bind, y })
    }

    /// Gives slots back once their work is done (an error leaves later work queued: waited
    /// for); those of a pass of `n` tokens that [`Self::keeps`] nothing of are dropped.
    fn give_back(&self, work: Vec<(usize, Slot, Event)>, n: usize) {
        for (_, _, ev) in &work {
            let _ = ev.wait();
        }
        let keep: Vec<bool> =
            work.iter().map(|(_, s, _)| self.part_device(s.key.0).is_ok_and(|dev| self.keeps(&**dev, n))).collect();
        let mut st = self.lock_parts();
        for ((_, s, _), keep) in work.into_iter().zip(keep) {
            if keep {
                st.slots.entry(s.key).or_default().push(s);
            }
        }
    }

    /// Runs `parts` of projection `role` of layer `layer` (weight `w`, in a model of `shape`)
    /// over `n` rows of `x` into `out` (`n` × `w.rows`): see the module.
    #[allow(clippy::too_many_arguments)]
    pub fn run_parts(
        &self,
        shape: &BlockShape,
        (layer, role): (usize, WeightRole),
        w: &WeightMatrix,
        x: &[f32],
        n: usize,
        out: &mut [f32],
        parts: &[Part],
    ) -> Result<(), BackendError> {
        let k = w.cols;
        if x.len() != n * k || out.len() != n * w.rows {
            return Err(BackendError::Shape {
                op: "split matmul",
                detail: format!("{} inputs, {} outputs for {n} tokens of {}", x.len(), out.len(), w.name),
            });
        }
        // Empty parts compute nothing.
        let parts: Vec<Part> = parts.iter().filter(|p| !p.tokens.is_empty() && !p.rows.is_empty()).cloned().collect();
        let mut views =
            views(out, w.rows, &parts).map_err(|detail| BackendError::Shape { op: "split matmul", detail })?;
        let mut devs = Vec::with_capacity(parts.len());
        for p in &parts {
            devs.push(self.part_device(p.dev)?.clone());
        }
        // Queued devices first, the NPU (which runs in `submit`) last.
        let mut order: Vec<usize> = (0..parts.len()).collect();
        order.sort_by_key(|&i| devs[i].desc().processor == Processor::Npu);
        // Every part's slot first (a first use loads rows and prepares): the operator's time,
        // which the fast sync learns, starts at the first submission.
        let mut slots: Vec<(usize, Slot)> = Vec::with_capacity(parts.len());
        for &i in &order {
            let (p, dev) = (&parts[i], &devs[i]);
            let key = (p.dev, layer, role, run_tokens(&**dev, p), p.rows.start, p.rows.end);
            match self.slot(shape, key, w, self.keeps(&**dev, n)) {
                Ok(s) => slots.push((i, s)),
                Err(err) => {
                    self.give_back(slots.into_iter().map(|(i, s)| (i, s, Event::ready(Ok(())))).collect(), n);
                    return Err(err);
                }
            }
        }
        let submitted = Instant::now();
        let mut work: Vec<(usize, Slot, Event)> = Vec::with_capacity(parts.len());
        let mut slots = slots.into_iter();
        while let Some((i, slot)) = slots.next() {
            let (p, dev) = (&parts[i], &devs[i]);
            let m = slot.key.3;
            let mut bytes = f32_bytes(&x[p.tokens.start * k..p.tokens.end * k]);
            // A static graph's rows past the part's tokens: zeros.
            bytes.resize(m * k * 4, 0);
            let e = |e| dev_err(&**dev, e);
            let r = dev.write(&slot.bind.x, 0, &bytes, &[]).map_err(e).and_then(|wrote| {
                dev.submit(&slot.exe, &slot.bind, std::slice::from_ref(&wrote)).map_err(|e| dev_err(&**dev, e))
            });
            match r {
                Ok(ev) => work.push((i, slot, ev)),
                Err(err) => {
                    work.push((i, slot, Event::ready(Ok(()))));
                    work.extend(slots.map(|(i, s)| (i, s, Event::ready(Ok(())))));
                    self.give_back(work, n);
                    return Err(err);
                }
            }
        }
        let on_npu = |i: usize| devs[i].desc().processor == Processor::Npu;
        let mixed = (0..parts.len()).any(on_npu) && !(0..parts.len()).all(on_npu);
        if mixed {
            let done = || work.iter().all(|(_, _, ev)| ev.state().is_some());
            let busy = !done();
            // Every layer runs the same operators: one prediction per role and token count
            // (rounded up to a power of two, so a prompt's odd tails share their size's).
            let key = format!("{role:?}.{}", n.next_power_of_two());
            let (woke, polled) = self.sync.wait(&key, &Polled(&done), 1, submitted);
            if busy {
                self.sync.observe(&key, submitted.elapsed());
                // The wake's latency after the last producer finished (its event signalled by
                // the runtime's completion callback), when the waiter had to wait.
                if let Some(finished) = work.iter().filter_map(|(_, _, ev)| ev.signalled_at()).max() {
                    self.sync.record_wake(&key, finished, woke, polled);
                }
            }
        }
        let mut result = Ok(());
        let mut raw = Vec::new();
        for (i, slot, ev) in &work {
            let (p, dev) = (&parts[*i], &devs[*i]);
            raw.resize(p.tokens.len() * p.rows.len() * 4, 0u8);
            if let Err(e) = dev.read(&slot.y, 0, &mut raw, std::slice::from_ref(ev)) {
                result = Err(dev_err(&**dev, e));
                break;
            }
            let vals = bytes_f32(&raw);
            for (o, row) in views[*i].iter_mut().zip(vals.chunks_exact(p.rows.len())) {
                o.copy_from_slice(row);
            }
        }
        self.give_back(work, n);
        result?;
        let st = &self.stats;
        st.matmuls.fetch_add(1, Ordering::Relaxed);
        let mut used = Vec::new();
        for (p, dev) in parts.iter().zip(&devs) {
            let c = match dev.desc().processor {
                Processor::Npu => &st.npu_parts,
                Processor::Gpu => &st.gpu_parts,
                Processor::Cpu => &st.cpu_parts,
            };
            c.fetch_add(1, Ordering::Relaxed);
            if !used.contains(&p.dev) {
                used.push(p.dev);
            }
        }
        if used.len() > 1 {
            st.split_matmuls.fetch_add(1, Ordering::Relaxed);
        }
        Ok(())
    }
}

/// The host's projections of a pass, run as `devs`' splitter divides them (a projection it
/// leaves whole runs on the host's planner): what a placed pass runs its host subgraphs with
/// ([`Transformer::split_linears`]).
pub struct SplitLinears<'a> {
    t: &'a Transformer,
    devs: &'a Devices,
    descs: Vec<&'a DeviceDesc>,
    /// Asked before each group: true stops the pass there with an error (a withdrawn job).
    stop: Option<&'a (dyn Fn() -> bool + Sync)>,
}

impl Linears for SplitLinears<'_> {
    fn group(
        &self,
        li: usize,
        site: CaptureSite,
        x: &[f32],
        n: usize,
        outs: &mut [&mut [f32]],
    ) -> Result<bool, BackendError> {
        if self.stop.is_some_and(|stop| stop()) {
            return Err(BackendError::Device(format!("stopped before layer {li}'s {site:?} group")));
        }
        if let Some(d) = self.devs.splitter.group(li, site, n, &self.descs) {
            self.t.run_group(self.devs, d, (li, site), x, n, outs)?;
            return Ok(true);
        }
        let roles = site.roles();
        let Some(l) = self.t.weights.layers.get(li) else { return Ok(false) };
        if roles.len() != outs.len() {
            return Ok(false);
        }
        let mut plans = Vec::with_capacity(roles.len());
        for &role in roles {
            let Some(w) = l.matrix(role) else { return Ok(false) };
            // Checked where the run cuts its output (`views`).
            let parts = self.devs.splitter.split(li, role, w.rows, n, &self.descs).parts(n, w.rows);
            plans.push((role, w, parts));
        }
        if plans.iter().all(|p| p.2.is_none()) {
            return Ok(false);
        }
        for ((role, w, parts), out) in plans.into_iter().zip(outs.iter_mut()) {
            match parts {
                Some(p) => self.devs.run_parts(&self.t.shape, (li, role), w, x, n, out, &p)?,
                None => {
                    let op = OpDesc { kind: OpKind::MatMul, weight_type: Some(w.ty), n_tokens: n };
                    self.t.planner().place(&op)?.matmul(w, x, n, out)?
                }
            }
        }
        Ok(true)
    }
}

impl Transformer {
    /// Every projection of the model, for a splitter's plan.
    pub fn projections(&self) -> Vec<Projection> {
        let mut v = Vec::new();
        for (layer, l) in self.weights.layers.iter().enumerate() {
            for &role in CaptureSite::ALL.iter().flat_map(|s| s.roles()) {
                if let Some(w) = l.matrix(role) {
                    v.push(Projection { layer, role, name: w.name.clone(), rows: w.rows, cols: w.cols });
                }
            }
        }
        v
    }

    /// The host's projections run as `devs`' splitter divides them, for a pass over host
    /// caches (the daemon's prompt chunks and decode steps on HeteroLLM's plan).
    pub fn split_linears<'a>(&'a self, devs: &'a Devices) -> Result<SplitLinears<'a>, BackendError> {
        self.split_linears_until(devs, None)
    }

    /// [`Self::split_linears`] that, given `stop`, stops before the first group after it says so.
    pub fn split_linears_until<'a>(
        &'a self,
        devs: &'a Devices,
        stop: Option<&'a (dyn Fn() -> bool + Sync)>,
    ) -> Result<SplitLinears<'a>, BackendError> {
        Ok(SplitLinears { t: self, devs, descs: self.descs(devs)?, stop })
    }

    /// Linear group `site` of layer `li` over `n` rows of `x`, whole on device `d` (≥ 1), into
    /// `outs` (one per projection): through the contract, on the weights `d` holds for it.
    fn run_group(
        &self,
        devs: &Devices,
        d: usize,
        (li, site): (usize, CaptureSite),
        x: &[f32],
        n: usize,
        outs: &mut [&mut [f32]],
    ) -> Result<(), BackendError> {
        let sg = Subgraph::group(li, site);
        let dev = devs.part_device(d)?.clone();
        let Some(held) = devs.lock().weights.get(&(d, sg)).cloned() else {
            return Err(BackendError::Device(format!(
                "{}: holds no weights of layer {li}'s {site:?} group (the splitter placed it there)",
                dev.desc().name
            )));
        };
        // The group the device holds must be this pass's shape: its input width and each
        // projection's rows (a reused buffer is longer than a pass needs).
        let k = held.first().map_or(0, |w| w.cols);
        if x.len() != n * k
            || outs.len() != held.len()
            || outs.iter().zip(held.iter()).any(|(o, w)| o.len() != n * w.rows.len())
        {
            return Err(BackendError::Shape {
                op: "linear group",
                detail: format!(
                    "layer {li}'s {site:?} group on {} takes {k} inputs per row and {:?} outputs; given {} values for {n} rows and {:?}",
                    dev.desc().name,
                    held.iter().map(|w| w.rows.len()).collect::<Vec<_>>(),
                    x.len(),
                    outs.iter().map(|o| o.len()).collect::<Vec<_>>()
                ),
            });
        }
        // One executable per group, whatever the pass's count: it runs the rows it is bound to.
        let exe = self.executable(devs, d, sg, 0)?;
        let total: usize = outs.iter().map(|o| o.len()).sum();
        let e = |e| dev_err(&*dev, e);
        let idle = {
            let mut st = devs.lock();
            let fits = st.group_bufs.iter().position(|b| b.dev == d && b.x.len >= x.len() * 4 && b.y.len >= total * 4);
            fits.map(|i| st.group_bufs.swap_remove(i))
        };
        let bufs = match idle {
            Some(b) => b,
            None => GroupBufs {
                dev: d,
                x: dev.alloc(BufferUsage::Activations, x.len() * 4).map_err(e)?,
                y: dev.alloc(BufferUsage::Activations, total * 4).map_err(e)?,
            },
        };
        // The contract's f32 buffers are little-endian: the host's own bytes (every target).
        let wrote = dev.write(&bufs.x, 0, bytemuck::cast_slice(x), &[]).map_err(e)?;
        // One row of `x` per token (the group reads no ids or positions).
        let zeros: Arc<[u32]> = vec![0u32; n].into();
        let bind = Bindings {
            x: bufs.x.clone(),
            tokens: zeros.clone(),
            positions: zeros,
            seqs: Arc::from(Vec::new()),
            logit_rows: Arc::from(Vec::new()),
            logits: None,
            y: Some(bufs.y.clone()),
            h: None,
        };
        let ran = dev.submit(&exe, &bind, &[wrote]).map_err(e)?;
        let mut at = 0;
        for o in outs.iter_mut() {
            dev.read(&bufs.y, at * 4, bytemuck::cast_slice_mut(&mut o[..]), std::slice::from_ref(&ran)).map_err(e)?;
            at += o.len();
        }
        {
            // Kept for the next group (outside the residency budget: at most
            // MAX_IDLE_GROUP_BUFFERS pairs, each the size of the largest group pass seen).
            let mut st = devs.lock();
            st.group_bufs.push(bufs);
            if st.group_bufs.len() > MAX_IDLE_GROUP_BUFFERS {
                let b = &st.group_bufs;
                if let Some(i) = (0..b.len()).min_by_key(|&i| b[i].x.len + b[i].y.len) {
                    st.group_bufs.swap_remove(i);
                }
            }
        }
        devs.stats.groups.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// The host's description, then `devs`' (the placement's list).
    pub(super) fn descs<'a>(&'a self, devs: &'a Devices) -> Result<Vec<&'a DeviceDesc>, BackendError> {
        let host = self
            .planner()
            .backends()
            .next()
            .ok_or_else(|| BackendError::NoBackend("the planner has no host backend".into()))?;
        Ok(std::iter::once(host).chain(devs.list.iter().map(|d| d.desc())).collect())
    }

    /// Prepares, on every device of `devs` with static shapes, each part the splitter gives it
    /// at its planned token counts — all of a device's in one [`Device::prepare_all`] (an NPU
    /// builds them in one context, kept in its graph cache) — and lets the row ranges loaded
    /// for them go (the executables hold their own copy). Returns the executables prepared.
    /// Nothing to do for a splitter without planned counts.
    pub fn prepare_splits(&self, devs: &Devices) -> Result<usize, BackendError> {
        let Some(counts) = devs.planned.clone() else { return Ok(0) };
        let descs = self.descs(devs)?;
        let mut per_dev: HashMap<usize, Vec<PartKey>> = HashMap::new();
        for p in self.projections() {
            for &m in &counts {
                let parts =
                    devs.splitter.split(p.layer, p.role, p.rows, m, &descs).parts(m, p.rows).unwrap_or_default();
                crate::sched::check(m, p.rows, &parts).map_err(|detail| BackendError::Shape {
                    op: "split plan",
                    detail: format!("{}: {detail}", p.name),
                })?;
                for part in parts {
                    let dev = devs.part_device(part.dev)?;
                    if matches!(dev.desc().static_shapes, StaticShapes::Only(_)) {
                        let key =
                            (part.dev, p.layer, p.role, run_tokens(&**dev, &part), part.rows.start, part.rows.end);
                        let keys = per_dev.entry(part.dev).or_default();
                        if !keys.contains(&key) && !devs.lock_parts().exes.contains_key(&key) {
                            keys.push(key);
                        }
                    }
                }
            }
        }
        let mut prepared = 0;
        let mut ds: Vec<usize> = per_dev.keys().copied().collect();
        ds.sort_unstable();
        for d in ds {
            let keys = &per_dev[&d];
            let mut items = Vec::with_capacity(keys.len());
            for &(_, layer, role, m, r0, r1) in keys {
                let w = self.weights.layers.get(layer).and_then(|l| l.matrix(role)).ok_or_else(|| {
                    BackendError::Device(format!("the splitter names layer {layer}'s {role:?}, which the model lacks"))
                })?;
                let weight = devs.part_weight(d, (layer, role), w, &(r0..r1))?;
                items.push(Preparation { subgraph: Subgraph::linear(layer, role), n_tokens: m, weights: vec![weight] });
            }
            let dev = devs.part_device(d)?.clone();
            let exes = dev.prepare_all(&self.shape, &items).map_err(|e| dev_err(&*dev, e))?;
            drop(items);
            let mut st = devs.lock_parts();
            st.weights.retain(|k, _| k.0 != d);
            prepared += exes.len();
            st.exes.extend(keys.iter().copied().zip(exes));
        }
        Ok(prepared)
    }
}
