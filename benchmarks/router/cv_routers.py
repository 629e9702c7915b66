"""Subject-grouped cross-validation of the routers tried for model "auto" (docs/router.md's table): 5 folds
of whole subjects (GSM8K one more subject), out-of-fold scores, RouteLLM's metrics on the MMLU rows and on
GSM8K. Needs the shared labels (../shared/data/router/train.jsonl beside the clone).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/router/cv_routers.py [--data FILE] \
        [--sentence-embeddings /tmp/minilm.npy]
"""

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from sobrio.gateway import router  # noqa: E402
from sobrio.gateway.router_cv import group_folds  # noqa: E402
from sobrio.gateway.router_data import read_labelled  # noqa: E402
from sobrio.gateway.router_features import LENGTH_COLUMN, PromptFeatures  # noqa: E402
from sobrio.gateway.router_metrics import metrics  # noqa: E402

DEFAULT = Path(__file__).resolve().parents[3] / "shared" / "data" / "router" / "train.jsonl"


def word_embedding_means(prompts: list[str]) -> np.ndarray:
    """MiniLM's input word embeddings averaged over each prompt's tokens, unit length (no transformer)."""
    from safetensors import safe_open

    from sobrio.loader.resolve import resolve_model

    folder = resolve_model("all-minilm-l6-v2").path
    with safe_open(str(folder / "model.safetensors"), "np") as f:
        table = f.get_tensor("embeddings.word_embeddings.weight")
    rows = [table[e.ids].mean(0) if e.ids else np.zeros(table.shape[1])
            for e in PromptFeatures().tokenizer.encode_batch(prompts, add_special_tokens=False)]
    x = np.array(rows, dtype=np.float32)
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-6)


def sentence_embeddings(prompts: list[str], cache: Path) -> np.ndarray:
    """all-MiniLM-L6-v2's sentence embeddings (sentence-transformers, the reference), cached in a .npy file."""
    if cache.is_file():
        return np.load(cache)
    from sentence_transformers import SentenceTransformer

    from sobrio.loader.resolve import resolve_model

    model = SentenceTransformer(str(resolve_model("all-minilm-l6-v2").path), device="cpu")
    x = model.encode(prompts, batch_size=64, normalize_embeddings=True, convert_to_numpy=True).astype(np.float32)
    np.save(cache, x)
    return x


def logistic(x: np.ndarray, y: np.ndarray, l2: float) -> np.ndarray:
    """Logistic regression on soft targets (L-BFGS, L2); the weights, bias last."""
    import torch

    xt = torch.from_numpy(np.c_[x, np.ones(len(x))].astype(np.float32))
    t = torch.from_numpy(y.astype(np.float32))
    w = torch.zeros(xt.shape[1], requires_grad=True)
    opt = torch.optim.LBFGS([w], max_iter=300, line_search_fn="strong_wolfe")

    def loss_fn():
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(xt @ w, t) + l2 * w[:-1].square().sum()
        loss.backward()
        return loss

    opt.step(loss_fn)
    return w.detach().numpy()


def rank(x: np.ndarray) -> np.ndarray:
    return np.argsort(np.argsort(x)) / len(x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=str(DEFAULT))
    parser.add_argument("--sentence-embeddings", default=None, help="a .npy cache of the full MiniLM sentence "
                        "embeddings of the data's prompts, written if missing (35 minutes on 2 busy cores): "
                        "adds the routers on them")
    args = parser.parse_args()
    data = read_labelled(args.data)
    form = PromptFeatures().features(data.prompts)
    words = np.c_[word_embedding_means(data.prompts), form[:, [LENGTH_COLUMN, 3, 4]]]
    s, w = data.strong, data.weak
    folds = group_folds(data.subjects, 5)
    mmlu = np.array([x == "mmlu" for x in data.sources])

    def out_of_fold(fit) -> np.ndarray:
        scores = np.zeros(len(data))
        for test in folds:
            scores[test] = fit(~test, test)
        return scores

    def lr(x, target, l2):
        def fit(tr, te):
            mu, sd = x[tr].mean(0), np.maximum(x[tr].std(0), 1e-6)
            coef = logistic((x[tr] - mu) / sd, target[tr], l2)
            return ((x[te] - mu) / sd) @ coef[:-1] + coef[-1]
        return out_of_fold(fit)

    def within(x, l2):
        def fit(tr, te):
            mu, sd = x[tr].mean(0), np.maximum(x[tr].std(0), 1e-6)
            subjects = [g for g, keep in zip(data.subjects, tr) if keep]
            return ((x[te] - mu) / sd) @ router.fit_within_subjects((x[tr] - mu) / sd, (s - w)[tr], subjects, l2)
        return out_of_fold(fit)

    soft = (s - w + 1) / 2
    length = np.array([len(p) for p in data.prompts], dtype=float)
    emb_lr = lr(words, soft, 1e-2)
    form_within = within(form, router.L2)
    table = {
        "prompt length": length,
        "LR, word-embedding mean + length/MC/digits, target (s-w+1)/2": emb_lr,
        "LR, same, target strong-only": lr(words, (s > w).astype(float), 1e-2),
        "LR, same, target weak-wrong": lr(words, 1 - w, 1e-2),
        "LR, 15 form features": lr(form, soft, 1e-2),
        "rank(length) + 0.3 rank(LR word embedding)": rank(length) + 0.3 * rank(emb_lr),
        "within-subject ridge, word embedding + form": within(np.c_[words, form], 1.0),
        "within-subject ridge, 15 form features": form_within,
        "rank(length) + rank(within-subject form)": rank(length) + rank(form_within),
    }
    if args.sentence_embeddings:
        sentences = np.c_[sentence_embeddings(data.prompts, Path(args.sentence_embeddings)),
                          form[:, [LENGTH_COLUMN, 3, 4]]]
        table["LR, full MiniLM sentence embedding + length/MC/digits"] = sentence_lr = lr(sentences, soft, 1e-2)
        table["rank(length) + rank(that)"] = rank(length) + rank(sentence_lr)
        table["within-subject ridge, full MiniLM sentence embedding"] = sentence_within = within(sentences, 1.0)
        table["rank(length) + rank(that) "] = rank(length) + rank(sentence_within)
    print(f"{'router':62s}{'MMLU APGR':>10s}{'CPT50':>8s}{'CPT80':>8s}{'PGR@30':>8s}{'GSM8K APGR':>11s}")
    for name, scores in table.items():
        a, g = metrics(scores[mmlu], s[mmlu], w[mmlu]), metrics(scores[~mmlu], s[~mmlu], w[~mmlu])
        print(f"{name:62s}{a['apgr']:10.3f}{a['cpt50']:8.1%}{a['cpt80']:8.1%}{a['pgr30']:8.3f}{g['apgr']:11.3f}")


if __name__ == "__main__":
    main()
