//! The CPU GEMM behind `linear`: `y = x · Wᵀ (+ b)` for `x: [m, k]`, `W: [n, k]`.
//!
//! **The reduction order is fixed by construction.** Every output element is one sequential fused
//! multiply-add chain over `k` in increasing order, starting from `0.0`, and the bias is added once
//! at the end:
//!
//! ```text
//! acc = 0;  for i in 0..k { acc = fma(x[r][i], W[c][i], acc) };  y[r][c] = acc + b[c]
//! ```
//!
//! The kernels vectorise across output columns (16 at a time, a "panel"), never across `k`, and
//! carry partial sums through memory between blocks of `k` (an f32 stored and reloaded is the same
//! f32). So the tiling over rows, columns and `k`, the number of threads, how many rows share the
//! call and the instruction set cannot change a single bit: a row decoded alone equals the same row
//! in a 4,096-row prefill, on every path — AVX-512F, AVX2 with FMA, NEON, and the portable
//! `f32::mul_add` loop that defines the result.
//!
//! **The weight is read where it lies**, row-major in the checkpoint's mapping, in its own dtype:
//! nothing is packed at load and no second copy of the model is kept. Each call packs the block of
//! the weight it is about to use — a run of panels `[16 columns][kc steps]`, transposed to
//! `[kc][16]` and widened exactly to f32 (`pack.rs`) — into a per-thread buffer, and runs the f32
//! micro-kernel over it for every row. A prefill packs long blocks once and streams all its rows
//! over each; a decode packs small ones that stay in the L1 cache while its row passes, so the
//! weight is streamed from memory once, at its stored width (bf16 reads half the bytes of f32).
//!
//! Decode can also run on [`Panels`]: the whole weight packed once, in its dtype, into
//! `[n / 16][k][16]`, which the kernel streams contiguously and widens itself. That costs a second
//! copy of the model and its packing at load, and pays where a process decodes for long
//! (`recall serve`); a one-shot run reads the mapping (the transposes fused into the chains,
//! `pack.rs`). Both give the same bits.

use std::sync::atomic::Ordering;
use std::sync::OnceLock;

use rayon::prelude::*;

#[cfg(target_arch = "x86_64")]
mod amx;
mod bf16;
#[cfg(target_arch = "x86_64")]
mod dot_bf16;
mod gated;
mod pack;
mod tasks;
#[cfg(target_arch = "x86_64")]
pub(super) use amx::{tile_products, TileOperand};
#[cfg(target_arch = "x86_64")]
pub(super) use dot_bf16::round_pairs_into;
#[cfg(target_arch = "x86_64")]
pub(super) use pack::transpose16;

use bf16::BF16_DOT;
pub use bf16::{
    bf16_dot, bf16_dot_available, gemm_bf16_dot, gemm_bf16_dot_with, gemm_shared, set_bf16_dot,
    takes_bf16_dot, Bf16Kernel, GemmJob,
};
pub use gated::{fuses_gated, gemm_gated, GatedWeight};
use tasks::{by_panels, by_panels_of};

/// Output columns per panel (one AVX-512 register of f32).
pub const NR: usize = 16;
/// Rows per micro-kernel call.
pub(crate) const MR: usize = 8;
/// Panels per micro-kernel call: an `MR × NP` tile of AVX-512 accumulators is 24 of the 32 registers.
const NP: usize = 3;

/// The accumulators of one micro-kernel call, in memory between calls.
type TileBuf = [[f32; NP * NR]; MR];
/// Steps of `k` per block of a many-row call: `MC · KC` inputs stay in the L2 cache while the
/// panels pass over them.
const KC: usize = 1024;
/// Rows per chunk of a many-row call.
const MC: usize = 96;
/// Rows from which a call packs long blocks ([`WIDE`]); below it, blocks for one micro-kernel
/// call ([`NARROW`]). Each packed block streams every row of `x` once more, which few rows do
/// cheaply.
const WIDE_ROWS: usize = 32;

/// The packed block one call uses: `panels` panels of `kc` steps.
#[derive(Debug, Clone, Copy)]
struct BlockShape {
    panels: usize,
    kc: usize,
}

/// Many rows: runs of 24 panels (the 2B MLP's tasks hold 24 and 9 panels on two threads), `KC`
/// steps: 1.5 MiB packed once and used by every row (docs/PERFORMANCE.md, 2026-12-04).
const WIDE: BlockShape = BlockShape {
    panels: 8 * NP,
    kc: KC,
};
/// Few rows (decode): one micro-kernel call's panels for 128 steps, 24 KiB: packed into L1 and
/// read back at once.
const NARROW: BlockShape = BlockShape { panels: NP, kc: 128 };

/// A weight `[n, k]` as stored, row-major: f32 values or little-endian 16-bit words (the
/// checkpoint's bytes, at any alignment).
#[derive(Debug, Clone, Copy)]
pub enum RowMajor<'a> {
    F32(&'a [f32]),
    Bf16(&'a [u8]),
    F16(&'a [u8]),
}

/// A weight `W: [n, k]` the GEMM multiplies by: a view of its row-major storage.
///
/// ```
/// use recall::backend::cpu::gemm::{gemm, Matrix, RowMajor};
/// // W = [[1, 2], [3, 4], [5, 6]]: n = 3 outputs of k = 2 inputs.
/// let w = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
/// let w = Matrix::new(3, 2, RowMajor::F32(&w));
/// let mut y = [0.0; 3];
/// gemm(&[1.0, 10.0], 1, &w, None, &mut y);
/// assert_eq!(y, [21.0, 43.0, 65.0]);
/// ```
#[derive(Debug, Clone, Copy)]
pub struct Matrix<'a> {
    /// Output width (columns of `y`, rows of `W`).
    pub n: usize,
    /// Input width (the reduction length).
    pub k: usize,
    pub(super) data: RowMajor<'a>,
    /// The weight packed for decode, when it has been.
    panels: Option<&'a Panels>,
}

impl<'a> Matrix<'a> {
    /// `W: [n, k]` over `data`, which must hold exactly `n · k` elements.
    pub fn new(n: usize, k: usize, data: RowMajor<'a>) -> Matrix<'a> {
        let len = match data {
            RowMajor::F32(v) => v.len(),
            RowMajor::Bf16(b) | RowMajor::F16(b) => {
                assert!(b.len().is_multiple_of(2), "16-bit words");
                b.len() / 2
            }
        };
        assert_eq!(len, n * k, "an [{n}, {k}] weight");
        Matrix {
            n,
            k,
            data,
            panels: None,
        }
    }

    /// The same weight, with `panels` (packed from it by [`Panels::pack`]) for calls of fewer
    /// than 8 rows.
    pub fn with_panels(self, panels: &'a Panels) -> Matrix<'a> {
        assert_eq!((panels.n, panels.k), (self.n, self.k), "panels of this weight");
        Matrix {
            panels: Some(panels),
            ..self
        }
    }
}

/// A weight packed whole into panels `[ceil(n / 16)][k][16]` in its stored dtype (bf16 and f16
/// stay half-width and are widened exactly inside the kernel), for decode.
pub struct Panels {
    n: usize,
    k: usize,
    data: PanelData,
}

impl std::fmt::Debug for Panels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Panels {{ n: {}, k: {}, bytes: {} }}",
            self.n,
            self.k,
            self.bytes()
        )
    }
}

/// Panel storage, `[ceil(n / 16)][k][16]`; columns past `n` are zero.
enum PanelData {
    F32(Vec<f32>),
    /// bf16 bit patterns.
    Bf16(Vec<u16>),
    /// IEEE half bit patterns.
    F16(Vec<u16>),
}

impl Panels {
    /// Packs `w` (in parallel, each element written once), at its stored width.
    pub fn pack(w: &Matrix<'_>) -> Panels {
        let (n, k) = (w.n, w.k);
        let panels = n.div_ceil(NR);
        let isa = Isa::detect();
        // Whole panels through the register transposes where the CPU has them; the rest, and
        // the steps past the last whole transpose, one element at a time.
        let fast = |p: usize, out: *mut u8| match isa {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `Isa::detect` found AVX-512F; rows `16p..16p + 16` lie inside `w` (checked
            // here) and `pack` hands each panel its `k · 16` elements of the stored width.
            Isa::Avx512 if (p + 1) * NR <= n => unsafe { pack::decode_panel512(w, p * NR, out) },
            _ => {
                let _ = (p, out);
                0
            }
        };
        let half = |b: &[u8]| {
            let at = |c, i| u16::from_le_bytes([b[2 * (c * k + i)], b[2 * (c * k + i) + 1]]);
            pack(panels, n, k, at, fast)
        };
        let data = match w.data {
            RowMajor::F32(v) => PanelData::F32(pack(panels, n, k, |c, i| v[c * k + i], fast)),
            RowMajor::Bf16(b) => PanelData::Bf16(half(b)),
            RowMajor::F16(b) => PanelData::F16(half(b)),
        };
        Panels { n, k, data }
    }

    /// An f32 `w` packed whole by the GEMM's own block packer (16 × 16 transposes in registers
    /// where the CPU has them), for a product that many calls reuse: attention's keys, shared by
    /// every tile of query rows of a head.
    pub(in crate::backend::cpu) fn pack_f32(isa: Isa, w: &Matrix<'_>) -> Panels {
        let panels = w.n.div_ceil(NR);
        let mut data = vec![0f32; panels * w.k * NR];
        pack::panels(isa, w, (0, panels), (0, w.k), &mut data);
        Panels {
            n: w.n,
            k: w.k,
            data: PanelData::F32(data),
        }
    }

    /// The panels of `W = Rᵀ` (`[width, count]`) for `count` rows `row(i)` of `width` floats: panel
    /// `p`'s step `i` is `row(i)[16p..16p + 16]`, a straight copy (zero past `width`). Attention's
    /// values, for `P·V` by the GEMM.
    pub(in crate::backend::cpu) fn of_transposed<'r>(
        count: usize,
        width: usize,
        row: impl Fn(usize) -> &'r [f32],
    ) -> Panels {
        let panels = width.div_ceil(NR);
        let mut data = vec![0f32; panels * count * NR];
        for i in 0..count {
            let r = &row(i)[..width];
            for (p, src) in r.chunks(NR).enumerate() {
                data[(p * count + i) * NR..][..src.len()].copy_from_slice(src);
            }
        }
        Panels {
            n: width,
            k: count,
            data: PanelData::F32(data),
        }
    }

    /// Bytes the panels take.
    pub fn bytes(&self) -> usize {
        match &self.data {
            PanelData::F32(v) => v.len() * 4,
            PanelData::Bf16(v) | PanelData::F16(v) => v.len() * 2,
        }
    }

    /// The panels from panel `p` on.
    fn from(&self, p: usize) -> Weights<'_> {
        let at = p * self.k * NR;
        match &self.data {
            PanelData::F32(d) => Weights::F32(&d[at..]),
            PanelData::Bf16(d) => Weights::Bf16(&d[at..]),
            PanelData::F16(d) => Weights::F16(&d[at..]),
        }
    }
}

/// Panels `[panels][k][NR]` with `at(c, i)` = `W[c][i]` (zero past `n`). `fast(p, panel)` may
/// write the first steps of panel `p` itself (every lane) and returns how many; the rest is
/// written element by element. Every element is written exactly once, so the buffer is never
/// zeroed first (fresh pages are zeroed by the kernel anyway: a second pass over gigabytes of
/// panels was the largest cost of loading).
fn pack<T: Copy + Default + Send + Sync>(
    panels: usize,
    n: usize,
    k: usize,
    at: impl Fn(usize, usize) -> T + Sync,
    fast: impl Fn(usize, *mut u8) -> usize + Sync,
) -> Vec<T> {
    /// Steps of `k` per tile: the tile's `NR` source rows are read in runs of this many elements.
    const TILE: usize = 64;
    let len = panels * k * NR;
    let mut out: Vec<T> = Vec::with_capacity(len);
    out.spare_capacity_mut()[..len]
        .par_chunks_mut((k * NR).max(1))
        .enumerate()
        .for_each(|(p, panel)| {
            // `fast` writes every lane of steps `0..done`; the loops below, steps `done..k`.
            let done = fast(p, panel.as_mut_ptr().cast());
            for i0 in (done..k).step_by(TILE) {
                let i1 = (i0 + TILE).min(k);
                for j in 0..NR {
                    let c = p * NR + j;
                    for i in i0..i1 {
                        panel[i * NR + j].write(if c < n { at(c, i) } else { T::default() });
                    }
                }
            }
        });
    // SAFETY: the chunks cover `out[..len]` (the last one may be short only when `k * NR` is 0,
    // then `len` is 0); `fast` wrote every element of steps `0..done` of its panel and the loops
    // above write every other element once: `i` in `done..k`, `j` in `0..NR`.
    unsafe { out.set_len(len) };
    out
}

/// An instruction set the kernels are written for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    Avx512,
    Avx2,
    Neon,
    Portable,
}

impl Isa {
    /// The best instruction set this CPU has (or `RECALL_CPU_KERNEL=avx512|avx2|neon|portable`, when
    /// the CPU has it).
    pub fn detect() -> Isa {
        static ISA: OnceLock<Isa> = OnceLock::new();
        *ISA.get_or_init(|| {
            let forced = std::env::var("RECALL_CPU_KERNEL")
                .ok()
                .and_then(|v| Isa::named(&v));
            match forced {
                Some(isa) if isa.available() => isa,
                Some(isa) => {
                    tracing::warn!("RECALL_CPU_KERNEL={isa:?} is not available on this CPU; detecting");
                    Isa::best()
                }
                None => Isa::best(),
            }
        })
    }

    fn best() -> Isa {
        [Isa::Avx512, Isa::Avx2, Isa::Neon]
            .into_iter()
            .find(|i| i.available())
            .unwrap_or(Isa::Portable)
    }

    /// `avx512`, `avx2`, `neon` or `portable`.
    pub fn named(s: &str) -> Option<Isa> {
        match s {
            "avx512" => Some(Isa::Avx512),
            "avx2" => Some(Isa::Avx2),
            "neon" => Some(Isa::Neon),
            "portable" => Some(Isa::Portable),
            _ => None,
        }
    }

    /// Whether this CPU can run the path.
    pub fn available(self) -> bool {
        match self {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => std::arch::is_x86_feature_detected!("avx512f"),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => {
                std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
                    && std::arch::is_x86_feature_detected!("f16c")
            }
            #[cfg(target_arch = "aarch64")]
            Isa::Neon => std::arch::is_aarch64_feature_detected!("neon"),
            Isa::Portable => true,
            #[allow(unreachable_patterns)]
            _ => false,
        }
    }
}

/// `y[m, n] = x[m, k] · Wᵀ (+ bias)` with the detected instruction set (and, for bf16 weights
/// when [`set_bf16_dot`] is on, through AVX512-BF16).
pub fn gemm(x: &[f32], m: usize, w: &Matrix<'_>, bias: Option<&[f32]>, y: &mut [f32]) {
    if BF16_DOT.load(Ordering::Relaxed) && takes_bf16_dot(w) {
        return gemm_bf16_dot(x, m, w, bias, y);
    }
    gemm_with(Isa::detect(), x, m, w, bias, y)
}

/// [`gemm`] on a given instruction set (which must be [`available`](Isa::available)), on the
/// exact path whatever [`set_bf16_dot`] says.
pub fn gemm_with(isa: Isa, x: &[f32], m: usize, w: &Matrix<'_>, bias: Option<&[f32]>, y: &mut [f32]) {
    assert!(isa.available(), "{isa:?} is not available on this CPU");
    by_panels(x, m, w, bias, y, None, |(p0, p1), y| {
        panel_range(isa, x, m, w, p0, p1, y)
    });
}

thread_local! {
    /// Each thread's packed block, reused across calls.
    static PACKED: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Columns of panels `p0..p1` for every row: runs of panels, and within one, each block of `k`
/// packed to f32 panels `[kc][16]` (exactly: a transposed copy, bf16 and f16 widened) into the
/// thread's buffer, then the micro-kernel over it for every row. Each output element's chain runs
/// over `k` in order from 0 whatever the block shape, so every bit is the same for any `m`.
fn panel_range(isa: Isa, x: &[f32], m: usize, w: &Matrix<'_>, p0: usize, p1: usize, y: &mut [f32]) {
    let k = w.k;
    if let (Some(panels), true) = (w.panels, m < MR) {
        return panels_range(isa, (x, k), m, panels, (w.n, k), (p0, p1), y);
    }
    let p0 = if m < MR {
        pack::fused_rows(isa, x, m, w, (p0, p1), y)
    } else {
        p0
    };
    if p0 >= p1 {
        return;
    }
    let shape = if m >= WIDE_ROWS { WIDE } else { NARROW };
    PACKED.with_borrow_mut(|buf| {
        buf.resize(shape.panels * shape.kc * NR, 0.0);
        let mut tile: TileBuf = [[0f32; NP * NR]; MR];
        for s0 in (p0..p1).step_by(shape.panels) {
            let s1 = (s0 + shape.panels).min(p1);
            for k0 in (0..k).step_by(shape.kc) {
                let kc = shape.kc.min(k - k0);
                let len = (s1 - s0) * kc * NR;
                pack::panels(isa, w, (s0, s1), (k0, kc), &mut buf[..len]);
                // The packed block's steps run from 0: `x` starts at column `k0`.
                let block = Block {
                    x: &x[k0..],
                    k,
                    k0: 0,
                    kc,
                    carry: k0 > 0,
                };
                let panels = |p: usize| Weights::F32(&buf[(p - s0) * kc * NR..len]);
                block_pass(isa, &block, (m, w.n), (s0, s1), (panels, kc), &mut tile, y);
            }
        }
    });
}

/// [`panel_range`] on a weight's [`Panels`], each panel read where it lies: panels `p0..p1` of its
/// first `n` outputs (the width of `y`), its first `k` steps in blocks of `KC`, the rows of `x`
/// `ldx` apart.
fn panels_range(
    isa: Isa,
    (x, ldx): (&[f32], usize),
    m: usize,
    w: &Panels,
    (n, k): (usize, usize),
    (p0, p1): (usize, usize),
    y: &mut [f32],
) {
    let mut tile: TileBuf = [[0f32; NP * NR]; MR];
    for k0 in (0..k).step_by(KC) {
        let block = Block {
            x,
            k: ldx,
            k0,
            kc: KC.min(k - k0),
            carry: k0 > 0,
        };
        let panels = |p: usize| w.from(p);
        block_pass(isa, &block, (m, n), (p0, p1), (panels, w.k), &mut tile, y);
    }
}

/// `y[m, n] = x[.., ..k] · W[..n, ..k]ᵀ` on the calling thread, from `w`'s panels: its first `n`
/// outputs over its first `k` steps, the rows of `x` `ldx` apart. Each output is the chain of
/// [`gemm`] (one `mul_add` per step, from 0, in order of `k`), so a product over a prefix of the
/// steps is the start of the product over all of them, bit for bit.
///
/// # Panics
/// When `n` or `k` exceed the panels', or `x` or `y` are too short.
pub(in crate::backend::cpu) fn gemm_panels(
    isa: Isa,
    (x, ldx): (&[f32], usize),
    m: usize,
    w: &Panels,
    (n, k): (usize, usize),
    y: &mut [f32],
) {
    assert!(
        n <= w.n && k <= w.k && k <= ldx,
        "[{n}, {k}] inside [{}, {}] panels",
        w.n,
        w.k
    );
    assert!(
        m == 0 || x.len() >= (m - 1) * ldx + k,
        "x is not [{m}, {k}] rows {ldx} apart"
    );
    assert_eq!(y.len(), m * n, "y is not [{m}, {n}]");
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        y.fill(0.0);
        return;
    }
    panels_range(isa, (x, ldx), m, w, (n, k), (0, n.div_ceil(NR)), y);
}

/// One block of `k` as the micro-kernels see it: steps `k0..k0 + kc` of `x` (row stride `k`) and
/// of the panels; `carry` adds to the partial sums of the earlier blocks that `y` holds.
struct Block<'a> {
    x: &'a [f32],
    k: usize,
    k0: usize,
    kc: usize,
    carry: bool,
}

/// One [`Block`] over rows `0..m` and panels `p0..p1` (the panels from panel `p` on, `stride`
/// steps apart, from `panels.0(p)`): chunks of `MC` rows, groups of `NP` panels, tiles of `MR`
/// rows.
fn block_pass<'w>(
    isa: Isa,
    block: &Block<'_>,
    (m, n): (usize, usize),
    (p0, p1): (usize, usize),
    (panels, stride): (impl Fn(usize) -> Weights<'w>, usize),
    tile: &mut TileBuf,
    y: &mut [f32],
) {
    for m0 in (0..m).step_by(MC) {
        let m1 = (m0 + MC).min(m);
        let mut p = p0;
        while p < p1 {
            let np = (p1 - p).min(NP);
            let c0 = p * NR;
            let cols = (np * NR).min(n - c0);
            for r0 in (m0..m1).step_by(MR) {
                let mr = MR.min(m1 - r0);
                let rows = |i: usize| (r0 + i) * n + c0..(r0 + i) * n + c0 + cols;
                // The next tile's rows of `y` (read for the carry, then written) miss the caches
                // (`y` is far larger than L2): ask for them while this tile computes.
                prefetch_rows(y, (r0 + MR..(r0 + 2 * MR).min(m1)).map(|r| r * n + c0), cols);
                let t = Tile {
                    x: &block.x[r0 * block.k..],
                    ldx: block.k,
                    k0: block.k0,
                    kc: block.kc,
                    mr,
                    np,
                };
                if isa == Isa::Avx512 && cols == np * NR {
                    // Whole panels: the AVX-512 kernel carries its sums in `y` itself.
                    let out = Rows {
                        y: &mut *y,
                        at: r0 * n + c0,
                        ld: n,
                        carry: block.carry,
                    };
                    kernel_rows(&t, panels(p), stride, out);
                    continue;
                }
                // Carry the partial sums of the earlier k blocks (0 for the first).
                for (i, t) in tile.iter_mut().enumerate().take(mr) {
                    t.fill(0.0);
                    if block.carry {
                        t[..cols].copy_from_slice(&y[rows(i)]);
                    }
                }
                kernel(isa, &t, panels(p), stride, tile);
                for (i, t) in tile.iter().enumerate().take(mr) {
                    y[rows(i)].copy_from_slice(&t[..cols]);
                }
            }
            p += np;
        }
    }
}

/// Hints the cache lines of `len` elements of `y` from each start in `starts` (x86-64: nothing
/// elsewhere, and nothing past `y`'s end).
#[inline]
fn prefetch_rows(y: &[f32], starts: impl Iterator<Item = usize>, len: usize) {
    #[cfg(target_arch = "x86_64")]
    for s in starts {
        let end = (s + len).min(y.len());
        for i in (s..end).step_by(16).chain(std::iter::once(end.saturating_sub(1))) {
            if i < y.len() {
                // SAFETY: a prefetch is a hint; the address is inside `y`.
                unsafe {
                    std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                        y.as_ptr().add(i).cast(),
                    )
                };
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (y, starts, len);
}

/// One micro-kernel call: rows `0..mr` of `x` (row stride `ldx`), steps `k0..k0 + kc`, `np`
/// (`1..=NP`) panels.
#[derive(Clone, Copy)]
struct Tile<'a> {
    x: &'a [f32],
    ldx: usize,
    k0: usize,
    kc: usize,
    mr: usize,
    np: usize,
}

/// A tile's rows of `y` itself, for a kernel that reads and writes its sums there: rows `0..mr`
/// from element `at`, `ld` apart, `np` whole panels wide; `carry` reads the earlier blocks' sums
/// (else the chains start from 0).
struct Rows<'a> {
    y: &'a mut [f32],
    at: usize,
    ld: usize,
    carry: bool,
}

/// [`kernel`] on AVX-512 with the sums in `y` (no copy through a [`TileBuf`]; the same chains, so
/// the same bits).
fn kernel_rows(t: &Tile<'_>, w: Weights<'_>, k: usize, out: Rows<'_>) {
    t.check(w, k);
    assert!(
        out.y.len() >= out.at + (t.mr - 1) * out.ld + t.np * NR,
        "rows of y out of range"
    );
    #[cfg(target_arch = "x86_64")]
    // SAFETY: only `block_pass` calls this, on `Isa::Avx512`, which `gemm_with` checked the CPU
    // has; the bounds are checked above.
    unsafe {
        x86::avx512_rows(t, w, k, out.y.as_mut_ptr().add(out.at), out.ld, out.carry)
    };
    #[cfg(not(target_arch = "x86_64"))]
    unreachable!("AVX-512 on {:?}", (t.mr, out.ld))
}

impl Tile<'_> {
    /// Panics unless `w` (panels `k · 16` elements apart) and `x` hold everything the tile reads:
    /// the bounds the unsafe kernels rely on.
    fn check(&self, w: Weights<'_>, k: usize) {
        assert!(
            w.len() >= (self.np - 1) * k * NR + (self.k0 + self.kc) * NR,
            "panels out of range"
        );
        assert!(
            self.x.len() >= (self.mr - 1) * self.ldx + self.k0 + self.kc,
            "rows out of range"
        );
    }
}

/// The panels of one call, from its first panel on (panels `k · 16` elements apart).
#[derive(Clone, Copy)]
enum Weights<'a> {
    F32(&'a [f32]),
    Bf16(&'a [u16]),
    F16(&'a [u16]),
}

impl Weights<'_> {
    /// Weight `j` of panel `p` at step `kk`, as f32 (exact for every storage type).
    fn get(self, p: usize, kk: usize, j: usize, k: usize) -> f32 {
        let i = p * k * NR + kk * NR + j;
        match self {
            Weights::F32(d) => d[i],
            Weights::Bf16(d) => f32::from_bits(u32::from(d[i]) << 16),
            Weights::F16(d) => half::f16::from_bits(d[i]).to_f32(),
        }
    }

    /// Elements this call may read, and in how many bytes each.
    fn len(self) -> usize {
        match self {
            Weights::F32(d) => d.len(),
            Weights::Bf16(d) | Weights::F16(d) => d.len(),
        }
    }
}

/// `tile[i][p·16 + j] = fma(x[i][kk], W_p[kk][j], tile[i][p·16 + j])` for every step `kk` of the
/// block, in order.
fn kernel(isa: Isa, t: &Tile<'_>, w: Weights<'_>, k: usize, tile: &mut TileBuf) {
    t.check(w, k);
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `gemm_with` checked that the CPU has AVX-512F; the bounds are checked above.
        Isa::Avx512 => unsafe { x86::avx512(t, w, k, tile) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `gemm_with` checked AVX2, FMA and F16C; the bounds are checked above.
        Isa::Avx2 => unsafe { x86::avx2(t, w, k, tile) },
        #[cfg(target_arch = "aarch64")]
        // SAFETY: `gemm_with` checked NEON; the bounds are checked above.
        Isa::Neon if matches!(w, Weights::F32(_)) => unsafe { arm::neon(t, w, k, tile) },
        _ => portable(t, w, k, tile),
    }
}

/// The defining loop: one `mul_add` per step, in order of `k`.
fn portable(t: &Tile<'_>, w: Weights<'_>, k: usize, tile: &mut TileBuf) {
    for (i, row) in tile.iter_mut().enumerate().take(t.mr) {
        for kk in t.k0..t.k0 + t.kc {
            let xv = t.x[i * t.ldx + kk];
            for p in 0..t.np {
                for j in 0..NR {
                    row[p * NR + j] = xv.mul_add(w.get(p, kk, j, k), row[p * NR + j]);
                }
            }
        }
    }
}

/// Calls `$f::<KIND, R, P>` for the runtime `(mr, np)` of a tile.
#[cfg(target_arch = "x86_64")]
macro_rules! dispatch_tile {
    ($f:ident, $kind:literal, $t:expr, ($($arg:expr),*)) => {
        match ($t.mr, $t.np) {
            (8, 3) => $f::<$kind, 8, 3>($($arg),*),
            (7, 3) => $f::<$kind, 7, 3>($($arg),*),
            (6, 3) => $f::<$kind, 6, 3>($($arg),*),
            (5, 3) => $f::<$kind, 5, 3>($($arg),*),
            (4, 3) => $f::<$kind, 4, 3>($($arg),*),
            (3, 3) => $f::<$kind, 3, 3>($($arg),*),
            (2, 3) => $f::<$kind, 2, 3>($($arg),*),
            (1, 3) => $f::<$kind, 1, 3>($($arg),*),
            (8, 2) => $f::<$kind, 8, 2>($($arg),*),
            (7, 2) => $f::<$kind, 7, 2>($($arg),*),
            (6, 2) => $f::<$kind, 6, 2>($($arg),*),
            (5, 2) => $f::<$kind, 5, 2>($($arg),*),
            (4, 2) => $f::<$kind, 4, 2>($($arg),*),
            (3, 2) => $f::<$kind, 3, 2>($($arg),*),
            (2, 2) => $f::<$kind, 2, 2>($($arg),*),
            (1, 2) => $f::<$kind, 1, 2>($($arg),*),
            (8, 1) => $f::<$kind, 8, 1>($($arg),*),
            (7, 1) => $f::<$kind, 7, 1>($($arg),*),
            (6, 1) => $f::<$kind, 6, 1>($($arg),*),
            (5, 1) => $f::<$kind, 5, 1>($($arg),*),
            (4, 1) => $f::<$kind, 4, 1>($($arg),*),
            (3, 1) => $f::<$kind, 3, 1>($($arg),*),
            (2, 1) => $f::<$kind, 2, 1>($($arg),*),
            (1, 1) => $f::<$kind, 1, 1>($($arg),*),
            _ => unreachable!("tiles are 1..=8 rows by 1..=3 panels"),
        }
    };
}

#[cfg(target_arch = "x86_64")]
#[allow(clippy::needless_range_loop)] // register tiles read best as indexed loops
mod x86 {
    //! AVX-512F (16 lanes: one register per panel) and AVX2 + FMA (8 lanes: two registers per
    //! panel) kernels. Each accumulator lane is one output element and each step one fused
    //! multiply-add: exactly `f32::mul_add`. The tile sizes are constants, so the accumulators stay
    //! in registers.

    use std::arch::x86_64::*;

    use super::{Tile, TileBuf, Weights, MR, NP, NR};

    /// Storage kinds (`KIND`): f32, bf16, and anything else f16.
    const F32: u8 = 0;
    const BF16: u8 = 1;
    /// Steps ahead that the micro-kernel prefetches its panels: 8–64 measured the same, none 10%
    /// slower on an Intel Xeon with AVX-512 (docs/PERFORMANCE.md, 2026-12-06).
    const PF: usize = 16;

    /// # Safety
    /// The CPU must support AVX-512F; the caller checked the bounds of `t` and `w`.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn avx512(t: &Tile<'_>, w: Weights<'_>, k: usize, tile: &mut TileBuf) {
        avx512_rows(t, w, k, tile.as_mut_ptr().cast(), NP * NR, true)
    }

    /// [`avx512`] with the sums at `out` (rows `ld` apart), read first when `carry`.
    ///
    /// # Safety
    /// As [`avx512`]; `out` holds `t.mr` rows of `t.np` panels, `ld` apart.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn avx512_rows(t: &Tile<'_>, w: Weights<'_>, k: usize, out: *mut f32, ld: usize, carry: bool) {
        let o = (out, ld, carry);
        match w {
            Weights::F32(d) => dispatch_tile!(tile512, 0, t, (t, d.as_ptr().cast(), k * NR, o)),
            Weights::Bf16(d) => dispatch_tile!(tile512, 1, t, (t, d.as_ptr().cast(), k * NR, o)),
            Weights::F16(d) => dispatch_tile!(tile512, 2, t, (t, d.as_ptr().cast(), k * NR, o)),
        }
    }

    /// 16 weights at element `idx` of storage `KIND`, widened to f32.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn load512<const KIND: u8>(base: *const u8, idx: usize) -> __m512 {
        match KIND {
            F32 => _mm512_loadu_ps(base.cast::<f32>().add(idx)),
            BF16 => {
                let raw = _mm256_loadu_si256(base.cast::<u16>().add(idx).cast());
                _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16))
            }
            _ => _mm512_cvtph_ps(_mm256_loadu_si256(base.cast::<u16>().add(idx).cast())),
        }
    }

    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn tile512<const KIND: u8, const R: usize, const P: usize>(
        t: &Tile<'_>,
        base: *const u8,
        stride: usize,
        (out, ld, carry): (*mut f32, usize, bool),
    ) {
        let mut acc = [[_mm512_setzero_ps(); P]; R];
        if carry {
            for i in 0..R {
                for p in 0..P {
                    acc[i][p] = _mm512_loadu_ps(out.add(i * ld + p * NR));
                }
            }
        }
        let x = t.x.as_ptr();
        let size = if KIND == F32 { 4 } else { 2 };
        for kk in t.k0..t.k0 + t.kc {
            let mut w = [_mm512_setzero_ps(); P];
            for p in 0..P {
                w[p] = load512::<KIND>(base, p * stride + kk * NR);
                // The panels stream from L2 (a block is too large for L1): ask for the line
                // `PF` steps ahead (a hint; past the block's end it fetches nothing useful).
                let ahead = (p * stride + (kk + PF) * NR) * size;
                _mm_prefetch::<_MM_HINT_T0>(base.wrapping_add(ahead).cast());
            }
            for i in 0..R {
                let xv = _mm512_set1_ps(*x.add(i * t.ldx + kk));
                for p in 0..P {
                    acc[i][p] = _mm512_fmadd_ps(xv, w[p], acc[i][p]);
                }
            }
        }
        for i in 0..R {
            for p in 0..P {
                _mm512_storeu_ps(out.add(i * ld + p * NR), acc[i][p]);
            }
        }
    }

    /// # Safety
    /// The CPU must support AVX2, FMA and F16C; the caller checked the bounds of `t` and `w`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn avx2(t: &Tile<'_>, w: Weights<'_>, k: usize, tile: &mut TileBuf) {
        // One panel (two registers) by at most 4 rows at a time: 8 accumulators of the 16 registers.
        for p in 0..t.np {
            for r0 in (0..t.mr).step_by(4) {
                let part = Tile {
                    x: &t.x[r0 * t.ldx..],
                    mr: (t.mr - r0).min(4),
                    np: 1,
                    ..*t
                };
                let mut sub: TileBuf = [[0f32; super::NP * NR]; MR];
                for i in 0..part.mr {
                    sub[i][..NR].copy_from_slice(&tile[r0 + i][p * NR..(p + 1) * NR]);
                }
                let off = p * k * NR;
                match w {
                    Weights::F32(d) => {
                        dispatch_tile!(tile256, 0, part, (&part, d.as_ptr().add(off).cast(), &mut sub))
                    }
                    Weights::Bf16(d) => {
                        dispatch_tile!(tile256, 1, part, (&part, d.as_ptr().add(off).cast(), &mut sub))
                    }
                    Weights::F16(d) => {
                        dispatch_tile!(tile256, 2, part, (&part, d.as_ptr().add(off).cast(), &mut sub))
                    }
                }
                for i in 0..part.mr {
                    tile[r0 + i][p * NR..(p + 1) * NR].copy_from_slice(&sub[i][..NR]);
                }
            }
        }
    }

    /// 8 weights at element `idx` of storage `KIND`, widened to f32.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load256<const KIND: u8>(base: *const u8, idx: usize) -> __m256 {
        match KIND {
            F32 => _mm256_loadu_ps(base.cast::<f32>().add(idx)),
            BF16 => {
                let raw = _mm_loadu_si128(base.cast::<u16>().add(idx).cast());
                _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16))
            }
            _ => _mm256_cvtph_ps(_mm_loadu_si128(base.cast::<u16>().add(idx).cast())),
        }
    }

    /// `R` rows of one panel; `_P` is always 1 here (the dispatch macro's shape).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn tile256<const KIND: u8, const R: usize, const _P: usize>(
        t: &Tile<'_>,
        base: *const u8,
        tile: &mut TileBuf,
    ) {
        let mut acc = [[_mm256_setzero_ps(); 2]; R];
        for i in 0..R {
            acc[i][0] = _mm256_loadu_ps(tile[i].as_ptr());
            acc[i][1] = _mm256_loadu_ps(tile[i].as_ptr().add(8));
        }
        let x = t.x.as_ptr();
        for kk in t.k0..t.k0 + t.kc {
            let w0 = load256::<KIND>(base, kk * NR);
            let w1 = load256::<KIND>(base, kk * NR + 8);
            for i in 0..R {
                let xv = _mm256_set1_ps(*x.add(i * t.ldx + kk));
                acc[i][0] = _mm256_fmadd_ps(xv, w0, acc[i][0]);
                acc[i][1] = _mm256_fmadd_ps(xv, w1, acc[i][1]);
            }
        }
        for i in 0..R {
            _mm256_storeu_ps(tile[i].as_mut_ptr(), acc[i][0]);
            _mm256_storeu_ps(tile[i].as_mut_ptr().add(8), acc[i][1]);
        }
    }
}

#[cfg(target_arch = "aarch64")]
#[allow(clippy::needless_range_loop)]
mod arm {
    //! NEON (4 lanes: four registers per panel) for f32 panels; `vfmaq_f32` is a fused multiply-add.

    use std::arch::aarch64::*;

    use super::{Tile, TileBuf, Weights, NR};

    /// # Safety
    /// The caller checked the bounds of `t` and `w`; `w` holds f32 panels.
    #[target_feature(enable = "neon")]
    pub unsafe fn neon(t: &Tile<'_>, w: Weights<'_>, k: usize, tile: &mut TileBuf) {
        let Weights::F32(d) = w else {
            unreachable!("NEON runs f32 panels")
        };
        // One panel (four registers) by at most 4 rows at a time: 16 accumulators of the 32.
        for p in 0..t.np {
            for r0 in (0..t.mr).step_by(4) {
                let rows = (t.mr - r0).min(4);
                let mut acc = [[vdupq_n_f32(0.0); 4]; 4];
                for i in 0..rows {
                    for q in 0..4 {
                        acc[i][q] = vld1q_f32(tile[r0 + i].as_ptr().add(p * NR + 4 * q));
                    }
                }
                for kk in t.k0..t.k0 + t.kc {
                    let ptr = d.as_ptr().add(p * k * NR + kk * NR);
                    let w = [
                        vld1q_f32(ptr),
                        vld1q_f32(ptr.add(4)),
                        vld1q_f32(ptr.add(8)),
                        vld1q_f32(ptr.add(12)),
                    ];
                    for i in 0..rows {
                        let xv = vdupq_n_f32(*t.x.get_unchecked((r0 + i) * t.ldx + kk));
                        for q in 0..4 {
                            acc[i][q] = vfmaq_f32(acc[i][q], xv, w[q]);
                        }
                    }
                }
                for i in 0..rows {
                    for q in 0..4 {
                        vst1q_f32(tile[r0 + i].as_mut_ptr().add(p * NR + 4 * q), acc[i][q]);
                    }
                }
            }
        }
    }
}
