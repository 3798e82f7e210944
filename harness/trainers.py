"""The trainers the harness launches, and what each can run: one line saying why not, before anything runs.

The harness reaches a trainer only through its worker module (`runner.WORKERS`) and the trace it writes
(TRACE_FORMAT.md).  ``reference`` is ours (reference_impl); ``megatron-core`` runs megatron-core's own GPTModel,
schedules, DDP and optimizer (megatron_trainer; the optional extra ``bitparity[megatron]``).  For the latter
the run config is also handed to megatron's own ``TransformerConfig`` here, in the harness, so megatron's
validator (layout, MoE, MTP, overlap rules) speaks at planning time, not in every rank.
"""
from __future__ import annotations

import importlib.metadata
import logging
import warnings
from typing import Optional

from megatron_trainer.source import megatron_source

from trainerkit.config import RunConfig

def megatron_version() -> Optional[str]:
    """The version of the megatron-core the ranks will import (`megatron_source`), or None."""
    src = megatron_source()
    return src["version"] if src else None


def versions(config: RunConfig) -> dict:
    """What a manifest records about the run's trainer: its name and, for megatron-core, the library's version,
    the compatibility layer's version and the points it patches on this run's device (`megatron_trainer.compat`;
    evaluated here, where the rank's environment is the same)."""
    if config.trainer != "megatron-core":
        return {"trainer": config.trainer}
    from megatron_trainer import compat
    version = megatron_version()
    commit = (megatron_source() or {}).get("commit")
    return {"trainer": config.trainer, "megatron_core": version, "megatron_commit": commit,
            "megatron_compat": compat.VERSION,
            "megatron_compat_points": list(compat.points(config.device)),
            "megatron_compat_checked_versions": list(compat.SUPPORTED) + list(compat.CHECKED_COMMITS),
            "megatron_version_checked": compat.version_checked(version or "", commit)}


def problem(config: RunConfig) -> Optional[str]:
    """Why `config` cannot run on its trainer, in one line (None when it can).

    reference: its planted fault (`config.inject`) must be one of `reference_impl.faults`.  megatron-core: the extra must be installed (and, on CPU, be a version the compat layer was checked
    against); reductions ``megatron`` only (``canonical`` is the reference's layout-invariant mode); EP = 1 (in
    megatron the EP ranks are carved out of data parallelism, so EP > 1 changes the global batch; bitparity's
    megatron trainer runs TP = CP = DP = 1); no activation capture, checkpoints or resume (the
    reference's probes); planted faults from `megatron_trainer.faults` only; on CUDA one GPU per rank (ranks
    cannot share a GPU over NCCL); then megatron's own config validator.
    """
    if config.trainer == "reference":
        from reference_impl import faults
        try:
            faults.check(config.inject)
        except faults.FaultError as e:
            return str(e)
        return None
    version = megatron_version()
    if version is None:
        return ("trainer megatron-core: megatron-core is not installed; install the extra with "
                "`pip install -e '.[megatron]'` (or run `make verify-megatron`)")
    # a CUDA build of torch without a GPU logs "No CUDA runtime is found" when megatron imports cpp_extension: a
    # warning of the torch build, not a line of bitparity's one-line errors
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():     # megatron warns on import that TE / Apex are missing: not our line
            warnings.simplefilter("ignore")
            import megatron.core  # noqa: F401  (distribution metadata can outlive a broken install)
    except ImportError as e:
        return (f"trainer megatron-core: megatron-core {version} is installed but cannot be imported ({e}); "
                "reinstall it (`pip install -e '.[megatron]'`) or fix its dependencies")
    from megatron_trainer import compat, faults

    commit = (megatron_source() or {}).get("commit")
    if config.device == "cpu" and not compat.version_checked(version, commit) and not compat.unchecked_allowed():
        return f"trainer megatron-core: {compat.unchecked_message(version, commit)}"
    t, par = config.training, config.parallel
    if config.device == "cpu" and config.params_dtype != "float32":
        return ("trainer megatron-core: params_dtype bfloat16 on CPU is not run (megatron's bf16 optimizer checks "
                "for CUDA tensor types); use float32 on CPU (`--params-dtype float32`), bfloat16 on CUDA")
    if t.reductions != "megatron":
        return "trainer megatron-core: reductions: canonical is the reference trainer's mode; megatron-core runs its own"
    if par.expert_model_parallel_size > 1:
        return ("trainer megatron-core: expert_model_parallel_size > 1 is not run: megatron carves EP out of data "
                "parallelism (EP ranks see different microbatches), and bitparity's megatron trainer runs DP = 1")
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
    """megatron's own ``MLATransformerConfig`` validation of `config`'s model and layout, as one line."""
    from megatron_trainer.model import transformer_config

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            transformer_config(config)
        except (AssertionError, ValueError, TypeError, NotImplementedError) as e:
            text = " ".join(str(e).split()) or type(e).__name__
            return f"megatron-core rejects this run: {text}"
    return None
