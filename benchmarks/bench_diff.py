"""Diff throughput: tensordiff vs a plain h5py read vs SGLang's own comparator, in one run.

Writes the same seeded tensors twice: as a pair of tensordiff traces (HDF5) and through SGLang's
real dumper (``sglang.srt.debug_utils.dumper``, one ``.pt`` per tensor) into baseline/target
dirs. Default shape as in docs/benchmarks.md: 32 layers x 2048 tokens x 4096 bf16 per side
(0.54 GB per side, 1.07 GB both), a residual stream ``x[b+1] = x[b] + delta`` with per-token and
per-channel scales; side B = side A with 1-ulp bf16 differences in 1/4 of the elements (honest
kernel noise, inside every tolerance) and one layer (20) corrupted with noise of half the
token RMS (rel err ~0.5, far above the bf16 tolerance).

Then one untimed warm-up pass of each, and ``--repeat`` timed rounds, each running every task
once in a fresh random order (seeded by ``--seed``); medians:

0. ``readinto``: both trace files read whole, in one thread, ``readinto`` a reused 1 MiB buffer
   (the page-cache read rate: the limit of a diff that reads every byte once; timed in a fresh
   process, start-up excluded);
1. ``h5py read``: every dataset of both traces read with plain h5py into reused buffers
   (the baseline; timed inside a fresh process, so start-up is excluded, and end to end);
2. ``plain script``: a ten-line h5py + numpy script (:data:`PLAIN_SCRIPT`) that reads each
   layer of both traces whole and prints its per-token cosine (min) and max abs error, end to
   end in a fresh process (the baseline of the CLI);
3. ``tensordiff CLI``: ``python -m tensordiff diff A B --json -q --backend serial`` end to end,
   with ``TENSORDIFF_TIMINGS=1`` (the CLI prints the time of its probe on stderr);
4. ``tensordiff in-process``: ``diff_traces(A, B)`` timed inside a process that has already
   imported tensordiff (separates import/start-up time);
5. ``numeric pass alone``: tensordiff's per-row sums over every tensor's mapped values on the
   diff's lanes, nothing else (:func:`numeric_pass`; timed in a fresh process after opening): its
   ratio to ``readinto`` is the ceiling of the in-process diff's on this CPU;
6. ``SGLang comparator``: ``python -m sglang.srt.debug_utils.comparator --preset raw
   --baseline-path .. --target-path .. --report-path ''`` end to end (CPU).

For each: wall time, MB/s over the tensor bytes of both sides (1 MB = 1e6 bytes), peak RSS of
its process (``os.wait4`` ru_maxrss), exit code, and whether its output names the corrupted layer.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_diff.py [--layers 32] [--tokens 2048]
        [--hidden 4096] [--repeat 3] [--corrupt 20] [--seed 0] [--dir /tmp] [--keep] [--no-comparator]
        [--json FILE] [--bytecode]

``--bytecode``: every task (baselines too) imports bytecode compiled once in the warm-up round,
under the data dir (``PYTHONPYCACHEPREFIX``). Without it the environment decides: scripts/setup.sh
compiles tensordiff's modules as pip does for a regular install, and the baselines' numpy and
h5py come compiled from site-packages; a module edited since (or a checkout never set up) is
compiled from its source on every run where ``PYTHONDONTWRITEBYTECODE=1`` (this machine). The
output's ``bytecode:`` line says which was measured.

``--json FILE`` writes the figures of benchmarks/benchjson.py's bench_diff entry:
``inproc_vs_readinto`` (readinto s / in-process diff s, both without start-up; ``readinto_gb_s``
the rate of the files' bytes), ``inproc_vs_read`` (h5py read s / in-process diff s), ``cli_vs_script``
(plain script s / CLI s, both end to end), ``numeric_vs_readinto`` (readinto s / the numeric pass
alone s: the in-process ratio's ceiling here; ``numeric_s``, ``numeric_lanes``), ``probe_share`` (the CLI's probe s / its wall s),
``rss_mb`` (the CLI's peak RSS, its worker included), ``names_corrupt`` (CLI and in-process exit
1 and name the corrupted layer first), and the medians in seconds.

Exit status 0 when it measured (the check line says whether tensordiff named the corrupted
layer), 2 when the data could not be prepared or a baseline could not run (a missing
dependency is never skipped silently). Runtime of the default: 4-6 minutes on 2 cores (the
comparator is most of it).

The comparator needs ``polars`` (and torch + sglang): without them the benchmark stops with exit 2
and says so, unless ``--no-comparator`` is given (then the table says it was left out, and no
dumper files are written).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _p in (REPO, os.path.dirname(os.path.abspath(__file__))):
    if _p not in sys.path:
        sys.path.insert(0, _p)

SEQ_KEY = "req-0"
#: the CLI's baseline: what a user writes without tensordiff (rows known to line up)
PLAIN_SCRIPT = """\
import sys, h5py, numpy as np
fa, fb = h5py.File(sys.argv[1], "r"), h5py.File(sys.argv[2], "r")
for name in fa["tensors"]:
    a, b = (f["tensors"][name]["values"][()].astype(np.uint32) << 16 for f in (fa, fb))
    a, b = a.view(np.float32), b.view(np.float32)
    cos = np.einsum("th,th->t", a, b) / np.sqrt(np.einsum("th,th->t", a, a) * np.einsum("th,th->t", b, b))
    print(name, "cos min", cos.min(), "max abs", np.abs(a - b).max())
"""
DUMP_NAME = "hidden_states"
RESULT_TAG = "BENCH_RESULT "
PROBE_LINE = re.compile(r"tensordiff: timing: probe ([0-9.]+) s")
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


# ----------------------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------------------


def layer_stream(layers: int, tokens: int, hidden: int, corrupt: int, seed: int = 0):
    """Yield ``(b, bits_a, bits_b)`` per layer: uint16 bf16 bits [tokens, hidden] of each side.

    One layer's worth of float32 state is kept (memory stays at a few layer-sized buffers)."""
    from tensordiff.dtypes import f32_to_bf16_bits

    rng = np.random.default_rng(seed)
    tok_scale = rng.lognormal(0.0, 0.3, size=(tokens, 1)).astype(np.float32)
    ch_scale = np.ones((1, hidden), np.float32)
    ch_scale[0, rng.choice(hidden, size=min(4, hidden), replace=False)] = 8.0  # a few outlier channels
    scale = tok_scale * ch_scale                                   # [T, H], reused every layer
    x = rng.standard_normal((tokens, hidden), dtype=np.float32)
    x *= scale
    delta = np.empty_like(x)
    for b in range(layers):
        if b:
            rng.standard_normal(out=delta, dtype=np.float32)
            delta *= scale
            delta *= np.float32(0.3)
            x += delta                                             # residual update
        bits_a = f32_to_bf16_bits(x)
        if b == corrupt:
            rms = np.sqrt(np.einsum("th,th->t", x, x) / hidden)[:, None].astype(np.float32)
            rng.standard_normal(out=delta, dtype=np.float32)
            delta *= rms
            delta *= np.float32(0.5)
            delta += x
            bits_b = f32_to_bf16_bits(delta)
        else:
            # honest kernel noise: +-1 ulp in 1/8 of the elements each way, zeros left alone
            r = np.frombuffer(rng.bytes(bits_a.size), np.uint8).reshape(bits_a.shape)
            step = (r < 32).view(np.int8) - (r >= 224).view(np.int8)
            step[(bits_a & 0x7FFF) == 0] = 0
            bits_b = bits_a + step.astype(np.int16).view(np.uint16)
        yield b, bits_a, bits_b


def prepare(cfg: dict) -> dict:
    """Write both traces and both dumper dirs from one pass over the generated layers."""
    from tensordiff.trace import TraceWriter

    d, L, T, H, c = cfg["dir"], cfg["layers"], cfg["tokens"], cfg["hidden"], cfg["corrupt"]
    out = {"trace_a": os.path.join(d, "a.h5"), "trace_b": os.path.join(d, "b.h5"),
           "dump_base": os.path.join(d, "dump", "baseline"), "dump_target": os.path.join(d, "dump", "target")}
    dump_mode, dumpers, torch = "skipped (no torch)", None, None
    try:
        if not cfg.get("dumps", True):
            dump_mode = "skipped (--no-comparator)"
            raise ImportError
        import torch  # noqa: F811
        try:
            from sglang.srt.debug_utils.dumper import DumperConfig, _Dumper

            # one dumper per side, exactly as two runs would configure it (env DUMPER_* is the
            # other route); console logging off: it prints sample values of every tensor
            dumpers = [_Dumper(config=DumperConfig(enable=True, dir=os.path.join(d, "dump"), exp_name=name,
                                                   enable_output_console=False))
                       for name in ("baseline", "target")]
            dump_mode = "sglang dumper"
        except Exception as e:  # noqa: BLE001 - fall back to writing its format by hand
            dump_mode = f"hand-written dumper format ({type(e).__name__}: {str(e)[:120]})"
            for p in (out["dump_base"], out["dump_target"]):
                os.makedirs(p, exist_ok=True)
    except ImportError:
        pass
    rng = np.random.default_rng(1)
    token_ids = rng.integers(3, 32000, size=T)
    token_ids[0] = 1  # BOS
    t0 = time.perf_counter()
    model = {"num_layers": L, "hidden_size": H}
    with TraceWriter(out["trace_a"], side="train", producer="bench_diff", model=model) as wa, \
            TraceWriter(out["trace_b"], side="serve", producer="bench_diff", model=model) as wb:
        rows = []
        for w, regime in ((wa, "train"), (wb, "prefill")):
            for b in range(L):
                w.define_tensor(f"layer{b}", H, kind="boundary", boundary=b, dtype="bfloat16", role="catalog",
                                sketch=False)
            rows.append(w.add_tokens(SEQ_KEY, np.arange(T), token_ids, regime))
        for b, bits_a, bits_b in layer_stream(L, T, H, c, cfg["seed"]):
            wa.append(f"layer{b}", rows[0], bits_a)
            wb.append(f"layer{b}", rows[1], bits_b)
            if torch is not None:
                for side, bits in enumerate((bits_a, bits_b)):
                    value = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16)
                    if dumpers is not None:
                        dumpers[side].dump(DUMP_NAME, value, layer_id=b)
                    else:  # the dumper's file format: tags key=value joined by ___, {"value", "meta"}
                        meta = {"step": 0, "rank": 0, "dump_index": b + 1, "name": DUMP_NAME,
                                "recompute_status": "disabled", "layer_id": b}
                        fn = "___".join(f"{k}={v}" for k, v in meta.items()) + ".pt"
                        path = os.path.join(out["dump_base"] if side == 0 else out["dump_target"], fn)
                        torch.save({"value": value, "meta": {**meta, "world_rank": 0, "world_size": 1}}, path)
    out["prepare_s"] = time.perf_counter() - t0
    out["dump_mode"] = dump_mode
    out["payload_bytes"] = 2 * L * T * H * 2
    sizes = {"trace": 0, "dump": 0}
    for p in (out["trace_a"], out["trace_b"]):
        sizes["trace"] += os.path.getsize(p)
    for root in (out["dump_base"], out["dump_target"]):
        if os.path.isdir(root):
            sizes["dump"] += sum(os.path.getsize(os.path.join(root, f)) for f in os.listdir(root))
    out["file_bytes"] = sizes
    return out


# ----------------------------------------------------------------------------------------------
# Workers (run in a fresh process; print one result line)
# ----------------------------------------------------------------------------------------------


def h5_read(paths: list[str]) -> dict:
    """Plain h5py: every dataset's bytes, large ones into reused preallocated buffers."""
    import h5py

    bufs: dict = {}
    n = 0
    t0 = time.perf_counter()
    for p in paths:
        with h5py.File(p, "r") as f:  # h5py defaults (HDF5 2.0: 8 MiB chunk cache per open dataset)
            names: list[str] = []

            def visit(name, obj, names=names):
                if isinstance(obj, h5py.Dataset):
                    names.append(name)

            f.visititems(visit)
            for name in names:  # one dataset open at a time, as a plain script would
                ds = f[name]
                if ds.dtype.kind == "O" or ds.nbytes < (1 << 20):
                    arr = ds[()]
                else:
                    key = (ds.shape, ds.dtype.str)
                    arr = bufs.get(key)
                    if arr is None:
                        arr = bufs[key] = np.empty(ds.shape, ds.dtype)
                    ds.read_direct(arr)
                n += ds.nbytes
    return {"seconds": time.perf_counter() - t0, "bytes": n}


READINTO_BYTES = 1 << 20   # the fastest of 1, 4 and 16 MiB on this machine (16 MiB spills the L2 cache)


def readinto(paths: list[str]) -> dict:
    """The page-cache read rate: both files, whole, in one thread, ``readinto`` a reused buffer
    (unbuffered: nothing copied twice). What the kernel hands a reader of these files, the
    physical limit of any diff of them that reads every byte once."""
    buf = bytearray(READINTO_BYTES)
    view = memoryview(buf)
    n = 0
    t0 = time.perf_counter()
    for p in paths:
        with open(p, "rb", buffering=0) as fh:
            while True:
                got = fh.readinto(view)
                n += got or 0
                if not got or got < len(buf):
                    break
    return {"seconds": time.perf_counter() - t0, "bytes": n}


def numeric_pass(paths: list[str]) -> dict:
    """The diff's numeric pass alone: tensordiff's own per-row sums (:class:`BlockMetrics`, the
    compiled kernel and its finish) over every tensor's values of both traces, mapped in place
    (one mapping per tensor; the diff maps and measures block by block), on as many threads as the
    diff's lanes. Opening, aligning, the identity search, the judge and the per-block costs are
    left out, so ``readinto s / this`` is the most the in-process diff's ratio to the page-cache
    rate can reach on this CPU. ``elements``: the pairs of elements compared."""
    from concurrent.futures import ThreadPoolExecutor

    from tensordiff.diff.stream import compute_lanes
    from tensordiff.numerics import BlockMetrics
    from tensordiff.traceset.reader import open_trace

    ra, rb = open_trace(paths[0]), open_trace(paths[1])
    lanes = compute_lanes()
    pool = ThreadPoolExecutor(lanes - 1) if lanes > 1 else None
    try:
        pairs = []
        for name in sorted(set(ra.tensors) & set(rb.tensors)):
            ia, ib = ra.tensors[name], rb.tensors[name]
            idx = np.arange(min(ia.rows, ib.rows), dtype=np.int64)
            xa, xb = ra.map_rows(name, "values", idx), rb.map_rows(name, "values", idx)
            if xa is None or xb is None:
                raise SystemExit(f"the values of {name} cannot be mapped in place")
            pairs.append((ia, xa, ib, xb))
        t0 = time.perf_counter()
        measured = 0
        for ia, xa, ib, xb in pairs:
            m = BlockMetrics(ia.slot_count, ia.slot_width, pool=pool, lanes=lanes).compute_stored(xa, ia.dtype, xb, ib.dtype)
            measured += m.cos.size * ia.slot_width
        secs = time.perf_counter() - t0
    finally:
        if pool is not None:
            pool.shutdown()
        ra.close()
        rb.close()
    return {"seconds": secs, "lanes": lanes, "elements": measured}


def inproc_diff(paths: list[str]) -> dict:
    from tensordiff.diff import diff_traces
    from tensordiff.cli import jsonable

    t0 = time.perf_counter()
    res = diff_traces(paths[0], paths[1])
    d = jsonable(res.to_dict())
    secs = time.perf_counter() - t0
    fd = d.get("first_divergence") or {}
    return {"seconds": secs, "exit_code": res.exit_code, "first_tensor": fd.get("tensor"), "headline": d["headline"]}


def worker_main(kind: str, cfg_json: str) -> None:
    cfg = json.loads(cfg_json)
    fn = {"prepare": prepare, "h5read": lambda c: h5_read(c["paths"]), "readinto": lambda c: readinto(c["paths"]),
          "inproc": lambda c: inproc_diff(c["paths"]), "numeric": lambda c: numeric_pass(c["paths"])}[kind]
    res = fn(cfg)
    sys.stdout.write(RESULT_TAG + json.dumps(res) + "\n")


# ----------------------------------------------------------------------------------------------
# Runner
# ----------------------------------------------------------------------------------------------


def run_proc(cmd: list[str], env: dict, cwd: str, log_base: str, timeout: float = 900.0) -> dict:
    """Run a command; wall time, exit code and peak RSS (ru_maxrss of the process, via wait4)."""
    with open(log_base + ".out", "wb") as fo, open(log_base + ".err", "wb") as fe:
        t0 = time.perf_counter()
        p = subprocess.Popen(cmd, stdout=fo, stderr=fe, env=env, cwd=cwd)
        timer = threading.Timer(timeout, p.kill)
        timer.start()
        try:
            _, status, ru = os.wait4(p.pid, 0)
        finally:
            timer.cancel()
        wall = time.perf_counter() - t0
        p.returncode = os.waitstatus_to_exitcode(status)
    with open(log_base + ".out", "rb") as fh:
        out = fh.read().decode("utf-8", "replace")
    with open(log_base + ".err", "rb") as fh:
        err = fh.read().decode("utf-8", "replace")
    res = {"wall": wall, "rc": p.returncode, "rss": ru.ru_maxrss * 1024, "stdout": out, "stderr": err}
    for line in out.splitlines()[::-1]:
        if line.startswith(RESULT_TAG):
            res["result"] = json.loads(line[len(RESULT_TAG):])
            break
    return res


def _proc_loadavg() -> str:
    try:
        with open("/proc/loadavg") as fh:
            return fh.read().strip()
    except OSError:
        return "?"


def set_cache(mode: str, paths: list[str]) -> None:
    """Put the traces' pages in the page cache (warm: every byte read once) or out of it (cold:
    written back, then dropped with POSIX_FADV_DONTNEED); as-is: leave them."""
    if mode == "as-is":
        return
    buf = bytearray(16 << 20) if mode == "warm" else None
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            if buf is not None:
                view = memoryview(buf)
                while os.readv(fd, [view]) == len(buf):
                    pass
            else:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _bytecode_state() -> str:
    """Whether the CLI finds tensordiff's modules compiled (scripts/setup.sh writes their bytecode,
    as pip does for a regular install) or compiles their sources on every run."""
    import importlib.util

    pkg = os.path.join(REPO, "tensordiff")
    mods = [os.path.join(d, f) for d, _, fs in os.walk(pkg) for f in fs if f.endswith(".py")]
    fresh = 0
    for m in mods:
        pyc = importlib.util.cache_from_source(m)
        if os.path.exists(pyc) and os.path.getmtime(pyc) >= os.path.getmtime(m):
            fresh += 1
    if fresh == len(mods):
        return "tensordiff's modules compiled (by scripts/setup.sh, or a run that wrote them)"
    if os.environ.get("PYTHONDONTWRITEBYTECODE"):
        return (f"{len(mods) - fresh} of {len(mods)} tensordiff modules without fresh bytecode and "
                "PYTHONDONTWRITEBYTECODE=1: those compiled from source on every run")
    return f"{len(mods) - fresh} of {len(mods)} tensordiff modules compiled on the first run (then cached)"


def names_layer_text(text: str, layer: int) -> bool:
    text = ANSI.sub("", text)
    return re.search(rf"layer(?:_id)?\W{{0,4}}{layer}\b", text) is not None


def main() -> int:
    if len(sys.argv) >= 4 and sys.argv[1] == "--_worker":
        worker_main(sys.argv[2], sys.argv[3])
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--corrupt", type=int, default=None, help="corrupted layer on side B (default 20, or layers*5//8)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dir", default="/tmp", help="parent of the temporary data dir")
    ap.add_argument("--keep", action="store_true", help="keep the data dir (path printed)")
    ap.add_argument("--no-comparator", action="store_true", help="skip SGLang's comparator")
    ap.add_argument("--json", metavar="FILE", help="write the figures as one JSON object (benchmarks/benchjson.py)")
    ap.add_argument("--cache", choices=("as-is", "warm", "cold"), default="as-is",
                    help="the page cache before every task (warm-up and timed): as-is (what the previous task "
                         "left), warm (both traces read whole first), cold (their pages dropped first). Pairs "
                         "that do not fit the page cache beside the plain script (8 GB at 100k tokens) are "
                         "otherwise measured warm or cold by the luck of the order")
    ap.add_argument("--bytecode", action="store_true",
                    help="every task imports compiled bytecode, written once (in the warm-up) under the data dir "
                         "(PYTHONPYCACHEPREFIX), as an installed package has it; default: the environment's setting "
                         "(with PYTHONDONTWRITEBYTECODE=1 the CLI compiles tensordiff's sources on every run)")
    a = ap.parse_args()
    corrupt = a.corrupt if a.corrupt is not None else (20 if a.layers > 20 else a.layers * 5 // 8)
    if not 0 < corrupt < a.layers:
        ap.error("--corrupt must be in 1..layers-1")
    if a.repeat < 1:
        ap.error("--repeat must be at least 1")
    py = sys.executable
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["CUDA_VISIBLE_DEVICES"] = ""
    env.setdefault("PYTHONWARNINGS", "ignore")
    work = tempfile.mkdtemp(prefix="tensordiff-bench-", dir=a.dir)
    logs = os.path.join(work, "logs")
    os.makedirs(logs)
    if a.bytecode:   # the same for every task: its modules' bytecode, compiled in the warm-up round
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = os.path.join(work, "pycache")
    bytecode = "compiled once, under the data dir (--bytecode)" if a.bytecode else _bytecode_state()
    me = os.path.abspath(__file__)
    from benchjson import Result

    result = Result("bench_diff", {"layers": a.layers, "tokens": a.tokens, "hidden": a.hidden, "corrupt": corrupt,
                                   "seed": a.seed, "repeat": a.repeat, "backend": "serial", "bytecode": a.bytecode,
                                   "cache": a.cache})
    load_start = os.getloadavg()
    result.config["proc_loadavg_start"] = _proc_loadavg()
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in load_start)} on {os.cpu_count()} CPUs "
          "(shared machine: other jobs may run)", flush=True)
    try:
        cfg = {"dir": work, "layers": a.layers, "tokens": a.tokens, "hidden": a.hidden, "corrupt": corrupt,
               "seed": a.seed, "dumps": not a.no_comparator}
        pr = run_proc([py, me, "--_worker", "prepare", json.dumps(cfg)], env, work, os.path.join(logs, "prepare"))
        if pr["rc"] != 0 or "result" not in pr:
            print(pr["stderr"][-3000:], file=sys.stderr)
            print("data preparation failed", file=sys.stderr)
            return 2
        info = pr["result"]
        payload = info["payload_bytes"]
        print(f"data: {a.layers} layers x {a.tokens} tokens x {a.hidden} bf16 per side = {payload / 2 / 1e9:.3f} GB "
              f"per side, {payload / 1e9:.3f} GB both; layer{corrupt} corrupted on side B", flush=True)
        print(f"files: traces {info['file_bytes']['trace'] / 1e9:.3f} GB, dumps {info['file_bytes']['dump'] / 1e9:.3f} GB "
              f"({info['dump_mode']}); written in {pr['wall']:.1f} s", flush=True)

        A, B = info["trace_a"], info["trace_b"]
        paths_json = json.dumps({"paths": [A, B]})
        script = os.path.join(work, "plain_diff.py")
        with open(script, "w") as fh:
            fh.write(PLAIN_SCRIPT)
        tasks = [
            ("readinto", [py, me, "--_worker", "readinto", paths_json]),
            ("h5py read", [py, me, "--_worker", "h5read", paths_json]),
            ("plain script", [py, script, A, B]),
            ("tensordiff CLI", [py, "-m", "tensordiff", "diff", A, B, "--json", "-q", "--backend", "serial"]),
            ("tensordiff in-process", [py, me, "--_worker", "inproc", paths_json]),
            ("numeric pass alone", [py, me, "--_worker", "numeric", paths_json]),
        ]
        have_cmp = False
        if not a.no_comparator and not os.path.isdir(info["dump_target"]):
            print(f"SGLang comparator cannot run: no dumper output ({info['dump_mode']}); pass --no-comparator",
                  file=sys.stderr)
            return 2
        if not a.no_comparator:
            chk = subprocess.run([py, "-c", "import polars, torch, sglang.srt.debug_utils.comparator.entrypoint"],
                                 env=env, capture_output=True, text=True)
            if chk.returncode == 0:
                have_cmp = True
                tasks.append(("SGLang comparator", [py, "-m", "sglang.srt.debug_utils.comparator", "--preset", "raw",
                                                    "--baseline-path", info["dump_base"],
                                                    "--target-path", info["dump_target"], "--report-path", ""]))
                # its start-up alone (python + imports), to split the end-to-end figure
                tasks.append(("SGLang comparator import", [py, "-c", "import sglang.srt.debug_utils.comparator.entrypoint"]))
            else:  # a baseline is never skipped silently: say what is missing and stop
                print(f"SGLang comparator cannot run: {chk.stderr.strip().splitlines()[-1:]}; install the bench "
                      "extra (scripts/setup.sh full installs polars) or pass --no-comparator", file=sys.stderr)
                return 2

        runs: dict[str, list[dict]] = {name: [] for name, _ in tasks}
        order = random.Random(a.seed)
        cli_env = dict(env, TENSORDIFF_TIMINGS="1")
        for rep in range(a.repeat + 1):  # rep 0: the untimed warm-up pass, in the listed order
            round_tasks = list(tasks)
            if rep:
                order.shuffle(round_tasks)
            for name, cmd in round_tasks:
                if rep == 0 and name == "SGLang comparator import":
                    continue  # the comparator's warm-up already loaded the same modules
                if name in ("readinto", "h5py read", "plain script", "tensordiff CLI", "tensordiff in-process",
                            "numeric pass alone"):
                    set_cache(a.cache, [A, B])
                r = run_proc(cmd, cli_env if name == "tensordiff CLI" else env, work,
                             os.path.join(logs, f"{name.replace(' ', '_')}.{rep}"))
                if name in ("readinto", "h5py read", "plain script", "tensordiff in-process",
                            "numeric pass alone") and r["rc"] != 0:
                    print(f"{name} failed (exit {r['rc']}): {r['stderr'].strip()[-800:]}", file=sys.stderr)
                    return 2   # a baseline that cannot run stops the benchmark
                if name == "tensordiff CLI":
                    m = PROBE_LINE.search(r["stderr"])
                    if m is None:
                        print(f"the CLI printed no probe timing: {r['stderr'].strip()[-800:]}", file=sys.stderr)
                        return 2
                    r["probe"] = float(m.group(1))
                if rep:
                    runs[name].append(r)
                inner = r.get("result", {}).get("seconds")
                load = os.getloadavg()[0]
                print(f"  {'warm-up' if rep == 0 else f'rep {rep}'}: {name:25s} load {load:5.2f}  wall {r['wall']:6.2f} s"
                      + (f", timed {inner:6.2f} s" if inner is not None else "") + f", rc {r['rc']}", flush=True)
        load_end = os.getloadavg()
        result.config["proc_loadavg_end"] = _proc_loadavg()
        print(f"/proc/loadavg: {result.config['proc_loadavg_start']} at start, {result.config['proc_loadavg_end']} at end")

        # -- checks ---------------------------------------------------------------------------
        label = f"layer{corrupt}"
        checks = {}
        for name, rs in runs.items():
            last = rs[-1]
            if name == "tensordiff CLI":
                try:
                    d = json.loads(last["stdout"])
                    fd = d.get("first_divergence") or {}
                    ok_name = fd.get("tensor") == label
                    checks[name] = ok_name
                    last["names"] = ok_name
                except ValueError:
                    last["names"] = False
                    checks[name] = False
                checks[name] = checks[name] and all(r["rc"] == 1 for r in rs)
            elif name == "tensordiff in-process":
                res = last.get("result", {})
                last["names"] = res.get("first_tensor") == label
                checks[name] = last["names"] and all(r.get("result", {}).get("exit_code") == 1 for r in rs)
                for r in rs:  # the diff's exit code (the worker process itself exits 0)
                    r["rc_shown"] = r.get("result", {}).get("exit_code")
            elif name == "SGLang comparator":
                text = last["stdout"] + last["stderr"]
                last["names"] = names_layer_text(text, corrupt)
                m = re.search(r"(\d+) failed", ANSI.sub("", text))
                last["flagged"] = int(m.group(1)) if m else None

        # -- table ----------------------------------------------------------------------------
        def med(xs):
            return statistics.median(xs) if xs else float("nan")

        rows = {}
        for name, rs in runs.items():
            wall = med([r["wall"] for r in rs])
            inner = [r["result"]["seconds"] for r in rs if "result" in r and "seconds" in r["result"]]
            rows[name] = {"wall": wall, "timed": med(inner) if inner else None,
                          "rss": max(r["rss"] for r in rs), "rc": sorted({r.get("rc_shown", r["rc"]) for r in rs}),
                          "names": rs[-1].get("names"), "flagged": rs[-1].get("flagged")}
        mb = payload / 1e6
        print()
        print(f"## diff throughput: {payload / 1e9:.3f} GB of bf16 tensors (both sides), median of {a.repeat}, warm cache")
        print(f"load average at end: {' '.join(f'{x:.2f}' for x in load_end)} (shared machine)")
        print()
        print("| tool | wall s (end to end) | MB/s end to end | timed s (no start-up) | MB/s timed | peak RSS MB | "
              f"exit code | names {label} |")
        print("|---|---|---|---|---|---|---|---|")
        for name, r in rows.items():
            if name == "SGLang comparator import":
                continue
            timed = f"{r['timed']:.2f}" if r["timed"] is not None else "-"
            mbs_t = f"{mb / r['timed']:.0f}" if r["timed"] else "-"
            names = {True: "yes", False: "no", None: "-"}[r["names"]]
            if name == "SGLang comparator" and r["flagged"] is not None:
                names += f" (flags {r['flagged']} failed)"
            print(f"| {name} | {r['wall']:.2f} | {mb / r['wall']:.0f} | {timed} | {mbs_t} | {r['rss'] / 1e6:.0f} | "
                  f"{','.join(map(str, r['rc']))} | {names} |")
        print()
        h5 = rows["h5py read"]
        rd = rows["readinto"]
        cli = rows["tensordiff CLI"]
        inp = rows["tensordiff in-process"]
        script_row = rows["plain script"]
        num = rows["numeric pass alone"]
        probe_s = med([r["probe"] for r in runs["tensordiff CLI"]])
        lanes_used = runs["numeric pass alone"][-1]["result"].get("lanes")
        print("ratios (throughput, higher is better):")
        print(f"  tensordiff in-process / readinto of both files (page-cache read rate, {rd['timed']:.3f} s = "
              f"{info['file_bytes']['trace'] / rd['timed'] / 1e9:.2f} GB/s): {rd['timed'] / inp['timed']:.2f}  (goal >= 0.6)")
        print(f"  the numeric pass alone / readinto (the most the line above can reach on this CPU): "
              f"{rd['timed'] / num['timed']:.2f}  ({num['timed']:.3f} s on {lanes_used} threads)")
        print(f"  tensordiff in-process / h5py read (both without start-up): {h5['timed'] / inp['timed']:.2f}  (goal >= 0.8)")
        print(f"  tensordiff CLI / plain per-layer script, both end to end : {script_row['wall'] / cli['wall']:.2f}  "
              "(goal >= 3)")
        print(f"  the CLI's probe: {probe_s:.3f} s, {probe_s / cli['wall']:.1%} of its wall time  (goal <= 5%)")
        print(f"  tensordiff CLI / h5py read, both end to end             : {h5['wall'] / cli['wall']:.2f}")
        print(f"  tensordiff CLI end to end / h5py read without start-up  : {h5['timed'] / cli['wall']:.2f}")
        if have_cmp:
            cmp_ = rows["SGLang comparator"]
            imp = rows["SGLang comparator import"]["wall"]
            print(f"  tensordiff CLI / SGLang comparator, both end to end     : {cmp_['wall'] / cli['wall']:.1f}  (goal >= 10)")
            print(f"  tensordiff in-process / SGLang comparator minus import  : "
                  f"{(cmp_['wall'] - imp) / inp['timed']:.1f}")
            print(f"SGLang comparator: python start-up + imports {imp:.2f} s (median of `python -c 'import "
                  f"sglang.srt.debug_utils.comparator.entrypoint'`), so {cmp_['wall'] - imp:.2f} s "
                  f"({mb / max(cmp_['wall'] - imp, 1e-9):.0f} MB/s) after start-up")
        print(f"tensordiff: python start-up + imports {inp['wall'] - inp['timed']:.2f} s (in-process worker's wall "
              f"minus its timed diff); CLI wall minus in-process diff {cli['wall'] - inp['timed']:.2f} s")
        ok = bool(checks.get("tensordiff CLI") and checks.get("tensordiff in-process"))
        print(f"check: tensordiff exit code 1 and first_divergence = {label}: {'PASS' if ok else 'FAIL'}")
        print("backend: serial (the CLI is given --backend serial; the in-process diff runs serial)")
        print(f"bytecode: {bytecode}")
        print(f"page cache before each task: {a.cache}")
        if a.json:
            figures = {"inproc_vs_readinto": rd["timed"] / inp["timed"], "readinto_s": rd["timed"],
                       "readinto_gb_s": info["file_bytes"]["trace"] / rd["timed"] / 1e9,
                       "inproc_vs_read": h5["timed"] / inp["timed"], "cli_vs_script": script_row["wall"] / cli["wall"],
                       "probe_share": probe_s / cli["wall"], "rss_mb": cli["rss"] / 1e6, "names_corrupt": ok,
                       "inproc_s": inp["timed"], "read_s": h5["timed"], "cli_s": cli["wall"],
                       "script_s": script_row["wall"], "probe_s": probe_s, "inproc_rss_mb": inp["rss"] / 1e6,
                       "payload_gb": payload / 1e9, "numeric_vs_readinto": rd["timed"] / num["timed"],
                       "numeric_s": num["timed"], "numeric_lanes": lanes_used}
            result.config["comparator"] = have_cmp
            result.write(a.json, figures)
        if a.keep:
            print(f"data kept in {work}")
        return 0
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
