"""Image rewards: CLIP score, PickScore, HPSv2.1, LAION aesthetic, JPEG (in)compressibility.

Registered rewards (``Reward`` classes; each loads its model once, in ``__init__``):

- ``clip_score``: open_clip CLIP, ``logit_scale · cos(image, prompt) / divisor`` (Flow-GRPO: ÷30).
- ``pickscore``: PickScore (a transformers ``CLIPModel`` and processor), ``logit_scale · cos / divisor`` (÷26).
- ``hpsv2``: HPSv2.1 (open_clip ViT-H-14 with the HPS checkpoint), ``cos(image, prompt)``.
- ``aesthetic``: LAION improved-aesthetic MLP on the unit-normalised CLIP ViT-L/14 image embedding.
- ``jpeg_compressibility`` / ``jpeg_incompressibility``: ∓ JPEG size (quality 95) in kB / 500.

Images are read by :func:`mmrl.rewards.images.read_images` (tensors, arrays or PIL images; 8-bit RGB conversion;
clear errors on unusable payloads). Samples whose pixels are not all finite score NaN and are left to
``rewards.on_nonfinite``. Text-image rewards compare each image with its row's ``prompt``.

Weights come from a local path or the Hugging Face hub. Hub files are looked up in the local cache first; with
``HF_HUB_OFFLINE=1`` nothing is downloaded. When weights cannot be found or read, construction raises a
:class:`RewardWeightsError`, one line naming the reward, what was tried and which option to set.
"""

from __future__ import annotations

import io
import logging
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, ClassVar

import torch
from torch import Tensor, nn

from mmrl.extras import require_extra
from mmrl.registry import Range
from mmrl.reward import Reward, RewardError, RewardInput
from mmrl.rewards.images import ImageBatch, clip_pixels, read_images

HUB_PREFIX = "hf-hub:"
LOCAL_DIR_PREFIX = "local-dir:"


class RewardWeightsError(RewardError):
    """A reward's weights are missing or unusable. ``str(error)`` is one line naming the reward, the path or hub id
    tried, and the option that provides the weights."""


# ------------------------------------------------------------------------------------------------ shared helpers


def pick_device(reward: str, device: str | None) -> torch.device:
    """``device`` as a torch device; ``None`` picks cuda when available, else cpu."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError:
        raise RewardError(f"reward {reward!r}: device {device!r} is not a torch device; allowed: cpu, cuda, "
                          "cuda:N, mps or null (cuda when available)") from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise RewardError(f"reward {reward!r}: device {device!r} requested but CUDA is not available; use cpu or null")
    return resolved


def hub_offline() -> bool:
    """True when Hugging Face downloads are disabled (``HF_HUB_OFFLINE`` set now or when the hub library loaded)."""
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        return True
    from huggingface_hub import constants

    return bool(getattr(constants, "HF_HUB_OFFLINE", False))


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    message = text[0] if text else ""
    return f"{type(error).__name__}: {message[:300]}" if message else type(error).__name__


def _network_errors() -> tuple[type[BaseException], ...]:
    from huggingface_hub.errors import EntryNotFoundError

    return (OSError, ValueError, RuntimeError, EntryNotFoundError)


def resolve_file(reward: str, option: str, value: str, how: str) -> str:
    """A local file for ``value``: an existing path, or ``hf-hub:org/repo/path/in/repo`` fetched from the hub.

    Raises :class:`RewardWeightsError` naming the reward, the path or hub file tried and ``how`` to provide it.
    """
    if value.startswith(HUB_PREFIX):
        parts = value[len(HUB_PREFIX):].strip("/").split("/")
        if len(parts) < 3 or not all(parts):
            raise RewardWeightsError(f"reward {reward!r}: {option}={value!r} is not a hub file; write "
                                     f"hf-hub:ORG/REPO/FILE or a local path")
        repo_id, filename = "/".join(parts[:2]), "/".join(parts[2:])
        return _hub_file(reward, option, repo_id, filename, how)
    path = Path(value).expanduser()
    if path.is_file():
        return str(path)
    state = "is a folder, not a file" if path.is_dir() else "does not exist"
    raise RewardWeightsError(f"reward {reward!r}: {option} file '{path}' {state}; {how}")


def _hub_file(reward: str, option: str, repo_id: str, filenames: str | list[str], how: str) -> str:
    """The first of ``filenames`` in hub repo ``repo_id``: from the local cache, else downloaded (unless offline)."""
    from huggingface_hub import hf_hub_download

    candidates = [filenames] if isinstance(filenames, str) else list(filenames)
    errors = _network_errors()
    for filename in candidates:
        try:
            return hf_hub_download(repo_id, filename, local_files_only=True)  # the cache, no network access
        except errors:
            continue  # not cached: try the next name, then download below unless offline
    where = f"hf-hub:{repo_id}/{candidates[-1]}"
    if hub_offline():
        raise RewardWeightsError(f"reward {reward!r}: {option} {where} is not in the local Hugging Face cache and "
                                 f"HF_HUB_OFFLINE is set; {how}")
    last: BaseException | None = None
    for filename in candidates:
        try:
            return hf_hub_download(repo_id, filename)
        except errors as error:
            last = error
    raise RewardWeightsError(f"reward {reward!r}: could not download {option} {where} ({_first_line(last)}); "
                             f"{how}") from None


def read_state_dict(reward: str, option: str, path: str) -> dict[str, Tensor]:
    """Tensors of a ``.safetensors`` file or a torch checkpoint (loaded with ``weights_only=True``, never full
    unpickling); a ``{"state_dict": ...}`` wrapper and ``module.`` prefixes are removed."""
    import pickle

    try:
        if path.endswith(".safetensors"):
            from safetensors.torch import load_file

            state: Any = load_file(path, device="cpu")
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, OSError, EOFError, ValueError) as error:
        raise RewardWeightsError(
            f"reward {reward!r}: cannot read {option} file '{path}' as safetensors or a weights-only torch checkpoint "
            f"({_first_line(error)}); convert it to .safetensors or check the file"
        ) from None
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    if not isinstance(state, dict) or not all(isinstance(v, Tensor) for v in state.values()):
        raise RewardWeightsError(f"reward {reward!r}: {option} file '{path}' does not hold a state dict of tensors")
    if state and all(key.startswith("module.") for key in state):
        state = {key[len("module."):]: value for key, value in state.items()}
    return state


def load_weights(reward: str, option: str, path: str, module: nn.Module, what: str) -> None:
    """Load ``path`` into ``module`` strictly; a mismatch is one line naming the first differing keys."""
    state = read_state_dict(reward, option, path)
    state.pop("text.transformer.embeddings.position_ids", None)
    expected = module.state_dict()
    if "logit_scale" in state and "logit_scale" in expected and state["logit_scale"].shape != expected[
            "logit_scale"].shape:
        state["logit_scale"] = state["logit_scale"].reshape(expected["logit_scale"].shape)
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    shapes = sorted(k for k in set(state) & set(expected) if state[k].shape != expected[k].shape)
    if missing or unexpected or shapes:
        details = []
        if missing:
            details.append(f"{len(missing)} missing keys (e.g. {missing[0]})")
        if unexpected:
            details.append(f"{len(unexpected)} unexpected keys (e.g. {unexpected[0]})")
        if shapes:
            key = shapes[0]
            details.append(f"{len(shapes)} shape mismatches (e.g. {key}: file {list(state[key].shape)} vs "
                           f"model {list(expected[key].shape)})")
        raise RewardWeightsError(f"reward {reward!r}: {option} file '{path}' does not fit {what}: "
                                 + "; ".join(details))
    module.load_state_dict(state, strict=True)


@contextmanager
def _quiet_random_init_warning() -> Iterator[None]:
    """open_clip warns 'Model initialized randomly' when built without weights; ours are loaded right after."""

    class _Filter(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            return "No pretrained weights loaded" not in record.getMessage()

    filt = _Filter()
    root = logging.getLogger()
    root.addFilter(filt)
    try:
        yield
    finally:
        root.removeFilter(filt)


class OpenClip:
    """An open_clip model with its tokenizer and preprocessing, loaded with clear errors.

    Args:
        reward: The reward's name, for messages.
        model: An open_clip architecture name (``"ViT-L-14"``), a path to a model-config JSON file (registered with
            ``open_clip.add_model_config``; the architecture is the file's stem), or ``hf-hub:ORG/REPO`` /
            ``local-dir:PATH`` (an open_clip model folder carrying config and weights).
        pretrained: An open_clip pretrained tag of ``model`` (``"openai"``), a local checkpoint file, or
            ``hf-hub:ORG/REPO/FILE``. Must be null with ``hf-hub:``/``local-dir:`` models and with ``checkpoint``.
        checkpoint: Instead of ``pretrained``: a full state dict to load over the architecture (HPSv2), as a local
            file or ``hf-hub:ORG/REPO/FILE``.
        device: Where the model runs.
        option: The name of the reward option that names the weights (for messages).
        resize_mode: How images are fitted to the model's input (:func:`~mmrl.rewards.images.clip_pixels`); None:
            the model's own preprocessing config (open_clip's evaluation transform: the shorter side, centre crop).
    """

    def __init__(self, reward: str, model: str, pretrained: str | None, device: torch.device,
                 checkpoint: str | None = None, option: str = "pretrained", how: str | None = None,
                 resize_mode: str | None = None):
        require_extra("image-rewards", f"reward {reward!r}", ["open_clip"])
        import open_clip

        self.reward = reward
        self.how = how
        name = model
        if model.endswith(".json"):
            path = Path(model).expanduser()
            if not path.is_file():
                raise RewardWeightsError(f"reward {reward!r}: model config file '{path}' does not exist; set this "
                                         "reward's args.model to an open_clip architecture name or a config JSON")
            open_clip.add_model_config(path)
            name = path.stem
        schema = model.startswith(HUB_PREFIX) or model.startswith(LOCAL_DIR_PREFIX)
        if schema and (pretrained or checkpoint):
            raise RewardError(f"reward {reward!r}: model {model!r} carries its own weights; set {option}: null")
        if not schema and name not in open_clip.list_models():
            raise RewardError(f"reward {reward!r}: unknown open_clip architecture {name!r}; use a name from "
                              "open_clip.list_models() (e.g. ViT-L-14, ViT-H-14) or a path to a model-config JSON")
        if not schema and not pretrained and not checkpoint:
            raise RewardWeightsError(f"reward {reward!r}: no weights given for {name!r}; set this reward's "
                                     f"args.{option} (a pretrained tag, a local file or hf-hub:ORG/REPO/FILE)")
        weights_file, quick_gelu, preprocess = None, False, {}
        if checkpoint:
            weights_file = resolve_file(reward, option, checkpoint, self._how(option, name))
        elif pretrained and not schema:
            weights_file, quick_gelu, preprocess = self._pretrained(open_clip, name, pretrained, option)
        try:
            with _quiet_random_init_warning():
                self.model = open_clip.create_model(name if not schema else model, device=device,
                                                    force_quick_gelu=quick_gelu)
        except _network_errors() as error:
            raise RewardWeightsError(f"reward {reward!r}: could not load open_clip model {model!r} "
                                     f"({_first_line(error)}); {self._how(option, name)}") from None
        if weights_file is not None:
            load_weights(reward, option, weights_file, self.model, f"open_clip architecture {name!r}")
        self.model = self.model.to(device).eval().requires_grad_(False)
        self.device = device
        cfg = dict(getattr(self.model.visual, "preprocess_cfg", {}) or {})
        cfg.update({k: v for k, v in preprocess.items() if k in ("mean", "std", "interpolation", "resize_mode")})
        size = cfg.get("size", getattr(self.model.visual, "image_size", 224))
        self.image_size = (size, size) if isinstance(size, int) else tuple(size)
        self.mean = tuple(cfg.get("mean", (0.48145466, 0.4578275, 0.40821073)))
        self.std = tuple(cfg.get("std", (0.26862954, 0.26130258, 0.27577711)))
        self.resize_mode = resize_mode or cfg.get("resize_mode", "shortest")
        self.interpolation = cfg.get("interpolation", "bicubic")
        try:
            self.tokenizer = open_clip.get_tokenizer(name if not schema else model)
        except _network_errors() as error:
            raise RewardWeightsError(f"reward {reward!r}: could not load the tokenizer of open_clip model {model!r} "
                                     f"({_first_line(error)})") from None

    def _how(self, option: str, name: str) -> str:
        if self.how is not None:
            return self.how
        return (f"set this reward's args.{option} to a local checkpoint file (.safetensors, .pt or .bin), "
                f"hf-hub:ORG/REPO/FILE, or an open_clip pretrained tag of {name!r}")

    def _pretrained(self, open_clip: Any, name: str, pretrained: str, option: str
                    ) -> tuple[str, bool, dict[str, Any]]:
        tag = open_clip.get_pretrained_cfg(name, pretrained)
        if not tag:
            if pretrained.startswith(HUB_PREFIX) or Path(pretrained).expanduser().exists() or os.sep in pretrained \
                    or pretrained.endswith((".pt", ".pth", ".bin", ".safetensors")):
                return resolve_file(self.reward, option, pretrained, self._how(option, name)), False, {}
            tags = ", ".join(open_clip.list_pretrained_tags_by_model(name)) or "(none)"
            raise RewardWeightsError(f"reward {self.reward!r}: {option}={pretrained!r} is neither a file nor a "
                                     f"pretrained tag of open_clip model {name!r} (tags: {tags})")
        hub = (tag.get("hf_hub") or "").strip()
        if hub:
            repo_id, filename = os.path.split(hub)
            filename = filename or "open_clip_pytorch_model.bin"
            stem = filename.rsplit(".", 1)[0]
            safe = "open_clip_model.safetensors" if stem == "open_clip_pytorch_model" else f"{stem}.safetensors"
            path = _hub_file(self.reward, option, repo_id, [safe, filename], self._how(option, name))
        else:
            try:
                path = open_clip.download_pretrained(tag)  # a URL download, cached under ~/.cache/clip
            except _network_errors() as error:
                raise RewardWeightsError(
                    f"reward {self.reward!r}: could not download weights of {name!r}/{pretrained!r} from "
                    f"{tag.get('url', '')} ({_first_line(error)}); {self._how(option, name)}") from None
        if not path:
            raise RewardWeightsError(f"reward {self.reward!r}: no download source for {name!r}/{pretrained!r}; "
                                     f"{self._how(option, name)}")
        return path, bool(tag.get("quick_gelu", False)), tag

    def pixels(self, images: list[Tensor]) -> Tensor:
        return clip_pixels(images, self.image_size, self.mean, self.std, self.device, self.resize_mode,
                           self.interpolation)

    def image_features(self, images: list[Tensor]) -> Tensor:
        """Unit-norm image embeddings ``[N, D]`` (float32) of uint8 ``[3, H, W]`` images."""
        return self.model.encode_image(self.pixels(images), normalize=True).float()

    def text_features(self, texts: list[str]) -> Tensor:
        """Unit-norm text embeddings ``[T, D]`` (float32)."""
        tokens = self.tokenizer(texts).to(self.device)
        return self.model.encode_text(tokens, normalize=True).float()

    @property
    def logit_scale(self) -> float:
        return float(self.model.logit_scale.exp())


def _unique(texts: list[str]) -> tuple[list[str], Tensor]:
    """Unique texts (first-seen order) and, per input, the index of its text in that list."""
    index: dict[str, int] = {}
    positions = [index.setdefault(text, len(index)) for text in texts]
    return list(index), torch.tensor(positions, dtype=torch.long)


def _prompts(batch: RewardInput, field: str) -> list[str]:
    return [str(value) for value in batch.column(field)]


# The ranges of the options that _check_positive checks again when a reward is built directly.
Positive = Annotated[float, Range(0, low_open=True)]
BatchSize = Annotated[int, Range(1)]


def _check_positive(reward: str, **values: float) -> None:
    for name, value in values.items():
        if not value > 0:
            raise RewardError(f"reward {reward!r}: {name} must be > 0, got {value!r}")


class _ImageReward(Reward):
    """Batched scoring of valid images in chunks; invalid (non-finite) samples score NaN."""

    name: ClassVar[str] = "image reward"

    output: str
    batch_size: int

    def __call__(self, batch: RewardInput) -> Tensor:
        images = read_images(batch, self.output, self.name)
        scores = torch.zeros(len(images), dtype=torch.float64)
        valid = images.finite.nonzero().flatten().tolist()
        if valid:
            context = self._context(batch)
            with torch.no_grad():
                for start in range(0, len(valid), self.batch_size):
                    chunk = valid[start : start + self.batch_size]
                    values = self._score(images, chunk, context)
                    scores[chunk] = values.detach().to("cpu", torch.float64)
        return images.nan_where_invalid(scores)

    def _context(self, batch: RewardInput) -> Any:
        return None

    def _score(self, images: ImageBatch, chunk: list[int], context: Any) -> Tensor:
        raise NotImplementedError


class _TextImageReward(_ImageReward):
    """Rewards that compare each image with its prompt; text features are computed once per unique prompt."""

    field: str

    def _context(self, batch: RewardInput) -> Any:
        texts, positions = _unique(_prompts(batch, self.field))
        with torch.no_grad():
            return self._text_features(texts), positions

    def _text_features(self, texts: list[str]) -> Tensor:
        raise NotImplementedError


# ------------------------------------------------------------------------------------------------ CLIP score


class ClipScore(_TextImageReward):
    """CLIP image-text similarity: logit_scale · cos(image, prompt) / divisor, with an open_clip model.

    With the defaults (OpenAI CLIP ViT-L/14, logit scale 100, divisor 30) this is Flow-GRPO's CLIPScore reward,
    about 3.3 · cos, typically 0.6–1.2 for matching pairs, up to its input: Flow-GRPO's ``clip_scorer.py`` (read in
    zhtmike/flow_grpo@19d5169) resizes the float image bilinearly without the 8-bit rounding, mmrl rounds to 8 bits
    and resizes bicubic (docs/rewards.md, "Image inputs"). Set ``divisor`` to 100 to get the plain cosine, or to 40
    for Hessel et al.'s CLIPScore 2.5 · cos (without its clipping at 0).
    """

    name: ClassVar[str] = "clip_score"

    def __init__(self, model: str = "ViT-L-14", pretrained: str | None = "openai", divisor: Positive = 30.0,
                 field: str = "prompt", output: str = "images", batch_size: BatchSize = 32,
                 device: str | None = None):
        """Options (the config's ``args``).

        Args:
            model: open_clip architecture name, a model-config JSON path, or hf-hub:ORG/REPO / local-dir:PATH.
            pretrained: open_clip pretrained tag (e.g. openai), a local checkpoint file, or hf-hub:ORG/REPO/FILE.
            divisor: The score is the model's logit_scale · cosine divided by this.
            field: Dataset column holding the text each image is compared with.
            output: Payload entry holding the images.
            batch_size: Images per forward pass.
            device: Where the model runs (null: cuda when available, else cpu).
        """
        _check_positive(self.name, divisor=divisor, batch_size=batch_size)
        self.divisor, self.field, self.output, self.batch_size = divisor, field, output, batch_size
        self.clip = OpenClip(self.name, model, pretrained, pick_device(self.name, device))

    def _text_features(self, texts: list[str]) -> Tensor:
        return self.clip.text_features(texts)

    def _score(self, images: ImageBatch, chunk: list[int], context: Any) -> Tensor:
        text, positions = context
        image = self.clip.image_features([images.images[i] for i in chunk])
        cosine = (image * text[positions[chunk].to(image.device)]).sum(-1)
        return self.clip.logit_scale * cosine / self.divisor


# ------------------------------------------------------------------------------------------------ HPSv2


class HPSv2(_TextImageReward):
    """Human Preference Score v2.1: cos(image, prompt) of open_clip ViT-H-14 fine-tuned on HPD v2 (≈0.2–0.35).

    The architecture is built without weights and the whole HPS state dict is loaded over it (strictly), so no
    other download is needed. The checkpoint is read with ``torch.load(weights_only=True)`` or as safetensors.
    """

    name: ClassVar[str] = "hpsv2"

    def __init__(self, checkpoint: str = "hf-hub:xswu/HPSv2/HPS_v2.1_compressed.pt", model: str = "ViT-H-14",
                 field: str = "prompt", output: str = "images", batch_size: BatchSize = 16,
                 device: str | None = None):
        """Options (the config's ``args``).

        Args:
            checkpoint: HPS_v2.1_compressed.pt: a local path or hf-hub:ORG/REPO/FILE.
            model: open_clip architecture the checkpoint belongs to (a name or a model-config JSON path).
            field: Dataset column holding the text each image is compared with.
            output: Payload entry holding the images.
            batch_size: Images per forward pass.
            device: Where the model runs (null: cuda when available, else cpu).
        """
        _check_positive(self.name, batch_size=batch_size)
        self.field, self.output, self.batch_size = field, output, batch_size
        how = ("set this reward's args.checkpoint to a local HPS_v2.1_compressed.pt (or a .safetensors copy) or "
               "hf-hub:ORG/REPO/FILE (it is published as hf-hub:xswu/HPSv2/HPS_v2.1_compressed.pt)")
        # HPSv2 scores with its light-augmentation eval transform: the longer side resized to 224, the rest padded
        # black (img_score.py, light_augmentation=True -> factory.py L368-375 -> ResizeMaxSize, tgxs002/HPSv2@866735e;
        # Flow-GRPO's and DanceGRPO's HPS rewards build the same transform), not open_clip's centre crop.
        self.clip = OpenClip(self.name, model, None, pick_device(self.name, device), checkpoint=checkpoint,
                             option="checkpoint", how=how, resize_mode="longest")

    def _text_features(self, texts: list[str]) -> Tensor:
        return self.clip.text_features(texts)

    def _score(self, images: ImageBatch, chunk: list[int], context: Any) -> Tensor:
        text, positions = context
        image = self.clip.image_features([images.images[i] for i in chunk])
        return (image * text[positions[chunk].to(image.device)]).sum(-1)


# ------------------------------------------------------------------------------------------------ aesthetic


class AestheticMLP(nn.Module):
    """The LAION improved-aesthetic-predictor head: Linear layers 768→1024→128→64→16→1 with dropout between the
    first four and no activations (its state-dict keys are ``layers.{0,2,4,6,7}``)."""

    def __init__(self, in_features: int = 768):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(in_features, 1024), nn.Dropout(0.2),
            nn.Linear(1024, 128), nn.Dropout(0.2),
            nn.Linear(128, 64), nn.Dropout(0.1),
            nn.Linear(64, 16),
            nn.Linear(16, 1),
        )

    def forward(self, embedding: Tensor) -> Tensor:
        return self.layers(embedding)


class Aesthetic(_ImageReward):
    """LAION aesthetic score (≈1–10): the improved-aesthetic MLP on the unit-normalised CLIP ViT-L/14 embedding.

    The default MLP weights are TRL's DDPO copy of ``sac+logos+ava1-l14-linearMSE.pth``; any state dict with the
    keys ``layers.{0,2,4,6,7}.{weight,bias}`` fits. The score is the MLP's raw output (Flow-GRPO and DDPO use it
    unscaled). The prompt is not used.
    """

    name: ClassVar[str] = "aesthetic"

    def __init__(self, mlp_weights: str = "hf-hub:trl-lib/ddpo-aesthetic-predictor/aesthetic-model.pth",
                 model: str = "ViT-L-14", pretrained: str | None = "openai", output: str = "images",
                 batch_size: BatchSize = 32, device: str | None = None):
        """Options (the config's ``args``).

        Args:
            mlp_weights: The MLP's state dict (.pth/.pt or .safetensors): a local path or hf-hub:ORG/REPO/FILE.
            model: open_clip architecture of the image encoder (its embedding size must match the MLP's input).
            pretrained: open_clip pretrained tag of the encoder (openai = OpenAI's ViT-L/14), a file or hf-hub file.
            output: Payload entry holding the images.
            batch_size: Images per forward pass.
            device: Where the model runs (null: cuda when available, else cpu).
        """
        _check_positive(self.name, batch_size=batch_size)
        self.output, self.batch_size = output, batch_size
        resolved = pick_device(self.name, device)
        how = "set this reward's args.mlp_weights to a local copy of sac+logos+ava1-l14-linearMSE.pth (LAION " \
              "improved-aesthetic-predictor) or hf-hub:ORG/REPO/FILE"
        weights = resolve_file(self.name, "mlp_weights", mlp_weights, how)  # before the (larger) CLIP download
        self.clip = OpenClip(self.name, model, pretrained, resolved)
        width = int(self.clip.model.visual.output_dim)
        self.mlp = AestheticMLP(width)
        load_weights(self.name, "mlp_weights", weights, self.mlp, f"the aesthetic MLP for {width}-d embeddings")
        self.mlp = self.mlp.to(resolved).eval().requires_grad_(False)

    def _score(self, images: ImageBatch, chunk: list[int], context: Any) -> Tensor:
        embedding = self.clip.image_features([images.images[i] for i in chunk])
        return self.mlp(embedding).squeeze(-1)


# ------------------------------------------------------------------------------------------------ PickScore


def _looks_like_path(value: str) -> bool:
    return value.startswith(("/", "./", "../", "~", ".\\")) or value.count("/") > 1 or os.sep != "/" and os.sep in value


def load_pretrained(reward: str, option: str, ident: str, loader: Callable[..., Any], what: str) -> Any:
    """``loader(ident)`` (a transformers ``from_pretrained``) from a local folder or a hub id, cache first.

    Raises :class:`RewardWeightsError` when the folder is missing, the id is not cached and downloads are off or
    fail, or the files cannot be read.
    """
    how = (f"download it where there is network (huggingface-cli download {ident}) and set this reward's "
           f"args.{option} to the local folder") if not _looks_like_path(ident) else \
        f"set this reward's args.{option} to a folder written by save_pretrained, or a hub id"
    path = Path(ident).expanduser()
    errors = _network_errors()
    if path.is_dir():
        try:
            return loader(str(path))
        except errors as error:
            raise RewardWeightsError(f"reward {reward!r}: cannot load {what} from '{path}' ({_first_line(error)}); "
                                     f"{how}") from None
    if _looks_like_path(ident) or path.exists():
        state = "is a file, not a folder" if path.exists() else "does not exist"
        raise RewardWeightsError(f"reward {reward!r}: {option} folder '{ident}' {state}; {how}")
    try:
        return loader(ident, local_files_only=True)
    except errors:
        pass  # not cached: download below unless offline
    if hub_offline():
        raise RewardWeightsError(f"reward {reward!r}: {what} {ident!r} is not in the local Hugging Face cache and "
                                 f"HF_HUB_OFFLINE is set; {how}")
    try:
        return loader(ident)
    except errors as error:
        raise RewardWeightsError(f"reward {reward!r}: could not load {what} {ident!r} from the Hugging Face hub "
                                 f"({_first_line(error)}); {how}") from None


class PickScore(_TextImageReward):
    """PickScore: logit_scale · cos(image, prompt) / divisor with a transformers CLIP model fine-tuned on Pick-a-Pic.

    With the defaults this is Flow-GRPO's PickScore reward: logit scale ≈100, divided by 26, so ≈0.8–0.9 for typical
    images (PickScore's own "score" is the undivided logit, ≈21–23). The processor resizes and normalises the
    8-bit images and tokenizes the prompts (truncated to the text model's length).
    """

    name: ClassVar[str] = "pickscore"

    def __init__(self, model: str = "yuvalkirstain/PickScore_v1",
                 processor: str = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K", divisor: Positive = 26.0,
                 field: str = "prompt", output: str = "images", batch_size: BatchSize = 32,
                 device: str | None = None):
        """Options (the config's ``args``).

        Args:
            model: CLIPModel weights: a hub id or a local folder written by save_pretrained.
            processor: The matching processor (image processor and tokenizer): a hub id or a local folder.
            divisor: The score is logit_scale · cosine divided by this.
            field: Dataset column holding the text each image is compared with.
            output: Payload entry holding the images.
            batch_size: Images per forward pass.
            device: Where the model runs (null: cuda when available, else cpu).
        """
        require_extra("image-rewards", f"reward {self.name!r}", ["transformers", "PIL"])
        from transformers import AutoProcessor, CLIPModel

        _check_positive(self.name, divisor=divisor, batch_size=batch_size)
        self.divisor, self.field, self.output, self.batch_size = divisor, field, output, batch_size
        self.device = pick_device(self.name, device)
        self.processor = load_pretrained(self.name, "processor", processor, AutoProcessor.from_pretrained,
                                         "the processor")
        clip = load_pretrained(self.name, "model", model, CLIPModel.from_pretrained, "the CLIP model")
        if not isinstance(clip, CLIPModel):
            raise RewardWeightsError(f"reward {self.name!r}: {model!r} is a {type(clip).__name__}, not a CLIPModel")
        self.model = clip.to(self.device).eval().requires_grad_(False)
        self.max_length = int(self.model.config.text_config.max_position_embeddings)

    def _text_features(self, texts: list[str]) -> Tensor:
        tokens = self.processor(text=texts, padding=True, truncation=True, max_length=self.max_length,
                                return_tensors="pt")
        return {key: value.to(self.device) for key, value in tokens.items()}  # type: ignore[return-value]

    def _score(self, images: ImageBatch, chunk: list[int], context: Any) -> Tensor:
        tokens, positions = context
        pixels = self.processor(images=[images.images[i].cpu() for i in chunk], return_tensors="pt",
                                input_data_format="channels_first")["pixel_values"].to(self.device)
        out = self.model(pixel_values=pixels, input_ids=tokens["input_ids"],
                         attention_mask=tokens.get("attention_mask"))
        # logits_per_image[i, t] = logit_scale · cos(image i, text t)
        logits = out.logits_per_image.float()
        return logits.gather(1, positions[chunk].to(logits.device).unsqueeze(1)).squeeze(1) / self.divisor


# ------------------------------------------------------------------------------------------------ JPEG


def jpeg_size_kb(image: Any, quality: int) -> float:
    """Size in kB (1000 bytes) of ``image`` (an RGB PIL image) saved as JPEG at ``quality``."""
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=quality)
    return buffer.tell() / 1000.0


class JpegCompressibility(_ImageReward):
    """JPEG compressibility: −(JPEG size in kB at quality 95) / divisor; flat, simple images score higher.

    The DDPO/Flow-GRPO toy reward (Flow-GRPO: −size_kB / 500). No weights are needed.
    """

    name: ClassVar[str] = "jpeg_compressibility"
    sign: ClassVar[float] = -1.0

    def __init__(self, quality: Annotated[int, Range(1, 100)] = 95, divisor: Positive = 500.0,
                 output: str = "images"):
        """Options (the config's ``args``).

        Args:
            quality: JPEG quality passed to PIL.
            divisor: The size in kB is divided by this.
            output: Payload entry holding the images.
        """
        require_extra("image-rewards", f"reward {self.name!r}", ["PIL"])  # the JPEG encoder
        if not 1 <= quality <= 100:
            raise RewardError(f"reward {self.name!r}: quality must be in 1..100, got {quality!r}")
        _check_positive(self.name, divisor=divisor)
        self.quality, self.divisor, self.output, self.batch_size = quality, divisor, output, 1 << 30

    def _score(self, images: ImageBatch, chunk: list[int], context: Any) -> Tensor:
        sizes = [jpeg_size_kb(images.pil(i), self.quality) for i in chunk]
        return self.sign * torch.tensor(sizes, dtype=torch.float64) / self.divisor


class JpegIncompressibility(JpegCompressibility):
    """JPEG incompressibility: +(JPEG size in kB at quality 95) / divisor; detailed, noisy images score higher.

    The mirror image of ``jpeg_compressibility`` (same scale, opposite sign). No weights are needed.

    Args:
        quality: JPEG quality passed to PIL.
        divisor: The size in kB is divided by this.
        output: Payload entry holding the images.
    """

    name: ClassVar[str] = "jpeg_incompressibility"
    sign: ClassVar[float] = 1.0
