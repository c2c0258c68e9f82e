"""Validate a script's composed Hydra config into its dataclass schema (as :func:`drafttrain.config.validate`
does for training), so a typo'd key or a wrong type fails with the key's name before any work starts."""

from __future__ import annotations

from typing import Any, TypeVar

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from drafttrain.config import ConfigError

T = TypeVar("T")


def validate_into(schema: type[T], cfg: DictConfig | dict[str, Any] | T) -> T:
    """Merge ``cfg`` (Hydra's own ``hydra`` node ignored) into dataclass ``schema``.

    Returns:
        A ``schema`` instance (``cfg`` itself when it already is one).

    Raises:
        ConfigError: unknown key (named with its full path) or wrong type.
    """
    if isinstance(cfg, schema):
        return cfg
    if isinstance(cfg, DictConfig):
        cfg = OmegaConf.to_container(cfg, resolve=True)
    cfg = {k: v for k, v in dict(cfg).items() if k != "hydra"}
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema), cfg)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None)
        raise ConfigError(f"invalid config key '{key}': {getattr(e, 'msg', e)}") from None
    return OmegaConf.to_object(merged)
