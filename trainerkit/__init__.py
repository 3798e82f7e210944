"""What every trainer uses to meet the harness's contract (TRACE_FORMAT.md): global parameter names and their
canonical order (`names`), the one fingerprint function (`fingerprint`, `fingerprint_gpu`), the per-rank trace
writer (`capture`) and the rank-process lifecycle (`process`).  Trainers import this; it imports no trainer and
not the harness."""
