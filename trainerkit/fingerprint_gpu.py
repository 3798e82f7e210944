"""The fp64v2 fingerprint (`trainerkit.fingerprint`) computed on the GPU with Triton kernels.

`fingerprint_device(t)` / `fingerprint_many(tensors)` return exactly `fingerprint.fingerprint(t)` for every
tensor, bit for bit, without copying tensors to the host: only one 8-byte sum per tensor comes back, and the
final ``mix(S ^ mix(header))`` is applied on the host with the reference's own numpy `_mix` and `_header`.

The kernels and how they compute it: `fingerprint_kernels`.

Launch geometry (`DEFAULT`): ``num_warps`` warps; ``wpt`` words per thread per sub-block (SUBW = num_warps * 32
* wpt words); ``nsub`` sub-blocks per program (BLOCKW = nsub * SUBW words); ``pack`` ("reshape" or "2d"): how
the strided kernel arranges element loads before packing (a 1-D load reshaped to [SUBW, R], or [SUBW, R]);
``loop`` ("static" or "dynamic", contiguous kernel): the sub-blocks in a loop of constexpr trip count with run-time
branches inside, or the whole-word ones in a branch-free loop of run-time trip count then one masked sub-block
(`_words_block_dyn`); ``stages``: Triton's ``num_stages`` for the contiguous kernel; ``narrow`` (dynamic loop):
32-bit index terms and 128-bit word loads where the launch allows them (`_words_block_dyn`: 20 % fewer ALU
instructions per word).  Off by default: on an H100 it equalled the wide loop from 256 MiB up (1.00-1.03 of
torch.sum) but gave 0.90 against 1.00-1.02 on 64 MiB tensors, and on the H200, whose ALU pipe it is meant to
relieve, it is not measured yet (bench/results/README.md, 2026-12-07).

`fingerprint_many_async` launches without waiting and returns a `PendingFingerprints` (`.result()`,
`.hex()`): the kernels run on the current stream, in order with the work that produces and later overwrites
the tensors, so the training step can go on while they run.  Plans (the device tables) are cached by the
tensors' pointers, dtypes, shapes and strides: the same gradient buffers every step cost a dictionary lookup
and no host-to-device copy.

Without Triton the module still imports (`HAVE_TRITON` / `available()` are False); the functions then raise
`TritonUnavailableError` (an ImportError) for CUDA tensors.  CPU tensors are fingerprinted with the
reference implementation, except under ``TRITON_INTERPRET=1`` (set before this module is imported) where
they run through the same kernels in Triton's interpreter (that is how the kernels are tested without a GPU).
"""
from __future__ import annotations

from collections import OrderedDict
from contextlib import nullcontext

import numpy as np
import torch

from .fingerprint import _header, _mix, fingerprint
from .fingerprint_kernels import HAVE_TRITON, INTERPRET

if HAVE_TRITON:
    from .fingerprint_kernels import _contig_kernel, _strided_kernel

DEFAULT = {"num_warps": 4, "wpt": 8, "nsub": 8, "pack": "reshape", "loop": "dynamic", "stages": 3, "narrow": False}
PACKS = ("reshape", "2d")
LOOPS = ("static", "dynamic")
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_GTAB_COLS = 5           # numel, first item, element offset from the launch's base, slot, first word's index
_MAX_DIMS = 4


class TritonUnavailableError(ImportError):
    """Raised when a CUDA tensor is to be fingerprinted but Triton is not installed."""


def available() -> bool:
    """True when CUDA tensors can be fingerprinted on the device (Triton importable)."""
    return HAVE_TRITON


# ----------------------------------------------------------------------------------------------------------
# host side: plans (tables), launches, final mix
# ----------------------------------------------------------------------------------------------------------
def _collapse(t: torch.Tensor):
    """(sizes, strides) of `t` with size-1 dims dropped and mergeable neighbours merged (C order)."""
    dims = [(n, s) for n, s in zip(t.shape, t.stride()) if n != 1]
    out: list = []
    for n, s in dims:
        if out and out[-1][1] == s * n:
            out[-1] = (out[-1][0] * n, s)
        else:
            out.append((n, s))
    return out


def _geometry(cfg: dict) -> tuple[int, int]:
    """(SUBW, BLOCKW): words per sub-block (num_warps * 32 threads * wpt) and per program (nsub sub-blocks)."""
    subw = cfg["num_warps"] * 32 * cfg["wpt"]
    return subw, subw * cfg["nsub"]


def _alignment(m: dict) -> tuple[bool, int]:
    """(16-byte aligned, bytes past the previous 8-byte boundary) of a tensor's data pointer: its launch class."""
    return m["ptr"] % 16 == 0, m["ptr"] % 8


class _Plan:
    """Device table and launch list for one list of tensors (cached: the same gradients every step)."""

    def __init__(self, metas, device, cfg):
        self.hmix = _mix(np.array([_header(m["dtype"], m["shape"]) for m in metas], dtype=np.uint64))
        subw, blockw = _geometry(cfg)
        self.launches: list = []      # ("contig", base, esize, (align16, mis), subw, blockw, row0, item0, nitems,
                                      #  narrow)
                                      # or ("strided", j, sizes4, strides4, esize, subw, blockw)
        by_launch: "OrderedDict[tuple, list]" = OrderedDict()
        strided: list = []
        for j, m in enumerate(metas):
            if m["numel"] == 0:
                continue
            if m["contig"]:
                by_launch.setdefault((m["esize"], _alignment(m)), []).append(j)
            else:
                strided.append(j)
        rows: list = []
        items: list = []              # items[k] = table row (relative to its launch) of program k
        for (esize, align), members in by_launch.items():
            base_ptr = metas[members[0]]["ptr"]
            row0, item0 = len(rows), len(items)
            narrow = cfg["narrow"]
            for r, j in enumerate(members):
                delta = metas[j]["ptr"] - base_ptr
                if delta % esize:
                    raise ValueError(f"tensor {j}: data pointer not aligned to its element size")
                nwords = -(-metas[j]["numel"] * esize // 8)
                narrow = narrow and metas[j].get("wbase", 0) + nwords < 2 ** 32    # j + 1 fits 32 bits
                rows.append([metas[j]["numel"], len(items) - item0, delta // esize, metas[j].get("slot", j),
                             metas[j].get("wbase", 0)])
                items.extend([r] * -(-nwords // blockw))
            self.launches.append(("contig", members[0], esize, align, subw, blockw, row0, item0,
                                  len(items) - item0, narrow))
        # one int64 buffer, one host->device copy: the rows, then the items
        self.items_at = len(rows) * _GTAB_COLS
        flat = np.asarray(rows, dtype=np.int64).reshape(-1)
        self.table = torch.from_numpy(np.concatenate([flat, np.asarray(items, dtype=np.int64)])).to(device)
        for j in strided:
            dims = [(1, 0)] * (_MAX_DIMS - len(metas[j]["dims"])) + list(metas[j]["dims"])
            self.launches.append(("strided", j, [n for n, _ in dims], [s for _, s in dims], metas[j]["esize"],
                                  subw, blockw))


_PLANS: "OrderedDict[tuple, _Plan]" = OrderedDict()
_PLAN_CACHE_SIZE = 8


def _meta(t: torch.Tensor) -> dict:
    esize = t.element_size()
    if esize not in _INT_VIEW:
        raise TypeError(f"fingerprint: unsupported element size {esize} bytes ({t.dtype})")
    dims = None
    contig: "bool | None" = t.is_contiguous()
    if not contig:
        dims = tuple(_collapse(t))
        if len(dims) <= 1 and (not dims or dims[0][1] == 1):
            contig = True          # e.g. a column slice of size 1: contiguous in all but name
        elif len(dims) > _MAX_DIMS:
            contig = None
    return {"esize": esize, "numel": t.numel(), "contig": contig, "dims": dims, "ptr": t.data_ptr(),
            "dtype": t.dtype, "shape": tuple(t.shape)}


def _cfg(overrides: dict) -> dict:
    cfg = dict(DEFAULT)
    for k, v in overrides.items():
        if k not in cfg:
            raise TypeError(f"unknown option {k!r} (known: {sorted(cfg)})")
        if v is not None:
            cfg[k] = v
    if cfg["pack"] not in PACKS:
        raise ValueError(f"pack must be one of {PACKS}")
    if cfg["loop"] not in LOOPS:
        raise ValueError(f"loop must be one of {LOOPS}")
    if not isinstance(cfg["narrow"], bool):
        raise ValueError("narrow must be True or False")
    if cfg["narrow"] and cfg["loop"] != "dynamic":
        raise ValueError("narrow=True needs loop='dynamic' (the static loop has no narrow form)")
    for k in ("num_warps", "wpt", "nsub", "stages"):
        if type(cfg[k]) is not int:       # (bool is an int; 8.0 would pass the range checks and fail in the kernel)
            raise ValueError(f"{k} must be an int, not {cfg[k]!r}")
    if cfg["num_warps"] not in (1, 2, 4, 8, 16, 32) or cfg["nsub"] < 1 or cfg["wpt"] not in (1, 2, 4, 8, 16) \
            or cfg["stages"] not in (1, 2, 3, 4, 5):
        raise ValueError("num_warps must be a power of two <= 32, wpt 1, 2, 4, 8 or 16, nsub >= 1, stages 1-5")
    return cfg


def _plan(tensors: list, cfg: dict, pieces: "tuple | None" = None) -> "tuple[_Plan, list]":
    """The plan for tensors on one device, cached by (pointer, dtype, shape, strides) of every tensor - the
    same gradient buffers every step cost one dictionary lookup.  Views with > 4 non-mergeable dims are
    replaced by contiguous copies (returned in the list, which the caller keeps alive until the kernels are
    done; such plans are not cached).  `pieces` (`word_sums`): (first word's global index, slot) per tensor."""
    key = (tensors[0].device, tuple(sorted(cfg.items())),
           tuple([(t.data_ptr(), t.dtype, t.shape, t.stride()) for t in tensors]), pieces)
    plan = _PLANS.get(key)
    if plan is not None:
        _PLANS.move_to_end(key)
        return plan, tensors
    metas, copied = [], False
    for j, t in enumerate(tensors):
        m = _meta(t)
        if m["contig"] is None:
            tensors[j] = t = t.contiguous()
            m, copied = _meta(t), True
        if pieces is not None:
            if not m["contig"]:
                raise ValueError(f"word_sums: piece {j} is not contiguous")
            m["wbase"], m["slot"] = pieces[j]
        metas.append(m)
    plan = _Plan(metas, tensors[0].device, cfg)
    if not copied:
        _PLANS[key] = plan
        while len(_PLANS) > _PLAN_CACHE_SIZE:
            _PLANS.popitem(last=False)
    return plan, tensors


def _launch(tensors: list, cfg: dict, pieces: "tuple | None" = None,
            nslots: "int | None" = None) -> "tuple[torch.Tensor, _Plan, list]":
    """Launch the kernels for tensors that all live on one device; returns the int64 sums tensor (S of each
    tensor, or of each slot's pieces, filled asynchronously on the current stream), the plan and the tensors
    actually read."""
    plan, tensors = _plan(tensors, cfg, pieces)
    nw, pack2d = cfg["num_warps"], cfg["pack"] == "2d"
    sums = torch.zeros(len(tensors) if nslots is None else nslots, dtype=torch.int64, device=tensors[0].device)
    table = plan.table
    items = table[plan.items_at:]
    for launch in plan.launches:
        if launch[0] == "strided":
            _, j, sizes, strides, esize, subw, blockw = launch
            t = tensors[j].detach().view(_INT_VIEW[esize])
            nwords = -(-t.numel() * esize // 8)
            _strided_kernel[(-(-nwords // blockw),)](
                t, sums, j, t.numel(), sizes[1], sizes[2], sizes[3], *strides, BLOCKW=blockw, SUBW=subw,
                ESIZE=esize, PACK2D=pack2d, num_warps=nw)
        else:
            _, base, esize, (align16, mis), subw, blockw, row0, item0, nitems, narrow = launch
            _contig_kernel[(nitems,)](
                tensors[base].detach().view(_INT_VIEW[esize]), items[item0:], table[row0 * _GTAB_COLS:], sums,
                BLOCKW=blockw, SUBW=subw, ESIZE=esize, ALIGN16=align16, MIS=mis, DYN=cfg["loop"] == "dynamic", NARROW=narrow,
                num_warps=nw, num_stages=cfg["stages"])
    return sums, plan, tensors


class PendingFingerprints:
    """Fingerprints whose kernels are launched but not yet read back: `result()` waits (one device-to-host
    copy of 8 bytes per tensor per device) and applies the final mix on the host."""

    def __init__(self, n: int):
        self._values: list = [None] * n
        self._pending: list = []      # (indices, sums tensor, plan, tensors kept alive)

    def result(self) -> list[int]:
        """Wait for the launched kernels and return the fingerprints as ints (input order)."""
        for idxs, sums, plan, _keep in self._pending:
            with np.errstate(over="ignore"):
                fps = _mix(sums.cpu().numpy().view(np.uint64) ^ plan.hmix)
            for j, v in zip(idxs, fps.tolist()):
                self._values[j] = int(v)
        self._pending = []
        return list(self._values)

    def hex(self) -> list[str]:
        """`result` as 16-digit lowercase hex strings."""
        return [f"{v:016x}" for v in self.result()]


def fingerprint_many_async(tensors, **options) -> PendingFingerprints:
    """Launch `fingerprint_many` without waiting: returns a `PendingFingerprints` (`.result()` / `.hex()`)."""
    cfg = _cfg(options)
    tensors = list(tensors)
    out = PendingFingerprints(len(tensors))
    by_device: "OrderedDict[torch.device, list]" = OrderedDict()
    for j, t in enumerate(tensors):
        if t.is_cuda or (INTERPRET and HAVE_TRITON and t.device.type == "cpu"):
            by_device.setdefault(t.device, []).append(j)
        elif t.device.type == "cpu":
            out._values[j] = fingerprint(t)
        else:
            raise ValueError(f"fingerprint_many: unsupported device {t.device}")
    for device, idxs in by_device.items():
        if not HAVE_TRITON:
            raise TritonUnavailableError("fingerprinting CUDA tensors on the device needs Triton "
                                         "(pip install triton); trainerkit.fingerprint works on the host")
        with torch.cuda.device(device) if device.type == "cuda" else nullcontext():
            sums, plan, keep = _launch(tensors if len(idxs) == len(tensors) else [tensors[j] for j in idxs], cfg)
        out._pending.append((idxs, sums, plan, keep))
    return out


def fingerprint_many(tensors, **options) -> list[int]:
    """`fingerprint.fingerprint` of every tensor of `tensors`, computed on their device in a few launches.

    CUDA tensors (and CPU tensors under ``TRITON_INTERPRET=1``) run through the Triton kernels: one fill +
    one launch per (element size, alignment class) for all contiguous tensors + one per non-contiguous view,
    per device; only 8 bytes per tensor come back.  Other CPU tensors use the reference implementation.
    options (speed only, never the values): num_warps, wpt, nsub, pack, loop, stages, narrow (see `DEFAULT`).

    Raises:
        TypeError: an unknown option.  ValueError: an option's value out of its range, or narrow without the
            dynamic loop.  TritonUnavailableError: CUDA tensors and no Triton.
    """
    return fingerprint_many_async(tensors, **options).result()


def fingerprint_device(t: torch.Tensor, **options) -> int:
    """`fingerprint.fingerprint(t)` computed on t's device (see `fingerprint_many`)."""
    return fingerprint_many([t], **options)[0]


def fingerprint_hex_device(t: torch.Tensor, **options) -> str:
    """`fingerprint.fingerprint_hex(t)`: 16 lowercase hex digits, computed on the device."""
    return f"{fingerprint_device(t, **options):016x}"


def fingerprint_hex_many_device(tensors, **options) -> list[str]:
    """`fingerprint_many` as 16-hex-digit strings."""
    return fingerprint_many_async(tensors, **options).hex()


def word_sums(pieces, word_bases, slots, nslots: int, **options) -> list[int]:
    """Partial sums of fp64v2's S for the pieces of sharded tensors (`trainerkit.fingerprint_shard`): piece k,
    a contiguous 1-D view whose bytes are whole words of a global tensor, the first at global word index
    ``word_bases[k]`` (its last word zero-padded only where the global tensor ends), adds
    ``sum_i mix(w_i ^ mix(word_bases[k] + i + 1))`` to ``slots[k]``; returns the `nslots` sums (ints mod 2^64).
    All pieces on one device, through the contiguous kernel (one launch per alignment class).

    Raises:
        TritonUnavailableError: no Triton.  ValueError: a piece is not contiguous or its pointer not aligned to
            its element size."""
    if not HAVE_TRITON:
        raise TritonUnavailableError("word_sums needs Triton (pip install triton)")
    pieces = [p.detach().reshape(-1) for p in pieces]
    cfg = _cfg(options)
    if not pieces:
        return [0] * nslots
    key = tuple(zip((int(b) for b in word_bases), (int(s) for s in slots)))
    device = pieces[0].device
    with torch.cuda.device(device) if device.type == "cuda" else nullcontext():
        sums, _plan_, _keep = _launch(pieces, cfg, key, nslots)
    return [int(v) for v in sums.cpu().numpy().view(np.uint64).tolist()]
