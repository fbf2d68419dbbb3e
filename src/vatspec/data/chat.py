"""Chat template and loss mask: ``Conversation`` -> ``Example`` (token ids + loss mask).

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

from dataclasses import dataclass

from vatspec.data.records import Conversation, DataError


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


def tokenize_conversation(conv: Conversation, tokenizer, max_length: int | None = None) -> Example:
    """Render ``conv`` with the tokenizer's chat template; mask in the assistant tokens only.

    How the mask is found: for each assistant turn i, the template is rendered for messages
    ``[:i]`` with the generation prompt; that text is a prefix of the full rendering, and the
    content starts right after it. Token character offsets then mark the content tokens and the
    end-of-turn special token that follows. The ids equal ``apply_chat_template(tokenize=True)``.
    Templates that rewrite earlier turns (not prefix-stable) or alter the content raise DataError.
    """
    require_template(tokenizer)
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


def require_template(tokenizer) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(
            f"tokenizer {getattr(tokenizer, 'name_or_path', type(tokenizer).__name__)!r} has no chat template; "
            "set tokenizer.chat_template (a Jinja string) before tokenizing conversations"
        )
    if not getattr(tokenizer, "is_fast", False):
        raise DataError("tokenizing conversations needs a fast tokenizer (for character offsets); use_fast=True")
