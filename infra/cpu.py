"""Fast BLAS on AMD CPUs: let the MKL inside torch's CPU wheel take its optimised code paths.

Contract:
- The MKL statically linked into torch's CPU build picks its GEMM kernels by CPU *vendor*: on a
  non-Intel CPU it falls back to generic code even where the CPU has the same AVX-512 units. Every
  GEMM with a few rows (a verify pass, a draft step, the lm_head over a chunk) then costs about as
  much as that many one-row GEMMs. MKL asks one internal function, `mkl_serv_intel_cpu_true`, whether
  the CPU is Intel; a one-line shared library that answers 1, preloaded into the process, makes MKL
  choose kernels by the CPU's features alone. Measured on this machine's AMD EPYC (AVX-512): a
  5x128 @ 128x1024 GEMM 31 -> 11 us, a decode step of the reference model at 0.5k tokens 1.02 -> 0.78
  ms, a 5-row verify 1.81 -> 1.09 ms (`benchmarks/mkl_vendor.py` measures both ways side by side).
- `ensure_fast_blas()` is called by the `vidspec` entry point (never by library code): on Linux with an
  `AuthenticAMD` CPU, when the shim is built and not yet preloaded, it re-executes the same command line
  with the shim added to `LD_PRELOAD` (a marker variable prevents loops). Child processes inherit it, so
  a local Ray's workers run with it too. `VIDSPEC_MKL_VENDOR_FIX=0` turns it off; on Intel, on other
  platforms or without a C compiler it does nothing.
- `python -m infra.cpu build` compiles the shim (`make setup` runs it; needs `cc`); `python -m infra.cpu
  preload` prints the `LD_PRELOAD` value to use (empty when the fix does not apply); `status()` says
  whether this process runs with it (recorded in `vidspec bench` JSON).
- Only kernel selection changes: results are the same GEMMs to float rounding (tested against float64),
  and every method of a benchmark runs in one process, so comparisons stay side by side.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

SHIM_NAME = "libvidspec_mkl_cpu.so"
SHIM_SOURCE = "/* vidspec: MKL picks kernels by CPU features, not vendor */\nint mkl_serv_intel_cpu_true(void) { return 1; }\n"
FIX_VAR = "VIDSPEC_MKL_VENDOR_FIX"
MARK_VAR = "VIDSPEC_MKL_REEXEC"


def cpu_vendor(cpuinfo: str | os.PathLike = "/proc/cpuinfo") -> str:
    """The first `vendor_id` of /proc/cpuinfo ("AuthenticAMD", "GenuineIntel", ...); "" if unknown."""
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def shim_path() -> Path:
    """Where the shim lives: inside the active virtual environment (one build per machine and venv)."""
    return Path(sys.prefix) / "lib" / SHIM_NAME


def build_shim(dest: Path | None = None, cc: str | None = None) -> Path | None:
    """Compile the shim into `dest` (default `shim_path()`); None when no C compiler is available or it fails."""
    dest = dest or shim_path()
    cc = cc or os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        return None
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "shim.c"
        src.write_text(SHIM_SOURCE)
        out = Path(tmp) / SHIM_NAME
        proc = subprocess.run([cc, "-shared", "-fPIC", "-O2", "-o", str(out), str(src)], capture_output=True)
        if proc.returncode != 0:
            print(f"infra.cpu: building the MKL shim failed: {proc.stderr.decode()[-500:]}", file=sys.stderr)
            return None
        shutil.move(str(out), dest)
    return dest


def preload_value(
    env: Mapping[str, str], vendor: str, shim: Path | None, platform: str = sys.platform
) -> str | None:
    """The new LD_PRELOAD for a process that should run with the shim, or None when nothing is to change.

    None when: turned off (FIX_VAR=0), not Linux, not an AMD CPU, no shim built, already preloaded, or
    this process is itself the re-executed one (MARK_VAR set)."""
    if env.get(FIX_VAR, "1") == "0" or not platform.startswith("linux") or vendor != "AuthenticAMD":
        return None
    if shim is None or env.get(MARK_VAR):
        return None
    current = env.get("LD_PRELOAD", "")
    entries = current.replace(" ", ":").split(":")
    if str(shim) in entries:
        return None
    return f"{current}:{shim}" if current else str(shim)


def status(env: Mapping[str, str] | None = None) -> dict[str, object]:
    """What this process runs with: CPU vendor and whether the shim is preloaded."""
    env = os.environ if env is None else env
    preloaded = SHIM_NAME in env.get("LD_PRELOAD", "")
    return {"cpu_vendor": cpu_vendor(), "mkl_vendor_fix": preloaded}


def _wanted_preload() -> str | None:
    """`preload_value` for this process: its environment, this CPU, the shim if built."""
    shim = shim_path()
    return preload_value(os.environ, cpu_vendor(), shim if shim.is_file() else None)


def ensure_fast_blas() -> None:
    """Re-execute this process with the shim preloaded when it applies (see the module docstring).

    Call it first thing in an entry point, before anything heavy is imported: `os.execv` replaces the
    process, keeping its command line (`sys.orig_argv`) and environment."""
    value = _wanted_preload()
    if value is None:
        return
    os.environ["LD_PRELOAD"] = value
    os.environ[MARK_VAR] = "1"
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv == ["build"]:
        if cpu_vendor() != "AuthenticAMD":
            print("infra.cpu: not an AMD CPU, no shim needed")
            return 0
        built = build_shim()
        print(f"infra.cpu: MKL shim {'built at ' + str(built) if built else 'not built (no C compiler)'}")
        return 0
    if argv == ["preload"]:
        print(_wanted_preload() or os.environ.get("LD_PRELOAD", ""))
        return 0
    print("usage: python -m infra.cpu build|preload", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
