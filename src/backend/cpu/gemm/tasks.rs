//! How a call's output columns are split among threads: runs of panels, each task writing its
//! columns of every row. The split depends on the thread count, never the arithmetic (each output
//! is one chain over `k` whichever task computes it), so it is free to change.

use rayon::prelude::*;

use super::{GemmJob, Matrix, NP, NR};

/// Runs `range` over runs of panels of `w` in parallel, each writing its columns of every row of
/// `y`, then adds the bias: the shared frame of every path. A task holds `per_task` panels where
/// the caller asks (fewer, longer runs where a block merits a pass of `x`), else about 8 per thread.
pub(super) fn by_panels(
    x: &[f32],
    m: usize,
    w: &Matrix<'_>,
    bias: Option<&[f32]>,
    y: &mut [f32],
    per_task: Option<usize>,
    range: impl Fn((usize, usize), &mut [f32]) + Sync,
) {
    by_panels_of(x, m, &mut [(w, bias, y)], per_task, |_, p, y| range(p, y));
}

/// [`by_panels`] of one `x` by several weights in one parallel pass: `range(j, panels, y)` for
/// runs of weight `j`'s panels, a task never spanning two weights. For a decode, whose calls each
/// stream a few megabytes, one pass over q, k and v (or gate and up) instead of one per weight
/// saves each one's start and its threads' uneven finish.
pub(super) fn by_panels_of(
    x: &[f32],
    m: usize,
    jobs: &mut [GemmJob<'_, '_>],
    per_task: Option<usize>,
    range: impl Fn(usize, (usize, usize), &mut [f32]) + Sync,
) {
    // About 8 tasks per thread even out the threads' shares (with 4, 2048 columns left one of 2
    // cores idle a tenth of the time). Tasks are whole groups of NP panels, the kernel's width.
    let groups: usize = jobs.iter().map(|(w, ..)| w.n.div_ceil(NR).div_ceil(NP)).sum();
    let per_task = per_task.unwrap_or_else(|| groups.div_ceil(rayon::current_num_threads() * 8).max(1) * NP);
    assert!(per_task > 0, "a task holds panels");
    let mut outs = Vec::with_capacity(jobs.len());
    for (w, bias, y) in jobs.iter_mut() {
        let (k, n) = (w.k, w.n);
        assert_eq!(x.len(), m * k, "x is not [{m}, {k}]");
        assert_eq!(y.len(), m * n, "y is not [{m}, {n}]");
        assert!(bias.is_none_or(|b| b.len() == n), "bias is not [{n}]");
        if k == 0 {
            // An empty sum: every element is 0 (+ bias).
            y.fill(0.0);
        }
        outs.push((n, *bias, y.as_mut_ptr() as usize));
    }
    if m == 0 {
        return;
    }
    let tasks: Vec<(usize, usize, usize)> = outs
        .iter()
        .enumerate()
        .flat_map(|(j, &(n, ..))| {
            let panels = n.div_ceil(NR);
            (0..panels)
                .step_by(per_task)
                .map(move |p0| (j, p0, (p0 + per_task).min(panels)))
        })
        .collect();
    tasks.into_par_iter().for_each(|(j, p0, p1)| {
        let (n, bias, y_addr) = outs[j];
        // SAFETY: `y_addr` is job `j`'s `y` (`m * n` values, asserted above), borrowed mutably
        // for this call; tasks cover disjoint panel ranges of each job, so they write disjoint
        // columns, and the parallel loop ends before the borrow does.
        let y = unsafe { std::slice::from_raw_parts_mut(y_addr as *mut f32, m * n) };
        range(j, (p0, p1), y);
        // The bias of the task's columns, on all threads (as one pass after the loop, it was a
        // single-threaded sweep over all of `y`).
        if let Some(b) = bias {
            let (c0, c1) = (p0 * NR, (p1 * NR).min(n));
            for row in y.chunks_mut(n) {
                row[c0..c1].iter_mut().zip(&b[c0..c1]).for_each(|(v, b)| *v += b);
            }
        }
    });
}
