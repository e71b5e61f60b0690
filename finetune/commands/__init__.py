"""The verbs of the ``finetune`` command, one module each: ``train``, ``export``, ``plan``, ``doctor``, ``report``.

Each module has ``main(argv) -> int`` (the process exit status); :mod:`finetune.cli` only dispatches to them.
"""
