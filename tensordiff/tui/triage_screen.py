"""The RL triage in the terminal (``tensordiff triage TRAIN ROLLOUT [PREFILL] --tui``): the
cause sentence, the per-token log-prob difference of one sequence at a time (walked with j/k, or
n/p), the error per state against the noise trend and the regime split; the arrows and page keys
scroll."""

from __future__ import annotations

from typing import ClassVar

from textual.app import App, ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import VerticalScroll
from textual.widgets import Footer, Static

from ..rl.triage import Triage
from .triage_text import regime_rows, sequence_lines, sequences, state_rows


class TriageApp(App[int]):
    """One triage on screen; returns the triage's exit code."""

    TITLE = "tensordiff triage"
    ENABLE_COMMAND_PALETTE = False   # not a triage key: its footer entry "^p palette" only takes room
    CSS = """
    #headline { padding: 0 1; text-style: bold; }
    .section { padding: 0 1; margin-top: 1; }
    .title { padding: 0 1; margin-top: 1; text-style: underline; }
    """
    BINDINGS: ClassVar[list[BindingType]] = [
        # up/down, page up/down stay with the scrolled view
        Binding("j,n", "seq(1)", "next sequence"),
        Binding("k,p", "seq(-1)", "previous sequence"),
        Binding("q,escape", "quit_triage", "quit"),
    ]

    def __init__(self, triage: Triage) -> None:
        super().__init__()
        self.triage = triage
        self.seqs = sequences(triage.curve)
        self.seq_index = 0

    def compose(self) -> ComposeResult:
        t = self.triage
        with VerticalScroll():
            yield Static(t.headline, id="headline", markup=False)
            # the sequence walked with j/k first: on a 24-line terminal it is above the fold
            yield Static("log-prob difference over positions (j/k: another sequence)", classes="title", markup=False)
            yield Static(self._seq_text(), id="tokens", classes="section", markup=False)
            yield Static("error per state against the noise trend", classes="title", markup=False)
            yield Static("\n".join(state_rows(t.noise_states)), id="states", classes="section", markup=False)
            yield Static("regime split", classes="title", markup=False)
            c = t.logprobs
            yield Static("\n".join(regime_rows(c.by_regime if c is not None else {}, t.three_way, t.layer)),
                         id="regimes", classes="section", markup=False)
            if t.lines:   # the evidence and the frameworks' metrics, as the text report prints them
                yield Static("the evidence and the metrics", classes="title", markup=False)
                yield Static("\n".join(t.lines), id="lines", classes="section", markup=False)
        yield Footer()

    def _seq_text(self) -> str:
        noise = self.triage.logprobs.noise if self.triage.logprobs is not None else 0.0
        return "\n".join(sequence_lines(self.seqs, self.seq_index, noise))

    def action_seq(self, step: int) -> None:
        if not self.seqs:
            return
        self.seq_index = (self.seq_index + step) % len(self.seqs)
        self.query_one("#tokens", Static).update(self._seq_text())

    def action_quit_triage(self) -> None:
        self.exit(self.triage.exit_code)


def run(triage: Triage) -> int:
    """Show the triage until the user quits; the triage's exit code."""
    code = TriageApp(triage).run()
    return triage.exit_code if code is None else code
