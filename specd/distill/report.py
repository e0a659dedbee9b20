"""What a trained draft is worth, measured and written to TRAINING.md beside its weights.

- **Agreement**: how often the draft's greedy token is the target's on held-out code (windows
  of files never trained on, every position, teacher-forced on the file's own text). Against
  the target as the engine serves it: a GGUF target on llama.cpp's forward, the draft then
  from its own GGUF file there too; otherwise both on torch. Also against the target's torch
  greedy (the teacher itself) where that differs.
- **Step costs**: one decode step of the draft (1 token after ``CONTEXT`` tokens, its last
  row of logits) against the target's, and the target's verify forwards of a few widths, on each
  forward path that serves the models here (transformers' ``hf``, the ``lean`` forward, and
  ``llamacpp`` on GGUF files), timed by ``specd.engine.forward.measure`` as the bench and the
  engine's own choice of a forward time them.
- **Tokens per forward**: what the agreement predicts for a chain of ``k`` drafted tokens if
  each is the target's with the measured probability ``a``, independently: accepted tokens
  plus the target's own per verify, (1 - a^(k+1)) / (1 - a); and the speed-up over the target
  alone this buys at the measured costs: that times one target step, over k draft steps plus
  one verify forward of k + 1 tokens.
"""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path
from typing import Any, Callable

CONTEXT = 512         # tokens in the cache before each timed forward
DRAFT_LENGTHS = (2, 4, 8)
REPEATS = 7
BUDGET_MS = 4000.0    # timed forwards per figure stop once this much went into them


def tokens_per_forward(agreement: float, k: int) -> float:
    """Expected tokens a verify forward yields after ``k`` drafted tokens, each accepted with
    probability ``agreement`` until the first rejection: the accepted ones plus the target's."""
    if agreement >= 1.0:
        return k + 1.0
    return (1.0 - agreement ** (k + 1)) / (1.0 - agreement)


def speedup(agreement: float, k: int, target_ms: dict[int, float], draft_ms: float) -> float:
    """Tokens per millisecond drafting ``k`` against the target alone (one token per step)."""
    return tokens_per_forward(agreement, k) * target_ms[1] / (k * draft_ms + target_ms[k + 1])


# --- agreement ------------------------------------------------------------------------------

def torch_greedy(model, windows) -> Any:
    """Argmax tokens [B, T] of a torch model over ``windows`` [B, T]."""
    import torch

    with torch.no_grad():
        return torch.stack([model(input_ids=windows[i:i + 1].long()).logits[0].argmax(-1) for i in range(len(windows))])


def llamacpp_greedy(gguf: Path, windows) -> Any:
    """Argmax tokens [B, T] of a GGUF file on the engine's llama.cpp forward, each window from
    an empty cache."""
    import numpy as np
    import torch

    from specd.engine.forward.choose import gguf_forward
    from specd.engine.options import EngineOptions
    from specd.llamacpp.model import open_gguf

    model, _ = open_gguf(str(gguf))
    path = gguf_forward(model, EngineOptions(prefix_tokens=windows.shape[1]))
    cache = path.new_cache()
    rows = []
    for window in windows.tolist():
        rows.append(np.asarray(path.forward_ids(window, cache)).argmax(-1))
        path.crop(cache, 0)
    return torch.from_numpy(np.stack(rows))


def share_equal(a, b) -> float:
    return float((a.long() == b.long()).float().mean())


# --- step costs -----------------------------------------------------------------------------

def _torch_paths(model) -> dict[str, Any]:
    from specd.engine.forward.lean import LeanForward, unsupported_reason
    from specd.engine.forward.transformers import HFForward

    paths = {"hf": HFForward(model)}
    if unsupported_reason(model) is None:
        paths["lean"] = LeanForward(model)
    return paths


def _gguf_path(gguf: Path):
    from specd.engine.forward.choose import gguf_forward
    from specd.engine.options import EngineOptions
    from specd.llamacpp.model import open_gguf

    model, _ = open_gguf(str(gguf))
    return model, gguf_forward(model, EngineOptions())


def step_costs(target_model, draft_model, target_gguf: Path | None, draft_gguf: Path | None,
               ids: list[int]) -> dict[str, dict[str, Any]]:
    """{path: {"target_ms": {width: ms}, "draft_ms": ms, "ratio": draft/target step}} on each
    path serving both models here; a path that cannot is {"unavailable": why}."""
    from specd.engine.forward.measure import measure_path

    widths = sorted({1, *(k + 1 for k in DRAFT_LENGTHS)})
    pairs: dict[str, tuple] = {}
    target_paths, draft_paths = _torch_paths(target_model), _torch_paths(draft_model)
    for name in target_paths:
        if name in draft_paths:
            pairs[name] = (target_model, target_paths[name], draft_model, draft_paths[name])
    out: dict[str, dict[str, Any]] = {}
    try:
        from specd.llamacpp.export import cached_gguf

        target_file = target_gguf or cached_gguf(target_model.name_or_path, "f32")
        draft_file = draft_gguf or cached_gguf(draft_model.name_or_path, "f32")
        pairs["llamacpp"] = (*_gguf_path(target_file), *_gguf_path(draft_file))
    except Exception as err:  # llama-cpp-python missing, or an architecture it cannot export
        out["llamacpp"] = {"unavailable": str(err).splitlines()[0]}

    for name, (t_model, t_path, d_model, d_path) in pairs.items():
        target = measure_path(t_model, t_path, ids, [CONTEXT], widths, 0, REPEATS, lambda: None, budget_ms=BUDGET_MS)
        draft = measure_path(d_model, d_path, ids, [CONTEXT], [1], 0, REPEATS, lambda: None, last_only=True,
                             budget_ms=BUDGET_MS)
        target_ms = {int(w): ms for w, ms in target["forward_ms"][str(CONTEXT)].items()}
        draft_ms = draft["forward_ms"][str(CONTEXT)]["1"]
        out[name] = {"target_ms": target_ms, "draft_ms": draft_ms, "ratio": draft_ms / target_ms[1]}
    return out


# --- the report -----------------------------------------------------------------------------

def evaluate_and_write(run, draft_dir: Path, draft_gguf: Path | None, say: Callable[[str], None]) -> dict:
    """Measure the saved draft (as the engine loads it) and write ``run.out/TRAINING.md``;
    returns the figures (also in ``figures.json`` beside it)."""
    import torch
    from transformers import AutoModelForCausalLM

    from specd.distill.student import param_count

    started = time.monotonic()
    settings, data, target = run.settings, run.data, run.target
    draft = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32).eval()
    windows = data["heldout"]
    figures: dict[str, Any] = {"heldout_tokens": windows.numel(), "heldout_files": len(data["heldout_files"])}
    draft_greedy = torch_greedy(draft, windows)
    # against the teacher's greedy as it taught (bfloat16 where the CPU has it): the progress lines' measure
    figures["agreement_torch"] = share_equal(draft_greedy, data["heldout_greedy"])
    if target.gguf is not None:
        say("agreement on llama.cpp's forward: the target's GGUF file as the engine serves it")
        served = llamacpp_greedy(target.gguf, windows)
        figures["torch_vs_served_target"] = share_equal(served, data["heldout_greedy"])
        figures["agreement"] = share_equal(llamacpp_greedy(draft_gguf, windows) if draft_gguf else draft_greedy, served)
        figures["served"] = f"llama.cpp: {target.gguf.name}" + (f" and {draft_gguf.name}" if draft_gguf else "")
    else:
        target_model = AutoModelForCausalLM.from_pretrained(target.folder, dtype=torch.float32).eval()
        figures["agreement"] = share_equal(draft_greedy, torch_greedy(target_model, windows))
        figures["served"] = "torch, float32"
    say(f"held-out agreement with the target's greedy: {figures['agreement']:.1%} ({figures['served']})")

    say("timing one step of each model on each forward path")
    target_model = AutoModelForCausalLM.from_pretrained(target.folder, dtype=torch.float32).eval()
    held = windows.flatten().tolist()
    ids = (held * (1 + (CONTEXT + 16) // len(held)))[:CONTEXT + 16]  # real code, as long as the forwards need
    figures["costs"] = step_costs(target_model, draft, target.gguf, draft_gguf, ids)
    for name, cost in figures["costs"].items():
        if "ratio" in cost:
            say(f"{name}: draft step {cost['draft_ms']:.2f} ms, target step {cost['target_ms'][1]:.2f} ms "
                f"({cost['ratio']:.1%})")
    figures["params"] = param_count(draft)
    figures["weights_mib"] = (draft_dir / "model.safetensors").stat().st_size / 2 ** 20
    figures["folder_mib"] = sum(p.stat().st_size for p in draft_dir.iterdir() if p.is_file()) / 2 ** 20
    figures["gguf_mib"] = draft_gguf.stat().st_size / 2 ** 20 if draft_gguf else None
    figures["report_s"] = time.monotonic() - started
    (run.out / "figures.json").write_text(json.dumps(figures, indent=1, default=str) + "\n", encoding="utf-8")
    (run.out / "TRAINING.md").write_text(render(run, draft_dir, draft_gguf, figures), encoding="utf-8")
    return figures


def render(run, draft_dir: Path, draft_gguf: Path | None, f: dict) -> str:
    import torch
    import transformers

    s, p, data, target = run.settings, run.progress, run.data, run.target
    a = f["agreement"]
    lines = [
        "# Draft distilled by `specd train-draft`",
        "",
        f"Command: `{run.command}`",
        "",
        f"Target: {target.describe()}. Draft: `{draft_dir}`" + (f", GGUF `{draft_gguf}`" if draft_gguf else "") + ".",
        "",
        f"Machine: {platform.processor() or platform.machine()}, {s.threads} torch threads, Python "
        f"{platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}.",
        "",
        f"Time: teacher {p.teacher_s / 60:.1f} min, training {p.train_s / 60:.1f} min (budget {s.minutes:g} min"
        + (f", {p.resumes} resume{'s' if p.resumes != 1 else ''}" if p.resumes else "") + f"), report "
        f"{f['report_s'] / 60:.1f} min.",
        "",
        "## Data",
        "",
        f"- Corpus: {data['train_files']} files under {', '.join(f'`{r}`' for r in data['roots'])}; "
        f"{len(data['train']):,} windows of {s.seq_len} tokens tokenized, the teacher ran over {p.taught:,} "
        f"({p.taught * s.seq_len:,} tokens) and kept its top {s.top_k} log-probabilities per position.",
        f"- Held out (never trained on): {f['heldout_files']} files"
        + (f" under {', '.join(f'`{h}`' for h in s.heldout)}" if s.heldout else " (a hashed share of the corpus)")
        + f"; {f['heldout_tokens']:,} tokens measured.",
        "",
        "## Draft",
        "",
        f"LlamaForCausalLM, hidden {s.shape.hidden}, {s.shape.layers} layers, {s.shape.heads} heads "
        f"({s.shape.kv_heads} kv), MLP {s.shape.intermediate}, vocab {run.student.config.vocab_size}, "
        f"tied embeddings started from the target's on their top {s.shape.hidden} principal directions; "
        f"{f['params'] / 1e6:.2f}M params, {f['weights_mib']:.1f} MiB of bfloat16 weights "
        f"({f['folder_mib']:.1f} MiB with the tokenizer)"
        + (f", GGUF {f['gguf_mib']:.1f} MiB" if f["gguf_mib"] else "") + ".",
        "",
        f"Loss: cross-entropy against the teacher's top-{s.top_k} renormalised; AdamW, peak lr {s.lr}, warm-up "
        f"then cosine over the training time; {s.tokens_per_step} tokens per step; {p.step} steps, "
        f"{p.tokens:,} tokens.",
        "",
        "| training min | step | tokens | lr | loss | held-out agreement (progress windows) |",
        "|---|---|---|---|---|---|",
        *(f"| {r.minute:.1f} | {r.step} | {r.tokens:,} | {r.lr:.2e} | {r.loss:.3f} | {r.agreement:.1%} |"
          for r in p.rows),
        "",
        "## Agreement on held-out code",
        "",
        f"The draft's greedy token is the target's on **{a:.1%}** of held-out positions ({f['served']}).",
    ]
    if "torch_vs_served_target" in f:
        lines += ["", f"Against the teacher as it taught (the target dequantized, on torch): {f['agreement_torch']:.1%}; "
                      f"that teacher picks the GGUF file's token on {f['torch_vs_served_target']:.1%}."]
    lines += ["", "## Step costs", "",
              f"Median ms of one forward after {CONTEXT} tokens of context ({REPEATS} timed at most): the draft's "
              "step (1 token, its last row of logits), the target's step and verify widths (every row).", "",
              "| path | draft step | target step | draft / target | " + " | ".join(
                  f"target {k + 1} tokens" for k in DRAFT_LENGTHS) + " |",
              "|---|---|---|---|" + "---|" * len(DRAFT_LENGTHS)]
    for name, cost in f["costs"].items():
        if "ratio" not in cost:
            lines.append(f"| {name} | unavailable: {cost['unavailable']} |")
            continue
        lines.append(f"| {name} | {cost['draft_ms']:.2f} | {cost['target_ms'][1]:.2f} | {cost['ratio']:.1%} | "
                     + " | ".join(f"{cost['target_ms'][k + 1]:.2f}" for k in DRAFT_LENGTHS) + " |")
    lines += ["", "## What the agreement predicts", "",
              f"Tokens per target forward with a chain of k drafted tokens, each the target's with probability "
              f"{a:.3f} independently: (1 - a^(k+1)) / (1 - a); and the speed-up over the target alone at the "
              "costs above: that times one target step, over k draft steps and one verify of k + 1 tokens. Real "
              "acceptance runs on the target's own continuations and drafts stop early at low confidence, so "
              "this is a guide, not a promise; `specd bench` measures it.", "",
              "| k | tokens per forward | " + " | ".join(f"speed-up on {n}" for n, c in f["costs"].items()
                                                          if "ratio" in c) + " |",
              "|---|---|" + "---|" * sum(1 for c in f["costs"].values() if "ratio" in c)]
    for k in DRAFT_LENGTHS:
        lines.append(f"| {k} | {tokens_per_forward(a, k):.2f} | " + " | ".join(
            f"{speedup(a, k, c['target_ms'], c['draft_ms']):.2f}x" for c in f["costs"].values() if "ratio" in c)
            + " |")
    lines += ["", "## Settings", "", "```json", json.dumps(run.settings.identity() | {
        "minutes": s.minutes, "lr": s.lr, "tokens_per_step": s.tokens_per_step, "teacher_share": s.teacher_share,
        "gguf": s.gguf}, indent=1), "```", ""]
    return "\n".join(lines)
