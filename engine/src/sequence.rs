//! A sequence: what the engine keeps of one conversation between passes — its KV cache, in host
//! memory and on whichever devices run its layers' attention (`Transformer::attach_devices`).
//! A caller (the daemon's session) holds the handle and asks it for its length, its size, a
//! truncation (a rolled-back turn, a reused prefix) or a spill to storage; the cache's layout
//! and its device buffers stay the engine's, and are freed when the handle is dropped.

use crate::error::BackendError;
use crate::model::kv::KvCache;
use crate::model::Transformer;

/// One conversation's state in the engine (see the module doc).
pub struct Sequence {
    kv: KvCache,
}

impl Sequence {
    /// Positions held (prompt and generated tokens fed so far).
    pub fn len(&self) -> usize {
        self.kv.len()
    }

    pub fn is_empty(&self) -> bool {
        self.kv.is_empty()
    }

    /// Bytes its cache takes, on the host and on devices.
    pub fn size_bytes(&self) -> usize {
        self.kv.size_bytes()
    }

    /// Keeps the first `len` positions (no-op if it holds fewer).
    pub fn truncate(&mut self, len: usize) {
        self.kv.truncate(len);
    }

    /// Drops every position and frees the memory.
    pub fn clear(&mut self) {
        self.kv.clear();
    }

    /// Writes the cache to `w` (the daemon spills idle sessions under memory pressure);
    /// [`Self::restore`] reads it back exactly. Layers held on a device come home first.
    pub fn spill(&mut self, w: &mut impl std::io::Write) -> std::io::Result<()> {
        self.kv.move_all_home().map_err(|e| std::io::Error::other(e.to_string()))?;
        self.kv.write_to(w)
    }

    /// A sequence of `t`'s model read back from what [`Self::spill`] wrote; an error if it is
    /// malformed or of another shape.
    pub fn restore(r: &mut impl std::io::Read, t: &Transformer) -> std::io::Result<Self> {
        KvCache::read_from(r, t.config.n_layers, t.config.kv_dim()).map(|kv| Self { kv })
    }

    /// The cache, for the engine's own passes.
    pub(crate) fn kv(&self) -> &KvCache {
        &self.kv
    }
}

impl Transformer {
    /// An empty sequence of this model (its cache of the model's `kv_type`).
    pub fn new_sequence(&self) -> Sequence {
        Sequence { kv: self.new_kv() }
    }

    /// [`Transformer::run`] over sequences: each runs its tokens after what it holds.
    pub fn run_sequences(
        &self,
        batch: &mut [(&mut Sequence, &[u32])],
        r: crate::model::Run<'_>,
    ) -> Result<Vec<Vec<f32>>, BackendError> {
        let mut kvs: Vec<(&mut KvCache, &[u32])> = batch.iter_mut().map(|(s, t)| (&mut s.kv, *t)).collect();
        self.run(&mut kvs, r)
    }
}
