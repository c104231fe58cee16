//! The flat pool of KV blocks: reference counts, the prefix index, the LRU of cached free blocks and the
//! list of empty free blocks. Pure bookkeeping; the K/V rows live in the model runner's pool tensor.
//!
//! Every block is in exactly one state:
//! * referenced (`ref_count > 0`): in some sequence's block table; never evicted;
//! * cached-free (`ref_count == 0`, registered): its K/V are still valid and findable through the
//!   index; kept in LRU order and evicted (unregistered and handed out) only when no empty block is left;
//! * empty-free (`ref_count == 0`, not registered): handed out first.

use std::collections::HashMap;

use super::hash::{BlockHash, TokenKey};

/// Index of a block in the pool; the K/V rows of block `b` are rows `b * block_size ..
/// (b + 1) * block_size` of each layer's pool tensor.
///
/// ```
/// use recall::kv::BlockId;
/// assert_eq!(BlockId(3).index(), 3);
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Debug)]
pub struct BlockId(pub u32);

impl BlockId {
    /// The block's index as a `usize`.
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

/// What a registered block holds. Compared in full on every index hit (the collision guard): a hit
/// needs equal keys, salt and parent, not just an equal 64-bit hash.
#[derive(Clone, PartialEq, Eq, Debug)]
pub(crate) struct Content {
    /// The chained hash under which the block is in the index.
    pub hash: BlockHash,
    /// The hash of the block before it in the registering sequence (`None` for a first block).
    pub parent: Option<BlockHash>,
    /// The request salt (adapter id, gate mode) the K/V were computed with.
    pub salt: u64,
    /// The token keys whose K/V the block holds. // [block_size]
    pub keys: Vec<TokenKey>,
}

/// One block's bookkeeping.
#[derive(Default, Debug)]
struct Block {
    /// Number of (sequence, block-table entry) pairs naming this block.
    ref_count: u32,
    /// `Some` iff the block is in the index (its K/V are complete and may be reused).
    content: Option<Content>,
    /// Neighbour towards the LRU head (older); only meaningful while the block is cached-free.
    lru_prev: Option<BlockId>,
    /// Neighbour towards the LRU tail (newer); only meaningful while the block is cached-free.
    lru_next: Option<BlockId>,
}

/// The pool: a flat `Vec` of blocks with an intrusive doubly linked LRU list of cached-free blocks.
#[derive(Debug)]
pub(crate) struct BlockPool {
    /// Tokens per block; the length of every registered block's keys.
    block_size: usize,
    /// All blocks, indexed by `BlockId`. // [num_blocks]
    blocks: Vec<Block>,
    /// Empty-free blocks, used as a stack (the top is handed out first).
    free: Vec<BlockId>,
    /// Least recently released cached-free block: the next to be evicted.
    lru_head: Option<BlockId>,
    /// Most recently released cached-free block.
    lru_tail: Option<BlockId>,
    /// Number of blocks in the LRU list.
    lru_len: usize,
    /// Prefix index: chained hash -> the one block registered under it.
    index: HashMap<BlockHash, BlockId>,
    /// Cached-free blocks unregistered to make room, since creation.
    evictions: u64,
}

impl BlockPool {
    /// A pool of `num_blocks` empty-free blocks of `block_size` tokens (`num_blocks <= u32::MAX`).
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        let mut blocks = Vec::with_capacity(num_blocks);
        blocks.resize_with(num_blocks, Block::default);
        // Reversed so that blocks are handed out in ascending order from a fresh pool.
        let free = (0..num_blocks as u32).rev().map(BlockId).collect();
        Self {
            block_size,
            blocks,
            free,
            lru_head: None,
            lru_tail: None,
            lru_len: 0,
            index: HashMap::new(),
            evictions: 0,
        }
    }

    pub fn num_blocks(&self) -> usize {
        self.blocks.len()
    }

    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    pub fn num_cached_free(&self) -> usize {
        self.lru_len
    }

    /// Blocks that `acquire` can hand out: empty-free plus cached-free.
    pub fn available(&self) -> usize {
        self.free.len() + self.lru_len
    }

    pub fn evictions(&self) -> u64 {
        self.evictions
    }

    pub fn ref_count(&self, id: BlockId) -> u32 {
        self.blocks[id.index()].ref_count
    }

    pub fn content(&self, id: BlockId) -> Option<&Content> {
        self.blocks[id.index()].content.as_ref()
    }

    /// The block registered under `hash` if it holds exactly `keys` computed with `salt` after `parent`;
    /// a hash hit with other content is a miss.
    pub fn lookup(
        &self,
        hash: BlockHash,
        parent: Option<BlockHash>,
        salt: u64,
        keys: &[TokenKey],
    ) -> Option<BlockId> {
        let id = *self.index.get(&hash)?;
        let c = self.content(id)?;
        (c.parent == parent && c.salt == salt && c.keys == keys).then_some(id)
    }

    /// Takes one more reference on `id`, reviving it from the free lists if it had none.
    pub fn retain(&mut self, id: BlockId) {
        let block = &self.blocks[id.index()];
        if block.ref_count == 0 {
            if block.content.is_some() {
                self.lru_unlink(id);
            } else if let Some(pos) = self.free.iter().position(|&b| b == id) {
                self.free.swap_remove(pos);
            }
        }
        self.blocks[id.index()].ref_count += 1;
    }

    /// Hands out an unregistered block with one reference: an empty-free block if any, else the least
    /// recently used cached-free block, which is evicted (unregistered). `None` when neither exists.
    pub fn acquire(&mut self) -> Option<BlockId> {
        let id = match self.free.pop() {
            Some(id) => id,
            None => {
                let id = self.lru_head?;
                self.lru_unlink(id);
                if let Some(c) = self.blocks[id.index()].content.take() {
                    self.index.remove(&c.hash);
                }
                self.evictions += 1;
                tracing::trace!(block = id.0, "evicted cached KV block");
                id
            }
        };
        self.blocks[id.index()].ref_count = 1;
        Some(id)
    }

    /// Drops one reference; a block left without references becomes cached-free (most recently used)
    /// if registered, else empty-free.
    pub fn release(&mut self, id: BlockId) {
        let block = &mut self.blocks[id.index()];
        debug_assert!(block.ref_count > 0, "release of unreferenced block {id:?}");
        if block.ref_count == 0 {
            return;
        }
        block.ref_count -= 1;
        if block.ref_count == 0 {
            if block.content.is_some() {
                self.lru_push_tail(id);
            } else {
                self.free.push(id);
            }
        }
    }

    /// Registers a referenced block under `content.hash`. Returns false (and changes nothing) if the
    /// hash is already registered: the existing block is kept and no duplicate entry is made.
    pub fn register(&mut self, id: BlockId, content: Content) -> bool {
        debug_assert!(self.blocks[id.index()].ref_count > 0 && self.blocks[id.index()].content.is_none());
        if self.index.contains_key(&content.hash) {
            return false;
        }
        self.index.insert(content.hash, id);
        self.blocks[id.index()].content = Some(content);
        true
    }

    /// Removes a referenced block from the index (its contents are about to be overwritten).
    pub fn unregister(&mut self, id: BlockId) {
        debug_assert!(self.blocks[id.index()].ref_count > 0);
        if let Some(c) = self.blocks[id.index()].content.take() {
            self.index.remove(&c.hash);
        }
    }

    fn lru_unlink(&mut self, id: BlockId) {
        let (prev, next) = {
            let b = &mut self.blocks[id.index()];
            (b.lru_prev.take(), b.lru_next.take())
        };
        match prev {
            Some(p) => self.blocks[p.index()].lru_next = next,
            None => self.lru_head = next,
        }
        match next {
            Some(n) => self.blocks[n.index()].lru_prev = prev,
            None => self.lru_tail = prev,
        }
        self.lru_len -= 1;
    }

    fn lru_push_tail(&mut self, id: BlockId) {
        self.blocks[id.index()].lru_prev = self.lru_tail;
        self.blocks[id.index()].lru_next = None;
        match self.lru_tail {
            Some(t) => self.blocks[t.index()].lru_next = Some(id),
            None => self.lru_head = Some(id),
        }
        self.lru_tail = Some(id);
        self.lru_len += 1;
    }

    /// Cached-free blocks from least to most recently used.
    pub fn lru_order(&self) -> Vec<BlockId> {
        let mut out = Vec::with_capacity(self.lru_len);
        let mut cur = self.lru_head;
        while let Some(id) = cur {
            if out.len() > self.blocks.len() {
                break; // a cycle; reported by check_invariants
            }
            out.push(id);
            cur = self.blocks[id.index()].lru_next;
        }
        out
    }

    /// The pool's own invariants: each block in exactly one state, LRU links consistent, the index a
    /// bijection between hashes and registered blocks.
    pub fn check_invariants(&self) -> Result<(), String> {
        let n = self.blocks.len();
        let mut in_lru = vec![false; n];
        let mut in_free = vec![false; n];
        let order = self.lru_order();
        if order.len() != self.lru_len {
            return Err(format!(
                "LRU list has {} entries, lru_len is {}",
                order.len(),
                self.lru_len
            ));
        }
        let mut prev = None;
        for &id in &order {
            let b = &self.blocks[id.index()];
            if std::mem::replace(&mut in_lru[id.index()], true) {
                return Err(format!("block {id:?} twice in the LRU list"));
            }
            if b.lru_prev != prev {
                return Err(format!(
                    "block {id:?}: lru_prev {:?}, expected {prev:?}",
                    b.lru_prev
                ));
            }
            prev = Some(id);
        }
        if self.lru_tail != prev {
            return Err(format!("lru_tail {:?}, list ends at {prev:?}", self.lru_tail));
        }
        for &id in &self.free {
            if id.index() >= n || std::mem::replace(&mut in_free[id.index()], true) {
                return Err(format!("block {id:?} out of range or twice in the free list"));
            }
        }
        for (i, b) in self.blocks.iter().enumerate() {
            let (cached, registered) = (in_lru[i], b.content.is_some());
            let state_ok = match (b.ref_count > 0, registered) {
                (true, _) => !cached && !in_free[i],
                (false, true) => cached && !in_free[i],
                (false, false) => in_free[i] && !cached,
            };
            if !state_ok {
                return Err(format!(
                    "block {i}: ref_count {}, registered {registered}, in LRU {cached}, in free list {}",
                    b.ref_count, in_free[i]
                ));
            }
            if !cached && (b.lru_prev.is_some() || b.lru_next.is_some()) {
                return Err(format!("block {i} is not in the LRU list but has LRU links"));
            }
            if let Some(c) = &b.content {
                if c.keys.len() != self.block_size {
                    return Err(format!("block {i} registered with {} keys", c.keys.len()));
                }
                if self.index.get(&c.hash) != Some(&BlockId(i as u32)) {
                    return Err(format!(
                        "block {i} registered as {:?} but the index disagrees",
                        c.hash
                    ));
                }
            }
        }
        for (hash, id) in &self.index {
            let stored = self
                .blocks
                .get(id.index())
                .and_then(|b| b.content.as_ref())
                .map(|c| c.hash);
            if stored != Some(*hash) {
                return Err(format!(
                    "index maps {hash:?} to block {id:?} which stores {stored:?}"
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn content(ids: &[u32], salt: u64) -> Content {
        let keys: Vec<TokenKey> = ids.iter().map(|&i| TokenKey::text(i)).collect();
        Content {
            hash: BlockHash::chain(None, &keys, salt),
            parent: None,
            salt,
            keys,
        }
    }

    #[test]
    fn fresh_pool_hands_out_ascending_blocks() {
        let mut pool = BlockPool::new(3, 2);
        let got: Vec<_> = (0..3).map(|_| pool.acquire().unwrap()).collect();
        assert_eq!(got, [BlockId(0), BlockId(1), BlockId(2)]);
        assert_eq!(pool.acquire(), None);
        pool.check_invariants().unwrap();
    }

    #[test]
    fn collision_guard_rejects_other_content_under_same_hash() {
        let mut pool = BlockPool::new(2, 2);
        let id = pool.acquire().unwrap();
        let mut forged = content(&[1, 2], 0);
        let real_hash = forged.hash;
        forged.keys = vec![TokenKey::text(3), TokenKey::text(4)]; // same hash, other tokens
        assert!(pool.register(id, forged));
        assert_eq!(
            pool.lookup(real_hash, None, 0, &[TokenKey::text(1), TokenKey::text(2)]),
            None
        );
        assert_eq!(
            pool.lookup(real_hash, None, 0, &[TokenKey::text(3), TokenKey::text(4)]),
            Some(id)
        );
        // Salt and parent are compared too.
        assert_eq!(
            pool.lookup(real_hash, None, 1, &[TokenKey::text(3), TokenKey::text(4)]),
            None
        );
        let parent = Some(real_hash);
        assert_eq!(
            pool.lookup(real_hash, parent, 0, &[TokenKey::text(3), TokenKey::text(4)]),
            None
        );
    }

    #[test]
    fn release_orders_lru_and_acquire_evicts_head() {
        let mut pool = BlockPool::new(3, 2);
        let ids: Vec<_> = (0..3).map(|_| pool.acquire().unwrap()).collect();
        for (k, &id) in ids.iter().enumerate() {
            assert!(pool.register(id, content(&[k as u32, 0], 0)));
        }
        pool.release(ids[2]);
        pool.release(ids[0]);
        pool.release(ids[1]);
        assert_eq!(pool.lru_order(), [ids[2], ids[0], ids[1]]);
        pool.retain(ids[0]); // a hit revives it
        assert_eq!(pool.lru_order(), [ids[2], ids[1]]);
        pool.check_invariants().unwrap();
        assert_eq!(pool.acquire(), Some(ids[2]));
        assert_eq!(pool.evictions(), 1);
        assert!(pool.content(ids[2]).is_none());
        pool.check_invariants().unwrap();
    }

    #[test]
    fn duplicate_registration_keeps_existing() {
        let mut pool = BlockPool::new(2, 2);
        let (a, b) = (pool.acquire().unwrap(), pool.acquire().unwrap());
        assert!(pool.register(a, content(&[1, 2], 0)));
        assert!(!pool.register(b, content(&[1, 2], 0)));
        assert!(pool.content(b).is_none());
        pool.release(b);
        assert_eq!(pool.num_free(), 1);
        pool.check_invariants().unwrap();
    }
}
