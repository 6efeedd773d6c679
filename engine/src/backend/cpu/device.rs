//! The CPU as a device of the contract ([`llmd_device::Device`]): host memory, each subgraph run
//! by the host blocks on the CPU kernels ([`crate::backend::device_run`]), synchronously (the
//! event it returns has signalled). The engine's own passes run the same blocks on their own
//! buffers with no copy (the host needs none); this is the CPU seen through the contract — for a
//! placement that puts work on a CPU beside other devices, and the reference a new backend's
//! results are checked against. Its KV caches are f16 whatever the engine's `kv_type` (the
//! contract leaves a device's KV layout to it).

use super::CpuBackend;
use crate::backend::device_run::{run_subgraph, HostCopy, HostIo};
use crate::backend::kv::{KvCache, KvType};
use crate::backend::{Backend, Planner};
use llmd_device::{
    Bindings, BlockShape, Buffer, BufferUsage, Device, DeviceDesc, DeviceError, DeviceId, Event, Executable,
    HostWeight, Subgraph, Weight,
};
use std::ops::Range;
use std::sync::{Arc, Mutex, MutexGuard};

/// A buffer's memory: bytes, or (KV) one layer's cache of one sequence, made at its first
/// attention.
enum Mem {
    Bytes(Vec<u8>),
    Kv(Option<KvCache>),
}

type Cell = Mutex<Mem>;

struct Prepared {
    shape: BlockShape,
    weights: Vec<Arc<HostCopy>>,
}

pub struct CpuDevice {
    id: DeviceId,
    desc: DeviceDesc,
    planner: Planner,
}

impl CpuDevice {
    /// The CPU with `threads` worker threads (0 = one per core) of its own.
    pub fn new(threads: usize) -> Self {
        let cpu = CpuBackend::new(threads);
        let mut desc = cpu.descriptor().clone();
        desc.name = "cpu-device".into();
        Self { id: DeviceId::fresh(), desc, planner: Planner::new(vec![Arc::new(cpu)]) }
    }

    fn err(&self, detail: impl Into<String>) -> DeviceError {
        DeviceError::Invalid { device: self.desc.name.clone(), detail: detail.into() }
    }

    fn cell<'a>(&self, b: &'a Buffer) -> Result<&'a Cell, DeviceError> {
        b.get::<Cell>(self.id).ok_or_else(|| self.err("a buffer of another device"))
    }
}

fn lock(c: &Cell) -> MutexGuard<'_, Mem> {
    c.lock().unwrap_or_else(|e| e.into_inner())
}

impl Device for CpuDevice {
    fn id(&self) -> DeviceId {
        self.id
    }

    fn desc(&self) -> &DeviceDesc {
        &self.desc
    }

    fn alloc(&self, usage: BufferUsage, bytes: usize) -> Result<Buffer, DeviceError> {
        let mem = match usage {
            BufferUsage::Kv => Mem::Kv(None),
            _ => Mem::Bytes(llmd_device::host::zeroed(&self.desc.name, usage, bytes)?),
        };
        Ok(Buffer::new(self.id, usage, bytes, Arc::new(Mutex::new(mem))))
    }

    fn write(&self, dst: &Buffer, offset: usize, src: &[u8], after: &[Event]) -> Result<Event, DeviceError> {
        Event::wait_all(after)?;
        match &mut *lock(self.cell(dst)?) {
            Mem::Bytes(b) => {
                llmd_device::host::copy_in(&self.desc.name, b, offset, src)?;
                Ok(Event::ready(Ok(())))
            }
            Mem::Kv(_) => Err(self.err("a KV buffer is written by attention only")),
        }
    }

    fn read(&self, src: &Buffer, offset: usize, dst: &mut [u8], after: &[Event]) -> Result<(), DeviceError> {
        Event::wait_all(after)?;
        match &*lock(self.cell(src)?) {
            Mem::Bytes(b) => llmd_device::host::copy_out(&self.desc.name, b, offset, dst),
            Mem::Kv(_) => Err(self.err("a KV buffer is read by attention only")),
        }
    }

    fn load_weight(&self, w: &HostWeight<'_>, rows: Range<usize>) -> Result<Weight, DeviceError> {
        let copy = HostCopy::load(w, rows.clone()).ok_or_else(|| {
            self.err(format!("{:?}: {} bytes do not hold rows {rows:?} of its shape", w.role, w.data.len()))
        })?;
        let bytes = copy.size_bytes();
        Ok(Weight::new(self.id, w.role, rows, w.cols, bytes, Arc::new(Arc::new(copy))))
    }

    fn prepare(
        &self,
        sg: Subgraph,
        shape: &BlockShape,
        n: usize,
        weights: &[Weight],
    ) -> Result<Executable, DeviceError> {
        let roles = sg.weight_roles(shape);
        if weights.len() != roles.len() || weights.iter().zip(&roles).any(|(w, r)| w.role != *r) {
            return Err(self.err(format!("{sg:?} takes the weights {roles:?}")));
        }
        // A block (or a group) runs on whole weights; a row range is a linear subgraph's (a
        // split matmul's piece).
        let whole = !matches!(sg.kind, llmd_device::SubgraphKind::Linear(_));
        if let Some(w) = weights.iter().find(|w| whole && w.rows.start != 0) {
            return Err(self.err(format!("{sg:?}: {:?} holds rows {:?}, not all of them", w.role, w.rows)));
        }
        let copies = weights
            .iter()
            .map(|w| w.get::<Arc<HostCopy>>(self.id).cloned().ok_or_else(|| self.err("a weight of another device")))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Executable::new(self.id, sg, n, Arc::new(Prepared { shape: *shape, weights: copies })))
    }

    fn submit(&self, exe: &Executable, bind: &Bindings, after: &[Event]) -> Result<Event, DeviceError> {
        let p = exe.get::<Prepared>(self.id).ok_or_else(|| self.err("an executable of another device"))?;
        Event::wait_all(after)?;
        // A group runs the rows it is bound to (the contract's rule); the rest their count.
        let group = matches!(exe.subgraph.kind, llmd_device::SubgraphKind::Group(_));
        if !group && bind.positions.len() != exe.n_tokens {
            return Err(self.err(format!("prepared for {} tokens, {} bound", exe.n_tokens, bind.positions.len())));
        }
        let fail = |detail: String| DeviceError::Execution { device: self.desc.name.clone(), detail };
        // The residual stream, out of its buffer for the run (and back whatever happens).
        let x_cell = self.cell(&bind.x)?;
        let mut x: Vec<f32> = match &*lock(x_cell) {
            Mem::Bytes(b) => b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
            Mem::Kv(_) => return Err(self.err("x is a KV buffer")),
        };
        // The sequences' caches of this layer.
        let mut guards = Vec::new();
        if exe.subgraph.uses_kv() {
            let mut seen: Vec<*const Cell> = Vec::new();
            for s in bind.seqs.iter() {
                let b = s.kv.as_ref().ok_or_else(|| self.err("attention without a KV buffer"))?;
                let cell = self.cell(b)?;
                if seen.contains(&(cell as *const Cell)) {
                    return Err(self.err("one KV buffer bound to two sequences"));
                }
                seen.push(cell);
                guards.push(lock(cell));
            }
        }
        let mut caches: Vec<&mut KvCache> = Vec::with_capacity(guards.len());
        for g in guards.iter_mut() {
            match &mut **g {
                Mem::Kv(c) => caches.push(
                    c.get_or_insert_with(|| KvCache::with_type(1, p.shape.kv_dim(), p.shape.head_dim, KvType::F16)),
                ),
                Mem::Bytes(_) => return Err(self.err("a KV binding that is not a KV buffer")),
            }
        }
        let mut logits = vec![0f32; if bind.logits.is_some() { bind.logit_rows.len() * p.shape.vocab } else { 0 }];
        let weights: Vec<&HostCopy> = p.weights.iter().map(|w| &**w).collect();
        let mut y = match &bind.y {
            Some(b) => match &*lock(self.cell(b)?) {
                Mem::Bytes(b) => vec![0f32; b.len() / 4],
                Mem::Kv(_) => return Err(self.err("y is a KV buffer")),
            },
            None => Vec::new(),
        };
        let h: Vec<f32> = match &bind.h {
            Some(b) => match &*lock(self.cell(b)?) {
                Mem::Bytes(b) => b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
                Mem::Kv(_) => return Err(self.err("h is a KV buffer")),
            },
            None => Vec::new(),
        };
        let io = HostIo {
            tokens: &bind.tokens,
            positions: &bind.positions,
            seqs: &bind.seqs,
            x: &mut x,
            kv: &mut caches,
            logit_rows: &bind.logit_rows,
            logits: &mut logits,
            y: &mut y,
            h: &h,
        };
        run_subgraph(&self.planner, &p.shape, exe.subgraph, &weights, io).map_err(fail)?;
        if let Some(b) = &bind.y {
            if let Mem::Bytes(dst) = &mut *lock(self.cell(b)?) {
                for (d, v) in dst.chunks_exact_mut(4).zip(&y) {
                    d.copy_from_slice(&v.to_le_bytes());
                }
            }
        }
        drop(caches);
        drop(guards);
        // A projection only reads `x`: nothing to write back.
        let reads_only = matches!(exe.subgraph.kind, llmd_device::SubgraphKind::Linear(_)) || group;
        if let (false, Mem::Bytes(b)) = (reads_only, &mut *lock(x_cell)) {
            let src: Vec<u8> = x.iter().flat_map(|v| v.to_le_bytes()).collect();
            if b.len() == src.len() {
                b.copy_from_slice(&src);
            }
        }
        if let Some(l) = &bind.logits {
            match &mut *lock(self.cell(l)?) {
                Mem::Bytes(b) if b.len() == logits.len() * 4 => {
                    for (d, v) in b.chunks_exact_mut(4).zip(&logits) {
                        d.copy_from_slice(&v.to_le_bytes());
                    }
                }
                _ => return Err(self.err("the logits buffer does not fit the rows")),
            }
        }
        Ok(Event::ready(Ok(())))
    }
}
