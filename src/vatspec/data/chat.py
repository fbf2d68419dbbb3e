"""Chat templates and loss masks: ``Conversation`` -> ``Example`` (token ids + loss mask).

A training sequence is what the serving engine feeds the target: for each assistant turn, the
history rendered with ``add_generation_prompt=True`` and the template arguments (``ChatTemplate``),
followed by the answer's tokens and the end-of-turn token. Masked in (``loss_mask[t]`` True:
``input_ids[t]`` is a supervised target, predicted from positions ``< t``): the answer and the
end-of-turn token. Masked out: the prompt, the role headers, text the template puts between the
assistant header and the answer (an empty ``<think>\\n\\n</think>\\n\\n`` block), what follows
the end-of-turn token, padding.

Example (SmolLM2 / ChatML, one turn):

    <|im_start|>system\\n...<|im_end|>\\n<|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\nHello<|im_end|>\\n
    0 ...                                                                                   1    1          0

Multi-turn: turn j extends the sequence of turn i when the rendering of its history starts with
the tokens of turn i's sequence. A template that rewrites history (Qwen3 renders an earlier answer
without the ``<think>`` block its generation prompt held) breaks that: ``split_turns`` then makes a
new sequence whose earlier turns are context, as the engine re-renders them, so every turn is
supervised in the context the target had when it answered (docs/data.md).
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import json
import re
from dataclasses import dataclass, field, replace
from typing import Any

import yaml

from vatspec.data.records import Conversation, DataError

CONTEXT_TURNS = "context_turns"  # meta: messages before this index are context only (split_turns)
PROBE = "vatspecprobe"  # a plain word rendered as an answer, to find the template's own text around it
# variables that transformers passes to every template itself: never template arguments of ours
_GIVEN = {"messages", "add_generation_prompt", "tools", "documents", "continue_final_message", "raise_exception",
          "strftime_now", "bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token",
          "additional_special_tokens", "range", "namespace", "dict", "loop", "true", "false", "none", "True",
          "False", "None"}


@dataclass(frozen=True)
class ChatTemplate:
    """How conversations are rendered: the Jinja text (None: the tokenizer's own) and its arguments,
    passed to ``apply_chat_template`` as the serving engine passes ``chat_template_kwargs``.

    ``date``: the day (``YYYY-MM-DD``) a template that stamps today's date (``strftime_now``: gpt-oss,
    Llama-3.2, Granite, SmolLM3, Mistral-Small-3.x) renders, pinned once per dataset (``pin_date``) so that data
    regenerated on one day and features cached on another are the same sequences. ``stop_ids``: the ids
    the engine ends a turn on (the target's generation config; ``attach_template`` sets them); the
    supervised end of an answer is the first of them the template renders after it."""

    text: str | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)
    source: str = ""  # the file it came from, for messages
    date: str | None = None
    stop_ids: tuple[int, ...] = ()

    def render(self, tokenizer, messages: list[dict], *, generation_prompt: bool, tools: list | None = None) -> str:
        text, extra = self.text, {}
        if self.date:
            text, extra[_PINNED] = _pinned_template(self.source_text(tokenizer), self.date)
        if tools:
            extra["tools"] = tools
        view = template_view(messages)
        try:
            return tokenizer.apply_chat_template(view, tokenize=False, add_generation_prompt=generation_prompt,
                                                 chat_template=text, **self.kwargs, **extra)
        except Exception:
            if not any(v.get("tool_calls") for v in view):
                raise
        # a template that concatenates the arguments as text (DeepSeek-V3.1, -R1) takes them as a JSON string
        return tokenizer.apply_chat_template(_json_arguments(view), tokenize=False,
                                             add_generation_prompt=generation_prompt, chat_template=text,
                                             **self.kwargs, **extra)

    def source_text(self, tokenizer) -> str:
        return (self.text if self.text is not None else getattr(tokenizer, "chat_template", None)) or ""

    def stamps_date(self, tokenizer) -> bool:
        """Whether the template renders today's date (it calls ``strftime_now``)."""
        return "strftime_now" in self.source_text(tokenizer)

    def settings(self, tokenizer) -> dict:
        """What is recorded with data, caches, checkpoints and exports: the template's sha256, its arguments,
        and the pinned date of a template that stamps one."""
        out = {"chat_template_sha256": template_sha256(self.source_text(tokenizer) or None),
               "chat_template_kwargs": dict(sorted(self.kwargs.items()))}
        if self.date is not None:
            out["chat_template_date"] = self.date
        return out


_PINNED = "vatspec_pinned_dates"  # the template variable the pinned day is read from (_pinned_template)
_STRFTIME_CALL = re.compile(r"""strftime_now\(\s*("[^"\\]*"|'[^'\\]*')\s*\)""")


@functools.lru_cache(maxsize=16)  # once per template and day, not once per rendering (gpt-oss' is 15 kB)
def _pinned_template(text: str, date: str) -> tuple[str, dict[str, str]]:
    """``text`` with each ``strftime_now("FORMAT")`` call read from a variable instead, and that variable's value
    (``{FORMAT: date formatted so}``). transformers passes a template only plain data (since 5.x a callable given
    as ``strftime_now=`` reaches it as a placeholder string, so calling it raises), so the pinned day cannot be
    handed over as a function; every published template calls it with a literal format."""
    day = datetime.date.fromisoformat(date)
    dates: dict[str, str] = {}

    def lookup(m: re.Match) -> str:
        fmt = m.group(1)[1:-1]
        dates[fmt] = day.strftime(fmt)
        return f"{_PINNED}[{m.group(1)}]"

    return _STRFTIME_CALL.sub(lookup, text), dates


def pin_date(template: ChatTemplate, tokenizer, recorded: dict | None = None, *, today: bool = False) -> ChatTemplate:
    """``template`` with its date pinned, for a template that stamps one: the date it already has, else the one
    ``recorded`` with the data, cache or draft it reads (``chat_template_date``), else (``today``) today's.
    A template that stamps no date is returned as it is."""
    if template.date is not None or not template.stamps_date(tokenizer):
        return template
    date = (recorded or {}).get("chat_template_date")
    if date is None and today:
        date = datetime.date.today().isoformat()
    return replace(template, date=date) if date is not None else template


def template_view(messages: list[dict]) -> list[dict]:
    """What a chat template reads of each message, as the engine passes it: role and content, an assistant's
    reasoning (as ``reasoning_content`` and as ``thinking``, the two names templates read it by) and tool
    calls (OpenAI shape, arguments a dict), a tool result's ``name`` and ``tool_call_id``. The ids recorded
    beside an answer (``token_ids``, ``prompt_token_ids``, ``stop_token_id``) are not the template's."""
    out = []
    for m in messages:
        v = {"role": m["role"], "content": m["content"]}
        if m.get("reasoning_content") is not None:
            v["reasoning_content"] = v["thinking"] = m["reasoning_content"]
        if m.get("tool_calls"):
            v["tool_calls"] = [dict(c) for c in m["tool_calls"]]
        for key in ("name", "tool_call_id"):
            if m.get(key) is not None:
                v[key] = m[key]
        out.append(v)
    return out


def _json_arguments(view: list[dict]) -> list[dict]:
    """``view`` with every tool call's arguments as a JSON string (the OpenAI wire form)."""
    out = []
    for v in view:
        if v.get("tool_calls"):
            v = {**v, "tool_calls": [{**c, "function": {**c["function"],
                                                         "arguments": json.dumps(c["function"]["arguments"])}}
                                     if isinstance(c.get("function", {}).get("arguments"), dict) else c
                                     for c in v["tool_calls"]]}
        out.append(v)
    return out


def template_sha256(text: str | None) -> str:
    return hashlib.sha256((text or "").encode("utf-8")).hexdigest()


def parse_kwargs(spec: str | dict | None, where: str = "--chat-template-kwargs") -> dict[str, Any]:
    """``"enable_thinking=false,foo=1"`` -> ``{"enable_thinking": False, "foo": 1}`` (values read as YAML)."""
    if not spec:
        return {}
    if isinstance(spec, dict):
        return _checked_kwargs(dict(spec), where)
    out: dict[str, Any] = {}
    for item in spec.split(","):
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key.isidentifier():
            raise DataError(f"{where}: expected key=value[,key=value...], got {item.strip()!r}")
        if key in out:
            raise DataError(f"{where}: {key!r} is given twice")
        try:
            out[key] = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as e:
            first = (str(e).strip().splitlines() or ["?"])[0]
            raise DataError(f"{where}: {key}={raw.strip()!r} is not a value ({first}); quote a string, "
                            "write true / false / a number") from None
    return _checked_kwargs(out, where)


# what the renderer passes a template itself (transformers' apply_chat_template, the engines'): never an argument
RESERVED_KWARGS = ("messages", "tools", "documents", "add_generation_prompt", "continue_final_message",
                   "chat_template", "tokenize", "return_dict")
# the families' thinking switches: a template tests them for truth, so a string ("maybe", "=false") is "on"
BOOL_KWARGS = ("enable_thinking", "thinking")


def _checked_kwargs(kwargs: dict[str, Any], where: str) -> dict[str, Any]:
    for key, value in kwargs.items():
        if key in RESERVED_KWARGS:
            raise DataError(f"{where}: {key!r} is set by the renderer, not a template argument")
        if key in BOOL_KWARGS and not isinstance(value, bool):
            raise DataError(f"{where}: {key} must be true or false, got {value!r}")
    return kwargs


def format_kwargs(kwargs: dict) -> str:
    """The inverse of ``parse_kwargs`` (for messages and commands): ``enable_thinking=false``."""
    return ",".join(f"{k}={yaml.safe_dump(v, default_flow_style=True).strip().removesuffix('...').strip()}"
                    for k, v in sorted(kwargs.items())) or "(none)"


def _parse_env():
    """A Jinja environment that parses what transformers renders: loop controls, and the ``{% generation %}``
    blocks of templates that mark assistant text (SmolLM3), read here as plain blocks."""
    import jinja2
    from jinja2.ext import Extension

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body, lineno=lineno)

    return jinja2.Environment(extensions=["jinja2.ext.loopcontrols", Generation])


def load_template(tokenizer, file: str = "", kwargs: str | dict | None = None, date: str | None = None,
                  stop_ids=()) -> ChatTemplate:
    """The template settings a command renders with, checked: ``file`` ("" = the tokenizer's own) must
    parse, and every argument must be a variable the template reads (an argument it ignores, e.g.
    ``enable_thinking`` given to a Llama template, is a mistake: the data would not be what was asked)."""
    import jinja2
    from jinja2 import meta

    args = parse_kwargs(kwargs)
    text, where = None, "the tokenizer's chat template"
    if file:
        try:
            with open(file, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise DataError(f"--chat-template {file}: cannot read: {e.strerror or e}") from None
        where = file
    source = text if text is not None else getattr(tokenizer, "chat_template", None)
    if not args and not source:  # nothing chosen and nothing to check: whatever renders says what is missing
        return ChatTemplate()
    if not isinstance(source, str) or not source:
        raise DataError(f"tokenizer {getattr(tokenizer, 'name_or_path', '?')!r} has no chat template; pass "
                        "--chat-template FILE (data.chat_template)")
    try:
        variables = meta.find_undeclared_variables(_parse_env().parse(source))
    except jinja2.TemplateSyntaxError as e:
        raise DataError(f"{where}:{e.lineno}: the chat template does not parse: {e.message}") from None
    unread = sorted(set(args) - variables)
    if unread:
        own = sorted(variables - _GIVEN)
        raise DataError(f"chat template kwargs {', '.join(unread)}: {where} does not read "
                        f"{'it' if len(unread) == 1 else 'them'} (its own variables: {', '.join(own) or 'none'})")
    if date is not None:
        try:
            date = datetime.date.fromisoformat(str(date)).isoformat()
        except ValueError:
            raise DataError(f"--chat-template-date {date}: expected a day as YYYY-MM-DD") from None
    return ChatTemplate(text, args, file, date, tuple(stop_ids))


def check_settings(have: dict | None, want: dict, what: str, against: str) -> None:
    """A ``DataError`` naming both values when ``have`` (recorded with data, a cache, a run or an export)
    differs from ``want`` (this command's template settings). ``have`` None: nothing recorded."""
    if have is None:
        return
    for key in ("chat_template_sha256", "chat_template_kwargs", "chat_template_date"):
        if key == "chat_template_date" and key not in want:  # a date recorded is adopted where none was pinned
            continue
        a, b = have.get(key, {} if key == "chat_template_kwargs" else None), want[key]
        if key == "chat_template_kwargs":
            a, b = format_kwargs(a or {}), format_kwargs(b)
        if a is not None and a != b:
            raise DataError(f"{what} was made with chat template {key.removeprefix('chat_template_')} {a}, "
                            f"{against} renders with {b}: pass the same --chat-template / --chat-template-kwargs / "
                            "--chat-template-date (data.chat_template*) everywhere")


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

    def supervise_all(self) -> Example:
        """The same tokens with every position after the first supervised (``data.loss_on=all``)."""
        return Example(self.input_ids, [False] + [True] * (len(self) - 1), self.id)


def tokenize_conversation(conv: Conversation, tokenizer, max_length: int | None = None,
                          template: ChatTemplate | None = None) -> Example:
    """``conv`` as one training sequence (see the module docstring); messages before
    ``conv.meta["context_turns"]`` are context only. A conversation whose template rewrites its
    history needs ``split_turns`` first: here it is a ``DataError``."""
    ids, mask, stop = _chain(conv, tokenizer, template or ChatTemplate())
    if stop is not None:
        raise DataError(f"conversation {conv.id!r}: the chat template renders message {stop}'s history differently "
                        "from the sequence before it (it rewrites earlier turns): split it with split_turns")
    if max_length is not None:
        ids, mask = ids[:max_length], mask[:max_length]
    return Example(ids, mask, conv.id)


def split_turns(convs: list[Conversation], tokenizer, template: ChatTemplate | None = None) -> list[Conversation]:
    """``convs`` with each conversation whose template rewrites history cut into parts that each
    tokenize as one sequence: part ``n`` (id ``ID@n``) holds the messages up to its last answer, the
    earlier ones as context (``meta["context_turns"]``). Conversations that need no cut stay as they are."""
    template = template or ChatTemplate()
    out = []
    for conv in convs:
        start, n = int(conv.meta.get(CONTEXT_TURNS, 0)), 0
        while True:
            part = conv if start == 0 and n == 0 else Conversation(
                f"{conv.id}@{n}", conv.messages, {**conv.meta, CONTEXT_TURNS: start}, conv.tools)
            stop = _chain(part, tokenizer, template)[2]
            if stop is None:
                out.append(part)
                break
            out.append(Conversation(part.id, part.messages[:stop], part.meta, conv.tools))
            start, n = stop, n + 1
    return out


def _chain(conv: Conversation, tok, template: ChatTemplate) -> tuple[list[int], list[bool], int | None]:
    """``(ids, mask, stop)``: the sequence of ``conv``'s answers from ``context_turns`` on, and the index of
    the first assistant message whose prompt does not extend it (None: every answer fits)."""
    require_template(tok, template)
    msgs = conv.messages
    first = int(conv.meta.get(CONTEXT_TURNS, 0))
    ids: list[int] = []
    mask: list[bool] = []
    for i, m in enumerate(msgs):
        if m["role"] != "assistant" or i < first:
            continue
        prompt = _render(template, tok, msgs[:i], conv, i, generation_prompt=True)
        # the engine's own prompt ids when the record has them (a server that returns them), else our rendering
        p = list(m["prompt_token_ids"]) if m.get("prompt_token_ids") is not None else _encode(tok, prompt)
        if ids and p[: len(ids)] != ids:
            return ids, mask, i
        mask += [False] * (len(p) - len(ids))
        ids = p
        answer, supervised = _answer(template, tok, msgs, i, prompt, p, conv)
        ids += answer
        mask += supervised
    return ids, mask, None


def _answer(template, tok, msgs, i, prompt, p, conv) -> tuple[list[int], list[bool]]:
    """Message ``i``'s answer after prompt ``p`` and which of its tokens are supervised: what the model generates,
    and the stop id that ended it.

    With the ids the target generated (``token_ids``) they are the answer as they are, then the stop id
    recorded with them (``stop_token_id``; None: cut at its length, no stop), else the one the template closes
    the answer with. Otherwise the answer is the template's own rendering of the message after the generation
    prompt (reasoning, content and tool calls, as the template writes what the model generates) up to and
    including the first stop id (``_stop``); text the template writes before an answer without reasoning (an
    empty think block: ``_lead``) is context."""
    m = msgs[i]
    if m.get("token_ids") is not None:
        ids = list(m["token_ids"])
        stop = m["stop_token_id"] if "stop_token_id" in m else _stop(template, tok, msgs, i, conv, prompt)[0]
        ids += [] if stop is None else [stop]
        return ids, [True] * len(ids)
    whole = _render(template, tok, msgs[: i + 1], conv, i, generation_prompt=False)
    text = _as_generated(template, tok, conv, i, prompt, whole)
    stop, end = _stop(template, tok, msgs, i, conv, prompt, text)
    lead = "" if m.get("reasoning_content") else _lead(template, tok, text)
    enc = tok(prompt + text[:end], add_special_tokens=False, return_offsets_mapping=True)
    joint = list(enc["input_ids"])
    if joint[: len(p)] == p:  # the answer tokenized in its context, as apply_chat_template(tokenize=True) would
        ids, offsets, base = joint[len(p):], enc["offset_mapping"][len(p):], len(prompt)
    else:  # a token would merge across the prompt's end: the answer alone, as generation would produce it
        enc = tok(text[:end], add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets, base = list(enc["input_ids"]), enc["offset_mapping"], 0
    if stop is not None and (not ids or ids[-1] != stop):  # the stop the engine ends on sits after the text
        ids, offsets = ids + [stop], offsets + [(base + end, base + end + 1)]
    return ids, [b > base + len(lead) for _, b in offsets]


def _as_generated(template, tok, conv, i, prompt: str, whole: str) -> str:
    """The text the model generates for message ``i`` after ``prompt``: the template's rendering of it as the last
    turn (``whole``) after the prompt. Where that does not hold all of it:
    - a template that renders the history otherwise than the prompt (Mistral puts the system message in the
      last user turn only): what ``whole`` writes after the last message before ``i`` and the prompt's own
      header after it (``[/INST]``);
    - a template that does not render the reasoning field (SmolLM3 in thinking mode): the family's reasoning
      block (its markers learned from its reasoning-off rendering) before the answer;
    - a prompt that opens a reasoning block its history does not render (DeepSeek-R1, DeepSeek-V3.1 with
      thinking: the prompt ends in ``<think>``): the reasoning and the block's closer
      (``vatspec.data.reasoning``), then the rest, as the model writes them;
    - else the content as it is.
    A reasoning the text then does not hold (thinking off in the template's arguments, Granite's markers that
    live only in its system prompt) is a ``DataError``, never dropped silently."""
    from vatspec.data.reasoning import reasoning_format

    msgs = conv.messages
    m, last = msgs[i], msgs[i - 1]["content"] if i else ""
    reasoning = (m.get("reasoning_content") or "").strip()
    fmt = reasoning_format(template, tok) if reasoning else None
    text = None
    if whole.startswith(prompt):
        text = whole[len(prompt):]
        closed = fmt is not None and fmt.closer in prompt[len(_upto(prompt, last)):]  # thinking off: prompt closed it
        if fmt is not None and not fmt.rendered and not fmt.opened and not closed:
            text = fmt.join(reasoning, text)  # a template that ignores the field (SmolLM3): the model's block first
    else:
        for shown in (last, json.dumps(last, ensure_ascii=False)) if last else ():  # gpt-oss shows a result |tojson
            if shown in prompt and shown in whole:
                header = prompt[len(_upto(prompt, shown)):]
                after = whole[len(_upto(whole, shown, prompt.count(shown))):]
                if header.strip() and after.startswith(header):
                    text = after[len(header):]
                    break
        fmt = fmt or reasoning_format(template, tok)
        if text is None and fmt is not None and fmt.opened:
            base = prompt.rstrip().removesuffix(fmt.opened)
            if whole.startswith(base):
                rest = whole[len(base):]
                text = reasoning + (rest if rest.startswith(fmt.closer) else fmt.separator + rest)
    if text is None:
        text = m["content"]
    if reasoning and reasoning not in text:  # never silently: the answer would train without what the model wrote
        raise DataError(f"conversation {conv.id!r}: message {i}: it has reasoning_content, but the chat template with "
                        "these arguments renders none for it (thinking off, or a template that shows no reasoning "
                        "markers): keep the answer as generated (its token_ids), render it in the mode it was "
                        "generated in, or drop the reasoning (regenerate --reasoning drop)")
    return text


def _upto(text: str, sub: str, n: int | None = None) -> str:
    """``text`` up to the end of the ``n``-th occurrence of ``sub`` (the last when ``n`` is None)."""
    if n is None:
        return text[: text.rfind(sub) + len(sub)]
    at = -1
    for _ in range(n):
        at = text.find(sub, at + 1)
    return text[: at + len(sub)]


def _stop(template, tok, msgs, i, conv, prompt, text: str | None = None) -> tuple[int | None, int]:
    """``(stop id, end)``: the id the engine stops answer ``i`` on and the length of ``text`` (the template's
    rendering after the prompt) the model generates before it, the stop's own text included when the template
    writes it. The stop is the first of ``template.stop_ids`` (without them: the first special token) after the
    content; a template that writes none after an answer (GLM-4.5: the model ends its turn with the next role's
    token, ``<|user|>`` or ``<|observation|>``) is asked by rendering what follows it: the next message, or a
    probe user message (a tool result after a tool call)."""
    special = _special_ids(tok)
    is_stop = (lambda t: t in template.stop_ids) if template.stop_ids else special.__contains__
    m = msgs[i]
    if text is None:
        whole = _render(template, tok, msgs[: i + 1], conv, i, generation_prompt=False)
        text = whole[len(prompt):] if whole.startswith(prompt) else ""
    body = m["content"].strip()
    start = text.rfind(body) + len(body) if body and body in text else 0
    stop = _first(tok, text[start:], is_stop)
    if stop is not None:
        return stop[0], start + stop[1]
    follower = msgs[i + 1] if i + 1 < len(msgs) and msgs[i + 1]["role"] in ("user", "tool") else _probe_after(m)
    try:
        after = template.render(tok, msgs[: i + 1] + [follower], generation_prompt=False, tools=conv.tools)
    except Exception:  # noqa: BLE001 - a template that refuses the probe writes no stop either
        return None, len(text)
    at = after.find(PROBE if follower.get("content") == PROBE else follower["content"], len(prompt))
    region = after[len(prompt): at if at >= 0 else len(after)]
    tail = region[region.rfind(body) + len(body):] if body and body in region else region[len(text):]
    found = _first(tok, tail, lambda t: t in special)
    return (found[0] if found is not None and is_stop(found[0]) else None), len(text)


def _first(tok, text: str, pred) -> tuple[int, int] | None:
    """``(id, end)`` of the first token of ``text`` (tokenized alone) that ``pred`` holds for, ``end`` its end in
    ``text``; None if there is none."""
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    for t, (_, b) in zip(enc["input_ids"], enc["offset_mapping"]):
        if pred(t):
            return t, b
    return None


def _probe_after(m: dict) -> dict:
    if m.get("tool_calls"):
        call = m["tool_calls"][0]
        fn = call.get("function", call)
        probe = {"role": "tool", "content": PROBE, "name": fn["name"]}
        if call.get("id") is not None:
            probe["tool_call_id"] = call["id"]
        return probe
    return {"role": "user", "content": PROBE}


def _lead(template, tok, text: str) -> str:
    """The empty reasoning block at the start of ``text`` (an answer without reasoning): Qwen3 with thinking on
    and GLM-4.5 render one before every last answer, DeepSeek-R1's model closes the block its prompt opened.
    It is context, never supervised. Text the model writes before every answer (gpt-oss'
    ``<|channel|>final<|message|>``) holds no reasoning closer and stays supervised."""
    from vatspec.data.reasoning import reasoning_format

    fmt = reasoning_format(template, tok)
    at = text.find(fmt.closer) if fmt is not None else -1
    if at < 0 or text[:at].strip() not in ("", fmt.opener.strip()):
        return ""
    end = at + len(fmt.closer)
    return text[: end + len(text[end:]) - len(text[end:].lstrip("\n"))]


def prompt_agreement(convs: list[Conversation], tok, template: ChatTemplate) -> tuple[int, int, list[int]]:
    """``(checked, same, first differences)``: of the answers whose records hold the engine's own prompt ids
    (``prompt_token_ids``), how many equal this project's rendering of their prompt, and the token position
    where each other one first differs."""
    checked, same, parts = 0, 0, []
    for conv in convs:
        for i, m in enumerate(conv.messages):
            if m["role"] != "assistant" or m.get("prompt_token_ids") is None:
                continue
            mine, theirs = _encode(tok, _render(template, tok, conv.messages[:i], conv, i, generation_prompt=True)), \
                m["prompt_token_ids"]
            checked += 1
            if mine == theirs:
                same += 1
            else:
                parts.append(first_difference(mine, theirs))
    return checked, same, parts


def first_difference(a: list[int], b: list[int]) -> int:
    """The first position where two id lists part (the shorter one's length when one extends the other)."""
    return next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _render(template, tok, messages, conv, i, *, generation_prompt):
    try:
        return template.render(tok, messages, generation_prompt=generation_prompt, tools=conv.tools)
    except Exception as e:  # a template's raise_exception (roles out of order, a system turn it refuses)
        name = f"the chat template {template.source}" if template.source else "the chat template"
        raise DataError(f"conversation {conv.id!r}: message {i}: {name} refuses it: {e}") from None


def _encode(tok, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False)["input_ids"])


def _special_ids(tok) -> set[int]:
    ids = set(tok.all_special_ids)
    ids |= {i for i, t in getattr(tok, "added_tokens_decoder", {}).items() if getattr(t, "special", False)}
    return ids


def require_template(tokenizer, template: ChatTemplate | None = None) -> None:
    if not (template is not None and template.text) and not getattr(tokenizer, "chat_template", None):
        raise DataError(
            f"tokenizer {getattr(tokenizer, 'name_or_path', type(tokenizer).__name__)!r} has no chat template; "
            "set tokenizer.chat_template (a Jinja string) or pass --chat-template FILE"
        )
    if not getattr(tokenizer, "is_fast", False):
        raise DataError("tokenizing conversations needs a fast tokenizer (for character offsets); use_fast=True")


def attach_template(target, file: str = "", kwargs: str | dict | None = None, date: str | None = None) -> ChatTemplate:
    """The template settings (``load_template``) ``target`` is served with, to pass to whatever renders. A
    template file is the served tokenizer's template, as an engine started with ``--chat-template FILE``
    serves it: it becomes ``target.tokenizer.chat_template``, so every hash of the tokenizer's template (in
    caches and exports) is that of the template trained and served. The turn's stop ids are the target's
    generation-config ones (``target.eos_token_ids``)."""
    template = load_template(target.tokenizer, file, kwargs, date)
    if template.text is not None:
        target.tokenizer.chat_template = template.text
    return replace(template, stop_ids=tuple(target.eos_token_ids))


def recorded_settings(convs: list[Conversation]) -> dict | None:
    """The template settings the first regenerated conversation of ``convs`` records (``meta["chat_template"]``)."""
    return next((c.meta["chat_template"] for c in convs if isinstance(c.meta.get("chat_template"), dict)), None)


def check_data_template(convs: list[Conversation], want: dict, source: str) -> None:
    """Regenerated conversations record the template settings their answers were generated with
    (``meta["chat_template"]``); a ``DataError`` names both values when they differ from ``want``."""
    for conv in convs:
        have = conv.meta.get("chat_template")
        if isinstance(have, dict):
            check_settings(have, want, f"{source}: conversation {conv.id!r}", "this run")
