#!/usr/bin/env bash
# Run meshrun from its container image (docker/Dockerfile) with GPUs, shared memory, the run, data
# and cache folders mounted, the config file mounted read-only, and WANDB_* passed through.
#
#   launch/docker-run.sh train                                  # the default job, GPUs if present
#   launch/docker-run.sh --gpus 0,1 train configs/x.yaml --set parallel.dp=2
#   launch/docker-run.sh --data /datasets prepare-data --source '/datasets/text/**/*.txt' --out /data/bytes
#   MESHRUN_ENGINE=podman launch/docker-run.sh --print train   # show the command, run nothing
#
# Usage: launch/docker-run.sh [OPTIONS] [--] [MESHRUN ARGS...]   (default meshrun args: train)
#   --image IMAGE     image to run (default $MESHRUN_IMAGE, else meshrun:latest)
#   --gpus SPEC       all | none | a list of indices such as 0,1 (default: all when nvidia-smi
#                     exists here, else none). docker: --gpus; podman: CDI devices nvidia.com/gpu=N
#   --shm-size SIZE   size of /dev/shm (default 16g): NCCL and dataloader workers live in it
#   --ipc-host        share the host's IPC namespace instead of a private /dev/shm (--ipc=host)
#   --host-network    use the host's network (multi-node: workers reach MASTER_ADDR and each other)
#   --runs DIR        host folder mounted at /workspace/runs (default ./runs); the container's
#                     working dir is /workspace, so `run_dir: runs/NAME` lands in DIR/NAME
#   --data DIR        host folder mounted at /data (point data.dir at /data/...)
#   --cache DIR       host folder mounted at /cache as XDG_CACHE_HOME: the default dataset is
#                     prepared there once (default ${XDG_CACHE_HOME:-~/.cache}/meshrun-container)
#   --user UID:GID    user in the container (default: yours, so files in DIRs are yours, with
#                     --userns=keep-id under rootless podman; when you are root: the image's own
#                     non-root user, uid 1000, which then needs write access to DIRs)
#   --name NAME       container name
#   --print           print the engine command instead of running it
#
# The config file: with `train FILE`, FILE (a host path) is mounted read-only at /config/ and the
# argument rewritten; other paths in meshrun arguments are container paths.
# Environment:
#   MESHRUN_ENGINE       container command with any global options (default: docker if found, else
#                        podman), e.g. "podman --root /srv/containers"
#   MESHRUN_DOCKER_ARGS  more `run` options, split on spaces (e.g. "--entrypoint=torchrun")
#   WANDB_*, NCCL_*, GLOO_*, and torchrun's RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK,
#   MASTER_ADDR, MASTER_PORT: passed through by name when exported; their values are never put on
#   the command line or printed (so API keys stay out of `ps` and logs).
set -euo pipefail

usage() { sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0"; }
die() { echo "docker-run.sh: error: $*" >&2; exit 2; }

image="${MESHRUN_IMAGE:-meshrun:latest}"
gpus=""
shm_size="16g"
ipc_host=0
host_network=0
runs_dir="runs"
data_dir=""
cache_dir="${XDG_CACHE_HOME:-$HOME/.cache}/meshrun-container"
user=""
name=""
print_only=0

while (($#)); do
    case "$1" in
        --image) image="${2:?--image needs a value}"; shift 2 ;;
        --gpus) gpus="${2:?--gpus needs all, none or a list like 0,1}"; shift 2 ;;
        --shm-size) shm_size="${2:?--shm-size needs a size like 16g}"; shift 2 ;;
        --ipc-host) ipc_host=1; shift ;;
        --host-network) host_network=1; shift ;;
        --runs) runs_dir="${2:?--runs needs a folder}"; shift 2 ;;
        --data) data_dir="${2:?--data needs a folder}"; shift 2 ;;
        --cache) cache_dir="${2:?--cache needs a folder}"; shift 2 ;;
        --user) user="${2:?--user needs UID:GID}"; shift 2 ;;
        --name) name="${2:?--name needs a value}"; shift 2 ;;
        --print) print_only=1; shift ;;
        -h | --help) usage; exit 0 ;;
        --) shift; break ;;
        -*) die "unknown option $1 (see --help; meshrun's own options go after --)" ;;
        *) break ;;
    esac
done
(($#)) || set -- train

if [[ -n "${MESHRUN_ENGINE:-}" ]]; then
    read -r -a engine <<< "$MESHRUN_ENGINE"
elif command -v docker > /dev/null; then
    engine=(docker)
elif command -v podman > /dev/null; then
    engine=(podman)
else
    die "neither docker nor podman found; install one or set MESHRUN_ENGINE"
fi
engine_name="$(basename "${engine[0]}")"

args=(run --rm)
[[ -t 0 && -t 1 ]] && args+=(-it)
[[ -n "$name" ]] && args+=(--name "$name")

if [[ -z "$gpus" ]]; then
    if command -v nvidia-smi > /dev/null; then gpus=all; else gpus=none; fi
fi
if [[ "$gpus" != none ]]; then
    [[ "$gpus" == all || "$gpus" =~ ^[0-9]+(,[0-9]+)*$ ]] || die "--gpus takes all, none or indices like 0,1, got '$gpus'"
    if [[ "$engine_name" == podman ]]; then  # podman: CDI names (nvidia-ctk cdi generate)
        IFS=, read -r -a ids <<< "$gpus"
        for id in "${ids[@]}"; do args+=(--device "nvidia.com/gpu=$id"); done
    elif [[ "$gpus" == all ]]; then
        args+=(--gpus all)
    else
        args+=(--gpus "\"device=$gpus\"")  # the inner quotes keep the comma list one value
    fi
fi

if ((ipc_host)); then args+=(--ipc=host); else args+=(--shm-size "$shm_size"); fi
((host_network)) && args+=(--network=host)

if [[ -z "$user" && "$(id -u)" != 0 ]]; then
    user="$(id -u):$(id -g)"
    # rootless podman: without keep-id, container UIDs map to subordinate host UIDs
    [[ "$engine_name" == podman ]] && args+=(--userns=keep-id)
fi
[[ -n "$user" ]] && args+=(--user "$user")

mount_dir() {  # host folder (created if missing) -> container path
    mkdir -p "$1"
    args+=(--volume "$(cd "$1" && pwd -P):$2")
}
mount_dir "$runs_dir" /workspace/runs
mount_dir "$cache_dir" /cache
args+=(--env XDG_CACHE_HOME=/cache)
[[ -n "$data_dir" ]] && mount_dir "$data_dir" /data

# By name only: the engine reads the values from this environment.
while read -r var; do
    case "$var" in
        WANDB_* | NCCL_* | GLOO_* | RANK | LOCAL_RANK | WORLD_SIZE | LOCAL_WORLD_SIZE | GROUP_RANK | MASTER_ADDR | MASTER_PORT)
            args+=(--env "$var") ;;
    esac
done < <(compgen -e)

# `train FILE`: mount the host's config file and point the argument at the mounted copy.
meshrun_args=("$@")
if [[ "${meshrun_args[0]}" == train && $# -ge 2 && "${meshrun_args[1]}" != -* ]]; then
    config="${meshrun_args[1]}"
    [[ -f "$config" ]] || die "config file $config not found on this machine"
    config_abs="$(cd "$(dirname "$config")" && pwd -P)/$(basename "$config")"
    args+=(--volume "$config_abs:/config/$(basename "$config"):ro")
    meshrun_args[1]="/config/$(basename "$config")"
fi

if [[ -n "${MESHRUN_DOCKER_ARGS:-}" ]]; then
    read -r -a extra <<< "$MESHRUN_DOCKER_ARGS"
    args+=("${extra[@]}")
fi

command=("${engine[@]}" "${args[@]}" "$image" "${meshrun_args[@]}")
if ((print_only)); then
    printf '%q ' "${command[@]}"
    echo
    exit 0
fi
exec "${command[@]}"
