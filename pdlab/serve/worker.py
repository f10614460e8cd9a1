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
import traceback
from dataclasses import asdict
from typing import Any

from pdlab.engine.model import load_stand_in
from pdlab.gpus import rank_device
from pdlab.kv.fingerprint import KvFingerprint
from pdlab.kv.ucx_log import remove_log_dir
from pdlab.serve import messages as m
from pdlab.serve.curve import connect_as_member
from pdlab.serve.process import die_with_parent, exit_on_signal, pin_process, use_threads
from pdlab.serve.spec import WorkerSpec
from pdlab.serve.tensor_group import TensorGroup
from pdlab.timing.pace import measure as measure_pace


def run_worker(spec_dict: dict) -> None:
    """Process entry point (spawn target): plain dict in."""
    spec = WorkerSpec.from_raw(spec_dict)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the main process's business: it stops us
    signal.signal(signal.SIGTERM, exit_on_signal)  # unwinds: the pool segment is unlinked on the way out
    die_with_parent()
    Worker(spec, pin_process(spec.devices, spec.tp, spec.visible_gpus, spec.host_cores)).serve()


class Worker:
    def __init__(self, spec: WorkerSpec, cpu_cores: list[int]):
        # deferred: torch, zmq
        import zmq

        from pdlab.engine import Engine, load_model

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
                self.tp = TensorGroup(spec)
                self.model = self.tp.load()
            else:  # a timed model is not run: its dimensions are enough
                self.model = (load_stand_in(spec.model, device=device) if spec.model.timing else
                              load_model(spec.model, device=device, seed=spec.seed))
            self.transport = None
            kv_alloc = None
            if spec.transport and self.role != "unified":
                # deferred: torch
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
            self.send(m.Fatal(self.name, f"{type(e).__name__}: {e}"))
            if self.tp is not None:
                self.tp.close()
            raise
        # deferred: torch
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
            fp = KvFingerprint.of(spec.model, self.engine, tp=spec.tp).to_raw()
        kernels = {n: c.to_dict() for n, c in getattr(self.engine.runner, "kernels", {}).items()}
        pace = None
        if not spec.model.timing and not spec.visible_gpus:  # a CPU worker running its model
            pace = measure_pace()
        self.send(m.Ready(self.name, os.getpid(), handle,
                           self.engine.blocks.num_blocks, self.engine.config.block_size, fp, kernels,
                           pace.to_raw() if pace else None))

    def send(self, msg: Any) -> None:
        self.sock.send(m.encode(msg))

    def _heartbeat(self) -> None:
        # deferred: zmq
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
        # deferred: zmq
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
            traceback.print_exc()
            self.send(m.Fatal(self.name, f"{type(e).__name__}: {e}"))
            raise
        finally:
            self.stopping.set()
            if self.tp is not None:
                self.tp.close()
            if self.transport is not None:
                self.handler.close()
                self.transport.close()
                remove_log_dir()
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
        self.send(m.Step(self.name, asdict(rec)))
