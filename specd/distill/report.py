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


def _device_name(device) -> str:
    """A torch device as TRAINING.md names it: the CPU, or the CUDA device's own name."""
    import torch

    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return "the CPU"


def _machine_and_data(run, f, kept: str) -> list[str]:
    """TRAINING.md's lines on the machine, the run's time and its data, for either kind of draft
    (``kept``: what the teacher kept of each position)."""
    import torch
    import transformers

    s, p, data = run.settings, run.progress, run.data
    return [
        f"Machine: {platform.processor() or platform.machine()}, {s.threads} torch threads, teacher and training "
        f"on {_device_name(run.device)}" + (" under bfloat16 autocast" if run.bf16 else "") + ", Python "
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
        f"({p.taught * s.seq_len:,} tokens) and kept {kept}.",
        f"- Held out (never trained on): {f['heldout_files']} files"
        + (f" under {', '.join(f'`{h}`' for h in s.heldout)}" if s.heldout else " (a hashed share of the corpus)")
        + f"; {f['heldout_tokens']:,} tokens measured.",
    ]


def _cost_rows(costs: dict, draft_ms: Callable[[dict], float]) -> list[str]:
    """The step-cost table's rows, one per forward path: the draft's step (``draft_ms`` of the
    path's figures), the target's step, their ratio and the target's verify widths."""
    rows = []
    for name, cost in costs.items():
        if "ratio" not in cost:
            rows.append(f"| {name} | unavailable: {cost['unavailable']} |")
            continue
        rows.append(f"| {name} | {draft_ms(cost):.2f} | {cost['target_ms'][1]:.2f} | {cost['ratio']:.1%} | "
                    + " | ".join(f"{cost['target_ms'][k + 1]:.2f}" for k in DRAFT_LENGTHS) + " |")
    return rows


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


def target_step_costs(target_model, target_gguf: Path | None, ids: list[int]) -> dict[str, dict[str, Any]]:
    """{path: {"target_ms": {width: ms}}} of the target's step and verify widths on each forward
    path serving it here, measured as ``step_costs`` measures them; {"unavailable": why} where not."""
    from specd.engine.forward.measure import measure_path

    widths = sorted({1, *(k + 1 for k in DRAFT_LENGTHS)})
    paths = {name: (target_model, path) for name, path in _torch_paths(target_model).items()}
    out: dict[str, dict[str, Any]] = {}
    try:
        from specd.llamacpp.export import cached_gguf

        paths["llamacpp"] = _gguf_path(target_gguf or cached_gguf(target_model.name_or_path, "f32"))
    except Exception as err:  # llama-cpp-python missing, or an architecture it cannot export
        out["llamacpp"] = {"unavailable": str(err).splitlines()[0]}
    for name, (model, path) in paths.items():
        measured = measure_path(model, path, ids, [CONTEXT], widths, 0, REPEATS, lambda: None, budget_ms=BUDGET_MS)
        out[name] = {"target_ms": {int(w): ms for w, ms in measured["forward_ms"][str(CONTEXT)].items()}}
    return out


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
    s, p, data, target = run.settings, run.progress, run.data, run.target
    a = f["agreement"]
    lines = [
        "# Draft distilled by `specd train-draft`",
        "",
        f"Command: `{run.command}`",
        "",
        f"Target: {target.describe()}. Draft: `{draft_dir}`" + (f", GGUF `{draft_gguf}`" if draft_gguf else "") + ".",
        "",
        *_machine_and_data(run, f, f"its top {s.top_k} log-probabilities per position"),
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
    lines += _cost_rows(f["costs"], lambda cost: cost["draft_ms"])
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


# --- a feature head (``specd train-draft --head``) ---------------------------------------------

def chain_tokens(first: float, second: float, k: int) -> float:
    """Expected tokens a verify forward yields after a chain of ``k`` drafted tokens when the first
    is the target's with probability ``first`` and each later one, given those before it were,
    with probability ``second``: the accepted ones plus the target's own."""
    if second >= 1.0:
        return 1.0 + first * k
    return 1.0 + first * (1.0 - second ** k) / (1.0 - second)


def head_step_ms(head, states, tokens) -> float:
    """Median ms of one head step (1 position, its argmax over its vocabulary) after a
    ``CONTEXT``-position ``HeadCache``; ``states`` [N, D], ``tokens`` [N] with N > CONTEXT."""
    import torch

    from specd.distill.head import window_guesses
    from specd.engine.feature_head import HeadCache, lookup_guesses
    from specd.engine.forward.measure import median_ms

    cache = HeadCache()
    feature, token = states[CONTEXT:CONTEXT + 1], tokens[CONTEXT:CONTEXT + 1]
    ids = tokens[:CONTEXT + 1].tolist()
    guesses = window_guesses(head, tokens[None, :CONTEXT])
    with torch.no_grad():
        head.step(states[:CONTEXT], tokens[:CONTEXT], cache, None if guesses is None else guesses[0])

        def step() -> None:  # as the engine drafts: the guess from the document's tokens, then the step
            guess = torch.tensor(lookup_guesses(ids, CONTEXT, CONTEXT + 1)) if head.config.guess else None
            head.vocab[head.scores(head.step(feature, token, cache, guess)).argmax(-1)]

        return median_ms(step, lambda: cache.crop(CONTEXT), REPEATS, lambda: None, budget_ms=BUDGET_MS)


def evaluate_head_and_write(run, head_dir: Path, say: Callable[[str], None]) -> dict:
    """Judge the trained head (``run.student``) on the held-out windows, write it to ``head_dir``
    with its figures in its config, time a step of it as loaded from there, and write
    ``run.out/TRAINING.md`` and ``figures.json``; returns the figures."""
    import torch
    from transformers import AutoModelForCausalLM

    from specd.distill.head import coverage, head_agreement, save_head, target_note
    from specd.engine.feature_head import FeatureHead

    started = time.monotonic()
    data, target, head, p = run.data, run.target, run.student, run.progress
    windows, states, greedy = data["heldout"].long(), data["heldout_states"], data["heldout_greedy"]
    first, second = head_agreement(head, windows, states, greedy)
    f: dict[str, Any] = {"heldout_tokens": windows.numel(), "heldout_files": len(data["heldout_files"]),
                         "agreement": first, "second": second, "vocab": len(head.vocab),
                         "coverage": coverage(head.vocab, greedy, head.config.vocab_size)}
    say(f"held-out agreement with the target's greedy: first drafted token {first:.1%}, the second given the "
        f"first {second:.1%}")
    trained = {"tokens": p.tokens, "minutes": round((p.teacher_s + p.train_s) / 60, 1),
               "agreement": round(first, 4), "second": round(second, 4)}
    save_head(head, head_dir, target_note(target), trained)
    say(f"wrote {head_dir}")

    say("timing one head step against the target's on each forward path")
    target_model = AutoModelForCausalLM.from_pretrained(target.folder, dtype=torch.float32).eval()
    loaded = FeatureHead.load(head_dir, target_model.get_input_embeddings().weight.detach().float(),
                              target_model.get_output_embeddings().weight.detach())
    repeat = 1 + (CONTEXT + 16) // windows.numel()
    ids = windows.flatten().repeat(repeat)[:CONTEXT + 16]  # real code, as long as the forwards need
    f["head_ms"] = head_step_ms(loaded, states.flatten(0, 1).float().repeat(repeat, 1)[:CONTEXT + 16], ids)
    f["costs"] = target_step_costs(target_model, target.gguf, ids.tolist())
    for name, cost in f["costs"].items():
        if "target_ms" in cost:
            cost["ratio"] = f["head_ms"] / cost["target_ms"][1]
            say(f"{name}: head step {f['head_ms']:.2f} ms, target step {cost['target_ms'][1]:.2f} ms "
                f"({cost['ratio']:.1%})")
    f["params"] = sum(t.numel() for t in loaded.parameters())
    f["folder_mib"] = sum(q.stat().st_size for q in head_dir.iterdir() if q.is_file()) / 2 ** 20
    f["report_s"] = time.monotonic() - started
    (run.out / "figures.json").write_text(json.dumps(f, indent=1, default=str) + "\n", encoding="utf-8")
    (run.out / "TRAINING.md").write_text(render_head(run, head_dir, f), encoding="utf-8")
    return f


def render_head(run, head_dir: Path, f: dict) -> str:
    s, p, data, target, c = run.settings, run.progress, run.data, run.target, run.student.config
    a, a2 = f["agreement"], f["second"]
    guess = " and lookup's guess" if c.guess else ""
    timed = {name: cost for name, cost in f["costs"].items() if "ratio" in cost}
    lines = [
        "# Feature head trained by `specd train-draft --head`",
        "",
        f"Command: `{run.command}`",
        "",
        f"A feature head (EAGLE's draft, `specd/engine/feature_head.py`) for {target.describe()}: one decoder layer "
        "that reads the target's final hidden state and the token the target emitted after it"
        + (" (and prompt lookup's guess of the token after that: the token that followed the last earlier "
           "occurrence of the last two tokens, else of the last one)" if c.guess else "")
        + ", predicts the next "
        "hidden state, and scores it with the target's own LM-head rows of its vocabulary. It is not a model of "
        "its own: it drafts from the target's hidden states and reads the target's embedding table, which the "
        f"head's folder `{head_dir}` does not hold.",
        "",
        "## Use",
        "",
        "```toml",
        "[model]",
        f'draft = "{head_dir}"',
        "```",
        "",
        "The engine drafts with a feature head on torch's lean forward, so its target runs on torch there "
        "(`engine.forward_backend = \"auto\"` keeps it on torch, a GGUF target dequantized; llama.cpp's and "
        "transformers' forwards give no hidden states and are refused). In code: "
        "`FeatureHead.load(folder, target.get_input_embeddings().weight, target.get_output_embeddings().weight)`.",
        "",
        *_machine_and_data(run, f, "its final hidden states (bfloat16) at every position"),
        "",
        "## Head",
        "",
        f"One decoder layer of width {c.hidden}, {c.heads} heads, MLP {c.intermediate}; {f['params'] / 1e6:.2f}M "
        f"trained params ({f['folder_mib']:.1f} MiB without the target's rows). It scores the {f['vocab']:,} tokens most frequent "
        f"in what the teacher read and emitted, of {c.vocab_size:,}; they hold **{f['coverage']:.1%}** of the "
        "target's greedy tokens on held-out code (the head can never draft the rest).",
        "",
        f"Loss at each position t (reading h_t and x_(t+1){guess}, predicting h_(t+1)): cross-entropy against the "
        "target's distribution over the head's vocabulary (softmax of h_(t+1)'s scores) plus smooth-L1 "
        "between the states; uniform noise of +-0.1 on the input states; AdamW, peak lr "
        f"{s.lr}, warm-up then cosine over the training time; {s.tokens_per_step} tokens per step; {p.step} steps, "
        f"{p.tokens:,} tokens.",
        "",
        "| training min | step | tokens | lr | loss | held-out agreement, first token (progress windows) |",
        "|---|---|---|---|---|---|",
        *(f"| {r.minute:.1f} | {r.step} | {r.tokens:,} | {r.lr:.2e} | {r.loss:.3f} | {r.agreement:.1%} |"
          for r in p.rows),
        "",
        "## Agreement on held-out code",
        "",
        f"The head's first drafted token (its argmax at t, from the target's state h_t and the token x_(t+1){guess}) is "
        f"the target's greedy token at t + 1 on **{a:.1%}** of held-out positions. Its second (from its own "
        "predicted state and the target's token, attending to the true states before) is the target's at t + 2 "
        f"on **{a2:.1%}** of the positions where the first was right. The target's states and greedy tokens "
        "are the teacher's (torch" + (", bfloat16 autocast" if run.bf16 else ", float32") + ").",
        "",
        "## Step costs",
        "",
        f"Median ms after {CONTEXT} positions of context ({REPEATS} timed at most): one head step (1 position, "
        "float32 on torch, its argmax over its vocabulary) against the target's step and verify widths (every row).",
        "",
        "| path | head step | target step | head / target | " + " | ".join(
            f"target {k + 1} tokens" for k in DRAFT_LENGTHS) + " |",
        "|---|---|---|---|" + "---|" * len(DRAFT_LENGTHS),
    ]
    lines += _cost_rows(f["costs"], lambda cost: f["head_ms"])
    lines += ["", "## What the agreement predicts", "",
              f"Tokens per target forward with a chain of k drafted tokens, the first the target's with probability "
              f"{a:.3f} and each later one, given those before were, with {a2:.3f}: 1 + a1 (1 - a2^k) / (1 - a2); "
              "and the speed-up over the target alone at the costs above (the head reads the hidden states the "
              "target's verify computes anyway): that times one target step, over k head steps and one verify of "
              "k + 1 tokens. A guide, not a promise: `specd bench` measures.", "",
              "| k | tokens per forward | " + " | ".join(f"speed-up on {n}" for n in timed) + " |",
              "|---|---|" + "---|" * len(timed)]
    for k in DRAFT_LENGTHS:
        tokens = chain_tokens(a, a2, k)
        lines.append(f"| {k} | {tokens:.2f} | " + " | ".join(
            f"{tokens * c['target_ms'][1] / (k * f['head_ms'] + c['target_ms'][k + 1]):.2f}x" for c in timed.values())
            + " |")
    small_draft_only = ("shape", "top_k")
    identity = {k: v for k, v in run.settings.identity().items() if k not in small_draft_only}
    lines += ["", "## Settings", "", "```json", json.dumps(identity | {
        "minutes": s.minutes, "lr": s.lr, "tokens_per_step": s.tokens_per_step, "teacher_share": s.teacher_share},
        indent=1), "```", ""]
    return "\n".join(lines)
