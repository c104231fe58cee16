//! What a forward's logits mean for each sequence: the next token (greedy on the device, or sampled
//! on the host), greedy verification of a draft, the log-probabilities a request asked for, and the
//! target log-probs of a scoring request.

use crate::backend::Backend;
use crate::engine::generate::finish_reason;
use crate::engine::sampling::token_logprobs;
use crate::engine::scheduler::Work;
use crate::engine::sequence::{Sequence, Task};
use crate::engine::{Generation, Outcome, Score};
use crate::error::{Error, Result};
use crate::kv::KvBlockManager;
use crate::tokenize::Tokenizer;

/// Records that work item `w` of `s` was computed and interprets its logits; `Some` when the
/// sequence is done (finished or failed).
pub(crate) fn postprocess<B: Backend>(
    be: &B,
    blocks: &mut KvBlockManager,
    tokenizer: Option<&Tokenizer>,
    s: &mut Sequence<B::Tensor>,
    w: &Work,
    logits: Option<B::Tensor>,
) -> Result<Option<Outcome>> {
    s.computed = w.start + w.len;
    s.forwards += 1;
    if let Some(kv) = s.kv {
        blocks.mark_computed(kv, s.computed)?;
    }
    let result = match (&s.task, logits) {
        (Task::Generate(_), Some(l)) => decide(be, blocks, tokenizer, s, w, &l),
        (Task::Score { .. }, Some(l)) => collect_logprobs(be, s, w, &l).map(|()| None),
        (Task::Warm { .. }, _) if s.is_prefilled() => Ok(Some(Outcome::Warmed)),
        _ => Ok(None),
    };
    Ok(match result {
        Ok(Some(o)) => Some(o),
        Ok(None) if matches!(s.task, Task::Score { .. }) && s.is_prefilled() => {
            Some(Outcome::Score(score_of(&s.logprobs)))
        }
        Ok(None) => None,
        Err(e) => Some(Outcome::Failed(e.to_string())),
    })
}

/// The next token after a generation step; `Some` when the sequence is done.
fn decide<B: Backend>(
    be: &B,
    blocks: &mut KvBlockManager,
    tokenizer: Option<&Tokenizer>,
    s: &mut Sequence<B::Tensor>,
    w: &Work,
    logits: &B::Tensor,
) -> Result<Option<Outcome>> {
    if s.draft_len == 0 {
        let row = if s.needs_rows() {
            Some(be.download(logits)?)
        } else {
            None
        };
        let next = match &row {
            Some(row) if s.penalties.is_some() || !s.sampling.is_greedy() => choose_on_host(s, row),
            // Greedy stays on the device's argmax, so that asking for logprobs changes no token.
            _ => be.argmax(logits)?[0],
        };
        return accept(tokenizer, s, next, row, false);
    }
    // Drafting (greedy only): rows from the last prompt token on predict the draft's tokens and one
    // more.
    let first = (s.prompt_len - 1).max(w.start);
    let end = w.start + w.len;
    if first < end {
        let rows = be.rows(logits, first - w.start, end - first)?;
        s.draft_preds.extend(be.argmax(&rows)?);
        if s.needs_rows() {
            let data = be.download(&rows)?;
            let vocab = be.dims(&rows).1;
            s.draft_logits.extend(data.chunks(vocab).map(<[f32]>::to_vec));
        }
    }
    if !s.is_prefilled() {
        return Ok(None);
    }
    verify(blocks, tokenizer, s)
}

/// The next token from a host row: penalised first (when the request has penalties), then greedy or
/// sampled.
fn choose_on_host<T>(s: &mut Sequence<T>, row: &[f32]) -> u32 {
    let penalised = s.penalties.as_ref().map(|p| p.penalised(row));
    let row = penalised.as_deref().unwrap_or(row);
    match &mut s.sampler {
        Some(sampler) if !s.sampling.is_greedy() => sampler.sample(row, &s.sampling),
        _ => crate::engine::sampling::argmax_row(row),
    }
}

/// Greedy verification of a draft: accepts the predictions up to and including the first one that
/// differs from the draft, drops the rejected draft tokens' K/V, and replays each accepted token as
/// an ordinary decision (so eos, stop strings and the token limit apply exactly as without a draft).
fn verify<T>(
    blocks: &mut KvBlockManager,
    tokenizer: Option<&Tokenizer>,
    s: &mut Sequence<T>,
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
        if let Some(done) = accept(tokenizer, s, token, rows.next(), i < k)? {
            return Ok(Some(done));
        }
    }
    Ok(None)
}

/// Records one generated token (with its log-probs and logits row when asked for); `Some` when
/// generation ends with it. Unless the token is already in the sequence (an accepted draft token),
/// it is appended, to be computed next step (the scheduler gives it a KV slot).
fn accept<T>(
    tokenizer: Option<&Tokenizer>,
    s: &mut Sequence<T>,
    next: u32,
    logits_row: Option<Vec<f32>>,
    in_sequence: bool,
) -> Result<Option<Outcome>> {
    let Task::Generate(params) = &s.task else {
        return Ok(None);
    };
    if let (Some(n), Some(row)) = (s.want_logprobs, &logits_row) {
        s.token_logprobs.push(token_logprobs(row, next, n));
    }
    if s.return_logits {
        s.decision_logits.extend(logits_row);
    }
    s.generated.push(next);
    if let Some(p) = &mut s.penalties {
        p.push(next);
    }
    if let Some(finish) = finish_reason(params, &s.generated, tokenizer)? {
        let text = tokenizer.map(|t| t.decode(&s.generated)).transpose()?;
        return Ok(Some(Outcome::Generation(Generation {
            tokens: s.generated.clone(),
            text,
            finish,
        })));
    }
    if !in_sequence {
        s.push_token(next);
    }
    Ok(None)
}

/// Log-probs of the target tokens predicted by the chunk's rows.
fn collect_logprobs<B: Backend>(
    be: &B,
    s: &mut Sequence<B::Tensor>,
    w: &Work,
    logits: &B::Tensor,
) -> Result<()> {
    // Row r (absolute) predicts token r + 1; targets are tokens prompt_len..tokens.len().
    let first = (s.prompt_len - 1).max(w.start);
    let last = (s.tokens.len() - 1).min(w.start + w.len);
    if first >= last {
        return Ok(());
    }
    let rows = be.rows(logits, first - w.start, last - first)?;
    let targets = &s.tokens[first + 1..last + 1];
    s.logprobs.extend(be.log_softmax_gather(&rows, targets)?);
    if let Some(n) = s.want_logprobs {
        // Prompt log-probs with alternatives (a completions request with `echo` and `logprobs`).
        let data = be.download(&rows)?;
        let vocab = be.dims(&rows).1;
        for (row, &t) in data.chunks(vocab).zip(targets) {
            s.token_logprobs.push(token_logprobs(row, t, n));
        }
    }
    Ok(())
}

fn score_of(logprobs: &[f32]) -> Score {
    let sum: f64 = logprobs.iter().map(|&x| x as f64).sum();
    Score {
        token_logprobs: logprobs.to_vec(),
        sum_logprob: sum,
        mean_logprob: sum / logprobs.len().max(1) as f64,
    }
}
