//! A CausalCache policy request body (`causalcache.mobileworld.policy_request.v2`):
//! `parse_policy_request` answers with an `ApiError` naming the field, never panics.
#![no_main]
use libfuzzer_sys::fuzz_target;
use recall::server::policy::parse_policy_request;

fuzz_target!(|text: &str| {
    let Ok(serde_json::Value::Object(obj)) = serde_json::from_str(text) else { return };
    let _ = parse_policy_request(&obj);
});
