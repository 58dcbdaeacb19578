"""The diagnosis loop of ``tensordiff locate``: each step is the command a user could run alone
(printed with its real paths) and runs in this process, in the order docs/ports.md follows by hand:

1. record both sides with the catalog (full values) and diff;
2. when boundary ``layer<b+1>`` is the first out of the noise, record both again zoomed into
   layer b, B with A's ``layer<b>`` grafted in (the divergence must stay: the cause is not before
   it), diff: the op and its kind (the signatures);
3. record B zoomed with A's ``layer<b+1>`` grafted in, diff: nothing after it may diverge;
4. compare layer b's weights (checkpoints, or a ``module:`` port's live fingerprints) and the
   configs.

A recording is written to ``NAME.partial.h5`` and renamed when complete, so an interrupted run
leaves only complete traces, and ``--resume`` skips the recordings whose traces exist.

An engine side (``sglang:DIR``, ``vllm:DIR``) is recorded by the engine in a child process
(:mod:`.engines`); a graft the engine cannot do is said in the chain instead of run, and a zoom in
which the engine recorded no op of the layer stops the loop at the layer.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import shlex
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ..errors import UsageError
from ..vocab import boundary_label
from .engines import ENGINES
from .result import Evidence, LocateResult
from .sides import Side, check_prompts, resolve_side

__all__ = ["LocateInterrupted", "LocateOptions", "run_locate"]

_ATTENTION = ("attn_norm", "q", "k", "v", "q_rope", "k_rope", "attn_out")
#: configuration keys that say how a file was written, not how the model computes
_BOOKKEEPING = ("_name_or_path", "transformers_version", "architectures", "dtype", "torch_dtype", "use_cache",
                "output_hidden_states", "return_dict")


@dataclass(frozen=True)
class LocateOptions:
    a: str
    b: str
    prompts: str
    out: str
    dtype_a: str | None = None
    dtype_b: str | None = None
    name_rules: tuple[str, ...] = ()
    resume: bool = False
    progress: bool = True
    echo: Callable[[str], None] | None = None   # each step's command as it runs (the CLI: stderr)
    engine_args: tuple[str, ...] = ()           # --engine-arg KEY=VALUE for every engine recording
    html: str | None = None                     # the last diff's HTML report (tensordiff report)


class LocateInterrupted(Exception):
    """Ctrl-C during a step: the traces of the steps before it are complete in ``out``."""

    def __init__(self, step: str, out: str, done: list[str]):
        super().__init__(step)
        self.step, self.out, self.done = step, out, done


@dataclass(frozen=True)
class _Step:
    title: str
    argv: tuple[str, ...]
    shown: str | None = None   # as printed, where it is more than argv (an engine's variables)

    @property
    def command(self) -> str:
        return self.shown or shlex.join(self.argv)


class _Loop:
    def __init__(self, opts: LocateOptions):
        self.o = opts
        self.done: list[str] = []     # traces complete so far
        self.current = ""
        self.last_diff: tuple[str, str] | None = None   # the traces of the last diff run

    # -- running one step ------------------------------------------------------------------

    def _say(self, text: str) -> None:
        if self.o.echo is not None:
            self.o.echo(text)

    def record(self, title: str, side: Side, name: str, *extra: str) -> tuple[str, _Step]:
        """Record ``side`` into OUT/name.h5 (skipped with --resume where it exists)."""
        model = _check_recordable(side, extra)
        out = os.path.join(self.o.out, f"{name}.h5")
        if side.kind in ENGINES:
            return self._record_engine(title, side, name, out, extra)
        argv = ["tensordiff", "record", "train", "--model", model, "--prompts", self.o.prompts, "--out", out,
                "--topk", "0", "--values", "all", "--no-draft-input"]
        if side.dtype:
            argv += ["--dtype", side.dtype]
        argv += list(extra)
        if side.kind == "module" and "--zoom" in extra:
            for r in self.o.name_rules:
                argv += ["--name-rule", r]
        step = _Step(title, tuple(argv))
        self.current = title
        if self._resumed(title, name, out):
            return out, step
        self._say(f"[{title}] $ {step.command}")
        from ..recorders import train_cli

        p = argparse.ArgumentParser(prog="tensordiff record train")
        train_cli.add_arguments(p)
        partial = os.path.join(self.o.out, f"{name}.partial.h5")
        with contextlib.suppress(FileNotFoundError):   # what a killed run left: never a complete trace
            os.remove(partial)
        args = p.parse_args([partial if w == out else w for w in argv[3:]])
        args.no_progress = not self.o.progress
        with contextlib.redirect_stdout(io.StringIO()):   # its summary lines: the report says what matters
            try:
                train_cli.run(args)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.remove(partial)
                raise
        os.replace(partial, out)
        self.done.append(out)
        return out, step

    def _resumed(self, title: str, name: str, out: str) -> bool:
        """With --resume, the trace of this recording exists in DIR: skip it."""
        if self.o.resume and (os.path.islink(out) or (os.path.lexists(out) and not os.path.isfile(out))):
            # a run writes its traces as files in DIR: anything else there is not one of them
            raise UsageError(f"--resume: {name}.h5 in DIR is {'a symbolic link' if os.path.islink(out) else 'not a file'}"
                             "; a run writes its traces there as files: remove it, or give another --resume DIR", out)
        if self.o.resume and os.path.isfile(out):
            self._say(f"[{title}] skipped: {out} exists (--resume)")
            self.done.append(out)
            return True
        return False

    def _record_engine(self, title: str, side: Side, name: str, out: str, extra: tuple[str, ...]) -> tuple[str, _Step]:
        """An engine side: ``record serve`` in a child process (the plugins zoom and graft through
        the environment); its output goes to OUT/name.log, kept where it fails."""
        from . import engines

        opt = dict(zip(extra[::2], extra[1::2]))
        model = side.model
        assert model is not None

        def serve(path: str) -> engines.EngineRun:
            return engines.serve_run(side.kind, model, self.o.prompts, path, side.dtype, zoom=opt.get("--zoom"),
                                     graft=opt.get("--graft"), engine_args=self.o.engine_args)

        shown = serve(out)
        step = _Step(title, shown.argv, shown.command)
        self.current = title
        if self._resumed(title, name, out):
            return out, step
        self._say(f"[{title}] $ {shown.command}")
        partial = os.path.join(self.o.out, f"{name}.partial.h5")
        log = os.path.join(self.o.out, f"{name}.log")
        with contextlib.suppress(FileNotFoundError):
            os.remove(partial)
        try:
            engines.run(serve(partial), log)
        except BaseException:
            with contextlib.suppress(OSError):
                os.remove(partial)
            raise
        os.replace(partial, out)
        with contextlib.suppress(OSError):
            os.remove(log)
        self.done.append(out)
        return out, step

    def diff(self, title: str, a: str, b: str) -> tuple[Any, _Step]:
        from ..diff import DiffOptions, diff_traces

        step = _Step(title, ("tensordiff", "diff", a, b))
        self.current = title
        self._say(f"[{title}] $ {step.command}")
        with _bar(self.o.progress, title) as cb:
            res = diff_traces(a, b, DiffOptions(progress=cb))
        return res, step


class _CannotRecord(Exception):
    pass


def _check_recordable(side: Side, extra: tuple[str, ...]) -> str:
    """The model that records ``side`` again; a _CannotRecord saying why there is none."""
    if side.model is None:
        raise _CannotRecord(f"{side.name} is a trace that names no model to record again from --prompts "
                            f"({side.spec}: an engine's, an imported or a --from-serve trace, or its model is gone); "
                            f"record {side.name} with {' '.join(extra)} yourself (an engine: TENSORDIFF_ZOOM "
                            "and TENSORDIFF_GRAFT, docs/ports.md sections 5 and 6)")
    return side.model


@contextlib.contextmanager
def _bar(enabled: bool, title: str) -> Iterator[Callable[[str, int, int], None] | None]:
    """A transient rich progress bar on stderr when it is a terminal (NO_COLOR respected)."""
    if not enabled or not sys.stderr.isatty():
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    prog = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                    TimeRemainingColumn(), console=Console(stderr=True, no_color=bool(os.environ.get("NO_COLOR")) or None),
                    transient=True)
    tasks: dict[str, Any] = {}

    def update(stage: str, done: int, total: int) -> None:
        if stage not in tasks:
            tasks[stage] = prog.add_task(f"{title}: {stage}", total=total)
        prog.update(tasks[stage], completed=done, total=total)

    with prog:
        yield update


# ----------------------------------------------------------------------------------------------


def run_locate(opts: LocateOptions) -> LocateResult:
    """The loop; a :class:`LocateInterrupted` on Ctrl-C, a UsageError on bad input."""
    a = resolve_side("A", opts.a, opts.dtype_a)
    b = resolve_side("B", opts.b, opts.dtype_b)
    check_prompts(opts.prompts)
    if os.path.exists(opts.out) and not os.path.isdir(opts.out):
        raise UsageError("--out: exists and is not a directory", opts.out)
    if os.path.isdir(opts.out) and not opts.resume and any(n.endswith(".h5") for n in os.listdir(opts.out)):
        raise UsageError("--out holds traces already: give --resume DIR to continue from them, or another --out",
                         opts.out)
    if opts.html:
        from ..safety import check_output_path

        check_output_path(opts.html, [x.trace for x in (a, b)], "--html")
    os.makedirs(opts.out, exist_ok=True)
    loop = _Loop(opts)
    try:
        res = _run(loop, a, b)
        if opts.html and loop.last_diff is not None:
            _write_html(loop, res, opts.html)
        return res
    except KeyboardInterrupt:
        raise LocateInterrupted(loop.current, opts.out, list(loop.done)) from None


def _write_html(loop: _Loop, res: LocateResult, path: str) -> None:
    """The last diff's HTML report (``tensordiff report``), named in the result."""
    assert loop.last_diff is not None
    a, b = loop.last_diff
    loop.current = "write the HTML report"
    loop._say(f"[write the HTML report] $ {shlex.join(['tensordiff', 'report', a, b, '-o', path])}")
    from ..report.html import make_report

    make_report(a, b, path)
    res.html = os.path.abspath(path)


def _run(loop: _Loop, a: Side, b: Side) -> LocateResult:
    out = loop.o.out
    ev: list[Evidence] = []
    res = LocateResult(verdict="", exit_code=1, out_dir=out, evidence=ev)

    # 1. both sides, the catalog, one diff
    cmds = []
    paths = {}
    for side, name in ((a, "a"), (b, "b")):
        if side.trace is not None:
            paths[name] = side.trace
        else:
            paths[name], st = loop.record(f"record {side.name}", side, name)
            cmds.append(st.command)
    res.traces.update(paths)
    plain, st = loop.diff("diff", paths["a"], paths["b"])
    loop.last_diff = (paths["a"], paths["b"])
    cmds.append(st.command)
    first = plain.first_divergence
    if plain.exit_code == 0:
        ev.append(Evidence("record both sides and diff", plain.headline(), tuple(cmds)))
        res.verdict = f"A and B agree: {plain.headline()}"
        res.exit_code = 0
        return res
    boundary = re.fullmatch(r"layer(\d+)", (first.tensor or "") if first is not None else "")
    layer = int(boundary.group(1)) - 1 if boundary and int(boundary.group(1)) >= 1 else None
    ev.append(Evidence("record both sides and diff", plain.headline()
                       + (f" (boundary layer{layer + 1} is the output of decoder layer {layer})" if layer is not None else ""),
                       tuple(cmds)))
    if layer is None or first is None:
        res.verdict = f"the cause is not inside a decoder layer: {plain.headline()}"
        _weights_and_configs(loop, res, a, b, None)
        res.verdict += "; " + _weights_clause(res, None)
        return res
    res.layer = layer
    before, after = boundary_label(layer), boundary_label(layer + 1)

    # 2. zoom into the layer: B with A's input to it grafted in (where B can graft it)
    from . import engines

    n_layers = _num_layers(b)
    no_before = engines.graft_refusal(b.kind, before, n_layers) if b.kind in ENGINES else None
    try:
        for side in (a, b):   # both, before either is recorded again
            _check_recordable(side, ("--zoom", f"layer{layer}"))
        az, st_az = loop.record(f"record A zoomed into layer{layer}", a, f"a-z{layer}", "--zoom", f"layer{layer}")
        if no_before is None:
            bz, st_bz = loop.record(f"record B zoomed into layer{layer}, {before} from A", b,
                                    f"b-z{layer}-graft-{before}", "--zoom", f"layer{layer}", "--graft", f"{az}:{before}")
        else:   # its own input to the layer: the first diff found it within the noise
            bz, st_bz = loop.record(f"record B zoomed into layer{layer}", b, f"b-z{layer}", "--zoom", f"layer{layer}")
    except _CannotRecord as e:
        res.verdict = f"the cause is inside decoder layer {layer} (its output {after} is the first state out of the noise); {e}"
        return res
    res.traces.update({"a_zoom": az, "b_zoom": bz})
    blind = next((s for s, path in ((a, az), (b, bz)) if s.kind in ENGINES and not _has_taps(path, layer)), None)
    if blind is not None:
        # the engine's modules gave no op of the layer: the layer is as far as the evidence goes
        said = (f"{blind.kind} recorded no op of layer {layer} with TENSORDIFF_ZOOM=layer{layer} (its modules "
                f"do not map to the taps, docs/ports.md section 5): the cause is located at the layer level only; "
                f"see what each side recorded with: tensordiff diff {shlex.quote(az)} {shlex.quote(bz)}")
        ev.append(Evidence(f"zoom into layer {layer}", said, (st_az.command, st_bz.command)))
        _weights_and_configs(loop, res, a, b, layer)
        res.verdict = (f"the cause is inside decoder layer {layer} (its output {after} is the first state out of the "
                       f"noise); {said}; " + _weights_clause(res, layer))
        return res
    zoomed, st_zd = loop.diff(f"diff zoomed into layer{layer}", az, bz)
    loop.last_diff = (az, bz)
    from ..report import opgraph

    res.op_graph = opgraph.line(zoomed, layer) or None
    zf = zoomed.first_divergence
    op_words = _op_words(zf, layer)
    res.op = zf.tensor if zf is not None else None
    res.kind = _kind(zf)
    ev.append(Evidence(f"zoom into layer {layer}", zoomed.headline(), (st_az.command, st_bz.command, st_zd.command)))
    stays = _graft_after(zoomed) if no_before is None else None
    if no_before is not None:
        ev.append(Evidence(f"graft {before} from A", f"not run: {no_before}; B was zoomed with its own input to "
                           f"layer {layer}, which the first diff found within the noise", ()))
    elif stays is not None:
        said = (f"with {before} (the input of layer {layer}) taken from A in B, {stays} divergence(s) after it "
                f"remain: the cause is not before layer {layer}" if stays
                else f"with {before} taken from A in B nothing after it diverges: the cause is before layer {layer}")
        ev.append(Evidence(f"graft {before} from A", said, (st_bz.command, st_zd.command)))

    # 3. confirm: A's output of the layer grafted into B
    no_after = engines.graft_refusal(b.kind, after, n_layers) if b.kind in ENGINES else None
    if no_after is not None:
        by_hand = _graft_by_hand(loop, b, az, after) if b.kind == "vllm" else ""
        graft_words = f"not confirmed by a graft: {no_after}"
        ev.append(Evidence(f"graft {after} from A", graft_words + (
            f"; where the cause is in the directory (not in vLLM's own code), confirm it by hand in SGLang: {by_hand}"
            if by_hand else ""), ()))
    else:
        bg, st_bg = loop.record(f"record B with {after} from A", b, f"b-z{layer}-graft-{after}",
                                "--zoom", f"layer{layer}", "--graft", f"{az}:{after}")
        res.traces["b_graft"] = bg
        grafted, st_gd = loop.diff(f"diff with {after} grafted", az, bg)
        loop.last_diff = (az, bg)
        left = _graft_after(grafted)
        first_left = _first_after(grafted, after)
        if left == 0:
            graft_words = f"confirmed by grafting {after} from A: nothing after it diverges"
        elif left is None:
            graft_words = f"not confirmed: the diff of the run with {after} grafted says nothing of the graft"
        else:
            graft_words = (f"not confirmed inside layer {layer} alone: with {after} grafted from A, {left} divergence(s) "
                           f"after it remain (the first: {first_left}), so a cause lies after layer {layer} as well")
        res.confirmed = bool(left == 0 and stays is not None and stays > 0)
        if left == 0 and stays == 0:
            graft_words += f", but grafting {before} removes the divergence too: the cause is before layer {layer}"
        note = _graft_note(grafted)
        ev.append(Evidence(f"graft {after} from A", graft_words + (f" ({note.details.evidence})" if note is not None else ""),
                           (st_bg.command, st_gd.command)))

    # 4. the layer's weights and the configs
    _weights_and_configs(loop, res, a, b, layer)
    res.verdict = f"the cause is inside layer {layer}'s {_region(res.op, layer)}: {op_words}; {graft_words}; " \
                  + _weights_clause(res, layer)
    return res


def _num_layers(side: Side) -> int:
    """The decoder layers of a side's model directory (0 where its config does not say)."""
    from ..errors import TensordiffError
    from ..safety import read_json_file

    if side.model is None or side.model.startswith("module:"):
        return 0
    try:
        cfg = read_json_file(os.path.join(side.model, "config.json"), "config.json")
        text = cfg.get("text_config") or cfg
        return int(text.get("num_hidden_layers") or 0)
    except (TensordiffError, AttributeError, TypeError, ValueError):
        return 0


def _has_taps(path: str, layer: int) -> bool:
    """Whether a zoomed trace holds any tap of ``layer`` (an engine's modules may map to none)."""
    from ..trace import TraceReader

    with TraceReader(path) as r:
        return any(n.startswith(f"layer{layer}.") for n in r.tensors)


def _graft_by_hand(loop: _Loop, b: Side, az: str, state: str) -> str:
    """What confirms a vLLM side's cause where vLLM cannot graft: the same directory served by
    SGLang with A's state grafted in, then the diff."""
    from . import engines

    assert b.model is not None
    out = os.path.join(loop.o.out, f"b-sglang-graft-{state}.h5")
    r = engines.serve_run("sglang", b.model, loop.o.prompts, out, b.dtype, graft=f"{az}:{state}")
    return f"{r.command}; tensordiff diff {shlex.quote(az)} {shlex.quote(out)}"


def _kind(f: Any) -> str | None:
    if f is None:
        return None
    if str(f.kind) == "signature":
        return str(f.details.signature)
    return str(f.kind)


def _region(op: str | None, layer: int) -> str:
    m = re.fullmatch(rf"layer{layer}\.([a-z_]+)", op or "")
    if m is None:
        return "residual stream (no op of the layer diverges before its output)"
    return "attention" if m.group(1) in _ATTENTION else "MLP"


def _op_words(f: Any, layer: int) -> str:
    if f is None:
        return f"no op of layer {layer} leaves the noise when zoomed"
    if str(f.kind) == "signature":
        d = f.details
        return f"{f.tensor} ({d.signature}): {d.what}; look at {d.cause}"
    return f"{f.tensor} ({f.kind}): {f.message}"


def _graft_note(res: Any) -> Any:
    return next((f for f in res.findings if str(f.kind) == "signature" and f.details.signature == "graft"), None)


def _graft_after(res: Any) -> int | None:
    """How many divergences the diff of a grafted run finds after the grafted state."""
    g = _graft_note(res)
    if g is None:
        return None
    n = g.details.params.get("after")
    return int(n) if isinstance(n, int) else None


def _first_after(res: Any, state: str) -> str | None:
    g = _graft_note(res)
    if g is None:
        return None
    return next((f.tensor for f in res.divergences if f.order > g.order), None)


# ----------------------------------------------------------------------------------------------
# weights and configs
# ----------------------------------------------------------------------------------------------


def _snapshot(side: Side, out: str) -> tuple[Any, dict[str, Any], str, str] | None:
    """(checkpoint or fingerprints, config, what `tensordiff weights` reads, the command that wrote
    it) of a side's model; None without one. A ``module:`` port's live fingerprints are written
    to OUT/<side>-fingerprints.json."""
    from .. import weights

    if side.model is None:
        return None
    if side.model.startswith("module:"):
        from ..recorders import user_module

        doc, cfg = user_module.snapshot(side.model)
        mod, attr = user_module.parse_spec(side.model)
        path = os.path.join(out, f"{side.name.lower()}-fingerprints.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(doc, f)
        code = (f"import json; from tensordiff.recorders.user_module import build; "
                f"from tensordiff.recorders.weights_fp import model_fingerprints; "
                f"print(json.dumps(model_fingerprints(build({side.model!r}, 'auto', 'cpu'), source={side.model!r})))")
        cmd = f"python -c {shlex.quote(code)} > {shlex.quote(path)}"
        return weights.checkpoint_from_doc(doc, side.model), cfg, path, cmd
    cfg_path = os.path.join(side.model, "config.json")
    from ..errors import TensordiffError
    from ..safety import read_json_file

    try:   # bounded in size and depth; an unreadable config compares as none
        cfg = read_json_file(cfg_path, "config.json")
    except TensordiffError:
        cfg = {}
    return weights.load(side.model), cfg if isinstance(cfg, dict) else {}, side.model, ""


def _weights_and_configs(loop: _Loop, res: LocateResult, a: Side, b: Side, layer: int | None) -> None:
    from .. import weights

    if a.model is None or b.model is None:
        return
    loop.current = "compare the weights"
    loop._say(f"[compare the weights] $ {shlex.join(['tensordiff', 'weights', a.model, b.model])}"
              + (" (a module: port's live fingerprints)" if "module:" in a.model + b.model else ""))
    with _bar(loop.o.progress, "compare the weights") as bar:
        if bar is not None:
            bar("reading the checkpoints", 0, 2)
        sa = _snapshot(a, loop.o.out)
        if bar is not None:
            bar("reading the checkpoints", 1, 2)
        sb = _snapshot(b, loop.o.out)
        if bar is not None:
            bar("reading the checkpoints", 2, 2)
    if sa is None or sb is None:
        return
    cmds = [c for c in (sa[3], sb[3]) if c]
    cmds.append(shlex.join(["tensordiff", "weights", sa[2], sb[2]]))
    ca, cb = sa[0], sb[0]
    if layer is not None:
        ca, cb = _layer_only(ca, layer), _layer_only(cb, layer)
    cmp = weights.compare(ca, cb)
    res.weights_equal = cmp.exit_code == 0
    where = f"layer {layer}" if layer is not None else "the model"
    lines = cmp.lines()
    ev = (f"the weights of {where} are equal ({cmp.compared} parameters)" if res.weights_equal
          else f"the weights of {where} differ: {lines[0].removeprefix('weights differ: ')}")
    res.config_diffs = _config_diffs(sa[1], sb[1])
    cfg = ("the configs are equal" if not res.config_diffs
           else f"the configs differ: {'; '.join(res.config_diffs)}")
    res.evidence.append(Evidence("compare the weights and configs", f"{ev}; {cfg}", tuple(cmds)))


def _layer_only(ck: Any, layer: int) -> Any:
    from .. import names, weights

    keep = {k: p for k, p in ck.params.items()
            if p.canon is not None and (st := names.maybe_state(p.canon)) is not None and st.kind == "tap"
            and st.layer == layer}
    return weights.Checkpoint(ck.path, keep, ck.num_layers, ck.fingerprints_only)


def _config_diffs(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    ta, tb = a.get("text_config"), b.get("text_config")
    a = {**a, **ta} if isinstance(ta, dict) else a
    b = {**b, **tb} if isinstance(tb, dict) else b
    out = []
    for k in sorted(set(a) & set(b)):
        if k in _BOOKKEEPING or k == "text_config":
            continue
        if a[k] != b[k]:
            out.append(f"{k}: A {_short(a[k])}, B {_short(b[k])}")
    return out


def _short(v: Any) -> str:
    s = json.dumps(v, sort_keys=True, default=str)
    return s if len(s) <= 80 else s[:77] + "..."


def _weights_clause(res: LocateResult, layer: int | None) -> str:
    where = f"layer {layer}" if layer is not None else "the model"
    if res.weights_equal is None:
        w = f"the weights of {where} not compared (no checkpoint)"
    elif res.weights_equal:
        w = f"the weights of {where} are equal"
    else:
        w = next((e.sentence.split(";")[0] for e in res.evidence if e.step == "compare the weights and configs"),
                 f"the weights of {where} differ")
    if res.weights_equal is None:
        return w
    return w + ("; the configs are equal" if not res.config_diffs else f"; the configs differ: {'; '.join(res.config_diffs)}")
