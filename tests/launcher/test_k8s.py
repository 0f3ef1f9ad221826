"""`meshrun k8s`: the manifest against the JobSet / TrainJob APIs, every refusal, and the pods'
contract executed: two "pods" in network namespaces, each with the hostname, /etc/hosts and
environment Kubernetes gives a JobSet pod, run the manifest's own container command.

The API rules checked (`check_jobset`, `check_trainjob`) are read from the published types:
JobSet `jobset.x-k8s.io/v1alpha2` (kubernetes-sigs/jobset, api/jobset/v1alpha2/jobset_types.go),
Kubeflow Trainer `trainer.kubeflow.org/v1alpha1` (kubeflow/trainer,
pkg/apis/trainer/v1alpha1/trainjob_types.go, with `runtimePatches`, which replaced
`podTemplateOverrides` in 2026), the Job and Pod rules of batch/v1 and core/v1, and Kueue's
queue label.
"""

from __future__ import annotations

import json
import re
import shlex
import signal
from pathlib import Path
from typing import Any

import netns
import pytest
import yaml
from conftest import REPO, kill_tree, losses, meshrun_env, run_meshrun, tiny
from jobset_pods import JobSetPods, wait_for

from meshrun.checkpoint.paths import complete_checkpoints, step_of
from meshrun.config.schema import load_config

DNS_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")  # RFC 1035, <= 63: JobSet / TrainJob / pod hostnames
SECRET = "wandb-secret-value-4c1d"  # must never appear in a manifest


def render(args: list[str], tmp_path: Path, **env: str) -> list[dict[str, Any]]:
    """`meshrun k8s ARGS` through the real CLI; its YAML stream, comments and all, parsed."""
    result = run_meshrun(["k8s", *args], tmp_path=tmp_path, timeout=120, env=meshrun_env(tmp_path, **env))
    assert SECRET not in result.stdout
    assert result.stdout.startswith("# meshrun job rendered by `meshrun k8s`")
    return list(yaml.safe_load_all(result.stdout))


# ---- the API rules -------------------------------------------------------------------------


def check_pod_spec(pod: dict[str, Any], *, in_job: bool) -> dict[str, Any]:
    """core/v1 PodSpec: containers need name and image; a Job's pods restart Never or OnFailure
    (podFailurePolicy needs Never); every volumeMount names a volume; env vars have a name and
    either a value or valueFrom, never both."""
    (container,) = pod["containers"]
    assert container["name"] and container["image"]
    if in_job:
        assert pod["restartPolicy"] == "Never"
        assert isinstance(pod["terminationGracePeriodSeconds"], int) and pod["terminationGracePeriodSeconds"] > 0
    volumes = {v["name"] for v in pod["volumes"]}
    assert {m["name"] for m in container["volumeMounts"]} <= volumes
    for var in container.get("env", []):
        assert var["name"] and (("value" in var) != ("valueFrom" in var))
    return container


def check_jobset(jobset: dict[str, Any], *, nodes: int) -> dict[str, Any]:
    """JobSet v1alpha2: metadata.name a DNS label; spec.replicatedJobs[] with name, replicas and
    a batch/v1 JobTemplateSpec; network.enableDNSHostnames gives pods the hostname
    <jobset>-<replicatedJob>-<jobIndex>-<podIndex> under network.subdomain (the headless
    service); failurePolicy.maxRestarts an int32 and rules[] with name (^[A-Za-z]...), action in
    the enum and onJobFailureReasons among the Job's failure reasons. Job: completionMode
    Indexed, parallelism = completions (one pod per index, JOB_COMPLETION_INDEX set), and a
    podFailurePolicy rule's onExitCodes with operator In / NotIn."""
    assert jobset["apiVersion"] == "jobset.x-k8s.io/v1alpha2" and jobset["kind"] == "JobSet"
    name = jobset["metadata"]["name"]
    assert DNS_LABEL.fullmatch(name)
    spec = jobset["spec"]
    assert spec["network"]["enableDNSHostnames"] is True and DNS_LABEL.fullmatch(spec["network"]["subdomain"])
    policy = spec["failurePolicy"]
    assert isinstance(policy["maxRestarts"], int) and 0 <= policy["maxRestarts"] < 2**31
    for rule in policy["rules"]:
        assert re.fullmatch(r"[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?", rule["name"])
        assert rule["action"] in (
            "FailJobSet",
            "RestartJobSet",
            "RestartJobSetAndIgnoreMaxRestarts",
            "RestartJob",
            "RestartJobAndIgnoreMaxRestarts",
        )
        assert set(rule["onJobFailureReasons"]) <= {
            "BackoffLimitExceeded",
            "DeadlineExceeded",
            "FailedIndexes",
            "MaxFailedIndexesExceeded",
            "PodFailurePolicy",
        }
    (replicated,) = spec["replicatedJobs"]
    assert DNS_LABEL.fullmatch(replicated["name"]) and replicated["replicas"] == 1
    job = replicated["template"]["spec"]
    assert job["completionMode"] == "Indexed" and job["parallelism"] == job["completions"] == nodes
    assert job["backoffLimit"] == 0
    for rule in job["podFailurePolicy"]["rules"]:
        assert rule["action"] in ("FailJob", "FailIndex", "Ignore", "Count")
        assert rule["onExitCodes"]["operator"] in ("In", "NotIn") and 0 not in rule["onExitCodes"]["values"]
    assert len(f"{name}-{replicated['name']}-0-{nodes - 1}") <= 63  # the last pod's hostname
    return check_pod_spec(job["template"]["spec"], in_job=True)


def check_trainjob(trainjob: dict[str, Any], *, nodes: int) -> dict[str, Any]:
    """TrainJob v1alpha1: metadata.name an RFC 1035 label <= 63; spec.runtimeRef.name required
    (kind defaults to ClusterTrainingRuntime); spec.trainer {image, command, args (<= 128
    items), env (name-keyed), numNodes, numProcPerNode, resourcesPerNode}; runtimePatches[]
    keyed by `manager`, each patching replicatedJobs by name down to the pod's volumes and its
    containers' volumeMounts (env of the `node` container only through spec.trainer.env)."""
    assert trainjob["apiVersion"] == "trainer.kubeflow.org/v1alpha1" and trainjob["kind"] == "TrainJob"
    assert DNS_LABEL.fullmatch(trainjob["metadata"]["name"])
    spec = trainjob["spec"]
    assert spec["runtimeRef"] == {"name": "torch-distributed"}
    trainer = spec["trainer"]
    assert trainer["numNodes"] == nodes and trainer["image"] and len(trainer["args"]) <= 128
    assert len({v["name"] for v in trainer["env"]}) == len(trainer["env"])
    (patch,) = spec["runtimePatches"]
    assert patch["manager"]
    (replicated,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    assert replicated["name"] == "node"
    pod = replicated["template"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["name"] == "node" and set(container) == {"name", "volumeMounts"}
    assert {m["name"] for m in container["volumeMounts"]} <= {v["name"] for v in pod["volumes"]}
    return {**trainer, "volumeMounts": container["volumeMounts"], "volumes": pod["volumes"]}


# ---- rendering -----------------------------------------------------------------------------

JOB = [
    "--set=parallel.dp=4",
    "--set=parallel.pp=2",
    "--set=train.global_batch=32",
    "--set=run_dir=/runs/exp-1",
    "--image=reg.example/meshrun:1",
]


@pytest.mark.parametrize("flavor", ["jobset", "trainjob"])
def test_every_option_round_trips_into_the_manifest(flavor: str, tmp_path: Path) -> None:
    docs = render(
        [
            *JOB,
            "--set=launch.max_restarts=3",
            "--nodes=2",
            "--gpus-per-node=4",
            f"--flavor={flavor}",
            "--queue=team-a",
            "--namespace=ml",
            "--pvc=runs-claim:/runs",
            "--env=NCCL_DEBUG=INFO",
            "--wandb-secret=wandb:key",
            "--cpus=16",
            "--memory=200Gi",
            "--grace-seconds=900",
            "--name=exp-1",
        ],
        tmp_path,
        WANDB_API_KEY=SECRET,
    )
    config_map, job = docs
    assert config_map["kind"] == "ConfigMap" and config_map["metadata"] == {"name": "exp-1-config", "namespace": "ml"}
    assert job["metadata"] == {"name": "exp-1", "namespace": "ml", "labels": {"kueue.x-k8s.io/queue-name": "team-a"}}
    assert job["spec"]["suspend"] is True
    container = check_jobset(job, nodes=2) if flavor == "jobset" else check_trainjob(job, nodes=2)
    assert container["image"] == "reg.example/meshrun:1" and container["command"] == ["meshrun"]
    assert container["args"] == [
        "train",
        "/etc/meshrun/config.yaml",
        "--nnodes=2",
        "--nproc-per-node=4",
        # pod 0 under the headless service; a TrainJob's JobSet is named after it (the torch plugin's
        # PET_MASTER_ADDR) and its trainer container declares port 29500
        f"--rdzv-endpoint=exp-1-node-0-0.exp-1:{29400 if flavor == 'jobset' else 29500}",
        "--rdzv-id=exp-1",
        "--local-addr=$(POD_IP)",
        "--node-rank=$(JOB_COMPLETION_INDEX)",
        f"--max-restarts={0 if flavor == 'jobset' else 3}",
    ]
    assert container["env"] == [
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "NCCL_DEBUG", "value": "INFO"},
        {"name": "WANDB_API_KEY", "valueFrom": {"secretKeyRef": {"name": "wandb", "key": "key"}}},
    ]
    resources = container["resources"] if flavor == "jobset" else container["resourcesPerNode"]
    gpus = {"nvidia.com/gpu": 4}
    assert resources == {"requests": {"cpu": "16", "memory": "200Gi", **gpus}, "limits": {"memory": "200Gi", **gpus}}
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts == {"config": "/etc/meshrun", "shm": "/dev/shm", "run": "/runs"}
    volumes = {v["name"]: v for v in (job_pod(job)["volumes"] if flavor == "jobset" else container["volumes"])}
    assert volumes["run"]["persistentVolumeClaim"] == {"claimName": "runs-claim"}
    assert volumes["shm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "4Gi"}
    assert volumes["config"]["configMap"] == {"name": "exp-1-config"}
    if flavor == "jobset":
        assert job["spec"]["failurePolicy"]["maxRestarts"] == 3
        assert job_pod(job)["terminationGracePeriodSeconds"] == 900
    # the ConfigMap's config is the resolved one: it loads back to the same config (launch: from the flags)
    (tmp_path / "config.yaml").write_text(config_map["data"]["config.yaml"])
    mounted = load_config(tmp_path / "config.yaml")
    expected = load_config(None, [a.removeprefix("--set=") for a in JOB if a.startswith("--set")])
    assert mounted.model_dump(exclude={"launch"}) == expected.model_dump(exclude={"launch"})


def job_pod(jobset: dict[str, Any]) -> dict[str, Any]:
    return jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]


def test_defaults_one_gpu_per_worker_no_queue_and_a_grace_period_for_a_save(tmp_path: Path) -> None:
    _, jobset = render([*JOB, "--nodes=2", "--pvc=runs:/runs"], tmp_path)
    container = check_jobset(jobset, nodes=2)
    assert jobset["metadata"] == {"name": "exp-1"} and "suspend" not in jobset["spec"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert [v["name"] for v in container["env"]] == ["POD_IP"]
    assert job_pod(jobset)["terminationGracePeriodSeconds"] >= 120


def test_one_node_cpu_needs_no_volume_nor_rendezvous(tmp_path: Path) -> None:
    _, jobset = render(["--image=img", "--nodes=1", "--gpus-per-node=0", "--set=run_dir=runs/x"], tmp_path)
    container = check_jobset(jobset, nodes=1)
    assert container["args"] == [
        "train",
        "/etc/meshrun/config.yaml",
        "--nnodes=1",
        "--nproc-per-node=4",  # the default config's dp 2 x pp 2
        "--max-restarts=0",
    ]
    assert "nvidia.com/gpu" not in container["resources"]["requests"]
    assert "run" not in {m["name"] for m in container["volumeMounts"]}


def test_relative_paths_are_warned_and_the_kubernetes_version_named(tmp_path: Path) -> None:
    """The pods resolve a relative data.dir / model.hf in the image, not here; the JobSet's
    podFailurePolicy needs Kubernetes 1.31 (GA), named in the header and on stderr. An --env value
    with a newline reaches the pod unchanged."""
    llama = {"model_type": "llama", "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2}
    llama |= {"num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 256, "max_position_embeddings": 256}
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text(json.dumps(llama))
    flags = ["--image=img", "--nodes=1", "--set=data.dir=data", "--set=model.hf=llama", "--env=NOTE=two\nlines"]
    result = run_meshrun(["k8s", *flags], tmp_path=tmp_path, timeout=120)
    assert "# Needs Kubernetes >= 1.31" in result.stdout
    assert "the JobSet needs Kubernetes >= 1.31" in result.stderr
    for key, path in (("data.dir", "data"), ("model.hf", "llama")):
        assert f'warning: {key} "{path}" is a relative path' in result.stderr, result.stderr
    _, jobset = yaml.safe_load_all(result.stdout)
    assert {"name": "NOTE", "value": "two\nlines"} in job_pod(jobset)["containers"][0]["env"]
    absolute = run_meshrun(["k8s", "--image=img", "--nodes=1", f"--set=data.dir={tmp_path}/data"], tmp_path=tmp_path)
    assert "relative path" not in absolute.stderr


def test_out_writes_a_new_file_and_never_overwrites(tmp_path: Path) -> None:
    out = tmp_path / "job.yaml"
    run_meshrun(["k8s", "--image=img", "--nodes=1", f"--out={out}"], tmp_path=tmp_path, timeout=120)
    assert [d["kind"] for d in yaml.safe_load_all(out.read_text())] == ["ConfigMap", "JobSet"]
    out.write_text("mine")
    result = run_meshrun(
        ["k8s", "--image=img", "--nodes=1", f"--out={out}"], tmp_path=tmp_path, timeout=120, check=False
    )
    assert result.returncode == 2 and "exists" in result.stderr and out.read_text() == "mine"


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--nodes=2"], "needs --pvc CLAIM:/MOUNT"),
        (["--nodes=2", "--pvc=runs:/runs", "--set=run_dir=runs/x"], "is not on the shared volume"),
        (["--nodes=2", "--pvc=runs:/data", "--set=run_dir=/runs/x"], "is not on the shared volume"),
        (["--nodes=2", "--pvc=runs", "--set=run_dir=/runs/x"], "use CLAIM:/MOUNT"),
        (["--nodes=2", "--pvc=runs:/etc", "--set=run_dir=/etc/x"], "overlaps /etc/meshrun"),
        (["--nodes=3", "--pvc=runs:/runs", "--set=run_dir=/runs/x"], "--nodes 3 must divide"),
        (["--nodes=2", "--gpus-per-node=8", "--pvc=runs:/runs", "--set=run_dir=/runs/x"], "--gpus-per-node is 8"),
        (["--nodes=1", f"--env=WANDB_API_KEY={SECRET}"], "Secret"),
        (["--nodes=1", f"--env=HF_TOKEN={SECRET}"], "Secret"),
        (["--nodes=1", "--env=NOEQUALS"], "KEY=VALUE"),
        (["--nodes=1", "--env=JOB_COMPLETION_INDEX=3"], "Kubernetes sets"),
        (["--nodes=1", "--set=tracker.mode=online"], "--wandb-secret"),
        (["--nodes=1", "--wandb-secret=Bad_Name"], "SECRET_NAME"),
        (["--nodes=1", "--name=Exp_1"], "--name"),
        (["--nodes=1", "--name=" + "a" * 60], "at most 54"),
        (["--nodes=1", "--set=run_dir=runs/__"], "pass --name"),
        (["--nodes=1", "--namespace=ML"], "--namespace"),
        (["--nodes=1", "--queue=a b"], "--queue"),
        (["--nodes=1", "--memory=lots"], "--memory"),
        (["--nodes=1", "--cpus=0"], "--cpus"),
        (["--nodes=1", "--grace-seconds=0"], "--grace-seconds"),
        (["--nodes=1", "--image=a b"], "--image"),
        (["--nodes=1", "--set=train.steps=0"], "train.steps"),
        (["--nodes=1", "--set=train.resume=none"], "train.resume is none"),
        (["--nodes=0"], "--nodes must be from 1 to 100,000"),
        (["--nodes=-3"], "--nodes must be from 1 to 100,000"),
        (["--nodes=100001", "--pvc=runs:/runs", "--set=run_dir=/runs/x"], "limit for an Indexed Job"),
    ],
)
def test_bad_input_exits_2_with_one_line(flags: list[str], message: str, tmp_path: Path) -> None:
    args = ["k8s", "--image=img", *flags] if not any(f.startswith("--image") for f in flags) else ["k8s", *flags]
    result = run_meshrun(
        args, tmp_path=tmp_path, timeout=120, check=False, env=meshrun_env(tmp_path, WANDB_API_KEY=SECRET)
    )
    assert result.returncode == 2, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and message in result.stderr, result.stderr
    assert SECRET not in result.stderr and result.stdout == ""


def test_the_image_the_manifest_expects_installs_the_extras(tmp_path: Path) -> None:
    """docker/Dockerfile installs meshrun with hf and tensorboard (tests/docker builds it), and the
    Kubernetes page's flow (docs/launch/kubernetes.md) renders as written."""
    assert '"/tmp/meshrun-src[hf,tensorboard]"' in (REPO / "docker" / "Dockerfile").read_text()
    (line,) = [
        ln
        for ln in (REPO / "docs" / "launch" / "kubernetes.md").read_text().splitlines()
        if ln.startswith("meshrun k8s ")
    ]
    command = shlex.split(line.split("|")[0])
    assert command[:2] == ["meshrun", "k8s"]
    result = run_meshrun([*command[1:2], str(REPO / command[2]), *command[3:]], tmp_path=tmp_path, timeout=120)
    assert [d["kind"] for d in yaml.safe_load_all(result.stdout)] == ["ConfigMap", "JobSet"]


@pytest.mark.parametrize("rank,host", [("0", "true"), ("1", "false")])
def test_node_rank_says_which_pod_hosts_the_rendezvous(rank: str, host: str, tmp_path: Path) -> None:
    """The completion index reaches `meshrun train --node-rank`: c10d cannot tell from a service name."""
    flags = ["--set=parallel.dp=2", "--nnodes=2", "--rdzv-endpoint=job-node-0-0.job:29400", f"--node-rank={rank}"]
    result = run_meshrun(["train", *flags, "--dry-run"], tmp_path=tmp_path, timeout=60)
    assert f"host_node: {host}" in result.stdout


@pytest.mark.parametrize("extra", [["--node-rank=-1"], ["--node-rank=0", "--no-host-node"]])
def test_bad_node_rank_exits_2_with_one_line(extra: list[str], tmp_path: Path) -> None:
    flags = ["--set=parallel.dp=2", "--nnodes=2", "--rdzv-endpoint=h:1", *extra, "--dry-run"]
    result = run_meshrun(["train", *flags], tmp_path=tmp_path, timeout=60, check=False)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1 and "--node-rank" in result.stderr


# ---- the pods' contract, executed -----------------------------------------------------------


@pytest.fixture
def two_hosts():
    yield from netns.two_hosts()


SETTINGS = {"parallel.dp": 2, "train.steps": 60, "checkpoint.interval": 4}  # dp 2: one worker per pod


def newest_step(run: Path) -> int:
    return max((step_of(c) for c in complete_checkpoints(run)), default=0)


def logs(pods: JobSetPods, *, tail: int | None = 3000) -> str:
    """The current attempt's pod logs (by default their ends: for failure messages)."""
    return "\n".join(pods.log(index).read_text()[-tail if tail else 0 :] for index in range(len(pods.hosts)))


@pytest.mark.timeout(600)
def test_two_pods_rendezvous_train_and_resume_after_a_kill_and_a_preemption(
    two_hosts, data_dir: Path, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The manifest's container command in two JobSet "pods": they find pod 0 by its headless
    service name and train dp=2 across them. Attempt 1: one pod is killed after a checkpoint; its
    Job fails and the JobSet recreates every pod. Attempt 2 resumes, then every pod is deleted
    (preemption: SIGTERM): each checkpoints and exits with the code the Job's podFailurePolicy
    matches (a restart that does not count). Attempt 3 resumes from that checkpoint and finishes
    with the losses of a one-node run of the same config."""
    volume = tmp_path / "pvc"  # the PersistentVolumeClaim: one folder both "pods" see
    flags = ["--image=meshrun:test", "--nodes=2", "--gpus-per-node=0", f"--pvc=runs:{volume}", "--name=job"]
    config_map, jobset = render([*tiny(data_dir, volume / "run", **SETTINGS), *flags], tmp_path)
    pods = JobSetPods(
        config_map,
        check_jobset(jobset, nodes=2),
        jobset=jobset["metadata"]["name"],
        replicated_job=jobset["spec"]["replicatedJobs"][0]["name"],
        subdomain=jobset["spec"]["network"]["subdomain"],
        hosts=two_hosts,
        workdir=tmp_path,
    )
    run = volume / "run"

    first = pods.start()
    try:
        wait_for(
            lambda: newest_step(run) > 0 or any(p.poll() is not None for p in first), timeout=300, what="a checkpoint"
        )
        kill_tree(first[1].pid)  # pod 1 dies (its node is lost)
    finally:
        pods.delete(first)  # its Job fails: the JobSet deletes every pod and creates them again
    killed_at = newest_step(run)
    assert first[1].returncode == -signal.SIGKILL and 0 < killed_at < SETTINGS["train.steps"], logs(pods)

    second = pods.start()
    try:
        wait_for(
            lambda: newest_step(run) > killed_at or any(p.poll() is not None for p in second),
            timeout=300,
            what="a checkpoint after the restart",
        )
    finally:
        pods.delete(second)  # preempted: SIGTERM to every pod, SIGKILL after the grace period
    (rule,) = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["podFailurePolicy"]["rules"]
    assert [p.returncode for p in second] == rule["onExitCodes"]["values"] * 2, logs(pods)
    assert f"at step {killed_at}" in logs(pods, tail=None)  # resumed from attempt 1's checkpoint
    stopped_at = newest_step(run)
    assert killed_at < stopped_at < SETTINGS["train.steps"], logs(pods)

    third = pods.start()
    try:
        for proc in third:
            proc.wait(timeout=300)
    finally:
        pods.delete(third, grace=0)
    assert [p.returncode for p in third] == [0, 0], logs(pods)
    assert f"at step {stopped_at}" in logs(pods, tail=None)
    assert losses(run) == one_node_losses(data_dir, tmp_path_factory) and len(losses(run)) == SETTINGS["train.steps"]


@pytest.mark.timeout(600)
def test_two_trainjob_pods_rendezvous_and_train(
    two_hosts, data_dir: Path, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The TrainJob's command in the pods the torch-distributed runtime makes: the JobSet named
    after the TrainJob, replicated job `node`, and the PET_* variables the Trainer's torch plugin
    adds to the container (torchrun reads them as defaults; meshrun's flags must win)."""
    volume = tmp_path / "pvc"
    flags = ["--image=meshrun:test", "--nodes=2", "--gpus-per-node=0", f"--pvc=runs:{volume}", "--name=tj"]
    config_map, trainjob = render([*tiny(data_dir, volume / "run", **SETTINGS), *flags, "--flavor=trainjob"], tmp_path)
    trainer = check_trainjob(trainjob, nodes=2)
    name = trainjob["metadata"]["name"]
    torch_plugin = {
        "PET_NNODES": str(trainer["numNodes"]),
        "PET_NPROC_PER_NODE": str(trainer["numProcPerNode"]),
        "PET_MASTER_ADDR": f"{name}-node-0-0.{name}",
        "PET_MASTER_PORT": "29500",
    }
    pods = JobSetPods(
        config_map,
        trainer,
        jobset=name,
        replicated_job="node",
        subdomain=name,
        hosts=two_hosts,
        workdir=tmp_path,
        added_env=[{**torch_plugin, "PET_NODE_RANK": str(index)} for index in range(2)],
    )
    procs = pods.start()
    try:
        for proc in procs:
            proc.wait(timeout=300)
    finally:
        pods.delete(procs, grace=0)
    assert [p.returncode for p in procs] == [0, 0], logs(pods)
    assert losses(volume / "run") == one_node_losses(data_dir, tmp_path_factory)


_one_node: list[float] = []


def one_node_losses(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    """The same config on one node (`meshrun train`, 2 workers), run once per session."""
    if not _one_node:
        tmp = tmp_path_factory.mktemp("one-node")
        run_meshrun(["train", *tiny(data_dir, tmp / "run", **SETTINGS)], tmp_path=tmp)
        _one_node.extend(losses(tmp / "run"))
    return _one_node
