"""HTML assembly: ``index.html`` (the case) and ``<run_dir>/index.html`` (one run's detail page), rendered
from the jinja2 templates beside this module with autoescaping, so names and error text containing markup
are shown as text.  Both pages are self-contained: inline CSS and SVG, no JavaScript, no network."""
from __future__ import annotations

import functools
import json
import pathlib
import posixpath
from typing import Optional

import jinja2
from markupsafe import Markup

from harness.judging.results import CaseResult

from . import cards, sections
from .chart_evidence import family_tables
from .chart_loss import group_rows, loss_curves_svg, loss_groups
from .matrix import verdict_matrix
from .summary_json import json_safe
from .words import (
    OUTCOME_STYLE,
    agreement_splits,
    bug_words,
    bugs_elsewhere_lines,
    card_anchors,
    clean_text,
    clip_words,
    cross_bug_words,
    divergence_words,
    format_elapsed,
    is_relative_link,
    megatron_source_words,
    run_dir_of,
)

TEMPLATE_DIR = pathlib.Path(__file__).resolve().parent / "templates"
TEMPLATE_NAME = "report.html.j2"
RUN_TEMPLATE_NAME = "run.html.j2"
#: Matrix-cell symbol per outcome class (for the legend and the failing list).
SYMBOLS = {cls: sym for cls, sym, _ in OUTCOME_STYLE.values()}


@functools.lru_cache(maxsize=1)
def environment() -> jinja2.Environment:
    """The jinja2 environment of the report's templates (autoescape, strict undefined, the report's filters)."""
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATE_DIR)),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )
    env.filters["elapsed"] = format_elapsed
    env.filters["divergence"] = divergence_words
    env.filters["clean"] = clean_text
    env.filters["clip"] = clip_words
    env.filters["megatron_source"] = lambda src: megatron_source_words(src) if isinstance(src, dict) else ""
    env.filters["fmt_value"] = lambda x: (json.dumps(json_safe(x), sort_keys=True)
                                          if isinstance(x, (dict, list, tuple)) else clean_text(x))
    env.tests["relative_link"] = is_relative_link
    return env


def render_html(result: CaseResult, report_dir: Optional[pathlib.Path] = None) -> str:
    """The self-contained ``index.html`` page: in the header, when the runs split into bitwise-equal groups,
    which runs agree with which (and whether the baseline may be the odd one out); then the verdict matrix,
    the run list, loss curves (grouped where bitwise identical), lm-loss bits, grad norm & clipping, mismatch
    counts, one card per run, the environment.

    `report_dir`, when given, is the directory the page is written to: the runs' ``trace.json`` files there
    (under each ``run_dir``) give the parameter counts of the "Structural checks" blocks
    (`harness.report.cards.parameter_count`); without it the counts are left out.
    """
    anchors = card_anchors(result.variants)
    counts = {k: sum(v.verdict == k for v in result.variants) for k in ("pass", "fail", "error")}
    card_data = [cards.card(v, i, anchors, result, report_dir) for i, v in enumerate(result.variants)]
    groups = loss_groups(result)
    svg = loss_curves_svg(result, groups)
    mismatch = [{**d, "tables": family_tables(d["v"])} for d in card_data if d["heatmap"] is not None]
    golden = getattr(result, "golden", None)
    return environment().get_template(TEMPLATE_NAME).render(
        result=result,
        all_pass=result.all_pass,
        counts=counts,
        golden=golden if isinstance(golden, dict) and golden else None,
        agreement=_agreement(result, anchors),
        bugs=[(v.name, anchors[i], w) for i, v in enumerate(result.variants) for w in [bug_words(v, False)] if w]
        + [("other versions", None, w) for w in bugs_elsewhere_lines(result.variants)]
        + [("cross-implementation", "cross-implementation", w) for w in cross_bug_words(result.cross_implementation)],
        matrix=verdict_matrix(result, anchors),
        symbols=SYMBOLS,
        cards=card_data,
        loss_svg=Markup(svg) if svg else None,
        loss_groups=group_rows(groups, anchors),
        hex=sections.hex_table(result, anchors),
        grad_norm=sections.grad_norm_section(result, anchors),
        mismatch=mismatch,
        cross=sections.cross_section(result.cross_implementation),
        environment=sorted((result.environment or {}).items(), key=lambda kv: str(kv[0])),
    )


def _agreement(result: CaseResult, anchors: dict) -> list[dict]:
    """`agreement_splits` with each group's runs as (name, card anchor or None) for the header's links."""
    by_name = {v.name: anchors[i] for i, v in enumerate(result.variants)}
    return [{**c, "groups": [{**k, "members": [(n, by_name.get(n)) for n in k["runs"]]} for k in c["groups"]]}
            for c in agreement_splits(getattr(result, "agreement", None))]


def render_run_page(result: CaseResult, index: int, report_dir: Optional[pathlib.Path] = None) -> str:
    """The detail page of ``result.variants[index]``, written to ``<run_dir>/index.html``: first divergence,
    differences outside the signature, layout grid, schedule timeline (and its Chrome trace), the heatmap of
    differing parameters and the ULP evidence with histograms.  Links back to the report's card."""
    anchors = card_anchors(result.variants)
    v = result.variants[index]
    d = cards.card(v, index, anchors, result, report_dir, charts=True)
    run_dir = run_dir_of(v) or "."
    root = posixpath.relpath(".", run_dir) + "/"
    return environment().get_template(RUN_TEMPLATE_NAME).render(
        result=result, d=d, root="" if root == "./" else root, measured=d["measured"])


__all__ = ["render_html", "render_run_page", "environment"]
