//! An OpenAI chat completion request body: `parse_chat_request` answers with an `ApiError` naming the
//! parameter, never panics.
#![no_main]
use libfuzzer_sys::fuzz_target;
use recall::server::openai::{parse_chat_request, SamplingDefaults};

fuzz_target!(|text: &str| {
    let Ok(serde_json::Value::Object(obj)) = serde_json::from_str(text) else { return };
    let defaults = SamplingDefaults::from_model_dir(std::path::Path::new("/nonexistent"));
    let _ = parse_chat_request(&obj, &defaults, "recall");
});
