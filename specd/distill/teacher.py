"""The target as a teacher: any name specd serves resolved to a torch folder, and its next-token
distributions on the corpus, run once and kept as the top ``k`` (ids and log-probabilities); for a
feature head (``--head``), its final hidden states and greedy tokens instead.

A GGUF target (a ``.gguf`` file, ``ollama:NAME``, or the default model) teaches from its
dequantized transformers folder (``specd.llamacpp.dequantize``): on a CPU torch runs it
several times faster than llama.cpp does when every position's logits are read, and the two
pick the same greedy token nearly everywhere; agreement is still measured against the file on
llama.cpp's forward, as the engine serves it (``report``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Target:
    name: str           # as given (empty: the default model)
    folder: Path        # a transformers folder: weights, config and tokenizer
    gguf: Path | None   # the GGUF file the engine serves, when the target is one

    def describe(self) -> str:
        return f"{self.name or 'the default model'} ({self.gguf or self.folder})"


def resolve_target(name: str, say=None) -> Target:
    """The target's torch folder (a GGUF file's dequantized one) and its GGUF file; empty is the
    default model, ``demo`` the demo pair's target, as ``model.target`` means them."""
    from specd.engine.builtin import resolve_names
    from specd.llamacpp.gguf import is_gguf_name, resolve

    resolved, _ = resolve_names(name, "", say=say)
    if is_gguf_name(resolved):
        from specd.llamacpp.dequantize import dequantized_folder

        gguf = resolve(resolved)
        return Target(name, dequantized_folder(str(gguf), progress=True), gguf)
    folder = Path(resolved).expanduser()
    if not folder.is_dir():
        from specd.llamacpp.export import resolve_model_dir

        folder = resolve_model_dir(resolved)  # a hub id's local snapshot
    return Target(name, folder, None)


def load_torch_model(folder: Path):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def top_k(logits, k: int):
    """(ids [.., k] int32, log-probabilities [.., k] float16) of the ``k`` likeliest tokens."""
    import torch

    logprobs = torch.log_softmax(logits.float(), dim=-1)
    values, ids = logprobs.topk(k, dim=-1)
    return ids.to(torch.int32), values.to(torch.float16)


def resolve_device(name: str):
    """The torch device a run trains on: ``auto`` is the first CUDA device where torch has one,
    else the CPU; a named device torch cannot use is a ValueError that says why."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device {name}: not a torch device (auto, cpu, cuda or cuda:N)") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {name}: this torch ({torch.__version__}) sees no CUDA device")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"--device {name}: torch sees {torch.cuda.device_count()} CUDA device(s)")
    elif device.type != "cpu":
        raise ValueError(f"--device {name}: train-draft runs on the CPU or a CUDA device")
    return device


def bf16_arithmetic(device=None) -> bool:
    """Whether ``device`` (the CPU when None) multiplies in bfloat16 natively: on a CPU, AVX-512
    BF16 or AMX (emulated it is slower than float32); on a CUDA device, Ampere or later."""
    import torch

    if device is not None and torch.device(device).type == "cuda":
        return bool(torch.cuda.is_bf16_supported())
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def model_device(model):
    """The device a torch module's weights are on."""
    return next(model.parameters()).device


def teach(model, windows, k: int, batch: int, bf16: bool = False):
    """The target's top-k over ``windows`` (a [B, T] LongTensor): (ids, logprobs), [B, T, k], on
    the CPU whatever device ``model`` runs on.
    ``bf16``: under bfloat16 autocast, which moves log-probabilities by a few thousandths and
    changes the greedy token only at near-ties: fine to learn from, not to judge by."""
    import torch

    ids, values = [], []
    device = model_device(model)
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
        for start in range(0, len(windows), batch):
            logits = model(input_ids=windows[start:start + batch].to(device)).logits  # [b, T, V]
            top_ids, top_values = top_k(logits, k)
            ids.append(top_ids.cpu())
            values.append(top_values.cpu())
    return torch.cat(ids), torch.cat(values)


def teach_states(model, windows, batch: int, bf16: bool = False):
    """The target's final hidden states (after its final norm: what its LM head scores) over
    ``windows`` [B, T], in bfloat16 to halve what is kept, and its greedy tokens there:
    (states [B, T, D] bfloat16, greedy [B, T] int32), on the CPU whatever device ``model`` runs
    on. ``bf16``: under bfloat16 autocast."""
    import torch

    states, greedy = [], []
    head = model.get_output_embeddings()
    device = model_device(model)
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
        for start in range(0, len(windows), batch):
            hidden = model.model(input_ids=windows[start:start + batch].to(device)).last_hidden_state  # [b, T, D]
            greedy.append(head(hidden).argmax(-1).to(torch.int32).cpu())
            states.append(hidden.to(torch.bfloat16).cpu())
    return torch.cat(states), torch.cat(greedy)
