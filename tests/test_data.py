"""Tests for trainerkit/data.py: deterministic real-text microbatches and the three data sources.

The Megatron MMIDIDX index is written here from the format description (megatron/core/datasets/
indexed_dataset.py), not with the reader under test.
"""
import struct

import numpy as np
import pytest
import torch

from trainerkit import text
from trainerkit.config import DataConfig
from trainerkit.data import DataError, TokenDataset, load_documents

S, B, V = 32, 2, 256


@pytest.fixture(scope="module")
def default_ds():
    return TokenDataset(DataConfig(), seed=1234, seq_length=S, micro_batch_size=B, vocab_size=V)


def full_rows(tokens, labels):
    """Reassemble each row's S+1 token window x from tokens = x[:-1], labels = x[1:]."""
    return torch.cat([tokens, labels[:, -1:]], dim=1)


def unpadded(row):
    """The row without its zero padding tail (padding only ever appears at the end)."""
    row = row.tolist()
    n = len(row)
    while n and row[n - 1] == 0:
        n -= 1
    assert 0 not in row[:n], "zero inside a row: padding must be a tail"
    return row[:n]


def is_substring(piece, doc):
    """`piece` (list) occurs contiguously in `doc` (list)."""
    return any(doc[i:i + len(piece)] == piece for i in range(len(doc) - len(piece) + 1))


# --- default source ------------------------------------------------------------------------------------------

def test_microbatch_types_and_shapes(default_ds):
    tokens, labels, mask = default_ds.microbatch(0, 0)
    assert tokens.shape == labels.shape == mask.shape == (B, S)
    assert tokens.dtype == labels.dtype == torch.int64 and mask.dtype == torch.float32
    assert tokens.min() >= 0 and labels.max() < V


def test_microbatches_deterministic_and_distinct(default_ds):
    """Same (step, mb) -> identical tensors (also from a fresh dataset); other mb / step / seed -> different."""
    a = default_ds.microbatch(2, 1)
    b = default_ds.microbatch(2, 1)
    c = TokenDataset(DataConfig(), seed=1234, seq_length=S, micro_batch_size=B, vocab_size=V).microbatch(2, 1)
    for x, y, z in zip(a, b, c):
        assert torch.equal(x, y) and torch.equal(x, z)
    assert not torch.equal(a[0], default_ds.microbatch(2, 0)[0])
    assert not torch.equal(a[0], default_ds.microbatch(3, 1)[0])
    other_seed = TokenDataset(DataConfig(), seed=99, seq_length=S, micro_batch_size=B, vocab_size=V)
    assert not torch.equal(a[0], other_seed.microbatch(2, 1)[0])


def test_rows_depend_only_on_their_own_coordinates():
    """Row r of a microbatch is the same whatever the micro batch size (no dependence on the other rows)."""
    small = TokenDataset(DataConfig(), seed=5, seq_length=S, micro_batch_size=1, vocab_size=V)
    big = TokenDataset(DataConfig(), seed=5, seq_length=S, micro_batch_size=3, vocab_size=V)
    assert torch.equal(small.microbatch(1, 2)[0][0], big.microbatch(1, 2)[0][0])


def test_tokens_labels_shift_and_mask(default_ds):
    """labels are tokens shifted left by one; loss_mask is 0 exactly where the label is padding (0)."""
    padded = 0
    for mb in range(16):
        tokens, labels, mask = default_ds.microbatch(0, mb)
        assert torch.equal(tokens[:, 1:], labels[:, :-1])
        assert torch.equal(mask == 0, labels == 0)
        assert set(mask.unique().tolist()) <= {0.0, 1.0}
        padded += int(mask.sum().item() < B * S)
    assert padded >= 1, "some microbatch in the first 16 must have fewer than b*s real tokens"


def test_default_rows_are_real_english_text(default_ds):
    """Each row is a contiguous piece of one document of the shipped text (byte-level tokens)."""
    docs = text.documents()
    tokens, labels, _ = default_ds.microbatch(0, 3)
    for row in full_rows(tokens, labels):
        piece = bytes(unpadded(row))
        assert len(piece) >= 2 and any(piece in d for d in docs)


# --- the shipped text: the same bytes and token stream on every Python ------------------------------------

#: sha256 of the first 8 microbatches of steps 0..2 at the defaults above (tokens then labels, int64
#: little-endian): a function of the shipped bytes, the seed and numpy's PCG64 only
STREAM_SHA256 = "dc186879bb86c1d333eb5e8e81247c696a26b83c82712eae5d495034e86d6ac2"


def _interpreters():
    """Every CPython >= 3.10 this machine has (pyenv's versions, plus this one)."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path
    found = {sys.executable}
    root = Path(subprocess.run(["pyenv", "root"], capture_output=True, text=True).stdout.strip() or "/nonexistent") \
        if shutil.which("pyenv") else Path("/nonexistent")
    for exe in sorted((root / "versions").glob("3.*/bin/python3")):
        if tuple(map(int, exe.parent.parent.name.split(".")[:2])) >= (3, 10):
            found.add(str(exe))
    return sorted(found)


def test_shipped_text_is_the_same_bytes_under_every_python():
    """The documents (bytes and boundaries) read by each interpreter the machine has, stdlib only."""
    import subprocess
    from pathlib import Path
    root = Path(text.__file__).resolve().parent.parent.parent
    probe = ("import hashlib, sys; sys.path.insert(0, sys.argv[1]); import trainerkit.text as t; d = t.documents(); "
             "print(len(d), hashlib.sha256(b'|'.join(hashlib.sha256(x).digest() for x in d)).hexdigest())")
    seen = {}
    for exe in _interpreters():
        out = subprocess.run([exe, "-c", probe, str(root)], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, (exe, out.stderr[-500:])
        seen[exe] = out.stdout.strip()
    assert len(set(seen.values())) == 1 and next(iter(seen.values())).startswith("79 "), seen


def test_default_token_stream_is_pinned():
    import hashlib
    ds = TokenDataset(DataConfig(), seed=1234, seq_length=S, micro_batch_size=B, vocab_size=V)
    h = hashlib.sha256()
    for step in range(3):
        for mb in range(8):
            tokens, labels, _ = ds.microbatch(step, mb)
            h.update(tokens.numpy().astype("<i8").tobytes() + labels.numpy().astype("<i8").tobytes())
    assert h.hexdigest() == STREAM_SHA256


def test_a_changed_shipped_text_is_one_line_naming_the_file(tmp_path):
    bad = tmp_path / "topics.txt"
    raw = bytearray(text.PATH.read_bytes())
    raw[1000] ^= 0x20
    bad.write_bytes(bytes(raw))
    pinned = r"sha256 [0-9a-f]{16}\.\.\. is not the pinned a00e91188694bf3f"
    with pytest.raises(text.TextError, match=rf"^{bad}: {pinned}"):
        text.documents(bad)
    with pytest.raises(text.TextError, match="unreadable"):
        text.documents(tmp_path / "missing.txt")


def test_a_changed_shipped_text_stops_verify_before_anything_runs(tmp_path):
    """A checkout whose text was edited (or had its line endings converted): exit 2, one line, no report."""
    from conftest import ROOT
    from planted import planted_tree, run_planted
    tree = planted_tree(tmp_path / "tree", {})
    path = tree / "trainerkit" / "text" / text.PATH.name
    path.write_bytes(path.read_bytes().replace(b"\n", b"\r\n"))
    proc = run_planted(tree, "verify", ROOT / "cases/smoke.yaml", "--out", tmp_path / "out")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert f"smoke.yaml: training.data (default: the shipped training text): {path}: sha256" in proc.stderr, proc.stderr
    assert "git checkout -- trainerkit/text" in proc.stderr, proc.stderr
    assert not (tmp_path / "out" / "smoke").exists()


# --- text file source ----------------------------------------------------------------------------------------

def test_text_file_source(tmp_path):
    """A text file: byte tokens, one document per blank-line-separated block; rows never cross blocks."""
    paras = [b"The quick brown fox jumps over the lazy dog. " * 3,
             b"Pack my box with five dozen liquor jugs!\nSecond line of the same block.",
             b"Sphinx of black quartz, judge my vow. " * 4]
    f = tmp_path / "corpus.txt"
    f.write_bytes(b"\n\n".join(paras) + b"\n\n\n")
    docs = load_documents(DataConfig(path=str(f)))
    assert [bytes(d.astype(np.uint8)) for d in docs] == paras
    ds = TokenDataset(DataConfig(path=str(f)), seed=0, seq_length=16, micro_batch_size=4, vocab_size=V)
    for mb in range(8):
        tokens, labels, mask = ds.microbatch(0, mb)
        assert torch.equal(mask == 0, labels == 0)
        for row in full_rows(tokens, labels):
            piece = bytes(unpadded(row))
            assert any(piece in p for p in paras), piece


def test_text_file_drops_nul_bytes(tmp_path):
    f = tmp_path / "nul.txt"
    f.write_bytes(b"ab\x00cd\x00ef")
    (doc,) = load_documents(DataConfig(path=str(f)))
    assert bytes(doc.astype(np.uint8)) == b"abcdef"


# --- Megatron indexed dataset --------------------------------------------------------------------------------

def write_mmidx(prefix, docs, code, magic=b"MMIDIDX\x00\x00", version=1):
    """Write prefix.idx / prefix.bin in Megatron's MMIDIDX v1 layout (one sequence per document)."""
    np_dtype = {4: np.int32, 8: np.uint16}[code]
    arrays = [np.asarray(d, dtype=np_dtype) for d in docs]
    sizes = np.array([a.size for a in arrays], dtype=np.int32)
    pointers = np.zeros(len(arrays), dtype=np.int64)
    pointers[1:] = np.cumsum([a.nbytes for a in arrays])[:-1]
    doc_idx = np.arange(len(arrays) + 1, dtype=np.int64)
    with open(f"{prefix}.idx", "wb") as fh:
        fh.write(magic)
        fh.write(struct.pack("<Q", version))
        fh.write(struct.pack("<B", code))
        fh.write(struct.pack("<Q", len(arrays)))
        fh.write(struct.pack("<Q", len(doc_idx)))
        fh.write(sizes.tobytes())
        fh.write(pointers.tobytes())
        fh.write(doc_idx.tobytes())
    with open(f"{prefix}.bin", "wb") as fh:
        for a in arrays:
            fh.write(a.tobytes())
    return str(prefix)


@pytest.mark.parametrize("code, high", [(4, 100_000), (8, 65_535)])
def test_indexed_dataset_round_trip(tmp_path, code, high):
    """Token ids written with int32 (code 4) or uint16 (code 8) are read back exactly, one doc per sequence;
    1-token documents are dropped (they yield no (token, label) pair)."""
    rng = np.random.default_rng(code)
    docs = [rng.integers(1, high + 1, size=n).tolist() for n in (5, 1, 40, 17, 3)]
    docs[2][0] = high                                          # the largest id survives the dtype
    prefix = write_mmidx(tmp_path / "ds", docs, code)
    got = load_documents(DataConfig(path=prefix))
    assert [d.tolist() for d in got] == [d for d in docs if len(d) >= 2]
    assert all(d.dtype == np.int64 for d in got)

    ds = TokenDataset(DataConfig(path=prefix), seed=3, seq_length=8, micro_batch_size=3, vocab_size=high + 1)
    for mb in range(6):
        tokens, labels, mask = ds.microbatch(0, mb)
        assert torch.equal(mask == 0, labels == 0)
        for row in full_rows(tokens, labels):
            piece = unpadded(row)
            assert any(is_substring(piece, d) for d in docs), piece


def test_indexed_dataset_vocab_check_names_file(tmp_path):
    """Token ids must be < vocab_size: the boundary id == vocab_size is rejected, naming the file."""
    prefix = write_mmidx(tmp_path / "big", [[1, 2, 3], [4, 300, 6]], 4)
    for vocab in (256, 300):
        with pytest.raises(DataError, match=rf"big.*300.*vocab_size {vocab}"):
            TokenDataset(DataConfig(path=prefix), seed=0, seq_length=4, micro_batch_size=1, vocab_size=vocab)
    TokenDataset(DataConfig(path=prefix), seed=0, seq_length=4, micro_batch_size=1, vocab_size=301)


def test_text_token_id_over_vocab_raises(tmp_path):
    f = tmp_path / "high.txt"
    f.write_bytes("naïve café".encode("utf-8"))             # bytes >= 128
    with pytest.raises(DataError, match="high.txt"):
        TokenDataset(DataConfig(path=str(f)), seed=0, seq_length=4, micro_batch_size=1, vocab_size=128)


# --- errors ---------------------------------------------------------------------------------------------------

def test_missing_path_raises(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(DataError, match="nope"):
        load_documents(DataConfig(path=str(missing)))


def test_missing_bin_raises(tmp_path):
    prefix = write_mmidx(tmp_path / "half", [[1, 2, 3]], 4)
    (tmp_path / "half.bin").unlink()
    with pytest.raises(DataError, match=r"half\.bin"):
        load_documents(DataConfig(path=prefix))


def test_bad_magic_raises(tmp_path):
    prefix = write_mmidx(tmp_path / "magic", [[1, 2, 3]], 4, magic=b"NOTMMIDX\x00")
    with pytest.raises(DataError, match=r"magic\.idx.*magic"):
        load_documents(DataConfig(path=prefix))


@pytest.mark.parametrize("code, version", [(4, 2), (99, 1)])
def test_unsupported_version_or_dtype_raises(tmp_path, code, version):
    prefix = tmp_path / "odd"
    write_mmidx(prefix, [[1, 2, 3]], 4)
    raw = bytearray((tmp_path / "odd.idx").read_bytes())
    raw[9:17] = struct.pack("<Q", version)
    raw[17] = code
    (tmp_path / "odd.idx").write_bytes(bytes(raw))
    with pytest.raises(DataError, match=r"odd\.idx"):
        load_documents(DataConfig(path=str(prefix)))


def test_empty_text_file_raises(tmp_path):
    f = tmp_path / "empty.txt"
    f.write_bytes(b"\n\n  \n\nx\n\n")                          # only blank blocks and a 1-token document
    with pytest.raises(DataError, match="empty.txt"):
        load_documents(DataConfig(path=str(f)))


# --- unreadable indexed data raises DataError naming the files ---------


def test_truncated_idx_raises_data_error(tmp_path):
    (tmp_path / "trunc.idx").write_bytes(b"MMIDIDX\x00\x00" + struct.pack("<Q", 1))   # header cut short
    (tmp_path / "trunc.bin").write_bytes(np.arange(1, 5, dtype=np.int32).tobytes())
    with pytest.raises(DataError, match=r"trunc\.idx"):
        load_documents(DataConfig(path=str(tmp_path / "trunc")))


@pytest.mark.parametrize("bin_bytes", [b"", np.array([1, 2, 3], dtype=np.int32).tobytes()])
def test_bin_shorter_than_index_raises_data_error(tmp_path, bin_bytes):
    """An empty .bin, or one shorter than the sizes/pointers in the .idx claim."""
    prefix = write_mmidx(tmp_path / "short", [[1, 2, 3], [4, 5, 6, 7]], 4)
    (tmp_path / "short.bin").write_bytes(bin_bytes)
    with pytest.raises(DataError, match=r"short"):
        load_documents(DataConfig(path=prefix))


def test_negative_and_empty_and_extension_paths(tmp_path):
    """Negative ids, an empty path, and a prefix given with its .idx extension."""
    prefix = write_mmidx(tmp_path / "neg", [[1, -5, 3]], 4)
    with pytest.raises(DataError, match="negative token id -5"):
        TokenDataset(DataConfig(path=prefix), 0, 4, 1, 256)
    with pytest.raises(DataError, match="empty"):
        load_documents(DataConfig(path=" "))
    good = write_mmidx(tmp_path / "good", [[1, 2, 3], [4, 5, 6, 7]], 4)
    assert [d.tolist() for d in load_documents(DataConfig(path=good + ".idx"))] == [[1, 2, 3], [4, 5, 6, 7]]


def test_a_variants_relative_data_path_is_relative_to_the_case_file(tmp_path, monkeypatch):
    """`options.data.path` resolves like `training.data.path`: against the case file, not the working directory."""
    from harness.planning.cases import load_case
    (tmp_path / "cases").mkdir()
    (tmp_path / "cases" / "mytext.txt").write_bytes(b"The quick brown fox jumps over the lazy dog. " * 20)
    case = tmp_path / "cases" / "c.yaml"
    case.write_text("model: {num_layers: 2, moe_layer_freq: '[0]*1+[1]*1', hidden_size: 32, mtp_num_layers: 0}\n"
                    "training: {train_iters: 1, seq_length: 16, num_microbatches: 2}\n"
                    "baseline: {name: b, pipeline_model_parallel_layout: 'Et|tL', pipeline_model_parallel_size: 2,"
                    " options: {data: {path: mytext.txt}}}\n"
                    "variants: [{name: v, pipeline_model_parallel_layout: 'EttL', pipeline_model_parallel_size: 1,"
                    " expect: bitwise, options: {data: {path: mytext.txt}}}]\n")
    monkeypatch.chdir(tmp_path)
    plan = load_case(case)
    assert [r.config.training.data.path for r in plan.runs] == [str(tmp_path / "cases" / "mytext.txt")] * 2
