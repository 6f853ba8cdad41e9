"""Acceptance rules as pure functions over tensors (no model, no cache).

Glossary (as in vLLM's rejection sampler):
- draft tokens: the gamma tokens a proposer guessed, d_1..d_gamma.
- accepted tokens: the leading draft tokens the target agrees with (k of them, 0 <= k <= gamma).
- recovered token: when d_{k+1} is rejected, the token the target emits in its place.
- bonus token: when all gamma drafts are accepted, the target's own next token after them.
Every verification therefore commits k + 1 tokens.

Lossless rules only live here: greedy exact match, and Leviathan et al. / Chen et al. speculative
sampling (accept d with probability min(1, p(d) / q(d)), else resample from norm(max(0, p - q))), which
leaves the output distribution equal to the target's.
"""

from __future__ import annotations

import torch


def greedy_accept(draft: torch.Tensor | list[int], target_logits: torch.Tensor) -> tuple[int, int]:
    """Exact-match acceptance.

    draft:         [gamma] drafted token ids (an int64 tensor or a list)
    target_logits: [gamma + 1, V] target logits at the pending token and each draft token
    returns (k, token): k accepted drafts and the target's argmax after them (recovered or bonus).
    One argmax and a short Python scan: it runs once per verification, where the tensor form (compare,
    cumprod, sum) cost ~17 us a cycle on this CPU against ~4 us.
    """
    drafted = draft.tolist() if isinstance(draft, torch.Tensor) else list(draft)
    target = torch.argmax(target_logits, dim=-1).tolist()  # [gamma + 1]
    assert len(target) == len(drafted) + 1
    k = 0
    while k < len(drafted) and drafted[k] == target[k]:
        k += 1
    return k, target[k]


def rejection_accept(
    draft: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
) -> tuple[int, int]:
    """Speculative sampling (Leviathan et al. 2023, Chen et al. 2023).

    draft:        [gamma] drafted ids
    draft_probs:  [gamma, V] the distribution q each draft was sampled from; None means the draft was
                  chosen deterministically (q is one-hot at the drafted token)
    target_probs: [gamma + 1, V] the target distribution p at each position (after temperature / top-p)
    returns (k, token): k accepted drafts, then the recovered token (sampled from norm(max(0, p - q)))
    or, if all were accepted, the bonus token sampled from p at position gamma.
    """
    gamma = draft.shape[0]
    assert target_probs.shape[0] == gamma + 1
    for i in range(gamma):
        d = int(draft[i])
        p = target_probs[i]  # [V]
        if draft_probs is None:
            q = torch.zeros_like(p)
            q[d] = 1.0
        else:
            q = draft_probs[i]  # [V]
        u = torch.rand((), generator=generator, device=p.device)
        ratio = p[d] / q[d] if q[d] > 0 else torch.tensor(float("inf"))
        if u < ratio:  # accept with probability min(1, p/q)
            continue
        residual = torch.clamp(p - q, min=0.0)  # [V]
        total = residual.sum()
        if total <= 0:  # p == q up to rounding: any sample from p is correct
            residual, total = p, p.sum()
        return i, int(torch.multinomial(residual / total, 1, generator=generator))
    return gamma, int(torch.multinomial(target_probs[gamma], 1, generator=generator))


# ---------------------------------------------------------------------------------------------------------
# Lossy rules (LVSpec). Kept apart from the lossless ones above: nothing lossless may call them.


def loose_accept(
    draft: torch.Tensor,
    target_logits: torch.Tensor,
    relevance: torch.Tensor,
    relevance_threshold: float,
    lam: float,
    shift_window: int = 0,
) -> tuple[int, int]:
    """LVSpec loose verification (greedy): anchors strictly, fillers loosely.

    draft:         [gamma] drafted ids
    target_logits: [gamma + 1, V] target logits at the pending token and each draft token
    relevance:     [gamma] visual relevance of each draft token (mean top-N cosine with visual states)
    A draft token d_i is accepted when
      (a) it equals the target's argmax t_j at some position j with |j - i| <= shift_window (the
          position-shift tolerance; with shift_window = 0 this is exact match), or
      (b) it is a filler (relevance < relevance_threshold) and the target finds it plausible:
          p_i(d_i) >= (1 - lam) * max_v p_i(v), i.e. `lam` is the relaxation ratio: 0 accepts only the
          target's top token (lossless), 1 accepts any filler the target gives non-zero probability.
    Visual anchors (relevance >= threshold) are accepted only through (a).
    returns (k, token): k accepted drafts, then the target's argmax after them.
    """
    gamma = draft.shape[0]
    assert target_logits.shape[0] == gamma + 1 and relevance.shape[0] == gamma
    probs = torch.softmax(target_logits.float(), dim=-1)  # [gamma + 1, V]
    top_p, top_t = probs.max(dim=-1)  # [gamma + 1]
    k = 0
    for i in range(gamma):
        d = int(draft[i])
        lo, hi = max(0, i - shift_window), min(gamma, i + shift_window)
        matched = bool((top_t[lo : hi + 1] == d).any())
        filler_ok = float(relevance[i]) < relevance_threshold and float(probs[i, d]) >= (1.0 - lam) * float(
            top_p[i]
        )
        if not (matched or filler_ok):
            break
        k += 1
    return k, int(top_t[k])
