"""Planning: what a case asks for and whether it can run, decided before any rank starts.

`case_schema` (the case file's grammar), `cases` (a case -> its planned runs), `bounds` (sizes a run may have),
`budget` (a time budget -> the runs that fit), `expectations` (per-megatron-version expectations and places),
`sources` (which megatron each run imports), `trainers` (the registry of trainers and their admission).
"""
