"""Loading a target + draft pair through AutoModelForCausalLM / AutoTokenizer, the tokenizer
once, and what each step of the load took; or a pair of GGUF files, run by llama.cpp with its
own tokenizer (``load_gguf_pair``)."""

from __future__ import annotations

import copy
import hashlib
import logging
import os
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from specd.engine.options import context_window
from specd.engine.types import ModelLoadError, UnsupportedModel
from specd.llamacpp.gguf import is_gguf_name

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from specd.llamacpp.model import GgufModel

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# The files a Hugging Face tokenizer is read from (any class, fast or slow). Two folders whose
# copies of these are byte-identical hold the same tokenizer; remote code (``tokenization_*.py``)
# counts too.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model",
    "tiktoken.model", "qwen.tiktoken",
)


class StartupTimes:
    """Seconds spent per step of a start-up, in the order they ran (a step run twice adds up)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def step(self, name: str):
        started = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - started)

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def total(self) -> float:
        return sum(self.seconds.values())

    def describe(self) -> str:
        """One line: ``tokenizer 0.41 s, target model 0.20 s, ...``."""
        return ", ".join(f"{name} {seconds:.2f} s" for name, seconds in self.seconds.items())


@dataclass
class ModelPair:
    """The loaded pair. Each model is a transformers module, or a ``GgufModel`` (a GGUF file:
    no module, llama.cpp's forward runs it; ``gguf``)."""

    target: PreTrainedModel | "GgufModel"
    draft: PreTrainedModel | "GgufModel" | None
    tokenizer: object
    target_name: str
    draft_name: str | None
    device: torch.device
    dtype: torch.dtype
    tokenizer_hash: str | None = None  # ``tokenizer_fingerprint`` of the target's files; None: unknown
    startup: StartupTimes = field(default_factory=StartupTimes)
    _description: dict | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def gguf(self) -> bool:
        """Whether the pair is GGUF files (then both models are ``GgufModel``s)."""
        return is_gguf(self.target)

    def vocab_size(self) -> int:
        """Rows of the target's logits."""
        return output_rows(self.target)

    def input_vocab(self) -> int:
        """Token ids every model of the pair embeds: the smaller embedding's rows."""
        return min(m.vocab_size if is_gguf(m) else m.config.vocab_size if is_head(m) else
                   m.get_input_embeddings().weight.shape[0] for m in (self.target, self.draft) if m is not None)

    def window(self) -> int | None:
        """Positions the target attends to (``options.context_window``; a GGUF file's trained
        context length)."""
        if is_gguf(self.target):
            return self.target.context_length
        return context_window(self.target_name, self.target.config)

    def describe(self) -> dict:
        """Names, device, dtype and parameter counts (counted once: ``status`` asks often, and a
        count walks every parameter); a fresh copy each time, for callers to add to."""
        if self._description is None:
            self._description = self._describe()
        return copy.deepcopy(self._description)

    def _describe(self) -> dict:
        def params(model):
            if model is None:
                return 0
            return model.params if is_gguf(model) else sum(p.numel() for p in model.parameters())
        dtype = f"gguf {self.target.file_type}" if self.gguf else str(self.dtype).removeprefix("torch.")
        info = {
            "target": self.target_name,
            "draft": self.draft_name,
            "device": str(self.device),
            "dtype": dtype,
            "target_params": params(self.target),
            "draft_params": params(self.draft),
        }
        if self.gguf:
            info["gguf"] = {role: {"file": str(model.path), "type": model.file_type, "architecture": model.architecture}
                            for role, model in (("target", self.target), ("draft", self.draft)) if model is not None}
        return info


def is_gguf(model) -> bool:
    from specd.llamacpp.model import GgufModel

    return isinstance(model, GgufModel)


def is_head(model) -> bool:
    """Whether ``model`` is a feature head (``specd.engine.feature_head``): a draft that reads the
    target's final hidden states, run by ``head_state.HeadState``."""
    from specd.engine.feature_head import FeatureHead

    return isinstance(model, FeatureHead)


def output_rows(model) -> int:
    """Rows of a model's logits (its output embedding's, or a GGUF file's vocabulary size)."""
    return model.vocab_size if is_gguf(model) else model.get_output_embeddings().weight.shape[0]


def resolve_device(name: str = "auto") -> torch.device:
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        device = torch.device(name)
    except RuntimeError as err:
        raise ModelLoadError(f"model.device: {name!r} is not a torch device ({err})") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"model.device is {name!r} but torch finds no CUDA device")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name != "auto":
        return DTYPES[name]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def _check_source(name: str, role: str) -> None:
    """A path-looking name must exist; hub ids pass through to transformers."""
    looks_local = name.startswith((".", "/", "~")) or os.sep in name.strip("/") and name.count("/") > 1
    path = Path(name).expanduser()
    if looks_local and not path.exists():
        raise ModelLoadError(f"{role} model directory {name} does not exist")
    if path.is_dir() and not (path / "config.json").is_file():
        raise ModelLoadError(f"{role} model directory {name} has no config.json (not a Hugging Face model)")


def _reason(err: Exception) -> str:
    """The first line of a loader's error, with a hint where it asks for remote code."""
    first = str(err).splitlines()[0] if str(err) else type(err).__name__
    if "trust_remote_code" in str(err):
        first += " (specd leaves model.trust_remote_code off; turn it on only for a repo you trust)"
    return first


def stderr_is_terminal() -> bool:
    try:
        return sys.stderr is not None and sys.stderr.isatty()
    except (AttributeError, ValueError, OSError):  # replaced, or closed
        return False


@contextmanager
def _progress_bars_only_on_a_terminal():
    """transformers and the hub draw tqdm bars on stderr while loading. On anything but a
    terminal (the daemon's spawn log, a journal) they are noise, and a write error there (a full
    disk) would fail the load itself, so they are off for the load and restored after."""
    from transformers.utils import logging as hf_logging

    if stderr_is_terminal() or not hf_logging.is_progress_bar_enabled():
        yield
        return
    hf_logging.disable_progress_bar()  # the hub's bars too
    try:
        yield
    finally:
        hf_logging.enable_progress_bar()


def tokenizer_folder(name: str) -> Path | None:
    """The local folder a tokenizer's files are read from: the folder itself, or a hub id's
    snapshot in the local hub cache; None when there is none (not downloaded yet)."""
    path = Path(name).expanduser()
    if path.is_dir():
        return path.resolve()
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name, local_files_only=True)).resolve()
    except Exception:  # an id never downloaded, or not an id at all: no files to read
        return None


def tokenizer_fingerprint(name: str) -> str | None:
    """A hash of the tokenizer files of ``name`` (``TOKENIZER_FILES`` and remote code, by name
    and content), equal for two folders holding the same tokenizer; None when no such file is
    found locally."""
    folder = tokenizer_folder(name)
    if folder is None:
        return None
    files = sorted(p for p in folder.iterdir() if p.is_file() and (
        p.name in TOKENIZER_FILES or p.name.startswith("tokenization") and p.suffix == ".py"))
    if not files:
        return None
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.name.encode() + b"\0")
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def load_tokenizer(name: str, trust_remote_code: bool = False):
    from transformers import AutoTokenizer  # on use: a GGUF pair tokenizes with llama.cpp's

    try:
        with _progress_bars_only_on_a_terminal():
            return AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code)
    except Exception as err:  # transformers raises OSError, ValueError, ... for a bad dir
        raise ModelLoadError(f"cannot load tokenizer from {name}: {_reason(err)}") from None


def load_model(name: str, role: str, device: torch.device, dtype: torch.dtype,
               trust_remote_code: bool = False) -> PreTrainedModel:
    from transformers import AutoModelForCausalLM  # on use: its model machinery takes seconds to import

    _check_source(name, role)
    try:
        with _progress_bars_only_on_a_terminal():
            model = AutoModelForCausalLM.from_pretrained(
                name, dtype=dtype, trust_remote_code=trust_remote_code, use_safetensors=True,
            )
    except Exception as err:
        raise ModelLoadError(f"cannot load {role} model from {name}: {_reason(err)}") from None
    return model.to(device).eval()


def check_same_tokenizer(target_tok, draft_tok, target_name: str, draft_name: str) -> None:
    t_vocab, d_vocab = target_tok.get_vocab(), draft_tok.get_vocab()
    if t_vocab != d_vocab:
        differ = len(set(t_vocab.items()) ^ set(d_vocab.items()))
        raise ModelLoadError(
            f"target {target_name} and draft {draft_name} use different tokenizers "
            f"({len(t_vocab)} vs {len(d_vocab)} tokens, {differ} entries differ); "
            "speculative decoding needs a shared vocabulary"
        )


def load_pair(target: str, draft: str | None, device: str = "auto", dtype: str = "auto",
              trust_remote_code: bool = False) -> ModelPair:
    """The pair, with one tokenizer: the target's. The draft's is loaded only to compare
    vocabularies, and not at all when its tokenizer files are the target's own (the same
    folder, or files of the same content). A target that names a GGUF file (or an Ollama
    model) loads as ``load_gguf_pair`` says."""
    from specd.engine.feature_head import is_feature_head

    head = bool(draft) and is_feature_head(draft)
    if is_gguf_name(target) or (draft and is_gguf_name(draft)):
        if head:
            raise ModelLoadError(f"draft {draft} is a feature head, which reads the target's final hidden states "
                                 f"on torch's forward; the GGUF target {target} runs on llama.cpp's: set "
                                 "engine.forward_backend = \"torch\" to pair them")
        return load_gguf_pair(target, draft, device, dtype)
    times = StartupTimes()
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    _check_source(target, "target")
    with times.step("tokenizer"):
        tokenizer = load_tokenizer(target, trust_remote_code)
        fingerprint = tokenizer_fingerprint(target)
    if draft and not head:
        _check_source(draft, "draft")
        with times.step("draft tokenizer check"):
            if fingerprint is not None and tokenizer_fingerprint(draft) == fingerprint:
                log.info("draft %s has the target's tokenizer files: one tokenizer loaded", draft)
            else:
                check_same_tokenizer(tokenizer, load_tokenizer(draft, trust_remote_code), target, draft)
    log.info("loading target %s on %s (%s)", target, dev, dt)
    with times.step("target model"):
        target_model = load_model(target, "target", dev, dt, trust_remote_code)
    draft_model = None
    if head:
        log.info("loading draft %s (a feature head)", draft)
        with times.step("draft model"):
            draft_model = load_feature_head(draft, target_model, dev)
    elif draft:
        log.info("loading draft %s", draft)
        with times.step("draft model"):
            draft_model = load_model(draft, "draft", dev, dt, trust_remote_code)
    return ModelPair(target_model, draft_model, tokenizer, target, draft or None, dev, dt, fingerprint, times)


def load_feature_head(folder: str, target_model, device: torch.device):
    """The feature head in ``folder``, reading ``target_model``'s input embeddings (shared, not
    copied, where they are float32) and scoring with its LM head's rows (with tied embeddings the
    same tensor); one-line errors for a head trained for another vocabulary."""
    from specd.engine.feature_head import FeatureHead

    embedding = target_model.get_input_embeddings().weight.detach()
    lm_head = target_model.get_output_embeddings().weight.detach()
    try:
        return FeatureHead.load(Path(folder).expanduser(), embedding, lm_head).float().to(device)
    except (ValueError, OSError) as err:
        raise ModelLoadError(f"draft {folder}: {err}") from None


def load_gguf_pair(target: str, draft: str | None, device: str = "auto", dtype: str = "auto") -> ModelPair:
    """A pair of GGUF files (``*.gguf`` paths or ``ollama:NAME``), on the CPU, tokenized by
    llama.cpp (``specd.llamacpp.tokenizer``): no torch weights; the forward is llama.cpp's.
    The draft, if any, must be a GGUF file with the same vocabulary. One-line errors
    (``UnsupportedModel``) for what cannot be served."""
    from specd.llamacpp.gguf import GgufError
    from specd.llamacpp.model import open_gguf
    from specd.llamacpp.runtime import LlamaCppUnavailable

    times = StartupTimes()
    for role, name in (("target", target), ("draft", draft)):
        if name and not is_gguf_name(name):
            raise UnsupportedModel(f"model.{role} {name} is not a GGUF file, but the "
                                   f"{'draft' if role == 'target' else 'target'} is: a pair is two GGUF files, "
                                   "or two transformers models")
    if device not in ("auto", "cpu"):
        raise UnsupportedModel(f"model.device is {device!r}: GGUF models run on llama.cpp's CPU backend (set auto or cpu)")
    if dtype != "auto":
        log.warning("model.dtype %s is ignored for GGUF files: their tensor types are their own", dtype)

    def open_one(name: str, role: str):
        try:
            with times.step(f"{role} model"):
                return open_gguf(name)
        except LlamaCppUnavailable as err:
            raise ModelLoadError(f"{role} model {name}: {err}") from None
        except GgufError as err:
            raise UnsupportedModel(f"{role} model {name}: {err}") from None

    target_model, tokenizer = open_one(target, "target")
    draft_model = None
    if draft:
        draft_model, draft_tokenizer = open_one(draft, "draft")
        with times.step("draft tokenizer check"):
            if draft_tokenizer.fingerprint() != tokenizer.fingerprint():
                raise ModelLoadError(f"target {target} and draft {draft} use different vocabularies "
                                     f"({len(tokenizer)} vs {len(draft_tokenizer)} tokens); speculative decoding "
                                     "needs a shared vocabulary")
    with times.step("tokenizer"):
        fingerprint = tokenizer.fingerprint()
    log.info("loaded target %s (%s)%s", target, target_model.describe(),
             f", draft {draft} ({draft_model.describe()})" if draft_model else "")
    # dtype: the precision of the logits and of the KV cells llama.cpp keeps for specd (f32)
    return ModelPair(target_model, draft_model, tokenizer, target, draft or None, target_model.device,
                     torch.float32, fingerprint, times)
