"""``python -m tierstore.cli`` is the ``tierstore`` command."""

from tierstore.cli import main

raise SystemExit(main())
