//! `episode.json` text: `Episode::from_json` accepts or names the field, never panics. It is read as
//! the episode of tests/fixtures/episode-sample, so that its screenshots exist.
#![no_main]
use libfuzzer_sys::fuzz_target;
use recall::memory::episode::Episode;

fuzz_target!(|text: &str| {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/episode-sample");
    let _ = Episode::from_json(text, &dir);
});
