"""Importers: turn files users already have into a trace, one module per source format.

=================== ===============================================================================
:mod:`.files`       reading sources safely: regular files only, headers checked first,
                    ``torch.load(weights_only=True)``, bounded gunzip, safetensors; directory walks
:mod:`.common`      :class:`ImportResult`, shape checks, the trace-writing helpers
:mod:`.dispatch`    :func:`detect_format` and :func:`import_files` for the three formats below
:mod:`.offline`     the draft trainers' one-sequence-per-file hidden states: slot plan, recording
:mod:`.specforge`   SpecForge ``.ckpt`` / ``.ckpt.gz`` samples (``aux_hidden_state``, ``hidden_state``)
:mod:`.speculators` speculators ``.pt`` data files (``hidden_states`` list / [L, K, H], or v0)
:mod:`.sglang_dump` SGLang dumper directories (``step=..___rank=..___name=...pt``)
:mod:`.engines`     vLLM ``extract_hidden_states``, TensorRT-LLM, Model-Optimizer
                    (:func:`detect_engine_format`, :func:`import_engine_files`)
=================== ===============================================================================

Every file is read with ``torch.load(..., weights_only=True)`` (or safetensors) only; a file that
does not load or does not hold what its format promises raises a
:class:`~tensordiff.errors.TensordiffError` subclass with one line. This package imports torch:
the CLI imports it only inside ``tensordiff import``.
"""

from __future__ import annotations

from .common import ImportResult
from .dispatch import FORMATS, detect_format, import_files
from .engines import ENGINE_FORMATS, detect_engine_format, import_engine_files
from .files import GZ_MAX_RATIO, GZ_SLACK, load_safetensors_file, load_torch_file, natural_key
from .sglang_dump import parse_dump_filename, tags_name_only

__all__ = ["load_torch_file", "detect_format", "import_files", "ImportResult", "FORMATS",
           "parse_dump_filename", "natural_key", "ENGINE_FORMATS", "detect_engine_format",
           "import_engine_files", "load_safetensors_file", "tags_name_only", "GZ_MAX_RATIO", "GZ_SLACK"]
