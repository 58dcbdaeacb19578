"""The reader's low-level metadata reads (tensordiff/trace/validate.py attr_get, follow) give what
h5py's own mapping and group lookups give, and refuse what they refused, on every kind of
attribute and link a file can hold."""

from __future__ import annotations

import h5py
import numpy as np
import pytest

from tensordiff.errors import TraceFileError
from tensordiff.trace.validate import _NOT_PLAIN, MISSING, _read_plain_scalar, attr_get, attr_int, attr_str, follow


@pytest.fixture
def attr_file(tmp_path):
    p = tmp_path / "attrs.h5"
    with h5py.File(p, "w") as f:
        g = f.create_group("g")
        a = g.attrs
        a["int"] = 7
        a["neg"] = np.int8(-3)
        a["u16"] = np.uint16(65000)
        a["big_endian"] = np.array(5, dtype=">i4")
        a["float"] = 2.5
        a["f2"] = np.float16(1.5)
        a["bool"] = True
        a["vlen"] = "hello"
        a["vlen_unicode"] = "h\u00e9llo \u2713"
        a["vlen_ascii"] = np.array(b"bytes", dtype=h5py.string_dtype("ascii"))
        a["vlen_bad_utf8"] = np.array(b"caf\xe9 \xff", dtype=h5py.string_dtype("utf-8"))
        a["vlen_empty"] = ""
        a["i64_min"] = np.int64(-(2**63))
        a["u64_max"] = np.uint64(2**64 - 1)
        a["f32"] = np.float32(0.1)
        a["nan"] = np.nan
        a["one_element"] = np.array([4])
        # floats of 4 or 8 bytes that are not IEEE single or double: h5py reads them wider
        for key, size, fields, bias, value in (("f4_wide_exp", 4, (31, 20, 11, 0, 20), 1023, 1e300),
                                               ("f4_bias", 4, (31, 23, 8, 0, 23), 100, 1.5),
                                               ("f8_long", 8, (63, 48, 15, 0, 48), 16383, 0.1),
                                               ("f4_short_exp", 4, (31, 25, 6, 0, 25), 31, 2.0**24 + 1)):
            t = (h5py.h5t.IEEE_F32LE if size == 4 else h5py.h5t.IEEE_F64LE).copy()
            t.set_fields(*fields)
            t.set_ebias(bias)
            aid = h5py.h5a.create(g.id, key.encode(), t, h5py.h5s.create(h5py.h5s.SCALAR))
            aid.write(np.array(value, dtype=np.float64))
        a["fixed"] = np.bytes_(b"fixed")
        a["fixed_utf8"] = np.array("caf\u00e9".encode(), dtype=h5py.string_dtype("utf-8", 5))
        a["small_array"] = np.arange(3)
        a["str_array"] = np.array(["a", "bc"], dtype=h5py.string_dtype())
        a.create("enum", data=np.int8(1), dtype=h5py.enum_dtype({"A": 0, "B": 1}, basetype="i1"))
        a.create("enum_u", data=np.uint8(0), dtype=h5py.enum_dtype({"X": 0, "Y": 1}, basetype="u1"))
        # refused ones
        a["compound"] = np.zeros((), dtype=[("x", "i4"), ("y", "f4")])
        a["long_array"] = np.arange(1000)
        a.create("null", data=h5py.Empty("f4"))
        a["ref"] = f.ref
        g.create_dataset("ds", data=np.arange(4))
        g.create_group("sub")
        g["soft"] = h5py.SoftLink("/g/ds")
        g["ext"] = h5py.ExternalLink("other.h5", "/x")
        f["hard_twice"] = g["ds"]
        f.create_dataset("vds_src", data=np.arange(4))
        layout = h5py.VirtualLayout(shape=(4,), dtype="i8")
        layout[:] = h5py.VirtualSource(f["vds_src"])
        g.create_virtual_dataset("virtual", layout)
    return p


ACCEPTED = ["int", "neg", "u16", "big_endian", "float", "f2", "bool", "vlen", "vlen_unicode", "vlen_ascii",
            "vlen_bad_utf8", "vlen_empty", "i64_min", "u64_max", "f32", "nan", "one_element",
            "f4_wide_exp", "f4_bias", "f8_long", "f4_short_exp",
            "fixed", "fixed_utf8", "small_array", "str_array", "enum", "enum_u"]
#: scalars of the types the trace writer writes, read by the short path (the rest by the checked one)
PLAIN = {"int", "neg", "u16", "float", "vlen", "vlen_unicode", "vlen_ascii", "vlen_bad_utf8", "vlen_empty", "i64_min",
         "u64_max", "f32", "nan"}


def _same(x, y):
    if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
        return (isinstance(x, np.ndarray) and isinstance(y, np.ndarray) and x.dtype == y.dtype
                and x.shape == y.shape and np.array_equal(x, y))
    return type(x) is type(y) and (x == y or (x != x and y != y))


def test_values_equal_h5py_reads(attr_file):
    with h5py.File(attr_file, "r") as f:
        a = f["g"].attrs
        for _ in range(2):   # the second time through the cached memory types
            for key in ACCEPTED:
                got, want = attr_get(a, key), a[key]
                assert _same(got, want), (key, got, want)
        assert attr_get(a, "absent") is MISSING
        assert attr_int(a, "enum") == 1 and attr_int(a, "bool") == 1
        assert attr_str(a, "vlen_unicode") == "h\u00e9llo \u2713"
        assert attr_str(a, "fixed") == "fixed"
        assert attr_int(a, "f4_short_exp") == 2**24 + 1   # not rounded through a float32


@pytest.mark.parametrize("key, words", [("compound", "compound"), ("long_array", "array of 1000"),
                                        ("null", "empty"), ("ref", "references")])
def test_refusals_unchanged(attr_file, key, words):
    with h5py.File(attr_file, "r") as f:
        assert _read_plain_scalar(h5py.h5a.open(f["g"].attrs._id, key.encode())) is _NOT_PLAIN
        with pytest.raises(TraceFileError, match=words):
            attr_get(f["g"].attrs, key)


def test_follow_matches_h5py(attr_file):
    with h5py.File(attr_file, "r") as f:
        g = f["g"]
        assert follow(g, "absent", "x") is None
        sub = follow(g, "sub", "x")
        assert isinstance(sub, h5py.Group) and sub.name == "/g/sub"
        with pytest.raises(TraceFileError, match="soft link"):
            follow(g, "soft", "x")
        with pytest.raises(TraceFileError, match="external link"):
            follow(g, "ext", "x")
        with pytest.raises(TraceFileError, match="linked under 2 names"):
            follow(g, "ds", "x")
        with pytest.raises(TraceFileError, match="virtual dataset"):
            follow(g, "virtual", "x")
        ds = follow(f, "vds_src", "x")
        assert isinstance(ds, h5py.Dataset) and ds[()].tolist() == [0, 1, 2, 3] and ds.name == "/vds_src"


def test_short_path_takes_only_plain_scalars(attr_file):
    """The short path reads the writer's scalar types and hands every other type, shape and byte
    order to the checked path; what it reads equals h5py's own read, invalid UTF-8 included."""
    with h5py.File(attr_file, "r") as f:
        a = f["g"].attrs
        for key in ACCEPTED:
            got = _read_plain_scalar(h5py.h5a.open(a._id, key.encode()))
            if key in PLAIN:
                assert _same(got, a[key]), (key, got, a[key])
            else:
                assert got is _NOT_PLAIN, key
