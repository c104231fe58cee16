//! Action equivalence: the per-platform matching rules and Python's `casefold`.

use super::{Action, ActionArgs, Platform, Point};

/// Python's `str.casefold()` for the characters where it differs from `to_lowercase` in practice
/// (`ß`/`ẞ` → `ss`, final sigma → `σ`, `ﬁ`-style ligatures via their lowercase), else `to_lowercase`.
///
/// ```
/// use recall::action::casefold;
/// assert_eq!(casefold("Straße"), "strasse");
/// assert_eq!(casefold("ΣΊΣΥΦΟΣ"), casefold("σίσυφος"));
/// ```
pub fn casefold(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            'ß' | 'ẞ' => out.push_str("ss"),
            'ς' => out.push('σ'),
            'ſ' => out.push('s'),
            'ﬀ' => out.push_str("ff"),
            'ﬁ' => out.push_str("fi"),
            'ﬂ' => out.push_str("fl"),
            'ﬃ' => out.push_str("ffi"),
            'ﬄ' => out.push_str("ffl"),
            'ﬅ' | 'ﬆ' => out.push_str("st"),
            _ => out.extend(c.to_lowercase().map(|l| if l == 'ς' { 'σ' } else { l })),
        }
    }
    out
}

/// Whether `a` and `b` are the same action under `platform`'s matching rules (see the module docs). Two
/// actions parsed for another platform than `platform` never match.
///
/// ```
/// use recall::action::{equivalent, parse_response, Platform};
/// let p = |r: &str| parse_response(r, Platform::Desktop).unwrap();
/// let a = p("<tool_call>{\"name\": \"computer_use\", \"arguments\": {\"action\": \"click\", \"coordinate\": [100, 100]}}</tool_call>");
/// let b = p("<tool_call>{\"name\": \"computer_use\", \"arguments\": {\"action\": \"left_click\", \"coordinate\": [120, 120]}}</tool_call>");
/// assert!(equivalent(&a, &b, Platform::Desktop)); // Chebyshev 20
/// ```
pub fn equivalent(a: &Action, b: &Action, platform: Platform) -> bool {
    if a.platform != platform || b.platform != platform {
        return false;
    }
    let near = |p: Point, q: Point| match platform {
        Platform::Mobile => p.near_euclidean(q),
        Platform::Desktop => p.near_chebyshev(q),
    };
    let near_opt = |p: &Option<Point>, q: &Option<Point>| match (p, q) {
        (Some(p), Some(q)) => near(*p, *q),
        (None, None) => true,
        _ => false,
    };
    let text_eq = |x: &str, y: &str| match platform {
        Platform::Mobile => casefold(x) == casefold(y),
        Platform::Desktop => x == y,
    };
    use ActionArgs as A;
    match (&a.args, &b.args) {
        (A::Click { coordinate: p }, A::Click { coordinate: q })
        | (A::LongPress { coordinate: p }, A::LongPress { coordinate: q })
        | (A::MouseMove { coordinate: p }, A::MouseMove { coordinate: q })
        | (A::LeftClick { coordinate: p }, A::LeftClick { coordinate: q })
        | (A::RightClick { coordinate: p }, A::RightClick { coordinate: q })
        | (A::MiddleClick { coordinate: p }, A::MiddleClick { coordinate: q })
        | (A::DoubleClick { coordinate: p }, A::DoubleClick { coordinate: q }) => near(*p, *q),
        (
            A::Swipe {
                coordinate: p,
                coordinate2: p2,
            },
            A::Swipe {
                coordinate: q,
                coordinate2: q2,
            },
        ) => near(*p, *q) && near(*p2, *q2),
        (
            A::LeftClickDrag {
                coordinate: p,
                coordinate2: p2,
            },
            A::LeftClickDrag {
                coordinate: q,
                coordinate2: q2,
            },
        ) => near_opt(p, q) && near(*p2, *q2),
        (A::Type { text: x }, A::Type { text: y })
        | (A::Open { text: x }, A::Open { text: y })
        | (A::Answer { text: x }, A::Answer { text: y }) => text_eq(x, y),
        (A::SystemButton { button: x }, A::SystemButton { button: y }) => x == y,
        (A::Key { keys: x }, A::Key { keys: y }) => {
            x.len() == y.len() && x.iter().zip(y).all(|(k, l)| casefold(k) == casefold(l))
        }
        (A::Scroll { pixels: x, .. }, A::Scroll { pixels: y, .. })
        | (A::HScroll { pixels: x, .. }, A::HScroll { pixels: y, .. }) => x.signum() == y.signum(),
        (A::Terminate { status: x }, A::Terminate { status: y }) => match platform {
            Platform::Mobile => true,
            Platform::Desktop => x == y,
        },
        (A::Wait, A::Wait) => true,
        _ => false,
    }
}
