"""Is this box the one the recipe was written for? Two checks, each one line in the summary and the run output.

A recipe's rates and SLO are chosen for some machine. On a much slower one (an AVX2-only CPU where the recipe
expected AVX-512, a loaded VM), a fixed rate can be past saturation: queues then grow for the whole run, TTFT
measures how long the run lasted, and a trade the recipe exists to show comes out inverted, with every number
looking normal. So:

1. **One request alone against the recipe's expectation** (`expect: {alone_ttft_ms, tolerance}` in the recipe):
   the calibration's TTFT more than `tolerance` times slower or faster than expected is named.
2. **A fixed rate above saturation**: a grid rate above the variant's measured saturation request rate (the
   all-at-once measurement, mean over repeats), or, without one, at or above what one request alone allows:
   W prefill workers each taking D per prefill serve at most W / D requests per second (M/D/1's rho >= 1).
   A rate search never goes above saturation by construction, so search variants are not checked.

Modelled variants are checked too (their saturation is the model's), but the wording never blames the box.
"""

from __future__ import annotations

import math
from typing import Any, Optional

from pdlab.measure.metrics import as_rate


def alone_finding(alone: Optional[dict], expected_ms: Optional[float], tolerance: float) -> Optional[dict]:
    """The calibration against the recipe's expectation; None when either is missing or they agree."""
    if not alone or not alone["ttft_ms"] or not expected_ms:
        return None
    ratio = alone["ttft_ms"] / expected_ms
    if 1 / tolerance <= ratio <= tolerance:
        return None
    way = "slower" if ratio > 1 else "faster"
    line = (f"the box: one request alone took {alone['ttft_ms']:.0f} ms TTFT, {max(ratio, 1 / ratio):.1f}x {way} "
            f"than the recipe expects ({expected_ms:.0f} ms): its rates and SLO were set for another machine, so "
            "read every figure as this box's" + (" (a slower CPU, e.g. without AVX-512, or a loaded one)"
                                                  if ratio > 1 else ""))
    return {"alone_ttft_ms": alone["ttft_ms"], "expected_ms": expected_ms, "ratio": ratio, "line": line}


def _capacity(vs: dict, alone: Optional[dict], prefill_workers: Optional[int]) -> tuple[Optional[float], str]:
    """The highest request rate a variant sustains: measured at saturation, else W / D from one request alone."""
    sat = vs["saturation"]
    if sat and sat["request_throughput"]["mean"]:
        return sat["request_throughput"]["mean"], "measured saturation"
    if alone and alone["ttft_ms"] and prefill_workers:
        return 1000.0 * prefill_workers / alone["ttft_ms"], (f"{prefill_workers} prefill worker(s) at "
                                                              f"{alone['ttft_ms']:.0f} ms per request alone")
    return None, ""


def over_saturation(variants: dict[str, dict], alone_by_variant: dict[str, dict], calibration: Optional[dict],
                    prefill_workers: dict[str, int], modelled: dict[str, Any]) -> list[dict]:
    """Every (grid variant, finite rate) above what that variant can serve, with the capacity and its source."""
    out = []
    for v, vs in variants.items():
        if vs["mode"] != "grid" or not vs["ran"]:
            continue
        cap, source = _capacity(vs, alone_by_variant.get(v) or calibration, prefill_workers.get(v))
        if cap is None:
            continue
        for tag, x in vs["rates"].items():
            rate = as_rate(tag)
            measured = source == "measured saturation"  # above it; from one request alone, rho >= 1
            if math.isfinite(rate) and (rate > cap if measured else rate >= cap):
                out.append({"variant": v, "rate": rate, "capacity_rps": cap, "source": source,
                            "modelled": v in modelled})
    return out


def over_line(over: list[dict]) -> Optional[str]:
    """One line for all rates above saturation; None when there are none."""
    if not over:
        return None
    parts = [f"{o['variant']} at {o['rate']:g} req/s (serves ~{o['capacity_rps']:.2g}: {o['source']})" for o in over]
    where = "under its timing model" if all(o["modelled"] for o in over) else "here"
    return (f"the box: fixed rates above what the deployment serves {where}: {'; '.join(parts)}; queues grow for the "
            "whole run, so latencies there measure the run's length: add lower rates, or use rates: auto")


CALIBRATION_TOLERANCE = 1.5  # the calibration against a variant's own "alone", same deployment kind and engine


def calibration_check(calibration: Optional[dict], alone_by_variant: dict[str, dict],
                      like_calibration: list[str]) -> list[str]:
    """The calibration (one request alone on one unified worker, at the start: it resolves relative SLOs and
    rates) against what each variant of the same kind measured alone later (`like_calibration`: unified,
    with the calibration's model and engine); a disagreement beyond CALIBRATION_TOLERANCE means one of them ran
    on a disturbed box, and the relative figures rest on the calibration."""
    out = []
    if not calibration:
        return out
    for v in like_calibration:
        own = alone_by_variant.get(v)
        for key, what in (("ttft_ms", "TTFT"), ("itl_ms", "ITL")):
            a, b = (calibration or {}).get(key), (own or {}).get(key)
            if not a or not b or not (math.isfinite(a) and math.isfinite(b)):
                continue
            ratio = b / a
            if 1 / CALIBRATION_TOLERANCE <= ratio <= CALIBRATION_TOLERANCE:
                continue
            out.append(f"the box: {v} measured one request alone at {b:.1f} ms {what}, {max(ratio, 1 / ratio):.1f}x "
                       f"{'slower' if ratio > 1 else 'faster'} than the calibration's {a:.1f} ms on the same kind "
                       "of worker: one of them ran on a disturbed box; relative SLOs and rates rest on the "
                       "calibration")
    return out
