//! Paged KV-cache bookkeeping: which block holds which tokens, which blocks a new prompt can reuse, and
//! when cached blocks may be evicted. No tensors and no device code: the model runner owns the pool
//! tensor (`num_blocks * block_size` rows per layer) and asks [`KvBlockManager`] for block tables and
//! slots.
//!
//! Why it is built this way:
//! * **Exact reuse.** A full block is found through a hash chain over everything that determines its
//!   K/V ([`TokenKey`]: token ids, image content hash and index, embedding-run hash; plus a request salt
//!   for the adapter and gate mode). Blocks are registered only after their K/V are written, and the
//!   partial last block of a prompt is never matched, so a hit is the K/V the request would compute.
//! * **Collision guard.** On an index hit the stored keys, salt and parent hash are compared with the
//!   requested ones; a mismatch is a miss, so a 64-bit hash collision costs a recompute, never a wrong
//!   answer.
//! * **Lazy eviction.** A freed block keeps its hash and stays findable until its space is needed; empty
//!   blocks are handed out first, then cached ones in least-recently-released order.

mod block_pool;
pub mod hash;
mod manager;

pub use block_pool::BlockId;
pub use hash::{BlockHash, TokenKey};
pub use manager::{Allocation, KvBlockManager, KvStats, SeqId};
