"""Checkpoints keyed by global parameter names, so a run saved under one layout resumes under another.

One safetensors file per rank, ``ckpt_rank{r}.safetensors``: ``param/<key>`` (fp32 master value),
``exp_avg/<key>``, ``exp_avg_sq/<key>``, ``step/<key>`` (AdamW state), ``buffer/<name>`` (router expert bias),
metadata ``{"step": k}`` (the last completed step).  Loading reads every rank's file and takes the keys this
rank holds; a replica missing from the checkpoint (saved by a layout without it) loads from its logical
name — replicas are identical to their original after every step (the harness checks that).  So a run
resumes under any EP size too: experts keep their global names whichever EP rank saved them, and the
``@ep{r}`` copies of an EP > 1 run load from their originals when the checkpoint came from EP = 1.
"""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

_STATE = ("exp_avg", "exp_avg_sq", "step")


def save(state, optimizer, directory: Path, step: int) -> None:
    """Write this rank's shard after `step` completed."""
    tensors = {}
    for key, _, _, p, _ in state.params:
        tensors[f"param/{key}"] = p.master.detach().cpu().contiguous()
        st = optimizer.state.get(p.master, {})
        for k in _STATE:
            if k in st:
                t = torch.as_tensor(st[k]).detach().cpu()
                tensors[f"{k}/{key}"] = (t.reshape(1) if k == "step" else t).contiguous()
    for name, buf in state.named_buffers():
        tensors[f"buffer/{name}"] = buf.detach().cpu().contiguous()
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / f"ckpt_rank{state.rank}.safetensors"), metadata={"step": str(step)})


@torch.no_grad()
def load(state, optimizer, directory: Path) -> int:
    """Load the keys this rank holds from every shard in `directory`; return the checkpoint's step.

    Raises RuntimeError when the directory has no shard or lacks a parameter this rank needs."""
    files = sorted(directory.glob("ckpt_rank*.safetensors"))
    if not files:
        raise RuntimeError(f"no checkpoint shards in {directory}")
    tensors: dict = {}
    for f in files:
        tensors.update(load_file(str(f)))
    with safe_open(str(files[0]), "pt") as f:
        step = int(f.metadata()["step"])
    for key, name, _, p, _ in state.params:
        src = key if f"param/{key}" in tensors else name
        if f"param/{src}" not in tensors:
            raise RuntimeError(f"checkpoint {directory} has no parameter {key}")
        p.master.copy_(tensors[f"param/{src}"])
        if p.master is not p:
            p.copy_(p.master)
        if f"step/{src}" in tensors:
            optimizer.state[p.master] = {
                "step": tensors[f"step/{src}"].reshape(()).clone(),
                "exp_avg": tensors[f"exp_avg/{src}"].to(p.master.device),
                "exp_avg_sq": tensors[f"exp_avg_sq/{src}"].to(p.master.device)}
    for name, buf in state.named_buffers():
        if f"buffer/{name}" in tensors:
            buf.copy_(tensors[f"buffer/{name}"])
    return step
