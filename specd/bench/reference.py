"""What a bench run measures "identical" against, and which methods it runs, by the kind of
target it was given.

- A transformers target (a folder or hub id; the embedded demo pair): the reference is
  ``hf_greedy``, ``generate(do_sample=False)`` of the target alone, and every method runs by
  default.
- A GGUF target (``*.gguf`` or ``ollama:NAME``, ``models.load_gguf_pair``): there are no torch
  weights, so no HF method can run. The reference is ``llamacpp``, llama.cpp's own greedy
  decoding of that same file, one token per forward (``LlamaSlot``): what specd guarantees on a
  GGUF file (docs/llamacpp.md, "What is lossless here"). The default methods are the llama.cpp
  peers and specd with its ablations; ``specd_llamacpp`` is left out, since on a GGUF target
  ``specd`` already runs every forward on llama.cpp (asked for, it runs: a second engine on
  its own llama.cpp context, the same decoding).

Decided from the configured names, before anything loads, with the loader's own test
(``is_gguf_name``), so a refused method costs no model load.
"""

from __future__ import annotations

from dataclasses import dataclass

from specd.bench.peers import ALL_METHODS, HF_PEERS, LLAMACPP_PEERS, SPECD_METHODS

TORCH_REFERENCE = "hf_greedy"
GGUF_REFERENCE = "llamacpp"
# What each reference is, for the report's readers.
REFERENCE_MEANING = {
    TORCH_REFERENCE: "HF generate(do_sample=False) of the target alone",
    GGUF_REFERENCE: "llama.cpp's own greedy of the same GGUF file, one token per forward",
}
GGUF_DEFAULT_METHODS = LLAMACPP_PEERS + tuple(m for m in SPECD_METHODS if m != "specd_llamacpp")


@dataclass(frozen=True)
class Baseline:
    """The reference and the default methods for one kind of target."""

    gguf: bool
    reference: str
    defaults: tuple[str, ...]

    def methods(self, requested: list[str] | None, target: str) -> list[str]:
        """The methods to run: ``requested`` (validated names) or the defaults, with the
        reference (first, when it was not asked for). ValueError, one line, for a method this
        target cannot run."""
        names = list(requested) if requested else list(self.defaults)
        if self.gguf:
            refused = [n for n in names if n in HF_PEERS]
            if refused:
                raise ValueError(f"{', '.join(refused)} need{'s' if len(refused) == 1 else ''} torch weights, and "
                                 f"the target {target} is a GGUF file (its reference is {GGUF_REFERENCE}: "
                                 f"{REFERENCE_MEANING[GGUF_REFERENCE]}); run the HF methods on the transformers "
                                 "model it was exported from")
        return names if self.reference in names else [self.reference, *names]


def baseline(target: str | None, draft: str | None) -> Baseline:
    """The baseline for the configured ``model.target`` / ``model.draft`` (empty: the embedded
    demo pair, transformers). Either one a GGUF name makes a GGUF pair, as the loader decides
    (a mixed pair is the loader's one-line refusal)."""
    from specd.llamacpp.gguf import is_gguf_name

    if any(name and is_gguf_name(name) for name in (target, draft)):
        return Baseline(True, GGUF_REFERENCE, GGUF_DEFAULT_METHODS)
    return Baseline(False, TORCH_REFERENCE, ALL_METHODS)
