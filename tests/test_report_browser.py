"""The report in a real browser (headless Chromium): the verdict matrix, the per-variant sections and the SVG
plots render, nothing is fetched from the network, no script error is logged, and markup in names is shown
escaped.  At 1400 x 900 px the whole verdict matrix of a dsv3-shaped report (32 runs) is on the first screen,
a failing cell is red and links to its card, and each run's Chrome trace loads as JSON with one event per
planned compute action.  Screenshots go to pytest's temporary directory (paths printed; run with ``-s``).
Chromium is Debian's `chromium`; the fixture installs it when missing (root + apt-get), otherwise the test is
skipped with the reason."""
import json
import os
import re
import shutil
import subprocess
import textwrap

import pytest
from conftest import run_cli
from report_cases import FAILING_RUN, make_dsv3_like

from harness.report import write_report
from harness.report.chrome_trace import MEASURED_PID

pytestmark = pytest.mark.slow
EVIL = "<img src=x onerror=alert(1)>"


@pytest.fixture(scope="module")
def chromium():
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None and os.geteuid() == 0 and shutil.which("apt-get"):
        subprocess.run(["apt-get", "install", "-y", "-q", "chromium"], capture_output=True, timeout=600)
        exe = shutil.which("chromium")
    if exe is None:
        pytest.skip("headless Chromium is not installed and cannot be installed here (needs root and apt-get)")
    return exe


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("browser")
    case = out / "browser.yaml"
    case.write_text(textwrap.dedent(f"""\
        name: browser
        model: {{num_layers: 4, moe_layer_freq: "[0]*1+[1]*3"}}
        training: {{train_iters: 2, seq_length: 16, num_microbatches: 4}}
        baseline: {{name: base, pipeline_model_parallel_layout: "Ett|ttmL", pipeline_model_parallel_size: 2}}
        variants:
          - {{name: "{EVIL}", pipeline_model_parallel_layout: "Et|tt|tm|L", pipeline_model_parallel_size: 4}}
          - {{name: p1, pipeline_model_parallel_layout: "Et*4mL", pipeline_model_parallel_size: 1, expect: may_diverge,
             first_divergence: {{kind: grad, name: embedding.word_embeddings.weight}}}}
        """))
    proc = run_cli("verify", case, "--out", out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out / "browser" / "index.html"


def _render(chromium, page, tmp_path):
    """(DOM, stderr, URLs fetched over the network other than Chromium's own service pings)."""
    netlog = tmp_path / f"{page.stem}-netlog.json"
    proc = subprocess.run(
        [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         f"--user-data-dir={tmp_path / 'profile'}", "--enable-logging=stderr", "--v=0",
         f"--log-net-log={netlog}", "--virtual-time-budget=3000", "--dump-dom", page.as_uri()],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    events = json.loads(netlog.read_text() or "{}").get("events", []) if netlog.exists() else []
    urls = {e.get("params", {}).get("url", "") for e in events}
    # Chromium's own service pings (clock sync, account checks) go to Google hosts whatever the page is;
    # anything else over the network would come from the page
    browser_own = ("google.com/", "googleapis.com/", "gstatic.com/", "gvt1.com/")
    fetched = [u for u in urls if u.startswith(("http:", "https:", "ws:", "wss:"))
               and not any(h in u.split("?")[0] for h in browser_own)]
    return proc.stdout, proc.stderr, fetched


def test_report_renders_offline_without_errors(chromium, report, tmp_path):
    dom, stderr, fetched = _render(chromium, report, tmp_path)
    # rendered content: verdict matrix, per-variant sections, the loss-curve SVG (timelines: on the run pages)
    assert 'id="matrix"' in dom and 'id="variants"' in dom and 'class="vmatrix"' in dom
    assert 'class="loss-svg"' in dom
    assert "p1" in dom and "pass" in dom
    # markup in a variant name is text, not an element
    assert "&lt;img src=x onerror=alert(1)&gt;" in dom
    assert "<img" not in dom
    # no script errors
    assert "Uncaught" not in stderr and "CONSOLE" not in stderr
    assert not fetched, fetched
    # each run's detail page: its timeline SVG, offline, no errors
    for page in sorted(report.parent.glob("runs/*/index.html")):
        dom, stderr, fetched = _render(chromium, page, tmp_path)
        assert 'class="timeline-svg"' in dom
        assert "<img" not in dom and "Uncaught" not in stderr and not fetched, fetched


def test_checks_catch_a_broken_page(chromium, report, tmp_path):
    """Controls: a page that fetches a stylesheet and throws a script error is caught by the same checks."""
    bad = tmp_path / "bad.html"
    bad.write_text(report.read_text().replace(
        "</head>", '<link rel="stylesheet" href="http://example.invalid/x.css">'
                   "<script>undefinedFunction()</script></head>"))
    _, stderr, fetched = _render(chromium, bad, tmp_path)
    assert any("example.invalid" in u for u in fetched)
    assert "Uncaught" in stderr


# ------------------------------------------------------------------ first screen, colours, links, trace

VIEWPORT = (1400, 900)
#: Measures the page once it has laid out; run only in a copy of the report (the report has no script).
PROBE = """<script>
window.addEventListener("load", () => {
  const box = e => { const r = e.getBoundingClientRect(); return [r.left, r.top, r.right, r.bottom]; };
  const matrix = document.querySelector("table.vmatrix");
  const fail = document.querySelector("a.vcell.unexpected");
  const href = fail ? fail.getAttribute("href") : "";
  const target = href ? document.getElementById(href.slice(1)) : null;
  const out = {viewport: [innerWidth, innerHeight], matrix: box(matrix),
               cells: document.querySelectorAll("table.vmatrix a.vcell").length,
               scroller: [matrix.parentElement.scrollWidth, matrix.parentElement.clientWidth],
               page_width: document.documentElement.scrollWidth,
               fail_run: fail ? fail.dataset.run : null, fail_bg: fail ? getComputedStyle(fail).backgroundColor : null,
               fail_title: fail ? fail.title : null, href: href, target: target ? target.className : null};
  if (target) { location.hash = href; out.target_top_after_click = target.getBoundingClientRect().top; }
  const pre = document.createElement("pre"); pre.id = "probe"; pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
});
</script>"""


def _chromium(chromium, tmp_path, *args):
    proc = subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                           "--disable-background-networking", "--disable-component-update", "--disable-sync",
                           "--hide-scrollbars", f"--user-data-dir={tmp_path / 'profile'}",
                           f"--window-size={VIEWPORT[0]},{VIEWPORT[1]}", "--virtual-time-budget=3000", *args],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def _probe(chromium, page, tmp_path) -> dict:
    probed = page.with_name("probe.html")       # beside the page: its relative links stay valid
    probed.write_text(page.read_text(encoding="utf-8").replace("</body>", PROBE + "</body>"), encoding="utf-8")
    dom = _chromium(chromium, tmp_path, "--dump-dom", probed.as_uri())
    probed.unlink()
    m = re.search(r'<pre id="probe">(.*?)</pre>', dom, re.S)
    assert m, dom[-2000:]
    return json.loads(m.group(1).replace("&quot;", '"').replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&"))


def _screenshot(chromium, page, tmp_path, name):
    shot = tmp_path / name
    _chromium(chromium, tmp_path, f"--screenshot={shot}", page.as_uri())
    assert shot.is_file() and shot.stat().st_size > 0
    print(f"\nscreenshot ({VIEWPORT[0]}x{VIEWPORT[1]}): {shot}")
    return shot


@pytest.fixture(scope="module")
def dsv3_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("dsv3")
    write_report(make_dsv3_like(), out)
    return out / "index.html"


def test_dsv3_matrix_on_the_first_screen_failing_cell_red_and_linked(chromium, dsv3_report, tmp_path):
    p = _probe(chromium, dsv3_report, tmp_path)
    width, height = p["viewport"]
    assert width == VIEWPORT[0], p         # --dump-dom's headless window keeps some height for itself
    left, top, right, bottom = p["matrix"]
    # the whole matrix inside the first screen, without scrolling either way
    assert 0 <= left and 0 <= top and right <= width and bottom <= min(height, VIEWPORT[1]), p
    assert p["scroller"][0] <= p["scroller"][1] and p["page_width"] <= width, p
    assert p["cells"] == 32
    # the failing run's cell is red and links to its card, which exists and is scrolled to
    assert p["fail_run"] == FAILING_RUN
    r, g, b = map(int, re.findall(r"\d+", p["fail_bg"])[:3])
    assert r > 180 and g < 80 and b < 80, p["fail_bg"]
    assert "first divergence: step 1 · grad" in p["fail_title"]
    assert p["href"] == "#card-ep2-pp2-1f1b-mtp-with-loss" and p["target"] == "variant fail"
    assert abs(p["target_top_after_click"]) < 2, p
    _screenshot(chromium, dsv3_report, tmp_path, "dsv3-1400x900.png")
    size = dsv3_report.stat().st_size
    print(f"dsv3-shaped index.html: {size} bytes")
    assert size < 2_000_000


def test_dsv3_detail_page_renders_offline(chromium, dsv3_report, tmp_path):
    page = dsv3_report.parent / "runs" / "pp16-vpp2-mtp-standalone" / "index.html"
    dom, stderr, fetched = _render(chromium, page, tmp_path)
    assert 'class="timeline-svg"' in dom and "schedule.trace.json" in dom
    assert "Uncaught" not in stderr and not fetched, fetched
    _screenshot(chromium, page, tmp_path, "dsv3-run-page-1400x900.png")


def _compute_actions(schedule: str) -> int:
    """Compute actions (F, B, merged F+B) of a manifest's serialised schedule; sends and receives not counted."""
    return sum(1 for line in schedule.splitlines() for tok in line.split(":", 1)[1].split()
               if not tok.startswith(("SEND", "RECV")))


def test_trace_files_load_as_json_with_one_event_per_planned_action(chromium, report, tmp_path):
    out = report.parent
    summary = json.loads((out / "summary.json").read_text())
    html = report.read_text(encoding="utf-8")
    assert summary["variants"]
    for v in summary["variants"]:
        rel = v["schedule_trace"]
        assert rel and f'href="{rel}"' in html           # the report links it
        trace = json.loads((out / rel).read_text())     # loads as JSON
        manifest = json.loads((out / rel).parent.joinpath("manifest.json").read_text())
        xs = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] < MEASURED_PID]   # planned
        assert len(xs) == _compute_actions(manifest["schedule"]) > 0
        assert {e["pid"] for e in xs} == set(range(v["pp"]))
        # the reference trainer on CPU also records each action's measured time: every step, every action
        measured = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] >= MEASURED_PID]
        steps = len(json.loads((out / rel).parent.joinpath("trace.json").read_text())["steps"])
        assert len(measured) == len(xs) * steps
    _screenshot(chromium, report, tmp_path, "browser-case-1400x900.png")


def test_a_real_report_matrix_on_the_first_screen(chromium, tmp_path):
    """The same checks on a report a real `bitparity verify` wrote (``make verify`` then
    ``BITPARITY_BROWSER_REPORT=reports/dsv3/index.html pytest tests/test_report_browser.py -s``)."""
    path = os.environ.get("BITPARITY_BROWSER_REPORT")
    if not path:
        pytest.skip("set BITPARITY_BROWSER_REPORT to a report's index.html to check it too")
    from pathlib import Path
    page = Path(path).resolve()
    p = _probe(chromium, page, tmp_path)
    left, top, right, bottom = p["matrix"]
    assert 0 <= left and 0 <= top and right <= p["viewport"][0] and bottom <= min(p["viewport"][1], VIEWPORT[1]), p
    assert p["scroller"][0] <= p["scroller"][1] and p["page_width"] <= VIEWPORT[0], p
    summary = json.loads(page.with_name("summary.json").read_text())
    assert p["cells"] == len(summary["variants"])
    if p["fail_run"] is not None:
        assert p["target"] and abs(p["target_top_after_click"]) < 2, p
    _screenshot(chromium, page, tmp_path, f"{summary['case']}-1400x900.png")
    print(f"{page}: {page.stat().st_size} bytes")
