//! The GPU processor's backend (`backend = "gpu"`, `[gpu]`): its thread opens the OpenCL device
//! (`llmd_engine::backend::gpu`) and, per resident model, a device set placing every block of
//! a pass on it (`sched::Pinned`; the model's weights uploaded at its first pass there). The
//! engine hands it each pass's decode steps — one batched pass over every decoding session of
//! a model — while the worker's own thread reads other apps' prompt chunks on the CPU, so the
//! two overlap; each session's KV cache is handed to the GPU at its turn's first decode step
//! and comes home when its next prompt is read on the CPU.
//!
//! **Decision:** the GPU decodes and the CPU reads prompts (`sched::DecodeOn`'s split, the
//! mission's: decode on the GPU, prefill on the NPU or CPU). A pass's decode steps all go to
//! the GPU as one batch; its prompt chunks stay on the CPU, run while the GPU works.

use super::thread::{Backend, Label, Prepared, Processor, Refusal, Takes};
use crate::config::{Backend as ConfigBackend, Config, GpuMatmul};
use llmd_engine::backend::gpu::{cpu_backed, GpuDevice, GpuError, GpuOptions, MatmulVariant, OpenClError};
use llmd_engine::model::Devices;
use llmd_engine::sched::Pinned;
use llmd_engine::Model;
use std::sync::Arc;

/// The GPU the config asks for: started on its thread, or off.
pub fn from_config(config: &Config) -> Arc<Processor> {
    if !matches!(config.backend, ConfigBackend::Gpu | ConfigBackend::Auto) {
        return Processor::off(Label::Gpu);
    }
    let auto = config.backend == ConfigBackend::Auto;
    let allow_emulated = config.devices.allow_emulated;
    if let Some(r) = auto_refusal(config) {
        return Processor::refused(Label::Gpu, r);
    }
    if config.kv_cache_type == crate::config::KvCacheType::Q8 {
        // The GPU's attention reads f16 caches, and an int8 one does not move to it.
        let reason = "the GPU decodes from f16 KV caches; kv_cache_type is \"q8\"".to_string();
        return Processor::refused(Label::Gpu, Refusal { reason, expected: config.backend == ConfigBackend::Auto });
    }
    let g = &config.gpu;
    start(
        GpuOptions {
            library: g.library.clone(),
            device: g.device,
            cache_dir: g.cache_dir.clone().or_else(|| config.residency.state_dir.as_ref().map(|d| d.join("gpu"))),
            matmul: match g.matmul {
                GpuMatmul::Auto => MatmulVariant::Auto,
                GpuMatmul::Rows => MatmulVariant::RowPerItem,
                GpuMatmul::Groups => MatmulVariant::GroupPerRow,
            },
            fp16: g.fp16,
            gpu_only: auto && !allow_emulated,
        },
        auto && !allow_emulated,
    )
}

/// Why `backend = "auto"` does not even look for a GPU, if it does not. Automatic placement is
/// for a phone's GPU. Off Android, probing the ICD loader's platforms would load whatever
/// runtimes are installed (PoCL brings LLVM; CI's accounting test saw RSS 219 MB against 151
/// MB accounted) to find, most likely, no GPU; `[gpu] library` or `device`, `[devices]
/// allow_emulated` or backend = "gpu" asks.
pub fn auto_refusal(config: &Config) -> Option<Refusal> {
    let named = config.gpu.library.is_some() || config.gpu.device.is_some();
    (config.backend == ConfigBackend::Auto
        && !named
        && !config.devices.allow_emulated
        && !cfg!(target_os = "android"))
    .then(|| Refusal {
        reason: "backend \"auto\" looks for a GPU on Android (off Android, set [gpu] library or device, [devices] allow_emulated = true or backend = \"gpu\")".into(),
        expected: true,
    })
}

/// Starts the GPU's thread, which opens the device with `opts` (refusing one on the host's CPU
/// if `refuse_emulated`).
pub fn start(opts: GpuOptions, refuse_emulated: bool) -> Arc<Processor> {
    let takes = Takes { decode: true, ..Takes::default() };
    Processor::start(Label::Gpu, takes, Box::new(Gpu { opts, refuse_emulated, device: None }))
}

struct Gpu {
    opts: GpuOptions,
    /// `backend = "auto"` without `[devices] allow_emulated`: no OpenCL device on the CPU.
    refuse_emulated: bool,
    device: Option<Arc<GpuDevice>>,
}

impl Backend for Gpu {
    fn open(&mut self) -> Result<String, Refusal> {
        let dev = match GpuDevice::open(&self.opts) {
            Ok(d) => d,
            // Automatic placement expects no GPU off a phone.
            Err(e)
                if self.opts.gpu_only
                    && matches!(e, GpuError::NoGpu { .. } | GpuError::OpenCl(OpenClError::Load { .. })) =>
            {
                return Err(Refusal { reason: format!("backend \"auto\": {e}"), expected: true })
            }
            Err(e) => return Err(Refusal::unexpected(e.to_string())),
        };
        let i = dev.info();
        match cpu_backed(i) {
            // `[gpu] device` may pick one such; automatic placement still does not take it.
            Some(why) if self.refuse_emulated => {
                return Err(Refusal {
                    reason: format!("backend \"auto\" does not take {why}: set [devices] allow_emulated = true"),
                    expected: true,
                })
            }
            _ => {}
        }
        let emulated = cpu_backed(i).map_or(String::new(), |_| " (on the host's CPU)".into());
        let what = format!("device {} ({}){emulated}; kernels {}", i.name, i.platform, dev.program_origin());
        self.device = Some(Arc::new(dev));
        Ok(what)
    }

    /// Every block of `model`'s passes on the GPU; its weights go up at its first pass.
    fn prepare(&mut self, _model: &Arc<Model>) -> Result<Prepared, String> {
        let dev = self.device.clone().ok_or("the GPU is not open")?;
        let name = llmd_device::Device::desc(&*dev).name.clone();
        let all_here = Pinned { names: vec![String::new(), name], pick: |_| 1 };
        let devs = Devices::new(vec![dev.clone() as Arc<dyn llmd_device::Device>], Arc::new(all_here));
        // The device's counters since it opened (one thread runs every job on it).
        let lines = Box::new(move |_: &Devices, _: &str| {
            let s = dev.stats();
            let (in_place, copied) = dev.weight_bytes();
            vec![
                format!(
                    "{} kernels, {} host waits, {} B up, {} B down",
                    s.kernels, s.host_waits, s.bytes_to_device, s.bytes_from_device
                ),
                format!("weights {in_place} B read in place in the CPU's memory, {copied} B copied to the device"),
            ]
        });
        Ok(Prepared {
            devs,
            graphs: 0,
            how: "weights uploaded at its first pass".into(),
            modelled: None,
            lines,
            takes: None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::processor::{Job, JobKind, State};
    use std::time::{Duration, Instant};

    #[test]
    fn an_int8_kv_cache_keeps_decode_on_the_cpu_and_says_why() {
        let mut c = Config { backend: ConfigBackend::Gpu, ..Config::default() };
        c.kv_cache_type = crate::config::KvCacheType::Q8;
        let g = from_config(&c);
        assert!(matches!(g.state(), State::Unavailable { reason } if reason.contains("q8")), "{:?}", g.state());
        assert!(g.dump().contains("state unavailable: decode runs on the CPU"), "{}", g.dump());
        let off = from_config(&Config { backend: ConfigBackend::Cpu, ..Config::default() });
        assert_eq!(off.state(), State::Off);
    }

    #[test]
    fn a_model_whose_pass_fails_decodes_on_the_cpu_and_the_others_keep_the_gpu() {
        let g = start(GpuOptions::default(), false);
        let t = Instant::now();
        while matches!(g.state(), State::Starting) && t.elapsed() < Duration::from_secs(60) {
            std::thread::sleep(Duration::from_millis(20));
        }
        if !matches!(g.state(), State::Serving { .. }) {
            let required = std::env::var("LLMD_REQUIRE_OPENCL").is_ok_and(|v| v == "1");
            assert!(!required, "LLMD_REQUIRE_OPENCL=1 and {:?}", g.state());
            return;
        }
        let fixture = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures/tiny-qwen2.gguf");
        let load = || Arc::new(Model::load(std::path::Path::new(fixture), &Default::default()).expect("loads"));
        let (bad, good) = (load(), load());
        g.prepare(&bad);
        g.prepare(&good);
        let t = Instant::now();
        while !(g.decodes(&bad) && g.decodes(&good)) && t.elapsed() < Duration::from_secs(30) {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(g.decodes(&bad) && g.decodes(&good), "{}", g.dump());
        let (tx, rx) = std::sync::mpsc::channel();
        let job: Job = Box::new(move |devs| {
            let _ = tx.send(devs.is_ok());
            Err("a weight type the kernels do not read".into())
        });
        assert!(g.submit(&bad, JobKind { sequences: 1, tokens: 1, requests: vec![0], prefill: None }, job).is_ok());
        assert!(rx.recv_timeout(Duration::from_secs(30)).expect("the job ran"), "it ran with the device set");
        let t = Instant::now();
        while g.decodes(&bad) && t.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(!g.decodes(&bad), "the failed model still goes to the GPU");
        assert!(g.decodes(&good), "another model keeps the GPU: {:?}", g.state());
        assert!(g.dump().contains("failed, on the CPU: a weight type the kernels do not read"), "{}", g.dump());
    }
}
