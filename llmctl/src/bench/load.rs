//! `llmctl bench --load`: many clients against a running daemon (socket or kernel Binder), to
//! show arbitration: foreground time to first token under background load, and the throughput
//! batched decode gives. Bounded in time; every request is accounted for.
//!
//! Phases (each client has its own connection and session):
//! 1. **idle**: (a) one foreground client, `--idle-requests` short prompts one after another →
//!    one client's time to first token (TTFT) on an idle daemon; (b) the `--foreground`
//!    clients alone, exactly as in the mixed phase (same prompts, arrival schedule, duration) → the
//!    foreground workload's TTFT on a daemon with no background work;
//! 2. **single**: one client decodes `--decode-tokens` tokens → one sequence's decode rate;
//! 3. **batched**: `--clients` clients each decode `--decode-tokens` tokens at once → aggregate
//!    decode rate while all of them are decoding (from the last one's first token to the first
//!    one's last). Phases 2 and 3 alternate for `--decode-rounds` rounds (a slow spell of a
//!    shared machine then hits both); `batch_decode_gain` = the median of the rounds'
//!    batched / single (same short prompts);
//! 4. **mixed**: `--foreground` clients send short foreground prompts on a fixed schedule
//!    (gaps of 0.8–1.6 s, staggered per client, the same as in 1b) while
//!    the rest send long background prompts, for `--duration-s`; then no new requests and every
//!    outstanding one must finish. `fg_p99_ttft_ratio` = foreground p99 TTFT here / p99 of the
//!    same foreground clients alone (1b): what the background load costs the foreground.
//!    Two foreground prompts that arrive together delay each other, at the same moments in
//!    both phases (the schedule does not depend on the replies); 1a's
//!    single client never sees that, so the ratio against 1a (`fg_p99_vs_one_client`) is
//!    printed too.
//!
//! TTFT is measured by the client: from the `generate` call to the first streamed tokens. The
//! slowest foreground prompt of 1b and of 4 is also split with the
//! daemon's own `onCompleted` figures into queue wait, prefill (the rest of the daemon's TTFT)
//! and delivery, so a high p99 says where it came from (a prompt whose prefill shares its
//! passes with another's shows a long prefill and no queue wait).
//! A request is lost if no terminal callback (completed or error) arrives, duplicated if a
//! second one does (checked by draining every request's callback channel at the end).

use super::{percentile, LoadArgs};
use crate::client::{self, Connection, Event};
use llmd_aidl::GenerateRequest::GenerateRequest;
use llmd_aidl::Priority::Priority;
use serde_json::json;
use std::path::Path;
use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant};

/// How long a request may take before it counts as lost.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(300);

/// One request's outcome as the client saw it.
#[derive(Clone, Debug)]
struct Outcome {
    foreground: bool,
    ttft: Option<Duration>,
    first: Option<Instant>,
    last: Option<Instant>,
    tokens: usize,
    /// Arrival time of each streamed token.
    times: Vec<Instant>,
    error: Option<String>,
    /// The daemon's own figures from `onCompleted`: (queue wait, time to first token) in ms.
    server: Option<(i64, i64)>,
}

fn prompt(foreground: bool, i: u64) -> String {
    let base = super::BENCH_TEXT;
    if foreground {
        // ~45 tokens: a short interactive prompt.
        format!("Question {i}: {}", &base[..220])
    } else {
        // ~200 tokens: a long background job.
        format!("Document {i}. {base}")
    }
}

fn request(text: String, max_tokens: i32, foreground: bool) -> GenerateRequest {
    GenerateRequest {
        prompt: text,
        maxTokens: max_tokens,
        priority: if foreground { Priority::FOREGROUND } else { Priority::BACKGROUND },
        ..GenerateRequest::default()
    }
}

struct Client {
    _conn: Connection,
    session: rsbinder::Strong<dyn llmd_aidl::ILlmSession::ILlmSession>,
    /// Callback channels of finished requests, drained at the end to find duplicates.
    done: Vec<Receiver<Event>>,
}

impl Client {
    fn new(socket: Option<&Path>, service: &str, model: Option<&str>) -> Result<Self, String> {
        let conn = client::connect(socket, service)?;
        let session = client::open_session(&conn, model)?;
        Ok(Self { _conn: conn, session, done: Vec::new() })
    }

    /// One independent request: the session is reset first, so contexts do not pile up.
    fn run(&mut self, req: &GenerateRequest, foreground: bool) -> Outcome {
        let mut o = Outcome {
            foreground,
            ttft: None,
            first: None,
            last: None,
            tokens: 0,
            times: Vec::new(),
            error: None,
            server: None,
        };
        if let Err(e) = self.session.reset() {
            o.error = Some(client::describe(&e));
            return o;
        }
        let (cb, _tx, rx) = client::callback();
        let t0 = Instant::now();
        if let Err(e) = self.session.generate(req, &cb) {
            o.error = Some(client::describe(&e));
            return o;
        }
        loop {
            match rx.recv_timeout(REQUEST_TIMEOUT.saturating_sub(t0.elapsed())) {
                Ok(Event::Tokens(_, ids)) => {
                    let now = Instant::now();
                    if o.first.is_none() {
                        o.first = Some(now);
                        o.ttft = Some(now - t0);
                    }
                    o.last = Some(now);
                    o.tokens += ids.len();
                    o.times.extend(std::iter::repeat_n(now, ids.len()));
                }
                Ok(Event::Completed(stats)) => {
                    o.server = Some((stats.queueWaitMs, stats.timeToFirstTokenMs));
                    break;
                }
                Ok(Event::Error(code, m)) => {
                    o.error = Some(format!("{m} (code {code})"));
                    break;
                }
                Ok(_) => {}
                Err(_) => {
                    o.error = Some("lost: no completion within the timeout".into());
                    break;
                }
            }
        }
        self.done.push(rx);
        o
    }

    /// Terminal callbacks that arrived after a request had already ended.
    fn duplicates(&self) -> usize {
        self.done
            .iter()
            .map(|rx| rx.try_iter().filter(|e| matches!(e, Event::Completed(_) | Event::Error(..))).count())
            .sum()
    }
}

/// Foreground client `i`'s gap before its prompt `k`: 0.8–1.6 s.
fn fg_gap_ms(i: u64, k: u64) -> u64 {
    800 + (211 * (k + 3 * i) + 97 * i) % 800
}

/// `n` clients for `duration_s`: the first `args.foreground` send short foreground prompts
/// on a fixed schedule (gaps of 0.8–1.6 s, staggered per client), the rest long background prompts back to back;
/// then no new requests, and every outstanding one runs to its end. Duplicates add to `dup`.
fn clients_for(
    socket: Option<&Path>,
    service: &str,
    model: Option<&str>,
    args: &LoadArgs,
    n: u64,
    duration_s: u64,
    dup: &mut usize,
) -> Result<Vec<Outcome>, String> {
    let start = Instant::now();
    let stop_at = start + Duration::from_secs(duration_s);
    let per_client: Vec<(Vec<Outcome>, usize)> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..n)
            .map(|i| {
                let fg = i < args.foreground;
                s.spawn(move || -> Result<(Vec<Outcome>, usize), String> {
                    let mut c = Client::new(socket, service, model)?;
                    let mut outs = Vec::new();
                    let mut k = 0u64;
                    let mut due = start;
                    while Instant::now() < stop_at {
                        if fg {
                            // Interactive prompts arrive on a fixed schedule from the phase's
                            // start (gaps of 0.8–1.6 s, different per client so foreground
                            // clients do not march in step), not a think time after each
                            // reply: the same arrivals in the loaded phase as alone, so two
                            // prompts that collide do so in both and the ratio compares like
                            // with like. A prompt due while the client's last one still runs
                            // goes once it ends (one request per session).
                            due += Duration::from_millis(fg_gap_ms(i, k));
                            if due >= stop_at {
                                break;
                            }
                            std::thread::sleep(due.saturating_duration_since(Instant::now()));
                            outs.push(c.run(&request(prompt(true, 1000 * i + k), 16, true), true));
                        } else {
                            outs.push(c.run(&request(prompt(false, 1000 * i + k), 64, false), false));
                        }
                        k += 1;
                    }
                    Ok((outs, c.duplicates()))
                })
            })
            .collect();
        hs.into_iter().filter_map(|h| h.join().ok()).collect::<Result<Vec<_>, String>>()
    })?;
    Ok(per_client
        .into_iter()
        .flat_map(|(o, d)| {
            *dup += d;
            o
        })
        .collect())
}

/// Tokens per second streamed by all of `outs` while every one of them was decoding: from the
/// latest first token to the earliest last token (so prefills and stragglers do not count).
fn decode_rate(outs: &[Outcome]) -> f64 {
    let (Some(from), Some(to)) = (outs.iter().filter_map(|o| o.first).max(), outs.iter().filter_map(|o| o.last).min())
    else {
        return 0.0;
    };
    if to <= from {
        return 0.0;
    }
    let n: usize = outs.iter().map(|o| o.times.iter().filter(|&&t| t > from && t <= to).count()).sum();
    n as f64 / (to - from).as_secs_f64()
}

pub fn run(
    socket: Option<&Path>,
    service: &str,
    args: &LoadArgs,
    decode_tokens: usize,
    json_out: bool,
) -> Result<(), String> {
    if args.foreground >= args.clients {
        return Err("--foreground must leave at least one background client".into());
    }
    let model = args.model.as_deref();
    let say = |m: &str| {
        if !json_out {
            eprintln!("{m}");
        }
    };
    // 1. Idle foreground TTFT.
    say("phase 1/4: idle daemon: one foreground client");
    let mut dup = 0usize;
    let mut decode_outcomes: Vec<Outcome> = Vec::new();
    let mut c = Client::new(socket, service, model)?;
    let mut idle = Vec::new();
    for i in 0..args.idle_requests {
        idle.push(c.run(&request(prompt(true, i), 16, true), true));
    }
    say(&format!("phase 1/4: idle daemon: the {} foreground clients alone for {} s", args.foreground, args.duration_s));
    let fg_alone = clients_for(socket, service, model, args, args.foreground, args.duration_s, &mut dup)?;
    // 2 and 3, alternated for `--decode-rounds` rounds so that a slow spell of a shared
    // machine hits both sides of the ratio: one sequence decoding, then all clients at once.
    let mut rounds: Vec<(f64, f64)> = Vec::new();
    for r in 0..args.decode_rounds {
        say(&format!("phase 2/4 (round {}/{}): one sequence decoding", r + 1, args.decode_rounds));
        let single = c.run(&request(prompt(true, r), decode_tokens as i32, true), true);
        say(&format!(
            "phase 3/4 (round {}/{}): {} sequences decoding at once",
            r + 1,
            args.decode_rounds,
            args.clients
        ));
        let batched: Vec<Outcome> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..args.clients)
                .map(|i| {
                    s.spawn(move || -> Result<(Outcome, usize), String> {
                        let mut c = Client::new(socket, service, model)?;
                        let o = c.run(&request(prompt(true, 100 * (r + 1) + i), decode_tokens as i32, true), true);
                        Ok((o, c.duplicates()))
                    })
                })
                .collect();
            hs.into_iter().filter_map(|h| h.join().ok()).collect::<Result<Vec<_>, String>>()
        })?
        .into_iter()
        .map(|(o, d)| {
            dup += d;
            o
        })
        .collect();
        rounds.push((decode_rate(std::slice::from_ref(&single)), decode_rate(&batched)));
        decode_outcomes.push(single);
        decode_outcomes.extend(batched);
    }
    dup += c.duplicates();
    drop(c);
    // 4. Mixed load.
    say(&format!(
        "phase 4/4: {} foreground + {} background clients for {} s",
        args.foreground,
        args.clients - args.foreground,
        args.duration_s
    ));
    let t_mixed = Instant::now();
    let mixed = clients_for(socket, service, model, args, args.clients, args.duration_s, &mut dup)?;
    let mixed_s = t_mixed.elapsed().as_secs_f64();
    std::thread::sleep(Duration::from_millis(300));

    let ttfts =
        |v: &[Outcome]| -> Vec<f64> { v.iter().filter_map(|o| o.ttft).map(|d| d.as_secs_f64() * 1e3).collect() };
    let idle_t = ttfts(&idle);
    let fg: Vec<Outcome> = mixed.iter().filter(|o| o.foreground).cloned().collect();
    let bg: Vec<Outcome> = mixed.iter().filter(|o| !o.foreground).cloned().collect();
    let fg_t = ttfts(&fg);
    let bg_t = ttfts(&bg);
    let median = |mut v: Vec<f64>| -> f64 {
        v.sort_by(|a, b| a.total_cmp(b));
        if v.is_empty() {
            f64::NAN
        } else {
            v[v.len() / 2]
        }
    };
    let single_rate = median(rounds.iter().map(|r| r.0).collect());
    let batched_rate = median(rounds.iter().map(|r| r.1).collect());
    let gain = median(rounds.iter().map(|r| r.1 / r.0).collect());
    let errors: Vec<String> =
        idle.iter().chain(&fg_alone).chain(&decode_outcomes).chain(&mixed).filter_map(|o| o.error.clone()).collect();
    let lost = errors.iter().filter(|e| e.starts_with("lost")).count();
    let bg_failed = bg.iter().filter(|o| o.error.is_some()).count();
    let alone_t = ttfts(&fg_alone);
    let fg_ratio = percentile(&fg_t, 99.0) / percentile(&alone_t, 99.0);
    let fg_vs_one = percentile(&fg_t, 99.0) / percentile(&idle_t, 99.0);
    let class_rate = |v: &[Outcome]| v.iter().map(|o| o.tokens).sum::<usize>() as f64 / mixed_s;
    // The slowest foreground prompt of a phase, split into the
    // daemon's queue wait, the rest of the daemon's time to first token, and delivery (the
    // client's time to first token beyond the daemon's).
    let slowest = |v: &[Outcome]| -> Option<(f64, i64, i64)> {
        let o = v.iter().filter(|o| o.ttft.is_some()).max_by_key(|o| o.ttft)?;
        let (wait, ttft) = o.server?;
        Some((o.ttft?.as_secs_f64() * 1e3, wait, ttft))
    };
    let slow = [("foreground clients alone", slowest(&fg_alone)), ("loaded foreground", slowest(&fg))];
    if json_out {
        crate::out!(
            "{}",
            json!({
                "clients": args.clients, "foreground_clients": args.foreground, "duration_s": args.duration_s,
                "idle_ttft_ms_p50": percentile(&idle_t, 50.0), "idle_ttft_ms_p99": percentile(&idle_t, 99.0),
                "fg_alone_ttft_ms_p50": percentile(&alone_t, 50.0), "fg_alone_ttft_ms_p99": percentile(&alone_t, 99.0),
                "fg_alone_requests": fg_alone.len(), "fg_p99_vs_one_client": fg_vs_one,
                "fg_ttft_ms_p50": percentile(&fg_t, 50.0), "fg_ttft_ms_p99": percentile(&fg_t, 99.0),
                "bg_ttft_ms_p50": percentile(&bg_t, 50.0), "bg_ttft_ms_p99": percentile(&bg_t, 99.0),
                "fg_tok_s": class_rate(&fg), "bg_tok_s": class_rate(&bg),
                "fg_requests": fg.len(), "bg_requests": bg.len(),
                "single_decode_tok_s": single_rate, "batched_decode_tok_s": batched_rate,
                "decode_rounds": rounds.iter().map(|r| json!({"single_tok_s": r.0, "batched_tok_s": r.1, "gain": r.1 / r.0})).collect::<Vec<_>>(),
                "fg_p99_ttft_ratio": fg_ratio, "batch_decode_gain": gain,
                "errors": errors.len(), "lost": lost, "duplicated": dup, "bg_failed": bg_failed,
                "fg_alone_slowest_ms": slow[0].1.map(|(c, w, t)| json!({"client_ttft": c, "server_queue_wait": w, "server_ttft": t})),
                "fg_slowest_ms": slow[1].1.map(|(c, w, t)| json!({"client_ttft": c, "server_queue_wait": w, "server_ttft": t})),
            })
        );
    } else {
        crate::out!("{:<34} {:>10} {:>10} {:>9}", "figure", "p50", "p99", "requests");
        for (name, t, n) in [
            ("idle, one client TTFT ms", &idle_t, idle.len()),
            ("idle, foreground clients TTFT ms", &alone_t, fg_alone.len()),
            ("loaded foreground TTFT ms", &fg_t, fg.len()),
            ("loaded background TTFT ms", &bg_t, bg.len()),
        ] {
            crate::out!("{name:<34} {:>10.0} {:>10.0} {n:>9}", percentile(t, 50.0), percentile(t, 99.0));
        }
        crate::out!("tokens/s under load: foreground {:.1}, background {:.1}", class_rate(&fg), class_rate(&bg));
        for (i, r) in rounds.iter().enumerate() {
            crate::out!(
                "decode round {}: one sequence {:.1} tok/s, {} at once {:.1} tok/s in all (gain {:.2}x)",
                i + 1,
                r.0,
                args.clients,
                r.1,
                r.1 / r.0
            );
        }
        crate::out!(
            "decode (medians of {} rounds): one sequence {single_rate:.1} tok/s, {} at once {batched_rate:.1} tok/s, batch_decode_gain {gain:.2}x",
            rounds.len(),
            args.clients
        );
        crate::out!("fg_p99_ttft_ratio {fg_ratio:.2} (loaded p99 / p99 of the foreground clients alone)");
        crate::out!("fg_p99_vs_one_client {fg_vs_one:.2} (loaded p99 / one idle client's p99)");
        for (name, s) in &slow {
            if let Some((client, wait, ttft)) = s {
                crate::out!(
                    "slowest {name}: TTFT {client:.0} ms = daemon queue wait {wait} + daemon prefill {} + delivery {:.0}",
                    ttft - wait,
                    client - *ttft as f64
                );
            }
        }
        crate::out!("requests: {} errors, {lost} lost, {dup} duplicated, {bg_failed} background failed", errors.len());
        for e in errors.iter().take(5) {
            crate::out!("  error: {e}");
        }
    }
    if lost > 0 || dup > 0 || bg_failed > 0 {
        return Err(format!("{lost} lost, {dup} duplicated, {bg_failed} background requests failed"));
    }
    Ok(())
}
