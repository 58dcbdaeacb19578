"""Guards against hostile trace files: every check the reader makes before it reads a byte.

Nothing here trusts the file: an attribute's shape and type are checked before it is read and
strings are bounded; links other than hard links, virtual datasets and external raw storage are
refused (nothing outside the file is opened); a dataset's declared size is checked against the
file's size, its chunk size bounded and its filters known before any of it is read. Every refusal
is a :class:`~tensordiff.errors.TraceFileError` with one line for a person (docs/robustness.md).

Why one module of this size: every check before the first read is in one place, so a reviewer
sees the whole guard against hostile files at once.
"""

from __future__ import annotations

import math
import os
import stat
from dataclasses import dataclass
from typing import Any

import h5py  # type: ignore[import-untyped, unused-ignore]
import numpy as np
from h5py import h5a, h5d, h5g, h5i, h5l, h5o, h5s, h5t  # type: ignore[import-untyped, unused-ignore]
from h5py._objects import ObjectID  # type: ignore[import-untyped, unused-ignore]

from ..dtypes import LOGICAL_DTYPES
from ..errors import TraceBusyError, TraceFileError
from ..safety import parse_json
from ..vocab import REGIMES, parse_label
from .budget import Budget, filters_of
from .schema import (
    KINDS,
    MAX_ATTR_CHARS,
    MAX_ATTR_ELEMENTS,
    MAX_BOUNDARY,
    MAX_CHUNK_BYTES,
    MAX_NAME_CHARS,
    MAX_POSITION,
    MAX_SLOTS,
    MAX_TOKEN_OFFSET,
    MAX_WIDTH,
    TOKEN_COLUMNS,
)


class _Missing:
    """The value of an attribute that is not there."""


MISSING = _Missing()


def short(e: BaseException) -> str:
    """The first line of an exception's message (or its type), at most 200 characters."""
    s = str(e).splitlines()[0] if str(e) else type(e).__name__
    return s[:200]


# -- the file itself ---------------------------------------------------------------------------

_HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"
_NOT_REGULAR = ((stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISCHR, "a character device"),
                (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


@dataclass(frozen=True)
class FileIdentity:
    """Which file a path named when it was checked: a later open must see the same one."""

    dev: int
    ino: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> FileIdentity:
        return cls(int(st.st_dev), int(st.st_ino), int(st.st_size), int(st.st_mtime_ns))

    def same_file(self, other: FileIdentity) -> bool:
        return (self.dev, self.ino) == (other.dev, other.ino)


def not_regular(st: os.stat_result) -> str | None:
    """What a non-regular file is ("a named pipe (FIFO)"), None for a regular file."""
    if stat.S_ISREG(st.st_mode):
        return None
    for test, what in _NOT_REGULAR:
        if test(st.st_mode):
            return what
    return "not a regular file"


def check_path(path: str) -> FileIdentity:
    """The identity of ``path`` after checking that it is a regular, non-empty HDF5 file that no
    process has open for writing. One descriptor is opened (non-blocking, so a FIFO swapped in
    cannot block) and every check is made on it."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise TraceFileError("no such file", path) from None
    except PermissionError:
        raise TraceFileError("permission denied", path) from None
    except OSError as e:
        raise TraceFileError(f"cannot read: {e.strerror or e}", path) from None
    if stat.S_ISDIR(st.st_mode):
        raise TraceFileError("is a directory, not a trace file", path)
    what = not_regular(st)
    if what:
        raise TraceFileError(f"is {what}, not a regular file; traces are read from regular files only", path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except PermissionError:
        raise TraceFileError("permission denied", path) from None
    except OSError as e:
        raise TraceFileError(f"cannot read: {e.strerror or e}", path) from None
    try:
        st = os.fstat(fd)
        what = not_regular(st)
        if what:
            raise TraceFileError(f"is {what}, not a regular file; traces are read from regular files only", path)
        if st.st_size == 0:
            raise TraceFileError("empty file (a recording killed before its first flush leaves nothing)", path)
        if being_written(fd):
            raise TraceBusyError("is still being written: a process (a recording in progress?) has it open for "
                                 "writing; read it once that process has closed it, or copy it to read what it "
                                 "has flushed so far", path)
        if superblock_offset(fd, st.st_size) is None:
            raise TraceFileError("not an HDF5 file (not a tensordiff trace)", path)
        return FileIdentity.of(st)
    except OSError as e:
        raise TraceFileError(f"cannot read: {e.strerror or e}", path) from None
    finally:
        os.close(fd)


def being_written(fd: int) -> bool:
    """Whether another process holds the write lock HDF5 takes on a file opened for writing
    (``flock(LOCK_EX)``; a writer whose HDF5 file locking is disabled is not seen)."""
    try:
        import fcntl
    except ImportError:  # not on this platform
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:  # a file system without locks
        return False
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False


def superblock_offset(fd: int, size: int) -> int | None:
    """Where the HDF5 signature is (0, 512, 1024, ...: where HDF5 looks), None if nowhere."""
    at = 0
    while at < size:
        if os.pread(fd, 8, at) == _HDF5_SIGNATURE:
            return at
        at = 512 if at == 0 else at * 2
    return None


# -- strings from a file -----------------------------------------------------------------------


def clean_text(s: str) -> str:
    """A string from a file as printable text: invalid UTF-8 (which h5py hands over as lone
    surrogates, as does JSON's ``\\udcxx``) becomes U+FFFD instead of failing when printed."""
    try:
        s.encode("utf-8")
        return s
    except UnicodeEncodeError:
        return s.encode("utf-8", "surrogatepass").decode("utf-8", "replace")


def clean_json(v: Any) -> Any:
    """:func:`clean_text` applied to every string (and key) of a parsed JSON value."""
    if isinstance(v, str):
        return clean_text(v)
    if isinstance(v, list):
        return [clean_json(x) for x in v]
    if isinstance(v, dict):
        return {clean_text(str(k)): clean_json(x) for k, x in v.items()}
    return v


# -- attributes --------------------------------------------------------------------------------


def attr_get(attrs: Any, key: str, where: str = "") -> Any:
    """An attribute's value after checking its shape and type (nothing large is read);
    :data:`MISSING` when there is none.

    On an h5py attribute mapping the attribute is opened once, checked on that handle and read
    from it (h5py's ``attrs[key]`` would open it again and rebuild its types: three HDF5 opens
    per attribute become one, with the same checks and the same value)."""
    oid = getattr(attrs, "_id", None)
    if not isinstance(oid, ObjectID):  # not an h5py mapping (a test's stand-in)
        if key not in attrs:
            return MISSING
        aid = attrs.get_id(key)
        _check_attr(aid, key, where)
        return attrs[key]
    bkey = key.encode("utf-8")   # h5py's name encoding: ASCII, else UTF-8 (the same bytes)
    if not h5a.exists(oid, bkey):
        return MISSING
    aid = h5a.open(oid, bkey)
    value = _read_plain_scalar(aid)
    if value is not _NOT_PLAIN:
        return value
    shape, dt = _check_attr(aid, key, where)
    return _read_attr(aid, shape, dt)


_NOT_PLAIN = object()

#: numpy dtypes of little-endian integer types, by (size, signed)
_PLAIN_INTS = {(n, s): np.dtype(f"<{'i' if s else 'u'}{n}") for n in (1, 2, 4, 8) for s in (True, False)}
#: the IEEE float types and their numpy dtypes (a float of another layout or bias, even of the
#: same size, is read by h5py as a wider type: the checked path reads it)
_PLAIN_FLOATS = ((h5t.IEEE_F32LE, np.dtype("<f4")), (h5t.IEEE_F64LE, np.dtype("<f8")))
#: memory types of variable-length strings, by character set
_VLEN_MTYPES: dict[int, Any] = {}


def _read_plain_scalar(aid: Any) -> Any:
    """The value of a scalar attribute of the types a trace's writer writes (a little-endian
    integer, an IEEE float of 4 or 8 bytes, a variable-length string), read from its low-level
    type and dataspace (h5py's ``shape`` and ``dtype`` build a dataspace and a numpy type first,
    and cost more than the read); :data:`_NOT_PLAIN` for anything else, which :func:`_check_attr`
    then checks. The value is the one :func:`_read_attr` returns for the same attribute."""
    if aid.get_space().get_simple_extent_type() != h5s.SCALAR:
        return _NOT_PLAIN
    tid = aid.get_type()
    cls = tid.get_class()
    if cls == h5t.STRING:
        if not tid.is_variable_str():
            return _NOT_PLAIN
        cset = tid.get_cset()
        mtype = _VLEN_MTYPES.get(cset)
        if mtype is None:
            if cset not in (h5t.CSET_ASCII, h5t.CSET_UTF8):
                return _NOT_PLAIN
            enc = "utf-8" if cset == h5t.CSET_UTF8 else "ascii"
            mtype = _VLEN_MTYPES[cset] = h5t.py_create(h5py.string_dtype(enc))
        out = np.empty((), dtype=object)
        aid.read(out, mtype=mtype)
        raw = out[()]
        return raw.decode("utf-8", "surrogateescape") if isinstance(raw, bytes) else raw
    if cls == h5t.INTEGER and tid.get_order() == h5t.ORDER_LE:
        dt = _PLAIN_INTS.get((tid.get_size(), tid.get_sign() == h5t.SGN_2))
    elif cls == h5t.FLOAT:
        dt = next((d for t, d in _PLAIN_FLOATS if tid.equal(t)), None)
    else:
        return _NOT_PLAIN
    if dt is None:
        return _NOT_PLAIN
    arr = np.empty((), dtype=dt)
    aid.read(arr, mtype=_numeric_mtype(dt))
    return arr[()]


def _numeric_mtype(dt: np.dtype) -> Any:
    mtype = _NUMERIC_MTYPES.get(dt)
    if mtype is None:
        mtype = _NUMERIC_MTYPES[dt] = h5t.py_create(dt)
    return mtype


def _check_attr(aid: Any, key: str, where: str) -> tuple[tuple[int, ...], np.dtype]:
    shape = aid.shape
    if shape is None:  # null dataspace
        raise TraceFileError(f"attribute {key!r}{where} is empty")
    if math.prod(shape) > MAX_ATTR_ELEMENTS:
        raise TraceFileError(f"attribute {key!r}{where} is an array of {math.prod(shape)} values, expected one")
    dt = aid.dtype
    if dt.names is not None or dt.subdtype is not None:
        raise TraceFileError(f"attribute {key!r}{where} has a compound or array type")
    if dt.kind == "O":
        if h5py.check_string_dtype(dt) is None:
            raise TraceFileError(f"attribute {key!r}{where} holds references or variable-length data, not a value")
    elif dt.kind == "S":
        if dt.itemsize > MAX_ATTR_CHARS:
            raise TraceFileError(f"attribute {key!r}{where} is longer than {MAX_ATTR_CHARS} characters")
    elif dt.kind not in "biuf":
        raise TraceFileError(f"attribute {key!r}{where} has an unsupported type ({dt})")
    return shape, dt


#: memory types for numeric attribute dtypes (h5py builds a new one on every read)
_NUMERIC_MTYPES: dict[np.dtype, Any] = {}


def _read_attr(aid: Any, shape: tuple[int, ...], dt: np.dtype) -> Any:
    """What h5py's ``attrs[key]`` returns, read from the open ``aid`` of a checked attribute
    (a non-null dataspace, neither compound nor array type: :func:`_check_attr`)."""
    if dt.kind in "biuf" and dt.metadata is None:   # not an enum (its members are metadata)
        mtype = _numeric_mtype(dt)
    else:  # strings (the memory type carries the encoding) and enums: built as h5py builds them
        mtype = h5t.py_create(dt)
    arr = np.zeros(shape, dtype=dt, order="C")
    aid.read(arr, mtype=mtype)
    info = h5t.check_string_dtype(dt) if dt.kind == "O" else None
    if info and info.length is None:  # variable-length strings: as h5py decodes them
        arr = np.array([b.decode("utf-8", "surrogateescape") for b in arr.flat], dtype=dt).reshape(arr.shape)
    if arr.ndim == 0:
        return arr[()]
    return arr


def attr_str(attrs: Any, key: str, default: str | None = None, where: str = "", budget: Budget | None = None) -> str:
    v = attr_get(attrs, key, where)
    if v is MISSING:
        if default is not None:
            return default
        raise TraceFileError(f"missing attribute {key!r}{where}")
    return _str_value(v, key, where, budget)


def _str_value(v: Any, key: str, where: str, budget: Budget | None) -> str:
    """An attribute's value (:func:`attr_get`) checked and cleaned as a string."""
    if isinstance(v, np.ndarray) and v.shape == ():
        v = v[()]
    if isinstance(v, bytes):
        v = v.decode("utf-8", "replace")
    if not isinstance(v, str):
        raise TraceFileError(f"attribute {key!r}{where} is not a string")
    if budget is not None:
        budget.string_bytes(len(v), f"attribute {key!r}{where}")
    if len(v) > MAX_ATTR_CHARS:
        raise TraceFileError(f"attribute {key!r}{where} is longer than {MAX_ATTR_CHARS} characters")
    return clean_text(v)


def attr_json(attrs: Any, key: str, default: Any = None, where: str = "", budget: Budget | None = None) -> Any:
    v = attr_get(attrs, key, where)   # one lookup: absent, or opened, checked and read
    if v is MISSING:
        return default
    s = _str_value(v, key, where, budget)
    return clean_json(parse_json(s, f"attribute {key!r}{where}", error=TraceFileError))


def attr_int(attrs: Any, key: str, default: int | None = None, where: str = "") -> int:
    """An integral attribute (bool or integer-valued float accepted), within +-2^62."""
    v = _attr_number(attrs, key, default, where)
    f = float(v)
    if f != int(f):
        raise TraceFileError(f"attribute {key!r}{where} is not an integer ({f:g})")
    if abs(f) > 2.0**62:
        raise TraceFileError(f"attribute {key!r}{where} is out of range")
    return int(v)


def attr_float(attrs: Any, key: str, default: float | None = None, where: str = "") -> float:
    return float(_attr_number(attrs, key, default, where))


def _attr_number(attrs: Any, key: str, default: float | None, where: str) -> Any:
    v = attr_get(attrs, key, where)
    if v is MISSING:
        if default is not None:
            return default
        raise TraceFileError(f"missing attribute {key!r}{where}")
    if isinstance(v, np.ndarray):
        if v.size != 1:
            raise TraceFileError(f"attribute {key!r}{where} is not a number")
        v = v.reshape(())[()]
    if not isinstance(v, (int, float, bool, np.number, np.bool_)):
        raise TraceFileError(f"attribute {key!r}{where} is not a number")
    if not math.isfinite(float(v)):
        raise TraceFileError(f"attribute {key!r}{where} is not finite")
    return v


# -- links and datasets ------------------------------------------------------------------------


def follow(group: Any, name: str, what: str) -> Any:
    """``group[name]`` when it is a hard link (a dataset is also checked), None when absent.

    Low-level calls where h5py's ``group.get(name, getlink=True)`` then ``group[name]`` make the
    same checks with more of them (``group[name]`` also builds a File object to learn the
    mode): the link's existence and type, one open, the object's type and link count."""
    gid = group.id
    bname = name.encode("utf-8")   # h5py's name encoding: ASCII, else UTF-8 (the same bytes)
    # a link of this group by that name, its target not resolved (as h5py's `name in group`)
    if not (gid.links.exists(bname) if "/" not in name else h5g._path_valid(gid, bname, None)):
        return None
    typecode = gid.links.get_info(bname).type
    if typecode != h5l.TYPE_HARD:
        kind = ("an external link" if typecode == h5l.TYPE_EXTERNAL else "a soft link" if typecode == h5l.TYPE_SOFT
                else None)
        if kind is None:
            raise TypeError("Unknown link type")  # as h5py raises it: "damaged trace (...)"
        raise TraceFileError(f"{what} is {kind}; links are not followed (a trace is one self-contained file)")
    oid = h5o.open(gid, bname)
    otype = h5i.get_type(oid)
    if otype == h5i.GROUP:
        obj: Any = h5py.Group(oid)
    elif otype == h5i.DATASET:
        obj = h5py.Dataset(oid, readonly=True)  # traces are opened read-only
    elif otype == h5i.DATATYPE:
        obj = h5py.Datatype(oid)
    else:
        raise TypeError("Unknown object type")
    links = _link_count(oid)
    if links > 1:
        raise TraceFileError(f"{what} is one object linked under {links} names; a trace stores each object once "
                             "(the file is crafted or damaged)")
    if isinstance(obj, h5py.Dataset):
        check_dataset(obj, what)
    return obj


def _link_count(oid: Any) -> int:
    """How many hard links name the object (H5Gget_objinfo's count: H5Oget_info reads the whole
    header summary for it)."""
    try:
        return int(h5g.get_objinfo(oid).nlink)
    except AttributeError:  # an HDF5 built without the 1.6 API
        return int(h5o.get_info(oid).rc)


def check_dataset(ds: Any, what: str) -> None:
    """Refuse a dataset whose storage reaches outside the file, or that cannot be read safely."""
    dcpl = getattr(ds, "_dcpl", None)   # h5py's Dataset keeps its creation property list
    if dcpl is None:
        dcpl = ds.id.get_create_plist()
    layout = dcpl.get_layout()   # one read of what is_virtual and chunks each asked for again
    if layout == h5d.VIRTUAL:
        raise TraceFileError(f"{what} is a virtual dataset; datasets mapped from other files are not read")
    if dcpl.get_external_count() > 0:
        raise TraceFileError(f"{what} keeps its data in external files; they are not read")
    if ds.shape is None:
        raise TraceFileError(f"{what} is an empty (null) dataset")
    dt = ds.dtype
    if dt.itemsize == 0 or dt.itemsize > 1 << 16:
        raise TraceFileError(f"{what} has an element size of {dt.itemsize} bytes")
    chunks = dcpl.get_chunk() if layout == h5d.CHUNKED else None
    if chunks is not None and math.prod(chunks) * dt.itemsize > MAX_CHUNK_BYTES:
        raise TraceFileError(f"{what} has chunks of {math.prod(chunks) * dt.itemsize} bytes "
                             f"(more than {MAX_CHUNK_BYTES >> 20} MiB)")
    missing = []
    for fid in filters_of(ds):
        if not h5py.h5z.filter_avail(fid):
            try:
                import hdf5plugin  # type: ignore[import-not-found, unused-ignore]  # noqa: F401
            except ImportError:
                pass
            if not h5py.h5z.filter_avail(fid):
                missing.append(fid)
    if missing:
        raise TraceFileError(f"{what} is compressed with HDF5 filter {missing[0]}, which this install cannot decode "
                             "(pip install hdf5plugin)")


# -- the token table ---------------------------------------------------------------------------


def check_token_table(tok: Any) -> None:
    """/tokens: a 1-D compound table with integer columns (``step`` may be absent)."""
    if not isinstance(tok, h5py.Dataset) or tok.dtype.names is None or tok.ndim != 1:
        raise TraceFileError("/tokens is not a 1-D compound table")
    for col in TOKEN_COLUMNS:
        if col not in tok.dtype.names:
            if col == "step":
                continue
            raise TraceFileError(f"/tokens lacks the column {col!r}")
        ct = tok.dtype.fields[col][0]
        if ct.kind not in "iu" or ct.itemsize > 8:
            raise TraceFileError(f"/tokens column {col!r} is {ct}, expected an integer")


def check_token_values(t: np.ndarray) -> None:
    """Regime codes and positions of token rows within what the format defines."""
    if ((t["regime"] < 0) | (t["regime"] >= len(REGIMES))).any():
        raise TraceFileError("/tokens has an unknown regime code")
    if ((t["position"] < 0) | (t["position"] >= MAX_POSITION)).any():
        raise TraceFileError("/tokens has a position outside 0..2^40")


def check_sequences(seqs: Any) -> None:
    if (not isinstance(seqs, h5py.Dataset) or seqs.ndim != 1
            or not (h5py.check_string_dtype(seqs.dtype) is not None or seqs.dtype.kind == "S")):
        raise TraceFileError("/sequences is not a 1-D list of strings")


# -- a tensor's attributes ---------------------------------------------------------------------


def tensor_name_problem(name: str) -> str | None:
    """Why ``name`` cannot name a tensor (the writer, the reader and the importers share this
    rule), None when it can: 1..256 printable characters of valid UTF-8, no '/', not '.'."""
    if not name:
        return "an empty tensor name"
    if len(name) > MAX_NAME_CHARS:
        return f"a tensor name is longer than {MAX_NAME_CHARS} characters"
    if clean_text(name) != name or not name.isprintable():
        return f"a tensor name is not printable UTF-8 text ({clean_text(name)[:40]!r})"
    if "/" in name or name in (".", ".."):
        return f"tensor name {name!r} is a path, not a name (no '/', not '.' or '..')"
    return None


def check_tensor_name(name: str) -> None:
    problem = tensor_name_problem(name)
    if problem:
        raise TraceFileError(problem)


CHANGED = ("changed while it was being opened (replaced or modified since it was checked); run the command "
           "again once nothing is writing it")

#: Files the probe checked in this process, by path: a later open must find the same file there.
CHECKED: dict[str, FileIdentity] = {}


@dataclass
class TensorAttrs:
    """A tensor group's attributes, validated (what :class:`~tensordiff.trace.TensorInfo` is made of)."""

    kind: str
    dtype: str
    width: int
    slot_count: int
    slot_width: int
    slot_labels: list[str] | None
    raw_ids: list[int] | None
    boundary: int | None
    token_offset: int


def tensor_attrs(ga: Any, name: str, budget: Budget | None = None) -> TensorAttrs:
    """Check the attributes that say what a tensor is."""
    where = f" of tensor {name!r}"
    kind = attr_str(ga, "kind", where=where, budget=budget)
    if kind not in KINDS:
        raise TraceFileError(f"tensor {name!r} has unknown kind {kind[:40]!r}")
    dtype = attr_str(ga, "dtype", where=where, budget=budget)
    if dtype not in LOGICAL_DTYPES:
        raise TraceFileError(f"tensor {name!r} has unsupported dtype {dtype[:40]!r}")
    width = attr_int(ga, "width", where=where)
    k = attr_int(ga, "slot_count", where=where)
    sw = attr_int(ga, "slot_width", where=where)
    if width <= 0 or k <= 0 or sw <= 0 or k * sw != width or width > MAX_WIDTH or k > MAX_SLOTS:
        raise TraceFileError(f"tensor {name!r}: width {width} is not slot_count {k} x slot_width {sw}")
    labels = attr_json(ga, "slot_labels", None, where, budget)
    if labels is not None:
        if not isinstance(labels, list) or len(labels) != k or not all(isinstance(x, str) for x in labels):
            raise TraceFileError(f"tensor {name!r}: slot_labels must be a list of {k} strings")
        for lab in labels:
            try:
                parse_label(lab)
            except ValueError as e:
                raise TraceFileError(f"tensor {name!r}: {short(e)}") from None
    if kind == "packed" and labels is None:
        raise TraceFileError(f"packed tensor {name!r} has no slot_labels")
    raw_ids = attr_json(ga, "raw_ids", None, where, budget)
    if raw_ids is not None and (not isinstance(raw_ids, list) or not all(
            isinstance(x, int) and not isinstance(x, bool) for x in raw_ids)):
        raise TraceFileError(f"tensor {name!r}: raw_ids must be a list of integers")
    boundary = None
    if kind == "boundary":
        boundary = attr_int(ga, "boundary", where=where)
        if boundary < 0 or boundary > MAX_BOUNDARY:
            raise TraceFileError(f"tensor {name!r}: boundary {boundary} out of range")
    token_offset = attr_int(ga, "token_offset", default=0, where=where)
    if abs(token_offset) > MAX_TOKEN_OFFSET:
        raise TraceFileError(f"tensor {name!r}: token_offset {token_offset} out of range")
    return TensorAttrs(kind=kind, dtype=dtype, width=width, slot_count=k, slot_width=sw, slot_labels=labels,
                       raw_ids=raw_ids, boundary=boundary, token_offset=token_offset)


# -- values by reference -----------------------------------------------------------------------


def values_source_attr(ga: Any, name: str, budget: Budget | None = None) -> str | None:
    """A tensor's ``values_source`` attribute: the name of the tensor it takes values from by
    reference, checked as a name (it is looked up among the trace's tensors, never as a path); None
    when it has none."""
    v = attr_get(ga, "values_source", f" of tensor {name!r}")
    if v is MISSING:
        return None
    source = _str_value(v, "values_source", f" of tensor {name!r}", budget)
    problem = tensor_name_problem(source)
    if problem:
        raise TraceFileError(f"tensor {name!r}: values_source is not a tensor name ({problem})")
    if source == name:
        raise TraceFileError(f"tensor {name!r} takes its values by reference from itself")
    return source


def check_values_ref(ds: Any, name: str) -> None:
    if not isinstance(ds, h5py.Dataset) or ds.ndim != 1 or ds.dtype.kind != "i":
        raise TraceFileError(f"tensor {name!r}: values_ref is not a 1-D integer dataset ({getattr(ds, 'dtype', None)}, "
                             f"shape {getattr(ds, 'shape', None)}); expected one source row or -1 per row")


_REF_BLOCK = 1 << 20   # values_ref entries encoded per step (in place: no copy of the column)


def encode_refs(ref: np.ndarray, own_rows: int, name: str, exact: bool) -> np.ndarray:
    """A values_ref column (int64, changed in place) as the reader keeps it: a referenced row's
    source row as is, the i-th row of the tensor's own values (the i-th -1 entry) as ``-1 - i``.
    ``own_rows``: the rows of its own values dataset. ``exact`` (a complete trace): every entry must
    be -1 or a row index, and the -1 entries exactly ``own_rows``; otherwise (a recovered trace) the
    rows before the first that breaks either are kept (a shorter view is returned)."""
    seen = 0
    n = len(ref)
    for lo in range(0, n, _REF_BLOCK):
        blk = ref[lo:lo + _REF_BLOCK]
        below = blk < -1
        keep = len(blk)
        if below.any():
            keep = int(np.argmax(below))
            if exact:
                raise TraceFileError(f"tensor {name!r}: values_ref holds {int(blk[keep])}, expected -1 (its own "
                                     "values) or a row of its values_source")
        blk = blk[:keep]
        own = blk == -1
        count = np.cumsum(own, dtype=np.int64)
        count += seen
        if len(count) and int(count[-1]) > own_rows:
            if exact:
                raise TraceFileError(f"tensor {name!r}: values_ref has more rows of its own values (-1) than its "
                                     f"values dataset holds ({own_rows})")
            keep = int(np.searchsorted(count, own_rows, side="right"))
            blk, own, count = blk[:keep], own[:keep], count[:keep]
        blk[own] = -count[own]
        seen = int(count[-1]) if len(count) else seen
        if keep < min(_REF_BLOCK, n - lo):
            n = lo + keep
            break
    if exact and seen != own_rows:
        raise TraceFileError(f"tensor {name!r}: values_ref has {seen} rows of its own values (-1), but its values "
                             f"dataset holds {own_rows}")
    out: np.ndarray = ref[:n]
    return out
