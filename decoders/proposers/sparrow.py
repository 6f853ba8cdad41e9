"""Sparrow: a one-layer draft head that reuses the target's hidden states and never reads visual tokens.

Contract:
- `SparrowHead` input at draft position j: `fc(cat(norm(embed(x_{j+1})), h_j))`, where `embed` is the
  target's frozen token embedding and `h_j` the target's final (normed) hidden state at text token j (HSR:
  hidden-state reuse). One decoder layer (GQA self-attention with 1-D RoPE, SwiGLU MLP), a final norm, and
  the target's frozen `lm_head` give the logits for x_{j+2}. The head's output feature g_j estimates h_{j+1}
  and is fed back as `h` when drafting further ahead.
- Text-anchored attention (VATA): the head's own KV cache holds only text positions after the video (the
  prompt suffix and generated tokens), numbered 0, 1, 2, ... (compacted positions). Visual tokens are never
  read, so a draft step costs the same for a 10-second clip and a 2-hour film.
- `SparrowProposer` plugs into the engine: `prefill` runs the prompt through the target and the head;
  `propose` drafts up to gamma tokens recursively, ending a draft at its first end-of-sequence token
  (greedy drafts: one native call for the whole chain where the kernels are available, `native=True`; on a
  GPU the drafts after the first are replays of one captured CUDA graph, `decoders.proposers.sparrow_graph`);
  `observe` drops the head's speculative entries and re-encodes the committed tokens with the target's true
  hidden states.
- Saved beside the target as `sparrow/config.json` + `sparrow/model.safetensors` (`save_head`/`load_head`).
Lossless by construction: the engine verifies every draft densely. An untrained head is just slow.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from decoders.attention import small_q_attention
from decoders.engine import Draft, Verified
from decoders.fastpath import transposed
from decoders.gamma import GammaController
from decoders.model import VideoLM
from decoders.proposers.sparrow_graph import static_chain
from decoders.sampling import DecodeConfig, draft_token
from decoders.session import VisualSession

HEAD_DIR = "sparrow"


@dataclass(frozen=True)
class SparrowConfig:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    max_positions: int = 4096
    # how it was trained (metadata, also read by the ablations)
    ivsb: bool = True
    mtp_steps: int = 3

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError(f"inconsistent head counts in {self}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def for_target(cls, lm: VideoLM, **kw: object) -> SparrowConfig:
        cfg = lm.text_config
        return cls(
            hidden_size=cfg.hidden_size,
            num_heads=cfg.num_attention_heads,
            num_kv_heads=cfg.num_key_value_heads,
            intermediate_size=cfg.intermediate_size,
            **kw,  # type: ignore[arg-type]
        )


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + self.eps)).to(x.dtype) * self.weight


@dataclass
class HeadKV:
    """The head's own KV cache: text positions only. keys/values [1, Hkv, cap, D]."""

    keys: torch.Tensor
    values: torch.Tensor
    length: int = 0

    @classmethod
    def empty(cls, cfg: SparrowConfig, capacity: int, dtype: torch.dtype, device: torch.device) -> HeadKV:
        shape = (1, cfg.num_kv_heads, capacity, cfg.head_dim)
        return cls(
            torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)
        )

    def reserve(self, end: int) -> None:
        """Room for entries up to index `end` (the buffers at least double when they grow)."""
        if end > self.keys.shape[2]:
            grow = max(end, 2 * self.keys.shape[2])
            pad = (0, 0, 0, grow - self.keys.shape[2])
            self.keys, self.values = F.pad(self.keys, pad), F.pad(self.values, pad)

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = k.shape[2]
        end = self.length + n
        self.reserve(end)
        self.keys[:, :, self.length : end] = k
        self.values[:, :, self.length : end] = v
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]


def _rope_tables(d: int, theta: float, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [n, D] for positions 0..n-1 (rotate-half convention)."""
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, device=device, dtype=torch.float32) / d))
    ang = torch.arange(n, device=device, dtype=torch.float32)[:, None] * inv[None, :]  # [n, D/2]
    return torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, n, D]; cos/sin [n, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


# Devices whose head attention over its own cache goes through SDPA; elsewhere it takes the target's decode
# attention (`small_q_attention`: two matmuls around a softmax), in float32. On one H200 in bfloat16 (session
# 24) the head's drafts after the first of a cycle, the ones from one-row SDPA calls without a mask over the
# cache's strided K/V views, were accepted far less often than in float32 or than in bfloat16 on the CPU;
# the target's own attention path was right there. With this routing, session 26's H200 run accepted 6.78 /
# 4.86 tokens a cycle in bfloat16 at 0.5k / 1.5k (README); the `gpu`-marked test in tests/test_sparrow.py
# checks it.
HEAD_SDPA_DEVICES = ("cpu",)


def _cache_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """q [1, Hq, n, D] for the last n positions of the head cache keys / values [1, Hkv, L, D] (causal among
    those n) -> [n, Hq * D]."""
    n = q.shape[2]
    if q.device.type in HEAD_SDPA_DEVICES:
        mask = (
            None
            if n == 1
            else torch.ones(n, keys.shape[2], dtype=torch.bool, device=q.device).tril(keys.shape[2] - n)
        )
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
        return out.transpose(1, 2).reshape(n, -1)
    # in float32 whatever the model's dtype: the head's cache is a few hundred entries, and bf16 scores
    # would be rounded before the softmax
    f = torch.float32
    out = small_q_attention(q.to(f), keys.to(f), values.to(f), None, q.shape[-1] ** -0.5, causal_tail=True)
    return out.reshape(n, -1).to(q.dtype)  # [1, n, Hq, D] -> [n, Hq * D]


def _unit(x: torch.Tensor) -> torch.Tensor:
    """x / ||x|| over the last dim (rows of the head's lean step; see `SparrowHead.step_rows`)."""
    return x / torch.linalg.vector_norm(x, dim=-1, keepdim=True).clamp_min_(1e-12)


class SparrowHead(nn.Module):
    def __init__(self, cfg: SparrowConfig) -> None:
        super().__init__()
        self.cfg = cfg
        h, d = cfg.hidden_size, cfg.head_dim
        self.embed_norm = RMSNorm(h, cfg.rms_eps)
        self.fc = nn.Linear(2 * h, h, bias=True)
        self.attn_norm = RMSNorm(h, cfg.rms_eps)
        self.q_proj = nn.Linear(h, cfg.num_heads * d, bias=True)
        self.k_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=True)
        self.v_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=True)
        self.o_proj = nn.Linear(cfg.num_heads * d, h, bias=False)
        self.mlp_norm = RMSNorm(h, cfg.rms_eps)
        self.gate_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, h, bias=False)
        self.out_norm = RMSNorm(h, cfg.rms_eps)
        self._rope_cache: tuple[torch.Tensor, torch.Tensor] | None = None

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [n, D] for `positions` (a table grown on demand, so decoding computes none)."""
        end = int(positions.max()) + 1 if positions.numel() else 1
        if (
            self._rope_cache is None
            or self._rope_cache[0].shape[0] < end
            or self._rope_cache[0].device != positions.device
        ):
            size = max(end, 2 * (self._rope_cache[0].shape[0] if self._rope_cache else 1024))
            self._rope_cache = _rope_tables(self.cfg.head_dim, self.cfg.rope_theta, size, positions.device)
        cos, sin = self._rope_cache
        return cos[positions], sin[positions]

    def _fused_qkv(self) -> tuple[torch.Tensor, torch.Tensor]:
        if getattr(self, "_qkv", None) is None:
            w = torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight]).detach()
            bias = torch.cat([self.q_proj.bias, self.k_proj.bias, self.v_proj.bias]).detach()
            self._qkv = (w, bias)
        return self._qkv

    def train(self, mode: bool = True) -> SparrowHead:
        self._qkv = None  # weights may change: fuse again after training
        self._lean = None
        self._tokens = None
        return super().train(mode)

    def _lean_weights(self) -> tuple[torch.Tensor, ...]:
        """The inference step's weights: projections transposed to [in, out] (see `decoders.fastpath`),
        the attention and MLP norm weights folded into the projections that follow them, and `fc` split
        into its token half and its feature half."""
        if getattr(self, "_lean", None) is None:
            wqkv, bqkv = self._fused_qkv()
            wgu = torch.cat([self.gate_proj.weight, self.up_proj.weight]).detach()
            h = self.cfg.hidden_size
            wfc = self.fc.weight.detach()
            root = float(h) ** 0.5  # x / ||x|| * sqrt(H) is the RMS norm (eps aside): sqrt(H) folded in too
            t = transposed
            self._lean = (
                self.embed_norm.weight.detach(),
                t(wfc[:, :h]),  # token half [H, H]
                t(wfc[:, h:]),  # feature half [H, H]
                self.fc.bias.detach(),
                t(wqkv * (root * self.attn_norm.weight.detach())[None, :]),  # attn_norm folded in
                bqkv.detach(),
                t(self.o_proj.weight),
                t(wgu * (root * self.mlp_norm.weight.detach())[None, :]),  # mlp_norm folded in
                t(self.down_proj.weight),
                root * self.out_norm.weight.detach(),
            )
            self._tokens = None
        return self._lean

    def token_rows(self, embed: torch.Tensor) -> torch.Tensor | None:
        """The token half of the input layer for the whole vocabulary, `fc_tok(norm(embed)) + b` [V, H],
        computed once per embedding table (it depends on the token only), or None when the table would
        exceed 16M entries (a real model's vocabulary: then each step computes its own rows)."""
        self._lean_weights()
        if embed.numel() > 1 << 24:
            return None
        key = (embed.data_ptr(), tuple(embed.shape), embed.dtype)
        if self._tokens is None or self._tokens[0] != key:
            self._tokens = (key, self._token_half(embed.detach()))
        return self._tokens[1]

    def _token_half(self, emb: torch.Tensor) -> torch.Tensor:
        """emb [n, H] token embeddings -> `fc_tok(norm(emb)) + b` [n, H]."""
        en, wfc_tok, _, bfc = self._lean_weights()[:4]
        return torch.addmm(bfc, F.rms_norm(emb, (emb.shape[-1],), en, self.cfg.rms_eps), wfc_tok)

    def step(self, tok_emb: torch.Tensor, h: torch.Tensor, kv: HeadKV) -> torch.Tensor:
        """Inference only: `layer(fuse(tok_emb, h), positions kv.length.., kv)` with a third of the ops.

        tok_emb, h [1, n, H] -> features g [1, n, H]. Same function as the module path up to rounding
        (fused Q/K/V and gate/up GEMMs with the norm weights folded in, one RoPE call for q and k,
        `F.rms_norm`); tested against it. A draft step of this small head is dominated by per-op overhead,
        and every op saved here is saved gamma times a cycle. Rounding never reaches the output: drafts are
        verified.
        """
        return self.step_rows(self._token_half(tok_emb[0]), h, kv)

    def step_rows(self, tok_rows: torch.Tensor, h: torch.Tensor, kv: HeadKV) -> torch.Tensor:
        """`step` from the token half already applied: tok_rows [n, H] (rows of `token_rows`), h [1, n, H].

        The three RMS norms are computed as x / ||x|| with sqrt(H) and the norm weights folded into what
        follows (one `vector_norm` and a division instead of `F.rms_norm`'s five ops; the norm's eps, 1e-6
        against a mean square near 1, is dropped: the features differ from the module path by ~1e-6).
        """
        cfg = self.cfg
        _, _, wfc_h, _, wqkv, bqkv, wo, wgu, wdown, on = self._lean_weights()
        n = tok_rows.shape[0]
        nq, nkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        # 2-D rows [n, .] against [in, out] weights: addmm/mm with the bias or residual fused
        x = torch.addmm(tok_rows, h[0], wfc_h)  # [n, H]
        qk, v = torch.addmm(bqkv, _unit(x), wqkv).split([(nq + nkv) * d, nkv * d], dim=-1)
        past = kv.length
        cos, sin_signed = self.rope_tables(past, n, x.device)
        qk = qk.view(1, n, nq + nkv, d).transpose(1, 2)
        qk = torch.addcmul(qk * cos, qk.roll(d // 2, dims=-1), sin_signed)  # RoPE (`rope_signed`), q and k
        keys, values = kv.append(qk[:, nq:], v.view(1, n, nkv, d).transpose(1, 2))
        x = torch.addmm(x, _cache_attention(qk[:, :nq], keys, values), wo)
        gate, up = torch.mm(_unit(x), wgu).chunk(2, dim=-1)
        x = torch.addmm(x, F.silu(gate) * up, wdown)
        return (_unit(x) * on)[None]

    def rope_tables(self, start: int, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and [-sin | sin] [n, D] for positions start..start+n-1 (slices of a cached table)."""
        table = getattr(self, "_rope_signed", None)
        if table is None or table[0].shape[0] < start + n or table[0].device != device:
            size = max(start + n, 2 * (table[0].shape[0] if table is not None else 1024))
            cos, sin = _rope_tables(self.cfg.head_dim, self.cfg.rope_theta, size, device)
            half = self.cfg.head_dim // 2
            sin_signed = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1)
            dtype = self.fc.weight.dtype
            table = self._rope_signed = (cos.to(dtype), sin_signed.to(dtype))
        return table[0][start : start + n], table[1][start : start + n]

    def fuse(self, tok_emb: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """[.., H] token embeddings and target (or predicted) features -> the layer input [.., H]."""
        return self.fc(torch.cat([self.embed_norm(tok_emb), h], dim=-1))

    def layer(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        kv: HeadKV | None = None,
        attn_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One decoder layer + final norm. x [1, n, H]; positions [n] -> features g [1, n, H].

        With `kv`, the new keys/values are appended and queries attend to the whole cache (causally among
        the new ones). Without it (training), attention is causal over x, or uses `attn_mask` (bool,
        [n, n], True = attend) when given.
        """
        cfg = self.cfg
        b, n, _ = x.shape
        y = self.attn_norm(x)
        if self.training:
            q, k, v = self.q_proj(y), self.k_proj(y), self.v_proj(y)
        else:  # one GEMM for q, k, v at inference (weights fused once)
            q, k, v = F.linear(y, *self._fused_qkv()).split(
                [
                    cfg.num_heads * cfg.head_dim,
                    cfg.num_kv_heads * cfg.head_dim,
                    cfg.num_kv_heads * cfg.head_dim,
                ],
                -1,
            )
        q = q.view(b, n, cfg.num_heads, cfg.head_dim).transpose(1, 2)
        k = k.view(b, n, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
        v = v.view(b, n, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
        cos, sin = self.rope(positions)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        if kv is not None:  # inference (batch 1): the new rows over the whole head cache
            k, v = kv.append(k, v)
            out = _cache_attention(q, k, v).view(b, n, -1)
        else:
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=attn_mask, is_causal=attn_mask is None, enable_gqa=True
            ).transpose(1, 2)
        x = x + self.o_proj(out.reshape(b, n, -1))
        y = self.mlp_norm(x)
        x = x + self.down_proj(F.silu(self.gate_proj(y)) * self.up_proj(y))
        return self.out_norm(x)


def save_head(head: SparrowHead, target_dir: str | Path, extra: dict | None = None) -> Path:
    from safetensors.torch import save_file

    out = Path(target_dir) / HEAD_DIR
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps({**asdict(head.cfg), **(extra or {})}, indent=2))
    save_file(
        {k: v.detach().float().contiguous() for k, v in head.state_dict().items()}, out / "model.safetensors"
    )
    return out


def head_path(target_dir: str | Path) -> Path:
    return Path(target_dir) / HEAD_DIR


def load_head(target_dir: str | Path, lm: VideoLM) -> SparrowHead:
    from safetensors.torch import load_file

    d = head_path(target_dir)
    if not (d / "config.json").is_file() or not (d / "model.safetensors").is_file():
        raise FileNotFoundError(f"no Sparrow draft head under {d} (train one with `vidspec train-draft`)")
    raw = json.loads((d / "config.json").read_text())
    fields = SparrowConfig.__dataclass_fields__
    cfg = SparrowConfig(**{k: v for k, v in raw.items() if k in fields})
    if cfg.hidden_size != lm.hidden_size:
        raise ValueError(f"draft head hidden size {cfg.hidden_size} != target's {lm.hidden_size}")
    head = SparrowHead(cfg)
    head.load_state_dict(load_file(d / "model.safetensors"))
    return head.to(device=lm.device, dtype=lm.dtype).eval()


def head_metadata(target_dir: str | Path) -> dict:
    p = head_path(target_dir) / "config.json"
    return json.loads(p.read_text()) if p.is_file() else {}


class SparrowProposer:
    name = "sparrow"

    def __init__(
        self,
        head: SparrowHead,
        gamma: int = 6,
        adaptive: bool = True,
        gamma_max: int = 12,
        visual_context: int = 0,
        native: bool = True,
    ) -> None:
        """`visual_context` > 0 is an ABLATION, not Sparrow: the head's cache starts with that many of the
        target's middle-layer visual states (evenly spaced; needs a session made with `capture_layer`), so
        the head attends to visual tokens as in IVSB training.
        `native` (default): greedy drafts run as one native call per cycle where the kernels are available
        (`decoders.kernels.NativeSparrow`); otherwise, and for sampled drafts, one torch step per token."""
        if gamma < 1:
            raise ValueError("gamma must be >= 1")
        self.visual_context = visual_context
        self.native = native
        self.head = head
        self.gamma0, self.gamma, self.adaptive, self.gamma_max = gamma, gamma, adaptive, max(gamma, gamma_max)
        # which of the session's draft-length controllers this proposer uses (LVSpec marks its inner one)
        # (native and torch drafts cost differently: each keeps its own controller)
        self.state_key = f"sparrow:{id(head)}:{self.gamma_max}:{int(native)}"
        self.info: dict = {}
        self.session: VisualSession | None = None
        self.kv: HeadKV | None = None
        self.h_last: torch.Tensor | None = None  # target feature of the last committed token [1, 1, H]
        # committed (feature, next token) pairs not yet encoded: done together with the next draft step
        self.todo_h: torch.Tensor | None = None  # [1, m, H]
        self.todo_ids: list[int] = []
        self.committed = 0
        self.cfg = DecodeConfig()
        self.generator: torch.Generator | None = None
        self.controller = GammaController(gamma, 1, self.gamma_max)
        self.draft_step_s = 0.0  # mean draft-step time of the last proposal
        self.stop: frozenset[int] = frozenset()  # end-of-sequence ids: a draft ends at the first one

    def _encode(self, h: torch.Tensor, next_ids: list[int]) -> torch.Tensor:
        """Append head entries for pairs (h_j, x_{j+1}); return the head features [1, n, H]."""
        assert self.kv is not None and self.session is not None
        lm = self.session.lm
        embed = lm.text_model.embed_tokens.weight
        table = self.head.token_rows(embed)
        if table is None:  # a large vocabulary: the token half computed per step
            emb = F.embedding(torch.tensor([next_ids], device=lm.device), embed)
            return self.head.step(emb, h, self.kv)
        if len(next_ids) == 1:  # a draft step: one row of the table, a view
            rows = table[next_ids[0] : next_ids[0] + 1]
        else:
            rows = table[torch.tensor(next_ids, device=lm.device)]
        return self.head.step_rows(rows, h, self.kv)

    @torch.inference_mode()
    def prefill(self, session: VisualSession, prompt_ids: list[int], cfg: DecodeConfig) -> torch.Tensor:
        hidden = session.extend(prompt_ids)  # [1, n, H] target features of the prompt suffix
        self.session, self.cfg = session, cfg
        lm = session.lm
        self.stop = frozenset() if cfg.ignore_eos else frozenset(lm.eos_token_ids)
        self.kv = HeadKV.empty(self.head.cfg, len(prompt_ids) + cfg.max_new_tokens + 32, lm.dtype, lm.device)
        if self.visual_context:
            states = (session.visual_states or {}).get("mid")
            if states is None:
                raise ValueError("visual_context needs a session created with capture_layer")
            pick = (
                torch.linspace(0, states.shape[0] - 1, min(self.visual_context, states.shape[0]))
                .round()
                .long()
            )
            x = states[pick][None].to(lm.dtype)
            self.head.layer(x, torch.arange(x.shape[1], device=lm.device), self.kv)
        self.committed = self.kv.length
        self.todo_h, self.todo_ids = hidden[:, :-1], list(prompt_ids[1:])
        self.h_last = hidden[:, -1:]
        if self.adaptive:  # the video's controller: it carries over from the previous prompt
            self.controller = session.draft_controller(
                self.state_key, lambda: GammaController(self.gamma0, 1, self.gamma_max)
            )
        else:
            self.controller = GammaController(self.gamma0, 1, self.gamma_max)
        self.gamma = self.controller.gamma
        self.generator = None
        if not cfg.greedy:
            self.generator = torch.Generator(device=lm.device)
            self.generator.manual_seed((cfg.seed or 0) + 104729)
        self.info = {"gamma": self.gamma, "head_entries": self.committed}
        return hidden

    @torch.inference_mode()
    def propose(self, pending: int, max_tokens: int) -> Draft:
        assert self.session is not None and self.h_last is not None
        lm = self.session.lm
        g = min(self.gamma, max_tokens)
        assert self.kv is not None
        # the first step also encodes the committed pairs left by `observe` (one layer call, not two)
        self.kv.length = self.committed
        todo_h = self.todo_h if self.todo_h is not None else self.h_last[:, :0]
        feat = torch.cat([todo_h, self.h_last], dim=1)
        ids = [*self.todo_ids, pending]
        tokens: list[int] = []
        probs: list[torch.Tensor] = []
        steps = 0  # draft steps computed (the draft-step cost the controller weighs)
        # greedy drafts after the first on a GPU: one CUDA graph replay each (`sparrow_graph`), else None
        # (made, and on first use captured, before the draft time is measured)
        chain = static_chain(self.head, lm) if self.generator is None and g > 1 else None
        t0 = time.perf_counter()
        native = self._native_chain() if self.generator is None else None
        if native is not None:
            drafted = native.chain(ids, feat, self.kv, g, self.stop)
            if drafted is not None:
                self.committed += len(self.todo_ids)  # those entries are committed text now
                self.todo_h, self.todo_ids = None, []
                self.draft_step_s = (time.perf_counter() - t0) / len(drafted)
                return Draft(drafted, None)
        for step in range(g):
            steps = step + 1
            feat = self._encode(feat, ids)[:, -1:]  # [1, 1, H]: predicted feature of the last id
            if self.todo_ids:
                self.committed += len(self.todo_ids)  # those entries are committed text now
                self.todo_h, self.todo_ids = None, []
            tok, p = draft_token(lm.logits(feat[0, -1]), self.cfg, self.generator)
            if p is not None:
                probs.append(p)
            tokens.append(tok)
            if tok in self.stop:  # nothing after an end of sequence is ever emitted: stop drafting
                break
            ids = [tok]
            if step == 0 and chain is not None:
                more = chain.run(self.kv.keys, self.kv.values, self.kv.length, tok, feat, g - 1)
                if more is not None:  # the rest of the chain; cut after its first end of sequence
                    for t in more:
                        tokens.append(t)
                        if t in self.stop:
                            break
                    steps = g  # the chain drafts on past an end of sequence: g steps were paid for
                    break
        self.draft_step_s = (time.perf_counter() - t0) / max(1, steps)
        return Draft(tokens, torch.stack(probs) if probs else None)

    def _native_chain(self) -> object | None:
        """The head's native draft chain (built once per head and target), or None."""
        if not self.native or self.session is None:
            return None
        from decoders.kernels import NativeSparrow

        lm = self.session.lm
        cached = getattr(self.head, "_native_chain", None)
        if cached is not None and cached[0] is lm and (cached[1] is None or cached[1].current(self.head, lm)):
            return cached[1]
        made = NativeSparrow.create(self.head, lm)
        self.head._native_chain = (lm, made)
        return made

    @torch.inference_mode()
    def observe(self, outcome: Verified) -> None:
        assert self.kv is not None and self.h_last is not None
        # forget the speculative entries; the committed tokens are re-encoded with the target's true
        # features at the start of the next `propose` (pairs (h of the token before, token))
        self.kv.length = self.committed
        self.todo_h = torch.cat([self.h_last, outcome.hidden[None, :-1]], dim=1)
        self.todo_ids = list(outcome.tokens)
        self.h_last = outcome.hidden[None, -1:]
        if self.adaptive and outcome.drafted:
            self.gamma = self.controller.update(
                outcome.drafted, outcome.accepted, self.draft_step_s, outcome.verify_s
            )
        self.info["gamma"] = self.gamma


def init_head(lm: VideoLM, seed: int = 0, **kw: object) -> SparrowHead:
    """A freshly initialised head for `lm` (small init, fc starting near "use h")."""
    torch.manual_seed(seed)
    head = SparrowHead(SparrowConfig.for_target(lm, **kw))
    std = 0.02
    for name, p in head.named_parameters():
        if p.dim() == 2:
            nn.init.normal_(p, std=std / math.sqrt(2) if "o_proj" in name or "down_proj" in name else std)
        elif name.endswith("bias"):
            nn.init.zeros_(p)
    with torch.no_grad():  # start as "pass h through": fc = [0 | I]
        hsz = head.cfg.hidden_size
        head.fc.weight.zero_()
        head.fc.weight[:, hsz:] = torch.eye(hsz)
    return head.to(device=lm.device, dtype=lm.dtype)
