"""Build a model from a preset/config (seeded random weights) or a local HF-layout safetensors checkpoint,
and name it for L3: a digest of its weights and config that two different models never share."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import torch
import xxhash
from safetensors.torch import load_file, save_file

from tierkv.engine.config import ModelConfig, resolve_config
from tierkv.engine.models import CausalLM, init_random_


# Device types the engine's kernels run on; others (meta: shapes only, no data) are refused at start
RUNNABLE_DEVICE_TYPES = ("cpu", "cuda", "xpu", "mps")


def check_device(device: str) -> torch.device:
    """``device`` as a torch.device if a model can run there: a known type, present on this machine, and
    a tiny tensor computed on it reads back right. ValueError saying why not (at start, not at the first
    request: a device that cannot hold data, such as meta, would fail every request after)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"not a torch device: {str(exc).splitlines()[0]}") from None
    if dev.type not in RUNNABLE_DEVICE_TYPES:
        raise ValueError(f"device type {dev.type!r} cannot run the model; use one of {RUNNABLE_DEVICE_TYPES}")
    backend = getattr(torch, dev.type, None)
    if dev.type != "cpu" and not (backend is not None and backend.is_available()):
        raise ValueError(f"{dev.type.upper()} is not available on this machine")
    if dev.index is not None and dev.type != "cpu" and dev.index >= backend.device_count():
        raise ValueError(f"this machine has {backend.device_count()} {dev.type} device(s), no index {dev.index}")
    try:
        probe = (torch.arange(4, dtype=torch.float32, device=dev) * 2).sum().item()
    except RuntimeError as exc:
        raise ValueError(f"a test computation failed: {str(exc).splitlines()[0]}") from None
    if probe != 12.0:
        raise ValueError(f"a test computation read back {probe}, not 12")
    return dev


def build_model(model: str | ModelConfig, device: torch.device | str = "cpu") -> CausalLM:
    """A preset name, a ModelConfig, a config.json, or a checkpoint directory (config.json + *.safetensors).

    Without weight files the model gets seeded random weights (``config.seed``).
    """
    cfg = model if isinstance(model, ModelConfig) else resolve_config(model)
    lm = CausalLM(cfg)
    weight_files = _weight_files(model)
    if weight_files:
        _load_weights(lm, weight_files)
    else:
        init_random_(lm, cfg.seed)
    return lm.to(device=device, dtype=cfg.torch_dtype).eval()


def _weight_files(model: str | ModelConfig) -> list[Path]:
    if isinstance(model, ModelConfig):
        return []
    path = Path(model)
    return sorted(path.glob("*.safetensors")) if path.is_dir() else []


def _load_weights(lm: CausalLM, files: list[Path]) -> None:
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    missing, unexpected = lm.load_state_dict(state, strict=False)
    if lm.config.tie_word_embeddings:  # tied checkpoints usually omit the head: it is the embedding
        missing = [k for k in missing if k != "lm_head.weight"]
    # rotary inverse frequencies and MoE/other extras some checkpoints carry are not parameters here
    unexpected = [k for k in unexpected if not k.endswith("rotary_emb.inv_freq")]
    if missing or unexpected:
        raise ValueError(f"checkpoint does not match the config: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")


def save_checkpoint(lm: CausalLM, directory: str | Path) -> Path:
    """Write ``config.json`` and ``model.safetensors`` with HF parameter names."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    lm.config.save_json(directory / "config.json")
    state = {k: v.detach().to("cpu").contiguous() for k, v in lm.state_dict().items()}
    if lm.config.tie_word_embeddings:
        del state["lm_head.weight"]  # safetensors refuses shared tensors; HF omits the tied head too
    save_file(state, str(directory / "model.safetensors"))
    return directory


def weights_digest(lm: torch.nn.Module) -> str:
    """xxh3-128 (hex) over every tensor's name, dtype, shape and bytes, whatever device it is on.

    The bytes themselves, not a checkpoint's headers and sizes: a fine-tune has the same headers and
    sizes as its base model. Hashing runs at memory speed, well below the cost of loading the weights.
    """
    state = xxhash.xxh3_128()
    for name, tensor in sorted(lm.state_dict().items()):
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)
        state.update(f"{name}|{flat.dtype}|{tuple(tensor.shape)}|".encode())
        state.update(flat.view(torch.uint8).numpy())
    return state.hexdigest()


def model_namespace(lm: CausalLM, model_id: str | None = None) -> str:
    """The model part of the L3 namespace: ``model_id`` (or the architecture) and a digest of the whole
    config, the weights and ``model_id``, so any change that changes the KV changes the keys."""
    identity = {"model_id": model_id, "config": dataclasses.asdict(lm.config), "weights": weights_digest(lm)}
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:32]
    return f"{model_id or lm.config.arch}-{digest}"
