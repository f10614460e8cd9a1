"""Building pdlab's CPU kernels (csrc/<name>.c) into shared objects, once per machine.

Why plain C and the system compiler: no torch headers, so a build takes about a second with `cc` (or $CC) and
needs neither ninja nor a matching torch build (pdlab.engine.cpu_kernel loads the result with ctypes).

The cache: $PDLAB_KERNEL_CACHE (default ~/.cache/pdlab/kernels), one file per kernel keyed by its source and
headers, the flags, the compiler's identity and the CPU's feature flags. Workers starting together take a
file lock around the build, so a kernel is compiled once, not once per worker; the compiler writes to a
temporary name that is renamed into place, and a temporary left by a build that was killed is removed by the
next build (under the lock nobody else is compiling). The compiler's identity (`cc --version`) is asked once
per process, and not at all on a cache hit of the same process.

The kernels that split a call over threads (THREADED: the GEMM by panels, decode attention by requests, prefill
attention by blocks of positions) build with `-fopenmp` where the compiler can, and without it where it cannot
(their parts then run one after another, with the same bits). Their OpenMP runtime is torch's: the build links
`libgomp.so.1`, and a process that imported torch already holds torch's copy under that name, so the loader
hands over that one and the parallel regions run on torch's own intra-op threads, with nothing spinning against
them (pdlab.engine.cpu_threads checks that the process holds one OpenMP runtime, not two, before it splits).

Every kernel builds as C11 (`-std=c11`) with warnings on; the tests build with `-Werror` and for more than
one target (`-march=native`, and `x86-64-v3`, the AVX2 path, where this CPU can run it). The engine's build is
native unless $PDLAB_KERNEL_MARCH names another target (`process_march()`): `x86-64-v3` on an AVX-512 box stands in
for an AVX2-only CPU in benchmarks.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import hashlib
import os
import platform
import shutil
import subprocess
from typing import Iterator, Optional

from pdlab.constants import KERNEL_BUILD_TIMEOUT_S, KERNEL_MARCH_ENV

CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
# -Wno-psabi: GCC notes that a 64-byte vector argument changes the ABI without AVX-512; every such function is
# static inline, so no call crosses an ABI boundary.
COMMON = ["-std=c11", "-O3", "-fPIC", "-shared", "-Wall", "-Wextra", "-Wno-psabi"]
# Associative float math (not -ffast-math: with GCC < 13 that links crtfastmath into a shared object, which turns
# on flush-to-zero for the whole process) lets the attention's dot products over head_dim vectorise. The rotary
# kernel must round as torch does: no reassociation, no fused multiply-add.
REASSOCIATE = ["-fno-math-errno", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math"]
FLAGS = {"decode_attention": REASSOCIATE, "prefill_attention": REASSOCIATE, "rotary": ["-ffp-contract=off"],
         "swiglu": REASSOCIATE, "rms_norm": REASSOCIATE,
         "gemm": []}  # sums in order, one fused multiply-add a term (its intrinsics, or fmaf): no reassociation
THREADED = ("gemm", "decode_attention", "prefill_attention")  # their calls take a number of parts (threads)
OPENMP = ["-fopenmp"]
TMP_MARK = ".tmp-"  # in the name of a file being written
FAILED = ".failed"  # beside a build's path: the compiler refused it (the reason inside); not tried again
TRANSIENT = ("Killed", "No space left", "Cannot allocate memory", "out of memory")  # failures not to cache


class BuildError(RuntimeError):
    """A kernel that could not be built; one line saying why."""


def cache_dir() -> str:
    root = os.environ.get("PDLAB_KERNEL_CACHE")
    if not root:
        root = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pdlab", "kernels")
    return root


def compiler() -> str:
    return os.environ.get("CC") or "cc"


@functools.lru_cache(maxsize=None)
def compiler_id(cc: str) -> str:
    """`cc --version`'s output, asked once per process and compiler."""
    try:
        return subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


@functools.lru_cache(maxsize=None)
def cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.machine()


def process_march() -> str:
    """The -march target of the process's kernel build: $PDLAB_KERNEL_MARCH, else native."""
    return os.environ.get(KERNEL_MARCH_ENV, "").strip() or "native"


def flags(name: str, march: str = "native", werror: bool = False, openmp: Optional[bool] = None) -> list[str]:
    """The compiler's arguments; openmp: with -fopenmp (default: for THREADED kernels)."""
    threads = OPENMP if (name in THREADED if openmp is None else openmp) else []
    return [*COMMON, f"-march={march}", *FLAGS[name], *threads, *(["-Werror"] if werror else [])]


def open_kernel(name: str, march: str = "native", werror: bool = False) -> tuple[ctypes.CDLL, str]:
    """Kernel `name` built (or taken from the cache) and loaded: (ctypes.CDLL, path). A THREADED kernel whose
    OpenMP build fails to compile or to load (a compiler without OpenMP, a runtime missing a symbol) is built
    without it; raises BuildError or OSError when no build loads."""
    if name in THREADED:
        try:
            path = build(name, march, werror, openmp=True)
            return ctypes.CDLL(path), path
        except (BuildError, OSError):
            pass
    path = build(name, march, werror, openmp=False)
    return ctypes.CDLL(path), path


def _refused(path: str) -> None:
    """Raise the cached BuildError of a build the compiler refused before, if there is one."""
    try:
        with open(path + FAILED) as f:
            why = f.read().strip()
    except OSError:
        return
    raise BuildError(f"{why} (cached: delete {path + FAILED} to try again)")


@contextlib.contextmanager
def locked(directory: str) -> Iterator[None]:
    """An exclusive lock on the cache directory (released when the process dies, whatever the way)."""
    with open(os.path.join(directory, ".lock"), "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def build(name: str, march: str = "native", werror: bool = False, openmp: Optional[bool] = None) -> str:
    """The path of kernel `name`'s shared object for `-march=<march>` (openmp: as in `flags`), built if it is
    not cached; raises BuildError with the reason. A compiler's refusal is cached too (`<path>.failed`, its
    reason inside), so that every worker start does not compile again what cannot compile (an OpenMP build
    with a compiler without OpenMP): the key holds the source, the flags, the compiler's --version and the
    CPU, so another compiler or source is tried afresh (after installing a missing runtime for the same
    compiler, delete the file). A build that ran out of time, was killed or ran out of memory or disk is not
    cached."""
    cc = compiler()
    if shutil.which(cc) is None:
        raise BuildError(f"no C compiler ({cc} not found)")
    source = os.path.join(CSRC, f"{name}.c")
    argv = flags(name, march, werror, openmp)
    with open(source, "rb") as f:
        src = f.read()
    for header in sorted(h for h in os.listdir(CSRC) if h.endswith(".h")):  # included sources change the build
        with open(os.path.join(CSRC, header), "rb") as f:
            src += f.read()
    key = hashlib.sha256(src + " ".join(argv).encode() + compiler_id(cc).encode() + cpu_flags().encode())
    out_dir = cache_dir()
    path = os.path.join(out_dir, f"{name}-{key.hexdigest()[:16]}.so")
    if os.path.isfile(path):
        return path
    _refused(path)
    os.makedirs(out_dir, exist_ok=True)
    with locked(out_dir):
        if os.path.isfile(path):  # another process built it while this one waited
            return path
        _refused(path)
        for stale in os.listdir(out_dir):  # left by a build that was killed: nobody else is building now
            if TMP_MARK in stale:
                os.unlink(os.path.join(out_dir, stale))
        tmp = f"{path}{TMP_MARK}{os.getpid()}"
        try:
            p = subprocess.run([cc, *argv, source, "-o", tmp, "-lm"], capture_output=True, text=True,
                               timeout=KERNEL_BUILD_TIMEOUT_S)
            if p.returncode:
                lines = p.stderr.strip().splitlines()
                why = next((x for x in lines if "error" in x), lines[-1] if lines else "?")
                msg = f"{cc} failed on {name}.c: {why.strip()}"
                if p.returncode > 0 and not any(x in p.stderr for x in TRANSIENT):  # a refusal, not a mishap
                    with open(tmp + FAILED, "w") as f:
                        f.write(msg)
                    os.replace(tmp + FAILED, path + FAILED)
                raise BuildError(msg)
            os.replace(tmp, path)
        except subprocess.TimeoutExpired:
            raise BuildError(f"{cc} took over {KERNEL_BUILD_TIMEOUT_S:.0f} s on {name}.c") from None
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return path
