"""Data pipeline numbers (issue 11), each measured side by side in one run.

1. Tokenization throughput: `meshrun prepare-data --workers CORES` vs the raw `tokenizers` loop
   (`encode_batch_fast` over ~1 MB batches, its own threads on all cores) on the same files with
   the same tokenizer (a byte-level BPE trained here on the corpus). Target: >= 0.9x.
2. Peak RSS of `meshrun prepare-data` (a subprocess, default byte tokenizer) on the default
   corpus and on a corpus 10x larger (the same files, copied 10 times): the bound must not grow.
3. Batch assembly: `TokenDataset.batch` (and a two-source mixture) for one rank's share of the
   default job's global batch, vs the default job's measured step time. Target: <= 2%.

    python bench/data.py                 # ~2-4 minutes on 2 shared cores
    python bench/data.py --rounds 5 --skip-rss
    python bench/data.py --quick         # seconds: a few files, one round, a tiny one-process job
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _quick  # bench/ is the script's folder: on sys.path

from meshrun.config.schema import load_config
from meshrun.data.dataset import MixtureDataset, TokenDataset
from meshrun.data.prepare import TASK_BYTES, prepare
from meshrun.data.sources import default_sources, expand_sources

THROUGHPUT_TARGET, ASSEMBLY_TARGET = 0.9, 0.02
# --quick's stand-in for the default job whose step time batch assembly is compared with
TINY_JOB = ["model.num_layers=1", "model.dim=16", "model.num_heads=2", "model.seq_len=8", "parallel.dp=1"]
TINY_JOB += ["parallel.pp=1", "train.global_batch=2", "train.micro_batch=1", "train.steps=4", "train.log_interval=2"]


def train_tokenizer(files: list[Path], out: Path, vocab: int) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<|endoftext|>"],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator((f.read_text(errors="replace") for f in files[::4]), trainer=trainer)
    tok.save(str(out))
    return out


def raw_tokenizers(files: list[Path], tokenizer: Path) -> float:
    """The loop a user would write: read, batch ~1 MB of documents, encode_batch_fast. Seconds."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer))
    start = time.perf_counter()
    batch, size, count = [], 0, 0
    for f in files:
        batch.append(f.read_bytes().decode("utf-8", errors="replace"))
        size += len(batch[-1])
        if size >= TASK_BYTES:
            count += sum(len(e.ids) for e in tok.encode_batch_fast(batch, add_special_tokens=False))
            batch, size = [], 0
    count += sum(len(e.ids) for e in tok.encode_batch_fast(batch, add_special_tokens=False))
    return time.perf_counter() - start


def meshrun_prepare(sources: list[str], tokenizer: Path, out: Path, workers: int) -> float:
    start = time.perf_counter()
    prepare(sources, out, tokenizer=str(tokenizer), workers=workers, progress=False)
    seconds = time.perf_counter() - start
    shutil.rmtree(out)
    return seconds


def throughput(tmp: Path, sources: list[str], rounds: int, workers: int, *, vocab: int) -> None:
    files = expand_sources(sources)
    megabytes = sum(f.stat().st_size for f in files) / 1e6
    tokenizer = train_tokenizer(files, tmp / "tokenizer.json", vocab=vocab)
    ratios = []
    for r in range(rounds):  # alternate who goes first
        order = [
            ("raw", lambda: raw_tokenizers(files, tokenizer)),
            ("meshrun", lambda: meshrun_prepare(sources, tokenizer, tmp / "out", workers)),
        ]
        times = {name: fn() for name, fn in (order if r % 2 == 0 else order[::-1])}
        ratios.append(times["raw"] / times["meshrun"])
        print(
            f"  round {r + 1}: raw tokenizers {megabytes / times['raw']:.2f} MB/s, "
            f"prepare-data {megabytes / times['meshrun']:.2f} MB/s, ratio {ratios[-1]:.3f}"
        )
    median = statistics.median(ratios)
    verdict = "PASS" if median >= THROUGHPUT_TARGET else "FAIL"
    print(
        f"tokenization: {megabytes:.1f} MB, {workers} workers: prepare-data / raw = {median:.3f}x "
        f"(target >= {THROUGHPUT_TARGET}) {verdict}"
    )


def peak_rss_mb(sources: list[str], out: Path) -> float:
    """Peak RSS of a `meshrun prepare-data` process, in MB, read by /usr/bin/time (a small parent:
    ru_maxrss of a child forked from this large bench process would count our pages too)."""
    args = [
        "/usr/bin/time",
        "-f",
        "%M",
        sys.executable,
        "-m",
        "meshrun",
        "prepare-data",
        "--out",
        str(out),
        *(f"--source={s}" for s in sources),
    ]
    result = subprocess.run(args, capture_output=True, text=True, check=True)
    shutil.rmtree(out)
    return int(result.stderr.split()[-1]) / 1024


def rss(tmp: Path, sources: list[str], copies: int) -> None:
    files = expand_sources(sources)
    root = Path(os.path.commonpath([f.parent for f in files]))
    big = tmp / "x10"
    for copy in range(copies):
        for f in files:
            dest = big / str(copy) / f.relative_to(root)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f, dest)
    size = sum(f.stat().st_size for f in files) / 1e6
    small, large = peak_rss_mb(sources, tmp / "o1"), peak_rss_mb([str(big)], tmp / "o10")
    largest = max(f.stat().st_size for f in files) / 1e6
    print(
        f"peak RSS: {size:.1f} MB corpus {small:.0f} MB, {copies * size:.1f} MB corpus {large:.0f} MB "
        f"(largest file {largest:.1f} MB); growth {large / small:.2f}x"
    )


def assembly(tmp: Path, sources: list[str], rounds: int, *, steps: int, job: list[str]) -> None:
    """Batch assembly per step vs the step time of `job` (settings over the default job's)."""
    cfg = load_config(None, job)
    data = tmp / "stdlib"
    prepare(sources, data, progress=False)
    seq, per_rank = cfg.model.seq_len, cfg.train.global_batch // cfg.parallel.dp
    single = TokenDataset(data, "train", seq_len=seq, seed=1)
    mixture = MixtureDataset([single, TokenDataset(data, "train", seq_len=seq, seed=2)], [0.7, 0.3], ["a", "b"])
    assembly_s = {}
    for name, ds in (("one dataset", single), ("mixture of 2", mixture)):
        times = []
        for _ in range(rounds):
            start = time.perf_counter()
            for step in range(steps):
                ds.batch(step * cfg.train.global_batch, per_rank)
            times.append((time.perf_counter() - start) / steps)
        assembly_s[name] = statistics.median(times)
    step = default_job_step_time(tmp, job)
    for name, seconds in assembly_s.items():
        verdict = "PASS" if seconds / step <= ASSEMBLY_TARGET else "FAIL"
        print(
            f"batch assembly ({name}, {per_rank} x {seq} tokens per rank): {seconds * 1e6:.0f} us/step = "
            f"{seconds / step:.3%} of the {'tiny' if job else 'default'} job's {step * 1e3:.0f} ms step (target <= 2%) {verdict}"
        )


def default_job_step_time(tmp: Path, job: list[str]) -> float:
    """Median step_time_s of a short default job (dp2 x pp2, bf16, recompute; `job` changes it),
    after its first window."""
    import json

    run = tmp / "run"
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp / "cache"), "WANDB_MODE": "disabled"}
    subprocess.run(
        [
            sys.executable,
            "-m",
            "meshrun",
            "train",
            f"--set=run_dir={run}",
            "--set=train.steps=30",
            "--set=train.log_interval=10",
            "--set=train.eval_interval=0",
            f"--set=data.dir={tmp / 'stdlib'}",
            *(f"--set={setting}" for setting in job),
        ],
        env=env,
        check=True,
        capture_output=True,
    )
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(r["step_time_s"] for r in rows[1:] if "step_time_s" in r)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--skip-rss", action="store_true")
    args = _quick.parse(parser, {"rounds": 1, "workers": 1})
    sources = _quick.stdlib_text(quick=True) if args.quick else default_sources()
    print(f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}")
    with tempfile.TemporaryDirectory() as tmp:
        throughput(Path(tmp), sources, args.rounds, args.workers, vocab=300 if args.quick else 8192)
        if not args.skip_rss:
            rss(Path(tmp), sources, copies=2 if args.quick else 10)
        job = TINY_JOB if args.quick else []
        assembly(Path(tmp), sources, args.rounds, steps=5 if args.quick else 200, job=job)
    print(f"bench peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB")
    return _quick.exit_code(True, quick=args.quick)


if __name__ == "__main__":
    sys.exit(main())
