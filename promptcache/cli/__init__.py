"""The command line: ``promptcache serve | bench | replay | cache | models`` (``main``; the console
script is ``promptcache.cli.main:main``, ``python -m promptcache.cli`` the same). The top of the
layers: each subcommand's module is imported only when it runs."""
