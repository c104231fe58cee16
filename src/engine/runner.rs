//! The model runner: turns the scheduler's work into one batched forward over the paged KV pool —
//! block tables, positions, injected image and embedding rows, adapter rows — and sends pure decode
//! steps through [`Backend::run_step`] so that a backend may replay them (CUDA graphs).

use crate::backend::{Backend, StepKey};
use crate::engine::scheduler::Work;
use crate::engine::sequence::Sequence;
use crate::error::{Error, Result};
use crate::kv::KvBlockManager;
use crate::model::{BatchItem, KvPool, QwenVl, VisualFeatures};

/// Largest decode batch recorded as one replayable step (one recording per batch size).
const MAX_REPLAY_ROWS: usize = 64;

/// The model, its backend and the KV pool it writes.
pub(crate) struct Runner<'m, B: Backend> {
    pub be: &'m B,
    pub model: &'m QwenVl<B>,
    pool: KvPool<B>,
}

impl<'m, B: Backend> Runner<'m, B> {
    /// A runner with a pool of `num_blocks` blocks of `block_size` tokens.
    pub fn new(be: &'m B, model: &'m QwenVl<B>, num_blocks: usize, block_size: usize) -> Result<Self> {
        Ok(Runner {
            be,
            model,
            pool: model.text.new_pool(be, num_blocks, block_size)?,
        })
    }

    /// One batched forward of `work` over `running`; the logits each work item asked for.
    pub fn run(
        &mut self,
        work: &[Work],
        running: &[Sequence<B::Tensor>],
        blocks: &KvBlockManager,
    ) -> Result<Vec<Option<B::Tensor>>> {
        let mut tables = Vec::with_capacity(work.len());
        let mut lora = Vec::with_capacity(work.len());
        let mut features = Vec::with_capacity(work.len());
        let mut positions = Vec::with_capacity(work.len());
        for w in work {
            let s = &running[w.seq];
            let kv =
                s.kv.ok_or_else(|| Error::InvalidRequest("sequence not admitted".into()))?;
            tables.push(blocks.block_table(kv).iter().map(|b| b.0).collect::<Vec<u32>>());
            features.push(self.chunk_features(s, w.start, w.len)?);
            positions.push(s.positions(w.start, w.start + w.len));
            lora.push(s.lora_rows(w.start, w.start + w.len));
        }
        let items: Vec<BatchItem<B::Tensor>> = work
            .iter()
            .enumerate()
            .map(|(k, w)| BatchItem {
                ids: &running[w.seq].tokens[w.start..w.start + w.len],
                positions: &positions[k],
                visual: &features[k],
                block_table: &tables[k],
                start: w.start,
                logits: w.logits,
                lora_rows: &lora[k],
            })
            .collect();
        let (be, text, pool) = (self.be, &self.model.text, &mut self.pool);
        let mut forward = || Ok(text.forward_batch(be, &items, pool, false)?.logits);
        match decode_step_key(&items) {
            // Pure decode steps have the same device work step after step: the backend may record
            // and replay them.
            Some(key) => be.run_step(key, &mut forward),
            None => forward(),
        }
    }

    /// The chunk's injected rows: for every image or embedding run overlapping `start..start + len`,
    /// the overlapping rows of its embeddings (and deepstack features).
    fn chunk_features(
        &self,
        s: &Sequence<B::Tensor>,
        start: usize,
        len: usize,
    ) -> Result<Vec<VisualFeatures<B::Tensor>>> {
        let mut out = Vec::new();
        for inj in &s.injected {
            let (a, b) = (start.max(inj.start), (start + len).min(inj.start + inj.len));
            if a >= b {
                continue;
            }
            let src: Vec<usize> = (a - inj.start..b - inj.start).collect();
            out.push(VisualFeatures {
                rows: (a - start..b - start).collect(),
                embeds: self.be.gather_rows(&inj.entry.embeds, &src)?,
                deepstack: inj
                    .entry
                    .deepstack
                    .iter()
                    .map(|d| self.be.gather_rows(d, &src))
                    .collect::<Result<_>>()?,
            });
        }
        Ok(out)
    }
}

/// The replay key of a pure decode step (one new token per sequence, no images, no adapter rows, at
/// most [`MAX_REPLAY_ROWS`] sequences); `None` for any other step.
fn decode_step_key<T>(items: &[BatchItem<'_, T>]) -> Option<StepKey> {
    let decode = items.len() <= MAX_REPLAY_ROWS
        && items
            .iter()
            .all(|it| it.ids.len() == 1 && it.visual.is_empty() && it.lora_rows.is_empty());
    decode.then(|| StepKey {
        rows: items.len(),
        tag: items
            .iter()
            .enumerate()
            .fold(0u64, |m, (i, it)| m | (u64::from(it.logits.is_some()) << i)),
    })
}
