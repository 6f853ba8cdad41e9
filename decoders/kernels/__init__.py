"""Native kernels for the decode path, compiled on first use for the CPU they run on.

Contract:
- `attention(qg, keys, values, nq, threads)` is the attention of a few query rows over a long KV cache in
  one pass (`attn.cpp`: per KV head, blocks of keys streamed once for all rows, online softmax, no score
  matrix over the cache). qg [Hkv, G, D] float32 contiguous, already scaled, the G = group * nq rows of a KV
  head side by side (row r is new token r % nq); keys, values [1, Hkv, kv, D] as `decoders.cache` keeps them
  on CPU (keys stored transposed: entry stride 1). Causal over the new tokens: row r sees entries
  < kv - nq + (r % nq) + 1. Returns [Hkv, G, D], or None when the kernel does not apply (not built, another
  device or dtype, layout, head dim other than 16/32/64/128, more than `max_rows()` rows): the caller then
  computes it with torch.
- The shared library is compiled from `attn.cpp` by g++ (`-O3 -march=native -fopenmp`) into
  `kernel_dir()` (`$VIDSPEC_KERNEL_DIR`, default inside the active virtual environment), named by a hash
  of the source, the flags and the CPU's model and feature flags, so a venv moved to another CPU builds
  its own; the build writes a temporary file and renames it (safe with several processes). No compiler,
  a failed build or `VIDSPEC_ATTN_KERNEL=0` leave `available()` False and every caller on torch.
- `threads` > 1 runs the KV heads in parallel (OpenMP; the library links the `libgomp.so.1` torch has
  already loaded, so one OpenMP runtime serves both).
- Results equal torch's two-GEMM attention to float rounding (~1e-7 relative; tested); every decode path
  (vanilla steps, verification, drafts) goes through the same kernel, so comparisons stay fair.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("attn.cpp")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]
ENABLE_VAR = "VIDSPEC_ATTN_KERNEL"

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
_max_rows = 0


def kernel_dir() -> Path:
    env = os.environ.get("VIDSPEC_KERNEL_DIR")
    return Path(env) if env else Path(sys.prefix) / "lib" / "vidspec-kernels"


def _cpu_signature() -> str:
    """The CPU's model name and feature flags (what -march=native compiles for)."""
    lines = []
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(("model name", "flags", "Features", "CPU part")):
                    lines.append(line.strip())
                if line.strip() == "":  # the first processor is enough
                    break
    except OSError:
        pass
    return "\n".join(lines) or platform.processor() or platform.machine()


def library_path() -> Path:
    h = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(FLAGS).encode(), _cpu_signature().encode()):
        h.update(part)
        h.update(b"\0")
    return kernel_dir() / f"vidspec_attn-{h.hexdigest()[:16]}.so"


def build(dest: Path | None = None) -> Path | None:
    """Compile `attn.cpp` into `dest` (default `library_path()`); None without a compiler or on failure."""
    dest = dest or library_path()
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        return None
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=dest.parent)
    os.close(fd)
    try:
        proc = subprocess.run([cxx, *FLAGS, "-o", tmp, str(SOURCE)], capture_output=True)
        if proc.returncode != 0:
            print(f"vidspec kernels: build failed: {proc.stderr.decode()[-800:]}", file=sys.stderr)
            return None
        os.replace(tmp, dest)
        return dest
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load() -> ctypes.CDLL | None:
    """The kernel library (built on first use), or None when it is off or cannot be built."""
    global _lib, _tried, _max_rows
    if _tried:
        return _lib
    with _lock:
        if _tried:
            return _lib
        try:
            if os.environ.get(ENABLE_VAR, "1") != "0":
                path = library_path()
                if not path.is_file():
                    path = build(path)
                if path is not None:
                    lib = ctypes.CDLL(str(path))
                    f = lib.vidspec_attn
                    f.restype = ctypes.c_int
                    f.argtypes = (
                        [ctypes.c_void_p] * 4 + [ctypes.c_int] * 5 + [ctypes.c_long] * 4 + [ctypes.c_int]
                    )
                    _max_rows = int(lib.vidspec_attn_max_rows())
                    _lib = lib
        except OSError as e:  # a library that does not load: stay on torch
            print(f"vidspec kernels: not loaded: {e}", file=sys.stderr)
            _lib = None
        _tried = True
    return _lib


def available() -> bool:
    return load() is not None


def max_rows() -> int:
    """The most query rows per KV head the kernel takes (0 when it is not available)."""
    return _max_rows if load() is not None else 0


def attention(
    qg: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, nq: int, threads: int = 1
) -> torch.Tensor | None:
    """See the module docstring. qg [Hkv, G, D]; keys, values [1, Hkv, kv, D] -> [Hkv, G, D] or None."""
    lib = load()
    if lib is None:
        return None
    hkv, g, d = qg.shape
    kv = keys.shape[2]
    if (
        qg.device.type != "cpu"
        or not (qg.dtype == keys.dtype == values.dtype == torch.float32)
        or keys.shape[0] != 1
        or g > _max_rows
        or d not in (16, 32, 64, 128)
        or kv < nq
        or keys.stride(2) != 1  # keys stored transposed (decoders.cache on CPU)
        or values.stride(3) != 1
        or not qg.is_contiguous()
    ):
        return None
    out = torch.empty_like(qg)
    rc = lib.vidspec_attn(
        qg.data_ptr(),
        keys.data_ptr(),
        values.data_ptr(),
        out.data_ptr(),
        hkv,
        g,
        nq,
        d,
        kv,
        keys.stride(1),
        keys.stride(3),
        values.stride(1),
        values.stride(2),
        max(1, threads),
    )
    return out if rc == 0 else None
