//! `GET /metrics`: Prometheus counters, gauges and histograms, with the names vLLM users know where
//! there is one (`recall_` instead of `vllm:`), as OpenMetrics 1.0 text to a scraper that asks for
//! it and as Prometheus text 0.0.4 otherwise ([`to_prometheus_text`]).

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

use crate::engine::EngineStats;

type Labels = Vec<(String, String)>;

/// Every metric the server exports.
pub struct Metrics {
    registry: Registry,
    /// HTTP requests by route and status.
    pub requests: Family<Labels, Counter>,
    pub prompt_tokens: Counter,
    pub generation_tokens: Counter,
    /// Prompt tokens served from the prefix cache.
    pub cached_tokens: Counter,
    /// Requests cancelled because their client went away.
    pub cancelled: Counter,
    pub ttft: Histogram,
    pub itl: Histogram,
    pub e2e_latency: Histogram,
    kv_blocks_used: Gauge,
    kv_blocks_free: Gauge,
    kv_blocks_cached: Gauge,
    waiting: Gauge,
    running: Gauge,
    preemptions: Gauge,
    forwards: Gauge,
    vision_tower_runs: Gauge,
    episodes: Gauge,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("recall");
        let requests = Family::<Labels, Counter>::default();
        registry.register("requests", "HTTP requests by route and status", requests.clone());
        let counter = |registry: &mut Registry, name: &str, help: &str| {
            let c = Counter::default();
            registry.register(name, help, c.clone());
            c
        };
        let prompt_tokens = counter(
            &mut registry,
            "prompt_tokens",
            "Prompt tokens of finished requests",
        );
        let generation_tokens = counter(&mut registry, "generation_tokens", "Generated tokens");
        let cached_tokens = counter(
            &mut registry,
            "prefix_cache_hit_tokens",
            "Prompt tokens served from the prefix cache",
        );
        let cancelled = counter(
            &mut registry,
            "cancelled_requests",
            "Requests cancelled because their client went away",
        );
        let histogram = |registry: &mut Registry, name: &str, help: &str| {
            let h = Histogram::new(exponential_buckets(0.001, 2.0, 18));
            registry.register(name, help, h.clone());
            h
        };
        let ttft = histogram(
            &mut registry,
            "time_to_first_token_seconds",
            "Time to first token",
        );
        let itl = histogram(
            &mut registry,
            "inter_token_latency_seconds",
            "Time between generated tokens",
        );
        let e2e_latency = histogram(
            &mut registry,
            "e2e_request_latency_seconds",
            "Time from submission to the last token",
        );
        let gauge = |registry: &mut Registry, name: &str, help: &str| {
            let g = Gauge::default();
            registry.register(name, help, g.clone());
            g
        };
        Metrics {
            kv_blocks_used: gauge(
                &mut registry,
                "kv_blocks_used",
                "KV blocks held by running requests",
            ),
            kv_blocks_free: gauge(
                &mut registry,
                "kv_blocks_free",
                "KV blocks free (empty or evictable)",
            ),
            kv_blocks_cached: gauge(
                &mut registry,
                "kv_blocks_cached",
                "Free KV blocks that still hold reusable prefixes",
            ),
            waiting: gauge(
                &mut registry,
                "num_requests_waiting",
                "Requests queued for admission",
            ),
            running: gauge(
                &mut registry,
                "num_requests_running",
                "Requests admitted to the batch",
            ),
            preemptions: gauge(&mut registry, "num_preemptions", "Preemptions so far"),
            forwards: gauge(&mut registry, "forwards", "Batched forwards so far"),
            vision_tower_runs: gauge(
                &mut registry,
                "vision_tower_runs",
                "Images encoded by the vision tower",
            ),
            episodes: gauge(&mut registry, "episodes", "Live episodes"),
            registry,
            requests,
            prompt_tokens,
            generation_tokens,
            cached_tokens,
            cancelled,
            ttft,
            itl,
            e2e_latency,
        }
    }

    /// Counts one HTTP request.
    pub fn count_request(&self, route: &str, status: u16) {
        self.requests
            .get_or_create(&vec![
                ("route".to_string(), route.to_string()),
                ("status".to_string(), status.to_string()),
            ])
            .inc();
    }

    /// The exposition text, with the gauges set from the engine's latest counters.
    pub fn render(&self, s: &EngineStats, episodes: usize) -> String {
        let set = |g: &Gauge, v: u64| {
            g.set(i64::try_from(v).unwrap_or(i64::MAX));
        };
        set(&self.kv_blocks_used, s.kv.blocks_in_use as u64);
        set(
            &self.kv_blocks_free,
            (s.kv.blocks_free + s.kv.blocks_cached_free) as u64,
        );
        set(&self.kv_blocks_cached, s.kv.blocks_cached_free as u64);
        set(&self.waiting, s.waiting as u64);
        set(&self.running, s.running as u64);
        set(&self.preemptions, s.preemptions);
        set(&self.forwards, s.forwards);
        set(&self.vision_tower_runs, s.vision_tower_runs);
        set(&self.episodes, episodes as u64);
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = encode(&mut out, &self.registry);
        out
    }
}

/// The content type of OpenMetrics 1.0 text.
pub const OPENMETRICS_CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
/// The content type of Prometheus text 0.0.4.
pub const PROMETHEUS_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Whether an `Accept` header asks for OpenMetrics (Prometheus itself does; curl, sglang-router's
/// `/engine_metrics` and most scrapers of vLLM-style servers do not, and they read 0.0.4 only).
pub fn wants_openmetrics(accept: Option<&str>) -> bool {
    accept.is_some_and(|a| a.contains("application/openmetrics-text"))
}

/// OpenMetrics 1.0 text rewritten as Prometheus text 0.0.4: a counter family is named with its
/// samples' `_total` suffix in its `# HELP` and `# TYPE` lines (OpenMetrics names the family
/// without it, which a 0.0.4 parser reads as a family with no samples next to untyped ones), and
/// `# UNIT` and `# EOF` lines are dropped. Samples, labels and values are unchanged.
///
/// ```
/// use recall::server::metrics::to_prometheus_text;
/// let om = "# HELP x_requests Requests.\n# TYPE x_requests counter\nx_requests_total{a=\"b\"} 3\n\
///           # TYPE x_busy gauge\nx_busy 1\n# EOF\n";
/// assert_eq!(
///     to_prometheus_text(om),
///     "# HELP x_requests_total Requests.\n# TYPE x_requests_total counter\nx_requests_total{a=\"b\"} 3\n\
///      # TYPE x_busy gauge\nx_busy 1\n"
/// );
/// ```
pub fn to_prometheus_text(openmetrics: &str) -> String {
    let counters: std::collections::HashSet<&str> = openmetrics
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE ")?.strip_suffix(" counter"))
        .collect();
    let mut out = String::with_capacity(openmetrics.len() + 16 * counters.len());
    for line in openmetrics.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        let meta = ["# HELP ", "# TYPE "]
            .into_iter()
            .find_map(|p| Some((p, line.strip_prefix(p)?)));
        match meta {
            Some((p, rest)) => {
                let (name, tail) = match rest.split_once(' ') {
                    Some((name, tail)) => (name, Some(tail)),
                    None => (rest, None),
                };
                out.push_str(p);
                out.push_str(name);
                if counters.contains(name) {
                    out.push_str("_total");
                }
                if let Some(tail) = tail {
                    out.push(' ');
                    out.push_str(tail);
                }
            }
            None => out.push_str(line),
        }
        out.push('\n');
    }
    out
}
