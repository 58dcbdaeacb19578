"""The pictures in docs/ are what scripts/make_doc_images.py makes from the example pair now:
the TUI's SVG compared by its text, screen line by screen line; the report's PNG by the
fingerprint of the report's visible text that the script writes into the PNG (a pixel comparison
would fail on another machine's fonts). When the TUI or the report changes, rerun the script."""

from __future__ import annotations

import struct
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import make_doc_images as docs  # noqa: E402


def test_tui_example_svg_is_current():
    committed = docs.comparable(docs.svg_text(docs.TUI_SVG.read_text(encoding="utf-8")))
    now = docs.comparable(docs.svg_text(docs.tui_svg()))
    assert len(now) == docs.TUI_SIZE[1]
    assert committed == now, ("docs/tui-example.svg is stale: run scripts/make_doc_images.py\n"
                              + "\n".join(f"- {a}\n+ {b}" for a, b in zip(committed, now) if a != b))


def test_report_example_png_is_current(tmp_path):
    data = docs.REPORT_PNG.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", data[16:24]) == docs.PAGE_SIZE
    page = tmp_path / "report.html"
    docs.report_html(page)
    assert docs.png_fingerprint(data) == docs.report_fingerprint(page.read_text()), \
        "docs/report-example.png is stale: run scripts/make_doc_images.py"


def test_svg_comparison_sees_a_changed_word_not_a_scrollbar():
    lines = docs.svg_text(docs.TUI_SVG.read_text(encoding="utf-8"))
    i = next(k for k, x in enumerate(lines) if "feeds layer3" in x)
    moved = [x.replace(" │", "▇│", 1) if k == i else x for k, x in enumerate(lines)]
    assert docs.comparable(moved) == docs.comparable(lines) or "▇│" not in moved[i]
    changed = [x.replace("feeds layer3", "feeds layer4") if k == i else x for k, x in enumerate(lines)]
    assert docs.comparable(changed) != docs.comparable(lines)


def test_fingerprint_sees_a_changed_sentence(tmp_path):
    """The comparison can fail: one changed word in the report changes the fingerprint, the
    generation time does not."""
    page = tmp_path / "report.html"
    docs.report_html(page)
    doc = page.read_text()
    base = docs.report_fingerprint(doc)
    assert docs.report_fingerprint(doc.replace("train feeds embed", "train feeds layer1")) != base
    assert docs.report_fingerprint(doc.replace("UTC", "GMT")) == base
    png = docs._png_with_text(docs.REPORT_PNG.read_bytes()[:33] + b"\0\0\0\0IEND\xaeB`\x82", docs.PNG_KEY, base)
    assert docs.png_fingerprint(png) == base
