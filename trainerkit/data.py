"""Real-text token data, identical on every rank and in every layout.

Sources (`DataConfig.path`): None -> the training text the repo ships (`trainerkit/text/`: CPython 3.11.7's
language-reference topics, one document per topic, byte-level tokens 1..255, sha256-checked, so the same
token stream under every Python and on every platform); a plain text file -> its bytes, one document per
blank-line-separated paragraph block; a Megatron indexed dataset prefix (``prefix.bin`` + ``prefix.idx``,
MMIDIDX v1 as in ``megatron/core/datasets/indexed_dataset.py``) -> its documents' token ids.

Token id 0 is padding: a sample that runs past its document's end is padded with 0 and masked out of the
loss, so token counts differ between microbatches (which the loss normalisation must get right).
The sample for (step, microbatch, row) depends only on the seed, never on the rank or layout.
"""
from __future__ import annotations

import hashlib
import struct
from pathlib import Path

import numpy as np

from . import text
from .config import DataConfig

_IDX_MAGIC = b"MMIDIDX\x00\x00"
_IDX_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
               8: np.uint16}


class DataError(ValueError):
    """Unreadable or unsuitable data source (message names the file and the problem)."""


def _default_documents() -> list[np.ndarray]:
    try:
        docs = text.documents()
    except text.TextError as e:
        raise DataError(f"data (default: {text.NAME}): {e}") from None
    return [np.frombuffer(doc, dtype=np.uint8).astype(np.int64) for doc in docs]


def text_sha256(cfg: DataConfig) -> str:
    """sha256 of the bytes behind `cfg` when it is the shipped text or a text file (for the manifest), '' for an
    indexed dataset, 'unreadable (reason)' when the file went away after validation (never raises)."""
    if cfg.path is None:        # the pinned bytes: `text.documents` refuses any other
        return text.SHA256
    path = Path(cfg.path)
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else ""
    except OSError as e:
        return f"unreadable ({e.strerror or e})"


def _text_documents(path: Path) -> list[np.ndarray]:
    raw = path.read_bytes()
    docs = [np.frombuffer(block, dtype=np.uint8).astype(np.int64) for block in raw.split(b"\n\n") if block.strip()]
    return [d[d != 0] for d in docs]


def _indexed_documents(prefix: Path) -> list[np.ndarray]:
    idx, binf = prefix.with_name(prefix.name + ".idx"), prefix.with_name(prefix.name + ".bin")
    for f in (idx, binf):
        if not f.is_file():
            raise DataError(f"data.path {prefix}: missing {f.name}")
    buf = idx.read_bytes()
    if not buf.startswith(_IDX_MAGIC):
        raise DataError(f"data.path {idx}: not a Megatron MMIDIDX index (bad magic)")
    try:
        off = len(_IDX_MAGIC)
        version, code, n_seq, n_doc = struct.unpack_from("<QBQQ", buf, off)
        if version != 1 or code not in _IDX_DTYPES:
            raise DataError(f"data.path {idx}: unsupported index version {version} / dtype code {code}")
        off += struct.calcsize("<QBQQ")
        sizes = np.frombuffer(buf, dtype=np.int32, count=n_seq, offset=off)
        pointers = np.frombuffer(buf, dtype=np.int64, count=n_seq, offset=off + 4 * n_seq)
        doc_idx = np.frombuffer(buf, dtype=np.int64, count=n_doc, offset=off + 12 * n_seq)
        data = np.memmap(binf, dtype=np.uint8, mode="r")
        dtype = np.dtype(_IDX_DTYPES[code])
        seqs = [np.frombuffer(data, dtype=dtype, count=int(n), offset=int(p)).astype(np.int64)
                for n, p in zip(sizes, pointers)]
    except (struct.error, ValueError) as e:
        raise DataError(f"data.path {prefix} ({idx.name}, {binf.name}): unreadable indexed dataset ({e})") from None
    # A document is the run of sequences between consecutive doc_idx entries (Megatron's document_indices).
    bounds = [int(b) for b in doc_idx] if n_doc >= 2 else [0, len(seqs)]
    return [np.concatenate(seqs[a:b]) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]


def load_documents(cfg: DataConfig) -> list[np.ndarray]:
    """Documents as int64 token arrays.  Raises `DataError` for a missing/unreadable/empty source."""
    if cfg.path is None:
        docs = _default_documents()
    else:
        path = Path(cfg.path)
        if path.suffix in (".bin", ".idx") and path.is_file():   # a prefix given with its extension
            path = path.with_suffix("")
        if not cfg.path.strip():
            raise DataError("data.path is empty")
        if path.is_file():
            docs = _text_documents(path)
        elif path.with_name(path.name + ".idx").exists() or path.with_name(path.name + ".bin").exists():
            docs = _indexed_documents(path)
        else:
            raise DataError(f"data.path {cfg.path}: no such file (nor {path.name}.bin/.idx)")
    docs = [d for d in docs if d.size >= 2]
    if not docs:
        raise DataError(f"data.path {cfg.path or text.NAME}: no document with at least 2 tokens")
    return docs


class TokenDataset:
    """Microbatches of ``micro_batch_size`` rows of ``seq_length`` tokens.

    Row r of microbatch m of step k: a document and start offset drawn from
    ``Generator(PCG64(SeedSequence([seed, k, m, r])))``; tokens = x[:-1], labels = x[1:], loss_mask = 1 where
    the label is a real token.  With probability ``cfg.pad_fraction`` the row starts close to its document's
    end (its tail padded and masked); a microbatch in ``cfg.empty_microbatches`` has its tokens and labels as
    drawn and a loss mask of zeros.
    """

    def __init__(self, cfg: DataConfig, seed: int, seq_length: int, micro_batch_size: int, vocab_size: int):
        self.docs = load_documents(cfg)
        top, low = max(int(d.max()) for d in self.docs), min(int(d.min()) for d in self.docs)
        if low < 0:
            raise DataError(f"data.path {cfg.path}: negative token id {low}")
        if top >= vocab_size:
            raise DataError(f"data.path {cfg.path or text.NAME}: token id {top} >= vocab_size {vocab_size}")
        self.seed, self.s, self.b, self.cfg = seed, seq_length, micro_batch_size, cfg

    def _row(self, step: int, mb: int, row: int) -> np.ndarray:
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, step, mb, row])))
        doc = self.docs[int(rng.integers(len(self.docs)))]
        # a row that starts close to its document's end is padded and partly masked (the draw is made whatever
        # the fraction, so the other rows' offsets do not depend on it)
        if rng.random() < self.cfg.pad_fraction:
            start = max(0, doc.size - int(rng.integers(2, self.s + 1)))
        else:
            start = int(rng.integers(max(1, doc.size - self.s)))
        x = np.zeros(self.s + 1, dtype=np.int64)
        piece = doc[start:start + self.s + 1]
        x[:piece.size] = piece
        return x

    def microbatch(self, step: int, mb: int):
        """(tokens [b, s] int64, labels [b, s] int64, loss_mask [b, s] fp32) on the CPU."""
        import torch  # the ranks' (imported long before); the harness validates data without loading torch
        rows = np.stack([self._row(step, mb, r) for r in range(self.b)])
        tokens, labels = torch.from_numpy(rows[:, :-1].copy()), torch.from_numpy(rows[:, 1:].copy())
        mask = (labels != 0).float()
        if self.cfg.is_empty(step, mb):
            mask.zero_()
        return tokens, labels, mask
