"""Conversations in, token ids and loss masks out; regeneration of responses by the target.

Formats read by ``load_conversations`` (JSONL, a JSON array or a single JSON object, parquet,
a ``datasets.save_to_disk`` folder, or a Hugging Face hub name with ``vatspec[hub]``):

    ShareGPT  {"id": .., "conversations": [{"from": "human"|"gpt"|"system", "value": ..}, ..]}
    OpenAI    {"id": .., "messages": [{"role": "user"|"assistant"|"system", "content": ..}, ..]}
    Alpaca    {"instruction": .., "input": .., "output": ..}
    prompt    {"prompt": .., "response": ..}          (response optional)

Loss-mask convention: ``Example.loss_mask[t]`` is True when ``input_ids[t]`` is a supervised
assistant token, i.e. a prediction *target* (the model predicts it from positions ``< t``).
Masked in: the assistant content and the end-of-turn token right after it. Masked out: the
system and user turns, the role headers (``<|im_start|>assistant\\n``), whatever the template
puts after the end-of-turn token (``\\n``), and padding.

Example (SmolLM2 / ChatML, one turn):

    <|im_start|>system\\n...<|im_end|>\\n<|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\nHello<|im_end|>\\n
    0 ...                                                                                   1    1          0
"""

from __future__ import annotations

import json
import logging
import os
import random
import time
import zlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

log = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant")
# ShareGPT ``from`` values (and OpenAI roles) -> our roles. Anything else is an error.
_ROLE_MAP = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "model": "assistant",
}


class DataError(ValueError):
    """Bad input data; the message names the file and line (or row) and what was expected."""


# --------------------------------------------------------------------------- types
@dataclass
class Conversation:
    """One conversation: ``messages`` is a list of ``{"role", "content"}`` with role in ROLES.

    A conversation read for training has at least one assistant turn; a prompt (benchmark,
    prompt file) may have none. ``meta`` holds extra fields (category, reference answer, ...).
    """

    id: str
    messages: list[dict[str, str]]
    meta: dict = field(default_factory=dict)

    @property
    def has_assistant(self) -> bool:
        return any(m["role"] == "assistant" for m in self.messages)

    def prompts(self) -> list[str]:
        """The user turns' texts, in order."""
        return [m["content"] for m in self.messages if m["role"] == "user"]

    def to_json(self) -> dict:
        rec = {"id": self.id, "messages": [dict(m) for m in self.messages]}
        if self.meta:
            rec["meta"] = self.meta
        return rec


@dataclass
class Example:
    """A tokenized conversation. ``loss_mask[t]`` True: ``input_ids[t]`` is a supervised target."""

    input_ids: list[int]
    loss_mask: list[bool]
    id: str = ""

    def __post_init__(self):
        if len(self.input_ids) != len(self.loss_mask):
            raise ValueError(f"example {self.id!r}: {len(self.input_ids)} ids but {len(self.loss_mask)} mask bits")

    def __len__(self) -> int:
        return len(self.input_ids)


@dataclass
class Batch:
    """Right-padded batch. input_ids [B, T] long, attention_mask [B, T] long (1 = real token),
    loss_mask [B, T] bool (True = supervised target; always False on padding)."""

    input_ids: Tensor
    attention_mask: Tensor
    loss_mask: Tensor

    def __post_init__(self):
        shape = self.input_ids.shape
        assert self.input_ids.dim() == 2, f"input_ids must be [B, T], got {tuple(shape)}"
        assert self.attention_mask.shape == shape and self.loss_mask.shape == shape, (
            f"attention_mask {tuple(self.attention_mask.shape)} / loss_mask {tuple(self.loss_mask.shape)} "
            f"must match input_ids {tuple(shape)}"
        )

    def to(self, device: str | torch.device, non_blocking: bool = False) -> Batch:
        tensors = (self.input_ids, self.attention_mask, self.loss_mask)
        return Batch(*(t.to(device, non_blocking=non_blocking) for t in tensors))

    @property
    def shape(self) -> torch.Size:
        return self.input_ids.shape


# --------------------------------------------------------------------------- reading
def load_conversations(
    path_or_name: str | os.PathLike, *, skip_bad: bool = False, require_assistant: bool = True
) -> list[Conversation]:
    """Read conversations from a file, a folder, or a hub dataset name (``name`` or ``name:split``).

    Bad records (malformed JSON, unknown role, no assistant turn when ``require_assistant``)
    raise ``DataError`` naming the file and line, or are skipped and counted (one warning with
    the count and the first reason) when ``skip_bad``. A partial last line of a JSONL file (an
    interrupted write) is dropped with a warning. Ids missing from the data are ``<stem>-<n>``;
    repeated ids get a ``#k`` suffix so that ids are unique.
    """
    p = Path(path_or_name)
    if p.is_dir():
        sources = _dir_sources(p)
    elif p.is_file():
        sources = [(str(p), _file_records(p))]
    elif str(path_or_name).startswith((".", "/", "~")) or p.suffix in (".json", ".jsonl", ".parquet", ".gz"):
        raise DataError(f"{path_or_name}: no such file or folder")
    else:
        sources = [(str(path_or_name), _hub_records(str(path_or_name)))]
    convs: list[Conversation] = []
    bad: list[str] = []
    seen: dict[str, int] = {}
    for where, records in sources:
        stem = Path(where).stem.replace(".", "_")
        n_before = len(convs) + len(bad)
        for loc, rec in records:
            try:
                if isinstance(rec, DataError):
                    raise rec
                conv = parse_record(rec, f"{where}:{loc}", default_id=f"{stem}-{str(loc).split()[-1]}")
                if require_assistant and not conv.has_assistant:
                    raise DataError(f"{where}:{loc}: conversation {conv.id!r} has no assistant turn")
            except DataError as e:
                if not skip_bad:
                    raise
                bad.append(str(e))
                continue
            k = seen.get(conv.id, 0)
            seen[conv.id] = k + 1
            if k:
                conv.id = f"{conv.id}#{k}"
            convs.append(conv)
        if len(convs) + len(bad) == n_before:
            raise DataError(f"{where}: empty: no records found")
    if bad:
        log.warning("skipped %d bad records (first: %s)", len(bad), bad[0])
    if not convs:
        raise DataError(f"{path_or_name}: no valid conversations ({len(bad)} skipped)")
    return convs


def parse_record(rec: object, where: str, default_id: str = "") -> Conversation:
    """One record in any supported format -> Conversation. ``where`` is ``file:line`` for errors."""
    if not isinstance(rec, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(rec).__name__}")
    rid = next((rec[k] for k in ("id", "question_id", "task_id") if rec.get(k) is not None), default_id)
    meta = rec.get("meta") if isinstance(rec.get("meta"), dict) else {}
    turns = rec.get("conversations", rec.get("conversation"))
    if turns is None and "messages" in rec:
        turns = rec["messages"]
    if turns is not None:
        if not isinstance(turns, list):
            raise DataError(f"{where}: 'conversations'/'messages' must be a list, got {type(turns).__name__}")
        msgs = [_parse_turn(t, f"{where}: turn {i}") for i, t in enumerate(turns)]
    elif "instruction" in rec:
        user = _text(rec["instruction"], f"{where}: 'instruction'")
        extra = _text(rec.get("input") or "", f"{where}: 'input'")
        msgs = [{"role": "user", "content": f"{user}\n\n{extra}" if extra else user}]
        if rec.get("output"):
            msgs.append({"role": "assistant", "content": _text(rec["output"], f"{where}: 'output'")})
    elif "prompt" in rec:
        msgs = [{"role": "user", "content": _text(rec["prompt"], f"{where}: 'prompt'")}]
        resp = rec.get("response", rec.get("completion"))
        if resp:
            msgs.append({"role": "assistant", "content": _text(resp, f"{where}: 'response'")})
    else:
        raise DataError(
            f"{where}: unrecognised record with keys {sorted(rec)[:8]}: expected 'conversations' (ShareGPT), "
            "'messages' (OpenAI), 'instruction' (Alpaca) or 'prompt'"
        )
    first_user = next((k for k, m in enumerate(msgs) if m["role"] == "user"), None)
    if first_user is None:
        raise DataError(f"{where}: conversation {rid!r} has no user turn")
    # Assistant turns before the first user turn answer nothing we have: dropped (as FastChat does).
    msgs = [m for k, m in enumerate(msgs) if k > first_user or m["role"] != "assistant"]
    return Conversation(str(rid), msgs, dict(meta))


def _parse_turn(t: object, where: str) -> dict[str, str]:
    if not isinstance(t, dict):
        raise DataError(f"{where}: expected an object with from/value or role/content, got {type(t).__name__}")
    if "from" in t:
        raw, content = t["from"], t.get("value")
    elif "role" in t:
        raw, content = t["role"], t.get("content")
    else:
        raise DataError(f"{where}: message has neither 'from' (ShareGPT) nor 'role' (OpenAI): keys {sorted(t)}")
    role = _ROLE_MAP.get(str(raw).lower()) if isinstance(raw, str) else None
    if role is None:
        raise DataError(f"{where}: unknown role {raw!r}; expected one of {sorted(_ROLE_MAP)}")
    return {"role": role, "content": _text(content, f"{where}: content")}


def _text(x: object, where: str) -> str:
    if isinstance(x, str):
        return x
    if isinstance(x, list):  # OpenAI content parts
        parts = []
        for p in x:
            if isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str):
                parts.append(p["text"])
            else:
                raise DataError(f"{where}: only text content parts are supported, got {p!r:.80}")
        return "".join(parts)
    raise DataError(f"{where}: expected a string, got {type(x).__name__}")


Records = Iterator[tuple[object, object]]  # (line or row, record or DataError)


def _file_records(p: Path) -> Records:
    suffix = "".join(p.suffixes[-2:]) if p.suffix == ".gz" else p.suffix
    if suffix == ".parquet":
        return _parquet_records(p)
    if suffix in (".jsonl", ".jsonl.gz"):
        return _jsonl_records(p)
    if suffix in (".json", ".json.gz"):
        with _open_text(p) as f:
            head = f.read(4096).lstrip()
        if head.startswith("["):
            return _json_array_records(p)
        if head.startswith("{"):
            # one object (possibly the whole file), or JSONL saved as .json
            with _open_text(p) as f:
                text = f.read()
            try:
                obj = json.loads(text)
            except json.JSONDecodeError:
                return _jsonl_records(p)
            return iter([(1, obj)])
        return iter([] if not head else [(1, DataError(f"{p}:1: not JSON (expected '[' or '{{')"))])
    raise DataError(f"{p}: unsupported file type {suffix!r}; expected .jsonl, .json, .parquet (optionally .gz)")


def _open_text(p: Path):
    if p.suffix == ".gz":
        import gzip

        return gzip.open(p, "rt", encoding="utf-8")
    return open(p, encoding="utf-8")


def _jsonl_records(p: Path) -> Records:
    with _open_text(p) as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                # A file written record by record ends with "\n": a last line without it is an interrupted write.
                if not line.endswith("\n"):
                    log.warning("%s:%d: dropped a partial last line (an interrupted write?): %.60r", p, i, line)
                    return
                yield i, DataError(f"{p}:{i}: malformed JSON ({e.msg} at column {e.colno})")
                continue
            yield i, rec


def _json_array_records(p: Path) -> Records:
    with _open_text(p) as f:
        yield from iter_json_array(f, str(p))


def iter_json_array(f, where: str, *, tolerate_cut: bool = False, chunk: int = 1 << 20, info: dict | None = None):
    """Stream the items of a JSON array from a text file: yields ``(line, item)``.

    Reads ``chunk`` characters at a time with an incremental decoder, so a large file is never
    held whole. A syntax error raises ``DataError`` with the line, unless the file simply ends
    inside an item and ``tolerate_cut`` (a cut-off file): then the complete items are kept and
    ``info["cut"]`` / ``info["dropped_chars"]`` say what was lost.
    """
    dec = json.JSONDecoder()
    buf, pos, line, eof = "", 0, 1, False
    info = info if info is not None else {}
    info.update(cut=False, dropped_chars=0)

    def fill() -> bool:  # append a chunk; False at end of file
        nonlocal buf, pos, eof
        if eof:
            return False
        more = f.read(chunk)
        eof = not more
        buf, pos = buf[pos:] + more, 0
        return bool(more)

    def skip_ws() -> str:  # next non-space character ("" at end of file), counting lines
        nonlocal pos, line
        while True:
            while pos < len(buf) and buf[pos] in " \t\r\n":
                line += buf[pos] == "\n"
                pos += 1
            if pos < len(buf) or not fill():
                return buf[pos] if pos < len(buf) else ""

    if skip_ws() != "[":
        raise DataError(f"{where}:{line}: expected a JSON array starting with '['")
    pos += 1
    first = True
    while True:
        c = skip_ws()
        if c == "]":
            return
        if not first:
            if c != ",":
                if c == "" and tolerate_cut:
                    info["cut"] = True
                    return
                raise DataError(f"{where}:{line}: expected ',' or ']' between array items, got {c!r}")
            pos += 1
            c = skip_ws()
        if c == "":
            if tolerate_cut:
                info["cut"] = True
                return
            raise DataError(f"{where}:{line}: the file ends inside the array")
        start = line
        while True:
            try:
                obj, end = dec.raw_decode(buf, pos)
                break
            except json.JSONDecodeError as e:
                err = f"{where}:{start + buf.count(chr(10), pos, e.pos)}: malformed JSON ({e.msg})"
                if fill():  # maybe the item only continues in the next chunk
                    continue
                if tolerate_cut:
                    info.update(cut=True, dropped_chars=len(buf) - pos)
                    return
                raise DataError(err) from None
        line += buf.count("\n", pos, end)
        pos = end
        first = False
        yield start, obj


def _parquet_records(p: Path) -> Records:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{p}: reading parquet needs pyarrow; install it with  pip install 'vatspec[hub]'") from None
    for i, row in enumerate(pq.read_table(p).to_pylist()):
        yield f"row {i}", row


def _dir_sources(d: Path) -> list[tuple[str, Records]]:
    if any((d / n).is_file() for n in ("dataset_info.json", "state.json", "dataset_dict.json")):
        return [(str(d), _hf_rows(_import_datasets(str(d)).load_from_disk(str(d)), str(d)))]
    exts = (".parquet", ".jsonl", ".json", ".jsonl.gz", ".json.gz")
    files = sorted(q for q in d.iterdir() if q.is_file() and q.name.endswith(exts))
    if not files:
        raise DataError(f"{d}: a folder with no .jsonl/.json/.parquet files and not a datasets.save_to_disk folder")
    return [(str(q), _file_records(q)) for q in files]


def _import_datasets(what: str):
    try:
        import datasets
    except ImportError:
        raise DataError(
            f"{what!r}: not a local file or folder; reading Hugging Face datasets needs the optional "
            "dependency:  pip install 'vatspec[hub]'"
        ) from None
    return datasets


def _hf_rows(ds, where: str) -> Records:
    if hasattr(ds, "keys") and not hasattr(ds, "features"):  # DatasetDict: take train, or the only split
        splits = list(ds.keys())
        if "train" not in splits and len(splits) != 1:
            raise DataError(f"{where}: several splits {splits} and none named 'train'; name one as NAME:SPLIT")
        ds = ds["train" if "train" in splits else splits[0]]
    for i, row in enumerate(ds):
        yield f"row {i}", row


def _hub_records(name: str) -> Records:
    datasets = _import_datasets(name)
    repo, _, split = name.partition(":")
    try:
        ds = datasets.load_dataset(repo, split=split or "train")
    except Exception as e:  # offline, unknown name, no such split: all say the same to a user
        raise DataError(
            f"{name!r} is not a local file or folder, and loading it from the Hugging Face hub failed "
            f"({type(e).__name__}: {str(e)[:200]}). Without network, pass a local file instead."
        ) from e
    return _hf_rows(ds, name)


# --------------------------------------------------------------------------- tokenizing
def tokenize_conversation(conv: Conversation, tokenizer, max_length: int | None = None) -> Example:
    """Render ``conv`` with the tokenizer's chat template; mask in the assistant tokens only.

    How the mask is found: for each assistant turn i, the template is rendered for messages
    ``[:i]`` with the generation prompt; that text is a prefix of the full rendering, and the
    content starts right after it. Token character offsets then mark the content tokens and the
    end-of-turn special token that follows. The ids equal ``apply_chat_template(tokenize=True)``.
    Templates that rewrite earlier turns (not prefix-stable) or alter the content raise DataError.
    """
    _require_template(tokenizer)
    msgs = conv.messages
    text = tokenizer.apply_chat_template(msgs, tokenize=False)
    spans: list[tuple[int, int]] = []  # [start, end) characters of each assistant content
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        head = tokenizer.apply_chat_template(msgs[:i], tokenize=False, add_generation_prompt=True) if i else ""
        if not text.startswith(head):
            raise DataError(
                f"conversation {conv.id!r}: the chat template is not prefix-stable at message {i} "
                "(rendering the history with a generation prompt is not a prefix of the full rendering)"
            )
        content = m["content"]
        if text.startswith(content, len(head)):
            start, end = len(head), len(head) + len(content)
        else:  # a template that strips the content
            body = content.strip()
            start = text.find(body, len(head))
            if start < 0 or text[len(head) : start].strip():
                raise DataError(
                    f"conversation {conv.id!r}: message {i}: the template does not render the content verbatim"
                )
            end = start + len(body)
        spans.append((start, end))
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids: list[int] = list(enc["input_ids"])
    special = set(tokenizer.all_special_ids)
    mask = [False] * len(ids)
    k = 0  # the assistant span being scanned
    for t, (a, b) in enumerate(enc["offset_mapping"]):
        if k == len(spans):
            break
        s, e = spans[k]
        if a < e:
            mask[t] = b > s  # overlaps the content
            continue
        # the first token after the content: the end-of-turn token when it is a special token
        mask[t] = ids[t] in special
        k += 1
    if max_length is not None:
        ids, mask = ids[:max_length], mask[:max_length]
    return Example(ids, mask, conv.id)


def _require_template(tokenizer) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(
            f"tokenizer {getattr(tokenizer, 'name_or_path', type(tokenizer).__name__)!r} has no chat template; "
            "set tokenizer.chat_template (a Jinja string) before tokenizing conversations"
        )
    if not getattr(tokenizer, "is_fast", False):
        raise DataError("tokenizing conversations needs a fast tokenizer (for character offsets); use_fast=True")


# --------------------------------------------------------------------------- batching
def collate(examples: Sequence[Example], pad_id: int) -> Batch:
    """Right-pad ``examples`` to the longest one -> Batch of [B, T] tensors."""
    if not examples:
        raise ValueError("collate: no examples")
    T = max(len(e) for e in examples)
    B = len(examples)
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, T), dtype=torch.long)
    loss_mask = torch.zeros((B, T), dtype=torch.bool)
    for b, e in enumerate(examples):
        n = len(e)
        input_ids[b, :n] = torch.tensor(e.input_ids, dtype=torch.long)
        attention_mask[b, :n] = 1
        loss_mask[b, :n] = torch.tensor(e.loss_mask, dtype=torch.bool)
    return Batch(input_ids, attention_mask, loss_mask)


class BatchIterator:
    """Deterministic batches over ``examples``; a new seeded shuffle each epoch; resumable.

    ``for batch in it`` yields the rest of the current epoch and moves to the next epoch;
    ``next(it)`` runs forever across epochs. ``state_dict()`` is ``{epoch, index, seed}`` where
    ``index`` counts the batches of this epoch already handed out, so after
    ``load_state_dict`` the next batch is the one that would have followed.
    The order of epoch e is ``randperm(N, seed + e)``, the same on every machine and restart.
    """

    def __init__(
        self,
        examples: Sequence[Example],
        batch_size: int,
        pad_id: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if not examples:
            raise ValueError("BatchIterator: no examples")
        self.examples = examples
        self.batch_size = batch_size
        self.pad_id = pad_id
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.epoch = 0
        self.index = 0
        if len(self) == 0:
            raise ValueError(f"{len(examples)} examples make no full batch of {batch_size} with drop_last")

    def __len__(self) -> int:
        """Batches per epoch."""
        n, bs = len(self.examples), self.batch_size
        return n // bs if self.drop_last else -(-n // bs)

    def order(self, epoch: int) -> list[int]:
        n = len(self.examples)
        if not self.shuffle:
            return list(range(n))
        g = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(n, generator=g).tolist()

    def __next__(self) -> Batch:
        if self.index >= len(self):
            self.epoch, self.index = self.epoch + 1, 0
        order = self.order(self.epoch)
        idx = order[self.index * self.batch_size : (self.index + 1) * self.batch_size]
        self.index += 1
        return collate([self.examples[i] for i in idx], self.pad_id)

    def __iter__(self) -> Iterator[Batch]:
        if self.index >= len(self):
            self.epoch, self.index = self.epoch + 1, 0
        epoch = self.epoch
        while self.epoch == epoch and self.index < len(self):
            yield next(self)
        if self.epoch == epoch:
            self.epoch, self.index = epoch + 1, 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        if state.get("seed", self.seed) != self.seed:
            raise ValueError(f"state was saved with seed {state['seed']}, this iterator has seed {self.seed}")
        self.epoch, self.index = int(state["epoch"]), int(state["index"])


def split_heldout(
    convs: Sequence[Conversation], fraction_or_n: float | int, seed: int = 0
) -> tuple[list[Conversation], list[Conversation]]:
    """Deterministic split -> ``(train, heldout)``, each in the input order.

    ``fraction_or_n``: a float in (0, 1) is a fraction (rounded, at least 1), an int is a count.
    """
    n = len(convs)
    if isinstance(fraction_or_n, float) and not isinstance(fraction_or_n, bool):
        if not 0.0 < fraction_or_n < 1.0:
            raise ValueError(f"held-out fraction must be in (0, 1), got {fraction_or_n}")
        k = max(1, round(n * fraction_or_n))
    else:
        k = int(fraction_or_n)
    if not 0 <= k <= n:
        raise ValueError(f"cannot hold out {k} of {n} conversations")
    held = set(random.Random(seed).sample(range(n), k))
    return [c for i, c in enumerate(convs) if i not in held], [c for i, c in enumerate(convs) if i in held]


def token_counts(examples: Iterable[Example], vocab_size: int) -> Tensor:
    """Counts ``[V]`` long of the supervised target tokens (``loss_mask`` True) over ``examples``."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for e in examples:
        ids = torch.tensor([t for t, m in zip(e.input_ids, e.loss_mask) if m], dtype=torch.long)
        if ids.numel() == 0:
            continue
        if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
            raise ValueError(f"example {e.id!r}: token id out of range for vocab_size {vocab_size}")
        counts += torch.bincount(ids, minlength=vocab_size)
    return counts


# --------------------------------------------------------------------------- regeneration
@dataclass
class RegenStats:
    conversations: int = 0  # written in this run
    skipped_done: int = 0  # already in the output file (resume)
    too_long: int = 0  # first prompt over max_prompt_tokens: not written
    turns: int = 0  # assistant turns generated
    new_tokens: int = 0  # generated tokens, end-of-turn token included
    truncated_turns: int = 0  # stopped at max_new_tokens without an end-of-turn token
    seconds: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0


def regenerate(
    convs: Sequence[Conversation],
    target,
    out_path: str | os.PathLike,
    *,
    batch_size: int = 8,
    max_new_tokens: int = 512,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    max_prompt_tokens: int = 2048,
    progress: bool = True,
) -> RegenStats:
    """Replace each assistant turn by the target's own response; append records to ``out_path``.

    Every user turn gets one response, generated from the regenerated history (the original
    assistant turns are dropped; a prompt-only conversation gets a response per user turn).
    Greedy when ``temperature == 0``. Generation stops at any ``target.eos_token_ids`` (the
    end token is not kept in the text) or after ``max_new_tokens`` (counted in
    ``truncated_turns``). A conversation stops at the first round whose prompt exceeds
    ``max_prompt_tokens``; if that is the first round it is not written (``too_long``).

    Resumable: each finished conversation is appended as one JSON line (flush + fsync); a
    restart skips ids already in the file, after cutting off a partial last line.
    Conversations are batched ``batch_size`` at a time with left padding, longest prompts first.
    """
    from tqdm.auto import tqdm

    tok = target.tokenizer
    _require_template(tok)
    ids = [c.id for c in convs]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise DataError(f"regenerate: conversation ids must be unique; {dup!r} repeats")
    out_path = Path(out_path)
    done = _resume_ids(out_path)
    todo = [c for c in convs if c.id not in done]
    stats = RegenStats(skipped_done=len(convs) - len(todo))
    todo.sort(key=lambda c: -sum(len(m["content"]) for m in c.messages if m["role"] != "assistant"))
    eos = list(target.eos_token_ids)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else eos[0]
    out_path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    bar = tqdm(total=len(todo), unit="conv", desc="regenerate", disable=not progress)
    with open(out_path, "a", encoding="utf-8") as f:
        for b in range(0, len(todo), batch_size):
            chunk = todo[b : b + batch_size]
            torch.manual_seed(zlib.crc32(f"{seed}:{chunk[0].id}".encode()))
            for conv, finishes in _regenerate_batch(chunk, target, eos, pad_id, max_new_tokens, temperature, top_p,
                                                    max_prompt_tokens, stats):
                if not finishes:
                    stats.too_long += 1
                    continue
                meta = dict(conv.meta, finish=finishes)
                rec = Conversation(conv.id, conv.messages, meta).to_json()
                f.write(json.dumps(rec, ensure_ascii=False) + "\n")
                f.flush()
                os.fsync(f.fileno())
                stats.conversations += 1
            stats.seconds = time.perf_counter() - t0
            bar.update(len(chunk))
            bar.set_postfix(tok_s=f"{stats.tokens_per_s:.1f}", tokens=stats.new_tokens)
    bar.close()
    stats.seconds = time.perf_counter() - t0
    return stats


def _regenerate_batch(convs, target, eos, pad_id, max_new_tokens, temperature, top_p, max_prompt_tokens, stats):
    """Run the rounds of a batch together; yields ``(conversation, finish reasons)`` per input."""
    from transformers import GenerationConfig

    tok = target.tokenizer
    gen_cfg = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=temperature > 0,
        temperature=temperature if temperature > 0 else None,
        top_p=top_p if temperature > 0 else None,
        top_k=None,
        eos_token_id=eos,
        pad_token_id=pad_id,
    )
    pending = [[m for m in c.messages if m["role"] != "assistant"] for c in convs]
    history: list[list[dict]] = [[] for _ in convs]
    finishes: list[list[str]] = [[] for _ in convs]
    stopped = [False] * len(convs)
    while True:
        # 1. advance each conversation to its next user turn
        rows, prompts = [], []
        for j, msgs in enumerate(pending):
            while msgs and not stopped[j]:
                m = msgs.pop(0)
                history[j].append(m)
                if m["role"] == "user":
                    text = tok.apply_chat_template(history[j], tokenize=False, add_generation_prompt=True)
                    p = tok(text, add_special_tokens=False)["input_ids"]
                    if len(p) > max_prompt_tokens:
                        history[j].pop()
                        stopped[j] = True
                        break
                    rows.append(j)
                    prompts.append(p)
                    break
        if not rows:
            break
        # 2. left-pad and generate
        T = max(len(p) for p in prompts)
        input_ids = torch.full((len(rows), T), pad_id, dtype=torch.long)
        attn = torch.zeros((len(rows), T), dtype=torch.long)
        for r, p in enumerate(prompts):
            input_ids[r, T - len(p) :] = torch.tensor(p)
            attn[r, T - len(p) :] = 1
        with torch.no_grad():
            out = target.model.generate(
                input_ids=input_ids.to(target.device), attention_mask=attn.to(target.device), generation_config=gen_cfg
            )
        # 3. cut each row at its first end token; the text excludes it
        for r, j in enumerate(rows):
            new = out[r, T:].tolist()
            stop = next((k for k, t in enumerate(new) if t in eos), None)
            finishes[j].append("length" if stop is None else "stop")
            stats.truncated_turns += stop is None
            kept = new if stop is None else new[:stop]
            stats.new_tokens += len(kept) + (stop is not None)
            stats.turns += 1
            history[j].append({"role": "assistant", "content": tok.decode(kept, skip_special_tokens=False)})
    for j, conv in enumerate(convs):
        # trailing system turns after the last user turn carry nothing to train on
        while history[j] and history[j][-1]["role"] != "assistant":
            history[j].pop()
        yield Conversation(conv.id, history[j], conv.meta), finishes[j]


def _resume_ids(path: Path) -> set[str]:
    """Ids already written to ``path``; cuts off a partial last line left by an interrupted run."""
    if not path.is_file():
        return set()
    with open(path, "rb+") as f:
        data = f.read()
        keep = data.rfind(b"\n") + 1
        if keep < len(data):
            log.warning("%s: cut off a partial last line (%d bytes) from an interrupted run", path, len(data) - keep)
            f.truncate(keep)
    done = set()
    for i, line in enumerate(data[:keep].decode("utf-8").split("\n"), 1):
        if line.strip():
            try:
                done.add(str(json.loads(line)["id"]))
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise DataError(f"{path}:{i}: not a regenerated record ({e}); refusing to append to it") from None
    return done

