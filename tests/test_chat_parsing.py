"""What /v1/chat/completions reads out of a completion's text: tool calls in GLM's <tool_call> form (serve/tools.py)
as OpenAI's tool_calls, and GLM's <think> ... </think> as reasoning_content (serve/reasoning.py, --reasoning-parser).

The parsers on texts in those forms; then the HTTP API itself (FastAPI's test client, driven by the real `openai`
client) over a scripted scheduler that "generates" a given text, since random weights never write a tool call or a
thought: the tools reach the chat template, the calls come back as tool_calls with typed arguments, the reasoning
apart from the content, streamed and not, and a conversation's earlier calls and tool results render."""
from __future__ import annotations

import json

import pytest

from rocket_mpi.serve import reasoning, tools as tc

openai = pytest.importorskip("openai", reason="the openai client is a test dependency (pip install -e '.[test]')")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                                     "code": {"type": "string"}, "opts": {"type": "object"}}}}}
CALL = ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n"
        "<arg_value>3</arg_value>\n<arg_key>code</arg_key>\n<arg_value>75</arg_value>\n<arg_key>opts</arg_key>\n"
        "<arg_value>{\"unit\": \"C\"}</arg_value>\n</tool_call>")
WANT = {"city": "Paris", "days": 3, "code": "75", "opts": {"unit": "C"}}

# A GLM-like template (written for this test): tools into a system turn, tool results as observations, earlier calls
# in the assistant's turn in the <tool_call> form
TEMPLATE = (
    "{% if tools %}<|system|>\n# Tools\n{% for t in tools %}{{ t.function | tojson }}\n{% endfor %}"
    "Call one as <tool_call>NAME\n<arg_key>KEY</arg_key>\n<arg_value>VALUE</arg_value>\n</tool_call>\n{% endif %}"
    "{% for m in messages %}{% if m.role == 'tool' %}<|observation|>\n<tool_response>{{ m.content }}"
    "</tool_response>\n{% else %}<|{{ m.role }}|>\n{{ m.content }}"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{{ c.function.name }}\n"
    "{% for k, v in c.function.arguments.items() %}<arg_key>{{ k }}</arg_key>\n<arg_value>{{ v }}</arg_value>\n"
    "{% endfor %}</tool_call>{% endfor %}{% endif %}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def test_a_call_with_typed_arguments_and_text_before_it():
    content, calls = tc.parse("Let me check.\n" + CALL, [WEATHER])
    assert content == "Let me check." and len(calls) == 1
    assert calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    assert calls[0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0]["function"]["arguments"]) == WANT  # "75" stays a string: the schema says so


def test_two_calls_an_unknown_tool_and_an_unfinished_one():
    content, calls = tc.parse(CALL + "\n" + CALL.replace("get_weather", "other"), [WEATHER])
    assert content is None and [c["function"]["name"] for c in calls] == ["get_weather", "other"]
    # a tool the request did not declare: its values read as JSON where they are
    assert json.loads(calls[1]["function"]["arguments"])["code"] == 75
    text = "Sure: <tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Par"  # cut by max_tokens
    assert tc.parse(text, [WEATHER]) == (text, [])


@pytest.mark.parametrize("text,n", [("abc", 3), ("abc<", 3), ("abc<tool_ca", 3), ("abc<tool_call>get", 3),
                                    ("a<b", 3), ("<", 0), ("", 0), ("x <tool_call", 2)])
def test_what_a_stream_may_send_before_a_call(text, n):
    assert tc.sendable(text) == n


@pytest.mark.parametrize("tools,choice,template,needle", [
    ([{"type": "function"}], None, TEMPLATE, "tools[0] must be"),
    ([{"type": "function", "function": {"description": "x"}}], None, TEMPLATE, "has no \"name\""),
    ("get_weather", None, TEMPLATE, "must be a list"),
    ([WEATHER], "required", TEMPLATE, "constrained decoding"),
    ([WEATHER], {"type": "function", "function": {"name": "get_weather"}}, TEMPLATE, "constrained decoding"),
    ([WEATHER], None, "{{ messages[0].content }}", "does not write tool calls"),
    (None, "required", TEMPLATE, "needs 'tools'"),
])
def test_tools_the_server_cannot_take(tools, choice, template, needle):
    with pytest.raises(tc.ToolError) as e:
        tc.check_tools(tools, choice, template)
    assert needle in str(e.value)


def test_tool_choice_none_renders_the_tools_and_reads_no_calls():
    assert tc.check_tools([WEATHER], "none", TEMPLATE) == ([WEATHER], False)
    assert tc.check_tools([WEATHER], None, TEMPLATE) == ([WEATHER], True)
    assert tc.check_tools([], None, None) == (None, False)


# ---- the HTTP API over a scripted scheduler -------------------------------------------------------------------

class _Tok:
    """A character tokenizer: one id per character (what the API needs of one: encode, decode)."""

    class _Enc:
        def __init__(self, ids):
            self.ids = ids

    def encode(self, text, add_special_tokens=True):
        return self._Enc([ord(c) for c in text])

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


class _Script:
    """A scheduler whose every request "generates" `text` a few characters per token, then stops."""

    class slots:
        capacity = 1 << 16

    def __init__(self, text):
        self.text, self.error, self.running, self.prompts = text, "", True, []

    def submit(self, req):
        self.prompts.append("".join(chr(i) for i in req.prompt))
        pieces = [self.text[i:i + 3] for i in range(0, len(self.text), 3)]
        for i, p in enumerate(pieces):
            req.sink(("token", 100 + i, p, None))
        req.sink(("done", "stop", {"prompt_tokens": len(req.prompt), "completion_tokens": len(pieces),
                                   "total_tokens": len(req.prompt) + len(pieces)}))

    def cancel(self, req):
        pass


@pytest.fixture
def scripted():
    from fastapi.testclient import TestClient

    from rocket_mpi.serve.api import Api, make_app

    def make(text, template=TEMPLATE, parser=False):
        sched = _Script(text)
        api = Api(sched, _Tok(), template, {}, "glm", 1 << 20, (), {}, parser)
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="none", max_retries=0,
                               http_client=TestClient(make_app(api)))
        return sched, client
    return make


CONV = [{"role": "user", "content": "Weather in Paris?"}]


def test_the_api_returns_tool_calls(scripted):
    sched, client = scripted("Let me check.\n" + CALL)
    r = client.chat.completions.create(model="glm", messages=CONV, tools=[WEATHER])
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.content == "Let me check."
    assert [c.function.name for c in msg.tool_calls] == ["get_weather"]
    assert json.loads(msg.tool_calls[0].function.arguments) == WANT
    assert '"name": "get_weather"' in sched.prompts[0]  # the template saw the tools
    # without tools (or with tool_choice "none") the text is the content, as generated
    r = client.chat.completions.create(model="glm", messages=CONV)
    assert r.choices[0].message.content == "Let me check.\n" + CALL and not r.choices[0].message.tool_calls
    r = client.chat.completions.create(model="glm", messages=CONV, tools=[WEATHER], tool_choice="none")
    assert r.choices[0].finish_reason == "stop" and "# Tools" in sched.prompts[-1]


def test_streamed_tool_calls(scripted):
    _, client = scripted("Let me check.\n" + CALL + "\n")
    content, calls, reasons = "", {}, []
    for ch in client.chat.completions.create(model="glm", messages=CONV, tools=[WEATHER], stream=True):
        d = ch.choices[0].delta
        content += d.content or ""
        for c in d.tool_calls or []:
            calls.setdefault(c.index, {"name": "", "arguments": ""})
            calls[c.index]["name"] += c.function.name or ""
            calls[c.index]["arguments"] += c.function.arguments or ""
        reasons.append(ch.choices[0].finish_reason)
    assert content.strip() == "Let me check." and "<tool" not in content
    assert [c["name"] for c in calls.values()] == ["get_weather"]
    assert json.loads(calls[0]["arguments"]) == WANT and reasons[-1] == "tool_calls"


def test_a_conversation_with_earlier_calls_and_results_renders(scripted):
    sched, client = scripted("It is sunny.")
    conv = CONV + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "days": 1})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    r = client.chat.completions.create(model="glm", messages=conv, tools=[WEATHER])
    assert r.choices[0].message.content == "It is sunny." and r.choices[0].finish_reason == "stop"
    p = sched.prompts[0]
    assert "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>" in p
    assert "<arg_key>days</arg_key>\n<arg_value>1</arg_value>" in p
    assert "<tool_response>sunny, 21 C</tool_response>" in p


def test_bad_tools_are_a_400_naming_the_field(scripted):
    _, client = scripted("x")
    with pytest.raises(openai.BadRequestError, match="constrained decoding") as e:
        client.chat.completions.create(model="glm", messages=CONV, tools=[WEATHER], tool_choice="required")
    assert e.value.body["param"] == "tool_choice"


# ---- reasoning ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text,inside,want", [
    ("<think>plan it</think>\nThe answer.", False, ("plan it", "The answer.")),
    ("\n<think>a</think>b", False, ("a", "b")),
    ("plan it</think>The answer.", True, ("plan it", "The answer.")),   # the prompt opened the <think>
    ("<think>cut short by max_tokens", False, ("cut short by max_tokens", "")),
    ("No thinking here.", False, (None, "No thinking here.")),
    ("<thin", False, (None, "<thin")),
    ("<think></think>Direct.", False, ("", "Direct.")),
])
def test_reasoning_split(text, inside, want):
    assert reasoning.split(text, inside) == want
    # streamed a character at a time: the same parts, nothing of a tag in either
    s, parts = reasoning.Splitter(inside), []
    parts = [s.feed(ch) for ch in text] + [s.finish()]
    got = ("".join(p[0] for p in parts) if s.thought else None, "".join(p[1] for p in parts))
    assert got == want


THINK_TEMPLATE = TEMPLATE.replace("<|assistant|>\n{% endif %}",
                                  "<|assistant|>\n{% if enable_thinking is defined and not enable_thinking %}"
                                  "<think></think>{% else %}<think>{% endif %}{% endif %}")


def test_the_api_returns_reasoning_apart_with_a_tool_call(scripted):
    sched, client = scripted("I should look it up.</think>\nLet me check.\n" + CALL, THINK_TEMPLATE, True)
    r = client.chat.completions.create(model="glm", messages=CONV, tools=[WEATHER])
    msg = r.choices[0].message
    assert msg.reasoning_content == "I should look it up." and msg.content == "Let me check."
    assert json.loads(msg.tool_calls[0].function.arguments) == WANT and r.choices[0].finish_reason == "tool_calls"
    thought, content, names = "", "", []
    for ch in client.chat.completions.create(model="glm", messages=CONV, tools=[WEATHER], stream=True):
        d = ch.choices[0].delta
        thought += getattr(d, "reasoning_content", None) or ""
        content += d.content or ""
        names += [c.function.name for c in d.tool_calls or []]
    assert thought == "I should look it up." and content.strip() == "Let me check." and names == ["get_weather"]
    # chat_template_kwargs reach the template: thinking off closes the <think> in the prompt, the text is content
    sched, client = scripted("Sunny.", THINK_TEMPLATE, True)
    r = client.chat.completions.create(model="glm", messages=CONV,
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert sched.prompts[0].endswith("<think></think>")
    assert r.choices[0].message.content == "Sunny." and getattr(r.choices[0].message, "reasoning_content", None) is None


def test_without_the_parser_the_text_is_as_written(scripted):
    _, client = scripted("<think>x</think>y", THINK_TEMPLATE, False)
    r = client.chat.completions.create(model="glm", messages=CONV)
    assert r.choices[0].message.content == "<think>x</think>y"
    assert getattr(r.choices[0].message, "reasoning_content", None) is None
    with pytest.raises(openai.BadRequestError, match="chat_template_kwargs"):
        client.chat.completions.create(model="glm", messages=CONV, extra_body={"chat_template_kwargs": {"messages": 1}})
