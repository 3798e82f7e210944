"""megatron's own validation of run configs (``MLATransformerConfig.__post_init__``: layout, MoE, MTP and
overlap rules), in the harness process or, for a megatron the harness does not import (the base of
``verify --megatron-base``), in a process of its own::

    python -m megatron_trainer.validate < configs.json      # a JSON list of RunConfig, one megatron_path

prints a JSON list with one entry per config (None or the one-line problem), or ``{"error": line}`` when that
megatron cannot be imported at all.

A process that imports megatron only to validate (this module's ``__main__``) says so with `checks_only`: its
megatron is then imported with ``torch.compile`` an identity, which skips importing ``torch._dynamo`` for
megatron's ~35 ``@jit_fuser`` helpers (``megatron/core/jit.py``): 1.4-1.9 s of the 4.3-5.2 s of CPU megatron's
import costs on 2 cores (measured 2026-12-07, 0.16.1 on Python 3.11 and 0.19.2 on 3.12).  The ``bitparity``
command imports megatron for real: its forkserver is that process forked (`harness.running.forkservers`), so the
ranks compute with the command's import.  Only a process that computes nothing with megatron, and forks nothing
that does, may skip it.
"""
from __future__ import annotations

import contextlib
import json
import logging
import sys
import warnings
from typing import Optional

from trainerkit.config import RunConfig

from . import options, source

_checks_only = False


def checks_only() -> None:
    """Declare that this process imports megatron-core only to validate run configs, never to compute with it:
    the imports `import_problem` and `config_problem` make then see ``torch.compile`` as an identity (see the
    module's docstring).  Call it before megatron is first imported; once imported, megatron keeps what it got."""
    global _checks_only
    _checks_only = True


def _identity_compile(model=None, **_options):
    # both spellings megatron uses: torch.compile(fn, ...) and @torch.compile(...)
    return model if model is not None else (lambda fn: fn)


@contextlib.contextmanager
def _imports_for_checks():
    """``torch.compile`` an identity for the megatron modules imported inside, in a `checks_only` process."""
    if not _checks_only:
        yield
        return
    import torch
    real, torch.compile = torch.compile, _identity_compile
    try:
        yield
    finally:
        torch.compile = real


def config_problem(config: RunConfig) -> Optional[str]:
    """megatron's own validation of `config`'s model, layout and ``megatron:`` options (`options.problem`:
    ``MLATransformerConfig``, ``OptimizerConfig``, ``DistributedDataParallelConfig``, the scheduler), as one line
    (None when megatron accepts it).  Imports the megatron this process imports."""
    with _imports_for_checks():
        return _config_problem(config)


def _config_problem(config: RunConfig) -> Optional[str]:
    from .model import transformer_config

    if config.model_class == "hybrid":
        from . import hybrid
        problem = hybrid.problem(config)
        if problem:
            return problem
    if config.megatron:
        return options.problem(config, transformer_config)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            transformer_config(config)
        except (AssertionError, ValueError, TypeError, NotImplementedError) as e:
            text = " ".join(str(e).split()) or type(e).__name__
            return f"megatron-core rejects this run: {text}"
    return None


def import_problem() -> Optional[str]:
    """Why the megatron this process would import cannot be imported, in one line (None when it can)."""
    # a CUDA build of torch without a GPU logs "No CUDA runtime is found" when megatron imports cpp_extension: a
    # warning of the torch build, not a line of bitparity's one-line errors
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():     # megatron warns on import that TE / Apex are missing: not our line
            warnings.simplefilter("ignore")
            with _imports_for_checks():
                import megatron.core  # noqa: F401
                import megatron.core.models.gpt  # noqa: F401
    except Exception as e:      # a broken tree fails in many ways (ImportError, SyntaxError, AttributeError...)
        return " ".join(f"{type(e).__name__}: {e}".split())
    return None


def main() -> None:
    checks_only()
    configs = [RunConfig.model_validate(c) for c in json.load(sys.stdin)]
    paths = {c.megatron_path for c in configs}
    if len(paths) != 1:
        raise SystemExit(f"one megatron_path per call, got {sorted(map(str, paths))}")
    answer = sys.stdout
    with contextlib.redirect_stdout(sys.stderr):    # whatever megatron prints is not the answer
        source.activate(paths.pop())
        problem = import_problem()
        out = {"error": problem} if problem else [config_problem(c) for c in configs]
    json.dump(out, answer)


if __name__ == "__main__":
    main()
