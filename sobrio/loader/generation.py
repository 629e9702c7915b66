"""`--generation-config`: the default sampling parameters a model's makers recommend, as vLLM reads them.

`auto` takes them from the model's `generation_config.json` (a GGUF: its `general.sampling.*` metadata); `vllm`
takes none; a folder is read as `auto` reads the model's. A request's own values always win; only the fields it
leaves unset get these. Read once at start-up; a GGUF's keys from its header alone.
"""

import json
import logging
import struct
from pathlib import Path

from sobrio.config.generation import HF_KEYS, check_overrides, check_sampling

logger = logging.getLogger(__name__)

_GGUF_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
              "general.sampling.top_k": "top_k", "general.sampling.min_p": "min_p",
              "general.sampling.penalty_repeat": "repetition_penalty"}


def default_sampling(mode: str, folder: Path, gguf_path: Path | None, overrides: dict | None = None) -> dict:
    """SamplingParams keywords a request gets for the fields it leaves unset (empty with `vllm`)."""
    if mode == "vllm":
        found = {}
    elif mode != "auto":
        found = _from_hf(Path(mode).expanduser())
    elif gguf_path is not None:
        found = gguf_sampling(gguf_path)
    else:
        found = _from_hf(folder)
    found.update(check_overrides(overrides))
    check_sampling(found, "--generation-config")
    if found:
        logger.info("default sampling parameters from the model's generation config: %s (--generation-config "
                    "vllm ignores them)", ", ".join(f"{k}={v}" for k, v in sorted(found.items())))
    return found


def _from_hf(folder: Path) -> dict:
    path = folder / "generation_config.json"
    if not path.is_file():
        return {}
    raw = json.loads(path.read_text())
    return {name: raw[key] for key, name in HF_KEYS.items() if raw.get(key) is not None}


def gguf_sampling(gguf_path: Path) -> dict:
    """The GGUF's `general.sampling.*` keys as SamplingParams keywords (tens of ms: the header alone)."""
    found = read_gguf_metadata(gguf_path, set(_GGUF_KEYS))
    return {_GGUF_KEYS[k]: float(f"{v:.6g}") if isinstance(v, float) else v for k, v in found.items()}  # float32


# GGUF value types: struct format of the scalars (8: string, 9: array)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def read_gguf_metadata(path: Path, wanted: set[str]) -> dict:
    """The scalar values of the wanted keys, from the header alone (gguf's GGUFReader maps every tensor: seconds)."""
    import mmap

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        (version,) = struct.unpack_from("<I", buf, 4)
        count_format = "<I" if version == 1 else "<Q"
        step = struct.calcsize(count_format)
        offset = 8 + step  # past the tensor count
        (num_kv,) = struct.unpack_from(count_format, buf, offset)
        offset += step
        found = {}
        for _ in range(num_kv):
            key, offset = _string(buf, offset, count_format)
            (kind,) = struct.unpack_from("<I", buf, offset)
            offset += 4
            if key in wanted and kind in _SCALARS:
                found[key] = struct.unpack_from(_SCALARS[kind], buf, offset)[0]
            offset = _skip(buf, offset, kind, count_format)
        return found


def _string(buf, offset: int, count_format: str) -> tuple[str, int]:
    (length,) = struct.unpack_from(count_format, buf, offset)
    offset += struct.calcsize(count_format)
    return bytes(buf[offset:offset + length]).decode("utf-8", "replace"), offset + length


def _skip(buf, offset: int, kind: int, count_format: str) -> int:
    if kind in _SCALARS:
        return offset + struct.calcsize(_SCALARS[kind])
    step = struct.calcsize(count_format)
    if kind == 8:
        return offset + step + struct.unpack_from(count_format, buf, offset)[0]
    if kind != 9:
        raise ValueError(f"unknown GGUF value type {kind}")
    (item_kind,) = struct.unpack_from("<I", buf, offset)
    (count,) = struct.unpack_from(count_format, buf, offset + 4)
    offset += 4 + step
    if item_kind in _SCALARS:
        return offset + count * struct.calcsize(_SCALARS[item_kind])
    for _ in range(count):
        offset = _skip(buf, offset, item_kind, count_format)
    return offset
