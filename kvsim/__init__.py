"""kvsim's own namespace for what has a generic name: the command line is ``kvsim.cli`` (``sim`` runs
``kvsim.cli:app``). ``kvsim/cli.py`` is a link to the checkout's ``cli.py``, so ``from cli import app`` in
a checkout and ``from kvsim.cli import app`` in an installed copy are the same code.

The simulator and its companions keep their import names: ``sim``, ``gpu``, ``traces``, ``reports``
(see the README's Packaging section)."""
