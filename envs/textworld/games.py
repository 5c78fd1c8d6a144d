"""Generate real TextWorld games from a seed and keep them in a disk cache.

``game_file(spec, seed)`` returns the path of a compiled ``.z8`` game. The
first call for a ``(spec, seed)`` pair builds it with TextWorld's Python API
(about 1 s); later calls, in this or any other process, reuse the file.

TextWorld's Inform 7 compiler writes ``$HOME/Inform``, so ``HOME`` points at
the cache folder while a game compiles. ``HOME`` is process-wide, hence the
lock. A game is compiled in a private temporary folder and then renamed into
place, so two processes never see half-written files.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from agentrl.errors import EnvError

__all__ = ["GameSpec", "default_cache_dir", "game_file", "game_spec", "require_textworld"]

_INSTALL_HINT = "pip install 'agentrl[textworld]' (or: pip install textworld)"
_COMPILE_LOCK = threading.Lock()


class GameSpec(BaseModel):
    """The shape of generated games; with a seed it names one game exactly."""

    model_config = ConfigDict(frozen=True)

    nb_rooms: int = Field(3, ge=1, le=20, description="rooms in the map")
    nb_objects: int = Field(6, ge=1, le=50, description="objects placed in the world")
    quest_length: int = Field(3, ge=1, le=20, description="actions in the winning walkthrough")
    theme: str = Field("house", description="TextWorld grammar theme")

    def key(self, seed: int) -> str:
        """A file-name-safe name of the game made from this spec and ``seed``."""
        return f"r{self.nb_rooms}_o{self.nb_objects}_q{self.quest_length}_{self.theme}_s{int(seed)}"


def game_spec(**settings: Any) -> GameSpec:
    """``GameSpec(**settings)``, or an ``EnvError`` naming the first bad setting and its value
    (pydantic's ``ValidationError`` is not agentrl's, and its text is several lines)."""
    try:
        return GameSpec(**settings)
    except ValidationError as exc:
        err = exc.errors()[0]
        key = ".".join(map(str, err["loc"])) or "game settings"
        raise EnvError(f"{key}: {err['msg'][0].lower()}{err['msg'][1:]}, not {err.get('input')!r:.80}") from exc


def require_textworld() -> Any:
    """Import ``textworld``, or fail with what to install."""
    try:
        import textworld
        import textworld.generator  # noqa: F401  (GameMaker and compiler live here)
    except ImportError as exc:
        raise EnvError(
            f"agentrl/TextWorld-v0 needs the textworld package: {_INSTALL_HINT}"
        ) from exc
    return textworld


def default_cache_dir() -> Path:
    """``$AGENTRL_CACHE/textworld``, else ``~/.cache/agentrl/textworld``."""
    root = os.environ.get("AGENTRL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "agentrl"
    )
    return Path(root) / "textworld"


def game_file(spec: GameSpec, seed: int, cache_dir: str | os.PathLike | None = None) -> Path:
    """The compiled game for ``(spec, seed)``, generated and cached on first use."""
    folder = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = folder / f"{spec.key(seed)}.z8"
    if target.is_file() and target.with_suffix(".json").is_file():
        return target
    textworld = require_textworld()
    folder.mkdir(parents=True, exist_ok=True)
    with _COMPILE_LOCK:
        if target.is_file() and target.with_suffix(".json").is_file():
            return target
        work = Path(tempfile.mkdtemp(prefix=".build-", dir=folder))
        try:
            _compile(textworld, spec, seed, work / target.name, folder)
            # The .json last: its presence marks a complete game.
            os.replace(work / target.name, target)
            os.replace(work / target.with_suffix(".json").name, target.with_suffix(".json"))
        except EnvError:
            raise
        except Exception as exc:  # the generator and compiler raise many kinds
            raise EnvError(f"could not generate TextWorld game {spec.key(seed)}: {exc}") from exc
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return target


def _compile(textworld: Any, spec: GameSpec, seed: int, path: Path, home: Path) -> None:
    options = textworld.GameOptions()
    options.seeds = int(seed)
    options.nb_rooms = spec.nb_rooms
    options.nb_objects = spec.nb_objects
    options.quest_length = spec.quest_length
    options.grammar.theme = spec.theme
    options.path = str(path)
    options.file_ext = ".z8"
    options.force_recompile = True
    old_home = os.environ.get("HOME")
    os.environ["HOME"] = str(home)  # Inform 7 writes $HOME/Inform
    try:
        game = textworld.generator.make_game(options)
        textworld.generator.compile_game(game, options)
    finally:
        if old_home is None:
            os.environ.pop("HOME", None)
        else:
            os.environ["HOME"] = old_home
