"""kvscope.commands: the commands whose code lives nowhere else (``serve``, ``demo``).

Every command of ``kvscope`` is a module with ``add_parser(subparsers)``, which adds its
subcommand and calls ``set_defaults(run=run)``, and ``run(args) -> int``, its exit status;
``kvscope.cli.COMMANDS`` lists them. A command that belongs to a package (``whatif``,
``loadgen``, ``layout dump``, ``query``, ``schema``) keeps its module there.

It may import anything: it is the top layer, with ``kvscope.cli``.
"""
