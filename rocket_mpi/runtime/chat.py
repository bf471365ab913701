"""Chat prompts: a checkpoint's chat template, rendered the way Hugging Face's apply_chat_template renders it.

A checkpoint keeps its template where the Hugging Face ecosystem does (chat_template.jinja, else
tokenizer_config.json's "chat_template"), its stop tokens in generation_config.json. The template is rendered
with jinja2 in an immutable sandbox with the same settings, globals and filters as transformers, so a
conversation becomes the same text, then the same token ids (the template writes the special tokens itself).
"""
from __future__ import annotations

import json
import os
from datetime import datetime
from functools import lru_cache

from rocket_mpi.errors import RocketError

TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG = "tokenizer_config.json"
GENERATION_CONFIG = "generation_config.json"
# The named special tokens transformers hands a template as variables (bos_token, eos_token, ...)
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _read_json(path: str, what: str):
    """-> the parsed file, or None when it does not exist; unreadable -> RocketError naming it."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as e:
        raise RocketError(f"{path}: cannot read the {what} ({e})") from None
    except json.JSONDecodeError as e:
        raise RocketError(f"{path}: not valid JSON ({e})") from None


def _json_object(path: str, what: str) -> dict:
    """The JSON object in `path`, {} when there is no such file."""
    cfg = _read_json(path, what)
    if cfg is None:
        return {}
    if not isinstance(cfg, dict):
        raise RocketError(f"{path}: expected a JSON object, got {type(cfg).__name__}")
    return cfg


def _tokenizer_config(ckpt_dir: str) -> dict:
    return _json_object(os.path.join(ckpt_dir, TOKENIZER_CONFIG), "tokenizer config")


def load_chat_template(ckpt_dir: str) -> str | None:
    """The checkpoint's chat template: chat_template.jinja, else tokenizer_config.json's "chat_template"
    (a string, or a list of {"name", "template"} from which "default" is taken); None when it has none."""
    path = os.path.join(ckpt_dir, TEMPLATE_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        pass
    except (OSError, UnicodeDecodeError) as e:
        raise RocketError(f"{path}: cannot read the chat template ({e})") from None
    cfg_path = os.path.join(ckpt_dir, TOKENIZER_CONFIG)
    tpl = _tokenizer_config(ckpt_dir).get("chat_template")
    if tpl is None or isinstance(tpl, str):
        return tpl
    if isinstance(tpl, list):
        named = {}
        for i, entry in enumerate(tpl):
            if not (isinstance(entry, dict) and isinstance(entry.get("name"), str)
                    and isinstance(entry.get("template"), str)):
                raise RocketError(f"{cfg_path}: chat_template entry {i} is not a {{\"name\", \"template\"}} pair "
                                  f"of strings")
            named[entry["name"]] = entry["template"]
        if "default" not in named:
            names = ", ".join(named) or "none"
            raise RocketError(f"{cfg_path}: chat_template lists no \"default\" template (it has: {names})")
        return named["default"]
    raise RocketError(f"{cfg_path}: chat_template is a {type(tpl).__name__}, expected a string or a list of "
                      f"{{\"name\", \"template\"}} entries")


def special_tokens(ckpt_dir: str) -> dict[str, str]:
    """tokenizer_config.json's named special tokens (bos_token, eos_token, ...) as strings, for the template."""
    out = {}
    for name, value in _tokenizer_config(ckpt_dir).items():
        if name not in SPECIAL_TOKEN_NAMES:
            continue
        if isinstance(value, dict):  # a serialised AddedToken
            value = value.get("content")
        if isinstance(value, str):
            out[name] = value
    return out


# ---- rendering --------------------------------------------------------------------------------------------------

def _template_raise(message):
    import jinja2
    raise jinja2.exceptions.TemplateError(message)


def _template_tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # jinja2's own tojson escapes <, >, & and ' for HTML; chat templates want the plain JSON text
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _template_strftime_now(fmt):
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """The template's dict(): builds plain dicts, but is not the dict type a template could poke at."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, keys, value=None):
        return dict.fromkeys(keys, value)


def _namespace_type():
    import jinja2.utils

    class Namespace(jinja2.utils.Namespace):
        """jinja2's namespace() that refuses underscore-prefixed attribute names (no reach into internals)."""

        def __init__(*args, **kwargs):  # self comes in args, as in jinja2's, so namespace(self=...) works
            for key in dict(*args[1:], **kwargs):
                Namespace._refuse(key)
            jinja2.utils.Namespace.__init__(*args, **kwargs)

        def __setitem__(self, key, value):
            Namespace._refuse(key)
            jinja2.utils.Namespace.__setitem__(self, key, value)

        @staticmethod
        def _refuse(key):
            if isinstance(key, str) and key.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"namespace attribute {key!r}: no names starting with '_'")

    return Namespace


@lru_cache(maxsize=16)
def _compile(template: str):
    """-> the compiled template; raises jinja2's TemplateSyntaxError."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _template_tojson
    env.globals.update(raise_exception=_template_raise, strftime_now=_template_strftime_now,
                       dict=_TemplateDict(), namespace=_namespace_type())
    return env.from_string(template)


def _plain(value):
    """JSON data rebuilt from exact builtin types (what the template may see): no objects with their methods."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return f"<{type(value).__name__}>"


def check_messages(messages, where: str = "conversation") -> list[dict]:
    """-> the messages as plain dicts, content joined into one string; anything else -> RocketError naming
    which message and what is wrong. Keys whose value is None are dropped (as transformers drops them)."""
    if not isinstance(messages, (list, tuple)):
        raise RocketError(f"{where}: expected a list of messages, got {type(messages).__name__}")
    if not messages:
        raise RocketError(f"{where}: has no messages")
    out = []
    for i, m in enumerate(messages):
        at = f"{where}: message {i}"
        if not isinstance(m, dict):
            raise RocketError(f"{at} is a {type(m).__name__}, expected an object with \"role\" and \"content\"")
        m = {k: v for k, v in m.items() if v is not None}
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise RocketError(f"{at} has no \"role\" string" if role is None
                              else f"{at}: \"role\" must be a non-empty string, got {role!r}")
        if "content" not in m:
            raise RocketError(f"{at} ({role}) has no \"content\"")
        content = m["content"]
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict):
                    raise RocketError(f"{at} ({role}): content part {j} is a {type(part).__name__}, expected "
                                      f"{{\"type\": \"text\", \"text\": ...}}")
                if part.get("type") != "text":
                    raise RocketError(f"{at} ({role}): content part {j} has type {part.get('type')!r}; only "
                                      f"\"text\" parts are supported")
                if not isinstance(part.get("text"), str):
                    raise RocketError(f"{at} ({role}): content part {j} has no \"text\" string")
                texts.append(part["text"])
            content = "".join(texts)
        elif not isinstance(content, str):
            raise RocketError(f"{at} ({role}): \"content\" must be a string or a list of text parts, got "
                              f"{type(content).__name__}")
        m = _plain(m)
        m["content"] = content
        out.append(m)
    return out


def render_chat(template: str, messages, add_generation_prompt: bool = True, *, source: str = "chat template",
                **extra) -> str:
    """The conversation as the template writes it, as transformers' apply_chat_template(tokenize=False) does:
    variables messages, tools=None, documents=None, add_generation_prompt and **extra (bos_token, eos_token, ...).
    `source` names the template in errors (e.g. the checkpoint's file)."""
    if not isinstance(template, str):
        raise RocketError(f"{source}: not a template string ({type(template).__name__})")
    msgs = check_messages(messages)
    import jinja2
    try:
        compiled = _compile(template)
    except jinja2.TemplateSyntaxError as e:
        raise RocketError(f"{source}: not a valid jinja template (line {e.lineno}: {e.message})") from None
    variables = {"tools": None, "documents": None, **_plain(extra)}
    try:
        return compiled.render(messages=msgs, add_generation_prompt=add_generation_prompt, **variables)
    except jinja2.TemplateError as e:
        raise RocketError(f"{source}: {' '.join(str(e).split()) or type(e).__name__}") from None
    except Exception as e:  # a template's own mistakes (a str + list, a bad index) surface as Python errors
        raise RocketError(f"{source}: failed to render ({type(e).__name__}: {' '.join(str(e).split())})") from None


def _template_source(ckpt_dir: str) -> str:
    path = os.path.join(ckpt_dir, TEMPLATE_FILE)
    if os.path.exists(path):
        return f"{path}"
    return f"{os.path.join(ckpt_dir, TOKENIZER_CONFIG)} chat_template"


def render_checkpoint_chat(ckpt_dir: str, messages, add_generation_prompt: bool = True, **extra) -> str:
    """render_chat with the checkpoint's own template and its bos/eos (and other named) special tokens."""
    template = load_chat_template(ckpt_dir)
    if template is None:
        raise RocketError(f"{ckpt_dir}: has no chat template ({TEMPLATE_FILE} or {TOKENIZER_CONFIG})")
    variables = {**special_tokens(ckpt_dir), **extra}
    return render_chat(template, messages, add_generation_prompt, source=_template_source(ckpt_dir), **variables)


# ---- chat prompt files ------------------------------------------------------------------------------------------

def read_chat_prompts(path: str, ckpt_dir: str, streams: int | None) -> list[list[int]]:
    """A JSON list of conversations (each a list of {"role", "content"} messages) -> one token-id list per
    conversation: rendered with the checkpoint's template, encoded with its tokenizer.json without adding special
    tokens (the template writes them). `streams` cycles or cuts the conversations to M, as read_prompts does."""
    flag = f"chat prompts {path}"
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except FileNotFoundError:
        raise RocketError(f"{flag}: file not found") from None
    except (OSError, UnicodeDecodeError) as e:
        raise RocketError(f"{flag}: cannot read it ({e})") from None
    except json.JSONDecodeError as e:
        raise RocketError(f"{flag}: not valid JSON ({e})") from None
    if not isinstance(raw, list) or not raw or not all(isinstance(c, list) for c in raw):
        raise RocketError(f"{flag}: expected a non-empty JSON list of conversations, each a list of "
                          f"{{\"role\", \"content\"}} messages")
    convs = [check_messages(c, f"{flag}: conversation {i}") for i, c in enumerate(raw)]
    template = load_chat_template(ckpt_dir)
    if template is None:
        raise RocketError(f"{flag}: the checkpoint {ckpt_dir} has no chat template "
                          f"({TEMPLATE_FILE} or {TOKENIZER_CONFIG})")
    tok_path = os.path.join(ckpt_dir, "tokenizer.json")
    if not os.path.exists(tok_path):
        raise RocketError(f"{flag}: chat prompts need {tok_path}")
    from tokenizers import Tokenizer
    try:
        tok = Tokenizer.from_file(tok_path)
    except Exception as e:
        raise RocketError(f"{tok_path}: not a readable tokenizer ({' '.join(str(e).split())})") from None
    variables = special_tokens(ckpt_dir)
    source = _template_source(ckpt_dir)
    ids = []
    for i, conv in enumerate(convs):
        try:
            text = render_chat(template, conv, True, source=source, **variables)
        except RocketError as e:
            raise RocketError(f"{flag}: conversation {i}: {e}") from None
        ids.append(tok.encode(text, add_special_tokens=False).ids)
        if not ids[-1]:
            raise RocketError(f"{flag}: conversation {i} renders to no tokens")
    if streams:
        ids = [ids[i % len(ids)] for i in range(streams)]
    return ids


# ---- generation config ------------------------------------------------------------------------------------------

def _token_ids(value, path: str, key: str) -> tuple[int, ...]:
    items = value if isinstance(value, list) else [value]
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in items):
        raise RocketError(f"{path}: {key} must be a token id or a list of token ids, got {value!r}")
    return tuple(items)


def generation_config(ckpt_dir: str) -> dict:
    """The checkpoint's generation_config.json: "eos_token_id" as a tuple of ints, and temperature, top_p, top_k
    where present; {} when there is none. A malformed file -> RocketError naming it."""
    path = os.path.join(ckpt_dir, GENERATION_CONFIG)
    raw = _json_object(path, "generation config")
    out: dict = {}
    if raw.get("eos_token_id") is not None:
        out["eos_token_id"] = _token_ids(raw["eos_token_id"], path, "eos_token_id")
    for key, kinds in (("temperature", (int, float)), ("top_p", (int, float)), ("top_k", (int,))):
        v = raw.get(key)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, kinds) or v < 0:
            raise RocketError(f"{path}: {key} must be a non-negative {'integer' if key == 'top_k' else 'number'}, "
                              f"got {v!r}")
        out[key] = v
    return out


def stop_ids(ckpt_dir: str, config_eos: tuple[int, ...]) -> tuple[int, ...]:
    """The ids that end a stream: config.json's eos ids (passed in) and generation_config.json's, sorted."""
    return tuple(sorted(set(config_eos) | set(generation_config(ckpt_dir).get("eos_token_id", ()))))
