"""``python -m hypershard.integrations.llamafactory train cfg.yaml``: LlamaFactory's own CLI, with
hypershard answering its ``use_hyper_parallel`` hook.

How LlamaFactory finds the integration. Its sft stage checks
``importlib.util.find_spec("hyper_parallel")`` and imports
``hyper_parallel.integration.llamafactory``. hypershard does not install a package of that name
(a real Hyper-Parallel install would be shadowed, or would shadow us, depending on path order).
Instead this launcher, in its own process only, puts a meta-path finder at the END of
``sys.meta_path`` that answers for ``hyper_parallel``, ``hyper_parallel.integration`` and
``hyper_parallel.integration.llamafactory`` -- and only when no real ``hyper_parallel`` is
importable: with Hyper-Parallel installed, the launcher says so and leaves it in charge. A plain
``llamafactory-cli`` never sees hypershard.

torchaudio. PyPI's torchaudio wheel is a CUDA build that fails to load with the CPU torch, and
``llamafactory/data/mm_plugin.py`` imports it at module level (for audio inputs only). When
``import torchaudio`` fails, the launcher registers a stand-in module whose every attribute raises
a clear error; where a real torchaudio loads, nothing is changed. Audio training is out of scope.

Launching. Under torchrun (RANK set) each process runs LlamaFactory's ``run_exp``. Without it,
``FORCE_TORCHRUN=1`` / ``NPROC_PER_NODE=N`` (LlamaFactory's own switches) make the launcher start
``torchrun --standalone --nproc-per-node N -m hypershard.integrations.llamafactory ...`` itself,
as ``llamafactory-cli`` would start its own launcher; otherwise one process runs.
``DISABLE_VERSION_CHECK=1`` is set (unless given): LlamaFactory 0.9.5 pins transformers<=5.6,
hypershard runs it on 5.18.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import subprocess
import sys
import types

ALIAS_ROOT = "hyper_parallel"
ALIAS_MODULE = "hyper_parallel.integration.llamafactory"
TARGET_MODULE = "hypershard.integrations.llamafactory"

USAGE = """usage: python -m hypershard.integrations.llamafactory train CONFIG.yaml [key=value ...]
       torchrun --nproc-per-node N -m hypershard.integrations.llamafactory train CONFIG.yaml
       FORCE_TORCHRUN=1 NPROC_PER_NODE=N python -m hypershard.integrations.llamafactory train CONFIG.yaml

CONFIG.yaml is a LlamaFactory training YAML with `use_hyper_parallel: true` and
`hyper_parallel_args: FILE.json` (see docs/llamafactory.md). Other LlamaFactory commands are passed
to llamafactory-cli unchanged."""


# ------------------------------------------------------------------------------ hyper_parallel

class _AliasFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers for the three ``hyper_parallel`` module names LlamaFactory imports: two empty
    packages and one module re-exporting hypershard's HyperParallelArguments / HyperParallelTrainer.
    Appended to sys.meta_path, so any real finder that knows these names is asked first."""

    _packages = (ALIAS_ROOT, "hyper_parallel.integration")

    def find_spec(self, fullname, path=None, target=None):
        if fullname in self._packages:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        if fullname == ALIAS_MODULE:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=False)
        return None

    def create_module(self, spec):
        return None  # a fresh module

    def exec_module(self, module):
        module.__doc__ = f"hypershard's implementation of LlamaFactory's use_hyper_parallel contract ({TARGET_MODULE})"
        if module.__name__ in self._packages:
            module.__path__ = []
            return
        target = importlib.import_module(TARGET_MODULE)
        module.HyperParallelArguments = target.HyperParallelArguments
        module.HyperParallelTrainer = target.HyperParallelTrainer  # imports LlamaFactory's trainer
        module.__all__ = ["HyperParallelArguments", "HyperParallelTrainer"]


def real_hyper_parallel_installed() -> bool:
    """Whether a real Hyper-Parallel package is importable (our finder not counted)."""
    finders = [f for f in sys.meta_path if not isinstance(f, _AliasFinder)]
    for finder in finders:
        find = getattr(finder, "find_spec", None)
        if find is not None and find(ALIAS_ROOT, None) is not None:
            return True
    return False


def register_hyper_parallel() -> bool:
    """Installs the alias finder when no real hyper_parallel exists; returns whether it did."""
    if any(isinstance(f, _AliasFinder) for f in sys.meta_path):
        return True
    if real_hyper_parallel_installed():
        print("hypershard: llamafactory: a real hyper_parallel package is installed; it handles "
              "use_hyper_parallel (hypershard is not registered)", file=sys.stderr)
        return False
    sys.meta_path.append(_AliasFinder())
    return True


# ---------------------------------------------------------------------------------- torchaudio

class _MissingAudio(types.ModuleType):
    """Stands in for a torchaudio that cannot load: importable (mm_plugin imports it), unusable."""

    def __init__(self, reason: str):
        super().__init__("torchaudio")
        self.__hypershard_stub__ = True
        self._reason = reason
        self.__spec__ = importlib.machinery.ModuleSpec("torchaudio", None)

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        raise ImportError(f"hypershard: llamafactory: torchaudio.{name} is unavailable: torchaudio does not load "
                          f"here ({self._reason}); audio inputs are not supported by this launcher")


def ensure_torchaudio() -> bool:
    """Imports torchaudio; when it fails (a CUDA build next to the CPU torch, or none at all),
    registers the stand-in. Returns whether the real one is used."""
    try:
        import torchaudio  # noqa: F401
        return True
    except Exception as error:  # OSError from a CUDA build's missing libraries, or ImportError
        for name in [n for n in sys.modules if n == "torchaudio" or n.startswith("torchaudio.")]:
            del sys.modules[name]  # a half-imported real module must not linger
        sys.modules["torchaudio"] = _MissingAudio(f"{type(error).__name__}: {error}")
        return False


# -------------------------------------------------------------------------------------- launch

def _under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _env_enabled(name: str) -> bool:
    return os.environ.get(name, "0").lower() in ("1", "true", "y", "yes")


def prepare() -> bool:
    """Everything LlamaFactory needs before it is imported; returns whether hypershard is registered."""
    os.environ.setdefault("DISABLE_VERSION_CHECK", "1")
    ensure_torchaudio()
    return register_hyper_parallel()


def _relaunch(argv: list) -> int:
    nproc = os.environ.get("NPROC_PER_NODE", "1")
    env = dict(os.environ)
    env.pop("FORCE_TORCHRUN", None)  # the ranks run LlamaFactory in-process, never torchrun again
    # --tee=3: every line of a rank's output is tagged with its rank ([default1]:...), so an error that
    # every rank raises is seen once per rank
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "--tee=3", "-m", "hypershard.integrations.llamafactory", *argv]
    return subprocess.call(command, env=env)


TIMEOUT_ENV = "HYPERSHARD_LLAMAFACTORY_TIMEOUT"


def _watchdog() -> None:
    """With HYPERSHARD_LLAMAFACTORY_TIMEOUT=S, a rank still running after S seconds prints which
    rank it is and every thread's stack, then exits (a stuck collective names its rank instead of
    hanging the run)."""
    seconds = os.environ.get(TIMEOUT_ENV)
    if not seconds:
        return
    import faulthandler
    import threading

    rank = os.environ.get("RANK", "0")

    def expire():
        print(f"hypershard: llamafactory: rank {rank} of {os.environ.get('WORLD_SIZE', '1')} still running after "
              f"{seconds} s ({TIMEOUT_ENV}); its stacks follow", file=sys.stderr, flush=True)
        faulthandler.dump_traceback(all_threads=True)
        os._exit(124)

    timer = threading.Timer(float(seconds), expire)
    timer.daemon = True
    timer.start()


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    if argv[0] == "train" and not _under_torchrun() and (_env_enabled("FORCE_TORCHRUN")
                                                         or int(os.environ.get("NPROC_PER_NODE", "1")) > 1):
        return _relaunch(argv)
    os.environ.pop("FORCE_TORCHRUN", None)  # LlamaFactory's launcher must not start torchrun itself
    _watchdog()
    prepare()
    sys.argv = ["llamafactory-cli", *argv]
    if argv[0] == "train":
        sys.argv.pop(1)
        from llamafactory.train.tuner import run_exp

        run_exp()
        return 0
    from llamafactory.cli import main as llamafactory_main

    llamafactory_main()
    return 0
