"""`python -m decoderlm ...` is the `decoderlm` command."""

from .cli import main

raise SystemExit(main())
