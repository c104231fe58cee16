//! The switch and the entry points of the opt-in bf16 GEMM (`--cpu-bf16-dot`): which kernel runs
//! (`amx.rs` where the CPU has AMX tiles, else `dot_bf16.rs`), and the frame both share with the
//! exact path (`by_panels`).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

#[cfg(target_arch = "x86_64")]
use super::{amx, by_panels, dot_bf16};
use super::{by_panels_of, gemm, panel_range, Isa, Matrix, RowMajor, MR};
use crate::{Error, Result};

/// Whether calls on bf16 weights go through AVX512-BF16 (see [`set_bf16_dot`]).
pub(super) static BF16_DOT: AtomicBool = AtomicBool::new(false);

/// The error of `--cpu-bf16-dot` on a CPU without AVX512-BF16.
fn bf16_dot_unavailable() -> Error {
    Error::CpuFeatureMissing {
        option: "--cpu-bf16-dot",
        feature: "AVX512-BF16",
        flag: "avx512_bf16",
    }
}

/// Routes every [`gemm`] on a bf16 weight (with an even `k`) through [`gemm_bf16_dot`]: the
/// activations rounded to bf16 and multiplied with `VDPBF16PS`, twice the multiply-adds per cycle,
/// as bf16 inference on a CPU usually runs (oneDNN, llama.cpp). Not HF's float32 result, which the
/// default path gives bit for bit; its error against HF is in docs/PERFORMANCE.md. Process-wide,
/// so every call switches together: a row still has the same bits alone or in a batch.
///
/// # Errors
/// [`Error::CpuFeatureMissing`] when `on` and the CPU lacks AVX512-BF16 (the setting is left off).
pub fn set_bf16_dot(on: bool) -> Result<()> {
    if on && !bf16_dot_available() {
        return Err(bf16_dot_unavailable());
    }
    BF16_DOT.store(on, Ordering::Relaxed);
    Ok(())
}

/// Whether [`set_bf16_dot`] is on.
pub fn bf16_dot() -> bool {
    BF16_DOT.load(Ordering::Relaxed)
}

/// Whether this CPU has AVX512-BF16 (AMX-BF16 CPUs have it too).
pub fn bf16_dot_available() -> bool {
    Bf16Kernel::Avx512Bf16.available()
}

/// The instructions [`gemm_bf16_dot`] runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bf16Kernel {
    /// AMX tiles (`TDPBF16PS`, Sapphire Rapids and later): 16 × 16 sums of 32 products each.
    Amx,
    /// AVX-512 (`VDPBF16PS`): one fused multiply-add chain per output (`dot_bf16.rs`).
    Avx512Bf16,
}

impl Bf16Kernel {
    /// AMX where the CPU has it, else AVX512-BF16 (or `RECALL_CPU_BF16=amx|avx512`, when the CPU
    /// has it). `None` without either.
    pub fn detect() -> Option<Bf16Kernel> {
        static KERNEL: OnceLock<Option<Bf16Kernel>> = OnceLock::new();
        *KERNEL.get_or_init(|| {
            let forced = match std::env::var("RECALL_CPU_BF16").as_deref() {
                Ok("amx") => Some(Bf16Kernel::Amx),
                Ok("avx512") => Some(Bf16Kernel::Avx512Bf16),
                _ => None,
            };
            match forced {
                Some(k) if k.available() => Some(k),
                _ => [Bf16Kernel::Amx, Bf16Kernel::Avx512Bf16]
                    .into_iter()
                    .find(|k| k.available()),
            }
        })
    }

    /// Whether this CPU (and, for AMX, the OS) can run it.
    pub fn available(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        return match self {
            Bf16Kernel::Amx => amx::available(),
            Bf16Kernel::Avx512Bf16 => dot_bf16::available(),
        };
        #[cfg(not(target_arch = "x86_64"))]
        false
    }
}

/// Whether [`gemm_bf16_dot`] can multiply by `w`: bf16, with an even `k` (every weight of the
/// Qwen-VL families; an odd `k` stays on the exact path for every call, so its rows agree too).
pub fn takes_bf16_dot(w: &Matrix<'_>) -> bool {
    matches!(w.data, RowMajor::Bf16(_)) && w.k.is_multiple_of(2)
}

/// `y = bf16(x) · Wᵀ (+ bias)` on the detected [`Bf16Kernel`], whatever [`set_bf16_dot`] says.
///
/// # Panics
/// When the CPU lacks AVX512-BF16 or `w` is not [`takes_bf16_dot`].
pub fn gemm_bf16_dot(x: &[f32], m: usize, w: &Matrix<'_>, bias: Option<&[f32]>, y: &mut [f32]) {
    let kernel = Bf16Kernel::detect().unwrap_or_else(|| panic!("{}", bf16_dot_unavailable()));
    gemm_bf16_dot_with(kernel, x, m, w, bias, y)
}

/// [`gemm_bf16_dot`] on a given kernel (which must be [`available`](Bf16Kernel::available)).
/// Each kernel has its own bits (the sums inside one AMX instruction are the hardware's); on
/// either, a row's bits do not depend on its batch.
pub fn gemm_bf16_dot_with(
    kernel: Bf16Kernel,
    x: &[f32],
    m: usize,
    w: &Matrix<'_>,
    bias: Option<&[f32]>,
    y: &mut [f32],
) {
    assert!(kernel.available(), "{kernel:?} is not available on this CPU");
    assert!(takes_bf16_dot(w), "a bf16 weight with an even k");
    #[cfg(target_arch = "x86_64")]
    dot_pass(kernel, x, m, &mut [(w, bias, y)], &[*w]);
}

/// One weight of [`gemm_shared`]: the weight, its bias and its output `y`.
pub type GemmJob<'a, 'w> = (&'a Matrix<'w>, Option<&'a [f32]>, &'a mut [f32]);

/// [`gemm`] of one `x` (`[m, k]`) by each `(w, bias, y)` of `jobs`, each `y` with the bits `gemm`
/// gives it alone. For a decode's few rows, all the weights' panels run in one parallel pass: q,
/// k and v, or gate and up, each a few megabytes, then share one start and one finish (a
/// prefill's products are long enough not to need it). Under `--cpu-bf16-dot`, `x` is rounded
/// once for all the weights (into AMX tiles for many rows).
///
/// ```
/// use recall::backend::cpu::gemm::{gemm, gemm_shared, Matrix, RowMajor};
/// let (q, kv): (Vec<f32>, Vec<f32>) = ((0..64 * 8).map(|i| i as f32).collect(), vec![0.5; 32 * 8]);
/// let (q, kv) = (Matrix::new(64, 8, RowMajor::F32(&q)), Matrix::new(32, 8, RowMajor::F32(&kv)));
/// let x = [1.0, -2.0, 0.5, 0.0, 3.0, 1.0, 1.0, 2.0];
/// let (mut yq, mut ykv) = (vec![0.0; 64], vec![0.0; 32]);
/// gemm_shared(&x, 1, &mut [(&q, None, &mut yq), (&kv, None, &mut ykv)]);
/// let mut alone = vec![0.0; 64];
/// gemm(&x, 1, &q, None, &mut alone);
/// assert_eq!(yq, alone);
/// ```
pub fn gemm_shared(x: &[f32], m: usize, jobs: &mut [GemmJob<'_, '_>]) {
    let ws: Vec<Matrix<'_>> = jobs.iter().map(|(w, ..)| **w).collect();
    let dot = |w: &Matrix<'_>| bf16_dot() && takes_bf16_dot(w);
    if jobs.len() > 1 && m < MR && !ws.iter().any(dot) {
        let isa = Isa::detect();
        return by_panels_of(x, m, jobs, None, |j, (p0, p1), y| {
            panel_range(isa, x, m, &ws[j], p0, p1, y)
        });
    }
    #[cfg(target_arch = "x86_64")]
    if jobs.len() > 1 && ws.iter().all(|w| dot(w) && w.k == ws[0].k) {
        // Many rows on AVX512-BF16 gain nothing from a shared pass (no tiles to round once).
        if let Some(kernel) = Bf16Kernel::detect().filter(|&k| k == Bf16Kernel::Amx || m < MR) {
            return dot_pass(kernel, x, m, jobs, &ws);
        }
    }
    for (w, bias, y) in jobs.iter_mut() {
        gemm(x, m, w, *bias, y);
    }
}

/// The bf16 products of `x` by each job's weight (`ws`, `jobs`' own, all bf16 of one `k`) on
/// `kernel`: `x` rounded once for all of them (into AMX tiles for many rows), and for fewer rows
/// every weight's panels in one parallel pass. One job is [`gemm_bf16_dot_with`]'s call.
#[cfg(target_arch = "x86_64")]
fn dot_pass(kernel: Bf16Kernel, x: &[f32], m: usize, jobs: &mut [GemmJob<'_, '_>], ws: &[Matrix<'_>]) {
    let Some(k) = ws.first().map(|w| w.k) else {
        return;
    };
    assert_eq!(x.len(), m * k, "x is not [{m}, {k}]");
    match kernel {
        Bf16Kernel::Amx if m > amx::FEW_ROWS => {
            let (a, steps) = amx::tile_rows(x, m, k);
            for (w, bias, y) in jobs.iter_mut() {
                amx_panels((&a, steps), x, m, w, *bias, y);
            }
        }
        Bf16Kernel::Amx => {
            let a = dot_bf16::round_pairs(x);
            let (xt, kpp) = amx::transpose_rows(&a, m, k / 2);
            by_panels_of(x, m, jobs, None, |j, p, y| {
                amx::few_rows(xt.words(), kpp, m, &ws[j], p, y)
            });
        }
        Bf16Kernel::Avx512Bf16 => {
            let a = dot_bf16::round_pairs(x);
            by_panels_of(x, m, jobs, None, |j, (p0, p1), y| {
                dot_bf16::panel_range(&a, m, &ws[j], p0, p1, y)
            });
        }
    }
}

/// Every panel of `w` on the row tiles `a` of `x` (from [`amx::tile_rows`]) into `y`.
#[cfg(target_arch = "x86_64")]
fn amx_panels(
    (a, steps): (&amx::Lines, usize),
    x: &[f32],
    m: usize,
    w: &Matrix<'_>,
    bias: Option<&[f32]>,
    y: &mut [f32],
) {
    let run = |p, y: &mut [f32]| amx::panel_range(a.words(), steps, m, w, p, y);
    let per_task = amx::task_panels(m, w.n, rayon::current_num_threads());
    by_panels(x, m, w, bias, y, per_task, run);
}
