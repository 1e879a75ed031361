"""The streaming text contract: pieces decoded with an 8-token context concatenate to
the full decode, however the token stream is cut (SmolLM2's byte-level BPE splits
emoji and CJK characters into byte tokens)."""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from inflightllm.detokenizer import (
    CONTEXT_WINDOW,
    REPLACEMENT_CHARACTER,
    IncrementalDetokenizer,
    decode_piece,
)

IM_START, IM_END = 1, 2  # SmolLM2's <|im_start|> and <|im_end|>

SHORT_TEXTS = [
    "Hello",
    " Hello world",
    "Hello  ",
    "a\nb",
    "\n\n",
    "😀",
    "é!",
    "你好",
    "🇫🇷",
    " 👍🏽",
    "naïve café",
]

LONG_TEXTS = [
    "The capital of France is Paris.",
    "   leading spaces and trailing ones   ",
    "line one\nline two\n\n\tindented\r\nwindows line",
    "Family: 👨\u200d👩\u200d👧\u200d👦 and 👩🏽\u200d💻 and 🏳️\u200d🌈 flags 🇫🇷🇯🇵🇺🇸",
    "中文测试：你好，世界！日本語のテキスト。한국어 텍스트.",
    "Ünïcödé àccéntš: Ærøskøbing, Ångström, façade, jalapeño, Straße",
    "mixed: price 10€ → 😀 你好 ok… «quotes» — dash 🎉🎉🎉",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 math 𝑥² + 𝑦² = 𝑧² and ancient 𓀀𓀁",
    "def f(x):\n    return x ** 2  # comment 🐍\n",
]


def expected_text(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


def stream_pieces(tokenizer, ids: list[int], cuts: list[int]) -> list[str]:
    """Decode `ids` cut at `cuts` as the engine + stateless postprocessing do: each piece
    with up to CONTEXT_WINDOW preceding tokens as context, the last one final."""
    bounds = [0, *cuts, len(ids)]
    pieces = []
    for index, (start, end) in enumerate(itertools.pairwise(bounds)):
        context = ids[max(0, start - CONTEXT_WINDOW) : start]
        final = index == len(bounds) - 2
        pieces.append(decode_piece(tokenizer, context, ids[start:end], final))
    return pieces


def all_cuts(length: int):
    """Every way to cut a stream of `length` tokens into non-empty pieces."""
    positions = range(1, length)
    for count in range(length):
        yield from (list(c) for c in itertools.combinations(positions, count))


def random_cuts(rng: random.Random, length: int) -> list[int]:
    """Random cut points, biased to small pieces (the engine streams 1 token at a time)."""
    cuts, position = [], 0
    while True:
        position += rng.choice([1, 1, 1, 2, 3, 5, 9, 17])
        if position >= length:
            return cuts
        cuts.append(position)


def token_streams(tokenizer, text: str) -> list[list[int]]:
    """The text's ids alone, followed by <|im_end|>, and with special tokens inside."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    middle = len(ids) // 2
    return [ids, [*ids, IM_END], [IM_START, *ids[:middle], IM_END, *ids[middle:], IM_END]]


def test_texts_really_split_characters_across_tokens(smollm2_tokenizer):
    """The test texts exercise the hard case: single tokens that decode to U+FFFD."""
    ids = smollm2_tokenizer.encode("😀", add_special_tokens=False)
    assert ids == [10813, 242, 218]
    assert [smollm2_tokenizer.decode([i]) for i in ids] == [REPLACEMENT_CHARACTER] * 3
    assert smollm2_tokenizer.encode("你好", add_special_tokens=False) == [18645, 250, 48392, 138]


@pytest.mark.parametrize("text", SHORT_TEXTS)
def test_every_split_of_short_streams(smollm2_tokenizer, text):
    for ids in token_streams(smollm2_tokenizer, text):
        assert len(ids) <= 12, "keep short texts short: all splits are tried"
        expected = expected_text(smollm2_tokenizer, ids)
        for cuts in all_cuts(len(ids)):
            pieces = stream_pieces(smollm2_tokenizer, ids, cuts)
            assert "".join(pieces) == expected, (ids, cuts, pieces)
            # Only the final piece may end in an incomplete character.
            assert all(not p.endswith(REPLACEMENT_CHARACTER) for p in pieces[:-1]), (cuts, pieces)


@pytest.mark.parametrize("text", LONG_TEXTS)
def test_random_splits_of_long_streams(smollm2_tokenizer, text):
    rng = random.Random(f"seed-{text}")
    for ids in token_streams(smollm2_tokenizer, text):
        expected = expected_text(smollm2_tokenizer, ids)
        splits = [[], list(range(1, len(ids)))]  # whole, and one token per piece
        splits += [random_cuts(rng, len(ids)) for _ in range(60)]
        for cuts in splits:
            pieces = stream_pieces(smollm2_tokenizer, ids, cuts)
            assert "".join(pieces) == expected, (cuts, pieces)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=40), seed=st.integers(0, 2**32 - 1))
# Found by hypothesis: SmolLM2 has no token for the byte 0xF1, so U+40000 encodes to
# three orphan continuation bytes (three U+FFFD) right before an incomplete character.
@example(text="000000\x80Ä𐀀𐀀𐀀𐀀\U00040000𐀀", seed=4)
def test_any_text_any_split(smollm2_tokenizer, text, seed):
    ids = smollm2_tokenizer.encode(text, add_special_tokens=False) + [IM_END]
    cuts = random_cuts(random.Random(seed), len(ids))
    assert "".join(stream_pieces(smollm2_tokenizer, ids, cuts)) == expected_text(smollm2_tokenizer, ids)


def single_byte_token_ids(tokenizer) -> list[int]:
    """Ids of the tokens that are one byte (decode to U+FFFD alone when >= 0x80)."""
    return [i for i in range(1000) if len(tokenizer.convert_ids_to_tokens(i)) == 1]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), seed=st.integers(0, 2**32 - 1))
def test_arbitrary_token_streams_any_split(smollm2_tokenizer, data, seed):
    """Streams a model could generate, garbage included: stray continuation bytes,
    lead bytes never completed, special tokens anywhere."""
    byte_ids = single_byte_token_ids(smollm2_tokenizer)
    token = st.one_of(st.sampled_from(byte_ids), st.integers(0, 49151), st.sampled_from([IM_START, IM_END]))
    ids = data.draw(st.lists(token, max_size=40))
    cuts = random_cuts(random.Random(seed), len(ids))
    assert "".join(stream_pieces(smollm2_tokenizer, ids, cuts)) == expected_text(smollm2_tokenizer, ids)


def test_one_token_at_a_time_holds_back_an_emoji_until_complete(smollm2_tokenizer):
    ids = smollm2_tokenizer.encode("Hi 😀!", add_special_tokens=False)
    # " 😀" is the tokens " \xf0\x9f\x98" + "\x80": the space comes out first.
    assert ids == [26843, 40303, 218, 17]
    assert smollm2_tokenizer.convert_ids_to_tokens(ids) == ["Hi", "ĠðŁĺ", "Ģ", "!"]
    pieces = stream_pieces(smollm2_tokenizer, ids, [1, 2, 3])
    assert pieces == ["Hi", " ", "😀", "!"]


def test_non_final_piece_ending_mid_emoji_has_no_replacement_character(smollm2_tokenizer):
    ids = smollm2_tokenizer.encode("ok 🇫🇷", add_special_tokens=False)
    assert smollm2_tokenizer.convert_ids_to_tokens(ids) == ["ok", "ĠðŁ", "ĩ", "«", "ðŁ", "ĩ", "·"]
    # The text so far after each non-final cut: never a U+FFFD; the flag's two regional
    # indicators (4 bytes each) appear as each completes.
    texts = [decode_piece(smollm2_tokenizer, [], ids[:cut], final=False) for cut in range(1, len(ids))]
    assert texts == ["ok", "ok ", "ok ", "ok \U0001F1EB", "ok \U0001F1EB", "ok \U0001F1EB"]
    assert decode_piece(smollm2_tokenizer, [], ids, final=False) == "ok 🇫🇷"


def test_final_piece_keeps_an_incomplete_character_like_the_full_decode(smollm2_tokenizer):
    ids = smollm2_tokenizer.encode("a😀", add_special_tokens=False)[:-1]  # cut inside the emoji
    assert smollm2_tokenizer.decode(ids, skip_special_tokens=True) == "a" + REPLACEMENT_CHARACTER
    assert decode_piece(smollm2_tokenizer, [], ids, final=False) == "a"
    assert decode_piece(smollm2_tokenizer, [], ids, final=True) == "a" + REPLACEMENT_CHARACTER
    # A final response with no new tokens releases what the context held back.
    assert decode_piece(smollm2_tokenizer, ids, [], final=True) == REPLACEMENT_CHARACTER
    assert decode_piece(smollm2_tokenizer, ids, [], final=False) == ""


def test_special_tokens_are_skipped_and_leading_spaces_kept(smollm2_tokenizer):
    hello = smollm2_tokenizer.encode(" Hello", add_special_tokens=False)
    assert decode_piece(smollm2_tokenizer, [IM_START], hello, final=False) == " Hello"
    assert decode_piece(smollm2_tokenizer, hello, [IM_END], final=True) == ""
    assert decode_piece(smollm2_tokenizer, [], [IM_END], final=True) == ""


def test_incremental_detokenizer_equals_the_stateless_pieces(smollm2_tokenizer):
    text = LONG_TEXTS[3] + LONG_TEXTS[4]
    ids = smollm2_tokenizer.encode(text, add_special_tokens=False) + [IM_END]
    cuts = random_cuts(random.Random(7), len(ids))
    expected_pieces = stream_pieces(smollm2_tokenizer, ids, cuts)
    detok = IncrementalDetokenizer(smollm2_tokenizer)
    bounds = [0, *cuts, len(ids)]
    pieces = [
        detok.add(ids[start:end], final=end == len(ids)) for start, end in itertools.pairwise(bounds)
    ]
    assert pieces == expected_pieces
    assert detok.text == smollm2_tokenizer.decode(ids, skip_special_tokens=True)
    assert detok.token_ids == ids
    with pytest.raises(RuntimeError, match="after the final piece"):
        detok.add([5])


def test_incremental_detokenizer_finish_releases_held_text(smollm2_tokenizer):
    ids = smollm2_tokenizer.encode("x 你", add_special_tokens=False)
    detok = IncrementalDetokenizer(smollm2_tokenizer)
    streamed = [detok.add([token]) for token in ids[:-1]]
    assert smollm2_tokenizer.convert_ids_to_tokens(ids) == ["x", "Ġ", "ä½", "ł"]
    assert streamed == ["x", " ", ""]  # the CJK character is not complete yet
    assert detok.finish() == REPLACEMENT_CHARACTER
    assert detok.text == smollm2_tokenizer.decode(ids[:-1])


class _RewritingTokenizer:
    """A decoder that changes earlier text when more tokens come (no real byte-level
    tokenizer does this): token 1 after token 0 turns "ab" into "aB"."""

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):
        text = "".join({0: "ab", 1: "c", 2: "d"}[i] for i in ids)
        return text.replace("abc", "aBc")


def test_context_that_is_not_a_prefix_falls_back_to_the_common_prefix():
    # "ab" vs "aBc": one character in common, so the piece is "Bc".
    assert decode_piece(_RewritingTokenizer(), [0], [1], final=False) == "Bc"
    assert decode_piece(_RewritingTokenizer(), [0], [2], final=False) == "d"
