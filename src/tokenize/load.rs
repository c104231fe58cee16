//! A direct way into a byte-level BPE `tokenizer.json`.
//!
//! The `tokenizers` crate reads a model through two untyped copies: the whole model object is
//! buffered, turned into a `serde_json::Value` (a map of 151,643 vocabulary entries, keyed by
//! string), then deserialized again into the BPE, whose builder copies every string twice more.
//! On the Qwen vocabulary that was most of the tokenizer's load, and the load is on the critical
//! path of every one-shot request.
//!
//! [`parse`] reads the vocabulary straight into the tables of [`Bpe`] (`bpe.rs`) and resolves each
//! merge as it reads it, then assembles the tokenizer with the crate's own builder, normaliser,
//! pre-tokenizer, post-processor and decoder types, and adds the added tokens as the crate's loader
//! does. It declines (returns `None`) on anything it does not read exactly as the crate would:
//! another model type, truncation or padding set, an unknown version, a BPE option `Bpe` does not
//! implement, ids that are not `0..n`, merges it cannot split or resolve, an added token whose id
//! comes out different. The caller then loads through the crate, which also gives the error
//! messages for malformed files.
//!
//! The tests below check that both ways give the same tokenizer (every token and id, the added
//! tokens, encodings and decodings) for every `tokenizer.json` in the repository and for merges
//! written as pairs. See docs/PERFORMANCE.md for the load times.

use std::borrow::Cow;
use std::fmt;
use std::path::Path;

use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;
use tokenizers::{
    AddedToken, DecoderWrapper, NormalizerWrapper, PostProcessorWrapper, PreTokenizerWrapper,
    TokenizerBuilder, TokenizerImpl,
};

use super::bpe::{Bpe, Merges, MergesBuilder, Vocab, VocabBuilder};
use super::cache::{self, Key};

/// A tokenizer read by [`parse`]: the crate's pipeline around [`Bpe`].
pub(super) type Direct =
    TokenizerImpl<Bpe, NormalizerWrapper, PreTokenizerWrapper, PostProcessorWrapper, DecoderWrapper>;

/// The top level of `tokenizer.json`, as far as [`parse`] reads it; other keys are ignored, as the
/// crate ignores them. The model is a [`BpeFile`], or skipped (`IgnoredAny`) when it comes from the
/// cache.
#[derive(Deserialize)]
struct TokenizerFile<M> {
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
    model: M,
}

/// An added token and the id the file gives it.
#[derive(Deserialize)]
struct AddedTokenWithId {
    id: u32,
    #[serde(flatten)]
    token: AddedToken,
}

/// The `model` object, read into a [`Bpe`]; `None` when it asks for something `Bpe` does not do
/// exactly as the crate (see [`BpeVisitor`]).
struct BpeFile(Option<Bpe>);

impl<'de> Deserialize<'de> for BpeFile {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_map(BpeVisitor)
    }
}

/// The fields the crate's BPE reader takes. `Bpe` serves the options the Qwen files set: no
/// dropout (or 0), no unknown token, no byte fallback, an empty or absent subword prefix and word
/// suffix (the crate adds them to texts, so empty ones change nothing), `fuse_unk` (which only
/// matters with an unknown token) and `ignore_merges` either way. The vocabulary must come before
/// the merges, which are resolved against it as they are read.
struct BpeVisitor;

impl<'de> Visitor<'de> for BpeVisitor {
    type Value = BpeFile;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a BPE model object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<BpeFile, A::Error> {
        let (mut served, mut ignore_merges, mut is_bpe) = (true, false, false);
        let mut vocab: Option<Option<Vocab>> = None;
        let mut merges: Option<Option<Merges>> = None;
        while let Some(key) = map.next_key::<Cow<'de, str>>()? {
            match key.as_ref() {
                "type" => is_bpe = map.next_value::<Cow<'de, str>>()? == "BPE",
                "dropout" => served &= map.next_value::<Option<f32>>()?.is_none_or(|p| p == 0.0),
                "unk_token" => served &= map.next_value::<Option<IgnoredAny>>()?.is_none(),
                "continuing_subword_prefix" | "end_of_word_suffix" => {
                    served &= map
                        .next_value::<Option<Cow<'de, str>>>()?
                        .is_none_or(|s| s.is_empty())
                }
                "fuse_unk" => drop(map.next_value::<Option<bool>>()?),
                "byte_fallback" => served &= map.next_value::<Option<bool>>()? != Some(true),
                "ignore_merges" => ignore_merges = map.next_value::<Option<bool>>()?.unwrap_or(false),
                // A second vocabulary or merge list: the crate keeps the last of each and resolves
                // the merges at the end; decline rather than follow.
                "vocab" | "merges" if merges.is_some() => {
                    map.next_value::<IgnoredAny>()?;
                    served = false;
                }
                "vocab" => vocab = Some(map.next_value_seed(VocabSeed)?),
                "merges" => match &vocab {
                    Some(Some(v)) => merges = Some(map.next_value_seed(MergesSeed(v))?),
                    // Merges before the vocabulary (or after a declined one).
                    _ => {
                        map.next_value::<IgnoredAny>()?;
                        served = false;
                    }
                },
                _ => drop(map.next_value::<IgnoredAny>()?),
            }
        }
        let bpe = match (served && is_bpe, vocab, merges) {
            (true, Some(Some(vocab)), Some(Some(merges))) => Some(Bpe::new(vocab, merges, ignore_merges)),
            _ => None,
        };
        Ok(BpeFile(bpe))
    }
}

/// The `vocab` object into a [`Vocab`] (`None` unless its ids are `0..n` and its texts differ).
struct VocabSeed;

impl<'de> DeserializeSeed<'de> for VocabSeed {
    type Value = Option<Vocab>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Option<Vocab>, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for VocabSeed {
    type Value = Option<Vocab>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a map of token texts to ids")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Option<Vocab>, A::Error> {
        let mut vocab = VocabBuilder::default();
        while let Some((Text(token), id)) = map.next_entry::<Text<'de>, u32>()? {
            vocab.push(&token, id);
        }
        Ok(vocab.build())
    }
}

/// The `merges` list resolved against a vocabulary: pairs (`[["Ġ", "t"], ...]`, newer files) or
/// lines (`["Ġ t", ...]`, older ones). `None` for a list the crate would not read this way (the
/// two forms mixed, a line that does not split in two) or that names a text outside the vocabulary.
struct MergesSeed<'v>(&'v Vocab);

impl<'de> DeserializeSeed<'de> for MergesSeed<'_> {
    type Value = Option<Merges>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Option<Merges>, D::Error> {
        d.deserialize_seq(self)
    }
}

impl<'de> Visitor<'de> for MergesSeed<'_> {
    type Value = Option<Merges>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a list of merges")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Option<Merges>, A::Error> {
        let mut merges = MergesBuilder::new(self.0);
        let (mut form, mut served) = (None, true);
        while let Some(merge) = seq.next_element::<Merge<'de>>()? {
            let (a, b, line) = match &merge {
                Merge::Pair(a, b) => (a.as_ref(), b.as_ref(), false),
                // As the crate: `#version` lines are skipped, the rest split at each space into
                // exactly two parts.
                Merge::Line(l) if l.starts_with("#version") => continue,
                Merge::Line(l) => {
                    let mut parts = l.split(' ');
                    match (parts.next(), parts.next(), parts.next()) {
                        (Some(a), Some(b), None) => (a, b, true),
                        _ => {
                            served = false;
                            continue;
                        }
                    }
                }
            };
            served &= *form.get_or_insert(line) == line;
            merges.push(a, b);
        }
        Ok(merges.build().filter(|_| served))
    }
}

/// One merge, in either form, borrowed from the file where it has no escapes.
enum Merge<'de> {
    Pair(Cow<'de, str>, Cow<'de, str>),
    Line(Cow<'de, str>),
}

impl<'de> Deserialize<'de> for Merge<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(MergeVisitor)
    }
}

struct MergeVisitor;

impl<'de> Visitor<'de> for MergeVisitor {
    type Value = Merge<'de>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a merge: two strings, or one with a space")
    }

    fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Merge<'de>, E> {
        Ok(Merge::Line(Cow::Borrowed(v)))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Merge<'de>, E> {
        Ok(Merge::Line(Cow::Owned(v.to_owned())))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Merge<'de>, A::Error> {
        let a: Cow<'de, str> = seq
            .next_element::<Text<'de>>()?
            .ok_or_else(|| de::Error::invalid_length(0, &self))?
            .0;
        let b: Cow<'de, str> = seq
            .next_element::<Text<'de>>()?
            .ok_or_else(|| de::Error::invalid_length(1, &self))?
            .0;
        if seq.next_element::<IgnoredAny>()?.is_some() {
            return Err(de::Error::invalid_length(3, &self));
        }
        Ok(Merge::Pair(a, b))
    }
}

/// A string, borrowed from the file where it has no escapes (serde's own `Cow<str>` always copies).
struct Text<'de>(Cow<'de, str>);

impl<'de> Deserialize<'de> for Text<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct TextVisitor;
        impl<'de> Visitor<'de> for TextVisitor {
            type Value = Text<'de>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string")
            }
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Text<'de>, E> {
                Ok(Text(Cow::Borrowed(v)))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Text<'de>, E> {
                Ok(Text(Cow::Owned(v.to_owned())))
            }
        }
        d.deserialize_str(TextVisitor)
    }
}

/// The tokenizer in `bytes`, when it is a BPE tokenizer [`parse`] reads exactly as the crate does;
/// `None` otherwise (including when the file is malformed: the crate's loader then says how).
#[cfg(test)]
pub(super) fn parse(bytes: &[u8]) -> Option<Direct> {
    parse_cached(bytes, None)
}

/// [`parse`], with the BPE model from its copy in the directory `cache` when there is one for these
/// bytes (`cache.rs`), else parsed and copied there.
pub(super) fn parse_cached(bytes: &[u8], cache: Option<&Path>) -> Option<Direct> {
    let key = cache.map(|dir| (dir, Key::of(bytes)));
    if let Some((dir, key)) = &key {
        if let Some(copy) = cache::fetch(dir, key) {
            // The rest of the file (normaliser, pre-tokenizer, added tokens, ...) is still read
            // from it, the model skipped, while the copy is read back.
            let (bpe, file) = rayon::join(
                || cache::decode(&copy, key),
                || serde_json::from_slice::<TokenizerFile<IgnoredAny>>(bytes),
            );
            if let Some(bpe) = bpe {
                return assemble(file.ok()?, bpe);
            }
        }
    }
    let file: TokenizerFile<BpeFile> = serde_json::from_slice(bytes).ok()?;
    let bpe = file.model.0.clone()?;
    let tokenizer = assemble(file, bpe.clone())?;
    if let Some((dir, key)) = &key {
        cache::write(dir, key, &bpe);
    }
    Some(tokenizer)
}

/// The tokenizer of `file`'s pipeline around `bpe`, or `None` where the crate would read the file
/// otherwise.
fn assemble<M>(file: TokenizerFile<M>, bpe: Bpe) -> Option<Direct> {
    if file.version.as_deref().is_some_and(|v| v != "1.0")
        || file.truncation.is_some()
        || file.padding.is_some()
    {
        return None;
    }
    let mut tokenizer = TokenizerBuilder::new()
        .with_model(bpe)
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
    ids_hold.then_some(tokenizer)
}

#[cfg(test)]
mod tests {
    use std::path::{Path, PathBuf};

    use tokenizers::{
        DecoderWrapper, Model, NormalizerWrapper, PostProcessorWrapper, PreTokenizerWrapper, TokenizerImpl,
    };

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

    /// Texts to encode both ways: the Qwen chat's shapes, then seeded random strings over an
    /// alphabet of letters, digits, spaces, punctuation, accents, CJK, emoji and the added tokens'
    /// texts (runs of one letter up to 300 long too, for merges over long words).
    fn texts() -> Vec<String> {
        let mut texts: Vec<String> = [
            "<|im_start|>user\nHello, world! 12345 <|image_pad|><|im_end|>",
            "  café naïve 東京 — \t\n\n  <tool_call>{\"x\": 1}</tool_call>",
            "",
            "don't  stop'll 'RE \u{1F600}",
        ]
        .map(str::to_owned)
        .to_vec();
        let pieces = [
            "a",
            "e",
            "th",
            "the",
            "ing",
            " ",
            "  ",
            "\n",
            "\t",
            "0",
            "7",
            "42",
            ".",
            ",",
            "'s",
            "\"",
            "{",
            "é",
            "e\u{301}",
            "ß",
            "東",
            "京",
            "語",
            "\u{1F600}",
            "\u{200B}",
            "<|im_end|>",
            "<tool_call>",
            "Z",
            "q",
        ];
        let mut rng = fastrand::Rng::with_seed(29);
        for _ in 0..300 {
            let mut t = String::new();
            for _ in 0..rng.usize(1..40) {
                t.push_str(pieces[rng.usize(..pieces.len())]);
            }
            texts.push(t);
        }
        for n in [1, 2, 3, 17, 255, 256, 300] {
            texts.push("a".repeat(n));
            texts.push(format!(" {}", "0".repeat(n)));
        }
        texts
    }

    /// `bytes` read by [`parse`] and by the crate give the same tokenizer: the same text for every
    /// id and the same id for every text, the same added tokens and pipeline, and the same ids,
    /// offsets and decodings for every text of [`texts`].
    fn same_as_the_crate(bytes: &[u8], what: &str) {
        let ours = parse(bytes).unwrap_or_else(|| panic!("{what}: the direct reader declined"));
        same_tokenizer_as_the_crate(&ours, bytes, what);
    }

    /// `ours`, read from `bytes` one way or another, is the crate's tokenizer of `bytes` (as
    /// [`same_as_the_crate`] checks).
    fn same_tokenizer_as_the_crate(ours: &super::Direct, bytes: &[u8], what: &str) {
        let theirs = tokenizers::Tokenizer::from_bytes(bytes).unwrap();
        for added in [false, true] {
            assert_eq!(ours.get_vocab_size(added), theirs.get_vocab_size(added), "{what}");
        }
        assert_eq!(ours.get_vocab(true), theirs.get_vocab(true), "{what}");
        for id in 0..theirs.get_vocab_size(true) as u32 + 2 {
            assert_eq!(ours.id_to_token(id), theirs.id_to_token(id), "{what}: id {id}");
        }
        assert_eq!(parts(ours), parts(&*theirs), "{what}");
        for text in texts() {
            let (a, b) = (
                ours.encode_fast(text.as_str(), false).unwrap(),
                theirs.encode_fast(text.as_str(), false).unwrap(),
            );
            assert_eq!(a.get_ids(), b.get_ids(), "{what}: {text:?}");
            assert_eq!(a.get_offsets(), b.get_offsets(), "{what}: {text:?}");
            assert_eq!(a.get_tokens(), b.get_tokens(), "{what}: {text:?}");
            for skip in [false, true] {
                assert_eq!(
                    ours.decode(a.get_ids(), skip).unwrap(),
                    theirs.decode(b.get_ids(), skip).unwrap()
                );
            }
            // The models alone, on pieces the pre-tokenizer never makes: whole texts in the
            // byte-level alphabet, and as they are (characters outside the vocabulary dropped).
            for piece in [byte_level(&text), text.clone()] {
                let (a, b) = (
                    ours.get_model().tokenize(&piece),
                    theirs.get_model().tokenize(&piece),
                );
                assert_eq!(a.unwrap(), b.unwrap(), "{what}: {piece:?}");
            }
        }
    }

    /// `text`'s bytes as GPT-2's byte-level alphabet writes them: printable bytes as themselves,
    /// the other 68 as U+0100 onwards, in byte order.
    fn byte_level(text: &str) -> String {
        let printable = |b: u8| matches!(b, 0x21..=0x7e | 0xa1..=0xac | 0xae..=0xff);
        let others: Vec<u8> = (0..=255u8).filter(|&b| !printable(b)).collect();
        let char_of = |b: u8| match others.iter().position(|&o| o == b) {
            Some(i) => char::from_u32(0x100 + i as u32).unwrap(),
            None => b as char,
        };
        text.bytes().map(char_of).collect()
    }

    /// A tokenizer's added tokens and pipeline components, serialized (they have no `PartialEq`).
    fn parts<M: Model>(
        t: &TokenizerImpl<M, NormalizerWrapper, PreTokenizerWrapper, PostProcessorWrapper, DecoderWrapper>,
    ) -> [serde_json::Value; 5] {
        [
            serde_json::to_value(t.get_added_tokens_decoder()).unwrap(),
            serde_json::to_value(t.get_normalizer()).unwrap(),
            serde_json::to_value(t.get_pre_tokenizer()).unwrap(),
            serde_json::to_value(t.get_post_processor()).unwrap(),
            serde_json::to_value(t.get_decoder()).unwrap(),
        ]
    }

    #[test]
    fn reads_every_tokenizer_in_the_repository_as_the_crate_does() {
        for path in files() {
            same_as_the_crate(&std::fs::read(&path).unwrap(), &path.display().to_string());
        }
    }

    /// The cache (`cache.rs`): a miss parses the file and writes one copy, a hit reads the copy
    /// back into the crate's tokenizer (checked against the crate as above), a changed file misses,
    /// and a damaged, truncated, empty or lengthened copy is ignored (the same tokenizer again) and
    /// written anew.
    #[test]
    fn the_cached_model_is_the_parsed_one() {
        use super::cache::decode;
        use super::parse_cached;
        use super::Key;
        for path in files() {
            let bytes = std::fs::read(&path).unwrap();
            let what = path.display().to_string();
            let dir = tempfile::tempdir().unwrap();
            let copies = || -> Vec<PathBuf> {
                std::fs::read_dir(dir.path())
                    .unwrap()
                    .map(|e| e.unwrap().path())
                    .collect()
            };
            let parsed = parse_cached(&bytes, Some(dir.path())).unwrap();
            let [copy] = &copies()[..] else {
                panic!("{what}: one copy after a miss: {:?}", copies())
            };
            let hit = parse_cached(&bytes, Some(dir.path())).unwrap();
            same_tokenizer_as_the_crate(&hit, &bytes, &what);
            let good = std::fs::read(copy).unwrap();
            let mut flipped = good.clone();
            let middle = flipped.len() / 2;
            flipped[middle] ^= 0x20;
            let damaged = [
                flipped,
                good[..good.len() - 5].to_vec(),
                Vec::new(),
                [&good[..], &[0]].concat(),
            ];
            for (i, bad) in damaged.iter().enumerate() {
                assert!(decode(bad, &Key::of(&bytes)).is_none(), "{what}: damage {i} read");
                std::fs::write(copy, bad).unwrap();
                let again = parse_cached(&bytes, Some(dir.path())).unwrap();
                assert_eq!(
                    again.get_vocab(true),
                    parsed.get_vocab(true),
                    "{what}: damage {i}"
                );
                let rewritten = std::fs::read(copy).unwrap();
                assert!(
                    decode(&rewritten, &Key::of(&bytes)).is_some(),
                    "{what}: damage {i} mended"
                );
            }
            let changed = [&bytes[..], b" "].concat();
            parse_cached(&changed, Some(dir.path())).unwrap();
            assert_eq!(copies().len(), 2, "{what}: a changed file has a copy of its own");
            assert!(
                decode(&good, &Key::of(&changed)).is_none(),
                "{what}: a copy of another file"
            );
        }
    }

    #[test]
    fn saves_vocabulary_and_merges_as_the_crate_does() {
        let bytes = serde_json::to_vec(&tiny()).unwrap();
        let (ours, theirs) = (
            parse(&bytes).unwrap(),
            tokenizers::Tokenizer::from_bytes(&bytes).unwrap(),
        );
        let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let saved_a = ours.get_model().save(a.path(), Some("tiny")).unwrap();
        let saved_b = theirs.get_model().save(b.path(), Some("tiny")).unwrap();
        assert_eq!(saved_a.len(), saved_b.len());
        for (x, y) in saved_a.iter().zip(&saved_b) {
            assert_eq!(x.file_name(), y.file_name());
            assert_eq!(std::fs::read(x).unwrap(), std::fs::read(y).unwrap(), "{x:?}");
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
        let edits: [(&str, Edit); 14] = [
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
            ("a merge outside the vocabulary", |j| {
                j["model"]["merges"][0] = "a \u{1F600}".into()
            }),
            ("dropout", |j| j["model"]["dropout"] = 0.5.into()),
            ("an unknown token", |j| j["model"]["unk_token"] = "a".into()),
            ("byte fallback", |j| j["model"]["byte_fallback"] = true.into()),
            ("a subword prefix", |j| {
                j["model"]["continuing_subword_prefix"] = "##".into()
            }),
            ("ids with a gap", |j| {
                let n = j["model"]["vocab"].as_object().unwrap().len();
                j["model"]["vocab"]["a"] = (n + 5).into();
            }),
            ("two texts with one id", |j| {
                let b = j["model"]["vocab"]["b"].clone();
                j["model"]["vocab"]["a"] = b;
            }),
            ("merges before the vocabulary", |j| {
                let model = j["model"].as_object_mut().unwrap();
                let vocab = model.remove("vocab").unwrap();
                model.insert("vocab".into(), vocab);
            }),
        ];
        for (what, edit) in edits {
            let mut json = tiny();
            edit(&mut json);
            assert!(parse(&serde_json::to_vec(&json).unwrap()).is_none(), "{what}");
        }
    }
}
