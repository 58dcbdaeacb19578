"""A real recorder to be killed: the crash-safety test (tests/test_crash.py) and the kill
measurement in docs/robustness.md start it.

It records a tiny random-weight LlamaForCausalLM (built locally with transformers, never
downloaded) on CPU, one sequence per step, through TraceWriter's flush policy:

* ``--mode hf``: through :class:`tensordiff.recorders.hf.HFExtractorRecorder` (every boundary,
  final_norm, and the packed draft input), the train-side recorder users run;
* ``--mode writer``: ``output_hidden_states=True`` and TraceWriter driven directly (the fallback
  when the HF recorder is missing or broken);
* ``--mode numpy``: no torch at all, seeded random rows of the same shapes (fast; for the quick
  crash test and the many-kill measurement).
``--mode auto`` (default) uses ``hf`` when it imports, else ``writer``.

Importing torch costs seconds, so the process is a zygote: it builds the model once, then forks
one recorder child per run (``--runs``). Everything is deterministic (seeded model and tokens,
one torch thread): a run left to finish is the reference every killed run is compared with.

Protocol: one line per event on stdout, each written with a single ``os.write`` (atomic on a
pipe), so a reader sees whole lines even from a child killed mid-run::

    READY <mode>                       the zygote built the model
    START <run> <pid> <path>           a child started recording
    FLUSH <run> <n> <tokens> <json>    the child's flush number n committed <tokens> token rows and
                                       {tensor: rows} (printed after the commit, by on_flush)
    STEP <run> <i> <tokens>            step i is complete; <tokens> token rows added so far
    DONE <run>                         the child closed its trace cleanly
    END <run> <status>                 the child is gone (status: exit code, or -signal)

Kill the child's pid with SIGKILL between START and DONE. ``--self-kill N`` makes the zygote do
it: run 0 is the reference, runs 1..N are killed at uniform random times over the first 90% of
the reference's duration, each trace is checked against the reference (:func:`check_recovered`)
and a summary line is printed. ``--write-sweep STRIDE`` kills runs under strace just before
their k-th file write, for every STRIDE-th k (needs strace). Both give the figures in
docs/robustness.md::

    PYTHONPATH=. python scripts/crash_recorder.py /tmp/crash/run --runs 1
    PYTHONPATH=. python scripts/crash_recorder.py /tmp/crash/run --self-kill 50 --mode numpy
    PYTHONPATH=. python scripts/crash_recorder.py /tmp/crash/sw --write-sweep 3 --mode numpy
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import random
import signal
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
if os.path.dirname(HERE) not in sys.path:
    sys.path.insert(0, os.path.dirname(HERE))

N_LAYERS, HIDDEN, VOCAB = 4, 64, 256
DRAFT_LAYERS = ("layer1", "layer2", "layer3")


# progress shared with the zygote (an anonymous mapping made before the fork):
# [token rows added by complete steps, token rows committed by the last flush]
_SHARED = np.frombuffer(mmap.mmap(-1, 16), dtype=np.int64)


def emit(line: str) -> None:
    os.write(1, (line + "\n").encode())


def step_done(run: int, step: int, total: int) -> None:
    _SHARED[0] = total
    emit(f"STEP {run} {step} {total}")


def token_ids(step: int, seq_len: int) -> np.ndarray:
    return np.random.default_rng(1000 + step).integers(1, VOCAB, seq_len)


# ----------------------------------------------------------------------------------------------
# recorders


class _Source:
    """Builds what one child records; heavy imports happen here, once, in the zygote."""

    def __init__(self, mode: str, hidden: int = HIDDEN):
        self.mode = mode
        self.hidden = hidden   # the numpy mode's width (4096: rows that fill the writer's aligned 2 MiB chunks)
        if mode == "numpy":
            return
        import torch

        torch.set_num_threads(1)
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=N_LAYERS,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                          initializer_range=0.3, tie_word_embeddings=False)
        self.torch = torch
        self.model = LlamaForCausalLM(cfg).eval()
        if mode in ("auto", "hf"):
            try:
                from tensordiff.recorders import hf  # noqa: F401
                from tensordiff.recorders.core import Recorder  # noqa: F401
                self.mode = "hf"
            except Exception as e:  # noqa: BLE001 - fall back to driving TraceWriter directly
                if mode == "hf":
                    raise
                emit(f"NOTE hf recorder unavailable ({type(e).__name__}: {e}); using TraceWriter directly")
                self.mode = "writer"

    def record(self, path: str, run: int, steps: int, seq_len: int, writer_kwargs: dict) -> None:
        def on_flush(w) -> None:
            _SHARED[1] = w.flushed["tokens"]
            emit(f"FLUSH {run} {w.flush_count} {w.flushed['tokens']} {json.dumps(w.flushed['tensors'])}")

        kw = dict(writer_kwargs, on_flush=on_flush)
        getattr(self, f"_record_{self.mode}")(path, run, steps, seq_len, kw)

    def _record_hf(self, path, run, steps, seq_len, kw) -> None:
        from tensordiff.recorders.core import Recorder
        from tensordiff.recorders.hf import HFExtractorRecorder, model_info, plan_draft_input

        plan = plan_draft_input("boundary", [1, 2, 3], N_LAYERS)
        total = 0
        with Recorder(path, side="train", producer="scripts/crash_recorder.py", model=model_info(self.model),
                      writer_kwargs=kw) as rec:
            hfr = HFExtractorRecorder(self.model, rec, plan, values="all")
            for step in range(steps):
                ids = token_ids(step, seq_len)
                hfr.run(f"sample-{step}", ids, step=step)
                total += len(ids)
                step_done(run, step, total)

    def _record_writer(self, path, run, steps, seq_len, kw) -> None:
        from tensordiff.trace import SlotSpec, TraceWriter
        from tensordiff.vocab import boundary_label

        torch = self.torch
        total = 0
        with TraceWriter(path, side="train", producer="scripts/crash_recorder.py",
                         model={"num_layers": N_LAYERS, "hidden_size": HIDDEN}, **kw) as w:
            for b in range(N_LAYERS + 1):
                w.define_tensor(boundary_label(b), HIDDEN, kind="boundary", boundary=b)
            w.define_tensor("draft_input", HIDDEN * len(DRAFT_LAYERS), kind="packed",
                            slots=SlotSpec(list(DRAFT_LAYERS)), token_offset=1, role="draft_input")
            for step in range(steps):
                ids = token_ids(step, seq_len)
                with torch.inference_mode():
                    out = self.model(torch.as_tensor(ids)[None], output_hidden_states=True, use_cache=False)
                rows = w.add_tokens(f"sample-{step}", np.arange(len(ids)), ids, "train", step=step)
                hs = [h[0].float().numpy() for h in out.hidden_states]
                for b in range(N_LAYERS + 1):
                    w.append(boundary_label(b), rows, hs[b])
                w.append("draft_input", rows[:-1], np.concatenate([hs[1], hs[2], hs[3]], axis=1)[:-1])
                total += len(ids)
                step_done(run, step, total)

    def _record_numpy(self, path, run, steps, seq_len, kw) -> None:
        from tensordiff.trace import SlotSpec, TraceWriter
        from tensordiff.vocab import boundary_label

        total = 0
        H = self.hidden
        with TraceWriter(path, side="train", producer="scripts/crash_recorder.py",
                         model={"num_layers": N_LAYERS, "hidden_size": H}, **kw) as w:
            for b in range(N_LAYERS + 1):
                w.define_tensor(boundary_label(b), H, kind="boundary", boundary=b, dtype="bfloat16")
            w.define_tensor("draft_input", H * len(DRAFT_LAYERS), kind="packed",
                            slots=SlotSpec(list(DRAFT_LAYERS)), token_offset=1, role="draft_input")
            for step in range(steps):
                ids = token_ids(step, seq_len)
                rng = np.random.default_rng(step)
                rows = w.add_tokens(f"sample-{step}", np.arange(len(ids)), ids, "train", step=step)
                hs = rng.standard_normal((N_LAYERS + 1, len(ids), H), dtype=np.float32)
                bits = (hs.view(np.uint32) >> 16).astype(np.uint16)
                for b in range(N_LAYERS + 1):
                    w.append(boundary_label(b), rows, bits[b])
                w.append("draft_input", rows[:-1], np.concatenate([hs[1], hs[2], hs[3]], axis=1)[:-1])
                total += len(ids)
                step_done(run, step, total)


# ----------------------------------------------------------------------------------------------
# checking a killed run


def _is_bad_input(e: BaseException) -> bool:
    """Whether ``e`` is the reader's refusal of a file (one line at the CLI), not a bug."""
    from tensordiff.errors import TensordiffError

    return isinstance(e, TensordiffError)


def check_recovered(path: str, ref_path: str) -> dict:
    """Open a killed run's trace and compare every row it recovered with the reference run.

    Returns {"tokens": recovered token rows, "tensor_rows": {name: rows}, "note": ...}; raises
    AssertionError when a recovered row differs from the reference (or the reference lacks it)."""
    from tensordiff.trace import TraceReader

    with TraceReader(ref_path) as ref, TraceReader(path) as r:
        assert ref.complete, "the reference run did not finish"
        n = len(r.tokens)
        # killed inside close() after the `complete` flag reached the file: then it must be all there
        assert not r.complete or n == len(ref.tokens), f"{path} is marked complete but lacks rows"
        assert n <= len(ref.tokens)
        assert np.array_equal(r.tokens, ref.tokens[:n]), "token rows differ from the reference"
        assert r.sequences == ref.sequences[:len(r.sequences)], "sequence keys differ"
        assert int(r.tokens["seq"].max(initial=-1)) < len(r.sequences)
        out = {"tokens": n, "tensor_rows": {}, "note": r.recovered_note}
        for name, info in r.tensors.items():
            k = info.rows
            assert name in ref.tensors and k <= ref.tensors[name].rows, f"{name}: more rows than the reference"
            rows = r.token_rows(name)
            assert np.array_equal(rows, ref.token_rows(name)[:k]), f"{name}: row index differs"
            assert k == 0 or rows.max() < n, f"{name}: rows point past the recovered token table"
            if info.has_values:
                assert np.array_equal(r.read_values(name, 0, k, raw=True), ref.read_values(name, 0, k, raw=True)), \
                    f"{name}: values differ from the reference"
            if info.has_sketch:
                assert np.array_equal(r.read_sketch(name, 0, k), ref.read_sketch(name, 0, k)), f"{name}: sketch differs"
            assert np.array_equal(r.read_rms(name, 0, k), ref.read_rms(name, 0, k)), f"{name}: rms differs"
            out["tensor_rows"][name] = k
        if r.complete:
            assert out["tensor_rows"] == {k: i.rows for k, i in ref.tensors.items()}, f"{path}: complete but rows missing"
        return out


# ----------------------------------------------------------------------------------------------


def write_sweep(a, argv: list[str]) -> int:
    """Every kill point at the granularity of file writes: strace injects SIGKILL into the recorder
    on entry to its k-th pwrite64 (HDF5 writes through pwrite only), so the file is left exactly
    as it was after k-1 writes: inside a flush, between the two phases, mid-step."""
    import shutil
    import subprocess

    if shutil.which("strace") is None:
        emit("SUMMARY strace not installed")
        return 2
    base = [sys.executable, os.path.abspath(__file__), "--runs", "1"]
    skip = {"--write-sweep"}
    rest, i = [], 0
    while i < len(argv):
        if argv[i] in skip:
            i += 2
            continue
        if argv[i] == a.prefix:
            i += 1
            continue
        rest.append(argv[i])
        i += 1
    ref = f"{a.prefix}-ref"
    subprocess.run(base + [ref] + rest, check=True, stdout=subprocess.DEVNULL)
    log = f"{a.prefix}-strace.txt"
    subprocess.run(["strace", "-f", "-qq", "-e", "trace=pwrite64", "-o", log] + base + [f"{a.prefix}-count"] + rest,
                   check=True, stdout=subprocess.DEVNULL)
    with open(log) as fh:
        total = sum(1 for line in fh if "pwrite64(" in line)
    results = []
    for k in range(1, total + 1, a.write_sweep):
        out = f"{a.prefix}-k"
        proc = subprocess.run(["strace", "-f", "-qq", "-o", "/dev/null", "-e", "trace=pwrite64",
                               "-e", f"inject=pwrite64:signal=SIGKILL:when={k}"] + base + [out] + rest,
                              stdout=subprocess.PIPE, text=True)
        lines = proc.stdout.splitlines()
        flushed = max([int(x.split()[3]) for x in lines if x.startswith("FLUSH ")], default=0)
        added = max([int(x.split()[3]) for x in lines if x.startswith("STEP ")], default=0)
        if any(x.startswith("DONE") for x in lines):
            continue
        try:
            res = check_recovered(f"{out}-0.h5", f"{ref}-0.h5")
            assert res["tokens"] >= flushed, f"recovered {res['tokens']} token rows, {flushed} were flushed"
            results.append(("ok", added - res["tokens"], k))
        except AssertionError as e:
            results.append(("bad", str(e), k))
        except Exception as e:  # noqa: BLE001
            if flushed == 0 and _is_bad_input(e):
                results.append(("ok", added, k))  # killed before its first commit: a clean refusal, nothing lost
            else:
                results.append(("error", f"{type(e).__name__}: {e}", k))
    lost = [t for s_, t, _ in results if s_ == "ok"]
    bad = [r for r in results if r[0] != "ok"]
    emit(f"SUMMARY writes={total} stride={a.write_sweep} killed={len(results)} intact={len(lost)} failed={len(bad)} "
         f"lost mean {np.mean(lost) if lost else 0:.1f} max {max(lost, default=0)} "
         + " ".join(f"[k={k} {s_}: {t}]" for s_, t, k in bad[:3])
         + (f" failed at k={[k for _, _, k in bad]}" if bad else ""))
    return 0 if not bad else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("prefix", help="traces are written to <prefix>-<run>.h5")
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--self-kill", type=int, default=0, metavar="N",
                    help="run a reference, then N runs killed at random times, check them, print a summary")
    ap.add_argument("--mode", choices=("auto", "hf", "writer", "numpy"), default="auto")
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--seq-len", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=HIDDEN, help="the width of --mode numpy's tensors")
    ap.add_argument("--flush-rows", type=int, default=96)
    ap.add_argument("--flush-seconds", type=float, default=0.0, help="0: off")
    ap.add_argument("--seed", type=int, default=0, help="kill times of --self-kill")
    ap.add_argument("--write-sweep", type=int, default=0, metavar="STRIDE",
                    help="kill a run (under strace) just before its k-th pwrite64, for k = 1, 1+STRIDE, ... "
                         "over all its writes; check each trace against a reference; print a summary")
    a = ap.parse_args(argv)
    if a.write_sweep:
        return write_sweep(a, argv if argv is not None else sys.argv[1:])
    src = _Source(a.mode, a.hidden)
    emit(f"READY {src.mode}")
    kw = {"flush_rows": a.flush_rows or None, "flush_seconds": a.flush_seconds or None}
    runs = a.self_kill + 1 if a.self_kill else a.runs
    rnd = random.Random(a.seed)
    duration = None
    results = []
    for run in range(runs):
        path = f"{a.prefix}-{run}.h5"
        if os.path.exists(path):
            os.unlink(path)
        t0 = time.monotonic()
        _SHARED[:] = 0
        pid = os.fork()
        if pid == 0:  # the recorder
            status = 0
            try:
                src.record(path, run, a.steps, a.seq_len, kw)
                emit(f"DONE {run}")
            except BaseException as e:  # noqa: BLE001
                emit(f"ERROR {run} {type(e).__name__}: {e}")
                status = 3
            os._exit(status)
        emit(f"START {run} {pid} {path}")
        if a.self_kill and run > 0:
            time.sleep(rnd.uniform(0, 0.9 * duration))
            os.kill(pid, signal.SIGKILL)
        _, st = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(st)
        emit(f"END {run} {code}")
        if a.self_kill:
            if run == 0:
                duration = time.monotonic() - t0
                continue
            if code == 0:  # finished before the kill
                continue
            added, flushed = int(_SHARED[0]), int(_SHARED[1])
            try:
                res = check_recovered(path, f"{a.prefix}-0.h5")
                assert res["tokens"] >= flushed, f"recovered {res['tokens']} token rows, {flushed} were flushed"
                results.append(("ok", added - res["tokens"]))
            except AssertionError as e:
                results.append(("bad", str(e)))
            except Exception as e:  # noqa: BLE001
                if flushed == 0 and _is_bad_input(e):
                    results.append(("ok", added))  # killed before its first commit: a clean refusal, nothing lost
                else:
                    results.append(("error", f"{type(e).__name__}: {e}"))
    if a.self_kill:
        lost = [t for s, t in results if s == "ok"]
        bad = [(s, t) for s, t in results if s != "ok"]
        stats = (f"token rows lost per kill: mean {np.mean(lost):.1f}, median {np.median(lost):.0f}, "
                 f"max {max(lost)} (flush_rows {a.flush_rows}, {a.seq_len} rows per step)") if lost else ""
        emit(f"SUMMARY mode={src.mode} killed={len(results)} intact={len(lost)} failed={len(bad)} {stats} "
             + " ".join(f"{s}:{t}" for s, t in bad[:5]))
        return 0 if not bad else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
