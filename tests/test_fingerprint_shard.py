"""Sharded fingerprints (`trainerkit.fingerprint_shard`): the partials of any tiling of a tensor, by dim slices
(tensor parallelism) or flat ranges (the distributed optimizer), combine to exactly the whole tensor's fp64v2
fingerprint, including shards that cut an 8-byte word; a wrong tiling is refused naming the element; a shard
fingerprinted at the wrong offset (planted) gives another fingerprint.  The device path is in
tests/test_fingerprint_gpu.py (Triton, or its interpreter on a CPU-only machine)."""
from __future__ import annotations

import json
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainerkit.capture import dump_tensors, read_dumps
from trainerkit.config import DumpConfig
from trainerkit.fingerprint import fingerprint
from trainerkit.fingerprint_shard import Shard, ShardError, assemble, combine, fingerprint_of, partial, partial_many

pytestmark = pytest.mark.arithmetic_free      # bits hashed, no floating-point result judged

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.uint8, torch.int32, torch.bool]


def _random(dtype: torch.dtype, shape: tuple, seed: int) -> torch.Tensor:
    """Random bits in every position (NaN payloads, -0.0 included): a tensor of `dtype` from uint8 bytes."""
    g = torch.Generator().manual_seed(seed)
    n = 1
    for s in shape:
        n *= s
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) < 0.5
    size = torch.empty((), dtype=dtype).element_size()
    return torch.randint(0, 256, (n * size,), generator=g, dtype=torch.uint8).view(dtype).reshape(shape)


@st.composite
def tilings(draw):
    """(tensor, [(local, Shard)]): a random tensor of 1-3 dims cut into 1-4 shards along one dim or flat."""
    dtype = draw(st.sampled_from(DTYPES))
    shape = tuple(draw(st.lists(st.integers(1, 9), min_size=1, max_size=3)))
    t = _random(dtype, shape, draw(st.integers(0, 2 ** 16)))
    dim = draw(st.one_of(st.none(), st.integers(0, len(shape) - 1)))
    n = t.numel() if dim is None else shape[dim]
    cuts = sorted(set(draw(st.lists(st.integers(0, n), max_size=3)) + [0, n]))
    shards = []
    for a, b in zip(cuts, cuts[1:]):
        local = t.reshape(-1)[a:b] if dim is None else t.narrow(dim, a, b - a)
        shards.append((local, Shard(shape, dim, a)))
    return t, draw(st.permutations(shards))


@settings(max_examples=300, deadline=None)
@given(tilings())
def test_partials_of_any_tiling_combine_to_the_whole_fingerprint(case):
    t, shards = case
    parts = partial_many([loc for loc, _ in shards], [s for _, s in shards])
    parts = json.loads(json.dumps(parts))          # as a trace carries them
    assert combine(parts) == fingerprint(t)


@settings(max_examples=100, deadline=None)
@given(tilings())
def test_shards_assemble_to_the_whole_tensor_bit_for_bit(case):
    t, shards = case
    whole = assemble(shards)
    assert whole.dtype == t.dtype and whole.shape == t.shape
    assert torch.equal(whole.reshape(-1).view(torch.uint8) if t.dtype != torch.bool else whole,
                       t.reshape(-1).view(torch.uint8) if t.dtype != torch.bool else t)


def test_assemble_refuses_shards_that_do_not_tile():
    t = _random(torch.float32, (4, 3), 1)
    with pytest.raises(ShardError, match="element 3 .flat. held by no shard"):
        assemble([(t.reshape(-1)[:3], Shard((4, 3), None, 0)), (t.reshape(-1)[6:], Shard((4, 3), None, 6))])
    with pytest.raises(ShardError, match="held by two shards"):
        assemble([(t[:3], Shard((4, 3), 0, 0)), (t[2:], Shard((4, 3), 0, 2))])


def test_sharded_dumps_are_read_back_whole(tmp_path):
    """Each rank dumps its shard (flat range or slice) under a name that says where it sits; `read_dumps` puts the
    ranks' files together; a key whose shards do not tile (a rank's dump cut by max_bytes) is left out."""
    from safetensors.torch import save_file
    a, b = _random(torch.float32, (5, 6), 2), _random(torch.bfloat16, (4, 7), 3)
    dump = DumpConfig(step=0, keys=["*"])
    ranks = [[("a", a.reshape(-1)[:13], Shard((5, 6), None, 0)), ("b", b[:, :3], Shard((4, 7), 1, 0)),
              ("c", a, None)],
             [("a", a.reshape(-1)[13:], Shard((5, 6), None, 13)), ("b", b[:, 3:6], Shard((4, 7), 1, 3))]]
    for r, items in enumerate(ranks):
        out = dump_tensors(dump, [(k, x) for k, x, _ in items], "grad", [s for _, _, s in items])
        save_file(out, str(tmp_path / f"rank{r}.dump.safetensors"))
    got = read_dumps(tmp_path, {"a": [5, 6], "b": [4, 7], "c": [5, 6]})
    assert set(got) == {"grad/a", "grad/c"}            # b's column 6 is in no rank's dump
    assert torch.equal(got["grad/a"], a) and torch.equal(got["grad/c"], a)


def test_word_cuts_are_carried_as_edges():
    """bf16 [3, 5] split along dim 1 at 2: every row's run is 4 or 6 bytes, so words are cut between shards."""
    t = _random(torch.bfloat16, (3, 5), 1)
    a, b = partial(t[:, :2], Shard((3, 5), 1, 0)), partial(t[:, 2:], Shard((3, 5), 1, 2))
    assert a["edges"] and b["edges"]
    assert {e[0] for e in a["edges"]} & {e[0] for e in b["edges"]}      # a word both shards hold a part of
    assert fingerprint_of([a, b]) == f"{fingerprint(t):016x}"


def test_aligned_column_shards_have_no_edges():
    """The common case (fp32 [8, 16] split in halves along dim 1: 32-byte runs) needs no edge bytes."""
    t = _random(torch.float32, (8, 16), 2)
    parts = [partial(t[:, i * 8:(i + 1) * 8], Shard((8, 16), 1, 8 * i)) for i in range(2)]
    assert not any(p["edges"] for p in parts)
    assert combine(parts) == fingerprint(t)


def test_planted_wrong_offset_changes_the_fingerprint():
    """A rank that fingerprints its TP shard with the neighbour's offset (its bytes placed at the wrong global
    words) while the tiling stays whole: the combined fingerprint is not the tensor's."""
    t = _random(torch.float32, (4, 8), 3)
    good = [partial(t[:, :4], Shard((4, 8), 1, 0)), partial(t[:, 4:], Shard((4, 8), 1, 4))]
    swapped = [partial(t[:, :4], Shard((4, 8), 1, 4)), partial(t[:, 4:], Shard((4, 8), 1, 0))]
    assert combine(good) == fingerprint(t)
    assert combine(swapped) != fingerprint(t)


@pytest.mark.parametrize("shards, words", [
    ([(None, 0, 6), (None, 5, 7)], "element 5 (flat) held by two shards"),
    ([(None, 0, 5), (None, 6, 6)], "element 5 (flat) held by no shard"),
    ([(None, 0, 11)], "element 11 (flat) held by no shard"),
    ([(0, 0, 2), (0, 1, 2)], "element 4 (flat) held by two shards"),
], ids=["overlap", "gap", "short", "dim-overlap"])
def test_a_wrong_tiling_is_refused_naming_the_element(shards, words):
    t = _random(torch.float32, (3, 4), 4)
    parts = []
    for dim, off, size in shards:
        local = t.reshape(-1)[off:off + size] if dim is None else t.narrow(dim, off, size)
        parts.append(partial(local, Shard((3, 4), dim, off)))
    with pytest.raises(ShardError, match=words.replace("(", r"\(").replace(")", r"\)")):
        combine(parts)


@pytest.mark.parametrize("local_shape, shard, words", [
    ((3, 2), Shard((3, 4), 1, 3), "outside its size 4"),
    ((2, 4), Shard((3, 4), 1, 0), "not a slice along dim 1"),
    ((5,), Shard((3, 4), None, 10), "outside a tensor of 12 elements"),
    ((3, 4), Shard((3, 4), 2, 0), "shard dim 2 of a 2-dim tensor"),
])
def test_a_shard_that_does_not_fit_is_refused(local_shape, shard, words):
    with pytest.raises(ShardError, match=words):
        partial(torch.zeros(local_shape), shard)


def test_a_record_that_is_not_a_partial_is_refused():
    with pytest.raises(ShardError, match="partial 0: not an fp64v2 partial"):
        combine([{"sum": "00"}])


def test_records_of_two_tensors_or_none_are_refused():
    t = _random(torch.float32, (2, 4), 5)
    a = partial(t[:1], Shard((2, 4), 0, 0))
    b = partial(t.to(torch.bfloat16)[1:], Shard((2, 4), 0, 1))
    with pytest.raises(ShardError, match="partial records of different tensors"):
        combine([a, b])
    with pytest.raises(ShardError, match="no partial fingerprint records"):
        combine([])


# --- the harness's merge: a sharded tensor's partial records from every rank become the whole fingerprint ---

def _rank_traces(tmp_path, tensors: dict, shards_of: dict, step_of=lambda rank, key, rec: rec):
    """Two rank traces (format bitparity-rank-trace/2): rank r holds shard r of each key in `shards_of`
    ({key: [(local of rank 0, Shard), (local of rank 1, Shard)]}) and rank 0 the whole of the other keys.
    `step_of` may replace a rank's step-0 gradient record of a key (a planted defect)."""
    from trainerkit.fingerprint import fingerprint_hex
    for rank in (0, 1):
        metas, grads = [], {}
        for i, (key, t) in enumerate(tensors.items()):
            meta = {"key": key, "name": key, "replica": None, "shape": list(t.shape), "dtype": str(t.dtype),
                    "family": "other", "weight_decay": True, "order": [5, 0, 1 << 40, key]}
            if key in shards_of:
                local, shard = shards_of[key][rank]
                metas.append({**meta, "shard": {"dim": shard.dim, "offset": shard.offset}})
                grads[key] = step_of(rank, key, partial(local, shard))
            elif rank == 0:
                metas.append(meta)
                grads[key] = fingerprint_hex(t)
        header = {"type": "header", "format": "bitparity-rank-trace/2", "rank": rank, "world_size": 2,
                  "pp_rank": rank, "ep_rank": 0, "reductions": "megatron", "stages": [rank], "params": metas}
        step = {"type": "step", "step": 0, "grads": grads, "params": grads, "buffers": {}, "grad_norm": None,
                "clip_coeff": None, "time_s": 0.1}
        lines = [header, {"type": "init", "params": grads}, step, {"type": "end"}]
        (tmp_path / f"rank{rank}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return tmp_path


def test_merge_combines_partials_into_the_whole_fingerprint(tmp_path):
    from harness.judging.trace import merge
    from trainerkit.fingerprint import fingerprint_hex
    w = _random(torch.bfloat16, (6, 10), 7)        # 20-byte rows split 3 | 7: cut words
    n = _random(torch.float32, (10,), 8)
    run = _rank_traces(tmp_path, {"w": w, "n": n},
                       {"w": [(w[:, :3], Shard((6, 10), 1, 0)), (w[:, 3:], Shard((6, 10), 1, 3))]})
    trace = merge(run, 2)
    for part in (trace.init, trace.steps[0].grads, trace.steps[0].params):
        assert part == {"w": fingerprint_hex(w), "n": fingerprint_hex(n)}
    assert [s["rank"] for s in trace.params["w"]["shards"]] == [0, 1]


def test_merge_planted_wrong_offset_is_a_divergence_of_that_tensor(tmp_path):
    """Rank 1 fingerprints its shard as if it sat one column to the left (its offset wrong by one) while its
    header is right: the merged fingerprint of `w` is not the whole tensor's, and the comparison with a
    correct run names `w` at step 0."""
    from harness.judging.compare import compare
    from harness.judging.trace import merge
    w = _random(torch.float32, (4, 8), 9)
    shards = {"w": [(w[:, :4], Shard((4, 8), 1, 0)), (w[:, 4:], Shard((4, 8), 1, 4))]}
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    good = merge(_rank_traces(tmp_path / "a", {"w": w}, shards), 2)

    def wrong(rank, key, rec):
        return partial(w[:, 4:].roll(1, dims=1), Shard((4, 8), 1, 4)) if rank == 1 else rec
    bad = merge(_rank_traces(tmp_path / "b", {"w": w}, shards, step_of=wrong), 2)
    assert good.steps[0].grads["w"] != bad.steps[0].grads["w"]
    fd = compare(good, bad).first_divergence
    assert fd is not None and fd.name == "w" and fd.step == 0


@pytest.mark.parametrize("plant, words", [
    (lambda rank, key, rec: {**rec, "offset": 3} if rank == 1 else rec, "tensor [8]: element 3 (flat) held by two shards"),
    (lambda rank, key, rec: "0" * 16 if rank == 1 else rec, "1 partial fingerprints for the 2 shards"),
], ids=["overlap", "missing"])
def test_merge_refuses_partials_that_do_not_tile(tmp_path, plant, words):
    from harness.judging.trace import TraceError, merge
    w = _random(torch.float32, (8,), 10)
    run = _rank_traces(tmp_path, {"w": w}, {"w": [(w[:4], Shard((8,), 0, 0)), (w[4:], Shard((8,), 0, 4))]},
                       step_of=plant)
    with pytest.raises(TraceError, match=r"^init params w \(ranks \[0, 1\]\): " + re.escape(words) if
                       "held" in words else r"^init params w: " + re.escape(words)):
        merge(run, 2)


@st.composite
def nested_tilings(draw):
    """(tensor, [(local, Shard)]): a random tensor whose dim `dim` is split over 1-4 tensor-parallel ranks as a
    gated MLP's ``linear_fc1`` is (each rank holds rows r of the gate half and rows r of the up half, stacked),
    and each rank's slice, read flat, cut again into 1-3 distributed-optimizer ranges (``within``)."""
    dtype = draw(st.sampled_from(DTYPES))
    tp = draw(st.integers(1, 4))
    rows = draw(st.integers(1, 3)) * tp          # per half: each TP rank holds rows / tp of it
    rest = tuple(draw(st.lists(st.integers(1, 5), max_size=2)))
    dim = draw(st.integers(0, len(rest)))
    shape = rest[:dim] + (2 * rows,) + rest[dim:]
    t = _random(dtype, shape, draw(st.integers(0, 2 ** 16)))
    shards, per = [], rows // tp
    for r in range(tp):
        pieces = ((r * per, per), (rows + r * per, per))
        local = torch.cat([t.narrow(dim, o, n) for o, n in pieces], dim=dim).contiguous()
        cuts = sorted(set(draw(st.lists(st.integers(0, local.numel()), max_size=2)) + [0, local.numel()]))
        for a, b in zip(cuts, cuts[1:]):
            shards.append((local.reshape(-1)[a:b], Shard(shape, dim, pieces[0][0], pieces, (a, b))))
    return t, draw(st.permutations(shards))


@settings(max_examples=200, deadline=None)
@given(nested_tilings())
def test_ranges_of_two_piece_tp_slices_combine_and_assemble_to_the_whole(case):
    t, shards = case
    parts = json.loads(json.dumps(partial_many([loc for loc, _ in shards], [s for _, s in shards])))
    assert combine(parts) == fingerprint(t)
    whole = assemble(shards)
    if t.dtype != torch.bool:
        assert torch.equal(whole.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))
    for _, s in shards:        # the dump's name of a shard reads back as the same shard
        assert Shard.from_tag(s.global_shape, s.tag()) == s
        assert Shard.from_record(s.global_shape, s.record()) == s


def test_a_tp_slice_at_the_wrong_piece_offset_is_another_fingerprint():
    """Planted: the up half of rank 1's fc1 slice fingerprinted as if it sat right after the gate half."""
    t = _random(torch.float32, (8, 3), 4)
    good = [Shard((8, 3), 0, 0, ((0, 2), (4, 2))), Shard((8, 3), 0, 2, ((2, 2), (6, 2)))]
    locals_ = [torch.cat([t[o:o + n] for o, n in s.pieces]) for s in good]
    assert combine(partial_many(locals_, good)) == fingerprint(t)
    bad = [good[0], Shard((8, 3), 0, 2, ((2, 2), (4, 2)))]
    with pytest.raises(ShardError, match="held by two shards"):
        combine(partial_many(locals_, bad))
