"""Config -> Kubernetes manifest (`meshrun k8s`): a JobSet or a Kubeflow Trainer TrainJob, after a
ConfigMap that carries the resolved config, as one YAML stream for `kubectl apply -f -`.

Every pod is one node: it runs `meshrun train` (so the torchrun command line is still built only
in `meshrun.launcher.torchrun`) with `--nnodes`, `--nproc-per-node`, a c10d rendezvous on pod 0's
stable name `<name>-node-0-0.<name>` (the JobSet's headless service; TrainJob makes the same
JobSet), its own pod IP as `--local-addr` and the Job's completion index as `--node-rank` (index 0
hosts the rendezvous store: torchrun cannot tell that from a service name).

Restarts: a failing pod fails its Job (`backoffLimit: 0`) and the JobSet recreates every pod
(`failurePolicy.maxRestarts` = `launch.max_restarts`, torchrun itself restarts nothing); a pod
stopped by SIGTERM checkpoints and exits 75 (`meshrun.launcher.outcome`), a restart that does not count
against that limit. Either way the new pods resume from the newest checkpoint in `run_dir`, which
must be on the shared volume (`--pvc`). TrainJob has no restart field: there the runtime's JobSet
restarts pods and `launch.max_restarts` stays torchrun's.
"""

from __future__ import annotations

import json
import math
import posixpath
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

from meshrun.config.schema import Config
from meshrun.config.topology import refuse_peer_recovery, workers_per_node
from meshrun.errors import ConfigError
from meshrun.files.atomic import write_atomic
from meshrun.launcher.outcome import STOPPED_EXIT_CODE

JOBSET_API = "jobset.x-k8s.io/v1alpha2"
TRAINJOB_API = "trainer.kubeflow.org/v1alpha1"
TORCH_RUNTIME = "torch-distributed"  # Kubeflow Trainer's ClusterTrainingRuntime for PyTorch
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
NODE = "node"  # the replicated job and its container (the name torch-distributed gives its trainer)
CONFIG_DIR = "/etc/meshrun"  # the ConfigMap's mount
CONFIG_FILE = "config.yaml"
RDZV_PORT = 29400  # torchrun's c10d default
TRAINJOB_PORT = 29500  # the port torch-distributed's trainer container declares (its PET_MASTER_PORT)
POD_IP_ENV = "POD_IP"  # the downward API's status.podIP
INDEX_ENV = "JOB_COMPLETION_INDEX"  # set by the Job controller in every pod of an Indexed Job
SECRET_NAMES = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|CREDENTIAL", re.IGNORECASE)
_DNS_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")  # RFC 1035: metadata.name of JobSet / TrainJob
_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")  # RFC 1123
_LABEL_VALUE = re.compile(r"([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?")
_QUANTITY = re.compile(r"\d+(\.\d+)?(m|k|M|G|T|Ki|Mi|Gi|Ti)?")
CHECKPOINT_BYTES_PER_SECOND = 100e6  # a slow shared volume; the grace period must cover one save
# The Job's podFailurePolicy (onExitCodes) is GA and always on from 1.31 (beta 1.26-1.30, where some
# 1.28 releases refuse a rule without onPodConditions; alpha and off by default in 1.25).
MIN_KUBERNETES = "1.31"
MAX_INDEXED_PODS = 100_000  # batch/v1 validation: an Indexed Job's parallelism at most


@dataclass(frozen=True)
class PodOptions:
    """What `meshrun k8s` takes besides the config (each one a flag of the same name)."""

    image: str
    nodes: int
    gpus_per_node: int | None = None  # None: one GPU per worker
    flavor: Literal["jobset", "trainjob"] = "jobset"
    name: str | None = None  # None: from run_dir's folder name
    queue: str | None = None
    namespace: str | None = None
    pvc: str | None = None  # NAME:/mount
    env: Sequence[str] = ()  # KEY=VALUE
    wandb_secret: str | None = None  # NAME[:KEY]
    cpus: str | None = None
    memory: str | None = None
    grace_seconds: int | None = None


def _dns_label(value: str, flag: str, *, longest: int = 63) -> str:
    if not _DNS_LABEL.fullmatch(value) or len(value) > longest:
        raise ConfigError(
            f"{flag} {json.dumps(value)} is not a Kubernetes name: lowercase letters, digits and '-', "
            f"starting with a letter, at most {longest} characters"
        )
    return value


def job_name(cfg: Config, options: PodOptions) -> str:
    """The JobSet / TrainJob name; pod hostnames `<name>-node-0-<index>` must stay DNS labels."""
    longest = 63 - len(f"-{NODE}-0-{options.nodes - 1}")
    if options.name is not None:
        return _dns_label(options.name, "--name", longest=longest)
    derived = re.sub(r"[^a-z0-9]+", "-", posixpath.basename(cfg.run_dir.rstrip("/")).lower()).strip("-")
    if not _DNS_LABEL.fullmatch(derived) or len(derived) > longest:
        raise ConfigError(
            f"run_dir's folder name does not make a Kubernetes name; pass --name (lowercase letters, digits and '-', "
            f"starting with a letter, at most {longest} characters)"
        )
    return derived


def shared_volume(cfg: Config, options: PodOptions) -> tuple[str, str] | None:
    """(claim, mount) of `--pvc`, refusing a run directory the restarted pods would not find."""
    if options.pvc is None:
        if options.nodes > 1:
            raise ConfigError(
                f"--nodes {options.nodes} needs --pvc CLAIM:/MOUNT: every node writes its checkpoint shards into "
                "run_dir, which must be one volume that outlives the pods"
            )
        return None
    claim, sep, mount = options.pvc.partition(":")
    if not sep or not _SUBDOMAIN.fullmatch(claim) or not posixpath.isabs(mount) or posixpath.normpath(mount) == "/":
        raise ConfigError(
            f"--pvc {json.dumps(options.pvc)}: use CLAIM:/MOUNT, a PersistentVolumeClaim name and an absolute "
            "folder other than /, e.g. --pvc runs:/runs"
        )
    mount = posixpath.normpath(mount)
    for taken in (CONFIG_DIR, "/dev/shm"):
        if mount == taken or mount.startswith(taken + "/") or taken.startswith(mount + "/"):
            raise ConfigError(f"--pvc mount {mount} overlaps {taken}, which the pods use; mount the claim elsewhere")
    run_dir = posixpath.normpath(cfg.run_dir)
    if not run_dir.startswith(mount + "/"):
        raise ConfigError(
            f"run_dir {cfg.run_dir} is not on the shared volume (--pvc {claim}:{mount}), so checkpoints would be lost "
            f"with the pod; set run_dir={mount}/{posixpath.basename(run_dir) or 'run'}"
        )
    return claim, mount


def container_env(options: PodOptions) -> list[dict[str, Any]]:
    """The pod's environment: its IP, `--env` values, and WANDB_API_KEY only by Secret reference."""
    env: list[dict[str, Any]] = [{"name": POD_IP_ENV, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]
    for item in options.env:
        key, sep, value = item.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            raise ConfigError(f"--env {json.dumps(key)}: use KEY=VALUE with a variable name of letters, digits and _")
        if SECRET_NAMES.search(key):
            raise ConfigError(
                f"--env {key}=... would put a secret into the manifest in plain text; store it in a Secret "
                f"(kubectl create secret generic NAME --from-literal=...) and pass --wandb-secret NAME for WANDB_API_KEY"
            )
        if key in (POD_IP_ENV, INDEX_ENV, "HOSTNAME"):
            raise ConfigError(f"--env {key}: Kubernetes sets {key} in every pod; leave it out")
        env.append({"name": key, "value": value})
    if options.wandb_secret is not None:
        secret, _, key = options.wandb_secret.partition(":")
        if not _SUBDOMAIN.fullmatch(secret) or not re.fullmatch(r"[-._A-Za-z0-9]+", key or "api-key"):
            raise ConfigError(
                f"--wandb-secret {json.dumps(options.wandb_secret)}: use SECRET_NAME[:KEY] (KEY default api-key)"
            )
        env.append({"name": "WANDB_API_KEY", "valueFrom": {"secretKeyRef": {"name": secret, "key": key or "api-key"}}})
    return env


def _quantity(value: str, flag: str) -> str:
    if not _QUANTITY.fullmatch(value) or float(re.sub(r"[^\d.]", "", value)) <= 0:
        raise ConfigError(f"{flag} {json.dumps(value)} is not a Kubernetes quantity, e.g. 8, 500m, 64Gi")
    return value


def grace_seconds(checkpoint_bytes: int, options: PodOptions) -> int:
    """Seconds between SIGTERM and SIGKILL: a step to finish plus one checkpoint written (every
    node writes its shards at once) to a slow volume; at least two minutes."""
    if options.grace_seconds is not None:
        if options.grace_seconds < 1:
            raise ConfigError(f"--grace-seconds must be >= 1, got {options.grace_seconds}")
        return options.grace_seconds
    return max(120, 60 + math.ceil(checkpoint_bytes / CHECKPOINT_BYTES_PER_SECOND))


def _args(name: str, nodes: int, nproc: int, restarts: int, port: int) -> list[str]:
    """`meshrun train` on the mounted config; $(VAR) is expanded by the kubelet from the pod's env."""
    multi_node = [
        f"--rdzv-endpoint={name}-{NODE}-0-0.{name}:{port}",
        f"--rdzv-id={name}",
        f"--local-addr=$({POD_IP_ENV})",
        f"--node-rank=$({INDEX_ENV})",
    ]
    return [
        "train",
        f"{CONFIG_DIR}/{CONFIG_FILE}",
        f"--nnodes={nodes}",
        f"--nproc-per-node={nproc}",
        *(multi_node if nodes > 1 else []),
        f"--max-restarts={restarts}",
    ]


@dataclass(frozen=True)
class JobShape:
    """What the checks settle: the job's name, workers and GPUs per pod, the shared volume."""

    name: str
    nproc: int
    gpus: int
    volume: tuple[str, str] | None  # (claim, mount)


def check_options(cfg: Config, options: PodOptions) -> JobShape:
    """Every refusal of `meshrun k8s` that needs no model, one line each (ConfigError)."""
    refuse_peer_recovery(cfg.parallel, cfg.launch, "meshrun k8s")
    if not 1 <= options.nodes <= MAX_INDEXED_PODS:
        raise ConfigError(
            f"--nodes must be from 1 to {MAX_INDEXED_PODS:,} (Kubernetes' limit for an Indexed Job), got {options.nodes}"
        )
    if not options.image or any(c.isspace() for c in options.image):
        raise ConfigError(f"--image {json.dumps(options.image)}: name one image, e.g. registry.example.com/meshrun:1")
    nproc = workers_per_node(cfg.parallel, options.nodes, named=f"--nodes {options.nodes}", change="--nodes")
    gpus = nproc if options.gpus_per_node is None else options.gpus_per_node
    if gpus not in (0, nproc):
        raise ConfigError(
            f"{cfg.world_size} workers ({cfg.layout.axes_text()}) on {options.nodes} nodes is {nproc} per node, but "
            f"--gpus-per-node is {gpus}; use --gpus-per-node {nproc} (or 0 for CPU nodes) or change --nodes"
        )
    if cfg.train.resume == "none":
        raise ConfigError(
            "train.resume is none, so every restarted pod would refuse the run it started; use auto (the default)"
        )
    if cfg.tracker.mode == "online" and "wandb" in cfg.tracker.backends and options.wandb_secret is None:
        raise ConfigError(
            "tracker.mode is online but no --wandb-secret names the API key's Secret: the pods would log offline; "
            "pass --wandb-secret NAME, or set tracker.mode=offline"
        )
    if options.namespace is not None:
        _dns_label(options.namespace, "--namespace")
    if options.queue is not None and (not _LABEL_VALUE.fullmatch(options.queue) or not 0 < len(options.queue) <= 63):
        raise ConfigError(f"--queue {json.dumps(options.queue)} is not a label value (letters, digits, - _ ., <= 63)")
    for flag, value in (("--cpus", options.cpus), ("--memory", options.memory)):
        if value is not None:
            _quantity(value, flag)
    grace_seconds(0, options)
    container_env(options)
    return JobShape(job_name(cfg, options), nproc, gpus, shared_volume(cfg, options))


def render_manifest(cfg: Config, options: PodOptions, *, checkpoint_bytes: int) -> str:
    """The YAML stream (ConfigMap, then JobSet or TrainJob) that trains `cfg` on `options.nodes` pods."""
    shape = check_options(cfg, options)
    restarts = 0 if options.flavor == "jobset" else cfg.launch.max_restarts
    port = RDZV_PORT if options.flavor == "jobset" else TRAINJOB_PORT
    container = {
        "name": NODE,
        "image": options.image,
        "command": ["meshrun"],
        "args": _args(shape.name, options.nodes, shape.nproc, restarts, port),
        "env": container_env(options),
    }
    mounts, volumes = _volumes(shape)
    meta = _metadata(shape.name, options, labels={QUEUE_LABEL: options.queue} if options.queue else {})
    grace = grace_seconds(checkpoint_bytes, options)
    if options.flavor == "jobset":
        pod = {
            "restartPolicy": "Never",  # a failed pod fails the Job; the JobSet restarts all of them
            "terminationGracePeriodSeconds": grace,
            "containers": [{**container, "resources": _resources(shape, options), "volumeMounts": mounts}],
            "volumes": volumes,
        }
        job = _jobset(cfg, meta, options, pod)
    else:
        job = _trainjob(meta, options, container, _resources(shape, options), shape.nproc, mounts, volumes)
    config_map = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(f"{shape.name}-config", options, labels={}),
        "data": {CONFIG_FILE: yaml.safe_dump(cfg.model_dump(mode="json", exclude={"launch"}), sort_keys=False)},
    }
    head = (
        f"# meshrun job rendered by `meshrun k8s`: run_dir {json.dumps(cfg.run_dir)}, {cfg.world_size} workers "
        f"({cfg.layout.text()}) = {options.nodes} pods x {shape.nproc}.\n"
        "# Apply with `kubectl apply -f THIS_FILE`; the image is docker/Dockerfile's.\n"
    )
    if options.flavor == "jobset":
        head += f"# Needs Kubernetes >= {MIN_KUBERNETES}: the Job's podFailurePolicy is GA there.\n"
    if options.flavor == "trainjob":  # TrainJob's runtime patches cannot set the pod's grace period
        head += (
            f"# A stop's checkpoint needs about {grace} s: give the {TORCH_RUNTIME} runtime's pods that grace period.\n"
        )
    return head + yaml.dump_all([config_map, job], Dumper=_Dumper, sort_keys=False)


def k8s_notes(cfg: Config, options: PodOptions) -> list[str]:
    """What a valid manifest may still get wrong on the cluster, one line each (for stderr)."""
    notes = []
    if options.flavor == "jobset":
        notes.append(f"the JobSet needs Kubernetes >= {MIN_KUBERNETES} (the Job's podFailurePolicy is GA there)")
    for key, path in _local_paths(cfg):
        if not posixpath.isabs(path):
            notes.append(
                f"warning: {key} {json.dumps(path)} is a relative path: the pods resolve it in the image's working "
                "directory, not here; use an absolute path inside the image or on the shared volume (--pvc)"
            )
    return notes


def _local_paths(cfg: Config) -> list[tuple[str, str]]:
    """(key, path) of every config value the pods read as a file or folder of their own."""
    data = cfg.data
    paths = [("data.dir", data.dir)] + [(f"data.mixture[{i}].dir", m.dir) for i, m in enumerate(data.mixture)]
    paths += [(f"data.sources[{i}]", source) for i, source in enumerate(data.sources)]
    if data.tokenizer is not None and data.tokenizer != "byte" and not data.tokenizer.startswith("bpe:"):
        paths.append(("data.tokenizer", data.tokenizer))
    paths.append(("model.hf", getattr(cfg.model, "hf", None)))
    return [(key, str(path)) for key, path in paths if path is not None]


def _shm_gib(shape: JobShape) -> int:
    return max(1, shape.nproc)  # NCCL's shared buffers between a node's workers; no loader workers use it


def _resources(shape: JobShape, options: PodOptions) -> dict[str, Any]:
    """Requests (what Kueue and the scheduler count) and limits; the memory covers /dev/shm too."""
    memory = options.memory or f"{8 * shape.nproc + _shm_gib(shape)}Gi"
    cpus = options.cpus or str(4 * shape.nproc)
    gpu = {"nvidia.com/gpu": shape.gpus} if shape.gpus else {}
    return {"requests": {"cpu": cpus, "memory": memory, **gpu}, "limits": {"memory": memory, **gpu}}


def _volumes(shape: JobShape) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(the container's volumeMounts, the pod's volumes): the config, /dev/shm in memory, the run's claim."""
    mounts = [
        {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
        {"name": "shm", "mountPath": "/dev/shm"},
        *([{"name": "run", "mountPath": shape.volume[1]}] if shape.volume else []),
    ]
    volumes = [
        {"name": "config", "configMap": {"name": f"{shape.name}-config"}},
        {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{_shm_gib(shape)}Gi"}},
        *([{"name": "run", "persistentVolumeClaim": {"claimName": shape.volume[0]}}] if shape.volume else []),
    ]
    return mounts, volumes


class _Dumper(yaml.SafeDumper):
    """safe_dump, with the ConfigMap's config file as a readable block (`|`) instead of one quoted line."""


def _text_block(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)


_Dumper.add_representer(str, _text_block)


def _metadata(name: str, options: PodOptions, *, labels: dict[str, str]) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name}
    if options.namespace is not None:
        meta["namespace"] = options.namespace
    if labels:
        meta["labels"] = labels
    return meta


def _jobset(cfg: Config, meta: dict[str, Any], options: PodOptions, pod: dict[str, Any]) -> dict[str, Any]:
    """One replicated Job of `nodes` indexed pods; stable hostnames through the headless service."""
    job_spec = {
        "parallelism": options.nodes,
        "completions": options.nodes,
        "completionMode": "Indexed",
        "backoffLimit": 0,
        "podFailurePolicy": {  # "stopped with a checkpoint" is told apart from a crash
            "rules": [
                {
                    "action": "FailJob",
                    "onExitCodes": {"containerName": NODE, "operator": "In", "values": [STOPPED_EXIT_CODE]},
                }
            ]
        },
        "template": {"spec": pod},
    }
    spec: dict[str, Any] = {
        "network": {"enableDNSHostnames": True, "subdomain": meta["name"], "publishNotReadyAddresses": True},
        "failurePolicy": {
            "maxRestarts": cfg.launch.max_restarts,
            "rules": [
                {
                    "name": "StoppedWithCheckpoint",
                    "action": "RestartJobSetAndIgnoreMaxRestarts",
                    "onJobFailureReasons": ["PodFailurePolicy"],
                }
            ],
        },
        "replicatedJobs": [{"name": NODE, "replicas": 1, "template": {"spec": job_spec}}],
    }
    if options.queue:
        spec["suspend"] = True  # Kueue admits it
    return {"apiVersion": JOBSET_API, "kind": "JobSet", "metadata": meta, "spec": spec}


def _trainjob(
    meta: dict[str, Any],
    options: PodOptions,
    container: dict[str, Any],
    resources: dict[str, Any],
    nproc: int,
    mounts: list[dict[str, Any]],
    volumes: list[dict[str, Any]],
) -> dict[str, Any]:
    """The torch-distributed runtime's trainer with meshrun's command; volumes by a runtime patch."""
    pod_patch = {"volumes": volumes, "containers": [{"name": NODE, "volumeMounts": mounts}]}
    spec: dict[str, Any] = {
        "runtimeRef": {"name": TORCH_RUNTIME},
        "trainer": {
            "image": container["image"],
            "command": container["command"],
            "args": container["args"],
            "env": container["env"],
            "numNodes": options.nodes,
            "numProcPerNode": nproc,
            "resourcesPerNode": resources,
        },
        "runtimePatches": [
            {
                "manager": "meshrun",
                "trainingRuntimeSpec": {
                    "template": {
                        "spec": {
                            "replicatedJobs": [{"name": NODE, "template": {"spec": {"template": {"spec": pod_patch}}}}]
                        }
                    }
                },
            }
        ],
    }
    if options.queue:
        spec["suspend"] = True
    return {"apiVersion": TRAINJOB_API, "kind": "TrainJob", "metadata": meta, "spec": spec}


def write_manifest(out: str, manifest: str) -> None:
    """`manifest` written to `out` (`--out`), which must not exist: meshrun overwrites nothing."""
    if Path(out).exists():
        raise ConfigError(f"--out {out} exists; meshrun does not overwrite it: choose a new file or remove it")
    try:
        write_atomic(out, manifest, replace=False)  # never over a file that appeared meanwhile
    except OSError as exc:
        raise ConfigError(f"--out {out} cannot be written ({exc.strerror or exc}); choose another path") from None
