//! Server-sent events for a streamed request of one or more choices: the engine events of every
//! choice, merged as they come, turned into chunks by the endpoint's [`Chunks`], then `data: [DONE]`.
//! An engine failure or the request timeout ends the stream with an error chunk and `[DONE]`.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::stream::{self, BoxStream, SelectAll, Stream, StreamExt};
use serde_json::Value;
use tokio_stream::wrappers::UnboundedReceiverStream;

use crate::engine::{EngineOutput, Outcome, TokenLogprobs};
use crate::server::engine_loop::{Event, InflightGuard};
use crate::server::error::ApiError;
use crate::server::prepare::Submitted;
use crate::server::AppState;

/// How an endpoint writes the chunks of its stream.
pub trait Chunks: Send + 'static {
    /// The chunks before any token (chat: a role chunk per choice).
    fn start(&mut self) -> Vec<Value>;
    /// The chunks for new tokens of choice `i`.
    fn tokens(
        &mut self,
        i: usize,
        tokens: &[u32],
        logprobs: &[TokenLogprobs],
    ) -> Result<Vec<Value>, ApiError>;
    /// The chunks when choice `i` finished with `out` (its last tokens came before).
    fn done(&mut self, i: usize, out: &EngineOutput) -> Result<Vec<Value>, ApiError>;
    /// The chunks once every choice finished (the usage chunk, when asked for).
    fn end(&mut self) -> Vec<Value>;
}

/// The event stream of `submitted` (choice `i` is `submitted[i]`) written by `chunks`.
pub fn sse(app: &Arc<AppState>, submitted: Vec<Submitted>, mut chunks: impl Chunks) -> Response {
    let remaining = submitted.len();
    let mut guards = Vec::with_capacity(remaining);
    let mut events: SelectAll<BoxStream<'static, (usize, Event)>> = SelectAll::new();
    for (i, s) in submitted.into_iter().enumerate() {
        guards.push(s.guard);
        let rest = UnboundedReceiverStream::new(s.rx);
        events.push(
            stream::once(async move { s.first })
                .chain(rest)
                .map(move |e| (i, e))
                .boxed(),
        );
    }
    let queue = chunks.start().into_iter().map(|c| c.to_string()).collect();
    let limit = app.limits.request_timeout;
    let state = State {
        chunks,
        events,
        queue,
        remaining,
        done: false,
        deadline: tokio::time::Instant::now() + limit,
        limit,
        _guards: guards,
    };
    Sse::new(unfold(state))
        .keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
        .into_response()
}

struct State<C> {
    chunks: C,
    events: SelectAll<BoxStream<'static, (usize, Event)>>,
    /// Chunks ready to send.
    queue: VecDeque<String>,
    /// Choices not yet finished.
    remaining: usize,
    done: bool,
    deadline: tokio::time::Instant,
    limit: Duration,
    _guards: Vec<InflightGuard>,
}

impl<C: Chunks> State<C> {
    /// Turns one engine event of choice `i` into chunks; `false` when the stream is over.
    fn absorb(&mut self, i: usize, ev: Event) -> bool {
        let chunks = match ev {
            Event::Tokens { tokens, logprobs } => self.chunks.tokens(i, &tokens, &logprobs),
            Event::Done(out) => match &out.outcome {
                Outcome::Generation(_) => {
                    self.remaining -= 1;
                    self.chunks.done(i, &out)
                }
                Outcome::Failed(m) => Err(ApiError::bad("messages", m.clone())),
                other => Err(ApiError::internal(format!("unexpected outcome {other:?}"))),
            },
            Event::Failed(e) => Err(ApiError::from_engine(&e, "messages")),
            Event::MissingImages(_) => Err(ApiError::internal("an image left the vision cache")),
        };
        match chunks {
            Ok(cs) => self.queue.extend(cs.into_iter().map(|c| c.to_string())),
            Err(e) => return self.error(e),
        }
        if self.remaining == 0 {
            let end = self.chunks.end();
            self.queue.extend(end.into_iter().map(|c| c.to_string()));
            self.queue.push_back("[DONE]".to_string());
            return false;
        }
        true
    }

    fn error(&mut self, e: ApiError) -> bool {
        self.queue.push_back(e.body().to_string());
        self.queue.push_back("[DONE]".to_string());
        false
    }
}

fn unfold<C: Chunks>(state: State<C>) -> impl Stream<Item = Result<SseEvent, std::convert::Infallible>> {
    stream::unfold(state, |mut st| async move {
        loop {
            if let Some(data) = st.queue.pop_front() {
                return Some((Ok(SseEvent::default().data(data)), st));
            }
            if st.done {
                return None;
            }
            let next = match tokio::time::timeout_at(st.deadline, st.events.next()).await {
                Ok(next) => next,
                Err(_) => {
                    st.done = !st.error(ApiError::timeout(st.limit));
                    continue;
                }
            };
            st.done = match next {
                Some((i, ev)) => !st.absorb(i, ev),
                None => !st.error(ApiError::unavailable("the engine stopped")),
            };
        }
    })
}
