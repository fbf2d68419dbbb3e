"""The feature-cache format: file names, the manifest, hashes, and the manifest's checks.

A cache folder (docs/features.md is the full specification, written for other tools)::

    manifest.json              what was run and how it is stored (target identity, layer ids,
                               tokenizer / chat-template hashes, dtype, max length, shard table
                               with each file's sha256)
    index.jsonl                one line per conversation, in the data's order:
                               {"id", "shard", "offset", "length", "supervised", "token_hash"}
    shard-00000.safetensors    per token, concatenated over the shard's conversations:
                               input_ids int32 [N], loss_mask uint8 [N],
                               layer.{i} [N, H] for every layer id i, hidden [N, H] (final-normed)

Layer id ``i`` is this project's convention (``vatspec.target``): the output of decoder layer i,
i.e. Hugging Face ``hidden_states[i + 1]``. ``hidden`` is what the lm_head reads, so soft labels
are one matmul at train time (``Target.logits``); logits ``[T, V]`` are never stored.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import torch

FORMAT = "vatspec-features"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
INDEX = "index.jsonl"
IDS_KEY, MASK_KEY, HIDDEN_KEY = "input_ids", "loss_mask", "hidden"
STORAGE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# the arithmetic of the target pass (``train.precision``'s values): fp32 = the target's own dtype, bf16 = under
# bfloat16 autocast, as online training runs it at train.precision=bf16
PRECISIONS = ("fp32", "bf16")
GiB = 1 << 30
# config keys that say nothing about the computation (names, versions, the load dtype, HF flags)
_VOLATILE_CONFIG_KEYS = {"transformers_version", "torch_dtype", "dtype", "name_or_path", "use_cache",
                         "output_hidden_states", "output_attentions", "return_dict", "id2label", "label2id",
                         "tokenizer_class", "architectures"}


class FeatureCacheError(ValueError):
    """A feature cache is missing, incomplete, corrupt, or does not fit the run; the message names
    the file or manifest field and what was expected."""


class CacheWriteError(FeatureCacheError):
    """A cache file could not be written (a full disk, a quota): the shards written before stay."""


def shard_name(k: int) -> str:
    return f"shard-{k:05d}.safetensors"


def layer_key(i: int) -> str:
    return f"layer.{i}"


def storage_dtype(name: str) -> torch.dtype:
    if name not in STORAGE_DTYPES:
        raise FeatureCacheError(f"storage dtype {name!r} is not one of {', '.join(STORAGE_DTYPES)}")
    return STORAGE_DTYPES[name]


def manifest_precision(manifest: dict) -> str:
    """The arithmetic the cache's target pass ran in (the manifest's ``precision``)."""
    if "precision" not in manifest:
        raise FeatureCacheError("the manifest records no precision (an older vatspec wrote it): rebuild the cache "
                                "with vatspec cache-features")
    return manifest["precision"]


def bytes_per_token(num_layers: int, hidden_size: int, dtype: str) -> int:
    """Stored bytes per token: int32 id + uint8 mask + (layers + hidden) rows of ``hidden_size``."""
    item = torch.empty(0, dtype=storage_dtype(dtype)).element_size()
    return 4 + 1 + (num_layers + 1) * hidden_size * item


# ----------------------------------------------------------------------------- hashes
def token_hash(ids: Sequence[int] | np.ndarray | torch.Tensor) -> str:
    """32 hex digits of sha256 over the token ids as int32 little-endian bytes (the index key)."""
    if isinstance(ids, torch.Tensor):
        ids = ids.detach().cpu().numpy()
    return hashlib.sha256(np.asarray(ids, dtype="<i4").tobytes()).hexdigest()[:32]


def text_sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def file_sha256(path: str | Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


_FILE_HASHES: dict[tuple, str] = {}  # (path, size, mtime_ns) -> sha256: the target's weights are hashed once


def _cached_file_sha256(path: Path) -> str:
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _FILE_HASHES:
        _FILE_HASHES[key] = file_sha256(path)
    return _FILE_HASHES[key]


def weights_sha256(target) -> str:
    """The target's weight checksum: sha256 over ``"<sha256>  <file>"`` lines of its weight files
    (``*.safetensors``, else ``*.bin``, sorted by name) when it was loaded from a folder; else over
    the state dict's tensors (name, dtype, shape, bytes) of an in-memory model."""
    folder = Path(target.path) if getattr(target, "path", None) else None
    files = []
    if folder is not None and folder.is_dir():
        files = sorted(folder.glob("*.safetensors")) or sorted(folder.glob("*.bin"))
    h = hashlib.sha256()
    if files:
        for f in files:
            h.update(f"{_cached_file_sha256(f)}  {f.name}\n".encode())
        return h.hexdigest()
    for name, t in sorted(target.model.state_dict().items()):
        t = t.detach().cpu().contiguous()
        h.update(f"{name} {t.dtype} {tuple(t.shape)}\n".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def target_config(target) -> dict:
    """The target's (text) config as plain JSON, without the keys that say nothing about the computation."""
    cfg = target.config.to_dict()
    return {k: v for k, v in sorted(cfg.items()) if not k.startswith("_") and k not in _VOLATILE_CONFIG_KEYS}


def tokenizer_sha256(tokenizer) -> str | None:
    """sha256 of the vocabulary (token -> id, sorted): ids mean the same tokens. None without a vocabulary."""
    if not hasattr(tokenizer, "get_vocab"):
        return None
    vocab = sorted(tokenizer.get_vocab().items())
    return text_sha256(json.dumps(vocab, ensure_ascii=False))


def chat_template_sha256(tokenizer) -> str:
    return text_sha256(getattr(tokenizer, "chat_template", None) or "")


def conversations_sha256(convs: Iterable) -> str:
    """sha256 over the conversations (id, messages and tools, canonical JSON): which data the cache holds."""
    h = hashlib.sha256()
    for c in convs:
        tools = [c.tools] if getattr(c, "tools", None) else []  # none: the hash of a cache made before tools
        h.update(json.dumps([c.id, c.messages, *tools], sort_keys=True, ensure_ascii=False).encode("utf-8"))
        h.update(b"\n")
    return h.hexdigest()


def target_identity(target) -> dict:
    """What the manifest records about the target (``check_target`` compares it)."""
    return {
        "path": str(target.path) if getattr(target, "path", None) else None,
        "config": target_config(target),
        "weights_sha256": weights_sha256(target),
        "num_layers": target.num_layers,
        "hidden_size": target.hidden_size,
        "vocab_size": target.vocab_size,
        "dtype": str(target.dtype).removeprefix("torch."),
    }


# ----------------------------------------------------------------------------- layer ids
def drafter_layer_ids(kind: str, num_target_layers: int, num_draft_layers: int = 1) -> list[int]:
    """A drafter's default target layer ids (this project's convention) for a target of that depth."""
    from vatspec.drafters import DRAFTERS

    if kind not in DRAFTERS:
        raise FeatureCacheError(f"drafter {kind!r} is not one of {', '.join(DRAFTERS)}")
    return DRAFTERS[kind].default_layer_ids(num_target_layers, num_draft_layers)


def config_layer_ids(drafter_cfg, num_target_layers: int) -> list[int]:
    """The layer ids a ``DrafterConfig`` will ask for (its explicit ids, else its kind's default)."""
    if drafter_cfg.target_layer_ids:
        return list(drafter_cfg.target_layer_ids)
    return drafter_layer_ids(drafter_cfg.kind, num_target_layers, drafter_cfg.num_layers)


# ----------------------------------------------------------------------------- manifest
def read_manifest(root: Path) -> dict:
    path = root / MANIFEST
    if not path.is_file():
        raise FeatureCacheError(f"{root}: no {MANIFEST}: not a feature cache (vatspec cache-features writes one)")
    try:
        m = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise FeatureCacheError(f"{root}: {MANIFEST}: unreadable ({e})") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise FeatureCacheError(f"{root}: {MANIFEST}: format is not {FORMAT!r}")
    if m.get("format_version") != FORMAT_VERSION:
        raise FeatureCacheError(f"{root}: {MANIFEST}: format_version {m.get('format_version')} is not {FORMAT_VERSION} "
                                "(written by another vatspec version); rebuild the cache")
    return m


def atomic_write(path: Path, data: bytes) -> None:
    """Write to a temporary name, fsync, rename into place, fsync the folder."""
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    with write_failure(path, tmp):
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    fsync_dir(path.parent)


@contextlib.contextmanager
def write_failure(path: Path, tmp: Path):
    """A failed write (a full disk, a quota) removes its temporary file and is a ``FeatureCacheError`` naming
    ``path``; what was written before stays as it was."""
    from vatspec.outputs import WRITE_ERRORS, write_error

    try:
        yield
    except WRITE_ERRORS as e:
        tmp.unlink(missing_ok=True)
        raise CacheWriteError(f"{path}: could not be written ({write_error(e)}); the partial file is removed, the "
                              "shards written before are kept (rerun to resume)") from e


def fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(root: Path, manifest: dict) -> None:
    atomic_write(root / MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode())


def check_target(manifest: dict, target, *, template=None, what: str = "the run's target") -> None:
    """The cache was written by this target: same weights, same config, tokenizer and chat template, rendered
    with the arguments and date of ``template`` (a ``ChatTemplate``; None: the tokenizer's own, no arguments).
    Config keys present on one side only are ignored (another transformers version may add some)."""
    have = manifest["target"]
    w = weights_sha256(target)
    if have["weights_sha256"] != w:
        raise FeatureCacheError(f"target.weights_sha256 is {have['weights_sha256'][:12]}… in the cache but "
                                f"{w[:12]}… for {what} ({target.path or 'in memory'}): the cache was built for "
                                "another target")
    cfg = target_config(target)
    for k in sorted(set(cfg) & set(have["config"])):
        if json.dumps(cfg[k], sort_keys=True) != json.dumps(have["config"][k], sort_keys=True):
            raise FeatureCacheError(f"target.config.{k} is {have['config'][k]!r} in the cache but {cfg[k]!r} "
                                    f"for {what}: the cache was built for another target")
    tok = target.tokenizer
    tok_sha = tokenizer_sha256(tok)
    if tok_sha is not None:  # a tokenizer-less test target has nothing to compare
        if manifest["tokenizer_sha256"] != tok_sha:
            raise FeatureCacheError(f"tokenizer_sha256 differs from {what}'s tokenizer (another vocabulary)")
        if manifest["chat_template_sha256"] != chat_template_sha256(tok):
            raise FeatureCacheError(f"chat_template_sha256 differs from {what}'s chat template: the cached token "
                                    "ids and loss masks were rendered with another template")
        from vatspec.data.chat import ChatTemplate, format_kwargs

        template = template or ChatTemplate()
        have_kw = format_kwargs(manifest.get("chat_template_kwargs") or {})  # a cache before the field: none
        want_kw = format_kwargs(template.kwargs)
        if have_kw != want_kw:
            raise FeatureCacheError(f"chat_template_kwargs is {have_kw} in the cache but {want_kw} for {what}: the "
                                    "cached sequences were rendered with other template arguments")
        have_date, want_date = manifest.get("chat_template_date"), template.date
        if have_date != want_date and (have_date or want_date):
            raise FeatureCacheError(f"chat_template_date is {have_date} in the cache but {want_date} for {what}: the "
                                    "cached sequences were rendered on another day (pass --chat-template-date "
                                    f"{have_date})")


def check_layers(manifest: dict, layer_ids: Iterable[int], who: str) -> None:
    missing = [i for i in layer_ids if i not in manifest["layer_ids"]]
    if missing:
        raise FeatureCacheError(f"layer_ids {manifest['layer_ids']} do not cover layers {missing} of {who}; "
                                "rebuild the cache with those layers (--layers or --drafter)")


def check_max_length(manifest: dict, max_length: int) -> None:
    if manifest["max_length"] != max_length:
        raise FeatureCacheError(f"max_length is {manifest['max_length']} in the cache but data.max_length="
                                f"{max_length} in the run; rebuild with --max-length {max_length} or set "
                                f"data.max_length={manifest['max_length']}")
