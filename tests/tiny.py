"""Tiny random-weight model pairs built in code, so no test downloads anything.

``make_tiny_pair(root, arch)`` writes a byte-level BPE tokenizer with Qwen2.5-Coder-style FIM
tokens and a target + draft model of the given architecture (llama, qwen2, gpt2, qwen3, gemma,
granite, gpt_neox, phi3, stablelm, phi, opt, gemma2, gemma3_text, olmo2) into
``root/target`` and ``root/draft``, loadable with AutoModelForCausalLM / AutoTokenizer.

Weights are drawn with a large init range so the next-token distribution is peaked: greedy
equality tests then compare argmaxes that are not decided by float rounding noise.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

FIM_TOKENS = [
    "<|endoftext|>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
]

CORPUS = Path(__file__).parent / "data" / "corpus"


def corpus_texts() -> list[str]:
    """Training text for the tiny tokenizer: our fixture sources plus a few stdlib files."""
    import sysconfig

    texts = [p.read_text(encoding="utf-8") for p in sorted(CORPUS.glob("*.py"))]
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in ("textwrap.py", "bisect.py", "colorsys.py", "fnmatch.py"):
        path = stdlib / name
        if path.exists():
            texts.append(path.read_text(encoding="utf-8"))
    texts.append("héllo wörld — 你好 🎉 ünïcödé\n")
    return texts


@functools.lru_cache(maxsize=None)
def _tokenizer_json(vocab_size: int) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=FIM_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus_texts(), trainer=trainer)
    return tok.to_str()


def make_tokenizer(vocab_size: int = 512):
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_tokenizer_json(vocab_size)),
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=FIM_TOKENS[1:],
    )
    return tok


def make_model(arch: str, vocab_size: int, hidden: int, layers: int, seed: int, init_range: float = 0.4):
    import torch
    from transformers import (
        AutoModelForCausalLM,
        GPT2Config,
        LlamaConfig,
        Qwen2Config,
    )

    torch.manual_seed(seed)
    common = dict(vocab_size=vocab_size, initializer_range=init_range, bos_token_id=0, eos_token_id=0)
    if arch == "llama":
        config = LlamaConfig(hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                             tie_word_embeddings=False, **common)
    elif arch == "qwen2":
        config = Qwen2Config(hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                             tie_word_embeddings=True, **common)
    elif arch == "gpt2":
        config = GPT2Config(n_embd=hidden, n_layer=layers, n_head=4, n_positions=4096, **common)
    elif arch in ("qwen3", "gemma", "granite", "phi3", "stablelm"):
        from transformers import GemmaConfig, GraniteConfig, Phi3Config, Qwen3Config, StableLmConfig

        extra = {"qwen3": dict(tie_word_embeddings=True, head_dim=hidden // 4),
                 "gemma": dict(hidden_act="gelu_pytorch_tanh", head_dim=hidden // 4),  # Gemma ties its embeddings
                 "granite": dict(tie_word_embeddings=False, embedding_multiplier=3.0, residual_multiplier=0.5,
                                 attention_multiplier=0.2, logits_scaling=2.5),
                 "phi3": dict(pad_token_id=0),  # Phi-3's fused qkv_proj and gate_up_proj
                 "stablelm": dict(use_qkv_bias=True)}[arch]  # a quarter of each head rotated, LayerNorms
        config_cls = {"qwen3": Qwen3Config, "gemma": GemmaConfig, "granite": GraniteConfig, "phi3": Phi3Config,
                      "stablelm": StableLmConfig}[arch]
        config = config_cls(hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                            **extra, **common)
    elif arch == "olmo2":  # OLMo 2: norms after each branch only, q/k normalised over whole projections
        from transformers import Olmo2Config

        config = Olmo2Config(hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, **common)
    elif arch == "gemma2":  # Gemma 2: soft-capped attention scores and logits, sandwich norms
        from transformers import Gemma2Config

        config = Gemma2Config(hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4,
                              sliding_window=64, max_position_embeddings=4096, attn_logit_softcapping=5.0,
                              layer_types=(["sliding_attention", "full_attention"] * layers)[:layers], **common)
    elif arch == "gemma3_text":  # Gemma 3: sliding and full layers, two rotary bases, sandwich norms
        from transformers import Gemma3TextConfig

        config = Gemma3TextConfig(hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4,
                                  sliding_window=64, max_position_embeddings=4096,
                                  layer_types=(["sliding_attention", "full_attention"] * layers)[:layers], **common)
    elif arch == "opt":  # OPT-125m's shape: learned positions offset by 2, relu
        from transformers import OPTConfig

        config = OPTConfig(hidden_size=hidden, ffn_dim=hidden * 4, word_embed_proj_dim=hidden, num_hidden_layers=layers,
                           num_attention_heads=4, max_position_embeddings=2048, init_std=init_range, pad_token_id=1,
                           **common)
    elif arch == "phi":  # Phi-1/1.5/2: half of each head rotated, one LayerNorm for both branches
        from transformers import PhiConfig

        config = PhiConfig(hidden_size=hidden, intermediate_size=hidden * 4, num_hidden_layers=layers,
                           num_attention_heads=4, max_position_embeddings=4096, tie_word_embeddings=False,
                           **common)
    elif arch == "gpt_neox":  # Pythia's shape: parallel residual, a quarter of each head rotated
        from transformers import GPTNeoXConfig

        config = GPTNeoXConfig(hidden_size=hidden, intermediate_size=hidden * 4, num_hidden_layers=layers,
                               num_attention_heads=4, max_position_embeddings=4096, rotary_pct=0.25,
                               tie_word_embeddings=False, **common)
    else:
        raise ValueError(arch)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # init_range alone leaves norms at 1 and biases at 0; spread the logits out
        model.lm_head.weight.mul_(4.0) if not config.tie_word_embeddings else None
    return model.eval()


def make_tiny_pair(root: Path, arch: str = "llama", vocab_size: int = 512) -> tuple[Path, Path]:
    """Write a tokenizer + target (4 layers) + draft (1 layer) of ``arch`` under root."""
    root = Path(root)
    tok = make_tokenizer(vocab_size)
    vocab = len(tok)
    # seed 1's Phi-3 target writes EOS 4 tokens after the lossless tests' cursor: too short for
    # them to see drafts accepted
    target_seed = 3 if arch == "phi3" else 1
    for name, hidden, layers, seed in (("target", 64, 4, target_seed), ("draft", 32, 1, 2)):
        out = root / name
        if (out / "config.json").exists():
            continue
        model = make_model(arch, vocab, hidden, layers, seed)
        model.save_pretrained(out)
        tok.save_pretrained(out)
    return root / "target", root / "draft"


if __name__ == "__main__":
    print(make_tiny_pair(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "llama"))
