"""Running: rank processes started, watched and reaped, and where their output goes.

`runner` (one run's ranks under the forkserver or torchrun), `pool` (runs side by side on this machine's cores),
`interrupt` (Ctrl-C and signals end every child), `outdir` (the report directory, written whole or not at all),
`evidence` (tensor dumps at the first divergence), `arithmetic` (the machine's arithmetic facts a run records).
"""
