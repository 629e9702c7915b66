"""sobrio's layers, as `.importlinter` writes them down (docs/architecture.md says why), hold: import-linter
runs on the package and every contract is kept; and a contract does fail when a forbidden import or a cycle
is planted in a copy of the package, or a module is added that no layer names, so the check can fail."""

import shutil
import subprocess
import sys
from pathlib import Path

import sobrio

ROOT = Path(sobrio.__file__).parent.parent
CONFIG = ROOT / ".importlinter"


def lint(root: Path) -> subprocess.CompletedProcess:
    """import-linter on the `sobrio` package under `root`, in a process of its own (a fresh import path)."""
    code = ("import sys; from importlinter.cli import lint_imports; "
            f"sys.exit(lint_imports(config_filename={str(CONFIG)!r}, no_cache=True, no_logo=True))")
    return subprocess.run([sys.executable, "-c", code], cwd=root, env={"PYTHONPATH": str(root)},
                          capture_output=True, text=True, timeout=120)


def test_every_contract_is_kept():
    result = lint(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def test_a_planted_forbidden_import_cycle_and_unplaced_module_break_their_contracts(tmp_path):
    shutil.copytree(ROOT / "sobrio", tmp_path / "sobrio",
                    ignore=lambda folder, names: [n for n in names if not (n.endswith(".py") or
                                                                           (Path(folder) / n).is_dir())
                                                  or n == "__pycache__"])
    with open(tmp_path / "sobrio" / "layers" / "attention.py", "a") as f:
        f.write("\nfrom sobrio.kv.cache import KVCache  # noqa\n")  # layers must get the cache through metadata
    with open(tmp_path / "sobrio" / "types" / "request.py", "a") as f:
        f.write("\nimport sobrio.engine.core  # noqa\n")  # engine -> types -> engine: a cycle, and a layer upside down
    (tmp_path / "sobrio" / "unplaced.py").write_text('"""A module no layer names."""\n')
    result = lint(tmp_path)
    out = " ".join(result.stdout.split())  # the report wraps long names
    assert result.returncode != 0, out
    assert "layers never import kv BROKEN" in out
    assert "sobrio.layers.attention -> sobrio.kv.cache" in out
    assert "plain types BROKEN" in out  # the request path's layers
    assert "no cycles between siblings) BROKEN" in out
    assert "sobrio.types.request -> sobrio.engine.core" in out
    assert "sobrio.unplaced" in out  # exhaustive: a new module must be given its layer
