//! A CausalCache label file (JSONL): `read_labels` accepts or names the file, line and field.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("labels.jsonl");
    std::fs::write(&path, data).unwrap();
    let _ = recall::agent::labels::read_labels(&[path], false);
});
