//! [`RemoteSession`]: the two-pass methods' [`Session`] inside the server. It runs on a blocking
//! thread; every call becomes a command to the engine loop, so an episode's passes are batched with
//! every other client's requests. When the HTTP client goes away, the next wait fails with
//! [`Error::Cancelled`] and the request in flight is cancelled (its receiver is dropped).

use std::sync::Arc;

use tokio::sync::{mpsc, watch};

use crate::engine::{EngineOutput, Prompt, RequestOptions, Score, Session, Task};
use crate::error::{Error, Result};
use crate::model::AdapterMode;
use crate::server::engine_loop::{Event, PromptSource};
use crate::server::prepare::{prepare_chat, ChatInput};
use crate::server::AppState;
use crate::tokenize::chat::ChatMessage;
use crate::tokenize::Tokenizer;

/// A session whose engine is the server's engine loop.
pub struct RemoteSession {
    app: Arc<AppState>,
    rt: tokio::runtime::Handle,
    /// Closed when the client that asked for this work is gone.
    client: watch::Receiver<()>,
}

impl RemoteSession {
    /// A session for work on behalf of the client holding `client`'s sender.
    pub fn new(app: Arc<AppState>, rt: tokio::runtime::Handle, client: watch::Receiver<()>) -> Self {
        RemoteSession { app, rt, client }
    }

    /// Waits for the next event of a request, or fails when the client is gone.
    fn next_event(&mut self, rx: &mut mpsc::UnboundedReceiver<Event>) -> Result<Event> {
        let client = &mut self.client;
        self.rt.block_on(async {
            tokio::select! {
                ev = rx.recv() => ev.ok_or(Error::Cancelled),
                _ = client.changed() => Err(Error::Cancelled),
            }
        })
    }

    /// Runs `f` on the engine thread and waits for its result.
    fn call<R: Send + 'static>(
        &mut self,
        f: impl FnOnce(&mut dyn crate::server::engine_loop::LoopCtx) -> R + Send + 'static,
    ) -> Result<R> {
        let rx = self.app.engine.call(f)?;
        let client = &mut self.client;
        self.rt.block_on(async {
            tokio::select! {
                r = rx => r.map_err(|_| Error::Cancelled),
                _ = client.changed() => Err(Error::Cancelled),
            }
        })
    }

    fn submit(&mut self, prompt: Prompt, task: Task, opts: RequestOptions) -> Result<EngineOutput> {
        let (mut rx, _guard) = self
            .app
            .engine
            .submit(PromptSource::Prompt(prompt), task, opts, false)?;
        match self.next_event(&mut rx)? {
            Event::Done(out) => Ok(*out),
            Event::Failed(e) => Err(e),
            other => Err(Error::InvalidRequest(format!(
                "unexpected engine event {other:?}"
            ))),
        }
    }
}

impl Session for RemoteSession {
    fn tokenizer(&self) -> &Tokenizer {
        &self.app.engine.info.tokenizer
    }

    fn eos_token_ids(&self) -> Vec<u32> {
        self.app.engine.info.eos_token_ids.clone()
    }

    fn hidden_size(&self) -> usize {
        self.app.engine.info.hidden_size
    }

    fn chat_prompt(&mut self, messages: &[ChatMessage]) -> Result<Prompt> {
        // The episode's screenshots are the server's own files: read directly, not under the
        // client media policy. A hash-only image the engine evicted is prepared again with pixels.
        let input = ChatInput {
            messages: messages.to_vec(),
            ..ChatInput::default()
        };
        for use_memo in [true, false] {
            let app = self.app.clone();
            let chat = self
                .rt
                .block_on(prepare_chat(&app, &input, use_memo, true))
                .map_err(|e| Error::InvalidRequest(e.message))?;
            match self.call(move |ctx| ctx.prompt(chat))?? {
                Ok(prompt) => return Ok(prompt),
                Err(missing) => missing.iter().for_each(|h| self.app.memo.forget(*h)),
            }
        }
        Err(Error::InvalidRequest(
            "images left the vision cache twice while preparing a prompt".into(),
        ))
    }

    fn run(&mut self, prompt: &Prompt, task: Task, opts: RequestOptions) -> Result<EngineOutput> {
        self.submit(prompt.clone(), task, opts)
    }

    fn score_many(&mut self, pairs: &[(Prompt, Vec<u32>)], adapter: AdapterMode) -> Result<Vec<Score>> {
        let opts = || RequestOptions::with_adapter(adapter);
        let owned = pairs.to_vec();
        if let Some((prompt, len)) = self.call(move |ctx| ctx.shared_prefix(&owned))?? {
            self.submit(prompt, Task::Warm { len }, opts())?;
        }
        // Submit every pair before waiting for any, so that they share the batch.
        let mut pending = Vec::with_capacity(pairs.len());
        for (prompt, target) in pairs {
            let task = Task::Score {
                target: target.clone(),
            };
            pending.push(self.app.engine.submit(
                PromptSource::Prompt(prompt.clone()),
                task,
                opts(),
                false,
            )?);
        }
        let mut scores = Vec::with_capacity(pairs.len());
        for (mut rx, _guard) in pending {
            match self.next_event(&mut rx)? {
                Event::Done(out) => match out.outcome {
                    crate::engine::Outcome::Score(s) => scores.push(s),
                    crate::engine::Outcome::Failed(e) => return Err(Error::InvalidRequest(e)),
                    other => return Err(Error::InvalidRequest(format!("unexpected outcome {other:?}"))),
                },
                Event::Failed(e) => return Err(e),
                other => {
                    return Err(Error::InvalidRequest(format!(
                        "unexpected engine event {other:?}"
                    )))
                }
            }
        }
        Ok(scores)
    }

    fn embed_tokens(&mut self, ids: &[u32]) -> Result<Vec<f32>> {
        let ids = ids.to_vec();
        self.call(move |ctx| ctx.embed(&ids))?
    }
}
