"""Hugging Face models in meshrun: step time vs a hand loop, and peak memory when loading weights.

1. Step time: meshrun's real `Trainer.train_step` (one process) on a small Llama vs the loop a
   user writes around the same transformers model: same pretrained weights (saved once with
   save_pretrained, loaded by both), batches, fp32/bf16, accumulation, AdamW + clipping +
   warmup/cosine lr. Turn-taking rounds and the median ratio as in overhead.py (reused).
   Target: <= 1.05x.
2. Memory: a larger Llama saved as safetensors; for each of the pp=4 stages, a fresh process
   materialises only that stage (meta build, keep its layers, read its tensors) while a thread
   samples the process's anonymous resident memory (RssAnon: tensors, not the file pages the
   kernel maps and may drop); peak growth vs the bytes of that stage's parameters.
   Target: <= 1.2x, never the whole model.

    python bench/hf.py                 # both parts (~2-4 minutes on 2 shared cores)
    python bench/hf.py --part memory
    python bench/hf.py --quick         # seconds: a 2-layer d16 Llama for both parts, pp=2
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from meshrun.config.schema import load_config

sys.path.insert(0, str(Path(__file__).parent))
import _quick
import overhead

STEP_TARGET, MEMORY_TARGET = 1.05, 1.2
SMALL = {
    "hidden_size": 128,
    "intermediate_size": 344,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 256,
}
LARGE = {
    "hidden_size": 512,
    "intermediate_size": 1376,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "vocab_size": 32000,
    "max_position_embeddings": 512,
}
TINY = {  # --quick's model for both parts
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "vocab_size": 256,
    "max_position_embeddings": 128,  # measure_stage reads with seq_len 128
}


def save_llama(fields: dict, out: Path) -> Path:
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(LlamaConfig(**fields, bos_token_id=0, eos_token_id=0)).save_pretrained(out)
    return out


class Logits(torch.nn.Module):
    """The transformers model as a plain `tokens -> logits` module for the hand loop."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=x).logits


def step_time(args: argparse.Namespace) -> int:
    from transformers import AutoModelForCausalLM

    from meshrun.data.prepare import prepare
    from meshrun.parallel.layout import Layout
    from meshrun.parallel.mesh import init_mesh, shutdown
    from meshrun.training.run import Run

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="meshrun-bench-hf-") as tmp_name:
        tmp = Path(tmp_name)
        model_dir = save_llama(TINY if args.quick else SMALL, tmp / "llama")
        data_dir = tmp / "data"
        corpus = (
            _quick.stdlib_text(quick=True) if args.quick else [str(Path(torch.__file__).parent / "nn/modules/*.py")]
        )
        prepare(corpus, data_dir)
        total = args.warmup + args.rounds * args.steps
        cfg = load_config(
            None,
            [
                f"model.hf={model_dir}",
                f"model.seq_len={args.seq_len}",
                f"precision={args.precision}",
                f"train.global_batch={args.global_batch}",
                f"train.micro_batch={args.micro_batch}",
                f"train.steps={total}",
                "train.eval_interval=0",
                f"train.log_interval={total}",
                "recompute=none",
                "parallel.dp=1",
                "parallel.pp=1",
                "tracker.mode=disabled",
                "checkpoint.at_end=false",
                f"data.dir={data_dir}",
                f"run_dir={tmp / 'run'}",
            ],
        )
        mesh = init_mesh(Layout())
        try:
            training = Run(cfg, mesh, data_dir)
            try:
                args.chunk, overhead.TARGET = None, STEP_TARGET
                hf = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa", dtype=torch.float32)
                hand = overhead.HandLoop(cfg, mesh.device, data_dir, model=Logits(hf))
                return overhead.run(args, cfg, training.trainer, hand, mesh.device)
            finally:
                training.close()
        finally:
            shutdown()


def rss_anon_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


def measure_stage(model_dir: str, stage: int, num_stages: int) -> dict:
    """In this (fresh) process: materialise one stage from the weights; peak RssAnon growth."""
    from meshrun.config.schema import validate
    from meshrun.models.families import build_model
    from meshrun.parallel.materialise import materialise_part
    from meshrun.parallel.stages import even_split

    cfg = validate({"model": {"hf": model_dir, "seq_len": 128}, "parallel": {"pp": num_stages, "dp": 1}})
    num_layers = json.loads(Path(model_dir, "config.json").read_text())["num_hidden_layers"]
    layers = even_split(num_layers, num_stages)[stage]
    build_model(cfg.model)  # imports transformers' modeling code before the baseline: code is not weights
    torch.nn.Linear(2, 2)(torch.zeros(1, 2))  # allocator warm-up
    baseline, peak, done = rss_anon_bytes(), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], rss_anon_bytes())
            time.sleep(0.0005)

    sampler = threading.Thread(target=sample)
    sampler.start()
    part = materialise_part(cfg, torch.device("cpu"), layers=layers, first=stage == 0, last=stage == num_stages - 1)
    done.set()
    sampler.join()
    peak[0] = max(peak[0], rss_anon_bytes())
    share = sum(p.numel() * p.element_size() for p in part.parameters())
    return {"stage": stage, "layers": layers, "share_mb": share / 2**20, "peak_growth_mb": (peak[0] - baseline) / 2**20}


def memory(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="meshrun-bench-hf-") as tmp_name:
        shape = TINY if args.quick else LARGE
        model_dir = save_llama(shape, Path(tmp_name) / "llama")
        whole = sum(f.stat().st_size for f in model_dir.glob("*.safetensors")) / 2**20
        print(
            f"Llama {shape['num_hidden_layers']}L d{shape['hidden_size']} vocab {shape['vocab_size']}: "
            f"{whole:.1f} MiB of fp32 safetensors; pp={args.pp}, one fresh process per stage\n"
        )
        print(f"{'stage':>5} {'layers':>14} {'share MiB':>10} {'peak MiB':>9} {'ratio':>6}")
        worst = 0.0
        for stage in range(args.pp):
            out = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--measure-stage",
                    str(stage),
                    "--pp",
                    str(args.pp),
                    "--model-dir",
                    str(model_dir),
                ],
                capture_output=True,
                text=True,
                check=True,
            )
            row = json.loads(out.stdout.strip().splitlines()[-1])
            ratio = row["peak_growth_mb"] / row["share_mb"]
            worst = max(worst, ratio)
            print(
                f"{stage:>5} {row['layers']!s:>14} {row['share_mb']:>10.1f} {row['peak_growth_mb']:>9.1f} {ratio:>6.2f}"
            )
    verdict = worst <= MEMORY_TARGET
    print(
        f"\n{'PASS' if verdict else 'FAIL'}: worst stage peak / its share {worst:.2f}x (target <= {MEMORY_TARGET}x; "
        f"whole model {whole:.1f} MiB)"
    )
    return _quick.exit_code(verdict, quick=args.quick)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=["all", "step", "memory"], default="all")
    p.add_argument("--precision", choices=list(overhead.DTYPES), default="fp32")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--pp", type=int, default=4)
    p.add_argument("--measure-stage", type=int, help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    tiny = {"steps": 2, "rounds": 1, "warmup": 1, "seq_len": 8, "global_batch": 4, "micro_batch": 2, "pp": 2}
    args = _quick.parse(p, tiny)
    if args.measure_stage is not None:
        print(json.dumps(measure_stage(args.model_dir, args.measure_stage, args.pp)))
        return 0
    codes = [step_time(args) if args.part in ("all", "step") else 0]
    if args.part in ("all", "memory"):
        print()
        codes.append(memory(args))
    return max(codes)


if __name__ == "__main__":
    sys.exit(main())
