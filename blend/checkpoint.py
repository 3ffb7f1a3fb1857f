"""Reading a checkpoint folder (config, weights, tokenizer), each failure a :class:`CheckpointError`.

transformers' loaders raise whatever their parsers raise on a damaged file (safetensors' own
``SafetensorError`` for a truncated or zeroed file, ``JSONDecodeError``, ``TypeError`` for a
tokenizer file of the wrong shape, ``ZeroDivisionError`` for a config with no heads...), and fill a
tensor the weight files lack with random values, saying so only in a log line kvblend silences.
Here:

- a failure to read the config, the weights or the tokenizer is one error naming the folder;
- a tensor the model needs that the weight files lack, or hold at another shape, is refused,
  never filled at random;
- a config that declares more layers than the weight files hold is refused before the model is
  built (a config.json claiming 10**6 layers had transformers allocate and initialize every missing
  one: memory and time without bound); safetensors headers name the layers, pickled ``.bin`` weights
  bound them by their size;
- a file transformers would read that is a FIFO or a device is refused, not waited on.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch

from blend import safeio
from blend.errors import CheckpointError

# the files of a checkpoint folder transformers may open (config, weights, tokenizer, chat template)
READ_SUFFIXES = (".json", ".safetensors", ".bin", ".jinja", ".txt", ".model", ".tiktoken")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")  # model.layers.N.* (a base model's checkpoint: layers.N.*)
MAX_ERROR_CHARS = 200


def brief(e: BaseException) -> str:
    """``TypeName: message`` on one line, cut to :data:`MAX_ERROR_CHARS` (transformers' messages span tables).

    Args:
        e: the exception to describe.

    Returns:
        The one-line description, with ``...`` where it was cut.
    """
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:MAX_ERROR_CHARS]}{'...' if len(text) > MAX_ERROR_CHARS else ''}"


def check_files(path: Path) -> None:
    """Refuse a folder where a file transformers would open is not a regular file (a FIFO is waited on for
    ever, a device read without end). Symbolic links to regular files (a hub cache's blobs) are fine.

    Args:
        path: the checkpoint folder.

    Raises:
        CheckpointError: naming the file and what it is.
    """
    for p in sorted(path.iterdir()):
        if p.suffix in READ_SUFFIXES and not safeio.is_regular(p):
            try:
                kind = safeio.file_kind(os.stat(p).st_mode)
            except OSError as e:
                kind = f"unreadable ({e.strerror})"
            raise CheckpointError(f"{p}: {kind}, not a regular file")


def load_config(path: Path):
    """The folder's transformers config.

    Args:
        path: the checkpoint folder.

    Returns:
        The ``PretrainedConfig`` transformers reads from ``config.json``.

    Raises:
        CheckpointError: ``config.json`` absent or unreadable, or one transformers refuses.
    """
    from transformers import AutoConfig

    check_files(path)
    try:
        return AutoConfig.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - any failure of transformers' parser of untrusted bytes
        raise CheckpointError(f"{path}: not a model checkpoint directory ({brief(e)})") from None


def weight_names(path: Path) -> set[str] | None:
    """The tensor names the folder's safetensors files hold (their headers only), or None where it has none
    (a ``pytorch_model.bin`` checkpoint: transformers reads it with ``weights_only``).

    Args:
        path: the checkpoint folder.

    Returns:
        The names of every tensor across its ``*.safetensors`` files, or None where there are none.

    Raises:
        CheckpointError: a safetensors file whose header cannot be read.
    """
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files:
        return None
    names: set[str] = set()
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as h:
                names.update(h.keys())
        except Exception as e:  # noqa: BLE001 - SafetensorError and whatever a damaged header raises
            raise CheckpointError(f"{f}: not a readable safetensors file ({brief(e)})") from None
    return names


def check_layers(path: Path, config) -> None:
    """Refuse a config whose decoder layers are not the ones the weight files hold, before any is built
    (more: transformers would build and fill the missing ones at random; fewer: the model would run
    without the rest).

    Args:
        path: the checkpoint folder.
        config: its transformers config (a ``num_hidden_layers`` that is not an int: nothing is checked).

    Raises:
        CheckpointError: the config's ``num_hidden_layers`` and the layers the safetensors files hold differ.
    """
    names = weight_names(path)
    declared = getattr(config, "num_hidden_layers", None)
    if not isinstance(declared, int):
        return
    if names is None:  # pickled weights: no header to list names without unpickling; their size bounds the layers
        _check_layers_fit(path, declared, getattr(config, "hidden_size", None))
        return
    held = {int(m.group(1)) for m in map(_LAYER.search, names) if m is not None}
    if held != set(range(declared)):
        raise CheckpointError(f"{path}: config.json declares {declared} layers, the weight files hold "
                              f"{len(held)}{' (not 0..n-1)' if len(held) == declared else ''} "
                              "(a damaged or mismatched checkpoint)")


MIN_LAYER_BYTES_PER_CHANNEL = 4  # a decoder layer's two RMSNorm weights at 2 bytes (fp16/bf16) per channel, at least


def _check_layers_fit(path: Path, declared: int, hidden: object) -> None:
    """Refuse ``declared`` layers of width ``hidden`` that the folder's ``.bin`` weight files are too small to
    hold: each layer has at least its two norms' weights, :data:`MIN_LAYER_BYTES_PER_CHANNEL` bytes per
    channel (a config claiming 10**6 layers over a small file would have transformers build every one).

    Raises:
        CheckpointError: the declared layers' norms alone need more bytes than the weight files have.
    """
    if not isinstance(hidden, int) or hidden <= 0:
        return  # transformers refuses such a config itself
    held = sum(f.stat().st_size for f in path.glob("*.bin"))
    need = declared * hidden * MIN_LAYER_BYTES_PER_CHANNEL
    if need > held:
        raise CheckpointError(f"{path}: config.json declares {declared} layers of width {hidden}; their norms alone "
                              f"need {need} bytes, the weight files hold {held} (a damaged or mismatched checkpoint)")


def load_weights(path: Path) -> torch.nn.Module:
    """The folder's causal LM in fp32 and eval mode, every tensor it needs read from the weight files.

    Args:
        path: the checkpoint folder.

    Returns:
        The model, in eval mode.

    Raises:
        CheckpointError: the weight files cannot be read, lack a tensor the model needs or hold one
            at another shape (transformers would have filled it with random values), or hold decoder layers
            the config does not declare (the model would have run without them).
    """
    from transformers import AutoModelForCausalLM

    try:
        model, info = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    except Exception as e:  # noqa: BLE001 - SafetensorError, RuntimeError (sizes), OSError, ...
        raise CheckpointError(f"{path}: its weights cannot be loaded ({brief(e)})") from None
    lacking = sorted(info.get("missing_keys") or ()) + sorted(str(k) for k in info.get("mismatched_keys") or ())
    beyond = sorted(k for k in info.get("unexpected_keys") or () if _LAYER.search(str(k)))
    if beyond:  # layers the config leaves out would be dropped: the model would run without them
        raise CheckpointError(f"{path}: the weight files hold decoder layers config.json does not declare "
                              f"({beyond[0]}{f' and {len(beyond) - 1} more' if len(beyond) > 1 else ''})")
    if lacking:
        shown = ", ".join(lacking[:3]) + (f" and {len(lacking) - 3} more" if len(lacking) > 3 else "")
        raise CheckpointError(f"{path}: the weight files lack {len(lacking)} tensor(s) the model needs ({shown}); "
                              "transformers would have filled them with random values")
    return model.eval()


def check_finite(model: torch.nn.Module, path: Path) -> None:
    """Refuse weights holding NaN or infinity (a damaged file whose header still parses).

    Args:
        model: the loaded model (its floating-point parameters are checked).
        path: its checkpoint folder (named in the error).

    Raises:
        CheckpointError: naming the first such parameter.
    """
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.is_floating_point() and not bool(torch.isfinite(p).all()):
                raise CheckpointError(f"{path}: the weight {name} holds NaN or infinite values")


def load_tokenizer(path: Path):
    """The folder's tokenizer.

    Args:
        path: the checkpoint folder.

    Returns:
        The tokenizer transformers builds from the folder's files.

    Raises:
        CheckpointError: its files are absent, not JSON, or of a shape transformers refuses.
    """
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - JSONDecodeError, TypeError, AttributeError, ...
        raise CheckpointError(f"{path}: its tokenizer cannot be loaded ({brief(e)})") from None
