"""``python -m resq``: the same as the ``resq`` command."""

from resq.cli import main

main()
