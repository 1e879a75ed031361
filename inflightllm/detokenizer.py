"""Turning streamed token ids into text pieces that concatenate to the full decode.

The contract (docs/INTERFACE.md, "The streaming text contract"): a piece is decoded
from a few preceding tokens (`context_ids`, up to `CONTEXT_WINDOW` generated tokens)
plus the piece's own tokens (`new_ids`). The text of the piece is

    decode(context_ids + new_ids)  minus  decode(context_ids)

where both decodes skip special tokens and keep spaces as they are
(`clean_up_tokenization_spaces=False`). A token may end inside a multi-byte UTF-8
character (byte-level BPE splits emoji and CJK into byte tokens); the tokenizer then
decodes the incomplete bytes at the end to one U+FFFD. So one trailing U+FFFD is dropped:

- from `decode(context_ids)` always: the earlier piece that ended there dropped it too
  (it was not final), and the bytes are completed by `new_ids` or show up in this
  piece's own decode;
- from `decode(context_ids + new_ids)` unless the piece is final: the character is
  completed by a later piece, which has these tokens in its context.

Exactly one U+FFFD, not a trailing run: bytes that never form a character (a model can
generate them) decode to U+FFFD too, and dropping a whole run would let the context
window's own leading U+FFFD (a window that starts inside a character) vanish with it.
A real U+FFFD at the end of a non-final piece is only held back, and appears in the
next piece, so the pieces still telescope.

Because a byte-level decode is local (the text of a token does not depend on the
tokens around it, apart from where UTF-8 characters start and end), the pieces
concatenate to exactly `decode(all_ids)` whatever way the ids are split into pieces,
and any stateless `postprocessing` instance can decode any piece. This holds for
byte-level BPE tokenizers (SmolLM2, Llama 3, GPT-2, Qwen). SentencePiece byte-fallback
decoders (`<0xF0>` tokens: Llama 2, Mistral) write one U+FFFD per byte of a broken
run of byte tokens, so their pieces can differ from the full decode around multi-byte
characters.

Hidden ids. The decode shows nothing for a special token (skipped) nor for an id beyond
the tokenizer's vocabulary, and joins the bytes on either side of them. So the context
window counts only the tokens the decode shows (`context_window`): eight hidden ids
after a character's first bytes must not push those bytes out of the context, or the
piece that completes (or breaks) the character would lose them. The engine forms the
context that way, with hidden ids left out (they change neither decode), and it never
samples an id beyond the tokenizer's vocabulary (`TokenizerVocabulary.num_ids`; the
model's logits there are -inf): a random-weight model whose shape has more ids than its
borrowed tokenizer would otherwise stream mostly empty text.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

REPLACEMENT_CHARACTER = "\ufffd"
CONTEXT_WINDOW = 8  # generated tokens the decode shows, sent as context before each piece


@dataclass(frozen=True)
class TokenizerVocabulary:
    """Which ids the streaming decode shows: 0 .. num_ids - 1, minus `special_ids`
    (skipped by `skip_special_tokens=True`). Every other id is hidden: it adds no text
    and no bytes."""

    num_ids: int  # one more than the tokenizer's largest id (added tokens included)
    special_ids: frozenset[int]

    def hides(self, token: int) -> bool:
        return token >= self.num_ids or token < 0 or token in self.special_ids

    @classmethod
    def of(cls, tokenizer) -> TokenizerVocabulary:
        """From a loaded tokenizer (a transformers tokenizer, or a `tokenizers.Tokenizer`)."""
        backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
        if hasattr(backend, "get_added_tokens_decoder") and hasattr(backend, "get_vocab"):
            ids = backend.get_vocab(with_added_tokens=True).values()
            special = {int(i) for i, token in backend.get_added_tokens_decoder().items() if token.special}
        else:  # a slow (Python) tokenizer: what its decode skips are its special ids
            ids = tokenizer.get_vocab().values()
            special = {int(i) for i in tokenizer.all_special_ids}
        return cls(num_ids=max(ids, default=-1) + 1, special_ids=frozenset(special))


@functools.lru_cache(maxsize=8)
def tokenizer_vocabulary(folder: str | Path) -> TokenizerVocabulary | None:
    """The vocabulary of the tokenizer in a model folder (read once per folder), or None
    when the folder holds no tokenizer (then nothing is treated as hidden)."""
    folder = Path(folder)
    if (folder / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        return TokenizerVocabulary.of(Tokenizer.from_file(str(folder / "tokenizer.json")))
    if (folder / "tokenizer_config.json").is_file() or (folder / "tokenizer.model").is_file():
        from transformers import AutoTokenizer

        return TokenizerVocabulary.of(AutoTokenizer.from_pretrained(folder))
    return None


def context_window(
    token_ids: Sequence[int], end: int, begin: int = 0,
    vocabulary: TokenizerVocabulary | None = None, window: int = CONTEXT_WINDOW,
) -> list[int]:
    """The context of a piece that starts at `token_ids[end]`: the last `window` tokens of
    `token_ids[begin:end]` that `vocabulary` shows, in order, hidden ones left out.
    Without a vocabulary: the last `window` tokens. Costs O(window) unless hidden ids
    sit among the last `window` tokens; then O(the run of hidden ids) as well."""
    recent = token_ids[max(begin, end - window) : end]
    if type(recent) is not list:  # a list's slice is a new list already: not copied twice
        recent = list(recent)
    if vocabulary is None or not recent:
        return recent
    if max(recent) < vocabulary.num_ids and vocabulary.special_ids.isdisjoint(recent):
        return recent
    shown: list[int] = []
    position = end
    while position > begin and len(shown) < window:
        position -= 1
        token = int(token_ids[position])
        if not vocabulary.hides(token):
            shown.append(token)
    shown.reverse()
    return shown


def decode_text(tokenizer, token_ids: Sequence[int]) -> str:
    """Decode ids the way the streaming contract does: special tokens skipped, spaces kept."""
    if len(token_ids) == 0:
        return ""
    return tokenizer.decode(
        [int(token) for token in token_ids],
        skip_special_tokens=True,
        clean_up_tokenization_spaces=False,
    )


def _drop_incomplete_tail(text: str) -> str:
    """The text without one trailing U+FFFD (the bytes of a character not complete yet)."""
    return text[:-1] if text.endswith(REPLACEMENT_CHARACTER) else text


def decode_texts(tokenizer, sequences: Sequence[Sequence[int]]) -> list[str]:
    """`decode_text` of each sequence, with one tokenizer call for all of them.

    A transformers fast tokenizer decodes the batch in its Rust backend
    (`backend_tokenizer.decode_batch`): the same decode as `tokenizer.decode` with
    `skip_special_tokens=True, clean_up_tokenization_spaces=False`, without its Python
    overhead per sequence. Any other tokenizer gets `batch_decode` with the same options.
    Empty sequences are "" without a call.
    """
    id_lists = [[int(token) for token in sequence] for sequence in sequences]
    texts = [""] * len(id_lists)
    todo = [index for index, ids in enumerate(id_lists) if ids]
    if not todo:
        return texts
    batch = [id_lists[index] for index in todo]
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and hasattr(backend, "decode_batch"):
        decoded = backend.decode_batch(batch, skip_special_tokens=True)
    else:
        decoded = tokenizer.batch_decode(batch, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    for index, text in zip(todo, decoded, strict=True):
        texts[index] = text
    return texts


def _piece_text(full: str, before: str, final: bool) -> str:
    """The piece from the decodes of `context + new` (`full`) and of `context` (`before`)."""
    if not final:
        full = _drop_incomplete_tail(full)
    before = _drop_incomplete_tail(before)
    if full.startswith(before):
        return full[len(before):]
    return full[len(os.path.commonprefix([full, before])):]


def decode_piece(
    tokenizer, context_ids: Sequence[int], new_ids: Sequence[int], final: bool
) -> str:
    """The text that `new_ids` add after `context_ids` (see the module docstring).

    `final` is true for the last piece of a request: then an incomplete character at the
    end is kept (as U+FFFD), exactly as a decode of the whole output shows it.

    If the context's text is not a prefix of the combined text (no byte-level tokenizer
    does this, but a decoder that rewrites text across token boundaries could), the
    result is the combined text minus as many characters as the two texts share at the
    start: the best stateless guess, which may repeat or lose a character.
    """
    full = decode_text(tokenizer, list(context_ids) + list(new_ids))
    return _piece_text(full, decode_text(tokenizer, context_ids), final)


def decode_pieces(
    tokenizer, pieces: Sequence[tuple[Sequence[int], Sequence[int], bool]]
) -> list[str]:
    """`decode_piece` of each `(context_ids, new_ids, final)`, with one tokenizer call
    (`decode_texts`) for the two decodes of every piece. Each piece keeps its own
    context, so pieces of different requests (and several of one) mix freely."""
    sequences: list[list[int]] = []
    for context_ids, new_ids, _ in pieces:
        sequences.append(list(context_ids) + list(new_ids))
        sequences.append(list(context_ids))
    texts = decode_texts(tokenizer, sequences)
    return [
        _piece_text(texts[2 * index], texts[2 * index + 1], final)
        for index, (_, _, final) in enumerate(pieces)
    ]


class IncrementalDetokenizer:
    """Stateful helper for one token stream (client CLI, engine-side tests).

    It keeps every token added so far and decodes each new piece with the same rule
    (and the same context window) as the stateless `postprocessing` model, so its
    pieces equal what the server streams.

        detok = IncrementalDetokenizer(tokenizer)
        for ids in pieces:
            print(detok.add(ids), end="")
        print(detok.finish(), end="")
    """

    def __init__(self, tokenizer, context_window: int = CONTEXT_WINDOW) -> None:
        self.tokenizer = tokenizer
        self.context_window = context_window
        try:
            self.vocabulary: TokenizerVocabulary | None = TokenizerVocabulary.of(tokenizer)
        except AttributeError:  # a tokenizer with no vocabulary to read: plain windows
            self.vocabulary = None
        self.token_ids: list[int] = []
        self.text = ""  # concatenation of every piece returned so far
        self.finished = False

    def add(self, new_ids: Sequence[int], final: bool = False) -> str:
        """Append `new_ids` and return the text they add (held back while a character
        is incomplete, unless `final`)."""
        if self.finished:
            raise RuntimeError("IncrementalDetokenizer: add() after the final piece")
        context_ids = context_window(
            self.token_ids, len(self.token_ids), vocabulary=self.vocabulary, window=self.context_window
        )
        new_list = [int(token) for token in new_ids]
        piece = decode_piece(self.tokenizer, context_ids, new_list, final)
        self.token_ids.extend(new_list)
        self.text += piece
        self.finished = final
        return piece

    def finish(self) -> str:
        """End the stream: the text still held back (an incomplete character as U+FFFD)."""
        return self.add([], final=True)
