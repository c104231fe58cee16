//! `config.json` text: `ModelConfig::from_json` accepts or names the bad field, never panics.
#![no_main]
use libfuzzer_sys::fuzz_target;
use recall::model::ModelConfig;

fuzz_target!(|text: &str| {
    let _ = ModelConfig::from_json(text, std::path::Path::new("config.json"));
});
