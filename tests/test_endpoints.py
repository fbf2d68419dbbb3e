"""Regeneration through OpenAI-compatible servers: faults, resume, several endpoints, token ids.

The server here is a small stand-in on the loopback address, only for the faults a real engine is hard
to make fail on cue (500s, slow answers, dropped connections, a wrong model name, a server that refuses
unknown fields); the main path against a real server is tests/test_serve.py.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

import vatspec.data.endpoints as endpoints_mod
from vatspec.data import Conversation, DataError, load_template
from vatspec.data.endpoints import regenerate_endpoints

MODEL = "stand-in/model"
IM_END = 2  # SmolLM2's <|im_end|>


class StandIn(ThreadingHTTPServer):
    """Answers ``echo: <last user message>``. A prompt holding ``fail500xN`` gets N 500s first, ``always500``
    only 500s, ``slow`` one answer slower than the client's timeout, ``trickle`` one that sends a byte at a time
    for longer than it, ``drop`` one dropped connection.
    ``token_ids``: return the answer's ids when asked (as vLLM); ``strict``: refuse unknown fields (HTTP 422,
    as transformers serve). ``vllm``: as vLLM with a reasoning parser and a tool parser: the prompt's ids (its
    own rendering of the messages, one token more for a prompt holding ``skew``), ``reasoning_content`` apart
    for a prompt holding ``think``, a structured call for one holding ``weather``. Bad answers: ``badid`` returns an
    id past the vocabulary, ``abort`` finish_reason ``abort``, ``nullcontent`` a null content, ``othermodel`` another
    model's name. ``key``: answer only requests carrying ``Authorization: Bearer KEY`` (else 401, as vLLM's
    ``--api-key``); ``auth`` holds the Authorization header of every request."""

    daemon_threads = True

    def __init__(self, tok, token_ids=True, strict=False, vllm=False, key=None):
        super().__init__(("127.0.0.1", 0), Handler)
        self.tok, self.token_ids, self.strict, self.vllm, self.key = tok, token_ids, strict, vllm, key
        self.auth: list = []  # each request's Authorization header (None: none)
        self.seen: list[dict] = []  # request bodies
        self.hits: dict[str, int] = {}
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):  # quiet
        pass

    def _send(self, code, obj):
        raw = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def _refused(self) -> bool:
        srv: StandIn = self.server
        with srv.lock:
            srv.auth.append(self.headers.get("Authorization"))
        if srv.key and self.headers.get("Authorization") != f"Bearer {srv.key}":
            self._send(401, {"error": "invalid api key"})
            return True
        return False

    def do_GET(self):
        if not self._refused():
            self._send(200, {"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    def do_POST(self):
        srv: StandIn = self.server
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self._refused():
            return
        if srv.strict and "return_token_ids" in body:
            return self._send(422, {"detail": "Unexpected fields in the request: {'return_token_ids'}"})
        if body["model"] != MODEL:
            return self._send(404, {"error": "no such model"})
        last = body["messages"][-1]["content"]
        with srv.lock:
            srv.seen.append(body)
            n = srv.hits[last] = srv.hits.get(last, 0) + 1
        if "always500" in last or any(f"fail500x{k}" in last and n <= k for k in range(1, 5)):
            return self._send(500, {"error": "overloaded"})
        if "slow" in last and n == 1:
            threading.Event().wait(1.0)
        if "trickle" in last and n == 1:  # a byte every 0.1 s: each read is quick, the whole answer is not
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", "100")
            self.end_headers()
            for _ in range(300):  # 30 s, far past the client's timeout, unless it hangs up
                try:
                    self.wfile.write(b" ")
                    self.wfile.flush()
                except OSError:
                    return
                threading.Event().wait(0.1)
            return
        if "drop" in last and n == 1:
            self.close_connection = True
            self.wfile.flush()
            self.connection.close()
            return
        if srv.vllm:
            return self._send(200, _as_vllm(srv.tok, body, last))
        text = f"echo: {last}"
        ids = srv.tok(text, add_special_tokens=False)["input_ids"]
        finish = "stop"
        if len(ids) > body["max_tokens"]:
            ids, finish = ids[: body["max_tokens"]], "length"
            text = srv.tok.decode(ids)
        choice = {"index": 0, "message": {"role": "assistant", "content": None if "nullcontent" in last else text},
                  "finish_reason": "abort" if "abort" in last else finish}
        if srv.token_ids and body.get("return_token_ids"):
            choice["token_ids"] = ids + ([IM_END] if finish == "stop" else [])  # vLLM keeps the stop token
            if "badid" in last:
                choice["token_ids"][0] = len(srv.tok)
        model = "other/model" if "othermodel" in last else body["model"]
        self._send(200, {"model": model, "choices": [choice], "usage": {"completion_tokens": len(ids)}})


def _as_vllm(tok, body: dict, last: str) -> dict:
    """A vLLM-shaped answer (reasoning parser, tool parser, ``return_token_ids``: the prompt's ids too)."""
    def parsed(c):
        return {**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}

    msgs = [{**m, "tool_calls": [parsed(c) for c in m["tool_calls"]]} if m.get("tool_calls") else m
            for m in body["messages"]]
    prompt = tok.apply_chat_template(msgs, tools=body.get("tools"), add_generation_prompt=True, tokenize=False,
                                     chat_template=body.get("chat_template"), **body.get("chat_template_kwargs", {}))
    prompt_ids = tok(prompt, add_special_tokens=False)["input_ids"] + ([7] if "skew" in last else [])
    message, text = {"role": "assistant", "content": f"echo: {last}"}, f"echo: {last}"
    if "think" in last:
        message["reasoning_content"] = f"thinking about {last}"
        text = f"<think>\nthinking about {last}\n</think>\n\necho: {last}"
    if "weather" in last:
        fn = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
        call = {"id": "call_9", "type": "function", "function": fn}
        message = {"role": "assistant", "content": None, "tool_calls": [call]}
        text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    ids = tok(text, add_special_tokens=False)["input_ids"] + [IM_END]
    return {"prompt_token_ids": prompt_ids, "usage": {"completion_tokens": len(ids)},
            "choices": [{"index": 0, "message": message, "finish_reason": "stop", "token_ids": ids}]}


@pytest.fixture(scope="module")
def tok(default_target_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_target_path)


@pytest.fixture
def server(tok):
    srv = StandIn(tok)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv
    srv.shutdown()
    srv.server_close()


@pytest.fixture(autouse=True)
def fast_backoff(monkeypatch):
    monkeypatch.setattr(endpoints_mod, "BACKOFF_S", 0.01)
    for var in endpoints_mod.KEY_VARS:  # no key of the developer's reaches the stand-in
        monkeypatch.delenv(var, raising=False)


def convs(*prompts):
    out = []
    for k, p in enumerate(prompts):
        turns = p if isinstance(p, list) else [p]
        out.append(Conversation(f"c{k}", [{"role": "user", "content": t} for t in turns]))
    return out


def run(server_or_urls, data, out, tok, **kw):
    urls = server_or_urls if isinstance(server_or_urls, list) else [server_or_urls.url]
    kw.setdefault("timeout", 0.5)
    kw.setdefault("retries", 3)
    return regenerate_endpoints(data, urls, MODEL, tok, [IM_END], out, progress=False, **kw)


def records(path):
    return {r["id"]: r for r in map(json.loads, path.read_text().splitlines())}


def test_faults_are_retried_counted_and_listed(server, tok, tmp_path):
    data = convs("hello", "fail500x2 please", "a slow one", "drop it", "always500 here", ["first?", "second?"],
                 "trickle on")
    out = tmp_path / "regen.jsonl"
    t0 = time.monotonic()
    stats = run(server, data, out, tok, concurrency=2)
    assert time.monotonic() - t0 < 15  # the trickle was cut at the request's timeout, not read for 30 s
    recs = records(out)
    assert set(recs) == {"c0", "c1", "c2", "c3", "c5", "c6"}  # every prompt but the one that keeps failing
    assert stats.conversations == 6 and stats.failed == 1
    # two 500s, a timeout, a dropped connection, always500's three retries, a trickle past the whole request's timeout
    assert stats.retried == 2 + 1 + 1 + 3 + 1
    failed = [json.loads(line) for line in (tmp_path / "regen.jsonl.failed.jsonl").read_text().splitlines()]
    assert [f["id"] for f in failed] == ["c4"] and "HTTP 500" in failed[0]["error"]
    two = recs["c5"]["messages"]
    assert [m["role"] for m in two] == ["user", "assistant", "user", "assistant"]
    assert two[1]["content"] == "echo: first?" and two[1]["token_ids"] == tok("echo: first?", add_special_tokens=False)[
        "input_ids"]  # the server's stop token is not part of the answer
    second = next(b for b in server.seen if b["messages"][-1]["content"] == "second?")
    assert second["messages"][1] == {"role": "assistant", "content": "echo: first?"}  # the regenerated history
    meta = recs["c0"]["meta"]
    assert meta["endpoint"] == server.url and meta["model"] == MODEL and meta["finish"] == ["stop"]
    assert meta["chat_template"]["chat_template_kwargs"] == {}
    # the next run retries only the failure (it fails again here); nothing is written twice
    server.hits.clear()
    stats2 = run(server, data, out, tok, retries=0)
    assert stats2.skipped_done == 6 and stats2.failed == 1  # always500 still fails; nothing written twice
    assert len(out.read_text().splitlines()) == 6


def test_resume_after_a_kill_writes_each_record_once(server, tok, tmp_path):
    data = convs("one", "two", "three", "four")
    out = tmp_path / "regen.jsonl"
    run(server, data[:2], out, tok)
    with open(out, "a") as f:
        f.write('{"id": "c2", "messages": [')  # a line cut by a kill
    stats = run(server, data, out, tok)
    assert stats.skipped_done == 2 and stats.conversations == 2
    assert sorted(records(out)) == ["c0", "c1", "c2", "c3"] and len(out.read_text().splitlines()) == 4


def test_first_request_checks_endpoint_and_model(server, tok, tmp_path):
    out = tmp_path / "regen.jsonl"
    with pytest.raises(DataError, match=r"serves \['stand-in/model'\], not --model 'other'"):
        regenerate_endpoints(convs("hi"), [server.url], "other", tok, [IM_END], out, progress=False)
    with pytest.raises(DataError, match="http://127.0.0.1:9: does not answer"):
        regenerate_endpoints(convs("hi"), ["http://127.0.0.1:9"], MODEL, tok, [IM_END], out, progress=False,
                             timeout=2)
    assert not out.exists()


def test_template_arguments_max_tokens_and_two_endpoints(tok, tmp_path, default_target_path):
    a, b = StandIn(tok), StandIn(tok, strict=True)  # b refuses return_token_ids: text only
    for s in (a, b):
        threading.Thread(target=s.serve_forever, daemon=True).start()
    try:
        data = convs(*[f"prompt number {k}" for k in range(8)])
        out = tmp_path / "regen.jsonl"
        qwen3 = load_template(tok, "tests/fixtures/chat_templates/Qwen-Qwen3-8B.jinja", "enable_thinking=false")
        stats = run([a.url, b.url], data, out, tok, template=qwen3, max_new_tokens=3, concurrency=1)
        assert stats.conversations == 8 and stats.truncated_turns == 8  # 'echo: prompt number k' > 3 tokens
        assert a.seen and b.seen  # both servers answered
        body = a.seen[-1]
        assert body["chat_template_kwargs"] == {"enable_thinking": False} and body["max_tokens"] == 3
        assert body["chat_template"] == qwen3.text and body["temperature"] == 0
        by = {r["meta"]["endpoint"]: r for r in records(out).values()}
        assert "token_ids" in by[a.url]["messages"][1] and "token_ids" not in by[b.url]["messages"][1]
        assert all(r["meta"]["finish"] == ["length"] for r in records(out).values())
        assert all(r["meta"]["chat_template"]["chat_template_kwargs"] == {"enable_thinking": False}
                   for r in records(out).values())
    finally:
        for s in (a, b):
            s.shutdown()
            s.server_close()


def test_cli_refuses_a_wrong_model_before_writing(server, tmp_path, default_target_path, capsys):
    from vatspec.cli import main

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "Hi"}\n')
    out = tmp_path / "out.jsonl"
    assert main(["regenerate", str(prompts), "--out", str(out), "--target", str(default_target_path),
                 "--endpoint", server.url, "--model", "nope"]) == 2
    assert "serves ['stand-in/model'], not --model 'nope'" in capsys.readouterr().err
    assert main(["regenerate", str(prompts), "--out", str(out), "--target", str(default_target_path),
                 "--endpoint", server.url]) == 2
    assert "--endpoint needs --model" in capsys.readouterr().err
    assert not out.exists()
    assert main(["regenerate", str(prompts), "--out", str(out), "--target", str(default_target_path),
                 "--endpoint", server.url, "--model", MODEL]) == 0
    assert "1 conversations" in capsys.readouterr().out and len(out.read_text().splitlines()) == 1
    summary = json.loads((tmp_path / "out.jsonl.summary.json").read_text())
    assert summary["done"] == 1 and summary["failed"] == 0 and summary["model"] == MODEL


def test_a_vllm_server_s_reasoning_tool_calls_and_prompt_ids(tok, tmp_path, default_target_path, capsys):
    """Through a server with a reasoning parser and a tool parser that returns the prompt's ids: each answer keeps
    its reasoning apart (never written into the content), its structured call, all the generated ids and the stop
    id apart; the engine's prompt ids are stored and counted against this project's rendering; the next turn's
    request carries the reasoning and the call back (arguments as a JSON string)."""
    srv = StandIn(tok, vllm=True)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        qwen3 = load_template(tok, "tests/fixtures/chat_templates/Qwen-Qwen3-8B.jinja", stop_ids=[IM_END])
        tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
        data = [Conversation("t", [{"role": "user", "content": "think first"}, {"role": "user", "content": "skew"}]),
                Conversation("w", [{"role": "user", "content": "weather?"}], tools=[tool])]
        out = tmp_path / "regen.jsonl"
        stats = run(srv, data, out, tok, template=qwen3)
        recs = records(out)
        think, skew = recs["t"]["messages"][1], recs["t"]["messages"][3]
        assert think["content"] == "echo: think first" and think["reasoning_content"] == "thinking about think first"
        assert tok.decode(think["token_ids"]).startswith("<think>\nthinking") and think["stop_token_id"] == IM_END
        call = recs["w"]["messages"][1]
        assert call["tool_calls"] == [{"id": "call_9", "type": "function",
                                       "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]
        assert recs["w"]["tools"] == [tool]
        assert all("prompt_token_ids" in m for r in recs.values() for m in r["messages"] if m["role"] == "assistant")
        assert (stats.prompts_checked, stats.prompts_same) == (3, 2)  # 'skew': the engine's prompt has one more id
        assert stats.prompt_differs_at == [len(skew["prompt_token_ids"]) - 1]
        second = next(b for b in srv.seen if b["messages"][-1]["content"] == "skew")["messages"][1]
        assert second == {"role": "assistant", "content": "echo: think first",
                          "reasoning_content": "thinking about think first",
                          "reasoning": "thinking about think first"}
        # training: the engine's own prompt ids, then the generated ids and the stop
        from vatspec.data import load_conversations, split_turns, tokenize_conversation

        conv = [c for c in split_turns(load_conversations(str(out)), tok, qwen3) if c.id == "t@1"][0]
        ex = tokenize_conversation(conv, tok, template=qwen3)
        assert ex.input_ids == skew["prompt_token_ids"] + skew["token_ids"] + [IM_END]
        assert sum(ex.loss_mask) == len(skew["token_ids"]) + 1
        # data validation: show-data compares the engine's prompts with this project's rendering
        from vatspec.cli import main

        assert main(["show-data", str(out), "--target", str(default_target_path), "--chat-template",
                     "tests/fixtures/chat_templates/Qwen-Qwen3-8B.jinja", "-n", "0"]) == 0
        last = capsys.readouterr().out.strip().splitlines()[-1]
        assert last == (f"engine prompts: 3 answers hold the server's own prompt ids (trained as they are); 2 equal "
                        f"this rendering, the others first differ at tokens {stats.prompt_differs_at}")
    finally:
        srv.shutdown()
        srv.server_close()


def test_a_resumed_regeneration_keeps_its_day_and_settings(server, tok, tmp_path):
    """A template that stamps today's date: a file begun on one day resumes on that day, whatever today is, and a
    resume with other template settings (another pinned day) is refused before anything is written."""
    llama32 = "tests/fixtures/chat_templates/meta-llama-Llama-3.2-3B-Instruct.jinja"
    out = tmp_path / "regen.jsonl"
    run(server, convs("one"), out, tok, template=load_template(tok, llama32, date="2026-01-02"))
    run(server, convs("one", "two"), out, tok, template=load_template(tok, llama32))  # no day given: the file's
    recs = records(out)
    assert [r["meta"]["chat_template"]["chat_template_date"] for r in recs.values()] == ["2026-01-02"] * 2
    before = out.read_text()
    with pytest.raises(DataError, match="date 2026-01-02, this regenerate renders with 2026-01-03"):
        run(server, convs("one", "two", "three"), out, tok, template=load_template(tok, llama32, date="2026-01-03"))
    assert out.read_text() == before


def failures(out):
    return sorted((json.loads(line) for line in (out.parent / (out.name + ".failed.jsonl")).read_text().splitlines()),
                  key=lambda f: f["id"])


def test_bad_answers_fail_their_conversation(server, tok, tmp_path):
    """An answer with an id past the vocabulary, a cut finish, a null content or another model's name is never
    written as done: its conversation is listed with the reason (not retried in the run) and a rerun retries it."""
    data = convs("fine", "badid here", "abort here", "nullcontent here", "othermodel here")
    out = tmp_path / "regen.jsonl"
    stats = run(server, data, out, tok)
    assert sorted(records(out)) == ["c0"] and (stats.conversations, stats.failed, stats.retried) == (1, 4, 0)
    bad, v = f"{server.url}: a bad answer:", len(tok)
    assert failures(out) == [
        {"id": "c1", "endpoint": server.url, "error": f"{bad} token_ids holds {v}, not a token id in [0, {v})"},
        {"id": "c2", "endpoint": server.url, "error": f"{bad} finish_reason 'abort' (the answer is cut or failed)"},
        {"id": "c3", "endpoint": server.url, "error": f"{bad} content null with no tool calls and no reasoning"},
        {"id": "c4", "endpoint": server.url,
         "error": f"{bad} it names model 'other/model', not --model 'stand-in/model'"}]
    server.seen.clear()
    stats2 = run(server, data, out, tok)  # the rerun asks again for the four, and only them
    assert (stats2.skipped_done, stats2.failed) == (1, 4)
    assert sorted(b["messages"][-1]["content"] for b in server.seen if b["max_tokens"] > 1) == sorted(
        ["badid here", "abort here", "nullcontent here", "othermodel here"])
    assert sorted(records(out)) == ["c0"]


def test_exit_status_when_every_request_fails(server, tmp_path, default_target_path, capsys):
    from vatspec.cli import main

    def regen(name, *prompts):
        src = tmp_path / f"{name}.jsonl"
        src.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
        out = tmp_path / f"{name}.out.jsonl"
        code = main(["regenerate", str(src), "--out", str(out), "--target", str(default_target_path),
                     "--endpoint", server.url, "--model", MODEL, "--retries", "0"])
        return code, capsys.readouterr().out, out

    code, line, out = regen("all", "abort one", "always500 two")
    assert code == 1 and "wrote 0 conversations" in line and ", 2 failed (listed in" in line
    assert line.rstrip().endswith(f"; every conversation of this run failed (see {out}.failed.jsonl)")
    assert [f["error"].split(": ", 1)[1] for f in failures(out)] == [
        "a bad answer: finish_reason 'abort' (the answer is cut or failed)", 'HTTP 500: {"error": "overloaded"}']
    code, line, out = regen("some", "Hi", "abort one")
    assert code == 0 and "wrote 1 conversations" in line and ", 1 failed (listed in" in line
    assert "every conversation" not in line and len(failures(out)) == 1


def test_api_key_from_the_environment(tok, tmp_path, monkeypatch, default_target_path, capsys):
    srv = StandIn(tok, key="s3cret-key")
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        out = tmp_path / "regen.jsonl"
        with pytest.raises(DataError) as e:
            run(srv, convs("hi"), out, tok)
        assert str(e.value) == (f"--endpoint {srv.url}: does not answer ({srv.url}: HTTP 401 (set VATSPEC_API_KEY or "
                                f"OPENAI_API_KEY to the server's API key))")
        assert srv.auth == [None] and not out.exists()  # a 401 is not retried
        srv.auth.clear()
        monkeypatch.setenv("OPENAI_API_KEY", "s3cret-key")
        assert run(srv, convs("hi"), out, tok).conversations == 1
        assert srv.auth and set(srv.auth) == {"Bearer s3cret-key"}  # every request, the model list included
        srv.auth.clear()
        monkeypatch.setenv("OPENAI_API_KEY", "wrong")
        monkeypatch.setenv("VATSPEC_API_KEY", "s3cret-key")  # first
        from vatspec.cli import main

        src = tmp_path / "p.jsonl"
        src.write_text('{"prompt": "Hi"}\n{"prompt": "abort"}\n')
        cli_out = tmp_path / "cli.jsonl"
        assert main(["regenerate", str(src), "--out", str(cli_out), "--target", str(default_target_path),
                     "--endpoint", srv.url, "--model", MODEL]) == 0
        assert set(srv.auth) == {"Bearer s3cret-key"}
        printed = capsys.readouterr()
        written = [p.read_text() for p in tmp_path.iterdir() if p.is_file()]
        assert not any("s3cret" in t for t in written + [printed.out, printed.err])
    finally:
        srv.shutdown()
        srv.server_close()


@pytest.mark.parametrize("url, shown, why", [
    ("http://user:hunter2@127.0.0.1:8000", "http://***@127.0.0.1:8000", "a URL with credentials is refused"),
    ("http://hunter2@127.0.0.1:8000/v1", "http://***@127.0.0.1:8000/v1", "a URL with credentials is refused"),
    ("http://127.0.0.1:8000/v1?api_key=hunter2", "http://127.0.0.1:8000/v1?***", "a URL with a query or a fragment"),
    ("https://host.example/v1#hunter2", "https://host.example/v1#***", "a URL with a query or a fragment"),
])
def test_a_url_with_a_secret_is_refused_without_echoing_it(tok, tmp_path, default_target_path, capsys, url, shown,
                                                           why):
    out = tmp_path / "regen.jsonl"
    with pytest.raises(DataError) as e:
        regenerate_endpoints(convs("hi"), [url], MODEL, tok, [IM_END], out, progress=False)
    assert str(e.value).startswith(f"--endpoint {shown}: {why}") and "hunter2" not in str(e.value)
    assert str(e.value).endswith("give the API key as VATSPEC_API_KEY or OPENAI_API_KEY")
    from vatspec.cli import main

    src = tmp_path / "p.jsonl"
    src.write_text('{"prompt": "Hi"}\n')
    assert main(["regenerate", str(src), "--out", str(out), "--target", str(default_target_path),
                 "--endpoint", url, "--model", MODEL]) == 2
    err = capsys.readouterr().err
    assert err == f"vatspec regenerate: error: {e.value}\n" and "hunter2" not in err
    assert not out.exists() and not (tmp_path / "regen.jsonl.summary.json").exists()
