//! The pictures recall writes, drawn with plotters: an episode's allocations (one row per decision
//! step, one cell per event) and the histogram of a selector's margins over Recent-B. Each has a
//! title, named axes with numbered ticks and a legend beside the plot, in a font bundled with the
//! binary (`assets/fonts/chart-sans.ttf`, a DejaVu Sans subset: no system font is needed).

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Once;

use plotters::coord::Shift;
use plotters::prelude::*;

use crate::error::{Error, Result};

/// How one decision step allocated its budget.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AllocationRow {
    /// The decision step (1-based); events `1..step` are completed.
    pub step: usize,
    /// Events shown with their screenshot.
    pub allocation: Vec<usize>,
    /// The Recent-B window of this step.
    pub recent: Vec<usize>,
}

impl From<&crate::agent::causalcache::StepReport> for AllocationRow {
    fn from(r: &crate::agent::causalcache::StepReport) -> Self {
        AllocationRow {
            step: r.t,
            allocation: r.allocation.clone(),
            recent: r.recent.clone(),
        }
    }
}

/// How an event appeared in a step's prompt: the cell colours of the allocation chart.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum CellKind {
    /// A Recent-B screenshot that stayed.
    Recent,
    /// An older screenshot the selector promoted.
    Promoted,
    /// A Recent-B event the promotion evicted (now a one-line summary).
    Evicted,
    /// A one-line summary.
    Folded,
    /// The step's current screenshot.
    Current,
}

impl CellKind {
    const ALL: [CellKind; 5] = [
        CellKind::Recent,
        CellKind::Promoted,
        CellKind::Evicted,
        CellKind::Folded,
        CellKind::Current,
    ];

    /// The kind of `event` in `row`.
    pub fn of(row: &AllocationRow, event: usize) -> CellKind {
        let (shown, recent) = (row.allocation.contains(&event), row.recent.contains(&event));
        match (event == row.step, shown, recent) {
            (true, _, _) => CellKind::Current,
            (false, true, true) => CellKind::Recent,
            (false, true, false) => CellKind::Promoted,
            (false, false, true) => CellKind::Evicted,
            (false, false, false) => CellKind::Folded,
        }
    }

    /// Its colour (an RGB triple).
    pub fn rgb(self) -> [u8; 3] {
        match self {
            CellKind::Recent => [66, 133, 244],
            CellKind::Promoted => [251, 140, 0],
            CellKind::Evicted => [150, 170, 200],
            CellKind::Folded => [214, 216, 220],
            CellKind::Current => [52, 168, 83],
        }
    }

    fn label(self) -> &'static str {
        match self {
            CellKind::Recent => "Recent-B screenshot",
            CellKind::Promoted => "promoted older screenshot",
            CellKind::Evicted => "evicted recent (now a summary)",
            CellKind::Folded => "one-line summary",
            CellKind::Current => "current screenshot",
        }
    }
}

/// Draws the allocation chart and writes it as a PNG: rows are decision steps (top to bottom),
/// columns events, colours [`CellKind`]s, with a legend that counts each kind.
///
/// ```
/// use recall::agent::chart::{write_allocation_chart, AllocationRow};
/// let rows = vec![AllocationRow { step: 3, allocation: vec![1], recent: vec![2] }];
/// let path = std::env::temp_dir().join("recall-chart-doc.png");
/// write_allocation_chart(&rows, &path).unwrap();
/// ```
pub fn write_allocation_chart(rows: &[AllocationRow], path: &Path) -> Result<()> {
    let size = allocation_size(rows);
    let mut buf = vec![0u8; (size.0 * size.1 * 3) as usize];
    draw_allocation(rows, &mut buf, size).map_err(|e| drawing_error(path, e))?;
    save_png(buf, size, path)
}

/// Cell centres (in pixels) by `(row index, event)`, what [`draw_allocation`] reports for tests.
type CellCentres = BTreeMap<(usize, usize), (i32, i32)>;

/// Side of a cell in pixels: about 720 pixels of plot across, between 10 and 28 per cell.
fn cell_px(rows: &[AllocationRow]) -> u32 {
    let cols = rows.iter().map(|r| r.step).max().unwrap_or(1).max(rows.len()) as u32;
    (720 / cols.max(1)).clamp(10, 28)
}

fn allocation_size(rows: &[AllocationRow]) -> (u32, u32) {
    let cell = cell_px(rows);
    let cols = rows.iter().map(|r| r.step).max().unwrap_or(1) as u32;
    let plot = (cols * cell, rows.len().max(1) as u32 * cell);
    ((plot.0 + 90).max(360) + LEGEND_W, (plot.1 + 140).max(280))
}

/// Width of the legend panel right of a plot.
const LEGEND_W: u32 = 290;

fn draw_allocation(
    rows: &[AllocationRow],
    buf: &mut [u8],
    size: (u32, u32),
) -> std::result::Result<CellCentres, String> {
    register_font();
    let root = BitMapBackend::with_buffer(buf, size).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let (plot_area, legend_area) = root.split_horizontally(size.0 - LEGEND_W);
    let cols = rows.iter().map(|r| r.step).max().unwrap_or(1);
    // y = −step: steps grow downwards, as in a table.
    let (first, last) = (
        rows.iter().map(|r| r.step).min().unwrap_or(1),
        rows.iter().map(|r| r.step).max().unwrap_or(1),
    );
    let mut chart = ChartBuilder::on(&plot_area)
        .caption("CausalCache allocations per decision step", font(20))
        .margin(12)
        .x_label_area_size(46)
        .y_label_area_size(52)
        .build_cartesian_2d(
            0.5..cols as f64 + 0.5,
            -(last as f64) - 0.5..-(first as f64) + 0.5,
        )
        .map_err(|e| e.to_string())?;
    let integer = |v: &f64| {
        let r = v.round();
        if (v - r).abs() < 1e-6 {
            format!("{}", r.abs() as i64)
        } else {
            String::new()
        }
    };
    chart
        .configure_mesh()
        .disable_mesh()
        .x_labels(cols.min(16))
        .y_labels((last - first + 1).min(16))
        .x_label_formatter(&integer)
        .y_label_formatter(&integer)
        .x_desc("event (completed step; the last cell of a row is its current screen)")
        .y_desc("decision step")
        .label_style(font(13))
        .axis_desc_style(font(14))
        .draw()
        .map_err(|e| e.to_string())?;
    let mut centres = CellCentres::new();
    let mut counts = BTreeMap::new();
    let mut cells = Vec::new();
    for (i, row) in rows.iter().enumerate() {
        for event in 1..=row.step {
            let kind = CellKind::of(row, event);
            *counts.entry(kind).or_insert(0usize) += 1;
            let (x, y) = (event as f64, -(row.step as f64));
            centres.insert((i, event), chart.backend_coord(&(x, y)));
            cells.push(Rectangle::new(
                [(x - 0.44, y + 0.44), (x + 0.44, y - 0.44)],
                rgb(kind.rgb()).filled(),
            ));
        }
    }
    chart.draw_series(cells).map_err(|e| e.to_string())?;
    let items: Vec<(RGBColor, String)> = CellKind::ALL
        .iter()
        .map(|&k| {
            let n = counts.get(&k).copied().unwrap_or(0);
            (rgb(k.rgb()), format!("{} ({n})", k.label()))
        })
        .collect();
    let budget = rows.iter().map(|r| r.allocation.len()).max().unwrap_or(0);
    let promoted = rows.iter().filter(|r| r.allocation != r.recent).count();
    let note = [
        format!("{} steps, budget B = {budget}", rows.len()),
        format!("{promoted} steps promoted an older event"),
    ];
    draw_legend(&legend_area, &items, &note).map_err(|e| e.to_string())?;
    root.present().map_err(|e| e.to_string())?;
    Ok(centres)
}

/// One step of an offline evaluation, as the margin histogram sees it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MarginPoint {
    /// `Q(S) − Q(Recent-B)`.
    pub margin: f64,
    /// The allocation differs from Recent-B.
    pub reallocated: bool,
}

/// Bars of the margin histogram.
const BINS: usize = 24;

/// The histogram's bins: `[lo, hi]` (zero always inside) cut into [`BINS`] equal bins, and per bin
/// the steps of each [`Segment`].
#[derive(Debug, Clone, PartialEq)]
struct MarginBins {
    lo: f64,
    hi: f64,
    counts: [[usize; 3]; BINS],
}

/// The parts of a bar, bottom to top: steps that kept Recent-B, then reallocated steps with a
/// margin `≥ 0`, then those with a margin `< 0` (a bin around zero can hold both).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Segment {
    Kept = 0,
    Gain = 1,
    Loss = 2,
}

impl Segment {
    const ALL: [Segment; 3] = [Segment::Kept, Segment::Gain, Segment::Loss];

    fn of(p: &MarginPoint) -> Segment {
        match (p.reallocated, p.margin >= 0.0) {
            (false, _) => Segment::Kept,
            (true, true) => Segment::Gain,
            (true, false) => Segment::Loss,
        }
    }

    fn rgb(self) -> [u8; 3] {
        match self {
            Segment::Kept => MARGIN_KEPT,
            Segment::Gain => MARGIN_GAIN,
            Segment::Loss => MARGIN_LOSS,
        }
    }
}

impl MarginBins {
    fn of(points: &[MarginPoint]) -> MarginBins {
        let lo = points.iter().map(|p| p.margin).fold(0.0, f64::min);
        let mut hi = points.iter().map(|p| p.margin).fold(0.0, f64::max);
        if hi <= lo {
            hi = lo + 1.0;
        }
        let mut bins = MarginBins {
            lo,
            hi,
            counts: [[0; 3]; BINS],
        };
        for p in points {
            let i = (((p.margin - lo) / (hi - lo) * BINS as f64) as usize).min(BINS - 1);
            bins.counts[i][Segment::of(p) as usize] += 1;
        }
        bins
    }

    fn width(&self) -> f64 {
        (self.hi - self.lo) / BINS as f64
    }
}

const MARGIN_KEPT: [u8; 3] = [160, 160, 160];
const MARGIN_GAIN: [u8; 3] = [52, 168, 83];
const MARGIN_LOSS: [u8; 3] = [234, 67, 53];

/// A histogram of per-step margins `Q(S) − Q(Recent-B)` as a PNG: 24 bins between the smallest and
/// largest margin (zero included), steps that kept Recent-B (margin exactly 0) in grey at the foot
/// of each bar, reallocated steps above them in green (margin `≥ 0`) then red (`< 0`), and a black
/// line at zero.
///
/// ```
/// use recall::agent::chart::{write_margin_histogram, MarginPoint};
/// let points = [MarginPoint { margin: 0.5, reallocated: true }, MarginPoint { margin: 0.0, reallocated: false }];
/// let path = std::env::temp_dir().join("recall-margins-doc.png");
/// write_margin_histogram(&points, &path).unwrap();
/// ```
pub fn write_margin_histogram(points: &[MarginPoint], path: &Path) -> Result<()> {
    let size = (720 + LEGEND_W, 380);
    let mut buf = vec![0u8; (size.0 * size.1 * 3) as usize];
    draw_margins(points, &mut buf, size).map_err(|e| drawing_error(path, e))?;
    save_png(buf, size, path)
}

/// Bar segment centres in pixels by `(bin, segment)`, what [`draw_margins`] reports for tests.
type SegmentCentres = BTreeMap<(usize, Segment), (i32, i32)>;

fn draw_margins(
    points: &[MarginPoint],
    buf: &mut [u8],
    size: (u32, u32),
) -> std::result::Result<SegmentCentres, String> {
    register_font();
    let bins = MarginBins::of(points);
    let top = (0..BINS)
        .map(|i| bins.counts[i].iter().sum::<usize>())
        .max()
        .unwrap_or(0)
        .max(1);
    let root = BitMapBackend::with_buffer(buf, size).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let (plot_area, legend_area) = root.split_horizontally(size.0 - LEGEND_W);
    let mut chart = ChartBuilder::on(&plot_area)
        .caption(
            format!("Margin of the allocation over Recent-B, {} steps", points.len()),
            font(20),
        )
        .margin(12)
        .x_label_area_size(46)
        .y_label_area_size(52)
        .build_cartesian_2d(bins.lo..bins.hi, 0.0..top as f64 * 1.08)
        .map_err(|e| e.to_string())?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .max_light_lines(0)
        .bold_line_style(RGBColor(232, 232, 232))
        .y_labels(top.min(10))
        .y_label_formatter(&|v| {
            let r = v.round();
            if (v - r).abs() < 1e-6 {
                format!("{r:.0}")
            } else {
                String::new()
            }
        })
        .x_label_formatter(&|v| format!("{v:.3}"))
        .x_desc("margin Q(S) − Q(Recent-B), mean log-likelihood of the recorded response")
        .y_desc("steps")
        .label_style(font(13))
        .axis_desc_style(font(14))
        .draw()
        .map_err(|e| e.to_string())?;
    let mut centres = SegmentCentres::new();
    let mut bars = Vec::new();
    let pad = bins.width() * 0.06;
    for i in 0..BINS {
        let x0 = bins.lo + i as f64 * bins.width();
        let (x1, mid) = (x0 + bins.width(), x0 + bins.width() / 2.0);
        let mut y0 = 0.0;
        for seg in Segment::ALL {
            let y1 = y0 + bins.counts[i][seg as usize] as f64;
            if y1 > y0 {
                centres.insert((i, seg), chart.backend_coord(&(mid, (y0 + y1) / 2.0)));
                bars.push(Rectangle::new(
                    [(x0 + pad, y0), (x1 - pad, y1)],
                    rgb(seg.rgb()).filled(),
                ));
            }
            y0 = y1;
        }
    }
    chart.draw_series(bars).map_err(|e| e.to_string())?;
    chart
        .draw_series(std::iter::once(PathElement::new(
            vec![(0.0, 0.0), (0.0, top as f64 * 1.08)],
            BLACK.stroke_width(2),
        )))
        .map_err(|e| e.to_string())?;
    let (items, note) = margin_legend(points);
    draw_legend(&legend_area, &items, &note).map_err(|e| e.to_string())?;
    root.present().map_err(|e| e.to_string())?;
    Ok(centres)
}

/// The margin chart's legend: a swatch per segment with its step count, and the mean margin.
fn margin_legend(points: &[MarginPoint]) -> ([(RGBColor, String); 3], [String; 2]) {
    let count = |f: &dyn Fn(&MarginPoint) -> bool| points.iter().filter(|p| f(p)).count();
    let gain = count(&|p| p.reallocated && p.margin >= 0.0);
    let loss = count(&|p| p.reallocated && p.margin < 0.0);
    let items = [
        (
            rgb(MARGIN_KEPT),
            format!("kept Recent-B ({})", count(&|p| !p.reallocated)),
        ),
        (rgb(MARGIN_GAIN), format!("reallocated, margin ≥ 0 ({gain})")),
        (rgb(MARGIN_LOSS), format!("reallocated, margin < 0 ({loss})")),
    ];
    let mean = points.iter().map(|p| p.margin).sum::<f64>() / points.len().max(1) as f64;
    let note = [
        format!("mean margin {mean:.4}"),
        "black line: margin 0".to_string(),
    ];
    (items, note)
}

/// The legend panel: a swatch and a label per item, then notes, from the panel's top left.
fn draw_legend<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    items: &[(RGBColor, String)],
    notes: &[String],
) -> std::result::Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    let (x, mut y) = (8, 56);
    area.draw(&Text::new("legend", (x, y - 26), font(15)))?;
    for (colour, label) in items {
        area.draw(&Rectangle::new([(x, y), (x + 16, y + 16)], colour.filled()))?;
        area.draw(&Text::new(label.as_str(), (x + 24, y + 1), font(13)))?;
        y += 24;
    }
    y += 10;
    for note in notes {
        area.draw(&Text::new(note.as_str(), (x, y), font(13)))?;
        y += 20;
    }
    Ok(())
}

/// The bundled font, registered once as plotters' "sans-serif".
fn register_font() {
    static FONT: &[u8] = include_bytes!("../../assets/fonts/chart-sans.ttf");
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // The bytes are a valid TrueType file (tests draw text with them); were they not,
        // plotters would fail each text draw with `FontUnavailable`, which callers report.
        let _ = plotters::style::register_font("sans-serif", FontStyle::Normal, FONT);
    });
}

fn font(size: u32) -> TextStyle<'static> {
    ("sans-serif", size).into_font().color(&RGBColor(40, 40, 40))
}

fn rgb([r, g, b]: [u8; 3]) -> RGBColor {
    RGBColor(r, g, b)
}

fn drawing_error(path: &Path, e: String) -> Error {
    Error::io(path, std::io::Error::other(format!("drawing the chart: {e}")))
}

fn save_png(buf: Vec<u8>, (w, h): (u32, u32), path: &Path) -> Result<()> {
    let img = image::RgbImage::from_raw(w, h, buf).expect("the buffer is w * h * 3 bytes");
    img.save(path)
        .map_err(|e| Error::io(path, std::io::Error::other(e.to_string())))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pixel(buf: &[u8], w: u32, (x, y): (i32, i32)) -> [u8; 3] {
        let i = 3 * (y as usize * w as usize + x as usize);
        [buf[i], buf[i + 1], buf[i + 2]]
    }

    /// Pixels of exactly `rgb` in the image.
    fn count(buf: &[u8], rgb: [u8; 3]) -> usize {
        buf.chunks_exact(3).filter(|p| **p == rgb).count()
    }

    #[test]
    fn cells_have_the_documented_colours() {
        use CellKind::*;
        let rows = vec![
            AllocationRow {
                step: 4,
                allocation: vec![2, 3],
                recent: vec![2, 3],
            },
            AllocationRow {
                step: 5,
                allocation: vec![1, 4],
                recent: vec![3, 4],
            },
        ];
        let size = allocation_size(&rows);
        let mut buf = vec![0u8; (size.0 * size.1 * 3) as usize];
        let centres = draw_allocation(&rows, &mut buf, size).unwrap();
        let want = [
            vec![Folded, Recent, Recent, Current],
            vec![Promoted, Folded, Evicted, Recent, Current],
        ];
        assert_eq!(centres.len(), 9);
        for (i, kinds) in want.iter().enumerate() {
            for (e, kind) in kinds.iter().enumerate() {
                let at = centres[&(i, e + 1)];
                assert_eq!(pixel(&buf, size.0, at), kind.rgb(), "row {i}, event {}", e + 1);
            }
        }
        // Rows go down, events right.
        assert!(centres[&(1, 1)].1 > centres[&(0, 1)].1);
        assert!(centres[&(0, 2)].0 > centres[&(0, 1)].0);
        // The legend shows every kind, present or not, and text is drawn (anti-aliased glyphs
        // leave grey levels that no cell or swatch has).
        for kind in CellKind::ALL {
            assert!(count(&buf, kind.rgb()) > 0, "{kind:?}");
        }
        let text = buf
            .chunks_exact(3)
            .filter(|p| p[0] == p[1] && p[1] == p[2] && p[0] < 200 && p[0] > 40)
            .count();
        assert!(text > 200, "{text} text pixels");
    }

    #[test]
    fn margin_bars_stack_kept_below_reallocated() {
        let points: Vec<MarginPoint> = [(0.0, false), (0.0, false), (0.3, true), (-0.2, true), (0.0, true)]
            .iter()
            .map(|&(margin, reallocated)| MarginPoint { margin, reallocated })
            .collect();
        let bins = MarginBins::of(&points);
        assert_eq!((bins.lo, bins.hi), (-0.2, 0.3));
        let total = |s: Segment| bins.counts.iter().map(|c| c[s as usize]).sum::<usize>();
        assert_eq!(
            [total(Segment::Kept), total(Segment::Gain), total(Segment::Loss)],
            [2, 2, 1]
        );
        let size = (720 + LEGEND_W, 380);
        let mut buf = vec![0u8; (size.0 * size.1 * 3) as usize];
        let centres = draw_margins(&points, &mut buf, size).unwrap();
        // Margin 0 falls in bin 9 of 24 over [-0.2, 0.3]: two kept steps and one reallocated.
        let zero = ((0.2 / 0.5) * BINS as f64) as usize;
        let at = |bin: usize, seg: Segment| pixel(&buf, size.0, centres[&(bin, seg)]);
        assert_eq!(at(zero, Segment::Kept), MARGIN_KEPT);
        assert_eq!(at(zero, Segment::Gain), MARGIN_GAIN);
        let y = |bin: usize, seg: Segment| centres[&(bin, seg)].1;
        assert!(y(zero, Segment::Gain) < y(zero, Segment::Kept), "stacked above");
        assert_eq!(at(0, Segment::Loss), MARGIN_LOSS);
        assert_eq!(at(BINS - 1, Segment::Gain), MARGIN_GAIN);
        assert_eq!(centres.len(), 4);
    }

    #[test]
    fn a_chart_into_a_missing_directory_names_the_path() {
        let rows = vec![AllocationRow {
            step: 2,
            allocation: vec![1],
            recent: vec![1],
        }];
        let path = Path::new("/nonexistent-dir/chart.png");
        let err = write_allocation_chart(&rows, path).unwrap_err().to_string();
        assert!(err.contains("/nonexistent-dir/chart.png"), "{err}");
        let err = write_margin_histogram(&[], path).unwrap_err().to_string();
        assert!(err.contains("/nonexistent-dir/chart.png"), "{err}");
    }
}
