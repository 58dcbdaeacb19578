"""The compiled part of tensordiff; everything else is in pyproject.toml.

tensordiff/_kernels.c holds the diff's per-row sums and the identity search's dot products: one
pass over each element, float64 sums in a fixed order. Floating-point contraction is off, so no
compiler turns a product and a sum into one FMA: every CPU path (AVX-512, AVX2, portable, picked
at import by what the CPU has) gives the same bits.

The extension is optional: where it cannot be built (no C compiler, no Python headers) the install
goes on without it and tensordiff.kernels runs numpy versions of the same sums (same bits, slower;
docs/architecture.md says what differs).
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("tensordiff._kernels", sources=["tensordiff/_kernels.c"],
                             extra_compile_args=["-O2", "-ffp-contract=off"], optional=True)])
