//! A byte-level BPE model that computes what the `tokenizers` crate's BPE computes, built with a
//! fraction of the work.
//!
//! The crate's `BpeBuilder` keeps the vocabulary as a map of owned strings, clones every string
//! again for the reverse map, and formats each merge's result into a new string to look it up:
//! about 60 ms on the Qwen vocabulary, on the critical path of every one-shot request. Here the
//! vocabulary is one string of every token's text, found by id through a table of spans and by
//! text through a hash table of ids; a merge is resolved while it is read, in a reused buffer.
//!
//! Only the configuration the Qwen files use is served: no dropout, no unknown token, no byte
//! fallback, no subword prefix or word suffix. `load.rs` declines every other file, which then
//! loads through the crate. Within it, [`Bpe::tokenize`] is the crate's algorithm: the characters
//! of the piece as tokens (a character outside the vocabulary is dropped, as the crate drops it
//! when there is no unknown token), then, over and over, the merge of lowest rank, the leftmost on
//! a tie, until none applies. The tests in `load.rs` compare it with the crate's BPE on every
//! vocabulary in the repository; `tests/tokenizer.rs` compares whole encodings with tiktoken.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

use ahash::{AHashMap, RandomState};
use hashbrown::HashTable;
use tokenizers::models::bpe::BpeTrainer;
use tokenizers::{Model, Token};

/// A token's place in [`Vocab::text`]: start and end byte.
pub(super) type Span = (u32, u32);
/// Not yet given a text.
const NO_SPAN: Span = (u32::MAX, 0);

/// The vocabulary: every token's text in one string, found by id (a dense range from 0) or by text.
pub(super) struct Vocab {
    text: String,
    spans: Vec<Span>,
    /// Every id, hashed by its token's text.
    index: HashTable<u32>,
    hasher: RandomState,
}

impl Vocab {
    /// The text of token `id`.
    pub(super) fn get(&self, id: u32) -> Option<&str> {
        Some(self.at(*self.spans.get(id as usize)?))
    }

    /// The id of the token whose text is `token`.
    pub(super) fn id(&self, token: &str) -> Option<u32> {
        let hash = self.hasher.hash_one(token);
        self.index.find(hash, |&id| self.get(id) == Some(token)).copied()
    }

    fn at(&self, span: Span) -> &str {
        text_at(&self.text, span)
    }

    pub(super) fn len(&self) -> usize {
        self.spans.len()
    }
}

/// The text `span` marks in `text`.
fn text_at(text: &str, (start, end): Span) -> &str {
    &text[start as usize..end as usize]
}

/// Collects a vocabulary as a `tokenizer.json` lists it: texts with their ids, in any order.
#[derive(Default)]
pub(super) struct VocabBuilder {
    text: String,
    entries: Vec<(u32, Span)>,
}

impl VocabBuilder {
    /// Appends one entry.
    pub(super) fn push(&mut self, token: &str, id: u32) {
        let start = self.text.len() as u32;
        self.text.push_str(token);
        self.entries.push((id, (start, self.text.len() as u32)));
    }

    /// The vocabulary, or `None` unless the ids are exactly `0..n` and the texts all differ (the
    /// crate would keep one of two equal texts; such files load through it).
    pub(super) fn build(self) -> Option<Vocab> {
        let mut spans = vec![NO_SPAN; self.entries.len()];
        for (id, span) in self.entries {
            let slot = spans.get_mut(id as usize)?;
            if *slot != NO_SPAN {
                return None;
            }
            *slot = span;
        }
        Vocab::from_parts(self.text, spans)
    }
}

impl Vocab {
    /// The vocabulary whose token `id` is `text[spans[id]]`, or `None` unless every span lies
    /// within `text` on character boundaries and the texts all differ.
    pub(super) fn from_parts(text: String, spans: Vec<Span>) -> Option<Vocab> {
        // Byte offsets are u32: decline a text past 4 GiB (far beyond any tokenizer file).
        u32::try_from(text.len()).ok()?;
        let on_chars = |&(start, end): &Span| {
            start <= end && text.is_char_boundary(start as usize) && text.is_char_boundary(end as usize)
        };
        if !spans.iter().all(on_chars) {
            return None;
        }
        let n = spans.len();
        let mut vocab = Vocab {
            text,
            spans,
            index: HashTable::with_capacity(n),
            hasher: RandomState::new(),
        };
        for id in 0..n as u32 {
            let span = vocab.spans[id as usize];
            let token = vocab.at(span);
            let hash = vocab.hasher.hash_one(token);
            if vocab.index.find(hash, |&j| vocab.get(j) == Some(token)).is_some() {
                return None;
            }
            let (text, spans, hasher) = (&vocab.text, &vocab.spans, &vocab.hasher);
            let rehash = |&j: &u32| hasher.hash_one(text_at(text, spans[j as usize]));
            vocab.index.insert_unique(hash, id, rehash);
        }
        Some(vocab)
    }

    /// Every token's text, one after another, and where each lies in it (by id): what
    /// [`from_parts`](Self::from_parts) takes back.
    pub(super) fn parts(&self) -> (&str, &[Span]) {
        (&self.text, &self.spans)
    }
}

/// The merges: a pair of ids to the merge's rank and the id of the merged token.
pub(super) type Merges = AHashMap<(u32, u32), (u32, u32)>;

/// Resolves merges against a vocabulary as they are read, ranked in reading order; a later merge
/// of the same pair replaces an earlier one, as in the crate's map.
pub(super) struct MergesBuilder<'v> {
    vocab: &'v Vocab,
    merges: Merges,
    /// Merges read so far: the next one's rank.
    read: u32,
    joined: String,
    /// A merge named a text outside the vocabulary (the crate fails on such a file).
    missing: bool,
}

impl<'v> MergesBuilder<'v> {
    pub(super) fn new(vocab: &'v Vocab) -> Self {
        MergesBuilder {
            vocab,
            merges: Merges::with_capacity(vocab.len()),
            read: 0,
            joined: String::new(),
            missing: false,
        }
    }

    /// Adds the merge of `a` and `b`, at the next rank.
    pub(super) fn push(&mut self, a: &str, b: &str) {
        self.joined.clear();
        self.joined.push_str(a);
        self.joined.push_str(b);
        match (self.vocab.id(a), self.vocab.id(b), self.vocab.id(&self.joined)) {
            (Some(a), Some(b), Some(joined)) => {
                self.merges.insert((a, b), (self.read, joined));
            }
            _ => self.missing = true,
        }
        self.read += 1;
    }

    /// The merges, or `None` when one named a text outside the vocabulary.
    pub(super) fn build(self) -> Option<Merges> {
        (!self.missing).then_some(self.merges)
    }
}

/// A byte-level BPE model (see the module's comment); clones share the tables.
#[derive(Clone)]
pub(super) struct Bpe(Arc<Tables>);

struct Tables {
    vocab: Vocab,
    /// The id of each character below [`CHARS`] that is a token (`u32::MAX` if none): the whole
    /// byte-level alphabet, looked up without hashing.
    chars: Vec<u32>,
    merges: Merges,
    /// A piece that is itself a token is that token, merges or not.
    ignore_merges: bool,
    /// Pieces merged before (the crate keeps such a cache too): prompts repeat their words, and
    /// an agent's prompts repeat whole instructions step after step.
    cache: RwLock<AHashMap<Box<str>, Box<[Piece]>>>,
}

/// One token of a merged piece: its id and how many bytes of the piece it covers.
type Piece = (u32, u32);

/// Pieces shorter than this many bytes are cached, at most [`CACHE_WORDS`] of them (the crate's
/// limits).
const CACHE_BYTES: usize = 256;
const CACHE_WORDS: usize = 10_000;

/// Characters below this code point are looked up in [`Tables::chars`] (GPT-2's byte-level
/// alphabet ends at U+0143).
const CHARS: u32 = 0x180;

/// No symbol: the end of a word's list.
const NONE: usize = usize::MAX;

/// One symbol of a word being merged: a token, the bytes of the piece it covers (0 once merged
/// into its left neighbour), and its neighbours.
#[derive(Clone, Copy)]
struct Symbol {
    id: u32,
    len: usize,
    prev: usize,
    next: usize,
}

impl Bpe {
    pub(super) fn new(vocab: Vocab, merges: Merges, ignore_merges: bool) -> Bpe {
        let chars = (0..CHARS)
            .map(|c| {
                let c = char::from_u32(c).expect("below the surrogates");
                vocab.id(c.encode_utf8(&mut [0; 4])).unwrap_or(u32::MAX)
            })
            .collect();
        Bpe(Arc::new(Tables {
            vocab,
            chars,
            merges,
            ignore_merges,
            cache: RwLock::new(AHashMap::new()),
        }))
    }

    /// The vocabulary, the merges and whether a piece that is a token skips them: what
    /// [`new`](Self::new) was given.
    pub(super) fn parts(&self) -> (&Vocab, &Merges, bool) {
        let t = &self.0;
        (&t.vocab, &t.merges, t.ignore_merges)
    }

    /// The tokens of `piece`, from the cache when it is there.
    fn pieces(&self, piece: &str) -> Box<[Piece]> {
        let cache = &self.0.cache;
        if piece.len() < CACHE_BYTES {
            // `try_`: a thread never waits for the cache, it merges instead.
            if let Some(hit) = cache.try_read().ok().and_then(|c| c.get(piece).cloned()) {
                return hit;
            }
        }
        let merged: Box<[Piece]> = self.merge(piece).iter().map(|s| (s.id, s.len as u32)).collect();
        if piece.len() < CACHE_BYTES {
            if let Ok(mut c) = cache.try_write() {
                if c.len() < CACHE_WORDS {
                    c.insert(piece.into(), merged.clone());
                }
            }
        }
        merged
    }

    /// The ids `piece` merges into, each with the bytes of `piece` it covers.
    fn merge(&self, piece: &str) -> Vec<Symbol> {
        let t = &*self.0;
        let mut symbols: Vec<Symbol> = Vec::with_capacity(piece.len());
        for (i, c) in piece.char_indices() {
            let len = c.len_utf8();
            let id = match t.chars.get(c as usize) {
                Some(&id) => (id != u32::MAX).then_some(id),
                None => t.vocab.id(&piece[i..i + len]),
            };
            // A character outside the vocabulary is dropped, as the crate does without an
            // unknown token.
            if let Some(id) = id {
                let at = symbols.len();
                symbols.push(Symbol {
                    id,
                    len,
                    prev: at.wrapping_sub(1),
                    next: at + 1,
                });
            }
        }
        if let Some(last) = symbols.last_mut() {
            last.next = NONE;
        }
        // Candidate merges by (rank, position of the left symbol): lowest rank first, the leftmost
        // on a tie. Entries go stale when a neighbour merges; they are skipped when popped.
        let mut queue = BinaryHeap::with_capacity(symbols.len());
        let pair = |l: &Symbol, r: &Symbol| t.merges.get(&(l.id, r.id)).copied();
        for (pos, w) in symbols.windows(2).enumerate() {
            if let Some((rank, id)) = pair(&w[0], &w[1]) {
                queue.push(Reverse((rank, pos, id)));
            }
        }
        while let Some(Reverse((_, pos, id))) = queue.pop() {
            let left = symbols[pos];
            if left.len == 0 || left.next == NONE {
                continue;
            }
            let right = symbols[left.next];
            if pair(&left, &right).map(|(_, merged)| merged) != Some(id) {
                continue;
            }
            symbols[left.next].len = 0;
            let merged = Symbol {
                id,
                len: left.len + right.len,
                prev: left.prev,
                next: right.next,
            };
            symbols[pos] = merged;
            if merged.next != NONE {
                symbols[merged.next].prev = pos;
                if let Some((rank, id)) = pair(&merged, &symbols[merged.next]) {
                    queue.push(Reverse((rank, pos, id)));
                }
            }
            if merged.prev != NONE {
                if let Some((rank, id)) = pair(&symbols[merged.prev], &merged) {
                    queue.push(Reverse((rank, merged.prev, id)));
                }
            }
        }
        symbols.retain(|s| s.len != 0);
        symbols
    }
}

impl Model for Bpe {
    type Trainer = BpeTrainer;

    fn tokenize(&self, sequence: &str) -> tokenizers::Result<Vec<Token>> {
        let t = &*self.0;
        if sequence.is_empty() {
            return Ok(Vec::new());
        }
        if t.ignore_merges {
            if let Some(id) = t.vocab.id(sequence) {
                return Ok(vec![Token::new(id, sequence.to_owned(), (0, sequence.len()))]);
            }
        }
        let mut at = 0;
        let pieces = self.pieces(sequence);
        let tokens = pieces.iter().map(|&(id, len)| {
            let text = t.vocab.get(id).expect("merged ids are in the vocabulary");
            at += len as usize;
            Token::new(id, text.to_owned(), (at - len as usize, at))
        });
        Ok(tokens.collect())
    }

    fn token_to_id(&self, token: &str) -> Option<u32> {
        self.0.vocab.id(token)
    }

    fn id_to_token(&self, id: u32) -> Option<String> {
        self.0.vocab.get(id).map(str::to_owned)
    }

    fn get_vocab(&self) -> HashMap<String, u32> {
        let v = &self.0.vocab;
        (0..v.len() as u32)
            .map(|id| (v.get(id).expect("dense ids").to_owned(), id))
            .collect()
    }

    fn get_vocab_size(&self) -> usize {
        self.0.vocab.len()
    }

    /// Writes `vocab.json` (ordered by id) and `merges.txt` (ordered by rank), as the crate's BPE.
    fn save(&self, folder: &Path, prefix: Option<&str>) -> tokenizers::Result<Vec<PathBuf>> {
        let t = &*self.0;
        let name =
            |file: &str| folder.join(prefix.map_or_else(|| file.to_owned(), |p| format!("{p}-{file}")));
        let vocab_path = name("vocab.json");
        let mut vocab = serde_json::Map::new();
        for id in 0..t.vocab.len() as u32 {
            vocab.insert(t.vocab.get(id).expect("dense ids").to_owned(), id.into());
        }
        std::fs::write(&vocab_path, serde_json::to_string(&vocab)?)?;
        let merges_path = name("merges.txt");
        let mut merges: Vec<_> = t.merges.iter().map(|(&pair, &(rank, _))| (rank, pair)).collect();
        merges.sort_unstable();
        let mut out = std::io::BufWriter::new(File::create(&merges_path)?);
        out.write_all(b"#version: 0.2\n")?;
        for (_, (a, b)) in merges {
            let text = |id| t.vocab.get(id).expect("merge ids are in the vocabulary");
            writeln!(out, "{} {}", text(a), text(b))?;
        }
        out.flush()?;
        Ok(vec![vocab_path, merges_path])
    }

    fn get_trainer(&self) -> BpeTrainer {
        BpeTrainer::default()
    }
}
