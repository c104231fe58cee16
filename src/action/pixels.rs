//! Grid → pixel conversion conventions.

/// How a grid coordinate becomes a pixel (protocol section 6).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Convention {
    /// CausalCache MobileWorld: `round(v / 999 * (W - 1))` (Python `round`, ties to even). The default.
    #[default]
    MobileWorld,
    /// CausalCache AndroidWorld: `(2 * v * (W - 1) + 999) // 1998`.
    CausalCacheAndroidWorld,
    /// Upstream AndroidWorld (`qwen-vl` source format): `int(v / 999 * W)`.
    UpstreamAndroidWorld,
    /// Upstream `mobile_use` / `computer_use` scripts: `int(v / 1000 * W)`, `W` the smart-resized size.
    UpstreamResized,
}

/// The pixel of grid value `v` along an axis of `size` pixels (width for x, height for y).
///
/// ```
/// use recall::action::{to_pixels, Convention};
/// assert_eq!(to_pixels(999, 1080, Convention::MobileWorld), 1079);
/// assert_eq!(to_pixels(500, 1080, Convention::MobileWorld), 540);
/// assert_eq!(to_pixels(500, 1080, Convention::CausalCacheAndroidWorld), 540);
/// assert_eq!(to_pixels(500, 1080, Convention::UpstreamAndroidWorld), 540);
/// assert_eq!(to_pixels(500, 1092, Convention::UpstreamResized), 546);
/// ```
pub fn to_pixels(v: u32, size: u32, convention: Convention) -> u32 {
    let (v64, w) = (f64::from(v), f64::from(size));
    match convention {
        Convention::MobileWorld => (v64 / 999.0 * (w - 1.0)).round_ties_even().max(0.0) as u32,
        Convention::CausalCacheAndroidWorld => {
            let num = 2 * u64::from(v) * u64::from(size.saturating_sub(1)) + 999;
            (num / 1998) as u32
        }
        Convention::UpstreamAndroidWorld => (v64 / 999.0 * w).trunc() as u32,
        Convention::UpstreamResized => (v64 / 1000.0 * w).trunc() as u32,
    }
}
