"""Load and save DFlash drafters: z-lab checkpoints (local or on the Hub) and the converted form we write.

One read path serves both `load_drafter` and the converter: find the files, parse `config.json` with
`DFlashConfig.from_dict`, read the safetensors, rename z-lab keys, and check every tensor against the shapes the
config implies before a strict load. Every failure is a `DFlashError` whose message says what to do.
Format: docs/algorithm.md, "Checkpoint formats".

The bottom of the drafter stack: `convert.drafter` (conversion) builds on this module, and `hub` (the cache of
converted hub drafters, and `open_drafter`, the one entry for a directory or repo id) on both. A repo id given
here is downloaded raw and converted in memory, never cached.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Dict, List, Optional, Tuple, Union

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten
from tqdm import tqdm

from ..dtypes import mx_dtype
from ..errors import DFlashError
from ..refs import is_repo_id
from ..validate import check_safetensors, hub_failure, read_json
from .config import DFlashConfig
from .dflash import DFlashDrafter
from .families import DrafterFamily, detect, family_of, marked_by

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"

QUANT_BITS = (4, 8)
QUANT_GROUP_SIZES = (32, 64, 128)

# Buffers some exports carry that the drafter recomputes itself; any other unknown tensor is an error.
_HARMLESS_SUFFIXES = ("rotary_emb.inv_freq",)

_SAFETENSORS_DTYPES = {
    mx.bfloat16: "BF16", mx.float16: "F16", mx.float32: "F32",
    mx.uint32: "U32", mx.int32: "I32", mx.uint8: "U8", mx.int8: "I8",
}


# -- finding and reading a checkpoint -------------------------------------------------------------------------
def resolve_checkpoint(path_or_repo: Union[str, Path], revision: Optional[str] = None) -> Path:
    """A local directory as is, otherwise a Hugging Face repo id fetched (json + safetensors only) into the cache."""
    path = Path(path_or_repo).expanduser()
    if path.exists():
        if not path.is_dir():
            raise DFlashError(f"drafter path '{path}' is a file; pass the directory that holds config.json")
        return path
    text = str(path_or_repo)
    if not is_repo_id(text):
        raise DFlashError(f"drafter directory '{text}' does not exist")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError

    try:
        return Path(snapshot_download(text, revision=revision, allow_patterns=["*.json", "*.safetensors"]))
    except HFValidationError:
        raise DFlashError(f"'{text}' is neither a local directory nor a valid Hugging Face repo id") from None
    except Exception as e:  # offline, unknown repo or revision, gated repo, HTTP errors: all end the same way
        raise DFlashError(
            f"no local directory '{text}' and could not download it from the Hugging Face Hub: "
            f"{hub_failure(e)}; check the repo id and your network, or pass a local directory"
        ) from None


def read_config(path: Path) -> DFlashConfig:
    """The normalized config of the drafter in `path`, of its family's config class (`drafters.families`)."""
    file = path / CONFIG_NAME
    raw = read_json(file, f"'{path}' has no {CONFIG_NAME}; pass a DFlash drafter directory or Hub repo id",
                    lambda e: f"cannot parse {file}: {e}; re-download or re-convert the drafter")
    family = detect(raw)
    if family.config_class is DFlashConfig:
        archs = raw.get("architectures") or []
        speculators = raw.get("speculators_model_type") == "dflash" or "transformer_layer_config" in raw
        if not speculators and raw.get("model_type") != "dflash" and archs and not any("DFlash" in a for a in archs):
            raise DFlashError(f"'{path}' holds a {', '.join(archs)} model, not a DFlash drafter")
    return family.config_class.from_dict(raw)


def _weight_files(path: Path) -> list:
    if (path / WEIGHTS_NAME).is_file():
        return [path / WEIGHTS_NAME]
    index = path / INDEX_NAME
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, AttributeError) as e:
            raise DFlashError(f"cannot parse {index}: {e}; re-download the drafter") from None
        missing = [s for s in shards if not (path / s).is_file()]
        if missing:
            raise DFlashError(f"'{path}' lacks shard {missing[0]} listed in {INDEX_NAME}; re-download the drafter")
        return [path / s for s in shards]
    files = sorted(path.glob("model*.safetensors"))
    if not files:
        raise DFlashError(f"'{path}' has no {WEIGHTS_NAME}; re-download the drafter or convert it again")
    return files


def read_weights(path: Path) -> Dict[str, mx.array]:
    """All tensors of a checkpoint directory, with z-lab naming normalized to the drafter's parameter names."""
    weights: Dict[str, mx.array] = {}
    for file in _weight_files(path):
        check_safetensors(file, fix="delete it and download or convert the drafter again")  # names the file
        try:
            weights.update(mx.load(str(file), format="safetensors"))
        except Exception as e:  # mlx reports truncation and bad headers as RuntimeError
            reason = " ".join(str(e).split())
            raise DFlashError(
                f"cannot read {file} ({reason}); the file is corrupt or incomplete: delete it and download or "
                "convert the drafter again"
            ) from None
    return sanitize(weights)


def sanitize(weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
    """Strip an optional `model.` prefix and drop buffers the drafter recomputes."""
    out = {}
    for key, value in weights.items():
        if key.startswith("model."):
            key = key[len("model."):]
        if key.endswith(_HARMLESS_SUFFIXES):
            continue
        out[key] = value
    return out


# -- building, quantizing and loading ------------------------------------------------------------------------
def _quantizable(group_size: int, keep_float=()):
    # Same rule as mlx-lm: layers whose input width is not a multiple of the group size stay in float; so do
    # the family's small, sensitive layers (`DrafterFamily.keep_float`).
    return lambda path, m: (hasattr(m, "to_quantized") and m.weight.shape[-1] % group_size == 0
                            and not any(part in path for part in keep_float))


def check_quantization(bits: int, group_size: int) -> None:
    if bits not in QUANT_BITS:
        raise DFlashError(f"unsupported quantization bits {bits}; choose one of {', '.join(map(str, QUANT_BITS))}")
    if group_size not in QUANT_GROUP_SIZES:
        raise DFlashError(
            f"unsupported quantization group size {group_size}; choose one of "
            f"{', '.join(map(str, QUANT_GROUP_SIZES))}"
        )


def quantize_drafter(drafter: DFlashDrafter, bits: int, group_size: int) -> None:
    """Quantize in place and record the settings in the drafter's config, so `save_drafter` writes them."""
    check_quantization(bits, group_size)
    keep = family_of(drafter.config).keep_float
    nn.quantize(drafter, group_size=group_size, bits=bits, class_predicate=_quantizable(group_size, keep))
    drafter.config.quantization = {"group_size": group_size, "bits": bits}


def build_drafter(config: DFlashConfig) -> DFlashDrafter:
    """An unloaded drafter of the config's family with the layout it describes (quantized layers included)."""
    family: DrafterFamily = family_of(config)
    try:
        drafter = family.drafter_class(config)
    except (ValueError, KeyError, TypeError) as e:  # e.g. a rope_scaling type mlx-lm does not know
        raise DFlashError(f"cannot build a drafter from this config.json: {e}") from None
    if config.quantization:
        q = config.quantization
        quantize_drafter(drafter, int(q["bits"]), int(q["group_size"]))
    return drafter


def _first_of(names: List[str]) -> str:
    """The first name quoted, and how many more there are."""
    more = f" (and {len(names) - 1} more)" if len(names) > 1 else ""
    return f"'{names[0]}'{more}"


def check_weights(drafter: DFlashDrafter, weights: Dict[str, mx.array], source: Path) -> None:
    """Every expected tensor present with the right shape and nothing else; names the first offender."""
    expected: Dict[str, Tuple[int, ...]] = {k: tuple(v.shape) for k, v in tree_flatten(drafter.parameters())}
    missing = sorted(set(expected) - set(weights))
    if missing:
        raise DFlashError(
            f"drafter checkpoint '{source}' lacks tensor {_first_of(missing)} that its config.json describes; "
            "the weights are incomplete or config.json does not match them: re-download or re-convert the drafter"
        )
    extra = sorted(set(weights) - set(expected))
    if extra:
        raise DFlashError(
            f"drafter checkpoint '{source}' has unexpected tensor {_first_of(extra)}, not described by its "
            "config.json; config.json does not match the weights (restore it from the drafter's source), or this "
            "is not a z-lab DFlash drafter this version understands"
        )
    for key in sorted(expected):
        got = tuple(weights[key].shape)
        if got != expected[key]:
            cfg = drafter.config
            why = (f" (hidden_size {cfg.hidden_size}, {cfg.num_taps} target_layer_ids)" if key == "fc.weight" else "")
            raise DFlashError(
                f"drafter checkpoint '{source}': tensor {key} has shape {list(got)}, expected {list(expected[key])} "
                f"for this config{why}; config.json and the weights do not match"
            )


def read_drafter(path: Path) -> DFlashDrafter:
    """Build, check and load the drafter stored in a local directory (z-lab or converted), not yet evaluated."""
    config = read_config(path)
    weights = read_weights(path)
    family = family_of(config)
    foreign = marked_by(weights, family)
    if foreign is not None:
        raise DFlashError(f"drafter checkpoint '{path}' holds tensor '{foreign[1]}' of a {foreign[0].name} drafter, "
                          f"but its config.json describes a {family.name} drafter; restore config.json from the "
                          "drafter's source")
    if family.rename is not None:
        weights = family.rename(weights, config)
    drafter = build_drafter(config)
    check_weights(drafter, weights, path)
    drafter.load_weights(list(weights.items()), strict=True)
    return drafter


def dequantize_drafter(drafter: DFlashDrafter, dtype: mx.Dtype = mx.float32) -> None:
    """Replace quantized layers by float ones and cast every float parameter to `dtype`, in place.

    The weights are dequantized straight into `dtype` (scales and biases cast first), which are the values the
    quantized matmul multiplies by. The config's quantization entry is dropped so a save writes what is held.
    """
    for _, module in drafter.named_modules():
        for name, child in list(module.children().items()):
            if isinstance(child, nn.QuantizedLinear):
                weight = mx.dequantize(child.weight, child.scales.astype(dtype), child.biases.astype(dtype),
                                       child.group_size, child.bits)
                linear = nn.Linear(weight.shape[1], weight.shape[0], bias="bias" in child)
                linear.weight = weight
                if "bias" in child:
                    linear.bias = child.bias
                setattr(module, name, linear)
    drafter.set_dtype(dtype)
    drafter.config.quantization = None


def use_fastest_form(drafter: DFlashDrafter) -> None:
    """Hold the weights as the default device multiplies them fastest, and say so in `drafter.weights_form`.

    MLX's CPU backend runs quantized and half-precision matmuls without BLAS, several times slower than float32
    through BLAS (benchmarks/draft_cost.py), so on the CPU they become float32. Apple GPUs run quantized matmuls
    fast and read fewer bytes: there the weights stay as stored.
    """
    q = drafter.config.quantization
    dtypes = {v.dtype for _, v in tree_flatten(drafter.parameters()) if mx.issubdtype(v.dtype, mx.floating)}
    stored = f"{q['bits']}-bit quantized" if q else "/".join(sorted(str(d).split(".")[-1] for d in dtypes))
    if mx.default_device().type == mx.cpu and (q is not None or dtypes != {mx.float32}):
        dequantize_drafter(drafter)
        drafter.weights_form = (f"{stored} weights converted to float32 at load (the CPU backend multiplies "
                                "float32 fastest)")
    else:
        drafter.weights_form = f"{stored} weights, as stored"


def load_drafter(path_or_repo: Union[str, Path], *, revision: Optional[str] = None,
                 fastest: bool = False) -> DFlashDrafter:
    """A ready drafter from a converted directory, a raw z-lab directory, or a Hub repo id (converted in memory).

    `fastest`: hold the weights in the form the default device multiplies fastest (`use_fastest_form`; what
    `dflash_mlx.load` does); otherwise exactly as stored. Bind it to its target with `drafter.bind(...)` before
    drafting.
    """
    drafter = read_drafter(resolve_checkpoint(path_or_repo, revision))
    if fastest:
        use_fastest_form(drafter)
    try:
        mx.eval(drafter.parameters())
    except Exception as e:  # data that passed the header checks but cannot be read
        raise DFlashError(f"cannot read the weights of drafter '{path_or_repo}': {' '.join(str(e).split())}") from None
    return drafter


# -- writing ----------------------------------------------------------------------------------------------------
def parse_dtype(name: str) -> mx.Dtype:
    return mx_dtype(name)


def _tensor_bytes(a: mx.array) -> bytes:
    if a.dtype == mx.bfloat16:  # numpy has no bfloat16: copy the raw 16-bit words
        a = a.view(mx.uint16)
    return np.asarray(a).tobytes()


def write_safetensors(tensors: Dict[str, mx.array], file: Path, metadata: Dict[str, str]) -> None:
    """Write tensors in sorted order with a sorted header, so equal inputs give byte-identical files.

    Written by hand (the format is a length, a JSON header and the raw data) to keep the layout independent of
    the mlx and safetensors versions installed. The file appears atomically.
    """
    names = sorted(tensors)
    header: Dict[str, object] = {"__metadata__": dict(metadata)}
    offset = 0
    for name in names:
        a = tensors[name]
        if a.dtype not in _SAFETENSORS_DTYPES:
            raise DFlashError(f"cannot save tensor {name} of dtype {a.dtype}")
        header[name] = {"dtype": _SAFETENSORS_DTYPES[a.dtype], "shape": list(a.shape),
                        "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    raw = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned
    tmp = file.with_name(file.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name in tqdm(names, desc=f"writing {file.name}", unit="tensor"):
            a = tensors[name]
            mx.eval(a)  # casts and quantization are lazy: they run here, one tensor at a time
            f.write(_tensor_bytes(a))
    os.replace(tmp, file)


def save_drafter(drafter: DFlashDrafter, out: Union[str, Path]) -> Path:
    """Write `config.json` (normalized, sorted) and `model.safetensors` into `out`; returns `out`."""
    out = Path(out).expanduser()
    if out.exists() and not out.is_dir():
        raise DFlashError(f"output path '{out}' is a file; pass a directory")
    out.mkdir(parents=True, exist_ok=True)
    write_safetensors(dict(tree_flatten(drafter.parameters())), out / WEIGHTS_NAME, {"format": "mlx"})
    text = json.dumps(drafter.config.to_dict(), sort_keys=True, indent=2) + "\n"
    (out / CONFIG_NAME).write_text(text)
    return out
