//! A binary copy of a parsed BPE model, so that the next load of the same `tokenizer.json` skips
//! what costs most: reading 151,643 vocabulary entries out of JSON and resolving 151,387 merges
//! against them (docs/PERFORMANCE.md has the times). One-shot requests (`recall generate`, a
//! script per step) load the tokenizer every time.
//!
//! The copy is named by two 64-bit hashes of the file's bytes and its length, and holds them
//! again inside, so a file that changed misses and a damaged copy is ignored (the file is then
//! parsed and the copy written again). Where it lives: `$RECALL_TOKENIZER_CACHE` (`off` or `0`:
//! no copies), else `$XDG_CACHE_HOME/recall/tokenizers`, else `~/.cache/recall/tokenizers`.
//! Writing is best effort; a read-only place only costs the parse.
//!
//! Layout (little-endian): the 8-byte [`MAGIC`] (which carries the layout's version), the file's
//! length and hashes (3 × u64), a hash of the rest of the copy (u64: a damaged copy is never
//! read), then `ignore_merges` (u32), the vocabulary's text (u32 length, bytes) and its spans
//! (u32 count, then start and end per id), the merges (u32 count, then left id, right id, rank
//! and merged id per merge).

use std::path::{Path, PathBuf};

use super::bpe::{Bpe, Merges, Span, Vocab};

/// The environment variable that moves (or, set to `off` or `0`, disables) the cache.
pub const ENV_TOKENIZER_CACHE: &str = "RECALL_TOKENIZER_CACHE";

/// The first bytes of a copy; the last one is the layout's version.
const MAGIC: [u8; 8] = *b"RCLBPE\0\x01";

/// What names a copy: the source file's length and two hashes of its bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Key {
    len: u64,
    hashes: [u64; 2],
}

impl Key {
    pub(super) fn of(bytes: &[u8]) -> Key {
        let hash = |seed| xxhash_rust::xxh64::xxh64(bytes, seed);
        Key {
            len: bytes.len() as u64,
            hashes: [hash(0), hash(0x5eed_1e55)],
        }
    }

    fn file_name(&self) -> String {
        format!("{:016x}{:016x}-{}.bpe", self.hashes[0], self.hashes[1], self.len)
    }
}

/// The cache directory, or `None` when it is disabled or no home is known.
pub fn dir() -> Option<PathBuf> {
    crate::cache_dir::under(ENV_TOKENIZER_CACHE, "tokenizers")
}

/// The copy in `dir` for the file `key` names, not yet checked ([`decode`] checks it); `None` on a
/// miss.
pub(super) fn fetch(dir: &Path, key: &Key) -> Option<Vec<u8>> {
    std::fs::read(dir.join(key.file_name())).ok()
}

/// Writes `bpe` into `dir` as the copy for `key`: best effort, a failure is only logged.
pub(super) fn write(dir: &Path, key: &Key, bpe: &Bpe) {
    let written = std::fs::create_dir_all(dir)
        .map_err(|e| crate::Error::io(dir, e))
        .and_then(|()| crate::atomic::write_atomic(&dir.join(key.file_name()), encode(key, bpe)));
    if let Err(e) = written {
        tracing::debug!(error = %e, "the tokenizer cache was not written");
    }
}

fn encode(key: &Key, bpe: &Bpe) -> Vec<u8> {
    let (vocab, merges, ignore_merges) = bpe.parts();
    let (text, spans) = vocab.parts();
    let mut out = Vec::with_capacity(16 + text.len() + spans.len() * 8 + merges.len() * 16);
    let put = |out: &mut Vec<u8>, words: &[u32]| words.iter().for_each(|w| out.extend(w.to_le_bytes()));
    put(&mut out, &[u32::from(ignore_merges), text.len() as u32]);
    out.extend_from_slice(text.as_bytes());
    put(&mut out, &[spans.len() as u32]);
    for &(start, end) in spans {
        put(&mut out, &[start, end]);
    }
    put(&mut out, &[merges.len() as u32]);
    for (&(a, b), &(rank, id)) in merges {
        put(&mut out, &[a, b, rank, id]);
    }
    let mut copy = Vec::with_capacity(HEADER + out.len());
    copy.extend_from_slice(&MAGIC);
    for v in [key.len, key.hashes[0], key.hashes[1], payload_hash(&out)] {
        copy.extend_from_slice(&v.to_le_bytes());
    }
    copy.extend_from_slice(&out);
    copy
}

/// Bytes before the payload: the magic and four u64.
const HEADER: usize = 8 + 4 * 8;

fn payload_hash(payload: &[u8]) -> u64 {
    xxhash_rust::xxh64::xxh64(payload, 0x0c0f_fee5)
}

/// Reads the copy in `bytes` back, checking every count, offset and id against what it reads;
/// `None` for a damaged copy or one of another file.
pub(super) fn decode(bytes: &[u8], key: &Key) -> Option<Bpe> {
    let bpe = decode_checked(bytes, key);
    if bpe.is_none() {
        tracing::debug!("a damaged tokenizer cache entry: parsing the file");
    }
    bpe
}

fn decode_checked(bytes: &[u8], key: &Key) -> Option<Bpe> {
    let mut r = Reader(bytes);
    if r.take(8)? != MAGIC {
        return None;
    }
    let stored = Key {
        len: r.u64()?,
        hashes: [r.u64()?, r.u64()?],
    };
    if stored != *key || r.u64()? != payload_hash(r.0) {
        return None;
    }
    let ignore_merges = match r.u32()? {
        0 => false,
        1 => true,
        _ => return None,
    };
    let text_len = r.u32()? as usize;
    let text = std::str::from_utf8(r.take(text_len)?).ok()?.to_owned();
    let n = r.u32()? as usize;
    let spans: Vec<Span> = r
        .words(n.checked_mul(2)?)?
        .chunks_exact(2)
        .map(|s| (s[0], s[1]))
        .collect();
    let count = r.u32()? as usize;
    let words = r.words(count.checked_mul(4)?)?;
    if !r.0.is_empty() {
        return None;
    }
    // The two hash tables, one per thread.
    let (vocab, merges) = rayon::join(|| Vocab::from_parts(text, spans), || merges_of(&words, n));
    Some(Bpe::new(vocab?, merges?, ignore_merges))
}

/// The merges of `words` (4 per merge), or `None` if one names an id past `n` or a pair twice.
fn merges_of(words: &[u32], n: usize) -> Option<Merges> {
    let in_vocab = |id: u32| (id as usize) < n;
    let mut merges = Merges::with_capacity(words.len() / 4);
    for m in words.chunks_exact(4) {
        let (a, b, rank, id) = (m[0], m[1], m[2], m[3]);
        if !(in_vocab(a) && in_vocab(b) && in_vocab(id)) || merges.insert((a, b), (rank, id)).is_some() {
            return None;
        }
    }
    Some(merges)
}

/// The unread rest of a copy.
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if n > self.0.len() {
            return None;
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Some(head)
    }

    fn u32(&mut self) -> Option<u32> {
        Some(u32::from_le_bytes(self.take(4)?.try_into().ok()?))
    }

    fn u64(&mut self) -> Option<u64> {
        Some(u64::from_le_bytes(self.take(8)?.try_into().ok()?))
    }

    /// `n` u32 words.
    fn words(&mut self, n: usize) -> Option<Vec<u32>> {
        let bytes = self.take(n.checked_mul(4)?)?;
        Some(
            bytes
                .chunks_exact(4)
                .map(|w| u32::from_le_bytes([w[0], w[1], w[2], w[3]]))
                .collect(),
        )
    }
}
