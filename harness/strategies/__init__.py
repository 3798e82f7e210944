"""Hypothesis strategies for Megatron pipeline layouts (``pipeline_model_parallel_layout`` strings).

Public API for property tests of anything that consumes a layout: the parser and validator in
`trainerkit.layout`, schedules, the reference trainer, your own tooling. Layout semantics are Megatron-LM's
``PipelineParallelLayerLayout`` (see /work/shared/megatron-semantics.md, section 1): stages are joined by ``|``,
``E`` embedding, ``t`` decoder layer, ``m`` MTP layer, ``L`` loss; flat stage ``i`` runs on pp rank ``i % P``,
virtual stage ``i // P``.

Strategies (all shrink toward few stages, small P, V = 1, layers packed into few stages, MTP co-located with the
loss and the plain ``|``-joined spelling):

* `stage_grids` -> ``(grid, pp, vpp)``: a valid layout as a tuple of flat stages (tuples of symbols).
* `spellings` -> strings that parse to exactly a given grid (plain, ``t*3``, ``(tt|)*29``, nested groups, commas).
* `layouts` -> ``(text, pp)``: `stage_grids` + `spellings`; V is implied by the number of stages.
* `invalid_layouts` -> ``(text, pp, rule)``: a layout breaking exactly one named rule (see `INVALID_RULES`).
* `layout_text` -> arbitrary text over the layout alphabet plus noise, for fuzzing parsers.

Every valid layout also satisfies `trainerkit.schedule.check_sizes` for the size pair: P = 1 implies V = 1
(interleaving additionally needs ``num_microbatches % P == 0``, which is the caller's choice of M).

Example::

    from hypothesis import given
    from harness.strategies import layouts, stage_grids, spellings
    from trainerkit.layout import PipelineLayout

    @given(layouts(num_layers=8, mtp_num_layers=1, mtp_placement="standalone"))
    def test_standalone_mtp_is_not_on_the_loss_rank(case):
        text, pp = case
        lay = PipelineLayout.from_string(text, pp, 8, 1)
        assert lay.mtp_standalone and lay.rank_of(lay.mtp_stage)[0] not in (0, pp - 1)

    @given(stage_grids(4, 0, pp=2, vpp=2, allow_empty_stages=False).flatmap(
        lambda g: spellings(g[0], megatron_compatible=True)))
    def test_megatron_style_spellings(text):
        ...

Sizes: ``pp``/``vpp`` accept an int (fixed), None (drawn: P in 1..8, V in 1..4, P = 1 forces V = 1) or a
strategy of ints (drawn, combinations that cannot hold a valid layout are rejected). Impossible fixed requests
(e.g. ``mtp_placement="standalone"`` with ``pp=2``, which needs P >= 3) raise hypothesis' ``InvalidArgument``.
"""
from .grids import MTP_PLACEMENTS, Grid, plain, stage_grids
from .invalid import INVALID_RULES, invalid_layouts, layout_text
from .spellings import layouts, spellings

__all__ = ["INVALID_RULES", "MTP_PLACEMENTS", "Grid", "stage_grids", "spellings", "layouts", "invalid_layouts",
           "layout_text", "plain"]
