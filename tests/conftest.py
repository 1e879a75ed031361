"""Shared test fixtures: the default tokenizer, and starting real Triton servers.

- `smollm2_tokenizer` (session): SmolLM2-135M-Instruct's tokenizer (the default model).
- `triton_server_factory` (session): `start(repository, **kwargs) -> TritonServer`; every
  server it starts is stopped at the end of the session. Use it from a session- or
  module-scoped fixture of your own so that a test file starts one server, not one per test.
- `running_triton_server(repository, **kwargs)`: the same as a context manager.
- `model_repo_server` (session): one tritonserver on the committed `model_repo/` (the
  default profile: the whole ensemble with SmolLM2), shared by every server test so the
  model loads once per session.
- `smollm2_folder`, `smollm2_loaded`, `smollm2_hf`, `smollm2_reference` (session): the
  prepared model folder, its weights loaded once for engines (`Engine(..., loaded=)`),
  the `transformers` model on the same weights, and memoised greedy references.
- Tests marked `gpu` are skipped where CUDA is absent.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))  # so that `tools.server_launcher` imports

import pytest  # noqa: E402
import torch  # noqa: E402

from inflightllm.model_source import DEFAULT_MODEL, prepare  # noqa: E402
from inflightllm.models.loader import LoadedModel, load_model  # noqa: E402
from tools.server_launcher import DEFAULT_SERVER_DIR, ServerStartError, TritonServer  # noqa: E402


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """The default model's tokenizer (a transformers fast tokenizer), loaded once."""
    from inflightllm.model_source import DEFAULT_MODEL, load_tokenizer

    return load_tokenizer(DEFAULT_MODEL)


def start_triton_server(repository: Path, timeout: float = 300.0, **kwargs) -> TritonServer:
    """Start a tritonserver on `repository` (free loopback ports) and wait until all its
    models are ready. Skips the test when the server folder is not built; fails it with
    the server's report (failed models and the log's tail) when the server does not come up."""
    server_dir = Path(kwargs.pop("server_dir", DEFAULT_SERVER_DIR))
    if not (server_dir / "bin" / "tritonserver").exists():
        pytest.skip(f"{server_dir}/bin/tritonserver is missing: run `make install`")
    server = TritonServer(Path(repository), server_dir=server_dir, **kwargs)
    try:
        return server.start(timeout=timeout)
    except ServerStartError as error:
        pytest.fail(f"tritonserver did not start on {repository}:\n{error}", pytrace=False)


@contextlib.contextmanager
def running_triton_server(repository: Path, **kwargs):
    """`with running_triton_server(repo) as server:` starts it and stops it afterwards."""
    server = start_triton_server(repository, **kwargs)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def triton_server_factory():
    """A function `start(repository, **kwargs) -> TritonServer`; all are stopped at the end."""
    servers: list[TritonServer] = []

    def start(repository: Path, **kwargs) -> TritonServer:
        server = start_triton_server(repository, **kwargs)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


@pytest.fixture(scope="session")
def model_repo_server(triton_server_factory) -> TritonServer:
    """The whole default repository (ensemble, preprocessing, engine, postprocessing)."""
    return triton_server_factory(REPO_ROOT / "model_repo", timeout=600.0)


@pytest.fixture(scope="session")
def smollm2_folder():
    return prepare(DEFAULT_MODEL)


@pytest.fixture(scope="session")
def smollm2_loaded(smollm2_folder) -> LoadedModel:
    return load_model(DEFAULT_MODEL)


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_folder):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_folder, dtype=torch.float32)
    model.eval()
    return model


class HFReference:
    """Greedy `transformers.generate` on one unpadded prompt at a time, memoised."""

    def __init__(self, model, eos_token_ids):
        self.model = model
        self.eos_token_ids = set(eos_token_ids)
        self._cache: dict[tuple, list[int]] = {}

    def greedy(self, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        """Generated ids, cut before the first EOS (the engine does not emit stop tokens)."""
        key = (tuple(prompt_ids), max_new_tokens)
        if key not in self._cache:
            with torch.no_grad():
                out = self.model.generate(
                    torch.tensor([prompt_ids]),
                    attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.int64),
                    max_new_tokens=max_new_tokens,
                    do_sample=False,
                    pad_token_id=next(iter(self.eos_token_ids), 0),
                )[0][len(prompt_ids):].tolist()
            cut = next((i for i, t in enumerate(out) if t in self.eos_token_ids), len(out))
            self._cache[key] = out[:cut]
        return self._cache[key]


@pytest.fixture(scope="session")
def smollm2_reference(smollm2_hf, smollm2_loaded) -> HFReference:
    return HFReference(smollm2_hf, smollm2_loaded.eos_token_ids)


def pytest_collection_modifyitems(config, items):
    """Skip `gpu` tests where CUDA is absent."""
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if gpu_items and not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs CUDA (no GPU here)")
        for item in gpu_items:
            item.add_marker(skip)
