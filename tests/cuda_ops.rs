//! Op parity of the CUDA backend against the CPU reference, in the spirit of llama.cpp's
//! test-backend-ops: every `Backend` op (and the fused `add_rms_norm`) on fresh random inputs of several
//! shapes, odd sizes included; outputs poisoned with NaN before each op writes them; any NaN fails;
//! errors measured relative to the reference (`max |got − ref| / max(|ref|, rms(ref))`) with bounds per
//! output type: bf16 outputs ≤ 1e-2, f32 outputs ≤ 1e-5, argmax exact.
//!
//! The CPU reference runs on exactly the values the GPU sees: inputs are rounded to bf16 (uploaded and
//! downloaded again) and weights are stored as bf16 in a temporary checkpoint that both backends load,
//! so only the kernels' arithmetic and their output rounding are measured.
//!
//! Also here: the tiny fixture models on CUDA against HF's logits (bf16 tolerance, identical greedy
//! tokens) and the HGKV bypass (bitwise the frozen model on CUDA). Every test prints a SKIP line and
//! returns when no GPU, driver, NVRTC or CUDA headers are present.
#![cfg(feature = "cuda")]

mod common;

use common::{rel_err, shuffled_tables, Bf16Checkpoint};

use std::path::Path;

use recall::backend::cpu::{CpuBackend, CpuTensor};
use recall::backend::cuda::{CudaBackend, CudaTensor};
use recall::backend::{AttnShape, Backend, Gelu, PagedSeq};
use recall::model::loader::Checkpoint;

const BF16_TOL: f32 = 1e-2;
const F32_TOL: f32 = 1e-5;

fn gpu() -> Option<CudaBackend> {
    match CudaBackend::new(0) {
        Ok(be) => {
            be.set_poison(true);
            Some(be)
        }
        Err(e) => {
            eprintln!("SKIP (no usable GPU): {e}");
            None
        }
    }
}

/// Uniform values in `[lo, hi)`.
fn rand_vec(rng: &mut fastrand::Rng, n: usize, lo: f32, hi: f32) -> Vec<f32> {
    (0..n).map(|_| lo + (hi - lo) * rng.f32()).collect()
}

fn bf16_round(v: &[f32]) -> Vec<f32> {
    v.iter().map(|&x| half::bf16::from_f32(x).to_f32()).collect()
}

/// The same activation on both backends (the CPU one holding the bf16-rounded values).
struct Pair {
    gpu: CudaTensor,
    cpu: CpuTensor,
}

fn pair(g: &CudaBackend, data: &[f32], rows: usize, cols: usize) -> Pair {
    let gpu = g.upload(data, rows, cols).unwrap();
    let rounded = g.download(&gpu).unwrap();
    assert_eq!(rounded, bf16_round(data), "upload/download is bf16 rounding");
    Pair {
        cpu: CpuBackend.upload(&rounded, rows, cols).unwrap(),
        gpu,
    }
}

fn rand_pair(g: &CudaBackend, rng: &mut fastrand::Rng, rows: usize, cols: usize, range: f32) -> Pair {
    pair(g, &rand_vec(rng, rows * cols, -range, range), rows, cols)
}

/// Compares a GPU tensor to its CPU twin and prints one line per case.
fn check(g: &CudaBackend, op: &str, case: &str, got: &CudaTensor, want: &CpuTensor, tol: f32) {
    assert_eq!(g.dims(got), CpuBackend.dims(want), "{op} {case}: shape");
    let err = rel_err(&g.download(got).unwrap(), &want.data, BF16_TOL);
    eprintln!("{op:<22} {case:<34} rel err {err:.2e} (bound {tol:.0e})");
    assert!(err <= tol, "{op} {case}: relative error {err} > {tol}");
}

#[test]
fn elementwise_ops_match_cpu() {
    let Some(g) = gpu() else { return };
    let mut rng = fastrand::Rng::with_seed(1);
    for (rows, cols) in [(1, 1), (3, 7), (17, 130), (64, 1000)] {
        let case = format!("[{rows}, {cols}]");
        let a = rand_pair(&g, &mut rng, rows, cols, 10.0);
        let b = rand_pair(&g, &mut rng, rows, cols, 10.0);
        check(
            &g,
            "scale",
            &case,
            &g.scale(&a.gpu, 0.37).unwrap(),
            &CpuBackend.scale(&a.cpu, 0.37).unwrap(),
            BF16_TOL,
        );
        check(
            &g,
            "add",
            &case,
            &g.add(&a.gpu, &b.gpu).unwrap(),
            &CpuBackend.add(&a.cpu, &b.cpu).unwrap(),
            BF16_TOL,
        );
        let (gs, cs) = (
            g.silu_mul(&a.gpu, &b.gpu).unwrap(),
            CpuBackend.silu_mul(&a.cpu, &b.cpu).unwrap(),
        );
        check(&g, "silu_mul", &case, &gs, &cs, BF16_TOL);
        for kind in [Gelu::Tanh, Gelu::Erf] {
            let name = format!("gelu {kind:?}");
            check(
                &g,
                &name,
                &case,
                &g.gelu(&a.gpu, kind).unwrap(),
                &CpuBackend.gelu(&a.cpu, kind).unwrap(),
                BF16_TOL,
            );
        }
    }
    // Shape errors are errors, not launches.
    let (a, b) = (
        rand_pair(&g, &mut rng, 2, 3, 1.0),
        rand_pair(&g, &mut rng, 3, 2, 1.0),
    );
    assert!(g.add(&a.gpu, &b.gpu).is_err());
}

#[test]
fn tensor_plumbing_matches_cpu() {
    let Some(g) = gpu() else { return };
    let mut rng = fastrand::Rng::with_seed(2);
    let a = rand_pair(&g, &mut rng, 9, 13, 3.0);
    let z = g.zeros(4, 5).unwrap();
    assert_eq!(g.download(&z).unwrap(), vec![0.0; 20]);
    check(
        &g,
        "rows",
        "[9, 13] 2..7",
        &g.rows(&a.gpu, 2, 5).unwrap(),
        &CpuBackend.rows(&a.cpu, 2, 5).unwrap(),
        0.0,
    );
    check(
        &g,
        "rows",
        "[9, 13] 9..9",
        &g.rows(&a.gpu, 9, 0).unwrap(),
        &CpuBackend.rows(&a.cpu, 9, 0).unwrap(),
        0.0,
    );
    assert!(g.rows(&a.gpu, 5, 5).is_err());
    let gr = g.reshape(g.rows(&a.gpu, 0, 9).unwrap(), 13, 9).unwrap();
    let cr = CpuBackend.reshape(a.cpu.clone(), 13, 9).unwrap();
    check(&g, "reshape", "[9, 13] -> [13, 9]", &gr, &cr, 0.0);
    let index = [8, 0, 3, 3, 1];
    let (gg, cg) = (
        g.gather_rows(&a.gpu, &index).unwrap(),
        CpuBackend.gather_rows(&a.cpu, &index).unwrap(),
    );
    check(&g, "gather_rows", "5 of 9", &gg, &cg, 0.0);
    assert!(g.gather_rows(&a.gpu, &[9]).is_err());
    for accumulate in [false, true] {
        for index in [vec![4usize, 0, 7], vec![2, 2, 5]] {
            let src = rand_pair(&g, &mut rng, 3, 13, 3.0);
            let (mut gd, mut cd) = (g.rows(&a.gpu, 0, 9).unwrap(), a.cpu.clone());
            g.scatter_rows(&mut gd, &index, &src.gpu, accumulate).unwrap();
            CpuBackend
                .scatter_rows(&mut cd, &index, &src.cpu, accumulate)
                .unwrap();
            let tol = if accumulate { BF16_TOL } else { 0.0 };
            check(
                &g,
                "scatter_rows",
                &format!("{index:?} accumulate={accumulate}"),
                &gd,
                &cd,
                tol,
            );
        }
    }
}

#[test]
fn split_cols_matches_cpu() {
    let Some(g) = gpu() else { return };
    let mut rng = fastrand::Rng::with_seed(12);
    for (rows, cols, parts) in [(1, 3, 3), (7, 96, 3), (33, 40, 2)] {
        let a = rand_pair(&g, &mut rng, rows, cols, 3.0);
        let gs = g.split_cols(g.rows(&a.gpu, 0, rows).unwrap(), parts).unwrap();
        let cs = CpuBackend.split_cols(a.cpu.clone(), parts).unwrap();
        for (j, (gp, cp)) in gs.iter().zip(&cs).enumerate() {
            check(
                &g,
                "split_cols",
                &format!("[{rows}, {cols}] part {j}/{parts}"),
                gp,
                cp,
                0.0,
            );
        }
    }
    assert!(g.split_cols(g.zeros(2, 5).unwrap(), 3).is_err());
}

#[test]
fn embeddings_match_cpu() {
    let Some(g) = gpu() else { return };
    let mut rng = fastrand::Rng::with_seed(3);
    for (vocab, cols) in [(50, 33), (1040, 64), (7, 1)] {
        let w = Bf16Checkpoint::new(&[(
            "t",
            rand_vec(&mut rng, vocab * cols, -1.0, 1.0),
            vec![vocab, cols],
        )]);
        let (gt, ct) = w.both(&g, "t");
        let ids: Vec<u32> = (0..37).map(|_| rng.u32(0..vocab as u32)).collect();
        let case = format!("vocab {vocab} × {cols}");
        check(
            &g,
            "embedding",
            &case,
            &g.embedding(&gt, &ids).unwrap(),
            &CpuBackend.embedding(&ct, &ids).unwrap(),
            0.0,
        );
        assert!(g.embedding(&gt, &[vocab as u32]).is_err());
        let taps = 4;
        let idx: Vec<u32> = (0..11 * taps).map(|_| rng.u32(0..vocab as u32)).collect();
        let wts = rand_vec(&mut rng, idx.len(), 0.0, 1.0);
        let gw = g.weighted_embedding(&gt, &idx, &wts, taps).unwrap();
        let cw = CpuBackend.weighted_embedding(&ct, &idx, &wts, taps).unwrap();
        check(&g, "weighted_embedding", &case, &gw, &cw, BF16_TOL);
    }
}

#[test]
fn linear_matches_cpu() {
    let Some(g) = gpu() else { return };
    let mut rng = fastrand::Rng::with_seed(4);
    for (n, inp, out) in [
        (1, 64, 32),
        (7, 33, 17),
        (130, 128, 96),
        (3, 256, 1040),
        (1, 1, 1),
        (64, 4096, 8),
    ] {
        let scale = 1.0 / (inp as f32).sqrt();
        let w = Bf16Checkpoint::new(&[
            ("w", rand_vec(&mut rng, out * inp, -scale, scale), vec![out, inp]),
            ("b", rand_vec(&mut rng, out, -1.0, 1.0), vec![out]),
        ]);
        let (gw, cw) = w.both(&g, "w");
        let (gb, cb) = w.both(&g, "b");
        let x = rand_pair(&g, &mut rng, n, inp, 1.0);
        let case = format!("[{n}, {inp}] · [{out}, {inp}]ᵀ");
        check(
            &g,
            "linear",
            &case,
            &g.linear(&x.gpu, &gw, None).unwrap(),
            &CpuBackend.linear(&x.cpu, &cw, None).unwrap(),
            BF16_TOL,
        );
        let (gy, cy) = (
            g.linear(&x.gpu, &gw, Some(&gb)).unwrap(),
            CpuBackend.linear(&x.cpu, &cw, Some(&cb)).unwrap(),
        );
        check(&g, "linear+bias", &case, &gy, &cy, BF16_TOL);
        // Second call of the same shape reuses the cached plan and gives the same bits.
        let again = g.linear(&x.gpu, &gw, Some(&gb)).unwrap();
        assert_eq!(
            g.download(&again).unwrap(),
            g.download(&gy).unwrap(),
            "{case}: not deterministic"
        );
    }
    eprintln!("cuBLASLt plans cached: {}", g.cached_gemm_plans());
}

/// `linear` over zero inputs is an empty sum: the bias in every row, zeros without one. The CPU is
/// checked against that definition first (this part runs without a GPU), then the GPU against it,
/// exactly (the bias values are exact in bf16).
#[test]
fn linear_with_no_inputs_is_the_bias() {
    let (rows, out) = (3, 5);
    let bias: Vec<f32> = (0..out).map(|i| i as f32 - 1.5).collect();
    let w = Bf16Checkpoint::new(&[("w", vec![], vec![out, 0]), ("b", bias.clone(), vec![out])]);
    let want: Vec<f32> = bias.iter().cycle().take(rows * out).copied().collect();
    let zeros = vec![0f32; rows * out];
    let cpu = |name: &str| CpuBackend.load_weight(w.ckpt.get(name).unwrap()).unwrap();
    let (cw, cb) = (cpu("w"), cpu("b"));
    let x = CpuBackend.upload(&[], rows, 0).unwrap();
    assert_eq!(
        CpuBackend.linear(&x, &cw, Some(&cb)).unwrap().data,
        want,
        "CPU with bias"
    );
    assert_eq!(
        CpuBackend.linear(&x, &cw, None).unwrap().data,
        zeros,
        "CPU without bias"
    );
    let Some(g) = gpu() else { return };
    let ((gw, _), (gb, _)) = (w.both(&g, "w"), w.both(&g, "b"));
    let x = g.upload(&[], rows, 0).unwrap();
    let with = g.linear(&x, &gw, Some(&gb)).unwrap();
    assert_eq!(g.dims(&with), (rows, out));
    assert_eq!(g.download(&with).unwrap(), want, "CUDA with bias");
    let without = g.linear(&x, &gw, None).unwrap();
    assert_eq!(g.download(&without).unwrap(), zeros, "CUDA without bias");
}

#[test]
fn norms_match_cpu() {
    let Some(g) = gpu() else { return };
    let mut rng = fastrand::Rng::with_seed(5);
    for (rows, cols, group) in [
        (5, 64, 64),
        (7, 128, 32),
        (3, 130, 130),
        (2, 4096, 4096),
        (9, 48, 16),
        (1, 1, 1),
    ] {
        let w = Bf16Checkpoint::new(&[
            ("w", rand_vec(&mut rng, group, 0.5, 1.5), vec![group]),
            ("lw", rand_vec(&mut rng, cols, 0.5, 1.5), vec![cols]),
            ("lb", rand_vec(&mut rng, cols, -0.5, 0.5), vec![cols]),
        ]);
        let ((gw, cw), (glw, clw), (glb, clb)) = (w.both(&g, "w"), w.both(&g, "lw"), w.both(&g, "lb"));
        let x = rand_pair(&g, &mut rng, rows, cols, 4.0);
        let case = format!("[{rows}, {cols}] groups of {group}");
        let eps = 1e-6;
        check(
            &g,
            "rms_norm",
            &case,
            &g.rms_norm(&x.gpu, &gw, eps).unwrap(),
            &CpuBackend.rms_norm(&x.cpu, &cw, eps).unwrap(),
            BF16_TOL,
        );
        let r = rand_pair(&g, &mut rng, rows, cols, 4.0);
        let (gsum, gnorm) = g.add_rms_norm(&x.gpu, &r.gpu, &gw, eps).unwrap();
        let csum = CpuBackend.add(&x.cpu, &r.cpu).unwrap();
        let csum = CpuBackend.upload(&bf16_round(&csum.data), rows, cols).unwrap();
        check(&g, "add_rms_norm (sum)", &case, &gsum, &csum, BF16_TOL);
        check(
            &g,
            "add_rms_norm (norm)",
            &case,
            &gnorm,
            &CpuBackend.rms_norm(&csum, &cw, eps).unwrap(),
            BF16_TOL,
        );
        let (gl, cl) = (
            g.layer_norm(&x.gpu, &glw, &glb, eps).unwrap(),
            CpuBackend.layer_norm(&x.cpu, &clw, &clb, eps).unwrap(),
        );
        check(&g, "layer_norm", &format!("[{rows}, {cols}]"), &gl, &cl, BF16_TOL);
    }
}

#[test]
fn rope_matches_cpu() {
    let Some(g) = gpu() else { return };
    let mut rng = fastrand::Rng::with_seed(6);
    for (n, heads, d) in [(1, 1, 2), (5, 4, 16), (9, 2, 32), (33, 8, 128), (3, 3, 80)] {
        let x = rand_pair(&g, &mut rng, n, heads * d, 2.0);
        let angles = rand_vec(&mut rng, n * d, -20.0, 20.0);
        let cos: Vec<f32> = angles.iter().map(|a| a.cos()).collect();
        let sin: Vec<f32> = angles.iter().map(|a| a.sin()).collect();
        let (c, s) = (pair(&g, &cos, n, d), pair(&g, &sin, n, d));
        let case = format!("n {n}, {heads} heads × {d}");
        let (gr, cr) = (
            g.rope(&x.gpu, &c.gpu, &s.gpu).unwrap(),
            CpuBackend.rope(&x.cpu, &c.cpu, &s.cpu).unwrap(),
        );
        check(&g, "rope", &case, &gr, &cr, BF16_TOL);
    }
}

/// A paged attention entry point of the CUDA backend: the trait op (which dispatches to the newest
/// kernel for the shape) or an explicit kernel.
type PagedOp = fn(
    &CudaBackend,
    &CudaTensor,
    &CudaTensor,
    &CudaTensor,
    AttnShape,
    &[PagedSeq],
) -> recall::Result<CudaTensor>;

/// The trait op.
const DISPATCHED: PagedOp = |g, q, k, v, s, b| g.paged_attention(q, k, v, s, b);
/// The v1 kernel of attention.cu (the fallback), whatever the shape.
const V1: PagedOp = |g, q, k, v, s, b| g.paged_attention_v1(q, k, v, s, b);

/// Paged attention shapes: GQA 2:1 and 4:1 and 1:1, odd block sizes, head dims 16 to 128.
const PAGED_SHAPES: [AttnShape; 4] = [
    AttnShape {
        q_heads: 4,
        kv_heads: 2,
        head_dim: 32,
        block_size: 16,
    },
    AttnShape {
        q_heads: 2,
        kv_heads: 1,
        head_dim: 16,
        block_size: 3,
    },
    AttnShape {
        q_heads: 8,
        kv_heads: 2,
        head_dim: 128,
        block_size: 16,
    },
    AttnShape {
        q_heads: 3,
        kv_heads: 3,
        head_dim: 72,
        block_size: 5,
    },
];

/// Prefill (with history), mixed chunked prefill + decode, pure decode (split-K), long decode.
const PAGED_BATCHES: [&[(usize, usize)]; 5] = [
    &[(7, 7)],
    &[(5, 12), (1, 30), (17, 17)],
    &[(1, 1), (1, 9), (1, 40)],
    &[(1, 700), (1, 257), (1, 3)],
    &[(1, 2049)],
];

/// A random batch over a shuffled block pool: `(rows, context_len)` per sequence; `op` on the GPU
/// against the CPU, relative error.
fn attention_case(
    g: &CudaBackend,
    rng: &mut fastrand::Rng,
    op: PagedOp,
    shape: AttnShape,
    seqs: &[(usize, usize)],
) -> f32 {
    let blocks_per: Vec<usize> = seqs.iter().map(|&(_, c)| c.div_ceil(shape.block_size)).collect();
    let (tables, num_blocks) = shuffled_tables(rng, &blocks_per, 3);
    let slots = num_blocks * shape.block_size;
    let kvd = shape.kv_heads * shape.head_dim;
    let (k, v) = (
        rand_pair(g, rng, slots, kvd, 2.0),
        rand_pair(g, rng, slots, kvd, 2.0),
    );
    let rows: usize = seqs.iter().map(|s| s.0).sum();
    let q = rand_pair(g, rng, rows, shape.q_heads * shape.head_dim, 2.0);
    let batch: Vec<PagedSeq> = seqs
        .iter()
        .zip(&tables)
        .map(|(&(rows, context_len), t)| PagedSeq {
            rows,
            context_len,
            block_table: t,
        })
        .collect();
    let got = op(g, &q.gpu, &k.gpu, &v.gpu, shape, &batch).unwrap();
    let want = CpuBackend
        .paged_attention(&q.cpu, &k.cpu, &v.cpu, shape, &batch)
        .unwrap();
    let case = format!(
        "{}q/{}kv × {} bs {} {seqs:?}",
        shape.q_heads, shape.kv_heads, shape.head_dim, shape.block_size
    );
    let case: String = case.chars().take(60).collect();
    let err = rel_err(&g.download(&got).unwrap(), &want.data, BF16_TOL);
    eprintln!("paged_attention        {case:<34} rel err {err:.2e} (bound {BF16_TOL:.0e})");
    err
}

#[test]
fn paged_attention_matches_cpu() {
    let Some(g) = gpu() else { return };
    let mut rng = fastrand::Rng::with_seed(7);
    for s in PAGED_SHAPES {
        for seqs in PAGED_BATCHES {
            let err = attention_case(&g, &mut rng, DISPATCHED, s, seqs);
            assert!(
                err <= BF16_TOL,
                "paged_attention {s:?} {seqs:?}: relative error {err}"
            );
        }
    }
    // head_dim over the kernels' register budget is an error.
    let s = AttnShape {
        q_heads: 1,
        kv_heads: 1,
        head_dim: 256,
        block_size: 4,
    };
    let q = g.zeros(1, 256).unwrap();
    let kv = g.zeros(4, 256).unwrap();
    let seq = [PagedSeq {
        rows: 1,
        context_len: 1,
        block_table: &[0],
    }];
    assert!(g.paged_attention(&q, &kv, &kv, s, &seq).is_err());
}

/// The v1 kernel itself: the trait op reaches flash or decode v2 for every shape above, so without
/// this test the fallback (unaligned operands, `RECALL_ATTN=v1`) would run in no test.
#[test]
fn paged_attention_v1_matches_cpu() {
    let Some(g) = gpu() else { return };
    let mut rng = fastrand::Rng::with_seed(17);
    for s in PAGED_SHAPES {
        for seqs in PAGED_BATCHES {
            let err = attention_case(&g, &mut rng, V1, s, seqs);
            assert!(
                err <= BF16_TOL,
                "paged_attention_v1 {s:?} {seqs:?}: relative error {err}"
            );
        }
    }
    let (q, kv) = (g.zeros(1, 256).unwrap(), g.zeros(4, 256).unwrap());
    let s = AttnShape {
        q_heads: 1,
        kv_heads: 1,
        head_dim: 256,
        block_size: 4,
    };
    let seq = [PagedSeq {
        rows: 1,
        context_len: 1,
        block_table: &[0],
    }];
    assert!(
        g.paged_attention_v1(&q, &kv, &kv, s, &seq).is_err(),
        "head_dim 256"
    );
}

/// `RECALL_ATTN=v1` (here its run-time switch): the trait ops then give bitwise the v1 kernels'
/// output on calls that are all prefill or all decode (a mixed call is split, so that its decode rows
/// get split-K as in a decode step).
#[test]
fn forced_v1_mode_runs_the_v1_kernels() {
    let Some(g) = gpu() else { return };
    let mut rng = fastrand::Rng::with_seed(18);
    let s = PAGED_SHAPES[2];
    let bits = |t: &CudaTensor| -> Vec<u32> { g.download(t).unwrap().iter().map(|v| v.to_bits()).collect() };
    for seqs in [&[(100usize, 130usize), (7, 7)][..], &[(1, 700), (1, 3)][..]] {
        let blocks: Vec<usize> = seqs.iter().map(|&(_, c)| c.div_ceil(s.block_size)).collect();
        let (tables, n) = shuffled_tables(&mut rng, &blocks, 3);
        let kvd = s.kv_heads * s.head_dim;
        let rows: usize = seqs.iter().map(|x| x.0).sum();
        let q = rand_pair(&g, &mut rng, rows, s.q_heads * s.head_dim, 2.0).gpu;
        let k = rand_pair(&g, &mut rng, n * s.block_size, kvd, 2.0).gpu;
        let v = rand_pair(&g, &mut rng, n * s.block_size, kvd, 2.0).gpu;
        let batch: Vec<PagedSeq> = seqs
            .iter()
            .zip(&tables)
            .map(|(&(rows, context_len), t)| PagedSeq {
                rows,
                context_len,
                block_table: t,
            })
            .collect();
        let v1 = bits(&g.paged_attention_v1(&q, &k, &v, s, &batch).unwrap());
        g.set_attention_v1_only(true);
        let forced = g.paged_attention(&q, &k, &v, s, &batch).map(|t| bits(&t));
        g.set_attention_v1_only(false);
        assert!(
            forced.unwrap() == v1,
            "{seqs:?}: forced v1 differs from paged_attention_v1"
        );
    }
    let [q, k, v] = [0; 3].map(|_| rand_pair(&g, &mut rng, 90, 2 * 64, 2.0).gpu);
    let cu = [0usize, 30, 90];
    let v1 = bits(&g.attention_segments_v1(&q, &k, &v, 2, &cu).unwrap());
    g.set_attention_v1_only(true);
    let forced = g.attention_segments(&q, &k, &v, 2, &cu).map(|t| bits(&t));
    g.set_attention_v1_only(false);
    assert!(forced.unwrap() == v1, "segments: forced v1 differs");
}

#[test]
fn attention_segments_match_cpu() {
    let Some(g) = gpu() else { return };
    let mut rng = fastrand::Rng::with_seed(8);
    for (heads, d) in [(2, 16), (2, 32), (4, 64), (3, 72), (2, 80), (1, 128)] {
        for cu in [vec![0usize, 5], vec![0, 1, 17, 17, 50], vec![0, 64, 128, 200]] {
            let n = *cu.last().unwrap();
            let (q, k, v) = (
                rand_pair(&g, &mut rng, n, heads * d, 2.0),
                rand_pair(&g, &mut rng, n, heads * d, 2.0),
                rand_pair(&g, &mut rng, n, heads * d, 2.0),
            );
            let got = g.attention_segments(&q.gpu, &k.gpu, &v.gpu, heads, &cu).unwrap();
            let want = CpuBackend
                .attention_segments(&q.cpu, &k.cpu, &v.cpu, heads, &cu)
                .unwrap();
            let case = format!("{heads} × {d}, cu {cu:?}");
            check(&g, "attention_segments", &case, &got, &want, BF16_TOL);
            // The v1 kernel explicitly (the trait op runs flash for every head dim here).
            let v1 = g
                .attention_segments_v1(&q.gpu, &k.gpu, &v.gpu, heads, &cu)
                .unwrap();
            check(&g, "attention_segments_v1", &case, &v1, &want, BF16_TOL);
        }
    }
}

#[test]
fn vocab_reductions_match_cpu() {
    let Some(g) = gpu() else { return };
    let mut rng = fastrand::Rng::with_seed(9);
    for (rows, vocab) in [(1, 1), (3, 151), (5, 1040), (2, 151_936)] {
        let x = rand_pair(&g, &mut rng, rows, vocab, 8.0);
        let targets: Vec<u32> = (0..rows).map(|_| rng.u32(0..vocab as u32)).collect();
        let got = g.log_softmax_gather(&x.gpu, &targets).unwrap();
        let want = CpuBackend.log_softmax_gather(&x.cpu, &targets).unwrap();
        let err = rel_err(&got, &want, BF16_TOL);
        eprintln!(
            "log_softmax_gather     [{rows}, {vocab}]{:<20} rel err {err:.2e} (bound {F32_TOL:.0e})",
            ""
        );
        assert!(err <= F32_TOL, "log_softmax_gather [{rows}, {vocab}]: {err}");
        // bf16 rounding makes ties common: the first maximum must win, as on the CPU.
        let (ga, ca) = (g.argmax(&x.gpu).unwrap(), CpuBackend.argmax(&x.cpu).unwrap());
        eprintln!(
            "argmax                 [{rows}, {vocab}]{:<20} {}",
            "",
            if ga == ca { "exact" } else { "DIFFERS" }
        );
        assert_eq!(ga, ca, "argmax [{rows}, {vocab}]");
    }
    // Explicit ties, -inf and NaN (at index 0, in the middle, everywhere): NaN never wins, on both.
    let (nan, ninf) = (f32::NAN, f32::NEG_INFINITY);
    let rows: [[f32; 3]; 7] = [
        [1.0, 3.0, 3.0],
        [ninf, ninf, ninf],
        [nan, 1.0, 2.0],
        [1.0, nan, 0.5],
        [nan, nan, nan],
        [nan, ninf, -1.0],
        [nan, ninf, ninf],
    ];
    let x = pair(&g, rows.as_flattened(), rows.len(), 3);
    let (ga, ca) = (g.argmax(&x.gpu).unwrap(), CpuBackend.argmax(&x.cpu).unwrap());
    assert_eq!(ga, ca, "argmax with ties, -inf and NaN");
    assert_eq!(
        ca,
        [1, 0, 2, 0, 0, 2, 1],
        "numpy's nanargmax (all-NaN: 0), as kernels/reduce.cu says"
    );
}

// ---- whole models on CUDA ----

mod models {
    use super::*;
    use common::{fixture, prompt_logits as logits, Reference};
    use recall::engine::{generate, GenerateParams, Pipeline, PromptInput};
    use recall::model::{AdapterMode, LogitsFor, Positions};
    use recall::tokenize::chat::parse_messages;

    /// Logits of a bf16 run against HF's f32 logits: relative to the logits' rms.
    const MODEL_TOL: f32 = 5e-2;

    fn check_model(dir: &Path) {
        let Some(g) = gpu() else { return };
        g.set_poison(false);
        let p = Pipeline::load(g, dir, Some(&fixture("tiny-tokenizer/tokenizer.json"))).unwrap();
        let reference = Reference::load(dir, "reference");
        for (i, prompt) in reference.prompts().iter().enumerate() {
            let name = prompt["name"].as_str().unwrap();
            let messages = parse_messages(&prompt["messages"].to_string(), Path::new("fixture")).unwrap();
            let ids = p.prepare(&messages, true).unwrap().ids;
            assert_eq!(
                ids,
                reference.ids(&format!("p{i}.input_ids")),
                "{name}: input ids"
            );
            let be = &p.backend;
            let mut cache = p.model.text.new_cache(be, ids.len()).unwrap();
            let out = p
                .model
                .text
                .forward(
                    be,
                    &ids,
                    &Positions::text(0, ids.len()),
                    None,
                    &[],
                    &mut cache,
                    LogitsFor::All,
                    false,
                )
                .unwrap();
            let (want, _) = reference.f32(&format!("p{i}.logits"));
            let err = rel_err(&be.download(&out.logits).unwrap(), &want, BF16_TOL);
            eprintln!(
                "{} {name}: logits rel err {err:.2e} (bound {MODEL_TOL:.0e})",
                dir.display()
            );
            assert!(err <= MODEL_TOL, "{name}: logits relative error {err}");
            let want = reference.ids(&format!("p{i}.greedy"));
            let params = GenerateParams {
                max_tokens: want.len(),
                eos_token_ids: vec![],
                stop_strings: vec![],
            };
            let got = generate(be, &p.model.text, &PromptInput::text(&ids), &params, None).unwrap();
            assert_eq!(got.tokens, want, "{name}: greedy tokens differ from HF on CUDA");
        }
    }

    #[test]
    fn tiny_qwen3_vl_on_cuda_matches_hf() {
        check_model(&fixture("tiny-qwen3-vl"));
    }

    #[test]
    fn tiny_qwen2_5_vl_on_cuda_matches_hf() {
        check_model(&fixture("tiny-qwen2.5-vl"));
    }

    #[test]
    fn tiny_qwen3_vl_bf16_on_cuda_matches_hf() {
        check_model(&fixture("tiny-qwen3-vl-bf16"));
    }

    #[test]
    fn tiny_qwen3_vl_head_dim_64_on_cuda_matches_hf() {
        check_model(&fixture("tiny-qwen3-vl-d64"));
    }

    /// HGKV with no history image: the adapter must not run, so logits are bitwise the frozen model's.
    #[test]
    fn hgkv_bypass_is_bitwise_on_cuda() {
        let (Some(g1), Some(g2)) = (gpu(), gpu()) else {
            return;
        };
        let base = Pipeline::load(g1, &fixture("tiny-qwen3-vl"), None).unwrap();
        let mut gated = Pipeline::load(g2, &fixture("tiny-qwen3-vl"), None).unwrap();
        gated
            .load_adapter(&fixture("hgkv-peft"), AdapterMode::Gated)
            .unwrap();
        let root = env!("CARGO_MANIFEST_DIR");
        let chats = [
            r#"[{"role": "user", "content": "Open the settings app."}]"#.to_string(),
            format!(
                r#"[{{"role": "user", "content": [{{"type": "image", "image": "{root}/tests/fixtures/vl-images/screen.png"}},
                    {{"type": "text", "text": "Next?"}}]}}]"#
            ),
        ];
        for chat in &chats {
            let messages = parse_messages(chat, Path::new("chat")).unwrap();
            let (a, b) = (
                base.prepare(&messages, true).unwrap(),
                gated.prepare(&messages, true).unwrap(),
            );
            assert!(b.lora_rows().is_empty());
            let (la, lb) = (logits(&base, &a), logits(&gated, &b));
            assert!(
                la.iter().zip(&lb).all(|(x, y)| x.to_bits() == y.to_bits()),
                "logits differ from the frozen model"
            );
            let ga = base.generate_input(&a, 8, &[]).unwrap();
            let gb = gated.generate_input(&b, 8, &[]).unwrap();
            assert_eq!(ga.tokens, gb.tokens);
            eprintln!(
                "hgkv bypass on CUDA: {} logits bitwise equal, tokens {:?}",
                la.len(),
                ga.tokens
            );
        }
    }
}

/// Freed memory stays in the device's pool: the release threshold is the maximum, not CUDA's 0.
#[test]
fn freed_memory_stays_in_the_pool() {
    let Some(g) = gpu() else { return };
    assert_eq!(g.pool_release_threshold().unwrap(), u64::MAX);
}

/// Synthetic weights generated on the device (`fill_random_v1`) are bitwise the host generator's
/// values (`Fill::value`), for a whole tensor and for a row slice of it.
#[test]
fn synthetic_weights_on_the_device_are_the_host_values() {
    use recall::model::loader::Fill;
    let Some(g) = gpu() else { return };
    let fill = Fill::Uniform {
        seed: 0x5eed,
        scale: 0.0346,
    };
    let ckpt = Checkpoint::synthetic("test", [("w".to_string(), vec![300, 257], fill)]).unwrap();
    let w = ckpt.get("w").unwrap();
    for t in [w.clone(), w.slice_rows(17, 100).unwrap()] {
        let rows = t.shape[0];
        let gw = g.load_weight(&t).unwrap();
        // Read the weight back through an identity GEMM: x = I selects each row exactly (bf16 values,
        // one nonzero product per output).
        let mut eye = vec![0f32; 257 * 257];
        (0..257).for_each(|i| eye[i * 257 + i] = 1.0);
        let x = g.upload(&eye, 257, 257).unwrap();
        let y = g.download(&g.linear(&x, &gw, None).unwrap()).unwrap(); // [257, rows] = Wᵀ
        let want = t.to_f32();
        for r in 0..rows {
            for c in 0..257 {
                assert_eq!(
                    y[c * rows + r].to_bits(),
                    want[r * 257 + c].to_bits(),
                    "({r}, {c})"
                );
            }
        }
    }
}
