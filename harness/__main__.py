"""``python -m harness`` = the ``bitparity`` console script."""
import sys

from .running import interrupt

# before the slow imports (torch, pydantic): a Ctrl-C that arrives while they run is then recorded even where
# Python drops its KeyboardInterrupt (harness.running.interrupt)
interrupt.install()

try:
    from .cli import main  # noqa: E402
except KeyboardInterrupt:           # Ctrl-C while the imports run: the same one line as later
    if not interrupt.installed():    # a rank re-importing this script: the harness says it, once
        raise
    print("bitparity: interrupted", file=sys.stderr)
    sys.exit(2)

if __name__ == "__main__":
    sys.exit(main())
