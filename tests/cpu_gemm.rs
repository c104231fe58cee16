//! The CPU GEMM's exactness contract: every output element is one sequential fused multiply-add
//! chain over k from 0.0, then + bias. Checked bitwise against that definition written as a plain
//! loop, on every instruction-set path this CPU has, for f32, bf16 and f16 weights, for shapes that
//! do not fill the tiles, read from the row-major storage and from decode panels; and a row's bits do
//! not depend on how many rows share the call or how many threads run it. Two products fused with
//! an elementwise function (`gemm_gated`, a SwiGLU MLP's gate and up) are that function of the
//! two definitions, bit for bit.

use recall::backend::cpu::gemm::{
    fuses_gated, gemm, gemm_gated, gemm_shared, gemm_with, Isa, Matrix, Panels, RowMajor,
};

#[derive(Debug, Clone, Copy, PartialEq)]
enum Elem {
    F32,
    Bf16,
    F16,
}

/// A weight `[n, k]` as a checkpoint stores it (f32 values, or 16-bit words as little-endian
/// bytes from byte `offset` on, which need not be aligned), with its values as f32 (what the
/// kernel must widen them to).
struct Stored {
    n: usize,
    k: usize,
    f32s: Vec<f32>,
    bytes: Vec<u8>,
    offset: usize,
    elem: Elem,
}

impl Stored {
    fn matrix(&self) -> Matrix<'_> {
        let b = &self.bytes[self.offset..];
        let data = match self.elem {
            Elem::F32 => RowMajor::F32(&self.f32s),
            Elem::Bf16 => RowMajor::Bf16(b),
            Elem::F16 => RowMajor::F16(b),
        };
        Matrix::new(self.n, self.k, data)
    }
}

fn weight(rng: &mut fastrand::Rng, n: usize, k: usize, elem: Elem) -> (Stored, Vec<f32>) {
    weight_at(rng, n, k, elem, 0)
}

fn weight_at(rng: &mut fastrand::Rng, n: usize, k: usize, elem: Elem, offset: usize) -> (Stored, Vec<f32>) {
    let f: Vec<f32> = (0..n * k).map(|_| rng.f32() * 2.0 - 1.0).collect();
    let (words, values): (Vec<u16>, Vec<f32>) = match elem {
        Elem::F32 => (Vec::new(), f.clone()),
        Elem::Bf16 => f
            .iter()
            .map(|&v| {
                let b = half::bf16::from_f32(v);
                (b.to_bits(), b.to_f32())
            })
            .unzip(),
        Elem::F16 => f
            .iter()
            .map(|&v| {
                let h = half::f16::from_f32(v);
                (h.to_bits(), h.to_f32())
            })
            .unzip(),
    };
    let mut bytes = vec![0u8; offset];
    bytes.extend(words.iter().flat_map(|w| w.to_le_bytes()));
    let stored = Stored {
        n,
        k,
        f32s: f,
        bytes,
        offset,
        elem,
    };
    (stored, values)
}

/// The definition.
fn reference(x: &[f32], m: usize, w: &[f32], n: usize, k: usize, bias: Option<&[f32]>) -> Vec<f32> {
    let mut y = vec![0f32; m * n];
    for r in 0..m {
        for c in 0..n {
            let mut acc = 0f32;
            for i in 0..k {
                acc = x[r * k + i].mul_add(w[c * k + i], acc);
            }
            y[r * n + c] = acc + bias.map_or(0.0, |b| b[c]);
        }
    }
    y
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

const PATHS: [Isa; 4] = [Isa::Avx512, Isa::Avx2, Isa::Neon, Isa::Portable];

#[test]
fn every_path_computes_the_definition_bitwise() {
    let mut rng = fastrand::Rng::with_seed(1);
    let paths: Vec<Isa> = PATHS.into_iter().filter(|i| i.available()).collect();
    eprintln!("paths on this CPU: {paths:?} (detected: {:?})", Isa::detect());
    // (m, n, k): single rows, tiles and panels partly filled, k over several blocks, k = 0.
    for &(m, n, k) in &[
        (1, 16, 8),
        (7, 33, 300),
        (13, 50, 517),
        (200, 17, 64),
        (2, 40, 0),
        (6, 32, 256),
        // Past the rows where long blocks are packed once: two blocks of k, two chunks of rows.
        (100, 130, 1100),
        // Few rows: blocks of 128 steps with a tail past the last whole transpose; a panel of
        // 9 columns (AVX2's second half holds one).
        (3, 9, 300),
        (31, 20, 2100),
        (32, 9, 40),
        // Decode rows on AVX-512 bf16 read 32 steps of each weight row per load: 2, 4 and 5 rows
        // (1, 3, 6 and 7 above and below), whole loads only, a tail of one step.
        (2, 48, 96),
        (4, 20, 64),
        (5, 64, 33),
    ] {
        for elem in [Elem::F32, Elem::Bf16, Elem::F16] {
            let (stored, w) = weight(&mut rng, n, k, elem);
            let mapped = stored.matrix();
            // The decode panels serve calls of fewer than 8 rows; larger ones read the mapping.
            let panels = Panels::pack(&mapped);
            let x: Vec<f32> = (0..m * k).map(|_| rng.f32() * 4.0 - 2.0).collect();
            let b: Vec<f32> = (0..n).map(|_| rng.f32()).collect();
            for bias in [None, Some(b.as_slice())] {
                let want = reference(&x, m, &w, n, k, bias);
                for &isa in &paths {
                    for (matrix, layout) in [(mapped, "mapped"), (mapped.with_panels(&panels), "panels")] {
                        let mut y = vec![f32::NAN; m * n];
                        gemm_with(isa, &x, m, &matrix, bias, &mut y);
                        assert_eq!(
                            bits(&y),
                            bits(&want),
                            "{isa:?} {elem:?} {layout} m={m} n={n} k={k} bias={}",
                            bias.is_some()
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn a_row_does_not_depend_on_its_batch_or_the_thread_count() {
    let mut rng = fastrand::Rng::with_seed(2);
    let (m, n, k) = (300, 70, 600);
    let (stored, _) = weight(&mut rng, n, k, Elem::Bf16);
    let matrix = stored.matrix();
    let x: Vec<f32> = (0..m * k).map(|_| rng.f32() - 0.5).collect();
    let mut all = vec![0f32; m * n];
    gemm(&x, m, &matrix, None, &mut all);
    for r in [0, 1, 5, 6, 191, 192, 299] {
        let mut one = vec![0f32; n];
        gemm(&x[r * k..(r + 1) * k], 1, &matrix, None, &mut one);
        assert_eq!(bits(&one), bits(&all[r * n..(r + 1) * n]), "row {r} alone");
        let mut some = vec![0f32; 3 * n];
        let start = r.min(m - 3);
        gemm(&x[start * k..(start + 3) * k], 3, &matrix, None, &mut some);
        assert_eq!(
            bits(&some[(r - start) * n..(r - start + 1) * n]),
            bits(&all[r * n..(r + 1) * n]),
            "row {r} among 3"
        );
    }
    for threads in [1, 3, 5] {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        let mut y = vec![0f32; m * n];
        pool.install(|| gemm(&x, m, &matrix, None, &mut y));
        assert_eq!(bits(&y), bits(&all), "{threads} threads");
    }
}

/// Several weights on one `x` (a decode's q, k and v) run as one parallel pass: each output is
/// still its weight's definition, bit for bit, whatever the weights' widths, dtypes and layouts,
/// with biases or without, on any number of threads (tasks of different weights interleave).
#[test]
fn shared_calls_compute_the_definition_bitwise() {
    let mut rng = fastrand::Rng::with_seed(6);
    for &(m, k) in &[(1, 96), (3, 300), (7, 64), (8, 40), (40, 70), (2, 0)] {
        let shapes = [
            (200, Elem::F32),
            (17, Elem::Bf16),
            (9, Elem::F16),
            (64, Elem::Bf16),
            (5, Elem::F32),
        ];
        let stored: Vec<(Stored, Vec<f32>)> =
            shapes.iter().map(|&(n, e)| weight(&mut rng, n, k, e)).collect();
        let panels = Panels::pack(&stored[3].0.matrix());
        let mats: Vec<Matrix<'_>> = stored
            .iter()
            .enumerate()
            .map(|(i, (s, _))| {
                if i == 3 {
                    s.matrix().with_panels(&panels)
                } else {
                    s.matrix()
                }
            })
            .collect();
        let biases: Vec<Option<Vec<f32>>> = shapes
            .iter()
            .enumerate()
            .map(|(i, &(n, _))| (i % 2 == 0).then(|| (0..n).map(|_| rng.f32()).collect()))
            .collect();
        let x: Vec<f32> = (0..m * k).map(|_| rng.f32() * 4.0 - 2.0).collect();
        for threads in [1, 2, 3, 5] {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            let mut outs: Vec<Vec<f32>> = mats.iter().map(|w| vec![f32::NAN; m * w.n]).collect();
            let mut jobs: Vec<_> = mats
                .iter()
                .zip(&biases)
                .zip(outs.iter_mut())
                .map(|((w, b), y)| (w, b.as_deref(), y.as_mut_slice()))
                .collect();
            pool.install(|| gemm_shared(&x, m, &mut jobs));
            for (i, (((_, w), got), b)) in stored.iter().zip(&outs).zip(&biases).enumerate() {
                let want = reference(&x, m, w, mats[i].n, k, b.as_deref());
                assert_eq!(
                    bits(got),
                    bits(&want),
                    "weight {i} ({:?}, n = {}), m = {m}, k = {k}, {threads} threads",
                    shapes[i].1,
                    mats[i].n
                );
            }
        }
    }
}

#[test]
fn several_runs_of_packed_panels_compute_the_definition_bitwise() {
    // On one thread a call of 3,100 columns gives each task 27 panels of 16 columns: more than
    // one run of packed panels (24), so runs after the first start inside a task; 33 rows are
    // past the long-block threshold (32) and k spans two blocks.
    let mut rng = fastrand::Rng::with_seed(3);
    let (m, n, k) = (33, 3100, 1100);
    let (stored, w) = weight(&mut rng, n, k, Elem::Bf16);
    let matrix = stored.matrix();
    let x: Vec<f32> = (0..m * k).map(|_| rng.f32() * 4.0 - 2.0).collect();
    let want = reference(&x, m, &w, n, k, None);
    let pool = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
    for isa in PATHS.into_iter().filter(|i| i.available()) {
        let mut y = vec![f32::NAN; m * n];
        pool.install(|| gemm_with(isa, &x, m, &matrix, None, &mut y));
        assert_eq!(bits(&y), bits(&want), "{isa:?}");
    }
}

#[test]
fn half_width_weights_at_any_byte_offset_compute_the_definition_bitwise() {
    // A checkpoint's tensors start wherever its header ends: 16-bit words at an odd address.
    let mut rng = fastrand::Rng::with_seed(4);
    let (m, n, k) = (40, 35, 260);
    for elem in [Elem::Bf16, Elem::F16] {
        let (stored, w) = weight_at(&mut rng, n, k, elem, 1);
        let matrix = stored.matrix();
        let x: Vec<f32> = (0..m * k).map(|_| rng.f32() * 4.0 - 2.0).collect();
        let want = reference(&x, m, &w, n, k, None);
        for isa in PATHS.into_iter().filter(|i| i.available()) {
            for rows in [1, m] {
                let mut y = vec![f32::NAN; rows * n];
                gemm_with(isa, &x[..rows * k], rows, &matrix, None, &mut y);
                assert_eq!(bits(&y), bits(&want[..rows * n]), "{isa:?} {elem:?} {rows} rows");
            }
        }
    }
}

/// `a ← silu(a) · b`, as the SwiGLU MLP combines gate and up (any elementwise function serves: the
/// point is where it is applied).
fn silu_mul(a: &mut [f32], b: &[f32]) {
    a.iter_mut()
        .zip(b)
        .for_each(|(a, b)| *a = *a / (1.0 + (-*a).exp()) * b);
}

/// `gemm_gated` on the exact path: each value is `silu_mul` of the two definitions, for f32, bf16
/// and f16 weights (16-bit ones at an odd byte offset), with biases or without, at widths that
/// leave partial panels and tasks, and k over several packed blocks. Below 32 rows, across
/// weights of different shapes and at k = 0 it declines (`fuses_gated`), and callers run the
/// products on their own.
#[test]
fn gated_products_compute_the_definition_bitwise() {
    let mut rng = fastrand::Rng::with_seed(12);
    for &(m, n, k) in &[(32, 17, 7), (45, 48, 64), (130, 400, 1100), (33, 1000, 40)] {
        for elem in [Elem::F32, Elem::Bf16, Elem::F16] {
            let (sg, g) = weight_at(&mut rng, n, k, elem, 1);
            let (su, u) = weight_at(&mut rng, n, k, elem, 1);
            let (wg, wu) = (sg.matrix(), su.matrix());
            assert!(fuses_gated(m, &wg, &wu));
            let x: Vec<f32> = (0..m * k).map(|_| rng.f32() * 4.0 - 2.0).collect();
            let (bg, bu): (Vec<f32>, Vec<f32>) = (0..n).map(|_| (rng.f32(), rng.f32() - 0.5)).unzip();
            for (gate_bias, up_bias) in [
                (None, None),
                (Some(&bg[..]), Some(&bu[..])),
                (None, Some(&bu[..])),
            ] {
                let mut want = reference(&x, m, &g, n, k, gate_bias);
                for (w, u) in want
                    .chunks_mut(n)
                    .zip(reference(&x, m, &u, n, k, up_bias).chunks(n))
                {
                    silu_mul(w, u);
                }
                let mut y = vec![f32::NAN; m * n];
                gemm_gated(&x, m, (&wg, gate_bias), (&wu, up_bias), &mut y, silu_mul);
                assert_eq!(
                    bits(&y),
                    bits(&want),
                    "{elem:?} m={m} n={n} k={k} biases {} {}",
                    gate_bias.is_some(),
                    up_bias.is_some()
                );
            }
        }
    }
    let (sa, _) = weight(&mut rng, 20, 8, Elem::F32);
    let (sb, _) = weight(&mut rng, 21, 8, Elem::F32);
    let (sz, _) = weight(&mut rng, 20, 0, Elem::F32);
    let (a, b, z) = (sa.matrix(), sb.matrix(), sz.matrix());
    assert!(fuses_gated(32, &a, &a));
    assert!(!fuses_gated(31, &a, &a), "decode's rows take their own paths");
    assert!(!fuses_gated(64, &a, &b), "widths differ");
    assert!(!fuses_gated(64, &z, &z), "k = 0");
}
