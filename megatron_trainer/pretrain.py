"""Megatron-LM's own training script, unmodified, with the bitparity capture installed from outside.

    torchrun --nproc_per_node N -m megatron_trainer.pretrain --bitparity-out DIR \\
        /path/to/Megatron-LM/pretrain_gpt.py <the script's own arguments>
    python -m megatron_trainer.pretrain --bitparity-nproc N --bitparity-out DIR ...    (CPU: `fork_launch`)

Every rank writes ``DIR/rank{r}.jsonl`` (a job resumed with ``--load`` from N iterations: ``DIR/iter{N:07d}/``;
TRACE_FORMAT.md; `pretrain_hooks`); compare two such directories with
``bitparity compare DIR_A DIR_B``.  The script runs as ``__main__`` with its own directory first on sys.path (as
``python pretrain_gpt.py`` would), after:

* on a machine without CUDA: `compat`'s CPU points and `compat_training`'s (megatron's training loop over gloo:
  ``--distributed-backend gloo`` is added when the arguments name no backend; ``--no-load-rng`` with ``--load``:
  the inert CUDA RNG tracker saved an empty state, which Megatron-LM's loader refuses), `compat_distopt`'s with
  ``--use-distributed-optimizer``, torch.compile off (megatron's fused helpers; 7-20 s per rank, same bits);
* on CUDA: `compat`'s local-spec points (megatron's local layers without Transformer Engine), nothing else;
* with ``--hybrid-layer-pattern`` (``pretrain_hybrid.py``) and no Transformer Engine: `compat_hybrid`'s point, and
  ``--spec megatron_trainer.hybrid_spec hybrid_stack_spec`` gives HybridModel bitparity's local stack spec;
* the capture (`pretrain_hooks.install`).

Bad invocation (no script, a script that is not a file, an output directory that cannot be made): one line on
stderr, exit 2.  A run the capture cannot trace (`pretrain_hooks.refusal` before megatron starts, `pretrain_hooks.CaptureRefused`
at the first step) and a megatron the compatibility points were not checked against (`compat.CompatError`): one
line, exit 2.
"""
from __future__ import annotations

import argparse
import os
import runpy
import sys
from pathlib import Path


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise SystemExit(_fail(f"{self.prog}: {message}"))


def _fail(line: str) -> int:
    print(line, file=sys.stderr)
    return 2


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m megatron_trainer.pretrain",
                description="run a Megatron-LM training script with the bitparity capture")
    p.add_argument("--bitparity-out", required=True, metavar="DIR",
                   help="where every rank writes rank{r}.jsonl (made if missing)")
    p.add_argument("--bitparity-init", type=int, metavar="SEED",
                   help="re-initialise every parameter by its global name before the first step (megatron seeds "
                        "by pipeline rank, so two layouts start from other weights without it)")
    p.add_argument("--bitparity-nproc", type=int, metavar="N",
                   help="start N ranks on this host by forking this process once megatron is imported, instead "
                        "of running under torchrun (CPU only; `fork_launch`)")
    p.add_argument("script", help="the training script, e.g. Megatron-LM's pretrain_gpt.py")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments, as you would pass them")
    return p


def _given(script_args: list, flag: str) -> bool:
    """Whether the training arguments name `flag` (``--flag value`` or ``--flag=value``)."""
    return any(a == flag or a.startswith(flag + "=") for a in script_args)


def main(argv: list[str] | None = None) -> int:
    """Parse bitparity's options, prepare the rank, run the script; returns the exit code."""
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    script = Path(args.script)
    if not script.is_file():
        return _fail(f"python -m megatron_trainer.pretrain: {args.script}: no such training script")
    from . import pretrain_hooks
    refused = pretrain_hooks.refusal(args.args)
    if refused:
        return _fail(refused)
    if args.bitparity_nproc is not None and args.bitparity_nproc < 1:
        return _fail(f"--bitparity-nproc {args.bitparity_nproc}: the number of ranks must be >= 1")
    if args.bitparity_nproc is not None and os.environ.get("WORLD_SIZE"):
        return _fail("--bitparity-nproc starts the ranks itself: run it without torchrun")
    out = Path(args.bitparity_out)
    if out.exists() and not out.is_dir():
        return _fail(f"--bitparity-out {args.bitparity_out}: not a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return _fail(f"--bitparity-out {args.bitparity_out}: {e.strerror or e}")
    if not os.access(out, os.W_OK):
        return _fail(f"--bitparity-out {args.bitparity_out}: not writable")

    import torch

    from . import compat, compat_training

    cuda = torch.cuda.is_available()
    if cuda and args.bitparity_nproc is not None:
        return _fail("--bitparity-nproc forks ranks after megatron's import, which initialises CUDA: on a GPU "
                     "machine run the script under torchrun")
    if not cuda:
        import torch._dynamo.config
        torch._dynamo.config.disable = True
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    sys.path.insert(0, str(script.resolve().parent))
    import importlib.util
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.training") is None:
        return _fail("python -m megatron_trainer.pretrain: no megatron.training here (megatron-core < 0.17 ships "
                     "only megatron.core): install megatron-core >= 0.17 (make ... PY=3.12) or run a Megatron-LM "
                     "checkout's script")
    try:
        points = compat.apply("cuda" if cuda else "cpu")
        points += compat_training.apply("cuda" if cuda else "cpu")
        if "--sequence-parallel" in args.args:
            from . import compat_tp
            points += compat_tp.apply()
        if _given(args.args, "--hybrid-layer-pattern"):
            from . import compat_hybrid
            points += compat_hybrid.apply() if compat_hybrid.needed("hybrid") else ()
        if not cuda and "--use-distributed-optimizer" in args.args:
            from . import compat_distopt
            points += compat_distopt.apply()
    except compat.CompatError as e:
        return _fail(f"bitparity capture: {e}")
    print(f"bitparity capture: {'cuda' if cuda else 'cpu'}, compat points {','.join(points)}; traces to {out}",
          file=sys.stderr)
    script_args = list(args.args)
    if not cuda and not _given(script_args, "--distributed-backend"):
        script_args += ["--distributed-backend", "gloo"]     # megatron's default, nccl, needs CUDA
    # on CPU megatron's CUDA RNG tracker is inert (compat), so a checkpoint holds an empty tracker state, which
    # Megatron-LM's loader refuses ("Unable to load rng state"); no bit depends on it (dropout 0)
    if not cuda and _given(script_args, "--load") and not _given(script_args, "--no-load-rng"):
        script_args += ["--no-load-rng"]
    if args.bitparity_nproc is None:
        return _run_rank(script, script_args, out, args.bitparity_init)
    from trainerkit.process import import_before_fork

    from . import fork_launch
    import_before_fork(_TRAINING_IMPORTS)
    return fork_launch.launch(args.bitparity_nproc,
                              lambda: _run_rank(script, script_args, out, args.bitparity_init))


#: what a Megatron-LM training script imports first (pretrain_gpt.py, pretrain_hybrid.py): imported once before
#: `fork_launch` forks the ranks, each of which would otherwise import them itself
_TRAINING_IMPORTS = ("megatron.training", "megatron.training.training", "megatron.training.arguments",
                     "megatron.training.argument_utils", "megatron.core.models.gpt", "megatron.core.datasets.gpt_dataset",
                     "megatron.core.pipeline_parallel", "megatron.core.optimizer")


def _run_rank(script: Path, script_args: list, out: Path, init_seed) -> int:
    """One rank: install the capture, run the script as ``__main__``, write the trace; the exit code."""
    from . import pretrain_hooks
    pretrain_hooks.install(out, [str(script), *script_args], init_seed)
    sys.argv = [str(script), *script_args]
    from trainerkit.capture import CaptureError
    try:
        runpy.run_path(str(script), run_name="__main__")
    except (pretrain_hooks.CaptureRefused, CaptureError) as e:
        return _fail(str(e))
    except SystemExit as e:
        if e.code not in (None, 0):
            raise
    try:
        steps = pretrain_hooks.finish()
    except CaptureError as e:
        return _fail(str(e))
    if steps == 0:
        return _fail(f"bitparity capture: {script} ran no megatron training step (megatron.training's train_step "
                     f"was never called): nothing written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
