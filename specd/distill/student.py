"""The draft being trained: a narrow Llama (``LlamaForCausalLM``, so the engine's lean forward,
its llama.cpp export and every loader take it as they take any Llama) with the target's
vocabulary and tied embeddings, started from a projection of the target's own embeddings.

Why a narrow, shallow model: a draft step is one token through the whole model, and at a
vocabulary of tens of thousands the head (hidden x vocab) is most of it; the step's cost
against the target's is roughly hidden_draft / hidden_target plus a little per layer. Why the
projection: the target's embedding rows already place tokens that predict alike near each other;
their top principal directions keep most of that at a quarter of the width, so training starts
from a head that ranks tokens sensibly instead of from noise.
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Shape:
    hidden: int = 256
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 768


def target_embeddings(model):
    """The target's token matrix [V, D] that scores tokens: its output head where it has one of
    its own, else the (tied) input embeddings."""
    head = model.get_output_embeddings()
    return (head.weight if head is not None else model.get_input_embeddings().weight).detach().float()


# Mean norm of the draft's embedding rows at the start. Its final hidden state leaves the norm
# at about sqrt(hidden), so rows of this norm give logits of a spread near 1: a start near the
# uniform distribution. The target's own rows (norm ~3 in SmolLM2) gave logits spread ~20 and a
# first loss of 40+ nats, which took most of a short run to come down from.
INIT_ROW_NORM = 0.5


def projected_embeddings(embeddings, width: int):
    """``embeddings`` [V, D] on their top ``width`` principal directions: [V, width], rescaled to
    rows of mean norm ``INIT_ROW_NORM``."""
    import torch

    centred = embeddings - embeddings.mean(0, keepdim=True)
    _, vectors = torch.linalg.eigh(centred.T @ centred)  # ascending eigenvalues; vectors: [D, D]
    basis = vectors[:, -min(width, vectors.shape[1]):].flip(1)  # [D, width'], largest first
    projected = embeddings @ basis
    if projected.shape[1] < width:  # a draft wider than the target: the rest starts at zero
        projected = torch.nn.functional.pad(projected, (0, width - projected.shape[1]))
    scale = INIT_ROW_NORM / projected.norm(dim=1).mean().clamp(min=1e-6)
    return projected * scale


def build_student(target_model, shape: Shape, max_positions: int):
    """A fresh draft for ``target_model``: same vocabulary rows, special ids and rotary base;
    embeddings from ``projected_embeddings``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tc = target_model.config
    embeddings = target_embeddings(target_model)
    rope = getattr(tc, "rope_theta", None) or (getattr(tc, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    config = LlamaConfig(
        vocab_size=embeddings.shape[0], hidden_size=shape.hidden, num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads, intermediate_size=shape.intermediate,
        max_position_embeddings=max_positions, rope_theta=float(rope), tie_word_embeddings=True,
        bos_token_id=tc.bos_token_id, eos_token_id=tc.eos_token_id, pad_token_id=getattr(tc, "pad_token_id", None),
        rms_norm_eps=1e-5,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.get_input_embeddings().weight.copy_(projected_embeddings(embeddings, shape.hidden))
    model.tie_weights()
    return model


def param_count(model) -> int:
    return sum(p.numel() for p in model.parameters())


def copy_tokenizer(source: Path, out: Path) -> list[str]:
    """The target's tokenizer files, byte for byte, into ``out``: the engine then finds the two
    folders' tokenizers identical (``tokenizer_fingerprint``) and loads one."""
    from specd.engine.models import TOKENIZER_FILES

    copied = []
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, out / name)
            copied.append(name)
    return copied


def save_student(model, target_folder: Path, out: Path, note: dict) -> None:
    """The draft as a transformers folder (bfloat16 safetensors, the target's tokenizer files,
    greedy generation defaults), written beside and then moved into ``out``: a folder there is
    whole. ``note`` goes into ``specd.json`` (what it was distilled from)."""
    import torch
    from transformers import GenerationConfig

    work = out.with_name(out.name + ".partial")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    eos = model.config.eos_token_id
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=model.config.pad_token_id or eos,
                                               bos_token_id=model.config.bos_token_id, do_sample=False)
    copy = type(model)(model.config)
    copy.load_state_dict(model.state_dict())
    copy.to(torch.bfloat16).save_pretrained(work, safe_serialization=True)
    if not copy_tokenizer(target_folder, work):
        raise ValueError(f"{target_folder} holds no tokenizer files to share with the draft")
    (work / "specd.json").write_text(json.dumps(note, indent=1) + "\n", encoding="utf-8")
    shutil.rmtree(out, ignore_errors=True)
    work.rename(out)


def export_student_gguf(draft_dir: Path, out: Path, gguf_type: str, target_gguf: Path | None) -> Path:
    """The draft as a GGUF file (``specd.llamacpp.export``) of ``gguf_type``; where the target is
    a GGUF file, checked to hold the same vocabulary as llama.cpp reads it (the engine's check
    when it loads the pair)."""
    from specd.llamacpp.export import ExportError, export_gguf

    export_gguf(draft_dir, out, dtype=gguf_type)
    if target_gguf is not None:
        from specd.llamacpp.model import open_gguf

        _, ours = open_gguf(str(out))
        _, theirs = open_gguf(str(target_gguf))
        if ours.fingerprint() != theirs.fingerprint():
            out.unlink(missing_ok=True)
            raise ExportError(f"the draft's GGUF file reads as another vocabulary than {target_gguf.name} "
                              f"({len(ours)} vs {len(theirs)} tokens) in llama.cpp")
    return out
