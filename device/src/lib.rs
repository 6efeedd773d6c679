//! llmd's device contract: what a processor tells the engine about itself, and the calls the
//! engine makes on it. The engine and every backend (CPU, QNN and OpenCL) depend on
//! this crate; it names no model type — a model reaches a device only as [`Subgraph`]s with a
//! [`BlockShape`], weights as [`HostWeight`] bytes, and buffers.
//!
//! The shape of the contract follows what the anchors converged on:
//! - ggml-backend: a *device* describes itself and says which ops it supports; memory comes as
//!   *buffers* of a usage; a graph is computed asynchronously and ordered by *events*.
//! - candle: a device allocates its own storage and loads a quantized matrix into its own
//!   layout (`QMatMul`).
//! - crosvm's `hypervisor`: one trait per capability set, each backend in its own folder,
//!   capabilities as data the caller checks before it calls.
//!
//! What is ours: the unit of work is a transformer *subgraph* (the embedding, one layer's
//! attention or FFN block, the head) rather than single ops. An NPU compiles a static graph per
//! subgraph and shape ([`Device::prepare`]) — per-op calls would cost it a graph launch each —
//! and the engine's scheduler places, orders and (HeteroLLM) splits whole subgraphs.

mod desc;
mod dtype;
mod error;
mod event;
mod graph;
pub mod host;

pub use desc::{BufferUsage, DeviceDesc, MemoryDesc, MemoryKind, OpKind, Processor, StaticShapes};
pub use dtype::GgmlType;
pub use error::DeviceError;
pub use event::Event;
pub use graph::{BlockShape, GroupSite, RopeParams, RopeStyle, Subgraph, SubgraphKind, WeightRole};

use std::any::Any;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Identifies one device instance within the process (handles carry it, so a device can refuse
/// another's buffer).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DeviceId(u64);

impl DeviceId {
    /// A new id, never handed out before in this process.
    pub fn fresh() -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        Self(NEXT.fetch_add(1, Ordering::Relaxed))
    }
}

/// A device's handle: its id, and state only the device that made it can read (downcast).
#[derive(Clone)]
struct Handle {
    device: DeviceId,
    inner: Arc<dyn Any + Send + Sync>,
}

impl Handle {
    fn get<T: Any>(&self, device: DeviceId) -> Option<&T> {
        (self.device == device).then(|| self.inner.downcast_ref::<T>()).flatten()
    }
}

macro_rules! handle_type {
    ($(#[$doc:meta])* $name:ident { $($field:ident: $ty:ty),* }) => {
        $(#[$doc])*
        #[derive(Clone)]
        pub struct $name {
            h: Handle,
            $(pub $field: $ty),*
        }

        impl $name {
            /// Made by the device `device` around its own state `inner`.
            pub fn new(device: DeviceId, $($field: $ty,)* inner: Arc<dyn Any + Send + Sync>) -> Self {
                Self { h: Handle { device, inner }, $($field),* }
            }
            /// The device that made it.
            pub fn device(&self) -> DeviceId {
                self.h.device
            }
            /// The device's own state, if `device` made it and it is a `T`.
            pub fn get<T: Any>(&self, device: DeviceId) -> Option<&T> {
                self.h.get(device)
            }
        }

        impl std::fmt::Debug for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.debug_struct(stringify!($name)).field("device", &self.h.device) $(.field(stringify!($field), &self.$field))* .finish()
            }
        }
    };
}

handle_type!(
    /// Memory on a device, allocated for one usage.
    Buffer { usage: BufferUsage, len: usize }
);
handle_type!(
    /// A weight (or a range of its rows) loaded into a device's own layout.
    Weight { role: WeightRole, rows: Range<usize>, cols: usize, bytes: usize }
);
handle_type!(
    /// A subgraph prepared for one shape: a compiled static graph (NPU) or a plan (CPU, GPU).
    Executable { subgraph: Subgraph, n_tokens: usize }
);

/// A weight as the model file holds it: `rows` rows of `cols` elements of `ty`, row-major in
/// `data` (`rows · ty.row_bytes(cols)` bytes; for [`GgmlType::F32`] vectors such as norms,
/// one row). `data` may be empty when the host has the weight only in a layout of its own
/// (`host`): a device that cannot read that layout refuses the weight.
#[derive(Clone, Copy, Debug)]
pub struct HostWeight<'a> {
    pub role: WeightRole,
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    pub data: &'a [u8],
    /// The weight as the host keeps it in memory for its own kernels, which a device that
    /// shares the host's memory may use in place instead of a copy of `data` (so the weight
    /// is in memory once, not twice).
    pub host: Option<&'a HostCopy>,
}

/// Host bytes a device may keep using in place: they do not move or change while any clone of
/// the `Arc` lives (a mapped file, or a matrix packed once at load).
pub type SharedBytes = Arc<dyn AsRef<[u8]> + Send + Sync>;

/// How the bytes of a [`HostCopy`] are laid out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HostLayout {
    /// The model file's rows, as [`HostWeight::data`] (ggml's block layouts).
    Rows,
    /// The host CPU kernels' tiles of 16 rows: the engine's `backend::cpu::packed` layout
    /// (Q4_0, Q4_1, Q8_0) or `backend::cpu::kpacked` layout (Q2_K … Q6_K, its
    /// `RECORD_LAYOUT`), documented there; for devices built with the engine.
    CpuTiles,
}

/// A weight as the host keeps it (see [`HostWeight::host`]).
#[derive(Clone)]
pub struct HostCopy {
    pub layout: HostLayout,
    /// The type of the values in `bytes`: the weight's own, or the one the host converted it
    /// to at load (the CPU keeps Q5_0 and Q5_1 matrices as Q8_0 tiles).
    pub ty: GgmlType,
    /// Every row's bytes in `layout`, from `offset` on (bytes before it are there only so
    /// that a device can start a buffer on an aligned address: a file's rows shared from the
    /// page they start in).
    pub bytes: SharedBytes,
    pub offset: usize,
}

impl HostCopy {
    /// The weight's bytes (from `offset`).
    pub fn weight_bytes(&self) -> &[u8] {
        (*self.bytes).as_ref().get(self.offset..).unwrap_or_default()
    }
}

impl std::fmt::Debug for HostCopy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostCopy")
            .field("layout", &self.layout)
            .field("ty", &self.ty)
            .field("bytes", &(*self.bytes).as_ref().len())
            .field("offset", &self.offset)
            .finish()
    }
}

impl HostWeight<'_> {
    /// The bytes of rows `r`, checked against the shape.
    pub fn rows_bytes(&self, r: Range<usize>) -> Option<&[u8]> {
        let rb = self.ty.row_bytes(self.cols)?;
        if r.start > r.end || r.end > self.rows || self.data.len() != self.rows.checked_mul(rb)? {
            return None;
        }
        self.data.get(r.start * rb..r.end * rb)
    }
}

/// One sequence of a pass, as a subgraph's executable sees it.
#[derive(Clone, Debug)]
pub struct SeqBinding {
    /// Its first token's row in the pass's activations, and how many it has.
    pub offset: usize,
    pub len: usize,
    /// The position of its first token: the KV cache holds `start` positions before the pass.
    pub start: usize,
    /// Its KV cache for this subgraph's layer on this device (attention subgraphs), made by
    /// [`Device::alloc`] with [`BufferUsage::Kv`]. The executable writes the pass's keys and
    /// values at `start..start + len`, overwriting what a rolled-back turn left there.
    ///
    /// The buffer's layout, for [`Device::write`] and [`Device::read`] (the engine hands a
    /// cache that the CPU filled to the device that decodes, and takes it back): `2 · ctx ·
    /// kv_dim` f16 values, little-endian — the keys of positions `0..ctx`, `kv_dim` each,
    /// then the values at byte `ctx · kv_dim · 2`. A device that keeps its caches another way
    /// converts there, or refuses such writes and reads (the cache then stays where it is).
    pub kv: Option<Buffer>,
}

/// What one submission of an executable reads and writes.
#[derive(Clone, Debug)]
pub struct Bindings {
    /// The residual stream: `n_tokens × d_model` f32 ([`BufferUsage::Activations`]), read and
    /// written in place (the embedding writes it; the head reads it).
    pub x: Buffer,
    /// The pass's token ids (the embedding) and positions (attention), one per row of `x`.
    pub tokens: Arc<[u32]>,
    pub positions: Arc<[u32]>,
    pub seqs: Arc<[SeqBinding]>,
    /// The head: which rows of `x` get logits, and where they go (`rows × vocab` f32).
    pub logit_rows: Arc<[u32]>,
    pub logits: Option<Buffer>,
    /// A [`SubgraphKind::Linear`]'s output: `n_tokens` rows of its weight's loaded rows, f32;
    /// a [`SubgraphKind::Group`]'s: each projection's `n_tokens` rows, one after the other; a
    /// layer part's output ([`Subgraph::part_widths`]).
    pub y: Option<Buffer>,
    /// A layer part's input besides `x`: what the part before it wrote to its `y`
    /// ([`Subgraph::part_widths`]), f32. It is read only; it may not be the buffer of `x` or
    /// `y`.
    pub h: Option<Buffer>,
}

/// One executable for [`Device::prepare_all`] to prepare.
#[derive(Clone, Debug)]
pub struct Preparation {
    pub subgraph: Subgraph,
    pub n_tokens: usize,
    /// Its weights, as [`Device::prepare`] takes them.
    pub weights: Vec<Weight>,
}

/// An estimate of one subgraph's time on a device, from a cost model (seconds).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Cost {
    pub compute_s: f64,
    /// Moving its inputs in and its outputs out, when the device does not share host memory.
    pub transfer_s: f64,
}

impl Cost {
    pub fn total(&self) -> f64 {
        self.compute_s + self.transfer_s
    }
}

/// A processor the engine runs subgraphs on. Every call may fail with a [`DeviceError`]; none
/// may panic on the engine's input. Work is ordered by [`Event`]s: a call given `after` starts
/// once they have all signalled; the returned event signals when its own work is done. Memory
/// is owned by handles: a [`Buffer`], [`Weight`] or [`Executable`] is freed when its last clone
/// is dropped (a device keeps its state behind the handle's `Arc`).
pub trait Device: Send + Sync {
    fn id(&self) -> DeviceId;

    fn desc(&self) -> &DeviceDesc;

    /// Memory for one usage, `bytes` long.
    fn alloc(&self, usage: BufferUsage, bytes: usize) -> Result<Buffer, DeviceError>;

    /// Copies `src` into `dst` at `offset` (an upload, for a device with memory of its own).
    /// `src` is read before the call returns.
    fn write(&self, dst: &Buffer, offset: usize, src: &[u8], after: &[Event]) -> Result<Event, DeviceError>;

    /// Copies `dst.len()` bytes from `src` at `offset` into `dst` (a download); returns once
    /// they are there.
    fn read(&self, src: &Buffer, offset: usize, dst: &mut [u8], after: &[Event]) -> Result<(), DeviceError>;

    /// Loads rows `rows` of a weight into the device's own layout (all of them, or a range so
    /// that one matmul can be split across devices by rows).
    fn load_weight(&self, w: &HostWeight<'_>, rows: Range<usize>) -> Result<Weight, DeviceError>;

    /// Prepares `subgraph` of a model of `shape` for passes of `n_tokens` tokens, with its
    /// weights (those of [`Subgraph::weight_roles`], loaded by this device): an NPU compiles
    /// a static graph (only for the token counts of its [`DeviceDesc::static_shapes`]); a CPU
    /// or GPU plans.
    fn prepare(
        &self,
        subgraph: Subgraph,
        shape: &BlockShape,
        n_tokens: usize,
        weights: &[Weight],
    ) -> Result<Executable, DeviceError>;

    /// Prepares several executables of a model of `shape` at once, in `items`' order (each as
    /// [`Self::prepare`] would). A device that compiles graphs builds them together — an NPU in
    /// one context, which it keeps (and loads again) as one binary; by default, one by one.
    fn prepare_all(&self, shape: &BlockShape, items: &[Preparation]) -> Result<Vec<Executable>, DeviceError> {
        items.iter().map(|p| self.prepare(p.subgraph, shape, p.n_tokens, &p.weights)).collect()
    }

    /// The device's own estimate of `subgraph` at `n_tokens` (None: it has no figures). The
    /// engine's placement prices subgraphs with its `CostModel` (figures per device); this is
    /// for a model that asks the devices themselves (llm.npu's job times, `prefill_times`;
    /// HeteroLLM's solver; measured costs).
    fn estimate(&self, _subgraph: Subgraph, _shape: &BlockShape, _n_tokens: usize) -> Option<Cost> {
        None
    }

    /// Runs a prepared executable over `bind` once `after` have signalled.
    fn submit(&self, exe: &Executable, bind: &Bindings, after: &[Event]) -> Result<Event, DeviceError>;
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn host_weight_rows_are_checked_against_the_shape() {
        let data = vec![0u8; 3 * 18];
        let w = HostWeight { role: WeightRole::Wq, ty: GgmlType::Q4_0, rows: 3, cols: 32, data: &data, host: None };
        assert_eq!(w.rows_bytes(1..3).map(<[u8]>::len), Some(36));
        assert_eq!(w.rows_bytes(0..0).map(<[u8]>::len), Some(0));
        assert!(w.rows_bytes(2..4).is_none(), "past the last row");
        let bad = HostWeight { cols: 33, ..w };
        assert!(bad.rows_bytes(0..1).is_none(), "not a whole number of blocks");
        let short = HostWeight { data: &data[..20], ..w };
        assert!(short.rows_bytes(0..1).is_none(), "data shorter than the shape");
    }

    #[test]
    fn a_handle_opens_only_for_the_device_that_made_it() {
        let (a, b) = (DeviceId::fresh(), DeviceId::fresh());
        let buf = Buffer::new(a, BufferUsage::Kv, 8, Arc::new(7u32));
        assert_eq!(buf.get::<u32>(a), Some(&7));
        assert_eq!(buf.get::<u32>(b), None, "another device");
        assert_eq!(buf.get::<u64>(a), None, "another type");
        assert_eq!(buf.device(), a);
    }
}
