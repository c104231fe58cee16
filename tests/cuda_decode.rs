//! Decode attention v2 (`CudaBackend::paged_decode_v2`, kernels/decode_attention.cu) against the CPU
//! reference and against itself:
//!
//! - parity: random q/K/V ~ N(0, 1) (rounded to bf16, the values both backends see), one decode row per
//!   sequence with contexts of 1, 17, 255, 256, 257, 4100 and 20000 tokens in one batch, shuffled block
//!   tables (one block longer than needed), block sizes 16/32/64, GQA 1:1 to 16:1, head_dim 128 and 64;
//!   per row ‖GPU − CPU‖₂ / ‖CPU‖₂ ≤ 1e-2 (`common::ATTN_ROW_TOL`; relative, because a row averaged
//!   over 20k keys is ~100x smaller than over a few, and an absolute bound cannot see a dropped split
//!   there — the test checks on the CPU that the bound does see one). Pool slots outside every context
//!   hold NaN, so a kernel that reads past a context fails; outputs are poisoned with NaN before the
//!   kernels write them.
//! - q = 0: every score equal, so each row is the plain mean of its context's values (closed form, in
//!   f64), at every context length above;
//! - row independence, bitwise: each row computed alone, and the batch in reverse order, give exactly the
//!   batch's bits (the split count is the row's own; the grid only covers the largest);
//! - a recorded and a replayed CUDA graph step (grid fixed at the maximum split count) give the direct
//!   call's bits, also with a new q and one more key per row every step (as decoding does);
//! - `Ok(None)` for calls v2 does not cover (prefill rows, head dims, groups over 16, block sizes that
//!   are not multiples of 16), errors for malformed calls.
//!
//! Every test prints a SKIP line and returns when no GPU, driver, NVRTC or CUDA headers are present.
#![cfg(feature = "cuda")]

mod common;

use common::{row_rel_errors, uniform_attention, ATTN_ROW_TOL};
use recall::backend::cpu::{CpuBackend, CpuTensor};
use recall::backend::cuda::{CudaBackend, CudaTensor};
use recall::backend::{AttnShape, Backend, PagedSeq, StepKey};

/// Context lengths of the decode rows of every batch: below, at and past the tile (16), split (128)
/// and block sizes, and long contexts that hit the split cap (64).
const CONTEXTS: [usize; 7] = [1, 17, 255, 256, 257, 4100, 20000];

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

fn shape(q_heads: usize, kv_heads: usize, head_dim: usize, block_size: usize) -> AttnShape {
    AttnShape {
        q_heads,
        kv_heads,
        head_dim,
        block_size,
    }
}

/// Standard normal samples (Box–Muller).
fn normal(rng: &mut fastrand::Rng, n: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(n + 1);
    while out.len() < n {
        let u1 = rng.f64().max(1e-300);
        let u2 = rng.f64();
        let r = (-2.0 * u1.ln()).sqrt();
        let a = 2.0 * std::f64::consts::PI * u2;
        out.push((r * a.cos()) as f32);
        out.push((r * a.sin()) as f32);
    }
    out.truncate(n);
    out
}

/// One decode row per table, row i attending the first `contexts[i]` keys of `tables[i]`.
fn decode_rows<'a>(tables: &'a [Vec<u32>], contexts: &[usize]) -> Vec<PagedSeq<'a>> {
    tables
        .iter()
        .zip(contexts)
        .map(|(t, &context_len)| PagedSeq {
            rows: 1,
            context_len,
            block_table: t,
        })
        .collect()
}

/// A decode batch (one new row per sequence) over a shuffled pool, on both backends.
struct Case {
    shape: AttnShape,
    contexts: Vec<usize>,
    tables: Vec<Vec<u32>>,
    q: (CudaTensor, CpuTensor),
    k: (CudaTensor, CpuTensor),
    v: (CudaTensor, CpuTensor),
}

impl Case {
    fn new(g: &CudaBackend, rng: &mut fastrand::Rng, shape: AttnShape, contexts: &[usize]) -> Self {
        let bs = shape.block_size;
        // One spare block per table (tables may be longer than the context) and a few unused ones.
        let blocks_per: Vec<usize> = contexts.iter().map(|c| c.div_ceil(bs) + 1).collect();
        let num_blocks = blocks_per.iter().sum::<usize>() + 3;
        let mut ids: Vec<u32> = (0..num_blocks as u32).collect();
        rng.shuffle(&mut ids);
        let mut tables = Vec::new();
        let mut next = 0;
        for &b in &blocks_per {
            tables.push(ids[next..next + b].to_vec());
            next += b;
        }
        let slots = num_blocks * bs;
        let kvd = shape.kv_heads * shape.head_dim;
        // Slots holding some context's keys get data, all others NaN.
        let mut used = vec![false; slots];
        for (t, &c) in tables.iter().zip(contexts) {
            for i in 0..c {
                used[t[i / bs] as usize * bs + i % bs] = true;
            }
        }
        let pool = |rng: &mut fastrand::Rng| {
            let mut x = normal(rng, slots * kvd);
            for (s, row) in x.chunks_mut(kvd).enumerate() {
                if !used[s] {
                    row.fill(f32::NAN);
                }
            }
            both(g, &x, slots, kvd)
        };
        let (k, v) = (pool(rng), pool(rng));
        let rows = contexts.len();
        let q = both(
            g,
            &normal(rng, rows * shape.q_heads * shape.head_dim),
            rows,
            shape.q_heads * shape.head_dim,
        );
        Case {
            shape,
            contexts: contexts.to_vec(),
            tables,
            q,
            k,
            v,
        }
    }

    /// The batch's sequences, in `order`.
    fn seqs(&self, order: &[usize]) -> Vec<PagedSeq<'_>> {
        order
            .iter()
            .map(|&i| PagedSeq {
                rows: 1,
                context_len: self.contexts[i],
                block_table: &self.tables[i],
            })
            .collect()
    }

    fn all(&self) -> Vec<usize> {
        (0..self.contexts.len()).collect()
    }

    /// v2 on the rows `order` (q rows gathered in that order); downloaded.
    fn v2(&self, g: &CudaBackend, order: &[usize]) -> Vec<f32> {
        let q = g.gather_rows(&self.q.0, order).unwrap();
        let out = g
            .paged_decode_v2(&q, &self.k.0, &self.v.0, self.shape, &self.seqs(order))
            .unwrap()
            .unwrap_or_else(|| panic!("v2 does not cover {:?}", self.shape));
        g.download(&out).unwrap()
    }

    fn cpu(&self) -> Vec<f32> {
        self.cpu_on(&self.contexts)
    }

    /// The CPU reference with each row attending only its first `contexts[i]` keys.
    fn cpu_on(&self, contexts: &[usize]) -> Vec<f32> {
        let seqs = decode_rows(&self.tables, contexts);
        CpuBackend
            .paged_attention(&self.q.1, &self.k.1, &self.v.1, self.shape, &seqs)
            .unwrap()
            .data
    }
}

/// The same data on both backends: uploaded to the GPU (bf16), and the rounded values to the CPU.
fn both(g: &CudaBackend, data: &[f32], rows: usize, cols: usize) -> (CudaTensor, CpuTensor) {
    let gpu = g.upload(data, rows, cols).unwrap();
    let rounded = g.download(&gpu).unwrap();
    let cpu = CpuBackend.upload(&rounded, rows, cols).unwrap();
    (gpu, cpu)
}

fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

#[test]
fn decode_v2_matches_cpu() {
    let Some(g) = gpu() else { return };
    let mut rng = fastrand::Rng::with_seed(11);
    let shapes = [
        shape(32, 8, 128, 16), // Qwen3-VL-8B, GQA 4:1
        shape(32, 8, 128, 64),
        shape(16, 2, 128, 16), // 8:1
        shape(8, 8, 128, 32),  // 1:1
        shape(28, 4, 128, 16), // 7:1 (Qwen2.5-VL-7B)
        shape(16, 1, 128, 16), // 16:1 (m16 variant)
        shape(16, 4, 64, 16),  // d 64, 4:1
        shape(16, 2, 64, 64),  // d 64, 8:1
        shape(4, 4, 64, 16),   // d 64, 1:1
        shape(24, 2, 64, 64),  // d 64, 12:1 (m16 variant)
    ];
    for s in shapes {
        let case = Case::new(&g, &mut rng, s, &CONTEXTS);
        let got = case.v2(&g, &case.all());
        let errs = row_rel_errors(&got, &case.cpu(), s.q_heads * s.head_dim);
        eprintln!(
            "paged_decode_v2 {s:?}: relative error per context {:?}",
            CONTEXTS.iter().zip(&errs).collect::<Vec<_>>()
        );
        for (c, e) in CONTEXTS.iter().zip(&errs) {
            assert!(
                *e <= ATTN_ROW_TOL,
                "{s:?}, context {c}: relative error {e} > {ATTN_ROW_TOL}"
            );
        }
    }
}

/// The bound of `decode_v2_matches_cpu` can see a lost split: dropping the last 1/64 of the keys of
/// the long contexts (what a split the combine step skipped would do) moves the CPU answer by far
/// more than the bound. CPU only (runs in CI).
#[test]
fn the_relative_bound_sees_a_dropped_split() {
    let s = shape(32, 8, 128, 16);
    let long = [4100, 20000];
    let case = CpuCase::new(14, s, &long);
    let dropped: Vec<usize> = long.iter().map(|c| c - c / 64).collect();
    let errs = row_rel_errors(
        &case.attend(&dropped),
        &case.attend(&long),
        s.q_heads * s.head_dim,
    );
    eprintln!("one split of 64 dropped: relative error {errs:?}");
    for (c, e) in long.iter().zip(&errs) {
        assert!(
            *e > 3.0 * ATTN_ROW_TOL,
            "context {c}: a dropped split moves the answer by only {e}"
        );
    }
}

#[test]
fn decode_v2_with_zero_queries_is_the_mean_of_the_values() {
    let Some(g) = gpu() else { return };
    let mut rng = fastrand::Rng::with_seed(15);
    for s in [shape(32, 8, 128, 16), shape(16, 2, 64, 64)] {
        let mut case = Case::new(&g, &mut rng, s, &CONTEXTS);
        let cols = s.q_heads * s.head_dim;
        case.q = both(&g, &vec![0.0; CONTEXTS.len() * cols], CONTEXTS.len(), cols);
        let got = case.v2(&g, &case.all());
        let rows: Vec<(&[u32], usize)> = case.tables.iter().map(|t| &t[..]).zip(CONTEXTS).collect();
        let want = uniform_attention(&case.v.1.data, s, &rows);
        let errs = row_rel_errors(&got, &want, cols);
        eprintln!("paged_decode_v2 {s:?}, q = 0: relative error per context {errs:?}");
        for (c, e) in CONTEXTS.iter().zip(&errs) {
            assert!(
                *e <= ATTN_ROW_TOL,
                "{s:?}, q = 0, context {c}: relative error {e}"
            );
        }
        let cpu = row_rel_errors(&case.cpu(), &want, cols);
        assert!(
            cpu.iter().all(|e| *e <= 1e-4),
            "the CPU reference is off the closed form: {cpu:?}"
        );
    }
}

/// A decode batch on the CPU alone: one row per context over shuffled tables, N(0, 1) data.
struct CpuCase {
    shape: AttnShape,
    tables: Vec<Vec<u32>>,
    q: CpuTensor,
    k: CpuTensor,
    v: CpuTensor,
}

impl CpuCase {
    fn new(seed: u64, s: AttnShape, contexts: &[usize]) -> Self {
        let mut rng = fastrand::Rng::with_seed(seed);
        let per: Vec<usize> = contexts.iter().map(|c| c.div_ceil(s.block_size)).collect();
        let (tables, blocks) = common::shuffled_tables(&mut rng, &per, 2);
        let (slots, kvd, cols) = (
            blocks * s.block_size,
            s.kv_heads * s.head_dim,
            s.q_heads * s.head_dim,
        );
        let mut up = |rows: usize, cols: usize| {
            CpuBackend
                .upload(&normal(&mut rng, rows * cols), rows, cols)
                .unwrap()
        };
        let (q, k, v) = (up(contexts.len(), cols), up(slots, kvd), up(slots, kvd));
        CpuCase {
            shape: s,
            tables,
            q,
            k,
            v,
        }
    }

    /// The CPU reference with row i attending its first `contexts[i]` keys.
    fn attend(&self, contexts: &[usize]) -> Vec<f32> {
        let seqs = decode_rows(&self.tables, contexts);
        CpuBackend
            .paged_attention(&self.q, &self.k, &self.v, self.shape, &seqs)
            .unwrap()
            .data
    }
}

/// The closed form the q = 0 test uses, checked against the CPU reference without a GPU (so it runs
/// in CI).
#[test]
fn cpu_attention_with_zero_queries_is_the_mean_of_the_values() {
    let s = shape(8, 2, 64, 16);
    let contexts = [1, 17, 300, 4100];
    let mut case = CpuCase::new(16, s, &contexts);
    let cols = s.q_heads * s.head_dim;
    case.q = CpuBackend
        .upload(&vec![0.0; contexts.len() * cols], contexts.len(), cols)
        .unwrap();
    let rows: Vec<(&[u32], usize)> = case.tables.iter().map(|t| &t[..]).zip(contexts).collect();
    let want = uniform_attention(&case.v.data, s, &rows);
    let errs = row_rel_errors(&case.attend(&contexts), &want, cols);
    assert!(errs.iter().all(|e| *e <= 1e-5), "{errs:?}");
}

#[test]
fn decode_v2_rows_are_independent_bitwise() {
    let Some(g) = gpu() else { return };
    let mut rng = fastrand::Rng::with_seed(12);
    for s in [shape(32, 8, 128, 16), shape(16, 2, 64, 64), shape(16, 1, 128, 32)] {
        let case = Case::new(&g, &mut rng, s, &CONTEXTS);
        let cols = s.q_heads * s.head_dim;
        let batch = case.v2(&g, &case.all());
        for i in 0..CONTEXTS.len() {
            let alone = case.v2(&g, &[i]);
            assert!(
                same_bits(&alone, &batch[i * cols..(i + 1) * cols]),
                "{s:?}: the row of context {} differs alone and in the batch",
                CONTEXTS[i]
            );
        }
        let rev: Vec<usize> = (0..CONTEXTS.len()).rev().collect();
        let reversed = case.v2(&g, &rev);
        for (j, &i) in rev.iter().enumerate() {
            assert!(
                same_bits(
                    &reversed[j * cols..(j + 1) * cols],
                    &batch[i * cols..(i + 1) * cols]
                ),
                "{s:?}: the row of context {} differs with the batch reversed",
                CONTEXTS[i]
            );
        }
    }
}

#[test]
fn decode_v2_in_recorded_steps_is_bitwise_direct() {
    let Some(g) = gpu() else { return };
    let mut rng = fastrand::Rng::with_seed(13);
    let s = shape(32, 8, 128, 16);
    let case = Case::new(&g, &mut rng, s, &[3, 300, 5000]);
    let order = case.all();
    let direct = case.v2(&g, &order);
    g.set_step_replay(true);
    let key = StepKey {
        rows: 3,
        tag: 0xdec0de,
    };
    let q = g.gather_rows(&case.q.0, &order).unwrap();
    // Step 0 runs directly (warm-up), step 1 is recorded, steps 2 and 3 are replayed.
    let before = g.step_stats();
    for step in 0..4 {
        let out = g
            .run_step(key, &mut || {
                g.paged_decode_v2(&q, &case.k.0, &case.v.0, s, &case.seqs(&order))
                    .map(|o| o.expect("v2 covers the shape"))
            })
            .unwrap();
        let got = g.download(&out).unwrap();
        assert!(
            same_bits(&got, &direct),
            "step {step} differs from the direct call"
        );
    }
    let stats = g.step_stats();
    eprintln!("step stats: {stats:?}");
    g.set_step_replay(false);
    assert!(stats.recorded > before.recorded, "no step was recorded");
    assert!(stats.replayed > before.replayed, "no step was replayed");
}

/// Replay with changing inputs, as in decoding: every step a new q and one more key per row, from
/// just below the tile (16), block (64), split chunk (128) and a block-table boundary, for 40 steps.
/// Each replayed step is bitwise the direct call on the same inputs, and steps were replayed (the grid
/// is fixed inside a step; contexts and tables are staged data, not launch parameters).
#[test]
fn decode_v2_replays_growing_contexts_bitwise() {
    let Some(g) = gpu() else { return };
    let mut rng = fastrand::Rng::with_seed(17);
    let steps = 40;
    for s in [shape(32, 8, 128, 64), shape(16, 2, 64, 16)] {
        let start = [14, 60, 126, 1000];
        let end: Vec<usize> = start.iter().map(|c| c + steps).collect();
        // The pools hold data for the longest contexts; each step sees a prefix of them.
        let case = Case::new(&g, &mut rng, s, &end);
        let cols = s.q_heads * s.head_dim;
        let key = StepKey {
            rows: start.len(),
            tag: 0x96_0e + s.head_dim as u64,
        };
        g.set_step_replay(true);
        let before = g.step_stats();
        for step in 0..steps {
            let contexts: Vec<usize> = start.iter().map(|c| c + step + 1).collect();
            let seqs = decode_rows(&case.tables, &contexts);
            let q = g
                .upload(&normal(&mut rng, start.len() * cols), start.len(), cols)
                .unwrap();
            let direct = g
                .paged_decode_v2(&q, &case.k.0, &case.v.0, s, &seqs)
                .unwrap()
                .expect("v2 covers the shape");
            let direct = g.download(&direct).unwrap();
            let out = g
                .run_step(key, &mut || {
                    g.paged_decode_v2(&q, &case.k.0, &case.v.0, s, &seqs)
                        .map(|o| o.expect("v2 covers the shape"))
                })
                .unwrap();
            let got = g.download(&out).unwrap();
            assert!(
                same_bits(&got, &direct),
                "{s:?}: step {step} (contexts {contexts:?}) differs from direct"
            );
        }
        let stats = g.step_stats();
        g.set_step_replay(false);
        eprintln!("{s:?}: step stats {stats:?}");
        assert!(
            stats.replayed - before.replayed >= steps - 2,
            "{s:?}: only {} of {steps} steps replayed",
            stats.replayed - before.replayed
        );
    }
}

#[test]
fn decode_v2_declines_or_rejects_what_it_does_not_cover() {
    let Some(g) = gpu() else { return };
    let table: Vec<u32> = (0..8).collect();
    let call = |s: AttnShape, seqs: &[PagedSeq<'_>]| {
        let rows: usize = seqs.iter().map(|x| x.rows).sum();
        let q = g.zeros(rows, s.q_heads * s.head_dim).unwrap();
        let kv = g.zeros(8 * s.block_size, s.kv_heads * s.head_dim).unwrap();
        g.paged_decode_v2(&q, &kv, &kv, s, seqs).map(|o| o.is_some())
    };
    let one = |ctx: usize| PagedSeq {
        rows: 1,
        context_len: ctx,
        block_table: &table,
    };
    assert!(call(shape(8, 2, 128, 16), &[one(20), one(3)]).unwrap());
    // Prefill or mixed batches, no sequences.
    let prefill = PagedSeq {
        rows: 2,
        context_len: 9,
        block_table: &table,
    };
    assert!(!call(shape(8, 2, 128, 16), &[one(5), prefill]).unwrap());
    assert!(!call(shape(8, 2, 128, 16), &[]).unwrap());
    // Head dims, groups, block sizes.
    for s in [
        shape(8, 2, 72, 16),
        shape(8, 2, 32, 16),
        shape(8, 2, 256, 16),
        shape(32, 1, 128, 16),
    ] {
        assert!(!call(s, &[one(20)]).unwrap(), "{s:?}");
    }
    for bs in [1, 8, 24] {
        assert!(!call(shape(8, 2, 128, bs), &[one(8)]).unwrap(), "block size {bs}");
    }
    // Malformed: q of the wrong width, a context past its table.
    let q = g.zeros(1, 100).unwrap();
    let kv = g.zeros(128, 256).unwrap();
    assert!(g
        .paged_decode_v2(&q, &kv, &kv, shape(8, 2, 128, 16), &[one(5)])
        .is_err());
    let q = g.zeros(1, 1024).unwrap();
    let short = PagedSeq {
        rows: 1,
        context_len: 200,
        block_table: &table,
    };
    assert!(g
        .paged_decode_v2(&q, &kv, &kv, shape(8, 2, 128, 16), &[short])
        .is_err());
}

/// Continuous batching mixes decode rows with prefill chunks of other sequences in one call. The
/// backend splits such a call by sequence kind, so every row gets exactly the bits of a call holding
/// only its own sequence: decode rows those of a pure decode step (split-K), prefill rows those of a
/// prefill call (flash). Checked for both orders of the sequences.
#[test]
fn mixed_calls_give_every_row_its_own_kernels_bits() {
    let Some(g) = gpu() else { return };
    let mut rng = fastrand::Rng::with_seed(21);
    let s = shape(32, 8, 128, 16);
    // Sequence 0: decode at 300 tokens of context; sequence 1: a 40-row prefill chunk after 60 cached
    // tokens; sequence 2: decode at 5 tokens. Disjoint block tables in one pool.
    let specs = [(1usize, 300usize), (40, 100), (1, 5)];
    let mut next = 0u32;
    let tables: Vec<Vec<u32>> = specs
        .iter()
        .map(|&(_, ctx)| {
            let n = ctx.div_ceil(s.block_size) as u32;
            next += n;
            (next - n..next).rev().collect()
        })
        .collect();
    let slots = next as usize * s.block_size;
    let kv_cols = s.kv_heads * s.head_dim;
    let k = g
        .upload(&normal(&mut rng, slots * kv_cols), slots, kv_cols)
        .unwrap();
    let v = g
        .upload(&normal(&mut rng, slots * kv_cols), slots, kv_cols)
        .unwrap();
    let q_cols = s.q_heads * s.head_dim;
    let qs: Vec<CudaTensor> = specs
        .iter()
        .map(|&(rows, _)| g.upload(&normal(&mut rng, rows * q_cols), rows, q_cols).unwrap())
        .collect();
    let seq = |i: usize| PagedSeq {
        rows: specs[i].0,
        context_len: specs[i].1,
        block_table: &tables[i],
    };
    let alone: Vec<Vec<f32>> = (0..specs.len())
        .map(|i| {
            let out = g.paged_attention(&qs[i], &k, &v, s, &[seq(i)]).unwrap();
            g.download(&out).unwrap()
        })
        .collect();
    for order in [[0usize, 1, 2], [1, 2, 0]] {
        let mut data = Vec::new();
        for &i in &order {
            data.extend(g.download(&qs[i]).unwrap());
        }
        let rows: usize = order.iter().map(|&i| specs[i].0).sum();
        let q = g.upload(&data, rows, q_cols).unwrap();
        let seqs: Vec<PagedSeq> = order.iter().map(|&i| seq(i)).collect();
        let got = g
            .download(&g.paged_attention(&q, &k, &v, s, &seqs).unwrap())
            .unwrap();
        let mut at = 0;
        for &i in &order {
            let n = specs[i].0 * q_cols;
            assert!(
                same_bits(&got[at..at + n], &alone[i]),
                "sequence {i} in order {order:?} differs from its call alone"
            );
            at += n;
        }
    }
}
