"""A family's reasoning markers, learned from its own chat template: where the model's reasoning starts and
ends in what it generates, so that an answer is stored as ``reasoning_content`` + ``content`` and rendered
back through the template's own field (never a fixed ``<think>`` pair).

    fmt = reasoning_format(template, tokenizer)     # None: the template renders no reasoning
    reasoning, content = fmt.split(generated_text)  # reasoning None: the text holds no reasoning block

The markers come from rendering a probe answer with a probe reasoning as the last turn, after the
generation prompt: Qwen3 ``<think>\\n`` ... ``\\n</think>\\n\\n``; gpt-oss (harmony)
``<|channel|>analysis<|message|>`` ... ``<|end|><|start|>assistant<|channel|>final<|message|>``. A template
that never renders reasoning but whose generation prompt opens a block (DeepSeek-R1: ``<｜Assistant｜><think>\\n``)
gets the block's closing token from the tokenizer (``</think>`` beside ``<think>``): the model writes its
reasoning, the closer, then the answer.
"""

from __future__ import annotations

from dataclasses import dataclass

REASONING_PROBE = "vatspecreasoning"
ANSWER_PROBE = "vatspecanswer"
QUESTION_PROBE = "vatspecquestion"


@dataclass(frozen=True)
class ReasoningFormat:
    """``opener`` (what the model writes before its reasoning; "" when the prompt opens the block) and
    ``separator`` (between reasoning and answer) as the template renders them; ``closer`` is the separator's
    marker without the whitespace around it (``</think>``)."""

    opener: str
    separator: str
    opened: str = ""  # the block opener the generation prompt ends with (DeepSeek-R1's ``<think>``), else ""
    rendered: bool = False  # the template renders the reasoning field itself (Qwen3, gpt-oss, GLM-4.5)

    @property
    def closer(self) -> str:
        return self.separator.strip()

    def split(self, text: str) -> tuple[str | None, str]:
        """``(reasoning, content)`` of a generated text; ``(None, text)`` when it holds no reasoning block. A
        text cut inside its reasoning (no closer yet) is all reasoning. Newlines around each part are dropped
        (the templates write their own)."""
        head = self.opener.strip()
        body = text
        if head:
            stripped = text.lstrip()
            if not stripped.startswith(head):
                return None, text
            body = stripped[len(head):]
        at = body.find(self.closer)
        if at < 0:
            return (body.strip("\n"), "") if head else (None, text)
        return body[:at].strip("\n"), body[at + len(self.closer):].lstrip("\n")

    def join(self, reasoning: str, content: str) -> str:
        """The text the model generates for ``reasoning`` and ``content`` (the inverse of ``split``)."""
        return f"{self.opener}{reasoning}{self.separator}{content}"


_LEARNED: dict[tuple, tuple[object, ReasoningFormat | None]] = {}  # (tokenizer id, template) -> (tokenizer, format)


def reasoning_format(template, tokenizer) -> ReasoningFormat | None:
    """The reasoning markers of ``template`` (a ``vatspec.data.ChatTemplate``) for ``tokenizer``; None when the
    template renders no reasoning and its generation prompt opens no block (or thinking is off). Learned once
    per tokenizer and template settings."""
    from vatspec.data.chat import format_kwargs

    key = (id(tokenizer), template.source_text(tokenizer), format_kwargs(template.kwargs), template.date)
    hit = _LEARNED.get(key)
    if hit is not None and hit[0] is tokenizer:
        return hit[1]
    if len(_LEARNED) >= 64:
        _LEARNED.clear()
    fmt = _learn(template, tokenizer)
    _LEARNED[key] = (tokenizer, fmt)
    return fmt


def _learn(template, tok) -> ReasoningFormat | None:
    user = [{"role": "user", "content": QUESTION_PROBE}]
    answer = {"role": "assistant", "content": ANSWER_PROBE}
    try:
        prompt = template.render(tok, user, generation_prompt=True)
        whole = template.render(tok, user + [{**answer, "reasoning_content": REASONING_PROBE}], generation_prompt=False)
    except Exception:  # noqa: BLE001 - a template that refuses the probe renders no reasoning we can learn
        return None
    if whole.startswith(prompt):  # 1. the template renders the reasoning field (Qwen3, gpt-oss, GLM-4.5)
        rest = whole[len(prompt):]
        r, c = rest.find(REASONING_PROBE), rest.find(ANSWER_PROBE)
        if 0 <= r < c:
            sep = rest[r + len(REASONING_PROBE): c]
            return ReasoningFormat(rest[:r], sep, rendered=True) if sep.strip() else None
    return _opened_by_prompt(tok, prompt, whole) or _empty_block(template, tok, user, answer)


def _pairs(tok) -> list[tuple[str, str]]:
    """``(<x>, </x>)`` pairs of the tokenizer's added tokens (``<think>``, ``</think>``)."""
    texts = _added_texts(tok)
    return [(t, "</" + t[1:]) for t in sorted(texts) if t.startswith("<") and not t.startswith("</")
            and "</" + t[1:] in texts]


def _opened_by_prompt(tok, prompt: str, whole: str) -> ReasoningFormat | None:
    """2. A generation prompt that ends by opening a block (``<think>``) whose closing token the tokenizer has too:
    the model writes its reasoning, the closer, then its answer (DeepSeek-R1, DeepSeek-V3.1 with thinking). The
    text between closer and answer is the template's where its history shows the closer before the answer
    (V3.1: ``</think>`` + answer), else the reasoning models' ``\n</think>\n\n``."""
    tail = prompt.rstrip()
    for opener, closer in _pairs(tok):
        if tail.endswith(opener):
            at = whole.find(ANSWER_PROBE)
            head = whole[:at].rstrip()
            if at > 0 and head.endswith(closer):
                return ReasoningFormat("", closer + whole[len(head):at], opener)
            return ReasoningFormat("", f"\n{closer}\n\n", opener)
    return None


def _empty_block(template, tok, user, answer) -> ReasoningFormat | None:
    """3. An empty reasoning block the template writes between the question and the answer (in the generation
    prompt or before the answer), with thinking as asked or, for a template that reads ``enable_thinking``, with
    it off (SmolLM3: ``<think>\\n\\n</think>\\n``): the block's whitespace split in two gives the opener and the
    separator."""
    from dataclasses import replace

    tries = [template]
    if "enable_thinking" in template.source_text(tok) and template.kwargs.get("enable_thinking") is not False:
        tries.append(replace(template, kwargs={**template.kwargs, "enable_thinking": False}))
    for t in tries:
        try:
            whole = t.render(tok, user + [answer], generation_prompt=False)
        except Exception:  # noqa: BLE001
            continue
        at, q = whole.find(ANSWER_PROBE), whole.find(QUESTION_PROBE)
        lead = whole[q + len(QUESTION_PROBE): at] if 0 <= q < at else ""  # the block may sit in the prompt
        for opener, closer in _pairs(tok):
            o, c = lead.find(opener), lead.find(closer)
            if 0 <= o < c and not lead[o + len(opener): c].strip():
                middle = lead[o + len(opener): c]
                half = len(middle) // 2
                return ReasoningFormat(opener + middle[:half], middle[half:] + lead[c:])
    return None


def _added_texts(tok) -> set[str]:
    return {t.content if hasattr(t, "content") else str(t) for t in getattr(tok, "added_tokens_decoder", {}).values()}
