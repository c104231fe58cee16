"""Writes assets/fonts/chart-sans.ttf: DejaVu Sans cut down to the characters recall's charts print.

The charts (src/agent/chart.rs) draw text with plotters' ab_glyph backend, which needs the font's
bytes; the whole DejaVu Sans is 740 KB, the subset a few tens. DejaVu's licence (Bitstream Vera
terms plus public-domain changes, assets/fonts/LICENSE) allows a modified copy whose name contains
neither "Bitstream" nor "Vera".

Regenerate (fonttools from PyPI; DejaVu Sans from a system package such as fonts-dejavu-core):

    python3 -m venv .venv-font && .venv-font/bin/pip install fonttools
    .venv-font/bin/python tools/make_chart_font.py --font /usr/share/fonts/truetype/dejavu/DejaVuSans.ttf
"""

import argparse
from pathlib import Path

from fontTools import subset

# Printable ASCII and the few symbols the charts' titles and axes use.
CHARS = "".join(chr(c) for c in range(0x20, 0x7F)) + "−–×·≤≥Δ…"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--font", required=True, type=Path, help="DejaVuSans.ttf")
    ap.add_argument("--out", type=Path, default=Path("assets/fonts/chart-sans.ttf"))
    a = ap.parse_args()
    opts = subset.Options()
    opts.name_IDs = ["*"]
    opts.hinting = False
    opts.layout_features = ["kern"]
    font = subset.load_font(str(a.font), opts)
    sub = subset.Subsetter(opts)
    sub.populate(text=CHARS)
    sub.subset(font)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    subset.save_font(font, str(a.out), opts)
    print(f"wrote {a.out} ({a.out.stat().st_size} bytes, {len(CHARS)} characters)")


if __name__ == "__main__":
    main()
