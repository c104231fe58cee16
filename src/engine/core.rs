//! The engine: continuous batching of prefill chunks and decode steps over a paged KV pool whose
//! prefix cache makes every shared prefix (a second pass, the next agent step, sibling prompts in a
//! scoring call, another client's request) cost nothing the second time — and change nothing,
//! because a cached block holds exactly the K/V its key determines.
//!
//! `step()` reads like nano-vllm's: the [`Scheduler`] admits and plans (preempting when the pool is
//! full), the [`Runner`] runs one batched forward, and [`postprocess`] turns the logits into tokens,
//! verified drafts and scores.

use std::sync::Arc;

use crate::backend::Backend;
use crate::engine::postprocess::postprocess;
use crate::engine::prompt::{FlatPrompt, ImageHash, ImageRole, Prompt, Segment};
use crate::engine::runner::Runner;
use crate::engine::sampling::{Penalties, PenaltyState, Sampler, Sampling, TokenLogprobs};
use crate::engine::scheduler::{Scheduler, Work};
use crate::engine::sequence::{Injected, RequestId, Sequence, Task};
use crate::engine::vision_cache::{VisionCache, VisionEntry};
use crate::engine::{GenerateParams, Generation, Outcome, Score};
use crate::error::{Error, Result};
use crate::kv::{KvBlockManager, KvStats, TokenKey};
use crate::model::{AdapterMode, QwenVl};
use crate::tokenize::Tokenizer;
use crate::vision::PixelValues;

/// Sizes and policies of an [`Engine`].
#[derive(Debug, Clone, PartialEq)]
pub struct EngineConfig {
    /// Tokens per KV block.
    pub block_size: usize,
    /// Blocks in the KV pool (when neither `memory_utilization` applies nor `kv_cache_bytes` is set).
    pub num_blocks: usize,
    /// Size the KV pool by bytes instead: as many blocks as fit.
    pub kv_cache_bytes: Option<usize>,
    /// On a backend with its own memory (a GPU), size the KV pool so that everything uses at most
    /// this fraction of the device's memory (vLLM's `gpu_memory_utilization`); ignored on the CPU.
    pub memory_utilization: Option<f64>,
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
            memory_utilization: None,
            chunk_size: 512,
            max_batch_tokens: 2048,
            vision_cache_bytes: 1 << 30,
            prefix_caching: true,
        }
    }
}

/// Per-request options.
#[derive(Debug, Clone, Default, PartialEq)]
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
    /// decoding gives, in fewer forwards when the draft is right. Needs greedy sampling.
    pub draft: Vec<u32>,
    /// Generation only: how tokens are chosen (greedy by default).
    pub sampling: Sampling,
    /// Generation: return each generated token's log-probability and this many most likely
    /// alternatives. Scoring: the same for every target token (`EngineOutput::logprobs`).
    pub logprobs: Option<usize>,
    /// Generation only: repetition, frequency and presence penalties (none by default). They apply
    /// to greedy decoding too; the logits are then chosen from on the host.
    pub penalties: Penalties,
}

impl RequestOptions {
    /// The defaults, with the adapter acting as `adapter` says (scoring requests).
    ///
    /// ```
    /// use recall::engine::RequestOptions;
    /// use recall::model::AdapterMode;
    /// assert_eq!(RequestOptions::with_adapter(AdapterMode::Gated).adapter, AdapterMode::Gated);
    /// ```
    pub fn with_adapter(adapter: AdapterMode) -> Self {
        RequestOptions {
            adapter,
            ..RequestOptions::default()
        }
    }
}

/// A finished request.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineOutput {
    pub id: RequestId,
    pub outcome: Outcome,
    /// Logits of every generation decision (when asked for in [`RequestOptions`]).
    pub decision_logits: Vec<Vec<f32>>,
    /// Log-probabilities of the generated tokens (when asked for in [`RequestOptions`]).
    pub logprobs: Vec<TokenLogprobs>,
    /// Prompt tokens (image tokens included).
    pub prompt_tokens: usize,
    /// Prompt tokens served from the prefix cache when the request was admitted.
    pub reused_tokens: usize,
    /// Draft tokens accepted by verification.
    pub accepted_draft: usize,
    /// Forwards the request took part in.
    pub forwards: u64,
    /// Times the request was preempted (and recomputed) to let others decode.
    pub preemptions: u32,
}

/// What a running generation has produced so far (for streaming).
#[derive(Debug, Clone, Copy)]
pub struct Progress<'a> {
    pub generated: &'a [u32],
    pub logprobs: &'a [TokenLogprobs],
    /// Prompt tokens served from the prefix cache (0 until admitted).
    pub reused_tokens: usize,
}

/// Counters and gauges of an engine, for logs and `/metrics`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EngineStats {
    pub kv: KvStats,
    pub num_blocks: usize,
    pub waiting: usize,
    pub running: usize,
    pub preemptions: u64,
    pub forwards: u64,
    pub vision_tower_runs: u64,
    pub vision_cache_hits: u64,
}

/// Continuous-batching engine over one model.
pub struct Engine<'m, B: Backend> {
    be: &'m B,
    model: &'m QwenVl<B>,
    tokenizer: Option<&'m Tokenizer>,
    cfg: EngineConfig,
    num_blocks: usize,
    runner: Runner<'m, B>,
    blocks: KvBlockManager,
    scheduler: Scheduler<B::Tensor>,
    vision: VisionCache<B::Tensor>,
    next_id: RequestId,
    /// Outputs of requests that finished while [`Engine::wait_for`] waited for another one.
    parked: Vec<EngineOutput>,
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
        cfg: EngineConfig,
    ) -> Result<Self> {
        if cfg.block_size == 0 || cfg.chunk_size == 0 || cfg.max_batch_tokens == 0 {
            return Err(Error::InvalidRequest(format!(
                "engine sizes must be positive: {cfg:?}"
            )));
        }
        let num_blocks = pool_blocks(&cfg, be, model)?;
        let model_id = xxhash_rust::xxh64::xxh64(format!("{:?}", model.config).as_bytes(), 0);
        Ok(Engine {
            be,
            model,
            tokenizer,
            runner: Runner::new(be, model, num_blocks, cfg.block_size)?,
            blocks: KvBlockManager::new(num_blocks, cfg.block_size)?,
            scheduler: Scheduler::new(cfg.chunk_size, cfg.max_batch_tokens, cfg.prefix_caching),
            vision: VisionCache::new(model_id, cfg.vision_cache_bytes),
            num_blocks,
            cfg,
            next_id: 0,
            parked: Vec::new(),
            forwards: 0,
            sources: std::collections::HashMap::new(),
        })
    }

    /// The engine's configuration, as given.
    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    /// Blocks in the KV pool, as sized from the configuration.
    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Prefix-cache statistics.
    pub fn kv_stats(&self) -> KvStats {
        self.blocks.stats()
    }

    /// Counters and gauges.
    pub fn stats(&self) -> EngineStats {
        EngineStats {
            kv: self.blocks.stats(),
            num_blocks: self.num_blocks,
            waiting: self.scheduler.waiting.len(),
            running: self.scheduler.running.len(),
            preemptions: self.scheduler.preemptions,
            forwards: self.forwards,
            vision_tower_runs: self.vision.tower_runs,
            vision_cache_hits: self.vision.hits,
        }
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
        let bytes = rows * cols * self.be.element_bytes() * (1 + out.deepstack.len());
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

    /// Like [`Engine::add_request`], with options. Errors (queuing nothing) on an invalid request.
    pub fn add_request_with(
        &mut self,
        prompt: &Prompt,
        task: Task,
        opts: RequestOptions,
    ) -> Result<RequestId> {
        let flat = self.flatten(prompt)?;
        if flat.ids.is_empty() {
            return Err(Error::InvalidRequest("the prompt is empty".into()));
        }
        validate_task(&task, &opts, self.tokenizer.is_some())?;
        let injected = self.injected(prompt, &flat)?;
        let keys = token_keys(prompt, &flat);
        let (gate, adapter) = self.gates(prompt, &flat, opts.adapter)?;
        let keys = match adapter {
            Some((aid, _)) => keys
                .iter()
                .zip(&gate)
                .map(|(k, &g)| if g { k.with_adapter(aid) } else { *k })
                .collect(),
            None => keys,
        };
        let id = self.next_id;
        let mut seq = Sequence::new(id, task, flat, keys, injected, gate, adapter);
        seq.return_logits = opts.return_logits;
        seq.salt = opts.salt;
        seq.sampling = opts.sampling;
        seq.want_logprobs = opts.logprobs;
        if !opts.sampling.is_greedy() {
            seq.sampler = Some(Sampler::new(opts.sampling.seed));
        }
        if !opts.penalties.is_none() && matches!(seq.task, Task::Generate(_)) {
            seq.penalties = Some(PenaltyState::new(opts.penalties, &seq.tokens[..seq.prompt_len]));
        }
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
        self.next_id += 1;
        self.scheduler.waiting.push_back(seq);
        Ok(id)
    }

    /// The image and embedding runs of a prompt, with their cached (or uploaded) embeddings.
    fn injected(&mut self, prompt: &Prompt, flat: &FlatPrompt) -> Result<Vec<Injected<B::Tensor>>> {
        let hidden = self.model.text.config().hidden_size;
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
                        bytes: data.len() * self.be.element_bytes(),
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
        Ok(injected)
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
        self.scheduler.has_work()
    }

    /// One scheduling step: runs one batched forward and returns the requests that finished.
    pub fn step(&mut self) -> Result<Vec<EngineOutput>> {
        let mut done = std::mem::take(&mut self.parked);
        let admitted = self.scheduler.admit(&mut self.blocks);
        let (work, failed) = self.scheduler.schedule(&mut self.blocks);
        let mut finished: Vec<_> = admitted.into_iter().chain(failed).collect();
        if !work.is_empty() {
            self.forwards += 1;
            let ran = self.runner.run(&work, &self.scheduler.running, &self.blocks);
            finished.extend(self.postprocess(&work, ran)?);
        }
        done.extend(finished.into_iter().map(|(s, o)| self.finish(s, o)));
        Ok(done)
    }

    /// Interprets a forward's logits for every work item and takes the sequences that are done out
    /// of the running queue. When the forward failed, every sequence in it fails; the caches stay
    /// consistent (nothing new was marked computed).
    #[allow(clippy::type_complexity)]
    fn postprocess(
        &mut self,
        work: &[Work],
        ran: Result<Vec<Option<B::Tensor>>>,
    ) -> Result<Vec<(Sequence<B::Tensor>, Outcome)>> {
        let mut outcomes: Vec<(usize, Outcome)> = match ran {
            Ok(logits) => {
                let mut out = Vec::new();
                for (w, l) in work.iter().zip(logits) {
                    let s = &mut self.scheduler.running[w.seq];
                    if let Some(o) = postprocess(self.be, &mut self.blocks, self.tokenizer, s, w, l)? {
                        out.push((w.seq, o));
                    }
                }
                out
            }
            Err(e) => work
                .iter()
                .map(|w| (w.seq, Outcome::Failed(e.to_string())))
                .collect(),
        };
        outcomes.sort_by_key(|(i, _)| std::cmp::Reverse(*i));
        outcomes.dedup_by_key(|(i, _)| *i);
        Ok(outcomes
            .into_iter()
            .map(|(i, o)| (self.scheduler.running.remove(i), o))
            .collect())
    }

    /// Steps until every request has finished.
    pub fn run_all(&mut self) -> Result<Vec<EngineOutput>> {
        let mut out = Vec::new();
        while self.has_work() || !self.parked.is_empty() {
            out.extend(self.step()?);
        }
        Ok(out)
    }

    /// Cancels request `id` (queued or running): its blocks go back to the pool (those already
    /// registered stay in the prefix cache). Returns whether the request was found.
    pub fn cancel(&mut self, id: RequestId) -> bool {
        if let Some(i) = self.parked.iter().position(|o| o.id == id) {
            self.parked.remove(i);
            return true;
        }
        match self.scheduler.remove(id) {
            Some(s) => {
                self.release(&s);
                true
            }
            None => false,
        }
    }

    /// What request `id` has generated so far, while it is queued or running.
    pub fn progress(&self, id: RequestId) -> Option<Progress<'_>> {
        let s = self
            .scheduler
            .running
            .iter()
            .find(|s| s.id == id)
            .or_else(|| self.scheduler.waiting.iter().find(|s| s.id == id))?;
        Some(Progress {
            generated: &s.generated,
            logprobs: &s.token_logprobs,
            reused_tokens: s.reused,
        })
    }

    fn release(&mut self, s: &Sequence<B::Tensor>) {
        if let Some(kv) = s.kv {
            // A sequence the manager does not know cannot hold blocks; nothing to release then.
            let _ = self.blocks.free(kv);
        }
    }

    fn finish(&mut self, s: Sequence<B::Tensor>, outcome: Outcome) -> EngineOutput {
        self.release(&s);
        EngineOutput {
            id: s.id,
            outcome,
            decision_logits: s.decision_logits,
            logprobs: s.token_logprobs,
            prompt_tokens: s.prompt_len,
            reused_tokens: s.reused,
            accepted_draft: s.accepted_draft,
            forwards: s.forwards,
            preemptions: s.preemptions,
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
        self.score_many_with(pairs, AdapterMode::Off)
    }

    /// [`Engine::score_many`] with the loaded adapter acting as `adapter` says (labels scored through
    /// the HGKV policy).
    pub fn score_many_with(
        &mut self,
        pairs: &[(Prompt, Vec<u32>)],
        adapter: AdapterMode,
    ) -> Result<Vec<Score>> {
        let opts = || RequestOptions::with_adapter(adapter);
        if let Some((prompt, len)) = self.shared_prefix(pairs)? {
            let id = self.add_request_with(&prompt, Task::Warm { len }, opts())?;
            if let Outcome::Failed(e) = self.wait_for(id)?.outcome {
                return Err(Error::InvalidRequest(e));
            }
        }
        let ids = pairs
            .iter()
            .map(|(p, t)| self.add_request_with(p, Task::Score { target: t.clone() }, opts()))
            .collect::<Result<Vec<_>>>()?;
        ids.iter()
            .map(|&id| match self.wait_for(id)?.outcome {
                Outcome::Score(s) => Ok(s),
                Outcome::Failed(e) => Err(Error::InvalidRequest(e)),
                other => Err(Error::InvalidRequest(format!("unexpected outcome {other:?}"))),
            })
            .collect()
    }

    /// The warm-up that lets every pair of a scoring call reuse their common prefix: the first
    /// prompt and the prefix length, when there is more than one pair and the prefix fills a block.
    pub fn shared_prefix(&self, pairs: &[(Prompt, Vec<u32>)]) -> Result<Option<(Prompt, usize)>> {
        if pairs.len() < 2 || !self.cfg.prefix_caching {
            return Ok(None);
        }
        let lcp = self.common_prefix(pairs)?;
        Ok((lcp >= self.cfg.block_size).then(|| (pairs[0].0.clone(), lcp)))
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
            lcp = lcp.min(flat.ids.len().saturating_sub(1));
            let keys = token_keys(p, &flat);
            match &first {
                None => first = Some(keys),
                Some(f) => lcp = lcp.min(f.iter().zip(&keys).take_while(|(a, b)| a == b).count()),
            }
        }
        Ok(if lcp == usize::MAX { 0 } else { lcp })
    }

    /// Waits for request `id`, running other requests alongside; their outputs are kept for the next
    /// [`step`](Engine::step) (or a later `wait_for`).
    pub fn wait_for(&mut self, id: RequestId) -> Result<EngineOutput> {
        loop {
            if let Some(i) = self.parked.iter().position(|o| o.id == id) {
                return Ok(self.parked.remove(i));
            }
            if !self.has_work() {
                return Err(Error::InvalidRequest(format!("request {id} is not queued")));
            }
            let outs = self.step()?;
            self.parked.extend(outs);
        }
    }
}

/// Checks what a task and its options ask for before anything is queued.
fn validate_task(task: &Task, opts: &RequestOptions, has_tokenizer: bool) -> Result<()> {
    match task {
        Task::Generate(p) => {
            if !p.stop_strings.is_empty() && !has_tokenizer {
                return Err(Error::InvalidRequest("stop strings need a tokenizer".into()));
            }
            if p.max_tokens == 0 {
                return Err(Error::InvalidRequest("max_tokens must be at least 1".into()));
            }
            opts.sampling.validate()?;
            opts.penalties.validate()?;
            if !opts.draft.is_empty() && !opts.sampling.is_greedy() {
                return Err(Error::InvalidRequest(
                    "a draft is verified greedily; it cannot be combined with sampling".into(),
                ));
            }
            if !opts.draft.is_empty() && !opts.penalties.is_none() {
                return Err(Error::InvalidRequest(
                    "a draft is verified on raw logits; it cannot be combined with penalties".into(),
                ));
            }
        }
        Task::Score { target } if target.is_empty() => {
            return Err(Error::InvalidRequest("scoring needs a non-empty target".into()));
        }
        _ => {}
    }
    Ok(())
}

/// Blocks of the KV pool: from the device's memory when `memory_utilization` is set and the backend
/// has its own memory, else from `kv_cache_bytes`, else `num_blocks`.
fn pool_blocks<B: Backend>(cfg: &EngineConfig, be: &B, model: &QwenVl<B>) -> Result<usize> {
    let t = model.text.config();
    // K and V, every layer, rows of kv_heads · head_dim in the backend's element type.
    let per_block =
        2 * t.num_hidden_layers * cfg.block_size * t.num_key_value_heads * t.head_dim * be.element_bytes();
    let memory = match cfg.memory_utilization {
        Some(u) => be.memory_info()?.map(|m| (u, m)),
        None => None,
    };
    let (blocks, source) = if let Some((util, (free, total))) = memory {
        // Room for one forward's activations and logits, the vision cache and the tower's workspace.
        let eb = be.element_bytes();
        let activations =
            cfg.max_batch_tokens * (8 * t.hidden_size + 3 * t.intermediate_size + t.vocab_size) * eb;
        let reserve = activations + cfg.vision_cache_bytes + (1 << 30);
        let blocks = blocks_from_memory(free, total, util, reserve, per_block)?;
        (
            blocks,
            format!("{:.0}% of {} GiB device memory", util * 100.0, total >> 30),
        )
    } else if let Some(bytes) = cfg.kv_cache_bytes {
        (bytes / per_block.max(1), format!("{bytes} bytes"))
    } else {
        (cfg.num_blocks, "a block count".to_string())
    };
    if blocks == 0 {
        return Err(Error::KvCacheFull {
            what: format!("a KV pool sized by {source}"),
            needed: 1,
            available: 0,
            total: 0,
        });
    }
    tracing::info!(
        blocks,
        block_size = cfg.block_size,
        mib = (blocks * per_block) >> 20,
        "KV pool sized by {source}"
    );
    Ok(blocks)
}

/// Blocks that fit when everything together may use `utilization · total` bytes of device memory,
/// `total - free` are in use already (weights, the runtime) and `reserve` is kept for the work of a
/// step.
///
/// ```
/// use recall::engine::blocks_from_memory;
/// // 100 GiB device, 20 GiB used, 90% allowed, 5 GiB reserved: 65 GiB of 1 GiB blocks.
/// let gib = 1usize << 30;
/// assert_eq!(blocks_from_memory(80 * gib, 100 * gib, 0.9, 5 * gib, gib).unwrap(), 65);
/// assert!(blocks_from_memory(10 * gib, 100 * gib, 0.9, 5 * gib, gib).is_err());
/// ```
pub fn blocks_from_memory(
    free: usize,
    total: usize,
    utilization: f64,
    reserve: usize,
    per_block: usize,
) -> Result<usize> {
    if !(utilization > 0.0 && utilization <= 1.0) {
        return Err(Error::InvalidRequest(format!(
            "memory utilization {utilization} is outside (0, 1]"
        )));
    }
    let allowed = (total as f64 * utilization) as usize;
    let used = total.saturating_sub(free);
    let budget = allowed.saturating_sub(used).saturating_sub(reserve);
    if budget < per_block.max(1) {
        return Err(Error::KvCacheFull {
            what: format!(
                "the KV pool ({} MiB in use of {} MiB, {:.0}% allowed, {} MiB reserved for activations)",
                used >> 20,
                total >> 20,
                utilization * 100.0,
                reserve >> 20
            ),
            needed: 1,
            available: 0,
            total: 0,
        });
    }
    Ok(budget / per_block)
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
