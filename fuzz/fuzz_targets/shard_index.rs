//! A `model.safetensors.index.json` of arbitrary bytes beside one real shard: `Checkpoint::open` must
//! refuse anything malformed, or pointing outside the directory, without panicking.
#![no_main]
use libfuzzer_sys::fuzz_target;
use recall::model::Checkpoint;

/// A valid one-tensor shard (`w`, f32 `[2]`).
fn shard() -> Vec<u8> {
    let header = br#"{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#;
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(header);
    out.extend_from_slice(&[0u8; 8]);
    out
}

fuzz_target!(|data: &[u8]| {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("model-00001-of-00001.safetensors"), shard()).unwrap();
    std::fs::write(dir.path().join("model.safetensors.index.json"), data).unwrap();
    let _ = Checkpoint::open(dir.path());
});
