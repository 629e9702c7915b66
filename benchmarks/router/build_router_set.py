"""Build the router's labelled set (sobrio/data/router_set.jsonl): prompts with checkable answers, each
answered greedily by the weak and the strong model (as a completion, "Question: ...\nAnswer:": Gemma 3's GGUF
has no chat template), labelled by who got it right, in the router's training format (docs/router.md: `id`,
`prompt`, `strong_correct`, `weak_correct`, `source`, `subject` = the family) plus `answer`, `split` and the
two models' names, so `sobrio router train/eval --data sobrio/data/router_set.jsonl` read it as they read
RouteLLM's labels.

    .venv/bin/python benchmarks/router/build_router_set.py [--weak smollm2-135m] [--strong gemma3-270m]

Families: arithmetic (sums, differences, products of 1-3 digit numbers), unit conversions, capitals, and
short word problems; the answers are computed here, the check is the last number (or the capital's name)
in the reply's first line. Rows go to the train or held-out split by a hash of the prompt (70/30), so the split does
not depend on the order or on the models. A few minutes on 2 cores.
"""

import argparse
import hashlib
import json
import random
import re
from pathlib import Path

from sobrio import LLM, SamplingParams

OUT = Path(__file__).resolve().parents[2] / "sobrio" / "data" / "router_set.jsonl"
CAPITALS = {
    "France": "Paris", "Italy": "Rome", "Germany": "Berlin", "Spain": "Madrid", "Portugal": "Lisbon",
    "Poland": "Warsaw", "Sweden": "Stockholm", "Norway": "Oslo", "Finland": "Helsinki", "Denmark": "Copenhagen",
    "Ireland": "Dublin", "Austria": "Vienna", "Greece": "Athens", "Hungary": "Budapest", "Czechia": "Prague",
    "Romania": "Bucharest", "Bulgaria": "Sofia", "Croatia": "Zagreb", "Belgium": "Brussels",
    "the Netherlands": "Amsterdam", "Switzerland": "Bern", "Japan": "Tokyo", "China": "Beijing",
    "India": "New Delhi", "Egypt": "Cairo", "Kenya": "Nairobi", "Canada": "Ottawa", "Australia": "Canberra",
    "Brazil": "Brasilia", "Argentina": "Buenos Aires", "Mexico": "Mexico City", "Peru": "Lima", "Chile": "Santiago",
    "Turkey": "Ankara", "Russia": "Moscow", "Ukraine": "Kyiv", "Morocco": "Rabat", "Nigeria": "Abuja",
    "South Korea": "Seoul", "Thailand": "Bangkok", "Vietnam": "Hanoi", "Indonesia": "Jakarta",
    "Iceland": "Reykjavik", "Estonia": "Tallinn", "Latvia": "Riga", "Lithuania": "Vilnius", "Slovakia": "Bratislava",
    "Slovenia": "Ljubljana", "Serbia": "Belgrade", "Cuba": "Havana",
}
UNITS = [("minutes", "hours", 60), ("seconds", "minutes", 60), ("meters", "kilometers", 1000),
         ("grams", "kilograms", 1000), ("centimeters", "meters", 100), ("days", "weeks", 7),
         ("months", "years", 12), ("hours", "days", 24), ("millimeters", "centimeters", 10)]
NAMES = ["Tom", "Anna", "Luca", "Marie", "Sven", "Ola", "Nina", "Omar"]
ITEMS = ["apples", "books", "pencils", "stamps", "marbles", "cards"]


def arithmetic(rng: random.Random) -> tuple[str, str]:
    op = rng.choice("+-*")
    digits = rng.choice([1, 2, 2, 3]) if op != "*" else rng.choice([1, 1, 2])
    a, b = (rng.randint(10 ** (digits - 1), 10 ** digits - 1) for _ in range(2))
    a, b = (max(a, b), min(a, b)) if op == "-" else (a, b)
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    symbol = {"+": "+", "-": "-", "*": "x"}[op]
    return f"What is {a} {symbol} {b}? Answer with the number only.", str(value)


def conversion(rng: random.Random) -> tuple[str, str]:
    small, big, factor = rng.choice(UNITS)
    n = rng.randint(2, 12)
    return f"How many {small} are in {n} {big}? Answer with the number only.", str(n * factor)


def capital(rng: random.Random) -> tuple[str, str]:
    country = rng.choice(sorted(CAPITALS))
    return f"What is the capital of {country}? Answer in one word.", CAPITALS[country]


def word_problem(rng: random.Random) -> tuple[str, str]:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b = rng.randint(2, 30), rng.randint(2, 20)
    kind = rng.randrange(3)
    if kind == 0:
        return f"{name} has {a} {item} and buys {b} more. How many {item} does {name} have now?", str(a + b)
    if kind == 1:
        a = a + b
        return f"{name} had {a} {item} and gave away {b}. How many {item} are left?", str(a - b)
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    return f"A box holds {a} {item}. How many {item} are in {b} boxes?", str(a * b)


FAMILIES = {"arithmetic": arithmetic, "conversion": conversion, "capital": capital, "word_problem": word_problem}


def prompts(per_family: int, seed: int = 0) -> list[dict]:
    rng, seen, rows = random.Random(seed), set(), []
    for family, make in FAMILIES.items():
        tries = 0
        while sum(r["family"] == family for r in rows) < per_family and tries < per_family * 20:
            tries += 1
            prompt, answer = make(rng)
            if prompt not in seen:
                seen.add(prompt)
                rows.append({"prompt": prompt, "answer": answer, "family": family})
    return rows


def correct(reply: str, answer: str) -> bool:
    """The reply's first non-empty line: its last number (after any "a + b =") is the answer, or it names
    the capital."""
    line = next((x for x in reply.splitlines() if x.strip()), "")
    if answer.isdigit():
        numbers = re.findall(r"-?\d[\d,]*", line)
        return bool(numbers) and numbers[-1].replace(",", "") == answer
    return answer.casefold() in line.casefold()


def answers(model: str, rows: list[dict]) -> list[str]:
    llm = LLM(model, dtype="float32", kv_cache_memory=512 << 20, max_model_len=512)
    params = SamplingParams(temperature=0, max_tokens=16)
    outs = llm.generate([f"Question: {r['prompt']}\nAnswer:" for r in rows], params, use_tqdm=True)
    return [o.outputs[0].text for o in outs]


def split_of(prompt: str) -> str:
    return "heldout" if hashlib.sha256(prompt.encode()).digest()[0] < 77 else "train"  # 77/256: 30%


def labelled(rows: list[dict], strong: str, weak: str) -> list[dict]:
    """The rows in the router's training format, ids numbered within each family."""
    count: dict[str, int] = {}
    out = []
    for r in rows:
        n = count[r["family"]] = count.get(r["family"], -1) + 1
        out.append({"id": f"{r['family']}-{n:04d}", "source": "sobrio", "subject": r["family"], "prompt": r["prompt"],
                    "answer": r["answer"], "strong_correct": r["strong_correct"], "weak_correct": r["weak_correct"],
                    "split": split_of(r["prompt"]), "strong": strong, "weak": weak})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--weak", default="smollm2-135m", help="the weak model (default: smollm2-135m)")
    parser.add_argument("--strong", default="gemma3-270m", help="the strong model (default: gemma3-270m)")
    parser.add_argument("--per-family", type=int, default=180, help="prompts per family (default: 180)")
    args = parser.parse_args()
    rows = prompts(args.per_family)
    for role, model in (("weak", args.weak), ("strong", args.strong)):
        for row, reply in zip(rows, answers(model, rows)):
            row[f"{role}_correct"] = correct(reply, row["answer"])
    OUT.write_text("".join(json.dumps(r) + "\n" for r in labelled(rows, args.strong, args.weak)))
    for family in FAMILIES:
        fam = [r for r in rows if r["family"] == family]
        print(f"{family:13s} {len(fam):4d} prompts  weak {sum(r['weak_correct'] for r in fam) / len(fam):.0%}  "
              f"strong {sum(r['strong_correct'] for r in fam) / len(fam):.0%}")
    print(f"wrote {len(rows)} rows to {OUT}")


if __name__ == "__main__":
    main()
