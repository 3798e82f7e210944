"""The public capture API: what any training loop calls to write its rank's bitparity trace.

Format ``bitparity-rank-trace/2`` (TRACE_FORMAT.md is the contract; `harness` only reads it).  One file per
rank, ``rank{r}.jsonl``, one JSON object per line:

* ``header``: who the rank is (rank, world size, pp / ep / dp ranks and sizes, the flat stages it holds) and its
  ``params`` (`param_entry`: global name, replica tag, shape, dtype, family, weight-decay group, canonical order);
* ``init``: fingerprints of the initial values;
* ``step``: fingerprints of every gradient after gradient finalisation, every parameter after the optimizer step,
  the buffers (router ``expert_bias``), the grad norm and clip coefficient, the loss rank's per-microbatch losses;
* ``end``: written by `RankCapture.close` after the last step.

`RankCapture` takes no collective of its own and never waits for the device in the training loop's thread:
fingerprints of CUDA tensors are reductions launched on the current stream (`fingerprint_hex_many_async`;
later in-place updates on that stream cannot race them), and a writer thread waits for their results, formats
the record and appends it (flushed per record, so a crashed rank leaves a readable prefix up to the last record
the thread wrote).  CPU tensors are fingerprinted in the caller's thread (numpy), before the loop can change them.
`CaptureClock` times the capture calls inside the rank (host seconds; CUDA events on the device), so the
capture's cost is measured where it is paid, not guessed from whole-step wall times.

Two trainers write through it: the megatron trainer (`megatron_trainer.train`) and megatron's own training loop
(`megatron_trainer.pretrain_hooks`, Megatron-LM's ``pretrain_gpt.py`` unmodified); the reference trainer uses
`TraceWriter` and `scalar` directly.
"""
from __future__ import annotations

import itertools
import json
import queue
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional

import torch

from . import names
from .fingerprint import PendingHex, fingerprint_hex_many_async, float_bits_hex
from .fingerprint_shard import Shard, partial_many

FORMAT = "bitparity-rank-trace/2"


def scalar(t: torch.Tensor) -> dict:
    """{hex, value} of a one-element float tensor: exact bits plus the decimal value."""
    return {"hex": float_bits_hex(t), "value": float(t.item())}


def float64_scalar(x: float) -> dict:
    """{hex, value} of a Python float as its float64 bits (megatron's grad norm and clip coefficient)."""
    return scalar(torch.tensor(x, dtype=torch.float64))


def param_entry(key: str, name: str, replica: Optional[str], tensor: torch.Tensor, weight_decay: bool,
                strict: bool = True, shard: Optional[Shard] = None) -> dict:
    """The header's description of one parameter: {key, name, replica, shape, dtype, family, weight_decay,
    order} (TRACE_FORMAT.md).  `strict`: the name must be one of DeepSeek-V3's parameters as bitparity's trainers
    build them (`trainerkit.names`, raises ValueError otherwise); not strict (a user's own model in megatron's
    training loop), any name gets a family and a canonical place (`names.family`, `names.order_key`).
    `shard`: this rank holds only that part of the parameter (`trainerkit.fingerprint_shard.Shard`; the
    distributed optimizer's range, a tensor-parallel slice): ``shape`` is then the global shape and the entry
    gets ``shard: {dim, offset[, pieces, within]}``, and `RankCapture` writes partial records for the key (TRACE_FORMAT.md
    "Sharded tensors")."""
    entry = {"key": key, "name": name, "replica": replica,
             "shape": list(shard.global_shape if shard is not None else tensor.shape),
             "dtype": str(tensor.dtype).replace("torch.", ""), "family": names.family(name, strict=strict),
             "weight_decay": weight_decay, "order": list(names.order_key(name, strict=strict))}
    if shard is not None:
        entry["shard"] = shard.record()
    return entry


def microbatch_losses(lm: list, mtp: list, mtp_num_layers: int, dp_size: int = 1, dp_rank: int = 0) -> list:
    """The step record's ``losses`` (TRACE_FORMAT.md) of one loss rank: per local microbatch m, from `lm` [(sum(CE
    * mask), num_tokens)] (fp32, int tensors) and `mtp` [depth losses, m-major], ``{microbatch: m * dp_size +
    dp_rank (global), lm: sum / max(num_tokens, 1), num_tokens, mtp: [...]}``."""
    return [{"microbatch": m * dp_size + dp_rank, "lm": scalar(s / n.clamp(min=1)), "num_tokens": int(n.item()),
             "mtp": [scalar(x) for x in mtp[m * mtp_num_layers:(m + 1) * mtp_num_layers]]}
            for m, (s, n) in enumerate(lm)]


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


@dataclass
class StepTiming:
    """What `CaptureClock.end_step` measured of one step; `fields` gives the step record's timing fields."""

    host_s: float
    cpu_s: float = 0.0
    start: "Optional[torch.cuda.Event]" = None
    end: "Optional[torch.cuda.Event]" = None
    spans: list = field(default_factory=list)

    def fields(self) -> dict:
        """``capture_s`` (host seconds inside the capture calls), ``cpu_s`` (CPU seconds this rank's process used over
        the step, every thread: ``time.process_time``; a rank that waits on a peer or the device without spinning
        uses less than its wall time); on CUDA also ``step_device_s`` (device seconds
        from the step's first event to its last, capture included) and ``capture_device_s`` (device seconds
        between each capture call's two events, summed: the fingerprint kernels, at the position in the stream
        where the loop queued them).  Waits for the step's last event (call it where the loop waits anyway, or
        in a writer thread)."""
        out = {"capture_s": self.host_s, "cpu_s": self.cpu_s}
        if self.start is not None and self.end is not None:
            self.end.synchronize()
            out["step_device_s"] = self.start.elapsed_time(self.end) / 1e3
            out["capture_device_s"] = sum(a.elapsed_time(b) for a, b in self.spans) / 1e3
        return out


class CaptureClock:
    """Times a training step and the capture calls inside it, inside the rank: host seconds with
    ``time.perf_counter`` and, once the process uses CUDA, device seconds between CUDA events recorded on the
    current stream (``torch.cuda.Event(enable_timing=True)``).  Events cost no synchronisation where they are
    recorded, so the step runs as it would without them; whole-step wall times, by contrast, carry the noise of
    everything else the machine does, which is larger than the capture they would measure.

    Usage: ``begin_step()``; ``with capture(): ...`` around each capture call; ``end_step()`` -> `StepTiming`."""

    def __init__(self) -> None:
        self._host, self._start, self._spans, self._cpu0 = 0.0, None, [], time.process_time()

    @staticmethod
    def _event():
        if not torch.cuda.is_initialized():
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def begin_step(self) -> None:
        """Start a step: reset the sums, record the step's first event."""
        self._host, self._spans, self._start = 0.0, [], self._event()
        self._cpu0 = time.process_time()

    @contextmanager
    def capture(self):
        """Count what runs inside as capture (host time; on CUDA the device time between two events)."""
        t0, first = time.perf_counter(), self._event()
        try:
            yield
        finally:
            if first is not None:
                self._spans.append((first, self._event()))
            self._host += time.perf_counter() - t0

    @property
    def host_s(self) -> float:
        """Host seconds inside capture calls since `begin_step`."""
        return self._host

    def end_step(self) -> StepTiming:
        """Record the step's last event; the `StepTiming` resolves the device times later (`StepTiming.fields`)."""
        return StepTiming(self._host, time.process_time() - self._cpu0, self._start, self._event(), list(self._spans))


class CaptureError(RuntimeError):
    """The capture's writer thread failed (disk full, unwritable directory): raised in the training loop's
    thread at the next call, naming the trace file."""


_STOP = object()
_TIMING = "_timing"          # the pending entry holding the step's `StepTiming`


def _timed(method):
    """Count the time the training loop spends inside a `RankCapture` call as capture (`CaptureClock`)."""
    def timed(self, *args, **kwargs):
        with self._clock.capture():
            return method(self, *args, **kwargs)
    timed.__name__, timed.__doc__ = method.__name__, method.__doc__
    return timed


def segment_dir(out_dir: Path, first_iteration: int) -> Path:
    """Where a job that starts at iteration `first_iteration` writes its rank traces: ``out_dir`` for a job from
    scratch, ``out_dir/iter{N:07d}`` for one resumed from a checkpoint of N iterations (Megatron-LM's ``--load``,
    `megatron_trainer.pretrain_hooks`), so a stopped and resumed job adds to its trace directory instead of
    overwriting it; `bitparity compare` stitches the segments by iteration (`harness.compare_dirs`)."""
    return out_dir if first_iteration == 0 else out_dir / f"iter{first_iteration:07d}"


class RankCapture:
    """One rank's trace, written by a background thread.

    Call order per rank (every call is local: no collective, no device synchronisation)::

        cap = RankCapture(path, header)          # header: identity + "params" (param_entry), written first
        cap.initial(values)                      # the parameters before the first update, aligned with `keys`
        for each step:
            cap.begin_step(step)
            cap.grads(main_grads)                # after gradient finalisation, before the optimizer step
            cap.params(values); cap.buffers({...})
            cap.set(grad_norm=..., clip_coeff=..., clipped=..., losses=[...], lm_loss={...})
            cap.end_step(time_s)                 # queued; fingerprints resolve in the writer thread
        cap.close()                              # the end record; waits for the thread

    `keys` (the header's params' keys, in order) name the tensors of `initial`, `grads` and `params`; for a key
    the header declares with a ``shard`` (`param_entry`) the tensor is this rank's part, written as a partial
    record (`trainerkit.fingerprint_shard.partial_many`, computed in the caller's thread).
    `fingerprints=False` (``RunConfig.capture == "losses"``): the step records carry no fingerprints.

    Raises:
        CaptureError: (from any call) the writer thread failed; OSError from the constructor when the file
            cannot be opened.
    """

    def __init__(self, path: Path, header: dict, fingerprints: bool = True):
        self.path = Path(path)
        self.keys = [p["key"] for p in header.get("params", [])]
        self._shards = {i: Shard.from_record(p["shape"], p["shard"])
                        for i, p in enumerate(header.get("params", [])) if "shard" in p}
        self._fingerprints = fingerprints
        self._writer = TraceWriter(self.path)
        self._queue: queue.Queue = queue.Queue()
        self._error: Optional[BaseException] = None
        self._record: Optional[dict] = None
        self._pending: dict = {}
        self._clock = CaptureClock()
        self._thread = threading.Thread(target=self._drain, name=f"bitparity-capture-{self.path.name}", daemon=True)
        self._thread.start()
        self._put({"type": "header", "format": FORMAT, **header}, {})

    # --- the training loop's calls ---------------------------------------------------------------------------
    @_timed
    def initial(self, values: list) -> None:
        """Fingerprint the initial parameter values ([tensor] aligned with `keys`) into the ``init`` record."""
        self._put({"type": "init"}, {"params": self._start(values)})

    def resumed(self, step: int, values: list, states: dict, buffers: dict) -> None:
        """The ``resumed`` record of a run that loaded a checkpoint saved after `step`: the state it loaded,
        before its first step: parameters ([tensor] aligned with `keys`, as `params`), Adam's moments (as
        `optimizer_state`), buffers (as `buffers`).  The harness compares it with the saving run's step `step`
        bit for bit, under any layout (TRACE_FORMAT.md "Resumed runs")."""
        self.begin_step(step)
        self._record["type"] = "resumed"
        self.optimizer_state(states)
        self.params(values)
        self.buffers(buffers)
        self.end_step(0.0)

    def begin_step(self, step: int) -> None:
        """Open step `step` (0-based, the run's own count)."""
        self._check()
        self._clock.begin_step()
        self._record, self._pending = {"type": "step", "step": step, "grads": {}, "grad_norm": None,
                                       "clip_coeff": None, "clipped": None, "params": {}, "buffers": {}}, {}

    @_timed
    def grads(self, tensors: list) -> None:
        """Fingerprint the gradients as the optimizer will see them ([tensor] aligned with `keys`; megatron's
        fp32 ``main_grad``): call before the optimizer step, which may scale them in place (clipping)."""
        self._step_record()
        self._pending["grads"] = self._start(tensors)

    @_timed
    def params(self, tensors: list) -> None:
        """Fingerprint the parameters after the optimizer step ([tensor] aligned with `keys`; the fp32 master
        where the optimizer keeps one)."""
        self._step_record()
        self._pending["params"] = self._start(tensors)

    @_timed
    def optimizer_state(self, states: dict) -> None:
        """Fingerprint Adam's moments after the optimizer step: {`names.OPTIMIZER_STATES` name: [tensor] aligned with
        `keys`}, each tensor the shape of what the optimizer steps (the fp32 master, or this rank's range of it
        under the distributed optimizer; TRACE_FORMAT.md).

        Raises:
            ValueError: a name that is not one of `names.OPTIMIZER_STATES`."""
        self._step_record()
        for name, tensors in states.items():
            if name not in names.OPTIMIZER_STATES:
                raise ValueError(f"optimizer state {name!r} is not one of {names.OPTIMIZER_STATES}")
            self._pending[name] = self._start(tensors)

    @_timed
    def buffers(self, named: dict) -> None:
        """Fingerprint named buffers after their update ({global name: tensor}, e.g. the routers' expert_bias)."""
        self._step_record()
        self._pending["buffers"] = (list(named), fingerprint_hex_many_async(list(named.values())), {}) if named else {}

    @_timed
    def set(self, **fields) -> None:
        """Put plain fields into the open step record (``grad_norm``, ``clip_coeff`` as `scalar` dicts,
        ``clipped``, ``losses``, ``lm_loss``, ``overlap``, ...; TRACE_FORMAT.md)."""
        self._step_record().update(fields)

    def end_step(self, time_s: float) -> None:
        """Close the open step (`time_s`: the step's host seconds) and queue it for the writer thread.  The record
        gets `StepTiming.fields`: ``capture_s``, the host time the loop spent inside this step's capture calls (on
        CUDA: launching the fingerprint kernels; on CPU: computing them), and on CUDA ``step_device_s`` /
        ``capture_device_s`` from CUDA events between `begin_step` and here (resolved by the writer thread)."""
        record = self._step_record()
        record["time_s"] = time_s
        self._put(record, {**self._pending, _TIMING: self._clock.end_step()})
        self._record, self._pending = None, {}

    def close(self) -> None:
        """Write the ``end`` record and wait for every queued record to be on disk.

        Raises:
            CaptureError: the writer thread failed."""
        if self._thread.is_alive():
            self._put({"type": "end"}, {})
            self._queue.put(_STOP)
            self._thread.join()
        self._writer.close()
        self._check()

    # --- internals ---------------------------------------------------------------------------------------------
    def _start(self, tensors: list):
        if not self._fingerprints:
            return {}
        if len(tensors) != len(self.keys):
            raise ValueError(f"{len(tensors)} tensors for the header's {len(self.keys)} parameters")
        if not self._shards:
            return self.keys, fingerprint_hex_many_async(list(tensors)), {}
        whole = [i for i in range(len(tensors)) if i not in self._shards]
        sharded = list(self._shards)
        partials = dict(zip((self.keys[i] for i in sharded),
                            partial_many([tensors[i] for i in sharded], [self._shards[i] for i in sharded])))
        return [self.keys[i] for i in whole], fingerprint_hex_many_async([tensors[i] for i in whole]), partials

    def _step_record(self) -> dict:
        self._check()
        if self._record is None:
            raise RuntimeError("RankCapture: no open step (call begin_step first)")
        return self._record

    def _put(self, record: dict, pending: dict) -> None:
        self._check()
        self._queue.put((record, pending))

    def _check(self) -> None:
        if self._error is not None:
            raise CaptureError(f"{self.path}: the capture's writer failed: {self._error}") from self._error

    def _drain(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            if self._error is not None:
                continue                  # keep draining so the loop never blocks on a full queue
            record, pending = item
            try:
                for part, started in pending.items():
                    if part == _TIMING:
                        record.update(started.fields())
                    else:
                        record[part] = _resolved(started)
                self._writer.write(record)
            except BaseException as e:    # reported in the training loop's thread (CaptureError)
                self._error = e


def _resolved(started) -> dict:
    """{key: hex or partial record} from `_start`'s (keys, PendingHex, partials), waiting for device
    fingerprints; {} as is."""
    if not started:
        return {}
    keys, pending, partials = started
    assert isinstance(pending, PendingHex)
    return {**dict(zip(keys, pending.hex())), **partials}


def dump_tensors(dump, items: Iterable, prefix: str, shards: Optional[list] = None) -> dict:
    """{prefix/key: CPU copy} of the (key, tensor) `items` that `dump` (a ``RunConfig.dump``: ``wants(key)``,
    ``max_bytes``) asks for, in order, until ``max_bytes`` would be exceeded: one rank's share of
    ``rank{r}.dump.safetensors`` (``grad/<key>``, ``param/<key>``; TRACE_FORMAT.md).  `shards`: a
    `trainerkit.fingerprint_shard.Shard` or None per item; a sharded item is this rank's part, stored as
    ``prefix/key#<Shard.tag()>`` (``#offset`` for a flat range, ``#d<dim>:<offset>`` for a slice), which
    `read_dumps` puts together."""
    out, used = {}, 0
    for (key, t), shard in zip(items, shards if shards is not None else itertools.repeat(None)):
        size = t.numel() * t.element_size()
        if dump.wants(key) and used + size <= dump.max_bytes:
            name = f"{prefix}/{key}" if shard is None else f"{prefix}/{key}#{shard.tag()}"
            out[name] = t.detach().cpu().clone().contiguous()
            used += size
    return out


def read_dumps(run_dir: Path, shapes: dict) -> dict:
    """{``grad/<key>`` | ``param/<key>``: tensor} of every ``rank*.dump.safetensors`` in `run_dir`, the shards
    of a sharded run (`dump_tensors`) put together into the whole tensor of its key's global shape (`shapes`:
    {key: shape}, the trace's params).  A key whose shards do not tile it (a rank's dump cut by ``max_bytes``)
    is left out.

    Raises:
        KeyError: a sharded key that `shapes` lacks."""
    from safetensors.torch import load_file

    from .fingerprint_shard import Shard, ShardError, assemble
    whole, pieces = {}, {}
    for f in sorted(Path(run_dir).glob("rank*.dump.safetensors")):
        for name, t in load_file(str(f)).items():
            base, _, where = name.partition("#")
            if not where:
                whole[name] = t
                continue
            key = base.split("/", 1)[1]
            pieces.setdefault(base, []).append((t, Shard.from_tag(tuple(shapes[key]), where)))
    for base, parts in pieces.items():
        try:
            whole[base] = assemble(parts)
        except ShardError:
            continue
    return whole
