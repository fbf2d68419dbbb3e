"""Training sequences under the chat templates real targets ship (tests/fixtures/chat_templates).

The reference for every family is what a serving engine feeds the target: the history rendered with
``add_generation_prompt=True`` and the template arguments, tokenized, then the ids the target
generated, then its end-of-turn token. The tokenizer is SmolLM2's (a real byte-level BPE with ChatML
special tokens) with each family's special tokens added, so each template renders its own markers.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from vatspec.data import Conversation, DataError, load_template, split_turns, tokenize_conversation
from vatspec.data.chat import check_settings
from vatspec.eval.bench import prompt_ids

TEMPLATES = Path(__file__).parent / "fixtures" / "chat_templates"
DATE = "26 Jul 2024"  # Llama 3.x print a date: fixed, or the rendering changes with the day

# family -> (template file, special tokens, plain added tokens, bos, end-of-turn token, template arguments)
FAMILIES = {
    "qwen3": ("Qwen-Qwen3-8B.jinja", [], ["<think>", "</think>"], None, "<|im_end|>", {}),
    "qwen3-nothink": ("Qwen-Qwen3-8B.jinja", [], ["<think>", "</think>"], None, "<|im_end|>",
                      {"enable_thinking": False}),
    "qwen2.5": ("Qwen-Qwen2.5-7B-Instruct.jinja", [], [], None, "<|im_end|>", {}),
    "llama3.1": ("meta-llama-Llama-3.1-8B-Instruct.jinja",
                 ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"], [],
                 "<|begin_of_text|>", "<|eot_id|>", {"date_string": DATE}),
    "llama3.2": ("meta-llama-Llama-3.2-3B-Instruct.jinja",
                 ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"], [],
                 "<|begin_of_text|>", "<|eot_id|>", {"date_string": DATE}),
    "gemma3": ("google-gemma-3-4b-it.jinja", ["<bos>", "<start_of_turn>", "<end_of_turn>"], [], "<bos>",
               "<end_of_turn>", {}),
    "mistral": ("mistralai-Mistral-7B-Instruct-v0.3.jinja", ["<s>", "</s>", "[INST]", "[/INST]"], [], "<s>", "</s>",
                {}),
    "deepseek-r1": ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja",
                    ["<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>"],
                    ["<think>", "</think>"], "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", {}),
}
# what each family's target generates for the two questions (reasoning families think first)
ANSWERS = {
    "qwen3": ["<think>\nTwo and two.\n</think>\n\nIt is 4.", "<think>\nDouble it.\n</think>\n\nThen 8."],
    "deepseek-r1": ["Two and two.\n</think>\n\nIt is 4.", "Double it.\n</think>\n\nThen 8."],  # after '<think>\n'
}
PLAIN = ["It is 4.", "Then 8, twice as much."]
QUESTIONS = ["What is 2 + 2?", "And doubled?"]


@pytest.fixture(scope="module")
def base_tok(default_target_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_target_path)


def family(base_tok, name):
    """(tokenizer with the family's tokens, ChatTemplate, end-of-turn id)."""
    from tokenizers import AddedToken

    file, special, plain, bos, eot, kwargs = FAMILIES[name]
    tok = copy.deepcopy(base_tok)
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in special], special_tokens=True)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in plain])
    if bos:
        tok.bos_token = bos
    tok.eos_token = eot
    template = load_template(tok, str(TEMPLATES / file), kwargs)
    return tok, template, tok.convert_tokens_to_ids(eot)


def encode(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def regenerated(tok, name, turns):
    """A conversation as ``regenerate`` writes it: each answer's text and the ids the target generated."""
    answers = ANSWERS.get(name, PLAIN)
    msgs = []
    for q, a in list(zip(QUESTIONS, answers))[:turns]:
        ids = encode(tok, a)
        msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": tok.decode(ids), "token_ids": ids}]
    return Conversation(f"{name}-{turns}", msgs)


def supervised_runs(ex):
    runs, cur = [], []
    for t, m in zip(ex.input_ids + [None], ex.loss_mask + [False]):
        if m:
            cur.append(t)
        elif cur:
            runs.append(cur)
            cur = []
    return runs


@pytest.mark.parametrize("turns", [1, 2])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_regenerated_sequence_is_what_the_engine_fed(base_tok, name, turns):
    """Each answer sits right after its generation prompt (rendered with the arguments), its generated ids
    as they are, then the end-of-turn token; the mask covers exactly those. Multi-turn: one sequence per
    part of ``split_turns``, each turn in the context the target had."""
    tok, template, eot = family(base_tok, name)
    conv = regenerated(tok, name, turns)
    parts = split_turns([conv], tok, template)
    seen = []
    for part in parts:
        ex = tokenize_conversation(part, tok, template=template)
        first = part.meta.get("context_turns", 0)
        answered = [i for i, m in enumerate(part.messages) if m["role"] == "assistant" and i >= first]
        assert supervised_runs(ex) == [part.messages[i]["token_ids"] + [eot] for i in answered]
        for i in answered:  # the prefix up to answer i is the engine's prompt for it
            prompt = encode(tok, tok.apply_chat_template(
                [{"role": m["role"], "content": m["content"]} for m in part.messages[:i]], tokenize=False,
                add_generation_prompt=True, chat_template=template.text, **template.kwargs))
            assert ex.input_ids[: len(prompt)] == prompt
            assert ex.input_ids[len(prompt): len(prompt) + len(part.messages[i]["token_ids"]) + 1] == \
                part.messages[i]["token_ids"] + [eot]
            assert prompt_ids(tok, part.messages[:i], template) == prompt  # decode, eval and check: the same prompt
        seen += answered
    assert seen == [i for i, m in enumerate(conv.messages) if m["role"] == "assistant"]  # every turn, once


def test_qwen3_template_tokenizes_text_answers(base_tok):
    """The Qwen3 template puts an empty think block before a plain answer (thinking on: template text, not
    supervised; off: part of the generation prompt) and renders earlier answers without it, so each turn is
    its own sequence; the supervised tokens decode to exactly the answer + <|im_end|>."""
    tok, template, _ = family(base_tok, "qwen3")
    one = Conversation("one", [{"role": "user", "content": QUESTIONS[0]}, {"role": "assistant", "content": PLAIN[0]}])
    ex = tokenize_conversation(one, tok, template=template)
    assert [tok.decode(r) for r in supervised_runs(ex)] == [PLAIN[0] + "<|im_end|>"]
    assert tok.decode(ex.input_ids).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n" + PLAIN[0] + "<|im_end|>")
    conv = Conversation("q", [{"role": "user", "content": QUESTIONS[0]}, {"role": "assistant", "content": PLAIN[0]},
                              {"role": "user", "content": QUESTIONS[1]}, {"role": "assistant", "content": PLAIN[1]}])
    nothink = load_template(tok, str(TEMPLATES / FAMILIES["qwen3"][0]), "enable_thinking=false")
    for t in (template, nothink):
        with pytest.raises(DataError, match="split it with split_turns"):  # turn 1 is re-rendered without the block
            tokenize_conversation(conv, tok, template=t)
        parts = split_turns([conv], tok, t)
        assert [p.id for p in parts] == ["q", "q@1"]
        exs = [tokenize_conversation(p, tok, template=t) for p in parts]
        assert [tok.decode(r) for e in exs for r in supervised_runs(e)] == [a + "<|im_end|>" for a in PLAIN]
        assert "assistant\nIt is 4.<|im_end|>" in tok.decode(exs[1].input_ids)  # the history as the engine renders it
    think = Conversation("r", [{"role": "user", "content": QUESTIONS[0]},
                               {"role": "assistant", "content": ANSWERS["qwen3"][0]},
                               {"role": "user", "content": QUESTIONS[1]},
                               {"role": "assistant", "content": ANSWERS["qwen3"][1]}])
    parts = split_turns([think], tok, template)  # reasoning kept in the answers: supervised as generated
    runs = [tok.decode(r) for p in parts for r in supervised_runs(tokenize_conversation(p, tok, template=template))]
    assert runs == [a + "<|im_end|>" for a in ANSWERS["qwen3"]]


def test_template_settings_are_checked(base_tok, tmp_path):
    tok, _, _ = family(base_tok, "qwen3")
    qwen3 = str(TEMPLATES / FAMILIES["qwen3"][0])
    with pytest.raises(DataError, match="enable_thinkng: .* does not read it .*enable_thinking"):
        load_template(tok, qwen3, "enable_thinkng=false")  # a typo
    with pytest.raises(DataError, match="enable_thinking: .*Llama-3.1.* does not read it"):
        load_template(tok, str(TEMPLATES / FAMILIES["llama3.1"][0]), "enable_thinking=false")  # ignored there
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}\n{{ m.content }\n{% endfor %}")
    with pytest.raises(DataError, match=r"bad.jinja:2: the chat template does not parse"):
        load_template(tok, str(bad))
    with pytest.raises(DataError, match="expected key=value"):
        load_template(tok, qwen3, "enable_thinking")
    with pytest.raises(DataError, match="cannot read"):
        load_template(tok, str(tmp_path / "missing.jinja"))
    # a thinking switch is a boolean (a template tests it for truth: "maybe" or "=false" would turn thinking on)
    for value in ("maybe", "=false", "1"):
        with pytest.raises(DataError, match="enable_thinking must be true or false, got "):
            load_template(tok, qwen3, f"enable_thinking={value}")
    # what the renderer sets itself, and values that are not YAML: one line each
    for arg in ("messages=[]", "add_generation_prompt=true"):
        with pytest.raises(DataError, match="is set by the renderer, not a template argument"):
            load_template(tok, qwen3, arg)
    for arg in ("enable_thinking=[1", "enable_thinking={", "x=!!python/object:os.system ls"):
        with pytest.raises(DataError, match="is not a value"):
            load_template(tok, qwen3, arg)
    want = load_template(tok, qwen3, "enable_thinking=false").settings(tok)
    check_settings(dict(want), want, "data", "this run")  # the same: passes
    with pytest.raises(DataError, match="kwargs enable_thinking=true, this run renders with enable_thinking=false"):
        check_settings({**want, "chat_template_kwargs": {"enable_thinking": True}}, want, "data", "this run")


def test_regenerate_bad_template_args_write_nothing(default_target_path, tmp_path, capsys):
    from vatspec.cli import main

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "Hi"}\n')
    out = tmp_path / "out.jsonl"
    assert main(["regenerate", str(prompts), "--out", str(out), "--target", str(default_target_path),
                 "--chat-template-kwargs", "enable_thinking=false"]) == 2
    err = capsys.readouterr().err
    assert "vatspec regenerate: error: chat template kwargs enable_thinking: the tokenizer's chat template does " \
        "not read it" in err
    assert not out.exists()
