"""The `meshrun` argument parser: every subcommand and its flags, with their help."""

from __future__ import annotations

import argparse


def build_parser() -> argparse.ArgumentParser:
    """Every subcommand and flag of `meshrun` (checked further in cli/arguments.py, before torch)."""
    parser = argparse.ArgumentParser(prog="meshrun", description="dp x tp x pp Transformer training.")
    parser.add_argument("--version", action="version", version=f"meshrun {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="run a training job (starts torchrun itself when needed)")
    _config_arguments(train, set_help="override a config key, e.g. --set train.lr=3e-4 (repeatable)")
    train.add_argument("--dry-run", action="store_true", help="validate and print the plan, start nothing")
    nodes = train.add_argument_group("multi-node (each flag sets the launch.* key of the same name)")
    nodes.add_argument("--nnodes", type=int, help="nodes in the job; run the same command on each")
    nodes.add_argument("--nproc-per-node", type=int, help="workers per node (default dp x tp x pp / nnodes)")
    nodes.add_argument("--rdzv-endpoint", metavar="HOST[:PORT]", help="c10d rendezvous on the host node")
    nodes.add_argument("--rdzv-id", help="job id shared by all nodes (e.g. $SLURM_JOB_ID)")
    nodes.add_argument("--local-addr", help="this node's address as the other nodes reach it")
    nodes.add_argument(
        "--host-node",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="this node hosts the rendezvous store (default: guessed from --rdzv-endpoint)",
    )
    nodes.add_argument("--max-restarts", type=int, help="torchrun restarts of the worker group after a failure")
    nodes.add_argument(
        "--node-rank",
        type=int,
        help="this node's index in the job, e.g. $JOB_COMPLETION_INDEX on Kubernetes: node 0 hosts the rendezvous "
        "(--host-node), the others do not",
    )
    nodes.add_argument(
        "--rdzv-timeout", type=int, metavar="SECONDS", help="give up waiting for the other nodes after this (600)"
    )
    slurm = sub.add_parser("slurm", help="write (or submit) the sbatch script that trains a config on Slurm")
    _config_arguments(slurm, set_help="override a config key (repeatable); passed on to the job")
    slurm.add_argument("--nodes", type=int, required=True, help="nodes; the dp x tp x pp workers are split over them")
    slurm.add_argument(
        "--gpus-per-node", type=int, required=True, help="GPUs (= workers) per node; 0 for CPU-only nodes"
    )
    slurm.add_argument("--partition", help="Slurm partition")
    slurm.add_argument("--account", help="Slurm account")
    slurm.add_argument("--time", help="time limit, e.g. 4:00:00 (0: none, so no checkpoint before a limit)")
    slurm.add_argument(
        "--cpus-per-task",
        type=int,
        help="CPUs for each node's torchrun agent and its workers (default: the partition's node CPUs from sinfo, else one per worker)",
    )
    slurm.add_argument("--mem", help="memory per node, sbatch's --mem (e.g. 64G; default 0: all of each node's memory)")
    slurm.add_argument("--job-name", default="meshrun", help="Slurm job name")
    slurm.add_argument(
        "--signal-seconds",
        type=int,
        default=300,
        help="USR1 this many seconds before the time limit: checkpoint, requeue, resume",
    )
    slurm.add_argument(
        "--sbatch",
        dest="sbatch_options",
        action="append",
        default=[],
        metavar="OPTION",
        help="any other sbatch option for the script header, e.g. --sbatch=--qos=high (repeatable)",
    )
    slurm.add_argument("--submit", action="store_true", help="submit with sbatch and print the job id")
    _k8s_parser(sub)
    data = sub.add_parser("prepare-data", help="tokenize text, jsonl, parquet or datasets folders into token shards")
    data.add_argument(
        "--source",
        dest="sources",
        action="append",
        default=[],
        metavar="PATH_OR_GLOB",
        help="files, folders, globs or save_to_disk folders (repeatable); default: the Python standard library",
    )
    data.add_argument("--out", required=True, help="output folder (new or empty; never overwritten)")
    data.add_argument("--val-fraction", type=float, default=0.05, help="share of documents held out for validation")
    data.add_argument(
        "--field",
        default="text",
        help="field of .jsonl records / column of .parquet and datasets: text, or lists of token ids (input_ids)",
    )
    data.add_argument(
        "--tokenizer",
        default="byte",
        metavar="byte|PATH",
        help="byte (vocab 256), a tokenizer.json, or a model folder with tokenizer files",
    )
    data.add_argument("--train-tokenizer", metavar="bpe:VOCAB", help="train a byte-level BPE on the sources and use it")
    data.add_argument("--workers", type=int, help="tokenizer processes (default: all cores)")
    data.add_argument(
        "--shard-tokens", type=int, default=1 << 28, help="tokens per shard file (shards end at documents)"
    )
    data.add_argument(
        "--pairs",
        action="store_true",
        help="seq2seq text pairs: one .jsonl (--source-field, --target-field) or two aligned text files; "
        "no --source = the built-in example (stdlib snake_case names -> CamelCase)",
    )
    data.add_argument("--source-field", default="source", help="--pairs: the source text field of .jsonl records")
    data.add_argument("--target-field", default="target", help="--pairs: the target text field of .jsonl records")
    _task_data_arguments(data)
    _supervised_arguments(data)
    _plan_parser(sub)
    _parity_parser(sub)
    export = sub.add_parser("export", help="consolidate a sharded checkpoint into one file")
    export.add_argument(
        "checkpoint", metavar="RUN_OR_CKPT", help="run directory (newest checkpoint) or checkpoint folder"
    )
    target = export.add_mutually_exclusive_group(required=True)
    target.add_argument("--out", help="output file: .safetensors or .pt")
    target.add_argument("--hf", metavar="OUT_DIR", help="Hugging Face models: a folder from_pretrained loads")
    target.add_argument(
        "--adapter",
        metavar="OUT_DIR",
        help="model.lora runs: the adapters as a PEFT folder (adapter_config.json, adapter_model.safetensors) "
        "that PeftModel.from_pretrained(base, OUT_DIR) loads",
    )
    export.add_argument(
        "--merge",
        action="store_true",
        help="with --hf, for model.lora runs (which need it there): full weights with the adapters merged in "
        "(peft's merge: W + B A x alpha / r)",
    )
    _trust_arguments(export)
    sample = sub.add_parser(
        "sample", help="generate text from a checkpoint (decoded with the training data's tokenizer)"
    )
    sample.add_argument(
        "checkpoint", metavar="RUN_OR_CKPT", help="run directory (newest checkpoint) or checkpoint folder"
    )
    sample.add_argument("--prompt", default="def ", help="text to continue")
    sample.add_argument(
        "--chat",
        metavar="MESSAGE",
        help="a user message, rendered with the chat template the model was fine-tuned with (prepare-data --chat); "
        "prints the answer up to the end of the turn",
    )
    sample.add_argument("--tokens", type=int, default=200, help="tokens to generate")
    sample.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    sample.add_argument("--top-k", type=int, default=50, help="sample among the k most likely tokens (0 = all)")
    sample.add_argument("--seed", type=int, default=0, help="sampling seed")
    sample.add_argument("--beam", type=int, default=1, help="encoder-decoder models: beam width (1 = greedy)")
    sample.add_argument(
        "--tokenizer",
        metavar="PATH",
        help="decode with this tokenizer.json or model folder instead of the one saved with the checkpoint "
        "(data read in place, e.g. nanoGPT's GPT-2 ids, carries none)",
    )
    _trust_arguments(sample)
    predict = sub.add_parser(
        "predict",
        help="classification runs: the label of a text and its probability; regression runs: a forecast from a csv",
    )
    predict.add_argument(
        "checkpoint", metavar="RUN_OR_CKPT", help="run directory (newest checkpoint) or checkpoint folder"
    )
    given = predict.add_mutually_exclusive_group(required=True)
    given.add_argument(
        "--text",
        action="append",
        help="classification: a text to classify (repeat for several); one line each: label, probability, text "
        "(tab-separated)",
    )
    given.add_argument(
        "--csv",
        metavar="FILE",
        help="regression: a .csv with the training data's columns (and time column); its last model.seq_len rows "
        "are forecast the next horizon values of each column, in the data's units",
    )
    predict.add_argument(
        "--out",
        metavar="FILE",
        help="with --csv: the forecast's .csv, a new file (default: FILE's name with .forecast.csv, beside it)",
    )
    _trust_arguments(predict)
    compare = sub.add_parser(
        "report", help="compare runs: a table of their summaries and one picture of their loss curves"
    )
    compare.add_argument("runs", nargs="+", metavar="RUN", help="run directories (each a training job's run_dir)")
    compare.add_argument(
        "--out", help="the loss-curves picture (a new .png, .pdf or .svg file; default: report.png in the first RUN)"
    )
    compare.add_argument("--force", action="store_true", help="replace --out if it exists")
    return parser


def _config_arguments(parser: argparse.ArgumentParser, *, set_help: str) -> None:
    """The config file and its `--set KEY=VALUE` overrides, as every command that reads a config takes them."""
    parser.add_argument("config", nargs="?", help="YAML config; default: the packaged configs/default.yaml")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help=set_help)


def _k8s_parser(sub: argparse._SubParsersAction) -> None:
    k8s = sub.add_parser("k8s", help="write the Kubernetes manifest (JobSet or Kubeflow TrainJob) that trains a config")
    _config_arguments(
        k8s, set_help="override a config key (repeatable); the resolved config goes into the manifest's ConfigMap"
    )
    k8s.add_argument("--image", required=True, help="the meshrun image (docker/Dockerfile) the pods run")
    k8s.add_argument(
        "--nodes", type=int, required=True, help="pods, one per node; the dp x tp x pp workers are split over them"
    )
    k8s.add_argument("--gpus-per-node", type=int, help="GPUs per pod (default: its workers; 0 for CPU nodes)")
    k8s.add_argument("--flavor", choices=("jobset", "trainjob"), default="jobset", help="JobSet or Kubeflow TrainJob")
    k8s.add_argument("--name", help="the job's name (default: run_dir's folder name)")
    k8s.add_argument("--queue", help="Kueue LocalQueue: adds its label and suspend: true")
    k8s.add_argument("--namespace", help="namespace of the job and its ConfigMap")
    k8s.add_argument("--pvc", metavar="CLAIM:/MOUNT", help="shared volume for run_dir (required for --nodes > 1)")
    k8s.add_argument(
        "--env", action="append", default=[], metavar="KEY=VALUE", help="pod environment (repeatable; no secrets)"
    )
    k8s.add_argument("--wandb-secret", metavar="NAME[:KEY]", help="Secret holding WANDB_API_KEY (key default api-key)")
    k8s.add_argument("--cpus", help="CPU request per pod (default 4 per worker)")
    k8s.add_argument("--memory", help="memory per pod (default 8Gi per worker + /dev/shm)")
    k8s.add_argument("--grace-seconds", type=int, help="SIGTERM -> SIGKILL (default: enough for one checkpoint)")
    k8s.add_argument("--out", help="write the manifest to this new file instead of printing it")


def _version() -> str:
    """The installed distribution's version (a source tree on PYTHONPATH without one: unknown)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("meshrun")
    except PackageNotFoundError:
        return "unknown (not installed)"


def _task_data_arguments(data: argparse.ArgumentParser) -> None:
    """prepare-data's --task and the flags of its record tasks (cli/task_data.py checks which apply)."""
    data.add_argument(
        "--task",
        choices=("causal_lm", "seq2seq", "classification", "regression", "masked_lm"),
        help="the task the data is for (recorded in meta.json): causal_lm (default), seq2seq (as --pairs), "
        "classification (.jsonl/.csv/.parquet: --field text, --label-field), regression (.csv/.parquet numeric "
        "columns: --seq-len, --horizon), masked_lm (token shards with a mask token)",
    )
    data.add_argument(
        "--label-field", help="classification: the field or column holding each row's label (default label)"
    )
    data.add_argument(
        "--val-source",
        dest="val_sources",
        action="append",
        default=[],
        metavar="PATH_OR_GLOB",
        help="classification: validation rows from these files (their labels must be training labels); "
        "default: --val-fraction of the rows, by a hash of their text",
    )
    data.add_argument(
        "--columns", help="regression: comma-separated value columns (default: every column but --time-column)"
    )
    data.add_argument("--time-column", help="regression: a column of times (numbers or ISO dates) the rows must follow")
    data.add_argument("--seq-len", type=int, help="regression: past values each window holds (model.seq_len)")
    data.add_argument("--horizon", type=int, help="regression: future values each window predicts (default 1)")


def _supervised_arguments(data: argparse.ArgumentParser) -> None:
    """prepare-data's flags for documents with a loss mask (data/supervised.py)."""
    data.add_argument(
        "--chat",
        action="store_true",
        help="conversations (a messages field of {role, content} lists in .jsonl, .parquet or datasets folders), "
        "rendered with the --tokenizer folder's chat template; the assistant turns are trained. Without --source: "
        "the built-in example (standard-library function names answered in CamelCase)",
    )
    data.add_argument(
        "--prompt-completion",
        action="store_true",
        help="records with a prompt and a completion text: stored as prompt completion EOS, the completion and EOS "
        "trained (no chat template)",
    )
    data.add_argument("--messages-field", default="messages", help="--chat: the field holding each conversation")
    data.add_argument("--prompt-field", default="prompt", help="--prompt-completion: the prompt text field")
    data.add_argument("--completion-field", default="completion", help="--prompt-completion: the completion text field")
    data.add_argument(
        "--chat-template",
        metavar="FILE",
        help="--chat: render with this jinja template instead of the --tokenizer folder's own",
    )
    data.add_argument(
        "--train-on",
        choices=("assistant", "all"),
        default="assistant",
        help="which tokens the loss counts: the assistant turns / completion (default), or all",
    )
    data.add_argument(
        "--max-len",
        type=int,
        metavar="TOKENS",
        help="--chat / --prompt-completion: the longest document stored (the model.seq_len you will train with)",
    )
    data.add_argument(
        "--long",
        choices=("truncate", "split", "refuse"),
        default="truncate",
        help="documents over --max-len: keep their first --max-len tokens (default: the context of every trained "
        "token is kept), cut them into pieces, or refuse",
    )


def _plan_parser(sub: argparse._SubParsersAction) -> None:
    plan = sub.add_parser(
        "plan", help="rank dp x pp x schedule x micro_batch x recompute layouts by predicted memory and speed"
    )
    _config_arguments(plan, set_help="override a config key (repeatable)")
    plan.add_argument("--gpus", type=int, default=1, help="devices in the job (dp x pp of every layout)")
    plan.add_argument("--nodes", type=int, default=1, help="nodes the devices are spread over")
    plan.add_argument("--gpu", help="device type: h100, h200, a100-40g, a100-80g, l40s, l4, ... or cpu (calibrated)")
    plan.add_argument("--memory-gb", type=float, help="memory per device in GiB (default: the device table's)")
    plan.add_argument("--margin", type=float, default=0.1, help="share of device memory kept free (default 0.1)")
    plan.add_argument("--intra-gbs", type=float, help="link GB/s within a node (default per device type)")
    plan.add_argument("--inter-gbs", type=float, help="link GB/s between nodes (default per device type)")
    plan.add_argument("--top", type=int, default=10, help="fitting (and non-fitting) layouts to show")
    plan.add_argument("--write", metavar="OUT.yaml", help="write the best fitting layout's config here (new file)")
    plan.add_argument("--calibration", metavar="FILE", help="calibration JSON (default: per device in the cache)")
    mode = plan.add_mutually_exclusive_group()
    mode.add_argument("--calibrate", action="store_true", help="time real steps on this machine and save the fit")
    mode.add_argument("--run", metavar="RUN_DIR", help="compare a finished run's metrics with the prediction")
    plan.add_argument("--steps", type=int, default=3, help="--calibrate: timed steps per probe")
    plan.add_argument("--rounds", type=int, default=3, help="--calibrate: alternating rounds over the probes (median)")
    _trust_code_flag(plan, "--run: import the model.factory the run's config.json names")


def _parity_parser(sub: argparse._SubParsersAction) -> None:
    parity = sub.add_parser(
        "parity",
        help="train one job in two layouts for a few steps and compare them (exit 0: equal, 1: different)",
        description="Train one job in two layouts (A and B) by real `meshrun train` launches, from the same "
        "weights on the same global batches, and compare each step's loss and pre-clip grad norm and the "
        "weights, tensor by tensor, against tolerances for the precision (docs/tools/parity.md).",
        epilog="exit status: 0 equal within the tolerances, 1 different (or a run failed), 2 bad input",
    )
    parity.add_argument(
        "configs",
        nargs="*",
        metavar="CONFIG",
        help="A.yaml B.yaml, or one config for both with --set-a / --set-b; none: the packaged default",
    )
    parity.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help="override a key of both runs"
    )
    for side in ("a", "b"):
        parity.add_argument(
            f"--set-{side}",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help=f"override a key of run {side.upper()} only, e.g. --set-{side} parallel.pp=2 (repeatable)",
        )
    parity.add_argument("--out", required=True, help="a new folder for the two runs (OUT/a, OUT/b) and their logs")
    parity.add_argument("--steps", type=int, default=5, help="optimizer steps each run trains (default 5)")
    parity.add_argument(
        "--layers", type=int, help="both runs at this depth (model.num_layers): a model too large to check whole"
    )
    parity.add_argument(
        "--weights",
        choices=("final", "every", "none"),
        default="every",
        help="compare the weights after every step (default: a checkpoint per step and run; names the first step "
        "and the tensor that differ), only the final ones (one checkpoint per run), or none",
    )


def _trust_arguments(parser: argparse.ArgumentParser) -> None:
    """A checkpoint's config.json may name a model.factory: code that runs only if the user says so."""
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="model.factory=MODULE:FUNCTION",
        help="build the model with this factory (the only key export and sample take)",
    )
    _trust_code_flag(parser, "import the model.factory the checkpoint's config.json names")


def _trust_code_flag(parser: argparse.ArgumentParser, help_text: str) -> None:
    """The one flag under which code named by a file meshrun did not get on the command line runs
    (see config.schema.check_code_trusted): the same name on every command that reads such names."""
    parser.add_argument("--trust-code", action="store_true", help=help_text)
