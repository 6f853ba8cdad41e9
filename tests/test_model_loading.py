"""Checkpoint directories: the real-release layout loads; anything else fails with a message that says why."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from decoders.model import CheckpointError, Family, load_model


@pytest.mark.parametrize("family", [f.value for f in Family])
def test_every_family_loads_offline_from_its_directory(tiny_checkpoints: dict, family: str) -> None:
    lm = load_model(tiny_checkpoints[family], device="auto")
    assert lm.family.value == family
    assert str(lm.device) == "cpu" and lm.dtype.is_floating_point and lm.dtype.itemsize == 4
    names = {p.name for p in Path(tiny_checkpoints[family]).iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "preprocessor_config.json"} <= names
    assert {"generation_config.json", "chat_template.jinja"} <= names
    # the full EOS list of the generation config
    gen = json.loads((Path(tiny_checkpoints[family]) / "generation_config.json").read_text())
    assert set(gen["eos_token_id"]) <= set(lm.eos_token_ids)


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_missing_directory_is_named(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(tmp_path / "nope")


def test_a_file_is_not_a_checkpoint(tmp_path: Path) -> None:
    f = tmp_path / "model.bin"
    f.write_bytes(b"x")
    with pytest.raises(CheckpointError, match="not a directory"):
        load_model(f)


def test_directory_without_config_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"no config\.json"):
        load_model(tmp_path)


def test_unsupported_model_type_names_the_supported_ones(tiny_checkpoints: dict, tmp_path: Path) -> None:
    d = _copy(tiny_checkpoints["qwen2_vl"], tmp_path / "c")
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "llama"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"'llama' is not supported.*qwen2_vl"):
        load_model(d)


@pytest.mark.parametrize(
    ("remove", "message"),
    [
        ("model.safetensors", "weights"),
        ("tokenizer.json", "tokenizer"),
        ("preprocessor_config.json", "preprocessor_config.json"),
    ],
)
def test_missing_parts_are_named(tiny_checkpoints: dict, tmp_path: Path, remove: str, message: str) -> None:
    d = _copy(tiny_checkpoints["qwen2_5_vl"], tmp_path / "c")
    (d / remove).unlink()
    with pytest.raises(CheckpointError, match=f"missing: {message}"):
        load_model(d)


def test_corrupt_weights_give_a_checkpoint_error(tiny_checkpoints: dict, tmp_path: Path) -> None:
    d = _copy(tiny_checkpoints["llava_onevision"], tmp_path / "c")
    (d / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(CheckpointError, match="weights could not be loaded"):
        load_model(d)


def test_invalid_config_json_is_reported(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_model(tmp_path)


def test_the_7b_shape_is_qwen2_vl_7b_and_bf16_checkpoints_load(tmp_path: Path) -> None:
    """The GPU benchmark's random checkpoint has Qwen2-VL-7B's language-model shape; bf16 saving works."""
    import torch

    from decoders.tiny import WORDS, build_tiny_checkpoint, tiny_config
    from decoders.train.tokenizer import QWEN_SPECIALS

    vocab = {w: i for i, w in enumerate([*QWEN_SPECIALS, *WORDS])}
    text = tiny_config(Family.QWEN2_VL, vocab, "7b", init_std=0.02).text_config
    assert (text.hidden_size, text.num_hidden_layers, text.intermediate_size) == (3584, 28, 18944)
    assert (text.num_attention_heads, text.num_key_value_heads) == (28, 4)
    assert text.rope_parameters["mrope_section"] == [16, 24, 24]
    lm = load_model(build_tiny_checkpoint("qwen2_vl", tmp_path / "bf16", dtype=torch.bfloat16), device="cpu")
    assert lm.family is Family.QWEN2_VL


def test_the_default_dtype_is_float32_on_cpu_and_the_checkpoints_own_elsewhere() -> None:
    import torch

    from decoders.model import default_dtype

    cpu, gpu = torch.device("cpu"), torch.device("meta")  # any device that is not the CPU
    assert default_dtype({"dtype": "bfloat16"}, cpu) == torch.float32
    assert default_dtype({"dtype": "float32"}, gpu) == torch.float32  # the reference model on a GPU
    assert default_dtype({"torch_dtype": "bfloat16"}, gpu) == torch.bfloat16  # the older key
    assert default_dtype({"text_config": {"dtype": "float16"}}, gpu) == torch.float16
    assert default_dtype({}, gpu) == default_dtype({"dtype": "int8"}, gpu) == torch.bfloat16
