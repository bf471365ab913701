"""serve's streamed text (serve/scheduler.py text_piece): decoding a few tokens per step, not the whole stream, joins
into the decode of all the tokens at once, through characters split over byte-level tokens and special tokens."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rocket_mpi.checkpoint.make import write_tokenizer
from rocket_mpi.serve.scheduler import text_piece

VOCAB = 512


@pytest.fixture(scope="module")
def decode(tmp_path_factory):
    from tokenizers import Tokenizer
    d = tmp_path_factory.mktemp("tok")
    write_tokenizer(str(d), VOCAB)
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    return tok.decode, tok


def stream_text(dec, ids):
    """text after each token, as the scheduler keeps it."""
    text, start, done, out = "", 0, 0, []
    for n in range(1, len(ids) + 1):
        text, start, done = text_piece(dec, ids[:n], text, start, done)
        out.append(text)
    return out


# ids of the byte-level alphabet's multi-byte characters and of whole words, mixed with any id of the vocabulary
@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(data=st.data())
def test_pieces_join_into_the_whole_decode(decode, data):
    dec, tok = decode
    words = data.draw(st.lists(st.sampled_from(["héllo", " wörld", "日本語", " 🚀", "rocket", " ", "\n", "é", "¿"]),
                               max_size=8))
    ids = tok.encode("".join(words)).ids
    ids = data.draw(st.permutations(ids)) if data.draw(st.booleans()) else ids
    ids += data.draw(st.lists(st.integers(0, tok.get_vocab_size() - 1), max_size=12))
    for n, text in enumerate(stream_text(dec, ids), 1):
        whole = dec(ids[:n])
        assert whole.startswith(text), (ids[:n], text, whole)
        if not whole.endswith("\ufffd"):
            assert text == whole, (ids[:n], text, whole)


def test_a_character_split_over_tokens_waits_for_its_last_byte(decode):
    dec, tok = decode
    ids = tok.encode("a🚀b").ids
    texts = stream_text(dec, ids)
    assert texts[-1] == "a🚀b"
    assert all("\ufffd" not in t for t in texts)
    assert len(ids) > 3, "the rocket should take several byte-level tokens in this small vocabulary"


def test_each_step_decodes_a_window_not_the_stream(decode):
    dec, tok = decode
    ids = tok.encode("rocket static fire " * 40).ids
    seen = []

    def counting(x):
        seen.append(len(x))
        return dec(x)

    stream_text(counting, ids)
    assert len(ids) > 100 and max(seen) <= 8, (len(ids), max(seen))
