"""Per-rank trace writer (append-only JSONL, flushed every record).

Trace format ``bitparity-rank-trace/2`` (the contract between trainer and harness; see TRACE_FORMAT.md):
one JSON object per line, each with ``"type"``:

* ``header``: rank, world size (P x EP), pp rank, ep rank and EP size, the flat stages this rank holds, and
  ``params``: a list of
  {key, name, replica, shape, dtype, family, weight_decay, order} where ``key`` is the global name (plus
  ``@replica``; with EP the non-expert parameters of ep rank r > 0 are replicas ``@ep{r}``) and ``order`` =
  [section, layer id, index within layer] gives the canonical order;
* ``init``: ``params``: {key: fingerprint} of the initial values;
* ``step``: step index; ``grads`` / ``params`` / ``buffers``: {key: fingerprint} (grads after accumulation
  and replica sync, before clipping; params after the optimizer step; buffers such as the expert bias after
  their update); on the loss rank ``losses``: per microbatch {microbatch, lm, mtp: [..], num_tokens} where
  each loss is {hex, value}, and ``lm_loss`` (reported); on every rank ``grad_norm`` and ``clip_coeff``
  (null when clipping is off; fp32 in megatron mode, fp64 in canonical mode) and ``clipped`` (coeff < 1);
  ``time_s``;
* ``end``: written after the last step.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from .fingerprint import float_bits_hex

FORMAT = "bitparity-rank-trace/2"


def scalar(t: torch.Tensor) -> dict:
    """{hex, value} of a one-element float tensor: exact bits plus the decimal value."""
    return {"hex": float_bits_hex(t), "value": float(t.item())}


class TraceWriter:
    """Append-only JSONL writer; every record is flushed so a crashed rank leaves a readable prefix."""

    def __init__(self, path: Path):
        self._f = open(path, "a", encoding="utf-8")

    def write(self, record: dict) -> None:
        """Append one record as a JSON line and flush it."""
        self._f.write(json.dumps(record, separators=(",", ":")) + "\n")
        self._f.flush()

    def close(self) -> None:
        """Close the file (records are already flushed)."""
        self._f.close()


def dump_tensors(dump, items, prefix: str) -> dict:
    """{prefix/key: CPU copy} of the (key, tensor) `items` that `dump` (a ``RunConfig.dump``: ``wants(key)``,
    ``max_bytes``) asks for, in order, until ``max_bytes`` would be exceeded: one rank's share of
    ``rank{r}.dump.safetensors`` (``grad/<key>``, ``param/<key>``; TRACE_FORMAT.md)."""
    out, used = {}, 0
    for key, t in items:
        size = t.numel() * t.element_size()
        if dump.wants(key) and used + size <= dump.max_bytes:
            out[f"{prefix}/{key}"] = t.detach().cpu().clone().contiguous()
            used += size
    return out
