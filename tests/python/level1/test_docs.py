"""Every runnable code block of README.md and docs/*.md runs as written, and so does every example
of examples/ (hypershard/testing/doc_blocks.py: the markers and the example commands).

The work dir is prepared once by the docs' setup block (`python -m hypershard.testing.fixtures
--out fixtures --families qwen3`: the tiny model folder, hypershard.sft's data and LlamaFactory's
dataset folder). Each block runs in its own folder beside it, with `fixtures/` and the repository's
`examples/` linked in:

- `python` blocks: all in ONE interpreter, each compiled and executed in a fresh namespace from
  its own folder (one torch import instead of one per block);
- `torchrun N` blocks: `torchrun --nproc-per-node N BLOCK.py`;
- `shell` blocks: `bash -e BLOCK.sh`, the venv's bin first on PATH (`python`, `torchrun`).

torchrun runs with PET_STANDALONE=1 (its `--standalone`: a free port), so the documented commands
do not collide with another torchrun on the machine. A failure names the doc, the block's line,
the command and the tail of its output.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hypershard.testing import doc_blocks

ROOT = doc_blocks.ROOT
BLOCKS = doc_blocks.all_blocks()
RUN = [b for b in BLOCKS if b.kind in ("python", "torchrun", "shell")]
PYTHON = [b for b in RUN if b.kind == "python"]
TIMEOUT = {"python": 180, "torchrun": 300, "shell": 420}
TAIL = 6000


def _env() -> dict:
    bin_dir = str(Path(sys.executable).parent)
    return {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        "OMP_NUM_THREADS": "1",
        "PET_STANDALONE": "1",
        "HYPERSHARD_LLAMAFACTORY_TIMEOUT": "360",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONUNBUFFERED": "1",
    }


def _run(command, cwd: Path, timeout: int, what: str) -> str:
    """Runs `command` in its own process group (killed whole at the timeout: torchrun's ranks too)."""
    process = subprocess.Popen(
        command,
        cwd=cwd,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        text, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        text, _ = process.communicate()
        pytest.fail(f"{what}: still running after {timeout} s: {' '.join(map(str, command))}\n{text[-TAIL:]}")
    assert process.returncode == 0, (
        f"{what}: exit {process.returncode}: {' '.join(map(str, command))} (in {cwd})\n{text[-TAIL:]}"
    )
    return text


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """The work dir, prepared by the docs' setup block (the fixtures command)."""
    root = tmp_path_factory.mktemp("docs")
    setups = {b.text for b in BLOCKS if b.kind == "setup"}
    assert len(setups) == 1, f"one setup text expected (tests/python/unit/test_doc_blocks.py): {setups}"
    block = next(b for b in BLOCKS if b.kind == "setup")
    script = root / "setup.sh"
    script.write_text(block.text)
    _run(["bash", "-e", str(script)], root, 300, f"{block.where} (setup)")
    assert (root / "fixtures" / "models" / "qwen3" / "config.json").is_file()
    return root


def _folder(work: Path, name: str) -> Path:
    folder = work / name
    folder.mkdir()
    (folder / "fixtures").symlink_to(work / "fixtures")
    (folder / "examples").symlink_to(ROOT / "examples")
    return folder


def _name(block) -> str:
    return f"{block.doc.replace('/', '_').replace('.md', '')}_{block.line}"


_RUNNER = textwrap.dedent(
    """
    import os, sys, traceback
    for path in sys.argv[1:]:
        os.chdir(os.path.dirname(path))
        print(f"@@@ start {path}", flush=True)
        try:
            exec(compile(open(path).read(), path, "exec"), {"__name__": "__main__", "__file__": path})
            print(f"@@@ ok {path}", flush=True)
        except BaseException:
            traceback.print_exc(file=sys.stdout)
            print(f"@@@ failed {path}", flush=True)
    """
)


@pytest.fixture(scope="module")
def python_outputs(work) -> dict:
    """The `python` blocks, run in one interpreter (fresh namespace and folder each): {path: (ok, output)}."""
    paths = []
    for block in PYTHON:
        folder = _folder(work, _name(block))
        (folder / "block.py").write_text(block.text)
        paths.append(str(folder / "block.py"))
    runner = work / "run_python_blocks.py"
    runner.write_text(_RUNNER)
    process = subprocess.Popen(
        [sys.executable, str(runner), *paths],
        cwd=work,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        text, _ = process.communicate(timeout=TIMEOUT["python"])
    except subprocess.TimeoutExpired:  # the block running then, and those after it, did not finish
        os.killpg(process.pid, signal.SIGKILL)
        text, _ = process.communicate()
        text += f"\n(the interpreter was stopped after {TIMEOUT['python']} s)"
    outputs, current = {}, None
    for line in text.splitlines():
        if line.startswith("@@@ start "):
            current = line[len("@@@ start ") :]
            outputs[current] = [None, []]
        elif line.startswith(("@@@ ok ", "@@@ failed ")) and current:
            outputs[current][0] = line.startswith("@@@ ok ")
            current = None
        elif current:
            outputs[current][1].append(line)
    return {path: (ok, "\n".join(lines)) for path, (ok, lines) in outputs.items()}


@pytest.mark.parametrize("block", PYTHON, ids=_name)
def test_python_block(block, work, python_outputs):
    path = str(work / _name(block) / "block.py")
    ok, output = python_outputs.get(path, (None, "(never started: the interpreter died before it)"))
    assert ok, f"{block.where} (python): {'failed' if ok is False else 'did not finish'}\n{output[-TAIL:]}"


@pytest.mark.parametrize("block", [b for b in RUN if b.kind != "python"], ids=_name)
def test_block(block, work):
    folder = _folder(work, _name(block))
    if block.kind == "torchrun":
        (folder / "block.py").write_text(block.text)
        command = ["torchrun", "--nproc-per-node", block.argument, "block.py"]
    else:
        (folder / "block.sh").write_text(block.text)
        command = ["bash", "-e", "block.sh"]
    output = _run(command, folder, TIMEOUT[block.kind], f"{block.where} ({block.marker})")
    if "examples/llamafactory/qwen3_dp2_tp2.yaml" in block.text:
        # HF's log line counts sequences per optimizer step: 2 per dp rank x dp2 x accumulation 2
        # (HyperParallelTrainer.get_total_train_batch_size; HF alone would say 32).
        assert "Total train batch size (w. parallel, distributed & accumulation) = 8" in output, output[-TAIL:]
        assert (folder / "saves" / "qwen3-hs" / "model.safetensors").is_file()


@pytest.mark.parametrize("path", list(doc_blocks.EXAMPLE_COMMANDS), ids=lambda p: p.replace("/", "_"))
def test_example(path, work):
    folder = _folder(work, path.replace("/", "_"))
    _run(doc_blocks.EXAMPLE_COMMANDS[path], folder, TIMEOUT["torchrun"], path)
    if path == "examples/train_tp_fully_shard.py":
        assert (folder / "out" / "ckpts" / "step_00000003" / "COMPLETE").is_file()
        assert (folder / "out" / "hf" / "model.safetensors").is_file()


def _options_without_help(help_text: str) -> list:
    """argparse --help lines of options that have no description (the option alone on its line,
    the next line not its description's continuation)."""
    lines = help_text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.strip() in ("options:", "optional arguments:")), None)
    bare = []
    for i, line in enumerate(lines[(start or 0) + 1 :], (start or 0) + 1):
        if not line.startswith("  -") or line.strip().startswith(("-h, --help", "--help")):
            continue
        described = "  " in line.strip()  # the option, two spaces, its description
        following = lines[i + 1] if i + 1 < len(lines) else ""
        if not described and not (following.startswith(" " * 8) and not following.strip().startswith("-")):
            bare.append(line.strip())
    return bare


def test_planner_clis_describe_every_option():
    """--help of the planner's commands, in this process (their main() prints it and exits 0)."""
    import contextlib
    import importlib
    import io

    for module in ("hypershard.planner.validate", "hypershard.plan"):
        out = io.StringIO()
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_:
            importlib.import_module(module).main(["--help"])
        assert exit_.value.code == 0
        bare = _options_without_help(out.getvalue())
        assert not bare, f"{module} --help: options without a description: {bare}"


def test_planted_option_without_help_is_found():
    import argparse

    parser = argparse.ArgumentParser(prog="x")
    parser.add_argument("--mesh", help="the mesh")
    parser.add_argument("--fully-shard", action="store_true")
    assert _options_without_help(parser.format_help()) == ["--fully-shard"]
