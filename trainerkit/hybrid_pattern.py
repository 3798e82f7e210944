"""HybridModel's layer pattern as a bitparity layout: parse, validate, and map it onto the GPT layout grammar.

megatron-core's HybridModel (``megatron/core/models/hybrid/``, >= 0.17) takes its layers and their pipeline
placement from one string, ``hybrid_layer_pattern`` (``hybrid_layer_allocation.parse_hybrid_pattern`` /
``select_pipeline_segment``): one symbol per layer (``+`` MLA, ``-`` dense MLP, ``E`` MoE; also ``*`` attention,
``D`` DeepSeek sparse attention, ``M`` Mamba, ``G`` gated delta net), ``|`` between pipeline segments (flat
segment i runs on pp rank i % P, virtual stage i // P, as the GPT layout's stages), and ``/`` before each MTP
depth's own pattern (``"+-+E|+E+E/+E"``: eight decoder layers, four DeepSeek-V3 blocks, in two segments, then one
MTP depth).
HybridModel builds the MTP block on the last pipeline stage, with the loss.

One GPT block is two Hybrid layers: the DeepSeek-V3 block "MLA then dense MLP / MoE" is the pair ``+-`` / ``+E``.
bitparity builds that architecture, so a pattern here is a sequence of such pairs; `HybridPattern.layout` is the
GPT layout (`trainerkit.layout`) of the same placement, which the schedule, trace and localisation use, and GPT
layer i is Hybrid layers 2i (attention) and 2i + 1 (MLP / MoE) (`megatron_trainer.hybrid` maps the names).

Stdlib only, so a pattern can be checked without importing torch or megatron.
"""
from __future__ import annotations

from dataclasses import dataclass

from .layout import LayoutError

__all__ = ["HybridPatternError", "HybridPattern", "parse_hybrid_pattern", "MEGATRON_SYMBOLS", "BUILT"]

#: Every layer symbol megatron's ``hybrid_layer_allocation.Symbols`` knows, with what it builds.
MEGATRON_SYMBOLS = {"+": "MLA", "-": "dense MLP", "E": "MoE", "*": "attention", "D": "DeepSeek sparse attention",
                    "M": "Mamba", "G": "gated delta net"}
#: What bitparity's DeepSeek-V3 builds: the attention of a block, and its MLP (dense or MoE).
ATTENTION, MLPS = "+", ("-", "E")
BUILT = (ATTENTION,) + MLPS
_PIPE, _MTP = "|", "/"
_MAX_CHARS = 100_000        # as the GPT layout's symbol bound: a typo fails fast


class HybridPatternError(LayoutError):
    """An invalid pattern; one line "hybrid_layer_pattern '<text>': <problem>[ at position N]" (0-based index
    into the text)."""

    def __init__(self, layout: object, problem: str, position: int | None = None):
        super().__init__(layout, problem, position)
        self.args = (str(self).replace("layout ", "hybrid_layer_pattern ", 1),)

    def __str__(self):
        return self.args[0]


@dataclass(frozen=True)
class HybridPattern:
    """A parsed pattern: `segments` (the main pattern split at ``|``, flat order), `mtp` (one depth's pattern,
    or None) and `mtp_depths` (how many ``/`` parts), as megatron's ``ParsedHybridPattern``."""

    text: str
    segments: tuple[str, ...]
    mtp: str | None
    mtp_depths: int

    @property
    def num_layers(self) -> int:
        """Hybrid layers of the main pattern (megatron's ``num_layers`` for a HybridModel): twice GPT's."""
        return sum(map(len, self.segments))

    @property
    def moe_layers(self) -> list[int]:
        """Per GPT layer (pair): 1 where its MLP is MoE (``E``), as `ModelConfig.moe_layers`."""
        flat = "".join(self.segments)
        return [int(flat[i + 1] == "E") for i in range(0, len(flat), 2)]

    @property
    def layout(self) -> str:
        """The GPT layout of the same placement: per segment one ``t`` per pair, ``E`` first, the MTP depths
        (``m``) and ``L`` on the last segment (HybridModel builds MTP with the loss)."""
        stages = ["t" * (len(s) // 2) for s in self.segments]
        stages[0] = "E" + stages[0]
        stages[-1] += "m" * self.mtp_depths + "L"
        return "|".join(stages)

    def pretty(self) -> str:
        """The pairs of each segment with their GPT layer ids ('t0=+- t1=+E'), one line per flat segment."""
        lines, layer = [], 0
        for i, seg in enumerate(self.segments):
            pairs = []
            for j in range(0, len(seg), 2):
                pairs.append(f"t{layer}={seg[j:j + 2]}")
                layer += 1
            if i == len(self.segments) - 1 and self.mtp_depths:
                pairs += [f"m{k}={self.mtp}" for k in range(self.mtp_depths)]
            lines.append(f"segment {i}: {' '.join(pairs) or '-'}")
        return "\n".join(lines)


def parse_hybrid_pattern(text: str) -> HybridPattern:
    """Parse `text` as megatron's ``parse_hybrid_pattern`` does, with bitparity's architecture rules.

    Megatron's rules: only its symbols, ``|`` in the main pattern only, every MTP depth's pattern identical, no
    ``*`` attention beside MLA.  bitparity's: only ``+ - E``; the main pattern is DeepSeek-V3 blocks, pairs
    ``+`` then ``-`` or ``E``, never split by ``|`` (GPT layer i is one pair; a pipeline boundary between a
    block's attention and its MLP has no GPT layout); the MTP pattern is one such pair.

    Raises:
        HybridPatternError: the first broken rule, with the character position where there is one.
    """
    if not isinstance(text, str):
        raise HybridPatternError(text, f"must be a string, got {type(text).__name__}")
    if len(text) > _MAX_CHARS:
        raise HybridPatternError(text, f"longer than {_MAX_CHARS} characters")
    if not text:
        raise HybridPatternError(text, "is empty")
    for pos, c in enumerate(text):
        if c in BUILT or c in (_PIPE, _MTP):
            continue
        if c in MEGATRON_SYMBOLS:
            raise HybridPatternError(text, f"{c!r} ({MEGATRON_SYMBOLS[c]}) is megatron's, but bitparity builds "
                                     "DeepSeek-V3's blocks: '+' (MLA) then '-' (dense MLP) or 'E' (MoE)", pos)
        shown = "whitespace" if c.isspace() else f"unknown symbol {c!r}"
        raise HybridPatternError(text, f"{shown} (expected one of + - E | /)", pos)
    main, *mtp_parts = text.split(_MTP)
    start = len(main) + 1
    for k, part in enumerate(mtp_parts):
        if not part:
            raise HybridPatternError(text, f"MTP depth {k + 1} is empty ('/' with no layers after it)", start - 1)
        if _PIPE in part:
            raise HybridPatternError(text, f"'|' in MTP depth {k + 1}'s pattern (pipeline boundaries belong to the "
                                     "main pattern; megatron builds MTP on the last stage)", start + part.index(_PIPE))
        if part != mtp_parts[0]:
            raise HybridPatternError(text, f"MTP depth {k + 1}'s pattern {part!r} differs from depth 1's "
                                     f"{mtp_parts[0]!r} (megatron repeats one pattern per depth)", start)
        if len(part) != 2 or part[0] != ATTENTION or part[1] not in MLPS:
            raise HybridPatternError(text, f"MTP pattern {part!r} is not one DeepSeek-V3 block ('+-' or '+E')",
                                     start)
        start += len(part) + 1
    if not main.replace(_PIPE, ""):
        raise HybridPatternError(text, "has no decoder layer")
    _check_pairs(text, main)
    return HybridPattern(text, tuple(main.split(_PIPE)), mtp_parts[0] if mtp_parts else None, len(mtp_parts))


def _check_pairs(text: str, main: str) -> None:
    """Every decoder layer pair is '+' then '-' / 'E', with no '|' between them."""
    layer = 0
    for pos, c in enumerate(main):
        if c == _PIPE:
            if layer % 2:
                raise HybridPatternError(text, f"pipeline boundary splits block {layer // 2} (its MLA before the "
                                         "'|', its MLP after): a GPT layer is one '+-' / '+E' pair", pos)
            continue
        want_attention = layer % 2 == 0
        if want_attention and c != ATTENTION:
            raise HybridPatternError(text, f"layer {layer} is {c!r} where block {layer // 2} starts: each block is "
                                     "'+' (MLA) then '-' or 'E'", pos)
        if not want_attention and c not in MLPS:
            raise HybridPatternError(text, f"layer {layer} is {c!r} where block {layer // 2}'s MLP belongs "
                                     "('-' dense or 'E' MoE)", pos)
        layer += 1
    if layer % 2:
        raise HybridPatternError(text, f"block {layer // 2} has its MLA but no MLP ('-' or 'E') after it",
                                 len(main))


def pipeline_layout(pattern: HybridPattern, pipeline_model_parallel_size: int, num_layers: int,
                    mtp_num_layers: int):
    """The validated `trainerkit.layout.PipelineLayout` of `pattern`'s placement (segments over P ranks, V =
    segments / P as Megatron-LM's ``arguments.py`` derives it).

    Raises:
        HybridPatternError: the placement breaks a layout rule (named with the pattern, and the GPT layout)."""
    from .layout import PipelineLayout

    P, n = pipeline_model_parallel_size, len(pattern.segments)
    if isinstance(P, int) and P >= 1 and n % P:
        raise HybridPatternError(pattern.text, f"{n} segment{'s' if n > 1 else ''} ('|'-separated) do not divide over "
                                 f"pipeline_model_parallel_size={P}: flat segment i runs on pp rank i % P, so give "
                                 "a multiple of P")
    try:
        return PipelineLayout.from_string(pattern.layout, pipeline_model_parallel_size, num_layers, mtp_num_layers)
    except LayoutError as e:
        shown = pattern.layout if len(pattern.layout) <= 60 else pattern.layout[:50] + "..."
        raise HybridPatternError(pattern.text, f"{e.problem} (as the GPT layout {shown!r})") from None


def check_against_model(pattern: HybridPattern, moe_layers: list[int], mtp_num_layers: int) -> str | None:
    """Why `pattern` is not the model's architecture, in one line (None when it is): its MoE blocks must be
    `moe_layers` (`ModelConfig.moe_layers`), its MTP depths `mtp_num_layers`, and the MTP block's MLP the last
    decoder block's (GPT's MTP layer has the last decoder layer's spec: ``get_gpt_mtp_block_spec``)."""
    mine = pattern.moe_layers
    if len(mine) != len(moe_layers):
        return f"has {len(mine)} blocks ('+-' / '+E' pairs) but model.num_layers is {len(moe_layers)}"
    bad = next((i for i, (a, b) in enumerate(zip(mine, moe_layers)) if a != b), None)
    if bad is not None:
        return (f"block {bad} is {'MoE' if mine[bad] else 'dense'} ('{'+E' if mine[bad] else '+-'}') but "
                f"model.moe_layer_freq makes layer {bad} {'MoE' if moe_layers[bad] else 'dense'}")
    if pattern.mtp_depths != mtp_num_layers:
        return f"has {pattern.mtp_depths} MTP depth(s) ('/' parts) but model.mtp_num_layers is {mtp_num_layers}"
    if pattern.mtp is not None and pattern.mtp[1] != ("E" if moe_layers[-1] else "-"):
        return (f"MTP block {pattern.mtp!r} differs from the last decoder block's MLP "
                f"('{'+E' if moe_layers[-1] else '+-'}'): GPTModel's MTP layer has the last decoder layer's spec")
    return None
