"""Optional dependencies: import them on use, and say which extra brings them when missing."""

from __future__ import annotations

import importlib
import warnings
from types import ModuleType

EXTRAS: dict[str, str] = {
    "ray": "ray",
    "boto3": "s3",
    "ipywidgets": "notebook",
    "papermill": "notebook",
    "matplotlib": "viz",
    "vllm": "gpu",
    "fastapi": "serve",
    "starlette": "serve",
    "openai": "serve",
    "prometheus_client": "serve",
    "tensorboard": "tensorboard",
    "mlflow": "mlflow",
    "sqlalchemy": "mlflow",
    "alembic": "mlflow",
    "wandb": "wandb",
}


def require(module: str) -> ModuleType:
    """Import `module`, or raise ImportError naming the extra (`pip install 'workbench[x]'`)."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        top = module.split(".")[0]
        extra = EXTRAS.get(top, "all")
        raise ImportError(
            f"{top!r} is needed for this feature but is not installed: "
            f"pip install 'workbench[{extra}]' (or `make setup`)"
        ) from err


def warn_fallback(path: str, reason: str) -> None:
    """The one line a fast path that fell back prints, with the reason (the host's `speed/*`
    metrics then show 0 for it)."""
    warnings.warn(f"{path} fell back to the slower path: {reason[:300]}", RuntimeWarning,
                  stacklevel=2)
