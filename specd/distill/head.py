"""``specd train-draft --head``: a feature head (``specd.engine.feature_head``, EAGLE's draft) for a
target, trained on the target's own final hidden states. The pieces that differ from the small
draft's are here; ``train.HeadRun`` runs them with the run's machinery (corpus, target,
checkpoint and resume, budget, progress, Ctrl-C, report).

What differs from the small draft:

- **teacher**: each window's final hidden states (after the final norm: what the LM head
  scores), kept in bfloat16, and the teacher's greedy tokens; not its top-k.
- **student**: one decoder layer of the target's width. At position t it reads h_t, the
  embedding of x_{t+1} and that of prompt lookup's guess of x_{t+2} (``lookup_guess``, within the
  window: a head trained with it agreed more in the same minutes), and predicts h_{t+1}; the loss is the cross-entropy of the prediction's
  scores against the target's distribution over the head's vocabulary (the softmax of the true
  next state's scores, computed from the stored state) plus smooth-L1 between the states. Its
  vocabulary is the ``head_vocab`` most frequent tokens of what the teacher read and emitted;
  its rows and the input embeddings are the target's, frozen (the head's file holds neither).
- **report**: agreement of the head's first and second drafted tokens with the target's
  greedy, and a head step against the target's (``report.evaluate_head_and_write``).
"""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

HEAD_SUBDIR = "head"
HEAD_CHECKPOINT = "head.pt"
HEAD_LR = 1e-3
# Windows of 1,024 tokens, four a step: a head step is far cheaper than the small draft's (one
# layer, a reduced vocabulary), so it affords more positions per update.
HEAD_TOKENS_PER_STEP = 4096
# Uniform noise of +-FEATURE_NOISE on the input states (EAGLE's): drafting feeds the head its own
# imperfect predictions, so it learns to read states that are a little off.
FEATURE_NOISE = 0.1


def head_settings(settings, head_vocab: int):
    """The run's ``Settings`` for a feature head: its vocabulary, and its optimizer's settings."""
    if head_vocab < 1:
        raise ValueError(f"--head-vocab must be positive, not {head_vocab}")
    return replace(settings, head=True, head_vocab=head_vocab, lr=HEAD_LR, weight_decay=0.0,
                   tokens_per_step=max(HEAD_TOKENS_PER_STEP, settings.seq_len))


def head_config(target_model, vocab_size: int):
    """``HeadConfig`` of one decoder layer shaped as the target's."""
    from specd.engine.feature_head import HeadConfig

    tc = target_model.config
    rope = getattr(tc, "rope_theta", None) or (getattr(tc, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    return HeadConfig(hidden=tc.hidden_size, heads=tc.num_attention_heads, intermediate=tc.intermediate_size,
                      vocab_size=vocab_size, rope_theta=float(rope), rms_eps=float(getattr(tc, "rms_norm_eps", 1e-5)),
                      guess=True)


def window_guesses(head, windows):
    """``lookup_guesses`` over each window [B, T] (within it), [B, T]; None for a head that
    reads none."""
    import torch

    from specd.engine.feature_head import lookup_guesses

    if not head.config.guess:
        return None
    return torch.tensor([lookup_guesses(row) for row in windows.tolist()], dtype=torch.long, device=windows.device)


def emitted_guesses(head, windows, emitted):
    """``chain_guesses`` per window: lookup's guess after ``emitted[:, t]`` [B, T - 1] where it
    follows ``windows[:, :t + 2]`` (a chain's second position, the head's token in place of the
    window's); None for a head that reads none."""
    import torch

    from specd.engine.feature_head import chain_guesses

    if not head.config.guess:
        return None
    return torch.tensor([chain_guesses(window, row) for window, row in zip(windows.tolist(), emitted.tolist())],
                        dtype=torch.long, device=windows.device)


def choose_vocab(windows, greedy, size: int, vocab_size: int):
    """The ``size`` most frequent token ids [R] (most frequent first) among ``windows`` [N, T]
    (what the teacher read) and ``greedy`` [N, T] (what it would emit there)."""
    import torch

    counts = torch.bincount(windows.flatten().long(), minlength=vocab_size)
    counts += torch.bincount(greedy.flatten().long(), minlength=vocab_size)
    return counts.argsort(descending=True, stable=True)[:min(size, vocab_size)]


def coverage(vocab, tokens, vocab_size: int) -> float:
    """Share of ``tokens`` that ``vocab`` holds."""
    import torch

    held = torch.zeros(vocab_size, dtype=torch.bool)
    held[vocab.cpu()] = True  # a head's vocabulary may sit on its training device
    return float(held[tokens.flatten().long().cpu()].float().mean())


def head_loss(head, predicted, following):
    """Cross-entropy of the predicted states' scores against the target's distribution over the
    head's vocabulary (the softmax of the true next states' scores) plus smooth-L1 between the
    states. ``predicted``, ``following``: [..., D]; the scores are taken in their dtype (or
    autocast's), the rest in float32. Returns (loss, cross-entropy)."""
    import torch
    import torch.nn.functional as F

    with torch.no_grad():
        wanted = torch.softmax(head.scores(following).float(), -1)
    cross_entropy = -(wanted * torch.log_softmax(head.scores(predicted).float(), -1)).sum(-1).mean()
    return cross_entropy + F.smooth_l1_loss(predicted.float(), following.float()), cross_entropy


def head_train_step(head, optimizer, windows, states, bf16: bool = False, grad_clip: float = 1.0) -> float:
    """One optimizer step on windows ``windows`` [B, T] and the target's states on them
    ``states`` [B, T, D]: at each t < T - 1, h_t (noised) and x_{t+1} predict h_{t+1}; and, as a
    chain's second step reads it, the head's own prediction of h_{t+1} and x_{t+2} predict
    h_{t+2} (EAGLE-3's training-time test: trained on true states alone, the head reads its own
    predictions badly, and a chain's second token seldom stands)."""
    import torch

    features = states[:, :-1].float()
    features = features + (torch.rand_like(features) - 0.5) * (2 * FEATURE_NOISE)
    tokens = windows[:, 1:]
    guesses = window_guesses(head, windows)
    following, second_guesses = (None, None) if guesses is None else (guesses[:, 1:], guesses[:, 2:])
    with torch.autocast(windows.device.type, dtype=torch.bfloat16, enabled=bf16):
        predicted = head(features, tokens, following)
        # positions t < T - 2: the second step reads the prediction and x_{t+2}
        drafted = head.second(features[:, :-1], tokens[:, :-1], predicted[:, :-1], windows[:, 2:],
                              None if following is None else following[:, :-1], second_guesses)
        # the scores too: over the head's vocabulary at every position they are most of a step's
        # products (autocast still takes the softmaxes in float32). The stored states are
        # bfloat16: handed over as float32, so that without autocast (a CPU that only emulates
        # bfloat16) their scores are float32 products, as the predictions' are.
        first, _ = head_loss(head, predicted, states[:, 1:].float())
        second, _ = head_loss(head, drafted, states[:, 2:].float())
    loss = first + second
    loss.backward()
    torch.nn.utils.clip_grad_norm_(head.parameters(), grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def head_agreement(head, windows, states, greedy, second: bool = True) -> tuple[float, float | None]:
    """(first, second): how often the head's first drafted token (its argmax at t, through its
    vocabulary) is the target's greedy at t + 1, over windows [B, T] with the target's states
    [B, T, D] and greedy [B, T]; and how often its second is the target's at t + 2 given the
    first was right (None unless ``second``)."""
    import torch

    was_training = head.training
    head.eval()
    first_right = first_total = chains = chains_right = 0
    with torch.no_grad():
        for row in range(len(windows)):  # a window at a time: scores are [T, R]
            window = windows[row:row + 1].long()
            features, tokens = states[row:row + 1, :-1].float(), window[:, 1:]
            wanted = greedy[row:row + 1, 1:].long().to(window.device)
            guesses = window_guesses(head, window)
            predicted = head(features, tokens, None if guesses is None else guesses[:, 1:])
            right = head.vocab[head.scores(predicted).argmax(-1)] == wanted  # [1, T-1]
            first_right += int(right.sum())
            first_total += right.numel()
            if second:
                drafted = head.second(features, tokens, predicted, wanted, None if guesses is None else guesses[:, 1:],
                                      emitted_guesses(head, window, wanted))
                second_right = head.vocab[head.scores(drafted).argmax(-1)][:, :-1] == wanted[:, 1:]
                chains += int(right[:, :-1].sum())  # the last position has no t + 2 in the window
                chains_right += int((right[:, :-1] & second_right).sum())
    head.train(was_training)
    return first_right / max(first_total, 1), (chains_right / max(chains, 1) if second else None)


def build_head(config, vocab, rows_all, embedding):
    """A fresh feature head scoring ``vocab``: its rows of the target's LM head ``rows_all``
    [V, D], reading the target's input ``embedding`` [V, D]."""
    from specd.engine.feature_head import FeatureHead

    return FeatureHead(config, vocab, rows_all[vocab], embedding)


def make_optimizer(head, settings):
    import torch

    return torch.optim.AdamW(head.parameters(), lr=settings.lr, weight_decay=settings.weight_decay)


def target_note(target) -> dict[str, Any]:
    """What the head was trained for, into its config: the target as named (empty: the default
    model) and, for a GGUF target, its file's name and digest."""
    note: dict[str, Any] = {"name": target.name}
    if target.gguf is not None:
        from specd.engine.builtin import file_sha256

        note |= {"gguf": target.gguf.name, "sha256": file_sha256(target.gguf)}
    return note


def save_head(head, folder: Path, target: dict, trained: dict) -> None:
    """The head's folder (``FeatureHead.save``) with what it was trained for and how in its
    config; written beside and then moved into ``folder``, so a folder there is whole."""
    head.config = replace(head.config, target=target, trained=trained)
    work = folder.with_name(folder.name + ".partial")
    shutil.rmtree(work, ignore_errors=True)
    head.save(work)
    shutil.rmtree(folder, ignore_errors=True)
    work.rename(folder)
