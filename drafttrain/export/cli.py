"""key=value command lines of the export scripts, validated into their dataclasses (the project's CLI style)."""

from __future__ import annotations

import sys
from typing import TypeVar

T = TypeVar("T")


def parse(schema: type[T], argv: list[str] | None = None) -> T:
    """Hydra-style ``key=value`` overrides -> a validated ``schema`` instance.

    Uses :func:`drafttrain.cliconfig.parse_cli` where the project has it; otherwise OmegaConf's dotlist
    (same grammar for key=value, nested.key=value and lists) merged strictly into the schema.

    Raises:
        ConfigError: unknown key (named), wrong type, or a --flag.
    """
    from drafttrain import cliconfig

    if hasattr(cliconfig, "parse_cli"):
        return cliconfig.parse_cli(schema, argv)
    from omegaconf import OmegaConf

    from drafttrain.config import ConfigError

    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(schema.__doc__)
        for k, v in OmegaConf.to_container(OmegaConf.structured(schema)).items():
            print(f"  {k}={v}")
        raise SystemExit(0)
    flags = [a for a in argv if a.startswith("-")]
    if flags:
        raise ConfigError(f"options are key=value words (no --flags), got {flags}")
    return cliconfig.validate_into(schema, OmegaConf.from_dotlist([a.removeprefix("+") for a in argv]))
