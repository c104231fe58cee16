//! `POST /v1/causalcache/policy` with the CausalCache authors' request shape
//! (`causalcache.mobileworld.policy_request.v2`, as their harness's `HTTPMobileWorldPolicy` builds it)
//! on the tiny Qwen3-VL and the demo episode (CPU):
//! * the client's Recent-B selection is answered in one pass, bitwise the step recall's library
//!   computes on the same decision (`fixed_step`, ending only at `</tool_call>`);
//! * with `--selector` and every screenshot sent, the server chooses (pass 1, selector, pass 2):
//!   the allocation and the response equal the library's `two_pass_step`;
//! * every response field of the authors' schema is there; an unparseable response is a `wait`;
//! * bad requests are 400s naming the field; `/v1/causalcache/policy/act` is the same route.

mod serving;

use std::path::Path;

use base64::Engine as _;
use recall::action::Platform;
use recall::agent::causalcache::{
    fixed_step, make_policy, two_pass_step, EpisodeMemo, PolicyChoice, StopRule, TwoPassConfig,
};
use recall::backend::cpu::CpuBackend;
use recall::engine::{EngineConfig, Pipeline};
use recall::memory::episode::{Episode, StepRecord};
use recall::memory::protocol::Protocol;
use recall::memory::selector::Mode;
use serde_json::{json, Value};
use serving::{fixture, Server};

fn demo() -> Episode {
    Episode::load(&Path::new(env!("CARGO_MANIFEST_DIR")).join("models/demo/episode")).unwrap()
}

fn selector() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("models/demo/selector.safetensors")
}

fn b64(path: &Path) -> String {
    base64::engine::general_purpose::STANDARD.encode(std::fs::read(path).unwrap())
}

/// The authors' request for decision `t` of the demo episode, screenshots restored for `shown`.
fn request(ep: &Episode, t: usize, shown: &[usize], selected: &[usize]) -> Value {
    let current = &ep.steps[t - 1].screenshot;
    let img = image::open(current).unwrap();
    let history: Vec<Value> = ep.steps[..t - 1]
        .iter()
        .enumerate()
        .map(|(i, s)| {
            json!({
                "step_id": i + 1,
                "action": {"action_type": "wait"},
                "action_text": s.action_line_for(Platform::Mobile),
                "full_response": s.response,
                "policy_parsed": true,
                "screen_changed": true,
                "observation_screenshot_sha256": "0".repeat(64),
                "post_screenshot_sha256": "0".repeat(64),
                "restored_observation_screenshot_png_base64":
                    if shown.contains(&(i + 1)) { json!(b64(&s.screenshot)) } else { Value::Null },
            })
        })
        .collect();
    json!({
        "schema_version": "causalcache.mobileworld.policy_request.v2",
        "task": {"instruction": ep.instruction, "instruction_sha256": "0".repeat(64)},
        "step_id": t,
        "screen_size": [img.width(), img.height()],
        "current_screenshot_png_base64": b64(current),
        "history": history,
        "selected_event_step_ids": selected,
        "action_schema": {"supported_action_types": ["click", "wait"], "contract": "Return exactly one MobileWorld JSONAction mapping."},
        "prompt_protocol": "mobile_agent_v3_5_gui_owl_official_faithful",
    })
}

/// Decision `t` as the policy endpoint sees it: steps `1..t`, the current screen step `t`'s.
fn decision_episode(ep: &Episode, t: usize) -> Episode {
    Episode {
        steps: ep.steps[..t - 1]
            .iter()
            .map(|s| StepRecord {
                action_line: Some(s.action_line_for(Platform::Mobile)),
                ..s.clone()
            })
            .collect(),
        final_screenshot: Some(ep.steps[t - 1].screenshot.clone()),
        ..ep.clone()
    }
}

fn cfg(budget: usize) -> TwoPassConfig {
    TwoPassConfig {
        budget,
        protocol: Protocol::Mobile,
        max_tokens: 256,
        stop: StopRule::ToolCallOnly,
        ..TwoPassConfig::default()
    }
}

const FIELDS: [&str; 12] = [
    "schema_version",
    "action",
    "action_text",
    "full_response",
    "policy_parsed",
    "parse_error",
    "dropped_arguments",
    "native_output",
    "selection",
    "request_count",
    "queue_seconds",
    "generation",
];

#[tokio::test]
async fn the_clients_selection_is_one_pass_equal_to_the_library() {
    let ep = demo();
    let server = Server::start(&[]);
    let p = Pipeline::load(CpuBackend, &fixture("tiny-qwen3-vl"), None).unwrap();
    for (t, selected) in [(1, vec![]), (6, vec![2, 3, 4, 5]), (9, vec![1, 5, 8])] {
        let body = request(&ep, t, &selected, &selected);
        let (status, r) = server.post("/v1/causalcache/policy", &body).await;
        assert_eq!(status, 200, "{r}");
        for f in FIELDS {
            assert!(r.get(f).is_some(), "t {t}: no `{f}` in {r}");
        }
        assert_eq!(r["schema_version"], "causalcache.mobileworld.policy_response.v2");
        assert!(r["selection"].is_null());
        assert_eq!(r["generation"]["allocation"], json!(selected));
        let mut e = p.engine(EngineConfig::default()).unwrap();
        let want = fixed_step(
            &mut p.session(&mut e),
            &decision_episode(&ep, t),
            t,
            &selected,
            &cfg(selected.len()),
        )
        .unwrap();
        assert_eq!(r["native_output"].as_str().unwrap(), want.response, "t {t}");
        // The tiny model's text is no GUI-Owl action: a `wait`, as the authors' server answers.
        if r["policy_parsed"] == false {
            assert_eq!(r["action"], json!({"action_type": "wait"}));
            assert!(r["parse_error"].is_string());
        }
        assert!(!r["action_text"].as_str().unwrap().is_empty());
    }
    // The harness appends `/act` to its base URL.
    let (status, r) = server
        .post("/v1/causalcache/policy/act", &request(&ep, 2, &[1], &[1]))
        .await;
    assert_eq!((status.as_u16(), r["request_count"].as_u64().unwrap()), (200, 4));
}

#[tokio::test]
async fn with_a_selector_and_every_screenshot_the_server_chooses_as_two_pass_step_does() {
    let ep = demo();
    let server = Server::start(&["--selector", selector().to_str().unwrap(), "--policy-budget", "2"]);
    let p = Pipeline::load(CpuBackend, &fixture("tiny-qwen3-vl"), None).unwrap();
    let choice = PolicyChoice {
        name: "selector".into(),
        selector: Some(selector()),
        mode: Mode::Paper,
        max_replacements: None,
        seed: 0,
        indexing: None,
    };
    let mut swapped = 0;
    for t in [5, 8, 11] {
        let all: Vec<usize> = (1..t).collect();
        let (status, r) = server
            .post("/v1/causalcache/policy", &request(&ep, t, &all, &all))
            .await;
        assert_eq!(status, 200, "{r}");
        let mut e = p.engine(EngineConfig::default()).unwrap();
        let mut policy = make_policy(&choice).unwrap();
        let want = two_pass_step(
            &mut p.session(&mut e),
            &decision_episode(&ep, t),
            t,
            policy.as_mut(),
            &cfg(2),
            &mut EpisodeMemo::default(),
        )
        .unwrap();
        let sel = &r["selection"];
        assert_eq!(sel["chosen"], json!(want.allocation), "t {t}");
        assert_eq!(sel["recent_tail"], json!(want.recent), "t {t}");
        assert_eq!(sel["passes"], if want.pass2 { 2 } else { 1 });
        assert_eq!(r["native_output"].as_str().unwrap(), want.response, "t {t}");
        swapped += usize::from(want.pass2);
    }
    assert!(swapped >= 1, "no decision ran pass 2: the comparison saw no swap");
    // Screenshots of Recent-B only: the client's selection stands.
    let (_, r) = server
        .post("/v1/causalcache/policy", &request(&ep, 6, &[4, 5], &[4, 5]))
        .await;
    assert!(r["selection"].is_null(), "{r}");
    assert_eq!(r["generation"]["allocation"], json!([4, 5]));
}

#[tokio::test]
async fn bad_requests_name_the_field() {
    let ep = demo();
    let server = Server::start(&[]);
    let ok = request(&ep, 4, &[2, 3], &[2, 3]);
    let with = |path: &[&str], v: Value| {
        let mut b = ok.clone();
        let mut at = &mut b;
        for k in &path[..path.len() - 1] {
            at = if let Ok(i) = k.parse::<usize>() {
                &mut at[i]
            } else {
                &mut at[*k]
            };
        }
        at[path[path.len() - 1]] = v;
        b
    };
    let cases = [
        (
            with(
                &["schema_version"],
                json!("causalcache.mobileworld.policy_request.v1"),
            ),
            "schema_version",
        ),
        (with(&["prompt_protocol"], json!("other")), "prompt_protocol"),
        (with(&["task", "instruction"], json!("  ")), "task.instruction"),
        (with(&["screen_size"], json!([1080])), "screen_size"),
        (
            with(&["current_screenshot_png_base64"], json!("not base64!")),
            "current_screenshot_png_base64",
        ),
        (
            with(&["current_screenshot_png_base64"], json!("aGVsbG8=")),
            "current_screenshot_png_base64",
        ),
        (with(&["history", "1", "step_id"], json!(7)), "history[1].step_id"),
        (
            with(&["history", "0", "full_response"], json!("")),
            "history[0].full_response",
        ),
        (
            with(&["selected_event_step_ids"], json!([1, 2])),
            "selected_event_step_ids",
        ),
        (
            with(&["selected_event_step_ids"], json!([3, 2])),
            "selected_event_step_ids",
        ),
        (
            with(&["selected_event_step_ids"], json!([9])),
            "selected_event_step_ids",
        ),
    ];
    for (body, param) in cases {
        let (status, r) = server.post("/v1/causalcache/policy", &body).await;
        assert_eq!(status, 400, "{param}: {r}");
        assert_eq!(r["error"]["param"], param, "{r}");
        assert!(r["error"]["message"].as_str().unwrap().len() < 300, "{r}");
    }
    let m = server.wait_idle().await;
    assert_eq!(m["recall_kv_blocks_used"], 0.0);
}

#[tokio::test]
async fn a_gui_owl_answer_becomes_the_mobileworld_action_in_screen_pixels() {
    let ep = demo();
    let model = fixture("agent-qwen3-vl");
    let server = Server::start_with(
        &["--model", model.to_str().unwrap(), "--served-model-name", "tiny"],
        &[],
    );
    let agent: Value =
        serde_json::from_str(&std::fs::read_to_string(model.join("agent.json")).unwrap()).unwrap();
    let body = request(&ep, 5, &[3, 4], &[3, 4]);
    let (w, h) = (
        body["screen_size"][0].as_f64().unwrap(),
        body["screen_size"][1].as_f64().unwrap(),
    );
    let (status, r) = server.post("/v1/causalcache/policy", &body).await;
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["full_response"], agent["response"]);
    assert_eq!(r["policy_parsed"], true, "{r}");
    assert!(r["parse_error"].is_null());
    assert_eq!(r["dropped_arguments"], json!({}));
    assert_eq!(r["action_text"], "Tap the search bar at the top of the screen.");
    // The answer's grid point (540, 120), as the authors convert it: round(v / 999 · (size − 1)).
    let px = |v: f64, size: f64| (v / 999.0 * (size - 1.0)).round_ties_even() as u64;
    assert_eq!(
        r["action"],
        json!({"action_type": "click", "x": px(540.0, w), "y": px(120.0, h)})
    );
}
