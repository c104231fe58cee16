//! Parity of the tensor-core attention kernel (`kernels/flash_attention.cu`,
//! `CudaBackend::paged_attention_flash` / `attention_segments_flash`) against the CPU reference and the
//! v1 CUDA kernels (`kernels/attention.cu`, called explicitly through `CudaBackend::paged_attention_v1`
//! / `attention_segments_v1`, each also checked against the CPU), on random ~N(0, 1) inputs: paged prefill over shuffled block tables (several
//! sequences, rows not a multiple of 64, sequences continuing after cached context, GQA 4:1 and 1:1,
//! block sizes 16 and 32, head dims 128/80/72/64/32/16) and the segments mode of the vision towers
//! (d 72/80/64/...), and Qwen3-VL-8B's text heads on a 700-row continuation of a 2,500-token context.
//! Bound: per output row ‖flash − reference‖₂ / ‖reference‖₂ ≤ 1e-2 (`common::ATTN_ROW_TOL`: bf16
//! inputs and output, f32 reference; relative, so long contexts, whose rows are small, are held to the
//! same standard as short ones). With q = 0 every row is the plain mean of the values it sees (closed
//! form, in f64): checked on the long case.
//!
//! Also the row contract, bitwise: a sequence's rows computed in one call equal the same rows computed
//! in two chunked calls (prefix, then the rest, as chunked prefill does), one row per call, or next to
//! other sequences; a segment's rows do not depend on the other segments.
//!
//! And the cp.async-pipelined kernels (`flash_attention_d*`) against the kernel they replaced, kept as
//! `flash_attention_v1_d*` (`*_flash_v1`): bitwise equal outputs on every shape above, on every padded
//! head dim 16..128, and on long Qwen3-VL-sized calls; `flash_perf_vs_v1` (ignored, run with
//! `-- --ignored --nocapture` on a device) times both on the perf targets.
//!
//! The CPU reference runs on exactly the values the GPU sees (inputs rounded to bf16). Outputs are
//! poisoned with NaN before the kernel writes them. Every GPU test prints a SKIP line and returns when
//! no GPU, driver, NVRTC or CUDA headers are present; `flash_v1_reference_compiles_for_sm_90` needs
//! only NVRTC (and fails without it under `CI=true`, like tests/kernel_compile.rs).
#![cfg(feature = "cuda")]

mod common;

use common::{row_rel_errors, shuffled_tables, uniform_attention, ATTN_ROW_TOL as TOL};
use recall::backend::cpu::{CpuBackend, CpuTensor};
use recall::backend::cuda::{kernels, libs, CudaBackend, CudaTensor, KernelSource};
use recall::backend::{AttnShape, Backend, PagedSeq};

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

/// ~N(0, 1) values (Box–Muller).
fn randn(rng: &mut fastrand::Rng, n: usize) -> Vec<f32> {
    (0..n)
        .map(|_| {
            let u = rng.f32().max(1e-7);
            (-2.0 * u.ln()).sqrt() * (std::f32::consts::TAU * rng.f32()).cos()
        })
        .collect()
}

/// The same activation on both backends (the CPU one holding the bf16-rounded values).
struct Pair {
    gpu: CudaTensor,
    cpu: CpuTensor,
}

fn rand_pair(g: &CudaBackend, rng: &mut fastrand::Rng, rows: usize, cols: usize) -> Pair {
    let gpu = g.upload(&randn(rng, rows * cols), rows, cols).unwrap();
    let rounded = g.download(&gpu).unwrap();
    Pair {
        cpu: CpuBackend.upload(&rounded, rows, cols).unwrap(),
        gpu,
    }
}

/// The worst row's relative error (`common::row_rel_errors`); fails on NaN or a length mismatch.
fn worst_row(got: &[f32], want: &[f32], cols: usize) -> f32 {
    row_rel_errors(got, want, cols).into_iter().fold(0f32, f32::max)
}

fn bits(g: &CudaBackend, x: &CudaTensor) -> Vec<u32> {
    g.download(x).unwrap().iter().map(|v| v.to_bits()).collect()
}

fn shape(q_heads: usize, kv_heads: usize, head_dim: usize, block_size: usize) -> AttnShape {
    AttnShape {
        q_heads,
        kv_heads,
        head_dim,
        block_size,
    }
}

/// A random batch over a shuffled block pool: `(rows, context_len)` per sequence.
struct PagedCase {
    shape: AttnShape,
    seqs: Vec<(usize, usize)>,
    tables: Vec<Vec<u32>>,
    q: Pair,
    k: Pair,
    v: Pair,
}

impl PagedCase {
    fn new(g: &CudaBackend, rng: &mut fastrand::Rng, shape: AttnShape, seqs: &[(usize, usize)]) -> Self {
        let per_seq: Vec<usize> = seqs.iter().map(|&(_, c)| c.div_ceil(shape.block_size)).collect();
        let (tables, num_blocks) = shuffled_tables(rng, &per_seq, 3);
        let slots = num_blocks * shape.block_size;
        let kvd = shape.kv_heads * shape.head_dim;
        let rows: usize = seqs.iter().map(|s| s.0).sum();
        PagedCase {
            shape,
            seqs: seqs.to_vec(),
            tables,
            q: rand_pair(g, rng, rows, shape.q_heads * shape.head_dim),
            k: rand_pair(g, rng, slots, kvd),
            v: rand_pair(g, rng, slots, kvd),
        }
    }

    fn batch(&self) -> Vec<PagedSeq<'_>> {
        self.seqs
            .iter()
            .zip(&self.tables)
            .map(|(&(rows, context_len), t)| PagedSeq {
                rows,
                context_len,
                block_table: t,
            })
            .collect()
    }

    /// Flash attention for `q` rows of sequences `seqs` (over this case's pools).
    fn flash(&self, g: &CudaBackend, q: &CudaTensor, seqs: &[PagedSeq<'_>]) -> CudaTensor {
        g.paged_attention_flash(q, &self.k.gpu, &self.v.gpu, self.shape, seqs)
            .unwrap()
            .expect("supported shape")
    }

    fn name(&self) -> String {
        let s = self.shape;
        let case = format!(
            "{}q/{}kv × {} bs {} {:?}",
            s.q_heads, s.kv_heads, s.head_dim, s.block_size, self.seqs
        );
        case.chars().take(70).collect()
    }
}

const PAGED_SHAPES: [(usize, usize, usize, usize); 7] = [
    (8, 2, 128, 16),
    (4, 4, 128, 32),
    (4, 1, 64, 16),
    (4, 4, 80, 32),
    (8, 2, 72, 16),
    (4, 1, 32, 32),
    (2, 2, 16, 16),
];

#[test]
fn paged_flash_matches_cpu_and_v1() {
    let Some(g) = gpu() else { return };
    let mut rng = fastrand::Rng::with_seed(11);
    // Fresh prompt, several lengths (not multiples of 64), continuation after cached context next to a
    // decode row, a single token, a long continuation.
    let batches: [&[(usize, usize)]; 5] = [
        &[(100, 100)],
        &[(37, 37), (64, 64), (130, 130)],
        &[(50, 200), (1, 77), (65, 65)],
        &[(1, 1)],
        &[(200, 330)],
    ];
    for (qh, kvh, d, bs) in PAGED_SHAPES {
        for seqs in batches {
            let c = PagedCase::new(&g, &mut rng, shape(qh, kvh, d, bs), seqs);
            let batch = c.batch();
            let got = g.download(&c.flash(&g, &c.q.gpu, &batch)).unwrap();
            let cpu = CpuBackend
                .paged_attention(&c.q.cpu, &c.k.cpu, &c.v.cpu, c.shape, &batch)
                .unwrap();
            // The v1 kernel of attention.cu, called explicitly: the trait op would dispatch these
            // shapes to flash and compare flash with itself.
            let v1 = g
                .paged_attention_v1(&c.q.gpu, &c.k.gpu, &c.v.gpu, c.shape, &batch)
                .unwrap();
            let v1 = g.download(&v1).unwrap();
            let cols = c.shape.q_heads * c.shape.head_dim;
            let (e_cpu, e_v1, e_v1_cpu) = (
                worst_row(&got, &cpu.data, cols),
                worst_row(&got, &v1, cols),
                worst_row(&v1, &cpu.data, cols),
            );
            eprintln!(
                "paged flash {:<70} worst row rel err {e_cpu:.2e} (cpu) {e_v1:.2e} (v1); v1 vs cpu {e_v1_cpu:.2e}",
                c.name()
            );
            assert!(e_cpu <= TOL, "{}: error {e_cpu} against the CPU", c.name());
            assert!(e_v1 <= TOL, "{}: error {e_v1} against v1", c.name());
            assert!(e_v1_cpu <= TOL, "{}: v1 off the CPU by {e_v1_cpu}", c.name());
        }
    }
}

/// Qwen3-VL-8B's text heads continuing a 2,500-token context with 700 rows (next to a fresh prompt
/// and a short continuation): against the CPU, then with q = 0 against the closed form.
#[test]
fn long_paged_flash_matches_cpu_and_the_closed_form() {
    let Some(g) = gpu() else { return };
    let mut rng = fastrand::Rng::with_seed(17);
    let mut c = PagedCase::new(
        &g,
        &mut rng,
        shape(32, 8, 128, 16),
        &[(700, 2500), (64, 64), (2, 300)],
    );
    let cols = c.shape.q_heads * c.shape.head_dim;
    let got = g.download(&c.flash(&g, &c.q.gpu, &c.batch())).unwrap();
    let cpu = CpuBackend
        .paged_attention(&c.q.cpu, &c.k.cpu, &c.v.cpu, c.shape, &c.batch())
        .unwrap();
    let e = worst_row(&got, &cpu.data, cols);
    eprintln!("paged flash {:<70} worst row rel err {e:.2e} (cpu)", c.name());
    assert!(e <= TOL, "{}: error {e} against the CPU", c.name());

    // q = 0: row j of a sequence with `rows` new rows over `context` keys sees keys 0..=context-rows+j.
    let rows: usize = c.seqs.iter().map(|s| s.0).sum();
    let zeros = g.upload(&vec![0.0; rows * cols], rows, cols).unwrap();
    c.q = Pair {
        cpu: CpuBackend.upload(&vec![0.0; rows * cols], rows, cols).unwrap(),
        gpu: zeros,
    };
    let got = g.download(&c.flash(&g, &c.q.gpu, &c.batch())).unwrap();
    let visible: Vec<(&[u32], usize)> = c
        .seqs
        .iter()
        .zip(&c.tables)
        .flat_map(|(&(n, context), t)| (0..n).map(move |j| (&t[..], context - n + j + 1)))
        .collect();
    let want = uniform_attention(&c.v.cpu.data, c.shape, &visible);
    let e = worst_row(&got, &want, cols);
    eprintln!(
        "paged flash {:<70} q = 0: worst row rel err {e:.2e} (closed form)",
        c.name()
    );
    assert!(e <= TOL, "{}, q = 0: error {e} against the closed form", c.name());
}

#[test]
fn paged_flash_rows_do_not_depend_on_chunking() {
    let Some(g) = gpu() else { return };
    let mut rng = fastrand::Rng::with_seed(12);
    let (history, n) = (150, 200);
    for (qh, kvh, d, bs) in [(8, 2, 128, 16), (4, 4, 80, 32), (4, 1, 72, 16)] {
        let c = PagedCase::new(&g, &mut rng, shape(qh, kvh, d, bs), &[(n, history + n)]);
        let table = &c.tables[0][..];
        let seq = |rows, context_len| PagedSeq {
            rows,
            context_len,
            block_table: table,
        };
        let whole = bits(&g, &c.flash(&g, &c.q.gpu, &[seq(n, history + n)]));
        let cols = c.q.cpu.cols;
        // Prefix then the rest, as chunked prefill does.
        for split in [1, 37, 64, 100, 128, 199] {
            let (qa, qb) = (
                g.rows(&c.q.gpu, 0, split).unwrap(),
                g.rows(&c.q.gpu, split, n - split).unwrap(),
            );
            let mut got = bits(&g, &c.flash(&g, &qa, &[seq(split, history + split)]));
            got.extend(bits(&g, &c.flash(&g, &qb, &[seq(n - split, history + n)])));
            assert!(got == whole, "{}: split at {split} changes the result", c.name());
        }
        // One row per call (decode-style), for every 13th row.
        for r in (0..n).step_by(13) {
            let qr = g.rows(&c.q.gpu, r, 1).unwrap();
            let got = bits(&g, &c.flash(&g, &qr, &[seq(1, history + r + 1)]));
            assert!(
                got[..] == whole[r * cols..(r + 1) * cols],
                "{}: row {r} alone differs",
                c.name()
            );
        }
        eprintln!("paged flash chunking {}: bitwise equal", c.name());
    }
}

#[test]
fn paged_flash_rows_do_not_depend_on_the_batch() {
    let Some(g) = gpu() else { return };
    let mut rng = fastrand::Rng::with_seed(13);
    let c = PagedCase::new(
        &g,
        &mut rng,
        shape(8, 2, 128, 16),
        &[(30, 90), (100, 100), (1, 300)],
    );
    let batch = c.batch();
    let all = bits(&g, &c.flash(&g, &c.q.gpu, &batch));
    let cols = c.q.cpu.cols;
    let mut start = 0;
    for (i, s) in batch.iter().enumerate() {
        let q = g.rows(&c.q.gpu, start, s.rows).unwrap();
        let alone = bits(&g, &c.flash(&g, &q, &[*s]));
        assert!(
            alone[..] == all[start * cols..(start + s.rows) * cols],
            "sequence {i} alone differs from the batch"
        );
        start += s.rows;
    }
    eprintln!("paged flash batch independence {}: bitwise equal", c.name());
}

/// Random q, k, v of `[cu.last(), heads · d]`.
fn segment_inputs(g: &CudaBackend, rng: &mut fastrand::Rng, heads: usize, d: usize, n: usize) -> [Pair; 3] {
    [0; 3].map(|_| rand_pair(g, rng, n, heads * d))
}

#[test]
fn segments_flash_matches_cpu_and_v1() {
    let Some(g) = gpu() else { return };
    let mut rng = fastrand::Rng::with_seed(14);
    for (heads, d) in [(4, 72), (3, 80), (2, 64), (1, 128), (2, 32), (2, 16)] {
        for cu in [
            vec![0usize, 5],
            vec![0, 1, 17, 17, 50],
            vec![0, 64, 128, 200],
            vec![0, 300, 1024],
        ] {
            let n = *cu.last().unwrap();
            let [q, k, v] = segment_inputs(&g, &mut rng, heads, d, n);
            let got = g
                .attention_segments_flash(&q.gpu, &k.gpu, &v.gpu, heads, &cu)
                .unwrap()
                .expect("supported shape");
            let got = g.download(&got).unwrap();
            let cpu = CpuBackend
                .attention_segments(&q.cpu, &k.cpu, &v.cpu, heads, &cu)
                .unwrap();
            let v1 = g
                .attention_segments_v1(&q.gpu, &k.gpu, &v.gpu, heads, &cu)
                .unwrap();
            let v1 = g.download(&v1).unwrap();
            let (e_cpu, e_v1, e_v1_cpu) = (
                worst_row(&got, &cpu.data, heads * d),
                worst_row(&got, &v1, heads * d),
                worst_row(&v1, &cpu.data, heads * d),
            );
            let case = format!("{heads} × {d}, cu {cu:?}");
            eprintln!(
                "segments flash {case:<40} worst row rel err {e_cpu:.2e} (cpu) {e_v1:.2e} (v1); v1 vs cpu {e_v1_cpu:.2e}"
            );
            assert!(e_cpu <= TOL, "{case}: error {e_cpu} against the CPU");
            assert!(e_v1 <= TOL, "{case}: error {e_v1} against v1");
            assert!(e_v1_cpu <= TOL, "{case}: v1 off the CPU by {e_v1_cpu}");
        }
    }
}

#[test]
fn segments_flash_rows_do_not_depend_on_other_segments() {
    let Some(g) = gpu() else { return };
    let mut rng = fastrand::Rng::with_seed(15);
    let (heads, d) = (4, 80);
    let cu = [0usize, 70, 71, 200, 333];
    let [q, k, v] = segment_inputs(&g, &mut rng, heads, d, 333);
    let all = bits(
        &g,
        &g.attention_segments_flash(&q.gpu, &k.gpu, &v.gpu, heads, &cu)
            .unwrap()
            .unwrap(),
    );
    let cols = heads * d;
    for w in cu.windows(2) {
        let n = w[1] - w[0];
        let [qs, ks, vs] = [&q, &k, &v].map(|x| g.rows(&x.gpu, w[0], n).unwrap());
        let alone = g
            .attention_segments_flash(&qs, &ks, &vs, heads, &[0, n])
            .unwrap()
            .unwrap();
        assert!(
            bits(&g, &alone)[..] == all[w[0] * cols..w[1] * cols],
            "segment {w:?} alone differs"
        );
    }
    eprintln!("segments flash independence: bitwise equal");
}

#[test]
fn flash_declines_unsupported_shapes_and_rejects_malformed_calls() {
    let Some(g) = gpu() else { return };
    let table = [0u32, 1, 2, 3];
    let seq = |rows, context_len| PagedSeq {
        rows,
        context_len,
        block_table: &table,
    };
    // Head dims without an instantiation: None, nothing launched.
    for d in [256, 12] {
        let (q, kv) = (g.zeros(1, d).unwrap(), g.zeros(16, d).unwrap());
        let got = g.paged_attention_flash(&q, &kv, &kv, shape(1, 1, d, 4), &[seq(1, 1)]);
        assert!(got.unwrap().is_none(), "head_dim {d}");
        let got = g.attention_segments_flash(&q, &q, &q, 1, &[0, 1]);
        assert!(got.unwrap().is_none(), "segments head_dim {d}");
    }
    // Malformed calls are errors, as on v1.
    let (q, kv) = (g.zeros(3, 64).unwrap(), g.zeros(16, 64).unwrap());
    let s = shape(2, 1, 32, 4);
    assert!(
        g.paged_attention_flash(&q, &kv, &kv, s, &[seq(2, 2)]).is_err(),
        "row count"
    );
    assert!(
        g.paged_attention_flash(&q, &kv, &kv, s, &[seq(3, 17)]).is_err(),
        "table too short"
    );
    assert!(
        g.paged_attention_flash(&q, &kv, &kv, shape(3, 2, 32, 4), &[seq(3, 3)])
            .is_err(),
        "heads"
    );
    assert!(
        g.attention_segments_flash(&q, &q, &q, 2, &[0, 2]).is_err(),
        "cu_seqlens"
    );
    // Nothing to do: an empty output, not an error.
    let empty = g.zeros(0, 64).unwrap();
    let out = g
        .paged_attention_flash(&empty, &kv, &kv, s, &[seq(0, 5)])
        .unwrap()
        .unwrap();
    assert_eq!(g.dims(&out), (0, 64));
}

/// Padded head dims of the kernel instantiations.
const PADDED_DIMS: [usize; 8] = [16, 32, 48, 64, 80, 96, 112, 128];

fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true" || v == "1")
}

#[test]
fn flash_v1_reference_compiles_for_sm_90() {
    if let Err(e) = libs::ensure_nvrtc().and_then(|()| libs::find_cuda_include().map(|_| ())) {
        assert!(!in_ci(), "CI=true but NVRTC or the CUDA headers are missing: {e}");
        eprintln!("SKIP flash_v1_reference_compiles_for_sm_90: {e}");
        return;
    }
    // What flash.rs builds for `*_flash_v1` (FLASH_V1_SOURCE).
    let src = KernelSource {
        name: "flash_attention_v1",
        source: concat!(
            "#define FLASH_ATTENTION_V1 1\n",
            include_str!("../kernels/flash_attention.cu")
        ),
        functions: &[],
    };
    let cubin = kernels::compile(&src, "sm_90").unwrap_or_else(|e| panic!("{e}"));
    let has = |name: &str| {
        cubin
            .windows(name.len() + 1)
            .any(|w| w[..name.len()] == *name.as_bytes() && w[name.len()] == 0)
    };
    for dp in PADDED_DIMS {
        assert!(has(&format!("flash_attention_v1_d{dp}")), "v1 d{dp} missing");
        assert!(
            !has(&format!("flash_attention_d{dp}")),
            "pipelined d{dp} in the reference build"
        );
    }
    eprintln!(
        "kernels/flash_attention.cu (FLASH_ATTENTION_V1) -> sm_90 CUBIN, {} bytes",
        cubin.len()
    );
}

/// Pipelined vs reference kernel on one paged case: bitwise equal.
fn paged_equals_v1(g: &CudaBackend, c: &PagedCase) {
    let batch = c.batch();
    let new = bits(g, &c.flash(g, &c.q.gpu, &batch));
    let v1 = g
        .paged_attention_flash_v1(&c.q.gpu, &c.k.gpu, &c.v.gpu, c.shape, &batch)
        .unwrap()
        .expect("supported shape");
    let v1 = bits(g, &v1);
    let differ = new.iter().zip(&v1).filter(|(a, b)| a != b).count();
    assert!(differ == 0, "{}: {differ} elements differ from v1", c.name());
    eprintln!("paged flash == v1 bitwise {}", c.name());
}

/// Pipelined vs reference kernel on one segments case: bitwise equal.
fn segments_equal_v1(g: &CudaBackend, rng: &mut fastrand::Rng, heads: usize, d: usize, cu: &[usize]) {
    let [q, k, v] = segment_inputs(g, rng, heads, d, *cu.last().unwrap());
    let new = g
        .attention_segments_flash(&q.gpu, &k.gpu, &v.gpu, heads, cu)
        .unwrap()
        .expect("supported");
    let v1 = g
        .attention_segments_flash_v1(&q.gpu, &k.gpu, &v.gpu, heads, cu)
        .unwrap()
        .expect("supported");
    let (new, v1) = (bits(g, &new), bits(g, &v1));
    let differ = new.iter().zip(&v1).filter(|(a, b)| a != b).count();
    let case = format!("{heads} × {d}, cu {cu:?}");
    assert!(differ == 0, "segments {case}: {differ} elements differ from v1");
    eprintln!("segments flash == v1 bitwise {case}");
}

#[test]
fn pipelined_flash_equals_v1_bitwise() {
    let Some(g) = gpu() else { return };
    let mut rng = fastrand::Rng::with_seed(16);
    let batches: [&[(usize, usize)]; 4] = [
        &[(100, 100)],
        &[(37, 37), (64, 64), (130, 130)],
        &[(50, 200), (1, 77), (65, 65)],
        &[(200, 330)],
    ];
    for (qh, kvh, d, bs) in PAGED_SHAPES {
        for seqs in batches {
            paged_equals_v1(&g, &PagedCase::new(&g, &mut rng, shape(qh, kvh, d, bs), seqs));
        }
    }
    // Every instantiation (d = padded dim and d = padded dim − 8), odd block sizes.
    for dp in PADDED_DIMS {
        for (d, bs) in [(dp, 16), (dp - 8, 8)] {
            let c = PagedCase::new(&g, &mut rng, shape(4, 2, d, bs), &[(70, 150), (3, 3)]);
            paged_equals_v1(&g, &c);
            segments_equal_v1(&g, &mut rng, 2, d, &[0, 1, 65, 200]);
        }
    }
    // Qwen3-VL-8B text heads (32 q / 8 kv × 128) continuing after cached context, and vision heads
    // (16 × 72, non-causal segments).
    let c = PagedCase::new(
        &g,
        &mut rng,
        shape(32, 8, 128, 16),
        &[(700, 2500), (64, 64), (2, 300)],
    );
    paged_equals_v1(&g, &c);
    segments_equal_v1(&g, &mut rng, 16, 72, &[0, 1500, 1501, 3000]);
    for (heads, d) in [(4, 72), (3, 80), (2, 64), (1, 128)] {
        segments_equal_v1(&g, &mut rng, heads, d, &[0, 5, 300, 1024]);
    }
}

/// Seconds per call of `kernel` (CUDA events, the backend's profiler), the median of `runs` calls.
fn time_kernel(g: &CudaBackend, kernel: &str, runs: usize, mut f: impl FnMut()) -> f64 {
    f(); // warm-up (and the reference module's first build)
    let mut times = Vec::new();
    for _ in 0..runs {
        g.set_profiling(true);
        f();
        g.synchronize().unwrap();
        let p = g.take_profile().unwrap();
        g.set_profiling(false);
        let t = p
            .iter()
            .find(|t| t.op == kernel)
            .unwrap_or_else(|| panic!("{kernel} not profiled: {p:?}"));
        times.push(t.seconds / t.calls as f64);
    }
    times.sort_by(f64::total_cmp);
    times[runs / 2]
}

/// Times the pipelined and the reference kernels on the perf targets (Qwen3-VL-8B text prefill chunks
/// of a 15k-token prompt in 4096-row chunks; a 10k-row vision segment) and checks they agree bitwise.
/// A device benchmark, not a correctness test: `cargo test --release --test cuda_flash -- --ignored
/// --nocapture`.
#[test]
#[ignore]
fn flash_perf_vs_v1() {
    let Some(g) = gpu() else { return };
    g.set_poison(false);
    let mut rng = fastrand::Rng::with_seed(17);
    let (total, chunk) = (15_000usize, 4096usize);
    let s = shape(32, 8, 128, 16);
    let c = PagedCase::new(&g, &mut rng, s, &[(chunk, total)]);
    let table = &c.tables[0][..];
    for start in (0..total).step_by(chunk) {
        let rows = chunk.min(total - start);
        let seq = [PagedSeq {
            rows,
            context_len: start + rows,
            block_table: table,
        }];
        let q = g.rows(&c.q.gpu, 0, rows).unwrap();
        let mut out = (None, None);
        let new = time_kernel(&g, "flash_attention_d128", 5, || {
            out.0 = Some(c.flash(&g, &q, &seq));
        });
        let v1 = time_kernel(&g, "flash_attention_v1_d128", 5, || {
            out.1 = g
                .paged_attention_flash_v1(&q, &c.k.gpu, &c.v.gpu, s, &seq)
                .unwrap();
        });
        assert!(
            bits(&g, out.0.as_ref().unwrap()) == bits(&g, out.1.as_ref().unwrap()),
            "chunk at {start}"
        );
        // 2 GEMMs x 2 flop per multiply-add x visible keys per row.
        let pairs: f64 = (0..rows).map(|i| (start + i + 1) as f64).sum();
        let flop = 4.0 * pairs * (s.head_dim * s.q_heads) as f64;
        eprintln!(
            "text chunk rows {start}..{}: pipelined {:.3} ms ({:.0} TFLOP/s), v1 {:.3} ms ({:.0} TFLOP/s), speed-up {:.2}x",
            start + rows,
            new * 1e3,
            flop / new / 1e12,
            v1 * 1e3,
            flop / v1 / 1e12,
            v1 / new
        );
    }
    let (heads, d, n) = (16usize, 72usize, 10_240usize);
    let [q, k, v] = segment_inputs(&g, &mut rng, heads, d, n);
    let cu = [0, n];
    let mut out = (None, None);
    let new = time_kernel(&g, "flash_attention_d80", 5, || {
        out.0 = g
            .attention_segments_flash(&q.gpu, &k.gpu, &v.gpu, heads, &cu)
            .unwrap();
    });
    let v1 = time_kernel(&g, "flash_attention_v1_d80", 5, || {
        out.1 = g
            .attention_segments_flash_v1(&q.gpu, &k.gpu, &v.gpu, heads, &cu)
            .unwrap();
    });
    assert!(
        bits(&g, out.0.as_ref().unwrap()) == bits(&g, out.1.as_ref().unwrap()),
        "vision segment"
    );
    let flop = 4.0 * (n * n) as f64 * (heads * d) as f64;
    eprintln!(
        "vision segment {n} rows, {heads} x {d}: pipelined {:.3} ms ({:.0} TFLOP/s), v1 {:.3} ms ({:.0} TFLOP/s), speed-up {:.2}x",
        new * 1e3,
        flop / new / 1e12,
        v1 * 1e3,
        flop / v1 / 1e12,
        v1 / new
    );
}
