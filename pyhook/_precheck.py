"""The ``pyhook`` command's arguments, checked before ``pyhook/__init__`` imports torch.

Only when the process is the command (``pyhook ...`` or ``python -m pyhook``, see
:func:`pyhook._startup.launched_as_command`): a mistyped flag, a value out of range, options that
contradict each other or a bad ``--config`` file exit here with status 2 and one line (``--help``
with 0), in milliseconds instead of after torch's import. :mod:`pyhook.cli` and the capture job
(:mod:`pyhook.pipeline.job`) import no torch at import time; importing pyhook from any other
program does nothing here.
"""

from __future__ import annotations

from ._startup import launched_as_command

if launched_as_command():
    from .cli import check_command_line

    check_command_line()
