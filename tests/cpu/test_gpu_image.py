"""The GPU tier against the GPU machine's own image: with only the packages that image holds (and the wheels
`tests/gpu/run.sh pack` carries) importable, every module of the project that a GPU run may import, every test
module of tests/gpu, and `python -m megatron_rl.train --help` import; and a single-turn run imports none of the
optional subsystems (agents and tools, SGLang, the reward server, the judge), so a run that does not use them never
needs their packages.

The image is simulated here by a site directory that links only the allowed distributions of this machine's
environment, and interpreters started with `-S` (no site-packages) on it."""

import importlib.metadata
import json
import os
import re
import subprocess
import sys

import pytest
from helpers import ROOT

# The GPU machine's image ('cuda', as read on 2026-11-17: the device documentation's package list), distribution names.
IMAGE_PACKAGE_LIST = """
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools
formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna
imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe
matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals
networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy
peft pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments
pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist
python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six
sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile
tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm
transformers treescope triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel
wrapt xarray xxhash yarl zipp
"""

# Packages of optional subsystems that the image lacks: a run imports them only when it uses the subsystem.
OPTIONAL_PACKAGES = ("jsonschema", "openai", "sglang", "wandb")
# The project's optional subsystems: a single-turn run with the built-in engine and a local reward imports none.
OPTIONAL_MODULES = ("megatron_rl.tools", "megatron_rl.rollout.agent.", "megatron_rl.rollout.sglang.engine",
                    "megatron_rl.rollout.sglang.server", "megatron_rl.rollout.sglang.judge",
                    "megatron_rl.rewards.remote")


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _packed_wheels() -> list[str]:
    with open(os.path.join(ROOT, "tests", "gpu", "wheels.txt")) as f:
        return [line.split("==")[0] for line in f if line.strip() and not line.startswith("#")]


def _with_dependencies(names: set[str], installed: dict) -> set[str]:
    """`names` and what their versions installed here require (without extras): this machine's versions may need
    packages that the image's versions do not (a newer huggingface-hub, say), which the image then has its own way."""
    from packaging.requirements import Requirement

    closure, todo = set(names), list(names)
    while todo:
        dist = installed.get(todo.pop())
        for line in (dist.requires or []) if dist else ():
            requirement = Requirement(line)
            name = _normalized(requirement.name)
            if name not in closure and (requirement.marker is None or requirement.marker.evaluate({"extra": ""})):
                closure.add(name)
                todo.append(name)
    return closure


@pytest.fixture(scope="module")
def image_site(tmp_path_factory):
    """A directory holding links to the top-level entries (packages, modules, .dist-info) of every distribution
    installed here that the image has or the tier's wheels bring: what `import` finds on the GPU machine."""
    installed = {_normalized(d.metadata["Name"]): d for d in importlib.metadata.distributions()}
    allowed = _with_dependencies({_normalized(n) for n in IMAGE_PACKAGE_LIST.split() + _packed_wheels()}, installed)
    site = tmp_path_factory.mktemp("image-site")
    for name, dist in installed.items():
        if name not in allowed:
            continue
        for top in {f.parts[0] for f in dist.files or () if f.parts[0] != ".."}:
            source, link = dist.locate_file(top), site / top
            if os.path.exists(source) and not os.path.lexists(link):
                link.symlink_to(source)
    return site


def _run_in_image(site, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), ROOT]), "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run([sys.executable, "-S", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


IMPORT_EVERYTHING = r"""
import importlib, importlib.util, json, pkgutil, sys
import megatron_rl

failed = {}
for module in pkgutil.walk_packages(megatron_rl.__path__, "megatron_rl.",
                                    onerror=lambda name: failed.setdefault(name, repr(sys.exc_info()[1]))):
    try:
        importlib.import_module(module.name)
    except BaseException as e:
        failed[module.name] = repr(e)
print(json.dumps({"failed": failed, "present": [p for p in sys.argv[1:] if importlib.util.find_spec(p)]}))
"""

SINGLE_TURN_RUN = r"""
import json, sys
from megatron_rl import train
import megatron_rl.rollout.worker, megatron_rl.trainer.executor, megatron_rl.controller.loop  # what ranks run
train.main(sys.argv[1:])
print(json.dumps(sorted(sys.modules)))
"""


def test_every_module_imports_with_only_the_images_packages(image_site):
    run = _run_in_image(image_site, "-c", IMPORT_EVERYTHING, *OPTIONAL_PACKAGES)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.splitlines()[-1])
    assert result["present"] == [], f"the simulated image has packages it lacks: {result['present']}"
    assert result["failed"] == {}, ("modules that need a package outside the GPU image at import time (import it "
                                    "where the optional feature is used):\n" + json.dumps(result["failed"], indent=1))


def test_the_gpu_tier_collects_and_the_cli_starts_with_only_the_images_packages(image_site):
    collect = _run_in_image(image_site, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "tests/gpu")
    assert collect.returncode == 0, collect.stdout[-3000:] + collect.stderr[-3000:]
    collected = {line.split("::")[0] for line in collect.stdout.splitlines() if "::" in line}
    on_disk = {f"tests/gpu/{name}" for name in os.listdir(os.path.join(ROOT, "tests", "gpu"))
               if name.startswith("test_") and name.endswith(".py")}
    assert collected == on_disk
    cli = _run_in_image(image_site, "-m", "megatron_rl.train", "--help")
    assert cli.returncode == 0 and "--rollout-backend" in cli.stdout, cli.stderr[-3000:]


def test_a_single_turn_run_imports_no_optional_subsystem(image_site, tmp_path):
    run = _run_in_image(image_site, "-c", SINGLE_TURN_RUN, "--model", "tiny-arith", "--seq-length", "32",
                        "--reward-fn", "math", "--output-dir", str(tmp_path), "--world-size", "2", "--dry-run")
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    modules = json.loads(run.stdout.splitlines()[-1])
    optional = [m for m in modules if m.startswith(OPTIONAL_MODULES) or m.split(".")[0] in OPTIONAL_PACKAGES]
    assert optional == [], f"a single-turn run imported optional subsystems: {optional}"
