//! A safetensors file of arbitrary bytes: `Checkpoint::open_file` and every tensor it accepts read
//! back (shape checks, offsets, dtype conversion) must not panic or read outside the file.
#![no_main]
use libfuzzer_sys::fuzz_target;
use recall::model::Checkpoint;

fuzz_target!(|data: &[u8]| {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.safetensors");
    std::fs::write(&path, data).unwrap();
    if let Ok(ckpt) = Checkpoint::open_file(&path) {
        for name in ckpt.names() {
            let t = ckpt.get(name).unwrap();
            if t.numel() <= 1 << 16 {
                let _ = t.to_f32();
            }
        }
    }
});
