#!/usr/bin/env bash
# Start meshrun workers with torchrun on one node or many, configured by environment variables
# (e.g. under your own scheduler).
#
# The variables become `meshrun train`'s multi-node flags: meshrun checks the job, then starts
# torchrun with the command line it builds in one place (meshrun.launcher.torchrun; printed as
# "starting N workers: ..."). The config must say parallel.dp x parallel.pp = NNODES x NPROC_PER_NODE.
#
# One node, 4 workers:
#   NPROC_PER_NODE=4 launch/torchrun.sh configs/default.yaml --set parallel.dp=2 --set parallel.pp=2
# Two nodes, 8 workers each; run the same line on both (node0 hosts the rendezvous):
#   NNODES=2 NPROC_PER_NODE=8 RDZV_ENDPOINT=node0:29400 RDZV_ID=job42 launch/torchrun.sh CONFIG [--set k=v ...]
# Nodes with several interfaces: say which address and interface the others reach this node on:
#   ... LOCAL_ADDR=10.0.0.2 IS_HOST=0 GLOO_SOCKET_IFNAME=eth1 NCCL_SOCKET_IFNAME=eth1 launch/torchrun.sh ...
#
# Environment (all optional except NPROC_PER_NODE):
#   NPROC_PER_NODE  workers on this node (GPUs per node on GPU machines)
#   NNODES          nodes in the job (default 1; > 1 needs RDZV_ENDPOINT)
#   RDZV_ENDPOINT   HOST[:PORT] of the c10d rendezvous on the host node (default port 29400)
#   RDZV_ID         id shared by all nodes of one job (default meshrun)
#   LOCAL_ADDR      this node's address as the other nodes reach it (default: its host name)
#   IS_HOST         1 on the node that hosts the rendezvous, 0 elsewhere (default: torchrun guesses)
#   MAX_RESTARTS    restarts of the worker group after a failure; each resumes from the newest
#                   checkpoint (default 0)
#   PYTHON          interpreter with meshrun installed (default python3)
set -euo pipefail

if [[ -z "${NPROC_PER_NODE:-}" ]]; then
    echo "launch/torchrun.sh: set NPROC_PER_NODE (workers on this node = parallel.dp x parallel.pp / NNODES)" >&2
    exit 2
fi
NNODES="${NNODES:-1}"
if [[ "$NNODES" != 1 && -z "${RDZV_ENDPOINT:-}" ]]; then
    echo "launch/torchrun.sh: NNODES=$NNODES needs RDZV_ENDPOINT=HOST:PORT (the host node's address)" >&2
    exit 2
fi

args=(--nproc-per-node="$NPROC_PER_NODE" --max-restarts="${MAX_RESTARTS:-0}")
if [[ -n "${RDZV_ENDPOINT:-}" ]]; then  # else one node: a private rendezvous on a free port
    args+=(--nnodes="$NNODES" --rdzv-endpoint="$RDZV_ENDPOINT" --rdzv-id="${RDZV_ID:-meshrun}")
    case "${IS_HOST:-}" in
        1) args+=(--host-node) ;;
        0) args+=(--no-host-node) ;;
        "") ;;
        *) echo "launch/torchrun.sh: IS_HOST must be 1 or 0, not '$IS_HOST'" >&2; exit 2 ;;
    esac
    [[ -n "${LOCAL_ADDR:-}" ]] && args+=(--local-addr="$LOCAL_ADDR")
fi

exec "${PYTHON:-python3}" -P -m meshrun train "$@" "${args[@]}"
