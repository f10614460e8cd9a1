"""Every list of names and every default that more than one module needs, in one place.

Recipe keys keep their defaults on their dataclass fields (pdlab.recipe); the defaults here are the ones
those fields and the process plumbing share. Nothing here imports anything, so any module may use it.
"""

from __future__ import annotations

# ---- names ----
ROLES = ("unified", "prefill", "decode")
DEPLOYMENT_KINDS = ("unified", "disagg")
TRANSPORTS = ("shm", "cuda-ipc", "host", "nixl")  # nixl: with the optional extra pdlab[nixl]
# the pools each transport moves, by device kind (host: a private pool beside a shared mirror, on CPU too)
TRANSPORT_DEVICES = {"shm": ("cpu",), "cuda-ipc": ("cuda",), "host": ("cpu", "cuda"), "nixl": ("cpu", "cuda")}
# Transports that hand KV over between tensor-parallel workers, by device kind (pdlab.kv.sharded; CPU groups'
# followers keep their shards in /dev/shm for rank 0, pdlab.serve.tensor_group)
TP_TRANSPORTS = {"cpu": ("shm", "nixl"), "cuda": ()}
MODES = ("pull", "push")
# NIXL (pdlab.kv.nixl): the backends an agent creates, and UCX_TLS. "auto" picks what works on the machine
# (pdlab.recipe.nixl.resolve_ucx_tls): tcp,sm,self on a CPU box (checked: UCX's own default failed there to
# create the backend), plus rc,ud where RDMA devices exist and cuda_copy,cuda_ipc for GPU pools.
NIXL_BACKENDS = ("UCX",)
NIXL_UCX_TLS = "auto"
NIXL_UCX_TLS_BASE = "tcp,sm,self"
NIXL_MODULES = ("nixl", "nixl_cu12", "nixl_cu13")  # "nixl": the meta package, picks by torch's CUDA
FIRST_TOKEN_FROM = ("decode", "prefill")
# what a disaggregated deployment does with a request whose KV hand-over failed or timed out (vLLM's
# kv_load_failure_policy): fail it with the reason, or prefill it again on its decode worker
TRANSFER_FAILURE_POLICIES = ("fail", "recompute")
TRANSFER_FAILURE_POLICY = "fail"
# where a request's prompt was prefilled (requests.jsonl `prefill_route`): on a unified worker, on a prefill
# worker and handed over, on its decode worker by choice (selective disaggregation), or on its decode worker
# again after a failed hand-over
PREFILL_ROUTES = ("unified", "remote", "local", "recompute")
REMOTE_PREFILL_MIN_TOKENS = 0  # route: prefill remotely from this many uncached prompt tokens (0: always)
# testing only: inject a fault into every (or every n-th) KV hand-over a decode worker receives, whatever the
# transport; PDLAB_KV_FAULT=drop|delay|corrupt[:n] (pdlab.kv.faults)
KV_FAULT_ENV = "PDLAB_KV_FAULT"
# POSIX shared memory: pdlab's segments (pdlab.kv.shm) and what external servers leave (pdlab.external.server)
SHM_DIR = "/dev/shm"
# "0": a CPU engine leaves glibc malloc as it is (pdlab.engine.host_malloc)
MALLOC_TUNE_ENV = "PDLAB_MALLOC_TUNE"
KV_FAULT_KINDS = ("drop", "delay", "corrupt")
STATS = ("mean", "p50", "p90", "p99", "max")  # latency statistics, and the per-request ITL statistic
MISS_KINDS = ("ttft_only", "itl_only", "both", "failed")
ARRIVAL_KINDS = ("poisson", "gamma", "constant", "burst")
LENGTH_KINDS = ("fixed", "uniform", "dataset", "mixture")
# production trace formats a workload replays (workload.trace.format; pdlab.traces has one reader each), and
# the rate in `rates` that replays a trace at its own pace (its timestamps times trace.time_scale)
TRACE_FORMATS = ("mooncake", "azure", "burstgpt", "jsonl")
TRACE_RATE = "trace"
# flash-attn's paged KV (pdlab.engine.cuda_attention) takes pages of a multiple of this many tokens
FLASH_PAGE_MULTIPLE = 256
# dtype aliases a recipe or the CLI may use -> the torch dtype name ("auto": the checkpoint's own)
# engine backends: pdlab's own engine, an external server pdlab starts (vllm), or a running OpenAI-compatible
# server pdlab only measures (endpoint); pdlab.external
ENGINE_BACKENDS = ("pdlab", "vllm", "endpoint")
EXTERNAL_BACKENDS = ("vllm", "endpoint")
# an endpoint deployment's `kind` as a recipe may write it -> Deployment.kind
ENDPOINT_KINDS = {"unified": "unified", "disaggregated": "disagg", "disagg": "disagg"}
ENDPOINT_PROBE_TIMEOUT_S = 30.0  # /v1/models and the one tiny completion checked before measuring an endpoint
CLIENT_CONNECT_TIMEOUT_S = 10.0  # the HTTP client's connect timeout (its read timeout: deployment.step_timeout_s)
# PDLAB_ARRIVAL_STAMPS: how the HTTP client stamps a chunk (pdlab.external.arrival; benchmarks/bench_client.py
# compares them): 1 (default) when the kernel received it where the kernel notes that, else when its socket was
# first seen readable; `peek` the latter alone; 0 when its stream takes it, as `vllm bench serve` does
ARRIVAL_STAMPS_ENV = "PDLAB_ARRIVAL_STAMPS"
VLLM_PYTHON = ".venv-vllm/bin/python"  # scripts/vllm-env.sh creates it; relative paths are from the cwd
VLLM_KV_CACHE_GB = 2.0  # VLLM_CPU_KVCACHE_SPACE per CPU server (GiB)
SERVED_MODEL_NAME = "pdlab"  # the name pdlab's client asks an external server for
# pdlab serve (pdlab.api): an OpenAI-compatible server in front of one variant's deployment
SERVE_HOST = "127.0.0.1"  # loopback unless --host says otherwise (which warns)
SERVE_PORT = 8000
SERVE_BACKENDS = ("pdlab", "vllm")  # engine backends it can put behind its API (an endpoint already is one)
API_KEY_ENV = "PDLAB_API_KEY"  # the API key, when --api-key is not given
SERVE_MAX_BODY_BYTES = 32 * 1024 * 1024  # a request body (a long prompt as token ids is ~7 bytes a token)
MODEL_CACHE_DIR = "runs/models"  # presets saved with save_pretrained for external servers
DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float16": "float16", "fp16": "float16", "auto": "auto"}

# ---- worker processes (pdlab.serve.launch) ----
# What a CPU worker spends its start importing (torch, transformers' model classes, the engine, the hand-over):
# multiprocessing's fork server imports them once per pdlab process and every CPU worker is a fork of it, where
# a spawned worker imported them again (~6 s of one core each on a 2-core box)
WORKER_PRELOAD = ("pdlab.serve.launch", "torch", "transformers.modeling_utils", "pdlab.engine.engine",
                  "pdlab.engine.model", "pdlab.serve.worker", "pdlab.serve.handlers", "pdlab.kv.factory")
# PDLAB_WORKER_START: fork-server (the default: CPU processes fork from the fork server) or spawn (every process
# starts its own interpreter, as GPU processes always do: slower, but it runs sitecustomize and import-time hooks)
WORKER_START_ENV = "PDLAB_WORKER_START"
WORKER_START_MODES = ("fork-server", "spawn")

# ---- timeouts (seconds) ----
TRANSFER_TIMEOUT_S = 30.0  # a KV hand-over (waiting for room included) may take this long
STEP_TIMEOUT_S = 300.0  # one engine step may take this long before its worker is declared hung
HEARTBEAT_S = 0.5  # a worker's heartbeat period
HEARTBEAT_TIMEOUT_S = 5.0  # no heartbeat for this long: the worker is dead or stopped
READY_TIMEOUT_S = 120.0  # workers load their model within this
STOP_TIMEOUT_S = 10.0  # stop(): Stop message, then SIGTERM, then SIGKILL within this
REAP_TIMEOUT_S = 120.0  # stop(): then wait this long more for SIGKILLed workers to be gone (reaped)
SERVER_READY_TIMEOUT_S = 300.0  # an external server (vLLM: 60-75 s on a 2-core box) is healthy within this
STALL_TIMEOUT_S = 300.0  # a run with no event at all for this long is stuck
KERNEL_BUILD_TIMEOUT_S = 120.0  # one CPU kernel's compilation (pdlab.engine.kernel_build)

# ---- CPU kernels (pdlab.engine.cpu_kernel) ----
CPU_KERNELS = ("decode_attention", "prefill_attention", "rotary", "swiglu", "rms_norm")
GEMM_PANEL = 16  # output columns per packed panel of pdlab's GEMM (csrc/gemm.c's PANEL)
# MKL's, oneDNN's or pdlab's packed GEMM for the linears (pdlab.engine.packed_linear), reported beside the kernels
PACKED_LINEAR = "packed_linear"
# PDLAB_CPU_KERNEL: auto (build, and use each kernel where it timed faster than the torch path it replaces on
# this machine), on (use every kernel that builds and applies, untimed) or off (torch only)
CPU_KERNEL_ENV = "PDLAB_CPU_KERNEL"
CPU_KERNEL_MODES = ("auto", "on", "off")
# PDLAB_KERNEL_MARCH: the -march target of the process's kernel build (default native); x86-64-v3 on an AVX-512
# box stands in for an AVX2-only CPU (benchmarks/bench_vllm_matrix.py --isa). A target this CPU cannot run dies
# with an illegal instruction.
KERNEL_MARCH_ENV = "PDLAB_KERNEL_MARCH"
SERVE_SHUTDOWN_TIMEOUT_S = 60.0  # pdlab serve: SIGTERM lets requests in flight finish this long, then cancels

# ---- timing profiles (pdlab.timing): when a profile's step model is said not to fit ----
PROFILE_CHECK_MAPE_PCT = 15.0  # pdlab profile --check / a run's last line: a kind of step predicted worse than this
# a step that starts this long after its worker's last one ended is a cold step (pdlab.timing.contention): its
# weights and KV were evicted by the other workers' steps, or its core slept, while it waited
COLD_AFTER_MS = 20.0
# The probability levels of a decode step's spread around its model (pdlab.timing.contention): a profile keeps
# the quantiles of measured / predicted there, over their median; the simulator draws each decode step from
# them. Dense in the tail, where a request's p99 ITL takes its steps from.
SPREAD_LEVELS = (0.01, 0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.98, 0.99)
# A profile's drift (pdlab.timing.drift): each worker's pace against the profile in each rate and repeat of the
# runs checked with `pdlab profile --check RUN --write-drift`. A simulation from it gives a band (pdlab.sim.band):
# the recipe again with every worker at the pace at each of DRIFT_LEVELS; fewer than DRIFT_MIN_FACTORS paces give
# none, and a profile keeps the DRIFT_KEEP latest.
DRIFT_LEVELS = (0.05, 0.95)
DRIFT_MIN_FACTORS = 4
DRIFT_KEEP = 256
# A decode worker whose running batch reached this share of engine.max_running in a rate is near its slot cliff
# (pdlab.measure.slots): past it, admitted requests wait for a slot and that wait is their first ITL gap
SLOTS_NEAR = 0.9
# a run's pace this far from its profile's (pdlab.timing.pace) is named in profile-check warnings; a drift's median
# this far from 1 gets a note under a forecast's band (pdlab.sim.band)
PACE_DRIFT = 0.1
PROFILE_MIN_R2 = 0.9  # pdlab profile: held-out R^2 (overall or of a kind) below this
PROFILE_MAX_P90_PCT = 25.0  # pdlab profile: held-out p90 percentage error above this
# pdlab profile: the box's pace (pdlab.timing.pace) after the steps this far from before them: the box changed speed
# while measured (on a 2-core AMD EPYC, 2026-12-07: x0.74-1.38 in four profiles whose held-out MAPE was 12-18%)
PROFILE_PACE_MOVED = 0.15

# ---- nodes: `pdlab worker` on another machine (pdlab.serve.agent), the control plane on TCP (pdlab.serve.curve) ----
JOIN_TIMEOUT_S = 120.0  # a run waits this long for the nodes its workers are placed on (control.join_timeout_s)
NODE_IDENTITY = "node:"  # an agent's identity on the router's socket is this plus its node name
# a cluster's CurveZMQ keys (`pdlab keys init DIR`): ZeroMQ certificate files, the *_secret ones hold the secret
# key too; the router serves with `server`, agents and workers connect with `client`
KEY_FILES = ("server.key", "server.key_secret", "client.key", "client.key_secret")
KEY_DIR_MODE, KEY_FILE_MODE = 0o700, 0o600  # readable by the owner only; looser keys are refused, as ssh does
ZAP_DOMAIN = "pdlab"  # ZeroMQ's authentication domain of the control plane
PEER_PROBE_SIZES = (64 * 1024, 1024 * 1024, 16 * 1024 * 1024, 64 * 1024 * 1024)  # doctor --peer, bytes per copy


def cdiv(a: int, b: int) -> int:
    """Ceiling division: blocks needed for `a` tokens at `b` tokens per block."""
    return -(-a // b)
