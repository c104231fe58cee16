//! A direct way into [`tokenizers::Tokenizer`] for a byte-level BPE `tokenizer.json`.
//!
//! The `tokenizers` crate reads a model through two untyped copies: the whole model object is
//! buffered, turned into a `serde_json::Value` (a map of 151,643 vocabulary entries, keyed by
//! string), then deserialized again into the BPE. On the Qwen vocabulary that took most of the
//! tokenizer's load, and the load is on the critical path of every one-shot request.
//!
//! [`parse`] reads the same fields straight into the vocabulary map and merge list, builds the BPE
//! with the crate's own builder and the same options, and assembles the tokenizer with the crate's
//! own builder, normaliser, pre-tokenizer, post-processor and decoder types, then adds the added
//! tokens as the crate's loader does. It declines (returns `None`) on anything it does not read
//! exactly as the crate would: another model type, truncation or padding set, an unknown version,
//! merges it cannot split, an added token whose id comes out different. The caller then loads
//! through the crate, which also gives the error messages for malformed files.
//!
//! The tests below check that both ways give the same tokenizer, serialized field by field, and
//! the same ids, for every `tokenizer.json` in the repository and for merges written as pairs.
//! On the Qwen vocabulary the load takes 113-120 ms here against about 175 ms through the crate
//! (docs/PERFORMANCE.md, 2026-12-06 night).

use std::fmt;

use serde::de::{self, Deserializer, IgnoredAny, SeqAccess, Visitor};
use serde::Deserialize;
use tokenizers::models::bpe::BPE;
use tokenizers::{
    AddedToken, DecoderWrapper, ModelWrapper, NormalizerWrapper, PostProcessorWrapper, PreTokenizerWrapper,
    TokenizerBuilder,
};

/// The top level of `tokenizer.json`, as far as [`parse`] reads it; other keys are ignored, as the
/// crate ignores them.
#[derive(Deserialize)]
struct TokenizerFile {
    version: Option<String>,
    /// `Some` when set (not `null`).
    truncation: Option<IgnoredAny>,
    padding: Option<IgnoredAny>,
    #[serde(default)]
    added_tokens: Vec<AddedTokenWithId>,
    normalizer: Option<NormalizerWrapper>,
    pre_tokenizer: Option<PreTokenizerWrapper>,
    post_processor: Option<PostProcessorWrapper>,
    decoder: Option<DecoderWrapper>,
    model: BpeFile,
}

/// An added token and the id the file gives it.
#[derive(Deserialize)]
struct AddedTokenWithId {
    id: u32,
    #[serde(flatten)]
    token: AddedToken,
}

/// The `model` object of a BPE tokenizer: the fields the crate's BPE reader takes.
#[derive(Deserialize)]
struct BpeFile {
    #[serde(rename = "type")]
    kind: Option<String>,
    dropout: Option<f32>,
    unk_token: Option<String>,
    continuing_subword_prefix: Option<String>,
    end_of_word_suffix: Option<String>,
    fuse_unk: Option<bool>,
    byte_fallback: Option<bool>,
    ignore_merges: Option<bool>,
    vocab: ahash::AHashMap<String, u32>,
    merges: Vec<Merge>,
}

/// The merges as the BPE builder takes them, from pairs (`[["Ġ", "t"], ...]`, newer files) or lines
/// (`["Ġ t", ...]`, older ones); `None` for a list the crate would not read this way (the two forms
/// mixed, a line that does not split in two).
fn merge_pairs(merges: Vec<Merge>) -> Option<Vec<(String, String)>> {
    let mut pairs = Vec::with_capacity(merges.len());
    let mut form = None;
    for merge in merges {
        let (pair, line) = match merge {
            Merge::Pair(a, b) => ((a, b), false),
            Merge::Line(l) => {
                // As the crate: `#version` lines are skipped, the rest split at each space into
                // exactly two parts.
                if l.starts_with("#version") {
                    continue;
                }
                let mut parts = l.split(' ');
                match (parts.next(), parts.next(), parts.next()) {
                    (Some(a), Some(b), None) => ((a.to_owned(), b.to_owned()), true),
                    _ => return None,
                }
            }
        };
        if *form.get_or_insert(line) != line {
            return None;
        }
        pairs.push(pair);
    }
    Some(pairs)
}

/// One merge, in either form, read as it comes (an untagged enum would buffer each one first).
enum Merge {
    Pair(String, String),
    Line(String),
}

impl<'de> Deserialize<'de> for Merge {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(MergeVisitor)
    }
}

struct MergeVisitor;

impl<'de> Visitor<'de> for MergeVisitor {
    type Value = Merge;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a merge: two strings, or one with a space")
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Merge, E> {
        Ok(Merge::Line(v.to_owned()))
    }

    fn visit_string<E: de::Error>(self, v: String) -> Result<Merge, E> {
        Ok(Merge::Line(v))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Merge, A::Error> {
        let a: String = seq
            .next_element()?
            .ok_or_else(|| de::Error::invalid_length(0, &self))?;
        let b: String = seq
            .next_element()?
            .ok_or_else(|| de::Error::invalid_length(1, &self))?;
        if seq.next_element::<de::IgnoredAny>()?.is_some() {
            return Err(de::Error::invalid_length(3, &self));
        }
        Ok(Merge::Pair(a, b))
    }
}

/// The tokenizer in `bytes`, when it is a BPE tokenizer [`parse`] reads exactly as the crate does;
/// `None` otherwise (including when the file is malformed: the crate's loader then says how).
pub(super) fn parse(bytes: &[u8]) -> Option<tokenizers::Tokenizer> {
    let file: TokenizerFile = serde_json::from_slice(bytes).ok()?;
    if file.version.as_deref().is_some_and(|v| v != "1.0")
        || file.truncation.is_some()
        || file.padding.is_some()
    {
        return None;
    }
    let model = file.model;
    if model.kind.as_deref() != Some("BPE") {
        return None;
    }
    let mut bpe = BPE::builder().vocab_and_merges(model.vocab, merge_pairs(model.merges)?);
    if let Some(p) = model.dropout {
        bpe = bpe.dropout(p);
    }
    if let Some(unk) = model.unk_token {
        bpe = bpe.unk_token(unk);
    }
    if let Some(prefix) = model.continuing_subword_prefix {
        bpe = bpe.continuing_subword_prefix(prefix);
    }
    if let Some(suffix) = model.end_of_word_suffix {
        bpe = bpe.end_of_word_suffix(suffix);
    }
    if let Some(fuse) = model.fuse_unk {
        bpe = bpe.fuse_unk(fuse);
    }
    if let Some(fallback) = model.byte_fallback {
        bpe = bpe.byte_fallback(fallback);
    }
    if let Some(ignore) = model.ignore_merges {
        bpe = bpe.ignore_merges(ignore);
    }
    let mut tokenizer = TokenizerBuilder::<
        ModelWrapper,
        NormalizerWrapper,
        PreTokenizerWrapper,
        PostProcessorWrapper,
        DecoderWrapper,
    >::new()
    .with_model(ModelWrapper::BPE(bpe.build().ok()?))
    .with_normalizer(file.normalizer)
    .with_pre_tokenizer(file.pre_tokenizer)
    .with_post_processor(file.post_processor)
    .with_decoder(file.decoder)
    .build()
    .ok()?;
    let added: Vec<AddedToken> = file.added_tokens.iter().map(|t| t.token.clone()).collect();
    tokenizer.add_tokens(&added);
    // The crate keeps the ids the model and the order of addition give, and only warns when they
    // differ from the file's; decline such a file, so that it loads (and warns) the crate's way.
    let ids_hold = file
        .added_tokens
        .iter()
        .all(|t| tokenizer.token_to_id(&t.token.content) == Some(t.id));
    ids_hold.then(|| tokenizers::Tokenizer::from(tokenizer))
}

#[cfg(test)]
mod tests {
    use std::path::{Path, PathBuf};

    use super::parse;

    /// Every `tokenizer.json` in the repository: the bundled Qwen vocabulary and the fixtures'.
    fn files() -> Vec<PathBuf> {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let mut files = vec![root.join("models/qwen-vl-tokenizer/tokenizer.json")];
        for entry in std::fs::read_dir(root.join("tests/fixtures")).unwrap() {
            let path = entry.unwrap().path().join("tokenizer.json");
            if path.exists() {
                files.push(path);
            }
        }
        assert!(files.len() >= 3, "{files:?}");
        files
    }

    const TEXTS: [&str; 4] = [
        "<|im_start|>user\nHello, world! 12345 <|image_pad|><|im_end|>",
        "  café naïve 東京 — \t\n\n  <tool_call>{\"x\": 1}</tool_call>",
        "",
        "don't  stop'll 'RE \u{1F600}",
    ];

    /// `bytes` read by [`parse`] and by the crate give the same tokenizer: every field serialized
    /// alike, and the same ids for [`TEXTS`].
    fn same_as_the_crate(bytes: &[u8], what: &str) {
        let ours = parse(bytes).unwrap_or_else(|| panic!("{what}: the direct reader declined"));
        let theirs = tokenizers::Tokenizer::from_bytes(bytes).unwrap();
        assert_eq!(
            ours.to_string(false).unwrap(),
            theirs.to_string(false).unwrap(),
            "{what}"
        );
        for text in TEXTS {
            let ids = |t: &tokenizers::Tokenizer| t.encode_fast(text, false).unwrap().get_ids().to_vec();
            assert_eq!(ids(&ours), ids(&theirs), "{what}: {text:?}");
        }
    }

    #[test]
    fn reads_every_tokenizer_in_the_repository_as_the_crate_does() {
        for path in files() {
            same_as_the_crate(&std::fs::read(&path).unwrap(), &path.display().to_string());
        }
    }

    /// The tiny fixture's tokenizer as JSON, to edit.
    fn tiny() -> serde_json::Value {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-tokenizer/tokenizer.json");
        serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
    }

    #[test]
    fn reads_merges_as_pairs_as_the_crate_does() {
        let mut json = tiny();
        let merges = json["model"]["merges"].as_array_mut().unwrap();
        for m in merges.iter_mut() {
            let line = m.as_str().unwrap().to_owned();
            let (a, b) = line.split_once(' ').unwrap();
            *m = serde_json::json!([a, b]);
        }
        same_as_the_crate(&serde_json::to_vec(&json).unwrap(), "pair merges");
    }

    #[test]
    fn declines_what_it_does_not_read_as_the_crate_does() {
        type Edit = fn(&mut serde_json::Value);
        let edits: [(&str, Edit); 6] = [
            ("padding set", |j| {
                j["padding"] = serde_json::json!({"strategy": "BatchLongest", "direction": "Right",
                    "pad_to_multiple_of": null, "pad_id": 0, "pad_type_id": 0, "pad_token": "!"})
            }),
            ("another version", |j| j["version"] = "2.0".into()),
            ("another model", |j| j["model"]["type"] = "WordPiece".into()),
            ("an added token's id moved", |j| {
                let id = j["added_tokens"][0]["id"].as_u64().unwrap();
                j["added_tokens"][0]["id"] = (id + 7).into();
            }),
            ("mixed merges", |j| {
                j["model"]["merges"][0] = serde_json::json!(["a", "b"])
            }),
            ("a merge of three parts", |j| {
                j["model"]["merges"][0] = "a b c".into()
            }),
        ];
        for (what, edit) in edits {
            let mut json = tiny();
            edit(&mut json);
            assert!(parse(&serde_json::to_vec(&json).unwrap()).is_none(), "{what}");
        }
    }
}
