"""A lean batch-1 forward for decoder-only models, on the loaded HF model's own weights.

HF's eager forward spends most of a small model's step outside arithmetic: mask building, the
DynamicCache machinery, module calls and hooks. ``LeanForward`` runs the same maths in a few tensor
ops per layer, after gpt-fast: a static per-document KV cache (rollback moves its length, nothing
is copied), rotary tables computed once, ``scaled_dot_product_attention`` with no mask for one
new token and a causal mask among the new tokens only. It holds the HF modules' parameters
themselves (no copies): it costs no weight memory and reads whatever the model holds.

The modules, by concern:

- ``forward``: ``LeanForward`` (the layer step, the ``ForwardPath`` interface ``KVState`` drives,
  token trees, replayed forwards);
- ``attention``: SDPA over the static cache, soft-capped attention, the masks;
- ``rotary``: rotary tables and the rotation;
- ``cache``: ``StaticCache``;
- ``layers``: the description of a decoder (``Norm``, ``Matmul``, ``Layer``, ``Decoder``) as
  references to the HF modules' parameters;
- ``host``: which few-row products run through numpy's BLAS (timed at load);
- ``families``: one module per model family (its model types, ``reason``, ``describe``),
  registered in one table; ``unsupported_reason(model)`` says, in one line, why a model must
  stay on the HF path.

Numerics follow HF's modules step for step (RMSNorm in float32 and cast back, rotary tables in
float32 cast to the model's dtype, projections, activations and residuals in the model's dtype),
so fp32 logits agree with HF's to float rounding and greedy argmaxes are the same.
"""

from specd.engine.forward.lean.attention import CAUSAL, WIDE
from specd.engine.forward.lean.cache import StaticCache
from specd.engine.forward.lean.families import FAMILIES, SUPPORTED_MODEL_TYPES, unsupported_reason
from specd.engine.forward.lean.forward import INITIAL_CAPACITY, LeanForward
from specd.engine.forward.lean.host import ALL_HOST_ROWS, HOST_PROBES, HOST_ROWS, host_blas, limit_host_threads
from specd.engine.forward.lean.layers import NO_HOST, projection

__all__ = [
    "ALL_HOST_ROWS", "CAUSAL", "FAMILIES", "HOST_PROBES", "HOST_ROWS", "INITIAL_CAPACITY", "NO_HOST",
    "SUPPORTED_MODEL_TYPES", "WIDE", "LeanForward", "StaticCache", "host_blas", "limit_host_threads",
    "projection", "unsupported_reason",
]
