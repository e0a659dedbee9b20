"""The lean batch-1 forward (specd.engine.forward.lean) computes what HF computes, for every model
type its family registry serves (``SUPPORTED_MODEL_TYPES``: each one is a case here, read from the
registry, beside the variants below): logits equal to HF's DynamicCache path through prefill,
decode and verify widths, rollback and re-extension; greedy generation equals ``model.generate``;
the static cache grows, rolls back by length and survives a failed forward; models it cannot
serve exactly are named with a reason; the registry is the one list of what it serves."""

from __future__ import annotations

import functools
import inspect
import types

import pytest
import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    GemmaConfig,
    GPT2Config,
    GPTBigCodeConfig,
    GPTNeoXConfig,
    GraniteConfig,
    LlamaConfig,
    MistralConfig,
    OPTConfig,
    Phi3Config,
    PhiConfig,
    Qwen2Config,
    Qwen3Config,
    StableLmConfig,
    Starcoder2Config,
)
from transformers.pytorch_utils import Conv1D

from specd.engine import compat
from specd.engine.speculation.verify import verify, verify_greedy
from specd.engine.speculation.drafters import Draft
from specd.engine.forward.lean import (
    ALL_HOST_ROWS,
    HOST_PROBES,
    HOST_ROWS,
    NO_HOST,
    SUPPORTED_MODEL_TYPES,
    LeanForward,
    StaticCache,
    host_blas,
    projection,
    unsupported_reason,
)
from specd.engine.caches import DenseRows, KVState, LazyRows
from specd.engine.speculation.sampling import SamplingParams
from tiny import make_model

VOCAB = 512
# fp32, relative to the largest logit (these peaked models' logits reach 20-40): float32 rounding
# of sums taken in another order. MKL's order differs between CPUs, buffer alignments and the
# memory layout a product reads (``_Matmul``): 1.1e-5 of the scale at most, measured here.
RTOL = 2e-5
# a prefill wide enough for the causal-kernel path, decode and verify widths, and a second
# prefill piece (wide, after a prefix: an explicit mask), in order
STEPS = (70, 1, 3, 8, 1, 16, 2, 66)


BIASED = ("gpt_neox", "stablelm", "phi", "opt", "seed_oss")  # projections with biases (drawn away from zero in tiny)


def tiny(arch: str, layers: int = 3, seed: int = 1, **overrides) -> torch.nn.Module:
    """A random-weight model of ``arch`` (peaked logits, see tests/tiny.py), built in memory."""
    if arch in ("llama", "qwen2"):
        model = make_model(arch, VOCAB, 64, layers, seed)
        if not overrides:
            return model
        config = model.config.to_dict() | overrides
        config_cls = LlamaConfig if arch == "llama" else Qwen2Config
    elif arch == "opt":  # OPT-125m's shape: learned positions offset by 2, relu, LayerNorms before each block
        config_cls = OPTConfig
        config = dict(vocab_size=VOCAB, hidden_size=64, ffn_dim=128, word_embed_proj_dim=64, num_hidden_layers=layers,
                      num_attention_heads=4, max_position_embeddings=1024, init_std=0.4, pad_token_id=1,
                      bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1) | overrides
    elif arch == "gemma3_text":  # sliding and full layers, each kind turning at its own rotary base
        from transformers import Gemma3TextConfig

        config_cls = Gemma3TextConfig
        config = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=16,
                      query_pre_attn_scalar=24, max_position_embeddings=4096, initializer_range=0.4,
                      layer_types=(["sliding_attention", "full_attention"] * layers)[:layers]) | overrides
    elif arch == "olmo2":  # norms after each branch only, q and k normalised over whole projections
        from transformers import Olmo2Config

        config_cls = Olmo2Config
        config = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                      initializer_range=0.4) | overrides
    elif arch == "gemma2":  # soft-capped attention scores and logits, sliding and full layers
        from transformers import Gemma2Config

        config_cls = Gemma2Config
        config = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=16,
                      query_pre_attn_scalar=24, max_position_embeddings=4096, initializer_range=0.4,
                      attn_logit_softcapping=5.0, final_logit_softcapping=30.0,  # caps that bind here
                      layer_types=(["sliding_attention", "full_attention"] * layers)[:layers]) | overrides
    elif arch == "bloom":  # no lean forward (ALiBi)
        from transformers import BloomConfig

        config_cls = BloomConfig
        config = dict(vocab_size=VOCAB, hidden_size=64, n_layer=layers, n_head=4) | overrides
    elif arch == "gpt_neox":  # Pythia's shape: parallel residual, a quarter of each head rotated
        config_cls = GPTNeoXConfig
        config = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, max_position_embeddings=4096, rotary_pct=0.25,
                      initializer_range=0.4) | overrides
    elif arch in ("gpt2", "gpt_bigcode"):
        config_cls = GPT2Config if arch == "gpt2" else GPTBigCodeConfig
        config = dict(vocab_size=VOCAB, n_embd=64, n_layer=layers, n_head=4, n_positions=1024,
                      initializer_range=0.4, bos_token_id=0, eos_token_id=0) | overrides
    else:  # a model type with no branch of its own (a newly registered family): its config's defaults
        config_cls = {"mistral": MistralConfig, "starcoder2": Starcoder2Config,
                      "qwen3": Qwen3Config, "gemma": GemmaConfig, "granite": GraniteConfig, "phi3": Phi3Config,
                      "stablelm": StableLmConfig, "phi": PhiConfig}.get(arch)
        if config_cls is None:
            def config_cls(**config):
                return AutoConfig.for_model(arch, **config)
        common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                      sliding_window=None, initializer_range=0.4)
        if arch == "qwen3":
            common |= dict(head_dim=24)  # Qwen3's heads need not split the hidden size
        elif arch == "seed_oss":
            # Not its config's 128 (Seed-OSS-36B's): 4 such heads on a 64-wide model sum over 512
            # values into o_proj, and transformers' own float32 logits then stray from a float64
            # run by 1.1-2.4x RTOL (seeds 1-5), so lean vs transformers crossed RTOL by chance.
            # 24 still does not split the hidden size.
            common |= dict(head_dim=24)
        elif arch == "gemma":
            common |= dict(head_dim=16, hidden_act="gelu_pytorch_tanh")
        elif arch == "granite":  # multipliers away from 1, so the test sees each one applied
            common |= dict(embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.2,
                           logits_scaling=2.5)
        elif arch == "phi3":
            common |= dict(pad_token_id=0)
        elif arch == "phi":  # half of each head rotated, one LayerNorm read by attention and MLP alike
            common |= dict(num_key_value_heads=4, hidden_act="gelu_new")
        elif arch == "stablelm":  # a quarter of each head rotated (StableLM's default), q/k/v biases
            common |= dict(use_qkv_bias=True, bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1)
        config = common | overrides
    torch.manual_seed(seed)
    # layer_types follows the sliding window, except where a test sets it (Gemma 3)
    derived = ("model_type", "architectures") + (() if arch in ("gemma2", "gemma3_text") else ("layer_types",))
    model = AutoModelForCausalLM.from_config(config_cls(**{k: v for k, v in config.items() if k not in derived}))
    # LayerNorm weights start at 1 and biases (norms', and GPT-2's projections') at 0: spread them
    # out, so the test sees every one of them used
    spread = (None if arch in ("llama", "qwen2", "mistral", "bloom") else
              "ln_" if arch in ("gpt2", "gpt_bigcode") else "norm")
    if spread is not None:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if spread in name or (name.endswith("bias") and (spread == "ln_" or arch in BIASED)):
                    # Gemma's norms scale by 1 + weight: their weights lie around 0
                    param.normal_(1.0 if name.endswith("weight") and not arch.startswith("gemma") else 0.0, 0.3)
    return model.eval()


def ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(1, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


def assert_close(lean: torch.Tensor, hf: torch.Tensor, rtol: float = RTOL) -> None:
    assert lean.dtype == torch.float32 and lean.shape == hf.shape
    error, scale = (lean - hf).abs().max().item(), hf.abs().max().item()
    assert error <= rtol * max(scale, 1.0), f"max error {error:.2e} of a {scale:.1f} scale"


def assert_same_logits(lean: torch.Tensor, hf: torch.Tensor) -> None:
    assert_close(lean, hf)
    assert torch.equal(lean.argmax(-1), hf.argmax(-1))


# every model type the registry serves, as its config has it ...
ARCH_CASES = {model_type: functools.partial(tiny, model_type) for model_type in SUPPORTED_MODEL_TYPES}
ARCH_CASES |= {  # ... and the variants within them
    "llama-attention-bias": lambda: tiny("llama", attention_bias=True, mlp_bias=True),
    "llama-rope-linear": lambda: tiny("llama", rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                               "rope_theta": 10000.0}),
    "llama-rope-yarn": lambda: tiny("llama", rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                                             "rope_theta": 10000.0,
                                                             "original_max_position_embeddings": 1024}),
    "qwen2-mha": lambda: tiny("qwen2", num_key_value_heads=4),
    "gpt2-unscaled-by-inverse-layer": lambda: tiny("gpt2", scale_attn_weights=False,
                                                    scale_attn_by_inverse_layer_idx=True),
    "gpt_bigcode-mqa": lambda: tiny("gpt_bigcode", multi_query=True),
    "gpt_bigcode-mha": lambda: tiny("gpt_bigcode", multi_query=False),
    "qwen3-bias": lambda: tiny("qwen3", attention_bias=True),
    "phi3-partial-rotary": lambda: tiny("phi3", rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                                 "partial_rotary_factor": 0.5}),
    "gemma3-softcap": lambda: tiny("gemma3_text", final_logit_softcapping=30.0),
    # sliding windows that bind (StarCoder2's 4,096 of 16,384 positions, Mistral 7B v0.1's)
    "mistral-window": lambda: tiny("mistral", sliding_window=16),
    "qwen2-window": lambda: tiny("qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=1),
    "starcoder2-window": lambda: tiny("starcoder2", sliding_window=24),
    "gpt_neox-sequential-rotary-all": lambda: tiny("gpt_neox", use_parallel_residual=False, rotary_pct=1.0),
}


@pytest.fixture(scope="module", params=sorted(ARCH_CASES))
def model(request):
    return ARCH_CASES[request.param]()


def test_supported_models_have_no_reason(model):
    assert unsupported_reason(model) is None


@pytest.mark.parametrize("transposed", ["on", "off", "numpy"])
def test_logits_equal_hf_through_prefill_decode_verify_and_rollback(model, transposed):
    """"numpy": the transposed weights, with every product of 1-16 rows through numpy's BLAS."""
    lean = LeanForward(model, transposed_weights="off" if transposed == "off" else "on")
    assert (lean.copied_bytes > 0) == (transposed != "off")
    if transposed == "numpy":
        assert lean.host_products("on") == ALL_HOST_ROWS
    cache, hf_cache = lean.new_cache(), compat.new_cache(model)  # rolls back past a binding window too
    for i, width in enumerate(STEPS):
        step = ids(width, seed=i)
        assert_same_logits(lean.forward(step, cache, last_only=False), compat.forward(model, step, hf_cache))
        assert lean.cache_length(cache) == compat.cache_length(hf_cache)
    # a rejected draft: roll both back by 9 tokens, then extend along another path
    held = lean.cache_length(cache) - 9
    lean.crop(cache, held)
    compat.crop_cache(hf_cache, held)
    for i, width in enumerate((5, 1)):
        step = ids(width, seed=100 + i)
        assert_same_logits(lean.forward(step, cache, last_only=False), compat.forward(model, step, hf_cache))
    step = ids(4, seed=200)
    last = lean.forward(step, cache, last_only=True)
    assert last.shape == (1, VOCAB)
    assert_same_logits(last, compat.forward(model, step, hf_cache, last_only=True))


@pytest.mark.parametrize("case", sorted(SUPPORTED_MODEL_TYPES) + ["gpt_bigcode-mqa"])  # gpt_bigcode: without MQA
def test_greedy_generation_equals_generate(case):
    arch, _, variant = case.partition("-")
    model = tiny(arch, layers=2, **({"multi_query": variant == "mqa"} if arch == "gpt_bigcode" else {}))
    prompt = ids(12, seed=7)
    expected = model.generate(prompt, do_sample=False, max_new_tokens=32, pad_token_id=0)[0, prompt.shape[1]:]
    lean = LeanForward(model)
    cache = lean.new_cache()
    logits = lean.forward(prompt, cache, last_only=True)
    out = []
    for _ in range(32):
        out.append(int(logits[-1].argmax()))
        logits = lean.forward(torch.tensor([[out[-1]]]), cache, last_only=True)
    assert len(expected) >= 8, "the tiny model should not stop at once"
    assert out[:len(expected)] == expected.tolist()


@pytest.mark.parametrize("kind", ["linear", "linear-bias", "conv1d"])
@pytest.mark.parametrize("copy", [True, False])
def test_every_product_route_computes_the_module(kind, copy):
    """A product runs as x @ [in, out] (one row, or every row when that is the only layout), as
    (W @ x.T).T (2-8 rows on a CPU) or as F.linear (wider): each equals the module's own output."""
    torch.manual_seed(0)
    module = Conv1D(48, 32) if kind == "conv1d" else torch.nn.Linear(32, 48, bias=kind == "linear-bias")
    with torch.no_grad():
        for param in module.parameters():
            param.normal_()
    product = projection(module, copy)
    assert (product.nbytes_copied() > 0) == copy
    host = product.routed(ALL_HOST_ROWS)  # through numpy's BLAS, where the [in, out] layout is held
    assert (host.host is not None) == (copy or kind == "conv1d")
    for rows in (1, 2, 3, 8, 9, 16, 17, 70):
        x = torch.randn(rows, 32)
        with torch.inference_mode():
            out, out_host = product(x), host(x)
        assert out.shape == out_host.shape == (rows, 48)
        assert_close(out, module(x).detach())
        assert_close(out_host, module(x).detach())


def test_auto_holds_transposed_weights_for_float32_on_a_cpu_only():
    model = tiny("llama", layers=1)
    lean = LeanForward(model)
    weights = sum(p.numel() * p.element_size() for name, p in model.named_parameters()
                  if p.dim() == 2 and "embed" not in name)
    assert lean.copied_bytes == weights  # every projection and the LM head, once more
    assert "transposed" in lean.description
    bf16 = LeanForward(tiny("llama", layers=1).to(torch.bfloat16))
    assert bf16.copied_bytes == 0 and bf16.description == "static KV cache"
    with pytest.raises(ValueError, match="auto, on or off"):
        LeanForward(model, transposed_weights="yes")


def test_host_products_route_as_set_and_measured():
    """numpy_products: "off" routes nothing, "on" every product of 1-16 rows, "auto" what its
    timed forwards chose (one of the four ranges), said in the description; a model held in
    another dtype never takes numpy's route; numpy's BLAS runs on one thread, torch's keep theirs."""
    from threadpoolctl import threadpool_info

    model = tiny("llama", layers=1)
    lean = LeanForward(model)
    threads = torch.get_num_threads()
    assert lean.host_products("off") == NO_HOST and "numpy" not in lean.description
    assert lean.host_products("on") == ALL_HOST_ROWS == frozenset(range(1, HOST_ROWS + 1))
    assert all(m.host_rows == ALL_HOST_ROWS for layer in lean.layers for m in layer.matmuls())
    assert f"products of 1-{HOST_ROWS} rows through numpy's BLAS ({host_blas()})" in lean.description
    assert torch.get_num_threads() == threads
    numpy_blas = [lib for lib in threadpool_info() if lib["user_api"] == "blas" and "numpy" in lib["filepath"]]
    assert numpy_blas and all(lib["num_threads"] == 1 for lib in numpy_blas)
    chosen = lean.host_products("auto", repeats=2)
    # each probe width decides all of its row counts, or none of them
    assert all(set(rows) <= chosen or not set(rows) & chosen for rows in HOST_PROBES.values())
    assert lean.host_rows == chosen and "numpy/torch measured" in lean.description
    assert all(f"at width {width}" in lean.description for width in HOST_PROBES)
    assert LeanForward(tiny("llama", layers=1).to(torch.bfloat16)).host_products("on") == NO_HOST
    with pytest.raises(ValueError, match="auto, on or off"):
        lean.host_products("yes")


def test_rollback_by_length_then_extend_equals_a_fresh_run():
    model = tiny("qwen2")
    lean = LeanForward(model)
    seq = ids(40, seed=1)
    draft = ids(8, seed=2)
    cache = lean.new_cache()
    lean.forward(seq, cache)
    lean.forward(draft, cache)  # verified, then 5 of the 8 draft tokens rejected
    lean.crop(cache, 43)
    assert lean.cache_length(cache) == 43
    extension = ids(6, seed=3)
    after_rollback = lean.forward(extension, cache)

    fresh = lean.new_cache()
    lean.forward(torch.cat([seq, draft[:, :3]], dim=1), fresh)
    assert_close(after_rollback, lean.forward(extension, fresh))


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gpt_bigcode"])
def test_greedy_verification_computes_only_the_rows_it_reads(arch):
    """On a CPU the lean path hands verification its logits row by row (LazyRows): each row is
    the forward's own row, a 7-token draft whose first 2 tokens stand reads 3 rows, and the
    verdict equals verification over every row at once."""
    model = tiny(arch)
    prompt = ids(30, seed=4)[0].tolist()
    lazy, dense = KVState(model, LeanForward(model)), KVState(model, LeanForward(model))
    for state in (lazy, dense):
        state.extend(prompt[:-1])
    expected = dense.extend(prompt[-1:]).argmax(-1).tolist()  # the target's own next token
    dense.rollback(len(prompt) - 1)
    greedy = expected + [int(dense.logits_after(prompt + expected).argmax())]
    draft = Draft(greedy[:2] + ids(5, seed=5)[0].tolist(), "lookup:current")
    if draft.tokens[2] == int(dense.logits_after(prompt + greedy).argmax()):
        draft.tokens[2] = (draft.tokens[2] + 1) % VOCAB  # make the third token a rejection
    dense.rollback(len(prompt) - 1)

    rows = lazy.extend_rows([prompt[-1], *draft.tokens])
    assert isinstance(rows, LazyRows) and rows.computed == 0
    n, own = verify_greedy(rows, draft, [])
    assert rows.computed == n + 1 == 3
    logits = dense.extend([prompt[-1], *draft.tokens])
    assert (n, own) == verify(logits, draft, SamplingParams(0.0), None)
    for i in range(len(draft) + 1):
        assert_close(rows.row(i), logits[i])
    assert rows.computed == len(draft) + 1 and rows.head_ms > 0


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_dense_rows_argmaxes_read_once_on_a_gpu_row_by_row_on_a_cpu(device):
    """Rows that came with the forward (every path on a GPU) answer greedy verification on a GPU
    from one argmax of all rows, read once (each row's own read would be a device sync), on a
    CPU row by row (a verify reads few of its rows); the lowest index wins a tie either way."""
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(0))
    logits[2, 7] = logits[2, 9] = logits[2].max() + 1  # a tie
    rows = DenseRows(logits)
    reads = []
    real = logits.argmax
    rows.logits = type("Watched", (), {"argmax": lambda _, dim: (reads.append(dim), real(dim))[1],
                                       "__getitem__": lambda _, i: logits[i], "shape": logits.shape,
                                       "device": torch.device(device)})()
    assert [rows.argmax(i) for i in range(6)] == [int(row.argmax()) for row in logits]
    assert reads == ([-1] if device == "cuda" else [])
    assert rows.argmax(2) == 7
    draft = Draft([int(logits[0].argmax()), int(logits[1].argmax()), 3], "lookup:current")  # the third fails
    assert verify_greedy(DenseRows(logits), draft, []) == (2, 7) == verify(logits, draft, SamplingParams(0.0), None)


def test_capacity_doubles_and_keeps_what_it_holds():
    model = tiny("llama", max_position_embeddings=96)
    lean = LeanForward(model)
    cache, hf_cache = lean.new_cache(capacity=8), compat.new_cache(model)
    assert cache.capacity == 8
    bytes_per_slot = lean.nbytes(cache) // 8
    capacities = []
    for i, width in enumerate((5, 1, 4, 9, 1, 30, 40)):  # 90 positions: 8 -> 16 -> 32 -> 64 -> 96
        step = ids(width, seed=i)
        assert_same_logits(lean.forward(step, cache), compat.forward(model, step, hf_cache))
        capacities.append(cache.capacity)
    assert capacities == [8, 8, 16, 32, 32, 64, 96]
    assert lean.nbytes(cache) == 96 * bytes_per_slot
    # past max_position_embeddings (as HF allows): the cache grows exactly as far as needed
    step = ids(10, seed=9)
    assert_same_logits(lean.forward(step, cache), compat.forward(model, step, hf_cache))
    assert cache.capacity == 100 and lean.cache_length(cache) == 100


def test_a_forward_failing_midway_leaves_the_cache_length_unchanged(monkeypatch):
    model = tiny("llama")
    lean = LeanForward(model)
    seq = ids(20, seed=1)
    cache = lean.new_cache(capacity=16)
    lean.forward(seq[:, :12], cache)
    real_layer = lean._decoder_layer
    calls = []

    def failing_layer(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # the second layer: the first has already written its K/V slots
            raise RuntimeError("injected fault")
        return real_layer(*args, **kwargs)

    monkeypatch.setattr(lean, "_decoder_layer", failing_layer)
    with pytest.raises(RuntimeError, match="injected fault"):
        lean.forward(seq[:, 12:], cache)  # also grew the cache past its 16 slots
    assert lean.cache_length(cache) == 12
    monkeypatch.undo()

    # the garbage written past the length is harmless: the retry equals a fresh run
    retried = lean.forward(seq[:, 12:], cache)
    assert_close(retried, lean.forward(seq, lean.new_cache())[12:])


def test_crop_cannot_grow_a_cache_and_a_forward_needs_a_token():
    lean = LeanForward(tiny("llama", layers=1))
    cache = lean.new_cache()
    lean.forward(ids(4, seed=0), cache)
    with pytest.raises(ValueError):
        lean.crop(cache, 5)
    with pytest.raises(ValueError):
        lean.forward(torch.zeros(1, 0, dtype=torch.long), cache)
    assert lean.cache_length(cache) == 4
    lean.crop(cache, 0)
    assert lean.cache_length(cache) == 0 and isinstance(cache, StaticCache)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "gemma", "granite", "olmo2"])
def test_bfloat16_follows_hf_rounding(arch):
    """Qwen3's head norms and Gemma's norms round as HF's do in bf16 (statistics in float32, and
    Gemma's (1 + weight) product before the cast). OLMo 2 normalises each branch's output, which
    magnifies a one-ulp difference of a small attention output (SDPA's grouping of the queries
    rounds otherwise than transformers'): its layer outputs part by 1-2 bf16 ulps, its logits
    by up to 1.3% of their range here, every argmax equal."""
    tolerance = 0.02 if arch == "olmo2" else 0.01
    model = tiny(arch).to(torch.bfloat16)
    lean = LeanForward(model)
    cache, hf_cache = lean.new_cache(), compat.new_cache(model)
    assert cache.kv[0].dtype == torch.bfloat16
    for i, width in enumerate((70, 1, 8)):
        step = ids(width, seed=i)
        mine, theirs = lean.forward(step, cache), compat.forward(model, step, hf_cache)
        # the same ops in the same dtype as HF's modules: equal today, a few bf16 ulps at most
        assert (mine - theirs).abs().max() <= tolerance * theirs.abs().max()
        assert torch.equal(mine.argmax(-1), theirs.argmax(-1))


def test_a_sliding_window_wider_than_the_positions_is_served_and_applied_beyond_them():
    # The window never binds inside max_position_embeddings, so the model is supported; past
    # them (HF runs on) the lean path applies the window exactly as HF does.
    model = tiny("mistral", sliding_window=24, max_position_embeddings=24)
    assert unsupported_reason(model) is None
    lean = LeanForward(model)
    cache, hf_cache = lean.new_cache(), compat.new_cache(model)
    for i, width in enumerate((20, 1, 8, 1, 12, 3, 70)):
        step = ids(width, seed=i)
        assert_same_logits(lean.forward(step, cache), compat.forward(model, step, hf_cache))


@pytest.mark.parametrize(("make", "words"), [
    (lambda: tiny("bloom"), "model type 'bloom'"),
    (lambda: tiny("gpt2", reorder_and_upcast_attn=True), "reorder_and_upcast_attn"),
    (lambda: tiny("gpt2", activation_function="gelu_fast"), "activation 'gelu_fast'"),
    (lambda: tiny("gpt_bigcode", add_cross_attention=True, multi_query=False), "cross-attention"),
    (lambda: tiny("gpt2").transformer, "no LM head"),
    (lambda: tiny("llama", rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}),
     "rope type 'dynamic'"),
    (lambda: tiny("llama", hidden_act="quick_gelu"), "activation 'quick_gelu'"),
    (lambda: tiny("llama").train(), "training"),
    (lambda: tiny("qwen2").model, "no LM head"),
    (lambda: tiny("gpt_neox", hidden_act="quick_gelu"), "activation 'quick_gelu'"),
    (lambda: tiny("opt", do_layer_norm_before=False), "do_layer_norm_before"),
    (lambda: tiny("opt", word_embed_proj_dim=32), "projected"),
    (lambda: tiny("stablelm", qk_layernorm=True), "qk_layernorm"),
    (lambda: tiny("phi", qk_layernorm=True), "qk_layernorm"),
    (lambda: tiny("gemma3_text", use_bidirectional_attention=True), "bidirectional"),
    (lambda: tiny("stablelm", use_parallel_residual=True), "parallel residual"),
    (lambda: tiny("gpt_neox").gpt_neox, "no LM head"),
])
def test_unsupported_models_say_why(make, words):
    model = make()
    reason = unsupported_reason(model)
    assert reason is not None and words in reason and "\n" not in reason
    with pytest.raises(ValueError, match="no lean forward"):
        LeanForward(model)


def test_demo_target_matches_hf():
    from specd.demo import demo_pair_paths

    paths = demo_pair_paths()
    assert paths is not None, "the shipped demo pair is missing"
    model = AutoModelForCausalLM.from_pretrained(paths[0], dtype=torch.float32).eval()
    assert unsupported_reason(model) is None
    lean = LeanForward(model)
    cache, hf_cache = lean.new_cache(), compat.new_cache(model)
    vocab = model.config.vocab_size
    for i, width in enumerate((300, 1, 8, 1)):
        step = torch.randint(0, vocab, (1, width), generator=torch.Generator().manual_seed(i))
        assert_same_logits(lean.forward(step, cache), compat.forward(model, step, hf_cache))


def test_the_family_registry_is_the_one_list_of_what_the_lean_forward_serves():
    """Every registered model type belongs to exactly one family module, and each module offers
    the family interface (model types -> transformers package, the decoder's attribute,
    ``reason(model)``, ``describe(model, copy)``); every one is a case of the tests above; a
    model type outside the registry has no lean forward, and the reason lists the registry's."""
    from specd.engine.forward.lean.families import BY_MODEL_TYPE, FAMILIES

    registered = []
    for family in FAMILIES:
        assert isinstance(family, types.ModuleType)
        assert family.__name__.startswith("specd.engine.forward.lean.families.")
        assert family.MODEL_TYPES and all(isinstance(package, str) for package in family.MODEL_TYPES.values())
        assert isinstance(family.BODY, str)
        assert list(inspect.signature(family.reason).parameters) == ["model"]
        assert list(inspect.signature(family.describe).parameters) == ["model", "copy"]
        registered += list(family.MODEL_TYPES)
        assert all(BY_MODEL_TYPE[model_type] is family for model_type in family.MODEL_TYPES)
    assert len(registered) == len(set(registered)) and tuple(registered) == SUPPORTED_MODEL_TYPES
    assert set(SUPPORTED_MODEL_TYPES) <= set(ARCH_CASES)
    model = tiny("bloom")
    assert model.config.model_type not in BY_MODEL_TYPE
    assert unsupported_reason(model) == (f"model type 'bloom' has no lean forward "
                                         f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")


def test_every_forward_path_declares_every_capability():
    """transformers', the lean and llama.cpp's forward paths each declare every member of
    ``ForwardPath`` (the lean path its own, the others ``BasicPath``'s "not here"), so a
    capability read by name is never a silent default."""
    from specd.engine.forward.llamacpp import LlamaCppForward
    from specd.engine.forward.path import BasicPath, ForwardPath
    from specd.engine.forward.transformers import HFForward

    model = tiny("llama", layers=1)
    lean, hf = LeanForward(model), HFForward(model)
    assert isinstance(lean, ForwardPath) and isinstance(hf, ForwardPath)
    assert not isinstance(lean, BasicPath) and issubclass(LlamaCppForward, BasicPath)
    assert (lean.lazy_head, lean.rows_from, lean.trees, lean.replays, lean.recordings) == (True, False, True, False, 0)
    assert (hf.lazy_head, hf.rows_from, hf.trees, hf.replays, hf.recordings, hf.description) == \
        (False, False, False, False, 0, "")
    assert (LlamaCppForward.lazy_head, LlamaCppForward.rows_from, LlamaCppForward.trees, LlamaCppForward.host_ids) \
        == (False, True, False, True)
    assert not lean.host_ids and not hf.host_ids
    with pytest.raises(TypeError, match="no host ids"):
        hf.forward_ids([1], hf.new_cache())
    assert hf.prepare(hf.new_cache(), 16) == 0
    with pytest.raises(TypeError, match="no token trees"):
        hf.keep(hf.new_cache(), 0, [])
