//! The engine: continuous batching of prefill chunks and decode steps over a paged KV pool whose
//! prefix cache makes every shared prefix (a second pass, the next agent step, sibling prompts in a
//! scoring call) cost nothing the second time — and change nothing, because a cached block holds
//! exactly the K/V its key determines.
//!
//! `step()` is schedule → run → postprocess:
//! * schedule: every decoding sequence gets one token; prefilling sequences get chunks of up to
//!   `chunk_size` tokens while the batch has room; waiting requests are admitted when blocks allow
//!   (their cached prefix is reused, never ending inside an image).
//! * run: one batched forward (`TextModel::forward_batch`).
//! * postprocess: greedy choice or log-prob collection, K/V registered in the prefix index, finished
//!   requests released.

use std::collections::VecDeque;
use std::sync::Arc;

use crate::backend::{Backend, StepKey};
use crate::engine::generate::finish_reason;
use crate::engine::prompt::{FlatPrompt, ImageHash, ImageRole, Prompt, Segment};
use crate::engine::sequence::{Injected, RequestId, Sequence, Task};
use crate::engine::vision_cache::{VisionCache, VisionEntry};
use crate::engine::{GenerateParams, Generation, Score};
use crate::error::{Error, Result};
use crate::kv::{KvBlockManager, KvStats, TokenKey};
use crate::model::{AdapterMode, BatchItem, KvPool, LogitsFor, QwenVl, VisualFeatures};
use crate::tokenize::Tokenizer;
use crate::vision::PixelValues;

/// Sizes and policies of an [`Engine`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineConfig {
    /// Tokens per KV block.
    pub block_size: usize,
    /// Blocks in the KV pool (ignored when `kv_cache_bytes` is set).
    pub num_blocks: usize,
    /// Size the KV pool by bytes instead: as many blocks as fit.
    pub kv_cache_bytes: Option<usize>,
    /// Most prompt tokens of one sequence per step (chunked prefill).
    pub chunk_size: usize,
    /// Most tokens in one batched forward.
    pub max_batch_tokens: usize,
    /// Byte capacity of the vision-embedding cache.
    pub vision_cache_bytes: usize,
    /// Reuse cached prefixes (off only to measure what reuse saves).
    pub prefix_caching: bool,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            block_size: 16,
            num_blocks: 1024,
            kv_cache_bytes: None,
            chunk_size: 512,
            max_batch_tokens: 2048,
            vision_cache_bytes: 1 << 30,
            prefix_caching: true,
        }
    }
}

/// The result of one request.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    Generation(Generation),
    Score(Score),
    /// A warm-up finished.
    Warmed,
    /// The request failed; the engine and its caches stay usable.
    Failed(String),
}

/// Per-request options.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RequestOptions {
    /// Return the logits of every generation decision.
    pub return_logits: bool,
    /// Cache salt for other request-wide state that changes K/V: requests with different salts
    /// share no block.
    pub salt: u64,
    /// Where the model's adapter acts (its id and the gate enter the cache key of every token it
    /// touches, so gated K/V are never served to an ungated or adapter-free request).
    pub adapter: AdapterMode,
    /// Generation only: tokens expected to be generated (e.g. the first pass's answer). They are
    /// computed together with the prompt and verified greedily; the output is exactly what plain
    /// decoding gives, in fewer forwards when the draft is right.
    pub draft: Vec<u32>,
}

/// A finished request.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineOutput {
    pub id: RequestId,
    pub outcome: Outcome,
    /// Logits of every generation decision (when asked for in [`RequestOptions`]).
    pub decision_logits: Vec<Vec<f32>>,
    /// Prompt tokens served from the prefix cache.
    pub reused_tokens: usize,
    /// Draft tokens accepted by verification.
    pub accepted_draft: usize,
}

/// Largest decode batch recorded as one replayable step (one recording per batch size).
const MAX_REPLAY_ROWS: usize = 64;

/// One sequence's share of a step.
struct Work {
    seq: usize, // index into `running`
    start: usize,
    len: usize,
    logits: Option<LogitsFor>,
}

/// Continuous-batching engine over one model.
pub struct Engine<'m, B: Backend> {
    be: &'m B,
    model: &'m QwenVl<B>,
    tokenizer: Option<&'m Tokenizer>,
    cfg: EngineConfig,
    pool: KvPool<B>,
    blocks: KvBlockManager,
    vision: VisionCache<B::Tensor>,
    waiting: VecDeque<Sequence<B::Tensor>>,
    running: Vec<Sequence<B::Tensor>>,
    next_id: RequestId,
    /// Decoder forwards run so far.
    pub forwards: u64,
    /// Image sources already hashed (source key → content hash), so files are not decoded twice.
    sources: std::collections::HashMap<u64, ImageHash>,
}

impl<'m, B: Backend> Engine<'m, B> {
    /// An engine over `model` on backend `be`; `tokenizer` is needed for stop strings.
    ///
    /// ```no_run
    /// use recall::{backend::cpu::CpuBackend, engine::{Engine, EngineConfig, GenerateParams, prompt::{Prompt, Segment}}, model::QwenVl};
    /// let be = CpuBackend;
    /// let model = QwenVl::load(&be, std::path::Path::new("tests/fixtures/tiny-qwen3-vl"))?;
    /// let mut engine = Engine::new(&be, &model, None, EngineConfig::default())?;
    /// let prompt = Prompt { segments: vec![Segment::Text(vec![1, 2, 3])] };
    /// let params = GenerateParams { max_tokens: 8, eos_token_ids: vec![], stop_strings: vec![] };
    /// let out = engine.generate(&prompt, &params)?;
    /// println!("{:?}", out.tokens);
    /// # Ok::<(), recall::Error>(())
    /// ```
    pub fn new(
        be: &'m B,
        model: &'m QwenVl<B>,
        tokenizer: Option<&'m Tokenizer>,
        mut cfg: EngineConfig,
    ) -> Result<Self> {
        if let Some(bytes) = cfg.kv_cache_bytes {
            let t = model.text.config();
            // K and V, every layer, f32 rows of kv_heads · head_dim.
            let per_block = 2 * t.num_hidden_layers * cfg.block_size * t.num_key_value_heads * t.head_dim * 4;
            cfg.num_blocks = bytes / per_block.max(1);
            tracing::info!(
                blocks = cfg.num_blocks,
                bytes_per_block = per_block,
                "KV pool sized by bytes"
            );
        }
        if cfg.block_size == 0 || cfg.num_blocks == 0 || cfg.chunk_size == 0 || cfg.max_batch_tokens == 0 {
            return Err(Error::InvalidRequest(format!(
                "engine sizes must be positive: {cfg:?}"
            )));
        }
        let model_id = xxhash_rust::xxh64::xxh64(format!("{:?}", model.config).as_bytes(), 0);
        Ok(Engine {
            be,
            model,
            tokenizer,
            pool: model.text.new_pool(be, cfg.num_blocks, cfg.block_size)?,
            blocks: KvBlockManager::new(cfg.num_blocks, cfg.block_size)?,
            vision: VisionCache::new(model_id, cfg.vision_cache_bytes),
            cfg,
            waiting: VecDeque::new(),
            running: Vec::new(),
            next_id: 0,
            forwards: 0,
            sources: std::collections::HashMap::new(),
        })
    }

    /// The engine's configuration.
    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    /// Prefix-cache statistics.
    pub fn kv_stats(&self) -> KvStats {
        self.blocks.stats()
    }

    /// The vision-embedding cache (hit, run and eviction counters).
    pub fn vision_cache(&self) -> &VisionCache<B::Tensor> {
        &self.vision
    }

    /// Checks the block manager's invariants (for tests).
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        self.blocks.check_invariants()
    }

    /// Whether `hash` is in the vision-embedding cache.
    pub fn has_image(&self, hash: ImageHash) -> bool {
        self.vision.contains(hash)
    }

    /// The content hash remembered for an image source key.
    pub fn source_hash(&self, key: u64) -> Option<ImageHash> {
        self.sources.get(&key).copied()
    }

    /// Remembers the content hash of an image source key.
    pub fn remember_source(&mut self, key: u64, hash: ImageHash) {
        self.sources.insert(key, hash);
    }

    /// The patch grid of a cached image.
    pub fn image_grid(&self, hash: ImageHash) -> Option<crate::model::GridThw> {
        self.vision.peek(hash).map(|e| e.grid)
    }

    /// Runs the vision tower on `pixels` unless the image is cached; returns whether it ran.
    pub fn add_image(&mut self, hash: ImageHash, pixels: &PixelValues) -> Result<bool> {
        if self.vision.contains(hash) {
            return Ok(false);
        }
        let tower = self
            .model
            .vision
            .as_ref()
            .ok_or_else(|| Error::InvalidRequest("this model has no vision tower".into()))?;
        let x = self
            .be
            .upload(&pixels.data, pixels.num_patches(), pixels.patch_dim)?;
        let out = tower.forward(self.be, &x, &[pixels.grid_thw])?;
        let (rows, cols) = self.be.dims(&out.embeds);
        let bytes = rows * cols * 4 * (1 + out.deepstack.len());
        self.vision.insert(
            hash,
            VisionEntry {
                grid: pixels.grid_thw,
                embeds: out.embeds,
                deepstack: out.deepstack,
                bytes,
            },
        );
        Ok(true)
    }

    /// Queues a request; its images must already be in the vision cache ([`Engine::add_image`]).
    pub fn add_request(&mut self, prompt: &Prompt, task: Task) -> Result<RequestId> {
        self.add_request_with(prompt, task, RequestOptions::default())
    }

    /// Like [`Engine::add_request`], with options.
    pub fn add_request_with(
        &mut self,
        prompt: &Prompt,
        task: Task,
        opts: RequestOptions,
    ) -> Result<RequestId> {
        let flat = self.flatten(prompt)?;
        let hidden = self.model.text.config().hidden_size;
        let keys = token_keys(prompt, &flat);
        let mut injected = Vec::new();
        for run in &flat.runs {
            let entry = match &prompt.segments[run.segment] {
                Segment::Image { hash, grid, .. } => {
                    let e = self.vision.get(*hash).ok_or_else(|| {
                        Error::InvalidRequest(format!(
                            "image {:016x} is not in the vision cache; add it first",
                            hash.0
                        ))
                    })?;
                    if e.grid != *grid {
                        return Err(Error::InvalidRequest(format!(
                            "image {:016x}: grid {grid:?} differs from the cached {:?}",
                            hash.0, e.grid
                        )));
                    }
                    e
                }
                Segment::Embeds { rows, data, .. } => {
                    if data.len() != rows * hidden {
                        return Err(Error::InvalidRequest(format!(
                            "embedding run of {} values is not {rows} rows of {hidden}",
                            data.len()
                        )));
                    }
                    let embeds = self.be.upload(data, *rows, hidden)?;
                    Arc::new(VisionEntry {
                        grid: [0, 0, 0],
                        embeds,
                        deepstack: Vec::new(),
                        bytes: data.len() * 4,
                    })
                }
                Segment::Text(_) => continue,
            };
            injected.push(Injected {
                start: run.start,
                len: run.len,
                entry,
            });
        }
        if let Task::Generate(p) = &task {
            if !p.stop_strings.is_empty() && self.tokenizer.is_none() {
                return Err(Error::InvalidRequest("stop strings need a tokenizer".into()));
            }
            if p.max_tokens == 0 {
                return Err(Error::InvalidRequest("max_tokens must be at least 1".into()));
            }
        }
        if let Task::Score { target } = &task {
            if target.is_empty() {
                return Err(Error::InvalidRequest("scoring needs a non-empty target".into()));
            }
        }
        let id = self.next_id;
        self.next_id += 1;
        let (gate, adapter) = self.gates(prompt, &flat, opts.adapter)?;
        let keys = match adapter {
            Some((aid, _)) => keys
                .iter()
                .zip(&gate)
                .map(|(k, &g)| if g { k.with_adapter(aid) } else { *k })
                .collect(),
            None => keys,
        };
        let mut seq = Sequence::new(id, task, flat, keys, injected, gate, adapter);
        seq.return_logits = opts.return_logits;
        seq.salt = opts.salt;
        if let Task::Generate(p) = &seq.task {
            let n = opts.draft.len().min(p.max_tokens);
            for &t in &opts.draft[..n] {
                seq.push_token(t);
            }
            seq.draft_len = n;
        }
        let limit = self.model.text.config().max_position_embeddings;
        let needed = seq.tokens.len()
            + match &seq.task {
                Task::Generate(p) => p.max_tokens,
                _ => 0,
            };
        if needed > limit {
            return Err(Error::PromptTooLong {
                tokens: needed,
                limit,
            });
        }
        self.waiting.push_back(seq);
        Ok(id)
    }

    /// Per prompt token, whether the adapter acts on it; and the adapter's id and whether it also acts
    /// after the prompt.
    #[allow(clippy::type_complexity)]
    fn gates(
        &self,
        prompt: &Prompt,
        flat: &FlatPrompt,
        mode: AdapterMode,
    ) -> Result<(Vec<bool>, Option<(u64, bool)>)> {
        let n = flat.ids.len();
        if mode == AdapterMode::Off {
            return Ok((vec![false; n], None));
        }
        let adapter = self.model.text.adapter().ok_or_else(|| {
            Error::InvalidRequest(format!("adapter mode {mode:?} but no adapter is loaded"))
        })?;
        let mut gate = vec![mode == AdapterMode::Ungated; n];
        if mode == AdapterMode::Gated {
            for run in &flat.runs {
                if let Segment::Image {
                    role: ImageRole::History,
                    ..
                } = prompt.segments[run.segment]
                {
                    gate[run.start..run.start + run.len]
                        .iter_mut()
                        .for_each(|g| *g = true);
                }
            }
        }
        Ok((gate, Some((adapter.id, mode == AdapterMode::Ungated))))
    }

    /// Whether requests are waiting or running.
    pub fn has_work(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty()
    }

    /// One scheduling step: runs one batched forward and returns the requests that finished.
    pub fn step(&mut self) -> Result<Vec<EngineOutput>> {
        let mut done = self.admit();
        let work = self.schedule();
        if work.is_empty() {
            return Ok(done);
        }
        match self.run(&work) {
            Ok(logits) => self.postprocess(&work, logits, &mut done)?,
            Err(e) => {
                // The batch failed as a whole; its sequences fail, the caches stay consistent (nothing
                // new was marked computed).
                let mut idx: Vec<usize> = work.iter().map(|w| w.seq).collect();
                idx.sort_unstable();
                idx.dedup();
                for i in idx.into_iter().rev() {
                    let s = self.running.remove(i);
                    done.push(self.finish(s, Outcome::Failed(e.to_string())));
                }
            }
        }
        Ok(done)
    }

    /// Steps until every request has finished.
    pub fn run_all(&mut self) -> Result<Vec<EngineOutput>> {
        let mut out = Vec::new();
        while self.has_work() {
            out.extend(self.step()?);
        }
        Ok(out)
    }

    /// Admits waiting requests while the pool has blocks for them; a request that can never fit
    /// fails at once.
    fn admit(&mut self) -> Vec<EngineOutput> {
        let mut finished = Vec::new();
        while let Some(mut seq) = self.waiting.pop_front() {
            let limit = if self.cfg.prefix_caching {
                seq.reuse_limit()
            } else {
                0
            };
            let allowed = |r: usize| seq.clamp_reuse(r.min(limit));
            match self.blocks.allocate_with(&seq.keys, seq.salt, allowed) {
                Ok(alloc) => {
                    seq.kv = Some(alloc.seq);
                    seq.computed = alloc.reused_tokens;
                    seq.reused = alloc.reused_tokens;
                    if matches!(seq.task, Task::Warm { .. }) && seq.is_prefilled() {
                        finished.push(self.finish(seq, Outcome::Warmed));
                    } else {
                        self.running.push(seq);
                    }
                }
                Err(e) if self.running.is_empty() => {
                    finished.push(self.finish(seq, Outcome::Failed(e.to_string())))
                }
                Err(_) => {
                    self.waiting.push_front(seq);
                    break;
                }
            }
        }
        finished
    }

    /// Decodes first (one token each), then prefill chunks while the batch has room.
    fn schedule(&self) -> Vec<Work> {
        let mut budget = self.cfg.max_batch_tokens;
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
            let len = (s.target_len() - s.computed).min(self.cfg.chunk_size).min(budget);
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

    fn run(&mut self, work: &[Work]) -> Result<Vec<Option<B::Tensor>>> {
        let mut tables = Vec::with_capacity(work.len());
        let mut lora = Vec::with_capacity(work.len());
        let mut features = Vec::with_capacity(work.len());
        let mut positions = Vec::with_capacity(work.len());
        for w in work {
            let s = &self.running[w.seq];
            let kv =
                s.kv.ok_or_else(|| Error::InvalidRequest("sequence not admitted".into()))?;
            tables.push(
                self.blocks
                    .block_table(kv)
                    .iter()
                    .map(|b| b.0)
                    .collect::<Vec<u32>>(),
            );
            features.push(self.chunk_features(s, w.start, w.len)?);
            positions.push(s.positions(w.start, w.start + w.len));
            lora.push(s.lora_rows(w.start, w.start + w.len));
        }
        let items: Vec<BatchItem<B::Tensor>> = work
            .iter()
            .enumerate()
            .map(|(k, w)| BatchItem {
                ids: &self.running[w.seq].tokens[w.start..w.start + w.len],
                positions: &positions[k],
                visual: &features[k],
                block_table: &tables[k],
                start: w.start,
                logits: w.logits,
                lora_rows: &lora[k],
            })
            .collect();
        self.forwards += 1;
        let (be, text, pool) = (self.be, &self.model.text, &mut self.pool);
        let mut forward = || Ok(text.forward_batch(be, &items, pool, false)?.logits);
        // Pure decode steps (one new token per sequence, no images, no adapter rows) have the same
        // device work step after step: the backend may record and replay them (CUDA graphs).
        let decode = work.len() <= MAX_REPLAY_ROWS
            && items
                .iter()
                .all(|it| it.ids.len() == 1 && it.visual.is_empty() && it.lora_rows.is_empty());
        if decode {
            let logits_mask = items
                .iter()
                .enumerate()
                .fold(0u64, |m, (i, it)| m | (u64::from(it.logits.is_some()) << i));
            let key = StepKey {
                rows: work.len(),
                tag: logits_mask,
            };
            be.run_step(key, &mut forward)
        } else {
            forward()
        }
    }

    fn postprocess(
        &mut self,
        work: &[Work],
        logits: Vec<Option<B::Tensor>>,
        done: &mut Vec<EngineOutput>,
    ) -> Result<()> {
        let mut finished = Vec::new();
        for (w, l) in work.iter().zip(logits) {
            let s = &mut self.running[w.seq];
            s.computed = w.start + w.len;
            if let Some(kv) = s.kv {
                self.blocks.mark_computed(kv, s.computed)?;
            }
            let result = match (&s.task, l) {
                (Task::Generate(_), Some(l)) => {
                    Self::decide(self.be, &mut self.blocks, self.tokenizer, s, w, &l)
                }
                (Task::Score { .. }, Some(l)) => Self::collect_logprobs(self.be, s, w, &l).map(|()| None),
                (Task::Warm { .. }, _) if s.is_prefilled() => Ok(Some(Outcome::Warmed)),
                _ => Ok(None),
            };
            let outcome = match result {
                Ok(Some(o)) => Some(o),
                Ok(None) if matches!(s.task, Task::Score { .. }) && s.is_prefilled() => {
                    Some(Outcome::Score(score_of(&s.logprobs)))
                }
                Ok(None) => None,
                Err(e) => Some(Outcome::Failed(e.to_string())),
            };
            if let Some(o) = outcome {
                finished.push((w.seq, o));
            }
        }
        finished.sort_by_key(|(i, _)| std::cmp::Reverse(*i));
        for (i, o) in finished {
            let s = self.running.remove(i);
            done.push(self.finish(s, o));
        }
        Ok(())
    }

    /// Greedy choice after a generation step; `Some` when the sequence is done.
    fn decide(
        be: &B,
        blocks: &mut KvBlockManager,
        tokenizer: Option<&Tokenizer>,
        s: &mut Sequence<B::Tensor>,
        w: &Work,
        logits: &B::Tensor,
    ) -> Result<Option<Outcome>> {
        if s.draft_len == 0 {
            let next = be.argmax(logits)?[0];
            let row = if s.return_logits {
                Some(be.download(logits)?)
            } else {
                None
            };
            return Self::accept(blocks, tokenizer, s, next, row, false);
        }
        // Drafting: rows from the last prompt token on predict the draft's tokens and one more.
        let first = (s.prompt_len - 1).max(w.start);
        let end = w.start + w.len;
        if first < end {
            let rows = be.rows(logits, first - w.start, end - first)?;
            s.draft_preds.extend(be.argmax(&rows)?);
            if s.return_logits {
                let data = be.download(&rows)?;
                let vocab = be.dims(&rows).1;
                s.draft_logits.extend(data.chunks(vocab).map(<[f32]>::to_vec));
            }
        }
        if !s.is_prefilled() {
            return Ok(None);
        }
        Self::verify(blocks, tokenizer, s)
    }

    /// Greedy verification of a draft: accepts the predictions up to and including the first one that
    /// differs from the draft, drops the rejected draft tokens' K/V, and replays each accepted token as
    /// an ordinary decision (so eos, stop strings and the token limit apply exactly as without a draft).
    fn verify(
        blocks: &mut KvBlockManager,
        tokenizer: Option<&Tokenizer>,
        s: &mut Sequence<B::Tensor>,
    ) -> Result<Option<Outcome>> {
        let n = s.draft_len;
        let draft = s.tokens[s.prompt_len..s.prompt_len + n].to_vec();
        let preds = std::mem::take(&mut s.draft_preds);
        if preds.len() != n + 1 {
            return Err(Error::InvalidRequest(format!(
                "draft verification saw {} predictions for {n} draft tokens",
                preds.len()
            )));
        }
        let mut rows = std::mem::take(&mut s.draft_logits).into_iter();
        let k = draft.iter().zip(&preds).take_while(|(d, p)| d == p).count();
        let kv =
            s.kv.ok_or_else(|| Error::InvalidRequest("sequence not admitted".into()))?;
        // Keep the accepted draft tokens (their K/V are exactly what decoding would have written).
        blocks.truncate(kv, s.prompt_len + k)?;
        s.tokens.truncate(s.prompt_len + k);
        s.keys.truncate(s.prompt_len + k);
        s.gate.truncate(s.prompt_len + k);
        s.computed = blocks.num_computed(kv);
        s.draft_len = 0;
        s.accepted_draft = k;
        for (i, &token) in preds[..=k].iter().enumerate() {
            if let Some(done) = Self::accept(blocks, tokenizer, s, token, rows.next(), i < k)? {
                return Ok(Some(done));
            }
        }
        Ok(None)
    }

    /// Records one generated token; `Some` when generation ends with it. Unless the token is already
    /// in the sequence (an accepted draft token), it is appended for computation next step.
    fn accept(
        blocks: &mut KvBlockManager,
        tokenizer: Option<&Tokenizer>,
        s: &mut Sequence<B::Tensor>,
        next: u32,
        logits_row: Option<Vec<f32>>,
        in_sequence: bool,
    ) -> Result<Option<Outcome>> {
        let Task::Generate(params) = &s.task else {
            return Ok(None);
        };
        s.decision_logits.extend(logits_row);
        s.generated.push(next);
        if let Some(finish) = finish_reason(params, &s.generated, tokenizer)? {
            let text = tokenizer.map(|t| t.decode(&s.generated)).transpose()?;
            return Ok(Some(Outcome::Generation(Generation {
                tokens: s.generated.clone(),
                text,
                finish,
            })));
        }
        if in_sequence {
            return Ok(None);
        }
        // The new token is computed next step; it needs a slot now.
        let kv =
            s.kv.ok_or_else(|| Error::InvalidRequest("sequence not admitted".into()))?;
        s.push_token(next);
        if let Err(e) = blocks.append(kv, *s.keys.last().unwrap_or(&TokenKey::text(next))) {
            s.tokens.pop();
            s.keys.pop();
            s.gate.pop();
            return Err(e);
        }
        Ok(None)
    }

    /// Log-probs of the target tokens predicted by the chunk's rows.
    fn collect_logprobs(be: &B, s: &mut Sequence<B::Tensor>, w: &Work, logits: &B::Tensor) -> Result<()> {
        // Row r (absolute) predicts token r + 1; targets are tokens prompt_len..tokens.len().
        let first = (s.prompt_len - 1).max(w.start);
        let last = (s.tokens.len() - 1).min(w.start + w.len);
        if first >= last {
            return Ok(());
        }
        let rows = be.rows(logits, first - w.start, last - first)?;
        let targets = &s.tokens[first + 1..last + 1];
        s.logprobs.extend(be.log_softmax_gather(&rows, targets)?);
        Ok(())
    }

    fn finish(&mut self, s: Sequence<B::Tensor>, outcome: Outcome) -> EngineOutput {
        if let Some(kv) = s.kv {
            // A sequence the manager does not know cannot hold blocks; nothing to release then.
            let _ = self.blocks.free(kv);
        }
        EngineOutput {
            id: s.id,
            outcome,
            decision_logits: s.decision_logits,
            reused_tokens: s.reused,
            accepted_draft: s.accepted_draft,
        }
    }

    /// Runs one generation to completion (other queued requests progress too).
    pub fn generate(&mut self, prompt: &Prompt, params: &GenerateParams) -> Result<Generation> {
        let id = self.add_request(prompt, Task::Generate(params.clone()))?;
        match self.wait_for(id)?.outcome {
            Outcome::Generation(g) => Ok(g),
            Outcome::Failed(e) => Err(Error::InvalidRequest(e)),
            other => Err(Error::InvalidRequest(format!("unexpected outcome {other:?}"))),
        }
    }

    /// Scores `target` after `prompt`.
    pub fn score(&mut self, prompt: &Prompt, target: &[u32]) -> Result<Score> {
        Ok(self.score_many(&[(prompt.clone(), target.to_vec())])?.remove(0))
    }

    /// Scores many (prompt, target) pairs in batches. Their longest common prefix is computed once
    /// first, so that every pair reuses it from the prefix cache.
    pub fn score_many(&mut self, pairs: &[(Prompt, Vec<u32>)]) -> Result<Vec<Score>> {
        if pairs.len() > 1 && self.cfg.prefix_caching {
            let lcp = self.common_prefix(pairs)?;
            if lcp >= self.cfg.block_size {
                let id = self.add_request(&pairs[0].0, Task::Warm { len: lcp })?;
                if let Outcome::Failed(e) = self.wait_for(id)?.outcome {
                    return Err(Error::InvalidRequest(e));
                }
            }
        }
        let ids = pairs
            .iter()
            .map(|(p, t)| self.add_request(p, Task::Score { target: t.clone() }))
            .collect::<Result<Vec<_>>>()?;
        let mut outs = self.run_all()?;
        ids.iter()
            .map(|id| {
                let pos = outs
                    .iter()
                    .position(|o| o.id == *id)
                    .ok_or_else(|| Error::InvalidRequest(format!("request {id} lost")))?;
                match outs.swap_remove(pos).outcome {
                    Outcome::Score(s) => Ok(s),
                    Outcome::Failed(e) => Err(Error::InvalidRequest(e)),
                    other => Err(Error::InvalidRequest(format!("unexpected outcome {other:?}"))),
                }
            })
            .collect()
    }

    /// The prompt's tokens and positions under this model's image-pad id and merge size.
    fn flatten(&self, prompt: &Prompt) -> Result<FlatPrompt> {
        let pad = self.model.config.image_token_id.unwrap_or(0);
        let merge = self
            .model
            .config
            .vision
            .as_ref()
            .map_or(1, |v| v.spatial_merge_size);
        prompt.flatten(pad, merge)
    }

    /// Tokens shared by every pair's prompt (equal keys), capped so that each still computes its
    /// last prompt token.
    fn common_prefix(&self, pairs: &[(Prompt, Vec<u32>)]) -> Result<usize> {
        let mut first: Option<Vec<TokenKey>> = None;
        let mut lcp = usize::MAX;
        for (p, _) in pairs {
            let flat = self.flatten(p)?;
            lcp = lcp.min(flat.ids.len() - 1);
            let keys = token_keys(p, &flat);
            match &first {
                None => first = Some(keys),
                Some(f) => lcp = lcp.min(f.iter().zip(&keys).take_while(|(a, b)| a == b).count()),
            }
        }
        Ok(if lcp == usize::MAX { 0 } else { lcp })
    }

    /// Waits for request `id`, running other requests alongside; their outputs are dropped.
    fn wait_for(&mut self, id: RequestId) -> Result<EngineOutput> {
        loop {
            if !self.has_work() {
                return Err(Error::InvalidRequest(format!("request {id} is not queued")));
            }
            if let Some(o) = self.step()?.into_iter().find(|o| o.id == id) {
                return Ok(o);
            }
        }
    }
}

/// The cache key of every token of a flattened prompt: text ids, image hash and index, embedding-run
/// hash and index.
fn token_keys(prompt: &Prompt, flat: &FlatPrompt) -> Vec<TokenKey> {
    let mut keys: Vec<TokenKey> = flat.ids.iter().map(|&t| TokenKey::text(t)).collect();
    for run in &flat.runs {
        let key = |j: usize| match &prompt.segments[run.segment] {
            Segment::Image { hash, .. } => TokenKey::image(hash.0, j as u32),
            Segment::Embeds { hash, .. } => TokenKey::embed(*hash, j as u32),
            Segment::Text(t) => TokenKey::text(t[j]),
        };
        for (j, k) in keys[run.start..run.start + run.len].iter_mut().enumerate() {
            *k = key(j);
        }
    }
    keys
}

fn score_of(logprobs: &[f32]) -> Score {
    let sum: f64 = logprobs.iter().map(|&x| x as f64).sum();
    Score {
        token_logprobs: logprobs.to_vec(),
        sum_logprob: sum,
        mean_logprob: sum / logprobs.len().max(1) as f64,
    }
}
