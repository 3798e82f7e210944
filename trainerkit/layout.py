"""Pipeline-parallel layer layout: parse, validate and query Megatron-style layout strings.

Mirrors `megatron/core/transformer/pipeline_parallel_layer_layout.py` (`PipelineParallelLayerLayout`) in behaviour,
with a real parser instead of Megatron's regex expansion (see /work/shared/megatron-semantics.md, section 1).
Stdlib only, so a layout can be checked without importing torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import NoReturn

__all__ = ["LayoutError", "SYMBOLS", "parse_layout", "PipelineLayout"]

SYMBOLS = {"E": "embedding", "t": "decoder", "m": "mtp", "L": "loss"}
_NAMES = {name: sym for sym, name in SYMBOLS.items()}
# A typo like 't*1000000000' must fail fast instead of exhausting memory; nesting is capped so a hostile
# string gets a LayoutError rather than a RecursionError.  The stage bound is the largest legal P x V
# (pipeline_model_parallel_size <= 1024 ranks x 64 virtual stages); the symbol bound leaves room for that many
# '|' plus layers.  Every query below is linear in the layout's size, so anything inside the bounds is fast.
_MAX_STAGES = 65_536
_MAX_SYMBOLS = 100_000
_MAX_DEPTH = 64
_MAX_LISTED = 4         # stage indices quoted in one error message (the line stays short)


class LayoutError(ValueError):
    """An invalid layout (syntax, or a rule of Megatron's `PipelineParallelLayerLayout.validate_layer_layout`).

    `position` is the 0-based character index in the original string for syntax errors, else None.
    `str(err)` is one line: "layout '<text>': <problem>[ at position N]".
    """

    def __init__(self, layout: object, problem: str, position: int | None = None):
        self.layout, self.problem, self.position = layout, problem, position
        where = f" at position {position}" if position is not None else ""
        # list input is shown by repr; validated layouts always carry a string.  A huge layout is cut so the
        # message stays one readable line (the position still points into the full text).
        shown = repr(layout)
        if len(shown) > 120:
            shown = f"{shown[:100]}... ({len(layout)} characters)"
        super().__init__(f"layout {shown}: {problem}{where}".replace("\n", " "))

    def __reduce__(self):  # the default pickling would call __init__(message) and fail in multiprocessing
        return type(self), (self.layout, self.problem, self.position)


class _Parser:
    """Recursive descent over: seq := item*, item := atom ('*' INT)?, atom := E|t|m|L|'|'|'(' seq ')'."""

    def __init__(self, text: str):
        self.text, self.pos = text, 0

    def fail(self, problem: str, position: int) -> LayoutError:
        return LayoutError(self.text, problem, position)

    def peek(self) -> str:
        return self.text[self.pos:self.pos + 1]

    def seq(self, depth: int) -> list[str]:
        out: list[str] = []
        while True:
            while self.peek() == ",":  # cosmetic separator, only between items
                self.pos += 1
            c = self.peek()
            if c == "" or c == ")":
                return out
            out += self.item(depth)
            if len(out) > _MAX_SYMBOLS:
                raise self.fail(f"layout expands to more than {_MAX_SYMBOLS} symbols", self.pos)

    def item(self, depth: int) -> list[str]:
        start, c = self.pos, self.peek()
        if c in SYMBOLS or c == "|":
            self.pos += 1
            body = [c]
        elif c == "(":
            if depth >= _MAX_DEPTH:
                raise self.fail(f"parentheses nested deeper than {_MAX_DEPTH}", start)
            self.pos += 1
            body = self.seq(depth + 1)
            if self.peek() != ")":
                raise self.fail("unclosed '('", start)
            if not body:
                raise self.fail("empty group '()'", start)
            self.pos += 1
        elif c == "*":
            raise self.fail("'*' must directly follow a symbol or ')'", start)
        elif c.isdigit():   # any Unicode digit here is a stray count
            raise self.fail(f"unexpected digit {c!r} (a count must directly follow '*'; commas cannot split it)", start)
        elif c.isspace():
            raise self.fail("whitespace is not allowed", start)
        else:
            raise self.fail(f"unknown character {c!r} (expected one of E t m L | ( ) * ,)", start)
        if self.peek() != "*":
            return body
        star = self.pos
        self.pos = digits_at = star + 1
        while self.peek() in "0123456789" and self.peek():     # ASCII digits only (int() rejects '²')
            self.pos += 1
        if self.pos == digits_at:
            raise self.fail("expected a repeat count after '*'", star)
        if self.pos - digits_at > len(str(_MAX_SYMBOLS)):           # also keeps int() off huge strings
            raise self.fail(f"layout expands to more than {_MAX_SYMBOLS} symbols", star)
        count = int(self.text[digits_at:self.pos])
        if count < 1:  # Megatron silently deletes the item; we refuse
            raise self.fail("repeat count must be >= 1", digits_at)
        if len(body) * count > _MAX_SYMBOLS:
            raise self.fail(f"layout expands to more than {_MAX_SYMBOLS} symbols", star)
        if self.peek() == "*":
            raise self.fail("chained repeat counts are not allowed", self.pos)
        return body * count


def _from_list(layout: object) -> list[list[str]]:
    if not isinstance(layout, (list, tuple)) or not all(isinstance(s, (list, tuple)) for s in layout):
        raise TypeError(f"layout must be a string or a list of lists, got {type(layout).__name__}")
    if len(layout) > _MAX_STAGES or sum(map(len, layout)) > _MAX_SYMBOLS:
        raise LayoutError(f"<list of {len(layout)} stages>", f"layout has more than {_MAX_STAGES} stages or "
                          f"{_MAX_SYMBOLS} layers")
    stages = []
    for i, stage in enumerate(layout):
        syms = []
        for entry in stage:
            name = getattr(entry, "name", entry)  # accepts Megatron's LayerType enum members too
            sym = None
            if isinstance(name, str):
                sym = name if name in SYMBOLS else _NAMES.get(name.strip().lower())
            if sym is None:
                raise LayoutError(layout, f"stage {i}: unknown layer type {entry!r}")
            syms.append(sym)
        stages.append(syms)
    return stages


def parse_layout(text: str | list) -> list[list[str]]:
    """Parse a layout into the flat list of stages (global order), each a list of symbols 'E', 't', 'm', 'L'.

    Mirrors `PipelineParallelLayerLayout.parse_str_to_list` (pipeline_parallel_layer_layout.py) but with a
    recursive-descent parser, so nesting such as '((t|)*2t|)*2' works and '()', '*0', a missing count, chained
    '*2*3', whitespace, unknown characters and unbalanced parentheses raise LayoutError with the position.
    Commas are separators between items; a comma inside a count or before '*' is an error. As in Megatron a
    '|' may be repeated ('t|*3' == 't|||') and empty stages are allowed.
    A list of lists is also accepted, with entries 'embedding'/'decoder'/'mtp'/'loss' (case-insensitive,
    stripped), the symbols themselves, or enum members with those names.

    Raises:
        LayoutError: malformed text, or more than 100000 symbols / 65536 stages once expanded.
    """
    if not isinstance(text, str):
        return _from_list(text)
    parser = _Parser(text)
    symbols = parser.seq(0)
    if parser.pos < len(text):  # seq only stops early on an unmatched ')'
        raise parser.fail("unmatched ')'", parser.pos)
    if symbols.count("|") >= _MAX_STAGES:
        raise LayoutError(text, f"layout has more than {_MAX_STAGES} stages")
    return [list(stage) for stage in "".join(symbols).split("|")]


@dataclass(frozen=True)
class PipelineLayout:
    """A validated layout with Megatron's stage -> (pp_rank, vpp_rank) mapping and layer offsets.

    Mirrors `PipelineParallelLayerLayout` (`__init__`, `validate_layer_layout`, `get_layer_offset`,
    `get_layer_id_list`, `pretty_repr`). Construction validates, so every instance is a legal layout.
    """

    text: str
    stages: tuple[tuple[str, ...], ...]
    pipeline_model_parallel_size: int
    virtual_pipeline_model_parallel_size: int
    num_layers: int
    mtp_num_layers: int
    # True: only the rules megatron itself enforces.  bitparity also refuses MTP on pp rank 0 (P > 1), a layout
    # megatron accepts and trains wrong (its validator checks only rank 0's non-last chunks; the embedding group
    # is then one rank and the MTP stage's embedding replica is never summed): a case that states that bug runs it.
    megatron_rules_only: bool = False

    @classmethod
    def from_string(cls, text: str | list, pipeline_model_parallel_size: int, num_layers: int,
                    mtp_num_layers: int = 0, megatron_rules_only: bool = False) -> "PipelineLayout":
        """Parse + validate (Megatron's `PipelineParallelLayerLayout.from_str` + `validate_layer_layout`).

        List input is accepted like Megatron's; `text` then holds its canonical string. Raises LayoutError
        naming the broken rule and where (flat stage index, pp/vpp rank).  `megatron_rules_only`: see the field.
        """
        stages = tuple(tuple(s) for s in parse_layout(text))
        shown = text if isinstance(text, str) else "|".join("".join(s) for s in stages)
        P = pipeline_model_parallel_size
        V = len(stages) // P if isinstance(P, int) and P >= 1 else 0
        return cls(shown, stages, P, V, num_layers, mtp_num_layers, megatron_rules_only)

    def __post_init__(self):
        P, V, n = self.pipeline_model_parallel_size, self.virtual_pipeline_model_parallel_size, len(self.stages)
        fail = self._fail
        for name in ("pipeline_model_parallel_size", "num_layers", "mtp_num_layers"):
            value, low = getattr(self, name), 0 if name == "mtp_num_layers" else 1
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                fail(f"{name} must be an integer >= {low}, got {value!r}")
        if n % P:
            fail(f"{n} stages are not divisible by pipeline_model_parallel_size={P}")
        if V != n // P:
            fail(f"virtual_pipeline_model_parallel_size must be {n // P}, got {V}")
        where = {s: [i for i, st in enumerate(self.stages) if s in st] for s in SYMBOLS}
        flat = [s for st in self.stages for s in st]
        for sym, name, pos in (("E", "first", 0), ("L", "last", -1)):
            if flat.count(sym) != 1:
                fail(f"expected exactly one '{sym}' ({SYMBOLS[sym]}), found {flat.count(sym)}"
                     + (f" in stages {self._at(*where[sym])}" if where[sym] else ""))
            if flat[pos] != sym:
                fail(f"'{sym}' must be the {name} layer in flattened order, found in stage {self._at(where[sym][0])}")
        if flat.count("t") != self.num_layers:
            fail(f"has {flat.count('t')} decoder layers 't' but num_layers={self.num_layers}")
        if flat.count("m") != self.mtp_num_layers:
            fail(f"has {flat.count('m')} MTP layers 'm' but mtp_num_layers={self.mtp_num_layers}")
        if "m" in flat and "t" in flat[flat.index("m"):]:
            fail(f"decoder layer 't' in stage {self._at(where['t'][-1])} comes after the first MTP layer "
                 f"in stage {self._at(where['m'][0])}; decoder layers must precede MTP layers")
        if len(where["m"]) > 1:
            fail(f"MTP layers must all be in one stage, found in stages {self._at(*where['m'])}")
        if where["m"]:
            (m,) = where["m"]
            pp, vpp = self.rank_of(m)
            if vpp != V - 1:
                fail(f"MTP stage {self._at(m)} must be the last virtual stage of its pp rank (vpp{V - 1})")
            # Megatron only checks rank 0's non-last chunks; with P == 1 rank 0 is also the last rank, so it is allowed.
            if pp == 0 and P > 1 and not self.megatron_rules_only:
                fail(f"MTP stage {self._at(m)} must not be on pp rank 0 (megatron accepts it, then never sums that "
                     "stage's embedding replica; a variant with layout_rules: megatron runs it to show that)")
        # Megatron checks E/L in flattened order only, but builds the embedding on the first stage and the loss
        # on the last whatever the string says (pre_process / post_process follow the stage position): empty
        # stages before E or after L would put them elsewhere, and every rank would fail.
        first, last = where["E"][0], where["L"][0]
        if first:
            fail(f"{self._stages(range(first))} (before 'E') {'is' if first == 1 else 'are'} empty: Megatron "
                 "embeds on the first stage; start the layout with E")
        if last != n - 1:
            fail(f"{self._stages(range(last + 1, n))} (after 'L') {'is' if n - 1 - last == 1 else 'are'} "
                 "empty: Megatron computes the loss on the last stage; end the layout with L")

    def _fail(self, problem: str) -> NoReturn:
        raise LayoutError(self.text, problem)

    def _at(self, *flats: int) -> str:
        """'i (ppP/vppV), ...' for at most _MAX_LISTED stages (a count for the rest: one short line)."""
        P = self.pipeline_model_parallel_size
        shown = ", ".join(f"{i} (pp{i % P}/vpp{i // P})" for i in flats[:_MAX_LISTED])
        return shown + (f" and {len(flats) - _MAX_LISTED} more" if len(flats) > _MAX_LISTED else "")

    def _stages(self, flats) -> str:
        flats = tuple(flats)
        return f"stage{'s' if len(flats) > 1 else ''} {self._at(*flats)}"

    def rank_of(self, flat: int) -> tuple[int, int]:
        """(pp_rank, vpp_rank) of flat stage `flat`: (flat % P, flat // P), as in Megatron's `layout[pp][vpp]`."""
        if not 0 <= flat < len(self.stages):
            raise IndexError(f"flat stage {flat} out of range [0, {len(self.stages)})")
        return flat % self.pipeline_model_parallel_size, flat // self.pipeline_model_parallel_size

    def flat_index(self, pp_rank: int, vpp_rank: int) -> int:
        """Flat stage index of (pp_rank, vpp_rank): vpp_rank * P + pp_rank."""
        P, V = self.pipeline_model_parallel_size, self.virtual_pipeline_model_parallel_size
        if not (0 <= pp_rank < P and 0 <= vpp_rank < V):
            raise IndexError(f"(pp{pp_rank}, vpp{vpp_rank}) out of range for P={P}, V={V}")
        return vpp_rank * P + pp_rank

    def stages_of_rank(self, pp_rank: int) -> list[int]:
        """Flat indices of the model chunks of `pp_rank`, in vpp order."""
        return [self.flat_index(pp_rank, v) for v in range(self.virtual_pipeline_model_parallel_size)]

    @cached_property
    def _offsets(self) -> dict[str, list[int]]:
        """Per symbol, the count in all stages before each stage (Megatron's get_layer_offset), computed once:
        summing the prefix per query made `pretty()` quadratic in the number of stages."""
        out = {}
        for sym in ("t", "m"):
            acc, offs = 0, []
            for st in self.stages:
                offs.append(acc)
                acc += st.count(sym)
            out[sym] = offs
        return out

    def _ids(self, flat: int, sym: str) -> list[int]:
        self.rank_of(flat)  # range check
        offset = self._offsets[sym][flat]
        return list(range(offset, offset + self.stages[flat].count(sym)))

    def decoder_layer_ids(self, flat: int) -> list[int]:
        """0-based global decoder layer ids built by flat stage `flat` (`get_layer_id_list(LayerType.decoder)`)."""
        return self._ids(flat, "t")

    def mtp_layer_ids(self, flat: int) -> list[int]:
        """0-based MTP depth indices (k-1) built by flat stage `flat`: [] or [0..D-1] (`get_mtp_layer_offset`)."""
        return self._ids(flat, "m")

    def _stage_with(self, sym: str) -> int | None:
        return next((i for i, st in enumerate(self.stages) if sym in st), None)

    num_stages = property(lambda self: len(self.stages), doc="Number of flat stages, P * V.")
    embedding_stage = property(lambda self: self._stage_with("E"), doc="Flat index of the stage holding 'E'.")
    loss_stage = property(lambda self: self._stage_with("L"), doc="Flat index of the stage holding 'L'.")
    mtp_stage = property(lambda self: self._stage_with("m"), doc="Flat index of the stage with all 'm', or None.")

    @property
    def last_decoder_stage(self) -> int:
        """Flat index holding decoder layer num_layers-1; with MTP the final norm lives there
        (`TransformerBlock.has_final_layernorm_in_this_stage`)."""
        return max(i for i, st in enumerate(self.stages) if "t" in st)

    @property
    def mtp_standalone(self) -> bool:
        """True iff the MTP stage is not on pp rank P-1, i.e. not co-located with the loss stage
        (the return value of Megatron's `validate_layer_layout`, stored as `config.mtp_standalone`)."""
        m = self.mtp_stage
        return m is not None and self.rank_of(m)[0] != self.pipeline_model_parallel_size - 1

    def _cell(self, flat: int) -> str:
        ids = {"t": iter(self.decoder_layer_ids(flat)), "m": iter(self.mtp_layer_ids(flat))}
        return " ".join(s + str(next(ids[s])) if s in ids else s for s in self.stages[flat]) or "-"

    def pretty(self) -> str:
        """A pp-rank x virtual-stage grid like Megatron's `pretty_repr`, each cell listing its layers with global
        ids ('E t0 t1 t2', 'm0', 'L', '-' when empty), under a header with P, V, stage count and MTP placement."""
        P, V = self.pipeline_model_parallel_size, self.virtual_pipeline_model_parallel_size
        m = self.mtp_stage
        mtp = "none" if m is None else f"{'standalone' if self.mtp_standalone else 'co-located'} at stage {self._at(m)}"
        rows = [[f"pp{p}"] + [self._cell(self.flat_index(p, v)) for v in range(V)] for p in range(P)]
        rows.insert(0, [""] + [f"vpp{v}" for v in range(V)])
        widths = [max(len(r[c]) for r in rows) for c in range(V + 1)]
        lines = [" | ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
        return "\n".join([f"PipelineLayout P={P} V={V} stages={self.num_stages} mtp={mtp}"] + lines)

    def canonical(self) -> str:
        """The stages joined by '|' without repeats, e.g. 'Ettt|tt|m|L'; parse_layout(canonical()) == stages."""
        return "|".join("".join(st) for st in self.stages)
