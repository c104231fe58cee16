//! Benchmark scorers: the action-matching rules of AITW, AndroidControl and GUI-Odyssey as their authors
//! define them, beside recall's own equivalence rule (`recall`).
//!
//! Each scorer decides whether a predicted [`Action`] matches a reference [`Action`], given the optional
//! per-step data its rule needs ([`ScoreContext`]). Sources, the mapping of recall's actions onto each
//! benchmark's action space and the known quirks are in `docs/EVAL.md` ("Benchmark scorers"); in brief:
//!
//! * [`Scorer::Recall`]: [`exact_match`] — [`equivalent`](crate::action::equivalent) (the reference
//!   notes' rule), widened by [`ScoreContext::target_box`] exactly as the step evaluation does; with no
//!   box it is `equivalent` itself.
//! * [`Scorer::Aitw`]: google-research `android_in_the_wild/action_matching.py` (`check_actions_match`).
//!   Actions other than dual-point gestures match on their type alone (the typed text is not compared);
//!   a gesture is a tap when touch and lift are within 0.04 of the screen, a tap never matches a swipe;
//!   two taps match within 0.14 of the screen or inside one UI annotation box enlarged by 1.4 of its size
//!   (both points); two swipes match on their main axis (vertical or horizontal, not the direction).
//!   Computed in `f32`, as the authors' JAX code computes it.
//! * [`Scorer::AndroidControl`]: the Qwen2.5-VL team's AndroidControl scorer (the dataset's authors publish
//!   none): clicks and long presses of the same kind match inside a candidate element box enlarged 1.2× about
//!   its centre or within 0.04 of the screen; typed text and app names lower-cased, stripped, either
//!   contained in the other; swipes by direction; buttons equal; wait and terminate by type; a click on the
//!   app's icon box counts as opening it.
//! * [`Scorer::Odyssey`]: OpenGVLab/GUI-Odyssey `src/eval_mm/GUIOdyssey_action_matching.py`: same action
//!   name; clicks and long presses within 0.14 (on the 0–1000 scale / 1000) or inside the element's SAM2
//!   box ([`ScoreContext::target_box`]); scrolls by direction; typed text stripped, contained either way or
//!   with normalised Levenshtein similarity ≥ 0.5 (case-sensitive); other actions by name.
//!
//! Benchmark scorers are defined on mobile actions: a desktop action, or a pair from different platforms,
//! never matches under them; an action without a counterpart in the benchmark (e.g. `open` or `wait` in
//! AITW) never matches either. Grid value `g` is the fraction `g / 999` of the screen.
//!
//! ```
//! use recall::action::{parse_tool_call, Platform};
//! use recall::agent::scorers::{ScoreContext, Scorer};
//! use serde_json::{json, Value};
//!
//! let act = |args: Value| {
//!     parse_tool_call(&json!({"name": "mobile_use", "arguments": args}), Platform::Mobile).unwrap()
//! };
//! let reference = act(json!({"action": "click", "coordinate": [500, 500]}));
//! let predicted = act(json!({"action": "click", "coordinate": [600, 500]}));
//! let ctx = ScoreContext::default();
//! assert!(!Scorer::Recall.matches(&predicted, &reference, &ctx)); // 100 grid units > 25
//! assert!(Scorer::Aitw.matches(&predicted, &reference, &ctx)); // 0.10 of the screen <= 0.14
//! assert!(Scorer::Odyssey.matches(&predicted, &reference, &ctx));
//! assert!(!Scorer::AndroidControl.matches(&predicted, &reference, &ctx)); // > 0.04, no candidate box
//! ```

use std::fmt;
use std::str::FromStr;

use crate::action::{equivalent, py_strip, Action, ActionArgs, Button, Platform, Point, GRID_MAX};
use crate::agent::dataset::is_click_like;

/// An action-matching rule, selected by name (`--scorer`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Scorer {
    /// recall's equivalence (reference notes, "Action equivalence"), with the step's target box.
    #[default]
    Recall,
    /// Android in the Wild's `check_actions_match`.
    Aitw,
    /// The Qwen2.5-VL team's AndroidControl scorer.
    AndroidControl,
    /// GUI-Odyssey's `action_matching`.
    Odyssey,
}

/// A scorer name that [`Scorer::from_str`] does not know.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown scorer `{0}` (expected one of: recall, aitw, androidcontrol, odyssey)")]
pub struct UnknownScorer(pub String);

/// Per-step data a rule may need; every member is optional and an empty context is valid for every
/// scorer (a rule then uses what it has: e.g. AITW's taps fall back on their distance).
///
/// ```
/// use recall::agent::scorers::ScoreContext;
/// let ctx = ScoreContext { target_box: Some([400, 400, 600, 500]), ..ScoreContext::default() };
/// assert!(ctx.candidate_boxes.is_empty() && ctx.ui_annotations.is_empty());
/// ```
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ScoreContext {
    /// The reference element's box `[x0, y0, x1, y1]` on the 0–999 grid, inclusive: the step's
    /// `target_box` for `recall`, GUI-Odyssey's `sam2_bbox` (converted from its 0–1000 scale) for
    /// `odyssey`. Ignored by `aitw` and `androidcontrol`.
    pub target_box: Option<[u32; 4]>,
    /// AndroidControl's `candidate_bbox`: the boxes `[x0, y0, x1, y1]` of the elements a click may hit, on
    /// the 0–999 grid (fractional values allowed); the first one is the app icon for an `open` reference.
    /// Used by `androidcontrol` only.
    pub candidate_boxes: Vec<[f64; 4]>,
    /// AITW's UI annotations of the screen, as the dataset stores them: `(y, x, height, width)` as
    /// fractions of the screen (`image/ui_annotations_positions`, four values per element). Used by
    /// `aitw` only; none means taps are matched by distance alone.
    pub ui_annotations: Vec<[f64; 4]>,
}

impl Scorer {
    /// Every scorer, in the order of [`Scorer::name`]'s list.
    pub const ALL: [Scorer; 4] = [
        Scorer::Recall,
        Scorer::Aitw,
        Scorer::AndroidControl,
        Scorer::Odyssey,
    ];

    /// The scorer's name, as `--scorer` takes it.
    ///
    /// ```
    /// use recall::agent::scorers::Scorer;
    /// let names: Vec<&str> = Scorer::ALL.iter().map(|s| s.name()).collect();
    /// assert_eq!(names, ["recall", "aitw", "androidcontrol", "odyssey"]);
    /// ```
    pub fn name(self) -> &'static str {
        match self {
            Scorer::Recall => "recall",
            Scorer::Aitw => "aitw",
            Scorer::AndroidControl => "androidcontrol",
            Scorer::Odyssey => "odyssey",
        }
    }

    /// Whether `predicted` matches `reference` under this scorer's rule (see the module docs and
    /// `docs/EVAL.md`). Pure; never panics.
    ///
    /// ```
    /// use recall::action::{parse_tool_call, Platform};
    /// use recall::agent::scorers::{ScoreContext, Scorer};
    /// use serde_json::{json, Value};
    ///
    /// let act = |args: Value| {
    ///     parse_tool_call(&json!({"name": "mobile_use", "arguments": args}), Platform::Mobile).unwrap()
    /// };
    /// // Scrolls: AITW compares the main axis only, GUI-Odyssey the direction.
    /// let up = act(json!({"action": "swipe", "coordinate": [500, 800], "coordinate2": [500, 200]}));
    /// let down = act(json!({"action": "swipe", "coordinate": [500, 200], "coordinate2": [500, 800]}));
    /// let ctx = ScoreContext::default();
    /// assert!(Scorer::Aitw.matches(&down, &up, &ctx));
    /// assert!(!Scorer::Odyssey.matches(&down, &up, &ctx));
    /// // Typed text: AITW compares types only; GUI-Odyssey is case-sensitive, AndroidControl is not.
    /// let a = act(json!({"action": "type", "text": "AB"}));
    /// let b = act(json!({"action": "type", "text": "ab"}));
    /// assert!(Scorer::Aitw.matches(&a, &b, &ctx));
    /// assert!(!Scorer::Odyssey.matches(&a, &b, &ctx));
    /// assert!(Scorer::AndroidControl.matches(&a, &b, &ctx));
    /// ```
    pub fn matches(&self, predicted: &Action, reference: &Action, ctx: &ScoreContext) -> bool {
        let mobile = predicted.platform == Platform::Mobile && reference.platform == Platform::Mobile;
        match self {
            Scorer::Recall => exact_match(reference, predicted, ctx.target_box, reference.platform),
            _ if !mobile => false,
            Scorer::Aitw => aitw::matches(predicted, reference, &ctx.ui_annotations),
            Scorer::AndroidControl => android_control::matches(predicted, reference, &ctx.candidate_boxes),
            Scorer::Odyssey => odyssey::matches(predicted, reference, ctx.target_box),
        }
    }
}

impl fmt::Display for Scorer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Scorer {
    type Err = UnknownScorer;

    /// The scorer named `s` (exactly one of [`Scorer::name`]'s names).
    ///
    /// ```
    /// use recall::agent::scorers::Scorer;
    /// assert_eq!("odyssey".parse::<Scorer>(), Ok(Scorer::Odyssey));
    /// let err = "gui-odyssey".parse::<Scorer>().unwrap_err();
    /// assert!(err.to_string().contains("recall, aitw, androidcontrol, odyssey"));
    /// ```
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Scorer::ALL
            .into_iter()
            .find(|scorer| scorer.name() == s)
            .ok_or_else(|| UnknownScorer(s.to_string()))
    }
}

/// Grid value `g` as a fraction of the screen, `g / 999`.
fn fraction(g: u32) -> f64 {
    f64::from(g) / f64::from(GRID_MAX)
}

/// `s.lower().strip()` as Python does it (Unicode lower case, then Python's whitespace).
fn py_lower_strip(s: &str) -> String {
    py_strip(&s.to_lowercase()).to_string()
}

/// The finger's direction from `a` to `b` on the grid, as GUI-Odyssey's `decode_action` and the
/// AndroidControl scorer's `predict_direction` both define it: horizontal only when `|dx| > |dy|` (a tie
/// is vertical); right when `dx > 0`, else left; down when `dy > 0`, else up — except that no movement
/// is up for AndroidControl and down for GUI-Odyssey (each module has its own `direction`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Direction {
    Up,
    Down,
    Left,
    Right,
}

mod aitw {
    //! `android_in_the_wild/action_matching.py`, in `f32` like the authors' JAX arrays: points and boxes
    //! are rounded to `f32` where the code converts them (`jnp.asarray`), and the box augmentation is done
    //! in `f64` first, as NumPy does it on the annotation array, before `jnp.maximum`/`jnp.minimum`.

    use super::*;

    const TAP_DISTANCE_THRESHOLD: f32 = 0.14;
    const SWIPE_DISTANCE_THRESHOLD: f32 = 0.04;
    const AUGMENT_FRACTION: f64 = 1.4;

    /// An AITW action: a dual-point gesture with its touch and lift points `(y, x)`, or another type id.
    enum AitwAction {
        DualPoint { touch: [f32; 2], lift: [f32; 2] },
        Other(u8),
    }

    fn yx(p: Point) -> [f32; 2] {
        [fraction(p.y) as f32, fraction(p.x) as f32]
    }

    /// recall's mobile action in AITW's action space (`action_type.py`), `None` without a counterpart.
    fn to_aitw(a: &Action) -> Option<AitwAction> {
        Some(match &a.args {
            ActionArgs::Click { coordinate } | ActionArgs::LongPress { coordinate } => {
                AitwAction::DualPoint {
                    touch: yx(*coordinate),
                    lift: yx(*coordinate),
                }
            }
            ActionArgs::Swipe {
                coordinate,
                coordinate2,
            } => AitwAction::DualPoint {
                touch: yx(*coordinate),
                lift: yx(*coordinate2),
            },
            ActionArgs::Type { .. } => AitwAction::Other(3),
            ActionArgs::SystemButton { button } => AitwAction::Other(match button {
                Button::Back => 5,
                Button::Home => 6,
                Button::Enter => 7,
            }),
            // STATUS_TASK_COMPLETE, or STATUS_TASK_IMPOSSIBLE when the status was not `success`.
            ActionArgs::Terminate { .. } => {
                AitwAction::Other(if a.coerced_status.is_some() { 11 } else { 10 })
            }
            _ => return None,
        })
    }

    fn norm(a: [f32; 2], b: [f32; 2]) -> f32 {
        let (dy, dx) = (a[0] - b[0], a[1] - b[1]);
        (dy * dy + dx * dx).sqrt()
    }

    fn is_tap(touch: [f32; 2], lift: [f32; 2]) -> bool {
        norm(touch, lift) <= SWIPE_DISTANCE_THRESHOLD
    }

    /// `jnp.maximum(0, v)` / `jnp.minimum(1, v)`, NaN propagating.
    fn clamp_low(v: f32) -> f32 {
        if v.is_nan() {
            v
        } else {
            v.max(0.0)
        }
    }

    fn clamp_high(v: f32) -> f32 {
        if v.is_nan() {
            v
        } else {
            v.min(1.0)
        }
    }

    /// `_resize_annotation_bounding_boxes`: `(top, left, height, width)` after augmentation. The top-left
    /// corner moves by 0.7 of the size and the size grows by 1.4 of itself, each clamped separately, so a
    /// box clamped at the top or left edge grows only downwards or rightwards (by the full 1.4).
    fn augment(b: &[f64; 4]) -> [f32; 4] {
        let [y, x, h, w] = *b;
        let (hc, wc) = (AUGMENT_FRACTION * h, AUGMENT_FRACTION * w);
        [
            clamp_low((y - hc / 2.0) as f32),
            clamp_low((x - wc / 2.0) as f32),
            clamp_high((h + hc) as f32),
            clamp_high((w + wc) as f32),
        ]
    }

    /// `_yx_in_bounding_boxes`, inclusive of the edges.
    fn inside(p: [f32; 2], b: [f32; 4]) -> bool {
        let [top, left, height, width] = b;
        let (bottom, right) = (top + height, left + width);
        p[0] >= top && p[0] <= bottom && p[1] >= left && p[1] <= right
    }

    fn taps_match(t1: [f32; 2], t2: [f32; 2], boxes: &[[f64; 4]]) -> bool {
        let both_in_box = boxes.iter().map(augment).any(|b| inside(t1, b) && inside(t2, b));
        both_in_box || norm(t1, t2) <= TAP_DISTANCE_THRESHOLD
    }

    /// `np.argmax(|lift - touch|)` over `(y, x)`: 0 (vertical) unless `|dx| > |dy|`.
    fn main_axis(touch: [f32; 2], lift: [f32; 2]) -> u8 {
        let (dy, dx) = ((lift[0] - touch[0]).abs(), (lift[1] - touch[1]).abs());
        u8::from(dx > dy)
    }

    pub(super) fn matches(predicted: &Action, reference: &Action, boxes: &[[f64; 4]]) -> bool {
        let (Some(p), Some(r)) = (to_aitw(predicted), to_aitw(reference)) else {
            return false;
        };
        match (p, r) {
            (AitwAction::Other(a), AitwAction::Other(b)) => a == b,
            (AitwAction::Other(_), AitwAction::DualPoint { .. })
            | (AitwAction::DualPoint { .. }, AitwAction::Other(_)) => false,
            (
                AitwAction::DualPoint { touch: t1, lift: l1 },
                AitwAction::DualPoint { touch: t2, lift: l2 },
            ) => match (is_tap(t1, l1), is_tap(t2, l2)) {
                (true, true) => taps_match(t1, t2, boxes),
                (false, false) => main_axis(t1, l1) == main_axis(t2, l2),
                _ => false,
            },
        }
    }
}

mod android_control {
    //! The Qwen2.5-VL team's AndroidControl scorer (gist
    //! `LukeForeverYoung/1f5d19495788de0d905c5ac6341153f5`, linked from QwenLM/Qwen2.5-VL issue #904),
    //! coordinates as fractions of the screen (`f64`, as NumPy).

    use super::*;

    const BBOX_ENLARGE_FACTOR: f64 = 1.2;
    const POINT_DISTANCE_THRESHOLD: f64 = 0.04;

    fn point(p: Point) -> [f64; 2] {
        [fraction(p.x), fraction(p.y)]
    }

    /// `check_text`: lower-cased and stripped, either one contained in the other.
    fn text_match(predicted: &str, reference: &str) -> bool {
        let (p, r) = (py_lower_strip(predicted), py_lower_strip(reference));
        r.contains(p.as_str()) || p.contains(r.as_str())
    }

    /// A grid box as fractions `[x0, y0, x1, y1]`.
    fn fraction_box(b: &[f64; 4]) -> [f64; 4] {
        let g = f64::from(GRID_MAX);
        [b[0] / g, b[1] / g, b[2] / g, b[3] / g]
    }

    /// `enlarge_bbox`: scaled by 1.2 about its centre.
    fn enlarge(b: [f64; 4]) -> [f64; 4] {
        let (xc, yc) = ((b[0] + b[2]) / 2.0, (b[1] + b[3]) / 2.0);
        let (w, h) = (
            (b[2] - b[0]) * BBOX_ENLARGE_FACTOR,
            (b[3] - b[1]) * BBOX_ENLARGE_FACTOR,
        );
        [xc - w / 2.0, yc - h / 2.0, xc + w / 2.0, yc + h / 2.0]
    }

    /// `check_click`: inside an enlarged candidate box (inclusive), or within 0.04 of `gt`.
    fn check_click(click: [f64; 2], boxes: &[[f64; 4]], gt: [f64; 2]) -> bool {
        let in_box = boxes
            .iter()
            .map(|b| enlarge(fraction_box(b)))
            .any(|b| b[0] <= click[0] && click[0] <= b[2] && b[1] <= click[1] && click[1] <= b[3]);
        let (dx, dy) = (gt[0] - click[0], gt[1] - click[1]);
        in_box || (dx * dx + dy * dy).sqrt() <= POINT_DISTANCE_THRESHOLD
    }

    /// `predict_direction` (finger movement; a tie is vertical, no movement is up).
    fn direction(a: Point, b: Point) -> Direction {
        let (dx, dy) = (i64::from(b.x) - i64::from(a.x), i64::from(b.y) - i64::from(a.y));
        match (dx.abs() > dy.abs(), dx > 0, dy > 0) {
            (true, true, _) => Direction::Right,
            (true, false, _) => Direction::Left,
            (false, _, true) => Direction::Down,
            (false, _, false) => Direction::Up,
        }
    }

    pub(super) fn matches(predicted: &Action, reference: &Action, boxes: &[[f64; 4]]) -> bool {
        use ActionArgs as A;
        match (&reference.args, &predicted.args) {
            (A::Wait, A::Wait) | (A::Terminate { .. }, A::Terminate { .. }) => true,
            (A::SystemButton { button: r }, A::SystemButton { button: p }) => r == p,
            (A::Type { text: r }, A::Type { text: p }) | (A::Open { text: r }, A::Open { text: p }) => {
                text_match(p, r)
            }
            // A click on the app's icon (the first candidate box) opens it.
            (A::Open { .. }, A::Click { coordinate }) => match boxes.first() {
                Some(icon) => {
                    let b = fraction_box(icon);
                    let centre = [(b[0] + b[2]) / 2.0, (b[1] + b[3]) / 2.0];
                    check_click(point(*coordinate), boxes, centre)
                }
                None => false,
            },
            (
                A::Swipe {
                    coordinate: r1,
                    coordinate2: r2,
                },
                A::Swipe {
                    coordinate: p1,
                    coordinate2: p2,
                },
            ) => direction(*p1, *p2) == direction(*r1, *r2),
            (A::Click { coordinate: r }, A::Click { coordinate: p })
            | (A::LongPress { coordinate: r }, A::LongPress { coordinate: p }) => {
                check_click(point(*p), boxes, point(*r))
            }
            _ => false,
        }
    }
}

mod odyssey {
    //! `src/eval_mm/GUIOdyssey_action_matching.py` (`action_matching`), with scroll directions from
    //! `data/format_converter.py` (`decode_action`). Grid value `g` is `g · 1000 / 999` on GUI-Odyssey's
    //! 0–1000 scale, so a distance divided by 1000 is the grid distance divided by 999.

    use super::*;

    const CLICK_COORD_THRESHOLD: f64 = 0.14;
    const TEXT_ANLS_THRESHOLD: f64 = 0.5;

    /// GUI-Odyssey's action names (`decode_action`'s outputs) with the information they are matched on.
    #[derive(PartialEq)]
    enum Kind {
        Click,
        LongPress,
        Scroll,
        Type,
        PressBack,
        PressHome,
        Complete,
        Impossible,
    }

    fn kind(a: &Action) -> Option<Kind> {
        Some(match &a.args {
            ActionArgs::Click { .. } => Kind::Click,
            ActionArgs::LongPress { .. } => Kind::LongPress,
            ActionArgs::Swipe { .. } => Kind::Scroll,
            ActionArgs::Type { .. } => Kind::Type,
            ActionArgs::SystemButton { button: Button::Back } => Kind::PressBack,
            ActionArgs::SystemButton { button: Button::Home } => Kind::PressHome,
            ActionArgs::Terminate { .. } if a.coerced_status.is_some() => Kind::Impossible,
            ActionArgs::Terminate { .. } => Kind::Complete,
            _ => return None,
        })
    }

    /// `decode_action`'s scroll direction: `LEFT`/`RIGHT` when `|dx| > |dy|`, else `UP` when `dy < 0`,
    /// else `DOWN` (a tie is vertical, no movement is down).
    fn direction(a: Point, b: Point) -> Direction {
        let (dx, dy) = (i64::from(b.x) - i64::from(a.x), i64::from(b.y) - i64::from(a.y));
        match (dx.abs() > dy.abs(), dx < 0, dy < 0) {
            (true, true, _) => Direction::Left,
            (true, false, _) => Direction::Right,
            (false, _, true) => Direction::Up,
            (false, _, false) => Direction::Down,
        }
    }

    /// The point on GUI-Odyssey's scale divided by 1000, as `np.asarray(info) / 1000` computes it.
    fn scaled(p: Point) -> [f64; 2] {
        let s = |g: u32| f64::from(g) * 1000.0 / f64::from(GRID_MAX) / 1000.0;
        [s(p.x), s(p.y)]
    }

    /// `click_matching`: the prediction inside the SAM2 box (inclusive), or within 0.14.
    fn click_match(predicted: Point, reference: Point, sam2_box: Option<[u32; 4]>) -> bool {
        if let Some([x1, y1, x2, y2]) = sam2_box {
            if (x1..=x2).contains(&predicted.x) && (y1..=y2).contains(&predicted.y) {
                return true;
            }
        }
        let (p, r) = (scaled(predicted), scaled(reference));
        let (dx, dy) = (p[0] - r[0], p[1] - r[1]);
        (dx * dx + dy * dy).sqrt() <= CLICK_COORD_THRESHOLD
    }

    /// Levenshtein distance over code points.
    fn levenshtein(a: &[char], b: &[char]) -> usize {
        let (a, b) = if a.len() > b.len() { (b, a) } else { (a, b) };
        let mut row: Vec<usize> = (0..=a.len()).collect();
        for (i, cb) in b.iter().enumerate() {
            let mut next = Vec::with_capacity(a.len() + 1);
            next.push(i + 1);
            for (j, ca) in a.iter().enumerate() {
                let cost = if ca == cb {
                    row[j]
                } else {
                    1 + row[j].min(row[j + 1]).min(next[j])
                };
                next.push(cost);
            }
            row = next;
        }
        row[a.len()]
    }

    /// `text_matching`: stripped (case kept), contained either way, or ANLS `1 − lev / max len ≥ 0.5`.
    fn text_match(reference: &str, predicted: &str) -> bool {
        let (r, p) = (py_strip(reference), py_strip(predicted));
        if p.contains(r) || r.contains(p) {
            return true;
        }
        let (rc, pc): (Vec<char>, Vec<char>) = (r.chars().collect(), p.chars().collect());
        let length = rc.len().max(pc.len());
        let value = if length == 0 {
            0.0
        } else {
            levenshtein(&rc, &pc) as f64 / length as f64
        };
        1.0 - value >= TEXT_ANLS_THRESHOLD
    }

    pub(super) fn matches(predicted: &Action, reference: &Action, sam2_box: Option<[u32; 4]>) -> bool {
        let (Some(pk), Some(rk)) = (kind(predicted), kind(reference)) else {
            return false;
        };
        if pk != rk {
            return false;
        }
        use ActionArgs as A;
        match (&predicted.args, &reference.args) {
            (A::Click { coordinate: p }, A::Click { coordinate: r })
            | (A::LongPress { coordinate: p }, A::LongPress { coordinate: r }) => {
                click_match(*p, *r, sam2_box)
            }
            (
                A::Swipe {
                    coordinate: p1,
                    coordinate2: p2,
                },
                A::Swipe {
                    coordinate: r1,
                    coordinate2: r2,
                },
            ) => direction(*p1, *p2) == direction(*r1, *r2),
            (A::Type { text: p }, A::Type { text: r }) => text_match(r, p),
            // PRESS_BACK, PRESS_HOME, COMPLETE, IMPOSSIBLE: the action name is all.
            _ => true,
        }
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn levenshtein_counts_code_points() {
            let c = |s: &str| s.chars().collect::<Vec<_>>();
            assert_eq!(levenshtein(&c("kitten"), &c("sitting")), 3);
            assert_eq!(levenshtein(&c(""), &c("abc")), 3);
            assert_eq!(levenshtein(&c("café"), &c("cafe")), 1);
        }
    }
}

/// Full-action match of `candidate` against `reference` with an optional target box (the EM rule of `agent::eval`'s module docs; here, beside the other rules, so that eval imports scorers and not the other way round).
pub fn exact_match(
    reference: &Action,
    candidate: &Action,
    target_box: Option<[u32; 4]>,
    platform: Platform,
) -> bool {
    if equivalent(reference, candidate, platform) {
        return true;
    }
    match (target_box, candidate.grid_point()) {
        (Some([x0, y0, x1, y1]), Some(p)) => {
            is_click_like(reference)
                && candidate.platform == platform
                && candidate.name() == reference.name()
                && (x0..=x1).contains(&p.x)
                && (y0..=y1).contains(&p.y)
        }
        _ => false,
    }
}
