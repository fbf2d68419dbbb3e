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

import hashlib
from dataclasses import dataclass, field
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
    passed to ``apply_chat_template`` as the serving engine passes ``chat_template_kwargs``."""

    text: str | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)
    source: str = ""  # the file it came from, for messages

    def render(self, tokenizer, messages: list[dict], *, generation_prompt: bool) -> str:
        return tokenizer.apply_chat_template(_plain(messages), tokenize=False, add_generation_prompt=generation_prompt,
                                             chat_template=self.text, **self.kwargs)

    def settings(self, tokenizer) -> dict:
        """What is recorded with data, caches, checkpoints and exports: the template's sha256 and its arguments."""
        text = self.text if self.text is not None else getattr(tokenizer, "chat_template", None)
        return {"chat_template_sha256": template_sha256(text),
                "chat_template_kwargs": dict(sorted(self.kwargs.items()))}


def template_sha256(text: str | None) -> str:
    return hashlib.sha256((text or "").encode("utf-8")).hexdigest()


def parse_kwargs(spec: str | dict | None, where: str = "--chat-template-kwargs") -> dict[str, Any]:
    """``"enable_thinking=false,foo=1"`` -> ``{"enable_thinking": False, "foo": 1}`` (values read as YAML)."""
    if not spec:
        return {}
    if isinstance(spec, dict):
        return dict(spec)
    out: dict[str, Any] = {}
    for item in spec.split(","):
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key.isidentifier():
            raise DataError(f"{where}: expected key=value[,key=value...], got {item.strip()!r}")
        if key in out:
            raise DataError(f"{where}: {key!r} is given twice")
        out[key] = yaml.safe_load(raw) if raw.strip() else ""
    return out


def format_kwargs(kwargs: dict) -> str:
    """The inverse of ``parse_kwargs`` (for messages and commands): ``enable_thinking=false``."""
    return ",".join(f"{k}={yaml.safe_dump(v, default_flow_style=True).strip().removesuffix('...').strip()}"
                    for k, v in sorted(kwargs.items())) or "(none)"


def load_template(tokenizer, file: str = "", kwargs: str | dict | None = None) -> ChatTemplate:
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
        variables = meta.find_undeclared_variables(jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])
                                                    .parse(source))
    except jinja2.TemplateSyntaxError as e:
        raise DataError(f"{where}:{e.lineno}: the chat template does not parse: {e.message}") from None
    unread = sorted(set(args) - variables)
    if unread:
        own = sorted(variables - _GIVEN)
        raise DataError(f"chat template kwargs {', '.join(unread)}: {where} does not read "
                        f"{'it' if len(unread) == 1 else 'them'} (its own variables: {', '.join(own) or 'none'})")
    return ChatTemplate(text, args, file)


def check_settings(have: dict | None, want: dict, what: str, against: str) -> None:
    """A ``DataError`` naming both values when ``have`` (recorded with data, a cache, a run or an export)
    differs from ``want`` (this command's template settings). ``have`` None: nothing recorded."""
    if have is None:
        return
    for key in ("chat_template_sha256", "chat_template_kwargs"):
        a, b = have.get(key, {} if key == "chat_template_kwargs" else None), want[key]
        if key == "chat_template_kwargs":
            a, b = format_kwargs(a or {}), format_kwargs(b)
        if a is not None and a != b:
            raise DataError(f"{what} was made with chat template {key.removeprefix('chat_template_')} {a}, "
                            f"{against} renders with {b}: pass the same --chat-template / --chat-template-kwargs "
                            "(data.chat_template / data.chat_template_kwargs) everywhere")


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
                f"{conv.id}@{n}", conv.messages, {**conv.meta, CONTEXT_TURNS: start})
            stop = _chain(part, tokenizer, template)[2]
            if stop is None:
                out.append(part)
                break
            out.append(Conversation(part.id, part.messages[:stop], part.meta))
            start, n = stop, n + 1
    return out


def _chain(conv: Conversation, tok, template: ChatTemplate) -> tuple[list[int], list[bool], int | None]:
    """``(ids, mask, stop)``: the sequence of ``conv``'s answers from ``context_turns`` on, and the index of
    the first assistant message whose history does not extend it (None: every answer fits)."""
    require_template(tok, template)
    msgs = conv.messages
    first = int(conv.meta.get(CONTEXT_TURNS, 0))
    special = _special_ids(tok)
    ids: list[int] = []
    mask: list[bool] = []
    for i, m in enumerate(msgs):
        if m["role"] != "assistant" or i < first:
            continue
        prompt = _render(template, tok, msgs[:i], conv, i, generation_prompt=True)
        p = _encode(tok, prompt)
        if ids and p[: len(ids)] != ids:
            return ids, mask, i
        mask += [False] * (len(p) - len(ids))
        ids = p
        probe = _render(template, tok, msgs[:i] + [{"role": "assistant", "content": PROBE}], conv, i,
                        generation_prompt=False)
        answer, supervised = _answer(template, tok, msgs, i, prompt, p, probe, conv)
        ids += answer
        mask += supervised
        eot = _end_of_turn(probe, tok, special)
        if eot is not None:
            ids.append(eot)
            mask.append(True)
    return ids, mask, None


def _answer(template, tok, msgs, i, prompt, p, probe, conv) -> tuple[list[int], list[bool]]:
    """Message ``i``'s answer tokens after prompt ``p`` and which of them are supervised: the ids the target
    generated when the record has them (``token_ids``), else the content tokenized as the template renders
    it, with the text the template puts before it (``lead``, e.g. an empty think block) masked out."""
    m = msgs[i]
    if m.get("token_ids") is not None:
        return list(m["token_ids"]), [True] * len(m["token_ids"])
    content = m["content"]
    lead = ""
    whole = _render(template, tok, msgs[: i + 1], conv, i, generation_prompt=False)
    if whole.startswith(prompt):
        rest = whole[len(prompt):]
        lead_probe = probe[len(prompt): probe.find(PROBE)] if probe.startswith(prompt) and PROBE in probe else ""
        for body in (content, content.strip()):  # a template may strip the content (Llama's `| trim`)
            if rest.startswith(lead_probe + body):
                lead, content = lead_probe, body
                break
            if rest.startswith(body):  # the answer carries what the template would add (its own think block)
                content = body
                break
        # else the template rewrites the answer itself (DeepSeek-R1 drops its reasoning): the answer as generated
    text = lead + content
    enc = tok(prompt + text, add_special_tokens=False, return_offsets_mapping=True)
    joint = list(enc["input_ids"])
    if joint[: len(p)] == p:  # the answer tokenized in its context, as apply_chat_template(tokenize=True) would
        ids, offsets, base = joint[len(p):], enc["offset_mapping"][len(p):], len(prompt)
    else:  # a token would merge across the prompt's end: the answer alone, as generation would produce it
        enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets, base = list(enc["input_ids"]), enc["offset_mapping"], 0
    end_lead = base + len(lead)
    return ids, [b > end_lead for _, b in offsets]


def _end_of_turn(probe: str, tok, special) -> int | None:
    """The token the template closes an answer with (``<|im_end|>``, ``<|eot_id|>``, ``<end_of_turn>``),
    when it is a special token; found in the rendering of a plain probe answer."""
    at = probe.rfind(PROBE)
    if at < 0:
        return None
    after = _encode(tok, probe[at + len(PROBE):])
    return after[0] if after and after[0] in special else None


def _render(template, tok, messages, conv, i, *, generation_prompt):
    try:
        return template.render(tok, messages, generation_prompt=generation_prompt)
    except Exception as e:  # a template's raise_exception (roles out of order, a system turn it refuses)
        name = f"the chat template {template.source}" if template.source else "the chat template"
        raise DataError(f"conversation {conv.id!r}: message {i}: {name} refuses it: {e}") from None


def _plain(messages: list[dict]) -> list[dict]:
    return [{"role": m["role"], "content": m["content"]} for m in messages]


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


def attach_template(target, file: str = "", kwargs: str | dict | None = None) -> ChatTemplate:
    """Load the template settings (``load_template``) for ``target`` and make them the ones it renders with:
    ``target.chat``, and a template file becomes its tokenizer's ``chat_template`` (so every hash of the
    tokenizer's template, in caches and exports, is that of the template trained and served)."""
    template = load_template(target.tokenizer, file, kwargs)
    if template.text is not None:
        target.tokenizer.chat_template = template.text
    target.chat = template
    return template


def target_template(target) -> ChatTemplate:
    """The template settings ``target`` renders with (``attach_template``), or its tokenizer's own."""
    return getattr(target, "chat", None) or ChatTemplate()


def check_data_template(convs: list[Conversation], want: dict, source: str) -> None:
    """Regenerated conversations record the template settings their answers were generated with
    (``meta["chat_template"]``); a ``DataError`` names both values when they differ from ``want``."""
    for conv in convs:
        have = conv.meta.get("chat_template")
        if isinstance(have, dict):
            check_settings(have, want, f"{source}: conversation {conv.id!r}", "this run")
