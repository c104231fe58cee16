//! A `tokenizer.json` of arbitrary bytes: loading refuses it cleanly; a loaded one encodes and decodes.
//!
//! The tokenizers crate (0.21) panics on some malformed files (`expect("Helper")` in its decoder
//! deserialisation); `Tokenizer::from_file` catches that and returns an error. libFuzzer's panic hook
//! aborts on every panic, caught or not, so this target lets panics raised inside the tokenizers crate
//! unwind to recall's `catch_unwind`; a panic anywhere else still aborts and is reported.
#![no_main]
use std::sync::Once;

use libfuzzer_sys::fuzz_target;
use recall::tokenize::Tokenizer;

fn let_tokenizers_panics_unwind() {
    static HOOK: Once = Once::new();
    HOOK.call_once(|| {
        let abort = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let in_tokenizers = info.location().is_some_and(|l| l.file().contains("/tokenizers-"));
            if !in_tokenizers {
                abort(info);
            }
        }));
    });
}

fuzz_target!(|data: &[u8]| {
    let_tokenizers_panics_unwind();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tokenizer.json");
    std::fs::write(&path, data).unwrap();
    if let Ok(tok) = Tokenizer::from_file(&path) {
        if let Ok(ids) = tok.encode("Click the <tool_call> button. 你好") {
            let _ = tok.decode(&ids);
        }
    }
});
