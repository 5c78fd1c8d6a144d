"""The local viewer server: the page, the run index, and one tree at a time.

Standard library only (``http.server``): three read-only routes, on
127.0.0.1 by default, no third-party code between the browser and the run.

    GET /                 the page (``page.render_page()``, server mode)
    GET /api/run          the run index: table rows, totals, curves, its generation
    GET /api/tree/<i>     tree i, parsed from its file when asked (the last 64 are kept,
                          at most 256 MB of them);
                          ``?generation=G``: of the index the page holds

A run may still be written (a training run adds steps and metrics rows) or have
a file replaced (a resumed step, a new rollout into the folder, an edited config). Each
``/api/run`` checks whether its files changed (``Run.changed``, a stat of each)
and, when they did, indexes the run again (``Run.reopen``: the changed files
only) under a new generation: a reload of
the page shows the run as it is now. A tree asked for under an older generation
than the server's, or whose line changed on disk, is answered 409 (reload),
never with what now holds its index.

The tokenizer loads in a background thread when the server starts, so the
first page and the run index show at once (the index says the tokenizer is
loading); a tree asked for before it is ready waits for it up to 5 s, then
comes with token ids only, marked ``"tokens_pending": true``: the page asks for
it again until it comes with the texts and the tokenizer's note
(``tokens_note``), so a tree opened early gets its texts without a reload. The
ids-only copy is kept (a few trees) while its file's stamp stays the same, so
that the asking again does not build the tree each time.

Served on a loopback address, it answers only requests addressed to one
(``Host: 127.0.0.1``, ``localhost``, ``[::1]``) and refuses others with 403: a
web page that re-points its own name at 127.0.0.1 (DNS rebinding) would
otherwise read the run from the user's browser as its own origin. Served on
another address (``--host``), where the user chose to expose the run, any
``Host`` is answered.

A thread serves each connection, at most 32 at once (more wait to be accepted),
and a connection that sends nothing for 30 s is closed.
"""

from __future__ import annotations

import ipaddress
import json
import socket
import threading
from collections import OrderedDict
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote

from .page import render_page, run_index, to_json, tree_data
from .run import Run, RunChanged
from .tokens import Decoder

__all__ = ["ViewerServer"]

_CACHED_TREES = 64
_PENDING_TREES = 8  # ids-only copies kept while the tokenizer loads (the page polls for each tree open)
_CACHED_BYTES = 256 * 2**20  # and at most this much of their JSON (a tree can be megabytes of web pages)
_MAX_CONNECTIONS = 32  # threads serving at once; more wait in the listen queue
_IDLE_SECONDS = 30  # a connection that sends nothing this long is closed
_TOKENIZER_WAIT_S = 5.0  # a tree waits this long for the tokenizer, then comes with ids, marked pending
_LOADING_NOTE = "loading the tokenizer: token ids until it is ready (the page shows texts then)"
_LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def _plain_number(text: str) -> bool:
    """ASCII digits of a plausible index: ``int()`` takes '²' and 5,000 digits."""
    return text.isascii() and text.isdigit() and len(text) < 16


class _NoTree(LookupError):
    """A tree number past the run's end (a 404)."""


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _host_name(header: str) -> str:
    """``127.0.0.1:8765`` -> ``127.0.0.1``; ``[::1]:8765`` -> ``::1``."""
    if header.startswith("["):
        return header[1:].split("]", 1)[0]
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


class _BoundedServer(ThreadingHTTPServer):
    """A thread per connection, at most ``_MAX_CONNECTIONS`` at once: a client that
    opens thousands of connections waits in the listen queue instead of starting
    a thread for each."""

    daemon_threads = True
    request_queue_size = 128  # connections waiting for a thread (socketserver's default: 5)

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler]):
        self._slots = threading.BoundedSemaphore(_MAX_CONNECTIONS)
        self._stopping = threading.Event()
        # an IPv6 address (``::1``, ``::``) needs an IPv6 socket: socketserver's default is IPv4 only
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        super().__init__(address, handler)

    def shutdown(self) -> None:
        self._stopping.set()  # the accept loop may be waiting for a slot: it stops waiting
        super().shutdown()

    def process_request(self, request: Any, client_address: Any) -> None:
        while not self._slots.acquire(timeout=0.5):  # as socketserver polls for shutdown
            if self._stopping.is_set():
                self.shutdown_request(request)
                return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class ViewerServer:
    """Serves ``run`` on ``host:port`` (port 0: a free one); ``url`` says where.

    ``load_decoder`` is called once, in a background thread; it returns
    ``(decode or None, a note for the page)``.
    """

    def __init__(self, run: Run, host: str = "127.0.0.1", port: int = 0,
                 load_decoder: Callable[[], tuple[Decoder | None, str]] | None = None):
        self.run = run
        self._decoder: tuple[Decoder | None, str] = (None, "token ids only")
        self._ready = threading.Event()
        self._lock = threading.Lock()
        self._trees: OrderedDict[int, bytes] = OrderedDict()
        # tree: (generation, its file's stamp, the ids-only answer) while the tokenizer loads
        self._pending: OrderedDict[int, tuple[int, Any, bytes]] = OrderedDict()
        self._index: dict[bool, bytes] = {}  # by whether the tokenizer was ready
        self.generation = 0  # bumped each time the run is indexed again
        self._reindex = threading.Lock()
        self._page = render_page().encode("utf-8")
        self._serving = False
        self.httpd = _BoundedServer((host, port), self._handler())  # first: a busy port loads nothing
        if load_decoder is None:
            self._ready.set()
        else:
            threading.Thread(target=self._load, args=(load_decoder,), daemon=True).start()
        self.loopback_only = _is_loopback(host)
        self._hosts = {*_LOOPBACK_NAMES, host}

    def _load(self, load: Callable[[], tuple[Decoder | None, str]]) -> None:
        try:
            self._decoder = load()
        except Exception as e:  # the page still works with ids; say why on it
            self._decoder = (None, f"tokenizer failed to load: {type(e).__name__}: {e}")
        finally:
            self._ready.set()

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://[{host}]:{port}/" if ":" in host else f"http://{host}:{port}/"

    def _refresh(self) -> None:
        """Index the run again if its files changed since it was indexed (a new generation)."""
        with self._reindex:
            if not self.run.changed():
                return
            try:
                run = self.run.reopen()  # reads only the files that changed
            except OSError:  # the run was moved or deleted: keep showing what was indexed
                return
            with self._lock:
                self.run, self.generation = run, self.generation + 1
                self._trees.clear()
                self._pending.clear()
                self._index.clear()

    def index_json(self) -> bytes:
        """The run index as it is on disk now; it needs the tokenizer's note only, so it never
        waits for the load."""
        self._refresh()
        ready = self._ready.is_set()
        with self._lock:
            run, generation, body = self.run, self.generation, self._index.get(ready)
        if body is None:
            index = run_index(run, self._decoder[1] if ready else _LOADING_NOTE)
            body = to_json({**index, "generation": generation}).encode("utf-8")
            with self._lock:
                if generation == self.generation:
                    self._index[ready] = body
        return body

    def tree_json(self, i: int, generation: int | None = None) -> bytes:
        """Tree ``i`` of the current index; ``RunChanged`` when ``generation`` (the page's) is
        not the current one (its ``i`` may now be another tree), ``_NoTree`` past the end."""
        with self._lock:
            run, current = self.run, self.generation
            if generation is not None and generation != current:
                raise RunChanged(f"the run changed on disk since this page was loaded: reload the page "
                                 f"(index {generation}, now {current})")
            if i in self._trees:
                self._trees.move_to_end(i)
                return self._trees[i]
        if i >= len(run):
            raise _NoTree(f"no tree {i}: the run holds {len(run)} trees")
        if not self._ready.wait(_TOKENIZER_WAIT_S):  # a load that hangs must not hang the tree
            return self._pending_json(run, i, current)
        self._pending.clear()  # the tokenizer is ready: no ids-only copy is asked for again
        decode, note = self._decoder
        body = to_json({**tree_data(run, i, decode), "tokens_pending": False, "tokens_note": note}).encode("utf-8")
        with self._lock:
            if current != self.generation or len(body) > _CACHED_BYTES:  # not this index's, or too big
                return body
            self._trees[i] = body
            held = sum(map(len, self._trees.values()))
            while len(self._trees) > _CACHED_TREES or held > _CACHED_BYTES:
                held -= len(self._trees.popitem(last=False)[1])
        return body

    def _pending_json(self, run: Run, i: int, generation: int) -> bytes:
        """Tree ``i`` with token ids only, marked pending (the page asks again until the
        tokenizer is ready). Kept while its file keeps its stamp, so that the page's asking
        again does not parse and build the tree each time; a changed file is read again
        (and ``Run.tree`` refuses it if tree ``i``'s line is not there any more)."""
        stamp = run.stamp_of(i)
        with self._lock:
            got = self._pending.get(i)
            if got is not None and got[:2] == (generation, stamp):
                self._pending.move_to_end(i)
                return got[2]
        pending = {**tree_data(run, i, None), "tokens_pending": True, "tokens_note": _LOADING_NOTE}
        body = to_json(pending).encode("utf-8")
        with self._lock:
            if generation == self.generation and len(body) <= _CACHED_BYTES and not self._ready.is_set():
                self._pending[i] = (generation, stamp, body)
                held = sum(len(b) for *_, b in self._pending.values())
                while len(self._pending) > _PENDING_TREES or held > _CACHED_BYTES:
                    held -= len(self._pending.popitem(last=False)[1][2])
        return body

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            timeout = _IDLE_SECONDS

            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                path, _, query = self.path.partition("?")
                asked = self.headers.get("Host")
                if server.loopback_only and asked is not None and _host_name(asked).lower() not in server._hosts:
                    self._error(403, f"this viewer answers requests to {server.url} only, not to host {asked!r} "
                                     "(behind a proxy that keeps its own name, serve it with --host)")
                    return
                try:
                    if path in ("/", "/index.html"):
                        self._send(200, server._page, "text/html; charset=utf-8")
                    elif path == "/api/run":
                        self._send(200, server.index_json(), "application/json")
                    elif path.startswith("/api/tree/") and "/" not in path[len("/api/tree/"):]:
                        tail = unquote(path[len("/api/tree/"):])
                        gens = parse_qs(query, keep_blank_values=True).get("generation")
                        gen = gens[-1] if gens else None
                        if not _plain_number(tail):
                            self._error(404, f"no tree {tail[:40]!r}: the run holds {len(server.run)} trees")
                        elif gen is not None and not _plain_number(gen):  # not the page's: say so, not ignore it
                            self._error(400, f"generation {gen[:40]!r} is not a number: give the 'generation' "
                                             "of the api/run answer the tree's index came from, or none")
                        else:
                            generation = int(gen) if gen is not None else None
                            self._send(200, server.tree_json(int(tail), generation), "application/json")
                    else:
                        self._error(404, f"nothing at {path}")
                except _NoTree as e:  # a tree number past the run's end
                    self._error(404, str(e))
                except RunChanged as e:  # the page's index is not the run's any more
                    self._error(409, str(e))
                except ConnectionError:  # the browser went away (a reload, the next tree): nobody to tell
                    self.close_connection = True
                except Exception as e:  # a tree this code cannot draw, a file changed under it: say so
                    self._error(500, f"{type(e).__name__}: {e}")

            def _error(self, code: int, message: str) -> None:
                self._send(code, json.dumps({"error": message}).encode(), "application/json")

            def _send(self, code: int, body: bytes, ctype: str) -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Cache-Control", "no-store")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:  # quiet: no line per request
                pass

        return Handler

    def serve_forever(self) -> None:
        self._serving = True
        self.httpd.serve_forever()

    def start(self) -> ViewerServer:
        """Serve in a daemon thread (tests, notebooks); ``close()`` stops it."""
        self._serving = True  # before the thread: a close() right after must still stop it
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    def close(self) -> None:
        """Stop serving (if it was) and close the socket."""
        if self._serving:  # shutdown() waits for serve_forever to end: for ever if it never ran
            self.httpd.shutdown()
        self.httpd.server_close()
