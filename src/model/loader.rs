//! Checkpoint loading: safetensors files mapped into memory (never copied at load time), from a single
//! `model.safetensors` or a sharded `model.safetensors.index.json`.
//!
//! The header is parsed here rather than through the `safetensors` crate so that every failure names
//! the file and the tensor, and so that a tensor can outlive the parse (it keeps its file's mapping
//! alive through an `Arc`).

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;
use serde_json::Value;

use crate::error::{Error, Result};

/// Element type of a stored tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dtype {
    F32,
    BF16,
    F16,
}

impl Dtype {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Dtype::F32 => 4,
            Dtype::BF16 | Dtype::F16 => 2,
        }
    }
}

/// One mapped safetensors file.
#[derive(Debug)]
pub struct MappedFile {
    pub path: PathBuf,
    mmap: Mmap,
}

/// A tensor inside a mapped file: a view, no copy.
#[derive(Debug, Clone)]
pub struct TensorRef {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    file: Arc<MappedFile>,
    start: usize,
    end: usize,
}

impl TensorRef {
    /// The raw little-endian bytes of the tensor.
    pub fn bytes(&self) -> &[u8] {
        &self.file.mmap[self.start..self.end]
    }

    /// The file the tensor lives in.
    pub fn path(&self) -> &Path {
        &self.file.path
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// The file's mapping and the byte range of this tensor in it (for zero-copy views).
    pub fn mapping(&self) -> (&Arc<MappedFile>, std::ops::Range<usize>) {
        (&self.file, self.start..self.end)
    }

    /// The same data viewed with another shape of equal element count (e.g. a Conv3d kernel
    /// `[out, c, t, p, p]` as the matrix `[out, c·t·p·p]`).
    pub fn reshaped(&self, shape: &[usize]) -> Result<TensorRef> {
        if shape.iter().product::<usize>() != self.numel() {
            return Err(Error::ShapeMismatch {
                name: self.name.clone(),
                path: self.path().to_path_buf(),
                expected: shape.to_vec(),
                actual: self.shape.clone(),
            });
        }
        Ok(TensorRef {
            shape: shape.to_vec(),
            ..self.clone()
        })
    }

    /// Rows `start..start + len` of the first dimension, as a view (e.g. the q, k or v part of a
    /// fused qkv projection).
    pub fn slice_rows(&self, start: usize, len: usize) -> Result<TensorRef> {
        let rows = *self.shape.first().unwrap_or(&0);
        if start + len > rows {
            return Err(Error::ShapeMismatch {
                name: format!("{}[{start}..{}]", self.name, start + len),
                path: self.path().to_path_buf(),
                expected: vec![start + len],
                actual: self.shape.clone(),
            });
        }
        let row_bytes = self.shape[1..].iter().product::<usize>() * self.dtype.size();
        let mut shape = self.shape.clone();
        shape[0] = len;
        Ok(TensorRef {
            name: format!("{}[{start}..{}]", self.name, start + len),
            shape,
            start: self.start + start * row_bytes,
            end: self.start + (start + len) * row_bytes,
            ..self.clone()
        })
    }

    /// Errors unless the shape is `expected`.
    pub fn expect_shape(&self, expected: &[usize]) -> Result<()> {
        if self.shape != expected {
            return Err(Error::ShapeMismatch {
                name: self.name.clone(),
                path: self.path().to_path_buf(),
                expected: expected.to_vec(),
                actual: self.shape.clone(),
            });
        }
        Ok(())
    }

    /// Converts the tensor to f32 on the host (a copy; for tests and small tensors).
    pub fn to_f32(&self) -> Vec<f32> {
        let bytes = self.bytes();
        match self.dtype {
            Dtype::F32 => bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
            Dtype::BF16 => bytes
                .chunks_exact(2)
                .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            Dtype::F16 => bytes
                .chunks_exact(2)
                .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
        }
    }
}

impl MappedFile {
    /// The whole mapping.
    pub fn data(&self) -> &[u8] {
        &self.mmap
    }
}

/// All tensors of a checkpoint directory, by name.
#[derive(Debug)]
pub struct Checkpoint {
    /// The directory (or file) the checkpoint was opened from, for error messages.
    pub source: PathBuf,
    tensors: HashMap<String, TensorRef>,
    /// The string entries of every file's `__metadata__`.
    pub metadata: HashMap<String, String>,
}

impl Checkpoint {
    /// Opens `dir/model.safetensors.index.json` if present, else `dir/model.safetensors`.
    ///
    /// ```no_run
    /// let ckpt = recall::model::loader::Checkpoint::open(std::path::Path::new("models/tiny"))?;
    /// let embed = ckpt.get("model.language_model.embed_tokens.weight")?;
    /// println!("{:?}", embed.shape);
    /// # Ok::<(), recall::Error>(())
    /// ```
    pub fn open(dir: &Path) -> Result<Self> {
        let index = dir.join("model.safetensors.index.json");
        let single = dir.join("model.safetensors");
        if index.exists() {
            Self::open_index(&index)
        } else if single.exists() {
            Self::open_files(dir, &[single])
        } else {
            Err(Error::io(
                &single,
                std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    "neither model.safetensors nor model.safetensors.index.json exists",
                ),
            ))
        }
    }

    fn open_index(index: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(index).map_err(|e| Error::io(index, e))?;
        let doc: Value = serde_json::from_str(&text).map_err(|e| Error::json(index, "", e))?;
        let map = doc
            .get("weight_map")
            .and_then(Value::as_object)
            .ok_or_else(|| Error::json(index, "weight_map", "missing or not an object"))?;
        let dir = index.parent().unwrap_or(Path::new("."));
        let mut files: Vec<PathBuf> = Vec::new();
        for (name, file) in map {
            let file = file
                .as_str()
                .ok_or_else(|| Error::json(index, format!("weight_map.{name}"), "not a string"))?;
            let path = dir.join(file);
            if !files.contains(&path) {
                files.push(path);
            }
        }
        let ckpt = Self::open_files(dir, &files)?;
        for name in map.keys() {
            if !ckpt.tensors.contains_key(name) {
                return Err(Error::MissingTensor {
                    name: name.clone(),
                    path: dir.join(map[name].as_str().unwrap_or_default()),
                });
            }
        }
        Ok(ckpt)
    }

    /// Opens one safetensors file.
    pub fn open_file(path: &Path) -> Result<Self> {
        Self::open_files(path, &[path.to_path_buf()])
    }

    fn open_files(source: &Path, files: &[PathBuf]) -> Result<Self> {
        let mut tensors = HashMap::new();
        let mut metadata = HashMap::new();
        for path in files {
            let (refs, meta) = parse_file(path)?;
            for t in refs {
                tensors.insert(t.name.clone(), t);
            }
            metadata.extend(meta);
        }
        tracing::debug!(tensors = tensors.len(), files = files.len(), "checkpoint mapped");
        Ok(Checkpoint {
            source: source.to_path_buf(),
            tensors,
            metadata,
        })
    }

    /// The tensor `name`, or an error naming it and the checkpoint.
    pub fn get(&self, name: &str) -> Result<&TensorRef> {
        self.tensors.get(name).ok_or_else(|| Error::MissingTensor {
            name: name.to_string(),
            path: self.source.clone(),
        })
    }

    /// Whether the checkpoint holds `name`.
    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// All tensor names, sorted.
    pub fn names(&self) -> Vec<&str> {
        let mut v: Vec<&str> = self.tensors.keys().map(String::as_str).collect();
        v.sort_unstable();
        v
    }
}

/// Maps one safetensors file and validates its header against the file size; returns its tensors and
/// the string entries of its `__metadata__`.
fn parse_file(path: &Path) -> Result<(Vec<TensorRef>, HashMap<String, String>)> {
    let bad = |message: String| Error::Safetensors {
        path: path.to_path_buf(),
        message,
    };
    let file = File::open(path).map_err(|e| Error::io(path, e))?;
    // SAFETY: the mapping is read-only; recall never writes checkpoint files while they are mapped.
    // A file truncated by another process after mapping is outside what we can defend against.
    let mmap = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
    if mmap.len() < 8 {
        return Err(bad(format!(
            "file is {} bytes, shorter than the 8-byte header length",
            mmap.len()
        )));
    }
    let header_len = u64::from_le_bytes(mmap[..8].try_into().expect("8 bytes")) as usize;
    let data_start = 8usize
        .checked_add(header_len)
        .filter(|&end| end <= mmap.len())
        .ok_or_else(|| {
            bad(format!(
                "header length {header_len} exceeds the file size {}",
                mmap.len()
            ))
        })?;
    let header: BTreeMap<String, Value> = serde_json::from_slice(&mmap[8..data_start])
        .map_err(|e| bad(format!("header is not valid JSON: {e}")))?;
    let data_len = mmap.len() - data_start;
    let file = Arc::new(MappedFile {
        path: path.to_path_buf(),
        mmap,
    });
    let mut out = Vec::with_capacity(header.len());
    let mut metadata = HashMap::new();
    for (name, info) in header {
        if name == "__metadata__" {
            if let Some(m) = info.as_object() {
                metadata.extend(
                    m.iter()
                        .filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_string()))),
                );
            }
            continue;
        }
        let dtype = match info.get("dtype").and_then(Value::as_str) {
            Some("F32") => Dtype::F32,
            Some("BF16") => Dtype::BF16,
            Some("F16") => Dtype::F16,
            other => {
                return Err(Error::UnsupportedDtype {
                    name,
                    path: path.to_path_buf(),
                    dtype: other.unwrap_or("<missing>").to_string(),
                })
            }
        };
        let shape: Vec<usize> = info
            .get("shape")
            .and_then(Value::as_array)
            .and_then(|a| a.iter().map(|d| d.as_u64().map(|d| d as usize)).collect())
            .ok_or_else(|| bad(format!("tensor `{name}` has no valid shape")))?;
        let offsets: Vec<usize> = info
            .get("data_offsets")
            .and_then(Value::as_array)
            .and_then(|a| a.iter().map(|d| d.as_u64().map(|d| d as usize)).collect())
            .filter(|o: &Vec<usize>| o.len() == 2)
            .ok_or_else(|| bad(format!("tensor `{name}` has no valid data_offsets")))?;
        let (begin, end) = (offsets[0], offsets[1]);
        if begin > end || end > data_len {
            return Err(bad(format!(
                "tensor `{name}` spans bytes {begin}..{end} but the data section has {data_len} bytes (truncated file?)"
            )));
        }
        let expected = shape.iter().product::<usize>() * dtype.size();
        if end - begin != expected {
            return Err(bad(format!(
                "tensor `{name}` has {} bytes, its shape {shape:?} needs {expected}",
                end - begin
            )));
        }
        out.push(TensorRef {
            name,
            dtype,
            shape,
            file: file.clone(),
            start: data_start + begin,
            end: data_start + end,
        });
    }
    Ok((out, metadata))
}
