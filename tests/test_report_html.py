"""The HTML report (``tensordiff report A B -o report.html``): its PNG writer, the heatmap bins,
what the page says, and what a real headless Chromium renders of it (Debian's ``chromium``
package, installed by the setup script; no network).

Chromium is driven with ``--dump-dom`` on a copy of the report with a probe script appended (the
report itself has no script): after the page's load event the probe writes what the browser
decoded and laid out (the heatmap image's natural size, pixels read back from it through a
canvas, the verdict box's colour, the tables) into the DOM that Chromium then dumps.
"""

from __future__ import annotations

import dataclasses

import html
import json
import os
import re
import shutil
import struct
import subprocess
import zlib
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from tracegen import tokenizer_dir, write_trace

from tensordiff.diff import DiffOptions, diff_traces
from tensordiff.report.html import (
    FAIL_HI,
    FAIL_LO,
    OK_HI,
    OK_LO,
    heatmap_bins,
    heatmap_rgb,
    make_report,
    png_bytes,
    render_html,
)
from tensordiff.summary import SummaryReader

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def read_png(data: bytes) -> np.ndarray:
    """Decode an 8-bit RGB PNG with filter 0 rows (what png_bytes writes), checking every CRC."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, {}
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + n]
        (crc,) = struct.unpack(">I", data[pos + 8 + n:pos + 12 + n])
        assert crc == zlib.crc32(kind + body) & 0xFFFFFFFF, kind
        chunks.setdefault(kind, b"")
        chunks[kind] += body
        pos += 12 + n
    w, h, depth, color, _, _, interlace = struct.unpack(">IIBBBBB", chunks[b"IHDR"])
    assert (depth, color, interlace) == (8, 2, 0)
    raw = np.frombuffer(zlib.decompress(chunks[b"IDAT"]), np.uint8).reshape(h, 1 + 3 * w)
    assert (raw[:, 0] == 0).all()
    return raw[:, 1:].reshape(h, w, 3)


def test_png_round_trip():
    rng = np.random.default_rng(0)
    img = rng.integers(0, 256, (7, 13, 3), dtype=np.uint8)
    np.testing.assert_array_equal(read_png(png_bytes(img)), img)
    with pytest.raises(ValueError):
        png_bytes(np.zeros((2, 2, 4), np.uint8))


class _Col:
    def __init__(self, data):
        self.data = data

    def __getitem__(self, sl):
        return self.data[sl]


def _fake_summary(n: int, k: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    cols = []
    for j in range(k):
        v = np.zeros((n, 4), np.float32)
        v[:, 1] = rng.random(n) * 10.0 ** -rng.integers(1, 6, n)
        v[:, 3] = (rng.random(n) < 0.05 * j).astype(np.float32)        # some fail
        v[rng.random(n) < 0.02, 3] = 2                                  # some NaN/Inf
        v[rng.random(n) < 0.03] = np.nan                                # some absent
        cols.append(_Col(v))
    return SimpleNamespace(n=n, columns=cols)


def test_heatmap_bins_stream_and_keep_the_worst():
    s = _fake_summary(10_000, 4)
    e1, c1, l1 = heatmap_bins(s, [0, 1, 2, 3], max_rows=97, chunk_rows=64)
    e2, c2, l2 = heatmap_bins(s, [0, 1, 2, 3], max_rows=97, chunk_rows=1 << 20)
    np.testing.assert_array_equal(e1, e2)
    np.testing.assert_array_equal(c1, c2)
    np.testing.assert_array_equal(l1, l2)
    assert len(e1) == 98 and e1[0] == 0 and e1[-1] == 10_000
    # each bin holds the worst category and the largest error of its tokens
    for b in (0, 41, 96):
        for j in range(4):
            v = s.columns[j].data[e1[b]:e1[b + 1]]
            present = ~np.isnan(v[:, 3])
            want = -1 if not present.any() else max(2 if f == 2 else int(f) for f in v[present, 3])
            assert c1[b, j] == want
            if present.any():
                assert l1[b, j] == pytest.approx(np.log10(v[present, 1].max()))
    img = heatmap_rgb(c1, l1, cell_w=5)
    assert img.shape == (97, 20, 3) and (img[:, 4::5] == 255).all()


def _pair(tmp_path: Path, *, diverge: bool, model_path: str | None = None) -> tuple[str, str]:
    a, b = str(tmp_path / "train.h5"), str(tmp_path / "serve.h5")
    model = {"num_layers": 3, "hidden_size": 16, **({"path": model_path} if model_path else {})}
    write_trace(a, side="train", model=model)
    write_trace(b, side="serve", seed=1, noise=1e-6, model=model,
                packed_labels=("layer2", "layer3") if diverge else ("layer1", "layer2"))
    return a, b


def test_render_says_what_the_aligner_says(tmp_path):
    a, b = _pair(tmp_path, diverge=True)
    opts = DiffOptions(summary_path=str(tmp_path / "s.h5"))
    res = diff_traces(a, b, opts)
    s = SummaryReader(opts.summary_path)
    try:
        doc = render_html(res, s)
    finally:
        s.close()
    first = res.first_divergence
    assert first is not None
    assert f'<span id="headline">{html.escape(res.headline())}</span>' in doc
    assert "DIVERGENCE (exit 1)" in doc
    for f in res.findings:
        assert html.escape(f.message) in doc
    assert "serve score" in doc and "serve margin" in doc     # the slot table's columns are side B's
    assert "<script" not in doc and "http://" not in doc and "https://" not in doc
    m = re.search(r'src="data:image/png;base64,([^"]+)"', doc)
    img = read_png(__import__("base64").b64decode(m.group(1)))
    assert img.shape[0] == res.tokens_aligned                # one row per token (a small trace)


def test_html_escapes_labels(tmp_path):
    a, b = _pair(tmp_path, diverge=True)
    res = diff_traces(a, b)
    # findings are frozen: a sentence of its own is a new finding in the result's list
    res.findings[0] = dataclasses.replace(res.findings[0], text="<script>alert(1)</script> & more")
    doc = render_html(res, None)
    assert "<script>" not in doc and "&lt;script&gt;alert(1)&lt;/script&gt; &amp; more" in doc


def test_make_report_refuses_to_overwrite_an_input(tmp_path):
    from tensordiff.errors import UsageError

    a, b = _pair(tmp_path, diverge=False)
    with pytest.raises(UsageError, match="overwrite an input"):
        make_report(a, b, b)
    with pytest.raises(UsageError, match="no directory"):
        make_report(a, b, str(tmp_path / "nope" / "r.html"))


def test_token_text_from_the_recorded_model_directory(tmp_path):
    tok = tokenizer_dir(tmp_path / "model")
    a, b = _pair(tmp_path, diverge=True, model_path=tok)
    out = str(tmp_path / "r.html")
    res = make_report(a, b, out)
    doc = Path(out).read_text()
    w = res.worst_tokens[0]
    assert f"<code>&#x27;w{w['token']}&#x27;</code>" in doc
    assert "token text from" in doc and "tokenizer.json" in doc


# ----------------------------------------------------------------------------------------------
# a real browser
# ----------------------------------------------------------------------------------------------

PROBE = """<script>
window.addEventListener('load', () => {
  const img = document.getElementById('heatmap');
  const c = document.createElement('canvas');
  c.width = img.naturalWidth; c.height = img.naturalHeight;
  const ctx = c.getContext('2d');
  ctx.drawImage(img, 0, 0);
  const px = (x, y) => Array.from(ctx.getImageData(x, y, 1, 1).data.slice(0, 3));
  const cols = Array.from(document.querySelectorAll('.hm-cols span')).map(s => s.textContent);
  const out = {
    complete: img.complete, natural: [img.naturalWidth, img.naturalHeight],
    box: [img.getBoundingClientRect().width, img.getBoundingClientRect().height],
    cols: cols, pixels: cols.map((_, j) => px(j * %(cell)d + 2, 0)),
    verdict_bg: getComputedStyle(document.getElementById('verdict')).backgroundColor,
    headline: document.getElementById('headline').textContent,
    tables: Array.from(document.querySelectorAll('table')).map(t => t.rows.length),
  };
  const pre = document.createElement('pre'); pre.id = 'probe'; pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
});
</script>"""


def chromium(*args: str, timeout: float = 90) -> subprocess.CompletedProcess:
    assert CHROMIUM, "chromium is not installed (the setup script installs Debian's chromium package)"
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
           "--disable-extensions", "--hide-scrollbars", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False,
                          env=dict(os.environ, HOME=os.environ.get("TMPDIR", "/tmp")))


def test_chromium_renders_the_report(tmp_path):
    from tensordiff.report.html import CELL_W

    a, b = _pair(tmp_path, diverge=True)
    out = tmp_path / "report.html"
    res = make_report(a, b, str(out))
    doc = out.read_text()
    probe = tmp_path / "probe.html"
    probe.write_text(doc.replace("</body>", PROBE % {"cell": CELL_W} + "</body>"))
    p = chromium("--virtual-time-budget=10000", "--dump-dom", probe.as_uri())
    m = re.search(r'<pre id="probe">(.*?)</pre>', p.stdout, re.DOTALL)
    assert m, f"no probe output; chromium said: {p.stderr[-2000:]}"
    got = json.loads(m.group(1).replace("&quot;", '"').replace("&amp;", "&").replace("&lt;", "<").replace("&gt;", ">"))
    # the PNG decoded, at its size, and laid out
    n_cols = len(got["cols"])
    assert got["complete"] and got["natural"] == [n_cols * CELL_W, res.tokens_aligned]
    assert got["box"][0] == n_cols * CELL_W + 2 and got["box"][1] > 0     # + its 1 px border
    # the heatmap's colours are the aligner's: the wrong slots fail (orange..red), the rest pass (green)
    fail_cols = {f"draft_input[{r.slot}]" for r in res.slot_table if r.verdict != "ok"}
    assert fail_cols and set(got["cols"]) >= fail_cols
    for label, rgb in zip(got["cols"], got["pixels"]):
        lo, hi = (FAIL_LO, FAIL_HI) if label in fail_cols else (OK_LO, OK_HI)
        assert all(min(x, y) - 2 <= v <= max(x, y) + 2 for v, x, y in zip(rgb, lo, hi)), (label, rgb)
    assert got["headline"] == res.headline()
    assert got["verdict_bg"] == "rgb(255, 235, 233)"
    # findings, slots, tensors, worst tokens
    assert got["tables"][0] == 1 + len(res.findings) and got["tables"][1] == 1 + len(res.slot_table)
    # and a screenshot of the report itself is a real picture of it
    shot = tmp_path / "shot.png"
    p = chromium("--window-size=1000,1200", f"--screenshot={shot}", out.as_uri())
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", data[16:24]) == (1000, 1200)
    assert len(data) > 20_000, "a blank page compresses to almost nothing"


# ----------------------------------------------------------------------------------------------
# acceptance (a pair with draft predictions and verify steps, as tests/test_acceptance.py writes it)
# ----------------------------------------------------------------------------------------------

ACCEPT_PROBE = """<script>
window.addEventListener('load', () => {
  const rows = t => Array.from(document.querySelectorAll('#' + t + ' tbody tr')).map(r => ({
    cells: Array.from(r.cells).map(c => c.textContent),
    bar: (() => { const b = r.querySelector('.bar'); if (!b) return null; const s = b.firstElementChild;
                  const w = e => e.getBoundingClientRect().width;
                  return {frac: parseFloat(b.dataset.frac), shown: w(s) / w(b),
                          color: getComputedStyle(s).backgroundColor, visible: b.getBoundingClientRect().height > 0}; })(),
  }));
  const out = {
    title: (document.getElementById('acceptance-title') || {}).textContent,
    finding: (document.getElementById('acceptance-finding') || {}).textContent,
    length: (document.getElementById('accept-length') || {}).textContent,
    positions: rows('acceptance-positions'), regimes: rows('acceptance-regimes'),
    other: rows('acceptance-regimes-other'), cross: rows('acceptance-cross'),
  };
  const pre = document.createElement('pre'); pre.id = 'probe'; pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
});
</script>"""


@pytest.fixture
def acceptance_pair(tmp_path):
    from test_acceptance import STEPS, _write

    return _write(tmp_path / "train.h5", side="train"), _write(tmp_path / "serve.h5", side="serve", steps=STEPS)


def _probe(tmp_path: Path, doc: str, probe: str) -> dict:
    page = tmp_path / "probe.html"
    page.write_text(doc.replace("</body>", probe + "</body>"))
    p = chromium("--virtual-time-budget=10000", "--dump-dom", page.as_uri())
    m = re.search(r'<pre id="probe">(.*?)</pre>', p.stdout, re.DOTALL)
    assert m, f"no probe output; chromium said: {p.stderr[-2000:]}"
    return json.loads(html.unescape(m.group(1)))


def test_chromium_renders_the_acceptance_section(tmp_path, acceptance_pair):
    from tensordiff.findings import Kind

    out = tmp_path / "report.html"
    res = make_report(*acceptance_pair, str(out))
    f = next(x for x in res.findings if x.kind == Kind.ACCEPTANCE)
    d = f.details
    got = _probe(tmp_path, out.read_text(), ACCEPT_PROBE)
    assert got["title"] == "Acceptance" and f.message in got["finding"] and got["length"] == "1.75"
    # per draft position: steps reaching it, accepted, and a bar as long as the accepted share
    assert [r["cells"][:3] for r in got["positions"]] == [["0", "4", "2"], ["1", "2", "1"]]
    for r, p in zip(got["positions"], d.per_position):
        assert r["bar"]["visible"] and r["bar"]["frac"] == pytest.approx(p["rate"])
        assert r["bar"]["shown"] == pytest.approx(p["rate"], abs=0.01)
        assert r["cells"][3].endswith(f"{100 * p['rate']:.1f}%") and r["cells"][4] == f"{100 * p['top1']:.1f}%"
    assert got["positions"][0]["cells"][6] == "100.0%" and float(got["positions"][1]["cells"][7]) > 0.1
    # per regime, teacher-forced on serve (the draft disagrees: red bars) and on train
    assert [r["cells"][0] for r in got["regimes"]] == list(d.teacher)
    for r, e in zip(got["regimes"], d.teacher.values()):
        assert r["cells"][1] == str(e["rows"]) and r["bar"]["frac"] == pytest.approx(e["top1"])
        assert r["bar"]["color"] == "rgb(207, 34, 46)"
    assert [r["cells"][0] for r in got["other"]] == list(d.teacher_other)
    # A against B
    assert {r["cells"][0]: r["cells"][2] for r in got["cross"]} == {n: f"{100 * c['top1']:.1f}%" for n, c in d.cross.items()}


def test_no_acceptance_section_without_predictions(tmp_path):
    a, b = _pair(tmp_path, diverge=True)
    doc = render_html(diff_traces(a, b), None)
    assert 'id="acceptance"' not in doc and "<h2 id=\"acceptance-title\">" not in doc
