//! Sessions' conversations: one caller's context with one model — its KV cache, the tokens in
//! it and the messages so far — and, in [`engine`], the scheduler's `Engine` that runs turns of
//! them on `llmd_engine` models. The `ILlmSession` Binder object a client holds is
//! `session::SessionBinder`, above this.
//!
//! A session holds the engine's `Sequence` handle (`SessionInner::kv`, private), never the KV
//! cache itself: its layout and any device memory stay the engine's. Every use of the handle is
//! in this file: making one, restoring a spilled one, a turn's set-up, rewind and commit, the
//! batched forward, spill and accounting.
//!
//! Locking: `SessionCore::inner` is held by the worker for one unit of work at a time and
//! briefly by Binder threads (submit, reset, dump) and the pressure response (`try_lock`). A
//! session runs at most one request at a time (`active_request`). States: open → closed (by
//! close(), the client's death, the last reference dropped, or going unused for
//! `session_idle_timeout_s`). A closed session's KV is freed by whoever closes it, or by the
//! engine when its running request ends.

pub mod engine;

use crate::error::ServiceError;
use crate::permission::Caller;
use llmd_engine::chat::ChatMessage;
use llmd_engine::generate::{GenerateRequest, Generation};
use llmd_engine::model::Run;
use llmd_engine::sequence::Sequence;
use llmd_engine::Model;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// What a turn adds to the conversation.
#[derive(Clone, Debug)]
pub enum TurnInput {
    /// Raw text appended to the context.
    Text(String),
    /// Messages appended to the conversation, which is re-rendered with the chat template.
    Chat(Vec<ChatMessage>),
}

pub struct SessionCore {
    pub id: u64,
    pub owner: Caller,
    pub model_id: String,
    /// Most positions this session's context may hold.
    pub context_limit: usize,
    inner: Mutex<SessionInner>,
    /// Set once the session is closed (shared with its requests' jobs).
    pub closed: Arc<AtomicBool>,
    /// When it was last used: a call of its owner's on it, or the end of its request.
    used: Mutex<Instant>,
    /// Closed for having gone unused this many seconds (0: not that way), for its owner's error.
    expired_after_s: AtomicU64,
    /// What the session held when its lock was last let go (see [`SessionGuard`]): what status
    /// and dump show while the lock is held (a pass, or a prompt chunk on the NPU).
    seen: Mutex<SessionView>,
}

/// A session's figures for status and dump.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SessionView {
    pub kv_len: usize,
    pub kv_bytes: usize,
    pub messages: usize,
    pub active_request: Option<u64>,
}

/// The session's lock, held: on release it records the session's figures ([`SessionView`]),
/// so readers that must not wait for a pass or an NPU chunk have them as of then.
pub struct SessionGuard<'a> {
    core: &'a SessionCore,
    inner: MutexGuard<'a, SessionInner>,
}

impl std::ops::Deref for SessionGuard<'_> {
    type Target = SessionInner;
    fn deref(&self) -> &SessionInner {
        &self.inner
    }
}

impl std::ops::DerefMut for SessionGuard<'_> {
    fn deref_mut(&mut self) -> &mut SessionInner {
        &mut self.inner
    }
}

impl Drop for SessionGuard<'_> {
    fn drop(&mut self) {
        *self.core.seen.lock().unwrap_or_else(|p| p.into_inner()) = self.inner.view();
    }
}

pub struct SessionInner {
    /// The engine's handle of this conversation (its KV cache, wherever the engine keeps it).
    kv: Sequence,
    /// The tokens whose keys and values `kv` holds, in order.
    tokens: Vec<u32>,
    pub messages: Vec<ChatMessage>,
    /// Tokens generated at the end of the last turn but not yet fed to the model; a raw-text
    /// turn feeds them first (a chat turn re-renders the reply instead).
    pending: Vec<u32>,
    pub active_request: Option<u64>,
    /// Where the KV cache was spilled under memory pressure (restored at the next turn).
    spilled: Option<PathBuf>,
}

impl SessionCore {
    /// A new, empty conversation of `owner` with `model`.
    pub fn new(id: u64, owner: Caller, model_id: &str, context_limit: usize, model: &Model) -> Self {
        Self {
            id,
            owner,
            model_id: model_id.to_owned(),
            context_limit,
            inner: Mutex::new(SessionInner {
                kv: model.transformer.new_sequence(),
                tokens: Vec::new(),
                messages: Vec::new(),
                pending: Vec::new(),
                active_request: None,
                spilled: None,
            }),
            closed: Arc::new(AtomicBool::new(false)),
            used: Mutex::new(Instant::now()),
            expired_after_s: AtomicU64::new(0),
            seen: Mutex::new(SessionView::default()),
        }
    }

    /// Marks the session used now (an idle session is closed after `session_idle_timeout_s`).
    pub fn touch(&self) {
        *self.used.lock().unwrap_or_else(|p| p.into_inner()) = Instant::now();
    }

    /// How long since it was last used.
    pub fn idle_for(&self) -> Duration {
        self.used.lock().unwrap_or_else(|p| p.into_inner()).elapsed()
    }

    /// If it was closed for going unused: after how many seconds.
    pub fn expired_after(&self) -> Option<u64> {
        Some(self.expired_after_s.load(Ordering::Acquire)).filter(|&s| s > 0)
    }

    /// Closes a session unused for `timeout` and frees its KV cache (spilled file included),
    /// unless a request is running in it or it is in use this instant (then `None`: it is
    /// looked at again later). Returns the bytes freed. Its removal from the open sessions is
    /// the caller's (`Shared::close_session`).
    pub fn expire(&self, timeout: Duration) -> Option<usize> {
        let mut inner = self.try_lock()?;
        if inner.active_request.is_some() || self.idle_for() < timeout {
            return None;
        }
        self.expired_after_s.store(timeout.as_secs().max(1), Ordering::Release);
        self.closed.store(true, Ordering::Release);
        let bytes = inner.kv_bytes();
        inner.clear();
        Some(bytes)
    }

    pub fn lock(&self) -> SessionGuard<'_> {
        // A panic while holding the lock cannot leave the cache half-written in a way later
        // steps rely on (a pass rewrites the cache from its length), so a poisoned lock is usable.
        SessionGuard { core: self, inner: self.inner.lock().unwrap_or_else(|p| p.into_inner()) }
    }

    /// The lock if it is free now.
    fn try_lock(&self) -> Option<SessionGuard<'_>> {
        let inner = match self.inner.try_lock() {
            Ok(g) => g,
            Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return None,
        };
        Some(SessionGuard { core: self, inner })
    }

    /// The session's figures now, or — while a pass or an NPU chunk holds it — as of when its
    /// lock was last let go (then `false`). Never waits.
    pub fn view(&self) -> (SessionView, bool) {
        match self.try_lock() {
            Some(g) => (g.view(), true),
            None => (*self.seen.lock().unwrap_or_else(|p| p.into_inner()), false),
        }
    }

    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    /// Frees a closed session's memory now if no request is running (else the request's end
    /// does).
    pub fn free_if_idle(&self) {
        if let Some(mut inner) = self.try_lock() {
            if inner.active_request.is_none() {
                inner.clear();
            }
        }
    }

    /// Frees the KV cache of an idle session holding more than `over` positions: spilled to
    /// `state_dir` (restored at its next turn) or, without one or when the spill fails,
    /// dropped (recomputed then). `None` if it is busy, running a request, or holds no more
    /// than `over`.
    pub fn shed_kv(&self, over: usize, state_dir: Option<&Path>) -> Option<Shed> {
        let mut inner = self.try_lock()?;
        if inner.active_request.is_some() || inner.kv.is_empty() || inner.kv.len() <= over {
            return None;
        }
        let bytes = inner.kv.size_bytes() as u64;
        let mut spilled = false;
        if let Some(dir) = state_dir {
            let path = spill_dir(dir).join(format!("session-{}.kv", self.id));
            match write_spill(dir, &path, &mut inner.kv) {
                Ok(()) => {
                    inner.spilled = Some(path);
                    spilled = true;
                }
                Err(e) => tracing::warn!(session = self.id, "KV spill failed ({e}); dropping it instead"),
            }
        }
        inner.kv.clear();
        llmd_alloc_sys::note_freed();
        Some(Shed { bytes, spilled })
    }
}

/// What [`SessionCore::shed_kv`] freed.
#[derive(Clone, Copy, Debug)]
pub struct Shed {
    pub bytes: u64,
    /// Written to storage (else dropped).
    pub spilled: bool,
}

/// Where spilled KV caches live: `state_dir/kv`, mode 0700 (they hold what prompts computed).
pub fn spill_dir(state_dir: &Path) -> std::path::PathBuf {
    state_dir.join("kv")
}

/// Writes a spill file whole or not at all: to a temporary name (mode 0600, in the 0700
/// directory), synced, then renamed into place; on any failure the temporary file is removed.
fn write_spill(state_dir: &Path, path: &Path, kv: &mut Sequence) -> std::io::Result<()> {
    use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
    let dir = spill_dir(state_dir);
    std::fs::DirBuilder::new().recursive(true).mode(0o700).create(&dir)?;
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700))?;
    let tmp = path.with_extension("kv.tmp");
    let r = (|| {
        let f = std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(0o600).open(&tmp)?;
        let mut w = std::io::BufWriter::new(f);
        kv.spill(&mut w)?;
        let f = w.into_inner().map_err(|e| e.into_error())?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if r.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    r
}

/// Removes the spill files a previous run left (its sessions are gone with it; nothing can
/// restore them). Returns how many.
pub fn remove_stale_spills(state_dir: &Path) -> usize {
    let Ok(entries) = std::fs::read_dir(spill_dir(state_dir)) else { return 0 };
    let mut n = 0;
    for e in entries.flatten() {
        let name = e.file_name();
        let name = name.to_string_lossy();
        if name.starts_with("session-")
            && (name.ends_with(".kv") || name.ends_with(".kv.tmp"))
            && std::fs::remove_file(e.path()).is_ok()
        {
            n += 1;
        }
    }
    n
}

impl SessionInner {
    /// Cuts the cache back to `len` positions (a prompt chunk that did not complete).
    pub fn truncate_kv(&mut self, len: usize) {
        self.kv.truncate(len);
    }

    /// Prefills `tokens` with the linear groups where `devs` place them (the NPU's graphs of
    /// `chunk` rows), several chunks out of order, `stop` asked before each group; the logits
    /// after the last token. On an error the cache is as it was.
    pub fn prefill_on(
        &mut self,
        model: &Model,
        tokens: &[u32],
        chunk: usize,
        devs: &llmd_engine::model::Devices,
        stop: &(dyn Fn() -> bool + Sync),
    ) -> Result<Vec<f32>, ServiceError> {
        model
            .transformer
            .run_sequences(&mut [(&mut self.kv, tokens)], Run::LAST.on(devs).chunked(chunk).until(stop))
            .map(|mut l| l.pop().unwrap_or_default())
            .map_err(|e| ServiceError::Internal(e.to_string()))
    }

    /// Positions the KV cache holds.
    pub fn kv_len(&self) -> usize {
        self.kv.len()
    }

    /// Bytes the KV cache holds.
    pub fn kv_bytes(&self) -> usize {
        self.kv.size_bytes()
    }

    /// Its figures for status and dump.
    pub fn view(&self) -> SessionView {
        SessionView {
            kv_len: self.kv_len(),
            kv_bytes: self.kv_bytes(),
            messages: self.messages.len(),
            active_request: self.active_request,
        }
    }

    /// Frees the KV cache and forgets the conversation.
    pub fn clear(&mut self) {
        if let Some(p) = self.spilled.take() {
            let _ = std::fs::remove_file(p);
        }
        if self.kv.size_bytes() > 0 {
            // The allocator keeps the freed pages: the idle worker gives them back.
            llmd_alloc_sys::note_freed();
        }
        self.kv.clear();
        self.tokens.clear();
        self.messages.clear();
        self.pending.clear();
    }

    /// Brings back a KV cache that memory pressure spilled to flash or dropped: read back from
    /// its spill file if it has one (and the file is intact), else recomputed from the
    /// session's tokens. Either way the conversation continues where it was.
    pub fn restore(&mut self, model: &Model) {
        if let Some(path) = self.spilled.take() {
            let restored = std::fs::File::open(&path)
                .and_then(|f| Sequence::restore(&mut std::io::BufReader::new(f), &model.transformer));
            let _ = std::fs::remove_file(&path);
            match restored {
                Ok(kv) if kv.len() <= self.tokens.len() => {
                    self.kv = kv;
                    return;
                }
                Ok(_) => tracing::warn!("spilled KV cache longer than its tokens; recomputing"),
                Err(e) => tracing::warn!("spilled KV cache unusable ({e}); recomputing"),
            }
        }
        if self.kv.len() < self.tokens.len() {
            let mut kv = model.transformer.new_sequence();
            let mut ok = true;
            for chunk in self.tokens.chunks(llmd_engine::generate::DEFAULT_PREFILL_CHUNK) {
                let step = model.transformer.run_sequences(&mut [(&mut kv, chunk)], Run::LAST);
                if step.is_err() {
                    ok = false;
                    break;
                }
            }
            if ok {
                self.kv = kv;
            } else {
                // The context cannot be rebuilt: start over (chat turns re-render from messages).
                self.tokens.clear();
                self.pending.clear();
                self.kv.clear();
            }
        }
    }

    /// Sets a turn up against the context: the whole context it makes, with the longest common
    /// prefix of what the cache holds kept (the rest is cut off the cache). Returns the prompt
    /// tokens to feed, the context they complete, and the KV length to rewind to.
    pub fn begin_turn(
        &mut self,
        model: &Model,
        input: &TurnInput,
        max_tokens: usize,
        context_limit: usize,
        max_prompt_tokens: usize,
    ) -> Result<(Vec<u32>, Vec<u32>, usize), ServiceError> {
        let tk = &model.tokenizer;
        let full: Vec<u32> = match input {
            TurnInput::Text(t) => {
                let add_bos = self.tokens.is_empty() && tk.add_bos;
                let mut full = self.tokens.clone();
                full.extend_from_slice(&self.pending);
                full.extend(tk.encode(t, false, add_bos).map_err(|e| ServiceError::InvalidArgument(e.to_string()))?);
                full
            }
            TurnInput::Chat(new) => {
                let mut messages = self.messages.clone();
                messages.extend(new.iter().cloned());
                model.prompt_tokens(&llmd_engine::generate::Prompt::Chat(messages))?
            }
        };
        if full.len() + max_tokens > context_limit {
            return Err(ServiceError::RequestTooLarge(format!(
                "the context would hold {} prompt tokens plus up to {} new ones; this session holds {context_limit}",
                full.len(),
                max_tokens
            )));
        }
        // Reuse the longest common prefix of what the cache holds; feed the rest (at least one
        // token, so there are logits to sample from).
        let mut common = self.tokens.iter().zip(&full).take_while(|(a, b)| a == b).count();
        if common == full.len() {
            common = common.saturating_sub(1);
        }
        let new_tokens = full.len() - common;
        if new_tokens > max_prompt_tokens {
            return Err(ServiceError::RequestTooLarge(format!(
                "prompt of {new_tokens} tokens exceeds the limit of {max_prompt_tokens}"
            )));
        }
        self.kv.truncate(common);
        self.tokens.truncate(common);
        self.pending.clear();
        Ok((full[common..].to_vec(), full, common))
    }

    /// The engine's generation of `prompt` after what the cache holds.
    pub fn generation(
        &self,
        model: &Model,
        prompt: Vec<u32>,
        request: &GenerateRequest,
        prefill_chunk: usize,
    ) -> Result<Generation, ServiceError> {
        // The chunk agreed with the devices' static shapes (unchanged with the CPU alone).
        let chunk = model.transformer.prefill_chunk(prefill_chunk);
        Ok(Generation::for_sequence(model, &self.kv, prompt, request)?.with_prefill_chunk(chunk))
    }

    /// A turn that could not start: the cache keeps only the session's tokens.
    pub fn abandon_turn(&mut self) {
        let len = self.tokens.len();
        self.kv.truncate(len);
    }

    /// Rolls a turn back to the context it began with (`rewind_to` positions).
    pub fn rewind(&mut self, rewind_to: usize) {
        self.kv.truncate(rewind_to);
        self.tokens.truncate(rewind_to);
        self.pending.clear();
    }

    /// Makes a completed turn part of the conversation: `context` (the context after the
    /// turn's prompt) and `generated` become its tokens — those the cache does not hold yet are
    /// pending — and a chat turn's messages and reply its messages.
    pub fn commit_turn(&mut self, model: &Model, input: &TurnInput, context: &[u32], generated: &[u32]) {
        let mut tokens = context.to_vec();
        tokens.extend_from_slice(generated);
        self.pending = tokens.split_off(self.kv.len().min(tokens.len()));
        self.tokens = tokens;
        if let TurnInput::Chat(new) = input {
            self.messages.extend(new.iter().cloned());
            let reply = model.tokenizer.decode(generated).unwrap_or_default();
            self.messages.push(ChatMessage::new("assistant", &reply));
        }
    }
}

/// [`forward_batch`] on a processor's device set (the GPU's; the NPU's HeteroLLM plan): each
/// session's cache handed to a device as its layers need; the engine's error in words.
pub fn forward_batch_on(
    model: &Model,
    devs: &llmd_engine::model::Devices,
    batch: &mut [(&mut SessionInner, &[u32])],
) -> Result<Vec<Vec<f32>>, String> {
    let mut seqs: Vec<(&mut Sequence, &[u32])> = batch.iter_mut().map(|(s, t)| (&mut s.kv, *t)).collect();
    model.transformer.run_sequences(&mut seqs, Run::LAST.on(devs)).map_err(|e| e.to_string())
}

/// One batched forward of `model` over several sessions' caches: each gets its tokens appended
/// and the logits after its last token.
pub fn forward_batch(model: &Model, batch: &mut [(&mut SessionInner, &[u32])]) -> Result<Vec<Vec<f32>>, ServiceError> {
    let mut seqs: Vec<(&mut Sequence, &[u32])> = batch.iter_mut().map(|(s, t)| (&mut s.kv, *t)).collect();
    model.transformer.run_sequences(&mut seqs, Run::LAST).map_err(|e| ServiceError::Internal(e.to_string()))
}
