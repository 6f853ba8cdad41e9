"""StD (Sparse-to-Dense): the model drafts for itself reading only the most attended visual KV entries.

Contract:
- `prefill` runs the prompt suffix through the dense model while recording, per layer and KV head, the
  attention mass the suffix queries put on each visual token (GQA query groups summed; no L x L matrix).
  It then gathers the top-K visual entries plus every text entry into a compact draft cache
  (`KVCache.gather`). K = min(n_visual, budget - n_text): the paper's K + text = 1024.
- Which K (`selection`): "shared" (default) ranks the visual entries once for the whole model, by each
  layer's prompt mass normalised per KV head and summed over layers and KV heads (`shared_scores`), and
  every layer and KV head keeps the same K; "per_head" is the paper's top-K per layer and KV head. The
  shared ranking pools the evidence of all layers; a single layer's prompt attention is a noisy guess of
  where the answer will look. On the reference model, gamma 4, the four caption requests
  (`benchmarks/std_selection.py`): acceptance 0.71 -> 0.91 at 25.6k visual tokens (the answer's own
  attention, an oracle, 0.90), 0.91 -> 0.99 at 4k, equal at 16k (0.93) and 1.5k (1.00); on a second video
  0.87 -> 0.96 at 25.6k and 0.81 -> 0.89 at 16k.
- `propose` runs the same model on the compact cache for up to gamma steps (true positions, so RoPE matches
  the gathered keys), greedy or sampled from the draft distribution (returned for rejection sampling); a
  draft ends at its first end-of-sequence token (nothing after it could be emitted).
- `observe` discards the draft's own K/V of the drafted tokens and writes the dense K/V of the committed
  tokens (pending + accepted drafts, just computed by the verify pass) into the draft cache.
- Adaptive gamma (on by default): `decoders.gamma.GammaController` picks the draft length that maximises
  expected tokens per second from the measured acceptance per position and the measured costs of a draft
  step and of verifying n rows, within [gamma_min, gamma_max].
- `native_draft` (on by default): each draft step is one native call (`decoders.kernels.NativeStep`, the
  whole decoder stack for one token in C++; built on first use, torch forward where unavailable). A step on
  the 1024-entry draft cache of the reference model: 0.51-0.52 ms against 1.41-1.48 ms for the torch
  forward (`benchmarks/attn_kernel.py`). Drafts'
  rounding never reaches the output (the verify decides), so it is lossless like every other draft.
- `compile_draft` (off by default): the draft steps run through `torch.compile` (the lean step compiled
  once per model, `decoders.fastpath.FastDecoder.compiled`); the verify stays eager, so the output is the
  same token for token. On the reference model a 1-row step on a 1k cache goes from ~1.1 to ~0.8 ms.
- Refresh (`refresh_every` > 0): the paper selects the top-K once, from the prompt's attention. During a
  caption, though, each sentence looks at a different stretch of the video. So the verify pass also reports
  where each committed token (the pending one and the accepted drafts) attends
  (`decoders.attention.watch_visual_attention`, one sum per layer over probabilities it computes anyway);
  the scores are a decayed sum, seeded by the prompt's per-query mass, and every `refresh_every` cycles the
  draft cache is re-gathered (top-K of those scores + every text entry, including the generated tokens'
  dense K/V). Off by default: a re-gather costs about what the prompt's gather does (README).
Lossless by construction: the engine verifies every draft densely.
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch

from decoders.attention import VisualAttentionRecorder, record_visual_attention, watch_visual_attention
from decoders.cache import KVCache
from decoders.engine import Draft, Verified
from decoders.gamma import GammaController
from decoders.sampling import DecodeConfig, draft_token
from decoders.session import VisualSession

SELECTIONS = ("shared", "per_head")


@dataclass(frozen=True)
class StDConfig:
    budget: int = 1024  # draft-cache entries at the start of a prompt: top-K visual + all text
    gamma: int = 6  # the first cycle's draft length (then chosen by cost when adaptive)
    adaptive: bool = True
    gamma_min: int = 2
    gamma_max: int = 16
    refresh_every: int = 0  # cycles between re-selections of the top-K (0: select once per prompt)
    refresh_decay: float = 0.8  # per cycle, weight of the older scores in the re-selection
    compile_draft: bool = False  # draft steps through torch.compile (`FastDecoder.compiled`; ~45 s once)
    native_draft: bool = True  # draft steps in one native call where available (not with compile_draft)
    selection: str = "shared"  # "shared": one top-K for all layers and KV heads; "per_head": the paper's

    def __post_init__(self) -> None:
        if self.budget < 1:
            raise ValueError("StD budget must be >= 1")
        if self.refresh_every < 0 or not 0.0 <= self.refresh_decay <= 1.0:
            raise ValueError(f"need refresh_every >= 0 and 0 <= refresh_decay <= 1, got {self}")
        if self.selection not in SELECTIONS:
            raise ValueError(f"StD selection must be one of {SELECTIONS}, got {self.selection!r}")
        if not 1 <= self.gamma_min <= self.gamma <= self.gamma_max:
            raise ValueError(f"need 1 <= gamma_min <= gamma <= gamma_max, got {self}")


def shared_scores(scores: list[torch.Tensor]) -> torch.Tensor:
    """One visual score for every layer and KV head: each layer's mass normalised to sum 1 per KV head, then
    summed over layers and KV heads. scores: per layer [B, Hkv, n_visual] -> [B, 1, n_visual]."""
    total = sum(s / s.sum(dim=-1, keepdim=True).clamp_min(1e-30) for s in scores)
    return total.sum(dim=1, keepdim=True)


def select_top_k(scores: torch.Tensor, k: int, offset: int) -> torch.Tensor:
    """Indices of the k highest-scoring visual entries per KV head, ascending.

    scores: [B, Hkv, n_visual] attention mass per visual entry; offset: cache index of visual entry 0.
    returns [B, Hkv, k] cache indices.
    """
    k = min(k, scores.shape[-1])
    idx = torch.topk(scores, k, dim=-1).indices  # [B, Hkv, k]
    return torch.sort(idx, dim=-1).values + offset


class StDProposer:
    name = "std"

    def __init__(self, config: StDConfig | None = None) -> None:
        self.config = config or StDConfig()
        self.gamma = self.config.gamma
        self.info: dict = {}
        self.session: VisualSession | None = None
        self.draft_cache: KVCache | None = None
        self.committed = 0  # draft-cache entries that hold committed (dense) K/V
        self.cfg = DecodeConfig()
        self.generator: torch.Generator | None = None
        self.controller = self._new_controller()
        self.draft_step_s = 0.0  # mean draft-step time of the last proposal
        self.stop: frozenset[int] = frozenset()  # end-of-sequence ids: a draft ends at the first one
        self.k_visual = 0
        self.scores: list[torch.Tensor] = []  # per layer [B, Hkv, n_visual]: decayed attention mass (refresh)
        self.watch: VisualAttentionRecorder | None = None
        self.cycles = 0
        # which of the session's draft-length controllers this proposer uses (LVSpec marks its inner one)
        c = self.config
        self.state_key = (
            f"std:{c.budget}:{c.selection}:{c.refresh_every}:{int(c.compile_draft)}:{int(c.native_draft)}:"
            f"{c.gamma_min}:{c.gamma_max}"
        )

    def _new_controller(self) -> GammaController:
        c = self.config
        return GammaController(c.gamma, c.gamma_min, c.gamma_max)

    def prefill(self, session: VisualSession, prompt_ids: list[int], cfg: DecodeConfig) -> torch.Tensor:
        vs, ve = session.visual_span
        with record_visual_attention((vs, ve)) as rec:
            hidden = session.extend(prompt_ids)  # [1, n, hidden]
        t0 = time.perf_counter()
        cache = session.cache
        n_text = cache.length - (ve - vs)
        self.k_visual = k = max(0, min(ve - vs, self.config.budget - n_text))
        self.session, self.cfg = session, cfg
        self.stop = frozenset() if cfg.ignore_eos else frozenset(session.lm.eos_token_ids)
        self.scores = [rec.scores[layer] / len(prompt_ids) for layer in range(len(cache.layers))]
        self.cycles = 0
        self._gather()
        if self.config.adaptive:  # the video's controller: it carries over from the previous prompt
            self.controller = session.draft_controller(self.state_key, self._new_controller)
        else:
            self.controller = self._new_controller()
        self.gamma = self.controller.gamma
        self.generator = None
        if not cfg.greedy:
            self.generator = torch.Generator(device=cache.layers[0].keys.device)
            self.generator.manual_seed((cfg.seed or 0) + 7919)
        self.info = {
            "k_visual": k,
            "draft_cache_entries": self.committed,
            "gather_s": time.perf_counter() - t0,
            "gamma": self.gamma,
            "refreshes": 0,
            "refresh_s": 0.0,
        }
        return hidden

    def _gather(self) -> None:
        """(Re)build the draft cache from the dense one: per layer and KV head the top-K visual entries by
        `self.scores`, and every text entry (system turn, prompt, committed generated tokens)."""
        assert self.session is not None
        cache = self.session.cache
        vs, ve = self.session.visual_span
        b, hkv = cache.layers[0].keys.shape[:2]
        dev = cache.layers[0].keys.device
        text_b = torch.arange(0, vs, device=dev).expand(b, hkv, -1)
        text_a = torch.arange(ve, cache.length, device=dev).expand(b, hkv, -1)
        if self.config.selection == "shared":  # one choice for all layers and KV heads
            top = select_top_k(shared_scores(self.scores), self.k_visual, vs).expand(b, hkv, -1)
            indices = [torch.cat([text_b, top, text_a], dim=-1)] * len(self.scores)
        else:
            indices = [
                torch.cat([text_b, select_top_k(scores, self.k_visual, vs), text_a], dim=-1)
                for scores in self.scores
            ]
        self.draft_cache = cache.gather(
            indices, extra_capacity=self.cfg.max_new_tokens + self.config.gamma_max + 8
        )
        self.committed = self.draft_cache.length

    def verify_watch(self) -> AbstractContextManager:
        """Around the engine's verify forward: record where the pending token looks (refresh only)."""
        assert self.session is not None
        if not self.config.refresh_every:
            return nullcontext()
        self.watch = VisualAttentionRecorder(span=self.session.visual_span)
        return watch_visual_attention(self.watch)

    @torch.inference_mode()
    def propose(self, pending: int, max_tokens: int) -> Draft:
        assert self.session is not None and self.draft_cache is not None
        g = min(self.gamma, max_tokens)
        lm, base = self.session.lm, self.session.length  # `pending` will sit at dense index `base`
        tokens: list[int] = []
        probs: list[torch.Tensor] = []
        tok = pending
        t0 = time.perf_counter()
        step = lm.fast.compiled() if self.config.compile_draft and lm.fast is not None else lm.step
        native = None
        if self.config.native_draft and not self.config.compile_draft and lm.fast is not None:
            native = lm.fast.native_step()
        for i in range(g):
            ids = torch.tensor([[tok]], device=lm.device)
            pos = base + i + self.session.rope_delta
            h = native.step(ids, pos, self.draft_cache) if native is not None else None
            if h is None:  # no native step here (or this cache does not fit it): the torch forward
                h = step(ids, pos, self.draft_cache)
            tok, p = draft_token(lm.logits(h[0, -1]), self.cfg, self.generator)
            if p is not None:
                probs.append(p)
            tokens.append(tok)
            if tok in self.stop:  # nothing after an end of sequence is ever emitted: stop drafting
                break
        self.draft_step_s = (time.perf_counter() - t0) / max(1, len(tokens))
        return Draft(tokens, torch.stack(probs) if probs else None)

    def observe(self, outcome: Verified) -> None:
        assert self.session is not None and self.draft_cache is not None
        # replace the draft's own K/V with the dense K/V of what was committed
        self.draft_cache.truncate(self.committed)
        n = outcome.accepted + 1
        self.draft_cache.copy_from(self.session.cache, outcome.cache_start, n)
        self.committed += n
        if self.config.refresh_every and outcome.drafted and self.watch is not None and self.watch.scores:
            t0 = time.perf_counter()
            decay = self.config.refresh_decay
            rows = outcome.accepted + 1  # the pending token and the accepted drafts: all committed
            for layer, mass in self.watch.scores.items():  # mass [B, Hkv, q, n_visual]
                self.scores[layer] = self.scores[layer] * decay + mass[:, :, :rows].sum(dim=2)
            self.watch = None
            self.cycles += 1
            if self.cycles % self.config.refresh_every == 0 and self.k_visual:
                self._gather()
                self.info["refreshes"] += 1
            self.info["refresh_s"] += time.perf_counter() - t0
        if self.config.adaptive and outcome.drafted:
            self.gamma = self.controller.update(
                outcome.drafted, outcome.accepted, self.draft_step_s, outcome.verify_s
            )
        self.info["gamma"] = self.gamma
