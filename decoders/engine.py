"""The one decode loop: propose -> verify -> accept -> commit, as a generator of accepted token chunks.

Contract:
- The engine knows nothing about tokenization, Redis or metrics. It takes a `VisualSession` (the cached
  visual prefix of one video), the prompt suffix ids, a `DecodeConfig`, and optionally a `Proposer`.
- State between cycles: the dense cache holds every committed token except the newest one (`pending`),
  which has been emitted but not yet run through the model.
- One cycle: (1) the proposer drafts up to gamma tokens after `pending`; (2) one forward pass over
  [pending, d_1..d_gamma] on the dense cache with correct positions gives the target's logits at gamma + 1
  places; (3) acceptance keeps k drafts plus one recovered/bonus token; (4) commit = truncate the cache to
  the pending token plus the k accepted drafts (a length change), tell the proposer, yield the chunk.
- With no proposer, gamma = 0 and one cycle is one ordinary decode step: that is vanilla decoding, and it
  is the baseline for every speedup. At temperature 0 every lossless proposer's output is token-identical
  to it. A lossy proposer (LVSpec) supplies its own `accept(draft, logits, hidden)`; its stats say so.
- A proposer may define `verify_watch()`, a context manager entered around the verify forward (StD uses it
  to see where the committed tokens attend; it must not change the computation).
- Generation stops after an EOS from the model's full EOS list (the EOS is emitted) or `max_new_tokens`.
- Whatever happens (exhaustion, an exception, the consumer closing the generator), the session is truncated
  back to its visual prefix afterwards.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field, fields
from typing import Protocol

import torch

from decoders.accept import greedy_accept, rejection_accept
from decoders.sampling import DecodeConfig, pick_token, target_probs
from decoders.session import VisualSession


@dataclass
class Draft:
    tokens: list[int]
    probs: torch.Tensor | None = None  # [gamma, V] draft distributions; None = deterministic drafts


@dataclass
class Verified:
    """What the proposer learns after one verification."""

    cache_start: int  # dense-cache index of the pending token
    drafted: int  # gamma of this cycle
    accepted: int  # k
    tokens: list[int]  # [pending, d_1..d_k]: the tokens whose dense K/V are now committed
    next_token: int  # the new pending token (recovered or bonus)
    hidden: torch.Tensor  # [k + 1, hidden] final hidden states of the committed tokens
    verify_s: float = 0.0  # time of this verification (forward of gamma + 1 rows, acceptance, rollback)


class Proposer(Protocol):
    """A drafter. One instance serves one prompt at a time."""

    name: str

    def prefill(self, session: VisualSession, prompt_ids: list[int], cfg: DecodeConfig) -> torch.Tensor:
        """Write the prompt suffix into the dense cache (`session.extend`), keeping whatever the drafter
        needs from that pass; return the suffix's final hidden states [1, n, hidden]."""

    def propose(self, pending: int, max_tokens: int) -> Draft:
        """Draft at most `max_tokens` tokens that follow `pending`."""

    def observe(self, outcome: Verified) -> None:
        """Feedback after verification (e.g. adapt gamma, sync the draft cache with dense K/V)."""


@dataclass
class SpecDecodeStats:
    """Counters of one generation; plain data (monitoring/ turns it into metrics)."""

    method: str = "vanilla"
    num_drafts: int = 0  # verification cycles that carried at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [i] = drafts accepted at position i
    new_tokens: int = 0
    prompt_tokens: int = 0  # prompt-suffix tokens (the visual prefix is the session's)
    prefill_s: float = 0.0  # prompt-suffix prefill (the visual prefix is the session's)
    ttft_s: float = 0.0  # from the start of the prompt to the first token
    decode_s: float = 0.0  # from the first token to the last
    draft_s: float = 0.0
    verify_s: float = 0.0
    num_steps: int = 0  # target forward passes after the first token
    extra: dict = field(default_factory=dict)  # proposer-specific timings and settings

    @property
    def mean_accepted_length(self) -> float | None:
        """1 + accepted / drafts: tokens per verification including the bonus token (vLLM's definition)."""
        if self.num_drafts == 0:
            return None
        return 1.0 + self.num_accepted_tokens / self.num_drafts

    @property
    def acceptance_rate(self) -> float | None:
        if self.num_draft_tokens == 0:
            return None
        return self.num_accepted_tokens / self.num_draft_tokens

    @classmethod
    def combined(cls, parts: list[SpecDecodeStats]) -> SpecDecodeStats:
        """Counters and times of several generations summed (per-position counts elementwise); the
        method and proposer extras are the last part's."""
        out = cls(method=parts[-1].method, extra=dict(parts[-1].extra))
        for part in parts:
            for f in fields(cls):
                value = getattr(part, f.name)
                if f.name == "accepted_per_pos":
                    pos = out.accepted_per_pos
                    pos += [0] * (len(value) - len(pos))
                    for i, a in enumerate(value):
                        pos[i] += a
                elif isinstance(value, (int, float)):
                    setattr(out, f.name, getattr(out, f.name) + value)
        return out

    def to_dict(self) -> dict:
        d = asdict(self)
        d["mean_accepted_length"] = self.mean_accepted_length
        d["acceptance_rate"] = self.acceptance_rate
        return d


def generate(
    session: VisualSession,
    prompt_ids: list[int],
    cfg: DecodeConfig,
    proposer: Proposer | None = None,
    stats: SpecDecodeStats | None = None,
) -> Iterator[list[int]]:
    """Yield accepted token chunks for one prompt on `session`. See the module docstring."""
    if not prompt_ids:
        raise ValueError("the prompt suffix is empty")
    lm = session.lm
    stats = stats if stats is not None else SpecDecodeStats()
    if proposer is not None:
        stats.method = proposer.name
    eos = set() if cfg.ignore_eos else set(lm.eos_token_ids)
    gen = cfg.generator(lm.device)

    # a lossy proposer (LVSpec) brings its own acceptance rule; every lossless one uses accept.py's
    loose = getattr(proposer, "accept", None)
    # a proposer may watch the verify pass (a context manager around its forward; StD's refresh)
    watch = getattr(proposer, "verify_watch", None)

    def select(logits: torch.Tensor, draft: Draft, hidden: torch.Tensor) -> tuple[int, int]:
        if cfg.greedy and loose is None:
            return greedy_accept(draft.tokens, logits)
        drafted = torch.tensor(draft.tokens, dtype=torch.long, device=logits.device)
        if loose is not None:
            return loose(drafted, logits, hidden)
        return rejection_accept(drafted, draft.probs, target_probs(logits, cfg.temperature, cfg.top_p), gen)

    with torch.inference_mode(), session.prompt():
        # 0. prefill the prompt suffix; its last logits give the first token
        t_start = time.perf_counter()
        if proposer is None:
            hidden = session.extend(prompt_ids)  # [1, n, hidden]
        else:
            hidden = proposer.prefill(session, prompt_ids, cfg)
        pending = pick_token(lm.logits(hidden[0, -1]), cfg, gen)
        t_first = time.perf_counter()
        stats.prefill_s = stats.ttft_s = t_first - t_start
        stats.new_tokens = 1
        stats.prompt_tokens = len(prompt_ids)
        yield [pending]
        while pending not in eos and stats.new_tokens < cfg.max_new_tokens:
            remaining = cfg.max_new_tokens - stats.new_tokens
            # 1. propose (never more drafts than tokens we may still emit, minus the bonus token)
            t0 = time.perf_counter()
            draft = proposer.propose(pending, remaining - 1) if proposer and remaining > 1 else Draft([])
            t1 = time.perf_counter()
            # 2. verify pending + drafts in one forward pass on the dense cache
            start = session.length
            with watch() if watch is not None else nullcontext():
                hidden = session.extend([pending, *draft.tokens])  # [1, gamma + 1, hidden]
            logits = lm.logits(hidden[0])  # [gamma + 1, V]
            # 3. accept
            k, next_token = select(logits, draft, hidden[0])
            # 4. commit: keep pending + k accepted drafts, drop the rest of the verified entries
            session.truncate(start + 1 + k)
            t2 = time.perf_counter()
            gamma = len(draft.tokens)
            chunk = [*draft.tokens[:k], next_token]
            for i, tok in enumerate(chunk):  # stop at the first EOS
                if tok in eos:
                    chunk = chunk[: i + 1]
                    break
            # drafts accepted after an EOS among them are never emitted: count only those up to the EOS
            k_emitted = min(k, len(chunk))
            if gamma:
                stats.num_drafts += 1
                stats.num_draft_tokens += gamma
                stats.num_accepted_tokens += k_emitted
                if len(stats.accepted_per_pos) < gamma:
                    stats.accepted_per_pos += [0] * (gamma - len(stats.accepted_per_pos))
                for i in range(k_emitted):
                    stats.accepted_per_pos[i] += 1
            stats.num_steps += 1
            stats.draft_s += t1 - t0
            stats.verify_s += t2 - t1
            if proposer is not None:
                proposer.observe(
                    Verified(
                        start, gamma, k, [pending, *draft.tokens[:k]], next_token, hidden[0, : k + 1], t2 - t1
                    )
                )
            chunk = chunk[:remaining]
            pending = chunk[-1]
            stats.new_tokens += len(chunk)
            stats.decode_s = time.perf_counter() - t_first
            if proposer is not None:
                stats.extra = dict(getattr(proposer, "info", {}))
            yield chunk


@dataclass
class GenerationResult:
    tokens: list[int]
    text: str
    stats: SpecDecodeStats


def run(
    session: VisualSession,
    prompt_ids: list[int],
    cfg: DecodeConfig,
    proposer: Proposer | None = None,
) -> GenerationResult:
    """Collect `generate` into a list of tokens and decoded text."""
    stats = SpecDecodeStats()
    tokens: list[int] = []
    for chunk in generate(session, prompt_ids, cfg, proposer, stats):
        tokens += chunk
    return GenerationResult(tokens=tokens, text=session.lm.decode(tokens), stats=stats)
