"""The reference article's worked examples, column by column, through
`pagedkv replay` (the real CLI in a subprocess) and the core."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from allocator_service.core import ContiguousPool

TRACES = Path(__file__).parents[1] / "traces"


def replay(trace: Path, *flags: str) -> list[dict]:
    proc = subprocess.run(
        [sys.executable, "-m", "pagedkv", "replay", str(trace), *flags],
        capture_output=True,
        text=True,
        check=True,
    )
    return [json.loads(line) for line in proc.stdout.splitlines()]


def test_hand_worked_table():
    """B=4, 8 blocks, steps 1-8 of the article's hand-worked table."""
    out = replay(TRACES / "article_table.jsonl", "--num-blocks", "8", "--block-size", "4")
    expected = [
        # (tables, free list, wasted slots, new blocks)
        ({"A": [0, 1]}, [2, 3, 4, 5, 6, 7], 2, [0, 1]),
        ({"A": [0, 1], "B": [2]}, [3, 4, 5, 6, 7], 3, [2]),
        ({"A": [0, 1], "B": [2], "C": [3, 4]}, [5, 6, 7], 6, [3, 4]),
        ({"A": [0, 1], "B": [2], "C": [3, 4]}, [5, 6, 7], 4, []),
        ({"A": [0, 1, 5], "B": [2], "C": [3, 4]}, [6, 7], 7, [5]),
        ({"A": [0, 1, 5], "B": [2, 6], "C": [3, 4]}, [7], 9, [6]),
        ({"A": [0, 1, 5], "C": [3, 4]}, [7, 2, 6], 6, []),
        ({"A": [0, 1, 5], "C": [3, 4, 7]}, [2, 6], 6, [7]),
    ]
    assert len(out) == len(expected)
    for step, (line, (tables, free, wasted, new)) in enumerate(zip(out, expected, strict=True), 1):
        assert line["ok"], step
        assert line["tables"] == tables, step
        assert line["free"] == free, step
        assert line["wasted_slots"] == wasted, step
        assert line["new_blocks"] == new, step
        assert line["copies"] == [], step
        refs = {int(b): c for b, c in line["refcounts"].items()}
        assert refs == {b: 1 for t in tables.values() for b in t}, step
    assert [line["cached_tokens"] for line in out[:3]] == [0, 0, 0]


@pytest.mark.parametrize("caching", [False, True])
def test_prefix_sharing_table(caching):
    """B=4, 6 blocks: fork shares, the first writer copies block 1, the second
    writes in place; block 0 (full) is never copied."""
    flags = ["--num-blocks", "6", "--block-size", "4"] + (["--prefix-caching"] if caching else [])
    out = replay(TRACES / "article_prefix_sharing.jsonl", *flags)
    rows = [(o["tables"], o["refcounts"], o["free"], o["copies"]) for o in out]
    assert rows == [
        ({"S1": [0, 1]}, {"0": 1, "1": 1}, [2, 3, 4, 5], []),
        ({"S1": [0, 1], "S2": [0, 1]}, {"0": 2, "1": 2}, [2, 3, 4, 5], []),
        ({"S1": [0, 2], "S2": [0, 1]}, {"0": 2, "1": 1, "2": 1}, [3, 4, 5], [[1, 2]]),
        ({"S1": [0, 2], "S2": [0, 1]}, {"0": 2, "1": 1, "2": 1}, [3, 4, 5], []),
    ]
    assert out[1]["new_blocks"] == [] and out[2]["new_blocks"] == [2]


def test_contiguous_example():
    """32 slots; R1/R2/R3 reserve 12/8/8 holding 5/3/6. After R2 finishes the
    12 free slots come in runs of 8 and 4, so 12 in a row is refused."""
    pool = ContiguousPool(32)
    assert pool.reserve("R1", 12, used=5) == 0
    assert pool.reserve("R2", 8, used=3) == 12
    assert pool.reserve("R3", 8, used=6) == 20
    assert pool.reserved_slots - pool.used_slots == 14
    assert pool.free_slots == 4
    pool.free("R2")
    assert pool.free_slots == 12
    assert pool.free_runs() == [(12, 8), (28, 4)]
    assert pool.reserve("R4", 12) is None
    assert pool.reserve("R4", 8) == 12


def test_failed_op_prints_unchanged_state(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        '{"op": "admit", "seq": "A", "tokens": [1, 2, 3, 4, 5]}\n'
        '{"op": "admit", "seq": "B", "tokens": [1, 2, 3, 4, 5]}\n'
        '{"op": "append", "seq": "Z", "tokens": [1]}\n'
        '{"op": "admit", "seq": "A", "tokens": [1]}\n'
    )
    out = replay(trace, "--num-blocks", "3", "--block-size", "4")
    assert out[1]["ok"] is False and out[1]["error"] == "out_of_blocks"
    assert (
        out[1]["tables"] == {"A": [0, 1]} and out[1]["free"] == [2] and out[1]["new_blocks"] == []
    )
    assert out[2]["error"] == "unknown_sequence"
    assert out[3]["error"] == "sequence_exists"
    assert out[3]["tables"] == out[0]["tables"]


@pytest.mark.parametrize(
    "line,needle",
    [
        ("{not json", "line 2: not valid JSON"),
        ('{"op": "grow", "seq": "A"}', "line 2: unknown op 'grow'"),
        ('{"op": "append", "seq": "A"}', "line 2: append needs tokens"),
        ('{"op": "append", "seq": "A", "tokens": [1.5]}', "line 2: tokens must be a list"),
        ('{"op": "append", "seq": "A", "tokens": [-1]}', "line 2: tokens must be a list"),
        ('{"op": "free", "seq": "A", "x": 1}', "line 2: free does not take x"),
        ("[1, 2]", "line 2: expected a JSON object"),
        ('{"op": "fork", "parent": 3, "child": "B"}', "line 2: parent must be a non-empty string"),
    ],
)
def test_malformed_line_is_named_without_traceback(tmp_path, line, needle):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"op": "admit", "seq": "A", "tokens": [1]}\n' + line + "\n")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pagedkv",
            "replay",
            str(trace),
            "--num-blocks",
            "4",
            "--block-size",
            "4",
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert needle in proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stdout == ""  # nothing ran: the trace is checked before the first op
