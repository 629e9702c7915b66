"""Energy per step and its split by FLOPs (engine/step_energy.py); grid carbon intensities (gateway/carbon.py)."""

import types

import pytest

from sobrio.engine.step_energy import CpuModelMeter, RaplMeter, StepFlops, split_by_flops
from sobrio.errors import ConfigError
from sobrio.gateway.carbon import carbon_intensities, grams_co2, region_code

SMOLLM2 = types.SimpleNamespace(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                                num_hidden_layers=30, intermediate_size=1536, vocab_size=49152)


def test_a_token_weighs_its_weights_plus_its_context():
    flops = StepFlops(SMOLLM2)
    assert flops.per_token == pytest.approx(2 * (30 * (2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536) + 49152 * 576))
    prompt, decode = flops(100, 0), flops(1, 2000)
    assert flops(1, 10) < decode < flops(2, 0) and prompt > 50 * decode
    shares = split_by_flops(3.0, [prompt, decode])
    assert sum(shares) == pytest.approx(3.0) and shares[0] > shares[1] > 0
    assert split_by_flops(1.0, [0.0, 0.0]) == [0.0, 0.0]


def test_cpu_model_counts_busy_core_seconds():
    meter = CpuModelMeter(watts_per_core=5.0)
    before = meter.read()
    sum(i * i for i in range(2_000_000))  # some CPU time
    assert meter.read() - before > 0.01 and meter.source == "cpu-model"


def test_rapl_counter_wraps(tmp_path):
    (tmp_path / "energy_uj").write_text("999000000\n")
    (tmp_path / "max_energy_range_uj").write_text("1000000000\n")
    meter = RaplMeter([str(tmp_path)])
    (tmp_path / "energy_uj").write_text("1000000\n")  # wrapped past its range: 2 J later
    assert meter.read() == pytest.approx(2.0) and meter.source == "rapl"


def test_regions_by_code_or_name_and_the_world_average():
    table = carbon_intensities()
    for code in ("ITA", "FRA", "DEU", "SWE", "POL", "IRL", "USA"):
        assert 10 < table[code][1] < 1000
    assert table["FRA"][1] < table["ITA"][1] < table["POL"][1]  # nuclear, gas, coal
    assert region_code("ita") == region_code("Italy") == "ITA" and region_code(None) == "WLD"
    assert grams_co2(3.6e6, "SWE") == pytest.approx(table["SWE"][1])
    with pytest.raises(ConfigError, match="unknown region 'Atlantis'"):
        region_code("Atlantis")


def test_region_policy():
    from sobrio.gateway.regions import region_allowed

    assert region_allowed("ITA", None) and region_allowed("ITA", ("EU",)) and region_allowed("ITA", ("ita",))
    assert not region_allowed("USA", ("EU",)) and not region_allowed("WLD", ("EU", "FRA"))
