"""The flags are built from the config dataclasses (`sobrio/config/`): same names, types and defaults as the
fields, each field in its concern, and a bad value raises a ConfigError naming the flag (the CLI exits 2
with that message, no traceback)."""

import argparse
import dataclasses
import pickle
import subprocess
import sys

import pytest

from sobrio import cli
from sobrio.config import (
    CacheConfig,
    CorsConfig,
    LimitsConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    ServerConfig,
    SobrioConfig,
)
from sobrio.config.fields import default_of, is_flag
from sobrio.engine_args import add_config_args, add_engine_args, config_from_args, engine_flag_fields, engine_kwargs
from sobrio.errors import ConfigError, SobrioError

FLAGS = ["--dtype", "--max-num-seqs", "--max-num-batched-tokens", "--max-model-len", "--block-size",
         "--kv-cache-memory", "--enable-prefix-caching", "--max-num-waiting", "--batch-invariant",
         "--long-prefill-token-threshold", "--max-num-partial-prefills", "--max-long-partial-prefills",
         "--tensor-parallel-size", "--data-parallel-size"]
SERVE_FLAGS = ["--model", "--served-model-name", "--host", "--port", "--api-key", "--log-level",
               "--default-max-tokens", "--shutdown-timeout", "--engine-process", "--engine-restarts",
               "--max-body-bytes", "--max-prompts-per-request", "--max-seqs-per-request", "--max-request-tokens",
               "--header-timeout", "--body-timeout", "--limit-concurrency", "--allowed-origins", "--allowed-methods",
               "--allowed-headers", "--allow-credentials"]
CONCERNS = [ModelConfig, CacheConfig, SchedulerConfig, ParallelConfig, ServerConfig, LimitsConfig, CorsConfig]


def parse(argv: list[str], with_model: bool = True) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_engine_args(parser, with_model)
    return parser.parse_args(argv)


def serve_parser() -> argparse.ArgumentParser:
    sub = argparse.ArgumentParser().add_subparsers()
    from sobrio.server.app import add_serve_parser

    add_serve_parser(sub)
    return sub.choices["serve"]


def test_every_engine_flag_is_still_there():
    assert sorted("--" + f.name.replace("_", "-") for f in engine_flag_fields(skip=("model",))) == sorted(FLAGS)


@pytest.mark.parametrize("concern", CONCERNS, ids=lambda c: c.__name__)
def test_every_concern_field_is_a_flag_with_its_default(concern):
    parser = argparse.ArgumentParser()
    add_config_args(parser, concern)
    args = parser.parse_args([])
    for f in dataclasses.fields(concern):
        if is_flag(f):
            assert getattr(args, f.name) == default_of(f), f.name
    assert config_from_args(args, concern) == concern()


def test_serve_has_every_server_and_engine_flag_each_with_its_default_in_help():
    parser = serve_parser()
    options = {o for a in parser._actions for o in a.option_strings if o.startswith("--")}
    assert {*FLAGS, *SERVE_FLAGS} <= options
    for action in parser._actions[1:]:  # after -h; None or [] defaults are explained in the help itself
        if action.default not in (None, []):
            assert action.help.endswith("(default: %(default)s)"), action.option_strings
    assert "port to listen on (default: 8000)" in parser.format_help()
    args = parser.parse_args([])
    assert config_from_args(args, ServerConfig) == ServerConfig()
    assert SobrioConfig.from_kwargs(**engine_kwargs(args)) == SobrioConfig()


def test_serve_flags_parse_to_the_server_config():
    args = serve_parser().parse_args(["--model", "a", "--model", "b", "--served-model-name", "x", "--port", "9000",
                                      "--no-engine-process", "--header-timeout", "2.5", "--allowed-origins",
                                      "http://a.example, http://b.example", "--allowed-methods", '["GET"]'])
    config = config_from_args(args, ServerConfig)
    assert (config.model, config.served_model_name, config.port, config.engine_process) == (["a", "b"], ["x"],
                                                                                             9000, False)
    assert config.limits.header_timeout == 2.5
    assert config.cors.allowed_origins == ["http://a.example", "http://b.example"]
    assert config.cors.allowed_methods == ["GET"]


def test_flag_defaults_are_the_dataclass_defaults():
    assert SobrioConfig.from_kwargs(**engine_kwargs(parse([]))) == SobrioConfig()
    assert parse([]).model == ModelConfig.model == "smollm2-135m"
    assert not hasattr(parse([], with_model=False), "model")  # serve: ServerConfig's repeatable --model


def test_flags_parse_to_the_field_types():
    args = parse(["--model", "gemma3-270m", "--dtype", "bfloat16", "--max-num-seqs", "3", "--max-model-len", "512",
                  "--kv-cache-memory", "1048576", "--no-enable-prefix-caching", "--batch-invariant",
                  "--long-prefill-token-threshold", "0", "--max-num-partial-prefills", "4",
                  "--max-long-partial-prefills", "2", "--max-num-waiting", "7"])
    config = SobrioConfig.from_kwargs(model=args.model, **engine_kwargs(args))
    model, cache, sched = config.model_config, config.cache_config, config.scheduler_config
    assert (model.model, model.dtype, model.max_model_len, model.batch_invariant) == ("gemma3-270m", "bfloat16",
                                                                                      512, True)
    assert (cache.kv_cache_memory, cache.enable_prefix_caching) == (1 << 20, False)
    assert (sched.max_num_seqs, sched.long_prefill_token_threshold, sched.max_num_partial_prefills,
            sched.max_long_partial_prefills, sched.max_num_waiting) == (3, 0, 4, 2, 7)


def test_a_flat_keyword_lands_in_its_concern():
    config = SobrioConfig.from_kwargs(model="m", dtype="float32", block_size=32, max_num_seqs=8, num_threads=2,
                                      kv_cache_memory_fraction=0.5)
    assert config.model_config == ModelConfig(model="m", dtype="float32")
    assert config.cache_config == CacheConfig(block_size=32, kv_cache_memory_fraction=0.5)
    assert config.scheduler_config == SchedulerConfig(max_num_seqs=8)
    assert config.parallel_config == ParallelConfig(num_threads=2)


def test_an_unknown_keyword_is_named():
    with pytest.raises(ConfigError, match="unknown engine argument 'max_num_seq'; did you mean 'max_num_seqs'"):
        SobrioConfig.from_kwargs(max_num_seq=8)
    with pytest.raises(ConfigError, match="'port'"):  # a server setting is not an engine argument
        SobrioConfig.from_kwargs(port=80)


@pytest.mark.parametrize("name", ["tensor_parallel_size", "data_parallel_size"])
def test_parallel_sizes_above_one_are_not_supported_yet(name):
    with pytest.raises(ConfigError, match="not supported yet") as exc:
        SobrioConfig.from_kwargs(**{name: 2})
    assert exc.value.option == "--" + name.replace("_", "-")


def test_the_config_pickles():
    """It crosses to the engine-core process."""
    config = SobrioConfig.from_kwargs(model="m", block_size=32, max_num_seqs=3, num_threads=1)
    assert pickle.loads(pickle.dumps(config)) == config
    server = ServerConfig(model=["a"], cors=CorsConfig(allowed_origins=["*"]))
    assert pickle.loads(pickle.dumps(server)) == server


def test_configs_are_frozen_so_a_value_is_checked_once():
    with pytest.raises(dataclasses.FrozenInstanceError):
        SchedulerConfig().max_num_seqs = 0  # type: ignore[misc]


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
    (dict(kv_cache_memory_fraction=0.0), "kv_cache_memory_fraction must be in (0, 1]"),
    (dict(tensor_parallel_size=0), "--tensor-parallel-size must be >= 1, got 0"),
])
def test_bad_values_raise_a_typed_error_naming_the_flag(kwargs, message):
    with pytest.raises(ConfigError) as exc:
        SobrioConfig.from_kwargs(**kwargs)
    assert message in str(exc.value)
    assert isinstance(exc.value, SobrioError) and isinstance(exc.value, ValueError)
    assert exc.value.option == message.split()[0]


@pytest.mark.parametrize("config_class, kwargs, message", [
    (ServerConfig, dict(port=0), "--port must be in [1, 65535], got 0"),
    (ServerConfig, dict(port=65536), "--port must be in [1, 65535], got 65536"),
    (ServerConfig, dict(shutdown_timeout=0.0), "--shutdown-timeout must be > 0 seconds, got 0.0"),
    (ServerConfig, dict(api_key=""), "--api-key must be a non-empty key (or unset), got ''"),
    (ServerConfig, dict(engine_restarts=-1), "--engine-restarts must be >= 0, got -1"),
    (ServerConfig, dict(default_max_tokens=-1), "--default-max-tokens must be >= 0, got -1"),
    (ServerConfig, dict(log_level="loud"), "--log-level must be one of critical, error, warning, info, debug"),
    (LimitsConfig, dict(header_timeout=-1.0), "--header-timeout must be > 0 seconds, got -1.0"),
    (LimitsConfig, dict(max_body_bytes=0), "--max-body-bytes must be >= 1, got 0"),
    (LimitsConfig, dict(limit_concurrency=0), "--limit-concurrency must be >= 1, got 0"),
])
def test_bad_server_values_raise_a_typed_error_naming_the_flag(config_class, kwargs, message):
    with pytest.raises(ConfigError) as exc:
        config_class(**kwargs)
    assert message in str(exc.value)
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


def test_serve_with_a_bad_server_flag_exits_2(capsys):
    assert cli.main(["serve", "--model", "smollm2-135m", "--port", "0"]) == 2
    assert "sobrio serve: error: --port must be in [1, 65535], got 0" in capsys.readouterr().err
