"""The engine flags are built from `EngineConfig`: same names, types and defaults as the dataclass, and a bad
value exits 2 with a message naming the flag (no traceback)."""

import argparse
import dataclasses
import subprocess
import sys

import pytest

from sobrio import cli
from sobrio.config import EngineConfig
from sobrio.engine_args import add_engine_args, engine_kwargs, flag_fields
from sobrio.errors import ConfigError, SobrioError

FLAGS = ["--dtype", "--max-num-seqs", "--max-num-batched-tokens", "--max-model-len", "--block-size",
         "--kv-cache-memory", "--enable-prefix-caching", "--max-num-waiting", "--batch-invariant",
         "--long-prefill-token-threshold", "--max-num-partial-prefills", "--max-long-partial-prefills"]


def parse(argv: list[str], multi_model: bool = False) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_engine_args(parser, multi_model)
    return parser.parse_args(argv)


def test_every_engine_flag_is_still_there():
    assert sorted("--" + f.name.replace("_", "-") for f in flag_fields()) == sorted(FLAGS)


def test_flag_defaults_are_the_dataclass_defaults():
    defaults = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    kwargs = engine_kwargs(parse([]))
    assert kwargs == {name: defaults[name] for name in kwargs}
    assert EngineConfig(**engine_kwargs(parse([]))) == EngineConfig()
    assert parse([]).model == EngineConfig.model == "smollm2-135m"
    assert parse([], multi_model=True).model is None  # serve: every installed alias


def test_flags_parse_to_the_field_types():
    args = parse(["--model", "gemma3-270m", "--dtype", "bfloat16", "--max-num-seqs", "3", "--max-model-len", "512",
                  "--kv-cache-memory", "1048576", "--no-enable-prefix-caching", "--batch-invariant",
                  "--long-prefill-token-threshold", "0", "--max-num-partial-prefills", "4",
                  "--max-long-partial-prefills", "2", "--max-num-waiting", "7"])
    config = EngineConfig(model=args.model, **engine_kwargs(args))
    assert (config.model, config.dtype, config.max_num_seqs, config.max_model_len) == ("gemma3-270m", "bfloat16", 3,
                                                                                         512)
    assert (config.kv_cache_memory, config.enable_prefix_caching, config.batch_invariant) == (1 << 20, False, True)
    assert (config.long_prefill_token_threshold, config.max_num_partial_prefills,
            config.max_long_partial_prefills, config.max_num_waiting) == (0, 4, 2, 7)
    assert parse(["--model", "a", "--model", "b"], multi_model=True).model == ["a", "b"]


def test_dtype_choices_are_enforced_by_argparse():
    with pytest.raises(SystemExit) as exc:
        parse(["--dtype", "int8"])
    assert exc.value.code == 2


@pytest.mark.parametrize("kwargs, message", [
    (dict(block_size=12), "--block-size must be a positive multiple of 8, got 12"),
    (dict(max_num_seqs=0), "--max-num-seqs must be >= 1, got 0"),
    (dict(kv_cache_memory=0), "--kv-cache-memory must be >= 1 (or unset), got 0"),
    (dict(dtype="int8"), "--dtype must be one of auto, float32, bfloat16, float16, got 'int8'"),
    (dict(max_num_partial_prefills=2, max_long_partial_prefills=3), "--max-long-partial-prefills must be in [1, "),
    (dict(attention_backend="fast"), "attention_backend must be one of auto, cpp, batched, reference"),
])
def test_bad_values_raise_a_typed_error_naming_the_flag(kwargs, message):
    with pytest.raises(ConfigError) as exc:
        EngineConfig(**kwargs)
    assert message in str(exc.value)
    assert isinstance(exc.value, SobrioError) and isinstance(exc.value, ValueError)
    assert exc.value.option == message.split()[0]


@pytest.mark.parametrize("command", [["generate", "--prompt", "hi"], ["chat"]])
def test_a_bad_flag_exits_2_with_its_message(command, capsys):
    assert cli.main([*command, "--block-size", "12"]) == 2
    err = capsys.readouterr().err
    assert f"sobrio {command[0]}: error: --block-size must be a positive multiple of 8, got 12" in err
    assert "Traceback" not in err


def test_serve_with_a_bad_flag_exits_2_without_a_traceback():
    proc = subprocess.run([sys.executable, "-m", "sobrio.cli", "serve", "--model", "smollm2-135m",
                           "--max-long-partial-prefills", "3"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "sobrio serve: error: --max-long-partial-prefills must be in [1, --max-num-partial-prefills=2], got 3" \
        in proc.stderr
    assert "Traceback" not in proc.stderr
