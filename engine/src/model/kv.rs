//! The KV cache of one sequence: f16 keys and values per layer, grown as tokens arrive.

use half::f16;

pub struct KvCache {
    kv_dim: usize,
    len: usize,
    k: Vec<Vec<f16>>,
    v: Vec<Vec<f16>>,
}

impl KvCache {
    pub fn new(n_layers: usize, kv_dim: usize) -> Self {
        Self { kv_dim, len: 0, k: vec![Vec::new(); n_layers], v: vec![Vec::new(); n_layers] }
    }

    /// Positions held.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes allocated for keys and values.
    pub fn size_bytes(&self) -> usize {
        self.k.iter().chain(&self.v).map(|x| x.capacity() * 2).sum()
    }

    /// Appends keys and values of new positions to layer `layer` (committed by [`Self::advance`]).
    pub(crate) fn append(&mut self, layer: usize, k: &[f32], v: &[f32]) {
        let keep = self.len * self.kv_dim;
        self.k[layer].truncate(keep);
        self.v[layer].truncate(keep);
        self.k[layer].extend(k.iter().map(|&x| f16::from_f32(x)));
        self.v[layer].extend(v.iter().map(|&x| f16::from_f32(x)));
    }

    pub(crate) fn layer(&self, layer: usize) -> (&[f16], &[f16]) {
        (&self.k[layer], &self.v[layer])
    }

    pub(crate) fn advance(&mut self, n: usize) {
        self.len += n;
    }

    /// Forgets every position after the first `len` (e.g. to rewind a cancelled turn) and
    /// returns the memory they held.
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
        let keep = self.len * self.kv_dim;
        for x in self.k.iter_mut().chain(self.v.iter_mut()) {
            x.truncate(keep);
            x.shrink_to_fit();
        }
    }

    /// Drops all positions and frees the memory.
    pub fn clear(&mut self) {
        self.len = 0;
        for x in self.k.iter_mut().chain(self.v.iter_mut()) {
            *x = Vec::new();
        }
    }
}
