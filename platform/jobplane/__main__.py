"""`python -m jobplane` is the `jobplane` command."""

from jobplane.cli import main

main()
