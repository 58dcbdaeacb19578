"""The bug fuzzer behind benchmarks/fuzz_verdicts.py: scenarios drawn from a seed
(:mod:`.scenario`), models and recordings (:mod:`.models`), the bug catalog (:mod:`.bugs`), the
ground truth taken from the generator's own recordings (:mod:`.truth`) and the judge of the
tool's JSON (:mod:`.judge`)."""
