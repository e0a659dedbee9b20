"""Loading a target + draft pair through AutoModelForCausalLM / AutoTokenizer."""

from __future__ import annotations

import logging
import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from specd.engine.types import ModelLoadError

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ModelPair:
    target: PreTrainedModel
    draft: PreTrainedModel | None
    tokenizer: object
    target_name: str
    draft_name: str | None
    device: torch.device
    dtype: torch.dtype

    def describe(self) -> dict:
        def params(model):
            return sum(p.numel() for p in model.parameters()) if model is not None else 0
        return {
            "target": self.target_name,
            "draft": self.draft_name,
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
            "target_params": params(self.target),
            "draft_params": params(self.draft),
        }


def resolve_device(name: str = "auto") -> torch.device:
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        device = torch.device(name)
    except RuntimeError as err:
        raise ModelLoadError(f"model.device: {name!r} is not a torch device ({err})") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"model.device is {name!r} but torch finds no CUDA device")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name != "auto":
        return DTYPES[name]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def _check_source(name: str, role: str) -> None:
    """A path-looking name must exist; hub ids pass through to transformers."""
    looks_local = name.startswith((".", "/", "~")) or os.sep in name.strip("/") and name.count("/") > 1
    path = Path(name).expanduser()
    if looks_local and not path.exists():
        raise ModelLoadError(f"{role} model directory {name} does not exist")
    if path.is_dir() and not (path / "config.json").is_file():
        raise ModelLoadError(f"{role} model directory {name} has no config.json (not a Hugging Face model)")


def _reason(err: Exception) -> str:
    """The first line of a loader's error, with a hint where it asks for remote code."""
    first = str(err).splitlines()[0] if str(err) else type(err).__name__
    if "trust_remote_code" in str(err):
        first += " (specd leaves model.trust_remote_code off; turn it on only for a repo you trust)"
    return first


def _stderr_is_terminal() -> bool:
    try:
        return sys.stderr is not None and sys.stderr.isatty()
    except (AttributeError, ValueError, OSError):  # replaced, or closed
        return False


@contextmanager
def _progress_bars_only_on_a_terminal():
    """transformers and the hub draw tqdm bars on stderr while loading. On anything but a
    terminal (the daemon's spawn log, a journal) they are noise, and a write error there (a full
    disk) would fail the load itself, so they are off for the load and restored after."""
    from transformers.utils import logging as hf_logging

    if _stderr_is_terminal() or not hf_logging.is_progress_bar_enabled():
        yield
        return
    hf_logging.disable_progress_bar()  # the hub's bars too
    try:
        yield
    finally:
        hf_logging.enable_progress_bar()


def load_tokenizer(name: str, trust_remote_code: bool = False):
    try:
        with _progress_bars_only_on_a_terminal():
            return AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code)
    except Exception as err:  # transformers raises OSError, ValueError, ... for a bad dir
        raise ModelLoadError(f"cannot load tokenizer from {name}: {_reason(err)}") from None


def load_model(name: str, role: str, device: torch.device, dtype: torch.dtype,
               trust_remote_code: bool = False) -> PreTrainedModel:
    _check_source(name, role)
    try:
        with _progress_bars_only_on_a_terminal():
            model = AutoModelForCausalLM.from_pretrained(
                name, dtype=dtype, trust_remote_code=trust_remote_code, use_safetensors=True,
            )
    except Exception as err:
        raise ModelLoadError(f"cannot load {role} model from {name}: {_reason(err)}") from None
    return model.to(device).eval()


def check_same_tokenizer(target_tok, draft_tok, target_name: str, draft_name: str) -> None:
    t_vocab, d_vocab = target_tok.get_vocab(), draft_tok.get_vocab()
    if t_vocab != d_vocab:
        differ = len(set(t_vocab.items()) ^ set(d_vocab.items()))
        raise ModelLoadError(
            f"target {target_name} and draft {draft_name} use different tokenizers "
            f"({len(t_vocab)} vs {len(d_vocab)} tokens, {differ} entries differ); "
            "speculative decoding needs a shared vocabulary"
        )


def load_pair(target: str, draft: str | None, device: str = "auto", dtype: str = "auto",
              trust_remote_code: bool = False) -> ModelPair:
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    _check_source(target, "target")
    tokenizer = load_tokenizer(target, trust_remote_code)
    if draft:
        _check_source(draft, "draft")
        check_same_tokenizer(tokenizer, load_tokenizer(draft, trust_remote_code), target, draft)
    log.info("loading target %s on %s (%s)", target, dev, dt)
    target_model = load_model(target, "target", dev, dt, trust_remote_code)
    draft_model = None
    if draft:
        log.info("loading draft %s", draft)
        draft_model = load_model(draft, "draft", dev, dt, trust_remote_code)
    return ModelPair(target_model, draft_model, tokenizer, target, draft or None, dev, dt)
