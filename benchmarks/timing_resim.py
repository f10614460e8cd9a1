"""Re-simulate a held-out validation's recipes (benchmarks/timing_validation.py --out DIR) from a profile, changed or
not, and score the forecasts against the same real runs: how a change to the timing model or to a profile's figures
moves the forecast, with the box's phase held fixed (the real runs are the validation's own).

    python benchmarks/timing_resim.py DIR                                  # DIR/box.yaml as it is
    python benchmarks/timing_resim.py DIR --set contention.prefill_x=1     # one figure changed
    python benchmarks/timing_resim.py DIR --profile other.yaml --out DIR/resim-other

A validation's point forecast is scored against real runs taken minutes later on a box whose pace moves x1.2-1.5
between them (BENCHMARKS.md), so two validations' figure counts differ by the box's phase as much as by the model;
the same real runs re-simulated are the fair comparison of two models. DIR/box.yaml is read without its drift (the
validation adds each scored recipe's runs to it; the point forecast never reads it). The simulations go to --out
(default: a temporary directory), each with its log; the tally is printed as the validation prints its own.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from timing_validation import RECIPES, figures, run, say_tally, tally  # noqa: E402
from pdlab.timing.replay import compare, table  # noqa: E402


def changed(profile: str, sets: list[str], out: str) -> str:
    """A copy of `profile` without its drift, with each `key.path=value` of `sets` set (values read as YAML)."""
    with open(profile) as f:
        raw = yaml.safe_load(f)
    raw.pop("drift", None)
    for s in sets:
        key, _, value = s.partition("=")
        node, parts = raw, key.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = yaml.safe_load(value)
    path = os.path.join(out, "profile.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(raw, f, sort_keys=False)
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", help="a validation's directory (benchmarks/timing_validation.py --out)")
    ap.add_argument("--profile", help="the profile to simulate from (default: DIR/box.yaml)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="change a figure of the profile (e.g. contention.prefill_x=1); repeatable")
    ap.add_argument("--out", help="where the simulations go (default: a temporary directory)")
    ap.add_argument("--verbose", action="store_true", help="print each recipe's table")
    args = ap.parse_args()
    names = [n for n in RECIPES if os.path.isdir(os.path.join(args.dir, f"{n}-real"))]
    if not names:
        print(f"error: {args.dir}: no recipe's real run in it (expected {', '.join(n + '-real' for n in RECIPES)})",
              file=sys.stderr)
        return 2
    bad = [s for s in args.set if not s.partition("=")[0] or "=" not in s]
    if bad:
        print(f"error: --set {bad[0]}: expected key.path=value", file=sys.stderr)
        return 2
    profile = args.profile or os.path.join(args.dir, "box.yaml")
    if not os.path.isfile(profile):
        print(f"error: --profile {profile}: no such file", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or tmp
        os.makedirs(out, exist_ok=True)
        path = changed(profile, args.set, out)
        comparisons = []
        for name in names:
            sim = os.path.join(out, f"{name}-sim")
            run([sys.executable, "-m", "pdlab.cli", "run", os.path.join(args.dir, f"{name}.yaml"), "--simulate",
                 "--set", f"model.timing={path}", "--out", sim], os.path.join(out, f"{name}-sim.log"))
            cmp = compare(figures(os.path.join(args.dir, f"{name}-real")), figures(sim))
            comparisons.append(cmp)
            if args.verbose:
                print(f"{name}:")
                for line in table(cmp):
                    print(f"  {line}")
        t = tally([r for c in comparisons for r in c["rows"]], comparisons)
        total = sum(m["within"] for m in t["met"].values())
        of = sum(m["of"] for m in t["met"].values())
        say_tally(f"within target, re-simulated from {os.path.basename(profile)}"
                  + (f" with {', '.join(args.set)}" if args.set else ""), t)
        print(f"figures within target: {total} of {of}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
