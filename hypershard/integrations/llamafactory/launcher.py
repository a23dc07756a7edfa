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

torchvision. transformers' video processors (every Qwen-VL processor holds one) are torchvision
classes, and PyPI's torchvision does not load with the CPU torch ("operator torchvision::nms does
not exist"), so ``AutoProcessor`` fails and LlamaFactory's qwen*_vl templates refuse to run without
a processor. When ``import torchvision`` fails, the launcher (its process only) marks torchvision
absent (``sys.modules["torchvision"] = None``: transformers then picks its PIL image processors, e.g.
Qwen2VLImageProcessorPil, instead of importing a broken package) and has ProcessorMixin load a
processor's ``video_processor`` as a stand-in: a real ``BaseVideoProcessor`` with the folder's
settings (merge_size, ...) that refuses any video. ``AutoProcessor`` then gives the model's real
processor class; images train, video inputs fail with a clear error. Where torchvision loads,
nothing is changed.

Launching. Under torchrun (RANK set) each process runs LlamaFactory's ``run_exp``. Without it,
``FORCE_TORCHRUN=1`` / ``NPROC_PER_NODE=N`` (LlamaFactory's own switches) make the launcher start
``torchrun --standalone --nproc-per-node N -m hypershard.integrations.llamafactory ...`` itself,
as ``llamafactory-cli`` would start its own launcher; otherwise one process runs.
``DISABLE_VERSION_CHECK=1`` is set (unless given): LlamaFactory 0.9.5 pins transformers<=5.6,
hypershard runs it on 5.18.
"""

from __future__ import annotations

import functools
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
        print(
            "hypershard: llamafactory: a real hyper_parallel package is installed; it handles "
            "use_hyper_parallel (hypershard is not registered)",
            file=sys.stderr,
        )
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
        raise ImportError(
            f"hypershard: llamafactory: torchaudio.{name} is unavailable: torchaudio does not load "
            f"here ({self._reason}); audio inputs are not supported by this launcher"
        )


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


# --------------------------------------------------------------------------------- torchvision


@functools.lru_cache(maxsize=None)
def _refusing_video_processor_class():
    from transformers.video_processing_utils import BaseVideoProcessor

    class HypershardNoVideoProcessor(BaseVideoProcessor):
        """What a processor holds when its torchvision video processor cannot load: the folder's
        settings (LlamaFactory's plugins read merge_size), no video processing."""

        reason = "torchvision does not load"

        def __call__(self, videos=None, **kwargs):
            raise ImportError(
                f"hypershard: llamafactory: video inputs are unavailable: the model's video processor "
                f"needs torchvision, which does not load here ({self.reason}); video training is not "
                f"supported by this launcher"
            )

        preprocess = __call__

        def to_dict(self):
            # A saved processor names no video processor class: loading it picks the model type's
            # own (where torchvision loads), or this stand-in again (where it does not).
            values = super().to_dict()
            values.pop("video_processor_type", None)
            return values

    return HypershardNoVideoProcessor


class NoVideoAutoProcessor:
    """What ProcessorMixin loads a processor's ``video_processor`` with once the fallback is
    installed (transformers' own AutoVideoProcessor is then a placeholder that raises: it requires
    torchvision)."""

    reason = "torchvision does not load"

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *inputs, **kwargs):
        processor = _refusing_video_processor_class().from_pretrained(pretrained_model_name_or_path, *inputs, **kwargs)
        processor.reason = cls.reason
        return processor


def _install_video_fallback(reason: str) -> None:
    from transformers import processing_utils
    from transformers.video_processing_utils import BaseVideoProcessor

    NoVideoAutoProcessor.reason = reason
    mapping = processing_utils.MODALITY_TO_AUTOPROCESSOR_MAPPING
    # An attribute of this one mapping object (its class's table stays as it is): ProcessorMixin
    # looks "video_processor" up here when it loads a processor's parts.
    mapping._MAPPING_NAMES = {
        **type(mapping)._MAPPING_NAMES,
        "video_processor": (__name__, NoVideoAutoProcessor.__name__),
    }
    # ProcessorMixin checks a video processor against transformers.BaseVideoProcessor, which without
    # torchvision is a placeholder that nothing is an instance of; the class itself imports and
    # works without torchvision (only its video transforms need it), so the check gets the class.
    setattr(processing_utils.transformers_module, "BaseVideoProcessor", BaseVideoProcessor)


def ensure_torchvision() -> bool:
    """Imports torchvision; when it fails, marks it absent and installs the video-processor
    fallback (module docstring). Returns whether the real one is used."""
    try:
        import torchvision  # noqa: F401

        return True
    except Exception as error:  # ModuleNotFoundError, or a wheel built for another torch (RuntimeError)
        reason = f"{type(error).__name__}: {error}".splitlines()[0]
    for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
        del sys.modules[name]  # a half-imported real module must not linger
    # None in sys.modules: importlib.util.find_spec answers None and an import raises
    # ModuleNotFoundError, so transformers' is_torchvision_available() is False
    sys.modules["torchvision"] = None
    import_utils = sys.modules.get("transformers.utils.import_utils")
    for name in ("is_torchvision_available", "is_torchvision_v2_available"):
        clear = getattr(getattr(import_utils, name, None), "cache_clear", None)
        if clear is not None:  # transformers imported before us: forget an answer already cached
            clear()
    _install_video_fallback(reason)
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
    ensure_torchvision()
    return register_hyper_parallel()


def _relaunch(argv: list) -> int:
    nproc = os.environ.get("NPROC_PER_NODE", "1")
    env = dict(os.environ)
    env.pop("FORCE_TORCHRUN", None)  # the ranks run LlamaFactory in-process, never torchrun again
    # --tee=3: every line of a rank's output is tagged with its rank ([default1]:...), so an error that
    # every rank raises is seen once per rank
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        # LlamaFactory's own variable: torchrun restarts a failed job that many times, and the
        # job resumes from the newest complete checkpoint by itself (docs/faults.md)
        f"--max-restarts={os.environ.get('MAX_RESTARTS', '0')}",
        "--tee=3",
        "-m",
        "hypershard.integrations.llamafactory",
        *argv,
    ]
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
        print(
            f"hypershard: llamafactory: rank {rank} of {os.environ.get('WORLD_SIZE', '1')} still running after "
            f"{seconds} s ({TIMEOUT_ENV}); its stacks follow",
            file=sys.stderr,
            flush=True,
        )
        faulthandler.dump_traceback(all_threads=True)
        os._exit(124)

    timer = threading.Timer(float(seconds), expire)
    timer.daemon = True
    timer.start()


def _init_process_group(train_argv: list) -> None:
    """Under torchrun, the default process group made here rather than by accelerate (which keeps one
    that exists), with keys of its own per attempt of ``torchrun --max-restarts``: accelerate's own
    group reuses the dead attempt's keys in the agent's store, and a restarted job's first group
    then reads dead addresses (hypershard.launch.init_torchrun_process_group). Its timeout is HF's
    ``ddp_timeout`` (the YAML's, else HF's default 1800 s), as accelerate would set it;
    HYPERSHARD_COLLECTIVE_TIMEOUT overrides it."""
    if not _under_torchrun() or int(os.environ.get("WORLD_SIZE", "1")) < 2:
        return
    import datetime
    from pathlib import Path

    import torch
    import yaml

    from hypershard.launch import init_torchrun_process_group
    from hypershard.launch.faults import collective_timeout

    seconds = 1800
    try:
        config = yaml.safe_load(Path(train_argv[0]).read_text()) or {} if train_argv else {}
        seconds = int(config.get("ddp_timeout", seconds))
    except (OSError, yaml.YAMLError, TypeError, ValueError):
        pass  # LlamaFactory reports its own YAML's faults
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    init_torchrun_process_group(backend, datetime.timedelta(seconds=collective_timeout(seconds)))


def check_hyper_parallel_args(train_argv: list, world: int) -> str:
    """The JSON the training YAML names (``use_hyper_parallel`` / ``hyper_parallel_args``, after the
    command line's ``key=value`` overrides) checked against the world size and the model folder's
    config.json, before LlamaFactory loads anything; returns the one-line error, "" when fine.
    The trainer checks again on the loaded model."""
    import json
    from pathlib import Path

    import yaml

    from .args import HyperParallelArguments, HyperParallelConfigError

    if not train_argv or not train_argv[0].endswith((".yaml", ".yml", ".json")):
        return ""
    try:
        config = yaml.safe_load(Path(train_argv[0]).read_text()) or {}
    except (OSError, yaml.YAMLError):
        return ""  # LlamaFactory reports its own YAML's faults
    for item in train_argv[1:]:
        key, _, value = item.partition("=")
        config[key.lstrip("-")] = yaml.safe_load(value) if value else value
    if not config.get("use_hyper_parallel") or not config.get("hyper_parallel_args"):
        return ""
    try:
        args = HyperParallelArguments.from_file(config["hyper_parallel_args"])
        args.check_world(world)
        model_config = Path(str(config.get("model_name_or_path", ""))) / "config.json"
        if model_config.is_file():
            values = json.loads(model_config.read_text())
            text = values.get("text_config", values)  # a vision-language model's text decoder
            args.check_model(types.SimpleNamespace(config=types.SimpleNamespace(**text)))
    except HyperParallelConfigError as error:
        return str(error)
    return ""


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    if (
        argv[0] == "train"
        and not _under_torchrun()
        and (_env_enabled("FORCE_TORCHRUN") or int(os.environ.get("NPROC_PER_NODE", "1")) > 1)
    ):
        # checked here first: one line, once, and no torchrun failure summary after it
        world = int(os.environ.get("NPROC_PER_NODE", "1")) * int(os.environ.get("NNODES", "1"))
        error = check_hyper_parallel_args(argv[1:], world)
        if error:
            print(error, file=sys.stderr, flush=True)
            return 2
        return _relaunch(argv)
    os.environ.pop("FORCE_TORCHRUN", None)  # LlamaFactory's launcher must not start torchrun itself
    _watchdog()
    prepare()
    sys.argv = ["llamafactory-cli", *argv]
    if argv[0] == "train":
        error = check_hyper_parallel_args(argv[1:], int(os.environ.get("WORLD_SIZE", "1")))
        if error:  # one line on every rank, before LlamaFactory loads the model
            print(error, file=sys.stderr, flush=True)
            return 2
        sys.argv.pop(1)
        _init_process_group(argv[1:])
        from llamafactory.train.tuner import run_exp

        from . import loading
        from .resume import install_auto_resume

        install_auto_resume()  # automatic resume: the newest COMPLETE checkpoint (docs/faults.md)
        loading.install()  # each rank reads only its shards of the model (loading.py)
        run_exp()
        return 0
    from llamafactory.cli import main as llamafactory_main

    llamafactory_main()
    return 0
