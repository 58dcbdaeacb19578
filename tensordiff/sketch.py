"""Seeded Gaussian sketches: a shared random projection R[H, d] turns any H-wide state into a
d-wide fingerprint whose cosine similarity approximates the full one (Johnson-Lindenstrauss).

Both sides rebuild the same R from (seed, H, d), so traces recorded apart stay comparable.
numpy only; recorders convert R to a torch tensor once and project where the data lives.
"""

from __future__ import annotations

import functools

import numpy as np

DEFAULT_SKETCH_DIM = 128
DEFAULT_SKETCH_SEED = 20260


@functools.lru_cache(maxsize=8)
def projection(hidden_size: int, dim: int = DEFAULT_SKETCH_DIM, seed: int = DEFAULT_SKETCH_SEED) -> np.ndarray:
    """The [hidden_size, dim] float32 projection for (seed, hidden_size, dim). Read-only."""
    rng = np.random.Generator(np.random.PCG64(seed))
    r = rng.standard_normal((hidden_size, dim), dtype=np.float32)
    r /= np.float32(np.sqrt(dim))
    r.setflags(write=False)
    return r


def sketch_np(x: np.ndarray, slot_width: int, dim: int = DEFAULT_SKETCH_DIM,
              seed: int = DEFAULT_SKETCH_SEED) -> np.ndarray:
    """Sketch rows of ``x`` [n, k*slot_width] slot by slot -> [n, k*dim] float32."""
    x = np.asarray(x, dtype=np.float32)
    n, width = x.shape
    k = width // slot_width
    r = projection(slot_width, dim, seed)
    with np.errstate(invalid="ignore", over="ignore"):  # NaN/Inf rows stay NaN/Inf: a finding, not a warning
        out: np.ndarray = x.reshape(n, k, slot_width) @ r  # [n, k, dim]
    return out.reshape(n, k * dim).astype(np.float32, copy=False)


def sketch_rows(x: np.ndarray, slot_width: int, dim: int = DEFAULT_SKETCH_DIM,
                seed: int = DEFAULT_SKETCH_SEED) -> np.ndarray:
    """:func:`sketch_np` for a block of float32 rows ``x`` [n, k*slot_width] -> [n, k*dim], as one
    2-D matmul over the n*k slot rows (the form the torch recorders use; several times faster than
    the per-row products of :func:`sketch_np` on a block). Same projection; the values agree with
    :func:`sketch_np`'s within float32 rounding (another summation order), not bit for bit.
    TraceWriter computes the sketches it owes with this, one values chunk at a time."""
    n, width = x.shape
    k = width // slot_width
    r = projection(slot_width, dim, seed)
    with np.errstate(invalid="ignore", over="ignore"):  # NaN/Inf rows stay NaN/Inf: a finding, not a warning
        out: np.ndarray = np.asarray(x, dtype=np.float32).reshape(n * k, slot_width) @ r  # [n*k, dim]
    return out.reshape(n, k * dim)
