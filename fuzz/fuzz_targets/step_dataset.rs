//! A step-level dataset (JSONL): `StepDataset::parse` accepts or names the line and field.
#![no_main]
use libfuzzer_sys::fuzz_target;
use recall::agent::dataset::StepDataset;

fuzz_target!(|text: &str| {
    let _ = StepDataset::parse(text, std::path::Path::new("steps.jsonl"), std::path::Path::new("."));
});
