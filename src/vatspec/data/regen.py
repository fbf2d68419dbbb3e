"""Regeneration: replace the assistant turns by the target's own responses, resumably."""

from __future__ import annotations

import json
import logging
import os
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from vatspec.data.chat import require_template
from vatspec.data.records import Conversation, DataError
from vatspec.outputs import own_jsonl

log = logging.getLogger(__name__)


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
    max_length: int | None = None,
    progress: bool = True,
) -> RegenStats:
    """Replace each assistant turn by the target's own response; append records to ``out_path``.

    Every user turn gets one response, generated from the regenerated history (the original
    assistant turns are dropped; a prompt-only conversation gets a response per user turn).
    Greedy when ``temperature == 0``. Generation stops at any ``target.eos_token_ids`` (the
    end token is not kept in the text) or after ``max_new_tokens`` (counted in
    ``truncated_turns``). A conversation stops at the first round whose prompt exceeds
    ``max_prompt_tokens``; if that is the first round it is not written (``too_long``).

    ``max_length``: the training length, when known. A round then generates only until every row of
    the batch holds ``max_length`` tokens (prompt included) and a few more, so the words at the cut
    re-tokenize as they would in the whole text: tokens past the training length are never trained
    on, so the training sequences are the same and the long-prompt batches finish sooner. Rows cut
    there finish as ``"length"``. A later user turn whose prompt already holds ``max_length``
    tokens ends the conversation (nothing after it fits the training window).

    Resumable: each finished conversation is appended as one JSON line (flush + fsync); a
    restart skips ids already in the file, after cutting off a partial last line. An existing
    ``out_path`` that is not this function's output (``is_regenerated``) is an ``OutputError``
    before anything is written or cut.
    Conversations are batched ``batch_size`` at a time with left padding, longest prompts first.
    """
    from tqdm.auto import tqdm

    tok = target.tokenizer
    require_template(tok)
    ids = [c.id for c in convs]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise DataError(f"regenerate: conversation ids must be unique; {dup!r} repeats")
    out_path = Path(out_path)
    done = _resume_ids(out_path)
    todo = [c for c in convs if c.id not in done]
    stats = RegenStats(skipped_done=len(convs) - len(todo))
    todo = longest_first(todo)
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
                                                    max_prompt_tokens, max_length, stats):
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


def longest_first(convs: Sequence[Conversation]) -> list[Conversation]:
    """The order ``regenerate`` batches conversations in: longest prompt text first (stable)."""
    return sorted(convs, key=lambda c: -sum(len(m["content"]) for m in c.messages if m["role"] != "assistant"))


# tokens generated past the training length: a cut inside a word would re-tokenize the word's head
CUT_MARGIN = 8


def _regenerate_batch(convs, target, eos, pad_id, max_new_tokens, temperature, top_p, max_prompt_tokens, max_length,
                      stats):
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
                    # an answered conversation (a finish per answer) whose next prompt fills the window
                    past_window = max_length is not None and len(p) >= max_length and bool(finishes[j])
                    if len(p) > max_prompt_tokens or past_window:
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
        if max_length is not None:
            gen_cfg.max_new_tokens = min(max_new_tokens, max(1, max_length + CUT_MARGIN - min(map(len, prompts))))
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


def is_regenerated(rec) -> bool:
    """A record ``regenerate`` writes: ``{"id", "messages": [...], "meta": {..., "finish": [...]}}``."""
    return (isinstance(rec, dict) and isinstance(rec.get("id"), str) and isinstance(rec.get("messages"), list)
            and isinstance(rec.get("meta"), dict) and isinstance(rec["meta"].get("finish"), list))


def _resume_ids(path: Path) -> set[str]:
    """Ids already written to ``path``; cuts off a partial last line left by an interrupted run, once the
    file is known to be regenerate's output."""
    if not path.exists():
        return set()
    records, keep = own_jsonl(path, is_regenerated, "--out", tail_prefix=b'{"id": ')
    if keep < path.stat().st_size:
        log.warning("%s: cut off a partial last line (%d bytes) from an interrupted run", path,
                    path.stat().st_size - keep)
        with open(path, "rb+") as f:
            f.truncate(keep)
    return {r["id"] for r in records}
