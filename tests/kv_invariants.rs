//! Long seeded random runs of the KV block manager against a small pool, with a simulated model runner.
//!
//! The runner's pool tensor is modelled by a shadow array: writing token `i` of a sequence stores, at the
//! token's slot, a fingerprint of everything its K/V depend on (salt and keys `0..=i`). After every
//! operation the manager's invariants are checked, and every computed token of every live sequence must
//! find its own fingerprint at its slot. That makes reuse exact by construction: a reused block whose
//! keys (or prefix, or salt) differ from the request's, or a block overwritten while another sequence
//! still reads it, shows up as a fingerprint mismatch. Block accounting is conserved after every
//! operation (in use + cached free + free = the pool), and a drained manager holds no reference.
//!
//! Besides the long seeded runs, a proptest draws a few hundred (seed, length) pairs and shrinks a
//! failure to the shortest run that shows it. The operations cover what the engine does with
//! sequences: add (allocate, sharing cached prefixes: a fork), extend (append, compute), finish and
//! cancel (free, computed or not), preempt (truncate), and evict (allocation under pressure).

use recall::kv::{KvBlockManager, SeqId, TokenKey};

const BLOCK_SIZE: usize = 4;
const NUM_BLOCKS: usize = 32;
const MAX_LIVE: usize = 8;
const STEPS: usize = 10_000;
const VISION_START: u32 = 151652;
const VISION_END: u32 = 151653;

/// A live sequence as the test (the runner's side) sees it.
struct Live {
    seq: SeqId,
    salt: u64,
    /// Keys of all tokens. // [num_tokens]
    keys: Vec<TokenKey>,
    /// `fps[i]` fingerprints (salt, keys[..=i]). // [num_tokens]
    fps: Vec<u64>,
}

fn mix(x: u64) -> u64 {
    // splitmix64 finaliser: unrelated to xxh64, so the check does not share the manager's hash.
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn fingerprints(salt: u64, keys: &[TokenKey]) -> Vec<u64> {
    let mut prev = mix(salt ^ 0x5a17);
    keys.iter()
        .map(|k| {
            prev = mix(prev.rotate_left(5) ^ k.raw());
            prev
        })
        .collect()
}

/// A prompt: one of a few shared system prefixes, then images, text runs and embedding runs drawn from
/// small sets so that prompts often share prefixes. Returns the keys and the image spans `[start, end)`
/// of image tokens.
fn prompt(rng: &mut fastrand::Rng) -> (Vec<TokenKey>, Vec<(usize, usize)>) {
    let prefix: &[u32] = match rng.u32(0..3) {
        0 => &[1, 2, 3, 4, 5, 6],
        1 => &[1, 2, 3, 4, 5, 6, 7, 8, 9],
        _ => &[1, 2, 3, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49],
    };
    let mut keys: Vec<TokenKey> = prefix.iter().map(|&t| TokenKey::text(t)).collect();
    let mut spans = Vec::new();
    for _ in 0..rng.usize(0..4) {
        match rng.u32(0..10) {
            0..=4 => {
                keys.push(TokenKey::text(VISION_START));
                let (hash, len) = (rng.u64(1..5), rng.u32(3..10));
                spans.push((keys.len(), keys.len() + len as usize));
                keys.extend((0..len).map(|i| TokenKey::image(hash, i)));
                keys.push(TokenKey::text(VISION_END));
            }
            5..=8 => keys.extend((0..rng.u32(1..7)).map(|_| TokenKey::text(rng.u32(100..104)))),
            _ => keys.extend((0..rng.u32(2..5)).map(|i| TokenKey::embed(rng.u64(1..3), i))),
        }
    }
    keys.push(TokenKey::text(rng.u32(200..203)));
    (keys, spans)
}

/// Longest reuse `<= r` that keeps one token to compute and does not end strictly inside an image.
fn outside_images(r: usize, len: usize, spans: &[(usize, usize)]) -> usize {
    let r = r.min(len - 1);
    spans
        .iter()
        .find(|&&(s, e)| s < r && r < e)
        .map_or(r, |&(s, _)| s)
}

struct Run {
    rng: fastrand::Rng,
    kv: KvBlockManager,
    /// The runner's pool: the fingerprint written at each slot. // [NUM_BLOCKS * BLOCK_SIZE]
    shadow: Vec<Option<u64>>,
    live: Vec<Live>,
    /// Operations that failed for lack of blocks.
    failures: usize,
    /// Truncations inside a shared block (which lower `num_computed` below the new length).
    shared_truncations: usize,
}

impl Run {
    fn new(seed: u64) -> Self {
        Run {
            rng: fastrand::Rng::with_seed(seed),
            kv: KvBlockManager::new(NUM_BLOCKS, BLOCK_SIZE).unwrap(),
            shadow: vec![None; NUM_BLOCKS * BLOCK_SIZE],
            live: Vec::new(),
            failures: 0,
            shared_truncations: 0,
        }
    }

    fn step(&mut self) {
        match self.rng.u32(0..100) {
            0..=29 if self.live.len() < MAX_LIVE => self.allocate(),
            0..=54 => self.compute(),
            55..=74 => self.append(),
            75..=86 => self.truncate(),
            _ => self.free(),
        }
    }

    fn pick(&mut self) -> Option<usize> {
        (!self.live.is_empty()).then(|| self.rng.usize(0..self.live.len()))
    }

    fn allocate(&mut self) {
        let (keys, spans) = prompt(&mut self.rng);
        let salt = self.rng.u64(0..3);
        let n = keys.len();
        let before = self.kv.stats();
        let with_images = self.rng.bool();
        let (result, limit) = if !with_images {
            let limit = if self.rng.bool() {
                n - 1
            } else {
                self.rng.usize(0..n)
            };
            (self.kv.allocate(&keys, salt, limit), limit)
        } else {
            (
                self.kv
                    .allocate_with(&keys, salt, |r| outside_images(r, n, &spans)),
                n - 1,
            )
        };
        let a = match result {
            Ok(a) => a,
            Err(e) => {
                assert!(
                    n.div_ceil(BLOCK_SIZE) > self.kv.available_blocks(),
                    "spurious failure: {e}"
                );
                assert_eq!(self.kv.stats(), before, "failed allocation changed the state");
                self.failures += 1;
                return;
            }
        };
        let reused = a.reused_tokens;
        assert!(
            reused <= limit && reused % BLOCK_SIZE == 0,
            "reused {reused} of {n}, limit {limit}"
        );
        if with_images {
            assert!(
                !spans.iter().any(|&(s, e)| s < reused && reused < e),
                "reuse {reused} in an image"
            );
        }
        assert_eq!(self.kv.block_table(a.seq), &a.block_table[..]);
        assert_eq!(
            (self.kv.num_tokens(a.seq), self.kv.num_computed(a.seq)),
            (n, reused)
        );
        assert_eq!(
            self.kv.stats().tokens_reused,
            before.tokens_reused + reused as u64
        );
        let fps = fingerprints(salt, &keys);
        for (i, fp) in fps.iter().enumerate().take(reused) {
            assert_eq!(
                self.shadow[self.kv.slot(a.seq, i)],
                Some(*fp),
                "reused token {i} holds other K/V"
            );
        }
        self.live.push(Live {
            seq: a.seq,
            salt,
            keys,
            fps,
        });
    }

    /// The runner writes K/V for a random number of pending tokens of one sequence.
    fn compute(&mut self) {
        let Some(k) = self.pick() else { return };
        let (seq, n) = (self.live[k].seq, self.live[k].keys.len());
        let done = self.kv.num_computed(seq);
        if done == n {
            return;
        }
        let upto = self.rng.usize(done + 1..=n);
        for i in done..upto {
            self.shadow[self.kv.slot(seq, i)] = Some(self.live[k].fps[i]);
        }
        let before = self.kv.stats().tokens_computed;
        self.kv.mark_computed(seq, upto).unwrap();
        assert_eq!(self.kv.stats().tokens_computed, before + (upto - done) as u64);
    }

    fn append(&mut self) {
        let Some(k) = self.pick() else { return };
        let key = TokenKey::text(self.rng.u32(100..104));
        let l = &mut self.live[k];
        let n = l.keys.len();
        match self.kv.append(l.seq, key) {
            Ok(()) => {
                l.keys.push(key);
                l.fps = fingerprints(l.salt, &l.keys);
            }
            Err(_) => {
                assert!(
                    n.is_multiple_of(BLOCK_SIZE) && self.kv.available_blocks() == 0,
                    "spurious append failure"
                );
                assert_eq!(self.kv.num_tokens(l.seq), n);
                self.failures += 1;
            }
        }
    }

    fn truncate(&mut self) {
        let Some(k) = self.pick() else { return };
        let n = self.live[k].keys.len();
        let len = if self.rng.u32(0..4) == 0 {
            self.rng.usize(0..=n)
        } else {
            n - self.rng.usize(0..=n.min(5))
        };
        let seq = self.live[k].seq;
        let done = self.kv.num_computed(seq);
        let before = (self.kv.stats(), self.kv.block_table(seq).to_vec());
        match self.kv.truncate(seq, len) {
            Ok(()) => {
                let l = &mut self.live[k];
                l.keys.truncate(len);
                l.fps.truncate(len);
                let now = self.kv.num_computed(seq);
                assert!(now <= done.min(len) && now >= done.min(len) / BLOCK_SIZE * BLOCK_SIZE);
                self.shared_truncations += usize::from(now < done.min(len));
            }
            Err(_) => {
                assert_eq!(self.kv.available_blocks(), 0, "spurious truncate failure");
                assert_eq!((self.kv.stats(), self.kv.block_table(seq).to_vec()), before);
                self.failures += 1;
            }
        }
    }

    fn free(&mut self) {
        let Some(k) = self.pick() else { return };
        let l = self.live.swap_remove(k);
        self.kv.free(l.seq).unwrap();
        assert!(!self.kv.contains(l.seq));
    }

    /// `steps` random operations, each followed by [`check`](Self::check), then every live sequence
    /// freed; the drained manager holds no reference. Returns its final stats.
    fn run_and_drain(&mut self, steps: usize) -> recall::kv::KvStats {
        for step in 0..steps {
            self.step();
            self.check(step);
        }
        while let Some(l) = self.live.pop() {
            self.kv.free(l.seq).unwrap();
        }
        self.kv.check_invariants().unwrap();
        let st = self.kv.stats();
        assert_eq!(
            st.blocks_in_use, 0,
            "a drained manager still holds blocks: {st:?}"
        );
        st
    }

    /// The manager's invariants, block accounting, and every computed token of every live sequence
    /// finds its own K/V.
    fn check(&self, step: usize) {
        if let Err(e) = self.kv.check_invariants() {
            panic!("step {step}: {e}");
        }
        let st = self.kv.stats();
        assert_eq!(
            st.blocks_in_use + st.blocks_cached_free + st.blocks_free,
            NUM_BLOCKS,
            "step {step}: blocks not conserved: {st:?}"
        );
        assert_eq!(self.kv.available_blocks(), st.blocks_cached_free + st.blocks_free);
        for l in &self.live {
            assert_eq!(self.kv.num_tokens(l.seq), l.keys.len(), "step {step}");
            for i in 0..self.kv.num_computed(l.seq) {
                let slot = self.kv.slot(l.seq, i);
                assert_eq!(
                    self.shadow[slot],
                    Some(l.fps[i]),
                    "step {step}: {:?} token {i} slot {slot}",
                    l.seq
                );
            }
        }
    }
}

#[test]
fn random_operations_keep_invariants_and_reuse_exact() {
    for seed in [1, 2, 3, 0xdecaf] {
        let mut run = Run::new(seed);
        let st = run.run_and_drain(STEPS);
        eprintln!(
            "seed {seed}: {st:?}, {} failures, {} shared truncations",
            run.failures, run.shared_truncations
        );
        // The run must have exercised reuse, eviction and exhaustion, or it proves little.
        assert!(st.tokens_reused > 1000, "seed {seed}: {st:?}");
        assert!(st.evictions > 50, "seed {seed}: {st:?}");
        assert!(run.failures > 10, "seed {seed}: {} failures", run.failures);
        assert!(
            run.shared_truncations > 5,
            "seed {seed}: {} shared truncations",
            run.shared_truncations
        );
    }
}

#[test]
fn allocate_with_never_ends_inside_an_image() {
    let mut run = Run::new(7);
    for step in 0..STEPS {
        run.step();
        let (keys, spans) = prompt(&mut run.rng);
        let n = keys.len();
        if let Ok(a) = run.kv.allocate_with(&keys, 0, |r| outside_images(r, n, &spans)) {
            let r = a.reused_tokens;
            assert!(
                !spans.iter().any(|&(s, e)| s < r && r < e),
                "step {step}: reuse {r} in {spans:?}"
            );
            assert!(r < n);
            run.kv.free(a.seq).unwrap();
        }
        run.check(step);
    }
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig {
        cases: 400,
        failure_persistence: None,
        ..proptest::prelude::ProptestConfig::default()
    })]

    #[test]
    fn any_interleaving_conserves_blocks_and_serves_no_stale_block(
        seed in proptest::prelude::any::<u64>(),
        steps in 1usize..600,
    ) {
        let st = Run::new(seed).run_and_drain(steps);
        proptest::prop_assert_eq!(st.blocks_cached_free + st.blocks_free, NUM_BLOCKS);
    }
}
