"""Chat templates: loaded where Hugging Face keeps them, rendered as transformers' apply_chat_template renders them."""
import json

import pytest

from rocket_mpi.checkpoint.make import CHAT_SPECIAL_TOKENS, make_checkpoint, write_tokenizer
from rocket_mpi.errors import RocketError
from rocket_mpi.runtime.chat import (generation_config, load_chat_template, read_chat_prompts, render_chat,
                                     render_checkpoint_chat, special_tokens, stop_ids)

# A richer template: a bos variable, namespace, loops with loop.* and loopcontrols, raise_exception, tojson of
# HTML-ish text, the tools variable, whitespace left to trim_blocks/lstrip_blocks, strftime_now, an extra kwarg.
RICH = """{{ bos_token }}
{%- set ns = namespace(system='') -%}
{%- for m in messages -%}
    {%- if m['role'] == 'system' -%}{%- set ns.system = ns.system + m['content'] + ' ' -%}{%- endif -%}
{%- endfor %}
{% if ns.system %}
<<SYS>>{{ ns.system | trim }}<</SYS>> (year {{ strftime_now('%Y') }}{% if day %}, {{ day }}{% endif %})
{% endif %}
{% if tools is not none %}TOOLS{% endif %}
{% for message in messages %}
    {% if message['role'] == 'system' %}{% continue %}{% endif %}
    {% if message['role'] not in ['user', 'assistant'] %}
        {{ raise_exception('Unknown role: ' + message['role']) }}
    {% endif %}
    [{{ loop.index }}/{{ loop.length }}] {{ message['role'] | upper }}: {{ message['content'] }}
    {% if message['meta'] is defined %} meta={{ message['meta'] | tojson }}{% endif %}
    {% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}
    {% if message['content'] == 'STOP' %}{% break %}{% endif %}
{% endfor %}
{% if add_generation_prompt %}
ASSISTANT:
{% endif %}"""

CONVS = [
    [{"role": "user", "content": "Hello, world!"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "The expert split?"},
     {"role": "assistant", "content": "Same tokens."}, {"role": "user", "content": "Why <exactly> & how?"}],
    [{"role": "system", "content": "One."}, {"role": "system", "content": "Two."},
     {"role": "user", "content": "a\n  b", "meta": {"tag": "<b>&'\"", "n": [1, 2.5, None, True]}},
     {"role": "user", "content": "STOP"}, {"role": "assistant", "content": "never shown"}],
]


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """A made checkpoint with its tokenizer (tiny: vocab 512, room for the chat special tokens)."""
    d = tmp_path_factory.mktemp("chat_tiny")
    make_checkpoint("tiny", str(d), seed=3)
    return d


@pytest.fixture(scope="module")
def hf_tok(made):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(made))


def _hf_render(hf_tok, template, messages, **kw):
    return hf_tok.apply_chat_template(messages, chat_template=template, tokenize=False, add_generation_prompt=True,
                                      **kw)


# ---- loading ----------------------------------------------------------------------------------------------------

def test_template_from_jinja_file_wins_over_tokenizer_config(tmp_path):
    assert load_chat_template(str(tmp_path)) is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "from config"}))
    assert load_chat_template(str(tmp_path)) == "from config"
    (tmp_path / "chat_template.jinja").write_text("from {{ file }}\n")
    assert load_chat_template(str(tmp_path)) == "from {{ file }}\n"


def test_template_list_form_takes_default(tmp_path):
    cfg = tmp_path / "tokenizer_config.json"
    cfg.write_text(json.dumps({"chat_template": [{"name": "tool_use", "template": "T"},
                                                 {"name": "default", "template": "D"}]}))
    assert load_chat_template(str(tmp_path)) == "D"
    cfg.write_text(json.dumps({"chat_template": [{"name": "tool_use", "template": "T"}]}))
    with pytest.raises(RocketError, match='no "default" template .*tool_use'):
        load_chat_template(str(tmp_path))
    cfg.write_text(json.dumps({"chat_template": 7}))
    with pytest.raises(RocketError, match="chat_template is a int"):
        load_chat_template(str(tmp_path))


def test_unreadable_tokenizer_config_names_the_file(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(RocketError, match="tokenizer_config.json: not valid JSON"):
        load_chat_template(str(tmp_path))


def test_made_checkpoint_files(made):
    cfg = json.loads((made / "config.json").read_text())
    assert load_chat_template(str(made)).startswith("[gMASK]<sop>")
    assert special_tokens(str(made)) == {"bos_token": "<bos>", "eos_token": "<eos>"}
    assert json.loads((made / "generation_config.json").read_text()) == {"eos_token_id": [cfg["eos_token_id"]],
                                                                         "bos_token_id": cfg["bos_token_id"]}
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(made / "tokenizer.json"))
    ids = [tok.token_to_id(t) for t in ("<bos>", "<eos>", *CHAT_SPECIAL_TOKENS)]
    assert ids[:2] == [cfg["bos_token_id"], cfg["eos_token_id"]]
    assert all(i is not None for i in ids) and tok.get_vocab_size() <= cfg["vocab_size"]
    assert tok.decode(tok.encode("Hello, world!").ids) == "Hello, world!"


def test_no_room_leaves_chat_markers_as_text(tmp_path):
    write_tokenizer(str(tmp_path), 258)  # 256 bytes + <bos>, <eos>: full
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert tok.get_vocab_size() == 258 and tok.token_to_id("[gMASK]") is None
    assert max(tok.encode("[gMASK]<sop><|user|>\nhi").ids) < 258


# ---- rendering: the same text as transformers -------------------------------------------------------------------

@pytest.mark.parametrize("conv", range(len(CONVS)))
def test_made_template_renders_as_transformers(made, hf_tok, conv):
    msgs = CONVS[conv][:4] if conv == 2 else CONVS[conv]  # the GLM-style template has no "meta" or STOP
    tpl = load_chat_template(str(made))
    assert hf_tok.chat_template == tpl  # transformers reads the same template from tokenizer_config.json
    want = hf_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert render_checkpoint_chat(str(made), msgs) == want
    assert render_chat(tpl, msgs, add_generation_prompt=False) == hf_tok.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=False)
    assert want.startswith("[gMASK]<sop><|") and want.endswith("<|assistant|>\n")


@pytest.mark.parametrize("conv", range(len(CONVS)))
def test_rich_template_renders_as_transformers(made, hf_tok, conv):
    want = _hf_render(hf_tok, RICH, CONVS[conv], day="Tuesday")
    assert render_chat(RICH, CONVS[conv], bos_token="<bos>", eos_token="<eos>", day="Tuesday") == want
    # a second pass without the extra kwarg: undefined is falsy the same way
    assert render_chat(RICH, CONVS[conv], bos_token="<bos>", eos_token="<eos>") == _hf_render(hf_tok, RICH,
                                                                                             CONVS[conv])


def test_rich_template_details():
    out = render_chat(RICH, CONVS[2], bos_token="<bos>", eos_token="<eos>")
    assert '"<b>&\'\\"' in out and "never shown" not in out  # tojson leaves HTML alone; break stopped the loop
    assert out.startswith("<bos><<SYS>>One. Two.<</SYS>>") and out.endswith("USER: STOP\nASSISTANT:\n")


def test_content_parts_are_joined(made, hf_tok):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "world!"}]}]
    plain = [{"role": "user", "content": "Hello, world!"}]
    assert render_checkpoint_chat(str(made), parts) == hf_tok.apply_chat_template(plain, tokenize=False,
                                                                                 add_generation_prompt=True)


def test_raise_exception_becomes_rocket_error(made, hf_tok):
    import jinja2
    bad = [{"role": "tool", "content": "x"}]
    with pytest.raises(jinja2.TemplateError, match="Unknown role: tool"):
        _hf_render(hf_tok, RICH, bad)
    with pytest.raises(RocketError, match="my template: Unknown role: tool"):
        render_chat(RICH, bad, source="my template")
    with pytest.raises(RocketError, match=r"tokenizer_config.json chat_template: role tool is not one of"):
        render_checkpoint_chat(str(made), bad)


def test_template_errors_name_the_template():
    with pytest.raises(RocketError, match=r"^T: not a valid jinja template \(line 1"):
        render_chat("{% for m in messages %}", [{"role": "user", "content": "x"}], source="T")
    with pytest.raises(RocketError, match=r"^T: failed to render \(TypeError"):
        render_chat("{{ messages[0]['content'] + 1 }}", [{"role": "user", "content": "x"}], source="T")
    # the sandbox: no underscore names on a namespace, no reach into Python internals
    with pytest.raises(RocketError, match=r"^T: namespace attribute '_x'"):
        render_chat("{% set ns = namespace() %}{% set ns._x = 1 %}", [{"role": "user", "content": "x"}], source="T")
    with pytest.raises(RocketError, match=r"^T: access to attribute '__class__' .* is unsafe"):
        render_chat("{{ messages.__class__.__mro__ }}", [{"role": "user", "content": "x"}], source="T")


@pytest.mark.parametrize("messages, why", [
    ([], "has no messages"),
    ("hi", "expected a list of messages, got str"),
    (["hi"], "message 0 is a str"),
    ([{"content": "x"}], 'message 0 has no "role" string'),
    ([{"role": 3, "content": "x"}], 'message 0: "role" must be a non-empty string, got 3'),
    ([{"role": "user", "content": "x"}, {"role": "user"}], r'message 1 \(user\) has no "content"'),
    ([{"role": "user", "content": 5}], r'message 0 \(user\): "content" must be a string or a list of text parts'),
    ([{"role": "user", "content": [{"type": "image", "url": "u"}]}], r"content part 0 has type 'image'"),
    ([{"role": "user", "content": [{"type": "text"}]}], r'content part 0 has no "text" string'),
    ([{"role": "user", "content": ["x"]}], r"content part 0 is a str"),
])
def test_bad_messages(messages, why):
    with pytest.raises(RocketError, match=why):
        render_chat("{{ messages }}", messages)


# ---- chat prompt files ------------------------------------------------------------------------------------------

def test_read_chat_prompts_matches_transformers_ids(made, hf_tok, tmp_path):
    convs = [CONVS[0], CONVS[1][:4]]
    p = tmp_path / "chat.json"
    p.write_text(json.dumps(convs))
    ids = read_chat_prompts(str(p), str(made), None)
    want = [hf_tok.apply_chat_template(c, tokenize=True, add_generation_prompt=True, return_dict=False)
            for c in convs]
    assert ids == want
    gmask, sop, user = (hf_tok.convert_tokens_to_ids(t) for t in ("[gMASK]", "<sop>", "<|user|>"))
    assert ids[0][:3] == [gmask, sop, user]
    vocab = json.loads((made / "config.json").read_text())["vocab_size"]
    assert all(0 <= t < vocab for seq in ids for t in seq)
    assert read_chat_prompts(str(p), str(made), 5) == [ids[0], ids[1], ids[0], ids[1], ids[0]]
    assert read_chat_prompts(str(p), str(made), 1) == [ids[0]]


def test_read_chat_prompts_errors(made, tmp_path):
    p = tmp_path / "c.json"
    with pytest.raises(RocketError, match="c.json: file not found"):
        read_chat_prompts(str(p), str(made), None)
    for text, why in (("[[{", "not valid JSON"), ("[]", "expected a non-empty JSON list of conversations"),
                      ('["hi"]', "expected a non-empty JSON list of conversations"),
                      ('[[{"role": "user", "content": "x"}], [{"role": "user"}]]',
                       r'conversation 1: message 0 \(user\) has no "content"'),
                      ('[[{"role": "tool", "content": "x"}]]', "conversation 0: .*chat_template: role tool")):
        p.write_text(text)
        with pytest.raises(RocketError, match=why) as e:
            read_chat_prompts(str(p), str(made), None)
        assert "\n" not in str(e.value)
    p.write_text(json.dumps([CONVS[0]]))
    bare = tmp_path / "bare"
    make_checkpoint("tiny", str(bare), seed=3, tokenizer=False)
    with pytest.raises(RocketError, match=r"has no chat template \(chat_template.jinja or tokenizer_config.json\)"):
        read_chat_prompts(str(p), str(bare), None)
    (bare / "chat_template.jinja").write_text(load_chat_template(str(made)))
    with pytest.raises(RocketError, match="chat prompts need .*tokenizer.json"):
        read_chat_prompts(str(p), str(bare), None)


# ---- generation config ------------------------------------------------------------------------------------------

def test_generation_config_and_stop_ids(made, tmp_path):
    assert generation_config(str(made)) == {"eos_token_id": (1,)}
    assert stop_ids(str(made), (1,)) == (1,)
    assert generation_config(str(tmp_path)) == {} and stop_ids(str(tmp_path), (5, 2)) == (2, 5)
    g = tmp_path / "generation_config.json"
    g.write_text(json.dumps({"eos_token_id": [9, 3], "temperature": 0.6, "top_p": 0.95, "top_k": 40,
                             "do_sample": True}))
    assert generation_config(str(tmp_path)) == {"eos_token_id": (9, 3), "temperature": 0.6, "top_p": 0.95,
                                                "top_k": 40}
    assert stop_ids(str(tmp_path), (3, 1)) == (1, 3, 9)
    g.write_text(json.dumps({"eos_token_id": 4}))
    assert generation_config(str(tmp_path)) == {"eos_token_id": (4,)}
    for text, why in (("{", "generation_config.json: not valid JSON"), ("[1]", "expected a JSON object"),
                      ('{"eos_token_id": "x"}', "eos_token_id must be a token id or a list"),
                      ('{"eos_token_id": [1, true]}', "eos_token_id must be"),
                      ('{"top_k": 1.5}', "top_k must be a non-negative integer")):
        g.write_text(text)
        with pytest.raises(RocketError, match=why):
            generation_config(str(tmp_path))
