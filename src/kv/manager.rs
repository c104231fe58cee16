//! The KV block manager (after nano-vllm's `BlockManager`): per-sequence block tables over a shared
//! [`BlockPool`](super::block_pool), prefix reuse through the hash chain, and the accounting the model
//! runner needs (which slots to write, how many tokens are already computed).
//!
//! Life of a sequence: [`KvBlockManager::allocate`] reuses the longest cached chain of full blocks and
//! allocates the rest; the runner writes K/V for tokens `num_computed..` and reports them with
//! [`KvBlockManager::mark_computed`], which registers each newly completed block; decode adds tokens with
//! [`KvBlockManager::append`]; speculative rollback uses [`KvBlockManager::truncate`];
//! [`KvBlockManager::free`] drops the sequence, leaving its registered blocks cached for later requests.
//!
//! Invariant the runner relies on: every block at or after the block holding token `num_computed` (the
//! blocks it may still write) is private to the sequence (one reference) and unregistered, so a write
//! never changes K/V that another sequence reads or that the index advertises.

use std::collections::BTreeMap;

use super::block_pool::{BlockId, BlockPool, Content};
use super::hash::{BlockHash, TokenKey};
use crate::error::{Error, Result};

/// Handle of a sequence in a [`KvBlockManager`]; valid until [`KvBlockManager::free`].
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Debug)]
pub struct SeqId(u64);

/// The result of [`KvBlockManager::allocate`].
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct Allocation {
    /// The new sequence.
    pub seq: SeqId,
    /// Its block table. // [ceil(keys.len() / block_size)]
    pub block_table: Vec<BlockId>,
    /// Leading tokens whose K/V are already in the cache (a multiple of the block size); the runner
    /// computes tokens `reused_tokens..`.
    pub reused_tokens: usize,
}

/// Counters and gauges of a [`KvBlockManager`].
#[derive(Clone, Copy, PartialEq, Eq, Default, Debug)]
pub struct KvStats {
    /// Tokens served from the cache by `allocate`, since creation.
    pub tokens_reused: u64,
    /// Tokens reported written by `mark_computed`, since creation.
    pub tokens_computed: u64,
    /// Cached blocks evicted to make room, since creation.
    pub evictions: u64,
    /// Blocks referenced by at least one sequence.
    pub blocks_in_use: usize,
    /// Unreferenced blocks that still hold registered K/V (reusable until evicted).
    pub blocks_cached_free: usize,
    /// Unreferenced, unregistered blocks.
    pub blocks_free: usize,
}

/// Per-sequence state.
#[derive(Debug)]
struct Sequence {
    /// Keys of all tokens of the sequence. // [num_tokens]
    keys: Vec<TokenKey>,
    /// Request-wide salt (adapter id, gate mode) mixed into every block hash.
    salt: u64,
    /// Blocks holding the tokens' K/V, in order. // [ceil(num_tokens / block_size)]
    block_table: Vec<BlockId>,
    /// Tokens `..num_computed` have their K/V written (or reused).
    num_computed: usize,
    /// Chained hashes of the full computed blocks. // [num_computed / block_size]
    hashes: Vec<BlockHash>,
}

/// Bookkeeping of a paged KV cache with exact prefix reuse, lazy eviction and a collision guard.
///
/// ```
/// use recall::kv::{KvBlockManager, TokenKey};
/// let mut kv = KvBlockManager::new(8, 4)?;
/// let prompt: Vec<TokenKey> = (0..10).map(TokenKey::text).collect();
/// let a = kv.allocate(&prompt, 0, prompt.len() - 1)?;
/// assert_eq!((a.block_table.len(), a.reused_tokens), (3, 0));
/// kv.mark_computed(a.seq, prompt.len())?; // the runner wrote K/V for all 10 tokens
/// kv.free(a.seq)?;
/// let b = kv.allocate(&prompt, 0, prompt.len() - 1)?;
/// assert_eq!(b.reused_tokens, 8); // two full blocks; the partial third is never matched
/// assert_eq!(kv.slot(b.seq, 9), b.block_table[2].index() * 4 + 1);
/// # Ok::<(), recall::Error>(())
/// ```
#[derive(Debug)]
pub struct KvBlockManager {
    /// Tokens per block.
    block_size: usize,
    /// Blocks, their reference counts, the prefix index and the free lists.
    pool: BlockPool,
    /// Live sequences (ordered so iteration is deterministic).
    seqs: BTreeMap<SeqId, Sequence>,
    /// Next `SeqId` to hand out; ids are never reused.
    next_seq: u64,
    /// See [`KvStats::tokens_reused`].
    tokens_reused: u64,
    /// See [`KvStats::tokens_computed`].
    tokens_computed: u64,
}

impl KvBlockManager {
    /// A manager of `num_blocks` blocks of `block_size` tokens; errors if either is 0 or there are more
    /// than `u32::MAX` blocks.
    ///
    /// ```
    /// let kv = recall::kv::KvBlockManager::new(1024, 16)?;
    /// assert_eq!(kv.stats().blocks_free, 1024);
    /// # Ok::<(), recall::Error>(())
    /// ```
    pub fn new(num_blocks: usize, block_size: usize) -> Result<Self> {
        if num_blocks == 0 || block_size == 0 || num_blocks > u32::MAX as usize {
            return Err(Error::InvalidRequest(format!(
                "KV cache of {num_blocks} blocks of {block_size} tokens: need 1..=2^32-1 blocks of at least 1 token"
            )));
        }
        Ok(Self {
            block_size,
            pool: BlockPool::new(num_blocks, block_size),
            seqs: BTreeMap::new(),
            next_seq: 0,
            tokens_reused: 0,
            tokens_computed: 0,
        })
    }

    /// A manager with as many blocks as fit in `bytes` (`bytes_per_block` covers all layers' K and V
    /// of one block).
    ///
    /// ```
    /// let kv = recall::kv::KvBlockManager::from_capacity(10 << 20, 3 << 20, 16)?;
    /// assert_eq!(kv.num_blocks(), 3);
    /// # Ok::<(), recall::Error>(())
    /// ```
    pub fn from_capacity(bytes: usize, bytes_per_block: usize, block_size: usize) -> Result<Self> {
        if bytes_per_block == 0 {
            return Err(Error::InvalidRequest("KV cache: bytes_per_block is 0".into()));
        }
        Self::new(bytes / bytes_per_block, block_size).map_err(|e| {
            Error::InvalidRequest(format!("{bytes} bytes at {bytes_per_block} bytes per block: {e}"))
        })
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks in the pool.
    pub fn num_blocks(&self) -> usize {
        self.pool.num_blocks()
    }

    /// Blocks that allocation can use now: empty-free plus cached-free (evictable).
    pub fn available_blocks(&self) -> usize {
        self.pool.available()
    }

    /// Creates a sequence for `keys`, reusing the longest cached chain of full blocks with at most
    /// `reuse_limit` tokens (rounded down to a block boundary), and allocating blocks for the rest.
    ///
    /// The caller sets `reuse_limit` to keep at least one token to compute (`keys.len() - 1`) and to keep
    /// a match from ending inside an image (the image's first token). A chain can also stop early at a
    /// cache miss; use [`allocate_with`](Self::allocate_with) when that must not land inside an image.
    /// Errors (changing nothing) when the pool lacks blocks even after evicting every cached-free block.
    ///
    /// ```
    /// use recall::kv::{KvBlockManager, TokenKey};
    /// let mut kv = KvBlockManager::new(6, 2)?;
    /// let keys: Vec<TokenKey> = (0..6).map(TokenKey::text).collect();
    /// let a = kv.allocate(&keys, 0, 5)?;
    /// kv.mark_computed(a.seq, 6)?;
    /// let b = kv.allocate(&keys, 0, 3)?; // shares a block with the live `a`
    /// assert_eq!(b.reused_tokens, 2); // 3 rounded down to the block boundary
    /// assert_eq!(b.block_table[0], a.block_table[0]);
    /// assert!(kv.allocate(&keys, 7, 5).is_err()); // other salt: no reuse, 3 blocks needed, 1 left
    /// # Ok::<(), recall::Error>(())
    /// ```
    pub fn allocate(&mut self, keys: &[TokenKey], salt: u64, reuse_limit: usize) -> Result<Allocation> {
        self.allocate_inner(keys, salt, reuse_limit / self.block_size, |r| r, 0)
    }

    /// Like [`allocate`](Self::allocate), but the reuse length is chosen by `allowed`: given the length
    /// `r` of the cached chain (a multiple of the block size), `allowed(r)` returns the longest allowed
    /// reuse `<= r` (e.g. the start of an image that `r` falls inside, and at most `keys.len() - 1`). The
    /// result is rounded down to a block boundary and `allowed` is applied again until it is stable, so
    /// the final reuse is a block boundary that `allowed` accepts.
    ///
    /// ```
    /// use recall::kv::{KvBlockManager, TokenKey};
    /// let mut kv = KvBlockManager::new(8, 2)?;
    /// // Text 0..3, then an image of 4 tokens at 3..7, then text.
    /// let mut keys: Vec<TokenKey> = (0..3).map(TokenKey::text).collect();
    /// keys.extend((0..4).map(|i| TokenKey::image(0xabc, i)));
    /// keys.push(TokenKey::text(9));
    /// let a = kv.allocate(&keys, 0, 7)?;
    /// kv.mark_computed(a.seq, 6)?; // blocks 0..3 complete, the image is half done
    /// let outside_image = |r: usize| if r > 3 && r < 7 { 3 } else { r.min(7) };
    /// let b = kv.allocate_with(&keys, 0, outside_image)?;
    /// assert_eq!(b.reused_tokens, 2); // 6 is inside the image -> 3 -> block boundary 2
    /// # Ok::<(), recall::Error>(())
    /// ```
    pub fn allocate_with(
        &mut self,
        keys: &[TokenKey],
        salt: u64,
        allowed: impl Fn(usize) -> usize,
    ) -> Result<Allocation> {
        self.allocate_inner(keys, salt, usize::MAX, allowed, 0)
    }

    /// Like [`allocate_with`](Self::allocate_with), but fails (changing nothing) unless `keep_free`
    /// blocks stay available afterwards: the scheduler admits a request only if the running
    /// sequences keep room to decode.
    ///
    /// ```
    /// use recall::kv::{KvBlockManager, TokenKey};
    /// let mut kv = KvBlockManager::new(4, 2)?;
    /// let keys: Vec<TokenKey> = (0..4).map(TokenKey::text).collect();
    /// assert!(kv.allocate_within(&keys, 0, |r| r, 3).is_err()); // 2 blocks needed, 4 - 3 allowed
    /// assert!(kv.allocate_within(&keys, 0, |r| r, 2).is_ok());
    /// # Ok::<(), recall::Error>(())
    /// ```
    pub fn allocate_within(
        &mut self,
        keys: &[TokenKey],
        salt: u64,
        allowed: impl Fn(usize) -> usize,
        keep_free: usize,
    ) -> Result<Allocation> {
        self.allocate_inner(keys, salt, usize::MAX, allowed, keep_free)
    }

    fn allocate_inner(
        &mut self,
        keys: &[TokenKey],
        salt: u64,
        max_blocks: usize,
        allowed: impl Fn(usize) -> usize,
        keep_free: usize,
    ) -> Result<Allocation> {
        let bs = self.block_size;
        let (mut hits, mut hashes) = self.cached_chain(keys, salt, max_blocks);
        let mut reuse = hits.len() * bs;
        loop {
            let next = allowed(reuse).min(reuse) / bs * bs;
            if next == reuse {
                break;
            }
            reuse = next;
        }
        hits.truncate(reuse / bs);
        hashes.truncate(reuse / bs);

        let needed = keys.len().div_ceil(bs) - hits.len();
        // Cached-free blocks we are about to revive cannot also serve as fresh blocks.
        let mut revived: Vec<BlockId> = hits
            .iter()
            .copied()
            .filter(|&b| self.pool.ref_count(b) == 0)
            .collect();
        revived.sort_unstable();
        revived.dedup();
        let available = self.pool.available() - revived.len();
        if needed + keep_free > available {
            return Err(Error::KvCacheFull {
                what: format!("a sequence of {} tokens ({reuse} reused)", keys.len()),
                needed,
                available,
                total: self.pool.num_blocks(),
            });
        }

        for &b in &hits {
            self.pool.retain(b);
        }
        let mut block_table = hits;
        for _ in 0..needed {
            block_table.push(self.pool.acquire().expect("availability checked above"));
        }
        let seq = SeqId(self.next_seq);
        self.next_seq += 1;
        self.tokens_reused += reuse as u64;
        tracing::trace!(
            ?seq,
            tokens = keys.len(),
            reused = reuse,
            blocks = block_table.len(),
            "allocate"
        );
        self.seqs.insert(
            seq,
            Sequence {
                keys: keys.to_vec(),
                salt,
                block_table: block_table.clone(),
                num_computed: reuse,
                hashes,
            },
        );
        Ok(Allocation {
            seq,
            block_table,
            reused_tokens: reuse,
        })
    }

    /// The cached blocks holding the longest chain of full blocks of `keys` (at most `max_blocks`), with
    /// their hashes; stops at the first miss or content mismatch.
    fn cached_chain(
        &self,
        keys: &[TokenKey],
        salt: u64,
        max_blocks: usize,
    ) -> (Vec<BlockId>, Vec<BlockHash>) {
        let (mut hits, mut hashes) = (Vec::new(), Vec::new());
        for chunk in keys.chunks_exact(self.block_size).take(max_blocks) {
            let parent = hashes.last().copied();
            let hash = BlockHash::chain(parent, chunk, salt);
            match self.pool.lookup(hash, parent, salt, chunk) {
                Some(b) => {
                    hits.push(b);
                    hashes.push(hash);
                }
                None => break,
            }
        }
        (hits, hashes)
    }

    /// Adds one token (decode), allocating a block when the last one is full. Errors, changing nothing,
    /// when no block is available.
    ///
    /// ```
    /// use recall::kv::{KvBlockManager, TokenKey};
    /// let mut kv = KvBlockManager::new(2, 2)?;
    /// let a = kv.allocate(&[TokenKey::text(1), TokenKey::text(2)], 0, 1)?;
    /// kv.append(a.seq, TokenKey::text(3))?; // second block
    /// kv.append(a.seq, TokenKey::text(4))?;
    /// assert!(kv.append(a.seq, TokenKey::text(5)).is_err()); // pool exhausted
    /// assert_eq!(kv.num_tokens(a.seq), 4);
    /// # Ok::<(), recall::Error>(())
    /// ```
    pub fn append(&mut self, seq: SeqId, key: TokenKey) -> Result<()> {
        let s = self.seqs.get_mut(&seq).ok_or_else(|| unknown(seq))?;
        if s.keys.len() % self.block_size == 0 {
            let total = self.pool.num_blocks();
            let block = self.pool.acquire().ok_or_else(|| Error::KvCacheFull {
                what: format!("appending a token to {seq:?}"),
                needed: 1,
                available: 0,
                total,
            })?;
            s.block_table.push(block);
        }
        s.keys.push(key);
        Ok(())
    }

    /// Records that the runner wrote K/V for tokens `..upto`, and registers every newly completed full
    /// block in the prefix index (only now, after the write, may other sequences reuse it). A block
    /// whose hash is already registered to another block stays unregistered (no duplicates). `upto` at
    /// or below `num_computed` is a no-op; above `num_tokens` an error.
    ///
    /// ```
    /// use recall::kv::{KvBlockManager, TokenKey};
    /// let mut kv = KvBlockManager::new(4, 2)?;
    /// let keys: Vec<TokenKey> = (0..4).map(TokenKey::text).collect();
    /// let a = kv.allocate(&keys, 0, 3)?;
    /// assert_eq!(kv.allocate(&keys, 0, 3)?.reused_tokens, 0); // not written yet: no reuse
    /// kv.mark_computed(a.seq, 3)?;
    /// assert_eq!(kv.num_computed(a.seq), 3);
    /// assert!(kv.mark_computed(a.seq, 5).is_err());
    /// # Ok::<(), recall::Error>(())
    /// ```
    pub fn mark_computed(&mut self, seq: SeqId, upto: usize) -> Result<()> {
        let bs = self.block_size;
        let s = self.seqs.get_mut(&seq).ok_or_else(|| unknown(seq))?;
        if upto > s.keys.len() {
            return Err(Error::InvalidRequest(format!(
                "mark_computed({seq:?}, {upto}) past the sequence's {} tokens",
                s.keys.len()
            )));
        }
        if upto <= s.num_computed {
            return Ok(());
        }
        self.tokens_computed += (upto - s.num_computed) as u64;
        for b in s.hashes.len()..upto / bs {
            let parent = s.hashes.last().copied();
            let keys = &s.keys[b * bs..(b + 1) * bs];
            let hash = BlockHash::chain(parent, keys, s.salt);
            s.hashes.push(hash);
            let content = Content {
                hash,
                parent,
                salt: s.salt,
                keys: keys.to_vec(),
            };
            self.pool.register(s.block_table[b], content);
        }
        s.num_computed = upto;
        Ok(())
    }

    /// Drops tokens `len..` (speculative rollback); `len > num_tokens` is an error.
    ///
    /// Blocks past the new end are released (registered ones stay cached). If the new last block is
    /// partial, the sequence will overwrite its tail, so:
    /// * if the sequence holds the only reference, the block is unregistered (its leading rows stay
    ///   valid and computed);
    /// * if other sequences share it (it came from the cache), the sequence releases it (it stays
    ///   registered for the others) and takes a fresh block, and `num_computed` drops to the block
    ///   boundary, so the runner recomputes those `< block_size` tokens instead of copying rows.
    ///
    /// Only that second case needs a block; when none is available it errors, changing nothing.
    ///
    /// ```
    /// use recall::kv::{KvBlockManager, TokenKey};
    /// let mut kv = KvBlockManager::new(4, 2)?;
    /// let keys: Vec<TokenKey> = (0..6).map(TokenKey::text).collect();
    /// let a = kv.allocate(&keys, 0, 5)?;
    /// kv.mark_computed(a.seq, 6)?;
    /// kv.truncate(a.seq, 3)?; // rejected draft tokens 3..6
    /// assert_eq!((kv.num_tokens(a.seq), kv.num_computed(a.seq), kv.block_table(a.seq).len()), (3, 3, 2));
    /// # Ok::<(), recall::Error>(())
    /// ```
    pub fn truncate(&mut self, seq: SeqId, len: usize) -> Result<()> {
        let bs = self.block_size;
        let s = self.seqs.get_mut(&seq).ok_or_else(|| unknown(seq))?;
        if len > s.keys.len() {
            return Err(Error::InvalidRequest(format!(
                "truncate({seq:?}, {len}) past the sequence's {} tokens",
                s.keys.len()
            )));
        }
        let kept_blocks = len.div_ceil(bs);
        let tail = &s.block_table[kept_blocks..];
        let partial = (!len.is_multiple_of(bs)).then(|| s.block_table[kept_blocks - 1]);
        let needs_fresh = partial.is_some_and(|b| self.pool.ref_count(b) > 1);
        // Releasing a tail block we hold alone makes it available, so only this case can fail.
        if needs_fresh && self.pool.available() == 0 && !tail.iter().any(|&b| self.pool.ref_count(b) == 1) {
            return Err(Error::KvCacheFull {
                what: format!("truncating {seq:?} inside a shared block"),
                needed: 1,
                available: 0,
                total: self.pool.num_blocks(),
            });
        }

        for &b in s.block_table[kept_blocks..].iter().rev() {
            self.pool.release(b);
        }
        s.block_table.truncate(kept_blocks);
        s.keys.truncate(len);
        s.num_computed = s.num_computed.min(len);
        if let Some(b) = partial {
            if needs_fresh {
                self.pool.release(b);
                s.block_table[kept_blocks - 1] = self.pool.acquire().expect("availability checked above");
                s.num_computed = s.num_computed.min(len / bs * bs);
            } else {
                self.pool.unregister(b);
            }
        }
        s.hashes.truncate(s.num_computed / bs);
        Ok(())
    }

    /// Drops the sequence, releasing its blocks (last block first, so that a sequence's tail is evicted
    /// before its head); registered blocks stay cached until evicted.
    ///
    /// ```
    /// use recall::kv::{KvBlockManager, TokenKey};
    /// let mut kv = KvBlockManager::new(4, 2)?;
    /// let a = kv.allocate(&[TokenKey::text(1), TokenKey::text(2), TokenKey::text(3)], 0, 2)?;
    /// kv.mark_computed(a.seq, 3)?;
    /// kv.free(a.seq)?;
    /// let st = kv.stats();
    /// assert_eq!((st.blocks_in_use, st.blocks_cached_free, st.blocks_free), (0, 1, 3));
    /// # Ok::<(), recall::Error>(())
    /// ```
    pub fn free(&mut self, seq: SeqId) -> Result<()> {
        let s = self.seqs.remove(&seq).ok_or_else(|| unknown(seq))?;
        for &b in s.block_table.iter().rev() {
            self.pool.release(b);
        }
        Ok(())
    }

    /// Whether `seq` is a live sequence of this manager.
    pub fn contains(&self, seq: SeqId) -> bool {
        self.seqs.contains_key(&seq)
    }

    /// Pool row (slot) of token `i` of `seq`: `block_table[i / block_size] * block_size + i % block_size`.
    ///
    /// # Panics
    /// If `seq` is not live or `i >= num_tokens(seq)` (a stale handle or out-of-range index is a bug in
    /// the caller, as with slice indexing).
    pub fn slot(&self, seq: SeqId, i: usize) -> usize {
        let s = self.seq(seq);
        assert!(
            i < s.keys.len(),
            "slot({seq:?}, {i}) past the sequence's {} tokens",
            s.keys.len()
        );
        s.block_table[i / self.block_size].index() * self.block_size + i % self.block_size
    }

    /// The sequence's block table. // [ceil(num_tokens / block_size)]
    ///
    /// # Panics
    /// If `seq` is not live.
    pub fn block_table(&self, seq: SeqId) -> &[BlockId] {
        &self.seq(seq).block_table
    }

    /// Tokens in the sequence.
    ///
    /// # Panics
    /// If `seq` is not live.
    pub fn num_tokens(&self, seq: SeqId) -> usize {
        self.seq(seq).keys.len()
    }

    /// Tokens whose K/V are written or reused; the runner computes `num_computed..num_tokens`.
    ///
    /// # Panics
    /// If `seq` is not live.
    pub fn num_computed(&self, seq: SeqId) -> usize {
        self.seq(seq).num_computed
    }

    /// Counters and gauges.
    pub fn stats(&self) -> KvStats {
        KvStats {
            tokens_reused: self.tokens_reused,
            tokens_computed: self.tokens_computed,
            evictions: self.pool.evictions(),
            blocks_in_use: self.pool.num_blocks() - self.pool.available(),
            blocks_cached_free: self.pool.num_cached_free(),
            blocks_free: self.pool.num_free(),
        }
    }

    fn seq(&self, seq: SeqId) -> &Sequence {
        self.seqs
            .get(&seq)
            .unwrap_or_else(|| panic!("{seq:?} is not a live sequence"))
    }

    /// Checks every structural invariant (for tests and debugging; O(blocks + tokens)):
    /// * each block is exactly one of referenced, cached-free (in the LRU list), empty-free, and the index
    ///   maps each hash to exactly one block storing that hash (see the pool's check);
    /// * reference counts equal the number of (sequence, block-table entry) pairs naming the block;
    /// * per sequence: `block_table.len() == ceil(num_tokens / block_size)`, `num_computed <= num_tokens`,
    ///   its chained hashes match its keys and cover exactly the full computed blocks, a registered block
    ///   in its table holds exactly its keys, and every block it may still write is private and
    ///   unregistered.
    pub fn check_invariants(&self) -> Result<(), String> {
        self.pool.check_invariants()?;
        let bs = self.block_size;
        let mut refs = vec![0u32; self.pool.num_blocks()];
        for (id, s) in &self.seqs {
            let n = s.keys.len();
            if s.block_table.len() != n.div_ceil(bs) {
                return Err(format!("{id:?}: {} blocks for {n} tokens", s.block_table.len()));
            }
            if s.num_computed > n || s.hashes.len() != s.num_computed / bs {
                return Err(format!(
                    "{id:?}: {} computed of {n} tokens with {} block hashes",
                    s.num_computed,
                    s.hashes.len()
                ));
            }
            for (b, &block) in s.block_table.iter().enumerate() {
                refs[block.index()] += 1;
                let content = self.pool.content(block);
                if b < s.hashes.len() {
                    let keys = &s.keys[b * bs..(b + 1) * bs];
                    let parent = b.checked_sub(1).map(|p| s.hashes[p]);
                    if BlockHash::chain(parent, keys, s.salt) != s.hashes[b] {
                        return Err(format!("{id:?}: hash of block {b} does not match its keys"));
                    }
                    let expected = Content {
                        hash: s.hashes[b],
                        parent,
                        salt: s.salt,
                        keys: keys.to_vec(),
                    };
                    if content.is_some_and(|c| *c != expected) {
                        return Err(format!(
                            "{id:?}: block {b} ({block:?}) is registered with other content"
                        ));
                    }
                } else if content.is_some() || self.pool.ref_count(block) != 1 {
                    return Err(format!(
                        "{id:?}: writable block {b} ({block:?}) is registered or shared (ref_count {})",
                        self.pool.ref_count(block)
                    ));
                }
            }
        }
        for (i, &r) in refs.iter().enumerate() {
            let actual = self.pool.ref_count(BlockId(i as u32));
            if actual != r {
                return Err(format!(
                    "block {i}: ref_count {actual}, but {r} block-table entries"
                ));
            }
        }
        let st = self.stats();
        if st.blocks_in_use + st.blocks_cached_free + st.blocks_free != self.pool.num_blocks() {
            return Err(format!(
                "{st:?} does not add up to {} blocks",
                self.pool.num_blocks()
            ));
        }
        Ok(())
    }
}

fn unknown(seq: SeqId) -> Error {
    Error::InvalidRequest(format!("{seq:?} is not a live KV sequence"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn texts(ids: std::ops::Range<u32>) -> Vec<TokenKey> {
        ids.map(TokenKey::text).collect()
    }

    /// Allocates `keys` with the maximum sensible reuse and marks every token computed.
    fn computed(kv: &mut KvBlockManager, keys: &[TokenKey], salt: u64) -> Allocation {
        let a = kv.allocate(keys, salt, keys.len().saturating_sub(1)).unwrap();
        kv.mark_computed(a.seq, keys.len()).unwrap();
        kv.check_invariants().unwrap();
        a
    }

    #[test]
    fn constructors_validate() {
        assert!(KvBlockManager::new(0, 16).is_err());
        assert!(KvBlockManager::new(16, 0).is_err());
        assert!(KvBlockManager::from_capacity(100, 0, 16).is_err());
        assert!(KvBlockManager::from_capacity(100, 101, 16).is_err());
        let kv = KvBlockManager::from_capacity(1000, 300, 16).unwrap();
        assert_eq!((kv.num_blocks(), kv.block_size()), (3, 16));
    }

    #[test]
    fn hit_after_register() {
        let mut kv = KvBlockManager::new(8, 4).unwrap();
        let keys = texts(0..10);
        let a = computed(&mut kv, &keys, 0);
        kv.free(a.seq).unwrap();
        let b = kv.allocate(&keys, 0, 9).unwrap();
        assert_eq!(b.reused_tokens, 8);
        assert_eq!(b.block_table[..2], a.block_table[..2]);
        assert_eq!(kv.num_computed(b.seq), 8);
        assert_eq!(kv.stats().tokens_reused, 8);
        // A longer prompt with the same start reuses the same blocks while the first is live.
        let mut longer = keys.clone();
        longer.extend(texts(50..60));
        let c = kv.allocate(&longer, 0, 19).unwrap();
        assert_eq!(c.reused_tokens, 8);
        assert_eq!(kv.block_table(c.seq)[..2], a.block_table[..2]);
        kv.check_invariants().unwrap();
    }

    #[test]
    fn no_hit_before_mark_computed() {
        let mut kv = KvBlockManager::new(16, 4).unwrap();
        let keys = texts(0..12);
        let a = kv.allocate(&keys, 0, 11).unwrap();
        assert_eq!(kv.allocate(&keys, 0, 11).unwrap().reused_tokens, 0);
        kv.mark_computed(a.seq, 6).unwrap(); // only the first block is complete
        assert_eq!(kv.allocate(&keys, 0, 11).unwrap().reused_tokens, 4);
        kv.check_invariants().unwrap();
    }

    #[test]
    fn collision_guard_turns_forged_hit_into_miss() {
        let mut kv = KvBlockManager::new(8, 2).unwrap();
        let (real, other) = (texts(0..2), texts(5..7));
        let a = kv.allocate(&real, 0, 1).unwrap();
        // Forge an index entry: `other`'s hash pointing at a block that holds `real`.
        let hash = BlockHash::chain(None, &other, 0);
        let content = Content {
            hash,
            parent: None,
            salt: 0,
            keys: real.clone(),
        };
        assert!(kv.pool.register(a.block_table[0], content));
        let b = kv
            .allocate(&[other.clone(), texts(9..10)].concat(), 0, 2)
            .unwrap();
        assert_eq!(b.reused_tokens, 0);
        assert!(!b.block_table.contains(&a.block_table[0]));
    }

    #[test]
    fn partial_last_block_never_matched() {
        let mut kv = KvBlockManager::new(8, 4).unwrap();
        let keys = texts(0..6);
        let a = computed(&mut kv, &keys, 0);
        kv.free(a.seq).unwrap();
        assert_eq!(kv.stats().blocks_cached_free, 1);
        let b = kv.allocate(&keys, 0, usize::MAX).unwrap();
        assert_eq!(b.reused_tokens, 4);
        assert_eq!(b.block_table[0], a.block_table[0]);
        assert_eq!(kv.stats().blocks_cached_free, 0);
    }

    #[test]
    fn whole_prompt_reusable_when_limit_allows() {
        let mut kv = KvBlockManager::new(8, 4).unwrap();
        let keys = texts(0..8);
        computed(&mut kv, &keys, 0);
        let b = kv.allocate(&keys, 0, 8).unwrap();
        assert_eq!((b.reused_tokens, kv.num_computed(b.seq)), (8, 8));
        kv.append(b.seq, TokenKey::text(99)).unwrap();
        assert_eq!(kv.block_table(b.seq).len(), 3);
        kv.check_invariants().unwrap();
    }

    #[test]
    fn reuse_limit_respected_and_rounded_down() {
        let mut kv = KvBlockManager::new(16, 4).unwrap();
        let keys = texts(0..13);
        computed(&mut kv, &keys, 0);
        for (limit, expected) in [(12, 12), (11, 8), (8, 8), (7, 4), (4, 4), (3, 0), (0, 0)] {
            let b = kv.allocate(&keys, 0, limit).unwrap();
            assert_eq!(b.reused_tokens, expected, "reuse_limit {limit}");
            kv.free(b.seq).unwrap();
        }
        kv.check_invariants().unwrap();
    }

    #[test]
    fn allocate_with_keeps_match_outside_image_after_a_miss() {
        let mut kv = KvBlockManager::new(16, 2).unwrap();
        // Text 0..3, image at 3..9, text 9..11.
        let mut keys = texts(0..3);
        keys.extend((0..6).map(|i| TokenKey::image(7, i)));
        keys.extend(texts(20..22));
        let a = kv.allocate(&keys, 0, 10).unwrap();
        kv.mark_computed(a.seq, 7).unwrap(); // the chain ends at 6, inside the image
        let outside = |r: usize| if (4..9).contains(&r) { 3 } else { r.min(10) };
        assert_eq!(kv.allocate(&keys, 0, 10).unwrap().reused_tokens, 6);
        assert_eq!(kv.allocate_with(&keys, 0, outside).unwrap().reused_tokens, 2);
        kv.mark_computed(a.seq, 11).unwrap();
        assert_eq!(kv.allocate_with(&keys, 0, outside).unwrap().reused_tokens, 10);
        kv.check_invariants().unwrap();
    }

    #[test]
    fn salt_separates_cache_entries() {
        let mut kv = KvBlockManager::new(8, 2).unwrap();
        let keys = texts(0..5);
        computed(&mut kv, &keys, 1);
        assert_eq!(kv.allocate(&keys, 2, 4).unwrap().reused_tokens, 0);
        assert_eq!(kv.allocate(&keys, 1, 4).unwrap().reused_tokens, 4);
    }

    #[test]
    fn eviction_picks_lru() {
        let mut kv = KvBlockManager::new(4, 2).unwrap();
        let (x, y) = (texts(0..2), texts(10..12));
        let a = computed(&mut kv, &x, 0);
        let b = computed(&mut kv, &y, 0);
        kv.free(a.seq).unwrap();
        kv.free(b.seq).unwrap(); // LRU: x then y; 2 empty blocks left
        let c = kv.allocate(&texts(20..26), 0, 0).unwrap(); // 3 blocks: 2 empty, then evict x
        assert_eq!(kv.stats().evictions, 1);
        assert!(c.block_table.contains(&a.block_table[0]));
        kv.free(c.seq).unwrap();
        assert_eq!(
            kv.allocate(&[x.clone(), texts(0..1)].concat(), 0, 2)
                .unwrap()
                .reused_tokens,
            0
        );
        kv.check_invariants().unwrap();

        // A hit refreshes recency: y is used again, so a different cached block goes first.
        let mut kv = KvBlockManager::new(3, 2).unwrap();
        let a = computed(&mut kv, &x, 0);
        let b = computed(&mut kv, &y, 0);
        kv.free(a.seq).unwrap();
        kv.free(b.seq).unwrap();
        let again = kv.allocate(&[y.clone(), texts(0..1)].concat(), 0, 2).unwrap();
        assert_eq!(again.reused_tokens, 2);
        kv.free(again.seq).unwrap(); // order now: x, y (refreshed)
        let d = kv.allocate(&texts(30..34), 0, 0).unwrap(); // 1 empty + evicts x
        assert_eq!(kv.stats().evictions, 1);
        kv.free(d.seq).unwrap();
        assert_eq!(
            kv.allocate(&[y, texts(0..1)].concat(), 0, 2)
                .unwrap()
                .reused_tokens,
            2
        );
        kv.check_invariants().unwrap();
    }

    #[test]
    fn eviction_never_frees_a_referenced_block() {
        let mut kv = KvBlockManager::new(3, 2).unwrap();
        let a = computed(&mut kv, &texts(0..4), 0); // live, registered, 2 blocks
        assert!(kv.allocate(&texts(10..14), 0, 0).is_err()); // needs 2, 1 available
        let b = kv.allocate(&texts(10..11), 0, 0).unwrap();
        assert!(!a.block_table.contains(&b.block_table[0]));
        assert_eq!(kv.stats().evictions, 0);
        assert!(kv.append(b.seq, TokenKey::text(1)).is_ok()); // same block
        assert!(kv.append(b.seq, TokenKey::text(2)).is_err()); // a new block: none left
        assert_eq!(kv.num_tokens(b.seq), 2);
        kv.check_invariants().unwrap();
    }

    #[test]
    fn allocation_failure_leaves_state_unchanged() {
        let mut kv = KvBlockManager::new(4, 2).unwrap();
        let keys = texts(0..4);
        let a = computed(&mut kv, &keys, 0);
        kv.free(a.seq).unwrap();
        computed(&mut kv, &texts(50..52), 0); // 1 block in use; 2 cached (hits), 1 empty
        let before = (kv.stats(), kv.pool.lru_order(), kv.seqs.len());
        // Reuses both cached blocks, then needs 2 fresh: only 1 left once the hits are revived.
        let long = [keys.clone(), texts(4..8)].concat();
        let err = kv.allocate(&long, 0, 7).unwrap_err();
        assert!(
            matches!(
                err,
                Error::KvCacheFull {
                    needed: 2,
                    available: 1,
                    total: 4,
                    ..
                }
            ),
            "{err}"
        );
        assert_eq!((kv.stats(), kv.pool.lru_order(), kv.seqs.len()), before);
        kv.check_invariants().unwrap();
        // One fresh block fits.
        assert_eq!(
            kv.allocate(&[keys, texts(4..6)].concat(), 0, 5)
                .unwrap()
                .reused_tokens,
            4
        );
        kv.check_invariants().unwrap();
    }

    #[test]
    fn duplicate_content_is_registered_once() {
        let mut kv = KvBlockManager::new(8, 2).unwrap();
        let keys = texts(0..4);
        let a = kv.allocate(&keys, 0, 3).unwrap();
        let b = kv.allocate(&keys, 0, 3).unwrap(); // nothing cached yet: private blocks
        kv.mark_computed(a.seq, 4).unwrap();
        kv.mark_computed(b.seq, 4).unwrap();
        kv.check_invariants().unwrap();
        kv.free(b.seq).unwrap();
        kv.free(a.seq).unwrap();
        let st = kv.stats();
        assert_eq!(
            (st.blocks_cached_free, st.blocks_free, st.tokens_computed),
            (2, 6, 8)
        );
        let c = kv.allocate(&keys, 0, 4).unwrap();
        assert_eq!(c.block_table, a.block_table);
    }

    #[test]
    fn mark_computed_validates_and_is_idempotent() {
        let mut kv = KvBlockManager::new(4, 2).unwrap();
        let a = kv.allocate(&texts(0..3), 0, 2).unwrap();
        assert!(kv.mark_computed(a.seq, 4).is_err());
        kv.mark_computed(a.seq, 3).unwrap();
        kv.mark_computed(a.seq, 1).unwrap();
        assert_eq!(kv.num_computed(a.seq), 3);
        assert_eq!(kv.stats().tokens_computed, 3);
        kv.free(a.seq).unwrap();
        assert!(kv.mark_computed(a.seq, 1).is_err());
        assert!(kv.append(a.seq, TokenKey::text(0)).is_err());
        assert!(kv.truncate(a.seq, 0).is_err());
        assert!(kv.free(a.seq).is_err());
        assert!(!kv.contains(a.seq));
    }

    #[test]
    fn slots_follow_block_table() {
        let mut kv = KvBlockManager::new(8, 4).unwrap();
        kv.allocate(&texts(0..4), 0, 0).unwrap(); // occupies block 0
        let a = kv.allocate(&texts(0..9), 0, 0).unwrap();
        for i in 0..9 {
            assert_eq!(kv.slot(a.seq, i), a.block_table[i / 4].index() * 4 + i % 4);
        }
        assert_eq!(kv.slot(a.seq, 0), 4);
    }

    #[test]
    fn truncate_releases_tail_and_unregisters_private_partial_block() {
        let mut kv = KvBlockManager::new(8, 2).unwrap();
        let keys = texts(0..7);
        let a = computed(&mut kv, &keys, 0); // blocks 0..3 registered, block 3 partial
        let table = a.block_table.clone();
        kv.truncate(a.seq, 3).unwrap();
        assert_eq!((kv.num_tokens(a.seq), kv.num_computed(a.seq)), (3, 3));
        assert_eq!(kv.block_table(a.seq), &table[..2]);
        kv.check_invariants().unwrap();
        // Block 2 (tokens 4..6) was released but stays cached; block 1 is now partial and unregistered.
        let st = kv.stats();
        assert_eq!((st.blocks_in_use, st.blocks_cached_free), (2, 1));
        let probe = kv.allocate(&keys, 0, 6).unwrap();
        assert_eq!(probe.reused_tokens, 2);
        kv.free(probe.seq).unwrap();
        // The sequence continues differently: its block 1 is overwritten in place.
        kv.append(a.seq, TokenKey::text(100)).unwrap();
        kv.mark_computed(a.seq, 4).unwrap();
        assert_eq!(kv.block_table(a.seq), &table[..2]);
        kv.check_invariants().unwrap();
        let other = [texts(0..3), texts(100..101)].concat();
        assert_eq!(kv.allocate(&other, 0, 4).unwrap().reused_tokens, 4);
        // Truncating at a block boundary keeps the last block registered; to 0 releases everything.
        kv.truncate(a.seq, 2).unwrap();
        assert_eq!(kv.num_computed(a.seq), 2);
        kv.truncate(a.seq, 0).unwrap();
        assert!(kv.block_table(a.seq).is_empty());
        assert!(kv.truncate(a.seq, 1).is_err());
        kv.check_invariants().unwrap();
    }

    #[test]
    fn truncate_into_shared_block_swaps_it_for_a_fresh_one() {
        let mut kv = KvBlockManager::new(8, 4).unwrap();
        let keys = texts(0..9);
        let a = computed(&mut kv, &keys, 0);
        let b = kv.allocate(&keys, 0, 8).unwrap();
        assert_eq!(b.reused_tokens, 8);
        kv.truncate(b.seq, 6).unwrap(); // inside the shared second block
        let tb = kv.block_table(b.seq).to_vec();
        assert_eq!(tb[0], a.block_table[0]);
        assert_ne!(tb[1], a.block_table[1]);
        assert_eq!((kv.num_tokens(b.seq), kv.num_computed(b.seq)), (6, 4));
        kv.check_invariants().unwrap();
        // The shared block is untouched and still cached for everyone.
        assert_eq!(kv.allocate(&keys, 0, 8).unwrap().reused_tokens, 8);
        kv.mark_computed(b.seq, 6).unwrap();
        kv.check_invariants().unwrap();
    }

    #[test]
    fn truncate_failure_leaves_state_unchanged() {
        let mut kv = KvBlockManager::new(3, 2).unwrap();
        let keys = texts(0..4);
        computed(&mut kv, &keys, 0);
        let b = kv.allocate(&keys, 0, 4).unwrap(); // shares both blocks, holds no private one
        assert_eq!(b.reused_tokens, 4);
        kv.allocate(&texts(9..10), 0, 0).unwrap(); // the last block
        let snapshot =
            |kv: &KvBlockManager| (kv.stats(), kv.block_table(b.seq).to_vec(), kv.num_computed(b.seq));
        let before = snapshot(&kv);
        assert!(kv.truncate(b.seq, 3).is_err()); // needs a private block for tokens 2..3, none left
        assert_eq!(snapshot(&kv), before);
        kv.check_invariants().unwrap();
        kv.truncate(b.seq, 2).unwrap(); // at a block boundary nothing is written: no block needed
        kv.check_invariants().unwrap();
    }
}
