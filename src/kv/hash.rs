//! Stable keys for prefix caching: what a token contributes to its K/V, and the hash chain over full blocks.
//!
//! Why a chain: the K/V of token `i` is a function of the weights, the request-wide adapter state and the
//! embeddings of tokens `0..=i` at their positions. A block's hash therefore folds in its parent's hash
//! (standing for the whole prefix), the request salt and its own token keys, so two blocks with equal
//! hashes hold equal K/V (up to a 64-bit collision, which the block manager's content check guards).
//!
//! Why positions need no key: positions are a function of the token sequence itself. Text positions
//! count the tokens before them; M-RoPE positions of an image follow from the prefix and the image's
//! grid, which is fixed by the decoded image (so the image hash must cover the decoded size). Equal
//! prefixes thus imply equal positions, and the parent hash already covers the prefix.
//!
//! The hash is xxh64 (seed 0) over a fixed little-endian byte layout: unlike `DefaultHasher`, its value
//! is stable across Rust releases and platforms, so keys may be logged, compared across processes or
//! persisted.

use xxhash_rust::xxh64::{xxh64, Xxh64};

/// Domain tags mixed into every hash so that keys of different kinds never collide trivially (a text
/// token id 7 and image index 7 of image hash 0 hash different bytes).
const TAG_TEXT: u8 = b'T';
const TAG_IMAGE: u8 = b'I';
const TAG_EMBED: u8 = b'E';
const TAG_BLOCK: u8 = b'B';
const TAG_ADAPTER: u8 = b'A';

/// What determines one token's K/V besides its position and the request salt.
///
/// Built only through the domain constructors, which hash a domain tag with the payload.
///
/// ```
/// use recall::kv::TokenKey;
/// let text = TokenKey::text(151655);
/// let image = TokenKey::image(0xfeed, 0);
/// assert_ne!(text, image);
/// assert_ne!(TokenKey::image(0xfeed, 0), TokenKey::image(0xbeef, 0));
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct TokenKey(u64);

impl TokenKey {
    /// A text token (including special tokens such as `<|vision_start|>`), by vocabulary id.
    pub fn text(id: u32) -> Self {
        Self(tagged(TAG_TEXT, u64::from(id), 0))
    }

    /// Token `index_in_image` (in merged-token order) of the image whose decoded content hashes to
    /// `image_hash`. The placeholder id is the same for every image, so the content hash is what tells
    /// two screenshots apart.
    pub fn image(image_hash: u64, index_in_image: u32) -> Self {
        Self(tagged(TAG_IMAGE, image_hash, index_in_image))
    }

    /// Row `index_in_run` of a raw embedding run (e.g. the ScopeMem prefix) whose vectors hash to
    /// `run_hash`.
    pub fn embed(run_hash: u64, index_in_run: u32) -> Self {
        Self(tagged(TAG_EMBED, run_hash, index_in_run))
    }

    /// This token with adapter `adapter_id` applied to its K/V (the HGKV gate is on for it). Tokens
    /// after it need no mark: the chain of parent hashes carries the difference forward.
    ///
    /// ```
    /// use recall::kv::TokenKey;
    /// let t = TokenKey::image(0xfeed, 3);
    /// assert_ne!(t.with_adapter(1), t);
    /// assert_ne!(t.with_adapter(1), t.with_adapter(2));
    /// ```
    pub fn with_adapter(self, adapter_id: u64) -> Self {
        let mut buf = [0u8; 17];
        buf[0] = TAG_ADAPTER;
        buf[1..9].copy_from_slice(&self.0.to_le_bytes());
        buf[9..17].copy_from_slice(&adapter_id.to_le_bytes());
        Self(xxh64(&buf, 0))
    }

    /// The key's 64-bit value.
    pub fn raw(self) -> u64 {
        self.0
    }
}

/// xxh64 of `tag ‖ a (8 bytes LE) ‖ b (4 bytes LE)`.
fn tagged(tag: u8, a: u64, b: u32) -> u64 {
    let mut buf = [0u8; 13];
    buf[0] = tag;
    buf[1..9].copy_from_slice(&a.to_le_bytes());
    buf[9..13].copy_from_slice(&b.to_le_bytes());
    xxh64(&buf, 0)
}

/// The chained hash of one full KV block: it stands for the block's keys, the salt and (through the
/// parent) every token before the block.
///
/// ```
/// use recall::kv::{BlockHash, TokenKey};
/// let keys: Vec<TokenKey> = (0..4).map(TokenKey::text).collect();
/// let first = BlockHash::chain(None, &keys, 0);
/// let second = BlockHash::chain(Some(first), &keys, 0);
/// assert_ne!(first, second); // same tokens, different prefix
/// assert_ne!(first, BlockHash::chain(None, &keys, 1)); // same tokens, different adapter state
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct BlockHash(u64);

impl BlockHash {
    /// xxh64 over `'B' ‖ has_parent (1 byte) ‖ parent (8) ‖ salt (8) ‖ keys.len() (8) ‖ keys (8 each)`,
    /// all little-endian; `parent` is `None` for the first block of a sequence.
    ///
    /// `salt` carries request-wide state that changes K/V: the adapter id and the gate mode (0 for
    /// none). Per-token gating that follows from the tokens themselves (HGKV acts on history images
    /// only) is covered by the keys once the salt names the adapter.
    pub fn chain(parent: Option<BlockHash>, keys: &[TokenKey], salt: u64) -> BlockHash {
        let mut h = Xxh64::new(0);
        h.update(&[TAG_BLOCK, u8::from(parent.is_some())]);
        h.update(&parent.map_or(0, |p| p.0).to_le_bytes());
        h.update(&salt.to_le_bytes());
        h.update(&(keys.len() as u64).to_le_bytes());
        for key in keys {
            h.update(&key.0.to_le_bytes());
        }
        BlockHash(h.digest())
    }

    /// The hash's 64-bit value.
    pub fn raw(self) -> u64 {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn texts(ids: std::ops::Range<u32>) -> Vec<TokenKey> {
        ids.map(TokenKey::text).collect()
    }

    /// The chain over every full block of `keys`, computed in one go.
    fn chain_all(keys: &[TokenKey], block_size: usize, salt: u64) -> Vec<BlockHash> {
        let mut out: Vec<BlockHash> = Vec::new();
        for chunk in keys.chunks_exact(block_size) {
            out.push(BlockHash::chain(out.last().copied(), chunk, salt));
        }
        out
    }

    #[test]
    fn domains_do_not_collide() {
        assert_ne!(TokenKey::text(7), TokenKey::image(7, 0));
        assert_ne!(TokenKey::text(7), TokenKey::embed(7, 0));
        assert_ne!(TokenKey::image(7, 3), TokenKey::embed(7, 3));
        assert_ne!(TokenKey::image(0, 0), TokenKey::embed(0, 0));
        assert_ne!(TokenKey::text(0), TokenKey::image(0, 0));
    }

    #[test]
    fn image_keys_depend_on_hash_and_index() {
        assert_ne!(TokenKey::image(1, 0), TokenKey::image(2, 0));
        assert_ne!(TokenKey::image(1, 0), TokenKey::image(1, 1));
        assert_eq!(TokenKey::image(1, 5), TokenKey::image(1, 5));
    }

    #[test]
    fn different_image_at_same_place_changes_block_hash() {
        let block = |image: u64| {
            let mut keys = texts(0..2);
            keys.extend((0..2).map(|i| TokenKey::image(image, i)));
            BlockHash::chain(None, &keys, 0)
        };
        assert_ne!(block(0xaaaa), block(0xbbbb));
        assert_eq!(block(0xaaaa), block(0xaaaa));
    }

    #[test]
    fn different_image_earlier_changes_later_blocks() {
        let prefix = |image: u64| -> Vec<TokenKey> {
            let mut keys: Vec<TokenKey> = (0..4).map(|i| TokenKey::image(image, i)).collect();
            keys.extend(texts(10..14));
            keys
        };
        let a = chain_all(&prefix(1), 4, 0);
        let b = chain_all(&prefix(2), 4, 0);
        assert_ne!(a[1], b[1], "second block has equal tokens but a different prefix");
    }

    #[test]
    fn salt_changes_hash() {
        let keys = texts(0..4);
        assert_ne!(BlockHash::chain(None, &keys, 0), BlockHash::chain(None, &keys, 1));
        assert_ne!(BlockHash::chain(None, &keys, 1), BlockHash::chain(None, &keys, 2));
    }

    #[test]
    fn parent_none_differs_from_any_parent() {
        let keys = texts(0..4);
        let root = BlockHash::chain(None, &keys, 0);
        assert_ne!(root, BlockHash::chain(Some(BlockHash(0)), &keys, 0));
    }

    #[test]
    fn embed_run_hash_changes_block_hash() {
        let run = |h: u64| (0..4).map(|i| TokenKey::embed(h, i)).collect::<Vec<_>>();
        assert_ne!(
            BlockHash::chain(None, &run(1), 0),
            BlockHash::chain(None, &run(2), 0)
        );
    }

    #[test]
    fn incremental_chain_equals_recomputing() {
        let keys: Vec<TokenKey> = (0..40u32)
            .map(|i| {
                if i % 5 == 0 {
                    TokenKey::image(99, i)
                } else {
                    TokenKey::text(i)
                }
            })
            .collect();
        let all = chain_all(&keys, 8, 3);
        let mut parent = None;
        for (b, expected) in all.iter().enumerate() {
            let h = BlockHash::chain(parent, &keys[b * 8..(b + 1) * 8], 3);
            assert_eq!(h, *expected);
            parent = Some(h);
        }
        // A longer prompt with the same start shares the first hashes exactly.
        let mut longer = keys.clone();
        longer.extend(texts(100..116));
        assert_eq!(chain_all(&longer, 8, 3)[..all.len()], all[..]);
    }

    /// Guards against accidental changes of the byte layout or hash algorithm (which would silently
    /// invalidate anything keyed by these hashes); the values were computed once with this code and
    /// xxhash-rust 0.8, they are not an independent oracle.
    #[test]
    fn stable_known_values() {
        assert_eq!(TokenKey::text(42).raw(), KNOWN_TEXT_42);
        let keys = [
            TokenKey::text(1),
            TokenKey::image(0xdead_beef, 2),
            TokenKey::embed(5, 3),
        ];
        let root = BlockHash::chain(None, &keys, 0);
        assert_eq!(root.raw(), KNOWN_ROOT);
        assert_eq!(BlockHash::chain(Some(root), &keys, 7).raw(), KNOWN_CHILD);
    }

    /// The streaming hash equals one-shot xxh64 over the documented byte layout.
    #[test]
    fn chain_matches_documented_layout() {
        let keys = [TokenKey::text(1), TokenKey::image(3, 4)];
        let parent = BlockHash(0x0123_4567_89ab_cdef);
        let mut bytes = vec![b'B', 1];
        bytes.extend(parent.0.to_le_bytes());
        bytes.extend(9u64.to_le_bytes());
        bytes.extend(2u64.to_le_bytes());
        keys.iter().for_each(|k| bytes.extend(k.0.to_le_bytes()));
        assert_eq!(BlockHash::chain(Some(parent), &keys, 9).0, xxh64(&bytes, 0));
    }

    const KNOWN_TEXT_42: u64 = 0xbcef_c77f_aef4_b383;
    const KNOWN_ROOT: u64 = 0x21c3_38b9_6c18_6868;
    const KNOWN_CHILD: u64 = 0xfad9_4c49_e715_a7d8;
}
