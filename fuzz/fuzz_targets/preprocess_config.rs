//! `preprocessor_config.json` text: `PreprocessConfig::from_json_str` never panics.
#![no_main]
use libfuzzer_sys::fuzz_target;
use recall::vision::PreprocessConfig;

fuzz_target!(|text: &str| {
    let _ = PreprocessConfig::from_json_str(text, "preprocessor_config.json");
});
