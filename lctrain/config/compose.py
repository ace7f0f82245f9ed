"""Hydra composition of conf/ + recipes/ + overrides into a typed LctrainConfig (the resolved
config as YAML: lctrain.config.resolved).

Recipes live in recipes/ (not under conf/) and are registered in Hydra's ConfigStore as the
`recipe` group, so `+recipe=NAME` selects recipes/NAME.yaml with its own defaults list. Keys that
the schema does not know (also those added with `+key=...`) are all reported at once.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field
from pathlib import Path

from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from lctrain.config.errors import ConfigError
from lctrain.config.paths import conf_dir, recipes_dir
from lctrain.config.schema import LctrainConfig
from lctrain.config.suggest import did_you_mean


@dataclass
class Composed:
    """A composed configuration with where it runs and the overrides that made it."""

    cfg: LctrainConfig
    run_dir: Path
    overrides: list[str]
    origins: dict[str, str] = field(default_factory=dict)
    """Where each model.* value came from (lctrain.prepare.init_from)."""
    notes: list[str] = field(default_factory=list)
    """What resolving the config changed, for the command to report at start."""


_registered: tuple | None = None
"""The recipe files (path, modification time) the ConfigStore holds: stored again only when
they change (a third of a composition's time, for every compose of a process)."""


def _register() -> None:
    global _registered
    paths = sorted(recipes_dir().glob("*.yaml"))
    files = tuple((path, path.stat().st_mtime_ns) for path in paths)
    if files == _registered:
        return
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=LctrainConfig)
    for path in paths:
        cs.store(group="recipe", name=path.stem, node=OmegaConf.load(path), package="_global_")
    _registered = files


def unknown_keys(node: object, schema: type, prefix: str = "") -> list[str]:
    """Dotted keys present in `node` (a plain dict) that the dataclass `schema` does not define."""
    fields = {f.name: f for f in dataclasses.fields(schema)}
    out = []
    for key, value in node.items():
        dotted = f"{prefix}{key}"
        if key not in fields:
            out.append(_unknown(dotted, fields, prefix))
            continue
        sub = fields[key].type
        sub_type = getattr(sys.modules[LctrainConfig.__module__], sub, None) if isinstance(
            sub, str) else sub
        if isinstance(value, dict) and dataclasses.is_dataclass(sub_type):
            out += unknown_keys(value, sub_type, dotted + ".")
    return out


def _unknown(dotted: str, fields: dict, prefix: str) -> str:
    near = did_you_mean(dotted[len(prefix):], fields, prefix)
    return (f"unknown key {dotted}{near}; valid keys"
            f"{' under ' + prefix[:-1] if prefix else ''}: {', '.join(fields)}")


def override_key_problems(overrides: list[str]) -> list[str]:
    """The keys of `section.key=value` overrides that the schema does not define, each with the
    known key it is closest to: Hydra itself refuses them with "Could not override" and no
    suggestion (`+section.key=value` adds a key, which `unknown_keys` reports after composing)."""
    out = []
    for override in overrides:
        key = override.split("=", 1)[0]
        if "=" not in override or key.startswith(("+", "~", "hydra.")) or "." not in key:
            continue  # additions, deletions, Hydra's own keys, config groups (model=NAME)
        nested = None  # section.key as {"section": {"key": None}}, walked as a composed node
        for part in reversed(key.split(".")):
            nested = {part: nested}
        out += unknown_keys(nested, LctrainConfig)
    return out


def choice_problems(overrides: list[str]) -> list[str]:
    """Recipes (+recipe=NAME) and model presets (model=NAME) that do not exist, each with the
    closest names and where the choices live (Hydra's own message lists its search path)."""
    groups = {"+recipe": ("recipe", recipes_dir()), "model": ("model preset", conf_dir() / "model")}
    out = []
    for override in overrides:
        key, _, name = override.partition("=")
        if key not in groups or not name:
            continue
        what, folder = groups[key]
        known = sorted(p.stem for p in folder.glob("*.yaml"))
        if name not in known:
            out.append(f"unknown {what} {key}={name}{did_you_mean(name, known)}; the "
                       f"{what}s are {', '.join(known)} ({folder})")
    return out


def compose(overrides: list[str]) -> Composed:
    """Compose, check keys and types, and return a `Composed`; raises ConfigError."""
    problems = choice_problems(overrides) + override_key_problems(overrides)
    if problems:
        raise ConfigError(problems)
    _register()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(version_base="1.3", config_dir=str(conf_dir()),
                                   job_name="lctrain"):
            raw = hydra_compose("config", overrides=overrides, return_hydra_config=True)
            HydraConfig.instance().set_config(raw)
            run_dir = Path(str(OmegaConf.select(raw, "hydra.run.dir")))
            recipe = OmegaConf.select(raw, "hydra.runtime.choices.recipe")
            user = OmegaConf.to_container(
                OmegaConf.masked_copy(raw, [k for k in raw if k != "hydra"]), resolve=True)
    except (HydraException, OmegaConfBaseException) as e:
        raise ConfigError([_hydra_message(e)],
                          header="configuration could not be composed") from e
    problems = unknown_keys(user, LctrainConfig) + required_keys(recipe, overrides)
    if problems:
        raise ConfigError(problems)
    try:
        merged = OmegaConf.merge(OmegaConf.structured(LctrainConfig), user)
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        raise ConfigError([_hydra_message(e)]) from e
    assert isinstance(cfg, LctrainConfig)
    return Composed(cfg=cfg, run_dir=run_dir, overrides=list(overrides))


def required_keys(recipe: str | None, overrides: list[str]) -> list[str]:
    """Keys that the selected recipe marks with Hydra's mandatory value `???` and that no
    override sets: merged over the schema's defaults, a `???` would keep the default silently."""
    if recipe is None:
        return []
    path = recipes_dir() / f"{recipe}.yaml"
    given = {o.split("=", 1)[0].lstrip("+~") for o in overrides}
    missing = sorted(OmegaConf.missing_keys(OmegaConf.load(path)) - given)
    out = [f"{key} is required by +recipe={recipe} (??? in recipes/{path.name}); set {key}=..."
           for key in missing]
    if missing:  # a plan needs neither: what to give it instead
        instead = [f"{key}=null" for key in missing]
        instead += ["model.hf_overrides=[]"] * ("model.init_from" in missing)
        instead += ["data.source=synthetic"] * ("data.path" in missing)
        out.append(f"to plan or trace +recipe={recipe} without them: lctrain plan "
                   f"+recipe={recipe} {' '.join(instead)}")
    return out


def _hydra_message(e: BaseException) -> str:
    parts = [str(e).strip()]
    cause = e.__cause__
    while cause is not None:
        parts.append(str(cause).strip())
        cause = cause.__cause__
    return " <- ".join(p.replace("\n", " ") for p in parts if p)
