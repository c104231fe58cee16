//! The CPU backend's fused and out-of-place ops against the compositions they replace and against
//! their definitions computed in f64 on random inputs: `qk_norm_rope_write` (each norm and its
//! rotation in one pass) and `add_rms_norm_owned` (the sum and its norm in one pass) must give the
//! composed ops' bits; `rms_norm`, `layer_norm`, `gather_rows` and `weighted_embedding` (written
//! once, on all threads) must be their definitions. Bad shapes are errors, not panics.

mod common;

use common::Bf16Checkpoint;
use recall::backend::cpu::{CpuBackend, CpuTensor, CpuWeight};
use recall::backend::Backend;
use recall::Error;

fn rand_vec(rng: &mut fastrand::Rng, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| (rng.f32() * 2.0 - 1.0) * scale).collect()
}

fn tensor(rng: &mut fastrand::Rng, rows: usize, cols: usize, scale: f32) -> CpuTensor {
    CpuBackend
        .upload(&rand_vec(rng, rows * cols, scale), rows, cols)
        .unwrap()
}

/// Random 1-D weights of the given lengths, loaded as bf16 CPU weights, with their bf16 values.
fn weights(
    rng: &mut fastrand::Rng,
    named: &[(&str, usize)],
) -> (Bf16Checkpoint, Vec<CpuWeight>, Vec<Vec<f64>>) {
    let tensors: Vec<_> = named
        .iter()
        .map(|&(n, len)| (n, rand_vec(rng, len, 1.5), vec![len]))
        .collect();
    let ckpt = Bf16Checkpoint::new(&tensors);
    let loaded = named
        .iter()
        .map(|(n, _)| CpuBackend.load_weight(ckpt.ckpt.get(n).unwrap()).unwrap())
        .collect();
    let rounded = tensors
        .iter()
        .map(|(_, v, _)| v.iter().map(|&x| half::bf16::from_f32(x).to_f64()).collect())
        .collect();
    (ckpt, loaded, rounded)
}

/// The rows of `rows` and columns `cols` the cases cover: one row, an odd count, a prefill's worth
/// of rows; head sizes 128 and 64 with several heads; a group that is the whole row.
const CASES: [(usize, usize, usize); 4] = [(1, 256, 128), (7, 512, 64), (300, 1024, 128), (33, 96, 96)];

#[test]
fn qk_norm_rope_write_is_its_composition() {
    let be = CpuBackend;
    let mut rng = fastrand::Rng::with_seed(29);
    for (rows, cols, d) in CASES {
        let kv_cols = cols / 2 / d * d;
        let kv_cols = kv_cols.max(d);
        let (q, k, v) = (
            tensor(&mut rng, rows, cols, 3.0),
            tensor(&mut rng, rows, kv_cols, 3.0),
            tensor(&mut rng, rows, kv_cols, 3.0),
        );
        let (cos, sin) = (tensor(&mut rng, rows, d, 1.0), tensor(&mut rng, rows, d, 1.0));
        let (_ckpt, w, _) = weights(&mut rng, &[("qn", d), ("kn", d)]);
        let pool_rows = rows + 5;
        let mut slots: Vec<usize> = (0..pool_rows).collect();
        rng.shuffle(&mut slots);
        slots.truncate(rows);
        let eps = 1e-6;
        for norms in [Some((&w[0], &w[1], eps)), None] {
            let mut pools = (
                tensor(&mut rng, pool_rows, kv_cols, 1.0),
                tensor(&mut rng, pool_rows, kv_cols, 1.0),
            );
            let mut want_pools = pools.clone();
            let got = be
                .qk_norm_rope_write(
                    &q,
                    &k,
                    &v,
                    norms,
                    (&cos, &sin),
                    (&mut pools.0, &mut pools.1),
                    &slots,
                )
                .unwrap();
            let rotate = |x: &CpuTensor, w: Option<&CpuWeight>| match w {
                Some(w) => be.rope(&be.rms_norm(x, w, eps).unwrap(), &cos, &sin).unwrap(),
                None => be.rope(x, &cos, &sin).unwrap(),
            };
            let want_q = rotate(&q, norms.map(|n| n.0));
            let want_k = rotate(&k, norms.map(|n| n.1));
            be.scatter_rows(&mut want_pools.0, &slots, &want_k, false)
                .unwrap();
            be.scatter_rows(&mut want_pools.1, &slots, &v, false).unwrap();
            let case = format!("[{rows}, {cols}] heads of {d}, norms {}", norms.is_some());
            assert_eq!(got.data, want_q.data, "q of {case}");
            assert_eq!(pools.0.data, want_pools.0.data, "k pool of {case}");
            assert_eq!(pools.1.data, want_pools.1.data, "v pool of {case}");
        }
    }
}

#[test]
fn add_rms_norm_owned_is_add_then_rms_norm() {
    let be = CpuBackend;
    let mut rng = fastrand::Rng::with_seed(30);
    for (rows, cols, g) in CASES {
        let (x, r) = (
            tensor(&mut rng, rows, cols, 4.0),
            tensor(&mut rng, rows, cols, 4.0),
        );
        let (_ckpt, w, _) = weights(&mut rng, &[("w", g)]);
        let (sum, normed) = be.add_rms_norm_owned(x.clone(), &r, &w[0], 1e-6).unwrap();
        let want_sum = be.add(&x, &r).unwrap();
        let want_norm = be.rms_norm(&want_sum, &w[0], 1e-6).unwrap();
        assert_eq!(sum.data, want_sum.data, "sum of [{rows}, {cols}]");
        assert_eq!(
            normed.data, want_norm.data,
            "norm of [{rows}, {cols}] in groups of {g}"
        );
    }
}

/// `|got − want| ≤ tol · (|want| + 1)` elementwise, `want` in f64.
fn assert_close(got: &[f32], want: &[f64], tol: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g as f64 - w).abs() <= tol * (w.abs() + 1.0),
            "{what}: element {i} is {g}, the definition {w}"
        );
    }
}

#[test]
fn norms_are_their_definitions() {
    let be = CpuBackend;
    let mut rng = fastrand::Rng::with_seed(31);
    for (rows, cols, g) in CASES {
        let x = tensor(&mut rng, rows, cols, 4.0);
        let (_ckpt, w, v) = weights(&mut rng, &[("g", g), ("w", cols), ("b", cols)]);
        let (wg, ww, wb) = (&v[0], &v[1], &v[2]);
        let mut rms = Vec::new();
        let mut ln = Vec::new();
        for row in x.data.chunks(cols) {
            for group in row.chunks(g) {
                let ms = group.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / g as f64;
                let r = 1.0 / (ms + 1e-6).sqrt();
                rms.extend(group.iter().zip(wg).map(|(&v, w)| w * v as f64 * r));
            }
            let mean = row.iter().map(|&v| v as f64).sum::<f64>() / cols as f64;
            let var = row.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / cols as f64;
            let r = 1.0 / (var + 1e-6).sqrt();
            ln.extend(
                row.iter()
                    .zip(ww.iter().zip(wb))
                    .map(|(&v, (w, b))| (v as f64 - mean) * r * w + b),
            );
        }
        let case = format!("[{rows}, {cols}]");
        assert_close(
            &be.rms_norm(&x, &w[0], 1e-6).unwrap().data,
            &rms,
            1e-5,
            &format!("rms_norm of {case}"),
        );
        assert_close(
            &be.layer_norm(&x, &w[1], &w[2], 1e-6).unwrap().data,
            &ln,
            1e-5,
            &format!("layer_norm of {case}"),
        );
    }
}

#[test]
fn gathered_and_weighted_rows_are_their_definitions() {
    let be = CpuBackend;
    let mut rng = fastrand::Rng::with_seed(32);
    let (rows, cols) = (301, 96);
    let x = tensor(&mut rng, rows, cols, 2.0);
    let index: Vec<usize> = (0..500).map(|_| rng.usize(0..rows)).collect();
    let got = be.gather_rows(&x, &index).unwrap();
    let want: Vec<f32> = index
        .iter()
        .flat_map(|&i| x.data[i * cols..(i + 1) * cols].to_vec())
        .collect();
    assert_eq!((got.rows, got.cols), (index.len(), cols));
    assert_eq!(got.data, want, "gather_rows");
    assert!(be.gather_rows(&x, &[]).unwrap().data.is_empty());

    let table_rows = 40;
    let ckpt = Bf16Checkpoint::new(&[(
        "t",
        rand_vec(&mut rng, table_rows * cols, 1.0),
        vec![table_rows, cols],
    )]);
    let table = be.load_weight(ckpt.ckpt.get("t").unwrap()).unwrap();
    let taps = 4;
    let out_rows = 257;
    let indices: Vec<u32> = (0..out_rows * taps)
        .map(|_| rng.u32(0..table_rows as u32))
        .collect();
    let wts = rand_vec(&mut rng, out_rows * taps, 1.0);
    let got = be.weighted_embedding(&table, &indices, &wts, taps).unwrap();
    let rows_of = |i: u32| be.weighted_embedding(&table, &[i], &[1.0], 1).unwrap().data;
    let mut want = Vec::new();
    for r in 0..out_rows {
        let mut acc = vec![0f64; cols];
        for j in 0..taps {
            let row = rows_of(indices[r * taps + j]);
            acc.iter_mut()
                .zip(&row)
                .for_each(|(a, &e)| *a += e as f64 * wts[r * taps + j] as f64);
        }
        want.extend(acc);
    }
    assert_close(&got.data, &want, 1e-6, "weighted_embedding");
}

#[test]
fn fused_ops_refuse_bad_shapes() {
    let be = CpuBackend;
    let mut rng = fastrand::Rng::with_seed(33);
    let (_ckpt, w, _) = weights(&mut rng, &[("w", 48), ("n", 64)]);
    let x = tensor(&mut rng, 3, 100, 1.0);
    let shape = |r: Result<CpuTensor, Error>, what: &str| {
        let err = r.expect_err(what);
        assert!(matches!(err, Error::Shape { .. }), "{what}: {err}");
    };
    shape(be.rms_norm(&x, &w[0], 1e-6), "rms_norm, 100 columns by 48");
    let other = tensor(&mut rng, 2, 100, 1.0);
    let err = be.add_rms_norm_owned(x.clone(), &other, &w[1], 1e-6).unwrap_err();
    assert!(matches!(err, Error::Shape { .. }), "{err}");
    let (q, k) = (tensor(&mut rng, 3, 128, 1.0), tensor(&mut rng, 3, 64, 1.0));
    let (cos, sin) = (tensor(&mut rng, 2, 64, 1.0), tensor(&mut rng, 2, 64, 1.0));
    let mut pools = (tensor(&mut rng, 4, 64, 1.0), tensor(&mut rng, 4, 64, 1.0));
    let before = pools.clone();
    let r = be.qk_norm_rope_write(
        &q,
        &k,
        &k,
        Some((&w[1], &w[1], 1e-6)),
        (&cos, &sin),
        (&mut pools.0, &mut pools.1),
        &[0, 1, 2],
    );
    shape(r, "rotary tables of 2 rows for 3");
    assert_eq!(
        (pools.0.data, pools.1.data),
        (before.0.data, before.1.data),
        "the pools are untouched"
    );
    // Empty inputs are empty outputs.
    let empty = be.upload(&[], 0, 64).unwrap();
    assert!(be.rms_norm(&empty, &w[1], 1e-6).unwrap().data.is_empty());
}

/// `linears` (one input, several weights) gives each weight the bits of its own `linear`, and
/// refuses a weight whose input width differs.
#[test]
fn linears_are_each_linear() {
    let be = CpuBackend;
    let mut rng = fastrand::Rng::with_seed(34);
    let k = 64;
    let tensors = [
        ("a", rand_vec(&mut rng, 48 * k, 1.0), vec![48, k]),
        ("b", rand_vec(&mut rng, 17 * k, 1.0), vec![17, k]),
        ("ab", rand_vec(&mut rng, 17, 1.0), vec![17]),
        ("odd", rand_vec(&mut rng, 8 * 10, 1.0), vec![8, 10]),
    ];
    let ckpt = Bf16Checkpoint::new(&tensors);
    let w = |n: &str| be.load_weight(ckpt.ckpt.get(n).unwrap()).unwrap();
    let (a, b, ab, odd) = (w("a"), w("b"), w("ab"), w("odd"));
    for rows in [1, 9, 40] {
        let x = tensor(&mut rng, rows, k, 1.0);
        let got = be.linears(&x, &[(&a, None), (&b, Some(&ab))]).unwrap();
        assert_eq!(
            got[0],
            be.linear(&x, &a, None).unwrap(),
            "the first of {rows} rows"
        );
        assert_eq!(
            got[1],
            be.linear(&x, &b, Some(&ab)).unwrap(),
            "the second of {rows} rows"
        );
        let err = be.linears(&x, &[(&a, None), (&odd, None)]).unwrap_err();
        assert!(
            matches!(err, Error::Shape { .. } | Error::ShapeMismatch { .. }),
            "{err}"
        );
    }
}

/// `swiglu` (gate and up fused with their product where the rows are many) gives the bits of
/// `linears` then `silu_mul_owned`, on both sides of the rows it fuses from, with biases or
/// without; a weight of the wrong input width or unequal widths is an error, not a panic.
#[test]
fn swiglu_is_linears_then_silu_mul() {
    let be = CpuBackend;
    let mut rng = fastrand::Rng::with_seed(35);
    let (n, k) = (300, 64);
    let tensors = [
        ("gate", rand_vec(&mut rng, n * k, 1.0), vec![n, k]),
        ("up", rand_vec(&mut rng, n * k, 1.0), vec![n, k]),
        ("gate_bias", rand_vec(&mut rng, n, 1.0), vec![n]),
        ("up_bias", rand_vec(&mut rng, n, 1.0), vec![n]),
        ("narrow", rand_vec(&mut rng, 17 * k, 1.0), vec![17, k]),
        ("odd", rand_vec(&mut rng, n * 10, 1.0), vec![n, 10]),
    ];
    let ckpt = Bf16Checkpoint::new(&tensors);
    let w = |n: &str| be.load_weight(ckpt.ckpt.get(n).unwrap()).unwrap();
    let (gate, up, gb, ub) = (w("gate"), w("up"), w("gate_bias"), w("up_bias"));
    for rows in [1, 31, 32, 200] {
        let x = tensor(&mut rng, rows, k, 2.0);
        for (g, u) in [(None, None), (Some(&gb), Some(&ub))] {
            let got = be.swiglu(&x, (&gate, g), (&up, u)).unwrap();
            let mut both = be.linears(&x, &[(&gate, g), (&up, u)]).unwrap();
            let up_x = both.pop().unwrap();
            let want = be.silu_mul_owned(both.pop().unwrap(), &up_x).unwrap();
            assert_eq!(got, want, "{rows} rows, biases {}", g.is_some());
        }
        for (gw, uw) in [(w("odd"), w("odd")), (w("gate"), w("narrow"))] {
            let err = be.swiglu(&x, (&gw, None), (&uw, None)).unwrap_err();
            assert!(
                matches!(err, Error::Shape { .. } | Error::ShapeMismatch { .. }),
                "{err}"
            );
        }
    }
}
