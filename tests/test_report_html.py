"""`pdlab report RUN --html OUT`: one self-contained file (no reference outside it) that carries the tables, the
verdict, the PARTIAL and BOX banners, every plot, the environment, the warnings and the recipe; opened in a
real headless browser (Chromium, where installed), which must decode every embedded plot."""

import os
import re
import shutil
import subprocess

import pytest

from pdlab.commands.report import main
from report_runs import DISAGG, UNIFIED, make, variant

CHROMIUM = next((shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None)
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--no-first-run",
         "--disable-component-update", "--disable-sync")
REASON = "worker decode0 died (SIGKILL)"


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    pytest.importorskip("matplotlib")
    d = tmp_path_factory.mktemp("report")
    run = make(d / "r", {"unified": variant(UNIFIED, {"itl": 3}), "disagg": variant(DISAGG, {"ttft": 1})},
               partial=REASON, alone={"ttft_ms": 900.0, "itl_ms": 2.0, "requests": 3, "devices": "cpu:0"},
               expect={"alone_ttft_ms": 190})
    out = str(d / "report.html")
    assert main([run], out) == 3  # written, and partial says so
    with open(out) as f:
        return out, f.read()


def test_the_report_is_one_self_contained_file(report):
    _, text = report
    assert not re.search(r"""(src|href)=["'](?!data:)""", text)  # nothing fetched from anywhere
    assert not re.search(r"https?://", text)
    imgs = re.findall(r'<img alt="([^"]+)" src="data:image/png;base64,', text)
    assert imgs == ["r: goodput.png", "r: latency_cdf.png", "r: itl_timeline.png"]


def test_the_report_carries_what_compare_says_and_what_ran(report):
    _, text = report
    assert f'<div class="banner partial">PARTIAL r: {REASON}</div>' in text
    assert '<div class="banner box">BOX: one request alone took 900 ms TTFT' in text
    assert "<caption>goodput (req/s, mean ± 95% interval over repeats)</caption>" in text
    assert "<th>TTFT only</th>" in text and "<h2>Verdict</h2>" in text
    assert "disagg vs unified: no verdict: the run of disagg was cut short (partial)" in text
    assert "<td>cpu_model</td>" in text and "&quot;Test CPU&quot;" in text  # env.json
    assert "name: synthetic" in text and "variants:" in text  # recipe.yaml
    assert "<h2>Warnings</h2>" in text


def test_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys):
    assert main([str(tmp_path / "nope")], str(tmp_path / "x.html")) == 2
    assert capsys.readouterr().err.count("\n") == 1 and not os.path.exists(tmp_path / "x.html")
    assert main([str(tmp_path)], str(tmp_path / "missing-dir" / "x.html")) == 2


@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium installed (Debian: apt-get install chromium)")
def test_the_report_renders_in_headless_chromium(report, tmp_path):
    path, _ = report
    url = "file://" + os.path.abspath(path)

    def chromium(*args):
        profile = tmp_path / f"profile-{len(os.listdir(tmp_path))}"
        return subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={profile}", *args, url], capture_output=True,
                              text=True, timeout=120)

    dom = chromium("--dump-dom").stdout
    assert 'data-images="3/3"' in dom and "3 of 3 plots decoded" in dom  # the page's own check, after load
    shot = tmp_path / "report.png"
    chromium("--window-size=1280,2400", f"--screenshot={shot}")
    with open(shot, "rb") as f:
        png = f.read()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and int.from_bytes(png[16:20], "big") == 1280
