//! The engine loop: one thread owns the model and the [`Engine`]; every request — a chat completion,
//! a pass of an episode step, a scoring batch — arrives as a command, joins the continuous batch
//! between two steps and leaves when it finishes. The prefix and vision caches are shared by all
//! clients, so an agent's next step reuses its previous step's prefix.
//!
//! Handlers talk to the loop through an [`EngineHandle`]: commands go in over a channel; each request
//! gets its own channel of [`Event`]s back (tokens as they are generated, then the output). A client
//! that goes away drops its receiver, and the loop cancels the request at its next step: its blocks
//! return to the pool. All backend work happens on this one thread (the CUDA backend has one stream).

use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use image::RgbImage;
use tokio::sync::{mpsc, oneshot};

use crate::backend::{select, Backend, BackendChoice};
use crate::engine::pipeline::ChatRenderer;
use crate::engine::{
    Engine, EngineConfig, EngineOutput, EngineStats, ImageHash, Pipeline, Prompt, RequestId, RequestOptions,
    Task, TokenLogprobs,
};
use crate::error::{Error, Result};
use crate::model::AdapterMode;
use crate::server::metrics::Metrics;
use crate::tokenize::Tokenizer;
use crate::vision::PreprocessConfig;

/// What the handlers need to know about the model (everything but its weights).
#[derive(Debug, Clone)]
pub struct ModelInfo {
    /// The name clients use in `model`.
    pub name: String,
    pub renderer: ChatRenderer,
    pub tokenizer: Arc<Tokenizer>,
    pub preprocess: PreprocessConfig,
    pub eos_token_ids: Vec<u32>,
    /// Tokens of context (prompt plus generation).
    pub max_context: usize,
    pub hidden_size: usize,
    /// Rows of the model's embedding matrix: token ids a request may send.
    pub vocab_size: usize,
    /// `cpu` or `cuda`, and what it runs on.
    pub backend: String,
    pub device: String,
    /// Whether an HGKV adapter is loaded (and its mode).
    pub adapter: Option<AdapterMode>,
    pub num_blocks: usize,
    pub block_size: usize,
}

/// An image of a prepared chat: decoded pixels, or only the hash of one the engine should still hold
/// in its vision cache.
#[derive(Debug, Clone)]
pub struct PreparedImage {
    pub hash: ImageHash,
    pub image: Option<Arc<RgbImage>>,
    /// The preprocessing of a request's own pixel budget (`None`: the server's).
    pub preprocess: Option<Arc<PreprocessConfig>>,
}

/// A chat rendered and tokenized off the engine thread: token ids (one image-pad id per image) and
/// the images in order.
#[derive(Debug, Clone)]
pub struct PreparedChat {
    pub ids: Vec<u32>,
    pub images: Vec<PreparedImage>,
    /// Tokens of the prompt with every image expanded.
    pub prompt_tokens: usize,
}

/// A request's prompt: a prepared chat (built into a prompt on the engine thread) or a prompt.
pub enum PromptSource {
    Chat(PreparedChat),
    Prompt(Prompt),
}

/// What the engine loop tells a request's handler.
#[derive(Debug)]
pub enum Event {
    /// New tokens (and their log-probs, when asked for).
    Tokens {
        tokens: Vec<u32>,
        logprobs: Vec<TokenLogprobs>,
    },
    /// The request finished (the last tokens came in a `Tokens` event before).
    Done(Box<EngineOutput>),
    /// The request failed or never started.
    Failed(Error),
    /// Images of a prepared chat the engine no longer holds: prepare it again with pixels.
    MissingImages(Vec<ImageHash>),
}

/// What the engine thread does with the model on behalf of a handler (besides running requests).
pub trait LoopCtx {
    /// The prompt of a prepared chat (running the vision tower on new images); `Err(hashes)` when a
    /// hash-only image is no longer cached.
    fn prompt(&mut self, chat: PreparedChat) -> Result<std::result::Result<Prompt, Vec<ImageHash>>>;
    /// See [`Engine::shared_prefix`].
    fn shared_prefix(&self, pairs: &[(Prompt, Vec<u32>)]) -> Result<Option<(Prompt, usize)>>;
    /// The model's input embeddings of `ids`.
    fn embed(&self, ids: &[u32]) -> Result<Vec<f32>>;
}

type Call = Box<dyn FnOnce(&mut dyn LoopCtx) + Send>;

enum Command {
    Submit(Box<Submit>),
    Call(Call),
    Shutdown,
}

struct Submit {
    source: PromptSource,
    task: Task,
    opts: RequestOptions,
    events: mpsc::UnboundedSender<Event>,
    stream: bool,
}

/// The handlers' side of the engine loop.
pub struct EngineHandle {
    tx: mpsc::UnboundedSender<Command>,
    pub info: Arc<ModelInfo>,
    /// Requests submitted and not yet finished.
    inflight: Arc<AtomicUsize>,
    stats: Arc<Mutex<EngineStats>>,
    alive: Arc<AtomicBool>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

/// How the engine thread loads its model.
#[derive(Debug, Clone)]
pub struct EngineSpec {
    pub model: std::path::PathBuf,
    pub tokenizer: Option<std::path::PathBuf>,
    pub adapter: Option<(std::path::PathBuf, AdapterMode)>,
    pub backend: BackendChoice,
    /// `--min-pixels`, `--max-pixels`: the server's screenshot budget over the checkpoint's.
    pub pixels: (Option<usize>, Option<usize>),
    pub engine: EngineConfig,
    pub name: String,
}

/// A request in flight, as the loop tracks it.
struct Live {
    events: mpsc::UnboundedSender<Event>,
    stream: bool,
    /// Tokens already sent.
    sent: usize,
    submitted: Instant,
    last_token: Option<Instant>,
}

/// Decrements the in-flight count when a request's receiver is done with it.
pub struct InflightGuard(Arc<AtomicUsize>);

impl Drop for InflightGuard {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl EngineHandle {
    /// Starts the engine thread: opens the backend, loads the model and sizes the KV pool there (all
    /// device work stays on that thread). Returns once the model is loaded, or its error.
    pub fn spawn(spec: EngineSpec, metrics: Arc<Metrics>) -> Result<Self> {
        let (tx, rx) = mpsc::unbounded_channel();
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let stats = Arc::new(Mutex::new(EngineStats::default()));
        let alive = Arc::new(AtomicBool::new(true));
        let (stats2, alive2) = (stats.clone(), alive.clone());
        let thread = std::thread::Builder::new()
            .name("recall-engine".into())
            .spawn(move || {
                let result = select(spec.backend).and_then(|selected| {
                    crate::with_backend!(selected, be => run_thread(be, &spec, rx, &ready_tx, &stats2, &metrics))
                });
                if let Err(e) = result {
                    let _ = ready_tx.send(Err(e));
                }
                alive2.store(false, Ordering::SeqCst);
            })
            .map_err(|e| Error::InvalidRequest(format!("cannot start the engine thread: {e}")))?;
        let info = ready_rx
            .recv()
            .map_err(|_| Error::InvalidRequest("the engine thread ended while loading".into()))??;
        Ok(EngineHandle {
            tx,
            info: Arc::new(info),
            inflight: Arc::new(AtomicUsize::new(0)),
            stats,
            alive,
            thread: Mutex::new(Some(thread)),
        })
    }

    /// Whether the engine thread is running.
    pub fn is_alive(&self) -> bool {
        self.alive.load(Ordering::SeqCst)
    }

    /// Requests submitted and not finished.
    pub fn inflight(&self) -> usize {
        self.inflight.load(Ordering::SeqCst)
    }

    /// The engine's counters after its last step.
    pub fn stats(&self) -> EngineStats {
        self.stats.lock().map(|s| *s).unwrap_or_default()
    }

    /// Submits a request; its events arrive on the returned receiver. Drop the receiver to cancel.
    /// The guard counts the request as in flight until dropped.
    pub fn submit(
        &self,
        source: PromptSource,
        task: Task,
        opts: RequestOptions,
        stream: bool,
    ) -> Result<(mpsc::UnboundedReceiver<Event>, InflightGuard)> {
        let (events, rx) = mpsc::unbounded_channel();
        self.inflight.fetch_add(1, Ordering::SeqCst);
        let guard = InflightGuard(self.inflight.clone());
        let submit = Submit {
            source,
            task,
            opts,
            events,
            stream,
        };
        self.tx
            .send(Command::Submit(Box::new(submit)))
            .map_err(|_| Error::Cancelled)?;
        Ok((rx, guard))
    }

    /// Runs `f` on the engine thread between two steps.
    pub fn call<R: Send + 'static>(
        &self,
        f: impl FnOnce(&mut dyn LoopCtx) -> R + Send + 'static,
    ) -> Result<oneshot::Receiver<R>> {
        let (tx, rx) = oneshot::channel();
        let call: Call = Box::new(move |ctx| {
            let _ = tx.send(f(ctx));
        });
        self.tx.send(Command::Call(call)).map_err(|_| Error::Cancelled)?;
        Ok(rx)
    }

    /// Stops the loop: every request still in flight fails with [`Error::Cancelled`]; waits for the
    /// thread to end.
    pub fn shutdown(&self) {
        let _ = self.tx.send(Command::Shutdown);
        if let Some(t) = self.thread.lock().ok().and_then(|mut t| t.take()) {
            let _ = t.join();
        }
    }
}

/// The engine thread: loads the model, reports ready, runs the loop.
fn run_thread<B: Backend>(
    be: B,
    spec: &EngineSpec,
    rx: mpsc::UnboundedReceiver<Command>,
    ready: &std::sync::mpsc::Sender<Result<ModelInfo>>,
    stats: &Mutex<EngineStats>,
    metrics: &Metrics,
) -> Result<()> {
    let device = be.describe();
    let mut p = Pipeline::load(be, &spec.model, spec.tokenizer.as_deref())?;
    if let Some((path, mode)) = &spec.adapter {
        p.load_adapter(path, *mode)?;
    }
    if spec.pixels != (None, None) {
        let min = spec.pixels.0.unwrap_or(p.preprocess.min_pixels);
        let max = spec.pixels.1.unwrap_or(p.preprocess.max_pixels);
        let side = p.preprocess.factor().pow(2);
        if min > max || max < side {
            return Err(Error::InvalidRequest(format!(
                "--min-pixels {min} and --max-pixels {max}: need min <= max and max >= {side} (one merged patch)"
            )));
        }
        p.preprocess = p.preprocess.clone().with_pixels(min, max);
        tracing::info!(min, max, "screenshot pixel budget");
    }
    let engine = p.engine(spec.engine.clone())?;
    let text = p.model.text.config();
    let info = ModelInfo {
        name: spec.name.clone(),
        renderer: p.renderer(),
        tokenizer: Arc::new(p.tokenizer.clone()),
        preprocess: p.preprocess.clone(),
        eos_token_ids: p.eos_token_ids(),
        max_context: text.max_position_embeddings,
        hidden_size: text.hidden_size,
        vocab_size: text.vocab_size,
        backend: p.backend.name().to_string(),
        device,
        adapter: spec.adapter.as_ref().map(|a| a.1),
        num_blocks: engine.num_blocks(),
        block_size: spec.engine.block_size,
    };
    let _ = ready.send(Ok(info));
    let mut lp = Loop {
        p: &p,
        engine,
        cfg: spec.engine.clone(),
        live: HashMap::new(),
        stats,
        metrics,
    };
    lp.run(rx);
    Ok(())
}

struct Loop<'p, B: Backend> {
    p: &'p Pipeline<B>,
    engine: Engine<'p, B>,
    cfg: EngineConfig,
    live: HashMap<RequestId, Live>,
    stats: &'p Mutex<EngineStats>,
    metrics: &'p Metrics,
}

struct Ctx<'a, 'p, B: Backend> {
    p: &'p Pipeline<B>,
    engine: &'a mut Engine<'p, B>,
}

impl<B: Backend> LoopCtx for Ctx<'_, '_, B> {
    fn prompt(&mut self, chat: PreparedChat) -> Result<std::result::Result<Prompt, Vec<ImageHash>>> {
        build_prompt(self.p, self.engine, chat)
    }

    fn shared_prefix(&self, pairs: &[(Prompt, Vec<u32>)]) -> Result<Option<(Prompt, usize)>> {
        self.engine.shared_prefix(pairs)
    }

    fn embed(&self, ids: &[u32]) -> Result<Vec<f32>> {
        self.p.embed_tokens(ids)
    }
}

/// The prompt of a prepared chat: new images go through the vision tower; a hash-only image must
/// still be cached, else its hash is reported missing.
fn build_prompt<B: Backend>(
    p: &Pipeline<B>,
    engine: &mut Engine<'_, B>,
    chat: PreparedChat,
) -> Result<std::result::Result<Prompt, Vec<ImageHash>>> {
    let missing: Vec<ImageHash> = chat
        .images
        .iter()
        .filter(|im| im.image.is_none() && !engine.has_image(im.hash))
        .map(|im| im.hash)
        .collect();
    if !missing.is_empty() {
        return Ok(Err(missing));
    }
    let mut images = Vec::with_capacity(chat.images.len());
    for im in &chat.images {
        let grid = match &im.image {
            Some(img) => {
                let cfg = im.preprocess.as_deref().unwrap_or(&p.preprocess);
                p.encode_decoded_with(engine, im.hash, img, cfg)?
            }
            None => engine.image_grid(im.hash).ok_or_else(|| {
                Error::InvalidRequest(format!("image {:016x} left the vision cache", im.hash.0))
            })?,
        };
        images.push((im.hash, grid));
    }
    Ok(Ok(p.renderer().prompt(chat.ids, &images)?))
}

impl<'p, B: Backend> Loop<'p, B> {
    fn run(&mut self, mut rx: mpsc::UnboundedReceiver<Command>) {
        loop {
            // Wait for work when idle; otherwise take whatever arrived since the last step.
            let mut commands = Vec::new();
            if !self.engine.has_work() {
                match rx.blocking_recv() {
                    Some(c) => commands.push(c),
                    None => return,
                }
            }
            while let Ok(c) = rx.try_recv() {
                commands.push(c);
            }
            for c in commands {
                match c {
                    Command::Submit(s) => self.submit(*s),
                    Command::Call(f) => {
                        let mut ctx = Ctx {
                            p: self.p,
                            engine: &mut self.engine,
                        };
                        f(&mut ctx);
                    }
                    Command::Shutdown => {
                        self.fail_all(|| Error::Cancelled);
                        return;
                    }
                }
            }
            self.cancel_abandoned();
            if self.engine.has_work() {
                self.step();
            }
            if let Ok(mut s) = self.stats.lock() {
                *s = self.engine.stats();
            }
        }
    }

    fn submit(&mut self, s: Submit) {
        if s.events.is_closed() {
            return; // the client left before the request started
        }
        let prompt = match s.source {
            PromptSource::Prompt(p) => Ok(p),
            PromptSource::Chat(chat) => match build_prompt(self.p, &mut self.engine, chat) {
                Ok(Ok(p)) => Ok(p),
                Ok(Err(missing)) => {
                    let _ = s.events.send(Event::MissingImages(missing));
                    return;
                }
                Err(e) => Err(e),
            },
        };
        match prompt.and_then(|p| self.engine.add_request_with(&p, s.task, s.opts)) {
            Ok(id) => {
                self.live.insert(
                    id,
                    Live {
                        events: s.events,
                        stream: s.stream,
                        sent: 0,
                        submitted: Instant::now(),
                        last_token: None,
                    },
                );
            }
            Err(e) => {
                let _ = s.events.send(Event::Failed(e));
            }
        }
    }

    /// Cancels the requests whose clients went away.
    fn cancel_abandoned(&mut self) {
        let gone: Vec<RequestId> = self
            .live
            .iter()
            .filter(|(_, l)| l.events.is_closed())
            .map(|(id, _)| *id)
            .collect();
        for id in gone {
            self.live.remove(&id);
            if self.engine.cancel(id) {
                self.metrics.cancelled.inc();
                tracing::debug!(request = id, "cancelled: the client went away");
            }
        }
    }

    fn step(&mut self) {
        let result = std::panic::catch_unwind(AssertUnwindSafe(|| self.engine.step()));
        let outputs = match result {
            Ok(Ok(outputs)) => outputs,
            Ok(Err(e)) => {
                tracing::error!("engine step failed: {e}");
                let msg = e.to_string();
                self.fail_all(|| Error::InvalidRequest(format!("engine step failed: {msg}")));
                self.reset();
                return;
            }
            Err(panic) => {
                let msg = panic_message(panic.as_ref());
                tracing::error!("engine step panicked: {msg}");
                self.fail_all(|| Error::InvalidRequest(format!("engine step panicked: {msg}")));
                self.reset();
                return;
            }
        };
        self.stream_tokens();
        for out in outputs {
            self.finish(out);
        }
    }

    /// Sends every streaming request the tokens it has not seen yet.
    fn stream_tokens(&mut self) {
        let now = Instant::now();
        for (id, live) in self.live.iter_mut() {
            let Some(progress) = self.engine.progress(*id) else {
                continue;
            };
            let n = progress.generated.len();
            if n <= live.sent {
                continue;
            }
            observe_tokens(self.metrics, live, now, n);
            if live.stream {
                let _ = live.events.send(Event::Tokens {
                    tokens: progress.generated[live.sent..].to_vec(),
                    logprobs: progress.logprobs.get(live.sent..).unwrap_or_default().to_vec(),
                });
            }
            live.sent = n;
        }
    }

    fn finish(&mut self, out: EngineOutput) {
        let Some(mut live) = self.live.remove(&out.id) else {
            return;
        };
        let now = Instant::now();
        let generated = match &out.outcome {
            crate::engine::Outcome::Generation(g) => g.tokens.as_slice(),
            _ => &[],
        };
        if generated.len() > live.sent {
            observe_tokens(self.metrics, &mut live, now, generated.len());
            if live.stream {
                let _ = live.events.send(Event::Tokens {
                    tokens: generated[live.sent..].to_vec(),
                    logprobs: out.logprobs.get(live.sent..).unwrap_or_default().to_vec(),
                });
            }
        }
        self.metrics.prompt_tokens.inc_by(out.prompt_tokens as u64);
        self.metrics.generation_tokens.inc_by(generated.len() as u64);
        self.metrics.cached_tokens.inc_by(out.reused_tokens as u64);
        self.metrics
            .e2e_latency
            .observe(now.duration_since(live.submitted).as_secs_f64());
        let _ = live.events.send(Event::Done(Box::new(out)));
    }

    fn fail_all(&mut self, err: impl Fn() -> Error) {
        for (id, live) in self.live.drain() {
            self.engine.cancel(id);
            let _ = live.events.send(Event::Failed(err()));
        }
    }

    /// A fresh engine after a failed step (its caches may not be trustworthy).
    fn reset(&mut self) {
        match self.p.engine(self.cfg.clone()) {
            Ok(e) => self.engine = e,
            Err(e) => tracing::error!("cannot rebuild the engine: {e}"),
        }
    }
}

fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into())
}

/// Records time-to-first-token or inter-token latency for `live` reaching `n` tokens at `now`.
fn observe_tokens(metrics: &Metrics, live: &mut Live, now: Instant, n: usize) {
    match live.last_token {
        None => metrics
            .ttft
            .observe(now.duration_since(live.submitted).as_secs_f64()),
        Some(t) => {
            let per = now.duration_since(t).as_secs_f64() / (n - live.sent) as f64;
            for _ in live.sent..n {
                metrics.itl.observe(per);
            }
        }
    }
    live.last_token = Some(now);
}
