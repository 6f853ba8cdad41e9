"""Decoding options and the maths of turning logits into a token (greedy, temperature, top-p).

Contract: `DecodeConfig` is validated at construction; `target_probs` is the distribution every method
samples from (vanilla directly, speculative methods through rejection sampling), so all of them share
one definition of temperature and top-p.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DecodeConfig:
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False  # benchmarks only: always produce max_new_tokens

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def generator(self, device: torch.device | str = "cpu") -> torch.Generator | None:
        if self.greedy:
            return None
        g = torch.Generator(device=device)
        g.manual_seed(self.seed if self.seed is not None else int(torch.randint(0, 2**62, ()).item()))
        return g


def target_probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """Softmax at `temperature`, restricted to the top-p nucleus and renormalised.

    logits: [..., V] -> probs [..., V] (float32). The nucleus keeps the smallest set of most likely tokens
    whose mass reaches top_p (the token that crosses the threshold is kept).
    """
    assert temperature > 0
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p >= 1.0:
        return probs
    sorted_p, order = torch.sort(probs, dim=-1, descending=True)
    mass_before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass of strictly more likely tokens
    sorted_p = torch.where(mass_before < top_p, sorted_p, torch.zeros_like(sorted_p))
    kept = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    return kept / kept.sum(dim=-1, keepdim=True)


def pick_token(logits: torch.Tensor, cfg: DecodeConfig, generator: torch.Generator | None) -> int:
    """One token from logits [V]: argmax when greedy, else a sample from `target_probs`."""
    if cfg.greedy:
        return int(torch.argmax(logits))
    probs = target_probs(logits, cfg.temperature, cfg.top_p)
    return int(torch.multinomial(probs, 1, generator=generator))


def draft_token(
    logits: torch.Tensor, cfg: DecodeConfig, generator: torch.Generator | None
) -> tuple[int, torch.Tensor | None]:
    """A drafter's token from its logits [V]: argmax when greedy (no distribution), else a sample from
    `target_probs` and that distribution (q, needed by rejection sampling)."""
    if cfg.greedy:
        return int(torch.argmax(logits)), None
    probs = target_probs(logits, cfg.temperature, cfg.top_p)
    return int(torch.multinomial(probs, 1, generator=generator)), probs
