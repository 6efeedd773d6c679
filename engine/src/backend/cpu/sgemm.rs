//! Float matrix products for the NPU path's host-side arithmetic: shadow outlier execution's
//! `outliers × weight rows` and the accuracy simulation's quantized-then-dequantized linears.
//! The kernel is the `matrixmultiply` crate's (packed, register-blocked, its own run-time
//! AVX/FMA detection: ~160 GFLOPS on one core here); rows of the output are split across threads.

/// How `b` is laid out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BLayout {
    /// `k × n`, row-major: row `i` is input channel `i` (shadow weights, channel-major).
    KByN,
    /// `n × k`, row-major: row `o` is output channel `o` (a weight matrix as the model stores it).
    NByK,
}

/// `c (m × n) = a (m × k) · b (+ c when `accumulate`)`, with `a` and `c` row-major, on up to
/// `threads` threads (split by rows of `a`). Panics if a slice does not hold its shape: the
/// callers' shapes are checked where they are built.
#[allow(clippy::too_many_arguments)]
pub fn sgemm(
    m: usize,
    k: usize,
    n: usize,
    a: &[f32],
    b: &[f32],
    layout: BLayout,
    c: &mut [f32],
    accumulate: bool,
    threads: usize,
) {
    assert!(a.len() >= m * k && b.len() >= k * n && c.len() >= m * n, "sgemm: {m}×{k} · {k}×{n} does not fit");
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            c[..m * n].fill(0.0);
        }
        return;
    }
    let threads = threads.clamp(1, m.div_ceil(16).max(1));
    let per = m.div_ceil(threads);
    let run = |a: &[f32], c: &mut [f32]| {
        let rows = c.len() / n;
        let (rsb, csb) = match layout {
            BLayout::KByN => (n as isize, 1),
            BLayout::NByK => (1, k as isize),
        };
        // SAFETY: `a` holds `rows × k` values at row stride `k`, `b` holds `k × n` values in the
        // strides `layout` names, and `c` holds `rows × n` values at row stride `n` (checked
        // above and by the split below); `c` does not alias `a` or `b` (it is a `&mut`), and
        // matrixmultiply reads and writes nothing outside those extents.
        unsafe {
            matrixmultiply::sgemm(
                rows,
                k,
                n,
                1.0,
                a.as_ptr(),
                k as isize,
                1,
                b.as_ptr(),
                rsb,
                csb,
                if accumulate { 1.0 } else { 0.0 },
                c.as_mut_ptr(),
                n as isize,
                1,
            );
        }
    };
    if threads == 1 {
        run(&a[..m * k], &mut c[..m * n]);
        return;
    }
    std::thread::scope(|s| {
        for (ai, ci) in a[..m * k].chunks(per * k).zip(c[..m * n].chunks_mut(per * n)) {
            crate::sched::count_spawned(1);
            s.spawn(move || run(ai, ci));
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(m: usize, k: usize, n: usize, a: &[f32], b: &[f32], layout: BLayout) -> Vec<f64> {
        let mut c = vec![0f64; m * n];
        for i in 0..m {
            for j in 0..n {
                c[i * n + j] = (0..k)
                    .map(|p| {
                        let bv = match layout {
                            BLayout::KByN => b[p * n + j],
                            BLayout::NByK => b[j * k + p],
                        };
                        f64::from(a[i * k + p]) * f64::from(bv)
                    })
                    .sum();
            }
        }
        c
    }

    #[test]
    fn both_layouts_and_thread_splits_equal_a_naive_product() {
        let (m, k, n) = (37, 29, 23);
        let a: Vec<f32> = (0..m * k).map(|i| ((i * 7919) % 97) as f32 / 50.0 - 1.0).collect();
        let b: Vec<f32> = (0..k * n).map(|i| ((i * 104729) % 89) as f32 / 40.0 - 1.1).collect();
        for layout in [BLayout::KByN, BLayout::NByK] {
            let want = naive(m, k, n, &a, &b, layout);
            for threads in [1, 2, 3] {
                let mut c = vec![1f32; m * n];
                sgemm(m, k, n, &a, &b, layout, &mut c, true, threads);
                for (g, w) in c.iter().zip(&want) {
                    assert!((f64::from(*g) - (w + 1.0)).abs() < 1e-4, "{g} vs {}", w + 1.0);
                }
                sgemm(m, k, n, &a, &b, layout, &mut c, false, threads);
                for (g, w) in c.iter().zip(&want) {
                    assert!((f64::from(*g) - w).abs() < 1e-4, "{g} vs {w}");
                }
            }
        }
    }
}
