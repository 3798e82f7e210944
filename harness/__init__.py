"""bitparity's harness: cases, runs, comparison, reports (``bitparity`` / ``python -m harness``)."""
import time

# when this process began to be the harness, before its slow imports (torch, pydantic: ~3 s): `verify --budget`
# counts from here on the command line (harness.planning.budget)
STARTED = time.monotonic()
