"""Timing profiles from measurement (`pdlab profile`): measure the real engine's steps, fit the step model.

- `pdlab.timing.fit`: non-negative least squares (numpy only), the step-model fit and its held-out errors,
  the transfer fit (latency + bytes / bandwidth).
- `pdlab.timing.measure`: a designed set of engine steps (prefill-only, decode-only, mixed) run in this
  process, each with the counts `pdlab.engine.timed.step_counts` gives and its measured time; transfer
  probes at several sizes.
- `pdlab.timing.write`: the profile as YAML, loadable by `pdlab.recipe.load_profile`.

The profile format itself (TimingProfile, StepTiming, TransferTiming) is `pdlab.recipe.timing`.
"""
