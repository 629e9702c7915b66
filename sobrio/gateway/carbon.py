"""Energy and CO2 of each request: the engine measures the joules (engine/step_energy.py); here they become grams
of CO2 by the grid carbon intensity of the region that served the request.

The intensities are `sobrio/data/grid_carbon_intensity.csv`: yearly averages per country in gCO2e/kWh,
from codecarbon's data (Ember and Our World in Data; see the file's header). A server's region is
`sobrio serve --region` (an ISO 3166 alpha-3 code such as ITA, FRA, DEU, or a country's name); without one,
the world average. Remote backends (no engine of ours to measure) will be estimated from their tokens.
"""

import csv
import functools
from importlib import resources

from sobrio.errors import ConfigError

JOULES_PER_KWH = 3.6e6


@functools.cache
def carbon_intensities() -> dict[str, tuple[str, float]]:
    """ISO alpha-3 code -> (country, gCO2e per kWh)."""
    text = resources.files("sobrio.data").joinpath("grid_carbon_intensity.csv").read_text()
    rows = csv.DictReader(line for line in text.splitlines() if not line.startswith("#"))
    return {r["iso3"]: (r["country"], float(r["g_co2_per_kwh"])) for r in rows}


def region_code(region: str | None) -> str:
    """The table's code for a region given as a code or a country name (None: the world average, WLD)."""
    if region is None:
        return "WLD"
    table = carbon_intensities()
    wanted = region.strip().casefold()
    for code, (country, _) in table.items():
        if wanted in (code.casefold(), country.casefold()):
            return code
    raise ConfigError(f"unknown region {region!r}: give an ISO 3166 alpha-3 code (ITA, FRA, DEU, SWE, POL, IRL, "
                      "USA, ...) or a country's name", option="--region")


def grams_co2(joules: float, region: str) -> float:
    return joules / JOULES_PER_KWH * carbon_intensities()[region][1]
