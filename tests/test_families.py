"""Training sequences under the published templates of the families teams train drafts for: reasoning,
tool calls, their stop ids, a pinned date (tests/fixtures/chat_templates: each template byte for byte with
its source, described in families.yaml).

The reference for every case is what the serving engine feeds the target and what the model generates:
the context is the template's rendering up to the generation prompt; the supervised tokens are what
families.yaml says the model writes after it (its reasoning markers, its tool-call syntax) up to and
including the stop id from its generation config, whichever of them ends the turn. The tokenizer is
SmolLM2's with each family's tokens added (special or plain, as the real tokenizer marks them).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml

from vatspec.data import DataError, load_template, split_turns, tokenize_conversation
from vatspec.data.reasoning import reasoning_format
from vatspec.data.records import parse_record

TEMPLATES = Path(__file__).parent / "fixtures" / "chat_templates"
FAMILIES = yaml.safe_load((TEMPLATES / "families.yaml").read_text(encoding="utf-8"))
DATE = "2026-03-14"
SYSTEM = "You are terse."
Q = ["What is 2 + 2?", "And doubled?"]
R = ["Two and two make four.", "Twice four is eight."]
C = ["It is 4.", "Then 8."]
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                        "required": ["city"]}}}
RESULT = '{"temp_c": 21}'


@pytest.fixture(scope="module")
def base_tok(default_target_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_target_path)


def family(base_tok, name, kwargs=None):
    """(tokenizer with the family's tokens, ChatTemplate with its stop ids and a pinned date, spec)."""
    from tokenizers import AddedToken

    spec = FAMILIES[name]
    tok = copy.deepcopy(base_tok)
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in spec["special"]], special_tokens=True)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in spec["plain"]])
    if spec["bos"]:
        tok.bos_token = spec["bos"]
    tok.eos_token = spec["eos"]
    stop = [tok.convert_tokens_to_ids(t) for t in spec["stop"]]
    if kwargs is None:
        kwargs = spec["kwargs_think"] if spec["kwargs_think"] is not None else spec["kwargs_nothink"]
    text = (TEMPLATES / spec["file"]).read_text(encoding="utf-8")
    template = load_template(tok, str(TEMPLATES / spec["file"]), kwargs, DATE if "strftime_now" in text else None,
                             stop_ids=stop)
    return tok, template, spec


def encode(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def runs(ex):
    """The supervised runs of an example: each a list of ids."""
    out, cur = [], []
    for t, m in zip(ex.input_ids + [None], ex.loss_mask + [False]):
        if m:
            cur.append(t)
        elif cur:
            out.append(cur)
            cur = []
    return out


def sequences(conv, tok, template):
    """Each answer's (prompt ids the engine renders, supervised ids), over the parts ``split_turns`` makes, and
    a check that every part's context is exactly the template's prompt for each of its answers."""
    out = []
    for part in split_turns([conv], tok, template):
        ex = tokenize_conversation(part, tok, template=template)
        first = part.meta.get("context_turns", 0)
        answered = [i for i, m in enumerate(part.messages) if m["role"] == "assistant" and i >= first]
        got = runs(ex)
        assert len(got) == len(answered), (part.id, [tok.decode(r) for r in got])
        pos = 0
        for i, sup in zip(answered, got):
            m = part.messages[i]
            prompt = (m["prompt_token_ids"] if m.get("prompt_token_ids") is not None else
                      encode(tok, template.render(tok, part.messages[:i], generation_prompt=True, tools=conv.tools)))
            assert ex.input_ids[: len(prompt)] == prompt  # the context is the engine's prompt
            start = ex.input_ids.index(sup[0], len(prompt)) if sup else len(prompt)
            assert ex.input_ids[len(prompt): start] == [] or not any(ex.loss_mask[len(prompt): start])
            assert start >= pos
            pos = start + len(sup)
            out.append((prompt, sup))
    return out


def expected(spec, tool=False, i=0, args=None):
    if tool:
        return spec["generated_tool"].format(N="get_weather", A=args)
    return spec["generated"].format(R=R[i], C=C[i])


def reasons(spec) -> bool:
    return spec["kwargs_think"] is not None and "{R}" in spec["generated"]


NAMES = list(FAMILIES)


@pytest.mark.parametrize("name", NAMES)
def test_single_and_multi_turn_text_answers(base_tok, name):
    """A record's answers as text (with their reasoning where the family reasons, from the server's
    reasoning parser): each is supervised as the model generates it after the engine's prompt, system
    message and all, with the stop id its generation config ends the turn on."""
    tok, template, spec = family(base_tok, name)
    think = reasons(spec)
    fmt = reasoning_format(template, tok)
    msgs = [{"role": "system", "content": SYSTEM}]
    for k in range(2):
        msgs.append({"role": "user", "content": Q[k]})
        msgs.append({"role": "assistant", "content": C[k], **({"reasoning_content": R[k]} if think else {})})
    conv = parse_record({"id": name, "messages": msgs}, "t")
    if think and fmt is None:  # Granite: reasoning lives in the content as the model writes it, never in a field
        with pytest.raises(DataError, match="message 2: it has reasoning_content, but the chat template with these"):
            sequences(conv, tok, template)
        return
    got = sequences(conv, tok, template)
    want = [expected(spec, i=k) if think else spec["generated"].format(R="", C=C[k]) for k in range(2)]
    assert [tok.decode(s) for _, s in got] == want


@pytest.mark.parametrize("name", NAMES)
def test_regenerated_ids_in_process_and_through_a_server(base_tok, name):
    """Regenerated answers (``token_ids`` + the ``stop_token_id`` that ended them): the ids as generated, then
    that stop, never a second stop; a server's prompt ids (``prompt_token_ids``) are the context as they are.
    The reasoning split of the generated text (the family's markers learned from its template) gives back the
    reasoning and the answer."""
    tok, template, spec = family(base_tok, name)
    think = reasons(spec)
    msgs = []
    for k in range(2):
        text = expected(spec, i=k) if think else spec["generated"].format(R="", C=C[k])
        ids = encode(tok, text)
        stop = ids[-1]
        assert stop in template.stop_ids
        msgs.append({"role": "user", "content": Q[k]})
        fmt = reasoning_format(template, tok)
        body = tok.decode(ids[:-1])
        r, c = fmt.split(body) if fmt is not None else (None, body)
        if think and fmt is not None:
            assert (r, c) == (R[k], C[k])  # split by the family's own markers
        msgs.append({"role": "assistant", "content": c, **({"reasoning_content": r} if r is not None else {}),
                     "token_ids": ids[:-1], "stop_token_id": stop})
    conv = parse_record({"id": name, "messages": msgs}, "t")
    got = sequences(conv, tok, template)
    assert [s for _, s in got] == [m["token_ids"] + [m["stop_token_id"]] for m in conv.messages[1::2]]
    # through a server that returns its prompt ids: the context is those ids, whatever we would render
    served = copy.deepcopy(conv)
    prompt0 = encode(tok, template.render(tok, served.messages[:1], generation_prompt=True))
    served.messages[1]["prompt_token_ids"] = prompt0
    assert sequences(served, tok, template)[0] == (prompt0, conv.messages[1]["token_ids"] + [msgs[1]["stop_token_id"]])


ARGS = {"city": "Paris"}
# how each family writes the arguments in its call ({A} in families.yaml): JSON, or its own XML blocks
ARGS_TEXT = {"glm-4.5": "<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n",
             "qwen3-coder": "<parameter=city>\nParis\n</parameter>\n"}


# Two templates write a call in the history otherwise than the model emits it (families.yaml notes): a text
# record trains the template's form (what the engine re-feeds); regenerated ids train the model's own.
AS_RENDERED = {
    "gpt-oss": ' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>',
    "mistral-v0.3": '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "call12345"}]</s>',
}


# harmony: an answer without analysis is its final channel alone
NO_REASONING = {"gpt-oss": "<|channel|>final<|message|>{C}<|return|>"}


def empty_block(spec) -> str:
    """The empty reasoning block a reasoning family's generation starts with (context when a record has none)."""
    if not reasons(spec):
        return ""
    text = spec["generated"].format(R="", C="")
    for stop in spec["stop"]:
        text = text.removesuffix(stop)
    return text


@pytest.mark.parametrize("name", [n for n in NAMES if FAMILIES[n]["tools"]])
def test_tool_call_result_and_final_answer(base_tok, name):
    """An agent turn: the tool schema (system prompt) and the tool result are context; the call is supervised as
    the template writes it for the model to generate, up to the stop id that ends a call (gpt-oss ``<|call|>``,
    GLM ``<|observation|>``), then the final answer with its own stop id."""
    tok, template, spec = family(base_tok, name)
    call = {"id": "call12345", "type": "function", "function": {"name": "get_weather", "arguments": ARGS}}
    msgs = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call12345", "content": RESULT},
            {"role": "assistant", "content": C[0]}]
    conv = parse_record({"id": name, "messages": msgs, "tools": [TOOL]}, "t")
    got = sequences(conv, tok, template)
    args = ARGS_TEXT.get(name, json.dumps(ARGS))
    block = empty_block(spec)
    want_call = AS_RENDERED.get(name, expected(spec, tool=True, args=args)).removeprefix(block)
    want_final = NO_REASONING.get(name, spec["generated"]).format(R="", C=C[0]).removeprefix(block)
    assert [tok.decode(s) for _, s in got] == [want_call, want_final]
    context = tok.decode(got[1][0])
    assert RESULT in context or RESULT.replace('"', "\\\"") in context  # the result is context of the answer
    for _, sup in got:
        assert RESULT not in tok.decode(sup) and "The weather in a city." not in tok.decode(sup)


@pytest.mark.parametrize("name", [n for n in NAMES if FAMILIES[n]["date"]])
def test_a_pinned_date_renders_the_same_sequence_any_day(base_tok, name, monkeypatch):
    """A template that stamps today's date renders the pinned day, whatever the clock says; the settings
    record it, and a run that pins another day is refused."""
    import datetime as dt

    from vatspec.data.chat import check_settings

    tok, template, _ = family(base_tok, name)
    conv = parse_record({"id": "d", "messages": [{"role": "user", "content": Q[0]},
                                                 {"role": "assistant", "content": C[0]}]}, "t")
    first = tokenize_conversation(conv, tok, template=template).input_ids
    assert "2026" in tok.decode(first) or "14" in tok.decode(first)

    class Later(dt.datetime):
        @classmethod
        def now(cls, tz=None):
            return dt.datetime(2031, 1, 2, tzinfo=tz)

    monkeypatch.setattr(dt, "datetime", Later)
    assert tokenize_conversation(conv, tok, template=template).input_ids == first
    assert template.settings(tok)["chat_template_date"] == DATE
    other = load_template(tok, template.source, template.kwargs, "2026-03-15").settings(tok)
    with pytest.raises(DataError, match="date 2026-03-14, this run renders with 2026-03-15"):
        check_settings(template.settings(tok), other, "data", "this run")


@pytest.mark.parametrize("name", [n for n in NAMES if reasons(FAMILIES[n])])
def test_regenerated_reasoning_kept_or_dropped(base_tok, name):
    """What in-process regeneration stores of a generated answer (``answer_message``), for every reasoning family:
    ``keep``: the reasoning apart (split by the markers learned from the template), the ids as generated;
    ``drop``: the content alone and no ids, so it trains as the template renders an answer without reasoning."""
    from vatspec.data.regen import answer_message

    tok, template, spec = family(base_tok, name)
    fmt = reasoning_format(template, tok)
    ids = encode(tok, expected(spec))
    text, stop = tok.decode(ids[:-1]), ids[-1]
    kept, dropped = answer_message(text, ids[:-1], stop, fmt, "keep")
    if fmt is None:  # Granite: no markers to split by: the answer is kept as generated, reasoning inline
        assert kept == {"role": "assistant", "content": text, "token_ids": ids[:-1], "stop_token_id": stop}
        return
    assert (kept["reasoning_content"], kept["content"], dropped) == (R[0], C[0], False)
    msg, dropped = answer_message(text, ids[:-1], stop, fmt, "drop")
    assert msg == {"role": "assistant", "content": C[0]} and dropped
    cut = encode(tok, fmt.opener + R[0])  # cut at its length inside the reasoning: nothing to keep alone
    kept_cut, dropped_cut = answer_message(tok.decode(cut), cut, None, fmt, "drop")
    assert kept_cut["token_ids"] == cut and kept_cut["stop_token_id"] is None and not dropped_cut
    conv = parse_record({"id": name, "messages": [{"role": "user", "content": Q[0]}, msg]}, "t")
    ((_, sup),) = sequences(conv, tok, template)
    assert tok.decode(sup) == NO_REASONING.get(name, spec["generated"]).format(R="", C=C[0]).removeprefix(
        empty_block(spec))


def test_reasoning_is_never_dropped_or_doubled_silently(base_tok):
    """Review cases: a reasoning with the newlines the template strips is supervised once; a reasoning under
    thinking off (the prompt already closed the block) is refused, not trained without its reasoning or with a
    second block; an answer that repeats the question keeps its own text (Mistral, whose prompt and history
    differ)."""
    tok, template, _ = family(base_tok, "qwen3")
    conv = parse_record({"id": "nl", "messages": [{"role": "user", "content": Q[0]}, {"role": "assistant",
                        "content": C[0], "reasoning_content": R[0] + "\n\n"}]}, "t")
    ((_, sup),) = sequences(conv, tok, template)
    assert tok.decode(sup) == f"<think>\n{R[0]}\n</think>\n\n{C[0]}<|im_end|>"
    for name in ("qwen3", "smollm3"):
        tok, template, _ = family(base_tok, name, {"enable_thinking": False})
        conv = parse_record({"id": name, "messages": [{"role": "user", "content": Q[0]}, {"role": "assistant",
                            "content": C[0], "reasoning_content": R[0]}]}, "t")
        with pytest.raises(DataError, match="message 1: it has reasoning_content, but the chat template with these"):
            tokenize_conversation(conv, tok, template=template)
    tok, template, spec = family(base_tok, "mistral-v0.3")
    echo = "Paris is nice. Tell me about Paris"
    conv = parse_record({"id": "m", "messages": [{"role": "system", "content": SYSTEM},
                                                 {"role": "user", "content": "Tell me about Paris"},
                                                 {"role": "assistant", "content": echo}]}, "t")
    ((_, sup),) = sequences(conv, tok, template)
    assert tok.decode(sup) == spec["generated"].format(R="", C=echo)
