"""Reading conversations: files, folders and Hugging Face datasets -> ``Conversation``.

Formats read by ``load_conversations`` (JSONL, a JSON array or a single JSON object, parquet,
a ``datasets.save_to_disk`` folder, or a Hugging Face hub name with ``vatspec[hub]``):

    ShareGPT  {"id": .., "conversations": [{"from": "human"|"gpt"|"system"|.., "value": ..}, ..], "tools": ..}
    OpenAI    {"id": .., "messages": [{"role": "user"|"assistant"|"system"|"tool", "content": ..}, ..], "tools": ..}
    Alpaca    {"instruction": .., "input": .., "output": ..}
    prompt    {"prompt": .., "response": ..}          (response optional)
    xLAM      {"id": .., "query": .., "tools": "[..]", "answers": "[..]"}

Messages carry what the OpenAI chat format carries: an assistant message its reasoning
(``reasoning_content``) and ``tool_calls``, a ``tool`` message the result of a call; the conversation its
``tools``. The tool-use shapes other than OpenAI's (LLaMA-Factory's ShareGPT ``function_call`` and
``observation`` turns, Hermes ``<tool_call>`` blocks, xLAM) are read in ``tools.py``.

A JSON array is streamed (``iter_json_array``), so a large file is never held whole, and a
cut-off one can still be read up to its last complete item.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant", "tool")
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
    "function_call": "assistant",  # ShareGPT (LLaMA-Factory): the value is the call, as JSON
    "tool": "tool",
    "function": "tool",  # OpenAI's older name
    "observation": "tool",  # ShareGPT (LLaMA-Factory)
    "ipython": "tool",  # Llama 3's
}
# Where an assistant message's reasoning may come from; it is kept as ``reasoning_content``.
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # OpenAI-compatible servers; gpt-oss/HF; vLLM


class DataError(ValueError):
    """Bad input data; the message names the file and line (or row) and what was expected."""


@dataclass
class Conversation:
    """One conversation: ``messages`` is a list of ``{"role", "content"}`` with role in ROLES.

    ``content`` is always a string (``""`` for an assistant message that only calls tools). An assistant
    message may carry ``reasoning_content`` (str), ``tool_calls`` (``[{"id" (if given), "type": "function",
    "function": {"name", "arguments": dict}}]``), and the ids regeneration writes: ``token_ids``,
    ``prompt_token_ids`` (lists of ints), ``stop_token_id`` (int). A tool message carries ``name`` and,
    if given, ``tool_call_id``. ``tools`` are the OpenAI tool schemas the conversation offers.

    A conversation read for training has at least one assistant turn; a prompt (benchmark,
    prompt file) may have none. ``meta`` holds extra fields (category, reference answer, ...).
    """

    id: str
    messages: list[dict]
    meta: dict = field(default_factory=dict)
    tools: list[dict] = field(default_factory=list)

    @property
    def has_assistant(self) -> bool:
        return any(m["role"] == "assistant" for m in self.messages)

    def prompts(self) -> list[str]:
        """The user turns' texts, in order."""
        return [m["content"] for m in self.messages if m["role"] == "user"]

    def to_json(self) -> dict:
        rec = {"id": self.id, "messages": [dict(m) for m in self.messages]}
        if self.tools:
            rec["tools"] = self.tools
        if self.meta:
            rec["meta"] = self.meta
        return rec


def load_conversations(
    path_or_name: str | os.PathLike, *, skip_bad: bool = False, require_assistant: bool = True,
    stats: dict | None = None,
) -> list[Conversation]:
    """Read conversations from a file, a folder, or a hub dataset name (``name`` or ``name:split``).

    Bad records (malformed JSON, unknown role, no assistant turn when ``require_assistant``)
    raise ``DataError`` naming the file and line, or are skipped and counted (one warning with
    the count and the first reason) when ``skip_bad``. A partial last line of a JSONL file (an
    interrupted write) is dropped with a warning. Ids missing from the data are ``<stem>-<n>``;
    repeated ids get a ``#k`` suffix so that ids are unique. ``stats`` (a dict) receives the counts:
    ``records`` read, ``bad`` skipped, ``partial_last_line`` dropped, and the first bad reason.

    A name that looks like a local path (``_looks_local``) and does not exist is a ``DataError`` at
    once; only a name that cannot be a local path is asked of the hub.
    """
    p = Path(path_or_name)
    info = {"partial_last_line": 0}
    if p.is_dir():
        sources = _dir_sources(p, info)
    elif p.is_file():
        sources = [(str(p), _file_records(p, info))]
    elif _looks_local(str(path_or_name)):
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
    if stats is not None:
        stats.update(records=len(convs) + len(bad), bad=len(bad), **info)
        if bad:
            stats["first_bad"] = bad[0]
    if not convs:
        raise DataError(f"{path_or_name}: no valid conversations ({len(bad)} skipped)")
    return convs


def parse_record(rec: object, where: str, default_id: str = "") -> Conversation:
    """One record in any supported format -> Conversation. ``where`` is ``file:line`` for errors."""
    from vatspec.data import tools as tl  # here, not at the top: tools.py raises this module's DataError

    if not isinstance(rec, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(rec).__name__}")
    rid = next((rec[k] for k in ("id", "question_id", "task_id") if rec.get(k) is not None), default_id)
    meta = rec.get("meta") if isinstance(rec.get("meta"), dict) else {}
    tools = tl.tool_schemas(rec.get("tools"), where)
    turns = rec.get("conversations", rec.get("conversation"))
    if turns is None and "messages" in rec:
        turns = rec["messages"]
    at: list[int] = []  # the turn each message was read from (a Hermes tool turn may give several)
    if turns is not None:
        if not isinstance(turns, list):
            raise DataError(f"{where}: 'conversations'/'messages' must be a list, got {type(turns).__name__}")
        msgs = []
        for i, t in enumerate(turns):
            got = _parse_turn(t, f"{where}: turn {i}", hermes=bool(tools))
            msgs += got
            at += [i] * len(got)
            if not tools and got[0]["role"] == "system" and "from" in t and "<tools>" in got[0]["content"]:
                tools = tl.hermes_tools(got[0]["content"], f"{where}: turn {i}")  # the text is kept as it is
    elif "query" in rec and "answers" in rec:  # xLAM
        msgs = [{"role": "user", "content": _text(rec["query"], f"{where}: 'query'")}]
        calls = tl.tool_calls(rec["answers"], where, "answers")
        if calls:
            msgs.append({"role": "assistant", "content": "", "tool_calls": calls})
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
            "'messages' (OpenAI), 'instruction' (Alpaca), 'prompt', or 'query' and 'answers' (xLAM)"
        )
    tl.link_results(msgs, at or list(range(len(msgs))), where)
    first_user = next((k for k, m in enumerate(msgs) if m["role"] == "user"), None)
    if first_user is None:
        raise DataError(f"{where}: conversation {rid!r} has no user turn")
    # Assistant turns before the first user turn answer nothing we have: dropped (as FastChat does), with
    # the results of their tool calls.
    msgs = [m for k, m in enumerate(msgs) if k > first_user or m["role"] not in ("assistant", "tool")]
    return Conversation(str(rid), msgs, dict(meta), tools)


def _parse_turn(t: object, where: str, hermes: bool = False) -> list[dict]:
    """One turn -> its message; a Hermes tool turn with several ``<tool_response>`` blocks gives one each.
    ``hermes``: the conversation has tools, so a ShareGPT assistant turn's ``<tool_call>`` blocks are calls."""
    from vatspec.data import tools as tl

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
    if raw.lower() == "function_call":  # the value is the call(s)
        calls, content = tl.function_call_turn(content, where), ""
    else:
        given = t.get("tool_calls") or t.get("function_call")  # function_call: OpenAI's older single call
        calls = tl.tool_calls([given] if isinstance(given, dict) else given, where) if given else []
    if calls and role != "assistant":
        raise DataError(f"{where}: tool_calls on a {role} message (only assistant messages carry tool calls)")
    if content is None and calls:
        content = ""  # OpenAI's null content beside tool calls
    msg = {"role": role, "content": _text(content, f"{where}: content")}
    if hermes and "from" in t and role == "assistant" and not calls and "<tool_call>" in msg["content"]:
        msg["content"], calls = tl.hermes_calls(msg["content"], where)
    reasoning = _reasoning(t, role, where)
    if reasoning is not None:
        msg["reasoning_content"] = reasoning
    if calls:
        msg["tool_calls"] = calls
    for key, what, ok in _ID_FIELDS:  # written by regenerate: trained as they are
        if key == "stop_token_id" and key in t and t[key] is None and t.get("token_ids") is not None:
            msg[key] = None  # the answer was cut at its length: no stop id is trained after its ids
        elif t.get(key) is not None:
            if role != "assistant" or not ok(t[key]):
                raise DataError(f"{where}: {key} must be {what} on an assistant message")
            msg[key] = t[key]
    if role != "tool":
        return [msg]
    for key in ("name", "tool_call_id"):
        if t.get(key) is not None:
            if not isinstance(t[key], str):
                raise DataError(f"{where}: {key} must be a string, got {t[key]!r:.40}")
            msg[key] = t[key]
    if "from" in t and "<tool_response>" in msg["content"]:  # Hermes
        return [{**msg, "content": r} for r in tl.hermes_responses(msg["content"])]
    return [msg]


def _is_id(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


_ID_FIELDS = (  # (field, what it must be, check): the token ids an assistant message may carry
    ("token_ids", "a list of token ids >= 0", lambda x: isinstance(x, list) and all(map(_is_id, x))),
    ("prompt_token_ids", "a list of token ids >= 0", lambda x: isinstance(x, list) and all(map(_is_id, x))),
    ("stop_token_id", "a token id >= 0", _is_id),
)


def _reasoning(t: dict, role: str, where: str) -> str | None:
    """The turn's reasoning from any of REASONING_FIELDS (None if none); two that differ are an error, and so is
    reasoning on a message other than the assistant's (an empty one there is taken as none)."""
    given = {k: t[k] for k in REASONING_FIELDS if t.get(k) is not None}
    if not given:
        return None
    if role != "assistant":
        key = next((k for k, v in given.items() if v != ""), None)
        if key is None:
            return None
        raise DataError(f"{where}: {key} on a {role} message (only assistant messages carry reasoning)")
    texts = {k: _text(v, f"{where}: {k}") for k, v in given.items()}
    if len(set(texts.values())) > 1:
        raise DataError(f"{where}: {' and '.join(texts)} differ; give the reasoning once")
    return next(iter(texts.values()))


def _text(x: object, where: str) -> str:
    if isinstance(x, list):  # OpenAI content parts
        parts = []
        for p in x:
            if isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str):
                parts.append(p["text"])
            else:
                raise DataError(f"{where}: only text content parts are supported, got {p!r:.80}")
        x = "".join(parts)
    if not isinstance(x, str):
        raise DataError(f"{where}: expected a string, got {type(x).__name__}")
    try:  # a JSON escape of half a surrogate pair ("\ud800") decodes, but no tokenizer can encode it
        x.encode("utf-8")
    except UnicodeEncodeError as e:
        raise DataError(f"{where}: text no tokenizer can encode ({x[e.start]!r} at character {e.start + 1}: "
                        "half of a UTF-16 surrogate pair)") from None
    return x


Records = Iterator[tuple[object, object]]  # (line or row, record or DataError)


DATA_SUFFIXES = (".json", ".jsonl", ".parquet", ".gz")


def _looks_local(name: str) -> bool:
    """A name meant as a local path: it starts with ``.``, ``/`` or ``~``, has a data file suffix, or has
    a folder part that a hub id (``org/name``) cannot have: more than two parts, or a first part that
    is a local folder (``data/trian``)."""
    if name.startswith((".", "/", "~")) or Path(name).suffix in DATA_SUFFIXES:
        return True
    parts = Path(name.partition(":")[0]).parts
    return len(parts) > 2 or (len(parts) == 2 and Path(parts[0]).is_dir()) or os.sep != "/" and os.sep in name


def _file_records(p: Path, info: dict | None = None) -> Records:
    suffix = "".join(p.suffixes[-2:]) if p.suffix == ".gz" else p.suffix
    if suffix == ".parquet":
        return _parquet_records(p)
    if suffix in (".jsonl", ".jsonl.gz"):
        return _jsonl_records(p, info)
    if suffix in (".json", ".json.gz"):
        try:
            with _open_text(p) as f:
                head = f.read(4096).lstrip()
        except UnicodeDecodeError:
            raise DataError(_not_utf8(p)) from None
        if head.startswith("["):
            return _json_array_records(p)
        if head.startswith("{"):
            # one object (possibly the whole file), or JSONL saved as .json
            try:
                with _open_text(p) as f:
                    text = f.read()
            except UnicodeDecodeError:
                raise DataError(_not_utf8(p)) from None
            try:
                obj = json.loads(text)
            except json.JSONDecodeError:
                return _jsonl_records(p, info)
            return iter([(1, obj)])
        return iter([] if not head else [(1, DataError(f"{p}:1: not JSON (expected '[' or '{{')"))])
    raise DataError(f"{p}: unsupported file type {suffix!r}; expected .jsonl, .json, .parquet (optionally .gz)")


def _open_text(p: Path):
    if p.suffix == ".gz":
        import gzip

        return gzip.open(p, "rt", encoding="utf-8")
    return open(p, encoding="utf-8")


def _not_utf8(p: Path) -> str:
    """``FILE:LINE: not UTF-8 text`` for the first line of ``p`` that does not decode."""
    import gzip

    with (gzip.open(p, "rb") if p.suffix == ".gz" else open(p, "rb")) as f:
        for i, raw in enumerate(f, 1):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as e:
                return f"{p}:{i}: not UTF-8 text (byte {raw[e.start]:#04x} at column {e.start + 1})"
    return f"{p}: not UTF-8 text"


def _jsonl_records(p: Path, info: dict | None = None) -> Records:
    import gzip

    with (gzip.open(p, "rb") if p.suffix == ".gz" else open(p, "rb")) as f:
        for i, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:  # one bad record: skip_bad skips it, as any other
                yield i, DataError(f"{p}:{i}: not UTF-8 text (byte {raw[e.start]:#04x} at column {e.start + 1})")
                continue
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                # A file written record by record ends with "\n": a last line without it is an interrupted write.
                if not line.endswith("\n"):
                    log.warning("%s:%d: dropped a partial last line (an interrupted write?): %.60r", p, i, line)
                    if info is not None:
                        info["partial_last_line"] = info.get("partial_last_line", 0) + 1
                    return
                yield i, DataError(f"{p}:{i}: malformed JSON ({e.msg} at column {e.colno})")
                continue
            yield i, rec


def _json_array_records(p: Path) -> Records:
    try:
        with _open_text(p) as f:
            yield from iter_json_array(f, str(p))
    except UnicodeDecodeError:
        raise DataError(_not_utf8(p)) from None


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


def _dir_sources(d: Path, info: dict | None = None) -> list[tuple[str, Records]]:
    if any((d / n).is_file() for n in ("dataset_info.json", "state.json", "dataset_dict.json")):
        return [(str(d), _hf_rows(_import_datasets(str(d)).load_from_disk(str(d)), str(d)))]
    exts = (".parquet", ".jsonl", ".json", ".jsonl.gz", ".json.gz")
    files = sorted(q for q in d.iterdir() if q.is_file() and q.name.endswith(exts))
    if not files:
        raise DataError(f"{d}: a folder with no .jsonl/.json/.parquet files and not a datasets.save_to_disk folder")
    return [(str(q), _file_records(q, info)) for q in files]


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
    if not _hub_reachable():  # fail at once, not after the hub client's retries
        raise DataError(f"{name!r} is not a local file or folder, and the Hugging Face hub is not reachable "
                        "from here; pass a local file (a path with its suffix, e.g. data/train.jsonl)")
    try:
        ds = datasets.load_dataset(repo, split=split or "train")
    except Exception as e:  # offline, unknown name, no such split: all say the same to a user
        raise DataError(
            f"{name!r} is not a local file or folder, and loading it from the Hugging Face hub failed "
            f"({type(e).__name__}: {str(e)[:200]}). Without network, pass a local file instead."
        ) from e
    return _hf_rows(ds, name)


def _hub_reachable(timeout: float = 3.0) -> bool:
    """One connection attempt to the hub (``HF_ENDPOINT``); False offline (``HF_HUB_OFFLINE``,
    ``HF_DATASETS_OFFLINE``) without trying."""
    import socket
    from urllib.parse import urlparse

    if any(os.environ.get(k, "").lower() in ("1", "true", "yes") for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")):
        return False
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout=timeout).close()
    except OSError:
        return False
    return True
