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


def greedy_accept(draft: torch.Tensor, target_logits: torch.Tensor) -> tuple[int, int]:
    """Exact-match acceptance.

    draft:         [gamma] int64 drafted token ids
    target_logits: [gamma + 1, V] target logits at the pending token and each draft token
    returns (k, token): k accepted drafts and the target's argmax after them (recovered or bonus).
    """
    gamma = draft.shape[0]
    assert target_logits.shape[0] == gamma + 1
    target = torch.argmax(target_logits, dim=-1)  # [gamma + 1]
    matches = (draft == target[:gamma]).to(torch.int64)  # [gamma]
    k = int(torch.cumprod(matches, dim=0).sum()) if gamma else 0
    return k, int(target[k])


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
