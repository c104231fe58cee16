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

/// What every run shares, read once: the fixture model's config and the real adapter's two files.
struct Fixture {
    cfg: ModelConfig,
    config: Vec<u8>,
    weights: Vec<u8>,
}

fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| {
        let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures");
        let peft = fixtures.join("hgkv-peft");
        Fixture {
            cfg: ModelConfig::from_dir(&fixtures.join("tiny-qwen3-vl")).unwrap(),
            config: std::fs::read(peft.join("adapter_config.json")).unwrap(),
            weights: std::fs::read(peft.join("adapter_model.safetensors")).unwrap(),
        }
    })
}

fuzz_target!(|data: &[u8]| {
    let Some((&pick, rest)) = data.split_first() else { return };
    let f = fixture();
    let dir = tempfile::tempdir().unwrap();
    let (config, weights) = if pick % 2 == 0 { (rest, &f.weights[..]) } else { (&f.config[..], rest) };
    std::fs::write(dir.path().join("adapter_config.json"), config).unwrap();
    std::fs::write(dir.path().join("adapter_model.safetensors"), weights).unwrap();
    let _ = Adapter::load(&CpuBackend, dir.path(), &f.cfg.text);
});
