//! Prompt attention of resident models (`[attention]`): with `mode = "shadow"`, each model's
//! shadowAttn profile is read from `<state_dir>/attention/` when it loads, or made on a thread of
//! its own (`llmd-attn`) while its prompts are served dense; then the model's prompt chunks run
//! sparse. `dump`'s `ATTENTION` section says where each model is.

use crate::config::{AttentionConfig, AttentionMode};
use llmd_engine::backend::sparse::SparseAttn;
use llmd_engine::shadowattn::Profile;
use llmd_engine::Model;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, Weak};
use std::time::Instant;

/// Where one model's attention stands.
#[derive(Clone, Debug)]
enum Stage {
    /// The profile is being made; prompts are dense meanwhile.
    Building { since: Instant, done: usize, of: usize },
    /// Sparse from here on.
    Ready { read: bool, secs: f64, settings: Arc<SparseAttn> },
    /// The profile could not be made: prompts stay dense.
    Failed(String),
}

struct Entry {
    model: Weak<Model>,
    stage: Arc<Mutex<Stage>>,
}

/// The daemon's attention setting and each model's stage.
pub struct Attention {
    config: AttentionConfig,
    dir: Option<PathBuf>,
    models: Mutex<BTreeMap<String, Entry>>,
}

impl Attention {
    /// `state_dir`: where profiles are kept (`attention/` in it); none: made at every load.
    pub fn new(config: AttentionConfig, state_dir: Option<&std::path::Path>) -> Self {
        Self { config, dir: state_dir.map(|d| d.join("attention")), models: Mutex::new(BTreeMap::new()) }
    }

    /// Sets up `model` (resident as `id`) once per load: dense mode does nothing; shadow reads
    /// its profile, or starts making it and leaves the model dense until it is made.
    pub fn prepare(&self, id: &str, model: &Arc<Model>) {
        if self.config.mode == AttentionMode::Dense {
            return;
        }
        let mut models = self.models.lock().unwrap_or_else(|p| p.into_inner());
        if models.get(id).is_some_and(|e| e.model.upgrade().is_some_and(|m| Arc::ptr_eq(&m, model))) {
            return;
        }
        let stage = Arc::new(Mutex::new(Stage::Building { since: Instant::now(), done: 0, of: 0 }));
        models.insert(id.to_owned(), Entry { model: Arc::downgrade(model), stage: stage.clone() });
        drop(models);
        let (cfg, dir, m) = (self.config.clone(), self.dir.clone(), model.clone());
        let spawned = std::thread::Builder::new().name("llmd-attn".into()).spawn(move || {
            let start = Instant::now();
            let tokens = match m.tokenizer.encode(llmd_engine::prefill::CALIBRATION_TEXT, false, false) {
                Ok(t) => t,
                Err(e) => {
                    *stage.lock().unwrap_or_else(|p| p.into_inner()) = Stage::Failed(e.to_string());
                    return;
                }
            };
            // Stops once this thread holds the model's last reference (it was evicted): a
            // profile must not keep an evicted model's memory.
            let progress = |done: usize, of: usize| {
                if let Stage::Building { done: d, of: o, .. } = &mut *stage.lock().unwrap_or_else(|p| p.into_inner()) {
                    (*d, *o) = (done, of);
                }
                Arc::strong_count(&m) > 1
            };
            let made = Profile::load_or_build(dir.as_deref(), &m.transformer, &tokens, cfg.head_ratios, &progress);
            let next = match made {
                Ok((profile, read)) => {
                    let settings = Arc::new(profile.settings(cfg.ratio as f32, !cfg.head_ratios, cfg.buckets));
                    match m.transformer.set_sparse_attention(Some(settings.clone())) {
                        Ok(()) => Stage::Ready { read, secs: start.elapsed().as_secs_f64(), settings },
                        Err(e) => Stage::Failed(e.to_string()),
                    }
                }
                Err(e) => Stage::Failed(e.to_string()),
            };
            if let Stage::Failed(e) = &next {
                tracing::warn!("shadowAttn profile failed; prompts stay dense: {e}");
            }
            *stage.lock().unwrap_or_else(|p| p.into_inner()) = next;
        });
        if let Err(e) = spawned {
            tracing::warn!("shadowAttn profile thread not started; prompts stay dense: {e}");
        }
    }

    /// `dump`'s `ATTENTION` section.
    pub fn dump(&self) -> String {
        let c = &self.config;
        let mut out = match c.mode {
            AttentionMode::Dense => "\nATTENTION\n  mode=dense\n".to_owned(),
            AttentionMode::Shadow => format!(
                "\nATTENTION\n  mode=shadow ratio={} buckets={} ratios={}\n",
                c.ratio,
                c.buckets,
                if c.head_ratios { "head-specific" } else { "uniform" }
            ),
        };
        let models = self.models.lock().unwrap_or_else(|p| p.into_inner());
        for (id, e) in models.iter().filter(|(_, e)| e.model.strong_count() > 0) {
            let line = match &*e.stage.lock().unwrap_or_else(|p| p.into_inner()) {
                Stage::Building { since, done, of } => format!(
                    "building the profile: {done}/{of} passes, {:.1} s; prompts dense meanwhile",
                    since.elapsed().as_secs_f64()
                ),
                Stage::Ready { read, secs, settings } => format!(
                    "sparse: profile {} in {secs:.2} s; sparse_rows={}",
                    if *read { "read" } else { "made" },
                    settings.rows()
                ),
                Stage::Failed(e) => format!("dense: the profile failed: {e}"),
            };
            out.push_str(&format!("  {id}: {line}\n"));
        }
        out
    }
}
