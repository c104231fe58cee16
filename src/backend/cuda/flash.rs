//! Tensor-core attention for prefill (`kernels/flash_attention.cu`): FlashAttention-2 style, bf16
//! `mma.sync` with f32 accumulation, over the paged KV pool (causal, GQA) and over contiguous
//! segments (non-causal, the vision towers).
//!
//! The host cuts each sequence (or segment) into q tiles of up to 64 rows and stages one record per
//! tile; the kernel runs one block per (tile, q head). Key tiles are aligned to key 0 in steps of 64
//! for every row, so a row's result does not depend on which tile it lands in or on how its prompt
//! was chunked (see the kernel's header comment). Head dims that are multiples of 8 up to 128 are
//! supported (padded to a multiple of 16 on the device); anything else returns `Ok(None)` and the
//! caller keeps the v1 kernels.
//!
//! The kernels stage K/V through two shared-memory stages filled by `cp.async` (dynamic shared
//! memory, up to 69,632 bytes at head dim 128): [`configure`] raises each kernel's limit once at load
//! time. The kernel before that pipeline is kept as `flash_attention_v1_d*` (the same file compiled
//! with `FLASH_ATTENTION_V1`), built on demand by [`CudaBackend::paged_attention_flash_v1`] and
//! [`CudaBackend::attention_segments_flash_v1`], the bitwise references of tests/cuda_flash.rs.

use std::collections::HashMap;

use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::{CudaFunction, DeviceRepr, LaunchConfig, PushKernelArg};
use xxhash_rust::xxh64::Xxh64;

use super::graph::Mode;
use super::kernels::{self, KernelSource};
use super::libs::cuda_err;
use super::params::{params, Traced};
use super::{to_i32, CudaBackend, CudaTensor};
use crate::backend::check::{self, shape_err};
use crate::backend::{AttnShape, PagedSeq};
use crate::error::Result;

/// Query rows per block (4 warps × 16 rows).
const TILE_ROWS: usize = 64;
/// Threads per block.
const THREADS: u32 = 128;
/// Largest supported head dim.
const MAX_HEAD_DIM: usize = 128;
/// Keys per K/V tile.
const TILE_KEYS: usize = 64;
/// K/V stages in shared memory (pipelined kernels).
const STAGES: usize = 2;
/// bf16 padding per shared-memory row.
const ROW_PAD: usize = 8;
/// The kernel for each padded head dim (`head_dim` rounded up to 16).
const KERNELS: [(usize, &str); 8] = [
    (16, "flash_attention_d16"),
    (32, "flash_attention_d32"),
    (48, "flash_attention_d48"),
    (64, "flash_attention_d64"),
    (80, "flash_attention_d80"),
    (96, "flash_attention_d96"),
    (112, "flash_attention_d112"),
    (128, "flash_attention_d128"),
];
/// The reference kernels (before the pipeline), in the same order.
const V1_KERNELS: [&str; 8] = [
    "flash_attention_v1_d16",
    "flash_attention_v1_d32",
    "flash_attention_v1_d48",
    "flash_attention_v1_d64",
    "flash_attention_v1_d80",
    "flash_attention_v1_d96",
    "flash_attention_v1_d112",
    "flash_attention_v1_d128",
];

/// `kernels/flash_attention.cu` built with the reference kernels instead of the pipelined ones. Not in
/// [`SOURCES`](super::SOURCES): compiled (and cached) on first use by the `*_flash_v1` methods only.
const FLASH_V1_SOURCE: KernelSource = KernelSource {
    name: "flash_attention_v1",
    source: concat!(
        "#define FLASH_ATTENTION_V1 1\n",
        include_str!("../../../kernels/flash_attention.cu")
    ),
    functions: &V1_KERNELS,
};

/// Dynamic shared memory of a pipelined kernel in bytes: `STAGES` × (K + V) × 64 keys × (DP + 8)
/// bf16; must equal `flash_smem_bytes<DP>()` in the kernel (69,632 at DP = 128).
fn smem_bytes(padded_dim: usize) -> usize {
    STAGES * 2 * TILE_KEYS * (padded_dim + ROW_PAD) * 2
}

/// Raises the dynamic shared-memory limit of every pipelined flash kernel to what it launches with
/// (over the default 48 KB from DP = 96 on). Called once by `CudaBackend::init` after loading the
/// kernels; an error means the device cannot run them (they need sm_80 or newer anyway).
pub(super) fn configure(funcs: &HashMap<&'static str, CudaFunction>) -> Result<()> {
    for (dp, name) in KERNELS {
        let f = funcs
            .get(name)
            .ok_or_else(|| cuda_err(format!("kernel {name} not loaded")))?;
        let bytes = smem_bytes(dp);
        f.set_attribute(
            CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            bytes as i32,
        )
        .map_err(|e| cuda_err(format!("{name}: {bytes} bytes of dynamic shared memory: {e:?}")))?;
    }
    Ok(())
}

params! {
    /// flash_attention.cu: flash_attention_d{16,32,...,128}.
    FlashParams {
        q: u64, k: u64, v: u64, out: u64, tiles: u64, tables: u64,
        n_tiles: i32, q_heads: i32, kv_heads: i32, d: i32, block_size: i32, causal: i32,
        scale_log2: f32,
    }
}

/// One q tile, as the kernel reads it (five `u32`s).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Tile {
    /// First row of `q` / `out`.
    q_row: u32,
    /// Rows in the tile, 1..=64.
    rows: u32,
    /// Position (key index) of the first row in its sequence or segment (unused for segments).
    pos0: u32,
    /// Keys visible to the tile's last row.
    kv_len: u32,
    /// Offset of the sequence's block table in the concatenated tables (paged), or the segment's
    /// first row (segments).
    kv_base: u32,
}

/// Which kernel family a launch uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Variant {
    /// `flash_attention_d*`: cp.async double buffering (the production kernels).
    Pipelined,
    /// `flash_attention_v1_d*`: the reference, bitwise the same results.
    V1,
}

/// The kernel for `head_dim`: its padded head dim and name, or `None` when no instantiation covers it.
fn kernel_for(head_dim: usize, variant: Variant) -> Option<(usize, &'static str)> {
    if head_dim == 0 || !head_dim.is_multiple_of(8) || head_dim > MAX_HEAD_DIM {
        return None;
    }
    let padded = head_dim.next_multiple_of(16);
    let i = KERNELS.iter().position(|(dp, _)| *dp == padded)?;
    Some(match variant {
        Variant::Pipelined => KERNELS[i],
        Variant::V1 => (padded, V1_KERNELS[i]),
    })
}

/// Tiles of `rows` query rows starting at q row `q_row`, the first at key position `pos0`.
fn push_tiles(out: &mut Vec<Tile>, q_row: usize, rows: usize, pos0: usize, kv: KvOf) {
    for start in (0..rows).step_by(TILE_ROWS) {
        let n = TILE_ROWS.min(rows - start);
        let kv_len = match kv {
            KvOf::Causal => pos0 + start + n,
            KvOf::All(len) => len,
        };
        out.push(Tile {
            q_row: (q_row + start) as u32,
            rows: n as u32,
            pos0: (pos0 + start) as u32,
            kv_len: kv_len as u32,
            kv_base: 0,
        });
    }
}

/// Which keys a tile's last row sees.
#[derive(Clone, Copy)]
enum KvOf {
    /// Keys up to its own position.
    Causal,
    /// The whole segment.
    All(usize),
}

/// Tile records and concatenated block tables of a paged call.
fn paged_tiles(seqs: &[PagedSeq<'_>]) -> (Vec<Tile>, Vec<u32>) {
    let (mut tiles, mut tables, mut q_row) = (Vec::new(), Vec::new(), 0);
    for seq in seqs {
        let first = tiles.len();
        push_tiles(
            &mut tiles,
            q_row,
            seq.rows,
            seq.context_len - seq.rows,
            KvOf::Causal,
        );
        for t in &mut tiles[first..] {
            t.kv_base = tables.len() as u32;
        }
        tables.extend_from_slice(seq.block_table);
        q_row += seq.rows;
    }
    (tiles, tables)
}

/// Tile records of a segments call.
fn segment_tiles(cu_seqlens: &[usize]) -> Vec<Tile> {
    let mut tiles = Vec::new();
    for w in cu_seqlens.windows(2) {
        let first = tiles.len();
        push_tiles(&mut tiles, w[0], w[1] - w[0], 0, KvOf::All(w[1] - w[0]));
        for t in &mut tiles[first..] {
            t.kv_base = w[0] as u32;
        }
    }
    tiles
}

/// Tiles as the staged `u32` array, longest key range first (the causal tail starts early), then the
/// tables. The order of blocks does not change any result.
fn tile_words(mut tiles: Vec<Tile>, tables: &[u32]) -> Vec<u32> {
    tiles.sort_by_key(|t| std::cmp::Reverse(t.kv_len));
    let mut words = Vec::with_capacity(tiles.len() * 5 + tables.len());
    for t in &tiles {
        words.extend_from_slice(&[t.q_row, t.rows, t.pos0, t.kv_len, t.kv_base]);
    }
    words.extend_from_slice(tables);
    words
}

/// Everything one launch needs besides the tensors.
struct Launch<'a> {
    op: &'static str,
    kernel: &'static str,
    variant: Variant,
    /// The kernel's padded head dim.
    padded_dim: usize,
    tiles: Vec<Tile>,
    tables: &'a [u32],
    q_heads: usize,
    kv_heads: usize,
    head_dim: usize,
    /// 0 for segments (contiguous keys, non-causal).
    block_size: usize,
}

impl CudaBackend {
    /// Causal paged attention on tensor cores; the same semantics as
    /// [`Backend::paged_attention`](crate::backend::Backend::paged_attention): row `i` of a sequence
    /// with `rows` new tokens and `context_len` valid tokens sits at position `context_len - rows + i`
    /// and attends to positions `0..=` that through its block table; q head `h` reads kv head
    /// `h / (q_heads / kv_heads)`.
    ///
    /// Arguments are validated as for the v1 kernel (errors for malformed calls). Returns `Ok(None)`,
    /// launching nothing, when the shape has no instantiation (head_dim not a multiple of 8 or over
    /// 128); the caller then uses v1. Meant for prefill: every q tile holds rows of one sequence, so a
    /// decode row occupies a whole 64-row tile and its keys are not split (no split-K).
    pub fn paged_attention_flash(
        &self,
        q: &CudaTensor,
        k_pool: &CudaTensor,
        v_pool: &CudaTensor,
        shape: AttnShape,
        seqs: &[PagedSeq<'_>],
    ) -> Result<Option<CudaTensor>> {
        self.paged_flash(q, k_pool, v_pool, shape, seqs, Variant::Pipelined)
    }

    /// [`paged_attention_flash`](Self::paged_attention_flash) on the reference kernel
    /// `flash_attention_v1_d*` (the kernel before cp.async pipelining), for tests: the results must be
    /// bitwise the same. Builds its module on first use (NVRTC, then the disk cache), loads it for each
    /// call and waits for the launch; an error inside a step recording.
    pub fn paged_attention_flash_v1(
        &self,
        q: &CudaTensor,
        k_pool: &CudaTensor,
        v_pool: &CudaTensor,
        shape: AttnShape,
        seqs: &[PagedSeq<'_>],
    ) -> Result<Option<CudaTensor>> {
        self.paged_flash(q, k_pool, v_pool, shape, seqs, Variant::V1)
    }

    fn paged_flash(
        &self,
        q: &CudaTensor,
        k_pool: &CudaTensor,
        v_pool: &CudaTensor,
        shape: AttnShape,
        seqs: &[PagedSeq<'_>],
        variant: Variant,
    ) -> Result<Option<CudaTensor>> {
        let dims = |x: &CudaTensor| (x.rows, x.cols);
        check::paged_attention(dims(q), dims(k_pool), dims(v_pool), shape, seqs)?;
        let Some((padded_dim, kernel)) = kernel_for(shape.head_dim, variant) else {
            return Ok(None);
        };
        // The kernel reads rows, positions and table offsets as 32-bit ints.
        let op = "paged_attention";
        to_i32(op, q.rows)?;
        to_i32(op, seqs.iter().map(|s| s.context_len).max().unwrap_or(0))?;
        to_i32(op, seqs.iter().map(|s| s.block_table.len()).sum())?;
        let (tiles, tables) = paged_tiles(seqs);
        let launch = Launch {
            op,
            kernel,
            variant,
            padded_dim,
            tiles,
            tables: &tables,
            q_heads: shape.q_heads,
            kv_heads: shape.kv_heads,
            head_dim: shape.head_dim,
            block_size: shape.block_size,
        };
        self.flash(q, k_pool, v_pool, launch)
    }

    /// Non-causal attention within segments on tensor cores; the same semantics as
    /// [`Backend::attention_segments`](crate::backend::Backend::attention_segments): rows
    /// `cu_seqlens[s]..cu_seqlens[s + 1]` attend to each other only, `q, k, v: [n, heads · head_dim]`.
    ///
    /// Validated as for the v1 kernel; `Ok(None)` when the head dim has no instantiation.
    pub fn attention_segments_flash(
        &self,
        q: &CudaTensor,
        k: &CudaTensor,
        v: &CudaTensor,
        heads: usize,
        cu_seqlens: &[usize],
    ) -> Result<Option<CudaTensor>> {
        self.segments_flash(q, k, v, heads, cu_seqlens, Variant::Pipelined)
    }

    /// [`attention_segments_flash`](Self::attention_segments_flash) on the reference kernel, for tests
    /// (see [`paged_attention_flash_v1`](Self::paged_attention_flash_v1)).
    pub fn attention_segments_flash_v1(
        &self,
        q: &CudaTensor,
        k: &CudaTensor,
        v: &CudaTensor,
        heads: usize,
        cu_seqlens: &[usize],
    ) -> Result<Option<CudaTensor>> {
        self.segments_flash(q, k, v, heads, cu_seqlens, Variant::V1)
    }

    fn segments_flash(
        &self,
        q: &CudaTensor,
        k: &CudaTensor,
        v: &CudaTensor,
        heads: usize,
        cu_seqlens: &[usize],
        variant: Variant,
    ) -> Result<Option<CudaTensor>> {
        let dims = |x: &CudaTensor| (x.rows, x.cols);
        check::attention_segments(dims(q), dims(k), dims(v), heads, cu_seqlens)?;
        let head_dim = q.cols / heads;
        let Some((padded_dim, kernel)) = kernel_for(head_dim, variant) else {
            return Ok(None);
        };
        let op = "attention_segments";
        to_i32(op, q.rows)?; // rows and key rows are 32-bit in the kernel
        let launch = Launch {
            op,
            kernel,
            variant,
            padded_dim,
            tiles: segment_tiles(cu_seqlens),
            tables: &[],
            q_heads: heads,
            kv_heads: heads,
            head_dim,
            block_size: 0,
        };
        self.flash(q, k, v, launch)
    }

    /// Stages the tile records and launches one block per (tile, q head); `None` when an operand is
    /// not 16-byte aligned (the kernel reads rows with 16-byte vector loads) or `k` has more rows than
    /// an `i32` holds (the kernel keeps k/v row indices in 32 bits).
    fn flash(
        &self,
        q: &CudaTensor,
        k: &CudaTensor,
        v: &CudaTensor,
        l: Launch<'_>,
    ) -> Result<Option<CudaTensor>> {
        if [q, k, v].iter().any(|x| x.ptr() % 16 != 0) || i32::try_from(k.rows).is_err() {
            return Ok(None);
        }
        let out = self.alloc_tensor(q.rows, q.cols)?;
        if l.tiles.is_empty() || q.cols == 0 {
            return Ok(Some(out));
        }
        if out.ptr() % 16 != 0 {
            return Ok(None);
        }
        let op = l.op;
        if l.q_heads > u16::MAX as usize {
            return Err(shape_err(
                op,
                format!("{} heads (grid.y holds at most 65535)", l.q_heads),
            ));
        }
        let n_tiles = l.tiles.len();
        let words = self.stage(&tile_words(l.tiles, l.tables))?;
        let d = l.head_dim;
        let p = FlashParams {
            q: q.ptr(),
            k: k.ptr(),
            v: v.ptr(),
            out: out.ptr(),
            tiles: words.ptr(),
            tables: words.ptr() + 4 * 5 * n_tiles as u64,
            n_tiles: to_i32(op, n_tiles)?,
            q_heads: l.q_heads as i32,
            kv_heads: l.kv_heads as i32,
            d: d as i32,
            block_size: to_i32(op, l.block_size)?,
            causal: (l.block_size > 0) as i32,
            scale_log2: std::f32::consts::LOG2_E / (d as f32).sqrt(),
        };
        let cfg = LaunchConfig {
            grid_dim: (n_tiles as u32, l.q_heads as u32, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: match l.variant {
                Variant::Pipelined => smem_bytes(l.padded_dim) as u32,
                Variant::V1 => 0, // static
            },
        };
        match l.variant {
            Variant::Pipelined => self.launch(l.kernel, cfg, p)?,
            Variant::V1 => self.launch_v1(l.kernel, cfg, p)?,
        }
        drop(words); // kept alive until the launch is queued
        Ok(Some(out))
    }

    /// Launches a reference kernel from its own module (built on demand, see [`FLASH_V1_SOURCE`]) and
    /// waits for it, so the module can be unloaded when this returns. Not for step recordings. Timed
    /// like any launch when profiling is on (the module load falls outside the timed span).
    fn launch_v1(&self, name: &'static str, cfg: LaunchConfig, p: FlashParams) -> Result<()> {
        if self.steps()?.mode != Mode::Direct {
            return Err(cuda_err(format!(
                "{name}: the reference kernels cannot run inside a step recording"
            )));
        }
        let cubin = kernels::load_cubin(&FLASH_V1_SOURCE, &self.arch)?;
        let module = self
            .ctx
            .load_module(cudarc::nvrtc::Ptx::from_binary(cubin))
            .map_err(|e| cuda_err(format!("loading {}: {e:?}", FLASH_V1_SOURCE.name)))?;
        let f = module
            .load_function(name)
            .map_err(|e| cuda_err(format!("kernel {name}: {e:?}")))?;
        let timer = self.profile_start()?;
        let mut b = self.stream.launch_builder(&f);
        b.arg(&p);
        // SAFETY: `p` matches the kernel's C parameter struct (FlashParams); every pointer in it is a
        // live allocation of this context whose size the caller validated against the counts in `p`.
        unsafe { b.launch(cfg) }.map_err(|e| cuda_err(format!("launching {name}: {e:?}")))?;
        self.profile_end(name, timer)?;
        self.synchronize()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn head_dims_map_to_padded_kernels() {
        let new = |d| kernel_for(d, Variant::Pipelined);
        assert_eq!(new(128), Some((128, "flash_attention_d128")));
        assert_eq!(new(120), Some((128, "flash_attention_d128")));
        assert_eq!(new(72), Some((80, "flash_attention_d80")));
        assert_eq!(new(80), Some((80, "flash_attention_d80")));
        assert_eq!(new(8), Some((16, "flash_attention_d16")));
        let v1 = |d| kernel_for(d, Variant::V1);
        assert_eq!(v1(72), Some((80, "flash_attention_v1_d80")));
        assert_eq!(v1(128), Some((128, "flash_attention_v1_d128")));
        for bad in [0, 4, 12, 130, 136, 256] {
            assert_eq!(new(bad), None, "head_dim {bad}");
            assert_eq!(v1(bad), None, "head_dim {bad}");
        }
        for ((dp, name), v1_name) in KERNELS.iter().zip(V1_KERNELS) {
            assert_eq!(v1_name, name.replace("attention_d", "attention_v1_d"), "d{dp}");
        }
        assert!(FLASH_V1_SOURCE
            .source
            .starts_with("#define FLASH_ATTENTION_V1 1\n"));
        let names: Vec<&str> = crate::backend::cuda::SOURCES
            .iter()
            .find(|k| k.name == "flash_attention")
            .expect("flash_attention in SOURCES")
            .functions
            .to_vec();
        assert_eq!(names, KERNELS.map(|(_, n)| n).to_vec());
    }

    #[test]
    fn shared_memory_fits_the_opt_in_limit() {
        // The kernel's static_assert pins flash_smem_bytes<128>() to the same number.
        assert_eq!(smem_bytes(128), 69_632);
        assert_eq!(smem_bytes(80), 45_056);
        // Opt-in limit per block: 227 KB on sm_90, 163 KB on sm_80, 99 KB on sm_86/89.
        assert!(KERNELS.iter().all(|&(dp, _)| smem_bytes(dp) <= 99 * 1024));
    }

    #[test]
    fn paged_tiles_cover_each_row_once_with_its_causal_range() {
        let (t0, t1) = ([7u32, 3, 9, 1], [4u32, 0]);
        let seqs = [
            PagedSeq {
                rows: 130,
                context_len: 150,
                block_table: &t0,
            },
            PagedSeq {
                rows: 0,
                context_len: 5,
                block_table: &t1[..1],
            },
            PagedSeq {
                rows: 1,
                context_len: 20,
                block_table: &t1,
            },
        ];
        let (tiles, tables) = paged_tiles(&seqs);
        assert_eq!(tables, [7, 3, 9, 1, 4, 4, 0]);
        let want = [
            Tile {
                q_row: 0,
                rows: 64,
                pos0: 20,
                kv_len: 84,
                kv_base: 0,
            },
            Tile {
                q_row: 64,
                rows: 64,
                pos0: 84,
                kv_len: 148,
                kv_base: 0,
            },
            Tile {
                q_row: 128,
                rows: 2,
                pos0: 148,
                kv_len: 150,
                kv_base: 0,
            },
            Tile {
                q_row: 130,
                rows: 1,
                pos0: 19,
                kv_len: 20,
                kv_base: 5,
            },
        ];
        assert_eq!(tiles, want);
        let words = tile_words(tiles, &tables);
        assert_eq!(&words[..5], &[128, 2, 148, 150, 0], "longest key range first");
        assert_eq!(&words[20..], &tables[..]);
    }

    #[test]
    fn segment_tiles_see_their_whole_segment() {
        let tiles = segment_tiles(&[0, 5, 5, 75]);
        let want = [
            Tile {
                q_row: 0,
                rows: 5,
                pos0: 0,
                kv_len: 5,
                kv_base: 0,
            },
            Tile {
                q_row: 5,
                rows: 64,
                pos0: 0,
                kv_len: 70,
                kv_base: 5,
            },
            Tile {
                q_row: 69,
                rows: 6,
                pos0: 64,
                kv_len: 70,
                kv_base: 5,
            },
        ];
        assert_eq!(tiles, want);
    }
}
