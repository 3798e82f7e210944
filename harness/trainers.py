"""The trainers the harness launches, and what each can run: one line saying why not, before anything runs.

The harness reaches a trainer only through its worker module (`runner.WORKERS`) and the trace it writes
(TRACE_FORMAT.md).  ``reference`` is ours (reference_impl); ``megatron-core`` runs megatron-core's own GPTModel,
schedules, DDP and optimizer (megatron_trainer; the optional extra ``bitparity[megatron]``).  For the latter
the run config is also handed to megatron's own ``TransformerConfig`` here, in the harness, so megatron's
validator (layout, MoE, MTP, overlap rules) speaks at planning time, not in every rank; for a megatron the
harness does not import (the base of ``verify --megatron-base``), in a process that imports it
(`validate_elsewhere`).
"""
from __future__ import annotations

from typing import Optional

from megatron_trainer.source import SourceError, activate, installed_root, megatron_source  # noqa: F401  (harness.sources)

from trainerkit.config import RunConfig

def megatron_version(path: Optional[str] = None) -> Optional[str]:
    """The version of the megatron-core the ranks of a run with ``megatron_path`` `path` will import
    (`megatron_source`), or None."""
    src = megatron_source(path)
    return src["version"] if src else None


def imported_here(config: RunConfig) -> bool:
    """Whether `config`'s megatron is the one this (the harness's) process imports, so that megatron's own
    validator can run here; otherwise `validate_elsewhere` runs it."""
    if config.megatron_path is None:
        return True
    mine, theirs = megatron_source(), megatron_source(config.megatron_path)
    return mine is not None and theirs is not None and mine["path"] == theirs["path"]


def versions(config: RunConfig) -> dict:
    """What a manifest records about the run's trainer: its name and, for megatron-core, the library's version,
    the compatibility layer's version and the points it patches on this run's device (`megatron_trainer.compat`;
    evaluated here, where the rank's environment is the same)."""
    if config.trainer != "megatron-core":
        return {"trainer": config.trainer}
    from megatron_trainer import compat, compat_overlap
    src = megatron_source(config.megatron_path) or {}
    version, commit = src.get("version"), src.get("commit")
    return {"trainer": config.trainer, "megatron_core": version, "megatron_commit": commit,
            "megatron_path": src.get("path"), "megatron_modified": src.get("modified"),
            "megatron_compat": compat.VERSION,
            "megatron_compat_points": list(compat.points(
                config.device, compat_overlap.needed(config.parallel), config.params_dtype == "bfloat16")),
            "megatron_compat_checked_versions": list(compat.SUPPORTED) + list(compat.CHECKED_COMMITS),
            "megatron_version_checked": compat.version_checked(version or "", commit)}


def problem(config: RunConfig) -> Optional[str]:
    """Why `config` cannot run on its trainer, in one line (None when it can).

    reference: DP = 1; its planted fault (`config.inject`) must be one of `reference_impl.faults`.  megatron-core: the extra must be installed (and, on CPU, be a version the compat layer was checked
    against); reductions ``megatron`` only (``canonical`` is the reference's layout-invariant mode); EP divides DP (in
    megatron the EP ranks are carved out of data parallelism; TP = CP = 1); no activation capture, checkpoints or resume (the
    reference's probes); planted faults from `megatron_trainer.faults` only; on CUDA one GPU per rank (ranks
    cannot share a GPU over NCCL); then megatron's own config validator.
    """
    if config.trainer == "reference":
        if config.parallel.data_parallel_size > 1:
            return ("data_parallel_size > 1 is the megatron-core trainer's (trainer: megatron-core); the reference "
                    "trainer's EP ranks share their microbatches (expert_model_parallel_size alone)")
        from reference_impl import faults, options
        try:
            faults.check(config.inject)
        except faults.FaultError as e:
            return str(e)
        if isinstance(config.model.moe_aux_loss_coeff, list):
            return ("model.moe_aux_loss_coeff as a list (one per load-balancing type) is megatron's; the reference "
                    "trainer has the one seq_aux_loss coefficient")
        if config.parallel.layout_rules != "bitparity":
            return "layout_rules: megatron is the megatron-core trainer's (a layout megatron accepts and trains wrong)"
        return options.problem(config.megatron)
    version = megatron_version(config.megatron_path)
    if version is None and config.megatron_path is not None:
        return f"trainer megatron-core: {config.megatron_path}: no megatron/core/ in it"
    if version is None:
        return ("trainer megatron-core: megatron-core is not installed; install the extra with "
                "`pip install -e '.[megatron]'` (or run `make verify-megatron`)")
    from megatron_trainer import compat, faults, validate

    if imported_here(config):
        problem = validate.import_problem()     # distribution metadata can outlive a broken install
        where = (megatron_source(config.megatron_path) or {}).get("path")
        if problem and where == installed_root():
            return (f"trainer megatron-core: megatron-core {version} is installed but cannot be imported ({problem}); "
                    "reinstall it (`pip install -e '.[megatron]'`) or fix its dependencies")
        if problem:
            return f"trainer megatron-core: the megatron-core in {where} cannot be imported ({problem})"
    commit = (megatron_source(config.megatron_path) or {}).get("commit")
    if config.device == "cpu" and not compat.version_checked(version, commit) and not compat.unchecked_allowed():
        return f"trainer megatron-core: {compat.unchecked_message(version, commit)}"
    t, par = config.training, config.parallel
    if t.reductions != "megatron":
        return "trainer megatron-core: reductions: canonical is the reference trainer's mode; megatron-core runs its own"
    if par.data_parallel_size % par.expert_model_parallel_size:
        return (f"trainer megatron-core: expert_model_parallel_size {par.expert_model_parallel_size} needs a "
                f"data_parallel_size that it divides (have {par.data_parallel_size}): megatron carves EP out of "
                "data parallelism")
    if config.capture == "activations":
        return "trainer megatron-core: capture: activations needs the reference trainer's probes"
    for key in ("checkpoint", "resume_from"):
        if getattr(config, key) is not None:
            return f"trainer megatron-core: {key} is a reference-trainer feature"
    if config.inject is not None and config.inject not in faults.NAMES:
        return (f"trainer megatron-core: unknown fault {config.inject!r} (the megatron trainer knows: "
                f"{', '.join(faults.NAMES)})")
    if config.device == "cuda":
        import torch
        if par.world_size > torch.cuda.device_count():
            return (f"trainer megatron-core: {par.world_size} ranks but {torch.cuda.device_count()} GPU(s): ranks "
                    "cannot share a GPU over NCCL")
    return megatron_config_problem(config)


def megatron_config_problem(config: RunConfig) -> Optional[str]:
    """megatron's own ``MLATransformerConfig`` validation of `config`'s model and layout, as one line; None when
    it accepts it, or when `config`'s megatron is not the one imported here (`validate_elsewhere` does those)."""
    if not imported_here(config):
        return None
    from megatron_trainer.validate import config_problem
    return config_problem(config)


def validate_elsewhere(configs: list[RunConfig], timeout_s: float = 300.0) -> list[Optional[str]]:
    """`megatron_config_problem` of each config, all with one ``megatron_path`` the harness does not import, in
    a process of its own that imports that megatron (``python -m megatron_trainer.validate``).

    Raises:
        UsageError: that megatron cannot be imported, or the validator died (one line, its last line)."""
    import json
    import subprocess
    import sys

    from .errors import UsageError
    path = configs[0].megatron_path
    try:
        done = subprocess.run([sys.executable, "-m", "megatron_trainer.validate"], capture_output=True, text=True,
                              input=json.dumps([c.model_dump(mode="json") for c in configs]), timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise UsageError(f"megatron in {path}: validating the runs took over {timeout_s:.0f} s") from None
    try:
        out = json.loads(done.stdout) if done.returncode == 0 else None
    except ValueError:
        out = None
    if isinstance(out, dict):
        raise UsageError(f"megatron in {path} cannot be imported: {out['error']}")
    if not isinstance(out, list) or len(out) != len(configs):
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise UsageError(f"megatron in {path}: its validator failed (exit {done.returncode}): {last}")
    return out
