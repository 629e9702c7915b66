"""The quantization cache (`--quantization-cache`): what `--quantization int8 | int8-weight-only | int4` made
at load, kept on disk, so that the next start reads it instead of calibrating and quantizing again.

After `CausalLM.quantize`, every module it made is written (loader/module_state.py: the packed tensors the
kernels read, in this CPU's layout; a mixture of experts' experts as lists of them) with every float parameter
left (the norms, which SmoothQuant and AWQ rescale), as one safetensors file named by `cache_key`, which
changes with anything that could change those bytes: the checkpoint's files (path, size and modification time
of each file of its folder), the method, the dtype, the calibration tokens when given, the source of the code
that quantizes and packs (every file of sobrio/layers, sobrio/models and sobrio/csrc, and the calibration text)
and what decides the kernels and their layouts (the CPU's flags, which C++ kernels were built, PyTorch's
version, SOBRIO_DISABLE_VNNI and SOBRIO_DISABLE_CPP). The next start with the same key builds the model's
modules, puts the cached ones in place of its Linears, embedding and experts' stacks before they are cast (so
their float memory is never touched) and reads the file with plain reads, tensor by tensor, into the tensors it
keeps: one copy, nothing mapped after load, the checkpoint's weights not read at all.

The file is written to a temporary name and renamed into place, so an interrupted write leaves no entry;
one that is cut short, unreadable or made for another key is skipped with one log line and written anew.
The cache holds weights only (derived from the checkpoint and the shipped calibration text): nothing of a
request's prompt or completion is ever in it.
"""

import hashlib
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from sobrio.loader.hf import read_safetensors, safetensors_metadata, write_safetensors
from sobrio.loader.module_state import (
    MODULES,
    TensorTable,
    Unsupported,
    decode_module,
    encode_module,
    is_quantized_list,
)
from sobrio.loader.resolve import cache_dir

logger = logging.getLogger(__name__)

FORMAT = 2  # the layout of the file's manifest; a change makes older entries mismatch
METADATA_KEY = "sobrio.quantization_cache"
SOURCES = ("layers", "models", "csrc")  # sobrio's folders whose code decides the quantized bytes
CALIBRATION_FILE = "calibration_as_you_like_it.txt"
FREE_SPACE_MARGIN = 1 << 30  # bytes left on the disk after writing an entry, or it is not written
_ROOT = Path(__file__).resolve().parent.parent


def cache_folder(setting: str) -> Path | None:
    """`--quantization-cache`: off (None), auto ($SOBRIO_QUANTIZATION_CACHE if set, else
    $SOBRIO_CACHE/quantized), or a folder."""
    if setting == "auto":
        setting = os.environ.get("SOBRIO_QUANTIZATION_CACHE") or str(cache_dir() / "quantized")
    return None if setting == "off" else Path(setting).expanduser()


@dataclass
class CachedModel:
    """A cache entry: its manifest (`modules`: encoded by name; `added`: those of them the float model did not
    have, set on their parent: the model's `quantized_lm_head`, a mixture of experts' lists of quantized
    experts; `dropped`: float modules set to None; `dropped_parameters`: float parameters set to None,
    an experts' stacks; `parameters`: name -> tensor) and, once `load`ed, its tensors."""

    path: Path
    manifest: dict
    tensors: dict[str, torch.Tensor] | None = None

    def load(self) -> None:
        """Read the tensors: plain reads, one at a time, each into the tensor the model keeps."""
        started = time.perf_counter()
        self.tensors = dict(read_safetensors(self.path))
        logger.info("quantization cache: read %s MB from %s in %.1f s (no quantizing)",
                    f"{sum(t.nbytes for t in self.tensors.values()) / 1e6:,.1f}", self.path,
                    time.perf_counter() - started)

    def check(self, model: torch.nn.Module) -> None:
        """A ValueError unless the entry fits this freshly built model: every module it replaces exists (the
        parent of each it adds), and the parameters it holds are the ones left once those and the dropped ones
        are gone. Nothing is changed."""
        names = dict(model.named_modules())
        added = set(self.manifest["added"])
        # where each module goes: in place of the float model's module of its name, or (added) on its parent
        missing = [n for n in self.manifest["modules"] if (n.rpartition(".")[0] if n in added else n) not in names]
        replaced = tuple(f"{n}." for n in [*self.manifest["modules"], *self.manifest["dropped"]])
        dropped = set(self.manifest["dropped_parameters"])
        left = sorted(n for n, _ in model.named_parameters() if not n.startswith(replaced) and n not in dropped)
        if missing or left != sorted(self.manifest["parameters"]):
            raise ValueError(f"made for another model (modules {missing[:3]}, parameters "
                             f"{sorted(set(left) ^ set(self.manifest['parameters']))[:3]})")

    def strip(self, model: torch.nn.Module) -> None:
        """Drop the float modules and parameters the entry replaces, before the model is cast: their memory,
        allocated but never written, is then never touched."""
        added = set(self.manifest["added"])
        for name in [*self.manifest["modules"], *self.manifest["dropped"], *self.manifest["dropped_parameters"]]:
            if name not in added:
                parent, _, child = name.rpartition(".")
                setattr(model.get_submodule(parent), child, None)

    def install(self, model: torch.nn.Module) -> None:
        """Put the cached modules in place and copy the cached parameters into the (cast) model's."""
        for name, state in self.manifest["modules"].items():
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, decode_module(state, self.tensors))
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name, tensor_name in self.manifest["parameters"].items():
                params[name].copy_(self.tensors[tensor_name])


class QuantizationCache:
    """One model's entry: `read` before building it, `write` once it is quantized."""

    def __init__(self, folder: Path, key: dict):
        self.key = key
        slot = _digest([key["checkpoint_folder"], key["method"], key["dtype"]])[:8]  # one entry per slot is kept
        self.prefix = f"{key['model_name']}-{key['method']}-{slot}-"
        self.path = folder / f"{self.prefix}{_digest(key)}.safetensors"

    @classmethod
    def for_model(cls, setting: str, model_folder: Path, method: str, dtype: torch.dtype,
                  calibration_ids: list[int] | None = None) -> "QuantizationCache | None":
        """The entry of a model folder quantized by `method` in `dtype`, or None with the cache off."""
        folder = cache_folder(setting)
        return None if folder is None else cls(folder, cache_key(model_folder, method, dtype, calibration_ids))

    def read(self) -> CachedModel | None:
        """The entry, or None (absent, or unusable: one log line says why, and the load quantizes anew)."""
        if not self.path.is_file():
            logger.info("quantization cache: no entry %s yet: quantizing, then writing it", self.path)
            return None
        try:
            manifest = json.loads(safetensors_metadata(self.path)[METADATA_KEY])
            if manifest.get("key") != self.key:
                raise ValueError("made for another key")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            logger.warning("quantization cache: entry %s unusable (%s): quantizing again and replacing it",
                           self.path, exc)
            return None
        return CachedModel(self.path, manifest)

    def write(self, model: torch.nn.Module, names_before: set[str], parameters_before: set[str]) -> None:
        """Write the entry for a model `CausalLM.quantize` just made from one whose modules were
        `names_before` and parameters `parameters_before`: the quantized modules, the float modules and
        parameters it dropped, every parameter left. A model holding something this format cannot (oneDNN's
        opaque packed weights) is not cached (one log line)."""
        started = time.perf_counter()
        table = TensorTable()
        try:
            modules = {name: encode_module(module, table) for name, module in _quantized(model, names_before)}
        except Unsupported as exc:
            logger.info("quantization cache: not written for this model: %s", exc)
            return
        parameters = {name: table.name_of(p.detach()) for name, p in model.named_parameters()}
        manifest = {"format": FORMAT, "key": self.key, "modules": modules,
                    "added": [name for name in modules if name not in names_before],
                    "dropped": _set_to_none(model, "_modules"),
                    "dropped_parameters": [n for n in _set_to_none(model, "_parameters") if n in parameters_before],
                    "parameters": parameters}
        if not self._room_for(table.nbytes):
            return
        temporary = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            size = write_safetensors(temporary, table.tensors, {METADATA_KEY: json.dumps(manifest)})
            os.replace(temporary, self.path)
        except OSError as exc:
            logger.warning("quantization cache: could not write %s (%s)", self.path, exc)
            temporary.unlink(missing_ok=True)
            return
        logger.info("quantization cache: wrote %s MB to %s in %.1f s (the next start reads it; "
                    "--quantization-cache off to not keep it)", f"{size / 1e6:,.1f}", self.path,
                    time.perf_counter() - started)
        self._remove_older()

    def _remove_older(self) -> None:
        """Remove the entries this one replaces (the same checkpoint folder, method and dtype under another key:
        an older sobrio, a rewritten checkpoint) and temporary files their writers, since gone, left behind."""
        for path in self.path.parent.glob(f"{self.prefix}*.safetensors"):
            if path != self.path:
                logger.info("quantization cache: removing %s (replaced by %s)", path.name, self.path.name)
                path.unlink(missing_ok=True)
        for path in self.path.parent.glob(f".{self.prefix}*.tmp"):
            pid = path.name.rsplit(".", 2)[-2]
            if not pid.isdigit() or not _running(int(pid)):
                path.unlink(missing_ok=True)

    def _room_for(self, nbytes: int) -> bool:
        probe = next(p for p in (self.path.parent, *self.path.parent.parents) if p.exists())
        free = shutil.disk_usage(probe).free
        if free < nbytes + FREE_SPACE_MARGIN:
            logger.warning("quantization cache: not written: %.2f GB needed, %.2f GB free in %s", nbytes / 1e9,
                           free / 1e9, probe)
            return False
        return True


def _set_to_none(model: torch.nn.Module, registry: str) -> list[str]:
    """The qualified names of a model's children (`_modules`) or parameters (`_parameters`) that are None."""
    return [f"{parent}.{child}".lstrip(".") for parent, module in model.named_modules()
            for child, value in getattr(module, registry).items() if value is None]


def _quantized(model: torch.nn.Module, names_before: set[str]) -> list[tuple[str, torch.nn.Module]]:
    """The outermost quantized modules (module_state.MODULES, or a list of them: an experts' quantized
    matrices) of a quantized model, by name: each in place of a module the float model had, or new on a module
    it had (the `quantized_lm_head` on the model, the experts' lists on their `FusedExperts`); one anywhere
    else is Unsupported."""
    found: list[tuple[str, torch.nn.Module]] = []
    for name, module in model.named_modules():
        quantized = type(module).__name__ in MODULES or is_quantized_list(module)
        if quantized and not any(name.startswith(f"{n}.") for n, _ in found):
            if name not in names_before and name.rpartition(".")[0] not in names_before:
                raise Unsupported(f"{name}: a quantized module where the float model had none")
            found.append((name, module))
    return found


def _digest(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:24]


def _running(pid: int) -> bool:
    """Whether process `pid` exists (one of another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def cache_key(model_folder: Path, method: str, dtype: torch.dtype, calibration_ids: list[int] | None) -> dict:
    """What the quantized bytes depend on (the module docstring lists it), as a JSON-able dict."""
    from sobrio.csrc import cpu_flags
    from sobrio.layers import cpu_ops

    files = sorted(p for p in model_folder.resolve().iterdir() if p.is_file())
    kernels = {name: bool(getattr(cpu_ops, name)()) for name in
               ("vnni_linear_available", "amx_int8_available", "grouped_linear_available", "avx2_without_avx512")}
    return {
        "format": FORMAT,
        "model_name": model_folder.resolve().name,
        "checkpoint_folder": str(model_folder.resolve()),
        "checkpoint": [[str(p), p.stat().st_size, p.stat().st_mtime_ns] for p in files],
        "method": method,
        "dtype": str(dtype),
        "calibration": None if calibration_ids is None else hashlib.sha256(str(calibration_ids).encode()).hexdigest(),
        "source": source_digest(),
        "cpu": hashlib.sha256(cpu_flags().encode()).hexdigest()[:16],
        "kernels": kernels,
        "torch": torch.__version__,
        "environment": {v: os.environ.get(v) for v in ("SOBRIO_DISABLE_VNNI", "SOBRIO_DISABLE_CPP")},
    }


def source_digest() -> str:
    """A hash of the code that quantizes, packs and lays out the weights (and of the calibration text)."""
    digest = hashlib.sha256()
    paths = [p for folder in SOURCES for p in sorted((_ROOT / folder).rglob("*"))
             if p.suffix in (".py", ".cpp", ".h")]
    for path in [*paths, _ROOT / "data" / CALIBRATION_FILE, Path(__file__), _ROOT / "loader" / "module_state.py"]:
        digest.update(path.relative_to(_ROOT).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:24]
