//! Wide registers for the CPU backend's loops without giving up a bit of determinism.
//!
//! [`multiversion!`] compiles one function body several times — for AVX-512F, for AVX2 and for the
//! baseline — and picks the widest the CPU has at run time. The body is ordinary scalar Rust; the
//! compiler vectorises it where it can. Every element still goes through the same IEEE operations
//! in the same order (Rust never reassociates or contracts floating-point arithmetic), so all
//! versions give the same bits: the width only changes how many elements are done at once.
//!
//! [`exp`] is a polynomial `exp` made of such operations only, so that it vectorises too (the
//! platform's `expf` is a call per element) and gives the same bits everywhere.

/// Defines `fn NAME(args) -> ret` whose body is compiled for AVX-512F, AVX2 and the baseline, and
/// dispatched at run time (see the module docs for why the results are identical).
macro_rules! multiversion {
    ($(#[$meta:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? $body:block) => {
        $(#[$meta])*
        $vis fn $name($($arg: $ty),*) $(-> $ret)? {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f")]
                unsafe fn avx512($($arg: $ty),*) $(-> $ret)? $body
                #[target_feature(enable = "avx2")]
                unsafe fn avx2($($arg: $ty),*) $(-> $ret)? $body
                if std::arch::is_x86_feature_detected!("avx512f") {
                    // SAFETY: the CPU has AVX-512F.
                    return unsafe { avx512($($arg),*) };
                }
                if std::arch::is_x86_feature_detected!("avx2") {
                    // SAFETY: the CPU has AVX2.
                    return unsafe { avx2($($arg),*) };
                }
            }
            #[inline(always)]
            fn baseline($($arg: $ty),*) $(-> $ret)? $body
            baseline($($arg),*)
        }
    };
}
pub(super) use multiversion;

/// Lanes of the dot-product accumulator: fixed, so that the order of additions never depends on
/// the machine or the batch.
const LANES: usize = 16;

/// `Σ a[i]·b[i]` (`a` and `b` of equal length): 16 partial sums, lane `l` adding the products of
/// elements `l, l + 16, l + 32, ...` in order (each product rounded, then added), then combined
/// pairwise (`s[l] += s[l + 8]`, then `+4`, `+2`, `+1`). The AVX-512 and AVX2 versions do exactly
/// these operations, 16 or 8 lanes at a time.
#[inline(always)]
pub(super) fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let n = a.len().min(b.len());
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512F; both slices hold `n` elements.
            return unsafe { x86::dot_avx512(a.as_ptr(), b.as_ptr(), n) };
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2; both slices hold `n` elements.
            return unsafe { x86::dot_avx2(a.as_ptr(), b.as_ptr(), n) };
        }
    }
    dot_scalar(&a[..n], &b[..n])
}

/// `out[r][c] = dot(q[r], k[c])` for 4 rows and 4 keys (all of one length), each exactly [`dot`]:
/// the 16 sums run side by side, and their pairwise combinations are done 16 at a time (the same
/// additions, lanes moved between registers).
#[inline(always)]
pub(super) fn dot_4x4(q: [&[f32]; 4], k: [&[f32]; 4]) -> [[f32; 4]; 4] {
    let n = q[0].len();
    debug_assert!(q.iter().chain(&k).all(|r| r.len() == n));
    #[cfg(target_arch = "x86_64")]
    {
        if q.iter().chain(&k).all(|r| r.len() >= n) && std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512F; every slice holds at least `n` elements.
            return unsafe { x86::dot_4x4_avx512(q.map(<[f32]>::as_ptr), k.map(<[f32]>::as_ptr), n) };
        }
    }
    q.map(|qr| k.map(|kc| dot(&qr[..n], &kc[..n])))
}

/// `o[r] += p[r·ldp + j] · v_j` elementwise for every key `j < visible[r]`, in key order, for each row
/// `r` of `o` (rows of `d`); `v_j` is `d` floats at `v[keys[j] · ldv + col..]`. Each step is a
/// rounded product, then a rounded sum, as `*o += p * v` — whatever the width of the registers.
///
/// # Panics
/// When a key's row does not fit in `v`.
#[allow(clippy::too_many_arguments)]
pub(super) fn pv_accumulate(
    o: &mut [f32],
    d: usize,
    p: &[f32],
    ldp: usize,
    visible: &[usize],
    v: &[f32],
    ldv: usize,
    keys: &[usize],
    col: usize,
) {
    let n = visible.iter().copied().max().unwrap_or(0);
    assert!(
        keys[..n].iter().all(|&k| k * ldv + col + d <= v.len()),
        "key rows out of range"
    );
    assert!(o.len() >= visible.len() * d && p.len() >= (visible.len().max(1) - 1) * ldp + n);
    #[cfg(target_arch = "x86_64")]
    {
        if d.is_multiple_of(16) && d <= 128 && std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512F; the bounds were checked above.
            unsafe { x86::pv_avx512(o, d, p, ldp, visible, v.as_ptr(), ldv, keys, col) };
            return;
        }
    }
    for (r, &vis) in visible.iter().enumerate() {
        let orow = &mut o[r * d..(r + 1) * d];
        for (j, &key) in keys[..vis].iter().enumerate() {
            let pj = p[r * ldp + j];
            let vj = &v[key * ldv + col..key * ldv + col + d];
            orow.iter_mut().zip(vj).for_each(|(o, v)| *o += pj * v);
        }
    }
}

/// [`dot`]'s definition, one lane at a time.
fn dot_scalar(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; LANES];
    let (ca, cb) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for l in 0..LANES {
            acc[l] += x[l] * y[l];
        }
    }
    for (l, (x, y)) in ra.iter().zip(rb).enumerate() {
        acc[l] += x * y;
    }
    let mut width = LANES;
    while width > 1 {
        width /= 2;
        for l in 0..width {
            acc[l] += acc[l + width];
        }
    }
    acc[0]
}

#[cfg(target_arch = "x86_64")]
#[allow(clippy::needless_range_loop)] // register tiles read best as indexed loops
mod x86 {
    use std::arch::x86_64::*;

    /// `s[l] += s[l + 4]`, `+2`, `+1` on the 4 lanes of `v`; lane 0.
    #[inline(always)]
    unsafe fn tree4(v: __m128) -> f32 {
        let v = _mm_add_ps(v, _mm_movehl_ps(v, v)); // l += l + 2
        let v = _mm_add_ss(v, _mm_shuffle_ps(v, v, 0b01)); // 0 += 1
        _mm_cvtss_f32(v)
    }

    /// # Safety
    /// AVX-512F; `a` and `b` point to `n` floats.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn dot_avx512(a: *const f32, b: *const f32, n: usize) -> f32 {
        let mut acc = _mm512_setzero_ps();
        let full = n / 16 * 16;
        let mut i = 0;
        while i < full {
            acc = _mm512_add_ps(
                acc,
                _mm512_mul_ps(_mm512_loadu_ps(a.add(i)), _mm512_loadu_ps(b.add(i))),
            );
            i += 16;
        }
        if full < n {
            let m: __mmask16 = (1u32 << (n - full)) as u16 - 1;
            let prod = _mm512_mul_ps(
                _mm512_maskz_loadu_ps(m, a.add(full)),
                _mm512_maskz_loadu_ps(m, b.add(full)),
            );
            acc = _mm512_mask_add_ps(acc, m, acc, prod);
        }
        tree16(acc)
    }

    /// # Safety
    /// AVX-512F; every `q[r]` and `k[c]` point to `n` floats.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn dot_4x4_avx512(q: [*const f32; 4], k: [*const f32; 4], n: usize) -> [[f32; 4]; 4] {
        // acc[4r + c]: lane l sums q[r][i]·k[c][i] over i ≡ l (mod 16), in order.
        let mut acc = [_mm512_setzero_ps(); 16];
        let full = n / 16 * 16;
        let mut i = 0;
        while i < full {
            let kv = k.map(|p| _mm512_loadu_ps(p.add(i)));
            for r in 0..4 {
                let qv = _mm512_loadu_ps(q[r].add(i));
                for c in 0..4 {
                    acc[4 * r + c] = _mm512_add_ps(acc[4 * r + c], _mm512_mul_ps(qv, kv[c]));
                }
            }
            i += 16;
        }
        if full < n {
            let m: __mmask16 = (1u32 << (n - full)) as u16 - 1;
            let kv = k.map(|p| _mm512_maskz_loadu_ps(m, p.add(full)));
            for r in 0..4 {
                let qv = _mm512_maskz_loadu_ps(m, q[r].add(full));
                for c in 0..4 {
                    let prod = _mm512_mul_ps(qv, kv[c]);
                    acc[4 * r + c] = _mm512_mask_add_ps(acc[4 * r + c], m, acc[4 * r + c], prod);
                }
            }
        }
        let sums = tree16x16(acc);
        let mut out = [0f32; 16];
        _mm512_storeu_ps(out.as_mut_ptr(), sums);
        [0, 1, 2, 3].map(|r| [0, 1, 2, 3].map(|c| out[4 * r + c]))
    }

    /// Lane `d` of the result is [`tree16`] of `acc[d]`: the same additions (`l += l + 8`, `+4`,
    /// `+2`, `+1`) done for 16 accumulators at once, pairing lanes of two registers with permutes.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn tree16x16(acc: [__m512; 16]) -> __m512 {
        // Lane index vectors: `pick(f)` takes lane f(i) of the pair (a, b) into lane i (16 + j is b[j]).
        let pick = |f: fn(i32) -> i32| {
            let idx: [i32; 16] = std::array::from_fn(|i| f(i as i32));
            _mm512_loadu_si512(idx.as_ptr().cast())
        };
        let step = |a: __m512, b: __m512, lo: __m512i, hi: __m512i| {
            _mm512_add_ps(_mm512_permutex2var_ps(a, lo, b), _mm512_permutex2var_ps(a, hi, b))
        };
        // Width 8: lanes 0..8 of each pair's halves.
        let (lo, hi) = (pick(|i| (i / 8) * 16 + i % 8), pick(|i| (i / 8) * 16 + i % 8 + 8));
        let s: [__m512; 8] = std::array::from_fn(|m| step(acc[2 * m], acc[2 * m + 1], lo, hi));
        // Width 4: groups of 4 lanes at 0 and 8 of each register.
        let (lo, hi) = (
            pick(|i| (i / 8) * 16 + (i % 8 / 4) * 8 + i % 4),
            pick(|i| (i / 8) * 16 + (i % 8 / 4) * 8 + i % 4 + 4),
        );
        let t: [__m512; 4] = std::array::from_fn(|m| step(s[2 * m], s[2 * m + 1], lo, hi));
        // Width 2: pairs of lanes at 0 of each group of 4.
        let (lo, hi) = (
            pick(|i| (i / 8) * 16 + (i % 8 / 2) * 4 + i % 2),
            pick(|i| (i / 8) * 16 + (i % 8 / 2) * 4 + i % 2 + 2),
        );
        let u: [__m512; 2] = std::array::from_fn(|m| step(t[2 * m], t[2 * m + 1], lo, hi));
        // Width 1: even and odd lanes.
        let (lo, hi) = (
            pick(|i| (i / 8) * 16 + (i % 8) * 2),
            pick(|i| (i / 8) * 16 + (i % 8) * 2 + 1),
        );
        step(u[0], u[1], lo, hi)
    }

    /// The pairwise combination of 16 lanes: `l += l + 8`, `+4`, `+2`, `+1`.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn tree16(acc: __m512) -> f32 {
        let lo = _mm512_castps512_ps256(acc);
        let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc), 1));
        let v8 = _mm256_add_ps(lo, hi);
        let v4 = _mm_add_ps(_mm256_castps256_ps128(v8), _mm256_extractf128_ps(v8, 1));
        tree4(v4)
    }

    /// # Safety
    /// AVX-512F; `d` is a multiple of 16 up to 128; the caller checked every bound.
    #[target_feature(enable = "avx512f")]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn pv_avx512(
        o: &mut [f32],
        d: usize,
        p: &[f32],
        ldp: usize,
        visible: &[usize],
        v: *const f32,
        ldv: usize,
        keys: &[usize],
        col: usize,
    ) {
        macro_rules! rows {
            ($c:literal) => {{
                let mut r = 0;
                while r + 1 < visible.len() {
                    pv_rows::<$c, 2>(o, p, ldp, &visible[r..r + 2], v, ldv, keys, col, r);
                    r += 2;
                }
                if r < visible.len() {
                    pv_rows::<$c, 1>(o, p, ldp, &visible[r..r + 1], v, ldv, keys, col, r);
                }
            }};
        }
        match d / 16 {
            1 => rows!(1),
            2 => rows!(2),
            3 => rows!(3),
            4 => rows!(4),
            5 => rows!(5),
            6 => rows!(6),
            7 => rows!(7),
            _ => rows!(8),
        }
    }

    /// `R` rows of `C` 16-float chunks, their accumulators held in registers over the keys.
    #[inline]
    #[target_feature(enable = "avx512f")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn pv_rows<const C: usize, const R: usize>(
        o: &mut [f32],
        p: &[f32],
        ldp: usize,
        visible: &[usize],
        v: *const f32,
        ldv: usize,
        keys: &[usize],
        col: usize,
        r0: usize,
    ) {
        let d = C * 16;
        let mut acc = [[_mm512_setzero_ps(); C]; R];
        for r in 0..R {
            for c in 0..C {
                acc[r][c] = _mm512_loadu_ps(o.as_ptr().add((r0 + r) * d + 16 * c));
            }
        }
        let common = visible.iter().copied().min().unwrap_or(0);
        let most = visible.iter().copied().max().unwrap_or(0);
        for (j, &key) in keys[..most].iter().enumerate() {
            let vj = v.add(key * ldv + col);
            let mut w = [_mm512_setzero_ps(); C];
            for c in 0..C {
                w[c] = _mm512_loadu_ps(vj.add(16 * c));
            }
            for r in 0..R {
                if j >= common && j >= visible[r] {
                    continue;
                }
                let pj = _mm512_set1_ps(*p.get_unchecked((r0 + r) * ldp + j));
                for c in 0..C {
                    acc[r][c] = _mm512_add_ps(acc[r][c], _mm512_mul_ps(pj, w[c]));
                }
            }
        }
        for r in 0..R {
            for c in 0..C {
                _mm512_storeu_ps(o.as_mut_ptr().add((r0 + r) * d + 16 * c), acc[r][c]);
            }
        }
    }

    /// # Safety
    /// AVX2; `a` and `b` point to `n` floats.
    #[target_feature(enable = "avx2")]
    pub unsafe fn dot_avx2(a: *const f32, b: *const f32, n: usize) -> f32 {
        let (mut lo, mut hi) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        let full = n / 16 * 16;
        let mut i = 0;
        while i < full {
            lo = _mm256_add_ps(
                lo,
                _mm256_mul_ps(_mm256_loadu_ps(a.add(i)), _mm256_loadu_ps(b.add(i))),
            );
            hi = _mm256_add_ps(
                hi,
                _mm256_mul_ps(_mm256_loadu_ps(a.add(i + 8)), _mm256_loadu_ps(b.add(i + 8))),
            );
            i += 16;
        }
        let rest = n - full;
        if rest > 0 {
            // Lanes past the end stay as they are (a masked add, not an add of 0.0).
            let lanes = |base: usize| {
                let idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
                _mm256_cmpgt_epi32(_mm256_set1_epi32(rest as i32 - base as i32), idx)
            };
            let (mlo, mhi) = (lanes(0), lanes(8));
            let plo = _mm256_mul_ps(
                _mm256_maskload_ps(a.add(full), mlo),
                _mm256_maskload_ps(b.add(full), mlo),
            );
            lo = _mm256_blendv_ps(lo, _mm256_add_ps(lo, plo), _mm256_castsi256_ps(mlo));
            if rest > 8 {
                let phi = _mm256_mul_ps(
                    _mm256_maskload_ps(a.add(full + 8), mhi),
                    _mm256_maskload_ps(b.add(full + 8), mhi),
                );
                hi = _mm256_blendv_ps(hi, _mm256_add_ps(hi, phi), _mm256_castsi256_ps(mhi));
            }
        }
        let v8 = _mm256_add_ps(lo, hi); // l += l + 8
        let v4 = _mm_add_ps(_mm256_castps256_ps128(v8), _mm256_extractf128_ps(v8, 1)); // l += l + 4
        tree4(v4)
    }
}

/// `e^x` to within about 1 ulp (Cephes' `expf`: `x = n·ln 2 + r`, a degree-5 polynomial in `r`,
/// scaled by `2^n`); 0 below -87.3 (no subnormal results), `inf` above 88 (where `e^x` would be
/// within a factor 2 of `f32::MAX`), NaN for NaN.
#[inline(always)]
pub(super) fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let xc = x.clamp(-87.3, 88.0);
    let n = (xc * LOG2E + 0.5).floor();
    let r = xc - n * LN2_HI - n * LN2_LO;
    let z = r * r;
    let mut p = 1.987_569_1e-4;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5; // Cephes: 5.0000001201e-1, which is 0.5 in f32
    let y = p * z + r + 1.0;
    let scale = f32::from_bits(((n as i32 + 127) as u32) << 23);
    let e = y * scale;
    if x < -87.3 {
        0.0
    } else if x > 88.0 {
        f32::INFINITY
    } else if x.is_nan() {
        x
    } else {
        e
    }
}

#[cfg(test)]
mod tests {
    use super::{dot, dot_4x4, dot_scalar, exp};

    #[test]
    fn dot_is_its_definition_on_every_path_and_length() {
        let mut rng = fastrand::Rng::with_seed(9);
        for n in (0..70).chain([128, 1000, 1001]) {
            let a: Vec<f32> = (0..n).map(|_| rng.f32() * 2.0 - 1.0).collect();
            let b: Vec<f32> = (0..n).map(|_| rng.f32() * 2.0 - 1.0).collect();
            let want = dot_scalar(&a, &b).to_bits();
            assert_eq!(dot(&a, &b).to_bits(), want, "n = {n}");
            let scaled = |x: &[f32], s: f32| x.iter().map(|v| v * s).collect::<Vec<f32>>();
            let q: Vec<Vec<f32>> = (0..4).map(|r| scaled(&a, r as f32 + 0.5)).collect();
            let k: Vec<Vec<f32>> = (0..4).map(|c| scaled(&b, 1.25 - c as f32)).collect();
            let grid = dot_4x4([&q[0], &q[1], &q[2], &q[3]], [&k[0], &k[1], &k[2], &k[3]]);
            for (r, row) in grid.iter().enumerate() {
                for (c, got) in row.iter().enumerate() {
                    let want = dot_scalar(&q[r], &k[c]).to_bits();
                    assert_eq!(got.to_bits(), want, "dot_4x4 [{r}][{c}], n = {n}");
                }
            }
            #[cfg(target_arch = "x86_64")]
            {
                if std::arch::is_x86_feature_detected!("avx512f") {
                    // SAFETY: checked above; the slices hold n floats.
                    let got = unsafe { super::x86::dot_avx512(a.as_ptr(), b.as_ptr(), n) };
                    assert_eq!(got.to_bits(), want, "avx512, n = {n}");
                }
                if std::arch::is_x86_feature_detected!("avx2") {
                    // SAFETY: checked above.
                    let got = unsafe { super::x86::dot_avx2(a.as_ptr(), b.as_ptr(), n) };
                    assert_eq!(got.to_bits(), want, "avx2, n = {n}");
                }
            }
        }
    }

    #[test]
    fn pv_accumulate_is_the_scalar_loop_bitwise() {
        let mut rng = fastrand::Rng::with_seed(4);
        for d in [16, 64, 80, 128, 72] {
            let (rows, keys_n, ldv) = (5, 37, d + 24);
            let v: Vec<f32> = (0..keys_n * ldv).map(|_| rng.f32() - 0.5).collect();
            let keys: Vec<usize> = (0..keys_n).rev().collect();
            let p: Vec<f32> = (0..rows * keys_n).map(|_| rng.f32()).collect();
            let visible = [3, 37, 20, 21, 1];
            let start: Vec<f32> = (0..rows * d).map(|_| rng.f32()).collect();
            let mut fast = start.clone();
            super::pv_accumulate(&mut fast, d, &p, keys_n, &visible, &v, ldv, &keys, 7);
            let mut want = start.clone();
            for (r, &vis) in visible.iter().enumerate() {
                for j in 0..vis {
                    for c in 0..d {
                        want[r * d + c] += p[r * keys_n + j] * v[keys[j] * ldv + 7 + c];
                    }
                }
            }
            let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&fast), bits(&want), "d = {d}");
        }
    }

    #[test]
    fn exp_is_within_an_ulp_or_two_and_handles_the_edges() {
        let mut worst = 0f64;
        for i in -870_000..=880_000 {
            let x = i as f32 * 1e-4;
            let (got, want) = (exp(x) as f64, (x as f64).exp());
            worst = worst.max(((got - want) / want).abs());
        }
        assert!(worst < 2.5e-7, "max relative error {worst}");
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(-100.0), 0.0);
        assert_eq!(exp(100.0), f32::INFINITY);
        assert!(exp(f32::NAN).is_nan());
        assert_eq!(exp(0.0), 1.0);
    }

    multiversion! {
        fn exps(xs: &mut [f32]) {
            xs.iter_mut().for_each(|x| *x = exp(*x));
        }
    }

    #[test]
    fn every_version_gives_the_same_bits() {
        let xs: Vec<f32> = (0..4096).map(|i| (i as f32 - 2048.0) * 0.0437).collect();
        let mut wide = xs.clone();
        exps(&mut wide);
        let scalar: Vec<f32> = xs.iter().map(|&x| exp(x)).collect();
        assert_eq!(
            wide.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            scalar.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        );
    }
}
