"""A gpt-oss (harmony) target end to end on CPU, through the CLI.

A tiny ``GptOssForCausalLM`` with the published config's shape (alternating sliding/full attention, a 128-token
window, top-k experts, attention sinks, YaRN RoPE; ``tests/gptoss_target.py``), the SmolLM2 tokenizer with the
harmony special tokens, the published chat template (``tests/fixtures/chat_templates/openai-gpt-oss-20b.jinja``,
which stamps today's date) and the published stop ids ``[<|return|>, <|endoftext|>, <|call|>]``. A random model
never writes a channel marker, so the builder teaches it (a few Adam steps) to answer every prompt as a gpt-oss
does after its generation prompt ``<|start|>assistant``:
``<|channel|>analysis<|message|>R<|end|><|start|>assistant<|channel|>final<|message|>C<|return|>``.

``regenerate`` in-process (a two-turn prompt: the first answer's harmony text must come back as reasoning +
content, or the template raises on the second turn) and through ``transformers serve`` -> the training sequences
of hand-written harmony records (reasoning, a tool call, a tool result) -> ``cache-features`` -> ``train``
EAGLE-3 + VAT and DFlash + VAT from the cache -> ``export`` -> ``check`` (decoding past the sliding window).
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.gptoss_target import CONTENT, HARMONY_ANSWER, REASONING, TEMPLATE, build_gptoss_target
from tests.gptoss_target import DATE as TAUGHT_DATE
from vatspec.cli import main

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.slow]

MAX_LEN, NEW_TOKENS, BLOCK, TTT = 192, 24, 4, 3
LAYERS = [0, 1, 2]  # EAGLE-3's default (1, L//2 - 1, L - 4) repeats a layer on 4 layers
LONG = ("Please read this and tell me in plain words what the main idea is: a farmer walked to the city with "
        "his old dog, sold three bags of rice at the market, bought a red kite for his daughter and came home late.")

PROMPTS = [
    {"id": "s0", "messages": [{"role": "user", "content": "What is the capital of France?"}]},
    {"id": "s1", "messages": [{"role": "user", "content": "Count from 1 to 10."}]},
    {"id": "s2", "messages": [{"role": "user", "content": "Write a haiku about the sea."}]},
    {"id": "m0", "messages": [{"role": "user", "content": "Tell me a fact about cats."},
                              {"role": "user", "content": "And one about dogs?"}]},
    {"id": "l0", "messages": [{"role": "user", "content": LONG}]},  # prompt + answer past the 128-token window
]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "City name"}},
                   "required": ["city"]}}}]
# what regenerating through a real gpt-oss gives, in the OpenAI shape (reasoning as `thinking` in one)
HANDWRITTEN = [
    {"id": "h-reason", "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "thinking": "Add two and two.", "content": "4"}]},
    {"id": "h-tool", "tools": TOOLS, "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "reasoning_content": "Need the weather tool.",
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp_c\": 18}"},
        {"role": "assistant", "reasoning_content": "Mild weather.", "content": "It is mild in Paris."}]},
]
DATE = "2026-01-15"  # the day the hand-written records are rendered with


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


# ----------------------------------------------------------------------------- the target, the data
@pytest.fixture(scope="module")
def gptoss_dir(tmp_path_factory, default_target_path) -> Path:
    # the prompts regenerated here, each user turn's (a second turn after the first answer, as the template renders it)
    answer = {"role": "assistant", "reasoning_content": REASONING, "content": CONTENT}
    turns = []
    for p in PROMPTS:
        users = p["messages"]
        turns += [[m for u in users[:k] for m in (u, answer)] + [users[k]] for k in range(len(users))]
    from vatspec.data.records import parse_record

    # the tool conversation's answer after the tool's result, its messages read as regenerate reads them, with its tools
    tool = parse_record(next(h for h in HANDWRITTEN if h["id"] == "h-tool"), "h-tool")
    turns.append({"messages": tool.messages[:3], "tools": tool.tools})
    return build_gptoss_target(tmp_path_factory.mktemp("gptoss_target"), default_target_path, speak=HARMONY_ANSWER,
                               prompts=turns)


@pytest.fixture(scope="module")
def target(gptoss_dir):
    from vatspec.target import Target

    return Target.from_pretrained(gptoss_dir)


@pytest.fixture(scope="module")
def ids(target):
    tok = target.tokenizer
    return {t: tok.convert_tokens_to_ids(t) for t in ("<|return|>", "<|endoftext|>", "<|call|>", "<|end|>")}


@pytest.fixture(scope="module")
def regen(gptoss_dir, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("regen")
    # the tool conversation too: its call and result are kept, the answer after the result regenerated
    prompts = write_jsonl(root / "prompts.jsonl", PROMPTS + [HANDWRITTEN[1]])
    out = root / "regen.jsonl"
    assert main(["regenerate", str(prompts), "--out", str(out), "--target", str(gptoss_dir),
                 "--max-new-tokens", str(NEW_TOKENS), "--batch-size", "8", "--device", "cpu",
                 # the day the target was taught on: the prompts carry the date, and a tiny model taught on one day's
                 # prompts may answer another day's long prompt otherwise (the test must not depend on its day)
                 "--chat-template-date", TAUGHT_DATE]) == 0
    return out


# ----------------------------------------------------------------------------- the target as published
def test_the_target_has_the_published_shape(target, ids):
    from transformers import GptOssForCausalLM

    cfg = target.model.config
    assert isinstance(target.model, GptOssForCausalLM)
    assert cfg.layer_types == ["sliding_attention", "full_attention"] * 2 and cfg.sliding_window == 128
    assert cfg.num_local_experts == 4 and cfg.num_experts_per_tok == 2
    assert cfg.rope_parameters["rope_type"] == "yarn" and cfg.rope_parameters["factor"] == 32.0
    assert all(layer.self_attn.sinks.shape == (cfg.num_attention_heads,) for layer in target.model.model.layers)
    assert target.vocab_size == len(target.tokenizer)
    assert target.eos_token_ids == [ids["<|return|>"], ids["<|endoftext|>"], ids["<|call|>"]]
    assert target.tokenizer.chat_template == TEMPLATE.read_text(encoding="utf-8")


# ----------------------------------------------------------------------------- regenerate in-process
def test_regenerate_stores_harmony_answers_as_reasoning_and_content(regen, target, ids):
    from vatspec.data import load_conversations, load_template, split_turns, tokenize_conversation

    tok = target.tokenizer
    records = {r["id"]: r for r in map(json.loads, regen.read_text().splitlines())}
    assert sorted(records) == sorted([p["id"] for p in PROMPTS] + ["h-tool"])
    today = TAUGHT_DATE  # regenerate pins the day it was given (else the day it ran)
    settings = {"chat_template_sha256": sha256(TEMPLATE.read_text(encoding="utf-8")), "chat_template_kwargs": {},
                "chat_template_date": today}
    generated = tok(HARMONY_ANSWER, add_special_tokens=False)["input_ids"]
    for rid, r in records.items():
        assert r["meta"]["chat_template"] == settings, rid
        answers = [m for m in r["messages"] if m["role"] == "assistant" and not m.get("tool_calls")]
        assert len(answers) == (2 if rid == "m0" else 1), rid
        for m in answers:  # the taught target says the harmony answer; the record splits it at its markers
            assert (m["reasoning_content"], m["content"]) == (REASONING, CONTENT), (rid, m)
            assert m["token_ids"] + [m["stop_token_id"]] == generated, rid
            assert m["stop_token_id"] == ids["<|return|>"]
    tool = records["h-tool"]
    assert tool["tools"] == TOOLS
    assert [m["role"] for m in tool["messages"]] == ["user", "assistant", "tool", "assistant"]
    assert tool["messages"][1]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": {"city": "Paris"}}

    # stored as generated, the first answer would make the template refuse the second turn (the bug fixed)
    raw = {"role": "assistant", "content": HARMONY_ANSWER.removesuffix("<|return|>")}
    with pytest.raises(Exception, match="containing <\\|channel\\|> tags in the content field"):
        load_template(tok, "", None, today).render(tok, [PROMPTS[3]["messages"][0], raw, PROMPTS[3]["messages"][1]],
                                                    generation_prompt=True)
    # the second turn rendered the first answer from its fields (no "<|channel|> tags in the content field"),
    # without its analysis (gpt-oss drops earlier reasoning): the conversation is split, each answer trained
    # once as generated, in the context the target answered in
    convs = load_conversations(regen)
    template = load_template(tok, "", None, today, stop_ids=target.eos_token_ids)
    parts = split_turns(convs, tok, template)
    assert sorted(c.id for c in parts) == sorted([*records, "m0@1"])
    for part in parts:
        ex = tokenize_conversation(part, tok, template=template)
        last = max(k for k, m in enumerate(part.messages) if m["role"] == "assistant")
        prompt = template.render(tok, part.messages[:last], generation_prompt=True, tools=part.tools)
        assert prompt.endswith("<|start|>assistant") and f"Current date: {today}" in prompt
        p = tok(prompt, add_special_tokens=False)["input_ids"]
        assert ex.input_ids == p + generated, part.id  # the prompt the engine renders, then what it generated
        assert ex.loss_mask[-len(generated):] == [True] * len(generated), part.id
    ex = tokenize_conversation(next(c for c in parts if c.id == "m0@1"), tok, template=template)
    assert sum(ex.loss_mask) == len(generated)  # the first answer is context here


# ----------------------------------------------------------------------------- regenerate through transformers serve
@pytest.fixture(scope="module")
def served(gptoss_dir, tmp_path_factory):
    """``(url, model name)`` of a ``transformers serve`` of the tiny gpt-oss on the loopback address."""
    pytest.importorskip("fastapi")  # transformers serve's own dependencies (`make setup` installs them)
    pytest.importorskip("uvicorn")
    from tests.test_serve import transformers_serve

    with transformers_serve(gptoss_dir, tmp_path_factory.mktemp("serve")) as served:
        yield served


def test_regenerate_through_transformers_serve(served, gptoss_dir, regen, tmp_path):
    """transformers serve (5.x) serves gpt-oss on a CPU, but it has no response parser for it (its fallbacks cover
    Qwen and Gemma 4; a tokenizer may ship its own ``response_template``, the published gpt-oss one does not), returns
    no token ids (``return_token_ids`` is refused: HTTP 422) and decodes with the special tokens skipped: the answer
    comes back as the harmony text with its markers deleted (``analysisR...assistantfinalC``), reasoning and
    content run together, not what the model generated. Regenerating a gpt-oss target through it gives data that
    trains on the wrong text; use an engine that returns the ids (vLLM) or parses harmony, or regenerate in-process."""
    url, model = served
    data = write_jsonl(tmp_path / "prompts.jsonl", [p for p in PROMPTS if p["id"] in ("s0", "m0")])
    out = tmp_path / "regen.jsonl"
    res = subprocess.run([sys.executable, "-m", "vatspec.cli", "regenerate", str(data), "--out", str(out), "--target",
                          str(gptoss_dir), "--endpoint", url, "--model", model, "--max-new-tokens", str(NEW_TOKENS),
                          "--concurrency", "1", "--threads", "1", "--verify-sample", "2",
                          "--chat-template-date", TAUGHT_DATE],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "the servers return no token ids, and the reasoning markers are special tokens" in res.stderr  # said
    records = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert sorted(records) == ["m0", "s0"] and "0 failed" in res.stdout
    in_process = {r["id"]: r for r in map(json.loads, regen.read_text().splitlines())}
    stripped = "analysis" + REASONING + "assistantfinal" + CONTENT  # HARMONY_ANSWER without its special tokens
    for rid, r in records.items():
        assert r["meta"]["endpoint"] == url and r["meta"]["finish"] == ["stop"] * (2 if rid == "m0" else 1)
        assert r["meta"]["chat_template"] == in_process[rid]["meta"]["chat_template"]  # the same settings, date
        for m in (m for m in r["messages"] if m["role"] == "assistant"):  # the second turn rendered: no raise
            assert m == {"role": "assistant", "content": stripped}, m  # no reasoning split, no ids
    v = json.loads(Path(f"{out}.summary.json").read_text())["verify_sample"]
    assert v["sampled"] == 2 and v["identical"] == 0  # in-process generation says the harmony answer itself


# ----------------------------------------------------------------------------- hand-written harmony records
def _spans(ex, tok) -> list[tuple[bool, str]]:
    """The sequence as runs of supervised / context text."""
    out: list[tuple[bool, list[int]]] = []
    for t, m in zip(ex.input_ids, ex.loss_mask):
        if out and out[-1][0] == m:
            out[-1][1].append(t)
        else:
            out.append((m, [t]))
    return [(m, tok.decode(run)) for m, run in out]


def test_handwritten_harmony_records_train_on_what_gpt_oss_generates(target, tmp_path):
    from vatspec.data import load_conversations, load_template, split_turns, tokenize_conversation

    tok = target.tokenizer
    template = load_template(tok, "", None, DATE, stop_ids=target.eos_token_ids)
    convs = load_conversations(write_jsonl(tmp_path / "harmony.jsonl", HANDWRITTEN))
    assert convs[0].messages[2]["reasoning_content"] == "Add two and two."  # read from `thinking`
    parts = {c.id: c for c in split_turns(convs, tok, template)}
    assert sorted(parts) == ["h-reason", "h-tool"]  # every answer extends the sequence before it

    def render(msgs, tools=None):
        return template.render(tok, msgs, generation_prompt=True, tools=tools)

    # reasoning + final answer: after the generation prompt, the analysis, the final channel and <|return|>
    reason = convs[0]
    spans = _spans(tokenize_conversation(parts["h-reason"], tok, template=template), tok)
    assert spans == [
        (False, render(reason.messages[:2])),
        (True, "<|channel|>analysis<|message|>Add two and two.<|end|><|start|>assistant<|channel|>final<|message|>"
               "4<|return|>"),
    ]
    assert spans[0][1].startswith("<|start|>system<|message|>") and f"Current date: {DATE}" in spans[0][1]
    assert "<|start|>developer<|message|># Instructions\n\nBe brief." in spans[0][1]

    # a tool call (the template's own rendering of it, up to <|call|>), the result as context, the final answer
    tool = convs[1]
    prompt1, prompt3 = render(tool.messages[:1], TOOLS), render(tool.messages[:3], TOOLS)
    call = ("<|channel|>analysis<|message|>Need the weather tool.<|end|><|start|>assistant to=functions.get_weather"
            "<|channel|>commentary json<|message|>{\"city\": \"Paris\"}<|call|>")
    assert prompt3.startswith(prompt1 + call)
    spans = _spans(tokenize_conversation(parts["h-tool"], tok, template=template), tok)
    assert spans == [
        (False, prompt1),  # the system message, the tool schema (developer message), the question
        (True, call),
        (False, prompt3[len(prompt1 + call):]),  # the tool result
        (True, "<|channel|>analysis<|message|>Mild weather.<|end|><|start|>assistant<|channel|>final<|message|>"
               "It is mild in Paris.<|return|>"),
    ]
    assert "namespace functions" in prompt1 and "// Current weather in a city" in prompt1
    assert spans[2][1] == ("<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"
                           "\"{\\\"temp_c\\\": 18}\"<|end|><|start|>assistant")


# ----------------------------------------------------------------------------- cache + train + export + check
@pytest.fixture(scope="module")
def cache(gptoss_dir, regen, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("cache") / "features"
    assert main(["cache-features", str(regen), "--out", str(out), "--target", str(gptoss_dir),
                 "--layers", *map(str, LAYERS), "--drafter", "dflash", "--feature-dtype", "float32",
                 "--max-length", str(MAX_LEN), "--batch-size", "8", "--device", "cpu", "--no-progress"]) == 0
    return out


STEPS = {"eagle3": 30, "dflash": 30}
LR = {"eagle3": "3e-3", "dflash": "3e-3"}


def train_args(gptoss_dir, cache, out: Path, kind: str, *extra: str) -> list[str]:
    layers = [f"drafter.target_layer_ids=[{','.join(map(str, LAYERS))}]"] if kind == "eagle3" else []
    return ["train", f"target.path={gptoss_dir}", f"data.features={cache}", f"train.out_dir={out}",
            "target.device=cpu", f"drafter.kind={kind}", "loss.kind=vat", "data.batch_size=2",
            f"data.max_length={MAX_LEN}", "data.heldout_max=2", "drafter.draft_vocab_size=64",
            f"drafter.ttt_steps={TTT}", f"drafter.block_size={BLOCK}", "drafter.num_anchors=4",
            f"train.steps={STEPS[kind]}", "train.eval_every=2", f"optim.lr={LR[kind]}", *layers, *extra,
            "--no-progress"]


@pytest.fixture(scope="module")
def runs(gptoss_dir, cache, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("runs")
    out = {}
    for kind in STEPS:
        out[kind] = root / kind
        assert main(train_args(gptoss_dir, cache, out[kind], kind)) == 0
    return out


FORMATS = {"eagle3-hf": "eagle3", "dflash": "dflash"}


@pytest.fixture(scope="module")
def exports(runs, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("exports")
    out = {}
    for fmt, kind in FORMATS.items():
        out[fmt] = root / fmt
        assert main(["export", str(runs[kind]), "--format", fmt, "--out", str(out[fmt])]) == 0
    return out


def test_the_cache_and_the_runs_record_the_pinned_date(cache, runs, regen):
    date = json.loads(regen.read_text().splitlines()[0])["meta"]["chat_template"]["chat_template_date"]
    man = json.loads((cache / "manifest.json").read_text())
    assert man["target"]["config"]["model_type"] == "gpt_oss"
    assert man.get("chat_template_date") == date, man  # adopted from the data, not today's
    assert man["conversations"] == len(PROMPTS) + 2  # + h-tool, + m0 split in two
    for kind, run in runs.items():
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert records[-1]["step"] == STEPS[kind] and "eval/tau_sim" in records[-1], kind


def test_check_decodes_past_the_sliding_window(exports, gptoss_dir, regen, capsys):
    # the prompts trained on (single-turn); the long one's prompt and answer run past the 128-token window,
    # so decoding crops sliding-window cache layers that have already slid (vatspec.target.rollback)
    prompts = write_jsonl(regen.parent / "check_prompts.jsonl", [p for p in PROMPTS if p["id"] in ("l0", "s0")])
    for folder in exports.values():
        code = main(["check", str(folder), "--target", str(gptoss_dir), "--prompts", str(prompts),
                     "--num-prompts", "2", "--max-new-tokens", str(NEW_TOKENS), "--device", "cpu"])
        out = capsys.readouterr().out
        findings = {line[6:28].strip(): line[:6].strip() for line in out.splitlines()
                    if line[:6] in ("  ok  ", "  FAIL")}
        assert "served: 2 held-out prompts" in out, out  # decoded past the window
        assert "ok    template date          " in out, out  # the day regenerate pinned, adopted from the draft
        # every convention passes, RoPE included: both drafts rotate like the target (YaRN with gpt-oss' parameters),
        # as they train and are served (drafters/eagle3/config.py rope_from_config carries YaRN into the EAGLE-3 draft)
        # the acceptance finding compares 2 prompts x 24 tokens with a 30-step draft's held-out tau_sim: noise at this
        # size (the prompts carry the day regenerate ran, so the data and that ratio change from day to day; it read
        # 42-44% of training's on 2026-12-07, against a 50% bar); every convention must pass
        assert all(ok == "ok" for what, ok in findings.items() if what != "acceptance"), out
        assert code == (0 if findings["acceptance"] == "ok" else 1), out
        rollback = "verification takes the cache back by: DynamicSlidingWindowLayer x2: record, DynamicLayer x2: crop"
        assert rollback in out, out


# ----------------------------------------------------------------------------- decoding on the sliding window
class _WrongDrafter:
    """Drafts k tokens the target never says: every round rejects them and crops the target's cache."""

    k, target_layer_ids = 3, (0,)

    def __init__(self, token: int):
        self.token = token

    def new_session(self, **_):
        return self

    def extend(self, *_):
        pass

    def propose(self, cap, **_):
        from vatspec.drafters.sampling import Proposal

        return Proposal(torch.full((cap,), self.token, dtype=torch.long))


def test_speculative_decoding_crops_the_cache_past_the_window(target):
    from vatspec.data.chat import ChatTemplate
    from vatspec.eval.decode import generate

    tok = target.tokenizer
    prompt = tok(ChatTemplate(date=DATE).render(tok, PROMPTS[-1]["messages"], generation_prompt=True),
                 add_special_tokens=False)["input_ids"]
    assert len(prompt) > 120  # the window slides during decoding
    ar = generate(target, prompt, None, max_new_tokens=NEW_TOKENS)
    assert tok.decode(ar.tokens) == HARMONY_ANSWER  # it says its answer, ending on <|return|>
    assert len(prompt) + len(ar.tokens) > 128
    spec = generate(target, prompt, _WrongDrafter(tok.convert_tokens_to_ids("<|constrain|>")),
                    max_new_tokens=NEW_TOKENS)
    assert spec.tokens == ar.tokens and all(r.drafted == 3 and r.accepted == 0 for r in spec.rounds[:-2])
