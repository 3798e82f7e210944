"""``python -m harness`` = the ``bitparity`` console script."""
import sys

from . import interrupt

# before the slow imports (torch, pydantic): a Ctrl-C that arrives while they run is then recorded even where
# Python drops its KeyboardInterrupt (harness.interrupt)
interrupt.install()

from .cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
