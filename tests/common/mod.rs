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
