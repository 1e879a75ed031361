"""Compiled grammars, built off the step thread and cached by their text.

`GrammarCompilerPool.submit(spec)` returns a Future of the compiled grammar: a hit in the
cache (keyed by the spec's kind and text) is the same Future, so a burst of requests with
one schema compiles it once. Compilation runs on `compile_threads` worker threads (xgrammar
compiles outside the GIL: two threads compiled 16 distinct schemas in half the time of one
on two cores), the first of which also loads the tokenizer's vocabulary the first time a
constrained request arrives; the engine's step thread only polls `Future.done()`. Each
worker has its own xgrammar.GrammarCompiler (sharing the one TokenizerInfo): no compiler
object is used by two threads at once. A failed compile is that Future's exception (the
request that asked fails alone) and is not cached.
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from inflightllm.guided.matcher import BitmaskRing
from inflightllm.guided.spec import GuidedSpec, GuidedSpecError, _short, check_spec, choice_grammar

DEFAULT_CACHE_ENTRIES = 256


def default_compile_threads() -> int:
    """Grammar compile workers: a quarter of the cores (4 on a 16-core GPU host, 1 on CI's
    2), so a burst of distinct schemas (15 ms each) is not compiled one after another while
    its requests wait, and the step thread keeps most cores."""
    return max(1, (os.cpu_count() or 1) // 4)


def default_mask_threads() -> int:
    """Threads that fill a step's masks together (0: one by one on the step thread). A
    host with few cores (CI's 2) gains nothing from them; a GPU host's 16 do: one row's
    fill is tens of microseconds, a thousand rows one by one outlast a decode step."""
    cores = os.cpu_count() or 1
    return cores // 2 if cores >= 8 else 0


class GrammarCompilerPool:
    """Compiles `GuidedSpec`s for one tokenizer on `compile_threads` worker threads (default
    `default_compile_threads()`); keeps the last `max_entries` compiled grammars (LRU)."""

    def __init__(self, tokenizer_folder: Path | str | None, vocab_size: int, stop_token_ids,
                 max_entries: int = DEFAULT_CACHE_ENTRIES, tokenizer=None, compile_threads: int | None = None):
        if compile_threads is None:
            compile_threads = default_compile_threads()
        if not isinstance(compile_threads, int) or compile_threads < 1:
            raise ValueError(f"compile_threads: {compile_threads!r} is not a positive integer; allowed: 1 or more")
        self.tokenizer_folder = tokenizer_folder
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.max_entries = max_entries
        self.compile_threads = compile_threads
        self._tokenizer = tokenizer
        self._info = None  # xgrammar.TokenizerInfo, made by the first compile (on a worker)
        self._info_lock = threading.Lock()  # one vocabulary load, however many workers ask
        self._compilers = threading.local()  # each worker's own xgrammar.GrammarCompiler
        self._executor = ThreadPoolExecutor(max_workers=compile_threads, thread_name_prefix="grammar-compile")
        self._lock = threading.Lock()
        self._cache: OrderedDict[GuidedSpec, Future] = OrderedDict()
        self.num_compiled = 0  # compiles run (not cache hits): tests and metrics read it
        # Seconds of the last compiles (not cache hits), oldest first: perf/bench_guided.py
        # reports them; bounded like the cache.
        self.compile_seconds: list[float] = []
        self._batch_matcher = None  # (mask_threads, xgrammar.BatchGrammarMatcher)
        self._accept_executor = None  # (mask_threads, ThreadPoolExecutor)
        self.mask_ring = BitmaskRing()  # the arrays the step's masks are filled in
        self.mask_threads = default_mask_threads()  # set before the first constrained step

    def submit(self, spec: GuidedSpec) -> Future:
        """The Future of `spec`'s compiled grammar (a cached one when there is one)."""
        with self._lock:
            future = self._cache.get(spec)
            if future is not None:
                self._cache.move_to_end(spec)
                return future
            future = self._executor.submit(self._compile, spec)
            self._cache[spec] = future
            while len(self._cache) > self.max_entries:
                self._cache.popitem(last=False)
        future.add_done_callback(lambda done: self._forget_failed(spec, done))
        return future

    def _forget_failed(self, spec: GuidedSpec, future: Future) -> None:
        if future.exception() is not None:
            with self._lock:
                if self._cache.get(spec) is future:
                    del self._cache[spec]

    def tokenizer_info(self):
        """xgrammar's view of the vocabulary (built once, on first use, by one thread)."""
        import xgrammar as xgr

        with self._info_lock:
            if self._info is None:
                tokenizer = self._tokenizer
                if tokenizer is None:
                    from transformers import AutoTokenizer

                    tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_folder)
                self._info = xgr.TokenizerInfo.from_huggingface(
                    tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids or None
                )
        return self._info

    def _compiler(self):
        """This worker thread's xgrammar.GrammarCompiler over the shared vocabulary."""
        compiler = getattr(self._compilers, "compiler", None)
        if compiler is None:
            import xgrammar as xgr

            compiler = self._compilers.compiler = xgr.GrammarCompiler(
                self.tokenizer_info(), max_threads=1, cache_enabled=False)
        return compiler

    def _compile(self, spec: GuidedSpec):
        started = time.perf_counter()
        check_spec(spec)  # the field-naming error for anything the engine got unchecked
        loading = time.perf_counter()
        compiler = self._compiler()
        started += time.perf_counter() - loading  # the vocabulary's one load is not a compile's
        with self._lock:
            self.num_compiled += 1
        try:
            return self._compile_checked(compiler, spec)
        finally:
            with self._lock:  # workers finish together: appends and trims one at a time
                self.compile_seconds.append(time.perf_counter() - started)
                del self.compile_seconds[: -self.max_entries]

    def _compile_checked(self, compiler, spec: GuidedSpec):
        try:
            if spec.kind == "json_schema":
                return compiler.compile_json_schema(spec.text, any_whitespace=False)
            if spec.kind == "json_object":  # a JSON object (not any JSON value), any keys
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
            if spec.kind == "regex":
                return compiler.compile_regex(spec.text)
            if spec.kind == "grammar":
                return compiler.compile_grammar(spec.text)
            if spec.kind == "choice":
                return compiler.compile_grammar(choice_grammar(spec.text))
        except (RuntimeError, ValueError, TypeError) as error:
            raise GuidedSpecError(f"{spec.field}: {_short(error)}") from None
        raise GuidedSpecError(f"guided_decoding: kind {spec.kind!r} is not supported")

    def batch_matcher(self):
        """xgrammar's BatchGrammarMatcher with `mask_threads` threads (they fill many rows'
        masks at once, outside the GIL), made on first use and again when `mask_threads`
        changes; None when `mask_threads` is 0 (rows one by one). The engine's step thread
        alone uses it."""
        if not self.mask_threads:
            return None
        if self._batch_matcher is None or self._batch_matcher[0] != self.mask_threads:
            import xgrammar as xgr

            self._batch_matcher = (self.mask_threads, xgr.BatchGrammarMatcher(max_threads=self.mask_threads))
        return self._batch_matcher[1]

    def accept_executor(self) -> ThreadPoolExecutor | None:
        """Workers that accept a step's tokens into the matchers in slices (`advance_batch`):
        xgrammar's batch accept runs one matcher after another, 15-40 us each (a token's bytes
        through the parser), but outside the GIL, so `mask_threads` - 1 workers and the step
        thread take a slice each. None when `mask_threads` < 2."""
        if self.mask_threads < 2:
            return None
        if self._accept_executor is None or self._accept_executor[0] != self.mask_threads:
            if self._accept_executor is not None:
                self._accept_executor[1].shutdown(wait=False)
            self._accept_executor = (self.mask_threads, ThreadPoolExecutor(
                max_workers=self.mask_threads - 1, thread_name_prefix="grammar-accept"))
        return self._accept_executor[1]

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        if self._accept_executor is not None:
            self._accept_executor[1].shutdown(wait=False)
