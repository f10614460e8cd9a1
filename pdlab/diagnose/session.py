"""One online diagnosis from the caller's thread: the client loop (pdlab.external.loop) started, the endpoint
checked, the plan made and shown, the phases run, and what was measured handed back, whether the plan ran
to its end, a cap cut it short, or Ctrl-C did.

Ctrl-C (KeyboardInterrupt in the waiting thread) asks the runner on the loop to stop: no request is sent
after it, every stream is cut, and the records so far come back marked partial.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from pdlab.constants import ENDPOINT_PROBE_TIMEOUT_S
from pdlab.diagnose.connect import EndpointSpec, Target, connect
from pdlab.diagnose.phases import Runner
from pdlab.diagnose.plan import Options, Plan, build_plan, render
from pdlab.external.loop import ClientLoop

STOP_WAIT_S = 15.0  # Ctrl-C: how long the streams may take to be cut and their records settled
INTERRUPTED = "interrupted (Ctrl-C): nothing was sent after it"


@dataclass(frozen=True)
class Measured:
    target: Target
    plan: Plan
    records: tuple[dict, ...]
    phases: dict  # phase -> [start, end] (time.monotonic())
    sent: dict  # the gate's counts (requests, tokens, most in flight, by kind)
    load: Optional[dict]  # the server's /metrics samples
    partial: Optional[str]  # why it was cut short; None: the plan ran to its end
    skipped: Optional[str]  # why longer probes were skipped
    interrupted: bool


def measure(opts: Options, show: Callable[[str], None]) -> Measured:
    """Raises DiagnoseError (connect) or PlanError (the server's limit leaves no probe) before anything is
    measured; KeyboardInterrupt only while connecting."""

    loop = ClientLoop("diagnose", opts.caps.duration_s)
    loop.start()
    try:
        target = loop.call(connect(loop.session, EndpointSpec(opts.url, opts.model, opts.api_key_env)),
                           4 * ENDPOINT_PROBE_TIMEOUT_S)
        plan = build_plan(opts, target.max_model_len)
        show(render(plan))
        runner = Runner(plan, target, loop.session)
        done = loop.submit(runner.run())
        interrupted = False
        try:
            done.result()
        except KeyboardInterrupt:
            interrupted = True
            show("pdlab diagnose: Ctrl-C: stopping; what was measured is kept")
            loop.call(runner.stop(INTERRUPTED), STOP_WAIT_S)
            done.result(STOP_WAIT_S)
        phases = {k: list(v) for k, v in runner.phases.items()}
        return Measured(target, plan, tuple(s.record() for s in runner.sent), phases, runner.budget.to_dict(),
                        runner.load.to_dict() if runner.load else None, runner.partial, runner.skipped, interrupted)
    finally:
        loop.close()
