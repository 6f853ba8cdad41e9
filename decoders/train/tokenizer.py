"""Word-level tokenizers with the special tokens and chat template of the Qwen2-VL / LLaVA-OneVision
families, built with the `tokenizers` library and saved in Hugging Face layout (tokenizer.json,
tokenizer_config.json, chat_template.jinja), so they load through `AutoTokenizer` like a real release.

Text is lower-cased and split on whitespace and punctuation; decoding joins words with single spaces.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers

QWEN_SPECIALS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
LLAVA_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<image>", "<video>")
UNK = "<unk>"

# The Qwen2-VL chat template, reduced to what this project sends (a system turn, a video, text).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for content in message['content'] %}"
    "{% if content['type'] == 'video' %}{{ video_placeholder }}"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SYSTEM_WORDS = ("system", "user", "assistant", "you", "are", "a", "helpful", ".", "\n")


def build_tokenizer(
    words: Iterable[str],
    out_dir: str | Path,
    specials: tuple[str, ...] = QWEN_SPECIALS,
    vocab_size: int | None = None,
    video_placeholder: str = "<|vision_start|><|video_pad|><|vision_end|>",
) -> dict[str, int]:
    """Build and save a word-level tokenizer; return its vocabulary (token -> id).

    Ids: `<unk>` 0, then the words (deduplicated, in order), then filler words `w<i>` up to
    `vocab_size - len(specials)`, then the special tokens, so special ids sit at the top of the vocabulary.
    """
    from transformers import PreTrainedTokenizerFast

    vocab: dict[str, int] = {UNK: 0}
    for w in [*SYSTEM_WORDS, *words]:
        w = w.strip().lower()
        if w and w not in vocab and w not in specials:
            vocab[w] = len(vocab)
    if vocab_size is not None:
        if len(vocab) + len(specials) > vocab_size:
            raise ValueError(f"vocab_size {vocab_size} is too small for {len(vocab) + len(specials)} tokens")
        i = 0
        while len(vocab) < vocab_size - len(specials):
            vocab.setdefault(f"w{i}", len(vocab))
            i += 1
    for s in specials:
        vocab[s] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token=UNK,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=[s for s in specials if s not in ("<|im_end|>", "<|endoftext|>")],
    )
    fast.chat_template = CHAT_TEMPLATE.replace("{{ video_placeholder }}", video_placeholder)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out)
    return vocab
