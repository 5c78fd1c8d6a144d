"""``python -m agentrl``: the same CLI as the ``agentrl`` script, for an environment
where the package is importable but its console script was not installed (a
``PYTHONPATH`` checkout, a ``pip install --target`` folder)."""

from agentrl.cli import main

if __name__ == "__main__":
    main()
