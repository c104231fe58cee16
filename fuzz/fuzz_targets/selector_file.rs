//! A CausalCache selector (marginal scorer) safetensors file of arbitrary bytes: `MarginalScorer::load`
//! accepts it or names the file and what is wrong, never panics.
#![no_main]
use libfuzzer_sys::fuzz_target;
use recall::memory::selector::MarginalScorer;

fuzz_target!(|data: &[u8]| {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("selector.safetensors");
    std::fs::write(&path, data).unwrap();
    let _ = MarginalScorer::load(&path);
});
