"""Users' own ports of the trained tiny Llama (tests/trained.py), for `tensordiff locate
module:locate_ports:FACTORY` (tests/test_locate.py). Not a test module.

Each factory builds the port the way a user's code would: from the reference's config and
weights, with the port's own change."""

from __future__ import annotations

import torch

import trained


def correct():
    return trained.load_target()


def gate_up_swapped_in_layer5():
    """A conversion bug in one layer: its gate and up projections' weights swapped."""
    m = trained.load_target()
    mlp = m.model.layers[5].mlp
    with torch.no_grad():
        g = mlp.gate_proj.weight.detach().clone()
        mlp.gate_proj.weight.copy_(mlp.up_proj.weight)
        mlp.up_proj.weight.copy_(g)
    return m
