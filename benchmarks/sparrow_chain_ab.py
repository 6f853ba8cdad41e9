"""A/B of Sparrow's native draft chain: this build of the kernels against an earlier one, call by call.

An earlier build from before the chain's weights were panel-packed (session 22) is given the head's
projections in the `[in, out]` layout; with `--packed`, an earlier build that reads the packed ones. One chain
call encodes `--rows` committed rows and drafts `--gamma` tokens (greedy) on a head cache holding a 40-entry
text history; both builds must draft the same tokens, and with `--packed` write bit-identical head-cache
entries. Usage:
python benchmarks/sparrow_chain_ab.py --lib .venv/lib/vidspec-kernels/vidspec_attn-<earlier>.so [--packed]
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import statistics
import threading
import time

import common  # benchmarks/common.py (scripts run from benchmarks/ on sys.path)
import torch

from decoders import kernels
from decoders.model import load_model
from decoders.proposers.router import draft_head
from decoders.proposers.sparrow import HeadKV


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="models/vidspec-reference")
    p.add_argument("--lib", required=True, help="an earlier build of the kernel library")
    p.add_argument("--rounds", type=int, default=400)
    p.add_argument("--packed", action="store_true", help="the earlier build reads panel-packed weights")
    p.add_argument("--rows", type=int, default=5, help="committed rows encoded per call")
    p.add_argument("--gamma", type=int, default=6, help="tokens drafted per call (at most)")
    a = p.parse_args()
    torch.set_num_threads(1)
    lm = load_model(a.model, device="cpu")
    head = draft_head(lm)
    new = kernels.NativeSparrow.create(head, lm)
    assert new is not None, "needs the native kernels"
    lib = common.earlier_build(a.lib, new.lib, ("vidspec_sparrow_chain", "vidspec_sparrow_scratch"))
    old = copy.copy(new)  # the same head and table, unpacked weights, the earlier library
    _, _, wfc_h, _, wqkv, bqkv, wo, wgu, wdown, on = head._lean_weights()
    if a.packed:
        old._weights = list(new._weights)
    else:
        old._weights = [t.detach().float().contiguous() for t in (wfc_h, wqkv, bqkv, wo, wgu, wdown, on)]
        old._weights.append(new._weights[-1])  # the lm_head is not packed in either
    ptrs = [t.data_ptr() for t in old._weights] + [0 if new._bias is None else new._bias.data_ptr()]
    old._w = (ctypes.c_void_p * len(ptrs))(*ptrs)
    old.lib, old._local = lib, threading.local()
    kv = HeadKV.empty(head.cfg, 512, torch.float32, torch.device("cpu"))
    h = head.cfg.hidden_size
    g = torch.Generator().manual_seed(0)
    new.chain(
        torch.randint(0, 200, (40,), generator=g).tolist(),
        torch.randn(1, 40, h, generator=g),
        kv,
        1,
        frozenset(),
    )
    base = kv.length
    ids = torch.randint(0, 200, (a.rows,), generator=g).tolist()
    feats = torch.randn(1, a.rows, h, generator=g)
    times: dict[str, list[float]] = {"earlier": [], "current": []}
    drafts, entries = {}, {}
    for _ in range(a.rounds):
        for name, chain in (("earlier", old), ("current", new)):
            t0 = time.perf_counter()
            drafts[name] = chain.chain(ids, feats, kv, a.gamma, frozenset())
            times[name].append(time.perf_counter() - t0)
            entries[name] = (kv.keys[:, :, : kv.length].clone(), kv.values[:, :, : kv.length].clone())
            kv.length = base
    assert drafts["earlier"] == drafts["current"], drafts
    if a.packed:
        for x, y in zip(entries["earlier"], entries["current"]):
            assert torch.equal(x, y), "head-cache entries differ"
    print(
        f"drafts {drafts['current']}; "
        + ", ".join(f"{k}: {statistics.median(v) * 1e3:.3f} ms" for k, v in times.items())
    )


if __name__ == "__main__":
    main()
