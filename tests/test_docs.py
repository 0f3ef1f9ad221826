"""The documentation tells the truth about the code: every config key, config check and flag has a
description (docs/hooks/reference.py generates the reference from them and refuses to build
without one), the site builds with `mkdocs build --strict`, every `meshrun` command shown in docs/
is marked runnable or says what it needs, and the runnable ones run (train on tiny settings)."""

from __future__ import annotations

import argparse
import importlib.util
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import meshrun_env, run_meshrun

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
TINY = ["--set=train.steps=2", "--set=train.eval_interval=0", "--set=train.log_interval=1", "--set=metrics.plots=false"]
_FENCE = re.compile(r"^\s*```(\w*)(.*)$")


def _reference():
    spec = importlib.util.spec_from_file_location("docs_reference", DOCS / "hooks" / "reference.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def shown_commands(page: Path) -> list[tuple[str, list[str]]]:
    """(title, meshrun command lines) of every fenced block of `page` that shows a `meshrun` command
    (output and usage blocks, fenced as text, are not commands)."""
    blocks, lines = [], page.read_text().splitlines()
    i = 0
    while i < len(lines):
        opened = _FENCE.match(lines[i])
        if not opened:
            i += 1
            continue
        language, info = opened.groups()
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
        body = _joined(lines[i + 1 : end])
        commands = [c for c in body if c.startswith("meshrun ")]
        if commands and language not in ("text", "yaml", "python"):
            title = re.search(r'title="([^"]*)"', info)
            blocks.append((title.group(1) if title else "", commands))
        i = end + 1
    return blocks


def _joined(lines: list[str]) -> list[str]:
    """Shell lines with `\\` continuations joined, indentation stripped."""
    out, pending = [], ""
    for line in lines:
        pending += line.strip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        out.append(pending)
        pending = ""
    return out


PAGES = sorted(DOCS.rglob("*.md"))
RUNNABLE = [p for p in PAGES if any(t.startswith("runnable") for t, _ in shown_commands(p))]


def test_every_key_check_and_flag_is_described() -> None:
    assert _reference().undocumented() == []


def test_a_missing_description_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check can fail: a key without a docstring and a flag without help are each named."""
    reference = _reference()
    from meshrun.config.schema import Config, TrainConfig

    monkeypatch.setattr(TrainConfig.model_fields["lr"], "description", None)
    monkeypatch.setattr(Config.model_fields["run_dir"], "description", "")
    build = reference.build_parser

    def with_bare_flag() -> argparse.ArgumentParser:
        parser = build()
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        sub.choices["train"].add_argument("--bare")
        return parser

    monkeypatch.setattr(reference, "build_parser", with_bare_flag)
    assert reference.undocumented() == [
        "config key run_dir",
        "config key train.lr",
        "flag ['--bare'] of meshrun train",
    ]


def test_the_site_builds_strict(tmp_path: Path) -> None:
    """Broken links, missing pages, an undescribed key or flag: the build fails (as in .ci/run)."""
    pytest.importorskip("mkdocs")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    config_page = (tmp_path / "site" / "reference" / "config" / "index.html").read_text()
    assert "train.global_batch" in config_page and "Refused:" in config_page  # generated from the schema
    assert "fonts.googleapis" not in (tmp_path / "site" / "index.html").read_text()  # nothing fetched offline


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(DOCS)))
def test_every_shown_command_says_whether_it_runs_here(page: Path) -> None:
    """A block showing `meshrun ...` is titled `runnable` (tests run it) or `needs ...` (a cluster, a
    GPU, your files): a reader knows which to copy."""
    for title, commands in shown_commands(page):
        assert title.startswith(("runnable", "needs ")), f"{page}: block {commands[0]!r} has no runnable/needs title"


@pytest.mark.parametrize("page", [*PAGES, REPO / "README.md"], ids=lambda p: str(p.relative_to(REPO)))
def test_globs_in_shown_commands_are_quoted(page: Path) -> None:
    """A shell expands an unquoted glob: several matches become extra arguments, which the command
    refuses (`unrecognized arguments`). meshrun expands the globs it is given itself."""
    for _, commands in shown_commands(page):
        for line in commands:
            words = shlex.split(line.split(" #")[0], posix=False)  # quotes kept on the words
            bare = [w for w in words if any(c in w for c in "*?[") and w[0] not in "'\""]
            assert not bare, f"{page}: quote {bare} in {line!r}"


def test_readme_links_lead_somewhere() -> None:
    """The README is short and points into docs/: every relative link exists (or is generated)."""
    generated = {"docs/reference/config.md", "docs/reference/cli.md", "docs/benchmarks/details.md"}
    for target in re.findall(r"\]\(([^)#]+)", (REPO / "README.md").read_text()):
        if not target.startswith("http"):
            assert (REPO / target).exists() or target in generated, target


@pytest.fixture(scope="module")
def default_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default job as the docs' first command runs it, on tiny settings (2 steps)."""
    where = tmp_path_factory.mktemp("docs-run")
    (where / "configs").symlink_to(REPO / "configs")
    run_meshrun(["train", *TINY], tmp_path=where, timeout=600)
    return where


@pytest.mark.parametrize("page", RUNNABLE, ids=lambda p: str(p.relative_to(DOCS)))
def test_runnable_commands_run(
    page: Path, default_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """Every command of a `runnable` block, in order, beside a copy of the default run: `train`
    is checked whole by `--dry-run` on tiny settings, in this process (the default job itself
    trains once, in the fixture); the other commands run as written, as processes."""
    from meshrun.cli import main

    shutil.copytree(default_run / "runs", tmp_path / "runs", symlinks=True)
    (tmp_path / "configs").symlink_to(REPO / "configs")
    env = meshrun_env(default_run)  # the prepared data
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_CACHE_HOME", env["XDG_CACHE_HOME"])
    for title, commands in shown_commands(page):
        for line in commands if title.startswith("runnable") else []:
            args = shlex.split(line, comments=True)[1:]
            if args[0] != "train":
                run_meshrun(args, tmp_path=tmp_path, env=env, timeout=300)
                continue
            dry_run = [*args, *TINY, "--set=run_dir=runs/docs-check", "--dry-run"]  # beside the run, not over it
            assert main(dry_run) == 0, f"{line}\n{capsys.readouterr().err[-3000:]}"
