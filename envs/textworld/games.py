"""Generate real TextWorld games from a seed and keep them in a disk cache.

``game_file(spec, seed)`` returns the path of a compiled ``.z8`` game. The
first call for a ``(spec, seed)`` pair builds it with TextWorld's Python API
(1-4 s); later calls, in this or any other process, reuse the file.

The cache holds at most ``max_games`` games (``MAX_CACHED_GAMES``, 1,000, about
400 MB at the default spec): a use sets a game's mtime, and building a new one
deletes the least recently used past the cap. Without it, an env reset without a
seed (a new game each time) grew the folder for ever. A dropped game is built
again, identically, from its spec and seed, which is how a snapshot of it is
restored; an env that has loaded a game keeps it in memory. Set the cap above the
number of games in use at once across the processes that share the folder.

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

__all__ = ["MAX_CACHED_GAMES", "GameSpec", "default_cache_dir", "game_file", "game_spec",
           "require_textworld", "stale_games"]

_INSTALL_HINT = "pip install 'agentrl[textworld]' (or: pip install textworld)"
_COMPILE_LOCK = threading.Lock()
MAX_CACHED_GAMES = 1_000
_GAME_GLOB = "r*_o*_q*_*_s*.z8"  # GameSpec.key's names: nothing else in the folder is touched


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


def game_file(spec: GameSpec, seed: int, cache_dir: str | os.PathLike | None = None,
              max_games: int = MAX_CACHED_GAMES) -> Path:
    """The compiled game for ``(spec, seed)``, generated and cached on first use; the
    cache keeps the ``max_games`` most recently used games (see the module docstring)."""
    folder = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = folder / f"{spec.key(seed)}.z8"
    if _mark_used(target):
        return target
    textworld = require_textworld()
    folder.mkdir(parents=True, exist_ok=True)
    with _COMPILE_LOCK:
        if _mark_used(target):
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
        for stale in stale_games(folder, max_games, keep=target):
            # the .json first: without it a game counts as incomplete, never as cached
            stale.with_suffix(".json").unlink(missing_ok=True)
            stale.unlink(missing_ok=True)
    return target


def _mark_used(target: Path) -> bool:
    """Whether ``target`` is a complete cached game; if so its mtime becomes now (its last use)."""
    if not (target.is_file() and target.with_suffix(".json").is_file()):
        return False
    try:
        os.utime(target)
    except OSError:  # gone meanwhile (another process dropped it), or a read-only cache
        return target.is_file()
    return True


def stale_games(folder: Path, max_games: int, keep: Path | None = None) -> list[Path]:
    """The cached games of ``folder`` past its ``max_games`` most recently used (by mtime),
    oldest first; never ``keep``."""
    games = []
    for path in folder.glob(_GAME_GLOB):
        try:
            games.append((path.stat().st_mtime_ns, path.name, path))
        except OSError:  # dropped by another process meanwhile
            continue
    games.sort(reverse=True)
    return [path for *_, path in reversed(games[max_games:]) if path != keep]


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
