//! Rescale + normalise + patchify, in HF `Qwen2VLImageProcessor`'s exact order and arithmetic.

use image::RgbImage;

use super::PreprocessConfig;

/// Normalise `img` and cut it into flattened patches.
///
/// Returns `(data, grid_thw)` with `data` row-major `[grid_h * grid_w, 3 * T * P * P]`:
///
/// * value: HF fuses rescale and normalise into `(x - m) / s` in f32 with `m = f32(mean) * 255`,
///   `s = f32(std) * 255` (`255 = 1 / rescale_factor`), which is what this computes;
/// * patch order: merge blocks row-major, then the `merge x merge` patches inside a block row-major
///   (HF's `reshape(C, gh/m, m, P, gw/m, m, P).permute(gh/m, gw/m, m, m, C, P, P)`);
/// * within a patch: channel, temporal (the single frame repeated `T` times), patch row, patch column.
///
/// The image sides must be multiples of `patch_size * merge_size` (what [`super::smart_resize`] returns).
///
/// ```
/// use recall::vision::{patchify, PreprocessConfig};
///
/// let cfg = PreprocessConfig::qwen3_vl();
/// let img = image::RgbImage::from_pixel(64, 32, image::Rgb([255, 0, 128]));
/// let (data, grid) = patchify(&img, &cfg);
/// assert_eq!(grid, [1, 2, 4]);
/// assert_eq!(data.len(), 8 * 3 * 2 * 16 * 16);
/// assert_eq!(data[0], 1.0); // (255 - 127.5) / 127.5
/// assert_eq!(data[2 * 16 * 16], -1.0); // first green value
/// ```
pub fn patchify(img: &RgbImage, cfg: &PreprocessConfig) -> (Vec<f32>, [usize; 3]) {
    let (w, h) = (img.width() as usize, img.height() as usize);
    let (p, m, t) = (cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size);
    assert!(
        w % (p * m) == 0 && h % (p * m) == 0,
        "image {w}x{h} is not a multiple of patch_size * merge_size = {}",
        p * m
    );
    let (gh, gw) = (h / p, w / p);
    let inv = (1.0 / cfg.rescale_factor) as f32;
    let mean: [f32; 3] = cfg.image_mean.map(|x| x * inv);
    let std: [f32; 3] = cfg.image_std.map(|x| x * inv);
    // Normalised lookup table per channel: every uint8 value maps to exactly one f32.
    let mut lut = [[0f32; 256]; 3];
    for (c, table) in lut.iter_mut().enumerate() {
        for (v, o) in table.iter_mut().enumerate() {
            *o = (v as f32 - mean[c]) / std[c];
        }
    }
    let patch_dim = 3 * t * p * p;
    let mut data = vec![0f32; gh * gw * patch_dim];
    let raw = img.as_raw();
    let mut idx = 0usize;
    for bh in 0..gh / m {
        for bw in 0..gw / m {
            for mh in 0..m {
                for mw in 0..m {
                    let (y0, x0) = ((bh * m + mh) * p, (bw * m + mw) * p);
                    let patch = &mut data[idx * patch_dim..(idx + 1) * patch_dim];
                    for c in 0..3 {
                        let frame = &mut patch[c * t * p * p..c * t * p * p + p * p];
                        for py in 0..p {
                            let row = &raw[((y0 + py) * w + x0) * 3..((y0 + py) * w + x0 + p) * 3];
                            for (px, o) in frame[py * p..(py + 1) * p].iter_mut().enumerate() {
                                *o = lut[c][row[px * 3 + c] as usize];
                            }
                        }
                        for k in 1..t {
                            let base = c * t * p * p;
                            patch.copy_within(base..base + p * p, base + k * p * p);
                        }
                    }
                    idx += 1;
                }
            }
        }
    }
    (data, [1, gh, gw])
}
