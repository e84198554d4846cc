"""Shared offline fixtures: the real GPT-2 tokenizer (built from local files) and tiny random GPT-2 models."""

import contextlib
import ctypes
import importlib.util
import logging
import os
import shutil
import sys
import tempfile
import warnings

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, PartialState
from transformers import GPT2Config, GPT2LMHeadModel

from lm_human_preference_details.tokenizer import gpt2_tokenizer_offline

# two intra-op threads on the 2-core machine; one per worker when pytest-xdist runs the tests in two processes (`make
# test`), so that the workers do not oversubscribe the cores
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else 2)

KEPT_BLOCKS = 2**30
"""glibc's malloc returns every freed block over 32 MiB to the OS and page-faults it in again at the next allocation;
the (batch, 50257) logits of every sampling step are such blocks. Blocks up to KEPT_BLOCKS bytes stay in the heap, as
demo/run_demo.py keeps them in its stages (measured on a reward test: system time 34 s -> 16 s, user time the same)."""
if "MALLOC_MMAP_THRESHOLD_" not in os.environ and "MALLOC_TRIM_THRESHOLD_" not in os.environ:
    # every process the tests start reads them at its start: the xdist workers, the scripts, torchrun's processes
    os.environ.update(MALLOC_MMAP_THRESHOLD_=str(KEPT_BLOCKS), MALLOC_TRIM_THRESHOLD_=str(KEPT_BLOCKS))
    with contextlib.suppress(OSError, AttributeError):  # this process is already running: mallopt, where glibc has it
        libc = ctypes.CDLL(None)
        libc.mallopt(-1, KEPT_BLOCKS)  # M_TRIM_THRESHOLD
        libc.mallopt(-3, KEPT_BLOCKS)  # M_MMAP_THRESHOLD

SLOWEST_FILES = (
    "test_demo.py",
    "test_demo_nplus.py",
    "test_nplus_end_to_end.py",
    "test_features_together.py",
    "test_fsdp_policy.py",
    "test_multiprocess.py",
    "test_train_reward.py",
    "test_fsdp_reward.py",
    "test_cli.py",
    "test_resume.py",
    "test_archs_end_to_end.py",
    "test_stop_signal.py",
    "test_train_sft.py",
    "test_pipeline.py",
    "test_train_policy.py",
    "test_lora.py",
    "test_train_both.py",
    "test_oai_ranks.py",
    "test_label_generation.py",
    "test_evaluation.py",
    "test_labelserver_browser.py",
    "test_output_dir_lock.py",
)
"""the test files that take longest (`--durations`), longest first. With `--dist loadfile` a file runs on one worker:
the workers start on these, so that no long file is left for the end while the other worker has nothing to do. A
stale order costs only wall time."""


@contextlib.contextmanager
def started_processes_temp_dir():
    """TMPDIR of the processes the tests start, a fresh directory removed at the end: torchrun leaves a torchelastic_*
    directory in the temporary directory at every launch, and nothing else removes those. The directory is one level
    below the temporary directory, so a socket a started process makes there (wandb's) stays far below the 107-byte
    limit of its path. This process's own temporary files stay where they were (tempfile's choice is made once)."""
    tempfile.gettempdir()
    path = tempfile.mkdtemp(prefix="pytest-started-")
    previous = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = path
    try:
        yield path
    finally:
        if previous is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = previous
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def started_processes_write_their_temporary_files_to_a_removed_directory():
    """Every test session's started processes (scripts, torchrun and its workers) get started_processes_temp_dir."""
    with started_processes_temp_dir():
        yield


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile` handing out the files of SLOWEST_FILES first (longest first), then the others in xdist's own
    order; every other mode as xdist does it."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class SlowestFilesFirst(LoadFileScheduling):
        def _assign_work_unit(self, node) -> None:
            def rank(scope: str) -> int:
                name = os.path.basename(scope)
                return SLOWEST_FILES.index(name) if name in SLOWEST_FILES else len(SLOWEST_FILES)

            self.workqueue.move_to_end(min(self.workqueue, key=rank), last=False)
            super()._assign_work_unit(node)

    return SlowestFilesFirst(config, log)


REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHECKED_LIBRARIES = ("transformers", "accelerate", "torch", "datasets")
"""libraries whose deprecations in the project's own calls fail the test (the next rename turns CI red)"""
DEPRECATIONS = (DeprecationWarning, FutureWarning)


def _site_package(filename: str) -> list[str] | None:
    """The path parts below site-packages of an installed package's file, None for any other file."""
    parts = os.path.normpath(filename).split(os.sep)
    for top in ("site-packages", "dist-packages"):
        if top in parts:
            return parts[parts.index(top) + 1 :]
    return None


def _package_directory(name: str) -> str | None:
    """The directory of the installed package `name` (found without importing it), None when it is not installed."""
    spec = importlib.util.find_spec(name)
    return os.path.dirname(os.path.abspath(spec.origin)) if spec is not None and spec.origin else None


LIBRARY_DIRECTORIES = {name: _package_directory(name) for name in CHECKED_LIBRARIES}
"""where each checked library is installed: site-packages, or any directory (`pip install --target DIR`)"""


def _library_of(filename: str) -> str | None:
    """The checked library a source file belongs to, None for any other file."""
    path = os.path.abspath(filename)
    for name, directory in LIBRARY_DIRECTORIES.items():
        if directory is not None and path.startswith(directory + os.sep):
            return name
    return None


def _is_project_file(filename: str) -> bool:
    """A file of this repository (package, scripts, tests), conftest.py and installed packages (a virtualenv inside the
    repository) excepted."""
    path = os.path.abspath(filename)
    inside = path.startswith(REPO_ROOT + os.sep) and _site_package(path) is None
    return inside and os.path.basename(path) != "conftest.py"


def _deprecation_from_project_call() -> str | None:
    """When a warning is being shown: the checked library that raised it, if the project called into it; else None.
    A warning raised while a library imports one of its own modules (a module body on the way up, e.g. torch's
    compiler importing torch.utils.mkldnn) is the library's own affair, not the project's call."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename in (__file__, warnings.__file__):
        frame = frame.f_back
    library = frame is not None and _library_of(frame.f_code.co_filename)
    if not library:
        return None
    while frame is not None:
        if _is_project_file(frame.f_code.co_filename):
            return library
        if frame.f_code.co_name == "<module>":
            return None
        frame = frame.f_back
    return None


class _DeprecationLog(logging.Handler):
    """Collects transformers' logger-based deprecation notices (`logger.warning_once("... deprecated ...")`)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "deprecat" in message.lower():
            self.messages.append(message)


@pytest.fixture(autouse=True)
def no_deprecated_library_calls(monkeypatch):
    """Fail a test whose project code calls transformers, accelerate, torch or datasets in a deprecated way: a
    DeprecationWarning or FutureWarning raised inside those libraries under a project frame becomes an error where
    it is raised, and a transformers log record mentioning a deprecation fails the test at its end.

    transformers logs most renames (e.g. `past_key_values` -> `cache`) with `logger.warning_once`, which the scripts'
    `set_verbosity_error` would drop and which a process logs only once: the level is kept at WARNING for the checker
    (the console handler still shows errors only) and the once-only memory is cleared before every test.
    """
    import transformers.utils.logging as hf_logging

    shown = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, DEPRECATIONS):
            library = _deprecation_from_project_call()
            if library:
                raise category(f"the project calls {library} in a deprecated way: {message}")
            if category is DeprecationWarning and (_site_package(filename) or _library_of(filename)):
                return  # an installed package's internal deprecation, not the project's call: not shown, as before
        shown(message, category, filename, lineno, file, line)

    monkeypatch.setattr(warnings, "showwarning", show)
    logging.Logger.warning_once.cache_clear()
    root = hf_logging.get_logger("transformers")
    log = _DeprecationLog()
    default_handler_level = hf_logging._default_handler.level if hf_logging._default_handler else None
    monkeypatch.setattr(hf_logging, "set_verbosity", lambda verbosity: _set_handler_level(hf_logging, verbosity))
    root.addHandler(log)
    level = root.level
    root.setLevel(logging.WARNING)
    try:
        yield log
    finally:
        root.removeHandler(log)
        root.setLevel(level)
        if default_handler_level is not None:
            hf_logging._default_handler.setLevel(default_handler_level)
    if log.messages:
        pytest.fail(f"the project calls transformers in a deprecated way: {log.messages}", pytrace=False)


def forget_accelerate_state_unless_on(device_type: str) -> None:
    """Reset accelerate's process-wide state (its supported reset, `AcceleratorState._reset_state`) when it was built
    on another device type than `device_type`. accelerate keeps one state per process: once a test on a GPU machine
    ran a script in-process (CUDA), `Accelerator(cpu=True)` raises "AcceleratorState has already been initialized",
    and once a test built a CPU one, a later `Accelerator()` stays on the CPU."""
    devices = [state.get("device") for state in (PartialState._shared_state, AcceleratorState._shared_state)]
    if any(device is not None and device.type != device_type for device in devices):
        AcceleratorState._reset_state(reset_partial_state=True)


def cpu_accelerator() -> Accelerator:
    """A one-process CPU Accelerator, whichever Accelerator an earlier test in this process built."""
    forget_accelerate_state_unless_on("cpu")
    return Accelerator(cpu=True)


@pytest.fixture(autouse=True)
def accelerate_state_on_the_gpu():
    """On a GPU machine, the next test's `Accelerator()` gets CUDA even when this test built a CPU Accelerator."""
    yield
    if torch.cuda.is_available():
        forget_accelerate_state_unless_on("cuda")


def _set_handler_level(hf_logging, verbosity: int) -> None:
    """transformers' set_verbosity applied to its console handler, not its logger, so the checker still sees
    warnings."""
    if hf_logging._default_handler is not None:
        hf_logging._default_handler.setLevel(verbosity)


def tiny_gpt2_config(**overrides) -> GPT2Config:
    """A 2-layer, 32-wide GPT-2 over the real 50257-token vocabulary, with dropout off."""
    kwargs = dict(n_layer=2, n_head=2, n_embd=32, n_positions=256, vocab_size=50257)
    kwargs.update(attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0, summary_first_dropout=0.0)
    kwargs.update(overrides)
    return GPT2Config(**kwargs)


def tiny_gpt2(seed: int = 0, **overrides) -> GPT2LMHeadModel:
    """A fresh tiny random GPT-2 language model in eval mode."""
    torch.manual_seed(seed)
    return GPT2LMHeadModel(tiny_gpt2_config(**overrides)).eval()


@contextlib.contextmanager
def one_intra_op_thread():
    """torch on one intra-op thread: the tiny models' ops are far too small to gain from more (and two threads on a
    busy 2-core machine are many times slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture
def one_thread():
    """One intra-op thread for one test."""
    with one_intra_op_thread():
        yield


@pytest.fixture(scope="module")
def single_thread():
    """One intra-op thread for a whole test module (`pytestmark = pytest.mark.usefixtures("single_thread")`)."""
    with one_intra_op_thread():
        yield


@pytest.fixture
def gloo_process_group():
    """A process group of this one process (gloo): FSDP2 shards a module into one shard there, with the hooks, DTensors
    and gathered storage of a run on several processes (`distributed.data_parallel(..., SeveralProcesses(), True)`)."""
    from tests.planted import free_port

    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        torch.distributed.destroy_process_group()


class SeveralProcesses:
    """The accelerator of a run on 2 processes, as `distributed.data_parallel` reads it (the group may have fewer)."""

    num_processes = 2


QUERY_TEXTS = [
    "The old man walked slowly down the road, thinking about the letter he had received that morning.",
    "She opened the window and the cold air rushed into the small room.",
    "Nobody in the village knew where the stranger had come from.",
    "He laughed, but his eyes were sad.",
    "The train was late again, and the platform was crowded with tired people.",
    "I never expected to see her again after that summer.",
    "The dog barked twice and then fell silent.",
    "Rain hammered on the roof all night long.",
    "They argued about money, as they always did on Sundays.",
    "The letter was short: come home, everything is forgiven.",
    "A single candle burned on the table.",
    "Her brother had left for the city years ago.",
]
"""short literary sentences: the query texts of the tiny policy and reward runs"""


def write_queries(path) -> str:
    """QUERY_TEXTS as a query file (a line per text) at `path`; returns the path as a string."""
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(QUERY_TEXTS) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def query_file(tmp_path_factory):
    """QUERY_TEXTS as a query file, once per test module."""
    return write_queries(tmp_path_factory.mktemp("queries") / "queries.txt")


@pytest.fixture(scope="session")
def tokenizer():
    return gpt2_tokenizer_offline()


@pytest.fixture
def tiny_lm():
    return tiny_gpt2()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tokenizer):
    path = tmp_path_factory.mktemp("tiny-gpt2")
    tiny_gpt2().save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def family_dirs(tmp_path_factory) -> dict[str, str]:
    """A saved tiny model and tokenizer of every family of tests/archs.py (a --base_model directory each)."""
    from tests import archs  # imported here, by the tests that use the stand-ins only

    return {family: archs.save_family(family, str(tmp_path_factory.mktemp(family))) for family in archs.FAMILIES}


def small_vocab_gpt2(tokens: list[int], seed: int = 0, strength: float = 10.0) -> GPT2LMHeadModel:
    """A tiny GPT-2 that samples almost only `tokens` (nearly uniformly), so planted preferences are discoverable."""
    model = tiny_gpt2(seed)
    with torch.no_grad():
        # hidden dim 0 is a constant `strength` after ln_f; the tied embedding's dim 0 is +1 for `tokens`, -1 otherwise
        model.transformer.ln_f.weight[0] = 0.0
        model.transformer.ln_f.bias[0] = strength
        model.transformer.wte.weight[:, 0] = -1.0
        model.transformer.wte.weight[tokens, 0] = 1.0
    return model


@pytest.fixture(scope="session")
def small_vocab_words(tokenizer):
    words = [" the", " a", " and", " of", " to", " in", " was", " he", " she", " it", " on", " with", " happy", " sad"]
    return {w.strip(): tokenizer.encode(w)[0] for w in words}


@pytest.fixture(scope="session")
def small_vocab_model_dir(tmp_path_factory, tokenizer, small_vocab_words):
    path = tmp_path_factory.mktemp("small-vocab-gpt2")
    small_vocab_gpt2(list(small_vocab_words.values())).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)
