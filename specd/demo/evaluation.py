"""How well the demo pair does on held-out text while it trains: language-model and FIM losses
of target and draft, how often the draft's guess is the target's, and one sample completion."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from specd.demo.data import EOS, FIM_FORMATS, MAX_CHARS_PER_TOKEN, FimFormat, Sample, SampleMaker, after_lines, collate, line_end

SAMPLE_MAX_NEW_TOKENS = 48
SAMPLE_ANCHOR = '    def __repr__(self):\n        """repr(self)"""\n'
SAMPLE_MIDDLE_LINES = 2


def masked_ce(logits, targets, mask):
    """Mean next-token cross-entropy (nats) over mask. logits: [B, T, V]; targets, mask: [B, T]."""
    import torch.nn.functional as F

    losses = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="none")
    weights = mask.flatten().float()
    return (losses * weights).sum() / weights.sum().clamp(min=1.0)


@dataclass
class EvalResult:
    target_lm: float = float("nan")      # nats/token over whole held-out files
    draft_lm: float = float("nan")
    target_fim: float = float("nan")     # nats/token over FIM middles (and their EOS)
    draft_fim: float = float("nan")
    agreement: float = float("nan")      # P(draft argmax == target argmax) on FIM middles


def heldout_lm_batches(tok, texts: list[str], seq_len: int, max_windows: int | None, eos_token: str = EOS):
    """Non-overlapping seq_len windows over each held-out file followed by EOS."""
    eos = tok.token_to_id(eos_token)
    windows = []
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False).ids + [eos]
        for start in range(0, len(ids) - 1, seq_len):
            windows.append(Sample(ids[start:start + seq_len + 1], 0, fim=False))
    if max_windows is not None:
        windows = windows[:max_windows]
    return [collate(windows[i:i + 4], seq_len, eos) for i in range(0, len(windows), 4)]


def heldout_fim_batches(maker: SampleMaker, count: int, seq_len: int):
    # Half suffix-first when training uses that layout at all.
    samples = [maker.fim(seq_len + 1, spm=maker.settings.spm_rate > 0 and i % 2 == 1) for i in range(count)]
    eos = maker.ids[maker.fmt.eos]
    return [collate(samples[i:i + 4], seq_len, eos, middle_only=True) for i in range(0, count, 4)]


def evaluate(target, draft, lm_batches, fim_batches, autocast: bool) -> EvalResult:
    import torch

    def mean_losses(batches, with_agreement: bool):
        totals = {"target": 0.0, "draft": 0.0, "agree": 0.0, "count": 0.0}
        for inputs, targets, mask in batches:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                t_logits = target(input_ids=inputs).logits
                d_logits = draft(input_ids=inputs).logits
            n = float(mask.sum())
            totals["target"] += float(masked_ce(t_logits, targets, mask)) * n
            totals["draft"] += float(masked_ce(d_logits, targets, mask)) * n
            if with_agreement:
                same = (t_logits.argmax(-1) == d_logits.argmax(-1)) & mask
                totals["agree"] += float(same.sum())
            totals["count"] += n
        count = max(totals["count"], 1.0)
        return totals["target"] / count, totals["draft"] / count, totals["agree"] / count

    was_training = target.training
    target.eval()
    draft.eval()
    with torch.no_grad():
        result = EvalResult()
        if lm_batches:
            result.target_lm, result.draft_lm, _ = mean_losses(lm_batches, False)
        result.target_fim, result.draft_fim, result.agreement = mean_losses(fim_batches, True)
    if was_training:
        target.train()
        draft.train()
    return result


def sample_completion(model_dir: Path, text: str, context: int, fim: FimFormat = FIM_FORMATS["qwen"],
                      max_new_tokens: int = SAMPLE_MAX_NEW_TOKENS):
    """Greedy PSM completion at a fixed cursor in a held-out file: (prefix tail, completion, original).

    The cursor sits after the indentation of the line following SAMPLE_ANCHOR (or mid-file
    if the anchor is missing); the original middle is SAMPLE_MIDDLE_LINES lines.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    at = text.find(SAMPLE_ANCHOR)
    cursor = at + len(SAMPLE_ANCHOR) if at >= 0 else text.rfind("\n", 0, len(text) // 2) + 1
    line = text[cursor:line_end(text, cursor)]
    cursor += len(line) - len(line.lstrip(" "))
    suffix_start = after_lines(text, cursor, SAMPLE_MIDDLE_LINES)
    prefix, suffix = text[:cursor], text[suffix_start:]
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    budget = context - max_new_tokens - 3
    suffix_ids = tok.encode(suffix[:budget * MAX_CHARS_PER_TOKEN])[:budget // 4]
    prefix_ids = tok.encode(prefix[-budget * MAX_CHARS_PER_TOKEN:])[-(budget - len(suffix_ids)):]
    special = tok.convert_tokens_to_ids
    prompt = [special(fim.prefix), *prefix_ids, special(fim.suffix), *suffix_ids, special(fim.middle)]
    input_ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                             max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
    middle = tok.decode(out[0, input_ids.shape[1]:], skip_special_tokens=True)
    return prefix[-200:], middle, text[cursor:suffix_start]
