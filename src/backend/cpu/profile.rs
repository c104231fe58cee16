//! Per-op wall times of the CPU backend ([`Backend::set_profiling`](crate::backend::Backend::set_profiling)).
//!
//! [`super::CpuBackend`] is a stateless unit struct, so the totals belong to the thread that switched
//! profiling on: every op that thread calls is timed (the engine calls the backend from its caller's
//! thread; rayon only runs inside an op), and ops other threads run meanwhile (concurrent tests, say)
//! are neither timed nor mixed in. Ops nested in another op are counted inside the outer one only, so
//! the totals never overlap and their sum is at most the wall time around them. While no thread
//! profiles, an op costs one relaxed atomic load more.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use crate::backend::OpTime;

/// Threads with profiling on; zero keeps every op on the fast path.
static PROFILING_THREADS: AtomicUsize = AtomicUsize::new(0);

/// One thread's profiling state.
#[derive(Default)]
struct Profile {
    on: bool,
    /// Timed ops running on this thread (only the outermost one is timed).
    depth: usize,
    totals: HashMap<&'static str, (usize, Duration, f64)>,
}

impl Drop for Profile {
    fn drop(&mut self) {
        if self.on {
            PROFILING_THREADS.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

thread_local! {
    static PROFILE: RefCell<Profile> = RefCell::new(Profile::default());
}

/// Switches profiling of this thread's ops on (clearing its totals) or off (keeping them for
/// [`take`]).
pub(super) fn set(on: bool) {
    PROFILE.with(|p| {
        let mut p = p.borrow_mut();
        if p.on == on {
            return;
        }
        p.on = on;
        if on {
            p.totals.clear();
            PROFILING_THREADS.fetch_add(1, Ordering::Relaxed);
        } else {
            PROFILING_THREADS.fetch_sub(1, Ordering::Relaxed);
        }
    });
}

/// This thread's totals, slowest first; resets them.
pub(super) fn take() -> Vec<OpTime> {
    let totals = PROFILE.with(|p| std::mem::take(&mut p.borrow_mut().totals));
    let mut ops: Vec<OpTime> = totals
        .into_iter()
        .map(|(op, (calls, time, flops))| OpTime {
            op: op.to_string(),
            calls,
            seconds: time.as_secs_f64(),
            flops,
        })
        .collect();
    ops.sort_by(|a, b| b.seconds.total_cmp(&a.seconds).then_with(|| a.op.cmp(&b.op)));
    ops
}

/// Times the op `op` until the returned guard drops: `let _op = profile::start("linear");` as the
/// first line of a backend method.
#[inline]
pub(super) fn start(op: &'static str) -> OpTimer {
    if PROFILING_THREADS.load(Ordering::Relaxed) == 0 {
        return OpTimer(None);
    }
    start_profiled(op)
}

#[inline(never)]
fn start_profiled(op: &'static str) -> OpTimer {
    PROFILE.with(|p| {
        let mut p = p.borrow_mut();
        if !p.on {
            return OpTimer(None);
        }
        p.depth += 1;
        OpTimer(Some((op, (p.depth == 1).then(Instant::now), 0.0)))
    })
}

/// Adds its op's time (and the floating-point operations it reports) to the thread's totals when
/// dropped (see [`start`]).
#[must_use = "the op is timed until the guard drops"]
pub(super) struct OpTimer(Option<(&'static str, Option<Instant>, f64)>);

impl OpTimer {
    /// Counts `flops` floating-point operations for this op (when it is being profiled).
    pub fn flops(&mut self, flops: f64) {
        if let Some((_, _, f)) = &mut self.0 {
            *f += flops;
        }
    }
}

impl Drop for OpTimer {
    fn drop(&mut self) {
        let Some((op, started, flops)) = self.0.take() else {
            return;
        };
        let elapsed = started.map(|s| s.elapsed());
        PROFILE.with(|p| {
            let mut p = p.borrow_mut();
            p.depth = p.depth.saturating_sub(1);
            if let Some(t) = elapsed {
                let entry = p.totals.entry(op).or_default();
                entry.0 += 1;
                entry.1 += t;
                entry.2 += flops;
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn busy(d: Duration) {
        let s = Instant::now();
        while s.elapsed() < d {}
    }

    #[test]
    fn totals_per_thread_outermost_only_and_reset() {
        // Off: nothing is recorded.
        drop(start("linear"));
        assert!(take().is_empty());
        set(true);
        let wall = Instant::now();
        for _ in 0..3 {
            let _op = start("linear");
            busy(Duration::from_micros(200));
            let _inner = start("add"); // nested: counted inside `linear` only
        }
        {
            let _op = start("add");
            busy(Duration::from_micros(100));
        }
        // Another thread's ops are not mixed in.
        std::thread::spawn(|| {
            let _op = start("rope");
        })
        .join()
        .unwrap();
        let wall = wall.elapsed().as_secs_f64();
        set(false);
        drop(start("argmax"));
        let ops = take();
        let names: Vec<(&str, usize)> = ops.iter().map(|o| (o.op.as_str(), o.calls)).collect();
        assert_eq!(names, vec![("linear", 3), ("add", 1)]);
        assert!(ops[0].seconds >= 600e-6 && ops[1].seconds >= 100e-6, "{ops:?}");
        assert!(ops.iter().map(|o| o.seconds).sum::<f64>() <= wall);
        assert!(take().is_empty(), "take resets");
        assert_eq!(PROFILE.with(|p| p.borrow().depth), 0);
    }
}
