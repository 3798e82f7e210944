"""The contract every trainer meets and the harness reads (TRACE_FORMAT.md): the run description (`config`), the
layout grammar (`layout`), the planned schedule (`schedule`), the dataset and the shipped training text
(`data`, `text`), initialisation by global name (`init`), global parameter names and their canonical order
(`names`), the one fingerprint function (`fingerprint`, `fingerprint_gpu`), the per-rank trace writer
(`capture`) and the rank-process lifecycle (`process`).  Trainers import this; it imports no trainer and not
the harness (pyproject.toml [tool.importlinter])."""
