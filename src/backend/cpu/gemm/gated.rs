//! Two products of one `x` that meet elementwise as soon as they exist: a SwiGLU MLP's gate and
//! up, `y ← f(x·Gᵀ, x·Uᵀ)`. Each task runs both products on its block of columns and applies `f`
//! while the block is in cache, so the up projection is never written out whole (the 2B model's
//! is 31 MB per layer at 1,278 rows) nor read back by a pass of its own.
//!
//! Every value has the bits of [`gemm`](super::gemm) for each product, then `f`: a product's
//! columns do not depend on which other columns run beside them (each output is one chain over
//! `k` in the kernel's fixed order, on any path), and `f` is elementwise.

use std::cell::RefCell;

#[cfg(target_arch = "x86_64")]
use super::bf16::{bf16_dot, takes_bf16_dot, Bf16Kernel};
#[cfg(target_arch = "x86_64")]
use super::{amx, dot_bf16};
use super::{by_panels, panel_range, Isa, Matrix, RowMajor, NR, WIDE_ROWS};

/// One product of [`gemm_gated`]: the weight and its bias.
pub type GatedWeight<'a, 'w> = (&'a Matrix<'w>, Option<&'a [f32]>);

thread_local! {
    /// Each thread's block of the second product, reused across calls.
    static SECOND: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Which kernel both products run on: what [`gemm`](super::gemm) would pick for each weight alone.
#[derive(Clone, Copy)]
enum RouteKind {
    Exact,
    #[cfg(target_arch = "x86_64")]
    Amx,
    #[cfg(target_arch = "x86_64")]
    Dot,
}

impl RouteKind {
    /// The route of `m` rows by `gate` and `up`, or `None` where [`gemm_gated`] does not fuse
    /// them: the weights differ in shape or in route, there are fewer than 32 rows (decode's
    /// paths: the weight's own panels, rows fused into the packing), or `k` is 0.
    fn of(m: usize, gate: &Matrix<'_>, up: &Matrix<'_>) -> Option<RouteKind> {
        if m < WIDE_ROWS || gate.n != up.n || gate.k != up.k || gate.k == 0 {
            return None;
        }
        #[cfg(target_arch = "x86_64")]
        if bf16_dot() && (takes_bf16_dot(gate) || takes_bf16_dot(up)) {
            return match (takes_bf16_dot(gate) && takes_bf16_dot(up), Bf16Kernel::detect()) {
                (true, Some(Bf16Kernel::Amx)) => Some(RouteKind::Amx),
                (true, Some(Bf16Kernel::Avx512Bf16)) => Some(RouteKind::Dot),
                _ => None,
            };
        }
        Some(RouteKind::Exact)
    }

    /// The route with `x` (`[m, k]`) prepared for it once: rounded into AMX tiles or bf16 pairs.
    #[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
    fn prepare(self, x: &[f32], m: usize, k: usize) -> Route {
        match self {
            RouteKind::Exact => Route::Exact(Isa::detect()),
            #[cfg(target_arch = "x86_64")]
            RouteKind::Amx => {
                let (a, steps) = amx::tile_rows(x, m, k);
                Route::Amx(a, steps)
            }
            #[cfg(target_arch = "x86_64")]
            RouteKind::Dot => Route::Dot(dot_bf16::round_pairs(x)),
        }
    }
}

/// A [`RouteKind`] with `x` prepared for its kernel.
enum Route {
    Exact(Isa),
    #[cfg(target_arch = "x86_64")]
    Amx(amx::Lines, usize),
    #[cfg(target_arch = "x86_64")]
    Dot(Vec<u32>),
}

impl Route {
    /// Panels per task where the route's `gemm` asks `by_panels` for its own (AMX: one packed
    /// block each); `None` for `by_panels`' default.
    #[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
    fn per_task(&self, m: usize, n: usize) -> Option<usize> {
        #[cfg(target_arch = "x86_64")]
        if let Route::Amx(..) = self {
            return amx::task_panels(m, n, rayon::current_num_threads());
        }
        None
    }

    /// Columns of panels `p0..p1` of `w`'s product, for every row, into `y` (`[m, w.n]`).
    fn run(&self, x: &[f32], m: usize, w: &Matrix<'_>, (p0, p1): (usize, usize), y: &mut [f32]) {
        match self {
            Route::Exact(isa) => panel_range(*isa, x, m, w, p0, p1, y),
            #[cfg(target_arch = "x86_64")]
            Route::Amx(a, steps) => amx::panel_range(a.words(), *steps, m, w, (p0, p1), y),
            #[cfg(target_arch = "x86_64")]
            Route::Dot(a) => dot_bf16::panel_range(a, m, w, p0, p1, y),
        }
    }
}

/// Whether [`gemm_gated`] fuses `m` rows by `gate` and `up` (else the caller runs the two
/// products and `f` on their own, with the same bits).
pub fn fuses_gated(m: usize, gate: &Matrix<'_>, up: &Matrix<'_>) -> bool {
    RouteKind::of(m, gate, up).is_some()
}

/// `y ← f(x·Gᵀ (+ g), x·Uᵀ (+ u))` for `x` `[m, k]` and `y` `[m, n]`, where `f(a, b)` overwrites
/// `a` with its values: each value has the bits of [`gemm`](super::gemm) of each product, then
/// `f`.
///
/// # Panics
/// Unless [`fuses_gated`] (the caller checks, and runs the products on their own otherwise), or
/// when `x`, `y` or a bias has the wrong length.
///
/// ```
/// use recall::backend::cpu::gemm::{fuses_gated, gemm, gemm_gated, Matrix, RowMajor};
/// let (m, n, k) = (32, 20, 3);
/// let x: Vec<f32> = (0..m * k).map(|i| i as f32 * 0.25).collect();
/// let (g, u): (Vec<f32>, Vec<f32>) = (0..n * k).map(|i| (i as f32 - 7.0, 0.5 * i as f32)).unzip();
/// let (g, u) = (Matrix::new(n, k, RowMajor::F32(&g)), Matrix::new(n, k, RowMajor::F32(&u)));
/// assert!(fuses_gated(m, &g, &u));
/// let mut y = vec![0.0; m * n];
/// gemm_gated(&x, m, (&g, None), (&u, None), &mut y, |a, b| {
///     a.iter_mut().zip(b).for_each(|(a, b)| *a *= b)
/// });
/// let (mut yg, mut yu) = (vec![0.0; m * n], vec![0.0; m * n]);
/// gemm(&x, m, &g, None, &mut yg);
/// gemm(&x, m, &u, None, &mut yu);
/// assert!(y.iter().zip(yg.iter().zip(&yu)).all(|(y, (g, u))| y.to_bits() == (g * u).to_bits()));
/// ```
pub fn gemm_gated(
    x: &[f32],
    m: usize,
    (gate, gate_bias): GatedWeight<'_, '_>,
    (up, up_bias): GatedWeight<'_, '_>,
    y: &mut [f32],
    f: impl Fn(&mut [f32], &[f32]) + Sync,
) {
    let kind = RouteKind::of(m, gate, up).expect("gemm_gated on weights it fuses (fuses_gated)");
    let (n, k) = (gate.n, gate.k);
    for b in [gate_bias, up_bias].into_iter().flatten() {
        assert_eq!(b.len(), n, "bias is not [{n}]");
    }
    let route = kind.prepare(x, m, k);
    // `by_panels` owns the tasks (and checks `x` and `y`); the biases are added here, before `f`,
    // each after its product as `gemm` adds it.
    by_panels(x, m, gate, None, y, route.per_task(m, n), |(p0, p1), y| {
        route.run(x, m, gate, (p0, p1), y);
        // The second product's columns `c0..c1`, as the product by those rows of `U` alone.
        let (c0, c1) = (p0 * NR, (p1 * NR).min(n));
        let width = c1 - c0;
        let up_cols = outputs(up, c0, c1);
        SECOND.with_borrow_mut(|second| {
            second.resize(m * width, 0.0);
            route.run(x, m, &up_cols, (0, width.div_ceil(NR)), second);
            for (row, s) in y.chunks_mut(n).zip(second.chunks_mut(width)) {
                let g = &mut row[c0..c1];
                if let Some(b) = gate_bias {
                    g.iter_mut().zip(&b[c0..c1]).for_each(|(v, b)| *v += b);
                }
                if let Some(b) = up_bias {
                    s.iter_mut().zip(&b[c0..c1]).for_each(|(v, b)| *v += b);
                }
                f(g, s);
            }
        });
    });
}

/// Rows `c0..c1` of `w` (outputs `c0..c1` of its product) as a weight of their own.
fn outputs<'w>(w: &Matrix<'w>, c0: usize, c1: usize) -> Matrix<'w> {
    let k = w.k;
    let data = match w.data {
        RowMajor::F32(v) => RowMajor::F32(&v[c0 * k..c1 * k]),
        RowMajor::Bf16(b) => RowMajor::Bf16(&b[c0 * k * 2..c1 * k * 2]),
        RowMajor::F16(b) => RowMajor::F16(&b[c0 * k * 2..c1 * k * 2]),
    };
    Matrix::new(c1 - c0, k, data)
}
