//! `recall selector train`: the marginal scorer from utility labels (docs/TRAINING.md).

use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Subcommand;
use recall::agent::labels::read_labels;
use recall::memory::selector::EventIndexing;
use recall::memory::selector_train::{report_table, train, TrainConfig, RECENCY_FEATURES};

use super::write_file;

#[derive(Subcommand)]
pub enum SelectorCommand {
    /// Train the marginal scorer on `recall episode label` files; writes a scorer that
    /// `--policy selector --selector FILE` loads, and a report.
    Train(TrainArgs),
}

#[derive(clap::Args)]
pub struct TrainArgs {
    /// Label files (comma-separated or repeated), from `recall episode label`.
    #[arg(long, value_delimiter = ',', required = true)]
    labels: Vec<PathBuf>,
    /// The scorer file to write (safetensors).
    #[arg(long)]
    out: PathBuf,
    /// The report as JSON [default: OUT with extension .report.json].
    #[arg(long)]
    report: Option<PathBuf>,
    /// Hidden width of the MLP (the paper: 192).
    #[arg(long, default_value_t = 192)]
    hidden: usize,
    #[arg(long, default_value_t = 60)]
    epochs: usize,
    /// AdamW learning rate.
    #[arg(long, default_value_t = 1e-3)]
    lr: f64,
    /// AdamW decoupled weight decay.
    #[arg(long, default_value_t = 1e-4)]
    weight_decay: f64,
    /// Weight of the within-state ranking term.
    #[arg(long, default_value_t = 1.0)]
    rank_weight: f64,
    /// Samples per mini-batch (whole states are added until it is reached).
    #[arg(long, default_value_t = 256)]
    batch_samples: usize,
    /// Fraction of episodes held out for the report.
    #[arg(long, default_value_t = 0.2)]
    holdout: f64,
    /// Seed of the initialisation, the split and the batch order: the same seed and labels give a
    /// bitwise-identical file.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Train on label files whose `made_with` differ.
    #[arg(long)]
    allow_mixed: bool,
    /// How features count ages: desktop (age t-s+1, the authors' training code; in_recent_B is
    /// Recent-B) or mobile (age t-s, their MobileWorld deployment). Recorded in the file.
    #[arg(long, default_value = "desktop", value_parser = |s: &str| s.parse::<EventIndexing>())]
    event_indexing: EventIndexing,
    /// Features to hold at 0 and cut from the scorer (comma-separated names, or `recency` for the
    /// paper's no-recency-membership control: in_recent_1/2/4/8 and n_recent_in_set).
    #[arg(long, value_delimiter = ',')]
    mask_features: Vec<String>,
}

/// The masked feature names, with `recency` expanded.
fn masked_features(names: &[String]) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for n in names {
        let expanded: Vec<String> = if n == "recency" {
            RECENCY_FEATURES.iter().map(|s| s.to_string()).collect()
        } else {
            vec![n.trim().to_string()]
        };
        for e in expanded {
            if !out.contains(&e) {
                out.push(e);
            }
        }
    }
    out
}

pub fn run(command: SelectorCommand) -> Result<()> {
    match command {
        SelectorCommand::Train(a) => train_scorer(&a),
    }
}

fn train_scorer(a: &TrainArgs) -> Result<()> {
    let set = read_labels(&a.labels, a.allow_mixed)?;
    tracing::info!(
        decisions = set.decisions.len(),
        labels = set.labels,
        "read {} label file(s)",
        a.labels.len()
    );
    let cfg = TrainConfig {
        hidden: a.hidden,
        epochs: a.epochs,
        learning_rate: a.lr,
        weight_decay: a.weight_decay,
        rank_weight: a.rank_weight,
        batch_samples: a.batch_samples,
        holdout: a.holdout,
        seed: a.seed,
        indexing: a.event_indexing,
        masked: masked_features(&a.mask_features),
    };
    let bar = indicatif::ProgressBar::new(a.epochs as u64).with_style(
        indicatif::ProgressStyle::with_template("training {bar:30} epoch {pos}/{len} loss {msg}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let trained = train(&set.decisions, &cfg, |epoch, loss| {
        bar.set_position(epoch as u64);
        bar.set_message(format!("{loss:.5}"));
        tracing::debug!(epoch, loss, "epoch");
    })?;
    bar.finish_and_clear();
    let mut meta = BTreeMap::new();
    let names: Vec<String> = a.labels.iter().map(|p| p.display().to_string()).collect();
    meta.insert("labels".to_string(), names.join(","));
    meta.insert("labels_made_with".to_string(), set.made_with.to_string());
    trained
        .save(&a.out, &meta)
        .with_context(|| format!("writing {}", a.out.display()))?;
    let report = a
        .report
        .clone()
        .unwrap_or_else(|| a.out.with_extension("report.json"));
    write_file(&report, serde_json::to_string_pretty(&trained.report)?)?;
    let r = &trained.report;
    println!(
        "trained on {} implied marginals ({} decisions); loss {:.5} -> {:.5} over {} epochs\n",
        r.train.samples, r.train.decisions, r.first_epoch_loss, r.last_epoch_loss, a.epochs
    );
    print!("{}", report_table(r));
    println!("\nwrote {} and {}", a.out.display(), report.display());
    Ok(())
}
