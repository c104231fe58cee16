//! Running one step in the mode [`Steps::begin`](super::graph::Steps::begin) chose: directly, recorded
//! into a CUDA graph, or replayed from one — and getting back to direct mode on every failure.
//!
//! The sequencing lives in [`drive_step`], generic over a [`StepDriver`], so that its failure paths
//! (a capture that cannot begin, a step that fails while recorded or replayed, a capture that cannot
//! end) are tested on the CPU with a driver that fails on demand; [`CudaBackend`](super::CudaBackend)
//! is the real driver. The rules it keeps:
//!
//! * Host code that runs directly always sees [`Mode::Direct`]: a step that cannot be recorded or
//!   replayed is abandoned (which sets the mode) before it runs again, so no direct launch stages its
//!   inputs into a buffer that is never copied.
//! * A replayed graph is launched only after the step's host code succeeded; a failed host run is
//!   rerun directly, never launched *and* rerun.
//! * A capture is ended with the driver's own call, not cudarc's (which returns an error stored by an
//!   earlier call *before* ending the capture and can leave the stream capturing), and the stream is
//!   checked to have left capture mode; if it has not, the step fails rather than run directly into a
//!   capture.

use std::sync::Arc;

use cudarc::driver::{result, sys, CudaStream};

use super::libs::cuda_err;
use crate::backend::StepKey;
use crate::error::Result;

/// What launches do in the current step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Mode {
    /// No step in progress: launch directly.
    Direct,
    /// Recording: launch (into the capture) and append to the trace.
    Record,
    /// Replaying: compare with the trace, do not launch.
    Replay,
}

/// An instantiated CUDA graph (the captured graph and its executable), destroyed on drop.
///
/// Ours rather than cudarc's `CudaGraph`, whose launch and drop go through the context's stored-error
/// check: a graph must launch or be destroyed whatever an unrelated earlier call left behind.
pub(super) struct StepGraph {
    graph: sys::CUgraph,
    exec: sys::CUgraphExec,
}

// SAFETY: graphs are only touched under the backend's step mutex, one thread at a time, which is what
// CUDA requires of graph objects.
unsafe impl Send for StepGraph {}

impl StepGraph {
    /// Launches the graph on `stream`.
    pub(super) fn launch(&self, stream: &Arc<CudaStream>) -> Result<()> {
        // SAFETY: `exec` is a live executable graph (destroyed only on drop); the stream is valid.
        unsafe { result::graph::launch(self.exec, stream.cu_stream()) }
            .map_err(|e| cuda_err(format!("graph launch: {e:?}")))
    }
}

impl Drop for StepGraph {
    fn drop(&mut self) {
        // SAFETY: both handles were created by `end_capture` and are destroyed once, here.
        unsafe {
            if let Err(e) = result::graph::exec_destroy(self.exec) {
                tracing::debug!("destroying a graph executable: {e:?}");
            }
            if let Err(e) = result::graph::destroy(self.graph) {
                tracing::debug!("destroying a graph: {e:?}");
            }
        }
    }
}

/// Makes the stream's context current on this thread with the driver call itself (cudarc's
/// `bind_to_thread` first returns any error stored by an earlier call).
fn make_current(stream: &Arc<CudaStream>) -> Result<()> {
    // SAFETY: the context outlives the stream that holds it.
    unsafe { result::ctx::set_current(stream.context().cu_ctx()) }
        .map_err(|e| cuda_err(format!("making the context current: {e:?}")))
}

/// Starts a capture on `stream` (thread-local mode: other threads' CUDA calls are unaffected).
pub(super) fn begin_capture(stream: &Arc<CudaStream>) -> Result<()> {
    make_current(stream)?;
    let mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
    // SAFETY: the stream is valid and not the legacy default stream.
    unsafe { result::stream::begin_capture(stream.cu_stream(), mode) }
        .map_err(|e| cuda_err(format!("begin capture: {e:?}")))
}

/// Ends the capture on `stream`: the instantiated graph, `None` when the capture was invalidated,
/// captured nothing or cannot be instantiated (the step then runs directly), an error when the stream
/// is still capturing afterwards (nothing can safely run on it).
pub(super) fn end_capture(stream: &Arc<CudaStream>) -> Result<Option<StepGraph>> {
    make_current(stream)?;
    // SAFETY: the stream is valid; ending a capture that was invalidated returns an error and ends it.
    let ended = unsafe { result::stream::end_capture(stream.cu_stream()) };
    // SAFETY: as above.
    let status = unsafe { result::stream::is_capturing(stream.cu_stream()) }
        .map_err(|e| cuda_err(format!("capture status after ending a capture: {e:?}")))?;
    if status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE {
        return Err(cuda_err(format!(
            "the stream is still capturing ({status:?}) after ending the capture"
        )));
    }
    let graph = match ended {
        Ok(g) if !g.is_null() => g,
        Ok(_) => return Ok(None),
        Err(e) => {
            tracing::debug!("end capture: {e:?}");
            return Ok(None);
        }
    };
    let flags = sys::CUgraphInstantiate_flags(0);
    // SAFETY: `graph` is the graph the capture just produced, owned here.
    match unsafe { result::graph::instantiate(graph, flags) } {
        Ok(exec) => Ok(Some(StepGraph { graph, exec })),
        Err(e) => {
            tracing::debug!("instantiating a captured graph: {e:?}");
            // SAFETY: not instantiated, destroyed once.
            let _ = unsafe { result::graph::destroy(graph) };
            Ok(None)
        }
    }
}

/// What [`drive_step`] needs from a backend.
pub(super) trait StepDriver {
    /// An instantiated graph.
    type Graph;
    /// Prepares the step; the mode it runs in.
    fn begin(&self, key: StepKey) -> Result<Mode>;
    fn begin_capture(&self) -> Result<()>;
    fn end_capture(&self) -> Result<Option<Self::Graph>>;
    /// After a successful replayed host run: whether the trace matched and the graph launched.
    fn finish_replay(&self, key: StepKey) -> Result<bool>;
    /// After a successful recorded host run: whether the graph was kept and launched.
    fn finish_record(&self, key: StepKey, graph: Option<Self::Graph>) -> Result<bool>;
    fn record_failed(&self, key: StepKey);
    /// Back to direct mode, dropping the key's recording.
    fn abandon(&self, key: StepKey) -> Result<()>;
}

/// Runs the step `f` under `key` in the mode `d.begin` chooses (see the module docs for the rules).
pub(super) fn drive_step<D: StepDriver, R>(
    d: &D,
    key: StepKey,
    f: &mut dyn FnMut() -> Result<R>,
) -> Result<R> {
    let direct = |f: &mut dyn FnMut() -> Result<R>| {
        d.abandon(key)?;
        f()
    };
    match d.begin(key)? {
        Mode::Direct => f(),
        Mode::Replay => match f() {
            Ok(r) if d.finish_replay(key)? => Ok(r),
            // Nothing of the step ran on the device: run it directly.
            _ => direct(f),
        },
        Mode::Record => {
            if let Err(e) = d.begin_capture() {
                tracing::debug!("step {key:?}: {e}; running directly");
                d.record_failed(key);
                return direct(f);
            }
            let r = f();
            let graph = match d.end_capture() {
                Ok(g) => g,
                Err(e) => {
                    d.abandon(key)?;
                    return Err(e);
                }
            };
            match r {
                Ok(r) if d.finish_record(key, graph)? => Ok(r),
                // Captured work never ran: run the step directly.
                _ => {
                    d.record_failed(key);
                    direct(f)
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::cell::{Cell, RefCell};

    use super::{drive_step, Mode, StepDriver};
    use crate::backend::cuda::libs::cuda_err;
    use crate::backend::StepKey;
    use crate::error::Result;

    /// A driver that starts every step in `start`, fails where told, and logs what was called.
    struct Fake {
        start: Mode,
        mode: Cell<Mode>,
        begin_capture_fails: bool,
        end_capture: fn() -> Result<Option<()>>,
        trace_matches: bool,
        calls: RefCell<Vec<&'static str>>,
    }

    impl Fake {
        fn new(start: Mode) -> Self {
            Fake {
                start,
                mode: Cell::new(Mode::Direct),
                begin_capture_fails: false,
                end_capture: || Ok(Some(())),
                trace_matches: true,
                calls: RefCell::new(Vec::new()),
            }
        }

        fn log(&self, call: &'static str) {
            self.calls.borrow_mut().push(call);
        }

        fn calls(&self) -> Vec<&'static str> {
            self.calls.borrow().clone()
        }
    }

    impl StepDriver for Fake {
        type Graph = ();
        fn begin(&self, _: StepKey) -> Result<Mode> {
            self.mode.set(self.start);
            Ok(self.start)
        }
        fn begin_capture(&self) -> Result<()> {
            self.log("begin_capture");
            match self.begin_capture_fails {
                true => Err(cuda_err("capture refused")),
                false => Ok(()),
            }
        }
        fn end_capture(&self) -> Result<Option<()>> {
            self.log("end_capture");
            (self.end_capture)()
        }
        fn finish_replay(&self, _: StepKey) -> Result<bool> {
            self.log(if self.trace_matches { "launch" } else { "mismatch" });
            self.mode.set(Mode::Direct);
            Ok(self.trace_matches)
        }
        fn finish_record(&self, _: StepKey, g: Option<()>) -> Result<bool> {
            self.mode.set(Mode::Direct);
            self.log(if g.is_some() { "launch" } else { "no graph" });
            Ok(g.is_some())
        }
        fn record_failed(&self, _: StepKey) {
            self.log("record_failed");
        }
        fn abandon(&self, _: StepKey) -> Result<()> {
            self.log("abandon");
            self.mode.set(Mode::Direct);
            Ok(())
        }
    }

    const KEY: StepKey = StepKey { rows: 1, tag: 0 };

    /// Runs a step whose host code fails the first `fail_first` times, logging the mode it ran in.
    fn run(d: &Fake, fail_first: usize) -> Result<usize> {
        let runs = Cell::new(0);
        let mut step = || {
            let n = runs.get();
            runs.set(n + 1);
            d.log(match d.mode.get() {
                Mode::Direct => "host:direct",
                Mode::Record => "host:record",
                Mode::Replay => "host:replay",
            });
            match n < fail_first {
                true => Err(cuda_err("step failed")),
                false => Ok(n),
            }
        };
        drive_step(d, KEY, &mut step)
    }

    #[test]
    fn a_capture_that_cannot_begin_runs_the_step_directly_in_direct_mode() {
        let d = Fake {
            begin_capture_fails: true,
            ..Fake::new(Mode::Record)
        };
        assert_eq!(run(&d, 0).unwrap(), 0);
        assert_eq!(
            d.calls(),
            ["begin_capture", "record_failed", "abandon", "host:direct"]
        );
    }

    #[test]
    fn a_failed_replayed_step_is_never_launched_and_reruns_directly() {
        let d = Fake::new(Mode::Replay);
        assert_eq!(run(&d, 1).unwrap(), 1);
        assert_eq!(d.calls(), ["host:replay", "abandon", "host:direct"]);
    }

    #[test]
    fn a_replay_whose_trace_differs_reruns_directly() {
        let d = Fake {
            trace_matches: false,
            ..Fake::new(Mode::Replay)
        };
        assert_eq!(run(&d, 0).unwrap(), 1);
        assert_eq!(d.calls(), ["host:replay", "mismatch", "abandon", "host:direct"]);
    }

    #[test]
    fn a_matching_replay_runs_the_host_code_once() {
        let d = Fake::new(Mode::Replay);
        assert_eq!(run(&d, 0).unwrap(), 0);
        assert_eq!(d.calls(), ["host:replay", "launch"]);
    }

    #[test]
    fn a_failed_recorded_step_ends_the_capture_and_reruns_directly() {
        let d = Fake::new(Mode::Record);
        assert_eq!(run(&d, 1).unwrap(), 1);
        assert_eq!(
            d.calls(),
            [
                "begin_capture",
                "host:record",
                "end_capture",
                "record_failed",
                "abandon",
                "host:direct"
            ]
        );
    }

    #[test]
    fn an_invalidated_capture_reruns_directly() {
        let d = Fake {
            end_capture: || Ok(None),
            ..Fake::new(Mode::Record)
        };
        assert_eq!(run(&d, 0).unwrap(), 1);
        assert_eq!(
            d.calls(),
            [
                "begin_capture",
                "host:record",
                "end_capture",
                "no graph",
                "record_failed",
                "abandon",
                "host:direct"
            ]
        );
    }

    #[test]
    fn a_stream_left_capturing_fails_the_step_in_direct_mode() {
        let d = Fake {
            end_capture: || Err(cuda_err("still capturing")),
            ..Fake::new(Mode::Record)
        };
        let e = run(&d, 0).unwrap_err();
        assert!(e.to_string().contains("still capturing"), "{e}");
        assert_eq!(
            d.calls(),
            ["begin_capture", "host:record", "end_capture", "abandon"]
        );
        assert_eq!(d.mode.get(), Mode::Direct);
    }

    #[test]
    fn a_recorded_step_runs_once_and_launches() {
        let d = Fake::new(Mode::Record);
        assert_eq!(run(&d, 0).unwrap(), 0);
        assert_eq!(
            d.calls(),
            ["begin_capture", "host:record", "end_capture", "launch"]
        );
    }

    #[test]
    fn a_direct_step_runs_once() {
        let d = Fake::new(Mode::Direct);
        assert_eq!(run(&d, 0).unwrap(), 0);
        assert_eq!(d.calls(), ["host:direct"]);
    }
}
