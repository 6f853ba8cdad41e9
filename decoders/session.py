"""`VisualSession`: the prefilled visual prefix of one video, reusable by many prompts.

Contract:
- `VisualSession.create(lm, visual)` runs the vision tower and prefills the system turn + video tokens into
  a preallocated `KVCache` once. The prefix is protected: it can never be truncated away.
- A prompt appends its suffix (question, end of user turn, assistant header) and generated tokens after
  the prefix, then `reset()` truncates back to the prefix (a length change), so the next prompt sees
  exactly the state a fresh prefill would give.
- Text after the prefix sits at position `cache index + rope_delta` (Qwen mRoPE: the first text position
  is the largest vision position + 1; LLaVA: rope_delta = 0).
- `extend(ids)` is the one way tokens enter the dense cache: it writes their K/V and returns their final
  hidden states. Drafters read what they need from the session (`visual_span`, the cache).
- `draft_controller(key, ...)` is the one piece of drafter state that outlives a prompt: the draft-length
  controller (`decoders.gamma`), shared by the prompts of one video and one kind of drafter. It changes how
  many tokens are drafted, never which tokens are emitted.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from decoders.cache import KVCache
from decoders.gamma import GammaController
from decoders.model import VideoLM, VisualInputs


@dataclass
class VisualSession:
    lm: VideoLM
    cache: KVCache
    prefix_len: int
    visual_span: tuple[int, int]  # [start, end) of the visual tokens in the cache
    rope_delta: int
    num_visual_tokens: int
    encode_s: float = 0.0  # vision tower seconds
    prefill_s: float = 0.0  # decoder prefill seconds of the prefix
    # unit-normalised visual representations for relevance scores (LVSpec): "input" = the vision tower's
    # output embeddings, "final" = the decoder's final hidden states at the visual positions
    visual_states: dict[str, torch.Tensor] | None = None
    # per drafter (its `state_key`): the draft-length controller of this video's prompts, so what a drafter
    # learned about acceptance and costs on this video carries over to its next prompt (`draft_controller`)
    draft_controllers: dict[str, GammaController] = field(default_factory=dict)

    @classmethod
    @torch.inference_mode()
    def create(
        cls,
        lm: VideoLM,
        visual: VisualInputs,
        headroom: int = 1024,
        chunk_tokens: int = 32768,
        capture_layer: int | None = None,
    ) -> VisualSession:
        """Encode the video and prefill its prefix; `headroom` entries are preallocated for prompts.

        `capture_layer`: also keep that decoder layer's output at the visual positions, as
        `visual_states["mid"]` (unnormalised; Sparrow's IVSB states, used by its ablations).
        """
        t0 = time.perf_counter()
        vis_emb = lm.encode_video(visual)  # [N_visual, hidden]
        t1 = time.perf_counter()
        layout = lm.prefix_ids(visual.num_tokens)
        ids = torch.tensor([layout.ids], device=lm.device)
        embeds = lm.embed(ids)  # [1, L, hidden]
        embeds[0, layout.visual_start : layout.visual_end] = vis_emb.to(embeds.dtype)
        positions, next_pos = lm.prefix_positions(layout, visual)
        n = len(layout.ids)
        cache = KVCache(lm.num_layers, lm.num_kv_heads, lm.head_dim, n + headroom, lm.dtype, lm.device)
        # Chunked prefill bounds activation memory for very long videos; each chunk attends to the cache.
        finals: list[torch.Tensor] = []
        mids: list[torch.Tensor] = []
        handle = None
        if capture_layer is not None:

            def keep(_module: object, _args: object, output: object) -> None:
                mids.append(output[0] if isinstance(output, tuple) else output)

            handle = lm.text_model.layers[capture_layer].register_forward_hook(keep)
        try:
            for s in range(0, n, chunk_tokens):
                e = min(n, s + chunk_tokens)
                finals.append(lm.forward(positions[..., s:e], cache, inputs_embeds=embeds[:, s:e]))
        finally:
            if handle is not None:
                handle.remove()
        cache.protect()
        final = torch.cat(finals, dim=1)[0, layout.visual_start : layout.visual_end]  # [N_visual, hidden]
        states = {
            "input": torch.nn.functional.normalize(vis_emb.float(), dim=-1).to(lm.dtype),
            "final": torch.nn.functional.normalize(final.float(), dim=-1).to(lm.dtype),
        }
        if mids:
            states["mid"] = torch.cat(mids, dim=1)[0, layout.visual_start : layout.visual_end].clone()
        t2 = time.perf_counter()
        return cls(
            lm=lm,
            cache=cache,
            prefix_len=n,
            visual_span=(layout.visual_start, layout.visual_end),
            rope_delta=next_pos - n,
            num_visual_tokens=visual.num_tokens,
            encode_s=t1 - t0,
            prefill_s=t2 - t1,
            visual_states=states,
        )

    @property
    def length(self) -> int:
        return self.cache.length

    def positions(self, start: int, n: int) -> torch.Tensor:
        """Positions of n tokens to be written at cache indices [start, start + n)."""
        return self.lm.text_positions(start + self.rope_delta, n)

    @torch.inference_mode()
    def extend(self, ids: list[int] | torch.Tensor, **kwargs: object) -> torch.Tensor:
        """Append tokens to the dense cache; return their final hidden states [1, n, hidden]."""
        if not isinstance(ids, torch.Tensor):
            ids = torch.tensor([ids], device=self.lm.device)
        if kwargs:
            n = ids.shape[-1]
            return self.lm.forward(self.positions(self.cache.length, n), self.cache, input_ids=ids, **kwargs)
        return self.lm.step(ids, self.cache.length + self.rope_delta, self.cache)

    def truncate(self, n: int) -> None:
        self.cache.truncate(n)

    def reset(self) -> None:
        """Drop everything after the visual prefix."""
        self.cache.truncate(self.prefix_len)

    @contextmanager
    def prompt(self) -> Iterator[VisualSession]:
        """Scope of one prompt: whatever happens inside, the session is back at its prefix afterwards."""
        self.reset()
        try:
            yield self
        finally:
            self.reset()

    def draft_controller(self, key: str, make: Callable[[], GammaController]) -> GammaController:
        """The draft-length controller drafters of kind `key` share on this session (the key names the
        drafter and the controller's bounds); `make()` creates it on first use.

        Answers on one video are decoded one after another; a controller that starts from what the previous
        answers taught it (acceptance rate, draft and verify costs, the draft length it chose) does not
        start every short answer from its prior. On the reference model's captions this measured a wash
        (README, "One controller per video").
        """
        c = self.draft_controllers.get(key)
        if c is None:
            c = self.draft_controllers[key] = make()
        return c

    def kv_bytes(self) -> int:
        """Bytes this session holds: the KV buffers and the visual states kept for relevance scores."""
        extra = sum(t.nbytes for t in (self.visual_states or {}).values())
        return self.cache.nbytes() + extra
