//! A picture of an episode's allocations: one row per decision step, one column per completed step
//! (event). A cell shows how the event appeared in that step's prompt: as a screenshot from the
//! Recent-B window, as an older screenshot the selector promoted, or folded into a one-line summary.
//! The current screenshot closes each row.

use std::path::Path;

use image::{Rgb, RgbImage};

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

const CELL: u32 = 14;
const GAP: u32 = 2;
const MARGIN: u32 = 24;
const RECENT: Rgb<u8> = Rgb([66, 133, 244]);
const PROMOTED: Rgb<u8> = Rgb([251, 140, 0]);
const FOLDED: Rgb<u8> = Rgb([214, 216, 220]);
const CURRENT: Rgb<u8> = Rgb([52, 168, 83]);
const DROPPED: Rgb<u8> = Rgb([150, 170, 200]);

/// Draws the chart and writes it as a PNG. Colours: blue = Recent-B screenshot, orange = promoted
/// older screenshot, light blue = a recent event the promotion evicted (now folded), grey = folded
/// summary, green = current screenshot.
///
/// ```
/// use recall::agent::chart::{write_allocation_chart, AllocationRow};
/// let rows = vec![AllocationRow { step: 3, allocation: vec![1], recent: vec![2] }];
/// let path = std::env::temp_dir().join("recall-chart-doc.png");
/// write_allocation_chart(&rows, &path).unwrap();
/// ```
pub fn write_allocation_chart(rows: &[AllocationRow], path: &Path) -> Result<()> {
    let cols = rows.iter().map(|r| r.step).max().unwrap_or(1) as u32;
    let (w, h) = (
        2 * MARGIN + cols * (CELL + GAP),
        2 * MARGIN + rows.len().max(1) as u32 * (CELL + GAP),
    );
    let mut img = RgbImage::from_pixel(w, h, Rgb([255, 255, 255]));
    for (i, row) in rows.iter().enumerate() {
        let y = MARGIN + i as u32 * (CELL + GAP);
        draw_number(&mut img, 2, y + 4, row.step);
        for event in 1..=row.step {
            let color = if event == row.step {
                CURRENT
            } else if row.allocation.contains(&event) && row.recent.contains(&event) {
                RECENT
            } else if row.allocation.contains(&event) {
                PROMOTED
            } else if row.recent.contains(&event) {
                DROPPED
            } else {
                FOLDED
            };
            fill(&mut img, MARGIN + (event as u32 - 1) * (CELL + GAP), y, color);
        }
    }
    for event in (1..=cols).step_by(5) {
        draw_number(
            &mut img,
            MARGIN + (event - 1) * (CELL + GAP) + 3,
            6,
            event as usize,
        );
    }
    img.save(path)
        .map_err(|e| Error::io(path, std::io::Error::other(e.to_string())))
}

fn fill(img: &mut RgbImage, x: u32, y: u32, color: Rgb<u8>) {
    for dy in 0..CELL {
        for dx in 0..CELL {
            img.put_pixel(x + dx, y + dy, color);
        }
    }
}

/// 3x5 bitmap digits: five rows of three bits (bit 2 = left column).
const DIGITS: [[u8; 5]; 10] = [
    [7, 5, 5, 5, 7],
    [2, 6, 2, 2, 7],
    [7, 1, 7, 4, 7],
    [7, 1, 7, 1, 7],
    [5, 5, 7, 1, 1],
    [7, 4, 7, 1, 7],
    [7, 4, 7, 5, 7],
    [7, 1, 1, 1, 1],
    [7, 5, 7, 5, 7],
    [7, 5, 7, 1, 7],
];

/// Draws `n` in 2x-scaled 3x5 digits with its top-left corner at (x, y).
fn draw_number(img: &mut RgbImage, x: u32, y: u32, n: usize) {
    for (k, ch) in n.to_string().bytes().enumerate() {
        let glyph = DIGITS[(ch - b'0') as usize];
        for (r, bits) in glyph.iter().enumerate() {
            for c in 0..3 {
                if bits & (4 >> c) != 0 {
                    for (sx, sy) in [(0, 0), (1, 0), (0, 1), (1, 1)] {
                        let (px, py) = (x + k as u32 * 8 + c * 2 + sx, y + r as u32 * 2 + sy);
                        if px < img.width() && py < img.height() {
                            img.put_pixel(px, py, Rgb([40, 40, 40]));
                        }
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cells_have_the_documented_colours() {
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
        let path = std::env::temp_dir().join(format!("recall-chart-{}.png", std::process::id()));
        write_allocation_chart(&rows, &path).unwrap();
        let img = image::open(&path).unwrap().to_rgb8();
        let at = |row: u32, event: u32| {
            *img.get_pixel(
                MARGIN + (event - 1) * (CELL + GAP) + 5,
                MARGIN + row * (CELL + GAP) + 5,
            )
        };
        assert_eq!(
            [at(0, 1), at(0, 2), at(0, 3), at(0, 4)],
            [FOLDED, RECENT, RECENT, CURRENT]
        );
        assert_eq!(
            [at(1, 1), at(1, 2), at(1, 3), at(1, 4), at(1, 5)],
            [PROMOTED, FOLDED, DROPPED, RECENT, CURRENT]
        );
        let _ = std::fs::remove_file(path);
    }
}
