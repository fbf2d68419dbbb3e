"""Regeneration through serving engines: the chat-completions API of vLLM, SGLang, TGI, the llama.cpp
server and ``transformers serve``, several servers at once, resumable.

    stats = regenerate_endpoints(convs, ["http://127.0.0.1:8000"], "Qwen/Qwen3-8B", tokenizer, eos_ids,
                                 "regen.jsonl", template=template, concurrency=8)

Each conversation is regenerated turn by turn with its regenerated history (``last_turn_only``: the
original history, one answer), greedy unless told otherwise, each request carrying the template
arguments (``chat_template_kwargs``). Workers (``concurrency`` per endpoint) take conversations from
one queue, so a faster server takes more. The output records are ``regenerate``'s (the same resume and
ownership rules), with the endpoint, the model and the server's finish reasons in ``meta``, and the
generated ids on each answer when the server returns them (vLLM's ``return_token_ids``); else training
re-tokenizes the text. A request that fails with a 5xx, a timeout or a dropped connection is retried with
backoff; a conversation that keeps failing is written to ``OUT.failed.jsonl`` and counted, and the next
run retries it. So is one whose answer is malformed or cut (``_check_answer``). The API key of a server started
with ``--api-key`` (or a hosted one) is read from ``VATSPEC_API_KEY``, else ``OPENAI_API_KEY``, sent as
``Authorization: Bearer`` and written nowhere; a URL holding credentials, a query or a fragment is refused.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import queue
import threading
import time
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from vatspec.data.chat import ChatTemplate, check_settings, first_difference, pin_date
from vatspec.data.reasoning import ReasoningFormat, reasoning_format
from vatspec.data.records import Conversation, DataError
from vatspec.data.regen import (
    RegenStats,
    _resume,
    answer_message,
    longest_first,
    regen_plan,
    source_sha256,
    turn_budget,
)
from vatspec.data.tools import tool_calls
from vatspec.outputs import own_jsonl

log = logging.getLogger(__name__)

BACKOFF_S = 0.5  # the first retry's wait; doubled each time
KEY_VARS = ("VATSPEC_API_KEY", "OPENAI_API_KEY")  # the servers' API key, first set one wins; never a flag (ps shows it)
FINISHED = ("stop", "length", "tool_calls")  # tool_calls: vLLM, transformers serve and OpenAI end a call so


def api_key() -> str | None:
    """The API key from the environment (``KEY_VARS``), or None."""
    return next((os.environ[v] for v in KEY_VARS if os.environ.get(v)), None)


def check_url(url: str) -> None:
    """A ``DataError`` of one line for a URL that would carry a secret into the outputs and messages: credentials
    (``user:pass@``), a query or a fragment (where a token hides); the secret part shown as ``***``."""
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 - a bad port raises here
    except ValueError as e:
        raise DataError(f"--endpoint: not a URL ({e})") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise DataError(f"--endpoint {'***' if '@' in url else url}: not an http(s)://HOST[:PORT] URL")
    host = parts.netloc.rpartition("@")[2]
    shown = urllib.parse.urlunsplit((parts.scheme, ("***@" if "@" in parts.netloc else "") + host, parts.path,
                                     "***" if parts.query else "", "***" if parts.fragment else ""))
    if "@" in parts.netloc:
        raise DataError(f"--endpoint {shown}: a URL with credentials is refused (it would be written to the outputs); "
                        f"give the API key as VATSPEC_API_KEY or OPENAI_API_KEY")
    if parts.query or parts.fragment or url.rstrip().endswith(("?", "#")):
        raise DataError(f"--endpoint {shown}: a URL with a query or a fragment is refused (a token there would be "
                        f"written to the outputs); give the API key as VATSPEC_API_KEY or OPENAI_API_KEY")


class EndpointError(RuntimeError):
    """A request failed: ``transient`` (retried: 5xx, 408, 429, a timeout, a dropped connection) or not."""

    def __init__(self, message: str, transient: bool):
        super().__init__(message)
        self.transient = transient


@dataclass
class Endpoint:
    """One OpenAI-compatible server: ``url`` with or without its ``/v1``."""

    url: str
    timeout: float = 600.0
    token_ids: bool = False  # the server returns the generated ids (found by ``check_endpoints``)
    requests: int = field(default=0, compare=False)
    key: str | None = field(default_factory=api_key, repr=False, compare=False)  # never printed nor written

    @property
    def base(self) -> str:
        url = self.url.rstrip("/")
        return url if url.endswith("/v1") else url + "/v1"

    def call(self, path: str, body: dict | None = None) -> dict:
        """GET (``body`` None) or POST JSON to ``base + path``; the decoded JSON answer. ``timeout`` bounds the
        whole request (a server that trickles its answer a byte at a time times out too)."""
        data = None if body is None else json.dumps(body).encode()
        try:
            status, raw = fetch(self.base + path, data, self.timeout, self.key)
        except TimeoutError:
            raise EndpointError(f"{self.url}: no complete answer within --timeout {self.timeout:g} s", True) from None
        except (OSError, http.client.HTTPException) as e:
            raise EndpointError(f"{self.url}: {type(e).__name__}: {e}", True) from None
        finally:
            self.requests += 1
        if status in (401, 403):
            raise EndpointError(f"{self.url}: HTTP {status} (set VATSPEC_API_KEY or OPENAI_API_KEY to the "
                                f"server's API key)", False)
        if not 200 <= status < 300:
            detail = raw[:300].decode("utf-8", "replace")
            raise EndpointError(f"{self.url}: HTTP {status}: {detail}", status >= 500 or status in (408, 429))
        try:
            return json.loads(raw)
        except ValueError:
            raise EndpointError(f"{self.url}: the answer is not JSON: {raw[:120]!r}", True) from None


def fetch(url: str, data: bytes | None = None, timeout: float = 30.0, key: str | None = None,
          accept: str = "application/json") -> tuple[int, bytes]:
    """``(HTTP status, body)`` of a GET (``data`` None) or a JSON POST to ``url``; ``timeout`` bounds the whole
    request (``TimeoutError``)."""
    deadline = time.monotonic() + timeout
    conn, sock, resp = open_request(url, data, timeout, key, accept)
    try:
        return resp.status, b"".join(body_chunks(resp, sock, deadline))
    finally:
        conn.close()


def open_request(url: str, data: bytes | None, timeout: float, key: str | None = None,
                 accept: str = "application/json"):
    """GET (``data`` None) or POST JSON ``data`` to ``url``: ``(connection, socket, response)`` once the response's
    head has arrived; the caller closes the connection. ``key``: sent as ``Authorization: Bearer``."""
    parts = urllib.parse.urlsplit(url)
    headers = {"Content-Type": "application/json", "Accept": accept}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    conn_cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    conn = conn_cls(parts.hostname, parts.port, timeout=timeout)
    try:
        conn.request("GET" if data is None else "POST", parts.path, data, headers)
        sock = conn.sock  # the response reads it; the connection lets go of it when the server closes after
        return conn, sock, conn.getresponse()
    except BaseException:
        conn.close()
        raise


def body_chunks(resp: http.client.HTTPResponse, sock, deadline: float):
    """The body of ``resp`` chunk by chunk as it arrives, read from ``sock`` before the monotonic ``deadline``
    (else ``TimeoutError``): a whole request bounded, not one read."""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        if sock is not None:
            sock.settimeout(left)
        chunk = resp.read1(65536)
        if not chunk:
            return
        yield chunk


def check_endpoints(endpoints: list[Endpoint], model: str, probe: dict, retries: int = 2) -> None:
    """Before any work: each endpoint answers, serves ``model``, and accepts ``probe`` (a request shaped as
    the real ones, one token; a transient failure retried). Finds which return token ids. A ``DataError``
    of one line otherwise."""
    for ep in endpoints:
        try:
            served = [m.get("id") for m in _retried(ep, "/models", None, retries).get("data", [])]
        except EndpointError as e:
            raise DataError(f"--endpoint {ep.url}: does not answer ({e})") from None
        if model not in served:
            raise DataError(f"--endpoint {ep.url} serves {served}, not --model {model!r}")
        body = {**probe, "model": model, "max_tokens": 1}
        try:
            _retried(ep, "/chat/completions", {**body, "return_token_ids": True}, retries)
            ep.token_ids = True
        except EndpointError as e:
            if e.transient:
                raise DataError(f"--endpoint {ep.url}: a first request failed ({e})") from None
            try:  # a server that refuses the field (transformers serve: HTTP 422): text only
                _retried(ep, "/chat/completions", body, retries)
            except EndpointError as e2:
                raise DataError(f"--endpoint {ep.url}: refuses the request ({e2})") from None


def _retried(ep: Endpoint, path: str, body: dict | None, retries: int, job: _Job | None = None) -> dict:
    """``ep.call`` again after a transient failure, ``retries`` times at most, waiting ``BACKOFF_S`` doubling."""
    for attempt in range(retries + 1):
        try:
            return ep.call(path, body)
        except EndpointError as e:
            if not e.transient or attempt == retries:
                raise
            if job is not None:
                job.retried += 1
            time.sleep(BACKOFF_S * 2**attempt)
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class _Run:
    """What every request of a run carries (``body``) and how its answers are read and checked."""

    model: str
    tokenizer: Any
    template: ChatTemplate
    eos: frozenset[int]
    max_new_tokens: int
    temperature: float
    top_p: float
    seed: int
    max_prompt_tokens: int
    max_length: int | None
    reasoning: str
    last_turn_only: bool
    retries: int
    format: ReasoningFormat | None = None  # the template's reasoning markers

    def body(self, messages: list[dict], max_tokens: int) -> dict:
        body = {"model": self.model, "messages": [_wire(m) for m in messages], "max_tokens": max_tokens,
                "temperature": self.temperature}
        if self.temperature > 0:
            body.update(top_p=self.top_p, seed=self.seed)
        kwargs = self.template.kwargs
        if kwargs:
            body["chat_template_kwargs"] = kwargs
            if "reasoning_effort" in kwargs:  # vLLM renders gpt-oss with harmony: it reads the request's own
                body["reasoning_effort"] = kwargs["reasoning_effort"]
        if self.template.text is not None:
            body["chat_template"] = self.template.text
        return body


@dataclass
class _Job:
    conv: Conversation
    record: dict | None = None
    error: str | None = None
    endpoint: str = ""
    retried: int = 0
    prompts_checked: int = 0  # answers whose prompt ids the server returned
    prompts_same: int = 0  # ... equal to this project's rendering of the prompt
    prompt_differs_at: list = field(default_factory=list)  # the first differing position of each other one
    dropped: int = 0  # reasoning dropped (reasoning="drop")
    tokens: int = 0
    turns: int = 0
    cut: int = 0


def regenerate_endpoints(
    convs: Sequence[Conversation],
    urls: Sequence[str],
    model: str,
    tokenizer,
    eos_ids: Sequence[int],
    out_path: str | os.PathLike,
    *,
    concurrency: int = 4,
    max_new_tokens: int = 512,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    max_prompt_tokens: int = 2048,
    max_length: int | None = None,
    template: ChatTemplate | None = None,
    reasoning: str = "keep",
    last_turn_only: bool = False,
    retries: int = 5,
    timeout: float = 600.0,
    progress: bool = True,
) -> RegenStats:
    """``regenerate`` through servers (module docstring); returns the counts (``retried``, ``failed``,
    ``truncated_turns``: cut at ``max_tokens``). ``tokenizer`` renders the prompts locally to count
    them (``max_prompt_tokens``, ``max_length``) as the in-process path does. One function: the output file,
    the failure file, the workers and the result queue live exactly as long as each other."""
    from tqdm.auto import tqdm

    for url in urls:  # before anything is read, written or sent
        check_url(url)
    template = template or ChatTemplate()
    out_path = Path(out_path)
    failed_path = out_path.with_name(out_path.name + ".failed.jsonl")
    endpoints = [Endpoint(u, timeout) for u in urls]
    ids = [c.id for c in convs]
    if len(set(ids)) != len(ids):
        raise DataError("regenerate: conversation ids must be unique")
    if failed_path.exists():
        own_jsonl(failed_path, lambda r: isinstance(r.get("id"), str) and "error" in r, "--out's failure list")
    done, recorded = _resume(out_path)
    todo = longest_first([c for c in convs if c.id not in done])
    stats = RegenStats(skipped_done=len(convs) - len(todo))
    if not todo:
        return stats
    run = _Run(model, tokenizer, template, frozenset(eos_ids), max_new_tokens, temperature, top_p, seed,
               max_prompt_tokens, max_length, reasoning, last_turn_only, retries)
    check_endpoints(endpoints, model, run.body([{"role": "user", "content": "Hi"}], 1), retries)
    template = pin_date(template, tokenizer, recorded, today=True)  # a resumed file keeps the day it was begun on
    settings = template.settings(tokenizer)
    check_settings(recorded, settings, str(out_path), "this regenerate")
    fmt = reasoning_format(template, tokenizer)
    special = [t for t in getattr(tokenizer, "all_special_tokens", []) if fmt and t in fmt.opener + fmt.separator]
    if special and not any(ep.token_ids for ep in endpoints):
        log.warning("the servers return no token ids, and the reasoning markers are special tokens (%s) that a server "
                    "drops from its text (transformers serve does): without its reasoning parser the reasoning cannot "
                    "be told apart from the answer; prefer a server that returns token ids (vLLM) or parses "
                    "reasoning (--reasoning-parser)", ", ".join(special))
    run = replace(run, template=template, format=fmt)
    jobs: queue.Queue = queue.Queue()
    for c in todo:
        jobs.put(c)
    results: queue.Queue = queue.Queue()
    stop = threading.Event()
    workers = [threading.Thread(target=_worker, args=(ep, jobs, results, stop, run), daemon=True)
               for ep in endpoints for _ in range(concurrency)]
    out_path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    bar = tqdm(total=len(todo), unit="conv", desc="regenerate", disable=not progress)
    with open(out_path, "a", encoding="utf-8") as f, open(failed_path, "w", encoding="utf-8") as bad:
        for w in workers:
            w.start()
        try:
            for _ in range(len(todo)):
                job: _Job = results.get()
                stats.retried += job.retried
                if job.error is not None:
                    stats.failed += 1
                    bad.write(json.dumps({"id": job.conv.id, "endpoint": job.endpoint, "error": job.error}) + "\n")
                    bad.flush()
                elif job.record is None:
                    stats.too_long += 1
                else:
                    job.record["meta"].update(chat_template=settings, endpoint=job.endpoint, model=run.model,
                                              source=source_sha256(job.conv))
                    f.write(json.dumps(job.record, ensure_ascii=False) + "\n")
                    f.flush()
                    os.fsync(f.fileno())
                    stats.conversations += 1
                    stats.turns += job.turns
                    stats.new_tokens += job.tokens
                    stats.truncated_turns += job.cut
                    stats.reasoning_dropped += job.dropped
                    stats.prompts_checked += job.prompts_checked
                    stats.prompts_same += job.prompts_same
                    stats.prompt_differs_at += job.prompt_differs_at
                stats.seconds = time.perf_counter() - t0
                reqs = sum(ep.requests for ep in endpoints)
                bar.update(1)
                bar.set_postfix(req_s=f"{reqs / max(stats.seconds, 1e-9):.2f}", tok_s=f"{stats.tokens_per_s:.1f}")
        finally:
            stop.set()  # Ctrl-C: the workers stop after their request; every written line is whole
            bar.close()
    if not stats.failed:
        failed_path.unlink(missing_ok=True)
    stats.requests = sum(ep.requests for ep in endpoints)
    stats.seconds = time.perf_counter() - t0
    return stats


def _worker(ep: Endpoint, jobs: queue.Queue, results: queue.Queue, stop: threading.Event, run: _Run) -> None:
    while not stop.is_set():
        try:
            conv = jobs.get_nowait()
        except queue.Empty:
            return
        job = _Job(conv, endpoint=ep.url)
        try:
            _run_conversation(ep, job, run, stop)
        except EndpointError as e:
            job.error = str(e)
        except Exception as e:  # noqa: BLE001 - a bad answer fails this conversation, never the run
            job.error = f"{type(e).__name__}: {e}"
        results.put(job)


def _run_conversation(ep: Endpoint, job: _Job, run: _Run, stop: threading.Event) -> None:
    """Answer each user turn and tool result of ``job.conv`` that regeneration answers (``regen_plan``), or only its
    last user turn (``last_turn_only``); sets ``job.record``."""
    tok, tools = run.tokenizer, job.conv.tools
    msgs = job.conv.messages
    if run.last_turn_only:
        last = max((i for i, m in enumerate(msgs) if m["role"] == "user"), default=None)
        if last is None:
            return
        history, pending = [dict(m) for m in msgs[:last]], [(msgs[last], True)]
    else:
        history, pending = [], regen_plan(msgs)
    context = len(history)  # original answers before this index are context, not supervised
    finishes = []
    while pending and not stop.is_set():
        m, answers = pending.pop(0)
        history.append(dict(m))
        if not answers:
            continue
        prompt = tok(run.template.render(tok, history, generation_prompt=True, tools=tools),
                     add_special_tokens=False)["input_ids"]
        budget = turn_budget(len(prompt), bool(finishes), run.max_new_tokens, run.max_prompt_tokens, run.max_length)
        if budget is None:
            history.pop()
            break
        answer, finish = _answer(ep, job, history, tools, budget, run, prompt)
        history.append(answer)
        finishes.append(finish)
    while history and history[-1]["role"] != "assistant":
        history.pop()
    if not finishes:
        return
    meta = dict(job.conv.meta, finish=finishes)
    if context:
        meta["context_turns"] = context
    job.record = Conversation(job.conv.id, history, meta, tools).to_json()


def _answer(ep: Endpoint, job: _Job, history: list[dict], tools, budget: int, run: _Run,
            prompt: list[int]) -> tuple[dict, str]:
    """One answer from the server, stored as a record holds it (``answer_message``): its reasoning apart (the
    server's reasoning parser, else the template's markers), its tool calls, the generated ids, the stop id
    that ended them and the engine's own prompt ids, where the server returns them. ``prompt``: this project's
    rendering of the prompt, counted against the engine's."""
    body = run.body(history, budget)
    if tools:
        body["tools"] = tools
    if ep.token_ids:
        body["return_token_ids"] = True
    resp = _retried(ep, "/chat/completions", body, run.retries, job)
    _check_answer(resp, ep.url, run.model, len(run.tokenizer))
    choice = resp["choices"][0]
    message = choice.get("message") or {}
    thought = message.get("reasoning_content") or message.get("reasoning")  # a server's reasoning parser
    ids = choice.get("token_ids")
    finish = "length" if choice.get("finish_reason") == "length" else "stop"
    stop = None
    if isinstance(ids, list):
        ids = list(ids)
        if ids and ids[-1] in run.eos:  # the end token is not part of the answer (as in-process): kept apart
            stop = ids.pop()
        elif finish == "stop" and isinstance(choice.get("stop_reason"), int):  # vLLM: the stop id it ended on
            stop = choice["stop_reason"]
    else:
        ids = None
    answer, dropped = answer_message(message.get("content") or "", ids, stop, run.format, run.reasoning,
                                     thought or None)
    if "token_ids" in answer and finish == "stop" and stop is None:
        del answer["stop_token_id"]  # it stopped on a token the server did not return: the template's is learned
    calls = message.get("tool_calls")
    if calls:  # the server's tool parser: structured calls, checked as records are (a bad one: kept as text, ids)
        try:
            answer["tool_calls"] = tool_calls(calls, f"{ep.url}: tool_calls")
        except DataError as e:
            log.warning("%s; the answer is kept as its text and ids", e)
    engine_prompt = resp.get("prompt_token_ids")
    if isinstance(engine_prompt, list) and "token_ids" in answer:
        answer["prompt_token_ids"] = engine_prompt
        job.prompts_checked += 1
        if engine_prompt == prompt:
            job.prompts_same += 1
        else:
            job.prompt_differs_at.append(first_difference(engine_prompt, prompt))
    job.dropped += dropped
    usage = resp.get("usage") or {}
    job.tokens += int(usage.get("completion_tokens") or len(ids or []))
    job.turns += 1
    job.cut += finish == "length"
    return answer, finish


def _check_answer(resp, url: str, model: str, vocab: int) -> None:
    """An answer that is whole and this model's, or ``EndpointError`` (not retried: the conversation fails and is
    listed, and a rerun retries it): its ids ints in [0, ``vocab``), its finish ``stop``, ``length`` or
    ``tool_calls`` (``abort``, ``error``: a cut answer is not trained as complete), some content, tool calls or
    reasoning, and ``model`` (or none) in its ``model`` field."""
    def bad(why: str):
        return EndpointError(f"{url}: a bad answer: {why}", False)

    choices = resp.get("choices") if isinstance(resp, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise bad("no choices")
    named = resp.get("model")
    if named is not None and named not in (model, f"{model}@main"):  # transformers serve: repo@revision
        raise bad(f"it names model {named!r:.80}, not --model {model!r}")
    choice = choices[0]
    finish = choice.get("finish_reason")
    if finish not in FINISHED:
        raise bad(f"finish_reason {finish!r:.40} (the answer is cut or failed)")
    for key, ids in (("token_ids", choice.get("token_ids")), ("prompt_token_ids", resp.get("prompt_token_ids"))):
        if ids is None:
            continue
        if not isinstance(ids, list):
            raise bad(f"{key} is not a list")
        wrong = [i for i in ids if type(i) is not int or not 0 <= i < vocab][:1]
        if wrong:
            raise bad(f"{key} holds {wrong[0]!r:.40}, not a token id in [0, {vocab})")
    message = choice.get("message")
    if not isinstance(message, dict):
        raise bad("no message")
    if message.get("content") is None and not message.get("tool_calls") and not (
            message.get("reasoning_content") or message.get("reasoning")):
        raise bad("content null with no tool calls and no reasoning")


def _wire(m: dict) -> dict:
    """A message as the chat-completions API takes it: tool call arguments as a JSON string, reasoning as
    ``reasoning_content`` (what vLLM and SGLang pass to a template) and ``reasoning`` (what vLLM's harmony
    rendering of gpt-oss reads), no recorded ids."""
    out = {"role": m["role"], "content": m["content"]}
    if m.get("reasoning_content") is not None:
        out["reasoning_content"] = out["reasoning"] = m["reasoning_content"]
    if m.get("tool_calls"):
        out["tool_calls"] = [{**c, "function": {**c["function"], "arguments": json.dumps(c["function"]["arguments"])}}
                             for c in m["tool_calls"]]
    for key in ("name", "tool_call_id"):
        if m.get(key) is not None:
            out[key] = m[key]
    return out


def verify_sample(records: Sequence[dict], target, template: ChatTemplate, n: int) -> dict:
    """The first answer of ``n`` of ``records`` (written through a server) generated again in-process, greedy:
    ``{"sampled", "identical", "share", "first_difference"}`` (the token position where each differing pair
    first parts). The server's ids are its ``token_ids``, else its text tokenized."""
    from vatspec.data.regen import generate_rows

    tok = target.tokenizer
    eos = list(target.eos_token_ids)
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos[0]
    sampled, same, parts = 0, 0, []
    for rec in records[:n]:
        msgs = rec["messages"]
        first = int(rec.get("meta", {}).get("context_turns", 0))
        # the first answer the server generated (a tool call kept from the data has neither ids nor a finish)
        i = next((k for k, m in enumerate(msgs) if m["role"] == "assistant" and k >= first
                  and (m.get("token_ids") is not None or not m.get("tool_calls"))), None)
        if i is None:
            continue
        served = msgs[i].get("token_ids")
        if served is None:
            served = tok(msgs[i]["content"], add_special_tokens=False)["input_ids"]
        stopped = rec["meta"]["finish"][0] == "stop"
        prompt = tok(template.render(tok, msgs[:i], generation_prompt=True, tools=rec.get("tools")),
                     add_special_tokens=False)["input_ids"]
        mine = generate_rows(target, [prompt], [len(served) + stopped], eos=eos, pad_id=pad)[0]
        if mine and mine[-1] in eos:
            mine = mine[:-1]
        sampled += 1
        if mine == list(served):
            same += 1
        else:
            parts.append(first_difference(mine, list(served)))
    return {"sampled": sampled, "identical": same, "share": same / sampled if sampled else None,
            "first_difference": parts}


__all__ = ["Endpoint", "EndpointError", "check_endpoints", "regenerate_endpoints", "verify_sample"]
