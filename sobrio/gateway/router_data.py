"""The router's labelled files (JSON Lines), read and checked: one prompt a line with what each model got.

Two formats, as `docs/router.md` describes: `strong_correct` / `weak_correct` booleans (RouteLLM's
per-prompt correctness), or graded `strong_score` / `weak_score` numbers in [0, 1] (a judge's scores,
rescaled). Every line needs `id` and `prompt`; `source` and `subject` are optional (the eval prints one
block per source; cross-validation keeps a subject in one fold).
"""

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np


class RouterDataError(ValueError):
    """A labelled file that cannot be used, with the line that says why."""


@dataclass
class LabelledSet:
    ids: list[str]
    prompts: list[str]
    strong: np.ndarray  # correctness (0/1) or graded score in [0, 1], per prompt
    weak: np.ndarray
    sources: list[str]
    subjects: list[str]

    def __len__(self) -> int:
        return len(self.ids)

    def subset(self, keep: np.ndarray) -> "LabelledSet":
        pick = np.flatnonzero(keep)
        return LabelledSet([self.ids[i] for i in pick], [self.prompts[i] for i in pick], self.strong[pick],
                           self.weak[pick], [self.sources[i] for i in pick], [self.subjects[i] for i in pick])


def _outcome(row: dict, who: str, where: str) -> float:
    if f"{who}_correct" in row:
        value = row[f"{who}_correct"]
        if not isinstance(value, bool):
            raise RouterDataError(f"{where}: {who}_correct must be true or false, not {value!r}")
        return float(value)
    if f"{who}_score" in row:
        value = row[f"{who}_score"]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
            raise RouterDataError(f"{where}: {who}_score must be a number in [0, 1], not {value!r}")
        return float(value)
    raise RouterDataError(f"{where}: needs {who}_correct (true/false) or {who}_score (0-1)")


def read_labelled(path: str | Path, need_labels: bool = True) -> LabelledSet:
    """A labelled file; `need_labels=False` (scoring) needs only `id` and `prompt`."""
    ids, prompts, strong, weak, sources, subjects = [], [], [], [], [], []
    try:
        lines = Path(path).read_text(encoding="utf-8").split("\n")
    except OSError as exc:
        raise RouterDataError(f"{path}: {exc.strerror or exc}") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise RouterDataError(f"{where}: not JSON ({exc.msg})") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or "id" not in row:
            raise RouterDataError(f"{where}: needs an \"id\" and a string \"prompt\"")
        ids.append(str(row["id"]))
        prompts.append(row["prompt"])
        strong.append(_outcome(row, "strong", where) if need_labels else np.nan)
        weak.append(_outcome(row, "weak", where) if need_labels else np.nan)
        sources.append(str(row.get("source", "all")))
        subjects.append(str(row.get("subject", row.get("source", "all"))))
    if not ids:
        raise RouterDataError(f"{path}: no rows")
    return LabelledSet(ids, prompts, np.array(strong), np.array(weak), sources, subjects)


def read_scores(path: str | Path, ids: list[str]) -> np.ndarray:
    """A `sobrio router score` file's scores, in the order of `ids` (each id must be there)."""
    scores = {}
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").split("\n"), 1):
        if line.strip():
            row = json.loads(line)
            if not isinstance(row.get("score"), (int, float)):
                raise RouterDataError(f"{path}:{number}: needs a number \"score\"")
            scores[str(row["id"])] = float(row["score"])
    missing = [i for i in ids if i not in scores]
    if missing:
        raise RouterDataError(f"{path}: no score for {len(missing)} id(s), e.g. {missing[0]!r}")
    return np.array([scores[i] for i in ids])


def read_set(split: str | None = None) -> list[dict]:
    """sobrio's own small labelled set (sobrio/data/router_set.jsonl, in the format above: gemma3-270m strong,
    smollm2-135m weak, on self-made questions), one split or all; benchmarks/gateway_demo.py asks its
    questions."""
    from importlib import resources

    text = resources.files("sobrio.data").joinpath("router_set.jsonl").read_text()
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    return [r for r in rows if split is None or r["split"] == split]
