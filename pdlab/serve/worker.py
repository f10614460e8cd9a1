"""A worker process: one engine (role unified, prefill or decode) on its own devices, behind a socket.

Started with the spawn method by the launcher. It pins itself to its devices *before* torch touches
them (CUDA_VISIBLE_DEVICES; CPU affinity and a matching thread count), loads the model once, reports
`Ready` with its exported pool handle, then loops: take messages, run one engine step, stream tokens,
step and transfer records. A heartbeat thread (own socket) lets the router notice a dead or hung
worker. Nothing here imports torch at module level, so the environment can be set first.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import asdict, dataclass, fields
from typing import Any, Optional

from pdlab.constants import HEARTBEAT_S
from pdlab.engine.config import EngineConfig
from pdlab.recipe.model import ModelSpec
from pdlab.serve import messages as m
from pdlab.serve.curve import connect_as_member


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker process needs, from the variant's typed recipe and the launcher."""

    name: str  # "prefill0", "decode1", "unified0"
    role: str
    devices: tuple[str, ...]  # this worker's devices, e.g. ("cpu:0",) or ("cuda:2",)
    endpoint: str  # the router's socket
    model: ModelSpec
    engine: EngineConfig
    seed: int
    transport: Optional[str]  # disaggregated roles only
    mode: str
    run_prefix: str
    first_token: str
    visible_gpus: tuple[str, ...]  # CUDA_VISIBLE_DEVICES entries (index, UUID, MIG), own GPUs first in rank order
    transfer_timeout_s: float
    heartbeat_s: float = HEARTBEAT_S
    tp: int = 1  # tensor-parallel ranks: this process is rank 0 on devices[0], followers take the rest
    nixl: Optional[dict] = None  # transport nixl: the deployment's nixl section, plain data
    memory_share: float = 1.0  # of each of its GPUs' memory (workers sharing a GPU split it, pdlab.serve.sharing)
    host_cores: tuple[int, ...] = ()  # a GPU worker's host cores (pinned, one torch thread each)
    peers: tuple[str, ...] = ()  # the workers of the other role (cuda-ipc: one pool export each)
    report_cache: bool = False  # decode role, selective routing: report prefix-cache changes (CacheEvents)
    # a tcp:// control plane's member keys (pdlab.serve.curve.ClusterKeys.member): put here by whoever spawns the
    # worker (the launcher, or the agent of its node), in memory; never part of a control message
    curve: Optional[dict] = None

    def to_raw(self) -> dict:
        """Plain data for the spawn arguments: nothing pickled needs pdlab classes."""
        raw = {f.name: getattr(self, f.name) for f in fields(self)}
        raw.update(model=self.model.to_raw(), engine=self.engine.to_raw(), devices=list(self.devices),
                   visible_gpus=list(self.visible_gpus), host_cores=list(self.host_cores), peers=list(self.peers))
        return raw

    @classmethod
    def from_raw(cls, raw: dict) -> "WorkerSpec":
        return cls(**{**raw, "model": ModelSpec.from_raw(raw["model"], "model"),
                      "engine": EngineConfig.from_raw(raw["engine"], "engine"), "devices": tuple(raw["devices"]),
                      "visible_gpus": tuple(str(g) for g in raw["visible_gpus"]),
                      "host_cores": tuple(raw.get("host_cores", ())), "peers": tuple(raw.get("peers", ()))})


def run_worker(spec_dict: dict) -> None:
    """Process entry point (spawn target): plain dict in."""
    spec = WorkerSpec.from_raw(spec_dict)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the main process's business: it stops us
    signal.signal(signal.SIGTERM, _exit_on_signal)  # unwinds: the pool segment is unlinked on the way out
    _die_with_parent()
    Worker(spec, pin_process(spec.devices, spec.tp, spec.visible_gpus, spec.host_cores)).serve()


def pin_process(devices: tuple[str, ...], tp: int = 1, visible_gpus: tuple[str, ...] = (),
                host_cores: tuple[int, ...] = ()) -> list[int]:
    """Pin this process to a worker's devices before torch touches them (CUDA_VISIBLE_DEVICES; CPU affinity
    and a matching OMP thread count); returns its CPU cores, for `use_threads`. Also what `pdlab profile`'s
    measuring process does (pdlab.timing.process), so a profile times steps as a worker runs them."""
    mine = devices[:1] if tp > 1 else devices  # under TP each rank pins to its own device
    cpu_cores = [int(d.split(":")[1]) for d in mine if d.startswith("cpu:")]
    if visible_gpus:
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(visible_gpus)
        if host_cores:  # a GPU worker's host side: its own cores, one thread each (followers inherit)
            cpu_cores = list(host_cores)
            os.sched_setaffinity(0, cpu_cores)
            os.environ["OMP_NUM_THREADS"] = str(len(cpu_cores))
    elif cpu_cores:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        os.sched_setaffinity(0, cpu_cores)
        os.environ["OMP_NUM_THREADS"] = str(len(cpu_cores))
    return cpu_cores


def use_threads(cpu_cores: list[int]) -> None:
    """One torch thread per pinned core (none pinned: torch's default)."""
    if cpu_cores:
        import torch

        torch.set_num_threads(len(cpu_cores))


def _exit_on_signal(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def _die_with_parent() -> None:
    """Ask Linux to SIGTERM us if the main process dies (even by SIGKILL): no orphan workers."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - not Linux: the heartbeat thread's ppid check still ends us
        pass


class Worker:
    def __init__(self, spec: WorkerSpec, cpu_cores: list[int]):
        import zmq

        from pdlab.engine import Engine, load_model
        from pdlab.engine.model import load_stand_in
        from pdlab.gpus import rank_device

        self.spec, self.name, self.role = spec, spec.name, spec.role
        self.parent = os.getppid()
        use_threads(cpu_cores)
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, spec.name.encode())  # the router addresses us by name
        self.sock.setsockopt(zmq.LINGER, 1000)
        connect_as_member(self.sock, spec.curve)
        self.sock.connect(spec.endpoint)
        self.loop_t = time.monotonic()
        self.stopping = threading.Event()
        threading.Thread(target=self._heartbeat, name="pdlab-heartbeat", daemon=True).start()
        self.tp = None
        try:
            device = rank_device(spec.visible_gpus, 0)  # rank 0 of its group
            if spec.tp > 1 and not spec.model.timing:  # a timed engine stands for its whole group alone
                from pdlab.serve.tensor_group import TensorGroup

                self.tp = TensorGroup(spec)
                self.model = self.tp.load()
            else:  # a timed model is not run: its dimensions are enough
                self.model = (load_stand_in(spec.model, device=device) if spec.model.timing else
                              load_model(spec.model, device=device, seed=spec.seed))
            self.transport = None
            kv_alloc = None
            if spec.transport and self.role != "unified":
                from pdlab.kv.factory import make_transport

                self.transport = make_transport(spec.transport, self.name, spec.run_prefix, device, spec.visible_gpus,
                                                {**(spec.nixl or {}), "timeout_s": spec.transfer_timeout_s,
                                                 "peers": spec.peers})
                kv_alloc = self.transport.kv_alloc
            self.engine = Engine(self.model, spec.engine, role=self.role, kv_alloc=kv_alloc,
                                 step_timing=spec.model.timing, tp_channel=self.tp and self.tp.channel,
                                 memory_share=spec.memory_share)
            if self.tp is not None:
                self.tp.start(self.engine.blocks.num_blocks)
        except Exception as e:  # noqa: BLE001 - reported to the router, then this process ends
            self._send(m.Fatal(self.name, f"{type(e).__name__}: {e}"))
            if self.tp is not None:
                self.tp.close()
            raise
        from pdlab.serve.handlers import RoleHandler

        handle, self.pool = None, self.engine.kv  # what hand-overs copy into / out of: the whole group's pool
        if self.transport is not None:
            if self.tp is not None:
                kv_heads = self.model.config.num_key_value_heads or self.model.config.num_attention_heads
                self.pool = self.tp.pool(self.engine.kv, kv_heads)
                handle = self.tp.export(self.transport, self.pool)
            else:
                handle = self.transport.export()
        self.handler = RoleHandler(self)
        fp = {}
        if self.transport is not None:
            from pdlab.kv.fingerprint import KvFingerprint

            fp = KvFingerprint.of(spec.model, self.engine, tp=spec.tp).to_raw()
        kernels = {n: c.to_dict() for n, c in getattr(self.engine.runner, "kernels", {}).items()}
        self._send(m.Ready(self.name, os.getpid(), handle,
                           self.engine.blocks.num_blocks, self.engine.config.block_size, fp, kernels))

    def _send(self, msg: Any) -> None:
        self.sock.send(m.encode(msg))

    def _heartbeat(self) -> None:
        import zmq

        hb = self.ctx.socket(zmq.DEALER)
        hb.setsockopt(zmq.IDENTITY, f"{self.name}#hb".encode())
        hb.setsockopt(zmq.LINGER, 0)
        connect_as_member(hb, self.spec.curve)
        hb.connect(self.spec.endpoint)
        try:
            while not self.stopping.wait(self.spec.heartbeat_s):
                if os.getppid() != self.parent:  # the main process is gone
                    os.kill(os.getpid(), signal.SIGTERM)
                    return
                hb.send(m.encode(m.Heartbeat(self.name, time.monotonic(), self.loop_t)))
        finally:
            hb.close()

    def serve(self) -> None:
        import zmq

        try:
            while True:
                self.loop_t = time.monotonic()
                busy = self.engine.has_work() or self.handler.has_pending()
                if self.sock.poll(0 if busy else 50, zmq.POLLIN):
                    while True:
                        try:
                            frame = self.sock.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        msg = m.decode(frame)
                        if isinstance(msg, m.Stop):
                            return
                        self.handler.handle(msg)
                self.handler.poll_pending()
                if self.engine.has_work():
                    self.handler.step()
        except Exception as e:  # noqa: BLE001
            import traceback

            traceback.print_exc()
            self._send(m.Fatal(self.name, f"{type(e).__name__}: {e}"))
            raise
        finally:
            self.stopping.set()
            if self.tp is not None:
                self.tp.close()
            if self.transport is not None:
                self.handler.close()
                self.transport.close()
            self.sock.close()
            self.ctx.term()

    def stats(self, token: int) -> m.Stats:
        eng = self.engine
        leak = ""
        if not eng.seqs:
            try:
                eng.check_idle()
            except AssertionError as e:
                leak = str(e)
        return m.Stats(self.name, token, eng.blocks.num_free, eng.blocks.num_blocks, eng.num_running,
                       eng.num_waiting, len(eng.seqs), leak)

    def step_record(self, rec: Any) -> None:
        self._send(m.Step(self.name, asdict(rec)))
