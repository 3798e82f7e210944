"""Loss masks and padding as Megatron-LM's data path builds them (`DataConfig.pad_fraction`,
``empty_microbatches``), and Megatron's per-token loss normalisation in the reference trainer
(``megatron: {calculate_per_token_loss: true}``, reference_impl/model/losses.py).

* the data: an empty microbatch has tokens and labels as drawn and a mask of zeros, every other microbatch is
  untouched; more padding masks more labels; the default (0.25) keeps every existing stream's bits;
* bad entries are one line naming the key, before anything runs;
* the reference trainer trains through an empty microbatch (finite, both normalisations), its layouts agree
  bit for bit under the per-token loss, and the per-token loss moves the gradients (another weighting of
  microbatches whose token counts differ), while the logged losses stay per-microbatch means.
"""
from __future__ import annotations

import json
import textwrap

import pytest
import torch
from conftest import run_cli
from test_cli_errors import _check_usage_error

from trainerkit.config import DataConfig
from trainerkit.data import TokenDataset


def _ds(**data) -> TokenDataset:
    return TokenDataset(DataConfig(**data), 1234, 16, 2, 256)


def test_an_empty_microbatch_has_its_tokens_and_no_loss_bearing_token():
    plain, empty = _ds(), _ds(empty_microbatches=[[1, 3]])
    for step in range(3):
        for mb in range(5):
            a, b = plain.microbatch(step, mb), empty.microbatch(step, mb)
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
            if (step, mb) == (1, 3):
                assert a[2].sum() > 0 and b[2].sum() == 0
            else:
                assert torch.equal(a[2], b[2])


def test_pad_fraction_masks_more_labels_and_its_default_keeps_the_stream():
    def masked(ds):
        return sum(int((ds.microbatch(s, m)[2] == 0).sum()) for s in range(4) for m in range(8))
    assert masked(_ds(pad_fraction=1.0)) > masked(_ds()) > masked(_ds(pad_fraction=0.0))
    for m in range(4):
        assert all(torch.equal(x, y) for x, y in zip(_ds().microbatch(0, m), _ds(pad_fraction=0.25).microbatch(0, m)))


CASE = textwrap.dedent("""\
    name: masks
    timeout_s: 120
    model: {num_layers: 4, moe_layer_freq: "[0]*1+[1]*3"}
    training: {train_iters: 2, seq_length: 8, num_microbatches: 4, data: {empty_microbatches: [[1, 2]]}}
    baseline: {name: pp2, pipeline_model_parallel_layout: "Ett|ttmL", pipeline_model_parallel_size: 2}
    variants:
      - {name: pp4, pipeline_model_parallel_layout: "Et|tt|tm|L", pipeline_model_parallel_size: 4}
      - {name: per-token/pp2, pipeline_model_parallel_layout: "Ett|ttmL", pipeline_model_parallel_size: 2,
         megatron: {calculate_per_token_loss: true}, expect: diverge, first_divergence: {step: 0, kind: grad}}
      - {name: per-token/pp4, pipeline_model_parallel_layout: "Et|tt|tm|L", pipeline_model_parallel_size: 4,
         megatron: {calculate_per_token_loss: true}, compare_to: per-token/pp2}
    """)


@pytest.mark.slow
def test_the_reference_trainer_trains_through_an_empty_microbatch_in_both_normalisations(tmp_path):
    (tmp_path / "masks.yaml").write_text(CASE)
    proc = run_cli("verify", tmp_path / "masks.yaml", "--out", tmp_path / "out")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((tmp_path / "out/masks/summary.json").read_text())
    runs = {v["name"]: v for v in summary["variants"]}
    assert runs["pp4"]["bitwise_equal"] and runs["per-token/pp4"]["bitwise_equal"]
    assert all(v["nonfinite"] is None for v in summary["variants"])
    traces = {n: json.loads((tmp_path / "out/masks/runs" / n.replace("/", "_") / "trace.json").read_text())
              for n in ("pp2", "per-token/pp2")}
    losses = {n: [[(r["microbatch"], r["num_tokens"], r["lm"]["hex"]) for r in s["losses"]] for s in t["steps"]]
              for n, t in traces.items()}
    # the logged losses are per-microbatch means in both normalisations (step 0: the same weights) ...
    assert losses["pp2"][0] == losses["per-token/pp2"][0]
    # ... and the empty microbatch has no token and a loss of 0
    assert [(mb, n, h) for mb, n, h in losses["pp2"][1] if mb == 2] == [(2, 0, "0x00000000")]


@pytest.mark.arithmetic_free
@pytest.mark.parametrize("data,fragments", [
    ("{empty_microbatches: [[0, 4]]}", ["empty_microbatches [0, 4]", "0..3"]),
    ("{empty_microbatches: [[5, 0]]}", ["empty_microbatches [5, 0]", "steps 0..0"]),
    ("{empty_microbatches: [[0]]}", ["empty_microbatches", "[step, microbatch]"]),
    ("{pad_fraction: 1.5}", ["pad_fraction"]),
])
def test_bad_data_options_are_one_line(tmp_path, data, fragments):
    case = tmp_path / "c.yaml"
    case.write_text(CASE.replace("data: {empty_microbatches: [[1, 2]]}", f"data: {data}").replace("train_iters: 2",
                                                                                                 "train_iters: 1"))
    _check_usage_error(run_cli("verify", case, "--out", tmp_path / "out"), tmp_path / "out", *fragments)
