//! Image bytes (PNG, JPEG, WebP, ...): decoding refuses bad or oversized images before allocating.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = recall::vision::decode_image_bytes(data, "fuzz");
});
