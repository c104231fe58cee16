//! The scheduler: which sequences take part in the next forward (after nano-vllm's `Scheduler`).
//!
//! * Admission: waiting requests enter in arrival order while the pool has blocks for their whole
//!   prompt; their longest cached prefix is reused (never ending inside an image). A request whose
//!   prefix a running request is still computing waits for it, then reuses it. While others run, a
//!   request is admitted only if it leaves one free block per running sequence, so that admitting
//!   it does not immediately force a preemption. A request that cannot fit even into an otherwise
//!   empty pool fails at once with [`Error::KvCacheFull`].
//! * Decode first: every running generation with a token waiting for its K/V gets one row and a KV
//!   slot for it. When the pool runs out, the youngest running sequence is preempted: it gives its
//!   blocks back (the registered ones stay in the prefix cache) and goes to the front of the queue,
//!   to be recomputed later through the prefix cache — with the same bits, since a row's result
//!   does not depend on how the sequence was chunked.
//! * Prefill chunks of up to `chunk_size` tokens then fill the batch up to `max_batch_tokens`.

use std::collections::VecDeque;

use crate::engine::sequence::{RequestId, Sequence, Task};
use crate::engine::Outcome;
use crate::error::Error;
use crate::kv::KvBlockManager;
use crate::model::LogitsFor;

/// One sequence's share of a forward.
pub(crate) struct Work {
    /// Index into [`Scheduler::running`].
    pub seq: usize,
    /// First token computed, and how many.
    pub start: usize,
    pub len: usize,
    pub logits: Option<LogitsFor>,
}

/// Queues of waiting and running sequences.
pub(crate) struct Scheduler<T> {
    /// Not yet admitted, or preempted, in the order they will be admitted.
    pub waiting: VecDeque<Sequence<T>>,
    /// Admitted, oldest first (the youngest is preempted first).
    pub running: Vec<Sequence<T>>,
    chunk_size: usize,
    max_batch_tokens: usize,
    prefix_caching: bool,
    /// Preemptions so far.
    pub preemptions: u64,
}

impl<T> Scheduler<T> {
    pub fn new(chunk_size: usize, max_batch_tokens: usize, prefix_caching: bool) -> Self {
        Scheduler {
            waiting: VecDeque::new(),
            running: Vec::new(),
            chunk_size,
            max_batch_tokens,
            prefix_caching,
            preemptions: 0,
        }
    }

    /// Whether anything is waiting or running.
    pub fn has_work(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty()
    }

    /// Admits waiting sequences while the pool has room; returns those that finished on admission
    /// (a warm-up whose prefix was all cached) or can never fit.
    pub fn admit(&mut self, blocks: &mut KvBlockManager) -> Vec<(Sequence<T>, Outcome)> {
        let mut finished = Vec::new();
        let mut deferred = Vec::new();
        while let Some(mut seq) = self.waiting.pop_front() {
            if self.prefix_caching && self.prefix_in_flight(&seq, blocks.block_size()) {
                deferred.push(seq);
                continue;
            }
            let limit = if self.prefix_caching { seq.reuse_limit() } else { 0 };
            let allowed = |r: usize| seq.clamp_reuse(r.min(limit));
            let keep_free = self.running.len();
            match blocks.allocate_within(&seq.keys, seq.salt, allowed, keep_free) {
                Ok(alloc) => {
                    seq.kv = Some(alloc.seq);
                    seq.computed = alloc.reused_tokens;
                    if seq.preemptions == 0 {
                        seq.reused = alloc.reused_tokens;
                    }
                    if matches!(seq.task, Task::Warm { .. }) && seq.is_prefilled() {
                        finished.push((seq, Outcome::Warmed));
                    } else {
                        self.running.push(seq);
                    }
                }
                Err(e @ Error::KvCacheFull { .. }) if self.running.is_empty() => {
                    finished.push((seq, Outcome::Failed(e.to_string())));
                }
                Err(Error::KvCacheFull { .. }) => {
                    self.waiting.push_front(seq);
                    break;
                }
                Err(e) => finished.push((seq, Outcome::Failed(e.to_string()))),
            }
        }
        // Deferred requests keep their place at the head of the queue.
        for seq in deferred.into_iter().rev() {
            self.waiting.push_front(seq);
        }
        finished
    }

    /// Whether a running sequence is still computing a full block that `seq` shares with it: `seq`
    /// then waits, so that it reuses those blocks from the prefix cache instead of computing them
    /// again (requests that arrive together with a long common prefix compute it once).
    fn prefix_in_flight(&self, seq: &Sequence<T>, block_size: usize) -> bool {
        self.running.iter().any(|r| {
            if r.salt != seq.salt || r.computed >= r.prompt_len {
                return false;
            }
            let common = r
                .keys
                .iter()
                .zip(&seq.keys)
                .take(seq.reuse_limit())
                .take_while(|(a, b)| a == b)
                .count();
            seq.clamp_reuse(common / block_size * block_size) / block_size * block_size > r.computed
        })
    }

    /// The next forward's work: a KV slot and one row for every generation with a pending token
    /// (preempting the youngest sequences when the pool is out of blocks), then prefill chunks.
    /// Returns the work and the sequences that failed (a lone sequence the whole pool cannot hold).
    pub fn schedule(&mut self, blocks: &mut KvBlockManager) -> (Vec<Work>, Vec<(Sequence<T>, Outcome)>) {
        let failed = self.reserve_slots(blocks);
        (self.plan(), failed)
    }

    /// Gives every running sequence a block-table entry for each of its tokens (decode adds one per
    /// step), preempting the youngest when the pool is full.
    fn reserve_slots(&mut self, blocks: &mut KvBlockManager) -> Vec<(Sequence<T>, Outcome)> {
        let mut failed = Vec::new();
        let mut i = 0;
        while i < self.running.len() {
            match Self::ensure_slots(&self.running[i], blocks) {
                Ok(()) => i += 1,
                Err(e @ Error::KvCacheFull { .. }) => {
                    let youngest = self.running.len() - 1;
                    if youngest > i {
                        self.preempt(youngest, blocks);
                    } else if i > 0 {
                        self.preempt(i, blocks);
                    } else {
                        // Alone and still no room: the pool cannot hold this sequence.
                        failed.push((self.running.remove(i), Outcome::Failed(e.to_string())));
                    }
                }
                Err(e) => failed.push((self.running.remove(i), Outcome::Failed(e.to_string()))),
            }
        }
        failed
    }

    fn ensure_slots(s: &Sequence<T>, blocks: &mut KvBlockManager) -> crate::Result<()> {
        let Some(kv) = s.kv else { return Ok(()) };
        for key in &s.keys[blocks.num_tokens(kv)..] {
            blocks.append(kv, *key)?;
        }
        Ok(())
    }

    /// Sends running sequence `i` back to the front of the queue without its blocks.
    fn preempt(&mut self, i: usize, blocks: &mut KvBlockManager) {
        let mut s = self.running.remove(i);
        if let Some(kv) = s.kv {
            // A sequence the manager does not know holds no blocks; nothing to give back then.
            let _ = blocks.free(kv);
        }
        tracing::debug!(request = s.id, tokens = s.tokens.len(), "preempted: KV pool full");
        s.reset_for_recompute();
        self.preemptions += 1;
        self.waiting.push_front(s);
    }

    /// Removes request `id` wherever it is; the caller frees its blocks.
    pub fn remove(&mut self, id: RequestId) -> Option<Sequence<T>> {
        if let Some(i) = self.running.iter().position(|s| s.id == id) {
            return Some(self.running.remove(i));
        }
        let i = self.waiting.iter().position(|s| s.id == id)?;
        self.waiting.remove(i)
    }

    /// Decodes first (one token each), then prefill chunks while the batch has room.
    fn plan(&self) -> Vec<Work> {
        let mut budget = self.max_batch_tokens;
        let mut work = Vec::new();
        for (i, s) in self.running.iter().enumerate() {
            if s.is_prefilled() || budget == 0 {
                continue;
            }
            let remaining = s.target_len() - s.computed;
            if remaining == 1 && matches!(s.task, Task::Generate(_)) && !s.generated.is_empty() {
                work.push(Work {
                    seq: i,
                    start: s.computed,
                    len: 1,
                    logits: Some(LogitsFor::Last),
                });
                budget -= 1;
            }
        }
        for (i, s) in self.running.iter().enumerate() {
            if budget == 0 {
                break;
            }
            if s.is_prefilled() || work.iter().any(|w| w.seq == i) {
                continue;
            }
            let len = (s.target_len() - s.computed).min(self.chunk_size).min(budget);
            let end = s.computed + len;
            let logits = match &s.task {
                Task::Generate(_) if s.draft_len > 0 && end >= s.prompt_len => Some(LogitsFor::All),
                Task::Generate(_) if end == s.target_len() => Some(LogitsFor::Last),
                Task::Score { .. } if end >= s.prompt_len => Some(LogitsFor::All),
                _ => None,
            };
            work.push(Work {
                seq: i,
                start: s.computed,
                len,
                logits,
            });
            budget -= len;
        }
        work
    }
}
