"""A screenshot of the TUI as PNG: the app saves SVG (Textual's export), converted here."""

from __future__ import annotations

import os
import shutil
import tempfile

from ..errors import UsageError


def svg_to_png(svg: str, out: str) -> None:
    """Rasterise an SVG screenshot with rsvg-convert, else headless chromium; a UsageError when
    neither is installed or the conversion fails."""
    import re
    import subprocess

    m = re.search(r'viewBox="0 0 ([0-9.]+) ([0-9.]+)"', svg)
    w, h = (int(float(m.group(1)) + 0.5), int(float(m.group(2)) + 0.5)) if m else (1400, 900)
    with tempfile.TemporaryDirectory(prefix="tensordiff-shot-") as d:
        src = os.path.join(d, "screen.svg")
        with open(src, "w", encoding="utf-8") as fh:
            fh.write(svg)
        if shutil.which("rsvg-convert"):
            cmd = ["rsvg-convert", "-o", out, src]
        elif exe := shutil.which("chromium") or shutil.which("chromium-browser"):
            cmd = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--hide-scrollbars",
                   f"--window-size={w},{h}", f"--screenshot={os.path.abspath(out)}", "file://" + src]
        else:
            raise UsageError(f"{out}: a PNG needs rsvg-convert (librsvg2-bin) or chromium; save as .svg instead")
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False, cwd=d,
                           env=dict(os.environ, HOME=d))
        if p.returncode != 0 or not os.path.isfile(out):
            tail = " ".join((p.stderr or "").split())[-200:]
            raise UsageError(f"could not convert the screenshot to {out} ({cmd[0]} exit {p.returncode}: {tail})")
