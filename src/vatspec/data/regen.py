"""Regeneration: replace the assistant turns by the target's own responses, resumably."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from vatspec.data.chat import ChatTemplate, check_settings, pin_date, require_template
from vatspec.data.reasoning import ReasoningFormat, reasoning_format
from vatspec.data.records import Conversation, DataError
from vatspec.outputs import OutputError, own_jsonl

log = logging.getLogger(__name__)


@dataclass
class RegenStats:
    conversations: int = 0  # written in this run
    skipped_done: int = 0  # already in the output file (resume)
    too_long: int = 0  # first prompt over max_prompt_tokens: not written
    turns: int = 0  # assistant turns generated
    new_tokens: int = 0  # generated tokens, end-of-turn token included
    truncated_turns: int = 0  # stopped at max_new_tokens without an end-of-turn token
    reasoning_dropped: int = 0  # answers whose reasoning block was cut (reasoning="drop")
    requests: int = 0  # through endpoints: requests sent (the probe and retries included)
    retried: int = 0  # through endpoints: requests retried after a 5xx, a timeout or a dropped connection
    failed: int = 0  # through endpoints: conversations that kept failing (OUT.failed.jsonl; the next run retries)
    prompts_checked: int = 0  # through endpoints: answers whose prompt ids the server returned
    prompts_same: int = 0  # ... equal to this project's rendering of the prompt
    prompt_differs_at: list = field(default_factory=list)  # where each other one first differs (token position)
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
    batch_tokens: int | None = None,
    max_new_tokens: int = 512,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    max_prompt_tokens: int = 2048,
    max_length: int | None = None,
    template: ChatTemplate | None = None,
    reasoning: str = "keep",
    progress: bool = True,
) -> RegenStats:
    """Replace each assistant turn by the target's own response; append records to ``out_path``.

    Every user turn gets one response, generated from the regenerated history (the original
    assistant turns are dropped; a prompt-only conversation gets a response per user turn).
    Greedy when ``temperature == 0``. Generation stops at any ``target.eos_token_ids`` (the
    end token is not kept in the text) or after ``max_new_tokens`` (counted in
    ``truncated_turns``). A conversation stops at the first round whose prompt exceeds
    ``max_prompt_tokens``; if that is the first round it is not written (``too_long``).

    ``max_length``: the training length, when known. A row then generates only until it holds
    ``max_length`` tokens (prompt included) and a few more, so the words at the cut re-tokenize as
    they would in the whole text: tokens past the training length are never trained on, so the
    training sequences are the same and long prompts finish sooner. Rows cut
    there finish as ``"length"``. A later user turn whose prompt already holds ``max_length``
    tokens ends the conversation (nothing after it fits the training window).

    ``template``: the chat template and its arguments (``enable_thinking=False``) every prompt is
    rendered with, as the serving engine would; recorded in each record's ``meta["chat_template"]``,
    and each answer keeps the ids the target generated (``token_ids``: training uses them as they are).
    Each answer is stored as the template reads it: its reasoning (``reasoning_content``, split from the
    generated text by the family's own markers, learned from the template: ``vatspec.data.reasoning``) apart
    from its ``content``, with the generated ids and the stop id that ended them (``stop_token_id``; None
    when the row was cut). ``reasoning``: ``keep`` keeps the reasoning (the target served in thinking mode
    writes it, so the draft learns it); ``drop`` stores the content alone, without ids, so the answer trains
    as the template renders it without reasoning, and the next turn's history holds none.
    A conversation with tool calls keeps the data's calls and their results (a result answers the call that
    was made) and the target answers every user turn and every tool result that no call follows.
    A template that stamps today's date renders the one pinned (``template.date``), else today's, recorded
    with the settings.

    Resumable: each finished conversation is appended as one JSON line (flush + fsync); a
    restart skips ids already in the file, after cutting off a partial last line. An existing
    ``out_path`` that is not this function's output (``is_regenerated``) is an ``OutputError``
    before anything is written or cut.
    Conversations are batched longest prompts first, left-padded: ``batch_size`` at most, and with
    ``batch_tokens`` at most that many first-prompt tokens (rows x the longest row), so short prompts run
    in wide batches and long ones, whose prefill a wide batch slows, in narrow ones. A row that is done
    (an end token, its budget, its training length) leaves the batch (``generate_rows``).
    """
    from tqdm.auto import tqdm

    tok = target.tokenizer
    template = template or ChatTemplate()
    require_template(tok, template)
    if reasoning not in ("keep", "drop"):
        raise DataError(f"reasoning must be keep or drop, got {reasoning!r}")
    out_path = Path(out_path)
    done, recorded = _resume(out_path)
    template = pin_date(template, tok, recorded, today=True)  # a resumed file keeps the day it was begun on
    settings = template.settings(tok)
    check_settings(recorded, settings, str(out_path), "this regenerate")
    ids = [c.id for c in convs]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise DataError(f"regenerate: conversation ids must be unique; {dup!r} repeats")
    todo = [c for c in convs if c.id not in done]
    src = {c.id: c for c in todo}
    stats = RegenStats(skipped_done=len(convs) - len(todo))
    todo = longest_first(todo)
    eos = list(target.eos_token_ids)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else eos[0]
    out_path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    bar = tqdm(total=len(todo), unit="conv", desc="regenerate", disable=not progress)
    with open(out_path, "a", encoding="utf-8") as f:
        for chunk in _batches(todo, tok, batch_size, batch_tokens, template):
            gen = torch.Generator(target.device).manual_seed(zlib.crc32(f"{seed}:{chunk[0].id}".encode()))
            for conv, finishes in _regenerate_batch(chunk, target, eos, pad_id, max_new_tokens, temperature, top_p,
                                                    max_prompt_tokens, max_length, stats, gen, template,
                                                    reasoning):
                if not finishes:
                    stats.too_long += 1
                    continue
                meta = dict(conv.meta, finish=finishes, chat_template=settings, source=source_sha256(src[conv.id]))
                rec = Conversation(conv.id, conv.messages, meta, conv.tools).to_json()
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


def longest_first(convs: Sequence[Conversation]) -> list[Conversation]:
    """The order ``regenerate`` batches conversations in: longest prompt text first (stable)."""
    return sorted(convs, key=lambda c: -sum(len(m["content"]) for m in c.messages if m["role"] != "assistant"))


def regen_plan(messages: list[dict]) -> list[tuple[dict, bool]]:
    """The messages regeneration keeps, in order, each with whether the target answers after it: the data's
    answers are dropped, its tool calls kept (the tool results after them answer those calls); the target
    answers after every user turn and every tool result that no call or further result follows."""
    kept = [m for m in messages if m["role"] != "assistant" or m.get("tool_calls")]
    plan = []
    for k, m in enumerate(kept):
        nxt = kept[k + 1] if k + 1 < len(kept) else None
        follows = nxt is not None and (nxt["role"] == "tool" or nxt["role"] == "assistant")
        plan.append((m, m["role"] in ("user", "tool") and not follows))
    return plan


def answer_message(text: str, ids: list[int] | None, stop: int | None, fmt: ReasoningFormat | None,
                   reasoning: str, thought: str | None = None) -> tuple[dict, bool]:
    """``(message, dropped)``: a generated answer as a record stores it. ``thought``: the reasoning a server's
    parser returned apart; else it is split from ``text`` by ``fmt``. ``reasoning="drop"`` keeps the content
    alone and no ids (they hold the reasoning); ``dropped`` says a reasoning was dropped. An answer cut inside its
    reasoning (or a harmony analysis followed by a call: no final channel) has no content to keep alone: it is
    kept as generated, with its ids."""
    whole = text
    if thought is None and fmt is not None:
        thought, text = fmt.split(text)
    if reasoning == "drop" and thought is not None and text:
        return {"role": "assistant", "content": text}, True
    if reasoning == "drop" and thought is not None and ids is not None:  # cut inside its reasoning: no answer
        thought, text = None, whole  # to keep alone: kept as generated, its ids trained as they are
    msg = {"role": "assistant", "content": text}
    if thought is not None:
        msg["reasoning_content"] = thought
    if ids is not None:
        msg["token_ids"] = ids
        msg["stop_token_id"] = stop
    return msg, False


def _batches(convs: list[Conversation], tok, batch_size: int, batch_tokens: int | None,
             template: ChatTemplate | None = None):
    """``convs`` (longest first) in consecutive batches of at most ``batch_size`` rows and, with
    ``batch_tokens``, at most that many first-prompt tokens counted as rows x the longest (one row at least)."""
    batch: list[Conversation] = []
    widest = 0
    for c in convs:
        n = _first_prompt_len(c, tok, template) if batch_tokens else 0
        if batch and (len(batch) == batch_size or (batch_tokens and (len(batch) + 1) * max(widest, n) > batch_tokens)):
            yield batch
            batch, widest = [], 0
        batch.append(c)
        widest = max(widest, n)
    if batch:
        yield batch


def shortest_prompt(convs: Sequence[Conversation], tok, template: ChatTemplate | None = None) -> int:
    """The fewest tokens a conversation's first prompt (rendered for generation) holds; 0 for no conversation."""
    return min((n for c in convs if (n := _first_prompt_len(c, tok, template))), default=0)


def _first_prompt_len(conv: Conversation, tok, template: ChatTemplate | None = None) -> int:
    plan = regen_plan(conv.messages)
    first = next((k for k, (_, answer) in enumerate(plan) if answer), None)
    if first is None:  # nothing to answer: regenerate writes no record for it
        return 0
    text = (template or ChatTemplate()).render(tok, [m for m, _ in plan[: first + 1]], generation_prompt=True,
                                               tools=conv.tools)
    return len(tok(text, add_special_tokens=False)["input_ids"])


# tokens generated past the training length: a cut inside a word would re-tokenize the word's head
CUT_MARGIN = 8


def _regenerate_batch(convs, target, eos, pad_id, max_new_tokens, temperature, top_p, max_prompt_tokens, max_length,
                      stats, generator, template, reasoning):
    """Run the rounds of a batch together; yields ``(conversation, finish reasons)`` per input."""
    tok = target.tokenizer
    fmt = reasoning_format(template, tok)
    pending = [regen_plan(c.messages) for c in convs]
    history: list[list[dict]] = [[] for _ in convs]
    finishes: list[list[str]] = [[] for _ in convs]
    stopped = [False] * len(convs)
    while True:
        # 1. advance each conversation to its next answer
        rows, prompts, budgets = [], [], []
        for j, plan in enumerate(pending):
            while plan and not stopped[j]:
                m, answer = plan.pop(0)
                history[j].append(m)
                if answer:
                    text = template.render(tok, history[j], generation_prompt=True, tools=convs[j].tools)
                    p = tok(text, add_special_tokens=False)["input_ids"]
                    budget = turn_budget(len(p), bool(finishes[j]), max_new_tokens, max_prompt_tokens, max_length)
                    if budget is None:
                        history[j].pop()
                        stopped[j] = True
                        break
                    rows.append(j)
                    prompts.append(p)
                    budgets.append(budget)
                    break
        if not rows:
            break
        # 2. generate: each row until an end token, max_new_tokens, or (max_length) the training length + margin
        news = generate_rows(target, prompts, budgets, eos=eos, pad_id=pad_id, temperature=temperature,
                             top_p=top_p, generator=generator)
        # 3. cut each row at its first end token; the text and the ids exclude it, the record keeps which it was
        for new, j in zip(news, rows):
            stop = next((k for k, t in enumerate(new) if t in eos), None)
            finishes[j].append("length" if stop is None else "stop")
            stats.truncated_turns += stop is None
            kept = new if stop is None else new[:stop]
            stats.new_tokens += len(kept) + (stop is not None)
            stats.turns += 1
            answer, dropped = answer_message(tok.decode(kept, skip_special_tokens=False), kept,
                                             None if stop is None else new[stop], fmt, reasoning)
            stats.reasoning_dropped += dropped
            history[j].append(answer)
    for j, conv in enumerate(convs):
        # trailing turns after the last answer carry nothing to train on
        while history[j] and history[j][-1]["role"] != "assistant":
            history[j].pop()
        yield Conversation(conv.id, history[j], conv.meta, conv.tools), finishes[j]


def turn_budget(n_prompt: int, answered: bool, max_new_tokens: int, max_prompt_tokens: int,
                max_length: int | None) -> int | None:
    """The new tokens a turn may generate after a prompt of ``n_prompt`` tokens: ``max_new_tokens``, and with
    ``max_length`` no further than the training length and ``CUT_MARGIN``. None: the conversation ends before
    this turn (its prompt is over ``max_prompt_tokens``, or, ``answered``, it already fills ``max_length``)."""
    if n_prompt > max_prompt_tokens or (max_length is not None and answered and n_prompt >= max_length):
        return None
    return max_new_tokens if max_length is None else min(max_new_tokens, max(1, max_length + CUT_MARGIN - n_prompt))


@torch.no_grad()
def generate_rows(target, prompts: list[list[int]], budgets: list[int], *, eos, pad_id: int, temperature: float = 0.0,
                  top_p: float = 1.0, generator: torch.Generator | None = None) -> list[list[int]]:
    """Each prompt's continuation by ``target`` (a ``vatspec.target.Target``): at most ``budgets[r]`` new
    tokens, ending at the first of ``eos`` (kept). The rows run together, left-padded, with a KV cache;
    greedy when ``temperature == 0`` (the tokens of Hugging Face ``generate``), else sampled with ``top_p``.

    A row that is done leaves the batch once an eighth of the live rows are done (its cache rows are
    dropped: one copy of the cache), so a wide batch costs what its live rows cost, where ``generate``
    runs every row until the last one ends. The linears run as ``F.linear`` at every row count (no
    few-row kernel): that kernel would time itself once for each of the 1-16 row counts a shrinking batch
    passes, to speed up only a batch's last few steps."""
    device = target.device
    n = len(prompts)
    ids, attn = (t.to(device) for t in left_pad(prompts, pad_id))
    pos = (attn.cumsum(-1) - 1).clamp_min(0)
    last = torch.zeros_like(attn, dtype=torch.bool)
    last[:, -1] = True
    tout = target(ids, attn, logits_at=last, position_ids=pos, use_cache=True)
    logits, cache, pos = tout.logits, tout.past_key_values, pos[:, -1:]
    eos_t = torch.tensor(list(eos), device=device)
    budget = torch.tensor(budgets, device=device)
    live = torch.arange(n, device=device)  # the prompt of each cache row
    done = torch.zeros(n, dtype=torch.bool, device=device)  # per cache row
    out: list[list[int]] = [[] for _ in range(n)]
    for step in range(1, max(budgets) + 1):
        nxt = _next_tokens(logits, temperature, top_p, generator)
        for r, t, d in zip(live.tolist(), nxt.tolist(), done.tolist()):
            if not d:
                out[r].append(t)
        done |= torch.isin(nxt, eos_t) | (budget[live] <= step)
        n_done = int(done.sum())
        if n_done == len(live):
            break
        if n_done * 8 >= len(live):  # drop the finished rows
            keep = (~done).nonzero().squeeze(1)
            keep_rows(cache, keep)
            live, nxt, attn, pos, done = live[keep], nxt[keep], attn[keep], pos[keep], done[keep]
        attn = torch.cat([attn, attn.new_ones(len(live), 1)], 1)
        pos = pos + 1
        logits = target(nxt[:, None], attn, position_ids=pos, past_key_values=cache, use_cache=True).logits[:, -1]
    return out


def keep_rows(cache, keep: torch.Tensor) -> None:
    """Keep the batch rows ``keep`` of a transformers cache, in every kind of layer: attention keys and values
    (``batch_select_indices``) and the convolution and recurrent states of linear-attention / Mamba layers, which
    ``batch_select_indices`` leaves alone (or lacks) and ``reorder_cache`` selects along the batch."""
    from transformers.cache_utils import LinearAttentionCacheLayerMixin

    for layer in getattr(cache, "layers", None) or [cache]:
        linear = isinstance(layer, LinearAttentionCacheLayerMixin)
        if linear:
            LinearAttentionCacheLayerMixin.reorder_cache(layer, keep)
        if not linear or hasattr(layer, "keys"):  # attention, or the attention half of a hybrid layer (Falcon-H1)
            layer.batch_select_indices(keep)


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)`` ``[len(prompts), longest]``: each prompt at the right end of its row."""
    T = max(map(len, prompts))
    ids = torch.full((len(prompts), T), pad_id, dtype=torch.long)
    attn = torch.zeros((len(prompts), T), dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, T - len(p):] = torch.tensor(p)
        attn[r, T - len(p):] = 1
    return ids, attn


def _next_tokens(logits: torch.Tensor, temperature: float, top_p: float, generator) -> torch.Tensor:
    """Greedy (``temperature == 0``), else sampled from the ``top_p`` nucleus of ``softmax(logits / temperature)``."""
    if temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        p_sorted, idx = probs.sort(dim=-1, descending=True)
        outside = p_sorted.cumsum(-1) - p_sorted >= top_p  # the most likely token always stays
        probs = torch.zeros_like(probs).scatter_(-1, idx, p_sorted.masked_fill(outside, 0.0))
    # the generator's device: a model split over devices (device_map) has its logits on the last one
    dev = generator.device if generator is not None else probs.device
    return torch.multinomial(probs.to(dev), 1, generator=generator).squeeze(1).to(logits.device)


def source_sha256(conv: Conversation) -> str:
    """The identity of the input conversation a record was regenerated from (its id aside): the sha256 of its
    messages' roles and texts, recorded as ``meta["source"]``."""
    msgs = [[m["role"], m["content"]] + ([m["tool_calls"]] if m.get("tool_calls") else []) for m in conv.messages]
    if conv.tools:  # a conversation without tools hashes as before tools were read
        msgs.append(conv.tools)
    return hashlib.sha256(json.dumps(msgs, ensure_ascii=False).encode()).hexdigest()


def check_same_input(records: Sequence[dict], convs: Sequence[Conversation], out: str, source: str) -> None:
    """An existing ``--out`` resumes only the regeneration of this input: each record's id must name a
    conversation of ``convs`` with the messages it was regenerated from (``meta["source"]``); the records of
    another input (their own ids, or the same ids with other prompts) are refused before anything is written."""
    by_id = {c.id: c for c in convs}
    for n, rec in enumerate(records, 1):
        conv = by_id.get(rec["id"])
        if conv is None:
            raise OutputError(f"{out}:{n}: conversation {rec['id']!r} is not in {source}: {out} holds another "
                              "input's regeneration; give another --out")
        recorded = rec["meta"].get("source")
        if recorded is not None and recorded != source_sha256(conv):
            raise OutputError(f"{out}:{n}: conversation {rec['id']!r} was regenerated from other messages than "
                              f"{source}'s {rec['id']!r}: {out} holds another input's regeneration; give another --out")


def is_regenerated(rec) -> bool:
    """A record ``regenerate`` writes: ``{"id", "messages": [...], "meta": {..., "finish": [...]}}``."""
    return (isinstance(rec, dict) and isinstance(rec.get("id"), str) and isinstance(rec.get("messages"), list)
            and isinstance(rec.get("meta"), dict) and isinstance(rec["meta"].get("finish"), list))


def _resume(path: Path) -> tuple[set[str], dict | None]:
    """``(ids already written to path, the template settings its records were made with)``; cuts off a partial
    last line left by an interrupted run, once the file is known to be regenerate's output."""
    if not path.exists():
        return set(), None
    records, keep = own_jsonl(path, is_regenerated, "--out", tail_prefix=b'{"id": ')
    if keep < path.stat().st_size:
        log.warning("%s: cut off a partial last line (%d bytes) from an interrupted run", path,
                    path.stat().st_size - keep)
        with open(path, "rb+") as f:
            f.truncate(keep)
    settings = next((r["meta"]["chat_template"] for r in records if isinstance(r["meta"].get("chat_template"), dict)),
                    None)
    return {r["id"] for r in records}, settings
