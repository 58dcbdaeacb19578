"""Logical dtypes and their on-disk form.

h5py has no bfloat16. tensordiff stores bf16 as its raw 16 bits in a ``uint16`` dataset with the
attribute ``dtype = "bfloat16"``: bit-exact, fast, and plain integers to tools that do not know
the attribute. float16/32/64 are stored as themselves.
"""

from __future__ import annotations

import numpy as np

LOGICAL_DTYPES = ("bfloat16", "float16", "float32", "float64")
_STORAGE: dict[str, np.dtype] = {
    "bfloat16": np.dtype("<u2"),
    "float16": np.dtype("<f2"),
    "float32": np.dtype("<f4"),
    "float64": np.dtype("<f8"),
}
# Unit roundoff of each dtype: the scale of honest rounding noise.
EPS = {"bfloat16": 2.0**-8, "float16": 2.0**-11, "float32": 2.0**-24, "float64": 2.0**-53}


def storage_dtype(logical: str) -> np.dtype:
    try:
        return _STORAGE[logical]
    except KeyError:
        raise ValueError(f"unsupported dtype {logical!r}; one of {', '.join(LOGICAL_DTYPES)}") from None


def bf16_bits_to_f32(bits: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """uint16 bf16 bit patterns -> float32 values (exact)."""
    bits = np.asarray(bits, dtype=np.uint16)
    if out is None:
        out = np.empty(bits.shape, dtype=np.float32)
    o32 = out.view(np.uint32)
    np.left_shift(bits, 16, out=o32, dtype=np.uint32)
    return out


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits, round to nearest even (NaN kept NaN). For tests and importers."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    u = x.view(np.uint32)
    rounding = ((u >> 16) & 1) + np.uint32(0x7FFF)
    out = ((u + rounding) >> 16).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        out[nan] = (u[nan] >> 16).astype(np.uint16) | np.uint16(0x0040)
    return out


def to_float32(stored: np.ndarray, logical: str, out: np.ndarray | None = None) -> np.ndarray:
    """Stored block -> float32 for metrics (float64 is narrowed). ``out``: a reusable buffer of at
    least ``stored.size`` float32 elements (first touch of fresh memory is slow on this class of
    machine, so hot loops pass one)."""
    if out is not None:
        out = out.reshape(-1)[:stored.size].reshape(stored.shape)
    if logical == "bfloat16":
        return bf16_bits_to_f32(stored, out)
    if out is None:
        return np.asarray(stored, dtype=np.float32)
    np.copyto(out, stored, casting="unsafe")
    return out
