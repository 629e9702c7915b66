"""Hugging Face model folders: safetensors shards under their own names.

The tensors are read with plain file reads, one at a time, in the order they lie in the file, each into a
tensor of its own: the caller copies it into its parameter and drops it, so loading holds the model plus one
tensor, and nothing of the file stays mapped into the process afterwards. (safetensors' `safe_open` maps
the whole file: every page read stayed in the process's resident memory until the file was closed, a second
copy of the weights at the end of the largest shard's load.)

`iter_safetensors_weights(folder, in_place=True)` yields each tensor unread (`StoredTensor`): the model's loader
reads it straight into its parameter (or its rows of a fused one), so each byte of the weights is written
into memory once, not into a tensor of its own and then copied (each pass faults in fresh pages: on a 2-core
Zen 4 the copy was a second of a 1B model's start). Where the bytes are only read once more, to be packed into
another layout (`models.pack_on_load`), `StoredTensor.mapped()` is a view of the file's page cache instead (no
copy at all); `release()` then unmaps its pages, so the mapping does not stay in the process's resident memory.
"""

import json
import math
import mmap
import struct
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


def safetensors_files(folder: Path) -> list[Path]:
    """The folder's shards in name order; none is a FileNotFoundError naming the folder."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {folder}")
    return files


def iter_safetensors_weights(folder: Path, in_place: bool = False
                             ) -> Iterator[tuple[str, "torch.Tensor | StoredTensor"]]:
    """(name, tensor) for each tensor of the folder's shards; with `in_place`, (name, StoredTensor) instead,
    each to be read (`read_into`, `read`) before the next is asked for."""
    for file in safetensors_files(folder):
        yield from (stored_safetensors(file) if in_place else read_safetensors(file))


class StoredTensor:
    """One tensor of an open safetensors file, not read yet (`models.weights.DeferredTensor`)."""

    def __init__(self, f, file: Path, name: str, dtype: torch.dtype, shape: list[int], offset: int,
                 mapping: "FileMapping | None" = None):
        self.f, self.file, self.name, self.offset = f, file, name, offset
        self.dtype, self.shape = dtype, torch.Size(shape)
        self.mapping = mapping

    @property
    def nbytes(self) -> int:
        return self.shape.numel() * self.dtype.itemsize

    def mapped(self) -> torch.Tensor | None:
        """The tensor as a view of the file's mapping (copy-on-write: a write never reaches the file), valid
        until the file's tensors are all yielded; None where the file could not be mapped. Once its bytes are
        used, `release()`."""
        return self._view()

    def _view(self) -> torch.Tensor | None:
        view = None if self.mapping is None else self.mapping.view(self.offset, self.nbytes)
        return None if view is None else view.view(self.dtype).view(self.shape)

    def release(self) -> None:
        """Unmap the pages of a `mapped()` view (the page cache keeps them): a view used again reads them
        back from the file."""
        if self.mapping is not None:
            self.mapping.release(self.offset, self.nbytes)

    def read(self) -> torch.Tensor:
        tensor = torch.empty(self.shape, dtype=self.dtype)
        self.read_into(tensor)
        return tensor

    def read_into(self, dest: torch.Tensor) -> None:
        """Fill `dest` (contiguous, of this dtype and shape) with the file's bytes: copied from the file's
        mapping by torch's threads where it maps, else read."""
        assert dest.is_contiguous() and dest.dtype == self.dtype and dest.shape == self.shape, self.name
        if (view := self._view()) is not None:
            dest.detach().copy_(view)
            return self.release()
        self.f.seek(self.offset)
        view = memoryview(dest.detach().reshape(-1).view(torch.uint8).numpy())
        if read_fully(self.f, view) < len(view):
            raise ValueError(f"{self.file}: ends inside tensor {self.name}")


def read_fully(f, view: memoryview) -> int:
    """Read into `view` from `f`'s position until it is full or the file ends (one `readinto` may return
    less); the bytes read."""
    got = 0
    while got < len(view) and (n := f.readinto(view[got:])):
        got += n
    return got


class FileMapping:
    """A whole file mapped copy-on-write, on first use; views of its bytes as uint8 tensors."""

    def __init__(self, f):
        self.f = f
        self.map: mmap.mmap | None = None
        self.failed = False

    def view(self, offset: int, nbytes: int) -> torch.Tensor | None:
        if self.map is None and not self.failed:
            try:
                self.map = mmap.mmap(self.f.fileno(), 0, access=mmap.ACCESS_COPY)
            except (OSError, ValueError):  # a file that cannot be mapped (a pipe, an odd file system): read it
                self.failed = True
        if self.map is None or nbytes == 0 or offset + nbytes > len(self.map):  # a short file: the read says so
            return None
        return torch.frombuffer(self.map, dtype=torch.uint8, count=nbytes, offset=offset)

    def release(self, offset: int, nbytes: int) -> None:
        if self.map is not None and nbytes:
            start = offset - offset % mmap.PAGESIZE
            self.map.madvise(mmap.MADV_DONTNEED, start, min(offset + nbytes, len(self.map)) - start)


def stored_safetensors(file: Path) -> Iterator[tuple[str, StoredTensor]]:
    """(name, StoredTensor) for each tensor of one file, in file order, the file open until the last is
    yielded (its mapping, if a tensor asked for one, goes with the last view of it); a malformed file is a
    ValueError."""
    with open(file, "rb", buffering=0) as f:
        mapping = FileMapping(f)
        for name, (dtype, shape, offset) in safetensors_layout(f, file).items():
            yield name, StoredTensor(f, file, name, dtype, shape, offset, mapping)


def safetensors_layout(f, file: Path) -> dict[str, tuple[torch.dtype, tuple[int, ...], int]]:
    """Each tensor's dtype, shape and offset in the open file (`f`, at its start), in file order, from the
    header alone; a malformed header, or a dtype sobrio does not read, is a ValueError."""
    header, start = _read_header(f, file)
    header.pop("__metadata__", None)
    layout = {}
    for name, info in sorted(header.items(), key=lambda item: item[1]["data_offsets"][0]):
        dtype = DTYPES.get(info["dtype"])
        if dtype is None:
            raise ValueError(f"{file}: tensor {name} has dtype {info['dtype']}, which sobrio does not read")
        begin, end = info["data_offsets"]
        shape = tuple(info["shape"])
        if math.prod(shape) * dtype.itemsize != end - begin:
            raise ValueError(f"{file}: tensor {name} takes {end - begin} bytes for shape {info['shape']}")
        layout[name] = (dtype, shape, start + begin)
    return layout


def read_safetensors(file: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for each tensor of one file, read in file order; a malformed file is a ValueError."""
    for name, stored in stored_safetensors(file):
        yield name, stored.read()


def _read_header(f, file: Path) -> tuple[dict, int]:
    """The header of an open safetensors file and where its data starts; a malformed one is a ValueError."""
    head = f.read(8)
    if len(head) < 8:
        raise ValueError(f"{file}: shorter than a safetensors header")
    (header_len,) = struct.unpack("<Q", head)
    try:
        header = json.loads(f.read(header_len))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{file}: its safetensors header is not JSON ({exc})") from None
    return header, 8 + header_len


def safetensors_names(file: Path) -> list[str]:
    """The names of a safetensors file's tensors, from its header."""
    with open(file, "rb") as f:
        header, _ = _read_header(f, file)
    return [name for name in header if name != "__metadata__"]


def safetensors_metadata(file: Path) -> dict[str, str]:
    """A safetensors file's `__metadata__` (strings), after checking that the file is as long as its header
    says (a file cut short by an interrupted write is a ValueError here, before any tensor is read)."""
    with open(file, "rb") as f:
        header, start = _read_header(f, file)
    ends = [info["data_offsets"][1] for name, info in header.items() if name != "__metadata__"]
    if file.stat().st_size != start + max(ends, default=0):
        raise ValueError(f"{file}: {file.stat().st_size} bytes, its header says {start + max(ends, default=0)}")
    return header.get("__metadata__", {})


def write_safetensors(file: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> int:
    """Write `tensors` (contiguous, CPU) as a safetensors file, tensor by tensor from their own memory (no
    copy of the whole in memory, as `safetensors.torch.save_file` makes); returns the bytes written."""
    specs = [(name, tensor.dtype, tuple(tensor.shape)) for name, tensor in tensors.items()]
    return write_safetensors_stream(file, specs, iter(tensors.items()), metadata)


TensorSpec = tuple[str, torch.dtype, tuple[int, ...]]  # a tensor's name, dtype and shape


def write_safetensors_stream(file: Path, specs: list[TensorSpec], tensors: Iterable[tuple[str, torch.Tensor]],
                             metadata: dict[str, str]) -> int:
    """Write a safetensors file from tensors made one at a time (each dropped before the next is asked for, so
    writing holds one): the header from `specs`, known beforehand, then each tensor's bytes as it comes, in the
    specs' order. A tensor that is not the spec's is a ValueError (the header would lie). Returns the bytes."""
    names = {dtype: name for name, dtype in DTYPES.items()}
    header: dict = {"__metadata__": metadata}
    offset = 0
    for name, dtype, shape in specs:
        nbytes = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": names[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data 8-byte aligned, as safetensors writes it
    expected = iter(specs)
    with open(file, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)) + encoded)
        for name, tensor in tensors:
            spec = next(expected, None)
            if spec != (name, tensor.dtype, tuple(tensor.shape)):
                raise ValueError(f"{file}: tensor {name} {tensor.dtype} {tuple(tensor.shape)} comes where the "
                                 f"header says {spec}")
            if tensor.nbytes:
                f.write(memoryview(tensor.contiguous().reshape(-1).view(torch.uint8).numpy()))
            del tensor  # before the next is made
        if (missing := next(expected, None)) is not None:
            raise ValueError(f"{file}: tensor {missing[0]} of the header never came")
    return 8 + len(encoded) + offset


def safetensors_elements(folder: Path) -> tuple[int, int]:
    """(elements of floating-point tensors, bytes of the others) in the folder's shards, from their headers
    alone: what the weights will take before any is read."""
    floats = others = 0
    for file in safetensors_files(folder):
        with open(file, "rb") as f:
            header, _ = _read_header(f, file)
        header.pop("__metadata__", None)
        for info in header.values():
            dtype = DTYPES.get(info["dtype"])
            begin, end = info["data_offsets"]
            if dtype is not None and dtype.is_floating_point:
                floats += (end - begin) // dtype.itemsize
            else:
                others += end - begin
    return floats, others
