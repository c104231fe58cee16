//! Turning a request's chat into what the engine thread runs, off that thread: the chat rendered with
//! the model's template (tools included) and tokenized, each image fetched under the media policy,
//! decoded and sized under its pixel budget, and the prompt's length known before anything is
//! encoded.
//!
//! Pixel budgets, most specific first: an image part's own `min_pixels` / `max_pixels` (Qwen's
//! format: on the part or inside its `image_url`), the request's `mm_processor_kwargs`
//! (`min_pixels`, `max_pixels`, or `size: {shortest_edge, longest_edge}`), the server's
//! `--min-pixels` / `--max-pixels`, the checkpoint's `preprocessor_config.json`. An image under a
//! budget other than the server's is cached under its own key ([`ImageHash::with_pixels`]), so two
//! requests that size one screenshot differently never share its embeddings or the K/V after it.

use std::sync::Arc;

use serde_json::{Map, Value};
use tokio::sync::mpsc;

use crate::engine::{ImageHash, RequestOptions, Task};
use crate::server::engine_loop::{Event, InflightGuard, PreparedChat, PreparedImage, PromptSource};
use crate::server::error::ApiError;
use crate::server::fields::Fields;
use crate::server::media::{image_tokens, SourceMemo};
use crate::server::AppState;
use crate::tokenize::chat::ChatMessage;
use crate::vision::PreprocessConfig;

/// The pixel bounds an image is resized into (`smart_resize`'s `min_pixels`, `max_pixels`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PixelBudget {
    pub min_pixels: usize,
    pub max_pixels: usize,
}

impl PixelBudget {
    /// The budget of a preprocessing configuration.
    pub fn of(cfg: &PreprocessConfig) -> Self {
        PixelBudget {
            min_pixels: cfg.min_pixels,
            max_pixels: cfg.max_pixels,
        }
    }

    /// This budget with what `f` sets (`min_pixels`, `max_pixels`, `size.shortest_edge`,
    /// `size.longest_edge`), checked: min ≤ max, room for one merged patch, and no more pixels than
    /// the server decodes (`--max-image-pixels`), so that a budget cannot inflate a small image.
    pub fn read(self, f: &Fields<'_>, factor: usize, cap: u64) -> Result<Self, ApiError> {
        let mut b = self;
        let set = |key: &str, f: &Fields<'_>, slot: &mut usize| -> Result<(), ApiError> {
            if let Some(n) = f.uint(key)? {
                if n > cap {
                    return Err(f.bad(
                        key,
                        format!(
                            "`{}` {n} exceeds the server's limit of {cap} pixels (--max-image-pixels)",
                            f.param(key)
                        ),
                    ));
                }
                *slot = n as usize;
            }
            Ok(())
        };
        set("min_pixels", f, &mut b.min_pixels)?;
        set("max_pixels", f, &mut b.max_pixels)?;
        if let Some(size) = f.object("size")? {
            let at = f.param("size");
            let size = Fields::nested(size, &at);
            set("shortest_edge", &size, &mut b.min_pixels)?;
            set("longest_edge", &size, &mut b.max_pixels)?;
        }
        if b.min_pixels > b.max_pixels || b.max_pixels < factor * factor {
            return Err(f.bad(
                "max_pixels",
                format!(
                    "the pixel budget min_pixels {} / max_pixels {} needs min ≤ max and max ≥ {} (one merged patch)",
                    b.min_pixels,
                    b.max_pixels,
                    factor * factor
                ),
            ));
        }
        Ok(b)
    }
}

/// One image of a request: its source, the field that holds it, and its budget.
#[derive(Debug, Clone)]
pub struct ImageRequest {
    pub source: String,
    pub param: String,
    pub budget: PixelBudget,
}

/// A request's chat: the messages, the tools for the template, and the images' fields and budgets
/// (in prompt order, once rendered).
#[derive(Debug, Clone, Default)]
pub struct ChatInput {
    pub messages: Vec<ChatMessage>,
    pub tools: Vec<Value>,
    /// The request's budget (`mm_processor_kwargs` over the server's).
    pub budget: Option<PixelBudget>,
    /// The request's `messages` as sent, for per-part budgets and field names.
    pub raw: Value,
}

impl ChatInput {
    /// The field name and budget of the image at content part `j` of message `i`.
    fn image(&self, app: &AppState, i: usize, j: usize) -> Result<(String, PixelBudget), ApiError> {
        let info = &app.engine.info;
        let base = self.budget.unwrap_or(PixelBudget::of(&info.preprocess));
        let at = format!("messages[{i}].content[{j}]");
        let Some(part) = self
            .raw
            .get(i)
            .and_then(|m| m.get("content"))
            .and_then(|c| c.get(j))
        else {
            return Ok((at, base));
        };
        let Some(part) = part.as_object() else {
            return Ok((at, base));
        };
        let factor = info.preprocess.factor();
        let cap = app.media.max_pixels();
        let budget = base.read(&Fields::nested(part, &at), factor, cap)?;
        match part.get("image_url").and_then(Value::as_object) {
            Some(inner) => {
                let inner_at = format!("{at}.image_url");
                let budget = budget.read(&Fields::nested(inner, &inner_at), factor, cap)?;
                Ok((format!("{inner_at}.url"), budget))
            }
            None => Ok((format!("{at}.image"), budget)),
        }
    }
}

/// Renders, tokenizes and fetches the images of a chat off the engine thread. With `use_memo`, an
/// image source seen recently is sent by hash only (the engine still holds its encoding). Images of
/// a client's request go through the media policy; `trusted` images are the server's own files
/// (an episode's screenshots), under the server's budget.
pub async fn prepare_chat(
    app: &AppState,
    chat: &ChatInput,
    use_memo: bool,
    trusted: bool,
) -> Result<PreparedChat, ApiError> {
    let info = &app.engine.info;
    let (ids, rendered) = info
        .renderer
        .render_ids(&info.tokenizer, &chat.messages, &chat.tools, true)
        .map_err(|e| ApiError::from_engine(&e, "messages"))?;
    let mut images = Vec::with_capacity(rendered.images.len());
    let mut prompt_tokens = ids.len() - rendered.images.len();
    for (src, &(i, j)) in rendered.images.iter().zip(&rendered.image_parts) {
        let (param, budget) = if trusted {
            (
                format!("messages[{i}].content[{j}]"),
                PixelBudget::of(&info.preprocess),
            )
        } else {
            chat.image(app, i, j)?
        };
        let req = ImageRequest {
            source: src.clone(),
            param,
            budget,
        };
        let (image, tokens) = prepare_image(app, &req, use_memo, trusted).await?;
        prompt_tokens += tokens;
        images.push(image);
    }
    Ok(PreparedChat {
        ids,
        images,
        prompt_tokens,
    })
}

/// One image of a chat: by hash when the memo knows its source under this budget, else fetched and
/// decoded.
async fn prepare_image(
    app: &AppState,
    req: &ImageRequest,
    use_memo: bool,
    trusted: bool,
) -> Result<(PreparedImage, usize), ApiError> {
    let info = &app.engine.info;
    let default = PixelBudget::of(&info.preprocess);
    let own = (req.budget != default).then_some(req.budget);
    let src = req.source.as_str();
    let key = if trusted {
        SourceMemo::file_key(std::path::Path::new(src))
    } else {
        SourceMemo::url_key(src)
    };
    let key = key.map(|k| match own {
        Some(b) => ImageHash(k).with_pixels(b.min_pixels, b.max_pixels).0,
        None => k,
    });
    let preprocess = own.map(|b| Arc::new(info.preprocess.clone().with_pixels(b.min_pixels, b.max_pixels)));
    if use_memo {
        if let Some((hash, tokens)) = key.and_then(|k| app.memo.get(k)) {
            return Ok((
                PreparedImage {
                    hash,
                    image: None,
                    preprocess,
                },
                tokens,
            ));
        }
    }
    let (data, name) = if trusted {
        let data = tokio::fs::read(src)
            .await
            .map_err(|e| ApiError::internal(format!("reading {src}: {e}")))?;
        (data, src.to_string())
    } else {
        app.media.fetch(src, &req.param).await?
    };
    let (media, param_owned) = (app.media.clone(), req.param.clone());
    let decoded = tokio::task::spawn_blocking(move || media.decode(&data, &name, &param_owned))
        .await
        .map_err(|e| ApiError::internal(format!("decoding an image: {e}")))??;
    let cfg = preprocess.as_deref().unwrap_or(&info.preprocess);
    let tokens = image_tokens(cfg, &decoded.image, &req.param)?;
    let hash = match own {
        Some(b) => decoded.hash.with_pixels(b.min_pixels, b.max_pixels),
        None => decoded.hash,
    };
    if let Some(k) = key {
        app.memo.insert(k, hash, tokens);
    }
    Ok((
        PreparedImage {
            hash,
            image: Some(decoded.image),
            preprocess,
        },
        tokens,
    ))
}

/// Submits a prepared chat `n` times (the choices of one request, which share the prompt's KV
/// blocks through the prefix cache) and waits for each first event; prepares it again with pixels
/// once if the engine no longer holds an image sent by hash. `task` and `opts` give each choice's
/// task and options.
pub async fn submit_chat(
    app: &AppState,
    chat: &ChatInput,
    n: usize,
    task: impl Fn(&PreparedChat) -> Result<Task, ApiError>,
    opts: impl Fn(usize) -> RequestOptions,
    stream: bool,
) -> Result<(Vec<Submitted>, usize), ApiError> {
    'again: for use_memo in [true, false] {
        let prepared = prepare_chat(app, chat, use_memo, false).await?;
        let prompt_tokens = prepared.prompt_tokens;
        let task = task(&prepared)?;
        let mut pending = Vec::with_capacity(n);
        for i in 0..n {
            let (rx, guard) = app
                .engine
                .submit(
                    PromptSource::Chat(prepared.clone()),
                    task.clone(),
                    opts(i),
                    stream,
                )
                .map_err(|_| ApiError::unavailable("the engine is not running"))?;
            pending.push((rx, guard));
        }
        let mut out = Vec::with_capacity(n);
        for (mut rx, guard) in pending {
            match rx.recv().await {
                Some(Event::MissingImages(hashes)) if use_memo => {
                    hashes.iter().for_each(|h| app.memo.forget(*h));
                    continue 'again;
                }
                Some(Event::Failed(e)) => return Err(ApiError::from_engine(&e, "messages")),
                Some(first) => out.push(Submitted { first, rx, guard }),
                None => return Err(ApiError::unavailable("the engine stopped")),
            }
        }
        return Ok((out, prompt_tokens));
    }
    Err(ApiError::internal(
        "images left the vision cache twice while preparing the request",
    ))
}

/// A submitted request: its first event, the rest to come, and its place in the in-flight count.
pub struct Submitted {
    pub first: Event,
    pub rx: mpsc::UnboundedReceiver<Event>,
    pub guard: InflightGuard,
}

/// `model`, when given, must name the served model.
pub fn check_model(f: &Fields<'_>, model_name: &str) -> Result<(), ApiError> {
    if let Some(model) = f.string("model")? {
        if model != model_name {
            return Err(ApiError::not_found(format!(
                "the model {} does not exist; this server serves `{model_name}`",
                crate::limits::excerpt(model)
            ))
            .with_code("model_not_found"));
        }
    }
    Ok(())
}

/// The request's pixel budget: `mm_processor_kwargs` over the server's.
pub fn request_budget(
    app: &AppState,
    kwargs: Option<&Map<String, Value>>,
) -> Result<Option<PixelBudget>, ApiError> {
    let Some(kwargs) = kwargs else {
        return Ok(None);
    };
    let pre = &app.engine.info.preprocess;
    let f = Fields::nested(kwargs, "mm_processor_kwargs");
    PixelBudget::of(pre)
        .read(&f, pre.factor(), app.media.max_pixels())
        .map(Some)
}

/// Refuses a request when `n` more would pass the server's queue limit.
pub fn check_queue(app: &AppState, n: usize) -> Result<(), ApiError> {
    if app.engine.inflight() + n > app.limits.max_queue {
        return Err(ApiError::too_many(format!(
            "the server's queue is full ({} requests in flight); retry later",
            app.limits.max_queue
        )));
    }
    Ok(())
}
