"""The verdict of a diagnosis, in plain words, with the numbers each sentence rests on.

`prefill_interference` when the prefill windows explain at least half of the ITL misses (beyond chance,
pdlab.diagnose.misses) and at least MIN_MISSES misses fell in windows (the share, not the stall tags, decides: a
stall that misses the target may still not stand out from a noisy steady distribution); `not_prefill_stalls`
otherwise (no misses at all included: then none are prefill stalls); `inconclusive` when the data cannot say
(too few gaps outside every window to know the steady ITL, or no isolated prefill window to fit).

The chunk budget suggested is the largest power of two whose stall, by the fitted line, stays within the ITL
target: each step's prefill then holds decodes about that long (chunking spreads one long stall over several
shorter ones). Disaggregation's TTFT cost is the prefill itself plus the KV hand-over, which the client
cannot see: the verdict quotes the probes' measured TTFT and says the hand-over comes on top.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from pdlab.diagnose.fit import Fit, by_length

EXPLAINS = 0.5  # the share of misses the windows must explain
MIN_MISSES = 2
MIN_BUDGET = 16  # the smallest chunk budget suggested; below it the step's own cost dominates
KINDS = ("prefill_interference", "not_prefill_stalls", "inconclusive")


@dataclass(frozen=True)
class Verdict:
    kind: str
    sentences: tuple[str, ...]
    budget: Optional[int] = None  # the chunked-prefill token budget suggested
    budget_stall_ms: Optional[float] = None
    stall_beyond_tokens: Optional[int] = None  # prompts longer than this stall beyond the ITL target

    @property
    def text(self) -> str:
        return " ".join(self.sentences)

    def to_dict(self) -> dict:
        return {"kind": self.kind, "text": self.text, "sentences": list(self.sentences), "budget": self.budget,
                "budget_stall_ms": self.budget_stall_ms, "stall_beyond_tokens": self.stall_beyond_tokens}


def _ms(x: Optional[float]) -> str:
    return "n/a" if x is None else f"{x:.0f} ms" if x >= 10 else f"{x:.1f} ms"


def _share(x: Optional[float]) -> str:
    return "n/a" if x is None else f"{100 * x:.0f}%" if x >= 0.01 or x == 0 else f"{100 * x:.2f}%"


def _budget(fit: Fit, target_ms: float, steady_ms: Optional[float]) -> tuple[Optional[int], Optional[float]]:
    """The largest power-of-two chunk budget whose stall stays within the target, and that stall. A step that
    carries b prefill tokens stalls a decode at least a steady step plus b tokens' prefill at the fitted rate:
    the line, fitted over long prompts, can extrapolate below that to small b (a negative intercept)."""
    line = fit.line
    if line is None or line.slope_ms_per_token <= 0 or fit.flat:
        return None, None

    def stall(b: int) -> float:
        return max(line.at(b), (steady_ms or 0.0) + line.slope_ms_per_token * b)

    top = max(p.prompt_tokens for p in fit.points)
    best = None
    b = MIN_BUDGET
    while b <= top and stall(b) <= target_ms:
        best, b = b, b * 2
    return (best, stall(best)) if best else (None, None)


def _beyond(fit: Fit, target_ms: float) -> Optional[int]:
    line = fit.line
    if line is None or line.slope_ms_per_token <= 0 or fit.flat:
        return None
    if fit.plateau_ms is not None and fit.plateau_ms <= target_ms:
        return None  # the stalls level off within the target
    return max(0, math.ceil((target_ms - line.intercept_ms) / line.slope_ms_per_token))


def judge(itl: dict, misses: dict, fit: Fit, corr: dict, threshold_ok: bool, target_ms: float) -> Verdict:
    if not threshold_ok:
        return Verdict("inconclusive", (f"Inconclusive: only {itl['steady_gaps']} gaps fell outside every prefill "
                                        "window, too few to know what steady decoding looks like; run longer or "
                                        "with more background streams.",))
    if not fit.points:
        return Verdict("inconclusive", ("Inconclusive: no prefill window was alone with a decoding stream, so no "
                                        "stall could be measured against prompt length.",))
    figures = (f"Steady ITL p50 {_ms(itl['steady_itl_p50_ms'])}, p99 {_ms(itl['steady_itl_p99_ms'])}; ITL p99 "
               f"with the probes {_ms(itl['itl_p99_with_probes_ms'])}.")
    explained = misses["explained_share"] or 0.0
    line, rows = fit.line, by_length(fit.points)
    longest = rows[-1]
    if explained >= EXPLAINS and misses["in_windows"] >= MIN_MISSES:
        return _interference(itl, misses, fit, target_ms, figures, longest)
    out = []
    stall_misses = misses["stall_tagged"] >= MIN_MISSES  # stalls that miss exist, but other misses outnumber them
    if misses["misses"]:
        lead = "Most of your ITL misses are not prefill stalls" if stall_misses else \
            "Your ITL misses are not prefill stalls"
        out.append(f"{lead}: {misses['misses']} gaps missed {target_ms:g} ms, "
                   f"{misses['in_windows']} of them in prefill windows, which explain {_share(explained)} beyond "
                   f"chance ({_share(misses['miss_rate_in_windows'])} of gaps in windows missed, "
                   f"{_share(misses['miss_rate_outside'])} outside).")
        if itl["steady_itl_p99_ms"] is not None and itl["steady_itl_p99_ms"] > target_ms:
            out.append(f"Decoding alone misses: the steady ITL p99 ({_ms(itl['steady_itl_p99_ms'])}) is over the "
                       "target.")
        if corr["r"] is not None and corr["correlated"]:
            out.append(f"The misses outside windows follow {corr['with']} (r = {corr['r']:+.2f}).")
        else:
            r = "it did not vary" if corr["r"] is None else f"r = {corr['r']:+.2f}"
            out.append(f"They follow neither prefill windows nor {corr['with']} ({r}): nothing the client can "
                       "measure explains them.")
    else:
        out.append(f"Your ITL misses are not prefill stalls: no gap missed the {target_ms:g} ms target.")
    worst = max(p.stall_ms for p in fit.points)
    stalled = sum(p.stalled for p in fit.points)
    out.append(f"{'Prefill stalls come on top: the' if stall_misses else 'The'} probes' prefills (up to "
               f"{longest['prompt_tokens']} tokens) stalled decodes in {stalled} of {len(fit.points)} windows; the "
               f"longest gap beside one was {_ms(worst)}.")
    beyond = _beyond(fit, target_ms) if stalled >= MIN_MISSES else None
    if beyond is not None and line is not None:
        shortest = min(p.prompt_tokens for p in fit.points)
        which = f"prompts longer than about {beyond} tokens stall" if beyond > shortest else \
            f"every prompt from {shortest} tokens on stalls"
        out.append(f"By the fit ({_ms(line.per_1k_ms)} per 1k prompt tokens), {which} decodes beyond your "
                   "target.")
    out.append(figures)
    return Verdict("not_prefill_stalls", tuple(out), stall_beyond_tokens=beyond)


def _interference(itl: dict, misses: dict, fit: Fit, target_ms: float, figures: str, longest: dict) -> Verdict:
    line = fit.line
    out = [f"Prefill interference explains {_share(misses['explained_share'])} of ITL misses: {misses['in_windows']} "
           f"of the {misses['misses']} gaps over {target_ms:g} ms fell in prefill windows "
           f"({_share(misses['miss_rate_in_windows'])} of gaps in windows missed, "
           f"{_share(misses['miss_rate_outside'])} outside)."]
    beyond = _beyond(fit, target_ms)
    budget, budget_ms = _budget(fit, target_ms, itl["steady_itl_p50_ms"])
    if fit.flat:
        out.append(f"Stalls do not grow with prompt length: about {_ms(fit.plateau_ms)} from "
                   f"{min(p.prompt_tokens for p in fit.points)} to {longest['prompt_tokens']} tokens; the server seems "
                   "to split prefills into chunks of a fixed budget already, and each chunk stalls decodes that long.")
        budget = budget_ms = beyond = None
    elif line is not None and line.slope_ms_per_token > 0:
        r2 = "" if line.r2 is None else f", R² {line.r2:.2f}"
        if beyond is not None:
            shortest = min(p.prompt_tokens for p in fit.points)
            lead = (f"Prompts longer than about {beyond} tokens stall decodes beyond your ITL target" if beyond
                    > shortest else f"Every prompt stalls decodes beyond your ITL target, even {shortest} tokens")
            out.append(f"{lead} (stall about {_ms(line.intercept_ms)} + {_ms(line.per_1k_ms)} per 1k prompt "
                       f"tokens{r2}, {line.n} probes).")
        if fit.levels_off_from is not None:
            out.append(f"Stalls stop growing from {fit.levels_off_from} tokens, at about {_ms(fit.plateau_ms)}: the "
                       "server seems to split long prefills already (chunked prefill).")
        if budget is not None:
            out.append(f"A chunked-prefill token budget of {budget} would cap a stall at about {_ms(budget_ms)} "
                       "(from the fit), at the price of more steps per prompt and a longer TTFT.")
        else:
            out.append(f"No chunked-prefill budget of {MIN_BUDGET} tokens or more keeps a stall within "
                       f"{target_ms:g} ms by the fit: chunking alone will not meet the target.")
    prefill = ""
    if line is not None and line.slope_ms_per_token > 0 and not fit.flat:
        prefill = f" (about {_ms(line.slope_ms_per_token * longest['prompt_tokens'])} of prefill by the fit)"
    out.append(f"Disaggregation would remove these stalls at a TTFT cost of about the prefill time plus a KV "
               f"hand-over: here a {longest['prompt_tokens']}-token prompt's TTFT is {_ms(longest['ttft_ms_p50'])}"
               f"{prefill}; the hand-over, which the client cannot see, comes on top.")
    out.append(figures)
    return Verdict("prefill_interference", tuple(out), budget, budget_ms, beyond)
