//! The device contract, proven with a device of memory its own: `DiscreteTestDevice` keeps
//! weights, KV caches and activations in a store only it can read (the engine reaches it through
//! `write`/`read`, ordered by events), runs each submission on a thread of its own, and computes
//! with the host blocks over its own copies (weights re-packed from the bytes `load_weight`
//! hands it). A pass with some subgraphs on it and the rest on the CPU must give the CPU-alone
//! logits bit for bit, and every byte it used must have crossed the contract. The CPU device
//! (`backend::cpu::device::CpuDevice`, product code: host memory) is checked the same way.
//!
//! It is a test device, not product code: a GPU or NPU backend implements the same trait with
//! kernels of its own.

#![allow(clippy::unwrap_used)]

mod common;

use llmd_device::{
    Bindings, BlockShape, Buffer, BufferUsage, Device, DeviceDesc, DeviceError, DeviceId, Event, Executable, GgmlType,
    HostWeight, MemoryDesc, MemoryKind, OpKind, Processor, StaticShapes, Subgraph, SubgraphKind, Weight, WeightRole,
};
use llmd_engine::backend::blocks::Logits;
use llmd_engine::backend::cpu::device::CpuDevice;
use llmd_engine::backend::device_run::{run_subgraph, HostCopy, HostIo};
use llmd_engine::backend::Planner;
use llmd_engine::model::kv::{KvCache, KvType};
use llmd_engine::model::Devices;
use llmd_engine::sched::{Part, Pinned, Split};
use llmd_engine::{LoadOptions, Model};
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

#[derive(Default)]
struct Mem {
    next: u64,
    bufs: HashMap<u64, Vec<u8>>,
    /// A KV buffer's cache: one layer of one sequence, made at its first attention.
    kv: HashMap<u64, KvCache>,
    kv_ids: Vec<u64>,
    weights: HashMap<u64, HostCopy>,
}

struct Prepared {
    sg: Subgraph,
    shape: BlockShape,
    n: usize,
    weights: Vec<u64>,
}

#[derive(Default)]
struct Counts {
    submits: AtomicUsize,
    uploads: AtomicUsize,
    downloads: AtomicUsize,
    weights: AtomicUsize,
    kv_buffers: AtomicUsize,
}

struct DiscreteTestDevice {
    id: DeviceId,
    desc: DeviceDesc,
    mem: Arc<Mutex<Mem>>,
    planner: Planner,
    counts: Arc<Counts>,
}

fn err(detail: impl Into<String>) -> DeviceError {
    DeviceError::Invalid { device: "discrete-test".into(), detail: detail.into() }
}

impl DiscreteTestDevice {
    fn new() -> Self {
        Self {
            id: DeviceId::fresh(),
            desc: DeviceDesc {
                name: "discrete-test".into(),
                processor: Processor::Gpu,
                available: true,
                ops: vec![
                    OpKind::GetRows,
                    OpKind::MatMul,
                    OpKind::RmsNorm,
                    OpKind::Rope,
                    OpKind::Attention,
                    OpKind::SwiGlu,
                ],
                weight_types: GgmlType::ALL.to_vec(),
                static_shapes: StaticShapes::Any,
                memory: MemoryDesc { kind: MemoryKind::Dedicated, capacity: None },
                max_tokens: None,
                threads: 1,
            },
            mem: Arc::default(),
            planner: Planner::cpu(1),
            counts: Arc::default(),
        }
    }

    fn slot<T: Copy + 'static>(&self, h: Option<&T>) -> Result<T, DeviceError> {
        h.copied().ok_or_else(|| err("a handle of another device"))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Mem> {
        self.mem.lock().unwrap_or_else(|e| e.into_inner())
    }
}

fn bytes_f32(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

/// One submission, on the device's thread, with its memory locked: the engine's host blocks
/// (`run_subgraph`) over this device's own copies.
fn run(mem: &mut Mem, planner: &Planner, p: &Prepared, b: &Bindings, id: DeviceId) -> Result<(), String> {
    let Mem { bufs, kv, weights, .. } = mem;
    if b.positions.len() != p.n {
        return Err(format!("prepared for {} tokens, bound {}", p.n, b.positions.len()));
    }
    let x_id = *b.x.get::<u64>(id).ok_or("x is not this device's")?;
    let mut x = bytes_f32(bufs.get(&x_id).ok_or("x was freed")?);
    let ws = p.weights.iter().map(|w| weights.get(w).ok_or("a weight was freed")).collect::<Result<Vec<_>, _>>()?;
    // Each sequence's cache of this layer, taken out of the device's memory for the run.
    let mut caches = Vec::new();
    if p.sg.uses_kv() {
        for s in b.seqs.iter() {
            let kid = *s.kv.as_ref().and_then(|k| k.get::<u64>(id)).ok_or("no KV buffer of this device")?;
            let c = kv
                .remove(&kid)
                .unwrap_or_else(|| KvCache::with_type(1, p.shape.kv_dim(), p.shape.head_dim, KvType::F16));
            caches.push((kid, c));
        }
    }
    let mut logits = vec![0f32; if b.logits.is_some() { b.logit_rows.len() * p.shape.vocab } else { 0 }];
    let y_id = b.y.as_ref().map(|y| y.get::<u64>(id).copied().ok_or("y of another device")).transpose()?;
    let mut y = match y_id {
        Some(i) => vec![0f32; bufs.get(&i).ok_or("y was freed")?.len() / 4],
        None => Vec::new(),
    };
    let h = match &b.h {
        Some(h) => bytes_f32(bufs.get(h.get::<u64>(id).ok_or("h of another device")?).ok_or("h was freed")?),
        None => Vec::new(),
    };
    let r = {
        let mut refs: Vec<&mut KvCache> = caches.iter_mut().map(|(_, c)| c).collect();
        let io = HostIo {
            tokens: &b.tokens,
            positions: &b.positions,
            seqs: &b.seqs,
            x: &mut x,
            kv: &mut refs,
            logit_rows: &b.logit_rows,
            logits: &mut logits,
            y: &mut y,
            h: &h,
        };
        run_subgraph(planner, &p.shape, p.sg, &ws, io)
    };
    for (kid, c) in caches {
        kv.insert(kid, c);
    }
    r?;
    bufs.insert(x_id, x.iter().flat_map(|v| v.to_le_bytes()).collect());
    if let Some(l) = &b.logits {
        let lid = *l.get::<u64>(id).ok_or("logits of another device")?;
        bufs.insert(lid, logits.iter().flat_map(|v| v.to_le_bytes()).collect());
    }
    if let Some(i) = y_id {
        bufs.insert(i, y.iter().flat_map(|v| v.to_le_bytes()).collect());
    }
    Ok(())
}

impl Device for DiscreteTestDevice {
    fn id(&self) -> DeviceId {
        self.id
    }

    fn desc(&self) -> &DeviceDesc {
        &self.desc
    }

    fn alloc(&self, usage: BufferUsage, bytes: usize) -> Result<Buffer, DeviceError> {
        let mut m = self.lock();
        m.next += 1;
        let id = m.next;
        if usage == BufferUsage::Kv {
            m.kv_ids.push(id);
            self.counts.kv_buffers.fetch_add(1, Ordering::Relaxed);
        } else {
            m.bufs.insert(id, vec![0; bytes]);
        }
        Ok(Buffer::new(self.id, usage, bytes, Arc::new(id)))
    }

    fn write(&self, dst: &Buffer, offset: usize, src: &[u8], after: &[Event]) -> Result<Event, DeviceError> {
        Event::wait_all(after)?;
        let id = self.slot(dst.get::<u64>(self.id))?;
        let mut m = self.lock();
        let b = m.bufs.get_mut(&id).ok_or_else(|| err("no such buffer"))?;
        let end = offset.checked_add(src.len()).filter(|&e| e <= b.len()).ok_or_else(|| err("write past the end"))?;
        b[offset..end].copy_from_slice(src);
        self.counts.uploads.fetch_add(1, Ordering::Relaxed);
        Ok(Event::ready(Ok(())))
    }

    fn read(&self, src: &Buffer, offset: usize, dst: &mut [u8], after: &[Event]) -> Result<(), DeviceError> {
        Event::wait_all(after)?;
        let id = self.slot(src.get::<u64>(self.id))?;
        let m = self.lock();
        let b = m.bufs.get(&id).ok_or_else(|| err("no such buffer"))?;
        let end = offset.checked_add(dst.len()).filter(|&e| e <= b.len()).ok_or_else(|| err("read past the end"))?;
        dst.copy_from_slice(&b[offset..end]);
        self.counts.downloads.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    fn load_weight(&self, w: &HostWeight<'_>, rows: std::ops::Range<usize>) -> Result<Weight, DeviceError> {
        let copy = HostCopy::load(w, rows.clone()).ok_or_else(|| err(format!("{:?}: bad rows {rows:?}", w.role)))?;
        let bytes = copy.size_bytes();
        let mut m = self.lock();
        m.next += 1;
        let id = m.next;
        m.weights.insert(id, copy);
        self.counts.weights.fetch_add(1, Ordering::Relaxed);
        Ok(Weight::new(self.id, w.role, rows, w.cols, bytes, Arc::new(id)))
    }

    fn prepare(
        &self,
        sg: Subgraph,
        shape: &BlockShape,
        n: usize,
        weights: &[Weight],
    ) -> Result<Executable, DeviceError> {
        if weights.len() != sg.weight_roles(shape).len()
            || weights.iter().zip(sg.weight_roles(shape)).any(|(w, r)| w.role != r)
        {
            return Err(err(format!("{sg:?} was given the wrong weights")));
        }
        let ids = weights.iter().map(|w| self.slot(w.get::<u64>(self.id))).collect::<Result<Vec<_>, _>>()?;
        let p = Prepared { sg, shape: *shape, n, weights: ids };
        Ok(Executable::new(self.id, sg, n, Arc::new(p)))
    }

    fn submit(&self, exe: &Executable, bind: &Bindings, after: &[Event]) -> Result<Event, DeviceError> {
        if exe.get::<Prepared>(self.id).is_none() {
            return Err(err("an executable of another device"));
        }
        self.counts.submits.fetch_add(1, Ordering::Relaxed);
        let (exe, bind, after) = (exe.clone(), bind.clone(), after.to_vec());
        let (mem, planner, id) = (self.mem.clone(), self.planner.clone(), self.id);
        let done = Event::new();
        let signal = done.clone();
        // The device's own queue: the work runs later, on another thread, once `after` signal.
        std::thread::spawn(move || {
            let r = Event::wait_all(&after).and_then(|()| {
                let p = exe.get::<Prepared>(id).ok_or_else(|| err("lost its plan"))?;
                let mut m = mem.lock().unwrap_or_else(|e| e.into_inner());
                run(&mut m, &planner, p, &bind, id)
                    .map_err(|detail| DeviceError::Execution { device: "discrete-test".into(), detail })
            });
            signal.signal(r);
        });
        Ok(done)
    }
}

fn load() -> Model {
    Model::load(&common::default_model_path(), &LoadOptions { threads: 2, ..Default::default() })
        .expect("the default model loads")
}

/// Logits of a prompt chunk, then of `steps` greedy decode steps, for each of `prompts` in one
/// batch per pass.
fn run_batch(m: &Model, prompts: &[Vec<u32>], steps: usize) -> Vec<Vec<Vec<f32>>> {
    let t = &m.transformer;
    let mut caches: Vec<KvCache> = prompts.iter().map(|_| t.new_kv()).collect();
    let mut feed: Vec<Vec<u32>> = prompts.to_vec();
    let mut out = vec![Vec::new(); prompts.len()];
    for _ in 0..=steps {
        let mut batch: Vec<(&mut KvCache, &[u32])> = caches.iter_mut().zip(&feed).map(|(c, f)| (c, &f[..])).collect();
        let logits = t.run(&mut batch, llmd_engine::model::Run::LAST).expect("the pass runs");
        for (i, l) in logits.into_iter().enumerate() {
            let next = llmd_engine::sampling::argmax(&l);
            out[i].push(l);
            feed[i] = vec![next];
        }
    }
    out
}

#[test]
fn subgraphs_on_a_device_with_its_own_memory_give_the_cpu_alone_logits() {
    let mut m = load();
    let enc = |s: &str| m.tokenizer.encode(s, false, false).expect("encodes");
    let prompts = vec![enc("The capital of France is"), enc("Write a haiku about the sea, please.")];
    let steps = 4;
    let cpu = run_batch(&m, &prompts, steps);
    let cpu_one = run_batch(&m, &prompts[..1], steps);

    let dev = Arc::new(DiscreteTestDevice::new());
    let counts = dev.counts.clone();
    let mem = dev.mem.clone();
    let on_device = |sg: Subgraph| match sg.kind {
        SubgraphKind::Embed | SubgraphKind::Head => true,
        SubgraphKind::Attention => sg.layer == 1 || sg.layer == 4,
        SubgraphKind::Ffn => sg.layer == 1 || sg.layer == 7,
        _ => false,
    };
    let pick = move |sg: Subgraph| usize::from(on_device(sg));
    let names = vec!["cpu".to_string(), "discrete-test".to_string()];
    m.transformer.attach_devices(vec![dev], Arc::new(Pinned { names, pick }));
    let mixed = run_batch(&m, &prompts, steps);
    let mixed_one = run_batch(&m, &prompts[..1], steps);

    for (a, b) in [(&cpu, &mixed), (&cpu_one, &mixed_one)] {
        for (seq, (x, y)) in a.iter().zip(b.iter()).enumerate() {
            for (step, (u, v)) in x.iter().zip(y.iter()).enumerate() {
                assert_eq!(u.len(), v.len());
                let same = u.iter().zip(v).all(|(p, q)| p.to_bits() == q.to_bits());
                assert!(same, "sequence {seq}, step {step}: logits differ from the CPU alone");
            }
        }
    }
    // Everything the device used crossed the contract.
    let passes = 2 * (steps + 1);
    assert_eq!(counts.submits.load(Ordering::Relaxed), passes * 6, "embed, head, 2 attention, 2 FFN per pass");
    // Weights loaded once: embed 1, head 1 (its norm; the output head is the embedding's bytes,
    // tied, loaded once), attention 5 each, FFN 4 each.
    assert_eq!(counts.weights.load(Ordering::Relaxed), 1 + 1 + 2 * 5 + 2 * 4);
    // KV of layers 1 and 4 on the device: one buffer per sequence and layer (3 caches made).
    assert_eq!(counts.kv_buffers.load(Ordering::Relaxed), 3 * 2);
    assert!(
        counts.uploads.load(Ordering::Relaxed) >= passes * 3,
        "the stream goes up before attention 1, FFN 7, the head"
    );
    assert!(counts.downloads.load(Ordering::Relaxed) >= passes * 3);
    let held = mem.lock().unwrap().kv.len();
    assert_eq!(held, 6, "the device holds those caches");
}

#[test]
fn a_device_without_a_graph_for_the_shape_leaves_the_subgraph_to_the_cpu() {
    let mut m = load();
    let mut dev = DiscreteTestDevice::new();
    dev.desc.static_shapes = StaticShapes::Only(vec![32]);
    let counts = dev.counts.clone();
    // Pin the FFN of layer 0 to a device that has no graph for this shape.
    let pick = |sg: Subgraph| usize::from(sg == Subgraph::ffn(0));
    let names = vec!["cpu".to_string(), "discrete-test".to_string()];
    m.transformer.attach_devices(vec![Arc::new(dev)], Arc::new(Pinned { names, pick }));
    let mut kv = m.transformer.new_kv();
    // The CPU has no price under the pin, the device has no graph for 3 tokens: the CPU runs it.
    let r = m.transformer.forward(&mut kv, &[1, 2, 3], Logits::Last);
    assert!(r.is_ok(), "{r:?}");
    assert_eq!(counts.submits.load(Ordering::Relaxed), 0, "the device ran a shape it has no graph for");
    assert_eq!(counts.weights.load(Ordering::Relaxed), 0, "weights loaded for a subgraph it never runs");
    m.transformer.attach_devices(Vec::new(), Arc::new(llmd_engine::sched::Roofline::default()));
    let mut kv2 = m.transformer.new_kv();
    let cpu = m.transformer.forward(&mut kv2, &[1, 2, 3], Logits::Last).unwrap();
    assert_eq!(r.unwrap(), cpu, "an unpriced host run equals the host alone");
}

#[test]
fn the_cpu_device_behind_the_contract_gives_the_host_logits() {
    let mut m = load();
    let enc = |s: &str| m.tokenizer.encode(s, false, false).expect("encodes");
    let prompts = vec![enc("Once upon a time"), enc("1, 2, 3, 4,")];
    let host = run_batch(&m, &prompts, 3);
    // Every subgraph but the odd layers' FFNs on the CPU device (the embedding and head too).
    let pick = |sg: Subgraph| usize::from(sg.kind != SubgraphKind::Ffn || sg.layer.is_multiple_of(2));
    let names = vec!["cpu".to_string(), "cpu-device".to_string()];
    m.transformer.attach_devices(vec![Arc::new(CpuDevice::new(2))], Arc::new(Pinned { names, pick }));
    let placed = run_batch(&m, &prompts, 3);
    for (x, y) in host.iter().zip(&placed) {
        for (step, (u, v)) in x.iter().zip(y).enumerate() {
            assert!(u.iter().zip(v).all(|(p, q)| p.to_bits() == q.to_bits()), "step {step} differs");
        }
    }
}

/// Every projection split between two CPU devices, a different way per layer: by rows, by
/// tokens, and a hybrid (the first half of the tokens cut by rows, the rest on one device).
struct EveryWay;

impl llmd_engine::sched::Splitter for EveryWay {
    fn split(&self, layer: usize, _: WeightRole, rows: usize, n: usize, _: &[&llmd_device::DeviceDesc]) -> Split {
        let (r, t) = (rows / 2, n / 2);
        match layer % 3 {
            0 => Split::Rows(vec![(1, 0..r), (2, r..rows)]),
            1 => Split::Tokens(vec![(1, 0..t), (2, t..n)]),
            _ => Split::Hybrid(vec![
                Part { dev: 2, tokens: 0..t, rows: 0..r, graph: None },
                Part { dev: 1, tokens: 0..t, rows: r..rows, graph: None },
                Part { dev: 1, tokens: t..n, rows: 0..rows, graph: None },
            ]),
        }
    }
}

#[test]
fn projections_split_by_the_executor_across_two_cpu_devices_give_the_host_logits() {
    let mut m = load();
    let enc = |s: &str| m.tokenizer.encode(s, false, false).expect("encodes");
    let prompts = vec![enc("The quick brown fox jumps over"), enc("Rust is a language")];
    let host = run_batch(&m, &prompts, 3);
    // Every block on the host; every projection's parts on the two CPU devices.
    let names = vec!["cpu".to_string()];
    let devs = Devices::new(
        vec![Arc::new(CpuDevice::new(2)), Arc::new(CpuDevice::new(1))],
        Arc::new(Pinned { names, pick: |_| 0 }),
    )
    .with_splitter(Arc::new(EveryWay));
    m.transformer.attach(devs);
    let placed = run_batch(&m, &prompts, 3);
    let st = &m.transformer.devices().expect("attached").stats;
    let (runs, split, parts) = (
        st.matmuls.load(Ordering::Relaxed),
        st.split_matmuls.load(Ordering::Relaxed),
        st.cpu_parts.load(Ordering::Relaxed),
    );
    eprintln!("{runs} projections run split, {split} across both devices, {parts} parts");
    // 30 layers × 7 projections × 4 passes, each across both devices (two sequences per pass:
    // even a decode step's token split gives each device one).
    assert_eq!(runs, 30 * 7 * 4);
    assert!(split == runs && parts > 2 * runs, "{split} {parts}");
    for (x, y) in host.iter().zip(&placed) {
        for (step, (u, v)) in x.iter().zip(y).enumerate() {
            assert!(u.iter().zip(v).all(|(p, q)| p.to_bits() == q.to_bits()), "step {step} differs");
        }
    }
}

#[test]
fn caches_never_move_between_the_host_and_a_device_silently() {
    let mut m = load();
    let toks = m.tokenizer.encode("Hello there, how are you?", false, false).expect("encodes");
    let mut host = m.transformer.new_kv();
    let all_host = m.transformer.forward(&mut host, &toks, Logits::All).expect("host pass");
    let mut before = m.transformer.new_kv();
    m.transformer.forward(&mut before, &toks, Logits::Last).expect("host pass");
    // Layer 2's attention on the CPU device.
    let pick = |sg: Subgraph| usize::from(sg == Subgraph::attention(2));
    let names = vec!["cpu".to_string(), "cpu-device".to_string()];
    m.transformer.attach_devices(vec![Arc::new(CpuDevice::new(1))], Arc::new(Pinned { names, pick }));
    // A cache whose layer 2 is in host memory is handed to the device that runs layer 2's
    // attention (`KvCache::move_to_device`, in the contract's KV layout); the CPU device keeps
    // its caches its own way and refuses the write — an error, never a silent loss.
    let e = m.transformer.forward(&mut before, &[1], Logits::Last).unwrap_err().to_string();
    assert!(e.contains("written by attention only"), "{e}");
    // A new one runs, every row's logits equal to the host's.
    let mut fresh = m.transformer.new_kv();
    let all_dev = m.transformer.forward(&mut fresh, &toks, Logits::All).expect("placed pass");
    assert_eq!(all_dev.len(), all_host.len());
    assert!(all_dev.iter().zip(&all_host).all(|(a, b)| a.to_bits() == b.to_bits()), "Logits::All differ");
    // Detached, the cache whose layer 2 is on the device comes home for the host's pass — which
    // the CPU device refuses to read out; cleared, it runs again.
    m.transformer.attach_devices(Vec::new(), Arc::new(llmd_engine::sched::Roofline::default()));
    let e = m.transformer.forward(&mut fresh, &[1], Logits::Last).unwrap_err().to_string();
    assert!(e.contains("read by attention only"), "{e}");
    fresh.clear();
    assert!(m.transformer.forward(&mut fresh, &toks, Logits::Last).is_ok());
}

#[test]
fn inconsistent_bindings_are_refused_not_run() {
    use llmd_device::SeqBinding;
    use llmd_engine::backend::device_run::check_bindings;
    let seq = |offset, len, start| SeqBinding { offset, len, start, kv: None };
    assert!(check_bindings(&[1, 2, 3], &[5, 6, 0], &[seq(0, 2, 5), seq(2, 1, 0)]).is_ok());
    assert!(check_bindings(&[1, 2, 3], &[5, 6, 0], &[seq(0, 2, 5)]).is_err(), "a token no sequence has");
    assert!(check_bindings(&[1, 2, 3], &[5, 6, 0], &[seq(1, 2, 5), seq(0, 1, 0)]).is_err(), "out of order");
    assert!(check_bindings(&[1, 2, 3], &[5, 7, 0], &[seq(0, 2, 5), seq(2, 1, 0)]).is_err(), "a position skipped");
    assert!(check_bindings(&[1, 2], &[5, 6, 0], &[seq(0, 3, 5)]).is_err(), "tokens and positions differ");
    assert!(check_bindings(&[1], &[0], &[seq(0, usize::MAX, 0)]).is_err(), "a length past the pass");
}

#[test]
fn the_prefill_chunk_is_agreed_with_the_devices_static_shapes() {
    let mut m = load();
    assert_eq!(m.transformer.prefill_chunk(256), 256, "the CPU alone takes any chunk");
    let mut npu = DiscreteTestDevice::new();
    npu.desc.static_shapes = StaticShapes::Only(vec![32, 128]);
    let names = vec!["cpu".to_string(), "discrete-test".to_string()];
    m.transformer.attach_devices(vec![Arc::new(npu)], Arc::new(Pinned { names, pick: |_| 0 }));
    assert_eq!(m.transformer.prefill_chunk(256), 128);
    assert_eq!(m.transformer.prefill_chunk(100), 32);
    assert_eq!(m.transformer.prefill_chunk(16), 16, "no graph that small: the CPU's chunk");
}

/// A prompt in chunks, out of order, with layer parts on two devices of their own: the engine's
/// one executor runs each chunk's parts where the placement puts them, each in its processor's
/// lane of the job graph, on the first device the embedding, the head, the norm and QKV of
/// layer 1 (its output crossing to the host's attention), the O and gate/up of layer 2 (the
/// SwiGLU output crossing back for the host's down), gate/up and down of layer 3 (the SwiGLU
/// output staying on the device), gate/up of layer 4 and O of layer 5; on the second device the
/// down of layer 4 (the SwiGLU output crossing between devices) and gate/up of layer 5 (the
/// residual stream crossing between them). Under llm.npu's policy and pseudo-random legal orders the logits
/// and the KV cache equal an in-order prefill on the host, bit for bit, and every part on a
/// device went through the contract. A prefill stopped part-way through its jobs, and one
/// whose placement puts attention's core on a device (refused with a typed error), leave the
/// cache as it was.
#[test]
fn a_prompt_in_chunks_with_layer_parts_on_a_device_gives_the_in_order_bits() {
    use llmd_engine::model::Run;
    use llmd_engine::sched::{Job, Policy};
    let m = load();
    let t = &m.transformer;
    const CHUNK: usize = 16;
    let prompt: Vec<u32> = m
        .tokenizer
        .encode(
            "Chunked prefill reads a long prompt in pieces: each piece's layers run as their weights \
             allow, and a later piece's projections may run before an earlier piece's attention.",
            false,
            false,
        )
        .expect("encodes");
    assert!(prompt.len() > 2 * CHUNK && !prompt.len().is_multiple_of(CHUNK), "{} tokens", prompt.len());
    let kv_bytes = |kv: &KvCache| {
        let mut b = Vec::new();
        kv.write_to(&mut b).unwrap();
        b
    };
    // In order on the host, chunk after chunk.
    let mut kv = t.new_kv();
    let mut want = Vec::new();
    for part in prompt.chunks(CHUNK) {
        want = t.forward(&mut kv, part, Logits::Last).expect("a chunk");
    }
    let want_kv = kv_bytes(&kv);
    let pick = |sg: Subgraph| match (sg.kind, sg.layer) {
        (SubgraphKind::Embed | SubgraphKind::Head, _)
        | (SubgraphKind::AttnQkv, 1)
        | (SubgraphKind::AttnOut | SubgraphKind::FfnGateUp, 2)
        | (SubgraphKind::FfnGateUp | SubgraphKind::FfnDown, 3)
        | (SubgraphKind::FfnGateUp, 4)
        | (SubgraphKind::AttnOut, 5) => 1,
        (SubgraphKind::FfnDown, 4) | (SubgraphKind::FfnGateUp, 5) => 2,
        _ => 0,
    };
    let (dev, mut second) = (Arc::new(DiscreteTestDevice::new()), DiscreteTestDevice::new());
    second.desc.name = "discrete-test-2".into();
    let (counts, counts2) = (dev.counts.clone(), second.counts.clone());
    let names = vec!["cpu".to_string(), "discrete-test".to_string(), "discrete-test-2".to_string()];
    let devs = Devices::new(vec![dev, Arc::new(second)], Arc::new(Pinned { names: names.clone(), pick }));
    let chunks = prompt.len().div_ceil(CHUNK);
    // The job graph's lanes: the devices' parts in the GPU's (their processor), the rest the CPU's.
    let dag = t.prefill_dag(&devs, chunks, CHUNK).expect("the job graph");
    let on_gpu = dag.specs.iter().filter(|s| s.proc == Processor::Gpu).count();
    assert_eq!(on_gpu, 9, "{:?}", dag.specs.iter().map(|s| (&s.name, s.proc)).collect::<Vec<_>>());
    let mut kv = t.new_kv();
    let got = t.run(&mut [(&mut kv, &prompt)], Run::LAST.on(&devs).chunked(CHUNK)).expect("prefills").pop().unwrap();
    assert!(got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "llm.npu's order: logits differ");
    assert!(kv_bytes(&kv) == want_kv, "llm.npu's order: KV caches differ");
    // Every chunk's seven parts and its embedding on the first device, two parts on the second,
    // and the last chunk's head.
    assert_eq!(counts.submits.load(Ordering::Relaxed), chunks * 8 + 1);
    assert_eq!(counts2.submits.load(Ordering::Relaxed), chunks * 2);
    let times = |j: Job| 1.0 + (j.step % 5) as f64 + j.chunk as f64;
    for policy in [Policy::InOrder, Policy::Random(7), Policy::Random(8)] {
        let mut kv = t.new_kv();
        let (got, tl) = t.prefill_out_of_order(&mut kv, &prompt, CHUNK, &devs, policy, &times).expect("prefills");
        assert_eq!(tl.runs.len(), dag.jobs());
        assert!(got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "{policy:?}: logits differ");
        assert!(kv_bytes(&kv) == want_kv, "{policy:?}: KV caches differ");
    }
    // Stopped part-way (at its 100th check of the flag): an error, the cache as it was.
    let mut kv = t.new_kv();
    t.forward(&mut kv, &prompt[..5], Logits::Last).expect("a turn before");
    let before = kv_bytes(&kv);
    let asked = AtomicUsize::new(0);
    let stop = || asked.fetch_add(1, Ordering::Relaxed) >= 100;
    let r = t.run(&mut [(&mut kv, &prompt)], Run::LAST.on(&devs).chunked(CHUNK).until(&stop));
    assert!(r.is_err(), "a stopped prefill gave logits");
    assert!(asked.load(Ordering::Relaxed) > 100, "stopped at the flag");
    assert!(kv_bytes(&kv) == before, "the stopped prefill changed the cache");
    // Attention's core of a chunk on the device: refused, the cache as it was.
    let core = Devices::new(
        vec![Arc::new(DiscreteTestDevice::new())],
        Arc::new(Pinned { names, pick: |sg: Subgraph| usize::from(sg == Subgraph::part(0, SubgraphKind::AttnCore)) }),
    );
    let mut kv = t.new_kv();
    t.forward(&mut kv, &prompt[..5], Logits::Last).expect("a turn before");
    let before = kv_bytes(&kv);
    let e = t.run(&mut [(&mut kv, &prompt)], Run::LAST.on(&core).chunked(CHUNK)).unwrap_err().to_string();
    assert!(e.contains("appends to its cache on the host"), "{e}");
    assert!(kv_bytes(&kv) == before, "the refused prefill changed the cache");
}
