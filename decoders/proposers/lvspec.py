"""LVSpec: loose verification guided by visual relevance, on top of a lossless drafter. Opt-in, LOSSY.

Contract:
- `LVSpecProposer(inner, ...)` drafts with `inner` (StD or Sparrow) and replaces exact-match acceptance by
  `accept.loose_accept`: visual anchors (drafted tokens whose visual relevance is at least
  `relevance_threshold`) must match the target; fillers are accepted when the target finds them plausible
  (`lam`); the position-shift window `shift_window` accepts a token the target produces a few places away.
- Visual relevance of a token = mean of its top-N (`top_n`, paper: 10) cosine similarities with the video's
  visual representations, from what the session already holds (`VisualSession.visual_states`):
  * "input" (default): the token's input embedding against the vision tower's output embeddings (the
    LLM's inputs at the visual positions). It depends only on (token, video), so it is computed once per
    token id and cached: the cost per draft token is a dictionary lookup after the first occurrence.
  * "final": the target's final hidden state of the draft token (from the verify pass) against the final
    hidden states at the visual positions. Context-dependent, one [n_visual, H] matvec per draft token.
- Greedy only. With lam = 0 and shift_window = 0 the output is token-identical to vanilla.
- The method name is "lvspec:<inner>" and `info["lossy"]` is True, so results and metrics say it.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch

from decoders.accept import loose_accept
from decoders.engine import Draft, Proposer, Verified
from decoders.sampling import DecodeConfig
from decoders.session import VisualSession

REPRESENTATIONS = ("input", "final")


def relevance_scores(token_states: torch.Tensor, visual_states: torch.Tensor, top_n: int) -> torch.Tensor:
    """Mean of the top-N cosine similarities of each token with the visual states.

    token_states: [n, H] (any norm); visual_states: [n_visual, H] unit-normalised -> [n] in [-1, 1].
    """
    x = torch.nn.functional.normalize(token_states.float(), dim=-1)
    sims = x @ visual_states.float().T  # [n, n_visual]
    n = min(top_n, sims.shape[-1])
    return torch.topk(sims, n, dim=-1).values.mean(dim=-1)


class LVSpecProposer:
    def __init__(
        self,
        inner: Proposer,
        lam: float = 0.5,
        relevance_threshold: float = 0.3,
        shift_window: int = 0,
        top_n: int = 10,
        representation: str = "input",
    ) -> None:
        if not 0.0 <= lam <= 1.0:
            raise ValueError(f"lam must be in [0, 1], got {lam}")
        if shift_window < 0 or top_n < 1:
            raise ValueError("shift_window must be >= 0 and top_n >= 1")
        if representation not in REPRESENTATIONS:
            raise ValueError(f"representation must be one of {REPRESENTATIONS}")
        self.inner = inner
        self.name = f"lvspec:{getattr(inner, 'name', 'draft')}"
        if hasattr(inner, "state_key"):  # loose acceptance teaches the controller other rates: its own one
            inner.state_key = f"{self.name}:{lam}:{shift_window}:{inner.state_key}"
        self.lam, self.threshold, self.window, self.top_n = lam, relevance_threshold, shift_window, top_n
        self.representation = representation
        self.session: VisualSession | None = None
        self._cache: dict[int, float] = {}
        self.anchors = 0
        self.scored = 0

    @property
    def info(self) -> dict:
        inner = dict(getattr(self.inner, "info", {}))
        share = self.anchors / self.scored if self.scored else None
        return {**inner, "lossy": True, "lam": self.lam, "shift_window": self.window, "anchor_share": share}

    def prefill(self, session: VisualSession, prompt_ids: list[int], cfg: DecodeConfig) -> torch.Tensor:
        if not cfg.greedy:
            raise ValueError("lvspec supports greedy decoding only (temperature 0)")
        if session.visual_states is None:
            raise ValueError("this session keeps no visual states; LVSpec needs them")
        self.session, self._cache = session, {}
        self.anchors = self.scored = 0
        return self.inner.prefill(session, prompt_ids, cfg)

    def propose(self, pending: int, max_tokens: int) -> Draft:
        return self.inner.propose(pending, max_tokens)

    def observe(self, outcome: Verified) -> None:
        self.inner.observe(outcome)

    def verify_watch(self) -> AbstractContextManager:
        watch = getattr(self.inner, "verify_watch", None)
        return watch() if watch is not None else nullcontext()

    def relevance(self, draft: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """[gamma] relevance of the draft tokens; hidden [gamma + 1, H] from the verify pass."""
        assert self.session is not None and self.session.visual_states is not None
        vis = self.session.visual_states[self.representation]
        if self.representation == "final":
            return relevance_scores(hidden[1:], vis, self.top_n)
        missing = [t for t in draft.tolist() if t not in self._cache]
        if missing:
            emb = self.session.lm.embed(torch.tensor([missing], device=vis.device))[0]
            for t, r in zip(missing, relevance_scores(emb, vis, self.top_n).tolist()):
                self._cache[t] = r
        return torch.tensor([self._cache[t] for t in draft.tolist()])

    def accept(self, draft: torch.Tensor, logits: torch.Tensor, hidden: torch.Tensor) -> tuple[int, int]:
        rel = self.relevance(draft, hidden)
        self.scored += rel.numel()
        self.anchors += int((rel >= self.threshold).sum())
        return loose_accept(draft, logits, rel, self.threshold, self.lam, self.window)
