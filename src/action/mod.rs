//! GUI-Owl-1.5 actions: parse a model response, canonicalise its tool call, match two actions.
//!
//! The rules are those of `shared/protocols/gui_owl_protocol.md` section 6 and of the "Action
//! equivalence" notes; see `docs/FORMATS.md` for the full table. In brief:
//!
//! * A response is `Action: <line>\n<tool_call>\n{json}\n</tool_call>`. [`action_line`] extracts the line
//!   exactly as `r.split("Action:")[-1].split("<tool_call>")[0].strip()` does.
//! * [`parse_response`] extracts the tool call as
//!   `json.loads(r.split("<tool_call>")[-1].split("</tool_call>")[0].strip())`, requiring both tags (the
//!   closing one after the last opening one), a JSON object whose `name` is the platform's function
//!   (`mobile_use` or `computer_use`) and whose `arguments` member is an object with a string `action`.
//!   Whitespace and key order do not matter; types do. Any failure is a [`ParseError`]; nothing is guessed.
//! * Mobile canonicalisation (CausalCache `_canonical_action`): aliases `tap→click`, `open_app→open` (whole
//!   value, not upstream's substring replace); `time` dropped; the canonical actions are click, long_press,
//!   swipe, type, system_button, open, wait, answer, terminate, so `key` is rejected; exact argument key
//!   sets; a coordinate is two JSON integers in `[0, 999]`; `text` is NFKC-normalised; `button` is Back,
//!   Home or Enter (`Menu` is rejected); a terminate `status` other than `success` becomes `success` and
//!   the original is kept in [`Action::coerced_status`].
//! * Desktop (`computer_use`, 13 actions): the RL-bridge aliases (`click→left_click`, `drag`,
//!   `leftclick`, `doubleclick`, `rightclick`, `middleclick`); `time` dropped; exact key sets with two
//!   optional members (the drag start `coordinate`, the scroll position `coordinate`) and an optional
//!   terminate `status` (default `success`); coordinates as on mobile; `keys` a non-empty list of
//!   strings; `pixels` an integer; text kept verbatim.
//! * [`equivalent`]: mobile — same action, Euclidean distance ≤ 25 on the grid for `coordinate` and
//!   `coordinate2`, casefolded text, equal button; desktop — same action (`click` is `left_click`),
//!   Chebyshev distance ≤ 25, exact text, keys equal as casefolded lists, scroll pixels of the same sign,
//!   equal status.
//!
//! ```
//! use recall::action::{equivalent, parse_response, ActionBucket, Platform};
//!
//! let r = "Action: Tap the search bar.\n<tool_call>\n\
//!          {\"name\": \"mobile_use\", \"arguments\": {\"action\": \"tap\", \"coordinate\": [540, 120]}}\n\
//!          </tool_call>";
//! let a = parse_response(r, Platform::Mobile).unwrap();
//! assert_eq!(a.name(), "click");
//! assert_eq!(a.point(), Some((540.0, 120.0)));
//! assert_eq!(a.bucket(), ActionBucket::Click);
//!
//! let b = parse_response(
//!     "<tool_call>{\"arguments\": {\"coordinate\": [555, 140], \"action\": \"click\"}, \"name\": \"mobile_use\"}</tool_call>",
//!     Platform::Mobile,
//! )
//! .unwrap();
//! assert!(equivalent(&a, &b, Platform::Mobile)); // distance 25
//! ```
//!
//! Layout: `types` (platforms, points, the canonical [`Action`] and its queries, [`ParseError`]), `parse`
//! (response text → tool call), `canonical` (the per-platform canonicalisation rules), `render`
//! (desktop fold lines and canonical tool-call JSON), `matching` ([`equivalent`], [`casefold`]),
//! `pixels` (grid → pixel conventions), `mobileworld` (the CausalCache authors' MobileWorld actions).
//! A leaf module: it depends on nothing else in the crate.

mod canonical;
mod matching;
mod mobileworld;
mod parse;
mod pixels;
mod render;
mod types;

pub use matching::{casefold, equivalent};
pub use mobileworld::{mobileworld_action, parse_official, OfficialParse};
pub(crate) use parse::py_strip;
pub use parse::{
    action_line, action_line_or_fallback, parse_arguments, parse_response, parse_tool_call, tool_call_text,
};
pub use pixels::{to_pixels, Convention};
pub use types::{Action, ActionArgs, ActionBucket, Button, ParseError, Platform, Point, Status};

/// The largest coordinate on the model's 1000×1000 grid.
pub const GRID_MAX: u32 = 999;
/// Distance (grid units) within which two coordinates match, Euclidean on mobile, Chebyshev on desktop.
pub const MATCH_TOLERANCE: u32 = 25;
/// The opening tag of a tool call.
pub const TOOL_CALL_OPEN: &str = "<tool_call>";
/// The closing tag of a tool call (token id 151658, CausalCache's stop token).
pub const TOOL_CALL_CLOSE: &str = "</tool_call>";
/// The action line CausalCache uses when neither the text nor the tool call yields one.
pub const UNKNOWN_ACTION_LINE: &str = "unknown action";
/// The desktop fold line when a response's action cannot be rendered from its arguments.
pub const DESKTOP_FALLBACK_LINE: &str = "Wait for the screen to update.";
