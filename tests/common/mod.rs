//! Helpers shared by the integration tests: fixture paths and reference tensors written by
//! tools/gen_fixtures.py (HF transformers' outputs).
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use safetensors::{Dtype, SafeTensors};

/// `tests/fixtures/<name>`.
pub fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

/// Reference tensors of one fixture model.
pub struct Reference {
    bytes: Vec<u8>,
    pub meta: serde_json::Value,
}

impl Reference {
    /// Reads `<dir>/<stem>.safetensors` and `<dir>/<stem>.json`.
    pub fn load(dir: &Path, stem: &str) -> Self {
        let bytes = std::fs::read(dir.join(format!("{stem}.safetensors"))).expect("reference tensors");
        let meta = std::fs::read_to_string(dir.join(format!("{stem}.json"))).expect("reference json");
        Reference {
            bytes,
            meta: serde_json::from_str(&meta).expect("reference json parses"),
        }
    }

    /// Reads a safetensors file alone (e.g. what `recall logits` wrote).
    pub fn from_file(path: &Path) -> Self {
        Reference {
            bytes: std::fs::read(path).expect("safetensors file"),
            meta: serde_json::Value::Null,
        }
    }

    fn tensors(&self) -> SafeTensors<'_> {
        SafeTensors::deserialize(&self.bytes).expect("reference safetensors parses")
    }

    /// An F32 tensor as `(data, shape)`.
    pub fn f32(&self, name: &str) -> (Vec<f32>, Vec<usize>) {
        let st = self.tensors();
        let t = st
            .tensor(name)
            .unwrap_or_else(|_| panic!("reference tensor {name}"));
        assert_eq!(t.dtype(), Dtype::F32, "{name}");
        let data = t
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect();
        (data, t.shape().to_vec())
    }

    /// An I64 tensor as u32 ids.
    pub fn ids(&self, name: &str) -> Vec<u32> {
        let st = self.tensors();
        let t = st
            .tensor(name)
            .unwrap_or_else(|_| panic!("reference tensor {name}"));
        assert_eq!(t.dtype(), Dtype::I64, "{name}");
        t.data()
            .chunks_exact(8)
            .map(|b| i64::from_le_bytes(b.try_into().unwrap()) as u32)
            .collect()
    }

    /// Whether the reference holds `name`.
    pub fn has(&self, name: &str) -> bool {
        self.tensors().tensor(name).is_ok()
    }

    /// The prompts' metadata.
    pub fn prompts(&self) -> &Vec<serde_json::Value> {
        self.meta["prompts"].as_array().expect("prompts array")
    }
}

/// Largest absolute difference (inputs of equal length).
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "lengths differ");
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

/// HF's pixel values `{prefix}.pixel_values`, split per image by `{prefix}.image_grid_thw`.
pub fn hf_pixels(reference: &Reference, prefix: &str, patch_dim: usize) -> Vec<recall::vision::PixelValues> {
    let (data, shape) = reference.f32(&format!("{prefix}.pixel_values"));
    assert_eq!(shape[1], patch_dim);
    let grids = reference.ids(&format!("{prefix}.image_grid_thw"));
    let mut offset = 0;
    grids
        .chunks(3)
        .map(|g| {
            let grid = [g[0] as usize, g[1] as usize, g[2] as usize];
            let n = grid.iter().product::<usize>() * patch_dim;
            offset += n;
            recall::vision::PixelValues {
                data: data[offset - n..offset].to_vec(),
                grid_thw: grid,
                patch_dim,
                resized: image::RgbImage::new(0, 0),
            }
        })
        .collect()
}

/// Tensors written once as a bf16 safetensors file in a temporary directory, so that every backend
/// loads exactly the same (bf16-rounded) weights.
pub struct Bf16Checkpoint {
    _dir: tempfile::TempDir,
    pub ckpt: recall::model::loader::Checkpoint,
}

impl Bf16Checkpoint {
    /// `(name, values, shape)` per tensor.
    pub fn new(tensors: &[(&str, Vec<f32>, Vec<usize>)]) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("model.safetensors");
        let bytes: Vec<(String, Vec<u8>, Vec<usize>)> = tensors
            .iter()
            .map(|(n, d, s)| {
                let b = d
                    .iter()
                    .flat_map(|&x| half::bf16::from_f32(x).to_le_bytes())
                    .collect();
                (n.to_string(), b, s.clone())
            })
            .collect();
        let views: Vec<(String, safetensors::tensor::TensorView)> = bytes
            .iter()
            .map(|(n, b, s)| {
                let v = safetensors::tensor::TensorView::new(Dtype::BF16, s.clone(), b).unwrap();
                (n.clone(), v)
            })
            .collect();
        std::fs::write(&path, safetensors::serialize(views, &None).unwrap()).unwrap();
        let ckpt = recall::model::loader::Checkpoint::open_file(&path).unwrap();
        Bf16Checkpoint { _dir: dir, ckpt }
    }

    /// Tensor `name` loaded on the GPU and on the CPU.
    #[cfg(feature = "cuda")]
    pub fn both(
        &self,
        g: &recall::backend::cuda::CudaBackend,
        name: &str,
    ) -> (recall::backend::cuda::CudaWeight, recall::backend::cpu::CpuWeight) {
        use recall::backend::Backend;
        let t = self.ckpt.get(name).unwrap();
        (
            g.load_weight(t).unwrap(),
            recall::backend::cpu::CpuBackend.load_weight(t).unwrap(),
        )
    }
}

/// `max |got − want| / max(|want|, rms(want))`; fails on NaN, mismatched infinities or length. Prints
/// the first elements whose error is above `show_above`.
pub fn rel_err(got: &[f32], want: &[f32], show_above: f32) -> f32 {
    assert_eq!(got.len(), want.len(), "output lengths differ");
    let rms = (want.iter().filter(|x| x.is_finite()).map(|x| x * x).sum::<f32>() / want.len().max(1) as f32)
        .sqrt()
        .max(1e-30);
    let mut worst = 0f32;
    let mut shown = 0;
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!(
            !g.is_nan() || w.is_nan(),
            "NaN at {i} (reference {w}): unwritten or broken output"
        );
        if !w.is_finite() {
            assert_eq!(g, w, "infinity mismatch at {i}");
            continue;
        }
        let e = (g - w).abs() / w.abs().max(rms);
        worst = worst.max(e);
        if e > show_above && shown < 10 {
            eprintln!("  mismatch at {i}: got {g}, reference {w}");
            shown += 1;
        }
    }
    worst
}

/// Bound on [`row_rel_errors`] for attention outputs over bf16 inputs (f32 reference). The bf16
/// output alone costs up to 2^-9 per element (~2e-3 in L2); a dropped split of 1/64 of a 20k-token
/// context costs ~0.1 on N(0, 1) inputs (the attention tests check that the bound sees it).
pub const ATTN_ROW_TOL: f32 = 1e-2;

/// Per row of `cols` values: `‖got − want‖₂ / ‖want‖₂` (the norm floored at 1e-30). A relative
/// bound follows the output's scale: averaged over 20k keys an attention row is ~100x smaller than
/// over a few, so an absolute bound tight for short contexts sees nothing at long ones. Fails on NaN
/// in `got` (an unwritten, poisoned output) and on mismatched lengths.
pub fn row_rel_errors(got: &[f32], want: &[f32], cols: usize) -> Vec<f32> {
    assert_eq!(got.len(), want.len(), "output lengths differ");
    got.chunks(cols)
        .zip(want.chunks(cols))
        .enumerate()
        .map(|(r, (g, w))| {
            let (mut diff, mut norm) = (0f64, 0f64);
            for (c, (&a, &b)) in g.iter().zip(w).enumerate() {
                assert!(
                    !a.is_nan(),
                    "row {r} col {c}: NaN (reference {b}): unwritten or broken output"
                );
                diff += ((a - b) as f64).powi(2);
                norm += (b as f64).powi(2);
            }
            (diff.sqrt() / norm.sqrt().max(1e-30)) as f32
        })
        .collect()
}

/// The closed-form attention output for q = 0 (all scores equal, softmax uniform): for each query
/// head, the mean over the row's visible keys of its KV head's values, in f64. `v` is the value pool
/// `[slots, kv_heads * d]`; `rows[i] = (block table, visible keys)` for output row i.
pub fn uniform_attention(v: &[f32], shape: recall::backend::AttnShape, rows: &[(&[u32], usize)]) -> Vec<f32> {
    let (d, kvd, bs) = (shape.head_dim, shape.kv_heads * shape.head_dim, shape.block_size);
    let group = shape.q_heads / shape.kv_heads;
    let mut out = Vec::with_capacity(rows.len() * shape.q_heads * d);
    for &(table, keys) in rows {
        let mut sum = vec![0f64; kvd];
        for i in 0..keys {
            let slot = table[i / bs] as usize * bs + i % bs;
            for (s, &x) in sum.iter_mut().zip(&v[slot * kvd..(slot + 1) * kvd]) {
                *s += x as f64;
            }
        }
        for h in 0..shape.q_heads {
            let kv = h / group;
            out.extend(sum[kv * d..(kv + 1) * d].iter().map(|s| (s / keys as f64) as f32));
        }
    }
    out
}

/// Logits of every position of `input`, run alone through the text model (a fresh cache).
pub fn prompt_logits<B: recall::backend::Backend>(
    p: &recall::engine::Pipeline<B>,
    input: &recall::engine::PromptInput<B::Tensor>,
) -> Vec<f32> {
    let be = &p.backend;
    let mut cache = p.model.text.new_cache(be, input.ids.len()).unwrap();
    let lora = input.lora_rows();
    let out = p
        .model
        .text
        .forward(
            be,
            &input.ids,
            &input.positions,
            input.visual.as_ref(),
            &lora,
            &mut cache,
            recall::model::LogitsFor::All,
            false,
        )
        .unwrap();
    be.download(&out.logits).unwrap()
}

/// Block tables for sequences needing `blocks[i]` blocks each, drawn without repetition from a
/// shuffled pool with `spare` unused blocks: `(tables, blocks in the pool)`.
pub fn shuffled_tables(rng: &mut fastrand::Rng, blocks: &[usize], spare: usize) -> (Vec<Vec<u32>>, usize) {
    let num_blocks = blocks.iter().sum::<usize>() + spare;
    let mut ids: Vec<u32> = (0..num_blocks as u32).collect();
    rng.shuffle(&mut ids);
    let mut tables = Vec::new();
    let mut next = 0;
    for &n in blocks {
        tables.push(ids[next..next + n].to_vec());
        next += n;
    }
    (tables, num_blocks)
}

/// Runs `pytest` on `script` (relative to the crate root) with the Python named by the environment
/// variable `python_var`, handing it this build's `recall` binary as RECALL_BIN. Without the variable
/// it prints SKIP, except under CI=true, where `.ci/run` must have set it (it installs `needs`).
pub fn run_pytest(python_var: &str, script: &str, recall_bin: &str, needs: &str) {
    let Some(python) = std::env::var_os(python_var) else {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "CI must set {python_var} to a Python with {needs} (see .ci/run)"
        );
        eprintln!("SKIP: set {python_var} to a Python with {needs} installed");
        return;
    };
    let out = std::process::Command::new(python)
        .args(["-m", "pytest", "-q", "-p", "no:cacheprovider", script])
        .env("RECALL_BIN", recall_bin)
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("python runs");
    assert!(
        out.status.success(),
        "pytest {script} failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The tiny bf16 model (`tiny-qwen3-vl-bf16`) run on every reference prompt with whatever
/// process-wide bf16 switches the caller set, each prompt's logits within `bound` of HF
/// transformers' float32 ones (tools/gen_fixtures.py); `what` names the mode in the failure.
pub fn assert_tiny_bf16_model_near_hf(bound: f32, what: &str) {
    use recall::engine::Pipeline;
    let dir = fixture("tiny-qwen3-vl-bf16");
    let tokenizer = fixture("tiny-tokenizer/tokenizer.json");
    let p = Pipeline::load(recall::backend::cpu::CpuBackend, &dir, Some(&tokenizer)).unwrap();
    let reference = Reference::load(&dir, "reference");
    for (i, prompt) in reference.prompts().iter().enumerate() {
        let messages =
            recall::tokenize::chat::parse_messages(&prompt["messages"].to_string(), Path::new("fixture"))
                .unwrap();
        let got = p.prompt_logits(&messages).unwrap();
        let (want, _) = reference.f32(&format!("p{i}.logits"));
        let err = max_abs_diff(&got.logits, &want);
        let spread = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        eprintln!("prompt {i}: logits max abs error {err} (largest |logit| {spread})");
        assert!(err <= bound, "prompt {i}: logits max abs error {err} with {what}");
    }
}
