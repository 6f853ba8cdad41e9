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
- `NativeStep` (below): the whole decoder stack for n new tokens in one call: StD's drafts and the
  native forward of every vanilla step and verify pass (`decoders.fastpath`).
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
import weakref
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("attn.cpp")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]
ENABLE_VAR = "VIDSPEC_ATTN_KERNEL"
HEAD_DIMS = (16, 32, 64, 128)  # the head dims attn.cpp is instantiated for (`vidspec_attn_supports`)

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
                    g = lib.vidspec_step1
                    g.restype = ctypes.c_int
                    g.argtypes = (
                        [ctypes.c_void_p] * 6 + [ctypes.c_int] * 7 + [ctypes.c_void_p, ctypes.c_float]
                    )
                    g.argtypes += [ctypes.c_void_p, ctypes.c_float, ctypes.c_void_p, ctypes.c_void_p]
                    lib.vidspec_step1_scratch.restype = ctypes.c_long
                    lib.vidspec_step1_scratch.argtypes = [ctypes.c_int] * 5
                    n = lib.vidspec_stepn
                    n.restype = ctypes.c_int
                    n.argtypes = [ctypes.c_void_p, ctypes.c_int, *g.argtypes[1:], ctypes.c_int]
                    n.argtypes += [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]  # mass, visual span
                    lib.vidspec_stepn_scratch.restype = ctypes.c_long
                    lib.vidspec_stepn_scratch.argtypes = [ctypes.c_int] * 6
                    c = lib.vidspec_sparrow_chain
                    c.restype = ctypes.c_int
                    c.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] + [ctypes.c_void_p] * 3
                    c.argtypes += [ctypes.c_long, ctypes.c_int] + [ctypes.c_void_p] * 2 + [ctypes.c_int] * 7
                    c.argtypes += [ctypes.c_void_p, ctypes.c_int] + [ctypes.c_void_p] * 2
                    lib.vidspec_sparrow_scratch.restype = ctypes.c_long
                    lib.vidspec_sparrow_scratch.argtypes = [ctypes.c_int] * 6 + [ctypes.c_long]
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
        or keys.device.type != "cpu"
        or values.device.type != "cpu"
        or keys.dim() != 4
        or tuple(keys.shape[1:]) != (hkv, kv, d)
        or values.shape != keys.shape
        or not (qg.dtype == keys.dtype == values.dtype == torch.float32)
        or keys.shape[0] != 1
        or g > _max_rows
        or d not in HEAD_DIMS
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


PANEL = 16  # columns per panel of vidspec_stepn's packed weights


def panels(w: torch.Tensor) -> torch.Tensor:
    """A [K, N] weight (N a multiple of `PANEL`) as N / PANEL contiguous panels [K, PANEL]: the layout
    `vidspec_stepn` reads (each panel one sequential stream; see attn.cpp, `gemm_panels`)."""
    k, n = w.shape
    return w.detach().reshape(k, n // PANEL, PANEL).permute(1, 0, 2).contiguous()


class NativeStep:
    """Decode steps of a `decoders.fastpath.FastDecoder`'s stack for n new tokens in one native call.

    `NativeStep.create(fast)` is None when the kernel is not available, the decoder is not on CPU in
    float32, or its projections' sizes are not multiples of 16 (the kernel reads them as 16-column panels,
    packed once here: `panels`; that is one more copy of the decoder's projection weights in memory, beside
    the model's own and `FastDecoder`'s [in, out] copy: 8 MB for the reference model, ~6 GB for a 1.5B
    language model in float32). `step(input_ids [1, n], start, cache)` computes what `FastDecoder.forward`
    does for n tokens at text positions `start`.. (writing their K/V into `cache` from `cache.length` on and
    growing every layer's length by n) and returns the final normed hidden [1, n, H]; None when this cache
    does not fit the kernel (another layout, no spare capacity), so the caller falls back to the torch
    forward. Its rounding differs from the torch forward's by float noise (cos/sin, summation order). It
    serves StD's draft steps (`StDConfig.native_draft`) and, as `FastDecoder.native_forward` (the default),
    every vanilla step and verify pass: vanilla and the verifies share it, so greedy speculative output stays
    token-identical to vanilla (tested against the torch forward's vanilla too).
    """

    def __init__(self, fast: object, lib: ctypes.CDLL) -> None:
        self.lib = lib
        self.fast = fast
        self.nq, self.nkv, self.d = fast.nq, fast.nkv, fast.d
        self.h = fast.embed.shape[1]
        wgu = fast.layers[0][7]
        self.inter = wgu.shape[1] // 2
        weights: list[torch.Tensor] = []
        floats: list[float] = []
        for w1, e1, wqkv, bqkv, wo, w2, e2, wgu, wdown, scale in fast.layers:
            weights += [w1.detach(), panels(wqkv), bqkv.detach(), panels(wo), w2.detach()]
            weights += [panels(wgu), panels(wdown)]
            floats += [float(e1), float(e2), float(scale)]
        self._weights = [t.contiguous() for t in weights]  # kept alive: the C side holds pointers
        self._w = (ctypes.c_void_p * len(weights))(*(t.data_ptr() for t in self._weights))
        self._f = (ctypes.c_float * len(floats))(*floats)
        self.n_layers = len(fast.layers)
        self._inv_freq = fast.inv_freq.detach().float().contiguous()
        self._norm_w = fast.norm_w.detach().contiguous()
        self.max_rows = max(1, (_max_rows or 1) // (self.nq // self.nkv))  # new tokens per call
        self._scratch_need: dict[int, int] = {}
        self._local = threading.local()  # a scratch buffer per thread: steps may run in several threads
        self._caches: dict[int, tuple] = {}  # id(cache) -> (weakref, K/V pointer arrays, capacities)

    @staticmethod
    def create(fast: object) -> NativeStep | None:
        lib = load()
        if lib is None or fast.embed.device.type != "cpu" or fast.embed.dtype != torch.float32:
            return None
        if fast.d not in HEAD_DIMS or fast.nq % fast.nkv:
            return None
        wqkv, wo, wgu, wdown = (fast.layers[0][i] for i in (2, 4, 7, 8))
        if any(w.shape[0] % PANEL or w.shape[1] % PANEL for w in (wqkv, wo, wgu, wdown)):
            return None  # the kernel reads 16-column panels (`panels`)
        return NativeStep(fast, lib)

    def _pointers(self, cache: object) -> tuple | None:
        layers = cache.layers
        key = id(cache)
        got = self._caches.get(key)
        caps = tuple(layer.capacity for layer in layers)
        buffers = tuple((layer._keys.data_ptr(), layer.values.data_ptr()) for layer in layers)
        if got is not None and got[0]() is cache and got[3] == caps and got[5] == buffers:  # same buffers
            return got
        want = (1, self.nkv, self.d)
        if len(layers) != self.n_layers or any(
            not layer.keys_transposed
            or tuple(layer._keys.shape[:3]) != want
            or (layer.values.shape[0], layer.values.shape[1], layer.values.shape[3]) != want
            or layer._keys.dtype != torch.float32
            or layer.values.dtype != torch.float32
            or not layer._keys.is_contiguous()
            or not layer.values.is_contiguous()
            for layer in layers
        ):
            return None
        kt = (ctypes.c_void_p * len(layers))(*(layer._keys.data_ptr() for layer in layers))
        vv = (ctypes.c_void_p * len(layers))(*(layer.values.data_ptr() for layer in layers))
        cp = (ctypes.c_long * len(layers))(*caps)
        if len(self._caches) > 8:
            self._caches.clear()
        self._caches[key] = got = (weakref.ref(cache), kt, vv, caps, cp, buffers)  # never keeps a cache alive
        return got

    @torch.inference_mode()
    def step(
        self,
        input_ids: torch.Tensor,
        start: int,
        cache: object,
        threads: int = 1,
        record: object | None = None,
    ) -> torch.Tensor | None:
        """input_ids [1, n] (n new tokens, at most `max_rows`) at text positions start.. -> [1, n, H];
        `threads` > 1 splits the stack among threads (projection columns, KV heads, rows; outputs
        bit-identical to one thread). With `record` (a
        `decoders.attention.VisualAttentionRecorder`), each layer's attention mass of the n rows on the
        recorder's visual span, summed over each KV head's query rows, is added to `record.scores[layer]`
        ([1, Hkv, n_visual]), as `decoders.attention`'s recording of the transformers forward does."""
        if input_ids.dim() != 2 or input_ids.shape[0] != 1 or not hasattr(cache, "layers"):
            return None
        n = input_ids.shape[1]
        if n < 1 or n > self.max_rows:
            return None
        ptrs = self._pointers(cache)
        length = cache.length
        if ptrs is None or any(length + n > c for c in ptrs[3]):
            return None
        _, kt, vv, _, cp, _ = ptrs
        if n == 1:
            x = self.fast.embed[int(input_ids[0, 0])]
        else:
            x = torch.nn.functional.embedding(input_ids[0], self.fast.embed).contiguous()
        out = torch.empty(1, n, self.h, dtype=torch.float32)
        need = self._scratch_need.get(n)
        if need is None:  # floats of scratch for n rows, asked of the library once per n
            need = self._scratch_need[n] = int(
                self.lib.vidspec_stepn_scratch(self.h, self.nq, self.nkv, self.d, self.inter, n)
            )
        scratch = getattr(self._local, "scratch", None)
        if scratch is None or scratch.numel() < need:
            scratch = self._local.scratch = torch.empty(need, dtype=torch.float32)
        mass, mass_ptrs, (vs, ve) = None, None, (0, 0)
        if record is not None:
            vs, ve = record.span
            if not 0 <= vs < ve <= length:
                return None
            mass = torch.zeros(self.n_layers, 1, self.nkv, ve - vs, dtype=torch.float32)
            mass_ptrs = (ctypes.c_void_p * self.n_layers)(*(m.data_ptr() for m in mass))
        rc = self.lib.vidspec_stepn(
            x.data_ptr(), n, self._w, self._f, kt, vv, cp, length, self.n_layers, self.h, self.nq, self.nkv,
            self.d, self.inter, self._inv_freq.data_ptr(), float(start), self._norm_w.data_ptr(),
            float(self.fast.norm_eps), out.data_ptr(), scratch.data_ptr(), max(1, int(threads)), mass_ptrs,
            vs, ve,
        )  # fmt: skip
        if rc != 0:
            return None
        if mass is not None:
            for layer in range(self.n_layers):
                got = record.scores.get(layer)
                record.scores[layer] = mass[layer] if got is None else got + mass[layer]
        for layer in cache.layers:
            layer.length = length + n
        return out


class NativeSparrow:
    """Greedy Sparrow draft chains in one native call (`vidspec_sparrow_chain`).

    `NativeSparrow.create(head, lm)` is None when the kernel is not available, the head or the target is not
    on CPU in float32, the vocabulary is too large for the head's token table, or the head's projection
    sizes are not multiples of 16 (they are packed into 16-column panels, as `NativeStep`'s).
    `chain(ids, feats, kv, g, stop)` does what `SparrowProposer.propose`'s loop does for greedy drafts: encodes the rows (ids[i],
    feats[i]) into the head's cache from `kv.length` on, then drafts up to g tokens (argmax of the target's
    `lm_head` on the head's feature, fed back with it), ending at the first token in `stop`; it leaves
    `kv.length` after the last encoded row and returns the drafts, or None when it cannot run (the caller
    falls back to torch). Its rounding differs from the torch step's by float noise (summation order): drafts
    only, the verify pass decides the output.
    """

    def __init__(self, head: object, lm: object, table: torch.Tensor, lib: ctypes.CDLL) -> None:
        self.lib = lib
        cfg = head.cfg
        self.h, self.nq, self.nkv, self.d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.inter = cfg.intermediate_size
        _, _, wfc_h, _, wqkv, bqkv, wo, wgu, wdown, on = head._lean_weights()
        fast = lm.fast
        head_w = fast.head_w if fast is not None else lm.lm_head.weight.detach().t()
        bias = fast.head_b if fast is not None else lm.lm_head.bias
        self.vocab = int(head_w.shape[1])
        # the five projections panel-packed (as `NativeStep`'s; `create` checked their sizes)
        weights = [panels(wfc_h), panels(wqkv), bqkv, panels(wo), panels(wgu), panels(wdown), on, head_w]
        self._weights = [t.detach().float().contiguous() for t in weights]  # kept alive: C holds pointers
        self._bias = None if bias is None else bias.detach().float().contiguous()
        ptrs = [t.data_ptr() for t in self._weights] + [0 if self._bias is None else self._bias.data_ptr()]
        self._w = (ctypes.c_void_p * len(ptrs))(*ptrs)
        self._table = table  # [V, H]: fc_tok(norm(embed)) + b for every token
        self.head = head
        self._local = threading.local()  # scratch per thread

    @staticmethod
    def create(head: object, lm: object) -> NativeSparrow | None:
        lib = load()
        if lib is None or head.cfg.head_dim > 128 or head.cfg.num_heads % head.cfg.num_kv_heads:
            return None
        w = head.fc.weight
        if w.device.type != "cpu" or w.dtype != torch.float32 or lm.dtype != torch.float32:
            return None
        cfg = head.cfg
        nqkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
        if any(x % PANEL for x in (cfg.hidden_size, nqkv, cfg.intermediate_size)):
            return None  # the chain reads its projections as 16-column panels
        table = head.token_rows(lm.text_model.embed_tokens.weight)
        if table is None or not table.is_contiguous():
            return None
        made = NativeSparrow(head, lm, table, lib)
        # every token the lm_head can draft must have a row in the table (the C side indexes it)
        return made if made.vocab <= table.shape[0] else None

    def current(self, head: object, lm: object) -> bool:
        """Whether this wrapper still matches `head` (its weights are not refolded since) and `lm`'s table."""
        return (
            head is self.head
            and getattr(head, "_tokens", None) is not None
            and head._tokens[1] is self._table
        )

    @torch.inference_mode()
    def chain(
        self, ids: list[int], feats: torch.Tensor, kv: object, g: int, stop: frozenset[int]
    ) -> list[int] | None:
        m = len(ids)
        if m < 1 or g < 1 or feats.shape != (1, m, self.h) or feats.dtype != torch.float32:
            return None
        if min(ids) < 0 or max(ids) >= self._table.shape[0]:  # ids the table has no row for
            return None
        need = kv.length + m + g
        kv.reserve(need)
        keys, values = kv.keys, kv.values
        if not (keys.is_contiguous() and values.is_contiguous() and keys.dtype == torch.float32):
            return None
        cap = keys.shape[2]
        cos, sin = self.head.rope_tables(kv.length, m + g, keys.device)
        feats = feats.contiguous()
        c_ids = (ctypes.c_int * m)(*ids)
        c_stop = (ctypes.c_int * max(1, len(stop)))(*sorted(stop))
        out = (ctypes.c_int * g)()
        need_scratch = int(
            self.lib.vidspec_sparrow_scratch(self.h, self.nq, self.nkv, self.d, self.inter, self.vocab, cap)
        )
        scratch = getattr(self._local, "scratch", None)
        if scratch is None or scratch.numel() < need_scratch:
            scratch = self._local.scratch = torch.empty(2 * need_scratch, dtype=torch.float32)
        n = self.lib.vidspec_sparrow_chain(
            self._table.data_ptr(), c_ids, feats.data_ptr(), m, self._w, keys.data_ptr(), values.data_ptr(),
            cap, kv.length, cos.contiguous().data_ptr(), sin.contiguous().data_ptr(), self.h, self.nq,
            self.nkv, self.d, self.inter, self.vocab, g, c_stop, len(stop), out, scratch.data_ptr(),
        )  # fmt: skip
        if n < 1:
            return None
        kv.length += m + n - 1  # the last draft is not encoded
        return list(out[:n])


def main() -> int:
    """`python -m decoders.kernels`: build the library for this CPU now (`make setup` runs it)."""
    try:
        path = library_path()
        built = path if path.is_file() else build(path)
    except OSError as e:  # e.g. the source is not installed with the package
        print(f"decoders.kernels: not built ({e}): torch paths")
        return 0
    print(
        f"decoders.kernels: {'built at ' + str(built) if built else 'not built (no C++ compiler?): torch paths'}"
    )
    return 0
