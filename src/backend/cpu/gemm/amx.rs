//! The opt-in bf16 GEMM on AMX tiles (Intel Sapphire Rapids and later): `TDPBF16PS` multiplies a
//! 16 × 32 bf16 tile of `x` by a 32 × 16 tile of the weight into 16 × 16 f32 sums, 16,384
//! FLOPs per instruction — what oneDNN runs PyTorch's bf16 matmuls on such CPUs with.
//!
//! The inputs are those of `dot_bf16.rs` (`x` rounded to bf16 by `round_pairs`, the weight's
//! pairs packed by `pack::pairs`), and so is the frame: blocks of panels, chains carried through
//! memory between blocks. How one `TDPBF16PS` adds its 32 products to an accumulator is the
//! hardware's (it is neither sequential order of fused multiply-adds: `tests/cpu_bf16_dot.rs`),
//! but every output element is computed alone, from its own row and column only, and the steps of
//! `k` are always the same 32-value groups from 0 (`k` padded with zeros to a multiple of 32), so
//! a row still has the same bits alone, in a batch, on any number of threads — the rows of a tile
//! past `m` are zeros whose sums are dropped.
//!
//! Calls of at most 16 rows (decode) swap the operands instead: the weight's rows are the first
//! tile, loaded straight from the mapping (16 rows of 32 values, nothing packed, so decode streams
//! the weight once), and `x`, transposed into pairs, the second; the sums come out transposed.
//! The products are exact and `TDPBF16PS` adds them the same way whichever operand brings them
//! (measured bitwise on random tiles, and `tests/cpu_bf16_dot.rs` checks rows alone against the
//! same rows in a many-row call), so both give the same bits.
//!
//! What sets its speed (docs/PERFORMANCE.md, 2026-12-07): a tile load costs more than the product
//! it feeds, so the loads are kept cheap. Every tile the many-row kernel loads starts on a 64-byte
//! line ([`Lines`]; a tile row across two lines is two loads, and unaligned tiles took 2.5 times as
//! long). `x` is laid out tile by tile ([`tile_rows`], on all threads), because rows `2k` bytes
//! apart put a tile's 16 rows in one L1 set. Whole 32 × 32 blocks of sums start from `tilezero` and
//! load and store in `y` itself. Decode reads the weight's rows where the checkpoint put them,
//! aligned or not (copying them to lines first was slower).
//!
//! The tiles are named in `asm!` (the compiler never uses them, so they keep their contents
//! between the blocks of one kernel call): tmm0–3 the 2 × 2 sums (32 rows × 2 panels), tmm4–5
//! two row tiles of `x`, tmm6–7 two panel tiles.

use std::arch::asm;
use std::sync::OnceLock;

use super::{pack, Matrix, RowMajor, NR};

/// Rows of a tile.
const TR: usize = 16;
/// Pair steps of `k` per `TDPBF16PS` (64 bytes of a tile row).
const TS: usize = 16;
/// Pair steps per packed block of a many-row call (2,048 values of `k`).
const WIDE_PAIRS: usize = 1024;
/// Panels per packed block of a many-row call (1 MiB of pairs; with 24 panels, 1.5 MiB, the
/// prefill shapes ran 5–15% slower: docs/PERFORMANCE.md, 2026-12-07).
const WIDE_PANELS: usize = 16;
/// Pair steps and panels per block of a call of fewer than 32 rows (16 KiB).
const NARROW: (usize, usize) = (2, 128);

/// Whether this CPU has AMX-BF16 and the kernel lets this process use the tiles (Linux asks for
/// it once, `arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`).
pub(super) fn available() -> bool {
    static OK: OnceLock<bool> = OnceLock::new();
    *OK.get_or_init(|| {
        // CPUID leaf 7 exists on every x86-64 CPU that has AVX-512 (checked first).
        let has = super::dot_bf16::available() && {
            let id = std::arch::x86_64::__cpuid_count(7, 0);
            id.edx & (1 << 22) != 0 && id.edx & (1 << 24) != 0 // AMX-BF16, AMX-TILE
        };
        has && request_tiles()
    })
}

#[cfg(target_os = "linux")]
fn request_tiles() -> bool {
    const ARCH_REQ_XCOMP_PERM: i64 = 0x1023;
    const XFEATURE_XTILEDATA: i64 = 18;
    const SYS_ARCH_PRCTL: i64 = 158;
    let ret: i64;
    // SAFETY: arch_prctl with these arguments only changes which state this process may use.
    unsafe {
        asm!("syscall", inlateout("rax") SYS_ARCH_PRCTL => ret, in("rdi") ARCH_REQ_XCOMP_PERM,
             in("rsi") XFEATURE_XTILEDATA, lateout("rcx") _, lateout("r11") _, options(nostack));
    }
    ret == 0
}

#[cfg(not(target_os = "linux"))]
fn request_tiles() -> bool {
    false
}

/// 64 bytes on a 64-byte boundary: what every tile the many-row kernel loads starts on. A tile
/// row that straddles two cache lines costs two loads; unaligned tiles took 2.5 times as long
/// (docs/PERFORMANCE.md, 2026-12-07).
#[derive(Debug, Clone, Copy, Default)]
#[repr(C, align(64))]
pub(super) struct Line([u32; TS]);

/// A buffer of 32-bit words in whole, aligned [`Line`]s.
#[derive(Debug, Default)]
pub(super) struct Lines(Vec<Line>);

impl Lines {
    /// At least `words` zero words.
    pub(super) fn zeroed(words: usize) -> Lines {
        Lines(vec![Line::default(); words.div_ceil(TS)])
    }

    /// At least `words` words, the new ones zero.
    fn grow(&mut self, words: usize) {
        self.0
            .resize(self.0.len().max(words.div_ceil(TS)), Line::default());
    }

    pub(super) fn words(&self) -> &[u32] {
        // SAFETY: a `Line` is 16 `u32`s with no padding (`repr(C)`, 64 bytes), so the lines are
        // `16 · len` initialised words.
        unsafe { std::slice::from_raw_parts(self.0.as_ptr().cast(), self.0.len() * TS) }
    }

    fn words_mut(&mut self) -> &mut [u32] {
        // SAFETY: as in `words`, borrowed mutably.
        unsafe { std::slice::from_raw_parts_mut(self.0.as_mut_ptr().cast(), self.0.len() * TS) }
    }
}

/// A value on a 64-byte boundary, like a [`Line`]: the sums and zero-padded steps that tiles are
/// stored to and loaded from.
#[derive(Debug, Clone, Copy)]
#[repr(C, align(64))]
struct Aligned<T>(T);

/// `x` (`[m, k]`, `k` even) rounded to bf16 pairs as `dot_bf16::round_pairs` rounds them, laid
/// out as whole tiles, each 1 KiB contiguous: `[m / 16][steps][16 rows][16 words]` (`steps`: the
/// `k / 2` pairs in groups of 16, rounded up; `m` rounded up to 16 rows; the rest zero), and
/// `steps`. A tile loaded from the rows of a row-major copy would take its 16 rows `2k` bytes
/// apart, a multiple of 4 KiB at every Qwen-VL width: one L1 set for all of them. Row tiles are
/// rounded on all threads.
pub(super) fn tile_rows(x: &[f32], m: usize, k: usize) -> (Lines, usize) {
    use rayon::prelude::*;
    tile_rows_with(x, m, k, |tiles, tile_lines, fill| {
        tiles.par_chunks_mut(tile_lines).enumerate().for_each(fill)
    })
}

/// [`tile_rows`] on this thread (attention's tasks, already one per thread).
fn tile_rows_here(x: &[f32], m: usize, k: usize) -> (Lines, usize) {
    tile_rows_with(x, m, k, |tiles, tile_lines, fill| {
        tiles.chunks_mut(tile_lines).enumerate().for_each(fill)
    })
}

/// Uninitialised lines, to be written once each.
type Uninit = [std::mem::MaybeUninit<Line>];

/// [`tile_rows`], each row tile filled by `fill` as `each` hands them out.
fn tile_rows_with(
    x: &[f32],
    m: usize,
    k: usize,
    each: impl FnOnce(&mut Uninit, usize, &(dyn Fn((usize, &mut Uninit)) + Sync)),
) -> (Lines, usize) {
    assert!(
        k.is_multiple_of(2) && x.len() == m * k,
        "x is [m, k] with an even k"
    );
    let kp = k / 2;
    let steps = kp.div_ceil(TS);
    // A line is one row's 16 pairs of one step; a tile is `steps × 16` lines.
    let tile_lines = steps * TR;
    let len = m.div_ceil(TR) * tile_lines;
    let mut lines = Vec::with_capacity(len);
    let fill = |(t, tile): (usize, &mut Uninit)| {
        let mut row = vec![0u32; kp];
        for j in 0..TR {
            let r = t * TR + j;
            if r < m {
                super::dot_bf16::round_pairs_into(&x[r * k..(r + 1) * k], &mut row);
            }
            for s in 0..steps {
                let mut line = Line::default();
                if r < m {
                    match row[s * TS..].first_chunk::<TS>() {
                        // A whole step is a fixed-size copy (a call to `memcpy` otherwise).
                        Some(pairs) => line.0 = *pairs,
                        None => line.0[..kp - s * TS].copy_from_slice(&row[s * TS..]),
                    }
                }
                tile[s * TR + j].write(line);
            }
        }
    };
    each(&mut lines.spare_capacity_mut()[..len], tile_lines, &fill);
    // SAFETY: `each` handed every tile of the `len` lines to `fill`, which wrote all its lines.
    unsafe { lines.set_len(len) };
    (Lines(lines), steps)
}

/// Rows up to which a call runs the swapped kernel ([`few_rows`]).
pub(super) const FEW_ROWS: usize = TR;

/// `x`'s pairs (`[m][kp]`, `m` ≤ 16) transposed to `[kpp][16]` (`kpp`: `kp` rounded up to 16),
/// zero past `m` and `kp`: the second operand of the swapped kernel.
pub(super) fn transpose_rows(a: &[u32], m: usize, kp: usize) -> (Lines, usize) {
    assert!(m <= FEW_ROWS && a.len() >= m * kp, "at most 16 rows");
    let kpp = kp.div_ceil(TS) * TS;
    let mut lines = Lines::zeroed(kpp * TR);
    let out = lines.words_mut();
    for r in 0..m {
        for i in 0..kp {
            out[i * TR + r] = a[r * kp + i];
        }
    }
    (lines, kpp)
}

/// Columns of panels `p0..p1` of `y` for `m` ≤ 16 rows (`xt` from [`transpose_rows`]): two
/// panels of the weight at a time as the first operand, read where they lie; a step of `k` that
/// would run past a row's end, or a panel past `n`, goes through a zero-padded copy.
pub(super) fn few_rows(
    xt: &[u32],
    kpp: usize,
    m: usize,
    w: &Matrix<'_>,
    (p0, p1): (usize, usize),
    y: &mut [f32],
) {
    let RowMajor::Bf16(bytes) = w.data else {
        panic!("a bf16 weight")
    };
    let (n, k) = (w.n, w.k);
    assert!(
        xt.len() >= kpp * TR && kpp * 2 >= k && y.len() >= m * n,
        "rows of x and y"
    );
    let whole_steps = k / 2 / TS;
    let mut pad = Aligned([[0u32; TS]; TR]);
    let mut sums = Aligned([[[0f32; TR]; NR]; 2]);
    // SAFETY: `available()` was checked by the caller (`gemm_bf16_dot`).
    unsafe { x86::configure() };
    for p in (p0..p1).step_by(2) {
        let np = (p1 - p).min(2);
        // SAFETY: as above.
        unsafe { x86::zero_sums() };
        for s in 0..kpp / TS {
            // SAFETY: `xt` holds `kpp` pair steps of 16 words (asserted above).
            unsafe { x86::load_x(xt.as_ptr().add(s * TS * TR)) };
            for q in 0..np {
                let c0 = (p + q) * NR;
                if c0 + NR <= n && s < whole_steps {
                    let at = 2 * (c0 * k + 2 * s * TS);
                    assert!(
                        at + 2 * ((NR - 1) * k + 2 * TS) <= bytes.len(),
                        "rows inside the weight"
                    );
                    // SAFETY: the 16 rows of 64 bytes from `at`, `2k` apart, lie inside `bytes`.
                    unsafe { x86::dot_rows(q, bytes.as_ptr().add(at), 2 * k) };
                } else {
                    pad_step(bytes, (n, k), c0, s, &mut pad.0);
                    // SAFETY: `pad` is 16 rows of 64 bytes.
                    unsafe { x86::dot_rows(q, pad.0.as_ptr().cast(), 4 * TS) };
                }
            }
        }
        // SAFETY: `sums` holds two 16 × 16 tiles.
        unsafe { x86::store_sums(&mut sums.0) };
        for (q, tile) in sums.0.iter().enumerate().take(np) {
            let c0 = (p + q) * NR;
            for (j, col) in tile.iter().enumerate().take(n.saturating_sub(c0).min(NR)) {
                for (r, v) in col.iter().enumerate().take(m) {
                    y[r * n + c0 + j] = *v;
                }
            }
        }
    }
    // SAFETY: as above.
    unsafe { x86::release() };
}

/// Pair step `s` (16 pairs) of rows `c0..c0 + 16` into `pad`, zero past `n` and past `k`.
fn pad_step(bytes: &[u8], (n, k): (usize, usize), c0: usize, s: usize, pad: &mut [[u32; TS]; TR]) {
    for (j, row) in pad.iter_mut().enumerate() {
        for (i, v) in row.iter_mut().enumerate() {
            let pair = s * TS + i;
            *v = if c0 + j < n && 2 * pair < k {
                let at = 2 * ((c0 + j) * k + 2 * pair);
                u32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]])
            } else {
                0
            };
        }
    }
}

/// The second operand of [`tile_products`]: `icp` pair steps (a multiple of 16) of 16-word
/// column tiles, tile `t` from word `t · next`, its pair steps `row` words apart. Packed panels
/// (`[tiles][icp][16]`) have `row` 16 and `next` `icp · 16`; pair rows (`[icp][cols]`, each row all
/// the columns' pairs of one step) `row` = `cols` and `next` 16.
pub(in crate::backend::cpu) struct TileOperand<'a> {
    pub words: &'a [u32],
    pub icp: usize,
    pub row: usize,
    pub next: usize,
}

/// `out[r·cols + c] (+)= Σ_i bf16 pair i of x's row r · pair i of column c`, for the `rows` rows
/// of `x` (`[rows, 2 · w.icp]`, rounded to bf16 pairs here) and the `cols` columns of `w` (a
/// multiple of 32): 2 × 2 tiles at a time, each sum from zero when `fresh` (else going on from the
/// sums in `out`), from its own row and column only, over the pair steps in groups of 16 from 0.
/// `out` holds `rows` rounded up to 32 rows of `cols` (the tiles past `rows` are written too). On
/// this thread: attention's products (`--cpu-bf16-attention`), one task per thread already.
pub(in crate::backend::cpu) fn tile_products(
    x: &[f32],
    rows: usize,
    w: &TileOperand<'_>,
    (cols, fresh): (usize, bool),
    out: &mut [f32],
) {
    let TileOperand {
        words,
        icp,
        row,
        next,
    } = *w;
    assert!(
        icp.is_multiple_of(TS) && cols.is_multiple_of(2 * NR) && row >= TS && available(),
        "AMX on whole tiles"
    );
    assert!(
        x.len() == rows * 2 * icp
            && (cols == 0 || words.len() >= (cols / NR - 1) * next + (icp - 1) * row + TS)
            && out.len() >= rows.div_ceil(2 * TR) * 2 * TR * cols,
        "rows of x, w and out"
    );
    if rows == 0 || icp == 0 {
        if fresh {
            out.fill(0.0);
        }
        return;
    }
    let (a, steps) = tile_rows_here(x, rows, 2 * icp);
    let tile_words = steps * TR * TS;
    // SAFETY: `available()` was asserted.
    unsafe { x86::configure() };
    for r0 in (0..rows).step_by(2 * TR) {
        let tiles_r = if rows - r0 > TR { 2 } else { 1 };
        for c0 in (0..cols).step_by(2 * NR) {
            // SAFETY: tiles configured; `a` holds `tiles_r` row tiles of `steps` steps from row
            // `r0`, `words` the two column tiles from `c0` (`icp` steps, `row` words apart), `out`
            // 32 rows of `cols` from row `r0` (all asserted above).
            unsafe {
                let operands = x86::Operands {
                    x: a.words()[r0 / TR * tile_words..].as_ptr(),
                    tile_words,
                    w: words[c0 / NR * next..].as_ptr(),
                    w_row: row,
                    w_next: next,
                    icp,
                };
                let c = out[r0 * cols + c0..].as_mut_ptr();
                x86::kernel(&operands, (tiles_r, 2), c, cols * 4, fresh)
            };
        }
    }
    // SAFETY: as above.
    unsafe { x86::release() };
}

/// Panels per task of a many-row call (`m` rows, `n` columns, `threads` threads): one packed block
/// ([`WIDE_PANELS`]) each, since every task streams all of `x` past each of its blocks, but never
/// fewer tasks than threads. `None` below 32 rows, where blocks are small and `x` is too.
pub(super) fn task_panels(m: usize, n: usize, threads: usize) -> Option<usize> {
    let share = n.div_ceil(NR).div_ceil(threads.max(1)).div_ceil(2) * 2;
    (m >= 2 * TR).then(|| WIDE_PANELS.min(share).max(2))
}

thread_local! {
    /// Each thread's packed block of pairs, reused across calls.
    static PAIRS: std::cell::RefCell<Lines> = const { std::cell::RefCell::new(Lines(Vec::new())) };
}

/// Columns of panels `p0..p1` of `y` (`[m, w.n]`) for every row of `a` (from [`tile_rows`]).
pub(super) fn panel_range(
    a: &[u32],
    steps: usize,
    m: usize,
    w: &Matrix<'_>,
    (p0, p1): (usize, usize),
    y: &mut [f32],
) {
    let kp = w.k / 2;
    assert!(
        a.len() >= m.div_ceil(TR) * steps * TR * TS && y.len() >= m * w.n,
        "rows of a and y"
    );
    let (block_panels, block_pairs) = if m >= 32 {
        (WIDE_PANELS, WIDE_PAIRS)
    } else {
        NARROW
    };
    // SAFETY: `available()` was checked by the caller (`gemm_bf16_dot`).
    unsafe { x86::configure() };
    PAIRS.with_borrow_mut(|lines| {
        lines.grow(block_panels * block_pairs * NR);
        let buf = lines.words_mut();
        for s0 in (p0..p1).step_by(block_panels) {
            let s1 = (s0 + block_panels).min(p1);
            for i0 in (0..kp).step_by(block_pairs) {
                let ic = block_pairs.min(kp - i0);
                let icp = ic.div_ceil(TS) * TS;
                for p in s0..s1 {
                    let panel = &mut buf[(p - s0) * icp * NR..(p - s0 + 1) * icp * NR];
                    pack::pairs(w, (p, p + 1), (i0, ic), &mut panel[..ic * NR]);
                    panel[ic * NR..].fill(0);
                }
                let block = Block {
                    a,
                    steps,
                    i0,
                    icp,
                    panels: &buf[..(s1 - s0) * icp * NR],
                    s0,
                };
                block_pass(&block, (m, w.n), (s0, s1), y);
            }
        }
    });
    // SAFETY: as above.
    unsafe { x86::release() };
}

/// One packed block: pair steps `i0..i0 + icp` of the row tiles of `a` (`steps` tiles each) and
/// panels from `s0` on (`icp · 16` words apart).
struct Block<'a> {
    a: &'a [u32],
    steps: usize,
    i0: usize,
    icp: usize,
    panels: &'a [u32],
    s0: usize,
}

/// A [`Block`] over all rows and panels `p0..p1`, 32 rows × 2 panels per kernel call; the sums
/// of the earlier blocks come from `y` and go back there.
fn block_pass(b: &Block<'_>, (m, n): (usize, usize), (p0, p1): (usize, usize), y: &mut [f32]) {
    // Tiles that run past `m` or `n` carry their sums here; whole 32 × 32 tiles load and store
    // theirs in `y` itself. Stale sums outside a partial tile's rows and columns are never read.
    let mut sums = Aligned([[0f32; 2 * NR]; 2 * TR]);
    let sums = &mut sums.0;
    let tile_words = b.steps * TR * TS;
    let fresh = b.i0 == 0;
    for r0 in (0..m).step_by(2 * TR) {
        let tiles_r = if m - r0 > TR { 2 } else { 1 };
        let rows = (m - r0).min(2 * TR);
        let x = &b.a[r0 / TR * tile_words + b.i0 * TR..];
        assert!(
            x.len() >= (tiles_r - 1) * tile_words + b.icp * TR,
            "rows of the tiles"
        );
        for p in (p0..p1).step_by(2) {
            let tiles_p = (p1 - p).min(2);
            let c0 = p * NR;
            let cols = (tiles_p * NR).min(n - c0);
            let panels = &b.panels[(p - b.s0) * b.icp * NR..];
            assert!(panels.len() >= tiles_p * b.icp * NR, "panels of the tiles");
            let whole = rows == 2 * TR && cols == 2 * NR;
            let (c, ldc) = if whole {
                (y[r0 * n + c0..].as_mut_ptr(), n * 4)
            } else {
                if !fresh {
                    for (i, s) in sums.iter_mut().enumerate().take(rows) {
                        s[..cols].copy_from_slice(&y[(r0 + i) * n + c0..][..cols]);
                    }
                }
                (sums.as_mut_ptr().cast::<f32>(), 2 * NR * 4)
            };
            // SAFETY: the tiles are configured (`panel_range`); `x` and the panels hold what
            // the tiles read (asserted above); `c` is 32 rows of 32 sums `ldc` bytes apart, in
            // `y` (a whole tile: rows `r0..r0 + 32`, columns `c0..c0 + 32`) or in `sums`.
            unsafe {
                let operands = x86::Operands {
                    x: x.as_ptr(),
                    tile_words,
                    w: panels.as_ptr(),
                    w_row: NR,
                    w_next: b.icp * NR,
                    icp: b.icp,
                };
                x86::kernel(&operands, (tiles_r, tiles_p), c, ldc, fresh)
            };
            if !whole {
                for (i, s) in sums.iter().enumerate().take(rows) {
                    y[(r0 + i) * n + c0..][..cols].copy_from_slice(&s[..cols]);
                }
            }
        }
    }
}

mod x86 {
    use std::arch::asm;

    use super::{NR, TR, TS};

    /// Palette 1, all eight tiles 16 rows of 64 bytes.
    #[repr(C, align(64))]
    struct Config([u8; 64]);

    /// # Safety
    /// The CPU has AMX and this process may use it ([`super::available`]).
    pub unsafe fn configure() {
        let mut c = Config([0; 64]);
        c.0[0] = 1;
        for t in 0..8 {
            c.0[16 + 2 * t] = 64; // bytes per row
            c.0[48 + t] = TR as u8; // rows
        }
        asm!("ldtilecfg [{c}]", c = in(reg) c.0.as_ptr(), options(nostack, readonly));
    }

    /// The swapped kernel's sums (tmm0, tmm1) to zero.
    ///
    /// # Safety
    /// Tiles configured.
    pub unsafe fn zero_sums() {
        asm!("tilezero tmm0", "tilezero tmm1", options(nostack, nomem));
    }

    /// 16 pair steps of `x`, transposed (`[16][16]` words), into tmm6.
    ///
    /// # Safety
    /// Tiles configured; `xt` holds 256 words.
    pub unsafe fn load_x(xt: *const u32) {
        asm!("tileloadd tmm6, [{p} + {ld}*1]", p = in(reg) xt, ld = in(reg) 64usize, options(nostack, readonly));
    }

    /// Sums `q` (tmm0 or tmm1) += 16 weight rows (64 bytes each, `ld` bytes apart, from `rows`)
    /// times tmm6.
    ///
    /// # Safety
    /// Tiles configured; the 16 rows are readable.
    pub unsafe fn dot_rows(q: usize, rows: *const u8, ld: usize) {
        if q == 0 {
            asm!("tileloadd tmm4, [{p} + {ld}*1]", "tdpbf16ps tmm0, tmm4, tmm6",
                 p = in(reg) rows, ld = in(reg) ld, options(nostack, readonly));
        } else {
            asm!("tileloadd tmm5, [{p} + {ld}*1]", "tdpbf16ps tmm1, tmm5, tmm6",
                 p = in(reg) rows, ld = in(reg) ld, options(nostack, readonly));
        }
    }

    /// tmm0 and tmm1 into `sums` (`[weight row][row of x]`).
    ///
    /// # Safety
    /// Tiles configured.
    pub unsafe fn store_sums(sums: &mut [[[f32; TR]; NR]; 2]) {
        let (a, b) = (sums[0].as_mut_ptr(), sums[1].as_mut_ptr());
        asm!("tilestored [{a} + {ld}*1], tmm0", "tilestored [{b} + {ld}*1], tmm1",
             a = in(reg) a, b = in(reg) b, ld = in(reg) 64usize, options(nostack));
    }

    /// # Safety
    /// As for [`configure`].
    pub unsafe fn release() {
        asm!("tilerelease", options(nostack, nomem));
    }

    /// One kernel call's operands: row tiles of `x` (16 × 16 words, contiguous by step; the second
    /// row tile `tile_words` after the first), and two tiles of the weight per step, `icp` pair
    /// steps: 16 words of each pair step, the steps `w_row` words apart, the second tile `w_next`
    /// words after the first (packed panels: 16 and `icp · 16`).
    pub struct Operands {
        pub x: *const u32,
        pub tile_words: usize,
        pub w: *const u32,
        pub w_row: usize,
        pub w_next: usize,
        pub icp: usize,
    }

    /// The sums `c` (32 rows of 32, `ldc` bytes apart; only `tiles` of the 2 × 2 tiles used),
    /// from zero when `fresh`, += the products of the operands' `tiles.0` row tiles and `tiles.1`
    /// panels.
    ///
    /// # Safety
    /// Tiles configured; the operands hold `tiles.0` row tiles of `icp / 16` steps and `tiles.1`
    /// panels; `c` the 2 × 2 tiles' rows, readable and writable.
    pub unsafe fn kernel(o: &Operands, tiles: (usize, usize), c: *mut f32, ldc: usize, fresh: bool) {
        let Operands {
            x,
            tile_words,
            w,
            w_row,
            w_next,
            icp,
        } = *o;
        let (ldx, ldw) = (TS * 4, w_row * 4);
        let (c01, c10) = (c.add(NR), c.byte_add(TR * ldc));
        let c11 = c10.add(NR);
        if fresh {
            asm!(
                "tilezero tmm0",
                "tilezero tmm1",
                "tilezero tmm2",
                "tilezero tmm3",
                options(nostack, nomem)
            );
        } else {
            asm!("tileloadd tmm0, [{c} + {ld}*1]", "tileloadd tmm1, [{c01} + {ld}*1]",
                 "tileloadd tmm2, [{c10} + {ld}*1]", "tileloadd tmm3, [{c11} + {ld}*1]",
                 c = in(reg) c, c01 = in(reg) c01, c10 = in(reg) c10, c11 = in(reg) c11, ld = in(reg) ldc,
                 options(nostack, readonly));
        }
        for s in (0..icp).step_by(TS) {
            // The second row tile and panel are only read when `tiles` has them.
            let (x0, x1) = (x.add(s * TR), x.wrapping_add(tile_words + s * TR));
            let (w0, w1) = (w.add(s * w_row), w.wrapping_add(w_next + s * w_row));
            match tiles {
                // Each load just before the first product that needs it: the tiles are not
                // renamed, so a load waits for the products still reading its tile.
                (2, 2) => asm!(
                    "tileloadd tmm4, [{x0} + {ldx}*1]", "tileloadd tmm6, [{w0} + {ldw}*1]",
                    "tdpbf16ps tmm0, tmm4, tmm6",
                    "tileloadd tmm7, [{w1} + {ldw}*1]", "tdpbf16ps tmm1, tmm4, tmm7",
                    "tileloadd tmm5, [{x1} + {ldx}*1]", "tdpbf16ps tmm2, tmm5, tmm6",
                    "tdpbf16ps tmm3, tmm5, tmm7",
                    x0 = in(reg) x0, x1 = in(reg) x1, w0 = in(reg) w0, w1 = in(reg) w1,
                    ldx = in(reg) ldx, ldw = in(reg) ldw, options(nostack, readonly)),
                (2, _) => asm!(
                    "tileloadd tmm4, [{x0} + {ldx}*1]", "tileloadd tmm5, [{x1} + {ldx}*1]",
                    "tileloadd tmm6, [{w0} + {ldw}*1]",
                    "tdpbf16ps tmm0, tmm4, tmm6", "tdpbf16ps tmm2, tmm5, tmm6",
                    x0 = in(reg) x0, x1 = in(reg) x1, w0 = in(reg) w0,
                    ldx = in(reg) ldx, ldw = in(reg) ldw, options(nostack, readonly)),
                (_, 2) => asm!(
                    "tileloadd tmm4, [{x0} + {ldx}*1]",
                    "tileloadd tmm6, [{w0} + {ldw}*1]", "tileloadd tmm7, [{w1} + {ldw}*1]",
                    "tdpbf16ps tmm0, tmm4, tmm6", "tdpbf16ps tmm1, tmm4, tmm7",
                    x0 = in(reg) x0, w0 = in(reg) w0, w1 = in(reg) w1,
                    ldx = in(reg) ldx, ldw = in(reg) ldw, options(nostack, readonly)),
                _ => asm!(
                    "tileloadd tmm4, [{x0} + {ldx}*1]", "tileloadd tmm6, [{w0} + {ldw}*1]",
                    "tdpbf16ps tmm0, tmm4, tmm6",
                    x0 = in(reg) x0, w0 = in(reg) w0,
                    ldx = in(reg) ldx, ldw = in(reg) ldw, options(nostack, readonly)),
            }
        }
        asm!("tilestored [{c} + {ld}*1], tmm0", "tilestored [{c01} + {ld}*1], tmm1",
             "tilestored [{c10} + {ld}*1], tmm2", "tilestored [{c11} + {ld}*1], tmm3",
             c = in(reg) c, c01 = in(reg) c01, c10 = in(reg) c10, c11 = in(reg) c11, ld = in(reg) ldc,
             options(nostack));
    }
}
