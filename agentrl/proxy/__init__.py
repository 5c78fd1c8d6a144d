"""The OpenAI-compatible harness proxy: serve a policy, record token-exact session trees."""

from .app import HTTPError, Proxy, RunningServer, create_app, serve, serve_in_thread
from .schemas import ProxyConfig
from .sessions import Session

__all__ = [
    "HTTPError",
    "Proxy",
    "ProxyConfig",
    "RunningServer",
    "Session",
    "create_app",
    "serve",
    "serve_in_thread",
]
