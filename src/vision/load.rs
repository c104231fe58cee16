//! Image sources and decoding: a path, a `file://` URL or a `data:image/...;base64,` URL to an 8-bit RGB
//! image, converted the way HF's torchvision backend decodes a path
//! (`torchvision.io.decode_image(path, mode=RGB, apply_exif_orientation=True)`).

use std::fmt;
use std::io::Cursor;
use std::path::PathBuf;

use base64::Engine as _;
use image::{DynamicImage, ImageDecoder, ImageFormat, ImageReader, RgbImage};

use crate::error::{Error, Result};

/// Where an image comes from.
///
/// ```
/// use recall::vision::ImageSource;
///
/// assert!(matches!(ImageSource::parse("shots/a.png").unwrap(), ImageSource::Path(_)));
/// assert!(matches!(ImageSource::parse("file:///tmp/a.png").unwrap(), ImageSource::Path(_)));
/// assert!(matches!(ImageSource::parse("data:image/png;base64,iVBORw0KGgo=").unwrap(), ImageSource::Bytes { .. }));
/// let err = ImageSource::parse("https://example.com/a.png").unwrap_err().to_string();
/// assert!(err.contains("not fetched"));
/// ```
#[derive(Debug, Clone, PartialEq)]
pub enum ImageSource {
    /// A local file.
    Path(PathBuf),
    /// Encoded bytes already in memory (e.g. from a `data:` URL); `name` is used in error messages.
    Bytes { name: String, data: Vec<u8> },
}

impl fmt::Display for ImageSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ImageSource::Path(p) => write!(f, "{}", p.display()),
            ImageSource::Bytes { name, .. } => f.write_str(name),
        }
    }
}

impl ImageSource {
    /// Parse an image reference as a chat request carries it: a local path, a `file://` URL or a
    /// `data:` URL with a base64 payload (`data:image/png;base64,…`; the media type may be any
    /// `image/…`, bare `image` or empty, as vLLM accepts: the bytes say what the image is).
    /// `http(s)://` URLs are refused: recall has no network access at run time. A string that is
    /// bare base64 (no `data:` prefix) is refused with a message saying to add the prefix. Error
    /// messages quote at most [`crate::limits::ECHO_BYTES`] bytes of `s`.
    ///
    /// ```
    /// use recall::vision::ImageSource;
    /// assert!(ImageSource::parse("data:image;base64,iVBORw0KGgo=").is_ok());
    /// let bare = "iVBORw0KGgoAAAANSUhEUgAA".repeat(20);
    /// let err = ImageSource::parse(&bare).unwrap_err().to_string();
    /// assert!(err.contains("data:image/png;base64,") && err.len() < 300, "{err}");
    /// ```
    pub fn parse(s: &str) -> Result<Self> {
        let t = s.trim();
        let quoted = crate::limits::excerpt(t);
        let lower = t.get(..t.len().min(16)).unwrap_or("").to_ascii_lowercase();
        if lower.starts_with("http://") || lower.starts_with("https://") {
            return Err(Error::InvalidRequest(format!(
                "remote image URL {quoted} is not fetched (recall has no network access at run time); \
                 pass a local path, a file:// URL or a data:image/...;base64 URL"
            )));
        }
        if lower.starts_with("data:") {
            return Self::parse_data_url(t);
        }
        if lower.starts_with("file://") {
            let rest = &t[7..];
            let rest = rest.strip_prefix("localhost").unwrap_or(rest);
            if !rest.starts_with('/') {
                return Err(Error::InvalidRequest(format!(
                    "file URL {quoted} must be absolute (file:///path/to/image.png)"
                )));
            }
            return Ok(ImageSource::Path(PathBuf::from(percent_decode(rest, &quoted)?)));
        }
        if let Some(i) = t.find("://") {
            if t[..i]
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "+-.".contains(c))
                && i > 1
            {
                return Err(Error::InvalidRequest(format!(
                    "image URL {quoted} has unsupported scheme {} (supported: local paths, file://, data:)",
                    crate::limits::excerpt(&t[..i])
                )));
            }
        }
        if t.is_empty() {
            return Err(Error::InvalidRequest("empty image reference".into()));
        }
        if looks_like_bare_base64(t) {
            return Err(Error::InvalidRequest(format!(
                "the image URL {quoted} is base64 without a data: prefix; send it as \
                 `data:image/png;base64,<payload>` (or image/jpeg, image/webp)"
            )));
        }
        Ok(ImageSource::Path(PathBuf::from(t)))
    }

    fn parse_data_url(url: &str) -> Result<Self> {
        let short = crate::limits::excerpt(url);
        let bad = |m: &str| Err(Error::InvalidRequest(format!("malformed data URL {short}: {m}")));
        let Some((header, payload)) = url.split_once(',') else {
            return bad("no ',' separating the header from the payload");
        };
        let media = header[5..].to_ascii_lowercase();
        let mut parts = media.split(';');
        let mime = parts.next().unwrap_or("");
        let image_like = mime.is_empty()
            || mime == "image"
            || mime.starts_with("image/")
            || mime == "application/octet-stream";
        if !image_like {
            return bad(&format!(
                "media type {} is not an image type",
                crate::limits::excerpt(mime)
            ));
        }
        if !parts.any(|p| p == "base64") {
            return bad("only ;base64 data URLs are supported");
        }
        let cleaned: String = payload.chars().filter(|c| !c.is_ascii_whitespace()).collect();
        let data = match base64::engine::general_purpose::STANDARD.decode(cleaned.as_bytes()) {
            Ok(d) => d,
            Err(e) => return bad(&format!("invalid base64 payload: {e}")),
        };
        let mime = if mime.is_empty() { "image" } else { mime };
        Ok(ImageSource::Bytes {
            name: format!("data URL ({mime}, {} bytes)", data.len()),
            data,
        })
    }

    /// Read and decode the image into 8-bit RGB.
    ///
    /// ```no_run
    /// let img = recall::vision::ImageSource::parse("screenshot.png")?.load()?;
    /// println!("{}x{}", img.width(), img.height());
    /// # Ok::<(), recall::Error>(())
    /// ```
    pub fn load(&self) -> Result<RgbImage> {
        match self {
            ImageSource::Path(p) => {
                let data = crate::limits::read_capped_bytes(p, crate::limits::MAX_IMAGE_FILE_BYTES)?;
                decode_image_bytes(&data, &p.display().to_string())
            }
            ImageSource::Bytes { name, data } => decode_image_bytes(data, name),
        }
    }
}

/// Whether `s` is an image's base64 with the `data:` prefix left out: long, only the base64 alphabet
/// (no `.` of a file name), and starting like an encoded PNG, JPEG, WebP or GIF — or simply too long to
/// be a path.
fn looks_like_bare_base64(s: &str) -> bool {
    let alphabet = s
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b == b'+' || b == b'/' || b == b'=');
    let magic = ["iVBORw0KGgo", "/9j/", "UklGR", "R0lGOD"]
        .iter()
        .any(|m| s.starts_with(m));
    alphabet && s.len() >= 64 && (magic || s.len() > 4096)
}

/// `s` with its %-escapes decoded; errors quote `whole` (already shortened).
fn percent_decode(s: &str, whole: &str) -> Result<String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = s.get(i + 1..i + 3).and_then(|h| u8::from_str_radix(h, 16).ok());
            let Some(v) = hex else {
                return Err(Error::InvalidRequest(format!(
                    "file URL {whole} has a bad %-escape"
                )));
            };
            out.push(v);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| Error::InvalidRequest(format!("file URL {whole} is not valid UTF-8")))
}

/// Identify the container from its magic bytes: `Ok(format)` for the supported ones, an error naming the
/// format otherwise.
fn sniff(data: &[u8], name: &str) -> Result<ImageFormat> {
    const SUPPORTED: &str = "supported: PNG, JPEG, WebP";
    if data.is_empty() {
        return Err(Error::InvalidRequest(format!(
            "{name}: empty file (0 bytes), not an image"
        )));
    }
    if data.starts_with(b"\x89PNG\r\n\x1a\n") {
        return Ok(ImageFormat::Png);
    }
    if data.starts_with(&[0xFF, 0xD8, 0xFF]) {
        return Ok(ImageFormat::Jpeg);
    }
    if data.len() >= 12 && &data[..4] == b"RIFF" && &data[8..12] == b"WEBP" {
        return Ok(ImageFormat::WebP);
    }
    let other = if data.starts_with(b"GIF87a") || data.starts_with(b"GIF89a") {
        Some("GIF")
    } else if data.starts_with(b"BM") {
        Some("BMP")
    } else if data.starts_with(b"II*\0") || data.starts_with(b"MM\0*") {
        Some("TIFF")
    } else if data.starts_with(&[0, 0, 1, 0]) {
        Some("ICO")
    } else if data.starts_with(b"qoif") {
        Some("QOI")
    } else if data.len() >= 12 && &data[4..8] == b"ftyp" {
        Some("AVIF/HEIF")
    } else {
        None
    };
    Err(Error::InvalidRequest(match other {
        Some(fmt) => format!("{name}: unsupported image format {fmt} ({SUPPORTED})"),
        None => format!("{name}: unrecognised image format ({SUPPORTED})"),
    }))
}

/// Decode PNG / JPEG / WebP bytes into 8-bit RGB; `name` (a path or URL) is used in error messages.
///
/// Conversion matches torchvision's `decode_image(mode=RGB)`: gray is replicated to three channels, alpha is
/// dropped (not composited), palettes are expanded, the EXIF orientation is applied. 16-bit samples keep
/// their high byte (as PIL's `RGB;16B` unpacking does).
///
/// ```
/// let err = recall::vision::decode_image_bytes(b"GIF89a....", "x.gif").unwrap_err().to_string();
/// assert!(err.contains("GIF") && err.contains("PNG, JPEG, WebP"));
/// ```
pub fn decode_image_bytes(data: &[u8], name: &str) -> Result<RgbImage> {
    decode_image_limited(data, name, DEFAULT_MAX_PIXELS)
}

/// The default cap on an image's pixels: PIL's decompression-bomb limit (twice
/// `PIL.Image.MAX_IMAGE_PIXELS`); see [`crate::limits::MAX_IMAGE_PIXELS`].
pub const DEFAULT_MAX_PIXELS: u64 = crate::limits::MAX_IMAGE_PIXELS;

/// Like [`decode_image_bytes`], but refuses an image of more than `max_pixels` pixels after reading
/// only its header: a small file that declares huge dimensions (a decompression bomb) is rejected
/// before anything is allocated for its pixels.
///
/// ```
/// // A PNG header claiming 20000x20000 pixels, and nothing else.
/// let mut png = b"\x89PNG\r\n\x1a\n\0\0\0\x0dIHDR".to_vec();
/// png.extend(20000u32.to_be_bytes());
/// png.extend(20000u32.to_be_bytes());
/// png.extend([8, 2, 0, 0, 0]);
/// png.extend(crc32(&png[12..]).to_be_bytes());
/// # fn crc32(b: &[u8]) -> u32 { let mut c = !0u32; for &x in b { c ^= x as u32; for _ in 0..8 { c = if c & 1 != 0 { 0xEDB88320 ^ (c >> 1) } else { c >> 1 }; } } !c }
/// let err = recall::vision::decode_image_limited(&png, "bomb.png", 50_000_000).unwrap_err().to_string();
/// assert!(err.contains("20000x20000"), "{err}");
/// ```
pub fn decode_image_limited(data: &[u8], name: &str, max_pixels: u64) -> Result<RgbImage> {
    let format = sniff(data, name)?;
    if let Some((w, h)) = header_dimensions(data, format) {
        if u64::from(w) * u64::from(h) > max_pixels {
            return Err(Error::InvalidRequest(format!(
                "{name}: image of {w}x{h} pixels exceeds the limit of {max_pixels} pixels"
            )));
        }
    }
    let corrupt =
        |e: image::ImageError| Error::InvalidRequest(format!("{name}: cannot decode {format:?} image: {e}"));
    let mut decoder = ImageReader::with_format(Cursor::new(data), format)
        .into_decoder()
        .map_err(corrupt)?;
    let (w, h) = decoder.dimensions();
    if w == 0 || h == 0 {
        return Err(Error::InvalidRequest(format!(
            "{name}: zero-size image ({w}x{h})"
        )));
    }
    if u64::from(w) * u64::from(h) > max_pixels {
        return Err(Error::InvalidRequest(format!(
            "{name}: image of {w}x{h} pixels exceeds the limit of {max_pixels} pixels"
        )));
    }
    let mut limits = image::Limits::default();
    // Room for the decoded pixels at up to 16 bits and 4 channels, and nothing more.
    limits.max_alloc = Some(u64::from(w) * u64::from(h) * 8 + (1 << 20));
    decoder.set_limits(limits).map_err(corrupt)?;
    let orientation = decoder
        .orientation()
        .unwrap_or(image::metadata::Orientation::NoTransforms);
    let mut img = DynamicImage::from_decoder(decoder).map_err(corrupt)?;
    img.apply_orientation(orientation);
    if img.width() == 0 || img.height() == 0 {
        return Err(Error::InvalidRequest(format!(
            "{name}: zero-size image ({}x{})",
            img.width(),
            img.height()
        )));
    }
    Ok(to_rgb8(img))
}

/// The width and height a PNG, JPEG or WebP file declares, read from its first bytes (`None` when
/// the header is cut short or unusual; the decoder then checks again).
fn header_dimensions(data: &[u8], format: ImageFormat) -> Option<(u32, u32)> {
    let be32 = |i: usize| Some(u32::from_be_bytes(data.get(i..i + 4)?.try_into().ok()?));
    let be16 = |i: usize| Some(u16::from_be_bytes(data.get(i..i + 2)?.try_into().ok()?) as u32);
    let le16 = |i: usize| Some(u16::from_le_bytes(data.get(i..i + 2)?.try_into().ok()?) as u32);
    let le24 = |i: usize| {
        let b = data.get(i..i + 3)?;
        Some(u32::from(b[0]) | u32::from(b[1]) << 8 | u32::from(b[2]) << 16)
    };
    match format {
        ImageFormat::Png if data.get(12..16) == Some(b"IHDR") => Some((be32(16)?, be32(20)?)),
        ImageFormat::Jpeg => {
            // Walk the marker segments to the first start-of-frame.
            let mut i = 2;
            while i + 9 < data.len() {
                if data[i] != 0xFF {
                    return None;
                }
                let marker = data[i + 1];
                let is_sof = (0xC0..=0xCF).contains(&marker) && !matches!(marker, 0xC4 | 0xC8 | 0xCC);
                if is_sof {
                    return Some((be16(i + 7)?, be16(i + 5)?));
                }
                i += 2 + be16(i + 2)? as usize;
            }
            None
        }
        ImageFormat::WebP => match data.get(12..16)? {
            b"VP8 " => Some((le16(26)? & 0x3FFF, le16(28)? & 0x3FFF)),
            b"VP8L" => {
                let bits = u32::from_le_bytes(data.get(21..25)?.try_into().ok()?);
                Some(((bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1))
            }
            b"VP8X" => Some((le24(24)? + 1, le24(27)? + 1)),
            _ => None,
        },
        _ => None,
    }
}

/// Any color type to RGB8: drop alpha, replicate gray, 16-bit -> high byte, float -> clamp(round(255 v)).
fn to_rgb8(img: DynamicImage) -> RgbImage {
    let (w, h) = (img.width(), img.height());
    match img {
        DynamicImage::ImageRgb8(i) => i,
        DynamicImage::ImageRgba8(i) => RgbImage::from_fn(w, h, |x, y| {
            let p = i.get_pixel(x, y).0;
            image::Rgb([p[0], p[1], p[2]])
        }),
        DynamicImage::ImageLuma8(i) => {
            RgbImage::from_fn(w, h, |x, y| image::Rgb([i.get_pixel(x, y).0[0]; 3]))
        }
        DynamicImage::ImageLumaA8(i) => {
            RgbImage::from_fn(w, h, |x, y| image::Rgb([i.get_pixel(x, y).0[0]; 3]))
        }
        DynamicImage::ImageLuma16(i) => {
            RgbImage::from_fn(w, h, |x, y| image::Rgb([(i.get_pixel(x, y).0[0] >> 8) as u8; 3]))
        }
        DynamicImage::ImageLumaA16(i) => {
            RgbImage::from_fn(w, h, |x, y| image::Rgb([(i.get_pixel(x, y).0[0] >> 8) as u8; 3]))
        }
        DynamicImage::ImageRgb16(i) => RgbImage::from_fn(w, h, |x, y| {
            let p = i.get_pixel(x, y).0;
            image::Rgb([(p[0] >> 8) as u8, (p[1] >> 8) as u8, (p[2] >> 8) as u8])
        }),
        DynamicImage::ImageRgba16(i) => RgbImage::from_fn(w, h, |x, y| {
            let p = i.get_pixel(x, y).0;
            image::Rgb([(p[0] >> 8) as u8, (p[1] >> 8) as u8, (p[2] >> 8) as u8])
        }),
        other => {
            // f32 variants (not produced by the PNG/JPEG/WebP decoders): clamp(round(255 v)), alpha dropped.
            let f = other.into_rgb32f();
            RgbImage::from_fn(w, h, |x, y| {
                let p = f.get_pixel(x, y).0;
                image::Rgb(p.map(|v| (v * 255.0).round().clamp(0.0, 255.0) as u8))
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_dimensions_match_the_decoded_images() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
        for name in [
            "images/photo_96x64.jpg",
            "images/exif_rot6_48x32.jpg",
            "images/lossless_80x60.webp",
            "images/lossy_80x60.webp",
            "images/rgba_64x48.png",
            "vl-images/portrait.jpg",
            "vl-images/square.webp",
        ] {
            let data = std::fs::read(dir.join(name)).unwrap();
            let format = sniff(&data, name).unwrap();
            let declared = header_dimensions(&data, format).unwrap_or_else(|| panic!("{name}"));
            let decoded = ImageReader::with_format(Cursor::new(&data), format)
                .into_dimensions()
                .unwrap();
            assert_eq!(declared, decoded, "{name}");
        }
    }
}
