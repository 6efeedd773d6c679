//! A schedule as a Gantt chart in SVG: one lane per processor, each job or operator a bar, for
//! `llmctl plan --svg` (a modelled schedule) and `llmctl dump --timeline` (a real request's
//! jobs). Written by hand: a few dozen elements, no crate needed.
//!
//! The SVG is for people and for tests alike: each lane is a `<g class="lane" data-lane=…>`,
//! each bar a `<rect class="bar" data-lane=… data-start-ms=… data-end-ms=… data-label=…>` in
//! the order of its start, and a hand-off between lanes (a bar whose predecessor on the same
//! request ran on another lane) a `<line class="handoff">`.

use std::fmt::Write as _;

/// One bar: on `lane`, from `start_ms` to `end_ms` (milliseconds from the chart's origin).
#[derive(Clone, Debug, PartialEq)]
pub struct Bar {
    pub lane: String,
    pub label: String,
    /// Bars of one group (a request) are joined by hand-off lines where they change lanes.
    pub group: Option<u64>,
    pub start_ms: f64,
    pub end_ms: f64,
}

const LANE_H: f64 = 36.0;
const LEFT: f64 = 90.0;
const WIDTH: f64 = 1000.0;
const TOP: f64 = 40.0;

fn escape(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

/// The colour of a bar's group (or of its lane when it has none).
fn colour(i: u64) -> &'static str {
    const C: [&str; 8] = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#9c755f"];
    C[(i % C.len() as u64) as usize]
}

/// The chart of `bars` on `lanes` (in that order, top to bottom; a bar on a lane not listed
/// gets a lane of its own below), titled `title`.
pub fn svg(title: &str, lanes: &[&str], bars: &[Bar]) -> String {
    let mut names: Vec<String> = lanes.iter().map(|s| s.to_string()).collect();
    for b in bars {
        if !names.contains(&b.lane) {
            names.push(b.lane.clone());
        }
    }
    let mut sorted: Vec<&Bar> = bars.iter().collect();
    sorted.sort_by(|a, b| a.start_ms.total_cmp(&b.start_ms).then(a.end_ms.total_cmp(&b.end_ms)));
    let t0 = sorted.first().map_or(0.0, |b| b.start_ms);
    let t1 = sorted.iter().map(|b| b.end_ms).fold(t0, f64::max);
    let span = (t1 - t0).max(1e-9);
    let x = |t: f64| LEFT + (t - t0) / span * WIDTH;
    let lane_y = |l: &str| TOP + names.iter().position(|n| n == l).unwrap_or(0) as f64 * LANE_H;
    let height = TOP + names.len() as f64 * LANE_H + 30.0;
    let mut out = String::new();
    let _ = writeln!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{height}" font-family="sans-serif" font-size="11">"#,
        w = LEFT + WIDTH + 20.0
    );
    let _ = writeln!(out, r#"<text x="4" y="16" font-size="13">{}</text>"#, escape(title));
    for (i, n) in names.iter().enumerate() {
        let y = TOP + i as f64 * LANE_H;
        let _ = writeln!(out, r#"<g class="lane" data-lane="{n}">"#, n = escape(n));
        let _ = writeln!(
            out,
            r##"<rect x="0" y="{y}" width="{w}" height="{LANE_H}" fill="{f}"/><text x="4" y="{ty}">{n}</text>"##,
            w = LEFT + WIDTH + 20.0,
            f = if i % 2 == 0 { "#f4f4f4" } else { "#ffffff" },
            ty = y + LANE_H / 2.0 + 4.0,
            n = escape(n)
        );
        out.push_str("</g>\n");
    }
    let mut last: Vec<(u64, &Bar)> = Vec::new();
    for b in &sorted {
        let y = lane_y(&b.lane) + 4.0;
        let w = (x(b.end_ms) - x(b.start_ms)).max(1.0);
        let fill = colour(b.group.unwrap_or_else(|| names.iter().position(|n| *n == b.lane).unwrap_or(0) as u64));
        let _ = writeln!(
            out,
            r##"<rect class="bar" data-lane="{l}" data-start-ms="{s:.3}" data-end-ms="{e:.3}" data-label="{lb}" x="{bx:.2}" y="{y}" width="{w:.2}" height="{h}" fill="{fill}" stroke="#333" stroke-width="0.5"><title>{lb} on {l}: {s:.1}–{e:.1} ms</title></rect>"##,
            l = escape(&b.lane),
            s = b.start_ms - t0,
            e = b.end_ms - t0,
            lb = escape(&b.label),
            bx = x(b.start_ms),
            h = LANE_H - 8.0,
        );
        if let Some(g) = b.group {
            if let Some((_, prev)) = last.iter().find(|(k, _)| *k == g) {
                if prev.lane != b.lane {
                    let _ = writeln!(
                        out,
                        r##"<line class="handoff" x1="{x1:.2}" y1="{y1}" x2="{x2:.2}" y2="{y2}" stroke="#c00" stroke-dasharray="3,2"/>"##,
                        x1 = x(prev.end_ms),
                        y1 = lane_y(&prev.lane) + LANE_H / 2.0,
                        x2 = x(b.start_ms),
                        y2 = y + LANE_H / 2.0 - 4.0
                    );
                }
            }
            last.retain(|(k, _)| *k != g);
            last.push((g, b));
        }
    }
    let _ = writeln!(
        out,
        r#"<text x="{LEFT}" y="{ty}">0 ms</text><text x="{xe}" y="{ty}" text-anchor="end">{span:.1} ms</text>"#,
        ty = height - 10.0,
        xe = LEFT + WIDTH
    );
    out.push_str("</svg>\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lanes_bars_in_time_order_and_handoffs() {
        let bar = |lane: &str, s: f64, e: f64| Bar {
            lane: lane.into(),
            label: "x<1>".into(),
            group: Some(7),
            start_ms: s,
            end_ms: e,
        };
        let s =
            svg("t", &["npu", "gpu", "cpu"], &[bar("gpu", 30.0, 40.0), bar("npu", 10.0, 20.0), bar("npu", 20.0, 30.0)]);
        assert_eq!(s.matches(r#"class="lane""#).count(), 3);
        let starts: Vec<f64> = s
            .match_indices("data-start-ms=\"")
            .map(|(i, m)| s[i + m.len()..].split('"').next().expect("a value").parse().expect("a number"))
            .collect();
        assert_eq!(starts, vec![0.0, 10.0, 20.0]);
        assert_eq!(s.matches(r#"class="handoff""#).count(), 1, "npu to gpu once");
        assert!(s.contains("x&lt;1&gt;"), "labels escaped");
    }
}
