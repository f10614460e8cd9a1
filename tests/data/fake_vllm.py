"""A stand-in for vLLM's OpenAI API server, for tests that must not need vLLM: /health, /reset_prefix_cache
and /v1/completions (token-id prompts, streamed or not, with vLLM's P/D `kv_transfer_params`).

Its tokens are a deterministic function of the prompt. Behaviour switches (after vLLM's own arguments):
  --fake-exit           print an error and exit 3 at start
  --fake-unhealthy      listen, but /health answers 503 forever
  --fake-port-busy      fail to bind as a server whose port was taken does (errno 98)
  --fake-child          start a child process in the group, as vLLM starts its engine core, that maps
                        /dev/shm/psm_fake_<its pid> and never removes it
  --fake-token-s S      seconds between tokens (default 0.002)
  --fake-chunk K        tokens per streamed chunk (default 1)
Env FAKE_VLLM_PIDS: a file to which it appends its pid (and its child's).
Env FAKE_VLLM_TMP: a file; like vLLM (its ipc:// sockets, its vllm_dist_* files), it then binds a socket
file in the temporary directory (tempfile.gettempdir()) that stays there when it is killed, and appends the
socket's path to that file.
Env FAKE_VLLM_LOG: a file to which it appends one JSON line per completion ({"body": what it was sent}) and
one per stream whose client closed the connection before the end ({"closed": tokens sent before}).
A stream stops after the first token in `stop_token_ids` (finish_reason "stop"), as vLLM's does.
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

p = argparse.ArgumentParser()
p.add_argument("-m")
p.add_argument("--port", type=int, required=True)
p.add_argument("--host", default="127.0.0.1")
p.add_argument("--kv-transfer-config", default=None)
p.add_argument("--fake-exit", action="store_true")
p.add_argument("--fake-unhealthy", action="store_true")
p.add_argument("--fake-port-busy", action="store_true")
p.add_argument("--fake-child", action="store_true")
p.add_argument("--fake-token-s", type=float, default=0.002)
p.add_argument("--fake-chunk", type=int, default=1)
args, _ = p.parse_known_args()
print("fake vLLM starting", flush=True)


def note_pid(pid: int) -> None:
    if os.environ.get("FAKE_VLLM_PIDS"):
        with open(os.environ["FAKE_VLLM_PIDS"], "a") as f:
            f.write(f"{pid}\n")


note_pid(os.getpid())
if os.environ.get("FAKE_VLLM_TMP"):
    # like vLLM's ipc:// sockets and vllm_dist_* files: in the temporary directory, left there when killed
    _sock = socket.socket(socket.AF_UNIX)
    _sock.bind(os.path.join(tempfile.gettempdir(), f"fake_vllm_{uuid.uuid4().hex}"))
    with open(os.environ["FAKE_VLLM_TMP"], "a") as f:
        f.write(f"{_sock.getsockname()}\n")
if args.fake_child:
    # like vLLM's CPU engine core: it maps a shared-memory segment (psm_*) that outlives it when killed
    child = subprocess.Popen([sys.executable, "-c", "import mmap, os, time\n"
                              "f = open('/dev/shm/psm_fake_%d' % os.getpid(), 'w+b'); f.write(bytes(4096)); f.flush()\n"
                              "m = mmap.mmap(f.fileno(), 4096); time.sleep(600)"])
    note_pid(child.pid)
if args.fake_exit:
    print("RuntimeError: Engine core initialization failed (fake)", flush=True)
    sys.exit(3)
if args.fake_port_busy:
    print("ERROR: [Errno 98] error while attempting to bind on address: address already in use", flush=True)
    sys.exit(1)


def tokens(prompt: list, n: int) -> list:
    return [(sum(prompt) * 31 + 7 * i + 3) % 512 for i in range(n)]


def log(entry: dict) -> None:
    if os.environ.get("FAKE_VLLM_LOG"):
        with open(os.environ["FAKE_VLLM_LOG"], "a") as f:
            f.write(json.dumps(entry) + "\n")


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def _json(self, code: int, obj: dict) -> None:
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/health":
            return self._json(503 if args.fake_unhealthy else 200, {})
        self._json(404, {"error": "not found"})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        if self.path == "/reset_prefix_cache":
            return self._json(200, {})
        if self.path != "/v1/completions":
            return self._json(404, {"error": "not found"})
        log({"body": body})
        prompt, n = body["prompt"], body["max_tokens"]
        kv = body.get("kv_transfer_params") or {}
        if kv.get("do_remote_prefill") and kv.get("remote_engine_id") != "fake-prefill":
            return self._json(400, {"error": "bad kv_transfer_params"})
        out = tokens(prompt, n)
        stops = set(body.get("stop_token_ids") or [])
        stop_at = next((i for i, t in enumerate(out) if t in stops), None)
        if stop_at is not None:
            out = out[:stop_at + 1]
        reason = "length" if stop_at is None else "stop"
        if not body.get("stream"):
            reply = {"choices": [{"index": 0, "text": "", "token_ids": out, "finish_reason": reason}]}
            if kv.get("do_remote_decode"):
                reply["kv_transfer_params"] = {"do_remote_prefill": True, "do_remote_decode": False,
                                               "remote_engine_id": "fake-prefill", "remote_block_ids": [0],
                                               "remote_host": "127.0.0.1", "remote_port": 1}
            return self._json(200, reply)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

        def send(obj) -> None:
            line = f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode()
            self.wfile.write(f"{len(line):x}\r\n".encode() + line + b"\r\n")
            self.wfile.flush()

        k = max(1, args.fake_chunk)
        try:
            for i in range(0, len(out), k):
                time.sleep(args.fake_token_s)
                last = i + k >= len(out)
                send({"choices": [{"index": 0, "text": "", "token_ids": out[i:i + k],
                                   "finish_reason": reason if last else None}]})
            send({"choices": [], "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(out)}})
            send("[DONE]")
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):  # the client closed the stream: vLLM aborts the request
            log({"closed": i})
            self.close_connection = True


srv = ThreadingHTTPServer((args.host, args.port), Handler)
srv.daemon_threads = True
srv.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
print(f"fake vLLM listening on {args.host}:{args.port}", flush=True)
srv.serve_forever()
