"""Per-layer format search (`mixprec.search`) on two models, reports committed under
benchmarks/results/:

- ``charlm``: examples/charlm.py's model trained ``--train-steps`` steps in bf16-mixed, then
  searched on training batches and verified on held-out ones (the last 10% of the text);
- ``gpt2``: a Hugging Face GPT-2 small config (124M parameters, random weights, nothing
  downloaded), searched and verified on byte sequences of the same text as token ids.

For each model and each ``--memory`` budget the report (search_<model>_<budget>.md and .json)
holds the plan, every uniform plan measured beside it, the per-layer choices and the time the
search took; the plan is also trained ``--plan-steps`` steps beside the baseline.

    PYTHONPATH=src python benchmarks/search.py --model charlm --memory 0.5,0.3
    PYTHONPATH=src python benchmarks/search.py --model gpt2 --memory 0.5
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

from charlm import CharGPT, charlm_loaders  # noqa: E402

from mixprec.plan import search  # noqa: E402
from mixprec.trainer import Trainer  # noqa: E402

BLOCK = 128


def charlm(args: argparse.Namespace) -> tuple[torch.nn.Module, list, list, object]:
    """The char LM trained `--train-steps` steps (cached in `--cache`), with search and
    held-out batches and the training loader."""
    torch.manual_seed(0)
    train, val = charlm_loaders(BLOCK, args.batch_size)
    model = CharGPT(block=BLOCK, dim=256, steps=args.train_steps)
    cache = Path(args.cache) / f"charlm_{args.train_steps}.pt"
    if cache.exists():
        model.load_state_dict(torch.load(cache, weights_only=True))
    else:
        Trainer(
            precision="bf16-mixed",
            max_steps=args.train_steps,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            seed=0,
        ).fit(model, train)
        cache.parent.mkdir(parents=True, exist_ok=True)
        torch.save(model.state_dict(), cache)
    batches = [b for _, b in zip(range(args.batches), train, strict=False)]
    held_out = [b for _, b in zip(range(args.eval_batches), val, strict=False)]
    return model.eval(), batches, held_out, train


def gpt2(args: argparse.Namespace) -> tuple[torch.nn.Module, list, list, object]:
    """GPT-2 small with random weights; batches of text bytes as token ids, and the
    training batches."""
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging

    logging.set_verbosity_error()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config()).eval()
    train, val = charlm_loaders(BLOCK, args.batch_size)

    def as_ids(batch: tuple) -> dict:
        ids = batch[0].long()
        return {"input_ids": ids, "labels": ids}

    batches = [as_ids(b) for _, b in zip(range(args.batches), train, strict=False)]
    held_out = [as_ids(b) for _, b in zip(range(args.eval_batches), val, strict=False)]
    return model, batches, held_out, map(as_ids, train)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", choices=("charlm", "gpt2"), required=True)
    p.add_argument("--memory", default="0.5", help="comma-separated budgets (fractions)")
    p.add_argument("--train-steps", type=int, default=300, help="char LM training steps")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--batches", type=int, default=2, help="search batches")
    p.add_argument("--eval-batches", type=int, default=8, help="held-out batches")
    p.add_argument("--plan-steps", type=int, default=0, help="train the plan this many steps")
    p.add_argument("--lr", type=float, default=3e-4, help="the training run's learning rate")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--cache", default="runs/search-cache", help="trained char LM weights")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = p.parse_args()
    warnings.filterwarnings("ignore", message=".*bf16.*")
    model, batches, held_out, loader = (charlm if args.model == "charlm" else gpt2)(args)
    # the training run's batches: fresh ones, one per step
    fresh = [b for _, b in zip(range(args.plan_steps), loader, strict=False)]
    command = "PYTHONPATH=src python benchmarks/search.py " + shlex.join(sys.argv[1:])
    for budget in (float(b) for b in args.memory.split(",")):
        start = time.perf_counter()
        report = search(
            model,
            batches,
            budget={"memory": budget},
            eval_batches=held_out,
            train_steps=args.plan_steps,
            train_batches=fresh or None,
            lr=args.lr,
            reps=args.reps,
        )
        print(f"\n{args.model}, memory {budget:g}: {time.perf_counter() - start:.1f} s")
        print(report)
        out = Path(args.out)
        stem = f"search_{args.model}_{budget:g}"
        title = f"Format search: {args.model}, memory {budget:g}x bf16-mixed's bytes"
        (out / f"{stem}.md").write_text(report.to_markdown(command, title))
        (out / f"{stem}.json").write_text(json.dumps(report.to_dict(), indent=2) + "\n")
        report.policy.save(out / f"{stem}.policy.json")


if __name__ == "__main__":
    main()
