"""``specd train-draft``: distil a draft for a target from the target's own next-token
distributions on code, within a time budget, resumable.

The run, in three phases over one wall-clock budget (``--minutes``, summed over resumes):

1. **teacher**: the target runs once over windows of the corpus (``corpus``) and its top-k
   next-token log-probabilities are kept (``teacher``), until ``teacher_share`` of the budget
   is spent or the corpus is used up. Its greedy tokens on the held-out windows are computed
   here too.
2. **student**: the draft (``student``: a narrow Llama started from the target's embeddings)
   learns to match those distributions: cross-entropy against the teacher's top-k,
   renormalised (KL to the teacher up to a constant), on random windows of what the teacher
   saw, learning rate warmed up then cosine-decayed over the fraction of the time left.
3. **report**: the draft is saved (a transformers folder; a GGUF file with ``--gguf``, always
   for a GGUF target, which the engine pairs only with a GGUF draft) and judged on held-out
   code (``report``), written to TRAINING.md beside the weights.

Everything the run has done lives in ``OUT/checkpoint``: the teacher's shards and the
student's weights, optimizer and clocks, saved every ``CHECKPOINT_EVERY_S`` and on Ctrl-C. The
same command again goes on from there (a longer ``--minutes`` extends the budget); a
checkpoint made with other settings is refused rather than mixed in.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import random
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from specd.distill.student import Shape

log = logging.getLogger(__name__)

TEACHER_SHARE = 0.5        # of the budget: the target over the corpus (a token of it costs ~2 of training)
TOP_K = 32                 # teacher log-probabilities kept per position
CHECKPOINT_EVERY_S = 120.0
PROGRESS_EVALS = 8         # agreement on a few held-out windows, this many times during training
PROGRESS_EVAL_WINDOWS = 4
HELDOUT_FILES = 16         # the held-out sample takes at most 1/this of its tokens from any one file
ADAM_BETAS = (0.9, 0.95)
GRAD_CLIP = 1.0
CHECKPOINT = "checkpoint"
DRAFT_SUBDIR = "draft"
REPORT = "TRAINING.md"
EXIT_INTERRUPTED = 130

# Settings that decide what the checkpoint holds: a resume must agree on all of them.
IDENTITY = ("target", "corpus", "heldout", "shape", "seq_len", "top_k", "seed", "max_corpus_tokens", "eval_tokens",
            "head", "head_vocab")
# A checkpoint written before a setting joined IDENTITY holds the setting's default.
IDENTITY_DEFAULTS = {"head": False, "head_vocab": 8192}


@dataclass(frozen=True)
class Settings:
    """Everything that decides the result; written into TRAINING.md."""

    target: str = ""                      # as model.target: empty is the default model
    corpus: tuple[str, ...] = ()
    heldout: tuple[str, ...] = ()
    minutes: float = 40.0                 # teacher + student, summed over resumes; saving and the report add to it
    shape: Shape = Shape()
    seq_len: int = 1024                   # tokens per window: engine prompts reach ~2k, the draft must attend far
    tokens_per_step: int = 1024           # more, smaller steps: a CPU's budget buys a few hundred
    teacher_batch: int = 2                # windows per teacher forward
    top_k: int = TOP_K
    lr: float = 3e-3
    weight_decay: float = 0.01
    teacher_share: float = TEACHER_SHARE
    max_corpus_tokens: int = 4_000_000    # tokenized up front; the teacher reaches what its time allows
    eval_tokens: int = 8192               # held-out tokens the final agreement is measured on
    gguf: str | None = None               # GGUF tensor type of the exported draft (None: no file)
    seed: int = 0
    threads: int = 2
    device: str = "auto"                  # where the teacher and the training run (``teacher.resolve_device``)
    head: bool = False                    # a feature head (``specd.distill.head``) instead of a small model
    head_vocab: int = 8192                # tokens the head scores: the most frequent on the corpus

    def identity(self) -> dict[str, Any]:
        return {name: json.loads(json.dumps(asdict(self)[name])) for name in IDENTITY}


# --- the checkpoint ------------------------------------------------------------------------

@dataclass
class LogRow:
    minute: float       # of training time
    step: int
    tokens: int
    lr: float
    loss: float         # running average of the distillation loss (nats/token)
    agreement: float    # on the progress held-out windows, against the teacher's greedy


@dataclass
class Progress:
    """What the run has done, across resumes."""

    teacher_s: float = 0.0
    train_s: float = 0.0
    taught: int = 0             # windows the teacher has run over
    shards: int = 0
    step: int = 0
    tokens: int = 0
    teacher_done: bool = False
    rows: list[LogRow] = field(default_factory=list)
    resumes: int = 0


class Checkpoint:
    """``OUT/checkpoint``: ``state.json`` (settings' identity, progress), ``corpus.pt`` (the
    windows, training and held-out, and the teacher's greedy on the held-out ones),
    ``teacher-NNNNN.pt`` (top-k shards, in window order), ``student.pt`` (weights, optimizer)."""

    def __init__(self, root: Path):
        self.root = root

    @property
    def state_file(self) -> Path:
        return self.root / "state.json"

    def exists(self) -> bool:
        return self.state_file.is_file()

    def load_state(self) -> tuple[dict, Progress]:
        data = json.loads(self.state_file.read_text(encoding="utf-8"))
        progress = data["progress"]
        rows = [LogRow(**row) for row in progress.pop("rows")]
        return data["identity"], Progress(**progress, rows=rows)

    def save_state(self, settings: Settings, progress: Progress) -> None:
        data = {"identity": settings.identity(), "progress": asdict(progress)}
        _atomic_write(self.state_file, json.dumps(data, indent=1).encode())

    def save(self, name: str, obj: Any) -> None:
        import io

        import torch

        buffer = io.BytesIO()
        torch.save(obj, buffer)
        _atomic_write(self.root / name, buffer.getvalue())

    def load(self, name: str) -> Any:
        import torch

        return torch.load(self.root / name, weights_only=False, map_location="cpu")  # a run may resume on another device

    def has(self, name: str) -> bool:
        return (self.root / name).is_file()


def _atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_name(path.name + ".part")
    part.write_bytes(data)
    os.replace(part, path)


# --- the run -------------------------------------------------------------------------------

class Interrupted(Exception):
    """Ctrl-C during a phase, after the checkpoint was saved."""


def say(line: str) -> None:
    """One line of what the run does, to the log (``run_train_draft`` routes the console's
    through tqdm, so a progress bar stays whole)."""
    log.info("%s", line)


def distill_loss(student_logits, teacher_ids, teacher_logprobs):
    """Cross-entropy of the student against the teacher's top-k distribution, renormalised:
    KL(teacher_k || student) plus the teacher's entropy, a constant. logits: [N, V];
    teacher_ids, teacher_logprobs: [N, k]."""
    import torch

    logq = torch.log_softmax(student_logits.float(), dim=-1)
    p = torch.softmax(teacher_logprobs.float(), dim=-1)  # the top-k renormalised
    return -(p * logq.gather(-1, teacher_ids.long())).sum(-1).mean()


def lr_factor(progress: float) -> float:
    from specd.demo.train import lr_factor as schedule  # warm-up, then cosine to a floor

    return schedule(progress)


class Run:
    """One invocation: the state it loaded, the phases it runs, the checkpoint it keeps."""

    label = "draft"  # what is trained, in progress lines

    def __init__(self, settings: Settings, out: Path, command: str):
        self.settings, self.out, self.command = settings, out, command
        self.checkpoint = Checkpoint(out / CHECKPOINT)
        self.started = time.monotonic()
        self.budget_s = settings.minutes * 60.0
        self.last_save = time.monotonic()

    # the three phases ------------------------------------------------------------------

    def run(self) -> int:
        import torch

        from specd.distill.teacher import bf16_arithmetic, load_torch_model, resolve_device, resolve_target

        s = self.settings
        self.device = resolve_device(s.device)
        self.bf16 = bf16_arithmetic(self.device)
        torch.set_num_threads(s.threads)
        torch.manual_seed(s.seed)
        self.progress = self._resume()
        self.target = resolve_target(s.target, say=say)
        say(f"target: {self.target.describe()}; training on {self.device}"
            f"{' (bfloat16 autocast)' if self.bf16 else ''}")
        teacher = load_torch_model(self.target.folder).to(self.device)
        self.data = self._corpus(teacher)
        self.student, self.optimizer = self._student(teacher)
        try:
            if not self.progress.teacher_done:
                self._teach(teacher)
            del teacher
            self._train()
        except Interrupted:
            say(f"stopped; the checkpoint in {self.checkpoint.root} keeps the work done "
                f"(teacher {self.progress.teacher_s / 60:.1f} min, training {self.progress.train_s / 60:.1f} min): "
                "run the same command to go on")
            return EXIT_INTERRUPTED
        return self._finish()

    def _resume(self) -> Progress:
        if not self.checkpoint.exists():
            return Progress()
        identity, progress = self.checkpoint.load_state()
        ours = self.settings.identity()
        differ = [name for name in IDENTITY if identity.get(name, IDENTITY_DEFAULTS.get(name)) != ours[name]]
        if differ:
            raise ValueError(f"{self.checkpoint.root} was made with other settings ({', '.join(differ)}): "
                             "remove it, or train into another --out")
        progress.resumes += 1
        say(f"resuming from {self.checkpoint.root}: teacher {progress.teacher_s / 60:.1f} min over "
            f"{progress.taught} windows, student step {progress.step} ({progress.train_s / 60:.1f} min)")
        return progress

    def _corpus(self, teacher) -> dict[str, Any]:
        """Windows to teach and to judge by, tokenized once and kept in the checkpoint."""
        import torch

        from specd.distill.corpus import split_files, token_windows
        if self.checkpoint.has("corpus.pt"):
            return self.checkpoint.load("corpus.pt")
        from transformers import AutoTokenizer

        s = self.settings
        tokenizer = AutoTokenizer.from_pretrained(self.target.folder)
        split = split_files([Path(p) for p in s.corpus], [Path(p) for p in s.heldout])
        separator = tokenizer.eos_token_id
        train, train_chars = token_windows(tokenizer, split.train, s.seq_len, s.seed, s.max_corpus_tokens, separator)
        heldout, _ = token_windows(tokenizer, split.heldout, s.seq_len, s.seed, s.eval_tokens, separator,
                                   per_file=max(s.seq_len, s.eval_tokens // HELDOUT_FILES))
        if not train or not heldout:
            raise ValueError(f"too little code for windows of {s.seq_len} tokens "
                             f"({len(train)} training, {len(heldout)} held-out)")
        say(f"corpus: {len(split.train)} files ({train_chars / 1e6:.1f} M characters read), "
            f"{len(train)} windows of {s.seq_len} tokens; held out: {len(split.heldout)} files, "
            f"{len(heldout)} windows{'' if split.heldout_named else ' (a share of the corpus)'}")
        heldout_ids = torch.tensor(heldout, dtype=torch.long)
        started = time.monotonic()
        judged = self._heldout_teacher(teacher, heldout_ids)
        say(f"teacher's greedy on the held-out windows (for the progress lines) in {time.monotonic() - started:.0f}s")
        data = {"train": torch.tensor(train, dtype=torch.int32), "heldout": heldout_ids.to(torch.int32),
                **judged, "train_files": len(split.train),
                "heldout_files": [str(p) for p in split.heldout], "train_chars": train_chars,
                "roots": list(s.corpus)}
        self.checkpoint.save("corpus.pt", data)
        self.checkpoint.save_state(self.settings, self.progress)
        return data

    def _heldout_teacher(self, teacher, heldout) -> dict:
        """What the teacher gives of the held-out windows [B, T]: its greedy tokens ``heldout_greedy``."""
        from specd.distill.teacher import teach

        top_ids, _ = teach(teacher, heldout, 1, self.settings.teacher_batch, self.bf16)
        return {"heldout_greedy": top_ids[..., 0]}

    def _student(self, teacher):
        import torch

        from specd.demo.train import make_optimizer
        from specd.distill.student import build_student, param_count

        s = self.settings
        max_positions = getattr(teacher.config, "max_position_embeddings", None) or 4096
        student = build_student(teacher, s.shape, max_positions).to(self.device)
        optimizer = make_optimizer(student, s.lr, s.weight_decay)
        if self.checkpoint.has("student.pt"):
            saved = self.checkpoint.load("student.pt")
            student.load_state_dict(saved["model"])
            optimizer.load_state_dict(saved["optimizer"])
            torch.set_rng_state(saved["rng"])
        student.train()
        say(f"draft: LlamaForCausalLM {param_count(student) / 1e6:.2f}M params, hidden {s.shape.hidden}, "
            f"{s.shape.layers} layers, vocab {student.config.vocab_size}, embeddings from the target's")
        return student, optimizer

    def _teach(self, teacher) -> None:
        """The target over the training windows, in order, until its share of the budget is
        spent; a shard per checkpoint."""
        import torch
        from tqdm import tqdm

        s, p = self.settings, self.progress
        windows = self.data["train"]
        bf16 = self.bf16
        budget = s.teacher_share * self.budget_s
        bar = tqdm(total=len(windows), initial=p.taught, desc="teacher", unit="win", file=sys.stderr,
                   dynamic_ncols=True)
        pending: list[dict] = []
        segment = time.monotonic()
        try:
            while p.taught < len(windows) and p.teacher_s < budget:
                batch = windows[p.taught:p.taught + s.teacher_batch].long()
                pending.append(self._teach_batch(teacher, batch, bf16))
                p.taught += len(batch)
                now = time.monotonic()
                p.teacher_s += now - segment
                segment = now
                bar.update(len(batch))
                bar.set_postfix(min=f"{p.teacher_s / 60:.1f}/{budget / 60:.1f}", refresh=False)
                if now - self.last_save >= CHECKPOINT_EVERY_S:
                    self._save_shard(pending)
        except KeyboardInterrupt:
            self._save_shard(pending)
            raise Interrupted from None
        finally:
            bar.close()
        p.teacher_done = True
        self._save_shard(pending)
        say(f"teacher: {p.taught} windows ({p.taught * s.seq_len:,} tokens) in {p.teacher_s / 60:.1f} min")

    def _teach_batch(self, teacher, batch, bf16: bool) -> dict:
        """What the teacher keeps of windows ``batch`` [b, T]: its top-k, ids and logprobs [b, T, k]."""
        from specd.distill.teacher import teach

        ids, values = teach(teacher, batch, self.settings.top_k, self.settings.teacher_batch, bf16)
        return {"ids": ids, "logprobs": values}

    def _save_shard(self, pending: list[dict]) -> None:
        import torch

        if pending:
            self.checkpoint.save(f"teacher-{self.progress.shards:05d}.pt",
                                 {key: torch.cat([part[key] for part in pending]) for key in pending[0]})
            self.progress.shards += 1
            pending.clear()
        self.checkpoint.save_state(self.settings, self.progress)
        self.last_save = time.monotonic()

    def _taught(self) -> dict:
        """The teacher's shards joined: each key's tensor over the windows taught, in order."""
        import torch

        shards = [self.checkpoint.load(f"teacher-{i:05d}.pt") for i in range(self.progress.shards)]
        return {key: torch.cat([sh[key] for sh in shards]) for key in shards[0]} if shards else {}

    def _train(self) -> None:
        import torch
        from tqdm import tqdm

        s, p = self.settings, self.progress
        bf16 = self.bf16
        taught = self._taught()
        windows = self.data["train"][:p.taught]
        if not taught or not len(windows):
            raise ValueError("the teacher ran over no window: give a longer --minutes")
        self._before_training(taught)
        budget = max(self.budget_s - p.teacher_s, 1.0)
        rows_per_step = max(1, s.tokens_per_step // s.seq_len)
        rng = random.Random(s.seed + p.step)
        # a few windows spread over the held-out set (its first file may be one long table)
        every = max(1, len(self.data["heldout"]) // PROGRESS_EVAL_WINDOWS)
        probe = self.data["heldout"][::every][:PROGRESS_EVAL_WINDOWS].long().to(self.device)
        probe_greedy = self.data["heldout_greedy"][::every][:PROGRESS_EVAL_WINDOWS]
        next_eval = int(p.train_s / budget * PROGRESS_EVALS) + 1
        ema = p.rows[-1].loss if p.rows else None
        bar = tqdm(total=round(budget), initial=min(round(p.train_s), round(budget)), desc=self.label, unit="s",
                   file=sys.stderr, dynamic_ncols=True)
        segment = time.monotonic()
        try:
            while p.train_s < budget:
                scale = lr_factor(p.train_s / budget)
                for group in self.optimizer.param_groups:
                    group["lr"] = s.lr * scale
                pick = torch.tensor([rng.randrange(len(windows)) for _ in range(rows_per_step)])
                loss = self._train_step(windows[pick].long().to(self.device),
                                        {key: t[pick].to(self.device) for key, t in taught.items()}, bf16)
                p.step += 1
                p.tokens += rows_per_step * s.seq_len
                ema = loss if ema is None else 0.95 * ema + 0.05 * loss
                now = time.monotonic()
                p.train_s += now - segment
                segment = now
                bar.update(min(round(p.train_s), round(budget)) - bar.n)
                bar.set_postfix(step=p.step, loss=f"{ema:.3f}", refresh=False)
                if p.train_s >= next_eval * budget / PROGRESS_EVALS or p.train_s >= budget:
                    next_eval += 1
                    agreement = self._probe_agreement(probe, probe_greedy, every)
                    row = LogRow(round(p.train_s / 60, 2), p.step, p.tokens, s.lr * scale, round(ema, 4),
                                 round(agreement, 4))
                    p.rows.append(row)
                    say(f"[{row.minute:5.1f} min] step {row.step} tokens {row.tokens:,} lr {row.lr:.2e} "
                        f"loss {row.loss:.3f} held-out agreement {row.agreement:.1%}")
                    segment = time.monotonic()  # the evaluation is not training time
                if now - self.last_save >= CHECKPOINT_EVERY_S:
                    self._save_student()
                    segment = time.monotonic()
        except KeyboardInterrupt:
            self._save_student()
            raise Interrupted from None
        finally:
            bar.close()
        self._save_student()
        say(f"{self.label}: {p.step} steps, {p.tokens:,} tokens in {p.train_s / 60:.1f} min")

    def _before_training(self, taught: dict) -> None:
        """Ready what training needs from the teacher's work (the student was built at the start)."""

    def _train_step(self, windows, taught: dict, bf16: bool) -> float:
        """One optimizer step on ``windows`` [B, T] and the teacher's work on them; the loss."""
        return train_step(self.student, self.optimizer, windows, taught["ids"], taught["logprobs"], bf16)

    def _probe_agreement(self, probe, probe_greedy, every: int) -> float:
        """Agreement on the progress windows ``probe`` (every ``every``-th held-out window)."""
        return greedy_agreement(self.student, probe, probe_greedy)

    def _save_student(self) -> None:
        import torch

        self.checkpoint.save("student.pt", {"model": self.student.state_dict(),
                                            "optimizer": self.optimizer.state_dict(),
                                            "rng": torch.get_rng_state()})
        self.checkpoint.save_state(self.settings, self.progress)
        self.last_save = time.monotonic()

    def _finish(self) -> int:
        from specd.distill.report import evaluate_and_write
        from specd.distill.student import export_student_gguf, save_student

        s = self.settings
        draft_dir = self.out / DRAFT_SUBDIR
        self.student = self.student.cpu().eval()  # saved and judged on the CPU, as the engine reads it
        save_student(self.student, self.target.folder, draft_dir,
                     {"distilled_from": str(self.target.gguf or self.target.folder), "by": "specd train-draft"})
        say(f"wrote {draft_dir}")
        gguf_type = s.gguf or (DEFAULT_GGUF_TYPE if self.target.gguf else None)
        gguf_path = None
        if gguf_type:
            gguf_path = export_student_gguf(draft_dir, self.out / f"draft.{gguf_type}.gguf", gguf_type,
                                            self.target.gguf)
            say(f"wrote {gguf_path}")
        evaluate_and_write(self, draft_dir, gguf_path, say)
        say(f"wrote {self.out / REPORT}; use the draft with: --draft-model {gguf_path or draft_dir}")
        return 0


class HeadRun(Run):
    """A run that trains a feature head: the teacher keeps hidden states, the head is built once
    they are in (its vocabulary counts what the teacher read and emitted)."""

    label = "head"

    def _heldout_teacher(self, teacher, heldout) -> dict:
        from specd.distill.teacher import teach_states

        states, greedy = teach_states(teacher, heldout, self.settings.teacher_batch, self.bf16)
        return {"heldout_greedy": greedy, "heldout_states": states}

    def _teach_batch(self, teacher, batch, bf16: bool) -> dict:
        from specd.distill.teacher import teach_states

        states, greedy = teach_states(teacher, batch, self.settings.teacher_batch, bf16)
        return {"states": states, "greedy": greedy}

    def _student(self, teacher):
        """The target's pieces the head needs (it is built after the teacher, or from the checkpoint)."""
        import torch

        from specd.distill import head as head_training
        from specd.distill.student import target_embeddings

        self.rows_all = target_embeddings(teacher)
        self.embedding = teacher.get_input_embeddings().weight.detach().float()
        self.config = head_training.head_config(teacher, self.rows_all.shape[0])
        if not self.checkpoint.has(head_training.HEAD_CHECKPOINT):
            return None, None
        saved = self.checkpoint.load(head_training.HEAD_CHECKPOINT)
        head = head_training.build_head(self.config, saved["model"]["vocab"], self.rows_all, self.embedding)
        head.load_state_dict(saved["model"])
        head = head.to(self.device)
        optimizer = head_training.make_optimizer(head, self.settings)
        optimizer.load_state_dict(saved["optimizer"])
        torch.set_rng_state(saved["rng"])
        self._announce(head)
        return head.train(), optimizer

    def _announce(self, head) -> None:
        from specd.distill.head import coverage

        c = head.config
        params = sum(p.numel() for p in head.parameters())
        say(f"head: one layer of width {c.hidden} ({c.heads} heads, MLP {c.intermediate}), {params / 1e6:.2f}M "
            f"params, scoring {len(head.vocab)} of {c.vocab_size} tokens, which cover "
            f"{coverage(head.vocab, self.data['heldout_greedy'], c.vocab_size):.1%} of the target's greedy "
            "tokens on held-out code")

    def _before_training(self, taught: dict) -> None:
        from specd.distill import head as head_training

        if self.student is not None:
            return
        vocab = head_training.choose_vocab(self.data["train"][:self.progress.taught], taught["greedy"],
                                           self.settings.head_vocab, self.config.vocab_size)
        self.student = head_training.build_head(self.config, vocab, self.rows_all, self.embedding).to(self.device).train()
        self.optimizer = head_training.make_optimizer(self.student, self.settings)
        self._announce(self.student)

    def _train_step(self, windows, taught: dict, bf16: bool) -> float:
        from specd.distill import head as head_training

        return head_training.head_train_step(self.student, self.optimizer, windows, taught["states"], bf16, GRAD_CLIP)

    def _probe_agreement(self, probe, probe_greedy, every: int) -> float:
        from specd.distill.head import head_agreement

        states = self.data["heldout_states"][::every][:PROGRESS_EVAL_WINDOWS].to(self.device)
        first, _ = head_agreement(self.student, probe, states, probe_greedy, second=False)
        return first

    def _save_student(self) -> None:
        import torch

        from specd.distill.head import HEAD_CHECKPOINT

        if self.student is not None:
            self.checkpoint.save(HEAD_CHECKPOINT, {"model": self.student.state_dict(),
                                                   "optimizer": self.optimizer.state_dict(),
                                                   "rng": torch.get_rng_state()})
        self.checkpoint.save_state(self.settings, self.progress)
        self.last_save = time.monotonic()

    def _finish(self) -> int:
        from specd.distill.head import HEAD_SUBDIR
        from specd.distill.report import evaluate_head_and_write

        self.student = self.student.cpu().eval()  # judged on the CPU, as the engine's CPU paths read it
        evaluate_head_and_write(self, self.out / HEAD_SUBDIR, say)
        say(f"wrote {self.out / REPORT}; use the head with: model.draft = {self.out / HEAD_SUBDIR}")
        return 0


def train_step(model, optimizer, inputs, teacher_ids, teacher_logprobs, bf16: bool = False) -> float:
    """One optimizer step on windows ``inputs`` [B, T]; returns the loss. ``bf16``: products
    under bfloat16 autocast (the head's over the whole vocabulary are most of a step)."""
    import torch

    with torch.autocast(inputs.device.type, dtype=torch.bfloat16, enabled=bf16):
        logits = model(input_ids=inputs).logits  # [B, T, V]
        loss = distill_loss(logits.flatten(0, 1), teacher_ids.flatten(0, 1), teacher_logprobs.flatten(0, 1))
    loss.backward()
    loss = loss.detach()
    torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def greedy_agreement(model, windows, greedy) -> float:
    """Share of positions where ``model``'s argmax is ``greedy`` (the target's), [B, T] both."""
    import torch

    was_training = model.training
    model.eval()
    same = total = 0
    with torch.no_grad():
        for row in range(len(windows)):
            picks = model(input_ids=windows[row:row + 1]).logits[0].argmax(-1)
            same += int((picks == greedy[row].long().to(picks.device)).sum())
            total += picks.numel()
    model.train(was_training)
    return same / max(total, 1)


# A GGUF target's draft is written as a GGUF file of this type (the engine pairs a GGUF target
# only with a GGUF draft). 8-bit: a quarter of f32's bytes per step at a rounding that leaves
# its greedy choices as they were.
DEFAULT_GGUF_TYPE = "q8_0"


# --- the command ---------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``specd train-draft`` (``cli.py`` spells them out too; a test keeps the two in step)."""
    parser.add_argument("--target", metavar="MODEL", default=None,
                        help="the model to draft for: a folder, a hub id, a .gguf file, ollama:NAME, demo, or "
                             "nothing for the default model (default: model.target)")
    parser.add_argument("--corpus", metavar="DIR", action="append",
                        help="code to learn from (repeatable; default: workspace.folders)")
    parser.add_argument("--heldout", metavar="DIR", action="append",
                        help="code never trained on, to measure agreement on (repeatable; default: a share "
                             "of the corpus files)")
    parser.add_argument("--minutes", type=float, default=40.0,
                        help="time budget for the teacher and the training, summed over resumes (default: 40)")
    parser.add_argument("--out", metavar="DIR", default=None,
                        help="where the draft, TRAINING.md and the checkpoint go (default: "
                             "$XDG_DATA_HOME/specd/drafts/<target>)")
    parser.add_argument("--gguf", metavar="TYPE", nargs="?", const=DEFAULT_GGUF_TYPE, default=None,
                        help=f"also write the draft as a GGUF file of this type (default {DEFAULT_GGUF_TYPE}; "
                             "always written for a GGUF target)")
    parser.add_argument("--head", action="store_true",
                        help="train a feature head instead: one layer that reads the target's final hidden state "
                             "and the token it emitted and predicts its next state (EAGLE's draft)")
    parser.add_argument("--head-vocab", type=int, default=Settings.head_vocab, metavar="N",
                        help="with --head: the N most frequent tokens it scores (default: %(default)s)")
    parser.add_argument("--hidden", type=int, default=None, help=f"draft width (default: {Shape.hidden})")
    parser.add_argument("--layers", type=int, default=None, help=f"draft layers (default: {Shape.layers})")
    parser.add_argument("--seq-len", type=int, default=Settings.seq_len,
                        help="tokens per training window (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=Settings.threads, help="torch threads (default: %(default)s)")
    parser.add_argument("--device", default=None, metavar="DEVICE",
                        help="where the teacher and the training run: auto (a CUDA device where torch has "
                             "one, else the CPU), cpu, cuda or cuda:N (default: model.device, auto)")
    parser.add_argument("--seed", type=int, default=0)


def settings_from_args(args: argparse.Namespace, cfg: Any = None) -> Settings:
    target = args.target if args.target is not None else (cfg["model.target"] if cfg is not None else "")
    corpus = args.corpus or ([f for f in cfg["workspace.folders"].split(":") if f] if cfg is not None else [])
    if not corpus:
        raise ValueError("no code to learn from: name --corpus DIR (or set workspace.folders)")
    head = getattr(args, "head", False)
    if not head and getattr(args, "head_vocab", Settings.head_vocab) != Settings.head_vocab:
        raise ValueError("--head-vocab sizes a feature head's vocabulary: it goes with --head")
    if head:
        shaping = [name for name, value in (("--gguf", args.gguf), ("--hidden", args.hidden), ("--layers", args.layers))
                   if value is not None]
        if shaping:
            raise ValueError(f"--head trains a feature head shaped by the target: {', '.join(shaping)} "
                             "shape the small draft, not the head")
    device = getattr(args, "device", None) or (cfg["model.device"] if cfg is not None else Settings.device)
    if device != "auto":  # a device torch cannot use is refused before any work (auto always resolves)
        from specd.distill.teacher import resolve_device

        resolve_device(device)
    hidden = args.hidden or Shape.hidden
    heads = max(1, hidden // 64)
    shape = Shape(hidden=hidden, layers=args.layers or Shape.layers, heads=heads, kv_heads=max(1, heads // 2),
                  intermediate=3 * hidden)
    base = Settings()
    settings = replace(base, target=target, corpus=tuple(str(Path(c).expanduser().resolve()) for c in corpus),
                       heldout=tuple(str(Path(h).expanduser().resolve()) for h in args.heldout or ()),
                       minutes=args.minutes, shape=shape, seq_len=args.seq_len, gguf=args.gguf, seed=args.seed,
                       threads=args.threads, tokens_per_step=max(base.tokens_per_step, args.seq_len),
                       device=device)
    if head:
        from specd.distill.head import head_settings

        settings = head_settings(settings, args.head_vocab)
    return settings


def default_out(target: str, head: bool = False) -> Path:
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    name = "".join(c if c.isalnum() or c in "._-" else "-" for c in (Path(target).name if target else "default"))
    return Path(base) / "specd" / "drafts" / (name + ("-head" if head else ""))


def run_train_draft(args: argparse.Namespace, cfg: Any = None) -> int:
    """Entry point of ``specd train-draft``; returns the exit status."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # spinning OpenMP workers stall on a shared CPU
    try:
        settings = settings_from_args(args, cfg)
    except ValueError as err:
        print(f"specd train-draft: {err}", file=sys.stderr)
        return 2
    out = Path(args.out).expanduser() if args.out else default_out(settings.target, settings.head)
    out.mkdir(parents=True, exist_ok=True)
    command = "specd train-draft " + " ".join(_argv(args, settings, out))
    log.info("train-draft into %s: %s", out, settings)
    from tqdm.contrib.logging import logging_redirect_tqdm

    # A stop from outside (kill, a service manager) saves the checkpoint as Ctrl-C does: a job
    # started in the background from a script ignores Ctrl-C's SIGINT.
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        with logging_redirect_tqdm():
            return (HeadRun if settings.head else Run)(settings, out, command).run()
    except ValueError as err:
        print(f"specd train-draft: {err}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _argv(args: argparse.Namespace, settings: Settings, out: Path) -> list[str]:
    parts = [f"--target {settings.target}" if settings.target else ""]
    parts += [f"--corpus {c}" for c in settings.corpus] + [f"--heldout {h}" for h in settings.heldout]
    parts += [f"--minutes {settings.minutes:g}", f"--out {out}"]
    if settings.head:
        parts.append("--head" + (f" --head-vocab {settings.head_vocab}" if settings.head_vocab != Settings.head_vocab
                                 else ""))
    if settings.gguf:
        parts.append(f"--gguf {settings.gguf}")
    if settings.shape != Shape():
        parts.append(f"--hidden {settings.shape.hidden} --layers {settings.shape.layers}")
    if settings.seq_len != Settings.seq_len:
        parts.append(f"--seq-len {settings.seq_len}")
    if settings.device != Settings.device:
        parts.append(f"--device {settings.device}")
    return [p for p in parts if p]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specd.distill.train", description=__doc__.split("\n")[0])
    add_arguments(parser)
    from specd.logs import setup_logging

    setup_logging("info")
    return run_train_draft(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
