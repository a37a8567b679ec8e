"""A tiny categorical sequence policy: prompt encoder + GRU decoder over a small vocabulary.

It is saved and loaded the way Hugging Face models are (``config.json`` + ``model.safetensors`` in a folder,
``from_pretrained``/``save_pretrained``), so the reference plugin exercises the same loading path as real ones.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn


@dataclass
class TinyPolicyConfig:
    """Architecture of :class:`TinySequencePolicy`.

    Token ids: digits ``0..num_digits-1``, then EOS, BOS and PAD. The decoder emits digits or EOS.
    """

    num_digits: int = 6
    max_prompt_length: int = 5
    embed_size: int = 16
    hidden_size: int = 64

    @property
    def eos_id(self) -> int:
        return self.num_digits

    @property
    def bos_id(self) -> int:
        return self.num_digits + 1

    @property
    def pad_id(self) -> int:
        return self.num_digits + 2

    @property
    def vocab_size(self) -> int:
        return self.num_digits + 3

    @property
    def num_outputs(self) -> int:
        return self.num_digits + 1  # digits and EOS


class TinySequencePolicy(nn.Module):
    """π(y_t | prompt, y_<t): a GRU decoder that attends over the prompt's token embeddings.

    The flattened prompt embeddings set the GRU's initial state; at each step the state attends over the
    prompt positions (PAD masked out) and the head reads the state and the attended context.

    Args:
        config: The architecture.
    """

    def __init__(self, config: TinyPolicyConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.embed_size)
        self.position = nn.Parameter(torch.zeros(config.max_prompt_length, config.embed_size))
        self.encoder = nn.Linear(config.max_prompt_length * config.embed_size, config.hidden_size)
        self.cell = nn.GRUCell(config.embed_size, config.hidden_size)
        self.keys = nn.Linear(config.embed_size, config.hidden_size)
        self.values = nn.Linear(config.embed_size, config.hidden_size)
        self.mix = nn.Linear(2 * config.hidden_size, config.hidden_size)
        self.head = nn.Linear(config.hidden_size, config.num_outputs)

    def encode(self, prompt_ids: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """``prompt_ids [N, P]`` (PAD-padded) → (initial state ``[N, H]``, keys ``[N, P, H]``, values ``[N, P, H]``,
        pad mask ``[N, P]``)."""
        embedded = self.embed(prompt_ids) + self.position  # [N, P, E]
        state = torch.tanh(self.encoder(embedded.flatten(1)))  # [N, H]
        return state, self.keys(embedded), self.values(embedded), prompt_ids == self.config.pad_id

    def step(self, state: Tensor, previous: Tensor, memory: tuple[Tensor, Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        """One decoding step: ``state [N, H]``, ``previous [N]`` token ids, the encoded prompt → (logits
        ``[N, V_out]``, new state)."""
        keys, values, pad = memory
        state = self.cell(self.embed(previous), state)  # [N, H]
        scores = torch.einsum("nh,nph->np", state, keys) / keys.shape[-1] ** 0.5  # [N, P]
        weights = torch.softmax(scores.masked_fill(pad, float("-inf")), dim=-1)  # [N, P]
        context = torch.einsum("np,nph->nh", weights, values)  # [N, H]
        return self.head(torch.tanh(self.mix(torch.cat([state, context], dim=-1)))), state

    def forward(self, prompt_ids: Tensor, tokens: Tensor) -> Tensor:
        """Teacher-forced logits of ``tokens [N, T]`` given ``prompt_ids [N, P]`` → ``[N, T, V_out]``.

        The loop runs the same :meth:`step` as sampling, so sampled and recomputed log-probs agree.
        """
        state, *memory = self.encode(prompt_ids)
        previous = torch.full((tokens.shape[0],), self.config.bos_id, dtype=torch.long, device=tokens.device)
        logits = []
        for t in range(tokens.shape[1]):
            step_logits, state = self.step(state, previous, memory)
            logits.append(step_logits)
            previous = tokens[:, t]
        return torch.stack(logits, dim=1)

    # ---------------------------------------------------------------- Hugging Face style persistence
    def save_pretrained(self, directory: str | Path) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "config.json").write_text(json.dumps(asdict(self.config), indent=2))
        save_file({k: v.detach().cpu().contiguous() for k, v in self.state_dict().items()},
                  str(directory / "model.safetensors"))

    @classmethod
    def from_pretrained(cls, directory: str | Path) -> TinySequencePolicy:
        directory = Path(directory)
        config_path, weights_path = directory / "config.json", directory / "model.safetensors"
        if not config_path.is_file() or not weights_path.is_file():
            raise FileNotFoundError(
                f"toy policy: expected config.json and model.safetensors in {directory}; "
                "create them with TinySequencePolicy.save_pretrained or leave plugin.model_path null"
            )
        model = cls(TinyPolicyConfig(**json.loads(config_path.read_text())))
        model.load_state_dict(load_file(str(weights_path)))
        return model
