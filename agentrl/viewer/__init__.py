"""The run viewer: ``agentrl view RUN_DIR_OR_TREES_JSONL`` in a browser.

What the page shows: the run's tasks and their groups (reward, success, turns,
failure reasons; sortable and filterable), one rollout tree drawn as a tree
(each node's action, observation, tool calls and results, reward and
advantage; branch points with the allocator's reason; failed and truncated
paths with theirs), the token view of one turn (tokens coloured by loss mask,
behaviour logprob, entropy, advantage or the teacher-student log-ratio, with
each token's numbers on hover), the run's curves from ``metrics.jsonl``, and two
steps of one task side by side.

Modules, one job each:

- ``run``: a run on disk; trees indexed by byte offset and parsed on demand;
- ``payload``: one tree as the page's data (advantages, branch reasons, tokens);
- ``curves``: which metrics make which curve (shared with ``agentrl report``);
- ``tokens``: token ids to text, with the run's tokenizer;
- ``page``: the HTML page, with the data inside (``--static``) or fetched;
- ``server``: the local server (standard library ``http.server``);
- ``report``: ``agentrl report``'s Markdown report and its plots;
- ``cli``: ``agentrl view`` and ``agentrl report``.

Why no front-end library. The page draws a tree (a tidy layout is about 20
lines: leaves in rows, a parent centred on its children), line charts and
coloured token spans. A charting or graph library (d3 is about 280 kB
minified, Plotly about 3.5 MB) would have to be vendored into the package,
since nothing may be fetched from the network at view time, and then kept
up to date and audited for a few hundred lines of use. Plain DOM and SVG
(``static/viewer.js``, about 600 lines, no build step) do the same, render
untrusted model output only through ``textContent``, and keep a static page
one file. Thousands of trees stay fast because the page holds only the
table's rows (paged, 50 at a time) and parses or fetches a tree when it is
opened.
"""

from .page import render_page, run_index, tree_data, write_static
from .payload import CreditSpec, branch_reasons, credit_spec, episode_values, tree_payload
from .run import Run, TreeRef, TreeSummary, open_run
from .server import ViewerServer

__all__ = [
    "CreditSpec",
    "Run",
    "TreeRef",
    "TreeSummary",
    "ViewerServer",
    "branch_reasons",
    "credit_spec",
    "episode_values",
    "open_run",
    "render_page",
    "run_index",
    "tree_data",
    "tree_payload",
    "write_static",
]
