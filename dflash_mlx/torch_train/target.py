"""The frozen target in PyTorch (transformers): its tapped features, greedy choices, embedding and head.

A target is a Hugging Face folder (an mlx-lm fp32/bf16 folder is one: same names, same config) or a GGUF file,
converted once into such a folder beside it by dflash-mlx's own converter (numpy and the `gguf` package). Feature id k is the output of
decoder layer k, `hidden_states[k + 1]` (index 0 is the embedding output), concatenated in the listed order: the
drafter's contract.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch

from ..errors import DFlashError


class Target:
    def __init__(self, model, tokenizer, taps: Sequence[int] = ()):
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.taps = list(taps)
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.num_layers = int(cfg.num_hidden_layers)
        self.hidden_size = int(cfg.hidden_size)
        self.vocab_size = int(model.get_input_embeddings().weight.shape[0])
        self.config = cfg
        # Every id that ends an answer: the tokenizer's EOS and the model's generation config's (often several).
        gen = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        gen = [gen] if isinstance(gen, int) else list(gen or [])
        self.eos = sorted({int(i) for i in gen + [getattr(tokenizer, "eos_token_id", None)] if i is not None})

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.get_input_embeddings()(ids)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        return self.model.get_output_embeddings()(h)

    def head_rows(self, ids: np.ndarray) -> torch.Tensor:
        """The head's weight rows [N, H] for target ids `ids` (tied or untied)."""
        return self.model.get_output_embeddings().weight[torch.as_tensor(ids, device=self.device)].detach().float()

    def output_gain(self) -> Optional[torch.Tensor]:
        """The target's final-norm gain (norm of a vector of ones), the drafter's starting output norm (see
        `dflash_mlx.train.drafter.output_scale`); None when the layout is unknown."""
        norm = getattr(getattr(self.model, "model", None), "norm", None)
        if norm is None:
            return None
        with torch.no_grad():
            ones = torch.ones(1, self.hidden_size, device=self.device, dtype=next(norm.parameters()).dtype)
            return norm(ones)[0].float().cpu()

    @torch.no_grad()
    def features(self, tokens: torch.Tensor, taps: Optional[Sequence[int]] = None) -> torch.Tensor:
        """Features [R, S, n*H] of the tapped layers for token rows [R, S] (the decoder alone: no head, no logits)."""
        taps = self.taps if taps is None else list(taps)
        out = self.model.get_decoder()(input_ids=tokens.to(self.device), output_hidden_states=True, use_cache=False)
        return torch.cat([out.hidden_states[k + 1] for k in taps], dim=-1)

    @torch.no_grad()
    def argmax_rows(self, tokens: np.ndarray, batch: int = 16, progress: bool = False) -> np.ndarray:
        """The target's greedy choice at every position of every row, [N, S] int32 (labels for --labels target)."""
        from tqdm import tqdm

        out = np.zeros(tokens.shape, dtype=np.int32)
        for begin in tqdm(range(0, len(tokens), batch), desc="target labels", unit="batch", disable=not progress):
            ids = torch.as_tensor(tokens[begin : begin + batch], dtype=torch.long, device=self.device)
            logits = self.model(input_ids=ids, use_cache=False).logits
            out[begin : begin + batch] = logits.argmax(-1).cpu().numpy()
        return out


def load_torch_target(ref: str, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> Target:
    """A target from a Hugging Face / mlx-lm folder or a `.gguf` file (dequantized by transformers)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(ref).expanduser()
    if not path.exists():
        raise DFlashError(f"target '{ref}' does not exist; pass a model folder or a .gguf file")
    folder = path
    if path.is_file():
        if path.suffix != ".gguf":
            raise DFlashError(f"target '{ref}' is a file but not a .gguf; pass a model folder or a .gguf file")
        folder = gguf_folder(path)
    import transformers

    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    dtype_key = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"  # renamed in transformers 4.56
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
        model = AutoModelForCausalLM.from_pretrained(str(folder), **{dtype_key: dtype})
    except (OSError, ValueError, ImportError) as e:
        raise DFlashError(f"cannot load target '{ref}' with transformers: {' '.join(str(e).split())[:300]}") from None
    return Target(model.to(device), tokenizer)


def gguf_folder(path: Path) -> Path:
    """The Hugging Face folder converted from the GGUF file `path` (beside it, `NAME.hf/`), made on first use with
    dflash-mlx's own GGUF converter (numpy only): the same fp32 weights the MLX side loads."""
    folder = path.with_suffix(".hf")
    if not (folder / "config.json").is_file():
        from ..convert.gguf import convert_gguf_to_hf

        convert_gguf_to_hf(path, folder, force=folder.exists())
    return folder


def pick_device(name: Optional[str] = None) -> torch.device:
    if name:
        return torch.device(name)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def describe(device: torch.device) -> str:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return f"cuda ({props.name}, {props.total_memory / 2 ** 30:.0f} GiB)"
    return f"{device.type}"
