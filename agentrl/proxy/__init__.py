"""The harness proxy: serve a policy over OpenAI and Anthropic APIs, record token-exact session trees.

``create_app`` / ``serve`` run the proxy (``app.py``): Chat Completions and
completions, Responses (``responses_api.py``) and Anthropic Messages
(``anthropic_api.py``), one internal conversation for all (``conversation.py``,
``handlers.py``); ``Session`` records one
harness episode as a ``RolloutTree`` (``sessions.py``); ``run_harness_episode``
runs an agent program in a session (``harness.py``); ``create_env_app`` serves
registered envs to such programs (``envserver.py``); ``HarnessRollouts`` makes
those episodes a trainer's rollout source (``rollouts.py``).
"""

from .app import HTTPError, Proxy, RunningServer, create_app, serve, serve_in_thread
from .envserver import EnvServerConfig, create_env_app, serve_envs
from .harness import EnvServer, SessionHandle, open_session, run_harness_episode
from .rollouts import HarnessRollouts, harness_rollouts, merge_sessions
from .schemas import ProxyConfig
from .sessions import Session

__all__ = [
    "EnvServer",
    "EnvServerConfig",
    "HTTPError",
    "HarnessRollouts",
    "Proxy",
    "ProxyConfig",
    "RunningServer",
    "Session",
    "SessionHandle",
    "create_app",
    "create_env_app",
    "harness_rollouts",
    "merge_sessions",
    "open_session",
    "run_harness_episode",
    "serve",
    "serve_envs",
    "serve_in_thread",
]
