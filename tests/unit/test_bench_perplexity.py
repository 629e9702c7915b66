"""`sobrio bench perplexity` without a model: the windows score each token once with the promised context,
the shipped texts are there, and bad flags fail at once with exit 2 and one line."""

import pytest

from sobrio import data
from sobrio.bench.perplexity import ModeResult, format_table, parse_modes, windows
from sobrio.cli import main


@pytest.mark.parametrize("num_tokens, window, stride, score_first", [
    (1000, 512, 256, False), (1000, 512, 512, False), (1000, 512, 512, True), (513, 512, 256, False),
    (100, 512, 256, False), (97, 16, 5, True), (2, 2, 1, False),
])
def test_windows_score_each_token_once(num_tokens, window, stride, score_first):
    spans = windows(num_tokens, window, stride, score_first)
    scored = [t for w in spans for t in range(w.first, w.end)]
    assert scored == sorted(set(scored))  # each once, in text order
    starts = {w.begin for w in spans} if stride == window else {0}  # tokens no window gives a context
    assert set(range(num_tokens)) - set(scored) == (set() if score_first else starts)
    for i, w in enumerate(spans):
        assert w.end - w.begin <= window and w.begin == i * stride
        assert w.first >= (w.begin if score_first else w.begin + 1)
        if i and stride < window:
            assert w.first - w.begin >= window - stride  # the context every later window promises


def test_shipped_texts_are_distinct_plain_english():
    heldout, calibration = data.read_text(data.HELDOUT), data.read_text(data.CALIBRATION)
    assert heldout.startswith("CHAPTER I") and "Alice" in heldout and len(heldout) > 20_000
    assert "ORLANDO" in calibration and len(calibration) > 7_000
    assert heldout.isascii() and calibration.isascii() and "\r" not in heldout + calibration


def test_table_has_one_row_per_mode_and_change_vs_none():
    results = [ModeResult("none", 10.0, 270_000_000, 23040, 5000, 12.5, "bfloat16"),
               ModeResult("int8", 10.1, 140_000_000, 23040, 5000, 9.0, "bfloat16")]
    lines = format_table(results).splitlines()
    assert lines[0].split(" | ")[0].strip() == "mode" and "KV bytes/token" in lines[0]
    assert lines[2].startswith("none") and "270.0" in lines[2]
    assert lines[3].startswith("int8") and "+1.00%" in lines[3] and "140.0" in lines[3]


def test_every_quantization_runs_with_every_kv_cache_dtype():
    modes = parse_modes("none,int8", "auto,int8")
    assert [m.name for m in modes] == ["none", "none + kv int8", "int8", "int8 + kv int8"]
    assert modes[0].engine_kwargs() == {} and modes[3].engine_kwargs() == {"quantization": "int8",
                                                                           "kv_cache_dtype": "int8"}


@pytest.mark.parametrize("argv, option", [
    (["--quantization", "int3"], "quantization"),
    (["--quantization", "none,,none"], "--quantization"),
    (["--quantization", "none,none"], "--quantization"),
    (["--window", "64", "--stride", "128"], "--stride"),
    (["--window", "1"], "--window"),
    (["--max-tokens", "1"], "--max-tokens"),
    (["--kv-cache-dtype", "int4"], "kv-cache-dtype"),
    (["--prompt-chunk", "0"], "--prompt-chunk"),
])
def test_bad_flags_exit_2_with_one_line(argv, option, capsys):
    assert main(["bench", "perplexity", *argv]) == 2  # refused before any model loads
    err = capsys.readouterr().err
    assert option in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
