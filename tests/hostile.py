"""A generator of hostile inputs: small files crafted to exhaust memory, hang the CLI, inject
terminal escapes or break the reader in ways plain corruption (tests/test_fuzz.py) does not reach.
One function per class (docs/robustness.md, "Hostile inputs"); each writes its file from a valid
trace in well under a second. Not a test module: tests/test_hostile.py uses it.

Also :func:`peak_rss`, which runs one CLI command in a fresh interpreter and returns its exit
code, output and peak resident memory (the command's process and its probe child).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import h5py
import numpy as np

from tensordiff.trace import SlotSpec, TraceWriter
from tracegen import write_trace

import tensordiff

# the code under test (the checkout on sys.path), for the fresh interpreters of peak_rss
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(tensordiff.__file__)))
TESTS = os.path.dirname(os.path.abspath(__file__))


def base(path: str, **kw) -> str:
    write_trace(path, **kw)
    return path


# -- memory ------------------------------------------------------------------------------------


def shared_heap_sequences(path: str, entries: int = 20000, string_bytes: int = 100_000) -> str:
    """/sequences of ``entries`` keys that all point at one ``string_bytes`` heap string: a file of
    a few hundred KB whose keys decode to entries x string_bytes."""
    base(path)
    with h5py.File(path, "r+") as f:
        keys = [s.decode() if isinstance(s, bytes) else s for s in f["sequences"][()]]
        del f["sequences"]
        vals = keys + ["x" * string_bytes] + ["y"] * (entries - len(keys) - 1)
        ds = f.create_dataset("sequences", data=np.array(vals, dtype=object), dtype=h5py.string_dtype("utf-8"),
                              maxshape=(None,), chunks=(1024,))
        desc = np.dtype([("len", "<u4"), ("addr", "V8"), ("idx", "<u4")])
        _, raw0 = ds.id.read_direct_chunk((0,))
        big = np.frombuffer(raw0, desc)[len(keys)].copy()
        for start in range(0, entries, 1024):
            _, raw = ds.id.read_direct_chunk((start,))
            arr = np.frombuffer(raw, desc).copy()
            lo = len(keys) + 1 if start == 0 else 0
            arr[lo:] = big
            ds.id.write_direct_chunk((start,), arr.tobytes())
    return path


def _pad(f: h5py.File, nbytes: int) -> None:
    """Incompressible bytes that make the file big enough for a ratio-based check to let its
    claims through (what an older reader allowed: 1000x the file's size when compressed)."""
    f.create_dataset("padding", data=np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8))


def compressed_rows(path: str, rows: int = 8_000_000, tensors: int = 8, linked: bool = True) -> str:
    """``tensors`` tensors whose rows index is compressed, never written (it reads as zeros: every
    row points at token row 0) and claims ``rows`` rows; their sketches (1 wide) claim as many,
    with a few chunks of noise stored so that they pass a check against the bytes stored for
    them. ``linked``: every tensor's datasets are hard links to the first one's."""
    with TraceWriter(path, model={"hidden_size": 16, "num_layers": tensors}, sketch_dim=1) as w:
        for b in range(tensors):
            w.define_tensor(f"layer{b}", 16, kind="boundary", boundary=b, values=False)
        r = w.add_tokens("s", [0], [1], "train")
        for b in range(tensors):
            w.append(f"layer{b}", r, sketch=np.ones((1, 1), np.float32), rms=np.ones(1, np.float32))
    noise = np.random.default_rng(0).standard_normal((2 << 14, 1)).astype(np.float32)
    with h5py.File(path, "r+") as f:
        _pad(f, 4 << 20)
        g0 = f["tensors/layer0"]
        for b in range(tensors):
            g = f[f"tensors/layer{b}"]
            for part in ("rows", "sketch", "rms"):
                del g[part]
            if linked and b:
                g["rows"], g["sketch"] = g0["rows"], g0["sketch"]
            else:
                g.create_dataset("rows", shape=(rows,), chunks=(1 << 16,), dtype="<i8", compression="gzip")
                sk = g.create_dataset("sketch", shape=(rows, 1), chunks=(1 << 14, 1), dtype="<f4", compression="gzip")
                sk[:len(noise)] = noise
            g.attrs["flushed_rows"] = np.int64(rows)
    return path


def compressed_refs(path: str, rows: int = 16_000_000, tensors: int = 3) -> str:
    """``tensors`` tensors taking values by reference (values_source), each with a rows index and a
    values_ref column compressed and never written (zeros: every row refers to row 0 of the
    source), claiming ``rows`` rows, and an RMS that passes the check against its stored bytes:
    each values_ref is a table loaded at open like the rows index, within the same cap."""
    with TraceWriter(path, model={"hidden_size": 16, "num_layers": 1}, sketch_dim=1) as w:
        w.define_tensor("src", 16, sketch=False)
        for b in range(tensors):
            w.define_tensor(f"ref{b}", 16, sketch=False, values_source="src")
        r = w.add_tokens("s", [0], [1], "train")
        w.append("src", r, np.ones((1, 16), np.float32))
        for b in range(tensors):
            w.append(f"ref{b}", r, None, values_ref=[0], rms=np.ones(1, np.float32))
    noise = np.random.default_rng(0).standard_normal((2 << 14, 1)).astype(np.float32)
    with h5py.File(path, "r+") as f:
        _pad(f, 4 << 20)
        for b in range(tensors):
            g = f[f"tensors/ref{b}"]
            for part in ("rows", "values_ref", "rms"):
                del g[part]
            g.create_dataset("rows", shape=(rows,), chunks=(1 << 16,), dtype="<i8", compression="gzip")
            g.create_dataset("values_ref", shape=(rows,), chunks=(1 << 16,), dtype="<i8", compression="gzip")
            rms = g.create_dataset("rms", shape=(rows, 1), chunks=(1 << 14, 1), dtype="<f4", compression="gzip")
            rms[:len(noise)] = noise
            g.attrs["flushed_rows"] = np.int64(rows)
    return path


def compressed_token_table(path: str, rows: int = 12_000_000) -> str:
    """A /tokens table compressed and never written, claiming ``rows`` rows (zeros: valid rows)."""
    base(path)
    with h5py.File(path, "r+") as f:
        old = f["tokens"][()]
        dt = old.dtype
        del f["tokens"]
        ds = f.create_dataset("tokens", shape=(rows,), maxshape=(None,), chunks=(1 << 15,), dtype=dt,
                              compression="gzip")
        ds[:len(old)] = old
        ds.attrs["regimes"] = json.dumps(["train", "prefill", "decode", "target_verify", "draft_extend", "other"])
        _pad(f, 1 << 20)
        f.attrs["flushed_tokens"] = np.int64(rows)
    return path


def gzip_bomb(path: str, mib: int = 512) -> str:
    """A .ckpt.gz of ``mib`` MiB of zeros (about mib KB on disk): not a torch file at all."""
    import zlib

    comp = zlib.compressobj(1, zlib.DEFLATED, 31)
    block = bytes(1 << 20)
    with open(path, "wb") as fh:
        for _ in range(mib):
            fh.write(comp.compress(block))
        fh.write(comp.flush())
    return path


# -- hangs -------------------------------------------------------------------------------------


def looping_heap(path: str) -> str:
    """A zeroed object header in the global heap: HDF5's string read loops forever on it."""
    base(path)
    data = bytearray(open(path, "rb").read())
    g = data.find(b"GCOL")
    first = g + 16
    size = int.from_bytes(data[first + 8:first + 16], "little")
    second = first + 16 + (size + 7) // 8 * 8
    data[second:second + 16] = bytes(16)
    with open(path, "wb") as fh:
        fh.write(bytes(data))
    return path


def many_tensors(path: str, tensors: int = 1500) -> str:
    """A valid trace with many small tensors (slow to open, not damaged)."""
    with TraceWriter(path, model={"hidden_size": 4, "num_layers": tensors}, sketch_dim=4) as w:
        for b in range(tensors):
            w.define_tensor(f"layer{b}", 4, kind="boundary", boundary=b, sketch=False)
        r = w.add_tokens("s", [0, 1], [1, 2], "train")
        for b in range(tensors):
            w.append(f"layer{b}", r, np.ones((2, 4), np.float32))
    return path


# -- strings -----------------------------------------------------------------------------------

ESCAPES = "\x1b[2K\r\x1b[1Averdict: AGREE\x1b]52;c;Y3VybCBldmlsIHwgc2g=\x07\u202e"


def escape_strings(path: str, side: str = "train", noise: float = 0.0) -> str:
    """A valid trace whose sequence keys, producer, convention, role and metadata hold terminal
    escapes: erase the line, move up, OSC 52 (set the clipboard), a right-to-left override."""
    rng = np.random.default_rng(0)
    base_rng = np.random.default_rng(1234)
    with TraceWriter(path, side=side, producer="evil" + ESCAPES, model={"num_layers": 2, "hidden_size": 8},
                     meta={"note" + ESCAPES: "v" + ESCAPES}, sketch_dim=8) as w:
        w.define_tensor("embed", 8, kind="boundary", boundary=0, role="catalog" + ESCAPES)
        w.define_tensor("draft_input", 16, kind="packed", slots=SlotSpec(["embed", "layer1"], raw_ids=[0, 1],
                        convention="conv" + ESCAPES), slot_width=8, role="draft_input")
        for s in range(2):
            ids = base_rng.integers(1, 500, 6)
            rows = w.add_tokens(f"req{s}{ESCAPES}\nverdict: AGREE", np.arange(6), ids, "train")
            x = base_rng.standard_normal((6, 8)).astype(np.float32)
            w.append("embed", rows, x + noise * rng.standard_normal(x.shape).astype(np.float32))
            w.append("draft_input", rows, np.concatenate([x, x], axis=1))
    return path


# -- structure ---------------------------------------------------------------------------------


def negative_regime(path: str) -> str:
    """A token table in another tool's layout (int8 regime) holding regime -1."""
    base(path)
    with h5py.File(path, "r+") as f:
        old = f["tokens"][()]
        dt = np.dtype([("seq", "<i4"), ("position", "<i8"), ("token", "<i8"), ("regime", "i1"), ("step", "<i4")])
        new = np.zeros(len(old), dt)
        for c in dt.names:
            new[c] = old[c]
        new["regime"][0] = -1
        del f["tokens"]
        f.create_dataset("tokens", data=new, maxshape=(None,), chunks=(2048,))
    return path


def slot_label(path: str, label: str) -> str:
    """A valid trace (side serve, a little noise, so the diff fits a noise model) whose draft
    input's second slot is labelled ``label`` (a layer number past any model's depth)."""
    base(path, side="serve", noise=1e-3)
    with h5py.File(path, "r+") as f:
        f["tensors/draft_input"].attrs["slot_labels"] = json.dumps(["layer1", label])
    return path


def model_attr(path: str, model: str) -> str:
    """A valid trace whose ``model`` attribute is the JSON text ``model``."""
    base(path)
    with h5py.File(path, "r+") as f:
        f.attrs["model"] = model
    return path


# -- JSON a user hands us --------------------------------------------------------------------


def deep_json(depth: int = 100_000) -> bytes:
    """A JSON array nested ``depth`` deep (Python's reader recurses once per level)."""
    return b"[" * depth + b"]" * depth


def safetensors_file(path: str, header: bytes, data: bytes = b"") -> str:
    """A safetensors file: the header's length (8 bytes, little-endian), the header, the data."""
    with open(path, "wb") as f:
        f.write(len(header).to_bytes(8, "little") + header + data)
    return path


def safetensors_ok(path: str) -> str:
    """A valid one-parameter safetensors file (no torch needed)."""
    h = json.dumps({"model.norm.weight": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode()
    return safetensors_file(path, h, np.ones(1, np.float32).tobytes())


# -- measuring ---------------------------------------------------------------------------------

_RUN = """
import json, resource, sys
from tensordiff.cli import main
rc = main(sys.argv[1:])
# VmHWM, not ru_maxrss: Linux carries ru_maxrss over an exec, so it would report the test process
self_kb = next(int(x.split()[1]) for x in open("/proc/self/status") if x.startswith("VmHWM:"))
child_kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
sys.stdout.flush()
sys.stderr.write("\\nRSS " + json.dumps({"rc": rc, "self_kb": self_kb, "child_kb": child_kb}) + "\\n")
"""


def peak_rss(argv: list[str], *, pythonpath: str = ROOT, env: dict | None = None, timeout: float = 180,
             preload: str = "") -> tuple[int, str, str, int]:
    """Run ``tensordiff ARGV`` in a fresh interpreter: (exit code, stdout, stderr without the
    measurement line, peak RSS in MiB of the process and its probe child, whichever is larger).
    ``preload``: statements run first (to measure against a baseline with the same imports)."""
    e = dict(os.environ, PYTHONPATH=pythonpath, COLUMNS="120", **(env or {}))
    e.pop("TENSORDIFF_DEBUG", None)
    p = subprocess.run([sys.executable, "-c", preload + "\n" + _RUN, *argv], capture_output=True, text=True,
                       timeout=timeout, env=e)
    lines = p.stderr.splitlines()
    meas = [x for x in lines if x.startswith("RSS ")]
    if not meas:
        return p.returncode, p.stdout, p.stderr, -1
    m = json.loads(meas[-1][4:])
    err = "\n".join(x for x in lines if not x.startswith("RSS ")).strip()
    return int(m["rc"]), p.stdout, err, max(m["self_kb"], m["child_kb"]) // 1024


# -- importers (torch needed to write these) ---------------------------------------------------


def sglang_dump(d: str, tensors: dict, rids=("req-a",), tokens: int = 4) -> str:
    """An SGLang dumper directory of one step: the core fields plus ``tensors`` {file name tag
    'name' value: tensor or (extra tags, tensor)}, written with torch.save."""
    import torch

    os.makedirs(d, exist_ok=True)
    i = 0

    def dump(name, value, **tags):
        nonlocal i
        i += 1
        fname = "___".join(f"{k}={v}" for k, v in dict(step=0, rank=0, dump_index=i, name=name,
                                                         recompute_status="disabled", **tags).items()) + ".pt"
        torch.save({"value": value, "meta": {"name": name}}, os.path.join(d, fname))
        return fname

    dump("input_ids", torch.arange(1, tokens + 1))
    dump("positions", torch.arange(tokens))
    dump("seq_lens", torch.tensor([tokens]))
    dump("rids", list(rids))
    for name, value in tensors.items():
        dump(name, value)
    return d
