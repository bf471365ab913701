"""A chat completion's reasoning, apart from its answer: GLM's `<think> ... </think>` (serve --reasoning-parser glm).

GLM models think before they answer, between `<think>` and `</think>`; some chat templates open the `<think>` in the
prompt themselves. With the parser on, /v1/chat/completions returns what is inside as `reasoning_content` (the field
vLLM and DeepSeek's API use) and only what follows as `content`; streamed, as `delta.reasoning_content` then
`delta.content`. A completion that does not start thinking is all content; one cut before `</think>` (max_tokens) is
all reasoning. Off (the default), the text comes back as the model wrote it.
"""
from __future__ import annotations

START, END = "<think>", "</think>"


def opened(prompt_text: str) -> bool:
    """Whether the rendered prompt leaves a `<think>` open, so the completion starts inside it."""
    return prompt_text.rstrip().endswith(START)


def split(text: str, inside: bool) -> tuple[str | None, str]:
    """A whole completion -> (its reasoning or None, its content). `inside`: the prompt opened the `<think>`."""
    s = Splitter(inside)
    r1, c1 = s.feed(text)
    r2, c2 = s.finish()
    return (r1 + r2 if s.thought else None), c1 + c2


def _held(text: str, tag: str) -> int:
    """How many characters at the end of `text` may be the start of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class Splitter:
    """Streamed text -> (reasoning delta, content delta) per piece, holding back what may be the start of a tag."""

    def __init__(self, inside: bool):
        self.mode = "think" if inside else "start"
        self.thought = inside
        self.buf = ""

    def feed(self, piece: str) -> tuple[str, str]:
        self.buf += piece
        if self.mode == "start":
            s = self.buf.lstrip()
            if not s or (START.startswith(s) and s != START):
                return "", ""                    # whitespace, or what may yet be "<think>"
            if s.startswith(START):
                self.mode, self.thought, self.buf = "think", True, s[len(START):]
            else:
                self.mode = "content"
        if self.mode == "think":
            at = self.buf.find(END)
            if at < 0:
                n = len(self.buf) - _held(self.buf, END)
                out, self.buf = self.buf[:n], self.buf[n:]
                return out, ""
            reason, self.buf = self.buf[:at], self.buf[at + len(END):]
            self.mode = "lead"
            return reason, self._lead()
        if self.mode == "lead":
            return "", self._lead()
        out, self.buf = self.buf, ""
        return "", out

    def _lead(self) -> str:
        """After `</think>`: the newlines before the answer are dropped, however they arrive."""
        self.buf = self.buf.lstrip("\n")
        if not self.buf:
            return ""
        out, self.buf, self.mode = self.buf, "", "content"
        return out

    def finish(self) -> tuple[str, str]:
        """What is held back at the end: reasoning cut short, or content that only looked like a tag's start."""
        out, self.buf = self.buf, ""
        return (out, "") if self.mode == "think" else ("", out)
