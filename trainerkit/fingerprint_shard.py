"""The fp64v2 fingerprint of a tensor that no rank holds whole: each rank fingerprints its shard as a partial
record, and `combine` adds the partials up to exactly `trainerkit.fingerprint.fingerprint` of the whole tensor,
without a gather.

Why it composes: fp64v2 is ``mix(S ^ mix(header))`` with ``S = sum_j mix(w_j ^ mix(j + 1)) mod 2^64`` over the
8-byte words w_j of the whole tensor's C-order bytes.  A rank that knows where its elements sit in the whole
tensor knows the global index j of every word it holds entirely and can add those terms; the partial sums of
all ranks add up (mod 2^64) to the part of S over whole-held words.  A word that a shard boundary cuts (a shard
starting or ending at a byte that is not a multiple of 8) is held by two or more ranks: each carries its bytes
of it (an *edge*: word index, first byte, the bytes), and `combine` puts the word together and adds its term.
The zero padding of the tensor's last word belongs to whichever shard holds the tensor's last byte.

A shard (`Shard`) is where a rank's local tensor sits in the global one, in the two ways Megatron shards:

* ``dim`` = d (tensor parallelism, `megatron.core.tensor_parallel.layers`: ColumnParallelLinear splits its
  weight [out, in] along dim 0, RowParallelLinear along dim 1; the vocabulary-parallel embedding along dim 0):
  the local tensor is the global one's slice ``offset : offset + local.shape[d]`` along d; every other dim is
  whole.  In the flattened global tensor that is one contiguous run of elements per index of the dims before d.
* ``dim`` = None (the distributed optimizer, `megatron.core.optimizer.distrib_optimizer`: each DP rank owns a
  contiguous range of a flat buffer): the local tensor, read flat, is elements ``offset : offset + numel`` of
  the flattened global tensor.

Record (JSON, TRACE_FORMAT.md "Sharded tensors"): ``{"partial": "fp64v2", "dtype": "torch.float32", "shape":
[global shape], "dim": d | null, "offset": int, "size": int (local.shape[d], or numel when dim is null), "sum": 16
hex digits, "edges": [[j, first byte, hex bytes], ...]}``.  `combine` checks that the records agree on dtype and
shape and that the shards tile the global tensor exactly (no element twice, none missing).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from .fingerprint import _header, _mix

FORMAT = "fp64v2"


class ShardError(ValueError):
    """Partial fingerprints that do not make one tensor: a gap, an overlap, a shard outside the tensor, a
    record that is not a partial, or disagreeing dtypes / shapes."""


@dataclass(frozen=True)
class Shard:
    """Where a local tensor sits in a global one of shape `global_shape` (module docstring).

    dim: the split dim (`local.shape` equals `global_shape` but along it), or None for a flat range.
    offset: the local tensor's first index along `dim`, or its first element in the flattened global tensor.
    pieces: along `dim`, the local tensor is these slices ``(offset, size)`` of the global one stacked in order
        (a gated MLP's ``linear_fc1`` under TP holds ``[gate_r; up_r]``, megatron/core/transformer/mlp.py
        ``apply_swiglu_sharded_factory``); empty: one slice at `offset`.
    within: ``(start, end)``: the local tensor is only that flat range of the dim-split slice (the distributed
        optimizer's range of a TP shard, `megatron.core.optimizer.distrib_optimizer`); needs `pieces` (the
        slice's sizes cannot be read off a flat range)."""

    global_shape: tuple
    dim: Optional[int] = None
    offset: int = 0
    pieces: tuple = ()
    within: Optional[tuple] = None

    def slices(self, size: int) -> tuple:
        """((offset, size), ...) along `dim` of the dim-split slice whose local size along `dim` is `size`."""
        return tuple((int(o), int(n)) for o, n in self.pieces) or ((int(self.offset), int(size)),)

    def record(self) -> dict:
        """The JSON fields of this shard in a trace (``dim``, ``offset``, and ``pieces`` / ``within`` when set)."""
        out = {"dim": self.dim, "offset": int(self.offset)}
        if self.pieces:
            out["pieces"] = [list(p) for p in self.slices(0)]
        if self.within is not None:
            out["within"] = [int(x) for x in self.within]
        return out

    @classmethod
    def from_record(cls, global_shape, rec: dict) -> "Shard":
        """The shard of a trace's JSON fields (`record`, or a partial fingerprint record)."""
        return cls(tuple(int(n) for n in global_shape), rec.get("dim"), int(rec.get("offset", 0)),
                   tuple(tuple(int(x) for x in p) for p in rec.get("pieces") or ()),
                   tuple(int(x) for x in rec["within"]) if rec.get("within") is not None else None)

    def tag(self) -> str:
        """A short text of the shard for a dump's tensor name (``#<tag>``, `from_tag`)."""
        if self.dim is None:
            return str(int(self.offset))
        text = f"d{self.dim}:" + ("+".join(f"{o}/{n}" for o, n in self.slices(0)) if self.pieces else str(self.offset))
        return text + (f":r{self.within[0]}-{self.within[1]}" if self.within is not None else "")

    @classmethod
    def from_tag(cls, global_shape, tag: str) -> "Shard":
        """The shard `tag` names (ValueError on a malformed one)."""
        if not tag.startswith("d"):
            return cls(tuple(global_shape), None, int(tag))
        dim, where, *rest = tag[1:].split(":")
        pieces = tuple(tuple(int(x) for x in p.split("/")) for p in where.split("+")) if "/" in where else ()
        within = tuple(int(x) for x in rest[0][1:].split("-")) if rest else None
        return cls(tuple(global_shape), int(dim), int(where) if not pieces else pieces[0][0], pieces, within)


def _runs(shard: Shard, size: int) -> tuple[np.ndarray, np.ndarray]:
    """(first element, element count) of each contiguous run, in the flattened global tensor, of `shard` whose
    local size is `size` (along its dim; its numel for a flat range), as int64 arrays in the local tensor's C
    order (with ``within``: the runs of that flat range of the slice).

    Raises:
        ShardError: the shard is not inside the global tensor."""
    shape = tuple(int(n) for n in shard.global_shape)
    dim, offset = shard.dim, int(shard.offset)
    numel = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if dim is None:
        if offset < 0 or size < 0 or offset + size > numel:
            raise ShardError(f"flat shard [{offset}, {offset + size}) is outside a tensor of {numel} elements")
        return np.array([offset], dtype=np.int64), np.array([size], dtype=np.int64)
    if not 0 <= dim < len(shape):
        raise ShardError(f"shard dim {dim} of a {len(shape)}-dim tensor {list(shape)}")
    slices = shard.slices(size)
    for o, n in slices:
        if o < 0 or n < 0 or o + n > shape[dim]:
            raise ShardError(f"shard [{o}, {o + n}) along dim {dim} is outside its size {shape[dim]}")
    outer = int(np.prod(shape[:dim], dtype=np.int64))
    inner = int(np.prod(shape[dim + 1:], dtype=np.int64))
    base = np.arange(outer, dtype=np.int64)[:, None] * (shape[dim] * inner)
    starts = (base + np.array([o * inner for o, _ in slices], dtype=np.int64)[None, :]).reshape(-1)
    counts = np.tile(np.array([n * inner for _, n in slices], dtype=np.int64), outer)
    if shard.within is None:
        return starts, counts
    lo, hi = (int(x) for x in shard.within)
    ends = np.cumsum(counts)
    firsts = ends - counts                   # each run's first position in the local slice, flat
    if not 0 <= lo <= hi <= (int(ends[-1]) if len(ends) else 0):
        raise ShardError(f"range [{lo}, {hi}) is outside a slice of {int(ends[-1]) if len(ends) else 0} elements")
    a, b = np.maximum(firsts, lo), np.minimum(ends, hi)
    keep = b > a
    return (starts + (a - firsts))[keep], (b - a)[keep]


def _local_size(local: torch.Tensor, shard: Shard) -> int:
    """The shard's size (along its dim, or its numel) after checking `local`'s shape against the global one.

    Raises:
        ShardError: `local`'s shape does not fit `shard.global_shape`."""
    g = tuple(shard.global_shape)
    if shard.dim is None:
        return local.numel()
    if not 0 <= shard.dim < len(g):
        raise ShardError(f"shard dim {shard.dim} of a {len(g)}-dim tensor {list(g)}")
    if shard.within is not None:
        if not shard.pieces:
            raise ShardError("a range within a dim slice needs the slice's pieces")
        if local.numel() != shard.within[1] - shard.within[0]:
            raise ShardError(f"{local.numel()} elements in a range [{shard.within[0]}, {shard.within[1]})")
        return sum(n for _, n in shard.slices(0))
    want = g[:shard.dim] + (local.shape[shard.dim] if local.dim() > shard.dim else -1,) + g[shard.dim + 1:]
    if local.dim() != len(g) or tuple(local.shape) != want:
        raise ShardError(f"local shape {list(local.shape)} is not a slice along dim {shard.dim} of {list(g)}")
    if shard.pieces and sum(n for _, n in shard.slices(0)) != local.shape[shard.dim]:
        raise ShardError(f"pieces {list(shard.slices(0))} do not make local size {local.shape[shard.dim]} along "
                         f"dim {shard.dim}")
    return local.shape[shard.dim]


def _pieces(starts: np.ndarray, counts: np.ndarray, esize: int, total: int):
    """Split runs (elements) into whole-held words and edges (bytes of a cut word), in bytes: for each run its
    byte range [b0, b1) in the global tensor (`total` bytes), local byte offset l0, and interior [a, e) of whole
    words (e rounded up at the tensor's end: the padding is the last byte's holder's)."""
    b0 = starts * esize
    b1 = b0 + counts * esize
    l0 = np.concatenate([[0], np.cumsum(counts * esize)[:-1]]).astype(np.int64)
    a = -(-b0 // 8) * 8
    e = np.where(b1 == total, -(-b1 // 8) * 8, b1 // 8 * 8)
    return b0, b1, l0, a, e


def partial(local: torch.Tensor, shard: Shard) -> dict:
    """The partial fingerprint record of `local`, the part `shard` of a global tensor (module docstring).

    local: any dtype of element size 1, 2, 4 or 8, any device (read on the host here; `partial_many` puts
    CUDA tensors' whole words through the Triton kernel), any strides (read in C order).

    Raises:
        ShardError: `local` does not fit `shard`.  TypeError: an unsupported element size."""
    return partial_many([local], [shard])[0]


def partial_many(tensors: list, shards: list) -> list[dict]:
    """`partial` of each (tensor, shard); CUDA tensors' whole words are summed on the device when Triton is
    available (`trainerkit.fingerprint_gpu.word_sums`, one launch for the list), their edges copied here.

    Raises:
        ShardError, TypeError: as `partial`."""
    plans = [_plan(t, s) for t, s in zip(tensors, shards)]
    sums = _device_sums(tensors, plans)
    out = []
    for k, (t, p) in enumerate(zip(tensors, plans)):
        raw = None
        if sums[k] is None or p["edge_spans"]:
            raw = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        s = sums[k] if sums[k] is not None else _host_sum(raw, p)
        edges = [[int(j), int(lo), raw[l0:l1].tobytes().hex()] for j, lo, l0, l1 in p["edge_spans"]]
        out.append({"partial": FORMAT, "dtype": str(t.dtype), "shape": [int(n) for n in p["shape"]],
                    **p["shard"], "size": p["size"], "sum": f"{s:016x}", "edges": edges})
    return out


def _plan(local: torch.Tensor, shard: Shard) -> dict:
    """The shard's runs split into whole-word interiors (local byte offset, word count, first global word) and
    edge spans (global word, first byte in it, local byte range)."""
    esize = local.element_size()
    if esize not in (1, 2, 4, 8):
        raise TypeError(f"fingerprint: unsupported element size {esize} bytes ({local.dtype})")
    size = _local_size(local, shard)
    starts, counts = _runs(shard, size)
    numel = int(np.prod(shard.global_shape, dtype=np.int64)) if len(shard.global_shape) else 1
    b0, b1, l0, a, e = _pieces(starts, counts, esize, numel * esize)
    inner = e > a
    interiors = np.stack([l0 + (a - b0), (e - a) // 8, a // 8], axis=1)[inner]
    spans = []
    cut = np.minimum(a, b1)                  # a run's bytes before its first whole word ...
    for r in np.nonzero(cut > b0)[0]:
        spans.append((int(b0[r] // 8), int(b0[r] % 8), int(l0[r]), int(l0[r] + cut[r] - b0[r])))
    tail = np.maximum(e, a)                  # ... and after its last (tail is a multiple of 8)
    for r in np.nonzero(b1 > tail)[0]:
        spans.append((int(tail[r] // 8), 0, int(l0[r] + tail[r] - b0[r]), int(l0[r] + b1[r] - b0[r])))
    return {"shape": tuple(shard.global_shape), "shard": shard.record(), "size": int(size), "interiors": interiors,
            "edge_spans": sorted(spans), "local_bytes": local.numel() * esize}


def _host_sum(raw: np.ndarray, plan: dict) -> int:
    """Sum (mod 2^64) of the terms of the whole-held words, read from the local bytes `raw`."""
    rows = plan["interiors"]
    if not len(rows):
        return 0
    total_words = int(rows[:, 1].sum())
    buf = np.zeros(total_words * 8, dtype=np.uint8)
    idx = np.empty(total_words, dtype=np.uint64)
    at = 0
    for lb, nw, j0 in rows.tolist():
        have = min(nw * 8, raw.size - lb)       # the tensor's last word: its padding stays zero
        buf[at * 8:at * 8 + have] = raw[lb:lb + have]
        idx[at:at + nw] = np.arange(j0 + 1, j0 + nw + 1, dtype=np.uint64)
        at += nw
    with np.errstate(over="ignore"):
        return int(np.add.reduce(_mix(buf.view("<u8").astype(np.uint64) ^ _mix(idx)), dtype=np.uint64))


def _device_sums(tensors: list, plans: list) -> list:
    """Whole-word sums of CUDA tensors computed by the Triton kernel (None for the others, or without Triton)."""
    # CPU tensors too under TRITON_INTERPRET=1 (how the kernel is tested without a GPU), as fingerprint_gpu does
    interpret = os.environ.get("TRITON_INTERPRET", "0") == "1"
    cuda = [k for k, t in enumerate(tensors) if t.device.type == "cuda" or (interpret and t.device.type == "cpu")]
    out: list = [None] * len(tensors)
    if not cuda:
        return out
    from . import fingerprint_gpu
    if not fingerprint_gpu.available():
        return out
    views, bases, slots = [], [], []
    for k in cuda:
        flat = tensors[k].detach().contiguous().reshape(-1)
        es = flat.element_size()
        for lb, nw, j0 in plans[k]["interiors"].tolist():
            n = min(nw * 8, plans[k]["local_bytes"] - lb) // es
            views.append(flat[lb // es:lb // es + n])
            bases.append(j0)
            slots.append(k)
    sums = fingerprint_gpu.word_sums(views, bases, slots, len(tensors))
    for k in cuda:
        out[k] = sums[k]
    return out


def combine(partials: list[dict]) -> int:
    """The fingerprint (`trainerkit.fingerprint.fingerprint`, an int) of the global tensor whose shards'
    partial records are `partials` (any order; dtype and global shape are the records').

    Raises:
        ShardError: no records, a record that is not an fp64v2 partial, records that disagree on dtype or
            shape, or shards that do not tile the tensor exactly (an element held twice or by none), naming the
            first such element."""
    if not partials:
        raise ShardError("no partial fingerprint records to combine")
    kinds = set()
    for i, p in enumerate(partials):
        if not isinstance(p, dict) or p.get("partial") != FORMAT:
            raise ShardError(f"partial {i}: not an {FORMAT} partial fingerprint record")
        kinds.add((p["dtype"], tuple(p["shape"])))
    if len(kinds) > 1:
        raise ShardError(f"partial records of different tensors: {sorted(kinds)}")
    dtype_name, shape = kinds.pop()
    dtype = getattr(torch, dtype_name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ShardError(f"partial records: unknown dtype {dtype_name!r}")
    numel = int(np.prod(shape, dtype=np.int64)) if shape else 1
    starts, counts, total = [], [], 0
    words: dict[int, int] = {}
    for p in partials:
        s, c = _runs(Shard.from_record(shape, p), int(p["size"]))
        starts.append(s)
        counts.append(c)
        total = (total + int(p["sum"], 16)) % 2 ** 64
        for j, lo, hexbytes in p["edges"]:
            word = int.from_bytes(bytes.fromhex(hexbytes), "little") << (8 * int(lo))
            words[int(j)] = words.get(int(j), 0) | word
    _check_tiling(np.concatenate(starts) if starts else np.zeros(0, np.int64),
                  np.concatenate(counts) if counts else np.zeros(0, np.int64), numel, shape)
    with np.errstate(over="ignore"):
        if words:
            j = np.fromiter(words, dtype=np.uint64, count=len(words))
            w = np.fromiter(words.values(), dtype=np.uint64, count=len(words))
            total = (total + int(np.add.reduce(_mix(w ^ _mix(j + np.uint64(1))), dtype=np.uint64))) % 2 ** 64
        return int(_mix(np.uint64(total) ^ _mix(_header(dtype, shape))))


def _check_tiling(starts: np.ndarray, counts: np.ndarray, numel: int, shape: tuple) -> None:
    keep = counts > 0
    starts, counts = starts[keep], counts[keep]
    order = np.argsort(starts, kind="stable")
    starts, counts = starts[order], counts[order]
    ends = starts + counts
    expected = np.concatenate([[0], ends[:-1]]) if len(starts) else np.zeros(0, np.int64)
    bad = np.nonzero(starts != expected)[0]
    if len(bad):
        k = int(bad[0])
        what = "held by two shards" if starts[k] < expected[k] else "held by no shard"
        at = int(min(starts[k], expected[k]))
        raise ShardError(f"tensor {list(shape)}: element {at} (flat) {what}")
    covered = int(ends[-1]) if len(ends) else 0
    if covered != numel:
        raise ShardError(f"tensor {list(shape)}: element {covered} (flat) held by no shard")


def place(whole: torch.Tensor, local: torch.Tensor, shard: Shard) -> None:
    """Copy `local`, the part `shard` of `whole` (contiguous, of shape ``shard.global_shape``), into `whole`.

    Raises:
        ShardError: `local` does not fit `shard`."""
    starts, counts = _runs(shard, _local_size(local, shard))
    flat, src, at = whole.view(-1), local.detach().reshape(-1).to(whole.dtype), 0
    for s, c in zip(starts.tolist(), counts.tolist()):
        flat[s:s + c] = src[at:at + c]
        at += c


def take(whole: torch.Tensor, shard: Shard) -> torch.Tensor:
    """The part `shard` of `whole` (of shape ``shard.global_shape``) as the rank holding it has it: a dim slice
    with its ``pieces`` stacked along the dim, or, with ``within``, that flat range of it.  The inverse of `place`.

    Raises:
        ShardError: a shard without ``pieces`` (its size is not known), or not inside `whole`."""
    if shard.dim is None or not shard.pieces:
        raise ShardError("take: the shard needs a dim and its pieces")
    g = tuple(shard.global_shape)
    size = sum(n for _, n in shard.slices(0))
    starts, counts = _runs(shard, size)
    flat = whole.reshape(-1)
    out = torch.cat([flat[s:s + c] for s, c in zip(starts.tolist(), counts.tolist())])
    return out if shard.within is not None else out.view(g[:shard.dim] + (size,) + g[shard.dim + 1:])


def assemble(pieces: list[tuple[torch.Tensor, Shard]]) -> torch.Tensor:
    """The global tensor put together from its shards ``(local, shard)`` (all of one global shape and dtype):
    the dump of a sharded run (`trainerkit.capture.dump_tensors`) read back whole.

    Raises:
        ShardError: no pieces, or pieces that do not tile the tensor exactly (naming the first element)."""
    if not pieces:
        raise ShardError("no shards to assemble")
    shape = tuple(pieces[0][1].global_shape)
    whole = torch.empty(shape, dtype=pieces[0][0].dtype)
    starts, counts = [], []
    for local, shard in pieces:
        s, c = _runs(shard, _local_size(local, shard))
        starts.append(s)
        counts.append(c)
        place(whole, local, shard)
    _check_tiling(np.concatenate(starts), np.concatenate(counts), whole.numel(), shape)
    return whole


def fingerprint_of(partials: list[dict]) -> str:
    """`combine` as 16 hex digits (the trace's form)."""
    return f"{combine(partials):016x}"
