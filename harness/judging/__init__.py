"""Judging: traces read, compared and turned into verdicts by one judge.

`trace` (a run's trace, merged over ranks), `compare` (two traces -> the first divergence), `localise` (the
first divergence in dataflow order), `ulp` (distances in units in the last place), `signature` (where a
divergence may be), `agreement` (which runs computed alike), `crossimpl` (the reference vs megatron-core
measurement), `golden` / `golden_schema` (recorded bits), `results` (the vocabularies and result records) and
`judge` (expectation + evidence -> verdict, for verify, compare, fuzz and the cross-implementation check).
"""
