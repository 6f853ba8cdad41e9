"""infra/cpu.py: when the MKL vendor shim is preloaded, and that GEMMs stay correct with it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from infra.cpu import FIX_VAR, MARK_VAR, SHIM_NAME, build_shim, cpu_vendor, preload_value

SHIM = Path("/venv/lib") / SHIM_NAME


def test_preload_value_applies_only_on_linux_amd_with_a_shim() -> None:
    assert preload_value({}, "AuthenticAMD", SHIM, "linux") == str(SHIM)
    assert preload_value({"LD_PRELOAD": "/a.so"}, "AuthenticAMD", SHIM, "linux") == f"/a.so:{SHIM}"
    assert preload_value({}, "GenuineIntel", SHIM, "linux") is None
    assert preload_value({}, "AuthenticAMD", SHIM, "darwin") is None
    assert preload_value({}, "AuthenticAMD", None, "linux") is None  # no compiler: nothing built
    assert preload_value({FIX_VAR: "0"}, "AuthenticAMD", SHIM, "linux") is None  # turned off
    assert preload_value({MARK_VAR: "1"}, "AuthenticAMD", SHIM, "linux") is None  # no exec loop
    already = {"LD_PRELOAD": f"/a.so {SHIM}"}  # space-separated lists count too
    assert preload_value(already, "AuthenticAMD", SHIM, "linux") is None


def test_cpu_vendor_reads_cpuinfo(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\n")
    assert cpu_vendor(info) == "AuthenticAMD"
    assert cpu_vendor(tmp_path / "missing") == ""


GEMM_CHECK = r"""
import json, torch
torch.manual_seed(0)
torch.set_num_threads(1)
worst = 0.0
for rows in (1, 2, 3, 5, 8, 33):
    x, w = torch.randn(rows, 128), torch.randn(1024, 128)
    ref = x.double() @ w.double().t()
    for out in (torch.nn.functional.linear(x, w), x @ w.t().contiguous()):
        worst = max(worst, ((out.double() - ref).abs().max() / ref.abs().max()).item())
q, k = torch.randn(2, 10, 32), torch.randn(2, 4000, 32)  # attention scores: a few rows over a long cache
ref = q.double() @ k.double().transpose(1, 2)
worst = max(worst, ((q @ k.transpose(1, 2)).double() - ref).abs().max().item() / ref.abs().max().item())
print(json.dumps({"worst": worst}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="LD_PRELOAD is Linux-only")
def test_gemms_with_the_shim_preloaded_match_float64(tmp_path: Path) -> None:
    shim = build_shim(tmp_path / SHIM_NAME)
    if shim is None:
        pytest.skip("no C compiler")
    env = {**os.environ, "LD_PRELOAD": str(shim)}
    out = subprocess.run(
        [sys.executable, "-c", GEMM_CHECK], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1])["worst"] < 1e-5


@pytest.mark.skipif(cpu_vendor() != "AuthenticAMD", reason="the re-exec applies to AMD CPUs only")
def test_ensure_fast_blas_reexecutes_with_the_shim(tmp_path: Path) -> None:
    code = (
        "from infra.cpu import ensure_fast_blas; ensure_fast_blas(); import os, json; "
        "print(json.dumps([os.environ.get('LD_PRELOAD', ''), os.environ.get('VIDSPEC_MKL_REEXEC')]))"
    )
    prefix = tmp_path / "venv"  # a private sys.prefix-like place for the shim
    shim = build_shim(prefix / "lib" / SHIM_NAME)
    if shim is None:
        pytest.skip("no C compiler")
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", MARK_VAR, FIX_VAR)}
    wrapper = f"import sys; sys.prefix = {str(prefix)!r}; exec({code!r})"
    out = subprocess.run([sys.executable, "-c", wrapper], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    preload, mark = json.loads(out.stdout.strip().splitlines()[-1])
    assert preload == str(shim) and mark == "1"
    off = subprocess.run(
        [sys.executable, "-c", wrapper], env={**env, FIX_VAR: "0"}, capture_output=True, text=True, timeout=60
    )
    assert json.loads(off.stdout.strip().splitlines()[-1]) == ["", None]
