"""transformers' own view of the same GGUF files: the reference sobrio must match."""

import contextlib
import functools

import numpy
import torch

from sobrio.loader.resolve import resolve_model


@functools.cache
def hf_model(alias: str):
    from transformers import AutoModelForCausalLM

    path = resolve_model(alias).path
    with _gguf_read_once():
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return model.eval()


@contextlib.contextmanager
def _gguf_read_once():
    """transformers parses a GGUF's metadata twice (for the config, then for the weights) and rebuilds gguf's
    tensor-name map once per tensor; and gguf's reader slices a numpy memmap once per field part, each slice
    paying memmap's Python-level bookkeeping: for Gemma 3's 262k-token vocabulary that is 786k slices, about
    50 s on a 2-core AMD EPYC. While loading, each reader and map is built once, and the reader sees the same
    mapped file as a plain ndarray (no copy: the same bytes, read the same way, 6x faster)."""
    import gguf
    import gguf.gguf_reader as reader_module

    saved = gguf.GGUFReader, gguf.get_tensor_name_map, reader_module.np
    gguf.GGUFReader, gguf.get_tensor_name_map = functools.cache(saved[0]), functools.cache(saved[1])
    reader_module.np = _NumpyWithPlainMemmap()
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map, reader_module.np = saved


class _NumpyWithPlainMemmap:
    """numpy, except that `memmap` returns the mapping as a base-class ndarray."""

    def __getattr__(self, name: str):
        return getattr(numpy, name)

    @staticmethod
    def memmap(*args, **kwargs) -> "numpy.ndarray":
        return numpy.asarray(numpy.memmap(*args, **kwargs))


@functools.cache
def hf_greedy(alias: str, prompt_ids: tuple[int, ...], max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """Greedy continuation of one prompt, alone (no padding), and the raw logits of each step."""
    model = hf_model(alias)
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, top_p=None, top_k=None,
                             temperature=None)
    new_ids = out.sequences[0, len(prompt_ids):].tolist()
    return new_ids, torch.stack(out.logits, dim=1)[0].float()


def mixed_prompts(tokenizer, count: int = 8) -> list[list[int]]:
    """Prompts from 1 token to about 400, of different lengths and content."""
    base = ("The history of the Roman Empire spans many centuries, from the founding of the city to the fall "
            "of Constantinople. Scholars debate the causes of its decline: economics, politics, plague, and "
            "pressure on the frontiers all played a part. ")
    texts = ["The capital of France is", "Write a short poem about the sea.\n",
             "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
             base, base * 3 + "In summary,", base * 6 + "Question: who founded Rome? Answer:",
             base * 15 + "To conclude, the most important lesson is"]
    prompts = [[tokenizer("Once").input_ids[-1]]] + [tokenizer(t).input_ids for t in texts]
    return prompts[:count]
