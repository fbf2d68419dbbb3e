"""A real tool-calling dataset end to end on the embedded target: the glaive tool-call demo that ships in
LLaMA-Factory's source distribution (bundled: ``vatspec/benchmarks/train_glaive_toolcall.jsonl``) ->
``regenerate`` in-process (SmolLM2 with a tool-capable ChatML template: Qwen2.5's, whose tokens SmolLM2
shares) -> ``show-data`` (the supervised share of tool-call tokens, printed) -> ``cache-features`` ->
``train`` EAGLE-3 + VAT from the cache.

What must hold: regeneration keeps the data's tool calls and tool results (a result answers the call that was
made) and the tool schemas, and answers every user turn and tool result with the target's own text; the
training sequences supervise the calls as the template writes them and never the schema or the results."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vatspec.cli import main

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.slow]

GLAIVE = Path(__file__).resolve().parents[1] / "src" / "vatspec" / "benchmarks" / "train_glaive_toolcall.jsonl"
TEMPLATE = Path(__file__).resolve().parent / "fixtures" / "chat_templates" / "Qwen-Qwen2.5-7B-Instruct.jinja"
FLAGS = ["--chat-template", str(TEMPLATE)]
N, MAX_LEN, NEW_TOKENS = 4, 640, 12


@pytest.fixture(scope="module")
def regen(default_target_path, tmp_path_factory) -> tuple[Path, list[dict]]:
    rows = [json.loads(line) for line in GLAIVE.read_text(encoding="utf-8").splitlines()]
    with_calls = [r for r in rows if any(t["from"] == "function_call" for t in r["conversations"])][:N]
    root = tmp_path_factory.mktemp("glaive")
    src = root / "glaive.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in with_calls), encoding="utf-8")
    out = root / "regen.jsonl"
    assert main(["regenerate", str(src), "--out", str(out), "--target", str(default_target_path), *FLAGS,
                 "--max-new-tokens", str(NEW_TOKENS), "--max-length", str(MAX_LEN), "--batch-size", "8",
                 "--device", "cpu"]) == 0
    return out, with_calls


def test_regeneration_keeps_the_calls_and_results_and_answers_the_rest(regen):
    from vatspec.data import load_conversations

    out, source = regen
    src = {c.id: c for c in load_conversations(str(out.parent / "glaive.jsonl"))}
    recs = load_conversations(str(out))
    assert len(recs) == N
    for rec in recs:
        orig = src[rec.id]
        assert rec.tools == orig.tools and rec.tools  # the schemas the engine puts in the system prompt
        kept = [m for m in orig.messages if m["role"] == "tool" or m.get("tool_calls")]
        got = [m for m in rec.messages if m["role"] == "tool" or m.get("tool_calls")]
        assert [(m["role"], m.get("tool_calls"), m["content"] if m["role"] == "tool" else "") for m in got] == \
            [(m["role"], m.get("tool_calls"), m["content"] if m["role"] == "tool" else "") for m in kept][: len(got)]
        for k, m in enumerate(rec.messages):  # every user turn and every last tool result is answered by the target
            if m["role"] == "assistant" and not m.get("tool_calls"):
                assert m["token_ids"] and "stop_token_id" in m
                assert rec.messages[k - 1]["role"] in ("user", "tool")


def test_show_data_prints_the_tool_call_share_and_training_runs(regen, default_target_path, tmp_path, capsys):
    from vatspec.data import load_conversations, load_template, split_turns, tokenize_conversation
    from vatspec.target import open_target

    out, _ = regen
    assert main(["show-data", str(out), "--target", str(default_target_path), *FLAGS, "-n", "1",
                 "--max-length", str(MAX_LEN), "--color", "never"]) == 0
    shown = capsys.readouterr().out
    summary = shown.strip().splitlines()[-1]
    print(summary)  # the supervised share of tool-call tokens, as the issue asks to see it
    share = float(summary.split("tool-call tokens ")[1].split("(")[1].split("%")[0])
    assert 0 < share < 100
    assert "[[<tool_call>" in shown  # a call is supervised as the template writes it

    # every supervised run is one answer: the target's generated ids and their stop, or a data call as the template
    # writes it; the tool results and the schema (system prompt) are context in every sequence
    target = open_target(str(default_target_path), device="meta")
    tok = target.tokenizer
    template = load_template(tok, str(TEMPLATE), stop_ids=target.eos_token_ids)
    calls = 0
    for conv in split_turns(load_conversations(str(out)), tok, template):
        ex = tokenize_conversation(conv, tok, MAX_LEN, template)
        runs, cur = [], []
        for t, m in zip(ex.input_ids + [None], ex.loss_mask + [False]):
            if m:
                cur.append(t)
            elif cur:
                runs, cur = runs + [cur], []
        first = conv.meta.get("context_turns", 0)
        answers = [m for i, m in enumerate(conv.messages) if m["role"] == "assistant" and i >= first]
        assert len(runs) == len(answers)
        for m, run in zip(answers, runs):
            if m.get("tool_calls"):
                calls += 1
                text = tok.decode(run)
                assert text.startswith("<tool_call>\n{") and text.endswith("}\n</tool_call><|im_end|>"), text
                assert json.loads(text[len("<tool_call>\n"): -len("\n</tool_call><|im_end|>")])["name"] == \
                    m["tool_calls"][0]["function"]["name"]
            else:
                stop = [] if m["stop_token_id"] is None else [m["stop_token_id"]]
                assert run == m["token_ids"] + stop
        assert "<tools>" in tok.decode(ex.input_ids)
    assert calls >= N

    feats = tmp_path / "feats"
    assert main(["cache-features", str(out), "--out", str(feats), "--target", str(default_target_path), *FLAGS,
                 "--drafter", "eagle3", "--feature-dtype", "float32", "--max-length", str(MAX_LEN),
                 "--device", "cpu", "--no-progress"]) == 0
    run = tmp_path / "run"
    assert main(["train", f"target.path={default_target_path}", f"data.features={feats}", f"train.out_dir={run}",
                 "target.device=cpu", "drafter.kind=eagle3", "loss.kind=vat", "data.batch_size=2",
                 f"data.max_length={MAX_LEN}", "data.heldout_max=2", "drafter.draft_vocab_size=256",
                 f"data.chat_template={TEMPLATE}", "train.steps=2", "train.eval_every=2", "--no-progress"]) == 0
    rec = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert rec[-1]["step"] == 2 and all(v == v for v in (rec[-1]["loss"],))
