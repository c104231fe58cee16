//! The Qwen tokenizer (the bundled 151,643-token vocabulary) in recall and in the `tokenizers`
//! crate that Hugging Face's Python package wraps, side by side: loading `tokenizer.json`, and
//! encoding a long English and a long Chinese-and-code text.
//!
//! Both keep a cache of the words they have encoded (at most 10,000, each under 256 bytes), which
//! every iteration after the first hits: the encode figures are those of warm caches.

use std::path::Path;

use criterion::{criterion_group, criterion_main, Criterion};
use recall::tokenize::Tokenizer;

fn file() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("models/qwen-vl-tokenizer/tokenizer.json")
}

/// About 20 KB of the repository's own prose (Markdown, code spans, tables).
const ENGLISH: &str = concat!(include_str!("../README.md"), include_str!("../docs/TOKENIZER.md"));

/// Chinese prose mixed with JSON and Python, repeated to about 10 KB.
fn chinese_and_code() -> String {
    let unit = "在手机屏幕上点击“设置”按钮，然后向下滑动找到“显示”选项。\n\
                {\"action\": \"click\", \"coordinate\": [540, 1210], \"text\": \"设置\"}\n\
                def step(obs):\n    return agent.act(obs, history=历史[-5:])  # 只保留最近五步\n";
    unit.repeat(10_000 / unit.len() + 1)
}

fn bench(c: &mut Criterion) {
    let path = file();
    let mut g = c.benchmark_group("tokenizer_load");
    g.sample_size(10);
    g.bench_function("recall", |b| b.iter(|| Tokenizer::from_file(&path).unwrap()));
    g.bench_function("tokenizers_crate", |b| {
        b.iter(|| tokenizers::Tokenizer::from_file(&path).unwrap())
    });
    g.finish();

    let ours = Tokenizer::from_file(&path).unwrap();
    let theirs = tokenizers::Tokenizer::from_file(&path).unwrap();
    let mixed = chinese_and_code();
    let mut g = c.benchmark_group("tokenizer_encode");
    for (name, text) in [("english_20k", ENGLISH), ("chinese_code_10k", mixed.as_str())] {
        assert_eq!(
            ours.encode(text).unwrap(),
            theirs.encode_fast(text, false).unwrap().get_ids(),
            "{name}"
        );
        g.bench_function(format!("{name}/recall"), |b| {
            b.iter(|| ours.encode(std::hint::black_box(text)).unwrap())
        });
        g.bench_function(format!("{name}/tokenizers_crate"), |b| {
            b.iter(|| theirs.encode_fast(std::hint::black_box(text), false).unwrap())
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
