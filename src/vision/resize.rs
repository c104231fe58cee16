//! `smart_resize` (HF) and PyTorch's antialiased bicubic resize on uint8.
//!
//! [`resize`] reproduces `torch.nn.functional.interpolate(x_uint8, size, mode="bicubic",
//! align_corners=False, antialias=True)` on CPU (what torchvision's `resize(..., BICUBIC, antialias=True)`
//! runs for a uint8 tensor), i.e. ATen's separable `_upsample_bicubic2d_aa` with the int16 fixed-point
//! weights of `HelperInterpBase::_compute_index_ranges_int16_weights`:
//!
//! * per output index `i`: `center = scale * (i + 0.5)` with `scale = in / out`;
//!   `support = 2 * scale` when downscaling (`scale >= 1`), else `2`; taps `xmin = max(trunc(center -
//!   support + 0.5), 0)` to `min(trunc(center + support + 0.5), in)`; weight of tap `x` is
//!   `keys((x - center + 0.5) * invscale)` (Keys cubic, `a = -0.5`; `invscale = 1 / scale` when
//!   downscaling, else 1), normalised to sum 1 (all in f64);
//! * weights become int16: `precision` is the largest `p < 22` with `round(max_w * 2^(p+1)) < 2^15` (over the
//!   whole axis), each weight `round_half_away(w * 2^p)`;
//! * a pass computes `clamp((2^(p-1) + Σ x·w) >> p, 0, 255)` in integers; the horizontal pass (width) runs
//!   first over every input row and is rounded to uint8, then the vertical pass (height). An axis whose size
//!   does not change is skipped.

use image::RgbImage;
use rayon::prelude::*;

use crate::error::{Error, Result};

/// HF's `smart_resize`: the `(height, width)` closest to the input with both sides multiples of `factor`
/// and `min_pixels <= height * width <= max_pixels` (approximately: the max/min branches rescale by the
/// square root of the pixel ratio, then floor/ceil to `factor`).
///
/// Follows the Python arithmetic exactly: f64 division, `round` half-to-even, `floor`/`ceil`. An absolute
/// aspect ratio above 200 is an error, as in HF.
///
/// ```
/// use recall::vision::smart_resize;
///
/// assert_eq!(smart_resize(1080, 1920, 32, 65_536, 16_777_216).unwrap(), (1088, 1920));
/// assert_eq!(smart_resize(1080, 1920, 32, 2_621_440, 2_621_440).unwrap(), (1216, 2176));
/// assert_eq!(smart_resize(70, 70, 28, 3136, 1_003_520).unwrap(), (56, 56)); // 2.5 rounds to 2
/// assert!(smart_resize(4, 1000, 32, 65_536, 16_777_216).unwrap_err().to_string().contains("250"));
/// ```
pub fn smart_resize(
    height: usize,
    width: usize,
    factor: usize,
    min_pixels: usize,
    max_pixels: usize,
) -> Result<(usize, usize)> {
    if height == 0 || width == 0 || factor == 0 {
        return Err(Error::InvalidRequest(format!(
            "cannot resize a {width}x{height} image with factor {factor}"
        )));
    }
    let (h, w, f) = (height as f64, width as f64, factor as f64);
    let ratio = h.max(w) / h.min(w);
    if ratio > 200.0 {
        return Err(Error::InvalidRequest(format!(
            "absolute aspect ratio must be smaller than 200, got {} (image {width}x{height})",
            py_float(ratio)
        )));
    }
    let mut h_bar = (h / f).round_ties_even() as usize * factor;
    let mut w_bar = (w / f).round_ties_even() as usize * factor;
    if h_bar * w_bar > max_pixels {
        let beta = ((h * w) / max_pixels as f64).sqrt();
        h_bar = factor.max((h / beta / f).floor() as usize * factor);
        w_bar = factor.max((w / beta / f).floor() as usize * factor);
    } else if h_bar * w_bar < min_pixels {
        let beta = (min_pixels as f64 / (h * w)).sqrt();
        h_bar = (h * beta / f).ceil() as usize * factor;
        w_bar = (w * beta / f).ceil() as usize * factor;
    }
    if h_bar == 0 || w_bar == 0 {
        return Err(Error::InvalidRequest(format!(
            "image {width}x{height} resizes to {w_bar}x{h_bar} (min_pixels {min_pixels} too small)"
        )));
    }
    Ok((h_bar, w_bar))
}

/// Format like Python's `repr(float)` for the common cases (`250.0`, `1.5`).
fn py_float(x: f64) -> String {
    if x.fract() == 0.0 && x.abs() < 1e16 {
        format!("{x:.1}")
    } else {
        format!("{x}")
    }
}

/// Precomputed taps and int16 weights for one axis (`in_size` -> `out_size`).
///
/// ```
/// let w = recall::vision::ResizeWeights::new(1920, 960);
/// assert_eq!(w.bounds.len(), 960);
/// assert!(w.precision > 0 && w.precision < 22);
/// ```
#[derive(Debug, Clone)]
pub struct ResizeWeights {
    /// Per output index: first input index and number of taps.
    pub bounds: Vec<(usize, usize)>,
    /// `out_size * stride` int16 weights (tap `j` of output `i` at `i * stride + j`).
    pub weights: Vec<i16>,
    /// Row stride of [`ResizeWeights::weights`] (`ceil(support) * 2 + 1`).
    pub stride: usize,
    /// Fixed-point precision bits.
    pub precision: u32,
}

/// Keys cubic convolution kernel with `a = -0.5` (PyTorch's `aa_filter` for bicubic with antialias, PIL's
/// bicubic).
fn keys_cubic(x: f64) -> f64 {
    const A: f64 = -0.5;
    let x = x.abs();
    if x < 1.0 {
        ((A + 2.0) * x - (A + 3.0)) * x * x + 1.0
    } else if x < 2.0 {
        ((A * x - 5.0 * A) * x + 8.0 * A) * x - 4.0 * A
    } else {
        0.0
    }
}

impl ResizeWeights {
    /// Compute the weights exactly as ATen's `_compute_index_ranges_int16_weights` (antialias = true,
    /// bicubic, align_corners = false, no explicit scale).
    pub fn new(in_size: usize, out_size: usize) -> Self {
        let scale = in_size as f64 / out_size as f64;
        let interp_size = 4.0;
        let support = if scale >= 1.0 {
            (interp_size * 0.5) * scale
        } else {
            interp_size * 0.5
        };
        let stride = support.ceil() as usize * 2 + 1;
        let invscale = if scale >= 1.0 { 1.0 / scale } else { 1.0 };
        let mut wf = vec![0f64; out_size * stride];
        let mut bounds = Vec::with_capacity(out_size);
        let mut wt_max = 0f64;
        for i in 0..out_size {
            let center = scale * (i as f64 + 0.5);
            // static_cast<int64_t> truncates toward zero
            let xmin = ((center - support + 0.5) as i64).max(0);
            let xmax = ((center + support + 0.5) as i64).min(in_size as i64);
            let xsize = (xmax - xmin).clamp(0, stride as i64) as usize;
            let row = &mut wf[i * stride..(i + 1) * stride];
            let mut total = 0f64;
            for (j, w) in row.iter_mut().enumerate().take(xsize) {
                *w = keys_cubic(((j as i64 + xmin) as f64 - center + 0.5) * invscale);
                total += *w;
            }
            if total != 0.0 {
                for w in row.iter_mut().take(xsize) {
                    *w /= total;
                    wt_max = wt_max.max(*w);
                }
            }
            bounds.push((xmin as usize, xsize));
        }
        let mut precision = 0u32;
        while precision < 22 {
            let next = (0.5 + wt_max * (1u64 << (precision + 1)) as f64) as i32;
            if next >= 1 << 15 {
                break;
            }
            precision += 1;
        }
        let mult = (1u64 << precision) as f64;
        let weights = wf
            .iter()
            .map(|&w| {
                let v = w * mult;
                (if v < 0.0 {
                    (-0.5 + v) as i32
                } else {
                    (0.5 + v) as i32
                }) as i16
            })
            .collect();
        Self {
            bounds,
            weights,
            stride,
            precision,
        }
    }
}

#[inline]
fn finish(acc: i32, precision: u32) -> u8 {
    (acc >> precision).clamp(0, 255) as u8
}

/// Resize `img` to `width` x `height` with PyTorch's antialiased bicubic uint8 kernel (see module docs).
///
/// ```
/// let img = image::RgbImage::from_pixel(64, 48, image::Rgb([200, 100, 50]));
/// let out = recall::vision::resize(&img, 32, 32);
/// assert_eq!(out.dimensions(), (32, 32));
/// assert_eq!(out.get_pixel(5, 5).0, [200, 100, 50]); // weights sum to 1: flat stays flat
/// ```
pub fn resize(img: &RgbImage, width: u32, height: u32) -> RgbImage {
    let (in_w, in_h) = (img.width() as usize, img.height() as usize);
    let (out_w, out_h) = (width as usize, height as usize);
    if (in_w, in_h) == (out_w, out_h) || out_w == 0 || out_h == 0 {
        return if (in_w, in_h) == (out_w, out_h) {
            img.clone()
        } else {
            RgbImage::new(width, height)
        };
    }
    // Horizontal pass (the contiguous dimension) first, over every input row.
    let horiz: Vec<u8> = if in_w != out_w {
        let wts = ResizeWeights::new(in_w, out_w);
        let src = img.as_raw();
        let mut out = vec![0u8; in_h * out_w * 3];
        let half = 1i32 << (wts.precision - 1);
        out.par_chunks_mut(out_w * 3).enumerate().for_each(|(y, orow)| {
            let srow = &src[y * in_w * 3..(y + 1) * in_w * 3];
            for (x, opx) in orow.chunks_exact_mut(3).enumerate() {
                let (xmin, xsize) = wts.bounds[x];
                let k = &wts.weights[x * wts.stride..x * wts.stride + xsize];
                let s = &srow[xmin * 3..(xmin + xsize) * 3];
                let (mut r, mut g, mut b) = (half, half, half);
                for (px, &w) in s.chunks_exact(3).zip(k) {
                    let w = w as i32;
                    r += px[0] as i32 * w;
                    g += px[1] as i32 * w;
                    b += px[2] as i32 * w;
                }
                opx[0] = finish(r, wts.precision);
                opx[1] = finish(g, wts.precision);
                opx[2] = finish(b, wts.precision);
            }
        });
        out
    } else {
        img.as_raw().clone()
    };
    if in_h == out_h {
        return RgbImage::from_raw(width, height, horiz).expect("buffer size matches");
    }
    // Vertical pass.
    let wts = ResizeWeights::new(in_h, out_h);
    let row_len = out_w * 3;
    let half = 1i32 << (wts.precision - 1);
    let mut out = vec![0u8; out_h * row_len];
    out.par_chunks_mut(row_len).enumerate().for_each(|(y, orow)| {
        let (ymin, ysize) = wts.bounds[y];
        let k = &wts.weights[y * wts.stride..y * wts.stride + ysize];
        let mut acc = vec![half; row_len];
        for (j, &w) in k.iter().enumerate() {
            let w = w as i32;
            let srow = &horiz[(ymin + j) * row_len..(ymin + j + 1) * row_len];
            for (a, &s) in acc.iter_mut().zip(srow) {
                *a += s as i32 * w;
            }
        }
        for (o, a) in orow.iter_mut().zip(acc) {
            *o = finish(a, wts.precision);
        }
    });
    RgbImage::from_raw(width, height, out).expect("buffer size matches")
}
