//! Preprocessing a 1920x1080 screenshot (generated in memory) for both Qwen-VL families, at the shipped
//! default pixel budget and at GUI-Owl's `min = max = 2,621,440`.

use criterion::{criterion_group, criterion_main, Criterion};
use recall::vision::{preprocess_image, PreprocessConfig};

fn screenshot() -> image::RgbImage {
    image::RgbImage::from_fn(1920, 1080, |x, y| {
        let band = (y / 40) % 3;
        let text = (x % 7 < 3 && y % 11 < 2) as u8 * 180;
        image::Rgb([
            (x * 255 / 1919) as u8 ^ text,
            (y * 255 / 1079) as u8,
            (band * 90) as u8 + text / 3,
        ])
    })
}

fn bench(c: &mut Criterion) {
    let img = screenshot();
    let mut g = c.benchmark_group("preprocess_1920x1080");
    g.sample_size(10);
    for (name, cfg) in [
        ("qwen3_vl_default", PreprocessConfig::qwen3_vl()),
        (
            "qwen3_vl_gui_owl_2621440",
            PreprocessConfig::qwen3_vl().with_pixels(2_621_440, 2_621_440),
        ),
        ("qwen2_5_vl_default", PreprocessConfig::qwen2_5_vl()),
        (
            "qwen2_5_vl_2621440",
            PreprocessConfig::qwen2_5_vl().with_pixels(2_621_440, 2_621_440),
        ),
    ] {
        g.bench_function(name, |b| {
            b.iter(|| preprocess_image(std::hint::black_box(&img), &cfg).unwrap())
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
