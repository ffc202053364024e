"""The sample ledger as it was before its indexes (cluster/data/ledger*.py at 7b3a0cd), frozen:
it scanned its entries on every call, which is slow (quadratic over a job) but simple enough to
trust. It is the oracle of tests/unit/test_ledger_index.py and the baseline of
benchmarks/ledger.py. Do not change it to follow the ledger: a change of behaviour must show up
as a difference in that test, and be made there on purpose. Changed on purpose since:
the per-prompt quarantine (`_fail`, `_quarantine`: a prompt failed in one epoch fails in all).
It speaks dict rows; `typed` is the adapter that lets it speak the ledger's typed rows
(`PromptTask`, `ProducedSample`, `LeasedSample`) beside it."""
