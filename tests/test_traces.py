"""The trace readers on the synthetic samples in tests/data (scripts/make_trace_samples.py), checked against a
plain reading of the same files; malformed traces; `pdlab trace stats`."""

import csv
import importlib.util
import json
import os
from datetime import datetime

import numpy as np
import pytest
from typer.testing import CliRunner

from pdlab.cli import app
from pdlab.constants import TRACE_FORMATS
from pdlab.traces import READERS, TraceError, read_trace, sniff_format
from pdlab.traces.stats import trace_stats

ROOT = os.path.join(os.path.dirname(__file__), os.pardir)
DATA = os.path.join(os.path.dirname(__file__), "data")


def sample(name):
    return os.path.join(DATA, name)


def test_every_format_has_a_reader():
    assert tuple(READERS) == TRACE_FORMATS


def test_the_samples_are_what_the_script_writes():
    spec = importlib.util.spec_from_file_location("make_trace_samples",
                                                  os.path.join(ROOT, "scripts", "make_trace_samples.py"))
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert gen.main(["--check"]) == 0


def test_mooncake_rows_lengths_milliseconds_and_hash_ids():
    path = sample("trace-mooncake.jsonl")
    lines = [json.loads(x) for x in open(path) if x.strip()]
    t = read_trace(path, "mooncake")
    assert len(t) == t.rows == len(lines) == 48 and t.dropped == ()
    assert t.input_len.tolist() == [x["input_length"] for x in lines]
    assert t.output_len.tolist() == [x["output_length"] for x in lines]
    ms = np.array([x["timestamp"] for x in lines], dtype=float)
    assert np.allclose(t.t, (ms - ms[0]) / 1000)  # milliseconds -> seconds from the first request
    assert [list(ids) for ids in t.hash_ids] == [x["hash_ids"] for x in lines]
    assert t.prefix_info and t.block_size == 512
    # as Mooncake writes them: one id per 512-token block, the last one partial
    assert all(len(x["hash_ids"]) == -(-x["input_length"] // 512) for x in lines)


def _epoch(text):
    day, frac = text.split(".")
    frac, zone = (frac.split("+")[0], "+" + frac.split("+")[1]) if "+" in frac else (frac, "+00:00")
    return datetime.fromisoformat(day + zone).timestamp() + int(frac) / 10 ** len(frac)


@pytest.mark.parametrize("name,digits", [("trace-azure-code-2023.csv", 7), ("trace-azure-conv-2024.csv", 6)])
def test_azure_2023_and_2024_times_and_token_columns(name, digits):
    rows = list(csv.DictReader(open(sample(name))))
    assert len(rows[1]["TIMESTAMP"].split(".")[1].split("+")[0]) == digits
    t = read_trace(sample(name), "azure")
    assert len(t) == len(rows) == 40 and not t.prefix_info
    assert t.input_len.tolist() == [int(r["ContextTokens"]) for r in rows]
    assert t.output_len.tolist() == [int(r["GeneratedTokens"]) for r in rows]
    epochs = np.array([_epoch(r["TIMESTAMP"]) for r in rows])
    assert np.allclose(t.t, epochs - epochs[0], atol=1e-6)
    assert 0 < t.t[1] < 1  # sub-second arrivals keep their fraction


def test_burstgpt_drops_and_counts_failed_rows():
    rows = list(csv.DictReader(open(sample("trace-burstgpt.csv"))))
    ok = [r for r in rows if int(r["Response tokens"]) > 0]
    t = read_trace(sample("trace-burstgpt.csv"), "burstgpt")
    assert t.rows == 40 and len(t) == len(ok) == 36
    assert t.dropped_counts == {"failed (0 response tokens)": 4}
    assert t.input_len.tolist() == [int(r["Request tokens"]) for r in ok]
    assert t.output_len.tolist() == [int(r["Response tokens"]) for r in ok]
    ts = np.array([float(r["Timestamp"]) for r in ok])
    assert np.allclose(t.t, ts - ts[0]) and not t.prefix_info


def test_plain_jsonl():
    lines = [json.loads(x) for x in open(sample("trace-plain.jsonl"))]
    t = read_trace(sample("trace-plain.jsonl"), "jsonl")
    assert t.input_len.tolist() == [x["input_len"] for x in lines]
    assert t.output_len.tolist() == [x["output_len"] for x in lines]
    assert np.allclose(t.t, [x["timestamp"] - lines[0]["timestamp"] for x in lines])


@pytest.mark.parametrize("name,fmt", [("trace-mooncake.jsonl", "mooncake"), ("trace-azure-code-2023.csv", "azure"),
                                      ("trace-burstgpt.csv", "burstgpt"), ("trace-plain.jsonl", "jsonl")])
def test_the_format_is_told_from_the_first_line(name, fmt):
    assert sniff_format(sample(name)) == fmt


# ---- malformed: one line naming the file and the line ----

MALFORMED = [
    ("mooncake", '{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [1]}\n\n'
                 '{"timestamp": 5, "input_length": 10, "output_length": 2}\n', ":3: missing key 'hash_ids'"),
    ("mooncake", '{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [1]}\n'
                 '{"timestamp": 9, "input_length": 10, "output_length": 2, "hash_ids": [1]}\n'
                 '{"timestamp": 5, "input_length": 10, "output_length": 2, "hash_ids": [1]}\n',
     ":3: timestamp goes back in time"),
    ("mooncake", '{"timestamp": 0, "input_length": -5, "output_length": 2, "hash_ids": []}\n',
     ":1: negative input_length (-5)"),
    ("azure", "TIMESTAMP,ContextTokens\n2023-11-16 18:15:46.6805900,5\n", ":1: missing column 'GeneratedTokens'"),
    ("azure", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:47.0,5,1\n2023-11-16 18:15:46.9,5,1\n",
     ":3: timestamp goes back in time"),
    ("azure", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:47.0,5,-1\n",
     ":2: negative GeneratedTokens (-1)"),
    ("azure", "TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,5,1\n", ":2: TIMESTAMP 'yesterday'"),
    ("burstgpt", "Timestamp,Model,Request tokens,Total tokens,Log Type\n1,ChatGPT,5,5,API log\n",
     ":1: missing column 'Response tokens'"),
    ("burstgpt", "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                 "1,ChatGPT,-3,5,2,API log\n", ":2: negative Request tokens (-3)"),
    ("jsonl", '{"timestamp": 1.0, "input_len": 4, "output_len": 1}\n{"timestamp": 0.5, "input_len": 4, '
              '"output_len": 1}\n', ":2: timestamp goes back in time"),
    ("jsonl", '{"timestamp": 1.0, "input_len": 4}\n', ":1: missing key 'output_len'"),
    ("jsonl", "not json\n", ":1: not valid JSON"),
]


@pytest.mark.parametrize("fmt,text,msg", MALFORMED)
def test_a_malformed_trace_is_one_line_naming_file_and_line(tmp_path, fmt, text, msg):
    p = tmp_path / f"bad-{fmt}.txt"
    p.write_text(text)
    with pytest.raises(TraceError) as e:
        read_trace(str(p), fmt)
    assert str(e.value).startswith(str(p) + msg.split(" ")[0]) and msg in str(e.value)
    assert "\n" not in str(e.value)


def test_zero_lengths_are_dropped_and_counted_and_an_all_dropped_trace_is_an_error(tmp_path):
    p = tmp_path / "z.csv"
    p.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2024-05-10 00:00:00.1+00:00,0,3\n"
                 "2024-05-10 00:00:00.2+00:00,4,0\n2024-05-10 00:00:01.2+00:00,4,2\n")
    t = read_trace(str(p), "azure")
    assert len(t) == 1 and t.rows == 3
    assert t.dropped_counts == {"no input tokens": 1, "no output tokens": 1}
    p.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2024-05-10 00:00:00.1+00:00,0,3\n")
    with pytest.raises(TraceError, match="no replayable request in 1 rows"):
        read_trace(str(p), "azure")


# ---- pdlab trace stats ----

def test_stats_of_the_mooncake_sample():
    t = read_trace(sample("trace-mooncake.jsonl"), "mooncake")
    s = trace_stats(t, bin_s=5.0)
    gaps = np.diff(t.t)
    assert s.burstiness == pytest.approx(gaps.std() / gaps.mean())
    assert sum(s.rate_over_time) * 5.0 == pytest.approx(len(t))  # every arrival in one bin
    assert s.mean_rate == pytest.approx((len(t) - 1) / t.t[-1])
    assert s.input_len.p50 == pytest.approx(np.median(t.input_len)) and s.output_len.max == t.output_len.max()
    assert 0 < s.reuse_ratio < 1


def test_pdlab_trace_stats_prints_a_table_and_writes_a_plot(tmp_path):
    png = tmp_path / "s.png"
    r = CliRunner().invoke(app, ["trace", "stats", sample("trace-mooncake.jsonl"), "--plot", str(png)])
    assert r.exit_code == 0, r.output
    assert "prefix reuse" in r.output and "burstiness" in r.output and "48 of 48 rows" in r.output
    assert png.stat().st_size > 0
    r = CliRunner().invoke(app, ["trace", "stats", sample("trace-burstgpt.csv"), "--no-plot", "--json"])
    out = json.loads(r.output)
    assert out["dropped"] == {"failed (0 response tokens)": 4} and out["reuse_ratio"] is None
    assert out["prefix_info"] is False


def test_pdlab_trace_stats_on_a_bad_file_exits_2_with_one_line(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"timestamp": 0, "input_length": 10, "output_length": -2, "hash_ids": []}\n')
    r = CliRunner().invoke(app, ["trace", "stats", str(p), "--format", "mooncake", "--no-plot"])
    assert r.exit_code == 2
    assert r.output.strip().splitlines() == [f"pdlab trace stats: error: {p}:1: negative output_length (-2)"]
    r = CliRunner().invoke(app, ["trace", "stats", str(p), "--format", "sharegpt"])
    assert r.exit_code == 2 and "--format 'sharegpt'" in r.output
