//! Model output parsed as an action, on both platforms: `parse_response` accepts it or says why,
//! never panics.
#![no_main]
use libfuzzer_sys::fuzz_target;
use recall::agent::action::{parse_response, Platform};

fuzz_target!(|text: &str| {
    for platform in [Platform::Mobile, Platform::Desktop] {
        let _ = parse_response(text, platform);
    }
});
