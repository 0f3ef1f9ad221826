"""Pipeline benchmarks of issue 3, side by side in one run on this machine, printing ratios.

1. speed-up of pp=2 over pp=1 on the same global batch (m = 2, 4, 8 microbatches) vs the
   ideal 2m/(m+1), through the real CLI (`python -m meshrun train --set ...`);
2. 1F1B vs GPipe peak activation memory (bytes saved for backward, saved-tensor hooks inside
   meshrun's Trainer on every pipeline rank) vs the theoretical (p - rank)/m;
3. activation recompute: share of block activation bytes that full / selective recompute
   saves (one process, forward of the whole GPT);
4. meshrun pp=2 vs a minimal hand-written torch.distributed.pipelining script
   (bench/_handwritten_pipeline.py) of the same model, split, schedule and optimizer.

Timings on a shared, noisy CPU: sides alternate (A B, then B A, ...) for several rounds and
each verdict is the median of the per-round ratios. Every process runs with
OMP_NUM_THREADS=1, so pp=1 uses one core and pp=2 two.

    python bench/pipeline.py            # about 6-10 minutes on 2 cores
    python bench/pipeline.py --rounds 1 --log-interval 1 --windows 1   # about 2 minutes
    python bench/pipeline.py --quick    # seconds: a 2-layer d16 GPT, m=2 only, pp=2 m=2 memory only
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _quick  # bench/ is the script's folder: on sys.path

BENCH = Path(__file__).resolve().parent
TARGET_SPEEDUP = 0.90  # of the ideal 2m/(m+1), at m = 8
TARGET_RECOMPUTE = 0.895  # share of block activation bytes saved by full recompute
TARGET_OVERHEAD = 1.03  # meshrun step time / hand-written step time


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds for timings")
    p.add_argument(
        "--log-interval",
        type=int,
        default=2,
        help="steps per metrics window; the first window is warm-up and left out",
    )
    p.add_argument("--windows", type=int, default=2, help="timed windows per run")
    p.add_argument("--microbatches", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--timeout", type=float, default=300, help="seconds before a benchmark subprocess is killed")
    tiny = {"rounds": 1, "log_interval": 1, "windows": 1, "microbatches": [2], "layers": 2, "dim": 16, "heads": 2}
    return _quick.parse(p, {**tiny, "seq_len": 8})


def memory_model(args: argparse.Namespace) -> tuple[int, int, int, int]:
    """(layers, dim, heads, seq_len) of section 2's GPT: fixed, but under --quick the tiny model."""
    return (args.layers, args.dim, args.heads, args.seq_len) if args.quick else (8, 128, 4, 128)


def log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def bench_env() -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("WANDB_", "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_"))
    }
    env.update(
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        WANDB_MODE="disabled",
        PYTHONUNBUFFERED="1",
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
    )
    return env


def run(argv: list[str], *, timeout: float, cwd: Path) -> str:
    """Run argv in its own process group; kill the whole group on timeout or interrupt."""
    proc = subprocess.Popen(
        argv,
        cwd=cwd,
        env=bench_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException:  # timeout, Ctrl-C: leave no workers behind
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:6])} ... exited {proc.returncode}\n{err[-3000:]}")
    return out


def torchrun(nproc: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]


def read_json(folder: Path, pattern: str) -> list[dict]:
    return [json.loads(path.read_text()) for path in sorted(folder.glob(pattern))]


# --- 1 and 4: step times -------------------------------------------------------------------


class Runs:
    def __init__(self, args: argparse.Namespace, tmp: Path, data: Path) -> None:
        self.args, self.tmp, self.data, self.count = args, tmp, data, 0
        self.steps = args.log_interval * (args.windows + 1)

    def meshrun(self, pp: int, m: int) -> tuple[float, float | None]:
        """Mean step time of a `meshrun train` run over its windows after the first (warm-up), and
        its mean measured pipeline bubble over those windows (pp > 1)."""
        a = self.args
        self.count += 1
        run_dir = self.tmp / f"run{self.count}"
        settings = {
            "data.dir": self.data,
            "run_dir": run_dir,
            "parallel.dp": 1,
            "parallel.pp": pp,
            "parallel.schedule": "1f1b",
            "model.num_layers": a.layers,
            "model.dim": a.dim,
            "model.num_heads": a.heads,
            "model.seq_len": a.seq_len,
            "model.dropout": 0.0,
            "train.micro_batch": a.micro_batch,
            "train.global_batch": a.micro_batch * m,
            "train.steps": self.steps,
            "train.log_interval": a.log_interval,
            "train.eval_interval": 0,
            "precision": "fp32",
            "recompute": "none",
            "tracker.mode": "disabled",
            "checkpoint.at_end": "false",
        }
        run(
            [sys.executable, "-m", "meshrun", "train", *(f"--set={k}={v}" for k, v in settings.items())],
            timeout=a.timeout,
            cwd=self.tmp,
        )
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        timed = [row for row in rows if "step_time_s" in row][1:]
        bubble = statistics.fmean(row["bubble"] for row in timed) if pp > 1 else None
        return statistics.fmean(row["step_time_s"] for row in timed), bubble

    def handwritten(self, m: int) -> float:
        """Mean step time (rank 0) of the hand-written script over the same steps meshrun times."""
        a = self.args
        self.count += 1
        out = self.tmp / f"hand{self.count}"
        out.mkdir()
        run(
            [
                *torchrun(2),
                str(BENCH / "_handwritten_pipeline.py"),
                f"--data={self.data}",
                f"--out={out}",
                f"--microbatches={m}",
                f"--steps={self.steps}",
                f"--layers={a.layers}",
                f"--dim={a.dim}",
                f"--heads={a.heads}",
                f"--seq-len={a.seq_len}",
                f"--micro-batch={a.micro_batch}",
            ],
            timeout=a.timeout,
            cwd=self.tmp,
        )
        times = next(r for r in read_json(out, "rank*.json") if r["rank"] == 0)["step_times"]
        return statistics.fmean(times[a.log_interval :])


def time_pipelines(args: argparse.Namespace, runs: Runs) -> tuple[dict, list[tuple[float, float]]]:
    """Rounds of adjacent (pp1, pp2) pairs per m, and at the largest m the hand-written run next to
    meshrun's pp2 run: pp1, pp2, hand-written; odd rounds reverse the order."""
    times: dict[int, list[tuple[float, float]]] = {m: [] for m in args.microbatches}
    bubbles: dict[int, list[float]] = {m: [] for m in args.microbatches}
    versus: list[tuple[float, float]] = []
    m_hand = max(args.microbatches)
    for r in range(args.rounds):
        flip = r % 2 == 1
        for m in args.microbatches:
            hand = m == m_hand  # meshrun's pp2 run doubles as its side against the hand-written script
            if flip:
                th = runs.handwritten(m) if hand else None
                t2, bubble = runs.meshrun(2, m)
                t1, _ = runs.meshrun(1, m)
            else:
                t1, _ = runs.meshrun(1, m)
                t2, bubble = runs.meshrun(2, m)
                th = runs.handwritten(m) if hand else None
            times[m].append((t1, t2))
            bubbles[m].append(bubble)
            log(f"round {r + 1}/{args.rounds} m={m}: pp1 {t1:.3f} s/step, pp2 {t2:.3f} s/step")
            if th is not None:
                versus.append((t2, th))
                log(f"round {r + 1}/{args.rounds} m={m}: hand-written pp2 {th:.3f} s/step")
    return times, bubbles, versus


# --- 2: 1F1B vs GPipe memory ---------------------------------------------------------------


def pipeline_memory(args: argparse.Namespace, tmp: Path, data: Path, layouts: list[tuple[int, int]]) -> list[dict]:
    results = []
    for pp, m in layouts:
        for schedule in ("gpipe", "1f1b"):
            run_dir = tmp / f"mem-{schedule}-{pp}-{m}"
            run(
                [
                    *torchrun(pp),
                    str(BENCH / "_pipeline_memory.py"),
                    f"--data={data}",
                    f"--run-dir={run_dir}",
                    f"--schedule={schedule}",
                    f"--microbatches={m}",
                    *(f"--{k}={v}" for k, v in zip(("layers", "dim", "heads", "seq-len"), memory_model(args))),
                ],
                timeout=args.timeout,
                cwd=tmp,
            )
            results += read_json(run_dir, "memory-rank*.json")
            log(f"memory: pp={pp} m={m} {schedule} done")
    return results


# --- 3: recompute ---------------------------------------------------------------------------


def recompute_bytes(args: argparse.Namespace, data: Path) -> dict[str, dict[str, int]]:
    """Block activation bytes kept for backward after one forward of the whole GPT, per policy.

    Counted by saved-tensor hooks while inside a Transformer block, plus what checkpointing keeps
    outside autograd's saved tensors: each checkpointed block's input (non-reentrant
    torch.utils.checkpoint holds it for the recompute) and, for selective, the matmul and
    attention outputs its policy caches.
    """
    import torch

    from meshrun.config.schema import load_config
    from meshrun.data.dataset import TokenDataset

    torch.set_num_threads(1)
    b = 2 * args.micro_batch
    x, _ = TokenDataset(data, "train", seq_len=args.seq_len, seed=0).batch(0, b)
    results = {}
    for policy in ("none", "full", "selective"):
        cfg = load_config(
            None,
            [
                f"model.num_layers={args.layers}",
                f"model.dim={args.dim}",
                f"model.num_heads={args.heads}",
                f"model.seq_len={args.seq_len}",
                "model.dropout=0.0",
                "parallel.dp=1",
                "parallel.pp=1",
                f"recompute={policy}",
                "precision=fp32",
            ],
        )
        results[policy] = _block_bytes_one_forward(cfg, policy, x)
    return results


def _block_bytes_one_forward(cfg, policy: str, x) -> dict[str, int]:
    """One forward of the whole GPT under `policy`; what recompute_bytes reports for that policy."""
    import torch
    from torch.utils._pytree import tree_leaves

    sys.path.insert(0, str(BENCH))
    from _saved_bytes import SavedBytes

    import meshrun.parallel.recompute as recompute_module
    from meshrun.parallel.materialise import materialise_part

    caches: list = []  # selective checkpoint contexts: their caching mode holds the saved op outputs
    original = recompute_module.create_selective_checkpoint_contexts

    def recording(*a, **kw):
        contexts = original(*a, **kw)
        caches.append(contexts[0])
        return contexts

    recompute_module.create_selective_checkpoint_contexts = recording
    try:
        model = materialise_part(cfg, torch.device("cpu"), layers=None, first=True, last=True)
        counter = SavedBytes(exclude=list(model.parameters()))
        counter.active = False
        inputs_held = []

        def enter(module, inputs):
            counter.active = True
            if policy != "none":  # the checkpoint's input, kept alive by its recompute closure
                inputs_held.extend(counter.hold(t) for t in inputs if isinstance(t, torch.Tensor))

        def leave(module, inputs, output):
            counter.active = False

        for block in model.blocks.values():
            block.register_forward_pre_hook(enter)
            block.register_forward_hook(leave)
        with counter.hooks():
            logits = model(x)
            cached = [
                counter.hold(leaf.val if hasattr(leaf, "val") else leaf)
                for cache in caches
                for leaf in tree_leaves(dict(cache.storage))
                if isinstance(getattr(leaf, "val", leaf), torch.Tensor)
            ]
        result = {"block_bytes": counter.live, "cached": len(cached), "blocks": len(model.blocks)}
        del logits, cached  # alive until measured: the graph holds the saved tensors
        return result
    finally:
        recompute_module.create_selective_checkpoint_contexts = original


# --- report ---------------------------------------------------------------------------------


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def report(
    args: argparse.Namespace,
    times: dict,
    bubbles: dict,
    versus: list,
    memory: list[dict],
    recompute: dict,
    load: tuple[tuple, tuple],
    elapsed: float,
) -> list[str]:
    out: list[str] = []
    say = out.append
    a = args
    say("meshrun pipeline benchmark (bench/pipeline.py)" + (" --quick" if a.quick else ""))
    say(
        f"machine: {os.cpu_count()} CPU cores, torch threads per process 1 (OMP_NUM_THREADS=1); "
        f"load average {load[0][0]:.1f} at start, {load[1][0]:.1f} at end (shared machine)"
    )
    say(
        f"model: GPT {a.layers} layers, dim {a.dim}, {a.heads} heads, seq_len {a.seq_len}, fp32, micro batch {a.micro_batch}"
    )
    say(
        f"timings: {a.rounds} alternating round(s); each run {a.log_interval * (a.windows + 1)} steps, "
        f"the first {a.log_interval} (warm-up) left out; verdicts use the median of per-round ratios"
    )
    verdicts = []

    say("")
    say("1. pp=2 vs pp=1 (1F1B, same global batch = m x micro batch), via `python -m meshrun train`")
    say("   ideal speed-up 2m/(m+1) assumes each of the 2 stages has a core of its own and free p2p;")
    say("   pp=1 is one process on one core, pp=2 two processes on the machine's 2 cores.")
    say("   bubble: pp=2 idle share measured by meshrun (rank mean) vs the 1F1B theory (p-1)/(m+p-1).")
    say(
        f"   {'m':>3} {'pp1 s/step':>11} {'pp2 s/step':>11} {'speed-up':>9} {'ideal':>6} {'% ideal':>8} "
        f"{'bubble':>7} {'theory':>7}  per-round speed-ups"
    )
    for m, pairs in times.items():
        ratios = [t1 / t2 for t1, t2 in pairs]
        speedup, ideal = statistics.median(ratios), 2 * m / (m + 1)
        t1, t2 = statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs)
        bubble = statistics.median(bubbles[m])
        say(
            f"   {m:>3} {t1:>11.3f} {t2:>11.3f} {speedup:>9.2f} {ideal:>6.2f} {speedup / ideal:>8.1%} "
            f"{bubble:>7.1%} {1 / (m + 1):>7.1%}  " + " ".join(f"{r:.2f}" for r in ratios)
        )
    m_top = max(times)
    share = statistics.median(t1 / t2 for t1, t2 in times[m_top]) / (2 * m_top / (m_top + 1))
    ok = share >= TARGET_SPEEDUP
    verdicts.append(ok)
    say(f"   target: >= {TARGET_SPEEDUP:.0%} of ideal at m={m_top}: {share:.1%} -> {verdict(ok)}")

    say("")
    say("2. 1F1B vs GPipe: peak bytes saved for backward per pipeline rank (saved-tensor hooks in meshrun's Trainer,")
    layers, dim, _, seq_len = memory_model(a)
    say(
        f"   each storage once, parameters left out; GPT {layers} layers, dim {dim}, seq_len {seq_len}, micro batch 1, fp32)."
    )
    say("   'held' = bytes still saved when the step starts: on stage 0 torch.distributed.pipelining's first-step")
    say("   shape inference keeps one forward graph alive for the whole run, the same under both schedules;")
    say("   'per step' = peak - held. Theory: 1F1B holds (p - rank) microbatches in flight, GPipe all m.")
    say(
        f"   {'pp':>3} {'m':>3} {'rank':>4} {'gpipe MB':>9} {'1f1b MB':>8} {'held MB':>8} {'ratio':>6} "
        f"{'ratio/step':>10} {'theory':>7}"
    )
    stage0_ok = []
    for pp, m in sorted({(r["pp"], r["microbatches"]) for r in memory}):
        for rank in range(pp):
            row = {r["schedule"]: r for r in memory if (r["pp"], r["microbatches"], r["pp_rank"]) == (pp, m, rank)}
            g, f = row["gpipe"]["peaks"][-1], row["1f1b"]["peaks"][-1]
            held = row["1f1b"]["live_after"]
            ratio, per_step = f / g, (f - held) / (g - row["gpipe"]["live_after"])
            theory = min(pp - rank, m) / m
            say(
                f"   {pp:>3} {m:>3} {rank:>4} {g / 1e6:>9.2f} {f / 1e6:>8.2f} {held / 1e6:>8.2f} {ratio:>6.3f} "
                f"{per_step:>10.3f} {theory:>7.3f}"
            )
            if rank == 0:
                stage0_ok.append(abs(per_step - theory) <= 0.1 * theory)
    say(
        f"   stage 0 per-step ratio within 10% of p/m in every row: {'yes' if all(stage0_ok) else 'no'} (no target set)"
    )

    say("")
    say(
        f"3. activation recompute: block activation bytes kept after one forward (batch {2 * a.micro_batch}, "
        f"{recompute['none']['blocks']} blocks, model of section 1)"
    )
    say("   counted with saved-tensor hooks inside blocks, plus what checkpointing keeps outside them: every")
    say(
        "   checkpointed block's input (non-reentrant checkpoint) and, for selective, the cached matmul/attention outputs."
    )
    base = recompute["none"]["block_bytes"]
    say(f"   {'policy':>10} {'MB kept':>8} {'saved':>7}")
    for policy, row in recompute.items():
        say(f"   {policy:>10} {row['block_bytes'] / 1e6:>8.2f} {1 - row['block_bytes'] / base:>7.1%}")
    saved = 1 - recompute["full"]["block_bytes"] / base
    ok = saved >= TARGET_RECOMPUTE
    verdicts.append(ok)
    say(f"   target: full recompute saves >= {TARGET_RECOMPUTE:.1%} (2BSH of 19BSH): {saved:.1%} -> {verdict(ok)}")

    say("")
    say(f"4. meshrun pp=2 vs hand-written torch.distributed.pipelining (bench/_handwritten_pipeline.py), m={m_top}:")
    say("   same GPT, even split, Schedule1F1B, AdamW + global-norm clipping, fp32; rounds alternate the order")
    ratios = [tm / th for tm, th in versus]
    say(
        f"   meshrun {statistics.median(t for t, _ in versus):.3f} s/step, hand-written "
        f"{statistics.median(t for _, t in versus):.3f} s/step; per-round ratios "
        + " ".join(f"{r:.3f}" for r in ratios)
    )
    ratio = statistics.median(ratios)
    ok = ratio <= TARGET_OVERHEAD
    verdicts.append(ok)
    say(f"   target: meshrun / hand-written <= {TARGET_OVERHEAD:.2f}: {ratio:.3f} -> {verdict(ok)}")

    say("")
    say(f"summary: {sum(verdicts)}/{len(verdicts)} targets met; benchmark took {elapsed / 60:.1f} min")
    return out


def main() -> int:
    args = parse_args()
    start, load_start = time.perf_counter(), os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="meshrun-pipeline-bench-") as name:
        tmp = Path(name)
        data = tmp / "data"
        from meshrun.data.prepare import prepare

        prepare(_quick.stdlib_text(quick=args.quick), data)  # --quick: the a*.py few
        log("section 3: recompute (one process)")
        recompute = recompute_bytes(args, data)
        log("section 2: 1F1B vs GPipe memory (torchrun workers)")
        layouts = [(2, 2)] if args.quick else [(2, 4), (2, 8), (4, 8)]
        memory = pipeline_memory(args, tmp, data, layouts)
        log("sections 1 and 4: step times (alternating runs)")
        times, bubbles, versus = time_pipelines(args, Runs(args, tmp, data))
        lines = report(
            args, times, bubbles, versus, memory, recompute, (load_start, os.getloadavg()), time.perf_counter() - start
        )
    print("\n".join(lines))
    return _quick.exit_code(True, quick=args.quick)


if __name__ == "__main__":
    sys.exit(main())
