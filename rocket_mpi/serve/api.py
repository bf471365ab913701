"""The OpenAI-compatible HTTP API on rank 0 (FastAPI): /v1/completions, /v1/chat/completions (both with
`stream: true` as server-sent events), /v1/models, /health and Prometheus-style /metrics.

Request fields follow the OpenAI API and the extensions vLLM accepts (top_k, ignore_eos, return_token_ids).
A bad request gets an OpenAI-style error body ({"error": {"message", "type", "param", "code"}}) with a 4xx
status; what the server does not do (n > 1, echo, best_of, a required or named tool call) is refused, not ignored.
Tools on /v1/chat/completions: serve/tools.py.

Log-probabilities: /v1/completions' `logprobs: N` and /v1/chat/completions' `logprobs: true` with `top_logprobs: N`
give each generated token's log-probability under the model's distribution (log-softmax of its logits, before
temperature or truncation) and the N most likely tokens' (N up to 20), in OpenAI's shapes, streamed or not.
`stream_options: {"include_usage": true}` ends a stream with a chunk that carries the usage.
"""
# no `from __future__ import annotations`: FastAPI reads the routes' annotations, which name make_app's imports
import asyncio
import json
import secrets
import time
import uuid

from rocket_mpi.errors import RocketError
from rocket_mpi.runtime.chat import check_messages, render_chat
from rocket_mpi.runtime.sampling import MAX_LOGPROBS, Sampling, Stop
from rocket_mpi.serve import reasoning, tools as toolcalls
from rocket_mpi.serve.scheduler import Request, Scheduler

UNSUPPORTED = ("echo", "best_of", "suffix", "functions", "logit_bias")


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.param, self.status, self.code = param, status, code


def _error(message: str, status: int, param=None, code=None):
    from fastapi.responses import JSONResponse
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status)


def _number(body: dict, key: str, default, kind=float):
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float) if kind is float else int):
        raise BadRequest(f"'{key}' must be {'a number' if kind is float else 'an integer'}, got {v!r}", key)
    return v


class Api:
    """What the routes need: the scheduler, the tokenizer, the chat template, the model's name and limits."""

    def __init__(self, scheduler: Scheduler, tokenizer, template: str | None, template_vars: dict, model: str,
                 vocab_size: int, eos: tuple[int, ...], defaults: dict, reasoning_parser: bool = False):
        self.scheduler, self.tokenizer, self.template, self.template_vars = scheduler, tokenizer, template, template_vars
        self.model, self.vocab_size, self.eos, self.defaults = model, vocab_size, eos, defaults
        self.reasoning_parser = reasoning_parser
        self.capacity = scheduler.slots.capacity
        self.created = int(time.time())

    # -- requests -> Request -----------------------------------------------------------
    def _sampling(self, body: dict) -> Sampling:
        d = self.defaults
        top_k = _number(body, "top_k", d.get("top_k", 0), int)
        seed = _number(body, "seed", None, int)
        s = Sampling(float(_number(body, "temperature", d.get("temperature", 1.0))),
                     float(_number(body, "top_p", d.get("top_p", 1.0))), 0 if top_k == -1 else top_k,
                     secrets.randbits(63) if seed is None else seed)
        why = s.problem()
        if why:
            raise BadRequest(why, why.split()[0])
        return s

    def _stop(self, body: dict) -> Stop:
        st = body.get("stop")
        strings = () if st is None else (st,) if isinstance(st, str) else st
        if not isinstance(strings, (list, tuple)) or not all(isinstance(x, str) and x for x in strings):
            raise BadRequest("'stop' must be a non-empty string or a list of them", "stop")
        ignore = body.get("ignore_eos", False)
        if not isinstance(ignore, bool):
            raise BadRequest("'ignore_eos' must be true or false", "ignore_eos")
        extra = body.get("stop_token_ids") or []
        if not isinstance(extra, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in extra):
            raise BadRequest("'stop_token_ids' must be a list of token ids", "stop_token_ids")
        return Stop(tuple(self.eos) + tuple(extra), tuple(strings), ignore)

    def _check_common(self, body: dict) -> None:
        model = body.get("model")
        if model is not None and model != self.model:
            raise BadRequest(f"The model '{model}' does not exist; this server serves '{self.model}'", "model", 404,
                             "model_not_found")
        for key in UNSUPPORTED:
            if body.get(key) not in (None, False, 0, [], {}):
                raise BadRequest(f"'{key}' is not supported by this server", key)
        if body.get("n", 1) != 1:
            raise BadRequest("only n = 1 is supported", "n")

    def _logprobs(self, body: dict, chat: bool) -> int | None:
        """How many alternatives per token the request wants with each token's log-probability; None: none at all.
        Completions: `logprobs` N; chat: `logprobs` true and `top_logprobs` N (default 0)."""
        lp = body.get("logprobs")
        if chat:
            if lp not in (None, True, False):
                raise BadRequest("'logprobs' must be true or false", "logprobs")
            top = _number(body, "top_logprobs", None, int)
            if top is not None and not lp:
                raise BadRequest("'top_logprobs' needs 'logprobs': true", "top_logprobs")
            n, key = (top or 0, "top_logprobs") if lp else (None, "logprobs")
        else:
            if lp is False:
                lp = None
            n, key = _number(body, "logprobs", None, int), "logprobs"
        if n is not None and not 0 <= n <= MAX_LOGPROBS:
            raise BadRequest(f"'{key}' must be from 0 to {MAX_LOGPROBS}, got {n}", key)
        return n

    def token_text(self, tok: int) -> str:
        """A token's text as the logprobs show it ('token_id:N' without a tokenizer, as vLLM writes it)."""
        if self.tokenizer is None:
            return f"token_id:{tok}"
        return self.tokenizer.decode([tok], skip_special_tokens=False)

    def logprobs_entry(self, tok: int, lp, chat: bool, offset: int = 0) -> dict:
        """One token's logprobs in the API's shape: chat's {"content": [...]} item, or the completions' parallel
        lists (one element each; `offset`: where the token starts in the concatenation of the tokens' texts, as vLLM
        counts it)."""
        mine, top = lp
        text = self.token_text(tok)
        if chat:
            def one(t, v):
                tt = self.token_text(t)
                return {"token": tt, "logprob": v, "bytes": list(tt.encode("utf-8"))}
            return dict(one(tok, mine), token=text, top_logprobs=[one(t, v) for t, v in top])
        return {"tokens": [text], "token_logprobs": [mine], "top_logprobs": [{self.token_text(t): v for t, v in top}],
                "text_offset": [offset]}

    def _request(self, body: dict, prompt: list[int], default_max, sink, chat: bool = False) -> Request:
        if not prompt:
            raise BadRequest("the prompt is empty", "prompt")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise BadRequest(f"token id {bad[0]} is out of range 0..{self.vocab_size - 1}", "prompt")
        key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        mt = _number(body, key, default_max, int)
        if mt is None:
            mt = self.capacity - len(prompt)
        if mt < 1:
            raise BadRequest(f"'{key}' must be at least 1, got {mt}", key)
        if len(prompt) + mt > self.capacity:
            raise BadRequest(f"This model's maximum context length is {self.capacity} tokens. However, you requested "
                             f"{len(prompt) + mt} tokens ({len(prompt)} in the prompt, {mt} for the completion). "
                             f"Please reduce the prompt or the completion.", "max_tokens", 400,
                             "context_length_exceeded")
        return Request(prompt, mt, self._sampling(body), self._stop(body), sink, self._logprobs(body, chat))

    def completion_prompt(self, body: dict) -> list[int]:
        p = body.get("prompt")
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
            p = p[0]  # a batch of one
        if isinstance(p, str):
            if self.tokenizer is None:
                raise BadRequest("text prompts need the checkpoint's tokenizer.json; send token ids", "prompt")
            return self.tokenizer.encode(p).ids
        if isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            return list(p)
        raise BadRequest("'prompt' must be a string or a list of token ids (one prompt per request)", "prompt")

    def chat_tools(self, body: dict) -> tuple[list[dict] | None, bool]:
        """The request's tools for the template, and whether tool calls are read out of the completion."""
        try:
            return toolcalls.check_tools(body.get("tools"), body.get("tool_choice"), self.template)
        except toolcalls.ToolError as e:
            raise BadRequest(str(e), e.param) from None

    def chat_prompt(self, body: dict, tools: list[dict] | None = None) -> tuple[list[int], bool | None]:
        """-> (the conversation's token ids, and with the reasoning parser on whether the prompt leaves a <think>
        open, else None). `chat_template_kwargs` (vLLM's extension, e.g. {"enable_thinking": false}) are more
        variables for the template."""
        if self.template is None or self.tokenizer is None:
            raise BadRequest("this checkpoint has no chat template or tokenizer: use /v1/completions", "messages")
        kw = body.get("chat_template_kwargs") or {}
        if not isinstance(kw, dict) or any(k in ("messages", "tools", "add_generation_prompt") for k in kw):
            raise BadRequest("'chat_template_kwargs' must be an object of template variables (not messages, tools "
                             "or add_generation_prompt)", "chat_template_kwargs")
        try:
            messages = check_messages(toolcalls.history(body.get("messages")), "messages")
            text = render_chat(self.template, messages, True, source="the checkpoint's chat template",
                               **{**self.template_vars, **kw, **({"tools": tools} if tools else {})})
        except RocketError as e:
            raise BadRequest(str(e), "messages") from None
        think = reasoning.opened(text) if self.reasoning_parser else None
        return self.tokenizer.encode(text, add_special_tokens=False).ids, think


class ChatOutput:
    """A chat completion's text as it arrives, piece by piece: the reasoning apart (serve --reasoning-parser), the
    content up to its first tool call (tools given; what may start one is held back), the calls read at the end."""

    def __init__(self, tools: list[dict] | None, think: bool | None):
        self.tools = tools
        self.split = reasoning.Splitter(think) if think is not None else None
        self.whole, self.sent = "", 0   # the content so far, and how much of it has gone out

    @property
    def thought(self) -> bool:
        return self.split is not None and self.split.thought

    def _content(self, piece: str) -> str:
        if not self.tools:
            return piece
        self.whole += piece
        n = max(toolcalls.sendable(self.whole), self.sent)
        out, self.sent = self.whole[self.sent:n], n
        return out

    def feed(self, piece: str) -> tuple[str, str]:
        """-> (reasoning, content) that may go out now."""
        r, c = self.split.feed(piece) if self.split else ("", piece)
        return r, self._content(c)

    def finish(self, why: str) -> tuple[str, str, list[dict], str]:
        """-> (the reasoning and content held back, the tool calls, the finish reason: "tool_calls" for a completion
        that stopped after calling)."""
        r, c = self.split.finish() if self.split else ("", "")
        if not self.tools:
            return r, c, [], why
        self.whole += c
        rest, calls = self.whole[self.sent:], toolcalls.parse(self.whole, self.tools)[1]
        if calls:
            rest = toolcalls.strip_calls(rest).strip()
            why = "tool_calls" if why == "stop" else why
        return r, rest, calls, why


def _joined(entries: list[dict], chat: bool) -> dict:
    """Per-token logprobs entries (Api.logprobs_entry) as one choice's `logprobs`."""
    if chat:
        return {"content": entries}
    return {k: [v for e in entries for v in e[k]] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


def make_app(api: Api):
    """The FastAPI application (imported here: the other commands do not load the web stack)."""
    from fastapi import FastAPI, Request as HttpRequest
    from fastapi.responses import PlainTextResponse, StreamingResponse
    app = FastAPI(title="rocket_mpi", docs_url=None, redoc_url=None)
    sched = api.scheduler

    @app.exception_handler(BadRequest)
    async def _bad(_, e: BadRequest):
        return _error(str(e), e.status, e.param, e.code)

    @app.get("/health")
    async def health():
        if sched.error:
            return _error(f"unhealthy: {sched.error}", 503)
        if not sched.running:
            return _error("not serving (starting or shutting down)", 503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": api.model, "object": "model", "created": api.created,
                                            "owned_by": "rocket_mpi", "max_model_len": api.capacity}]}

    @app.get("/metrics")
    async def metrics():
        lines = []
        for key, val in sched.metrics().items():
            name = f"rocket_{key}"
            lines += [f"# TYPE {name} {'counter' if key.endswith('_total') else 'gauge'}", f"{name} {val:g}"]
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    async def _body(http: HttpRequest) -> dict:
        try:
            body = json.loads(await http.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise BadRequest(f"the request body is not valid JSON ({e})") from None
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        api._check_common(body)
        return body

    async def _run(http: HttpRequest, body: dict, prompt: list[int], default_max, chat: bool, tools=None,
                   think=None):
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        req = api._request(body, prompt, default_max, lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev),
                           chat)
        opts = body.get("stream_options")
        if opts is not None and (not isinstance(opts, dict) or not isinstance(opts.get("include_usage", False), bool)):
            raise BadRequest("'stream_options' must be an object with include_usage true or false", "stream_options")
        usage_chunk = bool(opts and opts.get("include_usage")) and bool(body.get("stream"))
        try:
            sched.submit(req)
        except RocketError as e:
            return _error(str(e), 503)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        want_ids = body.get("return_token_ids") is True
        if body.get("stream"):
            out = ChatOutput(tools, think) if chat else None
            return StreamingResponse(_stream(http, req, events, rid, created, want_ids, usage_chunk, out),
                                     media_type="text/event-stream")
        text, ids, why, usage, lps, offset = [], [], None, None, [], 0
        try:
            while why is None:
                ev = await _next(http, events)
                if ev is None:
                    sched.cancel(req)
                    return _error("the client went away", 499)
                if ev[0] == "token":
                    if ev[3] is not None:
                        lps.append(api.logprobs_entry(ev[1], ev[3], chat, offset))
                        offset += len(api.token_text(ev[1]))
                    ids.append(ev[1])
                    text.append(ev[2])
                elif ev[0] == "done":
                    why, usage = ev[1], ev[2]
                else:
                    return _error(ev[1], 503)
        except asyncio.CancelledError:
            sched.cancel(req)
            raise
        choice = {"index": 0, "finish_reason": why, "logprobs": _joined(lps, chat) if req.logprobs is not None
                  else None}
        if chat:
            out = ChatOutput(tools, think)
            parts = [out.feed(piece) for piece in text]
            r, c, calls, choice["finish_reason"] = out.finish(why)
            content = "".join(p[1] for p in parts) + c
            msg = choice["message"] = {"role": "assistant", "content": (content.strip() or None) if calls else content}
            if out.thought:
                msg["reasoning_content"] = "".join(p[0] for p in parts) + r
            if calls:
                msg["tool_calls"] = calls
        else:
            choice["text"] = "".join(text)
        if want_ids:
            choice["token_ids"] = ids
        return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": api.model, "choices": [choice], "usage": usage}

    async def _next(http: HttpRequest, events: asyncio.Queue):
        """The next event, or None once the client has gone."""
        while True:
            try:
                return await asyncio.wait_for(events.get(), timeout=0.5)
            except asyncio.TimeoutError:
                if await http.is_disconnected():
                    return None

    async def _stream(http, req, events, rid, created, want_ids, usage_chunk, out: ChatOutput | None):
        chat = out is not None
        kind = "chat.completion.chunk" if chat else "text_completion"

        def data(obj) -> str:
            return f"data: {json.dumps(obj)}\n\n"

        def chunk(text, why=None, ids=None, first=False, lp=None, calls=None, thought=""):
            if chat:
                delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
                if thought:
                    delta["reasoning_content"] = thought
                if calls:
                    delta["tool_calls"] = [dict(c, index=i) for i, c in enumerate(calls)]
                c = {"index": 0, "delta": delta, "finish_reason": why, "logprobs": lp}
            else:
                c = {"index": 0, "text": text, "finish_reason": why, "logprobs": lp}
            if want_ids and ids is not None:
                c["token_ids"] = ids
            head = {"id": rid, "object": kind, "created": created, "model": api.model, "choices": [c]}
            return data(dict(head, usage=None) if usage_chunk else head)

        done, offset = False, 0
        try:
            if chat:
                yield chunk("", first=True)
            while not done:
                ev = await _next(http, events)
                if ev is None:
                    return
                if ev[0] == "token":
                    lp = None
                    if ev[3] is not None:
                        lp = _joined([api.logprobs_entry(ev[1], ev[3], chat, offset)], chat)
                        offset += len(api.token_text(ev[1]))
                    thought, text = out.feed(ev[2]) if chat else ("", ev[2])
                    yield chunk(text, ids=[ev[1]], lp=lp, thought=thought)
                elif ev[0] == "done":
                    done = True
                    why = ev[1]
                    if chat:
                        thought, rest, calls, why = out.finish(why)
                        if thought or rest or calls:
                            yield chunk(rest, calls=calls, thought=thought)
                    yield chunk("", why)
                    if usage_chunk:
                        yield data({"id": rid, "object": kind, "created": created, "model": api.model, "choices": [],
                                    "usage": ev[2]})
                else:
                    done = True
                    yield f"data: {json.dumps({'error': {'message': ev[1], 'type': 'server_error'}})}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            if not done:
                sched.cancel(req)  # the client went away mid-stream: its slot is freed before the next step

    @app.post("/v1/completions")
    async def completions(http: HttpRequest):
        body = await _body(http)
        return await _run(http, body, api.completion_prompt(body), 16, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HttpRequest):
        body = await _body(http)
        tools, read_calls = api.chat_tools(body)
        prompt, think = api.chat_prompt(body, tools)
        return await _run(http, body, prompt, None, chat=True, tools=tools if read_calls else None, think=think)

    return app
