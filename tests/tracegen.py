"""Small valid traces (numpy only, written through the real TraceWriter) and ways to break them,
for the bad-input, fuzz and crash tests. Not a test module.

Also: :func:`run_isolated`, which runs ``tensordiff.cli.main`` in a forked child with captured
stdout/stderr and a time limit, so a hang or a crash of the HDF5 library fails one test instead
of the whole run (and costs milliseconds, not a fresh interpreter).
"""

from __future__ import annotations

import io
import os
import signal
import sys
import tempfile
import time

import h5py
import numpy as np

from tensordiff.dtypes import f32_to_bf16_bits, to_float32
from tensordiff.sketch import sketch_np
from tensordiff.trace import SlotSpec, TraceWriter, slot_rms

H = 16
LAYERS = 3


def write_trace(path, *, side="train", seed=0, noise=0.0, hidden=H, seqs=3, length=12, packed_labels=("layer1", "layer2"),
                flush_rows=None, close=True, tokens_offset=0, model=None) -> TraceWriter | None:
    """A trace with boundaries embed..layer3 (float32 and bf16), final_norm and a packed draft input.
    ``noise`` perturbs the values (side B of a pair); ``close=False`` returns the open writer."""
    rng = np.random.default_rng(seed)
    base = np.random.default_rng(1234)
    w = TraceWriter(path, side=side, producer="tests/tracegen.py",
                    model=model if model is not None else {"num_layers": LAYERS, "hidden_size": hidden},
                    sketch_dim=8, flush_rows=flush_rows, flush_seconds=None)
    for b in range(LAYERS + 1):
        w.define_tensor(f"layer{b}" if b else "embed", hidden, kind="boundary", boundary=b,
                        dtype="bfloat16" if b == 2 else "float32")
    w.define_tensor("final_norm", hidden, kind="final_norm")
    k = len(packed_labels)
    w.define_tensor("draft_input", hidden * k, kind="packed", slots=SlotSpec(list(packed_labels), raw_ids=[0, 1],
                    convention="boundary"), slot_width=hidden, token_offset=1, role="draft_input")
    for s in range(seqs):
        ids = base.integers(1, 500, length) + tokens_offset
        rows = w.add_tokens(f"{side}-{s}", np.arange(length), ids, "train" if side == "train" else "prefill", step=s)
        states = {}
        for b in range(LAYERS + 1):
            x = base.standard_normal((length, hidden)).astype(np.float32)
            x += noise * rng.standard_normal(x.shape).astype(np.float32)
            states[b] = x
            name = f"layer{b}" if b else "embed"
            if b == 2:
                w.append(name, rows, (x.view(np.uint32) >> 16).astype(np.uint16))
            else:
                w.append(name, rows, x)
        w.append("final_norm", rows, base.standard_normal((length, hidden)).astype(np.float32))
        lab = {f"layer{b}" if b else "embed": b for b in range(LAYERS + 1)}
        packed = np.concatenate([states[lab[x]] for x in packed_labels], axis=1)[:-1]
        w.append("draft_input", rows[:-1], packed)
    if not close:
        return w
    w.close()
    return None


EAGLE_H = 64
DIM = 8
EAGLE_SEQS = 6
EAGLE_LENGTH = 120
_EAGLE_DTYPES = {0: "float32", 1: "float32", 2: "bfloat16", 3: "float16"}


def _eagle_name(b: int) -> str:
    return f"layer{b}" if b else "embed"


def write_eagle(path, *, side="train", sketches=True, refs=False, seed=0, noise=0.0, wrong=False, sketch_only=(),
                seqs=range(EAGLE_SEQS), flush_rows=None, close=True, meta=None):
    """An EAGLE-3-like trace (docs/format.md, "Derived sketches" and "Values by reference"):
    boundaries embed..layer3 (float32, bf16, float16), the target's packed ``aux_hidden_states``
    (bf16) and the ``draft_input`` the draft consumed: the aux rows but the last of each sequence,
    a few of them changed in their last bit (none in every third sequence).

    ``sketches=False``: valued tensors are stored without a sketch (the reader derives them).
    ``refs``: ``draft_input`` takes its values by reference to ``aux_hidden_states`` (the changed
    rows stored; the second of every three sequences appended without ``values_ref``, all rows
    given; the third with every row a reference, ``values=None``) and stores no sketch; the values
    read back are those of ``refs=False``. ``sketch_only``: tensors stored as sketch + RMS alone (the
    sketch computed per append, as the recorders do). ``wrong``: the aux's slot 1 holds layer3.
    ``seqs``: which sequences (a DP rank's share). ``close=False`` returns the open writer."""
    H, length = EAGLE_H, EAGLE_LENGTH
    base = np.random.default_rng(1234)
    rng = np.random.default_rng(seed)
    w = TraceWriter(path, side=side, producer="tests/tracegen.py", model={"num_layers": 3, "hidden_size": H},
                    sketch_dim=DIM, flush_rows=flush_rows, flush_seconds=None, meta=meta)
    for b in range(4):
        only = _eagle_name(b) in sketch_only
        w.define_tensor(_eagle_name(b), H, kind="boundary", boundary=b, dtype=_EAGLE_DTYPES[b], values=not only,
                        sketch=sketches or only)
    slots = SlotSpec(["layer1", "layer2"], raw_ids=[1, 2], convention="boundary")
    w.define_tensor("aux_hidden_states", 2 * H, kind="packed", slots=slots, slot_width=H, dtype="bfloat16",
                    role="aux", sketch=sketches)
    w.define_tensor("draft_input", 2 * H, kind="packed", slots=slots, slot_width=H, dtype="bfloat16",
                    role="draft_input", sketch=sketches and not refs,
                    values_source="aux_hidden_states" if refs else None)
    held = ("layer1", "layer3") if wrong else ("layer1", "layer2")
    wanted = set(seqs)
    aux_rows = 0
    for s in range(EAGLE_SEQS):
        ids = base.integers(1, 500, length)
        st = {}
        for b in range(4):
            x = base.standard_normal((length, H)).astype(np.float32)
            x += noise * rng.standard_normal(x.shape).astype(np.float32)
            st[_eagle_name(b)] = x
        if s not in wanted:
            continue
        rows = w.add_tokens(f"seq-{s}", np.arange(length), ids, "train" if side == "train" else "prefill", step=s)
        for b in range(4):
            name, x = _eagle_name(b), st[_eagle_name(b)]
            if name in sketch_only:
                w.append(name, rows, sketch=sketch_np(x, H, DIM, w.sketch_seed), rms=np.sqrt((x * x).mean(1)))
            elif _EAGLE_DTYPES[b] == "bfloat16":
                w.append(name, rows, f32_to_bf16_bits(x))
            else:
                w.append(name, rows, x.astype(_EAGLE_DTYPES[b]))
        aux = f32_to_bf16_bits(np.concatenate([st[h] for h in held], axis=1))
        w.append("aux_hidden_states", rows, aux)
        draft = aux[:-1].copy()
        changed = (np.arange(length - 1) % 6 == 5) & (s % 3 != 2)
        draft[changed] ^= np.uint16(1)
        if not refs:
            w.append("draft_input", rows[:-1], draft)
        elif s % 3 == 1:   # every row given (no values_ref): the writer computes the RMS
            w.append("draft_input", rows[:-1], draft)
        else:
            ref = aux_rows + np.arange(length - 1)
            ref[changed] = -1
            w.append("draft_input", rows[:-1], draft[changed] if changed.any() else None, values_ref=ref,
                     rms=slot_rms(to_float32(draft, "bfloat16"), H))
        aux_rows += length
    if not close:
        return w
    w.close()
    return path


def write_pair(d, **kw) -> tuple[str, str]:
    a, b = os.path.join(d, "a.h5"), os.path.join(d, "b.h5")
    write_trace(a, side="train", **kw)
    write_trace(b, side="serve", seed=1, noise=1e-6, **kw)
    return a, b


def write_verdict_pairs(d) -> dict[str, tuple[str, str]]:
    """One train trace and three serve traces against it, by the verdict each pair should get:
    ``agree`` (noise 1e-6), ``wrong`` (the packed draft input holds other layers), ``noisy`` (0.05)."""
    a = os.path.join(d, "train.h5")
    write_trace(a, side="train")
    same, wrong, noisy = (os.path.join(d, n) for n in ("same.h5", "wrong.h5", "noisy.h5"))
    write_trace(same, side="serve", seed=1, noise=1e-6)
    write_trace(wrong, side="serve", seed=1, noise=1e-6, packed_labels=("layer2", "layer3"))
    write_trace(noisy, side="serve", seed=1, noise=0.05)
    return {"agree": (a, same), "wrong": (a, wrong), "noisy": (a, noisy)}


def tokenizer_dir(d) -> str:
    """A word-level tokenizer (``w1`` .. ``w599``, ``[UNK]`` 0) saved as ``d/tokenizer.json``
    (``d`` is made); tokenizers is imported here, so only the tests that call this need it."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, **{f"w{i}": i for i in range(1, 600)}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    os.mkdir(d)
    tk.save(os.path.join(d, "tokenizer.json"))
    return str(d)


def objects(path) -> list[str]:
    """Every group and dataset path in a file (for deleting or replacing one)."""
    out = []
    with h5py.File(path, "r") as f:
        f.visit(out.append)
    return sorted(out)


def attributes(path) -> list[tuple[str, str]]:
    """(object path, attribute name) of every attribute, the root's as ("/", name)."""
    out = []
    with h5py.File(path, "r") as f:
        for k in f.attrs:
            out.append(("/", k))

        def visit(name, obj):
            for k in obj.attrs:
                out.append((name, k))
        f.visititems(visit)
    return out


# ----------------------------------------------------------------------------------------------


_PRELOADED = False


# not imported ahead of the children: the torch-side recorders, the TUI (textual) and the Ray
# backend (heavy, and seldom reached by the commands run here: a child that needs one imports
# it itself); ``__main__``, whose import runs the CLI; and the pytest plugin with the assertion
# helpers it loads, which pytest has imported itself
_NOT_PRELOADED = ("tensordiff.recorders", "tensordiff.tui", "tensordiff.ray_backend", "tensordiff.__main__",
                  "tensordiff.pytest_plugin", "tensordiff.testing")


def _preload() -> None:
    """Import every module the commands import, once, in the parent: each forked child starts warm.

    Under pytest a module imported for the first time is also rewritten for its asserts
    (tensordiff is a pytest plugin's package) and compiled from source where bytecode is not
    written: a child importing the diff's modules itself paid that on every run (the fuzz runs
    hundreds)."""
    global _PRELOADED
    if not _PRELOADED:
        import importlib
        import pkgutil

        import tensordiff
        from tensordiff.cli import build_parser

        def walk(package) -> None:   # (pkgutil.walk_packages would import the skipped packages)
            for mod in pkgutil.iter_modules(package.__path__, package.__name__ + "."):
                if not mod.name.startswith(_NOT_PRELOADED):
                    sub = importlib.import_module(mod.name)
                    if mod.ispkg:
                        walk(sub)

        walk(tensordiff)
        build_parser()
        _PRELOADED = True


def run_isolated(argv: list[str], timeout: float = 30.0, env: dict | None = None) -> tuple[int, str, str]:
    """Run ``tensordiff.cli.main(argv)`` in a forked child; returns (exit code, stdout, stderr).

    A child that outlives ``timeout`` is killed and reported as exit code 124; one killed by a
    signal (a crash in native code) as -signal."""
    _preload()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # child
            code = 99
            try:
                os.dup2(out.fileno(), 1)
                os.dup2(err.fileno(), 2)
                sys.stdout = io.TextIOWrapper(os.fdopen(1, "wb", closefd=False), encoding="utf-8")
                sys.stderr = io.TextIOWrapper(os.fdopen(2, "wb", closefd=False), encoding="utf-8")
                os.environ.pop("TENSORDIFF_DEBUG", None)
                os.environ["COLUMNS"] = "120"
                os.environ.update(env or {})
                from tensordiff.cli import main

                code = main(argv)
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 98
            except BaseException:  # noqa: BLE001 - an escaped exception: print it as Python would
                import traceback

                traceback.print_exc()
                code = 97
            finally:
                try:
                    sys.stdout.flush()
                    sys.stderr.flush()
                finally:
                    os._exit(code if isinstance(code, int) else 96)
        deadline = time.monotonic() + timeout
        status = None
        while True:
            done, st = os.waitpid(pid, os.WNOHANG)
            if done:
                status = os.waitstatus_to_exitcode(st)
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                status = 124
                break
            time.sleep(0.005)
        out.seek(0)
        err.seek(0)
        return status, out.read().decode("utf-8", "replace"), err.read().decode("utf-8", "replace")


def assert_clean_exit(rc: int, out: str, err: str, what: str = "") -> None:
    """The CLI contract: exit 0, 1 or 2; no traceback; on 2 exactly one line on stderr."""
    ctx = f"{what}: rc={rc}\nstderr: {err[-2000:]}"
    assert rc in (0, 1, 2), ctx
    assert "Traceback" not in err and "Traceback" not in out, ctx
    if rc == 2:
        lines = [x for x in err.splitlines() if x.strip()]
        assert len(lines) == 1 and lines[0].startswith("tensordiff: error: "), ctx
        assert "unexpected" not in lines[0], ctx  # an unvalidated failure slipped past the reader
