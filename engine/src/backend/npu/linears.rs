//! A model's W8A8 linear groups as finalized graphs of one QNN context ([`NpuLinears`]), run
//! chunk by chunk (a short last chunk padded with the input's zero point; its rows are
//! dropped), with llm.npu's shadow outlier execution beside the graph at the sites that have it
//! ([`ShadowSite`]). The groups come from [`crate::prefill`], which calibrates and quantizes a
//! model; [`super::QnnDevice`] runs them as the contract's `Group` subgraphs (`contract.rs`).

use super::device::NpuContext;
use super::graph::{build_linear_group, graph_name, run_linear_group, LinearGroup};
use super::shadow::{extract, ShadowWeights};
use crate::backend::blocks::CaptureSite;
use crate::backend::weight::WeightMatrix;
use crate::error::{BackendError, NpuError};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// A weight's rows as f32.
pub(crate) fn dequantize(m: &WeightMatrix) -> Result<Vec<f32>, NpuError> {
    let mut out = vec![0f32; m.rows * m.cols];
    for (r, o) in out.chunks_exact_mut(m.cols.max(1)).enumerate() {
        dequantize_row(m, r, o)?;
    }
    Ok(out)
}

/// Row `r` of a weight as f32.
pub(crate) fn dequantize_row(m: &WeightMatrix, r: usize, o: &mut [f32]) -> Result<(), NpuError> {
    if let Some(p) = &m.packed {
        p.dequantize_row(r, o);
    } else if let Some(row) = m.row(r) {
        crate::quant::dequantize_row(m.ty, row, o).map_err(|e| NpuError::Quantization(format!("{}: {e}", m.name)))?;
    } else {
        return Err(NpuError::Quantization(format!("{}: row {r} cannot be read for requantization", m.name)));
    }
    Ok(())
}

/// A group whose graph holds its weights: only its shapes and quantization stay on the host.
fn without_weights(mut g: LinearGroup) -> LinearGroup {
    for p in &mut g.projections {
        p.weights.q = Vec::new();
    }
    g
}

struct Built {
    group: LinearGroup,
    graph: Mutex<qnn_sys::api::Graph>,
    shadow: Option<Arc<ShadowSite>>,
}

/// Work run beside an NPU graph.
type BesideWork = Box<dyn FnOnce() + Send>;

/// The thread the shadow product runs on beside each NPU graph (llm.npu: the CPU works while
/// the NPU runs the graph): started at the first shadow site run and kept while the linears
/// live, so no thread is spawned per group (`crate::sched::threads_spawned`).
#[derive(Default)]
struct Beside {
    tx: Mutex<Option<std::sync::mpsc::Sender<BesideWork>>>,
}

impl Beside {
    /// Runs `f` on the thread (started if it is not), or here if it cannot start; its result
    /// comes on the receiver (none if `f` panicked).
    fn run<T: Send + 'static>(&self, f: impl FnOnce() -> T + Send + 'static) -> std::sync::mpsc::Receiver<T> {
        let (done, result) = std::sync::mpsc::channel();
        let work: BesideWork = Box::new(move || {
            let _ = done.send(f());
        });
        let mut tx = self.tx.lock().unwrap_or_else(|e| e.into_inner());
        if tx.is_none() {
            let (t, rx) = std::sync::mpsc::channel::<BesideWork>();
            let spawned = std::thread::Builder::new().name("llmd-shadow".into()).spawn(move || {
                // A panicking product drops its result's sender (its caller sees the error);
                // the thread goes on with the next.
                while let Ok(w) = rx.recv() {
                    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(w));
                }
            });
            if spawned.is_ok() {
                crate::sched::count_spawned(1);
                *tx = Some(t);
            }
        }
        let unsent = match tx.as_ref() {
            Some(t) => t.send(work).err().map(|e| e.0),
            None => Some(work),
        };
        if let Some(w) = unsent {
            // No thread (it could not start, or it is gone): here.
            *tx = None;
            w();
        }
        result
    }
}

/// Shadow outlier execution at one group: its int8 weights by input channel (hot in memory,
/// cold on storage) and the CPU's own weights of its projections, which recompute an output the
/// NPU saturated (the authors' code's output-side rule).
pub struct ShadowSite {
    pub weights: ShadowWeights,
    cpu: Vec<WeightMatrix>,
    recompute_saturated: bool,
}

impl ShadowSite {
    /// A site's shadow weights, the CPU's weights of its projections (in the group's order),
    /// and whether a saturated output is recomputed on them.
    pub fn new(weights: ShadowWeights, cpu: Vec<WeightMatrix>, recompute_saturated: bool) -> Self {
        Self { weights, cpu, recompute_saturated }
    }
}

/// Counters of shadow execution over a run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ShadowStats {
    /// Groups with shadow execution, of all groups.
    pub sites: usize,
    pub all_sites: usize,
    /// Chunks that ran a shadow group, and those that found outliers.
    pub chunks: u64,
    pub chunks_with_outliers: u64,
    pub outlier_elements: u64,
    pub outlier_channels: u64,
    pub saturated_outputs: u64,
    pub hot_rows_used: u64,
    pub cold_rows_read: u64,
    pub cold_bytes_read: u64,
    /// Shadow weight bytes in memory, and all of them (memory + storage).
    pub resident_bytes: u64,
    pub total_bytes: u64,
}

/// A model's linear groups as finalized graphs of one QNN context, for chunks of `chunk` rows.
pub struct NpuLinears {
    chunk: usize,
    layers: Vec<[Built; 4]>,
    executions: AtomicU64,
    modelled_ns: AtomicU64,
    shadow: Arc<ShadowCounters>,
    beside: Beside,
}

#[derive(Debug, Default)]
struct ShadowCounters {
    chunks: AtomicU64,
    chunks_with_outliers: AtomicU64,
    elements: AtomicU64,
    channels: AtomicU64,
    saturated: AtomicU64,
}

impl NpuLinears {
    /// Builds and finalizes every group's graph at `chunk` rows in `context` (its graphs give
    /// their modelled durations when the library is the emulator provider).
    pub fn build(context: &NpuContext, groups: Vec<[LinearGroup; 4]>, chunk: usize) -> Result<Self, NpuError> {
        let mut layers = Vec::with_capacity(groups.len());
        for layer in groups {
            let mut built = Vec::with_capacity(4);
            for group in layer {
                let graph = build_linear_group(context, &group, chunk)?;
                built.push(Built { group: without_weights(group), graph: Mutex::new(graph), shadow: None });
            }
            let built: [Built; 4] = match built.try_into() {
                Ok(b) => b,
                Err(_) => return Err(NpuError::Quantization("four groups per layer".into())),
            };
            layers.push(built);
        }
        Ok(Self::of_layers(layers, chunk))
    }

    fn of_layers(layers: Vec<[Built; 4]>, chunk: usize) -> Self {
        Self {
            chunk,
            layers,
            executions: AtomicU64::new(0),
            modelled_ns: AtomicU64::new(0),
            shadow: Arc::default(),
            beside: Beside::default(),
        }
    }

    /// Wraps graphs already in a context (`cache::graphs`), one per group in layer-major order.
    fn from_graphs(
        groups: Vec<[LinearGroup; 4]>,
        graphs: Vec<qnn_sys::api::Graph>,
        chunk: usize,
    ) -> Result<Self, NpuError> {
        if graphs.len() != groups.len() * 4 {
            return Err(NpuError::Quantization(format!("{} graphs for {} groups", graphs.len(), groups.len() * 4)));
        }
        let mut graphs = graphs.into_iter();
        let mut layers = Vec::with_capacity(groups.len());
        for layer in groups {
            let built: Vec<Built> = layer
                .into_iter()
                .filter_map(|group| {
                    graphs.next().map(|g| Built { group: without_weights(group), graph: Mutex::new(g), shadow: None })
                })
                .collect();
            match built.try_into() {
                Ok(b) => layers.push(b),
                Err(_) => return Err(NpuError::Quantization("four groups per layer".into())),
            }
        }
        // The host's int8 weights are gone into the graphs, and calibration's passes and the
        // context binary were freed before: give their pages back (the daemon's RSS with the
        // graphs ready: 250 MB with this, 361–369 MB without, 140 MB on the CPU alone; the
        // emulator holds the 106 MB of int8 weights).
        llmd_alloc_sys::release_free_memory();
        Ok(Self::of_layers(layers, chunk))
    }

    /// The graphs of `context` (from [`crate::prefill::prepare`]) for `groups` (flat, layer-major, as `prepare`
    /// returns them), by the tensor ids `ids`.
    pub fn from_context(
        context: &NpuContext,
        groups: Vec<LinearGroup>,
        ids: &[(u32, Vec<u32>)],
        chunk: usize,
    ) -> Result<Self, NpuError> {
        let graphs = crate::backend::npu::cache::graphs(context, &groups, chunk, ids)?;
        let mut layers = Vec::with_capacity(groups.len() / 4);
        let mut it = groups.into_iter();
        loop {
            let layer: Vec<LinearGroup> = it.by_ref().take(4).collect();
            if layer.is_empty() {
                break;
            }
            layers.push(layer.try_into().map_err(|_| NpuError::Quantization("four groups per layer".into()))?);
        }
        Self::from_graphs(layers, graphs, chunk)
    }

    /// The chunk size its graphs take.
    pub fn chunk(&self) -> usize {
        self.chunk
    }

    /// Turns on shadow outlier execution at the groups `sites` has one for (layer-major, one
    /// entry per group, as [`crate::prefill::prepare`] returns them).
    pub fn set_shadow(&mut self, sites: Vec<Option<ShadowSite>>) -> Result<(), NpuError> {
        if sites.len() != self.layers.len() * 4 {
            return Err(NpuError::Quantization(format!(
                "{} shadow entries for {} groups",
                sites.len(),
                self.layers.len() * 4
            )));
        }
        for (b, s) in self.layers.iter_mut().flat_map(|l| l.iter_mut()).zip(sites) {
            if let Some(s) = &s {
                if s.weights.k != b.group.k()
                    || s.weights.n() != b.group.projections.iter().map(|p| p.weights.rows).sum::<usize>()
                {
                    return Err(NpuError::Shape {
                        graph: b.group.name.clone(),
                        detail: "shadow weights of another shape".into(),
                    });
                }
            }
            b.shadow = s.map(Arc::new);
        }
        Ok(())
    }

    /// Shadow execution's counters so far.
    pub fn shadow_stats(&self) -> ShadowStats {
        let mut st = ShadowStats {
            all_sites: self.layers.len() * 4,
            chunks: self.shadow.chunks.load(Ordering::Relaxed),
            chunks_with_outliers: self.shadow.chunks_with_outliers.load(Ordering::Relaxed),
            outlier_elements: self.shadow.elements.load(Ordering::Relaxed),
            outlier_channels: self.shadow.channels.load(Ordering::Relaxed),
            saturated_outputs: self.shadow.saturated.load(Ordering::Relaxed),
            ..Default::default()
        };
        for s in self.layers.iter().flat_map(|l| l.iter()).filter_map(|b| b.shadow.as_ref()) {
            let c = &s.weights.counters;
            st.sites += 1;
            st.hot_rows_used += c.hot_rows_used.load(Ordering::Relaxed);
            st.cold_rows_read += c.cold_rows_read.load(Ordering::Relaxed);
            st.cold_bytes_read += c.cold_bytes_read.load(Ordering::Relaxed);
            st.resident_bytes += s.weights.resident_bytes() as u64;
            st.total_bytes += (s.weights.k * s.weights.n()) as u64;
        }
        st
    }

    /// Graph executions so far, and the modelled NPU time they add up to (nanoseconds; 0 on a
    /// library that runs for real and models nothing).
    pub fn stats(&self) -> (u64, u64) {
        (self.executions.load(Ordering::Relaxed), self.modelled_ns.load(Ordering::Relaxed))
    }

    /// The names of its graphs.
    pub fn graph_names(&self) -> Vec<String> {
        self.layers.iter().flat_map(|l| l.iter().map(|b| graph_name(&b.group, self.chunk))).collect()
    }
}

impl NpuLinears {
    /// The layers it has groups of.
    pub fn layers(&self) -> usize {
        self.layers.len()
    }

    /// Group `site` of layer `li`'s input width and each projection's output rows.
    pub fn group_shape(&self, li: usize, site: CaptureSite) -> Option<(usize, Vec<usize>)> {
        let g = &self.layers.get(li)?[site as usize].group;
        Some((g.k(), g.projections.iter().map(|p| p.weights.rows).collect()))
    }

    /// Runs group `site` of layer `li` over `n` rows of `x` into `outs` (one per projection,
    /// `n` rows each, f32), chunk by chunk, with shadow execution where the site has it.
    pub fn run(
        &self,
        li: usize,
        site: CaptureSite,
        x: &[f32],
        n: usize,
        outs: &mut [&mut [f32]],
    ) -> Result<(), BackendError> {
        let Some(b) = self.layers.get(li).map(|l| &l[site as usize]) else {
            return Err(BackendError::Shape { op: "npu linear group", detail: format!("no layer {li}") });
        };
        let g = &b.group;
        let (k, chunk) = (g.k(), self.chunk);
        if x.len() != n * k
            || outs.len() != g.projections.len()
            || outs.iter().zip(&g.projections).any(|(o, p)| o.len() != n * p.weights.rows)
        {
            return Err(BackendError::Shape {
                op: "npu linear group",
                detail: format!("{} values for {n} rows of {k}, or outputs not {n} rows each", x.len()),
            });
        }
        let zero = g.input.zero_point as u8;
        let mut xq = vec![zero; chunk * k];
        let mut start = 0;
        while start < n {
            let m = chunk.min(n - start);
            let xs = &x[start * k..(start + m) * k];
            g.input.quantize(xs, &mut xq[..m * k]);
            xq[m * k..].fill(zero);
            // The NPU's graph, and beside it on another thread the outliers' extraction and
            // product (llm.npu: the CPU works while the NPU runs the graph).
            let run_graph = || -> Result<Vec<Vec<u16>>, BackendError> {
                let mut graph = b.graph.lock().unwrap_or_else(|e| e.into_inner());
                let ys =
                    run_linear_group(&mut graph, g, chunk, &xq).map_err(|e| BackendError::Device(e.to_string()))?;
                if let Some((last, _)) = graph.modelled_ns() {
                    self.modelled_ns.fetch_add(last, Ordering::Relaxed);
                }
                Ok(ys)
            };
            let (ys, shadow) = match &b.shadow {
                Some(s) => {
                    let (site, counters, input, x) = (s.clone(), self.shadow.clone(), g.input, xs.to_vec());
                    let beside = self.beside.run(move || -> Result<Option<Vec<f32>>, BackendError> {
                        let o = extract(&x, k, &input);
                        counters.chunks.fetch_add(1, Ordering::Relaxed);
                        if o.elements == 0 {
                            return Ok(None);
                        }
                        counters.chunks_with_outliers.fetch_add(1, Ordering::Relaxed);
                        counters.elements.fetch_add(o.elements as u64, Ordering::Relaxed);
                        counters.channels.fetch_add(o.channels.len() as u64, Ordering::Relaxed);
                        site.weights.product(&o, 1).map(Some).map_err(|e| BackendError::Device(e.to_string()))
                    });
                    let ys = run_graph();
                    let prod = beside
                        .recv()
                        .unwrap_or_else(|_| Err(BackendError::Device("the shadow product panicked".into())));
                    (ys, prod.map(|p| Some((s, p))))
                }
                None => (run_graph(), Ok(None)),
            };
            let (ys, shadow) = (ys?, shadow?);
            self.executions.fetch_add(1, Ordering::Relaxed);
            let nt = shadow.as_ref().map_or(0, |(s, _)| s.weights.n());
            let mut col = 0;
            for (pi, ((p, y), out)) in g.projections.iter().zip(&ys).zip(outs.iter_mut()).enumerate() {
                let w = p.weights.rows;
                let out = &mut out[start * w..(start + m) * w];
                p.output.dequantize_codes(&y[..m * w], out);
                if let Some(gain) = &p.gain {
                    for row in out.chunks_exact_mut(w) {
                        for (v, g) in row.iter_mut().zip(gain) {
                            *v *= g;
                        }
                    }
                }
                if let Some((s, prod)) = &shadow {
                    let top = p.output.max_code() as u16;
                    let mut wrow = Vec::new();
                    for (r, row) in out.chunks_exact_mut(w).enumerate() {
                        for (o, v) in row.iter_mut().enumerate() {
                            let code = y[r * w + o];
                            // A code at either end, unless it is the zero point (an exact 0).
                            let extreme = (code == 0 || code == top) && i32::from(code) != p.output.zero_point;
                            if s.recompute_saturated && extreme {
                                // Saturated: the whole product in float, on the CPU's weights.
                                let cpu = &s.cpu[pi];
                                wrow.resize(cpu.cols, 0.0);
                                dequantize_row(cpu, o, &mut wrow).map_err(|e| BackendError::Device(e.to_string()))?;
                                *v = xs[r * k..(r + 1) * k].iter().zip(&wrow).map(|(a, b)| a * b).sum();
                                self.shadow.saturated.fetch_add(1, Ordering::Relaxed);
                            } else if let Some(prod) = prod {
                                *v += prod[r * nt + col + o];
                            }
                        }
                    }
                }
                col += w;
            }
            start += m;
        }
        Ok(())
    }
}
