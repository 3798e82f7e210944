"""Render a :class:`harness.judging.results.CaseResult` as a report directory (`write_report`).

One module per output, the jinja2 templates beside them:

* `summary_json` -- ``summary.json``, the machine-readable verdicts (schema in `summary_dict`);
* `junit`        -- ``junit.xml``, one ``<testcase>`` per variant, for CI test-report widgets;
* `markdown`     -- ``summary.md``, a short verdict table for a CI job page;
* `html`         -- ``index.html`` (verdict matrix first, `matrix`; run cards, `cards`; case-wide sections,
                    `sections`) and each run's detail page ``<run_dir>/index.html``;
* `chart_loss`, `chart_timeline`, `chart_evidence` -- the charts, all hand-written SVG (`svg`);
* `chrome_trace` -- ``<run_dir>/schedule.trace.json``, the schedule as a Chrome trace for Perfetto;
* `writer`       -- writes it all atomically; `words` -- wording shared by every output.
"""
from __future__ import annotations

from .cards import parameter_count, read_run_trace
from .chart_evidence import (
                             HEATMAP_HIGH,
                             HEATMAP_LOW,
                             HEATMAP_MAX_WIDTH,
                             HEATMAP_ZERO,
                             ULP_BUCKETS,
                             family_heatmap_svg,
                             ulp_bound_words,
                             ulp_bucket_label,
                             ulp_histogram_svg,
)
from .chart_loss import loss_curves_svg, loss_groups
from .chart_timeline import (
                             TIMELINE_BACKWARD,
                             TIMELINE_FORWARD,
                             TIMELINE_IDLE,
                             TIMELINE_MAX_WIDTH,
                             TIMELINE_MERGED,
                             TIMELINE_OTHER,
                             timeline_svg,
)
from .chrome_trace import chrome_trace
from .html import render_html, render_run_page
from .junit import junit_xml
from .markdown import cross_implementation_markdown, markdown_summary, md_cell
from .matrix import verdict_matrix
from .summary_json import summary_dict
from .words import (
                             clip_words,
                             clipping_on,
                             divergence_words,
                             format_elapsed,
                             format_fraction,
                             inventory_lines,
                             reference_of,
                             replica_words,
                             replicas_broken,
                             run_to_run_words,
)
from .writer import REPORT_FILES, write_report

#: Older name of `md_cell` (tests and callers of the single-module report used it).
_md_cell = md_cell

__all__ = [
    # the report directory and its files
    "write_report", "REPORT_FILES", "summary_dict", "junit_xml", "markdown_summary", "md_cell",
    "cross_implementation_markdown", "render_html", "render_run_page", "chrome_trace", "verdict_matrix",
    # charts
    "loss_curves_svg", "loss_groups", "timeline_svg", "ulp_histogram_svg", "family_heatmap_svg",
    "TIMELINE_FORWARD", "TIMELINE_BACKWARD", "TIMELINE_OTHER", "TIMELINE_MERGED", "TIMELINE_IDLE",
    "TIMELINE_MAX_WIDTH", "ULP_BUCKETS", "HEATMAP_ZERO", "HEATMAP_LOW", "HEATMAP_HIGH", "HEATMAP_MAX_WIDTH",
    "ulp_bound_words", "ulp_bucket_label",
    # wording and run data shared with other tools
    "divergence_words", "format_elapsed", "format_fraction", "clip_words", "clipping_on", "reference_of",
    "inventory_lines", "replica_words", "replicas_broken", "run_to_run_words", "parameter_count", "read_run_trace",
]
