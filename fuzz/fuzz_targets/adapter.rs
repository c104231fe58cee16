//! An HGKV adapter (PEFT directory) for the tiny fixture model: the first byte picks which file is
//! fuzzed — even: `adapter_config.json` beside the real `adapter_model.safetensors`; odd: the
//! safetensors beside the real config. `Adapter::load` accepts it or names the file and field.
#![no_main]
use std::path::Path;
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use recall::backend::cpu::CpuBackend;
use recall::model::hgkv::Adapter;
use recall::model::ModelConfig;

fn fixtures() -> &'static Path {
    static P: OnceLock<std::path::PathBuf> = OnceLock::new();
    P.get_or_init(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures"))
}

fuzz_target!(|data: &[u8]| {
    let Some((&pick, rest)) = data.split_first() else { return };
    let cfg = ModelConfig::from_dir(&fixtures().join("tiny-qwen3-vl")).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let peft = fixtures().join("hgkv-peft");
    let (config, weights) = if pick % 2 == 0 {
        (rest.to_vec(), std::fs::read(peft.join("adapter_model.safetensors")).unwrap())
    } else {
        (std::fs::read(peft.join("adapter_config.json")).unwrap(), rest.to_vec())
    };
    std::fs::write(dir.path().join("adapter_config.json"), config).unwrap();
    std::fs::write(dir.path().join("adapter_model.safetensors"), weights).unwrap();
    let _ = Adapter::load(&CpuBackend, dir.path(), &cfg.text);
});
