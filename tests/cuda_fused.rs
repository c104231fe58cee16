//! The fused CUDA `qk_norm_rope_write` (kernels/fused.cu, `qk_norm_rope_write_v1`) against the unfused
//! composition on the same backend (`rms_norm` → `rope` → `scatter_rows`): the returned q, the whole
//! k pool and the whole v pool must be BITWISE equal. Also against the CPU backend within bf16
//! tolerance. Shapes: Qwen3-like (q/k norms) and Qwen2.5-like (none), head dims 16 to 512 (512: each
//! norm thread sums two elements), GQA 4:1 and 1:1, 1, 7 and 300 rows, slots shuffled in a larger pool.
//!
//! Every test prints a SKIP line and returns when no GPU, driver, NVRTC or CUDA headers are present.
#![cfg(feature = "cuda")]

mod common;

use common::{rel_err, Bf16Checkpoint};
use recall::backend::cpu::{CpuBackend, CpuTensor};
use recall::backend::cuda::{CudaBackend, CudaTensor};
use recall::backend::Backend;

const BF16_TOL: f32 = 1e-2;
const OP: &str = "qk_norm_rope_write";

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

/// The same activation on both backends (the CPU one holding the bf16-rounded values).
struct Pair {
    gpu: CudaTensor,
    cpu: CpuTensor,
}

fn pair(g: &CudaBackend, data: &[f32], rows: usize, cols: usize) -> Pair {
    let gpu = g.upload(data, rows, cols).unwrap();
    let rounded = g.download(&gpu).unwrap();
    Pair {
        cpu: CpuBackend.upload(&rounded, rows, cols).unwrap(),
        gpu,
    }
}

/// Asserts two downloads are the same bf16 values bit for bit (no NaN: poisoned elements fail).
fn assert_bitwise(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: lengths differ");
    let diffs: Vec<usize> = (0..got.len())
        .filter(|&i| got[i].to_bits() != want[i].to_bits())
        .collect();
    for &i in diffs.iter().take(10) {
        eprintln!("  {what}: element {i}: fused {} vs composed {}", got[i], want[i]);
    }
    assert!(
        diffs.is_empty(),
        "{what}: {} elements differ from the composition",
        diffs.len()
    );
    assert!(got.iter().all(|x| !x.is_nan()), "{what}: NaN (unwritten element)");
}

/// One call's inputs on both backends.
struct Inputs {
    q: Pair,
    k: Pair,
    v: Pair,
    cos: Pair,
    sin: Pair,
    k_pool: Vec<f32>,
    v_pool: Vec<f32>,
    pool_rows: usize,
    slots: Vec<usize>,
    weights: Bf16Checkpoint,
}

fn inputs(g: &CudaBackend, rng: &mut fastrand::Rng, s: Shape, slots: Vec<usize>, pool_rows: usize) -> Inputs {
    let Shape {
        n,
        q_heads,
        kv_heads,
        d,
        ..
    } = s;
    let q = pair(g, &rand_vec(rng, n * q_heads * d, -4.0, 4.0), n, q_heads * d);
    let k = pair(g, &rand_vec(rng, n * kv_heads * d, -4.0, 4.0), n, kv_heads * d);
    let v = pair(g, &rand_vec(rng, n * kv_heads * d, -4.0, 4.0), n, kv_heads * d);
    let angles = rand_vec(rng, n * d, -30.0, 30.0);
    let cos: Vec<f32> = angles.iter().map(|a| a.cos()).collect();
    let sin: Vec<f32> = angles.iter().map(|a| a.sin()).collect();
    let (cos, sin) = (pair(g, &cos, n, d), pair(g, &sin, n, d));
    let pool_len = pool_rows * kv_heads * d;
    let weights = Bf16Checkpoint::new(&[
        ("q_norm", rand_vec(rng, d, 0.5, 1.5), vec![d]),
        ("k_norm", rand_vec(rng, d, 0.5, 1.5), vec![d]),
    ]);
    Inputs {
        q,
        k,
        v,
        cos,
        sin,
        k_pool: rand_vec(rng, pool_len, -1.0, 1.0),
        v_pool: rand_vec(rng, pool_len, -1.0, 1.0),
        pool_rows,
        slots,
        weights,
    }
}

#[derive(Debug, Clone, Copy)]
struct Shape {
    norms: bool,
    n: usize,
    q_heads: usize,
    kv_heads: usize,
    d: usize,
}

/// Fused (the trait op) vs the composition on the GPU, bitwise, and vs the CPU backend.
fn check_case(g: &CudaBackend, x: &Inputs, s: Shape) {
    let case = format!("{s:?}");
    let eps = 1e-6;
    let (gqn, cqn) = x.weights.both(g, "q_norm");
    let (gkn, ckn) = x.weights.both(g, "k_norm");
    let cols = s.kv_heads * s.d;
    let pool = |data: &[f32]| g.upload(data, x.pool_rows, cols).unwrap();

    let (mut kf, mut vf) = (pool(&x.k_pool), pool(&x.v_pool));
    let gnorms = s.norms.then_some((&gqn, &gkn, eps));
    let qf = g
        .qk_norm_rope_write(
            &x.q.gpu,
            &x.k.gpu,
            &x.v.gpu,
            gnorms,
            (&x.cos.gpu, &x.sin.gpu),
            (&mut kf, &mut vf),
            &x.slots,
        )
        .unwrap_or_else(|e| panic!("{case}: {e}"));

    // The composition, op by op (what the trait's default does).
    let rotate = |t: &CudaTensor, w: Option<&<CudaBackend as Backend>::Weight>| match w {
        Some(w) => g
            .rope(&g.rms_norm(t, w, eps).unwrap(), &x.cos.gpu, &x.sin.gpu)
            .unwrap(),
        None => g.rope(t, &x.cos.gpu, &x.sin.gpu).unwrap(),
    };
    let qc = rotate(&x.q.gpu, s.norms.then_some(&gqn));
    let kc = rotate(&x.k.gpu, s.norms.then_some(&gkn));
    let (mut kpc, mut vpc) = (pool(&x.k_pool), pool(&x.v_pool));
    g.scatter_rows(&mut kpc, &x.slots, &kc, false).unwrap();
    g.scatter_rows(&mut vpc, &x.slots, &x.v.gpu, false).unwrap();

    let (qf, kf, vf) = (
        g.download(&qf).unwrap(),
        g.download(&kf).unwrap(),
        g.download(&vf).unwrap(),
    );
    assert_eq!(g.dims(&qc), (s.n, s.q_heads * s.d), "{case}: q shape");
    assert_bitwise(&format!("{case} q"), &qf, &g.download(&qc).unwrap());
    assert_bitwise(&format!("{case} k pool"), &kf, &g.download(&kpc).unwrap());
    assert_bitwise(&format!("{case} v pool"), &vf, &g.download(&vpc).unwrap());

    // The CPU reference on the same bf16 inputs.
    let cpool = |data: &[f32]| {
        let rounded: Vec<f32> = data.iter().map(|&v| half::bf16::from_f32(v).to_f32()).collect();
        CpuBackend.upload(&rounded, x.pool_rows, cols).unwrap()
    };
    let (mut kcpu, mut vcpu) = (cpool(&x.k_pool), cpool(&x.v_pool));
    let qcpu = CpuBackend
        .qk_norm_rope_write(
            &x.q.cpu,
            &x.k.cpu,
            &x.v.cpu,
            s.norms.then_some((&cqn, &ckn, eps)),
            (&x.cos.cpu, &x.sin.cpu),
            (&mut kcpu, &mut vcpu),
            &x.slots,
        )
        .unwrap();
    for (what, got, want) in [
        ("q", &qf, &qcpu.data),
        ("k pool", &kf, &kcpu.data),
        ("v pool", &vf, &vcpu.data),
    ] {
        let err = rel_err(got, want, BF16_TOL);
        eprintln!("{OP} {case} {what}: bitwise the composition; vs CPU rel err {err:.2e}");
        assert!(
            err <= BF16_TOL,
            "{case} {what}: relative error vs CPU {err} > {BF16_TOL}"
        );
    }
}

/// `n` distinct slots shuffled in a pool of `pool_rows`.
fn shuffled_slots(rng: &mut fastrand::Rng, n: usize, pool_rows: usize) -> Vec<usize> {
    let mut all: Vec<usize> = (0..pool_rows).collect();
    rng.shuffle(&mut all);
    all.truncate(n);
    all
}

fn run_all(norms: bool, seed: u64) {
    let Some(g) = gpu() else { return };
    let mut rng = fastrand::Rng::with_seed(seed);
    for d in [128, 64, 16, 80, 256, 512] {
        for (q_heads, kv_heads) in [(8, 2), (4, 4)] {
            for n in [1, 7, 300] {
                let s = Shape {
                    norms,
                    n,
                    q_heads,
                    kv_heads,
                    d,
                };
                let pool_rows = 2 * n + 13;
                let slots = shuffled_slots(&mut rng, n, pool_rows);
                let x = inputs(&g, &mut rng, s, slots, pool_rows);
                check_case(&g, &x, s);
            }
        }
    }
}

#[test]
fn fused_is_bitwise_the_composition_with_qk_norms() {
    run_all(true, 11);
}

#[test]
fn fused_is_bitwise_the_composition_without_qk_norms() {
    run_all(false, 12);
}

/// Repeated slots are ordered writes (the last wins): the op takes the composition's path.
#[test]
fn repeated_slots_match_the_composition() {
    let Some(g) = gpu() else { return };
    let mut rng = fastrand::Rng::with_seed(13);
    for norms in [true, false] {
        let s = Shape {
            norms,
            n: 6,
            q_heads: 4,
            kv_heads: 2,
            d: 64,
        };
        let x = inputs(&g, &mut rng, s, vec![9, 2, 9, 0, 2, 9], 12);
        check_case(&g, &x, s);
    }
}

#[test]
fn empty_batch_is_a_no_op() {
    let Some(g) = gpu() else { return };
    let mut rng = fastrand::Rng::with_seed(14);
    let s = Shape {
        norms: true,
        n: 0,
        q_heads: 4,
        kv_heads: 2,
        d: 32,
    };
    let x = inputs(&g, &mut rng, s, vec![], 5);
    check_case(&g, &x, s);
}

/// Malformed calls are errors naming the op, raised before anything is written.
#[test]
fn bad_inputs_are_errors_naming_the_op() {
    let Some(g) = gpu() else { return };
    let mut rng = fastrand::Rng::with_seed(15);
    let (n, q_heads, kv_heads, d, pool_rows) = (3, 4, 2, 16, 8);
    let s = Shape {
        norms: true,
        n,
        q_heads,
        kv_heads,
        d,
    };
    let x = inputs(&g, &mut rng, s, vec![1, 5, 7], pool_rows);
    let (qn, kn) = (x.weights.both(&g, "q_norm").0, x.weights.both(&g, "k_norm").0);
    let w17 = Bf16Checkpoint::new(&[("w", rand_vec(&mut rng, d + 1, 0.5, 1.5), vec![d + 1])]);
    let (w17, _) = w17.both(&g, "w");
    let cols = kv_heads * d;
    let odd = pair(&g, &rand_vec(&mut rng, n * 15, -1.0, 1.0), n, 15);
    let q_short = pair(
        &g,
        &rand_vec(&mut rng, 2 * q_heads * d, -1.0, 1.0),
        2,
        q_heads * d,
    );

    let call = |q: &CudaTensor,
                norms: Option<(
        &<CudaBackend as Backend>::Weight,
        &<CudaBackend as Backend>::Weight,
        f32,
    )>,
                tables: (&CudaTensor, &CudaTensor),
                slots: &[usize]|
     -> String {
        let mut kp = g.upload(&x.k_pool, pool_rows, cols).unwrap();
        let mut vp = g.upload(&x.v_pool, pool_rows, cols).unwrap();
        let before = (g.download(&kp).unwrap(), g.download(&vp).unwrap());
        let err = g
            .qk_norm_rope_write(q, &x.k.gpu, &x.v.gpu, norms, tables, (&mut kp, &mut vp), slots)
            .map(|_| ())
            .expect_err("malformed call accepted");
        let after = (g.download(&kp).unwrap(), g.download(&vp).unwrap());
        assert_eq!(before, after, "pools written by a rejected call ({err})");
        err.to_string()
    };
    let tables = (&x.cos.gpu, &x.sin.gpu);
    let cases: Vec<(&str, String)> = vec![
        (
            "slot out of range",
            call(&x.q.gpu, None, tables, &[1, 5, pool_rows]),
        ),
        (
            "slot out of range (norms)",
            call(&x.q.gpu, Some((&qn, &kn, 1e-6)), tables, &[pool_rows + 3, 0, 1]),
        ),
        ("too few slots", call(&x.q.gpu, None, tables, &[1, 5])),
        ("q rows", call(&q_short.gpu, None, tables, &[1, 5, 7])),
        (
            "odd head_dim",
            call(&x.q.gpu, None, (&odd.gpu, &odd.gpu), &[1, 5, 7]),
        ),
        (
            "norm weight length",
            call(&x.q.gpu, Some((&qn, &w17, 1e-6)), tables, &[1, 5, 7]),
        ),
    ];
    for (what, msg) in cases {
        eprintln!("{what}: {msg}");
        assert!(msg.contains(OP), "{what}: error does not name {OP}: {msg}");
    }
}
