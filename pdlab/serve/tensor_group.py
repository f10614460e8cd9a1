"""A tensor-parallel worker group: the worker process is rank 0 and starts ranks 1..tp-1 ("followers").

Rank 0 owns the engine (scheduler, block manager, sockets); a follower owns a model shard and its slice of
the paged KV pool and runs the forward pass rank 0 describes (pdlab.engine.tensor_parallel). The group meets
through a torch.distributed FileStore in a private directory (no port, nothing reachable from outside);
NCCL runs the model's all-reduces on CUDA, gloo on CPU and always for the step broadcast.

Ends cleanly on every path: rank 0 sends STOP and joins its followers (killing any that hang); a follower
whose rank 0 dies gets SIGTERM from the kernel (PR_SET_PDEATHSIG) or an error from its next collective; a
rank 0 whose follower dies gets an error from its next collective, reports Fatal and exits, as any worker.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from typing import Any

from pdlab.constants import STEP_TIMEOUT_S, STOP_TIMEOUT_S, TP_TRANSPORTS
from pdlab.engine import load_model
from pdlab.engine.model import model_config, model_dims
from pdlab.gpus import rank_device
from pdlab.serve.process import die_with_parent


def _init(rank: int, world: int, store_dir: str, cuda: bool, timeout_s: float) -> Any:
    """Join the group (the default process group carries the model's all-reduces); returns the control
    group for the step broadcast (None on CPU: the default group, gloo, serves)."""
    # deferred: torch
    import torch.distributed as dist

    store = dist.FileStore(os.path.join(store_dir, "store"), world)
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    return dist.new_group(backend="gloo", timeout=timeout) if cuda else None


def _device(spec: Any, rank: int) -> str:
    return rank_device(spec.visible_gpus, rank)  # the launcher lists a worker's own GPUs first, in rank order


def _load(spec: Any, rank: int, fast: Any = None) -> Any:
    # deferred: torch
    from pdlab.engine.tensor_parallel import shard_model

    model = load_model(spec.model, device=_device(spec, rank), seed=spec.seed)  # same seed: the same weights
    return shard_model(model, rank, spec.tp, fast_reduce=fast)


def _fast_reduce(spec: Any, rank: int, alive: Any) -> Any:
    """CPU ranks of one host: the shared-memory all-reduce, sized for the largest step (token budget rows of
    the hidden state in float32); None where it does not apply (CUDA: NCCL; not x86-64)."""
    # deferred: torch
    from pdlab.engine import shm_allreduce

    if spec.visible_gpus or not shm_allreduce.available():
        return None

    cfg = model_config(spec.model)
    rows = max(spec.engine.token_budget, spec.engine.max_running)
    return shm_allreduce.ShmAllReduce(f"{spec.run_prefix}{spec.name}-allreduce", rank, spec.tp,
                                      rows * cfg.hidden_size * 4, create=rank == 0, alive=alive,
                                      timeout_s=STEP_TIMEOUT_S)


class TensorGroup:
    """Rank 0's side: start the followers, join the group, shard the model, close."""

    def __init__(self, spec: Any):
        # deferred: numpy
        from pdlab.serve.spec import WorkerSpec

        self.spec = spec
        # named with the run's prefix: the cluster removes it even when this worker is killed
        self.store_dir = tempfile.mkdtemp(prefix=f"{spec.run_prefix}{spec.name}-tp-")
        self.procs: list = []
        self.fast = _fast_reduce(spec, 0, lambda: all(p.poll() is None for p in self.procs))  # before the followers
        # subprocesses, not multiprocessing children: the worker is itself a daemonic multiprocessing child
        raw = json.dumps(WorkerSpec.to_raw(spec))
        cuda = bool(spec.visible_gpus)
        for r in range(1, spec.tp):
            p = subprocess.Popen([sys.executable, "-m", "pdlab.serve.tensor_group", str(r), self.store_dir],
                                 stdin=subprocess.PIPE, text=True)
            p.stdin.write(raw)
            p.stdin.close()
            self.procs.append(p)
        control = _init(0, spec.tp, self.store_dir, cuda, STEP_TIMEOUT_S)
        # deferred: torch
        from pdlab.engine.tensor_parallel import StepChannel

        self.channel = StepChannel(control)

    def load(self) -> Any:
        return _load(self.spec, 0, self.fast)

    def start(self, num_blocks: int) -> None:
        """Tell the followers the pool size rank 0's engine chose (they allocate the same block count) and
        wait until every shard exists."""
        # deferred: torch
        from pdlab.engine.tensor_parallel import OP_STEP

        self.channel.send(OP_STEP, num_blocks.to_bytes(8, "little"))
        self.channel.barrier()

    def export(self, transport: Any, pool: Any) -> dict:
        """The group's pool handle for peers: rank 0's shard handle, then each follower's shard as this
        process mapped it (shm: its segment; nixl: registered with rank 0's agent), so a peer can re-slice
        heads across groups of different sizes (pdlab.kv.sharded)."""
        for t in pool.shards[1:]:  # every shard first: a NIXL agent's metadata must list them all
            transport.adopt(t)
        own = transport.export()
        shards = [own] + [transport.export_shard(t, shard_segment(self.spec, r)) for r, t in enumerate(pool.shards[1:], 1)]
        return {"kind": "sharded", "name": f"{own['name']}-group", "kv_heads": pool.kv_heads, "shards": shards}

    def pool(self, own: Any, kv_heads: int) -> Any:
        """This group's pool as rank 0 copies into or out of it: its own shard and the followers' mapped."""
        # deferred: torch
        from pdlab.kv import shm
        from pdlab.kv.sharded import ShardedPool

        self._mapped = [shm.attach(shard_segment(self.spec, r), list(own.shape), own.dtype)
                        for r in range(1, self.spec.tp)]
        return ShardedPool([own] + [x.tensor for x in self._mapped], kv_heads)

    def close(self) -> None:
        # deferred: torch
        from pdlab.engine.tensor_parallel import OP_STOP

        alive = all(p.poll() is None for p in self.procs)
        if alive:
            try:
                self.channel.send(OP_STOP)
            except Exception:  # noqa: BLE001 - a follower died: the kill below ends the others
                pass
        for p in self.procs:  # every follower is waited for: no zombie, no orphan
            try:
                p.wait(STOP_TIMEOUT_S / 2 if alive else 0.5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(STOP_TIMEOUT_S)
        try:
            # deferred: torch
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass
        shutil.rmtree(self.store_dir, ignore_errors=True)
        if self.fast is not None:
            self.fast.close()


SHARD_IN_SHM = TP_TRANSPORTS["cpu"]  # rank 0 maps its followers' shards from /dev/shm for these hand-overs


def shard_segment(spec: Any, rank: int) -> str:
    """The shared-memory segment of a follower's KV shard (a disaggregated role with transport shm)."""
    return f"{spec.run_prefix}{spec.name}-kv-r{rank}"


def run_follower(spec_raw: dict, rank: int, store_dir: str) -> None:
    """Process entry of rank `rank` (spawned by rank 0): pin, join, load a shard, follow steps until STOP."""
    # deferred: numpy
    from pdlab.serve.spec import WorkerSpec

    spec = WorkerSpec.from_raw(spec_raw)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent()
    dev = spec.devices[rank]
    if spec.visible_gpus:
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(spec.visible_gpus)
    else:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        os.sched_setaffinity(0, [int(dev.split(":")[1])])
        os.environ["OMP_NUM_THREADS"] = "1"
    # deferred: torch
    import torch

    from pdlab.engine.runner import ModelRunner
    from pdlab.engine.tensor_parallel import OP_STEP, StepChannel, read_step

    if not spec.visible_gpus:
        torch.set_num_threads(1)
    control = _init(rank, spec.tp, store_dir, bool(spec.visible_gpus), STEP_TIMEOUT_S)
    channel = StepChannel(control)
    parent = os.getppid()
    fast = _fast_reduce(spec, rank, lambda: os.getppid() == parent)
    model = _load(spec, rank, fast)
    dims = model_dims(model)
    op, payload = channel.recv()  # rank 0's engine chose the pool size
    if op != OP_STEP:
        return
    blocks = int.from_bytes(payload, "little")
    param = next(model.parameters())
    shape = (dims["layers"], 2, blocks, spec.engine.block_size, dims["kv_heads"], dims["head_dim"])
    alloc = None
    if spec.role != "unified" and spec.transport in SHARD_IN_SHM:  # rank 0 hands this shard over: /dev/shm
        # deferred: torch
        from pdlab.kv.shm import ShmAllocator

        alloc = ShmAllocator(shard_segment(spec, rank))
        kv = alloc(shape, param.dtype)
        kv.zero_()
    else:
        kv = torch.zeros(shape, dtype=param.dtype, device=param.device)
    try:
        channel.barrier()
        runner = ModelRunner(model, kv, spec.engine.block_size)
        while True:
            op, payload = channel.recv()
            if op != OP_STEP:
                break
            seqs, ns, ds = read_step(payload)
            ids, pos, ctx, _ = runner.prepare(seqs, ns, ds)
            runner.forward(ids, pos, ctx, [])  # rank 0 samples
        # deferred: torch
        import torch.distributed as dist

        dist.destroy_process_group()
    finally:
        if alloc is not None and alloc.segment is not None:
            alloc.segment.unlink()


if __name__ == "__main__":
    run_follower(json.load(sys.stdin), int(sys.argv[1]), sys.argv[2])
