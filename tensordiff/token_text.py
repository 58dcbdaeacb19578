"""Token ids as text, for the reports and the TUI (``--tokenizer DIR``, or the model directory a
trace records in its ``model.path``).

The tokenizer libraries are imported lazily and only here: ``tokenizers`` reads a directory's
``tokenizer.json`` directly (fast to import); without that file, or without that library,
transformers' ``AutoTokenizer`` loads the directory, where transformers is installed. Nothing in
the core imports either at module level. A token shows as a quoted, escaped string
(``' the'``, ``'\\n'``); an id the tokenizer does not know shows as ``?``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable

from .errors import UsageError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class TokenText:
    """Decodes single token ids of one tokenizer (cached: reports ask for the same ids often)."""

    def __init__(self, decode: Callable[[int], str], source: str):
        self._decode = decode
        self.source = source
        self._cache: dict[int, str | None] = {}

    def raw(self, token: int) -> str | None:
        """The decoded text of one token id, or None when the tokenizer has no such id."""
        token = int(token)
        if token not in self._cache:
            try:
                self._cache[token] = self._decode(token)
            except Exception:  # noqa: BLE001 - an id out of the vocabulary, or a tokenizer that cannot decode it
                self._cache[token] = None
        return self._cache[token]

    def __call__(self, token: int | None) -> str:
        """The token as a quoted, escaped string (``' the'``), ``?`` when it cannot be decoded."""
        if token is None or int(token) < 0:
            return ""
        t = self.raw(int(token))
        return "?" if t is None else repr(t)


def has_tokenizer(directory: str) -> bool:
    return os.path.isdir(directory) and any(os.path.isfile(os.path.join(directory, f)) for f in TOKENIZER_FILES)


def load(directory: str) -> TokenText:
    """A tokenizer from a directory; a UsageError (one line, exit 2) when it cannot be loaded."""
    if not os.path.isdir(directory):
        raise UsageError(f"--tokenizer {directory}: not a directory")
    tj = os.path.join(directory, "tokenizer.json")
    if os.path.isfile(tj):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            pass
        else:
            try:
                tk = Tokenizer.from_file(tj)
            except Exception as e:  # noqa: BLE001 - a damaged tokenizer.json is bad input
                raise UsageError(f"cannot read {tj}: {' '.join(str(e).split())[:200]}") from None
            return TokenText(lambda i: tk.decode([i], skip_special_tokens=False), tj)
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise UsageError(f"--tokenizer {directory}: reading this tokenizer needs transformers "
                         "(pip install 'tensordiff[torch]') or a tokenizer.json with the tokenizers package") from None
    try:
        tok = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - whatever transformers raises on a bad directory
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UsageError(f"--tokenizer {directory}: not a tokenizer directory ({first[:200]})") from None

    def decode(i: int) -> str:
        s = tok.decode([i], skip_special_tokens=False)
        return s if isinstance(s, str) else "".join(s)   # one id decodes to one string
    return TokenText(decode, directory)


def resolve(tokenizer: str | None, model_dirs: Iterable[str | None] = ()) -> TokenText | None:
    """The tokenizer asked for (``--tokenizer DIR``: an error if it does not load), else the first
    recorded model directory that exists here and has tokenizer files (None when none does, or
    when it does not load: token text is a convenience, never a reason to fail a diff)."""
    if tokenizer:
        return load(tokenizer)
    for d in model_dirs:
        if d and has_tokenizer(d):
            tt = _try_load(d)
            if tt is not None:
                return tt
    return None


def _try_load(directory: str) -> TokenText | None:
    try:
        return load(directory)
    except UsageError:
        return None   # a recorded directory that does not load: token text is optional


def recorded_model_dirs(*paths: str) -> list[str]:
    """The model directories the traces record (``model.path``), in the order given."""
    from .traceset import open_trace

    def recorded(p: str) -> object:
        try:
            with open_trace(p) as r:  # a file or a trace set
                return r.model.get("path")
        except Exception:  # noqa: BLE001 - the diff reports a bad trace itself, in its own words
            return None

    return [d for d in map(recorded, paths) if isinstance(d, str) and d]
