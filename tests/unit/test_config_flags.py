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
    StructuredOutputsConfig,
)
from sobrio.config.fields import default_of, is_flag
from sobrio.config.lora import LoRAConfig
from sobrio.engine_args import add_config_args, add_engine_args, config_from_args, engine_flag_fields, engine_kwargs
from sobrio.errors import ConfigError, SobrioError

FLAGS = ["--dtype", "--max-num-seqs", "--max-num-batched-tokens", "--max-model-len", "--block-size",
         "--kv-cache-memory", "--kv-cache-dtype", "--enable-prefix-caching", "--max-num-waiting", "--batch-invariant",
         "--long-prefill-token-threshold", "--max-num-partial-prefills", "--max-long-partial-prefills",
         "--max-prompt-tokens-with-decodes", "--tensor-parallel-size", "--data-parallel-size",
         "--pipeline-parallel-size", "--scheduling-policy",
         "--tokenizer", "--chat-template", "--generation-config", "--override-generation-config", "--max-logprobs",
         "--seed", "--quantization", "--quantization-cache", "--enforce-eager", "--trust-remote-code",
         "--gpu-memory-utilization",
         "--enable-chunked-prefill", "--kv-offload-ram", "--kv-offload-disk", "--kv-offload-dir",
         "--kv-offload-key-file",
         "--structured-outputs-fast-forward", "--structured-outputs-compile-timeout", "--speculative-config",
         "--distributed-executor-backend", "--kv-transfer-config",
         "--enable-lora", "--lora-modules", "--max-loras", "--max-lora-rank", "--max-cpu-loras"]
SERVE_FLAGS = ["--model", "--served-model-name", "--host", "--port", "--api-key", "--log-level",
               "--default-max-tokens", "--shutdown-timeout", "--engine-process", "--engine-restarts",
               "--max-body-bytes", "--max-prompts-per-request", "--max-seqs-per-request", "--max-request-tokens",
               "--header-timeout", "--body-timeout", "--limit-concurrency", "--allowed-origins", "--allowed-methods",
               "--allowed-headers", "--allow-credentials", "--config", "--root-path", "--ssl-keyfile",
               "--ssl-certfile", "--ssl-ca-certs", "--ssl-cert-reqs", "--uvicorn-log-level", "--disable-log-requests",
               "--enable-log-requests", "--disable-log-stats"]
CONCERNS = [ModelConfig, CacheConfig, SchedulerConfig, ParallelConfig, StructuredOutputsConfig, ServerConfig,
            LimitsConfig, CorsConfig, LoRAConfig]


def parse(argv: list[str], with_model: bool = True) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_engine_args(parser, with_model)
    return parser.parse_args(argv)


def serve_parser() -> argparse.ArgumentParser:
    sub = argparse.ArgumentParser().add_subparsers()
    from sobrio.server.serving import add_serve_parser

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
    help_text = parser.format_help()
    assert "port to listen on (checked before any model loads) (default: 8000)" in " ".join(help_text.split())
    epilog = help_text.split("\nenvironment variables:\n")[1]  # the environment variables sobrio reads
    for variable in ("SOBRIO_CACHE", "SOBRIO_DISABLE_CPP", "SOBRIO_DISABLE_HUGE_PAGES", "XDG_CACHE_HOME", "CXX",
                     "GOMP_SPINCOUNT"):
        assert variable in epilog
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


def test_pipeline_parallelism_is_not_supported_yet():
    with pytest.raises(ConfigError, match="sobrio does not support --pipeline-parallel-size=2 yet") as exc:
        SobrioConfig.from_kwargs(pipeline_parallel_size=2)
    assert exc.value.option == "--pipeline-parallel-size"


def test_an_unknown_executor_backend_is_named():
    with pytest.raises(ConfigError, match="--distributed-executor-backend must be one of mp, ray, got 'slurm'"):
        SobrioConfig.from_kwargs(distributed_executor_backend="slurm")


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
                           "--max-long-partial-prefills", "9"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "sobrio serve: error: --max-long-partial-prefills must be in [1, --max-num-partial-prefills=8], got 9" \
        in proc.stderr
    assert "Traceback" not in proc.stderr


def test_serve_with_a_bad_server_flag_exits_2(capsys):
    assert cli.main(["serve", "--model", "smollm2-135m", "--port", "0"]) == 2
    assert "sobrio serve: error: --port must be in [1, 65535], got 0" in capsys.readouterr().err


# ---- vLLM's command line (issue 11): positional model, --config, refused features, one-line errors ----

def serve_args(argv: list[str], config_file: str | None = None) -> argparse.Namespace:
    from sobrio.engine_args import apply_config_file

    parser = serve_parser()
    if config_file is not None:
        apply_config_file(parser, config_file)
    return parser.parse_args(argv)


def test_serve_takes_the_model_positionally_and_with_model_too():
    from sobrio.server.serving import _served_models

    config = config_from_args(serve_args(["smollm2-135m", "--port", "9000"]), ServerConfig)
    assert (config.model_tag, config.model, config.port) == ("smollm2-135m", None, 9000)
    both = config_from_args(serve_args(["smollm2-135m", "--model", "gemma3-270m"]), ServerConfig)
    assert _served_models(both) == ["smollm2-135m", "gemma3-270m"]  # MODEL first, then --model


def test_served_model_names_one_model_takes_them_all_several_take_one_each():
    from sobrio.server.startup import served_names

    assert served_names(["m"], ["a", "b"]) == [["a", "b"]]
    assert served_names(["m", "n"], ["a"]) == [["a"], ["n"]]
    assert served_names(["m", "n"], None) == [["m"], ["n"]]
    with pytest.raises(ConfigError, match="3 names for 2 models"):
        served_names(["m", "n"], ["a", "b", "c"])
    with pytest.raises(ConfigError, match="'a' is served twice"):
        served_names(["m", "n"], ["a", "a"])
    args = serve_args(["m", "--served-model-name", "a", "b", "--served-model-name", "c"])  # vLLM's nargs form too
    assert args.served_model_name == ["a", "b", "c"]


def test_config_file_sets_defaults_and_the_command_line_wins(tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text("model: smollm2-135m\nmax-model-len: 512\nkv_cache_memory: 67108864\nport: 9000\n"
                    "served-model-name: [a, b]\nallowed-origins: ['*']\nenable-prefix-caching: false\n"
                    "override-generation-config: {temperature: 0.5}\n")
    args = serve_args(["--port", "9100", "--served-model-name", "c"], str(path))
    config = config_from_args(args, ServerConfig)
    engine = SobrioConfig.from_kwargs(model="m", **engine_kwargs(args))
    assert (config.model_tag, config.port, config.served_model_name) == ("smollm2-135m", 9100, ["c"])
    assert config.cors.allowed_origins == ["*"]
    assert (engine.model_config.max_model_len, engine.cache_config.kv_cache_memory) == (512, 64 << 20)
    assert engine.cache_config.enable_prefix_caching is False
    assert engine.model_config.override_generation_config == {"temperature": 0.5}
    assert config_from_args(serve_args(["gemma3-270m"], str(path)), ServerConfig).model_tag == "gemma3-270m"


@pytest.mark.parametrize("text, message", [
    ("max-model-lenn: 512\n", "unknown flag 'max-model-lenn'; did you mean 'max-model-len'?"),
    ("port: eighty\n", "port: invalid int value: 'eighty'"),
    ("dtype: int8\n", "dtype: 'int8' is not one of auto"),
    ("enable-prefix-caching: maybe\n", "enable-prefix-caching: expected true or false"),
    ("- a\n- b\n", "expected a mapping of flag names to values"),
    ("port: [1\n", "not valid YAML"),
])
def test_a_bad_config_file_exits_2_naming_the_key(tmp_path, capsys, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(SystemExit) as exc:
        cli.main(["serve", "--config", str(path)])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("flags", [["--enable-sleep-mode"], ["--pipeline-parallel-size", "2"],
                                   ["--reasoning-parser", "deepseek_r1"],
                                   ["--no-enable-chunked-prefill"]])
def test_a_flag_for_a_missing_feature_exits_2_saying_so(flags, capsys):
    assert cli.main(["serve", "smollm2-135m", *flags]) == 2
    err = capsys.readouterr().err
    assert f"sobrio serve: error: sobrio does not support {flags[0]}" in err and "unrecognized" not in err


@pytest.mark.parametrize("value, message", [
    ("{}", "kv_connector must be one of SharedMemoryConnector, TcpConnector"),
    ('{"kv_connector": "NixlConnector"}', "kv_connector must be one of"),
    ('{"kv_connector": "TcpConnector", "kv_role": "kv_producer"}', "kv_role must be kv_both"),
    ('{"kv_connector": "TcpConnector", "kv_prot": 1}', "unknown key(s) kv_prot"),
    ("[1]", "must be a JSON object")])
def test_a_bad_kv_transfer_config_exits_2_naming_the_problem(value, message, capsys):
    try:  # a bad JSON text fails in argparse (SystemExit), a bad object when the config is checked
        code = cli.main(["serve", "smollm2-135m", "--kv-transfer-config", value])
    except SystemExit as exc:
        code = exc.code
    assert code == 2 and message in capsys.readouterr().err


def test_vllm_tool_calling_flags_are_accepted_for_the_format_sobrio_parses(capsys):
    config = config_from_args(serve_args(["m", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]),
                              ServerConfig)
    assert config.enable_auto_tool_choice and config.tool_call_parser == "hermes"
    with pytest.raises(SystemExit) as exc:
        cli.main(["serve", "smollm2-135m", "--tool-call-parser", "mistral"])
    assert exc.value.code == 2 and "--tool-call-parser: invalid choice: 'mistral'" in capsys.readouterr().err


def test_no_op_values_of_vllm_flags_are_accepted():
    args = serve_args(["m", "--tensor-parallel-size", "1", "--load-format", "", "--enforce-eager",
                       "--enable-chunked-prefill", "--trust-remote-code", "--gpu-memory-utilization", "0.9",
                       "--disable-log-requests", "--disable-log-stats", "--uvicorn-log-level", "warning"])
    with pytest.raises(ConfigError, match="does not support --load-format"):  # "" is a value, not the default
        SobrioConfig.from_kwargs(**engine_kwargs(args))
    args.load_format = "auto"
    SobrioConfig.from_kwargs(**engine_kwargs(args))
    config = config_from_args(args, ServerConfig)
    assert (config.disable_log_requests, config.disable_log_stats, config.uvicorn_log_level) == (True, True,
                                                                                                "warning")


def test_an_unknown_model_is_one_line_listing_the_aliases(capsys):
    assert cli.main(["serve", "no-such-model"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "unknown model 'no-such-model': not an alias (smollm2-135m, gemma3-270m" in err


def test_a_busy_port_fails_before_any_model_loads(capsys, monkeypatch):
    import socket

    import sobrio.engine.async_llm as async_llm

    def no_loading(*_, **__):
        raise AssertionError("a model loaded although the port is busy")

    monkeypatch.setattr(async_llm, "load_model_files", no_loading)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert cli.main(["serve", "smollm2-135m", "--port", str(port)]) == 1
    err = capsys.readouterr().err
    assert f"sobrio serve: error: cannot listen on 127.0.0.1:{port}: Address already in use" in err


def test_chat_template_is_a_file_or_inline_and_is_compiled_at_start(tmp_path):
    from sobrio.config.chat_template import load_chat_template

    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert load_chat_template(str(path)) == path.read_text()
    assert load_chat_template("{{ messages[0].content }}\\n") == "{{ messages[0].content }}\n"  # escapes decoded
    with pytest.raises(ConfigError, match="looks like a file path, but there is no such file"):
        ModelConfig(chat_template="missing.jinja")
    with pytest.raises(ConfigError, match="not a valid Jinja template"):
        ModelConfig(chat_template="{% for m in messages %}")


def test_generation_config_defaults_come_from_the_model_unless_vllm(tmp_path):
    from gguf import GGUFWriter

    from sobrio.loader.generation import default_sampling

    (tmp_path / "generation_config.json").write_text('{"temperature": 0.6, "top_p": 0.95, "top_k": 20, '
                                                     '"do_sample": true, "max_new_tokens": 64}')
    assert default_sampling("auto", tmp_path, None) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20,
                                                        "max_tokens": 64}
    assert default_sampling("vllm", tmp_path, None) == {}
    assert default_sampling("auto", tmp_path, None, {"temperature": 0.2})["temperature"] == 0.2
    writer = GGUFWriter(str(tmp_path / "m.gguf"), "llama")  # a GGUF's general.sampling.* keys (llama.cpp's)
    writer.add_float32("general.sampling.temp", 0.7)
    writer.add_int32("general.sampling.top_k", 40)
    writer.add_array("tokenizer.ggml.tokens", ["a", "bb", "ccc"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    assert default_sampling("auto", tmp_path, tmp_path / "m.gguf") == {"temperature": 0.7, "top_k": 40}
    with pytest.raises(ConfigError, match="unknown sampling parameter 'temp'"):
        ModelConfig(override_generation_config={"temp": 0.5})
    with pytest.raises(ConfigError, match="--generation-config must be auto, vllm or a folder"):
        ModelConfig(generation_config="nowhere")


def test_max_logprobs_caps_what_a_request_may_ask():
    from sobrio.engine.input import InputProcessor
    from sobrio.errors import InvalidRequestError
    from sobrio.types.params import SamplingParams

    class Vocab:
        def get_vocab(self):
            return {str(i): i for i in range(100)}

    InputProcessor(Vocab(), 64, 100, max_logprobs=20).validate_params(SamplingParams(logprobs=20), None)
    with pytest.raises(InvalidRequestError, match="at most 5 \\(--max-logprobs\\)"):
        InputProcessor(Vocab(), 64, 100, max_logprobs=5).validate_params(SamplingParams(logprobs=6), None)
    InputProcessor(Vocab(), 64, 100, max_logprobs=-1).validate_params(SamplingParams(logprobs=100), None)


def test_unseeded_requests_get_seeds_from_the_engine_seed_and_their_number():
    from sobrio.engine.llm_engine import derived_seed

    assert derived_seed(7, 1) == derived_seed(7, 1)
    assert len({derived_seed(7, 1), derived_seed(7, 2), derived_seed(8, 1)}) == 3
    assert 0 <= derived_seed(7, 1) < 2**63


def test_model_defaults_fill_only_the_fields_a_request_left_unset():
    from sobrio.server.generate import with_model_defaults
    from sobrio.server.protocol import CompletionRequest
    from sobrio.types.params import SamplingParams

    defaults = {"temperature": 0.6, "top_k": 20, "max_tokens": 64}
    unset = CompletionRequest(prompt="x")
    params = with_model_defaults(unset.to_sampling_params(), unset, defaults)
    assert (params.temperature, params.top_k, params.max_tokens) == (0.6, 20, 16)  # max_tokens: the server's
    chosen = CompletionRequest(prompt="x", temperature=0.0)
    params = with_model_defaults(chosen.to_sampling_params(), chosen, defaults)
    assert (params.temperature, params.top_k) == (0.0, 20)
    assert with_model_defaults(SamplingParams(), unset, {}) == SamplingParams()


def test_tokenizer_and_chat_template_flags_replace_the_models_own():
    from sobrio.loader.load import load_model_files

    files = load_model_files(ModelConfig(model="gemma3-270m", tokenizer="smollm2-135m", chat_template="{{ 'X' }}"))
    assert len(files.tokenizer) < 60_000 < files.config.vocab_size  # SmolLM2's vocabulary, Gemma's config
    assert files.tokenizer.chat_template == "{{ 'X' }}" and files.default_sampling == {}


@pytest.mark.parametrize("value, message", [
    ('{"method": ', "--speculative-config must be a JSON object"),
    ('{"method": "eagle3", "num_speculative_tokens": 2}', "sobrio does not support method 'eagle3' yet"),
    ('{"method": "eagle", "num_speculative_tokens": 2}', 'method "eagle" needs "model"'),
    ('{"method": "medusa", "num_speculative_tokens": 2}', 'method "medusa" needs "model"'),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be an integer in [1, 16]"),
])
def test_a_bad_speculative_config_exits_2_naming_the_problem(value, message, capsys):
    try:
        code = cli.main(["serve", "smollm2-135m", "--speculative-config", value])
    except SystemExit as exc:  # argparse's own exit, for a value its converter refused
        code = exc.code
    assert code == 2
    assert message in capsys.readouterr().err


def test_speculative_config_takes_vllm_json_and_fills_the_defaults():
    config = SobrioConfig.from_kwargs(speculative_config='{"method": "ngram", "num_speculative_tokens": 3}')
    assert config.speculative_config.enabled and config.speculative_config.get("num_speculative_tokens") == 3
    assert config.speculative_config.get("prompt_lookup_max") == 5 and not SobrioConfig().speculative_config.enabled


def test_a_folder_model_answers_to_its_basename_and_the_path_as_given():
    """vLLM serves a folder under the path as given; sobrio under its basename: both reach it (issue 40)."""
    from sobrio.server.startup import served_names, with_paths_as_given

    models = ["/models/tiny-llama", "smollm2-135m", "./other"]
    names = with_paths_as_given(models, served_names(["tiny-llama", "smollm2-135m", "other"], None), None)
    assert names == [["tiny-llama", "/models/tiny-llama"], ["smollm2-135m"], ["other", "./other"]]
    named = with_paths_as_given(models[:1], served_names(["tiny-llama"], ["mine"]), ["mine"])
    assert named == [["mine"]]  # --served-model-name decides alone
