"""`python -m decoderlm ...` is the `decoderlm` command."""

try:
    from .cli import main
except KeyboardInterrupt:  # Ctrl-C while the command is still starting
    raise SystemExit(130) from None

raise SystemExit(main())
