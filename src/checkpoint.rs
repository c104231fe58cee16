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
use crate::limits;

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
    /// Set for the tensors of a [`Checkpoint::synthetic`]: values are generated, `start..end` is a
    /// virtual range (element `i` of the tensor is element `start / 2 + i` of the generated sequence).
    fill: Option<Fill>,
}

/// How the values of a synthetic tensor are generated (benchmarks: random weights of a real shape
/// without a file). bf16 values; every backend reproduces [`Fill::value`] bit for bit, the CUDA one in
/// a kernel on the device (`fill_random_v1`), so nothing of the size of the model crosses the bus.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Fill {
    Zeros,
    Ones,
    /// Uniform in `[-scale, scale)` (std = scale / √3), from a counter-based hash of `(seed, index)`.
    Uniform {
        seed: u64,
        scale: f32,
    },
}

impl Fill {
    /// Element `i`, rounded to bf16 (returned as f32).
    ///
    /// ```
    /// use recall::checkpoint::Fill;
    /// let f = Fill::Uniform { seed: 7, scale: 0.5 };
    /// assert_eq!(f.value(3), f.value(3));
    /// assert!(f.value(3).abs() <= 0.5);
    /// ```
    pub fn value(&self, i: u64) -> f32 {
        let v = match *self {
            Fill::Zeros => 0.0,
            Fill::Ones => 1.0,
            // 24 random bits → [0, 1) exactly, → [-1, 1) exactly, then one rounded multiply.
            Fill::Uniform { seed, scale } => {
                let u = (splitmix64(seed ^ i.wrapping_mul(0x9e37_79b9_7f4a_7c15)) >> 40) as f32;
                (u * (1.0 / 16_777_216.0) * 2.0 - 1.0) * scale
            }
        };
        half::bf16::from_f32(v).to_f32()
    }
}

/// SplitMix64's output function (also in kernels/elementwise.cu: keep them identical).
fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl TensorRef {
    /// The raw little-endian bytes of the tensor (empty for a synthetic tensor: see
    /// [`synthetic`](Self::synthetic)).
    pub fn bytes(&self) -> &[u8] {
        if self.fill.is_some() {
            return &[];
        }
        &self.file.mmap[self.start..self.end]
    }

    /// For a synthetic tensor: its fill rule and the generated-sequence index of its first element.
    pub fn synthetic(&self) -> Option<(Fill, u64)> {
        self.fill.map(|f| (f, (self.start / self.dtype.size()) as u64))
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
        if let Some((fill, first)) = self.synthetic() {
            return (0..self.numel() as u64).map(|i| fill.value(first + i)).collect();
        }
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

    /// Maps the pages of `range` into this process ahead of their first read
    /// (`MADV_POPULATE_READ`), a chunk at a time, for as long as `more()` says; returns the bytes
    /// done. A hint: where the kernel declines (before Linux 5.14, or off Linux) it stops, and
    /// the pages fault in when first read, as they would have anyway.
    ///
    /// The caller runs it on a thread that would otherwise wait, for pages it will read soon: a
    /// first read of a mapped page from the page cache pays a fault per 64 KiB
    /// (`fault_around_bytes`), and a tied `lm_head` is read whole by the first token.
    ///
    /// ```no_run
    /// let ckpt = recall::checkpoint::Checkpoint::open(std::path::Path::new("models/tiny"))?;
    /// let (file, range) = ckpt.get("model.language_model.embed_tokens.weight")?.mapping();
    /// let done = file.populate(range, || true);
    /// println!("{done} bytes mapped");
    /// # Ok::<(), recall::Error>(())
    /// ```
    pub fn populate(&self, range: std::ops::Range<usize>, mut more: impl FnMut() -> bool) -> usize {
        // Chunks of 256 KiB keep the answer to `more()` fresh without a system call per page.
        const CHUNK: usize = 256 << 10;
        const PAGE: usize = 4096;
        let end = range.end.min(self.mmap.len());
        // The mapping starts on a page, so offsets rounded down to a page are page-aligned addresses.
        let mut at = range.start / PAGE * PAGE;
        while at < end && more() {
            let len = CHUNK.min(end - at);
            if !self.advise_populate(at, len) {
                break;
            }
            at += len;
        }
        at.min(end).saturating_sub(range.start)
    }

    #[cfg(target_os = "linux")]
    fn advise_populate(&self, offset: usize, len: usize) -> bool {
        match self.mmap.advise_range(memmap2::Advice::PopulateRead, offset, len) {
            Ok(()) => true,
            Err(e) => {
                tracing::debug!(path = %self.path.display(), error = %e, "MADV_POPULATE_READ declined");
                false
            }
        }
    }

    #[cfg(not(target_os = "linux"))]
    fn advise_populate(&self, _offset: usize, _len: usize) -> bool {
        false
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
    /// let ckpt = recall::checkpoint::Checkpoint::open(std::path::Path::new("models/tiny"))?;
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
        let text = limits::read_capped(index, limits::MAX_CONFIG_BYTES)?;
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
            let path = dir.join(shard_file_name(index, name, file)?);
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

    /// A checkpoint of generated bf16 tensors (`(name, shape, fill)`), with no file behind it: for
    /// benchmarks at the shape of a real model. `source` names it in errors.
    ///
    /// ```
    /// use recall::checkpoint::{Checkpoint, Fill};
    /// let ckpt = Checkpoint::synthetic("random", [("w".to_string(), vec![2, 3], Fill::Ones)])?;
    /// assert_eq!(ckpt.get("w")?.to_f32(), vec![1.0; 6]);
    /// # Ok::<(), recall::Error>(())
    /// ```
    pub fn synthetic(
        source: &str,
        specs: impl IntoIterator<Item = (String, Vec<usize>, Fill)>,
    ) -> Result<Self> {
        let anon = memmap2::MmapMut::map_anon(1)
            .and_then(|m| m.make_read_only())
            .map_err(|e| Error::io(Path::new(source), e))?;
        let file = Arc::new(MappedFile {
            path: PathBuf::from(source),
            mmap: anon,
        });
        let tensors = specs
            .into_iter()
            .map(|(name, shape, fill)| {
                let bytes = shape.iter().product::<usize>() * 2;
                let t = TensorRef {
                    name: name.clone(),
                    dtype: Dtype::BF16,
                    shape,
                    file: file.clone(),
                    start: 0,
                    end: bytes,
                    fill: Some(fill),
                };
                (name, t)
            })
            .collect();
        Ok(Checkpoint {
            source: PathBuf::from(source),
            tensors,
            metadata: HashMap::new(),
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

/// `file`, the shard that the index at `index` names for tensor `name`, if it is a plain relative path
/// that stays inside the model directory: an absolute path or a `..` component would let an index
/// read any file on the machine. (Symlinks inside the directory are followed: the Hugging Face cache
/// links every shard to a blob outside the snapshot directory.)
fn shard_file_name<'a>(index: &Path, name: &str, file: &'a str) -> Result<&'a Path> {
    use std::path::Component;
    let path = Path::new(file);
    let plain = path
        .components()
        .all(|c| matches!(c, Component::Normal(_) | Component::CurDir));
    if !plain || !matches!(path.components().next_back(), Some(Component::Normal(_))) {
        return Err(Error::json(
            index,
            format!("weight_map.{name}"),
            format!("shard file `{file}` is not a relative path inside the model directory"),
        ));
    }
    Ok(path)
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
    let header_len = u64::from_le_bytes(mmap[..8].try_into().expect("8 bytes"));
    if header_len > limits::MAX_SAFETENSORS_HEADER_BYTES {
        return Err(Error::LimitExceeded {
            what: "safetensors header length".into(),
            path: path.to_path_buf(),
            value: header_len,
            cap: limits::MAX_SAFETENSORS_HEADER_BYTES,
        });
    }
    let data_start = 8 + header_len as usize;
    if data_start > mmap.len() {
        return Err(bad(format!(
            "header length {header_len} exceeds the file size {}",
            mmap.len()
        )));
    }
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
        let (dtype, shape, (begin, end)) = tensor_entry(&name, &info, data_len, path)?;
        out.push(TensorRef {
            name,
            dtype,
            shape,
            file: file.clone(),
            start: data_start + begin,
            end: data_start + end,
            fill: None,
        });
    }
    Ok((out, metadata))
}

/// One tensor's header entry: its dtype, its shape and its byte range in the data section, checked
/// against the data section's length and against each other.
fn tensor_entry(
    name: &str,
    info: &Value,
    data_len: usize,
    path: &Path,
) -> Result<(Dtype, Vec<usize>, (usize, usize))> {
    let bad = |message: String| Error::Safetensors {
        path: path.to_path_buf(),
        message,
    };
    let dtype = match info.get("dtype").and_then(Value::as_str) {
        Some("F32") => Dtype::F32,
        Some("BF16") => Dtype::BF16,
        Some("F16") => Dtype::F16,
        other => {
            return Err(Error::UnsupportedDtype {
                name: name.to_string(),
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
    // Checked: a hostile shape such as [2^40, 2^40] must not wrap around to the stored size.
    let expected = shape
        .iter()
        .try_fold(dtype.size(), |n, &d| n.checked_mul(d))
        .ok_or_else(|| {
            bad(format!(
                "tensor `{name}` has a shape {shape:?} too large to address"
            ))
        })?;
    if end - begin != expected {
        return Err(bad(format!(
            "tensor `{name}` has {} bytes, its shape {shape:?} needs {expected}",
            end - begin
        )));
    }
    Ok((dtype, shape, (begin, end)))
}
