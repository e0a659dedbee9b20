"""Train the embedded demo pair: a byte-level BPE tokenizer, a Qwen2 target and a Qwen2 draft
(the samples: ``data``; held-out evaluation: ``evaluation``). One concern, a training run,
from its settings and command line to the files it writes (the models and TRAINING.md).

Both models learn from the Python standard library (minus ``heldout.HELDOUT_MODULES``) with a
causal-LM objective in which about half the samples are fill-in-the-middle, split between
prefix-suffix-middle and suffix-prefix-middle order, in Qwen2.5-Coder's token format:

    PSM: <|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>{middle}<|endoftext|>
    SPM: <|fim_suffix|>{suffix}<|fim_prefix|>{prefix}<|fim_middle|>{middle}<|endoftext|>

Target and draft train side by side on the same batches. From ``DISTILL_START`` of the time
budget on, the draft's loss blends in KL divergence to the target's (detached) next-token
distribution, which raises how often the draft's guess is the token the target would pick:
the number speculative decoding lives on.

The run is bounded by wall time, not steps: the learning-rate schedule is a function of the
fraction of the budget spent, so a busy machine trains on fewer tokens but still finishes
its schedule. Run with ``specd train-demo`` or ``python -m specd.demo.train``.

The same script trains development pairs of other shapes: ``--arch llama`` builds Llama
models instead of Qwen2, ``--fim-format starcoder`` uses StarCoder's special tokens
(``<fim_prefix>{prefix}<fim_suffix>{suffix}<fim_middle>{middle}<|endoftext|>``, PSM only), and
``--distill-weight 0`` trains the draft on the data alone. The ``dev-llama`` preset combines
all three (``scripts/train-dev-pair``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from specd.demo import DEMO_DIR, DRAFT_SUBDIR, TARGET_SUBDIR
from specd.demo.data import (FIM_FORMATS, MAX_MIDDLE_LINES, REPO_TWIN_RATE, FimFormat, SampleMaker, train_tokenizer,
                             wrap_tokenizer)
from specd.demo.evaluation import SAMPLE_MAX_NEW_TOKENS, EvalResult, evaluate, masked_ce, heldout_fim_batches, heldout_lm_batches, sample_completion
from specd.demo.heldout import HELDOUT_MODULES, heldout_files, stdlib_dir, training_files
from specd.demo.options import ARCHS, add_arguments

# --- optimisation -------------------------------------------------------------------------
WARMUP_FRACTION = 0.03
MIN_LR_RATIO = 0.1
ADAM_BETAS = (0.9, 0.95)
GRAD_CLIP = 1.0
DISTILL_START = 0.3          # fraction of the budget where distillation starts to ramp in
DISTILL_FULL = 0.6           # ... and reaches its full weight
PROGRESS_EVALS = 8           # small held-out evaluations during training
LOSS_EMA = 0.95              # smoothing of the logged train losses (per step)
SAMPLE_FILE = "fractions.py"  # the held-out file of the sample completion (evaluation.sample_completion)
FINETUNE_LR_SCALE = 0.3      # peak learning rates are this much lower when going on from a trained pair


@dataclass(frozen=True)
class ModelSize:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int


@dataclass(frozen=True)
class Settings:
    """Everything that decides the result; written verbatim into TRAINING.md."""

    arch: str = "qwen2"          # a key of ARCHS
    fim_format: str = "qwen"     # a key of FIM_FORMATS
    vocab_size: int = 8192
    target: ModelSize = ModelSize(hidden=256, layers=6, heads=4, kv_heads=2, intermediate=1024)
    draft: ModelSize = ModelSize(hidden=128, layers=2, heads=4, kv_heads=2, intermediate=512)
    # Each step is tokens_per_step tokens split into sequences of one of seq_lens; the long ones
    # (long_fraction of steps) expose positions the engine's default prompt budget reaches.
    seq_lens: tuple[int, ...] = (1024, 2048)
    long_fraction: float = 0.3
    # 2048 rather than 4096: in a fixed ~45 CPU-minutes more, smaller steps learn faster.
    tokens_per_step: int = 2048
    max_positions: int = 4096
    target_lr: float = 2e-3
    draft_lr: float = 3e-3
    weight_decay: float = 0.1
    fim_rate: float = 0.5
    spm_rate: float = 0.5
    repo_rate: float = 0.0       # share of FIM samples with repo-level context chunks first
    init: str | None = None      # a pair to go on training (its tokenizer and weights), not a fresh one
    distill_weight: float = 0.7
    minutes: float = 47.0   # training loop; setup, evaluation and saving add about 2 minutes
    seed: int = 0
    threads: int = 2
    max_files: int | None = None          # cap on training files (smoke tests)
    eval_fim_samples: int = 96
    eval_lm_max_windows: int | None = None
    eval_seq_len: int = 1024

    def __post_init__(self):
        if self.arch not in ARCHS:
            raise ValueError(f"unknown arch {self.arch!r} (known: {', '.join(ARCHS)})")
        if self.fim_format not in FIM_FORMATS:
            raise ValueError(f"unknown FIM format {self.fim_format!r} (known: {', '.join(FIM_FORMATS)})")
        if self.spm_rate > 0 and not FIM_FORMATS[self.fim_format].spm:
            raise ValueError(f"FIM format {self.fim_format!r} has no suffix-first layout: spm_rate must be 0")

    @property
    def fim(self) -> FimFormat:
        return FIM_FORMATS[self.fim_format]


PRESETS: dict[str, Settings] = {
    "full": Settings(),
    # Seconds-long end-to-end run for tests: same code path, toy sizes.
    "tiny": Settings(
        vocab_size=384,
        target=ModelSize(hidden=32, layers=2, heads=2, kv_heads=1, intermediate=64),
        draft=ModelSize(hidden=16, layers=1, heads=2, kv_heads=1, intermediate=32),
        seq_lens=(128,),
        tokens_per_step=256,
        max_positions=512,
        max_files=6,
        eval_fim_samples=4,
        eval_lm_max_windows=4,
        eval_seq_len=128,
    ),
    # A second development pair of another architecture and FIM family (scripts/train-dev-pair):
    # Llama with multi-query attention, StarCoder tokens, PSM only, and a draft trained on the
    # data alone, so it agrees with its target less often than the distilled demo draft. Small
    # enough for ~20 minutes on one thread.
    "dev-llama": Settings(
        arch="llama",
        fim_format="starcoder",
        target=ModelSize(hidden=192, layers=5, heads=3, kv_heads=1, intermediate=512),
        draft=ModelSize(hidden=128, layers=2, heads=2, kv_heads=1, intermediate=384),
        spm_rate=0.0,
        distill_weight=0.0,
        minutes=20.0,
        threads=1,
    ),
}


# --- tokenizer ----------------------------------------------------------------------------

def _init_tokenizer(pair: Path, settings: Settings):
    """The tokenizer of the pair training goes on from; its special tokens must be the format's."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(pair / TARGET_SUBDIR / "tokenizer.json"))
    ids = [tok.token_to_id(name) for name in settings.fim.special_tokens]
    if ids != list(range(len(ids))) or tok.get_vocab_size() != settings.vocab_size:
        raise ValueError(f"{pair} was not trained with --fim-format {settings.fim_format} and vocab "
                         f"{settings.vocab_size} (special token ids {ids}, vocab {tok.get_vocab_size()})")
    return tok


# --- models -------------------------------------------------------------------------------

def build_model(size: ModelSize, settings: Settings, eos_id: int):
    import transformers

    config_name, model_name = ARCHS[settings.arch]
    extra = {"use_sliding_window": False} if settings.arch == "qwen2" else {}
    config = getattr(transformers, config_name)(
        vocab_size=settings.vocab_size,
        hidden_size=size.hidden,
        num_hidden_layers=size.layers,
        num_attention_heads=size.heads,
        num_key_value_heads=size.kv_heads,
        intermediate_size=size.intermediate,
        max_position_embeddings=settings.max_positions,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        **extra,
    )
    return getattr(transformers, model_name)(config)


def param_count(model) -> int:
    return sum(p.numel() for p in model.parameters())


def make_optimizer(model, lr: float, weight_decay: float):
    import torch

    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=ADAM_BETAS)


def lr_factor(progress: float) -> float:
    """Linear warm-up, then cosine decay to MIN_LR_RATIO, over the fraction of budget spent."""
    if progress < WARMUP_FRACTION:
        return max(progress / WARMUP_FRACTION, 1e-3)
    decayed = (progress - WARMUP_FRACTION) / (1.0 - WARMUP_FRACTION)
    return MIN_LR_RATIO + (1.0 - MIN_LR_RATIO) * 0.5 * (1.0 + math.cos(math.pi * min(decayed, 1.0)))


def distill_factor(progress: float, full_weight: float) -> float:
    ramp = (progress - DISTILL_START) / (DISTILL_FULL - DISTILL_START)
    return full_weight * min(max(ramp, 0.0), 1.0)


def masked_kl(teacher_logits, student_logits, mask):
    """Mean KL(teacher || student) over mask, teacher detached. Both logits: [B, T, V]."""
    import torch.nn.functional as F

    teacher = F.log_softmax(teacher_logits.detach().float(), dim=-1)
    student = F.log_softmax(student_logits.float(), dim=-1)
    kl = (teacher.exp() * (teacher - student)).sum(-1)  # [B, T]
    weights = mask.float()
    return (kl * weights).sum() / weights.sum().clamp(min=1.0)


# --- saving -------------------------------------------------------------------------------

def save_model(model, hf_tokenizer, out_dir: Path, eos_id: int, settings: Settings) -> None:
    import torch
    from transformers import GenerationConfig

    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    model.generation_config = GenerationConfig(
        eos_token_id=eos_id, pad_token_id=eos_id, do_sample=False,
    )
    model.to(torch.bfloat16).save_pretrained(out_dir, safe_serialization=True)
    model.to(torch.float32)
    hf_tokenizer.save_pretrained(out_dir)
    meta = dict(settings.fim.specd_json(), trained_context=max(settings.seq_lens))
    (out_dir / "specd.json").write_text(json.dumps(meta, indent=2) + "\n")


def dir_size_mb(path: Path) -> float:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 1e6


# --- the run ------------------------------------------------------------------------------

@dataclass
class LogRow:
    minute: float
    step: int
    tokens: int
    lr: float
    target_loss: float
    draft_loss: float
    distill: float
    eval: EvalResult | None = None


@dataclass
class RunLog:
    rows: list[LogRow] = field(default_factory=list)


def _read_sources(paths: list[Path], root: Path) -> list[tuple[str, str]]:
    sources = []
    for path in paths:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        sources.append((str(path.relative_to(root)), text))
    return sources


def train(settings: Settings, out_dir: Path, command: str) -> int:
    import torch
    from tqdm import tqdm

    started = time.time()
    torch.set_num_threads(settings.threads)
    torch.manual_seed(settings.seed)
    rng = random.Random(settings.seed)

    root = stdlib_dir()
    train_paths = training_files(root)
    if settings.max_files is not None:
        train_paths = random.Random(settings.seed).sample(train_paths, settings.max_files)
    sources = _read_sources(train_paths, root)
    heldout = [text for _, text in _read_sources(heldout_files(root), root)]
    corpus_mb = sum(len(t) for _, t in sources) / 1e6
    print(f"data: {len(sources)} training files ({corpus_mb:.1f} MB) from {root}, "
          f"{len(heldout)} held-out modules", flush=True)

    fim = settings.fim
    if settings.init:
        tok = _init_tokenizer(Path(settings.init), settings)
    else:
        tok = train_tokenizer((text for _, text in sources), settings.vocab_size, fim.special_tokens)
    hf_tok = wrap_tokenizer(tok, settings.max_positions, fim)
    eos_id = tok.token_to_id(fim.eos)
    heldout_chars = sum(len(t) for t in heldout)
    heldout_tokens = sum(len(e.ids) for e in tok.encode_batch(heldout, add_special_tokens=False))
    chars_per_token = heldout_chars / max(heldout_tokens, 1)
    print(f"tokenizer: vocab {tok.get_vocab_size()}, {chars_per_token:.2f} chars/token on held-out "
          f"({time.time() - started:.0f}s)", flush=True)

    maker = SampleMaker(tok, sources, settings, rng)
    eval_maker = SampleMaker(tok, [("", t) for t in heldout], settings, random.Random(settings.seed + 1))
    fim_eval = heldout_fim_batches(eval_maker, settings.eval_fim_samples, settings.eval_seq_len)
    progress_fim_eval = fim_eval[:max(1, len(fim_eval) // 3)]
    lm_eval = heldout_lm_batches(tok, heldout, settings.eval_seq_len, settings.eval_lm_max_windows, fim.eos)
    print(f"stream: {len(maker.stream):,} training tokens", flush=True)

    if settings.init:
        from transformers import AutoModelForCausalLM

        target, draft = (AutoModelForCausalLM.from_pretrained(Path(settings.init) / sub, dtype=torch.float32)
                         for sub in (TARGET_SUBDIR, DRAFT_SUBDIR))
        print(f"going on from {settings.init} (peak lr x{FINETUNE_LR_SCALE})", flush=True)
    else:
        target = build_model(settings.target, settings, eos_id)
        draft = build_model(settings.draft, settings, eos_id)
    # bfloat16 autocast where the CPU has bfloat16 arithmetic; emulated (AVX2 only) it is an order of
    # magnitude slower than float32 (docs/train-draft.md, "Timings behind the trainers' comments").
    bf16 = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    print(f"precision: {'bfloat16 autocast' if bf16 else 'float32 (no bfloat16 arithmetic on this CPU)'}", flush=True)
    target.train()
    draft.train()
    target_params, draft_params = param_count(target), param_count(draft)
    print(f"target: {target_params / 1e6:.2f}M params {settings.target}", flush=True)
    print(f"draft:  {draft_params / 1e6:.2f}M params {settings.draft}", flush=True)
    lr_scale = FINETUNE_LR_SCALE if settings.init else 1.0
    peaks = (settings.target_lr * lr_scale, settings.draft_lr * lr_scale)
    target_opt = make_optimizer(target, peaks[0], settings.weight_decay)
    draft_opt = make_optimizer(draft, peaks[1], settings.weight_decay)

    budget_s = settings.minutes * 60.0
    log = RunLog()
    step = tokens_seen = 0
    ema_target = ema_draft = None
    next_eval = 1
    loop_start = time.time()
    # disable=None: a bar on a terminal only; a log file gets the per-minute rows below.
    bar = tqdm(total=int(budget_s), unit="s", mininterval=30.0, desc="train", file=sys.stderr, disable=None)
    while True:
        elapsed = time.time() - loop_start
        progress = elapsed / budget_s
        if progress >= 1.0:
            break
        scale = lr_factor(progress)
        distill = distill_factor(progress, settings.distill_weight)
        for opt, peak in zip((target_opt, draft_opt), peaks):
            for group in opt.param_groups:
                group["lr"] = peak * scale

        long_step = len(settings.seq_lens) > 1 and rng.random() < settings.long_fraction
        seq_len = settings.seq_lens[-1] if long_step else settings.seq_lens[0]
        inputs, targets, mask = maker.batch(max(1, settings.tokens_per_step // seq_len), seq_len)

        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            t_logits = target(input_ids=inputs).logits  # [B, T, V]
        t_loss = masked_ce(t_logits, targets, mask)
        t_loss.backward()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            d_logits = draft(input_ids=inputs).logits
        d_ce = masked_ce(d_logits, targets, mask)
        d_loss = d_ce if distill == 0.0 else (1.0 - distill) * d_ce + distill * masked_kl(t_logits, d_logits, mask)
        d_loss.backward()
        for model, opt in ((target, target_opt), (draft, draft_opt)):
            torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
            opt.step()
            opt.zero_grad(set_to_none=True)

        step += 1
        tokens_seen += int(mask.sum())
        t_value, d_value = t_loss.item(), d_ce.item()
        ema_target = t_value if ema_target is None else LOSS_EMA * ema_target + (1 - LOSS_EMA) * t_value
        ema_draft = d_value if ema_draft is None else LOSS_EMA * ema_draft + (1 - LOSS_EMA) * d_value
        bar.update(int(time.time() - loop_start) - bar.n)
        bar.set_postfix(step=step, target=f"{ema_target:.3f}", draft=f"{ema_draft:.3f}", refresh=False)

        if time.time() - loop_start >= next_eval * budget_s / PROGRESS_EVALS:
            next_eval += 1
            result = evaluate(target, draft, [], progress_fim_eval, autocast=bf16)
            row = LogRow((time.time() - loop_start) / 60, step, tokens_seen, scale * peaks[0],
                         ema_target, ema_draft, distill, result)
            log.rows.append(row)
            tqdm.write(f"[{row.minute:5.1f} min] step {step} tokens {tokens_seen:,} lr {row.lr:.2e} "
                       f"train target {ema_target:.3f} draft {ema_draft:.3f} (distill {distill:.2f}) | "
                       f"held-out FIM target {result.target_fim:.3f} draft {result.draft_fim:.3f} "
                       f"agree {result.agreement:.3f}", file=sys.stderr)
    bar.close()
    train_s = time.time() - loop_start
    if not log.rows or log.rows[-1].step != step:
        log.rows.append(LogRow(train_s / 60, step, tokens_seen, scale * peaks[0],
                               ema_target or float("nan"), ema_draft or float("nan"), distill))
    print(f"trained {step} steps, {tokens_seen:,} tokens in {train_s / 60:.1f} min", flush=True)

    target_dir, draft_dir = out_dir / TARGET_SUBDIR, out_dir / DRAFT_SUBDIR
    save_model(target, hf_tok, target_dir, eos_id, settings)
    save_model(draft, hf_tok, draft_dir, eos_id, settings)

    # Final numbers come from the saved (bfloat16-rounded) weights, loaded as the engine loads them.
    from transformers import AutoModelForCausalLM

    saved_target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    saved_draft = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32)
    final = evaluate(saved_target, saved_draft, lm_eval, fim_eval, autocast=False)
    print(f"held-out LM loss: target {final.target_lm:.3f} draft {final.draft_lm:.3f} nats/token", flush=True)
    print(f"held-out FIM-middle loss: target {final.target_fim:.3f} draft {final.draft_fim:.3f}; "
          f"draft/target greedy agreement {final.agreement:.3f}", flush=True)
    sample_file = next((p for p in heldout_files(root) if p.name == SAMPLE_FILE), None)
    sample = (sample_completion(target_dir, sample_file.read_text(encoding="utf-8"), settings.eval_seq_len, fim)
              if sample_file else None)
    if sample:
        print(f"sample ({SAMPLE_FILE}, target, greedy): {sample[1]!r} (original {sample[2]!r})", flush=True)

    total_s = time.time() - started
    sizes = {"target": dir_size_mb(target_dir), "draft": dir_size_mb(draft_dir)}
    write_training_md(out_dir / "TRAINING.md", command=command, settings=settings, log=log, final=final,
                      facts={
                          "files": len(sources), "corpus_mb": corpus_mb, "root": str(root),
                          "vocab": tok.get_vocab_size(), "chars_per_token": chars_per_token,
                          "stream_tokens": len(maker.stream), "target_params": target_params,
                          "draft_params": draft_params, "steps": step, "tokens": tokens_seen,
                          "train_min": train_s / 60, "total_min": total_s / 60, "sizes": sizes,
                          "precision": "bfloat16 autocast" if bf16 else "float32",
                      }, sample=sample)
    print(f"wrote {out_dir} (target {sizes['target']:.1f} MB, draft {sizes['draft']:.1f} MB) "
          f"in {total_s / 60:.1f} min", flush=True)
    return 0


def write_training_md(path: Path, *, command: str, settings: Settings, log: RunLog, final: EvalResult,
                      facts: dict[str, Any], sample: tuple[str, str, str] | None) -> None:
    import tokenizers
    import torch
    import transformers

    f = facts
    fim = settings.fim
    arch = ARCHS[settings.arch][1].removesuffix("ForCausalLM")
    if settings.distill_weight > 0:
        distillation = (f"The draft's loss blends in KL to the target from {DISTILL_START:.0%} of the budget, "
                        f"reaching weight {settings.distill_weight} at {DISTILL_FULL:.0%}.")
    else:
        distillation = "No distillation: the draft learns from the data alone, on the target's batches."
    lines = [
        "# Demo pair: training log" if settings.arch == "qwen2" and settings.fim_format == "qwen"
        else f"# Development pair ({arch}, {fim.family} FIM tokens): training log",
        "",
        f"Command: `{command}`",
        "",
        f"Machine: {platform.processor() or platform.machine()}, {settings.threads} torch threads, "
        f"Python {platform.python_version()}, torch {torch.__version__}, transformers "
        f"{transformers.__version__}, tokenizers {tokenizers.__version__}.",
        "",
        f"Wall time: {f['total_min']:.1f} min in all, {f['train_min']:.1f} min in the training loop "
        f"({f['steps']} steps, {f['tokens']:,} tokens, both models on the same batches).",
        "",
        "## Data",
        "",
        f"- {f['files']} files ({f['corpus_mb']:.1f} MB) of the Python standard library at `{f['root']}`, "
        f"without tests, GUI code, codec tables and the held-out modules; {f['stream_tokens']:,} tokens.",
        f"- Held out: {', '.join(HELDOUT_MODULES)}.",
        f"- Tokenizer: byte-level BPE, vocab {f['vocab']}, {f['chars_per_token']:.2f} characters/token "
        "on the held-out modules; special tokens " + ", ".join(f"`{t}`" for t in fim.special_tokens) + ".",
        f"- Objective: causal LM; {settings.fim_rate:.0%} of samples fill-in-the-middle "
        f"({settings.spm_rate:.0%} of those suffix-first), middles mostly the rest of a line or 1-"
        f"{MAX_MIDDLE_LINES} whole lines; sequences of {' / '.join(map(str, settings.seq_lens))} tokens"
        + (f"; {settings.repo_rate:.0%} of FIM samples begin with other files' chunks in the engine's repo-level "
           f"format ({REPO_TWIN_RATE:.0%} of those hold a near-twin of the middle's surroundings)."
           if settings.repo_rate else "."),
        "",
        f"## Models ({arch}, tied embeddings, bfloat16 on disk)",
        "",
        "| | params | hidden | layers | heads (kv) | MLP | on disk |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, size, params in (("target", settings.target, f["target_params"]),
                               ("draft", settings.draft, f["draft_params"])):
        lines.append(f"| {name} | {params / 1e6:.2f}M | {size.hidden} | {size.layers} | "
                     f"{size.heads} ({size.kv_heads}) | {size.intermediate} | {f['sizes'][name]:.1f} MB |")
    lines += [
        "",
        f"AdamW {ADAM_BETAS}, weight decay {settings.weight_decay}, peak lr {settings.target_lr} (target) / "
        f"{settings.draft_lr} (draft), {WARMUP_FRACTION:.0%} warm-up then cosine to {MIN_LR_RATIO:.0%} over "
        f"the time budget, {f['precision']}. {distillation}"
        + (f" Went on from the pair in `{settings.init}` (its tokenizer and weights) with peak learning rates "
           f"x{FINETUNE_LR_SCALE}." if settings.init else ""),
        "",
        "## Losses (nats/token)",
        "",
        "Train columns are running averages of cross-entropy on the data; the held-out FIM columns "
        f"score only the middle tokens (and the closing `{fim.eos}`) on a third of the final FIM set.",
        "",
        "| min | step | tokens | lr | train target | train draft | distill | held-out FIM target "
        "| held-out FIM draft | agreement |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in log.rows:
        held_out = (f"{row.eval.target_fim:.3f} | {row.eval.draft_fim:.3f} | {row.eval.agreement:.3f}"
                    if row.eval else "- | - | -")
        lines.append(f"| {row.minute:.1f} | {row.step} | {row.tokens:,} | {row.lr:.2e} | {row.target_loss:.3f} "
                     f"| {row.draft_loss:.3f} | {row.distill:.2f} | {held_out} |")
    lines += [
        "",
        "## Held-out results (saved weights, float32)",
        "",
        "| | LM loss (whole files) | FIM-middle loss |",
        "|---|---|---|",
        f"| target | {final.target_lm:.3f} | {final.target_fim:.3f} |",
        f"| draft | {final.draft_lm:.3f} | {final.draft_fim:.3f} |",
        "",
        f"Draft and target pick the same greedy token on {final.agreement:.1%} of FIM-middle positions "
        f"({settings.eval_fim_samples} held-out FIM samples).",
    ]
    if sample:
        before, middle, original = sample
        lines += [
            "",
            "## Sample",
            "",
            f"Target, greedy, PSM prompt in held-out `{SAMPLE_FILE}`, cursor after the indentation of "
            f"the statement in `Fraction.__repr__`, suffix from the line after it "
            f"({SAMPLE_MAX_NEW_TOKENS} new tokens at most).",
            "",
            "Completion:",
            "```python",
            middle,
            "```",
            "Original:",
            "```python",
            original.rstrip("\n"),
            "```",
        ]
    lines += ["", "## Settings", "", "```json", json.dumps(asdict(settings), indent=2), "```", ""]
    path.write_text("\n".join(lines))


def settings_from_args(args: argparse.Namespace) -> Settings:
    base = PRESETS[getattr(args, "preset", None) or "full"]
    changes: dict[str, Any] = {"seed": getattr(args, "seed", None) or 0}
    if getattr(args, "minutes", None) is not None:
        changes["minutes"] = float(args.minutes)
    if getattr(args, "arch", None):
        changes["arch"] = args.arch
    if getattr(args, "fim_format", None):
        changes["fim_format"] = args.fim_format
        if not FIM_FORMATS[args.fim_format].spm:
            changes["spm_rate"] = 0.0
    if getattr(args, "distill_weight", None) is not None:
        changes["distill_weight"] = float(args.distill_weight)
    if getattr(args, "repo_rate", None) is not None:
        changes["repo_rate"] = float(args.repo_rate)
    if getattr(args, "init", None):
        changes["init"] = str(args.init)
    return replace(base, **changes)


def run_train_demo(args: argparse.Namespace, cfg: Any = None) -> int:
    """Entry point for ``specd train-demo``; returns the process exit status."""
    # Spinning OpenMP workers stall for seconds per step when other processes share the
    # cores (docs/train-draft.md, "Timings behind the trainers' comments"). Read once,
    # when torch first loads, so this only helps when torch is not imported yet.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    settings = settings_from_args(args)
    if settings.threads == 1:
        # tokenizers trains and batch-encodes on every core unless told otherwise.
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    out_dir = Path(args.out) if getattr(args, "out", None) else DEMO_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    preset = getattr(args, "preset", None) or "full"
    options = {"arch": getattr(args, "arch", None), "fim-format": getattr(args, "fim_format", None),
               "distill-weight": getattr(args, "distill_weight", None),
               "repo-rate": getattr(args, "repo_rate", None), "init": getattr(args, "init", None)}
    command = (f"python -m specd.demo.train --minutes {settings.minutes:g} --seed {settings.seed}"
               + (f" --preset {preset}" if preset != "full" else "")
               + "".join(f" --{name} {value:g}" if isinstance(value, float) else f" --{name} {value}"
                         for name, value in options.items() if value is not None)
               + (f" --out {out_dir}" if out_dir != DEMO_DIR else ""))
    return train(settings, out_dir, command)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specd.demo.train", description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run_train_demo(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
