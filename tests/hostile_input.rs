//! Hostile inputs — a decompression bomb, a safetensors header claiming 2^60 bytes, tensor offsets past
//! the end of the file, 10 MB of nested JSON, oversized files, a shard index that points outside the
//! model directory — are refused with an error that names the file and the numbers, before anything of
//! the declared size is allocated (see `recall::limits`).

mod common;

use std::fs;
use std::path::{Path, PathBuf};

use common::fixture;
use recall::agent::dataset::StepDataset;
use recall::agent::labels::read_labels;
use recall::limits::{self, read_capped};
use recall::memory::episode::Episode;
use recall::model::{Checkpoint, ModelConfig};
use recall::tokenize::chat::parse_messages;
use recall::tokenize::Tokenizer;
use recall::vision::ImageSource;
use recall::Error;

/// The standard CRC-32 of PNG chunks.
fn crc32(bytes: &[u8]) -> u32 {
    let mut c = !0u32;
    for &b in bytes {
        c ^= u32::from(b);
        for _ in 0..8 {
            c = if c & 1 != 0 {
                0xEDB8_8320 ^ (c >> 1)
            } else {
                c >> 1
            };
        }
    }
    !c
}

fn png_chunk(out: &mut Vec<u8>, kind: &[u8; 4], data: &[u8]) {
    out.extend((data.len() as u32).to_be_bytes());
    let start = out.len();
    out.extend(kind);
    out.extend(data);
    let crc = crc32(&out[start..]);
    out.extend(crc.to_be_bytes());
}

/// A well-formed ~1 KB PNG whose IHDR declares `w`×`h` 8-bit RGB pixels: IDAT holds one stored
/// (uncompressed) zlib block of 1000 zero bytes, the start of the first row.
fn png_declaring(w: u32, h: u32) -> Vec<u8> {
    let mut png = b"\x89PNG\r\n\x1a\n".to_vec();
    let mut ihdr = Vec::new();
    ihdr.extend(w.to_be_bytes());
    ihdr.extend(h.to_be_bytes());
    ihdr.extend([8, 2, 0, 0, 0]); // 8-bit, RGB, deflate, no filter, no interlace
    png_chunk(&mut png, b"IHDR", &ihdr);
    let payload = [0u8; 1000];
    let mut zlib = vec![0x78, 0x01, 0x01]; // zlib header, then a final stored block
    zlib.extend((payload.len() as u16).to_le_bytes());
    zlib.extend((!(payload.len() as u16)).to_le_bytes());
    zlib.extend(payload);
    zlib.extend(((1000u32 << 16) | 1).to_be_bytes()); // Adler-32 of 1000 zeros: a = 1, b = 1000
    png_chunk(&mut png, b"IDAT", &zlib);
    png_chunk(&mut png, b"IEND", &[]);
    png
}

/// `[[[...]]]`, `bytes` long: far deeper than serde_json's recursion limit.
fn nested_json(bytes: usize) -> String {
    "[".repeat(bytes / 2) + &"]".repeat(bytes / 2)
}

const TEN_MB: usize = 10 << 20;

/// A safetensors file: the 8-byte header length `declared`, then `header`, then `data`.
fn safetensors_bytes(declared: u64, header: &str, data: usize) -> Vec<u8> {
    let mut out = declared.to_le_bytes().to_vec();
    out.extend(header.as_bytes());
    out.extend(vec![0u8; data]);
    out
}

/// A file of `len` bytes that takes no disk space (a hole), for the size caps.
fn sparse_file(path: &Path, len: u64) {
    fs::File::create(path).unwrap().set_len(len).unwrap();
}

fn err<T>(r: recall::Result<T>, what: &str) -> Error {
    match r {
        Ok(_) => panic!("{what} should be refused"),
        Err(e) => e,
    }
}

fn assert_json_depth_error(e: &Error, path: &Path) {
    let msg = e.to_string();
    assert!(matches!(e, Error::Json { .. }), "{e:?}");
    assert!(msg.contains(&path.display().to_string()), "{msg}");
    assert!(msg.contains("recursion limit exceeded"), "{msg}");
}

#[test]
fn png_declaring_100000_squared_pixels_is_refused_from_its_header() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("bomb.png");
    let png = png_declaring(100_000, 100_000);
    assert!((1000..1200).contains(&png.len()), "{} bytes", png.len());
    fs::write(&path, &png).unwrap();
    let msg = err(ImageSource::Path(path.clone()).load(), "the bomb").to_string();
    assert!(msg.contains(&path.display().to_string()), "{msg}");
    assert!(msg.contains("100000x100000 pixels"), "{msg}");
    assert!(
        msg.contains(&format!("limit of {} pixels", limits::MAX_IMAGE_PIXELS)),
        "{msg}"
    );
}

#[test]
fn the_same_png_at_a_small_size_is_not_refused_by_the_cap() {
    // The same construction at 64x64 reaches the decoder, which finds its rows short of data: the cap,
    // not a flaw in the construction, is what refuses the bomb above.
    let png = png_declaring(64, 64);
    let msg = err(
        recall::vision::decode_image_bytes(&png, "small.png"),
        "a truncated PNG",
    )
    .to_string();
    assert!(!msg.contains("exceeds the limit"), "{msg}");
    assert!(msg.contains("small.png"), "{msg}");
}

#[test]
fn oversized_image_file_is_refused_unread() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("huge.png");
    sparse_file(&path, limits::MAX_IMAGE_FILE_BYTES + 1);
    let e = err(ImageSource::Path(path.clone()).load(), "the huge file");
    match &e {
        Error::LimitExceeded {
            path: p, value, cap, ..
        } => {
            assert_eq!(
                (p, *value, *cap),
                (
                    &path,
                    limits::MAX_IMAGE_FILE_BYTES + 1,
                    limits::MAX_IMAGE_FILE_BYTES
                )
            );
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn safetensors_header_claiming_2_pow_60_bytes_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("model.safetensors");
    fs::write(&path, safetensors_bytes(1 << 60, "{}", 0)).unwrap();
    let e = err(Checkpoint::open_file(&path), "a 2^60-byte header");
    match &e {
        Error::LimitExceeded {
            what,
            path: p,
            value,
            cap,
        } => {
            assert_eq!(
                (p, *value, *cap),
                (&path, 1 << 60, limits::MAX_SAFETENSORS_HEADER_BYTES)
            );
            assert!(what.contains("safetensors header"), "{what}");
        }
        other => panic!("{other:?}"),
    }
    assert!(e.to_string().contains("1152921504606846976 bytes"), "{e}");
}

#[test]
fn safetensors_header_longer_than_the_file_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("model.safetensors");
    fs::write(&path, safetensors_bytes(5000, "{}", 0)).unwrap();
    let e = err(Checkpoint::open_file(&path), "a header past the end");
    assert!(matches!(e, Error::Safetensors { .. }), "{e:?}");
    let msg = e.to_string();
    assert!(
        msg.contains("header length 5000 exceeds the file size 10"),
        "{msg}"
    );
    assert!(msg.contains(&path.display().to_string()), "{msg}");
}

#[test]
fn tensor_offsets_outside_the_file_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("model.safetensors");
    let header = r#"{"w": {"dtype": "F32", "shape": [1024, 1024], "data_offsets": [0, 4194304]}}"#;
    fs::write(&path, safetensors_bytes(header.len() as u64, header, 16)).unwrap();
    let e = err(Checkpoint::open_file(&path), "offsets past the end");
    assert!(matches!(e, Error::Safetensors { .. }), "{e:?}");
    let msg = e.to_string();
    assert!(msg.contains("tensor `w` spans bytes 0..4194304"), "{msg}");
    assert!(msg.contains("data section has 16 bytes"), "{msg}");
    assert!(msg.contains(&path.display().to_string()), "{msg}");
}

#[test]
fn tensor_shape_whose_size_overflows_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("model.safetensors");
    // 2^62 · 2^2 elements of 4 bytes wraps to 0 in 64-bit arithmetic: it must not match offsets 0..0.
    let header = r#"{"w": {"dtype": "F32", "shape": [4611686018427387904, 4], "data_offsets": [0, 0]}}"#;
    fs::write(&path, safetensors_bytes(header.len() as u64, header, 0)).unwrap();
    let msg = err(Checkpoint::open_file(&path), "an overflowing shape").to_string();
    assert!(
        msg.contains("tensor `w` has a shape") && msg.contains("too large"),
        "{msg}"
    );
}

/// A model directory whose index maps one tensor to a good-looking shard and one to `hostile`.
fn index_with(hostile: &str) -> (tempfile::TempDir, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let index = tmp.path().join("model.safetensors.index.json");
    let doc = serde_json::json!({"weight_map": {
        "a.weight": "model-00001-of-00002.safetensors",
        "b.weight": hostile,
    }});
    fs::write(&index, doc.to_string()).unwrap();
    (tmp, index)
}

#[test]
fn shard_index_entries_outside_the_model_directory_are_refused() {
    for hostile in [
        "../x.safetensors",
        "/etc/passwd",
        "shards/../../x.safetensors",
        "",
    ] {
        let (tmp, index) = index_with(hostile);
        // Refused before any shard is opened: the good-looking shard does not exist either.
        let e = err(Checkpoint::open(tmp.path()), hostile);
        assert!(matches!(e, Error::Json { .. }), "{hostile}: {e:?}");
        let msg = e.to_string();
        assert!(msg.contains(&index.display().to_string()), "{msg}");
        assert!(msg.contains("weight_map.b.weight"), "{msg}");
        assert!(msg.contains(&format!("shard file `{hostile}`")), "{msg}");
    }
}

#[test]
fn shard_index_with_plain_relative_names_still_loads() {
    let tmp = tempfile::tempdir().unwrap();
    let src = fixture("tiny-qwen3-vl-sharded");
    fs::create_dir(tmp.path().join("shards")).unwrap();
    let index: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(src.join("model.safetensors.index.json")).unwrap()).unwrap();
    let mut map = serde_json::Map::new();
    for (name, file) in index["weight_map"].as_object().unwrap() {
        let file = file.as_str().unwrap();
        fs::copy(src.join(file), tmp.path().join("shards").join(file)).unwrap();
        map.insert(name.clone(), format!("./shards/{file}").into());
    }
    let doc = serde_json::json!({ "weight_map": map });
    fs::write(tmp.path().join("model.safetensors.index.json"), doc.to_string()).unwrap();
    let ckpt = Checkpoint::open(tmp.path()).unwrap();
    assert_eq!(ckpt.names().len(), map.len());
}

#[test]
fn ten_mb_nested_config_json_fails_at_the_depth_limit() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("config.json");
    fs::write(&path, nested_json(TEN_MB)).unwrap();
    assert_json_depth_error(&err(ModelConfig::from_dir(tmp.path()), "nested config"), &path);
}

#[test]
fn ten_mb_nested_messages_file_fails_at_the_depth_limit() {
    // What `recall generate|logits|score --messages` does with the file.
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("chat.json");
    fs::write(&path, nested_json(TEN_MB)).unwrap();
    let text = read_capped(&path, limits::MAX_DOCUMENT_BYTES).unwrap();
    assert_json_depth_error(&err(parse_messages(&text, &path), "nested messages"), &path);
}

#[test]
fn ten_mb_nested_dataset_line_fails_at_the_depth_limit() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("steps.jsonl");
    fs::write(&path, nested_json(TEN_MB) + "\n").unwrap();
    let e = err(StepDataset::load(&path), "nested dataset line");
    assert_json_depth_error(&e, &path);
    assert!(e.to_string().contains("line 1"), "{e}");
}

#[test]
fn ten_mb_nested_label_line_fails_at_the_depth_limit() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("labels.jsonl");
    fs::write(&path, nested_json(TEN_MB) + "\n").unwrap();
    let msg = err(
        read_labels(std::slice::from_ref(&path), false),
        "nested label line",
    )
    .to_string();
    assert!(msg.contains(&format!("{}:1", path.display())), "{msg}");
    assert!(msg.contains("recursion limit exceeded"), "{msg}");
}

#[test]
fn ten_mb_nested_episode_fails_at_the_depth_limit() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("episode.json");
    fs::write(&path, nested_json(TEN_MB)).unwrap();
    assert_json_depth_error(&err(Episode::load(tmp.path()), "nested episode"), &path);
}

#[test]
fn ten_mb_nested_tokenizer_json_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("tokenizer.json");
    fs::write(&path, format!("{{\"model\": {}}}", nested_json(TEN_MB))).unwrap();
    let e = err(Tokenizer::from_file(&path), "nested tokenizer");
    assert!(matches!(e, Error::Tokenizer(_)), "{e:?}");
    let msg = e.to_string();
    assert!(msg.contains(&path.display().to_string()), "{msg}");
    assert!(msg.contains("recursion limit exceeded"), "{msg}");
}

#[test]
fn config_json_over_the_size_cap_is_refused_unread() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("config.json");
    sparse_file(&path, limits::MAX_CONFIG_BYTES + 1);
    let e = err(ModelConfig::from_dir(tmp.path()), "a huge config.json");
    assert!(matches!(e, Error::LimitExceeded { .. }), "{e:?}");
    let expected = format!(
        "{}: file size of {} bytes exceeds the limit of {} bytes",
        path.display(),
        limits::MAX_CONFIG_BYTES + 1,
        limits::MAX_CONFIG_BYTES
    );
    assert_eq!(e.to_string(), expected);
}

#[test]
fn shard_index_over_the_size_cap_is_refused_unread() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("model.safetensors.index.json");
    sparse_file(&path, limits::MAX_CONFIG_BYTES + 1);
    let e = err(Checkpoint::open(tmp.path()), "a huge index");
    assert!(
        matches!(&e, Error::LimitExceeded { path: p, .. } if *p == path),
        "{e:?}"
    );
}

#[test]
fn tokenizer_json_over_its_cap_is_refused_unread() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("tokenizer.json");
    sparse_file(&path, limits::MAX_TOKENIZER_BYTES + 1);
    let e = err(Tokenizer::from_file(&path), "a huge tokenizer.json");
    assert!(
        matches!(&e, Error::LimitExceeded { path: p, .. } if *p == path),
        "{e:?}"
    );
}

#[cfg(unix)]
#[test]
fn a_stream_that_reports_no_size_is_still_cut_at_the_cap() {
    // /dev/zero's metadata says 0 bytes; the reader must stop at the cap rather than trust it.
    let e = err(read_capped(Path::new("/dev/zero"), 1000), "/dev/zero");
    match e {
        Error::LimitExceeded { value, cap, .. } => assert_eq!((value, cap), (1001, 1000)),
        other => panic!("{other:?}"),
    }
}
