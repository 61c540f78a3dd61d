"""Hugging Face models: captured with their default arguments, and rebuilt from their config for ``generate()``.

A decoder called with its defaults returns its KV cache (a ``DynamicCache`` object, which ``torch.export`` cannot
output): sparta captures the cache-free forward (``use_cache=False``) and records the model's class and config, so
that :mod:`sparta.generation` can rebuild the model around sparta's kernels with Hugging Face's own cache and
generation loop. Classes are found by name among ``transformers``' own model classes only (no arbitrary import).
"""

from __future__ import annotations

import contextlib
import inspect

from ..errors import SpartaError


def is_hf_model(module) -> bool:
    """Whether ``module`` is a ``transformers`` ``PreTrainedModel``."""
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return False
    return isinstance(module, PreTrainedModel)


@contextlib.contextmanager
def cache_free(module, example_kwargs: dict):
    """Capture a Hugging Face model whose forward returns its cache by default as its cache-free forward: its
    ``config.use_cache`` is False while inside (unless the caller passed ``use_cache`` itself)."""
    config = getattr(module, "config", None)
    takes = "use_cache" in inspect.signature(module.forward).parameters
    if not is_hf_model(module) or not takes or "use_cache" in example_kwargs \
            or not getattr(config, "use_cache", False):
        yield
        return
    config.use_cache = False
    try:
        yield
    finally:
        config.use_cache = True


def model_record(module) -> dict | None:
    """What rebuilds a Hugging Face model around sparta's kernels: its class name and config (None: not one)."""
    if not is_hf_model(module):
        return None
    config = module.config.to_dict()
    config["use_cache"] = True                  # generation runs with a cache
    return {"class": type(module).__name__, "config": config,
            "generative": bool(getattr(module, "can_generate", lambda: False)())}


def model_config(record: dict):
    """The config object of a :func:`model_record`, built by its model class's own config class."""
    return model_class(record["class"]).config_class.from_dict(dict(record["config"]))


def model_class(name: str):
    """The ``transformers`` model class ``name`` (a ``PreTrainedModel`` of the package itself), else an error."""
    try:
        import transformers
    except ImportError as exc:
        raise SpartaError("rebuilding a Hugging Face model needs transformers (pip install transformers)") from exc
    cls = getattr(transformers, name, None) if isinstance(name, str) and name.isidentifier() else None
    if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)
            and cls.__module__.startswith("transformers.models.")):
        raise SpartaError(f"{name!r} is not a Hugging Face transformers model class this transformers "
                          f"({transformers.__version__}) has")
    return cls

