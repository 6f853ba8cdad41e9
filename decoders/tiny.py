"""Tiny random-weight checkpoints of every supported family, saved in the layout of the real releases.

Used by tests and benchmarks: the saved directory (config.json, model.safetensors, tokenizer files,
preprocessor_config.json, generation_config.json, chat template) loads through `load_model`, the same path
as a real Qwen2-VL / Qwen2.5-VL / LLaVA-OneVision checkpoint. Weights are random (seeded); `init_std`
is larger than the usual 0.02 so that greedy outputs vary instead of repeating one token.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from decoders.model import Family, _model_class
from decoders.train.tokenizer import LLAVA_SPECIALS, QWEN_SPECIALS, build_tokenizer

CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]

# name -> (hidden, layers, heads, kv_heads, intermediate, vision width, vision depth)
SIZES = {
    "test": (64, 3, 4, 2, 128, 32, 1),
    "bench": (256, 4, 4, 2, 512, 64, 2),
    # the language model of Qwen2-VL-7B (28 layers, hidden 3584, GQA 28/4, head dim 128, mRoPE [16, 24, 24])
    # with a one-block vision tower: for decode-speed measurements on a GPU (save it with dtype=bfloat16)
    "7b": (3584, 28, 28, 4, 18944, 64, 1),
}
WORDS = "the a red green blue yellow circle square triangle enters leaves moves left right then and".split()


def tiny_config(family: Family, vocab: dict[str, int], size: str = "test", init_std: float = 0.2) -> object:
    import transformers

    hidden, layers, heads, kv, inter, vwidth, vdepth = SIZES[size]
    head_dim = hidden // heads
    hw = 3 * (head_dim // 2 // 8)  # mrope sections (t, h, w) must sum to head_dim / 2
    text = {
        "vocab_size": len(vocab),
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-6,
        "initializer_range": init_std,
        "tie_word_embeddings": False,
        "eos_token_id": vocab["<|im_end|>"],
        "bos_token_id": vocab["<|endoftext|>"],
        "pad_token_id": vocab["<|endoftext|>"],
    }
    if family.is_qwen:
        text["rope_parameters"] = {
            "rope_type": "default",
            "rope_theta": 1_000_000.0,
            "mrope_section": [head_dim // 2 - 2 * hw, hw, hw],
        }
        ids = {
            "image_token_id": vocab["<|image_pad|>"],
            "video_token_id": vocab["<|video_pad|>"],
            "vision_start_token_id": vocab["<|vision_start|>"],
            "vision_end_token_id": vocab["<|vision_end|>"],
        }
        if family is Family.QWEN2_VL:
            vision = {
                "depth": vdepth,
                "embed_dim": vwidth,
                "hidden_size": hidden,
                "num_heads": 2,
                "mlp_ratio": 2,
                "patch_size": 14,
                "spatial_merge_size": 2,
                "temporal_patch_size": 2,
                "initializer_range": init_std,
            }
            return transformers.Qwen2VLConfig(
                text_config=text, vision_config=vision, initializer_range=init_std, **ids
            )
        vision = {
            "depth": vdepth,
            "hidden_size": vwidth,
            "out_hidden_size": hidden,
            "intermediate_size": 2 * vwidth,
            "num_heads": 2,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "window_size": 56,
            "fullatt_block_indexes": [vdepth - 1],
            "tokens_per_second": 2,
            "initializer_range": init_std,
        }
        return transformers.Qwen2_5_VLConfig(
            text_config=text, vision_config=vision, initializer_range=init_std, **ids
        )
    text["model_type"] = "qwen2"
    vision = {
        "model_type": "siglip_vision_model",
        "hidden_size": vwidth,
        "intermediate_size": 2 * vwidth,
        "num_hidden_layers": vdepth,
        "num_attention_heads": 2,
        "image_size": 56,
        "patch_size": 14,
    }
    return transformers.LlavaOnevisionConfig(
        text_config=text,
        vision_config=vision,
        image_token_index=vocab["<image>"],
        video_token_index=vocab["<video>"],
        vision_feature_layer=-1,
        vision_feature_select_strategy="full",
        initializer_range=init_std,
    )


def build_tiny_checkpoint(
    family: Family | str,
    out_dir: str | Path,
    size: str = "test",
    seed: int = 0,
    vocab_size: int = 256,
    init_std: float = 0.2,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
) -> Path:
    """Write a random-weight checkpoint of `family` to `out_dir`; return the directory. `device`: where the
    weights are drawn (a GPU draws the 7b shape in seconds; the values differ from a CPU draw)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    family = Family(family)
    out = Path(out_dir)
    specials = QWEN_SPECIALS if family.is_qwen else LLAVA_SPECIALS
    placeholder = "<|vision_start|><|video_pad|><|vision_end|>" if family.is_qwen else "<video>"
    vocab = build_tokenizer(WORDS, out, specials, vocab_size=vocab_size, video_placeholder=placeholder)
    config = tiny_config(family, vocab, size, init_std)
    torch.manual_seed(seed)
    with torch.device(device):
        model = _model_class(family)(config).to(dtype)
    model.save_pretrained(out, safe_serialization=True)
    eos = [vocab["<|im_end|>"], vocab["<|endoftext|>"]]
    (out / "generation_config.json").write_text(
        json.dumps(
            {"eos_token_id": eos, "pad_token_id": vocab["<|endoftext|>"], "do_sample": False}, indent=2
        )
    )
    if family.is_qwen:
        pre = {
            "image_processor_type": "Qwen2VLImageProcessor",
            "processor_class": "Qwen2VLProcessor" if family is Family.QWEN2_VL else "Qwen2_5_VLProcessor",
            "patch_size": 14,
            "temporal_patch_size": 2,
            "merge_size": 2,
            "min_pixels": 56 * 56,
            "max_pixels": 28 * 28 * 1280,
            "image_mean": CLIP_MEAN,
            "image_std": CLIP_STD,
        }
    else:
        side = config.vision_config.image_size
        pre = {
            "image_processor_type": "LlavaOnevisionImageProcessor",
            "processor_class": "LlavaOnevisionProcessor",
            "size": {"height": side, "width": side},
            "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5],
        }
    (out / "preprocessor_config.json").write_text(json.dumps(pre, indent=2))
    return out
