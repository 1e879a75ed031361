"""postprocessing decodes the pieces of one `execute` call together (one tokenizer call):
its responses must equal the piece-by-piece path byte for byte, whatever the batch holds
(pieces of many requests interleaved, several pieces of one request, multi-byte
characters split across pieces, special tokens, final pieces of every finish reason)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from inflightllm.detokenizer import CONTEXT_WINDOW, decode_pieces, decode_texts
from inflightllm.text.postprocess import build_text_response, build_text_responses

IM_END = 2  # SmolLM2's <|im_end|> (a special token: skipped in the text)

TEXTS = [
    "The capital of France is Paris.",
    "Family: 👨\u200d👩\u200d👧\u200d👦 and 👩🏽\u200d💻 flags 🇫🇷🇯🇵",
    "中文测试：你好，世界！日本語のテキスト。한국어 텍스트.",
    "Ünïcödé àccéntš: Ærøskøbing, Ångström, façade, Straße",
    "mixed: price 10€ → 😀 你好 ok… «quotes» — 🎉🎉🎉",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 math 𝑥² + 𝑦² = 𝑧² and 𓀀𓀁",
    "   spaces  \n\n\ttabs\r\n",
    "def f(x):\n    return x ** 2  # 🐍\n",
]


def engine_inputs(context: list[int], new: list[int], finish_code: int, serial: int) -> dict[str, np.ndarray]:
    """The tensors the engine sends postprocessing for one piece (leading batch dim 1)."""
    return {
        "request_handle": np.array([[serial]], np.int64),
        "output_ids": np.array([new], np.int32).reshape(1, len(new)),
        "context_ids": np.array([context], np.int32).reshape(1, len(context)),
        "finish_reason": np.array([[finish_code]], np.int32),
        "num_input_tokens": np.array([[7]], np.int32),
        "num_output_tokens": np.array([[serial]], np.int32),
        "num_cached_tokens": np.array([[0]], np.int32),
        "cum_log_probs": np.array([[-0.5 * serial]], np.float32),
        "output_log_probs": np.zeros((1, len(new)), np.float32),
        "top_logprob_ids": np.zeros((1, len(new), 0), np.int32),
        "top_logprobs": np.zeros((1, len(new), 0), np.float32),
    }


def request_pieces(ids: list[int], rng: random.Random, finish_code: int) -> list[dict[str, np.ndarray]]:
    """One request's stream cut at random points (mostly 1 token, as the engine streams;
    sometimes coalesced runs), each piece with the engine's 8-token context."""
    pieces, start = [], 0
    while start < len(ids):
        end = min(len(ids), start + rng.choice([1, 1, 1, 1, 2, 3, 5]))
        final = end == len(ids)
        context = ids[max(0, start - CONTEXT_WINDOW) : start]
        pieces.append(engine_inputs(context, ids[start:end], finish_code if final else 0, len(pieces)))
        start = end
    return pieces


def interleaved_pieces(tokenizer, seed: int) -> tuple[list[list[dict]], list[dict]]:
    """Every text as a request (some ending in <|im_end|>), their pieces interleaved the
    way engine steps emit them: (per-request pieces, all pieces in arrival order)."""
    rng = random.Random(seed)
    per_request = []
    for index, text in enumerate(TEXTS):
        ids = tokenizer.encode(text, add_special_tokens=False)
        if index % 3 == 0:
            ids = [*ids, IM_END]
        per_request.append(request_pieces(ids, rng, finish_code=1 + index % 3))
    cursors = [0] * len(per_request)
    arrival = []
    while any(cursor < len(pieces) for cursor, pieces in zip(cursors, per_request, strict=True)):
        live = [i for i, pieces in enumerate(per_request) if cursors[i] < len(pieces)]
        for i in rng.sample(live, rng.randint(1, len(live))):
            arrival.append(per_request[i][cursors[i]])
            cursors[i] += 1
    return per_request, arrival


def random_batches(items: list, rng: random.Random) -> list[list]:
    batches, start = [], 0
    while start < len(items):
        size = rng.choice([1, 2, 3, 8, 17, 64])
        batches.append(items[start : start + size])
        start += size
    return batches


def assert_same_response(batched: dict[str, np.ndarray], single: dict[str, np.ndarray]) -> None:
    assert list(batched) == list(single)
    for name in single:
        assert batched[name].dtype == single[name].dtype, name
        assert batched[name].shape == single[name].shape, name
        assert batched[name].tolist() == single[name].tolist(), name


@pytest.mark.parametrize("seed", range(6))
def test_batched_responses_equal_piece_by_piece(smollm2_tokenizer, seed):
    per_request, arrival = interleaved_pieces(smollm2_tokenizer, seed)
    assert len(arrival) > 100  # many pieces, most of one token
    rng = random.Random(1000 + seed)
    batched = []
    for batch in random_batches(arrival, rng):
        results = build_text_responses(batch, smollm2_tokenizer)
        assert len(results) == len(batch)
        batched.extend(results)
    for inputs, result in zip(arrival, batched, strict=True):
        assert not isinstance(result, Exception), result
        assert_same_response(result, build_text_response(inputs, smollm2_tokenizer))
    # And the pieces still telescope to each request's full decode.
    text_of = {id(inputs): result["text_output"][0, 0] for inputs, result in zip(arrival, batched, strict=True)}
    for text, pieces in zip(TEXTS, per_request, strict=True):
        joined = b"".join(text_of[id(piece)] for piece in pieces).decode("utf-8")
        assert joined == text


def test_multibyte_characters_are_held_back_in_a_batch(smollm2_tokenizer):
    """A piece that ends inside a character sends "" until the next piece completes it,
    also when both pieces sit in the same batch."""
    ids = smollm2_tokenizer.encode("😀", add_special_tokens=False)
    assert len(ids) >= 2  # byte-level BPE splits the emoji
    pieces = [
        engine_inputs(ids[:index], [ids[index]], 1 if index == len(ids) - 1 else 0, index)
        for index in range(len(ids))
    ]
    texts = [result["text_output"][0, 0] for result in build_text_responses(pieces, smollm2_tokenizer)]
    assert texts == [b""] * (len(ids) - 1) + ["😀".encode()]
    # A stream cut short inside the character: the final piece keeps the bytes as U+FFFD.
    cut = [engine_inputs([], [ids[0]], 2, 0)]
    assert build_text_responses(cut, smollm2_tokenizer)[0]["text_output"][0, 0] == "\ufffd".encode()


def test_a_bad_piece_fails_alone(smollm2_tokenizer):
    ids = smollm2_tokenizer.encode(" Paris.", add_special_tokens=False)
    good = engine_inputs([], ids, 1, 0)
    bad_reason = engine_inputs([], ids, 9, 1)  # no such finish reason
    unreadable = RuntimeError("tensor could not be read")
    results = build_text_responses([good, bad_reason, unreadable, good], smollm2_tokenizer)
    assert results[0]["text_output"][0, 0] == b" Paris."
    assert isinstance(results[1], ValueError) and "unknown code 9" in str(results[1])
    assert results[2] is unreadable
    assert_same_response(results[3], results[0])


def test_a_decode_error_fails_only_its_piece(smollm2_tokenizer):
    """When the one batched call raises, the pieces are decoded one by one, so only the
    piece whose ids the tokenizer refuses fails."""

    class Refusing:
        """SmolLM2's tokenizer, refusing id 13 (as a tokenizer might refuse a bad id)."""

        def decode(self, ids, **kwargs):
            if 13 in ids:
                raise KeyError(13)
            return smollm2_tokenizer.decode(ids, **kwargs)

        def batch_decode(self, batch, **kwargs):
            return [self.decode(ids, **kwargs) for ids in batch]

    results = build_text_responses(
        [engine_inputs([], [504], 0, 0), engine_inputs([], [13], 0, 1), engine_inputs([504], [504], 1, 2)],
        Refusing(),
    )
    assert isinstance(results[1], KeyError)
    assert results[0]["text_output"][0, 0] == smollm2_tokenizer.decode([504]).encode()
    assert results[2]["text_output"][0, 0] == smollm2_tokenizer.decode([504]).encode()


def test_decode_texts_one_call_equals_decode(smollm2_tokenizer):
    """The fast tokenizer's batch path (Rust decode_batch) and a tokenizer without one
    (batch_decode) both equal `tokenizer.decode` with the contract's options, sequence by
    sequence, for random ids over the whole vocabulary (special tokens included)."""
    rng = random.Random(7)
    vocab = len(smollm2_tokenizer)
    sequences = [[rng.randrange(vocab) for _ in range(rng.randint(0, 12))] for _ in range(500)]
    sequences += [[IM_END], [], [1, IM_END]]
    expected = [
        smollm2_tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False) if ids else ""
        for ids in sequences
    ]
    assert decode_texts(smollm2_tokenizer, sequences) == expected

    class NoBackend:
        """A tokenizer with only transformers' Python API (no Rust batch decode)."""

        def __init__(self):
            self.calls = 0

        def batch_decode(self, batch, **kwargs):
            self.calls += 1
            return [smollm2_tokenizer.decode(ids, **kwargs) for ids in batch]

    slow = NoBackend()
    assert decode_texts(slow, sequences) == expected
    assert slow.calls == 1  # one call for the whole batch


def test_decode_pieces_counts_one_tokenizer_call(smollm2_tokenizer):
    calls = []

    class Counting:
        backend_tokenizer = None

        def batch_decode(self, batch, **kwargs):
            calls.append(len(batch))
            return [smollm2_tokenizer.decode(ids, **kwargs) for ids in batch]

    pieces = [([504, 1115], [30], False), ([], [504], False), ([504], [], True)]
    texts = decode_pieces(Counting(), pieces)
    # context + new and context for each piece, empty sequences skipped: 2 + 1 + 2.
    assert calls == [5]
    assert texts == [
        smollm2_tokenizer.decode([504, 1115, 30])[len(smollm2_tokenizer.decode([504, 1115])):],
        smollm2_tokenizer.decode([504]),
        "",
    ]


def test_a_beam_search_response_decodes_every_beam_whole(smollm2_tokenizer):
    """A packed beam search response (inflightllm/packed_outputs.py) between ordinary pieces
    of one batch: text_output [1, beams], each beam's whole text (its padding left out),
    the numeric beam tensors passed through; the ordinary pieces are unchanged."""
    from inflightllm.packed_outputs import pack_beams

    beams = [smollm2_tokenizer.encode(text) for text in (TEXTS[0], TEXTS[2], TEXTS[1][:9])]
    beams[1] = beams[1][:5]  # ends inside a multi-byte character: held back until final
    ints, floats = pack_beams(finish_reason=0, num_input_tokens=7, num_output_tokens=len(beams[0]),
                              num_cached_tokens=0, beam_token_ids=beams, beam_cum_logprobs=[-1.0, -2.0, -3.0],
                              beam_logprobs=[[], [], []], pad_id=IM_END)
    packed = {"request_handle": np.array([[5]], np.int64), "engine_out_i32": ints, "engine_out_f32": floats}
    ordinary = engine_inputs([], beams[0][:3], 0, 1)
    results = build_text_responses([ordinary, packed, ordinary], smollm2_tokenizer)
    assert results[0]["text_output"].tolist() == results[2]["text_output"].tolist() == \
        build_text_response(ordinary, smollm2_tokenizer)["text_output"].tolist()
    beam = results[1]
    expected = [decode_pieces(smollm2_tokenizer, [([], ids, False)])[0] for ids in beams]
    assert beam["text_output"].shape == (1, 3)
    assert [text.decode() for text in beam["text_output"][0]] == expected
    assert expected[0] == TEXTS[0] and expected[1] == "中文测"  # the 5th token's partial character held back
    assert beam["sequence_length"].tolist() == [[len(ids) for ids in beams]]
    longest = max(len(ids) for ids in beams)
    assert beam["output_ids"].shape == (1, 3, longest)
    assert beam["output_ids"][0, 1].tolist() == beams[1] + [IM_END] * (longest - len(beams[1]))
    assert beam["cum_log_probs"].tolist() == beam["cumulative_logprob"].tolist() == [[-1.0, -2.0, -3.0]]
    assert beam["output_log_probs"].shape == (1, 3, 0) and beam["sequence_index"].tolist() == [[0]]
    # The final response keeps an incomplete character (as U+FFFD), as a whole decode does.
    ints, floats = pack_beams(finish_reason=2, num_input_tokens=7, num_output_tokens=len(beams[0]),
                              num_cached_tokens=0, beam_token_ids=beams, beam_cum_logprobs=[-1.0, -2.0, -3.0],
                              beam_logprobs=[[], [], []], pad_id=IM_END)
    final = build_text_response({"engine_out_i32": ints, "engine_out_f32": floats}, smollm2_tokenizer)
    assert [text.decode() for text in final["text_output"][0]] == \
        [smollm2_tokenizer.decode(ids, skip_special_tokens=True) for ids in beams]
    assert final["finish_reason"].tolist() == [[b"length"]]
