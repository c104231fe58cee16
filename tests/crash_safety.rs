//! Crash safety of what recall writes (docs/RELIABILITY.md "Crash safety"): whole-file outputs are
//! replaced atomically, JSONL outputs of long runs stay valid JSONL, and a killed
//! `recall episode label` leaves no truncated output and resumes to exactly the output of a clean run.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::fixture;
use recall::agent::labels::read_labels;
use recall::atomic::{write_atomic, JsonlWriter};
use serde_json::Value;

fn names_in(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

#[test]
fn write_atomic_replaces_the_whole_file_and_leaves_no_temporary() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("report.json");
    write_atomic(&path, "old").unwrap();
    write_atomic(&path, b"new contents").unwrap();
    assert_eq!(std::fs::read_to_string(&path).unwrap(), "new contents");
    assert_eq!(names_in(tmp.path()), ["report.json"]);

    // A failed write names the path and creates nothing.
    let missing = tmp.path().join("no-such-dir/report.json");
    let e = write_atomic(&missing, "x").unwrap_err().to_string();
    assert!(e.contains("no-such-dir/report.json"), "{e}");
    assert_eq!(names_in(tmp.path()), ["report.json"]);
}

#[cfg(unix)]
#[test]
fn write_atomic_keeps_permissions_and_follows_symlinks() {
    use std::os::unix::fs::PermissionsExt;
    let tmp = tempfile::tempdir().unwrap();
    let real = tmp.path().join("real.json");
    write_atomic(&real, "old").unwrap();
    std::fs::set_permissions(&real, std::fs::Permissions::from_mode(0o600)).unwrap();
    let link = tmp.path().join("link.json");
    std::os::unix::fs::symlink(&real, &link).unwrap();
    write_atomic(&link, "new").unwrap();
    assert!(std::fs::symlink_metadata(&link).unwrap().file_type().is_symlink());
    assert_eq!(std::fs::read_to_string(&real).unwrap(), "new");
    let mode = std::fs::metadata(&real).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
}

/// A reader polling the file while it is rewritten sees the old or the new contents, never a mix or
/// a prefix (`std::fs::write` truncates first, so a reader would see an empty or short file).
#[test]
fn a_concurrent_reader_never_sees_a_partial_file() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("dump.json");
    let (a, b) = (vec![b'a'; 256 << 10], vec![b'b'; 192 << 10]);
    write_atomic(&path, &a).unwrap();
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let reader = {
        let (path, a, b, done) = (path.clone(), a.clone(), b.clone(), done.clone());
        std::thread::spawn(move || {
            let mut reads = 0;
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                let got = std::fs::read(&path).unwrap();
                assert!(got == a || got == b, "a reader saw {} bytes", got.len());
                reads += 1;
            }
            reads
        })
    };
    for i in 0..40 {
        write_atomic(&path, if i % 2 == 0 { &b } else { &a }).unwrap();
    }
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    assert!(reader.join().unwrap() > 0);
    assert_eq!(names_in(tmp.path()), ["dump.json"]);
}

#[test]
fn jsonl_resume_cuts_a_trailing_partial_line() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("run.jsonl");
    let mut w = JsonlWriter::create(&path).unwrap();
    w.append("{\"t\":1}\n{\"t\":2}\n").unwrap();
    w.append_record(&serde_json::json!({"t": 3})).unwrap();
    // Refused whole: the file keeps only whole lines.
    assert!(w.append("{\"t\":4}").is_err());
    w.sync().unwrap();
    drop(w);
    assert_eq!(
        std::fs::read_to_string(&path).unwrap(),
        "{\"t\":1}\n{\"t\":2}\n{\"t\":3}\n"
    );

    // What a kill during a write leaves: half a line.
    let mut text = std::fs::read_to_string(&path).unwrap();
    text.push_str("{\"t\":4,\"q\":-0.");
    std::fs::write(&path, &text).unwrap();
    let mut w = JsonlWriter::resume(&path).unwrap();
    assert_eq!(w.len(), 24);
    w.append("{\"t\":4}\n").unwrap();
    drop(w);
    let text = std::fs::read_to_string(&path).unwrap();
    assert_eq!(text, "{\"t\":1}\n{\"t\":2}\n{\"t\":3}\n{\"t\":4}\n");

    // A file without a single whole line resumes empty; a missing one is created.
    std::fs::write(&path, "{\"t\":1,").unwrap();
    assert!(JsonlWriter::resume(&path).unwrap().is_empty());
    assert_eq!(std::fs::read(&path).unwrap(), b"");
    let fresh = tmp.path().join("fresh.jsonl");
    assert!(JsonlWriter::resume(&fresh).unwrap().is_empty());
    assert!(fresh.exists());
}

/// `JsonlWriter::finish_into` publishes the side file under the final name in one rename.
#[test]
fn jsonl_finish_into_replaces_the_target() {
    let tmp = tempfile::tempdir().unwrap();
    let (side, out) = (tmp.path().join("out.jsonl.partial"), tmp.path().join("out.jsonl"));
    std::fs::write(&out, "old\n").unwrap();
    let mut w = JsonlWriter::create(&side).unwrap();
    w.append("{\"t\":1}\n").unwrap();
    w.finish_into(&out).unwrap();
    assert_eq!(std::fs::read_to_string(&out).unwrap(), "{\"t\":1}\n");
    assert_eq!(names_in(tmp.path()), ["out.jsonl"]);
}

// ---- `recall episode label`, killed and resumed -------------------------------------------------

fn label_cmd(episodes: &[&Path], out: &Path, extra: &[&str]) -> Command {
    let list = episodes
        .iter()
        .map(|e| e.to_str().unwrap())
        .collect::<Vec<_>>()
        .join(",");
    let mut c = Command::new(env!("CARGO_BIN_EXE_recall"));
    c.args(["episode", "label", "--model"])
        .arg(fixture("tiny-qwen3-vl"))
        .args(["--episode", &list, "--budgets", "1,2", "--out"])
        .arg(out)
        .args(extra)
        .env("RUST_LOG", "warn")
        .env("RECALL_BACKEND", "cpu");
    c
}

fn label(episodes: &[&Path], out: &Path, extra: &[&str]) -> Output {
    label_cmd(episodes, out, extra)
        .output()
        .expect("the recall binary runs")
}

fn ok(o: &Output) -> String {
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Every line of `path` as JSON; panics on a truncated or otherwise broken line.
fn records(path: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(path).unwrap();
    assert!(
        text.is_empty() || text.ends_with('\n'),
        "{}: a partial last line",
        path.display()
    );
    text.lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{}: {e}: {l}", path.display())))
        .collect()
}

fn partial_of(out: &Path) -> PathBuf {
    PathBuf::from(format!("{}.partial", out.display()))
}

/// A copy of the sample episode under `dir/name` (another episode as far as labels go).
fn episode_copy(dir: &Path, name: &str) -> PathBuf {
    let to = dir.join(name);
    std::fs::create_dir(&to).unwrap();
    for e in std::fs::read_dir(fixture("episode-sample")).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
    to
}

/// The clean, uninterrupted labels of the sample episode (its text and records), made once for all
/// tests of this file.
fn clean_run() -> &'static (String, Vec<Value>) {
    static CLEAN: std::sync::OnceLock<(String, Vec<Value>)> = std::sync::OnceLock::new();
    CLEAN.get_or_init(|| {
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("clean.jsonl");
        ok(&label(&[&fixture("episode-sample")], &out, &[]));
        assert!(!partial_of(&out).exists());
        let recs = records(&out);
        assert!(recs.len() > 12, "{} lines", recs.len());
        (std::fs::read_to_string(&out).unwrap(), recs)
    })
}

/// Byte offsets of the starts of the lines of `text`.
fn line_starts(text: &str) -> Vec<usize> {
    std::iter::once(0)
        .chain(text.match_indices('\n').map(|(i, _)| i + 1))
        .filter(|&i| i < text.len())
        .collect()
}

#[test]
fn a_killed_label_run_leaves_whole_lines_and_resumes_to_the_clean_output() {
    let tmp = tempfile::tempdir().unwrap();
    let ep = fixture("episode-sample");
    let (_, clean) = clean_run();
    let out = tmp.path().join("labels.jsonl");
    std::fs::write(&out, "an older output\n").unwrap();
    let partial = partial_of(&out);
    let mut child = label_cmd(&[&ep], &out, &[])
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // Kill it once the first decision is on disk (or give up waiting; where the kill lands is not
    // asserted, only what it leaves).
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(60) && child.try_wait().unwrap().is_none() {
        let lines = std::fs::read(&partial).map_or(0, |b| b.iter().filter(|&&c| c == b'\n').count());
        if lines > 0 {
            break;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    child.kill().unwrap();
    child.wait().unwrap();

    // The output is the old file or the complete new one, never a partial one; the partial file
    // holds whole lines only.
    let published = std::fs::read_to_string(&out).unwrap();
    if published != "an older output\n" {
        assert_eq!(&records(&out), clean, "a published output must be complete");
    }
    if partial.exists() {
        records(&partial);
    }

    let log = ok(&label(&[&ep], &out, &["--resume"]));
    assert_eq!(&records(&out), clean, "{log}");
    assert!(!partial.exists());
}

/// Cuts the clean output the ways a kill can (inside a line; at a line boundary inside a decision's
/// group) and checks that `--resume` finishes each to the clean output, from the partial file or
/// from a cut output.
#[test]
fn resume_after_cuts_inside_a_line_and_inside_a_decision() {
    let tmp = tempfile::tempdir().unwrap();
    let ep = fixture("episode-sample");
    let (text, clean) = clean_run();
    let starts = line_starts(text);
    let decisions: Vec<usize> = clean
        .iter()
        .enumerate()
        .filter(|(_, r)| r["kind"] == "decision")
        .map(|(i, _)| i)
        .collect();
    let (fifth, sixth) = (decisions[4], decisions[5]);
    assert!(sixth - fifth > 2, "decision 5 has several labels");

    // In the middle of a label line of decision 5; then just after decision 5's decision line and
    // one label (whole lines, an incomplete group).
    let mid_line = starts[fifth + 2] + 17;
    let mid_group = starts[fifth + 2];
    for (name, cut, from_partial) in [
        ("mid-line", mid_line, true),
        ("mid-group", mid_group, true),
        ("mid-group-out", mid_group, false),
    ] {
        let out = tmp.path().join(format!("{name}.jsonl"));
        let target = if from_partial {
            partial_of(&out)
        } else {
            out.clone()
        };
        std::fs::write(&target, &text[..cut]).unwrap();
        if !from_partial {
            // The reader does not take the half decision for a complete one.
            let e = read_labels(std::slice::from_ref(&out), false)
                .unwrap_err()
                .to_string();
            assert!(e.contains("announces"), "{e}");
        }
        let log = ok(&label(&[&ep], &out, &["--resume"]));
        assert!(log.contains("4 of 6 decisions already labelled"), "{name}: {log}");
        assert_eq!(&records(&out), clean, "{name}: {log}");
        assert!(!partial_of(&out).exists(), "{name}");
    }
}

/// A resume with other settings is refused before anything is written.
#[test]
fn resume_refuses_a_file_made_with_other_settings() {
    let tmp = tempfile::tempdir().unwrap();
    let ep = fixture("episode-sample");
    let (text, _) = clean_run();
    let out = tmp.path().join("labels.jsonl");
    let partial = partial_of(&out);
    let cut = &text[..line_starts(text)[5]];
    std::fs::write(&partial, cut).unwrap();
    let other = episode_copy(tmp.path(), "other");
    for (extra, why) in [
        (&["--budgets", "4"][..], "--budgets"),
        (&["--max-pixels", "16384"][..], "made with"),
        (&[][..], "another --episode list"),
    ] {
        let episodes: &[&Path] = if extra.is_empty() { &[&other] } else { &[&ep] };
        let mut args = vec!["--resume"];
        args.extend(extra);
        let o = label(episodes, &out, &args);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "{why}");
        assert!(err.contains("cannot resume") && err.contains(why), "{why}: {err}");
        assert_eq!(std::fs::read_to_string(&partial).unwrap(), cut, "{why}");
        assert!(!out.exists());
    }
}
