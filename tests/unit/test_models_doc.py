"""docs/models.md's table says what the registry accepts: every family, its names, its GGUF architectures and
whether tensor parallelism splits it."""

import pathlib
import re

from sobrio.models.registry import FAMILIES

DOC = pathlib.Path(__file__).parents[2] / "docs" / "models.md"


def _rows() -> dict[str, list[str]]:
    """The supported-architecture table's rows by model_type: [family, model_type, architectures, gguf,
    window, tp]."""
    lines = DOC.read_text().split("## What is refused")[0].splitlines()
    cells = [[c.strip() for c in line.strip().strip("|").split("|")] for line in lines if line.startswith("| ")]
    return {re.sub(r"[` ]", "", row[1]): row for row in cells[1:]}


def _names(cell: str) -> set[str]:
    return set(re.findall(r"`([^`]+)`", cell))


def test_the_doc_table_is_the_registry():
    rows = _rows()
    assert set(rows) == {t for f in FAMILIES for t in f.model_types}
    for family in FAMILIES:
        for model_type in family.model_types:
            name, _, architectures, gguf, window, tp = rows[model_type]
            assert name == family.name
            assert _names(architectures) == set(family.architectures)
            assert _names(gguf) <= set(family.gguf) and gguf.startswith("not yet") == (not family.gguf)
            assert set(family.gguf) <= _names(gguf)
            assert window == family.sliding_window
            assert tp == ("yes" if family.tensor_parallel else "no")


def test_the_refused_fields_are_the_ones_checked():
    """Each field the registry refuses by name is in the doc's refusal table."""
    import inspect

    from sobrio.models import registry

    checked = set(re.findall(r'"(\w+)": ', inspect.getsource(registry.check_config)))
    listed = _names(DOC.read_text().split("## What is refused")[1])
    assert checked and checked <= listed, checked - listed


def test_every_gguf_architecture_listed_is_read():
    from sobrio.loader.gguf import GGUF_ARCHITECTURES

    assert {a for f in FAMILIES for a in f.gguf} <= set(GGUF_ARCHITECTURES)
