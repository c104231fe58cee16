//! A chat request's `messages` JSON: `parse_messages` accepts or names the field, never panics.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|text: &str| {
    let _ = recall::tokenize::chat::parse_messages(text, std::path::Path::new("messages.json"));
});
