"""Training the reference video LLM: a stock ``Qwen2VLForConditionalGeneration`` learned from scratch on CPU.

Contract
--------
* The model is a plain ``Qwen2VLForConditionalGeneration`` (``reference_config``): >= 8 decoder layers,
  grouped-query attention, fp32 safetensors well under 30 MB. The shipped directory (``export_checkpoint``)
  is standard HF layout (config, model.safetensors, tokenizer files, chat template, preprocessor and
  generation configs) and loads with ``decoders.model.load_model`` -- no hooks, no code changes.
* Training sees exactly the inference prompt layout: ``lm.prefix_ids(n_visual)`` (system turn, user header,
  vision start, video placeholders) then ``lm.suffix_ids(question)`` then the answer and ``<|im_end|>``; the
  pixels come from ``lm.prepare_video`` and positions from ``lm.prefix_positions`` / the text rule
  ``next_position + i`` (what ``VisualSession`` uses), always passed explicitly. The loss is on answer tokens
  only. Many prompts share one video: the prefix is run once and every prompt suffix attends to it through a
  block mask (prompt ``j`` sees the prefix and itself only), which is the same computation as one prefill plus
  one suffix per prompt.
* Remedy for the collapse of visual features seen earlier (``shared/research/training-from-scratch.md``),
  all of it stock-compatible: (1) pixels are normalised around the world's dim background
  (``PIXEL_MEAN`` / ``PIXEL_STD`` in the shipped preprocessor config, so inference normalises the same way);
  (2) during training only, an auxiliary per-token head on the RMS-normalised merger output predicts the
  colour, shape and motion direction of the object under each visual token (labels from the event log); the
  head is not part of the model and is dropped at export; (3) no weight decay on the vision tower.
* Optional count probe (``--count-weight``; off in the v2 recipe): a second training-only head reads the
  language model's hidden states at the visual positions (output of decoder layer ``--count-layer``) and
  predicts, at every visual token, the running counts of the objects shown so far (in all, per colour, per
  shape) and the entry rank of the object under the token (``count_labels``): dense labels for what
  counting and ordering questions need the visual KV cache to hold, where QA supervises a few tokens per
  video. Like the merger head, it is dropped at export.
* Frames are 112x112 (16 visual tokens per 2 frames); long-range training also uses 56x56 frames (4 tokens
  per 2 frames) so that thousands of frames -- the temporal positions of a one-hour video -- cost few tokens,
  plus a few genuine 16k+ token videos. Training videos are rendered with ``world.render_frames`` (a share of
  them round-tripped through h264 in memory, as evaluation reads real mp4 files).
* Reproducible by seed: the batch of step ``s`` depends only on ``(seed, s)``; world seeds of training are
  below ``EVAL_SEED0`` (evaluation uses seeds from it upwards, never seen in training).
* Resumable: ``state.pt`` in the work dir (model, EMA, aux head, optimizer, step, elapsed time, RNG state) is
  written atomically every ``--save-minutes`` and at the end; ``--resume`` continues from it. The exported
  weights are the exponential moving average of the training weights.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import random
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from decoders.model import Family, VideoLM
from decoders.protocol import LIST_PROMPT
from decoders.train import world as W
from decoders.train.tokenizer import QWEN_SPECIALS, build_tokenizer
from decoders.video import DecodedVideo, SamplingConfig, sample_indices, smart_nframes

__all__ = [
    "CAPTION_PROMPTS",
    "EVAL_SEED0",
    "PIXEL_MEAN",
    "PIXEL_STD",
    "SIZES",
    "ModelSize",
    "TrainConfig",
    "Trainer",
    "build_lm",
    "export_checkpoint",
    "main",
    "model_sampling",
    "reference_config",
]

EVAL_SEED0 = 1_000_000_000  # world seeds >= this are held out for evaluation


def question_turn_ids(lm: VideoLM, question: str) -> list[int]:
    """A second user turn after the list turn's ``<|im_end|>``, up to the assistant header."""
    return lm.encode_text(f"\n<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n")


CAPTION_PROMPTS: tuple[str, ...] = (
    "describe the video .",
    "what happens in the video ?",
    "describe what happens .",
    "caption the video .",
)
# Pixel statistics near the world's background (dim, ~0.15-0.2) so that objects stand out after normalising.
PIXEL_MEAN = [0.25, 0.25, 0.25]
PIXEL_STD = [0.3, 0.3, 0.3]
FRAME_SIDE = 112  # the model's default frame size (preprocessor min = max pixels = 112 * 112)
VOCAB_SIZE = 256


@dataclass(frozen=True)
class ModelSize:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vision_width: int
    vision_depth: int
    vision_heads: int
    mrope_section: tuple[int, int, int]  # (t, h, w) rotary pairs, summing to head_dim / 2


SIZES: dict[str, ModelSize] = {
    # 8 layers, GQA 4 query / 2 KV heads of dim 32; ~9 MB of fp32 weights.
    "reference": ModelSize(128, 8, 4, 2, 512, 96, 3, 3, (8, 4, 4)),
    # for tests: a few seconds per step
    "test": ModelSize(64, 2, 4, 2, 128, 32, 1, 2, (4, 2, 2)),
}


@dataclass(frozen=True)
class TrainConfig:
    seed: int = 0
    size: str = "reference"
    steps: int = 6000  # the planned schedule; a run may stop earlier (time budget) and resume later
    lr: float = 2e-3
    vision_lr_scale: float = 1.0
    warmup_steps: int = 100
    decay_frac: float = 0.15  # linear decay to 10% over the last decay_frac of the steps
    weight_decay: float = 0.01  # LLM matrices only; none on the vision tower, norms, biases
    grad_clip: float = 1.0
    ema_decay: float = 0.997
    aux_weight: float = 0.5
    qa_token_weight: float = 4.0  # QA answers are 1-3 tokens, captions 10-100: weight QA tokens up
    # two-turn QA: weight of the list turn's list tokens (a caption's are 1; its <|im_end|> keeps 1). A traced
    # answer (v7) repeated the list in every traced question, some 28 times per video; the list turn writes it
    # once (v17, v18: 1)
    list_token_weight: float = 1.0
    # two-turn QA: extra weight (on top of list_token_weight) of the list turn's direction words
    list_direction_weight: float = 1.0
    # two-turn QA: weight of the list turn's <|im_end|>, its decision to stop (a comma, the decision to go on,
    # weighs list_token_weight). At 1 with a list weight of 6 (v19-v27) the stop weighed a sixth of a
    # continuation, and most of v25's and v27's wrong short lists repeat their last item instead of ending.
    # Not on a drill's list (another world's), whose end keeps weight 1
    list_end_weight: float = 1.0
    # two-turn QA: weight of a training-only loss on the list turn's direction words read out early: the final
    # norm and the LM head applied to the hidden state after ``list_direction_layer`` decoder layers at the
    # positions that predict them (cross-entropy; 0 = off). ``benchmarks/direction_readout.py`` found v19's
    # head 0 reading direction off the object (90%) but its output projection not writing it (35%)
    list_direction_lens: float = 0.0
    list_direction_layer: int = 4
    # question sets drawn per training video (``world.questions`` called this many times, repeats of a
    # (type, answer, referenced objects) dropped): more questions about other objects of the same video
    # cost a few suffix tokens each, while the video's vision and prefix forward is paid once; 1 = v2-v4
    qa_sets: int = 1
    # train ``world.TRACED_QTYPES`` answers as ``world.answer_text``: the object list, then the answer (v6); the
    # list's tokens weigh like caption tokens, the answer's as qa_token_weight; False = the answer alone
    qa_trace: bool = False
    # the trace's form (``world.TRACE_STYLES``): "list", every object (v6, v7); "scan", ``world.scan_list``: a
    # filtered count carries a running count per item, a lookup's list stops at the object it reads; "cued",
    # ``world.cued_scan``: a scan with the question's cue written before every item
    qa_trace_style: str = "list"
    # weight of the decisions inside a traced answer's trace (the ``,`` / ``.`` after each item: go on or stop;
    # a scan's running count words), which otherwise weigh like caption tokens (1.0, v6-v8)
    trace_decision_weight: float = 1.0
    # share of training videos whose object count is drawn uniformly from 1..what fits (at most 10) instead
    # of the world's default (1-3 objects under 30 s, 2-4 under 5 min, 4-8 at an hour), as a schedule of
    # ``(from_step, share)`` pieces: v1-v8 drew 30% throughout, so lists of 5+ objects were rare at 112 px
    random_events: tuple[tuple[int, float], ...] = ((0, 0.3),)
    # with qa_trace and attention supervision: also supervise the traced answer's first token on the question's
    # visual refs (v6); False: only the list items are, the answer being read from the list written (v7)
    attn_traced_answer: bool = True
    # extra weight of some question types' answer tokens (on top of qa_token_weight): (("direction", 3.0),)
    qa_type_weights: tuple[tuple[str, float], ...] = ()
    tokens_per_step: int = 2048  # visual tokens per step for short videos
    max_batch_videos: int = 8
    codec_prob: float = 0.25  # share of training videos round-tripped through h264
    # warm phase: many cheap steps on very short videos (the LLM learns to read the video quickly)
    warm_steps: int = 1500
    warm_frames: tuple[int, int] = (4, 40)
    warm_tokens_per_step: int = 1024
    warm_max_videos: int = 4
    # after the warm phase: short / medium / long (small frames) / very long
    bucket_probs: tuple[float, float, float, float] = (0.5, 0.2, 0.27, 0.03)
    short_frames: tuple[int, int] = (4, 160)
    medium_frames: tuple[int, int] = (160, 560)
    long_frames: tuple[int, int] = (560, 2400)
    xl_frames: tuple[int, int] = (2000, 2200)
    frame_side: int = FRAME_SIDE
    small_side: int = 56
    # weights of the aux head's (colour, shape, direction) terms inside aux_weight
    aux_term_weights: tuple[float, float, float] = (1.0, 1.0, 1.0)
    # a second training-only head, on the language model's hidden states at the visual positions (output
    # of decoder layer ``count_layer``): at every visual token, the running counts of objects seen so far
    # (in all, per colour, per shape) and the entry rank of the object under the token. Dense labels for
    # what counting and ordering questions need the visual KV to hold; 0 = off (the v2 recipe)
    count_weight: float = 0.0
    count_layer: int = 6
    # continuation: start from an exported checkpoint instead of random weights (its training minutes
    # count against the total budget), optionally with a first phase that trains only the vision tower
    # and the aux head on short clips (the language model frozen, no LM loss)
    init_from: str | None = None
    vision_only_steps: int = 0
    # with init_from: continue the export's own schedule (same config, steps counted on from the export's
    # step, fresh AdamW moments re-warmed over warmup_steps): how a run crosses sessions that keep only git
    continue_schedule: bool = False
    # attention supervision (training only; 0 = off, the v2/v3 recipes): in decoder layers ``attn_layers``,
    # query head ``attn_head`` is trained to put its attention mass on the visual tokens of the objects an
    # answer is read from (``QA.refs``) at the position predicting a QA answer's first token, and on the
    # tokens of event ``i`` at every position predicting a token of a caption sentence about event ``i``
    # (``caption_attn``): a loss of ``-log(mass on those tokens)``, mean over QA positions plus mean over
    # caption positions
    attn_weight: float = 0.0
    attn_layers: tuple[int, ...] = (3, 5, 7)
    attn_head: int = 0
    # what a count question's first answer token attends to: "objects" (v4: every counted object, whose
    # running counts average to no count, and nothing for a zero count) or "end" (the video's last temporal
    # group, whose running counts, the count probe's labels, are the answer to every count, zero included)
    attn_count_target: str = "objects"
    # list-reading drill: per training video, this many extra traced questions whose trace is the list of
    # another, random world (1-10 objects) and whose answer is that list's. Only the answer after the trace
    # is supervised (weighted like a QA answer), never the trace nor its attention: the answer can only be
    # read from the trace, not from the video, which removes the shortcut that lets a model answer traced
    # questions from the video and never learn to look a word up in its own list (v7-v10); 0 = off
    drill_tasks: int = 0
    # two-turn QA (v11): per video, the object list (``world.object_list``) is asked first (``LIST_PROMPT``) and
    # every question is asked in a second turn after the model's list, answered with the answer alone
    # (``after_list``): the question's cue is a few tokens before the answer, and one list serves every
    # question of the video; captions are asked alone unless ``caption_turns``. Excludes qa_trace
    qa_turns: bool = False
    # with qa_turns: each question turn's reply repeats the question's cue first (``world.cued_answer``,
    # ``square . red``), so the answer is predicted at the cue word the lookup matches in the list (v12)
    qa_cue: bool = False
    # list-reading attention supervision (two-turn QA, v14), as a schedule of ``(from_step, weight)`` pieces
    # (0 = off): in ``attn_layers``, query head ``attn_list_head`` is trained to attend, at the position
    # predicting a lookup's answer, to the tokens of the list turn's item the answer is read from, and at the
    # positions predicting a cued reply's cue, to the cue words of the question (``list_attention_targets``):
    # the attention a copy from the model's own list needs, which v12/v13 never learned from the answers alone
    attn_list: tuple[tuple[int, float], ...] = ((0, 0.0),)
    attn_list_head: int = 2
    # with attn_list: weight of the copy loss, a schedule as attn_list (0 = off): the output of head
    # ``attn_list_head`` in the last of ``attn_layers`` at each list-attention position, read through the final
    # norm and the LM head on its own, is trained to predict the token that position predicts (the token its
    # attention is supervised onto): the head is trained to copy what it reads, not only where to look (v17)
    list_copy: tuple[tuple[int, float], ...] = ((0, 0.0),)
    # two-turn QA: the share of training videos whose list turn and questions are those of an altered world
    # (``world.altered_world``: one or two objects changed in colour, shape or direction), as a schedule of
    # ``(from_step, share)`` pieces (0 = off). The altered list is not a target (it contradicts the video); the
    # answers are the altered world's, so they can only be read from the list (v15)
    altered_lists: tuple[tuple[int, float], ...] = ((0, 0.0),)
    # two-turn QA: the share of training videos (of those whose list is the video's own) whose caption is asked
    # after the list turn, as the questions are (``after_list``), and so can be written from the list; the rest
    # ask it alone (0 = all alone, as before v23). The caption's attention targets are unchanged (as
    # ``caption_attn``, in query head ``attn_head``; its normaliser now includes the list's keys, so that head is kept
    # on the video while the other heads are free to read the list)
    caption_turns: float = 0.0
    # which caption sentence is about which event (``attention_targets``): "events" (session 47), as
    # ``world.caption_sentence_events`` reads the text (a motion sentence, ``it moves up .``, is about the event
    # before it); "periods", the rule of every run before: sentence ``i``, counted by periods, on event ``i``,
    # which put 56% of the caption tokens on the wrong event; "none": captions are not attention-supervised
    # (QA and lists still are). States saved before the field read as "periods"
    caption_attn: str = "events"


# ``(from_step, value)`` schedules that a resumed run may change for its untrained steps (``change_schedule``)
SCHEDULE_FIELDS = ("random_events", "attn_list", "altered_lists", "list_copy")
_INIT_FIELDS = ("init_from", "continue_schedule")  # may differ between the pieces of one schedule
AUX_FILE = "train_aux_head.safetensors"  # written beside an export on request; not part of the model


def _canon(v: object) -> object:
    if isinstance(v, list | tuple):
        return [_canon(x) for x in v]
    if isinstance(v, int | float) and not isinstance(v, bool):
        return float(v)
    return v


# fields added after configs were saved without them: what those configs were trained with
LEGACY_DEFAULTS: dict[str, object] = {"caption_attn": "periods"}


def config_diff(theirs: dict, mine: dict) -> dict[str, tuple[object, object]]:
    """Fields where two TrainConfig dicts differ (missing keys take the defaults, or in ``theirs``, a saved
    config, ``LEGACY_DEFAULTS``; init fields ignored)."""
    base = asdict(TrainConfig())
    a, b = {**base, **LEGACY_DEFAULTS, **theirs}, {**base, **mine}
    return {k: (a[k], b[k]) for k in base if k not in _INIT_FIELDS and _canon(a[k]) != _canon(b[k])}


# ---------------------------------------------------------------------------------------------- model


def reference_config(vocab: dict[str, int], size: ModelSize, init_std: float = 0.02) -> object:
    """A stock Qwen2-VL config of the given size."""
    import transformers

    head_dim = size.hidden // size.heads
    if sum(size.mrope_section) != head_dim // 2:
        raise ValueError(f"mrope_section {size.mrope_section} must sum to head_dim / 2 = {head_dim // 2}")
    text = {
        "vocab_size": len(vocab),
        "hidden_size": size.hidden,
        "intermediate_size": size.intermediate,
        "num_hidden_layers": size.layers,
        "num_attention_heads": size.heads,
        "num_key_value_heads": size.kv_heads,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-6,
        "initializer_range": init_std,
        "tie_word_embeddings": False,
        "eos_token_id": vocab["<|im_end|>"],
        "bos_token_id": vocab["<|endoftext|>"],
        "pad_token_id": vocab["<|endoftext|>"],
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 1_000_000.0,
            "mrope_section": list(size.mrope_section),
        },
    }
    vision = {
        "depth": size.vision_depth,
        "embed_dim": size.vision_width,
        "hidden_size": size.hidden,
        "num_heads": size.vision_heads,
        "mlp_ratio": 2,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "initializer_range": init_std,
    }
    return transformers.Qwen2VLConfig(
        text_config=text,
        vision_config=vision,
        initializer_range=init_std,
        image_token_id=vocab["<|image_pad|>"],
        video_token_id=vocab["<|video_pad|>"],
        vision_start_token_id=vocab["<|vision_start|>"],
        vision_end_token_id=vocab["<|vision_end|>"],
        tie_word_embeddings=False,
    )


def _vocab_words() -> list[str]:
    words = list(W.vocabulary())
    for p in CAPTION_PROMPTS:
        words += p.split()
    return words


def preprocessor_config(side: int = FRAME_SIDE) -> dict:
    return {
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen2VLProcessor",
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "min_pixels": side * side,
        "max_pixels": side * side,
        "image_mean": PIXEL_MEAN,
        "image_std": PIXEL_STD,
    }


def write_aux_files(out: Path, vocab: dict[str, int], side: int = FRAME_SIDE) -> None:
    """generation_config.json and preprocessor_config.json (the tokenizer is written by build_tokenizer)."""
    eos = [vocab["<|im_end|>"], vocab["<|endoftext|>"]]
    gen = {"eos_token_id": eos, "pad_token_id": vocab["<|endoftext|>"], "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    (out / "preprocessor_config.json").write_text(json.dumps(preprocessor_config(side), indent=2) + "\n")


def build_lm(tok_dir: Path, size: ModelSize, seed: int, side: int = FRAME_SIDE) -> VideoLM:
    """A fresh random-init model wrapped in ``VideoLM`` (tokenizer files are written to ``tok_dir``)."""
    from transformers import AutoTokenizer, Qwen2VLForConditionalGeneration
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    tok_dir.mkdir(parents=True, exist_ok=True)
    vocab = build_tokenizer(_vocab_words(), tok_dir, QWEN_SPECIALS, vocab_size=VOCAB_SIZE)
    write_aux_files(tok_dir, vocab, side)
    config = reference_config(vocab, size)
    config._attn_implementation = "sdpa"
    config.text_config._attn_implementation = "sdpa"
    config.vision_config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(config)
    tokenizer = AutoTokenizer.from_pretrained(tok_dir, local_files_only=True)
    return VideoLM(
        family=Family.QWEN2_VL,
        model=model,
        tokenizer=tokenizer,
        path=tok_dir,
        device=torch.device("cpu"),
        dtype=torch.float32,
        eos_token_ids=(vocab["<|im_end|>"], vocab["<|endoftext|>"]),
        preprocessor=preprocessor_config(side),
        name="vidspec-reference",
    )


def model_sampling(fps: float, side: int = FRAME_SIDE, max_frames: int = 100_000) -> SamplingConfig:
    """The sampling this model is trained and evaluated with: square ``side`` frames at ``fps``."""
    return SamplingConfig(
        fps=fps, min_frames=2, max_frames=max_frames, min_pixels=side * side, max_pixels=side * side
    )


def use_linear_patch_embed(model: nn.Module) -> None:
    """Run the vision tower's patch embedding as the matmul it is (training speed only, same weights).

    Qwen2-VL's ``PatchEmbed`` is a bias-free Conv3d whose kernel equals its input patch ``[C, T, P, P]``:
    exactly ``x @ W.view(embed, -1).T``. The CPU Conv3d kernels are several times slower than that matmul.
    """
    pe = model.model.visual.patch_embed
    if pe.proj.bias is not None:
        return

    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        w = pe.proj.weight
        return F.linear(hidden_states.to(w.dtype), w.view(w.shape[0], -1))

    pe.forward = forward


def use_batched_vision_attention(model: nn.Module) -> None:
    """Run the vision tower's attention as one batched call per layer (training speed only, same weights).

    Qwen2-VL's vision attention is block-diagonal: each temporal group of patches (``cu_seqlens``) attends
    only to itself. With an attention other than flash-attention, the stock module runs one
    ``scaled_dot_product_attention`` per group in a Python loop: hundreds to thousands of tiny calls per
    video (64 patches each at 112 px), forward and backward. When every group has the same length (one
    video grid, or a batch of equal grids, as in training), the same attention is one call over a
    ``[groups, heads, patches, head_dim]`` batch. Any other case runs the stock forward.
    """
    from transformers.models.qwen2_vl import modeling_qwen2_vl as qm

    for block in model.model.visual.blocks:
        attn = block.attn
        if "flash" in str(attn.config._attn_implementation):
            continue
        stock = attn.forward

        def forward(
            hidden_states: torch.Tensor,
            cu_seqlens: torch.Tensor,
            position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
            max_seqlen: int | None = None,
            _attn: nn.Module = attn,
            _stock: Callable[..., torch.Tensor] = stock,
            **kwargs: object,
        ) -> torch.Tensor:
            lengths = cu_seqlens[1:] - cu_seqlens[:-1]
            n = hidden_states.shape[0]
            if position_embeddings is None or lengths.numel() == 0 or bool((lengths != lengths[0]).any()):
                return _stock(
                    hidden_states,
                    cu_seqlens,
                    position_embeddings=position_embeddings,
                    max_seqlen=max_seqlen,
                    **kwargs,
                )
            groups, heads = lengths.numel(), _attn.num_heads
            q, k, v = _attn.qkv(hidden_states).reshape(n, 3, heads, -1).permute(1, 0, 2, 3).unbind(0)
            cos, sin = position_embeddings
            q, k = qm.apply_rotary_pos_emb_vision(q, k, cos, sin)
            q, k, v = (t.reshape(groups, n // groups, heads, -1).transpose(1, 2) for t in (q, k, v))
            out = F.scaled_dot_product_attention(q, k, v, scale=_attn.scaling)
            return _attn.proj(out.transpose(1, 2).reshape(n, -1))

        attn.forward = forward


COUNT_CLASSES = W.MAX_EVENTS + 1  # 0..MAX_EVENTS: a count, or an entry rank (0 = no object)
COUNT_COMPONENTS = 1 + len(W.COLOURS) + len(W.SHAPES) + 1  # all, per colour, per shape, entry rank


class AuxHead(nn.Module):
    """Training-only probe on the merger output: colour / shape / direction of the object under each token.

    ``counts``: also a probe on the language model's hidden states at the visual positions (``count_logits``)
    for the running counts and the entry rank (``count_labels``).
    """

    def __init__(self, hidden: int, counts: bool = False) -> None:
        super().__init__()
        self.proj = nn.Linear(hidden, (len(W.COLOURS) + 1) + (len(W.SHAPES) + 1) + (len(W.DIRECTIONS) + 1))
        self.count = nn.Linear(hidden, COUNT_COMPONENTS * COUNT_CLASSES) if counts else None

    def count_logits(self, h: torch.Tensor) -> torch.Tensor:
        """``[..., hidden]`` -> ``[..., COUNT_COMPONENTS, COUNT_CLASSES]``."""
        if self.count is None:
            raise ValueError("this aux head was built without the count probe")
        out = self.count(F.rms_norm(h, (h.shape[-1],)))
        return out.view(*h.shape[:-1], COUNT_COMPONENTS, COUNT_CLASSES)

    def forward(self, emb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = self.proj(F.rms_norm(emb, (emb.shape[-1],)))
        nc, ns = len(W.COLOURS) + 1, len(W.SHAPES) + 1
        return logits[..., :nc], logits[..., nc : nc + ns], logits[..., nc + ns :]


# ---------------------------------------------------------------------------------------------- data


@dataclass
class Task:
    prompt: str
    answer: str
    kind: str  # a qtype or "caption"
    refs: tuple[int, ...] = ()  # QA: ``QA.refs``; captions: unused (``attention_targets`` reads the text)
    # ``answer`` is ``world.answer_text``: a trace (the objects), `` . ``, then the answer
    traced: bool = False
    cue: str = ""  # QA: ``QA.cue``
    # a cued trace (``world.cued_scan``): each item starts with this many tokens of the cue, which are about
    # the question, not the item's object (no attention supervision towards the video)
    item_skip: int = 0
    # a list-reading drill (``TrainConfig.drill_tasks``): the trace is another world's, only the answer after
    # it is supervised, and ``refs`` are items of that trace, not events of the video (no attention to it)
    drill: bool = False
    # two-turn QA (``TrainConfig.qa_turns``): "list" for the first turn (``LIST_PROMPT``, the object list),
    # "question" for a question (or, with ``TrainConfig.caption_turns``, a caption) asked after it (sees the
    # list turn, positioned after it); "" otherwise
    turn: str = ""


@dataclass
class Sample:
    pixel_values: torch.Tensor
    grid_thw: tuple[int, int, int]
    num_tokens: int
    aux: torch.Tensor  # [num_tokens, 3] long: colour, shape, direction (0 = no object)
    tasks: list[Task]
    world: W.WorldSpec
    counts: torch.Tensor | None = None  # [num_tokens, COUNT_COMPONENTS] long: ``count_labels``
    ranks: torch.Tensor | None = None  # [num_tokens] long: entry rank of the object under the token, 0 = none


def _codec_roundtrip(frames: np.ndarray, fps: float) -> np.ndarray:
    """Encode to h264 in memory and decode again (what an mp4 file does to the pixels)."""
    import av

    buf = io.BytesIO()
    h, w = frames.shape[1:3]
    with av.open(buf, "w", format="mp4") as c:
        s = c.add_stream("libx264", rate=max(1, round(fps)), options={"crf": "23", "preset": "veryfast"})
        s.width, s.height, s.pix_fmt = w, h, "yuv420p"
        s.thread_count = 1
        for k, a in enumerate(frames):
            f = av.VideoFrame.from_ndarray(np.ascontiguousarray(a), format="rgb24")
            f.pts = k
            c.mux(s.encode(f))
        c.mux(s.encode(None))
    buf.seek(0)
    with av.open(buf) as c:
        st = c.streams.video[0]
        st.thread_type = "NONE"
        out = np.stack([f.to_ndarray(format="rgb24") for f in c.decode(st)])
    if out.shape[0] != frames.shape[0]:  # never expected; fall back to the raw frames
        return frames
    return out


def aux_labels(
    world: W.WorldSpec, times: np.ndarray, side: int, merge_px: int = 28, with_rank: bool = False
) -> torch.Tensor:
    """Per merged visual token (t-group, row, col): the object's (colour, shape, direction) ids, 0 = none.

    ``times``: the sampled frame times (even count; pairs form temporal groups). A token is labelled when
    an object's bounding box covers at least 20% of the smaller of the box and the token's cell.
    ``with_rank``: a fourth column, the object's entry rank in the event log (1 = first; 0 = none).
    """
    scale = side / min(world.width, world.height)
    cells = side // merge_px
    n_groups = len(times) // 2
    out = torch.zeros(n_groups, cells, cells, 4, dtype=torch.long)
    rank = {id(e): i + 1 for i, e in enumerate(world.events)}
    colours, shapes = tuple(W.COLOURS), W.SHAPES
    edges = np.arange(cells + 1) * merge_px
    for k, t in enumerate(times):
        for e in world.on_screen(float(t)):
            cx, cy = e.center_at(float(t))
            half = e.obj.size / 2
            x0, x1, y0, y1 = (
                (cx - half) * scale,
                (cx + half) * scale,
                (cy - half) * scale,
                (cy + half) * scale,
            )
            ox = np.clip(np.minimum(edges[1:], x1) - np.maximum(edges[:-1], x0), 0, None)
            oy = np.clip(np.minimum(edges[1:], y1) - np.maximum(edges[:-1], y0), 0, None)
            area = np.outer(oy, ox)  # [rows, cols]
            thresh = 0.2 * min((x1 - x0) * (y1 - y0), merge_px * merge_px)
            hit = torch.from_numpy(area >= thresh)
            lab = torch.tensor(
                [
                    colours.index(e.obj.colour) + 1,
                    shapes.index(e.obj.shape) + 1,
                    W.DIRECTIONS.index(e.direction) + 1,
                    rank[id(e)],
                ]
            )
            g = min(k // 2, n_groups - 1)
            out[g][hit] = lab
    return out.reshape(-1, 4) if with_rank else out[..., :3].reshape(-1, 3)


def count_labels(world: W.WorldSpec, times: np.ndarray, ranks: torch.Tensor) -> torch.Tensor:
    """Per visual token: running counts of the objects seen up to its temporal group (in all, per colour,
    per shape; an object counts from the first group in which a sampled frame shows it) and ``ranks``
    (the entry rank column of ``aux_labels(..., with_rank=True)``). ``[num_tokens, COUNT_COMPONENTS]``."""
    n_groups = len(times) // 2
    per_group = ranks.shape[0] // max(1, n_groups)
    colours = tuple(W.COLOURS)
    seen = torch.zeros(n_groups, COUNT_COMPONENTS - 1, dtype=torch.long)
    t = times[: 2 * n_groups]
    for e in world.events:
        after = t >= e.enter_s
        shown = np.nonzero(after & (t < e.leave_s))[0]  # ``Event.visible_at`` on every sampled frame
        if not len(shown):  # never on a sampled frame: counted from the first group after it entered
            shown = np.nonzero(after)[0]
            if not len(shown):
                continue
        g0 = int(shown[0]) // 2
        seen[g0:, 0] += 1
        seen[g0:, 1 + colours.index(e.obj.colour)] += 1
        seen[g0:, 1 + len(colours) + W.SHAPES.index(e.obj.shape)] += 1
    seen = seen.clamp(max=COUNT_CLASSES - 1).repeat_interleave(per_group, dim=0)
    return torch.cat([seen, ranks.clamp(max=COUNT_CLASSES - 1)[:, None]], dim=1)


def _tasks(
    world: W.WorldSpec,
    rng: np.random.Generator,
    n_captions: int = 1,
    qa_sets: int = 1,
    trace: bool = False,
    trace_style: str = "list",
    drill: int = 0,
    turns: bool = False,
    cue: bool = False,
    altered: W.WorldSpec | None = None,
    caption_turn: bool = False,
) -> list[Task]:
    """The tasks of a training video of ``world``. ``altered`` (two-turn QA; ``TrainConfig.altered_lists``):
    the list turn and the questions are this altered world's; its list is no target (``drill``), the captions
    stay the video's. ``caption_turn`` (two-turn QA; ``TrainConfig.caption_turns``): the captions are asked
    after the list turn too (never after an altered list, which they would contradict)."""
    tasks: list[Task] = []
    asked = world if altered is None else altered
    if turns:  # the list turn first: the question turns are packed after it and see it
        listed = Task(LIST_PROMPT, W.object_list(asked), "objects", traced=True, turn="list")
        tasks.append(listed if altered is None else replace(listed, drill=True))
    elif altered is not None:
        raise ValueError("an altered world's questions are asked after its list: they need turns")
    if caption_turn and not turns:
        raise ValueError("a caption asked after the list turn needs turns")
    seen: set[tuple[str, str, tuple[int, ...]]] = set()
    for _ in range(qa_sets):
        for q in W.questions(asked, rng):
            key = (q.qtype, q.answer, q.refs)
            if key not in seen:
                seen.add(key)
                traced = trace and q.qtype in W.TRACED_QTYPES
                answer = W.answer_text(asked, q, trace_style) if traced else q.answer
                skip = len(q.cue.split()) if traced and trace_style == "cued" and world.events else 0
                if turns and cue and q.cue:  # the cue is a one-item trace of no object (no attention target)
                    answer, traced, skip = W.cued_answer(q), True, len(q.cue.split())
                turn = "question" if turns else ""
                tasks.append(Task(q.question, answer, q.qtype, q.refs, traced, q.cue, skip, turn=turn))
    for _ in range(n_captions):
        prompt = CAPTION_PROMPTS[int(rng.integers(len(CAPTION_PROMPTS)))]
        after = caption_turn and altered is None
        tasks.append(Task(prompt, W.caption(world, rng), "caption", turn="question" if after else ""))
    for _ in range(drill):
        tasks.append(drill_task(rng, trace_style))
    return tasks


def drill_task(rng: np.random.Generator, trace_style: str = "list") -> Task:
    """One list-reading drill (``TrainConfig.drill_tasks``): a traced question about a random world of 1-10
    objects that is not the video's, answered after that world's trace (``world.answer_text``)."""
    other = W.make_world(int(rng.integers(0, EVAL_SEED0)), 600.0, 2.0, 112, 112, int(rng.integers(1, 11)))
    traced = [q for q in W.questions(other, rng) if q.qtype in W.TRACED_QTYPES]
    q = traced[int(rng.integers(len(traced)))]  # a count_colour / count_shape question always exists
    skip = len(q.cue.split()) if trace_style == "cued" else 0
    return Task(q.question, W.answer_text(other, q, trace_style), q.qtype, q.refs, True, q.cue, skip, True)


def make_sample(
    lm: VideoLM,
    rng: np.random.Generator,
    n_frames: int,
    fps: float,
    side: int,
    codec: bool,
    render_side: int | None = None,
    n_events: int | None = None,
    qa_sets: int = 1,
    qa_trace: bool = False,
    qa_trace_style: str = "list",
    drill: int = 0,
    qa_turns: bool = False,
    qa_cue: bool = False,
    altered_share: float = 0.0,
    caption_turn_share: float = 0.0,
) -> Sample:
    """One training video of ``n_frames`` sampled frames at ``fps``, its aux labels and its tasks
    (``altered_share``: the chance that they are asked about an altered world, ``TrainConfig.altered_lists``;
    ``caption_turn_share``: the chance that its caption is asked after the list, ``TrainConfig.caption_turns``)."""
    if caption_turn_share > 0 and not qa_turns:
        raise ValueError("a caption asked after the list turn needs qa_turns")
    render_side = render_side or side
    duration = n_frames / fps
    seed = int(rng.integers(0, EVAL_SEED0))
    try:
        world = W.make_world(seed, duration, fps, render_side, render_side, n_events=n_events)
    except ValueError:  # float rounding at world.py's capacity edge: a hair shorter, default count
        world = W.make_world(seed, duration - 0.005, fps, render_side, render_side)
    frames = np.stack(list(W.render_frames(world)))
    if codec:
        frames = _codec_roundtrip(frames, fps)
    sampling = model_sampling(fps, side)
    total = frames.shape[0]
    idx = sample_indices(total, smart_nframes(total, fps, sampling))
    frames = frames[idx]
    times = idx.astype(np.float64) / fps
    video = DecodedVideo(
        frames=frames,
        timestamps=times,
        sample_fps=len(idx) / total * fps,
        source_fps=fps,
        duration_s=duration,
        total_frames=total,
    )
    visual = lm.prepare_video(video, sampling)
    if len(times) % 2:
        times = np.concatenate([times, times[-1:]])
    aux = aux_labels(world, times, visual.grid_thw[1] * 14, with_rank=True)
    assert aux.shape[0] == visual.num_tokens, (aux.shape, visual.num_tokens)
    counts = count_labels(world, times, aux[:, 3])
    altered = None
    # no draw at a share of 0: the same batches as before either share existed
    if altered_share > 0 and rng.random() < altered_share:
        altered = W.altered_world(world, rng, int(rng.integers(1, 3)))
    caption_turn = caption_turn_share > 0 and bool(rng.random() < caption_turn_share)
    return Sample(
        visual.pixel_values,
        visual.grid_thw,
        visual.num_tokens,
        aux[:, :3],
        _tasks(
            world,
            rng,
            qa_sets=qa_sets,
            trace=qa_trace,
            trace_style=qa_trace_style,
            drill=drill,
            turns=qa_turns,
            cue=qa_cue,
            altered=altered,
            caption_turn=caption_turn,
        ),
        world,
        counts,
        aux[:, 3].clone(),
    )


def schedule_value(pieces: Sequence[tuple[int, float]], step: int) -> float:
    """The value of a ``(from_step, value)`` schedule at ``step``: the last piece starting at or before it."""
    value = 0.0
    for start, v in sorted(pieces):
        if start <= step:
            value = float(v)
    return value


def random_events_share(cfg: TrainConfig, step: int) -> float:
    """The share of ``cfg.random_events`` at ``step``."""
    return schedule_value(cfg.random_events, step)


def parse_schedule(
    text: str, flag: str, hi: float = 1.0, what: str = "SHARE"
) -> tuple[tuple[int, float], ...]:
    """``"0.6"`` -> ``((0, 0.6),)``; ``"0:0.3,2100:0.6"`` -> ``((0, 0.3), (2100, 0.6))``: values in
    ``[0, hi]``, steps increasing from 0 (ValueError naming ``flag`` if bad)."""
    out: list[tuple[int, float]] = []
    for part in filter(None, (x.strip() for x in text.split(","))):
        step, sep, value = part.rpartition(":")
        try:
            piece = (int(step) if sep else 0, float(value))
        except ValueError:
            raise ValueError(f"{flag}: {part!r} is not {what} or STEP:{what}") from None
        if piece[0] < 0 or not 0.0 <= piece[1] <= hi:
            raise ValueError(f"{flag}: {part!r} needs STEP >= 0 and {what} in [0, {hi:g}]")
        out.append(piece)
    steps = [s for s, _ in out]
    if not out or steps[0] != 0 or steps != sorted(set(steps)):
        raise ValueError(f"{flag}: {text!r} needs increasing steps starting at 0")
    return tuple(out)


def parse_random_events(text: str) -> tuple[tuple[int, float], ...]:
    """``--random-events``: a ``parse_schedule`` of shares in [0, 1]."""
    return parse_schedule(text, "--random-events")


def _n_events(rng: np.random.Generator, duration: float, fps: float, share: float = 0.3) -> int | None:
    """Mostly the world's default; ``share`` of the time any count that fits (so counts are read, not guessed
    from length, and long lists are seen at every length)."""
    if rng.random() < 1.0 - share:
        return None
    lo_vis, gap = max(3.0, 5.0 / fps), max(1.0, 2.0 / fps)
    cap = max(1, min(10, int((duration - 0.01) // (lo_vis + gap))))  # margin: world.py's slot test is exact
    return int(rng.integers(1, cap + 1))


def make_batch(lm: VideoLM, cfg: TrainConfig, step: int) -> tuple[str, list[Sample]]:
    """The batch of ``step``: a pure function of ``(cfg.seed, step)``."""
    rng = np.random.default_rng([cfg.seed, step])
    warm = step < cfg.warm_steps or step < cfg.vision_only_steps
    bucket = "warm" if warm else ("short", "medium", "long", "xl")[int(rng.choice(4, p=cfg.bucket_probs))]
    side, render_side = cfg.frame_side, None
    budget, max_videos = cfg.tokens_per_step, cfg.max_batch_videos
    if bucket in ("warm", "short"):
        lo, hi = cfg.warm_frames if warm else cfg.short_frames
        n = int(rng.integers(lo // 2, hi // 2 + 1)) * 2
        fps = float(rng.uniform(0.5, 4.0))
        if rng.random() < 0.15:
            render_side = 2 * side  # resized by prepare_video, as a larger mp4 would be
        if warm:
            budget, max_videos = cfg.warm_tokens_per_step, cfg.warm_max_videos
    elif bucket == "medium":
        n = int(rng.integers(cfg.medium_frames[0] // 2, cfg.medium_frames[1] // 2 + 1)) * 2
        fps = float(rng.uniform(0.4, 2.0))
    elif bucket == "long":
        n = int(rng.integers(cfg.long_frames[0] // 2, cfg.long_frames[1] // 2 + 1)) * 2
        fps = float(rng.uniform(0.3, 2.0))
        side = cfg.small_side
    else:
        n = int(rng.integers(cfg.xl_frames[0] // 2, cfg.xl_frames[1] // 2 + 1)) * 2
        fps = float(rng.uniform(0.5, 0.7))
    tokens = n // 2 * (side // 28) ** 2
    count = max(1, min(max_videos, budget // tokens)) if bucket in ("warm", "short") else 1
    samples = [
        make_sample(
            lm,
            rng,
            n,
            fps,
            side,
            codec=bool(rng.random() < cfg.codec_prob),
            render_side=render_side,
            n_events=_n_events(rng, n / fps, fps, random_events_share(cfg, step)),
            qa_sets=cfg.qa_sets,
            qa_trace=cfg.qa_trace,
            qa_trace_style=cfg.qa_trace_style,
            drill=cfg.drill_tasks,
            qa_turns=cfg.qa_turns,
            qa_cue=cfg.qa_cue,
            altered_share=schedule_value(cfg.altered_lists, step),
            caption_turn_share=cfg.caption_turns,
        )
        for _ in range(count)
    ]
    return bucket, samples


# ---------------------------------------------------------------------------------------------- forward


@dataclass
class BatchLoss:
    loss: torch.Tensor
    qa_loss: float
    caption_loss: float
    aux_loss: float
    qa_first_acc: float  # accuracy of the first answer token of QA tasks (teacher forced)
    n_tasks: int
    visual_tokens: int
    count_loss: float = float("nan")  # the count probe's loss (``TrainConfig.count_weight``), if on
    attn_loss: float = float("nan")  # the attention supervision's loss (``TrainConfig.attn_weight``), if on
    # accuracy of the drills' first answer tokens (``TrainConfig.drill_tasks``)
    drill_acc: float = float("nan")
    list_loss: float = float("nan")  # the list-reading attention loss (``TrainConfig.attn_list``), if on
    copy_loss: float = float("nan")  # its copy loss (``TrainConfig.list_copy``), if on
    # accuracy of the list turn's direction words (teacher forced; two-turn QA)
    list_direction_acc: float = float("nan")
    # two-turn QA: the share of list turns whose <|im_end|> (the list's end) is the argmax where it is due
    list_end_acc: float = float("nan")
    list_direction_lens: float = float("nan")  # the early read-out loss (``TrainConfig.list_direction_lens``)


COUNT_QTYPES = ("count", "count_colour", "count_shape")
# task kinds that are not questions: weighted like captions, outside the QA loss and accuracy
UNASKED_KINDS = frozenset({"caption", "objects"})
# ``refs`` of an attention target that names no event: the visual tokens of the video's last temporal group
LAST_GROUP: tuple[int, ...] = (-1,)
ATTN_COUNT_TARGETS = ("objects", "end")
CAPTION_ATTN = ("events", "periods", "none")


def answer_weights(
    answer_ids: Sequence[int],
    k0: int,
    answer_weight: float,
    decision_ids: frozenset[int],
    decision_weight: float,
) -> list[float]:
    """Loss weights of a task's answer tokens (``<|im_end|>`` included): a traced answer's trace (tokens before
    ``k0``) weighs like a caption, 1, except its decision tokens (``decision_ids``: separators and number
    words), which weigh ``decision_weight``; the answer proper from ``k0`` on weighs ``answer_weight``."""
    return [decision_weight if t in decision_ids else 1.0 for t in answer_ids[:k0]] + [answer_weight] * (
        len(answer_ids) - k0
    )


def list_turn_weights(
    weights: Sequence[float],
    list_ids: Sequence[int],
    token_weight: float,
    direction_weight: float,
    direction_ids: frozenset[int],
) -> list[float]:
    """Loss weights of a list turn's words and commas (``weights``, one per id of ``list_ids``): each times
    ``token_weight``, and a direction word (``direction_ids``) also times ``direction_weight``."""
    return [
        token_weight * w * (direction_weight if t in direction_ids else 1.0)
        for w, t in zip(weights, list_ids, strict=True)
    ]


def answer_targets(answer_ids: Sequence[int], k0: int, drill: bool = False) -> list[int]:
    """The targets of a task's answer tokens: all of them, but a drill's trace (tokens before ``k0``, another
    world's list) is not a target (-100): a drill supervises only the answer read from it."""
    return [-100] * k0 + list(answer_ids[k0:]) if drill else list(answer_ids)


def _answer_start(answer_ids: Sequence[int], period_id: int) -> int:
    """Index of a traced answer's first token after its object list (the one after the last period)."""
    last = max((k for k, t in enumerate(answer_ids) if t == period_id), default=-1)
    return last + 1


def attention_targets(
    sample: Sample,
    task: Task,
    answer_ids: Sequence[int],
    period_id: int,
    count_target: str = "objects",
    comma_id: int | None = None,
    traced_answer: bool = True,
    caption_attn: str = "events",
) -> list[tuple[int, tuple[int, ...]]]:
    """``(k, refs)``: the answer token ``k`` (0-based, into ``answer_ids``) whose prediction is supervised to
    attend to the events ``refs`` (indices into ``sample.world.events``; ``LAST_GROUP``: the tokens of the
    video's last temporal group).

    QA: the first answer token, on ``task.refs`` (none when empty); counts with ``count_target="end"`` on
    ``LAST_GROUP``, zero counts included (see ``TrainConfig.attn_count_target``). Captions (``task.answer``
    is the caption's text): every token of a sentence on the event it is about
    (``world.caption_sentence_events``: an object's sentence, and the motion sentence after it, ``it moves
    up .``, on that object's event), and the closing sentence on the objects on screen at the end; nothing
    when the sentences do not line up with the events. ``caption_attn="periods"``: the rule before session
    47 (``TrainConfig.caption_attn``), sentence ``i`` counted by periods on event ``i``; ``"none"``: captions
    have no attention targets.
    Traced QA (``task.traced``, needs ``comma_id``): every token of list item ``i`` on event ``i`` but its
    first ``task.item_skip`` (a cued trace's cue), then the answer's first token as an untraced QA's
    (``traced_answer``; otherwise not at all).
    """
    if count_target not in ATTN_COUNT_TARGETS:
        raise ValueError(f"count_target must be one of {ATTN_COUNT_TARGETS}, not {count_target!r}")
    if caption_attn not in CAPTION_ATTN:
        raise ValueError(f"caption_attn must be one of {CAPTION_ATTN}, not {caption_attn!r}")
    events = sample.world.events
    if task.traced:
        if comma_id is None:
            raise ValueError("a traced task's attention targets need comma_id")
        k0 = _answer_start(answer_ids, period_id)
        out_t: list[tuple[int, tuple[int, ...]]] = []
        item = j = 0  # j: the token's place in its item
        for k, t in enumerate(answer_ids[: k0 - 1] if events else ()):
            if item < len(events) and j >= task.item_skip:
                out_t.append((k, (item,)))
            j += 1
            if t == comma_id:
                item += 1
                j = 0
        if not traced_answer:
            return out_t
        plain = replace(task, traced=False)
        return out_t + [
            (k0 + k, refs) for k, refs in attention_targets(sample, plain, [], period_id, count_target)
        ]
    if task.kind in COUNT_QTYPES and count_target == "end":
        return [(0, LAST_GROUP)]
    if task.kind != "caption":
        return [(0, task.refs)] if task.refs else []
    if caption_attn == "none":
        return []
    n_periods = sum(1 for t in answer_ids if t == period_id)
    end = tuple(events.index(e) for e in sample.world.on_screen(sample.world.end_time))
    if caption_attn == "periods":
        # one sentence per event assumed, then the closing one: a motion sentence (``it moves up .``) shifts
        # the later targets by one event
        if not events or n_periods < len(events):
            return []
        refs = [(i,) if i < len(events) else end if i == len(events) else () for i in range(n_periods)]
    else:
        about = W.caption_sentence_events(task.answer)
        if not events or n_periods != len(about) or len({i for i in about if i is not None}) != len(events):
            return []
        refs = [end if i is None else (i,) for i in about]
    out: list[tuple[int, tuple[int, ...]]] = []
    sentence = 0
    for k, t in enumerate(answer_ids):
        if sentence < len(refs) and refs[sentence]:
            out.append((k, refs[sentence]))
        if t == period_id:
            sentence += 1
    return out


# the lookups whose answer is copied from one item of the object list (``Task.refs`` of one object)
LIST_LOOKUP_QTYPES = frozenset(
    {"colour_of_shape", "shape_of_colour", "first", "last", "shape_after", "colour_after", "direction", "end"}
)


def item_spans(list_ids: Sequence[int], comma_id: int) -> list[range]:
    """The token indices of each item of an object list's ids (items are separated by ``comma_id``)."""
    spans: list[range] = []
    start = 0
    for k, t in enumerate(list_ids):
        if t == comma_id:
            spans.append(range(start, k))
            start = k + 1
    spans.append(range(start, len(list_ids)))
    return spans


def find_last(seq: Sequence[int], sub: Sequence[int]) -> range | None:
    """The indices of the last occurrence of ``sub`` in ``seq`` (None: absent or empty)."""
    n = len(sub)
    for start in range(len(seq) - n, -1, -1) if n else ():
        if list(seq[start : start + n]) == list(sub):
            return range(start, start + n)
    return None


def list_attention_targets(
    task: Task,
    answer_ids: Sequence[int],
    period_id: int,
    items: Sequence[Sequence[int]],
    cue_keys: Sequence[int] = (),
) -> list[tuple[int, tuple[int, ...]]]:
    """``(k, keys)``: the answer token ``k`` of a two-turn question (``task.turn == "question"``) whose
    prediction is supervised to attend to the suffix positions ``keys`` (``TrainConfig.attn_list``).

    A lookup (``LIST_LOOKUP_QTYPES``, one ref): the answer's first token (after a cued reply's cue and period)
    on the list turn's item ``task.refs[0]`` (``items[i]``: the positions of item ``i``'s tokens); a cued
    reply's cue tokens on the question's cue words (``cue_keys``; none when empty). Nothing for other turns,
    for captions asked after the list (``TrainConfig.caption_turns``), for counts, and for a ref past the list
    (a list the tokens do not split into every object)."""
    if task.turn != "question":
        return []
    k0 = _answer_start(answer_ids, period_id) if task.traced else 0
    out = [(k, tuple(cue_keys)) for k in range(k0 - 1)] if cue_keys else []
    if task.kind in LIST_LOOKUP_QTYPES and len(task.refs) == 1 and task.refs[0] < len(items):
        out.append((k0, tuple(items[task.refs[0]])))
    return out


def head_projection(
    proj: nn.Linear, hs: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head: int, head_dim: int
) -> torch.Tensor:
    """One head's rotated query (``q_proj``) or key (``k_proj``) rows, as the attention computes them:
    ``hs`` ``[n, hidden]`` are the attention's (normed) inputs, ``cos`` / ``sin`` ``[n, head_dim]`` its rotary
    tables at those rows."""
    from transformers.models.qwen2_vl.modeling_qwen2_vl import rotate_half

    sl = slice(head * head_dim, (head + 1) * head_dim)
    x = F.linear(hs, proj.weight[sl], None if proj.bias is None else proj.bias[sl])
    return x * cos + rotate_half(x) * sin


@contextlib.contextmanager
def captured_attention_inputs(
    text_model: nn.Module, layers: Sequence[int]
) -> Iterator[dict[int, tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]]]:
    """Within the block, every forward through decoder layer ``l`` (``l in layers``) records the inputs of
    its attention: ``out[l] = (normed hidden states [b, n, hidden], (cos, sin) [b, n, head_dim])``."""
    out: dict[int, tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]] = {}

    def capture(layer: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            hs = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            out[layer] = (hs, kwargs["position_embeddings"])

        return hook

    hooks = [
        text_model.layers[layer].self_attn.register_forward_pre_hook(capture(layer), with_kwargs=True)
        for layer in layers
    ]
    try:
        yield out
    finally:
        for h in hooks:
            h.remove()


def _attention_loss(
    text_model: nn.Module,
    cfg: TrainConfig,
    captured: dict[int, tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]],
    cache: object,
    samples: Sequence[Sample],
    sel: list[list[tuple[int, tuple[int, ...], bool]]],
    visual_start: int,
    suffix_mask: torch.Tensor,
) -> torch.Tensor | None:
    """Mean of ``-log(attention mass on the referenced objects' visual tokens)`` of query head
    ``cfg.attn_head`` in ``cfg.attn_layers``, over QA positions plus over caption positions.

    ``sel[i]``: ``(row position, refs, is_qa)`` of sample ``i``'s supervised suffix positions. The queries are
    recomputed from the captured inputs of the layers' attention (their normed hidden states and rotary
    tables); the keys, prefix and suffix, are the cache's (after RoPE), so gradients reach both sides.
    """
    per_kind: dict[bool, list[torch.Tensor]] = {True: [], False: []}
    for i, s in enumerate(samples):
        if not sel[i] or s.ranks is None:
            continue
        n_vis = s.ranks.shape[0]
        refmask = torch.zeros(len(sel[i]), n_vis, dtype=torch.bool)
        for r, (_, refs, _) in enumerate(sel[i]):
            if refs == LAST_GROUP:  # visual tokens are time-major: the last grid_thw[0]-th of them
                refmask[r, n_vis - n_vis // s.grid_thw[0] :] = True
            else:
                refmask[r] = torch.isin(s.ranks, torch.tensor(refs) + 1)
        keep = refmask.any(dim=1)  # an object no sampled frame shows cannot be attended to
        if not keep.any():
            continue
        pos = torch.tensor([p for p, _, _ in sel[i]])[keep]
        is_qa = torch.tensor([q for _, _, q in sel[i]])[keep]
        # the keys each position sees (the whole prefix, its own prompt up to itself) and the referenced ones
        lp = cache.layers[cfg.attn_layers[0]].keys.shape[2] - suffix_mask.shape[-1]  # type: ignore[attr-defined]
        valid = torch.cat([torch.ones(len(pos), lp, dtype=torch.bool), suffix_mask[i, pos]], dim=1)
        ref = torch.zeros_like(valid)
        ref[:, visual_start : visual_start + n_vis] = refmask[keep]
        for layer in cfg.attn_layers:
            attn = text_model.layers[layer].self_attn
            hs, (cos, sin) = captured[layer]
            kv = cfg.attn_head // attn.num_key_value_groups
            q = head_projection(
                attn.q_proj, hs[i, pos], cos[i, pos], sin[i, pos], cfg.attn_head, attn.head_dim
            )
            keys = cache.layers[layer].keys[i, kv]  # type: ignore[attr-defined]  # [lp + ls, d]
            scores = (q @ keys.T * attn.scaling).masked_fill(~valid, float("-inf"))  # [n, lp + ls]
            lse_ref = torch.logsumexp(scores.masked_fill(~ref, float("-inf")), dim=1)
            nll = torch.logsumexp(scores, dim=1) - lse_ref
            for kind in (True, False):
                if (is_qa == kind).any():
                    per_kind[kind].append(nll[is_qa == kind])
    parts = [torch.cat(v).mean() for v in per_kind.values() if v]
    return sum(parts) if parts else None  # type: ignore[return-value]


def _list_attention_loss(
    text_model: nn.Module,
    cfg: TrainConfig,
    captured: dict[int, tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]],
    cache: object,
    sel: list[list[tuple[int, tuple[int, ...]]]],
    suffix_mask: torch.Tensor,
    copy: tuple[torch.Tensor, nn.Module] | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Mean of ``-log(attention mass on the target suffix positions)`` of query head ``cfg.attn_list_head`` in
    ``cfg.attn_layers`` (``sel[i]``: ``(row position, suffix positions)`` of sample ``i``), as
    ``_attention_loss`` computes it; positions a row does not see are no target. With ``copy``, ``(targets, lm_head)``
    (``targets`` ``[b, ls]``: the token each row position predicts), also the copy loss (``TrainConfig.list_copy``): the cross-entropy
    of the head's output in the last layer, through ``o_proj``'s columns of the head, the final norm and the LM
    head, against the token its position predicts. Returns ``(attention loss, copy loss)``."""
    parts: list[torch.Tensor] = []
    copies: list[torch.Tensor] = []
    ls = suffix_mask.shape[-1]
    for i, sel_i in enumerate(sel):
        if not sel_i:
            continue
        pos = torch.tensor([p for p, _ in sel_i])
        target = torch.zeros(len(sel_i), ls, dtype=torch.bool)
        for r, (_, keys) in enumerate(sel_i):
            target[r, list(keys)] = True
        seen = suffix_mask[i, pos]
        target &= seen
        keep = target.any(dim=1)
        if not keep.any():
            continue
        pos, target, seen = pos[keep], target[keep], seen[keep]
        for layer in cfg.attn_layers:
            attn = text_model.layers[layer].self_attn
            hs, (cos, sin) = captured[layer]
            kv = cfg.attn_list_head // attn.num_key_value_groups
            keys = cache.layers[layer].keys[i, kv]  # type: ignore[attr-defined]
            lp = keys.shape[0] - ls
            valid = torch.cat([torch.ones(len(pos), lp, dtype=torch.bool), seen], dim=1)
            ref = torch.cat([torch.zeros(len(pos), lp, dtype=torch.bool), target], dim=1)
            q = head_projection(
                attn.q_proj, hs[i, pos], cos[i, pos], sin[i, pos], cfg.attn_list_head, attn.head_dim
            )
            scores = (q @ keys.T * attn.scaling).masked_fill(~valid, float("-inf"))
            lse_ref = torch.logsumexp(scores.masked_fill(~ref, float("-inf")), dim=1)
            parts.append(torch.logsumexp(scores, dim=1) - lse_ref)
            if copy is not None and layer == cfg.attn_layers[-1]:
                targets, lm_head = copy
                values = cache.layers[layer].values[i, kv]  # type: ignore[attr-defined]  # [lp + ls, d]
                out = torch.softmax(scores, dim=1) @ values  # [n, head_dim]
                cols = slice(cfg.attn_list_head * attn.head_dim, (cfg.attn_list_head + 1) * attn.head_dim)
                contribution = out @ attn.o_proj.weight[:, cols].T  # [n, hidden]
                logits = lm_head(text_model.norm(contribution)).float()
                copies.append(F.cross_entropy(logits, targets[i, pos], reduction="none"))
    attn_loss = torch.cat(parts).mean() if parts else None
    return attn_loss, (torch.cat(copies).mean() if copies else None)


def batch_loss(
    lm: VideoLM,
    aux_head: AuxHead | None,
    samples: Sequence[Sample],
    cfg: TrainConfig,
    vision_only: bool = False,
    list_weight: float = 0.0,
    copy_weight: float = 0.0,
) -> BatchLoss:
    """Loss of one batch of same-grid videos, each with several prompts sharing its visual prefix.

    ``vision_only``: the aux loss alone (no language-model forward); needs an aux head. ``list_weight``: the
    weight of the list-reading attention loss (``TrainConfig.attn_list`` at the step; 0 = not computed);
    ``copy_weight``: its copy loss's (``TrainConfig.list_copy``; computed only with the attention loss).
    """
    model = lm.model
    text_model = lm.text_model
    grid = samples[0].grid_thw
    assert all(s.grid_thw == grid for s in samples)
    b = len(samples)
    px = torch.cat([s.pixel_values for s in samples])
    grids = torch.tensor([grid] * b)
    vis = model.model.get_video_features(px, grids).pooler_output  # tuple of [n_vis, hidden]
    vis = torch.stack(list(vis))  # [b, n_vis, hidden]
    n_vis = vis.shape[1]

    # aux loss on the merger output (training only)
    aux_loss = torch.zeros(())
    if aux_head is not None and cfg.aux_weight > 0:
        labels = torch.stack([s.aux for s in samples])  # [b, n_vis, 3]
        outs = aux_head(vis)
        for i, logits in enumerate(outs):
            nclass = logits.shape[-1]
            weight = torch.ones(nclass)
            weight[0] = 0.2
            aux_loss = aux_loss + cfg.aux_term_weights[i] * F.cross_entropy(
                logits.reshape(-1, nclass), labels[..., i].reshape(-1), weight=weight
            )
    if vision_only:
        if aux_head is None:
            raise ValueError("a vision-only step needs the aux head")
        return BatchLoss(
            loss=aux_loss,
            qa_loss=float("nan"),
            caption_loss=float("nan"),
            aux_loss=float(aux_loss.detach()),
            qa_first_acc=float("nan"),
            n_tasks=0,
            visual_tokens=b * n_vis,
        )

    # prefix: system turn + video
    layout = lm.prefix_ids(n_vis)
    head = torch.tensor([layout.ids[: layout.visual_start]])
    head_emb = lm.embed(head).expand(b, -1, -1)
    prefix_emb = torch.cat([head_emb, vis], dim=1)  # [b, Lp, hidden]
    from decoders.model import VisualInputs

    visual = VisualInputs(pixel_values=px[:0], num_tokens=n_vis, grid_thw=grid)
    pos, next_pos = lm.prefix_positions(layout, visual)  # [3, 1, Lp]
    lp = prefix_emb.shape[1]
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config.text_config)
    counting = aux_head is not None and aux_head.count is not None and cfg.count_weight > 0
    pre = text_model(
        inputs_embeds=prefix_emb,
        position_ids=pos.expand(3, b, lp),
        cache=cache,
        use_cache=True,
        output_hidden_states=counting,
    )
    count_loss = torch.zeros(())
    if counting:
        assert aux_head is not None
        h = pre.hidden_states[cfg.count_layer][:, layout.visual_start : layout.visual_start + n_vis]
        clog = aux_head.count_logits(h)  # [b, n_vis, COUNT_COMPONENTS, COUNT_CLASSES]
        lab = torch.stack([s.counts for s in samples])  # type: ignore[misc]
        count_loss = F.cross_entropy(clog[..., :-1, :].reshape(-1, COUNT_CLASSES), lab[..., :-1].reshape(-1))
        rank_w = torch.ones(COUNT_CLASSES)
        rank_w[0] = 0.2  # most tokens show no object
        count_loss = count_loss + F.cross_entropy(
            clog[..., -1, :].reshape(-1, COUNT_CLASSES), lab[..., -1].reshape(-1), weight=rank_w
        )

    # suffixes: each video's prompts packed one after another, each seeing the prefix and itself
    rows: list[list[int]] = []
    row_pos: list[list[int]] = []
    row_block: list[list[int]] = []
    targets: list[list[int]] = []  # -100 = no loss
    weights: list[list[float]] = []
    kinds: list[list[str]] = []
    im_end = lm.tokenizer.convert_tokens_to_ids("<|im_end|>")
    type_weight = {k: float(v) for k, v in cfg.qa_type_weights}
    attending = cfg.attn_weight > 0
    listing = list_weight > 0 and cfg.qa_turns
    period_id = lm.tokenizer.convert_tokens_to_ids(".")
    comma_id = lm.tokenizer.convert_tokens_to_ids(",")
    decision_ids = frozenset([period_id, comma_id, *(i for w in W.NUMBER_WORDS for i in lm.encode_text(w))])
    direction_ids = frozenset(i for d in W.DIRECTIONS for i in lm.encode_text(d))
    dir_pos: list[list[int]] = []  # per sample: the row positions predicting its list turn's direction words
    end_pos: list[list[int]] = []  # per sample: the row position predicting its list turn's <|im_end|>
    attn_sel: list[list[tuple[int, tuple[int, ...], bool]]] = []  # per sample: (row position, refs, is_qa)
    first_pos: list[list[int]] = []  # per sample: the row positions predicting each QA's (final) answer
    drill_pos: list[list[int]] = []  # per sample: the row positions predicting each drill's answer
    row_sees: list[list[bool]] = []
    list_blk: list[int] = []  # per sample: the block of its list turn (two-turn QA), -2 when none
    list_sel: list[list[tuple[int, tuple[int, ...]]]] = []  # per sample: (row position, suffix positions)
    for s in samples:
        list_blk.append(-2)
        items: list[range] = []  # the row positions of the list turn's items
        lsel_i: list[tuple[int, tuple[int, ...]]] = []
        fp_i: list[int] = []
        dp_i: list[int] = []
        dir_i: list[int] = []
        end_i: list[int] = []
        sel_i: list[tuple[int, tuple[int, ...], bool]] = []
        ids: list[int] = []
        p: list[int] = []
        blk: list[int] = []
        tgt: list[int] = []
        wt: list[float] = []
        kd: list[str] = []
        sees: list[bool] = []  # two-turn QA: the token is in a question turn (sees the list turn)
        list_end = next_pos  # two-turn QA: the position after the list turn
        for j, task in enumerate(s.tasks):
            asked = task.turn == "question"
            prompt = question_turn_ids(lm, task.prompt) if asked else lm.suffix_ids(task.prompt)
            ans = [*lm.encode_text(task.answer), im_end]
            seq = prompt + ans
            if task.turn == "list":  # all of it is the list (the trace of no answer)
                k0 = len(ans) - 1
                list_blk[-1], list_end = j, next_pos + len(seq)
                base = len(ids) + len(prompt)
                items = [range(base + r.start, base + r.stop) for r in item_spans(ans[:-1], comma_id)]
            else:
                # where the answer proper starts
                k0 = _answer_start(ans[:-1], period_id) if task.traced else 0
            if attending and not task.drill:
                at = len(ids) + len(prompt) - 1  # the row position predicting answer token 0
                if task.turn == "list":  # its items as a traced answer's, with a period closing the list
                    targets_k = attention_targets(
                        s, task, [*ans[:-1], period_id], period_id, cfg.attn_count_target, comma_id, False
                    )
                else:
                    targets_k = attention_targets(
                        s,
                        task,
                        ans[:-1],
                        period_id,
                        cfg.attn_count_target,
                        comma_id,
                        cfg.attn_traced_answer,
                        cfg.caption_attn,
                    )
                for k, refs in targets_k:  # a traced object list is averaged with the captions
                    sel_i.append((at + k, refs, task.kind not in UNASKED_KINDS and k >= k0))
            if listing and asked:
                at = len(ids) + len(prompt) - 1  # the row position predicting answer token 0
                cue = find_last(prompt, lm.encode_text(task.cue)) if task.cue else None
                cue_keys = [len(ids) + c for c in cue] if cue is not None else []
                for k, keys in list_attention_targets(task, ans[:-1], period_id, items, cue_keys):
                    lsel_i.append((at + k, keys))
            ids += seq
            start = list_end if asked else next_pos
            p += list(range(start, start + len(seq)))
            blk += [j] * len(seq)
            sees += [asked] * len(seq)
            # position i predicts seq[i + 1]: the last prompt token predicts the first answer token
            # a drill's trace is another world's: only the answer after it is a target
            t = [-100] * (len(prompt) - 1) + answer_targets(ans, k0, task.drill) + [-100]
            tgt += t
            w = 1.0 if task.kind in UNASKED_KINDS else cfg.qa_token_weight * type_weight.get(task.kind, 1.0)
            ans_at = len(ids) - len(seq) + len(prompt) - 1  # the row position predicting ans[0]
            if task.kind not in UNASKED_KINDS:
                (dp_i if task.drill else fp_i).append(ans_at + k0)
            # the traced object list weighs like a caption (but for its decisions); the answer after it (and
            # <|im_end|>) as QA; position len(prompt) - 1 + k predicts ans[k]
            aw = answer_weights(ans, k0, w, decision_ids, cfg.trace_decision_weight if task.traced else 1.0)
            if task.turn == "list":  # the list's words and commas; its <|im_end|> weighs list_end_weight
                aw = list_turn_weights(
                    aw[:k0], ans[:k0], cfg.list_token_weight, cfg.list_direction_weight, direction_ids
                ) + [x * (1.0 if task.drill else cfg.list_end_weight) for x in aw[k0:]]
                dir_i += [ans_at + k for k in range(k0) if ans[k] in direction_ids]
                if not task.drill:  # an altered world's list (a drill) ends where that world's does
                    end_i.append(ans_at + k0)
            wt += [1.0] * (len(prompt) - 1) + aw
            wt.append(1.0)  # the last position predicts nothing (target -100)
            kd += [task.kind] * len(seq)
        rows.append(ids)
        row_sees.append(sees)
        row_pos.append(p)
        row_block.append(blk)
        targets.append(tgt)
        weights.append(wt)
        kinds.append(kd)
        attn_sel.append(sel_i)
        list_sel.append(lsel_i)
        first_pos.append(fp_i)
        drill_pos.append(dp_i)
        dir_pos.append(dir_i)
        end_pos.append(end_i)
    ls = max(len(r) for r in rows)
    pad = lm.tokenizer.convert_tokens_to_ids("<|endoftext|>")
    ids_t = torch.full((b, ls), pad, dtype=torch.long)
    pos_t = torch.full((b, ls), next_pos, dtype=torch.long)
    blk_t = torch.full((b, ls), -1, dtype=torch.long)
    tgt_t = torch.full((b, ls), -100, dtype=torch.long)
    wt_t = torch.zeros(b, ls)
    is_qa = torch.zeros(b, ls, dtype=torch.bool)
    first_qa = torch.zeros(b, ls, dtype=torch.bool)
    first_drill = torch.zeros(b, ls, dtype=torch.bool)
    list_dir = torch.zeros(b, ls, dtype=torch.bool)
    list_stop = torch.zeros(b, ls, dtype=torch.bool)
    sees_t = torch.zeros(b, ls, dtype=torch.bool)
    for i in range(b):
        n = len(rows[i])
        ids_t[i, :n] = torch.tensor(rows[i])
        pos_t[i, :n] = torch.tensor(row_pos[i])
        blk_t[i, :n] = torch.tensor(row_block[i])
        tgt_t[i, :n] = torch.tensor(targets[i])
        wt_t[i, :n] = torch.tensor(weights[i])
        is_qa[i, :n] = torch.tensor([k not in UNASKED_KINDS for k in kinds[i]])
        sees_t[i, :n] = torch.tensor(row_sees[i])
        first_qa[i, first_pos[i]] = True
        first_drill[i, drill_pos[i]] = True
        list_dir[i, dir_pos[i]] = True
        list_stop[i, end_pos[i]] = True
    # mask [b, 1, ls, lp + ls]: prefix always; suffix keys of the same block at or before the query
    idx = torch.arange(ls)
    same = (blk_t[:, :, None] == blk_t[:, None, :]) & (blk_t[:, :, None] >= 0)
    # two-turn QA: a question turn also sees its video's list turn (packed before it)
    same |= sees_t[:, :, None] & (blk_t[:, None, :] == torch.tensor(list_blk)[:, None, None])
    causal = idx[None, :, None] >= idx[None, None, :]
    suffix_mask = same & causal
    mask = torch.cat([torch.ones(b, ls, lp, dtype=torch.bool), suffix_mask], dim=2)[:, None]
    spos = pos_t[None].expand(3, b, ls)
    lensing = cfg.list_direction_lens > 0 and bool(list_dir.any())
    if lensing and not 1 <= cfg.list_direction_layer <= len(text_model.layers):
        raise ValueError(f"list_direction_layer must be in 1..{len(text_model.layers)}")
    with captured_attention_inputs(text_model, cfg.attn_layers if attending or listing else ()) as captured:
        suffix_out = text_model(
            inputs_embeds=lm.embed(ids_t),
            position_ids=spos,
            cache=cache,
            attention_mask=mask,
            use_cache=True,
            output_hidden_states=lensing,
        )
    hidden = suffix_out.last_hidden_state
    lens_loss = None
    if lensing:
        early = suffix_out.hidden_states[cfg.list_direction_layer][list_dir]
        lens_loss = F.cross_entropy(lm.lm_head(text_model.norm(early)).float(), tgt_t[list_dir])
    attn_loss = None
    if attending:
        attn_loss = _attention_loss(
            text_model, cfg, captured, cache, samples, attn_sel, layout.visual_start, suffix_mask
        )
    list_loss = copy_loss = None
    if listing:
        copy = (tgt_t, lm.lm_head) if copy_weight > 0 else None
        list_loss, copy_loss = _list_attention_loss(
            text_model, cfg, captured, cache, list_sel, suffix_mask, copy
        )
    sel = tgt_t != -100
    logits = lm.lm_head(hidden[sel]).float()
    tg = tgt_t[sel]
    ce = F.cross_entropy(logits, tg, reduction="none")
    w = wt_t[sel]
    loss = (ce * w).sum() / w.sum()
    qa_sel = is_qa[sel]
    first = first_qa[sel]
    drilled = first_drill[sel]
    listed_dir = list_dir[sel]
    stops = list_stop[sel]

    def first_acc(at: torch.Tensor) -> float:
        return float((logits[at].argmax(-1) == tg[at]).float().mean()) if at.any() else float("nan")

    with torch.no_grad():
        qa_loss = float(ce[qa_sel].mean()) if qa_sel.any() else float("nan")
        cap_loss = float(ce[~qa_sel].mean()) if (~qa_sel).any() else float("nan")
        acc, drill_acc, dir_acc = first_acc(first), first_acc(drilled), first_acc(listed_dir)
        end_acc = first_acc(stops)
    total = loss + cfg.aux_weight * aux_loss + cfg.count_weight * count_loss
    if attn_loss is not None:
        total = total + cfg.attn_weight * attn_loss
    if list_loss is not None:
        total = total + list_weight * list_loss
    if copy_loss is not None:
        total = total + copy_weight * copy_loss
    if lens_loss is not None:
        total = total + cfg.list_direction_lens * lens_loss
    return BatchLoss(
        loss=total,
        qa_loss=qa_loss,
        caption_loss=cap_loss,
        aux_loss=float(aux_loss.detach()),
        qa_first_acc=acc,
        n_tasks=sum(len(s.tasks) for s in samples),
        visual_tokens=b * n_vis,
        count_loss=float(count_loss.detach()) if counting else float("nan"),
        attn_loss=float(attn_loss.detach()) if attn_loss is not None else float("nan"),
        drill_acc=drill_acc,
        list_loss=float(list_loss.detach()) if list_loss is not None else float("nan"),
        copy_loss=float(copy_loss.detach()) if copy_loss is not None else float("nan"),
        list_direction_acc=dir_acc,
        list_end_acc=end_acc,
        list_direction_lens=float(lens_loss.detach()) if lens_loss is not None else float("nan"),
    )


# ---------------------------------------------------------------------------------------------- training


def _param_groups(model: nn.Module, aux: nn.Module, cfg: TrainConfig) -> list[dict]:
    decay, no_decay, vision = [], [], []
    for name, p in model.named_parameters():
        if name.startswith("model.visual."):
            vision.append(p)
        elif p.ndim >= 2 and "embed_tokens" not in name:
            decay.append(p)
        else:
            no_decay.append(p)
    no_decay += list(aux.parameters())
    return [
        {"params": decay, "weight_decay": cfg.weight_decay, "lr_scale": 1.0},
        {"params": no_decay, "weight_decay": 0.0, "lr_scale": 1.0},
        {"params": vision, "weight_decay": 0.0, "lr_scale": cfg.vision_lr_scale},
    ]


def decay_start(cfg: TrainConfig) -> int:
    """The first step of the schedule's linear decay."""
    return int(cfg.steps * (1 - cfg.decay_frac))


def lr_at(cfg: TrainConfig, step: int) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    start = decay_start(cfg)
    if step < start:
        return cfg.lr
    frac = min(1.0, (step - start) / max(1, cfg.steps - start))
    return cfg.lr * (1.0 - 0.9 * frac)


@dataclass
class Trainer:
    """Model, aux head, EMA and optimizer; ``train`` runs until the step plan or a time budget ends."""

    cfg: TrainConfig
    work_dir: Path
    lm: VideoLM = field(init=False)
    aux: AuxHead = field(init=False)
    ema: dict[str, torch.Tensor] = field(init=False)
    opt: torch.optim.Optimizer = field(init=False)
    step: int = 0
    elapsed_s: float = 0.0
    log: list[dict] = field(default_factory=list)
    parent_info: dict = field(default_factory=dict)  # training_info of --init-from, if any
    restart_step: int | None = None  # where a --continue-schedule run restarted (fresh optimizer state)
    restarts: list[dict] = field(default_factory=list)  # every such restart of this schedule
    # ``replan``: changes of the planned steps made before either plan's decay (``{step, from, to}``)
    replans: list[dict] = field(default_factory=list)
    # ``change_data``: changes of ``random_events`` for the steps not yet trained (``{step, from, to}``)
    data_changes: list[dict] = field(default_factory=list)
    resuming: bool = False  # a saved state will be loaded: do not read --init-from first
    # build the next step's batch on a background thread while this step trains (``make_batch`` is a pure
    # function of the seed and the step, so the batches, and the run, are the same either way)
    prefetch: bool = True
    _next_batch: tuple[int, TrainConfig, Future] | None = field(default=None, init=False, repr=False)
    _pool: ThreadPoolExecutor | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.lm = build_lm(
            self.work_dir / "tokenizer", SIZES[self.cfg.size], self.cfg.seed, self.cfg.frame_side
        )
        torch.manual_seed(self.cfg.seed + 1)
        self.aux = AuxHead(self.lm.hidden_size, counts=self.cfg.count_weight > 0)
        use_linear_patch_embed(self.lm.model)
        use_batched_vision_attention(self.lm.model)
        self.lm.model.train()
        if self.cfg.init_from and not (self.resuming and self.state_path.exists()):
            self._init_from(Path(self.cfg.init_from))
        self.ema = {k: v.detach().clone() for k, v in self.lm.model.state_dict().items()}
        self.opt = torch.optim.AdamW(
            _param_groups(self.lm.model, self.aux, self.cfg), lr=self.cfg.lr, betas=(0.9, 0.98), eps=1e-8
        )

    def _init_from(self, src: Path) -> None:
        """Load an exported checkpoint's weights; its training minutes count as already spent."""
        from transformers import Qwen2VLForConditionalGeneration

        if not (src / "config.json").is_file():
            raise FileNotFoundError(f"--init-from {src}: not a checkpoint directory (no config.json)")
        # through from_pretrained, so the saved key names are mapped exactly as at inference
        src_model = Qwen2VLForConditionalGeneration.from_pretrained(src, local_files_only=True)
        try:
            self.lm.model.load_state_dict(src_model.state_dict())
        except RuntimeError as e:
            raise ValueError(f"--init-from {src}: not a checkpoint of this model size ({e})") from e
        info_path = src / "training_info.json"
        info = json.loads(info_path.read_text()) if info_path.is_file() else {}
        self.elapsed_s = float(info.get("train_minutes", 0.0)) * 60.0
        aux_path = src / AUX_FILE
        if aux_path.is_file():  # the training-only aux head, when the export carried it
            from safetensors.torch import load_file

            self.aux.load_state_dict(load_file(str(aux_path)))
        if not self.cfg.continue_schedule:
            self.parent_info = info
            return
        if "steps" not in info or "config" not in info:
            raise ValueError(f"--continue-schedule: {info_path} does not record the schedule")
        diff = config_diff(info["config"], asdict(self.cfg))
        if diff:
            raise ValueError(f"--continue-schedule: the config differs from {src}'s (theirs, mine): {diff}")
        self.step = self.restart_step = int(info["steps"])
        self.restarts = [
            *info.get("restarts", []),
            {"step": self.step, "train_minutes": info["train_minutes"]},
        ]
        self.parent_info = dict(info.get("continued_from", {}))

    @property
    def state_path(self) -> Path:
        return self.work_dir / "state.pt"

    def save(self) -> None:
        state = {
            "config": asdict(self.cfg),
            "model": self.lm.model.state_dict(),
            "aux": self.aux.state_dict(),
            "ema": self.ema,
            "opt": self.opt.state_dict(),
            "step": self.step,
            "elapsed_s": self.elapsed_s,
            "torch_rng": torch.get_rng_state(),
            "numpy_rng": np.random.get_state(),
            "python_rng": random.getstate(),
            "log": self.log,
            "parent_info": self.parent_info,
            "restart_step": self.restart_step,
            "restarts": self.restarts,
            "replans": self.replans,
            "data_changes": self.data_changes,
        }
        tmp = self.state_path.with_suffix(".tmp")
        torch.save(state, tmp)
        os.replace(tmp, self.state_path)

    def load(self, strict_config: bool = True, ignore: Sequence[str] = ()) -> None:
        """Restore a saved state; its config becomes this trainer's (``strict_config``: refuse a different one,
        except in the fields named in ``ignore``, e.g. ``steps`` when the caller replans them next)."""
        state = torch.load(self.state_path, weights_only=False)
        saved = _config_of(state)
        if saved.seed != self.cfg.seed or saved.size != self.cfg.size:
            raise ValueError(f"{self.state_path} was trained with seed={saved.seed} size={saved.size}")
        diff = {k: v for k, v in config_diff(asdict(saved), asdict(self.cfg)).items() if k not in ignore}
        if strict_config and diff:
            raise ValueError(f"{self.state_path} was trained with other settings (saved, given): {diff}")
        self.cfg = replace(saved, init_from=saved.init_from or self.cfg.init_from)
        self.lm.model.load_state_dict(state["model"])
        self.aux.load_state_dict(state["aux"])
        self.ema = state["ema"]
        self.opt.load_state_dict(state["opt"])
        self.step = int(state["step"])
        self.elapsed_s = float(state["elapsed_s"])
        torch.set_rng_state(state["torch_rng"])
        np.random.set_state(state["numpy_rng"])
        random.setstate(state["python_rng"])
        self.log = list(state.get("log", []))
        self.parent_info = dict(state.get("parent_info", {}))
        self.restart_step = state.get("restart_step")
        self.restarts = list(state.get("restarts", []))
        self.replans = list(state.get("replans", []))
        self.data_changes = list(state.get("data_changes", []))

    def replan(self, steps: int) -> None:
        """Change the planned steps of a resumed run. Only the LR schedule reads them, and only from its decay
        start on (``lr_at``), so this is allowed while no step so far was at or past the decay start of either
        plan: the run is then step for step the run planned with ``steps`` from scratch (the data is a
        function of the step). Recorded in the state and the export (``replans``)."""
        old = self.cfg.steps
        new_cfg = replace(self.cfg, steps=steps)
        first_decayed = min(decay_start(self.cfg), decay_start(new_cfg))
        if steps <= self.step or self.step > first_decayed:
            raise ValueError(
                f"cannot replan from {old} to {steps} steps at step {self.step}: a plan's decay starts at step "
                f"{first_decayed} (replanning is only exact before both plans' decay)"
            )
        if steps != old:
            self.cfg = new_cfg
            self.replans.append({"step": self.step, "from": old, "to": steps})

    def change_data(self, random_events: tuple[tuple[int, float], ...]) -> None:
        """``change_schedule("random_events", ...)``: the data of the steps not yet trained."""
        self.change_schedule("random_events", random_events)

    def change_schedule(self, name: str, pieces: tuple[tuple[int, float], ...]) -> None:
        """Change a schedule field of a resumed run (``SCHEDULE_FIELDS``: ``random_events`` and
        ``altered_lists``, the data; ``attn_list``, a loss weight) for the steps not yet trained. The steps already trained must be the new
        schedule's too, so the run stays the run of the new config from scratch (the batches and the losses
        are functions of the config and the step). Recorded (``data_changes``; ``field`` names any schedule
        but ``random_events``)."""
        if name not in SCHEDULE_FIELDS:
            raise ValueError(f"{name!r} is not a schedule field ({SCHEDULE_FIELDS})")
        flag = "--" + name.replace("_", "-")
        old = getattr(self.cfg, name)
        bad = next((s for s in range(self.step) if schedule_value(old, s) != schedule_value(pieces, s)), None)
        if bad is not None:
            raise ValueError(
                f"cannot change {flag} at step {self.step}: the new schedule differs at step {bad}, "
                "already trained (a change may only start at or after the current step)"
            )
        if _canon(pieces) != _canon(old):
            self.cfg = replace(self.cfg, **{name: pieces})
            change: dict = {
                "step": self.step,
                "from": [list(x) for x in old],
                "to": [list(x) for x in pieces],
            }
            self.data_changes.append(change if name == "random_events" else {"field": name, **change})

    def lr_now(self, step: int) -> float:
        """The schedule's rate, re-warmed over ``warmup_steps`` wherever parameters start with fresh AdamW
        moments: after a ``--continue-schedule`` restart, and when the language model joins after the
        vision-only phase (a first Adam step moves every weight by about the full rate)."""
        lr = lr_at(self.cfg, step)
        for start in (self.restart_step, self.cfg.vision_only_steps or None):
            if start is not None and step >= start:
                lr *= min(1.0, (step - start + 1) / max(1, self.cfg.warmup_steps))
        return lr

    def batch(self, step: int) -> tuple[str, list[Sample]]:
        """``make_batch(step)``, prefetched by the previous call when ``prefetch``; starts step + 1's."""
        pending, self._next_batch = self._next_batch, None
        if pending is not None and pending[0] == step and pending[1] is self.cfg:
            out = pending[2].result()
        else:  # not prefetched, or for another plan (``replan``)
            out = make_batch(self.lm, self.cfg, step)
        if self.prefetch and step + 1 < self.cfg.steps:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="make_batch")
            fut = self._pool.submit(make_batch, self.lm, self.cfg, step + 1)
            self._next_batch = (step + 1, self.cfg, fut)
        return out

    def train_step(self) -> tuple[str, BatchLoss]:
        cfg = self.cfg
        bucket, samples = self.batch(self.step)
        lr = self.lr_now(self.step)
        for g in self.opt.param_groups:
            g["lr"] = lr * g["lr_scale"]
        vision_only = self.step < cfg.vision_only_steps
        self.lm.model.model.language_model.requires_grad_(not vision_only)
        self.lm.model.lm_head.requires_grad_(not vision_only)
        out = batch_loss(
            self.lm,
            self.aux,
            samples,
            cfg,
            vision_only=vision_only,
            list_weight=schedule_value(cfg.attn_list, self.step),
            copy_weight=schedule_value(cfg.list_copy, self.step),
        )
        self.opt.zero_grad(set_to_none=True)
        out.loss.backward()
        self.update()
        self.step += 1
        return bucket, out

    def update(self) -> None:
        """After a backward pass: clip the gradients, take the AdamW step, update the EMA weights."""
        cfg = self.cfg
        params = [p for g in self.opt.param_groups for p in g["params"]]
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        self.opt.step()
        with torch.no_grad():
            d = cfg.ema_decay if self.step >= cfg.warmup_steps else 0.0
            for k, v in self.lm.model.state_dict().items():
                if v.is_floating_point():
                    self.ema[k].mul_(d).add_(v.detach(), alpha=1 - d)
                else:
                    self.ema[k].copy_(v)

    def train(
        self,
        minutes: float | None = None,
        max_total_minutes: float | None = None,
        save_minutes: float = 10.0,
        log_every: int = 20,
        max_steps: int | None = None,
    ) -> None:
        cfg = self.cfg
        start = time.perf_counter()
        base_elapsed = self.elapsed_s
        last_save = start
        acc: dict[str, list[float]] = {}
        buckets: dict[str, int] = {}
        t_log = start
        vis_tokens = 0
        while self.step < cfg.steps and (max_steps is None or self.step < max_steps):
            now = time.perf_counter()
            self.elapsed_s = base_elapsed + (now - start)
            if minutes is not None and now - start >= minutes * 60:
                print(f"time budget of this run ({minutes:g} min) reached", flush=True)
                break
            if max_total_minutes is not None and self.elapsed_s >= max_total_minutes * 60:
                print(f"total training budget ({max_total_minutes:g} min) reached", flush=True)
                break
            try:
                bucket, out = self.train_step()
            except Exception:
                self.elapsed_s = base_elapsed + (time.perf_counter() - start)
                self.save()  # the step did not happen: the state is consistent
                raise
            buckets[bucket] = buckets.get(bucket, 0) + 1
            vis_tokens += out.visual_tokens
            for k, v in (
                ("loss", float(out.loss.detach())),
                ("qa", out.qa_loss),
                ("cap", out.caption_loss),
                ("aux", out.aux_loss),
                ("acc1", out.qa_first_acc),
                ("cnt", out.count_loss),
                ("att", out.attn_loss),
                ("drill", out.drill_acc),
                ("lst", out.list_loss),
                ("cpy", out.copy_loss),
                ("ldir", out.list_direction_acc),
                ("lend", out.list_end_acc),
                ("dlens", out.list_direction_lens),
            ):
                if not math.isnan(v):
                    acc.setdefault(k, []).append(v)
            if self.step % log_every == 0:
                now = time.perf_counter()
                rec = {k: float(np.mean(v)) for k, v in acc.items()}
                rec.update(step=self.step, elapsed_min=round((base_elapsed + now - start) / 60, 2))
                rec["lr"] = self.lr_now(self.step - 1)
                rec["vis_tok_per_s"] = round(vis_tokens / max(1e-6, now - t_log))
                rec["buckets"] = dict(buckets)
                self.log.append(rec)
                print(
                    f"step {self.step}/{cfg.steps} [{rec['elapsed_min']:.1f} min] loss {rec.get('loss', 0):.3f} "
                    f"qa {rec.get('qa', float('nan')):.3f} cap {rec.get('cap', float('nan')):.3f} "
                    f"aux {rec.get('aux', float('nan')):.3f} acc1 {rec.get('acc1', float('nan')):.2f} "
                    + (f"cnt {rec['cnt']:.3f} " if "cnt" in rec else "")
                    + (f"att {rec['att']:.3f} " if "att" in rec else "")
                    + (f"drill {rec['drill']:.2f} " if "drill" in rec else "")
                    + (f"lst {rec['lst']:.3f} " if "lst" in rec else "")
                    + (f"cpy {rec['cpy']:.3f} " if "cpy" in rec else "")
                    + (f"ldir {rec['ldir']:.2f} " if "ldir" in rec else "")
                    + (f"lend {rec['lend']:.2f} " if "lend" in rec else "")
                    + (f"dlens {rec['dlens']:.3f} " if "dlens" in rec else "")
                    + f"lr {rec['lr']:.2e} vis tok/s {rec['vis_tok_per_s']} {buckets}",
                    flush=True,
                )
                acc, buckets, vis_tokens, t_log = {}, {}, 0, now
            if time.perf_counter() - last_save >= save_minutes * 60:
                self.elapsed_s = base_elapsed + (time.perf_counter() - start)
                self.save()
                last_save = time.perf_counter()
                print(f"saved {self.state_path} at step {self.step}", flush=True)
        self.elapsed_s = base_elapsed + (time.perf_counter() - start)
        self.save()
        print(
            f"saved {self.state_path} at step {self.step} ({self.elapsed_s / 60:.1f} min in all)", flush=True
        )


# ---------------------------------------------------------------------------------------------- export


def _config_of(state: dict) -> TrainConfig:
    """The ``TrainConfig`` a saved training state was trained with."""
    return TrainConfig(**{**LEGACY_DEFAULTS, **{k: _tupled(v) for k, v in state["config"].items()}})


def _tupled(v: object) -> object:
    """JSON / pickled lists back to the tuples of a TrainConfig (nested for qa_type_weights)."""
    return tuple(_tupled(x) for x in v) if isinstance(v, list | tuple) else v


def parse_type_weights(text: str) -> tuple[tuple[str, float], ...]:
    """``"direction=3,first=2"`` -> ``(("direction", 3.0), ("first", 2.0))``; names must be question types."""
    out = []
    for part in filter(None, (x.strip() for x in text.split(","))):
        name, sep, value = part.partition("=")
        if not sep or name not in W.QTYPES:
            raise ValueError(
                f"--qa-type-weights: {part!r} is not TYPE=WEIGHT with TYPE one of {list(W.QTYPES)}"
            )
        out.append((name, float(value)))
    return tuple(out)


def blend_with_parent(trainer: Trainer, model: nn.Module, alpha: float) -> None:
    """Set ``model``'s weights to ``(1 - alpha) * parent + alpha * its own``: ``alpha`` of the way along the
    straight line from the ``--init-from`` export this run started at to where it ended
    (``--blend-with-parent``). No training: both ends are checkpoints of this run's own lineage, so its training
    minutes are unchanged. The parent export must still be the one the run started from (its
    ``training_info.json`` is checked)."""
    from transformers import Qwen2VLForConditionalGeneration

    if not trainer.cfg.init_from:
        raise ValueError("blending with the parent needs a run started with --init-from")
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"the blend's alpha must lie in [0, 1], not {alpha}")
    src = Path(trainer.cfg.init_from)
    info_path = src / "training_info.json"
    if not info_path.exists() or json.loads(info_path.read_text()) != trainer.parent_info:
        raise ValueError(f"{src} is not the export this run started from (its training_info.json differs)")
    parent = Qwen2VLForConditionalGeneration.from_pretrained(
        src, dtype=torch.float32, local_files_only=True
    ).state_dict()
    own = model.state_dict()
    if own.keys() != parent.keys() or any(parent[k].shape != v.shape for k, v in own.items()):
        raise ValueError(f"{src} does not have this model's weights")
    with torch.no_grad():
        for k, v in own.items():
            if v.is_floating_point():
                v.mul_(alpha).add_(parent[k].to(v.dtype), alpha=1 - alpha)


def export_checkpoint(
    trainer: Trainer, out_dir: Path, use_ema: bool = True, with_aux: bool = False, blend: float | None = None
) -> Path:
    """Write the stock HF checkpoint (EMA weights by default) to ``out_dir``.

    ``with_aux``: also write the training-only aux head as ``AUX_FILE`` (for ``--init-from``
    continuations of an unfinished run; ``from_pretrained`` ignores the file). ``blend``: write the weights
    ``blend`` of the way from the parent export to this run's (``blend_with_parent``; recorded as ``blend``
    in ``training_info.json``); the aux head is written unblended.
    """
    from transformers import Qwen2VLForConditionalGeneration

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    vocab = build_tokenizer(_vocab_words(), out_dir, QWEN_SPECIALS, vocab_size=VOCAB_SIZE)
    write_aux_files(out_dir, vocab, trainer.cfg.frame_side)
    config = trainer.lm.model.config
    model = Qwen2VLForConditionalGeneration(config)
    state = trainer.ema if use_ema else trainer.lm.model.state_dict()
    model.load_state_dict(state)
    if blend is not None:
        blend_with_parent(trainer, model, blend)
    model.eval()
    model.save_pretrained(out_dir, safe_serialization=True)
    aux_path = out_dir / AUX_FILE
    if with_aux:
        from safetensors.torch import save_file

        save_file({k: v.detach().contiguous() for k, v in trainer.aux.state_dict().items()}, str(aux_path))
    elif aux_path.exists():
        aux_path.unlink()  # a stale head from an earlier export must not ride along
    info = {
        "seed": trainer.cfg.seed,
        "steps": trainer.step,
        "planned_steps": trainer.cfg.steps,
        "train_minutes": round(trainer.elapsed_s / 60, 1),
        "ema": use_ema,
        "config": asdict(trainer.cfg),
    }
    if blend is not None:
        info["blend"] = {"alpha": blend, "parent": str(trainer.cfg.init_from)}
    if trainer.restarts:
        info["restarts"] = trainer.restarts  # schedule pieces joined through exports (fresh optimizer)
    if trainer.replans:
        info["replans"] = trainer.replans  # planned steps changed before the decay (``Trainer.replan``)
    if trainer.data_changes:
        # random_events changed for the steps not yet trained (``Trainer.change_data``)
        info["data_changes"] = trainer.data_changes
    if trainer.parent_info:
        # the minutes above include the parent's; so does `steps` only for this stage
        info["continued_from"] = trainer.parent_info
    (out_dir / "training_info.json").write_text(json.dumps(info, indent=1) + "\n")
    return out_dir


# ---------------------------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="vidspec train-reference", description="Train the reference video LLM from scratch on CPU."
    )
    p.add_argument("--out", default="models/vidspec-reference", help="where the HF checkpoint is exported")
    p.add_argument("--work-dir", default="runtime/train-reference", help="training state (resumable)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--blend-with-parent",
        type=float,
        default=None,
        metavar="ALPHA",
        help="export (1 - ALPHA) * the --init-from export + ALPHA * this run's weights (no training; with "
        "--export-only, from a finished run's state)",
    )
    p.add_argument("--size", default="reference", choices=sorted(SIZES))
    p.add_argument("--steps", type=int, default=TrainConfig.steps, help="planned steps (LR schedule)")
    p.add_argument(
        "--replan-steps",
        type=int,
        default=None,
        help="with --resume: change the planned steps (only before the decay of both plans; recorded)",
    )
    p.add_argument("--minutes", type=float, default=None, help="time budget of this invocation")
    p.add_argument("--max-total-minutes", type=float, default=180.0, help="budget over all resumed runs")
    p.add_argument("--save-minutes", type=float, default=10.0)
    p.add_argument("--resume", action="store_true", help="continue from WORK_DIR/state.pt")
    p.add_argument(
        "--stop-at-step",
        type=int,
        default=None,
        help="stop this invocation once the run has done this many steps (the schedule is unchanged)",
    )
    p.add_argument("--lr", type=float, default=TrainConfig.lr)
    p.add_argument("--decay-frac", type=float, default=TrainConfig.decay_frac)
    p.add_argument("--warm-steps", type=int, default=TrainConfig.warm_steps)
    p.add_argument("--aux-weight", type=float, default=TrainConfig.aux_weight)
    p.add_argument(
        "--aux-term-weights",
        type=lambda v: tuple(float(x) for x in v.split(",")),
        default=TrainConfig.aux_term_weights,
        help="colour,shape,direction weights of the aux head's terms",
    )
    p.add_argument(
        "--count-weight",
        type=float,
        default=TrainConfig.count_weight,
        help="weight of the count probe on the LM's visual positions (running counts, entry rank); 0 = off",
    )
    p.add_argument(
        "--count-layer",
        type=int,
        default=TrainConfig.count_layer,
        help="decoder layer whose output the count probe reads",
    )
    p.add_argument(
        "--attn-weight",
        type=float,
        default=TrainConfig.attn_weight,
        help="weight of the attention supervision (one query head attends to the objects asked about); 0 = off",
    )
    p.add_argument(
        "--attn-layers",
        type=lambda t: tuple(int(x) for x in t.split(",")),
        default=TrainConfig.attn_layers,
        help="decoder layers (0-based, comma-separated) whose query head --attn-head is supervised",
    )
    p.add_argument("--attn-head", type=int, default=TrainConfig.attn_head, help="the supervised query head")
    p.add_argument(
        "--attn-count-target",
        choices=ATTN_COUNT_TARGETS,
        default=TrainConfig.attn_count_target,
        help="count questions attend to every counted object (v4) or to the video's last temporal group",
    )
    p.add_argument(
        "--init-from", default=None, help="continue from an exported checkpoint (its minutes count)"
    )
    p.add_argument(
        "--continue-schedule",
        action="store_true",
        help="with --init-from: continue that export's schedule (same flags; step counting goes on)",
    )
    p.add_argument(
        "--vision-only-steps", type=int, default=0, help="first steps train only vision tower + aux head"
    )
    p.add_argument(
        "--qa-type-weights",
        default="",
        help="extra weight of some question types' answers, e.g. direction=3 (on top of the QA weight)",
    )
    p.add_argument(
        "--trace-decision-weight",
        type=float,
        default=TrainConfig.trace_decision_weight,
        help="with --qa-trace: weight of the trace's decision tokens (',' or '.' after each item, a scan's "
        "running counts); the rest of a trace weighs like a caption, 1",
    )
    p.add_argument(
        "--random-events",
        default="0.3",
        help="share of training videos with a uniform object count (1..what fits, at most 10) instead of the "
        "world's default: SHARE, or a schedule STEP:SHARE,STEP:SHARE from step 0; with --resume it may change "
        "the steps not yet trained",
    )
    p.add_argument(
        "--qa-token-weight",
        type=float,
        default=TrainConfig.qa_token_weight,
        help="weight of QA answer tokens",
    )
    p.add_argument(
        "--list-token-weight",
        type=float,
        default=TrainConfig.list_token_weight,
        help="with --qa-turns: weight of the list turn's tokens (a caption's weigh 1)",
    )
    p.add_argument(
        "--list-direction-weight",
        type=float,
        default=TrainConfig.list_direction_weight,
        help="with --qa-turns: extra weight of the list turn's direction words (on top of --list-token-weight)",
    )
    p.add_argument(
        "--list-end-weight",
        type=float,
        default=TrainConfig.list_end_weight,
        help="with --qa-turns: weight of the list turn's <|im_end|>, the decision to end the list (its commas, "
        "the decision to go on, weigh --list-token-weight)",
    )
    p.add_argument(
        "--list-direction-lens",
        type=float,
        default=TrainConfig.list_direction_lens,
        help="with --qa-turns: weight of a loss on the list's direction words read out (final norm, LM head) "
        "after --list-direction-layer decoder layers; 0 = off",
    )
    p.add_argument(
        "--list-direction-layer",
        type=int,
        default=TrainConfig.list_direction_layer,
        help="decoder layers before --list-direction-lens reads the hidden state out (1 .. layers)",
    )
    p.add_argument(
        "--qa-sets",
        type=int,
        default=TrainConfig.qa_sets,
        help="question sets drawn per training video (repeats dropped); 1 = one question per type",
    )
    p.add_argument(
        "--qa-trace",
        nargs="?",
        const="list",
        default=None,
        choices=W.TRACE_STYLES,
        help="answer the lookup and filtered-count question types after a trace (world.answer_text): 'list' "
        "(the default) lists every object; 'scan' adds a running count to each item of a filtered count and "
        "stops a lookup's list at the object it reads (world.scan_list); 'cued' is 'scan' with the question's "
        "cue (the colour, shape or object it asks about) written before every item (world.cued_scan)",
    )
    p.add_argument(
        "--qa-turns",
        action="store_true",
        help="two-turn QA: per video the object list is asked first (LIST_PROMPT), then every question in a "
        "second turn after it, answered alone (excludes --qa-trace)",
    )
    p.add_argument(
        "--caption-turns",
        type=float,
        default=0.0,
        metavar="SHARE",
        help="with --qa-turns: the share of training videos whose caption is asked after the list turn, as the "
        "questions are (default 0: captions alone); a model trained with it is asked so by vidspec eval and the "
        "workers",
    )
    p.add_argument(
        "--caption-attn",
        choices=CAPTION_ATTN,
        default=TrainConfig.caption_attn,
        help="with --attn-weight: which caption sentence attends to which event: 'events' (default: an object's "
        "sentence and its motion sentence, 'it moves up .', on that object) or 'periods' (the rule before "
        "session 47: the i-th sentence on the i-th event) or 'none' (captions not supervised)",
    )
    p.add_argument(
        "--qa-cue",
        action="store_true",
        help="with --qa-turns: each question's reply repeats its cue first (world.cued_answer: 'square . red')",
    )
    p.add_argument(
        "--attn-list",
        default="0",
        metavar="SCHEDULE",
        help="with --qa-turns: weight of the list-reading attention loss (a lookup's answer on its list item, "
        "a cue on the question's cue words), WEIGHT or STEP:WEIGHT,STEP:WEIGHT from step 0; with --resume it "
        "may change for the steps not yet trained (default 0: off)",
    )
    p.add_argument(
        "--altered-lists",
        default="0",
        metavar="SCHEDULE",
        help="with --qa-turns: share of training videos whose list turn and questions are an altered world's "
        "(world.altered_world; the list is no target, the answers can only be read from it), SHARE or "
        "STEP:SHARE,... from step 0; with --resume it may change for the steps not yet trained (default 0)",
    )
    p.add_argument(
        "--list-copy",
        default="0",
        metavar="SCHEDULE",
        help="with --attn-list: weight of its copy loss (the head's output in the last --attn-layers layer, "
        "through the LM head, predicts the token it attends to), WEIGHT or STEP:WEIGHT,...; may change on "
        "--resume for the steps not yet trained (default 0: off)",
    )
    p.add_argument(
        "--attn-list-head",
        type=int,
        default=TrainConfig.attn_list_head,
        help="the query head of the list-reading attention loss (in --attn-layers)",
    )
    p.add_argument(
        "--drill-tasks",
        type=int,
        default=TrainConfig.drill_tasks,
        help="with --qa-trace: per training video, this many list-reading drills: traced questions about "
        "another, random world answered after its trace; only the answer is supervised",
    )
    p.add_argument(
        "--no-attn-traced-answer",
        action="store_true",
        help="with --qa-trace: supervise only the listed items' attention, not the answer after the list",
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads (the machine is shared: keep 1)")
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--no-export", action="store_true", help="do not export the checkpoint at the end")
    p.add_argument("--export-only", action="store_true", help="export WORK_DIR/state.pt and exit")
    p.add_argument(
        "--export-aux",
        action="store_true",
        help=f"also export the training-only aux head ({AUX_FILE}) for a later --init-from",
    )
    return p


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The ``TrainConfig`` of parsed ``train-reference`` arguments (``ValueError`` on a bad --qa-type-weights)."""
    return TrainConfig(
        seed=args.seed,
        size=args.size,
        steps=args.steps,
        lr=args.lr,
        decay_frac=args.decay_frac,
        warm_steps=args.warm_steps,
        aux_weight=args.aux_weight,
        aux_term_weights=args.aux_term_weights,
        count_weight=args.count_weight,
        count_layer=args.count_layer,
        qa_type_weights=parse_type_weights(args.qa_type_weights),
        qa_token_weight=args.qa_token_weight,
        list_token_weight=args.list_token_weight,
        list_direction_weight=args.list_direction_weight,
        list_end_weight=args.list_end_weight,
        list_direction_lens=args.list_direction_lens,
        list_direction_layer=args.list_direction_layer,
        qa_sets=args.qa_sets,
        qa_trace=args.qa_trace is not None,
        qa_trace_style=args.qa_trace or "list",
        random_events=parse_random_events(args.random_events),
        trace_decision_weight=args.trace_decision_weight,
        attn_traced_answer=not args.no_attn_traced_answer,
        drill_tasks=args.drill_tasks,
        qa_turns=args.qa_turns,
        caption_turns=args.caption_turns,
        caption_attn=args.caption_attn,
        qa_cue=args.qa_cue,
        attn_list=parse_schedule(args.attn_list, "--attn-list", hi=100.0, what="WEIGHT"),
        attn_list_head=args.attn_list_head,
        altered_lists=parse_schedule(args.altered_lists, "--altered-lists"),
        list_copy=parse_schedule(args.list_copy, "--list-copy", hi=100.0, what="WEIGHT"),
        attn_weight=args.attn_weight,
        attn_layers=args.attn_layers,
        attn_head=args.attn_head,
        attn_count_target=args.attn_count_target,
        init_from=args.init_from,
        vision_only_steps=args.vision_only_steps,
        continue_schedule=args.continue_schedule,
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_SDPA_FORCE_GQA", "1")
    torch.set_num_threads(max(1, args.threads))
    if len(args.aux_term_weights) != 3:
        raise SystemExit("--aux-term-weights needs three numbers: colour,shape,direction")
    try:
        cfg = config_from_args(args)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    size = SIZES[cfg.size]
    listing = any(w > 0 for _, w in cfg.attn_list)
    if (cfg.attn_weight > 0 or listing) and (
        not all(0 <= x < size.layers for x in cfg.attn_layers)
        or not 0 <= cfg.attn_head < size.heads
        or not 0 <= cfg.attn_list_head < size.heads
    ):
        raise SystemExit(
            f"--attn-layers must lie in 0..{size.layers - 1} and --attn-head / --attn-list-head in "
            f"0..{size.heads - 1}"
        )
    if cfg.qa_sets < 1:
        raise SystemExit("--qa-sets must be at least 1")
    if cfg.drill_tasks < 0 or (cfg.drill_tasks > 0 and not cfg.qa_trace):
        raise SystemExit("--drill-tasks must be >= 0, and drills (traced answers) need --qa-trace")
    if cfg.qa_turns and cfg.qa_trace:
        raise SystemExit("--qa-turns answers after the list turn: it excludes --qa-trace")
    if cfg.list_token_weight != 1.0 and not cfg.qa_turns:
        raise SystemExit("--list-token-weight weighs the list turn of two-turn QA: it needs --qa-turns")
    if cfg.list_token_weight < 0:
        raise SystemExit("--list-token-weight must be >= 0")
    if not 0 <= cfg.caption_turns <= 1 or (cfg.caption_turns > 0 and not cfg.qa_turns):
        raise SystemExit(
            "--caption-turns is a share in [0, 1] of captions asked after the list: it needs --qa-turns"
        )
    if cfg.list_direction_weight != 1.0 and not cfg.qa_turns:
        raise SystemExit("--list-direction-weight weighs the list turn of two-turn QA: it needs --qa-turns")
    if cfg.list_direction_weight < 0:
        raise SystemExit("--list-direction-weight must be >= 0")
    if cfg.list_end_weight != 1.0 and not cfg.qa_turns:
        raise SystemExit("--list-end-weight weighs the list turn of two-turn QA: it needs --qa-turns")
    if cfg.list_end_weight < 0:
        raise SystemExit("--list-end-weight must be >= 0")
    if cfg.list_direction_lens < 0 or (cfg.list_direction_lens > 0 and not cfg.qa_turns):
        raise SystemExit(
            "--list-direction-lens must be >= 0 and reads the list turn of two-turn QA: --qa-turns"
        )
    if cfg.qa_cue and not cfg.qa_turns:
        raise SystemExit("--qa-cue changes the replies of two-turn QA: it needs --qa-turns")
    if any(v > 0 for _, v in cfg.altered_lists) and not cfg.qa_turns:
        raise SystemExit("--altered-lists asks questions after an altered list turn: it needs --qa-turns")
    if any(v > 0 for _, v in cfg.list_copy) and not listing:
        raise SystemExit("--list-copy trains the --attn-list head's output: it needs --attn-list")
    if listing and not cfg.qa_turns:
        raise SystemExit("--attn-list supervises reading the list turn: it needs --qa-turns")
    if cfg.continue_schedule and not cfg.init_from:
        raise SystemExit("--continue-schedule needs --init-from")
    if cfg.vision_only_steps > 0 and cfg.aux_weight <= 0:
        raise SystemExit("--vision-only-steps trains on the aux loss alone: it needs --aux-weight > 0")
    if args.replan_steps is not None and (not args.resume or args.export_only):
        raise SystemExit("--replan-steps changes the plan of a resumed run: it needs --resume")
    resuming = args.resume or args.export_only
    state_path = Path(args.work_dir) / "state.pt"
    if args.export_only and state_path.exists():
        # build the trainer as the state was trained (its aux head may carry the count probe)
        cfg = _config_of(torch.load(state_path, weights_only=False))
    trainer = Trainer(cfg, Path(args.work_dir), resuming=resuming)
    if resuming:
        if not trainer.state_path.exists():
            if args.export_only or args.replan_steps is not None:
                flag = "--export-only" if args.export_only else "--replan-steps"
                raise SystemExit(f"{flag}: no training state at {trainer.state_path}")
            print(f"no training state at {trainer.state_path}; starting fresh")
        else:
            # --export-only records whatever the state was trained with; --resume must match it
            # --replan-steps names the new plan: --steps need not repeat the saved one
            ignore = (("steps",) if args.replan_steps else ()) + SCHEDULE_FIELDS
            trainer.load(strict_config=not args.export_only, ignore=ignore)
            print(
                f"resumed from {trainer.state_path} at step {trainer.step} ({trainer.elapsed_s / 60:.1f} min)"
            )
            if args.replan_steps is not None:
                try:
                    trainer.replan(args.replan_steps)
                except ValueError as e:
                    raise SystemExit(f"--replan-steps: {e}") from e
                print(f"replanned to {trainer.cfg.steps} steps at step {trainer.step}", flush=True)
            for name in SCHEDULE_FIELDS if not args.export_only else ():
                given = getattr(cfg, name)
                if _canon(given) != _canon(getattr(trainer.cfg, name)):
                    try:
                        trainer.change_schedule(name, given)
                    except ValueError as e:
                        raise SystemExit(str(e)) from e
                    print(f"--{name.replace('_', '-')} {given} from step {trainer.step}", flush=True)
    cfg = trainer.cfg
    n_params = sum(p.numel() for p in trainer.lm.model.parameters())
    print(
        f"model: {n_params / 1e6:.2f}M parameters ({cfg.size}); plan {cfg.steps} steps; seed {cfg.seed}",
        flush=True,
    )
    if not args.export_only:
        trainer.train(
            minutes=args.minutes,
            max_total_minutes=args.max_total_minutes,
            save_minutes=args.save_minutes,
            log_every=args.log_every,
            max_steps=args.stop_at_step,
        )
    if not args.no_export:
        try:
            out = export_checkpoint(
                trainer, Path(args.out), with_aux=args.export_aux, blend=args.blend_with_parent
            )
        except ValueError as e:
            raise SystemExit(f"--blend-with-parent: {e}") from None
        print(f"exported {out} (step {trainer.step}, {trainer.elapsed_s / 60:.1f} min of training)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
