"""The TUI stays split the way Textual apps split (toolong's, for one): a thin App (the diff
thread, the files it owns, help, screenshot, quit), a screen that lays the panes out, panes that
hold their own state, and the messages between them written as dataclasses in one module.
No app is run here: these read the modules."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import pkgutil
from pathlib import Path

import tensordiff.tui as tui
from tensordiff.tui import app, messages


def _class(path: str, name: str) -> ast.ClassDef:
    return next(n for n in ast.parse(Path(path).read_text()).body if isinstance(n, ast.ClassDef) and n.name == name)


def test_the_app_stays_thin():
    src = Path(app.__file__).read_text()
    methods = [n.name for n in _class(app.__file__, "TensordiffApp").body
               if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
    assert len(methods) <= 25, f"TensordiffApp has {len(methods)} methods: {methods}"
    assert len(src.splitlines()) <= 300
    # the app asks its screen to show things; it does not look the panes up itself
    assert "query" not in src


def test_every_message_of_the_tui_is_a_dataclass_of_the_messages_module():
    from textual.message import Message

    ours = []
    for info in pkgutil.iter_modules(tui.__path__):
        mod = importlib.import_module(f"tensordiff.tui.{info.name}")
        for _, cls in inspect.getmembers(mod, inspect.isclass):
            if issubclass(cls, Message) and cls.__module__.startswith("tensordiff."):
                assert cls.__module__ == messages.__name__, f"{cls.__qualname__} is defined in {cls.__module__}"
                ours.append(cls)
    assert {c.__name__ for c in ours} >= {"DiffProgress", "DiffEnded", "CellSelected", "FindingPicked", "ColumnPicked"}
    assert all(dataclasses.is_dataclass(c) for c in ours), [c.__name__ for c in ours if not dataclasses.is_dataclass(c)]
