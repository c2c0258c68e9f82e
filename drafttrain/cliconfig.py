"""The one command-line style of every entry point: Hydra ``key=value`` overrides validated into a dataclass.

    python -m scripts.NAME key=value nested.key=value 'list=[1,2]' +new_key=value

:func:`parse_cli` composes a script's config (its ``conf/NAME.yaml``, or its dataclass schema alone,
registered in Hydra's config store), applies the overrides with Hydra's own grammar (the grammar
``train.py`` takes) and merges the result into the schema, so a typo'd key, a key that moved, or a
wrong type fails with the key's name before any model or data loads. ``--help`` prints the schema's
docstring and every key with its default.

This module is the bottom of the config layer: :mod:`drafttrain.config` (the schemas) imports
:class:`ConfigError` and :func:`validate_into` from here, never the other way round.
"""

from __future__ import annotations

import difflib
import re
import sys
from dataclasses import fields, is_dataclass
from pathlib import Path
from collections.abc import Callable
from typing import Any, TypeVar

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

T = TypeVar("T")
CONF_DIR = Path(__file__).resolve().parents[1] / "conf"


class ConfigError(ValueError):
    """The composed config does not match the schema (unknown key, wrong type, bad value)."""


class FatalError(RuntimeError):
    """A fault the job cannot go on from (a full disk, a dead vLLM process) whose message is one complete line:
    the entry points print it without a traceback and exit with status 1; the same command resumes afterwards."""


def validate_into(schema: type[T], cfg: DictConfig | dict[str, Any] | T, moved: dict[str, str] | None = None) -> T:
    """Merge ``cfg`` (Hydra's own ``hydra`` node ignored) into dataclass ``schema``.

    Args:
        schema: a dataclass type.
        cfg: a composed config, a plain (nested) dict, or already a ``schema`` instance.
        moved: old dotted key -> its new dotted key; an old key in ``cfg`` is reported as moved.

    Returns:
        A ``schema`` instance (``cfg`` itself when it already is one).

    Raises:
        ConfigError: unknown key (named with its full path, with where it moved or the closest
            known key), a wrong type, or a mandatory value (``???``) left unset.
    """
    if isinstance(cfg, schema):
        return cfg
    if isinstance(cfg, DictConfig):
        try:
            cfg = OmegaConf.to_container(cfg, resolve=True)
        except OmegaConfBaseException as e:  # e.g. a mandatory value (???) left unset
            raise ConfigError(f"config key '{getattr(e, 'full_key', '?')}': {getattr(e, 'msg', e)}") from None
    cfg = {k: v for k, v in dict(cfg).items() if k != "hydra"}
    for old in moved or {}:
        if _has_key(cfg, old):
            raise ConfigError(moved_message(old, moved[old]))
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema), cfg)
    except OmegaConfBaseException as e:  # unknown key / type mismatch
        key = getattr(e, "full_key", None)
        msg = str(getattr(e, "msg", e)).splitlines()[0]
        raise ConfigError(f"invalid config key '{key}': {msg}{_did_you_mean(schema, key)}") from None
    try:
        return OmegaConf.to_object(merged)
    except MissingMandatoryValue as e:
        raise ConfigError(f"config key '{e.full_key}' is required (set {e.full_key}=...)") from None


def moved_message(old: str, new: str) -> str:
    return f"config key '{old}' moved to '{new}' (set {new}=... instead)"


def check_moved(overrides: list[str], moved: dict[str, str]) -> None:
    """Raise :class:`ConfigError` naming the new key for any override (``key=v``, ``+key=v``, ``~key``) of a moved key."""
    for o in overrides:
        key = _override_key(o)
        if key in moved:
            raise ConfigError(moved_message(key, moved[key]))


def parse_cli(schema: type[T], argv: list[str] | None = None, *, config_name: str | None = None,
              moved: dict[str, str] | None = None) -> T:  # fmt: skip
    """Hydra-style ``key=value`` overrides -> a validated ``schema`` instance (the CLI of every script).

    Args:
        schema: the script's dataclass.
        argv: the overrides (default ``sys.argv[1:]``); ``-h`` / ``--help`` prints the keys and exits 0.
        config_name: compose ``conf/<config_name>.yaml`` (its defaults list, groups, interpolations)
            before the overrides; None = the schema's own defaults.
        moved: old dotted key -> new dotted key (a clear error instead of "unknown key").

    Raises:
        ConfigError: an unknown or moved key, an override Hydra cannot parse, a wrong type.
    """
    from hydra import compose, initialize, initialize_config_dir
    from hydra.core.config_store import ConfigStore
    from hydra.errors import HydraException

    argv = list(sys.argv[1:] if argv is None else argv)
    helping = any(a in ("-h", "--help") for a in argv)
    argv = [a for a in argv if a not in ("-h", "--help")]
    flags = [a for a in argv if a.startswith("-")]
    if flags:
        raise ConfigError(f"options are Hydra-style key=value words (no --flags), got {flags}; "
                          f"--help lists the keys")  # fmt: skip
    check_moved(argv, moved or {})
    name = config_name
    if name is None:
        name = f"_cli_{schema.__module__}.{schema.__qualname__}"
        ConfigStore.instance().store(name=name, node=schema)
    try:
        # a schema alone: no config folder, so its keys never collide with conf/'s groups (e.g. target=)
        if config_name:
            ctx = initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3")
        else:
            ctx = initialize(version_base="1.3")
        with ctx:
            cfg = compose(name, overrides=argv)
    except (HydraException, OmegaConfBaseException) as e:
        msg = str(e).strip()
        m = re.search(r"Could not override '([^']+)'", msg)
        if m:
            hint = _did_you_mean(schema, m.group(1))
            raise ConfigError(f"unknown config key '{m.group(1)}'{hint} (--help lists the keys)") from None
        cause = str(e.__cause__ or "").strip().splitlines()[:1]
        hint = [f"in {o!r}, quote every list element that holds '=' (e.g. 'overrides=[\"a=1\",\"b.c=[2,3]\"]')"
                for o in argv if "=" in o.split("=", 1)[1]][:1]  # fmt: skip
        raise ConfigError("; ".join([(msg.splitlines() or [type(e).__name__])[0], *cause, *hint])) from None
    if helping:
        values = OmegaConf.to_container(cfg, resolve=False)
        values = {k: v for k, v in values.items() if k != "hydra"}
        try:  # the schema's defaults under the composed values
            values = OmegaConf.to_container(OmegaConf.merge(OmegaConf.structured(schema), values), resolve=False)
        except OmegaConfBaseException:
            pass
        print(usage(schema, config_name, values))
        raise SystemExit(0)
    return validate_into(schema, cfg, moved)


def run_cli(main: Callable[[], Any]) -> None:
    """Call a script's ``main()`` (overrides from ``sys.argv``); a :class:`ConfigError` exits with status 2
    and one line naming the key, instead of a traceback; a :class:`FatalError` (a full disk, a dead vLLM process)
    exits with status 1 and its one line. Scripts end with ``run_cli(main)``."""
    try:
        main()
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    except FatalError as e:
        print(str(e), file=sys.stderr)
        raise SystemExit(1) from None


def usage(schema: type, config_name: str | None = None, values: dict | None = None) -> str:
    """The script's docstring and every key with its value (default: the schema's defaults) and the
    comment beside it in the schema (the ``--help`` text)."""
    doc = (sys.modules[schema.__module__].__doc__ or schema.__doc__ or "").strip()
    src = f"conf/{config_name}.yaml over " if config_name else ""
    lines = [doc, "", f"Keys ({src}{schema.__module__}.{schema.__qualname__}), set as key=value:", ""]
    values = OmegaConf.to_container(OmegaConf.structured(schema)) if values is None else values
    return "\n".join(lines + _key_lines(schema, values)) + "\n"


def _key_lines(schema: type, values: dict, prefix: str = "") -> list[str]:
    import inspect

    import yaml

    try:
        src = inspect.getsource(schema)
    except (OSError, TypeError):
        src = ""
    notes = dict(re.findall(r"^\s+(\w+):[^#\n]*#\s*(.*)$", src, re.M))
    out = []
    for f in fields(schema):
        v = values.get(f.name, "?")
        t = f.default_factory() if callable(f.default_factory) else None  # type: ignore[misc]
        if is_dataclass(t):
            out += _key_lines(type(t), v if isinstance(v, dict) else {}, prefix + f.name + ".")
            continue
        text = yaml.safe_dump(v, default_flow_style=True).strip().removesuffix("...").strip()
        note = f"  # {notes[f.name]}" if f.name in notes else ""
        out.append(f"  {prefix}{f.name}={text}{note}")
    return out


def _override_key(o: str) -> str:
    return o.lstrip("+~").split("=", 1)[0].split("@", 1)[0]


def _has_key(d: dict, dotted: str) -> bool:
    for part in dotted.split("."):
        if not isinstance(d, dict) or part not in d:
            return False
        d = d[part]
    return True


def _keys(schema: type, prefix: str = "") -> list[str]:
    out = []
    for f in fields(schema):
        out.append(prefix + f.name)
        t = f.default_factory() if callable(f.default_factory) else None  # type: ignore[misc]
        if is_dataclass(t):
            out += _keys(type(t), prefix + f.name + ".")
    return out


def _did_you_mean(schema: type, key: str | None) -> str:
    if not key or not is_dataclass(schema):
        return ""
    keys = _keys(schema)
    if key in keys:  # a known key with a bad value: no suggestion
        return ""
    close = difflib.get_close_matches(key, keys, n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""
