//! Allocation policies: which `B` past events get their screenshots restored at one decision.
//!
//! Every policy implements [`AllocationPolicy`] and is exact-`B` (it returns `min(B, #events)`
//! distinct steps, ascending) and deterministic given its inputs (and seed). All of them except
//! [`Recent`] choose from the deduplicated pool of [`dedup_pool`] and fall back to Recent-B when the
//! pool holds fewer than `B` events, as the learned selector does, so every arm sees the same
//! candidates:
//!
//! * [`Recent`] — Recent-B.
//! * [`Random`] — a uniform `B`-subset of the pool, seeded per decision by `splitmix64(seed ⊕
//!   splitmix64(t))`.
//! * [`Rgb`] — the `B` pool events whose 32×32 thumbnails ([`thumbnail`]) have the smallest mean
//!   absolute difference to the current screen's (ties: the more recent).
//! * [`OcrText`] — the `B` pool events whose screenshots' OCR transcripts are most similar to the
//!   current screen's ([`text_similarity`]: cosine of word counts; ties: the more recent). The
//!   transcripts come with the episode (`steps[i].ocr`, `final_ocr`); recall runs no OCR.
//! * [`Selector`] — the learned scorer through [`compose_with`] (paper, greedy or reference
//!   [`Mode`]).
//! * [`Inverted`] — the same with the negated score (a specificity control).
//! * [`OracleBeam`] — the reference-mode beam with true set utilities from a [`UtilityOracle`].

use std::collections::HashMap;

use image::RgbImage;

use crate::error::{Error, Result};
use crate::memory::selector::{
    beam_search, compose_with, dedup_pool, recent_b, ComposeOptions, DecisionContext, MarginalModel, Mode,
    Negated, DEFAULT_BEAM,
};

/// Thumbnail side in pixels.
pub const THUMB_SIDE: usize = 32;
/// Bytes of a thumbnail (RGB, row-major).
pub const THUMB_LEN: usize = THUMB_SIDE * THUMB_SIDE * 3;
/// A 32×32 RGB thumbnail, row-major, 3 bytes per pixel.
pub type Thumbnail = [u8; THUMB_LEN];

/// Extra per-decision inputs some policies need.
#[derive(Debug, Clone, Copy, Default)]
pub struct PolicyInputs<'a> {
    /// Thumbnail of the current screen ([`Rgb`]).
    pub current_thumbnail: Option<&'a Thumbnail>,
    /// Thumbnails of past events by step ([`Rgb`]).
    pub event_thumbnails: Option<&'a HashMap<usize, Thumbnail>>,
    /// OCR transcript of the current screen ([`OcrText`]).
    pub current_text: Option<&'a str>,
    /// OCR transcripts of past events' screenshots by step ([`OcrText`]).
    pub event_texts: Option<&'a HashMap<usize, &'a str>>,
}

/// A rule choosing which events regain their screenshots.
///
/// ```
/// use recall::memory::policy::{AllocationPolicy, PolicyInputs, Recent};
/// use recall::memory::selector::{ActionBucket, DecisionContext, EventInfo};
/// let ev = |step| EventInfo {
///     step, image_hash: step as u64, next_bucket: ActionBucket::Click, next_point: None, witness: false,
/// };
/// let ctx = DecisionContext { t: 6, reference_point: None, events: (1..6).map(ev).collect() };
/// assert_eq!(Recent.allocate(&ctx, 2, &PolicyInputs::default())?, vec![4, 5]);
/// # Ok::<(), recall::Error>(())
/// ```
pub trait AllocationPolicy: Send {
    /// A short name for reports.
    fn name(&self) -> &'static str;

    /// The chosen steps, ascending; exactly `min(budget, ctx.events.len())` of them.
    fn allocate(&mut self, ctx: &DecisionContext, budget: usize, extra: &PolicyInputs) -> Result<Vec<usize>>;
}

/// The pool when it can fill the budget, else `None` (the caller falls back to Recent-B). Validates
/// the context either way.
fn pool_or_recent(
    ctx: &DecisionContext,
    budget: usize,
) -> Result<std::result::Result<Vec<usize>, Vec<usize>>> {
    let pool = dedup_pool(ctx)?;
    let recent = recent_b(ctx, budget);
    if budget == 0 || ctx.events.len() <= budget || pool.len() < budget {
        Ok(Err(recent))
    } else {
        Ok(Ok(pool))
    }
}

/// Recent-B.
#[derive(Debug, Clone, Copy, Default)]
pub struct Recent;

impl AllocationPolicy for Recent {
    fn name(&self) -> &'static str {
        "recent"
    }
    fn allocate(
        &mut self,
        ctx: &DecisionContext,
        budget: usize,
        _extra: &PolicyInputs,
    ) -> Result<Vec<usize>> {
        dedup_pool(ctx)?; // validation
        Ok(recent_b(ctx, budget))
    }
}

/// SplitMix64 step.
fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A uniform random `B`-subset of the pool (partial Fisher–Yates), seeded per decision.
///
/// ```
/// use recall::memory::policy::{AllocationPolicy, PolicyInputs, Random};
/// # use recall::memory::selector::{ActionBucket, DecisionContext, EventInfo};
/// # let ev = |step| EventInfo {
/// #     step, image_hash: step as u64, next_bucket: ActionBucket::Click, next_point: None, witness: false,
/// # };
/// let ctx = DecisionContext { t: 20, reference_point: None, events: (1..20).map(ev).collect() };
/// let a = Random { seed: 7 }.allocate(&ctx, 4, &PolicyInputs::default())?;
/// assert_eq!(a, Random { seed: 7 }.allocate(&ctx, 4, &PolicyInputs::default())?);
/// assert_eq!(a.len(), 4);
/// # Ok::<(), recall::Error>(())
/// ```
#[derive(Debug, Clone, Copy)]
pub struct Random {
    pub seed: u64,
}

impl AllocationPolicy for Random {
    fn name(&self) -> &'static str {
        "random"
    }
    fn allocate(
        &mut self,
        ctx: &DecisionContext,
        budget: usize,
        _extra: &PolicyInputs,
    ) -> Result<Vec<usize>> {
        let mut pool = match pool_or_recent(ctx, budget)? {
            Ok(pool) => pool,
            Err(recent) => return Ok(recent),
        };
        let mut state = splitmix64(self.seed ^ splitmix64(ctx.t as u64));
        for i in 0..budget {
            state = splitmix64(state);
            // Unbiased enough for pools far below 2^32: multiply-shift on the high bits.
            let span = (pool.len() - i) as u64;
            let j = i + (((state >> 32) * span) >> 32) as usize;
            pool.swap(i, j);
        }
        let mut chosen = pool[..budget].to_vec();
        chosen.sort_unstable();
        Ok(chosen)
    }
}

/// A 32×32 RGB thumbnail by box filtering: output pixel `(x, y)` averages the source rectangle
/// `[⌊x·W/32⌋, max(⌊(x+1)·W/32⌋, ⌊x·W/32⌋+1))` × (the same in `y`), rounding half up; images
/// smaller than 32 pixels repeat source pixels. An empty image gives all zeros.
///
/// ```
/// let img = image::RgbImage::from_pixel(64, 48, image::Rgb([10, 20, 30]));
/// let t = recall::memory::policy::thumbnail(&img);
/// assert_eq!(&t[..3], &[10, 20, 30]);
/// ```
pub fn thumbnail(image: &RgbImage) -> Thumbnail {
    let mut out = [0u8; THUMB_LEN];
    let (w, h) = (image.width() as usize, image.height() as usize);
    if w == 0 || h == 0 {
        return out;
    }
    let span = |i: usize, n: usize| {
        let a = i * n / THUMB_SIDE;
        let b = ((i + 1) * n / THUMB_SIDE).max(a + 1).min(n);
        (a, b)
    };
    let raw = image.as_raw();
    for oy in 0..THUMB_SIDE {
        let (y0, y1) = span(oy, h);
        for ox in 0..THUMB_SIDE {
            let (x0, x1) = span(ox, w);
            let mut sum = [0u64; 3];
            for y in y0..y1 {
                let row = &raw[(y * w + x0) * 3..(y * w + x1) * 3];
                for px in row.chunks_exact(3) {
                    for c in 0..3 {
                        sum[c] += px[c] as u64;
                    }
                }
            }
            let n = ((y1 - y0) * (x1 - x0)) as u64;
            for c in 0..3 {
                out[(oy * THUMB_SIDE + ox) * 3 + c] = ((sum[c] + n / 2) / n) as u8;
            }
        }
    }
    out
}

/// Mean absolute difference of two thumbnails (0–255).
///
/// ```
/// let a = [0u8; 3072];
/// let b = [2u8; 3072];
/// assert_eq!(recall::memory::policy::thumbnail_distance(&a, &b), 2.0);
/// ```
pub fn thumbnail_distance(a: &Thumbnail, b: &Thumbnail) -> f64 {
    let total: u64 = a.iter().zip(b.iter()).map(|(&x, &y)| x.abs_diff(y) as u64).sum();
    total as f64 / THUMB_LEN as f64
}

/// RGB similarity: the `B` pool events most similar to the current screen.
#[derive(Debug, Clone, Copy, Default)]
pub struct Rgb;

impl AllocationPolicy for Rgb {
    fn name(&self) -> &'static str {
        "rgb"
    }
    fn allocate(&mut self, ctx: &DecisionContext, budget: usize, extra: &PolicyInputs) -> Result<Vec<usize>> {
        let pool = match pool_or_recent(ctx, budget)? {
            Ok(pool) => pool,
            Err(recent) => return Ok(recent),
        };
        let current = extra
            .current_thumbnail
            .ok_or_else(|| Error::InvalidRequest("rgb policy: no current_thumbnail".into()))?;
        let thumbs = extra
            .event_thumbnails
            .ok_or_else(|| Error::InvalidRequest("rgb policy: no event_thumbnails".into()))?;
        let mut scored = Vec::with_capacity(pool.len());
        for &s in &pool {
            let th = thumbs
                .get(&s)
                .ok_or_else(|| Error::InvalidRequest(format!("rgb policy: no thumbnail for step {s}")))?;
            scored.push((thumbnail_distance(current, th), s));
        }
        scored.sort_by(|a, b| a.0.total_cmp(&b.0).then(b.1.cmp(&a.1)));
        let mut chosen: Vec<usize> = scored[..budget].iter().map(|&(_, s)| s).collect();
        chosen.sort_unstable();
        Ok(chosen)
    }
}

/// The words of a transcript: maximal runs of alphanumeric characters, lowercased.
fn word_counts(text: &str) -> HashMap<String, f64> {
    let mut counts = HashMap::new();
    for word in text
        .split(|c: char| !c.is_alphanumeric())
        .filter(|w| !w.is_empty())
    {
        *counts.entry(word.to_lowercase()).or_insert(0.0) += 1.0;
    }
    counts
}

/// Cosine similarity of two transcripts' word-count vectors (words: maximal alphanumeric runs,
/// lowercased), in `[0, 1]`; 0 when either has no word. The CausalCache paper names an OCR-similarity
/// baseline without defining the similarity; this is recall's (plain bag of words, no weighting).
///
/// ```
/// use recall::memory::policy::text_similarity;
/// // "wi fi settings" vs "settings wi fi": the same words -> 1.
/// assert!((text_similarity("Wi-Fi settings", "settings, wi fi") - 1.0).abs() < 1e-12);
/// // {alarm: 1, clock: 1} vs {clock: 1}: 1 / (sqrt(2) * 1).
/// assert!((text_similarity("Alarm clock", "clock") - 0.5f64.sqrt()).abs() < 1e-12);
/// assert_eq!(text_similarity("", "clock"), 0.0);
/// ```
pub fn text_similarity(a: &str, b: &str) -> f64 {
    let (a, b) = (word_counts(a), word_counts(b));
    let norm = |m: &HashMap<String, f64>| m.values().map(|v| v * v).sum::<f64>().sqrt();
    let (na, nb) = (norm(&a), norm(&b));
    if na == 0.0 || nb == 0.0 {
        return 0.0;
    }
    let dot: f64 = a.iter().filter_map(|(w, x)| b.get(w).map(|y| x * y)).sum();
    dot / (na * nb)
}

/// OCR-text similarity: the `B` pool events whose transcripts are most similar to the current
/// screen's ([`text_similarity`]; ties: the more recent). Every pool event and the current screen
/// need a transcript; a missing one is an error naming the step.
#[derive(Debug, Clone, Copy, Default)]
pub struct OcrText;

impl AllocationPolicy for OcrText {
    fn name(&self) -> &'static str {
        "ocr"
    }
    fn allocate(&mut self, ctx: &DecisionContext, budget: usize, extra: &PolicyInputs) -> Result<Vec<usize>> {
        let pool = match pool_or_recent(ctx, budget)? {
            Ok(pool) => pool,
            Err(recent) => return Ok(recent),
        };
        let current = extra.current_text.ok_or_else(|| {
            Error::InvalidRequest(format!(
                "ocr policy: decision {} has no OCR transcript of its current screen (`ocr` of step {}, \
                 or `final_ocr` for the live step)",
                ctx.t, ctx.t
            ))
        })?;
        let texts = extra
            .event_texts
            .ok_or_else(|| Error::InvalidRequest("ocr policy: no event transcripts".into()))?;
        let mut scored = Vec::with_capacity(pool.len());
        for &s in &pool {
            let text = texts.get(&s).ok_or_else(|| {
                Error::InvalidRequest(format!(
                    "ocr policy: step {s} (steps[{}].ocr) has no OCR transcript of its screenshot",
                    s - 1
                ))
            })?;
            scored.push((text_similarity(current, text), s));
        }
        scored.sort_by(|a, b| b.0.total_cmp(&a.0).then(b.1.cmp(&a.1)));
        let mut chosen: Vec<usize> = scored[..budget].iter().map(|&(_, s)| s).collect();
        chosen.sort_unstable();
        Ok(chosen)
    }
}

/// The learned selector.
///
/// ```
/// use recall::memory::policy::{AllocationPolicy, PolicyInputs, Selector};
/// use recall::memory::selector::Mode;
/// # use recall::memory::selector::{ActionBucket, DecisionContext, EventInfo};
/// # let ev = |step| EventInfo {
/// #     step, image_hash: step as u64, next_bucket: ActionBucket::Click, next_point: None, witness: false,
/// # };
/// let ctx = DecisionContext { t: 9, reference_point: None, events: (1..9).map(ev).collect() };
/// let mut policy = Selector::new(|f: &[f32; 28]| -f[0], Mode::Paper);
/// assert_eq!(policy.allocate(&ctx, 2, &PolicyInputs::default())?, vec![7, 8]);
/// # Ok::<(), recall::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct Selector<M> {
    pub scorer: M,
    pub options: ComposeOptions,
}

impl<M: MarginalModel> Selector<M> {
    /// The selector in `mode` with default options.
    pub fn new(scorer: M, mode: Mode) -> Self {
        Selector {
            scorer,
            options: ComposeOptions::new(mode),
        }
    }
}

impl<M: MarginalModel + Send> AllocationPolicy for Selector<M> {
    fn name(&self) -> &'static str {
        "selector"
    }
    fn allocate(
        &mut self,
        ctx: &DecisionContext,
        budget: usize,
        _extra: &PolicyInputs,
    ) -> Result<Vec<usize>> {
        Ok(compose_with(ctx, budget, &self.scorer, &self.options)?.steps)
    }
}

/// The selector with its score negated.
#[derive(Debug, Clone)]
pub struct Inverted<M> {
    pub scorer: M,
    pub options: ComposeOptions,
}

impl<M: MarginalModel> Inverted<M> {
    /// The inverted selector in `mode` with default options.
    pub fn new(scorer: M, mode: Mode) -> Self {
        Inverted {
            scorer,
            options: ComposeOptions::new(mode),
        }
    }
}

impl<M: MarginalModel + Send> AllocationPolicy for Inverted<M> {
    fn name(&self) -> &'static str {
        "inverted"
    }
    fn allocate(
        &mut self,
        ctx: &DecisionContext,
        budget: usize,
        _extra: &PolicyInputs,
    ) -> Result<Vec<usize>> {
        Ok(compose_with(ctx, budget, &Negated(&self.scorer), &self.options)?.steps)
    }
}

/// True utility `U(S)` of restoring the events `S` (ascending steps), e.g. the mean log-prob of the
/// recorded response under the prompt rendered with `S`.
pub trait UtilityOracle {
    fn utility(&mut self, set: &[usize]) -> Result<f64>;
}

impl<F: FnMut(&[usize]) -> Result<f64>> UtilityOracle for F {
    fn utility(&mut self, set: &[usize]) -> Result<f64> {
        self(set)
    }
}

/// The beam of [`Mode::Reference`] with true set utilities: children ranked by `U(child)` (the same
/// order as the true marginal `U(child) − U(parent)`), sets scored by `U(S)`. Each distinct set is
/// queried once per decision.
///
/// ```
/// use recall::memory::policy::{AllocationPolicy, OracleBeam, PolicyInputs};
/// # use recall::memory::selector::{ActionBucket, DecisionContext, EventInfo};
/// # let ev = |step| EventInfo {
/// #     step, image_hash: step as u64, next_bucket: ActionBucket::Click, next_point: None, witness: false,
/// # };
/// let ctx = DecisionContext { t: 9, reference_point: None, events: (1..9).map(ev).collect() };
/// let oracle = |s: &[usize]| Ok(s.iter().map(|&x| if x % 3 == 0 { 1.0 } else { 0.0 }).sum::<f64>());
/// let mut policy = OracleBeam::new(oracle);
/// assert_eq!(policy.allocate(&ctx, 2, &PolicyInputs::default())?, vec![3, 6]);
/// # Ok::<(), recall::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct OracleBeam<O> {
    pub oracle: O,
    pub beam_width: usize,
    pub children_per_parent: usize,
}

impl<O: UtilityOracle> OracleBeam<O> {
    /// Beam 3, 3 children per parent.
    pub fn new(oracle: O) -> Self {
        OracleBeam {
            oracle,
            beam_width: DEFAULT_BEAM,
            children_per_parent: DEFAULT_BEAM,
        }
    }
}

impl<O: UtilityOracle + Send> AllocationPolicy for OracleBeam<O> {
    fn name(&self) -> &'static str {
        "oracle_beam"
    }
    fn allocate(
        &mut self,
        ctx: &DecisionContext,
        budget: usize,
        _extra: &PolicyInputs,
    ) -> Result<Vec<usize>> {
        let pool = match pool_or_recent(ctx, budget)? {
            Ok(pool) => pool,
            Err(recent) => return Ok(recent),
        };
        let recent = recent_b(ctx, budget);
        let mut cache: HashMap<Vec<usize>, f64> = HashMap::new();
        let oracle = &mut self.oracle;
        let found = beam_search(
            &pool,
            budget,
            &recent,
            None,
            self.beam_width.max(1),
            self.children_per_parent.max(1),
            |parent, _acc, candidates, out| {
                out.clear();
                for &c in candidates {
                    let mut child = parent.to_vec();
                    child.push(c);
                    child.sort_unstable();
                    let u = match cache.get(&child) {
                        Some(&u) => u,
                        None => {
                            let u = oracle.utility(&child)?;
                            cache.insert(child, u);
                            u
                        }
                    };
                    out.push((u, u));
                }
                Ok(())
            },
        )?;
        Ok(match found {
            Some((steps, _)) => steps,
            None => recent,
        })
    }
}
