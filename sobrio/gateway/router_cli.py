"""`sobrio router train | score | eval | label`: fit the router on your own labels, score prompts with it,
measure it as RouteLLM does (with the random, prompt-length and oracle baselines beside it), and make the
labels by running your two models on a question set (gateway/router*.py, docs/router.md)."""

import argparse
import json
from pathlib import Path

DEFAULT_SHARE = 0.5
RESAMPLES = 1000


def add_router_parser(sub) -> None:
    parser = sub.add_parser("router", help="train, score, evaluate and label for model=\"auto\"'s router")
    actions = parser.add_subparsers(dest="action", required=True)
    train = actions.add_parser("train", help="fit the router on a labelled JSONL file (id, prompt, "
                                             "strong_correct/weak_correct or strong_score/weak_score)")
    train.add_argument("--data", required=True, help="the labelled file")
    train.add_argument("--out", default=None, help="weights file (default: the one sobrio ships, overwritten)")
    train.add_argument("--strong", default="gemma3-270m", help="the strong model's served name, written into "
                       "the weights; [router] large in the gateway config overrides it (default: gemma3-270m)")
    train.add_argument("--weak", default="smollm2-135m", help="the weak model's served name ([router] small "
                       "overrides it; default: smollm2-135m)")
    train.add_argument("--strong-share", type=float, default=DEFAULT_SHARE, help="the default threshold sends "
                       "this share of the training prompts to the strong model (default: 0.5)")
    train.add_argument("--folds", type=int, default=5, help="subject-grouped cross-validation folds whose "
                       "metrics are stored with the weights (the dashboard's quality estimate); 0: none "
                       "(default: 5)")
    score = actions.add_parser("score", help="write one {\"id\", \"score\"} line per prompt (higher: needs "
                                             "the strong model more)")
    score.add_argument("--data", required=True, help="JSONL with id and prompt per line")
    score.add_argument("--out", required=True, help="the scores file to write")
    score.add_argument("--weights", default=None, help="weights file (default: the one sobrio ships)")
    evaluate = actions.add_parser("eval", help="APGR, CPT(50%%), CPT(80%%), PGR at 30%% strong calls with "
                                               "bootstrap 95%% CIs, beside random, prompt length and oracle")
    evaluate.add_argument("--data", required=True, help="the labelled file")
    evaluate.add_argument("--scores", default=None, help="a `sobrio router score` file (default: score the "
                          "data with --weights)")
    evaluate.add_argument("--weights", default=None, help="weights file (default: the one sobrio ships)")
    evaluate.add_argument("--resamples", type=int, default=RESAMPLES, help="bootstrap resamples (default: 1000)")
    evaluate.add_argument("--plot", default=None, help="also draw the curves into this PNG")
    from sobrio.gateway.router_label import add_label_parser

    add_label_parser(actions)
    parser.set_defaults(func=cmd_router)


def cmd_router(args: argparse.Namespace) -> int:
    from sobrio.gateway.router_data import RouterDataError

    commands = {"train": _train, "score": _score, "eval": _evaluate}
    try:
        if args.action == "label":
            from sobrio.gateway.router_label import cmd_label

            return cmd_label(args)
        return commands[args.action](args)
    except (RouterDataError, ValueError) as exc:
        print(f"sobrio router {args.action}: {exc}")
        return 2


def _train(args: argparse.Namespace) -> int:
    from sobrio.gateway import router
    from sobrio.gateway.router_cv import cross_validate
    from sobrio.gateway.router_data import read_labelled
    from sobrio.gateway.router_features import PromptFeatures

    data = read_labelled(args.data)
    features = PromptFeatures().features(data.prompts)
    weights = router.train(features, data.strong, data.weak, data.subjects, args.weak, args.strong,
                           args.strong_share)
    if args.folds:
        weights.quality = cross_validate(data, features, args.folds)
        print(f"subject-grouped {args.folds}-fold cross-validation: " + ", ".join(
            f"{k} {v:.3f}" for k, v in weights.quality.items() if isinstance(v, float)))
    out = Path(args.out) if args.out else Path(router.__file__).parent.parent / "data" / router.DEFAULT_WEIGHTS
    weights.save(out)
    print(f"trained on {len(data)} prompts; threshold {weights.threshold:.4f} sends {args.strong_share:.0%} of "
          f"them to the strong model; weights in {out}")
    return 0


def _scores_of(prompts: list[str], weights_path: str | None):
    from sobrio.gateway.router import RouterWeights
    from sobrio.gateway.router_features import PromptFeatures

    return RouterWeights.load(weights_path).scores(PromptFeatures().features(prompts))


def _score(args: argparse.Namespace) -> int:
    from sobrio.gateway.router_data import read_labelled

    data = read_labelled(args.data, need_labels=False)
    scores = _scores_of(data.prompts, args.weights)
    with open(args.out, "w", encoding="utf-8") as f:
        for i, s in zip(data.ids, scores):
            f.write(json.dumps({"id": i, "score": round(float(s), 7)}) + "\n")
    print(f"scored {len(data)} prompts into {args.out}")
    return 0


def _evaluate(args: argparse.Namespace) -> int:
    import numpy as np

    from sobrio.gateway.router_data import read_labelled, read_scores
    from sobrio.gateway.router_report import plot_curves, print_block

    data = read_labelled(args.data)
    scores = (read_scores(args.scores, data.ids) if args.scores else _scores_of(data.prompts, args.weights))
    sources = sorted(set(data.sources))
    parts = [(s, np.array([x == s for x in data.sources])) for s in sources] if len(sources) > 1 else []
    for name, keep in [*parts, ("all", np.ones(len(data), dtype=bool))]:
        print_block(name, data.subset(keep), scores[keep], args.resamples)
    if args.plot:
        plot_curves(data, scores, Path(args.plot))
    return 0
