//! Screenshot preprocessing: from an image file to the `pixel_values` a Qwen-VL vision tower consumes.
//!
//! The pipeline reproduces, step for step, what HF transformers 5.24's `Qwen2VLImageProcessor` (the
//! torchvision backend that `AutoImageProcessor` selects for both Qwen3-VL and Qwen2.5-VL checkpoints)
//! does when it is given an image path:
//!
//! 1. [`load`]: decode PNG / JPEG / WebP into an 8-bit RGB image ([`ImageSource`]); alpha is dropped without
//!    compositing, grayscale is replicated, the EXIF orientation is applied (torchvision's
//!    `decode_image(mode=RGB, apply_exif_orientation=True)`).
//! 2. [`smart_resize`]: pick the output size (multiples of `patch_size * merge_size`, pixel count within
//!    `[min_pixels, max_pixels]`, aspect ratio kept).
//! 3. [`resize`]: PyTorch's separable antialiased bicubic (`a = -0.5`) on uint8 with its int16 fixed-point
//!    weights (`torch.nn.functional.interpolate(mode="bicubic", antialias=True)` on a uint8 tensor).
//! 4. [`patchify`]: rescale and normalise fused as `(x - 255·mean) / (255·std)` in f32, repeat the frame
//!    `temporal_patch_size` times, and flatten into `[num_patches, C·T·P·P]` in HF's merge-block order.
//!
//! See `docs/PREPROCESSING.md` for the algorithm and the measured agreement with HF.
//!
//! ```no_run
//! use recall::vision::{preprocess, ImageSource, PreprocessConfig};
//!
//! let cfg = PreprocessConfig::qwen3_vl().with_pixels(2_621_440, 2_621_440);
//! let pv = preprocess(&ImageSource::parse("screenshot.png")?, &cfg)?;
//! println!("grid {:?}, {} patches x {}", pv.grid_thw, pv.num_patches(), pv.patch_dim);
//! # Ok::<(), recall::Error>(())
//! ```

mod config;
mod load;
mod patchify;
mod resize;

pub use config::PreprocessConfig;
pub use load::{decode_image_bytes, decode_image_limited, ImageSource, DEFAULT_MAX_PIXELS};
pub use patchify::patchify;
pub use resize::{resize, smart_resize, ResizeWeights};

use crate::error::{Error, Result};
use image::RgbImage;

/// The vision tower's input for one image.
///
/// ```
/// use recall::vision::{preprocess_image, PreprocessConfig};
///
/// let img = image::RgbImage::from_pixel(100, 60, image::Rgb([10, 20, 30]));
/// let cfg = PreprocessConfig::qwen3_vl().with_pixels(32 * 32 * 4, 32 * 32 * 8);
/// let pv = preprocess_image(&img, &cfg).unwrap();
/// assert_eq!(pv.grid_thw[0], 1);
/// assert_eq!(pv.data.len(), pv.num_patches() * pv.patch_dim);
/// assert_eq!(pv.patch_dim, 3 * 2 * 16 * 16);
/// ```
#[derive(Debug, Clone)]
pub struct PixelValues {
    /// Row-major `[num_patches, patch_dim]`, patches ordered as HF orders them (merge blocks).
    pub data: Vec<f32>,
    /// `[t, h, w]` in patches: `t = 1` for an image, `h = resized_height / patch_size`.
    pub grid_thw: [usize; 3],
    /// `channels * temporal_patch_size * patch_size * patch_size`.
    pub patch_dim: usize,
    /// The resized 8-bit image the patches were cut from (before rescale/normalise).
    pub resized: RgbImage,
}

impl PixelValues {
    /// Number of patches (`t * h * w`), i.e. rows of [`PixelValues::data`].
    pub fn num_patches(&self) -> usize {
        self.grid_thw.iter().product()
    }

    /// Number of merged visual tokens the language model sees for this image
    /// (`num_patches / merge_size²`).
    pub fn num_merged_tokens(&self, merge_size: usize) -> usize {
        self.num_patches() / (merge_size * merge_size)
    }
}

/// Load `source` and preprocess it with `cfg`: decode, [`smart_resize`], [`resize`], [`patchify`].
///
/// Errors name the source (path, `file://` or `data:` URL) and the problem.
///
/// ```no_run
/// use recall::vision::{preprocess, ImageSource, PreprocessConfig};
///
/// let cfg = PreprocessConfig::from_file("models/qwen2.5-vl-7b-instruct/preprocessor_config.json")?;
/// let pv = preprocess(&ImageSource::parse("file:///tmp/screen.png")?, &cfg)?;
/// assert_eq!(pv.patch_dim, 3 * 2 * 14 * 14);
/// # Ok::<(), recall::Error>(())
/// ```
pub fn preprocess(source: &ImageSource, cfg: &PreprocessConfig) -> Result<PixelValues> {
    let img = source.load()?;
    preprocess_image(&img, cfg).map_err(|e| match e {
        Error::InvalidRequest(msg) => Error::InvalidRequest(format!("{source}: {msg}")),
        other => other,
    })
}

/// Preprocess an already decoded RGB image (steps 2–4 of the module docs).
///
/// ```
/// use recall::vision::{preprocess_image, PreprocessConfig};
///
/// let img = image::RgbImage::new(20, 12);
/// let pv = preprocess_image(&img, &PreprocessConfig::qwen2_5_vl()).unwrap();
/// // 20x12 is below min_pixels (3136), so it is upscaled to 56x84 (h x w).
/// assert_eq!(pv.grid_thw, [1, 4, 6]);
/// ```
pub fn preprocess_image(img: &RgbImage, cfg: &PreprocessConfig) -> Result<PixelValues> {
    cfg.validate()?;
    let (w, h) = img.dimensions();
    if w == 0 || h == 0 {
        return Err(Error::InvalidRequest(format!("zero-size image ({w}x{h})")));
    }
    let (rh, rw) = smart_resize(
        h as usize,
        w as usize,
        cfg.factor(),
        cfg.min_pixels,
        cfg.max_pixels,
    )?;
    let resized = resize(img, rw as u32, rh as u32);
    let (data, grid_thw) = patchify(&resized, cfg);
    Ok(PixelValues {
        data,
        grid_thw,
        patch_dim: 3 * cfg.temporal_patch_size * cfg.patch_size * cfg.patch_size,
        resized,
    })
}
