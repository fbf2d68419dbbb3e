"""Tool use in conversations: OpenAI tool calls and tool schemas, and the other shapes that carry them.

``records.parse_record`` reads through these; each raises ``DataError`` naming ``where`` (``file:line``,
``file:line: turn k``) and the field. What they produce (the internal message dict, see ``records``):

    assistant  {"role": "assistant", "content": str, "tool_calls": [
                    {"id": str (if given), "type": "function", "function": {"name": str, "arguments": dict}}]}
    tool       {"role": "tool", "content": str, "name": str, "tool_call_id": str (if given)}
    tools      [{"type": "function", "function": {"name": str, "description": .., "parameters": ..}}]

Shapes read besides OpenAI's: LLaMA-Factory's ShareGPT (``function_call`` and ``observation`` turns, ``tools``
as a JSON string: its glaive tool-call demo), Hermes function calling (``<tools>``, ``<tool_call>`` and
``<tool_response>`` blocks in the turns' text, in JSON or as Python literals) and xLAM (``query``, ``tools``,
``answers``).
"""

from __future__ import annotations

import ast
import json
import re

from vatspec.data.records import DataError

_TOOLS_BLOCK = re.compile(r"<tools>(.*?)</tools>", re.S)
_CALL_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
_RESPONSE_BLOCK = re.compile(r"<tool_response>(.*?)</tool_response>", re.S)


def load_json(text: object, what: str, where: str, *, literal: bool = False) -> object:
    """``text`` parsed as JSON; with ``literal`` a Python literal too (Hermes writes ``{'a': True}``).
    A value that is not a string is taken as already parsed."""
    if not isinstance(text, str):
        return text
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        err = f"{e.msg} at column {e.colno}"
    if literal:
        try:  # through JSON, so that what is kept is JSON (tuples become lists; a set fails)
            return json.loads(json.dumps(ast.literal_eval(text.strip())))
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            pass
    raise DataError(f"{where}: {what} is not JSON ({err}): {text!r:.80}")


def tool_schemas(x: object, where: str, *, literal: bool = False) -> list[dict]:
    """A conversation's ``tools`` -> OpenAI tool schemas ``{"type": "function", "function": {"name", ...}}``.

    Read: a list of those; flat ``{"name", "description", "parameters"}`` entries (wrapped); a JSON string
    holding either (glaive and xLAM store one). ``None``, ``""`` and ``[]`` are no tools.
    """
    if x is None or x == "":
        return []
    x = load_json(x, "tools", where, literal=literal)
    if not isinstance(x, list):
        raise DataError(f"{where}: tools must be a list of tool schemas, got {type(x).__name__}")
    out = []
    for k, t in enumerate(x):
        if isinstance(t, dict) and isinstance(t.get("function"), dict):
            t = {**t, "type": t.get("type", "function")}
        elif isinstance(t, dict) and "name" in t:
            t = {"type": "function", "function": {f: v for f, v in t.items() if f != "type"}}
        else:
            raise DataError(f"{where}: tools[{k}]: expected {{'type': 'function', 'function': {{'name': ..}}}} or "
                            f"{{'name', 'description', 'parameters'}}, got {t!r:.80}")
        if not isinstance(t["function"].get("name"), str) or not t["function"]["name"]:
            raise DataError(f"{where}: tools[{k}].function.name: missing (a tool schema names its function)")
        out.append(t)
    return out


def tool_calls(x: object, where: str, field: str = "tool_calls") -> list[dict]:
    """A message's tool calls -> ``[{"id" (if given), "type": "function", "function": {"name", "arguments"}}]``.

    Read: OpenAI's ``{"id", "type": "function", "function": {"name", "arguments"}}`` and the flat
    ``{"name", "arguments"}`` (glaive, Hermes, xLAM), as a list or a JSON string of one. ``arguments`` given as a
    JSON string is parsed; it must be an object (vLLM and HF chat templates take a dict).
    """
    x = load_json(x, field, where)
    if not isinstance(x, list):
        raise DataError(f"{where}: {field} must be a list of tool calls, got {type(x).__name__}")
    return [_tool_call(c, where, f"{field}[{k}]") for k, c in enumerate(x)]


def _tool_call(c: object, where: str, field: str) -> dict:
    if not isinstance(c, dict):
        raise DataError(f"{where}: {field}: expected an object with the function's name and arguments, got {c!r:.80}")
    fn = c["function"] if isinstance(c.get("function"), dict) else c
    name, args = fn.get("name"), fn.get("arguments")
    if not isinstance(name, str) or not name:
        raise DataError(f"{where}: {field}.function.name: missing (a tool call names its function)")
    if args is None:
        raise DataError(f"{where}: {field}.function.arguments: missing (give {{}} for a call without arguments)")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: {field}.function.arguments is not a JSON object: {fn['arguments']!r:.80} "
                            f"({e.msg} at column {e.colno})") from None
    if not isinstance(args, dict):
        raise DataError(f"{where}: {field}.function.arguments is not a JSON object: {fn['arguments']!r:.80}")
    call = {"type": "function", "function": {"name": name, "arguments": args}}
    if c.get("id") is not None:
        if not isinstance(c["id"], str):
            raise DataError(f"{where}: {field}.id must be a string, got {c['id']!r:.40}")
        call = {"id": c["id"], **call}
    return call


def function_call_turn(value: object, where: str) -> list[dict]:
    """A ShareGPT ``function_call`` turn's value (LLaMA-Factory): one call or a list of calls, in JSON."""
    v = load_json(value, "the function_call value", where, literal=True)
    return tool_calls(v if isinstance(v, list) else [v], where)


def hermes_tools(text: str, where: str) -> list[dict]:
    """The tools a Hermes system prompt lists in ``<tools>[...]</tools>`` (a JSON list, Python literals, or one
    object a line as Qwen's template writes them); ``[]`` if it lists none (``<tools></tools>`` in the prose)."""
    for m in _TOOLS_BLOCK.finditer(text):
        body = m.group(1).strip()
        if body.startswith("{") and "\n" in body:
            try:
                return tool_schemas([json.loads(line) for line in body.splitlines() if line.strip()], where)
            except json.JSONDecodeError:
                pass
        if body.startswith(("[", "{")):
            v = load_json(body, "the <tools> list", where, literal=True)
            return tool_schemas(v if isinstance(v, list) else [v], where)
    return []


def hermes_calls(text: str, where: str) -> tuple[str, list[dict]]:
    """An assistant text holding ``<tool_call>{"name", "arguments"}</tool_call>`` blocks -> (the text outside
    them, stripped; the calls)."""
    calls = [load_json(m.group(1).strip(), f"<tool_call> block {k}", where, literal=True)
             for k, m in enumerate(_CALL_BLOCK.finditer(text))]
    return _CALL_BLOCK.sub("", text).strip(), tool_calls(calls, where)


def hermes_responses(text: str) -> list[str]:
    """The texts of a Hermes tool turn's ``<tool_response>`` blocks, stripped (one tool message each); the whole
    text if it has none."""
    return [m.group(1).strip() for m in _RESPONSE_BLOCK.finditer(text)] or [text]


def link_results(msgs: list[dict], turns: list[int], where: str) -> None:
    """Check that each tool message answers a call, and fill in its ``name``.

    A tool message follows (after other tool messages) an assistant message with ``tool_calls``; its
    ``tool_call_id``, if given, is one of that message's call ids. A missing ``name`` comes from the call
    (by id, else by the tool message's position among those after the call). ``turns[i]`` is the turn
    ``msgs[i]`` was read from, for the errors.
    """
    calls: list[dict] = []
    n = 0
    for m, k in zip(msgs, turns):
        if m["role"] != "tool":
            calls, n = m.get("tool_calls", []), 0
            continue
        if not calls:
            raise DataError(f"{where}: turn {k}: a tool message with no tool call before it")
        if "tool_call_id" in m:
            call = next((c for c in calls if c.get("id") == m["tool_call_id"]), None)
            if call is None:
                raise DataError(f"{where}: turn {k}: tool_call_id {m['tool_call_id']!r} matches none of the calls "
                                f"before it (ids {[c.get('id') for c in calls]})")
        else:
            call = calls[n] if n < len(calls) else None
        if "name" not in m:
            if call is None:
                raise DataError(f"{where}: turn {k}: tool message {n + 1} after a message of {len(calls)} tool "
                                "call(s), with no name or tool_call_id to say which call it answers")
            m["name"] = call["function"]["name"]
        n += 1
