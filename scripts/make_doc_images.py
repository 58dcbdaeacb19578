#!/usr/bin/env python3
"""Regenerate the pictures in docs/ from the example pair in traces/ (run from anywhere):

* docs/tui-example.svg: the TUI at 140 x 40, headless (Textual's own SVG screenshot), as
  ``tensordiff tui traces/train.h5 traces/serve.h5 --screenshot docs/tui-example.svg`` makes it;
* docs/report-example.png: the HTML report (``tensordiff report``) rendered by headless Chromium
  at 960 x 1100.

    .venv/bin/python scripts/make_doc_images.py [--check]

tests/test_doc_images.py checks that the committed pictures are what this script makes now,
robustly rather than pixel for pixel (fonts and Chromium versions differ between machines): the
SVG by its text, screen line by screen line (:func:`svg_text`); the PNG by a fingerprint of the
report's visible text that this script writes into the PNG as a ``tEXt`` chunk
(:func:`report_fingerprint`, :func:`png_fingerprint`). ``--check`` does the same comparison
here and exits 1 when a picture is stale.
"""

from __future__ import annotations

import argparse
import hashlib
import html
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import zlib
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PAIR = ("traces/train.h5", "traces/serve.h5")   # relative to REPO: the pictures show these paths
TUI_SVG = REPO / "docs" / "tui-example.svg"
REPORT_PNG = REPO / "docs" / "report-example.png"
TUI_SIZE = (140, 40)
PAGE_SIZE = (960, 1100)
PNG_KEY = "tensordiff-report-text-sha256"


def _in_repo():
    """Run with the repository as the working directory (the pictures name traces/ relatively)."""
    class _Cwd:
        def __enter__(self):
            self.old = os.getcwd()
            os.chdir(REPO)

        def __exit__(self, *exc):
            os.chdir(self.old)
    return _Cwd()


# ----------------------------------------------------------------------------------------------
# the TUI


def tui_svg() -> str:
    """The TUI's screenshot of the example pair, as an SVG string."""
    import asyncio

    from tensordiff.tui.app import TensordiffApp

    async def go() -> str:
        app = TensordiffApp(*PAIR, find_tokenizer=False)
        async with app.run_test(size=TUI_SIZE) as pilot:
            while not app.ready and app.diff_error is None:
                await pilot.pause(0.05)
            if app.diff_error is not None:
                raise SystemExit(f"the diff failed: {app.diff_error}")
            while app.vectors_for != app.cell:
                await pilot.pause(0.05)
            await pilot.pause()
            return app.export_screenshot(title="tensordiff")

    with _in_repo():
        return asyncio.run(go())


def svg_text(svg: str) -> list[str]:
    """The screen an SVG screenshot shows, as text lines (its ``<text>`` elements by row and column)."""
    rows: dict[float, list[tuple[float, str]]] = defaultdict(list)
    for m in re.finditer(r'<text class="[^"]*" x="([\d.]+)" y="([\d.]+)"[^>]*>(.*?)</text>', svg):
        rows[float(m.group(2))].append((float(m.group(1)), html.unescape(m.group(3))))
    out = []
    for y in sorted(rows):
        line = ""
        for x, t in sorted(rows[y]):
            line = line.ljust(int(round(x / 12.2))) + t
        out.append(line.replace("\xa0", " ").rstrip())
    return out


_SCROLLBAR = re.compile(r"[▁▂▃▄▅▆▇█▉▊▋▌▍▎▏]{1,2}(?= ?│)")


def comparable(lines: list[str]) -> list[str]:
    """The screen's text without the scrollbars' thumbs (the block glyphs just inside a pane's right
    border): where a thumb sits depends on when the screenshot was taken, not on what it shows."""
    return [_SCROLLBAR.sub(lambda m: " " * len(m.group(0)), line) for line in lines]


# ----------------------------------------------------------------------------------------------
# the HTML report


def report_html(out: Path) -> None:
    from tensordiff.report.html import make_report

    with _in_repo():
        make_report(*PAIR, str(out))


def report_fingerprint(doc: str) -> str:
    """sha256 of the report's visible text: tags, the embedded heatmap image, the generation time
    and the version line left out (they change with every run, not with what the report says)."""
    body = doc.split("<body", 1)[-1]
    body = re.sub(r'<p class="meta">.*?</p>', "", body, flags=re.S)
    body = re.sub(r"<script.*?</script>|<style.*?</style>", "", body, flags=re.S)
    text = html.unescape(re.sub(r"<[^>]+>", " ", body))
    return hashlib.sha256(" ".join(text.split()).encode()).hexdigest()


def _png_with_text(data: bytes, key: str, value: str) -> bytes:
    """``data`` (a PNG) with a tEXt chunk ``key``=``value`` after its header chunk."""
    body = key.encode("latin-1") + b"\0" + value.encode("latin-1")
    chunk = struct.pack(">I", len(body)) + b"tEXt" + body + struct.pack(">I", zlib.crc32(b"tEXt" + body))
    ihdr_end = 8 + 8 + 13 + 4
    return data[:ihdr_end] + chunk + data[ihdr_end:]


def png_fingerprint(data: bytes) -> str | None:
    """The value of the tEXt chunk :data:`PNG_KEY` in a PNG, if it has one."""
    pos = 8
    while pos + 8 <= len(data):
        n, kind = struct.unpack(">I4s", data[pos:pos + 8])
        if kind == b"tEXt":
            k, _, v = data[pos + 8:pos + 8 + n].partition(b"\0")
            if k.decode("latin-1") == PNG_KEY:
                return v.decode("latin-1")
        pos += 12 + n
    return None


def report_png(out: Path) -> None:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if not exe:
        raise SystemExit("the report's picture needs chromium (scripts/setup.sh full installs it)")
    with tempfile.TemporaryDirectory(prefix="tensordiff-docs-") as d:
        page = Path(d) / "report.html"
        report_html(page)
        shot = Path(d) / "shot.png"
        cmd = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
               "--disable-extensions", "--hide-scrollbars", f"--window-size={PAGE_SIZE[0]},{PAGE_SIZE[1]}",
               f"--screenshot={shot}", page.as_uri()]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=180, check=False,
                           env=dict(os.environ, HOME=d))
        if p.returncode != 0 or not shot.is_file():
            raise SystemExit(f"chromium failed ({p.returncode}): {p.stderr[-500:]}")
        out.write_bytes(_png_with_text(shot.read_bytes(), PNG_KEY, report_fingerprint(page.read_text())))


# ----------------------------------------------------------------------------------------------


def stale() -> list[str]:
    """Which committed pictures differ from what this script makes now (empty: none)."""
    bad = []
    if comparable(svg_text(TUI_SVG.read_text(encoding="utf-8"))) != comparable(svg_text(tui_svg())):
        bad.append(str(TUI_SVG.relative_to(REPO)))
    with tempfile.TemporaryDirectory(prefix="tensordiff-docs-") as d:
        page = Path(d) / "report.html"
        report_html(page)
        if png_fingerprint(REPORT_PNG.read_bytes()) != report_fingerprint(page.read_text()):
            bad.append(str(REPORT_PNG.relative_to(REPO)))
    return bad


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="only say whether the committed pictures are stale")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(REPO))
    if args.check:
        bad = stale()
        print("stale: " + ", ".join(bad) if bad else "the pictures in docs/ are up to date")
        return 1 if bad else 0
    TUI_SVG.write_text(tui_svg(), encoding="utf-8")
    print(f"wrote {TUI_SVG.relative_to(REPO)}")
    report_png(REPORT_PNG)
    print(f"wrote {REPORT_PNG.relative_to(REPO)} ({REPORT_PNG.stat().st_size / 1e3:.0f} KB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
