"""Loading a local video-LLM checkpoint, and everything that differs between model families.

Contract:
- `load_model(path, device="auto")` loads a Hugging Face checkpoint directory of Qwen2-VL, Qwen2.5-VL or
  LLaVA-OneVision offline (config, safetensors, tokenizer files, preprocessor config: the layout of the real
  releases). fp32 on CPU, bf16 on CUDA. A directory that is not such a checkpoint raises `CheckpointError`
  naming what is missing or unsupported.
- `VideoLM` is the only object that knows model families: chat template and placeholder tokens
  (`prefix_ids`, `suffix_ids`), frame preprocessing (`prepare_video`), the vision tower (`encode_video`),
  and positions (`prefix_positions`, `text_positions`). Everything else sees token ids, embeddings,
  positions and a cache.
- Qwen mRoPE follows the original Qwen rule: vision tokens take (t, h, w) positions offset by the start
  position; text after a vision block starts at the largest vision position + 1. transformers 5.24's
  `get_rope_index` advances by `max(h, w) // merge` only (ignoring the temporal extent), which is wrong for
  videos with more temporal groups than that; we never call it and always pass explicit positions.
- `forward` runs the decoder stack only (no vision tower) with explicit positions on a given cache and
  returns the final (normed) hidden states; `logits` applies the LM head.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

import torch
from torch import nn

from decoders.attention import ATTN_NAME, SMALL_Q, active_recorder
from decoders.fastpath import FastDecoder
from decoders.video import (
    DecodedVideo,
    SamplingConfig,
    normalize,
    patchify_qwen,
    resize_frames,
    smart_resize,
)

QWEN_SYSTEM_PROMPT = "You are a helpful assistant."

# qwen-vl-utils defaults for videos (per frame).
VIDEO_MIN_PIXELS = 128 * 28 * 28
VIDEO_MAX_PIXELS = 768 * 28 * 28


class CheckpointError(ValueError):
    """A directory is not a loadable checkpoint of a supported family."""


class Family(StrEnum):
    QWEN2_VL = "qwen2_vl"
    QWEN2_5_VL = "qwen2_5_vl"
    LLAVA_ONEVISION = "llava_onevision"

    @property
    def is_qwen(self) -> bool:
        return self in (Family.QWEN2_VL, Family.QWEN2_5_VL)


def _model_class(family: Family) -> type[nn.Module]:
    import transformers

    return {
        Family.QWEN2_VL: transformers.Qwen2VLForConditionalGeneration,
        Family.QWEN2_5_VL: transformers.Qwen2_5_VLForConditionalGeneration,
        Family.LLAVA_ONEVISION: transformers.LlavaOnevisionForConditionalGeneration,
    }[family]


@dataclass(frozen=True)
class VisualInputs:
    """Model-ready pixels of one video, and how many LLM tokens they become."""

    pixel_values: torch.Tensor  # qwen: [N_patches, C*tp*p*p]; llava: [1, F, 3, S, S]
    num_tokens: int
    grid_thw: tuple[int, int, int] | None = None  # qwen only
    second_per_grid_t: float | None = None  # qwen2.5 only: seconds covered by one temporal group
    num_frames: int = 0


@dataclass(frozen=True)
class PrefixLayout:
    """Token ids of the cached visual prefix (system turn + user header + video tokens)."""

    ids: list[int]
    visual_start: int  # index of the first visual token
    visual_end: int  # one past the last visual token (== len(ids): the prefix ends with the video)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but no CUDA device is available")
    return dev


def check_checkpoint_dir(path: Path) -> tuple[Family, dict]:
    """Validate the layout of a checkpoint directory; return its family and config dict."""
    if not path.exists():
        raise CheckpointError(f"checkpoint directory {path} does not exist")
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a directory (expected a Hugging Face checkpoint directory)")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{path} has no config.json: not a Hugging Face checkpoint directory")
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{config_file} is not valid JSON: {exc}") from exc
    model_type = config.get("model_type")
    try:
        family = Family(model_type)
    except ValueError:
        supported = ", ".join(f.value for f in Family)
        raise CheckpointError(
            f"{path}: model_type {model_type!r} is not supported (supported: {supported})"
        ) from None
    missing = []
    if not (any(path.glob("*.safetensors")) or (path / "model.safetensors.index.json").is_file()):
        missing.append("weights (*.safetensors)")
    if not ((path / "tokenizer.json").is_file() or (path / "vocab.json").is_file()):
        missing.append("tokenizer (tokenizer.json)")
    if not (path / "preprocessor_config.json").is_file():
        missing.append("preprocessor_config.json")
    if missing:
        raise CheckpointError(f"{path} ({family.value}) is missing: {', '.join(missing)}")
    return family, config


def qwen_vision_positions(
    start: int, grid_thw: tuple[int, int, int], merge_size: int, time_interval: float = 1.0
) -> torch.Tensor:
    """mRoPE positions [3, t*h*w/merge^2] of one video block starting at position `start`.

    Temporal index i -> start + floor(i * time_interval) (Qwen2.5-VL scales time; Qwen2-VL uses 1);
    row r -> start + r; column c -> start + c, over the merged grid in row-major (t, h, w) order.
    """
    t, h, w = grid_thw[0], grid_thw[1] // merge_size, grid_thw[2] // merge_size
    tt = (torch.arange(t, dtype=torch.float64) * time_interval).long()
    grid = torch.meshgrid(tt, torch.arange(h), torch.arange(w), indexing="ij")
    return torch.stack([g.reshape(-1) for g in grid]) + start


@dataclass
class VideoLM:
    """A loaded video LLM with its tokenizer; see the module docstring."""

    family: Family
    model: nn.Module
    tokenizer: object
    path: Path
    device: torch.device
    dtype: torch.dtype
    eos_token_ids: tuple[int, ...]
    preprocessor: dict = field(default_factory=dict)
    name: str = ""
    fast: FastDecoder | None = None  # lean forward for few-token text steps (None: use transformers')

    # -- structure -------------------------------------------------------------------------------
    @property
    def text_config(self) -> object:
        return self.model.config.text_config

    @property
    def text_model(self) -> nn.Module:
        return self.model.model.language_model

    @property
    def lm_head(self) -> nn.Module:
        return self.model.lm_head

    @property
    def num_layers(self) -> int:
        return self.text_config.num_hidden_layers

    @property
    def num_kv_heads(self) -> int:
        return self.text_config.num_key_value_heads

    @property
    def num_heads(self) -> int:
        return self.text_config.num_attention_heads

    @property
    def head_dim(self) -> int:
        cfg = self.text_config
        return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads

    @property
    def hidden_size(self) -> int:
        return self.text_config.hidden_size

    @property
    def video_token_id(self) -> int:
        cfg = self.model.config
        return cfg.video_token_id if self.family.is_qwen else cfg.video_token_index

    @property
    def merge_size(self) -> int:
        return self.model.config.vision_config.spatial_merge_size

    # -- prompt layout ----------------------------------------------------------------------------
    def encode_text(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def prefix_ids(self, num_visual_tokens: int) -> PrefixLayout:
        """System turn, user header, vision start and the video placeholders: the cached prefix."""
        head = f"<|im_start|>system\n{QWEN_SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\n"
        if self.family.is_qwen:
            head += "<|vision_start|>"
        ids = self.encode_text(head)
        start = len(ids)
        ids += [self.video_token_id] * num_visual_tokens
        return PrefixLayout(ids=ids, visual_start=start, visual_end=len(ids))

    def suffix_ids(self, question: str) -> list[int]:
        """What follows the video in the user turn, then the assistant header."""
        head = "<|vision_end|>" if self.family.is_qwen else "\n"
        return self.encode_text(f"{head}{question}<|im_end|>\n<|im_start|>assistant\n")

    # -- pixels -----------------------------------------------------------------------------------
    def default_sampling(self, fps: float = 2.0, max_frames: int = 768) -> SamplingConfig:
        pp = self.preprocessor
        if self.family.is_qwen:
            min_px = max(int(pp.get("min_pixels", VIDEO_MIN_PIXELS)), VIDEO_MIN_PIXELS)
            max_px = min(int(pp.get("max_pixels", VIDEO_MAX_PIXELS)), VIDEO_MAX_PIXELS)
            min_px = min(min_px, max_px)
            return SamplingConfig(fps=fps, max_frames=max_frames, min_pixels=min_px, max_pixels=max_px)
        return SamplingConfig(fps=fps, max_frames=max_frames, frame_factor=1)

    def prepare_video(self, video: DecodedVideo, sampling: SamplingConfig | None = None) -> VisualInputs:
        """Resize, normalise and (for Qwen) patchify sampled frames."""
        sampling = sampling or self.default_sampling()
        frames = video.frames
        if frames.ndim != 4 or frames.shape[0] == 0:
            raise ValueError("a video needs at least one frame of shape [H, W, 3]")
        pp = self.preprocessor
        mean = pp.get("image_mean", [0.48145466, 0.4578275, 0.40821073])
        std = pp.get("image_std", [0.26862954, 0.26130258, 0.27577711])
        if self.family.is_qwen:
            vcfg = self.model.config.vision_config
            patch, tps, merge = vcfg.patch_size, vcfg.temporal_patch_size, vcfg.spatial_merge_size
            h, w = smart_resize(
                frames.shape[1],
                frames.shape[2],
                factor=patch * merge,
                min_pixels=sampling.min_pixels,
                max_pixels=sampling.max_pixels,
            )
            x = normalize(resize_frames(frames, h, w), mean, std)
            pixels, grid = patchify_qwen(x, patch_size=patch, temporal_patch_size=tps, merge_size=merge)
            spg = tps / video.sample_fps if video.sample_fps > 0 else 1.0
            return VisualInputs(
                pixel_values=pixels.to(self.dtype),
                num_tokens=grid[0] * grid[1] * grid[2] // merge**2,
                grid_thw=grid,
                second_per_grid_t=spg if self.family is Family.QWEN2_5_VL else None,
                num_frames=frames.shape[0],
            )
        vcfg = self.model.config.vision_config
        side = vcfg.image_size
        x = normalize(resize_frames(frames, side, side), mean, std)
        per_frame = math.ceil(side // vcfg.patch_size / 2) ** 2
        return VisualInputs(
            pixel_values=x.unsqueeze(0).to(self.dtype),
            num_tokens=frames.shape[0] * per_frame + 1,  # + one newline token per video
            num_frames=frames.shape[0],
        )

    @torch.inference_mode()
    def encode_video(self, visual: VisualInputs, chunk_frames: int = 128) -> torch.Tensor:
        """Run the vision tower: [num_tokens, hidden] embeddings, in chunks of frames (bounded memory).

        Frames are encoded independently by all three towers (Qwen attends within a temporal group,
        Qwen2.5's windows stay inside one, SigLIP sees one frame), so chunking changes nothing.
        """
        inner = self.model.model
        px = visual.pixel_values.to(self.device)
        if self.family.is_qwen:
            assert visual.grid_thw is not None
            t, gh, gw = visual.grid_thw
            per_group = gh * gw
            groups = max(1, chunk_frames // self.model.config.vision_config.temporal_patch_size)
            outs = []
            for g0 in range(0, t, groups):
                g1 = min(t, g0 + groups)
                grid = torch.tensor([[g1 - g0, gh, gw]], device=self.device)
                out = inner.get_video_features(px[g0 * per_group : g1 * per_group], grid)
                outs.append(torch.cat(list(out.pooler_output), dim=0))
            emb = torch.cat(outs, dim=0)
        else:
            cfg = self.model.config
            outs = []
            frames = px.shape[1]
            for f0 in range(0, frames, chunk_frames):
                out = inner.get_video_features(
                    px[:, f0 : f0 + chunk_frames],
                    vision_feature_layer=cfg.vision_feature_layer,
                    vision_feature_select_strategy=cfg.vision_feature_select_strategy,
                )
                outs.append(out.pooler_output[0, :-1])  # drop the per-call newline token
            newline = inner.image_newline[None].to(outs[0].dtype)
            emb = torch.cat([*outs, newline], dim=0)
        assert emb.shape[0] == visual.num_tokens, (emb.shape, visual.num_tokens)
        return emb.to(self.dtype)

    # -- positions --------------------------------------------------------------------------------
    def prefix_positions(self, layout: PrefixLayout, visual: VisualInputs) -> tuple[torch.Tensor, int]:
        """Positions of the prefix tokens and the position of the first token after it.

        Qwen: [3, 1, L] mRoPE positions; LLaVA: [1, L]. The next position is the largest position + 1.
        """
        n = len(layout.ids)
        if not self.family.is_qwen:
            return torch.arange(n, device=self.device).view(1, n), n
        assert visual.grid_thw is not None
        interval = 1.0
        if self.family is Family.QWEN2_5_VL:
            tps = getattr(self.model.config.vision_config, "tokens_per_second", 2)
            interval = tps * (visual.second_per_grid_t or 1.0)
        before = torch.arange(layout.visual_start).view(1, -1).expand(3, -1)
        vis = qwen_vision_positions(layout.visual_start, visual.grid_thw, self.merge_size, interval)
        after = torch.arange(layout.visual_end, n).view(1, -1).expand(3, -1)
        # (the prefix ends with the video in our template, so `after` is empty)
        if after.numel():
            after = after - layout.visual_end + int(vis.max()) + 1
        pos = torch.cat([before, vis, after], dim=1)
        return pos.unsqueeze(1).to(self.device), int(pos.max()) + 1

    def text_positions(self, start: int, n: int) -> torch.Tensor:
        """Positions of n consecutive text tokens from `start`: [3, 1, n] (Qwen) or [1, n]."""
        pos = torch.arange(start, start + n, device=self.device).view(1, n)
        if self.family.is_qwen:
            return pos.view(1, 1, n).expand(3, 1, n)
        return pos

    # -- the decoder stack ------------------------------------------------------------------------
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.text_model.embed_tokens(ids)

    def forward(
        self,
        positions: torch.Tensor,
        cache: object,
        input_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs: object,
    ) -> torch.Tensor:
        """Decoder stack only: final normed hidden states [1, L, hidden] after writing K/V into `cache`."""
        if inputs_embeds is None:
            assert input_ids is not None
            inputs_embeds = self.embed(input_ids)
        out = self.text_model(
            inputs_embeds=inputs_embeds, position_ids=positions, cache=cache, use_cache=True, **kwargs
        )
        return out.last_hidden_state

    def step(self, input_ids: torch.Tensor, start: int, cache: object) -> torch.Tensor:
        """Text tokens [1, n] at text positions start.. (after the video) -> final hidden [1, n, H].

        Decode, verify and draft steps come here: the lean `FastDecoder` when it applies (few tokens; under
        attention recording only its native stack, which records too), else the transformers forward with
        explicit positions.
        """
        n = input_ids.shape[1]
        if self.fast is not None and n <= SMALL_Q:
            record = active_recorder()
            if record is None:
                return self.fast.forward(input_ids, start, cache)
            out = self.fast.recorded_forward(input_ids, start, cache, record)  # StD's scoring, natively
            if out is not None:
                return out
        return self.forward(self.text_positions(start, n), cache, input_ids=input_ids)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.fast is not None:
            return self.fast.logits(hidden)
        return self.lm_head(hidden).float()


def default_dtype(config: dict, device: torch.device) -> torch.dtype:
    """float32 on the CPU (the native kernels' dtype); elsewhere the checkpoint's own (`dtype`, or the older
    `torch_dtype`, at the top level or in `text_config`), bfloat16 when it names none. A float32 model (the
    reference model) thus stays in the dtype it was trained and measured in on a GPU too, where its speedups
    were measured (README "On an H200"); a real 7B checkpoint says bfloat16."""
    if device.type == "cpu":
        return torch.float32
    for where in (config, config.get("text_config") or {}):
        name = where.get("dtype") or where.get("torch_dtype")
        if isinstance(name, str) and name.removeprefix("torch.") in ("float32", "bfloat16", "float16"):
            return getattr(torch, name.removeprefix("torch."))
    return torch.bfloat16


def load_model(path: str | os.PathLike, device: str = "auto", dtype: torch.dtype | None = None) -> VideoLM:
    """Load a local checkpoint directory offline. See the module docstring."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_SDPA_FORCE_GQA", "1")
    from safetensors import SafetensorError
    from transformers import AutoTokenizer, GenerationConfig
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    root = Path(path)
    family, config = check_checkpoint_dir(root)
    dev = resolve_device(device)
    if dtype is None:
        dtype = default_dtype(config, dev)
    try:
        tokenizer = AutoTokenizer.from_pretrained(root, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{root}: the tokenizer files could not be loaded: {exc}") from exc
    try:
        model = _model_class(family).from_pretrained(
            root, dtype=dtype, local_files_only=True, attn_implementation="sdpa"
        )
    except (OSError, ValueError, RuntimeError, SafetensorError) as exc:
        raise CheckpointError(f"{root}: the {family.value} weights could not be loaded: {exc}") from exc
    # Text layers use our SDPA wrapper (identical to sdpa, can record text->visual attention for StD).
    model.set_attn_implementation({"text_config": ATTN_NAME, "vision_config": "sdpa"})
    model.to(dev).eval()
    eos: list[int] = []
    gen_file = root / "generation_config.json"
    if gen_file.is_file():
        gen = GenerationConfig.from_pretrained(root, local_files_only=True)
        eos += [gen.eos_token_id] if isinstance(gen.eos_token_id, int) else list(gen.eos_token_id or [])
    cfg_eos = getattr(model.config.text_config, "eos_token_id", None)
    eos += [cfg_eos] if isinstance(cfg_eos, int) else list(cfg_eos or [])
    if tokenizer.eos_token_id is not None:
        eos.append(tokenizer.eos_token_id)
    eos_ids = tuple(dict.fromkeys(e for e in eos if e is not None))
    if not eos_ids:
        raise CheckpointError(f"{root}: no EOS token id in generation_config.json, config.json or tokenizer")
    preprocessor = json.loads((root / "preprocessor_config.json").read_text())
    lm = VideoLM(
        family=family,
        model=model,
        tokenizer=tokenizer,
        path=root,
        device=dev,
        dtype=dtype,
        eos_token_ids=eos_ids,
        preprocessor=preprocessor,
        name=root.name,
    )
    if FastDecoder.supported(lm) and os.environ.get("VIDSPEC_FAST_DECODE", "1") != "0":
        lm.fast = FastDecoder(lm)
    return lm


def hf_generate_inputs(lm: VideoLM, visual: VisualInputs, prompt_ids: list[int]) -> dict[str, torch.Tensor]:
    """Keyword arguments for stock `model.generate` / `model(...)` on the same prompt our decoders see."""
    ids = torch.tensor([lm.prefix_ids(visual.num_tokens).ids + prompt_ids], device=lm.device)
    kw: dict[str, torch.Tensor] = {"input_ids": ids, "pixel_values_videos": visual.pixel_values.to(lm.device)}
    if lm.family.is_qwen:
        assert visual.grid_thw is not None
        kw["video_grid_thw"] = torch.tensor([visual.grid_thw], device=lm.device)
        kw["mm_token_type_ids"] = (ids == lm.video_token_id).long() * 2  # 2 = video
        if visual.second_per_grid_t is not None:
            kw["second_per_grid_ts"] = torch.tensor([visual.second_per_grid_t], device=lm.device)
    return kw
