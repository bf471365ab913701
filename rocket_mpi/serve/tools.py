"""Tool calls on /v1/chat/completions, in the form GLM models write them.

The request's `tools` go to the checkpoint's chat template (as transformers' apply_chat_template hands them over),
which tells the model how to call them. GLM-4.5 and later write a call as

    <tool_call>NAME
    <arg_key>KEY</arg_key>
    <arg_value>VALUE</arg_value>
    ...
    </tool_call>

and this module turns the generated text into OpenAI's `tool_calls` ({id, type: "function", function: {name,
arguments: a JSON object as a string}}) and the text around them into the message's content. A value is kept as the
string written where the tool's JSON schema says the argument is a string (or says nothing about it and it is not
valid JSON), else it is read as JSON. Streaming holds back the text from the first `<tool_call>` on (and anything
that may be its start) and sends the calls, whole, when the completion ends.

Only that form is known: a template that does not write `<arg_key>` cannot be used with `tools` (one 400 that
says so), and `tool_choice` "required" or a named function (which need constrained decoding) is refused.
"""
from __future__ import annotations

import json
import re
import uuid

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)
_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)
MARKER = "<arg_key>"  # in a chat template: it writes GLM's form of tool calls


class ToolError(ValueError):
    """A request's tools or tool_choice the server cannot take (the API answers it with a 400 naming `param`)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def check_tools(tools, tool_choice, template: str | None) -> tuple[list[dict] | None, bool]:
    """-> (the tools for the template, or None; whether to read tool calls out of the completion)."""
    if tools is None or tools == []:
        if tool_choice not in (None, "none", "auto"):
            raise ToolError("'tool_choice' needs 'tools'", "tool_choice")
        return None, False
    if not isinstance(tools, list):
        raise ToolError("'tools' must be a list of {\"type\": \"function\", \"function\": {...}}", "tools")
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
            raise ToolError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}", "tools")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ToolError(f"tools[{i}].function has no \"name\"", "tools")
        if "parameters" in fn and not isinstance(fn["parameters"], dict):
            raise ToolError(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
    if tool_choice not in (None, "auto", "none"):
        raise ToolError("only 'tool_choice' \"auto\" and \"none\" are supported (a required or named call needs "
                        "constrained decoding)", "tool_choice")
    if template is None or MARKER not in template:
        raise ToolError("this checkpoint's chat template does not write tool calls in a form this server reads "
                        "(GLM's <tool_call> with <arg_key>/<arg_value>)", "tools")
    return tools, tool_choice != "none"


def _arg_type(tools: list[dict], name: str, key: str):
    for t in tools:
        fn = t["function"]
        if fn["name"] == name:
            prop = (fn.get("parameters") or {}).get("properties", {}).get(key)
            return prop.get("type") if isinstance(prop, dict) else None
    return None


def _value(raw: str, kind):
    if kind == "string":
        return raw
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def strip_calls(text: str) -> str:
    """The text without its complete tool calls."""
    return _CALL.sub("", text)


def parse(text: str, tools: list[dict]) -> tuple[str | None, list[dict]]:
    """The completion's text -> (its content without the calls, None if nothing is left; OpenAI tool_calls)."""
    calls = []
    for m in _CALL.finditer(text):
        body = m.group(1)
        name = body.split(MARKER, 1)[0].strip()
        if not name:
            continue
        args = {k.strip(): _value(v, _arg_type(tools, name, k.strip())) for k, v in _ARG.findall(body)}
        calls.append({"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                      "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}})
    if not calls:
        return text, []
    content = strip_calls(text).strip()
    return content or None, calls


def sendable(text: str) -> int:
    """How much of a streamed completion's text may go out as content now: up to the first tool call, holding back
    an end that may be the start of one."""
    at = text.find(OPEN)
    if at >= 0:
        return at
    for k in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if text.endswith(OPEN[:k]):
            return len(text) - k
    return len(text)


def history(messages: list[dict]) -> list[dict]:
    """Assistant messages' earlier tool calls as templates read them: `function.arguments` a mapping (OpenAI sends
    it as a JSON string; GLM's templates iterate it), and content "" where a call came without text."""
    if not isinstance(messages, list):
        return messages  # check_messages says what is wrong with it
    out = []
    for m in messages:
        calls = m.get("tool_calls") if isinstance(m, dict) else None
        if m.get("role") == "assistant" and isinstance(calls, list):
            m = dict(m, content=m.get("content") or "")
            fixed = []
            for c in calls:
                fn = c.get("function") if isinstance(c, dict) else None
                if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                    try:
                        args = json.loads(fn["arguments"])
                    except ValueError:
                        args = fn["arguments"]
                    c = dict(c, function=dict(fn, arguments=args))
                fixed.append(c)
            m["tool_calls"] = fixed
        out.append(m)
    return out
