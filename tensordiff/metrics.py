"""Old home of the per-token metrics and tolerances; they live in :mod:`tensordiff.numerics` and
:mod:`tensordiff.tolerances` now. Kept so that ``from tensordiff.metrics import ...`` still works."""

from __future__ import annotations

from .numerics import BlockMetrics, cosine_matrix, finite_or_zero, rms_agreement
from .tolerances import Tolerance, ToleranceBook, calibrated_tolerance, coarser

__all__ = [
           "BlockMetrics",
           "Tolerance",
           "ToleranceBook",
           "calibrated_tolerance",
           "coarser",
           "cosine_matrix",
           "finite_or_zero",
           "rms_agreement",
]
