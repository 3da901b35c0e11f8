"""`/playground` and `pagedkv playground`: the article's widget on the real
core. The article's hand-worked table, clicked step by step in headless
Chromium, shows what `pagedkv replay` prints for the same trace."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from allocator_service.web.app import start_web_server, stop_web_server
from allocator_service.web.playground import PlaygroundError, run
from tests.web import cdp

ROOT = Path(__file__).parents[2]
TRACE = ROOT / "tests" / "traces" / "article_table.jsonl"
OUT = ROOT / "out"


def replay() -> list[dict]:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pagedkv.cli",
            "replay",
            "--num-blocks",
            "8",
            "--block-size",
            "4",
            str(TRACE),
        ],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    ).stdout
    return [json.loads(line) for line in out.splitlines()]


def test_api_matches_replay_and_refuses_bad_input():
    ops = [json.loads(line) for line in TRACE.read_text().splitlines() if line.strip()]
    answer = run({"num_blocks": 8, "block_size": 4, "ops": ops})
    for got, want in zip(answer["results"], replay(), strict=True):
        assert {
            k: got[k] for k in ("ok", "tables", "free", "refcounts", "wasted_slots", "new_blocks")
        } == {
            k: want[k] for k in ("ok", "tables", "free", "refcounts", "wasted_slots", "new_blocks")
        }
    for bad in (
        {"num_blocks": 0},
        {"block_size": 99},
        {"ops": [{"op": "drop"}]},
        {"ops": "x"},
        {"ops": [{"op": "admit", "seq": "A", "tokens": [-1]}]},
        {"prefix_caching": "yes"},
    ):
        with pytest.raises(PlaygroundError):
            run(bad)


@pytest.fixture(scope="module")
def site():
    httpd = start_web_server(0, "127.0.0.1", playground=True)
    yield f"http://127.0.0.1:{httpd.server_port}"
    stop_web_server(httpd)


def test_offline_server_has_no_pools(site):
    assert urllib.request.urlopen(f"{site}/playground", timeout=5).status == 200
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(f"{site}/pools", timeout=5)
    assert err.value.code == 404
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(f"{site}/metrics", timeout=5)
    assert err.value.code == 404


def test_pagedkv_playground_command():
    proc = subprocess.Popen(
        [sys.executable, "-m", "pagedkv.cli", "playground", "--port", "0"],
        cwd=ROOT,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stderr.readline()
        url = line.split("open ", 1)[1].split()[0]
        page = urllib.request.urlopen(url, timeout=5).read().decode()
        assert "PagedKV playground" in page
        assert (
            b"pools.html"
            not in urllib.request.urlopen(
                url.replace("/playground", "/static/playground.js"), timeout=5
            ).read()
        )
    finally:
        proc.terminate()
        assert proc.wait(10) == 0


@pytest.mark.skipif(
    not cdp.available(), reason="needs Debian's chromium (/usr/bin/chromium); .ci/run installs it"
)
def test_clicking_the_article_table(site):
    want = replay()
    # The article's steps as clicks: (control, value, button)
    clicks = [
        ("#prompt", 6, "#add"),
        ("#prompt", 3, "#add"),
        ("#prompt", 5, "#add"),
        ("#n", 2, '[data-act="growN"][data-seq="A"]'),
        ("#n", 1, '[data-act="growN"][data-seq="A"]'),
        ("#n", 2, '[data-act="growN"][data-seq="B"]'),
        (None, None, '[data-act="free"][data-seq="B"]'),
        ("#n", 4, '[data-act="growN"][data-seq="C"]'),
    ]
    OUT.mkdir(exist_ok=True)
    with cdp.Browser(1280, 900) as b:
        b.goto(f"{site}/playground")
        b.wait_for("document.body.dataset.steps === '0'")
        for i, (control, value, button) in enumerate(clicks):
            if control:
                b.eval(f"document.querySelector('{control}').value = '{value}'")
            b.eval(f"document.querySelector('{button}').click()")
            b.wait_for(f"document.body.dataset.steps === '{i + 1}'")
            shown = b.eval("({...document.getElementById('paged').dataset})")
            assert json.loads(shown["tables"]) == want[i]["tables"], i
            assert json.loads(shown["free"]) == want[i]["free"], i
            assert json.loads(shown["refcounts"]) == want[i]["refcounts"], i
            assert int(shown["wasted"]) == want[i]["wasted_slots"], i
            cells = b.eval(
                "[...document.querySelectorAll('#paged-blocks .blk')].map(x => x.dataset.state)"
            )
            assert cells.count("used") == int(shown["usedBlocks"]) == 8 - len(want[i]["free"])
        # every row of the steps table, as replay prints it
        rows = b.eval(
            "[...document.querySelectorAll('#log tr[data-step]')]"
            ".map(r => [JSON.parse(r.dataset.tables), "
            "JSON.parse(r.dataset.free), +r.dataset.wasted])"
        )
        assert rows == [[w["tables"], w["free"], w["wasted_slots"]] for w in want]
        # the contiguous layout beside it: 32 slots, 16
        # reserved a chat shuts C out; 8 a chat fits all
        contig = b.eval("({...document.getElementById('contig').dataset})")
        assert json.loads(contig["waiting"]) == []  # B finished: C got its place
        b.screenshot(str(OUT / "playground.png"))

        # The article's button replays the same table, one press per step.
        b.eval("document.getElementById('reset').click()")
        b.wait_for("document.body.dataset.steps === '0'")
        for i in range(len(want)):
            b.eval("document.getElementById('article').click()")
            b.wait_for(f"document.body.dataset.steps === '{i + 1}'")
        assert (
            b.eval(
                "[...document.querySelectorAll('#log tr[data-step]')]"
                ".map(r => [JSON.parse(r.dataset.tables), "
                "JSON.parse(r.dataset.free), +r.dataset.wasted])"
            )
            == rows
        )

        # The slider: 16 slots a chat fit two of three chats in 32 slots; 8 fit all three.
        b.eval("document.getElementById('reset').click()")
        b.wait_for("document.body.dataset.steps === '0'")
        for i in range(3):
            b.eval("document.getElementById('article').click()")
            b.wait_for(f"document.body.dataset.steps === '{i + 1}'")
        assert json.loads(b.eval("document.getElementById('contig').dataset.waiting")) == ["C"]
        b.eval(
            "const r = document.getElementById('reserve'); "
            "r.value = '8'; r.dispatchEvent(new Event('change'))"
        )
        b.wait_for("document.getElementById('contig').dataset.waiting === '[]'")
        assert b.eval("+document.getElementById('contig').dataset.wasted") == 24 - 14

        # Fork shares every block (refcount 2); a smaller block size re-runs the same clicks.
        b.eval("""document.querySelector('[data-act="fork"][data-seq="A"]').click()""")
        b.wait_for("document.body.dataset.steps === '4'")
        refs = json.loads(b.eval("document.getElementById('paged').dataset.refcounts"))
        assert refs == {"0": 2, "1": 2, "2": 1, "3": 1, "4": 1}
        b.eval(
            "const s = document.getElementById('block-size'); "
            "s.value = '2'; s.dispatchEvent(new Event('change'))"
        )
        b.wait_for("JSON.parse(document.getElementById('paged').dataset.tables).A?.length === 3")
        b.eval(
            "const c = document.getElementById('prefix'); "
            "c.checked = true; c.dispatchEvent(new Event('change'))"
        )
        b.wait_for("document.getElementById('paged-stats').textContent.includes('hit rate')")
        b.screenshot(str(OUT / "playground-fork.png"))
