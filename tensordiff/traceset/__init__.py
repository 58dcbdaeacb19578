"""A trace set: many per-rank or per-shard trace files read as one trace (numpy + h5py only).

``tensordiff diff A_DIR B_DIR`` (or a glob) opens every ``*.h5`` / ``*.hdf5`` file of a directory
as one :class:`TraceSet`, an object with the interface the aligner and the diff use of
:class:`~tensordiff.trace.TraceReader` (``tokens``, ``sequences``, ``tensors``, ``token_rows``,
``read_at``, ``read_values_at``, ...). It holds the member readers open and delegates every
tensor read to the member that holds the row: no tensor data is copied or rewritten.

How members combine (docs/distributed.md):

- File names carry the ranks the SGLang plugin gives them (``serve.dp1.pp0.tp1.h5``: ``.dp<k>``,
  ``.pp<k>``, ``.tp<k>`` before the extension); a file without them is its own shard.
- Members that differ in DP rank, or are different shards, hold different tokens: their token
  tables are united, and a (sequence, position) recorded by two of them is refused.
- Members that differ in PP rank hold different layers of the same tokens: their tensors are
  joined; every stage 0..P-1 must be present for every shard.
- Members that differ only in TP rank are replicas where they hold the same tensor at the same
  token (replicated TP), and shards where they hold different tokens (DP attention). Replicated
  rows are compared bit for bit (:meth:`TraceSet.check_replicas`) and the lowest rank's are used;
  a difference is a :class:`ReplicaMismatch`, which the diff reports as a divergence. The same
  holds for a tensor that two PP stages both recorded.

Bad sets (mixed models or sides, duplicate DP tokens, a missing stage or rank, files that disagree
on a token id, an empty directory) raise one-line errors (exit code 2 in the CLI).

One module per job:

- :mod:`.paths`: which files a spec names (directory, glob), the rank suffixes of a file name;
- :mod:`.members`: one :class:`Member` per file, and the checks that the files are one recording
  (sides, models, sketches, every DP rank, PP stage and TP rank present, renamed files);
- :mod:`.union`: the DP union of the token tables (disjoint shards, agreeing token ids);
- :mod:`.join`: the PP join of the tensors and where TP / PP replicas are;
- :mod:`.replicas`: the bit-for-bit replica comparison, in picklable pieces for worker pools;
- :mod:`.index`: which file holds what (``tensordiff info`` on a set);
- :mod:`.reader`: :class:`TraceSet` itself, which delegates every read to the members, and
  :func:`open_trace`.
"""

from __future__ import annotations

from .index import index_lines
from .members import MODEL_KEYS, Member
from .paths import AXES, TRACE_EXTENSIONS, is_set_spec, parse_ranks, set_paths, trace_paths
from .reader import TraceSet, open_trace
from .replicas import REPLICA_BLOCK_ROWS, ReplicaMismatch, ReplicaPartial, ReplicaTask, compare_replica_rows

__all__ = [
    "AXES",
    "MODEL_KEYS",
    "REPLICA_BLOCK_ROWS",
    "TRACE_EXTENSIONS",
    "Member",
    "ReplicaMismatch",
    "ReplicaPartial",
    "ReplicaTask",
    "TraceSet",
    "compare_replica_rows",
    "index_lines",
    "is_set_spec",
    "open_trace",
    "parse_ranks",
    "set_paths",
    "trace_paths",
]
