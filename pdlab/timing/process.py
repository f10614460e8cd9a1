"""`pdlab profile`'s measuring process: the designed steps run in a spawned process set up as a worker sets
itself up, so the profile times what a worker executes.

Issue 25: the profile measured in the command's own process (torch's thread pool, its own kernel state)
while workers ran pinned to one core with one thread and pdlab's C kernels; on an AVX2 EPYC its prefill
figures were a third of the workers' and nothing noticed. Here the child:

- pins itself and sets its threads with the worker's own functions (pdlab.serve.process.pin_process and
  use_threads: CPU affinity, OMP_NUM_THREADS, CUDA_VISIBLE_DEVICES, one torch thread per core), and dies
  with its parent as a worker does;
- builds an engine exactly as a unified worker does (pdlab.engine.Engine with the default engine config):
  malloc tuning (pdlab.engine.host_malloc), fused projections and the per-machine kernel choice
  (pdlab.engine.kernel_check, the same cache and PDLAB_CPU_KERNEL), and a pool of a worker's size allocated
  as its pool is; every case's engine works in slices of that pool (pdlab.timing.measure.PoolSlices);
- reports which kernels it ran (`runner.kernels`), whether malloc tuning took, the device and the steps,
  and what a prefill leaves to the decode steps after it (pdlab.timing.after_prefill).

Parent and child exchange JSON over a pipe (plain data, no pickle). Ctrl-C in the parent ends the child.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional

from pdlab.serve.launch import start_process
from pdlab.timing.pace import measure as measure_pace


class MeasureError(RuntimeError):
    """The measuring process failed (a model that does not load, a device that is not there): one line."""


@dataclass(frozen=True)
class Job:
    """What the child measures, as plain data."""

    model: str
    dtype: str
    device: str  # the device the child uses once pinned: cpu, or cuda:0 (its one visible GPU)
    devices: tuple[str, ...]  # the worker devices it pins to, as a recipe names them: ("cpu:1",), ("cuda:2",)
    visible_gpus: tuple[str, ...]
    host_cores: tuple[int, ...]
    steps: int
    seed: int


def job_for(model: str, dtype: str, device: str, cores: list[int], steps: int, seed: int) -> Job:
    """A CPU profile pins to `cores` (cpu:i each, one torch thread per core, as a worker with those devices);
    a CUDA profile to its GPU, with `cores` as the worker's host cores."""
    if device.startswith("cuda"):
        gpu = device.split(":")[1] if ":" in device else "0"
        return Job(model, dtype, "cuda:0", (f"cuda:{gpu}",), (gpu,), tuple(cores), steps, seed)
    return Job(model, dtype, "cpu", tuple(f"cpu:{c}" for c in cores), (), (), steps, seed)


def measure(job: Job, progress: Optional[Callable[[str], None]] = None) -> dict:
    """Run `job` in a pinned process started as a worker is (pdlab.serve.launch); returns what it measured (see `_measure`). Raises
    MeasureError with the child's one-line reason."""
    recv, send = mp.Pipe(duplex=False)
    proc = start_process(_child, (asdict(job), send), "pdlab-profile", gpus=bool(job.visible_gpus))
    send.close()
    try:
        while True:
            if recv.poll(0.5):
                try:
                    msg = json.loads(recv.recv_bytes())
                except EOFError:
                    raise MeasureError(f"the measuring process ended (exit code {proc.exitcode})") from None
                if msg["kind"] == "progress":
                    if progress:
                        progress(msg["line"])
                elif msg["kind"] == "error":
                    raise MeasureError(msg["error"])
                else:
                    return msg["result"]
            elif not proc.is_alive() and not recv.poll(0):
                raise MeasureError(f"the measuring process ended without a result (exit code {proc.exitcode})")
    finally:
        recv.close()
        if proc.is_alive():
            proc.terminate()
            proc.join(5)
            if proc.is_alive():
                proc.kill()
        proc.join()


def _child(raw: dict, conn: Any) -> None:
    from pdlab.serve.process import die_with_parent, pin_process, use_threads

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's business: it ends us
    die_with_parent()
    job = Job(**{**raw, "devices": tuple(raw["devices"]), "visible_gpus": tuple(raw["visible_gpus"]),
                 "host_cores": tuple(raw["host_cores"])})
    cores = pin_process(job.devices, 1, job.visible_gpus, job.host_cores)
    use_threads(cores)

    def send(kind: str, **kw: Any) -> None:
        conn.send_bytes(json.dumps({"kind": kind, **kw}).encode())

    try:
        result = _measure(job, cores, lambda line: send("progress", line=line))
    except Exception as e:  # noqa: BLE001 - one line to the parent, which reports it
        from pdlab.engine import ModelLoadError

        send("error", error=str(e) if isinstance(e, ModelLoadError) else f"{type(e).__name__}: {e}")
        return
    send("done", result=result)


def _measure(job: Job, cores: list[int], say: Callable[[str], None]) -> dict:
    """In the child: the worker's engine set-up, the designed steps, the transfer probes."""
    import numpy as np
    import torch

    from pdlab.engine import Engine, EngineConfig, load_model
    from pdlab.engine.host_malloc import tune_malloc
    from pdlab.engine.model import model_dims
    from pdlab.timing import after_prefill
    from pdlab.timing.measure import (PRIMER_BLOCKS, Limits, PoolSlices, Primer, describe_device, design,
                                      kv_memory_gb, measure_steps, probe_transfers, warmup_cases)

    model = load_model(job.model, dtype=job.dtype, device=job.device, seed=0)
    dims = model_dims(model)
    cuda = job.device.startswith("cuda")
    threads = torch.get_num_threads()
    where = describe_device(job.device, threads)
    mem_gb = kv_memory_gb(job.device)  # before any pool: what "auto" sizing would see
    lim = Limits.for_device("cuda" if cuda else "cpu", dims["max_model_len"])
    rng = np.random.default_rng(job.seed)
    cases = design(job.steps, lim, rng)
    # the pool a unified worker with the default engine config allocates (larger when a case needs more)
    worker = Engine(model, EngineConfig())
    need = max(2 * c.blocks() + 16
               for c in cases + warmup_cases(lim) + [c for c, _ in after_prefill.cases(lim)]) + PRIMER_BLOCKS
    if worker.blocks.num_blocks < need:
        del worker
        worker = Engine(model, EngineConfig(kv_blocks=need))
    kernels = {n: c.to_dict() for n, c in getattr(worker.runner, "kernels", {}).items()}
    say(f"measuring in a process pinned to {', '.join(job.devices)} ({where}); {len(cases)} cases, about "
        f"{job.steps} steps (prompts/contexts up to {lim.max_context} tokens, up to {lim.max_batch} decodes a step); "
        f"pool {worker.blocks.num_blocks} blocks")
    paces = [] if cuda else [measure_pace()]  # the box's pace (pdlab.timing.pace), before and after the steps
    t0 = last = time.monotonic()

    def progress(done: int, n: int) -> None:
        nonlocal last
        if time.monotonic() - last > 10:
            last = time.monotonic()
            say(f"  {done}/{len(cases)} cases, {n} steps, {last - t0:.0f} s")

    slices = PoolSlices(worker.kv)
    samples = measure_steps(model, cases, lim, rng, progress, pool=slices)
    took = time.monotonic() - t0
    after = after_prefill.measure_after_prefill(model, lim, rng, pool=slices, primer=Primer(model, rng, pool=slices))
    if not cuda:
        paces.append(measure_pace())
    kv_per_token = worker.block_bytes // worker.config.block_size
    del worker
    transfers = probe_transfers(dims, "cuda" if cuda else "cpu", next(model.parameters()).dtype)
    return {"device": where, "threads": threads, "cores": cores, "pid": os.getpid(), "kv_memory_gb": mem_gb,
            "kv_bytes_per_token": kv_per_token, "kernels": kernels, "malloc_tuned": bool(tune_malloc()),
            "torch": str(torch.__version__), "measured_s": took, "pace_ms": [x.total_ms for x in paces],
            "memory_pace_ms": [x.memory_ms for x in paces],
            "pace_read_mib": paces[0].read_mib if paces else None,
            "case_kinds": [c.kind for c in cases],
            "max_context": lim.max_context, "max_batch": lim.max_batch,
            "steps": [[s.counts.to_dict(), s.ms, s.case, s.cpu_ms] for s in samples], "after_prefill": after,
            "transfers": {k: {**t, "gbps": t["gbps"] if np.isfinite(t["gbps"]) else None}
                          for k, t in transfers.items()}}
