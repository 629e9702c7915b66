"""`sobrio router label`: run a strong and a weak model on a question set with known answers and write the
router's training file, so a router is trained for the two models a user actually serves.

A question set is JSON Lines: `id`, `prompt`, `answer` (a letter A-J for multiple choice, or a number), and
optional `source`/`subject`. Grading is RouteLLM's: a letter answer is right when the first character of
the stripped reply is that letter (the models get 1 new token, temperature 0); a number answer is right when
the last integer of the reply (commas removed) equals the answer's last integer (up to --max-tokens new
tokens). Each model is reached through the OpenAI API: a remote backend of the gateway config (`--config`,
its `[models.NAME]` table's first remote), or the sobrio server at `--url` that serves it.
"""

import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from sobrio.gateway.router_data import RouterDataError

_INTEGER = re.compile(r"\d+")


def add_label_parser(actions) -> None:
    label = actions.add_parser("label", help="answer a labelled question set with both models and write the "
                                             "training file (strong_correct, weak_correct per prompt)")
    label.add_argument("--strong", required=True, help="the strong model's name (served or in --config)")
    label.add_argument("--weak", required=True, help="the weak model's name (served or in --config)")
    label.add_argument("--data", required=True, help="JSONL questions: id, prompt, answer (letter or number)")
    label.add_argument("--out", required=True, help="the training file to write")
    label.add_argument("--url", default="http://127.0.0.1:8000/v1", help="the OpenAI-compatible server of the "
                       "models not found in --config (default: http://127.0.0.1:8000/v1)")
    label.add_argument("--api-key-env", default=None, help="environment variable holding --url's key "
                       "(default: none)")
    label.add_argument("--config", default=None, help="a gateway TOML file: a model with remote backends is "
                       "asked at its first one (default: none)")
    label.add_argument("--max-tokens", type=int, default=512, help="new tokens for a number answer "
                       "(default: 512; a letter answer gets 1)")
    label.add_argument("--concurrency", type=int, default=4, help="requests in flight per model (default: 4)")
    label.add_argument("--timeout", type=float, default=120.0, help="seconds per request (default: 120)")


@dataclass(frozen=True)
class Endpoint:
    url: str
    model: str
    api_key: str | None


def endpoint(name: str, args) -> Endpoint:
    """Where to ask `name`: its first remote in the gateway config, else --url."""
    from sobrio.gateway.config import load_gateway_config

    spec = load_gateway_config(args.config).models.get(name) if args.config else None
    if spec is not None and spec.remotes:
        remote = spec.remotes[0]
        return Endpoint(remote.url, remote.model, os.environ.get(remote.api_key_env) if remote.api_key_env else None)
    return Endpoint(args.url, name, os.environ.get(args.api_key_env) if args.api_key_env else None)


def is_letter(answer: str) -> bool:
    return len(answer) == 1 and answer.isalpha() and answer.isupper()


def grade(answer: str, reply: str) -> bool:
    """RouteLLM's grading: the first character for a letter, the last integer for a number."""
    if is_letter(answer):
        return reply.strip()[:1] == answer
    want, got = _INTEGER.findall(answer.replace(",", "")), _INTEGER.findall(reply.replace(",", ""))
    return bool(want) and bool(got) and want[-1] == got[-1]


def read_questions(path: str) -> list[dict]:
    rows = []
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").split("\n"), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        if not isinstance(row, dict) or "id" not in row or not isinstance(row.get("prompt"), str) \
                or not isinstance(row.get("answer"), (str, int)):
            raise RouterDataError(f"{path}:{number}: needs id, a string prompt and an answer (letter or number)")
        row["answer"] = str(row["answer"]).strip()
        if not is_letter(row["answer"]) and not _INTEGER.search(row["answer"]):
            raise RouterDataError(f"{path}:{number}: the answer {row['answer']!r} is neither a letter A-Z nor "
                                  "a number")
        rows.append(row)
    if not rows:
        raise RouterDataError(f"{path}: no questions")
    return rows


def answers(where: Endpoint, rows: list[dict], args) -> list[bool]:
    """Each question asked once (greedy), graded; requests run `--concurrency` at a time."""
    import openai

    client = openai.OpenAI(base_url=where.url, api_key=where.api_key or "none", timeout=args.timeout,
                           max_retries=1)

    def one(row: dict) -> bool:
        letter = is_letter(row["answer"])
        reply = client.completions.create(model=where.model, prompt=row["prompt"], temperature=0,
                                          max_tokens=1 if letter else args.max_tokens,
                                          stop=None if letter else ["Question:"])
        return grade(row["answer"], reply.choices[0].text)

    with ThreadPoolExecutor(max(1, args.concurrency)) as pool:
        return list(pool.map(one, rows))


def cmd_label(args) -> int:
    rows = read_questions(args.data)
    strong = answers(endpoint(args.strong, args), rows, args)
    weak = answers(endpoint(args.weak, args), rows, args)
    with open(args.out, "w", encoding="utf-8") as f:
        for row, s, w in zip(rows, strong, weak):
            extra = {k: row[k] for k in ("source", "subject") if k in row}
            f.write(json.dumps({"id": row["id"], "prompt": row["prompt"], **extra, "strong_correct": s,
                                "weak_correct": w}) + "\n")
    print(f"{len(rows)} questions: {args.strong} right on {sum(strong)}, {args.weak} on {sum(weak)}; "
          f"written to {args.out}")
    return 0
