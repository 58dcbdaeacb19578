"""RL trainer-vs-rollout triage, as one package by job: :mod:`.triage` (why a trainer's log-probs
disagree with the rollout engine's), its causes' evidence (:mod:`.logprobs`, :mod:`.cache` the
prefix cache kept across updates, :mod:`.replay` routing replay, :mod:`.lora` adapters),
:mod:`.drift` over training steps, and :mod:`.html` the page. Pure: no torch, no textual; the
front ends import the module they need (nothing is imported here)."""
