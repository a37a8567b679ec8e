"""Tiny random reward models saved to disk once per session, loaded back through the rewards' own loading code.

Nothing is downloaded: the open_clip architecture is a small model-config JSON, the transformers CLIP model and its
processor (a byte-level BPE tokenizer with no merges) are written with ``save_pretrained``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

TINY_ARCH = "mmrl-test-tiny-clip"
TINY_SIZE = 32


@dataclass(frozen=True)
class TinyModels:
    clip_config: str  # open_clip model-config JSON (the `model` option)
    clip_weights: str  # open_clip state dict, torch format
    clip_safetensors: str  # the same weights as safetensors
    hps_checkpoint: str  # {"state_dict": ...} like HPS_v2.1_compressed.pt
    aesthetic_mlp: str  # LAION aesthetic MLP for 16-d embeddings
    pickscore_dir: str  # transformers CLIPModel + CLIPProcessor folder


def _byte_level_vocab() -> dict[str, int]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    characters = list(bytes_to_unicode().values())
    vocab = {c: i for i, c in enumerate(characters)}
    vocab.update({c + "</w>": len(characters) + i for i, c in enumerate(characters)})
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    return vocab


def save_tiny_open_clip(folder: Path) -> tuple[str, str, str, str, str]:
    import open_clip
    from safetensors.torch import save_file

    from mmrl.rewards.image_models import AestheticMLP

    config = {
        "embed_dim": 16,
        "vision_cfg": {"image_size": TINY_SIZE, "layers": 2, "width": 32, "patch_size": 8, "head_width": 16},
        "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 2},
    }
    config_path = folder / f"{TINY_ARCH}.json"
    config_path.write_text(json.dumps(config))
    open_clip.add_model_config(config_path)
    torch.manual_seed(0)
    model = open_clip.create_model(TINY_ARCH)
    state = model.state_dict()
    weights = folder / "tiny_clip.pt"
    torch.save(state, weights)
    safetensors = folder / "tiny_clip.safetensors"
    save_file({k: v.contiguous() for k, v in state.items()}, str(safetensors))
    # HPSv2 ships {"state_dict": ...}; a different seed so that it is not the CLIP model.
    torch.manual_seed(1)
    hps = open_clip.create_model(TINY_ARCH)
    hps_path = folder / "HPS_tiny.pt"
    torch.save({"state_dict": hps.state_dict()}, hps_path)
    torch.manual_seed(2)
    mlp = AestheticMLP(16)
    mlp_path = folder / "aesthetic_tiny.pth"
    torch.save(mlp.state_dict(), mlp_path)
    return str(config_path), str(weights), str(safetensors), str(hps_path), str(mlp_path)


def save_tiny_pickscore(folder: Path) -> str:
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor, CLIPTokenizer

    folder.mkdir()
    vocab = _byte_level_vocab()
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n")
    tokenizer = CLIPTokenizer(str(folder / "vocab.json"), str(folder / "merges.txt"))
    image_processor = CLIPImageProcessor(size={"shortest_edge": TINY_SIZE},
                                         crop_size={"height": TINY_SIZE, "width": TINY_SIZE})
    CLIPProcessor(image_processor=image_processor, tokenizer=tokenizer).save_pretrained(folder)
    bos, eos = vocab["<|startoftext|>"], vocab["<|endoftext|>"]
    config = CLIPConfig(
        text_config={"vocab_size": len(vocab), "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                     "num_attention_heads": 2, "max_position_embeddings": 77, "bos_token_id": bos,
                     "eos_token_id": eos, "pad_token_id": eos},
        vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                       "image_size": TINY_SIZE, "patch_size": 8},
        projection_dim=16,
    )
    torch.manual_seed(3)
    CLIPModel(config).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> TinyModels:
    folder = tmp_path_factory.mktemp("tiny_reward_models")
    clip_config, clip_weights, clip_safetensors, hps, mlp = save_tiny_open_clip(folder)
    pickscore = save_tiny_pickscore(folder / "pickscore")
    return TinyModels(clip_config, clip_weights, clip_safetensors, hps, mlp, pickscore)


def random_images(n: int, size: int = TINY_SIZE, seed: int = 0, height: int | None = None) -> torch.Tensor:
    """``[n, 3, height, size]`` float images in [0, 1] with a fixed seed."""
    generator = torch.Generator().manual_seed(seed)
    return torch.rand(n, 3, height or size, size, generator=generator)
