"""The registry of the trainers the harness launches (`REGISTRY`: one `Trainer` entry each), and what each can
run: one line saying why not, before anything runs.

The harness reaches a trainer only through this registry: its worker module (the ranks' entry point,
`harness.running.runner`), its admission (`problem`), its planted faults, its cross-implementation partner, and the trace
it writes (TRACE_FORMAT.md).  ``reference`` is ours (reference_impl); ``megatron-core`` runs megatron-core's own
GPTModel, schedules, DDP and optimizer (megatron_trainer; the optional extra ``bitparity[megatron]``).  For the
latter the run config is also handed to megatron's own ``TransformerConfig`` here, in the harness, so megatron's
validator (layout, MoE, MTP, overlap rules) speaks at planning time, not in every rank; for a megatron the
harness does not import (the base of ``verify --megatron-base``), in a process that imports it
(`validate_elsewhere`).

The names are `trainerkit.config.TRAINERS` (the run description's vocabulary, the one list); a new trainer (or
a second megatron model class run by its own worker) is its package with a ``worker`` module that writes the trace,
its name there, and one entry here (README "Adding a trainer").
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from megatron_trainer.source import SourceError, activate, installed_root, megatron_source  # noqa: F401  (harness.planning.sources)
from trainerkit.config import DEFAULT_TRAINER, TRAINERS, RunConfig


@dataclass(frozen=True)
class Trainer:
    """One trainer the harness can launch.

    name: its `trainerkit.config.TRAINERS` name (a case's ``trainer:``).  worker: the module each rank runs
    (``python -m`` under torchrun, `trainerkit.process.launch` under fork; it must write TRACE_FORMAT.md's trace).
    admission: why a run config cannot run on it, in one line, or None (`problem`).  faults: the planted faults
    its ranks know (test-only, ``inject``).  partner: the trainer the cross-implementation check compares it
    with (`harness.judging.crossimpl`).  megatron: it imports a megatron-core (per-version expectations
    ``megatron_versions``, ``layout_rules: megatron``, ``--megatron-base``, megatron's validator).  resume_problem:
    None when it writes no checkpoints; else why a run of it (second argument) cannot load the checkpoint of
    another of its runs (first), in one line, or None (a case's ``resume:``, `resume_problem`).  library_preload: a module the forkserver
    may import so that ranks fork with the trainer's library loaded (`harness.running.runner.preload` says when)."""

    name: str
    worker: str
    admission: Callable[[RunConfig], Optional[str]]
    faults: Callable[[], tuple]
    partner: str
    megatron: bool = False
    resume_problem: Optional[Callable[[RunConfig, RunConfig], Optional[str]]] = None
    library_preload: Optional[str] = None


def entry(name: str) -> Trainer:
    """The registry entry of trainer `name` (a `trainerkit.config.TRAINERS` name: validated before here).

    Raises:
        KeyError: `name` is not a registered trainer."""
    return REGISTRY[name]


def runs_megatron(name: str) -> bool:
    """Whether trainer `name` imports a megatron-core (its runs have megatron versions and sources)."""
    return entry(name).megatron


def is_default(name: Optional[str]) -> bool:
    """Whether `name` (None: not said) is the default trainer (`trainerkit.config.DEFAULT_TRAINER`): a run the
    report need not label with its trainer."""
    return name is None or name == DEFAULT_TRAINER


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
    if not runs_megatron(config.trainer):
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
    """Why `config` cannot run on its trainer, in one line (None when it can): its entry's admission
    (`_reference_problem`, `_megatron_problem`)."""
    return entry(config.trainer).admission(config)


def _reference_problem(config: RunConfig) -> Optional[str]:
    """Why `config` cannot run on the reference trainer: DP = 1 (its EP ranks share their microbatches); its
    planted fault (`config.inject`) must be one of `reference_impl.faults`; one load-balancing coefficient;
    bitparity's layout rules; the megatron options it implements (`reference_impl.options`)."""
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
    if config.parallel.tensor_model_parallel_size > 1 or config.parallel.expert_tensor_parallel > 1:
        return ("tensor_model_parallel_size / expert_tensor_parallel_size > 1 is the megatron-core trainer's "
                "(trainer: megatron-core); the reference trainer holds every matrix whole")
    if config.parallel.layout_rules != "bitparity":
        return "layout_rules: megatron is the megatron-core trainer's (a layout megatron accepts and trains wrong)"
    return options.problem(config.megatron)


def _megatron_problem(config: RunConfig) -> Optional[str]:
    """Why `config` cannot run on the megatron-core trainer: the extra must be installed (and, on CPU, be a
    version the compat layer was checked against); reductions ``megatron`` only (``canonical`` is the reference's
    layout-invariant mode); EP divides DP (megatron carves the EP ranks out of data parallelism; TP = CP = 1);
    no activation capture (the reference's probes); planted faults from
    `megatron_trainer.faults` only; on CUDA one GPU per rank (ranks cannot share a GPU over NCCL); then megatron's
    own config validator (`megatron_config_problem`)."""
    version = megatron_version(config.megatron_path)
    if version is None and config.megatron_path is not None:
        return f"trainer megatron-core: {config.megatron_path}: no megatron/core/ in it"
    if version is None:
        return ("trainer megatron-core: megatron-core is not installed; install the extra with "
                "`pip install -e '.[megatron]'` (or run `make verify-megatron`)")
    from megatron_trainer import compat, validate

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
    if par.tensor_model_parallel_size == 1 and par.data_parallel_size % par.expert_model_parallel_size:
        return (f"trainer megatron-core: expert_model_parallel_size {par.expert_model_parallel_size} needs a "
                f"data_parallel_size that it divides (have {par.data_parallel_size}): megatron carves EP out of "
                "data parallelism")
    if config.device == "cpu" and par.expert_tensor_parallel > 1 and par.expert_model_parallel_size > 1:
        return ("trainer megatron-core: expert_tensor_parallel_size > 1 with expert_model_parallel_size > 1 does not "
                "run over gloo: megatron's alltoall dispatcher all-gathers each expert-TP rank's token count, which "
                "differs between ranks, and gloo's all_gather takes equal sizes only (measured); set "
                "expert_tensor_parallel_size: 1 (Megatron's DeepSeek-V3 proxy runs ETP 1) or EP 1")
    if config.capture == "activations":
        return "trainer megatron-core: capture: activations needs the reference trainer's probes"
    known = entry(config.trainer).faults()
    if config.inject is not None and config.inject not in known:
        return f"trainer megatron-core: unknown fault {config.inject!r} (the megatron trainer knows: {', '.join(known)})"
    if config.device == "cuda":
        import torch
        if par.world_size > torch.cuda.device_count():
            return (f"trainer megatron-core: {par.world_size} ranks but {torch.cuda.device_count()} GPU(s): ranks "
                    "cannot share a GPU over NCCL")
    return megatron_config_problem(config)


def resume_problem(saver: RunConfig, resumer: RunConfig) -> Optional[str]:
    """Why run `resumer` cannot load the checkpoint run `saver` writes, in one line (None when it can): its
    trainer's entry decides (`Trainer.resume_problem`; both runs are of one trainer, `cases` checks that first)."""
    return entry(resumer.trainer).resume_problem(saver, resumer)


def _reference_resume_problem(saver: RunConfig, resumer: RunConfig) -> Optional[str]:
    """None: the reference trainer's checkpoints are keyed by global name and load under any layout
    (`reference_impl.checkpoint`)."""
    return None


def _megatron_resume_problem(saver: RunConfig, resumer: RunConfig) -> Optional[str]:
    """`megatron_trainer.checkpoint_rules.resume_problem`, naming the trainer."""
    from megatron_trainer.checkpoint_rules import resume_problem as megatron_resume_problem
    problem = megatron_resume_problem(saver, resumer)
    return f"trainer megatron-core: {problem}" if problem else None


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

    from ..errors import UsageError
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


def _reference_faults() -> tuple:
    from reference_impl import faults
    return tuple(faults.FAULTS)


def _megatron_faults() -> tuple:
    from megatron_trainer import faults
    return tuple(faults.NAMES)


#: Every trainer the harness launches, by name (the keys are `trainerkit.config.TRAINERS`, checked below).
REGISTRY: dict[str, Trainer] = {t.name: t for t in (
    Trainer("reference", "reference_impl.worker", _reference_problem, _reference_faults, partner="megatron-core",
            resume_problem=_reference_resume_problem),
    Trainer("megatron-core", "megatron_trainer.worker", _megatron_problem, _megatron_faults, partner="reference",
            megatron=True, library_preload="megatron_trainer.preload", resume_problem=_megatron_resume_problem),
)}
# the run description's vocabulary and the registry are one list: a name without an entry would pass a case's
# validation and crash at launch, an entry without a name could never be chosen
if set(REGISTRY) != set(TRAINERS):
    raise ImportError(
        "harness.planning.trainers: REGISTRY and trainerkit.config.TRAINERS differ: names without an entry "
        f"{sorted(set(TRAINERS) - set(REGISTRY))}, entries without a name {sorted(set(REGISTRY) - set(TRAINERS))}")
