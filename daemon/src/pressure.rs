//! The memory-pressure response, and the hourly prefetch of the predicted model: one look per
//! `pressure_poll_ms` on the `llmd-residency` thread. Under pressure (`some avg10` at or above
//! `pressure_high`) it sheds one step per look — first the KV caches of idle sessions (spilled
//! to the state directory, or dropped), then unpinned idle models, one at a time — and when the
//! pressure ends (at or below `pressure_low`) it loads the evicted models back. Without
//! pressure it spills idle contexts longer than `kv_spill_tokens` and prefetches the model the
//! usage history predicts for a new hour.
//!
//! It acts on the shared state (sessions, residency); the shared state knows nothing of it.

use crate::residency::{hour_now, PressureSource};
use crate::shared::Shared;
use std::sync::{Arc, Mutex, Weak};

pub struct Pressure {
    source: Box<dyn PressureSource>,
    state: Mutex<PressureState>,
}

/// Where the pressure response is: 0 = none, 1 = idle KV shed, 2 = evicting models.
#[derive(Clone, Debug, Default)]
pub struct PressureState {
    pub step: u8,
    /// Models evicted under pressure, to bring back when it ends.
    pub evicted: Vec<String>,
    pub last_avg10: Option<f64>,
    last_hour: Option<u32>,
    /// The pressure file was unreadable and that was logged.
    warned: bool,
    /// "Nothing left to shed" was said in this episode of pressure (once an episode: the
    /// response polls every `pressure_poll_ms`, and the bounded event list would fill with it).
    exhausted_said: bool,
}

impl Pressure {
    pub fn new(source: Box<dyn PressureSource>) -> Self {
        Self { source, state: Mutex::new(PressureState::default()) }
    }

    /// Starts the `llmd-residency` thread: a [`Pressure::tick`] every `pressure_poll_ms` until
    /// the shared state is gone.
    pub fn spawn(self: &Arc<Self>, shared: &Arc<Shared>) -> std::io::Result<()> {
        let weak: Weak<Shared> = Arc::downgrade(shared);
        let me = self.clone();
        let poll = std::time::Duration::from_millis(shared.config.residency.pressure_poll_ms);
        std::thread::Builder::new().name("llmd-residency".into()).spawn(move || loop {
            match weak.upgrade() {
                Some(s) => me.tick(&s),
                None => return,
            }
            std::thread::sleep(poll);
        })?;
        Ok(())
    }

    /// Where the response is now, for dump.
    pub fn state(&self) -> PressureState {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// One look at memory pressure and the clock: shed a step under pressure, grow back after,
    /// and load the model predicted for a new hour.
    pub fn tick(&self, shared: &Arc<Shared>) {
        let r = &shared.config.residency;
        let avg10 = self.source.some_avg10();
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if avg10.is_none() && !st.warned {
            st.warned = true;
            tracing::warn!(file = %r.pressure_file.display(), "memory pressure unreadable (no PSI?): not watching it");
        }
        st.last_avg10 = avg10;
        match avg10 {
            Some(v) if v >= r.pressure_high => {
                if st.step == 0 {
                    st.step = 1;
                    let (spilled, dropped, bytes) = shed_idle_kv(shared, 0);
                    shared.residency.event(format!(
                        "memory pressure {v:.1} (some avg10): spilled {spilled}, dropped {dropped} KV caches of idle sessions ({} KB)",
                        bytes >> 10
                    ));
                    if spilled + dropped > 0 {
                        return;
                    }
                }
                st.step = 2;
                match shared.residency.evict_one(&format!("under memory pressure ({v:.1})")) {
                    Some(id) => st.evicted.push(id),
                    None if !st.exhausted_said => {
                        st.exhausted_said = true;
                        shared.residency.event(format!(
                            "memory pressure {v:.1}: nothing left to shed (said once until the pressure ends)"
                        ));
                    }
                    None => {}
                }
            }
            Some(v) if v <= r.pressure_low && st.step > 0 => {
                st.step = 0;
                st.exhausted_said = false;
                let back = std::mem::take(&mut st.evicted);
                shared.residency.event(format!("memory pressure ended ({v:.1}); reloading {back:?}"));
                drop(st);
                let me = shared.clone();
                std::thread::spawn(move || {
                    for id in back {
                        if let Ok(m) = me.residency.acquire(&id, "back after memory pressure", me.kv_bytes()) {
                            me.processors.prepare(&m);
                        }
                    }
                });
                return;
            }
            _ => {}
        }
        if r.kv_spill_tokens > 0 && r.state_dir.is_some() && st.step == 0 {
            let (spilled, dropped, bytes) = shed_idle_kv(shared, r.kv_spill_tokens);
            if spilled + dropped > 0 {
                shared.residency.event(format!(
                    "spilled {spilled}, dropped {dropped} long idle KV caches over {} positions ({} KB)",
                    r.kv_spill_tokens,
                    bytes >> 10
                ));
            }
        }
        let hour = hour_now();
        if r.prefetch_predicted && st.last_hour != Some(hour) && st.step == 0 {
            st.last_hour = Some(hour);
            drop(st);
            let predicted = shared.history.lock().unwrap_or_else(|p| p.into_inner()).predict(hour);
            if let Some(id) = predicted.filter(|id| shared.residency.contains(id)) {
                if shared.residency.get_resident(&id).is_none() {
                    let me = shared.clone();
                    std::thread::spawn(move || {
                        let why = format!("predicted for hour {hour}");
                        match me.residency.acquire(&id, &why, me.kv_bytes()) {
                            Ok(m) => me.processors.prepare(&m),
                            Err(e) => me.residency.event(format!("prefetch of {id} failed: {e}")),
                        }
                    });
                }
            }
        }
    }
}

/// Frees the KV caches of sessions with no running request holding more than `over`
/// positions: spilled to the state directory (restored at their next turn) or dropped
/// (recomputed then). Returns (spilled, dropped, bytes).
fn shed_idle_kv(shared: &Shared, over: usize) -> (usize, usize, u64) {
    let dir = shared.config.residency.state_dir.as_deref();
    let (mut spilled, mut dropped, mut bytes) = (0, 0, 0u64);
    for s in shared.session_list() {
        if let Some(shed) = s.shed_kv(over, dir) {
            if shed.spilled {
                spilled += 1;
            } else {
                dropped += 1;
            }
            bytes += shed.bytes;
        }
    }
    (spilled, dropped, bytes)
}
