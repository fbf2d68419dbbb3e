"""vatspec.data records with tool use and reasoning: OpenAI tool calls, LLaMA-Factory's glaive ShareGPT,
Hermes function calling, xLAM, and the errors each bad shape gives (naming file:line and the field).

Nothing is downloaded. ``VATSPEC_GLAIVE_DEMO`` (the path of ``data/glaive_toolcall_en_demo.json`` from the
``llamafactory`` sdist) also reads that whole file.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest

from vatspec.data import ROLES, Conversation, DataError, load_conversations, parse_record


def jsonl(path: Path, *recs) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in recs), encoding="utf-8")
    return path


def call(name: str, args: dict, id: str | None = None) -> dict:
    """A tool call as it is read: ``{"id" (if given), "type": "function", "function": {...}}``."""
    return {**({"id": id} if id else {}), "type": "function", "function": {"name": name, "arguments": args}}


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


# --------------------------------------------------------------------------- OpenAI
OPENAI_TOOLS = {
    "id": "w1",
    "tools": [WEATHER],
    "messages": [
        {"role": "system", "content": "You can look up the weather."},
        {"role": "user", "content": "Weather in Paris and Oslo?"},
        {"role": "assistant", "content": None, "reasoning_content": "Two cities: two calls.",
         "tool_calls": [
             {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
             {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "tool_call_id": "c2", "content": [{"type": "text", "text": "-3 C"}]},
        {"role": "tool", "tool_call_id": "c1", "name": "get_weather", "content": "18 C"},
        {"role": "assistant", "content": "Paris 18 C, Oslo -3 C.", "token_ids": [5, 6, 7],
         "prompt_token_ids": [1, 2, 3, 4], "stop_token_id": 2},
    ],
}


def test_openai_tool_conversation_reads_and_round_trips(tmp_path):
    (c,) = load_conversations(jsonl(tmp_path / "o.jsonl", OPENAI_TOOLS))
    assert c == Conversation("w1", [
        {"role": "system", "content": "You can look up the weather."},
        {"role": "user", "content": "Weather in Paris and Oslo?"},
        {"role": "assistant", "content": "", "reasoning_content": "Two cities: two calls.",
         "tool_calls": [call("get_weather", {"city": "Paris"}, "c1"), call("get_weather", {"city": "Oslo"}, "c2")]},
        {"role": "tool", "content": "-3 C", "tool_call_id": "c2", "name": "get_weather"},  # name from the call c2
        {"role": "tool", "content": "18 C", "tool_call_id": "c1", "name": "get_weather"},
        {"role": "assistant", "content": "Paris 18 C, Oslo -3 C.", "token_ids": [5, 6, 7],
         "prompt_token_ids": [1, 2, 3, 4], "stop_token_id": 2},
    ], {}, [WEATHER])
    rec = json.loads(json.dumps(c.to_json()))  # through a file's JSON
    assert rec["tools"] == [WEATHER] and parse_record(rec, "x:1") == c


def test_plain_conversations_are_unchanged():
    c = Conversation("a", [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}], {"k": 1})
    assert c.tools == [] and c.to_json() == {"id": "a", "messages": c.messages, "meta": {"k": 1}}
    assert parse_record(c.to_json(), "x:1") == c
    assert ROLES == ("system", "user", "assistant", "tool")


def test_flat_tool_schemas_and_tools_as_a_json_string_and_empty_tools():
    msgs = [{"role": "user", "content": "?"}, {"role": "assistant", "content": "!"}]
    flat = [{"name": "get_weather", "description": "The weather in a city",
             "parameters": WEATHER["function"]["parameters"]}]
    assert parse_record({"messages": msgs, "tools": flat}, "x:1").tools == [WEATHER]
    assert parse_record({"messages": msgs, "tools": json.dumps(flat)}, "x:1").tools == [WEATHER]
    for none in ("", "[]", [], None):
        assert parse_record({"messages": msgs, "tools": none}, "x:1").tools == []


@pytest.mark.parametrize("field", ["reasoning_content", "thinking", "reasoning"])
def test_reasoning_read_from_each_field_as_reasoning_content(field):
    rec = {"messages": [{"role": "user", "content": "2+2?"},
                        {"role": "assistant", "content": "4", field: "Add them."}]}
    assert parse_record(rec, "x:1").messages[1] == {"role": "assistant", "content": "4",
                                                    "reasoning_content": "Add them."}
    rec["messages"][1]["reasoning_content"] = "Add them."  # the same twice (vLLM sends both) is fine
    assert parse_record(rec, "x:1").messages[1]["reasoning_content"] == "Add them."
    if field != "reasoning_content":
        rec["messages"][1]["reasoning_content"] = "Other."
        with pytest.raises(DataError, match=rf"x:1: turn 1: reasoning_content and {field} differ"):
            parse_record(rec, "x:1")


# --------------------------------------------------------------------------- LLaMA-Factory's glaive ShareGPT
# Two records copied verbatim from data/glaive_toolcall_en_demo.json of the llamafactory 0.9.5 sdist on PyPI
# (llamafactory-0.9.5.tar.gz), items 203 and 65 (0-based) of its JSON array; its dataset_info.json reads it as
# formatting "sharegpt" with columns {"messages": "conversations", "tools": "tools"}.
GLAIVE = [
    {"conversations": [
        {"from": "human", "value": "Hi, I was born on 1990-05-15. Can you tell me how old I am today?"},
        {"from": "function_call",
         "value": "{\"name\": \"calculate_age\", \"arguments\": {\"birthdate\": \"1990-05-15\"}}"},
        {"from": "observation", "value": "{\"age\": 31}"},
        {"from": "gpt", "value": "Based on the birthdate you provided, you are 31 years old today."}],
     "tools": "[{\"name\": \"calculate_age\", \"description\": \"Calculate the age based on birthdate\", "
              "\"parameters\": {\"type\": \"object\", \"properties\": {\"birthdate\": {\"type\": \"string\", "
              "\"description\": \"The birthdate in YYYY-MM-DD format\"}}, \"required\": [\"birthdate\"]}}]"},
    {"conversations": [
        {"from": "human", "value": "What's the current stock price of Apple?"},
        {"from": "function_call", "value": "{\"name\": \"get_stock_price\", \"arguments\": {\"company\": \"Apple\"}}"},
        {"from": "observation", "value": "{\"stock_price\": \"$150.75\"}"},
        {"from": "gpt", "value": "The current stock price of Apple is $150.75."},
        {"from": "human", "value": "And what about Microsoft?"},
        {"from": "function_call",
         "value": "{\"name\": \"get_stock_price\", \"arguments\": {\"company\": \"Microsoft\"}}"},
        {"from": "observation", "value": "{\"stock_price\": \"$210.22\"}"},
        {"from": "gpt", "value": "The current stock price of Microsoft is $210.22."},
        {"from": "human", "value": "Thank you for the information."},
        {"from": "gpt", "value": "You're welcome! If you have any other questions, feel free to ask."}],
     "tools": "[{\"name\": \"get_stock_price\", \"description\": \"Get the current stock price of a company\", "
              "\"parameters\": {\"type\": \"object\", \"properties\": {\"company\": {\"type\": \"string\", "
              "\"description\": \"The name of the company\"}}, \"required\": [\"company\"]}}]"},
]


def test_glaive_demo_records(tmp_path):
    p = tmp_path / "glaive.json"
    p.write_text(json.dumps(GLAIVE, indent=2), encoding="utf-8")  # a JSON array, as the demo file is
    age, stock = load_conversations(p)
    assert age.messages == [
        {"role": "user", "content": "Hi, I was born on 1990-05-15. Can you tell me how old I am today?"},
        {"role": "assistant", "content": "", "tool_calls": [call("calculate_age", {"birthdate": "1990-05-15"})]},
        {"role": "tool", "content": "{\"age\": 31}", "name": "calculate_age"},
        {"role": "assistant", "content": "Based on the birthdate you provided, you are 31 years old today."},
    ]
    assert age.tools == [{"type": "function", "function": {
        "name": "calculate_age", "description": "Calculate the age based on birthdate",
        "parameters": {"type": "object", "properties": {"birthdate": {
            "type": "string", "description": "The birthdate in YYYY-MM-DD format"}}, "required": ["birthdate"]}}}]
    price = [{"role": "assistant", "content": "", "tool_calls": [call("get_stock_price", {"company": company})]}
             for company in ("Apple", "Microsoft")]
    assert stock.messages == [
        {"role": "user", "content": "What's the current stock price of Apple?"}, price[0],
        {"role": "tool", "content": "{\"stock_price\": \"$150.75\"}", "name": "get_stock_price"},
        {"role": "assistant", "content": "The current stock price of Apple is $150.75."},
        {"role": "user", "content": "And what about Microsoft?"}, price[1],
        {"role": "tool", "content": "{\"stock_price\": \"$210.22\"}", "name": "get_stock_price"},
        {"role": "assistant", "content": "The current stock price of Microsoft is $210.22."},
        {"role": "user", "content": "Thank you for the information."},
        {"role": "assistant", "content": "You're welcome! If you have any other questions, feel free to ask."},
    ]
    assert [t["function"]["name"] for t in stock.tools] == ["get_stock_price"]
    assert all(parse_record(c.to_json(), "x:1") == c for c in (age, stock))


def test_glaive_call_lists_string_arguments_and_a_gpt_turn_right_after_the_call():
    calls = [{"name": "a", "arguments": "{\"x\": 1}"}, {"name": "b", "arguments": {}}]
    rec = {"conversations": [{"from": "human", "value": "Go"}, {"from": "function_call", "value": json.dumps(calls)},
                             {"from": "observation", "value": "1"}, {"from": "observation", "value": "2"},
                             {"from": "function_call", "value": json.dumps(calls[1])},
                             {"from": "gpt", "value": "Calling b."}]}
    assert parse_record(rec, "x:1").messages == [
        {"role": "user", "content": "Go"},
        {"role": "assistant", "content": "", "tool_calls": [call("a", {"x": 1}), call("b", {})]},
        {"role": "tool", "content": "1", "name": "a"},  # names by position after the call
        {"role": "tool", "content": "2", "name": "b"},
        {"role": "assistant", "content": "", "tool_calls": [call("b", {})]},  # two messages, as the template sees them
        {"role": "assistant", "content": "Calling b."},
    ]


def test_whole_glaive_demo_file():
    """The bundled glaive tool-call demo (LLaMA-Factory 0.9.5's data/glaive_toolcall_en_demo.json, one record a
    line): every record reads, every call and every result is kept."""
    path = Path(__file__).resolve().parents[1] / "src" / "vatspec" / "benchmarks" / "train_glaive_toolcall.jsonl"
    raw = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    stats: dict = {}
    convs = load_conversations(str(path), skip_bad=True, stats=stats)
    assert stats["bad"] == 0 and len(convs) == len(raw)
    turns = [t["from"] for r in raw for t in r["conversations"]]
    msgs = [m for c in convs for m in c.messages]
    assert sum(len(m.get("tool_calls", [])) for m in msgs) == turns.count("function_call")
    assert sum(m["role"] == "tool" for m in msgs) == turns.count("observation")
    assert sum(bool(c.tools) for c in convs) == sum(r["tools"] not in ("", "[]") for r in raw)


# --------------------------------------------------------------------------- Hermes function calling
# Shaped as NousResearch/hermes-function-calling-v1 (its dataset card's example, shortened): the tools and the
# calls as Python literals, a system prompt that also names <tools></tools> and <tool_call> in its prose.
HERMES_SYSTEM = (
    "You are a function calling AI model. You are provided with function signatures within <tools> </tools> XML "
    "tags.\n<tools>\n[{'type': 'function', 'function': {'name': 'get_weather', 'description': 'The weather in a "
    "city', 'parameters': {'type': 'object', 'properties': {'city': {'type': 'string'}}, 'required': ['city']}}}]"
    "\n</tools>\nFor each function call return a json object with function name and arguments within "
    "<tool_call> </tool_call> tags with the following schema:\n<tool_call>\n{'arguments': <args-dict>, "
    "'name': <function-name>}\n</tool_call>\n"
)
HERMES = {"id": "h1", "category": "Weather", "conversations": [
    {"from": "system", "value": HERMES_SYSTEM},
    {"from": "human", "value": "Weather in Paris and Oslo?"},
    {"from": "gpt", "value": "Looking both up.\n<tool_call>\n{'arguments': {'city': 'Paris'}, 'name': 'get_weather'}"
                             "\n</tool_call>\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": "
                             "\"Oslo\"}}\n</tool_call>\n"},
    {"from": "tool", "value": "<tool_response>\n{\"name\": \"get_weather\", \"content\": {\"c\": 18}}\n"
                              "</tool_response>\n<tool_response>\n{\"name\": \"get_weather\", \"content\": "
                              "{\"c\": -3}}\n</tool_response>\n"},
    {"from": "gpt", "value": "Paris 18 C, Oslo -3 C."},
]}


def test_hermes_function_calling():
    c = parse_record(HERMES, "x:1")
    assert c.tools == [WEATHER]
    assert c.messages == [
        {"role": "system", "content": HERMES_SYSTEM},  # kept as it is
        {"role": "user", "content": "Weather in Paris and Oslo?"},
        {"role": "assistant", "content": "Looking both up.",
         "tool_calls": [call("get_weather", {"city": "Paris"}), call("get_weather", {"city": "Oslo"})]},
        {"role": "tool", "content": "{\"name\": \"get_weather\", \"content\": {\"c\": 18}}", "name": "get_weather"},
        {"role": "tool", "content": "{\"name\": \"get_weather\", \"content\": {\"c\": -3}}", "name": "get_weather"},
        {"role": "assistant", "content": "Paris 18 C, Oslo -3 C."},
    ]
    assert parse_record(c.to_json(), "x:1") == c
    # Without tools in the conversation, <tool_call> in a ShareGPT answer is text, as before.
    plain = {"conversations": [HERMES["conversations"][1], HERMES["conversations"][2]]}
    assert parse_record(plain, "x:1").messages[1] == {"role": "assistant",
                                                      "content": HERMES["conversations"][2]["value"]}


# --------------------------------------------------------------------------- xLAM
# Shaped as Salesforce/xlam-function-calling-60k: tools and answers are JSON strings; parameters as xLAM writes them.
XLAM_TOOLS = [{"name": "live_giveaways_by_type", "description": "Retrieve live giveaways by type.",
               "parameters": {"type": {"description": "The type of giveaways (game, loot, beta).", "type": "str",
                                       "default": "game"}}}]
XLAM = {"id": 0, "query": "Where can I find live giveaways for beta access and games?",
        "answers": json.dumps([{"name": "live_giveaways_by_type", "arguments": {"type": "beta"}},
                               {"name": "live_giveaways_by_type", "arguments": {"type": "game"}}]),
        "tools": json.dumps(XLAM_TOOLS)}


def test_xlam():
    c = parse_record(XLAM, "x:1")
    assert c == Conversation("0", [
        {"role": "user", "content": "Where can I find live giveaways for beta access and games?"},
        {"role": "assistant", "content": "", "tool_calls": [
            call("live_giveaways_by_type", {"type": "beta"}), call("live_giveaways_by_type", {"type": "game"})]},
    ], {}, [{"type": "function", "function": XLAM_TOOLS[0]}])
    assert parse_record(c.to_json(), "x:1") == c


# --------------------------------------------------------------------------- bad input
GOOD = [{"id": "g1", "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]},
        OPENAI_TOOLS, HERMES]
ASK = {"role": "user", "content": "Weather?"}


def calls_then(result: dict, arguments: object = '{"city": "Paris"}') -> dict:
    return {"id": "bad", "messages": [ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]}, result]}


BAD = [  # (what, the bad record, the error after "FILE:2: ")
    ("tool_without_call", {"messages": [ASK, {"role": "tool", "content": "18 C"}]},
     "turn 1: a tool message with no tool call before it"),
    ("tool_after_plain_answer",
     {"messages": [ASK, {"role": "assistant", "content": "Hm"}, {"role": "tool", "content": "x"}]},
     "turn 2: a tool message with no tool call before it"),
    ("arguments_not_json", calls_then({"role": "tool", "content": "x"}, "{city: Paris}"),
     r"turn 1: tool_calls\[0\].function.arguments is not a JSON object: '\{city: Paris\}' \(Expecting property name"),
    ("arguments_not_an_object", calls_then({"role": "tool", "content": "x"}, "[1, 2]"),
     r"turn 1: tool_calls\[0\].function.arguments is not a JSON object: '\[1, 2\]'"),
    ("call_without_name", {"messages": [ASK, {"role": "assistant", "content": "", "tool_calls": [{"arguments": {}}]}]},
     r"turn 1: tool_calls\[0\].function.name: missing"),
    ("reasoning_on_user", {"messages": [{**ASK, "reasoning_content": "hm"}, {"role": "assistant", "content": "x"}]},
     r"turn 0: reasoning_content on a user message \(only assistant messages carry reasoning\)"),
    ("thinking_on_system", {"messages": [{"role": "system", "content": "s", "thinking": "hm"}, ASK,
                                         {"role": "assistant", "content": "x"}]},
     "turn 0: thinking on a system message"),
    ("tool_calls_on_user",
     {"messages": [{**ASK, "tool_calls": [call("f", {})]}, {"role": "assistant", "content": "x"}]},
     r"turn 0: tool_calls on a user message \(only assistant messages carry tool calls\)"),
    ("unknown_role", {"messages": [ASK, {"role": "robot", "content": "x"}]}, "turn 1: unknown role 'robot'; expected"),
    ("unmatched_tool_call_id", calls_then({"role": "tool", "tool_call_id": "c9", "content": "18 C"}),
     r"turn 2: tool_call_id 'c9' matches none of the calls before it \(ids \['c1'\]\)"),
    ("more_results_than_calls", {"messages": [*calls_then({"role": "tool", "content": "1"})["messages"],
                                              {"role": "tool", "content": "2"}]},
     "turn 3: tool message 2 after a message of 1 tool call"),
    ("stop_token_id_on_user", {"messages": [{**ASK, "stop_token_id": 2}, {"role": "assistant", "content": "x"}]},
     "turn 0: stop_token_id must be a token id >= 0 on an assistant message"),
    ("tools_not_a_list", {**GOOD[0], "tools": "{\"name\": \"f\"}"}, "tools must be a list of tool schemas, got dict"),
]


@pytest.mark.parametrize("what,bad,error", BAD, ids=[b[0] for b in BAD])
def test_bad_record_names_file_line_and_is_counted_by_skip_bad(tmp_path, caplog, what, bad, error):
    p = jsonl(tmp_path / f"{what}.jsonl", GOOD[0], bad, *GOOD[1:])
    with pytest.raises(DataError) as e:
        load_conversations(p)
    assert str(e.value).startswith(f"{p}:2: ")
    assert re.match(error, str(e.value)[len(f"{p}:2: "):]), str(e.value)
    stats: dict = {}
    with caplog.at_level(logging.WARNING, logger="vatspec.data"):
        convs = load_conversations(p, skip_bad=True, stats=stats)
    assert [c.id for c in convs] == ["g1", "w1", "h1"]
    assert stats["records"] == 4 and stats["bad"] == 1 and stats["first_bad"] == str(e.value)
    assert "skipped 1 bad records" in caplog.text
