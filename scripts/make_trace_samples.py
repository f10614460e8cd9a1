"""Write pdlab's small synthetic traces, one per format pdlab replays, under tests/data/.

    python scripts/make_trace_samples.py            # (re)write them
    python scripts/make_trace_samples.py --check    # exit 1 if a file differs from what this script writes

Nothing here comes from the public traces: every row is drawn from Python's `random.Random(seed)` by the
generators below, in each format's layout as its publishers document it, so the parsers, the replay and
`pdlab trace stats` can be tested and demonstrated without downloading them. (Python promises the same
`random()` stream across versions, not the same gamma or lognormal draws: tests/test_traces.py runs
`--check`, so a version that draws differently says so.)

- trace-mooncake.jsonl (48 rows) and trace-mooncake-gpu.jsonl (300 rows), Mooncake's layout: chat sessions
  that each start from one of a few shared system prompts (2-8 blocks of 512 tokens) and grow turn by turn.
  A later turn's hash_ids are the earlier turn's full blocks plus new ids, as a prompt that repeats the
  conversation so far would hash; a few requests repeat an earlier prompt exactly. Gaps between arrivals are
  gamma-distributed with shape 0.5 (burstier than Poisson: CV about 1.4). The small file's prompts are up to
  about 13k tokens (1.7k at length_scale 1/8, for the CPU demo) and one of 40k, which the demo's model clips.
- trace-azure-code-2023.csv, trace-azure-conv-2024.csv: Azure's TIMESTAMP,ContextTokens,GeneratedTokens,
  2023 naive times with 7 fractional digits, 2024 with 6 and +00:00; code: long contexts, short outputs;
  conversation: shorter contexts, longer outputs. Poisson arrivals.
- trace-burstgpt.csv: BurstGPT's six columns, integer-second timestamps, ChatGPT and GPT-4 rows, 4 failed
  requests logged with 0 response tokens.
- trace-plain.jsonl: pdlab's plain jsonl (timestamp in seconds, input_len, output_len).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
from datetime import datetime, timedelta

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "tests", "data")
BLOCK = 512  # Mooncake's tokens per hash id
AZURE_2023 = datetime(2023, 11, 16, 18, 15, 46)  # the samples' first times (the public traces' days)
AZURE_2024 = datetime(2024, 5, 12)


def _gaps(rng: random.Random, n: int, mean_s: float, shape: float) -> list[float]:
    """n - 1 gamma gaps with mean `mean_s` and shape `shape` (1: Poisson), as cumulative arrival times."""
    t, out = 0.0, [0.0]
    for _ in range(n - 1):
        t += rng.gammavariate(shape, mean_s / shape)
        out.append(t)
    return out


def mooncake_rows(seed: int, n: int, mean_gap_s: float, max_blocks: int, turn_blocks: int = 4, follow: float = 0.5,
                  long_every: int = 0) -> list[dict]:
    """Chat sessions over shared system prompts (see the module docstring), in arrival order: a row is the
    next turn of a session with probability `follow` (1-`turn_blocks` new blocks), and every `long_every`-th
    row (0: none) is an 80-block prompt."""
    rng = random.Random(seed)
    next_id = 0

    def new_ids(k: int) -> list[int]:
        nonlocal next_id
        next_id += k
        return list(range(next_id - k, next_id))

    systems = [new_ids(k) for k in (2, 4, 8)]
    sessions: list[list[int]] = []  # each session's next prompt starts with these ids
    rows: list[dict] = []
    for i, t in enumerate(_gaps(rng, n, mean_gap_s, 0.5)):
        if rows and rng.random() < 0.08:  # an exact repeat of an earlier prompt
            earlier = rng.choice(rows)
            ids, length = list(earlier["hash_ids"]), earlier["input_length"]
        else:
            if not sessions or rng.random() >= follow:
                sessions.append(list(rng.choice(systems)))
                s = len(sessions) - 1
            else:
                s = rng.randrange(len(sessions))
            base = sessions[s]
            long = long_every and i % long_every == long_every - 1
            k = 80 - len(base) if long else min(rng.randint(1, turn_blocks), max(1, max_blocks - len(base)))
            ids = base + new_ids(k)
            length = (len(ids) - 1) * BLOCK + rng.randint(1, BLOCK)
            # the session's next turn repeats this prompt's full blocks; a long or full one starts over
            sessions[s] = ids[:-1] if not long and len(ids) < max_blocks else list(rng.choice(systems))
        out = max(4, min(2000, round(rng.lognormvariate(math.log(220), 0.8))))
        rows.append({"timestamp": round(t * 1000), "input_length": length, "output_length": out, "hash_ids": ids})
    return rows


def azure_rows(seed: int, n: int, mean_gap_s: float, ctx: tuple[float, float],
               gen: tuple[float, float]) -> list[tuple[int, int, int]]:
    """(offset in 100 ns ticks, context tokens, generated tokens): lognormal lengths (median, sigma),
    Poisson arrivals."""
    rng = random.Random(seed)
    return [(round(t * 1e7), max(1, round(rng.lognormvariate(math.log(ctx[0]), ctx[1]))),
             max(1, round(rng.lognormvariate(math.log(gen[0]), gen[1])))) for t in _gaps(rng, n, mean_gap_s, 1.0)]


def azure_text(rows: list[tuple[int, int, int]], start: datetime, year: int) -> str:
    """2023: naive times with 100 ns digits; 2024: microseconds and a UTC offset."""
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    for ticks, c, g in rows:
        sec, frac = divmod(ticks, 10 ** 7)
        stamp = f"{start + timedelta(seconds=sec):%Y-%m-%d %H:%M:%S}"
        lines.append(f"{stamp}.{frac:07d},{c},{g}" if year == 2023 else f"{stamp}.{frac // 10:06d}+00:00,{c},{g}")
    return "\n".join(lines) + "\n"


def burstgpt_rows(seed: int, n: int, failed: tuple[int, ...]) -> list[tuple[int, str, int, int, str]]:
    """(timestamp s, model, request tokens, response tokens, log type); rows `failed` have 0 response tokens."""
    rng = random.Random(seed)
    t, rows = 0, []
    for i in range(n):
        t += int(rng.expovariate(1 / 3.0))
        model = "GPT-4" if rng.random() < 0.3 else "ChatGPT"
        req = max(1, round(rng.lognormvariate(math.log(600), 0.9)))
        resp = 0 if i in failed else max(1, round(rng.lognormvariate(math.log(150), 0.8)))
        rows.append((t, model, req, resp, "Conversation log" if rng.random() < 0.7 else "API log"))
    return rows


def plain_rows(seed: int, n: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"timestamp": round(t, 3), "input_len": rng.randint(64, 2048), "output_len": rng.randint(16, 256)}
            for t in _gaps(rng, n, 0.5, 1.0)]


def samples() -> dict[str, str]:
    """File name -> text of every sample."""
    burst = burstgpt_rows(4, 40, failed=(5, 17, 18, 33))
    return {
        "trace-mooncake.jsonl": "".join(json.dumps(r) + "\n" for r in mooncake_rows(1, 48, 1.0, 26, long_every=40)),
        "trace-mooncake-gpu.jsonl": "".join(json.dumps(r) + "\n" for r in mooncake_rows(2, 300, 0.5, 60, 6, 0.7)),
        "trace-azure-code-2023.csv": azure_text(azure_rows(3, 40, 0.4, (2000, 0.8), (20, 0.9)), AZURE_2023, 2023),
        "trace-azure-conv-2024.csv": azure_text(azure_rows(5, 40, 0.3, (900, 0.9), (230, 0.7)), AZURE_2024, 2024),
        "trace-burstgpt.csv": "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n" + "".join(
            f"{t},{m},{q},{r},{q + r},{lt}\n" for t, m, q, r, lt in burst),
        "trace-plain.jsonl": "".join(json.dumps(r) + "\n" for r in plain_rows(6, 30)),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="compare with the files instead of writing them")
    ap.add_argument("--out", default=DATA, help="directory (default: tests/data)")
    args = ap.parse_args(argv)
    stale = []
    for name, text in samples().items():
        path = os.path.join(args.out, name)
        if args.check:
            try:
                with open(path) as f:
                    if f.read() != text:
                        stale.append(name)
            except FileNotFoundError:
                stale.append(name)
            continue
        with open(path, "w") as f:
            f.write(text)
        print(path)
    if stale:
        print(f"differs from this script's output: {', '.join(stale)}", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
