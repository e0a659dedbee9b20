"""GGUF files loaded directly: what a file holds, read from its header without loading it;
whether this llama.cpp can serve it for specd, said in one line when not; and where Ollama keeps
the file of a model it pulled.

The header is read here rather than with the ``gguf`` package's reader, which builds Python
objects for every element of every array (a 152k-token vocabulary is several of them) and
refuses a tensor type its enum does not know, the very case that needs explaining.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

MAGIC = b"GGUF"
SUFFIX = ".gguf"
OLLAMA_PREFIX = "ollama:"
OLLAMA_MODEL_LAYER = "application/vnd.ollama.image.model"
OLLAMA_REGISTRY = "registry.ollama.ai"

# GGUF metadata value types -> struct format of a scalar ("" for string and array, read apart)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class GgufError(ValueError):
    """A file that is not a GGUF specd can serve; the message is one line for the user."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    ggml_type: int
    type_offset: int  # byte offset of the type field in the file (tests rewrite it)


@dataclass
class GgufHeader:
    """A GGUF file's metadata scalars (arrays only by length) and its tensors' names, shapes
    and ggml types."""

    version: int
    metadata: dict[str, object] = field(default_factory=dict)
    array_lengths: dict[str, int] = field(default_factory=dict)
    tensors: list[TensorInfo] = field(default_factory=list)
    value_offsets: dict[str, int] = field(default_factory=dict)  # byte offset of each scalar's value

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def params(self) -> int:
        total = 0
        for tensor in self.tensors:
            count = 1
            for dim in tensor.shape:
                count *= dim
            total += count
        return total

    def type_counts(self) -> dict[str, int]:
        """Tensors per ggml type name, most common first."""
        counts: dict[str, int] = {}
        for tensor in self.tensors:
            name = type_name(tensor.ggml_type)
            counts[name] = counts.get(name, 0) + 1
        return dict(sorted(counts.items(), key=lambda item: -item[1]))


def type_name(ggml_type: int) -> str:
    """A ggml type's name as gguf-py spells it (``Q8_0``), or ``type N`` for one it does not know."""
    try:
        import gguf

        return gguf.GGMLQuantizationType(ggml_type).name
    except (ImportError, ValueError):
        return f"type {ggml_type}"


def file_type_name(header: GgufHeader) -> str:
    """The file's type as its writer declared it (``general.file_type``: ``Q4_K_M``, ``F16``),
    else the most common matrix type."""
    value = header.metadata.get("general.file_type")
    if isinstance(value, int):
        try:
            import gguf

            return gguf.LlamaFileType(value).name.removeprefix("MOSTLY_").removeprefix("ALL_")
        except (ImportError, ValueError):
            pass
    matrices = [t.ggml_type for t in header.tensors if len(t.shape) > 1]
    return type_name(max(set(matrices), key=matrices.count)) if matrices else "unknown"


def read_header(path: str | Path) -> GgufHeader:
    """The header of the GGUF file at ``path``; GgufError when it is not one."""
    path = Path(path)
    try:
        with open(path, "rb") as handle:
            if handle.read(4) != MAGIC:
                raise GgufError(f"{path} is not a GGUF file (no GGUF magic at its start)")
            with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
                return _parse(data)
    except OSError as err:
        raise GgufError(f"cannot read {path}: {err.strerror or err}") from None
    except (struct.error, UnicodeDecodeError, IndexError) as err:
        raise GgufError(f"{path}: a damaged GGUF header ({err})") from None


def _parse(data) -> GgufHeader:
    offset = 4
    version, tensor_count, kv_count = struct.unpack_from("<IQQ", data, offset)
    offset += 20
    if version < 2:
        raise GgufError(f"GGUF version {version}; llama.cpp reads versions 2 and 3")
    header = GgufHeader(version)

    def string(at: int) -> tuple[str, int]:
        (length,) = struct.unpack_from("<Q", data, at)
        return bytes(data[at + 8:at + 8 + length]).decode("utf-8"), at + 8 + length

    def skip(kind: int, at: int, count: int) -> int:
        if kind in _SCALARS:
            return at + struct.calcsize(_SCALARS[kind]) * count
        if kind == _STRING:
            for _ in range(count):
                (length,) = struct.unpack_from("<Q", data, at)
                at += 8 + length
            return at
        if kind == _ARRAY:
            for _ in range(count):
                inner, length = struct.unpack_from("<IQ", data, at)
                at = skip(inner, at + 12, length)
            return at
        raise GgufError(f"unknown GGUF metadata type {kind}")

    for _ in range(kv_count):
        key, offset = string(offset)
        (kind,) = struct.unpack_from("<I", data, offset)
        offset += 4
        header.value_offsets[key] = offset
        if kind in _SCALARS:
            (header.metadata[key],) = struct.unpack_from(_SCALARS[kind], data, offset)
            offset += struct.calcsize(_SCALARS[kind])
        elif kind == _STRING:
            header.metadata[key], offset = string(offset)
        elif kind == _ARRAY:
            inner, length = struct.unpack_from("<IQ", data, offset)
            header.array_lengths[key] = length
            offset = skip(inner, offset + 12, length)
        else:
            raise GgufError(f"unknown GGUF metadata type {kind} for {key}")
    for _ in range(tensor_count):
        name, offset = string(offset)
        (dims,) = struct.unpack_from("<I", data, offset)
        shape = struct.unpack_from(f"<{dims}Q", data, offset + 4)
        offset += 4 + 8 * dims
        (ggml_type,) = struct.unpack_from("<I", data, offset)
        header.tensors.append(TensorInfo(name, tuple(shape), ggml_type, offset))
        offset += 4 + 8  # the type, then the data offset
    return header


def is_gguf_name(name: str) -> bool:
    """Whether a ``model.target`` / ``model.draft`` value names a GGUF file (a path ending in
    ``.gguf``) or an Ollama model (``ollama:NAME[:TAG]``)."""
    return name.startswith(OLLAMA_PREFIX) or name.lower().endswith(SUFFIX)


def ollama_models_dir() -> Path:
    """Where Ollama keeps its models: ``$OLLAMA_MODELS``, else ``~/.ollama/models``."""
    configured = os.environ.get("OLLAMA_MODELS")
    return Path(configured).expanduser() if configured else Path.home() / ".ollama" / "models"


def resolve_ollama(name: str, models_dir: Path | None = None) -> Path:
    """The GGUF blob of an Ollama model: ``qwen2.5-coder:1.5b`` (the ``library`` namespace),
    ``user/model:tag`` or ``host/user/model:tag``, tag ``latest`` when none. Its manifest
    (``manifests/<host>/<namespace>/<model>/<tag>``) names the layers by digest; the one of
    media type ``application/vnd.ollama.image.model`` is the weights, ``blobs/sha256-<hex>``."""
    root = models_dir or ollama_models_dir()
    model, _, tag = name.partition(":")
    parts = [p for p in model.split("/") if p]
    if not parts or any(p in (".", "..") for p in parts) or "/" in tag or tag in (".", ".."):
        raise GgufError(f"ollama model {name!r}: expected NAME[:TAG], e.g. qwen2.5-coder:1.5b")
    if len(parts) == 1:
        parts = [OLLAMA_REGISTRY, "library", *parts]
    elif len(parts) == 2:
        parts = [OLLAMA_REGISTRY, *parts]
    manifest = root.joinpath("manifests", *parts, tag or "latest")
    try:
        layers = json.loads(manifest.read_text(encoding="utf-8")).get("layers") or []
    except FileNotFoundError:
        raise GgufError(f"ollama model {name!r} is not pulled here (no manifest {manifest}); "
                        f"`ollama pull {name}` fetches it") from None
    except (OSError, ValueError, AttributeError) as err:
        raise GgufError(f"ollama model {name!r}: unreadable manifest {manifest} ({err})") from None
    digests = [layer.get("digest", "") for layer in layers
               if isinstance(layer, dict) and layer.get("mediaType") == OLLAMA_MODEL_LAYER]
    if not digests:
        raise GgufError(f"ollama model {name!r}: its manifest {manifest} has no model layer")
    algorithm, _, digest = str(digests[0]).partition(":")
    if algorithm != "sha256" or not digest or not all(c in "0123456789abcdef" for c in digest):
        raise GgufError(f"ollama model {name!r}: unexpected layer digest {digests[0]!r}")
    blob = root / "blobs" / f"sha256-{digest}"
    if not blob.is_file():
        raise GgufError(f"ollama model {name!r}: its weights {blob} are missing (pull it again)")
    return blob


def resolve(name: str) -> Path:
    """The GGUF file a model name means: an Ollama model's blob, or the path itself (checked
    to exist)."""
    if name.startswith(OLLAMA_PREFIX):
        return resolve_ollama(name[len(OLLAMA_PREFIX):])
    path = Path(name).expanduser()
    if not path.is_file():
        raise GgufError(f"GGUF file {name} does not exist")
    return path
