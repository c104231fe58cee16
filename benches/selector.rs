//! Selector composition per decision: paper (beam over swaps from Recent-B), greedy and reference
//! modes at B = 4 and B = 8 over a 50- and 100-event pool, with the H = 192 fixture scorer
//! (tests/fixtures/selector). The paper's reference implementation takes ~39 ms per decision; the
//! target is well under 1 ms. `cargo bench --bench selector`.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use recall::memory::selector::{compose, ActionBucket, DecisionContext, EventInfo, MarginalScorer, Mode};

fn context(events: usize) -> DecisionContext {
    DecisionContext {
        t: events + 1,
        reference_point: Some((400.0, 300.0)),
        events: (1..=events)
            .map(|s| EventInfo {
                step: s,
                image_hash: s as u64,
                next_bucket: ActionBucket::Click,
                next_point: Some(((s * 17 % 999) as f64, 250.0)),
                witness: s % 7 == 0,
            })
            .collect(),
    }
}

fn composition(c: &mut Criterion) {
    let path =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/selector/scorer.safetensors");
    let scorer = MarginalScorer::load(&path).expect("the fixture scorer");
    let mut g = c.benchmark_group("compose");
    for (budget, events) in [(4, 50), (8, 100)] {
        let ctx = context(events);
        for mode in [Mode::Paper, Mode::Greedy, Mode::Reference] {
            let id = BenchmarkId::new(format!("{mode}"), format!("B{budget}-{events}ev"));
            g.bench_with_input(id, &ctx, |b, ctx| {
                b.iter(|| compose(ctx, budget, &scorer, mode, None).expect("composes"))
            });
        }
    }
    g.finish();
}

criterion_group!(benches, composition);
criterion_main!(benches);
