//! Any text through the real Qwen tokenizer: encoding never fails, and decoding gives a fixed point
//! of the tokenizer's normalisation (decode(encode(t)) = t for t = decode(encode(s))).
#![no_main]
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use recall::tokenize::Tokenizer;

fn tokenizer() -> &'static Tokenizer {
    static T: OnceLock<Tokenizer> = OnceLock::new();
    T.get_or_init(|| {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/qwen-vl-tokenizer");
        Tokenizer::from_model_dir(&dir).unwrap()
    })
}

fuzz_target!(|text: &str| {
    let tok = tokenizer();
    let round = |s: &str| tok.decode(&tok.encode(s).unwrap()).unwrap();
    let t = round(text);
    assert_eq!(round(&t), t);
    if text.is_ascii() {
        assert_eq!(t, text);
    }
    let ids = tok.encode(text).unwrap();
    let _ = tok.decode_text(&ids);
});
