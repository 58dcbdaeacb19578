"""Fuzzing the reader through the CLI: valid traces are corrupted (truncated, bytes flipped or
zeroed, datasets deleted or replaced with wrong dtypes and shapes, attributes set to garbage,
links pointing elsewhere, tables filled with nonsense) and ``tensordiff info`` and ``tensordiff
diff`` run on them, each in a forked child with a time limit. Every run must exit 0, 1 or 2
within the limit, never print a traceback, and on exit 2 print exactly one line that is not an
"unexpected" error (that would mean the reader let a malformed file through to code that does
not expect it).

TENSORDIFF_FUZZ_EXAMPLES sets the number of hypothesis examples of the fast test (default 40);
the slow variant runs 300.
"""

from __future__ import annotations

import os
import shutil

import h5py
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tensordiff.trace.probe import WALL_FACTOR
from tracegen import assert_clean_exit, attributes, objects, run_isolated, write_pair, write_trace

EXAMPLES = int(os.environ.get("TENSORDIFF_FUZZ_EXAMPLES", "40"))
# the CLI's guard against files that make the HDF5 library loop (tensordiff.trace.probe), shortened
ENV = {"TENSORDIFF_OPEN_TIMEOUT": "8"}
# its bound on such a file: 8 CPU seconds without progress, or WALL_FACTOR times that in wall time
# whatever the CPU says (a loaded machine gives the looping child a fraction of a core); a run
# past that bound is a hang
TIME_LIMIT = 8.0 * WALL_FACTOR + 10.0


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzz_src")
    a, b = write_pair(str(d))
    # an interrupted recording too: the recovery path must be as robust as the clean one
    w = write_trace(str(d / "partial.h5"), side="serve", seed=1, noise=1e-6, flush_rows=10, close=False)
    w.flush()
    shutil.copyfile(d / "partial.h5", d / "partial_snapshot.h5")  # as a killed process leaves it
    w.close()
    return {"a": a, "b": b, "partial": str(d / "partial_snapshot.h5")}


# ----------------------------------------------------------------------------------------------
# corruptions


def _bytes_op(path, draw, kind):
    data = bytearray(open(path, "rb").read())
    n = len(data)
    if n == 0:
        return f"{kind} (file already empty)"
    if kind == "truncate":
        keep = draw(st.integers(0, n - 1))
        data = data[:keep]
    elif kind == "flip":
        for _ in range(draw(st.integers(1, 24))):
            i = draw(st.integers(0, n - 1))
            data[i] ^= draw(st.integers(1, 255))
    elif kind == "zero":
        i = draw(st.integers(0, n - 1))
        ln = draw(st.integers(1, 4096))
        data[i:i + ln] = bytes(len(data[i:i + ln]))
    elif kind == "random_block":
        i = draw(st.integers(0, n - 1))
        ln = draw(st.integers(1, 512))
        block = np.random.default_rng(draw(st.integers(0, 2**32 - 1))).integers(0, 256, ln, dtype=np.uint8).tobytes()
        data[i:i + ln] = block[:len(data[i:i + ln])]
    with open(path, "wb") as fh:
        fh.write(bytes(data))
    return kind


GARBAGE_ATTRS = [
    "not json {", "[]", "{}", '{"hidden_size": -3}', '{"hidden_size": "x", "num_layers": 1e300}',
    '["layer1", 5]', '["nope", "layer1"]', "[" * 5000 + "]" * 5000, "x" * (2 * 1024 * 1024), "",
    -1, 0, 2**40, -(2**62), 3.5, float("nan"), float("inf"), True,
    np.arange(1000), np.arange(3), np.bytes_(b"\xff\xfe\xfd"), h5py.Empty("f4"),
    np.array([1.5, 2.5]), np.complex64(1 + 2j),
]
BAD_DATASETS = ["int8", "float64", "uint16", "vlen_str", "compound", "scalar", "3d", "empty", "wide", "bool"]


def _make_bad(f, name, how, like: h5py.Dataset | None):
    n = min(like.shape[0], 64) if like is not None and like.shape else 4
    if how == "int8":
        f.create_dataset(name, data=np.ones((n,) + (like.shape[1:] if like is not None else ()), np.int8))
    elif how == "float64":
        f.create_dataset(name, data=np.ones((n,) + (like.shape[1:] if like is not None else ()), np.float64))
    elif how == "uint16":
        f.create_dataset(name, data=np.full((n,) + (like.shape[1:] if like is not None else ()), 7, np.uint16))
    elif how == "vlen_str":
        f.create_dataset(name, data=np.array(["a", "bb", "ccc"], dtype=object), dtype=h5py.string_dtype())
    elif how == "compound":
        f.create_dataset(name, data=np.zeros(n, dtype=[("x", "<f4"), ("y", "S3")]))
    elif how == "scalar":
        f.create_dataset(name, data=5)
    elif how == "3d":
        f.create_dataset(name, data=np.zeros((2, 3, 4), np.float32))
    elif how == "empty":
        f.create_dataset(name, data=h5py.Empty("f4"))
    elif how == "wide":
        f.create_dataset(name, data=np.zeros((n, 7), np.float32))
    elif how == "bool":
        f.create_dataset(name, data=np.zeros(n, bool))


def _pick(draw, items):
    if not items:
        raise ValueError("nothing to pick")
    return draw(st.sampled_from(items))


def _h5_op(path, draw, kind, other):
    objs = objects(path)
    with h5py.File(path, "r+") as f:
        if kind == "delete":
            name = _pick(draw, objs)
            if name in f:
                del f[name]
            return f"delete {name}"
        if kind == "replace":
            dsets = [o for o in objs if isinstance(f.get(o), h5py.Dataset)]
            name = _pick(draw, dsets)
            how = draw(st.sampled_from(BAD_DATASETS))
            like = f[name]
            like_copy = type("L", (), {"shape": like.shape})()
            del f[name]
            _make_bad(f, name, how, like_copy)
            return f"replace {name} with {how}"
        if kind == "attr":
            attrs = attributes(path) + [("/", "hidden"), ("tensors/draft_input", "slot_count")]
            obj, key = draw(st.sampled_from(attrs))
            val = draw(st.sampled_from(range(len(GARBAGE_ATTRS))))
            target = f if obj == "/" else f[obj]
            target.attrs[key] = GARBAGE_ATTRS[val]
            return f"attr {obj}@{key} = garbage #{val}"
        if kind == "resize":
            dsets = [o for o in objs if isinstance(f.get(o), h5py.Dataset) and f[o].maxshape and f[o].maxshape[0] is None]
            name = _pick(draw, dsets)
            size = draw(st.sampled_from([0, 1, 3, 10**6, 2**33]))
            f[name].resize(size, axis=0)
            return f"resize {name} to {size}"
        if kind == "link":
            name = _pick(draw, objs)
            how = draw(st.sampled_from(["external", "soft", "dangling", "self"]))
            del f[name]
            if how == "external":
                f[name] = h5py.ExternalLink(other, "/" + name)
            elif how == "soft":
                f[name] = h5py.SoftLink("/tokens")
            elif how == "dangling":
                f[name] = h5py.SoftLink("/nowhere")
            else:
                f[name] = h5py.SoftLink("/" + name)
            return f"link {name} -> {how}"
        if kind == "table":
            seed = draw(st.integers(0, 2**32 - 1))
            rng = np.random.default_rng(seed)
            tables = ["tokens"] + [o for o in objs if o.endswith("/rows")]
            name = _pick(draw, tables)
            ds = f[name]
            if name == "tokens":
                col = draw(st.sampled_from(["seq", "position", "token", "regime", "step"]))
                t = ds[()]
                t[col] = rng.integers(np.iinfo(t.dtype[col]).min, np.iinfo(t.dtype[col]).max, len(t), dtype=t.dtype[col],
                                      endpoint=True)
                ds[...] = t
                return f"tokens.{col} random"
            ds[...] = rng.integers(-(2**62), 2**62, ds.shape)
            return f"{name} random"
        if kind == "incomplete":
            f.attrs["complete"] = False
            if draw(st.booleans()):
                for o in [o for o in objs if o.startswith("tensors/") and o.count("/") == 1]:
                    f[o].attrs["flushed_rows"] = np.int64(draw(st.integers(-5, 100)))
                f.attrs["flushed_tokens"] = np.int64(draw(st.integers(-5, 100)))
            return "mark incomplete"
        if kind == "nan":
            vals = [o for o in objs if o.endswith("/values") and f[o].dtype.kind == "f"]
            name = _pick(draw, vals)
            v = f[name][()]
            v.flat[draw(st.integers(0, v.size - 1))] = draw(st.sampled_from([np.nan, np.inf, -np.inf, 1e38]))
            f[name][...] = v
            return f"nan in {name}"
    raise AssertionError(kind)


BYTE_OPS = ["truncate", "flip", "zero", "random_block"]
H5_OPS = ["delete", "replace", "attr", "resize", "link", "table", "incomplete", "nan"]


def corrupt(path, draw, other) -> list[str]:
    done = []
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(BYTE_OPS + H5_OPS))
        if kind in BYTE_OPS:
            done.append(_bytes_op(path, draw, kind))
        else:
            try:
                done.append(_h5_op(path, draw, kind, other))
            except (OSError, KeyError, ValueError, TypeError, RuntimeError, MemoryError):
                done.append(f"{kind} (h5py could not apply it: the file is already broken)")
    return done


def _check(cmds, what):
    for argv in cmds:
        rc, out, err = run_isolated(argv, timeout=TIME_LIMIT, env=ENV)
        assert rc != 124, f"{what}: `tensordiff {' '.join(argv)}` did not finish in {TIME_LIMIT} s"
        assert_clean_exit(rc, out, err, f"{what}: tensordiff {' '.join(argv)}")


def _fuzz(pair, tmp_path_factory, data, source):
    d = tmp_path_factory.mktemp("fuzz")
    bad = str(d / "bad.h5")
    shutil.copyfile(pair[source], bad)
    what = corrupt(bad, data.draw, pair["b"])
    as_b = data.draw(st.booleans())
    diff = ["diff", pair["a"], bad] if as_b else ["diff", bad, pair["b"]]
    _check([["info", bad], ["info", "--json", bad], diff + ["-q"]], f"{source} after {what}")


@settings(max_examples=EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data(), source=st.sampled_from(["a", "partial"]))
def test_corrupted_traces_never_crash_the_cli(pair, tmp_path_factory, data, source):
    _fuzz(pair, tmp_path_factory, data, source)


@pytest.mark.slow
@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data(), source=st.sampled_from(["a", "partial"]))
def test_corrupted_traces_never_crash_the_cli_long(pair, tmp_path_factory, data, source):
    _fuzz(pair, tmp_path_factory, data, source)


def test_every_truncation_point(pair, tmp_path):
    """Cut a valid trace at 64 evenly spaced lengths: each is refused (or opened) cleanly."""
    src = open(pair["a"], "rb").read()
    bad = str(tmp_path / "cut.h5")
    for i in range(64):
        with open(bad, "wb") as fh:
            fh.write(src[:len(src) * i // 64])
        rc, out, err = run_isolated(["info", bad], timeout=TIME_LIMIT, env=ENV)
        assert_clean_exit(rc, out, err, f"cut at {i}/64")
