"""Re-score a timing validation's bands with the drift accumulated over its own runs (issue 25).

    python benchmarks/band_rescore.py runs/timing-validation    # a benchmarks/timing_validation.py --out DIR

The validation's real runs stay in its folder, so a band can be scored again without running anything for
real: each recipe, in the order the validation ran them, is simulated from DIR/box.yaml with its drift as the
calibration left it, and again with the real runs (and reruns) of the recipes before it added to the drift, as
`pdlab profile --check RUN --profile FILE --write-drift` would have added them (what `timing_validation.py
--accumulate` now does as it goes). Each real run is held against both bands (pdlab.timing.replay.covered):
figures within the target of some value in the band; and the band's centre (the recipe simulated at the drift's
median) is scored against it as a forecast is (pdlab.timing.replay.compare, the same targets). A recipe's own runs
never feed its own band. Simulated, not measured: the bands are the simulator's; the runs they are held against are
the validation's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="a timing validation's --out folder (validation.json, box.yaml and its runs)")
    args = ap.parse_args()
    from pdlab.measure.records import load_run
    from pdlab.recipe import load_profile, parse_recipe
    from pdlab.recipe.timing import Drift
    from pdlab.sim.band import forecast_band
    from pdlab.sim.experiment import simulate_recipe
    from pdlab.timing.drift import merged, run_factors
    from pdlab.timing.replay import covered, figures, within
    from pdlab.workload import build_workload
    from timing_validation import centre, tally

    path = os.path.join(args.out, "validation.json")
    if not os.path.isfile(path):
        print(f"error: {args.out}: no validation.json (run benchmarks/timing_validation.py --out there)",
              file=sys.stderr)
        return 2
    done = json.load(open(path))
    names = list(done["recipes"])  # in the order they ran
    profile = load_profile(os.path.join(args.out, "box.yaml"))
    # the drift as the calibration left it (with --accumulate the validation went on to add its recipes' runs)
    kept = (done.get("calibration") or {}).get("drift_raw")
    calibration = Drift.from_raw(kept, "drift_raw") if kept is not None else profile.drift
    drift, totals = calibration, {"calibration": {}, "accumulated": {}}
    centres: dict[str, list] = {"calibration": [], "accumulated": []}  # the centre's comparisons, recipe by recipe
    for i, name in enumerate(names):
        scored_run = load_run(os.path.join(args.out, f"{name}-real"))
        real = figures(scored_run.requests, scored_run.summary)
        raw = yaml.safe_load(open(os.path.join(args.out, f"{name}.yaml")))
        raw["model"] = {k: v for k, v in raw["model"].items() if k != "check_timing"}
        for which, d in (("calibration", calibration), ("accumulated", drift)):
            raw["model"]["timing"] = profile.replace(drift=d).to_raw()
            r = parse_recipe(dict(raw, simulate=True))
            wl = {n: build_workload(v) for n, v in r.variants.items()}
            res = simulate_recipe(r, wl)
            band = forecast_band(res.recipe, res.slo, wl)
            met = within(covered(real, band) if band else [])
            scored = centre(real, band)
            if scored is not None:
                centres[which].append(scored)
                if i == 0:
                    centres["accumulated"].append(scored)
            for k, (a, b) in met.items():
                t = totals[which].setdefault(k, [0, 0])
                t[0], t[1] = t[0] + a, t[1] + b
            print(f"{name}, band from the {which} drift ({d.describe()}): "
                  + ", ".join(f"{k} {a}/{b}" for k, (a, b) in met.items()), flush=True)
            if i == 0:
                break  # nothing before it: the same drift
        if i == 0:
            for k, v in totals["calibration"].items():
                totals["accumulated"][k] = list(v)
        for x in ("", "-again"):
            ran = os.path.join(args.out, f"{name}-real{x}")
            if os.path.isdir(ran):
                rr = load_run(ran)
                # every variant of a validation runs its model (timing.drift.checked_variants would keep them all)
                factors = run_factors(profile, rr.steps, sorted({s["variant"] for s in rr.steps}))
                drift = merged(drift, factors, str(rr.env.get("time") or ran))
    for which, t in totals.items():
        print(f"within the target of the band from the {which} drift: "
              + ", ".join(f"{k} {a}/{b}" for k, (a, b) in t.items()))
        if centres[which]:
            c = tally([r for x in centres[which] for r in x["rows"]], centres[which])
            print(f"the band's centre (the drift's median) from the {which} drift, within target: "
                  f"{sum(m['within'] for m in c['met'].values())} of {sum(m['of'] for m in c['met'].values())} ("
                  + ", ".join(f"{k} {m['within']}/{m['of']}" for k, m in c["met"].items())
                  + f"); same ranking {c['ranking_same']['recipes']}/{c['ranking_same']['of']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
